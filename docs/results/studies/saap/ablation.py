"""Which training choice limits SAAP's classifier? One layer at a time, from a fit's kept q/k dumps.

Refits only the classifier of the chosen layers (the k-means partition is the fit's own) with one
setting changed at a time, and scores each on the fit's validation prompt with
:func:`kvsieve.fit.saap.recall_metrics` (decode-like queries, causal mass, batched probing):
the fit's own settings; causal or non-causal labels; no long-range filter; 4x the steps. The k-means
rows are the same for every variant (no training).

Usage (CPU, about 2 minutes per variant and layer on 2 busy cores; needs ``--keep-dumps`` fits)::

    python docs/results/studies/saap/ablation.py --artifacts ~/saap-smollm2 --layers 9,17 --out docs/results/saap
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from kvsieve.fit.saap import (
    RECALL_PROBES,
    Dumps,
    FitConfig,
    assign_all,
    layer_labels,
    model_rows,
    recall_metrics,
    train_classifier,
)
from kvsieve.methods.saap import load_artifacts

VARIANTS = {
    "default": {},
    "causal labels": {"causal_labels": True},
    "non-causal labels": {"causal_labels": False},
    "no long-range filter": {"long_range_keep": 1.0},
    "4x steps": {"steps_scale": 4},
    # the classifier's width: what a decode step reads (H·(d + C) weights per model) against what it recalls
    "hidden 64": {"hidden": 64},
    "hidden 256": {"hidden": 256},
    "hidden 512": {"hidden": 512},
    "hidden 1024": {"hidden": 1024},
}
# `--variants` picks a subset by name (the widths cost the CPU most: training time grows with the width).


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--layers", default="9,17")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train-prompts", type=int, default=4, help="training prompts used (of the fit's)")
    p.add_argument("--queries", type=int, default=256, help="candidate queries per prompt and head")
    p.add_argument("--val-queries", type=int, default=128)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variant names")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    art = load_artifacts(args.artifacts)
    hp = art.manifest["hyperparameters"]
    known = {f.name for f in dataclasses.fields(FitConfig)}
    base = FitConfig(**{k: v for k, v in hp.items() if k in known and k != "layers"})
    dumps = Dumps(Path(args.artifacts) / "dumps", art.shape, base.prompts + base.val_prompts, base.prompt_tokens)
    if not (dumps.folder / "progress.json").exists():
        raise ValueError(f"--artifacts: {args.artifacts} kept no dumps; refit with --keep-dumps")
    rope, d = art.rope, art.shape["head_dim"]
    group = art.shape["heads"] // art.shape["kv_heads"]
    rows = []
    for layer in [int(x) for x in args.layers.split(",")]:
        q_all, k_all = dumps.load(layer)
        q, k = q_all[: args.train_prompts], k_all[: args.train_prompts]
        qv, kv = q_all[base.prompts:], k_all[base.prompts:]
        t = art.layers[layer]
        cent, cent_r = t["centroids"], t["centroids_roped"]
        assign = assign_all(rope.invert(k, torch.arange(base.prompt_tokens)[None, None, :]), cent, base.sink)
        for name in args.variants.split(","):
            change = VARIANTS[name]
            t0 = time.perf_counter()
            fields = {kk: vv for kk, vv in change.items() if kk in known}
            cfg = dataclasses.replace(base, **fields)
            cfg = dataclasses.replace(cfg, steps=cfg.steps * change.get("steps_scale", 1))
            gen = torch.Generator().manual_seed(layer)
            rq, rp, (ry,), filt = layer_labels(q, k, [assign], cfg, d ** -0.5, gen, args.queries)
            x = [rope.invert(a, b) for a, b in zip(rq, rp, strict=True)]
            net, loss = train_classifier(model_rows(x, cfg.per, group), model_rows(ry, cfg.per, group), cfg, gen)
            m = recall_metrics(net, rope, qv, kv, cent, cent_r, cfg, d ** -0.5, torch.Generator().manual_seed(0),
                               RECALL_PROBES, args.val_queries)
            row = {"layer": layer, "variant": name, "train_kl": round(loss, 4), **filt, **m,
                   "wall_s": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            print(json.dumps({kk: vv for kk, vv in row.items() if "@8/" in kk or kk in ("layer", "variant")}),
                  flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": "CPU",
            "command": " ".join(sys.argv), "artifacts": str(args.artifacts),
            "wall_s": round(time.perf_counter() - t_start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ablation.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# SAAP classifier ablation ({meta['date']}, {meta['device']})", "", f"`{meta['command']}`. "
             "Recall of causal attention mass / selectivity of the indexed keys at ℓ visited buckets (C = "
             f"{base.clusters}), validation prompt, decode-like queries; k-means rows need no training.", "",
             "| layer | variant | train KL | ℓ=4 recall/sel | ℓ=8 recall/sel | ℓ=16 recall/sel | ℓ=32 recall/sel |",
             "|---|---|---|---|---|---|---|"]
    def cells(r, method):
        return " | ".join(f"{r[f'recall@{e}/{method}']:.3f} / {r[f'selectivity@{e}/{method}']:.3f}"
                          if f"recall@{e}/{method}" in r else "-" for e in (4, 8, 16, 32))

    for r in rows:
        lines.append(f"| {r['layer']} | {r['variant']} | {r['train_kl']} | {cells(r, 'saap')} |")
        if r["variant"] == "default":
            for km in ("kmeans", "kmeans-roped"):
                lines.append(f"| {r['layer']} | {km} (no training) | - | {cells(r, km)} |")
    (args.out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
