"""Bucketed sparse decode (SAAP): inverted lists of keys per KV head, attention over the keys of the
chosen buckets plus a dense part, partial attentions merged by log-sum-exp.

Contract
--------
- ``assign [B, Hkv, N]`` int64 in ``[0, C]``: the bucket of each cache position, ``C`` for positions
  that are not indexed (the dense part, padding, keys added after the build).
- :func:`build_csr` turns it into ``offsets [B, Hkv, C + 1]`` and ``ids [B, Hkv, N]`` (the SAAP
  paper's ``Off`` and ``Idx``, App. F): the cache positions of bucket ``c`` are
  ``ids[..., offsets[c]:offsets[c + 1]]`` in increasing order; ``offsets[C]`` indexed keys in all.
  Keys stay where they are in the cache; only positions are listed.
- :func:`bucket_lists` lists the positions of chosen buckets ``[B, Hkv, L]`` into one padded index
  list per KV head (``[B, Hkv, width]`` + counts), the operand of the weighted sparse decode.
- :func:`bucket_sparse_decode_reference`: exact softmax attention of the ``G`` query heads of each
  KV head over (dense list) ∪ (keys of the chosen buckets), computed as two partial attentions
  (:func:`kvsieve.kernels.sparse.weighted.weighted_sparse_decode`) merged by
  :func:`merge_partials`. An empty part (``L = 0``, or only empty buckets chosen) has
  ``lse = -inf`` and is the identity of the merge.

A GPU kernel implementing the paper's ``ℓ + 1`` blocks per KV head (block 0 the dense part, block
``b`` bucket ``b``) reads ``offsets``/``ids`` directly and returns the same ``(out, lse)``.

Nothing here synchronises with the host: widths are Python integers fixed when the index is
built (``width`` bounds the keys of any ``L`` buckets, see :func:`list_width`).
"""

from __future__ import annotations

import torch

from .weighted import weighted_sparse_decode


