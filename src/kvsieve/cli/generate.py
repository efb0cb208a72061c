"""``kvsieve generate``: the answer of dense attention and of a method, side by side."""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from .help_format import DefaultsHelpFormatter


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate with dense attention and with a method, and compare",
        description="Prefill the prompt (exactly, or with --prefill through a method's sparse prefill), then "
        "generate greedily with dense attention and with the method; print both answers, per-layer density and "
        "wall times.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", default="default", help="'default' (offline SmolLM2-135M) or a transformers id/path")
    p.add_argument("--method", default="santa-sys:budget=64", help="method spec, e.g. santa-sys:budget=64")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", type=Path, help="a text file used as the user message")
    src.add_argument("--demo", action="store_true",
                     help="a number hidden in ~4k tokens of the Paul Graham essays (retrieval check)")
    p.add_argument("--context-tokens", type=int, default=4000, help="demo prompt length in tokens")
    p.add_argument("--depth", type=float, default=0.5, help="demo: where the number sits (0 = start, 1 = end)")
    p.add_argument("--phase", choices=("decode", "question"), default="decode",
                   help="decode: generated tokens are sparse; question (demo only): the question too")
    p.add_argument("--dense-layers", default="", help="comma-separated layer indices kept exact (default: none)")
    p.add_argument("--prefill", default="exact",
                   help="prompt attention of the method's run (runtime engine): exact (SDPA), method (the method's "
                        "own sparse prefill, e.g. sketchwalk) or the spec of a method with a sparse prefill "
                        "(e.g. sketchwalk:variant=reconstruction,density=0.1, then --method decodes); the dense "
                        "run's prefill is exact")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated greedily by each run")
    p.add_argument("--seed", type=int, default=0, help="seed of the method's random draws and of the demo's number")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the model and its cache live there)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="model dtype")
    p.add_argument("--engine", choices=("auto", "runtime", "sparsify"), default="auto",
                   help="runtime: kvsieve.generate (static cache; the decode step in a CUDA graph on cuda); "
                        "sparsify: transformers' generate with kvsieve.sparsify; auto: runtime for --phase decode")
    p.set_defaults(handler=run)


#: The demo's shortest prompt: shorter ones leave too little essay around the number.
MIN_CONTEXT_TOKENS = 256


def _parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--dense-layers: expected comma-separated integers, got {text!r}") from None


def _check_prefill(args: argparse.Namespace, method) -> None:
    """--prefill: exact, method (a method with a sparse prefill) or such a method's spec; runtime engine only."""
    import kvsieve

    choice = args.prefill.strip()
    if choice == "exact":
        return
    if args.engine == "sparsify" or args.phase != "decode":
        raise ValueError(f"--prefill {choice}: the sparse prefill runs in the runtime (--engine runtime, --phase "
                         "decode); with sparsify use a phase that includes the prefill (kvsieve.sparsify(..., "
                         "phase='prefill'))")
    if choice == "method":
        if not method.sparse_prefill:
            raise ValueError(f"--prefill method: {method.name} (--method) has no sparse prefill; use --prefill exact "
                             "or the spec of a method with one (sketchwalk:variant=reconstruction,density=0.1)")
        return
    try:
        other = kvsieve.method(choice)
    except ValueError as exc:
        raise ValueError(f"--prefill: expected exact, method or a method spec, got {choice!r} ({exc})") from None
    if not other.sparse_prefill:
        raise ValueError(f"--prefill: {other.name} has no sparse prefill; expected exact, method or the spec of a "
                         "method with one (sketchwalk)")


