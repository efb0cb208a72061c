"""Systematic sampling in count form, the primitive of every S²ANTA sampler.

Given non-negative weights ``x`` that sum to a budget ``S`` along the last axis and one offset
``a ~ U[0, 1)``, the number of samples that land on item j is
``c_j = floor(a + X_j) - floor(a + X_{j-1})`` with ``X`` the running sum of ``x``. Then
``Σ_j c_j = S``, ``c_j ∈ {floor x_j, ceil x_j}`` and ``E[c_j] = x_j``.
"""

from __future__ import annotations

import torch


def systematic_counts(x: torch.Tensor, budget: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Counts ``c [..., n]`` (int64) of systematic sampling of ``budget [...]`` draws with weights ``x``.

    ``x`` need not sum to ``budget`` exactly: its running sum is rescaled so that the last entry
    equals ``budget`` exactly, which makes ``Σ c = budget`` hold despite rounding. Rows with
    ``budget = 0`` or zero total weight get no samples. ``offset [...]`` holds one uniform in [0, 1)
    per row.
    """
    x = x.to(torch.float64)
    budget = budget.to(torch.float64)
    cum = torch.cumsum(x, dim=-1)
    total = cum[..., -1:]
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    cum = torch.where(total > 0, cum * (budget[..., None] / safe_total), torch.zeros_like(cum))
    # The last entry must be the budget to the bit, whatever the rescaling rounded to.
    cum[..., -1] = torch.where(total[..., 0] > 0, budget, torch.zeros_like(budget))
    prev = torch.nn.functional.pad(cum[..., :-1], (1, 0))
    a = offset.to(torch.float64)[..., None]
    return (torch.floor(a + cum) - torch.floor(a + prev)).to(torch.int64)


def largest_remainder(weights: torch.Tensor, budget: int) -> torch.Tensor:
    """Integer budgets ``[..., T]`` proportional to ``weights`` that sum to ``budget`` (Alg. 4).

    Each entry is ``floor(q_t)`` or ``ceil(q_t)`` for ``q_t = budget · w_t / Σ w``; the
    ``budget − Σ floor(q)`` entries with the largest fractional parts get the +1 (ties: lower index).
    Deterministic, hence slightly biased as a sampling design (see docs/methods/santa.md).
    """
    w = weights.to(torch.float64)
    z = w.sum(-1, keepdim=True)
    share = budget * w / torch.where(z > 0, z, torch.ones_like(z))
    base = torch.floor(share)
    frac = share - base
    rem = (budget - base.sum(-1, keepdim=True)).clamp(min=0)
    # rank_t = number of entries ahead of t: larger fraction, or equal fraction and lower index.
    order = torch.argsort(-frac, dim=-1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(w.shape[-1], device=w.device).expand_as(order))
    bonus = (rank < rem).to(torch.float64)
    out = (base + bonus).to(torch.int64)
    return torch.where(z > 0, out, torch.zeros_like(out))


def systematic_rounding(weights: torch.Tensor, budget: int, offset: torch.Tensor) -> torch.Tensor:
    """Unbiased integer budgets: systematic sampling of ``budget`` draws over the entries.

    ``E[S_t] = budget · w_t / Σ w`` and ``S_t ∈ {floor, ceil}`` of it; sums to ``budget``.
    """
    b = torch.full(weights.shape[:-1], float(budget), dtype=torch.float64, device=weights.device)
    return systematic_counts(weights, b, offset)


def inverse_cdf(probs: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """``F^{-1}(t)``: for each threshold t in [0, 1), the key j with ``F(j−1) ≤ t < F(j)``.

    ``probs [..., n]`` (float64 recommended) need not be normalised exactly: the CDF is divided by
    its last entry so that it ends at 1 to the bit and every index lands on a key of non-zero mass.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    cdf = cdf / cdf[..., -1:]
    # A threshold that rounded up to 1.0 would fall past the last key of non-zero mass.
    t = thresholds.to(torch.float64).clamp(0.0, 1.0 - 2.0**-53).contiguous()
    idx = torch.searchsorted(cdf, t, right=True)
    return idx.clamp_(max=probs.shape[-1] - 1)
