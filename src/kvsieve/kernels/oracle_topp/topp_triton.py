"""Top-p selection on the device (``oracle-topp``): per row, the fewest keys of highest probability whose
attention mass reaches a target, as a token list for
:func:`kvsieve.kernels.shared.weighted_triton.sparse_decode_triton` — by a threshold, not a sort.

The set is ``{available keys with p ≥ τ}``, ``τ`` the largest value such that the mass of the available
keys at or above it reaches the target: all keys tied at ``τ`` are taken, as the torch reference
(:func:`kvsieve.methods.shared.selection.top_p`, whose bisection stops within ``max p · 2^-48`` below
``τ``) takes them. ``τ`` is found by a radix select on the bits of the float32 probabilities
(non-negative, so their int32 images order as the values) that accumulates MASS per bin where
:mod:`~kvsieve.kernels.shared.select_triton` counts: ``BITS`` bits per pass from bit 29 down (bit 30 and
the sign are 0 for values in [0, 1]).

Launches (grid ``(segments, Hs, B)`` each, static; no host read, so graph-capturable):

1. :func:`~kvsieve.kernels.shared.scores.scores_triton`: every scaled logit (−inf only past the length)
   and per-block softmax partials;
2. the first pass: each head's log-sum-exp from the partials, ``p`` (group-summed and divided by the
   group for ``share_kv_group``, 0 off ``[sink_end, window_start)``) written to a workspace row, the
   segment's available mass and its mass histogram of the top digit;
3. ``ceil(30 / BITS) − 1`` refining passes: every program reduces the previous pass's per-segment
   histograms in segment order (a few hundred floats; the same result in every program, so no
   program waits on another), picks the digit and writes nothing else shared but its own histogram;
   the first program of each row records the prefix and the mass still missing for the next launch;
4. the count pass: the same step for the last digit gives ``τ``; each program counts its keys;
5. the emit pass: each program writes its keys at the offset the earlier segments' counts give.

Why several launches and not one select program per row (as ``topk_rows_triton`` after its
prefilter): a top-p set has no small size to prefilter to (at ``top_p = 0.9`` it can be most of a flat
row), so every pass reads the whole row, and a 128k-key row on one SM is latency-bound. Split over
``segments`` programs per row, every pass is spread over the GPU; the launches are the only barrier.

Precision: ``p`` and every mass are float32 (the reference's float64), each segment's histogram summed
in the program's fixed order and the segments in index order, so the result is deterministic. It can
differ from the reference's set where the cumulative mass at the boundary is within float32 rounding
(~1e-6 relative) of the target, or where two probabilities differ by less than their rounding: the
tests compare sets exactly on random data and accept only such near-tie differences.
"""

from __future__ import annotations

import torch

from ..shared.scores import score_block, scores_triton
from ..shared.select_common import check_score_rows, row_segments, scratch
from ..shared.triton_utils import cdiv, launch, next_pow2, triton

BITS = 4  # digit bits per pass: BINS = 16 bins (a mass histogram costs one select + add per bin and key)
VALUE_BITS = 30  # bits 0..29 vary for float32 values in [0, 1]
BLOCK = 512  # keys per chunk of a pass (a [BLOCK, BINS] one-hot tile)
# programs per row: at least SEGMENT_MIN keys each, about WAVES programs per SM in all
SEGMENT_MIN = 2048
WAVES = 4


def n_passes(bits: int = BITS) -> int:
    return cdiv(VALUE_BITS, bits)


