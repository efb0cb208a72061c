"""What the S²ANTA Triton kernels share: the scoring and sampling steps, the tile budgets, the buffers.

The three forms of the default path (``decode.py`` picks one per call) are built from these pieces:
``two_pass.py`` (v8: stats pass, budgets, compacted sampling pass), ``fused.py`` (santa-flash at few
tiles: one kernel scores and samples each tile) and ``overlap.py`` (v10: the v8 passes with the sampling
overlapping the K stream). Counts are exact fixed-point prefix sums (``fixed_point``), so every form
draws the same counts for the same seed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..shared.triton_utils import (
    STREAM_BUDGET,
    STREAM_TILE,
    cdiv,
    dot_precision,
    group_block,
    next_pow2,
    pdl_available,
    triton,
    workspace,
)

if triton is not None:
    import triton.language as tl

    from ..shared.triton_utils import row_uniform

    # Triton compiles an int argument equal to 1 as a constexpr, on which ``budget.to(...)`` fails: the
    # kernels that take the budget keep it a runtime value (budget = 1 is a valid call)
    budget_jit = triton.jit(do_not_specialize=["budget"])

    @triton.jit
    def load_group_q(q_ptr, b, kvh, s_q_b, s_q_h, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr):
        """The G query rows of KV head kvh's group in batch row b, padded to BLOCK_G rows for ``tl.dot``;
        returns (q, heads, g_ok)."""
        offs_g = tl.arange(0, BLOCK_G)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + b * s_q_b + heads[:, None] * s_q_h + tl.arange(0, D)[None, :], mask=g_ok[:, None],
                    other=0.0)
        return q, heads, g_ok

    @triton.jit
    def score_block(q, k_base, u_base, offs_n, length, scale, s_k_n, g_ok, D: tl.constexpr,
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
    def fold_scores(m, l, s):
        """The running max m and sum l of e^{s - m} with the scores s [G, n] folded in."""
        m_new = tl.maximum(m, tl.max(s, axis=1))
        return m_new, l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)

    @triton.jit
    def count_dot(c, v, SPLIT_COUNTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
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
    def share_parts(w, scale):
        """The whole and fractional parts of the shares ``w · scale [:, None]``, the fraction quantised to 2^-40
        (int64). The fraction is one fused multiply-add, ``w · scale - floor(w · scale)`` rounded once, spelled
        out so that it does not depend on whether the compiler contracts the two operations (the interpreter
        and the compiled kernel, and the tests' exact twin, get the same number)."""
        base = tl.floor(w * scale[:, None])
        return base, (tl.fma(w, scale[:, None], -base) * 1099511627776.0).to(tl.int64)

    @triton.jit
    def _threshold_step(x, rem, v, above, p: tl.constexpr, BITS: tl.constexpr, DIGIT_BITS: tl.constexpr,
                        EARLY_EXIT: tl.constexpr):
        """Step ``p`` of :func:`histogram_threshold`: ``(v, above, known)`` with the threshold's next digit in
        ``v`` and the entries above its digits so far in ``above``. With EARLY_EXIT, when every entry of the
        digit's bin is needed (the entries above it and the bin's make exactly ``rem``), ``v`` is the bin's least
        entry, which the later steps would spell out digit by digit, and ``known`` is 1."""
        NB: tl.constexpr = 1 << DIGIT_BITS
        bins = tl.arange(0, NB)
        match = (x >= 0) & ((x >> (BITS - p * DIGIT_BITS)) == (v >> (BITS - p * DIGIT_BITS)))
        digit = (x >> (BITS - (p + 1) * DIGIT_BITS)) & (NB - 1)
        hist = tl.histogram(digit, NB, mask=match)
        at_or_above = above + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # entries >= each digit
        pick = tl.maximum(tl.sum((at_or_above >= rem).to(tl.int32), axis=0) - 1, 0)
        above += tl.sum(tl.where(bins > pick, hist, 0), axis=0)
        v += pick << (BITS - (p + 1) * DIGIT_BITS)
        known = rem * 0
        if EARLY_EXIT:
            in_pick = tl.sum(tl.where(bins == pick, hist, 0), axis=0)
            if (in_pick > 0) & (above + in_pick == rem):
                v = tl.min(tl.where(match & (digit == pick), x, 1 << BITS), axis=0)
                known += 1
        return v, above, known

    @triton.jit
    def histogram_threshold(x, rem, BITS: tl.constexpr, DIGIT_BITS: tl.constexpr, EARLY_EXIT: tl.constexpr):
        """Per row ``x [C]`` (int32, entries below 0 never count; ``rem`` a scalar): the largest v in [0, 2^BITS)
        with ``#{x >= v} >= rem`` (0 when none qualifies), most significant digit first, DIGIT_BITS bits a step:
        a histogram of the digit (``tl.histogram``) over the entries that share the threshold's digits so far.
        Entries of 2^BITS and above count as above every candidate. EARLY_EXIT: the steps after the one that
        makes the threshold known are skipped (:func:`_threshold_step`; the same value)."""
        tl.static_assert(BITS % DIGIT_BITS == 0)
        v = rem * 0
        above = tl.sum((x >= (1 << BITS)).to(tl.int32), axis=0)  # entries above the threshold's digits so far
        known = rem * 0
        for p in tl.static_range(BITS // DIGIT_BITS):
            if EARLY_EXIT:
                if known == 0:
                    v, above, known = _threshold_step(x, rem, v, above, p, BITS, DIGIT_BITS, EARLY_EXIT)
            else:
                v, above, known = _threshold_step(x, rem, v, above, p, BITS, DIGIT_BITS, EARLY_EXIT)
        return v

    @triton.jit
    def group_budgets(m_ptr, l_ptr, budgets_ptr, heads, h_ok, b, length, tiles_b, budget, seed_lo, seed_hi, budget_key,
                      n_tiles, hq, s_ml_b, s_ml_h, BLOCK_T: tl.constexpr, SYSTEMATIC: tl.constexpr,
                      DIGIT_BITS: tl.constexpr, EARLY_EXIT: tl.constexpr):
        """The tile budgets of one head ``heads [1]`` (``h_ok``: whether it is real) of batch row b, from the tile
        masses W_t = e^{m_t - m*} l_t (Alg. 4): largest remainder (the +1s go to the largest fractional
        parts, ties to the lower tile) or systematic rounding (fixed-point prefix sums with 2^-32
        resolution). (m, l) are read from L2 (``.cg``): in the overlapped passes (v10) the stats kernel
        writes them while this kernel runs.

        Largest remainder: the +1s go to the ``rem`` largest fractions (quantised to 2^-40), found without
        sorting the row padded to BLOCK_T: the rem-th largest fraction v by ``histogram_threshold`` (its 40
        bits as two 20-bit halves, int32 compares), then the +1s to the fractions above v and to the lowest
        tiles of those equal to v, as many as are left."""
        cols = tl.arange(0, BLOCK_T)
        ok = h_ok[:, None] & (cols < tiles_b)[None, :]
        row = (b * s_ml_b + heads * s_ml_h)[:, None] + cols[None, :]
        m = tl.load(m_ptr + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(l_ptr + row, mask=ok, other=0.0, cache_modifier=".cg")
        m_star = tl.max(m, axis=1)
        w = tl.where(ok, tl.exp(m - tl.where(h_ok, m_star, 0.0)[:, None]) * l, 0.0).to(tl.float64)
        z = tl.sum(w, axis=1)
        scale = budget.to(tl.float64) / tl.where(z > 0, z, 1.0)
        if SYSTEMATIC:
            share = w * scale[:, None]
            a_b = row_uniform(seed_lo, seed_hi, length, budget_key, (b * hq + heads).to(tl.int64))
            x = tl.floor(share * 4294967296.0).to(tl.int64)
            top = budget.to(tl.int64) << 32
            hi = tl.cumsum(x, axis=1)
            a = (a_b * 4294967296.0).to(tl.int64)[:, None]
            bt = ((a + tl.minimum(hi, top)) >> 32) - ((a + tl.minimum(hi - x, top)) >> 32)
            drawn = tl.sum(bt, axis=1)
            last = tl.max(tl.where(x > 0, cols[None, :], -1), axis=1)
            bt = bt + tl.where(cols[None, :] == last[:, None], (budget.to(tl.int64) - drawn)[:, None], 0)
        else:
            base, q = share_parts(w, scale)
            rem = budget - tl.sum(base, axis=1).to(tl.int32)
            # one head: the row as a 1-D tensor, which tl.histogram takes
            tl.static_assert(heads.shape[0] == 1)
            q = tl.reshape(q, [BLOCK_T])
            ok1 = tl.reshape(ok, [BLOCK_T])
            r1 = tl.sum(rem, axis=0)
            q_hi = tl.where(ok1, (q >> 20).to(tl.int32), -1)
            v_hi = histogram_threshold(q_hi, r1, 20, DIGIT_BITS, EARLY_EXIT)
            # the low 20 bits of the fractions whose high bits equal v_hi; 2^20 (above any) for those above
            q_lo = tl.where(q_hi > v_hi, 1 << 20, tl.where(q_hi == v_hi, (q & 1048575).to(tl.int32), -1))
            v_lo = histogram_threshold(q_lo, r1, 20, DIGIT_BITS, EARLY_EXIT)
            tie = (q_lo == v_lo).to(tl.int32)
            need = r1 - tl.sum((q_lo > v_lo).to(tl.int32), axis=0)
            bonus = tl.reshape((q_lo > v_lo) | ((tie > 0) & (tl.cumsum(tie, axis=0) <= need)), [1, BLOCK_T])
            bt = base.to(tl.int32) + tl.where((rem > 0)[:, None], (bonus & ok).to(tl.int32), 0)
        bt = tl.where(ok & (z > 0)[:, None], bt.to(tl.int32), 0)
        tl.store(budgets_ptr + row, bt, mask=h_ok[:, None] & (cols < n_tiles)[None, :])

    @triton.jit
    def compact_sample(v_ptr, s, counts_ptr, scr_ptr, b, kvh, t, length, m, l, budget, a0,
                       s_v_b, s_v_h, s_v_n, s_c_b, s_c_h,
                       G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                       TILE: tl.constexpr, R_MAX: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr):
        """Systematic sampling of ``budget [GP]`` draws in one tile from its stashed scores ``s [GP, TILE]``
        (loaded by the caller), the whole tile at once and on the G rows of the group only, then
        ``Σ_n c_n V_n`` [BLOCK_G, D] from the sampled rows only. Same counts as the fused kernel's sub-block walk: the
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
                acc += count_dot(cnt, v, True, DOT_PRECISION)
            else:
                acc += count_dot(cnt, v, False, DOT_PRECISION)
        return acc

    @triton.jit
    def sample_tile(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
                    oacc_ptr, oden_ptr, t, kvh, b,
                    budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
                    s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h,
                    G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                    R_MAX: tl.constexpr, FLASH: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr, LOAD_CACHE: tl.constexpr):
        """Tile t of (row b, KV head kvh): sampling and the V gather, the tile's share added to the
        accumulators (relaxed atomics).

        - prop: the tile budgets are read from ``budgets_ptr``; the program adds ``Σ c V`` to ``oacc``.
        - flash: every tile draws ``max(1, S // T_b)``; the stats pass left each head's global max in
          ``mstar``, so the program adds ``e^{m_t - m*} l_t Σ c V / S_tile`` to ``oacc`` and
          ``e^{m_t - m*} l_t`` to ``oden``.

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
        if not FLASH:
            tile_budget = tl.load(budgets_ptr + ml_row + t, mask=g_ok, other=0, cache_modifier=LOAD_CACHE)
        tiles_b = (length + TILE - 1) // TILE
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
            if tl.max(tile_budget, axis=0) > 0:  # tiles without samples read nothing and add nothing
                a0 = row_uniform(seed_lo, seed_hi, length, tile_key, (b * hq + heads).to(tl.int64) * n_tiles + t)
                scr = scr_ptr + ((b * hkv + kvh) * n_tiles + t).to(tl.int64) * (TILE * (1 + GP))
                acc = compact_sample(v_ptr, s, counts_ptr, scr, b, kvh, t, length, m, l, tile_budget, a0,
                                     s_v_b, s_v_h, s_v_n, s_c_b, s_c_h,
                                     G, GP, BLOCK_G, D, TILE, R_MAX, SPLIT_AT, DOT_PRECISION, WRITE_COUNTS,
                                     FIX_BITS, WIDE)
                if FLASH:
                    acc = acc * (mass / s_tile.to(tl.float32))[:, None]
                    tl.atomic_add(oden_ptr + b * hq + heads_r, mass, mask=r_ok, sem="relaxed")
                tl.atomic_add(oacc_ptr + r_rows, acc, mask=r_ok[:, None], sem="relaxed")

    @triton.jit
    def sample_fold(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
                    oacc_ptr, oden_ptr, done_ptr, out_ptr, t, kvh, b,
                    budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
                    s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
                    G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                    R_MAX: tl.constexpr, FLASH: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr, LOAD_CACHE: tl.constexpr):
        """``sample_tile`` with the merge folded in (v8): the last of the ``n_tiles`` programs of a (row, KV
        head) (an acq_rel counter) reads the accumulators through atomics (L2, no stale L1 line), writes
        ``out`` (prop ``oacc / S``, flash ``oacc / oden``) and leaves the accumulators, ``mstar`` and the
        counter as the next call expects them (zero, -inf, zero); it returns True."""
        sample_tile(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
                    oacc_ptr, oden_ptr, t, kvh, b, budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
                    s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h,
                    G, GP, BLOCK_G, D, TILE, R_MAX, FLASH, SPLIT_AT, DOT_PRECISION, WRITE_COUNTS, FIX_BITS, WIDE,
                    LOAD_CACHE)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        o_rows = (b * hq + heads)[:, None] * D + offs_d[None, :]
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


# Warps of the sampling programs (one per tile, KV head and row; most have no sample, the rest a short chain of
# dependent loads): 2 warps fit twice the programs per SM beside the stats pass's. H200, the whole call, cold L2
# (benchmarks/breakdown/launch_sweep.py --in-call): santa-prop 112.4 → 109.8 µs at 128k batch 1, Bernoulli's values
# 341 → 331 µs at 32k batch 8 against 4 warps; 8 warps lost at both
SAMPLE_WARPS = 2
TILE_KEY = (STREAM_TILE * 0x9E3779B9) & 0xFFFFFFFF  # the hash streams of the tile offsets and budget offsets
BUDGET_KEY = (STREAM_BUDGET * 0x9E3779B9) & 0xFFFFFFFF

# Bits of the largest-remainder threshold settled per histogram step (``histogram_threshold``): 4 steps per
# 20-bit half of the fractions
_DIGIT_BITS = 5
# The threshold's steps skipped once it is known (``histogram_threshold``'s EARLY_EXIT; the same budgets to the
# bit). H200, on the end-to-end model's operands (benchmarks/breakdown/e2e_layers.py --set): santa-prop's layer calls
# 100.7–107.6 → 99.5–100.0 µs at 128k batch 1, Bernoulli's values 7.48 → 7.41 ms a step; the budget launch alone
# 11.3 → 10.2 µs (santa_budget.py --early-exit). False times the select without it
BUDGET_EARLY_EXIT = True


def budget_meta(t: int, *, rounding: str) -> dict:
    """``group_budgets``' constexprs (from BLOCK_T on) for rows of ``t`` tiles."""
    return dict(BLOCK_T=max(16, next_pow2(t)), SYSTEMATIC=rounding == "systematic", DIGIT_BITS=_DIGIT_BITS,
                EARLY_EXIT=BUDGET_EARLY_EXIT)


def tile_count(n_keys: int, tile: int) -> int:
    return cdiv(n_keys, tile)


def all_tiles(k: torch.Tensor, tile: int) -> int:
    """Tiles of the stats pass: rows × KV heads × tiles per head."""
    return k.shape[0] * k.shape[1] * tile_count(k.shape[2], tile)


def check_tile(tile: int) -> None:
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile_size: the Triton kernels take a power of two ≥ 16, got {tile}")


def check_rounding(rounding: str) -> None:
    if rounding not in ("largest-remainder", "systematic"):
        raise ValueError(f"rounding: expected 'largest-remainder' or 'systematic', got {rounding!r}")


def fixed_point(max_tile_budget: int) -> dict:
    """Resolution of the running sums: int32 with (S + 1)·2^bits ≤ 2^30 while that leaves ≥ 16 bits,
    else int64 with 24 bits."""
    bits = 30 - max(1, int(max_tile_budget)).bit_length()
    return {"FIX_BITS": bits, "WIDE": False} if bits >= 16 else {"FIX_BITS": 24, "WIDE": True}


def split_at(dtype: torch.dtype) -> int:
    """The largest count a 16-bit dot operand holds exactly (bf16 256, fp16 2048; fp32 dots are exact)."""
    return {torch.bfloat16: 256, torch.float16: 2048}.get(dtype, 1 << 30)


def default_r_max(group: int, budget: int, tiles: int) -> int:
    """Rows gathered per step of the compacted V gather: the group's expected samples in a tile
    (G·S/T, the flash tile budget), as a power of two in [16, 64]; more rows take more steps."""
    return min(64, max(16, next_pow2(group * max(1, cdiv(budget, max(1, tiles))))))


def stats_buffers(q, b, hq, t, tile):
    """m, l ``[B·Hq·T]`` and the float32 score stash ``[B·Hq·T·tile]`` (workspace, flat)."""
    return (workspace("m", q, b * hq * t, torch.float32), workspace("l", q, b * hq * t, torch.float32),
            workspace("stash", q, b * hq * t * tile, torch.float32))


class PassBuffers(NamedTuple):
    """What one call of the stats + compacted sampling passes writes."""
    m: torch.Tensor
    l: torch.Tensor
    stash: torch.Tensor
    budgets: torch.Tensor | None  # [B, Hq, T] int32, returned to the caller; None for flash
    mstar: torch.Tensor  # santa-flash's per-head global maxima (-inf between calls)
    oacc: torch.Tensor  # the folded merge's accumulators [B·Hq·d], [B·Hq] and counters [B·Hkv]: zero between calls
    oden: torch.Tensor
    done: torch.Tensor
    scr: torch.Tensor  # the compaction scratch
    counts: torch.Tensor | None  # [B, Hq, N] int32 when the caller asked for counts
    out: torch.Tensor


def pass_buffers(q, v, t: int, tile: int, *, flash: bool, write_counts: bool, out) -> PassBuffers:
    b, hq, d = q.shape
    hkv, n = v.shape[1], v.shape[2]
    m, l, stash = stats_buffers(q, b, hq, t, tile)
    return PassBuffers(
        m, l, stash, None if flash else torch.empty(b, hq, t, device=q.device, dtype=torch.int32),
        workspace("mstar", q, b * hq, torch.float32, fill=float("-inf")),
        workspace("fold_acc", v, b * hq * d, torch.float32, zeroed=True),
        workspace("fold_den", v, b * hq, torch.float32, zeroed=True),
        workspace("fold_done", v, b * hkv, torch.int32, zeroed=True),
        workspace("compact_scratch", v, b * hkv * t * tile * (1 + next_pow2(hq // hkv)), torch.int32),
        torch.zeros(b, hq, n, device=q.device, dtype=torch.int32) if write_counts else None,
        out if out is not None else torch.empty(b, hq, d, device=q.device, dtype=q.dtype))


def begin_call(q, k, v, tile: int, *, flash: bool, rounding: str, write_counts: bool, out
               ) -> tuple[int, bool, PassBuffers]:
    """Checks a call of the stats + compacted sampling passes (v8 or v10) and gets its buffers: (tiles per
    head, whether programmatic dependent launch is on, the buffers)."""
    check_tile(tile)
    check_rounding(rounding)
    t = tile_count(k.shape[2], tile)
    return t, pdl_available(), pass_buffers(q, v, t, tile, flash=flash, write_counts=write_counts, out=out)


def sample_strides(v, buf: PassBuffers, hq: int, t: int, tile: int, write_counts: bool) -> tuple:
    """The strides ``sample_fold`` takes: V, the (m, l) rows, the stash rows, the counts rows, ``out``."""
    n = v.shape[2]
    return (v.stride(0), v.stride(1), v.stride(2), hq * t, t, hq * t * tile, t * tile,
            (hq * n) if write_counts else 0, n if write_counts else 0, buf.out.stride(0), buf.out.stride(1))


def sample_constexprs(v, hq: int, budget: int, t: int, tile: int, *, flash: bool, write_counts: bool,
                      r_max: int | None) -> dict:
    """The compile-time arguments ``sample_fold`` takes."""
    g = hq // v.shape[1]
    return dict(G=g, GP=next_pow2(g), BLOCK_G=group_block(g), D=v.shape[3], TILE=tile,
                R_MAX=min(r_max or default_r_max(g, budget, t), tile), FLASH=flash, SPLIT_AT=split_at(v.dtype),
                DOT_PRECISION=dot_precision(v.dtype), WRITE_COUNTS=write_counts, **fixed_point(budget))
