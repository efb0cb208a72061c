"""The grid runner: model × method × task × length × sample, resumable, one exact prefill per prompt.

For each (task, length, sample) with unfinished cells:

1. generate the sample (deterministic in its coordinates) and tokenize it;
2. prefill the context once, exactly (dense attention), into a ``DynamicCache``;
3. for each unfinished method: deep-copy the cache, run the question and greedy decoding inside
   ``kvsieve.sparsify(model, method, phase=...)`` (``dense`` runs without it), score the text; then,
   on a fresh copy, teacher-force the question and the gold answer and compare next-token
   distributions with dense (KL, top-1); write the cell atomically.

Under ``phase="question"`` (setup B) the cache holds only the context; the question's tokens and
the generated ones use the method. Under ``phase="decode"`` (setup A) the question is prefilled
exactly as well and only generated tokens use the method. Either way the shared prefill is
exact, so every method reuses it and pays only for its own tokens — except a prefill method
(Sketch&Walk), whose decode needs what it records from the prompt's own forward (the queries): its
prompt (setup A) or its context (setup B, then the question as one multi-row chunk) is run again
inside its session.

The sparse-prefill phases split the prompt as setup B does and run the context through the method's
sparse prefill (only methods that have one: others are refused by :func:`validate_config`):
``phase="prefill"`` (prefill-only) leaves the session after the context, so the question, the gold
target and the generated tokens are exact; ``phase="all"`` (end to end) keeps it, and they go through
the method's decode as under ``"question"``. Dense is the exact reference in every phase.
"""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.config import require_int
from . import tasks as task_registry
from .metrics import next_token_agreement, summarize_records
from .store import ResultStore

DENSE = "dense"
PHASES = ("question", "decode", "prefill", "all")
# Phases whose cache before the question is the method's own sparse prefill of the context.
SPARSE_PREFILL_PHASES = ("prefill", "all")


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation grid. ``methods`` are spec strings; dense is always part of the grid."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    methods: tuple[str, ...]
    samples: int
    output: str
    model: str = "default"
    phase: str = "question"
    seed: int = 0
    dense_layers: tuple[int, ...] = ()
    track_error: int = 4
    max_new_tokens: int | None = None
    teacher_forced: bool = True
    stop_when_solved: bool = True
    device: str = "cpu"

    def settings(self) -> dict[str, Any]:
        """What every cell of a results folder must share (checked on resume).

        The device is one of them: the methods draw their samples from a generator on the model's
        device, and CPU and CUDA generators give different streams for one seed.
        """
        return {
            "model": self.model, "phase": self.phase, "seed": self.seed, "dense_layers": list(self.dense_layers),
            "track_error": self.track_error, "max_new_tokens": self.max_new_tokens,
            "teacher_forced": self.teacher_forced, "stop_when_solved": self.stop_when_solved,
            "device": torch.device(self.device).type,
        }

    def grid(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), "lengths": list(self.lengths), "methods": list(self.methods),
                "samples": self.samples}


def canonical_methods(specs: Sequence[str]) -> tuple[str, ...]:
    """Validated, canonical spec strings, dense first, no duplicates (unknown names raise, listing valid ones)."""
    from ..core.registry import method

    out: list[str] = [DENSE]
    for spec in specs:
        m = method(spec)
        canonical = m.spec
        budget = getattr(m.config, "budget", None)
        if budget is not None and "budget=" not in canonical:
            # Reports plot against the budget, so it is always spelled out, even when it is the default.
            name, _, rest = canonical.partition(":")
            canonical = f"{name}:budget={budget}" + (f",{rest}" if rest else "")
        if canonical not in out:
            out.append(canonical)
    return tuple(out)


