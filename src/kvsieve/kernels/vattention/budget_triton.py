"""vAttention's budget statistics in one Triton launch.

``methods/vattention.VAttention.budget`` (the reference) gathers the K rows of the deterministic set
(sink, window, predicted top-k) and of the base sample, computes their float64 logits, shifts by the
largest, and sums ``e^s`` (``D̂``), the base sample's spread (``σ̂``) and, for ``bound=full``, the
numerator's plug-in ``N̂ = Σ_f e^s v + (n_s/n_b) Σ_b e^s v`` and ``Tr Σ̂`` of ``e^s v`` over the base
sample: ~40 torch launches. Here two launches do the same in float64: ``splits`` programs per (row,
query head) (~528 in all: one program per head would loop over every key at 32 programs) each
take a share of the sink range, the window range, the top-k list and the base list, read each entry once
and keep their sums around a running max (rescaled as it grows) and spreads around their running mean
(each block's spread around its own mean merged by Chan's update, not ``Σx² − (Σx)²/n``; the base rows'
``e^s v`` in one gather of their V rows); one program per (row, query head) rescales them to the row's max and
merges the spreads (Chan et al.). Float64 sums in another order than the reference's: equal to ~1e-15
relative (the tests hold the budgets to 1e-12 and their integer ceilings to equality).
Its torch twin is the method's ``budget`` (the tests compare the kernel path's budgets with the
reference's); what follows the statistics (the (ε, δ) formula) stays in torch, on ``[R, Hq]`` values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..shared.select_common import check_launch_value, sm_count
from ..shared.triton_utils import cdiv, float64_constants, is_interpreted, launch, next_pow2, triton, workspace

#: programs of the statistics launch per SM: each (row, query head) is cut into ``⌊SPLITS_PER_SM · SMs / (rows ·
#: heads)⌋`` splits. The launch takes 224+ registers a thread, so 2 programs an SM are one wave: on the H200 (Llama
#: 32/8/128, peaked) 128.0 µs at 128k batch 1 and 240.2 at 32k batch 8, against 179.5 / 265.7 at 528 programs
#: (docs/results/gpu-bench/2026-11-29-h200-vattention-stage-ways-128k.md, -32k-b8.md). Read at call time.
SPLITS_PER_SM = 2
#: entries per block of the statistics launch's loops (head dim ≤ 128; half beyond) and its warps: each loop
#: step waits on a gather, so larger blocks mean fewer steps and more registers. Read at call time
#: (``benchmarks/breakdown/stages.py`` times 64 at 8 warps).
PARTS_BLOCK = 32
PARTS_WARPS = 4

if triton is not None:
    import triton.language as tl

    from ..shared.triton_utils import dense_range

    @triton.jit
    def _segment_positions(lst, seg_lo, j, ok, IS_LIST: tl.constexpr):
        """Cache positions of a segment's entries ``j`` (masked by ``ok``)."""
        if IS_LIST:
            pos = tl.load(lst + j, mask=ok, other=0)
        else:
            pos = seg_lo + j
        return pos

    @triton.jit
    def _split_range(n_seg, s, splits):
        """Split ``s``'s share ``[lo, hi)`` of a segment's ``n_seg`` entries (``ceil(n_seg / splits)`` each)."""
        c = (n_seg + splits - 1) // splits
        lo = tl.minimum(s * c, n_seg)
        return lo, tl.minimum(lo + c, n_seg)

    @triton.jit
    def _block_loads(k_base, s_k_n, v_base, s_v_n, l_base, lst, seg_lo, j, ok, IS_LIST: tl.constexpr,
                     KEPT: tl.constexpr, FULL: tl.constexpr, D: tl.constexpr):
        """What a segment's entries ``j`` (masked by ``ok``) read: their raw logits (the kept float32 scores
        ``l_base`` if ``KEPT``, else K's rows) and (``FULL``) V's rows, as loaded."""
        pos = _segment_positions(lst, seg_lo, j, ok, IS_LIST).to(tl.int64)
        offs_d = tl.arange(0, D)
        if KEPT:
            raw = tl.load(l_base + pos, mask=ok, other=0.0)
        else:
            raw = tl.load(k_base + pos[:, None] * s_k_n + offs_d[None, :], mask=ok[:, None], other=0.0)
        if FULL:
            vr = tl.load(v_base + pos[:, None] * s_v_n + offs_d[None, :], mask=ok[:, None], other=0.0)
        else:
            vr = raw  # unused
        return raw, vr

    @triton.jit
    def _block_logits(q, raw, ok, scale, KEPT: tl.constexpr):
        """Float64 logits (−inf off ``ok``) from :func:`_block_loads`' raw logits."""
        if KEPT:
            s = raw.to(tl.float64)
        else:
            s = tl.sum(raw.to(tl.float64) * q[None, :], 1) * scale
        return tl.where(ok, s, float("-inf"))

    @triton.jit
    def _rescale(m, s):
        """The running max after a block of logits ``s``, its shift (0 while nothing is finite) and the factor
        ``e^(m − m_new)`` that brings sums around the old max to the new one."""
        m_new = tl.maximum(m, tl.max(s, 0))
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        return m_new, shift, tl.exp(m - shift)

    @triton.jit
    def _online_fixed(q, k_base, s_k_n, v_base, s_v_n, l_base, lst, seg_lo, j_lo, j_hi, scale, m, d_f, acc_f,
                      IS_LIST: tl.constexpr, KEPT: tl.constexpr, FULL: tl.constexpr, BLOCK: tl.constexpr,
                      D: tl.constexpr):
        """One pass over entries ``[j_lo, j_hi)`` of a deterministic segment: ``Σ e`` and (``FULL``) ``Σ e v``
        around the running max ``m``, rescaled as it grows. Each step issues the next block's loads before its
        own sums, so that their latency overlaps them."""
        offs = tl.arange(0, BLOCK)
        ok = j_lo + offs < j_hi
        raw, vr = _block_loads(k_base, s_k_n, v_base, s_v_n, l_base, lst, seg_lo, j_lo + offs, ok, IS_LIST, KEPT,
                               FULL, D)
        for j0 in range(j_lo, j_hi, BLOCK):
            ok_n = j0 + BLOCK + offs < j_hi
            raw_n, vr_n = _block_loads(k_base, s_k_n, v_base, s_v_n, l_base, lst, seg_lo, j0 + BLOCK + offs, ok_n,
                                       IS_LIST, KEPT, FULL, D)
            s = _block_logits(q, raw, ok, scale, KEPT)
            m, shift, c = _rescale(m, s)
            e = tl.where(ok, tl.exp(s - shift), 0.0)
            d_f = d_f * c + tl.sum(e, 0)
            if FULL:
                acc_f = acc_f * c + tl.sum(e[:, None] * vr.to(tl.float64), 0)
            ok, raw, vr = ok_n, raw_n, vr_n
        return m, d_f, acc_f

    @triton.jit
    def _store_record(o, m, d_f, s_b, nb, m2, lo, hi):
        """A split's record (``_budget_parts_kernel``): its max, ``Σ_f e``, ``Σ_b e``, base entries, their
        spread, min and max."""
        tl.store(o, m)
        tl.store(o + 1, d_f)
        tl.store(o + 2, s_b)
        tl.store(o + 3, nb)
        tl.store(o + 4, m2)
        tl.store(o + 5, lo)
        tl.store(o + 6, hi)

    @triton.jit
    def _store_full(o, tr, acc_f, acc_b, D: tl.constexpr):
        """The record's ``bound=full`` tail: ``Σ ‖e v − mean‖²``, ``Σ_f e v``, ``Σ_b e v``."""
        offs_d = tl.arange(0, D)
        tl.store(o + 7, tr)
        tl.store(o + 8 + offs_d, acc_f)
        tl.store(o + 8 + D + offs_d, acc_b)

    @triton.jit
    def _online_parts(o, q, k_base, s_k_n, v_base, s_v_n, l_base, top, base, start, end, a0, a1, w0, w1, t0, t1,
                      b0, b1, scale, FULL: tl.constexpr, KEPT: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
        """:func:`_budget_parts_kernel`'s record in one pass over each segment (no logits workspace, one
        exponential per entry): every sum kept around the running max and multiplied by ``e^(m_old − m_new)``
        when it grows (squared for the spreads); the base sample's spreads merged block by block (Chan)."""
        offs = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float64)
        d_f = tl.zeros([], tl.float64)
        acc_f = tl.zeros([D], tl.float64)
        m, d_f, acc_f = _online_fixed(q, k_base, s_k_n, v_base, s_v_n, l_base, top, 0, a0, a1, scale, m, d_f, acc_f,
                                      False, False, FULL, BLOCK, D)
        m, d_f, acc_f = _online_fixed(q, k_base, s_k_n, v_base, s_v_n, l_base, top, end, w0, w1, scale, m, d_f,
                                      acc_f, False, False, FULL, BLOCK, D)
        m, d_f, acc_f = _online_fixed(q, k_base, s_k_n, v_base, s_v_n, l_base, top, 0, t0, t1, scale, m, d_f, acc_f,
                                      True, KEPT, FULL, BLOCK, D)
        s_b = tl.zeros([], tl.float64)
        nb = tl.zeros([], tl.float64)
        mean_b = tl.zeros([], tl.float64)
        m2 = tl.zeros([], tl.float64)
        lo = tl.full([], float("inf"), tl.float64)
        hi = tl.full([], float("-inf"), tl.float64)
        acc_b = tl.zeros([D], tl.float64)
        mean_r = tl.zeros([D], tl.float64)
        tr = tl.zeros([], tl.float64)
        ok = b0 + offs < b1
        raw, vr = _block_loads(k_base, s_k_n, v_base, s_v_n, l_base, base, 0, b0 + offs, ok, True, KEPT, FULL, D)
        for j0 in range(b0, b1, BLOCK):
            ok_n = j0 + BLOCK + offs < b1
            raw_n, vr_n = _block_loads(k_base, s_k_n, v_base, s_v_n, l_base, base, 0, j0 + BLOCK + offs, ok_n,
                                       True, KEPT, FULL, D)
            s = _block_logits(q, raw, ok, scale, KEPT)
            m, shift, c = _rescale(m, s)
            e = tl.where(ok, tl.exp(s - shift), 0.0)
            d_f = d_f * c
            n_blk = tl.sum(ok.to(tl.float64), 0)
            s_blk = tl.sum(e, 0)
            mu_blk = s_blk / n_blk  # every block of the loop holds an entry
            dev = tl.where(ok, e - mu_blk, 0.0)
            n_new = nb + n_blk
            mean_b = mean_b * c
            delta = mu_blk - mean_b
            m2 = m2 * c * c + tl.sum(dev * dev, 0) + delta * delta * (nb * n_blk / n_new)
            mean_b += delta * (n_blk / n_new)
            s_b = s_b * c + s_blk
            lo = tl.minimum(tl.where(nb > 0, lo * c, float("inf")), tl.min(tl.where(ok, e, float("inf")), 0))
            hi = tl.maximum(tl.where(nb > 0, hi * c, float("-inf")), tl.max(tl.where(ok, e, float("-inf")), 0))
            if FULL:
                acc_f = acc_f * c
                rv = e[:, None] * vr.to(tl.float64)
                sv_blk = tl.sum(rv, 0)
                mu_v = sv_blk / n_blk
                dv = tl.where(ok[:, None], rv - mu_v[None, :], 0.0)
                mean_r = mean_r * c
                delta_v = mu_v - mean_r
                tr = tr * c * c + tl.sum(tl.sum(dv * dv, 1), 0) + tl.sum(delta_v * delta_v, 0) * (nb * n_blk / n_new)
                mean_r += delta_v * (n_blk / n_new)
                acc_b = acc_b * c + sv_blk
            nb = n_new
            ok, raw, vr = ok_n, raw_n, vr_n
        _store_record(o, m, d_f, s_b, nb, m2, lo, hi)
        if FULL:
            _store_full(o, tr, acc_f, acc_b, D)

    @triton.jit
    def _budget_parts_kernel(q_ptr, k_ptr, v_ptr, start_ptr, end_ptr, len_ptr, top_ptr, tc_ptr, base_ptr, bc_ptr,
                             part_ptr, scale_ptr, l_ptr, hq, group, hs_div, splits,
                             s_q_r, s_q_h, s_k_r, s_k_h, s_k_n, s_v_r, s_v_h, s_v_n,
                             s_t_r, s_t_h, s_b_r, s_b_h, s_c_r, s_c_h, s_bc_r, s_bc_h, s_l_r, s_l_h,
                             FULL: tl.constexpr, KEPT: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                             W: tl.constexpr):
        """Split ``s`` of (row, query head): ``1/splits`` of each segment (sink, window, top-k list, base list),
        each once, every sum around its running max ``m_s`` (:func:`_online_parts`); it stores ``m_s``, ``Σ_f e``,
        ``Σ_b e``, its base entries, their ``Σ (e − mean_s)²``, min and max, and (``FULL``) ``Σ ‖e v − mean_s‖²``,
        ``Σ_f e v``, ``Σ_b e v``: the combine launch rescales them to the row's max (Chan's merge)."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.program_id(2).to(tl.int64)
        kvh = h // group
        sh = h // hs_div  # the selection head of this query head
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + r * s_q_r + h * s_q_h + offs_d).to(tl.float64)
        scale = tl.load(scale_ptr)  # float64: a Python float argument would be float32
        k_base = k_ptr + r * s_k_r + kvh * s_k_h
        v_base = v_ptr + r * s_v_r + kvh * s_v_h
        l_base = l_ptr + r * s_l_r + h * s_l_h
        start = tl.load(start_ptr + r).to(tl.int32)
        end = tl.load(end_ptr + r).to(tl.int32)
        length = tl.load(len_ptr + r).to(tl.int32)
        top = top_ptr + r * s_t_r + sh * s_t_h
        base = base_ptr + r * s_b_r + sh * s_b_h
        tc = tl.load(tc_ptr + r * s_c_r + sh * s_c_h).to(tl.int32)
        bc = tl.load(bc_ptr + r * s_bc_r + sh * s_bc_h).to(tl.int32)
        a0, a1 = _split_range(start, s, splits)
        w0, w1 = _split_range(length - end, s, splits)
        t0, t1 = _split_range(tc, s, splits)
        b0, b1 = _split_range(bc, s, splits)
        _online_parts(part_ptr + ((r * hq + h) * splits + s) * W, q, k_base, s_k_n, v_base, s_v_n, l_base, top,
                      base, start, end, a0, a1, w0, w1, t0, t1, b0, b1, scale, FULL, KEPT, BLOCK, D)

    @triton.jit
    def _combine_head(part_ptr, out_ptr, r, h, hq, splits, bc, n_s, FULL: tl.constexpr, SP: tl.constexpr,
                      D: tl.constexpr, W: tl.constexpr):
        """The statistics of (row, query head) from its splits' partials: each split's sums rescaled by
        ``c_s = e^(m_s − m)`` to the row's max ``m``; the spreads by Chan's merge,
        ``Σ c_s² M2_s + Σ n_s (c_s mean_s − mean)²`` (two-pass accuracy, no ``Σx² − (Σx)²/n``). Stored
        to ``out[r, h]`` and returned as ``(D̂, σ̂, ‖N̂‖, Tr Σ̂, range)``."""
        so = tl.arange(0, SP)
        sm = so < splits
        rec = part_ptr + ((r * hq + h) * splits + so) * W
        m_s = tl.load(rec, mask=sm, other=float("-inf"))
        m = tl.max(m_s, 0)
        shift = tl.where(m > float("-inf"), m, 0.0)
        c = tl.where(m_s > float("-inf"), tl.exp(m_s - shift), 0.0)
        d_f = tl.sum(c * tl.load(rec + 1, mask=sm, other=0.0), 0)
        sb_s = c * tl.load(rec + 2, mask=sm, other=0.0)
        nb_s = tl.load(rec + 3, mask=sm, other=0.0)
        has = nb_s > 0
        s_b = tl.sum(sb_s, 0)
        lo = tl.min(tl.where(has, c * tl.load(rec + 5, mask=sm, other=0.0), float("inf")), 0)
        hi = tl.max(tl.where(has, c * tl.load(rec + 6, mask=sm, other=0.0), float("-inf")), 0)
        nb = bc.to(tl.float64)
        ratio = n_s / tl.maximum(nb, 1.0)
        mean_b = s_b / tl.maximum(nb, 1.0)
        dm = sb_s / tl.maximum(nb_s, 1.0) - mean_b
        m2 = tl.sum(c * c * tl.load(rec + 4, mask=sm, other=0.0) + tl.where(has, nb_s * dm * dm, 0.0), 0)
        var = m2 / (tl.maximum(nb, 2.0) - 1.0)
        d_hat = d_f + ratio * s_b
        sigma = tl.sqrt(var)
        rng = tl.where(bc > 0, hi - lo, 0.0)
        n_norm = tl.zeros([], tl.float64)
        tr = tl.zeros([], tl.float64)
        if FULL:
            offs_d = tl.arange(0, D)
            acc_f = tl.sum(c[:, None] * tl.load(rec[:, None] + 8 + offs_d[None, :], mask=sm[:, None], other=0.0), 0)
            accb_s = c[:, None] * tl.load(rec[:, None] + 8 + D + offs_d[None, :], mask=sm[:, None], other=0.0)
            acc_b = tl.sum(accb_s, 0)
            n_hat = acc_f + ratio * acc_b
            mean_r = acc_b / tl.maximum(nb, 1.0)
            dr = accb_s / tl.maximum(nb_s, 1.0)[:, None] - mean_r[None, :]
            tr = tl.sum(c * c * tl.load(rec + 7, mask=sm, other=0.0) + tl.where(has, nb_s * tl.sum(dr * dr, 1), 0.0),
                        0) / (tl.maximum(nb, 2.0) - 1.0)
            n_norm = tl.sqrt(tl.sum(n_hat * n_hat, 0))
        o = out_ptr + (r * hq + h) * 5
        tl.store(o, d_hat)
        tl.store(o + 1, sigma)
        tl.store(o + 2, n_norm)
        tl.store(o + 3, tr)
        tl.store(o + 4, rng)
        return d_hat, sigma, n_norm, tr, rng

    @triton.jit
    def _budget_formula(d_hat, sigma, n_norm, tr, rng, n_s, c_ptr, n_grid, RULE: tl.constexpr, GP: tl.constexpr):
        """vAttention's sample size before rounding (``methods/vattention``'s ``clt_budget``,
        ``full_budget``, ``hoeffding_budget``, then ``nan_to_num``), float64 in the reference's order of
        operations, its constants from ``c_ptr`` (:func:`budget_constants`). RULE 1: CLT on the
        denominator; 2: Theorem 4.3's min over the ``(ε', δ')`` grid; 3: Hoeffding."""
        if RULE == 1:
            b = tl.load(c_ptr) * n_s * sigma / (tl.load(c_ptr + 3) * d_hat)
            b = b * b
        elif RULE == 2:
            gi = tl.arange(0, GP)
            ok = gi < n_grid
            grid_ptr = c_ptr + 4
            e_d = tl.load(grid_ptr + gi, mask=ok, other=1.0)
            e_n = tl.load(grid_ptr + n_grid + gi, mask=ok, other=1.0)
            z_d = tl.load(grid_ptr + 2 * n_grid + gi, mask=ok, other=0.0)
            z_n = tl.load(grid_ptr + 3 * n_grid + gi, mask=ok, other=0.0)
            b_d = z_d[None, :] * n_s * sigma / (e_d[:, None] * d_hat)  # rows ε', columns δ'
            b_d = b_d * b_d
            b_n = z_n[None, :] * n_s * tl.sqrt(tr) / (e_n[:, None] * n_norm)
            b_n = b_n * b_n
            cell = tl.where((b_d != b_d) | (b_n != b_n), float("nan"), tl.maximum(b_d, b_n))  # torch.maximum: NaN wins
            live = ok[:, None] & ok[None, :]
            any_nan = tl.max(tl.max((live & (cell != cell)).to(tl.int32), 1), 0)
            b = tl.min(tl.min(tl.where(live, cell, float("inf")), 1), 0)
            b = tl.where(any_nan > 0, float("nan"), b)  # amin propagates NaN, nan_to_num makes it 0
        else:
            b = n_s * n_s * (rng * rng) * tl.load(c_ptr + 1) / (tl.load(c_ptr + 2) * (d_hat * d_hat))
        return tl.where(b != b, 0.0, b)

    @triton.jit
    def _budget_combine_kernel(part_ptr, bc_ptr, ns_ptr, tc_ptr, out_ptr, b_ptr, bi_ptr, cnt_ptr, c_ptr,
                               hq, hs_div, splits, n_keys, n_grid,
                               s_bc_r, s_bc_h, s_ns_r, s_ns_h, s_tc_r, s_tc_h,
                               FULL: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                               RULE: tl.constexpr, GP: tl.constexpr, FLOOR_BASE: tl.constexpr):
        """One program per (row, selection head): the statistics of its ``hs_div`` query heads
        (:func:`_combine_head`) and, with a RULE (> 0), the sample size: the max of their budgets
        (:func:`_budget_formula`; a KV head keeps every query head's budget), capped at ``n_keys``,
        rounded up, clamped to ``[floor, n_s]`` (floor 1, or the base sample's size), and the list's count
        ``top_counts + size`` — what ``VAttention.stages`` computes in ~20 torch launches."""
        sh = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        bc = tl.load(bc_ptr + r * s_bc_r + sh * s_bc_h).to(tl.int32)
        n_s_i = tl.load(ns_ptr + r * s_ns_r + sh * s_ns_h)
        n_s = n_s_i.to(tl.float64)
        b = tl.full([], float("-inf"), tl.float64)
        for g in range(0, hs_div):
            h = sh * hs_div + g
            d_hat, sigma, n_norm, tr, rng = _combine_head(part_ptr, out_ptr, r, h, hq, splits, bc, n_s, FULL, SP, D, W)
            if RULE > 0:
                b = tl.maximum(b, _budget_formula(d_hat, sigma, n_norm, tr, rng, n_s, c_ptr, n_grid, RULE, GP))
        if RULE > 0:
            hs = tl.num_programs(0)
            tl.store(b_ptr + r * hs + sh, b)
            b_int = tl.ceil(tl.minimum(b, tl.full([], n_keys, tl.int64).to(tl.float64))).to(tl.int64)
            if FLOOR_BASE:
                b_int = tl.maximum(b_int, bc.to(tl.int64))
            else:
                b_int = tl.maximum(b_int, 1)
            b_int = tl.minimum(b_int, n_s_i.to(tl.int64))
            tl.store(bi_ptr + r * hs + sh, b_int)
            tc = tl.load(tc_ptr + r * s_tc_r + sh * s_tc_h).to(tl.int64)
            tl.store(cnt_ptr + r * hs + sh, tc + b_int)

    @triton.jit
    def _residual_setup_kernel(pages_ptr, pcnt_ptr, lens_ptr, idx_ptr, w_ptr, tc_ptr, excl_ptr, start_ptr, end_ptr,
                               ns_ptr, nb_ptr, rate_ptr, sink, window, hs, n_pages, s_p_r, s_p_h, s_pc_r, s_pc_h,
                               s_i_r, s_i_h, page, HAS_TOP: tl.constexpr, PP: tl.constexpr, CH: tl.constexpr,
                               BLOCK: tl.constexpr):
        h = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        length, start, end = dense_range(lens_ptr, r, sink, window)
        if h == 0:  # every head of the row has the same range: one program writes it
            tl.store(start_ptr + r, start.to(tl.int64))
            tl.store(end_ptr + r, end.to(tl.int64))
        written = tl.zeros([], tl.int32)
        if HAS_TOP:
            pc = tl.load(pcnt_ptr + r * s_pc_r + h * s_pc_h).to(tl.int32)
            xrow = excl_ptr + (r * hs + h) * n_pages
            offs = tl.arange(0, BLOCK)
            for p0 in range(0, n_pages, BLOCK):
                tl.store(xrow + p0 + offs, tl.zeros([BLOCK], tl.int8), mask=p0 + offs < n_pages)
            tl.debug_barrier()  # the marks below land on zeros written by other threads
            prow = pages_ptr + r * s_p_r + h * s_p_h
            irow = idx_ptr + r * s_i_r + h * s_i_h
            wrow = w_ptr + r * s_i_r + h * s_i_h
            ch = tl.arange(0, CH)
            tok = tl.arange(0, PP)
            for j0 in range(0, pc, CH):
                j = j0 + ch
                ok = j < pc
                pg = tl.load(prow + j, mask=ok, other=0)
                tl.store(xrow + pg, tl.full([CH], 1, tl.int8), mask=ok)
                pos = tl.reshape(pg[:, None] * page + tok[None, :], [CH * PP])
                okp = tl.reshape(ok[:, None] & (tok < page)[None, :], [CH * PP])
                keep = okp & (pos >= start) & (pos < end)
                dest = written + tl.cumsum(keep.to(tl.int32), 0) - 1
                tl.store(irow + dest, pos, mask=keep)
                tl.store(wrow + dest, tl.full([CH * PP], 1.0, tl.float64), mask=keep)
                written += tl.sum(keep.to(tl.int32), 0)
        # the residual's size and the base sample's, as the reference computes them (float64 floor)
        n_s = (end - start - written).to(tl.int64)
        n_b = tl.floor(tl.load(rate_ptr) * n_s.to(tl.float64)).to(tl.int64)
        n_b = tl.minimum(tl.maximum(n_b, 2), n_s)
        at = r * hs + h
        tl.store(tc_ptr + at, written.to(tl.int64))
        tl.store(ns_ptr + at, n_s)
        tl.store(nb_ptr + at, n_b)

