"""The dependency bounds in pyproject.toml: every requirement is bounded above, the installed releases
lie within the bounds, and the install script's torch pin too."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# ruff is a linter whose newest release is wanted; everything the library or its tests import is bounded
UNBOUNDED = {"ruff"}


def _requirements() -> list:
    listed = PROJECT["dependencies"] + [r for extra in PROJECT["optional-dependencies"].values() for r in extra]
    return [requirements.Requirement(text) for text in listed]


def test_every_requirement_has_an_upper_bound():
    for req in _requirements():
        if req.name in UNBOUNDED:
            continue
        assert any(spec.operator in ("<", "<=", "==", "~=") for spec in req.specifier), str(req)


def test_the_installed_releases_lie_within_the_bounds():
    for req in _requirements():
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue  # an extra that is not installed here
        # a local build tag (2.13.0+cpu) is the same release
        assert req.specifier.contains(installed.split("+")[0], prereleases=True), (str(req), installed)


def test_the_install_scripts_torch_pin_lies_within_the_bounds():
    pin = re.search(r"KVSIEVE_TORCH:-([0-9.]+)", (ROOT / "scripts" / "install.sh").read_text()).group(1)
    torch_req = next(r for r in _requirements() if r.name == "torch")
    assert torch_req.specifier.contains(pin), (pin, str(torch_req))
