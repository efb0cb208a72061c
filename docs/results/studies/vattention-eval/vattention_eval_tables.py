"""The method × density tables of docs/results/vattention-eval-setupB.md, from eval summary.csv files.

    python docs/results/studies/vattention-eval/vattention_eval_tables.py \
        docs/results/vattention-eval-setupB/summary.csv \
        docs/results/vattention-eval-h100/summary.csv

prints the tables (a later file's rows replace an earlier one's at the same task and length), then the
paired comparisons (`kvsieve compare`) of vAttention with each baseline at each level, from the
folders' cells (their cells.sqlite). With `--methods LENGTH` it prints the grid's method list at that length instead
(for `kvsieve eval --methods`).

Each method spec is placed at the density level (~5%, ~10%, ~20%) its parameters were chosen for;
streaming's window is scaled with the context (sink 32 + window ≈ the level's share of the keys).
"""

import csv
import sys
from pathlib import Path

from kvsieve.eval.compare import compare_methods
from kvsieve.eval.store import ResultStore

SW = "sink=32,window=32"
BOUND = ",bound=denominator"  # what these runs used (the default then; the default is now bound=full)


def level(top_k, top_p, v_top_k, base_rate, eps, random, tables):
    """[(label, spec)] of one density level; vAttention's ε = δ = ``eps`` (None: its default)."""
    eps_param = f",epsilon={eps},delta={eps}" if eps else ""
    v_label = f"`top_k={v_top_k}, f_b={base_rate}" + (f", ε=δ={eps}`" if eps else "`, default ε=δ=0.05")
    return [(f"oracle-topk `top_k={top_k}`", f"oracle-topk:{SW},top_k={top_k}"),
            (f"oracle-topp `top_p={top_p}`", f"oracle-topp:{SW},top_p={top_p}"),
            (f"vattention (oracle) {v_label}",
             f"vattention:{SW},top_k={v_top_k},base_rate={base_rate}{eps_param}{BOUND}"),
            ("vattention (quest) same",
             f"vattention:{SW},top_k={v_top_k},predictor=quest,base_rate={base_rate}{eps_param}{BOUND}"),
            (f"quest `top_k={top_k}`", f"quest:{SW},top_k={top_k}"),
            (f"random `budget={random}`", f"random:{SW},budget={random}"),
            (f"magicpig `K=8, L={tables}`", f"magicpig:budget=0,{SW},tables={tables}")]


LEVELS = {
    #          top-k  top-p  vAttention top-k, f_b, ε=δ  random  MagicPIG tables
    "~5%": level(0.02, 0.8, 0.02, 0.01, 0.2, 0.02, 16),
    "~10%": level(0.07, 0.95, 0.05, 0.02, 0.1, 0.07, 48),
    "~20%": level(0.17, 0.99, 0.15, 0.02, None, 0.17, 110),
}
MIN_PROMPTS = 20  # smaller (task, length) groups (the first 5-prompt runs) are left out
STREAMING_WINDOW = {2048: (70, 172, 378), 4096: (172, 378, 786), 8176: (378, 786, 1603)}


def fmt(x, digits):
    return "–" if x in ("", None) else f"{float(x):.{digits}f}"


def main(paths):
    rows = {}
    for path in paths:
        with open(path) as f:
            for r in csv.DictReader(f):
                rows[(r["task"], int(r["length"]), r["method"])] = r
    for task, length in sorted({k[:2] for k in rows}, key=lambda k: (k[0] != "niah_single_2", k)):
        dense = rows.get((task, length, "dense"))
        if dense is None or int(dense["n"]) < MIN_PROMPTS:
            continue
        print(f"\n### {task}, {length} tokens (dense {fmt(dense['score'], 0)}% [{fmt(dense['score_lo'], 0)}, "
              f"{fmt(dense['score_hi'], 0)}], n = {dense['n']})\n")
        print("| level | method | n | score [95% CI] | Δ vs dense [95% CI] | density | kv density | rel. error | "
              "KL (nats) | top-1 |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for i, (level, methods) in enumerate(LEVELS.items()):
            window = STREAMING_WINDOW[length][i]
            methods = methods + [(f"streaming `window={window}`", f"streaming:sink=32,window={window}")]
            for label, spec in methods:
                r = rows.get((task, length, spec))
                if r is None:
                    continue
                print(f"| {level} | {label} | {r['n']} | {fmt(r['score'], 0)} [{fmt(r['score_lo'], 0)}, "
                      f"{fmt(r['score_hi'], 0)}] | {float(r['delta']):+.0f} [{float(r['delta_lo']):+.0f}, "
                      f"{float(r['delta_hi']):+.0f}] | {fmt(r['density'], 3)} | {fmt(r['kv_density'], 3)} | "
                      f"{fmt(r['rel_error'], 3)} | {fmt(r['kl_mean'], 4)} | {fmt(r['top1_agree'], 3)} |")


PAIRS = [  # (A label, A index in the level, B label, B index)
    ("vAtt(oracle)", 2, "oracle-topk", 0), ("vAtt(oracle)", 2, "oracle-topp", 1),
    ("vAtt(quest)", 3, "quest", 4), ("vAtt(oracle)", 2, "random", 5), ("vAtt(oracle)", 2, "magicpig", 6),
]


def ci(v, digits):
    star = "" if v["lo"] <= 0 <= v["hi"] else "*"
    return f"{v['delta']:+.{digits}f} [{v['lo']:+.{digits}f}, {v['hi']:+.{digits}f}]{star}"


def paired(paths):
    by_length = {}
    for path in paths:
        rows = ResultStore.open_existing(Path(path).parent).rows()
        for key in {(r["task"], r["length"]) for r in rows}:
            group = [r for r in rows if (r["task"], r["length"]) == key]
            if sum(r["method"] == "dense" for r in group) >= MIN_PROMPTS:
                by_length[key] = group
    print("\n### Paired differences A − B on the same prompts (95% bootstrap CI; * excludes 0)\n")
    print("| task | length | level | A − B | n | Δ score | Δ KL (nats) | density A / B | kv density A / B |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task, length in sorted(by_length, key=lambda k: (k[0] != "niah_single_2", k)):
        rows = by_length[(task, length)]
        for level, methods in LEVELS.items():
            for a_label, ia, b_label, ib in PAIRS:
                try:
                    (res,) = compare_methods(rows, methods[ia][1], methods[ib][1],
                                             metrics=("score", "kl_mean", "density", "kv_density"))
                except ValueError:
                    continue
                d, kv = res["density"], res["kv_density"]
                print(f"| {task} | {length} | {level} | {a_label} − {b_label} | {res['n']} | {ci(res['score'], 0)} | "
                      f"{ci(res['kl_mean'], 4)} | {d['a']:.3f} / {d['b']:.3f} | {kv['a']:.3f} / {kv['b']:.3f} |")


def grid_methods(length):
    """The ';'-separated method list of the grid at one length (dense, the levels, streaming scaled)."""
    specs = ["dense"] + [spec for methods in LEVELS.values() for _, spec in methods]
    specs += [f"streaming:sink=32,window={w}" for w in STREAMING_WINDOW[length]]
    return ";".join(specs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--methods"]:
        print(grid_methods(int(sys.argv[2])))
    else:
        main(sys.argv[1:])
        paired(sys.argv[1:])
