"""``benchmarks/breakdown/weights_gemv.py --check``: the products' shapes, the eager way against float32, the sums."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_weights_gemv_bench_check_runs():
    res = subprocess.run([sys.executable, "benchmarks/breakdown/weights_gemv.py", "--check"], capture_output=True,
                         text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert res.returncode == 0 and "check ok" in res.stdout, res.stdout + res.stderr


def test_tp_allreduce_bench_names_bad_ways_and_renders_its_table():
    """``benchmarks/breakdown/tp_allreduce.py`` needs GPUs to time; on the CPU: its table and its refusal."""
    import pytest
    import torch
    from bench_scripts import load_bench

    bench = load_bench("breakdown/tp_allreduce.py")
    with pytest.raises(ValueError, match="--ways: expected names from nccl, one-shot, two-shot"):
        bench.make_way("ring", torch.zeros(1, 4), "g")
    res = {"ranks": 2, "device": "GPU", "date": "d", "torch": "t", "multicast_disabled": "1",
           "rows": [{"batch": 1, "hidden": 4096, "way": "nccl", "us_each": 12.7, "us_each_min": 11.0, "max_err": 4e-3},
                    {"batch": 1, "hidden": 4096, "way": "one-shot", "error": "RuntimeError: no"}]}
    table = bench.markdown(res, "cmd")
    assert "| 1 | 4096 | nccl | 12.70 (11.00) | 4.0e-03 |" in table and "error: RuntimeError: no" in table
