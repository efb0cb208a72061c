"""Launch settings of the weighted sparse decode kernel (``kernels/shared/weighted_triton.py``), swept on
the GPU: ``launch_config`` says "not yet tuned on a GPU", and the 5 % page list reads its 27 MB at 128k in
23.8 µs (≈ 1.1 TB/s) where FlashInfer streams the whole cache at 2.7 TB/s.

For a page-16 list at ≈ 5 % density (random distinct pages, as ``run.py``'s ``sparse-pages16``) and for
the streaming case (sink + window as ranges, no list), at each context: every combination of ``block_n``,
``num_warps``, ``num_stages`` and ``target_programs``; each checked against the torch reference
(relative error) and timed captured in a CUDA graph with a cold L2 (``kvsieve.bench.timing``). FlashInfer
(when installed) and the current defaults are timed in the same run.

    PYTHONPATH=src python docs/results/studies/sparse-decode/tune_launch.py OUT [--contexts 32768 131072]

Writes ``tune_launch.json`` and ``tune_launch.md`` (the best settings per case, and the defaults' time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import product
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks" / "sparse_decode"))
from run import random_pages  # noqa: E402  benchmarks/sparse_decode/run.py: the same random page lists as its rows

from kvsieve.bench.decode import VARIANTS, Case, Inputs, library_version, timing_setup
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference, sparse_decode_triton

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE = 16
SINK = 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--programs", type=int, nargs="+", default=[132, 264, 528, 1056])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    flashinfer, peak, timer = timing_setup()
    t_start = time.time()
    rows = []
    for n in args.contexts:
        case = Case("llama-3.1-8b", HEADS, KV_HEADS, HEAD_DIM, n, 1)
        x = Inputs(case, torch.bfloat16, seed=0)
        budget = int(args.density * n)
        if flashinfer is not None and not isinstance(flashinfer, Exception):
            fi = VARIANTS["flashinfer"].make(x, None, 0)[0]
            rows.append({"n": n, "case": "flashinfer", "us": timer.time_graph_us(fi, iters=args.iters)["median_us"]})
            print(rows[-1], flush=True)
        pages, counts = random_pages(1, KV_HEADS, n, PAGE, budget // PAGE,
                                     torch.Generator(device="cuda").manual_seed(0))
        pages, counts = pages.to(torch.int32), counts.to(torch.int32)  # the lists the 2026-11-27 sweep timed
        cases = {
            "pages16": dict(indices=pages, counts=counts, page_size=PAGE),
            "streaming": dict(sink=SINK, window=budget - SINK),
        }
        for cname, kw in cases.items():
            n_bytes = 2.0 * KV_HEADS * budget * HEAD_DIM * 2
            want = sparse_decode_reference(x.q, x.k, x.v, lengths=x.lens, **kw)[0].float()
            settings = [dict()] + [dict(block_n=bn, num_warps=w, num_stages=s, target_programs=p)
                                   for bn, w, s, p in product(args.block_n, args.warps, args.stages, args.programs)]
            for opts in settings:
                r = {"n": n, "case": cname, **(opts or {"default": True}), "floor_us": n_bytes / peak * 1e6}
                try:
                    def call(opts=opts, kw=kw, x=x):
                        return sparse_decode_triton(x.q, x.k, x.v, lengths=x.lens, **kw, **opts)[0]
                    got = call().float()
                    r["rel_error"] = float((got - want).norm() / want.norm())
                    r["us"] = timer.time_graph_us(call, warmup=5, iters=args.iters)["median_us"]
                except Exception as exc:  # noqa: BLE001 - a setting that fails to compile loses only its row
                    r["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    torch.cuda.synchronize()
                rows.append(r)
                print(json.dumps(r), flush=True)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "torch": torch.__version__, "triton": library_version("triton"), "copy_rate": peak,
           "command": "tune_launch.py OUT " + " ".join(argv if argv is not None else sys.argv[1:]),
           "seconds": time.time() - t_start, "rows": rows}
    (args.out_dir / "tune_launch.json").write_text(json.dumps(res, indent=1))
    (args.out_dir / "tune_launch.md").write_text(markdown(res))
    print(markdown(res))
    return 0


def markdown(res: dict) -> str:
    out = [f"# Weighted sparse decode launch settings on {res['device']} ({res['date']})", "",
           f"- command: `{res['command']}`; torch {res['torch']}, triton {res['triton']}",
           "- page-16 list at ≈ 5 % (random distinct pages) and streaming (sink 128 + window, ranges), batch 1, "
           "32/8/128 bf16; CUDA graph, cold L2, median; floor = K+V bytes read / copy rate", "",
           "| n | case | setting | µs | × FlashInfer | floor µs | rel err |", "|---:|---|---|---:|---:|---:|---:|"]
    rows = [r for r in res["rows"] if "us" in r]
    fi = {r["n"]: r["us"] for r in rows if r["case"] == "flashinfer"}
    for (n, case) in sorted({(r["n"], r["case"]) for r in rows if r["case"] != "flashinfer"}):
        mine = [r for r in rows if r["n"] == n and r["case"] == case]
        default = [r for r in mine if r.get("default")]
        best = sorted((r for r in mine if not r.get("default")), key=lambda r: r["us"])[:5]
        for r in default + best:
            setting = "defaults" if r.get("default") else (f"block_n {r['block_n']}, warps {r['num_warps']}, "
                                                          f"stages {r['num_stages']}, programs {r['target_programs']}")
            ratio = f"{fi[n] / r['us']:.2f}" if n in fi else "—"
            out.append(f"| {n:,} | {case} | {setting} | {r['us']:.1f} | {ratio} | {r['floor_us']:.1f} | "
                       f"{r['rel_error']:.1e} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
