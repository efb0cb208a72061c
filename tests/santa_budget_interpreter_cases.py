"""S²ANTA-prop's tile budgets by every largest-remainder select (``santa/common.py``: ``BUDGET_SELECT``) against
an exact torch twin of the kernels' arithmetic, under Triton's interpreter. Not collected on its own:
``tests/test_santa_budget_select.py`` runs it in a subprocess with ``TRITON_INTERPRET=1``.

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

from kvsieve.kernels.santa import common  # noqa: E402
from kvsieve.kernels.santa.systematic import largest_remainder  # noqa: E402
from kvsieve.kernels.santa.two_pass import prop_budgets  # noqa: E402

# rows of no mass at all divide 0 by 0 (their budgets are masked to 0): numpy warns under the interpreter
pytestmark = [pytest.mark.triton, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

TILE = 16
#: (BUDGET_SELECT, its settings): every form and a few of each one's launch settings
SELECTS = [("sort", {}), ("radix", {"BUDGET_RADIX_BITS": 2}), ("radix", {"BUDGET_RADIX_BITS": 4}),
           ("histogram", {"BUDGET_RADIX_BITS": 5}), ("histogram", {"BUDGET_RADIX_BITS": 10}),
           ("count", {"BUDGET_COUNT_COLS": 0}),
           ("count", {"BUDGET_COUNT_COLS": 16, "BUDGET_CHUNK": 8}), ("count", {"BUDGET_COUNT_COLS": 64})]


def run_select(select, settings, m, l, lens, budget):
    b, hq, t = m.shape
    buf = types.SimpleNamespace(m=m.reshape(-1).contiguous(), l=l.reshape(-1).contiguous(),
                                budgets=torch.full((b, hq, t), -7, dtype=torch.int32))
    values = {"BUDGET_SELECT": select, **settings}
    before = {key: getattr(common, key) for key in values}
    for key, val in values.items():
        setattr(common, key, val)
    try:
        prop_budgets(lens, buf, budget, TILE, 3, b, hq, t, rounding="largest-remainder", pdl=False)
    finally:
        for key, val in before.items():
            setattr(common, key, val)
    return buf.budgets.long()


def fused_fraction(w, scale, base):
    """``w · scale - base`` rounded once to float64 (a fused multiply-add), in exact rational arithmetic."""
    from fractions import Fraction

    vals = [float(Fraction(a) * Fraction(b) - Fraction(c))
            for a, b, c in zip(w.flatten().tolist(), scale.flatten().tolist(), base.flatten().tolist(), strict=True)]
    return torch.tensor(vals, dtype=torch.float64).view(w.shape)


def twin(m, l, lens, budget):
    """The kernels' arithmetic in torch: float32 masses, their float64 sum, ``w · (S / z)``, the fractions
    (one fused multiply-add) quantised to 2^-40, the +1s to the `rem` largest (ties: the lower tile)."""
    t = m.shape[-1]
    valid = (torch.arange(t) < ((lens.long() + TILE - 1) // TILE)[:, None])[:, None, :].expand(m.shape)
    m = torch.where(valid, m, float("-inf"))
    m_star = m.amax(-1, keepdim=True)
    # a row of no mass at all: no budgets (the kernels' NaN masses there fail their z > 0)
    w = torch.where(valid, torch.exp(m - torch.where(m_star > float("-inf"), m_star, 0.0)) * l, 0.0).double()
    z = w.sum(-1, keepdim=True)
    scale = budget / torch.where(z > 0, z, 1.0)
    base = (w * scale).floor()
    rem = budget - base.sum(-1, keepdim=True).long()
    q = (fused_fraction(w, scale.expand_as(w), base) * 2.0**40).long()
    key = torch.where(valid, q * 2048 + (2047 - torch.arange(t)), -1)
    rank = (key[..., None, :] > key[..., :, None]).sum(-1)  # the keys above each
    out = base.long() + ((rank < rem) & valid).long()
    return torch.where(valid & (z > 0), out, 0), w


def exact_stats(b, hq, t, lens, seed):
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
def test_every_select_equals_the_twin_and_largest_remainder(t):
    """Rows of different lengths (the second row's last tile partly filled, or a row of one key); budgets 1 and
    1000 besides 128 at 17 tiles; at 513 tiles all but the sort (slow in the interpreter) and the one-program
    count (its count grows with the row's square)."""
    lens = torch.tensor([t * TILE, max(1, (t // 2) * TILE - 5)], dtype=torch.int32)
    m, l = exact_stats(2, 4, t, lens, seed=t)
    selects = SELECTS if t < 513 else [s for s in SELECTS if s[0] != "sort" and s[1].get("BUDGET_COUNT_COLS") != 0]
    for budget in ((1, 128, 1000) if t == 17 else (128,)):
        want, w = twin(m, l, lens, budget)
        assert torch.equal(want, largest_remainder(w, budget))
        assert torch.equal(want.sum(-1), torch.where(w.sum(-1) > 0, budget, 0))
        for select, settings in selects:
            got = run_select(select, settings, m, l, lens, budget)
            assert torch.equal(got, want), (t, budget, select, settings)


@pytest.mark.parametrize("t", [17, 129])
def test_every_select_equals_the_sort_on_random_stats(t):
    """Random (m, l) (float32 exp: no exact twin): every select gives the sort's budgets, rows of different lengths
    and a row of no mass at all included."""
    g = torch.Generator().manual_seed(t)
    m = torch.randn(2, 3, t, generator=g) * 3
    l = torch.rand(2, 3, t, generator=g) * 100 + 1
    m[1, 2], l[1, 2] = float("-inf"), 0.0
    lens = torch.tensor([t * TILE, (t - 5) * TILE + 1], dtype=torch.int32)
    want = run_select("sort", {}, m, l, lens, 128)
    assert (want[0].sum(-1) == 128).all() and not want[1, 2].any()
    for select, settings in SELECTS[1:]:
        assert torch.equal(run_select(select, settings, m, l, lens, 128), want), (select, settings)


def test_santa_prop_paths_take_the_select():
    """The two-pass, split and overlapped santa-prop calls draw the same budgets and counts whatever the select
    (the overlapped budget kernel counts in one program per row)."""
    from kvsieve.kernels.santa.overlap import santa_prop_overlap
    from kvsieve.kernels.santa.split_merge import santa_prop_split
    from kvsieve.kernels.santa.two_pass import santa_prop_two_pass

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g) * 2
    k = torch.randn(2, 2, 150, 64, generator=g)
    v = torch.randn(2, 2, 150, 64, generator=g)
    lens = torch.tensor([150, 91], dtype=torch.int32)
    opts = {"block_n": 16, "stats_programs": 2}
    base = santa_prop_two_pass(q, k, v, lens, 0.125, 24, TILE, 5, write_counts=True, **opts)
    for select, settings, runs in (("radix", {"BUDGET_RADIX_BITS": 2}, (santa_prop_two_pass,)),
                                   ("histogram", {"BUDGET_RADIX_BITS": 4}, (santa_prop_split,)),
                                   ("count", {"BUDGET_COUNT_COLS": 16, "BUDGET_CHUNK": 8},
                                    (santa_prop_two_pass, santa_prop_overlap))):
        values = {"BUDGET_SELECT": select, **settings}
        before = {key: getattr(common, key) for key in values}
        for key, val in values.items():
            setattr(common, key, val)
        try:
            for run in runs:
                _, counts, budgets = run(q, k, v, lens, 0.125, 24, TILE, 5, write_counts=True, **opts)
                assert torch.equal(budgets, base[2]) and torch.equal(counts, base[1]), (select, run.__name__)
        finally:
            for key, val in before.items():
                setattr(common, key, val)
