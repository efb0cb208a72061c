"""The stats passes' stream switches (``santa/common.py``: ``StreamHints``) under Triton's interpreter: every
candidate writes the current path's stats, stash, budgets, counts and output to the bit, and draws the float64
reference's budgets and counts. Not collected on its own: ``tests/test_santa_stream.py`` runs it in a subprocess
with ``TRITON_INTERPRET=1``.

Cache hints change no value by construction; the batched releases of v10 (``release_every``) and its balanced
program count change which thread raises which counter when, so the tile counters are also checked exactly
after the stats kernel alone (every lane of every unit at its tile count).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_santa_stream.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

from kvsieve.kernels.santa import common  # noqa: E402
from kvsieve.kernels.santa.common import StreamHints  # noqa: E402
from kvsieve.kernels.santa.overlap import ordered_stats_pass, santa_flash_overlap, santa_prop_overlap  # noqa: E402
from kvsieve.kernels.santa.reference import santa_prop_reference  # noqa: E402
from kvsieve.kernels.santa.split_merge import santa_prop_split  # noqa: E402
from kvsieve.kernels.santa.two_pass import santa_prop_two_pass  # noqa: E402
from kvsieve.kernels.shared import triton_utils  # noqa: E402

pytestmark = pytest.mark.triton

# the candidates of benchmarks/breakdown/santa_stream.py (the v8 stats pass ignores the v10 switches)
HINTS = [StreamHints(k_eviction="evict_first"),
         StreamHints(k_eviction="evict_first", stash_eviction="evict_last", lazy_stash=True),
         StreamHints(stash_cache=".cs", lazy_stash=True)]
V10 = [StreamHints(release_every=2), StreamHints(release_every=3, balanced_rounds=True),
       StreamHints(k_eviction="evict_first", release_every=4, balanced_rounds=True)]


def _case(b, hq, hkv, n, d, lens, dtype, seed, peaked=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g, dtype=torch.float64) * peaked).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, torch.tensor(lens, dtype=torch.int32)


def _call(run, q, k, v, lens, s, tile, seed, stream, **opts):
    """``(out, counts, budgets, m, l, stash)`` of one prop call, the stats copied out of the workspace (zeroed
    first: v8 leaves the tiles past a row's length unwritten)."""
    b, hq, d = q.shape
    t = -(-k.shape[2] // tile)
    m, l, stash = common.stats_buffers(q, b, hq, t, tile)
    for x in (m, l, stash):
        x.zero_()
    out = torch.full((b, hq, d), float("nan"), dtype=q.dtype)
    res = run(q, k, v, lens, d ** -0.5, s, tile, seed, write_counts=True, out=out, stream=stream, **opts)
    assert common.stats_buffers(q, b, hq, t, tile)[0].data_ptr() == m.data_ptr()
    stats = (m[:b * hq * t].clone(), l[:b * hq * t].clone(), stash[:b * hq * t * tile].clone())
    return (res[0].clone(), res[1].clone(), res[2].clone() if len(res) > 2 else None, *stats)


def _same(a, b):
    return all(x is None and y is None or torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _assert_clean(q):
    assert not triton_utils.workspace("overlap_sync", q, 1, torch.int32, zeroed=True).any()
    assert not triton_utils.workspace("fold_acc", q, 1, torch.float32).any()
    assert not triton_utils.workspace("fold_done", q, 1, torch.int32).any()


# (B, Hq, Hkv, N, d, lens, S, tile): GQA 4 and 3, ragged rows (one down to a single key), N not a tile multiple
SHAPES = [(2, 8, 2, 150, 64, [150, 71], 24, 32), (3, 6, 2, 100, 64, [100, 1, 77], 40, 32)]


@pytest.mark.parametrize(("shape", "dtype"), [(SHAPES[0], torch.bfloat16), (SHAPES[1], torch.float16)],
                         ids=["g4-bf16", "g3-fp16"])
def test_candidates_equal_the_current_path(shape, dtype):
    """v8 with the merge launch (the 128k path), v8 with the folded merge (Bernoulli's values) and v10 (the 32k
    batch-8 path), a seed per shape and dtype: the
    candidates give the current path's m, l, stash, tile budgets, counts and output exactly. The interpreter
    takes no cache hint, so one hint form per path checks their plumbing; v10's batched releases and balanced
    rounds change the schedule of the counters, checked in full."""
    b, hq, hkv, n, d, lens, s, tile = shape
    seed = 3 + n + (dtype == torch.bfloat16)
    q, k, v, lens32 = _case(b, hq, hkv, n, d, lens, dtype, seed)
    for run, opts, hints in ((santa_prop_split, {"block_n": 16, "stats_programs": 3}, HINTS[1:2]),
                             (santa_prop_two_pass, {"block_n": 16, "stats_programs": 3}, HINTS[2:]),
                             (santa_prop_overlap, {"block_n": 16, "stats_programs": 7}, HINTS[2:] + V10)):
        base = _call(run, q, k, v, lens32, s, tile, seed, None, **opts)
        assert torch.isfinite(base[0]).all()
        for h in hints:
            got = _call(run, q, k, v, lens32, s, tile, seed, h, **opts)
            assert _same(got, base), (run.__name__, h, seed)
            _assert_clean(q)


@pytest.mark.parametrize("hints", [HINTS[1], V10[2]._replace(lazy_stash=True)],
                         ids=["hints-lazy", "release4-balanced-lazy"])
def test_candidates_draw_the_reference(hints):
    """fp16 (the interpreter's bf16 dot is not the device's, so the reference check is fp16 and float32): the
    candidates' budgets and counts are the float64 reference's for the same uniforms, on peaked rows with
    tiles of no budget, both roundings."""
    b, hq, hkv, n, d, lens, s, tile = 2, 8, 2, 130, 64, [130, 60], 24, 32
    seed = 17
    q, k, v, lens32 = _case(b, hq, hkv, n, d, lens, torch.float16, seed, peaked=4.0)
    from kvsieve.core.inputs import check_decode_inputs

    inputs = check_decode_inputs(q.double(), k.double(), v.double(), lengths=lens32.long())
    t = -(-n // tile)
    for rounding in ("largest-remainder", "systematic"):
        ref = santa_prop_reference(inputs.scores(torch.float64), inputs.v, s, tile, rounding=rounding,
                                   budget_offset=triton_utils.budget_uniforms(seed, b, hq, lens32),
                                   tile_offsets=triton_utils.tile_uniforms(seed, b, hq, t, lens32))
        for run, opts in ((santa_prop_split, {"block_n": 16, "stats_programs": 5}),
                          (santa_prop_overlap, {"block_n": 16, "stats_programs": 5})):
            out, counts, budgets, *_ = _call(run, q, k, v, lens32, s, tile, seed, hints, rounding=rounding, **opts)
            assert torch.equal(budgets.long(), ref.tile_budgets), (run.__name__, rounding)
            assert torch.equal(counts.long(), ref.counts), (run.__name__, rounding)
            rel = float((out.double() - ref.out).norm() / ref.out.norm())
            assert rel < 2e-3, (run.__name__, rounding, rel)


@pytest.mark.parametrize("programs", [1, 7, 64])
@pytest.mark.parametrize("every", [2, 3])
def test_batched_releases_count_every_tile_once(every, programs):
    """v10's stats kernel alone with batched releases (and balanced rounds): each unit's every lane ends at the
    unit's tile count, tiles past a row's length included, for program counts that leave the last round
    partial, full, or one tile per program."""
    b, hq, hkv, n, d, tile = 3, 4, 2, 160, 64, 32
    q, k, _, lens32 = _case(b, hq, hkv, n, d, [160, 9, 100], torch.float32, 5)
    t = n // tile
    for balanced in (False, True):
        _, _, buf = common.begin_call(q, k, k, tile, flash=False, rounding="largest-remainder", write_counts=False,
                                      out=None)
        threads = 32
        sync = torch.zeros(b * hkv * threads + b * hq, dtype=torch.int32)
        ordered_stats_pass(q, k, lens32, buf, sync, d ** -0.5, tile, flash=False, pdl=False, block_n=16,
                           stats_programs=programs, stats_warps=1, stats_stages=2,
                           stream=StreamHints(release_every=every, balanced_rounds=balanced))
        assert (sync[:b * hkv * threads] == t).all(), (every, programs, balanced, sync[:b * hkv * threads])
        assert not sync[b * hkv * threads:].any()


def test_flash_overlap_with_batched_releases():
    """santa-flash's v10 shares the stats kernel: batched releases give its counts and output, and leave the sync
    words zero."""
    b, hq, hkv, n, d, s, tile = 2, 8, 2, 150, 64, 64, 32
    q, k, v, lens32 = _case(b, hq, hkv, n, d, [150, 71], torch.float16, 23)
    opts = {"block_n": 16, "stats_programs": 7, "write_counts": True}
    base_out, base_counts = santa_flash_overlap(q, k, v, lens32, d ** -0.5, s, tile, 9, **opts)
    base_out, base_counts = base_out.clone(), base_counts.clone()
    out, counts = santa_flash_overlap(q, k, v, lens32, d ** -0.5, s, tile, 9,
                                      stream=StreamHints(k_eviction="evict_first", release_every=3), **opts)
    assert torch.equal(counts, base_counts) and torch.equal(out, base_out)
    _assert_clean(q)


def test_module_default_switches_every_call(monkeypatch):
    """``common.STREAM`` is read at each call: setting it switches the calls that pass no ``stream``."""
    seen = []
    real = common.stream_hints

    def spy(stream):
        seen.append(real(stream))
        return seen[-1]

    monkeypatch.setattr(common, "STREAM", StreamHints(k_eviction="evict_first"))
    import kvsieve.kernels.santa.overlap as overlap_mod
    import kvsieve.kernels.santa.two_pass as two_pass_mod

    monkeypatch.setattr(overlap_mod, "stream_hints", spy)
    q, k, v, lens32 = _case(1, 4, 1, 64, 64, [64], torch.float32, 1)
    santa_prop_overlap(q, k, v, lens32, 0.125, 8, 32, 1, block_n=16, stats_programs=2)
    assert seen and seen[-1].k_eviction == "evict_first"
    assert two_pass_mod.stream_meta(None)["K_EVICT"] == "evict_first"
