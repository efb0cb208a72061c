"""GPU: what ``m.decode`` costs on top of its kernel, eager and captured in a CUDA graph (issue 14).

Llama-3.1-8B shapes (32 query / 8 KV heads, d 128), bf16, batch 1, i.i.d. Gaussian inputs, contexts
32k and 128k. For santa-prop (budget 128), santa-flash (budget 2048) and dense (Triton):

- ``kernel``: the Triton entry point alone (``santa_prop_triton`` / ``santa_flash_triton`` /
  ``dense_decode_triton``, no counts written), CUDA events, cold L2 (``bench.timing.ColdL2Timer``);
- ``api events``: ``m.decode(q, k, v, lengths=..., seed=RandomKey(...), check_finite=False)`` with
  CUDA events around the call (what the device spends, including any extra kernels: stats, counts);
- ``api wall``: the same call, host wall clock from before the call to the end of a synchronize
  after it, minus the same measured for an empty synchronize (what a caller waits);
- ``api graph``: the call captured once in ``torch.cuda.graph`` and replayed, CUDA events;
- FlashInfer ``single_decode_with_kv_cache`` (NHD) events and wall, when importable; torch SDPA events.

Target (issue 14): api wall ≤ kernel + 25 µs; api graph within 5% of kernel.

    python docs/results/studies/decode-contract/bench_api.py OUT_DIR [--iters 30]

Writes OUT_DIR/bench_api.json and OUT_DIR/bench_api.md. About 1–2 minutes on an H100.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import kvsieve
from kvsieve import CallContext
from kvsieve.bench.timing import ColdL2Timer
from kvsieve.core.rng import RandomKey

#: How the decode runtime calls a captured step: no per-key read counts for the stats.
NO_READS = CallContext(count_reads=False)

HEADS, KV_HEADS, D = 32, 8, 128
SPECS = {"santa-prop": "santa-prop:budget=128", "santa-flash": "santa-flash:budget=2048",
         "dense": "dense:backend=triton"}


def wall_us(timer: ColdL2Timer, fn, iters: int) -> float:
    """Median host µs from call to synchronized result, cold L2, minus an empty synchronize's."""
    def one(f):
        timer.flush()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6
    for _ in range(5):
        one(fn)
    base = statistics.median(one(lambda: None) for _ in range(iters))
    return statistics.median(one(fn) for _ in range(iters)) - base


def kernel_call(name: str, q, k, v, lens, scale: float, n: int):
    from kvsieve.kernels.santa.decode import santa_flash_triton, santa_prop_triton
    from kvsieve.kernels.santa.reference import auto_tile_size
    from kvsieve.kernels.shared.dense import dense_decode_triton

    tile, seed = auto_tile_size(n), 12345
    if name == "santa-prop":
        return lambda: santa_prop_triton(q, k, v, lens, scale, 128, tile, seed)[0]
    if name == "santa-flash":
        return lambda: santa_flash_triton(q, k, v, lens, scale, 2048, tile, seed)[0]
    return lambda: dense_decode_triton(q, k, v, lens, scale)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--lengths", default="32768,131072")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_api: needs CUDA")
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - optional; its absence is reported
        flashinfer, fi_note = None, f"FlashInfer not importable: {exc}"
    else:
        fi_note = f"FlashInfer {getattr(flashinfer, '__version__', '?')}"
    timer = ColdL2Timer()
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, KV_HEADS, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, KV_HEADS, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
        lens = torch.full((1,), n, device="cuda", dtype=torch.int32)
        scale = D ** -0.5
        key = RandomKey(0, (0, 0))
        for name, spec in SPECS.items():
            m = kvsieve.method(spec)

            def api(m=m, q=q, k=k, v=v, lens=lens, key=key):
                return m.decode(q, k, v, lengths=lens, seed=key, check_finite=False)

            def api_runtime(m=m, q=q, k=k, v=v, lens=lens, key=key, context=NO_READS):
                # as the decode runtime's captured step calls it: no per-key read counts for the stats
                return m.decode(q, k, v, lengths=lens, seed=key, check_finite=False, context=context)

            kern = kernel_call(name, q, k, v, lens, scale, n)
            row = {"n": n, "call": name, "spec": spec}
            row["kernel_us"] = timer.time_us(kern, iters=args.iters)["median_us"]
            row["kernel_wall_us"] = wall_us(timer, kern, args.iters)
            row["api_events_us"] = timer.time_us(api, iters=args.iters)["median_us"]
            row["api_wall_us"] = wall_us(timer, api, args.iters)
            _, stats = api()
            row["backend"] = stats.backend
            for key_name, fn in (("api_graph_us", api), ("api_graph_runtime_us", api_runtime)):
                try:
                    row[key_name] = timer.time_graph_us(fn, iters=args.iters)["median_us"]
                except Exception as exc:  # noqa: BLE001 - a capture failure is a result
                    row[key_name] = None
                    row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
        if flashinfer is not None:
            kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()

            def fi(q0=q[0], kn=kn, vn=vn):
                return flashinfer.single_decode_with_kv_cache(q0, kn, vn, kv_layout="NHD")

            rows.append({"n": n, "call": "flashinfer", "kernel_us": timer.time_us(fi, iters=args.iters)["median_us"],
                         "kernel_wall_us": wall_us(timer, fi, args.iters)})
            print(json.dumps(rows[-1]), flush=True)
        q4 = q[:, :, None]
        sdpa = lambda q4=q4, k=k, v=v: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: E731
        rows.append({"n": n, "call": "sdpa", "kernel_us": timer.time_us(sdpa, iters=args.iters)["median_us"],
                     "kernel_wall_us": wall_us(timer, sdpa, args.iters)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": fi_note,
            "shapes": f"{HEADS}/{KV_HEADS}/{D} bf16 batch 1", "iters": args.iters,
            "command": "python docs/results/studies/decode-contract/bench_api.py " + " ".join(sys.argv[1:])}
    (out / "bench_api.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    def f(x):
        return "—" if x is None else f"{x:.1f}"
    lines = ["# m.decode overhead over its kernel (issue 14)", "",
             f"{meta['date']}, {meta['device']}, torch {meta['torch']}, {fi_note}; {meta['shapes']}; "
             f"cold L2, medians of {args.iters}. Command: `{meta['command']}`", "",
             "| N | call | kernel µs (events) | kernel wall µs | api events µs | api wall µs | api graph µs | "
             "api graph, runtime form µs | wall − kernel µs | graph / kernel | runtime form / kernel |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        extra = r.get("api_wall_us")
        over = None if extra is None else extra - r["kernel_us"]
        ratio = None if r.get("api_graph_us") is None else r["api_graph_us"] / r["kernel_us"]
        ratio_rt = None if r.get("api_graph_runtime_us") is None else r["api_graph_runtime_us"] / r["kernel_us"]
        lines.append(f"| {r['n']} | {r['call']} | {f(r['kernel_us'])} | {f(r.get('kernel_wall_us'))} | "
                     f"{f(r.get('api_events_us'))} | {f(extra)} | {f(r.get('api_graph_us'))} | "
                     f"{f(r.get('api_graph_runtime_us'))} | {f(over)} | {'—' if ratio is None else f'{ratio:.2f}'} | "
                     f"{'—' if ratio_rt is None else f'{ratio_rt:.2f}'} |")
    errors = [f"- {r['n']} {r['call']}: {r['graph_error']}" for r in rows if r.get("graph_error")]
    if errors:
        lines += ["", "Graph capture failures:", *errors]
    (out / "bench_api.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
