"""Dense split-KV decode (FlashDecoding-style) in Triton: our baseline and the others' building block.

Torch reference: :func:`dense_decode_reference` below, ``softmax(q·K · scale) V`` over each row's
valid prefix, or over its last ``window`` keys (a sliding-window layer: keys ``[len - window, len)``).

One program per (split, KV head, batch row) scores its chunk of keys for the G query heads of the
group at once (one K load shared by G heads), keeps an online softmax, and writes partials that
``triton_utils.merge_partials`` combines: 2 launches per call (the merge with programmatic dependent launch
under ``triton_utils.MERGE_PDL``).
"""

from __future__ import annotations

import math

import torch

from .triton_utils import cdiv, dot_precision, group_block, launch, merge_partials, merge_pdl, triton, workspace

if triton is not None:
    import triton.language as tl

    from .triton_utils import attend_tile, gdc_launch_dependents

    @triton.jit
    def _dense_split_kernel(
        q_ptr, k_ptr, v_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr,
        scale_log2,
        s_q_b, s_q_h,
        s_k_b, s_k_h, s_k_n,
        s_v_b, s_v_h, s_v_n,
        s_acc_b, s_acc_h, s_acc_p,
        s_ml_b, s_ml_h,
        chunk, window,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # the merge may launch now: its programs wait (gdc_wait) until this launch is done
            gdc_launch_dependents()
        split = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length = tl.load(lens_ptr + b)
        # a row's splits start at its first key in the window (window >= every length: key 0)
        lo = tl.maximum(length - window, 0) + split * chunk
        if lo < length:
            hi = tl.minimum(lo + chunk, length)
            offs_g = tl.arange(0, BLOCK_G)
            offs_d = tl.arange(0, D)
            heads = kvh * G + offs_g
            g_ok = offs_g < G
            q = tl.load(q_ptr + b * s_q_b + heads[:, None] * s_q_h + offs_d[None, :],
                        mask=g_ok[:, None], other=0.0)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, D], tl.float32)
            k_base = k_ptr + b * s_k_b + kvh * s_k_h
            v_base = v_ptr + b * s_v_b + kvh * s_v_h
            for start in range(lo, hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                m_i, l_i, acc = attend_tile(q, k_base, v_base, offs_n, offs_n < hi, 0.0, m_i, l_i, acc, s_k_n, s_v_n,
                                            offs_d, scale_log2, False, DOT_PRECISION, False)
            ml = b * s_ml_b + heads * s_ml_h + split
            tl.store(m_ptr + ml, m_i * 0.6931471805599453, mask=g_ok)  # back to natural-log units
            tl.store(l_ptr + ml, l_i, mask=g_ok)
            tl.store(acc_ptr + b * s_acc_b + heads[:, None] * s_acc_h + split * s_acc_p + offs_d[None, :],
                     acc, mask=g_ok[:, None])


    @triton.jit
    def _short_rows_kernel(
        q_ptr, k_ptr, v_ptr, lens_ptr, out_ptr,
        scale_log2, max_len,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n, s_o_b, s_o_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # One program per (KV head, batch row); rows longer than max_len leave at once, so the launch
        # costs next to nothing when no row is short (the common case of a decode at long context).
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        length = tl.load(lens_ptr + b)
        if length <= max_len:
            offs_g = tl.arange(0, BLOCK_G)
            offs_d = tl.arange(0, D)
            heads = kvh * G + offs_g
            g_ok = offs_g < G
            q = tl.load(q_ptr + b * s_q_b + heads[:, None] * s_q_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
            m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, D], tl.float32)
            k_base = k_ptr + b * s_k_b + kvh * s_k_h
            v_base = v_ptr + b * s_v_b + kvh * s_v_h
            for start in range(0, length, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                m_i, l_i, acc = attend_tile(q, k_base, v_base, offs_n, offs_n < length, 0.0, m_i, l_i, acc, s_k_n,
                                            s_v_n, offs_d, scale_log2, False, DOT_PRECISION, False)
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + b * s_o_b + heads[:, None] * s_o_h + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=g_ok[:, None])


def dense_split_plan(batch: int, kv_heads: int, n_keys: int, block_n: int, target_programs: int = 264
                     ) -> tuple[int, int]:
    """(keys per split, number of splits): enough programs to fill the GPU, whole blocks each."""
    want_splits = max(1, cdiv(target_programs, batch * kv_heads))
    chunk = cdiv(n_keys, want_splits)
    chunk = max(block_n, cdiv(chunk, block_n) * block_n)
    return chunk, cdiv(n_keys, chunk)


# Head dims the dense kernel serves (Gemma 3 has 256; the sparse kernels state their own).
DENSE_HEAD_DIMS = (64, 128, 256)


def launch_config(n_keys: int, head_dim: int = 128) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages): the fastest of a sweep on an H100 (bf16, 32/8/128, batch 1;
    docs/methods/santa-kernels.md): 64/4/3 at 32k keys, 128/8/2 at 128k. At head dim 256 a stage's K and V
    tiles are twice as wide: 64 keys and 2 stages keep them within shared memory (128 KB)."""
    if head_dim > 128:
        return 64, 4, 2
    return (64, 4, 3) if n_keys < 65536 else (128, 8, 2)


def dense_decode_triton(q, k, v, lens, scale: float, *, out: torch.Tensor | None = None,
                        block_n: int | None = None, window: int | None = None) -> torch.Tensor:
    """Exact decode attention. q ``[B, Hq, d]``; k, v ``[B, Hkv, N, d]`` (last dim contiguous);
    ``lens [B]`` int32 valid prefix lengths (1 ≤ len ≤ N). Returns ``[B, Hq, d]`` in q's dtype.
    ``window`` (a sliding-window layer) reads only each row's last ``window`` keys, ``[len - window, len)``;
    the splits then cover ``min(N, window)`` keys from the row's own start.
    ``block_n`` (keys per step of a program's loop; default by length) changes only the sum order."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: expected an integer >= 1 or None, got {window!r}")
    span = n if window is None else min(n, window)  # keys one row reads at most
    default_block, num_warps, num_stages = launch_config(span, d)
    block_n = block_n or default_block
    g = hq // hkv
    pdl = merge_pdl()
    chunk, splits = dense_split_plan(b, hkv, span, block_n)
    acc = workspace("acc", q, b * hq * splits * d, torch.float32)
    m = workspace("pm", q, b * hq * splits, torch.float32)
    l = workspace("pl", q, b * hq * splits, torch.float32)
    launch(_dense_split_kernel, (splits, hkv, b),
           q, k, v, lens, acc, m, l,
           scale * _LOG2E,
           q.stride(0), q.stride(1),
           k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2),
           hq * splits * d, splits * d, d,
           hq * splits, splits,
           chunk, n if window is None else window,
           G=g, BLOCK_G=group_block(g), D=d, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype), PDL=pdl,
           num_warps=num_warps, num_stages=num_stages)
    if out is None:
        out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    if window is not None and window < n:
        lens = lens.clamp_max(window)  # the merge reads a row's first ceil(keys read / chunk) splits
    return merge_partials(acc, m, l, lens, out, b, hq, splits, d, chunk, (hq * splits * d, splits * d, d),
                          (hq * splits, splits), pdl=pdl)


