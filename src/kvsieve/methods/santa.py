"""SANTA and S²ANTA: estimate ``softmax(qKᵀ)V`` from S value rows sampled from the softmax.

- ``santa``: S i.i.d. draws with replacement (Eq. 4 of the paper).
- ``santa-strat``: one uniform in each stratum ``[m/S, (m+1)/S)``.
- ``santa-sys``: one offset U shared by all strata, thresholds ``U + m/S``.

The estimate is ``(1/S) Σ_m V[F^{-1}(T_m)]``; all three are unbiased. Every key is scored (all of K
is read); only the sampled V rows are read. Sampling is per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.config import MethodConfig, param, require_int
from ..core.method import Method, read_stats
from ..core.registry import register_method
from ..core.rng import STREAM_SAMPLE
from ..kernels.santa.systematic import inverse_cdf
from .shared.exact import compute_dtype, covered_rows, merge_exact_rows, row_draws
from .shared.selection import Draws, uniforms


@dataclass(frozen=True)
class SantaConfig(MethodConfig):
    budget: int = param(64, "samples S per query head")
    exact_when_covered: bool = param(
        True, "rows with at most `budget` valid keys run exact attention (no more reads than S samples)"
    )

    def __post_init__(self) -> None:
        require_int("budget", self.budget, minimum=1)


class _SantaSampler(Method):
    config_class = SantaConfig
    stochastic = True
    small_config = {"budget": 16}
    exact_config = {"budget": lambda n: n}
    exact_note = ("rows whose valid keys fit in `budget` run exact attention (exact_when_covered=true, the "
                  "default): S ≥ N samples drawn from the softmax would still be an estimate")
    random_keys = True
    multi_row = True
    graph_capturable = True

    def exact_below(self) -> int:
        return self.config.budget if self.config.exact_when_covered else 0

    def thresholds(self, shape: tuple[int, int], budget: int, gen: Draws,
                   device: torch.device) -> torch.Tensor:
        """``[B, Hq, S]`` thresholds in [0, 1) whose inverse-CDF images are the samples."""
        raise NotImplementedError

    def _decode(self, inputs, seed, state):
        s = self.config.budget
        gen = row_draws(inputs, seed)
        # float64 CDF from a product in the compute dtype (no float64 copy of K for float32 inputs)
        probs = torch.softmax(inputs.scores(compute_dtype(inputs)).to(torch.float64), dim=-1)
        t = self.thresholds((inputs.batch, inputs.heads), s, gen, inputs.q.device)
        idx = inverse_cdf(probs, t)  # [B, Hq, S]
        out = inputs.gather_values(idx).to(compute_dtype(inputs)).mean(2)
        v_read = torch.zeros(inputs.batch, inputs.heads, inputs.n_keys, dtype=torch.bool, device=idx.device)
        v_read.scatter_(2, idx, True)
        exact_rows = 0
        if self.config.exact_when_covered:
            out, v_read, exact_rows = merge_exact_rows(inputs, out, v_read, covered_rows(inputs, s), s)
        return out, read_stats(inputs, v_read, exact_rows=exact_rows, extra={"samples": s})


def _uniform(shape: tuple[int, ...], gen: Draws, device: torch.device) -> torch.Tensor:
    return uniforms(gen, STREAM_SAMPLE, shape, device)


@register_method
class Santa(_SantaSampler):
    name = "santa"
    summary = "SANTA: S i.i.d. samples (with replacement) from the softmax"

    def thresholds(self, shape, budget, gen, device):
        return _uniform((*shape, budget), gen, device)


@register_method
class SantaStrat(_SantaSampler):
    name = "santa-strat"
    summary = "S²ANTA-strat: one independent uniform per stratum [m/S, (m+1)/S)"

    def thresholds(self, shape, budget, gen, device):
        m = torch.arange(budget, device=device, dtype=torch.float64)
        return (m + _uniform((*shape, budget), gen, device)) / budget


@register_method
class SantaSys(_SantaSampler):
    name = "santa-sys"
    summary = "S²ANTA-sys: systematic sampling, one offset U for all strata (U + m/S)"

    def thresholds(self, shape, budget, gen, device):
        m = torch.arange(budget, device=device, dtype=torch.float64)
        return (m + _uniform((*shape, 1), gen, device)) / budget
