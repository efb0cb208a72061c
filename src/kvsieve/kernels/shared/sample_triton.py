"""A uniform sample without replacement on the device in one Triton launch (``random``'s, vAttention's and
MagicPIG's samples).

The references (``methods/shared/selection.uniform_sample``) give every available key ``j`` of a row the
uniform ``u = hash(row key, stream, h·2^22 + j) / 2^24`` (``core.rng.RowStreams``) and take the ``size``
smallest: ``torch.topk`` over the whole row (N keys), which at 5% of 32k–128k keys is a sort of the
row in 10–30 launches, after ~25 elementwise launches that build ``u``. Here one program per (row,
selection head):

1. hashes its available keys (a range ``[start, end)`` of positions, optionally minus excluded pages) in
   registers — ``u`` is never written — and copies out the keys whose 24-bit hash lies below a
   threshold a few standard deviations above the expected ``size``-th smallest
   (``(size + 4√size + 16) / n_avail``), in position order; if fewer than ``size`` pass (rare), every
   available key is taken as a candidate instead, so the result is exact whatever the draws;
2. finds the ``size``-th smallest hash among the candidates by bisection over the 24 bits (in registers
   when the candidates fit one block);
3. writes the keys below it and the first needed keys equal to it (ties to the lowest position), in
   ascending position order, then zeros up to the list's width, and the weights ``n_avail / size``.

The windowed cut (``sample_cut_triton`` always; ``sample_rows_triton`` where its caller asks, by default where the
scan is split over programs) finds it otherwise: the count of hashes below ``t`` is binomial, so the ``size``-th
smallest lies, but for a 6-sigma event, in a window of ``≈ 12 √(size (1 − size/n_avail)) + 32`` keys around ``size /
n_avail · 2^24`` (:func:`_window`). A launch spread over the row counts each chunk's keys below the window and
appends those inside it to the row's list (a relaxed atomic counter per row; the cut needs no order); one program
per (row, head) loads that list into registers (a few thousand keys where the one-program select's candidates are
``size``: 64k for vAttention's residual sample at 128k keys), bisects for the cut, and gives each chunk its place in
the output; a third launch spread over the row writes the chosen keys in position order (none for the cut alone).
Where the window misses the cut, or holds more than ``WINDOW_BLOCK`` keys, that program takes every available key
instead (the radix passes above): the same keys, whatever the draws.

Equal to the reference as a set up to ties of the 24-bit hash at the cut (``torch.topk`` breaks them
in no specified order): :func:`sample_rows_reference` is the twin with ties to the lowest position.
"""

from __future__ import annotations

import torch

from ...core.rng import GOLDEN, MASK32, POSITION_BITS, RandomKey, hash_bits, mix32, seed_words
from .triton_utils import cdiv, is_interpreted, launch, next_pow2, triton, workspace

CAND_BLOCK = 8192  # candidates kept in registers for the bisection (≈ 5% of 128k keys plus slack)
WINDOW_SIGMAS = 6.0  # the window's half-width in standard deviations of the cut's count
WINDOW_BLOCK = 8192  # window keys the cut launch holds in registers (≈ 12σ + 32: σ up to ~680 keys)
#: programs of the split scan in all (4 per H100 SM): a row of ``N`` keys is scanned by
#: ``ceil(SPLIT_PROGRAMS / (rows · heads))`` programs (at least two blocks of keys each)
SPLIT_PROGRAMS = 528


