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
        dd = tl.arange(0, BLOCK_D)
        gh = tl.arange(0, BLOCK_G)
        g_ok = gh < GROUP
        feats = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        f_ok = feats < m
        # the new query's sketches (one per query head of the group) and block c's, over chunks of BLOCK_D dims
        # (a CUDA-core dot holds its operands' whole inner dim per thread: chunks keep it in registers)
        q_new = tl.zeros([BLOCK_G, BLOCK_M], tl.float32)
        ks_c = tl.zeros([BLOCK_M], tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dc = d0 + dd
            dc_ok = dc < d
            phi_t = tl.load(phi_ptr + feats[None, :] * d + dc[:, None], mask=dc_ok[:, None] & f_ok[None, :],
                            other=0.0)
            qn = tl.load(q_ptr + b * s_qb + (g * GROUP + gh)[:, None] * s_qh + dc[None, :],
                         mask=g_ok[:, None] & dc_ok[None, :], other=0.0).to(tl.float32)
            q_new += tl.dot(qn, phi_t, input_precision="ieee")  # [BLOCK_G, BLOCK_M]
            k_mean = _key_sum(k_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c, s, restart, dc, dc_ok, cap, d, s_kb, s_kh,
                              s_kn) / BS
            ks_c += tl.sum(k_mean[:, None] * phi_t, axis=0)
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
    def _cache_at(bg, blocks, rows, cap, n_rows):
        """Offsets in the logit cache ``[B·Hkv, C, G·W]`` (block-major: a block's ring rows side by side) of the ring
        rows ``rows`` of (row, KV head) ``bg`` against the key blocks ``blocks`` (broadcast together)."""
        return (bg * cap + blocks) * n_rows + rows

    @triton.jit
    def _closed_sums(lg_ptr, bg, rows, rows_ok, c, cap, n_rows, scale, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        """``(max, Σ exp(· − max))`` of the cached scaled logits of the ring rows ``rows`` of (row, KV head) ``bg``
        over the blocks j < c, in one pass of BLOCK_N blocks at a time (the sum rescaled when the max grows)."""
        mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
        se = tl.zeros([BLOCK_R], tl.float32)
        for x0 in range(0, c, BLOCK_N):
            j = x0 + tl.arange(0, BLOCK_N)
            ok = rows_ok[:, None] & (j < c)[None, :]
            lg = tl.load(lg_ptr + _cache_at(bg, j[None, :], rows[:, None], cap, n_rows), mask=ok, other=0.0)
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

    @triton.jit(do_not_specialize=["cap", "p_cap", "w_len", "m", "n_rows", "n_tiles"])
    def _row_logits_kernel(lens_ptr, plen_ptr, qs_ptr, ks_ptr, lg_ptr, plg_ptr, cmx_ptr, cse_ptr, pcmx_ptr,
                           pcse_ptr, ncl_ptr, mx_ptr, se_ptr, tmx_ptr, tse_ptr, cap, p_cap, w_len, m, n_rows, n_tiles,
                           scale, GROUP: tl.constexpr, BS: tl.constexpr, BLOCK_G: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
        """The incremental logits, a program per (row, KV head, tile of BLOCK_N blocks) up to block c: the new
        query's ring rows against the tile (into the cache, and their max and Σ exp over the tile's closed blocks
        into the tile's partials), on a restart the other ring rows' logits against closed blocks from the
        prompt's copy. The first programs also take BLOCK_R of the other ring rows each: block c's column, the
        blocks closed since the last step folded into their closed sums (recomputed from the sketches: a step that
        skips ahead folds every skipped block; one that steps back folds the cache's [0, c) again), and their max
        and Σ exp over the row's blocks for the probabilities' launch, which records the closed count (read
        here by every such program)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        t = tl.program_id(2)
        bg = b * tl.num_programs(1) + g
        pos, c, _ = _position(lens_ptr, b, BS)
        plen = tl.load(plen_ptr + b)
        restart = (plen >= 0) & (pos == plen)
        slot = pos % w_len
        ring_base = (bg * GROUP) * w_len * m  # (b·Hq + g·GROUP)·W·m
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if t * BLOCK_N <= c:
            if restart:
                for r0 in range(0, n_rows, BLOCK_R):
                    rows = r0 + tl.arange(0, BLOCK_R)
                    ok = ((rows < n_rows) & (rows % w_len != slot))[:, None] & (cols < c)[None, :]
                    tl.store(lg_ptr + _cache_at(bg, cols[None, :], rows[:, None], cap, n_rows),
                             tl.load(plg_ptr + _cache_at(bg, cols[None, :], rows[:, None], p_cap, n_rows), mask=ok,
                                     other=0.0), mask=ok)
            gh = tl.arange(0, BLOCK_G)
            g_ok = gh < GROUP
            col_ok = cols <= c
            acc = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
            for f0 in range(0, m, BLOCK_M):
                f = f0 + tl.arange(0, BLOCK_M)
                f_ok = f < m
                qn = tl.load(qs_ptr + ring_base + (gh * w_len + slot)[:, None] * m + f[None, :],
                             mask=g_ok[:, None] & f_ok[None, :], other=0.0)
                kt = tl.load(ks_ptr + (bg * cap + cols)[:, None] * m + f[None, :], mask=col_ok[:, None] & f_ok[None, :],
                             other=0.0)
                acc += tl.sum(qn[:, None, :] * kt[None, :, :], 2)
            tl.store(lg_ptr + _cache_at(bg, cols[None, :], (gh * w_len + slot)[:, None], cap, n_rows), acc,
                     mask=g_ok[:, None] & col_ok[None, :])
            closed = g_ok[:, None] & (cols < c)[None, :]
            tmx, tse = _fold(tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32),
                             tl.where(closed, acc * scale, float("-inf")))
            tl.store(tmx_ptr + (bg * n_tiles + t) * GROUP + gh, tmx, mask=g_ok)
            tl.store(tse_ptr + (bg * n_tiles + t) * GROUP + gh, tse, mask=g_ok)
        if t * BLOCK_R < n_rows:  # the other ring rows, BLOCK_R of them per program of the first tiles
            n_prev = tl.load(ncl_ptr + bg)
            back = (restart.to(tl.int32) == 0) & (n_prev > c)
            rows = t * BLOCK_R + tl.arange(0, BLOCK_R)
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
                cm, cs = _closed_sums(lg_ptr, bg, rows, old, c, cap, n_rows, scale, BLOCK_R, BLOCK_N)
            for j in range(tl.where(restart | back, c, n_prev), c):
                col = _column(qs_ptr, ks_ptr, ring_base, (bg * cap + j) * m, rows, r_ok, m, BLOCK_M)
                tl.store(lg_ptr + _cache_at(bg, j, rows, cap, n_rows), col, mask=old)
                cm, cs = _plus(cm, cs, col * scale)
            col = _column(qs_ptr, ks_ptr, ring_base, (bg * cap + c) * m, rows, r_ok, m, BLOCK_M)
            tl.store(lg_ptr + _cache_at(bg, c, rows, cap, n_rows), col, mask=old)
            tl.store(cmx_ptr + at, cm, mask=old)
            tl.store(cse_ptr + at, cs, mask=old)
            cm, cs = _plus(cm, cs, col * scale)
            tl.store(mx_ptr + at, cm, mask=old)
            tl.store(se_ptr + at, cs, mask=old)

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
            new_rows = gh * w_len + slot
            lg_c = tl.load(lg_ptr + _cache_at(bg, c, new_rows, cap, n_rows), mask=g_ok, other=0.0)
            nm, ns = _plus(cm, cs, lg_c * scale)
            new_ok = g_ok[:, None] & live[None, :]
            lg_new = tl.load(lg_ptr + _cache_at(bg, cols[None, :], new_rows[:, None], cap, n_rows), mask=new_ok,
                             other=0.0)
            acc += tl.sum(tl.where(new_ok, tl.exp(lg_new * scale - nm[:, None]) / ns[:, None], 0.0), 0)
            for r0 in range(0, n_rows, BLOCK_R):
                rows = r0 + tl.arange(0, BLOCK_R)
                age = (slot - rows % w_len + w_len) % w_len
                ok = (rows < n_rows) & (age < nq_new) & (age != 0)  # (the new rows are summed above)
                mx = tl.load(mx_ptr + bg * n_rows + rows, mask=ok, other=0.0)
                se = tl.load(se_ptr + bg * n_rows + rows, mask=ok, other=1.0)
                both = ok[:, None] & live[None, :]
                lg = tl.load(lg_ptr + _cache_at(bg, cols[None, :], rows[:, None], cap, n_rows), mask=both, other=0.0)
                acc += tl.sum(tl.where(both, tl.exp(lg * scale - mx[:, None]) / se[:, None], 0.0), 0)
        tl.store(part_ptr + bg * cap + cols, acc, mask=cols < cap)


def _check_state(st) -> None:
    check_state(st, ("logits", "closed_max", "closed_sum", "p_logits", "p_closed_max", "p_closed_sum"))


def feature_chunk(m: int) -> int:
    """Sketch features per chunk of the state launch's dots: 32 at most."""
    return min(32, max(16, next_pow2(m)))


#: key blocks per program of the probabilities' launch and of the logits' launch: more programs than SMs hide the
#: latency (16 and 16 were the fastest of the launch sizes measured, docs/methods/sketchwalk.md)
ROW_TILE = 16
LOGIT_TILE = 16
#: ring rows per step of a probabilities program (of the G·W a KV head has): 32 took 15.2 µs against 22.6 at 64
#: and 26.5 at 128 a layer at 128k batch 1 (21.4 / 29.9 / 43.3 at 32k batch 8; H200, launch alone, cold L2)
PROB_ROWS = 32


def row_update_triton(st, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                      block_n: int | None = None, block_l: int | None = None, block_m: int | None = None,
                      partial_chunk: int = 64) -> torch.Tensor:
    """:func:`row_update_reference` in four launches (float32 state; ``q``, ``k`` any float dtype with a contiguous
    last dim; ``lengths`` int32 preferred): the state's step (``_row_state_kernel``), the logit cache's step
    (``_row_logits_kernel``, tiles of ``block_l`` blocks, default :data:`LOGIT_TILE`), the probabilities summed
    over the ring rows per tile of ``block_n`` blocks (``_row_probs_kernel``, default :data:`ROW_TILE`), and the
    tail (``authors_walk.row_tail_triton``). Returns ``r [B, C]`` (a workspace: valid until the next call).
    ``block_m``: the sketch features per chunk of the state's dots (default :func:`feature_chunk`);
    ``partial_chunk``: the logits' tiles per chunk (a power of two) of the probabilities' reduction of the new
    query's partials."""
    _check_state(st)
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
    launch(_row_state_kernel, (b, hkv, cdiv(m, block_m)), q, k, lengths, st.phi, st.qs, st.p_qs, st.n_queries,
           st.p_nq, st.prompt_len, st.ksum, st.ks, st.p_kpart, cap, w_len, m, d, hq, q.stride(0), q.stride(1),
           k.stride(0), k.stride(1), k.stride(2), GROUP=group, BS=st.block_size, BLOCK_R=max(16, next_pow2(n_rows)),
           BLOCK_G=max(16, next_pow2(group)), BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
    logit_rows = min(32, max(16, next_pow2(n_rows)))  # (128 ring rows a program: 255 registers on sm_90)
    launch(_row_logits_kernel, (b, hkv, max(n_tiles, cdiv(n_rows, logit_rows))), lengths, st.prompt_len, st.qs,
           st.ks, st.logits, st.p_logits, st.closed_max, st.closed_sum, st.p_closed_max, st.p_closed_sum,
           st.n_closed, mx, se, tmx, tse, cap, st.p_logits.shape[-2], w_len, m, n_rows, n_tiles, float(scale),
           GROUP=group, BS=st.block_size, BLOCK_G=block_g, BLOCK_N=block_l, BLOCK_R=logit_rows,
           BLOCK_M=min(32, max(16, next_pow2(m))), PDL=pdl, num_warps=4, **pdl_launch(pdl))
    launch(_row_probs_kernel, (b, hkv, cdiv(cap, block_n)), lengths, st.n_queries, st.p_nq, st.prompt_len, st.logits,
           mx, se, part, tmx, tse, st.closed_max, st.closed_sum, st.n_closed, cap, w_len, n_rows, n_tiles, float(scale),
           GROUP=group, BS=st.block_size, BLOCK_R=min(PROB_ROWS, max(16, next_pow2(n_rows))),
           BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_T=min(partial_chunk, max(2, next_pow2(n_tiles))), TILE=block_l,
           PDL=pdl, num_warps=4, **pdl_launch(pdl))
    row_tail_triton(st, part, r, k, lengths, pdl=pdl)
    st.fresh_rows = False
    return r


