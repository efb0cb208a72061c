"""What every selection method shares: sink + window config, the selected index set, and the decode.

A selection method builds one weighted :class:`~kvsieve.methods.shared.selection.IndexSet` per step
(sink + local window + its own stage) and runs the weighted sparse decode of
:mod:`kvsieve.kernels.sparse.weighted` on it. ``streaming``, ``oracle-topk``, ``oracle-topp``,
``random``, ``quest``, ``magicpig`` and ``vattention`` are built on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.config import MethodConfig, param, require_int
from ...core.inputs import DecodeInputs
from ...core.method import Method, read_stats
from ...core.rng import as_generator
from ...kernels.sparse.weighted import weighted_sparse_decode
from .exact import compute_dtype
from .selection import (
    IndexSet,
    available_after,
    exact_row_count,
    group_scores,
    kv_union_count,
    sink_and_window,
    v_read_mask,
)


@dataclass(frozen=True)
class SinkWindowConfig(MethodConfig):
    sink: int = param(128, "first valid keys always attended (attention sinks)")
    window: int = param(128, "last valid keys always attended (local window)")

    def __post_init__(self) -> None:
        require_int("sink", self.sink, minimum=0)
        require_int("window", self.window, minimum=0)


@dataclass
class Selected:
    """What a selection step returns.

    ``chosen``: the weighted index set the estimate runs on. ``scored``: None when every valid key
    was scored, else further sets whose K rows were scored besides ``chosen`` (a base sample, ...).
    ``v_extra``: further sets whose V rows were read (not part of the estimate). ``extra``: stats.
    """

    chosen: IndexSet
    scored: list[IndexSet] | None = field(default_factory=list)
    v_extra: list[IndexSet] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class SelectionMethod(Method):
    """A method that builds one :class:`IndexSet` per step and runs the weighted sparse decode."""

    def select(self, inputs: DecodeInputs, gen: torch.Generator | None, state: dict[str, Any]) -> Selected:
        raise NotImplementedError

    def selection_heads(self, inputs: DecodeInputs) -> int:
        return inputs.kv_heads if getattr(self.config, "share_kv_group", False) else inputs.heads

    def _decode(self, inputs, seed, state):
        gen = as_generator(seed, inputs.q.device) if self.stochastic else None
        sel = self.select(inputs, gen, state)
        chosen = sel.chosen
        if int(chosen.counts.min()) < 1:
            raise ValueError(f"{self.name}: the configuration selected no key for some head; "
                             "give sink, window or a budget > 0")
        out, lse = weighted_sparse_decode(inputs.q, inputs.k, inputs.v, chosen.indices, chosen.counts,
                                          chosen.weights, scale=inputs.scale, check=False)
        k_scored = None if sel.scored is None else kv_union_count(inputs, chosen, *sel.scored)
        v_read = v_read_mask(inputs, chosen)
        for s in sel.v_extra:
            v_read = v_read | v_read_mask(inputs, s)
        stats = read_stats(inputs, v_read, k_scored=k_scored,
                           exact_rows=exact_row_count(inputs, chosen), extra=sel.extra)
        return out.to(compute_dtype(inputs)), stats


def fixed_part(method: SelectionMethod, inputs: DecodeInputs) -> tuple[IndexSet, torch.Tensor]:
    """Sink + window for the method's selection heads, and the keys still available after them."""
    fixed = sink_and_window(inputs, method.config.sink, method.config.window, method.selection_heads(inputs))
    return fixed, available_after(inputs, fixed)


def ranking_scores(inputs: DecodeInputs, heads: int) -> torch.Tensor:
    """Exact scaled scores for ranking, per selection head (GQA groups: summed softmax mass)."""
    s = inputs.scores(compute_dtype(inputs))
    return s if heads == inputs.heads else group_scores(s, inputs.group)
