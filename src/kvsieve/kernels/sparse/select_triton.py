"""Exact per-row top-k on the device in one Triton launch, for Quest's pages and oracle-topk's keys.

:func:`topk_rows_triton` takes a scoring launch's output — float32 scores ``[B, Hq, X]`` over ``X``
units (pages or keys), each batch row's count of units to take (written by that launch), and, for a
GQA group ranked together (``share_kv_group``), the launch's per-block softmax partials — and writes
the ``count`` best units of each row as an index list ``[B, Hs, K]`` in ascending unit order (the
sparse kernel ignores the order; entries past the count are 0). One program per (row, selection head):

1. group-summed rows only: the per-head log-sum-exp from the partials, then ``log Σ_g softmax_g(s)[x]``
   with non-candidate units at −inf, written once to a workspace row (the separate ``logsumexp`` +
   group-sum launches of the earlier path, folded in);
2. a radix select on the order-preserving 32-bit image of the float scores: three histogram passes
   (11 + 11 + 10 bits) over the row find the exact ``count``-th largest value ``T`` and how many of the
   units equal to ``T`` are needed;
3. one compaction pass writes the units above ``T`` and the first needed ties (lowest index first).

Why not ``torch.topk``: at these sizes it is a radix select of its own — one launch for rows shorter
than ~20k but 20–50 launches (multi-block passes, then a sort for ``sorted=True``) for oracle-topk's
32k/128k-key rows, and Quest's group-summed ranking needed a ``logsumexp`` (several elementwise
launches) and a group-sum launch before it (issue 15 §2: 16 launches for Quest, 35–60 for oracle-topk).
Here selection is the scoring launch plus this one. Ties at ``T`` go to the lowest indices, where
``torch.topk`` picks any of them: selections are equal as sets up to ties.

The row is read from L2 four times (five with the group sum), by one program; rows of 128k keys are
the slow case (a few MB per program), a place to split rows over programs if it shows on the GPU.
"""

from __future__ import annotations

import torch

from ..triton_utils import launch, next_pow2, triton

_BITS = (11, 11, 10)  # radix digits from the top: 2048-bin histograms, three passes over 32 bits


def group_summed_from_scores(scores: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, Hq, X] -> [B, Hq/group, X]``: ``log Σ_g softmax_g(s)``, −inf where no head has a finite
    score (the torch twin of step 1, without the candidate mask)."""
    b, hq, x = scores.shape
    finite = torch.isfinite(scores)
    lse = torch.logsumexp(torch.where(finite, scores, float("-inf")), dim=-1, keepdim=True)
    logp = torch.where(finite & torch.isfinite(lse), scores - torch.where(torch.isfinite(lse), lse, 0.0),
                       float("-inf"))
    return torch.logsumexp(logp.view(b, hq // group, group, x), dim=2)


def topk_rows_reference(values: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, Hs, k]`` int64: the ``counts[b]`` largest units of each row of ``values [B, Hs, X]`` in
    ascending order (ties to the lowest index), then zeros — what :func:`topk_rows_triton` writes."""
    b, hs, x = values.shape
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    take = torch.arange(order.shape[-1], device=values.device) < counts.long().view(b, 1, 1)
    chosen = torch.where(take, order, x).sort(-1).values
    out = torch.where(chosen < x, chosen, 0)
    if out.shape[-1] < k:
        out = torch.nn.functional.pad(out, (0, k - out.shape[-1]))
    return out


