"""Next-token choice inside the captured decode step: greedy, or sampling from counter-based noise.

Sampling is Gumbel-max: ``argmax(logits / T + g)`` with ``g = -log(-log u)`` draws a token from
``softmax(logits / T)``. The uniforms ``u`` are a hash of (seed, step, batch row, token id), the
step read from device memory, so a replayed CUDA graph draws fresh numbers every step, a run is
reproducible from its seed, and no generator state lives on the host. ``top_k`` / ``top_p`` restrict
the candidates first (the same filters as transformers' logits warpers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_MIX1 = 0x7FEB352D  # lowbias32 (Chris Wellons' hash prospector); both factors < 2**32 so products fit int64
_MIX2 = 0x846CA68B


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The lowbias32 integer hash on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 16)


def counter_uniforms(seed: int, step: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) ``[B, V]`` for (seed, step [1], rows [B, 1], cols [1, V]): ``(k + 1/2) / 2**23``
    with a 23-bit ``k``, which float32 holds exactly.

    The words are chained through the hash, so (step, row, col) triples never collide by addition.
    """
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    x = mix32((step & _MASK32) ^ lo)
    x = mix32(x ^ hi ^ (rows & _MASK32))
    x = mix32(x ^ (cols & _MASK32))
    return ((x >> 9).to(torch.float32) + 0.5) * 2.0**-23


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"temperature: expected a number > 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed: expected an integer >= 0, got {self.seed!r}")


def choose_tokens(logits: torch.Tensor, step: torch.Tensor, config: SamplingConfig,
                  rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Next tokens ``[B]`` (int64) from ``logits [B, V]``; no host synchronisation."""
    if not config.do_sample:
        return logits.argmax(-1)
    scores = logits.float() / config.temperature
    if config.top_k and config.top_k < scores.shape[-1]:
        kth = scores.topk(config.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - config.top_p
        drop_sorted[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    u = counter_uniforms(config.seed, step, rows, cols)
    return (scores - torch.log(-torch.log(u))).argmax(-1)
