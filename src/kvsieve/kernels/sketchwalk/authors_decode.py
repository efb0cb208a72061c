"""variant=authors' decode selection on the device: the quantile threshold of a step's walk row over the
candidate blocks, the kept blocks and the page list the weighted sparse kernel reads.

- :func:`select_pages_reference`: torch (a sort, two gathers, ``torch.lerp`` — ``torch.nanquantile``'s linear
  quantile; then the kept blocks and their compaction), a dozen launches;
- :func:`select_pages_triton`: one launch, one program per row (the row sorted in registers with ``tl.sort``).

Per row: ``n`` blocks, candidates ``[sink_blocks, n − window_blocks)``, the threshold their ``q`` quantile
(NaN without a candidate), kept = above it, or a sink block, or one of the last ``window_blocks``; the pages
are the kept blocks reaching past the first ``window_tokens`` keys (those are read as the dense prefix),
ascending, at most ``max_pages`` (the caller's host bound).
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import launch, next_pow2, triton


def quantile_rows(w: torch.Tensor, candidate: torch.Tensor, q: float) -> torch.Tensor:
    """``[B]``: ``torch.nanquantile``'s linear quantile ``q`` of ``w`` over each row's candidates (NaN
    where none), with a sort and two gathers (no host read)."""
    vals = torch.where(candidate, w, torch.full_like(w, float("inf")))
    srt = torch.sort(vals, dim=-1).values
    m = candidate.sum(-1)
    ranks = (m - 1).clamp(min=0).to(w.dtype) * q  # q rounded to w's dtype, as nanquantile's q tensor
    lo = ranks.long()
    hi = torch.ceil(ranks).long()
    v_lo = srt.gather(1, lo[:, None])[:, 0]
    v_hi = srt.gather(1, hi[:, None])[:, 0]
    th = torch.lerp(v_lo, v_hi, ranks - lo.to(w.dtype))
    return torch.where(m > 0, th, torch.full_like(th, float("nan")))


def kept_blocks_reference(walk: torch.Tensor, n: torch.Tensor, sink_blocks: torch.Tensor, window_blocks: torch.Tensor,
                          q: float) -> torch.Tensor:
    """``[B, C]`` bool: the blocks a step keeps (module docstring)."""
    cols = torch.arange(walk.shape[1], device=walk.device)[None, :]
    live = cols < n[:, None]
    first_window = n[:, None] - window_blocks[:, None]
    candidate = live & (cols >= sink_blocks[:, None]) & (cols < first_window)
    th = quantile_rows(walk, candidate, q)
    return live & ((walk > th[:, None]) | (cols < sink_blocks[:, None]) | (cols >= first_window))


def page_list(kept: torch.Tensor, window_tokens: torch.Tensor, block_size: int,
              max_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages [B, max_pages] int32, counts [B] int32)`` of kept blocks ``[B, C]`` (module docstring);
    entries past a row's count are 0."""
    cols = torch.arange(kept.shape[1], device=kept.device)
    kept = kept & ((cols[None, :] + 1) * block_size > window_tokens[:, None])
    order = torch.cumsum(kept.to(torch.int32), -1) - 1
    target = torch.where(kept & (order < max_pages), order.long(), max_pages)
    pages = torch.zeros(kept.shape[0], max_pages + 1, dtype=torch.int32, device=kept.device)
    pages.scatter_(1, target, cols.to(torch.int32)[None, :].expand_as(target).contiguous())
    return pages[:, :max_pages].contiguous(), kept.sum(-1).clamp(max=max_pages).to(torch.int32)


