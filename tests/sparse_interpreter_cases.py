"""The Triton sparse decode kernel and Quest's page kernels against their torch references, on the CPU
through Triton's interpreter. Not collected on its own: ``tests/test_sparse_kernels.py`` runs this file
in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen when triton is imported).

bfloat16 runs with the tiles upcast to float32 before ``tl.dot`` (the interpreter's bf16 dot is wrong;
the kernels do this only when interpreted), so the bf16 cases check loads, masks and strides; the
``gpu`` tests check bf16 dots on the device.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_sparse_kernels.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

from kvsieve.kernels.quest import quest_pages  # noqa: E402
from kvsieve.kernels.shared import scores as score_kernels  # noqa: E402
from kvsieve.kernels.shared.weighted import weighted_sparse_decode_reference  # noqa: E402
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference, sparse_decode_triton  # noqa: E402

pytestmark = pytest.mark.triton

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _case(b, hq, hkv, n, d, dtype, seed, m, *, page=1, per_q=False, weights=False, lengths=False, dup=False,
          zero_counts=False):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * 2).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    hs = hq if per_q else hkv
    units = -(-n // page)
    idx = torch.randint(0, units, (b, hs, m), generator=g)
    if dup:
        idx[..., 1::2] = idx[..., ::2][..., : idx[..., 1::2].shape[-1]]
    lo = 0 if zero_counts else 1
    cnt = torch.randint(lo, m + 1, (b, hs), generator=g)
    w = torch.rand(b, hs, m, generator=g, dtype=torch.float64) * 5 + 0.05 if weights else None
    lens = torch.randint(1, n + 1, (b,), generator=g).to(torch.int32) if lengths else None
    return q, k, v, idx, cnt, w, lens


def _compare(q, k, v, idx, cnt, w, lens, page, sink, window, **kw):
    out, lse = sparse_decode_triton(q, k, v, idx, cnt, w, page_size=page, lengths=lens, sink=sink, window=window,
                                    check=True, **kw)
    ref_out, ref_lse = sparse_decode_reference(q, k, v, idx, cnt, w, page_size=page, lengths=lens, sink=sink,
                                               window=window, rows_per_batch=kw.get("rows_per_batch", 1))
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live)
    assert torch.all(out[~live] == 0)
    if live.any():
        err = (out.float()[live] - ref_out[live]).norm() / ref_out[live].norm()
        assert err < TOL[q.dtype], float(err)
        assert torch.allclose(lse[live], ref_lse[live], atol=1e-4, rtol=1e-5)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("per_q", [False, True])
def test_kernel_matches_reference(dtype, page, per_q):
    for seed in range(2):
        case = _case(2, 8, 2, 150 + 37 * seed, 64, dtype, seed, 9 if page > 1 else 40, page=page, per_q=per_q,
                     weights=seed == 1, lengths=True)
        _compare(*case, page, 0, 0)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_dims_and_dense_part(d):
    case = _case(2, 4, 1, 130, d, torch.float32, d, 5, page=16, weights=True, lengths=True)
    _compare(*case, 16, 7, 19)


@pytest.mark.parametrize("page", [1, 32])
def test_dense_part_with_lists_and_ragged_rows(page):
    for seed in range(3):
        case = _case(3, 6, 3, 257, 64, torch.float16, 10 + seed, 6 if page > 1 else 30, page=page,
                     per_q=seed == 2, weights=seed == 1, lengths=True, zero_counts=True)
        _compare(*case, page, 5 + seed, 33)


def test_dense_part_alone_is_exact_attention_over_sink_and_window():
    q, k, v, _, _, _, lens = _case(2, 4, 2, 90, 64, torch.float32, 3, 1, lengths=True)
    lens = torch.tensor([90, 12], dtype=torch.int32)
    out, lse = sparse_decode_triton(q, k, v, sink=4, window=10, lengths=lens)
    for b, length in enumerate(lens.tolist()):
        keep = sorted(set(range(min(4, length))) | set(range(max(length - 10, 0), length)))
        idx = torch.tensor(keep)[None, None].expand(1, 2, len(keep)).contiguous()
        ref, ref_lse = weighted_sparse_decode_reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], idx,
                                                        torch.full((1, 2), len(keep)))
        assert torch.allclose(out[b:b + 1], ref, atol=1e-5)
        assert torch.allclose(lse[b:b + 1], ref_lse, atol=1e-5)


def test_token_lists_match_the_contract_reference():
    for seed, per_q in ((0, False), (1, True)):
        q, k, v, idx, cnt, w, _ = _case(2, 6, 3, 70, 64, torch.float32, 20 + seed, 25, per_q=per_q, weights=True)
        out, lse = sparse_decode_triton(q, k, v, idx, cnt, w, check=True)
        ref, ref_lse = weighted_sparse_decode_reference(q, k, v, idx, cnt, w)
        assert torch.allclose(out, ref.float(), atol=2e-5) and torch.allclose(lse, ref_lse.float(), atol=2e-5)


@pytest.mark.parametrize("page", [1, 16])
def test_an_entry_listed_twice_counts_twice(page):
    q, k, v, idx, cnt, w, lens = _case(1, 4, 2, 100, 64, torch.float32, 5, 6, page=page, weights=True)
    cnt = torch.full_like(cnt, 6)
    twice = torch.cat([idx, idx[..., :1]], -1)  # first entry again
    w2 = torch.cat([w, w[..., :1]], -1)
    doubled = w.clone()
    doubled[..., 0] *= 2
    a = sparse_decode_triton(q, k, v, twice, cnt + 1, w2, page_size=page)
    b = sparse_decode_triton(q, k, v, idx, cnt, doubled, page_size=page)
    assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)
    case = _case(2, 4, 2, 100, 64, torch.float32, 6, 8, page=page, dup=True)
    _compare(*case, page, 0, 0)


def test_empty_but_valid_heads():
    q, k, v, idx, cnt, _, _ = _case(2, 4, 2, 64, 64, torch.float32, 7, 3, page=16)
    cnt[0] = 0  # no entry and no dense part: out 0, lse -inf
    out, lse = _compare(q, k, v, idx, cnt, None, None, 16, 0, 0)
    assert torch.all(torch.isinf(lse[0])) and torch.all(out[0] == 0) and torch.all(torch.isfinite(lse[1]))
    # every listed page inside the dense part: its keys are read once, by the dense part
    idx = torch.zeros_like(idx)
    cnt = torch.full_like(cnt, 3)
    out, lse = sparse_decode_triton(q, k, v, idx, cnt, page_size=16, sink=16, window=0)
    ref, ref_lse = sparse_decode_triton(q, k, v, sink=16, window=0)
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(lse, ref_lse, atol=1e-6)
    # length 1 and a page past the length
    lens = torch.tensor([1, 40], dtype=torch.int32)
    idx[1, :, 0] = 3  # keys 48..63 >= 40: nothing
    _compare(q, k, v, idx, cnt, None, lens, 16, 0, 0)


@pytest.mark.parametrize("target", [1, 7, 1000])
def test_split_counts_do_not_change_the_result(target):
    case = _case(2, 8, 4, 300, 64, torch.float32, 8, 40, lengths=True, weights=True)
    _compare(*case, 1, 3, 17, target_programs=target, block_n=16)


@pytest.mark.parametrize("per_q", [False, True])
def test_fused_merge_matches_reference_and_resets_its_tickets(per_q):
    for seed in range(3):  # the same ticket workspace serves every call
        case = _case(2, 8, 2, 200, 64, torch.float32, 30 + seed, 5, page=16, per_q=per_q, lengths=True,
                     weights=seed == 1, zero_counts=True)
        _compare(*case, 16, 4, 20 * seed, fused_merge=True, target_programs=40)


def test_query_rows_share_their_cache_row():
    """rows_per_batch = Q: B·Q query rows, each with its own lists and length, read a cache of B rows."""
    q, k, v, idx, cnt, w, _ = _case(6, 8, 2, 120, 64, torch.float32, 40, 5, page=16, weights=True)
    k, v = k[:2].contiguous(), v[:2].contiguous()  # 2 cache rows, 3 query rows each
    lens = torch.tensor([118, 119, 120, 60, 61, 62], dtype=torch.int32)  # causal rows of a chunk
    out, lse = _compare(q, k, v, idx, cnt, w, lens, 16, 4, 9, rows_per_batch=3)
    rep_out, rep_lse = sparse_decode_triton(q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), idx, cnt, w,
                                            page_size=16, lengths=lens, sink=4, window=9)
    assert torch.allclose(out, rep_out, atol=1e-6) and torch.allclose(lse, rep_lse, atol=1e-6)
    with pytest.raises(ValueError, match="rows_per_batch"):
        sparse_decode_triton(q, k, v, idx, cnt, rows_per_batch=2)


def test_workspace_reuse_never_reads_stale_partials():
    big = _case(2, 8, 2, 400, 64, torch.float32, 9, 60, weights=True)
    _compare(*big, 1, 16, 16, target_programs=4000, block_n=16)
    small = _case(1, 4, 2, 50, 64, torch.float32, 10, 3)
    _compare(*small, 1, 0, 0)


def test_bad_input_is_a_clear_error():
    q, k, v, idx, cnt, w, _ = _case(1, 4, 2, 50, 64, torch.float32, 11, 5, weights=True)
    cnt = torch.full_like(cnt, 5)

    def raises(match, *args, **kw):
        with pytest.raises(ValueError, match=match):
            sparse_decode_triton(*args, **kw)

    bad = idx.clone()
    bad[0, 0, 0] = 50
    raises("indices: used entries", q, k, v, bad, cnt, check=True)
    raises("indices: used entries", q, k, v, idx.clone().fill_(4), cnt, page_size=16, check=True)
    raises("counts: expected values", q, k, v, idx, cnt + 1, check=True)
    neg = w.clone()
    neg[0, 1, 2] = -1
    raises("weights: used entries", q, k, v, idx, cnt, neg, check=True)
    raises("head dim 96", q[..., :48].repeat(1, 1, 2), k[..., :48].repeat(1, 1, 1, 2).contiguous(),
           v[..., :48].repeat(1, 1, 1, 2).contiguous(), idx, cnt)
    raises("dtype torch.float64", q.double(), k.double(), v.double(), idx, cnt)
    raises("page_size 24", q, k, v, idx, cnt, page_size=24)
    raises("must be transposed", q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), idx, cnt)
    raises("indices: expected shape", q, k, v, idx[:, :1].expand(1, 3, 5).contiguous(), cnt)
    raises("lengths: expected values", q, k, v, idx, cnt, lengths=torch.tensor([51], dtype=torch.int32),
           check=True)
    raises("a dense part", q, k, v)


# --- Quest pages ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_bounds_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(12)
    b, hq, hkv, n, d, page = 2, 8, 2, 300, 64, 16
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    lens = torch.tensor([300, 77], dtype=torch.int32)
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, page)
    for sink, window in ((0, 0), (8, 20)):
        ref = quest_pages.page_bounds_reference(q, kmin, kmax, lens, page, sink, window)
        out = quest_pages.page_bounds_triton(q, kmin, kmax, lens, page, sink, window)
        live = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(out), live)
        assert torch.allclose(out[live], ref[live], atol=1e-4, rtol=1e-5)


# (block_p, tiles, num_warps, num_stages): 19 pages, so 2 tiles of 16 per program leave the last program a
# tile past the pages (whose softmax partial has no column to go to)
BOUNDS_LAUNCHES = [(64, 1, 4, 1), (16, 2, 2, 2), (32, 3, 8, 3), (128, 1, 4, 1), (16, 8, 4, 1)]


@pytest.mark.parametrize("block_p,tiles,warps,stages", BOUNDS_LAUNCHES)
def test_page_bounds_launch_overrides_keep_bounds_and_partials(block_p, tiles, warps, stages):
    """The bounds launch's overrides (tune_quest.py sweeps them): the default launch's bounds and maxima,
    and softmax partials of block_p pages each whose log-sum-exp is each head's over its bounds —
    nothing written past them (the partials are NaN-filled first; a stray column would land in the next
    head's row)."""
    from kvsieve.kernels.shared.select_triton import GROUP_MAX

    g = torch.Generator().manual_seed(21)
    b, hq, hkv, n, d, page = 2, 8, 2, 300, 64, 16
    q = torch.randn(b, hq, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    lens = torch.tensor([300, 77], dtype=torch.int32)
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, page)
    p = kmin.shape[2]
    want = quest_pages.page_bounds_triton(q, kmin, kmax, lens, page, mask_dense=False)
    parts = tuple(torch.full((b, hq, -(-p // block_p)), float("nan")) for _ in range(2))
    maxima = torch.full((b, hq, -(-p // GROUP_MAX)), float("nan"))
    kw = dict(block_p=block_p, tiles=tiles, num_warps=warps, num_stages=stages)
    got = quest_pages.page_bounds_triton(q, kmin, kmax, lens, page, mask_dense=False, parts=parts, **kw)
    live = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), live)
    # to rounding: the interpreter's float32 dot (numpy) sums in an order that depends on the tile width
    assert torch.allclose(got[live], want[live], atol=1e-5, rtol=1e-6)
    pm, pl = parts
    lse = torch.logsumexp(pm + torch.log(pl), -1)
    assert torch.allclose(lse, torch.logsumexp(want, -1), atol=1e-5, rtol=1e-6)
    quest_pages.page_bounds_triton(q, kmin, kmax, lens, page, 4, 20, maxima=maxima, **kw)
    dense = quest_pages.page_bounds_triton(q, kmin, kmax, lens, page, 4, 20)
    padded = torch.nn.functional.pad(dense, (0, -p % GROUP_MAX), value=float("-inf"))
    assert torch.allclose(maxima, padded.view(b, hq, -1, GROUP_MAX).amax(-1), atol=1e-5, rtol=1e-6)


# --- methods lowered to the kernel ------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["streaming:sink=4,window=16", "streaming:sink=0,window=9",
                                  "quest:top_k=24,page_size=8,sink=4,window=8",
                                  "quest:top_k=0.2,page_size=16,sink=2,window=5,share_kv_group=True",
                                  "quest:top_k=0,page_size=16,sink=3,window=5",
                                  "oracle-topk:top_k=10,sink=3,window=6",
                                  "oracle-topk:top_k=0.1,sink=0,window=4,share_kv_group=True"])
def test_methods_triton_path_matches_their_reference(spec):
    import kvsieve

    fast = kvsieve.method(spec + ",backend=triton")
    slow = kvsieve.method(spec + ",backend=reference")
    g = torch.Generator().manual_seed(13)
    b, hq, hkv, n, d = 2, 8, 2, 100, 64
    k = torch.randn(b, hkv, n + 12, d, generator=g)
    v = torch.randn(b, hkv, n + 12, d, generator=g)
    fast_state, slow_state = fast.new_state(), slow.new_state()
    lens = torch.tensor([n, 41])
    for step in range(12):  # a growing cache: one key per row and step, state kept across steps
        q = torch.randn(b, hq, d, generator=g) * 2
        kk, vv = k[:, :, : n + step], v[:, :, : n + step]
        out, stats = fast.decode(q, kk, vv, lengths=lens + step, state=fast_state)
        ref, ref_stats = slow.decode(q, kk, vv, lengths=lens + step, state=slow_state)
        assert stats.backend == "triton" and ref_stats.backend == "reference"
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (step, float((out - ref).abs().max()))
        for field in ("n_keys", "k_rows_scored", "v_rows_read", "kv_rows_read", "density", "bytes_read",
                      "exact_rows"):
            assert stats[field] == pytest.approx(ref_stats[field]), (field, step)


def test_methods_auto_backend_keeps_the_reference_on_cpu_and_says_why_triton_cannot():
    import kvsieve

    q = torch.randn(1, 4, 64)
    k = torch.randn(1, 2, 40, 64)
    _, stats = kvsieve.method("streaming:sink=4,window=8").decode(q, k, k)
    assert stats.backend == "reference" and "backend_reason" not in stats.extra
    with pytest.raises(ValueError, match="head dim 48"):
        kvsieve.method("quest:backend=triton").decode(q[..., :48].contiguous(), k[..., :48].contiguous(),
                                                      k[..., :48].contiguous())
    with pytest.raises(ValueError, match="page_size 12"):
        kvsieve.method("quest:backend=triton,page_size=12").decode(q, k, k)


def test_benchmark_variants_run_and_match_their_references():
    """Every call the GPU benchmark times, on tiny CPU inputs: right output, selection and attention parts."""
    from types import SimpleNamespace

    from bench_scripts import load_bench

    bench = load_bench("sparse_decode/run.py")
    g = torch.Generator().manual_seed(14)
    case = bench.Case("tiny", 4, 2, 64, 640, 1)
    x = SimpleNamespace(q=torch.randn(1, 4, 64, generator=g), k=torch.randn(1, 2, 640, 64, generator=g),
                        v=torch.randn(1, 2, 640, 64, generator=g), lens=torch.tensor([640], dtype=torch.int32),
                        scale=0.125)
    calls = bench.variants(case, x, 0.2, sink=8, window_qt=8)
    assert {"sparse-pages16", "streaming", "quest-kv", "quest-q", "oracle-topk-q", "quest-kv@torch-select",
            "quest-kv@split-group-sum", "quest-kv@group-sum-in-select", "quest-kv@row-select", "quest-q@row-select",
            "quest-kv@register-select",
            "oracle-topk-kv@torch-select", "oracle-topk-kv@row-select"} <= set(calls)
    for name, (call, select, attend, n_bytes, ref) in calls.items():
        got, want = call(), ref()
        assert float((got - want).norm() / want.norm()) < 1e-5, name
        assert torch.allclose(attend(), got, atol=1e-6), name
        assert 0 < n_bytes <= 3 * 640 * 2 * 64 * 4, name
        if select is not None:
            idx, counts = select()
            assert idx.shape[:2] == counts.shape and bool((counts > 0).all()), name


def test_quest_launch_tuner_runs_a_tiny_case(tmp_path):
    """benchmarks/sparse_decode/tune_quest.py's sweep on a tiny case (the --quick path, one case): every
    launch runs (limits lowered), each setting's selection is checked and timed, the proposals and the
    report come out."""
    import sys
    from argparse import Namespace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "sparse_decode"))
    try:
        import tune_quest
    finally:
        sys.path.pop(0)
    args = Namespace(quick=True, density=0.2, warmup=0, iters=1)
    sweep = {"group_sum": [{"block_x": 16, "chunk": 8}], "rows": [{"segment": 8}], "bounds": [{"tiles": 2}],
             "split": [{"programs": 3, "num_warps": 2}]}
    rows = tune_quest.run_case(tune_quest.TuneCase(512, 1, (8, 0, 0, 0)), args, tune_quest.WallTimer(), sweep,
                               lambda r: None)  # the rows select (the split select off)
    rows += tune_quest.run_case(tune_quest.TuneCase(512, 1, (8, 0, 0)), args, tune_quest.WallTimer(),
                                {"split": sweep["split"]}, lambda r: None)  # few rows: the split select
    swept = [r for r in rows if r["launch"] in tune_quest.LAUNCHES]
    assert {(r["method"], r["launch"]) for r in swept} == {("quest-kv", "bounds"), ("quest-kv", "group_sum"),
                                                           ("quest-kv", "rows"), ("quest-q", "bounds"),
                                                           ("quest-q", "rows"), ("quest-kv", "split"),
                                                           ("quest-q", "split")}
    assert all(r["same"] and r["selection_us"] > 0 and r["call_us"] > 0 for r in swept), swept
    props = tune_quest.proposals(rows, 0.02)
    assert set(props) == {"bounds", "group_sum", "rows", "split"}
    report = tune_quest.markdown({"device": "cpu", "date": "-", "command": "-", "torch": "-", "triton": "-",
                                  "protocol": "-", "density": 0.2, "seconds_sweep": 0, "seconds": 0, "rows": rows,
                                  "proposals": props, "min_gain": 0.02, "combined": {}, "combined_check": []})
    assert "## Proposed defaults" in report and "_group_sum_parts_kernel" in report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_kernel_matches_reference(dtype):
    g = torch.Generator().manual_seed(15)
    q = torch.randn(2, 8, 64, generator=g).to(dtype)
    k = torch.randn(2, 2, 300, 64, generator=g).to(dtype)
    lens = torch.tensor([300, 90], dtype=torch.int32)
    for sink, window in ((0, 0), (5, 30)):
        ref = score_kernels.scores_reference(q, k, lens, sink, window)
        out = score_kernels.scores_triton(q, k, lens, sink, window)
        live = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(out), live)
        assert torch.allclose(out[live], ref[live], atol=1e-4, rtol=1e-5)


def test_page_update_kernel_follows_any_appends():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("sparse_tests", Path(__file__).with_name("test_sparse_kernels.py"))
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    tests.check_page_summaries(quest_pages, pages=(1, 16), steps=(1, 2, 17, 40))


@pytest.mark.parametrize("size", [7, 0.05, 0.3, 1.0])
def test_selection_kernels_match_their_references(size):
    from kvsieve.kernels.oracle_topk import topk

    g = torch.Generator().manual_seed(17)
    b, hq, hkv, n, d = 3, 8, 2, 260, 64
    q = torch.randn(b, hq, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    lens = torch.tensor([260, 100, 20], dtype=torch.int32)  # 100 · 0.05 = 5.000000000000001 in float64
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, 16)
    for share in (False, True):
        for sink, window in ((0, 0), (4, 24)):
            pages, counts = quest_pages.quest_select(q, kmin, kmax, lens, page_size=16, sink=sink, window=window,
                                                     size=size, max_pages=6, share_kv_group=share)
            ref_pages, ref_counts = quest_pages.quest_select(q, kmin, kmax, lens, page_size=16, sink=sink,
                                                             window=window, size=size, max_pages=6,
                                                             share_kv_group=share, bounds="reference")
            assert torch.equal(counts, ref_counts)
            for row in range(b):
                for h in range(pages.shape[1]):
                    c = int(counts[row, h])
                    assert set(pages[row, h, :c].tolist()) == set(ref_pages[row, h, :c].tolist())
            idx, counts = topk.topk_select(q, k, lens, sink=sink, window=window, size=size, max_k=40,
                                           share_kv_group=share)
            ref_idx, ref_counts = topk.topk_select(q, k, lens, sink=sink, window=window, size=size, max_k=40,
                                                   share_kv_group=share, scores="reference")
            assert torch.equal(counts, ref_counts)
            for row in range(b):
                for h in range(idx.shape[1]):
                    c = int(counts[row, h])
                    assert set(idx[row, h, :c].tolist()) == set(ref_idx[row, h, :c].tolist())


# --- device selection (select_triton) ---------------------------------------------------------------

def _same_sets(idx, counts, ref_idx, ref_counts):
    """Equal counts, and each row's first ``count`` entries are the same set (no duplicates)."""
    assert torch.equal(counts, ref_counts)
    for row in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            c = int(counts[row, h])
            got = idx[row, h, :c].tolist()
            assert len(set(got)) == c and set(got) == set(ref_idx[row, h, :c].tolist()), (row, h)


@pytest.mark.parametrize("x,k,prefilter,segment", [(1, 1, False, None), (7, 5, True, None), (300, 40, False, None),
                                                   (300, 40, True, None), (5000, 700, True, None),
                                                   (2500, 2500, True, None), (300, 40, True, 64),
                                                   (5000, 700, True, 512), (129, 129, True, 64)])
def test_row_select_matches_its_reference_with_ties_and_empty_rows(x, k, prefilter, segment, monkeypatch):
    """The rows' count-th largest found exactly (ties to the lowest index, as the reference), with rows
    holding −inf, repeated values, one distinct value, count 0, count = every finite value; ``segment``:
    long rows split over several programs (the limit lowered so that these rows count as long), twice
    (the ticket counters must be back at 0 after a call), their candidates merged by the last program or
    by a second launch."""
    from kvsieve.kernels.shared import select_triton
    from kvsieve.kernels.shared.select_triton import GROUP_MAX, topk_rows_reference, topk_rows_triton

    if segment is not None:
        monkeypatch.setattr(select_triton, "SEGMENT", segment)

    g = torch.Generator().manual_seed(x + k)
    s = torch.randn(3, 4, x, generator=g) * 3
    s[0, 1, ::3] = float("-inf")
    s[1, 2] = (s[1, 2] * 2).round()  # many ties
    s[2, 3] = 1.5  # one value
    s[2, 0, : x // 2] = -s[2, 0, : x // 2].abs()  # negatives and positives
    finite = int(torch.isfinite(s[0, 1]).sum())
    counts = torch.tensor([min(k, finite), k if x > 1 else 0, k])
    maxima = None
    if prefilter:
        maxima = torch.nn.functional.pad(s, (0, -x % GROUP_MAX), value=float("-inf"))
        maxima = maxima.view(3, 4, -1, GROUP_MAX).amax(-1).contiguous()
    for merge in ("ticket", "launch") if segment else ("ticket",):  # the split row's last step: counter or launch
        for _ in range(2 if segment else 1):
            assert torch.equal(topk_rows_triton(s, counts, k, maxima=maxima, merge=merge),
                               topk_rows_reference(s, counts, k)), merge


@pytest.mark.parametrize("x,k", [(1, 1), (7, 5), (64, 3), (300, 40), (5000, 700), (2500, 2500), (129, 129)])
def test_register_select_matches_its_reference_with_ties_and_empty_rows(x, k):
    """topk_rows_registers (a row whole in registers, the radix stopping once the answer's bin is taken
    whole) on the rows of the test above: −inf, repeated values, one distinct value, count 0, count =
    every finite value."""
    from kvsieve.kernels.shared.select_triton import topk_rows_reference, topk_rows_registers

    g = torch.Generator().manual_seed(x + k)
    s = torch.randn(3, 4, x, generator=g) * 3
    s[0, 1, ::3] = float("-inf")
    s[1, 2] = (s[1, 2] * 2).round()  # many ties
    s[2, 3] = 1.5  # one value
    s[2, 0, : x // 2] = -s[2, 0, : x // 2].abs()  # negatives and positives
    s[0, 0, x // 3:] = 0.0  # ties at the answer with +0
    finite = int(torch.isfinite(s[0, 1]).sum())
    counts = torch.tensor([min(k, finite), k if x > 1 else 0, k])
    assert torch.equal(topk_rows_registers(s, counts, k), topk_rows_reference(s, counts, k))


def _selection_case(seed, b, hq, hkv, n, d, dtype):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, d, generator=g) * 2).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    lens = torch.randint(1, n + 1, (b,), generator=g).to(torch.int32)
    lens[0] = n
    if b > 2:
        lens[2] = 20  # shorter than sink + window: no candidate, count 0
    return q, k, lens


# (seed, batch, Hq, Hkv, N, d, dtype): GQA groups 4 and 1, ragged rows, fp32/fp16/bf16
SELECTION_SHAPES = [(0, 3, 8, 2, 700, 64, torch.float32), (1, 2, 4, 4, 500, 64, torch.float16),
                    (2, 2, 8, 2, 600, 128, torch.bfloat16)]


# (share_kv_group, long rows): with select="triton-rows" (the rows select launch: the register select's
# limit at 0; Quest's few rows take the split select there, "triton-rows-unsplit" one program per row)
# long group-summed rows take the parallel group-sum launch, and long rows split the select's prefilter
# pass over programs; with "triton" (the register select) long group-summed rows are group-summed in many
# chunks. The limits are lowered so that these rows count as long.
ROW_KINDS = [(False, False), (True, False), (False, True), (True, True)]


def _select_limits(monkeypatch, select, long_rows, segment):
    from kvsieve.kernels.shared import select_triton

    if select.startswith("triton-rows"):
        monkeypatch.setattr(select_triton, "REGISTER_SELECT_MAX", 0)
        if select == "triton-rows-unsplit":  # few rows too: one program per row (Quest splits them)
            monkeypatch.setattr(select_triton, "SPLIT_ROWS_MAX", 0)
    else:  # group-summed rows through the register select whatever their length
        monkeypatch.setattr(select_triton, "REGISTER_SELECT_GROUPED_MAX", 1 << 30)
    if long_rows:
        monkeypatch.setattr(select_triton, "ROW_GROUP_SUM_MAX", 8)
        monkeypatch.setattr(select_triton, "SEGMENT", segment)
        monkeypatch.setattr(select_triton, "REGISTER_CHUNK_MIN", 4)
    return select.split("-")[0]


@pytest.mark.parametrize("select", ["triton", "triton-rows", "triton-rows-unsplit", "torch"])
@pytest.mark.parametrize("share,long_rows", ROW_KINDS)
def test_quest_device_selection_matches_the_reference(select, share, long_rows, monkeypatch):
    """quest_select's device paths against its torch reference (the same bounds in torch): pages 16/32,
    sizes as counts and fractions, with and without a dense part."""
    select = _select_limits(monkeypatch, select, long_rows, 16)
    for seed, b, hq, hkv, n, d, dtype in SELECTION_SHAPES:
        q, k, lens = _selection_case(seed, b, hq, hkv, n, d, dtype)
        for page, size, (sink, window) in ((16, 40, (0, 0)), (32, 0.1, (4, 40)), (16, 1.0, (4, 40))):
            kmin, kmax = quest_pages.page_minmax_reference(k, lens, page)
            mp = -(-(size if isinstance(size, int) else int(n * size)) // page)
            kw = dict(page_size=page, sink=sink, window=window, size=size, max_pages=mp, share_kv_group=share)
            got = quest_pages.quest_select(q, kmin, kmax, lens, select=select, **kw)
            _same_sets(*got, *quest_pages.quest_select(q, kmin, kmax, lens, bounds="reference", **kw))


# Non-default settings of each selection launch (tune_quest.py sweeps them), by launch; "rows" paths: the
# rows select with the group sum in a launch of its own (the path of Quest's pages beyond 64k contexts)
SELECT_OVERRIDES = {
    "bounds": [{"block_p": 16, "tiles": 2, "num_warps": 2, "num_stages": 2}, {"block_p": 128, "num_warps": 8},
               {"tiles": 3, "num_stages": 3}],
    "group_sum": [{"block_x": 16, "chunk": 8, "num_warps": 2}, {"block_x": 64, "chunk": 32, "num_warps": 8}],
    "rows": [{"segment": 8, "num_warps": 2}, {"segment": 16, "num_warps": 16}],
    "registers": [{"programs": 3, "num_warps": 2}, {"programs": 1000, "num_warps": 16}],
    "split": [{"programs": 3, "num_warps": 2, "digit_bits": 4}, {"programs": 1000, "num_warps": 8}],
}


@pytest.mark.parametrize("path", ["registers", "rows", "split"])
@pytest.mark.parametrize("share", [False, True])
def test_quest_launch_overrides_keep_the_selection(path, share, monkeypatch):
    """quest_select with non-default launch settings: the default settings' pages and the reference's
    (as sets), on the launches that run on each path — tiles past the pages, chunks of a few units,
    rows split into segments of 8 units, a program per few units or per row."""
    from kvsieve.kernels.shared import select_triton

    # the bounds launch (its maxima: the test above) once per path of its outputs: parts or neither
    launches = ["bounds", "registers"] if path == "registers" else [path] + (["group_sum"] if share else [])
    if path != "registers":
        monkeypatch.setattr(select_triton, "REGISTER_SELECT_MAX", 0)
        monkeypatch.setattr(select_triton, "ROW_GROUP_SUM_MAX", 8)
        monkeypatch.setattr(select_triton, "SPLIT_ROWS_MAX", 1 << 30 if path == "split" else 0)
    q, k, lens = _selection_case(*SELECTION_SHAPES[2])  # GQA group 4, bf16, ragged rows
    n = k.shape[2]
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, 16)
    kw = dict(page_size=16, sink=4, window=40, size=0.1, max_pages=-(-int(n * 0.1) // 16), share_kv_group=share)
    want = quest_pages.quest_select(q, kmin, kmax, lens, **kw)
    _same_sets(*want, *quest_pages.quest_select(q, kmin, kmax, lens, bounds="reference", **kw))
    for launch in launches:
        for opts in SELECT_OVERRIDES[launch]:
            for _ in range(2 if launch != "bounds" else 1):  # the ticket counters must be back at 0 after a call
                got = quest_pages.quest_select(q, kmin, kmax, lens, launch_opts={launch: opts}, **kw)
                _same_sets(*got, *want)


@pytest.mark.parametrize("select", ["triton", "triton-rows", "torch"])
@pytest.mark.parametrize("share,long_rows", ROW_KINDS)
def test_topk_device_selection_matches_the_reference(select, share, long_rows, monkeypatch):
    """topk_select's device paths against its torch reference, as Quest's above."""
    from kvsieve.kernels.oracle_topk import topk

    select = _select_limits(monkeypatch, select, long_rows, 128)
    for seed, b, hq, hkv, n, d, dtype in SELECTION_SHAPES:
        q, k, lens = _selection_case(seed + 10, b, hq, hkv, n, d, dtype)
        for size, (sink, window) in ((7, (0, 0)), (0.1, (4, 40)), (1.0, (4, 40))):
            mk = size if isinstance(size, int) else int(n * size)
            kw = dict(sink=sink, window=window, size=size, max_k=mk, share_kv_group=share)
            got = topk.topk_select(q, k, lens, select=select, **kw)
            _same_sets(*got, *topk.topk_select(q, k, lens, scores="reference", **kw))
