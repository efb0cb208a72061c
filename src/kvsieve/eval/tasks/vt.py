"""RULER's variable tracking (``vt``): follow a chain ``VAR A = 12345``, ``VAR B = VAR A``, ...

One chain of 4 hops (5 variables) hidden in repeated noise sentences, the statements placed at
sorted random depths. The answer is every variable holding the value; scoring ``string_match_all``.
RULER also prepends a one-shot example; kvsieve does not (the context is all haystack).
"""

from __future__ import annotations

import string
from typing import Any

from .base import (
    PromptParts,
    Sample,
    build_prompt,
    fit_length,
    insert_at_depths,
    noise_units,
    sample_rng,
    template_parts,
)

TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# "assgined" is RULER's spelling; kept so prompts match RULER's.
ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are: "
)
MAX_NEW_TOKENS = 30
NUM_HOPS = 4


def make_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0) -> Sample:
    rng = sample_rng(seed, task, length, index)
    names: list[str] = []
    while len(names) < NUM_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(NUM_HOPS)]
    depths = sorted(rng.random() for _ in statements)
    fmt = {"query": value, "num_v": NUM_HOPS + 1}
    answer_prefix = ANSWER_PREFIX.format(**fmt)

    def build(n: int) -> PromptParts:
        texts, counts = noise_units(tokenizer, n)
        context = " ".join(insert_at_depths(texts, counts, statements, depths))
        head, tail = template_parts(TEMPLATE, context, **fmt)
        return build_prompt(tokenizer, head, tail, answer_prefix)

    n_units, parts = fit_length(build, length, length, task)
    return Sample(
        task=task, index=index, length=length,
        **parts.sample_fields(), answer_prefix=answer_prefix,
        gold=tuple(names), target=" ".join(names), max_new_tokens=MAX_NEW_TOKENS, metric="all",
        info={"statements": statements, "depths": depths, "haystack_units": n_units},
    )
