"""Exact per-row top-k on the device in one Triton launch, for Quest's pages and oracle-topk's keys.

:func:`topk_rows_triton` takes a scoring launch's output — float32 scores ``[B, Hq, X]`` over ``X``
units (pages or keys), each batch row's count of units to take (written by that launch), and, for a
GQA group ranked together (``share_kv_group``), the launch's per-block softmax partials — and writes
the ``count`` best units of each row as an index list ``[B, Hs, K]`` in ascending unit order (the
sparse kernel ignores the order; entries past the count are 0). One program per (row, selection head)
— rows over ``SEGMENT`` units (oracle-topk's keys) get up to one per ``SEGMENT`` units for step 2 (fewer
when rows are many: about two waves of programs in all), and the last of them to finish (a ticket
counter it resets) runs steps 3–4 on all their candidates:

1. group-summed rows: the per-head log-sum-exp from the partials, then ``log Σ_g softmax_g(s)[x]``
   with non-candidate units at −inf, written once to a workspace row (the separate ``logsumexp`` and
   group-sum launches of the earlier path, folded in). Rows longer than ``ROW_GROUP_SUM_MAX``
   (oracle-topk's keys, Quest's pages beyond a 64k context) get this from :func:`group_sum_rows_triton`
   instead, one launch spread over the row;
2. with ``maxima`` (long rows): a prefilter. The ``count``-th largest of the maxima of every
   ``GROUP_MAX`` units (a subset of the row, one unit per group) is at most the row's ``count``-th
   largest, so only units at or above it can be chosen; one pass copies them (value, index) out, and
   the select below runs on that list (≈ 1.2 × count long for i.i.d. scores at 5% density; the whole
   row in the worst case, still exact);
3. a radix select on the order-preserving 32-bit image of the float scores: six 64-bin histogram
   passes find the exact ``count``-th largest value ``T`` and how many units equal to ``T`` are needed;
4. one compaction pass writes the units above ``T`` and the first needed ties (lowest index first).

Why not ``torch.topk``: at these sizes it is a radix select of its own — one launch for rows shorter
than ~20k but 20–50 launches (multi-block passes, then a sort for ``sorted=True``) for oracle-topk's
32k/128k-key rows, and Quest's group-summed ranking needed a ``logsumexp`` (several elementwise
launches) and a group-sum launch before it (16 launches for Quest, 35–60 for oracle-topk).
Here Quest's selection is the bounds launch plus this one, oracle-topk's the scores pass plus this one
(plus :func:`group_sum_rows_triton` for group-summed rows longer than ``ROW_GROUP_SUM_MAX``). Ties at
``T`` go to the lowest indices, where ``torch.topk`` picks any of them: selections are equal as sets up
to ties.

Cost model: a row's select runs on one SM (its prefilter pass on up to ``ceil(X / SEGMENT)``), so
the work per row is what counts. Triton's histogram lowering differs across versions (ballots per bin
bit or per bin, or shared-memory atomics): 64 bins keep each variant cheap per element, and starting
below the shared high bits keeps the atomics' variant from piling every value into one bin. The
prefilter's copy pass (~20 ops per unit: a cumsum and two scattered stores) dominated a 128k-key row
on one SM (~30 µs by the model), hence the segments.
"""

from __future__ import annotations

import torch

