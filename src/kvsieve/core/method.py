"""The method interface: one decode step of one layer, returning an estimate and its stats."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .config import MethodConfig
from .context import NO_CONTEXT, CallContext, ForwardState, MethodState
from .inputs import DecodeInputs, check_decode_inputs
from .rng import RandomKey, as_key, per_row_key
from .stats import StepStats


class Method:
    """Base class of every attention method.

    Subclasses set ``name``, ``config_class`` and ``summary``, and implement ``_decode``. A method
    sees one layer's q/K/V, a :class:`~kvsieve.core.context.CallContext` (``inputs.context``) and its
    own typed state for one request and layer (``new_state()``: page summaries, sketches, an index);
    it never keeps request state on itself.

    What a model driver must do for the method is *declared* on the class (the class attributes
    below), never detected: ``kvsieve.driver.LayerDriver`` reads the declarations and calls the hooks.
    """

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    summary: ClassVar[str] = ""
    #: True when the estimate is random (driven by ``seed``).
    stochastic: ClassVar[bool] = False

    # -- What the method promises. ``tests/test_method_contract.py`` runs every registered method
    # -- against these declarations, so a new method is tested by registering it and filling them in.

    #: Config overrides (keyword arguments of ``config_class``) that make the method actually sparse
    #: on the contract test's small contexts (about 100-300 keys, head dim 16); the defaults are sized
    #: for real contexts (e.g. a sink and window of 128 keys each would cover the whole test context).
    small_config: ClassVar[dict[str, Any]] = {}
    #: Config overrides under which a decode over at most ``n`` valid keys is exact attention: a
    #: budget that covers the context. A value may be a callable of ``n`` (``{"budget": lambda n: n}``).
    #: ``None`` declares that no such setting exists; ``exact_note`` must then say why.
    exact_config: ClassVar[dict[str, Any | Callable[[int], Any]] | None] = None
    #: Why a covering budget is not exact (when ``exact_config`` is None), or how it is reached when
    #: that is not obvious from the parameter names.
    exact_note: ClassVar[str] = ""
    #: True when GQA (``Hq = G·Hkv``) gives the same output, for the same seed, as ``Hkv = Hq`` with
    #: every KV head repeated G times: selection and random draws are per query head under the
    #: default and ``small_config`` settings. False for methods that share one selection (or one
    #: draw) per KV head across its group; ``gqa_note`` must then say how the two differ.
    gqa_equivalent: ClassVar[bool] = True
    gqa_note: ClassVar[str] = ""
    #: Non-empty for a method that serves only prefix key masks (valid keys ``[0, length)``, no left
    #: padding), saying why; the contract test then checks that other masks are refused by name.
    prefix_only_note: ClassVar[str] = ""
    #: For a method that cannot be built without external artifacts (a per-model fit, such as
    #: SAAP's classifier): the test module that checks the contract's items against artifacts it
    #: writes itself, plus why the generic test cannot. The contract test then checks that the
    #: module exists instead of running its generic cases. Empty for every other method.
    contract_tested_in: ClassVar[str] = ""

    @classmethod
    def covering_config(cls, n_keys: int) -> dict[str, Any] | None:
        """``exact_config`` with callables evaluated at ``n_keys`` (None when no setting is exact)."""
        if cls.exact_config is None:
            return None
        return {key: value(n_keys) if callable(value) else value for key, value in cls.exact_config.items()}

    # -- What a model driver must do for the method (kvsieve.driver reads these; nothing else may ask
    # -- what class a method is).

    #: True when the method has a sparse prefill: :meth:`prefill` with ``sparse=True`` returns one
    #: layer's attention over the whole prompt (Sketch&Walk's block-sparse prefill).
    sparse_prefill: ClassVar[bool] = False
    #: True when the method's decode starts from what it records of the prompt's forward pass (its
    #: queries included, which no cache keeps): the driver calls :meth:`prefill` with ``sparse=False``
    #: on every prompt forward the method does not serve itself (Sketch&Walk's block sketches).
    observes_prefill: ClassVar[bool] = False
    #: True when the method's state crosses the layers of one forward pass: the driver gives every
    #: forward a fresh :meth:`new_forward_state` in ``context.forward`` (Sketch&Walk's walk).
    cross_layer: ClassVar[bool] = False
    #: True when the method cannot be built without artifacts fitted to one model (SAAP's
    #: classifiers); :meth:`check_model` then refuses any other model.
    needs_fit: ClassVar[bool] = False

    def new_state(self) -> MethodState | None:
        """A fresh per-(request, layer) state, or None for a method that keeps none."""
        return None

    def new_forward_state(self) -> ForwardState | None:
        """A fresh state shared by the layers of one forward pass (``cross_layer`` methods), or None."""
        return None

    def exact_layers(self, n_layers: int, max_positions: int | None) -> frozenset[int]:
        """Validate the config against a model of ``n_layers`` layers (and ``max_positions`` tokens of
        context, if known); return the layers the method keeps exact (its own ``dense_layers``)."""
        return frozenset()

    def check_model(self, model: Any) -> None:
        """Refuse a model the method's artifacts were not made for (``needs_fit`` methods)."""

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None,
                state: MethodState | None, context: CallContext = NO_CONTEXT,
                sparse: bool) -> tuple[torch.Tensor | None, StepStats | None]:
        """One layer's prompt: q ``[B, Hq, N, d]``, k/v ``[B, Hkv, N, d]`` (no past keys).

        With ``sparse`` (methods that declare ``sparse_prefill``) returns ``(out [B, Hq, N, dv], stats)``;
        with ``sparse=False`` (methods that declare ``observes_prefill``) it only records into ``state``
        what later decode steps need and returns ``(None, None)``.
        """
        raise ValueError(f"{self.name}: has no prefill hook (it declares neither sparse_prefill nor "
                         "observes_prefill)")

    def checked_state(self, state: Any) -> MethodState | None:
        """``state`` if it is this method's state, a fresh one for None; a ValueError otherwise."""
        fresh = self.new_state()
        if state is None:
            return fresh
        if fresh is None or type(state) is not type(fresh):
            want = "None (the method keeps no state)" if fresh is None else f"a {type(fresh).__name__} or None"
            raise ValueError(f"state: expected {want} (from {self.name}'s new_state()), got {type(state).__name__}")
        return state

    def __init__(self, config: MethodConfig | None = None) -> None:
        if config is None:
            config = self.config_class()
        if not isinstance(config, self.config_class):
            raise ValueError(
                f"{self.name}: expected a {self.config_class.__name__}, got {type(config).__name__}"
            )
        self.config = config

    @property
    def spec(self) -> str:
        """The spec string that rebuilds this method with ``kvsieve.method(spec)``."""
        extra = self.config.describe()
        return f"{self.name}:{extra}" if extra else self.name

    def __repr__(self) -> str:
        return f"kvsieve.method({self.spec!r})"

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        seed: int | RandomKey | torch.Generator | None | list[int] | torch.Tensor = None,
        scale: float | None = None,
        state: MethodState | None = None,
        context: CallContext = NO_CONTEXT,
        check_finite: bool = True,
    ) -> tuple[torch.Tensor, StepStats]:
        """One decode step of one layer, for one or many query rows per batch row.

        q ``[B, Hq, d]`` or ``[B, Hq, Q, d]`` (Q query rows: row j of batch row b sees the keys
        ``[0, len_b − Q + 1 + j)``); k, v ``[B, Hkv, N, d]`` (the transformers cache layout).
        ``lengths [B]`` marks rows whose valid keys (for the last query row) are the prefix
        ``[0, length)``; ``key_mask [B, N]`` or ``[B, Q, N]`` marks any other pattern (e.g. left
        padding). ``seed``: an int, a :class:`~kvsieve.core.rng.RandomKey` (seed + counters such as
        request, layer, step, possibly device tensors) or None (fresh entropy). ``scale`` defaults to
        ``1/sqrt(d)``. ``state``: the method's state for this request and layer (``new_state()``;
        None: a fresh one for this call alone). ``context``: what the caller knows of the call
        (:class:`~kvsieve.core.context.CallContext`; the model drivers set it). ``check_finite`` (default
        True) runs the value checks that read the data (a host synchronisation on CUDA); the decode
        path of a model turns them off. Returns the output
        ``[B, Hq, dv]`` (or ``[B, Hq, Q, dv]``) in q's dtype and the step's stats, whose values stay
        device tensors until read.
        """
        if not isinstance(context, CallContext):
            raise ValueError(f"context: expected a kvsieve CallContext, got {type(context).__name__}")
        inputs = check_decode_inputs(
            q, k, v, lengths=lengths, key_mask=key_mask, scale=scale, check_finite=check_finite
        )
        inputs.context = context
        state = self.checked_state(state)
        if isinstance(seed, bool) or not (seed is None or isinstance(seed, (int, RandomKey, torch.Generator, list,
                                                                              tuple, torch.Tensor))):
            raise ValueError(f"seed: expected an int, a torch.Generator or None (or B ints, or a kvsieve "
                             f"RandomKey), got {type(seed).__name__}")
        if isinstance(seed, (list, tuple)) or (isinstance(seed, torch.Tensor) and seed.dim() >= 1):
            # Per-row seeds: row b gets exactly what it gets alone with seed=seeds[b].
            if self.random_keys:
                seed = per_row_key(seed, inputs.cache_batch, inputs.q.device)
            elif self.stochastic:
                raise ValueError(f"seed: per-row seeds need a method with counter-based draws; {self.name} "
                                 "draws from one torch.Generator (give an int)")
            else:
                _row_seeds(seed, inputs.cache_batch)  # checked; a deterministic method draws nothing
                seed = None
        if inputs.q_len > 1 and not self.multi_row:
            out, stats = self._decode_rows_one_by_one(inputs, seed, state)
        else:
            out, stats = self._decode(inputs, self._seed_arg(seed), state)
        out = out.to(q.dtype)
        if q.dim() == 4:
            out = out.view(inputs.cache_batch, inputs.q_len, inputs.heads, -1).transpose(1, 2)
        return out, stats

    #: True when ``_decode`` serves calls with many query rows per batch row (``inputs.q_len > 1``)
    #: in one go; otherwise ``decode`` calls it once per query row (methods written before the
    #: multi-row contract keep working that way).
    multi_row: ClassVar[bool] = False
    #: True when ``_decode`` takes a :class:`RandomKey` (counter-based draws); otherwise it gets the
    #: seed as given (int, torch.Generator, None), a key with host counters as its derived int seed.
    random_keys: ClassVar[bool] = False
    #: True when a call can be captured in a CUDA graph and replayed with fresh draws: no host reads,
    #: draws from a key whose counters (or tensor seeds) live in device memory, shapes from the inputs'
    #: shapes only. The decode runtime captures only such methods.
    graph_capturable: ClassVar[bool] = False

    def exact_below(self) -> int:
        """Contexts of at most this many keys gain nothing from the method (it would read every key):
        a model integration runs exact attention there unless told otherwise."""
        return 0

    def _seed_arg(self, seed):
        if self.random_keys and not isinstance(seed, torch.Generator):
            return as_key(seed)
        if isinstance(seed, torch.Tensor):  # a device seed for a method that takes ints: read it (a sync)
            return int(seed.reshape(-1)[0])
        if isinstance(seed, RandomKey) and seed.host():
            return seed.host_seed()  # methods written for int seeds get one, derived from the whole key
        return seed

    def _decode_rows_one_by_one(self, inputs: DecodeInputs, seed, state) -> tuple[torch.Tensor, StepStats]:
        q_len, b = inputs.q_len, inputs.cache_batch
        outs, stats = [], []
        key = None if isinstance(seed, torch.Generator) else as_key(seed)
        for j in range(q_len):
            rows = torch.arange(b, device=inputs.q.device) * q_len + j
            row_inputs = select_rows(inputs, rows)
            row_seed = seed if key is None else (key if self.random_keys else key.child(j))
            out, st = self._decode(row_inputs, self._seed_arg(row_seed), state)
            outs.append(out)
            stats.append(st)
        out = torch.stack(outs, dim=1).reshape(b * q_len, inputs.heads, -1)
        return out, merge_stats(stats)

    def _decode(
        self, inputs: DecodeInputs, seed: int | RandomKey | torch.Generator | None, state: dict[str, Any]
    ) -> tuple[torch.Tensor, StepStats]:
        raise NotImplementedError


