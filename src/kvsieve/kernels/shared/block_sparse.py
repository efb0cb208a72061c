"""Block-sparse causal prefill attention over per-query-block lists of key blocks.

Contract
--------
- ``q [B, Hq, N, d]``, ``k [B, Hkv, N, d]``, ``v [B, Hkv, N, dv]``: a prompt of ``N`` tokens
  attending to itself (no past keys), ``Hq = G · Hkv`` (query head ``h`` reads KV head ``h // G``).
- Tokens are cut into ``n = ⌈N / block_size⌉`` blocks; block ``i`` holds positions
  ``[i·block_size, (i+1)·block_size)`` (the last one may be partial).
- ``block_idx [B, n, K]`` (int32 or int64): for query block ``i`` of batch row ``b``, the key blocks
  it attends to in its first ``block_counts[b, i]`` entries, **sorted ascending with the diagonal
  block ``i`` last** (the only one that needs the causal mask inside); entries past the count are
  padding (any value in ``[0, n)``, never read). The selection is shared by every head.
- ``block_counts [B, n]`` in ``[1, K]``.

Output ``[B, Hq, N, dv]``: per query row, exact softmax attention renormalised over the keys of its
selected blocks at positions ``≤`` its own (causal), and ``lse [B, Hq, N]`` (natural log of the
softmax denominator of the scaled logits). With every causal block selected this is dense causal
attention.

Three paths: :func:`block_sparse_prefill_reference` (torch, chunks of query blocks, float32 or
float64 arithmetic; no ``[N, N]`` tensor), :func:`block_sparse_prefill_flex` (PyTorch's
FlexAttention with a ``BlockMask`` built on the device from the lists: the selected off-diagonal
blocks as full blocks, the diagonal as a partial block with a causal ``mask_mod``) and
``block_sparse_triton.block_sparse_prefill_triton`` (a Triton kernel that packs a KV head's query heads
into one tile, so each selected K/V block is read once per KV-head group); :func:`block_sparse_prefill`
picks one (``backend``).
"""

from __future__ import annotations

import torch

from .block_sparse_checks import check_block_sparse_inputs
from .triton_utils import cdiv

# Elements of the [rows, keys] logit tile one reference chunk may hold (about 256 MB in float32).
_REFERENCE_CHUNK_ELEMENTS = 1 << 26


