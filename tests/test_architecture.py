"""The package's layering (docs/architecture.md), checked on the source: every import, lazy ones too.

core ← kernels ← methods ← integrations ← runtime ← eval, bench, fit ← cli. A module imports only
from its own layer or below; method modules use each other only through ``methods.shared``; the
shared Triton helpers import no other kernel module; nothing below the command line imports the
``kvsieve`` facade itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvsieve"

# Rank of each layer: a module may import from layers of equal or lower rank.
LAYERS = {
    "core": 0,
    "assets": 0,
    "kernels": 1,
    "methods": 2,
    "integrations": 3,
    "runtime": 4,
    "eval": 5,
    "bench": 5,
    "fit": 5,
    "demo": 6,
    "cli": 6,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import x` / `from .pkg import mod`: the names may be modules themselves.
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return [(line, mod) for line, mod in found if mod == "kvsieve" or mod.startswith("kvsieve.")]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def violations(path: Path) -> list[str]:
    me = module_name(path)
    my_layer = layer_of(me)
    out = []
    for line, target in imported_modules(path):
        where = f"{path.relative_to(SRC.parent)}:{line} imports {target}"
        if my_layer is None:  # the kvsieve facade (__init__) may import anything
            continue
        if target == "kvsieve" and LAYERS[my_layer] < LAYERS["cli"]:
            out.append(f"{where}: the facade, from inside a layer")
            continue
        their_layer = layer_of(target)
        if their_layer is None:
            continue  # kvsieve.__version__ and the like resolve on the facade's names
        if LAYERS[their_layer] > LAYERS[my_layer]:
            out.append(f"{where}: upward ({my_layer} → {their_layer})")
        if my_layer == "methods" and their_layer == "methods":
            mine_shared = me.startswith("kvsieve.methods.shared")
            theirs = target.split(".")
            theirs_shared = len(theirs) > 2 and theirs[2] == "shared"
            same_module = theirs[:3] == me.split(".")[:3]
            if not theirs_shared and target != "kvsieve.methods" and not mine_shared and not same_module:
                out.append(f"{where}: a method module uses another method's module (use methods.shared)")
            if mine_shared and not theirs_shared and target != "kvsieve.methods":
                out.append(f"{where}: methods.shared must not depend on a method module")
        if me == "kvsieve.kernels.shared.triton_utils" and their_layer == "kernels" and target != me:
            out.append(f"{where}: the shared Triton helpers import no other kernel module")
    return out


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_run_downward(path):
    assert violations(path) == []


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "kvsieve"
    (fake / "core").mkdir(parents=True)
    (fake / "methods").mkdir()
    bad = fake / "core" / "bad.py"
    bad.write_text("def f():\n    from ..methods import quest\n")
    cross = fake / "methods" / "a.py"
    cross.write_text("from .b import thing\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    assert any("upward (core → methods)" in v for v in violations(bad))
    assert any("another method's module" in v for v in violations(cross))


def test_every_layer_directory_is_known():
    dirs = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    modules = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert dirs | modules <= set(LAYERS), "add the new package to LAYERS and docs/architecture.md"