def validate_config(cfg: EvalConfig) -> EvalConfig:
    """Check everything that can be checked before loading a model; returns a normalized config."""
    if not cfg.tasks:
        raise ValueError("tasks: expected at least one task; valid tasks: " + ", ".join(task_registry.task_names()))
    tasks = tuple(dict.fromkeys(task_registry.check_task(t) for t in cfg.tasks))
    if not cfg.lengths:
        raise ValueError("lengths: expected at least one length in tokens")
    for length in cfg.lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 256:
            raise ValueError(f"lengths: expected integers of at least 256 tokens, got {length!r}")
    if isinstance(cfg.samples, bool) or not isinstance(cfg.samples, int) or cfg.samples < 1:
        raise ValueError(f"samples: expected a positive integer, got {cfg.samples!r}")
    if cfg.phase not in PHASES:
        raise ValueError(f"phase: expected 'question' (setup B), 'decode' (setup A), 'prefill' (sparse "
                         f"prefill of the context only) or 'all' (sparse prefill, then setup B), got {cfg.phase!r}")
    if cfg.track_error < 0:
        raise ValueError(f"track_error: expected an integer >= 0 (0 = off), got {cfg.track_error}")
    if cfg.max_new_tokens is not None and cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive integer, got {cfg.max_new_tokens}")
    check_device(cfg.device)
    methods = canonical_methods(cfg.methods)
    if cfg.phase in SPARSE_PREFILL_PHASES:
        check_sparse_prefill(methods, cfg.phase)
    return EvalConfig(**{**asdict(cfg), "tasks": tasks, "lengths": tuple(dict.fromkeys(cfg.lengths)),
                         "methods": methods, "dense_layers": tuple(cfg.dense_layers)})


def check_sparse_prefill(methods: Sequence[str], phase: str) -> None:
    """Every method but dense has a sparse prefill: an exact prefill in its place would be scored as if it
    were the method's, so a method without one is refused rather than run densely."""
    from ..core.registry import method, method_class
    from ..core.registry import methods as registered

    lacking = [m for m in methods if m != DENSE and not method(m).sparse_prefill]
    if lacking:
        having = [n for n in registered() if method_class(n).sparse_prefill]
        raise ValueError(
            f"phase: {phase!r} runs the context through the method's sparse prefill, and "
            f"{', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} none; methods with one: "
            f"{', '.join(having) or 'none'}. Run the others with phase 'question' or 'decode'")


def check_device(device: str) -> None:
    """'cpu' or 'cuda' / 'cuda:<index>' naming a GPU that this machine has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} was asked for but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r} does not exist; this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")


def check_model_name(name: str) -> None:
    """An offline model ('default', 'smollm2-135m', 'gemma3-270m'), a local folder, or something shaped like a
    hub id ``owner/name`` (needs network)."""
    from ..integrations.models import OFFLINE_MODELS

    if name in OFFLINE_MODELS or Path(name).is_dir() or (name.count("/") == 1 and all(name.split("/"))):
        return
    raise ValueError(
        f"model: unknown model {name!r}. Valid models: 'default' or 'smollm2-135m' (the offline "
        "SmolLM2-135M-Instruct), 'gemma3-270m' (the offline Gemma 3 270M, installed on request), "
        "a local folder holding a transformers causal LM, or a hub id 'owner/name' (needs network access)"
    )


def check_lengths(lengths: Sequence[int], config: Any) -> None:
    """Every length fits the model's maximum context (``config``: the model's transformers config)."""
    maximum = getattr(config, "max_position_embeddings", None)
    if maximum is None:
        return
    too_long = [n for n in lengths if n > maximum]
    if too_long:
        raise ValueError(f"lengths: {too_long} exceed the model's maximum context of {maximum} tokens")


def check_room_to_generate(sample: Any, cfg: EvalConfig, model: Any) -> None:
    """The prompt and its new tokens must fit the model's context.

    Positions past the trained range break the model (at 8192 + 16 tokens the default model found
    0/5 needles, at 7680 2/3), so such a run is refused rather than scored.
    """
    maximum = getattr(model.config, "max_position_embeddings", None)
    limit = sample.max_new_tokens if cfg.max_new_tokens is None else min(cfg.max_new_tokens, sample.max_new_tokens)
    if maximum is not None and len(sample.input_ids) + limit > maximum:
        raise ValueError(
            f"lengths: a {len(sample.input_ids)}-token prompt plus {limit} new tokens exceeds the model's "
            f"maximum context of {maximum} tokens; use a length of at most {maximum - limit}")


# ---- timing --------------------------------------------------------------------------------

@dataclass
class Timer:
    """Wall time spent inside the model's forward passes vs in the whole run."""

    forward_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def forward(self, model: Any, *, past_key_values: Any = None, **kwargs: Any):
        """``model(**kwargs)`` with the cache passed under this transformers release's name for it."""
        from ..integrations.models import cache_argument

        if past_key_values is not None:
            kwargs[cache_argument()] = past_key_values
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model(**kwargs)
        if out.logits.is_cuda:
            # CUDA runs asynchronously: without the wait, the GPU's time would be charged to the harness.
            torch.cuda.synchronize(out.logits.device)
        self.forward_s += time.perf_counter() - t0
        return out

    @property
    def total_s(self) -> float:
        return time.perf_counter() - self.started


