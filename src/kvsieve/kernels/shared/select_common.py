"""The pieces the select launches are built from (``select_triton.py``, ``oracle_topp/topp_triton.py``,
``sketchwalk/``): Triton device functions — the order-preserving 32-bit image of float scores, the radix
select of the ``count``-th largest (over a row in memory or in registers), the emit pass, the GQA group sum
of softmax rows from per-block partials, the scoring launches' partials and maxima — and the host helpers
(cached scratch buffers, input and launch-override checks, how many programs split a long row)."""

from __future__ import annotations

import torch

from .triton_utils import cdiv, triton, workspace

if triton is not None:
    import triton.language as tl

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
    def store_maxima(mx_ptr, b64, heads, g_ok, blk, s_x_b, s_x_h, s, n_units, BLOCK_X: tl.constexpr,
                     BLOCK_G: tl.constexpr, GROUP: tl.constexpr):
        """The max of every ``GROUP`` units of block ``blk``'s scores ``s [BLOCK_G, BLOCK_X]`` (the select
        kernel's prefilter subset)."""
        mx = tl.max(tl.reshape(s, [BLOCK_G, BLOCK_X // GROUP, GROUP]), axis=2)
        offs_m = blk * (BLOCK_X // GROUP) + tl.arange(0, BLOCK_X // GROUP)
        tl.store(mx_ptr + b64 * s_x_b + heads[:, None] * s_x_h + offs_m[None, :], mx,
                 mask=g_ok[:, None] & (offs_m * GROUP < n_units)[None, :])

    @triton.jit
    def ordered(v):
        # float32 -> uint32 with the same order (non-NaN): flip the magnitude bits of negatives, then
        # the sign bit, so unsigned comparisons and radix digits follow the float order.
        bits = v.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return key.to(tl.uint32, bitcast=True) ^ 0x80000000

    @triton.jit
    def high_bits(u, shift):
        # u >> shift for a runtime shift in [0, 32] (a shift by 32 is undefined in LLVM: 0 here)
        return tl.where(shift < 32, u >> tl.minimum(shift, 31).to(tl.uint32), 0)

    @triton.jit
    def bit_length(x):
        # the bit length of a uint32 scalar (0 for 0)
        n = tl.full([], 0, tl.int32)
        for bit in tl.static_range(32):
            n = tl.where(((x >> bit) & 1) != 0, bit + 1, n)
        return n

    @triton.jit
    def value_range(src, n_units, BLOCK_X: tl.constexpr):
        """The ordered images of the largest and of the smallest finite value of ``src[:n_units]``, and how
        many values are finite (> −inf)."""
        # elementwise accumulators: one block-wide reduction each at the end, not one per chunk
        hi = tl.zeros([BLOCK_X], dtype=tl.uint32)
        lo = tl.full([BLOCK_X], 0xFFFFFFFF, tl.uint32)
        n_fin = tl.zeros([BLOCK_X], dtype=tl.int32)
        for x0 in range(0, n_units, BLOCK_X):
            offs = x0 + tl.arange(0, BLOCK_X)
            ok = offs < n_units
            v = tl.load(src + offs, mask=ok, other=float("-inf"))
            u = ordered(v)
            fin = v > float("-inf")
            hi = tl.maximum(hi, u)
            lo = tl.minimum(lo, tl.where(fin, u, 0xFFFFFFFF))
            n_fin += fin.to(tl.int32)
        return tl.max(hi, axis=0), tl.min(lo, axis=0), tl.sum(n_fin, axis=0)

    @triton.jit
    def take_bin(hist, bins, need, prefix, low):
        """One radix step: the highest bin of ``hist`` (over ``bins``) at or above which ``need`` values lie
        becomes the digit at bit ``low`` of ``prefix``; returns the new prefix, how many of that bin are
        still needed, and how many values the bin holds."""
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        d = tl.max(tl.where(at_or_above >= need, bins, 0), axis=0)
        need -= tl.sum(tl.where(bins > d, hist, 0), axis=0)
        in_bin = tl.sum(tl.where(bins == d, hist, 0), axis=0)
        return prefix | (d.to(tl.uint32) << low.to(tl.uint32)), need, in_bin

    @triton.jit
    def radix_select(src, n_units, count, hi, lo, KEEP: tl.constexpr, BLOCK_X: tl.constexpr):
        """Radix select of the ``count``-th largest of ``src[:n_units]``, whose ordered image lies in
        ``[lo, hi]`` (1 ≤ count ≤ the values in that range): returns its image with only the top ``KEEP``
        bits that differ between lo and hi resolved (the rest 0: a lower bound; KEEP ≥ 32 gives it
        exactly) and how many values equal to that are among the ``count`` largest (exact case).

        Bits shared by lo and hi are skipped (for the prefilter's candidates, sign and most exponent
        bits), so no pass sorts nearly every value into one bin; each pass then resolves 6 bits with a
        64-bin histogram (Triton's histogram costs grow with the bins, per element)."""
        top = bit_length(hi ^ lo)
        prefix = tl.where(top < 32, (hi >> tl.minimum(top, 31).to(tl.uint32)) << tl.minimum(top, 31).to(tl.uint32), 0)
        stop = tl.maximum(top - KEEP, 0)
        need = count
        bins = tl.arange(0, 64)
        shift = top
        while shift > stop:
            low = tl.maximum(shift - 6, stop)
            width = shift - low
            hist = tl.zeros([64], dtype=tl.int32)
            n_off = tl.zeros([BLOCK_X], dtype=tl.int32)
            for x0 in range(0, n_units, BLOCK_X):
                offs = x0 + tl.arange(0, BLOCK_X)
                ok = offs < n_units
                u = ordered(tl.load(src + offs, mask=ok, other=float("-inf")))
                active = ok & (high_bits(u, shift) == high_bits(prefix, shift))
                digit = tl.where(active, (u >> low.to(tl.uint32)) & ((1 << width) - 1).to(tl.uint32), 0).to(tl.int32)
                hist += tl.histogram(digit, 64)
                n_off += (~active).to(tl.int32)
            # inactive values were counted in bin 0: take them out (portable; no histogram mask needed)
            hist -= tl.where(bins == 0, tl.sum(n_off, axis=0), 0)
            prefix, need, in_bin = take_bin(hist, bins, need, prefix, low)
            shift = low
        return prefix, need

    @triton.jit
    def emit_selected(src, idx_src, n_units, thr, need, out_row, HAS_IDX: tl.constexpr, BLOCK_X: tl.constexpr):
        # Units above thr and the first `need` equal to it, in src order, to out_row (their index: the
        # unit's position, or idx_src's entry); returns how many were written.
        n_taken = tl.full([], 0, tl.int32)
        ties = tl.full([], 0, tl.int32)
        for x0 in range(0, n_units, BLOCK_X):
            offs = x0 + tl.arange(0, BLOCK_X)
            ok = offs < n_units
            u = ordered(tl.load(src + offs, mask=ok, other=float("-inf")))
            eq = (ok & (u == thr)).to(tl.int32)
            sel = (ok & (u > thr)) | ((eq != 0) & (ties + tl.cumsum(eq, axis=0) <= need))
            pos = n_taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            if HAS_IDX:
                idx = tl.load(idx_src + offs, mask=sel, other=0).to(tl.int64)
            else:
                idx = offs.to(tl.int64)
            tl.store(out_row + pos, idx, mask=sel)
            n_taken += tl.sum(sel.to(tl.int32), axis=0)
            ties += tl.sum(eq, axis=0)
        return n_taken

    @triton.jit
    def group_sum_tile(s_ptr, row, heads, g_ok, lse, live_h, offs_x, x_ok, s_s_h, sink_end, win_start,
                        UNIT: tl.constexpr):
        # log Σ_g softmax_g(s)[x] for the units offs_x, −inf off the candidates [sink_end, win_start)
        sc = tl.load(s_ptr + row + heads[:, None] * s_s_h + offs_x[None, :],
                     mask=g_ok[:, None] & x_ok[None, :], other=float("-inf"))
        live = (sc > float("-inf")) & live_h[:, None]
        logp = tl.where(live, sc - lse[:, None], float("-inf"))
        m = tl.max(logp, axis=0)
        m_ref = tl.where(m > float("-inf"), m, 0.0)
        total = tl.sum(tl.where(live, tl.exp(logp - m_ref[None, :]), 0.0), axis=0)
        val = tl.where(total > 0, m_ref + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        start = offs_x * UNIT
        return tl.where((start < win_start) & (start + UNIT > sink_end), val, float("-inf"))

    @triton.jit
    def group_lse(pm_ptr, pl_ptr, prow, heads, g_ok, n_parts, s_p_h, BLOCK_G: tl.constexpr,
                   BLOCK_PART: tl.constexpr):
        # each group head's log-sum-exp over all its valid units, from the scoring launch's block partials
        m_run = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_run = tl.zeros([BLOCK_G], tl.float32)
        for p0 in range(0, n_parts, BLOCK_PART):
            offs_p = p0 + tl.arange(0, BLOCK_PART)
            at = prow + heads[:, None] * s_p_h + offs_p[None, :]
            ok = g_ok[:, None] & (offs_p < n_parts)[None, :]
            pm = tl.load(pm_ptr + at, mask=ok, other=float("-inf"))
            pl = tl.load(pl_ptr + at, mask=ok, other=0.0)
            m_new = tl.maximum(m_run, tl.max(pm, axis=1))
            ref = tl.where(m_new > float("-inf"), m_new, 0.0)
            l_run = l_run * tl.exp(m_run - ref) + tl.sum(pl * tl.exp(pm - ref[:, None]), axis=1)
            m_run = m_new
        live_h = l_run > 0
        return tl.where(live_h, m_run + tl.log(tl.where(live_h, l_run, 1.0)), 0.0), live_h

    @triton.jit
    def digit_step(h_row, j, prefix, need, shift, BITS: tl.constexpr):
        """Digit ``j``'s histogram (``2**BITS`` counts at ``h_row + j · 2**BITS``) applied to the state
        ``(prefix, need, shift)`` of :func:`replay_digits` where the search is still on at that digit."""
        bins = tl.arange(0, 1 << BITS)
        live = shift == 32 - j * BITS
        low = tl.maximum(shift - BITS, 0)
        hist = tl.load(h_row + j * (1 << BITS) + bins)
        p_new, n_new, in_bin = take_bin(hist, bins, need, prefix, low)
        prefix = tl.where(live, p_new, prefix)
        need = tl.where(live, n_new, need)
        shift = tl.where(live, tl.where(in_bin == n_new, 0, low), shift)
        return prefix, need, shift

    @triton.jit
    def replay_digits(h_row, count, PASSES: tl.constexpr, BITS: tl.constexpr):
        """The state of a radix select of the ``count``-th largest after ``PASSES`` row-wide histograms of
        ``BITS``-bit digits from the top (``h_row``: ``PASSES × 2**BITS`` counts, pass after pass; a pass
        after the answer's bin was taken whole counted nothing and is not read): ``(prefix, need, shift)``
        — the bits above ``shift`` resolved (``shift = 32 − PASSES·BITS`` while the search goes on), ``need``
        how many of the values with that prefix are still to take; ``shift = 0`` once a bin was taken whole
        (``prefix`` its low end, ``need`` all of it, as :func:`radix_select_regs` stops)."""
        prefix = tl.zeros([], dtype=tl.uint32)
        need = count
        shift = tl.full([], 32, tl.int32)
        for j in tl.static_range(PASSES):
            prefix, need, shift = digit_step(h_row, j, prefix, need, shift, BITS)
        return prefix, need, shift

    @triton.jit
    def radix_select_regs(u, valid, count, hi, lo):
        """:func:`radix_select` (exact) on a row held in registers: ``u`` the ordered images, ``valid`` which
        entries count. Stops as soon as the bin holding the answer is taken whole (its count equals what is
        still needed): the returned threshold is then the bin's low end (its lower bits 0), at most the
        answer, and ``need`` covers every unit equal to it, so the emit step takes exactly the bin and
        all above it."""
        top = bit_length(hi ^ lo)
        prefix = tl.where(top < 32, (hi >> tl.minimum(top, 31).to(tl.uint32)) << tl.minimum(top, 31).to(tl.uint32), 0)
        need = count
        bins = tl.arange(0, 64)
        shift = top
        while shift > 0:
            low = tl.maximum(shift - 6, 0)
            width = shift - low
            active = valid & (high_bits(u, shift) == high_bits(prefix, shift))
            digit = tl.where(active, (u >> low.to(tl.uint32)) & ((1 << width) - 1).to(tl.uint32), 0).to(tl.int32)
            hist = tl.histogram(digit, 64)
            # inactive values were counted in bin 0: take them out (portable; no histogram mask needed)
            n_act = tl.sum(active.to(tl.int32), axis=0)
            hist -= tl.where(bins == 0, digit.shape[0] - n_act, 0)
            prefix, need, in_bin = take_bin(hist, bins, need, prefix, low)
            shift = tl.where(in_bin == need, 0, low)
        return prefix, need

    @triton.jit
    def chosen_regs(u, valid, fin, count):
        """The ``count`` (≥ 1) largest of a row held in registers, ties to the lowest index: ``u`` the ordered
        images (:func:`ordered`), ``valid`` the entries that count, ``fin`` those of them that are finite
        (at least ``count``). Returns ``(sel, pos)``: which entries are chosen, and each one's place in the
        ascending list of the chosen (a cumulative sum, so in index order)."""
        hi = tl.max(tl.where(valid, u, 0), axis=0)
        lo = tl.min(tl.where(fin, u, 0xFFFFFFFF), axis=0)
        thr, need = radix_select_regs(u, valid, count, hi, lo)
        eq = (valid & (u == thr)).to(tl.int32)
        sel = (valid & (u > thr)) | ((eq != 0) & (tl.cumsum(eq, axis=0) <= need))
        return sel, tl.cumsum(sel.to(tl.int32), axis=0) - 1


def scratch(tag: str, like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A per-device cached buffer viewed as ``shape`` (``triton_utils.workspace``): an eager call allocates
    nothing but its outputs. Calls on one device must not overlap in time (as the sparse kernel's)."""
    numel = 1
    for n in shape:
        numel *= n
    return workspace(tag, like, numel, dtype)[:numel].view(shape)


def check_score_rows(scores: torch.Tensor, group: int) -> None:
    """The select launches' input: float32 score rows with a contiguous last dim, ``group`` dividing them."""
    hq = scores.shape[1]
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores: expected float32 with a contiguous last dim, got {scores.dtype}, "
                         f"strides {tuple(scores.stride())}")
    if group < 1 or hq % group:
        raise ValueError(f"group: expected a divisor of the {hq} score rows, got {group}")


SEGMENT = 8192  # rows longer than this split their prefilter pass over programs (oracle-topk's keys)
GROUP_MAX = 8  # units per maximum in the prefilter's subset (oracle-topk: N/8 maxima per row)
_SMS: dict = {}


def sm_count(device) -> int:
    """The device's SM count (132, an H100's, off CUDA: the interpreter's launches are sized as on one)."""
    if device.type != "cuda":
        return 132
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def check_launch_value(name: str, value, *, low: int = 1, high: int | None = None, pow2: bool = False):
    """A launch override (an int of at least ``low``, at most ``high``, a power of two if ``pow2``) or a
    ValueError naming it; returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high) \
            or (pow2 and value & (value - 1)):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected {'a power of two ' if pow2 else 'an int '}in {bound}, got {value!r}")
    return value


def row_segments(rows: int, x: int, device, *, segment: int = SEGMENT, waves: int = 2) -> int:
    """Programs per row for a pass split over a long row: one per ``segment`` units, fewer when there are
    many rows — at most about ``waves`` programs per SM in all. The prefilter here takes two, since each
    program also derives the bound from the row's maxima (that work repeats per program)."""
    return max(1, min(cdiv(x, segment), (waves * sm_count(device)) // max(rows, 1)))
