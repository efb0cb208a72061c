"""The feature-major stats loop of the Bernoulli decode path (``kernels/bernoulli/decode.py``'s
``stream_stats``) against the float64 reference, and at other launch shapes against its default launch:
batch 8 with ragged lengths, several seeds, dtypes, launch shapes and head dims."""

from __future__ import annotations

import pytest
import torch
from interpreted import compile_for_sm90, printed_worst, run_script

STREAM_CASES = """
import torch
from kvsieve.core.rng import RandomKey
from kvsieve.kernels.bernoulli.decode import bernoulli_prop_reference, bernoulli_prop_triton
from kvsieve.kernels.bernoulli.feature_major import FeatureMajorKeys
device = "{device}"
bound = {{torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}}  # the output dtype's rounding
# (seed, B, Hkv, G, N, d, dtype, S, tile, draws, rounding, launch options)
cases = [(0, 8, 2, 4, 200, 64, torch.float32, 16, 32, 4, "largest-remainder", dict(block_n=16, stats_programs=40)),
         (1, 8, 1, 3, 150, 64, torch.float16, 32, 64, 8, "systematic",
          dict(block_n=32, stats_programs=1000, feature_block=32)),
         (2, 8, 2, 2, 120, 128, torch.float32, 8, 32, 2, "largest-remainder",
          dict(block_n=32, stats_programs=2, feature_block=64)),
         (3, 3, 2, 4, 97, 64, torch.float32, 16, 16, 4, "largest-remainder",
          dict(block_n=16, stats_programs=14, rows=0.5)),
         (4, 4, 2, 4, 180, 128, torch.float16, 24, 64, 8, "systematic",
          dict(feature_block=16, stats_programs=8, block_n=32, stats_stages=2))]
flips, worst, zero_seen, launches = 0, 0.0, False, 0
for seed, b, hkv, g, n, d, dtype, s, tile, draws, rounding, opts in cases:
    gen = torch.Generator().manual_seed(300 + seed)
    hq = hkv * g
    # queries with outlier features (draws skip the small ones); one KV group of one row all zero: no feature kept
    q = torch.randn(b, hq, d, generator=gen) * torch.rand(d, generator=gen) ** 3 * 4
    q[b - 1, :g] = 0
    q = q.to(dtype).to(device)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype).to(device)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype).to(device)
    lens = torch.randint(1, n + 1, (b,), generator=gen)
    lens[0] = n
    lens = lens.to(torch.int32).to(device)
    kt = FeatureMajorKeys().update(k, lens)
    rows = opts.pop("rows", None)
    extra = dict(k=k, row_above=rows) if rows is not None else {{}}
    key = RandomKey(40 + seed)
    ref, read = bernoulli_prop_reference(q.double(), k.double(), v.double(), lens, d ** -0.5, draws, s, tile, key,
                                         17 + seed, rounding=rounding)
    # the default launch but for the features per step (a float32 sum in another order may move a count on the GPU)
    default = dict(feature_block=opts.get("feature_block"))
    runs = [bernoulli_prop_triton(q, kt, v, lens, d ** -0.5, draws, s, tile, key, 17 + seed, rounding=rounding,
                                  write_counts=True, **launch, **extra) for launch in (default, opts)]
    launches += len(runs)
    for out, counts, budgets, n_feat in runs:
        assert torch.equal(n_feat.long(), read.sum(-1))
        assert (read.double().mean() < 1).item(), "the case should skip some features"
        zero_seen |= bool((n_feat == 0).any())
        assert (budgets.sum(-1) == s).all()
        flips += int((budgets.long() != ref.tile_budgets).sum()) + int((counts.long() != ref.counts).sum())
        # a flipped count moves one sample to a neighbouring key: compare the heads without one
        same = (counts.long() == ref.counts).all(-1) & (budgets.long() == ref.tile_budgets).all(-1)
        err = float((out.double() - ref.out)[same].norm() / ref.out[same].norm())
        worst = max(worst, err / bound[dtype])
    # programs, stages and keys per sub-block change no count: the same sums in the same order
    (out, counts, budgets, _), (out_l, counts_l, budgets_l, _) = runs
    assert torch.equal(counts, counts_l) and torch.equal(budgets, budgets_l)
    torch.testing.assert_close(out, out_l, rtol=1e-5, atol=1e-5)
assert zero_seen, "a unit without kept features should be in the cases"
print("FLIPS", flips, "RUNS", launches)
print("WORST", worst)
"""


