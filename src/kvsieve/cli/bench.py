"""``kvsieve bench decode``: decode-step kernel latency against FlashInfer and SDPA (needs a CUDA GPU); ``bench e2e``;
``bench real``: every method end to end on the offline real models."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from ..bench.decode import DEFAULT_VARIANTS, VARIANTS

ATTENTION_HELP = ("peaked (default): attention calibrated to the offline real models' (sink tokens, a local window, "
                  "strong matches; bench/peaked.py, the committed fit per shape); uniform: random, flat attention "
                  "(the flat worst case, where adaptive methods keep nearly every key)")


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma list of sizes, "k" for 1024: "8k,32768" -> (8192, 32768)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return tuple(out)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="GPU benchmarks: decode-step attention vs FlashInfer/SDPA; whole-model decode")
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
                   help="with --attention uniform: multiply the Gaussian queries (1 = flat attention)")
    d.add_argument("--attention", choices=("peaked", "uniform"), default="peaked", help=ATTENTION_HELP)
    d.add_argument("--out", default="benchmarks/results", help="folder of the JSON/markdown/PNG results")
    d.add_argument("--name", default=None, help="file stem (default: <date>-<device>-decode)")
    d.add_argument("--record-command", default=None, help=argparse.SUPPRESS)
    d.set_defaults(handler=run)

    e = bench_sub.add_parser("e2e", help="whole-model decode steps per method (random weights, known shapes)")
    e.add_argument("--shapes", default="llama-3.1-8b", help="comma list of llama-3.1-8b, qwen2.5-7b, smollm2-135m")
    e.add_argument("--contexts", default="8k,32k,64k,128k", help="comma list of prompt lengths per row")
    e.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    e.add_argument("--cases", default=None,
                   help="explicit batch×context cases instead of the full grid, e.g. '1x32k,1x128k,8x32k'")
    e.add_argument("--methods", default=None,
                   help="semicolon list of method specs run in the runtime (empty: none; default "
                        "santa-prop:budget=128, with --ttft sketchwalk;sketchwalk:variant=reconstruction,density=0.1: "
                        "methods with a sparse prefill)")
    e.add_argument("--baselines", default="runtime,hf-eager", help="comma list of runtime, hf-eager")
    e.add_argument("--steps", type=int, default=30, help="timed decode steps (graph-captured variants)")
    e.add_argument("--method-steps", type=int, default=8, help="timed decode steps of eagerly run methods")
    e.add_argument("--hf-steps", type=int, default=4, help="timed decode steps of transformers' eager decode")
    e.add_argument("--warmup", type=int, default=3)
    e.add_argument("--attention", choices=("peaked", "uniform"), default="peaked", help=ATTENTION_HELP)
    e.add_argument("--ttft", action="store_true",
                   help="time to first token instead of decode steps: prefill of N tokens + the first token, for the "
                        "runtime's exact prefill, transformers' (hf-eager) and each method's sparse prefill")
    e.add_argument("--ttft-repeats", type=int, default=3, help="--ttft: timed prefills per variant (the median)")
    e.add_argument("--ttft-warmup", type=int, default=1,
                   help="--ttft: untimed prefills per variant first (they compile FlexAttention for the shape)")
    e.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: the command launches one process per GPU (NCCL), each building its "
                        "shard of the shape with random weights (bench/e2e_tp.py); one shape, also llama-3.1-70b")
    e.add_argument("--graph", default="auto", choices=("auto", "off"),
                   help="--tp: capture the decode step in a CUDA graph where the method allows (auto) or run eagerly")
    e.add_argument("--out", default="benchmarks/results", help="folder of the JSON/markdown/PNG results")
    e.add_argument("--saap-fits", default=None,
                   help="folder of the SAAP fits the bench makes for its random-weight shapes when a method that "
                        "needs a fit (saap:probes=32) names no artifacts (default ~/.cache/kvsieve/saap-bench-fits)")
    e.add_argument("--name", default=None, help="file stem (default: <date>-<device>-e2e, or -ttft with --ttft)")
    e.add_argument("--resume", default=None, metavar="EARLIER.json",
                   help="continue an earlier run of the same variants on the same device: its cases are skipped and "
                        "the results file (--out/--name) holds both processes' rows, dates and commands")
    e.add_argument("--record-command", default=None, help=argparse.SUPPRESS)
    e.set_defaults(handler=run_e2e)
    add_real_parser(bench_sub)


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
    if args.attention == "peaked" and args.q_scale != 1.0:
        raise ValueError(f"--q-scale: only with --attention uniform (peaked inputs follow the fit), got {args.q_scale}")
    if not torch.cuda.is_available():
        print("kvsieve bench decode needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    results = run_decode_bench(shapes=shapes, contexts=parse_sizes(args.contexts), batches=parse_sizes(args.batches),
                               variants=variants, warmup=args.warmup, iters=args.iters, seed=args.seed,
                               q_scale=args.q_scale, attention=args.attention)
    device = results["device"].lower()
    tag = "h100" if "h100" in device else "h200" if "h200" in device else device.split()[-1]
    stem = args.name or f"{time.strftime('%Y-%m-%d', time.gmtime())}-{tag}-decode"
    command = args.record_command or "kvsieve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    paths = write_results(results, Path(args.out), stem, command)
    from rich.console import Console
    from rich.markdown import Markdown

    console = Console()
    if console.is_terminal:
        console.print(Markdown(markdown(results, command)))
    else:  # piped: the markdown itself, every table row whole (rich would cut it at 80 columns)
        print(markdown(results, command))
    for path in paths:
        print(f"wrote {path}")
    return 0


def parse_cases(text: str) -> tuple[tuple[int, int], ...]:
    """'1x32k,8x32k' -> ((1, 32768), (8, 32768))."""
    out = []
    for part in text.split(","):
        batch, sep, n = part.strip().lower().partition("x")
        if not sep or not batch.isdigit():
            raise ValueError(f"--cases: expected BATCHxCONTEXT items such as 1x32k, got {part!r}")
        out.append((int(batch), parse_sizes(n)[0]))
    return tuple(out)


def run_e2e(args: argparse.Namespace) -> int:
    import torch

    from ..bench import e2e, resume
    from ..bench.e2e import BASELINES, MODEL_SHAPES, markdown, write_results

    if args.tp != 1:
        if args.resume:
            raise ValueError("--resume: not with --tp (the tensor-parallel bench writes one table per call)")
        return run_e2e_tp(args)
    shapes = tuple(s.strip() for s in args.shapes.split(",") if s.strip())
    for s in shapes:
        if s not in MODEL_SHAPES:
            raise ValueError(f"--shapes: expected names from {', '.join(MODEL_SHAPES)}, got {s!r}")
    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    for b in baselines:
        if b not in BASELINES:
            raise ValueError(f"--baselines: expected names from {', '.join(BASELINES)}, got {b!r}")
    if args.methods is None:
        methods = e2e.TTFT_METHODS if args.ttft else ("santa-prop:budget=128",)
    else:
        methods = tuple(m.strip() for m in args.methods.split(";") if m.strip())
    from ..bench.saap_fit import check_spec

    for m in methods:
        check_spec(m)  # a bad spec fails before the model is built (one the bench fits: all but its artifacts)
    if args.ttft:
        try:
            e2e.check_ttft_methods(methods)
        except ValueError as exc:
            raise ValueError(f"--{exc} (with --ttft)") from None
        for name, value, low in (("--ttft-repeats", args.ttft_repeats, 1), ("--ttft-warmup", args.ttft_warmup, 0)):
            if value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value}")
    cases = parse_cases(args.cases) if args.cases else None
    previous = None
    if args.resume:
        previous = resume.load_previous(args.resume)
        grid = cases or tuple((b, n) for b in parse_sizes(args.batches) for n in parse_sizes(args.contexts))
        cases = tuple(resume.remaining_cases(previous, shapes, grid, list(methods) + list(baselines)))
    if not torch.cuda.is_available():
        print("kvsieve bench e2e needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name().lower()
    tag = "h100" if "h100" in device else "h200" if "h200" in device else device.split()[-1]
    stem = args.name or f"{time.strftime('%Y-%m-%d', time.gmtime())}-{tag}-{'ttft' if args.ttft else 'e2e'}"
    command = args.record_command or "kvsieve " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    def whole(partial):
        """The results file's content and header command: this process's, or joined to the earlier run's."""
        if previous is None:
            return partial, command
        joined = resume.join(previous, partial, previous.get("command", ""), command)
        return joined, resume.joined_command(joined)

    def save(partial):
        joined, header = whole(partial)
        return write_results(joined, Path(args.out), stem, header)

    sizes = dict(contexts=parse_sizes(args.contexts), batches=parse_sizes(args.batches), cases=cases)
    if args.ttft:
        results = e2e.run_ttft_bench(shapes=shapes, methods=methods, baselines=baselines, repeats=args.ttft_repeats,
                                     warmup=args.ttft_warmup, checkpoint=save, attention=args.attention, **sizes)
    else:
        results = e2e.run_e2e_bench(shapes=shapes, methods=methods, baselines=baselines, steps=args.steps,
                                    method_steps=args.method_steps, hf_steps=args.hf_steps, warmup=args.warmup,
                                    checkpoint=save, saap_fits=args.saap_fits, attention=args.attention, **sizes)
    results, header = whole(results)
    paths = write_results(results, Path(args.out), stem, header)
    print(markdown(results, header))
    for path in paths:
        print(f"wrote {path}")
    return 0


