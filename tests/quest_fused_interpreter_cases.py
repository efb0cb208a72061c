"""Quest's chunked page select (``kernels/shared/select_chunked.py``) and the method's device path with it,
against their torch references on the CPU through Triton's interpreter. Not collected on its own:
``tests/test_quest_fused.py`` runs this file in a subprocess with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_quest_fused.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

from sparse_interpreter_cases import SELECTION_SHAPES, _selection_case  # noqa: E402
from sparse_interpreter_cases import _same_sets as same_sets  # noqa: E402

from kvsieve.kernels.quest import quest_pages  # noqa: E402
from kvsieve.kernels.shared import select_chunked  # noqa: E402
from kvsieve.kernels.shared.scores import candidate_mask, group_summed  # noqa: E402
from kvsieve.kernels.shared.select_triton import topk_rows_reference  # noqa: E402

pytestmark = pytest.mark.triton


def _same_sets(idx, counts, ref_idx, ref_counts):
    """The selection tests' check (equal counts, each row's first ``count`` entries distinct and the
    reference's set), and the list ascending, zeros after the count."""
    same_sets(idx, counts, ref_idx, ref_counts)
    take = torch.arange(idx.shape[-1]) < counts[..., None]
    assert (torch.where(take[..., 1:], idx.diff(dim=-1), 1) > 0).all()
    assert not torch.where(take, 0, idx).any()


