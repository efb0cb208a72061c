"""Recall and selectivity per layer from a SAAP fit's manifest (the validation prompt's metrics that
``kvsieve fit saap`` records for every fitted layer), as a markdown table.

    python docs/results/studies/saap/fit_table.py ARTIFACTS_DIR/manifest.json > table.md
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

NAMES = ("saap", "kmeans", "kmeans-roped")
PROBES = (4, 8, 16, 32, 64)


def table(manifest: dict) -> str:
    metrics = {int(k): v for k, v in manifest["layer_metrics"].items()}
    layers = sorted(metrics)
    hp = manifest["hyperparameters"]
    wall = manifest["wall_s"]
    devices = sorted({v.get("device", "cpu") for v in wall["layers"].values()})
    lines = [f"# SAAP fit: recall of attention mass on the validation prompt, {len(layers)} layers",
             "",
             f"C = {hp['clusters']}, {hp['prompts']} training prompts + {hp['val_prompts']} validation prompt of "
             f"{hp['prompt_tokens']} tokens, window {hp['window']}, {hp['steps']} Adam steps, hidden {hp['hidden']}, "
             f"per {hp['per']} head, causal labels: {hp['causal_labels']}. Fit wall time {wall['total']:.0f} s "
             f"(collect {wall['collect']:.0f} s) on {', '.join(devices)}. Recall = causal attention mass in the "
             "visited buckets / mass outside the dense part; selectivity = keys of the visited buckets / indexed "
             "keys; mean over layers.",
             "",
             "| ℓ | " + " | ".join(f"{n} recall | {n} sel." for n in NAMES) + " | layers SAAP > k-means |",
             "|---|" + "---|---|" * len(NAMES) + "---|"]
    for ell in PROBES:
        cells = []
        for n in NAMES:
            rec = statistics.mean(metrics[li][f"recall@{ell}/{n}"] for li in layers)
            sel = statistics.mean(metrics[li][f"selectivity@{ell}/{n}"] for li in layers)
            cells.append(f"{rec:.3f} | {sel:.3f}")
        wins = sum(metrics[li][f"recall@{ell}/saap"] > metrics[li][f"recall@{ell}/kmeans"] for li in layers)
        lines.append(f"| {ell} | " + " | ".join(cells) + f" | {wins}/{len(layers)} |")
    lines += ["", "Per layer at ℓ = 8 (recall / selectivity) and the classifier's final training KL:", "",
              "| layer | SAAP | k-means | k-means roped | train KL |", "|---|---|---|---|---|"]
    for li in layers:
        m = metrics[li]
        row = [f"{m[f'recall@8/{n}']:.3f} / {m[f'selectivity@8/{n}']:.3f}" for n in NAMES]
        lines.append(f"| {li} | " + " | ".join(row) + f" | {m['train_kl']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table(json.loads(Path(sys.argv[1]).read_text())))
