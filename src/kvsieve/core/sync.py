"""Where the decode path may read device values on the host, and how it avoids it elsewhere.

On CUDA a host read of a device value (``.item()``, ``int(t)``, ``bool(t)``, a data-dependent
output shape) stalls the CPU until the GPU has caught up and breaks CUDA-graph capture. On the CPU
the same read costs nothing, and using it to size a buffer tightly (the largest selection of a
call instead of its upper bound) makes the references faster there. The helpers below make that
choice in one place: on a CPU tensor they read the value, on any other device — or inside
:func:`no_host_reads`, which tests use to run the GPU code path on the CPU — they return a bound
known on the host.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_NO_HOST_READS: ContextVar[bool] = ContextVar("kvsieve_no_host_reads", default=False)


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Run the code path of devices where host reads are avoided, whatever the device."""
    token = _NO_HOST_READS.set(True)
    try:
        yield
    finally:
        _NO_HOST_READS.reset(token)


def host_reads_allowed(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not _NO_HOST_READS.get()


def max_or_bound(t: torch.Tensor, bound: int) -> int:
    """``min(max(t), bound)`` where host reads are allowed (and ``t`` is not empty), else ``bound``."""
    if t.numel() == 0:
        return 0
    if host_reads_allowed(t):
        return max(0, min(int(t.max()), int(bound)))
    return int(bound)


def any_or_true(t: torch.Tensor) -> bool:
    """``bool(t.any())`` where host reads are allowed, else True (take the general path)."""
    if host_reads_allowed(t):
        return bool(t.any())
    return True
