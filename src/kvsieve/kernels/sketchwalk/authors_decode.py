"""variant=authors' decode step up to the attention on the device, for every row of a batch at once.

One step of a row at position ``p`` (block ``c = p // B``, ``n = c + 1`` blocks, ``s = p mod B``):

1. **State.** Restart (``p`` is the first position after the row's prompt: the query ring, its count and the
   partial block's key sum back to the prompt's), the order flag, the new query's sketches into the ring
   (slot ``p mod W``), the new key into block ``c``'s key sum and that block's sketch.
2. **Block row** ``r`` (:func:`block_row_reference`) from the ring and the key-block sketches.
3. **Running matrix** ``A = diag(σ)·U`` (:func:`update_matrix_reference`): O(C) per row.
4. **Walk** ``w ← (1 − β)·r + β·(w ⊙ σ)·U``, ``degree`` times from ``r``, zero past ``n``.
5. **Selection** (:func:`select_pages_reference`): the ``q`` quantile of the walk over the candidate blocks
   ``[sink_blocks, n − window_blocks)`` (NaN without a candidate), kept = above it, or a sink block, or one
   of the last ``window_blocks``; the pages are the kept blocks reaching past the first ``window_tokens``
   keys (those are read as the dense prefix), ascending, at most ``max_pages`` (the caller's host bound).
   The sink and window sizes per row are :func:`reserved_device`'s.

Torch (``authors_reference.py``): :func:`row_update_reference` (1–3) and :func:`walk_select_reference` (4–5),
about a hundred small launches per step. Device: :func:`row_update_triton` (1–3, four Triton launches) and
``authors_walk.walk_select_triton`` (4–5, ``degree`` + 1 launches):

- ``_row_state_kernel``, a program per (row, KV head, chunk of sketch features): the state's step on the ring and
  the sketches (the group's ring rows on a restart, the new query's sketches into its slot, block ``c``'s sketch);
- ``_row_logits_kernel``, a program per (row, KV head, tile of key blocks up to ``c``): the step of the state's
  logit cache (``authors_reference``'s block above :func:`logit_cache_reference`): the new query's ring rows
  against the tile, their max and Σ exp over the tile's closed blocks as partials; on a restart the other ring
  rows' logits from the prompt's copy; block ``c``'s tile also block ``c``'s column of the other ring rows, the
  blocks closed since the last step folded into their closed sums, and their max and Σ exp over the row's blocks;
- ``_row_probs_kernel``, a program per (row, KV head, tile of key blocks): the tile's probabilities summed over the
  KV head's valid ring rows (the new query's rows' max and Σ exp from the partials);
- the per-row tail (the running matrix's step), the walk's hops and the selection: ``authors_walk.py``.

With :data:`FUSED_STATE` (``row_update_triton(fused_state=True)``) the state's step runs inside the logits' launch
(three launches before the hops): each program of :data:`FUSED_TILES` tiles computes the new query's sketches
once (``_sketches``, the state launch's arithmetic, so the two forms agree bit for bit), the tile holding block c
and the programs of the other ring rows compute block c's sketch, and each of the state's writes is made by one
program and read by no other in that launch (the other ring rows are read from the prompt's copy on a restart).
The launch it saves is on the step's critical path; the price is the new query's sketches once per program
(``[16, d] × [d, m]``, the dot's 16 rows for the group's 4 at Llama's shape) and the sketch matrix read by each
program from L2, as its signs (int8, 16 KB at m = d = 128, :func:`sketch_signs`) where every entry is ``±s``, as
their Hadamard sketch's are, else whole (64 KB).

A step reads the key-block sketches up to ``c`` once (the new query's rows) and the cache once (the
probabilities), both bandwidth-bound: a closed block's sketch never changes, so its logits against a ring row
stay valid until the row's slot is overwritten: each step computes the new query's rows (dots inside the logits'
programs) and block ``c``'s column, the cache keeps the rest.

Nothing is read on the host; buffers are cached workspaces or outputs allocated from host-known sizes (capturable);
there are no atomics, so nothing is summed in arrival order and a replay equals an eager call bit for bit.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import (
    cdiv,
    gdc_launch_dependents,
    gdc_wait,
    launch,
    next_pow2,
    pdl_available,
    pdl_launch,
    triton,
    workspace,
)
from .authors_walk import check_state, row_tail_triton

# -- the step in Triton ----------------------------------------------------------------------------------------

if triton is not None:
    import triton.language as tl

    from .authors_walk import key_sum as _key_sum
    from .authors_walk import position as _position
    from .authors_walk import ring as _ring

    @triton.jit
    def _sketches(q_ptr, k_ptr, phi_ptr, sgn_ptr, sabs_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c, s, restart,
                  with_key, feats, f_ok, cap, d, s_qb, s_qh, s_kb, s_kh, s_kn, GROUP: tl.constexpr, BS: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, QUERY: tl.constexpr,
                  SIGNS: tl.constexpr):
        """``(q_new [BLOCK_G, BLOCK_M], ks_c [BLOCK_M])`` over the sketch features ``feats``: the new query's sketches
        (one per query head of KV head g's group; zero unless ``QUERY``) and block c's sketch from its key sum after
        the step (zero unless ``with_key``), over chunks of BLOCK_D dims (a CUDA-core dot holds its operands' whole
        inner dim per thread: chunks keep it in registers). The state's launch and the fused logits' launch compute
        them alike, so both give the same bits. ``SIGNS``: where the sketch matrix is ``±s`` (``sabs_ptr``: s and
        that flag, :func:`sketch_signs`), its entries are made from their signs (int8, ``sgn_ptr``: a quarter of its
        bytes) as the same float32 values."""
        if SIGNS:
            s_abs = tl.load(sabs_ptr)
            signed = tl.load(sabs_ptr + 1) != 0
        dd = tl.arange(0, BLOCK_D)
        gh = tl.arange(0, BLOCK_G)
        g_ok = gh < GROUP
        q_new = tl.zeros([BLOCK_G, BLOCK_M], tl.float32)
        ks_c = tl.zeros([BLOCK_M], tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dc = d0 + dd
            dc_ok = dc < d
            phi_at = feats[None, :] * d + dc[:, None]
            phi_ok = dc_ok[:, None] & f_ok[None, :]
            if SIGNS:
                if signed:
                    neg = tl.load(sgn_ptr + phi_at, mask=phi_ok, other=0) != 0
                    phi_t = tl.where(phi_ok, tl.where(neg, -s_abs, s_abs), 0.0)
                else:
                    phi_t = tl.load(phi_ptr + phi_at, mask=phi_ok, other=0.0)
            else:
                phi_t = tl.load(phi_ptr + phi_at, mask=phi_ok, other=0.0)
            if QUERY:
                qn = tl.load(q_ptr + b * s_qb + (g * GROUP + gh)[:, None] * s_qh + dc[None, :],
                             mask=g_ok[:, None] & dc_ok[None, :], other=0.0).to(tl.float32)
                q_new += tl.dot(qn, phi_t, input_precision="ieee")  # [BLOCK_G, BLOCK_M]
            if with_key:
                k_mean = _key_sum(k_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c, s, restart, dc, dc_ok, cap, d, s_kb,
                                  s_kh, s_kn) / BS
                ks_c += tl.sum(k_mean[:, None] * phi_t, axis=0)
        return q_new, ks_c

    @triton.jit(do_not_specialize=["cap", "w_len", "m", "d", "hq"])
    def _row_state_kernel(q_ptr, k_ptr, lens_ptr, phi_ptr, qs_ptr, pqs_ptr, nq_ptr, pnq_ptr, plen_ptr, ksum_ptr,
                          ks_ptr, pkp_ptr, cap, w_len, m, d, hq, s_qb, s_qh, s_kb, s_kh, s_kn, GROUP: tl.constexpr,
                          BS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_D: tl.constexpr):
        """A program per (row, KV head, chunk of BLOCK_M sketch features): the state's step on the ring and the
        key-block sketches (module docstring, step 1) before the logits' launch reads them: on a restart the group's
        ring rows back to the prompt's, the new query's sketches into slot ``p mod W``, block c's sketch from its
        key sum after the step (which every chunk computes itself and the tail stores, so that no program reads
        what another writes)."""
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        hkv = tl.num_programs(1)
        pos, c, s = _position(lens_ptr, b, BS)
        restart, _, slot = _ring(plen_ptr, nq_ptr, pnq_ptr, b, pos, w_len)
        rows = tl.arange(0, BLOCK_R)
        row_ok = rows < GROUP * w_len
        gh = tl.arange(0, BLOCK_G)
        g_ok = gh < GROUP
        feats = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        f_ok = feats < m
        q_new, ks_c = _sketches(q_ptr, k_ptr, phi_ptr, phi_ptr, phi_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c, s,
                                restart, True, feats, f_ok, cap, d, s_qb, s_qh, s_kb, s_kh, s_kn, GROUP, BS, BLOCK_G,
                                BLOCK_M, BLOCK_D, True, False)
        ring_base = (b * hq + g * GROUP) * w_len * m
        if restart:
            ring_at = ring_base + rows[:, None] * m + feats[None, :]
            ring_mask = row_ok[:, None] & f_ok[None, :] & ((rows % w_len) != slot)[:, None]
            tl.store(qs_ptr + ring_at, tl.load(pqs_ptr + ring_at, mask=ring_mask, other=0.0), mask=ring_mask)
        tl.store(qs_ptr + ring_base + (gh * w_len + slot)[:, None] * m + feats[None, :], q_new,
                 mask=g_ok[:, None] & f_ok[None, :])
        tl.store(ks_ptr + ((b * hkv + g) * cap + c) * m + feats, ks_c, mask=f_ok)

    @triton.jit
    def _fold(mx, se, x):
        """``(max, Σ exp(· − max))`` per row of ``mx, se [R]`` with the values ``x [R, N]`` added (−inf: none)."""
        big = tl.maximum(mx, tl.max(x, 1))
        safe = tl.where(big == float("-inf"), 0.0, big)
        return big, se * tl.exp(mx - safe) + tl.sum(tl.exp(x - safe[:, None]), 1)

    @triton.jit
    def _plus(mx, se, x):
        """``(max, Σ exp(· − max))`` with the finite ``x`` (same shape) added."""
        big = tl.maximum(mx, x)
        return big, se * tl.exp(mx - big) + tl.exp(x - big)

    @triton.jit
    def _closed_sums(lg_ptr, at, rows_ok, c, cap, scale, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        """``(max, Σ exp(· − max))`` of the cached scaled logits of the ring rows at ``at`` over the blocks j < c,
        in one pass of BLOCK_N blocks at a time (the sum rescaled when the max grows)."""
        mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
        se = tl.zeros([BLOCK_R], tl.float32)
        for x0 in range(0, c, BLOCK_N):
            j = x0 + tl.arange(0, BLOCK_N)
            ok = rows_ok[:, None] & (j < c)[None, :]
            lg = tl.load(lg_ptr + at[:, None] * cap + j[None, :], mask=ok, other=0.0)
            mx, se = _fold(mx, se, tl.where(ok, lg * scale, float("-inf")))
        return mx, se

    @triton.jit
    def _column(qs_ptr, ks_ptr, ring_base, k_at, rows, r_ok, m, BLOCK_M: tl.constexpr):
        """``[BLOCK_R]``: the ring rows ``rows`` of a KV head against one key-block sketch (at ``k_at``)."""
        acc = tl.zeros(rows.shape, tl.float32)
        for f0 in range(0, m, BLOCK_M):
            f = f0 + tl.arange(0, BLOCK_M)
            f_ok = f < m
            qr = tl.load(qs_ptr + ring_base + rows[:, None] * m + f[None, :], mask=r_ok[:, None] & f_ok[None, :],
                         other=0.0)
            acc += tl.sum(qr * tl.load(ks_ptr + k_at + f, mask=f_ok, other=0.0)[None, :], 1)
        return acc

    @triton.jit(do_not_specialize=["cap", "p_cap", "w_len", "m", "n_rows", "n_tiles", "d"])
    def _row_logits_kernel(lens_ptr, plen_ptr, qs_ptr, ks_ptr, lg_ptr, plg_ptr, cmx_ptr, cse_ptr, pcmx_ptr,
                           pcse_ptr, ncl_ptr, mx_ptr, se_ptr, tmx_ptr, tse_ptr, q_ptr, k_ptr, phi_ptr, sgn_ptr,
                           sabs_ptr, pqs_ptr, pkp_ptr, ksum_ptr, scr_ptr, cap, p_cap, w_len, m, n_rows, n_tiles, d,
                           s_qb, s_qh, s_kb, s_kh, s_kn, scale, GROUP: tl.constexpr, BS: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, TILES: tl.constexpr, FUSED: tl.constexpr,
                           PDL: tl.constexpr):
        """The incremental logits, a program per (row, KV head, tile of BLOCK_N blocks) up to block c: the new
        query's ring rows against the tile (into the cache, and their max and Σ exp over the tile's closed blocks
        into the tile's partials), on a restart the other ring rows' logits against closed blocks from the
        prompt's copy. The first programs also take BLOCK_R of the other ring rows each: block c's column, the
        blocks closed since the last step folded into their closed sums (recomputed from the sketches: a step that
        skips ahead folds every skipped block; one that steps back folds the cache's [0, c) again), and their max
        and Σ exp over the row's blocks for the probabilities' launch, which records the closed count (read
        here by every such program).

        ``FUSED`` (the state's step in this launch, no ``_row_state_kernel`` before it), a program per (row, KV
        head, TILES tiles): the program computes the new query's sketches once (``_sketches``, the state launch's
        dot over BLOCK_Q ≥ 16 rows) into its own scratch (``scr_ptr``) and reads them back for its tiles as the
        unfused launch reads the ring; the tile holding block c computes block c's sketch, and the first programs
        compute it for its column and read the ring from the prompt's copy on a restart. The state's writes are
        made by one program each, none read back by another in this launch: the new query's sketches into slot
        ``p mod W`` by program 0, block c's sketch by the tile holding c, the restart's ring rows by the programs
        of the other rows (their own rows)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        hkv = tl.num_programs(1)
        p = tl.program_id(2)
        bg = b * hkv + g
        pos, c, s = _position(lens_ptr, b, BS)
        plen = tl.load(plen_ptr + b)
        restart = (plen >= 0) & (pos == plen)
        slot = pos % w_len
        ring_base = (bg * GROUP) * w_len * m  # (b·Hq + g·GROUP)·W·m
        gh = tl.arange(0, BLOCK_G)
        g_ok = gh < GROUP
        scr_base = (bg * tl.num_programs(2) + p) * GROUP * m
        if FUSED:
            if p * TILES * BLOCK_N <= c:  # the new query's sketches, once, into the program's scratch
                gq = tl.arange(0, BLOCK_Q)
                q_ok = gq < GROUP
                for f0 in range(0, m, BLOCK_M):
                    f = f0 + tl.arange(0, BLOCK_M)
                    f_ok = f < m
                    qn = _sketches(q_ptr, k_ptr, phi_ptr, sgn_ptr, sabs_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c, s,
                                   restart, False, f, f_ok, cap, d, s_qb, s_qh, s_kb, s_kh, s_kn, GROUP, BS, BLOCK_Q,
                                   BLOCK_M, BLOCK_D, True, True)[0]
                    tl.store(scr_ptr + scr_base + gq[:, None] * m + f[None, :], qn, mask=q_ok[:, None] & f_ok[None, :])
                    if p == 0:
                        tl.store(qs_ptr + ring_base + (gq * w_len + slot)[:, None] * m + f[None, :], qn,
                                 mask=q_ok[:, None] & f_ok[None, :])
                tl.debug_barrier()  # (the program's own stores, read back below by other threads)
        for i in tl.static_range(TILES):
            t = p * TILES + i
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            if t * BLOCK_N <= c:
                if restart:
                    for r0 in range(0, n_rows, BLOCK_R):
                        rows = r0 + tl.arange(0, BLOCK_R)
                        ok = ((rows < n_rows) & (rows % w_len != slot))[:, None] & (cols < c)[None, :]
                        at = (bg * n_rows + rows)[:, None]
                        tl.store(lg_ptr + at * cap + cols[None, :],
                                 tl.load(plg_ptr + at * p_cap + cols[None, :], mask=ok, other=0.0), mask=ok)
                col_ok = cols <= c
                holds_c = c < t * BLOCK_N + BLOCK_N
                acc = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
                for f0 in range(0, m, BLOCK_M):
                    f = f0 + tl.arange(0, BLOCK_M)
                    f_ok = f < m
                    tile_at = (bg * cap + cols)[:, None] * m + f[None, :]
                    if FUSED:
                        qn = tl.load(scr_ptr + scr_base + gh[:, None] * m + f[None, :],
                                     mask=g_ok[:, None] & f_ok[None, :], other=0.0, cache_modifier=".cg")
                        kc = _sketches(q_ptr, k_ptr, phi_ptr, sgn_ptr, sabs_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c,
                                       s, restart, holds_c, f, f_ok, cap, d, s_qb, s_qh, s_kb, s_kh, s_kn, GROUP, BS,
                                       BLOCK_Q, BLOCK_M, BLOCK_D, False, True)[1]
                        kt = tl.load(ks_ptr + tile_at, mask=(col_ok & (cols != c))[:, None] & f_ok[None, :],
                                     other=0.0)
                        kt = tl.where((cols == c)[:, None], kc[None, :], kt)
                        if holds_c:
                            tl.store(ks_ptr + (bg * cap + c) * m + f, kc, mask=f_ok)
                    else:
                        qn = tl.load(qs_ptr + ring_base + (gh * w_len + slot)[:, None] * m + f[None, :],
                                     mask=g_ok[:, None] & f_ok[None, :], other=0.0)
                        kt = tl.load(ks_ptr + tile_at, mask=col_ok[:, None] & f_ok[None, :], other=0.0)
                    acc += tl.sum(qn[:, None, :] * kt[None, :, :], 2)
                new_at = bg * n_rows + gh * w_len + slot
                tl.store(lg_ptr + new_at[:, None] * cap + cols[None, :], acc, mask=g_ok[:, None] & col_ok[None, :])
                closed = g_ok[:, None] & (cols < c)[None, :]
                tmx, tse = _fold(tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32),
                                 tl.where(closed, acc * scale, float("-inf")))
                tl.store(tmx_ptr + (bg * n_tiles + t) * GROUP + gh, tmx, mask=g_ok)
                tl.store(tse_ptr + (bg * n_tiles + t) * GROUP + gh, tse, mask=g_ok)
        if p * BLOCK_R < n_rows:  # the other ring rows, BLOCK_R of them per program of the first tiles
            n_prev = tl.load(ncl_ptr + bg)
            back = (restart.to(tl.int32) == 0) & (n_prev > c)
            rows = p * BLOCK_R + tl.arange(0, BLOCK_R)
            r_ok = rows < n_rows
            old = r_ok & (rows % w_len != slot)
            at = bg * n_rows + rows
            if restart:
                cm = tl.load(pcmx_ptr + at, mask=old, other=0.0)
                cs = tl.load(pcse_ptr + at, mask=old, other=0.0)
            else:
                cm = tl.load(cmx_ptr + at, mask=old, other=0.0)
                cs = tl.load(cse_ptr + at, mask=old, other=0.0)
            if back:
                cm, cs = _closed_sums(lg_ptr, at, old, c, cap, scale, BLOCK_R, BLOCK_N)
            for j in range(tl.where(restart | back, c, n_prev), c):
                col = _column(qs_ptr, ks_ptr, ring_base, (bg * cap + j) * m, rows, r_ok, m, BLOCK_M)
                tl.store(lg_ptr + at * cap + j, col, mask=old)
                cm, cs = _plus(cm, cs, col * scale)
            if FUSED:
                col = _fused_column(q_ptr, k_ptr, phi_ptr, sgn_ptr, sabs_ptr, pkp_ptr, ksum_ptr, qs_ptr, pqs_ptr, b, g,
                                    hkv, pos, c, s, restart, ring_base, rows, r_ok, old, cap, m, d, s_qb, s_qh, s_kb,
                                    s_kh, s_kn, GROUP, BS, BLOCK_M, BLOCK_D)
            else:
                col = _column(qs_ptr, ks_ptr, ring_base, (bg * cap + c) * m, rows, r_ok, m, BLOCK_M)
            tl.store(lg_ptr + at * cap + c, col, mask=old)
            tl.store(cmx_ptr + at, cm, mask=old)
            tl.store(cse_ptr + at, cs, mask=old)
            cm, cs = _plus(cm, cs, col * scale)
            tl.store(mx_ptr + at, cm, mask=old)
            tl.store(se_ptr + at, cs, mask=old)

    @triton.jit
    def _fused_column(q_ptr, k_ptr, phi_ptr, sgn_ptr, sabs_ptr, pkp_ptr, ksum_ptr, qs_ptr, pqs_ptr, b, g, hkv, pos, c,
                      s, restart, ring_base, rows, r_ok, old, cap, m, d, s_qb, s_qh, s_kb, s_kh, s_kn,
                      GROUP: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """:func:`_column` of block c for the fused logits' launch: block c's sketch computed here (``_sketches``),
        the ring read from the prompt's copy on a restart, whose rows ``old`` it also writes back into the ring."""
        acc = tl.zeros(rows.shape, tl.float32)
        for f0 in range(0, m, BLOCK_M):
            f = f0 + tl.arange(0, BLOCK_M)
            f_ok = f < m
            kc = _sketches(q_ptr, k_ptr, phi_ptr, sgn_ptr, sabs_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c, s, restart,
                           True, f, f_ok, cap, d, s_qb, s_qh, s_kb, s_kh, s_kn, GROUP, BS, 16, BLOCK_M, BLOCK_D, False,
                           True)[1]
            ring_at = ring_base + rows[:, None] * m + f[None, :]
            if restart:
                qr = tl.load(pqs_ptr + ring_at, mask=r_ok[:, None] & f_ok[None, :], other=0.0)
                tl.store(qs_ptr + ring_at, qr, mask=old[:, None] & f_ok[None, :])
            else:
                qr = tl.load(qs_ptr + ring_at, mask=r_ok[:, None] & f_ok[None, :], other=0.0)
            acc += tl.sum(qr * kc[None, :], 1)
        return acc

    @triton.jit(do_not_specialize=["cap", "w_len", "n_rows", "n_tiles"])
    def _row_probs_kernel(lens_ptr, nq_ptr, pnq_ptr, plen_ptr, lg_ptr, mx_ptr, se_ptr, part_ptr, tmx_ptr, tse_ptr,
                          cmx_ptr, cse_ptr, ncl_ptr, cap, w_len, n_rows, n_tiles, scale, GROUP: tl.constexpr,
                          BS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                          BLOCK_T: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
        """A program per (row, KV head, tile of BLOCK_N key blocks): the tile's probabilities summed over the valid
        ring rows (the slot's age below the ring's count after the step); zero past the row's blocks. The new
        query's ring rows take their max and Σ exp from the logits launch's partials (tiles of TILE blocks) and
        block c, and the first tile's program keeps their closed sums and the count."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        bg = b * tl.num_programs(1) + tl.program_id(1)
        pos, c, _ = _position(lens_ptr, b, BS)
        _, nq_new, slot = _ring(plen_ptr, nq_ptr, pnq_ptr, b, pos, w_len)
        n = c + 1
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = cols < n
        acc = tl.zeros([BLOCK_N], tl.float32)
        if tl.program_id(2) * BLOCK_N < n:
            gh = tl.arange(0, BLOCK_G)
            g_ok = gh < GROUP
            cm = tl.full([BLOCK_G], float("-inf"), tl.float32)
            cs = tl.zeros([BLOCK_G], tl.float32)
            for t0 in range(0, c, BLOCK_T * TILE):  # the tiles holding closed blocks
                tt = t0 // TILE + tl.arange(0, BLOCK_T)
                t_ok = g_ok[:, None] & (tt * TILE < c)[None, :]
                t_at = (bg * n_tiles + tt)[None, :] * GROUP + gh[:, None]
                tm = tl.load(tmx_ptr + t_at, mask=t_ok, other=float("-inf"))
                big = tl.maximum(cm, tl.max(tm, 1))
                safe = tl.where(big == float("-inf"), 0.0, big)
                cs = cs * tl.exp(cm - safe) + tl.sum(tl.load(tse_ptr + t_at, mask=t_ok, other=0.0)
                                                     * tl.exp(tm - safe[:, None]), 1)
                cm = big
            new_at = bg * n_rows + gh * w_len + slot
            if tl.program_id(2) == 0:
                tl.store(cmx_ptr + new_at, cm, mask=g_ok)
                tl.store(cse_ptr + new_at, cs, mask=g_ok)
                tl.store(ncl_ptr + bg, c)
            nm, ns = _plus(cm, cs, tl.load(lg_ptr + new_at * cap + c, mask=g_ok, other=0.0) * scale)
            new_ok = g_ok[:, None] & live[None, :]
            lg_new = tl.load(lg_ptr + new_at[:, None] * cap + cols[None, :], mask=new_ok, other=0.0)
            acc += tl.sum(tl.where(new_ok, tl.exp(lg_new * scale - nm[:, None]) / ns[:, None], 0.0), 0)
            for r0 in range(0, n_rows, BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R)
                age = (slot - rows % w_len + w_len) % w_len
                ok = (rows < n_rows) & (age < nq_new) & (age != 0)  # (the new rows are summed above)
                mx = tl.load(mx_ptr + bg * n_rows + rows, mask=ok, other=0.0)
                se = tl.load(se_ptr + bg * n_rows + rows, mask=ok, other=1.0)
                both = ok[:, None] & live[None, :]
                lg = tl.load(lg_ptr + (bg * n_rows + rows)[:, None] * cap + cols[None, :], mask=both, other=0.0)
                acc += tl.sum(tl.where(both, tl.exp(lg * scale - mx[:, None]) / se[:, None], 0.0), 0)
        tl.store(part_ptr + bg * cap + cols, acc, mask=cols < cap)


def sketch_signs(phi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(signs [m, d] int8, [s, flag] float32)`` of the sketch matrix: 1 where an entry is negative, s the largest
    magnitude and flag 1 where every entry is ``±s`` (their Hadamard sketch is; the fused logits' launch then makes
    the entries from the signs, else it reads ``phi``). Device ops, no host read."""
    mag = phi.abs().amax().reshape(1).float()
    flag = (phi.abs() == mag).all().reshape(1).float()
    return (phi < 0).to(torch.int8).contiguous(), torch.cat([mag, flag])


def _check_state(st) -> None:
    check_state(st, ("logits", "closed_max", "closed_sum", "p_logits", "p_closed_max", "p_closed_sum"))


def feature_chunk(m: int) -> int:
    """Sketch features per chunk of the state launch's dots: 32 at most."""
    return min(32, max(16, next_pow2(m)))


#: key blocks per program of the probabilities' launch and of the logits' launch: more programs than SMs hide the
#: latency (16 and 16 were the fastest of the launch sizes measured, docs/methods/sketchwalk.md)
ROW_TILE = 16
LOGIT_TILE = 16
#: the state's step as its own launch (False: five launches before the hops) or inside the logits' launch (True:
#: four; each logits program then computes the new query's sketches itself, reading the sketch matrix once more)
FUSED_STATE = False
#: the fused form's logits tiles per program: each program computes the new query's sketches once for its tiles
FUSED_TILES = 4


def row_update_triton(st, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                      block_n: int | None = None, block_l: int | None = None, block_m: int | None = None,
                      partial_chunk: int = 64, fused_state: bool | None = None,
                      fused_tiles: int | None = None) -> torch.Tensor:
    """:func:`row_update_reference` in four launches (three with ``fused_state``; float32 state; ``q``, ``k`` any
    float dtype with a contiguous last dim; ``lengths`` int32 preferred): the state's step (``_row_state_kernel``),
    the logit cache's step (``_row_logits_kernel``, tiles of ``block_l`` blocks, default :data:`LOGIT_TILE`), the
    probabilities summed over the ring rows per tile of ``block_n`` blocks (``_row_probs_kernel``, default
    :data:`ROW_TILE`), and the tail (``authors_walk.row_tail_triton``). Returns ``r [B, C]`` (a workspace: valid
    until the next call).
    ``block_m``: the sketch features per chunk of the state's dots (default :func:`feature_chunk`);
    ``partial_chunk``: the logits' tiles per chunk (a power of two) of the probabilities' reduction of the new
    query's partials. ``fused_state`` (default :data:`FUSED_STATE`): the state's step inside the logits' launch
    (``_row_logits_kernel``'s ``FUSED``; ``block_m`` then unused: the logits' feature chunks), three launches;
    ``fused_tiles`` (default :data:`FUSED_TILES`): its logits tiles per program."""
    _check_state(st)
    fused = FUSED_STATE if fused_state is None else bool(fused_state)
    if fused_tiles is not None and (not isinstance(fused_tiles, int) or fused_tiles < 1):
        raise ValueError(f"fused_tiles: expected a positive int or None, got {fused_tiles!r}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k: expected a contiguous last dim")
    if scale != st.logit_scale:
        raise ValueError(f"scale: the logit cache holds sums at st.logit_scale={st.logit_scale}, got {scale}")
    block_n, block_l = block_n or ROW_TILE, block_l or LOGIT_TILE
    b, hq, d = q.shape
    hkv, cap = st.ks.shape[1], st.ks.shape[2]
    w_len, m = st.qs.shape[2], st.qs.shape[3]
    group = hq // hkv
    n_rows = group * w_len
    n_tiles = cdiv(cap, block_l)
    mx = workspace("sw_authors_mx", q, b * hkv * n_rows, torch.float32)
    se = workspace("sw_authors_se", q, b * hkv * n_rows, torch.float32)
    tmx = workspace("sw_authors_tile_mx", q, b * hkv * n_tiles * group, torch.float32)
    tse = workspace("sw_authors_tile_se", q, b * hkv * n_tiles * group, torch.float32)
    part = workspace("sw_authors_part", q, b * hkv * cap, torch.float32)
    r = workspace("sw_authors_r", q, b * cap, torch.float32)[:b * cap].view(b, cap)
    pdl = pdl_available()
    block_m = block_m or feature_chunk(m)
    block_d = min(32, max(16, next_pow2(d)))
    block_g = max(2, next_pow2(group))
    logit_m = min(32, max(16, next_pow2(m)))
    signs, signed = st.phi, st.phi  # (the fused launch's sketch matrix as signs; unread otherwise)
    if fused:
        if getattr(st, "phi_signs", None) is None:  # a state made elsewhere (tests): once, outside a capture
            st.phi_signs, st.phi_abs = sketch_signs(st.phi)
        signs, signed = st.phi_signs, st.phi_abs
    else:
        launch(_row_state_kernel, (b, hkv, cdiv(m, block_m)), q, k, lengths, st.phi, st.qs, st.p_qs, st.n_queries,
               st.p_nq, st.prompt_len, st.ksum, st.ks, st.p_kpart, cap, w_len, m, d, hq, q.stride(0), q.stride(1),
               k.stride(0), k.stride(1), k.stride(2), GROUP=group, BS=st.block_size,
               BLOCK_R=max(16, next_pow2(n_rows)), BLOCK_G=max(16, next_pow2(group)), BLOCK_M=block_m,
               BLOCK_D=block_d, num_warps=4)
    logit_rows = min(32, max(16, next_pow2(n_rows)))  # (128 ring rows a program: 255 registers on sm_90)
    tiles = (fused_tiles or FUSED_TILES) if fused else 1
    n_prog = max(cdiv(n_tiles, tiles), cdiv(n_rows, logit_rows))
    scratch = workspace("sw_authors_qnew", q, b * hkv * n_prog * group * m if fused else 1, torch.float32)
    # fused: the step's first launch (as the state's is), so launched without programmatic dependent launch
    launch(_row_logits_kernel, (b, hkv, n_prog), lengths, st.prompt_len, st.qs, st.ks, st.logits, st.p_logits,
           st.closed_max, st.closed_sum, st.p_closed_max, st.p_closed_sum, st.n_closed, mx, se, tmx, tse, q, k, st.phi,
           signs, signed, st.p_qs, st.p_kpart, st.ksum, scratch, cap, st.p_logits.shape[-1], w_len, m, n_rows, n_tiles,
           d, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), float(scale), GROUP=group,
           BS=st.block_size, BLOCK_G=block_g, BLOCK_N=block_l, BLOCK_R=logit_rows, BLOCK_M=logit_m, BLOCK_D=block_d,
           BLOCK_Q=max(16, next_pow2(group)), TILES=tiles, FUSED=fused, PDL=pdl, num_warps=4,
           **pdl_launch(pdl and not fused))
    launch(_row_probs_kernel, (b, hkv, cdiv(cap, block_n)), lengths, st.n_queries, st.p_nq, st.prompt_len, st.logits,
           mx, se, part, tmx, tse, st.closed_max, st.closed_sum, st.n_closed, cap, w_len, n_rows, n_tiles, float(scale),
           GROUP=group, BS=st.block_size, BLOCK_R=min(64, max(16, next_pow2(n_rows))),
           BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_T=min(partial_chunk, max(2, next_pow2(n_tiles))), TILE=block_l,
           PDL=pdl, num_warps=4, **pdl_launch(pdl))
    row_tail_triton(st, part, r, k, lengths, pdl=pdl)
    st.fresh_rows = False
    return r


