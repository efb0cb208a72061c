"""variant=authors' decode step up to the attention on the device, for every row of a batch at once.

One step of a row at position ``p`` (block ``c = p // B``, ``n = c + 1`` blocks, ``s = p mod B``):

1. **State.** Restart (``p`` is the first position after the row's prompt: the query ring, its count and the
   partial block's key sum back to the prompt's), the order flag, the new query's sketches into the ring
   (slot ``p mod W``), the new key into block ``c``'s key sum and that block's sketch.
2. **Block row** ``r`` (:func:`block_row_reference`) from the ring and the key-block sketches.
3. **Running matrix** ``A = diag(σ)·U`` (:func:`update_matrix_reference`): O(C) per row.
4. **Walk** ``w ← (1 − β)·r + β·(w ⊙ σ)·U``, ``degree`` times from ``r``, zero past ``n``.
5. **Selection** (:func:`select_pages_reference`): the ``q`` quantile of the walk over the candidate blocks
   ``[sink_blocks, n − window_blocks)`` (NaN without a candidate), kept = above it, or a sink block, or one
   of the last ``window_blocks``; the pages are the kept blocks reaching past the first ``window_tokens``
   keys (those are read as the dense prefix), ascending, at most ``max_pages`` (the caller's host bound).
   The sink and window sizes per row are :func:`reserved_device`'s.

Torch (``authors_reference.py``): :func:`row_update_reference` (1–3) and :func:`walk_select_reference` (4–5),
about a hundred small launches per step. Device: :func:`row_update_triton` (1–3, four Triton launches and a
cuBLAS GEMM) and ``authors_walk.walk_select_triton`` (4–5, ``degree`` + 1 launches):

- ``_row_state_kernel``, a program per (row, KV head, chunk of sketch features): the state's step on the ring and
  the sketches (the group's ring rows on a restart, the new query's sketches into its slot, block ``c``'s sketch);
- :func:`sketch_logits`, one batched float32 GEMM: every ring row against every key-block sketch up to the
  capacity, per (row, KV head), into a workspace (the rows' different block counts are masked after it);
- ``_row_lse_kernel``, a program per (row, KV head, a few ring rows): each ring row's max and Σ exp of its logits
  over the row's blocks;
- ``_row_probs_kernel``, a program per (row, KV head, tile of key blocks): the tile's probabilities summed over the
  KV head's valid ring rows;
- the per-row tail (the running matrix's step), the walk's hops and the selection: ``authors_walk.py``.

The logits are a GEMM of their own rather than dots inside the softmax's programs: with the ring's 128 rows ×
128 sketch features per KV head, tile programs that each redid their dots held one program per SM and took
about 230 µs per layer at 128k tokens on an H200, where the GEMM and two passes over its 8 MB output are
bandwidth-bound.

Nothing is read on the host; buffers are cached workspaces or outputs allocated from host-known sizes (capturable);
there are no atomics, so nothing is summed in arrival order and a replay equals an eager call bit for bit.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import (
    cdiv,
    gdc_launch_dependents,
    gdc_wait,
    launch,
    next_pow2,
    pdl_available,
    pdl_launch,
    triton,
    workspace,
)
from .authors_walk import check_state as _check_state
from .authors_walk import row_tail_triton

# -- the step in Triton ----------------------------------------------------------------------------------------

if triton is not None:
    import triton.language as tl

    from .authors_walk import key_sum as _key_sum
    from .authors_walk import position as _position
    from .authors_walk import ring as _ring

    @triton.jit(do_not_specialize=["cap", "w_len", "m", "d", "hq"])
    def _row_state_kernel(q_ptr, k_ptr, lens_ptr, phi_ptr, qs_ptr, pqs_ptr, nq_ptr, pnq_ptr, plen_ptr, ksum_ptr,
                          ks_ptr, pkp_ptr, cap, w_len, m, d, hq, s_qb, s_qh, s_kb, s_kh, s_kn, GROUP: tl.constexpr,
                          BS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_D: tl.constexpr):
        """A program per (row, KV head, chunk of BLOCK_M sketch features): the state's step on the ring and the
        key-block sketches (module docstring, step 1) before the logits' GEMM reads them: on a restart the group's
        ring rows back to the prompt's, the new query's sketches into slot ``p mod W``, block c's sketch from its
        key sum after the step (which every chunk computes itself and the tail stores, so that no program reads
        what another writes)."""
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        hkv = tl.num_programs(1)
        pos, c, s = _position(lens_ptr, b, BS)
        restart, _, slot = _ring(plen_ptr, nq_ptr, pnq_ptr, b, pos, w_len)
        rows = tl.arange(0, BLOCK_R)
        row_ok = rows < GROUP * w_len
        dd = tl.arange(0, BLOCK_D)
        gh = tl.arange(0, BLOCK_G)
        g_ok = gh < GROUP
        feats = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        f_ok = feats < m
        # the new query's sketches (one per query head of the group) and block c's, over chunks of BLOCK_D dims
        # (a CUDA-core dot holds its operands' whole inner dim per thread: chunks keep it in registers)
        q_new = tl.zeros([BLOCK_G, BLOCK_M], tl.float32)
        ks_c = tl.zeros([BLOCK_M], tl.float32)
        for d0 in range(0, d, BLOCK_D):
            dc = d0 + dd
            dc_ok = dc < d
            phi_t = tl.load(phi_ptr + feats[None, :] * d + dc[:, None], mask=dc_ok[:, None] & f_ok[None, :],
                            other=0.0)
            qn = tl.load(q_ptr + b * s_qb + (g * GROUP + gh)[:, None] * s_qh + dc[None, :],
                         mask=g_ok[:, None] & dc_ok[None, :], other=0.0).to(tl.float32)
            q_new += tl.dot(qn, phi_t, input_precision="ieee")  # [BLOCK_G, BLOCK_M]
            k_mean = _key_sum(k_ptr, pkp_ptr, ksum_ptr, b, g, hkv, pos, c, s, restart, dc, dc_ok, cap, d, s_kb, s_kh,
                              s_kn) / BS
            ks_c += tl.sum(k_mean[:, None] * phi_t, axis=0)
        ring_base = (b * hq + g * GROUP) * w_len * m
        if restart:
            ring_at = ring_base + rows[:, None] * m + feats[None, :]
            ring_mask = row_ok[:, None] & f_ok[None, :] & ((rows % w_len) != slot)[:, None]
            tl.store(qs_ptr + ring_at, tl.load(pqs_ptr + ring_at, mask=ring_mask, other=0.0), mask=ring_mask)
        tl.store(qs_ptr + ring_base + (gh * w_len + slot)[:, None] * m + feats[None, :], q_new,
                 mask=g_ok[:, None] & f_ok[None, :])
        tl.store(ks_ptr + ((b * hkv + g) * cap + c) * m + feats, ks_c, mask=f_ok)

    @triton.jit(do_not_specialize=["cap", "n_rows"])
    def _row_lse_kernel(lens_ptr, lg_ptr, mx_ptr, se_ptr, cap, n_rows, scale, BS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        """A program per (row, KV head, chunk of BLOCK_R ring rows): each ring row's max and Σ exp of its scaled
        logits over the row's n blocks, in one pass (the sum rescaled when the max grows)."""
        if PDL:  # launched early (programmatic dependent launch): wait for the kernel before, let the next launch
            gdc_wait()
            gdc_launch_dependents()
        bg = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
        _, c, _ = _position(lens_ptr, tl.program_id(0).to(tl.int64), BS)
        n = c + 1
        rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        at = (bg * n_rows + rows) * cap
        mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
        se = tl.zeros([BLOCK_R], tl.float32)
        for x0 in range(0, n, BLOCK_N):
            j = x0 + tl.arange(0, BLOCK_N)
            ok = row_ok[:, None] & (j < n)[None, :]
            lg = tl.load(lg_ptr + at[:, None] + j[None, :], mask=ok, other=0.0)
            lg = tl.where(ok, lg * scale, float("-inf"))
            big = tl.maximum(mx, tl.max(lg, 1))  # finite on live rows: the first chunk holds block 0
            safe = tl.where(big == float("-inf"), 0.0, big)
            se = se * tl.exp(mx - safe) + tl.sum(tl.exp(lg - safe[:, None]), 1)
            mx = big
        tl.store(mx_ptr + bg * n_rows + rows, mx, mask=row_ok)
        tl.store(se_ptr + bg * n_rows + rows, se, mask=row_ok)

    @triton.jit(do_not_specialize=["cap", "w_len", "n_rows"])
    def _row_probs_kernel(lens_ptr, nq_ptr, pnq_ptr, plen_ptr, lg_ptr, mx_ptr, se_ptr, part_ptr, cap, w_len, n_rows,
                          scale, BS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        """A program per (row, KV head, tile of BLOCK_N key blocks): the tile's probabilities summed over the valid
        ring rows (the slot's age below the ring's count after the step); zero past the row's blocks."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        bg = b * tl.num_programs(1) + tl.program_id(1)
        pos, c, _ = _position(lens_ptr, b, BS)
        _, nq_new, slot = _ring(plen_ptr, nq_ptr, pnq_ptr, b, pos, w_len)
        n = c + 1
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = cols < n
        acc = tl.zeros([BLOCK_N], tl.float32)
        for r0 in range(0, n_rows, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            age = (slot - rows % w_len + w_len) % w_len
            ok = (rows < n_rows) & (age < nq_new)
            mx = tl.load(mx_ptr + bg * n_rows + rows, mask=ok, other=0.0)
            se = tl.load(se_ptr + bg * n_rows + rows, mask=ok, other=1.0)
            both = ok[:, None] & live[None, :]
            lg = tl.load(lg_ptr + (bg * n_rows + rows)[:, None] * cap + cols[None, :], mask=both, other=0.0)
            acc += tl.sum(tl.where(both, tl.exp(lg * scale - mx[:, None]) / se[:, None], 0.0), 0)
        tl.store(part_ptr + bg * cap + cols, acc, mask=cols < cap)

def feature_chunk(m: int) -> int:
    """Sketch features per chunk of the state launch's dots: 32 at most."""
    return min(32, max(16, next_pow2(m)))


#: key blocks per program of the probabilities' launch (a [64 ring rows, 32 blocks] tile at a time): about four
#: programs per SM at 128k tokens of 64-key blocks, batch 1
ROW_TILE = 32
#: ring rows per program of the log-sum-exp launch
LSE_ROWS = 4
#: blocks per chunk of the log-sum-exp launch's pass over a ring row
LSE_CHUNK = 256


def sketch_logits(qs: torch.Tensor, ks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out [B·Hkv, G·W, C] = qs [B, Hq, W, m] · ks [B, Hkv, C, m]ᵀ`` per (row, KV head): one batched GEMM in
    float32. On CUDA, TF32 is turned off for the call whatever the global setting (its 10-bit mantissa would move
    the softmax by about 1e-3; the float32 GEMM is a few µs at 128k tokens)."""
    b, hq, w_len, m = qs.shape
    hkv, cap = ks.shape[1], ks.shape[2]
    a, k_t = qs.view(b * hkv, hq // hkv * w_len, m), ks.view(b * hkv, cap, m).transpose(1, 2)
    if not qs.is_cuda:
        return torch.bmm(a, k_t, out=out)
    prec = torch.backends.cuda.matmul
    before = prec.fp32_precision
    prec.fp32_precision = "ieee"
    try:
        return torch.bmm(a, k_t, out=out)
    finally:
        prec.fp32_precision = before


def row_update_triton(st, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *, scale: float,
                      block_n: int = ROW_TILE, block_x: int | None = None, block_m: int | None = None,
                      lse_rows: int = LSE_ROWS, lse_chunk: int = LSE_CHUNK) -> torch.Tensor:
    """:func:`row_update_reference` in four launches and a GEMM (float32 state; ``q``, ``k`` any float dtype with a
    contiguous last dim; ``lengths`` int32 preferred): the state's step (``_row_state_kernel``), the logits of every
    ring row against every key-block sketch up to the capacity (:func:`sketch_logits`, into a workspace), each ring
    row's max and Σ exp over its row's blocks (``_row_lse_kernel``), the probabilities summed over the ring rows per
    tile of ``block_n`` blocks (``_row_probs_kernel``), and the tail (``authors_walk.row_tail_triton``, in the form
    its module's path says). Returns ``r [B, C]`` (a workspace: valid until the next call). ``block_x``: the chunked
    tail's chunk (default ``authors_walk.tail_chunk``);
    ``block_m``: the sketch features per chunk of the state's dots (default :func:`feature_chunk`); ``lse_rows``,
    ``lse_chunk``: the ring rows per program and the blocks per chunk of the log-sum-exp launch."""
    _check_state(st)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k: expected a contiguous last dim")
    b, hq, d = q.shape
    hkv, cap = st.ks.shape[1], st.ks.shape[2]
    w_len, m = st.qs.shape[2], st.qs.shape[3]
    group = hq // hkv
    n_rows = group * w_len
    logits = workspace("sw_authors_logits", q, b * hkv * n_rows * cap, torch.float32)[:b * hkv * n_rows * cap]
    mx = workspace("sw_authors_mx", q, b * hkv * n_rows, torch.float32)
    se = workspace("sw_authors_se", q, b * hkv * n_rows, torch.float32)
    part = workspace("sw_authors_part", q, b * hkv * cap, torch.float32)
    r = workspace("sw_authors_r", q, b * cap, torch.float32)[:b * cap].view(b, cap)
    pdl = pdl_available()
    block_m = block_m or feature_chunk(m)
    block_d = min(32, max(16, next_pow2(d)))
    launch(_row_state_kernel, (b, hkv, cdiv(m, block_m)), q, k, lengths, st.phi, st.qs, st.p_qs, st.n_queries,
           st.p_nq, st.prompt_len, st.ksum, st.ks, st.p_kpart, cap, w_len, m, d, hq, q.stride(0), q.stride(1),
           k.stride(0), k.stride(1), k.stride(2), GROUP=group, BS=st.block_size, BLOCK_R=max(16, next_pow2(n_rows)),
           BLOCK_G=max(16, next_pow2(group)), BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
    sketch_logits(st.qs, st.ks, logits.view(b * hkv, n_rows, cap))
    launch(_row_lse_kernel, (b, hkv, cdiv(n_rows, lse_rows)), lengths, logits, mx, se, cap, n_rows, float(scale),
           BS=st.block_size, BLOCK_R=lse_rows, BLOCK_N=lse_chunk, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    launch(_row_probs_kernel, (b, hkv, cdiv(cap, block_n)), lengths, st.n_queries, st.p_nq, st.prompt_len, logits, mx,
           se, part, cap, w_len, n_rows, float(scale), BS=st.block_size, BLOCK_R=min(64, max(16, next_pow2(n_rows))),
           BLOCK_N=block_n, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    row_tail_triton(st, part, r, k, lengths, block_x=block_x, block_d=block_d, pdl=pdl)
    st.fresh_rows = False
    return r


