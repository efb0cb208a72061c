"""Baselines on the weighted sparse decode contract: ``streaming``, ``oracle-topk``, ``oracle-topp``, ``random``.

Each is sink + local window (128 + 128 by default, as every method in the vAttention paper) plus one
stage of :mod:`kvsieve.methods.selection`, executed by
:func:`kvsieve.kernels.weighted_sparse.weighted_sparse_decode`. ``quest`` and ``magicpig`` live in
their own modules; ``vattention`` in ``vattention.py``. See ``docs/methods/baselines.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..core.config import MethodConfig, param, require_fraction, require_int
from ..core.inputs import DecodeInputs
from ..core.method import Method, read_stats
from ..core.registry import register_method
from ..core.rng import as_generator
from ..kernels.weighted_sparse import weighted_sparse_decode
from .common import compute_dtype
from .selection import (
    IndexSet,
    available_after,
    exact_row_count,
    group_scores,
    kv_union_count,
    require_size,
    resolve_size,
    sink_and_window,
    top_k,
    top_p,
    uniform_sample,
    union,
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


@register_method
class Streaming(SelectionMethod):
    name = "streaming"
    config_class = SinkWindowConfig
    summary = "StreamingLLM: attention sinks + local window only"

    def select(self, inputs, gen, state):
        fixed, _ = fixed_part(self, inputs)
        return Selected(fixed)


@dataclass(frozen=True)
class OracleTopKConfig(SinkWindowConfig):
    top_k: int | float = param(0.05, "heavy hitters beyond sink+window: a count, or a fraction of the context")
    share_kv_group: bool = param(False, "one selection per KV head shared by its query heads (by summed softmax mass)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("top_k", self.top_k)


@register_method
class OracleTopK(SelectionMethod):
    name = "oracle-topk"
    config_class = OracleTopKConfig
    summary = "sink + window + exact top-k of q·k over the rest (deterministic, renormalised)"

    def select(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        heads = fixed.heads
        k = resolve_size(self.config.top_k, inputs.n_valid)
        chosen = union(fixed, top_k(ranking_scores(inputs, heads), available, k))
        return Selected(chosen, scored=None)


@dataclass(frozen=True)
class OracleTopPConfig(SinkWindowConfig):
    top_p: float = param(0.9, "attention mass to cover, in (0, 1]")
    mass: Literal["total", "residual"] = param(
        "total", "'total': sink+window mass counts toward top_p (smallest set of the whole "
                      "softmax); 'residual': top_p of the mass left after sink+window (sparse-attention-hub)")
    share_kv_group: bool = param(False, "one selection per KV head shared by its query heads (summed mass)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_fraction("top_p", self.top_p, high_open=False)
        if self.mass not in ("total", "residual"):
            raise ValueError(f"mass: expected one of total, residual, got {self.mass!r}")


@register_method
class OracleTopP(SelectionMethod):
    name = "oracle-topp"
    config_class = OracleTopPConfig
    summary = "sink + window + the fewest highest-probability keys reaching attention mass p"

    def select(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        heads = fixed.heads
        probs = torch.softmax(inputs.scores(torch.float64), dim=-1)
        if heads != inputs.heads:
            b = inputs.batch
            probs = probs.view(b, heads, inputs.group, -1).sum(2) / inputs.group
        rest = (probs * available).sum(-1)
        p = self.config.top_p
        if self.config.mass == "total":
            target = torch.clamp(p - (1.0 - rest), min=0.0)  # mass still missing after sink+window
        else:
            target = p * rest
        chosen = union(fixed, top_p(probs, available, target))
        return Selected(chosen, scored=None)


@dataclass(frozen=True)
class RandomConfig(SinkWindowConfig):
    budget: int | float = param(0.05, "keys sampled uniformly from the rest: a count, or a fraction of the context")
    replacement: bool = param(False, "draw with replacement (sparse-attention-hub); the paper samples without")
    share_kv_group: bool = param(False, "one sample per KV head shared by its query heads")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("budget", self.budget)


@register_method
class RandomSample(SelectionMethod):
    name = "random"
    config_class = RandomConfig
    summary = "sink + window + uniform sample of the rest, weighted by n_rest / b (unbiased sums)"
    stochastic = True

    def select(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        size = resolve_size(self.config.budget, inputs.n_valid)[:, None].expand(inputs.batch, fixed.heads)
        n_av = available.sum(-1)
        if self.config.replacement:
            # Sampling all of the rest with replacement would not be exact: cover it instead.
            size = torch.where(size >= n_av, n_av, size)
            full = size >= n_av
            sample = uniform_sample(available, torch.where(full, 0, size), gen, replacement=True)
            rest = uniform_sample(available & full[..., None], torch.where(full, n_av, 0), gen)
            chosen = union(fixed, union(sample, rest))
        else:
            chosen = union(fixed, uniform_sample(available, size, gen))
        return Selected(chosen)
