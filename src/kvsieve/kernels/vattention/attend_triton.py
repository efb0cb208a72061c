"""vAttention's estimate with the oracle predictor in one pass per KV head, without an index list.

The list path (``kernels/shared/weighted_triton.py``) reads one weighted index list per query head: a key
that two heads of a GQA group keep is gathered twice, and the residual sample's list is as wide as the
context (its size is known on the device only). Here the selection is not listed but tested, key by key,
in the attention pass itself, and one program serves the ``G`` query heads of a KV head:

- the predicted top-k: the excluded-key marks ``excluded [R, Hq, N]`` that
  :func:`~kvsieve.kernels.vattention.budget_triton.residual_setup_triton` writes for the samples;
- the residual sample of head ``h``: the ``b_h`` residual keys with the smallest 24-bit hash
  (``sample_triton``'s draws), i.e. the keys whose hash is below the head's cut ``t_h``, or equal to it at a
  position ``≤ p_h`` (ties to the lowest positions): ``sample_rows_triton(..., cut=...)`` writes
  ``(t_h, p_h)`` instead of the list, and this kernel recomputes each key's hash (a few integer ops);
- weights 1 (top-k) and ``n_s / b`` (sample), sink and window read as ranges at weight 1.

The logits of the selectable keys are not recomputed from K: the predictor's scores pass already wrote
every one of them (float32 ``scale · q·k``, ``[R, Hq, N]``); the pass reads those (16 bytes per key for a
group of four heads instead of K's 256). It reads every V row and score of the selectable range, whatever the
selection: its loads then do not wait on the marks and hashes of their block, so they stream at the copy
rate, and at vAttention's default densities (0.55–0.8 per head) nearly every V row is kept by some head of a
GQA group of four anyway. Sink and window take their logits from K. With the scores pass over K the step
reads K + V + O(N·Hq) bytes.

Same estimator as the list path (``Σ w e^s v / Σ w e^s`` over the same keys at the same weights);
:func:`attend_reference` is its torch twin. Split-K partials as the list kernel's, merged by
``triton_utils.merge_partials``. No host sync; the grid depends on static shapes only.
"""

from __future__ import annotations

import math

import torch

from ...core.rng import GOLDEN, MASK32, POSITION_BITS, hash_bits
from ..shared.select_common import check_launch_value, sm_count
from ..shared.triton_utils import cdiv, is_interpreted, launch, merge_partials, next_pow2, triton, workspace

#: programs of the pass per SM, keys per block and pipeline stages: on the H200 (Llama 32/8/128, peaked) 103.1 µs at
#: 128k batch 1 and 180.6 at 32k batch 8, against 152.3 / 261.0 at 528 programs of 64-key blocks and 205.2 / 383.1
#: with the tests on 16 padded rows (docs/results/gpu-bench/2026-11-29-h200-vattention-stage-ways-128k.md, -32k-b8.md)
PROGRAMS_PER_SM = 5
BLOCK_N = 32
NUM_STAGES = 3
_LOG2E = math.log2(math.e)


def in_sample_reference(lo, hi, stream: int, start, end, excluded, cut, tie, n_keys: int) -> torch.Tensor:
    """``[R, Hs, N]`` bool: the residual sample as its cut describes it — positions of ``[start, end)``
    not ``excluded`` whose hash (``sample_rows_reference``'s) is below ``cut [R, Hs]`` or equal to it at a
    position ``≤ tie [R, Hs]``."""
    r, hs = cut.shape
    pos = torch.arange(n_keys, device=cut.device)
    c = (torch.arange(hs, device=cut.device)[:, None] << POSITION_BITS) + pos[None, :]
    h = hash_bits(lo.view(r, 1, 1), hi.view(r, 1, 1), stream, c[None]) >> 8
    ok = (pos >= start.view(r, 1, 1)) & (pos < end.view(r, 1, 1)) & ~excluded
    return ok & ((h < cut[..., None]) | ((h == cut[..., None]) & (pos <= tie[..., None])))