def sample_rows_reference(lo: torch.Tensor, hi: torch.Tensor, stream: int, start: torch.Tensor, end: torch.Tensor,
                          size: torch.Tensor, width: int, n_keys: int, excluded: torch.Tensor | None = None,
                          page: int = 1) -> torch.Tensor:
    """``[R, Hs, width]`` int64: the ``size [R, Hs]`` positions of ``[start, end) [R]`` (minus the pages
    marked in ``excluded [R, Hs, P]``) with the smallest hash under row words ``lo, hi [R]``, ascending,
    ties to the lowest position, then zeros — what :func:`sample_rows_triton` writes."""
    r, hs = size.shape
    pos = torch.arange(n_keys, device=size.device)
    c = (torch.arange(hs, device=size.device)[:, None] << POSITION_BITS) + pos[None, :]
    h = hash_bits(lo.view(r, 1, 1), hi.view(r, 1, 1), stream, c[None]) >> 8  # [R, Hs, N]
    ok = (pos >= start.view(r, 1, 1)) & (pos < end.view(r, 1, 1))
    if excluded is not None:
        ok = ok & ~excluded[:, :, pos // page]
    key = torch.where(ok, (h << POSITION_BITS) + pos, torch.iinfo(torch.int64).max)  # unique: no ties
    k = min(width, n_keys)
    chosen = torch.topk(key, k, dim=-1, largest=False, sorted=True).values & ((1 << POSITION_BITS) - 1)
    take = torch.arange(k, device=size.device) < size[..., None]
    out = torch.where(take, chosen, n_keys).sort(-1).values
    out = torch.where(out < n_keys, out, 0)
    return torch.nn.functional.pad(out, (0, width - k))


if triton is not None:
    import triton.language as tl

    from .triton_utils import hash_mix32

    @triton.jit
    def _mix32u(x):
        # core.rng.mix32 in uint32 arithmetic: products wrap mod 2^32 natively (no int64 emulation)
        x = x ^ (x >> 16)
        x = x * tl.full([], 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full([], 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def hash24(lo, hi, stream_key, counter):
        """``core.rng.hash_bits(lo, hi, stream, counter) >> 8`` as int64 (``stream_key`` = stream·golden)."""
        x = counter.to(tl.uint32)
        x = _mix32u(x ^ lo.to(tl.uint32))
        x = _mix32u(x ^ hi.to(tl.uint32))
        x = _mix32u(x ^ tl.full([], stream_key, tl.int64).to(tl.uint32))
        return (x >> 8).to(tl.int64)

    @triton.jit
    def _threshold(size, n_av):
        """The prefilter's 24-bit threshold: a few standard deviations above the expected ``size``-th
        smallest of ``n_av`` uniforms (every key when ``size >= n_av``)."""
        sz = size.to(tl.float32)
        thr_f = (sz + 4.0 * tl.sqrt(sz) + 16.0) / tl.maximum(n_av, 1).to(tl.float32) * 16777216.0
        thr = tl.minimum(thr_f, 16777216.0).to(tl.int64)
        return tl.where(size >= n_av, 16777216, thr).to(tl.int64)

    @triton.jit
    def _block_hashes(lo, hi, stream_key, base_c, b0, end, excl_ptr, r, h, s_x_r, s_x_h, n_pages,
                      PAGE: tl.constexpr, HAS_EXCL: tl.constexpr, BLOCK: tl.constexpr):
        """Positions ``b0 + [0, BLOCK)``, which of them are available (below ``end``, page not excluded) and
        their 24-bit hashes."""
        pos = b0 + tl.arange(0, BLOCK)
        ok = pos < end
        if HAS_EXCL:
            pg = pos // PAGE
            ex = tl.load(excl_ptr + r.to(tl.int64) * s_x_r + h * s_x_h + pg, mask=ok & (pg < n_pages), other=0)
            ok = ok & (ex == 0)
        return pos, ok, hash24(lo, hi, stream_key, base_c + pos)

    @triton.jit
    def _candidates(cand, lo, hi, stream_key, base_c, start, end, thr, size, excl_ptr, r, h, s_x_r, s_x_h,
                    n_pages, PAGE: tl.constexpr, HAS_EXCL: tl.constexpr, BLOCK: tl.constexpr,
                    WRITE: tl.constexpr = True):
        """Copy the available keys of ``[start, end)`` whose hash is below ``thr`` to ``cand`` as
        ``hash << 22 | position``, in position order (``WRITE=False``: count them only); returns how many."""
        cnt = tl.zeros([], tl.int32)
        if size > 0:
            for b0 in range(start, end, BLOCK):
                pos, ok, hv = _block_hashes(lo, hi, stream_key, base_c, b0, end, excl_ptr, r, h, s_x_r, s_x_h,
                                            n_pages, PAGE, HAS_EXCL, BLOCK)
                keep = ok & (hv < thr)
                ki = keep.to(tl.int32)
                if WRITE:
                    dest = cnt + tl.cumsum(ki, 0) - 1
                    tl.store(cand + dest, (hv << 22) | pos.to(tl.int64), mask=keep)
                cnt += tl.sum(ki, 0)
        return cnt

    @triton.jit
    def _row_params(lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, r, h, hs, s_sz_r, s_sz_h, s_nav_r,
                    s_nav_h):
        """Row ``r``, head ``h``: the flat index, the key's words, the range ``[start, end)``, the sample
        size (clamped to ``[0, n_av]``) and the available keys ``n_av``."""
        rh = r.to(tl.int64) * hs + h
        lo = tl.load(lo_ptr + r)
        hi = tl.load(hi_ptr + r)
        start = tl.load(start_ptr + r).to(tl.int32)
        end = tl.load(end_ptr + r).to(tl.int32)
        size = tl.load(size_ptr + r.to(tl.int64) * s_sz_r + h * s_sz_h).to(tl.int32)
        n_av = tl.load(nav_ptr + r.to(tl.int64) * s_nav_r + h * s_nav_h).to(tl.int32)
        size = tl.maximum(tl.minimum(size, n_av), 0)
        return rh, lo, hi, start, end, size, n_av

    @triton.jit
    def _radix_smallest24(cand, cnt, size, BLOCK: tl.constexpr):
        """The ``size``-th smallest (1 ≤ size ≤ cnt) 24-bit hash of the ``cnt`` candidates at ``cand``
        (``hash << 22 | position``): four passes, each a 64-bin histogram of the next 6 bits of the values
        that match the bits found so far (in place of 24 bisection passes over a long list)."""
        PAD: tl.constexpr = 1 << 46
        bins = tl.arange(0, 64)
        prefix = tl.zeros([], tl.int64)
        need = size
        for p in tl.static_range(4):
            shift = 18 - 6 * p
            hist = tl.zeros([64], tl.int32)
            n_off = tl.zeros([], tl.int32)
            for c0 in range(0, cnt, BLOCK):
                co = c0 + tl.arange(0, BLOCK)
                hv = tl.load(cand + co, mask=co < cnt, other=PAD) >> 22
                active = (co < cnt) & ((hv >> (shift + 6)) == (prefix >> (shift + 6)))
                hist += tl.histogram(tl.where(active, (hv >> shift) & 63, 0).to(tl.int32), 64)
                n_off += tl.sum((~active).to(tl.int32), 0)
            hist -= tl.where(bins == 0, n_off, 0)  # inactive values were counted in bin 0
            below = tl.cumsum(hist, 0) - hist
            d = tl.max(tl.where(below < need, bins, 0), 0)
            need -= tl.sum(tl.where(bins < d, hist, 0), 0)
            prefix = prefix | (d.to(tl.int64) << shift)
        return prefix.to(tl.int32)

    @triton.jit
    def _split_candidates_kernel(
        lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, excl_ptr, cand_ptr, cnt_ptr,
        stream_key, hs, n_keys, chunk, n_pages, s_x_r, s_x_h, s_sz_r, s_sz_h, s_nav_r, s_nav_h,
        PAGE: tl.constexpr, HAS_EXCL: tl.constexpr, WRITE: tl.constexpr, SPLITS: tl.constexpr,
        SP: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """One chunk ``[s·chunk, (s+1)·chunk) ∩ [start, end)`` of a row's positions: ``WRITE=False`` counts
        its keys below the prefilter's threshold into ``cnt[rh, s]``; ``WRITE=True`` copies them to the
        row's candidate list after those of the chunks before it (their counts from the first launch), so
        the list is the single-program scan's, in position order."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.program_id(2)
        rh, lo, hi, start, end, size, n_av = _row_params(lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, r,
                                                         h, hs, s_sz_r, s_sz_h, s_nav_r, s_nav_h)
        thr = _threshold(size, n_av)
        c_lo = tl.maximum(start, s * chunk)
        c_hi = tl.minimum(end, s * chunk + chunk)
        cnt_row = cnt_ptr + rh * SPLITS
        base_c = h.to(tl.int64) << 22
        if WRITE:
            so = tl.arange(0, SP)
            before = tl.sum(tl.load(cnt_row + so, mask=so < s, other=0), 0)
            _candidates(cand_ptr + rh * n_keys + before, lo, hi, stream_key, base_c, c_lo, c_hi, thr, size,
                        excl_ptr, r, h, s_x_r, s_x_h, n_pages, PAGE, HAS_EXCL, BLOCK, True)
        else:
            cnt = _candidates(cand_ptr, lo, hi, stream_key, base_c, c_lo, c_hi, thr, size, excl_ptr, r, h, s_x_r,
                              s_x_h, n_pages, PAGE, HAS_EXCL, BLOCK, False)
            tl.store(cnt_row + s, cnt)

    @triton.jit
    def _sample_rows_kernel(
        lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, excl_ptr, off_ptr, out_ptr, w_ptr, cand_ptr,
        cnt_ptr, stream_key, hs, n_keys, width, n_pages,
        s_out_r, s_out_h, s_x_r, s_x_h, s_sz_r, s_sz_h, s_nav_r, s_nav_h,
        PAGE: tl.constexpr, HAS_EXCL: tl.constexpr, HAS_OFF: tl.constexpr, HAS_W: tl.constexpr,
        FILL: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr, SPLITS: tl.constexpr = 1,
        SP: tl.constexpr = 1,
    ):
        PAD: tl.constexpr = 1 << 46  # a padding entry: hash 2^24, above every threshold
        h = tl.program_id(0)
        r = tl.program_id(1)
        rh, lo, hi, start, end, size, n_av = _row_params(lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, r,
                                                         h, hs, s_sz_r, s_sz_h, s_nav_r, s_nav_h)
        off = tl.zeros([], tl.int32)
        if HAS_OFF:
            off = tl.load(off_ptr + rh).to(tl.int32)
        cand = cand_ptr + rh * n_keys
        base_c = h.to(tl.int64) << 22
        offs = tl.arange(0, BLOCK)
        # 1. candidates: hash below a threshold the size-th smallest of n_av uniforms rarely exceeds (with
        # SPLITS > 1 found by two launches of SPLITS programs per row and head before this one)
        thr = _threshold(size, n_av)
        if SPLITS > 1:  # the candidates were written by _split_candidates_kernel: their count
            so = tl.arange(0, SP)
            cnt = tl.sum(tl.load(cnt_ptr + rh * SPLITS + so, mask=so < SPLITS, other=0), 0)
        else:
            cnt = _candidates(cand, lo, hi, stream_key, base_c, start, end, thr, size, excl_ptr, r, h, s_x_r,
                              s_x_h, n_pages, PAGE, HAS_EXCL, BLOCK)
        if cnt < size:  # too few below the threshold: every available key is a candidate
            thr = tl.full([], 16777216, tl.int64)
            cnt = _candidates(cand, lo, hi, stream_key, base_c, start, end, thr, size, excl_ptr, r, h, s_x_r,
                              s_x_h, n_pages, PAGE, HAS_EXCL, BLOCK)
        tl.debug_barrier()  # the candidates were written by other threads of this program
        # 2. bisection over the 24-bit hash: count(h < t_lo) < size <= count(h < t_hi)
        t_lo = tl.zeros([], tl.int32)
        t_hi = thr.to(tl.int32)
        if size >= cnt:  # every candidate is taken (size >= n_avail): no cut to find
            t_lo = tl.full([], 16777216, tl.int32)
        elif cnt <= CBLOCK:
            coffs = tl.arange(0, CBLOCK)
            ck = (tl.load(cand + coffs, mask=coffs < cnt, other=PAD) >> 22).to(tl.int32)
            for _ in range(24):
                mid = (t_lo + t_hi) // 2
                c = tl.sum((ck < mid).to(tl.int32), 0)
                go_lo = c >= size
                t_hi = tl.where(go_lo, mid, t_hi)
                t_lo = tl.where(go_lo, t_lo, mid)
        else:  # a long list (a sample of a large share of the row): four 64-bin radix passes over it
            t_lo = _radix_smallest24(cand, cnt, size, BLOCK)
        # the size-th smallest is t_lo: take every key below it and the first `need` equal to it
        below = tl.zeros([], tl.int32)
        if size < cnt:
            for c0 in range(0, cnt, BLOCK):
                co = c0 + tl.arange(0, BLOCK)
                kk = tl.load(cand + co, mask=co < cnt, other=PAD) >> 22
                below += tl.sum((kk < t_lo).to(tl.int32), 0)
        else:
            below = cnt
        need = size - below
        # 3. the chosen keys in position order, then zeros; weights n_av / size
        out = out_ptr + r.to(tl.int64) * s_out_r + h * s_out_h
        w = w_ptr + r.to(tl.int64) * s_out_r + h * s_out_h
        wv = n_av.to(tl.float64) / tl.maximum(size, 1).to(tl.float64)
        written = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for c0 in range(0, cnt, BLOCK):
            co = c0 + tl.arange(0, BLOCK)
            packed = tl.load(cand + co, mask=co < cnt, other=PAD)
            kk = packed >> 22
            eq = (kk == t_lo) & (co < cnt)
            tie_rank = ties + tl.cumsum(eq.to(tl.int32), 0)
            take = (co < cnt) & ((kk < t_lo) | (eq & (tie_rank <= need)))
            dest = off + written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(out + dest, packed & 0x3FFFFF, mask=take)
            if HAS_W:
                tl.store(w + dest, tl.zeros([BLOCK], tl.float64) + wv, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)
        if FILL:
            for z0 in range(off + size, width, BLOCK):
                zo = z0 + offs
                zm = zo < width
                tl.store(out + zo, tl.zeros([BLOCK], tl.int64), mask=zm)
                if HAS_W:
                    tl.store(w + zo, tl.zeros([BLOCK], tl.float64) + 1.0, mask=zm)

    @triton.jit
    def _window(size, n_av, SIGMAS: tl.constexpr):
        """The 24-bit hash window ``[t_lo, t_hi)`` that holds the ``size``-th smallest of ``n_av`` uniforms
        but for a ``SIGMAS``-sigma event: the count of hashes below ``t`` is binomial, so its ``size`` is
        reached within ``SIGMAS · √(size (1 − size/n_av)) + 16`` keys of the mean. ``size ≥ n_av``: every
        key lies below the window."""
        sz = size.to(tl.float32)
        na = tl.maximum(n_av, 1).to(tl.float32)
        margin = SIGMAS * tl.sqrt(sz * tl.maximum(1.0 - sz / na, 0.0)) + 16.0
        t_lo = (tl.maximum(sz - margin, 0.0) / na * 16777216.0).to(tl.int64)
        t_hi = (tl.minimum((sz + margin) / na * 16777216.0 + 1.0, 16777216.0)).to(tl.int64)
        every = size >= n_av
        return tl.where(every, 16777216, t_lo), tl.where(every, 16777216, t_hi)

    @triton.jit
    def tie_position(eq, p, at):
        """The ``at``-th lowest (``1 ≤ at ≤`` their count) of the distinct positions ``p`` where ``eq``: the
        last key a sample takes among those sharing its cut's hash (ties go to the lowest positions). One
        reduction when every such key is taken (the usual case), else a bisection over the 22 position bits
        (at 128k keys some other key shares the cut's 24-bit hash about once in a hundred rows)."""
        tie = tl.max(tl.where(eq, p, -1), 0)
        if tl.sum(eq.to(tl.int32), 0) > at:
            p_lo = tl.zeros([], tl.int32)
            p_hi = tl.full([], 1 << 22, tl.int32)
            for _ in range(22):  # count(eq & p < p_lo) < at <= count(eq & p < p_hi)
                mid = (p_lo + p_hi) // 2
                go_lo = tl.sum((eq & (p < mid)).to(tl.int32), 0) >= at
                p_hi = tl.where(go_lo, mid, p_hi)
                p_lo = tl.where(go_lo, p_lo, mid)
            tie = p_lo
        return tie

    @triton.jit
    def _window_scan_kernel(
        lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, excl_ptr, list_ptr, cnt_ptr, fill_ptr,
        stream_key, hs, n_keys, chunk, n_pages, s_x_r, s_x_h, s_sz_r, s_sz_h, s_nav_r, s_nav_h,
        PAGE: tl.constexpr, HAS_EXCL: tl.constexpr, SP: tl.constexpr, SIGMAS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Chunk ``s`` of a row's positions: counts its keys below the window (``cnt[rh, 0, s]``) and inside
        it (``cnt[rh, 1, s]``), and appends those inside (``hash << 22 | position``) to the row's list at
        the row's fill counter (``fill[rh]``, relaxed atomics: the list's order is not used; the cut launch
        reads and resets the counter)."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.program_id(2)
        rh, lo, hi, start, end, size, n_av = _row_params(lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, r,
                                                         h, hs, s_sz_r, s_sz_h, s_nav_r, s_nav_h)
        t_lo, t_hi = _window(size, n_av, SIGMAS)
        c_lo = tl.maximum(start, s * chunk)
        c_hi = tl.minimum(end, s * chunk + chunk)
        lst = list_ptr + rh * n_keys
        base_c = h.to(tl.int64) << 22
        below = tl.zeros([], tl.int32)
        cnt = tl.zeros([], tl.int32)
        if size > 0:
            for b0 in range(c_lo, c_hi, BLOCK):
                pos, ok, hv = _block_hashes(lo, hi, stream_key, base_c, b0, c_hi, excl_ptr, r, h, s_x_r, s_x_h,
                                            n_pages, PAGE, HAS_EXCL, BLOCK)
                below += tl.sum((ok & (hv < t_lo)).to(tl.int32), 0)
                win = ok & (hv >= t_lo) & (hv < t_hi)
                n_win = tl.sum(win.to(tl.int32), 0)
                if n_win > 0:
                    at = tl.atomic_add(fill_ptr + rh, n_win, sem="relaxed")
                    tl.store(lst + at + tl.cumsum(win.to(tl.int32), 0) - 1, (hv << 22) | pos.to(tl.int64), mask=win)
                cnt += n_win
        tl.store(cnt_ptr + rh * 2 * SP + s, below)
        tl.store(cnt_ptr + rh * 2 * SP + SP + s, cnt)

    @triton.jit
    def _window_cut_kernel(
        lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, excl_ptr, off_ptr, list_ptr, cnt_ptr, fill_ptr,
        cut_ptr, dest_ptr, stream_key, hs, n_keys, chunk, n_pages, splits,
        s_x_r, s_x_h, s_sz_r, s_sz_h, s_nav_r, s_nav_h,
        PAGE: tl.constexpr, HAS_EXCL: tl.constexpr, HAS_OFF: tl.constexpr, LIST: tl.constexpr, SP: tl.constexpr,
        BLOCK: tl.constexpr, CBLOCK: tl.constexpr,
    ):
        """One program per (row, selection head): the sample's cut ``(t, p)`` — the ``size``-th smallest
        hash ``t`` and the last position ``p`` taken at it — from the window's keys (one load into registers,
        a bisection on the hash, and on the position only where several keys share the cut's hash), or, when
        the window missed it (rare) or holds more than ``CBLOCK`` keys, from every available key in position
        order (radix passes). ``LIST``: also where each chunk's chosen keys start in the list (``dest[rh, s]``)."""
        PAD: tl.constexpr = 1 << 46  # a padding entry: hash 2^24, above every cut
        h = tl.program_id(0)
        r = tl.program_id(1)
        rh, lo, hi, start, end, size, n_av = _row_params(lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, r,
                                                         h, hs, s_sz_r, s_sz_h, s_nav_r, s_nav_h)
        so = tl.arange(0, SP)
        crow = cnt_ptr + rh * 2 * SP
        below_s = tl.load(crow + so, mask=so < splits, other=0)
        cnt = tl.sum(tl.load(crow + SP + so, mask=so < splits, other=0), 0)
        tl.store(fill_ptr + rh, 0)  # the scan's fill counter, back to 0 for the next call
        need = size - tl.sum(below_s, 0)
        lst = list_ptr + rh * n_keys
        cut = tl.zeros([], tl.int64)
        tie = tl.full([], -1, tl.int32)
        chosen_s = tl.where(size >= n_av, below_s, 0)  # every key: each chunk's keys, all below the window
        if size >= n_av:
            cut = tl.where(size > 0, 16777216, 0).to(tl.int64)
        elif size > 0:
            if (need >= 1) & (need <= cnt) & (cnt <= CBLOCK):
                coffs = tl.arange(0, CBLOCK)
                packed = tl.load(lst + coffs, mask=coffs < cnt, other=PAD)
                ck = (packed >> 22).to(tl.int32)
                p = (packed & 0x3FFFFF).to(tl.int32)
                # bisection: count(h < t_lo) < need <= count(h < t_hi)
                t_lo = tl.zeros([], tl.int32)
                t_hi = tl.full([], 16777216, tl.int32)
                for _ in range(24):
                    mid = (t_lo + t_hi) // 2
                    go_lo = tl.sum((ck < mid).to(tl.int32), 0) >= need
                    t_hi = tl.where(go_lo, mid, t_hi)
                    t_lo = tl.where(go_lo, t_lo, mid)
                eq = ck == t_lo
                at = need - tl.sum((ck < t_lo).to(tl.int32), 0)  # keys taken at the cut, lowest positions first
                tie = tie_position(eq, p, at)
                cut = t_lo.to(tl.int64)
                if LIST:  # each chunk's keys below the window, and its window keys the cut takes
                    take = (coffs < cnt) & ((ck < t_lo) | (eq & (p <= tie)))
                    chosen_s = below_s + tl.histogram(tl.where(take, p // chunk, 0), SP)
                    chosen_s -= tl.where(so == 0, tl.sum((~take).to(tl.int32), 0), 0)  # counted in bin 0
            else:  # every available key of the row, in position order
                n_list = _candidates(lst, lo, hi, stream_key, h.to(tl.int64) << 22, start, end,
                                     tl.full([], 16777216, tl.int64), size, excl_ptr, r, h, s_x_r, s_x_h, n_pages,
                                     PAGE, HAS_EXCL, BLOCK)
                tl.debug_barrier()  # the list was written by other threads of this program
                t_lo = _radix_smallest24(lst, n_list, size, BLOCK)
                n_below = tl.zeros([], tl.int32)
                for c0 in range(0, n_list, BLOCK):
                    co = c0 + tl.arange(0, BLOCK)
                    n_below += tl.sum((tl.load(lst + co, mask=co < n_list, other=PAD) >> 22 < t_lo).to(tl.int32), 0)
                ties = tl.zeros([], tl.int32)
                for c0 in range(0, n_list, BLOCK):
                    co = c0 + tl.arange(0, BLOCK)
                    packed = tl.load(lst + co, mask=co < n_list, other=PAD)
                    eq = (packed >> 22) == t_lo
                    rank = ties + tl.cumsum(eq.to(tl.int32), 0)
                    tie = tl.maximum(tie, tl.max(tl.where(eq & (rank == size - n_below),
                                                          (packed & 0x3FFFFF).to(tl.int32), -1), 0))
                    ties += tl.sum(eq.to(tl.int32), 0)
                cut = t_lo.to(tl.int64)
                if LIST:  # each chunk's keys the cut takes
                    for c0 in range(0, n_list, BLOCK):
                        co = c0 + tl.arange(0, BLOCK)
                        packed = tl.load(lst + co, mask=co < n_list, other=PAD)
                        kk = packed >> 22
                        pp = (packed & 0x3FFFFF).to(tl.int32)
                        take = (co < n_list) & ((kk < cut) | ((kk == cut) & (pp <= tie)))
                        chosen_s += tl.histogram(tl.where(take, pp // chunk, 0), SP)
                        chosen_s -= tl.where(so == 0, tl.sum((~take).to(tl.int32), 0), 0)  # counted in bin 0
        tl.store(cut_ptr + rh, cut)
        tl.store(cut_ptr + tl.num_programs(0) * tl.num_programs(1) + rh, tie.to(tl.int64))
        if LIST:
            off = tl.zeros([], tl.int32)
            if HAS_OFF:
                off = tl.load(off_ptr + rh).to(tl.int32)
            tl.store(dest_ptr + rh * SP + so, off + tl.cumsum(chosen_s, 0) - chosen_s)

    @triton.jit
    def _window_write_kernel(
        lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, excl_ptr, off_ptr, cut_ptr, dest_ptr, out_ptr, w_ptr,
        stream_key, hs, chunk, n_pages, width, s_out_r, s_out_h, s_x_r, s_x_h, s_sz_r, s_sz_h, s_nav_r, s_nav_h,
        PAGE: tl.constexpr, HAS_EXCL: tl.constexpr, HAS_OFF: tl.constexpr, HAS_W: tl.constexpr,
        FILL: tl.constexpr, SP: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """Chunk ``s``: its keys the cut takes, in position order, from the list slot the cut launch gave it;
        its share of the zeros (weight 1) after the sample."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.program_id(2)
        rh, lo, hi, start, end, size, n_av = _row_params(lo_ptr, hi_ptr, start_ptr, end_ptr, size_ptr, nav_ptr, r,
                                                         h, hs, s_sz_r, s_sz_h, s_nav_r, s_nav_h)
        cut = tl.load(cut_ptr + rh)
        tie = tl.load(cut_ptr + tl.num_programs(1) * tl.num_programs(2) + rh)
        dest0 = tl.load(dest_ptr + rh * SP + s)
        out = out_ptr + r.to(tl.int64) * s_out_r + h * s_out_h
        w = w_ptr + r.to(tl.int64) * s_out_r + h * s_out_h
        wv = n_av.to(tl.float64) / tl.maximum(size, 1).to(tl.float64)
        c_lo = tl.maximum(start, s * chunk)
        c_hi = tl.minimum(end, s * chunk + chunk)
        written = tl.zeros([], tl.int32)
        if size > 0:
            for b0 in range(c_lo, c_hi, BLOCK):
                pos, ok, hv = _block_hashes(lo, hi, stream_key, h.to(tl.int64) << 22, b0, c_hi, excl_ptr, r, h,
                                            s_x_r, s_x_h, n_pages, PAGE, HAS_EXCL, BLOCK)
                take = ok & ((hv < cut) | ((hv == cut) & (pos <= tie)))
                dest = dest0 + written + tl.cumsum(take.to(tl.int32), 0) - 1
                tl.store(out + dest, pos.to(tl.int64), mask=take)
                if HAS_W:
                    tl.store(w + dest, tl.zeros([BLOCK], tl.float64) + wv, mask=take)
                written += tl.sum(take.to(tl.int32), 0)
        if FILL:
            off = tl.zeros([], tl.int32)
            if HAS_OFF:
                off = tl.load(off_ptr + rh).to(tl.int32)
            share = (tl.maximum(width - off - size, 0) + tl.num_programs(0) - 1) // tl.num_programs(0)
            f_lo = off + size + s * share
            f_hi = tl.minimum(f_lo + share, width)
            for z0 in range(f_lo, f_hi, BLOCK):
                zo = z0 + tl.arange(0, BLOCK)
                zm = zo < f_hi
                tl.store(out + zo, tl.zeros([BLOCK], tl.int64), mask=zm)
                if HAS_W:
                    tl.store(w + zo, tl.zeros([BLOCK], tl.float64) + 1.0, mask=zm)

    @triton.jit
    def _absorb_counter(lo, hi, ptr, value, k1, k2, FROM_PTR: tl.constexpr):
        """One counter of the key mixed into the row's (lo, hi) words: read from device memory (a step
        counter) or given as a host int."""
        if FROM_PTR:
            w = tl.load(ptr).to(tl.int64) & 0xFFFFFFFF
        else:
            w = tl.zeros([], tl.int64) + value
        lo = hash_mix32(lo ^ w ^ k1)
        hi = hash_mix32(hi ^ lo ^ k2)
        return lo, hi

    @triton.jit
    def _row_words_kernel(pos_ptr, seeds_ptr, c0_ptr, c1_ptr, c2_ptr, c3_ptr, out_ptr, rows, q_len, lo0, hi0,
                          v0, v1, v2, v3, k10, k20, k11, k21, k12, k22, k13, k23,
                          NC: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                          T3: tl.constexpr, ROW_SEEDS: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        ok = r < rows
        brow = (r // q_len).to(tl.int64)
        p = tl.load(pos_ptr + r, mask=ok, other=0).to(tl.int64) & 0xFFFFFFFF
        if ROW_SEEDS:
            s = tl.load(seeds_ptr + brow, mask=ok, other=0)
            lo = s & 0xFFFFFFFF
            hi = (s >> 32) & 0xFFFFFFFF
            brow = brow * 0
        else:
            lo = tl.zeros([BLOCK], tl.int64) + lo0
            hi = tl.zeros([BLOCK], tl.int64) + hi0
            # the key's counters after its host-int prefix (``RandomKey.words``)
            if NC > 0:
                lo, hi = _absorb_counter(lo, hi, c0_ptr, v0, k10, k20, T0)
            if NC > 1:
                lo, hi = _absorb_counter(lo, hi, c1_ptr, v1, k11, k21, T1)
            if NC > 2:
                lo, hi = _absorb_counter(lo, hi, c2_ptr, v2, k12, k22, T2)
            if NC > 3:
                lo, hi = _absorb_counter(lo, hi, c3_ptr, v3, k13, k23, T3)
        lo = hash_mix32(lo ^ (brow & 0xFFFFFFFF) ^ 0x243F6A88)
        hi = hash_mix32(hi ^ lo ^ p ^ 0x85A308D3)
        lo = hash_mix32(lo ^ hi)
        tl.store(out_ptr + r, lo, mask=ok)
        tl.store(out_ptr + rows + r, hi, mask=ok)


def usable(t: torch.Tensor) -> bool:
    """Whether these kernels can run on ``t``'s device (CUDA, or the CPU under Triton's interpreter)."""
    return triton is not None and (t.is_cuda or is_interpreted(_sample_rows_kernel))


def sample_rows_triton(lo: torch.Tensor, hi: torch.Tensor, stream: int, start: torch.Tensor, end: torch.Tensor,
                       size: torch.Tensor, n_avail: torch.Tensor, width: int, n_keys: int, *,
                       excluded: torch.Tensor | None = None, page: int = 1, offset: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                       with_weights: bool = True, fill: bool = True,
                       target_programs: int = SPLIT_PROGRAMS, block: int | None = None, window: bool | None = None,
                       cand_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(indices, weights)``: per row ``r`` (words ``lo, hi [R]``, positions ``[start, end) [R]``) and
    selection head ``h`` of ``size [R, Hs]``, the ``min(size, n_avail)`` available positions with the
    smallest hash (:func:`sample_rows_reference`), ascending, written from column ``offset [R, Hs]``
    (default 0) of ``out [R, Hs, width]``; columns after them are 0 (weight 1), columns before the
    offset are left as the caller wrote them. ``n_avail [R, Hs]``: the available positions (the range
    minus the ``excluded [R, Hs, P]`` pages of ``page`` keys); the weights are ``n_avail / size``
    (float64). ``fill=False`` leaves the columns after the sample as they were (a list as wide as the
    context whose readers look at the first ``count`` entries only: writing its padding costs more than
    the sample). No host read.

    ``window``: the cut found from a hash window (module docstring: three launches spread over the row;
    ``cand_block`` window keys in registers) rather than by one program per row selecting among its keys
    below a threshold (one launch, three with a split scan). None: the window where the scan is split
    (:func:`sample_splits`). The caller chooses by the sample's size: the window is the faster for a large
    share of the row, one program per row for a small one."""
    r, hs = size.shape
    dev = size.device
    if out is None:
        out = torch.empty(r, hs, width, device=dev, dtype=torch.int64)
    if with_weights and weights is None:
        weights = torch.empty(r, hs, width, device=dev, dtype=torch.float64)
    if out.stride(-1) != 1 or (weights is not None and weights.stride() != out.stride()):
        raise ValueError("sample_rows_triton: out and weights must share a layout with a contiguous last dim")
    if width == 0 or r * hs == 0:
        return out, weights
    block, splits, chunk = _scan_plan(n_keys, r * hs, block, target_programs)
    if splits > 1 if window is None else window:
        _launch_window(lo, hi, stream, start, end, size, n_avail, n_keys, excluded, page, offset, out, weights, fill,
                       block, splits, chunk, None, cand_block)
    else:
        _launch_rows(lo, hi, stream, start, end, size, n_avail, n_keys, excluded, page, offset, out, weights, fill,
                     block, splits, chunk)
    return out, weights


def sample_cut_triton(lo: torch.Tensor, hi: torch.Tensor, stream: int, start: torch.Tensor, end: torch.Tensor,
                      size: torch.Tensor, n_avail: torch.Tensor, n_keys: int, *, excluded: torch.Tensor | None = None,
                      page: int = 1, target_programs: int = SPLIT_PROGRAMS, block: int | None = None,
                      cand_block: int | None = None) -> torch.Tensor:
    """The sample of :func:`sample_rows_triton` (same arguments, same draws) as a test instead of a list:
    ``[2, R, Hs]`` int64 ``(cut, tie)``, a position ``p`` of the range, not excluded, being in the sample
    of ``(r, h)`` iff its 24-bit hash is below ``cut`` or equal to it with ``p ≤ tie`` (ties go to the lowest
    positions, as in the list). A reader that tests every key (vAttention's attention pass) needs nothing
    wider than this. Found from a hash window (module docstring): two launches, the scan spread over the
    row, whatever the sample's size."""
    r, hs = size.shape
    cut = torch.empty(2, r, hs, device=size.device, dtype=torch.int64)
    if r * hs:
        block, splits, chunk = _scan_plan(n_keys, r * hs, block, target_programs)
        _launch_window(lo, hi, stream, start, end, size, n_avail, n_keys, excluded, page, None, None, None, False,
                       block, splits, chunk, cut, cand_block)
    return cut


def _scan_plan(n_keys: int, rows: int, block: int | None, target_programs: int) -> tuple[int, int, int]:
    """``(block, splits, chunk)`` of a sample's scan: the keys a program takes at a time (``block``, or a
    default from the row's length) and :func:`sample_splits`'s cut of the row."""
    block = block or min(1024, max(16, next_pow2(n_keys)))
    return (block, *sample_splits(n_keys, rows, block, target_programs))


def _row_operands(lo, hi, start, end, size, n_avail, excluded):
    """The per-row operands and strides every launch of the sample takes."""
    excl = excluded if excluded is not None else size
    row = (lo.contiguous(), hi.contiguous(), start.contiguous(), end.contiguous(), size, n_avail, excl)
    x_strides = (excl.stride(0), excl.stride(1)) if excluded is not None else (0, 0)
    strides = (*x_strides, size.stride(0), size.stride(1), n_avail.stride(0), n_avail.stride(1))
    return row, strides, excluded.shape[-1] if excluded is not None else 1


def _launch_window(lo, hi, stream, start, end, size, n_avail, n_keys, excluded, page, offset, out, weights, fill,
                   block, splits, chunk, cut, cand_block) -> None:
    """The windowed cut's launches: the list to ``out`` (``cut`` None), or the cut alone to ``cut``."""
    r, hs = size.shape
    cand = workspace("sample_candidates", size, r * hs * max(n_keys, 1), torch.int64)
    stream_key = (stream * GOLDEN) & MASK32
    sp = max(2, next_pow2(splits))
    counts = workspace("sample_window_counts", size, r * hs * 2 * sp, torch.int32)
    fills = workspace("sample_window_fill", size, r * hs, torch.int32, zeroed=True)
    dest = workspace("sample_window_dest", size, r * hs * sp, torch.int32)
    cuts = cut if cut is not None else workspace("sample_window_cut", size, 2 * r * hs, torch.int64)
    row, strides, n_pages = _row_operands(lo, hi, start, end, size, n_avail, excluded)
    flags = {"PAGE": page, "HAS_EXCL": excluded is not None, "SP": sp, "BLOCK": block}
    launch(_window_scan_kernel, (splits, hs, r), *row, cand, counts, fills, stream_key, hs, n_keys, chunk, n_pages,
           *strides, SIGMAS=WINDOW_SIGMAS, **flags, num_warps=8, num_stages=1)
    off = offset if offset is not None else size
    listed = cut is None
    launch(_window_cut_kernel, (hs, r), *row, off, cand, counts, fills, cuts, dest, stream_key, hs, n_keys, chunk,
           n_pages, splits, *strides, HAS_OFF=offset is not None, LIST=listed,
           CBLOCK=cand_block or WINDOW_BLOCK, **flags, num_warps=8, num_stages=1)
    if listed:
        launch(_window_write_kernel, (splits, hs, r), *row, off, cuts, dest, out,
               weights if weights is not None else out, stream_key, hs, chunk, n_pages, out.shape[-1],
               out.stride(0), out.stride(1), *strides, HAS_OFF=offset is not None, HAS_W=weights is not None,
               FILL=fill, **flags, num_warps=8, num_stages=1)


def _launch_rows(lo, hi, stream, start, end, size, n_avail, n_keys, excluded, page, offset, out, weights, fill,
                 block, splits, chunk) -> None:
    """One program per row selecting among its keys below a threshold (the candidates found by two split
    launches first where ``splits > 1``), the list to ``out``."""
    r, hs = size.shape
    cand = workspace("sample_candidates", size, r * hs * max(n_keys, 1), torch.int64)
    stream_key = (stream * GOLDEN) & MASK32
    row, strides, n_pages = _row_operands(lo, hi, start, end, size, n_avail, excluded)
    cnt = size
    if splits > 1:  # the scan over the row in splits x hs x r programs: counts, then the candidates
        cnt = workspace("sample_split_counts", size, r * hs * splits, torch.int32)
        for write in (False, True):
            launch(_split_candidates_kernel, (splits, hs, r), *row, cand, cnt, stream_key, hs, n_keys, chunk, n_pages,
                   *strides, PAGE=page, HAS_EXCL=excluded is not None, WRITE=write, SPLITS=splits,
                   SP=next_pow2(splits), BLOCK=block, num_warps=8, num_stages=1)
    launch(_sample_rows_kernel, (hs, r), *row, offset if offset is not None else size, out,
           weights if weights is not None else out, cand, cnt, stream_key, hs, n_keys, out.shape[-1], n_pages,
           out.stride(0), out.stride(1), *strides,
           PAGE=page, HAS_EXCL=excluded is not None, HAS_OFF=offset is not None, HAS_W=weights is not None,
           FILL=fill, BLOCK=block, CBLOCK=256 if is_interpreted(_sample_rows_kernel) else CAND_BLOCK, SPLITS=splits,
           SP=next_pow2(splits), num_warps=8, num_stages=1)


def sample_splits(n_keys: int, rows: int, block: int, target_programs: int = SPLIT_PROGRAMS) -> tuple[int, int]:
    """``(splits, chunk)``: the row's positions cut into ``splits`` chunks of ``chunk`` keys (a multiple
    of ``block``) so that ``splits · rows`` programs scan them, about ``target_programs`` in all; one
    split (the single-launch scan) when the row holds at most two blocks or the rows alone fill the GPU."""
    want = min(cdiv(target_programs, max(rows, 1)), cdiv(n_keys, 2 * block))
    if want <= 1:
        return 1, max(n_keys, 1)
    per = cdiv(n_keys, want)
    chunk = cdiv(per, block) * block
    return cdiv(n_keys, chunk), chunk


def row_words_triton(key: RandomKey, position: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``core.rng.row_words(key, r // q_len, position)`` for the ``R = position.numel()`` query rows in one
    launch (the torch version is ~40 elementwise launches on a key with a device step counter); None
    where this cannot serve (no Triton, a key with more than 4 counters after its host-int prefix)."""
    if not usable(position):
        return None
    rows = position.numel()
    dev = position.device
    lo, hi = seed_words(key.seed)
    counters = list(key.counters)
    i = 0
    if key.row_seeds is None:
        while i < len(counters) and not isinstance(counters[i], torch.Tensor):  # fold host ints
            w = int(counters[i]) & MASK32
            lo = mix32(lo ^ w ^ ((GOLDEN * (2 * i + 1)) & MASK32))
            hi = mix32(hi ^ lo ^ ((GOLDEN * (2 * i + 2)) & MASK32))
            i += 1
    rest = counters[i:] if key.row_seeds is None else []
    if len(rest) > 4 or any(isinstance(c, torch.Tensor) and (c.numel() != 1 or c.device != dev) for c in rest):
        return None
    ptrs, vals, flags, consts = [], [], [], []
    for j in range(4):
        c = rest[j] if j < len(rest) else 0
        t = isinstance(c, torch.Tensor)
        ptrs.append(c if t else position)
        vals.append(0 if t else int(c) & MASK32)
        flags.append(t)
        consts += [(GOLDEN * (2 * (i + j) + 1)) & MASK32, (GOLDEN * (2 * (i + j) + 2)) & MASK32]
    out = torch.empty(2, rows, device=dev, dtype=torch.int64)
    seeds = key.row_seeds if key.row_seeds is not None else position
    launch(_row_words_kernel, (1,), position, seeds, *ptrs, out, rows, q_len, lo, hi, *vals, *consts,
           NC=len(rest), T0=flags[0], T1=flags[1], T2=flags[2], T3=flags[3], ROW_SEEDS=key.row_seeds is not None,
           BLOCK=max(16, next_pow2(rows)), num_warps=1)
    return out[0], out[1]


__all__ = ["CAND_BLOCK", "SPLIT_PROGRAMS", "WINDOW_BLOCK", "WINDOW_SIGMAS", "row_words_triton",
           "sample_cut_triton", "sample_rows_reference", "sample_rows_triton", "sample_splits", "usable"]
