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
  (:func:`kvsieve.kernels.shared.weighted.weighted_sparse_decode`) merged by
  :func:`merge_partials`. An empty part (``L = 0``, or only empty buckets chosen) has
  ``lse = -inf`` and is the identity of the merge.

A GPU kernel implementing the paper's ``ℓ + 1`` blocks per KV head (block 0 the dense part, block
``b`` bucket ``b``) reads ``offsets``/``ids`` directly and returns the same ``(out, lse)``.

Nothing here synchronises with the host: widths are Python integers fixed when the index is
built (``width`` bounds the keys of any ``L`` buckets, see :func:`list_width`).
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import cdiv
from ..shared.weighted import weighted_sparse_decode


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
    dense_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, dv], lse [B, Hq], bucket_counts [B, Hkv])``: attention over the dense list
    ``dense_indices [B, Hkv, M]`` (first ``dense_counts [B, Hkv]`` used) and the keys of ``buckets [B, Hkv,
    L]`` of the CSR index, merged by log-sum-exp. ``dense_range = (lo [B], hi [B])`` adds the positions
    ``[lo_b, hi_b)`` of row b to its dense part, after the list (SAAP's keys added since the index
    build); the dense part needs at least one key. Float32 arithmetic (float64 for float64 inputs), as
    the weighted sparse decode."""
    if dense_range is not None:
        dense_indices, dense_counts = append_range(dense_indices, dense_counts, *dense_range, k.shape[2])
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


def append_range(indices: torch.Tensor, counts: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists ``indices [B, H, M]`` (first ``counts [B, H]`` used) followed by the positions ``[lo_b,
    hi_b)`` of each batch row (none when ``hi_b <= lo_b``): ``[B, H, M + n_keys]`` (padding 0) and the
    new counts."""
    b, h, width = indices.shape
    n_range = (hi.long() - lo.long()).clamp(min=0)  # [B]
    rel = torch.arange(width + n_keys, device=indices.device) - counts[..., None]  # slot - count: [B, H, W]
    padded = torch.cat([indices, indices.new_zeros(b, h, n_keys)], dim=-1)
    from_range = torch.where(rel < n_range[:, None, None], lo.long()[:, None, None] + rel, torch.zeros_like(rel))
    return torch.where(rel < 0, padded, from_range), counts + n_range[:, None]


bucket_sparse_decode = bucket_sparse_decode_reference
"""The entry point SAAP calls; a GPU kernel will dispatch here by device once it exists."""


# ---- Triton kernel: one flat list of keys per KV head, cut into equal chunks ---------------------
#
# The keys a (batch row, KV head) attends are, in order: the dense list (``dense_counts`` entries), the
# dense range ``[lo_b, hi_b)`` and the keys of the chosen buckets one after the other, as the CSR arrays
# hold them (``bucket_lists`` order). Program (KV head h, batch row b, split s) walks positions
# ``s·BLOCK_N, (s + SPLITS)·BLOCK_N, ...`` of that virtual list: each chunk of BLOCK_N positions finds
# its keys in registers (the bucket of a position is the one whose running end first exceeds it, over
# the ≤ ℓ chosen buckets), so no list is materialised and every program gets the same number of keys
# give or take one chunk, whatever the bucket sizes (a split of each part over a fixed number of programs
# would wait on the largest bucket). Each program scores its keys for the G query heads of the
# group at once (q is a [G, d] block: K and V rows are read once per group) and writes an unnormalised
# partial (acc, m, l); the last program of the (row, KV head) to finish (a ticket counter it resets)
# merges the partials in split order, skipping empty ones (l = 0) — or, with fused_merge=False, the shared
# split-KV merge of kernels/shared/triton_utils.py does. Split 0 also writes the bucket key count (the step's stats).

try:
    import triton
    import triton.language as tl

    from .index import assign_ahead_program
except ImportError:  # pragma: no cover - CPU installs without triton run the reference
    triton = None