def check_arguments(args: argparse.Namespace):
    """Everything that can be checked before the model is loaded; returns (method, dense layers).

    The checks that import neither torch nor transformers come first (the method's name, numbers, files, the
    model's name and whether a hub id can be served), so that such a bad argument fails in about a second.
    """
    from ..core.registry import check_method_name, parse_spec
    from ..integrations.models import check_model_name, check_model_source

    check_method_name(parse_spec(args.method)[0])
    dense_layers = _parse_layers(args.dense_layers)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected >= 1, got {args.max_new_tokens}")
    if args.threads < 0:
        raise ValueError(f"--threads: expected >= 0 (0 = torch's default), got {args.threads}")
    if args.phase == "question" and not args.demo:
        raise ValueError("--phase question needs --demo (a prompt file has no marked question)")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        raise ValueError(f"--prompt-file: {str(args.prompt_file)!r} is not a file")
    if args.demo:
        if not 0 <= args.depth <= 1:
            raise ValueError(f"--depth: expected a value in [0, 1], got {args.depth}")
        if args.context_tokens < MIN_CONTEXT_TOKENS:
            raise ValueError(f"--context-tokens: expected at least {MIN_CONTEXT_TOKENS} tokens, "
                             f"got {args.context_tokens}")
    check_model_name(args.model)
    check_model_source(args.model)

    import kvsieve

    from ..eval.runner import check_device
    from ..integrations.models import load_config

    method = kvsieve.method(args.method)
    _check_prefill(args, method)
    check_device(args.device)
    limit = getattr(load_config(args.model), "max_position_embeddings", None)
    # the smallest prompt each source can have: the demo's minimum, a prompt file's one token
    if limit and args.max_new_tokens + (MIN_CONTEXT_TOKENS if args.demo else 1) > limit:
        raise ValueError(f"--max-new-tokens: {args.max_new_tokens} new tokens leave no room for the prompt in the "
                         f"model's maximum context of {limit}")
    if limit and args.demo and args.context_tokens + args.max_new_tokens > limit:
        raise ValueError(f"--context-tokens: {args.context_tokens} tokens + {args.max_new_tokens} new "
                         f"(--max-new-tokens) exceed the model's maximum context of {limit}")
    return method, dense_layers


def run(args: argparse.Namespace) -> int:
    method, dense_layers = check_arguments(args)  # before the heavy imports below

    import torch
    from rich.markup import escape
    from transformers import DynamicCache

    import kvsieve
    from kvsieve.demo import needle_prompt
    from kvsieve.integrations.models import cache_argument

    from ..eval.report import print_text_table

    console = _console()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = args.engine if args.engine != "auto" else ("runtime" if args.phase == "decode" else "sparsify")
    if engine == "runtime" and args.phase != "decode":
        raise ValueError("--engine runtime: the runtime serves --phase decode only; use --engine sparsify")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is visible")
    with console.status(f"loading model {args.model!r}"):
        model, tok = kvsieve.load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    answer = None
    question_start = None
    if args.demo:
        prompt = needle_prompt(tok, args.context_tokens, args.depth, seed=args.seed)
        ids, answer, question_start = prompt.input_ids, prompt.answer, prompt.question_start
        console.print(f"demo: a 7-digit number hidden at depth {args.depth} of {prompt.n_tokens} tokens "
                      "of the Paul Graham essays")
    else:
        text = args.prompt_file.read_text(encoding="utf-8")
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    ids = ids.to(model.device)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and ids.shape[1] + args.max_new_tokens > limit:
        raise ValueError(f"prompt: {ids.shape[1]} tokens + {args.max_new_tokens} new exceed the model's "
                         f"maximum context of {limit}")

    if engine == "runtime":
        return _run_runtime(args, console, model, tok, ids, answer, method, dense_layers)

    # The exact prefix is computed once and shared by both runs. Its last prompt token is run again
    # by generate(); for phase=decode it must stay exact, so the method starts at the first
    # generated position (phase "question" with the question starting at the prompt's end).
    if args.phase == "decode":
        prefix_len, sparse_phase, sparse_start = ids.shape[1] - 1, "question", ids.shape[1]
    else:
        prefix_len, sparse_phase, sparse_start = question_start, "question", question_start
    t0 = time.perf_counter()
    with console.status(f"prefilling {prefix_len} tokens exactly"), torch.no_grad():
        cache = DynamicCache()
        model(ids[:, :prefix_len], use_cache=True, **{cache_argument(): cache})
    prefill_s = time.perf_counter() - t0

    def generate(session_method=None):
        kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": tok.pad_token_id,
                  cache_argument(): copy.deepcopy(cache)}
        t = time.perf_counter()
        with torch.no_grad():
            if session_method is None:
                out = model.generate(ids, **kwargs)
                session = None
            else:
                with kvsieve.sparsify(model, session_method, phase=sparse_phase, dense_layers=dense_layers,
                                      seed=args.seed, question_start=sparse_start) as session:
                    out = model.generate(ids, **kwargs)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        return text, time.perf_counter() - t, session

    with console.status("generating with dense attention"):
        dense_text, dense_s, _ = generate()
    with console.status(f"generating with {method.spec}"):
        sparse_text, sparse_s, session = generate(method)
    check_method_ran(session.records, session.layer_paths, args.model, method.spec)

    header = ["attention", "answer", *([f"found {answer}"] if answer is not None else []), "mean density",
              "generate s"]
    density = session.mean("density")
    body = []
    for name, text, dens, secs in (("dense", dense_text, 1.0, dense_s), (method.spec, sparse_text, density, sparse_s)):
        cells = [name, escape(text)]
        if answer is not None:
            cells.append("yes" if answer in text else "[red]no[/red]")
        body.append([*cells, f"{dens:.4f}", f"{secs:.1f}"])
    print_text_table(header, body, f"{args.model} · {ids.shape[1]} prompt tokens · phase={args.phase}", left=LEFT)
    console.print(f"shared exact prefill: {prefix_len} tokens in {prefill_s:.1f} s; "
                  f"backends that ran: {', '.join(sorted(session.backends)) or 'none'}")
    _print_miss_note(console, answer, dense_text, sparse_text, method.spec, density)

    _print_layer_summary(console, session.layer_summary(), dense_layers)
    return 0


