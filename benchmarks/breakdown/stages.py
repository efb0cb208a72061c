"""Per-stage device time of one decode step of one layer: dense, santa-prop, Bernoulli qKᵀ + santa-prop and
vAttention (defaults), on the bench's random inputs (flat, sharpened, and with outlier query features).

For each (q scale, variant): the whole ``m.decode`` call captured in a CUDA graph and replayed with a cold L2
(``ColdL2Timer.time_graph_us``), and the torch profiler's device time per kernel over a few cold-L2 eager calls,
each kernel filed under the stage it belongs to (:data:`STAGES`; a kernel no stage claims is listed under its
own name); ``--cases`` also gives queries with outlier features (what Bernoulli qKᵀ's K saving needs). Launch
gaps are in the graph time, not in the stages. Writes ``stages.json`` and ``stages.md`` to the
folder given. ``--check`` runs every variant once on tiny CPU inputs (the methods' reference paths) and the
stage filing, without timing: what its test runs.

    python benchmarks/breakdown/stages.py OUT [--n 131072] [--batch 1] [--cases 1:gaussian,4:gaussian,1:outliers]
        [--variants dense,vattention] [--reference]

``--reference`` adds each method variant's error against its torch reference on the same draws.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

#: (stage, substrings of the kernel names it holds), first match wins
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("dense attention", ("_dense_split_kernel", "_short_rows_kernel", "dense_merge")),
    ("K feature-major append", ("_transpose_new_keys_kernel",)),
    ("bernoulli draw", ("_mean_group_draw_kernel",)),
    ("K stream: scores/stats", ("_ordered_stats_kernel", "_tile_stats_kernel", "_feature_major_stats_kernel",
                                "_scores_kernel")),
    ("santa tile budgets", ("_unit_budget_kernel", "_prop_budget_kernel")),
    ("santa V sampling", ("_overlap_sample_kernel", "_compact_sample_kernel", "_prop_sample_kernel",
                          "_prop_merge_kernel")),
    ("row words", ("_row_words_kernel",)),
    ("top-k select (triton)", ("_topk_rows_kernel", "_select_regs_kernel", "_group_sum_parts_kernel",
                               "_merge_rows_kernel")),
    ("top-k select (radix)", ("_radix_hist_kernel", "_radix_place_kernel", "_radix_emit_kernel")),
    ("top-k select (torch)", ("topk", "TopK", "radix", "Radix", "sort", "Sort", "bitonic", "Bitonic")),
    ("vattention residual setup", ("_residual_setup_kernel",)),
    ("uniform samples (base + residual)", ("_split_candidates_kernel", "_sample_rows_kernel", "_window_scan_kernel",
                                           "_window_cut_kernel", "_window_write_kernel")),
    ("vattention budget statistics", ("_budget_parts_kernel", "_budget_combine_kernel")),
    ("sparse attention", ("_sparse_split_kernel", "sparse_merge")),
    ("vattention tested-key attention", ("_attend_kernel",)),
    ("split-K merge", ("_merge_partials_kernel",)),
)


def stage_of(kernel: str) -> str:
    """The stage a kernel name is filed under (its own name when no stage claims it)."""
    for stage, parts in STAGES:
        if any(p in kernel for p in parts):
            return stage
    return "other: " + kernel[:60]


def variant_specs() -> dict[str, str | None]:
    """``variant -> method spec`` (None: the dense Triton kernel itself)."""
    return {
        "dense": None,
        "santa-prop:128": "santa-prop:budget=128",
        "bernoulli-qk+santa-prop:128": "bernoulli-qk:query=mean-group,values=santa-prop,budget=128",
        "vattention@list": "vattention",
        "vattention": "vattention",
        "vattention@triton-select": "vattention",
        "vattention@radix-select": "vattention",
        "vattention@budget-x4": "vattention",
        "vattention@budget-b64": "vattention",
    }


_VATT = "kvsieve.methods.vattention"
_BUDGET = "kvsieve.kernels.vattention.budget_triton"
_SELECT_ABOVE = ("kvsieve.kernels.oracle_topk.topk", "RADIX_SELECT_ABOVE")
#: variant -> ((module, limit, value), ...) set while it runs
LIMITS = {# the oracle predictor's top-k by each of the two ways its shape rule picks between, at every length:
          # the Triton select (a long row's candidates merged by a second launch), the radix select spread over the GPU
          "vattention@triton-select": ((*_SELECT_ABOVE, 1 << 40),),
          "vattention@radix-select": ((*_SELECT_ABOVE, 0),),
          # the per-query-head lists and the weighted sparse kernel in place of the tested-key attention pass
          "vattention@list": ((_VATT, "TESTED_ATTENTION", False),),
          # the budget statistics over 4x the programs (shorter programs; the same sums up to rounding)
          "vattention@budget-x4": ((_BUDGET, "SPLITS_PER_SM", 8),),
          # the budget statistics' loops over blocks of 64 entries at 8 warps (half the steps)
          "vattention@budget-b64": ((_BUDGET, "PARTS_BLOCK", 64), (_BUDGET, "PARTS_WARPS", 8))}


def with_limit(name: str, fn):
    """``fn`` run with ``LIMITS[name]`` set (the limits are read at call time; graph capture calls ``fn``)."""
    if name not in LIMITS:
        return fn
    import importlib

    settings = [(importlib.import_module(module), attr, value) for module, attr, value in LIMITS[name]]

    def call():
        before = [getattr(mod, attr) for mod, attr, _ in settings]
        for mod, attr, value in settings:
            setattr(mod, attr, value)
        try:
            return fn()
        finally:
            for (mod, attr, _), old in zip(settings, before, strict=True):
                setattr(mod, attr, old)

    return call


def grouped_topk(scores: torch.Tensor, maxima: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """The ``k`` largest of each row of ``scores [B, H, N]`` (positions, highest first) found in two smaller
    selections: the row's top k lie in the k groups of ``group`` consecutive scores with the largest maxima
    (``maxima [B, H, ceil(N / group)]``; a key x of the top k: fewer than k keys, so fewer than k groups'
    maxima, exceed its group's max), so the top k of those k·group scores. Exact up to ties."""
    n = scores.shape[-1]
    g_idx = torch.topk(maxima, k, dim=-1, sorted=False).indices
    pos = (g_idx[..., None] * group + torch.arange(group, device=scores.device)).flatten(-2)
    vals = scores.gather(-1, pos.clamp(max=n - 1)).masked_fill(pos >= n, float("-inf"))
    return pos.gather(-1, torch.topk(vals, k, dim=-1, sorted=True).indices)


def topk_calls(x, top_k: float = 0.025) -> dict:
    """vAttention's oracle top-k at its default size on ``x``'s scores, each way: the scores launch alone, then
    torch.topk of the whole rows, the Triton select (prefilter + radix select),
    and :func:`grouped_topk` (torch.topk of the maxima, then of the chosen groups' scores)."""
    from kvsieve.kernels.shared.scores import scores_triton
    from kvsieve.kernels.shared.select_triton import GROUP_MAX, topk_rows_triton

    b, hq, _ = x.q.shape
    n = x.k.shape[2]
    kk = max(1, int(top_k * n))
    counts = torch.empty(b, device=x.q.device, dtype=torch.int64)
    maxima = torch.empty(b, hq, -(-n // GROUP_MAX), device=x.q.device, dtype=torch.float32)

    def scores(with_max: bool = False):
        return scores_triton(x.q, x.k, x.lens, 128, 128, x.scale, counts=counts, size=top_k, max_k=kk,
                             maxima=maxima if with_max else None)

    return {
        "scores only": lambda: scores(),
        "scores + torch.topk": lambda: torch.topk(scores(), kk, dim=-1, sorted=True).indices,
        "scores + triton select": lambda: topk_rows_triton(scores(True), counts, kk, maxima=maxima),
        "scores + grouped torch.topk": lambda: grouped_topk(scores(True), maxima, kk, GROUP_MAX),
    }


def outlier_scales(d: int, device) -> torch.Tensor:
    """Per-feature query scales ``u³`` (u uniform, fixed seed) normalised to a mean square of 1: a few features
    carry most of |q|, as in real models' queries, where Bernoulli qKᵀ's draws skip many features (Gaussian
    queries keep ~97 % of them at B = 4). The scores' spread stays that of the Gaussian case."""
    u = torch.rand(d, generator=torch.Generator().manual_seed(3)) ** 3
    return (u / u.pow(2).mean().sqrt()).to(device)


def make_call(spec: str | None, q, k, v, lens, backend: str | None = None):
    """``(call, stats)``: one decode step of the variant (its state kept across calls) and its stats function."""
    import kvsieve
    from kvsieve.core.rng import RandomKey
    from kvsieve.kernels.shared.dense import dense_decode_triton

    if spec is None:
        scale = q.shape[-1] ** -0.5
        return (lambda: dense_decode_triton(q, k, v, lens, scale)), (lambda: {})
    m = kvsieve.method(spec if backend is None else f"{spec}{',' if ':' in spec else ':'}backend={backend}")
    state = m.new_state()
    # host counters, as the runtime's driver gives (request, layer): S²ANTA and Bernoulli take their seed by
    # value, and a device counter would be read back to the host, a copy graph capture refuses
    key = RandomKey(7, (0, 1))

    def call():
        return m.decode(q, k, v, lengths=lens, seed=key, state=state, check_finite=False)

    def stats():
        st = call()[1]
        out = {"density": st["density"], "kv_density": st["kv_density"], "backend": st["backend"],
               "kernel": st.extra.get("kernel", "")}
        for name in ("budget", "fixed_keys", "sampled_fraction", "k_access_group", "samples"):
            if name in st:
                out[name] = st[name]
        return out

    return (lambda: call()[0]), stats


def reference_error(spec: str, call, q, k, v, lens) -> float:
    """Relative error (Frobenius) of the variant's output against its torch reference on the same draws: the
    same keys up to near-ties, so a bf16-level error; a wrong selection or estimate shows as far more."""
    ref = make_call(spec, q, k, v, lens, backend="reference")[0]().float()
    return float((call().float() - ref).norm() / ref.norm())


def kernel_times(fn, flush, iters: int) -> dict[str, tuple[float, float]]:
    """``kernel name -> (mean µs per call, launches per call)`` over ``iters`` cold-L2 eager calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as fp:
        flush()
        torch.cuda.synchronize()
    flush_names = {e.name for e in fp.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    tot: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name in flush_names:
            continue
        t = tot.setdefault(e.name, [0.0, 0.0])
        t[0] += e.time_range.elapsed_us()
        t[1] += 1
    return {name: (t[0] / iters, t[1] / iters) for name, t in tot.items()}


def by_stage(kernels: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, (us, n) in kernels.items():
        s = out.setdefault(stage_of(name), {"us": 0.0, "launches": 0.0})
        s["us"] += us
        s["launches"] += n
    return out


def run(args) -> list[dict]:
    from kvsieve.bench.decode import Case, Inputs
    from kvsieve.bench.timing import ColdL2Timer

    timer = ColdL2Timer()
    rows = []
    for qs, features in args.cases:
        peaked = features == "peaked"
        x = Inputs(Case("llama-3.1-8b", 32, 8, 128, args.n, args.batch), torch.bfloat16, seed=0, q_scale=qs,
                   attention="peaked" if peaked else "uniform")
        if features == "outliers":
            x.q = (x.q.float() * outlier_scales(x.q.shape[-1], x.q.device)).to(x.q.dtype)
        for name, spec in variant_specs().items():
            if args.variants and name not in args.variants:
                continue
            t0 = time.time()
            r = {"q_scale": qs, "q_features": features, "n": args.n, "batch": args.batch, "variant": name,
                 "spec": spec}
            try:
                call, stats = make_call(spec, x.q, x.k, x.v, x.lens)
                call, stats = with_limit(name, call), with_limit(name, stats)
                r["graph_us"] = timer.time_graph_us(call, warmup=3, iters=args.iters)["median_us"]
                r["stats"] = stats()
                if args.reference and spec is not None:
                    r["ref_rel_err"] = reference_error(spec, call, x.q, x.k, x.v, x.lens)
                try:
                    kernels = kernel_times(call, timer.flush, args.profile_iters)
                except Exception as exc:  # noqa: BLE001 - the profiler is optional: the graph time stays
                    r["profile_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    kernels = {}
                r["kernels"] = {k: {"us": v[0], "launches": v[1]} for k, v in kernels.items()}
                r["stages"] = by_stage(kernels)
                r["launches"] = sum(v[1] for v in kernels.values())
            except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
            r["seconds"] = round(time.time() - t0, 1)
            rows.append(r)
            print(f"q_scale={qs} {features} {name}: {r.get('graph_us', r.get('error'))} ({r['seconds']} s)", flush=True)
        if args.topk and features == "gaussian":
            for name, fn in topk_calls(x).items():
                r = {"q_scale": qs, "q_features": features, "n": args.n, "batch": args.batch,
                     "variant": "top-k: " + name}
                try:
                    r["graph_us"] = timer.time_graph_us(fn, warmup=3, iters=args.iters)["median_us"]
                except Exception as exc:  # noqa: BLE001
                    r["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(r)
                print(f"q_scale={qs} top-k {name}: {r.get('graph_us', r.get('error'))}", flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def case(r: dict) -> str:
    return f"×{r['q_scale']:g} {r['q_features']}"


def parse_cases(text: str) -> list[tuple[float, str]]:
    """``"1:gaussian,4:gaussian,1:outliers,1:peaked"`` -> ``[(1.0, "gaussian"), ...]``; ``peaked``: the bench's
    peaked attention (``bench.peaked``, the shape's fit to real models), q scale 1 only."""
    out = []
    for item in text.split(","):
        scale, _, features = item.partition(":")
        features = features or "gaussian"
        if features not in ("gaussian", "outliers", "peaked"):
            raise ValueError(f"--cases: features {features!r} (expected gaussian, outliers or peaked)")
        if features == "peaked" and float(scale) != 1.0:
            raise ValueError(f"--cases: peaked attention takes q scale 1, got {scale}")
        out.append((float(scale), features))
    return out


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"# Decode-step stages, one layer ({device})", "",
             "shape 32/8/128 bf16; graph µs = captured m.decode, cold L2, median; stage µs = profiler device time per "
             "kernel (eager, cold L2), summed per stage", ""]
    dense = {case(r): r.get("graph_us") for r in rows if r["variant"] == "dense"}
    lines += ["| q | variant | graph µs | × dense | launches | density / extras |",
              "|---|---|---:|---:|---:|---|"]
    for r in rows:
        g = r.get("graph_us")
        d = dense.get(case(r))
        ratio = f"{d / g:.2f}" if g and d else "—"
        extras = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in {**r.get("stats", {}), **({"ref_rel_err": r["ref_rel_err"]}
                                                                  if "ref_rel_err" in r else {})}.items())
        lines.append(f"| {case(r)} | {r['variant']} | {g:.1f} | {ratio} | {r.get('launches', 0):.0f} | "
                     f"{extras or r.get('error', '')} |" if g else f"| {case(r)} | {r['variant']} | — | — | — | "
                     f"{r.get('error', '')} |")
    lines += ["", "| q | variant | stage | µs | launches |", "|---|---|---|---:|---:|"]
    for r in rows:
        for stage, s in sorted(r.get("stages", {}).items(), key=lambda kv: -kv[1]["us"]):
            lines.append(f"| {case(r)} | {r['variant']} | {stage} | {s['us']:.1f} | {s['launches']:.0f} |")
    return "\n".join(lines) + "\n"


def tiny_inputs(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, lengths)`` of the CPU checks: one row, 4 query and 2 KV heads, 600 keys, d = 64."""
    q = torch.randn(1, 4, 64, generator=g)
    k = torch.randn(1, 2, 600, 64, generator=g)
    v = torch.randn(1, 2, 600, 64, generator=g)
    return q, k, v, torch.tensor([600], dtype=torch.int32)


def check() -> None:
    """Every variant once on tiny CPU inputs through its reference path, and the stage filing."""
    g = torch.Generator().manual_seed(0)
    q, k, v, lens = tiny_inputs(g)
    for name, spec in variant_specs().items():
        if spec is None:
            continue
        call, stats = make_call(spec, q, k, v, lens)  # on the CPU: the reference paths
        out = call()
        assert out.shape == q.shape and torch.isfinite(out).all(), name
        assert stats()["backend"] == "reference", name
        assert reference_error(spec, call, q, k, v, lens) == 0, name  # the same path on the CPU
    s = torch.randn(2, 3, 1001, generator=g)
    s[0, 0, 500:540] = 5.0 + torch.rand(40, generator=g)  # a cluster of top keys in few groups
    s[1, 2, :100] = float("-inf")
    mx = torch.nn.functional.pad(s, (0, 7), value=float("-inf")).view(2, 3, -1, 8).amax(-1)
    got = grouped_topk(s, mx, 50, 8)
    want = torch.topk(s, 50, dim=-1).indices
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert torch.equal(s.gather(-1, got), s.gather(-1, want))  # highest first, as torch.topk's sorted output
    assert stage_of("_budget_parts_kernel") == "vattention budget statistics"
    assert stage_of("void at::native::sbtopk::gatherTopK<float>") == "top-k select (torch)"
    assert stage_of("_radix_hist_kernel") == "top-k select (radix)"
    assert stage_of("elementwise_kernel") == "other: elementwise_kernel"
    print("check: ok")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for stages.json and stages.md")
    p.add_argument("--n", type=int, default=131072, help="context length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cases", default="1:gaussian,4:gaussian,1:outliers",
                   help="comma list of QSCALE:FEATURES; q scale 1 = flat attention, 4 = sharpened; features gaussian, "
                        "outliers (a few query features carry most of |q|, as in real models) or peaked (the "
                        "bench's peaked attention fitted to real models; scale 1)")
    p.add_argument("--iters", type=int, default=10, help="timed graph replays")
    p.add_argument("--profile-iters", type=int, default=3, help="profiled eager calls")
    p.add_argument("--no-topk", dest="topk", action="store_false",
                   help="skip the oracle top-k's alternatives (timed on the gaussian cases)")
    p.add_argument("--variants", default="", help=f"comma list of variants to run (default all: "
                                                  f"{', '.join(variant_specs())})")
    p.add_argument("--reference", action="store_true",
                   help="also run each method variant's torch reference on the same draws and record ref_rel_err")
    p.add_argument("--check", action="store_true", help="run the variants on tiny CPU inputs, no timing")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(args.variants) - set(variant_specs()))
    if unknown:
        p.error(f"--variants: unknown {unknown} (expected some of {list(variant_specs())})")
    if args.check:
        check()
        return 0
    if not args.out:
        p.error("out: give a folder for the results")
    if not torch.cuda.is_available():
        print("stages.py needs a CUDA GPU (use --check on a CPU)", file=sys.stderr)
        return 2
    args.cases = parse_cases(args.cases)

    t0 = time.time()
    rows = run(args)
    device = torch.cuda.get_device_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stages.json").write_text(json.dumps({"device": device, "seconds": round(time.time() - t0, 1),
                                                 "command": " ".join(sys.argv), "rows": rows}, indent=1))
    md = markdown(rows, device)
    (out / "stages.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
