"""``kvsieve bench e2e``: whole-model decode steps per method, on a known model shape with random weights.

For each model shape (a config written here, weights random: nothing is downloaded), batch size and
context N: the runtime prefills N random tokens per row once, then each variant decodes from the same
prefilled cache (``DecodeRuntime.rewind`` between variants):

- ``runtime``: kvsieve's runtime with dense attention (Triton split-KV kernel, step captured in a
  CUDA graph);
- a method spec (``santa-prop:budget=128``, ...): the runtime with that method in every layer (in the
  graph when the method's decode is capturable, else eagerly; ``graph`` in the results says which);
- ``hf-eager``: transformers' own eager decode (DynamicCache, SDPA) from the same prompt K/V, run last
  because it takes over the runtime's cache memory layer by layer.

Reported per (variant, N, batch): ms per decode step (median of per-step CUDA-event times, and the
mean of one timed loop), tokens/s (batch / step time), speedups vs runtime-dense and vs hf-eager, host
time per step (``host_ms``: the median time ``step()`` takes to return with the device idle before it —
the graph replay plus bookkeeping; ``issue_ms``: the mean time to issue
a step inside the timed loop, which also counts the host waiting on a full launch queue), and the
fraction of the physical floor: (weights read per step + the K/V bytes the method reads) / the
measured device copy rate (read + write), the byte floor.

``run_ttft_bench`` (``kvsieve bench e2e --ttft``) times the prompt instead: time to first token = one
prefill of the N-token prompt (every row, one forward each) + the first token, per variant:

- ``runtime``: the runtime's exact prefill (SDPA, causal flash, over each row);
- a method spec with a sparse prefill (default ``sketchwalk``, the authors' algorithm, and
  ``sketchwalk:variant=reconstruction,density=0.1``): the runtime with
  ``prefill=<spec>`` (that method's block-sparse prefill on its sparse layers, SDPA on the others);
- ``hf-eager``: transformers' own forward of the prompt (DynamicCache, SDPA) + argmax of the last
  position's logits.

Every variant computes the logits of the last position only (``logits_to_keep=1``): all positions' logits
would be N × vocab (33 GB at 128k for Llama 3.1). Timed with CUDA events around the whole call after
``warmup`` untimed calls (which compile FlexAttention for that shape), median of ``repeats``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .peaked import ATTENTION_LABELS, bench_prompts, calibration_markdown
from .report import environment, fmt
from .saap_fit import fit_line, fitted_specs
from .timing import step_kernel_kinds

# Shapes only (the decode cost does not depend on RoPE scaling or the weights' values).
MODEL_SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=131072 + 4096, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=131072 + 4096, tie_word_embeddings=False, use_sliding_window=False),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, tie_word_embeddings=True),
}
BASELINES = ("runtime", "hf-eager")
# Sketch&Walk's default (the authors' algorithm) and the reconstruction at 10 % of the blocks
TTFT_METHODS = ("sketchwalk", "sketchwalk:variant=reconstruction,density=0.1")


def build_model(shape: str, *, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                **overrides):
    """A causal LM of ``shape`` with random weights, on ``device``, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape not in MODEL_SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(MODEL_SHAPES)}, got {shape!r}")
    kw = {**MODEL_SHAPES[shape], **overrides}
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def _bench_model(shape, attention, peaked, device, dtype, results: dict, todo, log):
    """The shape's random-weight model for ``attention`` (``bench.peaked``), its attention profile recorded
    in ``results["calibration"][shape]``."""
    from .peaked import build_bench_model, calibration_record, run_profile

    model = build_bench_model(build_model, shape, attention, peaked, device=device, dtype=dtype)
    measured = run_profile(model, [n for _, n in todo], log=log)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the profile's prefill cache: the cases' memory checks read the free memory
    results["calibration"][shape] = calibration_record(shape, getattr(model, "peaked_attention", None), measured)
    return model


def weights_read_per_step(model) -> int:
    """Bytes of weights a decode step reads: every parameter once, except an untied input embedding
    (a step reads B of its rows)."""
    from ..runtime.parallel import local_tensor as local  # a tensor-parallel rank reads its own shard

    seen, total = set(), 0
    inp = model.get_input_embeddings().weight
    tied = local(inp).data_ptr() == local(model.get_output_embeddings().weight).data_ptr()
    for p in model.parameters():
        if local(p).data_ptr() in seen or (p is inp and not tied):
            continue
        seen.add(local(p).data_ptr())
        total += local(p).numel() * local(p).element_size()
    return total


