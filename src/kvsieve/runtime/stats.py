"""What a decode-runtime run reports: timings, the paths that ran and the method's stats."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..driver import StatsLog


@dataclass
class RuntimeStats:
    """What a run did; ``records`` holds the method's per-(layer, step) stats of eager steps (a captured
    step reads none), from the driver's :class:`~kvsieve.driver.StatsLog` (``log``)."""

    method: str
    attention_backend: str
    graph: bool
    graph_reason: str | None
    batch: int
    prompt_lengths: list[int]
    capacity: int
    cache_bytes: int
    fallbacks: list[str] = field(default_factory=list)
    compiled_ops: bool = False
    # with compiled_ops: each layer's q/k/v and gate/up as one product ({"groups": n, "refused": {group: why}})
    fused_projections: dict[str, Any] | None = None
    # the decode steps' K/V cache write: "scatter" (two eager scatter_ per layer) or, with compiled_ops,
    # "compiled" (K and V in one compiled kernel per layer: runtime/compiled.py)
    cache_write: str = "scatter"
    capture_s: float = 0.0  # warm-up steps, torch.compile and the CUDA-graph capture, once per request
    new_tokens: list[int] = field(default_factory=list)
    decode_steps: int = 0
    host_checks: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # which prefill ran: "exact" (SDPA on every layer) or "sparse" (prefill_method on prefill_sparse_layers,
    # SDPA on the others); prefill_records: the method's stats per (row, layer) of the last prefill
    prefill: str = "exact"
    prefill_method: str | None = None
    prefill_sparse_layers: list[int] = field(default_factory=list)
    prefill_records: list[dict[str, Any]] = field(default_factory=list)
    # layers the decode steps serve with the runtime's dense decode: the runtime's dense_layers and the
    # layers the method keeps exact (sketchwalk's dense_layers); the method runs (and records) on the others
    dense_decode_layers: list[int] = field(default_factory=list)
    # a tensor-parallel run (runtime/parallel.py): ranks, this rank's heads, the plan, what sharding changed
    tp: dict[str, Any] | None = None
    # the layers the decode method served (none for dense); sliding-window layers whose window binds
    # (window_layers, sliding_window keys) run exact window attention and are never among them
    method_decode_layers: list[int] = field(default_factory=list)
    sliding_window: int | None = None
    window_layers: list[int] = field(default_factory=list)
    log: StatsLog = field(default_factory=StatsLog, repr=False, compare=False)

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.log.records

    @property
    def ms_per_step(self) -> float:
        """Decode time per step, the one-time graph capture (and compilation) left out (``capture_s``)."""
        return 1e3 * (self.decode_s - self.capture_s) / self.decode_steps if self.decode_steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.decode_steps / self.decode_s if self.decode_s else float("nan")

    @property
    def backends(self) -> set[str]:
        return self.log.backends or {self.attention_backend}

    def layer_summary(self) -> dict[int, dict[str, float]]:
        """Per layer: calls, mean density, kv_density, V rows read, n_keys and bytes over the method's calls."""
        return self.log.layer_summary()

    def mean(self, key: str) -> float:
        """Mean of one record field over every method call (NaN when none ran)."""
        return self.log.mean(key)

    def prefill_mean(self, key: str) -> float:
        """Mean of one field over the sparse prefill's (row, layer) calls (NaN after an exact prefill):
        ``block_density`` (kept key blocks / causal blocks), ``density`` (keys read / causal pairs), ..."""
        values = [r[key] for r in self.prefill_records if key in r]
        return sum(values) / len(values) if values else float("nan")

    @property
    def prefill_block_density(self) -> float:
        """Realised block density of the sparse prefill, averaged over its layers (and rows)."""
        return self.prefill_mean("block_density")

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
             if f.name not in ("log", "prefill_records")}
        d.update(ms_per_step=self.ms_per_step, tokens_per_s=self.tokens_per_s, backends=sorted(self.backends),
                 method_calls=len(self.log), prefill_block_density=self.prefill_block_density,
                 prefill_density=self.prefill_mean("density"),
                 prefill_backends=sorted({r["backend"] for r in self.prefill_records}))
        return d


@dataclass
class GenerateResult:
    """``tokens [B, T]``: the new tokens of each row (``pad_token_id`` after a row's EOS); ``stats``."""

    tokens: torch.Tensor
    stats: RuntimeStats
