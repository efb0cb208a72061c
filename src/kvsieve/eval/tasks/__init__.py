"""Task registry: RULER-style tasks generated locally from real text, seeded, at any length.

``make_sample(task, tokenizer, length, index, seed)`` is deterministic in its arguments and
independent of other samples, so a resumed run regenerates exactly the same prompts.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from . import cwe, fwe, niah, qa, tf, vt
from .base import Sample

_GENERATORS: dict[str, Callable[..., Sample]] = {
    **{name: niah.make_sample for name in niah.CONFIGS},
    "vt": vt.make_sample,
    "cwe": cwe.make_sample,
    "fwe": fwe.make_sample,
    "qa_1": qa.make_sample,
    "tf_essay": tf.make_sample,
    "tf_gsm8k": tf.make_gsm8k_sample,
}

__all__ = ["Sample", "make_sample", "task_names", "check_task"]


def task_names() -> list[str]:
    return list(_GENERATORS)


def check_task(name: str) -> str:
    if name not in _GENERATORS:
        close = difflib.get_close_matches(name, list(_GENERATORS), n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"task: unknown task {name!r}.{hint} Valid tasks: {', '.join(_GENERATORS)}")
    return name


def make_sample(task: str, tokenizer: Any, length: int, index: int, seed: int = 0, **kwargs: Any) -> Sample:
    """Sample ``index`` of ``task`` with a prompt of ``length`` tokens (within 2%, never more)."""
    check_task(task)
    if not isinstance(length, int) or length < 64:
        raise ValueError(f"length: expected an integer of at least 64 tokens, got {length!r}")
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"index: expected a non-negative integer, got {index!r}")
    return _GENERATORS[task](task, tokenizer, length, index, seed, **kwargs)
