"""Weighted sparse decode: attention over a per-head list of key indices with per-index weights.

This is the execution contract that oracle top-k, Quest, streaming, random sampling, MagicPIG and
vAttention lower to (DESIGN.md, *weighted sparse decode*). A later GPU kernel implements exactly
this; the function here is its torch reference.

Contract
--------
Inputs, for one decode step of one layer:

- ``q [B, Hq, d]``; ``k [B, Hkv, N, d]``; ``v [B, Hkv, N, dv]`` (the transformers cache layout,
  ``Hq = G · Hkv``; query head ``h`` reads KV head ``h // G``).
- ``indices [B, Hs, M]`` int64, with ``Hs = Hkv`` (one index list per KV head, shared by the ``G``
  query heads of its group: the K/V rows are read once per group) or ``Hs = Hq`` (one list per
  query head). Entries are key positions in ``[0, N)``.
- ``counts [B, Hs]`` int64 in ``[1, M]``: only the first ``counts[b, h]`` entries of row
  ``(b, h)`` are used; the rest is padding (any value in ``[0, N)``, never read). Rows have
  different lengths this way without ragged tensors.
- ``weights [B, Hs, M]`` (optional, positive and finite on used entries): the inverse inclusion
  probability ``w_i = 1 / p_i`` of each index. ``None`` means every weight is 1.
- ``scale``: the logit scale (default ``1/sqrt(d)``).

Outputs, per query head ``h`` of batch row ``b`` with ``S`` its used entries (of its own list or its
KV head's list) and ``s_i = scale · q_bh · k_i``:

- ``out[b, h] = Σ_{i∈S} w_i e^{s_i} v_i / Σ_{i∈S} w_i e^{s_i}`` (the ratio estimator of Eq. 3 of
  the vAttention paper; with all ``w = 1`` it is exact attention renormalised over ``S``);
- ``lse[b, h] = log Σ_{i∈S} w_i e^{s_i}`` (natural log, scaled logits). With ``w = 1/p`` it is the
  log of a Horvitz–Thompson estimate of the full softmax denominator, which is what split-KV merges
  and the vAttention budget need.

An index listed twice counts twice (its terms are added): that is the with-replacement
(Hansen–Hurwitz) estimator. Methods that want a set pass distinct indices. Every reference path
here is O(M · d) per (b, h): only the listed rows are gathered, no ``[B, H, Q, N]`` mask exists.
Arithmetic is float64 for float64 inputs and float32 otherwise.
"""

from __future__ import annotations

import torch