def build_csr(assign: torch.Tensor, n_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets [B, H, C + 1], ids [B, H, N])`` from ``assign [B, H, N]`` with values in ``[0, C]``.

    ``ids`` is a stable argsort of the assignment, so each bucket lists its positions in increasing
    order and the not-indexed positions (value ``C``) come last.
    """
    if assign.dim() != 3:
        raise ValueError(f"assign: expected shape [B, H, N], got {tuple(assign.shape)}")
    b, h, n = assign.shape
    ids = torch.argsort(assign, dim=-1, stable=True)
    sizes = torch.zeros(b, h, n_buckets + 1, dtype=torch.long, device=assign.device)
    sizes.scatter_add_(2, assign.long(), torch.ones_like(assign, dtype=torch.long))
    offsets = torch.zeros(b, h, n_buckets + 1, dtype=torch.long, device=assign.device)
    offsets[..., 1:] = torch.cumsum(sizes[..., :n_buckets], dim=-1)
    return offsets, ids


def bucket_sizes(offsets: torch.Tensor) -> torch.Tensor:
    """``[B, H, C]`` keys per bucket."""
    return offsets[..., 1:] - offsets[..., :-1]


def list_width(offsets: torch.Tensor, probes: int) -> int:
    """The most keys any ``probes`` buckets of one (row, KV head) can hold: a list width that fits
    every choice. One host read, made once when the index is built."""
    if probes <= 0:
        return 0
    sizes = bucket_sizes(offsets)
    top = torch.topk(sizes, min(probes, sizes.shape[-1]), dim=-1).values.sum(-1)
    return max(int(top.max()), 1)


def bucket_lists(
    offsets: torch.Tensor, ids: torch.Tensor, buckets: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the keys of ``buckets [B, H, L]``: ``(indices [B, H, width], counts [B, H])``.

    Buckets follow each other in the order given; padding entries are 0. ``width`` must be at least
    the largest count (:func:`list_width`). Slot ``t`` finds its bucket by a binary search in the
    running sum of the chosen buckets' sizes: O(width · log L) per (row, head), whatever the sizes.
    """
    b, h, n_probe = buckets.shape
    sizes = bucket_sizes(offsets).gather(2, buckets)  # [B, H, L]
    starts = offsets.gather(2, buckets)  # [B, H, L]
    ends = torch.cumsum(sizes, dim=-1)  # where each bucket's run ends in the list
    counts = ends[..., -1] if n_probe else torch.zeros(b, h, dtype=torch.long, device=ids.device)
    slot = torch.arange(width, device=ids.device).expand(b, h, width).contiguous()
    which = torch.searchsorted(ends, slot, right=True).clamp_(max=max(n_probe - 1, 0))
    within = slot - (ends - sizes).gather(2, which)
    used = slot < counts[..., None]
    src = torch.where(used, starts.gather(2, which) + within, torch.zeros_like(slot))
    indices = torch.where(used, ids.gather(2, src), torch.zeros_like(slot))
    return indices, counts


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attentions ``(out_p [..., dv], lse_p [...])`` over disjoint key sets.

    ``out = Σ_p e^{lse_p − m} out_p / Σ_p e^{lse_p − m}`` with ``m = max_p lse_p``; the merged
    ``lse = m + log Σ_p e^{lse_p − m}``. Order-invariant; a part with ``lse = -inf`` (no key) adds
    nothing. If every part is empty the output is 0 and ``lse = -inf``.
    """
    if not outs or len(outs) != len(lses):
        raise ValueError(f"outs, lses: expected as many outputs as lses (>= 1), got {len(outs)}, {len(lses)}")
    lse = torch.stack(lses)
    m = lse.max(0).values
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # exp(-inf) = 0 for empty parts
    total = w.sum(0)
    out = sum(w_p[..., None] * o_p for w_p, o_p in zip(w, outs, strict=True))
    out = out / torch.where(total > 0, total, torch.ones_like(total))[..., None]
    return out, m_safe + torch.log(total)


def bucket_sparse_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dense_indices: torch.Tensor,
    dense_counts: torch.Tensor,
    offsets: torch.Tensor,
    ids: torch.Tensor,
    buckets: torch.Tensor,
    width: int,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, dv], lse [B, Hq], bucket_counts [B, Hkv])``: attention over the dense list
    ``dense_indices [B, Hkv, M]`` (first ``dense_counts [B, Hkv] >= 1`` used) and the keys of
    ``buckets [B, Hkv, L]`` of the CSR index, merged by log-sum-exp. Float32 arithmetic (float64 for
    float64 inputs), as the weighted sparse decode."""
    out_d, lse_d = weighted_sparse_decode(q, k, v, dense_indices, dense_counts, None, scale=scale, check=False)
    b, hkv = buckets.shape[:2]
    if buckets.shape[-1] == 0 or width == 0:
        return out_d, lse_d, torch.zeros(b, hkv, dtype=torch.long, device=q.device)
    idx, counts = bucket_lists(offsets, ids, buckets, width)
    # The decode contract needs one used entry per list; an empty list reads position 0 and its
    # part is then dropped through lse = -inf.
    out_b, lse_b = weighted_sparse_decode(q, k, v, idx, counts.clamp(min=1), None, scale=scale, check=False)
    group = q.shape[1] // hkv
    empty = (counts == 0).repeat_interleave(group, dim=1)
    lse_b = lse_b.masked_fill(empty, float("-inf"))
    out, lse = merge_partials([out_d, out_b], [lse_d, lse_b])
    return out, lse, counts


bucket_sparse_decode = bucket_sparse_decode_reference
"""The entry point SAAP calls; a GPU kernel will dispatch here by device once it exists."""


