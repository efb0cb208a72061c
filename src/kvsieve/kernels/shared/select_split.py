"""Exact per-row top-k spread over many programs per row, for few rows of many units (Quest's pages at
batch 1 or under tensor parallelism: 2–8 rows of 8192 pages, where one program per row leaves most SMs
idle).

:func:`topk_rows_split` writes what :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton` writes
(the ``counts[b]`` best units of each row, ascending, ties at the threshold to the lowest index, zeros
after) in two launches of ``P`` programs per row, each program taking one chunk of ``C`` units:

1. histogram launch: every program derives the row's range from the scoring launch's maxima (the row's
   max, and the prefilter's lower bound — the ``count``-th largest maximum with its top 6 varying bits
   resolved, as ``topk_rows_triton`` takes it — so the answer ``T`` lies in ``[bound, max]``); then in
   its chunk it keeps the candidates (finite, at or above the bound), writes them compacted (value,
   index; index order) to its own slot, their number, and a 256-bin histogram of the 8 bits below the
   bits that ``bound`` and ``max`` share — into ``[rows, P, 256]`` at its own place (no atomics: many
   programs' atomics on one counter serialise);
2. select launch: every program sums its row's ``P`` histograms (the same sums in every program), takes
   the bin holding the ``count``-th largest candidate, then refines ``T`` exactly with 64-bin radix
   passes over the candidates of that bin only (read from all slots; stops once the bin is taken whole).
   Its place in the output is the number of candidates above ``T`` in the slots before its own plus the
   ties there (capped at the ties needed); it writes its own selected candidates from there.

Every program repeats the row-wide steps (maxima, histogram sums, refine) so no program waits on
another within a launch; those steps read the maxima (``X / 8`` values), ``P × 256`` counts and the
candidates (about ``1.2 × count`` for i.i.d. scores; the whole row in the worst case, still exact), not
the row. The result does not depend on ``P`` (tested).
"""

from __future__ import annotations

import torch

from .select_common import GROUP_MAX, check_launch_value, check_score_rows, scratch, sm_count
from .triton_utils import cdiv, launch, next_pow2, triton

SPLIT_DIGIT_BITS = 8  # first-level histogram: 256 bins per program
SPLIT_CHUNK_MIN = 64  # units per program, at least
SPLIT_CHUNK_MAX = 4096  # ... and at most (one register tile per program)
SPLIT_SLAB = 2048  # candidates per tile when a program reads all slots of its row
SPLIT_HIST_TILE = 8192  # counts per tile when a program sums its row's histograms (2 tiles at 64 programs)
# warps of the histogram launch (the select launch keeps 4): Quest's call at 128k batch 1 64.5 → 63.2 µs on an H200
# (benchmarks/breakdown/launch_sweep.py --in-call; 8 warps made the select launch slower)
HIST_WARPS = 8


