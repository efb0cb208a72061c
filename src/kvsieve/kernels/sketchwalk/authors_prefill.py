"""Sketch&Walk's prefill attention as its authors' code keeps keys (``sketchwalk``'s ``variant=authors``).

Contract
--------
- ``q [B, Hq, N, d]``, ``k [B, Hkv, N, d]``, ``v [B, Hkv, N, d]``: a prompt attending to itself,
  ``Hq = G · Hkv``.
- ``blocks [B, n, n]`` bool, ``n = ⌈N / block_size⌉``: the key blocks each query block keeps (only
  ``j ≤ i`` is read), and ``window_tokens = w ≥ 1``.
- Query row ``r`` (block ``i = r // block_size``) attends key ``x ≤ r`` when ``blocks[i, x // block_size]``,
  or ``x > r − w`` (its last w keys), or ``x < w`` (the first w keys): exact softmax over those keys.

The torch reference of this rule is the method's ``authors.prefill_attention`` (a token mask per chunk
of query rows); :func:`authors_prefill_reference` here computes it from the block lists below, so that the
tests check the lists and the kernels against the token mask.

Block lists
-----------
The rule is a block mask plus two token windows whose edges cut through blocks. Per query block ``i``
(rows ``[r0, r1]``) and key block ``j < i`` (keys ``[k0, k1]``), :func:`authors_block_lists` sorts every
block into one of three kinds, in closed form on the device (no ``[N, N]`` tensor, no host sync):

- **full** (every pair kept, no mask inside): ``blocks[i, j]``, or no key of the block lies in
  ``[w, r1 − w]`` (each key is a sink key or in the window of every row);
- **partial** (the token rule inside): touched — a key of it in the window of row ``r0`` (``k1 > r0 − w``)
  or a sink key (``k0 < w``) — and not full. At most :data:`PARTIAL_SLOTS` = 4 per query block: the
  diagonal, the (at most two) blocks holding the window's left edge ``r − w + 1`` for ``r ∈ [r0, r1]`` and the
  block holding the sink's edge ``w``; ``part_idx`` lists them, ``-1`` for an unused slot;
- **skipped**: the rest.

Kernels
-------
:func:`authors_prefill_triton` walks, per (query block, KV head), the full list without any mask and
then the partial slots with the token rule (the diagonal adds the causal mask), packing the ``G`` query
heads of a KV head into one tile as the block-sparse kernel of ``kernels/shared/block_sparse_triton.py``
does (its per-block online-softmax step and launch settings are reused). :func:`authors_prefill_flex`
hands the same lists to FlexAttention (a ``BlockMask`` with 64-key blocks: the full list as full blocks,
the partial one with the rule as ``mask_mod``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..shared.block_sparse import compiled_flex_attention, flex_kernel_options
from ..shared.block_sparse_triton import (
    attend_block,
    attend_whole_blocks,
    launch_config,
    packed_program,
    store_packed_rows,
)
from ..shared.block_sparse_triton import unsupported_reason as _block_sparse_unsupported
from ..shared.triton_utils import cdiv, is_interpreted, launch, triton

#: Partial key blocks per query block: the diagonal, two at the window's edge, one at the sink's edge.
PARTIAL_SLOTS = 4
_LOG2E = math.log2(math.e)
# Query rows times keys one chunk of the lists' reference may score at once.
_REFERENCE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class AuthorsBlockLists:
    """What a query block reads (see the module docstring): ``full_idx [B, n, n]`` int32, its first
    ``full_counts [B, n]`` entries the full key blocks (ascending); ``part_idx [B, n, PARTIAL_SLOTS]`` int32
    the partial ones (-1: unused slot); ``touched [B, n, n]`` bool the key blocks it reads a key of;
    ``blocks [B, n, n]`` the selection (causal part) the rule reads inside partial blocks."""

    full_idx: torch.Tensor
    full_counts: torch.Tensor
    part_idx: torch.Tensor
    touched: torch.Tensor
    blocks: torch.Tensor
    window_tokens: int
    block_size: int
    n_tokens: int


def _check_selection(blocks: torch.Tensor, window_tokens: int, n_tokens: int, block_size: int) -> int:
    if blocks.dim() != 3 or blocks.dtype != torch.bool or blocks.shape[1] != blocks.shape[2]:
        raise ValueError(f"blocks: expected a [B, n, n] bool tensor, got {tuple(blocks.shape)} {blocks.dtype}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size: expected a power of two, got {block_size}")
    n = cdiv(n_tokens, block_size)
    if blocks.shape[1] != n:
        raise ValueError(f"blocks: expected n = ⌈{n_tokens} / {block_size}⌉ = {n} query and key blocks, got "
                         f"{blocks.shape[1]}")
    if isinstance(window_tokens, bool) or not isinstance(window_tokens, int) or window_tokens < 1:
        raise ValueError(f"window_tokens: expected an integer >= 1, got {window_tokens!r}")
    return n


def authors_block_lists(blocks: torch.Tensor, window_tokens: int, *, n_tokens: int,
                        block_size: int) -> AuthorsBlockLists:
    """The full and partial key blocks of every query block (module docstring), on ``blocks``' device."""
    n = _check_selection(blocks, window_tokens, n_tokens, block_size)
    dev, w, bs = blocks.device, window_tokens, block_size
    ar = torch.arange(n, device=dev)
    first = ar * bs  # r0 of a query block, k0 of a key block
    last = torch.clamp(first + bs, max=n_tokens) - 1  # r1, k1
    i, j = ar[:, None], ar[None, :]
    sel = blocks & (j <= i)
    # no key of block j in [w, r1 - w]: each is a sink key or in the window of every row of block i
    covered = torch.clamp(first[None, :], min=w) > torch.minimum(last[None, :], last[:, None] - w)
    reached = (last[None, :] > first[:, None] - w) | (first[None, :] < w)
    full = (j < i) & (sel | covered)
    touched = (j <= i) & (sel | reached | (j == i))
    partial = touched & ~full
    # the candidates of the partial slots, each kept where it is partial and not an earlier slot
    edge = torch.div(torch.stack([first - w + 1, last - w]), bs, rounding_mode="floor")
    cand = torch.stack([ar, edge[0], edge[1], torch.full_like(ar, w // bs)], dim=-1)  # [n, SLOTS]
    ok = (cand >= 0) & (cand <= ar[:, None])
    safe = torch.where(ok, cand, 0)
    ok = ok & partial.gather(2, safe[None].expand(blocks.shape[0], n, PARTIAL_SLOTS))
    for s in range(1, PARTIAL_SLOTS):
        ok[..., s] &= (cand[:, s:s + 1] != cand[:, :s]).all(-1)
    part_idx = torch.where(ok, cand, -1).to(torch.int32)
    # each full block at its rank among the row's full blocks (ascending); the others to a spare column
    rank = torch.where(full, full.cumsum(-1) - 1, n)
    full_idx = torch.zeros(blocks.shape[0], n, n + 1, dtype=torch.int32, device=dev)
    full_idx.scatter_(2, rank, ar.to(torch.int32).expand(blocks.shape[0], n, n))
    return AuthorsBlockLists(full_idx=full_idx[..., :n].contiguous(), full_counts=full.sum(-1, dtype=torch.int32),
                             part_idx=part_idx, touched=touched, blocks=sel, window_tokens=w, block_size=bs,
                             n_tokens=n_tokens)


def kept_keys(blocks: torch.Tensor, window_tokens: int, *, n_tokens: int, block_size: int) -> torch.Tensor:
    """``[B, N]`` int64: how many keys each query row attends under the rule, in closed form. Row ``r``
    keeps ``r + 1`` keys where the sink and its window meet (``r < 2w``), else its ``2w`` sink and window
    keys plus the selected keys in ``[w, r − w]``."""
    n = _check_selection(blocks, window_tokens, n_tokens, block_size)
    b, dev, w, bs = blocks.shape[0], blocks.device, window_tokens, block_size
    ar = torch.arange(n, device=dev)
    sel = (blocks & (ar[None, :] <= ar[:, None])).to(torch.int64)
    # selected blocks before key block j, per query block: [B, n, n + 1]
    before = torch.nn.functional.pad(sel.cumsum(-1), (1, 0))
    sel = torch.nn.functional.pad(sel, (0, 1))
    rows = torch.arange(n_tokens, device=dev)
    qb = torch.div(rows, bs, rounding_mode="floor")

    batch = torch.arange(b, device=dev)[:, None]

    def selected_below(x: torch.Tensor) -> torch.Tensor:  # selected keys < x in each row's query block's list
        x = x.clamp(min=0, max=n_tokens)
        xb = torch.div(x, bs, rounding_mode="floor")[None]
        return before[batch, qb[None], xb] * bs + sel[batch, qb[None], xb] * (x % bs)[None]

    far = 2 * w - selected_below(torch.full_like(rows, w)) + selected_below(rows - w + 1)
    return torch.where((rows < 2 * w)[None], (rows + 1)[None], far)


def authors_prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists: AuthorsBlockLists, *,
                              scale: float | None = None) -> torch.Tensor:
    """``out [B, Hq, N, d]`` (float32, float64 for float64 inputs) from the lists: full blocks whole, partial
    blocks under the token rule, nothing else; in chunks of query blocks."""
    b, hq, n_tok, d = q.shape
    bs, w = lists.block_size, lists.window_tokens
    n = cdiv(n_tok, bs)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = d ** -0.5 if scale is None else scale
    dev = q.device
    kmax = lists.full_idx.shape[-1]
    full = torch.zeros(b, n, n + 1, dtype=torch.bool, device=dev)
    used = torch.arange(kmax, device=dev) < lists.full_counts[..., None]
    full.scatter_(2, torch.where(used, lists.full_idx.long(), n), True)
    part = torch.zeros(b, n, n + 1, dtype=torch.bool, device=dev)
    part.scatter_(2, torch.where(lists.part_idx >= 0, lists.part_idx.long(), n), True)
    kf, vf = (t.to(dtype).repeat_interleave(hq // t.shape[1], dim=1) for t in (k, v))
    keys = torch.arange(n_tok, device=dev)
    kb = keys // bs
    step = max(1, _REFERENCE_CHUNK_ELEMENTS // max(1, b * hq * n_tok * bs)) * bs
    outs = []
    for lo in range(0, n_tok, step):
        rows = torch.arange(lo, min(n_tok, lo + step), device=dev)
        qb = rows // bs
        rule = (keys[None, :] <= rows[:, None]) & (lists.blocks[:, qb][:, :, kb] | (keys[None, :] > rows[:, None] - w)
                                                   | (keys[None, :] < w))
        allowed = full[:, qb][:, :, kb] | (part[:, qb][:, :, kb] & rule)
        logits = torch.matmul(q[:, :, rows].to(dtype), kf.transpose(-1, -2)) * scale
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        outs.append(torch.matmul(torch.softmax(logits, dim=-1), vf))
    return torch.cat(outs, dim=2)


# -- FlexAttention -------------------------------------------------------------------------------------------


def authors_block_mask(lists: AuthorsBlockLists):
    """A FlexAttention ``BlockMask`` of the lists (one for every head), built on their device. Its
    ``mask_mod`` holds the whole rule: compiled FlexAttention evaluates it on the partial blocks only, eager
    FlexAttention (off CUDA) on every score."""
    from torch.nn.attention.flex_attention import BlockMask

    b, n, _ = lists.full_idx.shape
    bs, w = lists.block_size, lists.window_tokens
    dev = lists.full_idx.device
    # the used partial slots first (kv_indices have one column per key block)
    order = torch.argsort((lists.part_idx < 0).to(torch.int8), dim=-1, stable=True)
    part = lists.part_idx.gather(-1, order)
    part_idx = torch.zeros(b, 1, n, n, dtype=torch.int32, device=dev)
    slots = min(PARTIAL_SLOTS, n)  # a query block has at most n distinct key blocks
    part_idx[:, 0, :, :slots] = part[..., :slots].clamp(min=0)
    part_num = (lists.part_idx >= 0).sum(-1, dtype=torch.int32)[:, None]
    blocks = lists.blocks

    def authors_rule(batch, head, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (blocks[batch, q_idx // bs, kv_idx // bs] | (kv_idx > q_idx - w) | (kv_idx < w))

    n_pad = n * bs
    return BlockMask.from_kv_blocks(part_num, part_idx, lists.full_counts[:, None], lists.full_idx[:, None],
                                    BLOCK_SIZE=bs, mask_mod=authors_rule, seq_lengths=(n_pad, n_pad),
                                    compute_q_blocks=False)


def authors_prefill_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists: AuthorsBlockLists, *,
                         scale: float | None = None, kernel_options: dict | None = None) -> torch.Tensor:
    """``out [B, Hq, N, d]`` in q's dtype through FlexAttention (compiled on CUDA, eager elsewhere); ``N``
    padded to whole blocks (padded keys lie after every real query; padded rows are dropped)."""
    b, hq, n_tok, d = q.shape
    n = cdiv(n_tok, lists.block_size)
    pad = n * lists.block_size - n_tok
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    if kernel_options is None and q.is_cuda:
        kernel_options = flex_kernel_options(lists.block_size)
    out = compiled_flex_attention()(q, k, v, block_mask=authors_block_mask(lists), scale=scale if scale is not None
                            else d ** -0.5, enable_gqa=hq != k.shape[1], kernel_options=kernel_options)
    return out[:, :, :n_tok]


# -- Triton ------------------------------------------------------------------------------------------------

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_tok", "n_blocks", "n_sub", "window"])
    def _authors_prefill_kernel(
        q_ptr, k_ptr, v_ptr, full_ptr, cnt_ptr, part_ptr, sel_ptr, out_ptr,
        scale_log2, n_tok, n_blocks, n_sub, window,
        s_qb, s_qh, s_qn,
        s_kb, s_kh, s_kn,
        s_vb, s_vh, s_vn,
        s_fb, s_fn,
        s_cb, s_cn,
        s_pb, s_pn,
        s_sb, s_sn,
        s_ob, s_oh, s_on,
        G: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
        SLOTS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        b, blk, q, head, tok, row_ok, k_base, v_base, k_tile, v_tile = packed_program(
            q_ptr, k_ptr, v_ptr, n_tok, n_blocks, n_sub, s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn,
            G, BS, BLOCK_M, BLOCK_N, D, DOT_F32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Full blocks: whole blocks before the query block, every pair kept.
        count = tl.load(cnt_ptr + b * s_cb + blk * s_cn).to(tl.int32)
        m_i, l_i, acc = attend_whole_blocks(q, full_ptr + b * s_fb + blk * s_fn, count, k_base, v_base, k_tile,
                                            v_tile, s_kn, s_vn, m_i, l_i, acc, scale_log2, BS, BLOCK_N, DOT_PRECISION,
                                            DOT_F32)
        # Partial blocks: the token rule (selected block, the row's window, the sink), causal.
        part_row = part_ptr + b * s_pb + blk * s_pn
        sel_row = sel_ptr + b * s_sb + blk * s_sn
        for s in tl.static_range(SLOTS):
            j = tl.load(part_row + s)
            if j >= 0:
                kept = tl.load(sel_row + j) != 0
                for c in tl.static_range(BS // BLOCK_N):
                    key_pos = j * BS + c * BLOCK_N + tl.arange(0, BLOCK_N)
                    key_ok = key_pos < n_tok
                    ok = ((key_pos[None, :] <= tok[:, None]) & key_ok[None, :]
                          & (kept | (key_pos[None, :] > tok[:, None] - window) | (key_pos[None, :] < window)))
                    start = j.to(tl.int64) * BS + c * BLOCK_N
                    m_i, l_i, acc = attend_block(q, k_base + start * s_kn + k_tile, v_base + start * s_vn + v_tile,
                                                 m_i, l_i, acc, scale_log2, key_ok, ok, True, DOT_PRECISION, DOT_F32)

        store_packed_rows(out_ptr, acc, l_i, b, head, tok, row_ok, s_ob, s_oh, s_on, D)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> str | None:
    """Why :func:`authors_prefill_triton` cannot serve these tensors (None when it can): the limits of the
    block-sparse prefill kernel whose tiles it shares."""
    return _block_sparse_unsupported(q, k, v, block_size)


def authors_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lists: AuthorsBlockLists, *,
                           scale: float | None = None, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``out [B, Hq, N, d]`` in q's dtype (module docstring); a ValueError where the kernel cannot serve.
    ``tiles`` = ``(block_m, block_n, num_warps, num_stages)`` replaces the block-sparse kernel's
    ``launch_config`` (packed query rows per program, a power of two ≥ 16; keys per K/V tile, a power of two
    in ``[16, block_size]``)."""
    reason = unsupported_reason(q, k, v, lists.block_size)
    if reason is not None:
        raise ValueError(f"authors_prefill_triton cannot serve this call: {reason}")
    b, hq, n_tok, d = q.shape
    hkv, bs = k.shape[1], lists.block_size
    if hq % hkv or k.shape[2] != n_tok or v.shape[:3] != k.shape[:3] or n_tok != lists.n_tokens:
        raise ValueError(f"q, k, v: expected [B, G·Hkv, N, d] and [B, Hkv, N, d] with N = {lists.n_tokens} (the "
                         f"lists'), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    n = cdiv(n_tok, bs)
    if lists.full_idx.shape[:2] != (b, n):
        raise ValueError(f"lists: expected the lists of {b} rows and {n} blocks, got {tuple(lists.full_idx.shape)}")
    group = hq // hkv
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    block_m, block_n, num_warps, num_stages = tiles or launch_config(group, bs, d)
    if block_m & (block_m - 1) or block_m < 16 or block_n & (block_n - 1) or not 16 <= block_n <= bs:
        raise ValueError(f"tiles: expected block_m a power of two >= 16 and block_n a power of two in [16, {bs}], "
                         f"got {block_m}, {block_n}")
    n_sub = cdiv(group * bs, block_m)
    out = torch.empty(b, hq, n_tok, d, device=q.device, dtype=q.dtype)
    sel = lists.blocks.view(torch.uint8)
    full_idx, counts, part = lists.full_idx, lists.full_counts, lists.part_idx
    launch(_authors_prefill_kernel, (n * n_sub, hkv, b),
           q, k, v, full_idx, counts, part, sel, out,
           (d ** -0.5 if scale is None else scale) * _LOG2E, n_tok, n, n_sub, lists.window_tokens,
           q.stride(0), q.stride(1), q.stride(2),
           k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2),
           full_idx.stride(0), full_idx.stride(1),
           counts.stride(0), counts.stride(1),
           part.stride(0), part.stride(1),
           sel.stride(0), sel.stride(1),
           out.stride(0), out.stride(1), out.stride(2),
           G=group, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n, D=d, SLOTS=PARTIAL_SLOTS,
           DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
           DOT_F32=is_interpreted(_authors_prefill_kernel) and q.dtype != torch.float32,
           num_warps=num_warps, num_stages=num_stages)
    return out


__all__ = ["AuthorsBlockLists", "PARTIAL_SLOTS", "authors_block_lists", "authors_block_mask", "authors_prefill_flex",
           "authors_prefill_reference", "authors_prefill_triton", "kept_keys", "unsupported_reason"]
