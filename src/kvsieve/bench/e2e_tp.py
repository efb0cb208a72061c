"""``kvsieve bench e2e --tp N``: whole-model decode steps on a model sharded across N ranks.

The command launches its N ranks itself (``runtime.parallel.launch``: one process per GPU, NCCL; gloo on
the CPU in tests), as ``torchrun --nproc-per-node N`` would. Each rank builds the model shape with
random weights **directly sharded**: the model is made on the meta device, transformers' own
tensor-parallel plan is applied to it (``maybe_distribute_model``: DTensor parameters with this rank's
shard shape, the sharded modules' forward hooks), and only then is each rank's shard allocated on its
device and filled with random numbers. No full checkpoint exists anywhere (Llama-3.1-70B's would be
141 GB). With ``attention="peaked"`` (``bench/peaked.py``, as the single-GPU bench) every rank then computes
the peaked construction's whole embedding, q_proj/k_proj and lm_head from the same seeds and keeps its
shard of each (``peaked.set_param``), and scales its shards of o_proj/down_proj; the prompts are
``peaked.bench_prompts``' on every rank, and the attention profile measured on the model gathers every
rank's heads.

Every rank then runs the single-GPU benchmark's case (``e2e._run_case``: one prefill, the runtime's
dense decode and each method from the same cache, then transformers' own eager decode on the same
shards) with its own heads' cache. Each case gets ranks of its own (the model is built again for it): the
kernel breakdown that follows a case's timings runs the torch profiler, which stays attached to its process and
slows every later launch, so a later case in the same process would report inflated host times. Rank 0
reports; each row also carries every rank's ms per step and host ms (``ms_by_rank``, ``host_ms_by_rank``: the
ranks wait on each other in every collective, so their step times agree; host times need not).

The per-rank floor is ``(this rank's weights + this rank's K/V bytes) / copy rate`` (the single-GPU
floor of the shard) **plus the measured collective time per step**: the step's collectives (one
all-reduce of ``[B, hidden]`` after each layer's ``o_proj`` and ``down_proj``, one after the
vocabulary-parallel embedding, one all-gather of the logits) timed alone, replayed from a CUDA graph
on CUDA (as the captured decode step runs them) or issued eagerly on the CPU (``collectives``).
"""

from __future__ import annotations

import functools
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import e2e
from .peaked import ATTENTION_LABELS
from .report import environment, fmt

TP_SHAPES: dict[str, dict] = {
    "llama-3.1-8b": e2e.MODEL_SHAPES["llama-3.1-8b"],
    "llama-3.1-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          max_position_embeddings=131072 + 4096, tie_word_embeddings=False),
    # for tests on the CPU
    "tiny-llama": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, tie_word_embeddings=False),
}
# what the issue's table runs: (shape, tp) pairs and their cases
DEFAULT_TP = {"llama-3.1-8b": 2, "llama-3.1-70b": 4}


def shape_config(shape: str, **overrides):
    from transformers import AutoConfig

    if shape not in TP_SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(TP_SHAPES)}, got {shape!r}")
    kw = {**TP_SHAPES[shape], **overrides}
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def _seed(name: str, seed: int, rank: int) -> int:
    return (zlib.crc32(name.encode()) * 1_000_003 + seed * 7919 + rank) % (2**63)


