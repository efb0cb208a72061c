"""The input checks of the block-sparse prefill contract (``block_sparse.py``'s docstring), shared by its
torch reference, the FlexAttention path and the Triton kernel (``block_sparse_triton.py``)."""

from __future__ import annotations

import torch

from .triton_utils import cdiv


def check_block_sparse_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, block_counts: torch.Tensor,
    block_size: int,
) -> None:
    """Raise ValueError naming the argument when a call breaks the contract (``block_sparse.py``'s module docstring)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected [B, H, N, d] tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, hq, n_tok, d = q.shape
    if k.shape[0] != b or k.shape[2] != n_tok or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v: expected [B={b}, Hkv, N={n_tok}, d={d}] (prefill without past keys), got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if hq % k.shape[1]:
        raise ValueError(f"q: {hq} query heads is not a multiple of k's {k.shape[1]} KV heads")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: expected a positive integer, got {block_size!r}")
    n = cdiv(n_tok, block_size)
    if block_idx.dim() != 3 or block_idx.shape[:2] != (b, n):
        raise ValueError(f"block_idx: expected shape [B={b}, n={n}, K], got {tuple(block_idx.shape)}")
    if block_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_idx: expected an int32 or int64 tensor, got {block_idx.dtype}")
    if block_counts.shape != (b, n) or block_counts.is_floating_point() or block_counts.dtype == torch.bool:
        raise ValueError(f"block_counts: expected an integer tensor of shape [{b}, {n}], got "
                         f"{block_counts.dtype} {tuple(block_counts.shape)}")
    kmax = block_idx.shape[2]
    lo, hi = int(block_counts.min()), int(block_counts.max())
    if lo < 1 or hi > kmax:
        raise ValueError(f"block_counts: expected values in [1, K={kmax}], got min {lo}, max {hi}")
    used = torch.arange(kmax, device=block_idx.device) < block_counts[..., None]
    rows = torch.arange(n, device=block_idx.device)[None, :, None].expand_as(block_idx)
    last = block_idx.gather(2, (block_counts - 1).long()[..., None]).squeeze(-1)
    if bool((last != rows[..., 0]).any()):
        raise ValueError("block_idx: the last used entry of each row must be its diagonal block i")
    bad = used & ((block_idx < 0) | (block_idx > rows))
    if bool(bad.any()):
        raise ValueError("block_idx: used entries must be causal key blocks in [0, i]")
    ordered = (block_idx[..., 1:] > block_idx[..., :-1]) | ~used[..., 1:]
    if bool((~ordered).any()):
        raise ValueError("block_idx: used entries must be strictly ascending (no duplicates)")
