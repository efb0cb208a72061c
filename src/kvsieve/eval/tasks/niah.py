"""RULER's needle-in-a-haystack family (``niah_*``), with RULER's names, templates and counts.

| task | haystack | key | value | needles |
|---|---|---|---|---|
| niah_single_1 | repeated noise sentences | word | 7-digit number | 1 |
| niah_single_2 | Paul Graham essays | word | 7-digit number | 1 |
| niah_single_3 | Paul Graham essays | word | UUID | 1 |
| niah_multikey_1 | essays | word | number | 4 keys, 1 asked |
| niah_multikey_2 | other needles | word | number | 1 asked among the haystack's needles |
| niah_multikey_3 | other needles | UUID | UUID | 1 asked among the haystack's needles |
| niah_multivalue | essays | word | number | 1 key with 4 values |
| niah_multiquery | essays | word | number | 4 keys, all 4 asked |

Needle depths are drawn from RULER's 40-point grid over [0, 1] (one per needle, without
replacement) unless ``depth`` is given. Scoring: ``string_match_all`` over the asked values.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .base import (
    PromptParts,
    Sample,
    build_prompt,
    essay_word_tokens,
    essay_words,
    fit_length,
    insert_at_depths,
    noise_units,
    random_key_word,
    random_number,
    random_uuid,
    sample_rng,
    template_parts,
)

TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
MAX_NEW_TOKENS = 128
DEPTH_GRID = tuple(i / 39 for i in range(40))


@dataclass(frozen=True)
class NiahConfig:
    haystack: str  # "essay" | "noise" | "needle"
    key_type: str  # "words" | "uuids"
    value_type: str  # "numbers" | "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


CONFIGS = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_keys=4, num_queries=4),
}


def _make(kind: str, rng: random.Random, taken: set[str]) -> str:
    if kind == "words":
        return random_key_word(rng, taken)
    if kind == "numbers":
        return random_number(rng, taken)
    return random_uuid(rng, taken)


def make_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0,
                depth: float | None = None) -> Sample:
    cfg = CONFIGS[task]
    rng = sample_rng(seed, task, length, index)
    taken: set[str] = set()
    keys = [_make(cfg.key_type, rng, taken) for _ in range(max(cfg.num_keys, cfg.num_queries))]
    values = [[_make(cfg.value_type, rng, taken) for _ in range(cfg.num_values)] for _ in keys]
    needles = [NEEDLE.format(type_v=cfg.value_type, key=k, value=v)
               for k, vs in zip(keys, values, strict=True) for v in vs]
    if depth is not None:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth: expected a fraction in [0, 1], got {depth}")
        depths = [depth] * len(needles)
    else:
        depths = rng.sample(DEPTH_GRID, len(needles))
    asked = rng.sample(range(len(keys)), cfg.num_queries) if cfg.num_queries < len(keys) else list(range(len(keys)))
    asked_keys = [keys[i] for i in asked]
    query = asked_keys[0] if len(asked_keys) == 1 else ", ".join(asked_keys[:-1]) + ", and " + asked_keys[-1]
    gold = tuple(v for i in asked for v in values[i])

    if cfg.haystack == "essay":
        pool = essay_words()
        pool_tokens = essay_word_tokens(tokenizer)
        # Start at a sentence start so that each sample reads like a text, not a fragment.
        offset = rng.randrange(len(pool))
        while offset > 0 and not pool[offset - 1].endswith((".", "!", "?")):
            offset -= 1
        upper = min(len(pool), length)

        def units(n: int) -> tuple[list[str], list[int]]:
            idx = [(offset + j) % len(pool) for j in range(n)]
            return [pool[i] for i in idx], [pool_tokens[i] for i in idx]

        joiner = " "
    elif cfg.haystack == "noise":
        upper = length

        def units(n: int) -> tuple[list[str], list[int]]:
            return noise_units(tokenizer, n)

        joiner = " "
    else:
        upper = max(1, length // 8)
        distractors = [
            NEEDLE.format(type_v=cfg.value_type, key=_make(cfg.key_type, rng, taken),
                          value=_make(cfg.value_type, rng, taken))
            for _ in range(upper)
        ]
        d_tokens = [len(i) for i in tokenizer(["\n" + d for d in distractors], add_special_tokens=False)["input_ids"]]

        def units(n: int) -> tuple[list[str], list[int]]:
            return distractors[:n], d_tokens[:n]

        joiner = "\n"

    fmt = {"type_v": cfg.value_type, "query": query}
    answer_prefix = ANSWER_PREFIX.format(**fmt)

    def build(n: int, partial_chars: int = 0) -> PromptParts:
        texts, counts = units(n)
        context = joiner.join(insert_at_depths(texts, counts, needles, depths,
                                               sentence_boundaries=cfg.haystack != "needle"))
        if partial_chars:
            # Whole distractor needles are too coarse to meet the length within 2% at short lengths;
            # the haystack ends with the start of the next one (its value cut off).
            context += joiner + units(n + 1)[0][-1][:partial_chars]
        head, tail = template_parts(TEMPLATE, context, **fmt)
        return build_prompt(tokenizer, head, tail, answer_prefix)

    if cfg.haystack == "needle":
        n_units, parts = fit_length(build, length, upper - 1, task, check=False)
        if parts.n_tokens < length:
            _, parts = fit_length(lambda m: build(n_units, m), length, len(units(n_units + 1)[0][-1]) - 1, task)
    else:
        n_units, parts = fit_length(build, length, upper, task)
    return Sample(
        task=task,
        index=index,
        length=length,
        **parts.sample_fields(),
        answer_prefix=answer_prefix,
        gold=gold,
        target=" " + ", ".join(gold) + ".",
        max_new_tokens=MAX_NEW_TOKENS,
        metric="all",
        info={"needles": needles, "depths": list(depths), "haystack_units": n_units, "query": query},
    )