# ---- one cell ------------------------------------------------------------------------------

@dataclass
class Prefill:
    cache: Any
    last_logits: torch.Tensor  # logits after the exactly prefilled part
    prefilled: int  # tokens in the cache
    seconds: float


def _ids(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long, device=device)


def prefill(model: Any, sample: task_registry.Sample, phase: str, timer: Timer) -> Prefill:
    """The context (every phase but ``"decode"``) or the whole prompt (``"decode"``) in one forward."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    upto = sample.n_tokens if phase == "decode" else sample.question_start
    cache = DynamicCache()
    t0 = time.perf_counter()
    out = timer.forward(model, input_ids=_ids(sample.input_ids[:upto], device), past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
    return Prefill(cache, out.logits[0, -1].float(), upto, time.perf_counter() - t0)


def _session(model: Any, method: str, cfg: EvalConfig, question_start: int, track: bool):
    if method == DENSE:
        return contextlib.nullcontext(None)
    from ..integrations.hf import sparsify

    return sparsify(model, method, phase=cfg.phase, dense_layers=cfg.dense_layers, seed=cfg.seed,
                     track_error=cfg.track_error if track else 0,
                     question_start=question_start if cfg.phase == "question" else None)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids


@dataclass
class MethodOutput:
    text: str
    new_tokens: int
    records: list[dict[str, Any]]
    tf_logits: torch.Tensor | None  # [T, V]: row j predicts forced token j + 1 (see run_method)
    tf_target_rows: int  # how many of the last rows predict gold-target tokens


def _target_ids(tokenizer: Any, sample: task_registry.Sample) -> list[int]:
    return tokenizer(sample.target, add_special_tokens=False)["input_ids"] if sample.target else []


def _records_prompt(session: Any) -> bool:
    """Whether the session's method must see the prompt's forward itself (``observes_prefill``)."""
    return session is not None and session.driver.records_prompt


def _stateless(session: Any) -> bool:
    """Whether the method keeps no state across calls (cropping the cache back is then exact)."""
    return session is None or session.method.new_state() is None


def run_method(model: Any, tokenizer: Any, sample: task_registry.Sample, pre: Prefill, method: str,
               cfg: EvalConfig, timer: Timer, *, generate: bool = True, teacher_force: bool = True) -> MethodOutput:
    """One method on one prompt from the shared exact prefill: greedy generation and teacher forcing.

    Teacher forcing feeds the tokens after the prefill (the question, under setup B) followed by
    the gold target, and keeps the method's next-token logits. The first forced token is predicted
    by the exact prefill, identically for every method, so it is left out: row ``j`` predicts
    forced token ``j + 1``.

    Under setup B both share one forward pass: question + target are run once (causal attention
    makes the question rows independent of the target), the cache is cropped back to the question,
    and greedy decoding continues from the question's last logits. The crop is exact only for
    methods that keep no per-layer state; for others the question is run again on a fresh copy.
    Under setup A forced tokens are fed one at a time, since only single-token steps are sparse.

    ``phase="prefill"`` / ``"all"`` go as setup B, from the method's own sparse prefill of the context
    instead of the shared exact one; under ``"prefill"`` the session ends there, so everything after the
    context is exact (and the crop with it). The first forced token is then predicted by the sparse
    prefill, still left out: it is a question token, and its row is the same position in every phase.
    """
    device = next(model.parameters()).device
    limit = sample.max_new_tokens if cfg.max_new_tokens is None else min(cfg.max_new_tokens, sample.max_new_tokens)
    generate = generate and limit > 0
    question = list(sample.input_ids[pre.prefilled:])
    target = _target_ids(tokenizer, sample) if teacher_force else []
    forced = question + target if teacher_force else []
    tf_logits, tf_rows = None, 0
    logits = pre.last_logits
    cache = copy.deepcopy(pre.cache)
    generated: list[int] = []
    split = cfg.phase != "decode"  # the question comes after the cached context (setup B's split)
    with contextlib.ExitStack() as stack:
        session = stack.enter_context(_session(model, method, cfg, sample.question_start, track=True))
        base = pre.cache
        if _records_prompt(session):
            # A prefill method (Sketch&Walk) keeps what its decode needs from the prompt's forward, queries
            # included: the prompt (setup A) or the context (the other phases) is run again inside the
            # session, exact (setups A, B) or through its sparse prefill ("prefill", "all").
            again = prefill(model, sample, cfg.phase, timer)
            base = again.cache
            # Setup B runs the question on `cache` and may start again from `base`: two caches.
            cache = copy.deepcopy(base) if split else base
            logits = again.last_logits
        if cfg.phase == "prefill":
            stack.close()  # prefill-only: the question, the forced target and the answer run exact
        if split and question:
            run = forced[:-1] if len(forced) > len(question) else question
            out = timer.forward(model, input_ids=_ids(run, device), past_key_values=cache, use_cache=True)
            if teacher_force and len(forced) >= 2:
                tf_logits = out.logits[0, : len(forced) - 1].float()
            logits = out.logits[0, len(question) - 1].float()
            if generate and len(run) > len(question):
                if cfg.phase == "prefill" or _stateless(session):
                    # A negative count removes tokens from the end in transformers 4.x and 5.x alike.
                    cache.crop(-(len(run) - len(question)))
                else:
                    cache = copy.deepcopy(base)
                    out = timer.forward(model, input_ids=_ids(question, device), past_key_values=cache,
                                        use_cache=True, logits_to_keep=1)
                    logits = out.logits[0, -1].float()
        elif teacher_force and len(forced) >= 2:
            tf_cache = copy.deepcopy(base)
            rows = []
            for tok in forced[:-1]:
                out = timer.forward(model, input_ids=_ids([tok], device), past_key_values=tf_cache, use_cache=True)
                rows.append(out.logits[0, -1].float())
            tf_logits = torch.stack(rows)
            del tf_cache
        if tf_logits is not None:
            tf_rows = min(len(target), tf_logits.shape[0])
        eos = _eos_ids(model, tokenizer)
        while generate and len(generated) < limit:
            token = int(logits.argmax())
            if token in eos:
                break
            generated.append(token)
            # Once every reference is in the text, more tokens cannot change a string-match score.
            if cfg.stop_when_solved and sample.score(tokenizer.decode(generated)) == 1.0:
                break
            if len(generated) == limit:
                break
            out = timer.forward(model, input_ids=_ids([token], device), past_key_values=cache, use_cache=True)
            logits = out.logits[0, -1]
    records = session.records if session is not None else []
    text = tokenizer.decode(generated, skip_special_tokens=True)
    return MethodOutput(text, len(generated), records, tf_logits, tf_rows)


def dense_kv_bytes(model: Any, n_keys: float) -> float:
    """K and V bytes that exact attention reads per decode step (all layers, the whole cache)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2.0 * c.num_hidden_layers * c.num_key_value_heads * n_keys * head_dim * elem


