"""Quest's chunked page select (``kernels/shared/select_chunked.py``) and programmatic dependent launch on
its device path (``quest:device_select=chunked,pdl=true``).

CPU: bad input, the kernels compiled for the H100 (sm_90, with and without PDL), and the interpreter
cases of ``quest_fused_interpreter_cases.py`` in a subprocess. GPU (``gpu`` mark, skipped without CUDA):
the pages equal the reference's at the Llama-3.1-8B shape, no host sync, CUDA-graph replays equal eager calls.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import case_groups, compile_for_sm90, group_id, run_interpreter_cases

import kvsieve
from kvsieve.kernels.shared.select_chunked import topk_rows_chunked

CASES = "quest_fused_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_chunked_select_matches_the_reference"), ids=group_id)
def test_kernels_under_the_triton_interpreter(group):
    pytest.importorskip("triton")
    run_interpreter_cases(CASES, group)


def test_config_refuses_bad_switches():
    with pytest.raises(ValueError, match="device_select"):
        kvsieve.method("quest:device_select=registers")
    with pytest.raises(ValueError, match="pdl"):
        kvsieve.method("quest", pdl="yes")


def test_chunked_select_refuses_bad_input_by_name():
    s = torch.zeros(2, 8, 100)
    counts = torch.ones(2, dtype=torch.int64)
    parts = (torch.zeros(2, 8, 2), torch.ones(2, 8, 2))
    with pytest.raises(ValueError, match="parts"):
        topk_rows_chunked(s, counts, 4, parts=(parts[0][:, :4], parts[1]))
    with pytest.raises(ValueError, match="lengths"):
        topk_rows_chunked(s, counts, 4, parts=parts, group=4)
    with pytest.raises(ValueError, match="k: expected >= 1"):
        topk_rows_chunked(s, counts, 0, parts=parts)
    with pytest.raises(ValueError, match="programs"):
        topk_rows_chunked(s, counts, 4, parts=parts, programs=0)
    with pytest.raises(ValueError, match="num_warps"):
        topk_rows_chunked(s, counts, 4, parts=parts, num_warps=3)
    with pytest.raises(ValueError, match="scores"):
        topk_rows_chunked(s.half(), counts, 4, parts=parts)


# The interpreter neither type-checks untaken branches nor emits griddepcontrol: every kernel of the device
# path compiled for the H100 with PDL, the chunked select at Quest's 128k pages (8 warps) both ways.
COMPILE = r"""
from kvsieve.kernels.quest import quest_pages as qp
from kvsieve.kernels.shared import select_chunked as sc, triton_utils as tu, weighted_triton as wt

ptr = {"s_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "cnt_ptr": "*i64", "lens_ptr": "*i32",
       "gs_ptr": "*fp32", "hist_ptr": "*i32", "cv_ptr": "*fp32", "tk_ptr": "*i32", "out_ptr": "*i64"}
for share in (True, False):
    for pdl in (False, True):
        meta = dict(G=4 if share else 1, BLOCK_G=4 if share else 2, SHARE=share, UNIT=16, CHUNK=512,
                    BLOCK_PART=512, BINS=sc.BINS, MANT=sc.MANT, E_MIN=sc.E_MIN, BLOCK_X=2048, BLOCK_C=256, PDL=pdl)
        compile_(sc._chunked_select_kernel, ptr, meta, num_warps=8)
ptr = {"q_ptr": "*bf16", "kmin_ptr": "*bf16", "kmax_ptr": "*bf16", "lens_ptr": "*i32", "out_ptr": "*fp32",
       "counts_ptr": "*i64", "frac_ptr": "*fp64", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "mx_ptr": "*fp32",
       "k_ptr": "*bf16", "done_ptr": "*i32", "tk_ptr": "*i32"}
for refresh in (False, True):
    compile_(qp._page_bounds_kernel, ptr, dict(G=4, BLOCK_G=16, D=128, BLOCK_P=64, PAGE=16, MASK_DENSE=False,
             WRITE_COUNTS=True, IS_FRAC=False, DOT_PRECISION="tf32", DOT_F32=False, WRITE_PARTS=True,
             WRITE_MAX=False, GROUP_MAX=8, TILES=1, REFRESH=refresh, BLOCK_K=16, PDL=True), floats=("scale",))
compile_(qp._page_update_kernel, {"k_ptr": "*bf16", "lens_ptr": "*i32", "done_ptr": "*i32", "kmin_ptr": "*bf16",
         "kmax_ptr": "*bf16"}, dict(PAGE=16, BLOCK=16, D=128, PDL=True))
