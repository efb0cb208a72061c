"""Triton kernels (dense split-KV, S²ANTA-flash, S²ANTA-prop) against their torch references, on
the CPU through Triton's interpreter.

The interpreter is picked when triton and the kernels are imported, so the cases
(``tests/triton_interpreter_cases.py``) run in a subprocess with ``TRITON_INTERPRET=1``; the variable
never leaks into other test modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from interpreted import case_groups, group_id, run_interpreter_cases

pytest.importorskip("triton")

pytestmark = pytest.mark.triton

HERE = Path(__file__).resolve().parent


CASES = "triton_interpreter_cases.py"


@pytest.mark.parametrize("group", case_groups(CASES, "test_kernels_match_references",
                                              "test_scheduled_paths_match_references",
                                              "test_kernel_mean_over_seeds_is_exact_attention"), ids=group_id)
def test_kernels_under_the_triton_interpreter(group):
    run_interpreter_cases(CASES, group)


def test_backend_triton_on_cpu_without_interpreter_is_a_clear_error():
    code = textwrap.dedent("""
        import torch, kvsieve
        q = torch.randn(1, 4, 64); k = torch.randn(1, 2, 32, 64); v = torch.randn(1, 2, 32, 64)
        try:
            kvsieve.method("santa-prop", backend="triton").decode(q, k, v, seed=0)
        except ValueError as e:
            print("ValueError:", e)
        _, stats = kvsieve.method("santa-prop", backend="auto").decode(q, k, v, seed=0)
        print("auto:", stats.backend)
    """)
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert "ValueError:" in res.stdout, res.stderr[-2000:]
    assert "TRITON_INTERPRET" in res.stdout
    assert "auto: reference" in res.stdout


def test_kernels_that_take_the_budget_keep_it_a_runtime_value():
    """Triton compiles an int argument equal to 1 as a constexpr, on which the budget arithmetic fails to
    compile (budget = 1 broke santa-prop on the GPU; the interpreter does not specialise, so only this
    check sees it): every kernel with a ``budget`` parameter must exclude it from specialisation."""
    code = textwrap.dedent("""
        from kvsieve.kernels.santa import fused, overlap, two_pass
        from triton.runtime.jit import JITFunction
        for module in (fused, overlap, two_pass):
            for name, fn in vars(module).items():
                if isinstance(fn, JITFunction) and name.endswith("_kernel"):
                    for p in fn.params:
                        if p.name == "budget":
                            print(name, p.do_not_specialize)
    """)
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    lines = res.stdout.split("\n")[:-1]
    assert res.returncode == 0 and len(lines) >= 5, res.stdout + res.stderr[-2000:]
    assert all(line.endswith(" True") for line in lines), res.stdout


def test_k_stream_probe_matches_the_shipped_stats_pass():
    """``benchmarks/santa_kernels/probe_k_stream.py`` (the K-stream bounds of docs/methods/santa-kernels.md) times
    a TMA form of the stats loop: its m, l and stash must equal the reference's tile statistics, or its times bound
    nothing."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "santa_kernels" / "probe_k_stream.py"),
                          "--check"],
                         cwd=HERE.parent, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "ok True" in res.stdout, res.stdout


def test_case_groups_run_every_case_function_once():
    from interpreted import case_groups

    groups = case_groups(CASES, "test_kernels_match_references", "test_default_path_by_size")
    names = [name for group in groups for name in group]
    text = (HERE / CASES).read_text()
    assert sorted(names) == sorted(set(names)) and len(names) == text.count("\ndef test_")
    assert groups[:2] == [("test_kernels_match_references",), ("test_default_path_by_size",)]
    with pytest.raises(ValueError, match="has no test functions"):
        case_groups(CASES, "test_no_such_case")
    split = case_groups(CASES, "test_kernels_match_references|flash")
    assert split[:2] == [("test_kernels_match_references|flash",), ("test_kernels_match_references|not (flash)",)]
    assert "test_kernels_match_references" not in split[2]


SPLIT_MERGE_FOR_H100 = """
from kvsieve.kernels.santa import split_merge as sm

for counts in (False, True):
    ptrs = dict(v_ptr="*bf16", lens_ptr="*i32", m_ptr="*fp32", l_ptr="*fp32", stash_ptr="*fp32", budgets_ptr="*i32",
                counts_ptr="*i32" if counts else "*fp32", scr_ptr="*i32", oacc_ptr="*fp32")
    compile_(sm._prop_sample_kernel, ptrs, dict(G=4, GP=4, BLOCK_G=16, D=128, TILE=256, R_MAX=16, FLASH=False,
                                           SPLIT_AT=256, DOT_PRECISION="tf32", WRITE_COUNTS=counts, FIX_BITS=22,
                                           WIDE=False, PDL=True))
compile_(sm._prop_merge_kernel, dict(oacc_ptr="*fp32", out_ptr="*bf16"), dict(D=128, PDL=True), num_warps=1)
print("COMPILED")
"""


