"""Methods that also sparsify the prefill and carry state across the layers of one forward pass.

A :class:`PrefillMethod` is a :class:`~kvsieve.core.method.Method` (its ``decode`` serves generated
tokens) that also offers ``prefill``: one layer's whole prompt at once. The integration calls it for
every prompt forward, with ``sparse=False`` when the prefill phase stays exact, so that the method
can still record what its decode needs (Sketch&Walk's block sketches).

Cross-layer state (Sketch&Walk's walk) belongs to one request and one forward pass: the integration
keeps one dict per forward pass and hands it over as ``forward`` to ``prefill`` and, under the key
:data:`FORWARD_STATE` of the per-layer ``state``, to ``decode``. Nothing lives on the method or the
model's modules.
"""

from __future__ import annotations

from typing import Any

import torch

from .method import Method
from .stats import StepStats

#: Key of the per-layer ``state`` under which ``decode`` finds the forward pass's shared dict.
FORWARD_STATE = "forward"


class PrefillMethod(Method):
    """A method with a prefill path and (optionally) state shared by the layers of one forward."""

    def check_layers(self, n_layers: int, max_positions: int | None) -> frozenset[int]:
        """Validate the config against the model; return the layers the method keeps exact."""
        return frozenset()

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
        state: dict[str, Any],
        forward: dict[str, Any],
        sparse: bool,
    ) -> tuple[torch.Tensor | None, StepStats | None]:
        """One layer's prompt: q ``[B, Hq, N, d]``, k/v ``[B, Hkv, N, d]`` (no past keys).

        Returns ``(out [B, Hq, N, dv], stats)`` when ``sparse``; with ``sparse=False`` it only
        records what later decode steps need and returns ``(None, None)``.
        """
        raise NotImplementedError
