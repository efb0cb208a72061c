"""``oracle-topk``: sink + window + the exact top-k keys by q·k (an oracle: it scores every key).

``backend``: "auto" (default) runs the device path on CUDA tensors it can serve, no host sync: every
score in one Triton pass over K (:func:`kvsieve.kernels.shared.scores.scores_triton`, also writing the
maxima of every 8 scores, or with ``share_kv_group`` each block's softmax partials and then one
parallel group-sum launch), one select launch
(:func:`kvsieve.kernels.shared.select_triton.topk_rows_triton`: a prefilter from those maxima, then the
exact top keys by a radix select) and the Triton sparse kernel (2 launches) on the chosen tokens with
sink and window as ranges — 4 launches per call, 5 with ``share_kv_group``. Per-query-head rows of
more than ``RADIX_SELECT_ABOVE`` keys take the radix select spread over many programs per row in place of
the select launch (see :func:`kvsieve.kernels.oracle_topk.topk.select_path`). Elsewhere the torch
reference. "reference" and "triton" force a path; ``stats.backend`` names the path that ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.config import param, require_choice
from ..core.registry import register_method
from ..kernels.oracle_topk.topk import select_path
from .shared.backend import BACKENDS, kernel_operands
from .shared.base import Selected, SelectionMethod, SinkWindowConfig, fixed_part, ranking_scores
from .shared.selection import require_size, resolve_size, size_bound, top_k, union
from .shared.sparse_path import choose_sparse_backend, page_list_mark, sparse_stats


@dataclass(frozen=True)
class OracleTopKConfig(SinkWindowConfig):
    top_k: int | float = param(0.05, "heavy hitters beyond sink+window: a count, or a fraction of the context")
    share_kv_group: bool = param(False, "one selection per KV head shared by its query heads (by summed softmax mass)")
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the device path (Triton scores + top-k + sparse kernel) on CUDA, else the torch reference; "
                "reference; triton (error if it cannot)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("top_k", self.top_k)
        require_choice("backend", self.backend, BACKENDS)


@register_method
class OracleTopK(SelectionMethod):
    name = "oracle-topk"
    config_class = OracleTopKConfig
    summary = "sink + window + exact top-k of q·k over the rest (deterministic, renormalised)"
    small_config = {"sink": 4, "window": 8, "top_k": 16}
    exact_config = {"top_k": 1.0}
    multi_row = True
    graph_capturable = True  # its CUDA path (Triton selection + sparse kernel) reads nothing on the host

    def select(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        heads = fixed.heads
        k = resolve_size(self.config.top_k, inputs.n_valid)
        bound = size_bound(self.config.top_k, inputs.n_keys)
        chosen = union(fixed, top_k(ranking_scores(inputs, heads), available, k, bound))
        return Selected(chosen, scored=None)

    def _decode(self, inputs, seed, state):
        cfg = self.config
        path, reason = choose_sparse_backend(cfg.backend, inputs)
        if path == "reference":
            out, stats = super()._decode(inputs, seed, state)
            if reason is not None:
                stats.extra["backend_reason"] = reason
            return out, stats
        from ..kernels.oracle_topk.topk import topk_select
        from ..kernels.shared.weighted_triton import sparse_decode_triton

        n = inputs.n_keys
        top = cfg.top_k if isinstance(cfg.top_k, int) else max(1, int(n * cfg.top_k))  # static bound
        if top == 0 and cfg.sink + cfg.window == 0:
            raise ValueError(f"{self.name}: the configuration selected no key for some head; "
                             "give sink, window or a budget > 0")
        q, k, v, lens = kernel_operands(inputs)
        idx = counts = None
        if top > 0:
            idx, counts = topk_select(q, k, lens, sink=cfg.sink, window=cfg.window,
                                      size=cfg.top_k, max_k=top,
                                      share_kv_group=cfg.share_kv_group, scale=inputs.scale,
                                      select=select_path(cfg.share_kv_group, n))
        out, _ = sparse_decode_triton(q, k, v, idx, counts, lengths=lens, sink=cfg.sink, window=cfg.window,
                                      scale=inputs.scale)
        if idx is None:
            idx = lens.new_zeros(inputs.batch, inputs.kv_heads, 1)
            counts = lens.new_zeros(inputs.batch, inputs.kv_heads)
        return out, sparse_stats(inputs, lambda: page_list_mark(inputs, idx, counts, 1, cfg.sink, cfg.window),
                                 extra={"select": select_path(cfg.share_kv_group, n)}, scored_all=True)