MERGE_PDL_FOR_H100 = """
from kvsieve.kernels.shared import dense, triton_utils as tu, weighted_triton as wt

ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32",
            l_ptr="*fp32")
for block_n, warps, stages in ((64, 4, 3), (128, 8, 2)):
    compile_(dense._dense_split_kernel, ptrs, dict(G=8, BLOCK_G=16, D=128, BLOCK_N=block_n, DOT_PRECISION="tf32",
             PDL=True), floats=("scale_log2",), num_warps=warps, num_stages=stages)
ptrs.update({"idx_ptr": "*i64", "cnt_ptr": "*i64", "w_ptr": "*i64", "sink_lens_ptr": "*fp32", "sem_ptr": "*fp32",
             "out_ptr": "*bf16", "lse_ptr": "*fp32"})
compile_(wt._sparse_split_kernel, ptrs, dict(HEADS=4, G=4, BLOCK_G=16, D=128, BLOCK_N=64, PAGE=16, HAS_LENS=True,
         HAS_W=False, DOT_PRECISION="tf32", DOT_F32=False, FUSED_MERGE=False, HAS_SINK_LENS=False, PDL=True),
         floats=("scale_log2",), num_stages=2)
compile_(tu._merge_partials_kernel, {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "lens_ptr": "*i32",
         "out_ptr": "*bf16", "lse_ptr": "*fp32"}, dict(D_CHUNK=16, CHUNK_P=64, HAS_LENS=True, HAS_LSE=True,
         PDL=True))
print("COMPILED")
"""


def test_merges_with_programmatic_dependent_launch_compile_for_the_h100():
    """``triton_utils.MERGE_PDL``: the dense and sparse split launches let the merge launch early and the merge
    waits for them; compiled for sm_90 (the interpreter has no grid dependency control)."""
    from interpreted import compile_for_sm90

    compile_for_sm90(MERGE_PDL_FOR_H100)


def test_merge_pdl_wiring(monkeypatch):
    """With ``MERGE_PDL`` on a GPU that has it, the dense and sparse split launches are told to let dependents
    launch and their merge is launched with programmatic dependent launch and waits; off, neither (the launches
    recorded, not run)."""
    from kvsieve.kernels.shared import dense, triton_utils, weighted_triton

    seen = []

    def record(kernel, grid, *args, **meta):
        seen.append((kernel, meta))

    monkeypatch.setattr(triton_utils, "pdl_available", lambda: True)
    monkeypatch.setattr(weighted_triton, "unsupported_reason", lambda *a: None)  # CPU tensors: nothing runs
    for module in (dense, triton_utils, weighted_triton):
        monkeypatch.setattr(module, "launch", record)
    q = torch.randn(1, 8, 64)
    k = torch.randn(1, 2, 300, 64)
    lens = torch.tensor([300], dtype=torch.int32)
    for on in (False, True):
        monkeypatch.setattr(triton_utils, "MERGE_PDL", on)
        for split_kernel, call in (
                (dense._dense_split_kernel, lambda: dense.dense_decode_triton(q, k, k, lens, 0.125)),
                (weighted_triton._sparse_split_kernel,
                 lambda: weighted_triton.sparse_decode_triton(q, k, k, lengths=lens, sink=4, window=16))):
            seen.clear()
            call()
            (split, split_meta), (merge, merge_meta) = seen
            assert split is split_kernel and merge is triton_utils._merge_partials_kernel
            assert split_meta["PDL"] is on and merge_meta["PDL"] is on
            assert merge_meta.get("launch_pdl", False) is on and "launch_pdl" not in split_meta
    seen.clear()  # the sparse kernel's own merge (fused_merge) takes no second launch
    weighted_triton.sparse_decode_triton(q, k, k, lengths=lens, sink=4, window=16, fused_merge=True)
    assert len(seen) == 1 and seen[0][1]["PDL"] is False


def test_split_merge_kernels_compile_for_the_h100():
    """The interpreter neither type-checks untaken branches nor runs the 16-bit dots nor programmatic dependent
    launch: compiling santa-prop's sampling and merge launches for sm_90 (no GPU needed) does."""
    from interpreted import compile_for_sm90

    compile_for_sm90(SPLIT_MERGE_FOR_H100)
