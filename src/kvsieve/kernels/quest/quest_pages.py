"""Quest's page selection on the device: page min/max kept as keys are appended, the page bound
``Σ_j max(q_j·min_j, q_j·max_j)`` in one Triton launch, and the top pages (one more launch,
:mod:`kvsieve.kernels.shared.select_triton`) as an index list for
:func:`kvsieve.kernels.shared.weighted_triton.sparse_decode_triton` (``page_size`` granularity).

Everything here takes plain tensors and runs without a host sync: lengths, counts and budgets stay on
the device; the shapes (the number of pages ``P = ceil(N / page)`` and the most pages a row may take)
come from static sizes. The torch references (:func:`page_minmax_reference`,
:func:`page_bounds_reference`) sit beside the fast paths and the tests compare them.

Available pages: a row of length ``L`` with a dense part (sink, window) attends to
``[0, sink_end) ∪ [window_start, L)`` anyway (``weighted_triton``'s contract); a page is a candidate
when it holds a key of ``[sink_end, window_start)``, and only those keys of it are read.
"""

from __future__ import annotations

import torch

from ..shared.scores import candidate_mask, group_summed, score_launch_args, selection_counts_reference
from ..shared.triton_utils import cdiv, is_interpreted, launch, next_pow2, triton

PAGE_BLOCK = 64  # pages per tile of the bounds launch (and per softmax partial)

# --- page summaries -------------------------------------------------------------------------------

