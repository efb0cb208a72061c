"""S²ANTA-prop's largest-remainder tile budgets (``santa/common.py``: ``group_budgets``, the +1s by a histogram
threshold select) against an exact torch twin of the kernels' arithmetic and ``systematic.largest_remainder``,
under Triton's interpreter. Not collected on its own: ``tests/test_santa_budget_select.py`` runs it in a
subprocess with ``TRITON_INTERPRET=1``.

The masses are exact in every summation order (m = 0 or -inf, l dyadic with few bits), so the float64 sum, the
shares and the quantised fractions of the twin are the kernels' to the bit, and the twin equals
``systematic.largest_remainder`` there too.
"""

from __future__ import annotations

import os
import types

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_santa_budget_select.py (needs TRITON_INTERPRET=1 before triton is imported)",
                allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvsieve.kernels.santa.common import histogram_threshold  # noqa: E402
from kvsieve.kernels.santa.systematic import largest_remainder  # noqa: E402
from kvsieve.kernels.santa.two_pass import prop_budgets  # noqa: E402

# rows of no mass at all divide 0 by 0 (their budgets are masked to 0): numpy warns under the interpreter
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

TILE = 16


@pytest.fixture(params=[False, True], ids=["all-steps", "early-exit"], autouse=True)
def early_exit(request, monkeypatch):
    """Every case with the threshold's every step and with its steps skipped once it is known: the same budgets."""
    from kvsieve.kernels.santa import common

    monkeypatch.setattr(common, "BUDGET_EARLY_EXIT", request.param)
    return request.param


def kernel_budgets(m, l, lens, budget):
    """The budget launch's tile budgets ``[B, Hq, T]`` of the stats ``m, l [B, Hq, T]``."""
    b, hq, t = m.shape
    buf = types.SimpleNamespace(m=m.reshape(-1).contiguous(), l=l.reshape(-1).contiguous(),
                                budgets=torch.full((b, hq, t), -7, dtype=torch.int32))
    prop_budgets(lens, buf, budget, TILE, 3, b, hq, t, rounding="largest-remainder", pdl=False)
    return buf.budgets.long()


@triton.jit
def threshold_kernel(x_ptr, rem_ptr, out_ptr, N: tl.constexpr, BITS: tl.constexpr, EARLY: tl.constexpr):
    r = tl.program_id(0)
    x = tl.load(x_ptr + r * N + tl.arange(0, N))
    rem = tl.load(rem_ptr + r)
    tl.store(out_ptr + r, histogram_threshold(x, rem, BITS, 5, EARLY))


def threshold_reference(x: torch.Tensor, rem: torch.Tensor, bits: int) -> torch.Tensor:
    """By the definition: per row the largest v in [0, 2^bits) with #{x >= v} >= rem (entries below 0 never
    count), 0 when none qualifies."""
    v = torch.arange(1 << bits)
    counts = ((x[:, None, :] >= v[None, :, None]) & (x[:, None, :] >= 0)).sum(-1)  # [R, 2^bits]
    ok = counts >= rem[:, None]
    return torch.where(ok.any(1), (ok * v[None, :]).amax(1), 0)


def test_the_threshold_select_by_its_definition(early_exit):
    """``histogram_threshold`` (with and without its early exit) on rows of few distinct values (many ties), entries of
    2^bits and above and below 0, ``rem`` from below 0 to past the row's entries."""
    g = torch.Generator().manual_seed(7)
    bits, n, rows = 10, 64, 120
    distinct = torch.randint(1, 40, (rows, 1), generator=g)  # values per row: few (ties) to many
    pool = torch.randint(-1, (1 << bits) + 3, (rows, 64), generator=g)
    x = torch.gather(pool, 1, torch.randint(0, 64, (rows, n), generator=g) % distinct).to(torch.int32)
    rem = torch.randint(-2, n + 3, (rows,), generator=g).to(torch.int32)
    out = torch.empty(rows, dtype=torch.int32)
    threshold_kernel[(rows,)](x, rem, out, N=n, BITS=bits, EARLY=early_exit)
    assert torch.equal(out.long(), threshold_reference(x.long(), rem.long(), bits))


def fused_fraction(w, scale, base):
    """``w · scale - base`` rounded once to float64 (a fused multiply-add), in exact rational arithmetic."""
    from fractions import Fraction

    vals = [float(Fraction(a) * Fraction(b) - Fraction(c))
            for a, b, c in zip(w.flatten().tolist(), scale.flatten().tolist(), base.flatten().tolist(), strict=True)]
    return torch.tensor(vals, dtype=torch.float64).view(w.shape)


