"""SAAP's index kept on the device: keys join their buckets as they leave the dense window.

Contract (prefix rows: the valid keys of row ``b`` are ``[0, L_b)``)
-----------------------------------------------------------------
- the dense part of row ``b`` is the sink ``[0, min(sink, L_b))`` and the window ``[lo_b, L_b)`` with
  ``lo_b = max(sink, L_b − W_b)``; ``W_b`` is fixed when the index is built;
- every other valid key, ``[sink, lo_b)``, is indexed: ``assign [B, Hkv, A]`` holds its bucket (``C`` for
  positions not indexed). The build fills ``[sink, t_lo_b)`` (``t_lo_b = max(sink, L0_b − W_b)``) and lists
  them by bucket (CSR, :func:`kvsieve.kernels.saap.buckets.build_csr`); each later step assigns the keys
  that have left the window since, the positions ``[t_lo_b, t_hi_b)`` with ``t_hi_b = max(t_lo_b, L_b − W_b)``
  (:func:`assign_tail_reference`, :func:`assign_tail_triton`; bounds computed from the lengths), writing
  only ``assign``: fixed shapes, no host read, and the same values whenever a step is repeated (a
  position's bucket depends on its key only);
- a decode step attends exactly over the dense part and every indexed key whose bucket was chosen
  (:func:`index_decode_reference`; the Triton path is
  :func:`kvsieve.kernels.saap.buckets.bucket_sparse_decode_triton` with ``dense_range`` and ``tail``).

Keys are assigned to the centroid of largest inner product (spherical k-means), after de-roping them at
their position (``inv_freq`` None: compared as stored, the roped baseline).
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import next_pow2

#: Positions each step assigns: a step may advance a row by up to this many keys while K's shape stays.
UPDATE_SPAN = 4
#: Positions assigned per chunk by the build (bounds its ``[B, Hkv, chunk, C]`` scores).
BUILD_CHUNK = 4096


def derope_keys(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor | None,
                scaling: float) -> torch.Tensor:
    """``k [B, H, U, d]`` seen at ``positions [B, U]`` → pre-RoPE float32 (float64 for float64 keys), in
    transformers' ``rotate_half`` layout (cos and sin in float32, as the model computes them)."""
    dtype = torch.promote_types(k.dtype, torch.float32)
    x = k.to(dtype)
    if inv_freq is None:
        return x
    freqs = positions[:, None, :, None].float() * inv_freq.float().to(k.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos - rot * sin) / (scaling ** 2)


