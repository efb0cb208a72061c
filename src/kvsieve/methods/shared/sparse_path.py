"""The Triton path of selection methods: which backend runs, and the stats of a call lowered to
:func:`kvsieve.kernels.shared.weighted_triton.sparse_decode_triton` (sink + window as the kernel's dense
part, the method's own stage as an index list of tokens or pages).

``backend="reference"`` runs the method's torch reference (its ``select`` + the weighted sparse decode
reference); ``"triton"`` runs the kernel path or raises a ValueError saying why it cannot;
``"auto"`` runs the kernel path for CUDA tensors it can serve and the reference otherwise, with
``stats.backend`` naming the path and ``stats.extra["backend_reason"]`` why the kernel did not run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.inputs import DecodeInputs
from ...core.method import read_stats
from ...core.stats import StepStats
from .backend import choose_path


def sparse_unsupported(inputs: DecodeInputs, page_size: int = 1) -> str | None:
    """Why the sparse kernel cannot serve this call, or None."""
    from ...kernels.shared.triton_utils import triton_available

    if not triton_available():
        return "triton is not installed"
    from ...kernels.shared.weighted_triton import unsupported_reason

    reason = unsupported_reason(inputs.q, inputs.k, inputs.v, page_size)
    if reason is None and inputs.lengths is None:
        reason = "key_mask is not a prefix of each row (the kernel takes per-row lengths)"
    return reason


def choose_sparse_backend(backend: str, inputs: DecodeInputs, page_size: int = 1) -> tuple[str, str | None]:
    """``(path, reason)`` for the sparse kernel (see :func:`kvsieve.methods.shared.backend.choose_path`)."""
    return choose_path(backend, inputs, lambda: sparse_unsupported(inputs, page_size))



def dense_part_mark(inputs: DecodeInputs, sink: int, window: int) -> torch.Tensor:
    """``[B, N]`` bool: the sink and window keys of each row (the kernel's dense part)."""
    from ...kernels.shared.scores import dense_bounds

    sink_end, win_start = dense_bounds(inputs.n_valid, sink, window)
    pos = torch.arange(inputs.n_keys, device=inputs.q.device)[None, :]
    return (pos < sink_end[:, None]) | ((pos >= win_start[:, None]) & (pos < inputs.n_valid[:, None]))


def page_list_mark(inputs: DecodeInputs, pages: torch.Tensor, counts: torch.Tensor, page_size: int, sink: int,
                   window: int) -> torch.Tensor:
    """``[B, Hs, N]`` bool: keys the kernel reads for a page list (outside the dense part) plus the dense part."""
    from ...kernels.shared.scores import dense_bounds

    b, hs, m = pages.shape
    n = inputs.n_keys
    sink_end, win_start = dense_bounds(inputs.n_valid, sink, window)
    pos = (pages.long()[..., None] * page_size + torch.arange(page_size, device=pages.device)).view(b, hs, -1)
    used = (torch.arange(m, device=pages.device) < counts[..., None]).repeat_interleave(page_size, -1)
    used = used & (pos >= sink_end[:, None, None]) & (pos < win_start[:, None, None])
    mark = torch.zeros(b, hs, n + 1, dtype=torch.bool, device=pages.device)
    mark.scatter_(2, torch.where(used, pos, n), True)
    return mark[..., :n] | dense_part_mark(inputs, sink, window)[:, None, :]


def sparse_stats(inputs: DecodeInputs, mark: Callable[[], torch.Tensor], *, extra: dict,
                 scored_all: bool = False) -> StepStats:
    """Stats of a kernel call from the keys it read per selection head (``mark() -> [B, Hs, N]``, weight
    1): K rows scored = V rows read = the union over each GQA group (as the reference's ``scored=[]``),
    or every valid key with ``scored_all`` (as ``scored=None``). Deferred: the mark and the stats are
    built on first read, so a call whose stats nobody reads (a captured decode step) adds no op."""

    def compute() -> StepStats:
        m = mark()
        b, hs, n = m.shape
        v_read = m if hs == inputs.heads else m.repeat_interleave(inputs.heads // hs, dim=1)
        k_scored = None if scored_all else v_read.view(b, inputs.kv_heads, inputs.group, n).any(2).sum(-1)
        exact_rows = (m.sum(-1) == inputs.n_valid[:, None]).all(-1).sum()  # a device tensor: no host read
        return read_stats(inputs, v_read, k_scored=k_scored, backend="triton", exact_rows=exact_rows)

    return StepStats.deferred(compute, "triton", {"kernel": "sparse_decode_triton", **extra})
