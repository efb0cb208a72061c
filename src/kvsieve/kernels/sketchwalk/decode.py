"""Sketch&Walk's decode step up to the attention, fused: :func:`sketch_walk_select`.

Four Triton launches and one ``torch.topk`` per call (one layer, one token per batch row), where the
method's torch path (:mod:`kvsieve.methods.sketchwalk`, ``backend="reference"``: the spec, and what the
tests compare this with) launches about a hundred small kernels:

1. ``_sketch_update_kernel``, one program per (batch row, chunk of head-dim features): the head-mean of
   the token's query (stored in ``q_tok``), its block ``c``'s sums recomputed from the kept queries and
   the cache's keys (stored), and the chunk's share of the SRHT Φx of the token's query, the block's
   query sum and key sum.
2. ``_scores_walk_kernel``, one program per (batch row, tile of key blocks, split of the walk's rows):
   the sketched logits of the token's query and of block c's mean query against the tile's key sketches
   (block c's from the projections) with the tile's (max, Σ exp) for the softmaxes; and, for the walk,
   the split's share of the tile's columns of ``w_prev[:c] · Ã[:c]`` (only rows ≥ the tile's first
   column can be non-zero, by causality) — a GEMV over Ã's causal half, the step's largest read.
3. ``_walk_row_kernel``, one program per batch row: block c's key sketch (stored), the softmaxes from
   the partials, ``ã = exp(α·log â)``, block c's row of Ã written when the token completes the block,
   the walk ``w = w_prev[:c]·Ã[:c] + w_prev[c]·ã`` (or ``ã``: one-hop and a layer without a previous
   walk; ``w_prev ⊙ ã``: diagonal), ``w / max w`` (the next layer's walk) and the ranking score
   ``w/max w + tie·ã/max ã`` over blocks ``1..c−1`` (−inf elsewhere).
4. ``torch.topk`` of the ranking (``kmax − 2`` entries, host-known; unsorted up to 256), then ``_select_kernel``,
   one program per batch row: the row's budget ``k = max(2, ⌈ρ(c+1)⌉)`` (in float64, as the
   reference), the best ``k − 2`` of the top-k entries (score, then lower block), block 0, those sorted
   ascending, block c, written as the page lists of
   :func:`kvsieve.kernels.sparse.weighted_triton.sparse_decode_triton` for every KV head.

Sizes come from host-known shapes and the rows' positions from ``lengths`` in device memory: nothing is
read on the host, every buffer is allocated per call from host-known sizes (graph-capturable), there are
no atomics (a replay equals an eager call bit for bit), and a replay recomputes the token's block like
the first call (``LayerSketch``'s recompute-not-accumulate contract).
"""

from __future__ import annotations

import torch

from ..triton_utils import launch, next_pow2, triton
from .common import float_bits

MODES = {"one-hop": 0, "walk": 1, "diagonal": 2}

