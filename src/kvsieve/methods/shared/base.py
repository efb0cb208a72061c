"""What every selection method shares: sink + window config, the selected index set, and the decode.

A selection method builds one weighted :class:`~kvsieve.methods.shared.selection.IndexSet` per step
(sink + local window + its own stage) and runs the weighted sparse decode of
:mod:`kvsieve.kernels.shared.weighted` on it. ``streaming``, ``oracle-topk``, ``oracle-topp``,
``random``, ``quest``, ``magicpig`` and ``vattention`` are built on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.config import MethodConfig, param, require_int
from ...core.inputs import DecodeInputs
from ...core.method import Method, read_stats
from ...core.rng import RandomKey, RowStreams, as_generator
from ...core.stats import StepStats
from ...kernels.shared.weighted import weighted_sparse_decode
from .exact import compute_dtype
from .selection import (
    Draws,
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

    def select(self, inputs: DecodeInputs, gen: Draws | None, state: dict[str, Any]) -> Selected:
        """The call's index set. ``gen``: the row streams of the call (or a generator for methods with
        ``random_keys = False``); draw through ``selection.uniforms`` / ``uniform_sample``."""
        raise NotImplementedError

    def exact_below(self) -> int:
        return int(getattr(self.config, "sink", 0)) + int(getattr(self.config, "window", 0))

    def selection_heads(self, inputs: DecodeInputs) -> int:
        return inputs.kv_heads if getattr(self.config, "share_kv_group", False) else inputs.heads

    def row_streams(self, inputs: DecodeInputs, seed) -> Draws | None:
        """The draws ``select`` gets: row streams from a key, a generator for generator-API methods."""
        if not self.stochastic:
            return None
        if self.random_keys and isinstance(seed, RandomKey):
            return RowStreams(seed, inputs.batch_row(), inputs.n_valid)
        return as_generator(seed, inputs.q.device)

    def _decode(self, inputs, seed, state):
        sel = self.select(inputs, self.row_streams(inputs, seed), state)
        chosen = sel.chosen
        if inputs.checked and int(chosen.counts.min()) < 1:
            raise ValueError(f"{self.name}: the configuration selected no key for some head; "
                             "give sink, window or a budget > 0")
        out, lse = weighted_sparse_decode(inputs.q, inputs.k, inputs.v, chosen.indices, chosen.counts,
                                          chosen.weights, scale=inputs.scale, check=False)
        return out.to(compute_dtype(inputs)), selection_stats(inputs, sel)


def selection_stats(inputs: DecodeInputs, sel: Selected, backend: str = "reference") -> StepStats:
    """The stats of a selection: V rows of ``chosen`` and ``v_extra`` read, K rows of ``chosen`` and
    ``scored`` scored (every valid key when ``scored`` is None). Shared by the reference decode and the
    kernel paths that run the same selection (:mod:`kvsieve.methods.shared.staged`)."""
    chosen = sel.chosen
    k_scored = None if sel.scored is None else kv_union_count(inputs, chosen, *sel.scored)
    v_read = v_read_mask(inputs, chosen)
    for s in sel.v_extra:
        v_read = v_read | v_read_mask(inputs, s)
    return read_stats(inputs, v_read, k_scored=k_scored, backend=backend,
                      exact_rows=exact_row_count(inputs, chosen), extra=sel.extra)


def fixed_part(method: SelectionMethod, inputs: DecodeInputs) -> tuple[IndexSet, torch.Tensor]:
    """Sink + window for the method's selection heads, and the keys still available after them."""
    fixed = sink_and_window(inputs, method.config.sink, method.config.window, method.selection_heads(inputs))
    return fixed, available_after(inputs, fixed)


def ranking_scores(inputs: DecodeInputs, heads: int) -> torch.Tensor:
    """Exact scaled scores for ranking, per selection head (GQA groups: summed softmax mass)."""
    s = inputs.scores(compute_dtype(inputs))
    return s if heads == inputs.heads else group_scores(s, inputs.group)
