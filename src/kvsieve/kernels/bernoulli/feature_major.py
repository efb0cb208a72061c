"""Bernoulli-K scores over a feature-major copy of K: a Triton kernel and its torch reference.

In the cache layout ``k [B, Hkv, N, d]`` one key's d features lie together, so a 32-byte sector
holds 16 bf16 features of one key and a feature subset that is not sector-aligned touches nearly
every sector (``1 − (1 − ρ)^16`` of them at access rate ρ). In the feature-major copy
``kT [B, Hkv, d, N]`` one feature of every key lies together, and reading ρ·d features reads
exactly ρ of K's bytes. This module scores the keys of a KV head over the features its Bernoulli
draws kept:

    scores[b, h, n] = scale · Σ_{j < n_feat[b, kvh]} q_est[b, h, f_j] · kT[b, kvh, f_j, n],
    f_j = feat_idx[b, kvh, j],  kvh = h // G,

with ``-inf`` past each row's length. ``q_est`` is the effective query of
``reference.bernoulli_query`` / ``reference.mean_group_query`` (zero off the kept features), and
``compact_features`` turns a read mask into ``(feat_idx, n_feat)`` on the device (no host sync).
The kernel loads ``FEATURE_BLOCK`` listed feature rows at a time (each a contiguous run of keys)
and multiplies them with the G queries of the group on tensor cores (``feature_scores``).
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import cdiv, group_block, is_interpreted, launch, triton_available

if triton_available():
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = None
    tl = None

FEATURE_BLOCK = 16
BLOCK_KEYS = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128, 256)


def to_feature_major(k: torch.Tensor) -> torch.Tensor:
    """``k [B, Hkv, N, d]`` -> contiguous ``kT [B, Hkv, d, N]`` (a copy)."""
    return k.transpose(-1, -2).contiguous()


def append_feature_major(kt: torch.Tensor, k_new: torch.Tensor, position: torch.Tensor) -> None:
    """Write one new key per row ``k_new [B, Hkv, d]`` at ``position [B]`` of ``kt [B, Hkv, d, N]``
    in place: d strided 2-byte writes per KV head, the append-time cost of the copy."""
    b = torch.arange(kt.shape[0], device=kt.device)
    kt[b, :, :, position] = k_new.to(kt.dtype)


def split_dots(kt: torch.Tensor) -> bool:
    """``feature_scores``'s SPLIT: 16-bit K on a compiled kernel."""
    return kt.dtype != torch.float32 and not is_interpreted(_feature_major_scores_kernel)