if triton is not None:
    import triton.language as tl

    from .common import block_budget

    @triton.jit
    def _block_position(lens_ptr, b, BS: tl.constexpr):
        """``(pos, c, count)``: the row's new token, its block, and the block's tokens so far (this one too)."""
        pos = tl.load(lens_ptr + b).to(tl.int64) - 1
        c = pos // BS
        return pos, c, pos - c * BS + 1

    @triton.jit
    def _sketch_update_kernel(q_ptr, k_ptr, lens_ptr, phi_ptr, qtok_ptr, qsum_ptr, ksum_ptr, proj_ptr,
                              hq, hkv, m,
                              s_qb, s_qh, s_kb, s_kh, s_kn, s_tb, s_tn, s_sb, s_sn, s_pm,
                              BS: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, BHK: tl.constexpr,
                              BM: tl.constexpr, NC: tl.constexpr):
        # One program per (batch row, chunk of BD features): each tile is one load, so the step's reads
        # (the block's keys of every KV head, at most BS·Hkv rows) are in flight at once.
        b = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        pos, c, _ = _block_position(lens_ptr, b, BS)
        offs_d = chunk * BD + tl.arange(0, BD)
        offs_h = tl.arange(0, BH)
        q = tl.load(q_ptr + b * s_qb + offs_h[:, None] * s_qh + offs_d[None, :], mask=(offs_h < hq)[:, None],
                    other=0.0)
        q_new = tl.sum(q.to(tl.float32), axis=0) / hq
        tl.store(qtok_ptr + b * s_tb + pos * s_tn + offs_d, q_new)
        tok = c * BS + tl.arange(0, BS)
        q_rows = tl.load(qtok_ptr + b * s_tb + tok[:, None] * s_tn + offs_d[None, :], mask=(tok < pos)[:, None],
                         other=0.0)  # the block's earlier tokens (this one's query is q_new)
        q_sum = tl.sum(q_rows, axis=0) + q_new
        r = tl.arange(0, BHK * BS)  # (KV head, token of the block) pairs
        head = r // BS
        tok_r = c * BS + r % BS
        k_rows = tl.load(k_ptr + b * s_kb + head[:, None] * s_kh + tok_r[:, None] * s_kn + offs_d[None, :],
                         mask=((head < hkv) & (tok_r <= pos))[:, None], other=0.0)
        k_sum = tl.sum(k_rows.to(tl.float32), axis=0) / hkv
        tl.store(qsum_ptr + b * s_sb + c * s_sn + offs_d, q_sum)
        tl.store(ksum_ptr + b * s_sb + c * s_sn + offs_d, k_sum)
        offs_m = tl.arange(0, BM)
        phi = tl.load(phi_ptr + offs_m[:, None] * s_pm + offs_d[None, :], mask=(offs_m < m)[:, None], other=0.0)
        # This chunk's share of Φx (padding features stay 0: they add nothing to a logit); the next
        # kernel sums the chunks.
        out = proj_ptr + ((b * NC + chunk) * 3) * BM + offs_m
        tl.store(out, tl.sum(phi * q_new[None, :], axis=1))
        tl.store(out + BM, tl.sum(phi * q_sum[None, :], axis=1))
        tl.store(out + 2 * BM, tl.sum(phi * k_sum[None, :], axis=1))

    @triton.jit
    def _projection(proj_ptr, b, which, BM: tl.constexpr, NC: tl.constexpr):
        """Φx summed over the feature chunks: ``which`` 0 the token's query, 1 block c's query sum, 2 its key sum."""
        offs_m = tl.arange(0, BM)
        total = tl.zeros([BM], dtype=tl.float32)
        for chunk in tl.static_range(NC):
            total += tl.load(proj_ptr + ((b * NC + chunk) * 3 + which) * BM + offs_m)
        return total

    @triton.jit
    def _logit_tile(qv, ks, causal, logit_scale, out_ptrs, part_ptrs):
        """One query sketch's logits over a tile of key sketches, stored with the tile's (max, Σ exp)."""
        logits = tl.where(causal, tl.sum(ks * qv[None, :], axis=1) * logit_scale, float("-inf"))
        tl.store(out_ptrs, logits)
        mx = tl.max(logits, axis=0)
        tl.store(part_ptrs, mx)
        tl.store(part_ptrs + 1, tl.sum(tl.exp(logits - tl.where(mx > float("-inf"), mx, 0.0)), axis=0))

    @triton.jit
    def _scores_walk_kernel(lens_ptr, ksk_ptr, proj_ptr, at_ptr, prev_ptr, logit_ptr, part_ptr, g_ptr,
                            m, n_pad, tiles, logit_scale,
                            s_kkb, s_kkn, s_ab, s_ar, s_pb,
                            BS: tl.constexpr, BJ: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr,
                            NC: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, WALK: tl.constexpr):
        # Program (b, t, s): key blocks j of tile t; split s of the walk's rows.
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1)
        s = tl.program_id(2)
        _, c, count = _block_position(lens_ptr, b, BS)
        j = t * BJ + tl.arange(0, BJ)
        if s == 0:
            offs_m = tl.arange(0, BM)
            ks = tl.load(ksk_ptr + b * s_kkb + j[:, None] * s_kkn + offs_m[None, :],
                         mask=(j < c)[:, None] & (offs_m < m)[None, :], other=0.0)
            k_c = _projection(proj_ptr, b, 2, BM, NC) / count.to(tl.float32)  # block c's sketch, not yet stored
            ks = tl.where((j == c)[:, None], k_c[None, :], ks)
            causal = j <= c
            # row 0: the token's query; row 1: block c's mean query
            _logit_tile(_projection(proj_ptr, b, 0, BM, NC), ks, causal, logit_scale,
                        logit_ptr + b * 2 * n_pad + j, part_ptr + (b * 2 * tiles + t) * 2)
            _logit_tile(_projection(proj_ptr, b, 1, BM, NC) / count.to(tl.float32), ks, causal, logit_scale,
                        logit_ptr + (b * 2 + 1) * n_pad + j, part_ptr + ((b * 2 + 1) * tiles + t) * 2)
        if WALK:  # w_prev[:c] · Ã[:c] over this split's rows; rows i < j of Ã are zero in column j
            acc = tl.zeros([BJ], dtype=tl.float32)
            lo = tl.maximum(s * ROWS, t * BJ).to(tl.int64)
            hi = tl.minimum((s + 1) * ROWS, c)
            for i0 in range(lo, hi, BI):
                rows = i0 + tl.arange(0, BI)
                r_ok = rows < hi
                p = tl.load(prev_ptr + b * s_pb + rows, mask=r_ok, other=0.0)
                a = tl.load(at_ptr + b * s_ab + rows[:, None] * s_ar + j[None, :], mask=r_ok[:, None], other=0.0)
                acc += tl.sum(p[:, None] * a, axis=0)
            tl.store(g_ptr + (b * SPLITS + s) * n_pad + j, acc)

    @triton.jit
    def _softmax_stat(part_ptr, base, tiles, BT: tl.constexpr):
        """log Σ exp over the tiles' partials (tile 0 always holds block 0, so the max is finite)."""
        offs = tl.arange(0, BT)
        ok = offs < tiles
        mx = tl.load(part_ptr + (base + offs) * 2, mask=ok, other=float("-inf"))
        total = tl.load(part_ptr + (base + offs) * 2 + 1, mask=ok, other=0.0)
        top = tl.max(mx, axis=0)
        return top + tl.log(tl.sum(total * tl.exp(mx - top), axis=0))

    @triton.jit
    def _walk_row_kernel(lens_ptr, proj_ptr, logit_ptr, part_ptr, g_ptr, prev_ptr, ksk_ptr, at_ptr, w_ptr,
                         rank_ptr, m, n, n_pad, tiles, alpha, tie, s_kkb, s_kkn, s_ab, s_ar, s_pb,
                         BS: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr, BM: tl.constexpr,
                         NC: tl.constexpr, SPLITS: tl.constexpr, MODE: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        _, c, count = _block_position(lens_ptr, b, BS)
        offs_m = tl.arange(0, BM)
        tl.store(ksk_ptr + b * s_kkb + c * s_kkn + offs_m, _projection(proj_ptr, b, 2, BM, NC) / count.to(tl.float32),
                 mask=offs_m < m)
        lse_t = _softmax_stat(part_ptr, b * 2 * tiles, tiles, BT)
        lse_c = _softmax_stat(part_ptr, (b * 2 + 1) * tiles, tiles, BT)
        if MODE == 1:
            p_c = tl.load(prev_ptr + b * s_pb + c)
        else:
            p_c = 0.0
        w_max = tl.zeros([], dtype=tl.float32)
        a_max = tl.zeros([], dtype=tl.float32)
        for j0 in range(0, n, BJ):  # pass 1: the walk (unnormalised), the maxima, block c's row of Ã
            j = j0 + tl.arange(0, BJ)
            ok = j < n
            a = tl.exp(alpha * (tl.load(logit_ptr + b * 2 * n_pad + j, mask=ok, other=float("-inf")) - lse_t))
            if MODE == 1:
                w = p_c * a
                for s in tl.static_range(SPLITS):
                    w += tl.load(g_ptr + (b * SPLITS + s) * n_pad + j, mask=ok, other=0.0)
            elif MODE == 2:
                w = tl.load(prev_ptr + b * s_pb + j, mask=ok, other=0.0) * a
            else:
                w = a
            tl.store(w_ptr + b * n + j, w, mask=ok)
            w_max = tl.maximum(w_max, tl.max(w, axis=0))
            a_max = tl.maximum(a_max, tl.max(a, axis=0))
            a_c = tl.exp(alpha * (tl.load(logit_ptr + (b * 2 + 1) * n_pad + j, mask=ok, other=float("-inf"))
                                  - lse_c))
            # the condition as a vector: Triton's interpreter rejects a mask that mixes in a scalar bool
            tl.store(at_ptr + b * s_ab + c * s_ar + j, a_c, mask=ok & (j * 0 + count == BS))
        w_max = tl.maximum(w_max, 1.1754943508222875e-38)  # float32 tiny, as normalize_rows
        a_max = tl.maximum(a_max, 1.1754943508222875e-38)
        tl.debug_barrier()  # pass 2 reads what other threads of this program stored in pass 1
        for j0 in range(0, n, BJ):  # pass 2: normalise; the ranking score over blocks 1..c−1
            j = j0 + tl.arange(0, BJ)
            ok = j < n
            a = tl.exp(alpha * (tl.load(logit_ptr + b * 2 * n_pad + j, mask=ok, other=float("-inf")) - lse_t))
            w = tl.load(w_ptr + b * n + j, mask=ok, other=0.0) / w_max
            tl.store(w_ptr + b * n + j, w, mask=ok)
            rank = tl.where((j >= 1) & (j < c), w + tie * (a / a_max), float("-inf"))
            tl.store(rank_ptr + b * n + j, rank, mask=ok)

    @triton.jit
    def _select_kernel(lens_ptr, val_ptr, top_ptr, pages_ptr, npages_ptr, rho_bits, n_blocks, extra, kmax, hkv,
                       BS: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                       FIXED: tl.constexpr, SORTED: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        _, c, _ = _block_position(lens_ptr, b, BS)
        k = block_budget(rho_bits, c, n_blocks, FIXED)
        offs_e = tl.arange(0, BE)
        e_ok = offs_e < extra
        idx = tl.load(top_ptr + b * extra + offs_e, mask=e_ok, other=0).to(tl.int32)
        if SORTED:  # best first: the row's k − 2 are the first entries
            used = offs_e < k - 2
        else:  # entry e is among the best k − 2 when fewer entries beat it (a higher score, or a tie at a lower block)
            val = tl.load(val_ptr + b * extra + offs_e, mask=e_ok, other=float("-inf"))
            better = tl.zeros([BE], dtype=tl.int32)
            for e0 in range(0, extra, BC):
                rival = e0 + tl.arange(0, BC)
                r_ok = rival < extra
                r_val = tl.load(val_ptr + b * extra + rival, mask=r_ok, other=float("-inf"))[None, :]
                r_idx = tl.load(top_ptr + b * extra + rival, mask=r_ok, other=0).to(tl.int32)[None, :]
                beats = (r_val > val[:, None]) | ((r_val == val[:, None]) & (r_idx < idx[:, None]))
                better += tl.sum((beats & r_ok[None, :]).to(tl.int32), axis=1)
            used = e_ok & (better < k - 2)
        ordered = tl.sort(tl.where(used, idx, 2147483647), dim=0)  # the used blocks ascending, first
        offs_k = tl.arange(0, BK)
        ends = tl.where(offs_k == k - 1, c, 0).to(tl.int32)  # block 0 first, block c last, 0 as padding
        ends_ok = (offs_k < kmax) & ((offs_k == 0) | (offs_k >= k - 1))
        first = offs_e < k - 2
        for h in range(hkv):
            row = pages_ptr + (b * hkv + h) * kmax
            tl.store(row + 1 + offs_e, ordered, mask=first)
            tl.store(row + offs_k, ends, mask=ends_ok)
            tl.store(npages_ptr + b * hkv + h, k.to(tl.int32))


def _prev_pow2(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def sketch_walk_select(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *, q_tok: torch.Tensor,
                       q_sum: torch.Tensor, k_sum: torch.Tensor, k_sketch: torch.Tensor, a_tilde: torch.Tensor,
                       phi: torch.Tensor, n_blocks: int, block_size: int, logit_scale: float, alpha: float,
                       mode: str, previous: torch.Tensor | None, density: float, fixed_k: bool,
                       kmax: int, tie: float, tile_cols: int | None = None,
                       split_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step's state update and selection, in place on the layer's state.

    ``q [B, Hq, d]``, ``k [B, Hkv, N, d]`` (the cache), ``lengths [B]`` int32 (row b's new token is at
    ``lengths[b] − 1``); the state tensors are float32 (``q_tok [B, ≥N, d]``, ``q_sum``/``k_sum
    [B, ≥n, d]``, ``k_sketch [B, ≥n, m]``, ``a_tilde [B, ≥n, ≥n]``, last dim contiguous), ``phi [m, d]``
    the SRHT; ``n_blocks`` = ⌈N / block_size⌉; ``mode`` one of :data:`MODES` (``walk``/``diagonal`` need
    ``previous [B, n]``, the walk of the previous sparse layer); ``kmax`` the largest budget
    (``max_block_budget``); ``tie`` the one-hop score's weight in the ranking; ``tile_cols``/``split_rows``
    (powers of two ≥ 16) override the GEMV's tiling (tests use them to run several tiles at small n).

    Returns ``(w [B, n] float32, pages [B, Hkv, kmax] int32, n_pages [B, Hkv] int32)``: the normalised
    walk and the selected blocks (ascending, block 0 first and block c last, padding 0)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    m = phi.shape[0]
    n = n_blocks
    dev = q.device
    f32 = torch.float32
    for name, t in (("q_tok", q_tok), ("q_sum", q_sum), ("k_sum", k_sum), ("k_sketch", k_sketch),
                    ("a_tilde", a_tilde), ("phi", phi)):
        if t.dtype != f32 or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected float32 with a contiguous last dim, got {t.dtype}, "
                             f"strides {t.stride()}")
    if k_sum.stride()[:2] != q_sum.stride()[:2]:
        raise ValueError("k_sum, q_sum: expected the same strides")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k: expected a contiguous last dim")
    if d & (d - 1) or d < 16:
        raise ValueError(f"q: head dim {d} (the sketch kernels take a power of two ≥ 16)")
    if lengths.dtype != torch.int32:
        raise ValueError(f"lengths: expected int32, got {lengths.dtype}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {sorted(MODES)}, got {mode!r}")
    walk_mode = MODES[mode] if previous is not None else 0
    if walk_mode and (previous.shape != (b, n) or previous.dtype != f32 or previous.stride(-1) != 1):
        raise ValueError(f"previous: expected float32 [{b}, {n}] with a contiguous last dim, got "
                         f"{previous.dtype} {tuple(previous.shape)}")
    bs = block_size
    bm, bhk = next_pow2(m), next_pow2(hkv)
    # Feature chunks small enough that one chunk of the block's keys (Hkv·B rows) is one 16k-element tile.
    bd = min(d, 64, max(16, _prev_pow2(16384 // (bhk * bs))))
    nc = d // bd
    # Key-block tiles of up to 64 columns (256-byte rows of Ã) and up to 8 row splits of the walk's GEMV,
    # the step's largest read (Ã's causal half: 8 MB at 128k tokens): ~128-256 programs at 128k.
    bj = tile_cols or min(64, max(16, next_pow2(-(-n // 16))))
    rows = split_rows or max(64, next_pow2(-(-n // 8)))
    for name, x in (("tile_cols", bj), ("split_rows", rows)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {x}")
    tiles = -(-n // bj)
    n_pad = tiles * bj
    bi = min(64, rows)
    splits = -(-n // rows)
    proj = torch.empty(b, nc, 3, bm, device=dev, dtype=f32)
    logits = torch.empty(b, 2, n_pad, device=dev, dtype=f32)
    parts = torch.empty(b, 2, tiles, 2, device=dev, dtype=f32)
    g = torch.empty(b, splits, n_pad, device=dev, dtype=f32) if walk_mode == 1 else logits
    w = torch.empty(b, n, device=dev, dtype=f32)
    rank = torch.empty(b, n, device=dev, dtype=f32)
    prev = previous if walk_mode else w  # an unread stand-in
    launch(_sketch_update_kernel, (b, nc), q, k, lengths, phi, q_tok, q_sum, k_sum, proj, hq, hkv, m,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), q_tok.stride(0), q_tok.stride(1),
           q_sum.stride(0), q_sum.stride(1), phi.stride(0),
           BS=bs, BD=bd, BH=next_pow2(hq), BHK=bhk, BM=bm, NC=nc, num_warps=8 if bhk * bs * bd > 4096 else 4)
    launch(_scores_walk_kernel, (b, tiles, splits if walk_mode == 1 else 1), lengths, k_sketch, proj, a_tilde,
           prev, logits, parts, g, m, n_pad, tiles, float(logit_scale), k_sketch.stride(0), k_sketch.stride(1),
           a_tilde.stride(0), a_tilde.stride(1), prev.stride(0),
           BS=bs, BJ=bj, BM=bm, BI=bi, NC=nc, ROWS=rows, SPLITS=splits, WALK=walk_mode == 1, num_warps=4)
    # One program per row reads the row's partials and writes w and the ranking: one tile up to 2048 blocks
    # (128k tokens of 64), so that each pass's loads are in flight together.
    row_tile = min(2048, next_pow2(n))
    launch(_walk_row_kernel, (b,), lengths, proj, logits, parts, g, prev, k_sketch, a_tilde, w, rank, m, n, n_pad,
           tiles, float(alpha), float(tie), k_sketch.stride(0), k_sketch.stride(1), a_tilde.stride(0),
           a_tilde.stride(1), prev.stride(0),
           BS=bs, BJ=row_tile, BT=next_pow2(tiles), BM=bm, NC=nc, SPLITS=splits, MODE=walk_mode,
           num_warps=8 if row_tile >= 1024 else 4)
    extra = min(kmax - 2, n)
    # Up to 256 entries topk comes unsorted and the select kernel ranks them pairwise (saving topk's sort
    # launch); beyond, the pairwise ranking (quadratic) would cost more than the sort.
    ranked = extra > 256
    if extra > 0:
        val, top = torch.topk(rank, extra, dim=-1, sorted=ranked)
    else:
        val = top = rank  # unread stand-ins
    pages = torch.empty(b, hkv, kmax, device=dev, dtype=torch.int32)
    n_pages = torch.empty(b, hkv, device=dev, dtype=torch.int32)
    be = next_pow2(max(extra, 2))
    launch(_select_kernel, (b,), lengths, val, top, pages, n_pages, float_bits(density), n, max(extra, 0), kmax,
           hkv, BS=bs, BE=be, BC=max(2, min(be, 4096 // be)), BK=next_pow2(max(kmax, 2)), FIXED=bool(fixed_k),
           SORTED=ranked, num_warps=4)
    return w, pages, n_pages
