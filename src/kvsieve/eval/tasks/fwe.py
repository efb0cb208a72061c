"""RULER's frequent words extraction (``fwe``): coded words drawn from a zeta law; name the top 3.

Vocabulary: ``length // 50`` random 6-letter words; the word of rank k appears
``floor(n · k^-α / ζ(α))`` times (α = 2), rank 1 is the noise word ``...`` and the answers are
ranks 2-4, as in RULER. The total count n is fitted to the length. Scoring ``string_match_all``.
"""

from __future__ import annotations

import math
import random
import string
from typing import Any

from .base import PromptParts, Sample, build_prompt, fit_length, sample_rng, template_parts

TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
MAX_NEW_TOKENS = 50
ALPHA = 2.0
WORD_LEN = 6


def _zeta(alpha: float, terms: int = 100000) -> float:
    # Tail bound of the integral keeps the error below 1e-9 for alpha = 2.
    return sum(k**-alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1)


def make_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0) -> Sample:
    rng = sample_rng(seed, task, length, index)
    vocab_size = max(10, length // 50)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=WORD_LEN)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."
    zeta = _zeta(ALPHA)
    order_seed = rng.getrandbits(64)

    def build(n: int) -> PromptParts:
        items = [w for k, w in enumerate(words, start=1) for _ in range(int(n * k**-ALPHA / zeta))]
        random.Random(order_seed).shuffle(items)
        head, tail = template_parts(TEMPLATE, " ".join(items))
        return build_prompt(tokenizer, head, tail, ANSWER_PREFIX)

    n_words, parts = fit_length(build, length, 2 * length, task)
    counts = [int(n_words * k**-ALPHA / zeta) for k in range(1, 5)]
    if not (counts[1] > counts[2] > counts[3] > 0):
        raise ValueError(f"length: {length} tokens is too short for fwe to have a strict top 3 (counts {counts})")
    gold = tuple(words[1:4])
    return Sample(
        task=task, index=index, length=length,
        **parts.sample_fields(), answer_prefix=ANSWER_PREFIX,
        gold=gold, target=" " + ", ".join(gold) + ".", max_new_tokens=MAX_NEW_TOKENS, metric="all",
        info={"n_words": n_words, "top_counts": counts[1:], "vocab_size": vocab_size,
              "zeta": math.pi**2 / 6 if ALPHA == 2.0 else zeta},
    )