if triton is not None:
    import triton.language as tl

    from ..shared.select_common import group_lse, group_sum_tile
    from ..shared.triton_utils import dense_range

    @triton.jit
    def _row_target(sum_ptr, row, n_seg, top_p, RESIDUAL: tl.constexpr, BLOCK_S: tl.constexpr):
        # The row's available mass (segments summed in order) and the mass to reach; nothing is taken
        # when it is <= 0 and everything when it is the whole available mass (the reference's rules).
        offs = tl.arange(0, BLOCK_S)
        rest = tl.sum(tl.load(sum_ptr + row * n_seg + offs, mask=offs < n_seg, other=0.0), axis=0)
        if RESIDUAL:
            target = top_p * rest
        else:  # p − (1 − rest), in this order so that top_p = 1 gives rest exactly
            target = rest - (1.0 - top_p)
        return rest, target

    @triton.jit
    def _advance(hist_ptr, row, n_rows, n_seg, j, prefix, goal, low, BINS: tl.constexpr, BLOCK_S: tl.constexpr):
        # Resolve the digit at bits [low, low + BITS) from pass j's per-segment mass histograms: the
        # largest digit whose bin and those above reach the mass still missing (``goal``); returns the
        # longer prefix and what is still missing below it.
        offs_s = tl.arange(0, BLOCK_S)
        bins = tl.arange(0, BINS)
        at = ((j * n_rows + row) * n_seg + offs_s[:, None]) * BINS + bins[None, :]
        mass = tl.sum(tl.load(hist_ptr + at, mask=(offs_s < n_seg)[:, None], other=0.0), axis=0)
        at_or_above = tl.sum(mass, axis=0) - tl.cumsum(mass, axis=0) + mass
        d = tl.max(tl.where(at_or_above >= goal, bins, 0), axis=0)
        goal = goal - tl.sum(tl.where(bins > d, mass, 0.0), axis=0)
        return prefix | (d << low).to(tl.int32), goal

    @triton.jit(do_not_specialize=["sink", "window", "n_units", "n_parts", "n_seg", "seg_len", "n_rows", "j",
                                   "shift", "low", "top_p"])
    def _topp_pass_kernel(
        s_ptr, pm_ptr, pl_ptr, lens_ptr, p_ptr, sum_ptr, hist_ptr, pre_ptr, goal_ptr, cnt_ptr, idx_ptr, out_cnt_ptr,
        sink, window, n_units, n_parts, n_seg, seg_len, n_rows, j, shift, low, top_p,
        s_s_b, s_s_h, s_p_b, s_p_h, s_i_b, s_i_h,
        STAGE: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, RESIDUAL: tl.constexpr,
        BINS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_PART: tl.constexpr,
    ):
        # STAGE 0: p, the segment's mass and pass 0's histogram; 1: pass j's histogram (j >= 1) under
        # the prefix from pass j - 1; 2: the count of the segment's keys at or above τ; 3: their list.
        seg = tl.program_id(0)
        hs = tl.program_id(1)
        b = tl.program_id(2)
        b64 = b.to(tl.int64)
        row = b * tl.num_programs(1) + hs
        p_row = p_ptr + row.to(tl.int64) * n_units
        length, sink_end, win_start = dense_range(lens_ptr, b, sink, window)
        x_lo = seg * seg_len
        x_hi = tl.minimum(n_units, x_lo + seg_len)
        bins = tl.arange(0, BINS)
        if STAGE == 0:
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = hs * G + offs_g
            lse, live_h = group_lse(pm_ptr, pl_ptr, b64 * s_p_b, heads, g_ok, n_parts, s_p_h, BLOCK_G,
                                     BLOCK_PART)
            hist = tl.zeros([BINS], dtype=tl.float32)
            total = tl.zeros([BLOCK_X], dtype=tl.float32)
            for x0 in range(x_lo, x_hi, BLOCK_X):
                offs = x0 + tl.arange(0, BLOCK_X)
                ok = offs < x_hi
                val = group_sum_tile(s_ptr, b64 * s_s_b, heads, g_ok, lse, live_h, offs, ok, s_s_h,
                                      sink_end, win_start, 1)
                p = tl.exp(val) / G  # 0 off the candidates (val = −inf)
                tl.store(p_row + offs, p, mask=ok)
                total += p
                digit = (p.to(tl.int32, bitcast=True) >> low) & (BINS - 1)
                hist += tl.sum(tl.where(digit[:, None] == bins[None, :], p[:, None], 0.0), axis=0)
            tl.store(sum_ptr + row * n_seg + seg, tl.sum(total, axis=0))
            tl.store(hist_ptr + (row * n_seg + seg) * BINS + bins, hist)
        else:
            rest, target = _row_target(sum_ptr, row, n_seg, top_p, RESIDUAL, BLOCK_S)
            every = target >= rest
            if STAGE == 3:
                prefix = tl.load(pre_ptr + j * n_rows + row)
            else:
                # prefix and missing mass after pass j - 1 (pass 0's: nothing resolved, the target)
                if j == 1:
                    prefix = tl.full([], 0, tl.int32)
                    goal = target
                else:
                    prefix = tl.load(pre_ptr + (j - 1) * n_rows + row)
                    goal = tl.load(goal_ptr + (j - 1) * n_rows + row)
                prefix, goal = _advance(hist_ptr, row, n_rows, n_seg, j - 1, prefix, goal, shift, BINS, BLOCK_S)
                if seg == 0:
                    tl.store(pre_ptr + j * n_rows + row, prefix)
                    tl.store(goal_ptr + j * n_rows + row, goal)
            if STAGE == 1:
                if (target > 0.0) & (target < rest):  # else no pass matters: leave the histogram at 0 mass
                    hist = tl.zeros([BINS], dtype=tl.float32)
                    for x0 in range(x_lo, x_hi, BLOCK_X):
                        offs = x0 + tl.arange(0, BLOCK_X)
                        p = tl.load(p_row + offs, mask=offs < x_hi, other=0.0)
                        u = p.to(tl.int32, bitcast=True)
                        active = (u >> shift) == (prefix >> shift)
                        digit = tl.where(active, (u >> low) & (BINS - 1), BINS)  # BINS: no bin
                        hist += tl.sum(tl.where(digit[:, None] == bins[None, :], p[:, None], 0.0), axis=0)
                else:
                    hist = tl.zeros([BINS], dtype=tl.float32)
                tl.store(hist_ptr + ((j * n_rows + row) * n_seg + seg) * BINS + bins, hist)
            else:
                # keys in [sink_end, win_start) at or above τ (all of them / none by the rules of _row_target)
                base = tl.full([], 0, tl.int32)
                if STAGE == 3:
                    offs_s = tl.arange(0, BLOCK_S)
                    seg_cnt = tl.load(cnt_ptr + row * n_seg + offs_s, mask=offs_s < n_seg, other=0)
                    base = tl.sum(tl.where(offs_s < seg, seg_cnt, 0), axis=0)
                    if seg == 0:
                        tl.store(out_cnt_ptr + row, tl.sum(seg_cnt, axis=0))
                n_taken = tl.full([], 0, tl.int32)
                thr = tl.where(every, 0, prefix)  # every key's bits are >= 0
                if target > 0.0:
                    for x0 in range(x_lo, x_hi, BLOCK_X):
                        offs = x0 + tl.arange(0, BLOCK_X)
                        p = tl.load(p_row + offs, mask=offs < x_hi, other=0.0)
                        keep = (offs < x_hi) & (offs >= sink_end) & (offs < win_start)
                        keep = keep & (p.to(tl.int32, bitcast=True) >= thr)
                        if STAGE == 3:
                            pos = base + n_taken + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                            tl.store(idx_ptr + b64 * s_i_b + hs * s_i_h + pos, offs, mask=keep)
                        n_taken += tl.sum(keep.to(tl.int32), axis=0)
                if STAGE == 2:
                    tl.store(cnt_ptr + row * n_seg + seg, n_taken)


