"""variant=authors' decode step, its per-row tail, walk and selection on the device (``authors_decode.py`` gives the
step; this module its steps 3–5 and the device helpers both share). Each holds a row of at most
:data:`MAX_BLOCKS` blocks in registers:

- ``_row_tail_kernel``, a program per row after the block row's per-KV-head partials (``row_update_triton``'s
  ``part [B, Hkv, C]``): block ``c``'s key sums, the KV heads summed and ``r`` normalised, the running matrix's
  step, the ring's count and the order flag; every load issued at once, the restart, a new block and fresh rows
  folded into the registers' values, each entry written once;
- ``_walk_hop_kernel`` per hop, a program per (row, tile of :data:`HOP_COLS` columns, split of the rows): the
  split's share of ``(w ⊙ σ)·U`` over the tile (float32), the previous hop's splits summed as it reads them; a later
  hop whose split is one step of :data:`HOP_ROWS` rows loads its tile before it waits for the hop before;
- ``_select_kernel``, a program per row: the walk (the last hop's splits summed), the quantile by an exact radix
  select on the registers (``select_common``'s), the kept blocks and the page list.

The torch references are ``authors_reference.py``'s :func:`update_matrix_reference` (the tail's matrix step) and
:func:`walk_select_reference` (the hops and the selection).

The per-row work is launches of its own rather than the last tile program to arrive (a ticket counter):
acquire-release atomics of hundreds of programs on one counter serialise and cost more than a launch, whose start
programmatic dependent launch hides. No atomics: sums in a fixed order, a replay equals an eager call bit for bit.
"""

from __future__ import annotations

import torch

from ..shared.select_common import row_segments
from ..shared.triton_utils import (
    cdiv,
    float64_constants,
    gdc_launch_dependents,
    gdc_wait,
    launch,
    next_pow2,
    pdl_available,
    pdl_launch,
    triton,
    workspace,
)
from .authors_reference import ROW_EPS

