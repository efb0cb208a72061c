"""The results folder: a manifest plus one SQLite database holding every finished cell.

Layout (``docs/eval.md`` describes it for users)::

    <dir>/manifest.json      format tag and version, the settings every cell shares, grid history, runs log
    <dir>/cells.sqlite       one row per finished (task, length, sample, method) cell
    <dir>/summary.csv, summary.md, report.md, *.png   derived views (kvsieve eval / kvsieve report)

The database is in WAL mode and each cell is written in its own transaction, so worker processes
write into one folder at once, a killed run loses nothing already finished, and a re-run skips the
cells that are there. Every operation opens its own short-lived connection: once it closes, the
write-ahead log is folded back into ``cells.sqlite`` and removed, so a finished folder is the
database file alone (a ``cells.sqlite-wal`` beside it means a run was killed; the next open recovers it).
A finished folder may keep its database gzip-compressed as ``cells.sqlite.gz`` (``gzip -9n``: a third of
the size, for committed results): it is then read as it is and refused for writing until unpacked.

A cell is stored without repeating its field names: each field has a column, added the first time
a row carries it. Integers, finite floats and strings are stored as SQLite values (so ``SELECT
method, avg(score) FROM cells GROUP BY method`` works), a list of floats as little-endian float64
(``D`` + bytes) and anything else as JSON (``J`` + text). NULL means "the row has no such field";
a field whose value is ``None`` is NULL and named in the row's ``null_fields``. Reading gives back
exactly the row that was written (a test checks it on every committed results folder).

Folders of format version 1 hold one JSON file per cell under ``cells/``; :func:`migrate_folder`
(``kvsieve report DIR --migrate``) moves them into the database. A folder whose manifest is
missing (but which is not empty), unreadable, of another format, or written with different shared
settings is refused with a clear error: results are never silently mixed.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import secrets
import shutil
import sqlite3
import struct
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "kvsieve-eval-results"
FORMAT_VERSION = 2  # 1: one JSON file per cell under cells/ (read only by migrate_folder)
MANIFEST = "manifest.json"
DATABASE = "cells.sqlite"
ARCHIVE = DATABASE + ".gz"  # a finished folder's database, compressed: read-only
CELL_FILES = "cells"  # the per-cell JSON files of format version 1
# Settings added after folders had been written, with the value those folders implicitly used.
SETTINGS_ADDED_LATER = {"device": "cpu", "engine": "sparsify"}
KEY_FIELDS = ("task", "length", "sample", "method")
NULL_FIELDS = "null_fields"
# Parallel workers wait for each other's (millisecond) commits; a minute means something is stuck.
BUSY_TIMEOUT_S = 60.0
# Rows are about 0.6 KB: 16 KB pages keep each one inside its B-tree page (no overflow pages).
PAGE_SIZE = 16384
_FLOATS, _JSON = b"D", b"J"
_INT64 = (-(2**63), 2**63 - 1)


class ResultsFolderError(ValueError):
    """The output folder cannot be used: foreign, corrupt, or made with other settings."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it there. The file gets the mode any
    new file gets (0666 less the umask), not mkstemp's private 0600: results are meant to be read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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
    """The version-1 file name of a method spec (``santa-sys:budget=64`` -> ``santa-sys@budget=64``)."""
    slug = spec.replace(":", "@").replace(",", "+")
    if not re.fullmatch(r"[A-Za-z0-9_.=@+\-]+", slug):
        raise ValueError(f"method spec {spec!r}: cannot be used as a file name")
    return slug


# ---- one value <-> one SQLite value ---------------------------------------------------------

def _encode(value: Any) -> Any:
    """A SQLite value that :func:`_decode` turns back into ``value`` (``None`` is handled by the caller)."""
    if isinstance(value, bool):  # before int: bool is an int subclass, and SQLite would give back 0/1
        return _JSON + json.dumps(value).encode()
    if isinstance(value, int) and _INT64[0] <= value <= _INT64[1]:
        return value
    if isinstance(value, float) and math.isfinite(value):  # SQLite stores NaN as NULL
        return value
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(v) is float for v in value):
        return _FLOATS + struct.pack(f"<{len(value)}d", *value)
    try:
        return _JSON + json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    except TypeError as e:
        raise ValueError(f"results: cannot store {value!r}: a cell's fields must be JSON values ({e})") from e


def _decode(stored: Any) -> Any:
    if not isinstance(stored, bytes):
        return stored
    if stored[:1] == _FLOATS:
        return list(struct.unpack(f"<{(len(stored) - 1) // 8}d", stored[1:]))
    if stored[:1] == _JSON:
        return json.loads(stored[1:])
    raise ResultsFolderError(f"results: a stored value starts with {stored[:1]!r}, not D or J: not written by kvsieve")


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# ---- the store --------------------------------------------------------------------------------

