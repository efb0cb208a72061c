"""Sketch&Walk's prefill selection kernels (``kernels/sketchwalk/prefill_select.py``).

CPU: the kernels against the method's torch path through Triton's interpreter
(``sketchwalk_pselect_interpreter_cases.py``, in a subprocess: the interpreter is chosen when triton is
imported). GPU (``gpu`` mark, skipped without CUDA): the two paths at Llama-3.1-8B shapes, no host sync, a CUDA
graph replay equal to the eager call, and the launch count the kernels are for.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import case_groups, group_id, run_interpreter_cases

import kvsieve
from kvsieve.methods.sketchwalk import TIE_BREAK, normalize_rows

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


CASES = "sketchwalk_pselect_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_select_matches_the_reference",
                                              "test_forced_ties_in_random_rankings"), ids=group_id)
def test_kernels_under_the_triton_interpreter(group):
    pytest.importorskip("triton")
    run_interpreter_cases(CASES, group)


def _llama_qk(n_tok: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, 32, n_tok, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 8, n_tok, 128, device="cuda", generator=g).bfloat16()
    return q, k


def _selection(m, q, k, previous):
    sk = m.prefill_sketch(q, k)
    return sk, m.prefill_select(sk["a_tilde"], previous)


def _assert_same_selection(got, ref, rank, rtol=1e-4, max_rows=0.01):
    """Equal counts; rows whose lists differ only swap blocks of (near-)equal ranking (float32 rounding of two
    paths can order a near-tie either way), and at most ``max_rows`` of the rows do."""
    (idx, cnt), (ridx, rcnt) = got, ref
    assert torch.equal(cnt, rcnt)
    used = torch.arange(idx.shape[-1], device=idx.device) < cnt[..., None]
    a = torch.where(used, rank.gather(-1, idx), -1.0).sort(-1).values
    r = torch.where(used, rank.gather(-1, ridx), -1.0).sort(-1).values
    torch.testing.assert_close(a, r, atol=1e-30, rtol=rtol)
    differ = (idx != ridx).any(-1).double().mean()
    assert differ <= max_rows, float(differ)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n_tok", [8192 + 37, 32768])
@pytest.mark.parametrize("walk", ["walk", "one-hop", "diagonal"])
def test_gpu_paths_agree_at_llama_shapes(n_tok, walk):
    q, k = _llama_qk(n_tok, seed=n_tok)
    q2, k2 = _llama_qk(n_tok, seed=n_tok + 1)
    spec = f"sketchwalk:variant=reconstruction,density=0.1,walk={walk}"
    res = {}
    for backend in ("auto", "reference"):
        m = kvsieve.method(f"{spec},backend={backend}")
        assert m.prefill_selection_path(q, -(-n_tok // 64))[0] == ("triton" if backend == "auto" else "reference")
        previous = _selection(m, q2, k2, None)[1][0]  # a previous layer's walk, from each path's own
        res[backend] = _selection(m, q, k, previous)
    sk, (w, idx, cnt) = res["auto"]
    rsk, (rw, ridx, rcnt) = res["reference"]
    for key in ("q_avg", "q_sum", "k_sum", "k_sketch"):
        torch.testing.assert_close(sk[key], rsk[key], atol=1e-4, rtol=1e-4, msg=lambda s, key=key: f"{key}: {s}")
    torch.testing.assert_close(sk["a_tilde"], rsk["a_tilde"], atol=1e-30, rtol=1e-3)
    torch.testing.assert_close(w, rw, atol=1e-30, rtol=1e-3)
    rank = rw + TIE_BREAK * normalize_rows(rsk["a_tilde"])
    _assert_same_selection((idx, cnt), (ridx, rcnt), rank)


@pytest.mark.gpu
@cuda
def test_gpu_selection_does_not_sync_and_replays_in_a_graph():
    q, k = _llama_qk(16384, seed=1)
    m = kvsieve.method("sketchwalk:variant=reconstruction,density=0.1")
    prev = _selection(m, q, k, None)[1][0]

    def call():
        return _selection(m, q, k, prev)[1]

    first = call()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph, stream=stream):
            captured = call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(first, captured, strict=True))


@pytest.mark.gpu
@cuda
def test_gpu_selection_is_a_handful_of_launches():
    from kvsieve.bench.timing import count_launches

    q, k = _llama_qk(32768, seed=2)
    counts = {}
    for backend in ("auto", "reference"):
        m = kvsieve.method(f"sketchwalk:variant=reconstruction,density=0.1,backend={backend}")
        prev = _selection(m, q, k, None)[1][0]
        counts[backend] = count_launches(lambda m=m, prev=prev: _selection(m, q, k, prev))
    # block means, SRHT matmul, logits matmul, softmax power, walk matmul, select: 6 (a cuBLAS split-K
    # reduction may add one per matmul)
    assert counts["auto"] is not None and counts["auto"] <= 9, counts
    assert counts["reference"] > 3 * counts["auto"], counts