# the selection tests' shapes (GQA groups 4 and 1, ragged rows, fp32/fp16/bf16) and a longer row of many chunks
SHAPES = [*SELECTION_SHAPES, (3, 1, 8, 2, 2100, 32, torch.float32)]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("programs", [None, 3, 1000])
def test_chunked_select_matches_the_reference(share, programs):
    """quest_select(select="chunked") against its torch reference (the same bounds in torch): pages 16/32,
    sizes as counts and fractions, with and without a dense part; one chunk per row, a few, or chunks of
    the least size; twice per setting (the ticket counters are back at 0 after a call)."""
    opts = None if programs is None else {"chunked": {"programs": programs}}
    for seed, b, hq, hkv, n, d, dtype in SHAPES:
        q, k, lens = _selection_case(seed, b, hq, hkv, n, d, dtype)
        for page, size, (sink, window) in ((16, 40, (0, 0)), (32, 0.1, (4, 40)), (16, 1.0, (4, 40))):
            kmin, kmax = quest_pages.page_minmax_reference(k, lens, page)
            mp = -(-(size if isinstance(size, int) else int(n * size)) // page)
            kw = dict(page_size=page, sink=sink, window=window, size=size, max_pages=mp, share_kv_group=share)
            want = quest_pages.quest_select(q, kmin, kmax, lens, bounds="reference", **kw)
            for _ in range(2):
                _same_sets(*quest_pages.quest_select(q, kmin, kmax, lens, select="chunked", launch_opts=opts, **kw),
                           *want)


def _parts(s: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scoring launches' per-block softmax partials of ``s [B, H, X]``: max (−inf for none) and Σ e^(s − max)."""
    b, h, x = s.shape
    blocks = -(-x // block)
    sp = torch.nn.functional.pad(s, (0, blocks * block - x), value=float("-inf")).view(b, h, blocks, block)
    m = sp.amax(-1)
    ref = torch.where(m > float("-inf"), m, 0.0)
    return m.contiguous(), torch.exp(sp - ref[..., None]).sum(-1).contiguous()


@pytest.mark.parametrize("spread", [1.0, 1e-4, 3e4])
def test_chunked_rows_equal_the_reference_lists_with_ties_and_empty_rows(spread):
    """topk_rows_chunked on rows of one query head each: the reference's list exactly (ascending, ties at
    the threshold to the lowest index), on integer scores full of ties, −inf units, a row with no finite
    score (count 0), counts of 1 and of every finite unit; values spread over 1e-4 (every unit in the first
    bin) to 3e4 (most beyond the last finite bin)."""
    g = torch.Generator().manual_seed(5)
    b, h, x, k = 3, 4, 1500, 300
    s = torch.randint(-20, 20, (b, h, x), generator=g).float() * spread
    s[torch.rand(b, h, x, generator=g) < 0.2] = float("-inf")
    s[1, 2] = float("-inf")
    counts = torch.tensor([k, 1, 0])
    s[1] = torch.where(torch.arange(x) < 40, s[1], float("-inf"))  # row 1: count 1 of at most 40 finite
    finite = torch.isfinite(s).sum(-1)
    s[2, :, :] = torch.where(torch.arange(x) < 30, s[2], float("-inf"))
    assert int(finite[0].min()) >= k
    parts = _parts(s, 64)
    for programs in (None, 7):
        out = select_chunked.topk_rows_chunked(s, counts, k, parts=parts, programs=programs)
        want = topk_rows_reference(s, counts, k)
        for r in range(b):
            for hh in range(h):
                if int(counts[r]) <= int(torch.isfinite(s[r, hh]).sum()):
                    assert torch.equal(out[r, hh], want[r, hh]), (r, hh)
                else:  # a count beyond the row's finite units (never from the scoring launches): those only
                    assert not out[r, hh].any(), (r, hh)
    # every finite unit of the row
    s2 = s[:1, :1].clone()
    c = int(torch.isfinite(s2).sum())
    out = select_chunked.topk_rows_chunked(s2, torch.tensor([c]), c, parts=_parts(s2, 64))
    assert torch.equal(out, topk_rows_reference(s2, torch.tensor([c]), c))


def test_chunked_group_summed_rows_match_the_reference():
    """group > 1: rows ranked by the group-summed softmax, units off [sink_end, window_start) never chosen."""
    g = torch.Generator().manual_seed(9)
    b, hq, group, x, unit, sink, window = 2, 8, 4, 900, 8, 20, 100
    lens = torch.tensor([x * unit, 5000], dtype=torch.int32)
    s = torch.randn(b, hq, x, generator=g) * 3
    s = s.masked_fill(torch.arange(x)[None, None, :] * unit >= lens.long()[:, None, None], float("-inf"))
    ranked = group_summed(s, group).masked_fill(~candidate_mask(lens, x, unit, sink, window)[:, None, :],
                                                float("-inf"))
    counts = torch.tensor([50, 120])
    out = select_chunked.topk_rows_chunked(s, counts, 120, parts=_parts(s, 64), group=group, lengths=lens,
                                           unit=unit, sink=sink, window=window, programs=16)
    _same_sets(out, counts[:, None].expand(b, hq // group), topk_rows_reference(ranked, counts, 120),
               counts[:, None].expand(b, hq // group))


@pytest.mark.parametrize("share", [False, True])
def test_bounds_launch_refreshes_the_summaries_after_any_appends(share):
    """quest_select(refresh=PageSummaries.pending(...)): after appends of 1, 2, 17 and 40 keys, shrunk rows
    and a call with nothing appended, the buffers equal page_minmax_reference below each row's length and
    the pages the reference's (page sizes 4 and 16: many and one page per program tile)."""
    g = torch.Generator().manual_seed(21)
    b, hq, hkv, d, n_max = 2, 8, 2, 32, 600
    k = torch.randn(b, hkv, n_max, d, generator=g)
    for page in (4, 16):
        summaries = quest_pages.PageSummaries(page)
        lens = torch.tensor([300, 170], dtype=torch.int32)
        n = 300
        for step, grow in enumerate((0, 1, 2, 17, 40, 0, -30, 1)):
            n += max(grow, 0)
            lens = torch.clamp(lens + grow, min=1).to(torch.int32)
            kk = k[:, :, :n]
            q = torch.randn(b, hq, d, generator=g) * 2
            kmin, kmax, refresh = summaries.pending(kk, lens)
            assert (refresh is None) == (step == 0)
            kw = dict(page_size=page, sink=4, window=20, size=0.1, max_pages=8, share_kv_group=share)
            got = quest_pages.quest_select(q, kmin, kmax, lens, select="chunked", refresh=refresh, **kw)
            want_min, want_max = quest_pages.page_minmax_reference(kk, lens, page)
            # pages past a row's length are never read (a shrunk row leaves them as they were)
            live = (torch.arange(kmin.shape[2]) * page < lens[:, None])[:, None, :, None]
            for got_t, want_t in ((kmin, want_min), (kmax, want_max)):
                assert torch.equal(torch.where(live, got_t, 0), want_t), (page, step)
            assert torch.equal(summaries.done, lens[:, None].expand(b, hkv)), (page, step)
            _same_sets(*got, *quest_pages.quest_select(q, want_min, want_max, lens, bounds="reference", **kw))


@pytest.mark.parametrize("spec,select,fused", [("quest:top_k=24,device_select=chunked", "chunked", False),
                                               ("quest:top_k=24,fused_update=True,pdl=True", "triton", True)])
def test_method_stats_say_which_device_path_ran(spec, select, fused):
    """stats.extra names the select, whether the update ran in the bounds launch (from the second call: the
    first builds the summaries whole) and whether PDL ran (never under the interpreter). The outputs against
    the reference: sparse_interpreter_cases.py's test_methods_triton_path_matches_their_reference."""
    import kvsieve

    m = kvsieve.method(spec + ",page_size=8,backend=triton")
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 8, 64, generator=g), torch.randn(1, 2, 90, 64, generator=g)
    state = m.new_state()
    for step in range(2):
        _, stats = m.decode(q, k[:, :, :80 + step], k[:, :, :80 + step], state=state)
        assert (stats.extra["select"], stats.extra["fused_update"], stats.extra["pdl"]) == \
            (select, fused and step == 1, False)


def test_gpu_script_check_mode_runs_a_tiny_case():
    """benchmarks/sparse_decode/quest_fused.py's --check path on one tiny case: every variant's pages equal
    the reference's and its rows are complete."""
    import argparse
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "sparse_decode"
    sys.path.insert(0, str(bench))
    try:
        import quest_fused
        from tune_quest import WallTimer
    finally:
        sys.path.remove(str(bench))
    args = argparse.Namespace(check=True, density=0.2, warmup=0, iters=1, flashinfer=None, pdl_ok=False)
    rows = quest_fused.run_case(1024, 1, "uniform", args, WallTimer(), lambda r: None)
    assert {r["variant"] for r in rows} == {"main", "main+pdl", "main+fused-update", "chunked", "chunked+pdl",
                                            "chunked+fused-update", "chunked+fused-update+pdl"}
    assert all(r.get("ok") and "call_us" in r and "selection_us" in r for r in rows), rows
    assert "| quest-kv | chunked |" in quest_fused.markdown(
        {"device": "cpu", "date": "-", "command": "-", "torch": "-", "triton": "-", "protocol": "-",
         "pdl_available": False, "seconds": 0.0, "rows": rows})
