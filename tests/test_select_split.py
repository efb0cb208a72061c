"""The split top-k (``kernels/shared/select_split.py``): its interpreter cases (``select_split_interpreter_cases.py``,
in a subprocess with ``TRITON_INTERPRET=1``) and the host-side choice of its programs."""

from __future__ import annotations

import pytest
import torch
from interpreted import case_groups, group_id, run_interpreter_cases

pytest.importorskip("triton")

CASES = "select_split_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_split_select_equals_the_rows_select_and_the_reference"),
                         ids=group_id)
def test_split_select_under_the_triton_interpreter(group):
    run_interpreter_cases(CASES, group)


def test_split_chunk_fills_the_gpu_with_few_rows_and_stays_in_its_bounds():
    from kvsieve.kernels.shared.select_split import SPLIT_CHUNK_MAX, SPLIT_CHUNK_MIN, split_chunk

    cpu = torch.device("cpu")  # sized as on a 132-SM GPU
    for rows, x in ((2, 8192), (8, 8192), (64, 2048), (1, 1 << 20), (500, 100)):
        chunk = split_chunk(rows, x, cpu)
        assert SPLIT_CHUNK_MIN <= chunk <= SPLIT_CHUNK_MAX and chunk & (chunk - 1) == 0
        if SPLIT_CHUNK_MIN < chunk < SPLIT_CHUNK_MAX and rows < 132:  # no bound binds: about one program per SM
            assert 132 / 2 < rows * -(-x // chunk) <= 2 * 132
        else:  # a chunk at a bound, or a row each
            assert chunk in (SPLIT_CHUNK_MIN, SPLIT_CHUNK_MAX) or -(-x // chunk) == 1
    assert split_chunk(2, 8192, cpu, programs=16) == 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,h,x", [(1, 2, 8192), (1, 8, 8192), (8, 8, 2048), (1, 4, 131072)])
def test_gpu_split_select_equals_the_rows_select(b, h, x):
    """On the GPU at Quest's shapes (and oracle-topk-like 128k-unit rows): the rows select's indices and the
    reference's, on i.i.d. and on rounded (tied) scores, and in a CUDA graph replay."""
    from kvsieve.kernels.shared.select_split import row_maxima, topk_rows_split
    from kvsieve.kernels.shared.select_triton import topk_rows_reference, topk_rows_triton

    g = torch.Generator(device="cuda").manual_seed(x + h)
    k = x // 20
    for ties in (False, True):
        s = torch.randn(b, h, x, device="cuda", generator=g) * 2 - 12
        s = (s * 10).round() / 10 if ties else s
        counts = torch.randint(k // 2, k + 1, (b,), device="cuda", generator=g)
        maxima = row_maxima(s).contiguous()
        want = topk_rows_reference(s, counts, k)
        assert torch.equal(topk_rows_triton(s, counts, k, maxima=maxima), want)
        out = torch.empty_like(want)
        assert torch.equal(topk_rows_split(s, counts, k, maxima=maxima, out=out), want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            topk_rows_split(s, counts, k, maxima=maxima, out=out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
