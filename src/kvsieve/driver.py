"""The layer driver: how one method is served in the attention layers of one model, whoever runs the model.

``kvsieve.sparsify`` (transformers' own forward and cache), the decode runtime (a cache kvsieve owns,
the step captured in a CUDA graph) and the evaluation harness (through ``sparsify``, or the runtime for
setup A on CUDA) plumb the model;
this module is the one place that knows how a method is served there. Per request and layer it owns

- the method's typed state (``Method.new_state()``), made on first use, dropped when a request ends
  or kept across a rewind when it records the prompt (``observes_prefill``);
- the state shared by the layers of one forward pass (``Method.new_forward_state()``, for
  ``cross_layer`` methods), made anew per forward;
- the seed keys: ``(seed, request, layer)``, to which each query row adds its batch row and position;
- the prefill hooks: the method's sparse prefill, or its observation of a prefill it does not serve,
  batch rows stacked when the caller prefills them one at a time;
- the stats of every call (:class:`StatsLog`), device tensors until read.

What a method needs is read from its declarations (``sparse_prefill``, ``observes_prefill``,
``cross_layer``, ``graph_capturable``, ``multi_row``, ``prefix_only_note``, ``needs_fit``); nothing
here or above asks what class a method is.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .core.context import CallContext, ForwardState, MethodState
from .core.method import Method, merge_stats
from .core.registry import method as build_method
from .core.rng import RandomKey
from .core.stats import StepStats

#: Row-weighted means that ``StatsLog.layer_summary`` reports per layer.
SUMMED = ("density", "kv_density", "v_rows_read", "n_keys")


@dataclass
class _LayerTotals:
    calls: int = 0
    rows: int = 0
    sums: dict[str, Any] = field(default_factory=dict)
    bytes_read: Any = 0.0
    error_sum: Any = 0.0
    error_rows: int = 0


class StatsLog:
    """The stats of a method's calls: ``records`` (one dict per call), ``layer_summary()``, ``mean()``,
    ``backends``. Sums stay device tensors until one of them is read."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._calls: list[tuple[dict[str, Any], StepStats, torch.Tensor | None]] = []
        self._records: list[dict[str, Any]] | None = None
        self._totals: dict[int, _LayerTotals] = defaultdict(_LayerTotals)

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, meta: dict[str, Any], stats: StepStats, error: torch.Tensor | None = None) -> None:
        """One call: ``meta`` holds at least ``layer`` and ``rows`` (query rows served)."""
        self._calls.append((meta, stats, error))
        self._records = None
        tot = self._totals[meta["layer"]]
        rows = meta["rows"]
        tot.calls += 1
        tot.rows += rows
        for name in SUMMED:
            tot.sums[name] = tot.sums.get(name, 0.0) + stats.raw(name) * rows
        tot.bytes_read = tot.bytes_read + stats.raw("bytes_read")
        if error is not None:
            tot.error_sum = tot.error_sum + error.sum()
            tot.error_rows += error.numel()

    @property
    def records(self) -> list[dict[str, Any]]:
        """One dict per call: its meta, its stats and ``rel_error`` (mean over tracked rows) where tracked."""
        if self._records is None or len(self._records) != len(self._calls):
            self._records = [_record(meta, stats, error) for meta, stats, error in self._calls]
        return self._records

    def layer_summary(self) -> dict[int, dict[str, float]]:
        """Per layer: calls, rows, row-weighted mean density, kv_density, V rows read and n_keys, mean
        bytes read per call, and rel_error where tracked."""
        summary = {}
        for layer in sorted(self._totals):
            tot = self._totals[layer]
            row: dict[str, float] = {"calls": tot.calls, "rows": tot.rows}
            for key in SUMMED:
                row[key] = float(tot.sums[key]) / tot.rows
            row["bytes_read"] = float(tot.bytes_read) / tot.calls
            if tot.error_rows:
                row["rel_error"] = float(tot.error_sum) / tot.error_rows
            summary[layer] = row
        return summary

    def mean(self, key: str) -> float:
        """Mean of one record field over every call (NaN when none ran)."""
        values = [r[key] for r in self.records if key in r]
        return sum(values) / len(values) if values else math.nan

    @property
    def backends(self) -> set[str]:
        return {stats.backend for _, stats, _ in self._calls}


def _record(meta: dict[str, Any], stats: StepStats, error: torch.Tensor | None) -> dict[str, Any]:
    rec = {**meta, **stats.as_dict()}
    if error is not None:
        rec["rel_error"] = float(error.mean())
    return rec


