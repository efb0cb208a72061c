"""Kernel-vs-reference cases run under Triton's interpreter (CPU). Not collected on its own: the
interpreter must be chosen before triton is imported, so ``tests/test_kernels_triton.py`` runs this
file in a subprocess with ``TRITON_INTERPRET=1``; other test modules never see that variable.

bfloat16 is not exercised here because the interpreter's ``tl.dot`` mishandles it; the ``gpu`` tests
(tests/test_gpu_kernels.py) check it on the device.
"""

from __future__ import annotations

import math
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_kernels_triton.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

from kvsieve import CallContext  # noqa: E402
from kvsieve.kernels.santa import decode  # noqa: E402
from kvsieve.kernels.santa.fused import santa_flash_fused  # noqa: E402
from kvsieve.kernels.santa.overlap import santa_flash_overlap, santa_prop_overlap  # noqa: E402
from kvsieve.kernels.santa.split_merge import santa_prop_split  # noqa: E402
from kvsieve.kernels.santa.two_pass import santa_flash_two_pass, santa_prop_two_pass  # noqa: E402
from kvsieve.kernels.shared import dense as triton_dense  # noqa: E402
from kvsieve.kernels.shared import triton_utils  # noqa: E402

pytestmark = pytest.mark.triton

import kvsieve  # noqa: E402
from kvsieve.core.inputs import check_decode_inputs  # noqa: E402
from kvsieve.kernels.santa.reference import (  # noqa: E402
    santa_flash_reference,
    santa_prop_reference,
)
from kvsieve.methods.shared.exact import exact_attention  # noqa: E402


def _case(b, hq, hkv, n, d, lens, dtype, seed, peaked=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g, dtype=torch.float64) * peaked).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    inputs = check_decode_inputs(q.double(), k.double(), v.double(), lengths=lens_t)
    return q, k, v, lens_t.to(torch.int32), inputs


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _poisoned(b, hq, d, dtype):
    return torch.full((b, hq, d), float("nan"), dtype=dtype)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3}

# (B, Hq, Hkv, N, d, lens, S, tile, dtype): GQA groups 1/3/4, d 64/128, N not a multiple of the tile,
# N < S, one tile, ragged lengths (down to one key).
CASES = [
    (2, 6, 2, 300, 64, [300, 150], 16, 32, torch.float32),
    (1, 8, 2, 200, 128, [200], 64, 64, torch.float16),
    (2, 2, 2, 100, 64, [100, 37], 8, 32, torch.float32),
    (2, 3, 1, 40, 64, [40, 1], 128, 32, torch.float32),
    (1, 4, 1, 20, 64, [20], 8, 32, torch.float16),
]


