"""``kvsieve bench real``: every method end to end on the offline real models, on needle prompts.

The random-weight shapes of ``kvsieve bench e2e`` time the decode step, but their attention is flat; the
offline real models give the only real attention we have: SmolLM2-135M (``smollm2-135m``, 8k context)
and Gemma 3 270M (``gemma3-270m``, 32k context; 15 of its 18 layers are sliding-window layers, which the
runtime serves exactly over their 512-key window, so a method serves its 3 global layers). Any other
model name or local folder that ``kvsieve.load_model`` takes works too.

Per model: ``prompts`` needle prompts of the eval's ``task`` (RULER's ``niah_single_2`` by default: a
7-digit number in the Paul Graham essays, asked for at the end) of ``context - new_tokens`` tokens, each
prefilled once (exact); then dense and every method at its defaults (every registered method unless
``methods`` names some) decode ``new_tokens`` greedy tokens from that cache, batch 1. Per (method, prompt):

- ``ms``: decode time per token (``RuntimeStats.ms_per_step``: the loop timed with a device sync around
  it, the one-time capture and compilation left out), from a run with the step captured in a CUDA graph
  where the method's decode can be (``graph``), else from its eager run;
- ``density`` / ``kv_density``: the method's mean over its (layer, step) calls, from an eager run (a
  captured step records no stats: for a captured method, its first ``stats_steps`` steps), and the layers
  it served (``method_layers``);
- ``same_as_dense``: its greedy tokens equal dense's; ``found``: the eval's score of its answer (1 when
  every asked value is in it), beside dense's, so "equal to dense where the method keeps the needle"
  reads off one row.

A method that cannot run (a SAAP variant without its fit, a shape its kernels refuse) is reported with
the reason and the others go on.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .report import environment, fmt

REAL_MODELS = {"smollm2-135m": 8192, "gemma3-270m": 32768}  # name -> context (prompt + new tokens)
DEFAULT_TASK = "niah_single_2"


def default_methods() -> tuple[str, ...]:
    """Every registered method but dense, at its defaults (the spec is the name)."""
    from ..core.registry import methods

    return tuple(name for name in methods() if name != "dense")


def default_context(name: str, model: Any) -> int:
    """The model's context in the table: ``REAL_MODELS``' for the offline models, else its maximum (at most 32k)."""
    if name in REAL_MODELS:
        return REAL_MODELS[name]
    return min(getattr(model.config, "max_position_embeddings", None) or 32768, 32768)


def run_real_bench(*, models: Sequence[str] = tuple(REAL_MODELS), contexts: dict[str, int] | None = None,
                   methods: Sequence[str] | None = None, task: str = DEFAULT_TASK, prompts: int = 2,
                   new_tokens: int = 16, seed: int = 0, device: str | torch.device = "cuda",
                   dtype: torch.dtype = torch.bfloat16, graph: bool | str = "auto", stats_steps: int = 4,
                   load: Callable[..., tuple[Any, Any]] | None = None, budget_s: float | None = None,
                   checkpoint: Callable[[dict], object] | None = None,
                   log: Callable[[str], None] = print) -> dict:
    """Rows of (model, method, prompt) and the environment; see the module doc. ``load(name, dtype=, device=)``
    gives ``(model, tokenizer)`` (default: ``kvsieve.integrations.models.load_model``). Once ``budget_s``
    seconds have passed, the variants not yet run are reported as skipped for it; ``checkpoint(results)`` is
    called after each model."""
    from ..eval.tasks import check_task

    check_task(task)
    for name, value, low in (("prompts", prompts, 1), ("new_tokens", new_tokens, 2), ("stats_steps", stats_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    methods = default_methods() if methods is None else tuple(methods)
    if load is None:
        from ..integrations.models import load_model as load
    device = torch.device(device)
    deadline = None if budget_s is None else time.perf_counter() + budget_s
    results = {**environment("real", device, dtype), "task": task, "prompts": prompts, "new_tokens": new_tokens,
               "seed": seed, "stats_steps": stats_steps, "budget_s": budget_s, "methods": list(methods), "models": [],
               "rows": []}
    for name in models:
        if deadline is not None and time.perf_counter() > deadline:
            results["rows"].append({"model": name, "context": None, "prompt": 0, "method": "*",
                                    "skipped": f"the time budget of {budget_s:.0f} s was spent before this model"})
            continue
        t0 = time.perf_counter()
        model, tokenizer = load(name, dtype=dtype, device=device)
        context = (contexts or {}).get(name) or default_context(name, model)
        info = {"model": name, "context": context, "load_s": time.perf_counter() - t0,
                "model_type": getattr(model.config, "model_type", None), "layers": model.config.num_hidden_layers}
        log(f"{name}: loaded in {info['load_s']:.1f} s, context {context}")
        results["models"].append(info)
        results["rows"] += _run_model(model, tokenizer, info, methods, task, prompts, new_tokens, seed, graph,
                                      min(stats_steps, new_tokens - 1), deadline, log)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(results)
    return results


def _run_model(model, tokenizer, info: dict, methods, task, prompts, new_tokens, seed, graph, stats_steps,
               deadline, log) -> list[dict]:
    from ..eval.tasks import make_sample
    from ..runtime import DecodeRuntime

    device = next(model.parameters()).device
    rows = []
    for index in range(prompts):
        sample = make_sample(task, tokenizer, info["context"] - new_tokens, index, seed)
        ids = torch.tensor(sample.input_ids, device=device)
        rt = DecodeRuntime(model, "dense", batch_size=1, capacity=ids.numel() + new_tokens, max_new_tokens=new_tokens,
                           eos_token_id=[], graph=graph)
        with rt:
            t0 = time.perf_counter()
            rt.prefill([ids])
            base = {"model": info["model"], "context": info["context"], "prompt": index, "prompt_tokens": ids.numel(),
                    "prefill_s": time.perf_counter() - t0, "gold": list(sample.gold)}
            dense = None
            for spec in ("dense", *methods):
                row = {**base, "method": spec}
                t0 = time.perf_counter()
                if deadline is not None and t0 > deadline:
                    row["skipped"] = "the time budget (budget_s) was spent before this variant"
                    rows.append(row)
                    continue
                try:
                    row.update(_run_variant(rt, spec, [ids], graph, stats_steps))
                except Exception as exc:  # noqa: BLE001 - a method that cannot run is reported, the others go on
                    row["skipped"] = f"{type(exc).__name__}: {exc}"[:300]
                row["wall_s"] = time.perf_counter() - t0
                if "tokens" in row:
                    row["answer"] = tokenizer.decode(row["tokens"], skip_special_tokens=True)
                    row["found"] = sample.score(row["answer"])
                    dense = row if spec == "dense" else dense
                    row["same_as_dense"] = dense is not None and row["tokens"] == dense["tokens"]
                rows.append(row)
                log(_line(row))
    return rows


def _run_variant(rt, spec: str, prompt_rows, graph, stats_steps: int) -> dict:
    """One method on the prefilled cache. Where its decode can be captured: a captured run (tokens, timing),
    then ``stats_steps`` eager steps for its stats (a captured step records none); else one eager run."""
    cuda = rt.device.type == "cuda"
    rt.set_method(spec, graph=graph)  # the runtime says why a step runs eagerly (CPU, a method's host reads)
    out = {"graph": rt.use_graph, "graph_reason": rt.stats.graph_reason}
    if rt.use_graph:
        _restart(rt, prompt_rows)
        rt.decode()
        out.update(tokens=rt.tokens()[0].tolist(), ms=rt.stats.ms_per_step, capture_s=rt.stats.capture_s)
        rt.set_method(spec, graph=False)
    _restart(rt, prompt_rows)
    rt.decode(stats_steps if out["graph"] else None)
    if not out["graph"]:
        out.update(tokens=rt.tokens()[0].tolist(), ms=rt.stats.ms_per_step)
    records = rt.stats.records
    out.update(method_layers=list(rt.stats.method_decode_layers), window_layers=list(rt.stats.window_layers),
               attention_backend=rt.attention_backend, backends=sorted(rt.stats.backends),
               fallbacks=list(rt.stats.fallbacks), cuda=cuda,
               density=_mean([r["density"] for r in records]) if records else (1.0 if spec == "dense" else None),
               kv_density=_mean([r["kv_density"] for r in records]) if records else None)
    return out


def _restart(rt, prompt_rows) -> None:
    """Back to just after the prompt: a method that starts from its record of the prompt sees it again."""
    if rt.records_prompt:
        rt.prefill(prompt_rows)
    else:
        rt.rewind()


def _mean(values) -> float | None:
    return float(statistics.fmean(values)) if values else None


def _line(r: dict) -> str:
    head = f"{r['model']} {r['context']} #{r['prompt']} {r['method']} ({r.get('wall_s', 0):.1f} s)"
    if "skipped" in r:
        return f"{head}: cannot run: {r['skipped']}"
    return (f"{head}: {fmt(r['ms'], '.2f')} ms/token ({'graph' if r['graph'] else 'eager'}), density "
            f"{fmt(r['density'], '.3f')}, same as dense {r['same_as_dense']}, found {r['found']}, "
            f"answer {r['answer'][:40]!r}")


# -- the table ------------------------------------------------------------------------------------

def summarize(results: dict) -> list[dict]:
    """One row per (model, method) over its prompts: mean ms/token and density, speed vs dense, and the
    counts of prompts whose answer equals dense's and whose needle was found."""
    out = []
    keys = list(dict.fromkeys((r["model"], r["method"]) for r in results["rows"]))
    for model, method in keys:
        rows = [r for r in results["rows"] if r["model"] == model and r["method"] == method]
        dense = [r for r in results["rows"] if r["model"] == model and r["method"] == "dense" and "ms" in r]
        ran = [r for r in rows if "ms" in r]
        row = {"model": model, "context": rows[0]["context"], "method": method, "prompts": len(rows)}
        if not ran:
            row["skipped"] = rows[0].get("skipped", "did not run")
            out.append(row)
            continue
        ms = statistics.fmean(r["ms"] for r in ran)
        dense_ms = statistics.fmean(r["ms"] for r in dense) if dense else None
        densities = [r["density"] for r in ran if r["density"] is not None]
        dense_found = {r["prompt"] for r in dense if r["found"] == 1}
        row.update(ms=ms, speedup=dense_ms / ms if dense_ms else None, density=_mean(densities),
                   graph=all(r["graph"] for r in ran), graph_reason=next((r["graph_reason"] for r in ran
                                                                          if r["graph_reason"]), None),
                   same_as_dense=sum(r["same_as_dense"] for r in ran), found=sum(r["found"] == 1 for r in ran),
                   same_where_dense_found=sum(r["same_as_dense"] for r in ran if r["prompt"] in dense_found),
                   dense_found=len(dense_found), ran=len(ran),
                   backends=sorted({b for r in ran for b in r.get("backends") or ()}),
                   method_layers=ran[0]["method_layers"], window_layers=ran[0]["window_layers"],
                   skipped=next((r["skipped"] for r in rows if "skipped" in r), None))
        out.append(row)
    return out