def build_sharded_model(shape: str, size: int, *, device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                        seed: int = 0, **overrides):
    """This rank's shards of ``shape`` with random weights, sharded by transformers' tensor-parallel plan
    (call on every rank of an initialised ``torch.distributed`` group of ``size`` ranks).

    Linear and embedding weights are N(0, 1/in_features) (so activations keep their scale through the
    layers), norms 1; a sharded weight's values come from (name, seed, rank), a replicated one's from
    (name, seed) so that every rank holds the same."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if not dist.is_initialized() or dist.get_world_size() != size:
        raise ValueError(f"tp: expected an initialised torch.distributed group of {size} ranks")
    device = torch.device(device)
    cfg = shape_config(shape, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    dcfg, _, mesh = model.prepare_distribute_model(DistributedConfig(tp_size=size))
    model = model.maybe_distribute_model(model, dcfg, mesh)
    rank = dist.get_rank()
    for mname, module in list(model.named_modules()):
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            name = f"{mname}.{pname}" if mname else pname
            is_dt = isinstance(p, DTensor)
            local = p.to_local() if is_dt else p
            replicated = not is_dt or all(isinstance(pl, Replicate) for pl in p.placements)
            g = torch.Generator(device=device).manual_seed(_seed(name, seed, 0 if replicated else rank))
            if local.dim() == 1:
                data = torch.ones(local.shape, dtype=dtype, device=device)
            else:
                data = torch.empty(local.shape, dtype=dtype, device=device)
                data.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
            if is_dt:
                data = DTensor.from_local(data, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                          stride=p.stride())
            module._parameters[pname] = torch.nn.Parameter(data, requires_grad=False)
    for mname, module in list(model.named_modules()):  # buffers computed at init (RoPE's inverse frequencies)
        if any(b is not None and b.is_meta for b in module.buffers(recurse=False)):
            if not type(module).__name__.endswith("RotaryEmbedding"):
                raise ValueError(f"model: {mname} ({type(module).__name__}) has buffers made on the meta device "
                                 "that the sharded builder does not know how to compute")
            with torch.device(device):
                fresh = type(module)(module.config)
            parent, _, attr = mname.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, fresh)
    return model.eval()


def collectives(model, batch: int, *, iters: int = 20, graph: bool | None = None) -> dict[str, Any]:
    """Time of one decode step's collectives on this rank, alone: ``2 L + 1`` all-reduces of
    ``[B, 1, hidden]`` and one all-gather of ``[B, 1, vocab / N]`` (the plan's row-parallel layers, the
    vocabulary-parallel embedding, the gathered logits), each the way the runtime's decode step issues it:
    on CUDA ranks the ``2 L`` row-parallel ones through symmetric memory's one-shot where the runtime can set
    it up (``runtime.parallel.step_all_reduce``), the rest through the backend (``collective_path`` says
    which). On CUDA replayed from a CUDA graph by default (as the captured step issues them), else issued
    eagerly; median over ``iters`` of each rank, max over the ranks."""
    import torch.distributed as dist

    from ..runtime.parallel import OneShotAllReduce, model_tp_size, tp_group

    cfg = model.config
    size, group = model_tp_size(model), tp_group(model)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    cuda = device.type == "cuda"
    graph = cuda if graph is None else graph
    hidden = torch.zeros(batch, 1, cfg.hidden_size, dtype=dtype, device=device)  # zeros: sums stay finite
    logits = torch.zeros(batch, 1, -(-cfg.vocab_size // size), dtype=dtype, device=device)
    gathered = torch.empty(size, *logits.shape, dtype=dtype, device=device)
    n_reduce = 2 * cfg.num_hidden_layers + 1
    backend = dist.get_backend(group)
    one_shot, path = None, backend
    if cuda:
        try:
            one_shot = OneShotAllReduce(group, batch, cfg.hidden_size, dtype, device)
            one_shot.buffer.zero_()
            path = f"symmetric memory's one-shot ({n_reduce - 1}), {path} (1 and the gather)"
        except Exception as exc:  # noqa: BLE001 - the runtime falls back the same way; recorded
            path = f"{path} (symmetric memory unavailable: {type(exc).__name__})"

    def step():
        for _ in range(n_reduce if one_shot is None else 1):
            dist.all_reduce(hidden, group=group)
        if one_shot is not None:  # the runtime's products write into the buffer: the sum is what is left
            for _ in range(n_reduce - 1):
                torch.ops.symm_mem.one_shot_all_reduce(one_shot.buffer, "sum", one_shot.group_name)
        if cuda:
            dist.all_gather_into_tensor(gathered, logits, group=group)
        else:  # gloo gathers into a list
            dist.all_gather(list(gathered.unbind(0)), logits, group=group)

    try:
        step()
    except Exception as exc:  # noqa: BLE001 - as the runtime would have: the backend's all-reduce, recorded
        if one_shot is None:
            raise
        one_shot, path = None, f"{backend} (the one-shot failed: {type(exc).__name__})"
        step()
    run = step
    if graph:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        run = g.replay
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    mine = torch.tensor([times[len(times) // 2]], dtype=torch.float64, device=device)  # NCCL gathers device tensors
    everyone = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine, group=group)
    per_rank = [float(t) for t in everyone]
    return {"collective_ms": max(per_rank), "collective_ms_by_rank": per_rank, "all_reduces": n_reduce,
            "all_gathers": 1, "collective_graph": graph, "collective_path": path,
            "collective_bytes": n_reduce * hidden.nbytes + gathered.nbytes}


def gather_heads(profile: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model_attention_profile``'s statistics [layers, this rank's heads] of every rank, joined along the
    heads in rank order (the plan gives rank r the r-th block of heads): the whole model's [layers, heads]."""
    import torch.distributed as dist

    from .attention_shape import STATS

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: profile[k].cpu() for k in STATS})
    return {**profile, **{k: torch.cat([r[k] for r in everyone], dim=1) for k in STATS}}


def _rank_bench(rank: int, size: int, kw: dict, out: dict | None) -> None:
    """One rank of :func:`run_tp_bench`; rank 0 puts the results in ``out`` (a shared dict)."""
    import torch.distributed as dist

    from .peaked import build_bench_model, calibration_record, run_profile

    device = f"cuda:{rank}" if kw["device"] == "cuda" else "cpu"
    cuda = kw["device"] == "cuda"
    log = print if rank == 0 else (lambda *_: None)
    peak = float("nan")
    if cuda:
        from .timing import copy_bandwidth

        peak = copy_bandwidth(device)
    t0 = time.perf_counter()
    model = build_bench_model(functools.partial(build_sharded_model, size=size), kw["shape"], kw["attention"],
                              kw["peaked"], device=device, dtype=kw["dtype"])
    weights = e2e.weights_read_per_step(model)
    log(f"{kw['shape']} tp={size}: shards built with random weights ({kw['attention']} attention) in "
        f"{time.perf_counter() - t0:.1f} s; {weights / 1e9:.2f} GB of weights per rank read per step")
    measured = run_profile(model, [n for _, n in kw["cases"]], log=log, combine=gather_heads)
    if cuda:
        torch.cuda.empty_cache()  # the profile's prefill cache: the cases' memory checks read the free memory
    rows = []
    for batch, n in kw["cases"]:
        base = {"shape": kw["shape"], "tp": size, "batch": batch, "n": n}
        comm = collectives(model, batch)
        try:
            case = e2e._run_case(model, base, weights, kw["methods"], kw["baselines"], kw["timing"], None, cuda,
                                 log, graph=kw["graph"])
        except Exception as exc:  # noqa: BLE001 - every rank fails alike; keep the other cases
            case = [{**base, "variant": "*", "error": f"{type(exc).__name__}: {exc}"[:300]}]
        for row in case:
            row.update(comm)
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, [{k: r.get(k) for k in ("ms", "host_ms")} for r in case])
        for i, row in enumerate(case):
            row["ms_by_rank"] = [g[i]["ms"] for g in gathered]
            row["host_ms_by_rank"] = [g[i]["host_ms"] for g in gathered]
        _derive_tp(case, peak)
        rows.extend(case)
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0 and out is not None:
        out["rows"] = rows
        out["copy_bandwidth_bytes_per_s"] = peak
        out["device"] = torch.cuda.get_device_name(device) if cuda else "cpu"
        out["calibration"] = {kw["shape"]: calibration_record(kw["shape"], getattr(model, "peaked_attention", None),
                                                              measured)}