def block_sparse_prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    block_counts: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, N, dv], lse [B, Hq, N])`` of the contract, in chunks of query blocks.

    Each chunk gathers the K/V rows of its rows' selected blocks (``K · block_size`` keys per query
    block), so memory is ``O(N · K · block_size)`` per chunk, never ``[N, N]``.
    """
    if check:
        check_block_sparse_inputs(q, k, v, block_idx, block_counts, block_size)
    b, hq, n_tok, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    group = hq // hkv
    bs = block_size
    n = cdiv(n_tok, bs)
    pad = n * bs - n_tok
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = d ** -0.5
    qf = torch.nn.functional.pad(q.to(dtype), (0, 0, 0, pad)).view(b, hkv, group, n, bs, d)
    kf = torch.nn.functional.pad(k.to(dtype), (0, 0, 0, pad)).view(b, hkv, n, bs, d)
    vf = torch.nn.functional.pad(v.to(dtype), (0, 0, 0, pad)).view(b, hkv, n, bs, dv)
    kmax = block_idx.shape[2]
    used = torch.arange(kmax, device=q.device) < block_counts[..., None]  # [B, n, K]
    idx = torch.where(used, block_idx.long(), 0)
    offs = torch.arange(bs, device=q.device)
    out = torch.empty(b, hkv, group, n, bs, dv, dtype=dtype, device=q.device)
    lse = torch.empty(b, hkv, group, n, bs, dtype=dtype, device=q.device)
    per_block = b * hq * bs * kmax * bs
    chunk = max(1, _REFERENCE_CHUNK_ELEMENTS // max(per_block, 1))
    batch_ix = torch.arange(b, device=q.device)[:, None, None]
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        sel = idx[:, lo:hi]  # [B, c, K]
        # K/V rows of the selected blocks: [B, Hkv, c, K·bs, d]
        kr = kf.permute(0, 2, 1, 3, 4)[batch_ix, sel].permute(0, 3, 1, 2, 4, 5).reshape(b, hkv, hi - lo, kmax * bs, d)
        vr = vf.permute(0, 2, 1, 3, 4)[batch_ix, sel].permute(0, 3, 1, 2, 4, 5).reshape(b, hkv, hi - lo, kmax * bs, dv)
        logits = torch.einsum("bhgcqd,bhckd->bhgcqk", qf[:, :, :, lo:hi], kr) * scale
        key_pos = (sel[..., None] * bs + offs).reshape(b, hi - lo, kmax * bs)  # [B, c, K·bs]
        q_pos = (torch.arange(lo, hi, device=q.device)[:, None] * bs + offs)  # [c, bs]
        ok = (used[:, lo:hi, :, None].expand(b, hi - lo, kmax, bs).reshape(b, hi - lo, kmax * bs)[:, :, None, :]
              & (key_pos[:, :, None, :] <= q_pos[None, :, :, None])
              & (key_pos[:, :, None, :] < n_tok))  # [B, c, bs, K·bs]
        logits = logits.masked_fill(~ok[:, None, None], float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)  # padded query rows may be -inf: dropped below
        p = torch.exp(logits - torch.where(torch.isfinite(row_lse), row_lse, 0.0)[..., None])
        out[:, :, :, lo:hi] = torch.einsum("bhgcqk,bhckd->bhgcqd", p, vr)
        lse[:, :, :, lo:hi] = row_lse
    out = out.reshape(b, hq, n * bs, dv)[:, :, :n_tok]
    lse = lse.reshape(b, hq, n * bs)[:, :, :n_tok]
    return out, lse


def selection_token_mask(block_idx: torch.Tensor, block_counts: torch.Tensor, *, block_size: int,
                         n_tokens: int) -> torch.Tensor:
    """``[B, N, N]`` bool: query row attends key column (selected block and causal). For tests only."""
    b, n, kmax = block_idx.shape
    used = torch.arange(kmax, device=block_idx.device) < block_counts[..., None]
    blocks = torch.zeros(b, n, n + 1, dtype=torch.bool, device=block_idx.device)
    blocks.scatter_(2, torch.where(used, block_idx.long(), n), True)
    tok = blocks[:, :, :n].repeat_interleave(block_size, 1).repeat_interleave(block_size, 2)[:, :n_tokens, :n_tokens]
    causal = torch.ones(n_tokens, n_tokens, dtype=torch.bool, device=block_idx.device).tril()
    return tok & causal


def flex_block_mask(block_idx: torch.Tensor, block_counts: torch.Tensor, *, block_size: int, n_tokens: int):
    """A FlexAttention ``BlockMask`` for the lists, built on their device without a host round trip.

    The used entries before the last are full blocks (no mask inside); the last one, the diagonal,
    is a partial block. One mask serves every head (head dim 1). The ``mask_mod`` holds the whole
    rule (selected block and causal), not just the causal part: the compiled kernel evaluates it
    only on partial blocks, but eager FlexAttention ignores the block lists and applies the
    ``mask_mod`` to every score.
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, n, kmax = block_idx.shape
    idx = block_idx.to(torch.int32)
    used = torch.arange(kmax, device=idx.device) < block_counts[..., None]
    selected = torch.zeros(b, n, n + 1, dtype=torch.bool, device=idx.device)
    selected.scatter_(2, torch.where(used, idx, n).long(), True)
    selected = selected[:, :, :n].contiguous()
    # kv_indices must have one column per key block (FlexAttention transposes it for backward).
    full_idx = torch.zeros(b, 1, n, n, dtype=torch.int32, device=idx.device)
    if kmax > 1:
        full_idx[:, 0, :, : kmax - 1] = idx[:, :, : kmax - 1]
    full_num = (block_counts - 1).to(torch.int32)[:, None]
    part_idx = torch.zeros(b, 1, n, n, dtype=torch.int32, device=idx.device)
    part_idx[:, 0, :, 0] = torch.arange(n, dtype=torch.int32, device=idx.device)
    part_num = torch.ones(b, 1, n, dtype=torch.int32, device=idx.device)

    def selected_and_causal(batch, head, q_idx, kv_idx):
        return (q_idx >= kv_idx) & selected[batch, q_idx // block_size, kv_idx // block_size]

    return BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=selected_and_causal, seq_lengths=(n_tokens, n_tokens),
                                    compute_q_blocks=False)


_COMPILED_FLEX = None

# FlexAttention kernel_options per BlockMask block size, where a launch sweep
# (docs/results/studies/sketchwalk/tune_prefill.py) found better than flex_kernel_options' rule: 64-key blocks.
# At 128-key blocks the sweep's winner needs USE_TMA (Hopper only) and still loses to the Triton kernel, so
# torch's config stays (measured on the H200: docs/results/gpu-bench/2026-11-27-h200-sketchwalk-prefill-tune.md).
FLEX_TUNED_OPTIONS: dict[int, dict] = {64: {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}}


