"""variant=authors' step, second half (``kernels/sketchwalk/authors_walk.py``): its interpreter cases
(``sketchwalk_authors_walk_interpreter_cases.py``, in a subprocess with ``TRITON_INTERPRET=1``), the path's checks,
and the kernels compiled for the H100 (sm_90, no GPU needed)."""

from __future__ import annotations

import pytest
import torch
from interpreted import case_groups, group_id, run_interpreter_cases

from kvsieve.kernels.sketchwalk import authors_walk as aw

CASES = "sketchwalk_authors_walk_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_the_tail_follows_the_reference_over_steps",
                                              "test_the_selection_forms_equal_the_reference"), ids=group_id)
def test_the_walk_kernels_under_the_triton_interpreter(group):
    pytest.importorskip("triton")
    run_interpreter_cases(CASES, group)


@pytest.mark.parametrize("kw,word", [
    (dict(tail="rows"), "tail"), (dict(select="fast"), "select"), (dict(walk_dtype=torch.float64), "walk_dtype"),
    (dict(tail="chunked", walk_dtype=torch.bfloat16), "walk_dtype"), (dict(block_i=24), "block_i"),
    (dict(block_j=8), "block_j"),
])
def test_a_bad_path_names_its_field(kw, word):
    with pytest.raises(ValueError, match=word):
        aw.WalkPath(**kw)


def test_set_path_swaps_the_default_and_checks_its_argument():
    path = aw.WalkPath(tail="chunked", select="chunked")
    before = aw.set_path(path)
    try:
        assert aw.PATH is path
    finally:
        assert aw.set_path(before) is path
    with pytest.raises(ValueError, match="path"):
        aw.set_path("registers")


COMPILE_FOR_H100 = """
from kvsieve.kernels.sketchwalk import authors_walk as aw

f32 = "*fp32"
ptrs = dict(k_ptr="*bf16", lens_ptr="*i32", nq_ptr="*i64", pnq_ptr="*i64", plen_ptr="*i64", ksum_ptr=f32,
            pkp_ptr=f32, part_ptr=f32, r_ptr=f32, u_ptr=f32, uw_ptr=f32, sigma_ptr=f32, rsum_ptr=f32, nb_ptr="*i64",
            p_nb_ptr="*i64", p_row_ptr=f32, p_col_ptr=f32, p_rsum_ptr=f32, last_ptr="*i64", err_ptr="*i1",
            pin_ptr=f32, pout_ptr=f32, frac_ptr="*fp64", walk_ptr=f32, kept_ptr="*i8", pages_ptr="*i32",
            counts_ptr="*i32", wt_ptr="*i32", n_ptr="*i32", short_ptr="*i8")
for width, uw in ((2048, None), (2048, "*bf16"), (512, "*fp16"), (8192, "*bf16")):
    compile_(aw._row_tail_regs_kernel, {**ptrs, "uw_ptr": uw or f32},
             dict(HKV=8, BLOCK_D=128, BS=64, BLOCK_X=width, BLOCK_H=8, HAS_UW=uw is not None, PDL=True),
             floats=("eps",), num_warps=aw.regs_warps(width))
    compile_(aw._select_regs_kernel, ptrs, dict(BS=64, SPLITS_P=16, BLOCK_X=width, BLOCK_P=1024, PDL=True),
             floats=("q", "beta", "one_minus_beta"), num_warps=aw.regs_warps(width))
for u, block_i, block_j, warps in (("*bf16", 32, 256, 4), ("*fp16", 32, 256, 4), (f32, 128, 128, 8),
                                   ("*bf16", 128, 256, 8)):
    for first in (True, False):
        compile_(aw._walk_hop_kernel, {**ptrs, "u_ptr": u, "ue_ptr": u},
                 dict(FIRST=first, BS=64, SPLITS_P=16, BLOCK_I=block_i, BLOCK_J=block_j, EARLY=block_i == 128,
                      PDL=True), floats=("beta", "one_minus_beta"), num_warps=warps, num_stages=2)
print("COMPILED")
"""


@pytest.mark.triton
def test_the_register_kernels_compile_for_the_h100():
    """The registers tail (with and without the 16-bit copy, at 512 to 8,192 blocks), the registers selection and
    the hops over a 16-bit U or in one step of 128 rows (the benchmark's sweep) compile for sm_90 within the shared
    memory an H100 block has."""
    pytest.importorskip("triton")
    from interpreted import compile_for_sm90

    compile_for_sm90(COMPILE_FOR_H100)
