"""The dense split-KV decode kernel's split count and launch settings, swept per head layout (GPU).

``kernels/shared/dense.py`` cuts each (row, KV head) into enough splits for about 264 programs and reads
them with the launch settings of an H100 sweep at Llama-3.1-8B's 8 KV heads. A tensor-parallel rank holds
fewer KV heads (the 70B shape at TP 4: 2 a rank; the 8B shape at TP 2: 4), so the same 264 programs read
shorter chunks and the merge has more partials to combine. This times the kernel (split launch + merge,
captured, cold L2) at each (programs, block_n, num_warps, num_stages) for each layout, with FlashInfer's
decode on the same K/V beside it, the split and merge launches' share by the profiler at the default, and the
default with its merge launched with programmatic dependent launch (``triton_utils.MERGE_PDL``) beside it.

    python benchmarks/breakdown/dense_splits.py --out DIR [--layouts 16/2/128,16/4/128,32/8/128]
        [--cases 1x128k,8x32k]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

PROGRAMS = (132, 264, 396, 528, 792)
LAUNCHES = ((64, 4, 3), (64, 4, 4), (128, 8, 2), (128, 4, 3), (64, 8, 3))
AB_ROUNDS = 3  # the default's merge without and with programmatic dependent launch, alternately


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="16/2/128,16/4/128,32/8/128", help="heads/kv_heads/head_dim, comma list")
    ap.add_argument("--cases", default="1x128k,8x32k")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()

    from kvsieve.bench.decode import VARIANTS, Case, Inputs, timing_setup
    from kvsieve.bench.report import environment
    from kvsieve.cli.bench import parse_cases
    from kvsieve.kernels.shared import dense, triton_utils

    flashinfer, peak, timer = timing_setup()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout, (batch, n) in itertools.product(args.layouts.split(","), parse_cases(args.cases)):
        h, hkv, d = (int(x) for x in layout.split("/"))
        case = Case(f"{h}/{hkv}/{d}", h, hkv, d, n, batch)
        x = Inputs(case, torch.bfloat16, seed=0)
        kv_bytes = 2 * x.k.numel() * x.k.element_size()
        ref = dense.dense_decode_triton(x.q, x.k, x.v, x.lens, x.scale).float()
        base = {"layout": case.shape, "batch": batch, "n": n, "kv_bytes": kv_bytes}
        if not isinstance(flashinfer, Exception):
            call, _ = VARIANTS["flashinfer"].make(x, None, 0)
            t = timer.time_graph_us(call, iters=args.iters)
            rows.append({**base, "variant": "flashinfer", **t})
            print(rows[-1], flush=True)
        default = dense.launch_config(n, d)
        default_programs = dense.dense_split_plan.__defaults__[0]
        for programs, launch in itertools.product(PROGRAMS, LAUNCHES):
            plan = dense.dense_split_plan

            def split_plan(b, kv_heads, n_keys, block_n, target_programs=programs, plan=plan):
                return plan(b, kv_heads, n_keys, block_n, target_programs)

            with mock.patch.object(dense, "launch_config", lambda *_, launch=launch: launch), \
                    mock.patch.object(dense, "dense_split_plan", split_plan):
                def call(x=x):
                    return dense.dense_decode_triton(x.q, x.k, x.v, x.lens, x.scale)
                err = (call().float() - ref).abs().max().item()
                t = timer.time_graph_us(call, iters=args.iters)
                parts = None
                if programs == default_programs and launch == default:
                    parts = timer.kernel_breakdown(call)
            pdl_row = None
            if programs == default_programs and launch == default:
                # the default both ways, alternately (neighbouring timings of one setting move by several %)
                def plain(x=x):
                    return dense.dense_decode_triton(x.q, x.k, x.v, x.lens, x.scale)
                off, on = [], []
                for _ in range(AB_ROUNDS):
                    off.append(timer.time_graph_us(plain, iters=args.iters)["median_us"])
                    with mock.patch.object(triton_utils, "MERGE_PDL", True):  # read when the graph is captured
                        on.append(timer.time_graph_us(plain, iters=args.iters)["median_us"])
                        pdl_err = (plain().float() - ref).abs().max().item()
                pdl_row = {"median_us": statistics.median(on), "ab_on_us": on, "ab_off_us": off,
                           "ab_off_median_us": statistics.median(off), "max_abs_err": pdl_err}
            splits = split_plan(batch, hkv, n, launch[0])[1]
            rows.append({**base, "variant": "dense", "programs": programs, "splits": splits,
                         "block_n": launch[0], "num_warps": launch[1], "num_stages": launch[2],
                         "default": programs == default_programs and launch == default, "max_abs_err": err,
                         "copy_fraction": kv_bytes / peak / (t["median_us"] * 1e-6), "kernels_us": parts, **t})
            print({k: v for k, v in rows[-1].items() if k != "kernels_us"}, flush=True)
            if pdl_row is not None:
                rows.append({**rows[-1], "kernels_us": None, "merge_pdl": True, **pdl_row,
                             "copy_fraction": kv_bytes / peak / (pdl_row["median_us"] * 1e-6)})
                print({k: v for k, v in rows[-1].items() if k != "kernels_us"}, flush=True)
    result = {**environment("dense-splits", "cuda", torch.bfloat16), "copy_bandwidth_bytes_per_s": peak, "rows": rows,
              "command": "python benchmarks/breakdown/dense_splits.py " + " ".join(sys.argv[1:])}
    (out / "dense_splits.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Dense split-KV decode: splits and launch settings per head layout — {result['device']}", "",
             f"- date: {result['date']}; command: `{result['command']}`",
             "- µs: split + merge launches captured, cold L2, median; copy = K/V bytes at the device copy rate "
             f"({peak / 1e12:.2f} TB/s) / µs; ★ = today's default", "",
             "| layout | batch | N | programs | splits | block_n/warps/stages | µs | copy | vs FlashInfer |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for key, group in itertools.groupby(rows, lambda r: (r["layout"], r["batch"], r["n"])):
        group = list(group)
        fi = next((r["median_us"] for r in group if r["variant"] == "flashinfer"), None)
        dense_rows = sorted((r for r in group if r["variant"] == "dense" and not r.get("merge_pdl")),
                            key=lambda r: r["median_us"])
        shown = ([r for r in dense_rows[:5]] + [r for r in dense_rows[5:] if r["default"]]
                 + [r for r in group if r.get("merge_pdl")])
        if fi is not None:
            lines.append(f"| {key[0]} | {key[1]} | {key[2]:,} | FlashInfer | | | {fi:.1f} | "
                         f"{group[0]['kv_bytes'] / peak / (fi * 1e-6):.0%} | 1.00 |")
        for r in shown:
            star = (" ★" if r["default"] else "") + (
                f", merge PDL (A/B medians: {r['ab_off_median_us']:.1f} without)" if r.get("merge_pdl") else "")
            ratio = f"{fi / r['median_us']:.2f}" if fi else "—"
            lines.append(f"| {key[0]} | {key[1]} | {key[2]:,} | {r['programs']}{star} | {r['splits']} | "
                         f"{r['block_n']}/{r['num_warps']}/{r['num_stages']} | {r['median_us']:.1f} | "
                         f"{r['copy_fraction']:.0%} | {ratio} |")
        for r in group:
            if r.get("kernels_us"):
                lines.append(f"| {key[0]} | {key[1]} | {key[2]:,} | default's launches (profiler): "
                             + ", ".join(f"{k[:40]} {v:.1f}" for k, v in r["kernels_us"].items()) + " | | | | | |")
    (out / "dense_splits.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