# ---- the grid ------------------------------------------------------------------------------

@dataclass
class RunResult:
    store: ResultStore
    computed: int
    skipped: int
    forward_s: float  # inside model forward passes, summed over workers
    total_s: float  # wall time of the run
    busy_s: float = 0.0  # time the workers were running, summed (= total_s with one worker)
    left: int = 0  # cells not computed because the run stopped early (stop_after)

    @property
    def overhead(self) -> float:
        busy = self.busy_s or self.total_s
        return 1.0 - self.forward_s / busy if busy > 0 else float("nan")


Group = tuple[str, int, int]  # (task, length, sample index)


def evaluate_group(model: Any, tokenizer: Any, cfg: EvalConfig, store: ResultStore, group: Group,
                   methods: Sequence[str], timer: Timer):
    """Run the unfinished ``methods`` of one prompt from one shared exact prefill; yields each written row."""
    task, length, index = group
    n_layers = model.config.num_hidden_layers
    sample = task_registry.make_sample(task, tokenizer, length, index, cfg.seed)
    check_room_to_generate(sample, cfg, model)
    fingerprint = sample.fingerprint()
    for m in cfg.methods:
        # With several workers another one may be computing this prompt's other methods right now.
        if m not in methods and store.has(task, length, index, m):
            old = store.read(task, length, index, m)
            if old.get("fingerprint") != fingerprint:
                raise ValueError(
                    f"results: cell {task}/{length}/{index}/{m} was computed on a different prompt "
                    "(the task generator changed); use a new output folder"
                )
    pre = prefill(model, sample, cfg.phase, timer)
    dense_tf = None
    if cfg.teacher_forced and DENSE not in methods:
        dense_tf = run_method(model, tokenizer, sample, pre, DENSE, cfg, timer, generate=False).tf_logits
    for m in methods:
        t0, f0 = time.perf_counter(), timer.forward_s
        res = run_method(model, tokenizer, sample, pre, m, cfg, timer, teacher_force=cfg.teacher_forced)
        row: dict[str, Any] = {
            "task": task, "length": length, "sample": index, "method": m,
            "n_tokens": sample.n_tokens, "question_start": sample.question_start,
            "fingerprint": fingerprint, "prediction": res.text, "gold": list(sample.gold),
            "score": sample.score(res.text), "new_tokens": res.new_tokens, "prefill_s": pre.seconds,
        }
        if m == DENSE:
            dense_tf = res.tf_logits
            row.update({"density": 1.0, "kv_density": 1.0, "rel_error": 0.0,
                        "rel_error_by_layer": [0.0] * n_layers, "sparse_calls": 0, "backends": ["sdpa"],
                        "bytes_read_per_step": dense_kv_bytes(model, sample.n_tokens)})
        else:
            row.update(summarize_records(res.records, n_layers))
        if cfg.phase in SPARSE_PREFILL_PHASES:
            # What ran in each part (1.0: exact); ``density`` mixes them, weighted by query tokens.
            exact_after = m == DENSE or cfg.phase == "prefill"
            row.setdefault("prefill_density", 1.0)
            row.setdefault("prefill_block_density", 1.0)
            row["decode_density"] = 1.0 if exact_after else row.get("decode_density")
        if cfg.teacher_forced and dense_tf is not None and res.tf_logits is not None:
            row.update(next_token_agreement(dense_tf, res.tf_logits))
            if res.tf_target_rows:
                ans = next_token_agreement(dense_tf[-res.tf_target_rows:], res.tf_logits[-res.tf_target_rows:])
                row.update({"kl_answer": ans["kl_mean"], "top1_answer": ans["top1_agree"]})
        row["seconds"] = time.perf_counter() - t0
        row["forward_s"] = timer.forward_s - f0
        store.write(row)
        yield row


