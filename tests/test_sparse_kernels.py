"""The weighted sparse decode kernel (``kernels/shared/weighted_triton.py``) and Quest's device-side page
selection (``kernels/quest/quest_pages.py``).

CPU: the extended contract's torch reference against the contract's own reference, and the Triton
kernels against their references through the interpreter (in a subprocess, as in
``test_kernels_triton.py``). GPU (``gpu`` mark, skipped without CUDA): bf16 at Llama-3.1-8B shapes,
no host sync, and CUDA-graph replays equal to eager calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cuda_capture import warm_check_and_capture
from interpreted import case_groups, group_id, run_interpreter_cases

from kvsieve.kernels.quest import quest_pages
from kvsieve.kernels.shared import scores as score_kernels
from kvsieve.kernels.shared.weighted import weighted_sparse_decode_reference
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference

HERE = Path(__file__).resolve().parent


def _qkv(b, hq, hkv, n, d, seed, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


@pytest.mark.parametrize("per_q", [False, True])
def test_reference_pages_are_their_token_lists(per_q):
    """A page list is the token list of its pages' keys (below the length, outside the dense part)."""
    q, k, v = _qkv(2, 6, 3, 100, 16, 0)
    g = torch.Generator().manual_seed(1)
    hs, page = (6 if per_q else 3), 8
    pages = torch.randint(0, 13, (2, hs, 5), generator=g)
    counts = torch.randint(1, 6, (2, hs), generator=g)
    w = torch.rand(2, hs, 5, generator=g, dtype=torch.float64) + 0.5
    lens = torch.tensor([100, 61])
    out, lse = sparse_decode_reference(q, k, v, pages, counts, w, page_size=page, lengths=lens, sink=3, window=9)
    for b in range(2):
        length = int(lens[b])
        sink_end, win_start = min(3, length), max(length - 9, 3)
        dense = list(range(sink_end)) + list(range(win_start, length))
        for h in range(hs):
            toks = dense + [int(p) * page + i for p in pages[b, h, : counts[b, h]] for i in range(page)
                            if sink_end <= int(p) * page + i < win_start]
            wts = [1.0] * len(dense) + [float(w[b, h, j]) for j in range(int(counts[b, h])) for i in range(page)
                                        if sink_end <= int(pages[b, h, j]) * page + i < win_start]
            heads = [h] if per_q else list(range(h * 2, h * 2 + 2))
            kv = h // 2 if per_q else h
            for hq in heads:
                s = (k[b, kv, toks] @ q[b, hq]) / 4 + torch.log(torch.tensor(wts, dtype=torch.float64))
                ref_lse = torch.logsumexp(s, 0)
                ref = torch.softmax(s, 0) @ v[b, kv, toks]
                assert torch.allclose(out[b, hq], ref, atol=1e-10)
                assert abs(float(lse[b, hq]) - float(ref_lse)) < 1e-5


def test_reference_tokens_match_the_contract():
    for seed, hs in ((0, 2), (1, 4)):
        q, k, v = _qkv(3, 4, 2, 40, 8, seed)
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, 40, (3, hs, 12), generator=g)  # duplicates included
        counts = torch.randint(1, 13, (3, hs), generator=g)
        w = torch.rand(3, hs, 12, generator=g, dtype=torch.float64) * 4 + 0.1
        out, lse = sparse_decode_reference(q, k, v, idx, counts, w)
        ref, ref_lse = weighted_sparse_decode_reference(q, k, v, idx, counts, w)
        assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(lse.double(), ref_lse, atol=1e-5)