def run_e2e_tp(args: argparse.Namespace) -> int:
    """``kvsieve bench e2e --tp N``: one shape sharded over N GPUs (bench/e2e_tp.py), with ``--attention`` as
    on one GPU (peaked by default: the shape needs a committed fit)."""
    import torch

    from ..bench import e2e_tp

    if args.tp < 2:
        raise ValueError(f"--tp: expected an integer >= 2 (1 = one GPU, without --tp), got {args.tp}")
    if args.ttft:
        raise ValueError("--ttft: not with --tp (the tensor-parallel bench times decode steps)")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if len(shapes) != 1 or shapes[0] not in e2e_tp.TP_SHAPES:
        raise ValueError(f"--shapes: --tp runs one shape of {', '.join(e2e_tp.TP_SHAPES)}, got {args.shapes!r}")
    methods = ("quest:top_k=0.05",) if args.methods is None else tuple(
        m.strip() for m in args.methods.split(";") if m.strip())
    import kvsieve

    for m in methods:
        kvsieve.method(m)  # a bad spec fails before any rank starts
    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    cases = parse_cases(args.cases) if args.cases else tuple(
        (b, n) for b in parse_sizes(args.batches) for n in parse_sizes(args.contexts))
    if torch.cuda.device_count() < args.tp:
        print(f"--tp: {args.tp} ranks need {args.tp} GPUs (one each), {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    results = e2e_tp.run_tp_bench(shape=shapes[0], tp=args.tp, cases=cases, methods=methods, baselines=baselines,
                                  steps=args.steps, method_steps=args.method_steps, hf_steps=args.hf_steps,
                                  warmup=args.warmup, graph="auto" if args.graph == "auto" else False,
                                  attention=args.attention)
    device = (results["device"] or "").lower()
    tag = "h100" if "h100" in device else "h200" if "h200" in device else (device.split() or ["gpu"])[-1]
    stem = args.name or f"{time.strftime('%Y-%m-%d', time.gmtime())}-{tag}-e2e-tp{args.tp}"
    command = args.record_command or "kvsieve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    paths = e2e_tp.write_results(results, Path(args.out), stem, command)
    print(e2e_tp.markdown(results, command))
    for path in paths:
        print(f"wrote {path}")
    return 0


