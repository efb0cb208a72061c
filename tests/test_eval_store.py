"""The results database: exact round trips, parallel writers, killed writers, migration, bad paths."""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest

from kvsieve.eval import store as store_module
from kvsieve.eval.report import SUMMARY_FIELDS, summarize
from kvsieve.eval.store import (
    ARCHIVE,
    DATABASE,
    FORMAT,
    Migration,
    ResultsFolderError,
    ResultStore,
    method_slug,
    migrate_folder,
)

GRID = {"tasks": ["vt"], "lengths": [512], "methods": ["dense"], "samples": 1}
RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def new_store(root: Path) -> ResultStore:
    store = ResultStore.open_for_run(root, {"seed": 0}, GRID)
    store.save_manifest()
    return store


def cell(sample: int, method: str = "dense", **fields) -> dict:
    return {"task": "vt", "length": 512, "sample": sample, "method": method, **fields}


def canonical(rows) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


def test_rows_read_back_exactly_as_written(tmp_path):
    store = new_store(tmp_path / "run")
    awkward = cell(0, score=None, density=1.0, sparse_calls=0, big=2**70, negative=-(2**63), flag=True,
                   nan=math.nan, inf=-math.inf, layers=[0.1, -0.0, 1e-300, math.nan], partial=[0.5, None],
                   ints=[1, 2], empty=[], gold=["ünïcode", "x\"y"], nested={"a": [1, {"b": None}]},
                   prediction="")
    awkward['we"ird name'] = 3
    plain = cell(1, "santa-sys:budget=16", score=0.5)  # lacks most fields: absent, not None
    store.write(awkward)
    store.write(plain)
    later = cell(2, density=0.25, added_later=[1.5])  # a field no earlier row has: a new column
    store.write(later)
    rows = ResultStore.open_existing(tmp_path / "run").rows()
    assert canonical(rows) == canonical([awkward, plain, later])
    got = {r["sample"]: r for r in rows}
    assert got[0]["score"] is None and "score" in got[0] and "density" not in got[1]
    assert type(got[0]["density"]) is float and type(got[0]["sparse_calls"]) is int and got[0]["flag"] is True
    assert math.copysign(1, got[0]["layers"][1]) == -1 and "added_later" not in got[0]
    assert store.read("vt", 512, 1, "santa-sys:budget=16") == plain
    assert store.has("vt", 512, 2, "dense") and not store.has("vt", 512, 3, "dense")
    assert store.finished() == {("vt", 512, s, m) for s, m in [(0, "dense"), (1, "santa-sys:budget=16"), (2, "dense")]}
    store.write({**plain, "score": 1.0})  # rewriting a cell replaces it
    assert store.read("vt", 512, 1, "santa-sys:budget=16")["score"] == 1.0 and len(store.rows()) == 3
    # Plain SQL sees the numbers: a None score is NULL, so aggregates skip it.
    import sqlite3

    con = sqlite3.connect(tmp_path / "run" / DATABASE)
    assert con.execute("SELECT avg(score), count(*) FROM cells").fetchone() == (1.0, 3)
    con.close()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [DATABASE, "manifest.json"]


def test_bad_rows_are_refused_and_leave_nothing(tmp_path):
    store = new_store(tmp_path / "run")
    with pytest.raises(ValueError, match=r"missing key field\(s\) \['method'\]"):
        store.write({"task": "vt", "length": 512, "sample": 0})
    with pytest.raises(ValueError, match="length must be int"):
        store.write(cell(0) | {"length": "512"})
    with pytest.raises(ValueError, match="null_fields.*reserved"):
        store.write(cell(0, null_fields=[]))
    with pytest.raises(ValueError, match="cannot store"):
        store.write(cell(0, when=object()))
    with pytest.raises(ValueError, match="cannot store"):  # the second row fails: the first is not kept
        store.write_many([cell(1), cell(2, when=object())])
    assert store.rows() == []


def _writer(root: str, worker: int, n: int, start) -> None:
    start.wait()
    store = ResultStore.open_existing(root)
    for i in range(n):
        # Each worker brings a field of its own, so both also add columns while the other writes.
        store.write(cell(i, f"m{worker}", score=i / n, **{f"only_{worker}": [float(i)] * 3}))


