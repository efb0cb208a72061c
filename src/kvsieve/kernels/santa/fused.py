"""S²ANTA-flash at few tiles: one kernel scores and samples each tile, then the split-KV merge (2 launches).

The default path of santa-flash up to ``decode.FLASH_FUSED_MAX_TILES`` tiles per head (8k keys at tile
256), where its one program per tile beats the two-pass form (``two_pass.py``), whose sampling pass draws
most of V at that size (measured: docs/methods/santa-kernels.md). Each program
scores its tile in pipelined sub-blocks into an L2-resident stash, keeps the online (m, l), draws
``S_tile = max(1, S // T_b)`` systematic samples walking the tile in sub-blocks, and writes ``l Σ c V /
S_tile`` as its part; ``triton_utils.merge_partials`` weighs the parts by ``e^{m} l``.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import dot_precision, group_block, launch, merge_partials, seed_words, triton, workspace
from .common import TILE_KEY, check_tile, fixed_point, split_at, stats_buffers, tile_count

if triton is not None:
    import triton.language as tl

    from ..shared.triton_utils import row_uniform
    from .common import budget_jit, count_dot, fold_scores, load_group_q, score_block

    @triton.jit
    def _score_tile(q_ptr, k_ptr, stash_ptr, b, kvh, t, length, scale,
                    s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_u_b, s_u_h,
                    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Scores of one tile for the G heads, in pipelined sub-blocks: stashed (float32, -inf past
        the row's length) and reduced to the tile's max m and sum l = Σ e^{s - m}."""
        q, heads, g_ok = load_group_q(q_ptr, b, kvh, s_q_b, s_q_h, G, BLOCK_G, D)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        k_base = k_ptr + b * s_k_b + kvh * s_k_h
        u_base = stash_ptr + b * s_u_b + heads[:, None] * s_u_h
        for j in range(0, TILE // BLOCK_N):
            s = score_block(q, k_base, u_base, t * TILE + j * BLOCK_N + tl.arange(0, BLOCK_N), length, scale, s_k_n,
                            g_ok, D, DOT_PRECISION)
            m, l = fold_scores(m, l, s)
        return m, l

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
            acc += count_dot(c, v, SPLIT_COUNTS, DOT_PRECISION)
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
            a0 = row_uniform(seed_lo, seed_hi, length, stream_key, (b * hq + heads).to(tl.int64) * n_tiles + t)
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


def santa_flash_fused(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                      write_counts: bool = False, out: torch.Tensor | None = None, block_n: int = 128):
    """S²ANTA-flash, one program per tile and the merge. Returns ``(out [B, Hq, d] in q's dtype, counts
    [B, Hq, N] int32 or None)``; ``block_n`` (keys per scoring sub-block) changes no count."""
    check_tile(tile)
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    t = tile_count(n, tile)
    if out is None:
        out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    m, l, stash = stats_buffers(q, b, hq, t, tile)
    acc = workspace("acc", q, b * hq * t * d, torch.float32)
    counts = torch.zeros(b, hq, n, device=q.device, dtype=torch.int32) if write_counts else None
    lo, hi = seed_words(seed)
    launch(_flash_tile_kernel, (t, hkv, b),
           q, k, v, lens, stash, acc, m, l, counts if write_counts else acc,
           scale, budget, lo, hi, TILE_KEY, t, hq,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           hq * t * tile, t * tile, hq * t * d, t * d, d, hq * t, t,
           (hq * n) if write_counts else 0, n if write_counts else 0,
           G=g, BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(block_n, tile), SAMPLE_N=min(256, tile),
           SPLIT_COUNTS=budget > split_at(v.dtype), WRITE_COUNTS=write_counts,
           DOT_PRECISION=dot_precision(q.dtype), **fixed_point(budget), num_warps=4, num_stages=3)
    merge_partials(acc, m, l, lens, out, b, hq, t, d, tile, (hq * t * d, t * d, d), (hq * t, t))
    return out, counts


__all__ = ["santa_flash_fused"]
