"""The benchmark scripts under ``benchmarks/`` (files, not a package) loaded as modules, for their host-side tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_bench(path: str):
    """The script ``benchmarks/<path>`` as a fresh module (each call executes it again)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, BENCHMARKS / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
