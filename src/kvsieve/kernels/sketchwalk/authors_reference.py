"""variant=authors' decode step in torch: the references of ``authors_decode.py``'s Triton launches (the step's
state, block row, running matrix, walk and selection; that module's docstring gives the step), about a hundred small
launches per step."""

from __future__ import annotations

import torch

#: Added to a row's sum before dividing by it (the authors').
ROW_EPS = 1e-12

def reserved_device(fraction: float, n_tokens: torch.Tensor, block_size: int, n_blocks: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The method's ``reserved`` per row: ``max(1, ⌊f·T⌋)`` tokens (in float64, as Python computes it) and
    ``min(n, max(1, ⌈tokens/B⌉))`` blocks."""
    tokens = torch.floor(n_tokens.to(torch.float64) * fraction).long().clamp(min=1)
    blocks = torch.minimum(n_blocks, torch.div(tokens + block_size - 1, block_size, rounding_mode="floor").clamp(min=1))
    return tokens, blocks


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


# -- the step's block row ------------------------------------------------------------------------------------
#
# r_j ∝ Σ_{kv head g} Σ_{query head h of g} Σ_{valid slot w} softmax_{j < n}(⟨qs[h, w], ks[g, j]⟩ · scale),
# normalised to sum 1 (+1e-12).


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
    return s / (s.sum(-1, keepdim=True) + ROW_EPS)


# -- the block row's logit cache ----------------------------------------------------------------------------------
#
# The block row's kernels (``authors_decode.py``) keep, per (row, KV head, ring row), the logits against every
# block up to the row's block c (``logits [B, Hkv, C, G·W]``, unscaled; valid for j ≤ c; a block's ring rows side by
# side, so a tile of blocks is one contiguous run for the probabilities' launch) and the max and Σ exp of
# the scaled logits over the closed blocks j < ``n_closed`` (``closed_max``, ``closed_sum [B, Hkv, G·W]``). A
# closed block's sketch never changes, so a step computes only the new query's logits, block c's column and, at a
# block's first key, folds block c − 1 into the closed sums; a restart takes the prompt's copies (``p_logits``,
# ``p_closed_max``, ``p_closed_sum``, over the prompt's closed blocks).


def logit_cache_reference(qs: torch.Tensor, ks: torch.Tensor, n_closed: torch.Tensor, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [B, Hkv, C, G·W], closed_max, closed_sum [B, Hkv, G·W])`` of ``qs [B, Hq, W, m]`` against
    ``ks [B, Hkv, C, m]`` with the closed sums over the blocks ``j < n_closed [B]`` (max −inf and sum 0 where
    there is none); the logits contiguous in the cache's layout (above)."""
    b, hq, w_len, m = qs.shape
    hkv, cap = ks.shape[1], ks.shape[2]
    logits = torch.matmul(qs.reshape(b, hkv, hq // hkv * w_len, m), ks.transpose(-1, -2))
    closed = torch.arange(cap, device=qs.device)[None, :] < n_closed[:, None]
    scaled = (logits * scale).masked_fill(~closed[:, None, None, :], float("-inf"))
    mx = scaled.max(-1).values
    safe = torch.where(torch.isfinite(mx), mx, 0.0)
    return logits.transpose(-1, -2).contiguous(), mx, torch.exp(scaled - safe[..., None]).sum(-1)




# -- the step in torch -----------------------------------------------------------------------------------------
#
# ``st``: the layer's device state (the method's ``AuthorsDeviceState``: ``phi [m, d]``, ``u [B, C, C]``,
# ``sigma, rsum [B, C]``, ``n_blocks [B]``, the ring ``qs [B, Hq, W, m]`` and ``n_queries [B]``, the key sums and
# sketches ``ksum [B, Hkv, C, d]``, ``ks [B, Hkv, C, m]``, the logit cache (above), ``last_pos``, ``order_error``,
# ``prompt_len [B]``, the prompt's copies ``p_*``, ``fresh_rows`` and ``block_size``), updated in place.


def row_update_reference(st, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Steps 1–3 (module docstring) in torch: ``q [B, Hq, d]`` the new queries, ``k [B, Hkv, N, d]`` the cache
    (the new key at ``lengths − 1``). Returns the block row ``r [B, C]``."""
    dtype, dev = st.phi.dtype, st.phi.device
    b = q.shape[0]
    w_len = st.qs.shape[2]
    bs = st.block_size
    cap = st.u.shape[-1]
    rows = torch.arange(b, device=dev)
    cols = torch.arange(cap, device=dev)
    pos = lengths.to(dev).long() - 1
    n = torch.div(pos, bs, rounding_mode="floor") + 1
    c = n - 1
    s = pos - c * bs
    # order and restart
    restart = (st.prompt_len >= 0) & (pos == st.prompt_len)
    st.order_error |= ~restart & (st.last_pos >= 0) & (pos != st.last_pos + 1)
    st.n_queries.copy_(torch.where(restart, st.p_nq, st.n_queries))
    st.qs.copy_(torch.where(restart[:, None, None, None], st.p_qs, st.qs))
    st.last_pos.copy_(pos)
    # the query ring and the key sketch of block c
    slot = torch.remainder(pos, w_len)
    st.qs[rows, :, slot] = q.to(dtype) @ st.phi.T
    st.n_queries.copy_(torch.clamp(st.n_queries + 1, max=w_len))
    k_new = k[rows, :, pos].to(dtype)  # [B, Hkv, d]
    old = st.ksum[rows, :, c]
    base = torch.where(restart[:, None, None], st.p_kpart, torch.where((s == 0)[:, None, None], 0.0, old))
    st.ksum[rows, :, c] = base + k_new
    st.ks[rows, :, c] = (st.ksum[rows, :, c] / bs) @ st.phi.T
    # this step's block row
    age = torch.remainder(pos[:, None] - torch.arange(w_len, device=dev)[None, :], w_len)  # slot's age
    slot_ok = age < st.n_queries[:, None]  # [B, W]
    live = cols[None, :] < n[:, None]  # [B, C]
    r = block_row_reference(st.qs, st.ks, n, slot_ok, scale)  # [B, C], zero past n
    # the logit cache, remade whole (the kernels' state after the step)
    logits, closed_max, closed_sum = logit_cache_reference(st.qs, st.ks, c, scale)
    st.logits.copy_(logits)
    st.closed_max.copy_(closed_max)
    st.closed_sum.copy_(closed_sum)
    st.n_closed.copy_(c[:, None].expand_as(st.n_closed))
    # the running block matrix (rows [n_prev, n) of a fresh state start as this row)
    if st.fresh_rows:
        new_rows = (cols[None, :] >= st.n_blocks[:, None]) & live
        st.u.copy_(torch.where(new_rows[:, :, None], r[:, None, :], st.u))
        st.sigma.copy_(torch.where(new_rows, torch.ones_like(st.sigma), st.sigma))
        st.rsum.copy_(torch.where(new_rows, r.sum(-1, keepdim=True).expand_as(st.rsum), st.rsum))
        st.n_blocks.copy_(torch.maximum(st.n_blocks, n))
        st.fresh_rows = False
    update_matrix_reference(st.u, st.sigma, st.rsum, st.n_blocks, r, pos, restart, st.p_nblocks, st.p_row, st.p_col,
                            st.p_rsum, block_size=bs, eps=ROW_EPS)
    return r


def walk_select_reference(st, r: torch.Tensor, lengths: torch.Tensor, *, beta: float, degree: int, sink: float,
                          window: float, q: float, max_pages: int) -> dict[str, torch.Tensor]:
    """Steps 4–5 in torch from the block row ``r [B, C]``: ``walk [B, C]``, ``kept [B, C]`` bool, ``pages
    [B, max_pages]`` and ``counts [B]`` int32, ``window_tokens [B]``, ``n [B]``, ``short [B]`` (every block a sink
    or window block)."""
    bs = st.block_size
    cols = torch.arange(r.shape[1], device=r.device)
    pos = lengths.to(r.device).long() - 1
    n = torch.div(pos, bs, rounding_mode="floor") + 1
    live = cols[None, :] < n[:, None]
    walk = r
    for _ in range(degree):
        step = torch.matmul((walk * st.sigma)[:, None, :], st.u)[:, 0]
        walk = torch.where(live, (1.0 - beta) * r + beta * step, 0.0)
    window_tokens, window_blocks = reserved_device(window, pos + 1, bs, n)
    _, sink_blocks = reserved_device(sink, pos + 1, bs, n)
    kept, pages, counts = select_pages_reference(walk, n, sink_blocks, window_blocks, window_tokens, q=q,
                                                 block_size=bs, max_pages=max_pages)
    return {"walk": walk, "kept": kept, "pages": pages, "counts": counts, "window_tokens": window_tokens, "n": n,
            "short": n <= sink_blocks + window_blocks}
