"""Exact per-row top-k by a radix select spread over the whole GPU, for long rows (oracle-topk's and
vAttention's per-query-head rows of 32k–128k keys, where one program per row, or every program of a row
re-reading the row's candidates, leaves the select far from the bandwidth of the logits).

:func:`topk_rows_radix` writes what :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton` writes (the
``counts[b]`` largest units of each row in ascending unit order, ties at the threshold to the lowest index,
zeros after) in ``D + 2`` launches, each of ``P`` programs per row taking one chunk of ``C`` units (but the
placing one: one program per row), on the order-preserving 32-bit image ``u`` of the float scores
(:func:`~kvsieve.kernels.shared.select_common.ordered`) in ``D`` digits from the top (``RADIX_BITS`` = 6: five
digits of 64 bins, then one of 2 bits):

1. histogram launches, one per digit: each program replays the row's earlier histograms (64 counts per
   digit, from L2) to the prefix of the ``count``-th largest found so far, then adds the histogram of the
   next digit of its chunk's values with that prefix into the row's histogram (global atomics: ``P`` adds
   per bin), and keeps it in a slot of its own with how many of its values lie above the prefix. Once the
   bin holding the answer is taken whole (its count is what is still needed: for logits, typically after
   the fourth 6-bit digit), later launches skip the row without reading it;
2. one program per row: the threshold ``T`` (exact after the last digit, else the low end of the bin taken
   whole) and how many values equal to it are needed; from the slots of the digit that resolved the row,
   per program, how many values above ``T`` and equal to it it holds, so its place in the output (the
   selected of the programs before it) and the ties it takes (lowest index first); zeroes the row's
   histograms for the next call;
3. compaction: each program writes its values above ``T`` and its ties from its place.

Every launch reads the row once at most (the first from HBM, the rest mostly from L2 when the logits fit
there: 16 MB for 32 rows of 128k keys), no program reads more of the row than its chunk, and the row-wide
steps read one histogram per digit (the placing launch: ``P`` of them). Shapes are static and nothing is read on
the host (CUDA-graph capturable); the histograms' workspace is zero when allocated and left zero by the
placing launch (calls on one device must not overlap in time, as for every cached workspace). The result
does not depend on ``C``, the digit width or the histogram's form (tested). For the bench's peaked logits at
128k keys (32 rows, k = 3276) the first 6-bit digit leaves ~22% of a row, the second ~1%, the third ~0.02%,
the fourth or fifth resolves (8-bit digits: ~22%, ~0.07%, resolved by the third or fourth).
"""

from __future__ import annotations

import inspect

import torch

