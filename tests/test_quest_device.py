"""Quest's device path (page update, page bounds, selection, sparse attention): its kernels compiled for the
H100 (CPU, no GPU needed), and on a GPU (``gpu`` mark, skipped without CUDA) the method at the Llama-3.1-8B shape
without host sync, its CUDA-graph replays equal to eager calls.
"""

from __future__ import annotations

import pytest
import torch
from cuda_capture import warm_check_and_capture
from interpreted import compile_for_sm90

import kvsieve

# The interpreter does not type-check untaken branches, nor ask for shared memory: the device path's kernels
# compiled for the H100 at Quest's 128k shapes and launch settings (the register select has its own check in
# test_sparse_kernels.py).
COMPILE = r"""
from kvsieve.kernels.quest import quest_pages as qp
from kvsieve.kernels.shared import select_triton as st, triton_utils as tu, weighted_triton as wt

ptr = {"q_ptr": "*bf16", "kmin_ptr": "*bf16", "kmax_ptr": "*bf16", "lens_ptr": "*i32", "out_ptr": "*fp32",
       "counts_ptr": "*i64", "frac_ptr": "*fp64", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "mx_ptr": "*fp32"}
for share in (True, False):
    compile_(qp._page_bounds_kernel, ptr, dict(G=4, BLOCK_G=16, D=128, BLOCK_P=64, PAGE=16, MASK_DENSE=not share,
             WRITE_COUNTS=True, IS_FRAC=False, DOT_PRECISION="tf32", DOT_F32=False, WRITE_PARTS=share,
             WRITE_MAX=not share, GROUP_MAX=8, TILES=1), floats=("scale",), num_stages=1)
compile_(qp._page_update_kernel, {"k_ptr": "*bf16", "lens_ptr": "*i32", "done_ptr": "*i32", "kmin_ptr": "*bf16",
         "kmax_ptr": "*bf16"}, dict(PAGE=16, BLOCK=16, D=128), num_stages=1)
ptr = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
ptr.update({"idx_ptr": "*i64", "cnt_ptr": "*i64", "w_ptr": "*i64", "lens_ptr": "*i32", "sink_lens_ptr": "*fp32",
            "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "sem_ptr": "*fp32", "lse_ptr": "*fp32"})
compile_(wt._sparse_split_kernel, ptr, dict(HEADS=4, G=4, BLOCK_G=16, D=128, BLOCK_N=64, PAGE=16, HAS_LENS=True,
         HAS_W=False, DOT_PRECISION="tf32", DOT_F32=False, FUSED_MERGE=False, HAS_SINK_LENS=False, PDL=False),
         floats=("scale_log2",), num_stages=2)
compile_(tu._merge_partials_kernel, {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "lens_ptr": "*bf16",
         "out_ptr": "*bf16", "lse_ptr": "*fp32"}, dict(D_CHUNK=32, CHUNK_P=64, HAS_LENS=False, HAS_LSE=True,
         PDL=False), num_warps=1, num_stages=2)
ptr = {"s_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "cnt_ptr": "*i64", "lens_ptr": "*i32",
       "gs_ptr": "*fp32", "tk_ptr": "*i32", "out_ptr": "*i64", "mx_ptr": "*fp32", "cv_ptr": "*fp32", "ci_ptr": "*i32",
       "sn_ptr": "*i32", "sh_ptr": "*i32", "sl_ptr": "*i32", "cv2_ptr": "*fp32", "ci2_ptr": "*i32"}
compile_(st._group_sum_parts_kernel, {**ptr, "out_ptr": "*fp32"}, dict(G=4, BLOCK_G=4, UNIT=16, BLOCK_X=1024,
         CHUNK=512, BLOCK_PART=512, GROUP_MAX=8), num_stages=1)
compile_(st._topk_rows_kernel, ptr, dict(G=1, BLOCK_G=2, SHARE=False, UNIT=16, BLOCK_X=2048, BLOCK_XG=2048,
         BLOCK_PART=1024, PREFILTER=True, GROUP_MAX=8, BLOCK_M=1024, BLOCK_C=512, SEGMENTED=False),
         num_warps=8, num_stages=1)
for ticket in (True, False):  # a split row's candidates merged by its last program, or by the merge launch
    compile_(st._topk_rows_kernel, ptr, dict(G=1, BLOCK_G=2, SHARE=False, UNIT=1, BLOCK_X=4096, BLOCK_XG=4096,
             BLOCK_PART=1024, PREFILTER=True, GROUP_MAX=8, BLOCK_M=2048, BLOCK_C=4096, SEGMENTED=True, TICKET=ticket,
             BOUND_BITS=6 if ticket else 32),
             num_warps=8, num_stages=1)
compile_(st._merge_rows_kernel, ptr, dict(BLOCK_C=4096, BLOCK_X=1024), num_warps=8, num_stages=1)
from kvsieve.kernels.shared import select_split as ss
ptr = {"s_ptr": "*fp32", "mx_ptr": "*fp32", "cnt_ptr": "*i64", "hist_ptr": "*i32", "meta_ptr": "*i32",
       "cv_ptr": "*fp32", "ci_ptr": "*i32", "nc_ptr": "*i32", "out_ptr": "*i64"}
for chunk, block_p in ((128, 64), (512, 16), (1024, 2)):
    compile_(ss._split_hist_kernel, ptr, dict(CHUNK=chunk, BLOCK_M=1024, DIGIT_BITS=8), num_stages=1)
    compile_(ss._split_select_kernel, ptr, dict(CHUNK=chunk, DIGIT_BITS=8, BLOCK_P=block_p,
             CB=min(chunk, 2048 // block_p), HB=min(block_p, 32)), num_stages=1)
print("COMPILED")
"""


@pytest.mark.triton
def test_device_path_kernels_compile_for_the_h100():
    pytest.importorskip("triton")
    compile_for_sm90(COMPILE)


# --- GPU --------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("spec", ["quest:top_k=0.05,share_kv_group=true", "quest:top_k=0.05"])
def test_gpu_method_paths_do_not_sync_and_replay_in_a_graph(spec):
    """The method's device path at the Llama-3.1-8B shape: no host sync (CUDA's sync debug mode raises on one), a
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
    assert stats.backend == "triton"
    ref, _ = kvsieve.method(spec + ",backend=reference").decode(q, k, v)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-2
    _, graph, (captured, _) = warm_check_and_capture(step)
    graph.replay()
    eager, _ = step()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
