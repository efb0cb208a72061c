"""Sketch&Walk's decode step up to the attention, fused: :func:`sketch_walk_select`.

Four Triton launches and one ``torch.topk`` per call (one layer, one token per batch row), where the
method's torch path (:mod:`kvsieve.methods.sketchwalk`, ``backend="reference"``: the spec, and what the
tests compare this with) takes about a hundred small ones:

1. ``_sketch_update_kernel``, one program per batch row: the head-mean of the token's query (stored in
   ``q_tok``), its block ``c``'s sums recomputed from the kept queries and the cache's keys (stored),
   and the SRHT of the block's mean key (stored in ``k_sketch``), of its mean query and of the token's
   query (a scratch buffer).
2. ``_scores_walk_kernel``, one program per (batch row, tile of key blocks): the sketched logits of the
   token's query and of block c's mean query against the tile's key sketches with their per-tile
   (max, Σ exp) for the softmax, and, for the walk, the tile's columns of ``w_prev[:c] · Ã[:c]`` (the
   rows of completed blocks; only rows ≥ the tile's first column can be non-zero, by causality).
3. ``_walk_row_kernel``, one program per batch row: the softmaxes from the partials, ``ã = exp(α·log â)``,
   block c's row of Ã written when the token completes it, the walk ``w = w_prev[:c]·Ã[:c] + w_prev[c]·ã``
   (or ``ã``, or ``w_prev ⊙ ã``), ``w / max w`` (the next layer's walk) and the ranking score
   ``w/max w + TIE·ã/max ã`` over blocks ``1..c−1`` (−inf elsewhere).
4. ``torch.topk`` of the ranking (``kmax − 2`` entries, host-known), then ``_select_kernel``, one program
   per batch row: the row's budget ``k = max(2, ⌈ρ(c+1)⌉)`` (float64, as the reference), block 0, the
   first ``k − 2`` of the top-k sorted ascending, block c, written as the page lists of
   :func:`kvsieve.kernels.sparse.weighted_triton.sparse_decode_triton` for every KV head.

Everything reads its sizes from host-known shapes and the rows' positions from ``lengths`` in device
memory: nothing is read on the host, and a replayed CUDA graph recomputes the token's block like the
first call (the recompute-not-accumulate contract of ``LayerSketch``).
"""

from __future__ import annotations

import struct

import torch

from ..triton_utils import launch, next_pow2, triton

