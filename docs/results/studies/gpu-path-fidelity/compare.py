"""Issue 15 §4: does a method's GPU path keep the fidelity its reference path measured?

Reads two `kvsieve eval` results folders run with the same task generator seed — ``new`` (the current
code on CUDA, where ``backend="auto"`` runs the Triton paths) and ``ref`` (the committed run, made
when every selection method ran its torch reference on CUDA) — pairs their cells prompt by prompt for
every (task, length, method) both hold, and prints (and writes, with ``--out``) a markdown table: score
of each, the paired difference with its 95% bootstrap CI, KL and density of each, and the backends the
new run used. Methods whose random streams changed since the reference run (counter-based RNG,
docs/decode-contract.md) are compared on the same prompts but not the same draws.

    python docs/results/studies/gpu-path-fidelity/compare.py NEW_FOLDER docs/results/vattention-eval-h100 --out OUT.md
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from kvsieve.eval.compare import compare_methods
from kvsieve.eval.store import ResultStore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("new")
    ap.add_argument("ref")
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    new_rows, ref_rows = ResultStore.open_existing(args.new).rows(), ResultStore.open_existing(args.ref).rows()
    shared = sorted({r["method"] for r in new_rows} & {r["method"] for r in ref_rows})
    if not shared:
        print("no method in common", file=sys.stderr)
        return 2
    lines = ["| task | length | method | n | backends (new) | score new | score ref | Δ [95% CI] | KL new | KL ref "
             "| density new | density ref |", "|---|---:|---|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    metrics = ("score", "kl_mean", "density")
    for method in shared:
        rows = ([{**r, "method": "new"} for r in new_rows if r["method"] == method]
                + [{**r, "method": "ref"} for r in ref_rows if r["method"] == method])
        backends = Counter(str(r.get("backends")) for r in new_rows if r["method"] == method)
        for cell in compare_methods(rows, "new", "ref", metrics=metrics):
            s, k, d = (cell[m] for m in metrics)
            star = "" if s["lo"] <= 0 <= s["hi"] else " *"
            lines.append(
                f"| {cell['task']} | {cell['length']} | `{method}` | {cell['n']} | {', '.join(sorted(backends))} "
                f"| {s['a']:.1f} | {s['b']:.1f} | {s['delta']:+.1f} [{s['lo']:+.1f}, {s['hi']:+.1f}]{star} "
                f"| {k['a']:.4f} | {k['b']:.4f} | {d['a']:.3f} | {d['b']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
