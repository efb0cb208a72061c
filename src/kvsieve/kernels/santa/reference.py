"""Torch references of the two S²ANTA kernels (the paper's Appendix O and P).

Both split the keys into tiles of ``tile`` keys, compute per (query head, tile) the score max
``m_t``, the stash ``u = exp(s − m_t)`` and its sum ``l_t``, and sample V rows by systematic
sampling inside each tile:

- *prop*: the budget S is shared out over tiles in proportion to their mass ``W_t = e^{m_t} l_t``
  (largest remainder, or unbiased systematic rounding), and the output is ``Σ c_n V_n / S``.
- *flash*: every tile that holds a valid key draws the same ``S_tile = max(1, S // T)`` samples,
  and tile estimates are merged with weights ``W_t / Z`` (deferred normalisation).

These are the semantics the Triton kernels must reproduce; given the same uniforms they produce the
same counts. Arithmetic is float64 so that the references are exact up to sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .systematic import largest_remainder, systematic_counts, systematic_rounding


@dataclass
class TiledSample:
    out: torch.Tensor  # [B, Hq, dv] float64
    counts: torch.Tensor  # [B, Hq, N] int64, samples landing on each key
    tile_budgets: torch.Tensor  # [B, Hq, T] int64
    samples: torch.Tensor  # [B, Hq] int64, samples drawn in total


def auto_tile_size(n_keys: int) -> int:
    """The public kernels' rule: 32 keys up to 1536, 64 up to 3072, else 256."""
    if n_keys <= 1536:
        return 32
    if n_keys <= 3072:
        return 64
    return 256


def n_tiles(n_keys: int, tile: int) -> int:
    return -(-n_keys // tile)


def tile_statistics(scores: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tile max ``m [B, Hq, T]``, stash ``u [B, Hq, T, tile]`` and sum ``l [B, Hq, T]``.

    ``scores [B, Hq, N]`` carry -inf on invalid keys; a tile with no valid key has ``l = 0``.
    """
    b, h, n = scores.shape
    t = n_tiles(n, tile)
    s = F.pad(scores, (0, t * tile - n), value=float("-inf")).view(b, h, t, tile)
    m = s.amax(-1)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    u = torch.exp(s - m_safe[..., None])  # exp(-inf) = 0 on invalid keys
    return m, u, u.sum(-1)


def tile_masses(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """``W_t = exp(m_t − max m) · l_t`` (zero for empty tiles)."""
    m_star = m.amax(-1, keepdim=True)
    w = torch.exp(m - m_star) * l
    return torch.where(l > 0, w, torch.zeros_like(w))


def grouped_weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``Σ_n weights[b, h, n] v[b, h // G, n]`` ``[B, Hq, dv]``; ``weights [B, Hq, ≥N]``, ``v [B, Hkv, N, dv]``."""
    b, hq = weights.shape[:2]
    hkv, n = v.shape[1], v.shape[2]
    w = weights[..., :n].reshape(b, hkv, hq // hkv, n)
    return torch.matmul(w, v.to(weights.dtype)).view(b, hq, -1)


def santa_prop_reference(
    scores: torch.Tensor,
    v: torch.Tensor,
    budget: int,
    tile: int,
    *,
    rounding: str,
    budget_offset: torch.Tensor,
    tile_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float64,
) -> TiledSample:
    """S²ANTA-prop. ``rounding`` is ``"largest-remainder"`` (the paper) or ``"systematic"`` (unbiased).

    ``scores [B, Hq, N]`` are the scaled float64 logits with -inf on invalid keys; ``v [B, Hkv, N, dv]``.
    ``budget_offset [B, Hq]`` (used by systematic rounding) and ``tile_offsets [B, Hq, T]`` are
    uniforms in [0, 1). ``out_dtype``: the dtype of the final ``Σ c_n V_n / S`` product (float32 for
    float32 inputs saves converting V; the sampling itself stays float64).
    """
    n_keys = scores.shape[-1]
    m, u, l = tile_statistics(scores, tile)
    w = tile_masses(m, l)
    if rounding == "largest-remainder":
        budgets = largest_remainder(w, budget)
    elif rounding == "systematic":
        budgets = systematic_rounding(w, budget, budget_offset)
    else:
        raise ValueError(f"rounding: expected 'largest-remainder' or 'systematic', got {rounding!r}")
    counts = systematic_counts(u, budgets, tile_offsets)  # [B, Hq, T, tile]
    b, h, t, tl = counts.shape
    flat = counts.view(b, h, t * tl)
    out = grouped_weighted_values(flat.to(out_dtype) / budget, v)
    return TiledSample(out=out, counts=flat[..., :n_keys], tile_budgets=budgets,
                       samples=budgets.sum(-1))


def flash_tile_budget(budget: int, valid_tiles: torch.Tensor) -> torch.Tensor:
    """``S_tile = max(1, S // T)`` with T the tiles holding a valid key (the public kernel's rule)."""
    return torch.clamp(budget // valid_tiles.clamp(min=1), min=1)


def santa_flash_reference(
    scores: torch.Tensor, v: torch.Tensor, budget: int, tile: int, *, tile_offsets: torch.Tensor,
    out_dtype: torch.dtype = torch.float64,
) -> TiledSample:
    """S²ANTA-flash: uniform per-tile budgets, tile estimates merged with weights ``W_t / Z``.

    ``scores`` and ``v`` as in :func:`santa_prop_reference`.
    """
    n_keys = scores.shape[-1]
    m, u, l = tile_statistics(scores, tile)
    w = tile_masses(m, l)
    valid_tile = l > 0
    s_tile = flash_tile_budget(budget, valid_tile.sum(-1))  # [B, Hq]
    budgets = torch.where(valid_tile, s_tile[..., None], torch.zeros_like(s_tile[..., None]))
    counts = systematic_counts(u, budgets, tile_offsets)  # [B, Hq, T, tile]
    z = w.sum(-1, keepdim=True)
    # Sample n of tile t stands for W_t / (Z · S_tile) of the output.
    per_sample = (w / (z * s_tile[..., None].to(torch.float64)))[..., None]
    b, h, t, tl = counts.shape
    weights = (counts.to(torch.float64) * per_sample).view(b, h, t * tl)
    out = grouped_weighted_values(weights.to(out_dtype), v)
    flat = counts.view(b, h, t * tl)
    return TiledSample(out=out, counts=flat[..., :n_keys], tile_budgets=budgets,
                       samples=budgets.sum(-1))