if triton is not None:
    import triton.language as tl

    from .select_common import bit_length, ordered, radix_select, take_bin, value_range

    @triton.jit
    def _split_program(cnt_ptr):
        # (program in the row, selection head, batch row, batch row as int64, the row's number, its count)
        b = tl.program_id(2)
        b64 = b.to(tl.int64)
        hs = tl.program_id(1)
        return tl.program_id(0), hs, b, b64, b64 * tl.num_programs(1) + hs, tl.load(cnt_ptr + b).to(tl.int32)

    @triton.jit(do_not_specialize=["n_units", "n_max"])
    def _split_hist_kernel(
        s_ptr, mx_ptr, cnt_ptr, hist_ptr, meta_ptr, cv_ptr, ci_ptr, nc_ptr,
        n_units, n_max, s_s_b, s_s_h, s_x_b, s_x_h,
        CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, DIGIT_BITS: tl.constexpr,
    ):
        BINS: tl.constexpr = 1 << DIGIT_BITS
        p, hs, b, b64, r, count = _split_program(cnt_ptr)
        n_p = tl.num_programs(0)
        if count > 0:  # an empty row's buffers are never read
            mx_row = mx_ptr + b64 * s_x_b + hs * s_x_h
            m_hi, m_lo, m_fin = value_range(mx_row, n_max, BLOCK_M)
            bound = tl.zeros([], dtype=tl.uint32)
            m_need = tl.full([], 0, tl.int32)  # unused; assigned in both branches for the compiler
            if count <= m_fin:  # else every finite unit is a candidate
                bound, m_need = radix_select(mx_row, n_max, count, m_hi, m_lo, 6, BLOCK_M)
            offs = p * CHUNK + tl.arange(0, CHUNK)
            ok = offs < n_units
            v = tl.load(s_ptr + b64 * s_s_b + hs * s_s_h + offs, mask=ok, other=float("-inf"))
            u = ordered(v)
            cand = ok & (v > float("-inf")) & (u >= bound)
            # candidates lie in [bound, m_hi]: they share the bits above `top`, so 8 bits from `shift`
            # order them (below 8 varying bits the low byte does, the shared bits above it constant)
            shift = tl.maximum(bit_length(bound ^ m_hi) - DIGIT_BITS, 0).to(tl.uint32)
            digit = tl.where(cand, (u >> shift) & (BINS - 1), 0).to(tl.int32)
            n_cand = tl.sum(cand.to(tl.int32), axis=0)
            bins = tl.arange(0, BINS)
            hist = tl.histogram(digit, BINS)
            hist -= tl.where(bins == 0, CHUNK - n_cand, 0)  # the others were counted in bin 0
            tl.store(hist_ptr + (r * n_p + p) * BINS + bins, hist)
            slot = r * n_p * CHUNK + p * CHUNK
            pos = tl.cumsum(cand.to(tl.int32), axis=0) - 1
            tl.store(cv_ptr + slot + pos, v, mask=cand)
            tl.store(ci_ptr + slot + pos, offs, mask=cand)
            tl.store(nc_ptr + r * n_p + p, n_cand)
            if p == 0:
                tl.store(meta_ptr + r * 2, bound.to(tl.int32, bitcast=True))
                tl.store(meta_ptr + r * 2 + 1, m_hi.to(tl.int32, bitcast=True))

    @triton.jit
    def _slab_tile(cv_row, nc, offs_p, c0, CHUNK: tl.constexpr, CB: tl.constexpr):
        # columns [c0, c0 + CB) of every slot of the row: the candidates' ordered images and which exist
        offs_c = c0 + tl.arange(0, CB)
        ok = offs_c[None, :] < nc[:, None]
        v = tl.load(cv_row + offs_p[:, None] * CHUNK + offs_c[None, :], mask=ok, other=float("-inf"))
        return ordered(v), ok

    @triton.jit(do_not_specialize=["k_out"])
    def _split_select_kernel(
        cnt_ptr, hist_ptr, meta_ptr, cv_ptr, ci_ptr, nc_ptr, out_ptr,
        k_out, s_o_b, s_o_h,
        CHUNK: tl.constexpr, DIGIT_BITS: tl.constexpr, BLOCK_P: tl.constexpr, CB: tl.constexpr, HB: tl.constexpr,
    ):
        BINS: tl.constexpr = 1 << DIGIT_BITS
        p, hs, b, b64, r, count = _split_program(cnt_ptr)
        n_p = tl.num_programs(0)
        out_row = out_ptr + b64 * s_o_b + hs * s_o_h
        if count > 0:
            bound = tl.load(meta_ptr + r * 2).to(tl.uint32, bitcast=True)
            m_hi = tl.load(meta_ptr + r * 2 + 1).to(tl.uint32, bitcast=True)
            shift = tl.maximum(bit_length(bound ^ m_hi) - DIGIT_BITS, 0)
            # the row's histogram: the sum of its programs', in the same order in every program
            bins = tl.arange(0, BINS)
            row_h = tl.zeros([BINS], dtype=tl.int32)
            for q0 in range(0, n_p, HB):
                offs_q = q0 + tl.arange(0, HB)
                h = tl.load(hist_ptr + (r * n_p + offs_q[:, None]) * BINS + bins[None, :],
                            mask=(offs_q < n_p)[:, None], other=0)
                row_h += tl.sum(h, axis=0)
            # the bin's low end: the shared high bits of m_hi, the bin's digit at `shift`, zeros below
            base = ((m_hi >> shift.to(tl.uint32)) >> DIGIT_BITS) << DIGIT_BITS
            prefix, need, in_bin = take_bin(row_h, bins, count, base << shift.to(tl.uint32), shift)
            cv_row = cv_ptr + r * n_p * CHUNK
            offs_p = tl.arange(0, BLOCK_P)
            nc = tl.load(nc_ptr + r * n_p + offs_p, mask=offs_p < n_p, other=0)
            max_nc = tl.max(nc, axis=0)
            # refine below `shift` among the bin's candidates; done once the bin is taken whole
            sh = tl.where(in_bin == need, 0, shift)
            rbins = tl.arange(0, 64)
            while sh > 0:
                low = tl.maximum(sh - 6, 0)
                width = sh - low
                hist = tl.zeros([64], dtype=tl.int32)
                n_act = tl.full([], 0, tl.int32)
                n_all = tl.full([], 0, tl.int32)
                for c0 in range(0, max_nc, CB):
                    u, ok = _slab_tile(cv_row, nc, offs_p, c0, CHUNK, CB)
                    active = ok & ((u >> sh.to(tl.uint32)) == (prefix >> sh.to(tl.uint32)))
                    dg = tl.where(active, (u >> low.to(tl.uint32)) & ((1 << width) - 1).to(tl.uint32), 0)
                    hist += tl.histogram(tl.reshape(dg.to(tl.int32), [BLOCK_P * CB]), 64)
                    n_act += tl.sum(tl.sum(active.to(tl.int32), axis=1), axis=0)
                    n_all += BLOCK_P * CB
                hist -= tl.where(rbins == 0, n_all - n_act, 0)
                prefix, need, in_bin = take_bin(hist, rbins, need, prefix, low)
                sh = tl.where(in_bin == need, 0, low)
            # T = prefix; this program's place: the candidates above T and the ties (up to need) before it
            n_gt = tl.full([], 0, tl.int32)
            n_eq = tl.full([], 0, tl.int32)
            before = offs_p < p
            for c0 in range(0, max_nc, CB):
                u, ok = _slab_tile(cv_row, nc, offs_p, c0, CHUNK, CB)
                ok = ok & before[:, None]
                n_gt += tl.sum(tl.sum((ok & (u > prefix)).to(tl.int32), axis=1), axis=0)
                n_eq += tl.sum(tl.sum((ok & (u == prefix)).to(tl.int32), axis=1), axis=0)
            offs = tl.arange(0, CHUNK)
            ok = offs < tl.load(nc_ptr + r * n_p + p)
            slot = r * n_p * CHUNK + p * CHUNK
            u = ordered(tl.load(cv_ptr + slot + offs, mask=ok, other=float("-inf")))
            eq = (ok & (u == prefix)).to(tl.int32)
            sel = (ok & (u > prefix)) | ((eq != 0) & (n_eq + tl.cumsum(eq, axis=0) <= need))
            pos = n_gt + tl.minimum(n_eq, need) + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            idx = tl.load(ci_ptr + slot + offs, mask=sel, other=0)
            tl.store(out_row + pos, idx.to(tl.int64), mask=sel)
        if p == n_p - 1:  # the unused tail (every row takes exactly `count`): defined values, never read
            for x0 in range(tl.maximum(count, 0), k_out, CHUNK):
                at = x0 + tl.arange(0, CHUNK)
                tl.store(out_row + at, tl.zeros([CHUNK], tl.int64), mask=at < k_out)


