"""Sketch&Walk, the authors' variant: walk vs one-hop vs oracle block top-k vs Quest at equal density.

The fidelity grid of the reconstruction (``docs/results/sketchwalk/eval-*``, ``walk-vs-onehop.md``) again, with
the authors' algorithm (``variant=authors``, the default): for each phase and length one ``kvsieve eval``
folder holding

- ``dense``;
- ``sketchwalk``: the authors' damped walk with their defaults (β = 0.25, degree 3);
- ``sketchwalk:walk_damping=0``: the same rule with β = 0, so the walk is ``W = A`` (one hop);
- ``sketchwalk:variant=reconstruction,density=ρ,walk=oracle``: block top-k on the exact head-averaged
  attention mass per block, ρ chosen per (task, length) so that its realised density equals the density
  the authors' walk kept in that cell (measured from the cells' stats, never assumed);
- ``quest:sink=64,window=64,top_k=t`` (phase ``question`` only: Quest has no sparse prefill), t matched
  the same way.

Phases (``kvsieve eval --phase``): ``question`` = decode-only (setup B: context exact, question and answer
sparse), ``prefill`` = prefill-only (the context through the sparse prefill, question and answer exact),
``all`` = end to end. Dense layers 0, 1 (SmolLM2; ``--model gemma3-270m``: none named, see ``MODELS``); 16 new
tokens; 20 prompts per task; seed 0 (the old grid's settings).

Per task the walk and one-hop run first, then the baselines at the matched density, so a run stopped
early leaves whole comparisons. Each folder's ``matched.json`` records the measured densities and the
specs chosen. ``summary`` writes the paired comparisons (95 % bootstrap CIs over prompts,
:mod:`kvsieve.eval.compare`) beside the reconstruction's numbers from the old folders.

Usage (repository root)::

    PYTHONPATH=src python docs/results/studies/sketchwalk-authors/fidelity_grid.py run \\
        --phases question,prefill,all --lengths 2048 --samples 20 --device cpu --stop-after 3600
    PYTHONPATH=src python docs/results/studies/sketchwalk-authors/fidelity_grid.py summary
    PYTHONPATH=src python docs/results/studies/sketchwalk-authors/fidelity_grid.py pack   # gzip the databases
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import statistics
import time
from pathlib import Path

OUT = Path("docs/results/sketchwalk-authors")
OLD = Path("docs/results/sketchwalk")
TASKS = ("niah_single_2", "niah_multikey_1", "vt", "fwe", "qa_1")
PHASES = {"question": "decode-only", "prefill": "prefill-only", "all": "end to end"}
OLD_PREFIX = {"question": "eval-setupB", "prefill": "eval-phase-prefill", "all": "eval-phase-all"}
WALK = "sketchwalk"
ONE_HOP = "sketchwalk:walk_damping=0"
BLOCK = 64  # the oracle's block size (the reconstruction's default)
QUEST_SINK = QUEST_WINDOW = 64
ANSWER = 8  # answer tokens generated on average (16 at most, fewer when solved early)
METRICS = ("score", "kl_mean", "kl_answer", "rel_error", "density")
# model -> (the folders' name tag, the layers kept exact). SmolLM2: its first two layers, as the reconstruction's
# grid. Gemma 3 270M: none named; its sliding-window layers stay exact by kvsieve's rule (a layer whose attention
# carries a sliding window is never sparsified), so the method runs on the global layers 5, 11 and 17.
MODELS = {"default": ("", "0,1"), "gemma3-270m": ("gemma3", "")}
MODEL_LABELS = {"": "SmolLM2-135M", "gemma3": "Gemma 3 270M"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="compute (or resume) the cells")
    run.add_argument("--phases", default="question,prefill,all")
    run.add_argument("--lengths", default="2048,4096,8192")
    run.add_argument("--tasks", default=",".join(TASKS))
    run.add_argument("--samples", type=int, default=20)
    run.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<i> (part of each folder's name)")
    run.add_argument("--model", default="default", choices=tuple(MODELS),
                     help="default (SmolLM2-135M, layers 0 and 1 exact) or gemma3-270m (its 3 global layers sparse, "
                          "its 15 sliding-window layers exact as kvsieve keeps them; part of the folder's name)")
    run.add_argument("--workers", type=int, default=1)
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--stop-after", type=float, default=None, help="start no new prompt after this many seconds")
    run.add_argument("--out", type=Path, default=OUT)
    summ = sub.add_parser("summary", help="write OUT/fidelity.md (+ .json) from the folders")
    summ.add_argument("--out", type=Path, default=OUT)
    summ.add_argument("--old", type=Path, default=OLD)
    pack = sub.add_parser("pack", help="gzip every folder's database (gzip -9n, read-only afterwards)")
    pack.add_argument("--out", type=Path, default=OUT)
    return p.parse_args()


# -- matching the baselines' density -----------------------------------------------------------------


def oracle_prefill_density(rho: float, n: int) -> float:
    """Share of the n(n+1)/2 causal (query, key) pairs that block top-k with ``max(2, ⌈ρ(i+1)⌉)`` blocks per
    query block ``i`` reads (block 0 and the query's own block among them; the own block causally)."""
    read = 0
    for i in range(math.ceil(n / BLOCK)):
        rows = min(BLOCK, n - i * BLOCK)
        kept = min(i + 1, max(2, math.ceil(rho * (i + 1) - 1e-9)))
        read += rows * (kept - 1) * BLOCK + rows * (rows + 1) // 2
    return read / (n * (n + 1) / 2)


def oracle_decode_density(rho: float, n: int, first: int | None = None) -> float:
    """Mean share of the keys that decode rows at positions ``first`` .. n − 1 read under the same budget
    (the question's rows and the answer's; one row at n − 1 without ``first``)."""
    shares = []
    for p in range(n - 1 if first is None else first, n):
        c = p // BLOCK
        kept = min(c + 1, max(2, math.ceil(rho * (c + 1) - 1e-9)))
        shares.append(((kept - 1) * BLOCK + p % BLOCK + 1) / (p + 1))
    return statistics.fmean(shares)


def match_rho(target: float, n: int, phase: str, question_start: int) -> float:
    """The ρ whose predicted realised density is closest to ``target`` (bisection; the prediction is monotone).
    Decode-only rows run from the question's start to the answer's end (``ANSWER`` tokens on average)."""
    def f(rho):
        if phase == "question":
            return oracle_decode_density(rho, n + ANSWER, question_start)
        return oracle_prefill_density(rho, n)
    lo, hi = 1e-4, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return round(hi, 4)


def match_quest(target: float, n: int) -> float:
    """Quest's ``top_k`` (a fraction of the context) so that sink + window + top-k pages read ``target``·n keys."""
    return round(max(target - (QUEST_SINK + QUEST_WINDOW) / n, 1.0 / n), 4)


# -- running -----------------------------------------------------------------------------------------


def folder_name(phase: str, length: int, device: str, model: str = "default") -> str:
    # rounded: SmolLM2's 8k cells are 8,176 tokens (its context is 8,192 including the 16 new tokens)
    tag = MODELS[model][0]
    return f"eval-{phase}-{round(length / 1024)}k-{tag + '-' if tag else ''}{device.split(':')[0]}"


def model_tag(folder: Path) -> str:
    """The folder's model tag ("" for SmolLM2): the part between the length and the device, if any."""
    parts = folder.name.split("-")
    return "-".join(parts[3:-1])


def eval_args(args, phase: str, length: int, task: str, methods: list[str], folder: Path,
              stop_after: float | None) -> list[str]:
    dense_layers = MODELS[args.model][1]
    argv = ["eval", "--model", args.model, "--tasks", task, "--lengths", str(length), "--samples", str(args.samples),
            "--phase", phase, "--max-new-tokens", "16", *(["--dense-layers", dense_layers] if dense_layers else []),
            "--device", args.device,
            "--workers", str(args.workers), "--threads", str(args.threads), "--quiet",
            "--methods", ";".join(["dense", *methods]), "--output", str(folder)]
    if stop_after is not None:
        argv += ["--stop-after", str(int(max(stop_after, 1)))]
    return argv


def unpack(folder: Path) -> None:
    """A packed folder (cells.sqlite.gz) is unpacked to be resumed."""
    gz, db = folder / "cells.sqlite.gz", folder / "cells.sqlite"
    if gz.exists() and not db.exists():
        with gzip.open(gz, "rb") as src, open(db, "wb") as dst:
            shutil.copyfileobj(src, dst)
        gz.unlink()


def rows_of(folder: Path) -> list[dict]:
    from kvsieve.eval.store import ResultStore

    if not (folder / "manifest.json").exists():
        return []
    return ResultStore.open_existing(folder).rows()


def run(args) -> None:
    from kvsieve.cli.main import main as kvsieve

    deadline = None if args.stop_after is None else time.monotonic() + args.stop_after
    for length in (int(x) for x in args.lengths.split(",")):
        for phase in args.phases.split(","):
            folder = args.out / folder_name(phase, length, args.device, args.model)
            folder.parent.mkdir(parents=True, exist_ok=True)
            unpack(folder)
            matched_path = folder / "matched.json"
            matched = json.loads(matched_path.read_text()) if matched_path.exists() else {}
            for task in args.tasks.split(","):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    print("stop-after reached", flush=True)
                    return
                print(f"== {phase} {length} {task}: walk and one-hop", flush=True)
                if kvsieve(eval_args(args, phase, length, task, [WALK, ONE_HOP], folder, left)) != 0:
                    raise SystemExit(f"kvsieve eval failed ({phase} {length} {task})")
                walk = [r for r in rows_of(folder) if r["task"] == task and r["method"] == WALK]
                if not walk:
                    continue
                entry = matched.get(task)
                if entry is None or entry["walk_prompts"] < len(walk):
                    # Matched on the prompts the walk ran; a later resume with more prompts keeps the first
                    # match (the baselines' specs are part of their cells' names).
                    if entry is None:
                        target = statistics.fmean(r["density"] for r in walk)
                        n = round(statistics.fmean(r["n_tokens"] for r in walk))
                        q0 = round(statistics.fmean(r["question_start"] for r in walk))
                        rho = match_rho(target, n, phase, q0)
                        entry = {"walk_density": target, "walk_prompts": len(walk), "n_tokens": n,
                                 "oracle": f"sketchwalk:variant=reconstruction,density={rho},walk=oracle"}
                        if phase == "question":
                            entry["quest"] = (f"quest:sink={QUEST_SINK},window={QUEST_WINDOW},"
                                              f"top_k={match_quest(target, n)}")
                        matched[task] = entry
                        matched_path.write_text(json.dumps(matched, indent=1) + "\n")
                baselines = [entry["oracle"]] + ([entry["quest"]] if "quest" in entry else [])
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    print("stop-after reached", flush=True)
                    return
                print(f"== {phase} {length} {task}: {baselines}", flush=True)
                if kvsieve(eval_args(args, phase, length, task, baselines, folder, left)) != 0:
                    raise SystemExit(f"kvsieve eval failed ({phase} {length} {task})")


def pack(args) -> None:
    for db in sorted(args.out.glob("eval-*/cells.sqlite")):
        if (db.parent / "cells.sqlite-wal").exists():
            raise SystemExit(f"{db}: a write-ahead log is beside it (a run is under way or was killed); open it once")
        with open(db, "rb") as src, gzip.GzipFile(db.with_suffix(".sqlite.gz"), "wb", 9, mtime=0) as dst:
            shutil.copyfileobj(src, dst)
        db.unlink()
        print(f"packed {db}.gz")


# -- summary -----------------------------------------------------------------------------------------


def canonical(spec: str) -> str:
    from kvsieve.eval.runner import canonical_methods

    return canonical_methods([spec])[-1]


def paired(rows: list[dict], task: str, a: str, b: str) -> dict | None:
    from kvsieve.eval.compare import compare_methods

    sub = [r for r in rows if r["task"] == task]
    present = {r["method"] for r in sub}
    if a not in present or b not in present:
        return None
    try:
        return compare_methods(sub, a, b, metrics=METRICS)[0]
    except ValueError:
        return None


def old_pairs(old: Path, phase: str, length: int, task: str) -> dict:
    """The reconstruction's walk − one-hop and walk − oracle at ρ = 0.2 (else 0.1) from the old folders."""
    out: dict = {}
    for folder in sorted(old.glob(f"{OLD_PREFIX[phase]}-{round(length / 1024)}k-*")):
        rows = rows_of(folder)
        # The old folders name the reconstruction "sketchwalk" (it was the default then).
        for rho, walk, hop, oracles in (("0.2", "sketchwalk", "sketchwalk:walk=one-hop",
                                         ("sketchwalk:walk=oracle", "sketchwalk:density=0.2,walk=oracle")),
                                        ("0.1", "sketchwalk:density=0.1", "sketchwalk:density=0.1,walk=one-hop",
                                         ("sketchwalk:density=0.1,walk=oracle",))):
            for key, b in [("one_hop", hop)] + [("oracle", o) for o in oracles]:
                if key in out:
                    continue
                res = paired(rows, task, walk, b)
                if res is not None:
                    out[key] = {"rho": rho, "folder": folder.name, **res}
    return out


def fmt(v: dict | None, metric: str) -> str:
    if not v or v.get(metric) is None:
        return "–"
    m = v[metric]
    d = 1 if metric == "score" else 3
    star = "" if m["lo"] <= 0 <= m["hi"] else " *"
    return f"{m['delta']:+.{d}f} [{m['lo']:+.{d}f}, {m['hi']:+.{d}f}]{star}"


def summary(args) -> None:
    table = []
    for folder in sorted(args.out.glob("eval-*")):
        phase, length = folder.name.split("-")[1], int(folder.name.split("-")[2].removesuffix("k")) * 1024
        rows = rows_of(folder)
        length = rows[0]["length"] if rows else length  # the cells' own length (8k cells are 8,176 tokens)
        matched = json.loads((folder / "matched.json").read_text()) if (folder / "matched.json").exists() else {}
        for task in TASKS:
            if task not in matched:
                continue
            e = matched[task]
            specs = {"walk": WALK, "one_hop": canonical(ONE_HOP), "oracle": canonical(e["oracle"])}
            if "quest" in e:
                specs["quest"] = canonical(e["quest"])
            by = {k: [r for r in rows if r["task"] == task and r["method"] == s] for k, s in specs.items()}
            dense = [r for r in rows if r["task"] == task and r["method"] == "dense"]
            entry = {"phase": phase, "length": length, "task": task, "folder": folder.name, "matched": e,
                     "model": MODEL_LABELS[model_tag(folder)],
                     "dense_score": 100 * statistics.fmean(r["score"] for r in dense) if dense else None,
                     "n": {k: len(v) for k, v in by.items()},
                     "score": {k: 100 * statistics.fmean(r["score"] for r in v) for k, v in by.items() if v},
                     "density": {k: statistics.fmean(r["density"] for r in v) for k, v in by.items() if v},
                     "kl_mean": {k: statistics.fmean(r["kl_mean"] for r in v) for k, v in by.items() if v},
                     "walk_vs": {k: paired(rows, task, specs["walk"], s) for k, s in specs.items() if k != "walk"},
                     "old": old_pairs(args.old, phase, length, task) if not model_tag(folder) else {}}
            table.append(entry)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity.json").write_text(json.dumps(table, indent=1) + "\n")
    (args.out / "fidelity-tables.md").write_text(markdown(table))
    print(markdown(table))


def markdown(table: list[dict]) -> str:
    lines = ["| phase | length | task | n | dense | walk | one-hop | oracle | quest | density walk / oracle / quest | "
             "KL walk / one-hop / oracle / quest | walk − one-hop: score | KL | walk − oracle: score | KL | "
             "walk − quest: score | KL | old walk KL | "
             "old (reconstruction) walk − one-hop: score | KL | old walk − oracle: score | KL |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in table:
        s, d, vs, old = e["score"], e["density"], e["walk_vs"], e["old"]
        sc = {k: f"{s[k]:.1f}" if k in s else "–" for k in ("walk", "one_hop", "oracle", "quest")}
        dens = " / ".join(f"{d[k]:.3f}" if k in d else "–" for k in ("walk", "oracle", "quest"))
        kls = " / ".join(f"{e['kl_mean'][k]:.3f}" if k in e["kl_mean"] else "–"
                         for k in ("walk", "one_hop", "oracle", "quest"))
        old_hop, old_or = old.get("one_hop"), old.get("oracle")
        oh = f" (ρ={old_hop['rho']}, n={old_hop['n']})" if old_hop else ""
        old_kl = f"{old_hop['kl_mean']['a']:.3f} (ρ={old_hop['rho']})" if old_hop and old_hop.get("kl_mean") else "–"
        oo = f" (ρ={old_or['rho']}, n={old_or['n']})" if old_or else ""
        lines.append(
            f"| {PHASES[e['phase']]} ({e['folder'].rsplit('-', 1)[-1]}"
            f"{', ' + e['model'] if e.get('model', MODEL_LABELS['']) != MODEL_LABELS[''] else ''}) | "
            f"{e['length']} | {e['task']} | "
            f"{e['n']['walk']} | "
            f"{e['dense_score']:.1f} | {sc['walk']} | {sc['one_hop']} | {sc['oracle']} | {sc['quest']} | "
            f"{dens} | {kls} | "
            f"{fmt(vs.get('one_hop'), 'score')} | {fmt(vs.get('one_hop'), 'kl_mean')} | "
            f"{fmt(vs.get('oracle'), 'score')} | {fmt(vs.get('oracle'), 'kl_mean')} | "
            f"{fmt(vs.get('quest'), 'score')} | {fmt(vs.get('quest'), 'kl_mean')} | {old_kl} | "
            f"{fmt(old_hop, 'score')}{oh} | {fmt(old_hop, 'kl_mean')} | {fmt(old_or, 'score')}{oo} | "
            f"{fmt(old_or, 'kl_mean')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    a = parse()
    {"run": run, "summary": summary, "pack": pack}[a.command](a)
