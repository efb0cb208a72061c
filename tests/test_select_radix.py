"""The radix top-k (``kernels/shared/select_radix.py``): its interpreter cases (``select_radix_interpreter_cases.py``,
in a subprocess with ``TRITON_INTERPRET=1``), the host-side choice of its programs and of the way long rows take."""

from __future__ import annotations

import pytest
import torch
from interpreted import case_groups, compile_for_sm90, group_id, run_interpreter_cases

CASES = "select_radix_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_radix_select_equals_the_reference",
                                              "test_vattention_with_the_radix_select_equals_the_triton_select"),
                         ids=group_id)
def test_radix_select_under_the_triton_interpreter(group):
    pytest.importorskip("triton")
    run_interpreter_cases(CASES, group)


COMPILE_RADIX = """
from kvsieve.kernels.shared import select_radix as m
ptr = {"s_ptr": "*fp32", "cnt_ptr": "*i64", "h_ptr": "*i32", "st_ptr": "*i32", "slot_ptr": "*i32", "above_ptr": "*i32",
       "meta_ptr": "*i32", "base_ptr": "*i32", "allow_ptr": "*i32", "out_ptr": "*i64"}
# the launches as topk_rows_radix makes them: the first digit, one replaying both earlier digits, one from the kept
# state, the narrow last one; with and without the histogram's mask and PDL; 6- and 8-bit digits
for bits, step, masked, pdl in ((6, 0, True, False), (6, 1, False, True), (6, 2, True, True), (6, 5, False, False),
                                (8, 3, True, True)):
    meta = {"PASS": step, "BITS": bits, "BLOCK": 4096 if step == 0 else 1024, "MASKED": masked, "PDL": pdl}
    assert registers(compile_(m._radix_hist_kernel, ptr, meta, num_warps=8, num_stages=1)) <= 64
for bits in (6, 8):
    compile_(m._radix_place_kernel, ptr, {"BITS": bits, "TILE_P": 32, "PDL": True}, num_warps=4, num_stages=1)
assert registers(compile_(m._radix_emit_kernel, ptr, {"BLOCK": 2048, "PDL": True}, num_warps=8, num_stages=1)) <= 64
print("COMPILED")
"""


def test_radix_select_compiles_for_the_h100():
    """Every launch form compiles for sm_90 (the interpreter type-checks no untaken branch) within a register
    budget that leaves 4+ programs of 8 warps per SM."""
    pytest.importorskip("triton")
    compile_for_sm90(COMPILE_RADIX)


def test_radix_chunk_spreads_rows_over_the_gpu_within_its_bounds():
    from kvsieve.kernels.shared.select_radix import RADIX_CHUNK_MAX, RADIX_CHUNK_MIN, RADIX_PROGRAMS_PER_SM, radix_chunk

    cpu = torch.device("cpu")  # sized as on a 132-SM GPU
    total = RADIX_PROGRAMS_PER_SM * 132
    for rows, x in ((32, 131072), (256, 32768), (1, 1 << 20), (8, 65536), (4096, 1000)):
        chunk = radix_chunk(rows, x, cpu)
        assert RADIX_CHUNK_MIN <= chunk <= RADIX_CHUNK_MAX and chunk & (chunk - 1) == 0
        if RADIX_CHUNK_MIN < chunk < RADIX_CHUNK_MAX:  # no bound binds: about `total` programs
            assert total / 2 < rows * -(-x // chunk) <= 2 * total
    assert radix_chunk(32, 131072, cpu) == 4096  # vAttention at 128k keys, batch 1: 32 programs per row
    assert radix_chunk(1, 131072, cpu, programs=8) == 16384


def test_long_rows_take_the_radix_select(monkeypatch):
    """``select_path``: per-query-head rows over ``RADIX_SELECT_ABOVE`` keys (read at call time) take the radix
    select, the rest the Triton select; ``select_launches`` lists the radix launch (after the group sum for
    group-summed rows)."""
    from kvsieve.kernels.oracle_topk import topk
    from kvsieve.kernels.shared.select_triton import select_launches

    n = topk.RADIX_SELECT_ABOVE + 1
    assert topk.select_path(False, n) == "radix"
    assert topk.select_path(False, n - 1) == "triton" and topk.select_path(True, 4 * n) == "triton"
    monkeypatch.setattr(topk, "RADIX_SELECT_ABOVE", 300)
    assert topk.select_path(False, 301) == "radix" and topk.select_path(False, 300) == "triton"
    assert select_launches(n, 4, False, "radix") == ("radix",)
    assert select_launches(n, 4, True, "radix") == ("group_sum", "radix")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,h,x", [(1, 32, 131072), (8, 32, 32768), (2, 3, 5000)])
def test_gpu_radix_select_equals_the_reference(b, h, x):
    """On the GPU at vAttention's shapes: the reference's list on i.i.d. and on rounded (tied) logits with
    −inf outside the candidates, eagerly and in a CUDA graph replayed twice (the histograms left zero)."""
    from kvsieve.kernels.shared.select_radix import topk_rows_radix
    from kvsieve.kernels.shared.select_triton import topk_rows_reference

    g = torch.Generator(device="cuda").manual_seed(x + h)
    k = x // 40
    for ties in (False, True):
        s = torch.randn(b, h, x, device="cuda", generator=g) * 2 - 3
        s = (s * 10).round() / 10 if ties else s
        s[..., :4] = float("-inf")
        counts = torch.randint(k // 2, k + 1, (b,), device="cuda", generator=g)
        want = topk_rows_reference(s, counts, k)
        out = torch.empty_like(want)
        assert torch.equal(topk_rows_radix(s, counts, k, out=out), want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            topk_rows_radix(s, counts, k, out=out)
        for _ in range(2):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,n", [(1, 131072), (4, 32768)])
def test_gpu_topk_select_radix_equals_the_triton_select(b, n):
    """oracle-topk's device top-k at the Llama-3.1-8B shape (bf16, 2.5% of the keys, ragged rows): the radix
    select's list is the Triton select's (both ascending, ties to the lowest index), per query head."""
    from kvsieve.kernels.oracle_topk import topk

    g = torch.Generator(device="cuda").manual_seed(n + b)
    q = (torch.randn(b, 32, 128, device="cuda", generator=g) * 2).to(torch.bfloat16)
    k = torch.randn(b, 8, n, 128, device="cuda", generator=g).to(torch.bfloat16)
    lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
    lens[-1] = n // 2 + 3
    kw = dict(sink=128, window=128, size=0.025, max_k=int(0.025 * n), share_kv_group=False)
    idx, counts = topk.topk_select(q, k, lens, select="radix", **kw)
    want, want_counts = topk.topk_select(q, k, lens, select="triton", **kw)
    assert torch.equal(counts, want_counts)
    used = torch.arange(idx.shape[-1], device="cuda") < counts[..., None]
    assert torch.equal(torch.where(used, idx, -1), torch.where(used, want, -1))
