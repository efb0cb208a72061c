"""The results folder: a manifest plus one JSON file per finished cell, each written atomically.

Layout (``docs/eval.md`` describes it for users)::

    <dir>/manifest.json                       format tag, the settings every cell shares, grid history
    <dir>/cells/<task>/<length>/<sample>/<method>.json   one finished (task, length, sample, method) cell
    <dir>/rows.jsonl, summary.csv, summary.md  derived views, rewritten at the end of every run

A cell file appears only once its row is complete (write to a temporary file, fsync, rename), so
an interrupted run loses nothing already finished and never leaves a half-written cell. A folder
whose manifest is missing (but which is not empty), unreadable, of another format, or written with
different shared settings is refused with a clear error: results are never silently mixed.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMAT = "kvsieve-eval-results"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CELLS = "cells"
# Settings added after folders had been written, with the value those folders implicitly used.
SETTINGS_ADDED_LATER = {"device": "cpu"}


class ResultsFolderError(ValueError):
    """The output folder cannot be used: foreign, corrupt, or made with other settings."""


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def method_slug(spec: str) -> str:
    """A file name for a method spec (``santa-sys:budget=64`` -> ``santa-sys@budget=64``)."""
    slug = spec.replace(":", "@").replace(",", "+")
    if not re.fullmatch(r"[A-Za-z0-9_.=@+\-]+", slug):
        raise ValueError(f"method spec {spec!r}: cannot be used as a file name")
    return slug


class ResultStore:
    """Read and write one results folder. Use :meth:`open_for_run` or :meth:`open_existing`."""

    def __init__(self, root: Path, manifest: dict[str, Any]):
        self.root = root
        self.manifest = manifest

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, root: str | Path) -> ResultStore:
        root = Path(root)
        if not root.is_dir():
            raise ResultsFolderError(f"results folder {root} does not exist")
        return cls(root, _read_manifest(root))

    @classmethod
    def open_for_run(cls, root: str | Path, settings: dict[str, Any], grid: dict[str, Any],
                     command: str | None = None) -> ResultStore:
        """Create the folder, or reopen it for resuming when its shared settings equal ``settings``.

        Nothing is written until :meth:`save_manifest` (so a run refused later leaves no trace).
        """
        root = Path(root)
        if root.exists() and not root.is_dir():
            raise ResultsFolderError(f"output: {root} exists and is not a folder")
        if root.is_dir() and (root / MANIFEST).exists():
            manifest = _read_manifest(root)
            old = {**SETTINGS_ADDED_LATER, **manifest["settings"]}
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            if diff:
                details = "; ".join(f"{k}: folder has {old.get(k)!r}, this run {settings.get(k)!r}" for k in diff)
                raise ResultsFolderError(
                    f"output: {root} holds results made with other settings ({details}). Results made "
                    "with different settings are not mixed: use another output folder"
                )
        elif root.is_dir() and any(root.iterdir()):
            raise ResultsFolderError(
                f"output: {root} is not empty and has no {MANIFEST}: it is not a kvsieve eval results "
                "folder. Choose a new or empty folder"
            )
        else:
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "settings": settings,
                        "created": _now(), "grid": {}, "commands": []}
        merged = dict(manifest.get("grid", {}))
        for key in ("tasks", "lengths", "methods"):
            seen = list(merged.get(key, []))
            seen += [x for x in grid[key] if x not in seen]
            merged[key] = seen
        merged["samples"] = max(int(merged.get("samples", 0)), int(grid["samples"]))
        manifest["grid"] = merged
        manifest["updated"] = _now()
        if command:
            manifest.setdefault("commands", []).append(command)
        return cls(root, manifest)

    def save_manifest(self) -> None:
        atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")

    # -- cells -------------------------------------------------------------------------------

    def cell_path(self, task: str, length: int, sample: int, method: str) -> Path:
        return self.root / CELLS / task / str(length) / f"{sample:05d}" / f"{method_slug(method)}.json"

    def has(self, task: str, length: int, sample: int, method: str) -> bool:
        return self.cell_path(task, length, sample, method).is_file()

    def read(self, task: str, length: int, sample: int, method: str) -> dict[str, Any]:
        return self._load_cell(self.cell_path(task, length, sample, method))

    def write(self, row: dict[str, Any]) -> None:
        path = self.cell_path(row["task"], row["length"], row["sample"], row["method"])
        atomic_write_text(path, json.dumps(row, sort_keys=True) + "\n")

    def rows(self) -> list[dict[str, Any]]:
        """Every finished cell, in a stable order."""
        return [self._load_cell(p) for p in sorted(self._cell_files())]

    def _cell_files(self) -> Iterator[Path]:
        base = self.root / CELLS
        if base.is_dir():
            yield from (p for p in base.glob("*/*/*/*.json"))

    def _load_cell(self, path: Path) -> dict[str, Any]:
        try:
            row = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ResultsFolderError(f"results: cell file {path} is unreadable ({e}); delete it to recompute it") from e
        missing = [k for k in ("task", "length", "sample", "method") if k not in row]
        if missing or path != self.cell_path(row["task"], row["length"], row["sample"], row["method"]):
            raise ResultsFolderError(
                f"results: cell file {path} does not belong at that place (missing {missing} or moved); "
                "delete it to recompute it"
            )
        return row


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise ResultsFolderError(f"results: {root} has no {MANIFEST}; it is not a kvsieve eval results folder")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsFolderError(f"results: {path} is corrupt ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ResultsFolderError(f"results: {path} is not a kvsieve eval manifest (format {FORMAT!r} expected)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ResultsFolderError(
            f"results: {path} has format version {manifest.get('format_version')!r}; this kvsieve reads "
            f"version {FORMAT_VERSION}"
        )
    if not isinstance(manifest.get("settings"), dict):
        raise ResultsFolderError(f"results: {path} has no settings block")
    return manifest


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
