"""What the exact scoring launches share (Quest's page bounds, the exact scores of oracle-topk, oracle-topp
and vAttention's oracle predictor): a row's candidates (the keys of ``[sink_end, window_start)``, the
dense part being read as ranges by the weighted sparse kernel), its count of units to take, the GQA
group-summed ranking, and the exact scores pass over K (:func:`scores_triton`, one launch, beside its
torch reference :func:`scores_reference`) with what the select launches of ``select_triton.py`` need.
No host sync; shapes are static."""

from __future__ import annotations

import torch

from .triton_utils import cdiv, float64_constants, is_interpreted, launch, next_pow2, triton


def dense_bounds(lengths: torch.Tensor, sink: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sink_end, window_start) [B]`` of the dense part (``weighted_triton``'s contract)."""
    length = lengths.long()
    sink_end = torch.clamp(length, max=sink)
    return sink_end, torch.maximum(length - window, sink_end)


def candidate_mask(lengths: torch.Tensor, n_units: int, unit: int, sink: int, window: int) -> torch.Tensor:
    """``[B, n_units]`` bool: units (pages of ``unit`` keys; tokens for 1) holding a candidate key, i.e. a
    key of ``[sink_end, window_start)``."""
    lo, hi = dense_bounds(lengths, sink, window)
    start = torch.arange(n_units, device=lengths.device) * unit
    return (start[None, :] < hi[:, None]) & (start[None, :] + unit > lo[:, None])


def selection_counts_reference(lengths: torch.Tensor, size: int | float, unit: int, sink: int, window: int,
                               max_units: int) -> torch.Tensor:
    """``[B]`` units a row takes: ``ceil(tokens / unit)`` with ``tokens`` = the ``size`` count, or
    ``max(1, floor(len · size))`` for a fraction (``resolve_size``), capped by ``max_units`` and by the
    units holding a candidate key."""
    length = lengths.long()
    if isinstance(size, float):
        tokens = torch.clamp(torch.floor(length.to(torch.float64) * size).long(), min=1)
    else:
        tokens = torch.full_like(length, int(size))
    lo, hi = dense_bounds(lengths, sink, window)
    first = torch.div(lo, unit, rounding_mode="floor")
    end = torch.div(hi + unit - 1, unit, rounding_mode="floor")
    cand = torch.where(hi > lo, end - first, 0)
    wanted = torch.div(tokens + unit - 1, unit, rounding_mode="floor")
    return torch.minimum(torch.clamp(wanted, max=max_units), cand)


def group_summed(scores: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, Hq, X] -> [B, Hkv, X]``: log of the per-head softmax summed over the GQA group (the
    reference's ``group_scores``); rows without a finite score stay −inf instead of NaN."""
    b, hq, x = scores.shape
    finite = torch.isfinite(scores).any(-1, keepdim=True)
    logp = torch.log_softmax(torch.where(finite, scores, 0.0), dim=-1)
    logp = torch.where(torch.isfinite(scores), logp, float("-inf"))
    return torch.logsumexp(logp.view(b, hq // group, group, x), dim=2)


def score_launch_args(q: torch.Tensor, n_units: int, scale: float | None, out: torch.Tensor | None,
                      size: int | float):
    """What a scoring launch over ``n_units`` keys or pages needs besides its tensors: the scale (1/√d by
    default), the float32 ``[B, Hq, n_units]`` output and :func:`count_args`."""
    b, hq, d = q.shape
    if out is None:
        out = torch.empty(b, hq, n_units, device=q.device, dtype=torch.float32)
    return (d ** -0.5 if scale is None else scale), out, *count_args(size, q.device)


def count_args(size: int | float, device) -> tuple[torch.Tensor | None, int, bool]:
    """``(fraction tensor or None, count, is_fraction)`` for the kernels that write selection counts."""
    if isinstance(size, float):
        return float64_constants((size,), device), 0, True
    return None, int(size), False


def scores_reference(q, k, lengths, sink: int = 0, window: int = 0, scale: float | None = None) -> torch.Tensor:
    """``[B, Hq, N]`` float32 ``scale · q·k``, −inf outside ``[sink_end, window_start)``."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    s = torch.matmul(q.float().view(b, hkv, hq // hkv, d), k.float().transpose(-1, -2)).view(b, hq, n) * scale
    return s.masked_fill(~candidate_mask(lengths, n, 1, sink, window)[:, None, :], float("-inf"))


if triton is not None:
    import triton.language as tl

    from .select_common import store_maxima, store_softmax_part
    from .triton_utils import dense_range

    @triton.jit
    def write_counts(counts_ptr, b, sink_end, win_start, length, frac_ptr, size, max_units,
                     UNIT: tl.constexpr, IS_FRAC: tl.constexpr):
        """``counts[b]`` = :func:`selection_counts_reference` for one row."""
        if IS_FRAC:
            tokens = tl.maximum(tl.floor(length.to(tl.float64) * tl.load(frac_ptr)).to(tl.int32), 1)
        else:
            tokens = size
        first = sink_end // UNIT
        end = (win_start + UNIT - 1) // UNIT
        cand = tl.where(win_start > sink_end, end - first, 0)
        wanted = tl.minimum((tokens + UNIT - 1) // UNIT, max_units)
        tl.store(counts_ptr + b, tl.minimum(wanted, cand).to(tl.int64))

    @triton.jit
    def score_program(lens_ptr, counts_ptr, frac_ptr, sink, window, size, max_units, UNIT: tl.constexpr,
                      WRITE_COUNTS: tl.constexpr, IS_FRAC: tl.constexpr):
        """A scoring program's (block, KV head, batch row) and its row's dense bounds; the first program
        of the row also writes the row's count of units to take (``write_counts``)."""
        blk = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length, sink_end, win_start = dense_range(lens_ptr, b, sink, window)
        if WRITE_COUNTS:
            if (blk == 0) & (kvh == 0):
                write_counts(counts_ptr, b, sink_end, win_start, length, frac_ptr, size, max_units, UNIT, IS_FRAC)
        return blk, kvh, b, b.to(tl.int64), length, sink_end, win_start

    @triton.jit
    def load_group_queries(q_ptr, b64, kvh, s_q_b, s_q_h, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr):
        """The query rows of KV head ``kvh``'s group ``[BLOCK_G, D]`` (rows past ``G`` are 0), their head
        numbers and row mask, and the feature offsets."""
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + b64 * s_q_b + heads[:, None] * s_q_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        return q, heads, g_ok, offs_d

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
    from .select_triton import GROUP_MAX

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