MODES = {"one-hop": 0, "walk": 1, "diagonal": 2}

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _sketch_update_kernel(q_ptr, k_ptr, lens_ptr, phi_ptr, qtok_ptr, qsum_ptr, ksum_ptr, ksk_ptr, qsk_ptr,
                              hq, hkv, m,
                              s_qb, s_qh, s_kb, s_kh, s_kn, s_tb, s_tn, s_sb, s_sn, s_kkb, s_kkn, s_pm,
                              BS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        pos = tl.load(lens_ptr + b).to(tl.int64) - 1
        c = pos // BS
        count = (pos - c * BS + 1).to(tl.float32)  # tokens of block c so far, this one included
        tok = c * BS + tl.arange(0, BS)
        before = tok < pos  # the block's earlier tokens: their queries are in q_tok
        seen = tok <= pos
        offs_m = tl.arange(0, BM)
        m_ok = offs_m < m
        kc = tl.zeros([BM], dtype=tl.float32)
        qc = tl.zeros([BM], dtype=tl.float32)
        qt = tl.zeros([BM], dtype=tl.float32)
        for d0 in tl.static_range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            q_new = tl.zeros([BD], dtype=tl.float32)
            for h in range(hq):
                q_new += tl.load(q_ptr + b * s_qb + h * s_qh + offs_d).to(tl.float32)
            q_new = q_new / hq
            tl.store(qtok_ptr + b * s_tb + pos * s_tn + offs_d, q_new)
            q_rows = tl.load(qtok_ptr + b * s_tb + tok[:, None] * s_tn + offs_d[None, :], mask=before[:, None],
                             other=0.0)
            q_sum = tl.sum(q_rows, axis=0) + q_new
            k_sum = tl.zeros([BD], dtype=tl.float32)
            for h in range(hkv):
                rows = tl.load(k_ptr + b * s_kb + h * s_kh + tok[:, None] * s_kn + offs_d[None, :],
                               mask=seen[:, None], other=0.0)
                k_sum += tl.sum(rows.to(tl.float32), axis=0)
            k_sum = k_sum / hkv
            tl.store(qsum_ptr + b * s_sb + c * s_sn + offs_d, q_sum)
            tl.store(ksum_ptr + b * s_sb + c * s_sn + offs_d, k_sum)
            phi = tl.load(phi_ptr + offs_m[:, None] * s_pm + offs_d[None, :], mask=m_ok[:, None], other=0.0)
            kc += tl.sum(phi * k_sum[None, :], axis=1)
            qc += tl.sum(phi * q_sum[None, :], axis=1)
            qt += tl.sum(phi * q_new[None, :], axis=1)
        tl.store(ksk_ptr + b * s_kkb + c * s_kkn + offs_m, kc / count, mask=m_ok)
        tl.store(qsk_ptr + b * 2 * BM + offs_m, qt)  # padding features are 0: they add nothing to a logit
        tl.store(qsk_ptr + b * 2 * BM + BM + offs_m, qc / count)

    @triton.jit
    def _logit_tile(q_ptrs, ks, causal, logit_scale, out_ptrs, part_ptrs):
        """One query sketch's logits over a tile of key sketches, stored with the tile's (max, Σ exp)."""
        logits = tl.where(causal, tl.sum(ks * tl.load(q_ptrs)[None, :], axis=1) * logit_scale, float("-inf"))
        tl.store(out_ptrs, logits)
        mx = tl.max(logits, axis=0)
        tl.store(part_ptrs, mx)
        tl.store(part_ptrs + 1, tl.sum(tl.exp(logits - tl.where(mx > float("-inf"), mx, 0.0)), axis=0))

    @triton.jit
    def _scores_walk_kernel(lens_ptr, ksk_ptr, qsk_ptr, at_ptr, prev_ptr, logit_ptr, part_ptr, g_ptr,
                            m, n, n_pad, tiles, logit_scale,
                            s_kkb, s_kkn, s_ab, s_ar, s_pb,
                            BS: tl.constexpr, BJ: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr,
                            WALK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1)
        c = (tl.load(lens_ptr + b).to(tl.int64) - 1) // BS
        j = t * BJ + tl.arange(0, BJ)
        causal = j <= c
        offs_m = tl.arange(0, BM)
        ks = tl.load(ksk_ptr + b * s_kkb + j[:, None] * s_kkn + offs_m[None, :],
                     mask=causal[:, None] & (offs_m < m)[None, :], other=0.0)
        # row 0: the token's query; row 1: block c's mean query
        _logit_tile(qsk_ptr + b * 2 * BM + offs_m, ks, causal, logit_scale, logit_ptr + b * 2 * n_pad + j,
                    part_ptr + (b * 2 * tiles + t) * 2)
        _logit_tile(qsk_ptr + (b * 2 + 1) * BM + offs_m, ks, causal, logit_scale,
                    logit_ptr + (b * 2 + 1) * n_pad + j, part_ptr + ((b * 2 + 1) * tiles + t) * 2)
        if WALK:
            acc = tl.zeros([BJ], dtype=tl.float32)
            for i0 in range(t.to(tl.int64) * BJ, c, BI):  # rows i < j of Ã are zero in column j: start at the tile
                rows = i0 + tl.arange(0, BI)
                r_ok = rows < c
                p = tl.load(prev_ptr + b * s_pb + rows, mask=r_ok, other=0.0)
                a = tl.load(at_ptr + b * s_ab + rows[:, None] * s_ar + j[None, :],
                            mask=r_ok[:, None] & (j < n)[None, :], other=0.0)
                acc += tl.sum(p[:, None] * a, axis=0)
            tl.store(g_ptr + b * n_pad + j, acc)

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
    def _walk_row_kernel(lens_ptr, logit_ptr, part_ptr, g_ptr, prev_ptr, at_ptr, w_ptr, rank_ptr,
                         n, n_pad, tiles, alpha, tie, s_ab, s_ar, s_pb,
                         BS: tl.constexpr, BJ: tl.constexpr, BT: tl.constexpr, MODE: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        pos = tl.load(lens_ptr + b).to(tl.int64) - 1
        c = pos // BS
        in_block = pos - c * BS + 1  # block c's tokens so far; at BS its row of Ã is final
        lse_t = _softmax_stat(part_ptr, b * 2 * tiles, tiles, BT)
        lse_c = _softmax_stat(part_ptr, (b * 2 + 1) * tiles, tiles, BT)
        if MODE == 1:
            p_c = tl.load(prev_ptr + b * s_pb + c)
        else:
            p_c = 0.0
        w_max = tl.zeros([], dtype=tl.float32)
        a_max = tl.zeros([], dtype=tl.float32)
        for j0 in range(0, n, BJ):  # pass 1: the maxima; block c's row of Ã
            j = j0 + tl.arange(0, BJ)
            ok = j < n
            a = tl.exp(alpha * (tl.load(logit_ptr + b * 2 * n_pad + j, mask=ok, other=float("-inf")) - lse_t))
            if MODE == 1:
                w = tl.load(g_ptr + b * n_pad + j, mask=ok, other=0.0) + p_c * a
            elif MODE == 2:
                w = tl.load(prev_ptr + b * s_pb + j, mask=ok, other=0.0) * a
            else:
                w = a
            w_max = tl.maximum(w_max, tl.max(w, axis=0))
            a_max = tl.maximum(a_max, tl.max(a, axis=0))
            a_c = tl.exp(alpha * (tl.load(logit_ptr + (b * 2 + 1) * n_pad + j, mask=ok, other=float("-inf"))
                                  - lse_c))
            # the condition as a vector: Triton's interpreter rejects a mask that mixes in a scalar bool
            tl.store(at_ptr + b * s_ab + c * s_ar + j, a_c, mask=ok & (j * 0 + in_block == BS))
        w_max = tl.maximum(w_max, 1.1754943508222875e-38)  # float32 tiny, as normalize_rows
        a_max = tl.maximum(a_max, 1.1754943508222875e-38)
        for j0 in range(0, n, BJ):  # pass 2: recomputed from the inputs (no read-back of this program's stores)
            j = j0 + tl.arange(0, BJ)
            ok = j < n
            a = tl.exp(alpha * (tl.load(logit_ptr + b * 2 * n_pad + j, mask=ok, other=float("-inf")) - lse_t))
            if MODE == 1:
                w = tl.load(g_ptr + b * n_pad + j, mask=ok, other=0.0) + p_c * a
            elif MODE == 2:
                w = tl.load(prev_ptr + b * s_pb + j, mask=ok, other=0.0) * a
            else:
                w = a
            w = w / w_max
            tl.store(w_ptr + b * n + j, w, mask=ok)
            rank = tl.where((j >= 1) & (j < c), w + tie * (a / a_max), float("-inf"))
            tl.store(rank_ptr + b * n + j, rank, mask=ok)

    @triton.jit
    def _select_kernel(lens_ptr, top_ptr, pages_ptr, npages_ptr, rho_bits, n_blocks, extra, kmax, hkv,
                       BS: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, FIXED: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        c = (tl.load(lens_ptr + b).to(tl.int64) - 1) // BS
        # block_budget in float64, as the reference: max(2, ⌈ρ·base − 1e-9⌉), at most c + 1
        rho = rho_bits.to(tl.float64, bitcast=True)
        if FIXED:
            base = (c * 0 + n_blocks).to(tl.float64)
        else:
            base = (c + 1).to(tl.float64)
        x = rho * base - tl.full([], 1e-9, tl.float64)
        whole = x.to(tl.int64)  # truncation: floor for x ≥ 0, and a negative x rounds up to ≤ 0 anyway
        k = whole + (whole.to(tl.float64) < x).to(tl.int64)
        k = tl.minimum(tl.maximum(k, 2), c + 1)
        offs_e = tl.arange(0, BE)
        used = offs_e < k - 2  # topk returns the best first: its first k − 2 entries are the row's
        top = tl.load(top_ptr + b * extra + offs_e, mask=used, other=0).to(tl.int32)
        ordered = tl.sort(tl.where(used, top, 2147483647), dim=0)  # the used ones ascending, first
        offs_k = tl.arange(0, BK)
        ends = tl.where(offs_k == k - 1, c, 0).to(tl.int32)  # block 0 first, block c last, 0 as padding
        ends_ok = (offs_k < kmax) & ((offs_k == 0) | (offs_k >= k - 1))
        for h in range(hkv):
            row = pages_ptr + (b * hkv + h) * kmax
            tl.store(row + 1 + offs_e, ordered, mask=used)
            tl.store(row + offs_k, ends, mask=ends_ok)
            tl.store(npages_ptr + b * hkv + h, k.to(tl.int32))


def _float_bits(x: float) -> int:
    """A float's IEEE double bits as a signed 64-bit integer: Triton passes Python floats as float32, which
    would move ρ(c+1) across an integer (ρ = 0.1, c + 1 = 100)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def sketch_walk_select(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *, q_tok: torch.Tensor,
                       q_sum: torch.Tensor, k_sum: torch.Tensor, k_sketch: torch.Tensor, a_tilde: torch.Tensor,
                       phi: torch.Tensor, n_blocks: int, block_size: int, logit_scale: float, alpha: float,
                       mode: str, previous: torch.Tensor | None, density: float, fixed_k: bool,
                       kmax: int, tie: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step's state update and selection, in place on the layer's state.

    ``q [B, Hq, d]``, ``k [B, Hkv, N, d]`` (the cache), ``lengths [B]`` int32 (row b's new token is at
    ``lengths[b] − 1``); the state tensors are float32 (``q_tok [B, ≥N, d]``, ``q_sum``/``k_sum
    [B, ≥n, d]``, ``k_sketch [B, ≥n, m]``, ``a_tilde [B, ≥n, ≥n]``, last dim contiguous), ``phi [m, d]``
    the SRHT; ``n_blocks`` = ⌈N / block_size⌉; ``mode`` one of :data:`MODES` (``walk``/``diagonal`` need
    ``previous [B, n]``, the walk of the previous sparse layer); ``kmax`` the largest budget
    (``max_block_budget``); ``tie`` the one-hop score's weight in the ranking.

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
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k: expected a contiguous last dim")
    if lengths.dtype != torch.int32:
        raise ValueError(f"lengths: expected int32, got {lengths.dtype}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {sorted(MODES)}, got {mode!r}")
    walk_mode = MODES[mode] if previous is not None else 0
    if walk_mode and (previous.shape != (b, n) or previous.dtype != f32 or previous.stride(-1) != 1):
        raise ValueError(f"previous: expected float32 [{b}, {n}] with a contiguous last dim, got "
                         f"{previous.dtype} {tuple(previous.shape)}")
    bm = next_pow2(m)
    # Tiles of key blocks for the logits and the walk's GEMV: narrow enough to spread n = 2048 blocks
    # (128k tokens) over ~128 programs, the GEMV's read of Ã being the step's largest.
    bj = min(128, max(16, next_pow2(-(-n // 128))))
    tiles = -(-n // bj)
    n_pad = tiles * bj
    qsk = torch.empty(b, 2, bm, device=dev, dtype=f32)
    logits = torch.empty(b, 2, n_pad, device=dev, dtype=f32)
    parts = torch.empty(b, 2, tiles, 2, device=dev, dtype=f32)
    g = torch.empty(b, n_pad, device=dev, dtype=f32) if walk_mode == 1 else logits
    w = torch.empty(b, n, device=dev, dtype=f32)
    rank = torch.empty(b, n, device=dev, dtype=f32)
    prev = previous if walk_mode else w  # an unread stand-in
    if k_sum.stride()[:2] != q_sum.stride()[:2]:
        raise ValueError("k_sum, q_sum: expected the same strides")
    bd = min(d, 64)
    launch(_sketch_update_kernel, (b,), q, k, lengths, phi, q_tok, q_sum, k_sum, k_sketch, qsk, hq, hkv, m,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), q_tok.stride(0), q_tok.stride(1),
           q_sum.stride(0), q_sum.stride(1), k_sketch.stride(0), k_sketch.stride(1), phi.stride(0),
           BS=block_size, D=d, BD=bd, BM=bm, num_warps=4)
    launch(_scores_walk_kernel, (b, tiles), lengths, k_sketch, qsk, a_tilde, prev, logits, parts, g,
           m, n, n_pad, tiles, float(logit_scale), k_sketch.stride(0), k_sketch.stride(1), a_tilde.stride(0),
           a_tilde.stride(1), prev.stride(0),
           BS=block_size, BJ=bj, BM=bm, BI=64, WALK=walk_mode == 1, num_warps=4)
    launch(_walk_row_kernel, (b,), lengths, logits, parts, g, prev, a_tilde, w, rank, n, n_pad, tiles,
           float(alpha), float(tie), a_tilde.stride(0), a_tilde.stride(1), prev.stride(0),
           BS=block_size, BJ=min(1024, next_pow2(n)), BT=next_pow2(tiles), MODE=walk_mode, num_warps=4)
    extra = min(kmax - 2, n)
    top = torch.topk(rank, extra, dim=-1).indices if extra > 0 else rank  # rank: an unread stand-in
    pages = torch.empty(b, hkv, kmax, device=dev, dtype=torch.int32)
    n_pages = torch.empty(b, hkv, device=dev, dtype=torch.int32)
    launch(_select_kernel, (b,), lengths, top, pages, n_pages, _float_bits(density), n, max(extra, 0), kmax, hkv,
           BS=block_size, BE=next_pow2(max(extra, 2)), BK=next_pow2(max(kmax, 2)), FIXED=bool(fixed_k), num_warps=1)
    return w, pages, n_pages
