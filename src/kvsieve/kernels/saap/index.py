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

Two device forms of the step's update: one work item per (row, KV head, position) scanning the C centroids in a
serial loop (:func:`assign_tail_program`, :func:`assign_tail_triton`), and a parallel one in two stages
(:func:`assign_partial_program` then :func:`assign_reduce_program`, :func:`assign_tail_parallel_triton`): a
program per (KV head, block of centroids, block of tail keys) scores its keys against its centroids (one dot)
and keeps each key's best of the block; a program per (KV head, key) then takes the best of the blocks. Both
keep the first index of the largest product, ``torch.argmax``'s choice. The serial loop made the update a chain
of C / block dependent L2 reads (about 20 µs a layer at C = 1024); the two stages read each centroid once per
step and finish in one short pass each. Which one runs is a rule on the batch, known on the host when a step is
captured (:func:`parallel_update`).

The update can also run one step early (:func:`assign_ahead_reference`; :func:`assign_ahead_program`, one program
per key, as extra programs of the bucket attention's launch): the keys that will leave the window in the next
``span`` keys are already in K, and are still in the window, where the attention does not read ``assign``. A step
then finds the keys leaving it assigned, and no launch before its attention waits on the update.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..shared.triton_utils import cdiv, next_pow2

#: Positions each step assigns: a step may advance a row by up to this many keys while K's shape stays.
UPDATE_SPAN = 4
#: Positions assigned per chunk by the build (bounds its ``[B, Hkv, chunk, C]`` scores).
BUILD_CHUNK = 4096
#: Centroids a stage-1 program of the parallel update scores: 64 × d float32 (32 KB at d = 128), 16 blocks a KV
#: head at C = 1024, so 128 programs at Llama-3.1-8B shapes, each reading its centroids once a step.
PARALLEL_BLOCK_C = 64
#: Tail keys a stage-1 program scores at most (the rows of its dot): a KV head's 32 at batch 8 and the default span.
PARALLEL_BLOCK_R = 32
#: Centroids a program of the update one step ahead (:func:`assign_ahead_program`, one key a program, inside the
#: bucket kernel's launch at its 4 warps) scores an iteration. One key a program: the span's keys as one padded dot
#: tile a (row, KV head) were slower on the H200 (docs/methods/saap.md, forms measured and dropped).
AHEAD_BLOCK_C = 64


def parallel_update(batch: int) -> bool:
    """Whether a step's index update runs parallel over the centroids (else the serial loop): at batch 1 only.
    On an H200 at Llama-3.1-8B shapes (C = 1024, docs/results/gpu-bench/2026-11-28-h200-saap-probe.md) the
    parallel update took 18.9 µs against the serial 28.3 at batch 1 and 47.2 against 28.8 at batch 8 (its stage 1
    reads every tail key once per centroid block); batches 2 to 4 were not measured."""
    return batch == 1


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


def ahead_end(t_lo: torch.Tensor, lengths: torch.Tensor, window: torch.Tensor, span: int) -> torch.Tensor:
    """``[B]`` ``max(t_lo, L − W + span)``: the end of the keys that will have left the window once each row has
    advanced by ``span`` keys."""
    return torch.maximum(t_lo, lengths.long() - window + span)


def assign_ahead_reference(assign: torch.Tensor, k: torch.Tensor, t_lo: torch.Tensor, lengths: torch.Tensor,
                           window: torch.Tensor, span: int, centroids: torch.Tensor, inv_freq: torch.Tensor | None,
                           scaling: float) -> None:
    """The update one step ahead: assign, in place, the keys of ``[max(t_lo, e − span), e)`` below ``L`` with
    ``e`` = :func:`ahead_end` — the keys that leave the window while a row advances by up to ``span``, still
    inside it now (at or past ``L − W``: a step's reads of ``assign``, below ``L − W``, never meet these writes).
    With ``W >= span`` every such key is in K (below ``L``); then the keys leaving at a step of at most ``span``
    keys were all assigned by the step before it (:func:`assign_tail_reference` of the later step writes the same
    values)."""
    b, h = assign.shape[:2]
    end = ahead_end(t_lo, lengths, window, span)
    pos = end[:, None] - span + torch.arange(span, device=end.device)[None, :]  # [B, U]
    valid = (pos >= t_lo[:, None]) & (pos < lengths.long()[:, None])
    idx = torch.where(valid, pos, 0)[:, None, :].expand(b, h, span)
    rows = k.gather(2, idx[..., None].expand(b, h, span, k.shape[-1]))
    got = assign_keys_reference(rows, idx[:, 0], centroids, inv_freq, scaling).to(assign.dtype)
    # the positions not written go to a spare column: a fixed-shape scatter with no duplicate target
    spare = torch.cat([assign, assign[..., :1]], dim=-1)
    spare.scatter_(2, torch.where(valid[:, None, :], idx, assign.shape[-1]), got)
    assign.copy_(spare[..., :-1])


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
    def _tail_pos(t_lo_ptr, len_ptr, win_ptr, b, u, span, ok):
        """Position ``u`` of :func:`tail_positions` for row ``b`` (scalars or matching blocks; ``ok`` masks rows)."""
        t_lo = tl.load(t_lo_ptr + b, mask=ok, other=0).to(tl.int32)
        t_hi = tl.maximum(tl.load(len_ptr + b, mask=ok, other=0).to(tl.int32)
                          - tl.load(win_ptr + b, mask=ok, other=0).to(tl.int32), t_lo)
        return tl.maximum(t_hi - span + u, t_lo)

    @triton.jit
    def _load_key(ptrs, offs_d, pos, freq_ptr, scaling, mask, HALF: tl.constexpr, DEROPE: tl.constexpr):
        """The keys at ``ptrs`` (``offs_d`` each element's dimension) in float32, de-roped at ``pos`` with
        :func:`derope_keys`' arithmetic (``DEROPE``) or as stored."""
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if DEROPE:
            # rotate_half: the partner of dimension i is i ± d/2, negated in the first half
            xr = tl.load(ptrs + tl.where(offs_d < HALF, HALF, -HALF), mask=mask, other=0.0).to(tl.float32)
            xr = tl.where(offs_d < HALF, -xr, xr)
            ang = pos.to(tl.float32) * tl.load(freq_ptr + offs_d % HALF)
            x = (x * (tl.cos(ang) * scaling) - xr * (tl.sin(ang) * scaling)) / (scaling * scaling)
        return x

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
        pos = _tail_pos(t_lo_ptr, len_ptr, win_ptr, b, u, span, True)
        _assign_key(k_ptr, cent_ptr, freq_ptr, assign_ptr, scaling, n_buckets, s_kb, s_kh, s_kn, s_ab, s_ah, b, h, pos,
                    D, HALF, BLOCK_C, DEROPE)

    @triton.jit
    def _assign_key(k_ptr, cent_ptr, freq_ptr, assign_ptr, scaling, n_buckets, s_kb, s_kh, s_kn, s_ab, s_ah, b, h,
                    pos, D: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, DEROPE: tl.constexpr):
        """``assign[b, h, pos]``: the first index of the largest product of the key at ``pos`` (de-roped with
        ``DEROPE``) with KV head ``h``'s centroids (``BLOCK_C`` at a time, float32 products summed over ``d``)."""
        offs_d = tl.arange(0, D)
        base = k_ptr + b.to(tl.int64) * s_kb + h * s_kh + pos.to(tl.int64) * s_kn
        x = _load_key(base + offs_d, offs_d, pos, freq_ptr, scaling, offs_d < D, HALF, DEROPE)
        cent_row = cent_ptr + h.to(tl.int64) * n_buckets * D
        best = float("-inf")
        best_i = n_buckets * 0
        offs_c = tl.arange(0, BLOCK_C)
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
    def assign_ahead_program(k_ptr, cent_ptr, freq_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, scaling, n_buckets,
                             span, s_kb, s_kh, s_kn, s_ab, s_ah, b, h, u,
                             D: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, DEROPE: tl.constexpr):
        """Work item (row ``b``, KV head ``h``, ``u``) of :func:`assign_ahead_reference`: key ``u`` of the row's
        ``span``, scored as :func:`assign_tail_program` scores its key (the centroid blocks read one after the other).
        Extra programs of the bucket attention's launch
        (:func:`kvsieve.kernels.saap.buckets.bucket_sparse_decode_triton` with ``ahead``), which reads ``assign``
        only below ``L − W``, where these programs never write."""
        t_lo = tl.load(t_lo_ptr + b).to(tl.int32)
        length = tl.load(len_ptr + b).to(tl.int32)
        pos = tl.maximum(length - tl.load(win_ptr + b).to(tl.int32) + span, t_lo) - span + u
        if (pos >= t_lo) & (pos < length):
            _assign_key(k_ptr, cent_ptr, freq_ptr, assign_ptr, scaling, n_buckets, s_kb, s_kh, s_kn, s_ab, s_ah, b, h,
                        pos, D, HALF, BLOCK_C, DEROPE)

    @triton.jit
    def assign_partial_program(k_ptr, cent_ptr, freq_ptr, ps_ptr, pi_ptr, t_lo_ptr, len_ptr, win_ptr, scaling,
                               n_buckets, span, rows, c_blocks, r_blocks, s_kb, s_kh, s_kn, item,
                               D: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                               DEROPE: tl.constexpr):
        """Stage 1 of the parallel update, work item (KV head, centroid block, key block) =
        ``item`` in that order: the tail keys ``r = b·span + u`` of the block (``rows = B·span`` in all) de-roped,
        scored against the block's ``BLOCK_C`` centroids in one float32 dot, each key's best product and its first
        index written to ``ps``/``pi [Hkv, rows, c_blocks]``."""
        per_head = c_blocks * r_blocks
        h = item // per_head
        cb = (item % per_head) // r_blocks
        rb = item % r_blocks
        offs_d = tl.arange(0, D)
        cc = cb * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = cc < n_buckets
        cent = tl.load(cent_ptr + (h.to(tl.int64) * n_buckets + cc[:, None]) * D + offs_d[None, :],
                       mask=c_ok[:, None], other=0.0)
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < rows
        b = r // span
        pos = _tail_pos(t_lo_ptr, len_ptr, win_ptr, b, r % span, span, r_ok)
        ptrs = k_ptr + (b.to(tl.int64) * s_kb + h * s_kh + pos.to(tl.int64) * s_kn)[:, None] + offs_d[None, :]
        x = _load_key(ptrs, offs_d[None, :], pos[:, None], freq_ptr, scaling, r_ok[:, None], HALF, DEROPE)
        sc = tl.dot(x, tl.trans(cent), input_precision="ieee")  # [BLOCK_R, BLOCK_C]
        sc = tl.where(c_ok[None, :], sc, float("-inf"))
        blk = tl.max(sc, axis=1)
        # the first index of each key's maximum in the block (torch.argmax takes the first too)
        blk_i = tl.min(tl.where(sc == blk[:, None], cc[None, :], n_buckets), axis=1)
        out = (h * rows + r) * c_blocks + cb
        tl.store(ps_ptr + out, blk, mask=r_ok)
        tl.store(pi_ptr + out, blk_i, mask=r_ok)

    @triton.jit
    def assign_reduce_program(ps_ptr, pi_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, n_buckets, span, rows,
                              c_blocks, s_ab, s_ah, item, BLOCKS_P: tl.constexpr):
        """Stage 2 of the parallel update, work item ``item = KV head·rows + r``: the best of key ``r``'s block
        maxima, the lowest index among the blocks that reach it (the blocks ascend: the first index overall),
        written to ``assign`` at the key's position."""
        h = item // rows
        r = item % rows
        b = r // span
        offs = tl.arange(0, BLOCKS_P)
        ok = offs < c_blocks
        s = tl.load(ps_ptr + item * c_blocks + offs, mask=ok, other=float("-inf"))
        i = tl.load(pi_ptr + item * c_blocks + offs, mask=ok, other=n_buckets)
        best_i = tl.min(tl.where(s == tl.max(s, axis=0), i, n_buckets), axis=0)
        pos = _tail_pos(t_lo_ptr, len_ptr, win_ptr, b, r % span, span, True)
        tl.store(assign_ptr + b.to(tl.int64) * s_ab + h * s_ah + pos, best_i.to(assign_ptr.dtype.element_ty))

    @triton.jit
    def _assign_tail_kernel(k_ptr, cent_ptr, freq_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, scaling, kv_heads,
                            n_buckets, span, s_kb, s_kh, s_kn, s_ab, s_ah,
                            D: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, DEROPE: tl.constexpr):
        """Program (row·Hkv + KV head, u): :func:`assign_tail_program`."""
        assign_tail_program(k_ptr, cent_ptr, freq_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, scaling, kv_heads,
                            n_buckets, span, s_kb, s_kh, s_kn, s_ab, s_ah, tl.program_id(0), tl.program_id(1),
                            D, HALF, BLOCK_C, DEROPE)

    @triton.jit
    def _assign_ahead_kernel(k_ptr, cent_ptr, freq_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, scaling, n_buckets,
                             span, s_kb, s_kh, s_kn, s_ab, s_ah,
                             D: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, DEROPE: tl.constexpr):
        """Program (row, KV head, key): :func:`assign_ahead_program`."""
        assign_ahead_program(k_ptr, cent_ptr, freq_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, scaling, n_buckets,
                             span, s_kb, s_kh, s_kn, s_ab, s_ah, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                             D, HALF, BLOCK_C, DEROPE)

    @triton.jit
    def _assign_partial_kernel(k_ptr, cent_ptr, freq_ptr, ps_ptr, pi_ptr, t_lo_ptr, len_ptr, win_ptr, scaling,
                               n_buckets, span, rows, c_blocks, r_blocks, s_kb, s_kh, s_kn,
                               D: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                               DEROPE: tl.constexpr):
        """Program ``item``: :func:`assign_partial_program`."""
        assign_partial_program(k_ptr, cent_ptr, freq_ptr, ps_ptr, pi_ptr, t_lo_ptr, len_ptr, win_ptr, scaling,
                               n_buckets, span, rows, c_blocks, r_blocks, s_kb, s_kh, s_kn, tl.program_id(0),
                               D, HALF, BLOCK_C, BLOCK_R, DEROPE)

    @triton.jit
    def _assign_reduce_kernel(ps_ptr, pi_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, n_buckets, span, rows, c_blocks,
                              s_ab, s_ah, BLOCKS_P: tl.constexpr):
        """Program ``item``: :func:`assign_reduce_program`."""
        assign_reduce_program(ps_ptr, pi_ptr, assign_ptr, t_lo_ptr, len_ptr, win_ptr, n_buckets, span, rows,
                              c_blocks, s_ab, s_ah, tl.program_id(0), BLOCKS_P)


def _checked_keys(assign: torch.Tensor, k: torch.Tensor, span: int, centroids: torch.Tensor) -> torch.Tensor:
    if assign.stride(-1) != 1 or centroids.dtype != torch.float32 or not centroids.is_contiguous():
        raise ValueError("assign, centroids: expected a last-dimension-contiguous assign and contiguous float32 "
                         "centroids")
    if span < 1:
        raise ValueError(f"span: expected at least 1 position per step, got {span}")
    return k if k.stride(-1) == 1 else k.contiguous()


def tail_launch_args(assign: torch.Tensor, k: torch.Tensor, t_lo: torch.Tensor, lengths: torch.Tensor,
                     window: torch.Tensor, span: int, centroids: torch.Tensor, inv_freq: torch.Tensor | None,
                     scaling: float, block_c: int = 128) -> tuple[tuple, dict, int]:
    """``(args, constexprs, items)`` of :func:`assign_tail_program` for :func:`assign_tail_reference`'s update:
    ``items = B·Hkv·span`` work items. Centroids float32 ``[Hkv, C, d]`` contiguous; ``assign`` contiguous in
    its last dimension. ``block_c``: centroids scored per iteration (at most; fewer when C is smaller)."""
    b, h, _, d = k.shape
    k = _checked_keys(assign, k, span, centroids)
    freq = centroids if inv_freq is None else inv_freq
    args = (k, centroids, freq, assign, t_lo, lengths, window, float(scaling), h, centroids.shape[1], span,
            k.stride(0), k.stride(1), k.stride(2), assign.stride(0), assign.stride(1))
    meta = dict(D=d, HALF=d // 2, BLOCK_C=min(block_c, max(16, next_pow2(centroids.shape[1]))),
                DEROPE=inv_freq is not None)
    return args, meta, b * h * span


def ahead_launch_meta(k: torch.Tensor, span: int, centroids: torch.Tensor, inv_freq: torch.Tensor | None,
                      block_c: int | None = None) -> dict:
    """The constexprs of the update one step ahead: ``PROGRAMS`` per (row, KV head) (``span``, one a key), ``D``,
    ``HALF``, ``BLOCK_C`` (centroids an iteration, default :data:`AHEAD_BLOCK_C`, fewer when C is smaller),
    ``DEROPE``."""
    d = k.shape[-1]
    return dict(PROGRAMS=span, D=d, HALF=d // 2,
                BLOCK_C=min(block_c or AHEAD_BLOCK_C, max(16, next_pow2(centroids.shape[1]))),
                DEROPE=inv_freq is not None)


def assign_ahead_triton(assign: torch.Tensor, k: torch.Tensor, t_lo: torch.Tensor, lengths: torch.Tensor,
                        window: torch.Tensor, span: int, centroids: torch.Tensor, inv_freq: torch.Tensor | None,
                        scaling: float, block_c: int | None = None) -> None:
    """:func:`assign_ahead_reference` in a launch of its own (arguments as :func:`tail_launch_args`, ``block_c``
    as :func:`ahead_launch_meta`). The method runs these programs inside the bucket attention's launch instead."""
    if triton is None:
        raise RuntimeError("assign_ahead_triton needs triton")
    k = _checked_keys(assign, k, span, centroids)
    meta = ahead_launch_meta(k, span, centroids, inv_freq, block_c)
    _assign_ahead_kernel[(k.shape[0], k.shape[1], meta.pop("PROGRAMS"))](
        k, centroids, centroids if inv_freq is None else inv_freq, assign, t_lo, lengths, window, float(scaling),
        centroids.shape[1], span, k.stride(0), k.stride(1), k.stride(2), assign.stride(0), assign.stride(1),
        **meta, num_warps=4)


class ParallelTail(NamedTuple):
    """The two stages of the parallel update as launch pieces: runtime arguments, constexprs and work items of
    :func:`assign_partial_program` (stage 1) and :func:`assign_reduce_program` (stage 2), and the stage-1 results
    ``ps``/``pi`` (float32 / int32 ``[Hkv, B·span, c_blocks]``) the second reads."""

    partial_args: tuple
    partial_meta: dict
    partial_items: int
    reduce_args: tuple
    reduce_meta: dict
    reduce_items: int


def parallel_tail_args(assign: torch.Tensor, k: torch.Tensor, t_lo: torch.Tensor, lengths: torch.Tensor,
                       window: torch.Tensor, span: int, centroids: torch.Tensor, inv_freq: torch.Tensor | None,
                       scaling: float, block_c: int | None = None, block_r: int | None = None) -> ParallelTail:
    """The parallel update's launch pieces for :func:`assign_tail_reference`'s update (arguments as
    :func:`tail_launch_args`); ``block_c``/``block_r``: centroids and keys a stage-1 program takes (powers of two,
    at least 16; default :data:`PARALLEL_BLOCK_C`, :data:`PARALLEL_BLOCK_R`, fewer when C or ``B·span`` is
    smaller)."""
    b, h, _, d = k.shape
    k = _checked_keys(assign, k, span, centroids)
    c = centroids.shape[1]
    rows = b * span
    block_c = min(block_c or PARALLEL_BLOCK_C, max(16, next_pow2(c)))
    block_r = min(block_r or PARALLEL_BLOCK_R, max(16, next_pow2(rows)))
    c_blocks, r_blocks = cdiv(c, block_c), cdiv(rows, block_r)
    ps = torch.empty(h, rows, c_blocks, device=k.device, dtype=torch.float32)
    pi = torch.empty(h, rows, c_blocks, device=k.device, dtype=torch.int32)
    freq = centroids if inv_freq is None else inv_freq
    return ParallelTail(
        (k, centroids, freq, ps, pi, t_lo, lengths, window, float(scaling), c, span, rows, c_blocks, r_blocks,
         k.stride(0), k.stride(1), k.stride(2)),
        dict(D=d, HALF=d // 2, BLOCK_C=block_c, BLOCK_R=block_r, DEROPE=inv_freq is not None),
        h * c_blocks * r_blocks,
        (ps, pi, assign, t_lo, lengths, window, c, span, rows, c_blocks, assign.stride(0), assign.stride(1)),
        dict(BLOCKS_P=max(16, next_pow2(c_blocks))),
        h * rows)


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


def assign_tail_parallel_triton(assign: torch.Tensor, k: torch.Tensor, t_lo: torch.Tensor, lengths: torch.Tensor,
                                window: torch.Tensor, span: int, centroids: torch.Tensor,
                                inv_freq: torch.Tensor | None, scaling: float, block_c: int | None = None,
                                block_r: int | None = None) -> None:
    """:func:`assign_tail_reference` in two launches, the parallel update's two stages (arguments as
    :func:`parallel_tail_args`)."""
    if triton is None:
        raise RuntimeError("assign_tail_parallel_triton needs triton")
    t = parallel_tail_args(assign, k, t_lo, lengths, window, span, centroids, inv_freq, scaling, block_c, block_r)
    _assign_partial_kernel[(t.partial_items,)](*t.partial_args, **t.partial_meta, num_warps=4)
    _assign_reduce_kernel[(t.reduce_items,)](*t.reduce_args, **t.reduce_meta, num_warps=1)
