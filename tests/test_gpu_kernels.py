"""The Triton kernels against their float64 references on a CUDA GPU (marked ``gpu``; skipped without one).

Every form of the default path (v8 two-pass, the fused flash kernel, v10 with programmatic dependent launch
where the GPU has it) in bf16, fp16 and fp32 on random data: batch rows of different lengths (down to one
key), GQA groups 1/3/4, head dims 64/128, N not a multiple of the tile, N < S, one tile, many tiles,
counts above what a 16-bit dot holds; the entry points at the Llama-3.1-8B shape at 32k and 128k keys
(where v10 is the default on Hopper); budget 1; unbiasedness over seeds. Counts and tile budgets are
compared with the reference fed the kernels' uniforms: on the GPU scores are float32 (float64 in the
reference), so a count may flip at a floor boundary (measured: at most 1e-4 of keys); outputs within the
dtype's rounding. The interpreter tests (``tests/triton_interpreter_cases.py``) check the same forms
exactly, on the CPU, in fp16/fp32 without PDL.

    pytest -m gpu tests/test_gpu_kernels.py
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-4}
FLIPS = 1e-3  # largest fraction of keys whose count may differ from the reference's (floor-boundary flips)


def _case(b, hq, hkv, n, d, lens, dtype, seed, peaked=1.5):
    from kvsieve.core.inputs import check_decode_inputs

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(b, hq, d, device="cuda", generator=g) * peaked).to(dtype)
    k = torch.randn(b, hkv, n, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hkv, n, d, device="cuda", generator=g).to(dtype)
    lens_t = torch.tensor(lens, device="cuda", dtype=torch.int64)
    inputs = check_decode_inputs(q.double(), k.double(), v.double(), lengths=lens_t)
    return q, k, v, lens_t.to(torch.int32), inputs


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _references(inputs, seed, s, tile):
    from kvsieve.kernels.santa.reference import santa_flash_reference, santa_prop_reference
    from kvsieve.kernels.shared.triton_utils import budget_uniforms, tile_uniforms

    b, hq, n = inputs.batch, inputs.heads, inputs.n_keys
    tile_u = tile_uniforms(seed, b, hq, -(-n // tile), inputs.lengths, device="cuda")
    scores = inputs.scores(torch.float64)
    refs = {"flash": santa_flash_reference(scores, inputs.v, s, tile, tile_offsets=tile_u)}
    for rounding in ("largest-remainder", "systematic"):
        refs[rounding] = santa_prop_reference(scores, inputs.v, s, tile, rounding=rounding, tile_offsets=tile_u,
                                              budget_offset=budget_uniforms(seed, b, hq, inputs.lengths, device="cuda"))
    return refs


def _assert_workspace_clean(q):
    """The folded merge and v10's sync words are left as the next call expects them."""
    from kvsieve.kernels.shared.triton_utils import workspace

    for tag, dtype in (("fold_acc", torch.float32), ("fold_den", torch.float32), ("fold_done", torch.int32),
                       ("overlap_sync", torch.int32)):
        assert not workspace(tag, q, 1, dtype, zeroed=True).any(), tag
    assert (workspace("mstar", q, 1, torch.float32, fill=float("-inf")) == float("-inf")).all()


