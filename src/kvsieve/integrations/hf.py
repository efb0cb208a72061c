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
``"decode"``) and one dict per forward pass shared by its layers (``SparseSession.forward_state``).
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
from ..core.rng import derive_seed

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
class SparseSession:
    """One model under one method. Readable after the ``with`` block: ``records``, ``layer_summary()``."""

    model: torch.nn.Module
    method: Method
    phase: Phase = "decode"
    dense_layers: frozenset[int] = frozenset()
    seed: int = 0
    track_error: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    question_start: torch.Tensor | None = None
    step: int = -1
    request: int = 0
    layer_state: dict[int, dict[str, Any]] = field(default_factory=lambda: defaultdict(dict))
    #: State shared by the layers of the current forward pass (Sketch&Walk's walk); reset per forward.
    forward_state: dict[str, Any] = field(default_factory=dict)

    def mark_question(self, start: int | Sequence[int] | torch.Tensor) -> None:
        """Where the question starts: an index into the (left-padded) input ids, per row or shared.

        With ``phase="question"``, queries at or after this position, and every generated token,
        use the method; the context before it is prefilled exactly.
        """
        start_t = torch.as_tensor(start, dtype=torch.long).reshape(-1)
        if start_t.numel() == 0 or bool((start_t < 0).any()):
            raise ValueError(f"start: expected non-negative token positions, got {start!r}")
        self.question_start = start_t

    # -- bookkeeping -------------------------------------------------------------------------

    def _begin_forward(self, layer: int, q_len: int, n_keys: int) -> None:
        if layer != self._first_layer:
            return
        self.forward_state = {}
        if n_keys == q_len and self.step >= 0:  # no past keys after earlier work: a new request
            self.request += 1
            self.step = -1
            self.layer_state.clear()
        self.step += 1

    def _sparse_rows(self, batch: int, q_len: int, n_keys: int, device: torch.device) -> torch.Tensor:
        """``[B, Q]`` bool: which query rows of this chunk use the method."""
        positions = torch.arange(n_keys - q_len, n_keys, device=device)
        if self.phase == "prefill":
            return torch.zeros(batch, q_len, dtype=torch.bool, device=device)
        if self.phase in ("decode", "all"):
            # Generated tokens: single-token forwards that follow a prefill.
            sparse = q_len == 1 and n_keys > 1
            return torch.full((batch, q_len), sparse, dtype=torch.bool, device=device)
        if self.question_start is None:
            raise ValueError(
                "phase='question' needs the question's start: call session.mark_question(start) "
                "before running the model"
            )
        start = self.question_start.to(device)
        if start.numel() not in (1, batch):
            raise ValueError(f"mark_question: {start.numel()} starts given for a batch of {batch}")
        return positions[None, :] >= start.reshape(-1, 1).expand(batch, 1)

    def _record(self, layer: int, row_pos: int, q_len: int, stats, rel_error: float | None) -> None:
        rec = {"request": self.request, "layer": layer, "step": self.step, "position": row_pos,
               "q_len": q_len, **stats.as_dict()}
        if rel_error is not None:
            rec["rel_error"] = rel_error
        self.records.append(rec)

    # -- the attention call ------------------------------------------------------------------

    def attend(self, module, query, key, value, attention_mask, scaling, kwargs) -> torch.Tensor:
        """Output ``[B, Q, Hq, dv]`` (the layout transformers' attention functions return)."""
        layer = module.layer_idx
        batch, _, q_len, _ = query.shape
        n_keys = key.shape[2]
        self._begin_forward(layer, q_len, n_keys)
        if q_len > 1 and isinstance(self.method, PrefillMethod) and layer not in self.dense_layers:
            out = self._prefill(module, query, key, value, attention_mask, scaling, kwargs)
            if out is not None:
                return out
        sparse = self._sparse_rows(batch, q_len, n_keys, query.device)
        if layer in self.dense_layers or not bool(sparse.any()):
            return _sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0]
        for unsupported in ("softcap", "s_aux", "sinks"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"model: attention with {unsupported!r} is not supported by kvsieve methods")
        if bool(sparse.all()):
            out = query.new_empty(batch, q_len, query.shape[1], value.shape[-1])
        else:
            out = _sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0].clone()
        for row in range(q_len):
            rows = sparse[:, row]
            if not bool(rows.any()):
                continue
            lengths, key_mask = visible_keys(attention_mask, batch, q_len, n_keys, row, query.device)
            q_row, k_rows, v_rows = query[:, :, row, :], key, value
            if not bool(rows.all()):
                idx = rows.nonzero().squeeze(1)
                q_row, k_rows, v_rows = q_row[idx], key[idx], value[idx]
                lengths = lengths[idx] if lengths is not None else None
                key_mask = key_mask[idx] if key_mask is not None else None
            seed = derive_seed(self.seed, self.request, layer, self.step, row)
            state = self.layer_state[layer]
            if isinstance(self.method, PrefillMethod):
                state[FORWARD_STATE] = self.forward_state
            est, stats = self.method.decode(
                q_row, k_rows, v_rows, lengths=lengths, key_mask=key_mask, seed=seed,
                scale=scaling, state=state, check_finite=False,
            )
            rel_error = None
            if self.track_error and self.step % self.track_error == 0:
                rel_error = _relative_error(est, q_row, k_rows, v_rows, lengths, key_mask, scaling)
            out[rows, row] = est.to(out.dtype)
            self._record(layer, n_keys - q_len + row, q_len, stats, rel_error)
        return out

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
        rel_error = None
        if self.track_error:
            exact = _sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0].to(torch.float64)
            rel_error = float((out.to(torch.float64) - exact).norm() / exact.norm().clamp_min(1e-30))
        self._record(layer, q_len - 1, q_len, stats, rel_error)
        return out

    # -- results -----------------------------------------------------------------------------

    def layer_summary(self) -> dict[int, dict[str, float]]:
        """Per layer: mean density, kv_density, V rows read, calls, and rel_error where tracked."""
        by_layer: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for rec in self.records:
            by_layer[rec["layer"]].append(rec)
        summary = {}
        for layer in sorted(by_layer):
            recs = by_layer[layer]
            row = {"calls": len(recs)}
            for key in ("density", "kv_density", "v_rows_read", "n_keys"):
                row[key] = sum(r[key] for r in recs) / len(recs)
            errors = [r["rel_error"] for r in recs if "rel_error" in r]
            if errors:
                row["rel_error"] = sum(errors) / len(errors)
            summary[layer] = row
        return summary

    def mean(self, key: str) -> float:
        """Mean of one record field over every sparse call (NaN when none ran)."""
        values = [r[key] for r in self.records if key in r]
        return sum(values) / len(values) if values else math.nan

    @property
    def backends(self) -> set[str]:
        return {r["backend"] for r in self.records}

    @property
    def _first_layer(self) -> int:
        return self.__dict__.setdefault("_first", min(m.layer_idx for m in attention_modules(self.model)))


