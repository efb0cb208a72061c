"""Sketch&Walk's prefill selection on the device: :func:`prefill_sketch` and :func:`prefill_select`.

The method's torch path (:mod:`kvsieve.methods.sketchwalk`: ``head_mean``, ``block_sums``, ``block_means``,
``causal_log_scores``, ``hadamard_power``, ``walk_step``, ``normalize_rows``, ``block_budget``,
``select_blocks``; ``backend="reference"`` and every CPU call) dispatches about 85 aten ops per layer, 48 of
them in the top-k stage alone, so that at 32k–64k keys the host's launches, not the device, set its time.
Here the same selection is six launches (five without a previous walk):

1. ``_block_means_kernel``, one program per (batch row, block): reads the block's query and key rows of
   every head once (16-bit in, float32 sums), writes the head-mean query of every token (the decode state's
   ``q_tok``), the block sums of the head-mean queries and keys, and their block means.
2. ``torch.matmul``: the SRHT of the query and key means in one product (``[2, B, n, d] @ Φᵀ``).
3. ``torch.matmul``: the sketched logits ``q̃ k̃ᵀ`` (``[B, n, n]``).
4. ``_power_rows_kernel``, one program per (batch row, query block): the causal log-softmax of the row's
   scaled logits and ``Ã = exp(α·log Â)``, zero above the diagonal.
5. ``torch.matmul``: the walk ``W_prev · Ã`` (mode ``walk`` with a previous layer only).
6. ``_select_rows_kernel``, one program per (batch row, query block): ``w / max w`` (the next layer's walk),
   the ranking ``w/max w + tie·ã/max ã``, the row's budget (float64, as ``block_budget``), the best
   ``k − 2`` of blocks ``1..i−1`` by ``shared/select_common``'s register radix select (``chosen_regs``: ties
   at the threshold go to the lower block, as in the decode kernel), and the list: block 0, those ascending,
   block ``i``, padding 0.

The matmuls are torch's (TF32 where the caller allows it, as in the reference path), so the sketches, the
logits and the walk are the reference's products; the kernels' sums run in another order than torch's
reductions, so the floats agree to rounding, not bit for bit. Sizes are host-known (nothing is read on the
host, the calls are graph-capturable) and there are no atomics.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import launch, next_pow2, triton
from .common import float_bits

MODES = {"one-hop": 0, "walk": 1, "diagonal": 2}
# A row of the n x n block scores is one tile of a program: up to 4096 blocks (256k tokens of 64) its
# 16 entries per thread (8 warps) stay in registers. Longer contexts take the torch path.
MAX_BLOCKS = 4096

if triton is not None:
    import triton.language as tl

    from ..shared.select_common import chosen_regs, ordered
    from .common import FLOAT32_TINY, block_budget

    @triton.jit
    def _block_means_kernel(q_ptr, k_ptr, qtok_ptr, sums_ptr, means_ptr, hq, hkv, n_tok, d, n_blocks, batch,
                            s_qb, s_qh, s_qn, s_kb, s_kh, s_kn,
                            BS: tl.constexpr, BD: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64)
        tok = i * BS + tl.arange(0, BS)
        offs_d = tl.arange(0, BD)
        ok = (tok < n_tok)[:, None] & (offs_d < d)[None, :]
        count = tl.minimum(n_tok - i * BS, BS).to(tl.float32)
        q_rows = q_ptr + b * s_qb + tok[:, None] * s_qn + offs_d[None, :]
        acc = tl.zeros([BS, BD], dtype=tl.float32)
        for h in range(hq):
            acc += tl.load(q_rows + h * s_qh, mask=ok, other=0.0).to(tl.float32)
        q_avg = tl.div_rn(acc, tl.full([BS, BD], 1.0, tl.float32) * hq)
        tl.store(qtok_ptr + (b * n_tok + tok[:, None]) * d + offs_d[None, :], q_avg, mask=ok)
        k_rows = k_ptr + b * s_kb + tok[:, None] * s_kn + offs_d[None, :]
        acc = tl.zeros([BS, BD], dtype=tl.float32)
        for h in range(hkv):
            acc += tl.load(k_rows + h * s_kh, mask=ok, other=0.0).to(tl.float32)
        k_avg = tl.div_rn(acc, tl.full([BS, BD], 1.0, tl.float32) * hkv)
        d_ok = offs_d < d
        # sums and means are [2, B, n, d]: queries at 0, keys at 1 (one SRHT product for both)
        q_at = (b * n_blocks + i) * d + offs_d
        k_at = ((batch + b) * n_blocks + i) * d + offs_d
        q_sum = tl.sum(q_avg, axis=0)
        k_sum = tl.sum(k_avg, axis=0)
        tl.store(sums_ptr + q_at, q_sum, mask=d_ok)
        tl.store(sums_ptr + k_at, k_sum, mask=d_ok)
        tl.store(means_ptr + q_at, tl.div_rn(q_sum, tl.full([BD], 1.0, tl.float32) * count), mask=d_ok)
        tl.store(means_ptr + k_at, tl.div_rn(k_sum, tl.full([BD], 1.0, tl.float32) * count), mask=d_ok)

    @triton.jit
    def _power_rows_kernel(logit_ptr, at_ptr, n, logit_scale, alpha, BN: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64)
        j = tl.arange(0, BN)
        row = (b * n + i) * n
        causal = j <= i
        x = tl.load(logit_ptr + row + j, mask=causal, other=0.0) * logit_scale
        x = tl.where(causal, x, float("-inf"))
        shifted = x - tl.max(x, axis=0)  # as torch.log_softmax: (x − max) − log Σ exp(x − max)
        log_a = shifted - tl.log(tl.sum(tl.exp(shifted), axis=0))
        tl.store(at_ptr + row + j, tl.where(causal, tl.exp(alpha * log_a), 0.0), mask=j < n)

    @triton.jit
    def _select_rows_kernel(at_ptr, raw_ptr, w_ptr, idx_ptr, cnt_ptr, n, kmax, tie, rho_bits, n_budget,
                            BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr, FIXED: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64)
        j = tl.arange(0, BN)
        in_row = j < n
        row = (b * n + i) * n
        a = tl.load(at_ptr + row + j, mask=in_row, other=0.0)
        if MODE == 0:
            raw = a
        elif MODE == 1:
            raw = tl.load(raw_ptr + row + j, mask=in_row, other=0.0)
        else:
            raw = tl.load(raw_ptr + row + j, mask=in_row, other=0.0) * a
        w = tl.div_rn(raw, tl.full([BN], 1.0, tl.float32) * tl.maximum(tl.max(raw, axis=0), FLOAT32_TINY))
        tl.store(w_ptr + row + j, w, mask=in_row)
        a_n = tl.div_rn(a, tl.full([BN], 1.0, tl.float32) * tl.maximum(tl.max(a, axis=0), FLOAT32_TINY))
        k = block_budget(rho_bits, i, n_budget, FIXED)
        # The list: block 0 first, block i at k − 1 (the same slot when i = 0, k = 1), padding 0 from k; the
        # chosen blocks fill 1..k−2, so the two stores never write one slot (no order between their threads).
        out = idx_ptr + (b * n + i) * kmax
        slot = tl.arange(0, BK)
        tl.store(out + slot, tl.where(slot == k - 1, i, 0), mask=(slot < kmax) & ((slot == 0) | (slot >= k - 1)))
        extra = (k - 2).to(tl.int32)  # at most i − 1: every block of 1..i−1 can be taken
        if extra > 0:  # ties to the lower block, as the decode kernel; pos ascends with the block
            middle = (j >= 1) & (j < i)
            sel, pos = chosen_regs(ordered(w + tie * a_n), middle, middle, extra)
            tl.store(out + 1 + pos, j.to(tl.int64), mask=sel)
        tl.store(cnt_ptr + b * n + i, k.to(tl.int64))


def unsupported_reason(n_blocks: int, dtype: torch.dtype) -> str | None:
    """Why these kernels cannot serve a prompt of ``n_blocks`` blocks with q/k of ``dtype`` (None if they can)."""
    if triton is None:
        return "triton is not installed"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype} (the selection kernels compute in float32 from 16- or 32-bit q/k)"
    if n_blocks > MAX_BLOCKS:
        return f"{n_blocks} blocks (the selection kernels hold a row of at most {MAX_BLOCKS} blocks)"
    return None


def prefill_sketch(q: torch.Tensor, k: torch.Tensor, phi: torch.Tensor, *, block_size: int, logit_scale: float,
                   alpha: float) -> dict[str, torch.Tensor]:
    """The method's ``prefill_sketch`` for ``walk_power=hadamard`` (no ``log_a``): ``q [B, Hq, N, d]``,
    ``k [B, Hkv, N, d]`` (no past keys), ``phi [m, d]`` float32. Returns float32 ``q_avg [B, N, d]``,
    ``q_sum``/``k_sum [B, n, d]``, ``k_sketch [B, n, m]`` and ``a_tilde [B, n, n]`` (``Â^α`` element-wise)."""
    b, hq, n_tok, d = q.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[2] != n_tok or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"k: expected [{b}, Hkv, {n_tok}, {d}] with Hkv dividing {hq}, got {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k: expected a contiguous last dim")
    if phi.dtype != torch.float32 or phi.shape[1] != d:
        raise ValueError(f"phi: expected float32 [m, {d}], got {phi.dtype} {tuple(phi.shape)}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size: expected a power of two, got {block_size}")
    n = -(-n_tok // block_size)
    reason = unsupported_reason(n, q.dtype)
    if reason is not None:
        raise ValueError(f"prefill_sketch: {reason}")
    dev, f32 = q.device, torch.float32
    q_avg = torch.empty(b, n_tok, d, device=dev, dtype=f32)
    sums = torch.empty(2, b, n, d, device=dev, dtype=f32)
    means = torch.empty(2, b, n, d, device=dev, dtype=f32)
    bd = next_pow2(d)
    launch(_block_means_kernel, (b, n), q, k, q_avg, sums, means, hq, k.shape[1], n_tok, d, n, b,
           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
           BS=block_size, BD=bd, num_warps=8 if block_size * bd >= 8192 else 4)
    sketch = torch.matmul(means, phi.T)  # [2, B, n, m]
    logits = torch.matmul(sketch[0], sketch[1].transpose(-1, -2))
    a_tilde = torch.empty(b, n, n, device=dev, dtype=f32)
    bn = next_pow2(n)
    launch(_power_rows_kernel, (b, n), logits, a_tilde, n, float(logit_scale), float(alpha), BN=bn,
           num_warps=_row_warps(bn))
    return {"q_avg": q_avg, "q_sum": sums[0], "k_sum": sums[1], "k_sketch": sketch[1], "a_tilde": a_tilde}


def prefill_select(a_tilde: torch.Tensor, previous: torch.Tensor | None, *, mode: str, density: float,
                   fixed_k: bool, kmax: int, tie: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The method's ``prefill_select``: ``a_tilde [B, n, n]`` float32 (this layer's Ã, zero above the
    diagonal), ``previous [B, n, n]`` the previous sparse layer's walk (None: the first one), ``mode`` one of
    :data:`MODES`, ``kmax`` the largest budget (``max_block_budget``), ``tie`` the one-hop score's weight.
    Returns ``(w [B, n, n] float32, block_idx [B, n, kmax] int64, block_counts [B, n] int64)``."""
    b, n, n2 = a_tilde.shape
    if n != n2 or a_tilde.dtype != torch.float32:
        raise ValueError(f"a_tilde: expected float32 [B, n, n], got {a_tilde.dtype} {tuple(a_tilde.shape)}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {sorted(MODES)}, got {mode!r}")
    if n > MAX_BLOCKS:
        raise ValueError(f"prefill_select: {unsupported_reason(n, torch.float32)}")
    if not 1 <= kmax <= n:
        raise ValueError(f"kmax: expected 1 <= kmax <= {n}, got {kmax}")
    walk_mode = MODES[mode] if previous is not None else 0
    if walk_mode and (previous.shape != a_tilde.shape or previous.dtype != torch.float32):
        raise ValueError(f"previous: expected float32 {tuple(a_tilde.shape)}, got {previous.dtype} "
                         f"{tuple(previous.shape)}")
    a_tilde = a_tilde.contiguous()
    if walk_mode == 1:
        raw = torch.matmul(previous, a_tilde)
    elif walk_mode == 2:
        raw = previous.contiguous()
    else:
        raw = a_tilde  # an unread stand-in
    dev = a_tilde.device
    w = torch.empty(b, n, n, device=dev, dtype=torch.float32)
    idx = torch.empty(b, n, kmax, device=dev, dtype=torch.int64)
    counts = torch.empty(b, n, device=dev, dtype=torch.int64)
    bn = next_pow2(n)
    launch(_select_rows_kernel, (b, n), a_tilde, raw, w, idx, counts, n, kmax, float(tie), float_bits(density), n,
           BN=bn, BK=next_pow2(kmax), MODE=walk_mode, FIXED=bool(fixed_k), num_warps=_row_warps(bn))
    return w, idx, counts


def _row_warps(bn: int) -> int:
    return 8 if bn >= 1024 else 4 if bn >= 256 else 2