def check_page_summaries(quest_pages, pages=(4, 16), steps=(1, 1, 2, 17, 40, 1)):
    """PageSummaries equal a fresh summary after appends of any size, on a growing cache and on one of
    fixed shape, and after a row got shorter (ragged rows: each row appends the same count)."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 200, 64, generator=g).to(torch.bfloat16)
    for page in pages:
        for fixed_shape in (False, True):
            ps = quest_pages.PageSummaries(page)
            lens = torch.tensor([40, 21], dtype=torch.int32)
            n = 40
            ps.update(k if fixed_shape else k[:, :, :n], lens)
            for step in (*steps, -30, 5):
                lens = torch.clamp(lens + step, min=1)
                n = int(lens.max()) if not fixed_shape else 200
                kk = k[:, :, :max(n, 40)]
                got = ps.update(kk, lens)
                want = quest_pages.page_minmax_reference(kk, lens, page)
                live = (torch.arange(got[0].shape[2]) * page < lens[:, None])[:, None, :, None]
                assert torch.equal(torch.where(live, got[0], 0), torch.where(live, want[0], 0)), (page, step)
                assert torch.equal(torch.where(live, got[1], 0), torch.where(live, want[1], 0)), (page, step)


def test_page_summaries_follow_any_appends():
    check_page_summaries(quest_pages)


def test_quest_select_picks_the_reference_methods_pages():
    """Given the same bounds, the device selection equals methods/quest.py's reference selection."""
    import kvsieve
    from kvsieve.core.inputs import check_decode_inputs

    for seed, share in ((0, False), (1, True), (2, False)):
        q, k, v = _qkv(2, 8, 2, 300, 16, seed, torch.float32)
        lens = torch.tensor([300, 170])
        m = kvsieve.method(f"quest:top_k=40,page_size=16,sink=8,window=24,share_kv_group={share}")
        inputs = check_decode_inputs(q, k, v, lengths=lens)
        chosen = m.select(inputs, None, m.new_state()).chosen
        want = chosen.to_heads(8).mark(300)
        kmin, kmax = quest_pages.page_minmax_reference(k, lens, 16)
        pages, counts = quest_pages.quest_select(q, kmin, kmax, lens, page_size=16, sink=8, window=24,
                                                 size=40, max_pages=3,
                                                 share_kv_group=share, bounds="reference")
        hs = pages.shape[1]
        got = torch.zeros(2, hs, 300, dtype=torch.bool)
        for b in range(2):
            length = int(lens[b])
            se, ws = min(8, length), max(length - 24, 8)
            got[b, :, :se] = True
            got[b, :, ws:length] = True
            for h in range(hs):
                for p in pages[b, h, : counts[b, h]].tolist():
                    lo, hi = max(p * 16, se), min(p * 16 + 16, ws)
                    got[b, h, lo:hi] = True
        if hs != 8:
            got = got.repeat_interleave(4, dim=1)
        assert torch.equal(got, want), seed


def test_launch_overrides_are_checked():
    """The selection launches' overrides (tune_quest.py) refuse values their kernels cannot take, by name,
    before anything launches."""
    pytest.importorskip("triton")
    from kvsieve.kernels.shared import select_triton

    q, k, _ = _qkv(1, 8, 2, 64, 16, 0, torch.float32)
    lens = torch.tensor([64], dtype=torch.int32)
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, 16)
    kw = dict(page_size=16, sink=0, window=0, size=16, max_pages=1, share_kv_group=True)
    for opts, match in (({"bound": {}}, "unknown launch 'bound'"), ({"rows": 4}, "a dict of keyword"),
                        ({"bounds": {"block_p": 8}}, "block_p: expected a power of two in 16..1024"),
                        ({"bounds": {"block_p": 48}}, "block_p"), ({"bounds": {"tiles": 0}}, "tiles"),
                        ({"bounds": {"num_warps": 3}}, "num_warps"), ({"bounds": {"num_stages": 0}}, "num_stages")):
        with pytest.raises(ValueError, match=match):
            quest_pages.quest_select(q, kmin, kmax, lens, launch_opts=opts, **kw)
    parts = (torch.empty(1, 8, 4), torch.empty(1, 8, 4))
    with pytest.raises(ValueError, match=r"parts: expected two \[1, 8, 1\] tensors"):
        quest_pages.page_bounds_triton(q, kmin, kmax, lens, 16, parts=parts)
    s = torch.zeros(1, 2, 100)
    for opts, match in (({"chunk": 4}, "chunk"), ({"block_x": 100}, "block_x"),
                        ({"block_x": 64, "chunk": 128}, "chunk"), ({"num_warps": 64}, "num_warps")):
        with pytest.raises(ValueError, match=match):
            select_triton.group_sum_rows_triton(s, 2, parts, lens, 16, 0, 0, **opts)
    with pytest.raises(ValueError, match="segment"):
        select_triton.topk_rows_triton(s, torch.ones(1, dtype=torch.long), 4, segment=0)
    with pytest.raises(ValueError, match="num_warps"):
        select_triton.topk_rows_triton(s, torch.ones(1, dtype=torch.long), 4, num_warps=6)
    with pytest.raises(ValueError, match="programs"):
        select_triton.topk_rows_registers(s, torch.ones(1, dtype=torch.long), 4, programs=0)


