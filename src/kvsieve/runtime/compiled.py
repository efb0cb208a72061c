"""Fewer kernels per decode step: the decoder layers' elementwise work compiled by ``torch.compile``.

A captured decode step of Llama-3.1-8B in transformers runs about 1,500 kernels, 1,100 of them the
small elementwise ones of RMSNorm (a cast, a square, a mean, an rsqrt, two products and a cast back),
RoPE (slices, a negation, a concatenation, products and sums), SiLU·mul and the residual adds; at
1–2 µs each they cost about 1.9 ms of a 10 ms step (docs/results/gpu-bench/2026-11-23-h100-e2e.md).
Inductor fuses each run of them into one kernel. Nothing of the model is rewritten:

- each decoder layer's own ``forward`` is compiled, with its attention module left out of the graph
  (``torch.compiler.disable``: the runtime's attention reads device lengths, launches kvsieve's
  kernels and may run a method, none of which should be traced), so the compiled graphs hold the
  norms, the residual adds and the MLP;
- the modeling module's ``apply_rotary_pos_emb`` (the function the attention module calls) is
  replaced by its compiled self while the runtime is attached, and put back after;
- on a model sharded by transformers' tensor-parallel plan, each layer's sharded modules outside attention
  (DTensor weights, and a ``forward`` that transformers wrapped with layout changes and, for the
  row-parallel ones, an ``all_reduce``) are either left out of the graphs the same way as attention (the
  row-parallel ``down_proj``: dynamo breaks the graph there and transformers runs it, collective included)
  or, for the column-parallel Linears whose output stays local (``gate_proj``, ``up_proj``), traced as
  the very path transformers takes on a local input without autograd: this rank's matmul on the local
  shards (``runtime/parallel.py``: :func:`~.parallel.layer_sharding`; installed while the runtime is
  attached, prefill included, where it computes what transformers' wrapper would). The compiled graphs
  thus see local tensors only and trace no collective, and SiLU·mul stays one kernel as on one GPU. On CUDA
  ranks the row-parallel products (``o_proj``, ``down_proj``) write their partial rows into torch's symmetric
  memory and sum them with its one-shot all-reduce instead of NCCL (``parallel.OneShotAllReduce``).

In the same steps each layer's q/k/v and gate/up products run as one product each over their weights
concatenated once (``fused_projections.py``: the step's weight reads at 89 % of the copy rate against 76 %).
And each layer's K/V cache write (``cache.py``), which the attention module makes outside the graphs, calls
a function compiled on its own: the new key and value written in one kernel instead of two eager ``scatter_``
(64 of a Llama-3.1-8B step's launches, 3.8 µs each on an H200). ``CACHE_WRITE = False`` keeps the scatters.

Compiled code runs only in decode steps (``active()``), whose shapes never change, so nothing
recompiles between steps; prefill runs the model as it is. The runtime compiles only for captured
CUDA steps: there the compiled kernels are recorded once in the graph, and dynamo's per-call guard
checks cost nothing at replay.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from .cache import RuntimeCache, index_write
from .fused_projections import FusedProjections
from .parallel import LayerSharding, row_parallel_forward

ROPE_FUNCTION = "apply_rotary_pos_emb"
# torch.compile's backend (a name or a callable): inductor wherever the runtime compiles; tests may set another
BACKEND: str | Callable = "inductor"
# the decode step's K/V write compiled (cache.index_write: one kernel per layer) where the ops are compiled;
# False: the cache's eager scatters
CACHE_WRITE = True
# inductor fuses two kernels side by side only where they share this many bytes of reads (10 by default): the
# two writes share the positions alone, 8 bytes at batch 1
WRITE_OPTIONS = {"score_fusion_memory_threshold": 1}


def compiled_cache_write() -> Callable:
    """:func:`~.cache.index_write` compiled: the K and V writes of a layer's decode token in one kernel."""
    options = WRITE_OPTIONS if BACKEND == "inductor" else None  # inductor's options; another backend takes none
    return torch.compile(index_write, fullgraph=True, dynamic=False, backend=BACKEND, options=options)