def _row_seeds(seed: Any, batch: int) -> list[int] | None:
    """The per-row seeds of a sequence or 1-D integer tensor; None for an int, a Generator or None."""
    if seed is None or isinstance(seed, (int, torch.Generator)):
        return None  # bool and other types are rejected by the method's generator
    if isinstance(seed, torch.Tensor):
        ok = seed.dim() == 1 and not seed.is_floating_point() and seed.dtype != torch.bool
        seeds = seed.tolist() if ok else None
    elif isinstance(seed, (list, tuple)) and all(isinstance(s, int) and not isinstance(s, bool) for s in seed):
        seeds = list(seed)
    else:
        seeds = None
    if seeds is None or len(seeds) != batch:
        raise ValueError(f"seed: expected an int, a torch.Generator or None, or {batch} ints (one per batch "
                         f"row), got {seed!r}")
    return seeds


def select_rows(inputs: DecodeInputs, rows: torch.Tensor) -> DecodeInputs:
    """The query rows ``rows`` (an index tensor, one per batch row) of a call, as a one-row-per-batch call."""
    pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
    out = DecodeInputs(q=pick(inputs.q), k=inputs.cache_k, v=inputs.cache_v, key_mask=pick(inputs.key_mask),
                       n_valid=pick(inputs.n_valid), lengths=pick(inputs.lengths), scale=inputs.scale,
                       q_len=1, cache_k=inputs.cache_k, cache_v=inputs.cache_v, checked=inputs.checked)
    out.context = inputs.context
    return out


