"""MagicPIG's retrieval rules on real attention: attention error and density, old rule vs the authors'.

The captured decode calls of the vAttention fidelity study (the default model, SmolLM2-135M-Instruct,
float32 on the CPU, Paul Graham essay contexts; ``verify_vattention_guarantee.decode_calls``), sink 32 +
window 32 as there. Each (K, L) runs under:

- ``old``: the former default — SimpleLSH (``transform=mips``), a key retrieved on at least 1 table,
  weight ``1/P[≥1]``;
- ``authors``: the default now — keys centred by the mean of the middle keys, at least 2 tables,
  weight ``1/(P[≥2] + 1e-4)`` (MagicPIG's code);
- ``center>=1``, ``mips>=2``: one of the two changes alone.

Error = ``‖ô − o‖/‖o‖`` per (call, query head) against exact attention; density = V rows read / N.

    PYTHONPATH=src python benchmarks/magicpig_rule/fidelity.py --out docs/results/magicpig-rule-fidelity
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import kvsieve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vattention_guarantee"))
from verify_vattention_guarantee import decode_calls, rel_error  # noqa: E402

RULES = {
    "old": "transform=mips,min_tables=1,weight_eps=0",
    "authors": "",
    "center>=1": "min_tables=1",
    "mips>=2": "transform=mips",
}


def specs(sw: str, grid) -> list[tuple[str, int, int, str]]:
    out = []
    for bits, tables in grid:
        for rule, flags in RULES.items():
            extra = f",{flags}" if flags else ""
            out.append((rule, bits, tables, f"magicpig:{sw},bits={bits},tables={tables}{extra}"))
    return out


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    model, tok = kvsieve.load_model("default")
    dense = kvsieve.method("dense")
    grid = [tuple(int(x) for x in g.split("x")) for g in args.grid]
    todo = specs(args.sink_window, grid)
    methods = [kvsieve.method(s) for *_, s in todo]
    rows = []
    t0 = time.time()
    for li, n_tokens in enumerate(args.lengths):
        for step, calls in decode_calls(model, tok, n_tokens, args.layers, args.steps, offset=li * 7):
            for layer, q, k, v in calls:
                ref, _ = dense.decode(q, k, v)
                for si, ((rule, bits, tables, spec), m) in enumerate(zip(todo, methods, strict=True)):
                    est, st = m.decode(q, k, v, seed=kvsieve.core.rng.derive_seed(7, layer, step, li, si))
                    rows.append(dict(rule=rule, bits=bits, tables=tables, spec=spec, length=n_tokens, layer=layer,
                                     step=step, errors=rel_error(est, ref)[0].tolist(), density=st.density,
                                     retrieved=float(st["retrieved"])))
            print(f"{n_tokens} step {step}: {time.time() - t0:.0f}s", flush=True)
    return dict(rows=rows, seconds=time.time() - t0, args=vars(args) | {"argv": sys.argv[1:]})


def table(data: dict) -> str:
    lines = ["| K × L | rule | mean error | median | density | keys retrieved per head |", "|---|---|---|---|---|---|"]
    keys = []
    for r in data["rows"]:
        key = (r["bits"], r["tables"], r["rule"])
        if key not in keys:
            keys.append(key)
    for bits, tables, rule in keys:
        rs = [r for r in data["rows"] if (r["bits"], r["tables"], r["rule"]) == (bits, tables, rule)]
        err = torch.tensor([e for r in rs for e in r["errors"]], dtype=torch.float64)
        dens = sum(r["density"] for r in rs) / len(rs)
        ret = sum(r["retrieved"] for r in rs) / len(rs)
        lines.append(f"| {bits} × {tables} | {rule} | {float(err.mean()):.3f} | {float(err.median()):.3f} | "
                     f"{dens:.3f} | {ret:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/results/magicpig-rule-fidelity")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 14, 20, 26, 29])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--grid", nargs="+", default=["10x150", "8x75", "8x16"], help="K x L settings")
    p.add_argument("--sink-window", default="sink=32,window=32")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    data = run(args)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data))
    print(table(data))


if __name__ == "__main__":
    main()
