"""The method interface: one decode step of one layer, returning an estimate and its stats."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .config import MethodConfig
from .inputs import DecodeInputs, check_decode_inputs
from .stats import StepStats


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
        seed: int | torch.Generator | None = None,
        scale: float | None = None,
        state: dict[str, Any] | None = None,
        check_finite: bool = True,
    ) -> tuple[torch.Tensor, StepStats]:
        """One decode step.

        q ``[B, Hq, d]``; k, v ``[B, Hkv, N, d]`` (the transformers cache layout). ``lengths [B]``
        marks rows whose valid keys are the prefix ``[0, length)``; ``key_mask [B, N]`` marks any
        other pattern (e.g. left padding). ``scale`` defaults to ``1/sqrt(d)``. Returns the output
        ``[B, Hq, dv]`` in q's dtype and the step's stats.
        """
        inputs = check_decode_inputs(
            q, k, v, lengths=lengths, key_mask=key_mask, scale=scale, check_finite=check_finite
        )
        out, stats = self._decode(inputs, seed, state if state is not None else {})
        return out.to(q.dtype), stats

    def _decode(
        self, inputs: DecodeInputs, seed: int | torch.Generator | None, state: dict[str, Any]
    ) -> tuple[torch.Tensor, StepStats]:
        raise NotImplementedError


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