def merge_stats(parts: list[StepStats]) -> StepStats:
    """Stats of one call served in parts of equal row counts: means of means, sums of totals."""
    if len(parts) == 1:
        return parts[0]
    if any(p._pending is not None for p in parts):
        # Deferred parts (a kernel path's) hold their extras only once built: merge them when read.
        def merged() -> StepStats:
            for p in parts:
                p._resolve()
            return merge_stats(parts)

        return StepStats.deferred(merged, "+".join(sorted({p.backend for p in parts})))
    n = len(parts)
    mean = lambda key: sum(p.raw(key) for p in parts) / n  # noqa: E731
    total = lambda key: sum(p.raw(key) for p in parts)  # noqa: E731
    extra = {}
    for key in parts[0].extra:
        values = [p.extra.get(key) for p in parts]
        if all(isinstance(x, (int, float, torch.Tensor)) and not isinstance(x, bool) for x in values) and all(
                not isinstance(x, torch.Tensor) or x.dim() == 0 for x in values):
            extra[key] = sum(values) / n
        elif all(isinstance(x, torch.Tensor) for x in values) and len({x.shape[1:] for x in values}) == 1:
            extra[key] = torch.cat(values)
        else:
            extra[key] = values[0]
    backends = sorted({p.backend for p in parts})
    return StepStats(n_keys=mean("n_keys"), k_rows_scored=mean("k_rows_scored"), v_rows_read=mean("v_rows_read"),
                     kv_rows_read=mean("kv_rows_read"), density=mean("density"), kv_density=mean("kv_density"),
                     bytes_read=total("bytes_read"), backend="+".join(backends), exact_rows=total("exact_rows"),
                     extra=extra)