def valid_tiles(t, lens):
    return (torch.arange(t) < ((lens.long() + TILE - 1) // TILE)[:, None])[:, None, :]


def masses(m, l, lens):
    """The tile masses ``e^{m - m*} l`` (float32, then float64), 0 past each row's length."""
    valid = valid_tiles(m.shape[-1], lens).expand(m.shape)
    m = torch.where(valid, m, float("-inf"))
    m_star = m.amax(-1, keepdim=True)
    # a row of no mass at all: no budgets (the kernels' NaN masses there fail their z > 0)
    return torch.where(valid, torch.exp(m - torch.where(m_star > float("-inf"), m_star, 0.0)) * l, 0.0).double()


def twin(m, l, lens, budget):
    """The kernels' arithmetic in torch: float32 masses, their float64 sum, ``w · (S / z)``, the fractions
    (one fused multiply-add) quantised to 2^-40, the +1s to the `rem` largest (ties: the lower tile)."""
    t = m.shape[-1]
    valid = valid_tiles(t, lens).expand(m.shape)
    w = masses(m, l, lens)
    z = w.sum(-1, keepdim=True)
    scale = budget / torch.where(z > 0, z, 1.0)
    base = (w * scale).floor()
    rem = budget - base.sum(-1, keepdim=True).long()
    q = (fused_fraction(w, scale.expand_as(w), base) * 2.0**40).long()
    key = torch.where(valid, q * 2048 + (2047 - torch.arange(t)), -1)
    rank = (key[..., None, :] > key[..., :, None]).sum(-1)  # the keys above each
    out = base.long() + ((rank < rem) & valid).long()
    return torch.where(valid & (z > 0), out, 0), w


def exact_stats(b, hq, t, seed):
    """(m, l) with masses exact in any summation order: m = 0 (e^0 = 1) or -inf with l = 0 (no mass); l = k/16,
    k < 2^12; head 1 with many equal masses (tied fractions), head 2 with equal masses (no remainder where the
    row's tiles divide the budget), every third tile of head 3 without mass."""
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(b, hq, t)
    l = torch.randint(1, 1 << 12, (b, hq, t), generator=g).float() / 16
    l[:, 1] = torch.randint(1, 4, (b, t), generator=g).float()
    l[:, 2] = 1.0
    m[:, 3, ::3], l[:, 3, ::3] = float("-inf"), 0.0
    return m, l


@pytest.mark.parametrize("t", [1, 2, 15, 16, 17, 129, 513])
def test_budgets_equal_the_twin_and_largest_remainder(t):
    """Rows of different lengths (the second row's last tile partly filled, or a row of one key); budgets 1 and
    1000 besides 128 at 17 tiles (1000: whole shares with rem = 0 in the tied heads' rows of 8 tiles)."""
    lens = torch.tensor([t * TILE, max(1, (t // 2) * TILE - 5)], dtype=torch.int32)
    m, l = exact_stats(2, 4, t, seed=t)
    for budget in ((1, 128, 1000) if t == 17 else (128,)):
        want, w = twin(m, l, lens, budget)
        assert torch.equal(want, largest_remainder(w, budget))
        assert torch.equal(want.sum(-1), torch.where(w.sum(-1) > 0, budget, 0))
        assert torch.equal(kernel_budgets(m, l, lens, budget), want), (t, budget)


def test_no_remainder_and_all_ties():
    """Equal masses over rows whose tiles divide the budget (rem = 0: no +1 at all) and rows where they do not
    (every fraction tied: the +1s to the lowest tiles); a row of no mass at all gets nothing."""
    t = 40
    m = torch.zeros(1, 4, t)
    l = torch.ones(1, 4, t)
    m[0, 3], l[0, 3] = float("-inf"), 0.0
    for length, budget in ((32 * TILE, 128), (40 * TILE, 120), (24 * TILE, 100), (7 * TILE - 3, 30)):
        lens = torch.tensor([length], dtype=torch.int32)
        want, w = twin(m, l, lens, budget)
        assert torch.equal(want, largest_remainder(w, budget))
        got = kernel_budgets(m, l, lens, budget)
        assert torch.equal(got, want), (length, budget)
        assert not got[0, 3].any()


@pytest.mark.parametrize("t", [17, 129])
def test_budgets_equal_largest_remainder_on_random_stats(t):
    """Random (m, l) (no exact twin: the interpreter's float32 exp is numpy's, not torch's, so only a near-tie
    could differ; these seeds have none): the budgets of ``largest_remainder`` on torch's masses, rows of
    different lengths and a row of no mass at all included."""
    g = torch.Generator().manual_seed(t)
    m = torch.randn(2, 3, t, generator=g) * 3
    l = torch.rand(2, 3, t, generator=g) * 100 + 1
    m[1, 2], l[1, 2] = float("-inf"), 0.0
    lens = torch.tensor([t * TILE, (t - 5) * TILE + 1], dtype=torch.int32)
    got = kernel_budgets(m, l, lens, 128)
    assert (got[0].sum(-1) == 128).all() and not got[1, 2].any()
    assert torch.equal(got, largest_remainder(masses(m, l, lens), 128))


def test_santa_prop_paths_share_the_budgets():
    """The two-pass, split and overlapped santa-prop calls draw the same budgets and counts (their budget
    launches: ``two_pass.prop_budgets`` and v10's own kernel), each head's budgets summing to the budget."""
    from kvsieve.kernels.santa.overlap import santa_prop_overlap
    from kvsieve.kernels.santa.split_merge import santa_prop_split
    from kvsieve.kernels.santa.two_pass import santa_prop_two_pass

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g) * 2
    k = torch.randn(2, 2, 150, 64, generator=g)
    v = torch.randn(2, 2, 150, 64, generator=g)
    lens = torch.tensor([150, 91], dtype=torch.int32)
    opts = {"block_n": 16, "stats_programs": 2}
    _, counts, budgets = santa_prop_two_pass(q, k, v, lens, 0.125, 24, TILE, 5, write_counts=True, **opts)
    assert torch.equal(budgets.sum(-1), torch.full((2, 4), 24, dtype=budgets.dtype))
    for run in (santa_prop_split, santa_prop_overlap):
        _, c, bt = run(q, k, v, lens, 0.125, 24, TILE, 5, write_counts=True, **opts)
        assert torch.equal(bt, budgets) and torch.equal(c, counts), run.__name__