def _case_id(c):
    return f"B{c[0]}-H{c[1]}-G{c[1] // c[2]}-N{c[3]}-d{c[4]}-S{c[6]}-t{c[7]}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernels_match_references(case):
    b, hq, hkv, n, d, lens, s, tile, dtype = case
    seed = 1234 + n
    q, k, v, lens32, inputs = _case(b, hq, hkv, n, d, lens, dtype, seed)
    scale = d ** -0.5
    t = -(-n // tile)
    tile_u = triton_utils.tile_uniforms(seed, b, hq, t, lens32)

    out = _poisoned(b, hq, d, dtype)
    triton_dense.dense_decode_triton(q, k, v, lens32, scale, block_n=16, out=out)
    assert torch.isfinite(out).all()
    assert _rel(out, triton_dense.dense_decode_reference(q, k, v, lens32, scale)) < TOL[dtype]
    assert _rel(triton_dense.dense_decode_reference(q, k, v, lens32, scale), exact_attention(inputs)) < 1e-12

    ref = santa_flash_reference(inputs.scores(torch.float64), inputs.v, s, tile, tile_offsets=tile_u)
    # every form of the default path: v8 (stats + compacted sampling, merge folded; one or several gather
    # steps per tile), the fused kernel, v10 (stats in unit order, then the sampling kernel; without
    # programmatic dependent launch here, so its waits find their units ready)
    two_pass = {"block_n": 16, "stats_programs": 2}
    for run, opts in ((santa_flash_two_pass, two_pass), (santa_flash_two_pass, {**two_pass, "r_max": 16}),
                      (santa_flash_fused, {"block_n": 16}), (santa_flash_overlap, two_pass)):
        out = _poisoned(b, hq, d, dtype)
        _, counts = run(q, k, v, lens32, scale, s, tile, seed, write_counts=True, out=out, **opts)
        assert torch.isfinite(out).all()
        assert torch.equal(counts.long(), ref.counts)
        assert _rel(out, ref.out) < TOL[dtype]
        _assert_fold_workspace_clean(q)

    for rounding in ("largest-remainder", "systematic"):
        ref = santa_prop_reference(inputs.scores(torch.float64), inputs.v, s, tile, rounding=rounding,
                                   budget_offset=triton_utils.budget_uniforms(seed, b, hq, lens32), tile_offsets=tile_u)
        # v8 (one or several gather steps), v8 with the merge launch, v10
        for run, opts in ((santa_prop_two_pass, two_pass), (santa_prop_two_pass, {**two_pass, "r_max": 16}),
                          (santa_prop_split, two_pass), (santa_prop_overlap, two_pass)):
            out = _poisoned(b, hq, d, dtype)
            _, counts, budgets = run(q, k, v, lens32, scale, s, tile, seed, rounding=rounding, write_counts=True,
                                     out=out, **opts)
            assert torch.isfinite(out).all()
            assert (budgets.sum(-1) == s).all()
            assert torch.equal(budgets.long(), ref.tile_budgets)
            assert torch.equal(counts.long(), ref.counts)
            assert _rel(out, ref.out) < TOL[dtype]
            _assert_fold_workspace_clean(q)


def _assert_fold_workspace_clean(q):
    """The folded merge leaves its accumulators and counters zero, the global maxima -inf, and the
    overlapped passes their sync words zero, for the next call."""
    assert not triton_utils.workspace("fold_acc", q, 1, torch.float32).any()
    assert not triton_utils.workspace("overlap_sync", q, 1, torch.int32, zeroed=True).any()
    assert not triton_utils.workspace("fold_den", q, 1, torch.float32).any()
    assert not triton_utils.workspace("fold_done", q, 1, torch.int32).any()
    mstar = triton_utils.workspace("mstar", q, 1, torch.float32, fill=float("-inf"))
    assert (mstar == float("-inf")).all()


# the path that schedules its work itself: v10's stats programs (1 to as many as tiles, 30 here; 7 and 13
# leave the last round partial)
OVERLAP_VARIANTS = [{"stats_programs": p} for p in (1, 7, 13, 30)]


@pytest.mark.parametrize("flash", [False, True], ids=["prop", "flash"])
def test_scheduled_paths_match_references(flash):
    """v10 (stats in unit order, the sampling kernel waiting per unit and claiming each head's budgets
    once) gives the references' budgets and counts for every work order, on ragged rows with peaked
    attention (units whose tiles get no samples), twice in a row (its sync words must be back at zero)."""
    rounding, variants = "systematic", OVERLAP_VARIANTS
    b, hq, hkv, n, d, s, tile = 3, 6, 2, 160, 64, 24, 32  # 5 tiles of 2 sub-blocks per (row, KV head)
    q, k, v, lens32, inputs = _case(b, hq, hkv, n, d, [160, 9, 100], torch.float32, 41, peaked=4.0)
    seed = 5
    t = n // tile
    tile_u = triton_utils.tile_uniforms(seed, b, hq, t, lens32)
    if flash:
        ref = santa_flash_reference(inputs.scores(torch.float64), inputs.v, s, tile, tile_offsets=tile_u)
    else:
        ref = santa_prop_reference(inputs.scores(torch.float64), inputs.v, s, tile, rounding=rounding,
                                   budget_offset=triton_utils.budget_uniforms(seed, b, hq, lens32), tile_offsets=tile_u)
    for opts in variants:
        for _ in range(2):
            out = _poisoned(b, hq, d, torch.float32)
            common = {"write_counts": True, "block_n": 16, "out": out, **opts}
            if flash:
                (_, counts), budgets = santa_flash_overlap(q, k, v, lens32, d ** -0.5, s, tile, seed, **common), None
            else:
                _, counts, budgets = santa_prop_overlap(q, k, v, lens32, d ** -0.5, s, tile, seed, rounding=rounding,
                                                        **common)
            assert torch.equal(counts.long(), ref.counts), opts
            if not flash:
                assert torch.equal(budgets.long(), ref.tile_budgets), opts
            assert _rel(out, ref.out) < TOL[torch.float32], opts
            _assert_fold_workspace_clean(q)


@pytest.mark.parametrize("flash", [False, True], ids=["prop", "flash"])
def test_default_path_by_size(flash, monkeypatch):
    """flash: v10 from a count of tiles in all (rows × KV heads × tiles) where programmatic dependent launch
    is on (faked here; the path itself then runs without it); below the count, or without it, v8, and the
    fused kernel up to FLASH_FUSED_MAX_TILES tiles per head. prop: v8 with the merge launch and the wide stats
    launch from its count of tiles in all and PROP_SPLIT_MIN_HEAD_TILES per head, v10 above the count with fewer
    per head where PDL is on (the merge-launch path without it); v8 below the count. The entry point runs the
    path named."""
    kind = "flash" if flash else "prop"
    functions = {"two-pass": f"santa_{kind}_two_pass"}
    functions.update({"overlap": "santa_flash_overlap", "fused": "santa_flash_fused"} if flash
                     else {"split": "santa_prop_split", "overlap": "santa_prop_overlap"})
    calls = []
    for path, name in functions.items():
        real = getattr(decode, name)

        def spy(*args, _real=real, _path=path, **kwargs):
            if _path == "split":
                assert all(kwargs.get(key) == value for key, value in decode.PROP_WIDE_STATS.items()), kwargs
            calls.append(_path)
            return _real(*args, **kwargs)
        monkeypatch.setattr(decode, name, spy)
    monkeypatch.setattr(decode, "FLASH_OVERLAP_MIN_TILES", 8)
    monkeypatch.setattr(decode, "PROP_WIDE_MIN_TILES", 8)
    monkeypatch.setattr(decode, "PROP_SPLIT_MIN_HEAD_TILES", 4)
    monkeypatch.setattr(decode, "FLASH_FUSED_MAX_TILES", 2)
    hq, hkv, d, tile = 4, 2, 64, 16
    small = "fused" if flash else "two-pass"
    above = ("overlap", "two-pass") if flash else ("split", "split")  # with, without PDL
    # prop below PROP_SPLIT_MIN_HEAD_TILES tiles per head but above the count in all: v10 with PDL
    few_per_head = "overlap"
    # (rows, keys, PDL, path): 2 KV heads × 4 tiles = 8 tiles in all; 6 below the count; batch 2 above it again
    # with 3 tiles per head
    for b, n, pdl, expected in ((1, 64, True, above[0]), (1, 48, True, "two-pass"), (2, 48, True, few_per_head),
                                (1, 64, False, above[1]), (1, 32, False, small), (1, 32, True, small)):
        monkeypatch.setattr(decode, "pdl_available", lambda pdl=pdl: pdl)
        q, k, v, lens32, _ = _case(b, hq, hkv, n, d, [n] * b, torch.float32, 3)
        calls.clear()
        run = decode.santa_flash_triton if flash else decode.santa_prop_triton
        run(q, k, v, lens32, d ** -0.5, 8, tile, 1, out=_poisoned(b, hq, d, torch.float32))
        assert calls == [expected], (b, n, pdl, calls)
        assert (decode.flash_path if flash else decode.prop_path)(k, tile) == expected


def test_workspace_is_reused_and_grows():
    x = torch.zeros(1)
    a = triton_utils.workspace("test_ws", x, 100, torch.float32)
    assert triton_utils.workspace("test_ws", x, 80, torch.float32).data_ptr() == a.data_ptr()
    b = triton_utils.workspace("test_ws", x, 101, torch.float32)
    assert b.numel() >= 101 + 101 // 8 - 1 and b.data_ptr() != a.data_ptr()
    z = triton_utils.workspace("test_ws_zero", x, 50, torch.int32, zeroed=True)
    assert z.numel() == 50 and not z.any()


def test_prop_skips_tiles_without_budget():
    """Peaked attention leaves most tiles without samples: they read no V row and add nothing."""
    b, hq, hkv, n, d, s, tile = 1, 4, 1, 256, 64, 8, 16
    q, k, v, lens32, inputs = _case(b, hq, hkv, n, d, [n], torch.float32, 5, peaked=6.0)
    seed = 77
    t = n // tile
    _, counts, budgets = decode.santa_prop_triton(q, k, v, lens32, d ** -0.5, s, tile, seed, write_counts=True)
    assert (budgets == 0).any()
    ref = santa_prop_reference(inputs.scores(torch.float64), inputs.v, s, tile, rounding="largest-remainder",
                               budget_offset=triton_utils.budget_uniforms(seed, b, hq, lens32),
                               tile_offsets=triton_utils.tile_uniforms(seed, b, hq, t, lens32))
    assert torch.equal(budgets.long(), ref.tile_budgets)
    assert torch.equal(counts.long(), ref.counts)
    zero_tiles = (budgets == 0).repeat_interleave(tile, dim=-1)[..., :n]
    assert (counts[zero_tiles] == 0).all()


def test_large_tile_budget_splits_counts_exactly():
    """A tile budget above 256 (16-bit dots hold integers only to 256 in bf16) still sums exactly."""
    b, hq, hkv, n, d, s, tile = 1, 2, 1, 48, 64, 600, 16
    q, k, v, lens32, inputs = _case(b, hq, hkv, n, d, [n], torch.float16, 9, peaked=4.0)
    out, counts = decode.santa_flash_triton(q, k, v, lens32, d ** -0.5, s, tile, 3, write_counts=True)
    assert (counts.sum(-1) == (s // 3) * 3).all()
    scores64 = inputs.scores(torch.float64)
    ref = santa_flash_reference(scores64, inputs.v, s, tile,
                                tile_offsets=triton_utils.tile_uniforms(3, b, hq, 3, lens32))
    assert torch.equal(counts.long(), ref.counts)
    assert _rel(out, ref.out) < TOL[torch.float16]


def test_prop_split_counts_above_2048():
    """Per-key counts above 2048 (fp16 dots split them into bytes; int64 running sums)."""
    b, hq, hkv, n, d, s, tile = 1, 2, 1, 48, 64, 20000, 16
    q, k, v, lens32, inputs = _case(b, hq, hkv, n, d, [n], torch.float16, 11, peaked=6.0)
    ref = santa_prop_reference(inputs.scores(torch.float64), inputs.v, s, tile, rounding="largest-remainder",
                               budget_offset=triton_utils.budget_uniforms(4, b, hq, lens32),
                               tile_offsets=triton_utils.tile_uniforms(4, b, hq, 3, lens32))
    assert ref.counts.max() > 2048
    out, counts, _ = decode.santa_prop_triton(q, k, v, lens32, d ** -0.5, s, tile, 4, write_counts=True)
    assert torch.equal(counts.long(), ref.counts)
    assert _rel(out, ref.out) < TOL[torch.float16]


def test_uniforms_are_exact_binary_fractions_and_differ_by_counter_and_position():
    lens = torch.tensor([40, 41])
    u = triton_utils.tile_uniforms(5, 2, 3, 7, lens)
    assert u.shape == (2, 3, 7)
    assert ((u >= 0) & (u < 1)).all()
    assert torch.equal(u * 2**24, torch.floor(u * 2**24))
    assert u.flatten().unique().numel() == u.numel()
    assert not torch.equal(u, triton_utils.tile_uniforms(6, 2, 3, 7, lens))
    assert not torch.equal(triton_utils.budget_uniforms(5, 2, 3, lens), u[..., 0])
    # the next decode step of a row (one more valid key) draws new numbers from the same seed
    moved = triton_utils.tile_uniforms(5, 2, 3, 7, lens + 1)
    assert not (moved == u).any(dim=(1, 2)).all()


def test_santa_kernels_draw_new_numbers_at_the_next_step():
    """Same seed, one more valid key: different counts (the kernels key each row by its length, so a
    replayed CUDA graph draws fresh numbers), and each step matches the reference under its uniforms."""
    b, hq, hkv, n, d, s, tile = 1, 4, 2, 96, 64, 24, 16
    q, k, v, lens32, inputs = _case(b, hq, hkv, n, d, [80], torch.float32, 19)
    step_counts = []
    for lens in (lens32, lens32 + 1):
        _, counts, _ = decode.santa_prop_triton(q, k, v, lens, d ** -0.5, s, tile, 7, rounding="systematic",
                                                write_counts=True)
        step = check_decode_inputs(q.double(), k.double(), v.double(), lengths=lens.long())
        ref = santa_prop_reference(step.scores(torch.float64), step.v, s, tile, rounding="systematic",
                                   budget_offset=triton_utils.budget_uniforms(7, b, hq, lens),
                                   tile_offsets=triton_utils.tile_uniforms(7, b, hq, n // tile, lens))
        assert torch.equal(counts.long(), ref.counts)
        step_counts.append(counts.long())
    assert not torch.equal(step_counts[0][..., :80], step_counts[1][..., :80])


@pytest.mark.parametrize("kernel", ["flash", "prop-systematic"])
def test_kernel_mean_over_seeds_is_exact_attention(kernel):
    """Unbiasedness: over R seeds the mean estimate is exact attention within its standard error."""
    b, hq, hkv, n, d, s, tile, seeds = 1, 2, 1, 64, 64, 8, 16, 96
    q, k, v, lens32, inputs = _case(b, hq, hkv, n, d, [n], torch.float32, 21, peaked=1.5)
    exact = exact_attention(inputs)
    outs = []
    for seed in range(seeds):
        if kernel == "flash":
            out, _ = decode.santa_flash_triton(q, k, v, lens32, d ** -0.5, s, tile, seed)
        else:
            out, _, _ = decode.santa_prop_triton(q, k, v, lens32, d ** -0.5, s, tile, seed, rounding="systematic")
        outs.append(out.double())
    outs = torch.stack(outs)
    z = (outs.mean(0) - exact) / (outs.std(0) / math.sqrt(seeds))
    # z² averages 1 over the 128 coordinates when unbiased; its standard error is about sqrt(2/128).
    assert float((z**2).mean()) < 1.6
    assert float(z.abs().max()) < 5.0


def test_method_backends_on_cpu_under_interpreter():
    q, k, v, _, inputs = _case(2, 6, 2, 300, 64, [300, 150], torch.float32, 3)
    lens = torch.tensor([300, 150])
    for name, extra in (("santa-prop", {}), ("santa-prop", {"rounding": "systematic"}), ("santa-flash", {})):
        out, stats = kvsieve.method(name, budget=32, backend="triton", **extra).decode(q, k, v, lengths=lens, seed=1)
        assert stats.backend == "triton"
        assert out.dtype == q.dtype and torch.isfinite(out).all()
        assert 0 < stats.density < 1
        assert stats.bytes_read > 0
        _, ref_stats = kvsieve.method(name, budget=32, backend="auto", **extra).decode(q, k, v, lengths=lens, seed=1)
        assert ref_stats.backend == "reference"  # auto runs the kernels on CUDA tensors only
    out, stats = kvsieve.method("santa-prop", budget=32, backend="triton").decode(q, k, v, lengths=lens, seed=1)
    assert stats.samples == 32
    out, stats = kvsieve.method("dense", backend="triton").decode(q, k, v, lengths=lens)
    assert stats.backend == "triton"
    assert _rel(out, exact_attention(inputs)) < 1e-5
    # rows whose whole context fits in the budget run exact attention, as on the reference path
    out, stats = kvsieve.method("santa-prop", budget=400, backend="triton").decode(q, k, v, lengths=lens, seed=1)
    assert stats.exact_rows == 2
    assert _rel(out, exact_attention(inputs)) < 1e-5
    # one row covered (150 keys ≤ 200), one not: the kernel's estimate for the long row, exact for the short
    m = kvsieve.method("santa-prop", budget=200, backend="triton")
    out, stats = m.decode(q, k, v, lengths=lens, seed=1)
    raw, _, _ = decode.santa_prop_triton(q, k, v, lens.to(torch.int32), 64 ** -0.5, 200, m.tile_for(300), m_seed(1))
    assert torch.equal(out[0], raw[0])
    assert _rel(out[1], exact_attention(inputs)[1]) < 1e-5
    assert stats.exact_rows == 1 and stats.v_rows_read <= (200 + 150) / 2
    # without per-key counts (what the decode runtime's captured steps ask): the same output, samples as reads
    out2, stats2 = m.decode(q, k, v, lengths=lens, seed=1, context=CallContext(count_reads=False))
    assert torch.equal(out, out2)
    assert stats2.samples == 200 and "upper bound" in stats2.v_rows_read_is
    assert stats2.v_rows_read >= stats.v_rows_read


def m_seed(seed):
    """The int the santa methods give their kernels for ``seed=<int>``."""
    from kvsieve.core.rng import as_key, seed_int

    return seed_int(as_key(seed), torch.device("cpu"))


def test_method_backend_triton_rejects_what_the_kernels_cannot_serve():
    q, k, v = (t.to(torch.float64) for t in _case(1, 4, 2, 64, 64, [64], torch.float32, 4)[:3])
    with pytest.raises(ValueError, match="dtype"):
        kvsieve.method("santa-prop", backend="triton").decode(q, k, v)
    q, k, v = _case(1, 4, 2, 64, 32, [64], torch.float32, 4)[:3]
    with pytest.raises(ValueError, match="head dim"):
        kvsieve.method("santa-flash", backend="triton").decode(q, k, v)
    q, k, v = _case(1, 4, 2, 64, 64, [64], torch.float32, 4)[:3]
    mask = torch.ones(1, 64, dtype=torch.bool)
    mask[0, :3] = False  # left padding is not a prefix
    with pytest.raises(ValueError, match="prefix"):
        kvsieve.method("santa-prop", backend="triton").decode(q, k, v, key_mask=mask)
    with pytest.raises(ValueError, match="tile_size"):
        kvsieve.method("santa-prop", backend="triton", tile_size=48).decode(q, k, v)
    with pytest.raises(ValueError, match="backend"):
        kvsieve.method("santa-prop", backend="cuda")
    # auto falls back to the reference for what the kernels cannot serve (here: CPU tensors)
    _, stats = kvsieve.method("santa-prop", backend="auto", tile_size=48).decode(q, k, v, seed=0)
    assert stats.backend == "reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_short_rows_get_exact_attention_and_long_rows_are_left_alone(dtype):
    """``dense_short_rows_triton`` overwrites only rows with at most ``max_len`` valid keys (the rows a
    method's budget covers) with exact attention, reading no length on the host."""
    b, hq, hkv, n, d = 4, 6, 2, 200, 64
    q, k, v, lens32, _ = _case(b, hq, hkv, n, d, [200, 64, 1, 65], dtype, 23)
    before = torch.randn(b, hq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = before.clone()
    triton_dense.dense_short_rows_triton(q, k, v, lens32, d ** -0.5, out, 64)
    ref = triton_dense.dense_short_rows_reference(q, k, v, lens32, d ** -0.5, before, 64)
    assert torch.equal(out[[0, 3]], before[[0, 3]])
    assert _rel(out[[1, 2]], ref[[1, 2]]) < TOL[dtype]
    assert _rel(out[[1, 2]], triton_dense.dense_decode_reference(q, k, v, lens32, d ** -0.5)[[1, 2]]) < TOL[dtype]


@pytest.mark.parametrize("window,d", [(1, 64), (7, 64), (40, 64), (500, 64), (40, 256), (500, 256)])
def test_dense_window_reads_only_each_rows_last_keys(window, d):
    """A sliding-window layer's decode: the kernel over ``[len - window, len)`` of ragged rows (shorter than
    the window, longer, one key) equals the float64 reference, which equals exact attention over the slice
    (head dims 64 and Gemma 3's 256)."""
    b, hq, hkv, n = 3, 6, 2, 300
    q, k, v, lens32, _ = _case(b, hq, hkv, n, d, [300, 33, 1], torch.float32, 77 + window)
    out = _poisoned(b, hq, d, torch.float32)
    triton_dense.dense_decode_triton(q, k, v, lens32, d ** -0.5, block_n=16, window=window, out=out)
    ref = triton_dense.dense_decode_reference(q, k, v, lens32, d ** -0.5, window=window)
    assert torch.isfinite(out).all() and _rel(out, ref) < TOL[torch.float32]
    for row, length in enumerate(lens32.tolist()):
        lo = max(0, length - window)
        alone = triton_dense.dense_decode_reference(q[row:row + 1], k[row:row + 1, :, lo:length],
                                                    v[row:row + 1, :, lo:length], lens32[row:row + 1] - lo, d ** -0.5)
        assert _rel(ref[row:row + 1], alone) < 1e-12
