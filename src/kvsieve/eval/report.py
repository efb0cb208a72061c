"""Summaries, terminal tables, PNG plots and ``report.md`` for a results folder.

- :func:`summarize` groups cell rows by (task, length, method): mean score with its 95% bootstrap
  CI, the paired delta to dense on the same prompts with its CI, density, KV bytes per step,
  attention error, teacher-forced KL and top-1 agreement.
- :func:`write_report` writes ``summary.csv``, ``summary.md``, four plots and ``report.md`` (score
  vs density with Pareto fronts per task, attention error vs budget, per-layer error heatmap,
  next-token KL vs budget); a plot without data is left out and ``report.md`` says why.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bootstrap import bootstrap_mean_ci, paired_delta_ci
from .store import ResultStore, atomic_write_text

DENSE = "dense"
SUMMARY_FIELDS = (
    "task", "length", "method", "n", "score", "score_lo", "score_hi", "delta", "delta_lo", "delta_hi",
    "density", "kv_density", "bytes_per_step", "rel_error", "kl_mean", "top1_agree", "kl_answer", "top1_answer",
    "new_tokens", "seconds",
)


def _mean(values: Sequence[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    # fsum: exactly rounded, so the summaries' digits do not depend on the Python version (3.12 compensates sum()).
    return math.fsum(vals) / len(vals) if vals else None


def method_family_budget(spec: str) -> tuple[str, float | None]:
    """(method name, its ``budget`` parameter if any) of a spec string."""
    from ..core.registry import method, parse_spec

    name, _ = parse_spec(spec)
    try:
        budget = getattr(method(spec).config, "budget", None)
    except ValueError:  # a method this installation does not know: read the spec text alone
        budget = parse_spec(spec)[1].get("budget")
    try:
        return name, float(budget) if budget is not None else None
    except (TypeError, ValueError):
        return name, None


def summarize(rows: Sequence[dict[str, Any]], *, seed: int = 0) -> list[dict[str, Any]]:
    """One summary row per (task, length, method), dense first within each (task, length)."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["task"], int(r["length"]), r["method"])].append(r)
    out = []
    def order(key: tuple[str, int, str]) -> tuple[Any, ...]:
        family, budget = method_family_budget(key[2])
        return key[0], key[1], key[2] != DENSE, family, budget if budget is not None else math.inf, key[2]

    for (task, length, method) in sorted(groups, key=order):
        cells = sorted(groups[(task, length, method)], key=lambda r: r["sample"])
        dense = {r["sample"]: r for r in groups.get((task, length, DENSE), [])}
        scores = [r["score"] for r in cells if r.get("score") is not None]
        s_mean, s_lo, s_hi = bootstrap_mean_ci([100 * s for s in scores], seed=seed) if scores else (None,) * 3
        paired = [(100 * r["score"], 100 * dense[r["sample"]]["score"]) for r in cells
                  if r.get("score") is not None and dense.get(r["sample"], {}).get("score") is not None]
        if paired and method != DENSE:
            d_mean, d_lo, d_hi = paired_delta_ci([m for m, _ in paired], [d for _, d in paired], seed=seed)
        else:
            d_mean = d_lo = d_hi = None
        out.append({
            "task": task, "length": length, "method": method, "n": len(cells),
            "score": s_mean, "score_lo": s_lo, "score_hi": s_hi, "delta": d_mean, "delta_lo": d_lo, "delta_hi": d_hi,
            "density": _mean([r.get("density") for r in cells]),
            "kv_density": _mean([r.get("kv_density") for r in cells]),
            "bytes_per_step": _mean([r.get("bytes_read_per_step") for r in cells]),
            "rel_error": _mean([r.get("rel_error") for r in cells]),
            "kl_mean": _mean([r.get("kl_mean") for r in cells]),
            "top1_agree": _mean([r.get("top1_agree") for r in cells]),
            "kl_answer": _mean([r.get("kl_answer") for r in cells]),
            "top1_answer": _mean([r.get("top1_answer") for r in cells]),
            "new_tokens": _mean([r.get("new_tokens") for r in cells]),
            "seconds": _mean([r.get("seconds") for r in cells]),
        })
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        return f"{value:.{digits}f}"
    return str(value)


