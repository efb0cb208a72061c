"""``dense``: exact attention, the baseline every method is judged against."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import MethodConfig
from ..core.method import Method, read_stats
from ..core.registry import register_method
from .common import exact_attention


@dataclass(frozen=True)
class DenseConfig(MethodConfig):
    pass


@register_method
class Dense(Method):
    name = "dense"
    config_class = DenseConfig
    summary = "exact attention over every valid key (the baseline)"

    def _decode(self, inputs, seed, state):
        out = exact_attention(inputs)
        v_read = inputs.key_mask[:, None, :].expand(inputs.batch, inputs.heads, inputs.n_keys)
        return out, read_stats(inputs, v_read)