def time_steps(step: Callable[[], None], n: int, cuda: bool) -> dict[str, float]:
    """Per-step CUDA-event times (median), the mean over one loop, and the host time to issue a step."""
    if not cuda:
        t = []
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            t.append((time.perf_counter() - t0) * 1e3)
        return {"ms": statistics.median(t), "loop_ms": sum(t) / n, "host_ms": float("nan"), "issue_ms": float("nan")}
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s, e in events:
        s.record()
        step()
        e.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    loop = time.perf_counter() - t0
    per = [s.elapsed_time(e) for s, e in events]
    return {"ms": statistics.median(per), "loop_ms": loop / n * 1e3, "issue_ms": host / n * 1e3,
            "min_ms": min(per), "max_ms": max(per)}


HOST_STEPS = 9


def host_ms(step: Callable[[], None], n: int = HOST_STEPS) -> dict[str, float]:
    """Host time of one step with the device idle before it: the replay (or eager launches) plus the
    runtime's bookkeeping, without waiting on earlier steps' work. ``host_ms`` the median, ``host_min_ms``
    the fastest: the minimum beside the median tells a steady cost from interference (such as CUPTI's, see
    ``_PROFILED``)."""
    t = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return {"host_ms": statistics.median(t), "host_min_ms": min(t)}


BREAKDOWN_STEPS = 3
# eager steps a captured variant runs after its timing, for its density and bytes (captured steps record none)
STATS_STEPS = 2
# The torch profiler keeps CUPTI attached after its first use in a process that captures CUDA graphs
# (torch/profiler/profiler.py sets TEARDOWN_CUPTI=0: teardown crashes with graphs), and every later launch
# pays CUPTI's callbacks: captured decode steps measured 0.3-0.8 ms of host time after a profiled variant
# against 13-22 us in a process never profiled (docs/results/studies/runtime-host/README.md). So each case profiles
# its variants only after timing all of them, and host times taken after any profiling are flagged.
_PROFILED = {"done": False}


def kernel_breakdown(step: Callable[[], None], n: int = BREAKDOWN_STEPS) -> dict | None:
    """``timing.step_kernel_kinds`` over ``n`` steps, the process marked as profiled (see ``_PROFILED``)."""
    torch.cuda.synchronize()
    _PROFILED["done"] = True
    return step_kernel_kinds(step, n)


def _kv_bytes_dense(rt, keys: float) -> float:
    """K and V bytes of ``keys`` valid keys (summed over rows) in every layer."""
    s = rt.shape
    elt = torch.finfo(rt.dtype).bits // 8
    kv_heads = rt.tp.kv_heads if rt.tp is not None else s.kv_heads  # a tensor-parallel rank's own heads
    return keys * kv_heads * 2 * s.head_dim * elt * s.layers


