"""One benchmark run spread over several processes: ``kvsieve bench e2e --resume EARLIER.json``.

A device call may be shorter than a full grid of cases (and host times are clean only in a process whose
profiler has not run yet), so a run can continue from its earlier results file: the cases it already holds
are skipped, the rest run in this process, and the rows are joined into one results file whose header
keeps every process's date and command. Joining is refused, naming the field, where the two processes would
not make one table: another kind of run, device, software, dtype, attention, protocol, or other variants.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

#: results fields that must agree between the processes of one run
SAME = ("kind", "device", "torch", "transformers", "triton", "dtype", "attention", "protocol")


def load_previous(path: str | Path) -> dict:
    """An earlier results file of ``bench e2e`` (``.json`` or ``.json.gz``)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--resume: expected an earlier results file (.json or .json.gz), got {str(path)!r}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        results = json.load(f)
    if not isinstance(results, dict) or "rows" not in results or "kind" not in results:
        raise ValueError(f"--resume: {str(path)!r} is not a results file of kvsieve bench e2e")
    return results


def _variants(rows) -> set[str]:
    return {r["variant"] for r in rows if r.get("variant") not in (None, "*")}


def remaining_cases(previous: dict, shapes: Sequence[str], cases: Sequence[tuple[int, int]],
                    variants: Sequence[str]) -> list[tuple[int, int]]:
    """The ``(batch, n)`` of ``cases`` that ``previous`` lacks for some shape of ``shapes``; a ValueError when the
    earlier run timed other variants, or when nothing is left to run."""
    before = _variants(previous["rows"])
    if before and before != set(variants):
        raise ValueError(f"--resume: the earlier run timed {sorted(before)}, this one would time "
                         f"{sorted(set(variants))}: one table needs the same methods and baselines")
    done = {(r["shape"], r["batch"], r["n"]) for r in previous["rows"] if r.get("variant") != "*"}
    left = [c for c in cases if any((s, *c) not in done for s in shapes)]
    if not left:
        raise ValueError("--resume: every requested case is already in the earlier results")
    return left


def join(previous: dict, new: dict, previous_command: str, command: str) -> dict:
    """One results dict: ``previous``'s header with every process's date and command, its rows then ``new``'s
    (a case both hold keeps ``new``'s rows: re-run on purpose)."""
    for field in SAME:
        if previous.get(field) != new.get(field):
            raise ValueError(f"--resume: {field} differs between the runs ({previous.get(field)!r} before, "
                             f"{new.get(field)!r} now): they would not make one table")
    redone = {(r["shape"], r["batch"], r["n"]) for r in new["rows"]}
    rows = [r for r in previous["rows"] if (r["shape"], r["batch"], r["n"]) not in redone] + list(new["rows"])
    out = dict(previous)
    out["rows"] = rows
    out["dates"] = list(previous.get("dates", [previous["date"]])) + [new["date"]]
    out["commands"] = list(previous.get("commands", [previous_command])) + [command]
    for key in ("calibration", "saap_fits"):
        if key in new or key in previous:
            out[key] = {**previous.get(key, {}), **new.get(key, {})}
    return out


def joined_command(results: dict) -> str:
    """The header's command line of a run :func:`join` made: each process's command, in order."""
    return "  ;  ".join(f"({i + 1}) {c}" for i, c in enumerate(results["commands"]))