def test_tuner_selection_check_tells_near_ties_from_wrong_pages():
    """tune_quest.py's check of a setting's selection against the defaults': equal sets, sets that differ
    only at a near-tie of the reference scores (accepted), a worse page or a repeated one (refused)."""
    sys.path.insert(0, str(HERE.parent / "benchmarks" / "sparse_decode"))
    try:
        from tune_quest import selection_check
    finally:
        sys.path.pop(0)
    scores = torch.tensor([[[5.0, 4.0, 3.0, 3.0 - 1e-6, 1.0, 0.0]]])
    counts = torch.tensor([[3]])
    want = (torch.tensor([[[0, 1, 2, 0]]]), counts)
    assert selection_check((torch.tensor([[[2, 0, 1, 5]]]), counts), want, scores)["same"]
    tie = selection_check((torch.tensor([[[0, 1, 3, 0]]]), counts), want, scores)
    assert not tie["same"] and tie["ok"] and tie["rows_differ"] == 1
    assert not selection_check((torch.tensor([[[0, 1, 4, 0]]]), counts), want, scores)["ok"]
    assert not selection_check((torch.tensor([[[0, 1, 1, 0]]]), counts), want, scores)["ok"]
    assert not selection_check((torch.tensor([[[0, 1, 2, 0]]]), torch.tensor([[2]])), want, scores)["ok"]


def test_topk_select_picks_the_reference_methods_keys():
    import kvsieve
    from kvsieve.core.inputs import check_decode_inputs
    from kvsieve.kernels.oracle_topk.topk import topk_select

    for seed, share in ((0, False), (1, True)):
        q, k, v = _qkv(2, 8, 2, 200, 16, seed, torch.float32)
        lens = torch.tensor([200, 90])
        m = kvsieve.method(f"oracle-topk:top_k=30,sink=4,window=16,share_kv_group={share}")
        want = m.select(check_decode_inputs(q, k, v, lengths=lens), None, m.new_state()).chosen.to_heads(8).mark(200)
        idx, counts = topk_select(q, k, lens, sink=4, window=16, size=30, max_k=30,
                                  share_kv_group=share, scores="reference")
        got = torch.zeros(2, idx.shape[1], 200, dtype=torch.bool)
        for b in range(2):
            length = int(lens[b])
            got[b, :, :4] = True
            got[b, :, max(length - 16, 4):length] = True
            for h in range(idx.shape[1]):
                got[b, h, idx[b, h, : counts[b, h]]] = True
        got = got.repeat_interleave(8 // idx.shape[1], dim=1)
        assert torch.equal(got, want), seed


# The register select compiled for the H100 (sm_90) with the installed Triton: the interpreter does not
# type-check branches, and a row held in registers must not spill at Quest's 128k-context pages (8192,
# 8 warps). Seen with Triton 3.6: 254 registers group-summed (chunks of 512), 245 per query head, no spill;
# 16384 pages with 16 warps spill 148 bytes.
COMPILE_REGISTER_SELECT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvsieve.kernels.shared import select_triton

kernel = select_triton._select_regs_kernel
pointers = {"s_ptr": "*fp32", "pm_ptr": "*fp32", "pl_ptr": "*fp32", "cnt_ptr": "*i64", "lens_ptr": "*i32",
            "gs_ptr": "*fp32", "tk_ptr": "*i32", "out_ptr": "*i64"}
for share in (True, False):
    meta = {"G": 4 if share else 1, "BLOCK_G": 4 if share else 2, "SHARE": share, "UNIT": 16, "XT": 8192,
            "CHUNK": 512, "BLOCK_PART": 512}
    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in meta:
            signature[name], constexprs[(i,)] = "constexpr", meta[name]
        else:
            signature[name] = pointers.get(name, "i32")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs={})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})
    print("compiled", compiled.metadata.shared)
