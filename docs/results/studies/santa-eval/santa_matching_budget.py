"""Per (task, length, S²ANTA variant): the smallest budget from which every paired Δ-vs-dense CI includes 0.

Reads eval summary.csv files and prints the markdown table of docs/results/eval-baseline.md:
    python docs/results/studies/santa-eval/santa_matching_budget.py docs/results/eval-santa-cpu-2k/summary.csv \
        docs/results/eval-santa-h100-4k/summary.csv
"""

import collections
import csv
import sys


def main(paths: list[str]) -> None:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += list(csv.DictReader(f))
    by_variant = collections.defaultdict(dict)
    dense = {}
    for r in rows:
        if r["method"] == "dense":
            dense[(r["task"], r["length"])] = float(r["score"])
            continue
        name, _, params = r["method"].partition(":")
        budget = int(next(p for p in params.split(",") if p.startswith("budget=")).split("=")[1])
        by_variant[(r["task"], r["length"], name)][budget] = r
    print("| task | length | dense | variant | Δ at 16 / 32 / 64 / 128 / 256 | KL at 16 / 64 / 256 | matches from |")
    print("|---|---|---|---|---|---|---|")
    for (task, length, name), cells in sorted(by_variant.items()):
        budgets = sorted(cells)
        ok = [float(cells[b]["delta_lo"]) <= 0 <= float(cells[b]["delta_hi"]) for b in budgets]
        first = next((b for i, b in enumerate(budgets) if all(ok[i:])), None)
        marked = zip(budgets, ok, strict=True)
        deltas = " / ".join(f"{float(cells[b]['delta']):+.0f}" + ("" if o else "*") for b, o in marked)
        kls = " / ".join(f"{float(cells[b]['kl_mean']):.3f}" for b in (16, 64, 256) if b in cells)
        print(f"| {task} | {length} | {dense[(task, length)]:.0f} | {name} | {deltas} | {kls} | {first or '—'} |")


if __name__ == "__main__":
    main(sys.argv[1:])