def test_two_processes_writing_at_once_lose_no_cell(tmp_path):
    store = new_store(tmp_path / "run")
    ctx = mp.get_context("fork")
    start = ctx.Barrier(2)
    n = 60
    procs = [ctx.Process(target=_writer, args=(str(store.root), w, n, start)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    rows = store.rows()
    assert len(rows) == 2 * n
    expected = [cell(i, f"m{w}", score=i / n, **{f"only_{w}": [float(i)] * 3}) for w in range(2) for i in range(n)]
    assert canonical(rows) == canonical(expected)
    assert not (store.root / f"{DATABASE}-wal").exists()  # the last connection folded the log back in


def _write_forever(root: str, done) -> None:
    store = ResultStore.open_existing(root)
    i = 0
    while True:
        store.write(cell(i, layers=[i + 0.5] * 30, prediction="x" * 100))
        done.value = i + 1
        i += 1


def test_a_killed_writer_loses_no_finished_cell_and_the_run_resumes(tmp_path):
    store = new_store(tmp_path / "run")
    ctx = mp.get_context("fork")
    done = ctx.Value("i", 0)
    proc = ctx.Process(target=_write_forever, args=(str(store.root), done))
    proc.start()
    while done.value < 25 and proc.is_alive():
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    reported = done.value
    assert reported >= 25
    rows = store.rows()  # opening recovers whatever the killed process had committed
    # Every cell it reported is there and complete; at most the one it was writing is missing.
    assert reported <= len(rows) <= reported + 1
    assert canonical(rows) == canonical([cell(i, layers=[i + 0.5] * 30, prediction="x" * 100)
                                         for i in range(len(rows))])
    # Resuming: the finished cells are skipped, the rest written.
    todo = [i for i in range(len(rows) + 5) if ("vt", 512, i, "dense") not in store.finished()]
    assert todo == list(range(len(rows), len(rows) + 5))
    store.write_many([cell(i) for i in todo])
    assert len(store.rows()) == len(rows) + 5


# ---- migration --------------------------------------------------------------------------------

def write_v1_folder(root: Path, rows: list[dict]) -> None:
    """A results folder as kvsieve wrote it before the database: one JSON file per cell."""
    root.mkdir(parents=True)
    manifest = {"format": FORMAT, "format_version": 1, "settings": {"seed": 0}, "grid": GRID, "commands": []}
    (root / "manifest.json").write_text(json.dumps(manifest))
    for r in rows:
        path = root / "cells" / r["task"] / str(r["length"]) / f"{r['sample']:05d}" / f"{method_slug(r['method'])}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, sort_keys=True) + "\n")
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


V1_ROWS = [cell(s, m, score=[1.0, None][s % 2], rel_error_by_layer=[0.1 * s, None], kl_mean=math.nan)
           for s in range(3) for m in ("dense", "santa-sys:budget=16,backend=reference")]


def test_migration_moves_every_cell_into_the_database(tmp_path, capsys):
    root = tmp_path / "old"
    write_v1_folder(root, V1_ROWS)
    leftover = root / "cells" / "vt" / "512" / "00000" / ".dense.json.abc.tmp"  # an interrupted v1 write
    leftover.write_text('{"task": "v')
    with pytest.raises(ResultsFolderError, match=r"one JSON file per cell.*kvsieve report .* --migrate"):
        ResultStore.open_existing(root)
    with pytest.raises(ResultsFolderError, match="--migrate"):
        ResultStore.open_for_run(root, {"seed": 0}, GRID)

    assert migrate_folder(root) == Migration(cells=6, removed=8)
    assert canonical(ResultStore.open_existing(root).rows()) == canonical(V1_ROWS)
    assert sorted(p.name for p in root.iterdir()) == [DATABASE, "manifest.json"]
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and manifest["migrations"][0]["cells"] == 6
    assert migrate_folder(root) == Migration(0, 0)  # already done: nothing to do

    from kvsieve.cli.main import main

    write_v1_folder(tmp_path / "cli", V1_ROWS)
    assert main(["report", str(tmp_path / "cli"), "--migrate"]) == 0
    assert "migrated 6 cells" in capsys.readouterr().out
    assert (tmp_path / "cli" / "summary.csv").is_file() and not (tmp_path / "cli" / "cells").exists()


def test_an_interrupted_migration_finishes_and_a_bad_cell_stops_it_before_any_change(tmp_path):
    root = tmp_path / "old"
    write_v1_folder(root, V1_ROWS)
    # Interrupted after the insert, before the manifest was updated: the database has some rows.
    ResultStore(root, {}).write_many(V1_ROWS[:2])
    assert migrate_folder(root).cells == 6
    assert canonical(ResultStore.open_existing(root).rows()) == canonical(V1_ROWS)

    # Interrupted after the manifest was updated, before the files were deleted.
    root2 = tmp_path / "half"
    write_v1_folder(root2, V1_ROWS)
    ResultStore(root2, {}).write_many(V1_ROWS)
    manifest = json.loads((root2 / "manifest.json").read_text())
    (root2 / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2}))
    with pytest.raises(ResultsFolderError, match="cells/ folder.*--migrate"):
        ResultStore.open_existing(root2)
    assert migrate_folder(root2).cells == 6 and not (root2 / "cells").exists()

    bad = tmp_path / "bad"
    write_v1_folder(bad, V1_ROWS)
    files = sorted(p for p in (bad / "cells").rglob("*.json"))
    files[0].write_text('{"task": "vt", "len')
    with pytest.raises(ResultsFolderError, match="unreadable.*delete it to recompute it"):
        migrate_folder(bad)
    files[0].rename(files[0].with_name("santa-sys@budget=64.json"))
    with pytest.raises(ResultsFolderError, match="unreadable"):
        migrate_folder(bad)
    files[0].with_name("santa-sys@budget=64.json").write_text(json.dumps(V1_ROWS[1]))
    with pytest.raises(ResultsFolderError, match="does not belong at that place"):
        migrate_folder(bad)
    assert not (bad / DATABASE).exists() and len(list((bad / "cells").rglob("*.json"))) == 6

    conflict = tmp_path / "conflict"
    write_v1_folder(conflict, V1_ROWS)
    ResultStore(conflict, {}).write({**V1_ROWS[0], "score": 0.25})
    with pytest.raises(ResultsFolderError, match="already holds a different cell"):
        migrate_folder(conflict)


