"""Which calls the Triton kernels can serve, and the backend choice every kernel-backed method makes.

``backend="reference"`` always runs the torch reference. ``backend="triton"`` runs the kernel or raises
a ``ValueError`` that says why it cannot (CPU tensors run only when ``TRITON_INTERPRET=1`` was set
before the kernels were imported). ``backend="auto"`` runs the kernel for CUDA tensors it can serve
and the reference otherwise; ``stats.backend`` names the path that ran and
``stats.extra["backend_reason"]`` why the kernel did not.
"""

from __future__ import annotations

import torch

from ...core.inputs import DecodeInputs

BACKENDS = ("auto", "reference", "triton")


def triton_unsupported(inputs: DecodeInputs, *, tile: int | None = None, budget: int | None = None) -> str | None:
    """Why the Triton kernels cannot serve this call, or None."""
    # imported lazily: decorating the kernels reads TRITON_INTERPRET
    from ...kernels.shared.triton_utils import MAX_BUDGET, triton_available, unsupported_reason

    if not triton_available():
        return "triton is not installed"
    reason = unsupported_reason(inputs.q, inputs.k, inputs.v)
    if reason is not None:
        return reason
    if inputs.lengths is None:
        return "key_mask is not a prefix of each row (the kernels take per-row lengths)"
    if tile is not None and (tile < 16 or tile & (tile - 1)):
        return f"tile_size {tile} (the kernels take a power of two ≥ 16)"
    if budget is not None and budget > MAX_BUDGET:
        return f"budget {budget} (the kernels take at most {MAX_BUDGET})"
    return None


def choose_backend(backend: str, inputs: DecodeInputs, **limits) -> tuple[str, str | None]:
    """``(path, reason)`` for the S²ANTA and dense kernels (see :func:`choose_path`)."""
    return choose_path(backend, inputs, lambda: triton_unsupported(inputs, **limits))


def choose_path(backend: str, inputs: DecodeInputs, unsupported) -> tuple[str, str | None]:
    """``(path, reason)``: path is "triton" or "reference"; reason says why the kernel was not used.

    ``unsupported()`` says why the method's kernel cannot serve the call (None when it can)."""
    if backend == "reference":
        return "reference", None
    if backend == "auto" and inputs.q.device.type != "cuda":
        return "reference", None  # the expected path off the GPU, not a fallback
    reason = unsupported()
    if reason is None:
        return "triton", None
    if backend == "triton":
        raise ValueError(f"backend: 'triton' cannot serve this call: {reason}; use backend='auto' or 'reference'")
    return "reference", reason


def kernel_operands(inputs: DecodeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with a contiguous last dim (copied only when not) and int32 lengths."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (inputs.q, inputs.k, inputs.v))
    return q, k, v, inputs.kernel_lengths
