"""The package's layering (docs/architecture.md), checked on the source: every import, lazy ones too.

core ← kernels ← methods ← driver ← integrations ← runtime ← eval, bench, fit ← cli. A module imports only
from its own layer or below; method modules use each other only through ``methods.shared``, and a
method's kernels (``kernels/<method>/``) another method's only through ``kernels/shared``; the
shared Triton helpers import no other kernel module; nothing below the command line imports the
``kvsieve`` facade itself. Besides: no import cycle among the modules, no source file over ``MAX_LINES``
lines, and no module (nor a benchmark) imports another module's private names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvsieve"
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

MAX_LINES = 800
# Method kernel packages that build on another method's kernels: bernoulli-qk runs S²ANTA's sampling passes.
KERNELS_BUILT_ON = {("bernoulli", "santa")}

# Files allowed over MAX_LINES, relative to src/kvsieve (none: split a file by concern instead).
LONG_FILES_ALLOWED: set[str] = set()

# Rank of each layer: a module may import from layers of equal or lower rank.
LAYERS = {
    "core": 0,
    "assets": 0,
    "kernels": 1,
    "methods": 2,
    "driver": 3,
    "integrations": 4,
    "runtime": 5,
    "eval": 6,
    "bench": 6,
    "fit": 6,
    "demo": 7,
    "cli": 7,
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
        if my_layer == "kernels" and their_layer == "kernels":
            mine, theirs = me.split(".")[2:3], target.split(".")[2:3]
            if mine and theirs and mine != theirs and theirs != ["shared"] and mine != ["shared"] \
                    and (mine[0], theirs[0]) not in KERNELS_BUILT_ON:
                out.append(f"{where}: a method's kernels use another method's (shared pieces go to kernels/shared)")
            if mine == ["shared"] and theirs and theirs != ["shared"]:
                out.append(f"{where}: kernels/shared depends on no method's kernels")
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
    (fake / "kernels" / "oracle_topk").mkdir(parents=True)
    kernel_cross = fake / "kernels" / "oracle_topk" / "topk.py"
    kernel_cross.write_text("from ..quest.quest_pages import candidate_mask\nfrom ..shared.scores import score_block\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    assert any("upward (core → methods)" in v for v in violations(bad))
    assert any("another method's module" in v for v in violations(cross))
    assert [v.split(" imports ")[1].split(":")[0] for v in violations(kernel_cross)] == [
        "kvsieve.kernels.quest.quest_pages", "kvsieve.kernels.quest.quest_pages.candidate_mask"]


def import_graph() -> dict[str, set[str]]:
    """Module -> the src modules it imports (lazy imports too; a package is its ``__init__``)."""
    paths = {module_name(p): p for p in sources()}
    return {m: {t for _, t in imported_modules(p) if t in paths and t != m} for m, p in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_source_file_over_max_lines():
    long = {str(p.relative_to(SRC)): line_count(p) for p in sources() if line_count(p) > MAX_LINES}
    assert set(long) <= LONG_FILES_ALLOWED, f"split these by concern (over {MAX_LINES} lines): {long}"
    stale = LONG_FILES_ALLOWED - set(long)
    assert not stale, f"no longer over {MAX_LINES} lines: remove {sorted(stale)} from LONG_FILES_ALLOWED"


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(path: Path, package: str | None) -> list[str]:
    """``file:line name`` for every private name (or private module) imported from a kvsieve module.
    ``package``: the file's package, to resolve relative imports (None outside ``src``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level and package is not None:
                base = package.split(".")
                module = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [(module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in targets:
            if module != "kvsieve" and not module.startswith("kvsieve."):
                continue
            private = [part for part in module.split(".") if is_private(part)]
            if name is not None and is_private(name):
                private.append(name)
            out += [f"{path}:{node.lineno} {module} {part}" for part in private]
    return out


def src_package(path: Path) -> str:
    return module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]


def test_no_private_name_imports_in_src():
    found = [v for p in sources() for v in private_imports(p, src_package(p))]
    assert found == [], "make the name public (and say what it is for) or keep it in its module"


def test_benchmarks_import_no_private_names():
    found = [v for p in sorted(BENCHMARKS.rglob("*.py")) for v in private_imports(p, None)]
    assert found == [], "benchmarks use the public API: make the name public in src"


def test_the_private_import_check_catches_one(tmp_path):
    bad = tmp_path / "bench.py"
    bad.write_text("from kvsieve.bench.e2e import _host_ms, public\nimport kvsieve._hidden\nfrom os import _exit\n")
    found = private_imports(bad, None)
    assert [v.split()[-1] for v in found] == ["_host_ms", "_hidden"]
    relative = tmp_path / "x.py"
    relative.write_text("from .select_common import _ordered\n")
    found = private_imports(relative, src_package(SRC / "kernels" / "shared" / "x.py"))
    assert found[0].endswith("kvsieve.kernels.shared.select_common _ordered")


def test_every_layer_directory_is_known():
    dirs = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    modules = {p.stem for p in SRC.glob("*.py") if p.stem != "__init__"}
    assert dirs | modules <= set(LAYERS), "add the new package to LAYERS and docs/architecture.md"


def _method_subclass_names() -> set[str]:
    import kvsieve
    from kvsieve.core.registry import method_class

    return {method_class(name).__name__ for name in kvsieve.methods()} - {"Method"}


def class_checks(path: Path, names: set[str]) -> list[str]:
    """``isinstance``/``issubclass`` calls against a method class (not the ``Method`` base) in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "isinstance", "issubclass") and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for c in classes:
                name = c.id if isinstance(c, ast.Name) else c.attr if isinstance(c, ast.Attribute) else None
                if name in names:
                    out.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {node.func.id}(..., {name})")
    return out


def test_no_special_case_for_a_method_class_outside_core_methods_and_the_driver():
    """What a method needs is declared on it (sparse_prefill, observes_prefill, ...) and served by the
    driver: nothing above the methods asks what class a method is."""
    names = _method_subclass_names()
    assert {"SketchWalk", "Saap", "Quest"} <= names
    found = []
    for path in sources():
        rel = path.relative_to(SRC)
        if rel.parts[0] in ("core", "methods", "kernels") or rel.name == "driver.py":
            continue
        found += class_checks(path, names)
    assert found == []


def test_the_class_check_catches_one(tmp_path, monkeypatch):
    fake = tmp_path / "kvsieve"
    fake.mkdir()
    bad = fake / "x.py"
    bad.write_text("def f(m):\n    return isinstance(m, SketchWalk) or issubclass(type(m), (int, sw.Saap))\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    assert len(class_checks(bad, {"SketchWalk", "Saap"})) == 2


# ---- benchmarks/: living tools on the public API -----------------------------------------------

BENCHMARKS = SRC.parents[1] / "benchmarks"


def private_uses(path: Path) -> list[str]:
    """Private kvsieve names a script imports (``from kvsieve.x import _y``, ``kvsieve._x``, ``from
    kvsieve.x import y`` then ``y._z``): the tools in benchmarks/ use only what the package publishes."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvsieve":
            private_module = any(part.startswith("_") for part in node.module.split("."))
            for alias in node.names:
                if private_module or alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvsieve":
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(f"{path.name}:{node.lineno} imports {alias.name}")
                    aliases.add((alias.asname or alias.name).split(".")[0])
    for node in ast.walk(tree):
        private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        if private and ast.unparse(node.value).split(".")[0] in aliases:
            found.append(f"{path.name}:{node.lineno} uses {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", sorted(BENCHMARKS.rglob("*.py")), ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_benchmark_tools_use_only_the_public_api(path):
    assert private_uses(path) == []


def test_the_benchmark_checker_catches_private_names(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text("import kvsieve.bench.e2e as e2e\nfrom kvsieve.kernels.triton_utils import _COMPILED, launch\n"
                      "from kvsieve.methods import sketchwalk as sw\nx = sw.SketchWalk._select\ny = e2e._host_ms\n"
                      "z = launch.__name__\n")
    assert [v.split(" ", 1)[1] for v in private_uses(script)] == [
        "imports kvsieve.kernels.triton_utils._COMPILED", "uses sw.SketchWalk._select", "uses e2e._host_ms"]
