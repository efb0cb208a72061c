"""Run a test script in a fresh interpreter: Triton's interpreter is chosen when triton is imported, so
kernel-vs-reference cases under ``TRITON_INTERPRET=1`` (and their GPU twins) run in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, device: str, interpret: bool) -> str:
    """Run ``script`` formatted with ``device`` (``{{``/``}}`` for literal braces); returns its stdout and
    fails the test with its output when it fails."""
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", script.format(device=device)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def run_interpreter_cases(cases_file: str) -> str:
    """Run the ``triton``-marked tests of ``tests/<cases_file>`` under ``TRITON_INTERPRET=1`` in a fresh
    pytest; fails with its output unless they ran and passed with none skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "triton",
         str(ROOT / "tests" / cases_file)],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1], res.stdout[-2000:]
    return res.stdout
