"""Sketch&Walk fidelity on the default model: walk vs one-hop vs oracle block top-k at equal density.

For a handful of real prompts (kvsieve's RULER-style task generators on the Paul Graham essays) at
one length, in two of the paper's modes:

- ``prefill``: the whole prompt through Sketch&Walk's block-sparse prefill (decode not involved);
  next-token KL(dense ‖ sparse) and top-1 agreement over the prompt's last ``--tail`` positions
  (the question and answer prefix), and the relative attention-output error of every sparse layer
  (``track_error``: exact attention on the same layer inputs).
- ``decode``: the prompt minus its last ``--tail`` tokens prefilled exactly (the method records its
  block sketches), then those tokens fed one at a time through Sketch&Walk's decode; the same
  metrics on those positions.

Selections compared at the same block budget per query block (``max(2, ⌈ρ(i+1)⌉)``): ``walk`` (the
method), ``one-hop`` (this layer's sketched scores alone) and ``oracle`` (exact head-averaged
attention mass per block). Dense layers {0, 1} as in the paper.

Usage::

    PYTHONPATH=src python docs/results/studies/sketchwalk/fidelity.py --out docs/results/sketchwalk-fidelity \
        --length 2048 --prompts 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

TASKS = ("niah_single_2", "vt", "fwe", "qa_1", "niah_multikey_1")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tail", type=int, default=16, help="positions scored (the prompt's last tokens)")
    p.add_argument("--densities", default="0.2,0.1")
    p.add_argument("--selections", default="walk,one-hop,oracle",
                   help="comma list (or ';' list) of walk modes, each optionally with '+'-joined parameters "
                        "for an ablation, e.g. 'one-hop;walk;walk+alpha=4;walk+sketch_dim=32'")
    p.add_argument("--modes", default="prefill,decode")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    return p.parse_args()


def kl_and_top1(dense_logits: torch.Tensor, logits: torch.Tensor) -> tuple[list[float], list[bool]]:
    p = torch.log_softmax(dense_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return kl.tolist(), (dense_logits.argmax(-1) == logits.argmax(-1)).tolist()


def main() -> None:
    args = parse()
    from transformers import DynamicCache

    import kvsieve
    from kvsieve.eval.tasks import make_sample

    torch.manual_seed(0)
    model, tok = kvsieve.load_model("default", device=args.device)
    tail = args.tail
    cells = []
    t_start = time.perf_counter()
    for index in range(args.prompts):
        task = TASKS[index % len(TASKS)]
        sample = make_sample(task, tok, args.length, index, seed=args.seed)
        ids = torch.tensor([list(sample.input_ids)], device=args.device)
        n = ids.shape[1]
        with torch.no_grad():
            dense = model(ids, logits_to_keep=tail).logits[0]
        for mode in args.modes.split(","):
            for density in (float(x) for x in args.densities.split(",")):
                for sel in args.selections.split(";" if ";" in args.selections else ","):
                    walk, *extra = sel.split("+")
                    spec = ",".join([f"sketchwalk:variant=reconstruction,density={density}", f"walk={walk}", *extra])
                    t0 = time.perf_counter()
                    with torch.no_grad(), kvsieve.sparsify(model, spec, phase=mode, track_error=1) as s:
                        if mode == "prefill":
                            logits = model(ids, logits_to_keep=tail).logits[0]
                        else:
                            cache = DynamicCache()
                            model(ids[:, : n - tail], past_key_values=cache, logits_to_keep=1)
                            rows = [model(ids[:, p: p + 1], past_key_values=cache).logits[0, -1]
                                    for p in range(n - tail, n)]
                            logits = torch.stack(rows)
                    kl, top1 = kl_and_top1(dense, logits)
                    recs = [r for r in s.records if "rel_error" in r]
                    cell = {"task": task, "index": index, "n_tokens": n, "mode": mode, "density": density,
                            "selection": sel, "kl_mean": statistics.fmean(kl), "kl_last": kl[-1],
                            "top1": statistics.fmean(top1),
                            "attn_rel_error": statistics.fmean(r["rel_error"] for r in recs),
                            "realised_density": statistics.fmean(r["density"] for r in recs),
                            "block_density": statistics.fmean(r["block_density"] for r in recs),
                            "seconds": round(time.perf_counter() - t0, 1)}
                    cells.append(cell)
                    print(json.dumps(cell), flush=True)
    summary = summarize(cells)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
            "model": "SmolLM2-135M-Instruct (default)", "torch": torch.__version__,
            "python": platform.python_version(), "command": " ".join(["python"] + sys.argv),
            "minutes": round((time.perf_counter() - t_start) / 60, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "cells": cells}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(meta, summary, args))
    print(args.out.with_suffix(".md").read_text())


def summarize(cells):
    """Per (mode, density, selection): means over prompts, and the paired walk − one-hop difference of
    the log KL per prompt (mean and its standard error)."""
    groups = {}
    for c in cells:
        groups.setdefault((c["mode"], c["density"], c["selection"]), []).append(c)
    rows = []
    for (mode, density, sel), cs in sorted(groups.items()):
        row = {"mode": mode, "density": density, "selection": sel, "prompts": len(cs)}
        for key in ("kl_mean", "top1", "attn_rel_error", "realised_density", "block_density"):
            row[key] = statistics.fmean(c[key] for c in cs)
        base = {c["index"]: c for c in groups.get((mode, density, "one-hop"), [])}
        diffs = [math.log(c["kl_mean"]) - math.log(base[c["index"]]["kl_mean"]) for c in cs if c["index"] in base]
        if sel != "one-hop" and len(diffs) >= 2:
            row["log_kl_vs_one_hop"] = statistics.fmean(diffs)
            row["log_kl_vs_one_hop_se"] = statistics.stdev(diffs) / math.sqrt(len(diffs))
        rows.append(row)
    return rows


def markdown(meta, summary, args) -> str:
    lines = [f"# Sketch&Walk fidelity: walk vs one-hop vs oracle block top-k ({meta['date']})", "",
             f"{meta['model']}, {meta['device']}, {args.prompts} prompts of {args.length} tokens "
             f"({', '.join(TASKS[: args.prompts])}), last {args.tail} positions scored; dense layers 0-1; "
             f"B = 64, m = 64, α = 8. Command: `{meta['command']}` ({meta['minutes']} min).", "",
             "KL: next-token KL(dense ‖ method), mean over positions and prompts. Attention error: relative "
             "error of each sparse layer's attention output vs exact attention on the same inputs, mean over "
             "layers and prompts. Δlog KL: paired mean over prompts of log KL(method) − log KL(one-hop) (± s.e.).", "",
             "| mode | ρ | selection | KL | top-1 | attn error | token density | block density | Δlog KL vs one-hop |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in summary:
        d = (f"{r['log_kl_vs_one_hop']:+.2f} ± {r['log_kl_vs_one_hop_se']:.2f}" if "log_kl_vs_one_hop" in r else "")
        lines.append(f"| {r['mode']} | {r['density']} | {r['selection']} | {r['kl_mean']:.4f} | {r['top1']:.3f} | "
                     f"{r['attn_rel_error']:.4f} | {r['realised_density']:.3f} | {r['block_density']:.3f} | {d} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