class ResultStore:
    """Read and write one results folder. Use :meth:`open_for_run` or :meth:`open_existing`."""

    def __init__(self, root: Path, manifest: dict[str, Any]):
        self.root = root
        self.manifest = manifest

    @property
    def database(self) -> Path:
        return self.root / DATABASE

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def open_existing(cls, root: str | Path) -> ResultStore:
        root = Path(root)
        if not root.is_dir():
            what = "is not a folder" if root.exists() else "does not exist"
            raise ResultsFolderError(f"results: {root} {what}; expected a folder written by kvsieve eval --output")
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
            # a setting added later takes its old implicit value on whichever side does not name it
            old = {**SETTINGS_ADDED_LATER, **manifest["settings"]}
            new = {**SETTINGS_ADDED_LATER, **settings}
            diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if diff:
                details = "; ".join(f"{k}: folder has {old.get(k)!r}, this run {new.get(k)!r}" for k in diff)
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
        """Write the manifest and create the database if it is not there yet."""
        atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")
        with self._connect(write=True):
            pass

    # -- database ----------------------------------------------------------------------------

    @contextmanager
    def _connect(self, *, write: bool) -> Iterator[sqlite3.Connection | None]:
        """A connection for one operation, closed afterwards; ``None`` when reading a folder without a database.

        Writers take the write lock at ``BEGIN IMMEDIATE`` (waiting for other workers' commits), so
        reading the columns and inserting the row happen in one transaction.
        """
        path = self.database
        if path.exists() and not path.is_file():
            raise ResultsFolderError(f"results: {path} is not a file; it should be the folder's SQLite database")
        archive = self.root / ARCHIVE
        packed = not path.exists() and archive.is_file()
        if packed and write:
            raise ResultsFolderError(
                f"results: {self.root} keeps its cells compressed in {ARCHIVE}, which is read-only; "
                f"unpack it first (`gunzip {archive}`) to add cells")
        if not write and not path.exists() and not packed:
            yield None
            return
        with ExitStack() as stack:
            try:
                if packed:
                    unpacked = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvsieve-results-")))
                    con = _unpack(archive, unpacked / DATABASE)
                elif write or (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
                    # Readers too open read-write: the last connection to close folds the log back in and
                    # removes it (a read-only one would leave cells.sqlite-wal and -shm behind).
                    con = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
                else:
                    con = _connect_read_only_copy(path)
            except sqlite3.Error as e:
                raise ResultsFolderError(f"results: cannot open {archive if packed else path} ({e})") from e
            try:
                if write:
                    _create_schema(con)
                yield con
            except sqlite3.DatabaseError as e:
                hint = " (is it a kvsieve results database?)" if "not a database" in str(e) else ""
                raise ResultsFolderError(f"results: {archive if packed else path}: {e}{hint}") from e
            finally:
                con.close()

    def vacuum(self) -> None:
        """Rewrite the database without free pages (after a run or a migration: the committed file stays small)."""
        with self._connect(write=True) as con:
            con.execute("VACUUM")

    # -- cells -------------------------------------------------------------------------------

    def has(self, task: str, length: int, sample: int, method: str) -> bool:
        with self._connect(write=False) as con:
            return con is not None and con.execute(
                "SELECT 1 FROM cells WHERE task = ? AND length = ? AND sample = ? AND method = ?",
                (task, length, sample, method)).fetchone() is not None

    def finished(self) -> set[tuple[str, int, int, str]]:
        """The (task, length, sample, method) of every finished cell."""
        with self._connect(write=False) as con:
            if con is None:
                return set()
            return {tuple(k) for k in con.execute("SELECT task, length, sample, method FROM cells")}

    def read(self, task: str, length: int, sample: int, method: str) -> dict[str, Any]:
        with self._connect(write=False) as con:
            cur = None if con is None else con.execute(
                "SELECT * FROM cells WHERE task = ? AND length = ? AND sample = ? AND method = ?",
                (task, length, sample, method))
            found = [] if cur is None else _rows(cur)
        if not found:
            raise KeyError(f"results: {self.root} has no cell {task}/{length}/{sample}/{method}")
        return found[0]

    def write(self, row: dict[str, Any]) -> None:
        """Store one finished cell (replacing an earlier one with the same key) in one transaction."""
        self.write_many([row])

    def write_many(self, rows: list[dict[str, Any]]) -> None:
        """Store several cells in one transaction: all of them or, if anything fails, none."""
        encoded = [_encode_row(r) for r in rows]
        with self._connect(write=True) as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                columns = {c[1] for c in con.execute("PRAGMA table_info(cells)")}
                for values in encoded:
                    for name in values:
                        if name not in columns:
                            con.execute(f"ALTER TABLE cells ADD COLUMN {_quote(name)}")
                            columns.add(name)
                    names = ", ".join(_quote(n) for n in values)
                    marks = ", ".join("?" * len(values))
                    con.execute(f"INSERT OR REPLACE INTO cells ({names}) VALUES ({marks})", list(values.values()))
                con.execute("COMMIT")
            except BaseException:
                con.execute("ROLLBACK")
                raise

    def rows(self) -> list[dict[str, Any]]:
        """Every finished cell, ordered by task, length, sample and method."""
        with self._connect(write=False) as con:
            if con is None:
                return []
            return _rows(con.execute("SELECT * FROM cells ORDER BY task, length, sample, method"))


def _unpack(archive: Path, path: Path) -> sqlite3.Connection:
    """A read-only connection to ``archive`` (a gzip-compressed database), unpacked at ``path``."""
    try:
        with gzip.open(archive, "rb") as src, open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    except (OSError, EOFError) as e:
        raise ResultsFolderError(f"results: cannot read {archive} ({e}); it should be a gzip-compressed "
                                 f"{DATABASE}") from e
    return sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True, isolation_level=None)


