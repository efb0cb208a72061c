"""Exact per-row top-k spread over several programs per row, in one launch (Quest's pages at long contexts).

:func:`topk_rows_chunked` takes a scoring launch's float32 scores ``[B, Hq, X]``, each batch row's count of
units to take and that launch's per-block softmax partials, and writes what
:func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton` writes: the ``count`` best units of each row
as ``[B, Hs, K]``, ascending, ties at the threshold to the lowest index, zero-padded past the count.

1. ``C`` programs per row (chunks of ``CHUNK`` units) each take their units' values — group-summed rows:
   ``log Σ_g softmax_g(s)`` with each head's log-sum-exp from the partials, written to a workspace row — and
   a ``BINS``-bin histogram of how far each lies below ``top``, an upper bound of the row that every program
   derives from the partials alone (group-summed: ``log Σ_g exp(max_g − lse_g)``; else the row's largest
   score). A value's bin is the top bits of the float32 distance ``top − v``: exponent and ``MANT``
   mantissa bits, so bins are ``2^-MANT`` of an octave wide (finer near the top) and follow the values'
   order (bin 0 holds the largest). Each program writes its histogram (no atomics on bins).
2. The last of the row's programs to finish (a ticket counter, reset by it) sums the ``C`` histograms,
   finds the bin holding the ``count``-th largest value, copies that bin's values out (one pass over the
   row), radix-selects the exact threshold among them, and writes the list (a second pass).

Against ``group_sum_rows_triton`` + ``topk_rows_triton`` (Quest's group-summed pages beyond 4096): one
launch instead of two, and a serial tail of two passes over the row plus a radix select over one bin's
values, instead of a prefilter pass and a radix select over its ≈ 1.2 · count candidates.
"""

from __future__ import annotations

import torch

from .select_common import check_launch_value, check_score_rows, scratch
from .triton_utils import cdiv, launch, next_pow2, pdl_launch, triton, workspace

# about this many programs in all take the chunks (one wave on an H100/H200), chunks of at least CHUNK_MIN units
CHUNKED_PROGRAMS = 128
CHUNK_MIN = 256
# bins of the distance below the row's bound: 2^-MANT of an octave from 2^E_MIN up (254 finite bins: to ~2^10)
BINS, MANT, E_MIN = 256, 4, -6