def usable(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or is_interpreted(_budget_parts_kernel))


def budget_splits(rows: int, entries: int, block: int, target_programs: int) -> int:
    """Programs per (row, query head) of :func:`budget_stats_triton`: at most ``target_programs`` in all (one
    wave), at most one per two blocks of the ``entries`` a row may hold (sink + window + list widths) and 64;
    at least one."""
    return max(1, min(target_programs // max(rows, 1), cdiv(entries, 2 * block), 64))


@dataclass(frozen=True)
class BudgetRule:
    """How :func:`budget_triton` turns the statistics into a sample size: ``rule`` 1 (CLT on the
    denominator), 2 (Theorem 4.3's grid) or 3 (Hoeffding); ``constants`` the float64 vector
    ``[z, ln(2/δ), 2ε², ε, ε'/2 (g), (ε − ε')/2 (g), z(δ') (g), z(δ − δ') (g)]`` over a grid of ``g``
    points (``methods/vattention.budget_constants``); ``floor_base``: the size is at least the base
    sample's (else 1); ``n_keys``: the cap before rounding."""

    rule: int
    constants: torch.Tensor
    grid: int
    floor_base: bool
    n_keys: int


@dataclass
class Budget:
    """:func:`budget_triton`'s results: ``stats [R, Hq, 5]`` (as :func:`budget_stats_triton`) and, with a
    rule, per (row, selection head) the size before rounding ``raw`` (float64, the max over the
    selection head's query heads), the size ``size`` (int64) and the list's count ``top_counts + size``."""

    stats: torch.Tensor
    raw: torch.Tensor | None = None
    size: torch.Tensor | None = None
    counts: torch.Tensor | None = None


def budget_stats_reference(q, k, v, start, end, length, top, top_counts, base, base_counts, n_s, scale: float,
                           full: bool, dense_width: int, logits: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`budget_stats_triton`'s ``[R, Hq, 5]`` in torch (float64, one shift by each row's largest logit,
    spreads in two passes): the same arguments, the rows' sink and window as the first ``dense_width``
    entries of a list. Reads only the listed rows of K and V."""
    from ..shared.weighted import gather_rows

    r, hq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    heads = torch.arange(hq, device=q.device)
    sel, kv = heads // (hq // top.shape[1]), heads // (hq // hkv)
    j = torch.arange(dense_width, device=q.device)
    st = start.long()[:, None]
    rng = torch.where(j < st, j, end.long()[:, None] + j - st)  # [0, start) then [end, length)
    rng_ok = (j < st) | (rng < length.long()[:, None])
    rng, rng_ok = rng[:, None].expand(r, hq, -1), rng_ok[:, None].expand(r, hq, -1)

    def listed(lst, counts):
        idx = lst[:, sel].long()
        return idx, torch.arange(idx.shape[-1], device=q.device) < counts[:, sel].long()[..., None]

    def logit(idx, ok, kept):
        idx = torch.where(ok, idx, 0).clamp(max=max(n - 1, 0))
        if kept:
            s = torch.gather(logits, 2, idx).double()
        else:
            s = torch.einsum("rhd,rhmd->rhm", q.double(), gather_rows(k, idx, kv).double()) * scale
        return s.masked_fill(~ok, float("-inf")), idx

    (ti, t_ok), (bi, b_ok) = listed(top, top_counts), listed(base, base_counts)
    parts = [logit(rng, rng_ok, False), logit(ti, t_ok, logits is not None), logit(bi, b_ok, logits is not None)]
    m = torch.cat([p[0] for p in parts], -1).amax(-1, keepdim=True) if dense_width + ti.shape[-1] + bi.shape[-1] \
        else torch.zeros(r, hq, 1, dtype=torch.float64, device=q.device)
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = [torch.exp(p[0] - m) for p in parts]  # 0 off the lists
    nb = base_counts[:, sel].double()
    ratio = n_s[:, sel].double() / nb.clamp(min=1)
    e_b = e[2]
    mean = e_b.sum(-1) / nb.clamp(min=1)
    var = (((e_b - mean[..., None]) ** 2) * b_ok).sum(-1) / (nb.clamp(min=2) - 1)
    spread = torch.where(nb > 0, e_b.masked_fill(~b_ok, float("-inf")).amax(-1)
                         - e_b.masked_fill(~b_ok, float("inf")).amin(-1), 0.0)
    out = torch.zeros(r, hq, 5, dtype=torch.float64, device=q.device)
    out[..., 0] = e[0].sum(-1) + e[1].sum(-1) + ratio * e_b.sum(-1)
    out[..., 1] = var.sqrt()
    out[..., 4] = spread
    if full:
        ev = [torch.einsum("rhm,rhmd->rhmd", ei, gather_rows(v, p[1], kv).double()) for ei, p in zip(e, parts,
                                                                                                      strict=True)]
        n_hat = ev[0].sum(2) + ev[1].sum(2) + ratio[..., None] * ev[2].sum(2)
        mean_r = ev[2].sum(2) / nb.clamp(min=1)[..., None]
        out[..., 2] = n_hat.norm(dim=-1)
        out[..., 3] = (((ev[2] - mean_r[:, :, None]) ** 2) * b_ok[..., None]).sum((2, 3)) / (nb.clamp(min=2) - 1)
    return out


def budget_stats_triton(q, k, v, start, end, length, top, top_counts, base, base_counts, n_s, scale: float,
                        full: bool, dense_width: int, splits: int | None = None,
                        logits: torch.Tensor | None = None, *, block: int | None = None,
                        num_warps: int | None = None) -> torch.Tensor:
    """``[R, Hq, 5]`` float64 ``(D̂, σ̂, ‖N̂‖, Tr Σ̂, range of e^s over the base sample)`` per query head
    (``‖N̂‖`` and ``Tr Σ̂`` 0 unless ``full``): :func:`budget_triton` without a rule."""
    return budget_triton(q, k, v, start, end, length, top, top_counts, base, base_counts, n_s, scale, full,
                         dense_width, splits=splits, logits=logits, block=block, num_warps=num_warps).stats


def budget_triton(q, k, v, start, end, length, top, top_counts, base, base_counts, n_s, scale: float,
                  full: bool, dense_width: int, rule: BudgetRule | None = None,
                  splits: int | None = None, logits: torch.Tensor | None = None, *, block: int | None = None,
                  num_warps: int | None = None) -> Budget:
    """vAttention's budget statistics and, with ``rule``, its sample size. The deterministic set of row
    ``r`` is ``[0, start) ∪ [end, length)`` (at most ``dense_width`` keys) plus the first ``top_counts``
    entries of ``top [R, Hs, Kt]``; the base sample the first ``base_counts`` of ``base [R, Hs, Kb]``;
    ``Hs`` is Hkv or Hq; ``n_s [R, Hs]`` the residual's size. ``k``/``v`` ``[R, Hkv, N, d]`` with a
    contiguous last dim.

    Two launches: ``splits`` programs per (row, query head) (default :func:`budget_splits`) each take
    ``1/splits`` of every segment and write partial sums around their own max; one program per (row,
    selection head) merges them for its query heads (float64; the same sums as a single pass up to
    rounding, ~1e-15 relative) and applies the rule. Each split reads each segment once, its sums kept
    around a running max (one exponential per entry, no logits workspace).

    ``logits [R, Hq, N]`` (float32 ``scale · q·k``, the oracle predictor's kept scores): the list entries'
    logits are read from it instead of computed from K (4 bytes a key instead of a K row; float32 rather
    than float64 logits, as the tested-key attention pass uses); sink and window stay computed from K.

    Launch settings (the same statistics up to rounding whatever they are; ``vattention_stages.py`` times
    them): ``block`` entries per loop step (a power of two, 4 to 128; default ``PARTS_BLOCK``, half beyond a head
    dim of 128) and ``num_warps`` (default ``PARTS_WARPS``) of the split launch. Each loop step issues the next
    block's gathers (list entries, their logits and V rows) before its own sums, so that a program waits on one
    gather latency less per block."""
    r, hq, d = q.shape
    hkv = k.shape[1]
    hs = top.shape[1]
    if hq % hs or hq % hkv:
        raise ValueError(f"budget_triton: {hq} query heads are not a multiple of {hs} selection and {hkv} KV heads")
    if logits is not None and (logits.dtype != torch.float32 or tuple(logits.shape) != (r, hq, k.shape[2])
                               or logits.stride(-1) != 1):
        raise ValueError(f"budget_triton: logits must be float32 [{r}, {hq}, {k.shape[2]}] with a contiguous last "
                         f"dim, got {logits.dtype} {list(logits.shape)} strides {logits.stride()}")
    width = dense_width + top.shape[2] + base.shape[2]
    if block is None:
        block = PARTS_BLOCK if d <= 128 else PARTS_BLOCK // 2
    check_launch_value("block", block, low=4, high=128, pow2=True)
    warps = PARTS_WARPS if num_warps is None else check_launch_value("num_warps", num_warps, high=16, pow2=True)
    if splits is not None:
        check_launch_value("splits", splits)
    dp = next_pow2(d)
    splits = splits or budget_splits(r * hq, width, block, SPLITS_PER_SM * sm_count(q.device))
    rec = 8 + (2 * dp if full else 0)
    dev = q.device
    parts = workspace("vattention_budget_parts", q, max(1, r * hq * splits * rec), torch.float64)
    out = torch.empty(r, hq, 5, device=dev, dtype=torch.float64)
    launch(_budget_parts_kernel, (splits, hq, r),
           q, k, v, start, end, length, top, top_counts, base, base_counts, parts,
           float64_constants((scale,), dev), q if logits is None else logits, hq, hq // hkv, hq // hs, splits,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           top.stride(0), top.stride(1), base.stride(0), base.stride(1), top_counts.stride(0), top_counts.stride(1),
           base_counts.stride(0), base_counts.stride(1), *((0, 0) if logits is None else logits.stride()[:2]),
           FULL=full, KEPT=logits is not None, BLOCK=block, D=dp, W=rec, num_warps=warps, num_stages=1)
    res = Budget(out)
    if rule is not None:
        sizes = torch.empty(2, r, hs, device=dev, dtype=torch.int64)
        res.raw, res.size, res.counts = torch.empty(r, hs, device=dev, dtype=torch.float64), sizes[0], sizes[1]
        if rule.constants.dtype != torch.float64 or rule.constants.numel() < 4 + 4 * rule.grid:
            raise ValueError(f"budget_triton: rule.constants must be float64 with {4 + 4 * rule.grid} entries")
    launch(_budget_combine_kernel, (hs, r), parts, base_counts, n_s, top_counts, out,
           res.raw if rule else out, res.size if rule else n_s, res.counts if rule else n_s,
           rule.constants if rule else out, hq, hq // hs, splits, rule.n_keys if rule else 0,
           rule.grid if rule else 1,
           base_counts.stride(0), base_counts.stride(1), n_s.stride(0), n_s.stride(1), top_counts.stride(0),
           top_counts.stride(1),
           FULL=full, SP=max(2, next_pow2(splits)), D=dp, W=rec, RULE=rule.rule if rule else 0,
           GP=max(2, next_pow2(rule.grid)) if rule else 2, FLOOR_BASE=bool(rule and rule.floor_base),
           num_warps=4, num_stages=1)
    return res


@dataclass
class ResidualSetup:
    """What :func:`residual_setup_triton` writes: the rows' key range ``[start, end)`` ``[R]`` between
    sink and window, per (row, selection head) ``[R, Hs]`` the top-k keys listed (``top_counts``), the
    residual's size ``n_s`` and the base sample's ``n_base``, and the pages (keys, for ``page = 1``)
    the samples must skip (``excluded [R, Hs, P]`` bool; None without a top-k)."""

    start: torch.Tensor
    end: torch.Tensor
    top_counts: torch.Tensor
    n_s: torch.Tensor
    n_base: torch.Tensor
    excluded: torch.Tensor | None


def residual_setup_reference(lengths: torch.Tensor, sink: int, window: int, base_rate: float,
                             top_counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(start, end, n_s, n_base)`` as ``VAttention.stages`` computes them, from the top-k's counts."""
    nv = lengths.long()
    start = torch.clamp(nv, max=sink)
    end = torch.maximum(nv - window, start)
    n_s = (end - start)[:, None] - top_counts
    n_base = torch.minimum(torch.clamp(torch.floor(base_rate * n_s.double()).long(), min=2), n_s)
    return start, end, n_s, n_base


def residual_setup_triton(lengths: torch.Tensor, sink: int, window: int, base_rate: float, heads: int,
                          pages: torch.Tensor | None = None, page_counts: torch.Tensor | None = None,
                          page: int = 1, n_pages: int = 0, idx: torch.Tensor | None = None,
                          weights: torch.Tensor | None = None) -> ResidualSetup:
    """vAttention's bookkeeping between its predictor and its samples, in one launch: the keys of the
    first ``page_counts [R, Hs]`` pages of ``pages [R, Hs, K]`` (``page`` keys each; ``page = 1``: keys)
    that lie in ``[start, end)``, written page by page to the first columns of ``idx [R, Hs, W]``
    (weights 1; ``W ≥ K·page``), the pages marked for the samples, and the sizes of
    :func:`residual_setup_reference`. Without ``pages`` there is no top-k (counts 0). ``lengths`` [R]."""
    r = lengths.shape[0]
    dev = lengths.device
    lens = lengths.to(torch.int32) if lengths.dtype != torch.int32 else lengths
    start = torch.empty(r, device=dev, dtype=torch.int64)
    end = torch.empty(r, device=dev, dtype=torch.int64)
    sizes = torch.empty(3, r, heads, device=dev, dtype=torch.int64)
    has_top = pages is not None
    if has_top:
        k = pages.shape[-1]
        excl = torch.empty(r, heads, n_pages, device=dev, dtype=torch.bool)
        pp = next_pow2(page)
        ch = max(1, min(next_pow2(k), max(1, 1024 // pp)))
        if idx.stride() != weights.stride() or idx.stride(-1) != 1:
            raise ValueError("residual_setup_triton: idx and weights must share a layout with a contiguous last dim")
    else:
        excl, pages, page_counts, idx, weights, pp, ch = None, sizes, sizes[0], sizes, sizes, 1, 1
    launch(_residual_setup_kernel, (heads, r), pages, page_counts, lens, idx, weights, sizes[0],
           excl.view(torch.int8) if has_top else sizes, start, end, sizes[1], sizes[2],
           float64_constants((base_rate,), dev), sink, window, heads, n_pages, pages.stride(0), pages.stride(1),
           page_counts.stride(0), page_counts.stride(1), idx.stride(0), idx.stride(1), page,
           HAS_TOP=has_top, PP=pp, CH=ch, BLOCK=1024, num_warps=4, num_stages=1)
    return ResidualSetup(start, end, sizes[0], sizes[1], sizes[2], excl)


__all__ = ["SPLITS_PER_SM", "Budget", "BudgetRule", "ResidualSetup", "budget_splits", "budget_stats_reference",
           "budget_stats_triton",
           "budget_triton", "residual_setup_reference",
           "residual_setup_triton", "usable"]