def check_weighted_sparse_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    weights: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the argument when the call breaks the contract above."""
    b, hq, d = q.shape
    _, hkv, n, _ = k.shape
    if indices.dim() != 3 or indices.shape[0] != b or indices.shape[1] not in (hkv, hq):
        raise ValueError(
            f"indices: expected shape [B={b}, Hkv={hkv} or Hq={hq}, M], got {tuple(indices.shape)}"
        )
    if indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"indices: expected an int64 or int32 tensor, got {indices.dtype}")
    m = indices.shape[2]
    if m < 1:
        raise ValueError("indices: expected at least one column (M >= 1)")
    if counts.shape != indices.shape[:2]:
        raise ValueError(f"counts: expected shape {tuple(indices.shape[:2])}, got {tuple(counts.shape)}")
    if counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(f"counts: expected an integer tensor, got {counts.dtype}")
    lo, hi = int(counts.min()), int(counts.max())
    if lo < 1 or hi > m:
        raise ValueError(f"counts: expected values in [1, M={m}], got min {lo}, max {hi}")
    used = torch.arange(m, device=indices.device) < counts[..., None]
    if used.any():
        used_idx = indices[used]
        if int(used_idx.min()) < 0 or int(used_idx.max()) >= n:
            raise ValueError(
                f"indices: used entries must lie in [0, N={n}), got min {int(used_idx.min())}, "
                f"max {int(used_idx.max())}"
            )
    if weights is not None:
        if weights.shape != indices.shape:
            raise ValueError(f"weights: expected shape {tuple(indices.shape)}, got {tuple(weights.shape)}")
        w_used = weights[used]
        if not bool(torch.isfinite(w_used).all()) or not bool((w_used > 0).all()):
            raise ValueError("weights: used entries must be positive and finite (inverse inclusion probabilities)")


def gather_rows(t: torch.Tensor, idx: torch.Tensor, head_of: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``t [B, Hkv, N, x]`` at ``idx [B, Hs, M]`` -> ``[B, Hs, M, x]``.

    Head ``h`` of ``idx`` reads KV head ``head_of[h]`` (default: ``h``, for ``Hs = Hkv``). One
    ``index_select`` over the flattened rows: whole rows are copied, which is many times faster on
    CPU than an element-wise ``gather`` with an expanded index.
    """
    b, hkv, n, x = t.shape
    hs, m = idx.shape[1], idx.shape[2]
    if head_of is None:
        head_of = torch.arange(hs, device=idx.device)
    rows = torch.arange(b, device=idx.device)
    if b > 1 and t.stride(0) == 0:  # one cache row viewed by many query rows: read the one copy
        t, rows = t[:1], torch.zeros_like(rows)
    base = (rows[:, None] * hkv + head_of[None, :]) * n  # [B, Hs]
    flat = (base[..., None] + idx).reshape(-1)
    return torch.index_select(t.reshape(-1, x), 0, flat).view(b, hs, m, x)


def weighted_sparse_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, dv], lse [B, Hq])`` of the weighted sparse decode contract (module docstring)."""
    if check:
        check_weighted_sparse_inputs(q, k, v, indices, counts, weights)
    b, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    hs, m = indices.shape[1], indices.shape[2]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = d ** -0.5
    # Padding entries are never read: they are pointed at the row's first entry (always used, since
    # counts >= 1), whose weight is then masked to zero below. No NaN of an unused row can leak.
    used_flat = torch.arange(m, device=q.device) < counts[..., None]
    idx = torch.where(used_flat, indices.long(), indices[..., :1].long())
    if hs == hkv:
        # One list per KV head: gather its rows once, score them for the G query heads of the group.
        kr = gather_rows(k, idx).to(dtype)
        vr = gather_rows(v, idx).to(dtype)
        qg = q.to(dtype).view(b, hkv, group, d)
        logits = torch.matmul(qg, kr.transpose(-1, -2)) * scale  # [B, Hkv, G, M]
        extra_dims = (b, hkv, 1, m)
    else:
        # One list per query head (only reached when G > 1): each head gathers from its KV head.
        kv_of = torch.arange(hq, device=q.device) // group
        kr = gather_rows(k, idx, kv_of).to(dtype)
        vr = gather_rows(v, idx, kv_of).to(dtype)
        logits = torch.einsum("bhd,bhmd->bhm", q.to(dtype), kr)[:, :, None, :] * scale  # [B, Hq, 1, M]
        extra_dims = (b, hq, 1, m)
    used = (torch.arange(m, device=q.device) < counts[..., None]).view(extra_dims)
    if weights is not None:
        # Padding entries may hold any weight; they are masked to -inf below. The fill is a Python
        # scalar: a CPU tensor there would be copied to the device (a host sync on CUDA).
        log_w = torch.log(torch.where(used, weights.to(dtype).view(extra_dims), 1.0))
        logits = logits + log_w
    logits = logits.masked_fill(~used, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # every row has >= 1 used entry, hence finite
    p = torch.exp(logits - lse[..., None])
    out = torch.matmul(p, vr)  # [B, Hs, G or 1, dv]
    return out.reshape(b, hq, -1), lse.reshape(b, hq)


weighted_sparse_decode = weighted_sparse_decode_reference
"""The entry point methods call; a GPU kernel will dispatch here by device once it exists."""
