"""S²ANTA-flash and S²ANTA-prop decode kernels in Triton.

Torch references: ``kvsieve.kernels.santa.reference.santa_flash_reference`` and
``santa_prop_reference`` (float64). Given the uniforms of ``triton_utils.tile_uniforms`` /
``budget_uniforms`` the kernels draw the same counts, except for rare floor-boundary flips: scores
are float32 here, and the running sums of systematic sampling are fixed-point integers with 2^-24
resolution (exact prefix sums, so every tile's counts add up to its budget to the unit): int32 with
2^(30 − bits(S)) resolution up to S = 16383, int64 with 2^-24 beyond.

Layout and grid: q ``[B, Hq, d]``, K/V ``[B, Hkv, N, d]`` (the transformers cache; last dim
contiguous), ``lens [B]`` valid prefix lengths. One program per (tile, KV head, batch row) loads the
K tile once for the G query heads of its group; V rows are loaded with a row mask, so rows that no
head of the group sampled issue no memory traffic; the V accumulation is ``tl.dot(counts, V)``.

- prop (3 launches): ``_tile_stats_kernel`` (per-tile max m, sum l, and the float32 score stash)
  → ``_prop_budget_kernel`` (one program per head: largest remainder or systematic rounding of the
  tile budgets) → the sampling pass with the merge ``out = Σ_t acc_t / S`` folded in (float32
  atomics, the last program per (row, KV head) writes ``out``): v8's ``_compact_sample_kernel``
  (default: the whole tile's counts on the G rows, the sampled rows compacted and gathered into one
  dot) or v7's ``_tile_sample_kernel`` (``compact=False``; ``fold_merge=False`` adds the merge kernel).
- flash (2 launches): up to 32 tiles ``_flash_tile_kernel`` (tile stats +
  ``S_tile = max(1, S // T_b)`` systematic samples + gather) then the split-KV merge with weights
  ``e^{m_t} l_t``; otherwise (v8) the stats pass, which also keeps each head's global max, then
  ``_compact_sample_kernel`` with the merge folded in.
- From ``FLASH_OVERLAP_MIN_TILES`` (flash) / ``PROP_OVERLAP_MIN_TILES`` (prop) tiles in all (rows × KV
  heads × tiles per head), where programmatic
  dependent launch is on (Hopper and newer), both run v10 (``santa.overlap``): the same passes,
  the stats in (row, KV head) order and the later kernels launched early, each program waiting for its
  own (row, KV head), so that sampling overlaps the K stream.

Host path: launches go through ``triton_utils.launch`` (cached compiled kernels) and scratch buffers
come from ``triton_utils.workspace`` (cached per device), with explicit strides of flat buffers.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from ..triton_utils import (
    STREAM_BUDGET,
    STREAM_TILE,
    group_block,
    is_interpreted,
    launch,
    merge_partials_raw,
    next_pow2,
    seed_words,
    triton,
    workspace,
)

if triton is not None:
    import triton.language as tl

    from ..triton_utils import hash_uniform

    # Triton compiles an int argument equal to 1 as a constexpr, on which ``budget.to(...)`` fails: the
    # kernels that take the budget keep it a runtime value (budget = 1 is a valid call)
    budget_jit = triton.jit(do_not_specialize=["budget"])

    try:  # programmatic dependent launch (Hopper); absent from older Triton releases
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # pragma: no cover - depends on the installed Triton
        gdc_launch_dependents = gdc_wait = None

    @triton.jit
    def _score_block(q, k_base, u_base, offs_n, length, scale, s_k_n, g_ok, D: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
        """Scores of one sub-block of keys ``offs_n`` for the G heads, stashed (float32, -inf past the row's
        length) and returned."""
        n_ok = offs_n < length
        k = tl.load(k_base + offs_n[:, None] * s_k_n + tl.arange(0, D)[None, :], mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        tl.store(u_base + offs_n[None, :], s, mask=g_ok[:, None])
        return s

    @triton.jit
    def _fold_scores(m, l, s):
        """The running max m and sum l of e^{s - m} with the scores s [G, n] folded in."""
        m_new = tl.maximum(m, tl.max(s, axis=1))
        return m_new, l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)

    @triton.jit
    def _score_tile(q_ptr, k_ptr, stash_ptr, b, kvh, t, length, scale,
                    s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_u_b, s_u_h,
                    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Scores of one tile for the G heads, in pipelined sub-blocks: stashed (float32, -inf past
        the row's length) and reduced to the tile's max m and sum l = Σ e^{s - m}."""
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + b * s_q_b + heads[:, None] * s_q_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        k_base = k_ptr + b * s_k_b + kvh * s_k_h
        u_base = stash_ptr + b * s_u_b + heads[:, None] * s_u_h
        for j in range(0, TILE // BLOCK_N):
            s = _score_block(q, k_base, u_base, t * TILE + j * BLOCK_N + tl.arange(0, BLOCK_N), length, scale, s_k_n,
                             g_ok, D, DOT_PRECISION)
            m, l = _fold_scores(m, l, s)
        return m, l

    @triton.jit
    def _count_dot(c, v, SPLIT_COUNTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """``c [BLOCK_G, n] (int) @ v [n, D]`` in float32."""
        if SPLIT_COUNTS:
            # 16-bit dots hold integers exactly only up to 256: counts above that (possible only
            # for per-tile budgets over 256) are split into two bytes.
            out = tl.dot((c & 255).to(tl.float32).to(v.dtype), v, input_precision=DOT_PRECISION)
            out += 256.0 * tl.dot((c >> 8).to(tl.float32).to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            out = tl.dot(c.to(tl.float32).to(v.dtype), v, input_precision=DOT_PRECISION)
        return out

    @triton.jit
    def _sample_tile(v_ptr, stash_ptr, counts_ptr, b, kvh, t, length, m, l, budget, a0,
                     s_v_b, s_v_h, s_v_n, s_u_b, s_u_h, s_c_b, s_c_h,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                     SAMPLE_N: tl.constexpr, SPLIT_COUNTS: tl.constexpr, WRITE_COUNTS: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr):
        """Systematic sampling of ``budget [BLOCK_G]`` draws inside one tile with weights e^{s - m}
        (from the stash) and ``Σ_n c_n V_n`` [BLOCK_G, D] (float32), reading only sampled V rows.

        Running sums are fixed-point integers (2^-FIX_BITS resolution), so consecutive keys share their
        boundary exactly; sums are clamped at the budget, and whatever rounding left short of it is
        given to the last key of positive weight, so each head's counts add up to its budget."""
        FIX: tl.constexpr = 1 << FIX_BITS
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        # int32 running sums when (budget + 1)·2^FIX_BITS fits (fewer registers), else int64.
        if WIDE:
            top = budget.to(tl.int64) * FIX
            a = (a0 * FIX).to(tl.int64)
            carry = tl.zeros([BLOCK_G], tl.int64)
        else:
            top = budget * FIX
            a = (a0 * FIX).to(tl.int32)
            carry = tl.zeros([BLOCK_G], tl.int32)
        norm = tl.where(l > 0, budget.to(tl.float32) / tl.where(l > 0, l, 1.0), 0.0)
        m_safe = tl.where(g_ok, m, 0.0)
        last = tl.full([BLOCK_G], -1, tl.int32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        u_base = stash_ptr + b * s_u_b + heads[:, None] * s_u_h
        v_base = v_ptr + b * s_v_b + kvh * s_v_h
        for j in range(0, TILE // SAMPLE_N):
            offs_n = t * TILE + j * SAMPLE_N + tl.arange(0, SAMPLE_N)
            n_ok = offs_n < length
            s = tl.load(u_base + offs_n[None, :], mask=g_ok[:, None] & n_ok[None, :], other=float("-inf"))
            x = tl.exp(s - m_safe[:, None]) * norm[:, None]
            xi = (x * FIX + 0.5).to(carry.dtype)
            hi = carry[:, None] + tl.cumsum(xi, axis=1)
            c = ((a[:, None] + tl.minimum(hi, top[:, None])) >> FIX_BITS) \
                - ((a[:, None] + tl.minimum(hi - xi, top[:, None])) >> FIX_BITS)
            carry += tl.sum(xi, axis=1)
            last = tl.maximum(last, tl.max(tl.where(xi > 0, offs_n[None, :], -1), axis=1))
            used = (tl.max(c, axis=0) > 0) & n_ok
            v = tl.load(v_base + offs_n[:, None] * s_v_n + offs_d[None, :], mask=used[:, None], other=0.0)
            acc += _count_dot(c, v, SPLIT_COUNTS, DOT_PRECISION)
            if WRITE_COUNTS:
                tl.store(counts_ptr + b * s_c_b + heads[:, None] * s_c_h + offs_n[None, :], c.to(tl.int32),
                         mask=g_ok[:, None] & n_ok[None, :])
        drawn = ((a + tl.minimum(carry, top)) >> FIX_BITS) - (a >> FIX_BITS)
        short = budget - drawn.to(tl.int32)
        fix = g_ok & (short > 0) & (last >= 0)
        if tl.max(fix.to(tl.int32), axis=0) > 0:
            row = tl.load(v_base + last[:, None] * s_v_n + offs_d[None, :], mask=fix[:, None], other=0.0)
            acc += tl.where(fix, short, 0).to(tl.float32)[:, None] * row.to(tl.float32)
            if WRITE_COUNTS:
                tl.debug_barrier()
                c_ptr = counts_ptr + b * s_c_b + heads * s_c_h + last
                tl.store(c_ptr, tl.load(c_ptr, mask=fix, other=0) + short, mask=fix)
        return acc

    @triton.jit
    def _sample_tile_any(v_ptr, stash_ptr, counts_ptr, b, kvh, t, length, m, l, budget, a0,
                         s_v_b, s_v_h, s_v_n, s_u_b, s_u_h, s_c_b, s_c_h,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                         SAMPLE_N: tl.constexpr, MAY_SPLIT: tl.constexpr, WRITE_COUNTS: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr):
        """``_sample_tile`` with split 16-bit dots only where a tile's budget can put > 256 samples on a key."""
        if MAY_SPLIT:
            if tl.max(budget, axis=0) > 256:
                acc = _sample_tile(v_ptr, stash_ptr, counts_ptr, b, kvh, t, length, m, l, budget, a0,
                                   s_v_b, s_v_h, s_v_n, s_u_b, s_u_h, s_c_b, s_c_h,
                                   G, BLOCK_G, D, TILE, SAMPLE_N, True, WRITE_COUNTS, DOT_PRECISION, FIX_BITS, WIDE)
            else:
                acc = _sample_tile(v_ptr, stash_ptr, counts_ptr, b, kvh, t, length, m, l, budget, a0,
                                   s_v_b, s_v_h, s_v_n, s_u_b, s_u_h, s_c_b, s_c_h,
                                   G, BLOCK_G, D, TILE, SAMPLE_N, False, WRITE_COUNTS, DOT_PRECISION, FIX_BITS, WIDE)
        else:
            acc = _sample_tile(v_ptr, stash_ptr, counts_ptr, b, kvh, t, length, m, l, budget, a0,
                               s_v_b, s_v_h, s_v_n, s_u_b, s_u_h, s_c_b, s_c_h,
                               G, BLOCK_G, D, TILE, SAMPLE_N, False, WRITE_COUNTS, DOT_PRECISION, FIX_BITS, WIDE)
        return acc

    @budget_jit
    def _flash_tile_kernel(
        q_ptr, k_ptr, v_ptr, lens_ptr, stash_ptr, acc_ptr, m_ptr, l_ptr, counts_ptr,
        scale, budget, seed_lo, seed_hi, stream_key, n_tiles, hq,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n, s_u_b, s_u_h,
        s_acc_b, s_acc_h, s_acc_p, s_ml_b, s_ml_h, s_c_b, s_c_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
        SAMPLE_N: tl.constexpr, SPLIT_COUNTS: tl.constexpr, WRITE_COUNTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        FIX_BITS: tl.constexpr, WIDE: tl.constexpr,
    ):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        if t * TILE < length:
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = kvh * G + offs_g
            m, l = _score_tile(q_ptr, k_ptr, stash_ptr, b, kvh, t, length, scale,
                               s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_u_b, s_u_h,
                               G, BLOCK_G, D, TILE, BLOCK_N, DOT_PRECISION)
            tl.debug_barrier()  # the stash written above is read back by other threads
            tiles_b = (length + TILE - 1) // TILE
            s_tile = tl.maximum(budget // tiles_b, 1)
            row_budget = tl.where(g_ok, s_tile, 0)
            a0 = hash_uniform(seed_lo, seed_hi, stream_key, (b * hq + heads).to(tl.int64) * n_tiles + t)
            acc = _sample_tile_any(v_ptr, stash_ptr, counts_ptr, b, kvh, t, length, m, l, row_budget, a0,
                                   s_v_b, s_v_h, s_v_n, s_u_b, s_u_h, s_c_b, s_c_h,
                                   G, BLOCK_G, D, TILE, SAMPLE_N, SPLIT_COUNTS, WRITE_COUNTS, DOT_PRECISION,
                                   FIX_BITS, WIDE)
            # The merge weighs parts by e^{m} l: store l·Õ/S_tile so that the tile estimate gets W_t/Z.
            acc = acc * (l / s_tile.to(tl.float32))[:, None]
            offs_d = tl.arange(0, D)
            tl.store(acc_ptr + b * s_acc_b + heads[:, None] * s_acc_h + t * s_acc_p + offs_d[None, :],
                     acc, mask=g_ok[:, None])
            tl.store(m_ptr + b * s_ml_b + heads * s_ml_h + t, m, mask=g_ok)
            tl.store(l_ptr + b * s_ml_b + heads * s_ml_h + t, l, mask=g_ok)

    @triton.jit
    def _stats_tiles(q_ptr, k_ptr, m_ptr, l_ptr, stash_ptr, mstar_ptr, b, kvh, t0, t1, length, scale, hq,
                     s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                     BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TRACK_MAX: tl.constexpr):
        """Tiles t0..t1-1 of (row b, KV head kvh): per-tile max m and sum l of e^{s-m}, and the float32
        score stash, streamed in one pipelined loop over sub-blocks (long streams keep K loads in flight),
        resetting (m, l) at each tile start. ``TRACK_MAX``: also folds the max of these scores into
        ``mstar [B·Hq]`` (float32 atomic max)."""
        SUBS: tl.constexpr = TILE // BLOCK_N
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + b * s_q_b + heads[:, None] * s_q_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        k_base = k_ptr + b * s_k_b + kvh * s_k_h
        u_base = stash_ptr + b * s_u_b + heads[:, None] * s_u_h
        ml_base = b * s_ml_b + heads * s_ml_h
        m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for j in range(t0 * SUBS, t1 * SUBS):
            s = _score_block(q, k_base, u_base, j * BLOCK_N + tl.arange(0, BLOCK_N), length, scale, s_k_n, g_ok, D,
                             DOT_PRECISION)
            first = (j % SUBS) == 0
            m, l = _fold_scores(tl.where(first, float("-inf"), m), tl.where(first, 0.0, l), s)
            if TRACK_MAX:
                m_all = tl.maximum(m_all, m)
            done = (j % SUBS) == SUBS - 1
            tl.store(m_ptr + ml_base + j // SUBS, m, mask=g_ok & done)
            tl.store(l_ptr + ml_base + j // SUBS, l, mask=g_ok & done)
        if TRACK_MAX:
            tl.atomic_max(mstar_ptr + b * hq + heads, m_all, mask=g_ok, sem="relaxed")

    @triton.jit
    def _tile_stats_kernel(
        q_ptr, k_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, mstar_ptr,
        scale, tiles_per_program, hq,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, TRACK_MAX: tl.constexpr, PDL: tl.constexpr,
    ):
        """Pass 1: ``_stats_tiles`` over ``tiles_per_program`` consecutive tiles per program; with
        ``TRACK_MAX`` each head's global max is left in ``mstar``, so that the sampling pass knows it
        without reading all tiles."""
        if PDL:  # the next kernel may launch now: its programs wait (gdc_wait) until this one is done
            gdc_launch_dependents()
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        tiles_b = (length + TILE - 1) // TILE
        t0 = pid * tiles_per_program
        t1 = tl.minimum(t0 + tiles_per_program, tiles_b)
        if t0 < t1:
            _stats_tiles(q_ptr, k_ptr, m_ptr, l_ptr, stash_ptr, mstar_ptr, b, kvh, t0, t1, length, scale, hq,
                         s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
                         G, BLOCK_G, D, TILE, BLOCK_N, DOT_PRECISION, TRACK_MAX)

    @triton.jit
    def _group_budgets(m_ptr, l_ptr, budgets_ptr, heads, h_ok, b, tiles_b, budget, seed_lo, seed_hi, budget_key,
                       n_tiles, hq, s_ml_b, s_ml_h, BLOCK_T: tl.constexpr, SYSTEMATIC: tl.constexpr):
        """The tile budgets of the heads ``heads [R]`` (``h_ok``: real rows) of batch row b, from the tile
        masses W_t = e^{m_t - m*} l_t (Alg. 4): largest remainder (the +1s go to the largest fractional
        parts, ties to the lower tile: a sort of the fractions quantised to 2^-40) or systematic rounding
        (fixed-point prefix sums with 2^-32 resolution). (m, l) are read from L2 (``.cg``): in the one-pass
        kernel other programs wrote them during the same launch."""
        cols = tl.arange(0, BLOCK_T)
        ok = h_ok[:, None] & (cols < tiles_b)[None, :]
        row = (b * s_ml_b + heads * s_ml_h)[:, None] + cols[None, :]
        m = tl.load(m_ptr + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(l_ptr + row, mask=ok, other=0.0, cache_modifier=".cg")
        m_star = tl.max(m, axis=1)
        w = tl.where(ok, tl.exp(m - tl.where(h_ok, m_star, 0.0)[:, None]) * l, 0.0).to(tl.float64)
        z = tl.sum(w, axis=1)
        share = w * (budget.to(tl.float64) / tl.where(z > 0, z, 1.0))[:, None]
        if SYSTEMATIC:
            a_b = hash_uniform(seed_lo, seed_hi, budget_key, (b * hq + heads).to(tl.int64))
            x = tl.floor(share * 4294967296.0).to(tl.int64)
            top = budget.to(tl.int64) << 32
            hi = tl.cumsum(x, axis=1)
            a = (a_b * 4294967296.0).to(tl.int64)[:, None]
            bt = ((a + tl.minimum(hi, top)) >> 32) - ((a + tl.minimum(hi - x, top)) >> 32)
            drawn = tl.sum(bt, axis=1)
            last = tl.max(tl.where(x > 0, cols[None, :], -1), axis=1)
            bt = bt + tl.where(cols[None, :] == last[:, None], (budget.to(tl.int64) - drawn)[:, None], 0)
        else:
            base = tl.floor(share)
            rem = budget - tl.sum(base, axis=1).to(tl.int32)
            # Unique keys: the fraction (quantised to 2^-40) above, the lower tile winning ties below;
            # the +1s go to the `rem` largest keys, i.e. those at or above the rem-th largest.
            key = (((share - base) * 1099511627776.0).to(tl.int64) << 11) | (2047 - cols[None, :]).to(tl.int64)
            key = tl.where(ok, key, -1)
            ranked = tl.sort(key, descending=True)
            kth = tl.sum(tl.where(cols[None, :] == (rem - 1)[:, None], ranked, 0), axis=1)
            bonus = (key >= kth[:, None]) & ok
            bt = base.to(tl.int32) + tl.where((rem > 0)[:, None], bonus.to(tl.int32), 0)
        bt = tl.where(ok & (z > 0)[:, None], bt.to(tl.int32), 0)
        tl.store(budgets_ptr + row, bt, mask=h_ok[:, None] & (cols < n_tiles)[None, :])

    @budget_jit
    def _prop_budget_kernel(
        m_ptr, l_ptr, lens_ptr, budgets_ptr,
        budget, seed_lo, seed_hi, budget_key, n_tiles, hq, s_ml_b, s_ml_h,
        TILE: tl.constexpr, BLOCK_T: tl.constexpr, SYSTEMATIC: tl.constexpr, PDL: tl.constexpr,
    ):
        """One program per (head, batch row): ``_group_budgets`` of one head."""
        if PDL:  # launched early (programmatic dependent launch): wait for the stats pass, let the next launch
            gdc_wait()
            gdc_launch_dependents()
        h = tl.program_id(0)
        b = tl.program_id(1)
        length = tl.load(lens_ptr + b)
        one = tl.arange(0, 1)
        _group_budgets(m_ptr, l_ptr, budgets_ptr, h + one, one < 1, b, (length + TILE - 1) // TILE, budget, seed_lo,
                       seed_hi, budget_key, n_tiles, hq, s_ml_b, s_ml_h, BLOCK_T, SYSTEMATIC)


    @budget_jit
    def _prop_budget_rank_kernel(
        m_ptr, l_ptr, lens_ptr, budgets_ptr,
        budget, seed_lo, seed_hi, budget_key, n_tiles, hq, s_ml_b, s_ml_h,
        TILE: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr, SYSTEMATIC: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """The tile budgets of ``_group_budgets`` for CHUNK tiles of one head per program (grid: chunks,
        heads, rows), without a sort: each program forms every tile's share (O(T), the same values in
        the same order in every program of the head) and gives its tiles their floor plus, for largest
        remainder, a +1 when fewer than ``rem`` tiles hold a larger key; for systematic rounding it
        reads its tiles' prefix sums. More programs, shorter chains than one sort per head."""
        if PDL:  # launched early (programmatic dependent launch): wait for the stats pass, let the next launch
            gdc_wait()
            gdc_launch_dependents()
        c = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        tiles_b = (length + TILE - 1) // TILE
        cols = tl.arange(0, BLOCK_T)
        ok = cols < tiles_b
        row = b * s_ml_b + h * s_ml_h
        m = tl.load(m_ptr + row + cols, mask=cols < n_tiles, other=0.0)
        l = tl.load(l_ptr + row + cols, mask=cols < n_tiles, other=0.0)
        m_star = tl.max(tl.where(ok, m, float("-inf")), axis=0)
        w = tl.where(ok, tl.exp(tl.where(ok, m, 0.0) - m_star) * tl.where(ok, l, 0.0), 0.0).to(tl.float64)
        z = tl.sum(w, axis=0)
        share = w * (budget.to(tl.float64) / tl.where(z > 0, z, 1.0))
        own = c * CHUNK + tl.arange(0, CHUNK)
        pick = cols[None, :] == own[:, None]
        if SYSTEMATIC:
            a_b = hash_uniform(seed_lo, seed_hi, budget_key, tl.full([1], 0, tl.int64) + b * hq + h)
            a = (a_b * 4294967296.0).to(tl.int64)
            x = tl.where(ok, tl.floor(share * 4294967296.0).to(tl.int64), 0)
            hi = tl.cumsum(x, axis=0)
            top = budget.to(tl.int64) << 32
            hi_own = tl.sum(tl.where(pick, hi[None, :], 0), axis=1)
            x_own = tl.sum(tl.where(pick, x[None, :], 0), axis=1)
            bt = ((a + tl.minimum(hi_own, top)) >> 32) - ((a + tl.minimum(hi_own - x_own, top)) >> 32)
            drawn = (a + tl.minimum(tl.sum(x, axis=0), top)) >> 32  # a < 2^32: the offset's own floor is 0
            last = tl.max(tl.where(x > 0, cols, -1), axis=0)
            bt = (bt + tl.where(own == last, budget.to(tl.int64) - drawn, 0)).to(tl.int32)
        else:
            base = tl.floor(share)
            rem = budget - tl.sum(base, axis=0).to(tl.int32)
            key = (((share - base) * 1099511627776.0).to(tl.int64) << 11) | (2047 - cols).to(tl.int64)
            own_key = tl.sum(tl.where(pick, key[None, :], 0), axis=1)
            own_base = tl.sum(tl.where(pick, base[None, :], 0.0), axis=1)
            # the own tile is left out by its index, not by comparing its key with itself
            rank = tl.sum((ok[None, :] & (cols[None, :] != own[:, None]) & (key[None, :] > own_key[:, None])
                           ).to(tl.int32), axis=1)
            bt = own_base.to(tl.int32) + ((rem > 0) & (rank < rem)).to(tl.int32)
        bt = tl.where(own < tiles_b, bt, 0)
        bt = tl.where(z > 0, bt, 0)
        tl.store(budgets_ptr + row + own, bt, mask=own < n_tiles)


    @budget_jit
    def _tile_sample_kernel(
        v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, acc_ptr, pm_ptr, pl_ptr, counts_ptr,
        oacc_ptr, done_ptr, out_ptr,
        budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
        s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
        s_acc_b, s_acc_h, s_acc_p, s_c_b, s_c_h, s_o_b, s_o_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, SAMPLE_N: tl.constexpr,
        FLASH: tl.constexpr, SPLIT_COUNTS: tl.constexpr, WRITE_COUNTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        FIX_BITS: tl.constexpr, WIDE: tl.constexpr, FOLD: tl.constexpr,
    ):
        """Pass 2: systematic samples inside each tile from the stash and the V gather. prop: the
        tile budgets come from ``budgets_ptr`` and the partial is ``Σ c V`` with merge weight l = S_t;
        flash: every tile draws ``max(1, S // T_b)`` and the partial is ``l Σ c V / S_tile`` with the
        tile's (m, l).

        ``FOLD`` (prop only) folds the merge in: each program adds its ``Σ c V`` to the float32
        accumulator ``oacc [B, Hq, D]`` with atomics, then counts itself done for its (row, KV head);
        the last of the ``n_tiles`` programs reads the accumulator back (an atomic add of zero) and zeroes it,
        writes ``out = Σ_t acc_t / S`` in out's dtype and zeroes the counter, so the workspace is zero
        again for the next call."""
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        tiles_b = (length + TILE - 1) // TILE
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        if t < tiles_b:
            pm = b * s_ml_b + heads * s_ml_h + t
            m = tl.load(m_ptr + pm, mask=g_ok, other=0.0)
            l = tl.load(l_ptr + pm, mask=g_ok, other=0.0)
            if FLASH:
                s_tile = tl.maximum(budget // tiles_b, 1)
                tile_budget = tl.where(g_ok, s_tile, 0)
                tl.store(pm_ptr + pm, m, mask=g_ok)
                tl.store(pl_ptr + pm, l, mask=g_ok)
            else:
                tile_budget = tl.load(budgets_ptr + pm, mask=g_ok, other=0)
                if not FOLD:
                    tl.store(pm_ptr + pm, tl.zeros([BLOCK_G], tl.float32), mask=g_ok)
                    tl.store(pl_ptr + pm, tile_budget.to(tl.float32), mask=g_ok)
            if tl.max(tile_budget, axis=0) > 0:  # tiles without samples read nothing and write no partial
                a0 = hash_uniform(seed_lo, seed_hi, tile_key, (b * hq + heads).to(tl.int64) * n_tiles + t)
                acc = _sample_tile_any(v_ptr, stash_ptr, counts_ptr, b, kvh, t, length, m, l, tile_budget, a0,
                                       s_v_b, s_v_h, s_v_n, s_u_b, s_u_h, s_c_b, s_c_h,
                                       G, BLOCK_G, D, TILE, SAMPLE_N, SPLIT_COUNTS, WRITE_COUNTS, DOT_PRECISION,
                                       FIX_BITS, WIDE)
                if FLASH:
                    acc = acc * (l / tl.maximum(tile_budget, 1).to(tl.float32))[:, None]
                if FOLD:
                    tl.atomic_add(oacc_ptr + (b * hq + heads)[:, None] * D + offs_d[None, :], acc,
                                  mask=(g_ok & (tile_budget > 0))[:, None], sem="relaxed")
                else:
                    tl.store(acc_ptr + b * s_acc_b + heads[:, None] * s_acc_h + t * s_acc_p + offs_d[None, :],
                             acc, mask=g_ok[:, None])
        if FOLD:
            tl.debug_barrier()  # every thread's atomics are issued before the release below
            done = tl.atomic_add(done_ptr + b * hkv + kvh, 1, sem="acq_rel")
            if done == n_tiles - 1:
                o_ptrs = oacc_ptr + (b * hq + heads)[:, None] * D + offs_d[None, :]
                # read at L2 through an atomic (no stale L1 line), then zero: every other program is done
                total = tl.atomic_add(o_ptrs, tl.zeros([BLOCK_G, D], tl.float32), mask=g_ok[:, None])
                tl.store(o_ptrs, tl.zeros([BLOCK_G, D], tl.float32), mask=g_ok[:, None])
                total = total / budget
                tl.store(out_ptr + b * s_o_b + heads[:, None] * s_o_h + offs_d[None, :],
                         total.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
                tl.atomic_xchg(done_ptr + b * hkv + kvh, 0)

    @triton.jit
    def _ml_chunk(m_ptr, l_ptr, ml_row, g_ok, c0, n_tiles, CHUNK_T: tl.constexpr):
        """Tile maxima and sums of tiles c0..c0+CHUNK_T of each head of the group, bounded by the launch's
        tile count only (so the loads need not wait on the row length); garbage past the row's tiles."""
        cols = c0 + tl.arange(0, CHUNK_T)
        in_buf = g_ok[:, None] & (cols < n_tiles)[None, :]
        m = tl.load(m_ptr + ml_row[:, None] + cols[None, :], mask=in_buf, other=0.0)
        l = tl.load(l_ptr + ml_row[:, None] + cols[None, :], mask=in_buf, other=0.0)
        return m, l

    @triton.jit
    def _masses(m, l, g_ok, c0, tiles_b, m_star, CHUNK_T: tl.constexpr):
        """W_t = e^{m_t - m*} l_t (float32, as ``_group_budgets`` computes it), zero past the row's tiles."""
        cols = c0 + tl.arange(0, CHUNK_T)
        ok = g_ok[:, None] & (cols < tiles_b)[None, :]
        w = tl.where(ok, tl.exp(tl.where(ok, m, 0.0) - m_star[:, None]) * tl.where(ok, l, 0.0), 0.0)
        return w, ok, cols

    @triton.jit
    def _lr_keys(w, cols, per_mass):
        """Largest remainder: the floors of the shares and their unique keys (the fraction quantised to
        2^-40 above, the lower tile winning ties below), as ``_group_budgets`` forms them."""
        share = w.to(tl.float64) * per_mass[:, None]
        base = tl.floor(share)
        key = (((share - base) * 1099511627776.0).to(tl.int64) << 11) | (2047 - cols[None, :]).to(tl.int64)
        return base.to(tl.int64), key

    @triton.jit
    def _own_tile_budget(m_ptr, l_ptr, m0, l0, ml_row, g_ok, heads, t, b, tiles_b, n_tiles, hq, budget,
                         seed_lo, seed_hi, budget_key,
                         GP: tl.constexpr, CHUNK_T: tl.constexpr, SYSTEMATIC: tl.constexpr):
        """prop: this tile's budget for each head of the group, by the rule of ``_group_budgets``
        (largest remainder with ties to the lower tile, or systematic rounding), computed from every
        tile's mass in O(T) without a sort: the tile gets a +1 when fewer than ``rem`` other tiles have
        a larger key. Every program of the launch reduces the same values in the same order, so they
        all agree on z and rem, and each head's budgets add up to S exactly. ``m0, l0``: the first
        CHUNK_T tiles, loaded by the caller; further chunks (T > CHUNK_T) are loaded in each pass."""
        m_star = tl.max(tl.where(g_ok[:, None] & ((tl.arange(0, CHUNK_T) < tiles_b)[None, :]), m0,
                                 float("-inf")), axis=1)
        for c0 in range(CHUNK_T, n_tiles, CHUNK_T):
            m, _ = _ml_chunk(m_ptr, l_ptr, ml_row, g_ok, c0, n_tiles, CHUNK_T)
            ok = g_ok[:, None] & ((c0 + tl.arange(0, CHUNK_T)) < tiles_b)[None, :]
            m_star = tl.maximum(m_star, tl.max(tl.where(ok, m, float("-inf")), axis=1))
        m_star = tl.where(g_ok, m_star, 0.0)
        w0, ok0, cols0 = _masses(m0, l0, g_ok, 0, tiles_b, m_star, CHUNK_T)
        z = tl.sum(w0.to(tl.float64), axis=1)
        for c0 in range(CHUNK_T, n_tiles, CHUNK_T):
            m, l = _ml_chunk(m_ptr, l_ptr, ml_row, g_ok, c0, n_tiles, CHUNK_T)
            w, _, _ = _masses(m, l, g_ok, c0, tiles_b, m_star, CHUNK_T)
            z += tl.sum(w.to(tl.float64), axis=1)
        per_mass = budget.to(tl.float64) / tl.where(z > 0, z, 1.0)
        if SYSTEMATIC:
            a_b = hash_uniform(seed_lo, seed_hi, budget_key, (b * hq + heads).to(tl.int64))
            a = (a_b * 4294967296.0).to(tl.int64)
            top = budget.to(tl.int64) << 32
            x = tl.where(ok0, tl.floor(w0.to(tl.float64) * per_mass[:, None] * 4294967296.0).to(tl.int64), 0)
            hi = tl.sum(tl.where(cols0[None, :] <= t, x, 0), axis=1)
            x_own = tl.sum(tl.where(cols0[None, :] == t, x, 0), axis=1)
            total = tl.sum(x, axis=1)
            last = tl.max(tl.where(x > 0, cols0[None, :], -1), axis=1)
            for c0 in range(CHUNK_T, n_tiles, CHUNK_T):
                m, l = _ml_chunk(m_ptr, l_ptr, ml_row, g_ok, c0, n_tiles, CHUNK_T)
                w, ok, cols = _masses(m, l, g_ok, c0, tiles_b, m_star, CHUNK_T)
                x = tl.where(ok, tl.floor(w.to(tl.float64) * per_mass[:, None] * 4294967296.0).to(tl.int64), 0)
                hi += tl.sum(tl.where(cols[None, :] <= t, x, 0), axis=1)
                x_own += tl.sum(tl.where(cols[None, :] == t, x, 0), axis=1)
                total += tl.sum(x, axis=1)
                last = tl.maximum(last, tl.max(tl.where(x > 0, cols[None, :], -1), axis=1))
            bt = ((a + tl.minimum(hi, top)) >> 32) - ((a + tl.minimum(hi - x_own, top)) >> 32)
            drawn = (a + tl.minimum(total, top)) >> 32  # a < 2^32: the offset's own floor is 0
            bt = bt + tl.where(last == t, budget.to(tl.int64) - drawn, 0)
            bt = bt.to(tl.int32)
        else:
            base, key0 = _lr_keys(w0, cols0, per_mass)
            floors = tl.sum(tl.where(ok0, base, 0), axis=1)
            own_key = tl.sum(tl.where(cols0[None, :] == t, key0, 0), axis=1)
            own_base = tl.sum(tl.where(cols0[None, :] == t, base, 0), axis=1)
            for c0 in range(CHUNK_T, n_tiles, CHUNK_T):
                m, l = _ml_chunk(m_ptr, l_ptr, ml_row, g_ok, c0, n_tiles, CHUNK_T)
                w, ok, cols = _masses(m, l, g_ok, c0, tiles_b, m_star, CHUNK_T)
                base, key = _lr_keys(w, cols, per_mass)
                floors += tl.sum(tl.where(ok, base, 0), axis=1)
                own_key += tl.sum(tl.where(cols[None, :] == t, key, 0), axis=1)
                own_base += tl.sum(tl.where(cols[None, :] == t, base, 0), axis=1)
            rem = budget - floors.to(tl.int32)
            # the own tile is left out by its index, not by comparing its key with itself
            rank = tl.sum((ok0 & (cols0[None, :] != t) & (key0 > own_key[:, None])).to(tl.int32), axis=1)
            for c0 in range(CHUNK_T, n_tiles, CHUNK_T):
                m, l = _ml_chunk(m_ptr, l_ptr, ml_row, g_ok, c0, n_tiles, CHUNK_T)
                w, ok, cols = _masses(m, l, g_ok, c0, tiles_b, m_star, CHUNK_T)
                _, key = _lr_keys(w, cols, per_mass)
                rank += tl.sum((ok & (cols[None, :] != t) & (key > own_key[:, None])).to(tl.int32), axis=1)
            bt = own_base.to(tl.int32) + ((rem > 0) & (rank < rem)).to(tl.int32)
        return tl.where(g_ok & (z > 0), bt, 0)

    @triton.jit
    def _compact_sample(v_ptr, s, counts_ptr, scr_ptr, b, kvh, t, length, m, l, budget, a0,
                        s_v_b, s_v_h, s_v_n, s_c_b, s_c_h,
                        G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                        TILE: tl.constexpr, R_MAX: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr):
        """Systematic sampling of ``budget [GP]`` draws in one tile from its stashed scores ``s [GP, TILE]``
        (loaded by the caller), the whole tile at once and on the G rows of the group only, then
        ``Σ_n c_n V_n`` [BLOCK_G, D] from the sampled rows only. Same counts as ``_sample_tile``: the
        fixed-point prefix sums are exact integers, and the rounding shortfall goes to the last key of
        positive weight.

        The rows that some head of the group sampled are compacted through a per-program scratch
        ``scr`` (TILE key indices, then GP × TILE counts): each used row is stored at its rank (a prefix
        sum of the used flags), and after a barrier R_MAX rows at a time are read back with their
        counts on BLOCK_G (16) rows and their V rows gathered into ``tl.dot(counts, V)``. No
        cross-thread reduction over the tile is needed for the gather (v8's first form reduced
        [TILE, R_MAX] selections per head: 255 registers and shared-memory stalls)."""
        FIX: tl.constexpr = 1 << FIX_BITS
        offs_g = tl.arange(0, GP)
        offs_k = tl.arange(0, TILE)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        offs_n = t * TILE + offs_k
        n_ok = offs_n < length
        s = tl.where(n_ok[None, :], s, float("-inf"))
        if WIDE:
            top = budget.to(tl.int64) * FIX
            a = (a0 * FIX).to(tl.int64)
            xi = (tl.exp(s - tl.where(g_ok, m, 0.0)[:, None]) *
                  tl.where(l > 0, budget.to(tl.float32) / tl.where(l > 0, l, 1.0), 0.0)[:, None] * FIX + 0.5
                  ).to(tl.int64)
        else:
            top = budget * FIX
            a = (a0 * FIX).to(tl.int32)
            xi = (tl.exp(s - tl.where(g_ok, m, 0.0)[:, None]) *
                  tl.where(l > 0, budget.to(tl.float32) / tl.where(l > 0, l, 1.0), 0.0)[:, None] * FIX + 0.5
                  ).to(tl.int32)
        hi = tl.cumsum(xi, axis=1)
        c = ((a[:, None] + tl.minimum(hi, top[:, None])) >> FIX_BITS) \
            - ((a[:, None] + tl.minimum(hi - xi, top[:, None])) >> FIX_BITS)
        carry = tl.sum(xi, axis=1)
        last = tl.max(tl.where(xi > 0, offs_k[None, :], -1), axis=1)
        drawn = ((a + tl.minimum(carry, top)) >> FIX_BITS) - (a >> FIX_BITS)
        short = tl.where(g_ok & (last >= 0), budget - drawn.to(tl.int32), 0)
        c = c.to(tl.int32) + tl.where(offs_k[None, :] == last[:, None], tl.maximum(short, 0)[:, None], 0)
        if WRITE_COUNTS:
            tl.store(counts_ptr + b * s_c_b + heads[:, None] * s_c_h + offs_n[None, :], c,
                     mask=g_ok[:, None] & n_ok[None, :])
        used = tl.max(c, axis=0) > 0
        u = used.to(tl.int32)
        pos = tl.cumsum(u, axis=0) - u
        n_used = tl.sum(u, axis=0)
        tl.store(scr_ptr + pos, offs_k, mask=used)
        tl.store(scr_ptr + TILE + offs_g[:, None] * TILE + pos[None, :], c, mask=used[None, :] & g_ok[:, None])
        tl.debug_barrier()  # the scratch written by every thread above is read back by others below
        offs_r = tl.arange(0, BLOCK_G)
        r_rows = offs_r < G
        big = tl.max(budget, axis=0) > SPLIT_AT  # a count above SPLIT_AT is not exact in the dot's 16-bit type
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        v_base = v_ptr + b * s_v_b + kvh * s_v_h + t * TILE * s_v_n
        for r0 in range(0, n_used, R_MAX):
            rr = r0 + tl.arange(0, R_MAX)
            r_ok = rr < n_used
            idx = tl.load(scr_ptr + rr, mask=r_ok, other=0)
            cnt = tl.load(scr_ptr + TILE + offs_r[:, None] * TILE + rr[None, :], mask=r_rows[:, None] & r_ok[None, :],
                          other=0)
            v = tl.load(v_base + idx[:, None] * s_v_n + offs_d[None, :], mask=r_ok[:, None], other=0.0)
            if big:
                acc += _count_dot(cnt, v, True, DOT_PRECISION)
            else:
                acc += _count_dot(cnt, v, False, DOT_PRECISION)
        return acc

    @triton.jit
    def _sample_fold(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
                     oacc_ptr, oden_ptr, done_ptr, out_ptr, t, kvh, b,
                     budget, seed_lo, seed_hi, tile_key, budget_key, n_tiles, hq, hkv,
                     s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
                     G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                     R_MAX: tl.constexpr, FLASH: tl.constexpr, INLINE_BUDGETS: tl.constexpr, SYSTEMATIC: tl.constexpr,
                     CHUNK_T: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr, LOAD_CACHE: tl.constexpr):
        """Tile t of (row b, KV head kvh): sampling, the V gather and the folded merge (v8).

        - prop: the tile budgets are computed inline (``INLINE_BUDGETS``, O(T) per program, so the
          budget launch disappears) or read from ``budgets_ptr``; inline, they are also written there.
          Each program adds ``Σ c V`` to ``oacc`` and the last one writes ``out = oacc / S``.
        - flash: every tile draws ``max(1, S // T_b)``; the stats pass left each head's global max in
          ``mstar``, so each program adds ``e^{m_t - m*} l_t Σ c V / S_tile`` to ``oacc`` and
          ``e^{m_t - m*} l_t`` to ``oden``, and the last one writes ``out = oacc / oden``.

        The last of the ``n_tiles`` programs of a (row, KV head) (an acq_rel counter) reads the
        accumulators through atomics (L2, no stale L1 line), writes ``out`` and leaves the accumulators,
        ``mstar`` and the counter as the next call expects them (zero, -inf, zero); it returns True.
        ``LOAD_CACHE``: the cache modifier of the loads of what the stats pass wrote (".cg" when that pass
        ran in the same launch)."""
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        ml_row = b * s_ml_b + heads * s_ml_h
        length = tl.load(lens_ptr + b)
        m = tl.load(m_ptr + ml_row + t, mask=g_ok, other=0.0, cache_modifier=LOAD_CACHE)
        l = tl.load(l_ptr + ml_row + t, mask=g_ok, other=0.0, cache_modifier=LOAD_CACHE)
        # issued with the loads above, before the budget math, so that the two round trips overlap;
        # the launch's stash holds n_tiles·TILE keys per head, so no row length is needed to bound it
        s = tl.load(stash_ptr + b * s_u_b + heads[:, None] * s_u_h + t * TILE + tl.arange(0, TILE)[None, :],
                    mask=g_ok[:, None], other=float("-inf"), cache_modifier=LOAD_CACHE)
        if INLINE_BUDGETS:  # the first CHUNK_T tiles' (m, l) of the group, for the budget math
            m0, l0 = _ml_chunk(m_ptr, l_ptr, ml_row, g_ok, 0, n_tiles, CHUNK_T)
        elif not FLASH:
            tile_budget = tl.load(budgets_ptr + ml_row + t, mask=g_ok, other=0, cache_modifier=LOAD_CACHE)
        tiles_b = (length + TILE - 1) // TILE
        o_rows = (b * hq + heads)[:, None] * D + offs_d[None, :]
        # the G heads on the 16 rows of the dots (the gathered sums come out in that layout)
        offs_r = tl.arange(0, BLOCK_G)
        r_ok = offs_r < G
        heads_r = kvh * G + offs_r
        r_rows = (b * hq + heads_r)[:, None] * D + offs_d[None, :]
        if t < tiles_b:
            if FLASH:
                s_tile = tl.maximum(budget // tiles_b, 1)
                tile_budget = tl.where(g_ok, s_tile, 0)
                m_r = tl.load(m_ptr + b * s_ml_b + heads_r * s_ml_h + t, mask=r_ok, other=0.0,
                              cache_modifier=LOAD_CACHE)
                l_r = tl.load(l_ptr + b * s_ml_b + heads_r * s_ml_h + t, mask=r_ok, other=0.0,
                              cache_modifier=LOAD_CACHE)
                m_star = tl.load(mstar_ptr + b * hq + heads_r, mask=r_ok, other=0.0, cache_modifier=".cg")
                mass = tl.where(r_ok & (l_r > 0), tl.exp(m_r - tl.where(r_ok, m_star, 0.0)) * l_r, 0.0)
            elif INLINE_BUDGETS:
                tile_budget = _own_tile_budget(m_ptr, l_ptr, m0, l0, ml_row, g_ok, heads, t, b, tiles_b, n_tiles,
                                               hq, budget, seed_lo, seed_hi, budget_key, GP, CHUNK_T, SYSTEMATIC)
                tl.store(budgets_ptr + ml_row + t, tile_budget, mask=g_ok)
            if tl.max(tile_budget, axis=0) > 0:  # tiles without samples read nothing and add nothing
                a0 = hash_uniform(seed_lo, seed_hi, tile_key, (b * hq + heads).to(tl.int64) * n_tiles + t)
                scr = scr_ptr + ((b * hkv + kvh) * n_tiles + t).to(tl.int64) * (TILE * (1 + GP))
                acc = _compact_sample(v_ptr, s, counts_ptr, scr, b, kvh, t, length, m, l, tile_budget, a0,
                                      s_v_b, s_v_h, s_v_n, s_c_b, s_c_h,
                                      G, GP, BLOCK_G, D, TILE, R_MAX, SPLIT_AT, DOT_PRECISION, WRITE_COUNTS,
                                      FIX_BITS, WIDE)
                if FLASH:
                    acc = acc * (mass / s_tile.to(tl.float32))[:, None]
                    tl.atomic_add(oden_ptr + b * hq + heads_r, mass, mask=r_ok, sem="relaxed")
                tl.atomic_add(oacc_ptr + r_rows, acc, mask=r_ok[:, None], sem="relaxed")
        elif INLINE_BUDGETS:
            tl.store(budgets_ptr + ml_row + t, tl.zeros([GP], tl.int32), mask=g_ok)
        tl.debug_barrier()  # every thread's atomics are issued before the release below
        done = tl.atomic_add(done_ptr + b * hkv + kvh, 1, sem="acq_rel")
        if done == n_tiles - 1:
            total = tl.atomic_add(oacc_ptr + o_rows, tl.zeros([GP, D], tl.float32), mask=g_ok[:, None])
            tl.store(oacc_ptr + o_rows, tl.zeros([GP, D], tl.float32), mask=g_ok[:, None])
            if FLASH:
                den = tl.atomic_add(oden_ptr + b * hq + heads, tl.zeros([GP], tl.float32), mask=g_ok)
                tl.store(oden_ptr + b * hq + heads, tl.zeros([GP], tl.float32), mask=g_ok)
                tl.store(mstar_ptr + b * hq + heads, tl.full([GP], float("-inf"), tl.float32), mask=g_ok)
                total = total / tl.where(g_ok, den, 1.0)[:, None]
            else:
                total = total / budget
            tl.store(out_ptr + b * s_o_b + heads[:, None] * s_o_h + offs_d[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
            tl.atomic_xchg(done_ptr + b * hkv + kvh, 0)
        return done == n_tiles - 1

    @budget_jit
    def _compact_sample_kernel(
        v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
        oacc_ptr, oden_ptr, done_ptr, out_ptr,
        budget, seed_lo, seed_hi, tile_key, budget_key, n_tiles, hq, hkv,
        s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
        G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        R_MAX: tl.constexpr, FLASH: tl.constexpr, INLINE_BUDGETS: tl.constexpr, SYSTEMATIC: tl.constexpr,
        CHUNK_T: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr, WRITE_COUNTS: tl.constexpr,
        FIX_BITS: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr,
    ):
        """Sampling pass with the merge folded in (v8), one program per (tile, KV head, row):
        ``_sample_fold``."""
        if PDL:  # launched early (programmatic dependent launch): nothing of the previous kernel is read before
            gdc_wait()
        _sample_fold(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
                     oacc_ptr, oden_ptr, done_ptr, out_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                     budget, seed_lo, seed_hi, tile_key, budget_key, n_tiles, hq, hkv,
                     s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
                     G, GP, BLOCK_G, D, TILE, R_MAX, FLASH, INLINE_BUDGETS, SYSTEMATIC, CHUNK_T, SPLIT_AT,
                     DOT_PRECISION, WRITE_COUNTS, FIX_BITS, WIDE, "")


def _tiles(n_keys: int, tile: int) -> int:
    return -(-n_keys // tile)


def _all_tiles(k: torch.Tensor, tile: int) -> int:
    """Tiles of the stats pass: rows × KV heads × tiles per head."""
    return k.shape[0] * k.shape[1] * _tiles(k.shape[2], tile)


def _check_tile(tile: int) -> None:
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile_size: the Triton kernels take a power of two ≥ 16, got {tile}")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _fixed_point(max_tile_budget: int) -> dict:
    """Resolution of the running sums: int32 with (S + 1)·2^bits ≤ 2^30 while that leaves ≥ 16 bits,
    else int64 with 24 bits."""
    bits = 30 - max(1, int(max_tile_budget)).bit_length()
    return {"FIX_BITS": bits, "WIDE": False} if bits >= 16 else {"FIX_BITS": 24, "WIDE": True}


def _split_at(dtype: torch.dtype) -> int:
    """The largest count a 16-bit dot operand holds exactly (bf16 256, fp16 2048; fp32 dots are exact)."""
    return {torch.bfloat16: 256, torch.float16: 2048}.get(dtype, 1 << 30)


def _split_counts(dtype: torch.dtype, max_count: int) -> bool:
    if dtype == torch.bfloat16:
        return max_count > 256
    if dtype == torch.float16:
        return max_count > 2048
    return False


def _stats_raw(q, k, lens, m, l, stash, scale, b, hq, hkv, d, t, tile, *, block_n, num_warps, num_stages,
               stats_programs, mstar=None):
    """Launches the stats pass into flat buffers: m, l ``[B, Hq, T]``, stash ``[B, Hq, T·tile]``;
    with ``mstar [B·Hq]`` (-inf on entry) also each head's global max."""
    g = hq // hkv
    per_program = max(1, round(t * hkv * b / stats_programs))
    launch(_tile_stats_kernel, (-(-t // per_program), hkv, b),
           q, k, lens, m, l, stash, mstar if mstar is not None else m, scale, per_program, hq,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), hq * t, t, hq * t * tile, t * tile,
           G=g, BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(block_n, tile),
           DOT_PRECISION=_dot_precision(q.dtype), TRACK_MAX=mstar is not None, PDL=_pdl(),
           num_warps=num_warps, num_stages=num_stages)


def _stats_buffers(q, b, hq, t, tile):
    return (workspace("m", q, b * hq * t, torch.float32), workspace("l", q, b * hq * t, torch.float32),
            workspace("stash", q, b * hq * t * tile, torch.float32))


def _tile_stats(q, k, lens, scale, tile, *, block_n, num_warps, num_stages, stats_programs):
    """The stats pass alone (for the sweep): views ``m, l [B, Hq, T]``, ``stash [B, Hq, T·tile]``
    of the workspace, valid until the next call."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    t = _tiles(n, tile)
    m, l, stash = _stats_buffers(q, b, hq, t, tile)
    _stats_raw(q, k, lens, m, l, stash, scale, b, hq, hkv, d, t, tile, block_n=block_n, num_warps=num_warps,
               num_stages=num_stages, stats_programs=stats_programs)
    return (m[:b * hq * t].view(b, hq, t), l[:b * hq * t].view(b, hq, t),
            stash[:b * hq * t * tile].view(b, hq, t * tile))


def _sample_raw(v, lens, m, l, stash, budgets, budget, tile, seed, b, hq, t, *, flash, fold, out, write_counts,
                sample_n, num_warps, num_stages):
    """Launches the sampling pass. Unfolded: returns flat partials ``acc [B, Hq, T, d]``, ``pm, pl
    [B, Hq, T]`` for the merge; folded (prop): writes ``out`` and returns None partials. ``counts``
    (``[B, Hq, N]`` int32) when ``write_counts``."""
    hkv, n, d = v.shape[1], v.shape[2], v.shape[3]
    g = hq // hkv
    if fold:
        oacc = workspace("fold_acc", v, b * hq * d, torch.float32, zeroed=True)
        done = workspace("fold_done", v, b * hkv, torch.int32, zeroed=True)
        acc = pm = pl = m
        s_out = (out.stride(0), out.stride(1))
    else:
        acc = workspace("acc", v, b * hq * t * d, torch.float32)
        pm = workspace("pm", v, b * hq * t, torch.float32)
        pl = workspace("pl", v, b * hq * t, torch.float32)
        oacc = done = out = m
        s_out = (0, 0)
    counts = torch.zeros(b, hq, n, device=v.device, dtype=torch.int32) if write_counts else None
    lo, hi = seed_words(seed)
    launch(_tile_sample_kernel, (t, hkv, b),
           v, lens, m, l, stash, budgets if budgets is not None else m, acc, pm, pl,
           counts if write_counts else m, oacc, done, out,
           budget, lo, hi, _TILE_KEY, t, hq, hkv,
           v.stride(0), v.stride(1), v.stride(2), hq * t, t, hq * t * tile, t * tile,
           hq * t * d, t * d, d, (hq * n) if write_counts else 0, n if write_counts else 0, s_out[0], s_out[1],
           G=g, BLOCK_G=group_block(g), D=d, TILE=tile, SAMPLE_N=min(sample_n, tile), FLASH=flash,
           SPLIT_COUNTS=_split_counts(v.dtype, budget), WRITE_COUNTS=write_counts,
           DOT_PRECISION=_dot_precision(v.dtype), **_fixed_point(budget), FOLD=fold,
           num_warps=num_warps, num_stages=num_stages)
    return (None, None, None, counts) if fold else (acc, pm, pl, counts)


def default_r_max(group: int, budget: int, tiles: int) -> int:
    """Rows gathered per step of the compacted V gather: the group's expected samples in a tile
    (G·S/T, the flash tile budget), as a power of two in [16, 64]; more rows take more steps."""
    return min(64, max(16, next_pow2(group * max(1, -(-budget // max(1, tiles))))))


# prop computes its tile budgets inside the sampling pass (2 launches) up to this many tiles by default. 0:
# on the H100 it was slower than the budget kernel at every length measured (+1.5 µs at 32k, +59 µs at 128k:
# O(T) float64 work per program, O(T²) in all); ``inline_budgets=True`` still selects it.
INLINE_BUDGET_MAX_TILES = 0
BUDGET_CHUNK_TILES = 512  # tiles per step of the inline budget math (the tests lower it to cover several steps)
BUDGET_RANK_CHUNK = 8  # tiles per program of the rank budget kernel
# the budget kernel: rank (True) or sort (False); the rank kernel measured slower (4.7 against 3.1 µs at 32k,
# 16.1 against 5.9 at 128k)
RANK_BUDGETS_DEFAULT = False


def _fold_buffers(v, b: int, hq: int, t: int, tile: int):
    """The compacted sampling pass's buffers: the folded merge's accumulators ``[B·Hq·d]``, ``[B·Hq]`` and
    counters ``[B·Hkv]`` (zero between calls) and the compaction scratch."""
    hkv, d = v.shape[1], v.shape[3]
    return (workspace("fold_acc", v, b * hq * d, torch.float32, zeroed=True),
            workspace("fold_den", v, b * hq, torch.float32, zeroed=True),
            workspace("fold_done", v, b * hkv, torch.int32, zeroed=True),
            workspace("compact_scratch", v, b * hkv * t * tile * (1 + next_pow2(hq // hkv)), torch.int32))


def _global_max_buffer(q, b: int, hq: int):
    """santa-flash's per-head global maxima (-inf between calls)."""
    return workspace("mstar", q, b * hq, torch.float32, fill=float("-inf"))


def _check_rounding(rounding: str) -> None:
    if rounding not in ("largest-remainder", "systematic"):
        raise ValueError(f"rounding: expected 'largest-remainder' or 'systematic', got {rounding!r}")


class _PassBuffers(NamedTuple):
    """What one call of the stats + compacted sampling passes writes (v10 takes all of it)."""
    m: torch.Tensor
    l: torch.Tensor
    stash: torch.Tensor
    budgets: torch.Tensor | None  # [B, Hq, T] int32, returned to the caller; None for flash
    mstar: torch.Tensor
    oacc: torch.Tensor
    oden: torch.Tensor
    done: torch.Tensor
    scr: torch.Tensor
    counts: torch.Tensor | None  # [B, Hq, N] int32 when the caller asked for counts
    out: torch.Tensor


def _pass_buffers(q, v, t: int, tile: int, *, flash: bool, write_counts: bool, out) -> _PassBuffers:
    b, hq, d = q.shape
    n = v.shape[2]
    m, l, stash = _stats_buffers(q, b, hq, t, tile)
    oacc, oden, done, scr = _fold_buffers(v, b, hq, t, tile)
    return _PassBuffers(
        m, l, stash, None if flash else torch.empty(b, hq, t, device=q.device, dtype=torch.int32),
        _global_max_buffer(q, b, hq), oacc, oden, done, scr,
        torch.zeros(b, hq, n, device=q.device, dtype=torch.int32) if write_counts else None,
        out if out is not None else torch.empty(b, hq, d, device=q.device, dtype=q.dtype))


def _compact_raw(v, lens, m, l, stash, budgets, budget, tile, seed, b, hq, t, *, flash, out, write_counts,
                 inline_budgets, systematic, r_max, num_warps, mstar=None):
    """Launches the v8 sampling pass (``_compact_sample_kernel``), the merge folded in: writes ``out``.
    Returns ``counts`` (``[B, Hq, N]`` int32) when ``write_counts``."""
    hkv, n, d = v.shape[1], v.shape[2], v.shape[3]
    g = hq // hkv
    oacc, oden, done, scr = _fold_buffers(v, b, hq, t, tile)
    counts = torch.zeros(b, hq, n, device=v.device, dtype=torch.int32) if write_counts else None
    lo, hi = seed_words(seed)
    launch(_compact_sample_kernel, (t, hkv, b),
           v, lens, m, l, stash, budgets if budgets is not None else m, counts if write_counts else m,
           mstar if mstar is not None else m, scr, oacc, oden, done, out,
           budget, lo, hi, _TILE_KEY, _BUDGET_KEY, t, hq, hkv,
           v.stride(0), v.stride(1), v.stride(2), hq * t, t, hq * t * tile, t * tile,
           (hq * n) if write_counts else 0, n if write_counts else 0, out.stride(0), out.stride(1),
           G=g, GP=next_pow2(g), BLOCK_G=group_block(g), D=d, TILE=tile, R_MAX=min(r_max, tile), FLASH=flash,
           INLINE_BUDGETS=inline_budgets, SYSTEMATIC=systematic,
           CHUNK_T=max(16, min(next_pow2(t), BUDGET_CHUNK_TILES)), SPLIT_AT=_split_at(v.dtype),
           DOT_PRECISION=_dot_precision(v.dtype), WRITE_COUNTS=write_counts, **_fixed_point(budget), PDL=_pdl(),
           num_warps=num_warps, **_pdl_launch())
    return counts


@contextlib.contextmanager
def programmatic_dependent_launch(on: bool = True):
    """Within the block, launches follow ``on`` instead of the module's ``PDL`` flag (read at launch time, so
    this also holds for a CUDA graph captured inside the block)."""
    global PDL
    before, PDL = PDL, on
    try:
        yield
    finally:
        PDL = before


@functools.cache
def _hopper_or_newer(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _pdl() -> bool:
    """Programmatic dependent launch: on when asked for, the kernels are compiled (the interpreter has no
    grid dependency control) and the GPU has it (compute capability 9.0 and newer)."""
    return (bool(PDL) and gdc_wait is not None and not is_interpreted(_compact_sample_kernel)
            and _hopper_or_newer(torch.cuda.current_device()))


def _can_overlap() -> bool:
    """Whether v10 can overlap its passes here (it needs programmatic dependent launch)."""
    return _pdl()


def _pdl_launch() -> dict:
    return {"launch_pdl": True} if _pdl() else {}


def _tile_sample(v, lens, m, l, stash, budgets, budget, tile, seed, *, flash, write_counts, sample_n,
                 num_warps, num_stages):
    """The sampling pass alone, unfolded (for the sweep); m, l, stash as ``_tile_stats`` returns them."""
    b, hq, t = m.shape
    return _sample_raw(v, lens, m, l, stash, budgets, budget, tile, seed, b, hq, t, flash=flash, fold=False,
                       out=None, write_counts=write_counts, sample_n=sample_n, num_warps=num_warps,
                       num_stages=num_stages)


# santa-flash's default path (H100, graph-timed, 2026-11-22-h100-decode-v8 and -v8-smollm): the fused kernel up
# to this many tiles (8k keys, 32/8/128: 27.6 µs against v8's 30.0; 9/3/64: 16.8 against 20.1), v8 (stats +
# compacted sampling) above (32/8/128 at 16k: 38.9 against 42.3, 128k: 156.6 against 202.1; 9/3/64 at 32k:
# 23.1 against the fused 30.3 and v7's split 26.4).
FLASH_FUSED_MAX_TILES = 32
# Programmatic dependent launch (Hopper and newer): the kernels after the stats pass are launched early and wait
# on the device (gdc_wait) instead of in the stream. On since 2026-11-22-h100-decode-v9 (graph µs, same run):
# prop 53.3 -> 52.1 at 32k, 87.4 -> 85.7 at 64k, 146.7 -> 144.8 at 128k, 26.3 -> 25.0 at 8k; flash within
# ±0.8 µs. Never used under the interpreter or on GPUs before compute capability 9.0.
PDL = True
# v10's overlapped passes (santa.overlap) are the default from this many tiles in all (rows × KV heads ×
# tiles per head) where programmatic dependent launch is on: its stats programs (528) finish the (row, KV head)
# units one after another only when there are several rounds of tiles; with one or two rounds it only adds
# waits. 2026-11-22-h100-decode-v10c, graph µs, v10 against v8: llama (8 KV heads, tile 256) batch 1: flash
# 56.7 / 57.4 at 32k (1,024 tiles), 140.4 / 154.6 at 128k; prop 84.9 / 85.8 at 64k (2,048), 136.5 / 145.2 at
# 128k, but 54.2 / 51.7 at 32k (v10b); smollm2 (3 KV heads) batch 1: flash 26.4 / 22.8 at 32k (384), 37.2 / 33.3
# at 64k (768), 53.9 / 54.9 at 128k (1,536); prop 39.5 / 33.2 at 64k, 53.5 / 52.6 at 128k (1,536); batch 8:
# flash 88.3 / 95.2 (smollm2, 32k, 3,072), prop 122.0 / 148.8 (smollm2, 64k, 6,144), 475.6 / 532.6 (llama, 64k).
FLASH_OVERLAP_MIN_TILES = 1024
PROP_OVERLAP_MIN_TILES = 2048


_TILE_KEY = (STREAM_TILE * 0x9E3779B9) & 0xFFFFFFFF
_BUDGET_KEY = (STREAM_BUDGET * 0x9E3779B9) & 0xFFFFFFFF


def santa_flash_triton(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                       write_counts: bool = False, fused: bool | None = None, fold_merge: bool = True,
                       block_n: int | None = None, sample_n: int = 256, num_warps: int = 4, num_stages: int = 3,
                       sample_warps: int | None = None, sample_stages: int = 3, stats_programs: int = 264,
                       r_max: int | None = None, overlap: bool | None = None,
                       out: torch.Tensor | None = None):
    """S²ANTA-flash. Returns ``(out [B, Hq, d] in q's dtype, counts [B, Hq, N] int32 or None)``.

    - ``overlap=True`` (v10, ``santa.overlap``): stats in (row, KV head) order, the sampling kernel
      launched early (PDL) and waiting per (row, KV head); ``None``: from ``FLASH_OVERLAP_MIN_TILES`` tiles
      in all (rows × KV heads × tiles per head) when programmatic dependent launch is on (Hopper and
      newer) and ``fused`` and ``fold_merge`` are left at their defaults. v10 runs with its own launch
      parameters (``santa_overlap_triton`` takes them).
    - ``fused=False, fold_merge=True`` (v8): the stats pass streams K in long pipelined loops and
      keeps each head's global max, then the compacted sampling pass adds every tile's weighted
      estimate to the output itself (2 launches).
    - ``fused=True``: one kernel scores and samples each tile, then the merge (2 launches, v6/v7).
    - ``fused=False, fold_merge=False``: stats, the v7 sampling pass, the merge (3 launches).
    - ``None`` picks the one measured faster on an H100: v10 (``overlap``) from ``FLASH_OVERLAP_MIN_TILES``
      tiles in all where programmatic dependent launch is on, checked first (so a batch can take it at
      fewer tiles per head than the fused kernel's limit); otherwise fused up to ``FLASH_FUSED_MAX_TILES``
      tiles per head, v8 above (docs/methods/santa-kernels.md).
    Scratch buffers are cached per device (``triton_utils.workspace``)."""
    _check_tile(tile)
    if overlap is None:  # by length where the caller chose no path; it needs PDL (without it v10 is just slower)
        overlap = (fused is None and fold_merge and _all_tiles(k, tile) >= FLASH_OVERLAP_MIN_TILES
                   and _can_overlap())
    if overlap:
        from .overlap import santa_overlap_triton

        out, counts, _ = santa_overlap_triton(q, k, v, lens, scale, budget, tile, seed, flash=True,
                                              write_counts=write_counts, block_n=block_n or 128, r_max=r_max,
                                              out=out)
        return out, counts
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    t = _tiles(n, tile)
    if fused is None:
        fused = t <= FLASH_FUSED_MAX_TILES
    if out is None:
        out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    m, l, stash = _stats_buffers(q, b, hq, t, tile)
    if not fused and fold_merge:
        mstar = _global_max_buffer(q, b, hq)
        _stats_raw(q, k, lens, m, l, stash, scale, b, hq, hkv, d, t, tile, block_n=block_n or 64,
                   num_warps=num_warps, num_stages=num_stages, stats_programs=stats_programs, mstar=mstar)
        counts = _compact_raw(v, lens, m, l, stash, None, budget, tile, seed, b, hq, t, flash=True, out=out,
                              write_counts=write_counts, inline_budgets=False, systematic=False,
                              r_max=r_max or default_r_max(hq // hkv, budget, t),
                              num_warps=sample_warps or 4, mstar=mstar)
        return out, counts
    if not fused:
        _stats_raw(q, k, lens, m, l, stash, scale, b, hq, hkv, d, t, tile, block_n=block_n or 128,
                   num_warps=num_warps, num_stages=num_stages, stats_programs=stats_programs)
        acc, pm, pl, counts = _sample_raw(v, lens, m, l, stash, None, budget, tile, seed, b, hq, t, flash=True,
                                          fold=False, out=None, write_counts=write_counts, sample_n=sample_n,
                                          num_warps=sample_warps or 2, num_stages=sample_stages)
        merge_partials_raw(acc, pm, pl, lens, out, b, hq, t, d, tile, (hq * t * d, t * d, d), (hq * t, t))
        return out, counts
    g = hq // hkv
    acc = workspace("acc", q, b * hq * t * d, torch.float32)
    counts = torch.zeros(b, hq, n, device=q.device, dtype=torch.int32) if write_counts else None
    lo, hi = seed_words(seed)
    block_n = block_n or 128
    launch(_flash_tile_kernel, (t, hkv, b),
           q, k, v, lens, stash, acc, m, l, counts if write_counts else acc,
           scale, budget, lo, hi, _TILE_KEY, t, hq,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           hq * t * tile, t * tile, hq * t * d, t * d, d, hq * t, t,
           (hq * n) if write_counts else 0, n if write_counts else 0,
           G=g, BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(block_n, tile), SAMPLE_N=min(sample_n, tile),
           SPLIT_COUNTS=_split_counts(v.dtype, budget), WRITE_COUNTS=write_counts,
           DOT_PRECISION=_dot_precision(q.dtype), **_fixed_point(budget), num_warps=num_warps, num_stages=num_stages)
    merge_partials_raw(acc, m, l, lens, out, b, hq, t, d, tile, (hq * t * d, t * d, d), (hq * t, t))
    return out, counts


def santa_prop_triton(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                      rounding: str = "largest-remainder", write_counts: bool = False, fold_merge: bool = True,
                      compact: bool = True, inline_budgets: bool | None = None, rank_budgets: bool | None = None,
                      block_n: int = 64, sample_n: int = 64, num_warps: int = 4, num_stages: int = 3,
                      sample_warps: int | None = None, sample_stages: int = 3, stats_programs: int = 264,
                      r_max: int | None = None, overlap: bool | None = None,
                      out: torch.Tensor | None = None):
    """S²ANTA-prop. Returns ``(out, counts or None, tile budgets [B, Hq, T] int32)``.

    - ``overlap=True`` (v10, ``santa.overlap``): stats in (row, KV head) order, the budget and
      sampling kernels launched early (PDL), each (row, KV head) getting its budgets and samples once its
      tiles are scored; ``None``: from ``PROP_OVERLAP_MIN_TILES`` tiles in all when programmatic dependent launch
      is on (Hopper and newer) and no other path option was given (``compact``, ``fold_merge``,
      ``inline_budgets``, ``rank_budgets``). v10 runs with its own launch parameters.
    - ``compact=True`` (v8, the default; needs ``fold_merge``): stats, then the compacted sampling pass
      with the merge folded in; the tile budgets are computed inside it when ``inline_budgets``
      (default: up to ``INLINE_BUDGET_MAX_TILES`` tiles; 2 launches), else by a budget kernel (3):
      ``rank_budgets`` picks the one that ranks chunks of tiles in parallel over the one-program-per-head
      sort.
    - ``compact=False``: the v7 passes: stats, budgets, sampling with the merge folded in
      (``fold_merge``, 3 launches) or followed by the merge kernel (4 launches).
    Same budgets and counts on every path. Scratch buffers are cached per device
    (``triton_utils.workspace``)."""
    _check_tile(tile)
    _check_rounding(rounding)
    if overlap is None:  # by length where the caller chose no path; it needs PDL (without it v10 is just slower)
        overlap = (compact and fold_merge and inline_budgets is None and rank_budgets is None
                   and _all_tiles(k, tile) >= PROP_OVERLAP_MIN_TILES and _can_overlap())
    if overlap:
        from .overlap import santa_overlap_triton

        return santa_overlap_triton(q, k, v, lens, scale, budget, tile, seed, flash=False, rounding=rounding,
                                    write_counts=write_counts, r_max=r_max, out=out)
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    t = _tiles(n, tile)
    compact = compact and fold_merge
    if inline_budgets is None:
        inline_budgets = t <= INLINE_BUDGET_MAX_TILES
    inline_budgets = inline_budgets and compact
    if rank_budgets is None:
        rank_budgets = RANK_BUDGETS_DEFAULT
    m, l, stash = _stats_buffers(q, b, hq, t, tile)
    _stats_raw(q, k, lens, m, l, stash, scale, b, hq, hkv, d, t, tile, block_n=block_n, num_warps=num_warps,
               num_stages=num_stages, stats_programs=stats_programs)
    budgets = torch.empty(b, hq, t, device=q.device, dtype=torch.int32)
    lo, hi = seed_words(seed)
    if not inline_budgets and rank_budgets:
        chunk = BUDGET_RANK_CHUNK
        launch(_prop_budget_rank_kernel, (-(-t // chunk), hq, b),
               m, l, lens, budgets, budget, lo, hi, _BUDGET_KEY, t, hq, hq * t, t,
               TILE=tile, BLOCK_T=max(16, next_pow2(t)), CHUNK=chunk, SYSTEMATIC=rounding == "systematic", PDL=_pdl(),
               num_warps=4, **_pdl_launch())
    elif not inline_budgets:
        launch(_prop_budget_kernel, (hq, b, 1),
               m, l, lens, budgets, budget, lo, hi, _BUDGET_KEY, t, hq, hq * t, t,
               TILE=tile, BLOCK_T=max(16, next_pow2(t)), SYSTEMATIC=rounding == "systematic", PDL=_pdl(), num_warps=4,
               **_pdl_launch())
    if out is None:
        out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    if compact:
        counts = _compact_raw(v, lens, m, l, stash, budgets, budget, tile, seed, b, hq, t, flash=False, out=out,
                              write_counts=write_counts, inline_budgets=inline_budgets,
                              systematic=rounding == "systematic",
                              r_max=r_max or default_r_max(hq // hkv, budget, t),
                              num_warps=sample_warps or 4)
        return out, counts, budgets
    acc, pm, pl, counts = _sample_raw(v, lens, m, l, stash, budgets, budget, tile, seed, b, hq, t, flash=False,
                                      fold=fold_merge, out=out, write_counts=write_counts, sample_n=sample_n,
                                      num_warps=sample_warps or 2, num_stages=sample_stages)
    if not fold_merge:
        merge_partials_raw(acc, pm, pl, lens, out, b, hq, t, d, tile, (hq * t * d, t * d, d), (hq * t, t))
    return out, counts, budgets


__all__ = ["santa_flash_triton", "santa_prop_triton"]
