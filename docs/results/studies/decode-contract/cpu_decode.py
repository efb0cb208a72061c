"""CPU: every method's decode against the dense reference at the default model's shapes.

One decode call of one layer: q [1, 9, 64], K/V [1, 3, N, 64] float32, N = 8192 by default, as
``sparsify`` calls it (``check_finite=False``, a fresh seed per call). Minimum of ``--reps`` calls
interleaved with dense calls (the machine is shared: compare ratios).
Runs against whichever kvsieve is on PYTHONPATH (so the same script measures main and a branch).

    PYTHONPATH=src python docs/results/studies/decode-contract/cpu_decode.py --out DIR [--n 8192] [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvsieve

SPECS = ["dense", "streaming", "oracle-topk", "oracle-topp", "quest", "random", "magicpig", "vattention",
         "santa", "santa-strat", "santa-sys", "santa-prop", "santa-flash"]


# CPU time of this thread: with one torch thread every op runs on it, and time spent waiting for a
# core that other jobs hold is not counted (the wall clock of a loaded 2-core machine is not usable).
CLOCK = time.thread_time


def time_pair(spec: str, q, k, v, reps: int) -> tuple[float, float]:
    """Minimum times of the method and of dense over ``reps`` interleaved calls (after two warm-ups):
    on a machine shared with other jobs the minimum is the least disturbed call of each."""
    m, dense = kvsieve.method(spec), kvsieve.method("dense")
    state: dict = {}
    t_m, t_d = [], []
    for i in range(reps + 2):
        for meth, acc, st in ((dense, t_d, {}), (m, t_m, state)):
            t0 = CLOCK()
            _, stats = meth.decode(q, k, v, seed=i, state=st, check_finite=False)
            _ = stats.density  # reading the stats is part of what a caller pays
            if i >= 2:
                acc.append(CLOCK() - t0)
    return min(t_m), min(t_d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--label", default="")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default=",".join(SPECS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 64, generator=g)
    k = torch.randn(1, 3, args.n, 64, generator=g)
    v = torch.randn(1, 3, args.n, 64, generator=g)
    rows = []
    for spec in args.methods.split(","):
        t, d = time_pair(spec, q, k, v, args.reps)
        rows.append({"method": spec, "ms": t * 1e3, "dense_ms": d * 1e3, "ratio": t / d})
        print(f"{spec:14s} {t * 1e3:8.2f} ms  dense {d * 1e3:6.2f} ms  ratio {t / d:5.2f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "n_keys": args.n,
            "shape": "q [1, 9, 64], K/V [1, 3, N, 64] float32", "threads": args.threads, "label": args.label,
            "kvsieve": kvsieve.__file__, "machine": platform.processor() or platform.machine(),
            "command": "PYTHONPATH=src python docs/results/studies/decode-contract/cpu_decode.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if k != "methods")}
    stem = f"cpu_decode{('_' + args.label) if args.label else ''}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# CPU decode vs dense ({args.label or 'this tree'}), N = {args.n}", "",
             f"{meta['date']}, {meta['shape']}, {args.threads} thread(s), minimum of {args.reps} "
             "interleaved calls, thread CPU time (the machine is shared)", "",
             "| method | ms | dense ms (same run) | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['ms']:.2f} | {r['dense_ms']:.2f} | {r['ratio']:.2f} |" for r in rows]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