_LOG2E = math.log2(math.e)


def dense_short_rows_triton(q, k, v, lens, scale: float, out: torch.Tensor, max_len: int) -> torch.Tensor:
    """Overwrite ``out [B, Hq, d]`` with exact attention for the rows whose valid length is at most
    ``max_len`` (one launch; the other rows are left as they are and cost one length load). Methods use
    it for the rows their budget covers (``exact_when_covered``) without a host read of the lengths."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    launch(_short_rows_kernel, (hkv, b),
           q, k, v, lens, out, scale * _LOG2E, max_len,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           out.stride(0), out.stride(1),
           G=g, BLOCK_G=group_block(g), D=d, BLOCK_N=64, DOT_PRECISION=dot_precision(q.dtype), num_warps=4,
           num_stages=2)
    return out


def dense_short_rows_reference(q, k, v, lens, scale: float, out: torch.Tensor, max_len: int) -> torch.Tensor:
    """What :func:`dense_short_rows_triton` computes (a new tensor; float64 attention cast to out's dtype)."""
    short = (lens.to(out.device).long() <= max_len)[:, None, None]
    return torch.where(short, dense_decode_reference(q, k, v, lens, scale).to(out.dtype), out)


def dense_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                           scale: float, window: int | None = None) -> torch.Tensor:
    """What :func:`dense_decode_triton` computes, in float64: ``softmax(q·K · scale) V`` over ``[0, lens)``,
    or over ``[lens - window, lens)`` with a ``window``."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qg = q.double().view(b, hkv, hq // hkv, d)
    s = torch.matmul(qg, k.double().transpose(-1, -2)) * scale  # [B, Hkv, G, N]
    index = torch.arange(n, device=q.device)[None, :]
    length = lens.to(q.device).long()[:, None]
    valid = (index < length) if window is None else (index < length) & (index >= length - window)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double()).view(b, hq, -1)


__all__ = ["dense_decode_reference", "dense_decode_triton", "dense_short_rows_reference", "dense_short_rows_triton"]