def add_real_parser(bench_sub: argparse._SubParsersAction) -> None:
    """``kvsieve bench real``: every method end to end on the offline real models (bench/real.py)."""
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
    r.add_argument("--new-tokens", type=int, default=16, help="greedy new tokens per prompt")
    r.add_argument("--stats-steps", type=int, default=4,
                   help="eager steps a captured method runs for its density (a captured step records no stats)")
    r.add_argument("--device", default="cuda")
    r.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    r.add_argument("--graph", default="auto", choices=("auto", "off"),
                   help="auto: time a captured run where the method's decode can be captured; off: eager runs only")
    r.add_argument("--budget-s", type=float, default=None,
                   help="after this many seconds, the variants not yet run are reported as skipped for it")
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
    device = torch.cuda.get_device_name(args.device).lower() if args.device.startswith("cuda") else "cpu"
    tag = "h100" if "h100" in device else "h200" if "h200" in device else device.split()[-1]
    stem = args.name or f"{time.strftime('%Y-%m-%d', time.gmtime())}-{tag}-real"
    command = args.record_command or "kvsieve " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = real.run_real_bench(models=models, contexts=contexts, methods=methods, task=args.task,
                                  prompts=args.prompts, new_tokens=args.new_tokens, stats_steps=args.stats_steps,
                                  device=args.device, dtype=getattr(torch, args.dtype), budget_s=args.budget_s,
                                  graph="auto" if args.graph == "auto" else False,
                                  checkpoint=lambda partial: real.write_results(partial, Path(args.out), stem, command))
    paths = real.write_results(results, Path(args.out), stem, command)
    print(real.markdown(results, command))
    for path in paths:
        print(f"wrote {path}")
    return 0
