"""What Sketch&Walk's decode and prefill selection kernels share: the block budget in float64 (as the
method's ``block_budget``), the host side of passing ρ to it, and the floor of a row's maximum."""

from __future__ import annotations

import struct

import torch

from ..shared.triton_utils import triton

if triton is not None:
    import triton.language as tl

    # The floor normalize_rows clamps a row's maximum to (an all-zero row stays zero, not NaN). A constexpr:
    # jit code may read a module global only if it is one.
    FLOAT32_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)

    @triton.jit
    def block_budget(rho_bits, row, n_blocks, FIXED: tl.constexpr):
        """Blocks kept by query block ``row``: ``max(2, ⌈ρ·base − 1e-9⌉)``, at most ``row + 1``, with base
        ``row + 1`` (or ``n_blocks`` when ``FIXED``), in float64 as the reference; ``rho_bits`` from
        :func:`float_bits`."""
        rho = rho_bits.to(tl.float64, bitcast=True)
        if FIXED:
            base = (row * 0 + n_blocks).to(tl.float64)
        else:
            base = (row + 1).to(tl.float64)
        x = rho * base - tl.full([], 1e-9, tl.float64)
        whole = x.to(tl.int64)  # truncation: floor for x ≥ 0, and a negative x rounds up to ≤ 0 anyway
        k = whole + (whole.to(tl.float64) < x).to(tl.int64)
        return tl.minimum(tl.maximum(k, 2), row + 1)


def float_bits(x: float) -> int:
    """A float's IEEE double bits as a signed 64-bit integer: Triton passes Python floats as float32, which
    would move ρ(i+1) across an integer (ρ = 0.1, i + 1 = 100)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]
