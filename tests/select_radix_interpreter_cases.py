"""The radix top-k (``kernels/shared/select_radix.py``) against the torch reference, through ``topk_select`` and in
vAttention, on the CPU through Triton's interpreter. Not collected on its own: ``tests/test_select_radix.py`` runs
this file in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen when triton is imported).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_select_radix.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

from kvsieve.kernels.shared.select_radix import topk_rows_radix  # noqa: E402
from kvsieve.kernels.shared.select_triton import topk_rows_reference  # noqa: E402
from kvsieve.kernels.shared.triton_utils import workspace  # noqa: E402

pytestmark = pytest.mark.triton


def hard_rows(x: int, seed: int) -> torch.Tensor:
    """``[2, 5, x]`` random rows with what a digit-by-digit search must get right: −inf, many ties, one value,
    negatives and positives, a narrow range (most high bits shared: every digit refines), a very wide one,
    and values whose second byte tells them apart (the answer's bin is taken whole after two digits)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, 5, x, generator=g) * 3
    s[0, 1, ::3] = float("-inf")
    s[0, 2] = (s[0, 2] * 2).round()  # many ties
    s[0, 3] = 1.5  # one value
    s[0, 4] = 1.0 + torch.randint(0, 128, (x,), generator=g) / 128  # 128 values, each its own second-byte bin
    s[1, 0, : x // 2] = -s[1, 0, : x // 2].abs()
    s[1, 1] = 1000 + torch.rand(x, generator=g) * 1e-3  # narrow
    s[1, 2] = torch.randn(x, generator=g) * torch.exp(torch.randn(x, generator=g) * 20)  # very wide
    s[1, 3] = -(torch.rand(x, generator=g) * 30)  # log-probability-like, all negative
    s[1, 4] = torch.randn(x, generator=g) - 12  # logits-like
    return s


def _zero_histograms(like: torch.Tensor) -> bool:
    return bool((workspace("radix_hist", like, 1, torch.int32) == 0).all())


@pytest.mark.parametrize("x,k,chunk,seed", [(1, 1, 16, 0), (7, 5, 16, 0), (300, 40, 64, 0), (300, 40, 128, 1),
                                           (1000, 1000, 512, 0), (1000, 999, 256, 1), (1500, 1, 512, 0),
                                           (2049, 300, 2048, 1)])
def test_radix_select_equals_the_reference(x, k, chunk, seed):
    """The reference's list — ascending, ties at the threshold to the lowest index, zeros after — with counts
    0, 1, below k, k = every unit, = every finite value (the rows with −inf); chunks that do not divide the
    row; twice (the histograms are left zero for the next call); histograms with and without their mask."""
    s = hard_rows(x, seed)
    finite = int(torch.isfinite(s[0]).sum(-1).min())
    for counts in (torch.tensor([min(k, finite), k if x > 1 else 0]), torch.tensor([0, min(k, 1)])):
        want = topk_rows_reference(s, counts, k)
        got = topk_rows_radix(s, counts, k, chunk=chunk, hist_mask=seed == 0)  # either histogram form
        assert torch.equal(got, want), (counts, (got != want).nonzero()[:5])
        assert _zero_histograms(s)


@pytest.mark.parametrize("seed", [2, 3])
def test_radix_select_does_not_depend_on_the_launch_settings(seed):
    """Random rows and counts: one program per row, a few, many (chunks of 16) and the default, digits of 4 to
    8 bits (the last one narrower where they do not divide 32), histograms with and without tl.histogram's
    mask give one list; an ``out`` given is the list returned."""
    g = torch.Generator().manual_seed(seed)
    x, k = 300 + seed * 37, 60
    s = torch.randn(3, 1, x, generator=g) * 4
    # ties of values with full mantissas: every digit down to the last (narrower) one resolves the threshold
    s[1] = (torch.randn(20, generator=g) * 4)[torch.randint(0, 20, (x,), generator=g)]
    counts = torch.randint(1, k + 1, (3,), generator=g)
    want = topk_rows_reference(s, counts, k)
    for chunk, bits, mask in ((1024, 8, None), (64, 6, False), (16, 8, False), (None, 5, True), (128, 4, None)):
        out = torch.full((3, 1, k), -1, dtype=torch.int64)
        assert topk_rows_radix(s, counts, k, chunk=chunk, digit_bits=bits, hist_mask=mask, out=out) is out
        assert torch.equal(out, want), (chunk, bits, mask)
        assert _zero_histograms(s)


def test_radix_select_with_programs_of_many_tiles():
    """Chunks of several tiles in every launch (the first digit's, the later digits' and the compaction's):
    logits-like rows, one with ties, count across tiles."""
    g = torch.Generator().manual_seed(7)
    s = torch.randn(1, 2, 4500, generator=g) * 2 - 5
    s[0, 1] = (s[0, 1] * 4).round() / 4
    for count in (1, 700, 4500):
        counts = torch.tensor([count])
        assert torch.equal(topk_rows_radix(s, counts, 4500, chunk=4096), topk_rows_reference(s, counts, 4500))


def test_radix_select_rejects_bad_arguments():
    s = torch.randn(1, 2, 100)
    counts = torch.tensor([5])
    for kw, name in (({"chunk": 100}, "chunk"), ({"chunk": 8}, "chunk"), ({"num_warps": 3}, "num_warps"),
                     ({"programs": 0}, "programs"), ({"digit_bits": 9}, "digit_bits")):
        with pytest.raises(ValueError, match=name):
            topk_rows_radix(s, counts, 5, **kw)
    with pytest.raises(ValueError, match="counts"):
        topk_rows_radix(s, torch.tensor([5, 5]), 5)
    with pytest.raises(ValueError, match="k:"):
        topk_rows_radix(s, counts, 0)
    with pytest.raises(ValueError, match="scores"):
        topk_rows_radix(s.double(), counts, 5)


def test_topk_select_radix_takes_the_reference_keys():
    """oracle-topk's device top-k with ``select="radix"``: the reference's keys (as sets; counts equal) and the
    Triton select's list itself, for per-query-head and group-summed rows (the latter after the group sum)."""
    from kvsieve.kernels.oracle_topk import topk

    g = torch.Generator().manual_seed(5)
    b, hq, hkv, n, d = 2, 4, 2, 300, 64
    q = torch.randn(b, hq, d, generator=g) * 2
    k = torch.randn(b, hkv, n, d, generator=g)
    lens = torch.tensor([n, 250], dtype=torch.int32)
    for share in (False, True):
        for size, sink, window in ((7, 0, 0), (0.1, 4, 40), (1.0, 4, 40)):
            kw = dict(sink=sink, window=window, size=size, max_k=size if isinstance(size, int) else int(n * size),
                      share_kv_group=share)
            idx, counts = topk.topk_select(q, k, lens, select="radix", launch_opts={"radix": {"chunk": 128}}, **kw)
            ref_idx, ref_counts = topk.topk_select(q, k, lens, scores="reference", **kw)
            tri_idx, _ = topk.topk_select(q, k, lens, select="triton", **kw)
            assert torch.equal(counts, ref_counts)
            for row in range(b):
                for h in range(idx.shape[1]):
                    c = int(counts[row, h])
                    assert set(idx[row, h, :c].tolist()) == set(ref_idx[row, h, :c].tolist()), (share, size, row, h)
                    assert torch.equal(idx[row, h, :c], tri_idx[row, h, :c]), (share, size, row, h)


def test_vattention_with_the_radix_select_equals_the_triton_select(monkeypatch):
    """vAttention's kernel path with its long per-query-head rows (the limit lowered) through the radix select
    and, the limit raised, through the Triton select: the stats name the way; the same budgets and densities,
    the same estimate (up to the order of float sums), and the reference's; ragged rows."""
    import kvsieve
    from kvsieve.kernels.oracle_topk import topk

    g = torch.Generator().manual_seed(2)
    spec = "vattention:sink=4,window=8,top_k=0.05,base_rate=0.05,epsilon=0.2,delta=0.2"
    for r, n, seed in ((1, 500, 3), (2, 420, 5)):
        q = torch.randn(r, 4, 64, generator=g) * 2
        k = torch.randn(r, 2, n, 64, generator=g)
        v = torch.randn(r, 2, n, 64, generator=g)
        lens = torch.tensor([n, n - 77][:r])
        runs = {}
        for way, limit in (("radix", 300), ("triton", 1 << 20)):
            monkeypatch.setattr(topk, "RADIX_SELECT_ABOVE", limit)
            out, st = kvsieve.method(spec + ",backend=triton").decode(q, k, v, lengths=lens, seed=seed)
            assert st.backend == "triton" and st.extra.get("topk_select") == way, st.extra
            runs[way] = (out, st)
        ref, rst = kvsieve.method(spec + ",backend=reference").decode(q, k, v, lengths=lens, seed=seed)
        (out, st), (t_out, t_st) = runs["radix"], runs["triton"]
        for f in ("density", "kv_density", "v_rows_read"):
            assert st[f] == t_st[f] == rst[f], (f, st[f], t_st[f], rst[f])
        assert torch.equal(st.raw("budget_per_head"), t_st.raw("budget_per_head"))
        assert torch.equal(st.raw("budget_per_head"), rst.raw("budget_per_head"))
        torch.testing.assert_close(out, t_out, rtol=1e-5, atol=1e-6)
        assert float((out - ref).norm() / ref.norm()) < 2e-5