if triton is not None:
    import triton.language as tl

    from .select_common import emit_selected, group_lse_max, group_sum_tile, ordered, radix_select
    from .triton_utils import dense_range, gdc_launch_dependents, gdc_wait

    @triton.jit
    def bin_below(v, top, BINS: tl.constexpr, MANT: tl.constexpr, E_MIN: tl.constexpr):
        """The bin of each value below the row's bound ``top`` (0: nearest; in the values' order, since the
        float32 bits of a distance ≥ 0 grow with it); −inf values in the last bin, which counts nothing."""
        d = tl.maximum(top - v, 0.0)
        code = (d.to(tl.int32, bitcast=True) >> (23 - MANT)) - ((127 + E_MIN) << MANT)
        return tl.where(v > float("-inf"), tl.minimum(tl.maximum(code, 0), BINS - 2), BINS - 1)

    @triton.jit(do_not_specialize=["sink", "window", "n_units", "n_parts", "k_out", "n_chunks"])
    def _chunked_select_kernel(
        s_ptr, pm_ptr, pl_ptr, cnt_ptr, lens_ptr, gs_ptr, hist_ptr, cv_ptr, tk_ptr, out_ptr,
        sink, window, n_units, n_parts, k_out, n_chunks,
        s_s_b, s_s_h, s_p_b, s_p_h, s_g_b, s_g_h, s_o_b, s_o_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, SHARE: tl.constexpr, UNIT: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_PART: tl.constexpr, BINS: tl.constexpr, MANT: tl.constexpr, E_MIN: tl.constexpr,
        BLOCK_X: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
    ):
        c = tl.program_id(0)
        hs = tl.program_id(1)
        b = tl.program_id(2)
        b64 = b.to(tl.int64)
        if PDL:  # launched early: wait for the scoring launch; the attention may launch now
            gdc_wait()
            gdc_launch_dependents()
        row = b * tl.num_programs(1) + hs
        offs_x = c * CHUNK + tl.arange(0, CHUNK)
        x_ok = offs_x < n_units
        if SHARE:
            length, sink_end, win_start = dense_range(lens_ptr, b, sink, window)
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = hs * G + offs_g
            lse, live_h, m_max = group_lse_max(pm_ptr, pl_ptr, b64 * s_p_b, heads, g_ok, n_parts, s_p_h, BLOCK_G,
                                               BLOCK_PART)
            # log Σ_g softmax_g(s)[x] ≤ log Σ_g exp(max_g − lse_g): one bound for the row, in every program
            u_g = tl.where(live_h, m_max - lse, float("-inf"))
            u_top = tl.max(u_g, axis=0)
            u_ref = tl.where(u_top > float("-inf"), u_top, 0.0)
            top = u_ref + tl.log(tl.sum(tl.where(live_h, tl.exp(u_g - u_ref), 0.0), axis=0))
            src = gs_ptr + b64 * s_g_b + hs * s_g_h
            val = group_sum_tile(s_ptr, b64 * s_s_b, heads, g_ok, lse, live_h, offs_x, x_ok, s_s_h,
                                 sink_end, win_start, UNIT)
            tl.store(src + offs_x, val, mask=x_ok)
        else:
            src = s_ptr + b64 * s_s_b + hs * s_s_h
            m_run = tl.full([BLOCK_PART], float("-inf"), tl.float32)
            for p0 in range(0, n_parts, BLOCK_PART):
                offs_p = p0 + tl.arange(0, BLOCK_PART)
                pm = tl.load(pm_ptr + b64 * s_p_b + hs * s_p_h + offs_p, mask=offs_p < n_parts, other=float("-inf"))
                m_run = tl.maximum(m_run, pm)
            top = tl.max(m_run, axis=0)
            val = tl.load(src + offs_x, mask=x_ok, other=float("-inf"))
        bins = tl.arange(0, BINS)
        hist_row = hist_ptr + row.to(tl.int64) * n_chunks * BINS
        tl.store(hist_row + c * BINS + bins, tl.histogram(bin_below(val, top, BINS, MANT, E_MIN), BINS))
        # all threads' stores precede the release; the acquire of the last one sees them all
        tl.debug_barrier()
        ticket = tl.atomic_add(tk_ptr + row, 1, sem="acq_rel", scope="gpu")
        if ticket == n_chunks - 1:
            tl.atomic_xchg(tk_ptr + row, 0)
            out_row = out_ptr + b64 * s_o_b + hs * s_o_h
            # other programs wrote the histograms and the row: read them through L2 (.cg)
            total = tl.zeros([BINS], tl.int32)
            for cc in range(0, n_chunks):
                total += tl.load(hist_row + cc * BINS + bins, cache_modifier=".cg")
            total = tl.where(bins < BINS - 1, total, 0)
            # at most the row's finite values (the callers' counts are): the list never outgrows them
            count = tl.minimum(tl.load(cnt_ptr + b).to(tl.int32), tl.sum(total, axis=0))
            n_taken = tl.full([], 0, tl.int32)
            if count > 0:
                at = tl.min(tl.where(tl.cumsum(total, axis=0) >= count, bins, BINS), axis=0)
                above = tl.sum(tl.where(bins < at, total, 0), axis=0)
                # the count-th largest is in bin `at`: its values out of the row, then the exact select there
                cv = cv_ptr + row.to(tl.int64) * n_units
                n_cand = tl.full([], 0, tl.int32)
                hi = tl.zeros([BLOCK_X], dtype=tl.uint32)
                lo = tl.full([BLOCK_X], 0xFFFFFFFF, tl.uint32)
                for x0 in range(0, n_units, BLOCK_X):
                    offs = x0 + tl.arange(0, BLOCK_X)
                    ok = offs < n_units
                    v = tl.load(src + offs, mask=ok, other=float("-inf"), cache_modifier=".cg")
                    keep = ok & (bin_below(v, top, BINS, MANT, E_MIN) == at)
                    tl.store(cv + n_cand + tl.cumsum(keep.to(tl.int32), axis=0) - 1, v, mask=keep)
                    n_cand += tl.sum(keep.to(tl.int32), axis=0)
                    u = ordered(v)
                    hi = tl.maximum(hi, tl.where(keep, u, 0))
                    lo = tl.minimum(lo, tl.where(keep, u, 0xFFFFFFFF))
                tl.debug_barrier()  # the bin's values written above are read back by other threads
                thr, need = radix_select(cv, n_cand, count - above, tl.max(hi, axis=0), tl.min(lo, axis=0), 32,
                                         BLOCK_C)
                # every value of the bins above `at` exceeds thr, every one below is under it
                n_taken = emit_selected(src, src, n_units, thr, need, out_row, False, BLOCK_X, True)
            for x0 in range(n_taken, k_out, BLOCK_X):  # the unused tail: defined values, never read
                offs = x0 + tl.arange(0, BLOCK_X)
                tl.store(out_row + offs, tl.zeros([BLOCK_X], tl.int64), mask=offs < k_out)


