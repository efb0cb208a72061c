"""``quest``: query-aware page selection from per-page key min/max (Tang et al., ICML 2024).

Keys are cut into pages of ``page_size`` positions. Each page keeps the per-channel minimum and
maximum of its valid keys; a query bounds the page's best logit by
``Σ_j max(q_j · min_j, q_j · max_j)`` and attends to every key of the highest-bound pages (plus
sink and window). The page summaries (:mod:`kvsieve.methods.shared.pages`, also the top-k
predictor of ``vattention:predictor=quest``) live in the per-(request, layer) ``state`` and are
updated incrementally as the cache grows: only the last, partly filled page and the new pages are
recomputed.

``backend``: "auto" (default) runs the device path on CUDA tensors it can serve, five launches per call
(six for group-summed rows of over 4096 pages) and no host sync: page min/max kept in ``state`` by
:class:`kvsieve.kernels.quest.quest_pages.PageSummaries` (one launch refreshes the last pages of each
row), the bounds in one Triton launch (with ``share_kv_group`` it also writes each block's softmax
partials, so that no ``logsumexp`` runs), one select launch
(:func:`kvsieve.kernels.shared.select_triton.topk_rows_registers` for rows of up to 16384 pages per query
head, 4096 group-summed — the group sum in chunks over the GPU, then each row's last chunk program selects
with the row in registers; else :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton`, with a
group-sum launch of its own beyond 4096 pages, or for at most ``select_triton.SPLIT_ROWS_MAX`` rows — batch 1,
tensor parallel — :func:`~kvsieve.kernels.shared.select_split.topk_rows_split`: two launches spread over each
row, the same pages) and the Triton sparse kernel (2 launches) reading the
chosen pages as tiles with sink and window as ranges. Elsewhere it runs the torch reference; "reference" and "triton"
force a path; ``stats.backend`` names the path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.config import param, require_choice, require_int
from ..core.registry import register_method
from .shared.backend import BACKENDS, kernel_operands
from .shared.base import Selected, SelectionMethod, SinkWindowConfig, fixed_part
from .shared.pages import PageState, quest_top_tokens
from .shared.selection import require_size, resolve_size, union
from .shared.sparse_path import choose_sparse_backend, page_list_mark, sparse_stats


@dataclass(frozen=True)
class QuestConfig(SinkWindowConfig):
    top_k: int | float = param(
        0.05, "tokens in the selected pages (rounded up to whole pages): a count, or a fraction of the context")
    page_size: int = param(16, "keys per page (Quest: 16)")
    share_kv_group: bool = param(False, "one page selection per KV head (group-summed softmax over page bounds)")
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the device path (Triton page bounds + sparse kernel) on CUDA, else the torch reference; "
                "reference; triton (error if it cannot)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("top_k", self.top_k)
        require_int("page_size", self.page_size, minimum=1)
        require_choice("backend", self.backend, BACKENDS)


@register_method
class Quest(SelectionMethod):
    name = "quest"
    config_class = QuestConfig
    summary = "Quest: sink + window + the pages with the highest min/max logit bound"
    small_config = {"sink": 4, "window": 8, "top_k": 32, "page_size": 8}
    exact_config = {"top_k": 1.0}
    # Page summaries are state per request and layer: the rows of a chunk update them one by one.
    multi_row = False
    graph_capturable = True  # its CUDA path (Triton selection + sparse kernel) reads nothing on the host

    def new_state(self) -> PageState:
        return PageState()

    def select(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        tokens = resolve_size(self.config.top_k, inputs.n_valid)
        pages = quest_top_tokens(inputs, available, tokens, self.config.page_size, state)
        p_total = -(-inputs.n_keys // self.config.page_size)
        return Selected(union(fixed, pages), extra={"page_size": self.config.page_size, "pages_scored": p_total})

    def _decode(self, inputs, seed, state):
        cfg = self.config
        path, reason = choose_sparse_backend(cfg.backend, inputs, cfg.page_size)
        if path == "reference":
            out, stats = super()._decode(inputs, seed, state)
            if reason is not None:
                stats.extra["backend_reason"] = reason
            return out, stats
        from ..kernels.quest.quest_pages import PageSummaries, quest_select
        from ..kernels.shared.weighted_triton import sparse_decode_triton

        page, n = cfg.page_size, inputs.n_keys
        # the most tokens any row can ask for, from static sizes (rows have n_valid <= N)
        top = cfg.top_k if isinstance(cfg.top_k, int) else max(1, int(n * cfg.top_k))
        max_pages = min(-(-top // page), -(-n // page))
        if max_pages == 0 and cfg.sink + cfg.window == 0:
            raise ValueError(f"{self.name}: the configuration selected no key for some head; "
                             "give sink, window or a budget > 0")
        q, k, v, lens = kernel_operands(inputs)
        if state.device is None:
            state.device = PageSummaries(page)
        summaries = state.device
        kmin, kmax = summaries.update(k, lens)
        pages = counts = None
        if max_pages > 0:
            pages, counts = quest_select(q, kmin, kmax, lens, page_size=page, sink=cfg.sink, window=cfg.window,
                                         size=cfg.top_k, max_pages=max_pages,
                                         share_kv_group=cfg.share_kv_group, scale=inputs.scale)
        out, _ = sparse_decode_triton(q, k, v, pages, counts, page_size=page, lengths=lens, sink=cfg.sink,
                                      window=cfg.window, scale=inputs.scale)
        if pages is None:
            pages = lens.new_zeros(inputs.batch, inputs.kv_heads, 1)
            counts = lens.new_zeros(inputs.batch, inputs.kv_heads)
        return out, sparse_stats(inputs, lambda: page_list_mark(inputs, pages, counts, page, cfg.sink, cfg.window),
                                 extra={"page_size": page, "pages_scored": -(-n // page)})
