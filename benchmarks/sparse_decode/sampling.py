"""The sampling baselines' GPU paths: ``vattention`` (Quest and oracle predictors), ``random``,
``magicpig`` and ``oracle-topp`` (top_p = 0.9: its density is the data's; ``select=torch`` is the same
set by the torch selection, to compare with the device select) through ``method.decode`` (their device
selection + the Triton weighted sparse kernel,
``methods/shared/staged.py``) against FlashInfer in the same run.

    PYTHONPATH=src python benchmarks/sparse_decode/sampling.py OUT_DIR [--iters 20] [--contexts 32768 131072]

Llama-3.1-8B shapes (32 query heads, 8 KV heads, d 128), bf16, i.i.d. Gaussian inputs, batch 1 at each
context and batch 8 at 32k. Budgets aim at ≈5% density: ``random`` and ``magicpig`` (capped) take
5% of the context in sink 128 + window 128 + sample; vAttention takes f_t = f_b = 2.5% (the paper's
setting) and the budget its (ε, δ) bound gives, whose size depends on the scores (``method_specs`` says
which settings give ≈5% here): the density each call reached is reported beside its time.

Each ``m.decode`` (the runtime's form: ``check_finite=False``, a device step counter in the key) is
captured in a CUDA graph and replayed with a 512 MB L2 flush before each replay (CUDA events, median;
``kvsieve.bench.timing``); eager times too. "selection" times the method's selection alone
(``m.kernel_stages``: what the kernel path runs before the kernel), "attention" the kernel alone on
that selection. "floor" = the bytes the method's stats say it touched (K rows scored + V rows read; page
summaries and MagicPIG's hash codes not counted) / the measured device copy rate. Once per case the
kernel path's output is compared with the torch reference's on the same key (same selection, so only
rounding differs) and with exact attention (the estimator's own error). Writes ``sampling.json`` and
``sampling.md`` into OUT_DIR. Aimed at < 3 minutes
on an H100.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SINK = WINDOW = 128  # the methods' defaults
TARGETS = {"vattention-quest": (3, 4)}  # the targets: × FlashInfer at (32k, 128k), batch 1; the others: report


def method_specs(n: int, density: float) -> dict[str, str]:
    """``variant -> spec`` at about ``density`` of an ``n``-key context.

    vAttention's budget comes from (ε, δ) and the scores, not from a size: on these inputs (Gaussian q,
    K, V; measured with the CPU reference at 32k) ``bound=denominator`` with ε = 0.1, δ = 0.05 reads
    ≈5% of the keys with the Quest predictor (sink + window 256, top-k 2.5%, b ≈ 590) and ≈4% with the
    oracle; ``bound=full`` (the default, which keeps the (ε, δ) promise) takes every key at any ε ≤ 0.2:
    with random values ‖N̂‖ is small against √Tr Σ̂, so it is timed as the dense-budget case it is.
    """
    sample = max(1, int(density * n) - SINK - WINDOW)  # keys beyond sink + window
    vatt = "top_k=0.025,base_rate=0.025"
    return {
        "vattention-quest": f"vattention:predictor=quest,page_size=16,bound=denominator,epsilon=0.1,delta=0.05,{vatt}",
        "vattention-oracle": f"vattention:predictor=oracle,bound=denominator,epsilon=0.1,delta=0.05,{vatt}",
        "vattention-quest-full": f"vattention:predictor=quest,page_size=16,bound=full,epsilon=0.05,delta=0.05,{vatt}",
        "random": f"random:budget={sample}",
        # 8 bits x 16 tables retrieve ≈ 6% of these keys (1 − (1 − 2^-8)^16 for orthogonal ones); the cap
        # keeps 5% of the context in all
        "magicpig": f"magicpig:bits=8,tables=16,budget={sample}",
        # data-dependent density (top-p of the softmax); select=torch: the same set by the torch ops
        "oracle-topp": "oracle-topp:top_p=0.9",
        "oracle-topp-torch-select": "oracle-topp:top_p=0.9,select=torch",
    }


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def method_calls(spec: str, x, step: torch.Tensor) -> dict:
    """For one spec: the method, its key (a device step counter, as the runtime keys a step) and state,
    and the calls timed — the captured decode, its selection alone, the kernel alone on that selection —
    and the reference path's decode on the same key."""
    import kvsieve
    from kvsieve.core.inputs import check_decode_inputs
    from kvsieve.core.rng import RandomKey
    from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton
    from kvsieve.methods.shared.staged import kernel_plan

    m = kvsieve.method(spec)
    key = RandomKey(7, (0, step))
    state = m.new_state()
    sel_state = m.new_state()

    def call():
        return m.decode(x.q, x.k, x.v, lengths=x.lens, seed=key, state=state, check_finite=False)[0]

    def select():  # what the kernel path runs before the kernel
        inputs = check_decode_inputs(x.q, x.k, x.v, lengths=x.lens, check_finite=False)
        return m.kernel_stages(inputs, m.kernel_row_streams(inputs, key), sel_state).rest.indices

    inputs = check_decode_inputs(x.q, x.k, x.v, lengths=x.lens, check_finite=False)
    st = m.kernel_stages(inputs, m.kernel_row_streams(inputs, key), m.new_state())
    rest = st.rest
    cfg = m.config
    plan = kernel_plan(st)  # the split the kernel path asks for

    def attend():
        if st.attend is not None:  # a method whose own pass tests its keys (vAttention's oracle path)
            return st.attend(x.q, x.k, x.v, inputs.kernel_lengths)
        return sparse_decode_triton(x.q, x.k, x.v, rest.indices, rest.counts, rest.weights, lengths=x.lens,
                                    sink=cfg.sink, window=cfg.window, scale=inputs.scale, **plan)[0]

    ref_m = kvsieve.method(spec + ",backend=reference")

    def reference():
        return ref_m.decode(x.q, x.k, x.v, lengths=x.lens, seed=key, check_finite=False)[0]

    return {"method": m, "key": key, "state": state, "call": call, "select": select, "attend": attend,
            "reference": reference}