def topp_rows_triton(scores: torch.Tensor, parts: tuple[torch.Tensor, torch.Tensor], lengths: torch.Tensor, *,
                     group: int, top_p: float, mass: str, sink: int, window: int,
                     bits: int = BITS, segments: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p keys of each row as ``(indices [B, Hs, N] int32, counts [B, Hs] int32)``, ``Hs = Hq /
    group``; the first ``counts`` entries of a row are its keys in ascending order, the rest unwritten.

    ``scores [B, Hq, N]`` float32 scaled logits, −inf only past each row's length (``lengths`` int32
    ``[B]``), with ``parts = (max, sum_exp) [B, Hq, n_blocks]`` their block softmax partials (what
    :func:`~kvsieve.kernels.shared.scores.scores_triton` writes with ``mask_dense=False``). A row's
    probabilities are the softmax over all its valid keys (``group > 1``: summed over the group's heads
    and divided by ``group``); keys in ``[sink_end, window_start)`` are available, and the target is
    ``top_p − (mass off them)`` (``mass="total"``) or ``top_p ×`` their mass (``"residual"``).
    ``bits``: digit bits per pass; ``segments``: programs per row (default: from the rows and the GPU)."""
    b, hq, n = scores.shape
    check_score_rows(scores, group)
    if mass not in ("total", "residual"):
        raise ValueError(f"mass: expected 'total' or 'residual', got {mass!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a value in (0, 1], got {top_p}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits: expected 1 to 8, got {bits}")
    hs = hq // group
    rows = b * hs
    pm, pl = parts
    n_seg = segments or row_segments(rows, n, scores.device, segment=SEGMENT_MIN, waves=WAVES)
    seg_len = cdiv(n, n_seg)
    passes = n_passes(bits)
    bins = 1 << bits
    probs = scratch("topp_p", scores, (rows, n), torch.float32)
    sums = scratch("topp_sum", scores, (rows, n_seg), torch.float32)
    hist = scratch("topp_hist", scores, (passes, rows, n_seg, bins), torch.float32)
    prefix = scratch("topp_prefix", scores, (passes + 1, rows), torch.int32)
    goal = scratch("topp_goal", scores, (passes + 1, rows), torch.float32)
    seg_cnt = scratch("topp_cnt", scores, (rows, n_seg), torch.int32)
    # fresh outputs: the stats read them after the call, when the workspaces may hold another call's
    idx = torch.empty(b, hs, n, device=scores.device, dtype=torch.int32)
    counts = torch.empty(b, hs, device=scores.device, dtype=torch.int32)
    block_g = max(2, next_pow2(group))
    # pass j resolves bits [low_j, high_j), high_j = 30 − j·bits; a launch of pass j first finishes pass
    # j − 1 (whose low end is high_j); the count and emit launches come as "pass" number `passes`
    for stage, j in [(0, 0)] + [(1, i) for i in range(1, passes)] + [(2, passes), (3, passes)]:
        high = max(VALUE_BITS - j * bits, 0)
        launch(_topp_pass_kernel, (n_seg, hs, b),
               scores, pm, pl, lengths, probs, sums, hist, prefix, goal, seg_cnt, idx, counts,
               sink, window, n, pm.shape[-1], n_seg, seg_len, rows, j, high, max(high - bits, 0), float(top_p),
               scores.stride(0), scores.stride(1), pm.stride(0), pm.stride(1), idx.stride(0), idx.stride(1),
               STAGE=stage, G=group, BLOCK_G=block_g, RESIDUAL=mass == "residual", BINS=bins,
               BLOCK_S=max(2, next_pow2(n_seg)), BLOCK_X=BLOCK, BLOCK_PART=max(64, 2048 // block_g),
               num_warps=4, num_stages=1)
    return idx, counts


def topp_select(q, k, lengths, *, sink: int, window: int, top_p: float, mass: str, share_kv_group: bool,
                scale: float | None = None, bits: int = BITS,
                segments: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``oracle-topp``'s token list for :func:`sparse_decode_triton` (with the same ``sink``/``window``):
    ``(indices [B, Hs, N] int32, counts [B, Hs] int32)``, ``Hs = Hkv`` when ``share_kv_group`` else
    ``Hq``; the scores launch (:func:`~kvsieve.kernels.shared.scores.scores_triton`) then
    :func:`topp_rows_triton`. ``lengths`` int32 ``[B]``."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = hq // hkv if share_kv_group else 1
    n_blocks = cdiv(n, score_block(d))
    parts = (scratch("topp_pm", q, (b, hq, n_blocks), torch.float32),
             scratch("topp_pl", q, (b, hq, n_blocks), torch.float32))
    s = scores_triton(q, k, lengths, sink, window, scale, out=scratch("topp_scores", q, (b, hq, n), torch.float32),
                      mask_dense=False, parts=parts)
    return topp_rows_triton(s, parts, lengths, group=group, top_p=top_p, mass=mass, sink=sink, window=window,
                            bits=bits, segments=segments)


__all__ = ["BITS", "n_passes", "topp_rows_triton", "topp_select"]
