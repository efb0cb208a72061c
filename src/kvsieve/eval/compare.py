"""Paired comparison of two methods in one results folder.

Two methods evaluated on the same prompts are compared prompt by prompt: the mean of (A − B) with a
95% bootstrap CI over the prompts both ran. That is much sharper than comparing their two score CIs
(each includes the prompt-to-prompt spread that the pairing cancels), and it is how claims such as
"vAttention beats top-k at equal density" are checked in ``docs/results``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from .bootstrap import paired_delta_ci

#: Row fields that can be compared, and the factor that puts them in the units of the reports.
METRICS = {"score": 100.0, "kl_mean": 1.0, "top1_agree": 1.0, "kl_answer": 1.0, "top1_answer": 1.0,
           "rel_error": 1.0, "density": 1.0, "kv_density": 1.0}


#: What a '*' after a difference means (printed under every comparison table).
STAR_NOTE = "* the 95% CI of A − B excludes 0: a paired difference at the 5% level (per row; not corrected " \
            "for the number of rows)"


def resolve_method(spec: str, present: Sequence[str]) -> str:
    """The folder's spelling of ``spec``: exact, its canonical form, or, for a bare method name, the one spec
    of that method in the folder; errors list the folder's methods."""
    if spec in present:
        return spec
    from ..core.registry import parse_spec
    from .runner import canonical_methods

    if ":" not in spec:
        same = [p for p in present if parse_spec(p)[0] == spec.strip()]
        if len(same) == 1:
            return same[0]
        if same:
            raise ValueError(f"method {spec!r} names {len(same)} specs in this folder; give one of:\n  "
                             + "\n  ".join(sorted(same)))
    canonical = canonical_methods([spec])[-1]
    if canonical in present:
        return canonical
    listing = "\n  ".join(sorted(present))
    raise ValueError(f"method {spec!r} has no cells in this folder; its methods are:\n  {listing}")


def compare_methods(rows: Sequence[dict[str, Any]], a: str, b: str, *,
                    metrics: Sequence[str] = ("score", "kl_mean", "top1_agree"), seed: int = 0) -> list[dict[str, Any]]:
    """Per (task, length) where both ran: n paired prompts and, per metric, mean A, mean B, A − B and its CI."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"metrics: unknown {unknown}; expected some of {sorted(METRICS)}")
    present = sorted({r["method"] for r in rows})
    a, b = resolve_method(a, present), resolve_method(b, present)
    if a == b:
        raise ValueError(f"compare: both methods are {a!r}; give two different methods")
    cells: dict[tuple[str, int], dict[str, dict[int, dict[str, Any]]]] = defaultdict(lambda: {a: {}, b: {}})
    for r in rows:
        if r["method"] in (a, b):
            cells[(r["task"], int(r["length"]))][r["method"]][r["sample"]] = r
    out = []
    for (task, length), by_method in sorted(cells.items()):
        samples = sorted(set(by_method[a]) & set(by_method[b]))
        if not samples:
            continue
        row: dict[str, Any] = {"task": task, "length": length, "n": len(samples)}
        for metric in metrics:
            factor = METRICS[metric]
            pairs = [(by_method[a][s].get(metric), by_method[b][s].get(metric)) for s in samples]
            pairs = [(factor * x, factor * y) for x, y in pairs if x is not None and y is not None]
            if not pairs:
                row[metric] = None
                continue
            xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
            delta, lo, hi = paired_delta_ci(xs, ys, seed=seed)
            row[metric] = {"a": math.fsum(xs) / len(xs), "b": math.fsum(ys) / len(ys), "delta": delta, "lo": lo,
                           "hi": hi, "n": len(pairs)}
        out.append(row)
    if not out:
        raise ValueError(f"compare: {a!r} and {b!r} share no prompt (task, length, sample) in this folder")
    return out


def comparison_table(result: Sequence[dict[str, Any]], metrics: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Header and text cells: per metric 'A | B | A − B [95% CI]' (a '*' marks a CI that excludes 0)."""
    header = ["task", "length", "n"]
    for m in metrics:
        header += [f"{m} A", f"{m} B", f"{m} A − B [95% CI]"]
    digits = {"score": 1}
    body = []
    for row in result:
        cells = [row["task"], str(row["length"]), str(row["n"])]
        for m in metrics:
            v = row[m]
            if v is None:
                cells += ["–", "–", "–"]
                continue
            d = digits.get(m, 4)
            star = "" if v["lo"] <= 0 <= v["hi"] else " *"
            cells += [f"{v['a']:.{d}f}", f"{v['b']:.{d}f}",
                      f"{v['delta']:+.{d}f} [{v['lo']:+.{d}f}, {v['hi']:+.{d}f}]{star}"]
        body.append(cells)
    return header, body
