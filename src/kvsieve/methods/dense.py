"""``dense``: exact attention, the baseline every method is judged against.

``backend``: "reference" (default: torch, float32 accumulation — the ground truth other methods are
compared with), "triton" (the split-KV kernel of ``kernels/shared/dense.py``; a ValueError says why
when it cannot serve a call) or "auto" (the kernel on CUDA tensors it can serve, else the reference).
``stats.backend`` names the path that ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.config import MethodConfig, param, require_choice
from ..core.method import Method, read_stats
from ..core.registry import register_method
from ..core.stats import StepStats
from .shared.backend import BACKENDS, choose_backend, kernel_operands
from .shared.exact import exact_attention


@dataclass(frozen=True)
class DenseConfig(MethodConfig):
    backend: Literal["auto", "reference", "triton"] = param(
        "reference", "reference (torch); triton (split-KV kernel, error if it cannot); auto (kernel on CUDA tensors)"
    )

    def __post_init__(self) -> None:
        require_choice("backend", self.backend, BACKENDS)


@register_method
class Dense(Method):
    name = "dense"
    config_class = DenseConfig
    summary = "exact attention over every valid key (the baseline)"
    exact_config = {}  # exact as it is
    multi_row = True
    graph_capturable = True

    def _decode(self, inputs, seed, state):
        path, reason = choose_backend(self.config.backend, inputs)
        extra = {}
        if path == "triton":
            from ..kernels.shared.dense import dense_decode_triton

            q, k, v, lens = kernel_operands(inputs)
            out = dense_decode_triton(q, k, v, lens, inputs.scale)  # in q's dtype: decode returns that
            return out, StepStats.deferred(lambda: self._stats(inputs, path, extra), path, extra)
        out = exact_attention(inputs)
        if reason is not None and self.config.backend != "reference":
            extra["backend_reason"] = reason
        return out, self._stats(inputs, path, extra)

    @staticmethod
    def _stats(inputs, path, extra):
        v_read = inputs.key_mask[:, None, :].expand(inputs.batch, inputs.heads, inputs.n_keys)
        return read_stats(inputs, v_read, backend=path, extra=extra)