def flex_kernel_options(block_size: int) -> dict | None:
    """The ``kernel_options`` :func:`block_sparse_prefill_flex` passes on CUDA by default: a tuned entry of
    ``FLEX_TUNED_OPTIONS``, else tiles as wide as the blocks below 128 keys (torch's default tiles are 128
    query rows, and a tile must divide the BlockMask's blocks), else None (torch's default config)."""
    if block_size in FLEX_TUNED_OPTIONS:
        return dict(FLEX_TUNED_OPTIONS[block_size])
    return {"BLOCK_M": block_size, "BLOCK_N": block_size} if block_size < 128 else None


def compiled_flex_attention():
    """FlexAttention as the block-sparse prefills call it: compiled once on CUDA, eager elsewhere."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _COMPILED_FLEX is None:
        # Eager FlexAttention is a dense math fallback; compiled it is the block-sparse kernel.
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False) if torch.cuda.is_available() else flex_attention
    return _COMPILED_FLEX


def block_sparse_prefill_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    block_counts: torch.Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    block_mask=None,
    check: bool = False,
    kernel_options: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract through FlexAttention (compiled on CUDA, eager elsewhere); ``lse`` in float32.

    ``N`` is padded up to a multiple of ``block_size``: padded keys lie after every real query, so
    the causal mask hides them, and padded query rows are dropped. ``kernel_options`` (FlexAttention's:
    ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``, ...) replace :func:`flex_kernel_options` for
    this call; ``{}`` asks for torch's default config. Each distinct dict compiles its own kernel.
    """
    if check:
        check_block_sparse_inputs(q, k, v, block_idx, block_counts, block_size)
    b, hq, n_tok, d = q.shape
    hkv = k.shape[1]
    n = cdiv(n_tok, block_size)
    pad = n * block_size - n_tok
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    if block_mask is None:
        block_mask = flex_block_mask(block_idx, block_counts, block_size=block_size, n_tokens=n * block_size)
    if kernel_options is None and q.is_cuda:
        kernel_options = flex_kernel_options(block_size)
    kwargs = dict(block_mask=block_mask, scale=scale if scale is not None else d ** -0.5, enable_gqa=hq != hkv,
                  kernel_options=kernel_options)
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # torch < 2.9
        out, lse = compiled_flex_attention()(q, k, v, return_lse=True, **kwargs)
    else:
        out, aux = compiled_flex_attention()(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    return out[:, :, :n_tok], lse[:, :, :n_tok]


BACKENDS = ("auto", "flex", "triton", "reference")
# auto takes the Triton kernel up to this block size, FlexAttention above it: each backend at its best swept
# launch settings, the Triton kernel was faster at 64- and 128-key blocks (10 % density, Llama-3.1-8B shapes,
# H200: docs/results/gpu-bench/2026-11-27-h200-sketchwalk-prefill-tune.md).
TRITON_MAX_BLOCK = 128


def auto_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> str:
    """What ``backend="auto"`` runs for these tensors: the reference off CUDA or in float64; on CUDA the
    Triton kernel for blocks of at most ``TRITON_MAX_BLOCK`` keys where it can serve them, else Flex."""
    if not q.is_cuda or q.dtype == torch.float64:
        return "reference"
    if block_size <= TRITON_MAX_BLOCK:
        from .block_sparse_triton import unsupported_reason

        if unsupported_reason(q, k, v, block_size) is None:
            return "triton"
    return "flex"


def block_sparse_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_counts: torch.Tensor, *,
    block_size: int, scale: float | None = None, backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(out, lse, backend)`` with the backend that ran: ``auto`` (:func:`auto_backend`: the Triton kernel
    for blocks of up to 128 keys on CUDA, FlexAttention for larger ones, the reference off CUDA); ``flex``;
    ``triton`` (:mod:`.block_sparse_triton`, fewer K/V reads per selected block: the GQA group's heads share
    a tile; a ValueError when it cannot serve the call); ``reference``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = auto_backend(q, k, v, block_size)
    if backend == "triton":
        from .block_sparse_triton import block_sparse_prefill_triton  # decorating the kernel reads TRITON_INTERPRET

        out, lse = block_sparse_prefill_triton(q, k, v, block_idx, block_counts, block_size=block_size, scale=scale)
        return out, lse, "triton"
    if backend == "flex":
        out, lse = block_sparse_prefill_flex(q, k, v, block_idx, block_counts, block_size=block_size, scale=scale)
        return out, lse, "flex"
    out, lse = block_sparse_prefill_reference(q, k, v, block_idx, block_counts, block_size=block_size,
                                              scale=scale, check=False)
    return out, lse, "reference"
