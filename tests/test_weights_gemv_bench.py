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