def run_eval(cfg: EvalConfig, *, model: Any = None, tokenizer: Any = None, command: str | None = None,
             progress: bool = True, on_cell: Callable[[dict[str, Any]], None] | None = None,
             workers: int = 1, threads: int | None = None, stop_after: float | None = None) -> RunResult:
    """Run (or resume) the grid; returns counts and timing. ``model``/``tokenizer`` skip loading.

    ``stop_after``: seconds after which no new prompt is started (those under way finish), for runs
    under a time limit; re-running the command resumes.

    ``workers > 1`` runs the prompts in that many processes, each with its own copy of the model on
    ``cfg.device`` (on a machine with several GPUs, worker i takes GPU i mod count); they pull prompts
    from one queue and write cells into the same folder. ``threads`` is the torch CPU threads per
    worker (default: the cores divided among the workers).
    """
    cfg = validate_config(cfg)
    require_int("workers", workers, minimum=1)
    if threads is not None:
        require_int("threads", threads, minimum=1)
    if stop_after is not None and not stop_after > 0:
        raise ValueError(f"stop_after: expected a positive number of seconds, got {stop_after!r}")
    deadline = None if stop_after is None else time.monotonic() + stop_after
    if workers > 1 and model is not None:
        raise ValueError("workers: a model passed in cannot be shared with worker processes; pass model=None "
                         "(each worker loads cfg.model) or workers=1")
    store = ResultStore.open_for_run(cfg.output, cfg.settings(), cfg.grid(), command)
    groups = [(t, n, i) for t in cfg.tasks for n in cfg.lengths for i in range(cfg.samples)]
    finished = store.finished()
    todo = [(g, [m for m in cfg.methods if (*g, m) not in finished]) for g in groups]
    todo = [(g, ms) for g, ms in todo if ms]
    n_cells = len(groups) * len(cfg.methods)
    n_todo = sum(len(ms) for _, ms in todo)
    if not todo:
        store.save_manifest()
        return RunResult(store, 0, n_cells, 0.0, 0.0)
    workers = min(workers, len(todo))
    if workers > 1:
        check_model_name(cfg.model)
        from ..integrations.models import load_config

        check_lengths(cfg.lengths, load_config(cfg.model))
        store.save_manifest()
        return _run_workers(cfg, store, todo, n_cells, n_todo, workers, threads, progress, on_cell, deadline)
    if threads is not None:
        torch.set_num_threads(threads)
    if model is None:
        check_model_name(cfg.model)
        from ..integrations.models import load_model

        model, tokenizer = load_model(cfg.model, device=cfg.device)
    check_lengths(cfg.lengths, model.config)
    store.save_manifest()
    timer = Timer()
    from tqdm.auto import tqdm

    bar = tqdm(total=n_todo, desc="eval cells", unit="cell", disable=not progress, dynamic_ncols=True)
    computed = 0
    try:
        for group, methods in todo:
            if deadline is not None and time.monotonic() > deadline:
                break
            bar.set_postfix_str("{} {} #{}".format(*group))
            for row in evaluate_group(model, tokenizer, cfg, store, group, methods, timer):
                computed += 1
                bar.update(1)
                if on_cell is not None:
                    on_cell(row)
    finally:
        bar.close()
        _log_run(store, computed, timer.total_s, timer.forward_s, timer.total_s, workers=1,
                 threads=torch.get_num_threads())
    store.vacuum()
    return RunResult(store, computed, n_cells - n_todo, timer.forward_s, timer.total_s, timer.total_s,
                     n_todo - computed)


