"""``kvsieve bench real``: every method end to end on the offline real models (SmolLM2-135M at 8k, Gemma 3
270M at 32k), on needle prompts: ms/token, density, and whether the greedy answer equals dense's."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from .bench import parse_sizes


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    r = bench_sub.add_parser("real", help="every method end to end on the offline real models, on needle prompts")
    r.add_argument("--models", default="smollm2-135m,gemma3-270m",
                   help="comma list of offline model names (smollm2-135m, gemma3-270m) or local folders")
    r.add_argument("--contexts", default=None,
                   help="comma list of contexts (prompt + new tokens), one per model (default: 8k for smollm2-135m, "
                        "32k for gemma3-270m, else the model's maximum up to 32k)")
    r.add_argument("--methods", default=None,
                   help="semicolon list of method specs (default: every registered method at its defaults)")
    r.add_argument("--task", default="niah_single_2", help="the eval task the prompts come from")
    r.add_argument("--prompts", type=int, default=2, help="prompts per model (the task's samples 0, 1, ...)")
    r.add_argument("--new-tokens", type=int, default=24, help="greedy new tokens per prompt")
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    r.add_argument("--graph", default="auto", choices=("auto", "off"),
                   help="auto: time a captured run where the method's decode can be captured; off: eager runs only")
    r.add_argument("--out", default="benchmarks/results", help="folder of the JSON/markdown results")
    r.add_argument("--name", default=None, help="file stem (default: <date>-<device>-real)")
    r.add_argument("--record-command", default=None, help=argparse.SUPPRESS)
    r.set_defaults(handler=run_real)


def run_real(args: argparse.Namespace) -> int:
    import torch

    from ..bench import real
    from ..core.registry import method_class, parse_spec

    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    if not models:
        raise ValueError("--models: expected at least one model name")
    contexts = None
    if args.contexts:
        sizes = parse_sizes(args.contexts)
        if len(sizes) != len(models):
            raise ValueError(f"--contexts: expected one context per model ({len(models)}), got {len(sizes)}")
        contexts = dict(zip(models, sizes, strict=True))
    methods = None
    if args.methods is not None:
        methods = tuple(m.strip() for m in args.methods.split(";") if m.strip())
        for m in methods:  # a misspelt spec fails before a model is loaded; one that cannot run is reported
            method_class(parse_spec(m)[0])
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("kvsieve bench real: --device cuda but no CUDA GPU is visible (use --device cpu)", file=sys.stderr)
        return 2
    results = real.run_real_bench(models=models, contexts=contexts, methods=methods, task=args.task,
                                  prompts=args.prompts, new_tokens=args.new_tokens, device=args.device,
                                  dtype=getattr(torch, args.dtype), graph="auto" if args.graph == "auto" else False)
    device = results["device"].lower()
    tag = "h100" if "h100" in device else "h200" if "h200" in device else device.split()[-1]
    stem = args.name or f"{time.strftime('%Y-%m-%d', time.gmtime())}-{tag}-real"
    command = args.record_command or "kvsieve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    paths = real.write_results(results, Path(args.out), stem, command)
    print(real.markdown(results, command))
    for path in paths:
        print(f"wrote {path}")
    return 0