if triton is not None:
    import triton.language as tl

    from ..shared.select_common import ordered, radix_select_regs

    @triton.jit
    def position(lens_ptr, b, BS: tl.constexpr):
        """``(pos, c, s)``: the row's new token, its block and its place in the block."""
        pos = tl.load(lens_ptr + b).to(tl.int64) - 1
        c = pos // BS
        return pos, c, pos - c * BS

    @triton.jit
    def ring(plen_ptr, nq_ptr, pnq_ptr, b, pos, w_len):
        """``(restart, ring count after the step, slot)`` of row b."""
        plen = tl.load(plen_ptr + b)
        restart = (plen >= 0) & (pos == plen)
        nq = tl.where(restart, tl.load(pnq_ptr + b), tl.load(nq_ptr + b))
        return restart, tl.minimum(nq + 1, w_len), pos % w_len

    @triton.jit
    def key_sum(k_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c, s, restart, dc, dc_ok, cap, d, s_kb, s_kh, s_kn):
        """Block c's key sum after the step over the dims ``dc`` (KV head g of row b): the new key added to the
        prompt's partial sum on a restart, to nothing at a block's first key, else to the stored sum."""
        k_new = tl.load(k_ptr + b * s_kb + g * s_kh + pos * s_kn + dc, mask=dc_ok, other=0.0).to(tl.float32)
        if restart:
            base = tl.load(pkp_ptr + (b * hkv + g) * d + dc, mask=dc_ok, other=0.0)
        elif s == 0:
            base = tl.zeros_like(k_new)
        else:
            base = tl.load(ksum_ptr + ((b * hkv + g) * cap + c) * d + dc, mask=dc_ok, other=0.0)
        return base + k_new

    @triton.jit
    def _tail_start(lens_ptr, plen_ptr, nq_ptr, pnq_ptr, w_len, BS: tl.constexpr, PDL: tl.constexpr):
        """A tail program's start: the wait for the kernel before (launched early), then ``(row, pos, c, s,
        restart, ring count after the step)``."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        pos, c, s = position(lens_ptr, b, BS)
        restart, nq_new, _ = ring(plen_ptr, nq_ptr, pnq_ptr, b, pos, w_len)
        return b, pos, c, s, restart, nq_new

    @triton.jit
    def _close_ring(b, pos, restart, nq_new, nq_ptr, last_ptr, err_ptr):
        """The ring's count, the order flag, the last position, after the step."""
        last = tl.load(last_ptr + b)
        bad = (restart.to(tl.int32) == 0) & (last >= 0) & (pos != last + 1)
        tl.store(err_ptr + b, (tl.load(err_ptr + b) != 0) | bad)
        tl.store(last_ptr + b, pos)
        tl.store(nq_ptr + b, nq_new.to(tl.int64))

    @triton.jit
    def _reserved(n_tok, frac, n, BS: tl.constexpr):
        """``reserved_device``: ``max(1, ⌊f·T⌋)`` tokens (float64) and ``min(n, max(1, ⌈tokens/B⌉))`` blocks."""
        tokens = tl.maximum((n_tok.to(tl.float64) * frac).to(tl.int64), 1)
        return tokens, tl.minimum(n, tl.maximum((tokens + BS - 1) // BS, 1))

    @triton.jit
    def _row_sizes(pos, n, frac_ptr, BS: tl.constexpr):
        """``(window tokens, window blocks, sink blocks)`` of a row at position pos (``frac_ptr``: sink, window)."""
        wt, wb = _reserved(pos + 1, tl.load(frac_ptr + 1), n, BS)
        sb = _reserved(pos + 1, tl.load(frac_ptr), n, BS)[1]
        return wt, wb, sb

    @triton.jit
    def _lerp(ranks, lo, hi, v_lo, v_next, n_le):
        """torch.nanquantile's linear interpolation between the lo-th smallest ``v_lo`` and the hi-th (``v_lo`` again
        where ``n_le`` values, at most v_lo, reach past hi; else the next larger ``v_next``), in torch.lerp's two forms
        (exact at both ends)."""
        v_hi = tl.where((hi == lo) | (n_le > hi), v_lo, v_next)
        weight = ranks - lo.to(tl.float32)
        return tl.where(weight < 0.5, v_lo + weight * (v_hi - v_lo), v_hi - (v_hi - v_lo) * (1.0 - weight))

    @triton.jit
    def _kept_pages(b, j, w, listed_n, n, sb, first_window, n_cand, th, wt, cap, max_pages, kept_ptr, pages_ptr,
                    BS: tl.constexpr):
        """The kept blocks among ``j`` (walk ``w``) and those of them past the first wt keys into the page list after
        the ``listed_n`` listed before; returns the count listed."""
        kept = (j < n) & (((n_cand > 0) & (w > th)) | (j < sb) | (j >= first_window))
        tl.store(kept_ptr + b * cap + j, kept.to(tl.int8), mask=j < cap)
        listed = kept & ((j + 1) * BS > wt)
        order = listed_n + tl.cumsum(listed.to(tl.int32), 0) - 1
        ok = (listed.to(tl.int32) * (order < max_pages).to(tl.int32)) != 0  # (the interpreter's mask types)
        tl.store(pages_ptr + b * max_pages + order, j, mask=ok)
        return listed_n + tl.sum(listed.to(tl.int32), 0)

    @triton.jit
    def _close_pages(b, n, sb, wb, wt, listed_n, max_pages, pages_ptr, counts_ptr, wt_ptr, n_ptr, short_ptr,
                     BLOCK: tl.constexpr):
        """The page list's zeros past its count, the count, and the row's sizes."""
        count = tl.minimum(listed_n, max_pages)
        for e0 in range(0, max_pages, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            tl.store(pages_ptr + b * max_pages + e, tl.zeros([BLOCK], tl.int32), mask=(e >= count) & (e < max_pages))
        tl.store(counts_ptr + b, count)
        tl.store(wt_ptr + b, wt.to(tl.int32))
        tl.store(n_ptr + b, n.to(tl.int32))
        tl.store(short_ptr + b, (n <= sb + wb).to(tl.int8))

    @triton.jit(do_not_specialize=["cap", "n_splits", "split_rows"])
    def _walk_hop_kernel(lens_ptr, plen_ptr, p_nb_ptr, u_ptr, ue_ptr, sigma_ptr, r_ptr, pin_ptr, pout_ptr, cap,
                         n_splits, split_rows, beta, one_minus_beta, FIRST: tl.constexpr, BS: tl.constexpr,
                         SPLITS_P: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, EARLY: tl.constexpr,
                         PDL: tl.constexpr):
        """A program per (row, tile of BLOCK_J columns, split of split_rows rows): the split's share of
        ``(w ⊙ σ)·U`` over the tile, ``w`` the previous hop's splits summed (``FIRST``: the block row).

        ``EARLY`` (the split is one step of BLOCK_I rows; launched early by programmatic dependent launch): the
        program loads its tile of U before it waits for the kernel before. A later hop's tile is final then (the
        tail, which writes U, r and σ, finished before the hop before passed its own wait, and only then could this
        hop launch). The first hop's tile is read while the tail writes it: after the wait it reloads the entries
        the tail rewrites — row and column c, and on a restart row and column n0 − 1 (the caller keeps EARLY off
        for the first hop of a step that starts fresh rows, whose rows the tail rewrites whole). ``ue_ptr``: what
        the early loads read, U itself (a test passes U as it was before the tail)."""
        if PDL and not EARLY:  # launched early (programmatic dependent launch): wait for the kernel before, let
            gdc_wait()  # the next launch
            gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        jt = tl.program_id(1)
        sp = tl.program_id(2)
        pos, c, _ = position(lens_ptr, b, BS)
        n = (c + 1).to(tl.int32)
        j = jt * BLOCK_J + tl.arange(0, BLOCK_J)
        j_ok = j < cap
        i0 = sp * split_rows
        i1 = tl.minimum(i0 + split_rows, n)
        spl = tl.arange(0, SPLITS_P)
        if EARLY:
            i = i0 + tl.arange(0, BLOCK_I)
            i_ok = i < i1
            at = (b * cap + i[:, None]) * cap + j[None, :]
            a = tl.load(ue_ptr + at, mask=i_ok[:, None] & j_ok[None, :], other=0.0)
            if not FIRST:  # (the first hop's r and σ are the tail's)
                rs = tl.load(r_ptr + b * cap + i, mask=i_ok, other=0.0)
                sig = tl.load(sigma_ptr + b * cap + i, mask=i_ok, other=0.0)
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
            if FIRST:
                plen = tl.load(plen_ptr + b)
                n0i = tl.maximum(tl.load(p_nb_ptr + b) - 1, 0)
                again = (i == c) | ((plen >= 0) & (pos == plen) & (i == n0i))
                again = again[:, None] | ((j == c) | ((plen >= 0) & (pos == plen) & (j == n0i)))[None, :]
                again = (again.to(tl.int32) * (i_ok[:, None] & j_ok[None, :]).to(tl.int32)) != 0
                a = tl.where(again, tl.load(u_ptr + at, mask=again, other=0.0), a)
                v = tl.load(r_ptr + b * cap + i, mask=i_ok, other=0.0)
            else:
                prev = tl.load(pin_ptr + (b * n_splits + spl[:, None]) * cap + i[None, :],
                               mask=(spl < n_splits)[:, None] & i_ok[None, :], other=0.0)
                v = one_minus_beta * rs + beta * tl.sum(prev, 0)
            if FIRST:
                v = v * tl.load(sigma_ptr + b * cap + i, mask=i_ok, other=0.0)
            else:
                v = v * sig
            tl.store(pout_ptr + (b * n_splits + sp) * cap + j, tl.sum(v[:, None] * a, 0), mask=j_ok)
        else:
            acc = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
            for x0 in range(i0, i1, BLOCK_I):
                i = x0 + tl.arange(0, BLOCK_I)
                i_ok = i < i1
                w = tl.load(r_ptr + b * cap + i, mask=i_ok, other=0.0)
                if not FIRST:  # the previous hop's walk over these rows (all live: i < n)
                    prev = tl.load(pin_ptr + (b * n_splits + spl[:, None]) * cap + i[None, :],
                                   mask=(spl < n_splits)[:, None] & i_ok[None, :], other=0.0)
                    w = one_minus_beta * w + beta * tl.sum(prev, 0)
                v = w * tl.load(sigma_ptr + b * cap + i, mask=i_ok, other=0.0)
                a = tl.load(u_ptr + (b * cap + i[:, None]) * cap + j[None, :], mask=i_ok[:, None] & j_ok[None, :],
                            other=0.0)
                acc += v[:, None] * a
            tl.store(pout_ptr + (b * n_splits + sp) * cap + j, tl.sum(acc, 0), mask=j_ok)

    @triton.jit(do_not_specialize=["cap", "w_len", "fresh"])
    def _row_tail_kernel(lens_ptr, nq_ptr, pnq_ptr, plen_ptr, part_ptr, r_ptr, u_ptr, sigma_ptr, rsum_ptr, nb_ptr,
                         p_nb_ptr, p_row_ptr, p_col_ptr, p_rsum_ptr, last_ptr, err_ptr, k_ptr, pkp_ptr, ksum_ptr, cap,
                         w_len, fresh, eps, d, s_kb, s_kh, s_kn, HKV: tl.constexpr, BLOCK_D: tl.constexpr,
                         BS: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        """A program per row (``cap ≤ BLOCK_X``) after every tile's partials, the row in registers: every load is
        issued at the start (the KV heads' partials, row c and column c of U, the row scales and sums, the prompt's
        copies on a restart, the new keys), the fresh rows, the restart and a new block are folded into the
        registers' values (``update_matrix_reference``'s order), and each entry of U is written once at the end,
        the rare writes (fresh rows, the restart's row and column) before it behind barriers; the key sums of every
        KV head at once. Its own launch rather than the last of the tile programs (module docstring)."""
        b, pos, c, s, restart, nq_new = _tail_start(lens_ptr, plen_ptr, nq_ptr, pnq_ptr, w_len, BS, PDL)
        n = (c + 1).to(tl.int32)
        vec = b * cap
        u_row = b * cap * cap
        j = tl.arange(0, BLOCK_X)
        j_ok = j < cap
        live = j < n
        # every load first (one round trip): the partials, row and column c, the scales and sums, the prompt's copies
        r = tl.zeros([BLOCK_X], tl.float32)
        for g in tl.static_range(HKV):  # the KV heads in order
            r += tl.load(part_ptr + (b * HKV + g) * cap + j, mask=j_ok, other=0.0, cache_modifier=".cg")
        row_c = tl.load(u_ptr + u_row + c * cap + j, mask=j_ok, other=0.0)
        col_c = tl.load(u_ptr + u_row + j * cap + c, mask=j_ok, other=0.0)
        sig = tl.load(sigma_ptr + vec + j, mask=j_ok, other=1.0)
        rs = tl.load(rsum_ptr + vec + j, mask=j_ok, other=0.0)
        n_prev = tl.load(nb_ptr + b).to(tl.int32)
        n0 = tl.load(p_nb_ptr + b).to(tl.int32)
        on = restart.to(tl.int32)  # (a scalar flag in masks as int: the interpreter's mask types)
        p_ok = (j_ok.to(tl.int32) * on) != 0
        p_row = tl.load(p_row_ptr + vec + j, mask=p_ok, other=0.0)
        p_col = tl.load(p_col_ptr + vec + j, mask=p_ok, other=0.0)
        p_rsum = tl.load(p_rsum_ptr + vec + j, mask=p_ok, other=0.0)
        # block c's key sums, every KV head at once
        gh = tl.arange(0, BLOCK_H)
        dd = tl.arange(0, BLOCK_D)
        hd_ok = (gh < HKV)[:, None] & (dd < d)[None, :]
        k_new = tl.load(k_ptr + b * s_kb + gh[:, None] * s_kh + pos * s_kn + dd[None, :], mask=hd_ok,
                        other=0.0).to(tl.float32)
        at_c = ((b * HKV + gh[:, None]) * cap + c) * d + dd[None, :]
        from_prompt = tl.load(pkp_ptr + (b * HKV + gh[:, None]) * d + dd[None, :], mask=(hd_ok.to(tl.int32) * on) != 0,
                              other=0.0)
        stored = tl.load(ksum_ptr + at_c, mask=(hd_ok.to(tl.int32) * (s != 0).to(tl.int32)) != 0, other=0.0)
        base = tl.where(restart, from_prompt, stored)  # (zero at a block's first key)
        tl.store(ksum_ptr + at_c, base + k_new, mask=hd_ok)
        # the block row, normalised
        r = r / (tl.sum(r, axis=0) + eps)
        r_total = tl.sum(r, axis=0)
        r_c = tl.sum(tl.where(j == c, r, 0.0), axis=0)
        tl.store(r_ptr + vec + j, r, mask=j_ok)
        # fresh rows [n_prev, n) start as r (written whole here; row and column c are rewritten below)
        if fresh != 0:
            for i in range(n_prev, n):
                tl.store(u_ptr + u_row + i * cap + j, r, mask=j_ok)
            new_row = (j >= n_prev) & live
            if c >= n_prev:
                row_c = r
            col_c = tl.where(new_row, r_c, col_c)
            sig = tl.where(new_row, 1.0, sig)
            rs = tl.where(new_row, r_total, rs)
            n_prev = tl.maximum(n_prev, n)
        # restart: row and column n0 − 1 (row first), σ and the row sums back to the prompt's
        if restart:
            n0i = tl.maximum(n0 - 1, 0)
            in_prompt = j < n0
            tl.debug_barrier()  # after the fresh rows' writes
            if c != n0i:  # row c and column c are written at the end, with the rest of the step
                tl.store(u_ptr + u_row + n0i * cap + j, p_row, mask=j_ok)
                tl.debug_barrier()
                tl.store(u_ptr + u_row + j * cap + n0i, p_col, mask=in_prompt & (j != c))
                col_c = tl.where(j == n0i, tl.sum(tl.where(j == c, p_row, 0.0), axis=0), col_c)
                if c < n0:
                    row_c = tl.where(j == n0i, tl.sum(tl.where(j == c, p_col, 0.0), axis=0), row_c)
            else:
                row_c = tl.where((j == n0i) & (n0i < n0), tl.sum(tl.where(j == c, p_col, 0.0), axis=0), p_row)
                col_c = tl.where(in_prompt, p_col, tl.where(j == n0i, row_c, col_c))
            sig = tl.where(in_prompt, 1.0, sig)
            rs = p_rsum
            n_prev = n0
        # a block that appears: row c = r, older rows' column c = 0
        if c >= n_prev:
            row_c = r
            col_c = tl.where(j == c, r_c, tl.where(j < n_prev, 0.0, col_c))
            sig = tl.where(j == c, 1.0, sig)
            rs = tl.where(j == c, r_total, rs)
        tl.store(nb_ptr + b, tl.maximum(n_prev, n).to(tl.int64))
        # α = 1/(s + 1) and 1 − α in float64, rounded once (the reference's)
        alpha = (1.0 / (s + 1).to(tl.float64)).to(tl.float32)
        one_minus = (1.0 - 1.0 / (s + 1).to(tl.float64)).to(tl.float32)
        # row c ← (1 − α)·A_c + α·r, normalised
        sig_c = tl.sum(tl.where(j == c, sig, 0.0), axis=0)
        x = tl.where(live, one_minus * (sig_c * row_c) + alpha * r, 0.0)
        x = x / tl.maximum(tl.sum(x, axis=0), eps)
        sig = tl.where(j == c, 1.0, sig)
        rs = tl.where(j == c, tl.sum(x, axis=0), rs)
        col_c = tl.where(j == c, tl.sum(tl.where(j == c, x, 0.0), axis=0), col_c)
        # column c, then every live row's scale
        y = one_minus * (sig * col_c) + alpha * r
        u_new = tl.where(live, y / sig, col_c)
        rs = rs + tl.where(live, u_new - col_c, 0.0)
        sig = tl.where(live, sig / tl.maximum(sig * rs, eps), sig)
        tl.debug_barrier()  # after the restart's writes
        tl.store(u_ptr + u_row + c * cap + j, x, mask=j_ok & (j != c))
        tl.store(u_ptr + u_row + j * cap + c, u_new, mask=j_ok)
        tl.store(sigma_ptr + vec + j, sig, mask=j_ok)
        tl.store(rsum_ptr + vec + j, rs, mask=j_ok)
        _close_ring(b, pos, restart, nq_new, nq_ptr, last_ptr, err_ptr)

    @triton.jit(do_not_specialize=["cap", "n_splits", "max_pages"])
    def _select_kernel(lens_ptr, r_ptr, pout_ptr, frac_ptr, walk_ptr, kept_ptr, pages_ptr, counts_ptr, wt_ptr, n_ptr,
                       short_ptr, cap, n_splits, max_pages, q, beta, one_minus_beta, BS: tl.constexpr,
                       SPLITS_P: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
        """A program per row after the last hop, the row (``cap ≤ BLOCK_X``) in registers: the walk is loaded once (the
        last hop's splits, each a row of loads issued together), the quantile's exact radix select runs on the
        registers (``radix_select_regs``: no pass over memory per digit, and it stops once the digit's bin is
        taken whole), and the kept blocks and the page list are one pass of stores."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        pos, c, _ = position(lens_ptr, b, BS)
        n = c + 1
        vec = b * cap
        j = tl.arange(0, BLOCK_X)
        live = j < n
        hop = tl.zeros([BLOCK_X], tl.float32)
        for sp in tl.static_range(SPLITS_P):  # the splits in order
            sp_ok = (live.to(tl.int32) * (sp < n_splits).to(tl.int32)) != 0  # (the interpreter's mask types)
            hop += tl.load(pout_ptr + (b * n_splits + sp) * cap + j, mask=sp_ok, other=0.0, cache_modifier=".cg")
        w = tl.where(live, one_minus_beta * tl.load(r_ptr + vec + j, mask=live, other=0.0) + beta * hop, 0.0)
        tl.store(walk_ptr + vec + j, w, mask=j < cap)
        wt, wb, sb = _row_sizes(pos, n, frac_ptr, BS)
        first_window = n - wb
        n_cand = tl.maximum(first_window - sb, 0).to(tl.int32)
        th = tl.full([], 0.0, tl.float32)
        if n_cand > 0:  # torch.nanquantile's linear quantile over [sb, first_window)
            cand = (j >= sb) & (j < first_window)
            ranks = (n_cand - 1).to(tl.float32) * q
            lo = ranks.to(tl.int32)
            hi = tl.ceil(ranks).to(tl.int32)
            u = ordered(w)
            img_hi = tl.max(tl.where(cand, u, 0), axis=0)
            img_lo = tl.min(tl.where(cand, u, 0xFFFFFFFF), axis=0)
            # a lower bound of the lo-th smallest's image, every candidate at or above it among the n_cand − lo
            # largest: the lo-th smallest is the least of them
            bound = radix_select_regs(u, cand, n_cand - lo, img_hi, img_lo)[0]
            v_lo = tl.min(tl.where(cand & (u >= bound), w, float("inf")), axis=0)
            img = ordered(v_lo)
            v_next = tl.min(tl.where(cand & (u > img), w, float("inf")), axis=0)
            n_le = tl.sum((cand & (u <= img)).to(tl.int32), axis=0)
            th = _lerp(ranks, lo, hi, v_lo, v_next, n_le)
        listed_n = _kept_pages(b, j, w, tl.full([], 0, tl.int32), n, sb, first_window, n_cand, th, wt, cap, max_pages,
                               kept_ptr, pages_ptr, BS)
        _close_pages(b, n, sb, wb, wt, listed_n, max_pages, pages_ptr, counts_ptr, wt_ptr, n_ptr, short_ptr, BLOCK_P)



#: the longest row (in blocks) the kernels hold in registers: 512k tokens of 64-key blocks (U is then 256 MiB a row)
MAX_BLOCKS = 8192
#: a hop program's rows per step of its loop, its columns, its warps
HOP_ROWS = 32
HOP_COLS = 128
HOP_WARPS = 4


def check_state(st, extra: tuple[str, ...] = ()) -> None:
    """Each of the state's tensors the kernels read (and the ``extra`` names) contiguous float32, and rows of at
    most :data:`MAX_BLOCKS` blocks, or a clear error."""
    for name in ("u", "sigma", "rsum", "qs", "p_qs", "ks", "ksum", "p_kpart", "p_row", "p_col", "p_rsum", "phi",
                 *extra):
        t = getattr(st, name)
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"st.{name}: expected a contiguous float32 tensor, got {t.dtype} {tuple(t.shape)}")
    if st.u.shape[-1] > MAX_BLOCKS:
        raise ValueError(f"st.u: the kernels hold rows of at most {MAX_BLOCKS} blocks, got {st.u.shape[-1]}")


def row_tail_triton(st, part: torch.Tensor, r: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *,
                    pdl: bool = False) -> None:
    """The step's tail after the block row's partials ``part [B·Hkv·C]`` (float32, the KV heads' probabilities
    summed over their ring rows, zero past each row's blocks): block c's key sums, ``r [B, C]`` (normalised, into
    ``r``), the running matrix's step, the ring count, the order flag. ``pdl``: launched with programmatic
    dependent launch."""
    st.tail_fresh = bool(st.fresh_rows)  # (the first hop reads its tile early unless the tail starts fresh rows)
    b, hkv, _, d = st.ksum.shape
    cap = st.u.shape[-1]
    block_x = max(16, next_pow2(cap))
    launch(_row_tail_kernel, (b,), lengths, st.n_queries, st.p_nq, st.prompt_len, part, r, st.u, st.sigma, st.rsum,
           st.n_blocks, st.p_nblocks, st.p_row, st.p_col, st.p_rsum, st.last_pos, st.order_error, k, st.p_kpart,
           st.ksum, cap, st.qs.shape[2], int(st.fresh_rows), ROW_EPS, d, k.stride(0), k.stride(1), k.stride(2),
           HKV=hkv, BLOCK_D=max(16, next_pow2(d)), BS=st.block_size, BLOCK_X=block_x, BLOCK_H=max(2, next_pow2(hkv)),
           PDL=pdl, num_warps=row_warps(block_x), **pdl_launch(pdl))


def row_warps(block_x: int) -> int:
    """Warps of a per-row program: about eight of a row's entries per thread."""
    return min(16, max(4, block_x // 256))


def walk_splits(batch: int, cap: int, device: torch.device) -> int:
    """Row splits of each hop's GEMV: about two programs per SM in all, at least :data:`HOP_ROWS` rows each."""
    return row_segments(batch * cdiv(cap, min(HOP_COLS, max(16, next_pow2(cap)))), cap, device, segment=HOP_ROWS)


def walk_select_triton(st, r: torch.Tensor, lengths: torch.Tensor, *, beta: float, degree: int, sink: float,
                       window: float, q: float, max_pages: int, splits: int | None = None,
                       u_before: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """:func:`walk_select_reference` in ``degree`` + 1 launches (float32). ``splits``: the GEMV's row splits
    (default :func:`walk_splits`). ``u_before``: what the first hop's early loads read in place of the U it reads
    (tests: U as it was before the tail, to check that the entries the tail rewrote are read again after the
    wait)."""
    check_state(st)
    if r.dtype != torch.float32 or r.shape != st.sigma.shape or not r.is_contiguous():
        raise ValueError(f"r: expected a contiguous float32 {tuple(st.sigma.shape)}, got {r.dtype} {tuple(r.shape)}")
    if degree < 1:
        raise ValueError(f"degree: expected at least 1, got {degree}")
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"splits: expected a positive int or None, got {splits!r}")
    b, cap = r.shape
    dev = r.device
    u = st.u
    block_j = min(HOP_COLS, max(16, next_pow2(cap)))
    col_tiles = cdiv(cap, block_j)
    splits = splits or walk_splits(b, cap, dev)
    split_rows = cdiv(cdiv(cap, splits), HOP_ROWS) * HOP_ROWS
    n_splits = cdiv(cap, split_rows)
    splits_p = max(2, next_pow2(n_splits))
    hops = workspace("sw_authors_hops", r, 2 * b * n_splits * cap, torch.float32)[:2 * b * n_splits * cap]
    hops = hops.view(2, b * n_splits * cap)
    out = {"walk": torch.empty(b, cap, device=dev, dtype=torch.float32),
           "kept": torch.empty(b, cap, device=dev, dtype=torch.int8),
           "pages": torch.empty(b, max_pages, device=dev, dtype=torch.int32),
           "counts": torch.empty(b, device=dev, dtype=torch.int32),
           "window_tokens": torch.empty(b, device=dev, dtype=torch.int32),
           "n": torch.empty(b, device=dev, dtype=torch.int32),
           "short": torch.empty(b, device=dev, dtype=torch.int8)}
    frac = float64_constants((sink, window), dev)
    pdl = pdl_available()  # each launch starts while the kernel before it runs (its programs wait for it first)
    for hop in range(degree):
        launch(_walk_hop_kernel, (b, col_tiles, n_splits), lengths, st.prompt_len, st.p_nblocks, u,
               u if u_before is None or hop else u_before, st.sigma, r, hops[(hop + 1) % 2], hops[hop % 2], cap,
               n_splits, split_rows, float(beta), float(1.0 - beta), FIRST=hop == 0, BS=st.block_size,
               SPLITS_P=splits_p, BLOCK_I=HOP_ROWS, BLOCK_J=block_j,
               EARLY=split_rows <= HOP_ROWS and (hop > 0 or not getattr(st, "tail_fresh", False)), PDL=pdl,
               num_warps=HOP_WARPS, num_stages=2, **pdl_launch(pdl))
    width = max(16, next_pow2(cap))
    launch(_select_kernel, (b,), lengths, r, hops[(degree - 1) % 2], frac, out["walk"], out["kept"], out["pages"],
           out["counts"], out["window_tokens"], out["n"], out["short"], cap, n_splits, max_pages, float(q), float(beta),
           float(1.0 - beta), BS=st.block_size, SPLITS_P=splits_p, BLOCK_X=width,
           BLOCK_P=min(width, max(16, next_pow2(max_pages))), PDL=pdl, num_warps=row_warps(width), **pdl_launch(pdl))
    out["kept"] = out["kept"].view(torch.bool)
    out["short"] = out["short"].view(torch.bool)
    return out
