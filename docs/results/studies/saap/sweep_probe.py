"""SAAP's probe alone (``probe_scores_triton``: de-rope, classifier, group softmax, top-ℓ) at
Llama-3.1-8B shapes — 32 query heads, 8 KV heads, d 128, hidden 1024, C = 1024, ℓ = 32, bfloat16 serve
weights — captured in a CUDA graph on a cold L2 (kvsieve.bench.timing), with its per-kernel profile,
for each rank-kernel launch shape (``RANK_CHUNK`` buckets a program × ``RANK_WARPS`` warps) the tree
has; a tree without them (before the rank kernel) is timed as it is. Each shape's buckets are checked
against ``top_buckets_reference`` of its scores (as sets) and its scores against
``probe_scores_reference``.

Usage (about a minute)::

    python docs/results/studies/saap/sweep_probe.py --out OUT --tag X
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from kvsieve.kernels.saap import probe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for sweep.json and sweep.md")
    p.add_argument("--tag", default="")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--chunks", default="8,16,32,64")
    p.add_argument("--warps", default="2,4,8")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from kvsieve.bench.timing import ColdL2Timer

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, hidden, c, probes = 32, 8, 128, 1024, 1024, 32
    w = probe.serve_weights(torch.randn(hkv, d, hidden, generator=g) * d ** -0.5, torch.randn(hkv, hidden, generator=g),
                            torch.randn(hkv, hidden, c, generator=g) * hidden ** -0.5, torch.randn(hkv, c, generator=g))
    w = [t.to(dev) for t in w]
    q = torch.randn(1, hq, d, generator=g).to(torch.bfloat16).to(dev)
    lengths = torch.full((1,), 131072, device=dev)
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d))).to(dev)
    ref = probe.probe_scores_reference(q, lengths - 1, inv_freq, 1.0, *w, kv_heads=hkv)

    def call():
        return probe.probe_scores_triton(q, lengths, inv_freq, 1.0, *w, kv_heads=hkv, probes=probes,
                                         position_offset=-1)

    timer = ColdL2Timer(dev)
    tunable = hasattr(probe, "RANK_CHUNK")
    shapes = (list(itertools.product([int(x) for x in args.chunks.split(",")], [int(x) for x in args.warps.split(",")]))
              if tunable else [(None, None)])
    rows = []
    with torch.inference_mode():
        for chunk, warps in shapes:
            if tunable:
                probe.RANK_CHUNK, probe.RANK_WARPS = chunk, warps
            scores, top = call()
            same = torch.equal(top.sort(-1).values, probe.top_buckets_reference(scores, probes).sort(-1).values)
            row = {"rank_chunk": chunk, "rank_warps": warps, "top_equal": same,
                   "scores_max_abs_err": float((scores - ref).abs().max()),
                   "probe-graph_us": timer.time_graph_us(call, iters=args.iters)["median_us"],
                   "kernels_us": timer.kernel_breakdown(call)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "tag": args.tag, "command": " ".join(sys.argv)}
    (args.out / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# SAAP probe sweep [{args.tag}] ({meta['device']})", "",
             "| chunk | warps | probe graph µs | kernels (µs) | top = reference | scores err |",
             "|---|---|---:|---|---|---:|"]
    for r in rows:
        ks = ", ".join(f"{k.split('(')[0][:24]} {v:.1f}" for k, v in sorted((r["kernels_us"] or {}).items()))
        lines.append(f"| {r['rank_chunk']} | {r['rank_warps']} | {r['probe-graph_us']:.1f} | {ks} | {r['top_equal']} | "
                     f"{r['scores_max_abs_err']:.1e} |")
    (args.out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["top_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
