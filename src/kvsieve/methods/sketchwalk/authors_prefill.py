"""``variant=authors``' prefill on the device: the block matrix with bounded memory, and the attention over
the kept keys through the kernels of :mod:`kvsieve.kernels.sketchwalk.authors_prefill` (Triton or
FlexAttention) instead of the reference's masked logits.

The walk and the selection are ``[B, n, n]`` (n = N / block size: 2,048 at 128k tokens and 64-key blocks)
and stay the torch functions of :mod:`.authors` on the device (no host read). :func:`block_matrix` is
:func:`.authors.block_matrix` computed without a float32 copy of the prompt's q and k (block sums
accumulate in float32 from the input dtype) and with the per-head ``[n, n]`` softmaxes summed a few heads
at a time (``head_chunk``), so its memory is ``O(head_chunk · n²)``, not ``O(Hq · n²)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...core.stats import StepStats
from .authors import LOGIT_DIVISOR, normalized

if TYPE_CHECKING:
    from ...kernels.sketchwalk.authors_prefill import AuthorsBlockLists

#: Query heads whose ``[n, n]`` block scores one step of :func:`block_matrix` holds.
HEAD_CHUNK = 8
PATHS = ("triton", "flex", "reference")


def block_sums(x: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, T, d]`` -> ``[B, H, ⌈T/bs⌉, d]`` block sums accumulated in ``dtype`` (no copy of x in it)."""
    b, h, t, d = x.shape
    whole = t // block_size
    sums = x[:, :, : whole * block_size].reshape(b, h, whole, block_size, d).sum(3, dtype=dtype)
    if t % block_size:
        sums = torch.cat([sums, x[:, :, whole * block_size:].sum(2, keepdim=True, dtype=dtype)], dim=2)
    return sums


def block_matrix(q: torch.Tensor, k: torch.Tensor, phi: torch.Tensor, block_size: int, *, causal: bool,
                 dtype: torch.dtype, head_chunk: int = HEAD_CHUNK) -> torch.Tensor:
    """:func:`.authors.block_matrix`'s ``A [B, n, n]``, in chunks of ``head_chunk`` query heads."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    q_sketch = (block_sums(q, block_size, dtype) / block_size) @ phi.T  # [B, Hq, n, m]
    k_sketch = (block_sums(k, block_size, dtype) / block_size) @ phi.T  # [B, Hkv, n, m]
    n, m = q_sketch.shape[2], q_sketch.shape[3]
    scale = m ** -0.5 / LOGIT_DIVISOR
    future = None
    if causal:
        rows = torch.arange(n, device=q.device)
        future = rows[None, :] > rows[:, None]
    b = q_sketch.shape[0]
    k_sketch = k_sketch[:, :, None].expand(b, hkv, group, n, m).reshape(b, hq, n, m)  # query head h: KV head h // G
    total = None
    for lo in range(0, hq, head_chunk):
        heads = slice(lo, lo + head_chunk)
        logits = torch.matmul(q_sketch[:, heads], k_sketch[:, heads].transpose(-1, -2)) * scale
        if future is not None:
            logits = logits.masked_fill(future, float("-inf"))
        part = torch.softmax(logits, dim=-1).sum(1)
        total = part if total is None else total + part
    return normalized(total)


def prefill_path(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int
                 ) -> tuple[str, str | None]:
    """``(path, reason)`` of the attention for ``prefill_backend=backend``: ``auto`` takes the Triton kernel
    on CUDA where it can serve the call, else FlexAttention on CUDA (``reason`` says why), the reference off
    CUDA or in float64; ``flex`` and ``reference`` as asked; ``triton`` or a ValueError saying why not."""
    if backend in ("flex", "reference"):
        return backend, None
    from ...kernels.sketchwalk.authors_prefill import unsupported_reason  # decorating its kernel reads TRITON_INTERPRET

    reason = unsupported_reason(q, k, v, block_size)
    if backend == "triton":
        if reason is not None:
            raise ValueError(f"prefill_backend: triton cannot serve this call: {reason}")
        return "triton", None
    if q.device.type != "cuda":
        return "reference", None
    if q.dtype == torch.float64:
        return "reference", "float64 inputs: the kernels compute in 16- or 32-bit floats"
    return ("triton", None) if reason is None else ("flex", f"the Triton kernel cannot serve this call: {reason}")


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, window_tokens: int, *,
                     block_size: int, scale: float, path: str) -> tuple[torch.Tensor, AuthorsBlockLists]:
    """``(out [B, Hq, N, d] in q's dtype, lists)``: the rule's attention (kept ``blocks [B, n, n]``, each query's
    last ``window_tokens`` keys and the first ``window_tokens``) through ``path`` (``triton`` or ``flex``)."""
    from ...kernels.sketchwalk import authors_prefill as kernels

    lists = kernels.authors_block_lists(blocks, window_tokens, n_tokens=q.shape[2], block_size=block_size)
    if path == "triton":
        return kernels.authors_prefill_triton(q, k, v, lists, scale=scale), lists
    if path == "flex":
        return kernels.authors_prefill_flex(q, k, v, lists, scale=scale), lists
    raise ValueError(f"path: expected triton or flex, got {path!r}")


def prefill_stats(k: torch.Tensor, kept: torch.Tensor, touched: torch.Tensor, extra: dict[str, Any], *,
                  block_size: int, backend: str = "reference") -> StepStats:
    """The prefill's stats from ``kept [B, N]`` (keys of each query) and ``touched [B, n, n]`` (key blocks each
    query block reads); reads them on the host."""
    b, hkv, n_tok, d = k.shape
    n = touched.shape[-1]
    causal_keys = torch.arange(1, n_tok + 1, device=k.device)
    pairs = n_tok * (n_tok + 1) / 2
    per_row = float(kept.to(torch.float64).sum(-1).mean()) / n_tok
    density = float(kept.to(torch.float64).sum(-1).mean()) / pairs
    blocks = touched.to(torch.float64).sum(-1)  # [B, n]
    return StepStats(
        n_keys=float(n_tok), k_rows_scored=float(n_tok), v_rows_read=per_row, kv_rows_read=per_row,
        density=density, kv_density=density,
        bytes_read=int(blocks.sum(-1).mean() * block_size * hkv * 2 * d * k.element_size()), backend=backend,
        exact_rows=int((kept == causal_keys).all(-1).sum()),
        extra={**extra, "block_density": float(blocks.sum(-1).mean()) / (n * (n + 1) / 2),
               "blocks_kept": float(blocks.mean())})
