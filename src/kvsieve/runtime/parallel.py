"""The runtime on a model sharded by transformers' tensor-parallel plan.

transformers shards a model across the ranks of a ``torch.distributed`` group when it is loaded with
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))`` (the older ``tp_plan="auto"``
argument maps to the same): the parameters become DTensors holding each rank's shard, and each
sharded module's ``forward`` is wrapped so that it runs on local tensors under ``no_grad``. For the
Llama-family plan (``base_model_tp_plan``):

- ``q_proj``/``k_proj``/``v_proj`` are column-parallel: each rank computes its own ``Hq / N`` query and
  ``Hkv / N`` KV heads, so the attention function (ours) sees local heads only, and nothing of attention
  needs communication as long as each GQA group is whole on one rank (``Hkv`` a multiple of ``N``);
- ``o_proj`` and ``down_proj`` are row-parallel (an all-reduce each), the input embedding is
  vocabulary-parallel (an all-reduce), and ``lm_head`` is column-parallel with its output gathered
  (``colwise_gather_output``), so every rank holds the same full logits.

The runtime therefore keeps, per rank, a cache of the local KV heads only and a method state built
from local tensors (the methods run unchanged on whatever heads they are given); the next token is
chosen from the gathered logits on every rank by the same rule (greedy, or counter-based sampling
from the same seed), so the ranks agree on every token without exchanging it. What must agree
across ranks (method, seed, sampling, batch, capacity) is checked once, with one collective when
the runtime is built, and a disagreement raises the same ValueError on every rank. ``compile_ops``
compiles each decoder layer with the modules the plan sharded left out (:func:`sharded_modules`) except
the column-parallel Linears, traced as this rank's matmul on its local shards (:func:`local_column_forward`),
so no compiled graph sees a DTensor or traces a collective.

:func:`tensor_parallel` inspects a model and returns ``None`` for an unsharded one, so the runtime's
single-process path is untouched.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .support import ModelShape

# the plan entries the runtime relies on, by module-name suffix: heads split by rank, logits replicated
ATTENTION_STYLES = {"q_proj": ("colwise",), "k_proj": ("colwise",), "v_proj": ("colwise",), "o_proj": ("rowwise",)}
REPLICATED_LOGITS = ("colwise_gather_output", "colwise_rep")


@dataclass
class TensorParallel:
    """One rank's view of a tensor-parallel model: its place in the group and its share of the heads."""

    rank: int
    size: int
    group: Any  # the tensor-parallel process group (None: the default group)
    heads: int  # query heads on this rank
    kv_heads: int  # KV heads on this rank (whole GQA groups)
    plan: dict[str, str]
    backend: str
    notes: list[str] = field(default_factory=list)  # paths the runtime took because of the sharding
    method_notes: dict[str, list[str]] = field(default_factory=dict)  # what sharding changes, per method
    # what compile_ops does with the sharded modules inside the decoder layers (compiled.py uses the same)
    sharding: LayerSharding = field(default_factory=lambda: LayerSharding({}, {}, [], [], None), repr=False)

    @property
    def kv_head_offset(self) -> int:
        """The global index of this rank's first KV head (its heads are ``[offset, offset + kv_heads)``)."""
        return self.rank * self.kv_heads

    def check_method(self, method) -> list[str]:
        """A ValueError for a method that cannot run on local heads; notes on what sharding changes."""
        notes = []
        if method.needs_fit:  # artifacts fitted per global head: the method takes this rank's slice, if it can
            use_local_heads = getattr(method, "use_local_heads", None)
            if use_local_heads is None:
                raise ValueError(f"method: {method.name} runs on artifacts fitted per global head of the whole model "
                                 f"and cannot slice them to a tensor-parallel rank's heads (tp size {self.size}); "
                                 "run it on one GPU")
            notes.append(use_local_heads(self.kv_head_offset, self.kv_heads))
        if method.stochastic:
            notes.append(f"{method.name}: random draws are keyed by the local head index, so rank r's head h draws "
                         "what rank 0's head h draws: each head's estimate keeps its distribution, but the draws "
                         "differ from the single-process run with the same seed")
        if method.name == "sketchwalk":
            notes.append("sketchwalk: sketches and the walk are averaged over this rank's heads only, so each rank "
                         "selects its own blocks (a different selection from the single-process one)")
        self.method_notes[method.spec] = notes
        return notes

    def agree(self, **values: Any) -> None:
        """Raise the same ValueError on every rank unless every rank passed the same ``values``.

        One ``all_gather_object`` of a digest: a call every rank makes, so a disagreement never hangs."""
        import torch.distributed as dist

        text = repr(sorted(values.items()))
        digest = hashlib.sha256(text.encode()).hexdigest()
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, (digest, text), group=self.group)
        if len({d for d, _ in gathered}) > 1:
            by_rank = "; ".join(f"rank {r}: {t}" for r, (_, t) in enumerate(gathered))
            names = ", ".join(sorted(values))
            raise ValueError(f"{names}: the tensor-parallel ranks disagree ({by_rank}); every rank must run the "
                             "same request with the same method and seed")

    def compile_ops(self, wanted: bool | str, device: torch.device) -> bool | str:
        """``compile_ops`` on a sharded model: each decoder layer compiled with its sharded modules left out
        (runtime/compiled.py), so the compiled graphs hold local tensors only and trace none of transformers'
        layout changes and collectives; off where the plan shards a decoder layer itself (recorded, and
        ``True`` refused). The path is recorded when the step compiles."""
        blocker = self.sharding.blocker
        if blocker is not None:
            if wanted is True:
                raise ValueError(f"compile_ops: True is not served on this tensor-parallel model "
                                 f"({blocker}); use 'auto' or False")
            if wanted == "auto" and device.type == "cuda":
                self.notes.append(f"compile_ops: off: {blocker}; the decoder layers run uncompiled, as "
                                  "transformers shards them")
            return False
        if wanted is True or (wanted == "auto" and device.type == "cuda"):
            left_out = ", ".join(self.sharding.left_out_names) or "none"
            local = ", ".join(self.sharding.local_names) or "none"
            self.notes.append(f"compile_ops: each decoder layer compiled with its attention and its sharded modules "
                              f"{left_out} left out of the graphs (transformers runs them and their all-reduces "
                              f"between the graphs) and its column-parallel Linears {local} traced as this rank's "
                              "matmul: the norms, residual adds, SiLU·mul and RoPE fused on local tensors")
        return wanted

    def as_dict(self, *specs: str) -> dict[str, Any]:
        """The stats of a run with the methods ``specs`` (decode, prefill)."""
        notes = [n for spec in dict.fromkeys(specs) for n in self.method_notes.get(spec, [])]
        return {"ranks": self.size, "rank": self.rank, "backend": self.backend, "heads": self.heads,
                "kv_heads": self.kv_heads, "kv_head_offset": self.kv_head_offset,
                "plan": dict(sorted(self.plan.items())),
                "fallbacks": list(self.notes) + notes}


def spec_of(method: Any) -> str | None:
    """What ranks compare of a method argument: its spec (a string as given, stripped)."""
    if method is None or isinstance(method, str):
        return None if method is None else method.strip()
    return getattr(method, "spec", repr(method))


def model_tp_size(model: torch.nn.Module) -> int:
    """The tensor-parallel size transformers sharded ``model`` with (1: not sharded)."""
    size = getattr(model, "_tp_size", None)
    return int(size) if size else 1


def tp_group(model: torch.nn.Module):
    """The process group of the model's tensor-parallel mesh dimension."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh["tp"].get_group() if "tp" in names and mesh.ndim > 1 else mesh.get_group()


def generic_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan with layer numbers as ``*`` (what the rules say, not every module)."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    return {generic_name(k): v for k, v in plan.items()}


def generic_name(name: str) -> str:
    """A module's name with its layer numbers as ``*`` ("model.layers.*.mlp.up_proj"), as the plan names it."""
    return re.sub(r"\.\d+\.", ".*.", name)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether transformers' plan sharded ``module`` itself: it holds DTensor parameters or buffers of its own,
    or its ``forward`` was replaced on the instance (the plan's styles wrap it with layout changes and, for
    row-parallel and embedding styles, a collective)."""
    own = list(module._parameters.values()) + list(module._buffers.values())
    return "forward" in vars(module) or any(hasattr(t, "to_local") and hasattr(t, "placements") for t in own)


def sharded_modules(root: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> list[tuple[str, torch.nn.Module]]:
    """The outermost sharded modules (:func:`is_sharded`) of ``root``, itself included, as (name under
    ``root``, module), not looking inside the modules ``skip``."""
    found: list[tuple[str, torch.nn.Module]] = []

    def walk(name: str, module: torch.nn.Module) -> None:
        if any(module is s for s in skip):
            return
        if is_sharded(module):
            found.append((name, module))
            return
        for child_name, child in module.named_children():
            walk(f"{name}.{child_name}" if name else child_name, child)

    walk("", root)
    return found


def local_column_forward(module: torch.nn.Module, style: str | None) -> Callable | None:
    """For a ``torch.nn.Linear`` the plan shards by output features with the output kept local (``"colwise"``:
    weight and bias ``Shard(0)``, a replicated input), the path transformers' style takes on a local input
    without autograd: this rank's matmul on the local shards, no communication. Returned so that compile_ops
    traces it (the matmul and what follows it in one graph); None for any other module. On a DTensor input or
    with autograd on it calls the module's own (transformers') forward."""
    shards = [t for t in (module._parameters.get("weight"), module._parameters.get("bias")) if t is not None]
    if (style != "colwise" or not isinstance(module, torch.nn.Linear) or type(module).forward is not
            torch.nn.Linear.forward or getattr(module, "_hf_quantized_needs_local_tp", False) or not shards):
        return None
    if any(shard_dim(t) != 0 for t in shards):
        return None
    from torch.distributed.tensor import DTensor

    weight = module.weight.to_local()
    bias = None if module.bias is None else module.bias.to_local()
    sharded_forward = module.forward

    def forward(x, *args, **kwargs):
        if args or kwargs or isinstance(x, DTensor) or torch.is_grad_enabled():
            return sharded_forward(x, *args, **kwargs)
        return torch.nn.functional.linear(x, weight, bias)

    return forward


@dataclass
class LayerSharding:
    """How compile_ops treats the sharded modules inside a model's decoder layers (outside attention)."""

    left_out: dict[int, list[torch.nn.Module]]  # per layer (by id): run by transformers, outside the graphs
    local: dict[int, list[tuple[torch.nn.Module, Callable]]]  # per layer: column-parallel Linears, traced locally
    left_out_names: list[str]  # by name in the layer
    local_names: list[str]
    blocker: str | None  # why the layers cannot be compiled at all (None: they can)
    # every column-parallel Linear with a local output, attention's included (by id): this rank's weight and
    # bias shards, which fused_projections.py can concatenate into one product per group
    column: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    # every row-parallel Linear (attention's o_proj included): (module, this rank's weight shard, bias or None)
    row: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)


def layer_sharding(model: torch.nn.Module) -> LayerSharding:
    """The sharded modules of each decoder layer outside its attention (:func:`sharded_modules`): the
    column-parallel Linears traced as their local matmul (:func:`local_column_forward`), every other one left
    out of the compiled graphs; a blocker where the plan shards a decoder layer itself."""
    plan = generic_plan(model)
    out = LayerSharding({}, {}, [], [], None)
    left_names, local_names = set(), set()
    for layer_name, layer in model.named_modules():
        if not isinstance(getattr(layer, "self_attn", None), torch.nn.Module):
            continue
        left, local = out.left_out.setdefault(id(layer), []), out.local.setdefault(id(layer), [])
        for name, module in sharded_modules(layer, skip=(layer.self_attn,)):
            if not name:
                out.blocker = f"the plan shards the decoder layer {type(layer).__name__} itself"
                return out
            forward = local_column_forward(module, plan.get(generic_name(f"{layer_name}.{name}")))
            if forward is None:
                left.append(module)
                left_names.add(name)
            else:
                local.append((module, forward))
                local_names.add(name)
    out.left_out_names, out.local_names = sorted(left_names), sorted(local_names)
    for name, module in model.named_modules():
        style = plan.get(generic_name(name))
        if local_column_forward(module, style) is not None:
            out.column[id(module)] = (module.weight.to_local(), None if module.bias is None else module.bias.to_local())
        elif _is_row_parallel(module, style):
            bias = module.bias
            out.row.append((module, module.weight.to_local(),
                            None if bias is None else local_tensor(bias)))
    return out


def _is_row_parallel(module: torch.nn.Module, style: str | None) -> bool:
    """A ``torch.nn.Linear`` the plan shards by input features (``"rowwise"``: weight ``Shard(1)``, the output
    all-reduced to every rank)."""
    weight = module._parameters.get("weight") if isinstance(module, torch.nn.Linear) else None
    return (style == "rowwise" and type(module).forward is torch.nn.Linear.forward and weight is not None
            and shard_dim(weight) == 1 and not getattr(module, "_hf_quantized_needs_local_tp", False))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's own shard of a DTensor (``to_local()``); any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def shard_dim(t: torch.Tensor) -> int | None:
    """The dimension (counted from 0) a DTensor on a one-dimensional mesh is sharded along; None for anything
    else (a plain tensor, a replicated or partial DTensor, a mesh of more dimensions). Read by the column- and
    row-parallel checks here and by whatever writes a rank's shard of a whole tensor (the bench's peaked model)."""
    placements = getattr(t, "placements", None)
    if not hasattr(t, "to_local") or placements is None or len(placements) != 1:
        return None
    if type(placements[0]).__name__ != "Shard":
        return None
    return placements[0].dim % t.ndim


class OneShotAllReduce:
    """The decode step's row-parallel products summed across the ranks through torch's symmetric memory.

    Each row-parallel product (``o_proj``, ``down_proj``) writes this rank's partial rows straight into a
    buffer every rank can read over NVLink, and ``torch.ops.symm_mem.one_shot_all_reduce`` sums the ranks'
    buffers in one kernel. Two H200s, a CUDA graph of 65 all-reduces of a ``[1, 4096]`` bf16 row: 7.5 µs each
    against NCCL's 12.7 (``benchmarks/breakdown/tp_allreduce.py``; docs/results/gpu-bench/
    2026-11-29-h200x2-tp-allreduce.md). No NVLink multicast is used. Decode steps only; prefill and any other
    input keep transformers' own all-reduce."""

    def __init__(self, group, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = (group or dist.group.WORLD).group_name
        self.rows, self.width = rows, width
        self.buffer = symm_mem.empty(rows, width, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # a collective: every rank builds its runtime alike

    def serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1]
        return (rows <= self.rows and weight.shape[0] == self.width and x.dtype == self.buffer.dtype
                and x.device == self.buffer.device)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` summed over the ranks (``x``: this rank's input shard, ``weight``: its weight shard)."""
        rows = x.numel() // x.shape[-1]
        partial = self.buffer[:rows]
        torch.mm(x.reshape(rows, x.shape[-1]), weight.t(), out=partial)
        return torch.ops.symm_mem.one_shot_all_reduce(partial, "sum", self.group_name).view(*x.shape[:-1], self.width)


def step_all_reduce(tp: TensorParallel, rows: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[OneShotAllReduce | None, str]:
    """The decode step's all-reduce for the row-parallel products of ``tp``'s model (``rows`` rows of their
    output width), and what was chosen: symmetric memory's one-shot on CUDA ranks that have it, else
    transformers' own (NCCL or gloo)."""
    if device.type != "cuda":
        return None, f"row-parallel all-reduces: transformers' ({tp.backend}); symmetric memory needs CUDA ranks"
    if not tp.sharding.row:
        return None, "row-parallel all-reduces: none found in the plan"
    width = tp.sharding.row[0][0].out_features  # the hidden size: every row-parallel product's output
    try:
        reducer = OneShotAllReduce(tp.group, rows, width, dtype, device)
    except Exception as exc:  # noqa: BLE001 - recorded; transformers' NCCL all-reduce still serves
        return None, (f"row-parallel all-reduces: transformers' ({tp.backend}); symmetric memory unavailable "
                      f"({type(exc).__name__}: {str(exc)[:160]})")
    return reducer, (f"row-parallel all-reduces: symmetric memory's one-shot in decode steps "
                     f"({len(tp.sharding.row)} modules; prefill keeps transformers' {tp.backend})")


def row_parallel_forward(module: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
                         reducer, active: Callable[[], bool]) -> Callable:
    """The ``forward`` of a row-parallel Linear while the runtime is attached: in decode steps on a plain local
    input, this rank's product summed by ``reducer`` then the bias, as transformers' local path computes it;
    otherwise transformers' own forward."""
    sharded_forward = module.forward

    def forward(x, *args, **kwargs):
        if (args or kwargs or not active() or type(x).__name__ == "DTensor" or torch.is_grad_enabled()
                or not reducer.serves(x, weight)):
            return sharded_forward(x, *args, **kwargs)
        out = reducer.linear(x, weight)
        return out if bias is None else out + bias

    return forward


def _style_of(plan: dict[str, str], suffix: str) -> set[str]:
    return {style for name, style in plan.items() if name.rsplit(".", 1)[-1] == suffix}


def tensor_parallel(model: torch.nn.Module, shape: ModelShape) -> TensorParallel | None:
    """This rank's :class:`TensorParallel` for a model sharded by transformers (None if not sharded), or a
    ValueError naming what the runtime cannot serve."""
    size = model_tp_size(model)
    if size == 1:
        return None
    if shape.heads % size:
        raise ValueError(f"model: {shape.heads} query heads do not divide by the tensor-parallel size {size}; "
                         "expected a head count that is a multiple of it")
    if shape.kv_heads % size:
        raise ValueError(f"model: {shape.kv_heads} KV heads do not divide by the tensor-parallel size {size}: GQA "
                         "groups would split across ranks (or KV heads be replicated); expected a KV head count "
                         "that is a multiple of the tp size")
    plan = generic_plan(model)
    for suffix, wanted in ATTENTION_STYLES.items():
        got = _style_of(plan, suffix)
        if got and not got <= set(wanted):
            raise ValueError(f"model: the tensor-parallel plan shards {suffix} as {sorted(got)}; the runtime expects "
                             f"{wanted[0]!r} (heads split by rank, attention local)")
    if not _style_of(plan, "k_proj"):
        raise ValueError("model: the tensor-parallel plan does not shard k_proj by heads; the runtime serves the "
                         "plan that splits attention heads across ranks")
    head_style = _style_of(plan, "lm_head")
    if head_style and not head_style <= set(REPLICATED_LOGITS):
        raise ValueError(f"model: the tensor-parallel plan leaves lm_head's logits sharded ({sorted(head_style)}); "
                         f"the runtime chooses tokens from full logits on every rank ({REPLICATED_LOGITS})")
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError(f"model: sharded for tensor parallelism (tp size {size}) but torch.distributed is not "
                         "initialised in this process")
    group = tp_group(model)
    rank = dist.get_rank(group)
    heads, kv_heads = shape.heads // size, shape.kv_heads // size
    for module in model.modules():  # what the shards hold, not only what the plan says
        proj = getattr(module, "k_proj", None)
        if proj is None or not hasattr(module, "q_proj"):
            continue
        local = local_tensor(proj.weight)
        if local.shape[0] != kv_heads * shape.head_dim:
            raise ValueError(f"model: k_proj holds {local.shape[0]} output features on rank {rank}; expected "
                             f"{kv_heads} KV heads × head_dim {shape.head_dim} = {kv_heads * shape.head_dim}")
        break
    return TensorParallel(rank=rank, size=size, group=group, heads=heads, kv_heads=kv_heads, plan=plan,
                          backend=dist.get_backend(group), sharding=layer_sharding(model))


def free_port() -> int:
    """A TCP port free on this host now (for ``MASTER_PORT`` of ranks launched here)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, size: int, port: int, backend: str, timeout_s: float, fn, args: tuple) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist

    # the variables torchrun sets, which transformers' tensor-parallel loading reads
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend=backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s),
                            device_id=torch.device("cuda", rank) if backend == "nccl" else None)
    try:
        fn(rank, size, *args)
    finally:
        dist.destroy_process_group()


def launch(fn, size: int, *args: Any, backend: str = "gloo", timeout_s: float = 600.0) -> None:
    """Run ``fn(rank, size, *args)`` in ``size`` new processes on this host, each a rank of one
    ``torch.distributed`` group (``backend``: gloo on the CPU, nccl with one GPU per rank), as ``torchrun
    --nproc-per-node size`` would. ``fn`` must be importable by name (spawned processes import it).
    An exception in any rank is raised here (``torch.multiprocessing.spawn`` then ends the others); a
    collective waits at most ``timeout_s`` seconds for the other ranks."""
    import torch.multiprocessing as mp

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size: expected an integer >= 1, got {size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and size > torch.cuda.device_count():
        raise ValueError(f"tp: {size} ranks need {size} GPUs, {torch.cuda.device_count()} visible")
    mp.spawn(_rank_main, args=(size, free_port(), backend, timeout_s, fn, args), nprocs=size, join=True)
