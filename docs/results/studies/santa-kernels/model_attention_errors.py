"""The kernel path against the reference path on attention captured from the default model (SmolLM2-135M,
9/3/64, last token of a 2047-token essay prompt): mean relative error of each over many seeds, and the z
of their difference. Result: ``results/2026-11-22-h100-model-attention-errors.json.gz``
(docs/methods/santa-kernels.md).

    python docs/results/studies/santa-kernels/capture_model_attention.py  # .device_data/smollm_attention.pt
    python docs/results/studies/santa-kernels/model_attention_errors.py --out $OUT  # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import kvsieve
from kvsieve.core.inputs import check_decode_inputs
from kvsieve.methods.shared.exact import exact_attention


def check_model_attention(path: str, seeds: int, device: str) -> list[dict]:
    data = torch.load(path)
    rows = []
    for layer, (q, k, v) in sorted(data.items()):
        q, k, v = (t.to(device) for t in (q, k, v))
        inputs = check_decode_inputs(q.double(), k.double(), v.double())
        exact = exact_attention(inputs)
        for spec in ("santa-prop:budget=128", "santa-prop:budget=128,rounding=systematic",
                     "santa-flash:budget=2048", "santa-flash:budget=256"):
            row = {"layer": int(layer), "method": spec, "seeds": seeds}
            for backend in ("triton", "reference"):
                method = kvsieve.method(f"{spec},backend={backend}")
                errs, outs = [], []
                for sd in range(seeds):
                    out, stats = method.decode(q, k, v, seed=sd)
                    assert stats.backend == backend
                    outs.append(out.double())
                    errs.append(float((out.double() - exact).norm() / exact.norm()))
                errs_t = torch.tensor(errs, dtype=torch.float64)
                mean = torch.stack(outs).mean(0)
                row[f"{backend}_err_mean"] = float(errs_t.mean())
                row[f"{backend}_err_se"] = float(errs_t.std() / math.sqrt(seeds))
                row[f"{backend}_err_of_mean"] = float((mean - exact).norm() / exact.norm())
                row[f"{backend}_density"] = float(stats.density)
            se = math.sqrt(row["triton_err_se"] ** 2 + row["reference_err_se"] ** 2)
            row["z_err_diff"] = (row["triton_err_mean"] - row["reference_err_mean"]) / max(se, 1e-12)
            print("MODEL " + json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".device_data/smollm_attention.pt")
    ap.add_argument("--seeds", type=int, default=64)
    ap.add_argument("--out", required=True, help="folder of model_attention_errors.json")
    args = ap.parse_args()
    rows = check_model_attention(args.data, args.seeds, "cuda")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "model_attention_errors.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