COMMITTED = sorted(str(p.parent.relative_to(RESULTS)) for name in (DATABASE, ARCHIVE) for p in RESULTS.rglob(name))


def test_every_committed_results_folder_is_checked():
    assert len(COMMITTED) >= 27 and any(
        (RESULTS / f / ARCHIVE).is_file() for f in COMMITTED), "the committed results folders moved: update RESULTS"


@pytest.mark.parametrize("folder", COMMITTED)
def test_committed_results_regenerate_their_summary(folder):
    """Each committed database (plain or compressed) gives back the summary.csv committed beside it."""
    root = RESULTS / folder
    rows = ResultStore.open_existing(root).rows()
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=SUMMARY_FIELDS, lineterminator="\r\n")
    writer.writeheader()
    for s in summarize(rows):
        writer.writerow({k: s.get(k) for k in SUMMARY_FIELDS})
    assert buf.getvalue() == (root / "summary.csv").read_bytes().decode()


# ---- bad paths ---------------------------------------------------------------------------------

def test_bad_paths_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ResultsFolderError, match="does not exist"):
        ResultStore.open_existing(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ResultsFolderError, match="is not a folder"):
        ResultStore.open_existing(tmp_path / "file")
    with pytest.raises(ResultsFolderError, match="does not exist"):
        migrate_folder(tmp_path / "missing")
    with pytest.raises(ResultsFolderError, match="no manifest.json"):
        migrate_folder(tmp_path)

    store = new_store(tmp_path / "run")
    store.write(cell(0, score=1.0))
    db = store.root / DATABASE
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ResultsFolderError, match=r"cells.sqlite: file is not a database \(is it a kvsieve"):
        store.rows()
    with pytest.raises(ResultsFolderError, match="not a database"):
        store.write(cell(1))
    db.unlink()
    db.mkdir()
    with pytest.raises(ResultsFolderError, match="is not a file"):
        store.rows()


def test_a_compressed_database_is_read_as_it_is_and_refused_for_writing(tmp_path):
    store = new_store(tmp_path / "run")
    rows = [cell(0, score=1.0, layers=[0.25, 0.5]), cell(1, "santa-sys:budget=16", score=0.0, gold=["x"])]
    store.write_many(rows)
    db = store.root / DATABASE
    (store.root / ARCHIVE).write_bytes(gzip.compress(db.read_bytes()))
    db.unlink()
    again = ResultStore.open_existing(store.root)
    assert canonical(again.rows()) == canonical(rows)
    assert again.finished() == {("vt", 512, 0, "dense"), ("vt", 512, 1, "santa-sys:budget=16")}
    assert again.read("vt", 512, 1, "santa-sys:budget=16") == rows[1]
    assert sorted(p.name for p in store.root.iterdir()) == [ARCHIVE, "manifest.json"]  # nothing unpacked beside it
    with pytest.raises(ResultsFolderError, match=r"compressed in cells.sqlite.gz.*gunzip"):
        again.write(cell(2))
    with pytest.raises(ResultsFolderError, match="gunzip"):
        ResultStore.open_for_run(store.root, {"seed": 0, "device": "cpu"}, GRID).save_manifest()
    (store.root / ARCHIVE).write_bytes(b"not gzip" * 10)
    with pytest.raises(ResultsFolderError, match="cannot read .*cells.sqlite.gz"):
        again.rows()
    (store.root / ARCHIVE).write_bytes(gzip.compress(b"this is not sqlite" * 100))
    with pytest.raises(ResultsFolderError, match="not a database"):
        again.rows()


def test_a_read_only_copy_is_readable_unless_a_killed_run_left_its_log(tmp_path, monkeypatch):
    store = new_store(tmp_path / "run")
    store.write(cell(0, score=1.0))
    real_access = os.access
    # As root every path is writable; pretend the folder is a read-only checkout.
    monkeypatch.setattr(store_module.os, "access", lambda p, mode: False if mode == os.W_OK else real_access(p, mode))
    assert store.rows() == [cell(0, score=1.0)]
    assert sorted(p.name for p in store.root.iterdir()) == [DATABASE, "manifest.json"]
    (store.root / f"{DATABASE}-wal").write_bytes(b"\0" * 64)
    with pytest.raises(ResultsFolderError, match="read-only here.*a run was killed.*copy the folder"):
        store.rows()


def test_written_files_get_the_mode_of_any_new_file(tmp_path):
    import os

    from kvsieve.eval.store import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a" / "summary.md", "x")
        os.umask(0o027)
        atomic_write_text(tmp_path / "a" / "report.md", "y")
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "summary.md").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "a" / "report.md").stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["report.md", "summary.md"]  # no temporaries left
