"""``kvsieve bench decode``: decode-step kernel latency against FlashInfer and SDPA (needs a CUDA GPU)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from ..bench.decode import DEFAULT_VARIANTS, VARIANTS


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma list of sizes, "k" for 1024: "8k,32768" -> (8192, 32768)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return tuple(out)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="GPU microbenchmarks (decode-step attention vs FlashInfer/SDPA)")
    bench_sub = p.add_subparsers(dest="bench_kind", required=True)
    d = bench_sub.add_parser("decode", help="time one decode step's attention with a cold L2")
    d.add_argument("--shapes", default="llama-3.1-8b,smollm2-135m",
                   help="comma list of llama-3.1-8b (32/8/128), smollm2-135m (9/3/64)")
    d.add_argument("--contexts", default="4k,8k,16k,32k,64k,128k,256k", help="comma list of context lengths")
    d.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    d.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}: FlashInfer, torch SDPA and the GPU path of each method "
                        "(its default path); those with a budget as name:S, e.g. santa-prop:128")
    d.add_argument("--warmup", type=int, default=10)
    d.add_argument("--iters", type=int, default=40)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--q-scale", type=float, default=1.0,
                   help="multiply the Gaussian queries (1 = the protocol's flat attention; 4 = peaked)")
    d.add_argument("--out", default="benchmarks/results", help="folder of the JSON/markdown/PNG results")
    d.add_argument("--name", default=None, help="file stem (default: <date>-<device>-decode)")
    d.add_argument("--record-command", default=None, help=argparse.SUPPRESS)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..bench.decode import SHAPES, parse_variant, run_decode_bench
    from ..bench.report import markdown, write_results

    shapes = tuple(s.strip() for s in args.shapes.split(","))
    for s in shapes:
        if s not in SHAPES:
            raise ValueError(f"--shapes: expected names from {', '.join(SHAPES)}, got {s!r}")
    variants = tuple(v.strip() for v in args.variants.split(","))
    for v in variants:
        parse_variant(v)
    if not torch.cuda.is_available():
        print("kvsieve bench decode needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    results = run_decode_bench(shapes=shapes, contexts=parse_sizes(args.contexts), batches=parse_sizes(args.batches),
                               variants=variants, warmup=args.warmup, iters=args.iters, seed=args.seed,
                               q_scale=args.q_scale)
    device = results["device"].lower()
    tag = "h100" if "h100" in device else "h200" if "h200" in device else device.split()[-1]
    stem = args.name or f"{time.strftime('%Y-%m-%d', time.gmtime())}-{tag}-decode"
    command = args.record_command or "kvsieve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    paths = write_results(results, Path(args.out), stem, command)
    try:
        from rich.console import Console
        from rich.markdown import Markdown

        Console().print(Markdown(markdown(results, command)))
    except ImportError:  # pragma: no cover
        print(markdown(results, command))
    for path in paths:
        print(f"wrote {path}")
    return 0