from .select_common import GROUP_MAX, SEGMENT, check_launch_value, check_score_rows, row_segments, scratch
from .select_radix import topk_rows_radix
from .select_split import topk_rows_split
from .triton_utils import cdiv, launch, next_pow2, triton, workspace


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

    from .select_common import (
        chosen_regs,
        emit_selected,
        group_lse,
        group_sum_tile,
        ordered,
        radix_select,
        value_range,
    )
    from .triton_utils import dense_range

    @triton.jit(do_not_specialize=["sink", "window", "n_units", "n_parts"])
    def _group_sum_parts_kernel(
        s_ptr, pm_ptr, pl_ptr, lens_ptr, out_ptr, mx_ptr,
        sink, window, n_units, n_parts,
        s_s_b, s_s_h, s_p_b, s_p_h, s_o_b, s_o_h, s_x_b, s_x_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, UNIT: tl.constexpr, BLOCK_X: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK_PART: tl.constexpr, GROUP_MAX: tl.constexpr,
    ):
        # Rows too long for one program to group-sum (oracle-topk's keys): each program takes BLOCK_X
        # units, and also writes the max of every GROUP_MAX units (the select kernel's prefilter).
        xb = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        b64 = b.to(tl.int64)
        length, sink_end, win_start = dense_range(lens_ptr, b, sink, window)
        offs_g = tl.arange(0, BLOCK_G)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        lse, live_h = group_lse(pm_ptr, pl_ptr, b64 * s_p_b, heads, g_ok, n_parts, s_p_h, BLOCK_G, BLOCK_PART)
        for c0 in range(0, BLOCK_X, CHUNK):
            offs_x = xb * BLOCK_X + c0 + tl.arange(0, CHUNK)
            x_ok = offs_x < n_units
            val = group_sum_tile(s_ptr, b64 * s_s_b, heads, g_ok, lse, live_h, offs_x, x_ok, s_s_h,
                                  sink_end, win_start, UNIT)
            tl.store(out_ptr + b64 * s_o_b + kvh * s_o_h + offs_x, val, mask=x_ok)
            mx = tl.max(tl.reshape(val, [CHUNK // GROUP_MAX, GROUP_MAX]), axis=1)
            offs_m = (xb * BLOCK_X + c0) // GROUP_MAX + tl.arange(0, CHUNK // GROUP_MAX)
            tl.store(mx_ptr + b64 * s_x_b + kvh * s_x_h + offs_m, mx, mask=offs_m * GROUP_MAX < n_units)

    @triton.jit
    def _merge_segments(cv, ci, cv2, ci2, sn_ptr, sh_ptr, sl_ptr, sq, n_seg, seg_len, count, out_row,
                        BLOCK_C: tl.constexpr):
        """The segments' candidates (``cv, ci`` at ``sg · seg_len``, ``sn[sq + sg]`` of them, their ordered
        max and min in ``sh``, ``sl``), in segment order (so in unit order), gathered into one list
        ``cv2, ci2``; its ``count`` largest (exact radix select) written to ``out_row``; returns how many.
        Other programs wrote the segments: read through L2 (.cg), not this SM's L1."""
        total = tl.full([], 0, tl.int32)
        hi_row = tl.zeros([], dtype=tl.uint32)
        lo_row = tl.full([], 0xFFFFFFFF, tl.uint32)
        for sg in range(0, n_seg):
            n_sg = tl.load(sn_ptr + sq + sg, cache_modifier=".cg")
            hi_row = tl.maximum(hi_row, tl.load(sh_ptr + sq + sg, cache_modifier=".cg").to(tl.uint32, bitcast=True))
            lo_row = tl.minimum(lo_row, tl.load(sl_ptr + sq + sg, cache_modifier=".cg").to(tl.uint32, bitcast=True))
            for y0 in range(0, n_sg, BLOCK_C):
                offs = y0 + tl.arange(0, BLOCK_C)
                ok = offs < n_sg
                tl.store(cv2 + total + offs, tl.load(cv + sg * seg_len + offs, mask=ok, cache_modifier=".cg"),
                         mask=ok)
                tl.store(ci2 + total + offs, tl.load(ci + sg * seg_len + offs, mask=ok, cache_modifier=".cg"),
                         mask=ok)
            total += n_sg
        tl.debug_barrier()  # the list written above is read back by other threads
        thr, need = radix_select(cv2, total, count, hi_row, lo_row, 32, BLOCK_C)
        return emit_selected(cv2, ci2, total, thr, need, out_row, True, BLOCK_C)

    @triton.jit(do_not_specialize=["n_seg", "seg_len", "k_out"])
    def _merge_rows_kernel(cnt_ptr, cv_ptr, ci_ptr, cv2_ptr, ci2_ptr, sn_ptr, sh_ptr, sl_ptr, out_ptr, n_seg, seg_len,
                           k_out, s_c_b, s_c_h, s_o_b, s_o_h, BLOCK_C: tl.constexpr, BLOCK_X: tl.constexpr):
        """The segmented select's last step as a launch of its own, one program per (row, selection head),
        after every segment's program has written its candidates (no ticket counter: the launch boundary
        orders them): :func:`_merge_segments`, then zeros up to ``k_out``."""
        hs = tl.program_id(0)
        b = tl.program_id(1)
        b64 = b.to(tl.int64)
        count = tl.load(cnt_ptr + b).to(tl.int32)
        out_row = out_ptr + b64 * s_o_b + hs * s_o_h
        n_taken = tl.full([], 0, tl.int32)
        if count > 0:
            c_row = b64 * s_c_b + hs * s_c_h
            n_taken = _merge_segments(cv_ptr + c_row, ci_ptr + c_row, cv2_ptr + c_row, ci2_ptr + c_row, sn_ptr, sh_ptr,
                                      sl_ptr, (b * tl.num_programs(0) + hs) * n_seg, n_seg, seg_len, count, out_row,
                                      BLOCK_C)
        for x0 in range(n_taken, k_out, BLOCK_X):  # the unused tail: defined values, never read
            offs = x0 + tl.arange(0, BLOCK_X)
            tl.store(out_row + offs, tl.zeros([BLOCK_X], tl.int64), mask=offs < k_out)

    @triton.jit(do_not_specialize=["sink", "window", "n_units", "n_parts", "n_max", "k_out", "n_seg", "seg_len"])
    def _topk_rows_kernel(
        s_ptr, pm_ptr, pl_ptr, cnt_ptr, lens_ptr, gs_ptr, mx_ptr, cv_ptr, ci_ptr, out_ptr,
        tk_ptr, sn_ptr, sh_ptr, sl_ptr, cv2_ptr, ci2_ptr,
        sink, window, n_units, n_parts, n_max, k_out, n_seg, seg_len,
        s_s_b, s_s_h, s_p_b, s_p_h, s_g_b, s_g_h, s_x_b, s_x_h, s_c_b, s_c_h, s_o_b, s_o_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, SHARE: tl.constexpr, UNIT: tl.constexpr,
        BLOCK_X: tl.constexpr, BLOCK_XG: tl.constexpr, BLOCK_PART: tl.constexpr, PREFILTER: tl.constexpr,
        GROUP_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, SEGMENTED: tl.constexpr,
        TICKET: tl.constexpr = True, BOUND_BITS: tl.constexpr = 6,
    ):
        # BLOCK_X: units per chunk over the row; BLOCK_M over its maxima; BLOCK_C over the prefilter's
        # candidates (about k of them): short lists get narrow chunks, not a row-wide one mostly masked.
        # SEGMENTED (long rows): n_seg programs per row, each prefilters seg_len units of it; the last to
        # finish (a ticket counter it resets) selects among all their candidates, or (TICKET false) none of
        # them: _merge_rows_kernel, launched next, does.
        hs = tl.program_id(0)
        b = tl.program_id(1)
        b64 = b.to(tl.int64)
        count = tl.load(cnt_ptr + b).to(tl.int32)
        out_row = out_ptr + b64 * s_o_b + hs * s_o_h
        mx_row = mx_ptr + b64 * s_x_b + hs * s_x_h
        if SHARE:
            src = gs_ptr + b64 * s_g_b + hs * s_g_h
        else:
            src = s_ptr + b64 * s_s_b + hs * s_s_h
        if SHARE:
            length, sink_end, win_start = dense_range(lens_ptr, b, sink, window)
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = hs * G + offs_g
            lse, live_h = group_lse(pm_ptr, pl_ptr, b64 * s_p_b, heads, g_ok, n_parts, s_p_h, BLOCK_G,
                                     BLOCK_PART)
            for x0 in range(0, n_units, BLOCK_XG):
                offs_x = x0 + tl.arange(0, BLOCK_XG)
                x_ok = offs_x < n_units
                val = group_sum_tile(s_ptr, b64 * s_s_b, heads, g_ok, lse, live_h, offs_x, x_ok, s_s_h,
                                      sink_end, win_start, UNIT)
                tl.store(src + offs_x, val, mask=x_ok)
                mx = tl.max(tl.reshape(val, [BLOCK_XG // GROUP_MAX, GROUP_MAX]), axis=1)
                offs_m = x0 // GROUP_MAX + tl.arange(0, BLOCK_XG // GROUP_MAX)
                tl.store(mx_row + offs_m, mx, mask=offs_m < n_max)
            tl.debug_barrier()  # the rows written above are read back by other threads of this program
        n_taken = tl.full([], 0, tl.int32)
        if SEGMENTED:  # only the row's last program writes its list (or the first, for an empty row)
            seg = tl.program_id(2)
            if TICKET:
                writer = (count == 0) & (seg == 0)
            else:
                writer = count < 0  # none: the merge launch writes every row
        else:
            seg = 0
            writer = count >= 0
        if count > 0:
            if PREFILTER:
                # A lower bound of the answer: the count-th largest of a subset of the row (one unit per
                # group, its max) is at most the row's count-th largest. Only units at or above it can
                # be chosen; copying them out leaves the exact select a list near count long.
                bound = tl.zeros([], dtype=tl.uint32)
                m_need = tl.full([], 0, tl.int32)  # unused; assigned in both branches for the compiler
                m_hi, m_lo, m_fin = value_range(mx_row, n_max, BLOCK_M)
                if count <= m_fin:  # else the count-th largest maximum is −inf: every unit is a candidate
                    # BOUND_BITS 6: one pass, 6 bits below those the maxima share (the bound is a few % of the
                    # maxima's range low at most: some more candidates, for a pass less per program); 32:
                    # the exact count-th largest maximum (more passes per program, the fewest candidates
                    # for the row's one-program select)
                    bound, m_need = radix_select(mx_row, n_max, count, m_hi, m_lo, BOUND_BITS, BLOCK_M)
                cv = cv_ptr + b64 * s_c_b + hs * s_c_h
                ci = ci_ptr + b64 * s_c_b + hs * s_c_h
                n_cand = tl.full([], 0, tl.int32)
                hi = tl.zeros([BLOCK_X], dtype=tl.uint32)
                lo = tl.full([BLOCK_X], 0xFFFFFFFF, tl.uint32)
                x_lo = seg * seg_len
                if SEGMENTED:
                    x_hi = tl.minimum(n_units, x_lo + seg_len)
                else:
                    x_hi = n_units
                for x0 in range(x_lo, x_hi, BLOCK_X):
                    offs = x0 + tl.arange(0, BLOCK_X)
                    ok = offs < x_hi
                    v = tl.load(src + offs, mask=ok, other=float("-inf"))
                    u = ordered(v)
                    keep = ok & (u >= bound)
                    pos = x_lo + n_cand + tl.cumsum(keep.to(tl.int32), axis=0) - 1  # in the segment's region
                    tl.store(cv + pos, v, mask=keep)
                    tl.store(ci + pos, offs, mask=keep)
                    n_cand += tl.sum(keep.to(tl.int32), axis=0)
                    hi = tl.maximum(hi, u)
                    lo = tl.minimum(lo, tl.where(keep & (v > float("-inf")), u, 0xFFFFFFFF))
                hi_row = tl.max(hi, axis=0)
                lo_row = tl.min(lo, axis=0)
                if SEGMENTED:
                    sq = (b * tl.num_programs(0) + hs) * n_seg
                    tl.store(sn_ptr + sq + seg, n_cand)
                    tl.store(sh_ptr + sq + seg, hi_row.to(tl.int32, bitcast=True))
                    tl.store(sl_ptr + sq + seg, lo_row.to(tl.int32, bitcast=True))
                    # all threads' stores precede the release; the acquire of the last one sees them all
                    tl.debug_barrier()
                    if TICKET:
                        ticket = tl.atomic_add(tk_ptr + b * tl.num_programs(0) + hs, 1, sem="acq_rel",
                                               scope="gpu")
                        if ticket == n_seg - 1:
                            n_taken = _merge_segments(cv, ci, cv2_ptr + b64 * s_c_b + hs * s_c_h,
                                                      ci2_ptr + b64 * s_c_b + hs * s_c_h, sn_ptr, sh_ptr, sl_ptr,
                                                      sq, n_seg, seg_len, count, out_row, BLOCK_C)
                            writer = count > 0
                            tl.atomic_xchg(tk_ptr + b * tl.num_programs(0) + hs, 0)
                else:
                    tl.debug_barrier()  # the candidates written above are read back by other threads
                    thr, need = radix_select(cv, n_cand, count, hi_row, lo_row, 32, BLOCK_C)
                    n_taken = emit_selected(cv, ci, n_cand, thr, need, out_row, True, BLOCK_C)
            else:
                hi, lo, n_fin = value_range(src, n_units, BLOCK_X)
                thr, need = radix_select(src, n_units, count, hi, lo, 32, BLOCK_X)
                n_taken = emit_selected(src, src, n_units, thr, need, out_row, False, BLOCK_X)
        if writer:
            for x0 in range(n_taken, k_out, BLOCK_X):  # the unused tail: defined values, never read
                offs = x0 + tl.arange(0, BLOCK_X)
                tl.store(out_row + offs, tl.zeros([BLOCK_X], tl.int64), mask=offs < k_out)

    @triton.jit
    def _select_row_regs(v, offs, ok, count, out_row, k_out, XT: tl.constexpr):
        # The count best of the row v [XT] (entries with ok), ties to the lowest index, as an ascending
        # list at out_row, then zeros up to k_out.
        u = ordered(v)
        fin = ok & (v > float("-inf"))
        n_taken = tl.full([], 0, tl.int32)
        if count > 0:
            sel, pos = chosen_regs(u, ok, fin, count)
            tl.store(out_row + pos, offs.to(tl.int64), mask=sel)
            n_taken = tl.sum(sel.to(tl.int32), axis=0)
        for x0 in range(0, k_out, XT):  # the unused tail: defined values, never read
            at = x0 + offs
            tl.store(out_row + at, tl.zeros([XT], tl.int64), mask=(at >= n_taken) & (at < k_out))

    @triton.jit(do_not_specialize=["sink", "window", "n_units", "n_parts", "k_out", "n_chunks"])
    def _select_regs_kernel(
        s_ptr, pm_ptr, pl_ptr, cnt_ptr, lens_ptr, gs_ptr, tk_ptr, out_ptr,
        sink, window, n_units, n_parts, k_out, n_chunks,
        s_s_b, s_s_h, s_p_b, s_p_h, s_g_b, s_g_h, s_o_b, s_o_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, SHARE: tl.constexpr, UNIT: tl.constexpr, XT: tl.constexpr,
        CHUNK: tl.constexpr, BLOCK_PART: tl.constexpr,
    ):
        # One row per (selection head, batch row), held whole in registers (XT >= its units) by the
        # program that selects on it. SHARE (group-summed rows): n_chunks programs per row each group-sum
        # CHUNK units into a workspace row, and the last of them to finish (a ticket counter it resets)
        # selects; otherwise one program per row reads the scores row itself.
        hs = tl.program_id(1)
        b = tl.program_id(2)
        b64 = b.to(tl.int64)
        offs = tl.arange(0, XT)
        ok = offs < n_units
        out_row = out_ptr + b64 * s_o_b + hs * s_o_h
        if SHARE:
            c = tl.program_id(0)
            src = gs_ptr + b64 * s_g_b + hs * s_g_h
            length, sink_end, win_start = dense_range(lens_ptr, b, sink, window)
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = hs * G + offs_g
            lse, live_h = group_lse(pm_ptr, pl_ptr, b64 * s_p_b, heads, g_ok, n_parts, s_p_h, BLOCK_G,
                                     BLOCK_PART)
            offs_x = c * CHUNK + tl.arange(0, CHUNK)
            x_ok = offs_x < n_units
            val = group_sum_tile(s_ptr, b64 * s_s_b, heads, g_ok, lse, live_h, offs_x, x_ok, s_s_h,
                                  sink_end, win_start, UNIT)
            tl.store(src + offs_x, val, mask=x_ok)
            # all threads' stores precede the release; the acquire of the last one sees them all
            tl.debug_barrier()
            ticket = tl.atomic_add(tk_ptr + b * tl.num_programs(1) + hs, 1, sem="acq_rel", scope="gpu")
            if ticket == n_chunks - 1:
                tl.atomic_xchg(tk_ptr + b * tl.num_programs(1) + hs, 0)
                count = tl.load(cnt_ptr + b).to(tl.int32)
                # other programs wrote the row: read it through L2 (.cg), not this SM's L1
                v = tl.load(src + offs, mask=ok, other=float("-inf"), cache_modifier=".cg")
                _select_row_regs(v, offs, ok, count, out_row, k_out, XT)
        else:
            count = tl.load(cnt_ptr + b).to(tl.int32)
            v = tl.load(s_ptr + b64 * s_s_b + hs * s_s_h + offs, mask=ok, other=float("-inf"))
            _select_row_regs(v, offs, ok, count, out_row, k_out, XT)


def _warps(value, default: int) -> int:
    return default if value is None else check_launch_value("num_warps", value, high=32, pow2=True)



def topk_rows_triton(scores: torch.Tensor, counts: torch.Tensor, k: int, *, group: int = 1,
                     parts: tuple[torch.Tensor, torch.Tensor] | None = None, lengths: torch.Tensor | None = None,
                     unit: int = 1, sink: int = 0, window: int = 0, maxima: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, num_warps: int | None = None,
                     segment: int | None = None, merge: str = "ticket") -> torch.Tensor:
    """The ``counts[b]`` best units of each row as ``[B, Hs, k]`` int64, ascending, zero-padded (one
    launch). ``scores [B, Hq, X]`` float32 with a contiguous last dim; ``counts [B]`` with every
    ``counts[b] ≤ min(k, X)`` and at most the row's finite scores (what the scoring launches write).

    ``group = 1``: rows are ``scores``' rows as they are (``Hs = Hq``; non-candidates already −inf).
    ``group > 1``: rows are KV heads ranked by ``log Σ_g softmax_g(s)`` over their ``group`` query
    heads, computed in this launch; ``scores`` are −inf only past each row's length (``lengths`` int32
    ``[B]``), ``parts = (max, sum_exp) [B, Hq, n_blocks]`` from the scoring launch, and units without a
    key in ``[sink_end, window_start)`` (``unit`` keys each) are never chosen; this launch takes the
    rows' maxima itself and prefilters. ``maxima [B, Hs, ceil(X / GROUP_MAX)]`` (``group = 1``): the max
    of every ``GROUP_MAX`` units of each row, written by the scoring launch; without them the select runs
    on the whole row (six passes over it: fine for short rows only).

    Launch overrides (for tuning; None: the defaults below): ``num_warps`` (a power of two up to 32;
    default 8 for chunks of 2048 units or more, else 4); ``segment`` (default ``SEGMENT``): rows with
    ``maxima`` longer than this split their prefilter pass over up to one program per ``segment`` units
    (about two waves of programs at most); no effect on other rows; ``merge``: how a split row's
    candidates meet — ``"ticket"`` (the last of its programs to finish, by an atomic counter, selects:
    one launch) or ``"launch"`` (a second launch of one program per row: no counter, whose acquire-release
    atomics serialise the row's programs; a split row's prefilter bound is then the exact ``count``-th
    largest maximum, not 6 bits of it, for the fewest candidates). The selection does not depend on them."""
    b, hq, x = scores.shape
    segment = SEGMENT if segment is None else check_launch_value("segment", segment)
    if merge not in ("ticket", "launch"):
        raise ValueError(f"merge: expected 'ticket' or 'launch', got {merge!r}")
    check_score_rows(scores, group)
    share = group > 1
    if share and (parts is None or lengths is None):
        raise ValueError("parts and lengths: required when group > 1 (the group-summed ranking)")
    if share and maxima is not None:
        raise ValueError("maxima: only for rows of group = 1 (group_sum_rows_triton writes both)")
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    hs = hq // group
    if maxima is not None and (maxima.shape != (b, hs, cdiv(x, GROUP_MAX)) or maxima.stride(-1) != 1):
        raise ValueError(f"maxima: expected [{b}, {hs}, {cdiv(x, GROUP_MAX)}] with a contiguous last dim, "
                         f"got {tuple(maxima.shape)}")
    dev = scores.device
    if out is None:
        out = torch.empty(b, hs, k, device=dev, dtype=torch.int64)
    pm, pl = parts if share else (scores, scores)
    gs = scratch("select_gs", scores, (b, hs, x), torch.float32) if share else scores
    prefilter = share or maxima is not None
    if share:  # this launch group-sums the rows and takes their maxima on the way
        maxima = scratch("select_mx", scores, (b, hs, cdiv(x, GROUP_MAX)), torch.float32)
    mx = scores if maxima is None else maxima
    if prefilter:  # the prefilter's candidates: at most the whole row
        cv = scratch("select_cv", scores, (b, hs, x), torch.float32)
        ci = scratch("select_ci", scores, (b, hs, x), torch.int32)
    else:
        cv, ci = scores, scores
    # long rows: several programs per row share the prefilter's pass over it (see the kernel)
    n_seg = row_segments(b * hs, x, scores.device, segment=segment) if prefilter and not share and x > segment else 1
    segmented = n_seg > 1
    seg_len = cdiv(x, n_seg)
    if segmented:
        tickets = workspace("select_tickets", scores, b * hs, torch.int32, zeroed=True)
        seg_n, seg_hi, seg_lo = (scratch(f"select_seg_{t}", scores, (b, hs, n_seg), torch.int32)
                                 for t in ("n", "hi", "lo"))
        cv2 = scratch("select_cv2", scores, (b, hs, x), torch.float32)
        ci2 = scratch("select_ci2", scores, (b, hs, x), torch.int32)
    else:
        tickets = seg_n = seg_hi = seg_lo = counts
        cv2, ci2 = cv, ci
    block_g = max(2, next_pow2(group))
    block_x = min(4096, max(64, next_pow2(seg_len)))
    launch(_topk_rows_kernel, (hs, b, n_seg),
           scores, pm, pl, counts, counts if lengths is None else lengths, gs, mx, cv, ci, out,
           tickets, seg_n, seg_hi, seg_lo, cv2, ci2,
           sink, window, x, pm.shape[-1], mx.shape[-1], k, n_seg, seg_len,
           scores.stride(0), scores.stride(1), pm.stride(0), pm.stride(1), gs.stride(0), gs.stride(1),
           mx.stride(0), mx.stride(1), cv.stride(0), cv.stride(1), out.stride(0), out.stride(1),
           G=group, BLOCK_G=block_g, SHARE=share, UNIT=unit, BLOCK_X=block_x,
           BLOCK_XG=max(64, min(block_x, 4096 // block_g)), BLOCK_PART=max(64, 2048 // block_g),
           PREFILTER=prefilter, GROUP_MAX=GROUP_MAX, BLOCK_M=min(block_x, max(64, next_pow2(cdiv(x, GROUP_MAX)))),
           BLOCK_C=min(block_x, max(64, next_pow2(k))), SEGMENTED=segmented, TICKET=merge == "ticket",
           BOUND_BITS=32 if segmented and merge == "launch" else 6,
           num_warps=_warps(num_warps, 8 if block_x >= 2048 else 4), num_stages=1)
    if segmented and merge == "launch":
        launch(_merge_rows_kernel, (hs, b), counts, cv, ci, cv2, ci2, seg_n, seg_hi, seg_lo, out, n_seg, seg_len, k,
               cv.stride(0), cv.stride(1), out.stride(0), out.stride(1),
               BLOCK_C=min(block_x, max(64, next_pow2(k))), BLOCK_X=min(1024, max(64, next_pow2(k))), num_warps=8,
               num_stages=1)
    return out


# Rows of at most this many units are selected by _select_regs_kernel: the row whole in one program's
# registers (XT = next_pow2(units) values; 32 per thread at 8192 units with 8 warps, 16 warps beyond), the
# radix passes on them without reloading, one pass for the list. Quest's pages up to a 256k context. Each
# radix pass costs ~60 instructions per unit of the whole row (tl.histogram's ballots), so group-summed
# rows take it up to REGISTER_SELECT_GROUPED_MAX units only, where it beat topk_rows_triton with its
# group-sum launch on the H100 (docs/results/gpu-bench/2026-11-25-h100-quest-register-select.md).
REGISTER_SELECT_MAX = 16384
REGISTER_SELECT_GROUPED_MAX = 4096
# group-summed rows: about this many programs in all group-sum the rows (in chunks of at least
# REGISTER_CHUNK_MIN units) before the last of each row selects (one wave: ~200 registers per program)
REGISTER_PROGRAMS = 128
REGISTER_CHUNK_MIN = 64


def topk_rows_registers(scores: torch.Tensor, counts: torch.Tensor, k: int, *, group: int = 1,
                        parts: tuple[torch.Tensor, torch.Tensor] | None = None,
                        lengths: torch.Tensor | None = None, unit: int = 1, sink: int = 0, window: int = 0,
                        out: torch.Tensor | None = None, num_warps: int | None = None,
                        programs: int | None = None) -> torch.Tensor:
    """:func:`topk_rows_triton` (same arguments, less ``maxima``; same output: ascending, zero-padded,
    ties to the lowest index) for rows of at most ``REGISTER_SELECT_MAX`` units, in one launch.

    ``group = 1``: one program per row loads it whole into registers and selects there — a radix select
    whose passes read no memory and stop once the answer's bin is taken whole, then one cumulative sum
    writes the list. ``group > 1``: ``ceil(X / chunk)`` programs per row each group-sum a chunk of it from
    the partials (as :func:`group_sum_rows_triton`, so in parallel over the GPU) into a workspace row; the
    last of them to finish (a ticket counter, reset by it) loads the row and selects as above.

    Launch overrides (for tuning; None: the defaults): ``num_warps`` (a power of two up to 32; default 4
    below 2048 units, 8 up to 8192, 16 beyond); ``programs`` (group-summed rows; default
    ``REGISTER_PROGRAMS``): about this many programs in all group-sum the rows, in chunks of a power of
    two of at least ``REGISTER_CHUNK_MIN`` units. The selection does not depend on them."""
    b, hq, x = scores.shape
    programs = REGISTER_PROGRAMS if programs is None else check_launch_value("programs", programs)
    check_score_rows(scores, group)
    if x > REGISTER_SELECT_MAX:
        raise ValueError(f"scores: rows of at most {REGISTER_SELECT_MAX} units, got {x} (use topk_rows_triton)")
    share = group > 1
    if share and (parts is None or lengths is None):
        raise ValueError("parts and lengths: required when group > 1 (the group-summed ranking)")
    if k < 1:
        raise ValueError(f"k: expected >= 1, got {k}")
    hs = hq // group
    if out is None:
        out = torch.empty(b, hs, k, device=scores.device, dtype=torch.int64)
    xt = max(64, next_pow2(x))
    pm, pl = parts if share else (scores, scores)
    if share:
        gs = scratch("select_regs_gs", scores, (b, hs, x), torch.float32)
        tickets = workspace("select_regs_tickets", scores, b * hs, torch.int32, zeroed=True)
        per_row = max(1, programs // (b * hs))
        chunk = max(REGISTER_CHUNK_MIN, next_pow2(cdiv(x, per_row)))
        n_chunks = cdiv(x, chunk)
    else:
        gs, tickets, chunk, n_chunks = scores, counts, 64, 1
    block_g = max(2, next_pow2(group))
    launch(_select_regs_kernel, (n_chunks, hs, b),
           scores, pm, pl, counts, counts if lengths is None else lengths, gs, tickets, out,
           sink, window, x, pm.shape[-1], k, n_chunks,
           scores.stride(0), scores.stride(1), pm.stride(0), pm.stride(1), gs.stride(0), gs.stride(1),
           out.stride(0), out.stride(1),
           G=group, BLOCK_G=block_g, SHARE=share, UNIT=unit, XT=xt, CHUNK=chunk,
           BLOCK_PART=max(64, 2048 // block_g),
           num_warps=_warps(num_warps, 16 if xt > 8192 else (8 if xt >= 2048 else 4)), num_stages=1)
    return out


def group_sum_rows_triton(scores: torch.Tensor, group: int, parts: tuple[torch.Tensor, torch.Tensor],
                          lengths: torch.Tensor, unit: int, sink: int, window: int, *, block_x: int | None = None,
                          chunk: int | None = None, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log Σ_g softmax_g(s) [B, Hq/group, X], its maxima [B, Hq/group, ceil(X / GROUP_MAX)])`` in one
    launch spread over the row (for rows too long for :func:`topk_rows_triton` to group-sum in its one
    program per row): each head's log-sum-exp from ``parts`` (as there), units off ``[sink_end,
    window_start)`` at −inf.

    Launch overrides (for tuning; None: the defaults): ``block_x`` units per program (default 1024, 4096
    for rows of 64k units or more), taken ``chunk`` at a time (default ``2048 / group`` rounded up to a
    power of two, at least ``GROUP_MAX``): both powers of two, ``GROUP_MAX ≤ chunk ≤ block_x`` (each
    chunk's maxima cover whole groups; the chunks tile the block); ``num_warps`` a power of two up to 32 (8: Quest's
    call at 128k batch 1 64.5 → 63.6 µs against 4 on an H200, ``benchmarks/breakdown/launch_sweep.py --in-call``)."""
    b, hq, x = scores.shape
    pm, pl = parts
    hs = hq // group
    block_g = max(2, next_pow2(group))
    # short rows (pages) in small blocks, for programs enough to fill the GPU; long rows (keys) in big
    # ones, since every program reads all of its heads' softmax partials
    block_x = (4096 if x >= 65536 else 1024) if block_x is None else check_launch_value("block_x", block_x, pow2=True)
    chunk = max(GROUP_MAX, 2048 // block_g) if chunk is None else check_launch_value(
        "chunk", chunk, low=GROUP_MAX, high=block_x, pow2=True)
    if chunk > block_x:
        raise ValueError(f"block_x: expected at least the chunk of {chunk} units, got {block_x}")
    check_launch_value("num_warps", num_warps, high=32, pow2=True)
    out = scratch("select_rows", scores, (b, hs, x), torch.float32)
    maxima = scratch("select_rows_mx", scores, (b, hs, cdiv(x, GROUP_MAX)), torch.float32)
    launch(_group_sum_parts_kernel, (cdiv(x, block_x), hs, b),
           scores, pm, pl, lengths, out, maxima, sink, window, x, pm.shape[-1],
           scores.stride(0), scores.stride(1), pm.stride(0), pm.stride(1), out.stride(0), out.stride(1),
           maxima.stride(0), maxima.stride(1),
           G=group, BLOCK_G=block_g, UNIT=unit, BLOCK_X=block_x, CHUNK=chunk, BLOCK_PART=max(64, 2048 // block_g),
           GROUP_MAX=GROUP_MAX, num_warps=num_warps, num_stages=1)
    return out, maxima


# Group-summed rows longer than this get group_sum_rows_triton's parallel launch: in the select launch one
# program reads the group's G rows (~30 ops per unit and head, ~7 µs for 8192 pages × 4 heads by a cost
# model, vs ~2 µs of launch for the split); at Quest's 32k context (2048 pages) the fold wins, at 128k
# not. ``benchmarks/sparse_decode/run.py`` times both (quest-kv@group-sum-in-select / @split-group-sum).
ROW_GROUP_SUM_MAX = 4096
# With ``split=True`` (Quest), rows that would go to topk_rows_triton go to select_split.topk_rows_split when
# there are at most this many of them (batch × selection heads): one program per row leaves most of the GPU
# idle below ~1/4 of its SMs. 0 turns it off (the benchmarks time both).
SPLIT_ROWS_MAX = 32

SELECT_LAUNCHES = ("group_sum", "rows", "registers", "split", "radix")  # the launches select_rows takes overrides for
SELECTS = ("triton", "torch", "radix")  # select_rows' ways


def check_launch_opts(launch_opts: dict[str, dict] | None, names: tuple[str, ...]) -> dict[str, dict]:
    """``launch_opts`` (None: {}) after checking that it maps some of ``names`` to keyword dicts."""
    opts = dict(launch_opts or {})
    for name, kw in opts.items():
        if name not in names:
            raise ValueError(f"launch_opts: unknown launch {name!r} (expected some of {', '.join(names)})")
        if not isinstance(kw, dict):
            raise ValueError(f"launch_opts[{name!r}]: expected a dict of keyword arguments, got {kw!r}")
    return opts


def select_launches(n_units: int, group: int, share_kv_group: bool, select: str = "triton", *,
                    rows: int | None = None) -> tuple[str, ...]:
    """The launches :func:`select_rows` runs after the scoring one for rows of ``n_units`` units and GQA
    groups of ``group`` query heads (as its ``launch_opts`` name them): ``("registers",)``, ``("rows",)``
    or ``("group_sum", "rows")``; with ``select="torch"`` ``("group_sum",)`` or none (then ``torch.topk``);
    with ``select="radix"`` ``("radix",)`` after ``"group_sum"`` for group-summed rows.
    ``rows`` (batch × selection heads; None: no split select): where ``"rows"`` would run for at most
    ``SPLIT_ROWS_MAX`` rows, ``"split"`` (:func:`~kvsieve.kernels.shared.select_split.topk_rows_split`, its
    group sum, if any, in the parallel launch) runs instead. Read from the module limits at call time (the
    benchmarks change them)."""
    share = share_kv_group and group > 1
    if select == "radix":
        return (("group_sum",) if share else ()) + ("radix",)
    limit = min(REGISTER_SELECT_MAX, REGISTER_SELECT_GROUPED_MAX) if share else REGISTER_SELECT_MAX
    if select == "triton" and n_units <= limit:
        return ("registers",)
    if select == "triton" and rows is not None and rows <= SPLIT_ROWS_MAX:
        return (("group_sum",) if share else ()) + ("split",)
    split = share and (select == "torch" or n_units > ROW_GROUP_SUM_MAX)
    return (("group_sum",) if split else ()) + (("rows",) if select == "triton" else ())


def select_rows(score, *, batch: int, heads: int, kv_heads: int, n_units: int, k: int, block: int,
                share_kv_group: bool, lengths: torch.Tensor, unit: int, sink: int, window: int, select: str,
                device, launch_opts: dict[str, dict] | None = None,
                keep_scores: bool = False, split: bool = False) -> tuple[torch.Tensor, ...]:
    """The device selection shared by Quest (pages) and oracle-topk (keys): ``score(counts=, parts=,
    maxima=, mask_dense=, out=)`` is the scoring launch (writing the row counts and, as asked, the softmax
    partials of its ``block``-unit blocks and the maxima); returns ``(indices [B, Hs, k], counts [B,
    Hs])`` (an expanded view of ``[B]``).

    ``select="triton"``: :func:`topk_rows_triton` (ascending order) — 2 launches with the scoring one,
    3 for group-summed rows longer than ``ROW_GROUP_SUM_MAX``. ``select="radix"``: the group sum (if any) in
    one parallel launch, then :func:`~kvsieve.kernels.shared.select_radix.topk_rows_radix` (ascending; a radix
    select spread over many programs per row, for long rows). ``select="torch"``: the group sum (if any)
    from the partials in one parallel launch, then ``torch.topk`` (sorted, highest first: rows whose count
    is below ``k`` read the first ``count`` entries) — kept to compare.

    ``launch_opts``: launch overrides by launch, for tuning — ``"group_sum"``: keywords of
    :func:`group_sum_rows_triton`, ``"rows"``: of :func:`topk_rows_triton` (``num_warps``, ``segment``),
    ``"registers"``: of :func:`topk_rows_registers` (``num_warps``, ``programs``), ``"split"``: of
    :func:`~kvsieve.kernels.shared.select_split.topk_rows_split` (``programs``, ``num_warps``), ``"radix"``: of
    :func:`~kvsieve.kernels.shared.select_radix.topk_rows_radix` (``chunk``, ``programs``, ``num_warps``,
    ``digit_bits``, ``hist_mask``); each applies
    where its launch runs. The selection does not depend on them.

    ``split``: few rows (at most ``SPLIT_ROWS_MAX``) that would take ``topk_rows_triton`` take the split
    select (:func:`select_launches`); same indices."""
    if select not in SELECTS:
        raise ValueError(f"select: expected one of {', '.join(SELECTS)}, got {select!r}")
    opts = check_launch_opts(launch_opts, SELECT_LAUNCHES)
    group = heads // kv_heads
    # one query head per KV head: log softmax ranks as the scores do, and the rows are the same
    share_kv_group = share_kv_group and group > 1
    launches = select_launches(n_units, group, share_kv_group, select,
                               rows=batch * (kv_heads if share_kv_group else heads) if split else None)
    registers = "registers" in launches
    counts = torch.empty(batch, device=device, dtype=torch.int64)
    parts = maxima = None
    if share_kv_group:
        n_blocks = cdiv(n_units, block)
        parts = (scratch("select_pm", counts, (batch, heads, n_blocks), torch.float32),
                 scratch("select_pl", counts, (batch, heads, n_blocks), torch.float32))
    elif select == "triton" and not registers:
        maxima = scratch("select_scores_mx", counts, (batch, heads, cdiv(n_units, GROUP_MAX)), torch.float32)
    s = score(counts=counts, parts=parts, maxima=maxima, mask_dense=not share_kv_group,
              out=scratch("select_scores", counts, (batch, heads, n_units), torch.float32))
    if registers:
        idx = topk_rows_registers(s, counts, k, group=group if share_kv_group else 1, parts=parts, lengths=lengths,
                                  unit=unit, sink=sink, window=window, **opts.get("registers", {}))
        return (idx, counts[:, None].expand(batch, idx.shape[1])) + ((s,) if keep_scores else ())
    scored = s
    if "group_sum" in launches:
        s, maxima = group_sum_rows_triton(s, group, parts, lengths, unit, sink, window, **opts.get("group_sum", {}))
        share_kv_group = False
    if select == "torch":  # sorted: a row whose count is below k takes the first count entries
        idx = torch.topk(s, k, dim=-1, sorted=True).indices
    elif select == "radix":
        idx = topk_rows_radix(s, counts, k, **opts.get("radix", {}))
    elif "split" in launches:
        idx = topk_rows_split(s, counts, k, maxima=maxima, **opts.get("split", {}))
    else:
        idx = topk_rows_triton(s, counts, k, group=group if share_kv_group else 1, parts=parts, lengths=lengths,
                               unit=unit, sink=sink, window=window, maxima=maxima, **opts.get("rows", {}))
    return (idx, counts[:, None].expand(batch, idx.shape[1])) + ((scored,) if keep_scores else ())


__all__ = ["GROUP_MAX", "REGISTER_SELECT_MAX", "ROW_GROUP_SUM_MAX", "SELECTS", "SELECT_LAUNCHES", "SPLIT_ROWS_MAX",
           "check_launch_opts", "group_sum_rows_triton", "select_launches", "select_rows", "topk_rows_reference",
           "topk_rows_registers", "topk_rows_triton"]