def topk_rows_chunked(scores: torch.Tensor, counts: torch.Tensor, k: int, *, parts: tuple[torch.Tensor, torch.Tensor],
                      group: int = 1, lengths: torch.Tensor | None = None, unit: int = 1, sink: int = 0,
                      window: int = 0, out: torch.Tensor | None = None, programs: int | None = None,
                      num_warps: int | None = None, pdl: bool = False) -> torch.Tensor:
    """The ``counts[b]`` best units of each row as ``[B, Hs, k]`` int64, ascending, zero-padded, ties to the
    lowest index — :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton`'s output, in one launch of
    several programs per row (module docstring).

    ``scores [B, Hq, X]`` float32 with a contiguous last dim; ``counts [B]`` with every ``counts[b] ≤ min(k,
    X)`` and at most the row's finite scores; ``parts = (max, sum_exp) [B, Hq, n_blocks]``, the scoring
    launch's per-block softmax partials (their maxima bound each row). ``group = 1``: rows are ``scores``'
    rows (non-candidates already −inf). ``group > 1``: rows are KV heads ranked by ``log Σ_g softmax_g(s)``
    over their ``group`` query heads (``scores`` −inf only past each row's length, ``lengths`` int32 ``[B]``;
    units without a key in ``[sink_end, window_start)``, ``unit`` keys each, are never chosen).

    Launch overrides (None: the defaults): ``programs`` (default ``CHUNKED_PROGRAMS``): about this many
    programs in all, in chunks of a power of two of at least ``CHUNK_MIN`` units; ``num_warps`` (a power of two
    up to 32; default 8 for rows of 2048 units or more, else 4). ``pdl``: launched with programmatic dependent
    launch (its programs wait on the device for the scoring launch; see ``triton_utils.pdl_available``).
    The selection does not depend on them."""
    b, hq, x = scores.shape
    programs = CHUNKED_PROGRAMS if programs is None else check_launch_value("programs", programs)
    num_warps = (8 if x >= 2048 else 4) if num_warps is None else check_launch_value("num_warps", num_warps,
                                                                                       high=32, pow2=True)
    check_score_rows(scores, group)
    pm, pl = parts
    if pm.shape != pl.shape or pm.shape[:2] != (b, hq) or pm.dtype != torch.float32 or pm.stride(-1) != 1:
        raise ValueError(f"parts: expected two float32 [{b}, {hq}, n_blocks] tensors with a contiguous last dim, "
                         f"got {pm.dtype} {tuple(pm.shape)}, {pl.dtype} {tuple(pl.shape)}")
    if group > 1 and lengths is None:
        raise ValueError("lengths: required when group > 1 (the group-summed ranking)")
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    hs = hq // group
    if out is None:
        out = torch.empty(b, hs, k, device=scores.device, dtype=torch.int64)
    share = group > 1
    per_row = max(1, programs // (b * hs))
    chunk = max(CHUNK_MIN, next_pow2(cdiv(x, per_row)))
    n_chunks = cdiv(x, chunk)
    gs = scratch("chunked_gs", scores, (b, hs, x), torch.float32) if share else scores
    hist = workspace("chunked_hist", scores, b * hs * n_chunks * BINS, torch.int32)
    cv = workspace("chunked_cv", scores, b * hs * x, torch.float32)
    tickets = workspace("chunked_tickets", scores, b * hs, torch.int32, zeroed=True)
    block_g = max(2, next_pow2(group))
    block_x = min(2048, max(64, next_pow2(x)))
    launch(_chunked_select_kernel, (n_chunks, hs, b),
           scores, pm, pl, counts, counts if lengths is None else lengths, gs, hist, cv, tickets, out,
           sink, window, x, pm.shape[-1], k, n_chunks,
           scores.stride(0), scores.stride(1), pm.stride(0), pm.stride(1), gs.stride(0), gs.stride(1),
           out.stride(0), out.stride(1),
           G=group, BLOCK_G=block_g, SHARE=share, UNIT=unit, CHUNK=chunk, BLOCK_PART=max(64, 2048 // block_g),
           BINS=BINS, MANT=MANT, E_MIN=E_MIN, BLOCK_X=block_x, BLOCK_C=min(block_x, 256), PDL=pdl,
           num_warps=num_warps, num_stages=1, **pdl_launch(pdl))
    return out


__all__ = ["CHUNKED_PROGRAMS", "CHUNK_MIN", "topk_rows_chunked"]