"""


@pytest.mark.triton
def test_register_select_compiles_for_the_h100():
    pytest.importorskip("triton")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", COMPILE_REGISTER_SELECT], capture_output=True, text=True,
                         env=env, cwd=HERE.parent)
    if "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("this triton install has no ptxas")
    assert res.returncode == 0 and res.stdout.count("compiled") == 2, res.stderr[-3000:]


CASES = "sparse_interpreter_cases.py"


@pytest.mark.triton
# the top-k selection's rows-select cases (the slowest) but one, apart from the others
@pytest.mark.parametrize("group", case_groups(CASES, "test_topk_device_selection_matches_the_reference|triton-rows and "
                                                     "not True-True",
                                              "test_kernel_matches_reference",
                                              "test_quest_device_selection_matches_the_reference|triton-rows",
                                              "test_methods_triton_path_matches_their_reference",
                                              "test_selection_kernels_match_their_references",
                                              "test_quest_launch_overrides_keep_the_selection",
                                              "test_row_select_matches_its_reference_with_ties_and_empty_rows"),
                         ids=group_id)
def test_kernels_under_the_triton_interpreter(group):
    pytest.importorskip("triton")
    run_interpreter_cases(CASES, group)


# --- GPU --------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_case(b, n, page, hs, seed, density=0.05):
    q, k, v = _qkv(b, 32, 8, n, 128, seed, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    p = -(-n // page)
    count = max(1, int(density * n) // page)
    idx = torch.rand(b, hs, p, device="cuda", generator=g).argsort(-1)[..., :count].contiguous()
    counts = torch.randint(1, count + 1, (b, hs), device="cuda", generator=g)
    w = torch.rand(b, hs, count, device="cuda", generator=g) + 0.5
    lens = torch.randint(n // 2, n + 1, (b,), device="cuda", generator=g).to(torch.int32)
    return q, k, v, idx, counts, w, lens


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("page,hs,n", [(1, 8, 4096), (16, 8, 32768), (32, 32, 16384), (64, 8, 32768),
                                       (16, 32, 8192)])
def test_gpu_bf16_matches_reference(page, hs, n):
    from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton

    for seed in range(2):
        q, k, v, idx, counts, w, lens = _gpu_case(2, n, page, hs, seed)
        for sink, window in ((0, 0), (128, 512)):
            out, lse = sparse_decode_triton(q, k, v, idx, counts, w, page_size=page, lengths=lens, sink=sink,
                                            window=window, check=True)
            ref, ref_lse = sparse_decode_reference(q, k, v, idx, counts, w, page_size=page, lengths=lens,
                                                   sink=sink, window=window)
            err = float((out.float() - ref).norm() / ref.norm())
            assert err < 1e-2, err
            assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
@cuda
def test_gpu_fused_merge_matches_reference_over_many_calls():
    """The opt-in one-launch path (ticket counter): a race would show as a wrong row in some call."""
    from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton

    for seed in range(20):
        q, k, v, idx, counts, w, lens = _gpu_case(2, 8192, 16, 8, 100 + seed)
        out, lse = sparse_decode_triton(q, k, v, idx, counts, w, page_size=16, lengths=lens, sink=32, window=256,
                                        fused_merge=True)
        ref, ref_lse = sparse_decode_reference(q, k, v, idx, counts, w, page_size=16, lengths=lens, sink=32,
                                               window=256)
        assert float((out.float() - ref).norm() / ref.norm()) < 1e-2, seed
        assert torch.allclose(lse, ref_lse, atol=2e-3, rtol=1e-4), seed


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("d,dtype", [(64, torch.float16), (256, torch.bfloat16), (128, torch.float32)])
def test_gpu_head_dims_and_dtypes(d, dtype):
    from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton

    q, k, v = _qkv(2, 8, 2, 5000, d, 4, dtype, "cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    idx = torch.randint(0, 5000 // 16, (2, 2, 20), device="cuda", generator=g)
    counts = torch.full((2, 2), 20, device="cuda")
    out, lse = sparse_decode_triton(q, k, v, idx, counts, page_size=16, sink=16, window=64, check=True)
    ref, ref_lse = sparse_decode_reference(q, k, v, idx, counts, page_size=16, sink=16, window=64)
    tol = 2e-3 if dtype == torch.float32 else 1e-2  # fp32 dots may run as tf32 on Hopper
    assert float((out.float() - ref).norm() / ref.norm()) < tol


def _quest_step(q, k, v, lens, summaries, size, share, select="triton"):
    kmin, kmax = summaries.update(k, lens)
    pages, counts = quest_pages.quest_select(q, kmin, kmax, lens, page_size=16, sink=128, window=128, size=size,
                                             max_pages=-(-int(size * k.shape[2]) // 16), share_kv_group=share,
                                             select=select)
    from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton

    return sparse_decode_triton(q, k, v, pages, counts, page_size=16, lengths=lens, sink=128, window=128)


def _topk_step(q, k, v, lens, size, share, select="triton"):
    from kvsieve.kernels.oracle_topk.topk import topk_select
    from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton

    idx, counts = topk_select(q, k, lens, sink=128, window=128, size=size, max_k=int(size * k.shape[2]),
                              share_kv_group=share, select=select)
    return sparse_decode_triton(q, k, v, idx, counts, lengths=lens, sink=128, window=128)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("spec", ["streaming:sink=64,window=1000", "quest:top_k=0.05",
                                  "quest:top_k=0.05,share_kv_group=True", "oracle-topk:top_k=0.05",
                                  "oracle-topk:top_k=0.05,share_kv_group=True"])
def test_gpu_methods_run_the_kernel_path_by_default(spec):
    import kvsieve

    q, k, v = _qkv(2, 32, 8, 8192, 128, 6, torch.bfloat16, "cuda")
    lens = torch.tensor([8192, 5000], device="cuda")
    m = kvsieve.method(spec)
    state = m.new_state()
    out, stats = m.decode(q, k, v, lengths=lens, state=state, check_finite=False)
    ref, ref_stats = kvsieve.method(spec + ",backend=reference").decode(q, k, v, lengths=lens)
    assert stats.backend == "triton" and ref_stats.backend == "reference"
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-2
    assert abs(stats.density - ref_stats.density) < 0.01 * ref_stats.density


@pytest.mark.gpu
@cuda
def test_gpu_decode_paths_do_not_sync_and_replay_in_a_graph():
    from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton

    q, k, v, idx, counts, w, lens = _gpu_case(2, 16384, 16, 8, 5)
    summaries = quest_pages.PageSummaries(16)
    tokens = 0.05
    calls = {
        "pages": lambda: sparse_decode_triton(q, k, v, idx, counts, w, page_size=16, lengths=lens, sink=64,
                                              window=256),
        "streaming": lambda: sparse_decode_triton(q, k, v, lengths=lens, sink=128, window=700),
        "quest-q": lambda: _quest_step(q, k, v, lens, summaries, tokens, False),
        "quest-kv": lambda: _quest_step(q, k, v, lens, summaries, tokens, True),
        "oracle-topk-kv": lambda: _topk_step(q, k, v, lens, tokens, True),
        "oracle-topk-q": lambda: _topk_step(q, k, v, lens, tokens, False),
        "quest-kv@torch-select": lambda: _quest_step(q, k, v, lens, summaries, tokens, True, "torch"),
        "oracle-topk-kv@torch-select": lambda: _topk_step(q, k, v, lens, tokens, True, "torch"),
    }
    for name, fn in calls.items():
        eager = fn()  # compiles, allocates workspaces and page summaries
        _, graph, captured = warm_check_and_capture(fn)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], eager[0]), name
        assert torch.equal(captured[1], eager[1]), name


def _check_near_ties(idx, counts, ref_idx, ref_counts, scores):
    """Same counts; per row no duplicate and every chosen unit scores, in the reference's float32 scores,
    at least the reference's count-th best less a rounding margin (the kernels' fp32 sums run in another
    order, so a near-tie may flip); returns the fraction of rows whose sets are equal."""
    assert torch.equal(counts, ref_counts)
    same = rows = 0
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            c = int(counts[b, h])
            if c == 0:
                continue
            got = idx[b, h, :c]
            assert got.unique().numel() == c, (b, h)
            kth = float(scores[b, h, ref_idx[b, h, c - 1]])
            assert float(scores[b, h, got].min()) >= kth - 1e-3 * (1 + abs(kth)), (b, h)
            same += set(got.tolist()) == set(ref_idx[b, h, :c].tolist())
            rows += 1
    return same / max(rows, 1)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n", [32768, 131072])
@pytest.mark.parametrize("kind", ["quest", "oracle-topk"])
def test_gpu_device_selection_matches_the_reference(kind, n):
    """Llama-3.1-8B shape, bf16, two rows of different lengths, 5% of the keys: every select path (the
    default Triton select, the torch one) against the torch reference, per query head and group-summed."""
    from kvsieve.kernels.oracle_topk import topk

    q, k, _ = _qkv(2, 32, 8, n, 128, 7, torch.bfloat16, "cuda")
    lens = torch.tensor([n, n // 2 + 3], device="cuda", dtype=torch.int32)
    sink = window = 128
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, 16)
    cand_pages = score_kernels.candidate_mask(lens, kmin.shape[2], 16, sink, window)[:, None, :]
    for share in (False, True):
        if kind == "quest":
            kw = dict(page_size=16, sink=sink, window=window, size=0.05, max_pages=-(-int(0.05 * n) // 16),
                      share_kv_group=share)
            ref = quest_pages.quest_select(q, kmin, kmax, lens, bounds="reference", **kw)
            if share:
                s = score_kernels.group_summed(quest_pages.page_bounds_reference(q, kmin, kmax, lens, 16), 4)
                s = s.masked_fill(~cand_pages, float("-inf"))
            else:
                s = quest_pages.page_bounds_reference(q, kmin, kmax, lens, 16, sink, window)
        else:
            kw = dict(sink=sink, window=window, size=0.05, max_k=int(0.05 * n), share_kv_group=share)
            ref = topk.topk_select(q, k, lens, scores="reference", **kw)
            if share:
                s = score_kernels.group_summed(score_kernels.scores_reference(q, k, lens), 4)
                s = s.masked_fill(~score_kernels.candidate_mask(lens, n, 1, sink, window)[:, None, :], float("-inf"))
            else:
                s = score_kernels.scores_reference(q, k, lens, sink, window)
        for select in ("triton", "torch"):
            if kind == "quest":
                got = quest_pages.quest_select(q, kmin, kmax, lens, select=select, **kw)
            else:
                got = topk.topk_select(q, k, lens, select=select, **kw)
            assert _check_near_ties(*got, *ref, s) >= 0.5, (share, select)


# Non-default launch settings (tune_quest.py's kind) of every selection launch that runs at 32k / 128k
GPU_OVERRIDES = [{"bounds": {"block_p": 128, "num_warps": 8}}, {"bounds": {"tiles": 4, "num_stages": 3}},
                 {"bounds": {"block_p": 32, "tiles": 8, "num_stages": 2}},
                 {"group_sum": {"block_x": 256, "chunk": 256, "num_warps": 8}},
                 {"rows": {"segment": 1024}}, {"rows": {"segment": 512, "num_warps": 16}},
                 {"registers": {"programs": 512, "num_warps": 16}}, {"registers": {"programs": 32, "num_warps": 4}}]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n", [32768, 131072])
def test_gpu_launch_overrides_keep_the_selection(n):
    """Llama-3.1-8B shape, bf16, two rows of different lengths, 5 %: quest_select under non-default launch
    settings picks the default settings' pages, up to near-ties of the group-summed ranking (its float32
    sums may run in another order), twice (ticket counters reset)."""
    q, k, _ = _qkv(2, 32, 8, n, 128, 9, torch.bfloat16, "cuda")
    lens = torch.tensor([n, n // 2 + 3], device="cuda", dtype=torch.int32)
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, 16)
    for share in (False, True):
        kw = dict(page_size=16, sink=128, window=128, size=0.05, max_pages=-(-int(0.05 * n) // 16),
                  share_kv_group=share)
        idx, counts = quest_pages.quest_select(q, kmin, kmax, lens, **kw)
        scores = quest_pages.quest_scores_reference(q, kmin, kmax, lens, 16, 128, 128, share)
        # best first, as _check_near_ties reads the reference (the device lists are in page order)
        taken = torch.arange(idx.shape[-1], device="cuda") < counts[..., None]
        order = torch.where(taken, scores.gather(-1, idx), float("-inf")).argsort(dim=-1, descending=True, stable=True)
        want = (idx.gather(-1, order), counts)
        for opts in GPU_OVERRIDES:
            for _ in range(2):
                got = quest_pages.quest_select(q, kmin, kmax, lens, launch_opts=opts, **kw)
                assert _check_near_ties(*got, *want, scores) >= 0.9, (share, opts)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("x,k", [(2048, 87), (8192, 410), (16384, 800), (32768, 1600), (131072, 6500)])
def test_gpu_row_select_matches_its_reference(x, k):
    """The select launch alone on the device, with and without the prefilter, at Quest's (pages) and
    oracle-topk's (keys) row lengths of 32k/128k contexts: exactly the reference's units (ties to the
    lowest index), on rows with −inf, many ties, one value, count 0 and every finite value."""
    from kvsieve.kernels.shared.select_triton import (
        GROUP_MAX,
        REGISTER_SELECT_MAX,
        topk_rows_reference,
        topk_rows_registers,
        topk_rows_triton,
    )

    g = torch.Generator(device="cuda").manual_seed(x)
    s = torch.randn(3, 8, x, device="cuda", generator=g) * 3
    s[0, 1, ::3] = float("-inf")
    s[1, 2] = (s[1, 2] * 2).round()
    s[2, 3] = 1.5
    counts = torch.tensor([k, 0, k], device="cuda")
    maxima = torch.nn.functional.pad(s, (0, -x % GROUP_MAX), value=float("-inf"))
    maxima = maxima.view(3, 8, -1, GROUP_MAX).amax(-1).contiguous()
    want = topk_rows_reference(s, counts, k)
    assert torch.equal(topk_rows_triton(s, counts, k), want)
    for _ in range(3):  # rows over 8192 units split over programs: their ticket counters must reset
        assert torch.equal(topk_rows_triton(s, counts, k, maxima=maxima), want)
    if x <= REGISTER_SELECT_MAX:  # Quest's pages: the register select
        assert torch.equal(topk_rows_registers(s, counts, k), want)


def test_oracle_topk_takes_the_radix_select_for_long_per_query_head_rows():
    """The measured crossover (topk.RADIX_SELECT_ABOVE): per query head at 128k keys the radix select spread
    over the GPU beats torch.topk and the Triton select; per KV head, and at 64k keys or fewer, the Triton select."""
    from kvsieve.kernels.oracle_topk.topk import RADIX_SELECT_ABOVE, select_path

    assert select_path(False, RADIX_SELECT_ABOVE + 1) == "radix"
    assert select_path(False, RADIX_SELECT_ABOVE) == "triton"
    assert select_path(True, 4 * RADIX_SELECT_ABOVE) == "triton"