def _relative_error(est, q, k, v, lengths, key_mask, scale) -> float:
    exact, _ = build_method("dense").decode(q, k, v, lengths=lengths, key_mask=key_mask, scale=scale,
                                            check_finite=False)
    e = exact.to(torch.float64)
    return float((est.to(torch.float64) - e).norm() / e.norm().clamp_min(1e-30))


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
):
    """Run ``method`` in ``model``'s attention inside a ``with`` block; yields a :class:`SparseSession`.

    - ``phase="decode"``: the prompt is prefilled exactly; generated tokens use the method.
    - ``phase="question"`` (setup B): the context is prefilled exactly; the question's tokens (from
      ``question_start`` or ``session.mark_question(...)``) and generated tokens use the method.
    - ``phase="prefill"`` / ``"all"``: methods with a sparse prefill (``sketchwalk``) run it on the
      prompt; generated tokens stay exact (``"prefill"``) or use the method too (``"all"``).
    - ``dense_layers``: layer indices that always stay exact.
    - ``seed``: every (request, layer, step, query row) draws its own stream derived from it.
    - ``track_error=k``: on every k-th step also compute exact attention and record ``rel_error``.

    On exit the model's attention implementation is restored; nothing else on it is changed.
    """
    if phase not in PHASES:
        raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
    if isinstance(track_error, bool) or not isinstance(track_error, int) or track_error < 0:
        raise ValueError(f"track_error: expected an integer >= 0, got {track_error!r}")
    m = build_method(method)
    modules = attention_modules(model)
    n_layers = len(modules)
    dense = frozenset(int(i) for i in dense_layers)
    if isinstance(m, PrefillMethod):
        if phase not in ("decode", "prefill", "all"):
            raise ValueError(f"phase: {m.name} supports phases decode, prefill and all, got {phase!r}")
        max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        dense = dense | m.check_model(n_layers, max_positions)
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
                            track_error=track_error)
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