if triton is not None:

    @triton.jit
    def _chunk_keys(n0, total, n_list, n_dense, n_bucket_keys, lo, begins, ends, shift, list_ptr, ids_row, t_lo,
                    assign_row, bkt_ptr, row, n_probe, tail_from, BLOCK_N: tl.constexpr, HAS_TAIL: tl.constexpr):
        """``(idx, ok)``: the cache positions of the chunk of the virtual list starting at ``n0`` and which of them
        are read (the dense list, the dense range, the chosen buckets' CSR keys, then the tail's positions whose
        bucket is chosen). The tail test (an ``assign`` read and ℓ dependent compares) runs only on a chunk reaching
        ``tail_from``, where the tail starts: the chunks before it skip it."""
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < total
        in_list = pos < n_list
        rel = pos - n_dense  # position in the chosen buckets' run
        in_bucket = ok & (rel >= 0)
        hot = (begins[None, :] <= rel[:, None]) & (rel[:, None] < ends[None, :])  # [BLOCK_N, BLOCK_L]
        slot = tl.sum(tl.where(hot, shift[None, :], 0), axis=1) + rel
        from_list = tl.load(list_ptr + pos, mask=in_list, other=0)
        if HAS_TAIL:
            in_tail = in_bucket & (rel >= n_bucket_keys)
            in_bucket = in_bucket & (rel < n_bucket_keys)
        from_ids = tl.load(ids_row + slot, mask=in_bucket, other=0)
        idx = tl.where(in_list, from_list, tl.where(in_bucket, from_ids, lo + pos - n_list))
        if HAS_TAIL:
            tail_pos = t_lo + rel - n_bucket_keys
            idx = tl.where(in_tail, tail_pos, idx)
            # no compare on a chunk before the tail: a loop of no trip (a branch around the call made it spill)
            hit = _tail_hit(assign_row, tail_pos, in_tail, bkt_ptr, row,
                            tl.where(n0 + BLOCK_N > tail_from, n_probe, 0), BLOCK_N)
            # a bucket key the dense range now holds (a row shorter than at the build) is read there
            ok = ok & tl.where(in_tail, hit, ~in_bucket | (idx < lo))
        return tl.where(ok, idx, 0).to(tl.int64), ok

    @triton.jit
    def _tail_hit(assign_row, tail_pos, in_tail, bkt_ptr, row, n_probe, BLOCK_N: tl.constexpr):
        """Which tail positions (``in_tail``) hold a key of a chosen bucket."""
        a = tl.load(assign_row + tail_pos, mask=in_tail, other=-1)
        # one compare per chosen bucket, not a [BLOCK_N, BLOCK_L] tile reduced to a mask: Triton 3.6's layout pass
        # breaks a select whose condition comes out of such a reduction
        hit = tl.zeros([BLOCK_N], dtype=tl.int1)
        for j in range(n_probe):
            hit = hit | (a == tl.load(bkt_ptr + row * n_probe + j))
        return hit

    @triton.jit
    def _attend_chunk(q, idx, ok, m, l, acc, k_base, v_base, s_kn, s_vn, scale, offs_d, offs_dv,
                      HAS_TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
        """The online softmax ``(m, l, acc)`` of the group's queries after the keys ``idx`` (those ``ok``)."""
        kb = tl.load(k_base + idx[:, None] * s_kn + offs_d[None, :], mask=ok[:, None], other=0.0)
        if DOT_F32:
            kb = kb.to(tl.float32)
        s = tl.dot(q, tl.trans(kb), out_dtype=tl.float32, input_precision=DOT_PRECISION) * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite unless the chunk's keys were all masked
        if HAS_TAIL:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp(m - m_ref)
        pexp = tl.exp(s - m_ref[:, None])
        l = l * alpha + tl.sum(pexp, axis=1)
        vb = tl.load(v_base + idx[:, None] * s_vn + offs_dv[None, :], mask=ok[:, None], other=0.0)
        if DOT_F32:
            vb = vb.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pexp.to(vb.dtype), vb, out_dtype=tl.float32,
                                            input_precision=DOT_PRECISION)
        return m_new, l, acc

    @triton.jit
    def _bucket_parts_kernel(
        q_ptr, k_ptr, v_ptr, dense_ptr, dense_cnt_ptr, lo_ptr, hi_ptr, off_ptr, ids_ptr, bkt_ptr,
        acc_ptr, m_ptr, l_ptr, counts_ptr, out_ptr, lse_ptr, sem_ptr, tail_lo_ptr, assign_ptr,
        scale, kv_heads, n_buckets, n_probe, s_db, s_dh, s_cb, s_ch, n_ids, s_asb, s_ash,
        s_qb, s_qh, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
        s_ab, s_ah, s_ap, s_mb, s_mh, s_ob, s_oh,
        cent_ptr, freq_ptr, a_scaling, a_span,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_L: tl.constexpr, SPLITS: tl.constexpr, HAS_RANGE: tl.constexpr, HAS_TAIL: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        FUSED_MERGE: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_S: tl.constexpr,
        AHEAD: tl.constexpr, A_HALF: tl.constexpr, A_BLOCK_C: tl.constexpr, A_DEROPE: tl.constexpr,
    ):
        """Programs (KV head, row, split): the attention's splits, after ``AHEAD`` programs per (KV head, row) that
        come first in the grid (dispatched first): the index update one step ahead
        (:func:`kvsieve.kernels.saap.index.assign_ahead_program`, one a key), which writes ``assign`` at or past
        ``L − W``; the attention programs read it below."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        split = tl.program_id(2)
        if AHEAD > 0:
            if split < AHEAD:
                assign_ahead_program(k_ptr, cent_ptr, freq_ptr, assign_ptr, tail_lo_ptr, hi_ptr, lo_ptr, a_scaling,
                                     n_buckets, a_span, s_kb, s_kh, s_kn, s_asb, s_ash, b, h, split,
                                     D, A_HALF, A_BLOCK_C, A_DEROPE)
        split -= AHEAD
        if split >= 0:  # an attention program
            row = b * kv_heads + h
            # the chosen buckets: where each starts in ids, its size and where its run ends in the flat list
            offs_l = tl.arange(0, BLOCK_L)
            l_ok = offs_l < n_probe
            # (positions and slots are below 2^31: int32 keeps the [BLOCK_N, BLOCK_L] search in few registers)
            c = tl.load(bkt_ptr + row * n_probe + offs_l, mask=l_ok, other=0)
            off_row = off_ptr + row.to(tl.int64) * (n_buckets + 1)
            starts = tl.load(off_row + c, mask=l_ok, other=0).to(tl.int32)
            sizes = tl.load(off_row + c + 1, mask=l_ok, other=0).to(tl.int32) - starts
            ends = tl.cumsum(sizes, 0)
            begins = ends - sizes
            shift = starts - begins  # ids slot of a flat bucket position: shift[j] + position
            n_bucket_keys = tl.sum(sizes, axis=0)
            n_list = tl.load(dense_cnt_ptr + b * s_cb + h * s_ch).to(tl.int32)
            if HAS_TAIL:
                # SAAP's sliding window: lo_ptr holds each row's window W, hi_ptr its length L, the list the sink
                # (n_list keys): the range is [max(sink, L - W), L), the tail [t_lo, max(t_lo, L - W))
                length = tl.load(hi_ptr + b).to(tl.int32)
                start = length - tl.load(lo_ptr + b).to(tl.int32)
                lo = tl.maximum(start, n_list)
                n_range = tl.maximum(length - lo, 0)
                n_list = tl.minimum(n_list, length)
            elif HAS_RANGE:
                lo = tl.load(lo_ptr + b).to(tl.int32)
                n_range = tl.maximum(tl.load(hi_ptr + b).to(tl.int32) - lo, 0)
            else:
                lo = n_list * 0
                n_range = n_list * 0
            n_dense = n_list + n_range
            total = n_dense + n_bucket_keys
            if HAS_TAIL:  # the positions [t_lo, t_hi) scanned after the buckets: their keys of a chosen bucket
                t_lo = tl.load(tail_lo_ptr + b).to(tl.int32)
                total += tl.maximum(start - t_lo, 0)
                assign_row = assign_ptr + b.to(tl.int64) * s_asb + h * s_ash
            if split == 0:
                tl.store(counts_ptr + row, n_bucket_keys.to(tl.int64))
            offs_g = tl.arange(0, BLOCK_G)
            offs_d = tl.arange(0, D)
            offs_dv = tl.arange(0, DV)
            g_ok = offs_g < GROUP
            q = tl.load(q_ptr + b * s_qb + (h * GROUP + offs_g)[:, None] * s_qh + offs_d[None, :],
                        mask=g_ok[:, None], other=0.0)
            if DOT_F32:  # the interpreter's bfloat16 tl.dot is wrong; its tests upcast the tiles instead
                q = q.to(tl.float32)
            # strides, not a row index: a dense list shared by the KV heads comes with head stride 0
            list_ptr = dense_ptr + b * s_db + h * s_dh
            ids_row = ids_ptr + row.to(tl.int64) * n_ids
            k_base = k_ptr + b * s_kb + h * s_kh
            v_base = v_ptr + b * s_vb + h * s_vh
            m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            l = tl.zeros([BLOCK_G], dtype=tl.float32)
            acc = tl.zeros([BLOCK_G, DV], dtype=tl.float32)
            if not HAS_TAIL:  # unused without the tail: any values of the right kinds
                t_lo = lo
                assign_row = ids_row
            # the tail scan's positions come last in the list: chunks before them skip its per-bucket test
            tail_from = n_dense + n_bucket_keys
            step = SPLITS * BLOCK_N
            # the keys of the next chunk found (their ids loaded) before this chunk's K/V rows are read: a chunk waits
            # on its K/V rows only, not on the ids then the rows (at batch 8 a program walks many chunks)
            idx, ok = _chunk_keys(split * BLOCK_N, total, n_list, n_dense, n_bucket_keys, lo, begins, ends, shift,
                                  list_ptr, ids_row, t_lo, assign_row, bkt_ptr, row, n_probe, tail_from, BLOCK_N,
                                  HAS_TAIL)
            for n0 in range(split * BLOCK_N, total, step):
                idx_next, ok_next = _chunk_keys(n0 + step, total, n_list, n_dense, n_bucket_keys, lo, begins, ends,
                                                shift, list_ptr, ids_row, t_lo, assign_row, bkt_ptr, row, n_probe,
                                                tail_from, BLOCK_N, HAS_TAIL)
                m, l, acc = _attend_chunk(q, idx, ok, m, l, acc, k_base, v_base, s_kn, s_vn, scale, offs_d, offs_dv,
                                          HAS_TAIL, DOT_PRECISION, DOT_F32)
                idx = idx_next
                ok = ok_next
            heads = h * GROUP + offs_g
            tl.store(acc_ptr + b * s_ab + heads[:, None] * s_ah + split * s_ap + offs_dv[None, :], acc,
                     mask=g_ok[:, None])
            tl.store(m_ptr + b * s_mb + heads * s_mh + split, m, mask=g_ok)
            tl.store(l_ptr + b * s_mb + heads * s_mh + split, l, mask=g_ok)
            if FUSED_MERGE:
                # The last program of (row, KV head) to finish merges the SPLITS partials of its GROUP query
                # heads (a ticket counter it resets to 0, so every graph replay finds it at 0): no merge launch.
                # The merge reads the partials in split order whichever program runs it (deterministic).
                # All threads' stores precede the release (barrier, then an acq_rel atomic at GPU scope).
                tl.debug_barrier()
                ticket = tl.atomic_add(sem_ptr + row, 1, sem="acq_rel", scope="gpu")
                if ticket == SPLITS - 1:
                    offs_gp = tl.arange(0, GROUP_P)
                    heads_p = h * GROUP + offs_gp
                    gp_ok = offs_gp < GROUP
                    offs_s = tl.arange(0, BLOCK_S)
                    s_ok = gp_ok[:, None] & (offs_s[None, :] < SPLITS)
                    ml_all = b * s_mb + heads_p[:, None] * s_mh + offs_s[None, :]
                    mp = tl.load(m_ptr + ml_all, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                    lp = tl.load(l_ptr + ml_all, mask=s_ok, other=0.0, cache_modifier=".cg")
                    m_max = tl.max(tl.where(lp > 0, mp, float("-inf")), axis=1)
                    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
                    z = tl.sum(tl.where(lp > 0, tl.exp(mp - m_ref[:, None]), 0.0) * lp, axis=1)
                    o = tl.zeros([GROUP_P, DV], dtype=tl.float32)
                    for p0 in tl.static_range(0, SPLITS, MERGE_S):  # unrolled: every chunk's loads in flight
                        offs_c = p0 + tl.arange(0, MERGE_S)
                        ml_c = b * s_mb + heads_p[:, None] * s_mh + offs_c[None, :]
                        c_ok = gp_ok[:, None] & (offs_c[None, :] < SPLITS)
                        mc = tl.load(m_ptr + ml_c, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
                        lc = tl.load(l_ptr + ml_c, mask=c_ok, other=0.0, cache_modifier=".cg")
                        live = c_ok & (lc > 0)  # empty partials cost no traffic
                        wc = tl.where(live, tl.exp(mc - m_ref[:, None]), 0.0)
                        a = tl.load(acc_ptr + b * s_ab + heads_p[:, None, None] * s_ah + offs_c[None, :, None] * s_ap
                                    + offs_dv[None, None, :], mask=live[:, :, None], other=0.0, cache_modifier=".cg")
                        o += tl.sum(wc[:, :, None] * a, axis=1)
                    safe = tl.where(z > 0, z, 1.0)
                    o = tl.where((z > 0)[:, None], o / safe[:, None], 0.0)  # no key at all: 0 and LSE -inf
                    tl.store(out_ptr + b * s_ob + heads_p[:, None] * s_oh + offs_dv[None, :],
                             o.to(out_ptr.dtype.element_ty), mask=gp_ok[:, None])
                    tl.store(lse_ptr + b * (kv_heads * GROUP) + heads_p,
                             tl.where(z > 0, m_ref + tl.log(safe), float("-inf")), mask=gp_ok)
                    tl.atomic_xchg(sem_ptr + row, 0)


#: The most programs per (row, KV head) for which the fused merge (a ticket counter per row, the last program
#: merges) is the method's choice: every program's acq_rel increment of the row's one counter serialises (about
#: 0.3 us each on the H200), so at batch 1 (48 programs a row) a separate merge launch is faster, and at batch 8
#: (6 a row) the two measured about equal (the shared sparse decode kernel with either merge, on the H200).
FUSED_MERGE_MAX_SPLITS = 8


def fused_merge_default(rows: int, max_keys: int, block_n: int = 64) -> bool:
    """Whether SAAP's decode fuses the split merge into the bucket kernel: with :func:`default_splits` at most
    :data:`FUSED_MERGE_MAX_SPLITS` programs contend for each row's counter."""
    return default_splits(rows, max_keys, block_n) <= FUSED_MERGE_MAX_SPLITS