def _connect_read_only_copy(path: Path) -> sqlite3.Connection:
    """A folder that cannot be written (a read-only checkout): SQLite cannot take WAL locks there, so the
    file is opened as immutable, which is safe because nothing can be writing it."""
    wal = path.with_name(path.name + "-wal")
    if wal.exists() and wal.stat().st_size > 0:
        raise ResultsFolderError(
            f"results: {path} is read-only here and {wal.name} beside it holds cells not yet folded into it "
            "(a run was killed): copy the folder somewhere writable and open it there")
    return sqlite3.connect(f"{path.resolve().as_uri()}?immutable=1", uri=True, isolation_level=None)


def _create_schema(con: sqlite3.Connection) -> None:
    if con.execute("SELECT 1 FROM sqlite_master WHERE name = 'cells'").fetchone():
        return
    con.execute(f"PRAGMA page_size = {PAGE_SIZE}")  # only takes effect on a new (empty) database
    if con.execute("PRAGMA journal_mode = WAL").fetchone()[0] != "wal":
        raise ResultsFolderError("results: SQLite refused WAL mode for this folder (a network file system?); "
                                 "use a local folder")
    con.execute(
        "CREATE TABLE IF NOT EXISTS cells (task TEXT NOT NULL, length INTEGER NOT NULL, sample INTEGER NOT NULL, "
        f"method TEXT NOT NULL, {NULL_FIELDS} TEXT, PRIMARY KEY (task, length, sample, method)) WITHOUT ROWID")


def _encode_row(row: dict[str, Any]) -> dict[str, Any]:
    """Column name -> stored value for one row; checks the key fields."""
    if not isinstance(row, dict):
        raise ValueError(f"row: expected a dict, got {type(row).__name__}")
    missing = [k for k in KEY_FIELDS if k not in row]
    if missing:
        raise ValueError(f"row: missing key field(s) {missing}; a cell needs {list(KEY_FIELDS)}")
    for k, kind in zip(KEY_FIELDS, (str, int, int, str), strict=True):
        if type(row[k]) is not kind:
            raise ValueError(f"row: {k} must be {kind.__name__}, got {row[k]!r}")
    if NULL_FIELDS in row:
        raise ValueError(f"row: the field name {NULL_FIELDS!r} is reserved by the results database")
    bad = [k for k in row if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"row: field names must be non-empty strings, got {bad!r}")
    values = {k: _encode(v) for k, v in row.items() if v is not None}
    nones = sorted(k for k, v in row.items() if v is None)
    values[NULL_FIELDS] = json.dumps(nones) if nones else None
    return values


def _rows(cur: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description]
    out = []
    for stored in cur:
        row, nones = {}, []
        for name, value in zip(names, stored, strict=True):
            if name == NULL_FIELDS:
                nones = json.loads(value) if value is not None else []
            elif value is not None:
                row[name] = _decode(value)
        out.append({**row, **dict.fromkeys(nones)})
    return out