def compact_features(read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``read [..., d]`` bool -> ``feat_idx [..., d]`` int32 (kept features first, ascending) and
    ``n_feat [...]`` int32. The tail past ``n_feat`` is padding the kernel never reads."""
    order = torch.argsort((~read).to(torch.int8), dim=-1, stable=True)
    return order.to(torch.int32), read.sum(-1).to(torch.int32)


def check_feature_major_inputs(q_est, kt, feat_idx, n_feat, lengths) -> None:
    """ValueError unless the shapes, dtypes and head dim are ones the kernel serves."""
    if q_est.dim() != 3 or kt.dim() != 4:
        raise ValueError(f"q_est, kt: expected [B, Hq, d] and [B, Hkv, d, N], got {tuple(q_est.shape)}, "
                         f"{tuple(kt.shape)}")
    b, hq, d = q_est.shape
    if kt.shape[0] != b or kt.shape[2] != d or hq % kt.shape[1]:
        raise ValueError(f"kt: shape {tuple(kt.shape)} does not fit q_est {tuple(q_est.shape)} "
                         "(want [B, Hkv, d, N] with Hq a multiple of Hkv)")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"kt: head dim {d} is not served by the feature-major kernel (it takes {SUPPORTED_HEAD_DIMS})")
    if kt.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kt: dtype {kt.dtype} (the kernel takes float16, bfloat16 or float32)")
    if feat_idx.shape != (b, kt.shape[1], d) or n_feat.shape != (b, kt.shape[1]):
        raise ValueError(f"feat_idx, n_feat: expected shapes [{b}, {kt.shape[1]}, {d}] and [{b}, {kt.shape[1]}], "
                         f"got {tuple(feat_idx.shape)}, {tuple(n_feat.shape)}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths: expected shape [{b}], got {tuple(lengths.shape)}")
    if not kt.is_contiguous():
        raise ValueError("kt: expected a contiguous [B, Hkv, d, N] tensor (see to_feature_major)")


def feature_major_scores_reference(q_est, kt, feat_idx, n_feat, lengths, scale: float) -> torch.Tensor:
    """float64 scores ``[B, Hq, N]`` over the listed features only, ``-inf`` past ``lengths``."""
    check_feature_major_inputs(q_est, kt, feat_idx, n_feat, lengths)
    b, hq, d = q_est.shape
    hkv, n = kt.shape[1], kt.shape[3]
    listed = torch.arange(d, device=kt.device) < n_feat[..., None].long()  # [B, Hkv, d] by slot
    kept = torch.zeros(b, hkv, d, dtype=torch.bool, device=kt.device)
    kept.scatter_(2, feat_idx.long(), listed)
    q = q_est.to(torch.float64).view(b, hkv, hq // hkv, d) * kept[:, :, None, :]
    s = torch.matmul(q, kt.to(torch.float64)).view(b, hq, n) * scale
    valid = torch.arange(n, device=kt.device)[None, :] < lengths[:, None]
    return s.masked_fill(~valid[:, None, :], float("-inf"))


if triton is not None:

    @triton.jit
    def feature_scores(q_rows, kt_base, idx_base, nf, offs_n, n_in, g_ok, s_kt_f, FB: tl.constexpr,
                       G_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        """``Σ_j q_est[g, f_j] · kT[f_j, n]`` ``[G_BLOCK, BLOCK_N]`` (float32, unscaled) over the
        ``nf`` listed features ``idx_base[0:nf]``: FB feature rows (each a contiguous run of the keys
        ``offs_n``) at a time against the group's effective queries at ``q_rows [G_BLOCK]`` (pointers
        to float32 rows of D). ``n_in``: the keys inside kT's key axis (``offs_n < capacity``), not the
        row's valid keys: a bound with 16 | capacity keeps the feature-row loads 16-byte vectors, where a
        row length (any integer) splits them into 2-byte loads; keys past the length are read and the
        caller masks their scores. ``SPLIT`` (16-bit K, compiled): on tensor cores, the float32 query split
        in two parts of K's type; else (float32 K, or the interpreter, whose 16-bit ``tl.dot`` is wrong)
        IEEE float32 dots."""
        acc = tl.zeros([G_BLOCK, BLOCK_N], tl.float32)
        for j0 in range(0, nf, FB):
            offs_f = j0 + tl.arange(0, FB)
            f_ok = offs_f < nf
            feat = tl.load(idx_base + offs_f, mask=f_ok, other=0)
            k = tl.load(kt_base + feat[:, None].to(tl.int64) * s_kt_f + offs_n[None, :],
                        mask=f_ok[:, None] & n_in[None, :], other=0.0)  # [FB, BLOCK_N]
            qv = tl.load(q_rows[:, None] + feat[None, :], mask=g_ok[:, None] & f_ok[None, :], other=0.0)
            acc += feature_dot(qv, k, SPLIT)
        return acc

    @triton.jit
    def feature_dot(qv, k, SPLIT: tl.constexpr):
        """``qv [G_BLOCK, FB] (float32) @ k [FB, BLOCK_N]`` in float32. ``SPLIT``: q_est split into K's 16-bit
        type, high part plus remainder, two tensor-core dots with exact products; tf32 (one dot) rounds q_est
        to 10 bits, enough to move S²ANTA's sampling boundaries (counts flipped on the H100)."""
        if not SPLIT:
            acc = tl.dot(qv.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            hi = qv.to(k.dtype)
            lo = (qv - hi.to(tl.float32)).to(k.dtype)
            acc = tl.dot(hi, k) + tl.dot(lo, k)
        return acc

    @triton.jit
    def _feature_major_scores_kernel(q_ptr, kt_ptr, idx_ptr, nfeat_ptr, len_ptr, out_ptr, n_keys, kv_heads,
                                     scale, G: tl.constexpr, G_BLOCK: tl.constexpr, D: tl.constexpr,
                                     FB: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
        row = tl.program_id(0)  # b * Hkv + kvh
        nb = tl.program_id(1)
        b = row // kv_heads
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        length = tl.load(len_ptr + b)
        key_ok = offs_n < length
        offs_g = tl.arange(0, G_BLOCK)
        head_ok = offs_g < G
        acc = tl.zeros([G_BLOCK, BLOCK_N], tl.float32)
        if nb * BLOCK_N < length:
            acc = feature_scores(q_ptr + (row * G + offs_g) * D, kt_ptr + row.to(tl.int64) * D * n_keys,
                                 idx_ptr + row * D, tl.load(nfeat_ptr + row), offs_n, offs_n < n_keys, head_ok,
                                 n_keys, FB,
                                 G_BLOCK, BLOCK_N, SPLIT)
        out = tl.where(key_ok[None, :], acc * scale, float("-inf"))
        tl.store(out_ptr + (row * G + offs_g[:, None]) * n_keys + offs_n[None, :], out,
                 mask=head_ok[:, None] & (offs_n[None, :] < n_keys))

    @triton.jit
    def append_new_keys(k_ptr, lens_ptr, done_ptr, kt_ptr, b, kvh, rows_per_batch, kv_heads,
                        s_k_b, s_k_h, s_k_n, s_kt_b, s_kt_h, s_kt_f, D: tl.constexpr, BLOCK: tl.constexpr):
        """Copy keys ``[min(done, length), length)`` of (batch row b, KV head kvh) into kT; done = length
        (length: the batch row's last query row's)."""
        length = tl.load(lens_ptr + b * rows_per_batch + rows_per_batch - 1)
        done = tl.load(done_ptr + b * kv_heads + kvh)
        offs_d = tl.arange(0, D)
        k_base = k_ptr + b.to(tl.int64) * s_k_b + kvh * s_k_h
        kt_base = kt_ptr + b.to(tl.int64) * s_kt_b + kvh * s_kt_h
        for n0 in range(tl.minimum(done, length), length, BLOCK):
            offs_n = n0 + tl.arange(0, BLOCK)
            ok = offs_n < length
            k = tl.load(k_base + offs_n[:, None] * s_k_n + offs_d[None, :], mask=ok[:, None], other=0.0)
            tl.store(kt_base + offs_d[None, :] * s_kt_f + offs_n[:, None], k, mask=ok[:, None])
        tl.store(done_ptr + b * kv_heads + kvh, length)

    @triton.jit
    def _transpose_new_keys_kernel(k_ptr, lens_ptr, done_ptr, kt_ptr, rows_per_batch, kv_heads,
                                   s_k_b, s_k_h, s_k_n, s_kt_b, s_kt_h, s_kt_f,
                                   D: tl.constexpr, BLOCK: tl.constexpr):
        """:func:`append_new_keys` of one (KV head, batch row)."""
        append_new_keys(k_ptr, lens_ptr, done_ptr, kt_ptr, tl.program_id(1), tl.program_id(0), rows_per_batch,
                        kv_heads, s_k_b, s_k_h, s_k_n, s_kt_b, s_kt_h, s_kt_f, D, BLOCK)

    @triton.jit
    def row_scores(q_rows, k_base, offs_n, n_ok, g_ok, s_k_n, D: tl.constexpr, SPLIT: tl.constexpr):
        """``Σ_i q_est[g, i] · k[n, i]`` ``[G_BLOCK, BLOCK_N]`` (float32, unscaled) over every feature, from
        the cache layout (``k_base``: the KV head's ``[N, d]`` rows): what :func:`feature_scores` computes
        when every feature is listed (``q_est`` is zero off the kept ones), for a unit whose draws kept so
        many features that reading whole rows costs less than reading feature rows. ``SPLIT`` as there."""
        offs_d = tl.arange(0, D)
        qv = tl.load(q_rows[:, None] + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        k = tl.load(k_base + offs_n[:, None].to(tl.int64) * s_k_n + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if not SPLIT:
            acc = tl.dot(qv.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            hi = qv.to(k.dtype)
            lo = (qv - hi.to(tl.float32)).to(k.dtype)
            kt = tl.trans(k)
            acc = tl.dot(hi, kt) + tl.dot(lo, kt)
        return acc


class FeatureMajorKeys:
    """Per-(request, layer) feature-major copy ``kT [B, Hkv, d, capacity]`` of a growing K cache.

    Like ``sparse.quest_pages.PageSummaries``: a device tensor ``done [B, Hkv]`` holds how many keys of
    each batch row are copied, and ``update(k, lengths)`` copies keys ``[min(done, length), length)``
    (one key per decode step; the whole prompt on the first call) and sets ``done = length`` in one
    launch, with no host sync, on a key axis that grows (a DynamicCache) or is fixed (a static cache).
    A cache that changed batch, heads, head dim, dtype or device is copied from scratch. The capacity
    grows by 1/8 beyond what is needed (capture a CUDA graph once it covers the context). Keys before
    ``done`` are assumed unchanged (an append-only cache; a row that got shorter recopies from its new
    length on)."""

    def __init__(self) -> None:
        self.kt: torch.Tensor | None = None
        self.done: torch.Tensor | None = None

    def update(self, k: torch.Tensor, lengths: torch.Tensor, rows_per_batch: int = 1) -> torch.Tensor:
        """The current ``kT [B, Hkv, d, capacity]`` for ``k [B, Hkv, N, d]``; ``lengths [B·rows_per_batch]``
        int32 are the query rows' lengths (the last row of each batch row has the cache's length).
        :meth:`reserve` and the copy launch; ``decode.bernoulli_prop_triton`` takes the copy into its draw
        launch instead (``append=``)."""
        kt = self.reserve(k)
        b, hkv, _, d = k.shape
        launch(_transpose_new_keys_kernel, (hkv, b), k, lengths, self.done, kt, rows_per_batch, hkv,
               k.stride(0), k.stride(1), k.stride(2), kt.stride(0), kt.stride(1), kt.stride(2),
               D=d, BLOCK=64, num_warps=4)
        return kt

    def reserve(self, k: torch.Tensor) -> torch.Tensor:
        """``kT`` with room for ``k [B, Hkv, N, d]``'s keys (grown or made anew as the class says), not yet
        brought up to date: the keys from ``done`` on are still to copy."""
        b, hkv, n, d = k.shape
        same = (self.kt is not None and self.kt.shape[:3] == (b, hkv, d) and self.kt.dtype == k.dtype
                and self.kt.device == k.device)
        if not same or n > self.kt.shape[3]:
            # a multiple of 256 keys: every feature row starts 16-byte aligned, so its runs load as vectors
            # (an odd capacity made the stats kernel 1.5x slower at 128k on the H100)
            cap = cdiv(n + n // 8 + 1, 256) * 256
            kt = torch.zeros(b, hkv, d, cap, device=k.device, dtype=k.dtype)
            if same:  # grown: the copied keys move over
                kt[..., :self.kt.shape[3]] = self.kt
            else:
                self.done = torch.zeros(b, hkv, device=k.device, dtype=torch.int32)
            self.kt = kt
        return self.kt


def feature_major_scores(q_est, kt, feat_idx, n_feat, lengths, scale: float, *, block_keys: int = BLOCK_KEYS,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel: float32 scores ``[B, Hq, N]`` (see the module docstring)."""
    if triton is None:
        raise ValueError("feature_major_scores: triton is not installed")
    check_feature_major_inputs(q_est, kt, feat_idx, n_feat, lengths)
    if kt.device.type != "cuda" and not is_interpreted(_feature_major_scores_kernel):
        raise ValueError("kt: CPU tensors run the kernel only under TRITON_INTERPRET=1")
    b, hq, d = q_est.shape
    hkv, n = kt.shape[1], kt.shape[3]
    g = hq // hkv
    if out is None:
        out = torch.empty(b, hq, n, device=kt.device, dtype=torch.float32)
    grid = (b * hkv, triton.cdiv(n, block_keys))
    launch(_feature_major_scores_kernel, grid, q_est.float().contiguous(), kt, feat_idx.int().contiguous(),
           n_feat.int().contiguous(), lengths.int().contiguous(), out, n, hkv, float(scale),
           G=g, G_BLOCK=group_block(g), D=d, FB=FEATURE_BLOCK, BLOCK_N=block_keys, SPLIT=split_dots(kt),
           num_warps=4)
    return out
