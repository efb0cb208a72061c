"""Hugging Face transformers integration: run a kvsieve method inside any causal LM's attention.

kvsieve registers an attention function named ``"kvsieve"`` in transformers' attention interface
(and the SDPA mask builder under the same name). ``sparsify`` points the model's attention modules
at it for the duration of a ``with`` block and restores the previous implementation afterwards.
Queries that the phase policy leaves dense go through transformers' own SDPA path unchanged; the
others run the method, every query row of the chunk in one call, against the layer's whole KV cache.

This module only plumbs the model: the phase policy (which query rows use the method), masks and the
error tracking. How the method is served — its per-request state, seeds, prefill hooks and stats —
is the :class:`~kvsieve.driver.LayerDriver`'s, the same one the decode runtime uses. A method that
declares a prefill hook (``sparse_prefill``/``observes_prefill``: Sketch&Walk) gets the prompt's forward
pass (sparse under ``phase="prefill"`` or ``"all"``, observed only under ``"decode"`` and ``"question"``);
under ``"question"`` the question chunk that follows the observed context goes through its decode as one
multi-row call per layer. Left-padded rows reach a prefix-only method one row at a time (its blocks are
positions), which its stats say.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..core.method import Method
from ..core.registry import method as build_method
from ..driver import LayerDriver

ATTENTION_NAME = "kvsieve"
Phase = Literal["decode", "question", "prefill", "all"]
PHASES = ("decode", "question", "prefill", "all")
# Phases whose prompt forward runs the method's sparse prefill.
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


@dataclass
class _Plan:
    """What every layer of one forward shares (FlashInfer's plan/run split), computed at its first
    layer for each cache length seen (sliding-window layers hold fewer keys)."""

    first_row: int  # query rows before it stay exact (host-known)
    row_mask: torch.Tensor | None  # [B, Q'] bool on the device where rows after first_row still differ
    track_rows: torch.Tensor | None  # [Q'] rows whose error is tracked (positions divisible by k)
    plain_causal: bool | None = None  # the forward's mask is plain causal (checked once, prefix-only methods)


@dataclass
class SparseSession:
    """One model under one method. Readable after the ``with`` block: ``records``, ``layer_summary()``,
    ``layer_paths`` (which layers ran the method and why the others stayed exact).

    The method is called once per layer per forward with every query row of the chunk that uses it
    (``q [B, Hq, Q, d]``); nothing on that path reads device values on the host. Stats stay device
    tensors until ``records``, ``layer_summary()`` or ``mean()`` read them.
    """

    model: torch.nn.Module
    driver: LayerDriver
    phase: Phase = "decode"
    track_error: int = 0
    sparse_everywhere: bool = False
    question_start: torch.Tensor | None = None
    layer_paths: dict[int, str] = field(default_factory=dict)
    first_layer: int = 0
    _plans: dict[tuple, _Plan] = field(default_factory=dict)
    # first valid key of each row when the prompt was left-padded and the method serves prefixes only
    _row_starts: list[int] | None = None

    @property
    def method(self) -> Method:
        return self.driver.method

    @property
    def dense_layers(self) -> frozenset[int]:
        """The layers that stay exact: ``dense_layers`` and the method's own."""
        return self.driver.exact_layers

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
        if n_keys == q_len:  # no past keys: a new request (the first one keeps request 0)
            self.driver.begin_request(new=self.driver.step >= 0)
            self._row_starts = None
        self.driver.begin_forward()
        self._plans.clear()

    def _exact_reason(self, module, layer: int, n_keys: int, kwargs) -> str | None:
        """Why this layer stays exact in this forward (host-known facts only), or None."""
        if layer in self.driver.exact_layers:
            return "exact: dense_layers"
        if self.sparse_everywhere:
            return None
        window = _sliding_window(module, kwargs)
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
        method = self.method
        # A sliding-window layer stays exact in every phase (see _exact_reason): its prompt is neither
        # sparse-prefilled nor recorded.
        sliding = not self.sparse_everywhere and _sliding_window(module, kwargs)
        hooked = (method.sparse_prefill or method.observes_prefill) and self.driver.serves(layer) and not sliding
        # Setup B: a chunk after the observed context (the question) goes through the method's decode;
        # under "all" so does any chunk after the sparse prefill.
        question_chunk = hooked and self.phase in ("question", "all") and n_keys > q_len
        if q_len > 1 and hooked and not question_chunk:
            out = self._prefill(module, query, key, value, attention_mask, scaling, kwargs)
            if out is not None:
                return out
        plan = self._plan(batch, q_len, n_keys, query.device)
        if question_chunk and (plan is None or plan.first_row > 0):
            raise ValueError(
                f"model: {method.name} takes the context in one forward pass (its decode needs what the "
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
        if self._row_starts is not None:  # left-padded rows under a prefix-only method: one row at a time
            est, stats = self.driver.decode_rows_apart(layer, q_rows, key, value, self._row_starts, scale=scaling)
        else:
            if attention_mask is not None and q_len > 1 and method.prefix_only_note:
                attention_mask = self._prefix_only_mask(plan, attention_mask, batch, q_len, n_keys)
            if attention_mask is not None:
                m = attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask
                m = m[:, lo:, :n_keys]
                key_mask = (m if m.dtype == torch.bool else m == 0).expand(batch, rows, n_keys)
            est, stats = self.driver.decode(layer, q_rows, key, value, key_mask=key_mask, scale=scaling)
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
        ValueError: methods whose blocks are cache positions (``prefix_only_note``) serve no padding
        within a chunk. Read once per forward (a host read of the mask, on multi-row forwards only)."""
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

    def _account(self, layer: int, first_pos: int, last_pos: int, rows: int, stats, error) -> None:
        d = self.driver
        meta = {"request": d.request, "layer": layer, "step": d.step, "position": last_pos,
                "first_position": first_pos, "rows": rows, "q_len": rows}
        d.log.add(meta, stats, error)

    def _prefill(self, module, query, key, value, attention_mask, scaling, kwargs) -> torch.Tensor | None:
        """The prompt's forward through the method's prefill hook: its output ``[B, Q, Hq, dv]``, or None
        when the prompt stays exact (the method only recorded what its decode needs). Left-padded rows
        go one at a time, each from its first valid token. ``track_error`` compares every sparse prefill
        with exact attention."""
        layer = module.layer_idx
        q_len = query.shape[2]
        if key.shape[2] != q_len:
            raise ValueError(
                f"model: {self.method.name} takes the prompt in one forward pass and then one token per "
                f"step; this forward has {q_len} tokens after {key.shape[2] - q_len} cached ones")
        starts = None if attention_mask is None else _left_padding(attention_mask, q_len, self.method.name)
        sparse = self.phase in SPARSE_PREFILL
        if starts is None:
            out, stats = self.driver.prefill(layer, query, key, value, scale=scaling, sparse=sparse)
        else:
            self._row_starts = starts
            out, stats = self.driver.prefill_rows_apart(layer, query, key, value, starts, scale=scaling,
                                                        sparse=sparse)
        if out is None:
            return None
        out = out.transpose(1, 2)
        error = None
        if self.track_error:
            exact = _sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0].to(torch.float64)
            if starts is not None:  # padded query rows attend to nothing: compare the rows that exist
                valid = torch.arange(q_len, device=exact.device)[None, :] >= torch.tensor(starts, device=exact.device)[
                    :, None]
                exact = torch.where(valid[..., None, None], exact, 0.0)
                out = torch.where(valid[..., None, None], out, 0.0)
            error = ((out.to(torch.float64) - exact).norm() / exact.norm().clamp_min(1e-30)).reshape(1)
        self._account(layer, 0, q_len - 1, q_len, stats, error)
        return out

    # -- results (read here: the only host reads of the session) -------------------------------

    @property
    def records(self) -> list[dict[str, Any]]:
        """One dict per method call (layer × forward): its stats, request, step, last ``position``,
        ``rows`` served, and ``rel_error`` (mean over the tracked rows) where tracked."""
        return self.driver.log.records

    def layer_summary(self) -> dict[int, dict[str, float]]:
        """Per layer: mean density, kv_density, V rows read, n_keys over rows, calls, rows, and
        rel_error where tracked."""
        return self.driver.log.layer_summary()

    def mean(self, key: str) -> float:
        """Mean of one record field over every sparse call (NaN when none ran)."""
        return self.driver.log.mean(key)

    @property
    def backends(self) -> set[str]:
        return self.driver.log.backends


def _sliding_window(module, kwargs) -> int | None:
    """The layer's sliding window in keys (transformers passes it per call; older modules carry it), or None."""
    return kwargs.get("sliding_window", getattr(module, "sliding_window", None))


def _left_padding(attention_mask: torch.Tensor, q_len: int, name: str) -> list[int] | None:
    """None for a plain causal prompt mask; each row's first valid key for a left-padded one (a host read,
    once per prompt forward); a ValueError for any other pattern."""
    m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    m = (m[:, 0] if m.dim() == 4 else m)[..., :q_len, :q_len]
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=m.device).tril()
    if bool((m == causal).all()):
        return None
    starts = (~m[:, -1]).sum(-1)  # the last query row sees every valid key
    cols = torch.arange(q_len, device=m.device)
    padded = causal & (cols[None, None, :] >= starts[:, None, None]) & (cols[None, :, None] >= starts[:, None, None])
    if not bool((m == padded).all()):
        raise ValueError(f"attention_mask: {name}'s prefill needs causal attention over each row's tokens (left "
                         "padding at most); run other masks one prompt at a time")
    return [int(x) for x in starts.tolist()]


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
    m.check_model(model)  # methods fitted to one model (SAAP) refuse any other
    modules = attention_modules(model)
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    driver = LayerDriver(m, n_layers=len(modules), dense_layers=dense_layers, seed=seed,
                         max_positions=max_positions)
    if phase in SPARSE_PREFILL and not m.sparse_prefill:
        raise ValueError(f"phase: {phase!r} needs a method with a sparse prefill (sketchwalk); "
                         f"{m.name} has none")
    busy = [mod for mod in modules if mod in _SESSIONS]
    if busy:
        raise ValueError("model: already inside another kvsieve.sparsify block; nest none")
    session = SparseSession(model=model, driver=driver, phase=phase, track_error=track_error,
                            sparse_everywhere=bool(sparse_everywhere),
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
