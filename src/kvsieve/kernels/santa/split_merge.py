"""S²ANTA-prop as v8 with the merge in a launch of its own (4 launches: stats, budgets, sampling, merge).

v8's sampling programs fold the merge in: each ends with an acq_rel add on its (row, KV head)'s counter, and
the last one writes the output. At batch 1 with long rows that is thousands of programs on a few counters, and
such atomics on one address serialise: the sparse gather kernel with the same folded merge took 55.9 µs at
128k batch 1 against 29.6 µs with a merge launch, about equal at 32k batch 8
(``benchmarks/sparse_decode/tune_gather.py``, H200). Here the sampling programs only add their tile's
``Σ c V`` to the accumulators (relaxed atomics), and one small launch per (head, row), started early with
programmatic dependent launch, writes ``out = oacc / S`` and leaves the accumulators at zero for the next
call. Stats pass, budgets, counts and sums are v8's (``two_pass.py``) for the same seed.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import launch, pdl_launch, seed_words, triton
from .common import SAMPLE_WARPS, TILE_KEY, begin_call, sample_constexprs, sample_strides
from .two_pass import prop_budgets, stats_pass

if triton is not None:
    import triton.language as tl

    from ..shared.triton_utils import gdc_launch_dependents, gdc_wait
    from .common import budget_jit, sample_tile

    @budget_jit
    def _prop_sample_kernel(
        v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, scr_ptr, oacc_ptr,
        budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
        s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
        G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        R_MAX: tl.constexpr, FLASH: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr, PDL: tl.constexpr,
    ):
        """One program per (tile, KV head, row): ``sample_tile`` (prop; ``FLASH`` is False), no merge."""
        if PDL:  # launched early: wait for the budgets, then let the merge launch (it waits for this grid)
            gdc_wait()
            gdc_launch_dependents()
        sample_tile(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, m_ptr, scr_ptr,
                    oacc_ptr, oacc_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                    budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
                    s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h,
                    G, GP, BLOCK_G, D, TILE, R_MAX, FLASH, SPLIT_AT, DOT_PRECISION, WRITE_COUNTS, FIX_BITS, WIDE, "")

    @budget_jit
    def _prop_merge_kernel(oacc_ptr, out_ptr, budget, hq, s_o_b, s_o_h, D: tl.constexpr, PDL: tl.constexpr):
        """One program per (head, row): ``out = oacc / S`` in out's dtype, the accumulator row back to zero."""
        if PDL:  # launched early: nothing of the sampling grid is read before it is done
            gdc_wait()
        h = tl.program_id(0)
        b = tl.program_id(1)
        offs_d = tl.arange(0, D)
        row = oacc_ptr + (b * hq + h) * D + offs_d
        total = tl.load(row, cache_modifier=".cg")  # written by other programs' atomics (L2)
        tl.store(row, tl.zeros([D], tl.float32))
        tl.store(out_ptr + b * s_o_b + h * s_o_h + offs_d, (total / budget).to(out_ptr.dtype.element_ty))


# the launch defaults: the wide stats launch of v8 (decode.PROP_WIDE_STATS)
def santa_prop_split(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                     rounding: str = "largest-remainder", write_counts: bool = False,
                     out: torch.Tensor | None = None, block_n: int = 128, stats_programs: int = 528,
                     r_max: int | None = None, stats_warps: int = 4, stats_stages: int = 2):
    """S²ANTA-prop in 4 launches: v8's stats pass and tile budgets, the sampling pass without the folded merge,
    the merge. Returns ``(out [B, Hq, d] in q's dtype, counts [B, Hq, N] int32 or None, tile budgets [B, Hq, T]
    int32)``, those of ``two_pass.santa_prop_two_pass`` for the same seed; ``block_n``, ``stats_programs``,
    ``stats_warps``, ``stats_stages`` and ``r_max`` are launch parameters, they change no count."""
    b, hq, d = q.shape
    t, pdl, buf = begin_call(q, k, v, tile, flash=False, rounding=rounding, write_counts=write_counts, out=out)
    stats_pass(q, k, lens, buf, scale, tile, flash=False, pdl=pdl, block_n=block_n, stats_programs=stats_programs,
               num_warps=stats_warps, num_stages=stats_stages)
    prop_budgets(lens, buf, budget, tile, seed, b, hq, t, rounding=rounding, pdl=pdl)
    lo, hi = seed_words(seed)
    launch(_prop_sample_kernel, (t, v.shape[1], b),
           v, lens, buf.m, buf.l, buf.stash, buf.budgets, buf.counts if write_counts else buf.m, buf.scr, buf.oacc,
           budget, lo, hi, TILE_KEY, t, hq, v.shape[1], *sample_strides(v, buf, hq, t, tile, write_counts),
           **sample_constexprs(v, hq, budget, t, tile, flash=False, write_counts=write_counts, r_max=r_max),
           PDL=pdl, num_warps=SAMPLE_WARPS, **pdl_launch(pdl))
    launch(_prop_merge_kernel, (hq, b, 1), buf.oacc, buf.out, budget, hq, buf.out.stride(0), buf.out.stride(1),
           D=d, PDL=pdl, num_warps=1, **pdl_launch(pdl))
    return buf.out, buf.counts, buf.budgets


__all__ = ["santa_prop_split"]