def _ci(mean: Any, lo: Any, hi: Any, digits: int = 1, signed: bool = False) -> str:
    if mean is None:
        return "–"
    sign = "+" if signed else ""
    return f"{mean:{sign}.{digits}f} [{lo:{sign}.{digits}f}, {hi:{sign}.{digits}f}]"


def table_rows(summary: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and text cells shared by the terminal table and summary.md."""
    header = ["task", "length", "method", "n", "score [95% CI]", "Δ vs dense [95% CI]", "density", "kv density",
              "rel. error", "KL (nats)", "top-1"]
    body = []
    for s in summary:
        body.append([
            s["task"], str(s["length"]), s["method"], str(s["n"]),
            _ci(s["score"], s["score_lo"], s["score_hi"]),
            _ci(s["delta"], s["delta_lo"], s["delta_hi"], signed=True),
            _fmt(s["density"], 3), _fmt(s["kv_density"], 3), _fmt(s["rel_error"], 3),
            _fmt(s["kl_mean"], 4), _fmt(s["top1_agree"], 3),
        ])
    return header, body


def print_text_table(header: Sequence[str], body: Sequence[Sequence[str]], title: str,
                     sections: Sequence[Any] | None = None, left: Sequence[str] = ("task", "method")) -> None:
    """A table on stdout: rich on a terminal (a new section wherever ``sections[i]`` changes, cells wrapped
    to the terminal's width); piped or redirected, plain text with every row whole on one line. Cells may
    hold rich markup (``[red]no[/red]``); plain text drops it. Columns named in ``left`` are left-aligned,
    the others right-aligned."""
    import sys

    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        sys.stdout.write(plain_text_table(header, body, title, sections, left))
        return
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in header:
        # fold, never "…": a cut cell is a value the reader cannot copy
        table.add_column(h, justify="left" if h in left else "right", overflow="fold")
    for i, row in enumerate(body):
        if sections is not None and i > 0 and sections[i] != sections[i - 1]:
            table.add_section()
        table.add_row(*row)
    console.print(table)


def plain_text_table(header: Sequence[str], body: Sequence[Sequence[str]], title: str,
                     sections: Sequence[Any] | None = None, left: Sequence[str] = ("task", "method")) -> str:
    """The table as plain text: the title, then the header and one line per row, columns padded to their
    widest cell (never cut), a blank line between sections, line breaks inside a cell shown as ⏎."""
    from rich.text import Text

    # a line break inside a cell (a generated answer's) would split its row
    rows = [[Text.from_markup(str(cell)).plain.replace("\n", " ⏎ ") for cell in row] for row in body]
    widths = [max([len(h)] + [len(r[j]) for r in rows]) for j, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if h in left else c.rjust(w)
                         for c, w, h in zip(cells, widths, header, strict=True)).rstrip()

    lines = [*title.splitlines(), line(header), "  ".join("-" * w for w in widths)]
    for i, row in enumerate(rows):
        if sections is not None and i > 0 and sections[i] != sections[i - 1]:
            lines.append("")
        lines.append(line(row))
    return "\n".join(lines) + "\n"


def markdown_text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def print_table(summary: Sequence[dict[str, Any]], title: str = "kvsieve eval") -> None:
    header, body = table_rows(summary)
    print_text_table(header, body, title, sections=[(s["task"], s["length"]) for s in summary])


def markdown_table(summary: Sequence[dict[str, Any]]) -> str:
    return markdown_text_table(*table_rows(summary))


def write_tables(store: ResultStore, rows: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``summary.csv`` and ``summary.md`` in the results folder; returns the summary.

    The rows themselves are in the folder's database (``ResultStore.open_existing(dir).rows()``).
    """
    rows = store.rows() if rows is None else rows
    summary = summarize(rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=SUMMARY_FIELDS)
    writer.writeheader()
    for s in summary:
        writer.writerow({k: s.get(k) for k in SUMMARY_FIELDS})
    atomic_write_text(store.root / "summary.csv", buf.getvalue())
    atomic_write_text(store.root / "summary.md", markdown_table(summary))
    return summary


# ---- plots -----------------------------------------------------------------------------------

def _family_colors(methods: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    families = sorted({method_family_budget(m)[0] for m in methods})
    cmap = matplotlib.colormaps["tab10"]
    return {f: cmap(i % 10) for i, f in enumerate(families)}


def _pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten by another with lower-or-equal density and higher-or-equal score."""
    front, best = [], -math.inf
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return front


def plot_score_vs_density(summary: Sequence[dict[str, Any]], path: Path) -> bool:
    import matplotlib.pyplot as plt

    scored = [s for s in summary if s["score"] is not None and s["density"] is not None]
    if not scored:
        return False
    keys = sorted({(s["task"], s["length"]) for s in scored})
    colors = _family_colors([s["method"] for s in scored])
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax, (task, length) in zip(axes.flat, keys, strict=False):
        group = [s for s in scored if (s["task"], s["length"]) == (task, length)]
        seen = set()
        for s in group:
            fam, _ = method_family_budget(s["method"])
            ax.errorbar(s["density"], s["score"], yerr=[[s["score"] - s["score_lo"]], [s["score_hi"] - s["score"]]],
                        fmt="o", color=colors[fam], capsize=2, label=fam if fam not in seen else None)
            seen.add(fam)
        front = _pareto([(s["density"], s["score"]) for s in group])
        xs = [p[0] for p in front] + [max(s["density"] for s in group)]
        ys = [p[1] for p in front] + [front[-1][1]]
        ax.plot(xs, ys, "k--", lw=0.8, drawstyle="steps-post", label="Pareto front")
        dense = [s for s in group if s["method"] == DENSE]
        if dense:
            ax.axhline(dense[0]["score"], color="grey", lw=0.6, ls=":", label="dense score")
        ax.set_xscale("log")
        ax.set_title(f"{task} @ {length}")
        ax.set_xlabel("density (V rows read / N)")
        ax.set_ylabel("score (RULER recall, %)")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_vs_budget(summary: Sequence[dict[str, Any]], key: str, ylabel: str, path: Path, title: str) -> bool:
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, int], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in summary:
        fam, budget = method_family_budget(s["method"])
        if budget is None or s.get(key) is None:
            continue
        lines[(fam, s["length"])][budget].append(s[key])
    if not lines:
        return False
    colors = _family_colors([f for f, _ in lines])
    styles = ["-", "--", ":", "-."]
    lengths = sorted({n for _, n in lines})
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (fam, length), by_budget in sorted(lines.items()):
        xs = sorted(by_budget)
        ax.plot(xs, [sum(by_budget[x]) / len(by_budget[x]) for x in xs], marker="o", color=colors[fam],
                linestyle=styles[lengths.index(length) % len(styles)], label=f"{fam} @ {length}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("budget (sampled V rows per head)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_layer_heatmap(rows: Sequence[dict[str, Any]], path: Path) -> bool:
    import matplotlib.pyplot as plt
    import numpy as np

    per_method: dict[str, list[list[float]]] = defaultdict(list)
    for r in rows:
        if r["method"] != DENSE and r.get("rel_error_by_layer"):
            per_method[r["method"]].append(r["rel_error_by_layer"])
    if not per_method:
        return False

    def order(m: str) -> tuple[str, float]:
        fam, budget = method_family_budget(m)
        return fam, budget if budget is not None else math.inf

    methods = sorted(per_method, key=order)
    n_layers = max(len(v) for lists in per_method.values() for v in lists)
    grid = np.full((len(methods), n_layers), np.nan)
    for i, m in enumerate(methods):
        for j in range(n_layers):
            vals = [v[j] for v in per_method[m] if j < len(v) and v[j] is not None]
            if vals:
                grid[i, j] = float(np.mean(vals))
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * n_layers + 3), 0.35 * len(methods) + 1.8))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(methods)), methods, fontsize=7)
    ax.set_xlabel("layer")
    ax.set_title("relative attention-output error ‖ô − o‖/‖o‖ per layer (mean over tracked steps)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(results_dir: str | Path) -> Path:
    """Tables, plots and ``report.md`` for a results folder; returns the report's path."""
    return write_report_with_notes(results_dir)[0]


def write_report_with_notes(results_dir: str | Path) -> tuple[Path, list[str]]:
    """:func:`write_report`, and a note for every plot it did not draw and every method left out of the
    budget plots (also in ``report.md``)."""
    store = ResultStore.open_existing(results_dir)
    rows = store.rows()
    if not rows:
        raise ValueError(f"results: {store.root} holds no finished cells yet; run kvsieve eval first")
    summary = write_tables(store, rows)
    root = store.root
    plots, notes = [], []
    no_budget = sorted({s["method"] for s in summary
                        if s["method"] != DENSE and method_family_budget(s["method"])[1] is None})
    if plot_score_vs_density(summary, root / "score_vs_density.png"):
        plots.append(("Score vs density (Pareto front per task)", "score_vs_density.png"))
    else:
        notes.append("score_vs_density.png not drawn: no method has both a score and a density")
    if _plot_vs_budget(summary, "rel_error", "mean ‖ô − o‖/‖o‖", root / "error_vs_budget.png",
                       "Attention-output error vs budget"):
        plots.append(("Attention error vs budget", "error_vs_budget.png"))
    else:
        notes.append("error_vs_budget.png not drawn: no method with a budget parameter has an attention error "
                     "(kvsieve eval --track-error)")
    if plot_layer_heatmap(rows, root / "layer_error_heatmap.png"):
        plots.append(("Per-layer attention error", "layer_error_heatmap.png"))
    else:
        notes.append("layer_error_heatmap.png not drawn: no cell tracked the per-layer attention error "
                     "(kvsieve eval --track-error)")
    if _plot_vs_budget(summary, "kl_mean", "mean KL(dense ‖ method), nats", root / "kl_vs_budget.png",
                       "Teacher-forced next-token KL vs budget"):
        plots.append(("Next-token KL vs budget", "kl_vs_budget.png"))
    else:
        notes.append("kl_vs_budget.png not drawn: no method with a budget parameter has a next-token KL")
    if no_budget:
        notes.append("not in the budget plots (no budget parameter): " + ", ".join(no_budget))
    m = store.manifest
    runs = m.get("runs", [])
    fwd = sum(r.get("forward_s") or 0 for r in runs)
    tot = sum(r.get("total_s") or 0 for r in runs)
    lines = [
        "# kvsieve eval report", "",
        f"Results folder: `{root}`", "",
        "## Settings", "",
        "```json", json.dumps(m["settings"], indent=2, sort_keys=True), "```", "",
        f"Grid: tasks {', '.join(m['grid'].get('tasks', []))}; lengths "
        f"{', '.join(map(str, m['grid'].get('lengths', [])))}; {m['grid'].get('samples')} samples; methods "
        f"{', '.join(m['grid'].get('methods', []))}. Finished cells: {len(rows)}.", "",
        "Commands that wrote this folder:", "",
        *[f"    {c}" for c in m.get("commands", [])], "",
        "## Summary", "",
        "Score: RULER string-match recall in %, mean over samples with a 95% bootstrap CI. Δ: the paired "
        "difference to dense on the same prompts, with its 95% bootstrap CI. Density: V rows read / N per query "
        "head, kv density: the union over a GQA group, both means over the method's calls. Rel. error: "
        "‖ô − o‖/‖o‖ on tracked steps. KL / top-1: teacher-forced next-token agreement with dense over the "
        "question and gold answer (see docs/eval.md).", "",
        markdown_table(summary),
        "## Harness overhead", "",
        f"Time inside model forward passes: {fwd:.1f} s of {tot:.1f} s run time "
        f"(harness overhead {100 * (1 - fwd / tot):.1f}%)." if tot > 0 else "No timing recorded.", "",
    ]
    for title, fname in plots:
        lines += [f"## {title}", "", f"![{title}]({fname})", ""]
    if notes:
        lines += ["## Plots not drawn", "", *[f"- {note}" for note in notes], ""]
    path = root / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path, notes
