"""Block-sparse causal prefill in Triton: the kernel of ``block_sparse.py``'s contract, one K/V read per
selected block per KV-head group.

Contract: :func:`kvsieve.kernels.shared.block_sparse.block_sparse_prefill_reference` (its module docstring);
the tests compare the two. ``q [B, Hq, N, d]``, ``k, v [B, Hkv, N, d]`` (float16, bfloat16 or float32,
``d`` 64 or 128, any strides with a contiguous last dim), ``block_idx [B, n, K]`` / ``block_counts [B, n]``
shared by every head, the diagonal block last. Output ``out`` in q's dtype, ``lse [B, Hq, N]`` float32
(natural log of the softmax denominator of the scaled logits, as the reference and FlexAttention).

Why a kernel of its own
-----------------------
The selection is shared by the heads, so the ``G = Hq / Hkv`` query heads of a KV head read the same K/V
blocks. FlexAttention runs one program per (query head, query block) and reads every selected block once
per query head; here one program takes the group's rows of a query block packed as one tile —
packed row ``r`` is head ``hkv·G + r // block_size``, token ``i·block_size + r % block_size`` — so a
selected K/V block is read once per KV head (4× fewer K/V reads at Llama's G = 4) and the ``tl.dot``
tiles are ``G·block_size`` rows tall (256 at G = 4, block 64) instead of ``block_size``.

Execution
---------
Grid ``(n · S, Hkv, B)``, heaviest query blocks first (block ``n − 1`` is launched first: its list is the
longest). ``S = ⌈G·block_size / BLOCK_M⌉`` sub-tiles: when the packed rows exceed ``BLOCK_M``
(``block_m``, default :func:`launch_config`) a program takes the rows ``[s·BLOCK_M, (s+1)·BLOCK_M)`` and
the group's K/V blocks are read ``S`` times; packed rows past ``G·block_size`` (G not a power of two) and
tokens past ``N`` are masked. Each program reads its row's count from device memory (no host sync),
walks the ``count − 1`` off-diagonal blocks of its list without any mask (they are whole blocks before
the diagonal), then the diagonal block with the causal mask (keys ``≤`` the row's token and ``< N``).
Online softmax in float32 in log2 units; K and V tiles are ``block_size`` keys × ``d``; ``P`` is cast to
V's dtype for the second dot (FlashAttention's practice). Every real query row sees its own key, so its
denominator is positive.
"""

from __future__ import annotations

import math

import torch

