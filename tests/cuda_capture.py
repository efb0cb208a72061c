"""The decode-contract check the GPU tests share: warm-up calls on a side stream, one call that must not
synchronise with the host (CUDA's sync debug mode raises on one), then the call captured in a CUDA graph."""

import torch


def warm_check_and_capture(call):
    """``(last warm-up result, graph, captured result)`` of ``call`` (a zero-argument decode step)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            warm = call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    return warm, graph, captured