class LayerDriver:
    """One method served in the attention layers of one model, request after request.

    ``exact_layers``: the caller's ``dense_layers`` and the layers the method keeps exact itself.
    ``seed``: every (request, layer) gets ``RandomKey(seed, (request, layer))``; query rows add their
    batch row and position. ``capacity``: the cache's capacity per row when the caller owns a static
    cache. The caller tells the driver where a request and a forward pass begin; the driver keeps
    the method's state between them.
    """

    def __init__(self, method: str | Method, *, n_layers: int, dense_layers: Iterable[int] = (), seed: int = 0,
                 max_positions: int | None = None, capacity: int | None = None, model: Any = None) -> None:
        self.method = build_method(method)
        if model is not None:
            self.method.check_model(model)  # artifacts fitted to one model (SAAP) refuse any other
        dense = frozenset(int(i) for i in dense_layers)
        bad = sorted(i for i in dense if not 0 <= i < n_layers)
        if bad:
            raise ValueError(f"dense_layers: layers {bad} do not exist; the model has layers 0..{n_layers - 1}")
        self.exact_layers = dense | self.method.exact_layers(n_layers, max_positions)
        self.seed, self.capacity = seed, capacity
        self.request = 0
        self.step = -1
        self.min_length = 0
        self.states: dict[int, MethodState | None] = {}
        self.forward: ForwardState | None = None
        # rows served apart (left padding): each row's own cross-layer state of the current forward
        self._row_forwards: dict[int, ForwardState | None] = {}
        self.prompt_recorded = False
        # rows prefilled one at a time: each layer's row states, stacked by end_prefill()
        self._row_states: dict[int, list[MethodState | None]] | None = None
        self.log = StatsLog()

    # -- what the method needs (its declarations) -----------------------------------------------

    @property
    def records_prompt(self) -> bool:
        """The method's decode starts from what it recorded of the prompt's forward."""
        return self.method.observes_prefill

    def serves(self, layer: int) -> bool:
        """Whether the method runs on ``layer`` (it is not kept exact)."""
        return layer not in self.exact_layers

    # -- requests and forward passes --------------------------------------------------------------

    def begin_request(self, *, new: bool = True, min_length: int = 0) -> None:
        """A new request: every layer's state is dropped (and the request counter advances when ``new``).
        ``min_length``: a host-known lower bound on every row's length for the whole request."""
        if new:
            self.request += 1
        self.step = -1
        self.min_length = min_length
        self.states.clear()
        self.forward = None
        self.prompt_recorded = False
        self._row_states = None

    def begin_forward(self) -> None:
        """A new forward pass: cross-layer methods get a fresh forward state."""
        self.step += 1
        self.forward = self.method.new_forward_state()
        self._row_forwards = {}

    def rewind(self) -> None:
        """Back to the state just after the prompt: what the method recorded of the prompt stays (a
        decode step recomputes what it writes there); any other state is dropped."""
        if not self.records_prompt:
            self.states.clear()
        self.forward = None

    def state(self, layer: int) -> MethodState | None:
        """The method's state for this request and layer (made on first use)."""
        if layer not in self.states:
            self.states[layer] = self.method.new_state()
        return self.states[layer]

    def context(self, layer: int, *, count_reads: bool = True, row: int | None = None) -> CallContext:
        """The call context of ``layer``; ``row``: a batch row served apart, with its own forward state."""
        forward = self.forward
        if row is not None:
            if row not in self._row_forwards:
                self._row_forwards[row] = self.method.new_forward_state()
            forward = self._row_forwards[row]
        return CallContext(layer=layer, request=self.request, count_reads=count_reads, min_length=self.min_length,
                           capacity=self.capacity, forward=forward)

    def seed_key(self, layer: int) -> RandomKey:
        return RandomKey(self.seed, (self.request, layer))

    # -- decode -------------------------------------------------------------------------------------

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               lengths: torch.Tensor | None = None, key_mask: torch.Tensor | None = None, scale: float | None = None,
               count_reads: bool = True) -> tuple[torch.Tensor, StepStats]:
        """One layer's decode call (``Method.decode``'s shapes) with this request's state, context and seed."""
        return self.method.decode(q, k, v, lengths=lengths, key_mask=key_mask, seed=self.seed_key(layer),
                                  scale=scale, state=self.state(layer),
                                  context=self.context(layer, count_reads=count_reads), check_finite=False)

    def decode_rows_apart(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          starts: list[int], *, scale: float | None = None) -> tuple[torch.Tensor, StepStats]:
        """A prefix-only method (``prefix_only_note``) on left-padded rows: each batch row alone, its keys
        from ``starts[b]`` on (a prefix again), with its own state (see :meth:`prefill_rows_apart`).
        ``q [B, Hq, Q, d]``; the stats merge the rows' and say they were served apart."""
        states = self._apart_states(layer, len(starts))
        outs, parts = [], []
        for b, start in enumerate(starts):
            n = k.shape[2] - start
            lengths = torch.full((1,), n, dtype=torch.long, device=q.device)
            context = self.context(layer, row=b)
            out, st = self.method.decode(q[b:b + 1], k[b:b + 1, :, start:], v[b:b + 1, :, start:], lengths=lengths,
                                         seed=self.seed_key(layer), scale=scale, state=states[b], context=context,
                                         check_finite=False)
            outs.append(out)
            parts.append(st)
        stats = merge_stats(parts)
        stats.extra["rows_served"] = "apart (left padding: each row's keys as a prefix)"
        return torch.cat(outs), stats

    # -- prefill ------------------------------------------------------------------------------------

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None,
                sparse: bool, state: MethodState | None = None,
                row: int | None = None) -> tuple[torch.Tensor | None, StepStats | None]:
        """One layer's prompt (no past keys) through the method: its sparse prefill (``sparse``) or its
        observation of a prefill it does not serve. Between :meth:`begin_prefill_rows` and
        :meth:`end_prefill` the call is one batch row's, and its state is kept for stacking."""
        if sparse and not self.method.sparse_prefill:
            raise ValueError(f"prefill: {self.method.name} has no sparse prefill")
        if not sparse and not self.method.observes_prefill:
            return None, None
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"model: {self.method.name} takes the prompt in one forward pass and then one token "
                             f"per step; this forward has {q.shape[2]} tokens after {k.shape[2] - q.shape[2]} "
                             "cached ones")
        if state is None:
            if self._row_states is not None:
                state = self.method.new_state()
                self._row_states[layer].append(state)
            else:
                state = self.state(layer)
        out, stats = self.method.prefill(q, k.contiguous(), v.contiguous(), scale=scale, state=state,
                                         context=self.context(layer, row=row), sparse=sparse)
        if sparse and out is None:
            raise RuntimeError(f"prefill: {self.method.name}.prefill(sparse=True) returned no output")
        return out, stats

    def prefill_rows_apart(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int], *,
                           scale: float | None, sparse: bool) -> tuple[torch.Tensor | None, StepStats | None]:
        """:meth:`prefill` for left-padded rows: each row's prompt from ``starts[b]`` on, alone, with its
        own state (kept apart for :meth:`decode_rows_apart`). Padded positions of the output are zero."""
        states = self._apart_states(layer, len(starts), fresh=True)
        outs, parts = [], []
        for b, start in enumerate(starts):
            out, st = self.prefill(layer, q[b:b + 1, :, start:], k[b:b + 1, :, start:], v[b:b + 1, :, start:],
                                   scale=scale, sparse=sparse, state=states[b], row=b)
            if out is not None:
                outs.append(torch.nn.functional.pad(out, (0, 0, start, 0)))
                parts.append(st)
        if not outs:
            return None, None
        stats = merge_stats(parts)
        stats.extra["rows_served"] = "apart (left padding: each row's prompt alone)"
        return torch.cat(outs), stats

    def _apart_states(self, layer: int, batch: int, fresh: bool = False) -> list[MethodState | None]:
        held = self.states.get(layer)
        if fresh or not isinstance(held, _RowStates) or len(held.rows) != batch:
            held = _RowStates([self.method.new_state() for _ in range(batch)])
            self.states[layer] = held  # type: ignore[assignment]
        return held.rows

    def begin_prefill_rows(self) -> None:
        """The caller prefills the batch one row at a time (batch-1 forwards, rows in order)."""
        self._row_states = defaultdict(list)

    def end_prefill(self) -> None:
        """Stack the row states of the prefill (batch row ``b`` = the ``b``-th row prefilled)."""
        if self._row_states is not None:
            for layer, rows in self._row_states.items():
                if rows and rows[0] is not None:
                    self.states[layer] = rows[0] if len(rows) == 1 else type(rows[0]).stack_rows(rows)
            self._row_states = None
        self.prompt_recorded = True


@dataclass
class _RowStates:
    """A layer's states when its rows are served apart (left padding under a prefix-only method)."""

    rows: list[MethodState | None]
