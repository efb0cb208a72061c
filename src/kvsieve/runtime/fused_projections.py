"""Fewer, wider weight products per decode step: each layer's q/k/v and gate/up products as one GEMV each.

At decode a weight product is a matrix-vector product that reads its whole weight once. A Llama-3.1-8B step
runs 7 a layer; the small ones (k and v: 8 MB each) are over before the device's memory pipes fill, so the
step's products stream at 76 % of the copy rate. One product over the concatenated q/k/v weights and one over
gate/up (how serving engines store them) stream at 89 %: 4.68 → 3.99 ms a step of the 8B shape, 3.06 → 2.34 at
one tensor-parallel rank of two, 11.2 → 9.7 ms of the 70B shape at TP 4 (H200, every layer's products in one
graph: ``benchmarks/breakdown/weights_gemv.py --step``; docs/results/gpu-bench/2026-11-29-h200-weights-gemv.md).

How, without rewriting the model's code: each group's weights (and biases) are moved once into one buffer,
each module's ``weight`` becoming its slice of it (same values, same shapes, no extra memory), and while the
runtime is attached each module's ``forward`` is replaced: the first of a group called on an input computes
the whole group's product and hands its slice back; the others, called on the same input, take theirs from
it. Any other call (another input, another order) computes its own product as before, so a model whose
attention or MLP uses its projections differently stays correct. The buffers stay when the runtime detaches:
the modules are plain ``nn.Linear`` again, reading their slices.

Only plain ``nn.Linear`` groups on one device and dtype with equal input widths are fused. On a model sharded by
transformers' tensor-parallel plan the group's modules must all be column-parallel with a local output (q/k/v,
gate/up in the Llama plan): their local shards are what is concatenated, so each rank runs one product over its
own heads' q/k/v rows and its own gate/up rows; any DTensor input goes to transformers' own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: per decoder layer: (child holding the projections, the projections that read the same input)
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _fusable(linears: list[Any], shards: dict[int, tuple] | None) -> str | None:
    """Why these modules cannot share one product (None: they can); ``shards``: on a tensor-parallel rank,
    the column-parallel modules' local (weight, bias) shards by module id."""
    if not all(type(m) is torch.nn.Linear for m in linears):
        return "not plain nn.Linear"
    if shards is not None:
        if any(id(m) not in shards for m in linears):
            return "not all column-parallel with a local output"
        weights = [shards[id(m)][0] for m in linears]
    else:
        weights = [m.weight for m in linears]
        if any(type(w.data) is not torch.Tensor for w in weights):
            return "weights are not plain tensors (a tensor-parallel shard outside the plan's column styles?)"
    if len({(w.device, w.dtype, w.shape[1]) for w in weights}) != 1:
        return "weights differ in device, dtype or input width"
    if len({m.bias is None for m in linears}) != 1:
        return "some have a bias and some not"
    return None


def _one_buffer(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The buffer ``tensors`` already are consecutive row slices of, in order (a model packed by an earlier
    runtime), as a tensor over that memory; None when they are not."""
    first = tensors[0]
    storage, start = first.untyped_storage(), first.storage_offset()
    offset, rows = start, 0
    for t in tensors:
        if (t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous()
                or t.storage_offset() != offset or t.shape[1:] != first.shape[1:]):
            return None
        offset, rows = offset + t.numel(), rows + t.shape[0]
    shape = (rows, *first.shape[1:])
    return first.new_empty(0).set_(storage, start, shape, torch.empty(shape, device="meta").stride())


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One buffer holding ``tensors`` as consecutive rows; each tensor's data becomes its slice of it."""
    buffer = _one_buffer(tensors)
    if buffer is not None:
        return buffer
    buffer = torch.cat([t.detach() for t in tensors])
    start = 0
    for t in tensors:
        t.data = buffer[start:start + t.shape[0]]
        start += t.shape[0]
    return buffer


def _is_dtensor(x: torch.Tensor) -> bool:
    return type(x).__name__ == "DTensor"


class SharedProduct:
    """One group's projections as one product over their concatenated weights (see the module's doc)."""

    def __init__(self, linears: list[torch.nn.Linear], shards: dict[int, tuple] | None = None):
        self.linears = linears
        pairs = [shards[id(m)] if shards is not None else (m.weight, m.bias) for m in linears]
        with torch.no_grad():
            self.weight = _pack([w for w, _ in pairs])
            self.bias = None if pairs[0][1] is None else _pack([b for _, b in pairs])
        self.widths = [w.shape[0] for w, _ in pairs]
        self.sharded = shards is not None
        self.input: torch.Tensor | None = None
        self.pending: dict[int, torch.Tensor] = {}

    def forward(self, index: int, eager: Callable, active: Callable[[], bool]) -> Callable:
        """The ``forward`` of projection ``index``: its slice of the group's product while ``active()``."""

        def run(x: torch.Tensor) -> torch.Tensor:
            if not active() or (self.sharded and _is_dtensor(x)):
                return eager(x)
            if self.input is x and index in self.pending:
                out = self.pending.pop(index)
                if not self.pending:
                    self.input = None  # nothing of the step stays referenced between steps
                return out
            parts = F.linear(x, self.weight, self.bias).split(self.widths, dim=-1)
            self.input, self.pending = x, {i: p for i, p in enumerate(parts) if i != index}
            return parts[index]

        return run


class FusedProjections:
    """Install (``attach``) and remove (``detach``) the shared products of a model's decoder layers."""

    def __init__(self, layers: list[torch.nn.Module], active: Callable[[], bool],
                 shards: dict[int, tuple] | None = None):
        self.layers, self.active, self.shards = layers, active, shards
        self.products: list[SharedProduct] = []
        self.refused: dict[str, str] = {}  # group name -> why it keeps separate products
        self._saved: list[tuple[Any, bool, Any]] = []

    def attach(self) -> None:
        if self._saved:
            return
        for layer in self.layers:
            for child, names in GROUPS:
                owner = getattr(layer, child, None)
                linears = [getattr(owner, n, None) for n in names]
                if owner is None or any(m is None for m in linears):
                    continue
                reason = _fusable(linears, self.shards)
                if reason is not None:
                    self.refused[f"{child}.{'/'.join(names)}"] = reason
                    continue
                product = SharedProduct(linears, self.shards)
                self.products.append(product)
                for i, m in enumerate(linears):
                    self._saved.append((m, "forward" in vars(m), m.forward))
                    m.forward = product.forward(i, m.forward, self.active)

    def detach(self) -> None:
        for module, had, forward in reversed(self._saved):
            if had:
                module.forward = forward
            else:
                del module.forward  # the module falls back to its class's forward
        self._saved.clear()
        self.products.clear()

    def summary(self) -> dict[str, Any]:
        """What ``stats.fused_projections`` reports: groups fused, and the groups left separate with why."""
        return {"groups": len(self.products), "refused": dict(self.refused)}