def markdown(results: dict, command: str) -> str:
    lines = [f"# Real weights, real attention: every method end to end — {results['device']}", "",
             f"- date: {results['date']}; torch {results['torch']}, transformers {results['transformers']}, "
             f"triton {results['triton']}; {results['dtype']}; batch 1",
             f"- command: `{command}`",
             f"- prompts: {results['prompts']} per model, task `{results['task']}` (seed {results['seed']}), "
             f"{results['new_tokens']} greedy new tokens each; context = prompt + new tokens",
             "- ms/token: decode loop time per token (capture and compilation left out), captured in a CUDA graph "
             "where `graph` says yes, else eager; density: the method's mean fraction of keys read per query head "
             "over its layers and steps (an eager run: its first steps where the method is captured); "
             "= dense: prompts whose greedy tokens equal dense's; "
             "needle: prompts whose answer holds the needle (dense's in its own row); path: the attention backends "
             "that ran (`reference` = the method's torch reference, for methods or shapes no kernel serves)", ""]
    for info in results["models"]:
        name = info["model"]
        summary = [s for s in summarize(results) if s["model"] == name]
        served = next((s["method_layers"] for s in summary if s.get("method_layers")), None)
        window = next((s["window_layers"] for s in summary if "window_layers" in s), [])
        lines += [f"## {name} at {info['context']} tokens ({info['layers']} layers"
                  + (f"; {len(window)} sliding-window layers run exact window attention, methods serve layers "
                     f"{served}" if window else "") + ")", "",
                  "| method | ms/token | vs dense | density | graph | path | = dense | = dense where dense found it "
                  "| needle |",
                  "|---|---:|---:|---:|---|---|---:|---:|---:|"]
        for s in summary:
            if "ms" not in s:
                lines.append(f"| {s['method']} | cannot run: {s['skipped'][:160]} | | | | | | | |")
                continue
            n, nd = s["ran"], s["dense_found"]
            graph = "yes" if s["graph"] else f"no ({(s['graph_reason'] or '')[:60]})"
            lines.append(f"| {s['method']} | {s['ms']:.2f} | {fmt(s['speedup'], '.2f')}× "
                         f"| {fmt(s['density'], '.3f')} | {graph} | {', '.join(s['backends']) or '—'} "
                         f"| {s['same_as_dense']}/{n} "
                         f"| {s['same_where_dense_found']}/{nd} | {s['found']}/{n} |")
        lines.append("")
    lines += [f"## {r['model']}: not run ({r['skipped']})\n" for r in results["rows"] if r["method"] == "*"]
    return "\n".join(lines)


def write_results(results: dict, out_dir, stem: str, command: str) -> list:
    """``<stem>.json`` and ``.md``."""
    from .report import write_results as write

    return write(results, out_dir, stem, command, markdown, lambda *_: False)
