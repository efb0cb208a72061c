"""S²ANTA-prop's largest-remainder tile budgets (``santa/common.py``: ``group_budgets``, the histogram threshold
select): their interpreter cases (``santa_budget_interpreter_cases.py``, in a subprocess with
``TRITON_INTERPRET=1``), the launch's constexprs, the sm_90 compile and the budget benchmark's CPU check."""

from __future__ import annotations

import pytest
from interpreted import case_groups, group_id, run_interpreter_cases, run_script

pytest.importorskip("triton")

CASES = "santa_budget_interpreter_cases.py"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups(CASES, "test_santa_prop_paths_share_the_budgets"), ids=group_id)
def test_budgets_under_the_triton_interpreter(group):
    run_interpreter_cases(CASES, group)


def test_budget_meta():
    from kvsieve.kernels.santa import common

    early = common.BUDGET_EARLY_EXIT
    assert common.budget_meta(513, rounding="largest-remainder") == dict(BLOCK_T=1024, SYSTEMATIC=False,
                                                                         DIGIT_BITS=5, EARLY_EXIT=early)
    assert common.budget_meta(5, rounding="systematic") == dict(BLOCK_T=16, SYSTEMATIC=True, DIGIT_BITS=5,
                                                                EARLY_EXIT=early)
    assert 20 % common.budget_meta(1, rounding="largest-remainder")["DIGIT_BITS"] == 0  # two 20-bit halves


@pytest.mark.triton
def test_budget_benchmark_check_runs():
    """``benchmarks/breakdown/santa_budget.py --check``: its synthetic checks and whole calls on the CPU."""
    out = run_script("import sys, runpy; sys.argv = ['santa_budget.py', '--check']; "
                     "runpy.run_path('benchmarks/breakdown/santa_budget.py', run_name='__main__')",
                     device="cpu", interpret=True)
    assert "check: ok" in out


def test_budget_benchmark_parses_its_shapes_and_keys_on_the_host(monkeypatch):
    """The shapes list; the whole calls (``stages.make_call``'s) pass a key with host counters only (a device
    counter would be read back by ``RandomKey.host_seed`` during graph capture)."""
    import torch
    from bench_scripts import load_bench

    import kvsieve

    mod = load_bench("breakdown/santa_budget.py")
    assert mod.parse_shapes("1:513,8:129") == [(1, 513), (8, 129)]
    with pytest.raises(ValueError, match="--shapes"):
        mod.parse_shapes("1x513")

    keys = []

    class Recording:
        def new_state(self):
            return None

        def decode(self, q, k, v, *, lengths, seed, state, check_finite):
            keys.append(seed)
            return q, {}

    monkeypatch.setattr(kvsieve, "method", lambda spec: Recording())
    calls = mod.whole_calls(mod.load_stages(), torch.zeros(1), None, None, None)
    assert set(calls) == set(mod.CALLS)
    for call in calls.values():
        call()
    assert len(keys) == len(calls) and all(key.host() for key in keys)


BUDGET_COMPILES = """
from kvsieve.kernels.santa import common, overlap, two_pass

pointers = dict(m_ptr="*fp32", l_ptr="*fp32", lens_ptr="*i32", budgets_ptr="*i32", sync_ptr="*i32")
for rounding, t, early in (("largest-remainder", 513, False), ("largest-remainder", 129, False),
                          ("systematic", 129, False), ("largest-remainder", 513, True),
                          ("largest-remainder", 129, True)):
    meta = {**common.budget_meta(t, rounding=rounding), "EARLY_EXIT": early}
    compile_(two_pass._prop_budget_kernel, pointers, dict(TILE=256, **meta, PDL=True))
    compile_(overlap._unit_budget_kernel, pointers,
             dict(G=4, TILE=256, **meta, PDL=True, SLEEP=True, STATS_THREADS=128, NAPS=8))
print("COMPILED")
"""


@pytest.mark.triton
def test_budget_kernels_compile_for_the_h100():
    """The interpreter type-checks neither untaken branches nor constexpr reuse: both budget kernels compile
    for sm_90."""
    from interpreted import compile_for_sm90

    compile_for_sm90(BUDGET_COMPILES)
