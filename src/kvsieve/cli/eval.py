"""``kvsieve eval``: run (or resume) an evaluation grid and print its summary table."""

from __future__ import annotations

import argparse
import shlex
import sys

from .help_format import DefaultsHelpFormatter


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _methods(text: str) -> list[str]:
    # Method specs contain commas themselves (santa-sys:budget=64,rounding=largest): split on ';'
    # when present, else on commas that start a new method name (the part before '=' has no ':').
    if ";" in text:
        return [t.strip() for t in text.split(";") if t.strip()]
    out: list[str] = []
    for part in _csv(text):
        if out and "=" in part and ":" not in part.split("=", 1)[0] and ":" in out[-1]:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def _ints(name: str, text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None


def register(sub: argparse._SubParsersAction) -> None:
    from ..eval.tasks import task_names

    p = sub.add_parser(
        "eval", help="evaluate methods on RULER-style long-context tasks (resumable)",
        description="Run the grid model x method x task x length x sample. Re-running the same command "
        "skips finished cells; adding methods, tasks, lengths or samples computes only the new cells.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", default="default",
                   help="'default' (offline SmolLM2-135M-Instruct) or a local model folder")
    p.add_argument("--tasks", required=True,
                   help=f"comma-separated task names, or 'all' (all scored tasks). Valid: {', '.join(task_names())}")
    p.add_argument("--lengths", required=True, help="comma-separated prompt lengths in tokens, e.g. 2048,4096")
    p.add_argument("--methods", default="dense",
                   help="method specs, e.g. 'dense,santa-sys:budget=64,santa:budget=32' (dense is always added)")
    p.add_argument("--samples", type=int, default=20, help="samples per (task, length) (default 20)")
    p.add_argument("--phase", default="question", choices=("question", "decode", "prefill", "all"),
                   help="question: setup B, context exact, question + answer sparse (default); "
                   "decode: setup A, only generated tokens sparse; prefill: the context through the method's "
                   "sparse prefill, question + answer exact; all: the context through the sparse prefill, "
                   "question + answer sparse as in setup B. prefill and all need methods with a sparse "
                   "prefill (sketchwalk); others are refused. Part of the folder's settings")
    p.add_argument("--output", required=True, help="results folder (created, or resumed when it exists)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task generators and the methods")
    p.add_argument("--dense-layers", default="", help="comma-separated layers that stay exact (default none)")
    p.add_argument("--track-error", type=int, default=4,
                   help="compute exact attention on every k-th sparse step for the relative error (0 = off)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on generated tokens (default: the task's)")
    p.add_argument("--no-teacher-forced", action="store_true", help="skip the teacher-forced KL/top-1 pass")
    p.add_argument("--no-stop-when-solved", action="store_true",
                   help="generate to EOS/limit even after every reference string has appeared")
    p.add_argument("--device", default="cpu",
                   help="where the model runs: 'cpu' (default), 'cuda' or 'cuda:<index>'. Part of the folder's "
                   "settings: CPU and CUDA samplers draw different random streams")
    p.add_argument("--engine", default="auto", choices=("auto", "sparsify", "runtime"),
                   help="what generates the answers: sparsify (transformers' forward with the method attached), "
                   "runtime (kvsieve.generate: serves --phase decode) or auto (the runtime on CUDA under --phase "
                   "decode, sparsify otherwise). Part of the folder's settings")
    p.add_argument("--workers", type=int, default=1,
                   help="processes evaluating prompts in parallel, each with its own model copy (default 1; "
                   "with several GPUs and --device cuda, worker i uses GPU i mod count)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads per worker (default: torch's choice, or the cores divided among workers)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no new prompt after this many seconds (those under way finish); re-run to resume")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..eval import tasks as task_registry
    from ..eval.report import print_table, write_tables
    from ..eval.runner import EvalConfig, run_eval, validate_config

    task_list = _csv(args.tasks)
    if task_list == ["all"]:
        task_list = [t for t in task_registry.task_names() if not t.startswith("tf_")]
    cfg = validate_config(EvalConfig(
        tasks=tuple(task_list), lengths=tuple(_ints("lengths", args.lengths)), methods=tuple(_methods(args.methods)),
        samples=args.samples, output=args.output, model=args.model, phase=args.phase, seed=args.seed,
        dense_layers=tuple(_ints("dense-layers", args.dense_layers)), track_error=args.track_error,
        max_new_tokens=args.max_new_tokens, teacher_forced=not args.no_teacher_forced,
        stop_when_solved=not args.no_stop_when_solved, device=args.device, engine=args.engine,
    ))
    from ..eval.runner import check_lengths
    from ..integrations.models import check_model_name, load_config

    check_model_name(cfg.model)
    check_lengths(cfg.lengths, load_config(cfg.model))  # before a model is loaded or a folder made
    command = "kvsieve " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["eval"] else None
    result = run_eval(cfg, command=command, progress=not args.quiet, workers=args.workers, threads=args.threads,
                      stop_after=args.stop_after)
    summary = write_tables(result.store)
    print_table(summary, title=f"kvsieve eval — {result.store.root}")
    if result.computed:
        busy = f" of {result.busy_s:.1f} s busy in {args.workers} workers" if args.workers > 1 else ""
        print(f"computed {result.computed} cells in {result.total_s:.1f} s, skipped {result.skipped} finished "
              f"ones; {result.forward_s:.1f} s{busy or f' of {result.total_s:.1f} s'} in model forward passes "
              f"(harness overhead {100 * result.overhead:.1f}%)")
    elif not result.left:
        print(f"all {result.skipped} cells were already finished; nothing computed")
    if result.left:
        print(f"stopped early (--stop-after): {result.left} cells left; re-run the command to resume")
    print(f"rows and summary under {result.store.root}; plots: kvsieve report {result.store.root}")
    return 0