def page_minmax_reference(k: torch.Tensor, lengths: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kmin, kmax) [B, Hkv, ceil(N/page), d]`` in k's dtype over each page's keys below the row's
    length; pages with no such key hold 0 (never candidates: past the length)."""
    b, hkv, n, d = k.shape
    p = cdiv(n, page_size)
    pad = p * page_size - n
    valid = (torch.arange(p * page_size, device=k.device)[None, :] < lengths.long()[:, None])  # [B, P*page]
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad))
    v = valid[:, None, :, None]
    big = torch.finfo(k.dtype).max
    kmin = kp.masked_fill(~v, big).view(b, hkv, p, page_size, d).amin(3)
    kmax = kp.masked_fill(~v, -big).view(b, hkv, p, page_size, d).amax(3)
    has = valid.view(b, p, page_size).any(-1)[:, None, :, None]
    return torch.where(has, kmin, 0).to(k.dtype), torch.where(has, kmax, 0).to(k.dtype)


class PageSummaries:
    """Per-(request, layer) page min/max ``[B, Hkv, capacity, d]`` updated as the cache grows.

    A device tensor ``done [B, Hkv]`` holds how many keys of each row are summarised; each
    ``update(k, lengths)`` recomputes the pages from ``min(done, length)`` to the row's last key and sets
    ``done = length`` — one launch, no host sync, whatever the rows appended since the last call (one key
    of a decode step, a chunk, or nothing), on a cache whose key axis grows (a DynamicCache) or has a
    fixed shape (a static cache). A row that got shorter has its last partial page recomputed; pages past
    a row's length are never read (their bounds are −inf). A cache that changed its batch, heads, head
    dim, dtype or device is summarised from scratch; so is a fresh one. Buffers grow by 1/8 beyond what
    is needed, so a decode loop reallocates rarely (capture a CUDA graph once the capacity covers the
    context).
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.kmin: torch.Tensor | None = None
        self.kmax: torch.Tensor | None = None
        self.done: torch.Tensor | None = None

    def _fresh(self, k: torch.Tensor, lengths: torch.Tensor) -> None:
        b, hkv, n, d = k.shape
        p = cdiv(n, self.page_size)
        cap = p + p // 8 + 1
        kmin, kmax = page_minmax_reference(k, lengths, self.page_size)
        self.kmin = torch.zeros(b, hkv, cap, d, device=k.device, dtype=k.dtype)
        self.kmax = torch.zeros_like(self.kmin)
        self.kmin[:, :, :p] = kmin
        self.kmax[:, :, :p] = kmax
        self.done = lengths.to(torch.int32)[:, None].repeat(1, hkv).contiguous()

    def update(self, k: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)`` views ``[B, Hkv, ceil(N/page), d]`` current for ``k`` and ``lengths [B]``."""
        b, hkv, n, d = k.shape
        page = self.page_size
        p = cdiv(n, page)
        same = (self.kmin is not None and self.kmin.shape[:2] == (b, hkv) and self.kmin.shape[3] == d
                and self.kmin.dtype == k.dtype and self.kmin.device == k.device)
        if not same:
            self._fresh(k, lengths)
            return self.kmin[:, :, :p], self.kmax[:, :, :p]
        if p > self.kmin.shape[2]:
            cap = p + p // 8 + 1
            grow = torch.zeros(b, hkv, cap - self.kmin.shape[2], d, device=k.device, dtype=k.dtype)
            self.kmin = torch.cat([self.kmin, grow], 2)
            self.kmax = torch.cat([self.kmax, grow], 2)
        if triton is not None and (k.is_cuda or is_interpreted(_page_update_kernel)):
            launch(_page_update_kernel, (hkv, b),
                   k, lengths, self.done, self.kmin, self.kmax,
                   k.stride(0), k.stride(1), k.stride(2),
                   self.kmin.stride(0), self.kmin.stride(1), self.kmin.stride(2),
                   PAGE=page, BLOCK=max(2, page), D=d, num_warps=4 if d * page >= 2048 else 1, num_stages=1)
        else:  # CPU without the interpreter: the same pages in torch (host syncs are free here)
            length = lengths.long()
            first = torch.minimum(self.done.long().amin(1), length) // page
            lo, hi = int(first.min()), int(((length - 1) // page).max())
            if hi >= lo:
                kmin, kmax = page_minmax_reference(k[:, :, lo * page:(hi + 1) * page],
                                                   torch.clamp(length - lo * page, min=0), page)
                self.kmin[:, :, lo:hi + 1] = kmin
                self.kmax[:, :, lo:hi + 1] = kmax
            self.done.copy_(length.to(torch.int32)[:, None].expand(b, hkv))
        return self.kmin[:, :, :p], self.kmax[:, :, :p]


# --- page bounds ----------------------------------------------------------------------------------

def page_bounds_reference(q, kmin, kmax, lengths, page_size: int, sink: int = 0, window: int = 0,
                          scale: float | None = None) -> torch.Tensor:
    """``[B, Hq, P]`` float32 ``scale · Σ_j max(q_j·min_j, q_j·max_j)``; −inf on non-candidate pages."""
    b, hq, d = q.shape
    hkv, p = kmin.shape[1], kmin.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qg = q.float().view(b, hkv, hq // hkv, 1, d)
    bound = torch.maximum(qg * kmin.float()[:, :, None], qg * kmax.float()[:, :, None]).sum(-1) * scale
    cand = candidate_mask(lengths, p, page_size, sink, window)
    return bound.view(b, hq, p).masked_fill(~cand[:, None, :], float("-inf"))


if triton is not None:
    import triton.language as tl

    from ..shared.scores import load_group_queries, score_program
    from ..shared.select_common import store_maxima, store_softmax_part

    @triton.jit
    def _page_update_kernel(
        k_ptr, lens_ptr, done_ptr, kmin_ptr, kmax_ptr,
        s_k_b, s_k_h, s_k_n, s_m_b, s_m_h, s_m_p,
        PAGE: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
    ):
        # Pages from the first key not yet summarised (or past a shrunk length) to the row's last key:
        # min/max over their keys below the length (0 for a page with none). done[b, kvh] = length after.
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        b64 = b.to(tl.int64)
        length = tl.load(lens_ptr + b).to(tl.int32)
        done_at = done_ptr + b * tl.num_programs(0) + kvh
        first = tl.minimum(tl.load(done_at), length) // PAGE
        offs = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        for page in range(first, (length - 1) // PAGE + 1):
            pos = page * PAGE + offs
            ok = (offs < PAGE) & (pos < length)
            rows = tl.load(k_ptr + b64 * s_k_b + kvh * s_k_h + pos[:, None] * s_k_n + offs_d[None, :],
                           mask=ok[:, None], other=0.0).to(tl.float32)
            lo = tl.min(tl.where(ok[:, None], rows, float("inf")), axis=0)
            hi = tl.max(tl.where(ok[:, None], rows, float("-inf")), axis=0)
            any_ok = tl.sum(ok.to(tl.int32), axis=0) > 0
            dst = b64 * s_m_b + kvh * s_m_h + page * s_m_p + offs_d
            tl.store(kmin_ptr + dst, tl.where(any_ok, lo, 0.0).to(kmin_ptr.dtype.element_ty))
            tl.store(kmax_ptr + dst, tl.where(any_ok, hi, 0.0).to(kmax_ptr.dtype.element_ty))
        tl.store(done_at, length)

    @triton.jit(do_not_specialize=["sink", "window", "n_pages", "size", "max_units"])
    def _page_bounds_kernel(
        q_ptr, kmin_ptr, kmax_ptr, lens_ptr, out_ptr, counts_ptr, frac_ptr, pm_ptr, pl_ptr, mx_ptr,
        scale, sink, window, n_pages, size, max_units,
        s_q_b, s_q_h, s_m_b, s_m_h, s_m_p, s_o_b, s_o_h, s_p_b, s_p_h, s_x_b, s_x_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, PAGE: tl.constexpr,
        MASK_DENSE: tl.constexpr, WRITE_COUNTS: tl.constexpr, IS_FRAC: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr, WRITE_PARTS: tl.constexpr,
        WRITE_MAX: tl.constexpr, GROUP_MAX: tl.constexpr, TILES: tl.constexpr,
    ):
        # max(q·lo, q·hi) per channel = q⁺·hi + q⁻·lo (lo ≤ hi): two dots per page tile. A program takes
        # TILES consecutive tiles of BLOCK_P pages (the query rows loaded once; with num_stages > 1 the
        # next tiles' loads overlap this one's dots); outputs stay per tile, so the consumers see one
        # layout whatever TILES is.
        pid, kvh, b, b64, length, sink_end, win_start = score_program(
            lens_ptr, counts_ptr, frac_ptr, sink, window, size, max_units, PAGE, WRITE_COUNTS, IS_FRAC)
        q, heads, g_ok, offs_d = load_group_queries(q_ptr, b64, kvh, s_q_b, s_q_h, G, BLOCK_G, D)
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong; its tests upcast the tiles instead
            q = q.to(tl.float32)
        q_pos = tl.where(q > 0, q, 0.0).to(q.dtype)
        q_neg = tl.where(q < 0, q, 0.0).to(q.dtype)
        for t in range(TILES):
            pb = pid * TILES + t
            offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
            p_ok = offs_p < n_pages
            base = b64 * s_m_b + kvh * s_m_h + offs_p[:, None] * s_m_p + offs_d[None, :]
            lo = tl.load(kmin_ptr + base, mask=p_ok[:, None], other=0.0)
            hi = tl.load(kmax_ptr + base, mask=p_ok[:, None], other=0.0)
            if DOT_F32:
                lo = lo.to(tl.float32)
                hi = hi.to(tl.float32)
            bound = tl.dot(q_pos, tl.trans(hi), input_precision=DOT_PRECISION)
            bound = tl.dot(q_neg, tl.trans(lo), bound, input_precision=DOT_PRECISION) * scale
            start = offs_p * PAGE
            if MASK_DENSE:
                keep = p_ok & (start < win_start) & (start + PAGE > sink_end)
            else:
                keep = p_ok & (start < length)
            bound = tl.where(keep[None, :], bound, float("-inf"))
            tl.store(out_ptr + b64 * s_o_b + heads[:, None] * s_o_h + offs_p[None, :], bound,
                     mask=g_ok[:, None] & p_ok[None, :])
            if WRITE_PARTS:  # the group-summed ranking's softmax needs each head's lse over all pages
                # the last program's tiles past the pages have no partial to write (TILES > 1)
                # (a [BLOCK_G] mask: the interpreter rejects g_ok & a scalar comparison as a store mask)
                tile_ok = g_ok & (heads * 0 + pb * BLOCK_P < n_pages)
                store_softmax_part(pm_ptr, pl_ptr, b64, heads, tile_ok, pb, s_p_b, s_p_h, bound)
            if WRITE_MAX:  # the select launch's prefilter subset
                store_maxima(mx_ptr, b64, heads, g_ok, pb, s_x_b, s_x_h, bound, n_pages, BLOCK_P, BLOCK_G, GROUP_MAX)


def page_bounds_triton(q, kmin, kmax, lengths, page_size: int, sink: int = 0, window: int = 0,
                       scale: float | None = None, out: torch.Tensor | None = None, *, mask_dense: bool = True,
                       counts: torch.Tensor | None = None, size: int | float = 0,
                       max_pages: int = 0, parts: tuple[torch.Tensor, torch.Tensor] | None = None,
                       maxima: torch.Tensor | None = None, block_p: int = PAGE_BLOCK, tiles: int = 1,
                       num_warps: int = 4, num_stages: int = 1) -> torch.Tensor:
    """:func:`page_bounds_reference` in one launch (``lengths`` int32 ``[B]``; kmin/kmax in q's dtype
    with a contiguous last dim). Products of bf16/fp16 values are exact in the fp32 accumulator; fp32
    inputs use IEEE dots. ``mask_dense=False`` masks only pages past the length (the group-summed ranking
    normalises over them). With ``counts [B]`` (int64) it also writes :func:`selection_counts_reference`
    for ``size`` and ``max_pages``; with ``parts = (max, sum_exp)`` float32 ``[B, Hq, ceil(P / block_p)]``
    each block of ``block_p`` pages' softmax partials; with ``maxima`` float32 ``[B, Hq, ceil(P / GROUP_MAX)]``
    the max of every ``GROUP_MAX`` bounds (both for :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton`).

    Launch overrides (for tuning; defaults: the settings so far): ``block_p`` pages per tile (a power of
    two, 16 to 1024: ``tl.dot``'s least width, and whole groups of ``GROUP_MAX`` for the maxima), ``tiles``
    consecutive tiles per program (the grid: ``ceil(P / (block_p · tiles))`` programs per KV head and row),
    ``num_warps`` (a power of two up to 32), ``num_stages`` (1 to 8; software pipelining over the tiles of a
    program, so it matters only with ``tiles > 1``). The bounds do not depend on them; the partials' blocks
    follow ``block_p``."""
    from ..shared.select_common import check_launch_value
    from ..shared.select_triton import GROUP_MAX

    b, hq, d = q.shape
    hkv, p = kmin.shape[1], kmin.shape[2]
    g = hq // hkv
    check_launch_value("block_p", block_p, low=max(16, GROUP_MAX), high=1024, pow2=True)
    check_launch_value("tiles", tiles)
    check_launch_value("num_warps", num_warps, high=32, pow2=True)
    check_launch_value("num_stages", num_stages, high=8)
    n_tiles = cdiv(p, block_p)
    if parts is not None and any(t.shape != (b, hq, n_tiles) for t in parts):
        raise ValueError(f"parts: expected two [{b}, {hq}, {n_tiles}] tensors (one column per {block_p} pages), "
                         f"got {[tuple(t.shape) for t in parts]}")
    scale, out, frac, count, is_frac = score_launch_args(q, p, scale, out, size)
    pm, pl = (out, out) if parts is None else parts
    mx = out if maxima is None else maxima
    launch(_page_bounds_kernel, (cdiv(n_tiles, tiles), hkv, b),
           q, kmin, kmax, lengths, out, out if counts is None else counts, lengths if frac is None else frac, pm, pl,
           mx, scale, sink, window, p, count, max_pages,
           q.stride(0), q.stride(1), kmin.stride(0), kmin.stride(1), kmin.stride(2), out.stride(0), out.stride(1),
           pm.stride(0), pm.stride(1), mx.stride(0), mx.stride(1),
           G=g, BLOCK_G=max(16, next_pow2(g)), D=d, BLOCK_P=block_p, PAGE=page_size,
           MASK_DENSE=mask_dense, WRITE_COUNTS=counts is not None, IS_FRAC=is_frac,
           DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
           DOT_F32=q.dtype == torch.bfloat16 and is_interpreted(_page_bounds_kernel), WRITE_PARTS=parts is not None,
           WRITE_MAX=maxima is not None, GROUP_MAX=GROUP_MAX, TILES=tiles, num_warps=num_warps,
           num_stages=num_stages)
    return out


# --- top pages ------------------------------------------------------------------------------------

def quest_scores_reference(q, kmin, kmax, lengths, page_size: int, sink: int, window: int, share_kv_group: bool,
                           scale: float | None = None) -> torch.Tensor:
    """What :func:`quest_select` ranks, in torch: ``[B, Hs, P]`` float32, −inf on non-candidate pages —
    the bounds (``Hs = Hq``), or with ``share_kv_group`` their group-summed softmax (``Hs = Hkv``; each
    head normalised over every page with a valid key, sink and window included)."""
    if not share_kv_group:
        return page_bounds_reference(q, kmin, kmax, lengths, page_size, sink, window, scale)
    s = group_summed(page_bounds_reference(q, kmin, kmax, lengths, page_size, 0, 0, scale), q.shape[1] // kmin.shape[1])
    return s.masked_fill(~candidate_mask(lengths, kmin.shape[2], page_size, sink, window)[:, None, :], float("-inf"))


def quest_select(q, kmin, kmax, lengths, *, page_size: int, sink: int, window: int, size: int | float,
                 max_pages: int, share_kv_group: bool, scale: float | None = None,
                 bounds: str = "triton", select: str = "triton",
                 launch_opts: dict[str, dict] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's page list for :func:`sparse_decode_triton` (``page_size`` granularity, with the same
    ``sink``/``window`` dense part): ``(pages [B, Hs, K], counts [B, Hs])`` with ``K = max(1,
    max_pages)``, ``Hs = Hkv`` when ``share_kv_group`` (pages ranked by the group-summed softmax of the
    bounds, each head's softmax over every page with a valid key — sink and window pages included — as in
    the reference) else ``Hq``. ``size``: tokens wanted per row (a count, or a fraction of its length, as
    ``resolve_size``), rounded up to whole pages. The first ``counts`` entries of a row are its pages.

    ``select="triton"`` (default): two launches — the bounds (group-summed rows also write per-block
    softmax partials, the others the maxima of every 8 bounds) and
    :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton` (group sum, prefilter, exact radix
    select), pages in ascending order; for few rows (at most ``select_triton.SPLIT_ROWS_MAX``: batch 1, tensor
    parallel) :func:`~kvsieve.kernels.shared.select_split.topk_rows_split` instead, two launches spread over
    each row (same pages). ``select="torch"``: the bounds, a parallel group-sum launch (if
    any) and ``torch.topk`` (highest first). ``bounds="reference"`` runs every step in torch (highest bound first).

    ``launch_opts`` (device paths; for tuning, ``benchmarks/sparse_decode/tune_quest.py``): launch overrides
    by launch — ``"bounds"``: :func:`page_bounds_triton`'s ``block_p``, ``tiles``, ``num_warps``,
    ``num_stages``; ``"group_sum"``, ``"rows"``, ``"registers"``, ``"split"``: as
    :func:`~kvsieve.kernels.shared.select_triton.select_rows` takes them. The pages chosen do not depend
    on them (up to near-ties of the group-summed ranking, whose float32 sums may run in another order)."""
    b, hq, _ = q.shape
    hkv, p = kmin.shape[1], kmin.shape[2]
    k = max(1, min(max_pages, p))
    if select not in ("triton", "torch"):
        raise ValueError(f"select: expected 'triton' or 'torch', got {select!r}")
    if bounds == "reference":
        s = quest_scores_reference(q, kmin, kmax, lengths, page_size, sink, window, share_kv_group, scale)
        counts = selection_counts_reference(lengths, size, page_size, sink, window, k)
    elif bounds != "triton":
        raise ValueError(f"bounds: expected 'triton' or 'reference', got {bounds!r}")
    else:
        from ..shared.select_triton import SELECT_LAUNCHES, check_launch_opts, select_rows

        opts = check_launch_opts(launch_opts, ("bounds", *SELECT_LAUNCHES))
        bounds_opts = opts.pop("bounds", {})

        def score(**kw):
            return page_bounds_triton(q, kmin, kmax, lengths, page_size, sink, window, scale, size=size,
                                      max_pages=k, **bounds_opts, **kw)

        return select_rows(score, batch=b, heads=hq, kv_heads=hkv, n_units=p, k=k,
                           block=bounds_opts.get("block_p", PAGE_BLOCK), share_kv_group=share_kv_group,
                           lengths=lengths, unit=page_size, sink=sink, window=window, select=select,
                           device=q.device, launch_opts=opts, split=True)
    pages = torch.topk(s, k, dim=-1, sorted=True).indices
    return pages, counts[:, None].expand(b, s.shape[1])


__all__ = ["PAGE_BLOCK", "PageSummaries", "page_bounds_reference", "page_bounds_triton", "page_minmax_reference",
           "quest_scores_reference", "quest_select"]
