"""Hugging Face transformers integration: run a kvsieve method inside any causal LM's attention.

kvsieve registers an attention function named ``"kvsieve"`` in transformers' attention interface
(and the SDPA mask builder under the same name). ``sparsify`` points the model's attention modules
at it for the duration of a ``with`` block and restores the previous implementation afterwards.
Queries that the phase policy leaves dense go through transformers' own SDPA path unchanged; the
others run the method, one query row at a time, against the layer's whole KV cache.

Per-request state (step counter, each layer's method state, the collected stats) lives in the
:class:`SparseSession` object, never on the model's modules.

Methods with a prefill path (:class:`~kvsieve.core.prefill.PrefillMethod`, e.g. Sketch&Walk) also
get the prompt's forward pass (sparse under ``phase="prefill"`` or ``"all"``, observed only under
``"decode"`` and ``"question"``) and one dict per forward pass shared by its layers
(``SparseSession.forward_state``). Under ``"question"`` the question chunk that follows the observed
context goes through their decode as one multi-row call per layer.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..core.method import Method
from ..core.prefill import FORWARD_STATE, PrefillMethod
from ..core.registry import method as build_method
from ..core.rng import RandomKey

ATTENTION_NAME = "kvsieve"
Phase = Literal["decode", "question", "prefill", "all"]
PHASES = ("decode", "question", "prefill", "all")
# Phases whose prompt forward runs a PrefillMethod's sparse prefill.
SPARSE_PREFILL = ("prefill", "all")

# attention module -> the session it currently serves (weak: a dropped model leaves nothing behind)
_SESSIONS: weakref.WeakKeyDictionary[torch.nn.Module, SparseSession] = weakref.WeakKeyDictionary()
_CAPTURES: weakref.WeakKeyDictionary[torch.nn.Module, AttentionCapture] = weakref.WeakKeyDictionary()
_REGISTERED = False


def _register_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _kvsieve_attention)
    # Boolean masks [B, 1, Q, N] (or None when plain causal): exactly what the query rows need.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _REGISTERED = True


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of a transformers model (those that carry a ``layer_idx``)."""
    found = [
        m for m in model.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and type(m).__name__.endswith("Attention")
        and hasattr(m, "config")
    ]
    if not found:
        raise ValueError(
            f"model: found no attention modules with a layer_idx in {type(model).__name__}; kvsieve "
            "supports transformers causal LMs that use the attention interface (Llama, Qwen2/3, "
            "Mistral, Gemma families)"
        )
    return found


