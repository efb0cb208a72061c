"""Exact top-k selection on the device (``oracle-topk``): every score in one Triton pass over K, then the
exact top keys in one more launch (:mod:`kvsieve.kernels.shared.select_triton`), as a token list for
:func:`kvsieve.kernels.shared.weighted_triton.sparse_decode_triton`.

The scores pass reads all of K once (a GQA group's query rows share each K tile) and writes float32
scaled logits ``[B, Hq, N]``, −inf outside each row's candidates ``[sink_end, window_start)`` (the keys
the dense part does not cover, below the length), and each row's count of keys to take (and what the
select launch needs: the maxima of every 8 scores, or per-block softmax partials). No host sync; shapes
are static.
"""

from __future__ import annotations

import torch

from ..quest.quest_pages import (
    candidate_mask,
    group_summed,
    score_launch_args,
    selection_counts_reference,
)
from ..shared.triton_utils import cdiv, is_interpreted, launch, next_pow2, triton

# Per-query-head rows above this many keys take torch.topk: there it beat the select launch on the H100, which
# wins per KV head (a quarter of the rows) and at 32k
# (benchmarks/results/2026-11-25-h100-sparse-decode-select.md).
TORCH_SELECT_ABOVE = 65536


def select_path(share_kv_group: bool, n_keys: int) -> str:
    """The top-k step of an oracle top-k on the device (oracle-topk, vattention's oracle predictor):
    ``"torch"`` for long per-query-head rows, else ``"triton"``."""
    return "torch" if not share_kv_group and n_keys > TORCH_SELECT_ABOVE else "triton"


def scores_reference(q, k, lengths, sink: int = 0, window: int = 0, scale: float | None = None) -> torch.Tensor:
    """``[B, Hq, N]`` float32 ``scale · q·k``, −inf outside ``[sink_end, window_start)``."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    s = torch.matmul(q.float().view(b, hkv, hq // hkv, d), k.float().transpose(-1, -2)).view(b, hq, n) * scale
    return s.masked_fill(~candidate_mask(lengths, n, 1, sink, window)[:, None, :], float("-inf"))


if triton is not None:
    import triton.language as tl

    from ..quest.quest_pages import load_group_queries, score_program
    from ..shared.select_common import store_maxima, store_softmax_part

    @triton.jit(do_not_specialize=["sink", "window", "n_keys", "size", "max_units"])
    def _scores_kernel(
        q_ptr, k_ptr, lens_ptr, out_ptr, counts_ptr, frac_ptr, pm_ptr, pl_ptr, mx_ptr,
        scale, sink, window, n_keys, size, max_units,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_o_b, s_o_h, s_p_b, s_p_h, s_x_b, s_x_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        MASK_DENSE: tl.constexpr, WRITE_COUNTS: tl.constexpr, IS_FRAC: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr, WRITE_PARTS: tl.constexpr,
        WRITE_MAX: tl.constexpr, GROUP_MAX: tl.constexpr,
    ):
        blk, kvh, b, b64, length, sink_end, win_start = score_program(
            lens_ptr, counts_ptr, frac_ptr, sink, window, size, max_units, 1, WRITE_COUNTS, IS_FRAC)
        q, heads, g_ok, offs_d = load_group_queries(q_ptr, b64, kvh, s_q_b, s_q_h, G, BLOCK_G, D)
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        if MASK_DENSE:
            keep = (offs_n >= sink_end) & (offs_n < win_start)
        else:
            keep = offs_n < length
        k = tl.load(k_ptr + b64 * s_k_b + kvh * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                    mask=keep[:, None], other=0.0)
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong; its tests upcast the tiles instead
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(keep[None, :], s, float("-inf"))
        tl.store(out_ptr + b64 * s_o_b + heads[:, None] * s_o_h + offs_n[None, :], s,
                 mask=g_ok[:, None] & (offs_n < n_keys)[None, :])
        if WRITE_PARTS:  # the group-summed ranking's softmax needs each head's lse over all keys
            store_softmax_part(pm_ptr, pl_ptr, b64, heads, g_ok, blk, s_p_b, s_p_h, s)
        if WRITE_MAX:  # the select launch's prefilter subset
            store_maxima(mx_ptr, b64, heads, g_ok, blk, s_x_b, s_x_h, s, n_keys, BLOCK_N, BLOCK_G, GROUP_MAX)


def scores_triton(q, k, lengths, sink: int = 0, window: int = 0, scale: float | None = None,
                  out: torch.Tensor | None = None, *, mask_dense: bool = True, counts: torch.Tensor | None = None,
                  size: int | float = 0, max_k: int = 0,
                  parts: tuple[torch.Tensor, torch.Tensor] | None = None,
                  maxima: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`scores_reference` in one launch (``lengths`` int32 ``[B]``). bf16/fp16 products are exact
    in the fp32 accumulator; fp32 inputs use IEEE dots. ``mask_dense=False`` masks only keys past the
    length; with ``counts [B]`` (int64) it also writes the keys each row takes (``size``, ``max_k``); with
    ``parts = (max, sum_exp)`` float32 ``[B, Hq, ceil(N / score_block(d))]`` each block's softmax
    partials; with ``maxima`` float32 ``[B, Hq, ceil(N / GROUP_MAX)]`` the max of every ``GROUP_MAX``
    scores (both for :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton`)."""
    from ..shared.select_triton import GROUP_MAX

    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    scale, out, frac, count, is_frac = score_launch_args(q, n, scale, out, size)
    block_n = score_block(d)
    pm, pl = (out, out) if parts is None else parts
    mx = out if maxima is None else maxima
    launch(_scores_kernel, (cdiv(n, block_n), hkv, b),
           q, k, lengths, out, out if counts is None else counts, lengths if frac is None else frac, pm, pl, mx,
           scale, sink, window, n, count, max_k,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), out.stride(0), out.stride(1),
           pm.stride(0), pm.stride(1), mx.stride(0), mx.stride(1),
           G=g, BLOCK_G=max(16, next_pow2(g)), D=d, BLOCK_N=block_n,
           MASK_DENSE=mask_dense, WRITE_COUNTS=counts is not None, IS_FRAC=is_frac,
           DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
           DOT_F32=q.dtype == torch.bfloat16 and is_interpreted(_scores_kernel), WRITE_PARTS=parts is not None,
           WRITE_MAX=maxima is not None, GROUP_MAX=GROUP_MAX, num_warps=4, num_stages=2)
    return out