def _read_manifest(root: Path, versions: tuple[int, ...] = (FORMAT_VERSION,)) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise ResultsFolderError(f"results: {root} has no {MANIFEST}; it is not a kvsieve eval results folder")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsFolderError(f"results: {path} is corrupt ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ResultsFolderError(f"results: {path} is not a kvsieve eval manifest (format {FORMAT!r} expected)")
    version = manifest.get("format_version")
    if version == 1 and version not in versions:
        raise ResultsFolderError(
            f"results: {root} holds one JSON file per cell (format version 1); convert it once into "
            f"{DATABASE} with `kvsieve report {root} --migrate`")
    if version not in versions:
        raise ResultsFolderError(
            f"results: {path} has format version {version!r}; this kvsieve reads version {FORMAT_VERSION}")
    if not isinstance(manifest.get("settings"), dict):
        raise ResultsFolderError(f"results: {path} has no settings block")
    if version == FORMAT_VERSION and (root / CELL_FILES).is_dir() and versions == (FORMAT_VERSION,):
        raise ResultsFolderError(
            f"results: {root} still has a {CELL_FILES}/ folder of per-cell files (an interrupted migration?); "
            f"finish it with `kvsieve report {root} --migrate`")
    return manifest


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# ---- migration from format version 1 ----------------------------------------------------------

@dataclass(frozen=True)
class Migration:
    cells: int  # cells moved into the database (0: the folder was already in the database layout)
    removed: int  # files deleted after the check: the cell files, leftover temporary files, rows.jsonl


def _v1_cell(root: Path, path: Path) -> dict[str, Any]:
    try:
        row = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ResultsFolderError(f"results: cell file {path} is unreadable ({e}); delete it to recompute it, "
                                 "then migrate again") from e
    if not isinstance(row, dict) or any(k not in row for k in KEY_FIELDS):
        raise ResultsFolderError(f"results: cell file {path} lacks the fields {list(KEY_FIELDS)}")
    expected = (root / CELL_FILES / row["task"] / str(row["length"]) / f"{row['sample']:05d}"
                / f"{method_slug(row['method'])}.json")
    if path != expected:
        raise ResultsFolderError(f"results: cell file {path} does not belong at that place (moved?); "
                                 "delete it to recompute it, then migrate again")
    return row


def migrate_folder(root: str | Path) -> Migration:
    """Move a version-1 folder's per-cell JSON files into ``cells.sqlite``.

    Every file is read and checked first (nothing changes if one is bad), the rows are inserted in
    one transaction, read back and compared with the files' JSON, and only then is the manifest
    set to version 2 and are the cell files (with ``rows.jsonl``, the old derived copy of every row,
    and temporary files of interrupted writes) deleted. Running it again after an interruption
    finishes the job; on a folder already migrated it does nothing.
    """
    root = Path(root)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise ResultsFolderError(f"results: {root} {what}; expected a kvsieve eval results folder to migrate")
    manifest = _read_manifest(root, versions=(1, FORMAT_VERSION))
    store = ResultStore(root, manifest)
    base = root / CELL_FILES
    if manifest["format_version"] == FORMAT_VERSION and not base.exists():
        return Migration(0, 0)
    files = sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
    leftovers = [p for p in files if p.name.startswith(".") and p.name.endswith(".tmp")]
    cells = [p for p in files if p not in leftovers]
    strays = [p for p in cells if p.suffix != ".json" or len(p.relative_to(base).parts) != 4]
    if strays:
        raise ResultsFolderError(f"results: {strays[0]} is not a kvsieve cell file; move it out of {base} "
                                 "and migrate again")
    rows = [_v1_cell(root, p) for p in cells]
    stored = {(r["task"], r["length"], r["sample"], r["method"]): r for r in store.rows()}
    new = []
    for r in rows:
        old = stored.get((r["task"], r["length"], r["sample"], r["method"]))
        if old is None:
            new.append(r)
        elif _canonical(old) != _canonical(r):
            raise ResultsFolderError(f"results: the database already holds a different cell "
                                     f"{r['task']}/{r['length']}/{r['sample']}/{r['method']}; not migrating")
    store.write_many(new)
    back = {(r["task"], r["length"], r["sample"], r["method"]): r for r in store.rows()}
    for r in rows:
        if _canonical(back[(r["task"], r["length"], r["sample"], r["method"])]) != _canonical(r):
            raise ResultsFolderError(f"results: cell {r['task']}/{r['length']}/{r['sample']}/{r['method']} reads "
                                     "back differently from its file; the files are kept")
    if manifest["format_version"] != FORMAT_VERSION:
        manifest["format_version"] = FORMAT_VERSION
        manifest.setdefault("migrations", []).append({"date": _now(), "from_version": 1, "cells": len(rows)})
        store.save_manifest()
    derived = [p for p in (root / "rows.jsonl",) if p.is_file()]
    if base.exists():
        shutil.rmtree(base)
    for p in derived:
        p.unlink()
    store.vacuum()
    return Migration(len(rows), len(files) + len(derived))


def _canonical(row: dict[str, Any]) -> str:
    # JSON text, not ==: NaN != NaN, but both rows spell it "NaN".
    return json.dumps(row, sort_keys=True)