def _derive_tp(rows: list[dict], peak: float) -> None:
    """The single-GPU derived fields, then the per-rank floor with the collectives added."""
    e2e._derive(rows, peak)
    for r in rows:
        if "ms" in r and "floor_ms" in r:
            r["tp_floor_ms"] = r["floor_ms"] + r["collective_ms"]
            r["fraction_of_tp_floor"] = r["tp_floor_ms"] / r["ms"]


def run_tp_bench(*, shape: str = "llama-3.1-8b", tp: int = 2, cases: Sequence[tuple[int, int]] = ((1, 131072),),
                 methods: Sequence[str] = ("quest:top_k=0.05",), baselines: Sequence[str] = e2e.BASELINES,
                 steps: int = 30, method_steps: int = 8, warmup: int = 3, hf_steps: int = 4,
                 dtype: torch.dtype = torch.bfloat16, device: str = "cuda", graph: bool | str = "auto",
                 attention: str = "uniform", peaked=None, log: Callable[[str], None] = print) -> dict:
    """Launch ``tp`` ranks (one GPU each, NCCL; ``device="cpu"``: gloo) and run every case on ``shape``
    sharded across them; the results (rank 0's rows with every rank's times) as ``run_e2e_bench``'s.
    ``attention``: ``uniform`` (random weights, flat attention) or ``peaked`` (``bench.peaked``: ``peaked``
    or the shape's committed fit), as ``run_e2e_bench``'s; the results carry it, the parameters and the
    attention profile measured on the sharded model."""
    import torch.multiprocessing as mp

    from ..runtime.parallel import launch
    from .peaked import check_attention, fitted

    check_attention(attention, peaked)
    if shape not in TP_SHAPES:
        raise ValueError(f"shapes: expected one of {', '.join(TP_SHAPES)}, got {shape!r}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2:
        raise ValueError(f"tp: expected an integer >= 2, got {tp!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device: expected 'cuda' or 'cpu', got {device!r}")
    if device == "cuda" and tp > torch.cuda.device_count():
        raise ValueError(f"tp: {tp} ranks need {tp} GPUs (one each), {torch.cuda.device_count()} visible")
    cfg = TP_SHAPES[shape]
    for name in ("num_attention_heads", "num_key_value_heads"):
        if cfg[name] % tp:
            raise ValueError(f"tp: {shape} has {cfg[name]} {name.replace('num_', '').replace('_', ' ')}, "
                             f"not a multiple of --tp {tp}")
    for b in baselines:
        if b not in e2e.BASELINES:
            raise ValueError(f"baselines: expected names from {', '.join(e2e.BASELINES)}, got {b!r}")
    # the fit is read here, once: a shape without one fails before any rank starts
    params = None if attention == "uniform" else peaked if peaked is not None else fitted(shape)[0]
    timing = dict(steps=steps, method_steps=method_steps, hf_steps=hf_steps, warmup=warmup)
    kw = dict(shape=shape, cases=list(cases), methods=list(methods), baselines=list(baselines), timing=timing,
              dtype=dtype, device=device, graph=graph, attention=attention, peaked=params)
    got: dict[str, Any] = {"rows": []}
    failed = []
    with mp.Manager() as manager:
        for case in cases:  # ranks of its own per case: see the module doc
            out = manager.dict()
            try:
                # a rank stuck in a collective (another rank failed) gives up after timeout_s instead of hanging
                launch(_rank_bench, tp, {**kw, "cases": [case]}, out,
                       backend="nccl" if device == "cuda" else "gloo", timeout_s=300)
            except Exception as exc:  # a case whose ranks failed keeps the cases run before it, and says why
                failed.append(exc)
                got["rows"].append({"shape": shape, "tp": tp, "batch": case[0], "n": case[1], "variant": "*",
                                    "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            part = dict(out)
            got["rows"] += part.get("rows", [])
            for key in ("device", "copy_bandwidth_bytes_per_s", "calibration"):
                if got.get(key) is None:
                    got[key] = part.get(key)
    if failed and len(failed) == len(cases):
        raise failed[-1]  # nothing ran: the error, not an empty table
    return {
        **environment("e2e-tp", "cpu", dtype),  # (this launcher holds no GPU: the device is the ranks')
        "device": got.get("device"),
        "tp": tp,
        "protocol": (f"random weights built directly sharded by transformers' tensor-parallel plan over {tp} ranks "
                     f"({'NCCL' if device == 'cuda' else 'gloo'})"
                     + ("" if params is None else ", rewritten on every rank for peaked attention (bench/peaked.py; "
                        "each rank its shard of the same whole tensors)")
                     + f"; each case in ranks of its own, as kvsieve bench e2e on every rank "
                     f"(one prefill; {warmup} warm-up steps then {steps} timed steps (graph) or {method_steps} "
                     f"(eager), {hf_steps} for hf-eager); ms and host ms of rank 0, every rank's in *_by_rank; "
                     "per-rank floor = (rank weights + rank K/V) / copy rate + the step's collectives timed alone, "
                     "each the way the runtime issues it (collective_path)"),
        "copy_bandwidth_bytes_per_s": got.get("copy_bandwidth_bytes_per_s"),
        "attention": attention,
        "peaked": None if params is None else params.to_dict(),
        "calibration": got.get("calibration", {}),
        "rows": got.get("rows", []),
    }


def markdown(results: dict, command: str) -> str:
    # a results file without the key: its ranks built plain random weights, whatever its command line says
    attention = results.get("attention", "uniform")
    lines = [f"# kvsieve bench e2e --tp {results['tp']}: {results['device']}, {results['date']}", "",
             f"`{command}`", "", results["protocol"], "",
             f"Attention: {ATTENTION_LABELS.get(attention, attention)}"
             + ("" if not results.get("peaked") else f"; parameters {results['peaked']}") + ".", "",
             "| shape | tp | batch | N | variant | ms/step | ms by rank | tok/s | vs dense | vs hf-eager "
             "| collectives ms | rank floor ms | of floor | host ms by rank | graph |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = fmt
    for r in results["rows"]:
        if "ms" not in r:
            lines.append(f"| {r['shape']} | {r['tp']} | {r['batch']} | {r['n']} | {r['variant']} | "
                         f"{r.get('error') or r.get('skipped')} |||||||||||")
            continue
        by_rank = ", ".join(f(x, ".2f") for x in r.get("ms_by_rank") or [])
        host = ", ".join(f(x, ".3f") for x in r.get("host_ms_by_rank") or [])
        lines.append(f"| {r['shape']} | {r['tp']} | {r['batch']} | {r['n']} | {r['variant']} | {r['ms']:.2f} | "
                     f"{by_rank} | {r['tokens_per_s']:.1f} | {f(r.get('speedup_vs_runtime_dense'), '.2f')} | "
                     f"{f(r.get('speedup_vs_hf_eager'), '.2f')} | {f(r.get('collective_ms'), '.3f')} | "
                     f"{f(r.get('tp_floor_ms'), '.2f')} | {f(r.get('fraction_of_tp_floor'), '.2f')} | {host} | "
                     f"{r.get('graph')} |")
    return "\n".join(lines + [""] + e2e.breakdown_lines(results["rows"], " on rank 0")
                     + e2e.calibration_lines(results)) + "\n"


def write_results(results: dict, out_dir, stem: str, command: str) -> list:
    """``<stem>.json``, ``.md`` and ``.png`` (tokens/s against context, where matplotlib is installed)."""
    from .report import write_results as write

    return write(results, out_dir, stem, command, markdown, e2e.plot)