def run_case(case, args, timer, peak, rows):
    from kvsieve.bench.decode import VARIANTS, Inputs
    from kvsieve.bench.timing import count_launches

    x = Inputs(case, torch.bfloat16, seed=0)
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    case_rows = []
    exact = None
    for name in ("flashinfer", "dense"):
        r = {"n": case.n, "batch": case.batch, "variant": name,
             "bytes": 2.0 * case.batch * KV_HEADS * case.n * HEAD_DIM * 2, "density": 1.0}
        r["floor_us"] = r["bytes"] / peak * 1e6
        try:
            call = VARIANTS[name].make(x, None, 0)[0]
            if name == "dense":
                exact = call().float().clone()
            r["graph_us"] = timer.time_graph_us(call, warmup=args.warmup, iters=args.iters)["median_us"]
            r["eager_us"] = timer.time_us(call, warmup=args.warmup, iters=args.iters)["median_us"]
        except Exception as exc:  # noqa: BLE001 - a missing baseline must not lose the others
            r["error"] = f"{type(exc).__name__}: {exc}"[:200]
        case_rows.append(r)
        print(f"n={case.n} b={case.batch} {name}: {r.get('graph_us', r.get('error'))}")
    for name, spec in method_specs(case.n, args.density).items():
        r = {"n": case.n, "batch": case.batch, "variant": name, "spec": spec}
        try:
            c = method_calls(spec, x, step)
            call, select, attend = c["call"], c["select"], c["attend"]
            out, stats = c["method"].decode(x.q, x.k, x.v, lengths=x.lens, seed=c["key"], state=c["state"],
                                            check_finite=False)
            r["backend"] = stats.backend
            r["density"] = stats.density
            r["kv_density"] = stats.kv_density
            r["bytes"] = float(stats.bytes_read)
            r["floor_us"] = r["bytes"] / peak * 1e6
            for extra in ("budget", "fixed_keys", "retrieved", "kept"):
                if extra in stats:
                    r[extra] = stats[extra]
            ref_out = c["reference"]()
            r["rel_error_vs_reference"] = rel_error(out, ref_out)
            del ref_out
            if exact is not None:
                r["rel_error_vs_exact"] = rel_error(out, exact)
            torch.cuda.empty_cache()
            r["graph_us"] = timer.time_graph_us(call, warmup=args.warmup, iters=args.iters)["median_us"]
            r["eager_us"] = timer.time_us(call, warmup=args.warmup, iters=args.iters)["median_us"]
            r["selection_graph_us"] = timer.time_graph_us(select, warmup=args.warmup, iters=args.iters)["median_us"]
            r["attention_graph_us"] = timer.time_graph_us(attend, warmup=args.warmup, iters=args.iters)["median_us"]
            r["launches"] = count_launches(call)
            print(f"n={case.n} b={case.batch} {name}: graph {r['graph_us']:.1f} us (selection "
                  f"{r['selection_graph_us']:.1f}, attention {r['attention_graph_us']:.1f}), eager "
                  f"{r['eager_us']:.1f} us, density {r['density']:.3f}, err vs reference "
                  f"{r['rel_error_vs_reference']:.1e}")
        except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others' rows
            r["error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"n={case.n} b={case.batch} {name}: {r['error']}")
            torch.cuda.synchronize()
        case_rows.append(r)
        torch.cuda.empty_cache()
    base = next((r for r in case_rows if r["variant"] == "flashinfer" and "graph_us" in r), None)
    for r in case_rows:
        if base is not None and "graph_us" in r:
            r["speedup_vs_flashinfer"] = base["graph_us"] / r["graph_us"]
        if base is not None and "eager_us" in r:
            r["eager_speedup_vs_flashinfer"] = base["eager_us"] / r["eager_us"]
    rows.extend(case_rows)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batch8-context", type=int, default=32768, help="context of the batch-8 case (0: none)")
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from kvsieve.bench.decode import Case, library_version, timing_setup

    args.out_dir.mkdir(parents=True, exist_ok=True)
    flashinfer, peak, timer = timing_setup()
    cases = [Case("llama-3.1-8b", HEADS, KV_HEADS, HEAD_DIM, n, 1) for n in args.contexts]
    if args.batch8_context:
        cases.append(Case("llama-3.1-8b", HEADS, KV_HEADS, HEAD_DIM, args.batch8_context, 8))
    rows: list[dict] = []
    t0 = time.time()
    for case in cases:
        run_case(case, args, timer, peak, rows)
        torch.cuda.empty_cache()
    results = {
        "kind": "sparse_decode_sampling",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else "sampling.py " + " ".join(
            map(str, argv)),
        "torch": torch.__version__, "triton": library_version("triton"),
        "flashinfer": None if isinstance(flashinfer, Exception) else library_version("flashinfer"),
        "shape": f"{HEADS}/{KV_HEADS}/{HEAD_DIM} bf16", "density": args.density,
        "protocol": f"m.decode captured in a CUDA graph, replays with a 512 MB L2 flush before each, CUDA events, "
                    f"{args.warmup} warm-up + {args.iters} timed, median (eager: the same without the graph)",
        "copy_bandwidth_bytes_per_s": peak,
        "wall_s": time.time() - t0,
        "rows": rows,
    }
    (args.out_dir / "sampling.json").write_text(json.dumps(results, indent=1))
    (args.out_dir / "sampling.md").write_text(markdown(results))
    print(markdown(results))
    return 0


def _f(v, spec=".1f"):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(res: dict) -> str:
    lines = [f"# Sampling baselines' GPU paths on {res['device']} ({res['date']})", "",
             f"- command: `{res['command']}`; torch {res['torch']}, triton {res['triton']}, "
             f"FlashInfer {res['flashinfer']}; {res['wall_s']:.0f} s",
             f"- shape {res['shape']}, budgets for ≈ {res['density']:.0%} density (vAttention's is data-dependent: "
             f"see its density column); {res['protocol']}",
             f"- floor = bytes the method's stats count / device copy rate "
             f"({res['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s); err ref = kernel path vs torch reference on "
             "the same key (same selection); err exact = vs exact attention (the estimator's error)", "",
             "| n | batch | variant | graph µs | eager µs | × FlashInfer | target | selection µs | attention µs | "
             "floor µs | density | launches | err ref | err exact |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['n']:,} | {r['batch']} | {r['variant']} | error: {r['error'][:90]} |"
                         " | | | | | | | | | |")
            continue
        tgt = TARGETS.get(r["variant"])
        target = "—" if tgt is None or r["batch"] != 1 else f"≥ {tgt[0 if r['n'] <= 32768 else 1]}×"
        lines.append(
            f"| {r['n']:,} | {r['batch']} | {r['variant']} | {_f(r.get('graph_us'))} | {_f(r.get('eager_us'))} | "
            f"{_f(r.get('speedup_vs_flashinfer'), '.2f')} | {target} | {_f(r.get('selection_graph_us'))} | "
            f"{_f(r.get('attention_graph_us'))} | {_f(r.get('floor_us'))} | {_f(r.get('density'), '.3f')} | "
            f"{r.get('launches', '—')} | {_f(r.get('rel_error_vs_reference'), '.1e')} | "
            f"{_f(r.get('rel_error_vs_exact'), '.1e')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
