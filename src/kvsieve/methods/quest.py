"""``quest``: query-aware page selection from per-page key min/max (Tang et al., ICML 2024).

Keys are cut into pages of ``page_size`` positions. Each page keeps the per-channel minimum and
maximum of its valid keys; a query bounds the page's best logit by
``Σ_j max(q_j · min_j, q_j · max_j)`` and attends to every key of the highest-bound pages (plus
sink and window). The page summaries (:mod:`kvsieve.methods.shared.pages`, also the top-k
predictor of ``vattention:predictor=quest``) live in the per-(request, layer) ``state`` and are
updated incrementally as the cache grows: only the last, partly filled page and the new pages are
recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import param, require_int
from ..core.registry import register_method
from .shared.base import Selected, SelectionMethod, SinkWindowConfig, fixed_part
from .shared.pages import quest_top_tokens
from .shared.selection import require_size, resolve_size, union


@dataclass(frozen=True)
class QuestConfig(SinkWindowConfig):
    top_k: int | float = param(
        0.05, "tokens in the selected pages (rounded up to whole pages): a count, or a fraction of the context")
    page_size: int = param(16, "keys per page (Quest: 16)")
    share_kv_group: bool = param(False, "one page selection per KV head (group-summed softmax over page bounds)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("top_k", self.top_k)
        require_int("page_size", self.page_size, minimum=1)


@register_method
class Quest(SelectionMethod):
    name = "quest"
    config_class = QuestConfig
    summary = "Quest: sink + window + the pages with the highest min/max logit bound"

    def select(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        tokens = resolve_size(self.config.top_k, inputs.n_valid)
        pages = quest_top_tokens(inputs, available, tokens, self.config.page_size, state)
        p_total = -(-inputs.n_keys // self.config.page_size)
        return Selected(union(fixed, pages), extra={"page_size": self.config.page_size, "pages_scored": p_total})