@pytest.mark.triton
def test_streamed_stats_loop_matches_the_reference_under_the_interpreter():
    """Batch 8 with ragged lengths (a row of one key, rows ending inside a tile), a unit with no feature kept,
    several tiles per program and programs per unit, 16/32/64 features per step, d = 64 and 128, float32 and
    float16 (the interpreter's bfloat16 ``tl.dot`` is wrong: the GPU twin runs bfloat16), both roundings, and
    units on the cache rows beside it: the same counts and tile budgets as the float64 reference (no boundary
    flip on these cases), the output to the dtype's rounding, and at each case's launch shape the same counts,
    budgets and output as at the default launch with the same features per step."""
    pytest.importorskip("triton")
    out = run_script(STREAM_CASES, "cpu", True)
    assert int(out.split("FLIPS")[-1].split()[0]) == 0, out
    assert int(out.split("RUNS")[-1].split()[0]) == 10, out
    assert printed_worst(out) < 1.0, out  # relative error over the dtype's bound


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_streamed_stats_loop_matches_the_reference_on_the_gpu():
    out = run_script(STREAM_CASES.replace("torch.float16", "torch.bfloat16"), "cuda", False)
    assert int(out.split("FLIPS")[-1].split()[0]) <= 4, out  # float32 against float64 may move a floor boundary
    assert printed_worst(out) < 3.0, out


@pytest.mark.parametrize("change,match", [(dict(feature_block=48), "feature_block"),
                                          (dict(feature_block=8), "feature_block"),
                                          (dict(feature_block=128), "feature_block")])
def test_stats_launch_options_it_does_not_serve_are_clear_errors(change, match):
    pytest.importorskip("triton")
    from kvsieve.core.rng import RandomKey
    from kvsieve.kernels.bernoulli.decode import bernoulli_prop_triton

    q = torch.randn(1, 4, 64)
    kt = torch.randn(1, 2, 64, 256)
    v = torch.randn(1, 2, 200, 64)
    with pytest.raises(ValueError, match=match):
        bernoulli_prop_triton(q, kt, v, torch.tensor([200], dtype=torch.int32), 0.125, 4, 16, 32, RandomKey(1), 1,
                              **change)


OCCUPANCY = """
from kvsieve.kernels.bernoulli import decode as bd

pointers = dict(qest_ptr="*fp32", kt_ptr="*bf16", idx_ptr="*i32", nfeat_ptr="*i32", lens_ptr="*i32", m_ptr="*fp32",
                l_ptr="*fp32", stash_ptr="*fp32")
programs, stages, block, fb = bd.STATS_LAUNCH
meta = dict(G=4, BLOCK_G=16, D=128, TILE=256, BLOCK_N=block, FB=fb, SPLIT=True, PDL=True)
compiled = compile_(bd._feature_major_stats_kernel, pointers, meta, floats=("scale",), num_stages=stages,
                    aligned=set(pointers) | {"capacity", "s_kt_b", "s_kt_h", "s_kt_f"})
print("REGS", registers(compiled), "SHARED", compiled.metadata.shared, "PROGRAMS", programs)
print("COMPILED")
"""


@pytest.mark.triton
def test_streamed_stats_default_launch_is_one_wave():
    """Llama's shape (G = 4, d = 128, bf16) at the stats loop's default launch: registers and shared memory
    leave enough programs on each of the 132 SMs of an H100/H200 that the default program count is one wave
    (one program past a wave doubles the pass's time); a change that costs registers or shared memory (a select
    on the accumulator kept 166 live) would turn it into two waves."""
    pytest.importorskip("triton")
    out = compile_for_sm90(OCCUPANCY)
    regs, shared, programs = (int(out.split(tag)[1].split()[0]) for tag in ("REGS", "SHARED", "PROGRAMS"))
    per_sm = min(65536 // (-(-regs // 8) * 8 * 128), 233472 // (shared + 1024))  # registers, shared memory per SM
    assert per_sm >= 1 and programs <= 132 * per_sm, out
