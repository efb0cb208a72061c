"""The split top-k (``kernels/shared/select_split.py``) against the one-program rows select and the torch
reference, on the CPU through Triton's interpreter. Not collected on its own: ``tests/test_select_split.py``
runs this file in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen when triton is imported).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_select_split.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

from kvsieve.kernels.shared import select_triton  # noqa: E402
from kvsieve.kernels.shared.select_split import row_maxima, split_chunk, topk_rows_split  # noqa: E402
from kvsieve.kernels.shared.select_triton import topk_rows_reference, topk_rows_triton  # noqa: E402

pytestmark = pytest.mark.triton


def hard_rows(x: int, seed: int) -> torch.Tensor:
    """``[2, 4, x]`` random rows with what the threshold search must get right: −inf, many ties, one value,
    negatives and positives, a narrow range (most high bits shared), a very wide one."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, 4, x, generator=g) * 3
    s[0, 1, ::3] = float("-inf")
    s[0, 2] = (s[0, 2] * 2).round()  # many ties
    s[0, 3] = 1.5  # one value
    s[1, 0, : x // 2] = -s[1, 0, : x // 2].abs()
    s[1, 1] = 1000 + torch.rand(x, generator=g) * 1e-3  # narrow: the first 8-bit digit leaves bits to refine
    s[1, 2] = torch.randn(x, generator=g) * torch.exp(torch.randn(x, generator=g) * 20)  # very wide
    s[1, 3] = -(torch.rand(x, generator=g) * 30)  # log-probability-like, all negative
    return s


@pytest.mark.parametrize("x,k,programs", [(1, 1, 8), (7, 5, 8), (300, 40, 16), (777, 100, 64), (1000, 999, 32),
                                          (1000, 1000, 64), (1500, 75, 132), (2049, 300, 40)])
@pytest.mark.parametrize("seed", [0, 1])
def test_split_select_equals_the_rows_select_and_the_reference(x, k, programs, seed):
    """Same indices as topk_rows_triton (with the maxima: its prefilter path) and the torch reference — ties
    to the lowest index, ascending, zeros after — with counts 0, below k and = every finite value; chunks
    of 64+ units that do not divide the row."""
    s = hard_rows(x, seed)
    finite = int(torch.isfinite(s[0]).sum(-1).min())
    counts = torch.tensor([min(k, finite), k if x > 1 else 0])
    maxima = row_maxima(s).contiguous()
    want = topk_rows_reference(s, counts, k)
    assert torch.equal(topk_rows_triton(s, counts, k, maxima=maxima), want)
    got = topk_rows_split(s, counts, k, maxima=maxima, programs=programs)
    assert torch.equal(got, want)
    if x >= 128:  # the cases split their rows
        assert -(-x // split_chunk(s.shape[0] * s.shape[1], x, s.device, programs)) > 1


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_split_select_does_not_depend_on_the_programs(seed):
    """Random rows, random counts: one program per row, a few, many (chunks of 64), first histograms of 16 to
    1024 bins give the same list; the maxima computed inside when not given."""
    g = torch.Generator().manual_seed(seed)
    x, k = 900 + seed * 37, 120
    s = torch.randn(3, 2, x, generator=g)
    counts = torch.randint(0, k + 1, (3,), generator=g)
    want = topk_rows_reference(s, counts, k)
    for programs, bits in ((1, 8), (12, 4), (100, 10)):
        assert torch.equal(topk_rows_split(s, counts, k, programs=programs, digit_bits=bits), want)


@pytest.mark.parametrize("share", [True, False])
def test_quest_select_takes_the_same_pages_with_the_split_select(share, monkeypatch):
    """quest_select at batch 1 with the split select (SPLIT_ROWS_MAX at its default) and without it (0):
    the same pages; the register select turned off so that both take the rows path."""
    from kvsieve.kernels.quest import quest_pages

    monkeypatch.setattr(select_triton, "REGISTER_SELECT_MAX", 0)
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, n, d, page = 1, 8, 2, 1500, 64, 4
    q = torch.randn(b, hq, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    lens = torch.tensor([n - 37], dtype=torch.int32)
    kmin, kmax = quest_pages.page_minmax_reference(k, lens, page)
    opts = dict(page_size=page, sink=8, window=8, size=0.1, max_pages=40, share_kv_group=share)
    rows = hkv if share else hq
    assert select_triton.select_launches(kmin.shape[2], hq // hkv, share, rows=rows)[-1] == "split"
    new = quest_pages.quest_select(q, kmin, kmax, lens, **opts)
    monkeypatch.setattr(select_triton, "SPLIT_ROWS_MAX", 0)
    assert select_triton.select_launches(kmin.shape[2], hq // hkv, share, rows=rows)[-1] == "rows"
    old = quest_pages.quest_select(q, kmin, kmax, lens, **opts)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    assert 10 < int(new[1][0, 0]) < kmin.shape[2] / 2  # a real selection: some pages of many


def test_split_select_bad_input_is_a_clear_error():
    s = torch.randn(1, 2, 100)
    counts = torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="maxima"):
        topk_rows_split(s, counts, 4, maxima=torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="scores"):
        topk_rows_split(s.double(), counts, 4)
    with pytest.raises(ValueError, match="k:"):
        topk_rows_split(s, counts, 0)
    with pytest.raises(ValueError, match="programs"):
        topk_rows_split(s, counts, 4, programs=0)
    with pytest.raises(ValueError, match="num_warps"):
        topk_rows_split(s, counts, 4, num_warps=3)
    with pytest.raises(ValueError, match="digit_bits"):
        topk_rows_split(s, counts, 4, digit_bits=12)
