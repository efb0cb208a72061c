"""Issue 15 §3's targets table from one GPU call: ``run.py`` (the weighted kernel, streaming, quest,
oracle-topk) and ``sampling.py`` (vattention, random, magicpig) write their JSON into the same folder
(``docs/results/studies/sparse-decode/targets.sh`` runs both), and this joins them into one table: per method, µs
and × FlashInfer at each context (FlashInfer measured in the same script, same process, as the row), the
target, whether it is met, and for every row the split the issue asks of a missed target: selection
vs attention µs, the bytes the call must touch, the byte floor and the fraction of it reached.

    python docs/results/studies/sparse-decode/targets.py OUT_DIR     # reads sparse_decode.json + sampling.json

Writes ``targets.md`` and ``targets.json`` into OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

# (label, source file, variant, target × FlashInfer at (32k, 128k) or None: report)
ROWS = [
    ("weighted sparse decode alone (page-16 lists)", "sparse_decode", "sparse-pages16", (6, 12)),
    ("streaming (sink + window = 5 %)", "sparse_decode", "streaming", (6, 12)),
    ("quest, pages group-summed per KV head", "sparse_decode", "quest-kv", (4, 7)),
    ("quest, per query head", "sparse_decode", "quest-q", (4, 7)),
    ("vattention, Quest predictor", "sampling", "vattention-quest", (3, 4)),
    ("vattention, oracle predictor (its default)", "sampling", "vattention-oracle", None),
    ("oracle-topk, per KV head", "sparse_decode", "oracle-topk-kv", (1.3, 1.5)),
    ("oracle-topk, per query head", "sparse_decode", "oracle-topk-q", (1.3, 1.5)),
    ("random", "sampling", "random", None),
    ("magicpig", "sampling", "magicpig", None),
    ("oracle-topp, top_p 0.9 (device select)", "sampling", "oracle-topp", None),
    ("oracle-topp, top_p 0.9 (torch select)", "sampling", "oracle-topp-torch-select", None),
]
LONG = 131072


def _f(v, spec=".1f"):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _find(res: dict, variant: str, n: int, batch: int) -> dict | None:
    return next((r for r in res["rows"] if r["variant"] == variant and r["n"] == n and r["batch"] == batch), None)


def collect(out_dir: Path) -> dict:
    sources = {}
    for name in ("sparse_decode", "sampling"):
        path = out_dir / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"{path} is missing: run run.py and sampling.py into the same OUT_DIR first")
        sources[name] = json.loads(path.read_text())
    cases = sorted({(r["n"], r["batch"]) for s in sources.values() for r in s["rows"]})
    rows = []
    for label, src, variant, target in ROWS:
        for n, batch in cases:
            r = _find(sources[src], variant, n, batch)
            if r is None:
                continue
            graph = r.get("graph_us")
            row = {"method": label, "variant": variant, "n": n, "batch": batch, "graph_us": graph,
                   "speedup_vs_flashinfer": r.get("speedup_vs_flashinfer"), "error": r.get("error"),
                   "selection_us": r.get("selection_graph_us"), "attention_us": r.get("attention_graph_us"),
                   "bytes": r.get("bytes"), "floor_us": r.get("floor_us"), "launches": r.get("launches"),
                   "density": r.get("density")}
            if graph and row["floor_us"]:
                row["of_floor"] = row["floor_us"] / graph
            if target is not None and batch == 1:
                row["target"] = target[1 if n >= LONG else 0]
                if row["speedup_vs_flashinfer"] is not None:
                    row["met"] = row["speedup_vs_flashinfer"] >= row["target"]
            rows.append(row)
    meta = {k: sources["sparse_decode"].get(k) for k in ("date", "device", "torch", "triton", "flashinfer",
                                                           "shape", "density", "protocol")}
    meta["commands"] = [s.get("command") for s in sources.values()]
    for key, src in (("flashinfer_us", "sparse_decode"), ("flashinfer_us_sampling", "sampling")):
        meta[key] = {f"{n}x{b}": (_find(sources[src], "flashinfer", n, b) or {}).get("graph_us") for n, b in cases}
    return {"meta": meta, "rows": rows}


def markdown(res: dict) -> str:
    m = res["meta"]
    fi = ", ".join(f"{k}: {_f(v)} / {_f(m['flashinfer_us_sampling'].get(k))} µs"
                   for k, v in m["flashinfer_us"].items())
    lines = [f"# Issue 15 targets — {m['device']} ({m['date']})", "",
             f"- commands (one GPU call): {'; '.join(f'`{c}`' for c in m['commands'])}",
             f"- torch {m['torch']}, triton {m['triton']}, FlashInfer {m['flashinfer']}; shape {m['shape']}, "
             f"≈ {m['density']:.0%} density; {m['protocol']}",
             f"- FlashInfer (context x batch: run.py / sampling.py, each the baseline of its own rows): {fi}",
             "- total = selection + attention, one captured call; floor = bytes the call must touch / the device "
             "copy rate; of floor = floor / time", "",
             "| method | n | batch | µs | × FlashInfer | target | met | selection µs | attention µs | MB | "
             "floor µs | of floor | launches |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if r.get("error"):
            lines.append(f"| {r['method']} | {r['n']:,} | {r['batch']} | error: {r['error'][:80]} | | | | | | | | | |")
            continue
        met = {True: "yes", False: "**no**"}.get(r.get("met"), "report")
        mb = None if r["bytes"] is None else r["bytes"] / 1e6
        lines.append(
            f"| {r['method']} | {r['n']:,} | {r['batch']} | {_f(r['graph_us'])} | "
            f"{_f(r['speedup_vs_flashinfer'], '.2f')} | {_f(r.get('target'), 'g')} | {met} | "
            f"{_f(r['selection_us'])} | {_f(r['attention_us'])} | {_f(mb)} | {_f(r['floor_us'])} | "
            f"{_f(r.get('of_floor'), '.0%')} | {r['launches'] if r['launches'] is not None else '—'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args(argv)
    res = collect(args.out_dir)
    (args.out_dir / "targets.json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    (args.out_dir / "targets.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