def assign_keys_reference(k: torch.Tensor, positions: torch.Tensor, centroids: torch.Tensor,
                          inv_freq: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """``[B, H, U]`` int64: the bucket (largest inner product with ``centroids [H, C, d]``) of the keys
    ``k [B, H, U, d]`` seen at ``positions [B, U]``."""
    x = derope_keys(k, positions, inv_freq, scaling)
    return torch.einsum("bhud,hcd->bhuc", x, centroids.to(x.dtype)).argmax(-1)


def build_assign(k: torch.Tensor, lengths: torch.Tensor, window: torch.Tensor, sink: int, centroids: torch.Tensor,
                 inv_freq: torch.Tensor | None, scaling: float, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The build: ``(assign [B, H, width], t_lo [B])``, the positions ``[sink, t_lo_b)`` assigned (chunks of
    :data:`BUILD_CHUNK`), the others ``C``. ``width >= N`` (``k [B, H, N, d]``): the capacity."""
    b, h, n, _ = k.shape
    c = centroids.shape[1]
    t_lo = (lengths.long() - window).clamp(min=sink)
    assign = torch.full((b, h, width), c, dtype=torch.long, device=k.device)
    for start in range(0, n, BUILD_CHUNK):
        pos = torch.arange(start, min(n, start + BUILD_CHUNK), device=k.device)
        got = assign_keys_reference(k[:, :, start:start + len(pos)], pos.expand(b, -1), centroids, inv_freq, scaling)
        indexed = (pos[None, :] >= sink) & (pos[None, :] < t_lo[:, None])
        assign[:, :, start:start + len(pos)] = torch.where(indexed[:, None, :], got, c)
    return assign, t_lo


def tail_end(t_lo: torch.Tensor, lengths: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """``[B]`` ``t_hi = max(t_lo, L − W)``: the end of the keys that have left the window."""
    return torch.maximum(t_lo, lengths.long() - window)


def tail_positions(t_lo: torch.Tensor, t_hi: torch.Tensor, span: int) -> torch.Tensor:
    """``[B, span]``: the last ``span`` positions before ``t_hi``, those before ``t_lo`` moved to ``t_lo``
    (a duplicate writes the same value: a position's bucket depends on its key only)."""
    rel = torch.arange(span - 1, -1, -1, device=t_hi.device)
    return torch.maximum(t_hi[:, None] - 1 - rel[None, :], t_lo[:, None])


def assign_tail_reference(assign: torch.Tensor, k: torch.Tensor, t_lo: torch.Tensor, lengths: torch.Tensor,
                          window: torch.Tensor, span: int, centroids: torch.Tensor, inv_freq: torch.Tensor | None,
                          scaling: float) -> None:
    """Assign, in place, the keys at :func:`tail_positions` (the last ``span`` to have left the window of
    rows of ``lengths``)."""
    pos = tail_positions(t_lo, tail_end(t_lo, lengths, window), span)  # [B, U]
    b, h = assign.shape[:2]
    idx = pos[:, None, :].expand(b, h, span)
    rows = k.gather(2, idx[..., None].expand(b, h, span, k.shape[-1]))
    assign.scatter_(2, idx, assign_keys_reference(rows, pos, centroids, inv_freq, scaling).to(assign.dtype))


def index_read_mask(n_keys: int, lengths: torch.Tensor, window: torch.Tensor, sink: int, assign: torch.Tensor,
                    buckets: torch.Tensor) -> torch.Tensor:
    """``[B, P, N]`` bool: the keys a probing head reads — the sink, the window ``[lo_b, L_b)`` and the
    keys of ``[sink, lo_b)`` whose bucket is in ``buckets [B, P, L]`` (``P`` KV heads, or query heads with
    ``assign`` given per query head)."""
    pos = torch.arange(n_keys, device=lengths.device)
    length = lengths.long()[:, None]
    lo = (length - window[:, None]).clamp(min=sink)
    dense = (pos[None, :] < min(sink, n_keys)) | ((pos[None, :] >= lo) & (pos[None, :] < length))
    dense = dense & (pos[None, :] < length)
    a = assign[..., :n_keys].long()
    if buckets.shape[-1]:
        hit = (a[..., None] == buckets[:, :, None, :]).any(-1)
    else:
        hit = torch.zeros_like(a, dtype=torch.bool)
    indexed = (pos[None, :] >= sink) & (pos[None, :] < lo)
    return dense[:, None, :] | (hit & indexed[:, None, :])


def index_decode_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                           window: torch.Tensor, sink: int, assign: torch.Tensor, buckets: torch.Tensor, *,
                           scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, dv], read [B, P, N])``: exact attention of each query head over the keys its probing
    head reads (:func:`index_read_mask`), in float32 (float64 for float64 inputs)."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    read = index_read_mask(n, lengths, window, sink, assign, buckets)
    per_q = read if read.shape[1] == hq else read.repeat_interleave(hq // read.shape[1], dim=1)
    dtype = torch.promote_types(q.dtype, torch.float32)
    kk = k.to(dtype).repeat_interleave(hq // hkv, dim=1)
    vv = v.to(dtype).repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("bhd,bhnd->bhn", q.to(dtype), kk) * (d ** -0.5 if scale is None else scale)
    p = torch.softmax(s.masked_fill(~per_q, float("-inf")), dim=-1)
    return torch.einsum("bhn,bhnd->bhd", p, vv), read


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton run the reference
    triton = None

if triton is not None:

    @triton.jit
    def assign_tail_program(k_ptr, cent_ptr, freq_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, scaling, kv_heads,
                            n_buckets, span, s_kb, s_kh, s_kn, s_ab, s_ah, bh, u,
                            D: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, DEROPE: tl.constexpr):
        """Work item (row·Hkv + KV head ``bh``, ``u``): tail position ``u`` of :func:`tail_positions` de-roped and
        scored against every centroid (``BLOCK_C`` at a time, float32 products summed over ``d``), the first best
        kept. One key an item: a ``[16, d]`` dot tile would be three quarters padding at the default span, and
        these items are latency-bound (the centroids stream from L2). Its own launch
        (:func:`assign_tail_triton`) or extra programs of the probe's first launch
        (:func:`kvsieve.kernels.saap.probe.probe_scores_triton` with ``tail``)."""
        b = bh // kv_heads
        h = bh % kv_heads
        t_lo = tl.load(t_lo_ptr + b).to(tl.int32)
        t_hi = tl.maximum(tl.load(len_ptr + b).to(tl.int32) - tl.load(win_ptr + b).to(tl.int32), t_lo)
        pos = tl.maximum(t_hi - span + u, t_lo)
        offs_d = tl.arange(0, D)
        base = k_ptr + b.to(tl.int64) * s_kb + h * s_kh + pos.to(tl.int64) * s_kn
        x = tl.load(base + offs_d).to(tl.float32)
        if DEROPE:
            # rotate_half: the partner of dimension i is i ± d/2, negated in the first half
            partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
            xr = tl.load(base + partner).to(tl.float32)
            xr = tl.where(offs_d < HALF, -xr, xr)
            ang = pos.to(tl.float32) * tl.load(freq_ptr + offs_d % HALF)
            x = (x * (tl.cos(ang) * scaling) - xr * (tl.sin(ang) * scaling)) / (scaling * scaling)
        best = float("-inf")
        best_i = n_buckets * 0
        offs_c = tl.arange(0, BLOCK_C)
        cent_row = cent_ptr + h.to(tl.int64) * n_buckets * D
        for c0 in range(0, n_buckets, BLOCK_C):
            cc = c0 + offs_c
            c_ok = cc < n_buckets
            cb = tl.load(cent_row + cc[:, None] * D + offs_d[None, :], mask=c_ok[:, None], other=0.0)
            sc = tl.where(c_ok, tl.sum(cb * x[None, :], axis=1), float("-inf"))
            blk = tl.max(sc, axis=0)
            # the first index of the block's maximum (torch.argmax takes the first too)
            blk_i = tl.min(tl.where(sc == blk, cc, n_buckets), axis=0)
            better = blk > best
            best_i = tl.where(better, blk_i, best_i)
            best = tl.where(better, blk, best)
        tl.store(assign_ptr + b.to(tl.int64) * s_ab + h * s_ah + pos, best_i.to(assign_ptr.dtype.element_ty))

    @triton.jit
    def _assign_tail_kernel(k_ptr, cent_ptr, freq_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, scaling, kv_heads,
                            n_buckets, span, s_kb, s_kh, s_kn, s_ab, s_ah,
                            D: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, DEROPE: tl.constexpr):
        """Program (row·Hkv + KV head, u): :func:`assign_tail_program`."""
        assign_tail_program(k_ptr, cent_ptr, freq_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, scaling, kv_heads,
                            n_buckets, span, s_kb, s_kh, s_kn, s_ab, s_ah, tl.program_id(0), tl.program_id(1),
                            D, HALF, BLOCK_C, DEROPE)


def tail_launch_args(assign: torch.Tensor, k: torch.Tensor, t_lo: torch.Tensor, lengths: torch.Tensor,
                     window: torch.Tensor, span: int, centroids: torch.Tensor, inv_freq: torch.Tensor | None,
                     scaling: float, block_c: int = 128) -> tuple[tuple, dict, int]:
    """``(args, constexprs, items)`` of :func:`assign_tail_program` for :func:`assign_tail_reference`'s update:
    ``items = B·Hkv·span`` work items. Centroids float32 ``[Hkv, C, d]`` contiguous; ``assign`` contiguous in
    its last dimension. ``block_c``: centroids scored per iteration (at most; fewer when C is smaller)."""
    b, h, _, d = k.shape
    if assign.stride(-1) != 1 or centroids.dtype != torch.float32 or not centroids.is_contiguous():
        raise ValueError("assign, centroids: expected a last-dimension-contiguous assign and contiguous float32 "
                         "centroids")
    if span < 1:
        raise ValueError(f"span: expected at least 1 position per step, got {span}")
    if k.stride(-1) != 1:
        k = k.contiguous()
    freq = centroids if inv_freq is None else inv_freq
    args = (k, centroids, freq, assign, t_lo, lengths, window, float(scaling), h, centroids.shape[1], span,
            k.stride(0), k.stride(1), k.stride(2), assign.stride(0), assign.stride(1))
    meta = dict(D=d, HALF=d // 2, BLOCK_C=min(block_c, max(16, next_pow2(centroids.shape[1]))),
                DEROPE=inv_freq is not None)
    return args, meta, b * h * span


def assign_tail_triton(assign: torch.Tensor, k: torch.Tensor, t_lo: torch.Tensor, lengths: torch.Tensor,
                       window: torch.Tensor, span: int, centroids: torch.Tensor, inv_freq: torch.Tensor | None,
                       scaling: float) -> None:
    """:func:`assign_tail_reference` in one launch (one program per row, KV head and position); arguments as
    :func:`tail_launch_args`."""
    if triton is None:
        raise RuntimeError("assign_tail_triton needs triton")
    # 128 centroids (64 KB at d = 128) per iteration: few serial iterations, many loads in flight
    args, meta, _ = tail_launch_args(assign, k, t_lo, lengths, window, span, centroids, inv_freq, scaling)
    _assign_tail_kernel[(k.shape[0] * k.shape[1], span)](*args, **meta, num_warps=8)
