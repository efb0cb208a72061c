"""Run a test script in a fresh interpreter: Triton's interpreter is chosen when triton is imported, so
kernel-vs-reference cases under ``TRITON_INTERPRET=1`` (and their GPU twins) run in a subprocess."""

from __future__ import annotations

import ast
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


def case_groups(cases_file: str, *alone: str) -> list[tuple[str, ...]]:
    """The test functions of ``tests/<cases_file>`` in groups, each for one :func:`run_interpreter_cases`
    (one test of the suite): every name in ``alone`` by itself (the slow ones), the rest together. A name
    ``"test_x|expr"`` splits a parametrized function in two: its cases that pytest's ``-k expr`` selects,
    and the others. The groups hold every case of the file, so a new case always runs."""
    tree = ast.parse((ROOT / "tests" / cases_file).read_text())
    names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    unknown = [name for name in alone if name.split("|")[0] not in names]
    if unknown:
        raise ValueError(f"{cases_file} has no test functions {unknown}")
    groups: list[tuple[str, ...]] = []
    for name in alone:
        groups.append((name,))
        if "|" in name:
            function, expr = name.split("|", 1)
            groups.append((f"{function}|not ({expr})",))
    taken = {name.split("|")[0] for name in alone}
    rest = tuple(name for name in names if name not in taken)
    return groups + ([rest] if rest else [])


def group_id(group: tuple[str, ...]) -> str:
    """A test id without spaces: the function (and its -k expression), or how many functions run together."""
    if len(group) > 1:
        return f"{len(group)}-others"
    return group[0].replace("|", "-").replace(" ", "_").replace("(", "").replace(")", "")


def run_interpreter_cases(cases_file: str, tests: tuple[str, ...] | None = None) -> str:
    """Run the ``triton``-marked tests of ``tests/<cases_file>`` (those named in ``tests``, as from
    :func:`case_groups`, or all) under ``TRITON_INTERPRET=1`` in a fresh pytest; fails with its output unless
    they ran and passed with none skipped."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    path = str(ROOT / "tests" / cases_file)
    targets, select = [path], []
    if tests is not None:
        targets = [f"{path}::{name.split('|')[0]}" for name in tests]
        select = ["-k", tests[0].split("|", 1)[1]] if len(tests) == 1 and "|" in tests[0] else []
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "triton", *select, *targets],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1], res.stdout[-2000:]
    return res.stdout
