"""The README's demo: a number hidden in the Paul Graham essays, asked for at the end."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .assets import essay_texts

NEEDLE = "The special magic number mentioned in this text is {number}."
QUESTION = "What is the special magic number mentioned in the text above? Answer with the number only."
ANSWER_PREFIX = "The special magic number mentioned in the text is"


@dataclass
class NeedlePrompt:
    input_ids: torch.Tensor  # [1, L]
    answer: str
    depth: float
    n_tokens: int
    question_start: int  # index in input_ids where the question begins


def needle_prompt(tokenizer, n_tokens: int = 4000, depth: float = 0.5, seed: int = 0) -> NeedlePrompt:
    """A chat prompt of about ``n_tokens`` tokens: essays with a 7-digit number at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a value in [0, 1], got {depth}")
    rng = random.Random(seed)
    number = str(rng.randint(1_000_000, 9_999_999))
    haystack_ids = tokenizer("\n\n".join(essay_texts()), add_special_tokens=False)["input_ids"]
    needle = " " + NEEDLE.format(number=number) + " "

    def build(n_hay: int) -> tuple[list[int], int]:
        cut = int(n_hay * depth)
        before = tokenizer.decode(haystack_ids[:cut])
        after = tokenizer.decode(haystack_ids[cut:n_hay])
        context = before + needle + after
        prefix = _chat(tokenizer, context, "")
        full = _chat(tokenizer, context, QUESTION) + ANSWER_PREFIX
        ids_prefix = tokenizer(prefix, add_special_tokens=False)["input_ids"]
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        return ids, _common_prefix(ids_prefix, ids)

    n_hay = max(16, n_tokens - 80)
    ids, q_start = build(n_hay)
    n_hay = max(16, n_hay - (len(ids) - n_tokens))  # one correction reaches the target within a few tokens
    ids, q_start = build(n_hay)
    return NeedlePrompt(torch.tensor([ids]), number, depth, len(ids), q_start)


def _chat(tokenizer, context: str, question: str) -> str:
    content = f"{context}\n\n{question}" if question else f"{context}\n\n"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=bool(question))
    return content + ("\n" if question else "")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
