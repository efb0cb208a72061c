"""Sketch&Walk's decode step up to the attention, fused: :func:`sketch_walk_select`.

Two Triton launches per call (one layer, one token per batch row), where the method's torch path
(:mod:`kvsieve.methods.sketchwalk`, ``backend="reference"``: the spec, and what the tests compare this
with) launches about a hundred small kernels:

1. ``_update_walk_kernel``, per batch row ``NC`` programs of the sketch update and, on a walk layer, one
   per (tile of key blocks, split of the walk's rows) of the walk's GEMV. The update, per chunk of
   head-dim features: the head-mean of the token's query (stored in ``q_tok``), its block ``c``'s sums
   recomputed from the kept queries and the cache's keys (stored), and the chunk's share of the SRHT Φx
   of the token's query, the block's query sum and key sum. The GEMV: the split's share of the tile's
   columns of ``w_prev[:c] · Ã[:c]`` (only rows ≥ the tile's first column can be non-zero, by
   causality) — Ã's causal half, the step's largest read, which needs nothing the update writes and so
   runs beside it.
2. ``_scores_select_kernel``, one program per (batch row, tile of key blocks): the sketched logits of
   the token's query and of block c's mean query against the tile's key sketches (block c's from the
   projections) with the tile's (max, Σ exp) for the softmaxes, and the sum of the GEMV's row splits over
   the tile's columns (one row of partial walks for the tail, whatever the split count). The last of a
   row's programs to finish (a ticket counter it resets) then runs the row: block c's key sketch
   (stored), the softmaxes from the partials, ``ã = exp(α·log â)``, block c's row of Ã written when the
   token completes the block, the walk ``w = w_prev[:c]·Ã[:c] + w_prev[c]·ã`` (or ``ã``: one-hop and a
   layer without a previous walk; ``w_prev ⊙ ã``: diagonal), ``w / max w`` (the next layer's walk), the ranking score
   ``w/max w + tie·ã/max ã`` over blocks ``1..c−1``, the budget ``k = max(2, ⌈ρ(c+1)⌉)`` (in float64, as
   the reference), and the best ``k − 2`` of the ranking by a radix select (``select_triton``'s; ties to
   the lower block): in registers for rows of up to 2048 blocks, over a workspace row beyond. Block 0,
   those ascending (the select emits them in block order) and block c are written as the page lists of
   :func:`kvsieve.kernels.shared.weighted_triton.sparse_decode_triton` for every KV head.

Sizes come from host-known shapes and the rows' positions from ``lengths`` in device memory: nothing is
read on the host, every buffer is allocated per call from host-known sizes or is a cached workspace
(graph-capturable); the one atomic is the ticket, which only picks the program that goes on, so nothing
is summed in arrival order and a replay equals an eager call bit for bit; and a replay recomputes the
token's block like the first call (``LayerSketch``'s recompute-not-accumulate contract).
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import launch, next_pow2, triton, workspace
from .common import float_bits

MODES = {"one-hop": 0, "walk": 1, "diagonal": 2}

if triton is not None:
    import triton.language as tl

    from ..shared.select_common import chosen_regs, emit_selected, ordered, radix_select, value_range
    from .common import FLOAT32_TINY, block_budget

    @triton.jit
    def _block_position(lens_ptr, b, BS: tl.constexpr):
        """``(pos, c, count)``: the row's new token, its block, and the block's tokens so far (this one too)."""
        pos = tl.load(lens_ptr + b).to(tl.int64) - 1
        c = pos // BS
        return pos, c, pos - c * BS + 1

    @triton.jit
    def _sketch_update(b, chunk, q_ptr, k_ptr, lens_ptr, phi_ptr, qtok_ptr, qsum_ptr, ksum_ptr, proj_ptr, hq, hkv, m,
                       s_qb, s_qh, s_kb, s_kh, s_kn, s_tb, s_tn, s_sb, s_sn, s_pm,
                       BS: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BHK: tl.constexpr, BM: tl.constexpr,
                       NC: tl.constexpr):
        # Feature chunk `chunk` of row b: each tile is one load, so the step's reads (the block's keys of
        # every KV head, at most BS·Hkv rows) are in flight at once.
        pos, c, _ = _block_position(lens_ptr, b, BS)
        offs_d = chunk * BD + tl.arange(0, BD)
        offs_h = tl.arange(0, BH)
        q = tl.load(q_ptr + b * s_qb + offs_h[:, None] * s_qh + offs_d[None, :], mask=(offs_h < hq)[:, None],
                    other=0.0)
        q_new = tl.sum(q.to(tl.float32), axis=0) / hq
        tl.store(qtok_ptr + b * s_tb + pos * s_tn + offs_d, q_new)
        tok = c * BS + tl.arange(0, BS)
        q_rows = tl.load(qtok_ptr + b * s_tb + tok[:, None] * s_tn + offs_d[None, :], mask=(tok < pos)[:, None],
                         other=0.0)  # the block's earlier tokens (this one's query is q_new)
        q_sum = tl.sum(q_rows, axis=0) + q_new
        r = tl.arange(0, BHK * BS)  # (KV head, token of the block) pairs
        head = r // BS
        tok_r = c * BS + r % BS
        k_rows = tl.load(k_ptr + b * s_kb + head[:, None] * s_kh + tok_r[:, None] * s_kn + offs_d[None, :],
                         mask=((head < hkv) & (tok_r <= pos))[:, None], other=0.0)
        k_sum = tl.sum(k_rows.to(tl.float32), axis=0) / hkv
        tl.store(qsum_ptr + b * s_sb + c * s_sn + offs_d, q_sum)
        tl.store(ksum_ptr + b * s_sb + c * s_sn + offs_d, k_sum)
        offs_m = tl.arange(0, BM)
        phi = tl.load(phi_ptr + offs_m[:, None] * s_pm + offs_d[None, :], mask=(offs_m < m)[:, None], other=0.0)
        # This chunk's share of Φx (padding features stay 0: they add nothing to a logit); the next
        # kernel sums the chunks.
        out = proj_ptr + ((b * NC + chunk) * 3) * BM + offs_m
        tl.store(out, tl.sum(phi * q_new[None, :], axis=1))
        tl.store(out + BM, tl.sum(phi * q_sum[None, :], axis=1))
        tl.store(out + 2 * BM, tl.sum(phi * k_sum[None, :], axis=1))

    @triton.jit
    def _projection(proj_ptr, b, which, BM: tl.constexpr, NC: tl.constexpr):
        """Φx summed over the feature chunks: ``which`` 0 the token's query, 1 block c's query sum, 2 its key sum."""
        offs_m = tl.arange(0, BM)
        total = tl.zeros([BM], dtype=tl.float32)
        for chunk in tl.static_range(NC):
            total += tl.load(proj_ptr + ((b * NC + chunk) * 3 + which) * BM + offs_m)
        return total

    @triton.jit
    def _logit_tile(qv, ks, causal, logit_scale, out_ptrs, part_ptrs):
        """One query sketch's logits over a tile of key sketches, stored with the tile's (max, Σ exp)."""
        logits = tl.where(causal, tl.sum(ks * qv[None, :], axis=1) * logit_scale, float("-inf"))
        tl.store(out_ptrs, logits)
        mx = tl.max(logits, axis=0)
        tl.store(part_ptrs, mx)
        tl.store(part_ptrs + 1, tl.sum(tl.exp(logits - tl.where(mx > float("-inf"), mx, 0.0)), axis=0))

    @triton.jit
    def _walk_gemv(b, t, s, lens_ptr, at_ptr, prev_ptr, g_ptr, n_pad, s_ab, s_ar, s_pb, BS: tl.constexpr,
                   BJ: tl.constexpr, BI: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr):
        """Split s of the rows of ``w_prev[:c] · Ã[:c]`` over the columns of tile t; rows i < j of Ã are zero
        in column j, so only rows from the tile's first column on are read."""
        _, c, _ = _block_position(lens_ptr, b, BS)
        j = t * BJ + tl.arange(0, BJ)
        acc = tl.zeros([BJ], dtype=tl.float32)
        lo = tl.maximum(s * ROWS, t * BJ).to(tl.int64)
        hi = tl.minimum((s + 1) * ROWS, c)
        for i0 in range(lo, hi, BI):
            rows = i0 + tl.arange(0, BI)
            r_ok = rows < hi
            p = tl.load(prev_ptr + b * s_pb + rows, mask=r_ok, other=0.0)
            a = tl.load(at_ptr + b * s_ab + rows[:, None] * s_ar + j[None, :], mask=r_ok[:, None], other=0.0)
            acc += tl.sum(p[:, None] * a, axis=0)
        tl.store(g_ptr + (b * SPLITS + s) * n_pad + j, acc)

    @triton.jit
    def _update_walk_kernel(q_ptr, k_ptr, lens_ptr, phi_ptr, qtok_ptr, qsum_ptr, ksum_ptr, proj_ptr,
                            at_ptr, prev_ptr, g_ptr, hq, hkv, m, n_pad,
                            s_qb, s_qh, s_kb, s_kh, s_kn, s_tb, s_tn, s_sb, s_sn, s_pm, s_ab, s_ar, s_pb,
                            BS: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BHK: tl.constexpr,
                            BM: tl.constexpr, NC: tl.constexpr, BJ: tl.constexpr, BI: tl.constexpr,
                            ROWS: tl.constexpr, SPLITS: tl.constexpr):
        # Programs (b, p < NC): the sketch update's feature chunk p. Programs (b, NC + t·SPLITS + s), walk
        # layers only: split s of the walk's GEMV over tile t. The GEMV reads only the previous layer's walk
        # and the Ã rows of completed blocks, nothing the update writes: in one launch the GEMV's read (the
        # step's largest) overlaps the update's dependent loads instead of waiting for them.
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        if p < NC:
            _sketch_update(b, p, q_ptr, k_ptr, lens_ptr, phi_ptr, qtok_ptr, qsum_ptr, ksum_ptr, proj_ptr, hq, hkv,
                           m, s_qb, s_qh, s_kb, s_kh, s_kn, s_tb, s_tn, s_sb, s_sn, s_pm, BS, BD, BH, BHK, BM, NC)
        else:
            _walk_gemv(b, (p - NC) // SPLITS, (p - NC) % SPLITS, lens_ptr, at_ptr, prev_ptr, g_ptr, n_pad,
                       s_ab, s_ar, s_pb, BS, BJ, BI, ROWS, SPLITS)

    @triton.jit
    def _softmax_stat(part_ptr, base, tiles, BT: tl.constexpr):
        """log Σ exp over the tiles' partials (tile 0 always holds block 0, so the max is finite)."""
        offs = tl.arange(0, BT)
        ok = offs < tiles
        mx = tl.load(part_ptr + (base + offs) * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
        total = tl.load(part_ptr + (base + offs) * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
        top = tl.max(mx, axis=0)
        return top + tl.log(tl.sum(total * tl.exp(mx - top), axis=0))

    @triton.jit
    def _store_pages(pages_ptr, npages_ptr, b, c, k, kmax, hkv, BK: tl.constexpr):
        """Every KV head's list but the chosen middle: block 0 first, block c at k − 1, 0 as padding."""
        offs_k = tl.arange(0, BK)
        ends = tl.where(offs_k == k - 1, c, 0).to(tl.int32)
        ends_ok = (offs_k < kmax) & ((offs_k == 0) | (offs_k >= k - 1))
        for h in range(hkv):
            tl.store(pages_ptr + (b * hkv + h) * kmax + offs_k, ends, mask=ends_ok)
            tl.store(npages_ptr + b * hkv + h, k.to(tl.int32))

    @triton.jit
    def _walk_tile(j, b, c, count, p_c, lse_t, lse_c, alpha, n, n_pad, logit_ptr, gs_ptr, prev_ptr, at_ptr,
                   s_ab, s_ar, s_pb, BS: tl.constexpr, MODE: tl.constexpr):
        """Columns ``j`` of the token's row ``ã`` and of the walk (unnormalised; 0 past n; ``gs_ptr`` the GEMV's
        splits summed by the tiles), and of block c's row of Ã, stored when the token completes the block."""
        ok = j < n
        a = tl.exp(alpha * (tl.load(logit_ptr + b * 2 * n_pad + j, mask=ok, other=float("-inf"),
                                    cache_modifier=".cg") - lse_t))
        if MODE == 1:
            w = p_c * a + tl.load(gs_ptr + b * n_pad + j, mask=ok, other=0.0)
        elif MODE == 2:
            w = tl.load(prev_ptr + b * s_pb + j, mask=ok, other=0.0) * a
        else:
            w = a
        a_c = tl.exp(alpha * (tl.load(logit_ptr + (b * 2 + 1) * n_pad + j, mask=ok, other=float("-inf"),
                                      cache_modifier=".cg") - lse_c))
        # the condition as a vector: Triton's interpreter rejects a mask that mixes in a scalar bool
        tl.store(at_ptr + b * s_ab + c * s_ar + j, a_c, mask=ok & (j * 0 + count == BS))
        return a, w

    @triton.jit
    def _walk_row(b, lens_ptr, proj_ptr, logit_ptr, part_ptr, gs_ptr, prev_ptr, ksk_ptr, at_ptr, w_ptr, rank_ptr,
                  pages_ptr, npages_ptr, m, n, n_pad, tiles, alpha, tie, rho_bits, kmax, hkv, s_kkb, s_kkn, s_ab,
                  s_ar, s_pb, BS: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr,
                  NC: tl.constexpr, MODE: tl.constexpr, WHOLE: tl.constexpr, BK: tl.constexpr, FIXED: tl.constexpr):
        """Row b's walk, its ranking and selection, once every tile's logits and partials are written."""
        _, c, count = _block_position(lens_ptr, b, BS)
        offs_m = tl.arange(0, BM)
        tl.store(ksk_ptr + b * s_kkb + c * s_kkn + offs_m, _projection(proj_ptr, b, 2, BM, NC) / count.to(tl.float32),
                 mask=offs_m < m)
        lse_t = _softmax_stat(part_ptr, b * 2 * tiles, tiles, BT)
        lse_c = _softmax_stat(part_ptr, (b * 2 + 1) * tiles, tiles, BT)
        if MODE == 1:
            p_c = tl.load(prev_ptr + b * s_pb + c)
        else:
            p_c = 0.0
        k = block_budget(rho_bits, c, n, FIXED)
        need = (k - 2).to(tl.int32)  # the blocks to choose among 1..c−1 (at most c − 1 of them)
        _store_pages(pages_ptr, npages_ptr, b, c, k, kmax, hkv, BK)
        first = pages_ptr + b * hkv * kmax + 1  # the chosen blocks' place in head 0's list
        if WHOLE:  # the row is one tile: w and ã stay in registers for the ranking and its top k − 2
            j = tl.arange(0, BJ)
            a, w = _walk_tile(j, b, c, count, p_c, lse_t, lse_c, alpha, n, n_pad, logit_ptr, gs_ptr, prev_ptr, at_ptr,
                              s_ab, s_ar, s_pb, BS, MODE)
            w = w / tl.maximum(tl.max(w, axis=0), FLOAT32_TINY)  # as normalize_rows
            tl.store(w_ptr + b * n + j, w, mask=j < n)
            middle = (j >= 1) & (j < c)
            u = ordered(tl.where(middle, w + tie * (a / tl.maximum(tl.max(a, axis=0), FLOAT32_TINY)),
                                  float("-inf")))
            if need > 0:  # ties to the lower block; pos ascends with the block, as the list wants
                sel, pos = chosen_regs(u, middle, middle, need)
                for h in range(hkv):
                    tl.store(first + h * kmax + pos, j.to(tl.int32), mask=sel)
        else:
            w_max = tl.zeros([], dtype=tl.float32)
            a_max = tl.zeros([], dtype=tl.float32)
            for j0 in range(0, n, BJ):  # pass 1: the walk (unnormalised), the maxima, block c's row of Ã
                j = j0 + tl.arange(0, BJ)
                a, w = _walk_tile(j, b, c, count, p_c, lse_t, lse_c, alpha, n, n_pad, logit_ptr, gs_ptr, prev_ptr,
                                  at_ptr, s_ab, s_ar, s_pb, BS, MODE)
                tl.store(w_ptr + b * n + j, w, mask=j < n)
                w_max = tl.maximum(w_max, tl.max(w, axis=0))
                a_max = tl.maximum(a_max, tl.max(a, axis=0))
            w_max = tl.maximum(w_max, FLOAT32_TINY)
            a_max = tl.maximum(a_max, FLOAT32_TINY)
            tl.debug_barrier()  # pass 2 reads what other threads of this program stored in pass 1
            row = rank_ptr + b * n
            for j0 in range(0, n, BJ):  # pass 2: normalise; the ranking score over blocks 1..c−1
                j = j0 + tl.arange(0, BJ)
                ok = j < n
                a = tl.exp(alpha * (tl.load(logit_ptr + b * 2 * n_pad + j, mask=ok, other=float("-inf"),
                                            cache_modifier=".cg") - lse_t))
                w = tl.load(w_ptr + b * n + j, mask=ok, other=0.0) / w_max
                tl.store(w_ptr + b * n + j, w, mask=ok)
                tl.store(row + j, tl.where((j >= 1) & (j < c), w + tie * (a / a_max), float("-inf")), mask=ok)
            tl.debug_barrier()  # the select reads the ranking row back
            if need > 0:
                hi, lo, _ = value_range(row, n, BJ)
                thr, ties = radix_select(row, n, need, hi, lo, 32, BJ)
                # the chosen blocks in block order into head 0's list (ties to the lower block), then copied
                emit_selected(row, row, n, thr, ties, first, False, BJ)
                tl.debug_barrier()  # the copy reads what other threads stored
                offs_k = tl.arange(0, BK)
                chosen = tl.load(first + offs_k, mask=offs_k < need)
                for h in range(1, hkv):
                    tl.store(first + h * kmax + offs_k, chosen, mask=offs_k < need)

    @triton.jit
    def _scores_select_kernel(lens_ptr, ksk_ptr, proj_ptr, logit_ptr, part_ptr, tk_ptr, g_ptr, gs_ptr, prev_ptr,
                              at_ptr, w_ptr, rank_ptr, pages_ptr, npages_ptr, m, n, n_pad, tiles, logit_scale, alpha,
                              tie, rho_bits, kmax, hkv, s_kkb, s_kkn, s_ab, s_ar, s_pb,
                              BS: tl.constexpr, BJ: tl.constexpr, BM: tl.constexpr, NC: tl.constexpr,
                              ROW: tl.constexpr, BT: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                              MODE: tl.constexpr, WHOLE: tl.constexpr, BK: tl.constexpr, FIXED: tl.constexpr):
        # Program (b, t): the sketched logits of key blocks j of tile t, with the tile's softmax partials;
        # the last of row b's programs to finish (a ticket counter it resets) then runs the row's walk and
        # selection on all tiles' results: no launch of its own (the counter orders, nothing is summed
        # in arrival order, so a replay still equals an eager call bit for bit).
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1)
        _, c, count = _block_position(lens_ptr, b, BS)
        j = t * BJ + tl.arange(0, BJ)
        offs_m = tl.arange(0, BM)
        ks = tl.load(ksk_ptr + b * s_kkb + j[:, None] * s_kkn + offs_m[None, :],
                     mask=(j < c)[:, None] & (offs_m < m)[None, :], other=0.0)
        k_c = _projection(proj_ptr, b, 2, BM, NC) / count.to(tl.float32)  # block c's sketch, not yet stored
        ks = tl.where((j == c)[:, None], k_c[None, :], ks)
        causal = j <= c
        # row 0: the token's query; row 1: block c's mean query
        _logit_tile(_projection(proj_ptr, b, 0, BM, NC), ks, causal, logit_scale,
                    logit_ptr + b * 2 * n_pad + j, part_ptr + (b * 2 * tiles + t) * 2)
        _logit_tile(_projection(proj_ptr, b, 1, BM, NC) / count.to(tl.float32), ks, causal, logit_scale,
                    logit_ptr + (b * 2 + 1) * n_pad + j, part_ptr + ((b * 2 + 1) * tiles + t) * 2)
        if MODE == 1:
            # The GEMV's row splits summed here, per tile, so that the row's serial tail reads one row of
            # partial walks whatever the split count (at 128k: 32 rows of 2,048 columns otherwise).
            offs_s = tl.arange(0, SPLITS_P)
            g = tl.load(g_ptr + (b * SPLITS + offs_s[:, None]) * n_pad + j[None, :],
                        mask=(offs_s < SPLITS)[:, None], other=0.0)
            tl.store(gs_ptr + b * n_pad + j, tl.sum(g, axis=0))

        # every thread's stores precede the release; the acquire of the last program sees them all
        tl.debug_barrier()
        ticket = tl.atomic_add(tk_ptr + b, 1, sem="acq_rel", scope="gpu")
        if ticket == tiles - 1:
            tl.atomic_xchg(tk_ptr + b, 0)
            _walk_row(b, lens_ptr, proj_ptr, logit_ptr, part_ptr, gs_ptr, prev_ptr, ksk_ptr, at_ptr, w_ptr, rank_ptr,
                      pages_ptr, npages_ptr, m, n, n_pad, tiles, alpha, tie, rho_bits, kmax, hkv, s_kkb, s_kkn,
                      s_ab, s_ar, s_pb, BS, ROW, BT, BM, NC, MODE, WHOLE, BK, FIXED)

def _prev_pow2(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def sketch_walk_select(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *, q_tok: torch.Tensor,
                       q_sum: torch.Tensor, k_sum: torch.Tensor, k_sketch: torch.Tensor, a_tilde: torch.Tensor,
                       phi: torch.Tensor, n_blocks: int, block_size: int, logit_scale: float, alpha: float,
                       mode: str, previous: torch.Tensor | None, density: float, fixed_k: bool,
                       kmax: int, tie: float, tile_cols: int | None = None,
                       split_rows: int | None = None,
                       row_tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step's state update and selection, in place on the layer's state.

    ``q [B, Hq, d]``, ``k [B, Hkv, N, d]`` (the cache), ``lengths [B]`` int32 (row b's new token is at
    ``lengths[b] − 1``); the state tensors are float32 (``q_tok [B, ≥N, d]``, ``q_sum``/``k_sum
    [B, ≥n, d]``, ``k_sketch [B, ≥n, m]``, ``a_tilde [B, ≥n, ≥n]``, last dim contiguous), ``phi [m, d]``
    the SRHT; ``n_blocks`` = ⌈N / block_size⌉; ``mode`` one of :data:`MODES` (``walk``/``diagonal`` need
    ``previous [B, n]``, the walk of the previous sparse layer); ``kmax`` the largest budget
    (``max_block_budget``); ``tie`` the one-hop score's weight in the ranking; ``tile_cols``/``split_rows``
    (powers of two ≥ 16) override the GEMV's tiling and ``row_tile`` (one too) the walk row's (tests use them
    to run several tiles at small n, and the select over memory that rows past 2048 blocks take).

    Returns ``(w [B, n] float32, pages [B, Hkv, kmax] int32, n_pages [B, Hkv] int32)``: the normalised
    walk and the selected blocks (ascending, block 0 first and block c last, padding 0)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    m = phi.shape[0]
    n = n_blocks
    dev = q.device
    f32 = torch.float32
    for name, t in (("q_tok", q_tok), ("q_sum", q_sum), ("k_sum", k_sum), ("k_sketch", k_sketch),
                    ("a_tilde", a_tilde), ("phi", phi)):
        if t.dtype != f32 or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected float32 with a contiguous last dim, got {t.dtype}, "
                             f"strides {t.stride()}")
    if k_sum.stride()[:2] != q_sum.stride()[:2]:
        raise ValueError("k_sum, q_sum: expected the same strides")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k: expected a contiguous last dim")
    if d & (d - 1) or d < 16:
        raise ValueError(f"q: head dim {d} (the sketch kernels take a power of two ≥ 16)")
    if lengths.dtype != torch.int32:
        raise ValueError(f"lengths: expected int32, got {lengths.dtype}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {sorted(MODES)}, got {mode!r}")
    walk_mode = MODES[mode] if previous is not None else 0
    if walk_mode and (previous.shape != (b, n) or previous.dtype != f32 or previous.stride(-1) != 1):
        raise ValueError(f"previous: expected float32 [{b}, {n}] with a contiguous last dim, got "
                         f"{previous.dtype} {tuple(previous.shape)}")
    bs = block_size
    bm, bhk = next_pow2(m), next_pow2(hkv)
    # Feature chunks small enough that one chunk of the block's keys (Hkv·B rows) is one 16k-element tile.
    bd = min(d, 64, max(16, _prev_pow2(16384 // (bhk * bs))))
    nc = d // bd
    # Key-block tiles of up to 64 columns (256-byte rows of Ã) and 64-row splits of the walk's GEMV, the
    # step's largest read (Ã's causal half: 8 MB at 128k tokens): each program one 16 KB tile, every tile in
    # flight at once (1,024 programs at 128k; 256-row splits, 4 dependent steps each, took 11.0 against
    # 8.2 µs on the H200). The scores kernel's tiles sum the splits, so their count costs the tail nothing.
    bj = tile_cols or min(64, max(16, next_pow2(-(-n // 16))))
    rows = split_rows or 64
    for name, x in (("tile_cols", bj), ("split_rows", rows)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {x}")
    tiles = -(-n // bj)
    n_pad = tiles * bj
    bi = min(64, rows)
    splits = -(-n // rows)
    proj = torch.empty(b, nc, 3, bm, device=dev, dtype=f32)
    logits = torch.empty(b, 2, n_pad, device=dev, dtype=f32)
    parts = torch.empty(b, 2, tiles, 2, device=dev, dtype=f32)
    g = torch.empty(b, splits, n_pad, device=dev, dtype=f32) if walk_mode == 1 else logits
    g_sum = torch.empty(b, n_pad, device=dev, dtype=f32) if walk_mode == 1 else logits
    w = torch.empty(b, n, device=dev, dtype=f32)
    prev = previous if walk_mode else w  # an unread stand-in
    gemv = tiles * splits if walk_mode == 1 else 0
    launch(_update_walk_kernel, (b, nc + gemv), q, k, lengths, phi, q_tok, q_sum, k_sum, proj, a_tilde, prev, g,
           hq, hkv, m, n_pad, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), q_tok.stride(0),
           q_tok.stride(1), q_sum.stride(0), q_sum.stride(1), phi.stride(0), a_tilde.stride(0), a_tilde.stride(1),
           prev.stride(0), BS=bs, BD=bd, BH=next_pow2(hq), BHK=bhk, BM=bm, NC=nc, BJ=bj, BI=bi, ROWS=rows,
           SPLITS=splits, num_warps=8 if bhk * bs * bd > 4096 else 4)
    # The last program of each row reads the row's partials, writes w and selects: the row whole in one tile up to
    # 2048 blocks (128k tokens of 64), so the ranking and its radix select stay in registers; longer rows
    # (or a smaller row_tile) go over memory in tiles.
    row_tile = row_tile or min(2048, max(16, next_pow2(n)))
    if row_tile < 16 or row_tile & (row_tile - 1):
        raise ValueError(f"row_tile: expected a power of two >= 16, got {row_tile}")
    whole = n <= row_tile
    rank = w if whole else torch.empty(b, n, device=dev, dtype=f32)  # whole rows rank in registers
    pages = torch.empty(b, hkv, kmax, device=dev, dtype=torch.int32)
    n_pages = torch.empty(b, hkv, device=dev, dtype=torch.int32)
    tickets = workspace("sketchwalk_tickets", q, b, torch.int32, zeroed=True)
    launch(_scores_select_kernel, (b, tiles), lengths, k_sketch, proj, logits, parts, tickets, g, g_sum, prev,
           a_tilde, w, rank, pages, n_pages, m, n, n_pad, tiles, float(logit_scale), float(alpha), float(tie),
           float_bits(density), kmax, hkv, k_sketch.stride(0), k_sketch.stride(1), a_tilde.stride(0),
           a_tilde.stride(1), prev.stride(0),
           BS=bs, BJ=bj, BM=bm, NC=nc, ROW=row_tile, BT=next_pow2(tiles), SPLITS=splits,
           SPLITS_P=max(2, next_pow2(splits)), MODE=walk_mode, WHOLE=whole,
           BK=next_pow2(max(kmax, 2)), FIXED=bool(fixed_k), num_warps=8 if row_tile >= 1024 else 4)
    return w, pages, n_pages
