"""The cold-L2 timing protocol of the SANTA paper's Appendix Q (``shared/measurements/h100-dense-decode.md``).

Before every timed call a 512 MB buffer is rewritten, so that no K/V byte is served from L2 (50 MB
on an H100); the call is bracketed by CUDA events; warm-up calls come first; the median is kept. The
flush also hides the host's launch cost: the kernels are queued while the flush runs, so the events
measure device time, launch gaps between kernels included.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

FLUSH_BYTES = 512 * 1024 * 1024


class ColdL2Timer:
    def __init__(self, device: torch.device | str = "cuda", flush_bytes: int = FLUSH_BYTES):
        self.flush_buffer = torch.empty(flush_bytes // 4, dtype=torch.float32, device=device)

    def flush(self) -> None:
        self.flush_buffer.fill_(1.0)

    def time_us(self, fn: Callable[[], object], *, warmup: int = 10, iters: int = 40) -> dict[str, float]:
        """Median, min and max of ``iters`` cold-L2 calls, in µs."""
        for _ in range(warmup):
            self.flush()
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends, strict=True):
            self.flush()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends, strict=True)]
        return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}


    def time_graph_us(self, fn: Callable[[], object], *, warmup: int = 10, iters: int = 40) -> dict[str, float]:
        """As ``time_us`` for ``fn`` captured once in a CUDA graph and replayed: no host launch cost,
        kernels back to back (how a serving engine runs decode steps)."""
        return self.time_us(capture_graph(fn).replay, warmup=warmup, iters=iters)

    def kernel_breakdown(self, fn: Callable[[], object], *, iters: int = 5) -> dict[str, float] | None:
        """Mean device µs per kernel name over ``iters`` cold-L2 calls (torch profiler), flush excluded."""
        try:
            from torch.profiler import ProfilerActivity, profile

            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as flush_prof:
                self.flush()
                torch.cuda.synchronize()
            flush_names = set(kernel_totals(flush_prof, width=60))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    self.flush()
                    torch.cuda.synchronize()
                    fn()
                    torch.cuda.synchronize()
            return {k: us / iters for k, (us, _) in kernel_totals(prof, width=60).items() if k not in flush_names}
        except Exception:  # noqa: BLE001 - the profiler is optional
            return None


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after three warm-up calls on a side stream (workspaces, handles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_totals(prof, width: int | None = None) -> dict[str, tuple[float, int]]:
    """``{kernel name (its first ``width`` characters): (device µs summed, launches)}`` of a torch profiler's
    CUDA events."""
    totals: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name if width is None else e.name[:width]
        us, count = totals.get(name, (0.0, 0))
        totals[name] = (us + e.time_range.elapsed_us(), count + 1)
    return totals


def host_us(fn: Callable[[], object], iters: int = 50) -> float:
    """Host time to issue one call (µs), the GPU kept busy so that nothing waits on it."""
    import time

    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000 // 1000 * 5)  # ~5 ms of device work queued ahead
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / iters * 1e6


def copy_bandwidth(device: torch.device | str = "cuda", n_bytes: int = 2 * 1024**3, iters: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus written (the bandwidth ceiling)."""
    src = torch.empty(n_bytes // 2 // 2, dtype=torch.float16, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        dst.copy_(src)
    e.record()
    torch.cuda.synchronize()
    seconds = s.elapsed_time(e) / 1000.0 / iters
    return 2 * src.numel() * src.element_size() / seconds


def count_launches(fn: Callable[[], object]) -> int | None:
    """Kernels one call launches (torch profiler); None where the profiler cannot see the device."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(count for _, count in kernel_totals(prof).values())
    except Exception:  # noqa: BLE001 - the profiler is optional, the count is reported as unknown
        return None


# aten ops that launch no kernel on a GPU (allocation, aliasing); views are told by their schema
_NO_KERNEL = {"empty.memory_format", "empty_strided.default", "empty_like.default", "lift_fresh.default",
              "detach.default", "_local_scalar_dense.default"}


def count_dispatched(fn: Callable[[], object]) -> dict:
    """What one call would launch, counted without a GPU (the CPU proxy of :func:`count_launches`): the torch ops
    that run a kernel (a dispatch-mode counter; views and allocations excluded), the Triton launches (under
    ``TRITON_INTERPRET=1``, where every launch goes through the interpreter) and the host reads of a device value
    (``.item()``-like: a sync on a GPU). Returns ``{"torch_ops", "triton_launches", "host_reads", "ops"}``, ``ops``
    the torch ops by name."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    ops: Counter = Counter()
    counts = {"triton": 0, "reads": 0, "inside": 0}

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = f"{func._overloadpacket.__name__}.{func._overloadname}"
            if name == "_local_scalar_dense.default":
                counts["reads"] += 1
            elif not counts["inside"] and not func.is_view and name not in _NO_KERNEL:
                ops[name] += 1
            return func(*args, **(kwargs or {}))

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - triton is an optional dependency
        InterpretedFunction = None
    run = InterpretedFunction.run if InterpretedFunction is not None else None

    def counted_run(self, *args, **kwargs):
        counts["triton"] += 1
        counts["inside"] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counts["inside"] -= 1

    if run is not None:
        InterpretedFunction.run = counted_run
    try:
        with _Mode():
            fn()
    finally:
        if run is not None:
            InterpretedFunction.run = run
    return {"torch_ops": sum(ops.values()), "triton_launches": counts["triton"], "host_reads": counts["reads"],
            "ops": dict(ops)}


# kvsieve's Triton kernels (kernels/: every one is named ``_..._kernel``; a method's selection, index and state
# update included), FlashAttention/SDPA kernels, and selection (topk/sort) count as attention
_ATTENTION_KERNELS = ("dense_split", "merge_partials", "merge_lse", "_tile_", "sample", "budget", "group_sum",
                      "ordered_stats", "page_", "scores_kernel", "sparse_split", "flash", "fmha", "attention",
                      "sdpa", "topk", "sort")
_GEMM_KERNELS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "matmul", "cublas", "splitk")
# a tensor-parallel step's collectives: NCCL's kernels and torch's symmetric-memory all-reduces
_COLLECTIVE_KERNELS = ("nccl", "all_reduce", "allreduce", "one_shot", "two_shot", "multimem")
TOP_KERNELS = 16