from .block_sparse_checks import check_block_sparse_inputs
from .triton_utils import cdiv, is_interpreted, launch, next_pow2, triton
from .triton_utils import unsupported_reason as _triton_unsupported_reason

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128)
MIN_BLOCK_SIZE = 16  # tl.dot needs 16 key rows
MAX_BLOCK_SIZE = 128
_LOG2E = math.log2(math.e)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def attend_block(q, k_ptrs, v_ptrs, m_i, l_i, acc, scale_log2, key_ok, ok, MASKED: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
        """One online-softmax step of the ``[M, D]`` query tile over one K/V block (log2 units); with
        MASKED, only the keys ``key_ok [BS]`` are read and only the pairs ``ok [M, BS]`` count."""
        if MASKED:
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong; its tests upcast the tiles instead
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # masked rows (padding) stay empty
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MASKED:
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def packed_program(q_ptr, k_ptr, v_ptr, n_tok, n_blocks, n_sub, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh,
                       s_vn, G: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       D: tl.constexpr, DOT_F32: tl.constexpr):
        """This program's share of grid ``(n · n_sub, Hkv, B)``: query block ``blk`` (the longest lists first),
        KV head ``kvh``, batch row ``b``, and its sub-tile of the packed rows of the KV head's query heads
        (packed row ``r``: head ``kvh·G + r // BS``, token ``blk·BS + r % BS``). Returns ``(b, blk, q
        [BLOCK_M, D], head, tok, row_ok, k_base, v_base, k_tile, v_tile)``: rows past the group or past N masked
        (q zero); the KV head's keys/values at ``k_base``/``v_base``, and the offsets of a ``[BLOCK_N, D]`` tile
        (kept as 32-bit offsets beside a scalar pointer: a tile of 64-bit pointers would take registers)."""
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        blk = n_blocks - 1 - pid // n_sub
        r = (pid % n_sub) * BLOCK_M + tl.arange(0, BLOCK_M)
        head = kvh * G + r // BS
        tok = blk * BS + r % BS
        row_ok = (r < G * BS) & (tok < n_tok)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        q_rows = b * s_qb + head.to(tl.int64) * s_qh + tok.to(tl.int64) * s_qn
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        k_base = k_ptr + b * s_kb + kvh.to(tl.int64) * s_kh
        v_base = v_ptr + b * s_vb + kvh.to(tl.int64) * s_vh
        k_tile = offs_n[:, None] * s_kn + offs_d[None, :]
        v_tile = offs_n[:, None] * s_vn + offs_d[None, :]
        return b, blk, q, head, tok, row_ok, k_base, v_base, k_tile, v_tile

    @triton.jit
    def attend_whole_blocks(q, idx_row, count, k_base, v_base, k_tile, v_tile, s_kn, s_vn, m_i, l_i, acc, scale_log2,
                            BS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                            DOT_F32: tl.constexpr):
        """The online softmax over the first ``count`` key blocks listed at ``idx_row``, every pair kept (no
        mask); ``BS // BLOCK_N`` key tiles each."""
        for t in range(0, count * (BS // BLOCK_N)):
            start = tl.load(idx_row + t // (BS // BLOCK_N)).to(tl.int64) * BS + (t % (BS // BLOCK_N)) * BLOCK_N
            m_i, l_i, acc = attend_block(q, k_base + start * s_kn + k_tile, v_base + start * s_vn + v_tile, m_i, l_i,
                                         acc, scale_log2, None, None, False, DOT_PRECISION, DOT_F32)
        return m_i, l_i, acc

    @triton.jit
    def store_packed_rows(out_ptr, acc, l_i, b, head, tok, row_ok, s_ob, s_oh, s_on, D: tl.constexpr):
        """The packed rows' outputs ``acc / l`` (zero where ``l = 0``) into ``out [B, Hq, N, D]``."""
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = b * s_ob + head.to(tl.int64) * s_oh + tok.to(tl.int64) * s_on
        tl.store(out_ptr + o_rows[:, None] + tl.arange(0, D)[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])

    @triton.jit(do_not_specialize=["n_tok", "n_blocks", "n_sub"])
    def _block_sparse_prefill_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, cnt_ptr, out_ptr, lse_ptr,
        scale_log2, n_tok, n_blocks, n_sub,
        s_qb, s_qh, s_qn,
        s_kb, s_kh, s_kn,
        s_vb, s_vh, s_vn,
        s_ib, s_in,
        s_cb, s_cn,
        s_ob, s_oh, s_on,
        s_lb, s_lh,
        G: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        b, blk, q, head, tok, row_ok, k_base, v_base, k_tile, v_tile = packed_program(
            q_ptr, k_ptr, v_ptr, n_tok, n_blocks, n_sub, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
            G, BS, BLOCK_M, BLOCK_N, D, DOT_F32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Off-diagonal blocks: whole blocks before the query block, no mask.
        count = tl.load(cnt_ptr + b * s_cb + blk * s_cn).to(tl.int32)
        m_i, l_i, acc = attend_whole_blocks(q, idx_ptr + b * s_ib + blk * s_in, count - 1, k_base, v_base, k_tile,
                                            v_tile, s_kn, s_vn, m_i, l_i, acc, scale_log2, BS, BLOCK_N, DOT_PRECISION,
                                            DOT_F32)
        # The diagonal block: keys at or before the row's token, and before N.
        for j in tl.static_range(BS // BLOCK_N):
            key_pos = blk * BS + j * BLOCK_N + tl.arange(0, BLOCK_N)
            key_ok = key_pos < n_tok
            ok = (key_pos[None, :] <= tok[:, None]) & key_ok[None, :]
            start = blk.to(tl.int64) * BS + j * BLOCK_N
            m_i, l_i, acc = attend_block(q, k_base + start * s_kn + k_tile, v_base + start * s_vn + v_tile, m_i, l_i,
                                         acc, scale_log2, key_ok, ok, True, DOT_PRECISION, DOT_F32)

        store_packed_rows(out_ptr, acc, l_i, b, head, tok, row_ok, s_ob, s_oh, s_on, D)
        safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, (m_i + tl.log2(safe)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + b * s_lb + head.to(tl.int64) * s_lh + tok, lse, mask=row_ok)


def launch_config(group: int, block_size: int, d: int) -> tuple[int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages)`` from the launch sweep
    (``docs/results/studies/sketchwalk/tune_prefill.py``;
    ``docs/results/gpu-bench/2026-11-27-h200-sketchwalk-prefill-tune.md``, H200, G = 4, d = 128, 10 % density):
    64-key blocks take packed tiles of up to 256 rows against whole 64-key blocks, 8 warps, 2 stages (faster
    than 128-row tiles: the group's 256 rows share each K/V tile, although it spills); 128-key blocks take
    128-row tiles against whole 128-key blocks, 3 stages. Other block sizes keep tiles of up to 128 rows and 64
    keys, 2 stages (not swept)."""
    rows = next_pow2(group * block_size)
    if block_size == 64:
        return min(rows, 256), 64, 8, 2
    if block_size == 128 and d <= 128:
        return min(rows, 128), 128, 8, 3
    return min(rows, 128), min(block_size, 64), 8, 2


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> str | None:
    """Why :func:`block_sparse_prefill_triton` cannot serve these tensors (None when it can)."""
    if block_size & (block_size - 1) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        return (f"block_size {block_size} (the Triton prefill kernel takes a power of two in "
                f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}])")
    if not (q.dtype == k.dtype == v.dtype):
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (q, k, v must share one)"
    return _triton_unsupported_reason(q, k, v, head_dims=SUPPORTED_HEAD_DIMS, kernels="the block-sparse prefill kernel")


def block_sparse_prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    block_counts: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    check: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, N, d] in q's dtype, lse [B, Hq, N] float32)`` of the contract (module docstring).

    ``check=True`` runs :func:`check_block_sparse_inputs` (reads the lists: a host sync). ``block_m``
    (packed query rows per program, a power of two ≥ 16), ``block_n`` (keys per K/V tile, a power of two
    in ``[16, block_size]``), ``num_warps`` and ``num_stages`` override :func:`launch_config`.
    """
    if check:
        check_block_sparse_inputs(q, k, v, block_idx, block_counts, block_size)
    elif q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or block_idx.dim() != 3 or block_counts.dim() != 2:
        raise ValueError(f"q, k, v, block_idx, block_counts: expected 4-D, 4-D, 4-D, 3-D, 2-D tensors, got "
                         f"{q.dim()}, {k.dim()}, {v.dim()}, {block_idx.dim()}, {block_counts.dim()}")
    reason = unsupported_reason(q, k, v, block_size)
    if reason is not None:
        raise ValueError(f"block_sparse_prefill_triton cannot serve this call: {reason}")
    b, hq, n_tok, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or k.shape[2] != n_tok or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"q, k, v: expected [B, G·Hkv, N, d] and [B, Hkv, N, d], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    group = hq // hkv
    n = cdiv(n_tok, block_size)
    if block_idx.shape[:2] != (b, n) or block_counts.shape != (b, n):
        raise ValueError(f"block_idx, block_counts: expected [B={b}, n={n}, K] and [{b}, {n}], got "
                         f"{tuple(block_idx.shape)}, {tuple(block_counts.shape)}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    default_m, default_n, default_warps, default_stages = launch_config(group, block_size, d)
    block_m, block_n = block_m or default_m, block_n or default_n
    if block_m & (block_m - 1) or block_m < 16:
        raise ValueError(f"block_m: expected a power of two ≥ 16, got {block_m}")
    if block_n & (block_n - 1) or not 16 <= block_n <= block_size:
        raise ValueError(f"block_n: expected a power of two in [16, block_size={block_size}], got {block_n}")
    n_sub = cdiv(group * block_size, block_m)
    out = torch.empty(b, hq, n_tok, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(b, hq, n_tok, device=q.device, dtype=torch.float32)
    scale = d ** -0.5 if scale is None else scale
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    launch(_block_sparse_prefill_kernel, (n * n_sub, hkv, b),
           q, k, v, block_idx, block_counts, out, lse,
           scale * _LOG2E, n_tok, n, n_sub,
           q.stride(0), q.stride(1), q.stride(2),
           k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2),
           block_idx.stride(0), block_idx.stride(1),
           block_counts.stride(0), block_counts.stride(1),
           out.stride(0), out.stride(1), out.stride(2),
           lse.stride(0), lse.stride(1),
           G=group, BS=block_size, BLOCK_M=block_m, BLOCK_N=block_n, D=d, DOT_PRECISION=precision,
           DOT_F32=is_interpreted(_block_sparse_prefill_kernel) and q.dtype != torch.float32,
           num_warps=num_warps or default_warps, num_stages=num_stages or default_stages)
    return out, lse


__all__ = ["block_sparse_prefill_triton", "launch_config", "unsupported_reason", "SUPPORTED_DTYPES",
           "SUPPORTED_HEAD_DIMS", "MIN_BLOCK_SIZE", "MAX_BLOCK_SIZE"]
