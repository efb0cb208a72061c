"""``oracle-topk``: sink + window + the exact top-k keys by q·k (an oracle: it scores every key)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import param
from ..core.registry import register_method
from .shared.base import Selected, SelectionMethod, SinkWindowConfig, fixed_part, ranking_scores
from .shared.selection import require_size, resolve_size, top_k, union


@dataclass(frozen=True)
class OracleTopKConfig(SinkWindowConfig):
    top_k: int | float = param(0.05, "heavy hitters beyond sink+window: a count, or a fraction of the context")
    share_kv_group: bool = param(False, "one selection per KV head shared by its query heads (by summed softmax mass)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("top_k", self.top_k)


@register_method
class OracleTopK(SelectionMethod):
    name = "oracle-topk"
    config_class = OracleTopKConfig
    summary = "sink + window + exact top-k of q·k over the rest (deterministic, renormalised)"

    def select(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        heads = fixed.heads
        k = resolve_size(self.config.top_k, inputs.n_valid)
        chosen = union(fixed, top_k(ranking_scores(inputs, heads), available, k))
        return Selected(chosen, scored=None)
