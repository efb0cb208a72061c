"""S²ANTA-prop and S²ANTA-flash in separate passes (v8): the default path below v10's size, and wherever
programmatic dependent launch is off (pre-Hopper GPUs, the interpreter).

- ``_tile_stats_kernel`` streams K in long pipelined loops (about 264 programs, several tiles each) and
  writes the per-tile max m, the sum l of e^{s−m} and the float32 score stash; for flash it also folds
  each head's global max m* into a float32 atomic max.
- prop: ``_prop_budget_kernel``, one program per (head, row), shares the budget over the tiles
  (``common.group_budgets``: largest remainder, its +1s found by a histogram threshold select, or
  systematic rounding).
- ``_compact_sample_kernel``, one program per (tile, KV head, row): systematic sampling from the stash,
  the sampled V rows compacted and gathered into one dot, the merge folded in (``common.sample_fold``).

prop: 3 launches, flash: 2. With programmatic dependent launch (Hopper and newer) the later kernels are
launched while the one before runs and wait on the device (``gdc_wait``). Scratch buffers come from
``triton_utils.workspace``, launches go through ``triton_utils.launch``.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import cdiv, dot_precision, group_block, launch, pdl_launch, seed_words, triton
from .common import (
    BUDGET_KEY,
    SAMPLE_WARPS,
    TILE_KEY,
    begin_call,
    budget_meta,
    sample_constexprs,
    sample_strides,
    tile_count,
)

if triton is not None:
    import triton.language as tl

    from ..shared.triton_utils import gdc_launch_dependents, gdc_wait
    from .common import (
        budget_jit,
        fold_scores,
        group_budgets,
        load_group_q,
        sample_fold,
        score_block,
    )

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
        q, heads, g_ok = load_group_q(q_ptr, b, kvh, s_q_b, s_q_h, G, BLOCK_G, D)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        k_base = k_ptr + b * s_k_b + kvh * s_k_h
        u_base = stash_ptr + b * s_u_b + heads[:, None] * s_u_h
        ml_base = b * s_ml_b + heads * s_ml_h
        m_all = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for j in range(t0 * SUBS, t1 * SUBS):
            s = score_block(q, k_base, u_base, j * BLOCK_N + tl.arange(0, BLOCK_N), length, scale, s_k_n, g_ok, D,
                             DOT_PRECISION)
            first = (j % SUBS) == 0
            m, l = fold_scores(tl.where(first, float("-inf"), m), tl.where(first, 0.0, l), s)
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

    @budget_jit
    def _prop_budget_kernel(
        m_ptr, l_ptr, lens_ptr, budgets_ptr,
        budget, seed_lo, seed_hi, budget_key, n_tiles, hq, s_ml_b, s_ml_h,
        TILE: tl.constexpr, BLOCK_T: tl.constexpr, SYSTEMATIC: tl.constexpr, DIGIT_BITS: tl.constexpr,
        EARLY_EXIT: tl.constexpr, PDL: tl.constexpr,
    ):
        """One program per (head, batch row): ``group_budgets`` of one head."""
        if PDL:  # launched early (programmatic dependent launch): wait for the stats pass, let the next launch
            gdc_wait()
            gdc_launch_dependents()
        h = tl.program_id(0)
        b = tl.program_id(1)
        length = tl.load(lens_ptr + b)
        one = tl.arange(0, 1)
        group_budgets(m_ptr, l_ptr, budgets_ptr, h + one, one < 1, b, length, (length + TILE - 1) // TILE, budget,
                      seed_lo, seed_hi, budget_key, n_tiles, hq, s_ml_b, s_ml_h, BLOCK_T, SYSTEMATIC, DIGIT_BITS,
                      EARLY_EXIT)

    @budget_jit
    def _compact_sample_kernel(
        v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
        oacc_ptr, oden_ptr, done_ptr, out_ptr,
        budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
        s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
        G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        R_MAX: tl.constexpr, FLASH: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr,
    ):
        """Sampling pass with the merge folded in (v8), one program per (tile, KV head, row):
        ``sample_fold``."""
        if PDL:  # launched early (programmatic dependent launch): nothing of the previous kernel is read before
            gdc_wait()
        sample_fold(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
                    oacc_ptr, oden_ptr, done_ptr, out_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                    budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
                    s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
                    G, GP, BLOCK_G, D, TILE, R_MAX, FLASH, SPLIT_AT, DOT_PRECISION, WRITE_COUNTS, FIX_BITS, WIDE, "")


def stats_pass(q, k, lens, buf, scale, tile, *, flash, pdl, block_n, stats_programs, num_warps=4, num_stages=3):
    """The stats pass into ``buf.m``, ``buf.l``, ``buf.stash`` (and, for flash, ``buf.mstar``)."""
    b, hq, d = q.shape
    hkv, t = k.shape[1], tile_count(k.shape[2], tile)
    g = hq // hkv
    per_program = max(1, round(t * hkv * b / stats_programs))
    launch(_tile_stats_kernel, (cdiv(t, per_program), hkv, b),
           q, k, lens, buf.m, buf.l, buf.stash, buf.mstar, scale, per_program, hq,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), hq * t, t, hq * t * tile, t * tile,
           G=g, BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(block_n, tile),
           DOT_PRECISION=dot_precision(q.dtype), TRACK_MAX=flash, PDL=pdl, num_warps=num_warps, num_stages=num_stages)


def _sample_pass(v, lens, buf, budget, tile, seed, b, hq, t, *, flash, write_counts, pdl, r_max):
    """The compacted sampling pass with the merge folded in: writes ``buf.out`` (and ``buf.counts``)."""
    hkv = v.shape[1]
    lo, hi = seed_words(seed)
    launch(_compact_sample_kernel, (t, hkv, b),
           v, lens, buf.m, buf.l, buf.stash, buf.budgets if buf.budgets is not None else buf.m,
           buf.counts if write_counts else buf.m, buf.mstar, buf.scr, buf.oacc, buf.oden, buf.done, buf.out,
           budget, lo, hi, TILE_KEY, t, hq, hkv, *sample_strides(v, buf, hq, t, tile, write_counts),
           **sample_constexprs(v, hq, budget, t, tile, flash=flash, write_counts=write_counts, r_max=r_max),
           PDL=pdl, num_warps=SAMPLE_WARPS, **pdl_launch(pdl))


def _two_pass(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *, flash: bool, rounding: str,
              write_counts: bool, out, block_n: int, stats_programs: int, r_max: int | None, stats_warps: int = 4,
              stats_stages: int = 3):
    b, hq, _ = q.shape
    t, pdl, buf = begin_call(q, k, v, tile, flash=flash, rounding=rounding, write_counts=write_counts, out=out)
    stats_pass(q, k, lens, buf, scale, tile, flash=flash, pdl=pdl, block_n=block_n, stats_programs=stats_programs,
                num_warps=stats_warps, num_stages=stats_stages)
    if flash:
        _sample_pass(v, lens, buf, budget, tile, seed, b, hq, t, flash=True, write_counts=write_counts, pdl=pdl,
                     r_max=r_max)
    else:
        prop_sampling_passes(v, lens, buf, budget, tile, seed, b, hq, t, rounding=rounding,
                             write_counts=write_counts, pdl=pdl, r_max=r_max)
    return buf


def prop_budgets(lens, buf, budget: int, tile: int, seed: int, b: int, hq: int, t: int, *, rounding: str,
                 pdl: bool) -> None:
    """S²ANTA-prop's tile budgets into ``buf.budgets`` from the stats in ``buf.m``, ``buf.l`` (one launch, a
    program per (head, row))."""
    lo, hi = seed_words(seed)
    launch(_prop_budget_kernel, (hq, b),
           buf.m, buf.l, lens, buf.budgets, budget, lo, hi, BUDGET_KEY, t, hq, hq * t, t,
           TILE=tile, **budget_meta(t, rounding=rounding), PDL=pdl, num_warps=4, **pdl_launch(pdl))


def prop_sampling_passes(v, lens, buf, budget: int, tile: int, seed: int, b: int, hq: int, t: int, *,
                         rounding: str, write_counts: bool, pdl: bool, r_max: int | None = None) -> None:
    """S²ANTA-prop after its stats pass: the tile budgets, then the compacted sampling pass with the merge
    folded in, from whatever wrote ``buf.m``, ``buf.l`` and the score stash (the stats pass above, or
    ``kernels/bernoulli/decode.py``'s feature-major one)."""
    prop_budgets(lens, buf, budget, tile, seed, b, hq, t, rounding=rounding, pdl=pdl)
    _sample_pass(v, lens, buf, budget, tile, seed, b, hq, t, flash=False, write_counts=write_counts, pdl=pdl,
                 r_max=r_max)


def santa_prop_two_pass(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                        rounding: str = "largest-remainder", write_counts: bool = False,
                        out: torch.Tensor | None = None, block_n: int = 64, stats_programs: int = 264,
                        r_max: int | None = None, stats_warps: int = 4, stats_stages: int = 3):
    """S²ANTA-prop in 3 launches: stats, tile budgets, sampling with the merge folded in. Returns
    ``(out [B, Hq, d] in q's dtype, counts [B, Hq, N] int32 or None, tile budgets [B, Hq, T] int32)``.
    ``block_n`` (keys per sub-block of the stats loop), ``stats_programs``, ``stats_warps``, ``stats_stages``
    (the stats kernel's warps and pipeline depth) and ``r_max`` (rows per V gather step) are launch
    parameters; they change no count."""
    buf = _two_pass(q, k, v, lens, scale, budget, tile, seed, flash=False, rounding=rounding,
                    write_counts=write_counts, out=out, block_n=block_n, stats_programs=stats_programs, r_max=r_max,
                    stats_warps=stats_warps, stats_stages=stats_stages)
    return buf.out, buf.counts, buf.budgets


def santa_flash_two_pass(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                         write_counts: bool = False, out: torch.Tensor | None = None, block_n: int = 64,
                         stats_programs: int = 264, r_max: int | None = None):
    """S²ANTA-flash in 2 launches: stats (with each head's global max), then ``max(1, S // T_b)`` draws
    per tile with each tile's weighted estimate added to the output by the sampling pass itself. Returns
    ``(out, counts or None)``; launch parameters as for ``santa_prop_two_pass``."""
    buf = _two_pass(q, k, v, lens, scale, budget, tile, seed, flash=True, rounding="largest-remainder",
                    write_counts=write_counts, out=out, block_n=block_n, stats_programs=stats_programs, r_max=r_max)
    return buf.out, buf.counts


__all__ = ["prop_budgets", "prop_sampling_passes", "santa_flash_two_pass", "santa_prop_two_pass", "stats_pass"]