ptr = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
ptr.update({"idx_ptr": "*i64", "cnt_ptr": "*i64", "w_ptr": "*i64", "lens_ptr": "*i32", "sink_lens_ptr": "*fp32",
            "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "sem_ptr": "*fp32", "lse_ptr": "*fp32"})
compile_(wt._sparse_split_kernel, ptr, dict(HEADS=4, G=4, BLOCK_G=16, D=128, BLOCK_N=64, PAGE=16, HAS_LENS=True,
         HAS_W=False, DOT_PRECISION="tf32", DOT_F32=False, FUSED_MERGE=False, HAS_SINK_LENS=False, PDL=True),
         floats=("scale_log2",))
compile_(tu._merge_partials_kernel, {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "lens_ptr": "*bf16",
         "out_ptr": "*bf16", "lse_ptr": "*fp32"}, dict(D_CHUNK=32, CHUNK_P=64, HAS_LENS=False, HAS_LSE=True, PDL=True),
         num_warps=1)
from kvsieve.kernels.shared import select_triton as st

ptr = {"s_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "cnt_ptr": "*i64", "lens_ptr": "*i32",
       "gs_ptr": "*fp32", "tk_ptr": "*i32", "out_ptr": "*i64", "mx_ptr": "*fp32", "cv_ptr": "*fp32", "ci_ptr": "*i32",
       "sn_ptr": "*i32", "sh_ptr": "*i32", "sl_ptr": "*i32", "cv2_ptr": "*fp32", "ci2_ptr": "*i32"}
compile_(st._select_regs_kernel, ptr, dict(G=4, BLOCK_G=4, SHARE=True, UNIT=16, XT=4096, CHUNK=512, BLOCK_PART=512,
         PDL=True), num_warps=8)
compile_(st._group_sum_parts_kernel, {**ptr, "out_ptr": "*fp32"}, dict(G=4, BLOCK_G=4, UNIT=16, BLOCK_X=1024,
         CHUNK=512, BLOCK_PART=512, GROUP_MAX=8, PDL=True))
compile_(st._topk_rows_kernel, ptr, dict(G=1, BLOCK_G=2, SHARE=False, UNIT=16, BLOCK_X=2048, BLOCK_XG=2048,
         BLOCK_PART=1024, PREFILTER=True, GROUP_MAX=8, BLOCK_M=1024, BLOCK_C=512, SEGMENTED=False, PDL=True),
         num_warps=8)
print("COMPILED")
"""


@pytest.mark.triton
def test_device_path_kernels_compile_for_the_h100_with_pdl():
    pytest.importorskip("triton")
    compile_for_sm90(COMPILE)


# --- GPU --------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n", [32768, 131072])
@pytest.mark.parametrize("share", [True, False])
def test_gpu_chunked_select_matches_the_reference(n, share):
    """Llama-3.1-8B shape, bf16, two rows of different lengths, 5 %: the chunked select (with and without
    PDL) takes the reference's pages, up to near-ties of the float32 scores."""
    import sys
    from pathlib import Path

    from kvsieve.kernels.quest import quest_pages

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "sparse_decode"))
    from tune_quest import selection_check

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 32, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, 8, n, 128, device="cuda", generator=g).bfloat16()
    lens = torch.tensor([n, n - 5000], device="cuda", dtype=torch.int32)
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, 16)
    kw = dict(page_size=16, sink=128, window=128, size=0.05, max_pages=-(-int(n * 0.05) // 16), share_kv_group=share)
    want = quest_pages.quest_select(q, kmin, kmax, lens, bounds="reference", **kw)
    scores = quest_pages.quest_scores_reference(q, kmin, kmax, lens, 16, 128, 128, share)
    for pdl in (False, True):
        for _ in range(2):
            got = quest_pages.quest_select(q, kmin, kmax, lens, select="chunked", pdl=pdl, **kw)
            assert selection_check(got, want, scores)["ok"], pdl


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("spec", ["quest:top_k=0.05,share_kv_group=true,device_select=chunked",
                                  "quest:top_k=0.05,share_kv_group=true,device_select=chunked,pdl=true",
                                  "quest:top_k=0.05,pdl=true"])
def test_gpu_method_paths_do_not_sync_and_replay_in_a_graph(spec):
    """The method's device path with the switches: no host sync (CUDA's sync debug mode raises on one), a
    CUDA-graph replay equal to the eager call, the output near the reference path's."""
    m = kvsieve.method(spec)
    g = torch.Generator(device="cuda").manual_seed(1)
    n = 32768
    q = torch.randn(1, 32, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 8, n, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, 8, n, 128, device="cuda", generator=g).bfloat16()
    lengths = torch.full((1,), n, device="cuda", dtype=torch.int64)
    state = m.new_state()

    def step():  # as the runtime calls it: device lengths, no finiteness check (that check reads the device)
        return m.decode(q, k, v, lengths=lengths, state=state, check_finite=False)

    out, stats = step()
    assert stats.backend == "triton" and stats.extra["select"] == ("chunked" if "chunked" in spec else "triton")
    ref, _ = kvsieve.method(spec + ",backend=reference").decode(q, k, v)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-2
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = step()
    graph.replay()
    eager, _ = step()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