def run_e2e_bench(*, shapes: Sequence[str] = ("llama-3.1-8b",), contexts: Sequence[int] = (32768, 131072),
                  batches: Sequence[int] = (1, 8), methods: Sequence[str] = ("santa-prop:budget=128",),
                  baselines: Sequence[str] = BASELINES, steps: int = 30, method_steps: int = 8, warmup: int = 3,
                  hf_steps: int = 4, dtype: torch.dtype = torch.bfloat16, prefill_chunk: int | None = None,
                  cases: Sequence[tuple[int, int]] | None = None, device: str = "cuda",
                  log: Callable[[str], None] = print, checkpoint: Callable[[dict], None] | None = None,
                  saap_fits: str | None = None, attention: str = "uniform", peaked=None) -> dict:
    """Rows of ms/step per (shape, batch, context, variant); see the module docstring. ``checkpoint``
    is called with the results so far after every case (the CLI writes its files there). A method that
    needs a fit and gives no ``artifacts`` (``saap:probes=32``) gets the shape's bench fit, made or loaded
    in ``saap_fits`` (:mod:`kvsieve.bench.saap_fit`; ``results["saap_fits"]`` says how and how long).
    ``attention``: ``uniform`` (random weights, flat attention) or ``peaked`` (``bench.peaked``: ``peaked``
    or the shape's committed fit); the results carry the attention profile measured on the model."""
    from .peaked import check_attention
    from .timing import copy_bandwidth

    check_attention(attention, peaked)

    cuda = torch.device(device).type == "cuda"
    for b in baselines:
        if b not in BASELINES:
            raise ValueError(f"baselines: expected names from {', '.join(BASELINES)}, got {b!r}")
    peak = copy_bandwidth(device) if cuda else float("nan")
    if cuda:
        torch.cuda.empty_cache()  # the memory checks below read the driver's free memory
        log(f"device-to-device copy: {peak / 1e12:.2f} TB/s (bytes read + written)")
    rows: list[dict] = []
    results = {
        **environment("e2e", device, dtype),
        "protocol": (f"random weights; N random prompt tokens per row prefilled once (SDPA, "
                     f"{'one forward per row' if prefill_chunk is None else f'chunks of {prefill_chunk}'});"
                     f" per variant {warmup} warm-up steps then {steps} timed steps (graph) or {method_steps} (eager"
                     f" steps), {hf_steps} for hf-eager; ms = median per-step CUDA-event time; host ms = median time"
                     f" step() takes to return with the device idle ({HOST_STEPS} steps, the fastest in brackets;"
                     f" hf-eager: its issue time in the timed loop); greedy"),
        "copy_bandwidth_bytes_per_s": peak,
        "attention": attention,
        "calibration": {},
        "rows": rows,
    }
    todo = list(cases) if cases is not None else [(b, n) for b in batches for n in contexts]
    timing = dict(steps=steps, method_steps=method_steps, hf_steps=hf_steps, warmup=warmup)
    for shape in shapes:
        t0 = time.perf_counter()
        model = _bench_model(shape, attention, peaked, device, dtype, results, todo, log)
        weights = weights_read_per_step(model)
        log(f"{shape}: built with random weights in {time.perf_counter() - t0:.1f} s; "
            f"{weights / 1e9:.2f} GB of weights read per step")
        specs = fitted_specs(methods, model, shape, saap_fits, results, log)
        for batch, n in todo:
            base = {"shape": shape, "batch": batch, "n": n}
            try:
                case_rows = _run_case(model, base, weights, methods, baselines, timing, prefill_chunk, cuda, log,
                                      specs)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory in prefill: keep the other cases
                case_rows = [{**base, "variant": "*", "error": f"{type(exc).__name__}: {exc}"[:300]}]
                log(_line(case_rows[0]))
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            _derive(case_rows, peak)
            rows.extend(case_rows)
            if checkpoint is not None:
                checkpoint(results)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return results


def _start_variant(rt, variant: str, warmup: int, prompts, specs: dict[str, str] | None = None,
                   graph: bool | str = "auto") -> None:
    """The runtime set to ``variant`` (``runtime`` = dense), back to just after prefill, ``warmup`` steps run
    (the first captures the step). A method whose decode starts from its record of the prompt (Sketch&Walk's
    sketches) sees the prompts again: an exact prefill with it in place, not timed here."""
    rt.set_method("dense" if variant == "runtime" else (specs or {}).get(variant, variant), graph=graph)
    if rt.records_prompt:
        rt.prefill(prompts)
    rt.rewind()
    for _ in range(warmup):
        rt.step()


