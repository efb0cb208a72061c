"""Teacher-forced fidelity on real text (``tf_essay``): no question, no generation, no score.

The context is a stretch of the Paul Graham essays; the "question" is the next
``CONTINUATION_TOKENS`` tokens of the same text, teacher-forced. Under ``phase="question"`` the
continuation is processed by the method, and the runner compares its next-token distributions
with dense ones (KL, top-1 agreement): a model-agnostic fidelity measure.
"""

from __future__ import annotations

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