def attend_reference(q, k, v, lengths, sink: int, window: int, scale: float, scores, excluded, in_sample,
                     n_s, size) -> torch.Tensor:
    """``out [R, Hq, d]`` (q's dtype): :func:`attend_triton`'s estimate in torch (float32) from the same
    operands, with the sample given as ``in_sample [R, Hq, N]`` (:func:`in_sample_reference`)."""
    r, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    pos = torch.arange(n, device=q.device)
    length = lengths.long()[:, None, None]
    sink_end = torch.clamp(length, max=sink)
    win_start = torch.maximum(length - window, sink_end)
    dense = ((pos < sink_end) | (pos >= win_start)) & (pos < length)
    mid = (pos >= sink_end) & (pos < win_start)
    dense_logit = torch.einsum("rhd,rhnd->rhn", q.float(), k.float().repeat_interleave(g, 1)) * scale
    w = n_s.double() / size.clamp(min=1).double()
    logw = torch.log(w.float())[..., None]
    top = excluded & mid
    samp = in_sample & mid & ~excluded
    logit = torch.where(dense, dense_logit, scores.float())
    logit = logit + torch.where(samp, logw, 0.0)
    logit = logit.masked_fill(~(dense | top | samp), float("-inf"))
    p = torch.softmax(logit, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    return torch.einsum("rhn,rhnd->rhd", p, v.float().repeat_interleave(g, 1)).to(q.dtype)


if triton is not None:
    import triton.language as tl

    from ..shared.sample_triton import hash24
    from ..shared.triton_utils import attend_dense_split, dense_range, store_partials

    @triton.jit
    def _double_rows(x):
        # [R, C] -> [2R, C]: x in rows [0, R), a copy of it in [R, 2R)
        return tl.reshape(tl.permute(tl.join(x, x), (2, 0, 1)), [2 * x.shape[0], x.shape[1]])

    @triton.jit
    def _widen(x, TO: tl.constexpr):
        """``[R, C] -> [TO, C]`` (``R`` and ``TO`` powers of two, ``R ≤ TO ≤ 16 R``): x in the first ``R`` rows,
        copies of it below (the caller masks or ignores them)."""
        for _ in tl.static_range(4):
            if TO >= 2 * x.shape[0]:
                x = _double_rows(x)
        return x

    @triton.jit(do_not_specialize=["n_keys", "sink", "window", "n_mid_parts", "mid_chunk", "dense_chunk",
                                   "n_parts"])
    def _attend_kernel(
        q_ptr, k_ptr, v_ptr, sc_ptr, x_ptr, lens_ptr, lo_ptr, hi_ptr, cut_ptr, tie_ptr, ns_ptr, bs_ptr,
        acc_ptr, m_ptr, l_ptr,
        scale_log2, stream_key, n_keys, sink, window, n_mid_parts, mid_chunk, dense_chunk, n_parts,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n, s_s_b, s_s_h, s_x_b, s_x_h, s_c_b, s_c_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        # BLOCK_G rows for tl.dot (at least 16); BLOCK_H (≤ BLOCK_G) rows on which the selectable keys'
        # tests, hashes and exponentials run: BLOCK_G, or next_pow2(G) with p widened to BLOCK_G rows (zeros
        # below the heads) only for the dot
        part = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        b64 = b.to(tl.int64)
        length, sink_end, win_start = dense_range(lens_ptr, b, sink, window)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * G + offs_g
        g_ok = offs_g < G
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        k_base = k_ptr + b64 * s_k_b + kvh * s_k_h
        v_base = v_ptr + b64 * s_v_b + kvh * s_v_h
        if part < n_mid_parts:
            # selectable keys [sink_end, win_start): tested per head, logits from the scores pass
            lo = sink_end + part * mid_chunk
            hi = tl.minimum(lo + mid_chunk, win_start)
            if lo < hi:
                offs_h = tl.arange(0, BLOCK_H)
                h_ok = offs_h < G
                hh = kvh * G + offs_h
                w_lo = tl.load(lo_ptr + b)
                w_hi = tl.load(hi_ptr + b)
                cs = b64 * s_c_b + hh * s_c_h
                # 24-bit hashes, positions and cuts all fit 32 bits: the tests run in int32
                cut = tl.load(cut_ptr + cs, mask=h_ok, other=0).to(tl.int32)
                tie = tl.load(tie_ptr + cs, mask=h_ok, other=-1).to(tl.int32)
                n_s = tl.load(ns_ptr + cs, mask=h_ok, other=1).to(tl.float64)
                size = tl.load(bs_ptr + cs, mask=h_ok, other=1).to(tl.float64)
                # the list path's log2 of the float64 weight n_s / b, taken in float32
                log2_w = tl.log2((n_s / tl.maximum(size, 1.0)).to(tl.float32))
                s_row = sc_ptr + b64 * s_s_b + hh[:, None] * s_s_h
                x_row = x_ptr + b64 * s_x_b + hh[:, None] * s_x_h
                # hash_bits' counter (head << POSITION_BITS) + position, taken mod 2^32 as the hash does
                counter = hh.to(tl.uint32)[:, None] << 22
                m_h = tl.full([BLOCK_H], float("-inf"), tl.float32)
                l_h = tl.zeros([BLOCK_H], tl.float32)
                for p0 in range(lo, hi, BLOCK_N):
                    pos = p0 + offs_n
                    okh = h_ok[:, None] & (pos < hi)[None, :]
                    # the block's loads first, independent of its selection: issued without waiting
                    vt = tl.load(v_base + pos[:, None] * s_v_n + offs_d[None, :], mask=(pos < hi)[:, None], other=0.0)
                    s = tl.load(s_row + pos[None, :], mask=okh, other=0.0) * 1.4426950408889634
                    top = tl.load(x_row + pos[None, :], mask=okh, other=0) != 0
                    hv = hash24(w_lo, w_hi, stream_key, counter + pos.to(tl.uint32)[None, :]).to(tl.int32)
                    samp = ~top & ((hv < cut[:, None]) | ((hv == cut[:, None]) & (pos[None, :] <= tie[:, None])))
                    sel = okh & (top | samp)
                    s = tl.where(sel, s + tl.where(top, 0.0, log2_w[:, None]), float("-inf"))
                    m_new = tl.maximum(m_h, tl.max(s, axis=1))
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_h - m_ref)
                    p = tl.exp2(s - m_ref[:, None])
                    l_h = l_h * alpha + tl.sum(p, axis=1)
                    if DOT_F32:  # the interpreter's bf16 tl.dot is wrong; its tests upcast the tiles instead
                        vt = vt.to(tl.float32)
                    if BLOCK_H < BLOCK_G:
                        p_g = tl.where(offs_g[:, None] < BLOCK_H, _widen(p, BLOCK_G), 0.0)
                        alpha_g = _widen(alpha[:, None], BLOCK_G)
                    else:
                        p_g = p
                        alpha_g = alpha[:, None]
                    acc = acc * alpha_g + tl.dot(p_g.to(vt.dtype), vt, input_precision=DOT_PRECISION)
                    m_h = m_new
                if BLOCK_H < BLOCK_G:  # rows past BLOCK_H are copies, and past G never stored
                    m_i = tl.reshape(_widen(m_h[:, None], BLOCK_G), [BLOCK_G])
                    l_i = tl.reshape(_widen(l_h[:, None], BLOCK_G), [BLOCK_G])
                else:
                    m_i = m_h
                    l_i = l_h
        else:
            # sink and window: position t of [0, sink_end) ++ [win_start, length), logits from K
            q = tl.load(q_ptr + b64 * s_q_b + heads[:, None] * s_q_h + offs_d[None, :], mask=g_ok[:, None],
                        other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            m_i, l_i, acc = attend_dense_split(q, k_base, v_base, part - n_mid_parts, dense_chunk, sink_end, win_start,
                                               length, m_i, l_i, acc, s_k_n, s_v_n, offs_n, offs_d, scale_log2,
                                               BLOCK_N, DOT_PRECISION, DOT_F32)
        store_partials(m_ptr, l_ptr, acc_ptr, b64 * (G * tl.num_programs(1)) + heads, g_ok, n_parts, part, m_i, l_i,
                       acc, offs_d, D)


def usable(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or is_interpreted(_attend_kernel))


def attend_plan(batch: int, kv_heads: int, n_keys: int, dense_keys: int, block_n: int,
                target_programs: int) -> tuple[int, int, int, int]:
    """``(n_mid_parts, mid_chunk, n_dense_parts, dense_chunk)``: the selectable range and the dense part
    cut into chunks of whole ``block_n`` blocks, about ``target_programs`` programs in all."""
    want = max(1, cdiv(target_programs, batch * kv_heads))
    chunk = max(block_n, cdiv(cdiv(n_keys, want), block_n) * block_n)
    n_mid = cdiv(max(n_keys - dense_keys, 0), chunk)
    n_dense = cdiv(dense_keys, chunk) if dense_keys else 0
    return n_mid, chunk, n_dense, chunk


def attend_triton(q, k, v, lengths, sink: int, window: int, scale: float, scores, excluded, lo, hi, stream: int,
                  cut, tie, n_s, size, out: torch.Tensor | None = None, *,
                  block_n: int = BLOCK_N, num_warps: int = 4, num_stages: int = NUM_STAGES,
                  programs: int | None = None) -> torch.Tensor:
    """vAttention's estimate (module docstring): ``q [R, Hq, d]``, ``k, v [R, Hkv, N, d]`` (last dim
    contiguous), ``lengths [R]`` int32, ``scores [R, Hq, N]`` float32 (the predictor's scaled logits of
    ``[sink_end, window_start)``), ``excluded [R, Hq, N]`` bool (the top-k), the sample's row words
    ``lo, hi [R]`` and ``stream``, its cut ``cut, tie [R, Hq]``, the residual's size ``n_s [R, Hq]`` and the
    sample's ``size [R, Hq]``. Returns ``out [R, Hq, d]`` in q's dtype. Two launches (pass, merge).

    The selectable keys' tests, hashes and exponentials run on the group's ``next_pow2(G)`` rows, the
    probabilities widened to the dot's 16 rows (zeros below the heads) for ``tl.dot`` only. Launch settings
    (the same estimate whatever they are; ``vattention_stages.py`` times them): ``block_n`` keys per block (a
    power of two, 32 to 256), ``num_warps``, ``num_stages``; ``programs``: about this many programs of the
    pass in all (default ``PROGRAMS_PER_SM`` per SM)."""
    r, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    for name, t, shape in (("scores", scores, (r, hq, n)), ("excluded", excluded, (r, hq, n)),
                           ("cut", cut, (r, hq)), ("tie", tie, (r, hq)), ("n_s", n_s, (r, hq)),
                           ("size", size, (r, hq))):
        if tuple(t.shape) != shape:
            raise ValueError(f"attend_triton: {name} must be {list(shape)}, got {list(t.shape)}")
    if scores.dtype != torch.float32 or scores.stride(-1) != 1 or excluded.stride(-1) != 1:
        raise ValueError("attend_triton: scores must be float32, scores and excluded with a contiguous last dim")
    if not (cut.stride() == tie.stride() == n_s.stride() == size.stride()):
        raise ValueError("attend_triton: cut, tie, n_s and size must share a layout")
    # 16-key blocks compile to a wrong estimate on the GPU (H200, Triton 3.6: rel err 1.3-2.0 for groups of 4, 2
    # and 1, from the selectable part alone; the dense part and the interpreter are right), so 32 is the least
    check_launch_value("block_n", block_n, low=32, high=256, pow2=True)
    check_launch_value("num_warps", num_warps, high=16, pow2=True)
    check_launch_value("num_stages", num_stages, high=6)
    target = PROGRAMS_PER_SM * sm_count(q.device) if programs is None else check_launch_value("programs", programs)
    dense_keys = min(sink + window, n)
    n_mid, mid_chunk, n_dense, dense_chunk = attend_plan(r, hkv, n, dense_keys, block_n, target)
    parts = max(1, n_mid + n_dense)
    acc = workspace("vattention_attend_acc", q, r * hq * parts * d, torch.float32)
    pm = workspace("vattention_attend_m", q, r * hq * parts, torch.float32)
    pl = workspace("vattention_attend_l", q, r * hq * parts, torch.float32)
    if out is None:
        out = torch.empty(r, hq, d, device=q.device, dtype=q.dtype)
    lens = lengths if lengths.dtype == torch.int32 else lengths.to(torch.int32)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    dot_f32 = q.dtype == torch.bfloat16 and is_interpreted(_attend_kernel)
    launch(_attend_kernel, (parts, hkv, r),
           q, k, v, scores, excluded.view(torch.int8), lens, lo, hi, cut, tie, n_s, size, acc, pm, pl,
           scale * _LOG2E, (stream * GOLDEN) & MASK32, n, sink, window, n_mid, mid_chunk, dense_chunk, parts,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           scores.stride(0), scores.stride(1), excluded.stride(0), excluded.stride(1), cut.stride(0), cut.stride(1),
           G=g, BLOCK_G=max(16, next_pow2(g)), BLOCK_H=next_pow2(g), D=d,
           BLOCK_N=block_n, DOT_PRECISION=precision, DOT_F32=dot_f32, num_warps=num_warps, num_stages=num_stages)
    merge_partials(acc, pm, pl, None, out, r, hq, parts, d, 1, (hq * parts * d, parts * d, d), (hq * parts, parts),
                   d_chunk=32, num_warps=1, num_stages=2)
    return out


__all__ = ["BLOCK_N", "NUM_STAGES", "PROGRAMS_PER_SM", "attend_plan", "attend_reference", "attend_triton",
           "in_sample_reference", "usable"]