def _check_flash(run, q, k, v, lens, scale, s, tile, seed, ref, dtype):
    out = torch.full(q.shape, float("nan"), device="cuda", dtype=dtype)
    _, counts = run(q, k, v, lens, scale, s, tile, seed, write_counts=True, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert float((counts.long() != ref.counts).double().mean()) < FLIPS
    _assert_close_where_no_flip(out, ref.out, counts.long() == ref.counts, dtype)
    _assert_workspace_clean(q)


def _assert_close_where_no_flip(out, ref_out, same_counts, dtype):
    """Heads whose counts (and budgets) all equal the reference's agree to the dtype's rounding. A flipped
    count moves one sample to a neighbouring key, an error of order 1/sqrt(S) of a flat head's output
    (0.0202 at bf16, G4, N4113, S128 after the length-keyed draws, against 0.012 before): the flips are
    bounded by their own check above, the arithmetic by this one."""
    same = same_counts.all(-1)
    assert _rel(out[same], ref_out[same]) < TOL[dtype]


def _check_prop(run, q, k, v, lens, scale, s, tile, seed, ref, rounding, dtype):
    out = torch.full(q.shape, float("nan"), device="cuda", dtype=dtype)
    _, counts, budgets = run(q, k, v, lens, scale, s, tile, seed, rounding=rounding, write_counts=True, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert (budgets.sum(-1) == s).all()
    assert float((budgets.long() != ref.tile_budgets).double().mean()) < FLIPS
    assert float((counts.long() != ref.counts).double().mean()) < FLIPS
    assert (counts.sum(-1) == s).all()
    _assert_close_where_no_flip(out, ref.out, (counts.long() == ref.counts) & (budgets.long() == ref.tile_budgets)
                                .all(-1, keepdim=True), dtype)
    _assert_workspace_clean(q)


# (B, Hq, Hkv, N, d, lens, S, tile)
SHAPES = [
    (1, 32, 8, 4096 + 17, 128, [4096 + 17], 128, 256),
    (1, 32, 8, 20000, 128, [20000], 2048, 256),
    (2, 32, 8, 9000, 128, [9000, 5000], 256, 256),
    (3, 9, 3, 3000, 64, [3000, 1, 2047], 64, 64),       # ragged down to one key
    (2, 9, 3, 700, 64, [700, 333], 1024, 32),           # N < S
    (1, 8, 8, 1000, 128, [1000], 128, 32),              # G = 1
    (2, 12, 4, 200, 64, [200, 150], 16, 256),           # one tile
    (1, 16, 4, 70000, 128, [70000], 128, 256),          # many tiles
    (1, 16, 4, 5000, 64, [5000], 4096, 256),            # counts above 256 per key (bf16 dots split them)
    (4, 32, 8, 16384, 128, [16384, 12000, 8192, 1], 128, 256),  # ragged batch at the Llama shape
]
CASES = ([(i, torch.bfloat16) for i in range(len(SHAPES))]
         + [(i, dt) for i in (3, 8) for dt in (torch.float16, torch.float32)])




def _case_id(case) -> str:
    index, dtype = case
    b, hq, hkv, n, d, _, s, tile = SHAPES[index]
    return f"{str(dtype)[6:]}-B{b}-G{hq // hkv}-N{n}-d{d}-S{s}-t{tile}"


@pytest.mark.parametrize(("index", "dtype"), CASES, ids=[_case_id(c) for c in CASES])
def test_every_form_matches_the_references(index, dtype):
    from kvsieve.kernels.santa.fused import santa_flash_fused
    from kvsieve.kernels.santa.overlap import santa_flash_overlap, santa_prop_overlap
    from kvsieve.kernels.santa.split_merge import santa_prop_split
    from kvsieve.kernels.santa.two_pass import santa_flash_two_pass, santa_prop_two_pass
    from kvsieve.kernels.shared.dense import dense_decode_triton
    from kvsieve.methods.shared.exact import exact_attention

    b, hq, hkv, n, d, lens, s, tile = SHAPES[index]
    seed = 1000 + index
    q, k, v, lens32, inputs = _case(b, hq, hkv, n, d, lens, dtype, seed)
    scale = d ** -0.5
    out = torch.full((b, hq, d), float("nan"), device="cuda", dtype=dtype)
    dense_decode_triton(q, k, v, lens32, scale, out=out)
    assert _rel(out, exact_attention(inputs)) < TOL[dtype]
    refs = _references(inputs, seed, s, tile)
    for run in (santa_flash_two_pass, santa_flash_fused, santa_flash_overlap):
        _check_flash(run, q, k, v, lens32, scale, s, tile, seed, refs["flash"], dtype)
    for rounding in ("largest-remainder", "systematic"):
        for run in (santa_prop_two_pass, santa_prop_overlap, santa_prop_split):
            _check_prop(run, q, k, v, lens32, scale, s, tile, seed, refs[rounding], rounding, dtype)


@pytest.mark.parametrize("n", [32768, 131072], ids=["32k", "128k"])
def test_entry_points_at_the_llama_shape(n):
    """The path a caller gets (flash: v10 on Hopper from 32k; prop: v8 with the merge launch from 64k), twice
    in a row."""
    from kvsieve.kernels.santa.decode import flash_path, prop_path, santa_flash_triton, santa_prop_triton

    q, k, v, lens32, inputs = _case(1, 32, 8, n, 128, [n], torch.bfloat16, 7, peaked=1.0)
    refs = _references(inputs, 3, 128, 256)
    flash_refs = _references(inputs, 3, 2048, 256)["flash"]
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert flash_path(k, 256) == ("overlap" if hopper else "two-pass")
    assert prop_path(k, 256) == ("split" if n >= 65536 else "two-pass")
    for _ in range(2):
        _check_flash(santa_flash_triton, q, k, v, lens32, 128 ** -0.5, 2048, 256, 3, flash_refs, torch.bfloat16)
        for rounding in ("largest-remainder", "systematic"):
            _check_prop(santa_prop_triton, q, k, v, lens32, 128 ** -0.5, 128, 256, 3, refs[rounding], rounding,
                        torch.bfloat16)


def test_budget_one():
    """Triton compiles an int argument equal to 1 as a constant; the kernels keep the budget a runtime value."""
    from kvsieve.kernels.santa.fused import santa_flash_fused
    from kvsieve.kernels.santa.overlap import santa_flash_overlap, santa_prop_overlap
    from kvsieve.kernels.santa.split_merge import santa_prop_split
    from kvsieve.kernels.santa.two_pass import santa_flash_two_pass, santa_prop_two_pass

    q, k, v, lens32, _ = _case(2, 32, 8, 32768, 128, [32768, 20000], torch.bfloat16, 5)
    for run in (santa_prop_two_pass, santa_prop_overlap, santa_prop_split):
        out, counts, budgets = run(q, k, v, lens32, 128 ** -0.5, 1, 256, 0, write_counts=True)
        assert torch.isfinite(out).all() and (counts.sum(-1) == 1).all() and (budgets.sum(-1) == 1).all()
    for run in (santa_flash_two_pass, santa_flash_fused, santa_flash_overlap):
        out, counts = run(q, k, v, lens32, 128 ** -0.5, 1, 256, 0, write_counts=True)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and (counts > 0).any()


@pytest.mark.parametrize("kernel", ["flash", "prop-systematic"])
def test_mean_over_seeds_is_exact_attention(kernel):
    """Unbiasedness: over 512 seeds (fp32) each coordinate's z of the mean against exact attention has
    E[z²] = 1; the mean of z² over the 512 coordinates has a standard error of about sqrt(2/512)."""
    from kvsieve.kernels.santa.decode import santa_flash_triton, santa_prop_triton
    from kvsieve.methods.shared.exact import exact_attention

    seeds, n, d = 512, 3000, 64
    q, k, v, lens32, inputs = _case(1, 8, 2, n, d, [n], torch.float32, 7, peaked=2.0)
    exact = exact_attention(inputs)
    if kernel == "flash":
        outs = [santa_flash_triton(q, k, v, lens32, d ** -0.5, 256, 64, sd)[0] for sd in range(seeds)]
    else:
        outs = [santa_prop_triton(q, k, v, lens32, d ** -0.5, 64, 64, sd, rounding="systematic")[0]
                for sd in range(seeds)]
    outs = torch.stack(outs).double()
    z = (outs.mean(0) - exact) / (outs.std(0) / math.sqrt(seeds))
    assert abs(float((z**2).mean()) - 1.0) < 5 * math.sqrt(2 / z.numel())