def select_pages_reference(walk, n, sink_blocks, window_blocks, window_tokens, *, q: float, block_size: int,
                           max_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(kept [B, C] bool, pages [B, max_pages] int32, counts [B] int32)`` in torch."""
    kept = kept_blocks_reference(walk, n, sink_blocks, window_blocks, q)
    pages, counts = page_list(kept, window_tokens, block_size, max_pages)
    return kept, pages, counts


if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_cols", "max_pages"])
    def _select_kernel(walk_ptr, n_ptr, sb_ptr, wb_ptr, wt_ptr, kept_ptr, pages_ptr, counts_ptr,
                       n_cols, max_pages, q, BLOCK_SIZE: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_C)
        n = tl.load(n_ptr + b).to(tl.int32)
        sb = tl.load(sb_ptr + b).to(tl.int32)
        first_window = n - tl.load(wb_ptr + b).to(tl.int32)
        wt = tl.load(wt_ptr + b).to(tl.int32)
        w = tl.load(walk_ptr + b * n_cols + cols, mask=cols < n_cols, other=0.0)
        live = cols < n
        cand = live & (cols >= sb) & (cols < first_window)
        srt = tl.sort(tl.where(cand, w, float("inf")))
        m = tl.sum(cand.to(tl.int32), 0)
        ranks = tl.maximum(m - 1, 0).to(tl.float32) * q
        lo = ranks.to(tl.int32)
        hi = tl.ceil(ranks).to(tl.int32)
        v_lo = tl.sum(tl.where(cols == lo, srt, 0.0), 0)
        v_hi = tl.sum(tl.where(cols == hi, srt, 0.0), 0)
        weight = ranks - lo.to(tl.float32)
        # torch.lerp's two forms (exact at both ends)
        th = tl.where(weight < 0.5, v_lo + weight * (v_hi - v_lo), v_hi - (v_hi - v_lo) * (1.0 - weight))
        above = (w > th) & (m > 0)
        kept = live & (above | (cols < sb) | (cols >= first_window))
        tl.store(kept_ptr + b * n_cols + cols, kept.to(tl.int8), mask=cols < n_cols)
        listed = kept & ((cols + 1) * BLOCK_SIZE > wt)
        order = tl.cumsum(listed.to(tl.int32), 0) - 1
        ok = (listed.to(tl.int32) * (order < max_pages).to(tl.int32)) != 0
        tl.store(pages_ptr + b * max_pages + order, cols, mask=ok)
        tl.store(counts_ptr + b, tl.minimum(tl.sum(listed.to(tl.int32), 0), max_pages))


def select_pages_triton(walk, n, sink_blocks, window_blocks, window_tokens, *, q: float, block_size: int,
                        max_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`select_pages_reference` in one launch (``walk [B, C]`` float32, the rest ``[B]`` integers)."""
    if walk.dtype != torch.float32 or walk.stride(-1) != 1 or walk.dim() != 2:
        raise ValueError(f"walk: expected a contiguous float32 [B, C], got {walk.dtype} {tuple(walk.shape)}")
    b, c = walk.shape
    walk = walk.contiguous()
    kept = torch.empty(b, c, dtype=torch.int8, device=walk.device)
    pages = torch.zeros(b, max_pages, dtype=torch.int32, device=walk.device)
    counts = torch.empty(b, dtype=torch.int32, device=walk.device)
    block_c = max(16, next_pow2(c))
    launch(_select_kernel, (b,), walk, n, sink_blocks, window_blocks, window_tokens, kept, pages, counts, c,
           max_pages, float(q), BLOCK_SIZE=block_size, BLOCK_C=block_c, num_warps=4 if block_c <= 1024 else 8,
           num_stages=1)
    return kept.bool(), pages, counts


# -- the running block matrix's step ---------------------------------------------------------------------------
#
# A = diag(σ)·U with S the row sums of U. One step of row b at position p (block c = p // B, s = p mod B,
# α = 1/(s + 1)), on the rows and columns below n = c + 1:
#   restart (p is the first position after the prompt): row and column n0 − 1 of U, σ (= 1) and S of the
#       prompt's rows, and the block count, back to the prompt's;
#   a block that appears (c ≥ the block count): row c = r (σ = 1, S = Σr), older rows' column c = 0;
#   row c ← (1 − α)·A_c + α·r, normalised (σ_c = 1, S_c its sum);
#   column c: A_jc ← (1 − α)·A_jc + α·r_j, written to U as A_jc / σ_j, S_j updated by the change;
#   every row renormalised through σ_j ← σ_j / max(σ_j·S_j, 1e-12).
# O(C) per row: the O(C²) renormalisation of the reference is folded into σ.


def update_matrix_reference(u, sigma, rsum, n_blocks, r, pos, restart, p_nblocks, p_row, p_col, p_rsum, *,
                            block_size: int, eps: float) -> None:
    """The step above in torch, in place (``u [B, C, C]``; ``sigma, rsum, r, p_row, p_col, p_rsum [B, C]``;
    ``n_blocks, pos, restart, p_nblocks [B]``)."""
    b, cap = sigma.shape
    dev = u.device
    rows = torch.arange(b, device=dev)
    cols = torch.arange(cap, device=dev)[None, :]
    c = torch.div(pos, block_size, rounding_mode="floor")
    s = pos - c * block_size
    alpha = (1.0 / (s + 1).to(torch.float64)).to(u.dtype)[:, None]
    one_minus = (1.0 - 1.0 / (s + 1).to(torch.float64)).to(u.dtype)[:, None]
    live = cols <= c[:, None]
    ones = torch.ones_like(alpha[:, 0])
    # restart
    r0 = restart[:, None]
    n0i = (p_nblocks - 1).clamp(min=0)
    in_prompt = cols < p_nblocks[:, None]
    u[rows, n0i] = torch.where(r0, p_row, u[rows, n0i])
    u[rows, :, n0i] = torch.where(r0 & in_prompt, p_col, u[rows, :, n0i])
    sigma.copy_(torch.where(r0 & in_prompt, torch.ones_like(sigma), sigma))
    rsum.copy_(torch.where(r0, p_rsum, rsum))
    n_blocks.copy_(torch.where(restart, p_nblocks, n_blocks))
    # a block that appears
    n_prev = n_blocks.clone()
    new = (c >= n_prev)[:, None]
    u[rows, c] = torch.where(new, r, u[rows, c])
    sigma[rows, c] = torch.where(new[:, 0], ones, sigma[rows, c])
    rsum[rows, c] = torch.where(new[:, 0], r.sum(-1), rsum[rows, c])
    u[rows, :, c] = torch.where(new & (cols < n_prev[:, None]), 0.0, u[rows, :, c])
    n_blocks.copy_(torch.maximum(n_blocks, c + 1))
    # row c
    a_c = sigma[rows, c][:, None] * u[rows, c]
    x = torch.where(live, one_minus * a_c + alpha * r, 0.0)
    x = x / x.sum(-1, keepdim=True).clamp(min=eps)
    u[rows, c] = x
    sigma[rows, c] = ones
    rsum[rows, c] = x.sum(-1)
    # column c
    u_col = u[rows, :, c]
    y = one_minus * (sigma * u_col) + alpha * r
    u_new = torch.where(live, y / sigma, u_col)
    rsum.add_(torch.where(live, u_new - u_col, 0.0))
    u[rows, :, c] = u_new
    total = (sigma * rsum).clamp(min=eps)
    sigma.copy_(torch.where(live, sigma / total, sigma))


if triton is not None:

    @triton.jit(do_not_specialize=["cap"])
    def _update_kernel(u_ptr, sigma_ptr, rsum_ptr, nb_ptr, r_ptr, pos_ptr, restart_ptr, p_nb_ptr, p_row_ptr,
                       p_col_ptr, p_rsum_ptr, cap, eps, BLOCK_SIZE: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_C)
        in_cap = cols < cap
        pos = tl.load(pos_ptr + b).to(tl.int32)
        c = pos // BLOCK_SIZE
        s = (pos - c * BLOCK_SIZE).to(tl.float32)
        alpha = 1.0 / (s + 1.0)
        one_minus = s / (s + 1.0)
        live = cols <= c
        vec = b * cap + cols
        u_row = u_ptr + b * cap * cap
        n_prev = tl.load(nb_ptr + b).to(tl.int32)
        if tl.load(restart_ptr + b) != 0:
            n0 = tl.load(p_nb_ptr + b).to(tl.int32)
            n0i = tl.maximum(n0 - 1, 0)
            tl.store(u_row + n0i * cap + cols, tl.load(p_row_ptr + vec, mask=in_cap), mask=in_cap)
            tl.debug_barrier()
            tl.store(u_row + cols * cap + n0i, tl.load(p_col_ptr + vec, mask=in_cap), mask=cols < n0)
            tl.store(sigma_ptr + vec, 1.0, mask=cols < n0)
            tl.store(rsum_ptr + vec, tl.load(p_rsum_ptr + vec, mask=in_cap), mask=in_cap)
            n_prev = n0
        tl.debug_barrier()
        r = tl.load(r_ptr + vec, mask=in_cap, other=0.0)
        r_sum = tl.sum(r, 0)
        if c >= n_prev:
            tl.store(u_row + c * cap + cols, r, mask=in_cap)
            tl.store(sigma_ptr + b * cap + c, 1.0)
            tl.store(rsum_ptr + b * cap + c, r_sum)
            tl.debug_barrier()
            tl.store(u_row + cols * cap + c, tl.zeros([BLOCK_C], tl.float32), mask=cols < n_prev)
        tl.store(nb_ptr + b, tl.maximum(n_prev, c + 1).to(tl.int64))
        tl.debug_barrier()
        # row c
        sig_c = tl.load(sigma_ptr + b * cap + c)
        a_c = sig_c * tl.load(u_row + c * cap + cols, mask=in_cap, other=0.0)
        x = tl.where(live, one_minus * a_c + alpha * r, 0.0)
        x = x / tl.maximum(tl.sum(x, 0), eps)
        tl.store(u_row + c * cap + cols, x, mask=in_cap)
        tl.store(sigma_ptr + b * cap + c, 1.0)
        tl.store(rsum_ptr + b * cap + c, tl.sum(x, 0))
        tl.debug_barrier()
        # column c, then every row's scale
        sig = tl.load(sigma_ptr + vec, mask=in_cap, other=1.0)
        rs = tl.load(rsum_ptr + vec, mask=in_cap, other=0.0)
        u_col = tl.load(u_row + cols * cap + c, mask=in_cap, other=0.0)
        y = one_minus * (sig * u_col) + alpha * r
        u_new = tl.where(live, y / sig, u_col)
        rs = rs + tl.where(live, u_new - u_col, 0.0)
        tl.store(u_row + cols * cap + c, u_new, mask=in_cap)
        total = tl.maximum(sig * rs, eps)
        tl.store(sigma_ptr + vec, tl.where(live, sig / total, sig), mask=in_cap)
        tl.store(rsum_ptr + vec, rs, mask=in_cap)


def update_matrix_triton(u, sigma, rsum, n_blocks, r, pos, restart, p_nblocks, p_row, p_col, p_rsum, *,
                         block_size: int, eps: float) -> None:
    """:func:`update_matrix_reference` in one launch (float32, contiguous; one program per row)."""
    for name, t in (("u", u), ("sigma", sigma), ("rsum", rsum), ("r", r), ("p_row", p_row), ("p_col", p_col),
                    ("p_rsum", p_rsum)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous float32 tensor, got {t.dtype}")
    b, cap = sigma.shape
    block_c = max(16, next_pow2(cap))
    launch(_update_kernel, (b,), u, sigma, rsum, n_blocks, r, pos, restart.to(torch.int8), p_nblocks, p_row, p_col,
           p_rsum, cap, float(eps), BLOCK_SIZE=block_size, BLOCK_C=block_c, num_warps=4 if block_c <= 1024 else 8,
           num_stages=1)


# -- the step's block row ------------------------------------------------------------------------------------
#
# r_j ∝ Σ_{kv head g} Σ_{query head h of g} Σ_{valid slot w} softmax_{j < n}(⟨qs[h, w], ks[g, j]⟩ · scale),
# normalised to sum 1 (+1e-12). Two launches over (row, KV head, tile of key blocks): the first writes each
# query row's max and sum of exponentials per tile, the second merges them into the row's log-sum-exp and
# sums the probabilities over the rows of the tile (every KV head's partial, summed in torch).


def block_row_reference(qs: torch.Tensor, ks: torch.Tensor, n: torch.Tensor, slot_ok: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """``[B, C]`` the normalised block row from ``qs [B, Hq, W, m]``, ``ks [B, Hkv, C, m]``, ``n [B]`` and
    ``slot_ok [B, W]`` (the ring's valid slots)."""
    b, hq, w_len, m = qs.shape
    hkv, cap = ks.shape[1], ks.shape[2]
    g = hq // hkv
    logits = torch.matmul(qs.reshape(b, hkv, g * w_len, m), ks.transpose(-1, -2)) * scale
    live = torch.arange(cap, device=qs.device)[None, :] < n[:, None]
    logits = logits.masked_fill(~live[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).view(b, hkv, g, w_len, cap)
    probs = probs * slot_ok[:, None, None, :, None].to(probs.dtype)
    s = probs.sum((1, 2, 3))
    return s / (s.sum(-1, keepdim=True) + 1e-12)


if triton is not None:

    @triton.jit
    def _row_logits(qs_ptr, ks_ptr, b, g, t, n, cap, n_rows, m, scale, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
        rows = tl.arange(0, BLOCK_R)
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        feats = tl.arange(0, BLOCK_M)
        n_kv = tl.num_programs(1)
        q = tl.load(qs_ptr + ((b * n_kv + g) * n_rows + rows[:, None]) * m + feats[None, :],
                    mask=(rows[:, None] < n_rows) & (feats[None, :] < m), other=0.0)
        k = tl.load(ks_ptr + ((b * n_kv + g) * cap + cols[:, None]) * m + feats[None, :],
                    mask=(cols[:, None] < cap) & (feats[None, :] < m), other=0.0)
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        return tl.where(cols[None, :] < n, logits, float("-inf")), rows, cols

    @triton.jit(do_not_specialize=["cap", "n_rows", "m", "n_tiles"])
    def _row_stats_kernel(qs_ptr, ks_ptr, n_ptr, mx_ptr, se_ptr, cap, n_rows, m, n_tiles, scale,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                          PRECISION: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        t = tl.program_id(2)
        n = tl.load(n_ptr + b).to(tl.int32)
        logits, rows, _ = _row_logits(qs_ptr, ks_ptr, b, g, t, n, cap, n_rows, m, scale, BLOCK_R, BLOCK_N, BLOCK_M,
                                      PRECISION)
        mx = tl.max(logits, 1)
        safe = tl.where(mx == float("-inf"), 0.0, mx)
        se = tl.sum(tl.exp(logits - safe[:, None]), 1)
        out = ((b * tl.num_programs(1) + g) * n_tiles + t) * BLOCK_R + rows
        tl.store(mx_ptr + out, mx)
        tl.store(se_ptr + out, se)

    @triton.jit(do_not_specialize=["cap", "n_rows", "m", "n_tiles", "w_len"])
    def _row_probs_kernel(qs_ptr, ks_ptr, n_ptr, ok_ptr, mx_ptr, se_ptr, part_ptr, cap, n_rows, m, n_tiles, w_len,
                          scale, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                          PRECISION: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        t = tl.program_id(2)
        n = tl.load(n_ptr + b).to(tl.int32)
        rows = tl.arange(0, BLOCK_R)
        base = (b * tl.num_programs(1) + g) * n_tiles * BLOCK_R + rows
        big = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for tt in range(0, n_tiles):
            big = tl.maximum(big, tl.load(mx_ptr + base + tt * BLOCK_R))
        safe = tl.where(big == float("-inf"), 0.0, big)
        total = tl.zeros([BLOCK_R], tl.float32)
        for tt in range(0, n_tiles):
            mt = tl.load(mx_ptr + base + tt * BLOCK_R)
            total += tl.where(mt == float("-inf"), 0.0, tl.load(se_ptr + base + tt * BLOCK_R) * tl.exp(mt - safe))
        lse = safe + tl.log(tl.where(total > 0, total, 1.0))
        ok = tl.load(ok_ptr + b * w_len + rows % w_len, mask=rows < n_rows, other=0) != 0
        logits, _, cols = _row_logits(qs_ptr, ks_ptr, b, g, t, n, cap, n_rows, m, scale, BLOCK_R, BLOCK_N, BLOCK_M,
                                      PRECISION)
        p = tl.where(ok[:, None] & (cols[None, :] < n), tl.exp(logits - lse[:, None]), 0.0)
        tl.store(part_ptr + (b * tl.num_programs(1) + g) * cap + cols, tl.sum(p, 0), mask=cols < cap)


def block_row_triton(qs: torch.Tensor, ks: torch.Tensor, n: torch.Tensor, slot_ok: torch.Tensor, scale: float,
                     *, block_n: int = 64, precision: str = "tf32x3") -> torch.Tensor:
    """:func:`block_row_reference` in two launches (float32). ``precision``: ``tl.dot``'s (tf32x3 keeps about
    float32's accuracy on tensor cores; the interpreter computes in float32 whatever it is)."""
    if qs.dtype != torch.float32 or ks.dtype != torch.float32 or not qs.is_contiguous() or not ks.is_contiguous():
        raise ValueError(f"qs, ks: expected contiguous float32 tensors, got {qs.dtype}, {ks.dtype}")
    b, hq, w_len, m = qs.shape
    hkv, cap = ks.shape[1], ks.shape[2]
    n_rows = (hq // hkv) * w_len
    block_r = max(16, next_pow2(n_rows))
    block_m = max(16, next_pow2(m))
    n_tiles = -(-cap // block_n)
    mx = torch.empty(b, hkv, n_tiles, block_r, dtype=torch.float32, device=qs.device)
    se = torch.empty_like(mx)
    part = torch.empty(b, hkv, cap, dtype=torch.float32, device=qs.device)
    ok = slot_ok.to(torch.int8).contiguous()
    meta = dict(BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_M=block_m, PRECISION=precision, num_warps=8, num_stages=1)
    launch(_row_stats_kernel, (b, hkv, n_tiles), qs, ks, n, mx, se, cap, n_rows, m, n_tiles, float(scale), **meta)
    launch(_row_probs_kernel, (b, hkv, n_tiles), qs, ks, n, ok, mx, se, part, cap, n_rows, m, n_tiles, w_len,
           float(scale), **meta)
    s = part.sum(1)
    return s / (s.sum(-1, keepdim=True) + 1e-12)