from .select_common import check_launch_value, check_score_rows, scratch, sm_count
from .triton_utils import (
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

# Digit width: six passes over the 32-bit keys (the last one of 2 bits), 64 bins each. Where Triton lowers a
# histogram to warp ballots (releases up to early 2026, by their source) it costs a ballot per bin bit and
# element plus bins/32 popcounts (~3 warp instructions per element at 256 bins, ~1 at 64: the first pass over
# 32 × 128k logits ~11 vs ~4 µs of an H200's issue slots); where it lowers it to a shared-memory atomic per
# counted element (Triton 3.9 here), 256 bins need fewer passes. The bench times both (radix, radix-b8).
RADIX_BITS = 6
RADIX_PROGRAMS_PER_SM = 8  # the default chunk gives about this many programs per SM in all
RADIX_CHUNK_MIN = 1024  # default chunks: at least this many units per program ...
RADIX_CHUNK_MAX = 16384  # ... and at most this many
RADIX_BLOCK = 4096  # units a program holds at once (its chunk in tiles of this) ...
RADIX_SPARSE_BLOCK = 1024  # ... after the first digit: tiles with no value on the prefix skip the histogram
RADIX_EMIT_BLOCK = 2048  # ... in the compaction (its two cumulative sums: 64 registers a thread, not 80)
RADIX_TILE_P = 32  # programs' slots per tile in the placing launch
RADIX_PDL = False  # programmatic dependent launch between the select's launches (timed as radix-pdl)

# Histograms skip the values off the prefix through tl.histogram's mask where this Triton has one (else they
# count them in bin 0 and take them out after).
RADIX_HIST_MASK = False

if triton is not None:
    import triton.language as tl

    from .select_common import digit_step, high_bits, ordered, replay_digits, take_bin

    RADIX_HIST_MASK = "mask" in inspect.signature(tl.histogram).parameters

    @triton.jit
    def _radix_program(cnt_ptr):
        # (program in the row, selection head, batch row as int64, the row's number, the row's count)
        b = tl.program_id(2)
        hs = tl.program_id(1)
        b64 = b.to(tl.int64)
        return tl.program_id(0), hs, b64, b64 * tl.num_programs(1) + hs, tl.load(cnt_ptr + b).to(tl.int32)

    @triton.jit(do_not_specialize=["n_units", "chunk"])
    def _radix_hist_kernel(
        s_ptr, cnt_ptr, h_ptr, st_ptr, slot_ptr, above_ptr, n_units, chunk, s_s_b, s_s_h,
        PASS: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr, PDL: tl.constexpr,
    ):
        # Digit PASS (from the top; the last one the bits left, BITS or fewer) of the values of this program's
        # chunk that carry the prefix found so far: added into the row's histogram, and kept in this program's
        # slot with how many of its values lie above the prefix (the placing launch counts from the slots of
        # the digit that resolved the row). A row resolved by an earlier digit is skipped. The search's state
        # before the digit: replayed from the row's histograms up to the second digit, later from the state
        # the previous launch's first program kept and one more histogram. MASKED: the histogram skips the
        # values off the prefix (with Triton's shared-memory atomics, no pile-up in bin 0 when nearly all of
        # them are off).
        PASSES: tl.constexpr = (32 + BITS - 1) // BITS
        BINS: tl.constexpr = 1 << BITS
        if PDL:  # launched while the previous kernel ends: everything below reads what it wrote
            gdc_wait()
            gdc_launch_dependents()
        p, hs, b64, r, count = _radix_program(cnt_ptr)
        if count > 0:  # an empty row's buffers are never read
            h_row = h_ptr + r * (PASSES * BINS)
            st_row = st_ptr + r * (PASSES * 4)
            if PASS < 2:
                prefix, need, shift = replay_digits(h_row, count, PASS, BITS)
            else:
                st = st_row + (PASS - 2) * 4
                prefix, need, shift = digit_step(h_row, PASS - 1, tl.load(st).to(tl.uint32, bitcast=True),
                                                 tl.load(st + 1), tl.load(st + 2), BITS)
            if (PASS > 0) & (PASS < PASSES - 1):
                if p == 0:  # the state before this digit, for the next launch
                    st = st_row + (PASS - 1) * 4
                    tl.store(st, prefix.to(tl.int32, bitcast=True))
                    tl.store(st + 1, need)
                    tl.store(st + 2, shift)
            if shift == 32 - PASS * BITS:  # not resolved yet
                src = s_ptr + b64 * s_s_b + hs * s_s_h
                bins = tl.arange(0, BINS)
                x_lo = p * chunk
                x_hi = tl.minimum(n_units, x_lo + chunk)
                low = tl.maximum(shift - BITS, 0)
                width_mask = ((1 << (shift - low)) - 1).to(tl.uint32)
                low = low.to(tl.uint32)
                hist = tl.zeros([BINS], dtype=tl.int32)
                n_off = tl.zeros([BLOCK], dtype=tl.int32)
                n_above = tl.zeros([BLOCK], dtype=tl.int32)
                for x0 in range(x_lo, x_hi, BLOCK):
                    offs = x0 + tl.arange(0, BLOCK)
                    ok = offs < x_hi
                    u = ordered(tl.load(src + offs, mask=ok, other=float("-inf")))
                    top = high_bits(u, shift)
                    active = ok & (top == high_bits(prefix, shift))
                    digit = tl.where(active, (u >> low) & width_mask, 0).to(tl.int32)
                    n_act = BLOCK  # the first digit counts every value
                    if PASS > 0:  # later ones few: a tile without any skips the histogram
                        n_act = tl.sum(active.to(tl.int32), axis=0)
                    if n_act > 0:
                        if MASKED:
                            hist += tl.histogram(digit, BINS, mask=active)
                        else:
                            hist += tl.histogram(digit, BINS)
                            n_off += (~active).to(tl.int32)
                    n_above += (ok & (top > high_bits(prefix, shift))).to(tl.int32)
                # unmasked, values off the prefix were counted in bin 0: take them out
                hist -= tl.where(bins == 0, tl.sum(n_off, axis=0), 0)
                tl.atomic_add(h_row + PASS * BINS + bins, hist, mask=hist != 0, sem="relaxed")
                at = (r * PASSES + PASS) * tl.num_programs(0) + p
                tl.store(slot_ptr + at * BINS + bins, hist)
                tl.store(above_ptr + at, tl.sum(n_above, axis=0))

    @triton.jit(do_not_specialize=["n_p"])
    def _radix_place_kernel(
        cnt_ptr, h_ptr, slot_ptr, above_ptr, meta_ptr, base_ptr, allow_ptr, n_p,
        BITS: tl.constexpr, TILE_P: tl.constexpr, PDL: tl.constexpr,
    ):
        # One program per row: the threshold, and each program's place in the output and ties to take, from
        # the slots of the digit that resolved the row.
        PASSES: tl.constexpr = (32 + BITS - 1) // BITS
        BINS: tl.constexpr = 1 << BITS
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(1)
        r = b.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
        count = tl.load(cnt_ptr + b).to(tl.int32)
        h_row = h_ptr + r * (PASSES * BINS)
        bins = tl.arange(0, BINS)
        if count > 0:
            # the radix search over every digit (replay_digits, also keeping the last digit taken and its bin)
            prefix = tl.zeros([], dtype=tl.uint32)
            need = count
            shift = tl.full([], 32, tl.int32)
            last = tl.full([], 0, tl.int32)
            d = tl.full([], 0, tl.int32)
            for j in tl.static_range(PASSES):
                live = shift == 32 - j * BITS
                low = tl.maximum(shift - BITS, 0)
                hist = tl.load(h_row + j * BINS + bins)
                p_new, n_new, in_bin = take_bin(hist, bins, need, prefix, low)
                digit = (p_new >> low.to(tl.uint32)) & ((1 << (shift - low)) - 1).to(tl.uint32)
                d = tl.where(live, digit.to(tl.int32), d)
                last = tl.where(live, j, last)
                prefix = tl.where(live, p_new, prefix)
                need = tl.where(live, n_new, need)
                shift = tl.where(live, tl.where(in_bin == n_new, 0, low), shift)
            # exact after the last digit: T = prefix, `need` of the values equal to it (lowest index first);
            # else the bin of digit `last` was taken whole: T its low end, every value at or above it
            exact = last == PASSES - 1
            row_p = (r * PASSES + last) * n_p
            placed = tl.full([], 0, tl.int32)  # selected values in the programs before the tile
            tied = tl.full([], 0, tl.int32)  # values equal to T in the programs before the tile
            for q0 in range(0, n_p, TILE_P):
                offs_q = q0 + tl.arange(0, TILE_P)
                q_ok = offs_q < n_p
                h = tl.load(slot_ptr + (row_p + offs_q[:, None]) * BINS + bins[None, :], mask=q_ok[:, None], other=0)
                gt = tl.load(above_ptr + row_p + offs_q, mask=q_ok, other=0)
                gt += tl.sum(tl.where(bins[None, :] > d, h, 0), axis=1)
                eq = tl.sum(tl.where(bins[None, :] == d, h, 0), axis=1)
                ties_before = tied + tl.cumsum(eq, axis=0) - eq
                allow = tl.where(exact, tl.minimum(tl.maximum(need - ties_before, 0), eq), 1 << 30)
                taken = gt + tl.minimum(allow, eq)
                tl.store(base_ptr + r * n_p + offs_q, placed + tl.cumsum(taken, axis=0) - taken, mask=q_ok)
                tl.store(allow_ptr + r * n_p + offs_q, allow, mask=q_ok)
                placed += tl.sum(taken, axis=0)
                tied += tl.sum(eq, axis=0)
            tl.store(meta_ptr + r, prefix.to(tl.int32, bitcast=True))
            for j in tl.static_range(PASSES):  # left zero for the next call's atomics
                tl.store(h_row + j * BINS + bins, tl.zeros([BINS], dtype=tl.int32))

    @triton.jit(do_not_specialize=["n_units", "chunk", "k_out"])
    def _radix_emit_kernel(
        s_ptr, cnt_ptr, meta_ptr, base_ptr, allow_ptr, out_ptr, n_units, chunk, k_out,
        s_s_b, s_s_h, s_o_b, s_o_h, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        # This program's values above T and its first `allow` equal to it, in unit order, from its place.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        p, hs, b64, r, count = _radix_program(cnt_ptr)
        n_p = tl.num_programs(0)
        out_row = out_ptr + b64 * s_o_b + hs * s_o_h
        if count > 0:
            thr = tl.load(meta_ptr + r).to(tl.uint32, bitcast=True)
            pos0 = tl.load(base_ptr + r * n_p + p)
            allow = tl.load(allow_ptr + r * n_p + p)
            src = s_ptr + b64 * s_s_b + hs * s_s_h
            x_lo = p * chunk
            x_hi = tl.minimum(n_units, x_lo + chunk)
            n_taken = tl.full([], 0, tl.int32)
            ties = tl.full([], 0, tl.int32)
            for x0 in range(x_lo, x_hi, BLOCK):
                offs = x0 + tl.arange(0, BLOCK)
                ok = offs < x_hi
                u = ordered(tl.load(src + offs, mask=ok, other=float("-inf")))
                eq = (ok & (u == thr)).to(tl.int32)
                sel = (ok & (u > thr)) | ((eq != 0) & (ties + tl.cumsum(eq, axis=0) <= allow))
                at = pos0 + n_taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(out_row + at, offs.to(tl.int64), mask=sel & (at < k_out))  # a count over k: no overrun
                n_taken += tl.sum(sel.to(tl.int32), axis=0)
                ties += tl.sum(eq, axis=0)
        if p == n_p - 1:  # the unused tail (every row takes exactly `count`): defined values, never read
            for x0 in range(tl.maximum(count, 0), k_out, BLOCK):
                at = x0 + tl.arange(0, BLOCK)
                tl.store(out_row + at, tl.zeros([BLOCK], tl.int64), mask=at < k_out)


def radix_chunk(rows: int, x: int, device, programs: int | None = None) -> int:
    """Units per program for :func:`topk_rows_radix`: a power of two giving about ``programs`` programs in
    all (default ``RADIX_PROGRAMS_PER_SM`` per SM), within ``[RADIX_CHUNK_MIN, RADIX_CHUNK_MAX]``."""
    total = RADIX_PROGRAMS_PER_SM * sm_count(device) if programs is None else check_launch_value("programs",
                                                                                                  programs)
    per_row = max(1, total // max(rows, 1))
    return min(RADIX_CHUNK_MAX, max(RADIX_CHUNK_MIN, next_pow2(cdiv(x, per_row))))


def topk_rows_radix(scores: torch.Tensor, counts: torch.Tensor, k: int, *, out: torch.Tensor | None = None,
                    chunk: int | None = None, programs: int | None = None, num_warps: int | None = None,
                    digit_bits: int | None = None, hist_mask: bool | None = None,
                    pdl: bool | None = None) -> torch.Tensor:
    """:func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton` for rows already ranked (``group = 1``),
    spread over ``ceil(X / chunk)`` programs per row (see the module): ``[B, H, k]`` int64, the ``counts[b]``
    largest units of each row ascending (ties at the threshold to the lowest index), then zeros. ``scores
    [B, H, X]`` float32 with a contiguous last dim; ``counts [B]`` with every ``counts[b] ≤ min(k, X)`` and
    at most the row's finite scores (else −inf units fill the count, lowest index first).

    Launch overrides (for tuning; None: the defaults): ``chunk`` — units per program (a power of two of at
    least 16; default :func:`radix_chunk` of ``programs``, about that many programs in all); ``num_warps``
    (a power of two up to 32; default 8 for chunks of 2048 units or more, else 4); ``digit_bits`` (4 to 8;
    default ``RADIX_BITS``): the digit width, ``ceil(32 / digit_bits)`` histogram launches of ``2 **
    digit_bits`` bins (Triton lowers a histogram to shared-memory atomics or to ballots per bin bit: fewer
    bins, cheaper ballots, more launches); ``hist_mask`` (default ``RADIX_HIST_MASK``): the histograms skip
    the values off the prefix by tl.histogram's mask; ``pdl`` (default ``RADIX_PDL``): programmatic dependent
    launch of every launch but the first where the GPU and Triton have it (each starts while the one before
    ends, waiting for it before it reads anything). The selection does not depend on them."""
    b, h, x = scores.shape
    check_score_rows(scores, 1)
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    if counts.shape != (b,):
        raise ValueError(f"counts: expected [{b}], got {tuple(counts.shape)}")
    rows = b * h
    if chunk is None:
        chunk = radix_chunk(rows, x, scores.device, programs)
    else:
        chunk = check_launch_value("chunk", chunk, low=16, pow2=True)
    warps = (8 if chunk >= 2048 else 4) if num_warps is None else check_launch_value("num_warps", num_warps,
                                                                                      high=32, pow2=True)
    bits = RADIX_BITS if digit_bits is None else check_launch_value("digit_bits", digit_bits, low=4, high=8)
    masked = RADIX_HIST_MASK if hist_mask is None else bool(hist_mask)
    passes = cdiv(32, bits)
    pdl = (RADIX_PDL if pdl is None else bool(pdl)) and pdl_available()
    if out is None:
        out = torch.empty(b, h, k, device=scores.device, dtype=torch.int64)
    n_p = cdiv(x, chunk)
    bins = 1 << bits
    hist = workspace("radix_hist", scores, rows * passes * bins, torch.int32, zeroed=True)
    slot = scratch("radix_slot", scores, (rows, passes, n_p, bins), torch.int32)
    above = scratch("radix_above", scores, (rows, passes, n_p), torch.int32)
    base = scratch("radix_base", scores, (rows, n_p), torch.int32)
    allow = scratch("radix_allow", scores, (rows, n_p), torch.int32)
    state = scratch("radix_state", scores, (rows, passes, 4), torch.int32)
    meta = scratch("radix_meta", scores, (rows,), torch.int32)
    block = min(chunk, RADIX_BLOCK)
    for step in range(passes):
        dep = pdl and step > 0
        launch(_radix_hist_kernel, (n_p, h, b), scores, counts, hist, state, slot, above, x, chunk,
               scores.stride(0), scores.stride(1), PASS=step, BITS=bits,
               BLOCK=block if step == 0 else min(block, RADIX_SPARSE_BLOCK), MASKED=masked, PDL=dep,
               num_warps=warps, num_stages=1, **pdl_launch(dep))
    launch(_radix_place_kernel, (h, b), counts, hist, slot, above, meta, base, allow, n_p,
           BITS=bits, TILE_P=RADIX_TILE_P, PDL=pdl, num_warps=4, num_stages=1, **pdl_launch(pdl))
    launch(_radix_emit_kernel, (n_p, h, b), scores, counts, meta, base, allow, out, x, chunk, k,
           scores.stride(0), scores.stride(1), out.stride(0), out.stride(1), BLOCK=min(block, RADIX_EMIT_BLOCK),
           PDL=pdl, num_warps=warps, num_stages=1, **pdl_launch(pdl))
    return out


__all__ = ["RADIX_BITS", "RADIX_HIST_MASK", "RADIX_CHUNK_MAX", "RADIX_CHUNK_MIN", "radix_chunk", "topk_rows_radix"]