def default_splits(rows: int, max_keys: int, block_n: int = 64) -> int:
    """Programs per (batch row, KV head): about 384 in all, one wave on an H100 (132 SMs, three programs
    each: the kernel compiles to 168 registers a thread at 4 warps for sm_90), no more than the chunks of
    the longest possible list."""
    return max(1, min(384 // max(rows, 1), cdiv(max_keys, block_n)))


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
    dense_range: tuple[torch.Tensor, torch.Tensor] | None = None,
    sliding: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block_n: int = 64,
    splits: int | None = None,
    fused_merge: bool = True,
    ahead: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`bucket_sparse_decode_reference` as one Triton launch plus the split-KV merge. Probing per
    KV head only (``buckets [B, Hkv, L]``). The keys of a (row, KV head) — dense list, dense range,
    chosen buckets — form one virtual list cut into chunks of ``block_n`` (64: the measured chunk) dealt
    round-robin over ``splits`` programs (default :func:`default_splits` of the longest list the host can bound: the
    dense list's width, the range and ``width``, the most keys of any ``L`` buckets, or every key
    when ``width`` is 0); a program with no chunk writes an empty partial that the merge skips. The
    bucket key counts come from the kernel (no torch launch). ``fused_merge`` (default): the last program
    of each (row, KV head) merges its partials (a ticket counter in a zeroed workspace that the kernel
    leaves at 0; one launch per call); False runs the separate merge kernel. Calls on different streams
    of one device must not overlap in time (the counter is shared, as :func:`workspace`'s buffers).

    ``sliding = (lengths [B], window [B], t_lo [B], assign [B, Hkv, A])`` (instead of ``dense_range``; the
    dense list is the sink, ``dense_counts`` its size): SAAP's sliding window and tail
    (:mod:`kvsieve.kernels.saap.index`), bounds computed in the kernel: the range ``[lo_b, L_b)`` with
    ``lo_b = max(sink, L_b − W_b)``, then after the buckets the positions ``[t_lo_b, max(t_lo_b, L_b − W_b))``
    whose ``assign`` is a chosen bucket; CSR keys at or past ``lo_b`` are skipped (the range holds them).
    :func:`kvsieve.kernels.saap.index.index_decode_reference` is its reference. The returned counts are the
    CSR keys of the chosen buckets, the tail not included.

    ``ahead = (centroids, inv_freq, scaling, span)`` (with ``sliding``): the same launch also runs
    :func:`kvsieve.kernels.saap.index.assign_ahead_reference`'s update of ``assign`` (its ``span`` programs a
    (row, KV head) first in the grid), the keys that leave the window in the next ``span`` keys: off the step's
    critical path. Its writes are at or past ``L − W`` and the attention reads ``assign`` below: no race. Needs
    every row's window to be at least ``span`` (the keys written must be in K)."""
    from ..shared.triton_utils import (
        dot_precision,
        is_interpreted,
        merge_partials,
        next_pow2,
        workspace,
    )

    if triton is None:
        raise RuntimeError("bucket_sparse_decode_triton needs triton")
    b, hq, d = q.shape
    hkv, n_keys, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = hq // hkv
    if buckets.shape[1] != hkv:
        raise ValueError(f"buckets: the kernel probes per KV head, expected [B, {hkv}, L], got {tuple(buckets.shape)}")
    if d % 16 or dv % 16 or d != next_pow2(d) or dv != next_pow2(dv):
        raise ValueError(f"q, v: head dims {d}, {dv} must be powers of two >= 16 for the kernel")
    n_probe = buckets.shape[-1]
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16 or block_n != next_pow2(block_n):
        raise ValueError(f"block_n: expected a power of two >= 16, got {block_n!r}")
    if splits is None:
        bound = dense_indices.shape[-1] + (n_keys if dense_range is not None else 0) + (width or n_keys)
        bound += 2 * n_keys if sliding is not None else 0
        splits = default_splits(b * hkv, min(bound, n_keys), block_n)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits: expected an integer >= 1, got {splits!r}")
    scale = d ** -0.5 if scale is None else scale
    acc = torch.empty(b, hq, splits, dv, device=q.device, dtype=torch.float32)
    m = torch.empty(b, hq, splits, device=q.device, dtype=torch.float32)
    l = torch.empty(b, hq, splits, device=q.device, dtype=torch.float32)
    counts = torch.empty(b, hkv, device=q.device, dtype=torch.int64)
    if dense_indices.stride(-1) != 1:
        dense_indices = dense_indices.contiguous()
    offsets, ids, buckets = offsets.contiguous(), ids.contiguous(), buckets.contiguous()
    k_, v_ = k, v
    if k.stride(-1) != 1:
        k_ = k.contiguous()
    if v.stride(-1) != 1:
        v_ = v.contiguous()
    lo, hi = dense_range if dense_range is not None else (dense_counts, dense_counts)
    if sliding is not None and dense_range is not None:
        raise ValueError("sliding: SAAP's window is the dense range; give one of sliding and dense_range")
    if sliding is not None:
        hi, lo, t_lo, assign = sliding
    else:
        t_lo, assign = lo, ids
    if ahead is None:
        cent, freq, a_scaling, a_span = q, q, 1.0, 1
        a_meta = dict(PROGRAMS=0, HALF=8, BLOCK_C=16, DEROPE=False)
    else:
        from .index import ahead_launch_meta

        if sliding is None:
            raise ValueError("ahead: the update one step ahead writes SAAP's assign; give sliding too")
        if len(ahead) != 4:
            raise ValueError(f"ahead: expected (centroids, inv_freq, scaling, span), got {len(ahead)} elements")
        cent, inv_freq, a_scaling, a_span = ahead
        if cent.shape[:2] != (hkv, offsets.shape[-1] - 1) or cent.dtype != torch.float32 \
                or not cent.is_contiguous() or assign.stride(-1) != 1 or a_span < 1:
            raise ValueError(f"ahead: expected contiguous float32 centroids [{hkv}, {offsets.shape[-1] - 1}, d], an "
                             f"assign contiguous in its last dimension and a span >= 1; got {tuple(cent.shape)}, "
                             f"{cent.dtype}, span {a_span}")
        freq = cent if inv_freq is None else inv_freq
        a_meta = ahead_launch_meta(k, a_span, cent, inv_freq)
    block_g = max(16, next_pow2(group))
    out = torch.empty(b, hq, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, hq, device=q.device, dtype=torch.float32)
    sem = workspace("bucket_ticket", q, b * hkv, torch.int32, zeroed=True) if fused_merge else counts
    group_p = max(2, next_pow2(group))
    _bucket_parts_kernel[(hkv, b, splits + a_meta["PROGRAMS"])](
        q, k_, v_, dense_indices, dense_counts, lo, hi, offsets, ids, buckets, acc, m, l, counts, out, lse, sem,
        t_lo, assign,
        float(scale), hkv, offsets.shape[-1] - 1, n_probe, dense_indices.stride(0), dense_indices.stride(1),
        dense_counts.stride(0), dense_counts.stride(1), ids.shape[-1], assign.stride(0), assign.stride(1),
        q.stride(0), q.stride(1), k_.stride(0), k_.stride(1), k_.stride(2), v_.stride(0), v_.stride(1), v_.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1), out.stride(0), out.stride(1),
        cent, freq, float(a_scaling), a_span,
        GROUP=group, BLOCK_G=block_g, BLOCK_N=block_n, D=d, DV=dv, BLOCK_L=max(16, next_pow2(n_probe)),
        SPLITS=splits, HAS_RANGE=dense_range is not None, HAS_TAIL=sliding is not None,
        # float32 inputs take IEEE dots: Triton's default for them is TF32 (about 1e-3 relative error)
        DOT_PRECISION=dot_precision(q.dtype),
        DOT_F32=q.dtype != torch.float32 and is_interpreted(_bucket_parts_kernel), FUSED_MERGE=fused_merge,
        GROUP_P=group_p, BLOCK_S=max(16, next_pow2(splits)),
        MERGE_S=max(1, min(32 // group_p, next_pow2(splits))),  # 8 at G = 4: no spill for sm_90
        AHEAD=a_meta.pop("PROGRAMS"), **{f"A_{key}": val for key, val in a_meta.items() if key != "D"},
        num_warps=4,
    )
    if fused_merge:
        return out, lse, counts
    merge_partials(acc, m, l, None, out, b, hq, splits, dv, 1, (acc.stride(0), acc.stride(1), acc.stride(2)),
                   (m.stride(0), m.stride(1)), lse=lse)
    return out, lse, counts