def decoder_layers(model: torch.nn.Module, attention: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules whose attribute ``self_attn`` is one of ``attention`` (transformers' decoder layers)."""
    wanted = {id(m) for m in attention}
    return [m for m in model.modules() if id(getattr(m, "self_attn", None)) in wanted]


class CompiledOps:
    """Install (``attach``) and remove (``detach``) the compiled decode-step pieces of one model."""

    def __init__(self, model: torch.nn.Module, attention: list[torch.nn.Module], active: Callable[[], bool],
                 sharding: LayerSharding | None = None, row_reducer: Any = None, cache: RuntimeCache | None = None):
        self.model, self.attention, self.active = model, attention, active
        self.cache = cache  # its decode writes compiled too (CACHE_WRITE)
        # on a sharded model: the row-parallel products' all-reduce in decode steps (parallel.step_all_reduce)
        self.row_reducer, self.row = row_reducer, [] if sharding is None or row_reducer is None else sharding.row
        self.layers = decoder_layers(model, attention)
        if len(self.layers) != len(attention):
            raise ValueError(f"model: found {len(self.layers)} decoder layers with a self_attn for "
                             f"{len(attention)} attention modules; compile_ops serves transformers' decoder layers")
        # on a sharded model (``sharding``: its TensorParallel's): each layer's sharded modules outside its
        # attention, left out of the graphs or (column-parallel Linears) traced as their local matmul
        self.excluded: list[torch.nn.Module] = []
        self.local: list[tuple[torch.nn.Module, Callable]] = []
        if sharding is not None:
            if sharding.blocker is not None:
                raise ValueError(f"model: {sharding.blocker}; compile_ops compiles each decoder layer's forward and "
                                 "serves plans that shard modules inside the layers")
            for layer in self.layers:
                self.excluded += sharding.left_out[id(layer)]
                self.local += sharding.local[id(layer)]
        self._saved: list[tuple[Any, str, Any, bool]] = []
        # each layer's q/k/v and gate/up products as one product each (fused_projections.py); on a rank, over
        # its column-parallel shards
        self.projections = FusedProjections(self.layers, active, None if sharding is None else sharding.column)

    def _set(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner) if not isinstance(owner, type(sys)) else True
        self._saved.append((owner, name, getattr(owner, name), had))
        setattr(owner, name, value)

    def attach(self) -> None:
        if self._saved:
            return
        # left out of the graphs: each layer's attention, and on a sharded model the sharded modules
        for module in [layer.self_attn for layer in self.layers] + self.excluded:
            self._set(module, "forward", torch.compiler.disable(module.forward, recursive=True))
        for module, forward in self.local:
            self._set(module, "forward", forward)
        # over the forwards set so far (a rank's local matmuls): those are what a group's other inputs run
        self.projections.attach()
        for module, weight, bias in self.row:  # eager, outside the graphs, as transformers' forward was
            forward = row_parallel_forward(module, weight, bias, self.row_reducer, self.active)
            self._set(module, "forward", torch.compiler.disable(forward, recursive=True))
        compiled: dict[type, Callable] = {}
        for layer in self.layers:
            cls = type(layer)
            if cls not in compiled:  # one compiled forward per class: the layers share it
                compiled[cls] = torch.compile(cls.forward, fullgraph=False, dynamic=False, backend=BACKEND)
            self._set(layer, "forward", self._switch(compiled[cls], layer, layer.forward))
        for module_name in {type(m).__module__ for m in self.attention}:
            modeling = sys.modules.get(module_name)
            rope = getattr(modeling, ROPE_FUNCTION, None)
            if rope is not None:
                fused = torch.compile(rope, fullgraph=True, dynamic=False, backend=BACKEND)
                self._set(modeling, ROPE_FUNCTION, self._switch(fused, None, rope))
        if self.cache is not None and CACHE_WRITE:
            self._set(self.cache, "compiled_write", self._switch(compiled_cache_write(), None, index_write))

    @property
    def cache_write(self) -> str:
        """How decode steps write the K/V cache while attached: ``compiled`` (both in one compiled kernel per
        layer) or ``scatter`` (the cache's eager scatters)."""
        return "compiled" if self.cache is not None and self.cache.compiled_write is not None else "scatter"

    def _switch(self, compiled: Callable, owner: Any, eager: Callable) -> Callable:
        active = self.active

        @functools.wraps(eager)
        def run(*args, **kwargs):
            if not active():
                return eager(*args, **kwargs)
            return compiled(owner, *args, **kwargs) if owner is not None else compiled(*args, **kwargs)

        return run

    def detach(self) -> None:
        self.projections.detach()  # first: it restores forwards set after this class's own
        for owner, name, value, had in reversed(self._saved):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)  # the instance falls back to its class's method again
        self._saved.clear()