def step_kernel_kinds(step: Callable[[], object], n: int) -> dict | None:
    """Device ms per step by kernel kind (attention, gemm = weights, collective: a tensor-parallel step's all-reduces,
    other: norms, RoPE, sampling, ...), kernels
    per step, and the ``TOP_KERNELS`` costliest kernel names with their ms per step (``top``), from the torch
    profiler over ``n`` steps; None where the profiler sees no kernels. Kernels launched with programmatic
    dependent launch count the time their programs wait for the previous kernel."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            torch.cuda.synchronize()
        out: dict = {"attention_ms": 0.0, "gemm_ms": 0.0, "collective_ms": 0.0, "other_ms": 0.0, "kernels": 0.0}
        by_name: dict[str, float] = {}
        for full_name, (us, count) in kernel_totals(prof).items():
            name = full_name.lower()
            ours = name.startswith("_") and name.endswith("_kernel")  # not inductor's triton_* nor at::native
            kind = ("collective" if any(k in name for k in _COLLECTIVE_KERNELS)
                    else "attention" if ours or any(k in name for k in _ATTENTION_KERNELS)
                    else "gemm" if any(k in name for k in _GEMM_KERNELS) else "other")
            ms = us / 1e3 / n
            out[f"{kind}_ms"] += ms
            out["kernels"] += count / n
            by_name[full_name[:80]] = by_name.get(full_name[:80], 0.0) + ms
        out["top"] = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS])
        return out if out["kernels"] else None
    except Exception:  # noqa: BLE001 - the profiler is optional
        return None