if triton is not None:
    import triton.language as tl

    from ..triton_utils import dense_range

    @triton.jit
    def store_softmax_part(pm_ptr, pl_ptr, b64, heads, g_ok, blk, s_p_b, s_p_h, s):
        """Block ``blk``'s softmax partial of each head's scores ``s [BLOCK_G, BLOCK_X]``: the max ``m``
        (−inf when the block has no finite score) and ``Σ exp(s − m)``."""
        m = tl.max(s, axis=1)
        ref = tl.where(m > float("-inf"), m, 0.0)
        l_sum = tl.sum(tl.exp(s - ref[:, None]), axis=1)
        at = b64 * s_p_b + heads * s_p_h + blk
        tl.store(pm_ptr + at, m, mask=g_ok)
        tl.store(pl_ptr + at, l_sum, mask=g_ok)

    @triton.jit
    def _ordered(v):
        # float32 -> uint32 with the same order (non-NaN): flip the magnitude bits of negatives, then
        # the sign bit, so unsigned comparisons and radix digits follow the float order.
        bits = v.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return key.to(tl.uint32, bitcast=True) ^ 0x80000000

    @triton.jit
    def _radix_pass(src, n_units, prefix, need, SHIFT: tl.constexpr, WIDTH: tl.constexpr, FIRST: tl.constexpr,
                    BLOCK_X: tl.constexpr, NBINS: tl.constexpr):
        # Histogram of the WIDTH-bit digit at SHIFT over the units whose higher bits equal prefix's, then
        # the digit holding the need-th largest of them; returns the extended prefix and what is still
        # needed inside that digit.
        bins = tl.arange(0, NBINS)
        hist = tl.zeros([NBINS], dtype=tl.int32)
        for x0 in range(0, n_units, BLOCK_X):
            offs = x0 + tl.arange(0, BLOCK_X)
            ok = offs < n_units
            u = _ordered(tl.load(src + offs, mask=ok, other=float("-inf"), cache_modifier=".cg"))
            if FIRST:
                active = ok
            else:
                active = ok & ((u >> (SHIFT + WIDTH)) == (prefix >> (SHIFT + WIDTH)))
            digit = tl.where(active, (u >> SHIFT) & ((1 << WIDTH) - 1), 0).to(tl.int32)
            # inactive units were counted in bin 0: take them out (portable; no histogram mask needed)
            n_off = BLOCK_X - tl.sum(active.to(tl.int32), axis=0)
            hist += tl.histogram(digit, NBINS) - tl.where(bins == 0, n_off, 0)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        digit = tl.max(tl.where((at_or_above >= need) & (bins < (1 << WIDTH)), bins, 0), axis=0)
        above = tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        return prefix | (digit.to(tl.uint32) << SHIFT), need - above

    @triton.jit(do_not_specialize=["sink", "window", "n_units", "n_parts", "k_out"])
    def _topk_rows_kernel(
        s_ptr, pm_ptr, pl_ptr, cnt_ptr, lens_ptr, gs_ptr, out_ptr,
        sink, window, n_units, n_parts, k_out,
        s_s_b, s_s_h, s_p_b, s_p_h, s_g_b, s_g_h, s_o_b, s_o_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, SHARE: tl.constexpr, UNIT: tl.constexpr,
        BLOCK_X: tl.constexpr, BLOCK_XG: tl.constexpr, BLOCK_PART: tl.constexpr, NBINS: tl.constexpr,
        B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
    ):
        hs = tl.program_id(0)
        b = tl.program_id(1)
        b64 = b.to(tl.int64)
        count = tl.load(cnt_ptr + b).to(tl.int32)
        out_row = out_ptr + b64 * s_o_b + hs * s_o_h
        if SHARE:
            src = gs_ptr + b64 * s_g_b + hs * s_g_h
        else:
            src = s_ptr + b64 * s_s_b + hs * s_s_h
        if SHARE:
            length, sink_end, win_start = dense_range(lens_ptr, b, sink, window)
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = hs * G + offs_g
            # each head's log-sum-exp over all its valid units, from the scoring launch's block partials
            m_run = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_run = tl.zeros([BLOCK_G], tl.float32)
            for p0 in range(0, n_parts, BLOCK_PART):
                offs_p = p0 + tl.arange(0, BLOCK_PART)
                at = b64 * s_p_b + heads[:, None] * s_p_h + offs_p[None, :]
                ok = g_ok[:, None] & (offs_p < n_parts)[None, :]
                pm = tl.load(pm_ptr + at, mask=ok, other=float("-inf"))
                pl = tl.load(pl_ptr + at, mask=ok, other=0.0)
                m_new = tl.maximum(m_run, tl.max(pm, axis=1))
                ref = tl.where(m_new > float("-inf"), m_new, 0.0)
                l_run = l_run * tl.exp(m_run - ref) + tl.sum(pl * tl.exp(pm - ref[:, None]), axis=1)
                m_run = m_new
            live_h = l_run > 0
            lse = tl.where(live_h, m_run + tl.log(tl.where(live_h, l_run, 1.0)), 0.0)
            # log Σ_g softmax_g(s)[x], −inf off the candidates, written once for the passes below
            for x0 in range(0, n_units, BLOCK_XG):
                offs_x = x0 + tl.arange(0, BLOCK_XG)
                x_ok = offs_x < n_units
                sc = tl.load(s_ptr + b64 * s_s_b + heads[:, None] * s_s_h + offs_x[None, :],
                             mask=g_ok[:, None] & x_ok[None, :], other=float("-inf"))
                live = (sc > float("-inf")) & live_h[:, None]
                logp = tl.where(live, sc - lse[:, None], float("-inf"))
                m = tl.max(logp, axis=0)
                m_ref = tl.where(m > float("-inf"), m, 0.0)
                total = tl.sum(tl.where(live, tl.exp(logp - m_ref[None, :]), 0.0), axis=0)
                val = tl.where(total > 0, m_ref + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
                start = offs_x * UNIT
                keep = (start < win_start) & (start + UNIT > sink_end)
                tl.store(src + offs_x, tl.where(keep, val, float("-inf")), mask=x_ok)
            tl.debug_barrier()  # the row written above is read back by other threads of this program
        n_taken = tl.full([], 0, tl.int32)
        if count > 0:
            prefix = tl.zeros([], dtype=tl.uint32)
            prefix, need = _radix_pass(src, n_units, prefix, count, 32 - B0, B0, True, BLOCK_X, NBINS)
            prefix, need = _radix_pass(src, n_units, prefix, need, 32 - B0 - B1, B1, False, BLOCK_X, NBINS)
            prefix, need = _radix_pass(src, n_units, prefix, need, 0, B2, False, BLOCK_X, NBINS)
            # prefix is now the count-th largest value's image; take all above it and `need` ties
            ties = tl.full([], 0, tl.int32)
            for x0 in range(0, n_units, BLOCK_X):
                offs = x0 + tl.arange(0, BLOCK_X)
                ok = offs < n_units
                u = _ordered(tl.load(src + offs, mask=ok, other=float("-inf"), cache_modifier=".cg"))
                eq = (ok & (u == prefix)).to(tl.int32)
                sel = (ok & (u > prefix)) | ((eq != 0) & (ties + tl.cumsum(eq, axis=0) <= need))
                pos = n_taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(out_row + pos, offs.to(tl.int64), mask=sel)
                n_taken += tl.sum(sel.to(tl.int32), axis=0)
                ties += tl.sum(eq, axis=0)
        for x0 in range(n_taken, k_out, BLOCK_X):  # the unused tail: defined values, never read
            offs = x0 + tl.arange(0, BLOCK_X)
            tl.store(out_row + offs, tl.zeros([BLOCK_X], tl.int64), mask=offs < k_out)


def topk_rows_triton(scores: torch.Tensor, counts: torch.Tensor, k: int, *, group: int = 1,
                     parts: tuple[torch.Tensor, torch.Tensor] | None = None, lengths: torch.Tensor | None = None,
                     unit: int = 1, sink: int = 0, window: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``counts[b]`` best units of each row as ``[B, Hs, k]`` int64, ascending, zero-padded (one
    launch). ``scores [B, Hq, X]`` float32 with a contiguous last dim; ``counts [B]`` with every
    ``counts[b] ≤ min(k, X)`` and at most the row's finite scores (what the scoring launches write).

    ``group = 1``: rows are ``scores``' rows as they are (``Hs = Hq``; non-candidates already −inf).
    ``group > 1``: rows are KV heads ranked by ``log Σ_g softmax_g(s)`` over their ``group`` query
    heads; ``scores`` are −inf only past each row's length (``lengths`` int32 ``[B]``), ``parts =
    (max, sum_exp) [B, Hq, n_blocks]`` from the scoring launch, and units without a key in
    ``[sink_end, window_start)`` (``unit`` keys each) are never chosen."""
    b, hq, x = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores: expected float32 with a contiguous last dim, got {scores.dtype}, "
                         f"strides {tuple(scores.stride())}")
    if group < 1 or hq % group:
        raise ValueError(f"group: expected a divisor of the {hq} score rows, got {group}")
    share = group > 1
    if share and (parts is None or lengths is None):
        raise ValueError("parts and lengths: required when group > 1 (the group-summed ranking)")
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    hs = hq // group
    if out is None:
        out = torch.empty(b, hs, k, device=scores.device, dtype=torch.int64)
    if share:
        pm, pl = parts
        gs = torch.empty(b, hs, x, device=scores.device, dtype=torch.float32)
    else:
        pm = pl = gs = scores
    block_g = max(2, next_pow2(group))
    launch(_topk_rows_kernel, (hs, b),
           scores, pm, pl, counts, counts if lengths is None else lengths, gs, out,
           sink, window, x, pm.shape[-1], k,
           scores.stride(0), scores.stride(1), pm.stride(0), pm.stride(1), gs.stride(0), gs.stride(1),
           out.stride(0), out.stride(1),
           G=group, BLOCK_G=block_g, SHARE=share, UNIT=unit, BLOCK_X=2048, BLOCK_XG=max(64, 4096 // block_g),
           BLOCK_PART=max(64, 2048 // block_g), NBINS=1 << max(_BITS), B0=_BITS[0], B1=_BITS[1], B2=_BITS[2],
           num_warps=8, num_stages=1)
    return out


__all__ = ["group_summed_from_scores", "store_softmax_part", "topk_rows_reference", "topk_rows_triton"]
