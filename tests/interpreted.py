"""Run a test script in a fresh interpreter: Triton's interpreter is chosen when triton is imported, so
kernel-vs-reference cases under ``TRITON_INTERPRET=1`` (and their GPU twins) run in a subprocess."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def interpreter_and_gpu() -> list:
    """The two places a kernel check script runs, as ``pytest.mark.parametrize("device", ...)`` values: the CPU
    under Triton's interpreter (marked ``triton``) and a CUDA GPU (marked ``gpu``, skipped without one);
    ``run_script(script, device, device == "cpu")`` runs it there."""
    import pytest
    import torch

    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return [pytest.param("cpu", marks=pytest.mark.triton, id="interpreter"),
            pytest.param("cuda", marks=(pytest.mark.gpu, needs_cuda), id="gpu")]


def run_script(script: str, device: str, interpret: bool, **fields) -> str:
    """Run ``script`` formatted with ``device`` and ``fields`` (``{{``/``}}`` for literal braces); returns its
    stdout and fails the test with its output when it fails."""
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", script.format(device=device, **fields)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def printed_worst(out: str) -> float:
    """The worst error a check script found: what it printed last, after ``WORST`` (``print("WORST", worst)``),
    read from its stdout ``out``."""
    return float(out.split("WORST")[-1])


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


#: What a compile-only check of Triton kernels for the H100 (sm_90, no GPU needed) starts with: ``compile_(kernel,
#: pointers, meta, floats=(), ints64=(), num_warps=4, num_stages=3, aligned=())`` compiles ``kernel`` with the pointer
#: types ``pointers`` (name -> "*bf16", ...), the constexprs ``meta``, fp32 ``floats``, i64 ``ints64`` and i32 for the
#: rest, the arguments named in ``aligned`` specialised as a launch does 16-byte aligned pointers and multiples of 16,
#: and returns the compiled kernel (``.asm``, ``.metadata``); ``registers(compiled)`` is what ptxas reports the
#: kernel uses per thread.
SM90_COMPILE = """
import re
import subprocess
import triton
H100_SHARED_BYTES = 232448  # the opt-in limit per block on sm_90
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_(kernel, pointers, meta, floats=(), ints64=(), num_warps=4, num_stages=3, aligned=()):
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in meta:
            signature[name], constexprs[(i,)] = "constexpr", meta[name]
            continue
        signature[name] = pointers.get(name, "fp32" if name in floats else ("i64" if name in ints64 else "i32"))
        if name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    # a kernel that compiles but asks for more shared memory than an H100/H200 block can have fails at launch
    assert compiled.metadata.shared <= H100_SHARED_BYTES, f"{kernel.__name__}: {compiled.metadata.shared} bytes"
    return compiled


def registers(compiled):
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        with open(tmp + "/k.ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        res = subprocess.run([get_ptxas(90).path, "--gpu-name=sm_90a", "-v", tmp + "/k.ptx", "-o", tmp + "/k.cubin"],
                             capture_output=True, text=True, check=True)
    return int(re.search(r"Used (\\d+) registers", res.stderr).group(1))
"""


def compile_for_sm90(body: str) -> str:
    """Run :data:`SM90_COMPILE` then ``body`` (not formatted) without Triton's interpreter: the interpreter neither
    type-checks untaken branches nor runs 16-bit tensor-core dots, compiling does. Fails unless it prints
    COMPILED; returns its stdout."""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", SM90_COMPILE + body], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    assert res.returncode == 0 and "COMPILED" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout
