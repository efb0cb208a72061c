"""Recall of attention mass vs selectivity for SAAP, k-means (no RoPE) and k-means (roped) on held-out essays.

For each held-out prompt (essays ``i % 4 != 0``, never seen by the fit), one exact prefill records
every layer's q/k; then, per layer >= 1 and KV head, decode-like queries (positions in the second half
of the prompt) are scored as served: the KV head visits the ℓ buckets of largest group-summed score
(classifier probabilities for ``saap``, inner products with the centroids for the k-means baselines)
and each query of the group is credited with the causal attention mass that those buckets hold,
out of the mass outside the sink and the dense window (:func:`kvsieve.fit.saap.recall_metrics`).
Selectivity is the fraction of the indexed keys that the visited buckets hold: equal ℓ is not equal
cost when bucket sizes differ, so the plot is recall against selectivity.

Usage (CPU, about 3 minutes per prompt on 2 idle cores; ``--device cuda`` on a GPU)::

    python docs/results/studies/saap/recall.py --artifacts ~/saap-smollm2 --out docs/results/saap
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

from kvsieve.assets import essay_texts
from kvsieve.fit.saap import RECALL_PROBES, FitConfig, essay_names, essay_split, recall_metrics, text_prompts
from kvsieve.integrations.hf import capture_attention
from kvsieve.integrations.models import load_model
from kvsieve.methods.saap import load_artifacts

METHODS = ("saap", "kmeans", "kmeans-roped")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--queries", type=int, default=128, help="query positions per prompt (all heads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the prefills and the metrics run, e.g. cuda")
    p.add_argument("--allow-incomplete", action="store_true", help="use the finished layers of a running fit")
    p.add_argument("--tag", default="", help="suffix of the output names: recall-TAG.json/.md/.png")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    art = load_artifacts(args.artifacts, allow_incomplete=args.allow_incomplete)
    hp = art.manifest["hyperparameters"]
    model, tok = load_model(art.manifest["model"]["name"])
    _check(art, model)
    device = torch.device(args.device)
    model.to(device)
    known = {f for f in FitConfig.__dataclass_fields__}
    cfg = FitConfig(**{k: (tuple(v) if k == "layers" and v is not None else v) for k, v in hp.items() if k in known})
    _, held = essay_split()
    texts = essay_texts()
    prompts = text_prompts(tok, [texts[i] for i in held], args.prompt_tokens, args.prompts, "held-out text")
    # The window and filter of the fit's prompt length, applied to prompts of this length.
    cfg = FitConfig(**{**{k: getattr(cfg, k) for k in known}, "prompt_tokens": args.prompt_tokens})
    gen = torch.Generator().manual_seed(args.seed)
    layers = sorted(art.layers)
    per_layer: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for i, ids in enumerate(prompts):
        with torch.no_grad(), capture_attention(model, only_decode=False) as cap:
            model(torch.tensor([ids], device=device), use_cache=False)
        for layer, q, k, _v in cap.calls:
            if layer not in art.layers:
                continue
            t = art.layers[layer]
            net = art.classifier(layer, device)
            m = recall_metrics(net, art.rope, q, k, t["centroids"].to(device), t["centroids_roped"].to(device), cfg,
                               q.shape[-1] ** -0.5, gen, RECALL_PROBES, args.queries)
            n = m.pop("queries")
            acc = per_layer.setdefault(layer, {})
            for key, v in m.items():
                acc[key] = acc.get(key, 0.0) + v * n
            counts[layer] = counts.get(layer, 0) + n
        del cap
        print(f"prompt {i + 1}/{len(prompts)} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    for layer in per_layer:
        per_layer[layer] = {k: v / counts[layer] for k, v in per_layer[layer].items()}
    summary = {}
    for method in METHODS:
        for ell in RECALL_PROBES:
            key_r, key_s = f"recall@{ell}/{method}", f"selectivity@{ell}/{method}"
            if key_r not in per_layer[layers[0]]:
                continue
            vals = torch.tensor([per_layer[li][key_r] for li in layers])
            sels = torch.tensor([per_layer[li][key_s] for li in layers])
            wins = None
            if method != "saap":
                wins = int((torch.tensor([per_layer[li][f"recall@{ell}/saap"] for li in layers]) > vals).sum())
            summary[f"{method}@{ell}"] = {
                "method": method, "probes": ell, "recall": round(float(vals.mean()), 4),
                "recall_min_layer": round(float(vals.min()), 4), "selectivity": round(float(sels.mean()), 4),
                **({"layers_where_saap_recalls_more": f"{wins}/{len(layers)}"} if wins is not None else {}),
            }
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                       else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"),
            "command": " ".join(sys.argv),
            "artifacts": str(args.artifacts), "model": art.manifest["model"]["name"],
            "causal_labels": bool(hp.get("causal_labels")),
            "clusters": cfg.clusters, "window": cfg.window, "held_out_essays": essay_names(held),
            "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "queries_per_prompt": args.queries,
            "wall_s": round(time.perf_counter() - t0, 1), "fit_wall_s": art.manifest["wall_s"]}
    args.out.mkdir(parents=True, exist_ok=True)
    rounded = {str(li): {k: round(v, 4) for k, v in d.items()} for li, d in per_layer.items()}
    stem = f"recall-{args.tag}" if args.tag else "recall"
    (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "summary": summary, "per_layer": rounded},
                                                      indent=1))
    _markdown(args.out / f"{stem}.md", meta, summary, per_layer, layers)
    _plot(args.out / f"{stem}.png", summary, meta)
    print((args.out / f"{stem}.md").read_text())
    return 0


def _check(art, model) -> None:
    from kvsieve.methods.saap import config_hash, weights_fingerprint

    want = art.manifest["model"]
    if (config_hash(model.config), weights_fingerprint(model)) != (want["config_hash"], want["weights_fingerprint"]):
        raise ValueError(f"--artifacts: fitted on another model than {want['name']!r}")


def _markdown(path: Path, meta, summary, per_layer, layers) -> None:
    labels = "causal" if meta["causal_labels"] else "non-causal"
    lines = [f"# SAAP recall of attention mass on held-out essays ({meta['model']}, C = {meta['clusters']}, "
             f"classifier trained on {labels} labels)", "",
             f"{meta['date']}, {meta['device']}; `{meta['command']}`; {meta['prompts']} prompts x "
             f"{meta['prompt_tokens']} tokens from the held-out essays, {meta['queries_per_prompt']} decode-like "
             f"query positions each (second half of the prompt), layers {layers[0]}-{layers[-1]}, every KV head; "
             f"dense window {meta['window']} + sink excluded from the mass. Recall = attention mass in the visited "
             "buckets / mass outside the dense part; selectivity = keys in the visited buckets / indexed keys. "
             f"Fit wall time on this CPU: {meta['fit_wall_s'].get('total')} s.", "",
             "| ℓ | SAAP recall | SAAP sel. | k-means recall | k-means sel. | k-means roped recall | roped sel. | "
             "layers SAAP > k-means | layers SAAP > roped |", "|---|---|---|---|---|---|---|---|---|"]
    for ell in RECALL_PROBES:
        s, k, r = (summary.get(f"{m}@{ell}") for m in METHODS)
        if s is None:
            continue
        lines.append(f"| {ell} | {s['recall']:.3f} | {s['selectivity']:.3f} | {k['recall']:.3f} | "
                     f"{k['selectivity']:.3f} | {r['recall']:.3f} | {r['selectivity']:.3f} | "
                     f"{k['layers_where_saap_recalls_more']} | {r['layers_where_saap_recalls_more']} |")
    lines += ["", "Per layer, recall at ℓ = 8 (SAAP / k-means / k-means roped):", "",
              "| layer | SAAP | k-means | roped |", "|---|---|---|---|"]
    for li in layers:
        d = per_layer[li]
        s, k, r = (d[f"recall@8/{m}"] for m in METHODS)
        lines.append(f"| {li} | {s:.3f} | {k:.3f} | {r:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def _plot(path: Path, summary, meta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for method, label in zip(METHODS, ("SAAP (classifier)", "k-means, no RoPE", "k-means, roped"), strict=True):
        pts = sorted((v["selectivity"], v["recall"]) for v in summary.values() if v["method"] == method)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("selectivity (indexed keys visited)")
    ax.set_ylabel("recall of attention mass")
    ax.grid(alpha=0.3)
    ax.legend()
    labels = "causal" if meta["causal_labels"] else "non-causal"
    ax.set_title(f"{meta['model']}, C = {meta['clusters']}, {labels} training labels, held-out essays", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
