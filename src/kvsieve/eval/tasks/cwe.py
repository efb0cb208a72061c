"""RULER's common words extraction (``cwe``): a numbered word list; name the 10 most common words.

10 common words appear ``freq_common`` times each, the other words 3 times each, shuffled, as
``1. word 2. word ...``. RULER uses 30 repeats; below ~4k tokens 300 common entries would crowd
out the rare words, so kvsieve lowers the repeats to keep the common entries at most ~40% of the
list (never below 6, twice the rare count). Words come from the essays' vocabulary (RULER:
``wonderwords``); no one-shot example. Scoring ``string_match_all`` over the 10 words.
"""

from __future__ import annotations

from typing import Any

from .base import PromptParts, Sample, build_prompt, essay_vocabulary, fit_length, sample_rng, template_parts

TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
MAX_NEW_TOKENS = 120
NUM_COMMON = 10
FREQ_COMMON = 30
FREQ_RARE = 3
TOKENS_PER_ENTRY = 5  # rough size of "123. word " for choosing the repeat count only


def make_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0) -> Sample:
    rng = sample_rng(seed, task, length, index)
    entries_est = max(1, length // TOKENS_PER_ENTRY)
    freq_common = max(2 * FREQ_RARE, min(FREQ_COMMON, int(0.4 * entries_est / NUM_COMMON)))
    max_rare = max(1, entries_est // FREQ_RARE)
    words = rng.sample(essay_vocabulary(), NUM_COMMON + max_rare)
    common, rare_pool = words[:NUM_COMMON], words[NUM_COMMON:]
    order_seed = rng.getrandbits(64)
    answer_prefix = ANSWER_PREFIX

    def build(n: int) -> PromptParts:
        import random

        items = common * freq_common + rare_pool[:n] * FREQ_RARE
        random.Random(order_seed).shuffle(items)
        context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        head, tail = template_parts(TEMPLATE, context)
        return build_prompt(tokenizer, head, tail, answer_prefix)

    n_rare, parts = fit_length(build, length, max_rare, task)
    return Sample(
        task=task, index=index, length=length,
        **parts.sample_fields(), answer_prefix=answer_prefix,
        gold=tuple(common), target=" " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common)),
        max_new_tokens=MAX_NEW_TOKENS, metric="all",
        info={"freq_common": freq_common, "freq_rare": FREQ_RARE, "n_rare": n_rare},
    )