def read_stats(
    inputs: DecodeInputs,
    v_read: torch.Tensor,
    *,
    k_scored: torch.Tensor | None = None,
    backend: str = "reference",
    exact_rows: int = 0,
    extra: dict[str, Any] | None = None,
) -> StepStats:
    """Stats from the V rows read per query head (``v_read [B, Hq, N]`` bool).

    ``k_scored [B, Hkv]`` is the number of K rows scored per KV head (default: every valid key).
    ``exact_rows`` may be an int or a device tensor. Nothing here reads device values on the host.
    """
    b, hq, n = v_read.shape
    n_valid = inputs.n_valid.to(torch.float64)
    v_per_head = v_read.sum(-1).to(torch.float64)  # [R, Hq]
    v_per_kv = v_read.view(b, inputs.kv_heads, inputs.group, n).any(2).sum(-1).to(torch.float64)
    if k_scored is None:
        k_scored = n_valid[:, None].expand(b, inputs.kv_heads)
    k_scored = k_scored.to(torch.float64)
    k_bytes = inputs.k.element_size() * inputs.k.shape[-1]
    v_bytes = inputs.v.element_size() * inputs.v.shape[-1]
    # Device tensors, read only when someone asks (StepStats turns them into numbers).
    return StepStats(
        n_keys=n_valid.mean(),
        k_rows_scored=k_scored.mean(),
        v_rows_read=v_per_head.mean(),
        kv_rows_read=v_per_kv.mean(),
        density=(v_per_head / n_valid[:, None]).mean(),
        kv_density=(v_per_kv / n_valid[:, None]).mean(),
        bytes_read=k_scored.sum() * k_bytes + v_per_kv.sum() * v_bytes,
        backend=backend,
        exact_rows=exact_rows,
        extra=extra or {},
    )
