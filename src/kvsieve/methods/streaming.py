"""``streaming``: StreamingLLM (Xiao et al., ICLR 2024) — attention sinks + a local window only.

``backend``: "auto" (default) runs the Triton sparse kernel on CUDA tensors it can serve, reading
sink and window as two key ranges with no index list and no selection pass
(:func:`kvsieve.kernels.shared.weighted_triton.sparse_decode_triton`), and the torch reference
otherwise; "reference" and "triton" force a path. ``stats.backend`` names the path that ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.config import param, require_choice
from ..core.registry import register_method
from .shared.backend import BACKENDS, kernel_operands
from .shared.base import Selected, SelectionMethod, SinkWindowConfig, fixed_part
from .shared.sparse_path import choose_sparse_backend, dense_part_mark, sparse_stats


@dataclass(frozen=True)
class StreamingConfig(SinkWindowConfig):
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the Triton sparse kernel on CUDA, else the torch reference; reference; triton (error if it "
                "cannot)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("backend", self.backend, BACKENDS)


@register_method
class Streaming(SelectionMethod):
    name = "streaming"
    config_class = StreamingConfig
    summary = "StreamingLLM: attention sinks + local window only"
    small_config = {"sink": 4, "window": 16}
    exact_config = {"sink": lambda n: n}
    multi_row = True
    graph_capturable = True  # its CUDA path (Triton selection + sparse kernel) reads nothing on the host

    def select(self, inputs, gen, state):
        fixed, _ = fixed_part(self, inputs)
        return Selected(fixed)

    def _decode(self, inputs, seed, state):
        cfg = self.config
        path, reason = choose_sparse_backend(cfg.backend, inputs)
        if path == "reference":
            out, stats = super()._decode(inputs, seed, state)
            if reason is not None:
                stats.extra["backend_reason"] = reason
            return out, stats
        if cfg.sink + cfg.window == 0:
            raise ValueError(f"{self.name}: the configuration selected no key for some head; "
                             "give sink, window or a budget > 0")
        from ..kernels.shared.weighted_triton import sparse_decode_triton

        q, k, v, lens = kernel_operands(inputs)
        out, _ = sparse_decode_triton(q, k, v, lengths=lens, sink=cfg.sink, window=cfg.window, scale=inputs.scale)
        def mark():
            return dense_part_mark(inputs, cfg.sink, cfg.window)[:, None, :].expand(inputs.batch, inputs.kv_heads, -1)

        return out, sparse_stats(inputs, mark, extra={})