def _run_runtime(args, console, model, tok, ids, answer, method, dense_layers) -> int:
    """Both answers through kvsieve.generate (the decode runtime); prints the same tables."""
    import time

    from rich.markup import escape

    import kvsieve

    from ..eval.report import print_text_table

    ids = ids.to(args.device)

    def generate(spec, prefill="exact"):
        t = time.perf_counter()
        result = kvsieve.generate(model, ids, spec, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                  dense_layers=dense_layers, pad_token_id=tok.pad_token_id, device=args.device,
                                  prefill=prefill)
        text = tok.decode(result.tokens[0], skip_special_tokens=True).strip()
        return text, time.perf_counter() - t, result.stats

    with console.status("generating with dense attention"):
        dense_text, dense_s, dense_stats = generate("dense")
    with console.status(f"generating with {method.spec}"):
        sparse_text, sparse_s, stats = generate(method, args.prefill.strip())
    header = ["attention", "answer", *([f"found {answer}"] if answer is not None else []), "mean density",
              "generate s", "ms/token", "graph"]
    body = []
    runs = (("dense", dense_text, dense_stats, dense_s), (method.spec, sparse_text, stats, sparse_s))
    for name, text, st, secs in runs:
        # captured steps record no stats: their density is not known here (not 1)
        density = "1.0000" if name == "dense" else f"{st.mean('density'):.4f}" if st.records else "– (captured)"
        cells = [name, escape(text)]
        if answer is not None:
            cells.append("yes" if answer in text else "[red]no[/red]")
        body.append([*cells, density, f"{secs:.1f}", f"{st.ms_per_step:.1f}", "yes" if st.graph else "no"])
    print_text_table(header, body, f"{args.model} · {ids.shape[1]} prompt tokens · runtime on {args.device}",
                     left=LEFT)
    _print_miss_note(console, answer, dense_text, sparse_text, method.spec,
                     stats.mean("density") if stats.records else None)
    console.print(f"exact prefill of {ids.shape[1]} tokens: {dense_stats.prefill_s:.1f} s (dense run)")
    if stats.prefill == "sparse":
        console.print(f"{stats.method}: sparse prefill by {stats.prefill_method} on layers "
                      f"{_ranges(stats.prefill_sparse_layers)} (the others exact): "
                      f"{stats.prefill_s:.1f} s, block density {stats.prefill_block_density:.3f}, backends "
                      f"{', '.join(sorted({r['backend'] for r in stats.prefill_records}))}")
    else:
        console.print(f"{stats.method}: exact prefill, {stats.prefill_s:.1f} s")
    console.print(f"{stats.method}: decode attention paths: {', '.join(sorted(stats.backends))}")
    for st in (dense_stats, stats):
        if st.capture_s:
            console.print(f"{st.method}: graph capture and compilation {st.capture_s:.1f} s (in generate s, "
                          "not in ms/token)")
        if not st.graph:
            console.print(f"{st.method}: no CUDA graph ({st.graph_reason})")
        for note in st.fallbacks:
            console.print(f"{st.method}: {note}")
    _print_layer_summary(console, stats.layer_summary(), dense_layers)
    return 0