def score_block(d: int) -> int:
    """Keys per program of the scores launch (and per softmax partial) for head dim ``d``."""
    return 128 if d <= 128 else 64


def topk_select(q, k, lengths, *, sink: int, window: int, size: int | float, max_k: int, share_kv_group: bool,
                scale: float | None = None, scores: str = "triton",
                select: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """``oracle-topk``'s token list for :func:`sparse_decode_triton` (with the same ``sink``/``window``):
    ``(indices [B, Hs, K], counts [B, Hs])`` with ``K = max(1, max_k)``; ``Hs = Hkv`` when
    ``share_kv_group`` (ranked by the group-summed softmax, each head's softmax over every valid key as in
    the reference) else ``Hq``. ``size``: keys per row (a count or a fraction of its length, as
    ``resolve_size``). The first ``counts`` entries of a row are its keys.

    ``select="triton"`` (default): the scores pass over K (writing the maxima of every 8 scores, or for
    group-summed rows per-block softmax partials and then one parallel group-sum launch) and
    :func:`~kvsieve.kernels.shared.select_triton.topk_rows_triton` (prefilter, exact radix select), keys
    in ascending order: 2 launches, 3 with ``share_kv_group``. ``select="torch"``: the same up to
    ``torch.topk`` in place of the select launch (a multi-block radix select of its own for
    rows over ~20k keys). ``scores="reference"`` runs every step
    in torch (highest first)."""
    b, hq, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    kk = max(1, min(max_k, n))
    if select not in ("triton", "torch"):
        raise ValueError(f"select: expected 'triton' or 'torch', got {select!r}")
    if scores == "reference":
        if share_kv_group:
            s = group_summed(scores_reference(q, k, lengths, 0, 0, scale), hq // hkv)
            s = s.masked_fill(~candidate_mask(lengths, n, 1, sink, window)[:, None, :], float("-inf"))
        else:
            s = scores_reference(q, k, lengths, sink, window, scale)
        counts = selection_counts_reference(lengths, size, 1, sink, window, kk)
    elif scores != "triton":
        raise ValueError(f"scores: expected 'triton' or 'reference', got {scores!r}")
    else:
        from ..shared.select_triton import select_rows

        def score(**kw):
            return scores_triton(q, k, lengths, sink, window, scale, size=size, max_k=kk, **kw)

        return select_rows(score, batch=b, heads=hq, kv_heads=hkv, n_units=n, k=kk, block=score_block(q.shape[-1]),
                           share_kv_group=share_kv_group, lengths=lengths, unit=1, sink=sink, window=window,
                           select=select, device=q.device)
    idx = torch.topk(s, kk, dim=-1, sorted=True).indices
    return idx, counts[:, None].expand(b, s.shape[1])


__all__ = ["score_block", "scores_reference", "scores_triton", "topk_select"]
