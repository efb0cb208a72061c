"""``streaming``: StreamingLLM (Xiao et al., ICLR 2024) — attention sinks + a local window only."""

from __future__ import annotations

from ..core.registry import register_method
from .shared.base import Selected, SelectionMethod, SinkWindowConfig, fixed_part


@register_method
class Streaming(SelectionMethod):
    name = "streaming"
    config_class = SinkWindowConfig
    summary = "StreamingLLM: attention sinks + local window only"

    def select(self, inputs, gen, state):
        fixed, _ = fixed_part(self, inputs)
        return Selected(fixed)
