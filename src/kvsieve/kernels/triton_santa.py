"""S²ANTA-flash and S²ANTA-prop decode kernels in Triton.

Torch references: ``kvsieve.kernels.santa_reference.santa_flash_reference`` and
``santa_prop_reference`` (float64). Given the uniforms of ``triton_common.tile_uniforms`` /
``budget_uniforms`` the kernels draw the same counts, except for rare floor-boundary flips: scores
are float32 here, and the running sums of systematic sampling are fixed-point integers with 2^-24
resolution (exact prefix sums, so every tile's counts add up to its budget to the unit).

Layout and grid: q ``[B, Hq, d]``, K/V ``[B, Hkv, N, d]`` (the transformers cache; last dim
contiguous), ``lens [B]`` valid prefix lengths. One program per (tile, KV head, batch row) loads the
K tile once for the G query heads of its group; V rows are loaded with a row mask, so rows that no
head of the group sampled issue no memory traffic; the V accumulation is ``tl.dot(counts, V)``.

- flash (2 launches): ``_flash_tile_kernel`` (tile stats + ``S_tile = max(1, S // T_b)`` systematic
  samples + gather) then the split-KV merge with weights ``e^{m_t} l_t``.
- prop (3 launches): ``_prop_stats_kernel`` (per-tile max m, sum l and the exp-score stash u,
  float32) → ``_prop_sample_kernel``, where each (tile, KV head) program recomputes the budgets of
  its own tile from every tile's (m, l) — largest remainder by rank, or systematic rounding from two
  prefix sums computed with the same masks in every program, so budgets agree across programs and
  sum to S without a separate budget launch — then samples and gathers; then the merge
  (``m = 0``, ``l = S_t``: ``out = Σ_t acc_t / S``).
"""

from __future__ import annotations

import math

import torch

from .triton_common import (
    STREAM_BUDGET,
    STREAM_TILE,
    group_block,
    merge_partials,
    next_pow2,
    seed_words,
    triton,
)

