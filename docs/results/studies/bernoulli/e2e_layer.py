"""Bernoulli qKᵀ + S²ANTA-prop against santa-prop and dense, per layer, at the end-to-end bench's two points (GPU), or
``--check`` (CPU, Triton interpreter, correctness only).

Llama 32/8/128 bf16 on the bench's peaked attention (``bench.decode.Inputs(attention="peaked")``), 128k batch 1
and 32k batch 8, each call captured in a CUDA graph and replayed with a cold L2 (``ColdL2Timer.time_graph_us``):

- ``dense``: our dense decode kernel (reads K and V);
- ``method:santa-prop`` and ``method:bernoulli``: ``m.decode`` as the runtime's captured step calls it (state
  kept, host key, ``count_reads=False``), Bernoulli at the end-to-end spec (mean-group, draws 8, S = 128);
- ``kernel:bernoulli``: ``bernoulli_prop_triton`` alone at its default launch (the same draws), its output checked in
  the same run against the float64 reference fed the kernels' uniforms (features kept equal, tile budgets and
  counts equal up to rare float32 floor flips, output error); ``kernel:bernoulli-fm-only`` without the cache rows
  (no row stats launch: every unit on the feature-major copy), what that launch costs where no unit needs it;
- ``kernel:bernoulli-P<programs>-s<stages>[-fb<FB>][-n<block>][-w<warps>]``: the same at a sweep of the
  feature-major stats launch's shapes (``decode.py``'s ``stream_stats``: one flat pipelined loop per program),
  each checked against the reference as above (``checks``), beside ``kernel:bernoulli`` at
  :data:`STATS_LAUNCH`;

with each variant's per-kernel device µs (``ColdL2Timer.kernel_breakdown``; PDL-launched kernels include their
wait), the fraction of K's features the draws kept (the K bytes the feature-major stats pass must read), the
fraction of units on the row layout (``row_layout_units``) and of the sampling launch's (row, KV head, tile)
programs that sample anything (``sampled_tiles``: the work of ``_compact_sample``).
Writes ``e2e_layer.json`` and ``.md`` under ``--out``.

    python docs/results/studies/bernoulli/e2e_layer.py --out $OUT            # GPU, about a minute
    python docs/results/studies/bernoulli/e2e_layer.py --check --out /tmp/x  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--check" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))

import kvsieve  # noqa: E402
from kvsieve.bench.decode import VARIANTS, Case, Inputs  # noqa: E402
from kvsieve.core.context import CallContext  # noqa: E402
from kvsieve.core.rng import RandomKey  # noqa: E402
from kvsieve.kernels.bernoulli.decode import (  # noqa: E402
    bernoulli_prop_reference,
    bernoulli_prop_triton,
    row_layout_features,
)
from kvsieve.kernels.bernoulli.feature_major import FeatureMajorKeys  # noqa: E402
from kvsieve.kernels.santa.reference import auto_tile_size  # noqa: E402

BUDGET, DRAWS, SEED = 128, 8, 11
# the stats launch's shapes timed beside its default (STATS_LAUNCH): (programs, stages, features per step,
# keys per sub-block, warps). Registers and shared memory (ptxas for sm_90) give the programs an SM holds: 4 at 256
# keys and 3-5 stages (128 registers; 53 KB at 5 stages), 3 at 6 stages (62 KB), 5 at 128 keys and 8 stages (93
# registers, 44 KB), 3 with 32 features per step (168 registers); 132 SMs times that is one wave.
LAUNCH_SWEEP = ((528, 5, 16, 256, 4), (1056, 5, 16, 256, 4), (2112, 5, 16, 256, 4), (528, 4, 16, 256, 4),
                (528, 3, 16, 256, 4), (1056, 3, 16, 256, 4), (396, 6, 16, 256, 4), (660, 8, 16, 128, 4),
                (1320, 8, 16, 128, 4), (4224, 5, 16, 256, 4))
CHECK_SWEEP = ((3, 3, 16, 16, 4), (1, 3, 32, 32, 4))
SPECS = {"method:santa-prop": f"santa-prop:budget={BUDGET}",
         "method:bernoulli": f"bernoulli-qk:query=mean-group,values=santa-prop,budget={BUDGET},draws={DRAWS}"}
GPU_CASES = (("128k-b1", 131072, 1), ("32k-b8", 32768, 8))
CHECK_CASES = (("tiny-b1", 1024, 1), ("tiny-b2", 512, 2))


def _method_call(x: Inputs, spec: str):
    m = kvsieve.method(spec)
    state = m.new_state()
    key = RandomKey(SEED, (0, 0))
    ctx = CallContext(count_reads=False, min_length=int(x.k.shape[2]))
    return lambda: m.decode(x.q, x.k, x.v, lengths=x.lens, seed=key, state=state, context=ctx, check_finite=False)[0]


def _kernel_call(x: Inputs, kt, tile: int, opts: dict, write_counts: bool = False, rows: bool = True):
    return lambda: bernoulli_prop_triton(x.q, kt, x.v, x.lens, x.scale, DRAWS, BUDGET, tile, RandomKey(SEED), SEED,
                                         write_counts=write_counts, k=x.k if rows else None, **opts)


def _launch_variants(check_mode: bool) -> dict:
    """``{name: bernoulli_prop_triton options}`` of the stats launch's sweep."""
    variants = {}
    for programs, stages, fb, block, warps in CHECK_SWEEP if check_mode else LAUNCH_SWEEP:
        name = f"kernel:bernoulli-P{programs}-s{stages}" + (f"-fb{fb}" if fb != 16 else "") + \
            (f"-n{block}" if block != 256 else "") + (f"-w{warps}" if warps != 4 else "")
        variants[name] = {"stats_programs": programs, "stats_stages": stages, "feature_block": fb, "block_n": block,
                          "stats_warps": warps}
    return variants


