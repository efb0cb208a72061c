"""S²ANTA-prop's largest-remainder selects (``santa/common.py``: ``BUDGET_SELECT``): their interpreter cases
(``santa_budget_interpreter_cases.py``, in a subprocess with ``TRITON_INTERPRET=1``), the launch settings each one
takes, and the budget benchmark's CPU check."""

from __future__ import annotations

import pytest
from interpreted import case_groups, group_id, run_interpreter_cases, run_script

pytest.importorskip("triton")

CASES = "santa_budget_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_every_select_equals_the_twin_and_largest_remainder|513"),
                         ids=group_id)
def test_budget_selects_under_the_triton_interpreter(group):
    run_interpreter_cases(CASES, group)


def test_budget_meta_spreads_only_the_count_over_programs(monkeypatch):
    from kvsieve.kernels.santa import common

    assert common.BUDGET_SELECT == "sort"  # the default until measured on the GPU
    programs, meta = common.budget_meta(513, rounding="largest-remainder", split=True)
    assert programs == 1 and meta["BLOCK_T"] == 1024 and meta["COLS"] == 1024 and meta["SELECT"] == "sort"
    monkeypatch.setattr(common, "BUDGET_SELECT", "count")
    monkeypatch.setattr(common, "BUDGET_COUNT_COLS", 64)
    assert common.budget_meta(513, rounding="largest-remainder", split=True)[0] == 9
    assert common.budget_meta(513, rounding="largest-remainder", split=False)[0] == 1
    assert common.budget_meta(513, rounding="systematic", split=True)[0] == 1
    programs, meta = common.budget_meta(5, rounding="largest-remainder", split=True)
    assert programs == 1 and meta["COLS"] == 16 and meta["CHUNK"] == 16  # a chunk never exceeds the columns
    monkeypatch.setattr(common, "BUDGET_SELECT", "top")
    with pytest.raises(ValueError, match="BUDGET_SELECT"):
        common.budget_meta(8, rounding="largest-remainder", split=True)
    monkeypatch.setattr(common, "BUDGET_SELECT", "radix")
    monkeypatch.setattr(common, "BUDGET_RADIX_BITS", 10)  # histogram only: radix would compare 1024 candidates
    with pytest.raises(ValueError, match="BUDGET_RADIX_BITS"):
        common.budget_meta(8, rounding="largest-remainder", split=True)
    monkeypatch.setattr(common, "BUDGET_RADIX_BITS", 4)
    monkeypatch.setattr(common, "BUDGET_COUNT_COLS", 48)
    with pytest.raises(ValueError, match="BUDGET_COUNT_COLS"):
        common.budget_meta(8, rounding="largest-remainder", split=True)


@pytest.mark.triton
def test_budget_benchmark_check_runs():
    """``benchmarks/breakdown/santa_budget.py --check``: its synthetic checks on the CPU (two variants and the sort)."""
    out = run_script("import sys, runpy; sys.argv = ['santa_budget.py', '--check', '--variants', "
                     "'radix:4,count:16']; "
                     "runpy.run_path('benchmarks/breakdown/santa_budget.py', run_name='__main__')",
                     device="cpu", interpret=True)
    assert "check: ok" in out


def test_budget_benchmark_parses_its_variants():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "santa_budget", Path(__file__).resolve().parents[1] / "benchmarks" / "breakdown" / "santa_budget.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.variant_settings("radix:2") == {"BUDGET_SELECT": "radix", "BUDGET_RADIX_BITS": 2}
    assert mod.variant_settings("count:0") == {"BUDGET_SELECT": "count", "BUDGET_COUNT_COLS": 0}
    assert mod.variant_settings("count:64:16") == {"BUDGET_SELECT": "count", "BUDGET_COUNT_COLS": 64,
                                                   "BUDGET_CHUNK": 16}
    for bad in ("radix", "heap:2", "sort:1", "count:64:x"):
        with pytest.raises(ValueError, match="--variants"):
            mod.variant_settings(bad)
    assert mod.parse_shapes("1:513,8:129") == [(1, 513), (8, 129)]
    for name in mod.DEFAULT_VARIANTS.split(","):
        mod.variant_settings(name)


BUDGET_COMPILES = """
from kvsieve.kernels.santa import common, overlap, two_pass

pointers = dict(m_ptr="*fp32", l_ptr="*fp32", lens_ptr="*i32", budgets_ptr="*i32", sync_ptr="*i32")
for select, t in (("radix", 513), ("histogram", 513), ("count", 513), ("count", 129)):
    common.BUDGET_SELECT = select
    _, meta = common.budget_meta(t, rounding="largest-remainder", split=True)
    compile_(two_pass._prop_budget_kernel, pointers, dict(TILE=256, **meta, PDL=True))
    if t == 129:  # v10's budget kernel: one program per row
        _, meta = common.budget_meta(t, rounding="largest-remainder", split=False)
        compile_(overlap._unit_budget_kernel, pointers,
                 dict(G=4, TILE=256, **meta, PDL=True, SLEEP=True, STATS_THREADS=128, NAPS=8))
print("COMPILED")
"""


@pytest.mark.triton
def test_budget_selects_compile_for_the_h100():
    """The interpreter type-checks neither untaken branches nor constexpr reuse: each select compiles for sm_90."""
    from interpreted import compile_for_sm90

    compile_for_sm90(BUDGET_COMPILES)