@contextmanager
def _attention_implementation(modules: Sequence[torch.nn.Module]):
    """Point every module's config at kvsieve's attention; restore each config on exit."""
    _register_attention()
    configs = {id(m.config): m.config for m in modules}
    previous = {key: cfg._attn_implementation for key, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg._attn_implementation = ATTENTION_NAME
        yield
    finally:
        for key, cfg in configs.items():
            cfg._attn_implementation = previous[key]


@contextmanager
def _attached(modules: Sequence[torch.nn.Module], registry: weakref.WeakKeyDictionary, owner: Any):
    """Route the modules' attention through kvsieve and map each module to ``owner`` in ``registry``."""
    with _attention_implementation(modules):
        for mod in modules:
            registry[mod] = owner
        try:
            yield
        finally:
            for mod in modules:
                registry.pop(mod, None)


def visible_keys(attention_mask: torch.Tensor | None, batch: int, q_len: int, n_keys: int,
                 row: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Keys visible to query ``row`` of the chunk: ``(lengths [B], None)`` or ``(None, key_mask [B, N])``.

    Without a mask attention is plain causal: the chunk's last query sits at the cache's end.
    """
    if attention_mask is None:
        length = n_keys - q_len + row + 1
        return torch.full((batch,), length, dtype=torch.long, device=device), None
    m = attention_mask[:, 0, row, :n_keys] if attention_mask.dim() == 4 else attention_mask[:, row, :n_keys]
    if m.dtype != torch.bool:
        m = m == 0  # additive float mask: 0 where visible, a large negative number where not
    return None, m.expand(batch, n_keys).contiguous()


@dataclass
class _Plan:
    """What every layer of one forward shares (FlashInfer's plan/run split), computed at its first
    layer for each cache length seen (sliding-window layers hold fewer keys)."""

    first_row: int  # query rows before it stay exact (host-known)
    row_mask: torch.Tensor | None  # [B, Q'] bool on the device where rows after first_row still differ
    track_rows: torch.Tensor | None  # [Q'] rows whose error is tracked (positions divisible by k)
    plain_causal: bool | None = None  # the forward's mask is plain causal (checked once, prefix-only methods)


@dataclass
class _LayerTotals:
    """Per layer sums over the calls the method served, on the device until read."""

    calls: int = 0
    rows: int = 0
    sums: dict[str, Any] = field(default_factory=dict)
    error_sum: Any = 0.0
    error_rows: int = 0


_SUMMED = ("density", "kv_density", "v_rows_read", "n_keys")


@dataclass
class SparseSession:
    """One model under one method. Readable after the ``with`` block: ``records``, ``layer_summary()``,
    ``layer_paths`` (which layers ran the method and why the others stayed exact).

    The method is called once per layer per forward with every query row of the chunk that uses it
    (``q [B, Hq, Q, d]``); nothing on that path reads device values on the host. Stats stay device
    tensors until ``records``, ``layer_summary()`` or ``mean()`` read them.
    """

    model: torch.nn.Module
    method: Method
    phase: Phase = "decode"
    dense_layers: frozenset[int] = frozenset()
    seed: int = 0
    track_error: int = 0
    sparse_everywhere: bool = False
    question_start: torch.Tensor | None = None
    step: int = -1
    request: int = 0
    layer_state: dict[int, dict[str, Any]] = field(default_factory=lambda: defaultdict(dict))
    layer_paths: dict[int, str] = field(default_factory=dict)
    first_layer: int = 0
    _calls: list[tuple[dict[str, Any], Any, Any]] = field(default_factory=list)
    _records: list[dict[str, Any]] | None = None
    _plans: dict[tuple, _Plan] = field(default_factory=dict)
    _totals: dict[int, _LayerTotals] = field(default_factory=lambda: defaultdict(_LayerTotals))
    #: State shared by the layers of the current forward pass (Sketch&Walk's walk); reset per forward.
    forward_state: dict[str, Any] = field(default_factory=dict)

    def mark_question(self, start: int | Sequence[int] | torch.Tensor) -> None:
        """Where the question starts: an index into the (left-padded) input ids, per row or shared.

        With ``phase="question"``, queries at or after this position, and every generated token,
        use the method; the context before it is prefilled exactly.
        """
        start_t = torch.as_tensor(start, dtype=torch.long).reshape(-1).cpu()
        if start_t.numel() == 0 or bool((start_t < 0).any()):
            raise ValueError(f"start: expected non-negative token positions, got {start!r}")
        self.question_start = start_t
        self._plans.clear()

    # -- plan: once per forward ----------------------------------------------------------------

    def _begin_forward(self, layer: int, q_len: int, n_keys: int) -> None:
        if layer != self.first_layer:
            return
        self.forward_state = {}
        if n_keys == q_len and self.step >= 0:  # no past keys after earlier work: a new request
            self.request += 1
            self.step = -1
            self.layer_state.clear()
        self.step += 1
        self._plans.clear()

    def _exact_reason(self, module, layer: int, n_keys: int, kwargs) -> str | None:
        """Why this layer stays exact in this forward (host-known facts only), or None."""
        if layer in self.dense_layers:
            return "exact: dense_layers"
        if self.sparse_everywhere:
            return None
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if window:
            return f"exact: sliding window of {window} keys"
        if n_keys <= self.method.exact_below():
            return f"exact: context of {n_keys} keys within the method's fixed part ({self.method.exact_below()})"
        return None

    def _plan(self, batch: int, q_len: int, n_keys: int, device: torch.device) -> _Plan | None:
        """Which query rows use the method (None: no row does)."""
        key = (batch, q_len, n_keys, device)
        if key in self._plans:
            return self._plans[key]
        plan = None
        if self.phase == "prefill":
            pass  # the prompt is sparse (the method's prefill), generated tokens exact
        elif self.phase == "decode":
            # Generated tokens: single-token forwards that follow a prefill.
            if q_len == 1 and n_keys > 1:
                plan = _Plan(0, None, None)
        elif self.phase == "all":
            # Every forward after the sparse prefill: generated tokens, or a chunk of rows (setup B's
            # question), which a prefill method's decode takes as that many decode steps at once.
            if n_keys > q_len:
                plan = _Plan(0, None, None)
        else:
            if self.question_start is None:
                raise ValueError(
                    "phase='question' needs the question's start: call session.mark_question(start) "
                    "before running the model"
                )
            start = self.question_start
            if start.numel() not in (1, batch):
                raise ValueError(f"mark_question: {start.numel()} starts given for a batch of {batch}")
            # Host arithmetic only: the starts are host ints, the chunk's positions are known.
            first_pos = n_keys - q_len
            starts = start.expand(batch) if start.numel() == 1 else start
            lo = max(0, min(q_len, int(starts.min()) - first_pos))
            if lo < q_len:
                positions = torch.arange(first_pos + lo, n_keys)
                mask = positions[None, :] >= starts[:, None]
                plan = _Plan(lo, None if bool(mask.all()) else mask.to(device), None)
        if plan is not None and self.track_error:
            positions = torch.arange(n_keys - q_len + plan.first_row, n_keys)
            rows = (positions % self.track_error == 0).nonzero().squeeze(1)
            plan.track_rows = rows.to(device) if rows.numel() else None
        self._plans[key] = plan
        return plan

    # -- the attention call ------------------------------------------------------------------

    def attend(self, module, query, key, value, attention_mask, scaling, kwargs) -> torch.Tensor:
        """Output ``[B, Q, Hq, dv]`` (the layout transformers' attention functions return)."""
        layer = module.layer_idx
        batch, _, q_len, _ = query.shape
        n_keys = key.shape[2]
        self._begin_forward(layer, q_len, n_keys)
        prefill_method = isinstance(self.method, PrefillMethod) and layer not in self.dense_layers
        # Setup B: a chunk after the observed context (the question) goes through the method's decode;
        # under "all" so does any chunk after the sparse prefill.
        question_chunk = prefill_method and self.phase in ("question", "all") and n_keys > q_len
        if q_len > 1 and prefill_method and not question_chunk:
            out = self._prefill(module, query, key, value, attention_mask, scaling, kwargs)
            if out is not None:
                return out
        plan = self._plan(batch, q_len, n_keys, query.device)
        if question_chunk and (plan is None or plan.first_row > 0):
            raise ValueError(
                f"model: {self.method.name} takes the context in one forward pass (its decode needs what the "
                f"prefill records) and then the question; this forward has {q_len} tokens after {n_keys - q_len} "
                "cached ones that start before the question")
        reason = None if plan is None else self._exact_reason(module, layer, n_keys, kwargs)
        if plan is None or reason is not None:
            if reason is not None:
                self.layer_paths[layer] = reason
            return _sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0]
        for unsupported in ("softcap", "s_aux", "sinks"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"model: attention with {unsupported!r} is not supported by kvsieve methods")
        self.layer_paths[layer] = "method"
        lo = plan.first_row
        q_rows = query[:, :, lo:, :]
        rows = q_len - lo
        key_mask = None
        if attention_mask is not None and q_len > 1 and self.method.prefix_only_note:
            attention_mask = self._prefix_only_mask(plan, attention_mask, batch, q_len, n_keys)
        if attention_mask is not None:
            m = attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask
            m = m[:, lo:, :n_keys]
            key_mask = (m if m.dtype == torch.bool else m == 0).expand(batch, rows, n_keys)
        # Rows are keyed by their batch row and position on top of this (core.rng.RowStreams): every
        # decode step draws fresh numbers, and a row draws the same in a chunk as on its own.
        seed = RandomKey(self.seed, (self.request, layer))
        est, stats = self.method.decode(q_rows, key, value, key_mask=key_mask, seed=seed, scale=scaling,
                                        state=self._state(layer), check_finite=False)
        est = est.transpose(1, 2).to(query.dtype)  # [B, Q', Hq, dv]
        error = None
        if plan.track_rows is not None:
            error = _relative_errors(est, q_rows, key, value, key_mask, scaling, plan.track_rows)
        if lo == 0 and plan.row_mask is None:
            out = est
        else:
            out = _sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0]
            mixed = est if plan.row_mask is None else torch.where(plan.row_mask[..., None, None], est, out[:, lo:])
            out = torch.cat([out[:, :lo], mixed], dim=1) if lo else mixed
        self._account(layer, n_keys - q_len + lo, n_keys - 1, rows, stats, error)
        return out

    def _prefix_only_mask(self, plan: _Plan, attention_mask: torch.Tensor, batch: int, q_len: int,
                          n_keys: int) -> torch.Tensor | None:
        """None when the chunk's mask is plain causal (then the method gets per-row lengths), else a
        ValueError: methods whose blocks are cache positions (``prefix_only_note``) serve no padding.
        Read once per forward (a host read of the mask, on multi-row forwards only)."""
        if plan.plain_causal is None:
            m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            m = m[:, 0] if m.dim() == 4 else m
            rows = torch.arange(n_keys - q_len, n_keys, device=m.device)
            causal = torch.arange(n_keys, device=m.device)[None, :] <= rows[:, None]
            plan.plain_causal = bool((m[..., :q_len, :n_keys] == causal).all())
        if not plan.plain_causal:
            raise ValueError(f"attention_mask: {self.method.name} needs plain causal attention for a chunk of "
                             f"query rows ({self.method.prefix_only_note}); run padded prompts one at a time")
        return None

    def _state(self, layer: int) -> dict[str, Any]:
        """The method's state for this request and layer. ``state["layer"]`` tells methods with
        per-layer artifacts (SAAP) which layer they serve."""
        state = self.layer_state[layer]
        state["layer"] = layer
        if isinstance(self.method, PrefillMethod):  # cross-layer state of this forward (Sketch&Walk's walk)
            state[FORWARD_STATE] = self.forward_state
        return state

    def _account(self, layer: int, first_pos: int, last_pos: int, rows: int, stats, error) -> None:
        meta = {"request": self.request, "layer": layer, "step": self.step, "position": last_pos,
                "first_position": first_pos, "rows": rows}
        self._calls.append((meta, stats, error))
        self._records = None
        tot = self._totals[layer]
        tot.calls += 1
        tot.rows += rows
        for name in _SUMMED:
            tot.sums[name] = tot.sums.get(name, 0.0) + stats.raw(name) * rows
        if error is not None:
            tot.error_sum = tot.error_sum + error.sum()
            tot.error_rows += error.numel()

    def _prefill(self, module, query, key, value, attention_mask, scaling, kwargs) -> torch.Tensor | None:
        """A PrefillMethod's prompt forward: its output ``[B, Q, Hq, dv]``, or None when the prompt stays
        exact (the method only recorded what its decode needs). ``track_error`` compares every sparse
        prefill with exact attention."""
        layer = module.layer_idx
        q_len = query.shape[2]
        if key.shape[2] != q_len:
            raise ValueError(
                f"model: {self.method.name} takes the prompt in one forward pass and then one token per "
                f"step; this forward has {q_len} tokens after {key.shape[2] - q_len} cached ones")
        if attention_mask is not None:
            m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            causal = torch.ones(q_len, q_len, dtype=torch.bool, device=m.device).tril()
            if not bool((m[..., :q_len, :q_len] == causal).all()):
                raise ValueError(f"attention_mask: {self.method.name}'s prefill needs plain causal attention "
                                 "(no padding); run padded prompts one at a time")
        sparse = self.phase in SPARSE_PREFILL
        out, stats = self.method.prefill(query, key, value, scale=scaling, state=self.layer_state[layer],
                                         forward=self.forward_state, sparse=sparse)
        if out is None:
            return None
        out = out.transpose(1, 2)
        error = None
        if self.track_error:
            exact = _sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0].to(torch.float64)
            error = ((out.to(torch.float64) - exact).norm() / exact.norm().clamp_min(1e-30)).reshape(1)
        self._account(layer, 0, q_len - 1, q_len, stats, error)
        return out

    # -- results (read here: the only host reads of the session) -------------------------------

    @property
    def records(self) -> list[dict[str, Any]]:
        """One dict per method call (layer × forward): its stats, request, step, last ``position``,
        ``rows`` served, and ``rel_error`` (mean over the tracked rows) where tracked."""
        if self._records is None or len(self._records) != len(self._calls):
            self._records = [_record(meta, stats, error) for meta, stats, error in self._calls]
        return self._records

    def layer_summary(self) -> dict[int, dict[str, float]]:
        """Per layer: mean density, kv_density, V rows read, n_keys over rows, calls, rows, and
        rel_error where tracked."""
        summary = {}
        for layer in sorted(self._totals):
            tot = self._totals[layer]
            row = {"calls": tot.calls, "rows": tot.rows}
            for key in _SUMMED:
                row[key] = float(tot.sums[key]) / tot.rows
            if tot.error_rows:
                row["rel_error"] = float(tot.error_sum) / tot.error_rows
            summary[layer] = row
        return summary

    def mean(self, key: str) -> float:
        """Mean of one record field over every sparse call (NaN when none ran)."""
        values = [r[key] for r in self.records if key in r]
        return sum(values) / len(values) if values else math.nan

    @property
    def backends(self) -> set[str]:
        return {stats.backend for _, stats, _ in self._calls}


def _record(meta: dict[str, Any], stats, error) -> dict[str, Any]:
    rec = {**meta, "q_len": meta["rows"], **stats.as_dict()}
    if error is not None:
        rec["rel_error"] = float(error.mean())
    return rec


def _relative_errors(est, q, k, v, key_mask, scale, rows: torch.Tensor) -> torch.Tensor:
    """``‖ô − o‖ / ‖o‖`` per tracked query row (over batch, heads and channels), on the device."""
    qr = q.index_select(2, rows)
    km = None if key_mask is None else key_mask.index_select(1, rows)
    lengths = None
    if km is None:
        # Row j of the chunk sees N − Q' + 1 + j keys: pass them as a per-row mask of the chunk.
        n, q_len = k.shape[2], q.shape[2]
        visible = n - q_len + 1 + rows
        km = (torch.arange(n, device=q.device)[None, :] < visible[:, None])[None].expand(q.shape[0], -1, -1)
    exact, _ = build_method("dense").decode(qr, k, v, lengths=lengths, key_mask=km, scale=scale, check_finite=False)
    e = exact.to(torch.float64).transpose(1, 2)  # [B, rows, Hq, dv]
    diff = est.index_select(1, rows).to(torch.float64) - e
    num = diff.pow(2).sum((0, 2, 3)).sqrt()
    den = e.pow(2).sum((0, 2, 3)).sqrt().clamp_min(1e-30)
    return num / den


def _kvsieve_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    capture = _CAPTURES.get(module)
    if capture is not None:
        capture.add(module.layer_idx, query, key, value)
    session = _SESSIONS.get(module)
    if session is None:  # only capturing: exact attention
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("model: kvsieve methods are for inference; put the model in eval() mode")
    return session.attend(module, query, key, value, attention_mask, scaling, kwargs), None


@contextmanager
def sparsify(
    model: torch.nn.Module,
    method: str | Method,
    *,
    phase: Phase = "decode",
    dense_layers: Iterable[int] = (),
    seed: int = 0,
    track_error: int = 0,
    question_start: int | Sequence[int] | torch.Tensor | None = None,
    sparse_everywhere: bool = False,
):
    """Run ``method`` in ``model``'s attention inside a ``with`` block; yields a :class:`SparseSession`.

    - ``phase="decode"``: the prompt is prefilled exactly; generated tokens use the method.
    - ``phase="question"`` (setup B): the context is prefilled exactly; the question's tokens (from
      ``question_start`` or ``session.mark_question(...)``) and generated tokens use the method. A method
      with a sparse prefill (``sketchwalk``) records the context's forward (one pass, no past keys) and
      takes the question as a chunk of query rows after it.
    - ``phase="prefill"`` / ``"all"``: methods with a sparse prefill (``sketchwalk``) run it on the
      prompt (one forward, no past keys); generated tokens stay exact (``"prefill"``) or use the method
      too (``"all"``, where a chunk of several tokens after the prompt, such as a question, goes through
      the method's decode as one multi-row call, as under ``"question"``).
    - ``dense_layers``: layer indices that always stay exact.
    - ``seed``: every (request, layer, batch row, query position) draws its own stream derived from it.
    - ``track_error=k``: for query rows at positions divisible by k (every k-th decode step, every
      k-th row of a chunk) also compute exact attention and record ``rel_error`` (on the device).
    - ``sparse_everywhere``: run the method on layers where it cannot pay too — sliding-window layers
      (e.g. 15 of Gemma 3's 18) and contexts no longer than the method's fixed part, which stay
      exact by default; ``session.layer_paths`` says which layers ran the method.

    On exit the model's attention implementation is restored; nothing else on it is changed.
    """
    if phase not in PHASES:
        raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
    if isinstance(track_error, bool) or not isinstance(track_error, int) or track_error < 0:
        raise ValueError(f"track_error: expected an integer >= 0, got {track_error!r}")
    m = build_method(method)
    check_model = getattr(m, "check_model", None)
    if check_model is not None:  # methods fitted to one model (SAAP) refuse any other
        check_model(model)
    modules = attention_modules(model)
    n_layers = len(modules)
    dense = frozenset(int(i) for i in dense_layers)
    if isinstance(m, PrefillMethod):
        max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        dense = dense | m.check_layers(n_layers, max_positions)
    elif phase in SPARSE_PREFILL:
        raise ValueError(f"phase: {phase!r} needs a method with a sparse prefill (sketchwalk); "
                         f"{m.name} has none")
    bad = sorted(i for i in dense if not 0 <= i < n_layers)
    if bad:
        raise ValueError(f"dense_layers: layers {bad} do not exist; the model has layers 0..{n_layers - 1}")
    busy = [mod for mod in modules if mod in _SESSIONS]
    if busy:
        raise ValueError("model: already inside another kvsieve.sparsify block; nest none")
    session = SparseSession(model=model, method=m, phase=phase, dense_layers=dense, seed=seed,
                            track_error=track_error, sparse_everywhere=bool(sparse_everywhere),
                            first_layer=min(mod.layer_idx for mod in modules))
    if question_start is not None:
        session.mark_question(question_start)
    with _attached(modules, _SESSIONS, session):
        yield session


@dataclass
class AttentionCapture:
    """Real q/k/v seen by chosen layers: ``calls`` holds (layer, q [B,Hq,Q,d], k [B,Hkv,N,d], v)."""

    layers: frozenset[int] | None
    only_decode: bool
    calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.layers is not None and layer not in self.layers:
            return
        if self.only_decode and q.shape[2] != 1:
            return
        self.calls.append((layer, q.detach().clone(), k.detach().clone(), v.detach().clone()))


@contextmanager
def capture_attention(model: torch.nn.Module, layers: Iterable[int] | None = None, only_decode: bool = True):
    """Record the q/k/v of attention calls (decode steps only, by default) of the chosen layers.

    Attention stays exact. Copies are kept, so capture few layers and steps at long contexts.
    """
    modules = attention_modules(model)
    cap = AttentionCapture(layers=frozenset(layers) if layers is not None else None, only_decode=only_decode)
    with _attached(modules, _CAPTURES, cap):
        yield cap