def _check(x: Inputs, kt, tile: int, opts: dict, ref=None) -> dict:
    """The kernel's draws, tile budgets, counts and output against the float64 reference (``ref``: its
    ``(sample, read)`` for these inputs, computed when None)."""
    ref, read = ref or bernoulli_prop_reference(x.q, x.k, x.v, x.lens, x.scale, DRAWS, BUDGET, tile, RandomKey(SEED),
                                                SEED)
    out, counts, budgets, n_feat = _kernel_call(x, kt, tile, opts, write_counts=True)()
    count_flips = int((counts.long() != ref.counts).sum())
    budget_flips = int((budgets.long() != ref.tile_budgets).sum())
    err = float((out.double() - ref.out.double()).norm() / ref.out.double().norm())
    same = bool(torch.equal(n_feat.long().cpu(), read.sum(-1).cpu()))
    ok = same and budget_flips <= 2 and count_flips <= max(2, counts.numel() // 10000) and err < 3e-2
    r, hq, t = budgets.shape
    hkv = kt.shape[1]
    # the sampling launch's programs (row, KV head, tile) that sample anything: the work that launch does, and
    # the units whose draws kept more than the row bound (read whole cache rows, not the feature-major copy)
    sampled = (budgets.view(r, hkv, hq // hkv, t) > 0).any(2).double().mean()
    row_units = (n_feat > row_layout_features(x.q.shape[-1])).double().mean()
    return {"sampled_tiles": round(float(sampled), 4), "row_layout_units": round(float(row_units), 4),
            "features_equal": same, "budget_flips": budget_flips, "count_flips": count_flips,
            "out_rel_err": round(err, 5), "ok": ok, "kept": round(float(read.double().mean()), 4)}


def run_case(label: str, n: int, batch: int, check_mode: bool) -> dict:
    device = "cpu" if check_mode else "cuda"
    dtype = torch.float16 if check_mode else torch.bfloat16  # the interpreter's bf16 dot is wrong
    heads, kv_heads, d = (8, 2, 64) if check_mode else (32, 8, 128)
    x = Inputs(Case("llama-3.1-8b", heads, kv_heads, d, n, batch), dtype, SEED, device=device, attention="peaked")
    tile = 64 if check_mode else auto_tile_size(n)
    opts = {"block_n": 16, "stats_programs": 3} if check_mode else {}
    kt = FeatureMajorKeys().update(x.k, x.lens)
    ref = bernoulli_prop_reference(x.q, x.k, x.v, x.lens, x.scale, DRAWS, BUDGET, tile, RandomKey(SEED), SEED)
    sweep = _launch_variants(check_mode)
    result = {"case": label, "n": n, "batch": batch, "tile": tile, "check": _check(x, kt, tile, opts, ref),
              "checks": {name: _check(x, kt, tile, o, ref) for name, o in sweep.items()}, "launch": sweep}
    calls = {"dense": VARIANTS["dense"].make(x, None, SEED)[0],
             **{name: _method_call(x, spec) for name, spec in SPECS.items()},
             "kernel:bernoulli": _kernel_call(x, kt, tile, opts),
             "kernel:bernoulli-fm-only": _kernel_call(x, kt, tile, opts, rows=False),
             **{name: _kernel_call(x, kt, tile, o) for name, o in sweep.items()}}
    rows = {}
    for name, fn in calls.items():
        fn()  # compiles; the method calls also build their state
        if check_mode:
            rows[name] = {"ran": True}
            continue
        from kvsieve.bench.timing import ColdL2Timer

        timer = ColdL2Timer()
        timing = timer.time_graph_us(fn, warmup=5, iters=30)
        kernels = timer.kernel_breakdown(fn) or {}
        rows[name] = {"median_us": round(timing["median_us"], 2), "min_us": round(timing["min_us"], 2),
                      "kernels_us": {k: round(v, 2) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])}}
    if not check_mode:
        base = rows["dense"]["median_us"]
        for row in rows.values():
            row["vs_dense"] = round(base / row["median_us"], 3)
    result["rows"] = rows
    return result


def write_markdown(report: dict, path: Path) -> None:
    lines = ["# Bernoulli qKᵀ + S²ANTA-prop per layer (peaked attention)", "",
             f"device: {report['device']}; command: `{report['command']}`", "",
             "| case | variant | µs | vs dense | kept | check |", "|---|---|---:|---:|---:|---|"]
    for case in report["cases"]:
        for name, row in case["rows"].items():
            bern = "bernoulli" in name
            check = case["checks"].get(name, case["check"])
            lines.append(f"| {case['case']} | {name} | {row.get('median_us', '')} | {row.get('vs_dense', '')} | "
                         f"{check['kept'] if bern else ''} | {check['ok'] if bern else ''} |")
    lines += ["", "Feature-major stats launch, the default (`STATS_LAUNCH`) against the sweep's fastest:", ""]
    for case in report["cases"]:
        check = case["check"]
        lines.append(f"- {case['case']}: features kept {check['kept']}, units on the row layout "
                     f"{check['row_layout_units']}, sampling programs that sample {check['sampled_tiles']}")
        best = _fastest_launch(case)
        if best is not None:
            rows = case["rows"]
            lines.append(f"- {case['case']}: default {rows['kernel:bernoulli']['median_us']} µs, {best} "
                         f"{rows[best]['median_us']} µs (launch {case['launch'][best]})")
    lines += ["", "Per-kernel device µs (profiler, PDL waits included):", ""]
    for case in report["cases"]:
        for name, row in case["rows"].items():
            if row.get("kernels_us"):
                lines.append(f"- {case['case']} {name}: " + ", ".join(f"{k} {v}" for k, v in row["kernels_us"].items()))
    path.write_text("\n".join(lines) + "\n")


def _fastest_launch(case: dict) -> str | None:
    """The fastest swept launch of a timed case whose check passed (None untimed or none passed)."""
    timed = [name for name in case["launch"]
             if "median_us" in case["rows"].get(name, {}) and case["checks"][name]["ok"]]
    return min(timed, key=lambda name: case["rows"][name]["median_us"], default=None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", action="store_true", help="tiny CPU inputs under the Triton interpreter, no timing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu (interpreter)" if args.check else torch.cuda.get_device_name()
    report = {"device": device, "command": " ".join(["python", *sys.argv]), "draws": DRAWS, "budget": BUDGET,
              "cases": []}
    for label, n, batch in CHECK_CASES if args.check else GPU_CASES:
        report["cases"].append(run_case(label, n, batch, args.check))
        (out / "e2e_layer.json").write_text(json.dumps(report, indent=1))
        write_markdown(report, out / "e2e_layer.md")
        print(json.dumps({"case": label, "check": report["cases"][-1]["check"],
                          "us": {k: v.get("median_us") for k, v in report["cases"][-1]["rows"].items()}}), flush=True)
    bad = [f"{c['case']} {name}" for c in report["cases"] for name, check in [("kernel:bernoulli", c["check"]),
                                                                            *c["checks"].items()] if not check["ok"]]
    if bad:
        print("CHECK FAILED:", bad)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
