"""``benchmarks/breakdown/stages.py``: its variants run on tiny CPU inputs and its kernels land in their stages."""

from bench_scripts import BENCHMARKS, load_bench

SCRIPT = BENCHMARKS / "breakdown" / "stages.py"


def load():
    return load_bench("breakdown/stages.py")


def test_check_runs_every_variant():
    assert load().main(["--check"]) == 0


def test_stage_filing():
    mod = load()
    assert mod.stage_of("_feature_major_stats_kernel") == "K stream: scores/stats"
    assert mod.stage_of("_mean_group_draw_kernel") == "bernoulli draw"
    assert mod.stage_of("_split_candidates_kernel") == "uniform samples (base + residual)"
    assert mod.stage_of("_attend_kernel") == "vattention tested-key attention"
    stages = mod.by_stage({"_budget_parts_kernel": (3.0, 1.0), "_budget_combine_kernel": (1.0, 1.0),
                           "memset": (0.5, 2.0)})
    assert stages["vattention budget statistics"] == {"us": 4.0, "launches": 2.0}
    assert stages["other: memset"] == {"us": 0.5, "launches": 2.0}


def test_needs_a_folder():
    import pytest

    with pytest.raises(SystemExit):
        load().main([])


def test_cases_and_outlier_queries():
    import pytest

    mod = load()
    assert mod.parse_cases("1:gaussian,4,2:outliers") == [(1.0, "gaussian"), (4.0, "gaussian"), (2.0, "outliers")]
    with pytest.raises(ValueError, match="features 'flat'"):
        mod.parse_cases("1:flat")
    assert mod.parse_cases("1:peaked") == [(1.0, "peaked")]
    with pytest.raises(ValueError, match="q scale 1"):
        mod.parse_cases("4:peaked")
    s = mod.outlier_scales(128, "cpu")
    assert abs(float(s.pow(2).mean()) - 1) < 1e-5
    top = s.pow(2).sort(descending=True).values
    assert float(top[:16].sum() / top.sum()) > 0.5  # a few features carry most of |q|²


def test_vattention_stages_check_runs_every_way():
    """``benchmarks/breakdown/vattention_stages.py --check``: one decode spied on, every stage's ways run and
    agree with their references (under the interpreter, in a subprocess)."""
    import pytest

    pytest.importorskip("triton")
    from interpreted import run_script

    script = ("import runpy, sys; sys.argv = ['vattention_stages.py', '--check']; "
              f"runpy.run_path({str(SCRIPT.parent / 'vattention_stages.py')!r}, run_name='__main__')")
    assert "check: ok" in run_script(script, "cpu", True)