# ---- Triton kernel: the paper's ℓ + 1 programs per KV head ------------------------------------------
#
# Program (KV head h, batch row b, slot): the first DENSE_SPLITS slots walk the dense list, the next
# BUCKET_SPLITS slots per probe the inverted list of bucket buckets[b, h, p - 1] straight from the CSR
# arrays (no list is materialised). A part's tiles are dealt round-robin over its slots: with one
# program per part (the paper's ℓ + 1 blocks) the 2047-key dense part and the largest buckets were one
# program each, and the step waited on them (83 µs for 8k keys at 128k on an H100). Each program scores
# its keys for the G query heads of the group at once (q is a [G, d] block: K and V rows are read once
# per group) and writes an unnormalised partial (acc, m, l); the shared split-KV merge of
# kernels/triton_utils.py combines the partials, skipping empty ones (l = 0).

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton run the reference
    triton = None

if triton is not None:

    @triton.jit
    def _bucket_parts_kernel(
        q_ptr, k_ptr, v_ptr, dense_ptr, dense_cnt_ptr, off_ptr, ids_ptr, bkt_ptr,
        acc_ptr, m_ptr, l_ptr,
        scale, kv_heads, n_buckets, n_probe, s_db, s_dh, s_cb, s_ch, n_ids,
        s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
        s_ab, s_ah, s_ap, s_mb, s_mh,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DENSE_SPLITS: tl.constexpr, BUCKET_SPLITS: tl.constexpr,
    ):
        h = tl.program_id(0)
        b = tl.program_id(1)
        slot = tl.program_id(2)
        row = b * kv_heads + h
        if slot < DENSE_SPLITS:
            p = slot * 0
            split = slot
            n_splits = DENSE_SPLITS
        else:
            p = (slot - DENSE_SPLITS) // BUCKET_SPLITS + 1
            split = (slot - DENSE_SPLITS) % BUCKET_SPLITS
            n_splits = BUCKET_SPLITS
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, DV)
        g_ok = offs_g < GROUP
        q = tl.load(q_ptr + b * s_qb + (h * GROUP + offs_g)[:, None] * s_qh + offs_d[None, :],
                    mask=g_ok[:, None], other=0.0)
        if p == 0:
            # strides, not a row index: a dense list shared by the KV heads comes with head stride 0
            list_ptr = dense_ptr + b * s_db + h * s_dh
            count = tl.load(dense_cnt_ptr + b * s_cb + h * s_ch)
            start = count * 0  # int64 like the other branch's (the compiler needs one type)
        else:
            c = tl.load(bkt_ptr + row * n_probe + p - 1)
            start = tl.load(off_ptr + row * (n_buckets + 1) + c)
            count = tl.load(off_ptr + row * (n_buckets + 1) + c + 1) - start
            list_ptr = ids_ptr + row * n_ids
        m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, DV], dtype=tl.float32)
        for n0 in range(split * BLOCK_N, count, n_splits * BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            ok = offs_n < count
            idx = tl.load(list_ptr + start + offs_n, mask=ok, other=0).to(tl.int64)
            kb = tl.load(k_ptr + b * s_kb + h * s_kh + idx[:, None] * s_kn + offs_d[None, :], mask=ok[:, None],
                         other=0.0)
            s = tl.dot(q, tl.trans(kb), out_dtype=tl.float32, input_precision=DOT_PRECISION) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: the chunk holds at least one key
            alpha = tl.exp(m - m_new)
            pexp = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(pexp, axis=1)
            vb = tl.load(v_ptr + b * s_vb + h * s_vh + idx[:, None] * s_vn + offs_dv[None, :], mask=ok[:, None],
                         other=0.0)
            acc = acc * alpha[:, None] + tl.dot(pexp.to(vb.dtype), vb, out_dtype=tl.float32,
                                                input_precision=DOT_PRECISION)
            m = m_new
        heads = h * GROUP + offs_g
        tl.store(acc_ptr + b * s_ab + heads[:, None] * s_ah + slot * s_ap + offs_dv[None, :], acc,
                 mask=g_ok[:, None])
        tl.store(m_ptr + b * s_mb + heads * s_mh + slot, m, mask=g_ok)
        tl.store(l_ptr + b * s_mb + heads * s_mh + slot, l, mask=g_ok)


def bucket_sparse_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dense_indices: torch.Tensor,
    dense_counts: torch.Tensor,
    offsets: torch.Tensor,
    ids: torch.Tensor,
    buckets: torch.Tensor,
    width: int = 0,
    *,
    scale: float | None = None,
    block_n: int = 64,
    dense_splits: int | None = None,
    bucket_splits: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`bucket_sparse_decode_reference` as one Triton launch plus the split-KV merge. Probing per
    KV head only (``buckets [B, Hkv, L]``); ``width`` is unused (the programs read the CSR lists
    directly). The dense list is split over ``dense_splits`` programs (default: one per two tiles of its
    width, at most 32) and each bucket over ``bucket_splits``, tiles dealt round-robin; a program
    with no tile writes an empty partial that the merge skips."""
    from ..triton_utils import dot_precision, merge_partials, next_pow2

    if triton is None:
        raise RuntimeError("bucket_sparse_decode_triton needs triton")
    b, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    group = hq // hkv
    if buckets.shape[1] != hkv:
        raise ValueError(f"buckets: the kernel probes per KV head, expected [B, {hkv}, L], got {tuple(buckets.shape)}")
    if d % 16 or dv % 16 or d != next_pow2(d) or dv != next_pow2(dv):
        raise ValueError(f"q, v: head dims {d}, {dv} must be powers of two >= 16 for the kernel")
    n_probe = buckets.shape[-1]
    if dense_splits is None:
        dense_splits = min(32, max(1, -(-dense_indices.shape[-1] // (2 * block_n))))
    for name, value in (("dense_splits", dense_splits), ("bucket_splits", bucket_splits)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    parts = dense_splits + n_probe * bucket_splits
    scale = d ** -0.5 if scale is None else scale
    acc = torch.empty(b, hq, parts, dv, device=q.device, dtype=torch.float32)
    m = torch.empty(b, hq, parts, device=q.device, dtype=torch.float32)
    l = torch.empty(b, hq, parts, device=q.device, dtype=torch.float32)
    if dense_indices.stride(-1) != 1:
        dense_indices = dense_indices.contiguous()
    offsets, ids, buckets = offsets.contiguous(), ids.contiguous(), buckets.contiguous()
    k_, v_ = k, v
    if k.stride(-1) != 1:
        k_ = k.contiguous()
    if v.stride(-1) != 1:
        v_ = v.contiguous()
    block_g = max(16, next_pow2(group))
    _bucket_parts_kernel[(hkv, b, parts)](
        q, k_, v_, dense_indices, dense_counts, offsets, ids, buckets, acc, m, l,
        float(scale), hkv, offsets.shape[-1] - 1, max(n_probe, 1), dense_indices.stride(0), dense_indices.stride(1),
        dense_counts.stride(0), dense_counts.stride(1), ids.shape[-1],
        q.stride(0), q.stride(1), k_.stride(0), k_.stride(1), k_.stride(2), v_.stride(0), v_.stride(1), v_.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        GROUP=group, BLOCK_G=block_g, BLOCK_N=block_n, D=d, DV=dv,
        # float32 inputs take IEEE dots: Triton's default for them is TF32 (about 1e-3 relative error)
        DOT_PRECISION=dot_precision(q.dtype), DENSE_SPLITS=dense_splits, BUCKET_SPLITS=bucket_splits, num_warps=4,
    )
    out = torch.empty(b, hq, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, hq, device=q.device, dtype=torch.float32)
    merge_partials(acc, m, l, None, out, b, hq, parts, dv, 1, (acc.stride(0), acc.stride(1), acc.stride(2)),
                   (m.stride(0), m.stride(1)), lse=lse)
    sizes = bucket_sizes(offsets).gather(2, buckets) if n_probe else torch.zeros_like(buckets[..., :1])
    return out, lse, sizes.sum(-1)