def _log_run(store: ResultStore, computed: int, wall_s: float, forward_s: float, busy_s: float, *,
             workers: int, threads: int) -> None:
    run_log = {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cells": computed,
               "total_s": busy_s, "wall_s": wall_s, "forward_s": forward_s,
               "overhead": 1.0 - forward_s / busy_s if busy_s > 0 else None, "workers": workers,
               "threads": threads, "device": store.manifest["settings"].get("device", "cpu"),
               "host": platform.node(), "cpu_count": os.cpu_count()}
    store.manifest.setdefault("runs", []).append(run_log)
    store.save_manifest()


def _worker_device(device: str, rank: int) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.device_count() > 1:
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


def _worker_main(rank: int, cfg: EvalConfig, root: str, threads: int, jobs: Any, results: Any,
                 deadline: float | None) -> None:
    """A worker process: load the model once, then evaluate prompts from ``jobs`` until a ``None``."""
    import traceback

    try:
        torch.set_num_threads(threads)
        from ..integrations.models import load_model

        model, tokenizer = load_model(cfg.model, device=_worker_device(cfg.device, rank))
        store = ResultStore.open_existing(root)
        timer = Timer()
        while (job := jobs.get()) is not None:
            if deadline is not None and time.monotonic() > deadline:
                break
            group, methods = job
            for row in evaluate_group(model, tokenizer, cfg, store, group, methods, timer):
                results.put(("cell", rank, row))
        results.put(("done", rank, timer.forward_s, timer.total_s))
    except BaseException:  # noqa: BLE001 — reported to the parent, which stops the run with it
        results.put(("error", rank, traceback.format_exc()))