def _run_case(model, base: dict, weights: int, methods, baselines, timing: dict, prefill_chunk, cuda: bool,
              log, specs: dict[str, str] | None = None, graph: bool | str = "auto") -> list[dict]:
    """The rows of one (shape, batch, N): one prefill, every runtime variant, then hf-eager. On a
    tensor-parallel model (``bench/e2e_tp.py``) every rank runs it, with its own heads' cache."""
    from ..runtime import DecodeRuntime

    batch, n, cfg = base["batch"], base["n"], model.config
    steps, method_steps, hf_steps, warmup = (timing[k] for k in ("steps", "method_steps", "hf_steps", "warmup"))
    new = 1 + warmup + max(steps, method_steps, hf_steps) + HOST_STEPS + BREAKDOWN_STEPS + 1
    if n + new > cfg.max_position_embeddings:
        return [{**base, "variant": "*", "skipped": f"context {n} + {new} > the shape's {cfg.max_position_embeddings}"}]
    kv_heads = cfg.num_key_value_heads // (getattr(model, "_tp_size", None) or 1)  # this rank's
    kv_per_key = kv_heads * 2 * (cfg.hidden_size // cfg.num_attention_heads) * 2 * cfg.num_hidden_layers
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        kv = batch * (n + new) * kv_per_key
        if kv * 1.15 + 6e9 > free:
            log(f"skip {base}: cache {kv / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
            return [{**base, "variant": "*",
                     "skipped": f"K/V cache {kv / 1e9:.1f} GB does not fit in {free / 1e9:.1f} GB free"}]
    g = torch.Generator().manual_seed(n + batch)
    prompts = bench_prompts(model, n, batch, g)
    case_rows = []
    rt = DecodeRuntime(model, "dense", batch_size=batch, capacity=n + new, max_new_tokens=new,
                       eos_token_id=[], graph=graph, prefill_chunk=prefill_chunk)
    with rt:
        rt.prefill(prompts)
        log(f"{base}: prefill {rt.stats.prefill_s:.1f} s")
        variants = (["runtime"] if "runtime" in baselines else []) + list(methods)
        for variant in variants:
            row = {**base, "variant": variant}
            try:
                _start_variant(rt, variant, warmup, prompts, specs, graph)
                n_steps = steps if rt.use_graph else method_steps
                rt.stats.log.clear()
                # valid keys summed over rows, averaged over the timed steps
                keys = sum(rt.host_lengths()) + batch * (n_steps - 1) / 2
                row.update(time_steps(rt.step, n_steps, cuda))
                if cuda:
                    row.update(host_ms(rt.step), host_after_profiler=_PROFILED["done"])
                # what was timed: read before the eager stats steps below change the runtime's choice
                row.update(graph=rt.use_graph, graph_reason=rt.stats.graph_reason,
                           attention_backend=rt.attention_backend, weights_bytes=weights,
                           compiled_ops=rt.stats.compiled_ops, fused_projections=rt.stats.fused_projections,
                           cache_write=rt.stats.cache_write,
                           fallbacks=list(rt.stats.fallbacks), **({"tp_stats": rt.stats.tp} if rt.stats.tp else {}))
                recs, stat_steps, source = rt.stats.records, n_steps, "method stats"
                if not recs and variant != "runtime":
                    # a captured step records no stats: the density comes from a few eager steps from the same point
                    _start_variant(rt, variant, 0, prompts, specs, False)
                    rt.stats.log.clear()
                    for _ in range(STATS_STEPS):
                        rt.step()
                    recs, stat_steps = rt.stats.records, STATS_STEPS
                    source = f"method stats of {STATS_STEPS} eager steps"
                if recs:
                    per_step = sum(r["bytes_read"] for r in recs) / stat_steps
                    row["kv_bytes_source"] = source
                    row["density"] = sum(r["kv_density"] for r in recs) / len(recs)
                    row["method_backends"] = sorted({r["backend"] for r in recs})
                else:
                    per_step = _kv_bytes_dense(rt, keys)
                    row["kv_bytes_source"] = "all valid keys"
                row.update(kv_bytes=per_step, timed_steps=n_steps)
            except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            case_rows.append(row)
            log(_line(row))
        if cuda:  # after every variant's timing: see _PROFILED
            for row in case_rows:
                if "error" in row:
                    continue
                try:
                    _start_variant(rt, row["variant"], warmup, prompts, specs, graph)
                    row["breakdown"] = kernel_breakdown(rt.step)
                except Exception as exc:  # noqa: BLE001 - the breakdown is optional
                    row["breakdown_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if "hf-eager" in baselines:
        row = {**base, "variant": "hf-eager"}
        try:
            row.update(_hf_eager(model, rt, n, hf_steps, warmup=1, cuda=cuda))
            row.update(graph=False, attention_backend="sdpa (transformers)", weights_bytes=weights,
                       kv_bytes=batch * n * kv_per_key, kv_bytes_source="all valid keys")
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        case_rows.append(row)
        log(_line(row))
    return case_rows


def _hf_eager(model, rt, n: int, steps: int, warmup: int, cuda: bool) -> dict:
    """transformers' eager decode (DynamicCache, SDPA) from the runtime's prompt K/V. Each layer's K/V
    move into the DynamicCache and the runtime's buffer is freed at once, so peak memory stays one cache."""
    from transformers import DynamicCache

    from ..integrations.models import cache_argument

    cache = DynamicCache()
    for i, layer in enumerate(rt.cache.layers):
        cache.update(layer.keys[:, :, :n], layer.values[:, :, :n], i)
        layer.keys = layer.values = None
    tokens = rt.tokens_in.clone()
    rt.cache.layers = []

    @torch.no_grad()
    def step():
        nonlocal tokens
        out = model(input_ids=tokens, use_cache=True, logits_to_keep=1, **{cache_argument(): cache})
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(warmup):
        step()
    timed = time_steps(step, steps, cuda)
    # eager: the host issues every kernel of the step, so its issue time is its host time
    return {"host_ms": timed["issue_ms"], **timed}


# -- time to first token -----------------------------------------------------------------------------


def check_ttft_methods(methods: Sequence[str]) -> None:
    """Every method spec must have a sparse prefill (``sparse_prefill``); ValueError naming ``methods``."""
    from ..core.registry import method as build_method

    for spec in methods:
        m = build_method(spec)
        if not m.sparse_prefill:
            raise ValueError(f"methods: {m.name} has no sparse prefill; the time-to-first-token bench times "
                             "methods' sparse prefills (sketchwalk), the runtime's exact prefill and transformers'")


def _time_prefill(run: Callable[[], object], repeats: int, warmup: int, cuda: bool) -> tuple[dict, object]:
    """Median time of ``run`` (CUDA events around the whole call, the device idle before it) over ``repeats``
    calls after ``warmup`` untimed ones; also wall-clock times and the warm-up's (compilation) time."""
    t0 = time.perf_counter()
    out = None
    for _ in range(warmup):
        out = run()
    if cuda:
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    device_ms, wall_ms = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            start.record()
            out = run()
            end.record()
            torch.cuda.synchronize()
            wall_ms.append((time.perf_counter() - t) * 1e3)
            device_ms.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            out = run()
            wall_ms.append((time.perf_counter() - t) * 1e3)
    times = device_ms if cuda else wall_ms
    return {"ttft_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeats_ms": times,
            "wall_ms": statistics.median(wall_ms), "warmup_s": warm_s}, out


def run_ttft_bench(*, shapes: Sequence[str] = ("llama-3.1-8b",), contexts: Sequence[int] = (65536, 131072),
                   batches: Sequence[int] = (1,), methods: Sequence[str] = TTFT_METHODS,
                   baselines: Sequence[str] = BASELINES, repeats: int = 3, warmup: int = 1,
                   dtype: torch.dtype = torch.bfloat16, cases: Sequence[tuple[int, int]] | None = None,
                   device: str = "cuda", log: Callable[[str], None] = print,
                   checkpoint: Callable[[dict], None] | None = None, attention: str = "uniform",
                   peaked=None) -> dict:
    """Time-to-first-token rows per (shape, batch, context, variant); see the module docstring and
    ``run_e2e_bench`` for ``attention``."""
    from .peaked import check_attention

    check_attention(attention, peaked)
    for b in baselines:
        if b not in BASELINES:
            raise ValueError(f"baselines: expected names from {', '.join(BASELINES)}, got {b!r}")
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    check_ttft_methods(methods)
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    rows: list[dict] = []
    results = {
        **environment("e2e-ttft", device, dtype),
        "protocol": (f"random weights; N random prompt tokens per row; time to first token = prefill (one forward "
                     f"per row; the last position's logits only) + the first token (greedy); {warmup} untimed "
                     f"call(s), then the median of {repeats} ({'CUDA-event' if cuda else 'wall-clock'} time "
                     "around the whole call)"),
        "attention": attention,
        "calibration": {},
        "rows": rows,
    }
    todo = list(cases) if cases is not None else [(b, n) for b in batches for n in contexts]
    for shape in shapes:
        t0 = time.perf_counter()
        model = _bench_model(shape, attention, peaked, device, dtype, results, todo, log)
        log(f"{shape}: built with random weights in {time.perf_counter() - t0:.1f} s")
        for batch, n in todo:
            base = {"shape": shape, "batch": batch, "n": n}
            try:
                case_rows = _run_ttft_case(model, base, methods, baselines, repeats, warmup, cuda, log)
            except Exception as exc:  # noqa: BLE001 - keep the other cases
                case_rows = [{**base, "variant": "*", "error": f"{type(exc).__name__}: {exc}"[:300]}]
                log(_ttft_line(case_rows[0]))
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            _derive_ttft(case_rows)
            rows.extend(case_rows)
            if checkpoint is not None:
                checkpoint(results)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return results


def _run_ttft_case(model, base: dict, methods, baselines, repeats: int, warmup: int, cuda: bool, log) -> list[dict]:
    """The rows of one (shape, batch, N): the runtime's exact prefill, each sparse prefill, then transformers'
    (after the runtime's cache is freed, so that one cache is alive at a time)."""
    from ..runtime import DecodeRuntime

    batch, n, cfg = base["batch"], base["n"], model.config
    if n + 1 > cfg.max_position_embeddings:
        return [{**base, "variant": "*", "skipped": f"context {n} + 1 > the shape's {cfg.max_position_embeddings}"}]
    elt = torch.finfo(next(model.parameters()).dtype).bits // 8
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = batch * (n + 1) * cfg.num_key_value_heads * 2 * head_dim * elt * cfg.num_hidden_layers
    # one layer's activations of one row's forward: the MLP's intermediates (about three alive at once)
    # and a few hidden-size tensors (residual, norm, q, attention output)
    act = n * (3 * cfg.intermediate_size + 8 * cfg.hidden_size) * elt
    if cuda:
        free, _ = torch.cuda.mem_get_info()
        if kv * 1.15 + act + 4e9 > free:
            log(f"skip {base}: cache {kv / 1e9:.1f} GB + activations {act / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
            return [{**base, "variant": "*", "skipped": f"K/V cache {kv / 1e9:.1f} GB + prefill activations "
                                                         f"{act / 1e9:.1f} GB do not fit in {free / 1e9:.1f} GB free"}]
    g = torch.Generator().manual_seed(n + batch)
    prompts = bench_prompts(model, n, batch, g)
    case_rows = []
    variants = (["runtime"] if "runtime" in baselines else []) + list(methods)
    if variants:
        # decode never runs (one new token: the prefill's): no graph, nothing compiled but FlexAttention
        rt = DecodeRuntime(model, "dense", batch_size=batch, capacity=n + 1, max_new_tokens=1, eos_token_id=[],
                           graph=False, compile_ops=False)
        with rt:
            for variant in variants:
                row = {**base, "variant": variant}
                try:
                    rt.set_method("dense", graph=False, prefill="exact" if variant == "runtime" else variant)

                    def run():
                        rt.prefill(prompts)

                    timing, _ = _time_prefill(run, repeats, warmup, cuda)
                    row.update(timing)
                    st = rt.stats
                    sparse = st.prefill == "sparse"
                    row.update(prefill=st.prefill, prefill_method=st.prefill_method,
                               prefill_sparse_layers=st.prefill_sparse_layers,
                               block_density=st.prefill_block_density if sparse else None,
                               density=st.prefill_mean("density") if sparse else None,
                               prefill_backends=sorted({r["backend"] for r in st.prefill_records}),
                               first_token=rt.out_tokens[:, 0].tolist(), prefill_s=st.prefill_s,
                               attention="sdpa" + (f" + {'/'.join(sorted({r['backend'] for r in st.prefill_records}))}"
                                                   " (sparse layers)" if sparse else ""))
                except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                case_rows.append(row)
                log(_ttft_line(row))
        del rt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if "hf-eager" in baselines:
        row = {**base, "variant": "hf-eager"}
        try:
            ids = torch.stack(prompts)

            @torch.no_grad()
            def run_hf():
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                return out.logits[:, -1].argmax(-1)

            timing, tokens = _time_prefill(run_hf, repeats, warmup, cuda)
            row.update(timing)
            row.update(prefill="exact", attention=f"{model.config._attn_implementation} (transformers)",
                       first_token=tokens.tolist())
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        case_rows.append(row)
        log(_ttft_line(row))
    return case_rows


def _derive_ttft(rows: list[dict]) -> None:
    base = next((r for r in rows if r["variant"] == "runtime" and "ttft_ms" in r), None)
    hf = next((r for r in rows if r["variant"] == "hf-eager" and "ttft_ms" in r), None)
    for r in rows:
        if "ttft_ms" not in r:
            continue
        if base is not None:
            r["speedup_vs_runtime_dense"] = base["ttft_ms"] / r["ttft_ms"]
            r["first_token_as_dense"] = r.get("first_token") == base.get("first_token")
        if hf is not None:
            r["speedup_vs_hf_eager"] = hf["ttft_ms"] / r["ttft_ms"]


def _ttft_line(r: dict) -> str:
    head = f"{r['shape']} b={r['batch']} n={r['n']} {r['variant']}"
    if "skipped" in r:
        return f"{head}: skipped: {r['skipped']}"
    if "error" in r:
        return f"{head}: {r['error']}"
    dens = f" block density {r['block_density']:.3f}" if r.get("block_density") is not None else ""
    return (f"{head}: time to first token {r['ttft_ms']:.1f} ms (min {r['min_ms']:.1f}, max {r['max_ms']:.1f}; "
            f"warm-up {r['warmup_s']:.1f} s); prefill={r.get('prefill')}{dens}")


def _header(title: str, results: dict, command: str) -> list[str]:
    """The lines every e2e markdown report starts with: title, versions, command, protocol."""
    return [
        f"# {title} — {results['device']}",
        "",
        f"- date: {results['date']}; torch {results['torch']}, transformers {results['transformers']}, "
        f"triton {results['triton']}; {results['dtype']}",
        f"- command: `{command}`",
        f"- protocol: {results['protocol']}",
        f"- attention: {ATTENTION_LABELS.get(results.get('attention'), results.get('attention', 'uniform'))}",
    ] + [f"- SAAP fit for {shape}: {fit_line(fit)}" for shape, fit in results.get("saap_fits", {}).items()]


def calibration_lines(results: dict) -> list[str]:
    """The markdown of every shape's attention calibration in ``results`` (``peaked.calibration_markdown``)."""
    return [line for shape, cal in results.get("calibration", {}).items() for line in calibration_markdown(cal, shape)]


def _groups(rows: list[dict]):
    """(shape, batch, that group's rows) in sorted order: one markdown section each."""
    for shape in sorted({r["shape"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows if r["shape"] == shape}):
            yield shape, batch, [r for r in rows if r["shape"] == shape and r["batch"] == batch]


def ttft_markdown(results: dict, command: str) -> str:
    lines = _header("Time to first token", results, command) + [
        "- runtime = kvsieve's runtime with its exact prefill (SDPA); hf-eager = transformers' forward of the "
        "prompt (DynamicCache, SDPA); other rows = the runtime with that method's sparse prefill "
        "(`prefill=<spec>`; the method's dense layers run SDPA); block density = kept key blocks / causal "
        "blocks over the sparse layers",
        "",
    ]
    for shape, batch, sel in _groups(results["rows"]):
        lines += [f"## {shape}, batch {batch}", "",
                  "| N | variant | time to first token ms | min–max ms | vs runtime-dense | vs hf-eager "
                  "| prefill | sparse layers | block density | attention | first token = dense | warm-up s |",
                  "|---:|---|---:|---:|---:|---:|---|---:|---:|---|---|---:|"]
        order = {"runtime": 0, "hf-eager": 1}  # the baselines first, then the methods as given
        for r in sorted(sel, key=lambda r: (r["n"], order.get(r["variant"], 2))):
            if "skipped" in r or "error" in r:
                what = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error'][:160]}"
                lines.append(f"| {r['n']:,} | {r['variant']} | {what} | | | | | | | | | |")
                continue
            layers = r.get("prefill_sparse_layers")
            same = r.get("first_token_as_dense")
            lines.append(
                f"| {r['n']:,} | {r['variant']} | {r['ttft_ms']:.1f} | {r['min_ms']:.1f}–{r['max_ms']:.1f} "
                f"| {fmt(r.get('speedup_vs_runtime_dense'), '.2f')}x "
                f"| {fmt(r.get('speedup_vs_hf_eager'), '.2f')}x | {r.get('prefill')} "
                f"| {len(layers) if layers else '—'} | {fmt(r.get('block_density'), '.3f')} "
                f"| {r.get('attention')} | {'—' if same is None else 'yes' if same else 'no'} "
                f"| {r['warmup_s']:.1f} |")
        lines.append("")
    return "\n".join(lines + calibration_lines(results))


def _derive(rows: list[dict], peak: float) -> None:
    base = next((r for r in rows if r["variant"] == "runtime" and "ms" in r), None)
    hf = next((r for r in rows if r["variant"] == "hf-eager" and "ms" in r), None)
    for r in rows:
        if "ms" not in r:
            continue
        r["tokens_per_s"] = r["batch"] / (r["ms"] / 1e3)
        if base is not None:
            r["speedup_vs_runtime_dense"] = base["ms"] / r["ms"]
        if hf is not None:
            r["speedup_vs_hf_eager"] = hf["ms"] / r["ms"]
        if peak == peak:  # not NaN
            r["floor_ms"] = (r["weights_bytes"] + r["kv_bytes"]) / peak * 1e3
            r["fraction_of_floor"] = r["floor_ms"] / r["ms"]


def _line(r: dict) -> str:
    head = f"{r['shape']} b={r['batch']} n={r['n']} {r['variant']}"
    if "skipped" in r:
        return f"{head}: skipped: {r['skipped']}"
    if "error" in r:
        return f"{head}: {r['error']}"
    host = r.get("host_ms", float("nan"))
    return (f"{head}: {r['ms']:.2f} ms/step (loop {r['loop_ms']:.2f}, host {host:.3f}); graph={r.get('graph')}"
            f" backend={r.get('attention_backend')}")


def _host_cell(r: dict) -> str:
    cell = fmt(r.get("host_ms"), ".3f")
    cell = f"{cell} ({r['host_min_ms']:.3f})" if "host_min_ms" in r else cell
    return cell + "†" if r.get("host_after_profiler") else cell


def markdown(results: dict, command: str) -> str:
    if results.get("kind") == "e2e-ttft":
        return ttft_markdown(results, command)
    lines = _header("End-to-end decode benchmark", results, command) + [
        f"- floor = (weights read per step + K/V bytes the method reads) / device copy rate "
        f"({results['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, read + write)",
        "- runtime = kvsieve's decode runtime with dense attention; hf-eager = transformers' eager decode "
        "(DynamicCache, SDPA); other rows = the runtime with that method",
        "",
    ]
    rows = results["rows"]
    for shape, batch, sel in _groups(rows):
        lines += [f"## {shape}, batch {batch}", "",
                  "| N | variant | ms/step | tokens/s | vs runtime-dense | vs hf-eager | floor ms | of floor "
                  "| host ms | graph | attention | K/V density |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
        for r in sorted(sel, key=lambda r: (r["n"], r["variant"])):
            if "skipped" in r:
                lines.append(f"| {r['n']:,} | {r['variant']} | skipped: {r['skipped']} | | | | | | | | | |")
                continue
            if "error" in r:
                lines.append(f"| {r['n']:,} | {r['variant']} | error: {r['error'][:120]} | | | | | | | | | |")
                continue
            lines.append(
                f"| {r['n']:,} | {r['variant']} | {r['ms']:.2f} | {r['tokens_per_s']:.1f} "
                f"| {fmt(r.get('speedup_vs_runtime_dense'), '.2f')}x "
                f"| {fmt(r.get('speedup_vs_hf_eager'), '.2f')}x "
                f"| {fmt(r.get('floor_ms'), '.2f')} | {fmt(r.get('fraction_of_floor'), '.0%')} "
                f"| {_host_cell(r)} | {'yes' if r.get('graph') else 'no'} "
                f"| {r.get('attention_backend')} | {fmt(r.get('density'), '.3f')} |")
        lines.append("")
    lines += breakdown_lines(rows)
    if any(r.get("host_after_profiler") for r in rows):
        lines += ["† host time taken after the torch profiler ran in this process (an earlier case's kernel "
                  "breakdown): CUPTI stays attached once CUDA graphs were profiled, and its callbacks add to every "
                  "launch; run one case per process for clean host times.", ""]
    reasons = sorted({r["graph_reason"] for r in rows if r.get("graph_reason") and not r.get("graph")})
    if reasons:
        lines += ["Decode steps that ran without a CUDA graph, and why:", ""] + [f"- {x}" for x in reasons] + [""]
    return "\n".join(lines + calibration_lines(results))


def breakdown_lines(rows: list[dict], who: str = "") -> list[str]:
    """The markdown table of the rows' per-step device time by kernel kind (``kernel_breakdown``), a collectives
    column where any row has collectives; [] where no row has a breakdown. ``who``: whose steps were profiled."""
    broken = [r for r in rows if r.get("breakdown")]
    if not broken:
        return []
    comm = any(r["breakdown"].get("collective_ms") for r in broken)
    lines = [f"Per-step device time by kernel kind{who} (torch profiler, mean of {BREAKDOWN_STEPS} steps; gemm = "
             "the weights' matrix products" + ("; collectives = NCCL's and symmetric memory's all-reduce kernels"
                                              if comm else "") + "):", "",
             "| shape | batch | N | variant | attention ms | gemm ms | " + ("collectives ms | " if comm else "")
             + "other ms | kernels/step |",
             "|---|---:|---:|---|---:|---:|" + ("---:|" if comm else "") + "---:|---:|"]
    for r in sorted(broken, key=lambda r: (r["shape"], r["batch"], r["n"], r["variant"])):
        b = r["breakdown"]
        lines.append(f"| {r['shape']} | {r['batch']} | {r['n']:,} | {r['variant']} | {b['attention_ms']:.2f} "
                     f"| {b['gemm_ms']:.2f} | " + (f"{b.get('collective_ms', 0.0):.2f} | " if comm else "")
                     + f"{b['other_ms']:.2f} | {b['kernels']:.0f} |")
    return lines + [""]


def plot(results: dict, path) -> bool:
    """tokens/s vs context per variant; False (no file) where matplotlib is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return False
    from .report import plot_by_context

    if results.get("kind") == "e2e-ttft":
        rows = {**results, "rows": [r for r in results["rows"] if "ttft_ms" in r]}
        plot_by_context(rows, path, "ttft_ms", "context N (prompt tokens per row)", "time to first token (ms)")
        return True
    # Rows that failed (no "ms") carry no tokens/s and are left out.
    rows = {**results, "rows": [r for r in results["rows"] if "ms" in r]}
    plot_by_context(rows, path, "tokens_per_s", "context N (tokens per row)", "tokens/s (batch / median step time)")
    return True


def write_results(results: dict, out_dir, stem: str, command: str) -> list:
    """``<stem>.json``, ``.md`` and ``.png`` (where matplotlib is installed) of an e2e or TTFT run."""
    from .report import write_results as write

    return write(results, out_dir, stem, command, markdown, plot)