if triton is not None:
    import triton.language as tl

    from .triton_common import hash_uniform

    @triton.jit
    def _load_tile_scores(q_ptr, k_ptr, b, kvh, t, length, scale, s_q_b, s_q_h, s_k_b, s_k_h, s_k_n,
                          G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = t * TILE + tl.arange(0, TILE)
        n_ok = offs_n < length
        q = tl.load(q_ptr + b * s_q_b + (kvh * G + offs_g)[:, None] * s_q_h + offs_d[None, :],
                    mask=(offs_g < G)[:, None], other=0.0)
        k = tl.load(k_ptr + b * s_k_b + kvh * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                    mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        return tl.where(n_ok[None, :], s, float("-inf"))

    @triton.jit
    def _systematic_tile_counts(u, budget, a0, TILE: tl.constexpr):
        """Counts [BLOCK_G, TILE] (int64) of ``budget [BLOCK_G]`` systematic samples with weights u."""
        FIX: tl.constexpr = 1 << 24
        cols = tl.arange(0, TILE)
        l = tl.sum(u, axis=1)
        bf = budget.to(tl.float32)
        x = u * tl.where(l > 0, bf / tl.where(l > 0, l, 1.0), 0.0)[:, None]
        xi = (x * FIX + 0.5).to(tl.int64)
        cum = tl.cumsum(xi, axis=1)
        top = (budget.to(tl.int64) * FIX)[:, None]
        last = tl.max(tl.where(xi > 0, cols[None, :], -1), axis=1)[:, None]
        hi = tl.where(cols[None, :] >= last, top, tl.minimum(cum, top))
        lo = tl.where(cols[None, :] > last, top, tl.minimum(cum - xi, top))
        a = (a0 * FIX).to(tl.int64)[:, None]
        return ((a + hi) >> 24) - ((a + lo) >> 24)

    @triton.jit
    def _gather_counts(c, v_ptr, b, kvh, t, length, s_v_b, s_v_h, s_v_n,
                       D: tl.constexpr, TILE: tl.constexpr, SPLIT_COUNTS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
        """``Σ_n c[g, n] V[n]`` [BLOCK_G, D] fp32, reading only V rows with a nonzero count."""
        offs_n = t * TILE + tl.arange(0, TILE)
        offs_d = tl.arange(0, D)
        used = (tl.max(c, axis=0) > 0) & (offs_n < length)
        v = tl.load(v_ptr + b * s_v_b + kvh * s_v_h + offs_n[:, None] * s_v_n + offs_d[None, :],
                    mask=used[:, None], other=0.0)
        if SPLIT_COUNTS:
            # 16-bit dots hold integers exactly only up to 256: split counts into two bytes.
            c_lo = (c & 255).to(tl.float32).to(v.dtype)
            c_hi = (c >> 8).to(tl.float32).to(v.dtype)
            acc = tl.dot(c_lo, v, input_precision=DOT_PRECISION)
            acc += 256.0 * tl.dot(c_hi, v, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(c.to(tl.float32).to(v.dtype), v, input_precision=DOT_PRECISION)
        return acc

    @triton.jit
    def _flash_tile_kernel(
        q_ptr, k_ptr, v_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, counts_ptr,
        scale, budget, seed_lo, seed_hi, stream_key, n_tiles, hq,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n,
        s_acc_b, s_acc_h, s_acc_p, s_ml_b, s_ml_h, s_c_b, s_c_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        SPLIT_COUNTS: tl.constexpr, WRITE_COUNTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        if t * TILE < length:
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = kvh * G + offs_g
            s = _load_tile_scores(q_ptr, k_ptr, b, kvh, t, length, scale, s_q_b, s_q_h, s_k_b, s_k_h, s_k_n,
                                  G, BLOCK_G, D, TILE, DOT_PRECISION)
            m = tl.max(s, axis=1)
            u = tl.exp(s - m[:, None])
            l = tl.sum(u, axis=1)
            tiles_b = (length + TILE - 1) // TILE
            s_tile = tl.maximum(budget // tiles_b, 1)
            row_budget = tl.where(g_ok, s_tile, 0)
            a0 = hash_uniform(seed_lo, seed_hi, stream_key, (b * hq + heads).to(tl.int64) * n_tiles + t)
            c = _systematic_tile_counts(u, row_budget, a0, TILE)
            acc = _gather_counts(c, v_ptr, b, kvh, t, length, s_v_b, s_v_h, s_v_n, D, TILE, SPLIT_COUNTS,
                                 DOT_PRECISION)
            # The merge weighs parts by e^{m} l: store l·Õ/S_tile so that the tile estimate gets W_t/Z.
            acc = acc * (l / s_tile.to(tl.float32))[:, None]
            offs_d = tl.arange(0, D)
            tl.store(acc_ptr + b * s_acc_b + heads[:, None] * s_acc_h + t * s_acc_p + offs_d[None, :],
                     acc, mask=g_ok[:, None])
            tl.store(m_ptr + b * s_ml_b + heads * s_ml_h + t, m, mask=g_ok)
            tl.store(l_ptr + b * s_ml_b + heads * s_ml_h + t, l, mask=g_ok)
            if WRITE_COUNTS:
                offs_n = t * TILE + tl.arange(0, TILE)
                tl.store(counts_ptr + b * s_c_b + heads[:, None] * s_c_h + offs_n[None, :], c.to(tl.int32),
                         mask=g_ok[:, None] & (offs_n < length)[None, :])

    @triton.jit
    def _prop_stats_kernel(
        q_ptr, k_ptr, lens_ptr, m_ptr, l_ptr, u_ptr,
        scale,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        if t * TILE < length:
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = kvh * G + offs_g
            s = _load_tile_scores(q_ptr, k_ptr, b, kvh, t, length, scale, s_q_b, s_q_h, s_k_b, s_k_h, s_k_n,
                                  G, BLOCK_G, D, TILE, DOT_PRECISION)
            m = tl.max(s, axis=1)
            u = tl.exp(s - m[:, None])
            l = tl.sum(u, axis=1)
            tl.store(m_ptr + b * s_ml_b + heads * s_ml_h + t, m, mask=g_ok)
            tl.store(l_ptr + b * s_ml_b + heads * s_ml_h + t, l, mask=g_ok)
            offs_n = t * TILE + tl.arange(0, TILE)
            tl.store(u_ptr + b * s_u_b + heads[:, None] * s_u_h + offs_n[None, :], u, mask=g_ok[:, None])

    @triton.jit
    def _prop_sample_kernel(
        v_ptr, lens_ptr, m_ptr, l_ptr, u_ptr, acc_ptr, pm_ptr, pl_ptr, counts_ptr, budgets_ptr,
        budget, seed_lo, seed_hi, tile_key, budget_key, n_tiles, hq,
        s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
        s_acc_b, s_acc_h, s_acc_p, s_c_b, s_c_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        CHUNK_T: tl.constexpr, SYSTEMATIC: tl.constexpr,
        SPLIT_COUNTS: tl.constexpr, WRITE_COUNTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        tiles_b = (length + TILE - 1) // TILE
        if t < tiles_b:
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = kvh * G + offs_g
            # --- this tile's budget per head, from every tile's mass W = e^{m - m*} l (float64) ---
            # Every program runs the same loops over the same data, so all programs of a head agree on
            # z, the floors and the prefix sums bit for bit: the budgets sum to S with no barrier.
            ml_row = b * s_ml_b + heads * s_ml_h
            m_star = tl.full([BLOCK_G], float("-inf"), tl.float32)
            for c0 in range(0, tiles_b, CHUNK_T):
                cols = c0 + tl.arange(0, CHUNK_T)
                ok = g_ok[:, None] & (cols < tiles_b)[None, :]
                mc = tl.load(m_ptr + ml_row[:, None] + cols[None, :], mask=ok, other=float("-inf"))
                m_star = tl.maximum(m_star, tl.max(mc, axis=1))
            m_star = tl.where(g_ok, m_star, 0.0)
            z = tl.zeros([BLOCK_G], tl.float64)
            for c0 in range(0, tiles_b, CHUNK_T):
                cols = c0 + tl.arange(0, CHUNK_T)
                ok = g_ok[:, None] & (cols < tiles_b)[None, :]
                mc = tl.load(m_ptr + ml_row[:, None] + cols[None, :], mask=ok, other=float("-inf"))
                lc = tl.load(l_ptr + ml_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float64)
                w = tl.where(ok, tl.exp((mc - m_star[:, None]).to(tl.float64)) * lc, 0.0)
                z += tl.sum(w, axis=1)
            z_ok = z > 0
            share_scale = budget.to(tl.float64) / tl.where(z_ok, z, 1.0)
            bud = budget.to(tl.float64)
            acc_hi = tl.zeros([BLOCK_G], tl.float64)  # systematic: Σ_{j<=t} W_j;  LR: Σ floor(q_j)
            acc_lo = tl.zeros([BLOCK_G], tl.float64)  # systematic: Σ_{j<t} W_j;   LR: unused
            my_frac = tl.zeros([BLOCK_G], tl.float64)
            my_base = tl.zeros([BLOCK_G], tl.float64)
            for c0 in range(0, tiles_b, CHUNK_T):
                cols = c0 + tl.arange(0, CHUNK_T)
                ok = g_ok[:, None] & (cols < tiles_b)[None, :]
                mc = tl.load(m_ptr + ml_row[:, None] + cols[None, :], mask=ok, other=float("-inf"))
                lc = tl.load(l_ptr + ml_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float64)
                w = tl.where(ok, tl.exp((mc - m_star[:, None]).to(tl.float64)) * lc, 0.0)
                if SYSTEMATIC:
                    acc_hi += tl.sum(tl.where(cols[None, :] <= t, w, 0.0), axis=1)
                    acc_lo += tl.sum(tl.where(cols[None, :] < t, w, 0.0), axis=1)
                else:
                    share = w * share_scale[:, None]
                    base = tl.floor(share)
                    frac = share - base
                    acc_hi += tl.sum(base, axis=1)
                    mine = cols[None, :] == t
                    my_frac += tl.sum(tl.where(mine, frac, 0.0), axis=1)
                    my_base += tl.sum(tl.where(mine, base, 0.0), axis=1)
            if SYSTEMATIC:
                hi_edge = tl.where(t == tiles_b - 1, bud, tl.minimum(acc_hi * share_scale, bud))
                lo_edge = tl.minimum(acc_lo * share_scale, bud)
                a_b = hash_uniform(seed_lo, seed_hi, budget_key, (b * hq + heads).to(tl.int64)).to(tl.float64)
                tile_budget = (tl.floor(a_b + hi_edge) - tl.floor(a_b + lo_edge)).to(tl.int32)
            else:
                rem = budget - acc_hi.to(tl.int32)
                rank = tl.zeros([BLOCK_G], tl.int32)
                for c0 in range(0, tiles_b, CHUNK_T):
                    cols = c0 + tl.arange(0, CHUNK_T)
                    ok = g_ok[:, None] & (cols < tiles_b)[None, :]
                    mc = tl.load(m_ptr + ml_row[:, None] + cols[None, :], mask=ok, other=float("-inf"))
                    lc = tl.load(l_ptr + ml_row[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float64)
                    w = tl.where(ok, tl.exp((mc - m_star[:, None]).to(tl.float64)) * lc, 0.0)
                    share = w * share_scale[:, None]
                    frac = share - tl.floor(share)
                    ahead = (frac > my_frac[:, None]) | ((frac == my_frac[:, None]) & (cols[None, :] < t))
                    rank += tl.sum((ahead & ok).to(tl.int32), axis=1)
                tile_budget = my_base.to(tl.int32) + (rank < rem).to(tl.int32)
            tile_budget = tl.where(g_ok & z_ok, tile_budget, 0)
            # --- systematic sampling inside the tile from the stash ---
            offs_n = t * TILE + tl.arange(0, TILE)
            n_ok = offs_n < length
            u = tl.load(u_ptr + b * s_u_b + heads[:, None] * s_u_h + offs_n[None, :],
                        mask=g_ok[:, None] & n_ok[None, :], other=0.0)
            a0 = hash_uniform(seed_lo, seed_hi, tile_key, (b * hq + heads).to(tl.int64) * n_tiles + t)
            c = _systematic_tile_counts(u, tile_budget, a0, TILE)
            acc = _gather_counts(c, v_ptr, b, kvh, t, length, s_v_b, s_v_h, s_v_n, D, TILE, SPLIT_COUNTS,
                                 DOT_PRECISION)
            offs_d = tl.arange(0, D)
            tl.store(acc_ptr + b * s_acc_b + heads[:, None] * s_acc_h + t * s_acc_p + offs_d[None, :],
                     acc, mask=g_ok[:, None])
            pm = b * s_ml_b + heads * s_ml_h + t
            tl.store(pm_ptr + pm, tl.zeros([BLOCK_G], tl.float32), mask=g_ok)
            tl.store(pl_ptr + pm, tile_budget.to(tl.float32), mask=g_ok)
            tl.store(budgets_ptr + pm, tile_budget, mask=g_ok)
            if WRITE_COUNTS:
                tl.store(counts_ptr + b * s_c_b + heads[:, None] * s_c_h + offs_n[None, :], c.to(tl.int32),
                         mask=g_ok[:, None] & n_ok[None, :])
        else:
            # Tiles past the row's length hold no sample; written so that no memset launch is needed.
            offs_g = tl.arange(0, BLOCK_G)
            tl.store(budgets_ptr + b * s_ml_b + (kvh * G + offs_g) * s_ml_h + t, tl.zeros([BLOCK_G], tl.int32),
                     mask=offs_g < G)


def _tiles(n_keys: int, tile: int) -> int:
    return -(-n_keys // tile)


def _check_tile(tile: int) -> None:
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile_size: the Triton kernels take a power of two ≥ 16, got {tile}")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _split_counts(dtype: torch.dtype, max_count: int) -> bool:
    if dtype == torch.bfloat16:
        return max_count > 256
    if dtype == torch.float16:
        return max_count > 2048
    return False


def santa_flash_triton(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                       write_counts: bool = False, num_warps: int = 8, num_stages: int = 1,
                       out: torch.Tensor | None = None):
    """S²ANTA-flash. Returns ``(out [B, Hq, d] in q's dtype, counts [B, Hq, N] int32 or None)``."""
    _check_tile(tile)
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    t = _tiles(n, tile)
    dev = q.device
    acc = torch.empty(b, hq, t, d, device=dev, dtype=torch.float32)
    m = torch.empty(b, hq, t, device=dev, dtype=torch.float32)
    l = torch.empty(b, hq, t, device=dev, dtype=torch.float32)
    counts = torch.zeros(b, hq, n, device=dev, dtype=torch.int32) if write_counts else acc
    lo, hi = seed_words(seed)
    _flash_tile_kernel[(t, hkv, b)](
        q, k, v, lens, acc, m, l, counts,
        scale, budget, lo, hi, (STREAM_TILE * 0x9E3779B9) & 0xFFFFFFFF, t, hq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        counts.stride(0) if write_counts else 0, counts.stride(1) if write_counts else 0,
        G=g, BLOCK_G=group_block(g), D=d, TILE=tile,
        SPLIT_COUNTS=_split_counts(v.dtype, min(budget, tile * budget)), WRITE_COUNTS=write_counts,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    if out is None:
        out = torch.empty(b, hq, d, device=dev, dtype=q.dtype)
    merge_partials(acc, m, l, lens, tile, out)
    return out, (counts if write_counts else None)


def santa_prop_triton(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                      rounding: str = "largest-remainder", write_counts: bool = False,
                      num_warps: int = 8, num_stages: int = 1, out: torch.Tensor | None = None):
    """S²ANTA-prop. Returns ``(out, counts or None, tile budgets [B, Hq, T] int32)``."""
    _check_tile(tile)
    if rounding not in ("largest-remainder", "systematic"):
        raise ValueError(f"rounding: expected 'largest-remainder' or 'systematic', got {rounding!r}")
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    t = _tiles(n, tile)
    dev = q.device
    m = torch.empty(b, hq, t, device=dev, dtype=torch.float32)
    l = torch.empty(b, hq, t, device=dev, dtype=torch.float32)
    u = torch.empty(b, hq, t * tile, device=dev, dtype=torch.float32)
    precision = _dot_precision(q.dtype)
    block_g = group_block(g)
    _prop_stats_kernel[(t, hkv, b)](
        q, k, lens, m, l, u, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), m.stride(0), m.stride(1),
        u.stride(0), u.stride(1),
        G=g, BLOCK_G=block_g, D=d, TILE=tile, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    acc = torch.empty(b, hq, t, d, device=dev, dtype=torch.float32)
    pm = torch.empty(b, hq, t, device=dev, dtype=torch.float32)
    pl = torch.empty(b, hq, t, device=dev, dtype=torch.float32)
    budgets = torch.empty(b, hq, t, device=dev, dtype=torch.int32)
    counts = torch.zeros(b, hq, n, device=dev, dtype=torch.int32) if write_counts else acc
    lo, hi = seed_words(seed)
    _prop_sample_kernel[(t, hkv, b)](
        v, lens, m, l, u, acc, pm, pl, counts, budgets,
        budget, lo, hi, (STREAM_TILE * 0x9E3779B9) & 0xFFFFFFFF, (STREAM_BUDGET * 0x9E3779B9) & 0xFFFFFFFF,
        t, hq,
        v.stride(0), v.stride(1), v.stride(2), m.stride(0), m.stride(1), u.stride(0), u.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        counts.stride(0) if write_counts else 0, counts.stride(1) if write_counts else 0,
        G=g, BLOCK_G=block_g, D=d, TILE=tile, CHUNK_T=min(128, max(16, next_pow2(t))),
        SYSTEMATIC=rounding == "systematic", SPLIT_COUNTS=_split_counts(v.dtype, budget),
        WRITE_COUNTS=write_counts, DOT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )
    if out is None:
        out = torch.empty(b, hq, d, device=dev, dtype=q.dtype)
    merge_partials(acc, pm, pl, lens, tile, out)
    return out, (counts if write_counts else None), budgets


__all__ = ["santa_flash_triton", "santa_prop_triton", "math"]