def _run_workers(cfg: EvalConfig, store: ResultStore, todo: list, n_cells: int, n_todo: int, workers: int,
                 threads: int | None, progress: bool, on_cell: Callable[[dict[str, Any]], None] | None,
                 deadline: float | None, methods_per_job: int = 6) -> RunResult:
    import multiprocessing as mp
    import queue

    from tqdm.auto import tqdm

    threads = threads or max(1, (os.cpu_count() or 1) // workers)
    ctx = mp.get_context("spawn")  # CUDA cannot be used in forked children
    jobs, results = ctx.Queue(), ctx.Queue()
    # A job is a prompt with a few of its methods: the prefill is cheap next to the methods, and small
    # jobs keep the workers evenly busy to the end. Largest lengths first, for the same reason.
    for group, methods in sorted(todo, key=lambda j: -j[0][1]):
        for i in range(0, len(methods), methods_per_job):
            jobs.put((group, methods[i:i + methods_per_job]))
    for _ in range(workers):
        jobs.put(None)
    # Jobs left in the queue when the run stops early must not keep this process from exiting.
    jobs.cancel_join_thread()
    procs = [ctx.Process(target=_worker_main, args=(r, cfg, str(store.root), threads, jobs, results, deadline),
                         daemon=True) for r in range(workers)]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    bar = tqdm(total=n_todo, desc=f"eval cells ({workers} workers)", unit="cell", disable=not progress,
               dynamic_ncols=True)
    computed, forward_s, busy_s, done = 0, 0.0, 0.0, set()
    try:
        while len(done) < workers:
            try:
                msg = results.get(timeout=5.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and not p.is_alive()]
                if dead and results.empty():
                    raise RuntimeError(f"eval worker {dead[0]} died (exit code {procs[dead[0]].exitcode}) "
                                       "without reporting; finished cells are kept, re-run to resume") from None
                continue
            kind, rank = msg[0], msg[1]
            if kind == "cell":
                computed += 1
                bar.update(1)
                bar.set_postfix_str("{task} {length} #{sample}".format(**msg[2]))
                if on_cell is not None:
                    on_cell(msg[2])
            elif kind == "done":
                done.add(rank)
                forward_s += msg[2]
                busy_s += msg[3]
            else:
                raise RuntimeError(f"eval worker {rank} failed; finished cells are kept, re-run to resume. "
                                   f"Its traceback:\n{msg[2]}")
    finally:
        bar.close()
        for proc in procs:
            if proc.is_alive() and len(done) < workers:
                proc.terminate()
            proc.join(timeout=30)
        wall = time.perf_counter() - started
        _log_run(store, computed, wall, forward_s, busy_s or wall, workers=workers, threads=threads)
    store.vacuum()
    return RunResult(store, computed, n_cells - n_todo, forward_s, wall, busy_s, n_todo - computed)
