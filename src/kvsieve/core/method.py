"""The method interface: one decode step of one layer, returning an estimate and its stats."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .config import MethodConfig
from .inputs import DecodeInputs, check_decode_inputs
from .stats import StepStats, merge_row_stats


class Method:
    """Base class of every attention method.

    Subclasses set ``name``, ``config_class`` and ``summary``, and implement ``_decode``. A method
    sees one layer's q/K/V and, through ``state``, whatever it keeps across steps for one request
    and layer (page summaries, sketches, ...); it never keeps request state on itself.
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
        seed: int | torch.Generator | None | list[int] | torch.Tensor = None,
        scale: float | None = None,
        state: dict[str, Any] | None = None,
        check_finite: bool = True,
    ) -> tuple[torch.Tensor, StepStats]:
        """One decode step.

        q ``[B, Hq, d]``; k, v ``[B, Hkv, N, d]`` (the transformers cache layout). ``lengths [B]``
        marks rows whose valid keys are the prefix ``[0, length)``; ``key_mask [B, N]`` marks any
        other pattern (e.g. left padding). ``scale`` defaults to ``1/sqrt(d)``. Returns the output
        ``[B, Hq, dv]`` in q's dtype and the step's stats.

        ``seed``: an int or a ``torch.Generator`` drives one random stream for the whole batch, so a
        row's draws depend on the other rows; a sequence (or 1-D integer tensor) of B ints gives every
        row its own stream: row b then gets exactly what it gets alone with ``seed=seeds[b]`` (rows
        run one at a time, each with its own part of ``state``).
        """
        inputs = check_decode_inputs(
            q, k, v, lengths=lengths, key_mask=key_mask, scale=scale, check_finite=check_finite
        )
        state = state if state is not None else {}
        row_seeds = _row_seeds(seed, inputs.batch)
        if row_seeds is None:
            out, stats = self._decode(inputs, seed, state)
        elif inputs.batch == 1 or not self.stochastic:
            out, stats = self._decode(inputs, row_seeds[0], state)
        else:
            rows = [self._decode(_row(inputs, b), row_seeds[b], state.setdefault(("row", b), {}))
                    for b in range(inputs.batch)]
            out = torch.cat([o for o, _ in rows], dim=0)
            stats = merge_row_stats([s for _, s in rows])
        return out.to(q.dtype), stats

    def _decode(
        self, inputs: DecodeInputs, seed: int | torch.Generator | None, state: dict[str, Any]
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


def _row(inputs: DecodeInputs, b: int) -> DecodeInputs:
    """Batch row ``b`` alone, checked as if it had been passed alone (lengths set for a prefix mask)."""
    sl = slice(b, b + 1)
    return check_decode_inputs(inputs.q[sl], inputs.k[sl], inputs.v[sl], key_mask=inputs.key_mask[sl],
                               scale=inputs.scale, check_finite=False)


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
    """
    b, hq, n = v_read.shape
    n_valid = inputs.n_valid.to(torch.float64)
    v_per_head = v_read.sum(-1).to(torch.float64)  # [B, Hq]
    v_per_kv = v_read.view(b, inputs.kv_heads, inputs.group, n).any(2).sum(-1).to(torch.float64)
    if k_scored is None:
        k_scored = inputs.n_valid[:, None].expand(b, inputs.kv_heads)
    k_scored = k_scored.to(torch.float64)
    k_bytes = inputs.k.element_size() * inputs.k.shape[-1]
    v_bytes = inputs.v.element_size() * inputs.v.shape[-1]
    return StepStats(
        n_keys=float(n_valid.mean()),
        k_rows_scored=float(k_scored.mean()),
        v_rows_read=float(v_per_head.mean()),
        kv_rows_read=float(v_per_kv.mean()),
        density=float((v_per_head / n_valid[:, None]).mean()),
        kv_density=float((v_per_kv / n_valid[:, None]).mean()),
        bytes_read=int(k_scored.sum() * k_bytes + v_per_kv.sum() * v_bytes),
        backend=backend,
        exact_rows=exact_rows,
        extra=extra or {},
    )
