"""variant=authors' step, second half (``kernels/sketchwalk/authors_walk.py``): its interpreter cases
(``sketchwalk_authors_walk_interpreter_cases.py``, in a subprocess with ``TRITON_INTERPRET=1``), the launchers'
argument checks, and the kernels compiled for the H100 (sm_90, no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from interpreted import case_groups, group_id, run_interpreter_cases

from kvsieve.kernels.sketchwalk import authors_walk as aw

CASES = "sketchwalk_authors_walk_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_the_tail_follows_the_reference_over_steps",
                                              "test_the_selection_equals_the_reference"), ids=group_id)
def test_the_walk_kernels_under_the_triton_interpreter(group):
    pytest.importorskip("triton")
    run_interpreter_cases(CASES, group)


def meta_state(cap: int, **dtypes):
    """A state of meta tensors (no memory) with rows of ``cap`` blocks, float32 unless ``dtypes`` says."""
    names = ("u", "sigma", "rsum", "qs", "p_qs", "ks", "ksum", "p_kpart", "p_row", "p_col", "p_rsum", "phi")
    shapes = {"u": (1, cap, cap), "sigma": (1, cap), "rsum": (1, cap)}
    return SimpleNamespace(**{name: torch.empty(shapes.get(name, (1, 2)), device="meta",
                                                dtype=dtypes.get(name, torch.float32)) for name in names})


@pytest.mark.parametrize("st,kw,word", [
    (meta_state(aw.MAX_BLOCKS + 1), {}, "st.u: the kernels hold rows"),
    (meta_state(64, ksum=torch.float16), {}, "st.ksum: expected"), (meta_state(64), dict(degree=0), "degree: expected"),
    (meta_state(64), dict(splits=0), "splits: expected"),
    (meta_state(64), dict(r=torch.empty(1, 64, device="meta", dtype=torch.float16)), "r: expected"),
])
def test_a_bad_argument_is_named(st, kw, word):
    """Rows past the registers' width, a state tensor of another dtype, no hop, no split, a block row of another
    dtype: a ValueError naming it, before any launch."""
    cap = st.u.shape[-1]
    args = dict(beta=0.5, degree=2, sink=0.01, window=0.02, q=0.9, max_pages=4)
    r = kw.pop("r", torch.empty(1, cap, device="meta"))
    with pytest.raises(ValueError, match=word):
        aw.walk_select_triton(st, r, torch.empty(1, device="meta", dtype=torch.int32), **{**args, **kw})


COMPILE_FOR_H100 = """
from kvsieve.kernels.sketchwalk import authors_walk as aw

f32 = "*fp32"
ptrs = dict(k_ptr="*bf16", lens_ptr="*i32", nq_ptr="*i64", pnq_ptr="*i64", plen_ptr="*i64", ksum_ptr=f32,
            pkp_ptr=f32, part_ptr=f32, r_ptr=f32, u_ptr=f32, ue_ptr=f32, sigma_ptr=f32, rsum_ptr=f32, nb_ptr="*i64",
            p_nb_ptr="*i64", p_row_ptr=f32, p_col_ptr=f32, p_rsum_ptr=f32, last_ptr="*i64", err_ptr="*i1",
            pin_ptr=f32, pout_ptr=f32, frac_ptr="*fp64", walk_ptr=f32, kept_ptr="*i8", pages_ptr="*i32",
            counts_ptr="*i32", wt_ptr="*i32", n_ptr="*i32", short_ptr="*i8")
for width in (512, 2048, aw.MAX_BLOCKS):
    compile_(aw._row_tail_kernel, ptrs, dict(HKV=8, BLOCK_D=128, BS=64, BLOCK_X=width, BLOCK_H=8, PDL=True),
             floats=("eps",), num_warps=aw.row_warps(width))
    compile_(aw._select_kernel, ptrs, dict(BS=64, SPLITS_P=16, BLOCK_X=width, BLOCK_P=1024, PDL=True),
             floats=("q", "beta", "one_minus_beta"), num_warps=aw.row_warps(width))
for first in (True, False):
    for early in (True, False):
        compile_(aw._walk_hop_kernel, ptrs, dict(FIRST=first, BS=64, SPLITS_P=16, BLOCK_I=aw.HOP_ROWS,
                                                 BLOCK_J=aw.HOP_COLS, EARLY=early, PDL=True),
                 floats=("beta", "one_minus_beta"), num_warps=aw.HOP_WARPS, num_stages=2)
print("COMPILED")
"""


@pytest.mark.triton
def test_the_walk_kernels_compile_for_the_h100():
    """The tail and the selection (rows of 512 to ``MAX_BLOCKS`` blocks) and the hops (first and later, read early
    or in a loop of steps) compile for sm_90 within the shared memory an H100 block has, with programmatic
    dependent launch."""
    pytest.importorskip("triton")
    from interpreted import compile_for_sm90

    compile_for_sm90(COMPILE_FOR_H100)
