"""The S²ANTA stats passes' stream switches (``santa/common.py``: ``StreamHints``): their interpreter cases
(``santa_stream_interpreter_cases.py``, in a subprocess with ``TRITON_INTERPRET=1``), the switches' checks, the
sm_90 compile of the candidates (the hints reach the PTX; v10's batched release is one fence before relaxed adds)
and the stream benchmark's CPU check."""

from __future__ import annotations

import pytest
from interpreted import case_groups, compile_for_sm90, group_id, run_interpreter_cases, run_script

pytest.importorskip("triton")

CASES = "santa_stream_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_candidates_equal_the_current_path",
                                              "test_candidates_draw_the_reference"), ids=group_id)
def test_stream_candidates_under_the_triton_interpreter(group):
    run_interpreter_cases(CASES, group)


def test_stream_hints_default_to_the_current_path_and_name_bad_fields():
    from kvsieve.kernels.santa import common

    assert common.STREAM == common.StreamHints()
    assert common.stream_meta(None) == dict(K_EVICT="", STASH_CACHE="", STASH_EVICT="")
    assert common.stream_hints(common.StreamHints(release_every=4)).release_every == 4
    for bad, field in ((common.StreamHints(k_eviction="first"), "stream.k_eviction"),
                       (common.StreamHints(stash_cache=".ca"), "stream.stash_cache"),
                       (common.StreamHints(stash_eviction="evict_normal"), "stream.stash_eviction"),
                       (common.StreamHints(release_every=0), "stream.release_every"),
                       (common.StreamHints(balanced_rounds=1), "stream.balanced_rounds"),
                       ({"k_eviction": "evict_first"}, "stream:")):
        with pytest.raises(ValueError, match=field):
            common.stream_hints(bad)


@pytest.mark.triton
def test_stream_candidates_compile_for_sm90():
    """v10's stats kernel with every switch on and v8's with the K hint compile for sm_90 within the shared-memory
    limit; the K loads carry an L2 evict-first policy, the stash stores evict-last, and the batched release is a
    predicated ``fence.acq_rel.gpu`` placed after the tile's stash stores and before relaxed counter adds (no
    release atomic left); prop's sampling kernel compiles with the lazy stash read."""
    out = compile_for_sm90("""
from kvsieve.kernels.santa import overlap, two_pass
P = {n: "*fp32" for n in ("m_ptr", "l_ptr", "stash_ptr", "mstar_ptr")}
P.update(q_ptr="*bf16", k_ptr="*bf16", lens_ptr="*i32", sync_ptr="*i32")
meta = dict(G=4, BLOCK_G=16, D=128, TILE=256, BLOCK_N=128, DOT_PRECISION="ieee", TRACK_MAX=False, PDL=True,
            K_EVICT="evict_first", STASH_CACHE="", STASH_EVICT="evict_last")
aligned = ("q_ptr", "k_ptr", "stash_ptr", "s_k_b", "s_k_h", "s_k_n", "s_u_b", "s_u_h")
ptx = compile_(overlap._ordered_stats_kernel, P, dict(meta, THREADS=128, BLOCK_B=8, RELEASE_EVERY=2, FENCE=True),
               floats=("scale",), num_warps=4, num_stages=2, aligned=aligned).asm["ptx"]
assert "cp.async.cg.shared.global.L2::cache_hint" in ptx and "L2::evict_first" in ptx, "K hint"
assert "L2::evict_last" in ptx, "stash hint"
fence = ptx.index("fence.acq_rel.gpu")
assert ".release" not in ptx, "a release atomic is left"
assert ptx.count("red.global.gpu.relaxed.add") == 2 and ptx.index("red.global.gpu.relaxed.add") > fence
assert ptx.rindex("st.global.L1::evict_last") < fence, "a stash store after the fence"
ptx = compile_(two_pass._tile_stats_kernel, P, dict(meta, STASH_EVICT=""), floats=("scale",), num_warps=4,
               num_stages=2, aligned=aligned).asm["ptx"]
assert "L2::evict_first" in ptx and "L2::evict_last" not in ptx
from kvsieve.kernels.santa import split_merge
S = {n: "*fp32" for n in ("m_ptr", "l_ptr", "stash_ptr", "oacc_ptr")}
S.update(v_ptr="*bf16", lens_ptr="*i32", budgets_ptr="*i32", counts_ptr="*i32", scr_ptr="*i32")
sample = dict(G=4, GP=4, BLOCK_G=16, D=128, TILE=256, R_MAX=16, FLASH=False, SPLIT_AT=256, DOT_PRECISION="ieee",
              WRITE_COUNTS=False, FIX_BITS=21, WIDE=False, PDL=True)
lazy = compile_(split_merge._prop_sample_kernel, S, dict(sample, LAZY_STASH=True), num_warps=4).asm["ptx"]
eager = compile_(split_merge._prop_sample_kernel, S, dict(sample, LAZY_STASH=False), num_warps=4).asm["ptx"]
assert lazy != eager
print("COMPILED")
""")
    assert "COMPILED" in out


@pytest.mark.triton
def test_stream_benchmark_check_runs():
    """``benchmarks/breakdown/santa_stream.py --check``: every candidate of both paths equals the current path."""
    out = run_script("import sys, runpy; sys.argv = ['santa_stream.py', '--check']; "
                     "runpy.run_path('benchmarks/breakdown/santa_stream.py', run_name='__main__')",
                     device="cpu", interpret=True)
    assert "check: ok" in out


def test_stream_benchmark_parses_its_cases():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "santa_stream", Path(__file__).resolve().parents[1] / "benchmarks" / "breakdown" / "santa_stream.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_cases("131072:1,32768:8") == [(131072, 1), (32768, 8)]
    with pytest.raises(ValueError, match="--cases"):
        mod.parse_cases("131072x1")
    assert set(mod.variants("split")) < set(mod.variants("overlap"))
    assert all(h.release_every == 1 and not h.balanced_rounds for h in mod.variants("split").values())