def check_method_ran(records, layer_paths: dict, model: str, spec: str) -> None:
    """A run in which the method served no attention call compares nothing: an error, not NaN stats.

    ``records``: the method's calls (``SparseSession.records``); ``layer_paths``: per layer, "method" or why
    it stayed exact (``SparseSession.layer_paths``).
    """
    if records:
        return
    if not layer_paths:
        raise ValueError(f"--model: no attention call of {model!r} reached {spec} (its attention does not go "
                         "through transformers' attention interface as a causal LM's self-attention does; "
                         "kvsieve serves causal LMs such as Llama, Qwen2/3, Mistral and Gemma)")
    by_reason: dict[str, list[int]] = {}
    for layer, why in sorted(layer_paths.items()):
        by_reason.setdefault(why, []).append(layer)
    reasons = "; ".join(f"layers {_ranges(layers)}: {why}" for why, layers in by_reason.items())
    raise ValueError(f"--method: {spec} served no attention call, every layer stayed exact ({reasons})")


def miss_note(answer: str | None, dense_text: str, sparse_text: str, spec: str, density: float | None) -> str | None:
    """Why the method's demo answer lacks the number dense attention found, and what to try (None otherwise)."""
    if answer is None or answer not in dense_text or answer in sparse_text:
        return None
    name = spec.partition(":")[0]
    read = f"reading {density:.1%} of the keys per step" if density is not None else "with its selection"
    return (f"note: {spec} lost the number that dense attention found: {read}, its selection most likely "
            "left out keys that carry it in some layer and step, and greedy decoding then continues differently "
            f"(a sparse method trades accuracy for reading less). Try a larger budget (kvsieve methods {name} "
            "lists its parameters), --dense-layers to keep some layers exact, or a shorter --context-tokens.")


def _print_miss_note(console, *args) -> None:
    note = miss_note(*args)
    if note is not None:
        from rich.markup import escape

        console.print(escape(note))


#: Left-aligned columns of the answer tables (text); numbers are right-aligned.
LEFT = ("attention", "answer")


def _console():
    """The console for progress and notes; piped, its lines are never broken (soft wrap)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(soft_wrap=True)


def _ranges(layers: list[int]) -> str:
    """[2, 3, 4, 7] -> '2-4, 7'."""
    parts: list[list[int]] = []
    for i in layers:
        if parts and i == parts[-1][1] + 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _print_layer_summary(console, summary: dict, dense_layers) -> None:
    """The per-layer table both engines print (sparsify's session, the runtime's stats)."""
    from ..eval.report import print_text_table

    if summary:
        body = [[str(layer), str(row["calls"]), f"{row['density']:.4f}", f"{row['kv_density']:.4f}",
                 f"{row['v_rows_read']:.1f}", f"{row['n_keys']:.0f}"] for layer, row in summary.items()]
        print_text_table(["layer", "calls", "density", "kv_density", "V rows read", "keys"], body,
                         "per-layer mean over the method's calls", left=())
    if dense_layers:
        console.print(f"layers kept exact: {', '.join(map(str, dense_layers))}")