def split_chunk(rows: int, x: int, device, programs: int | None = None) -> int:
    """Units per program for :func:`topk_rows_split`: a power of two in ``[SPLIT_CHUNK_MIN,
    SPLIT_CHUNK_MAX]`` giving about ``programs`` programs in all (default: the SM count), so that few
    rows still fill the GPU."""
    total = sm_count(device) if programs is None else check_launch_value("programs", programs)
    per_row = max(1, cdiv(total, max(rows, 1)))
    return min(SPLIT_CHUNK_MAX, max(SPLIT_CHUNK_MIN, next_pow2(cdiv(x, per_row))))


def row_maxima(scores: torch.Tensor) -> torch.Tensor:
    """``[B, H, ceil(X / GROUP_MAX)]``: the max of every ``GROUP_MAX`` units of each row (what the scoring
    launches write with ``maxima=``), in torch."""
    b, h, x = scores.shape
    padded = torch.nn.functional.pad(scores, (0, -x % GROUP_MAX), value=float("-inf"))
    return padded.view(b, h, -1, GROUP_MAX).amax(-1)


def topk_rows_split(scores: torch.Tensor, counts: torch.Tensor, k: int, *, maxima: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, programs: int | None = None,
                    num_warps: int | None = None, digit_bits: int | None = None) -> torch.Tensor:
    """:func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton` for rows already ranked (``group = 1``)
    in two launches spread over each row: ``[B, H, k]`` int64, the ``counts[b]`` best units of each row
    ascending (ties at the threshold to the lowest index), then zeros. ``scores [B, H, X]`` float32 with a
    contiguous last dim; ``counts [B]`` with every ``counts[b] ≤ min(k, X)`` and at most the row's finite
    scores. ``maxima [B, H, ceil(X / GROUP_MAX)]``: the max of every ``GROUP_MAX`` units (the scoring
    launch writes them; None: computed here in torch, a few launches more).

    Launch overrides (for tuning; None: the defaults): ``programs`` — about this many programs in all
    (default: the SM count), as chunks of a power of two of units (:func:`split_chunk`); ``num_warps``
    (a power of two up to 32, both launches; default :data:`HIST_WARPS` for the first, 4 for the second);
    ``digit_bits`` (4 to 10; default ``SPLIT_DIGIT_BITS``): the first histogram's bins, ``2 ** digit_bits`` per
    program (fewer: less to sum in the second launch, more candidates to refine).
    The selection does not depend on them."""
    b, h, x = scores.shape
    check_score_rows(scores, 1)
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    n_max = cdiv(x, GROUP_MAX)
    if maxima is None:
        maxima = row_maxima(scores)
    if maxima.shape != (b, h, n_max) or maxima.stride(-1) != 1 or maxima.dtype != torch.float32:
        raise ValueError(f"maxima: expected float32 [{b}, {h}, {n_max}] with a contiguous last dim, "
                         f"got {maxima.dtype} {tuple(maxima.shape)}")
    warps = 4 if num_warps is None else check_launch_value("num_warps", num_warps, high=32, pow2=True)
    bits = SPLIT_DIGIT_BITS if digit_bits is None else check_launch_value("digit_bits", digit_bits, low=4, high=10)
    if out is None:
        out = torch.empty(b, h, k, device=scores.device, dtype=torch.int64)
    chunk = split_chunk(b * h, x, scores.device, programs)
    n_p = cdiv(x, chunk)
    rows = b * h
    hist = scratch("split_hist", scores, (rows, n_p, 1 << bits), torch.int32)
    meta = scratch("split_meta", scores, (rows, 2), torch.int32)
    cv = scratch("split_cv", scores, (rows, n_p * chunk), torch.float32)
    ci = scratch("split_ci", scores, (rows, n_p * chunk), torch.int32)
    nc = scratch("split_nc", scores, (rows, n_p), torch.int32)
    launch(_split_hist_kernel, (n_p, h, b),
           scores, maxima, counts, hist, meta, cv, ci, nc, x, n_max,
           scores.stride(0), scores.stride(1), maxima.stride(0), maxima.stride(1),
           CHUNK=chunk, BLOCK_M=min(4096, max(64, next_pow2(n_max))), DIGIT_BITS=bits,
           num_warps=HIST_WARPS if num_warps is None else warps, num_stages=1)
    block_p = next_pow2(n_p)
    launch(_split_select_kernel, (n_p, h, b),
           counts, hist, meta, cv, ci, nc, out, k, out.stride(0), out.stride(1),
           CHUNK=chunk, DIGIT_BITS=bits, BLOCK_P=block_p, CB=max(1, min(chunk, SPLIT_SLAB // block_p)),
           HB=max(1, min(block_p, SPLIT_HIST_TILE >> bits)), num_warps=warps, num_stages=1)
    return out


__all__ = ["SPLIT_DIGIT_BITS", "SPLIT_CHUNK_MAX", "SPLIT_CHUNK_MIN", "row_maxima", "split_chunk", "topk_rows_split"]
