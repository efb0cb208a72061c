"""S²ANTA-prop per layer, one sweep that decides its K stream's launch shape and form (GPU), or ``--check`` (CPU).

Times, graph µs with a cold L2 (``bench.timing.ColdL2Timer``), Llama 32/8/128 bf16, at 128k batch 1 and 32k batch
8 (the end-to-end bench's two points), on the bench's peaked attention (``--attention peaked``, what the
end-to-end table measures) and flat attention:

- ``ref:*``: FlashInfer (if importable), our dense kernel, a pure K read (``probe_k_stream.read_call``: the
  byte floor of any method that reads all of K) — each with its bytes/s;
- ``stats:*``: the two-pass stats kernel alone (K scores, per-tile max and sum, the float32 stash) over a grid of
  (keys per sub-block, programs, warps, stages), the dense kernel's shape among them: the K stream's bytes/s;
- ``tail:two-pass``: the budget and sampling launches alone (after one stats call): what follows the stream;
- ``prop:*``: the whole santa-prop call, the default (``decode.santa_prop_triton``) and each form (v10
  ``overlap``, v8 ``two-pass``, v8 with the merge launch ``split``) over its launch parameters.

- ``method:*``: santa-prop and Bernoulli + santa-prop through ``m.decode`` as the runtime calls them (state,
  device step counter, no per-step stats): the kernels plus what the method adds;
- ``bern:*``: Bernoulli qKᵀ (mean-group, B = 4) + santa-prop (``kernels/bernoulli/decode.py``) with every unit
  on the feature-major copy (``fm``), every unit on whole cache rows (``rows``, the row stats launch at its
  default shape and at the dense kernel's), and the default rule (``ROW_LAYOUT_ABOVE``), with the fraction of
  K features its draws kept (``kept``): the bench's peaked queries keep few, Gaussian ones nearly all. From the
  fm and rows times at the two kept fractions the md estimates the kept fraction where the rows launch starts
  to win (the rule's bound).

Every ``prop:*`` and ``bern:*`` variant is checked against the float64 reference fed the kernels' uniforms (tile
budgets and counts equal up to rare float32 floor flips, output error; Bernoulli: the same features kept), and the
fastest correct santa-prop call per case is named in ``best``. Writes ``tune_prop_stream.json`` and ``.md`` under
``--out`` after each case; variants left when ``--time-limit`` seconds have passed are recorded as skipped.
``--check`` runs a reduced sweep on tiny CPU inputs under the Triton interpreter (correctness only, no timing).
``--quick`` runs only the default against the former one (v10 at its launch shape), the v8 forms (merge folded
or launched), the method call, the stats kernels at the wide launch, the tail and the byte floor (``QUICK``), and
records per case the default's time over the former default's (``versus_former``).

    python benchmarks/santa_kernels/tune_prop_stream.py --out $OUT          # GPU, well under 3 min
    python benchmarks/santa_kernels/tune_prop_stream.py --quick --out $OUT  # GPU, under 2 min
    python benchmarks/santa_kernels/tune_prop_stream.py --check --out /tmp/x  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--check" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from kvsieve.bench.decode import Case, Inputs  # noqa: E402
from kvsieve.core.rng import RandomKey  # noqa: E402
from kvsieve.kernels.bernoulli.decode import (  # noqa: E402
    ROW_LAYOUT_ABOVE,
    bernoulli_prop_reference,
    bernoulli_prop_triton,
)
from kvsieve.kernels.bernoulli.feature_major import FeatureMajorKeys  # noqa: E402
from kvsieve.kernels.santa import overlap, two_pass  # noqa: E402
from kvsieve.kernels.santa.common import begin_call  # noqa: E402
from kvsieve.kernels.santa.decode import prop_path, santa_prop_triton  # noqa: E402
from kvsieve.kernels.santa.reference import auto_tile_size, santa_prop_reference  # noqa: E402
from kvsieve.kernels.santa.split_merge import santa_prop_split  # noqa: E402
from kvsieve.kernels.shared import triton_utils  # noqa: E402

BUDGET = 128
SEED = 11
DRAWS = 4

# (label, n keys, batch): the end-to-end bench's two points
GPU_CASES = (("128k-b1", 131072, 1), ("32k-b8", 32768, 8))
CHECK_CASES = (("tiny-b1", 1024, 1), ("tiny-b2", 512, 2))

# stats kernel alone: (block_n, programs, warps, stages); (128, 264, 8, 2) is the dense kernel's shape at 128k
STATS_GRID = ((64, 264, 4, 3), (128, 264, 8, 2), (128, 264, 4, 2), (128, 528, 4, 2), (128, 528, 8, 2),
              (128, 1056, 4, 2), (256, 264, 8, 2))
# whole call: (form, block_n, programs, warps, stages, rounding); systematic rounding (a cumulative sum, no sort
# of the tile fractions) shows what the largest-remainder sort costs on the call's critical path
LR, SYS = "largest-remainder", "systematic"
PROP_GRID = (("overlap", 128, 528, 4, 2, LR), ("overlap", 128, 264, 8, 2, LR), ("overlap", 128, 1056, 4, 2, LR),
             ("overlap", 128, 528, 8, 2, LR), ("overlap", 64, 528, 4, 3, LR),
             ("two-pass", 64, 264, 4, 3, LR), ("two-pass", 128, 264, 8, 2, LR), ("two-pass", 128, 528, 4, 2, LR),
             ("two-pass", 256, 264, 8, 2, LR),
             ("overlap", 128, 528, 4, 2, SYS), ("two-pass", 128, 264, 8, 2, SYS),
             ("split", 128, 528, 4, 2, LR), ("split", 128, 528, 4, 2, SYS))
# the tile size (a method parameter, ``tile_size``; the kernels' rule gives 256 at these lengths): fewer tiles make
# a shorter budget sort and fewer sampling programs; (form, tile, block_n, programs, warps, stages)
TILE_GRID = (("overlap", 512, 128, 528, 4, 2), ("overlap", 1024, 128, 528, 4, 2), ("two-pass", 1024, 128, 264, 8, 2))
CHECK_TILE_GRID = (("overlap", 128, 16, 3, 4, 2),)
# the ordered (v10) stats kernel alone: (block_n, programs, warps, stages)
ORDERED_GRID = ((128, 528, 4, 2), (128, 264, 8, 2), (128, 1056, 4, 2))
CHECK_STATS_GRID = ((16, 3, 4, 2), (32, 5, 4, 2))
CHECK_PROP_GRID = (("overlap", 16, 3, 4, 2, LR), ("overlap", 32, 7, 8, 2, LR), ("two-pass", 16, 3, 4, 3, LR),
                   ("two-pass", 32, 5, 8, 2, SYS), ("split", 16, 3, 4, 2, LR))
CHECK_ORDERED_GRID = ((16, 3, 4, 2),)
# Bernoulli: (label, row_above, row launch (block_n, programs, warps, stages))
BERN_GRID = (("fm", 1.0, (64, 264, 4, 3)), ("rows", 0.0, (64, 264, 4, 3)), ("rows-b128-w8-s2", 0.0, (128, 264, 8, 2)),
             ("rows-b128-p528-w4-s2", 0.0, (128, 528, 4, 2)), (f"default({ROW_LAYOUT_ABOVE})", ROW_LAYOUT_ABOVE,
                                                                (64, 264, 4, 3)))
# --quick: the variants kept (name prefixes); under --check the prop calls only
FORMER_DEFAULT = "prop:overlap-b128-p528-w4-s2"
QUICK = ("prop:default", FORMER_DEFAULT, "prop:two-pass-b128-p528-w4-s2", "prop:split-b128-p528-w4-s2",
         "prop:two-pass-b64-p264-w4-s3", "method:santa-prop", "ref:dense", "ref:k-read-p528",
         "stats:b128-p528-w4-s2", "stats:ordered-b128-p528-w4-s2", "tail:two-pass")
CHECK_BERN_GRID = (("fm", 1.0, (16, 3, 4, 3)), ("rows", 0.0, (16, 3, 4, 3)), ("rows-b32-w8", 0.0, (32, 5, 8, 2)))


def _prop_call(x: Inputs, tile: int, form: str, block_n: int, programs: int, warps: int, stages: int,
               rounding: str, write_counts: bool = False):
    run = {"overlap": overlap.santa_prop_overlap, "two-pass": two_pass.santa_prop_two_pass,
           "split": santa_prop_split}[form]
    return lambda: run(x.q, x.k, x.v, x.lens, x.scale, BUDGET, tile, SEED, rounding=rounding,
                       write_counts=write_counts, block_n=block_n, stats_programs=programs, stats_warps=warps,
                       stats_stages=stages)


def _default_call(x: Inputs, tile: int, write_counts: bool = False):
    return lambda: santa_prop_triton(x.q, x.k, x.v, x.lens, x.scale, BUDGET, tile, SEED, write_counts=write_counts)


def _stats_call(x: Inputs, tile: int, block_n: int, programs: int, warps: int, stages: int):
    _, pdl, buf = begin_call(x.q, x.k, x.v, tile, flash=False, rounding="largest-remainder", write_counts=False,
                             out=None)
    return lambda: two_pass.stats_pass(x.q, x.k, x.lens, buf, x.scale, tile, flash=False, pdl=pdl,
                                        block_n=block_n, stats_programs=programs, num_warps=warps,
                                        num_stages=stages)


def _ordered_stats_call(x: Inputs, tile: int, block_n: int, programs: int, warps: int, stages: int):
    """The ordered stats launch alone, on a sync buffer of its own (it leaves its tile counters raised)."""
    units = x.k.shape[0] * x.k.shape[1]
    _, pdl, buf = begin_call(x.q, x.k, x.v, tile, flash=False, rounding="largest-remainder", write_counts=False,
                             out=None)
    sync = torch.zeros(units * 32 * warps, device=x.q.device, dtype=torch.int32)
    return lambda: overlap.ordered_stats_pass(x.q, x.k, x.lens, buf, sync, x.scale, tile, flash=False, pdl=pdl,
                                              block_n=block_n, stats_programs=programs, stats_warps=warps,
                                              stats_stages=stages)


def _tail_call(x: Inputs, tile: int):
    """The budget and sampling launches alone, over the buffers one stats call filled."""
    b, hq, _ = x.q.shape
    t, pdl, buf = begin_call(x.q, x.k, x.v, tile, flash=False, rounding="largest-remainder", write_counts=False,
                             out=None)
    two_pass.stats_pass(x.q, x.k, x.lens, buf, x.scale, tile, flash=False, pdl=pdl, block_n=64,
                         stats_programs=264)
    return lambda: two_pass.prop_sampling_passes(x.v, x.lens, buf, BUDGET, tile, SEED, b, hq, t,
                                                 rounding="largest-remainder", write_counts=False, pdl=pdl)


def _reference(x: Inputs, tile: int, rounding: str):
    b, hq, _ = x.q.shape
    hkv, n = x.k.shape[1], x.k.shape[2]
    g = hq // hkv
    qg = x.q.double().view(b, hkv, g, -1)
    scores = torch.matmul(qg, x.k.double().transpose(-1, -2)).reshape(b, hq, n) * x.scale
    t = -(-n // tile)
    return santa_prop_reference(scores, x.v, BUDGET, tile, rounding=rounding,
                                budget_offset=triton_utils.budget_uniforms(SEED, b, hq, x.lens, x.q.device),
                                tile_offsets=triton_utils.tile_uniforms(SEED, b, hq, t, x.lens, x.q.device))


def _check(fn, ref) -> dict:
    """Tile budgets and counts against the reference's, and the output's relative error."""
    out, counts, budgets = fn()
    flips = (counts.long() != ref.counts).sum().item()
    budget_flips = (budgets.long() != ref.tile_budgets).sum().item()
    err = ((out.double() - ref.out.double()).norm() / ref.out.double().norm()).item()
    # float32 scores on the device against float64 ones: a rare floor or tie may move one sample
    ok = budget_flips <= 2 and flips <= max(2, counts.numel() // 10000) and err < 3e-2
    return {"budget_flips": budget_flips, "count_flips": flips, "out_rel_err": round(err, 5), "ok": bool(ok)}


def _bern_setup(x: Inputs, check_mode: bool):
    """The feature-major copy of K (as the method keeps it) and the launch options of the stats kernels."""
    kt = FeatureMajorKeys().update(x.k, x.lens)
    opts = {"block_n": 16, "stats_programs": 3} if check_mode else {}
    return kt, opts


def _bern_call(x: Inputs, kt, tile: int, row_above: float, row_launch, opts: dict, write_counts: bool = False):
    key = RandomKey(SEED)
    return lambda: bernoulli_prop_triton(x.q, kt, x.v, x.lens, x.scale, DRAWS, BUDGET, tile, key, SEED,
                                         write_counts=write_counts, k=x.k, row_above=row_above,
                                         row_launch=row_launch, **opts)


def _bern_check(fn, ref, read) -> dict:
    out, counts, budgets, n_feat = fn()
    checked = _check(lambda: (out, counts, budgets), ref)
    same_features = torch.equal(n_feat.long().cpu(), read.sum(-1).cpu())
    checked.update(kept=round(read.double().mean().item(), 4), features_equal=same_features,
                   ok=checked["ok"] and same_features)
    return checked


METHOD_SPECS = {"method:santa-prop": "santa-prop:budget=128",
                "method:bernoulli+santa-prop": "bernoulli-qk:query=mean-group,values=santa-prop,budget=128"}


def _method_call(x: Inputs, spec: str):
    """``m.decode`` as the runtime's captured step calls it: a state kept across calls, the driver's host key
    (request, layer) — the rows' positions, read from device memory, make each step's draws — no per-step stats
    (``count_reads=False``), the lengths' lower bound known on the host. (A key with a device counter, as
    ``breakdown/stages.py`` uses, costs Bernoulli's path about 60 small torch launches of row words per call.)"""
    import kvsieve
    from kvsieve.core.context import CallContext

    m = kvsieve.method(spec)
    state = m.new_state()
    key = RandomKey(SEED, (0, 0))
    ctx = CallContext(count_reads=False, min_length=int(x.k.shape[2]))
    return lambda: m.decode(x.q, x.k, x.v, lengths=x.lens, seed=key, state=state, context=ctx, check_finite=False)[0]


def _reference_calls(x: Inputs, flashinfer) -> dict:
    from kvsieve.bench.decode import VARIANTS

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from probe_k_stream import read_call

    calls = {"ref:dense": VARIANTS["dense"].make(x, None, SEED)[0],
             "ref:k-read-p264": read_call(x.k, programs=264),
             "ref:k-read-p528": read_call(x.k, programs=528)}
    if flashinfer is not None and not isinstance(flashinfer, Exception):
        calls["ref:flashinfer"] = VARIANTS["flashinfer"].make(x, None, SEED)[0]
    return calls


def _bytes(name: str, kb: int) -> int:
    """The bytes a variant must read given K's ``kb``: K and V for dense/FlashInfer, K otherwise (the sampled V
    rows are few), none for the tail."""
    if name in ("ref:dense", "ref:flashinfer"):
        return 2 * kb
    return 0 if name.startswith(("tail:", "bern:", "method:bern")) else kb


def run_case(label: str, n: int, batch: int, attention: str, timer, flashinfer, *, check_mode: bool,
             deadline: float, log=print, quick: bool = False) -> list[dict]:
    device = "cpu" if check_mode else "cuda"
    dtype = torch.float16 if check_mode else torch.bfloat16  # the interpreter's dot mishandles bf16
    heads, kv_heads, d = (8, 2, 64) if check_mode else (32, 8, 128)
    x = Inputs(Case("llama-3.1-8b", heads, kv_heads, d, n, batch), dtype, SEED, device=device, attention=attention)
    tile = 64 if check_mode else auto_tile_size(n)
    refs = {r: _reference(x, tile, r) for r in (LR, SYS)}
    if not quick:
        kt, bern_opts = _bern_setup(x, check_mode)
        bern_ref, bern_read = bernoulli_prop_reference(x.q, x.k, x.v, x.lens, x.scale, DRAWS, BUDGET, tile,
                                                       RandomKey(SEED), SEED)
    k_bytes = x.k.numel() * x.k.element_size()
    grids = ((CHECK_STATS_GRID, CHECK_PROP_GRID, CHECK_ORDERED_GRID, CHECK_BERN_GRID) if check_mode
             else (STATS_GRID, PROP_GRID, ORDERED_GRID, BERN_GRID))
    stats_grid, prop_grid, ordered_grid, bern_grid = grids
    # (name, call, check or None), the most telling first: what is left at the deadline is recorded as skipped
    jobs = [(f"prop:default({prop_path(x.k, tile)})", _default_call(x, tile),
             lambda: _check(_default_call(x, tile, write_counts=True), refs[LR]))]
    refs_calls = _reference_calls(x, flashinfer) if not check_mode and attention == "peaked" else {}
    jobs += [(name, fn, None) for name, fn in refs_calls.items() if name != "ref:flashinfer"]
    for tag, row_above, row_launch in () if quick else bern_grid:
        jobs.append((f"bern:{tag}", _bern_call(x, kt, tile, row_above, row_launch, bern_opts),
                     lambda ra=row_above, rl=row_launch: _bern_check(
                         _bern_call(x, kt, tile, ra, rl, bern_opts, write_counts=True), bern_ref, bern_read)))
    if not check_mode:
        jobs += [(name, _method_call(x, spec), None) for name, spec in METHOD_SPECS.items()]
    for form, bn, p, w, st, rounding in prop_grid:
        jobs.append((f"prop:{form}-b{bn}-p{p}-w{w}-s{st}" + ("-systematic" if rounding == SYS else ""),
                     _prop_call(x, tile, form, bn, p, w, st, rounding),
                     lambda a=(form, bn, p, w, st, rounding): _check(_prop_call(x, tile, *a, write_counts=True),
                                                                     refs[a[-1]])))
    for form, tl_, bn, p, w, st in (CHECK_TILE_GRID if check_mode else TILE_GRID):
        jobs.append((f"prop:{form}-tile{tl_}-b{bn}-p{p}-w{w}-s{st}", _prop_call(x, tl_, form, bn, p, w, st, LR),
                     lambda a=(tl_, form, bn, p, w, st): _check(_prop_call(x, *a, LR, write_counts=True),
                                                                _reference(x, a[0], LR))))
    if attention == "peaked" or check_mode:  # the stream alone does not depend on the attention
        jobs += [(f"stats:b{bn}-p{p}-w{w}-s{st}", _stats_call(x, tile, bn, p, w, st), None)
                 for bn, p, w, st in stats_grid]
        jobs += [(f"stats:ordered-b{bn}-p{p}-w{w}-s{st}", _ordered_stats_call(x, tile, bn, p, w, st), None)
                 for bn, p, w, st in ordered_grid]
        jobs.append(("tail:two-pass", _tail_call(x, tile), None))
    if "ref:flashinfer" in refs_calls:  # last: it may compile its kernels at first use
        jobs.append(("ref:flashinfer", refs_calls["ref:flashinfer"], None))
    if quick:  # in QUICK's order: the default and the former default first
        keep = ("prop:",) if check_mode else QUICK
        rank = {name: min([i for i, prefix in enumerate(keep) if name.startswith(prefix)], default=-1)
                for name, _, _ in jobs}
        jobs = sorted((job for job in jobs if rank[job[0]] >= 0), key=lambda job: rank[job[0]])
    rows = []
    for name, fn, check in jobs:
        row = {"case": label, "attention": attention, "variant": name}
        if time.time() > deadline:
            row["skipped"] = "time limit"
            rows.append(row)
            continue
        if check is not None:
            try:
                row.update(check())
            except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded, the sweep goes on
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        if timer is not None and row.get("ok", True):
            try:
                r = timer.time_graph_us(fn, warmup=3, iters=20)
                row.update(r)
                nbytes = _bytes(name, k_bytes)
                row["tb_s"] = round(nbytes / r["median_us"] / 1e6, 3) if nbytes else None
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        log(f"{label} {attention} {name}: " + json.dumps({k: v for k, v in row.items()
                                                             if k not in ("case", "attention", "variant")}))
    return rows


def best_rows(rows: list[dict]) -> dict:
    """Per (case, attention): the fastest correct ``prop:*`` variant and the default's time."""
    best = {}
    for row in rows:
        if not row["variant"].startswith("prop:") or not row.get("ok") or "median_us" not in row:
            continue
        key = f"{row['case']}/{row['attention']}"
        if key not in best or row["median_us"] < best[key]["median_us"]:
            best[key] = {"variant": row["variant"], "median_us": row["median_us"]}
    for row in rows:
        key = f"{row['case']}/{row['attention']}"
        if row["variant"].startswith("prop:default") and key in best and "median_us" in row:
            best[key]["default_us"] = row["median_us"]
    return best


def versus_former(rows: list[dict]) -> dict:
    """Per (case, attention): the default's and the former default's (v10 at its launch shape) graph µs and
    their ratio (former / default: above 1 where the default is faster), with both checks."""
    out = {}
    for row in rows:
        key = f"{row['case']}/{row['attention']}"
        if row["variant"].startswith("prop:default"):
            out.setdefault(key, {}).update(default=row["variant"], default_us=row.get("median_us"),
                                           default_ok=row.get("ok"))
        elif row["variant"] == FORMER_DEFAULT:
            out.setdefault(key, {}).update(former_us=row.get("median_us"), former_ok=row.get("ok"))
    for v in out.values():
        if v.get("default_us") and v.get("former_us"):
            v["speedup"] = round(v["former_us"] / v["default_us"], 3)
    return out


def bernoulli_crossover(rows: list[dict]) -> dict:
    """Per case: the kept fraction where the feature-major stats (linear in the fraction, through its two
    measured points) take as long as the best rows launch (the mean of its two points: its bytes do not
    depend on the fraction); None where a point is missing."""
    out = {}
    for case in sorted({r["case"] for r in rows}):
        pts = {}
        for r in rows:
            if r["case"] == case and r["variant"].startswith("bern:") and "median_us" in r and "kept" in r:
                pts.setdefault(r["attention"], {})[r["variant"]] = (r["kept"], r["median_us"])
        try:
            (k1, f1), (k2, f2) = (pts[a]["bern:fm"] for a in ("peaked", "uniform"))
            rows_us = [min(us for name, (_, us) in pts[a].items() if name.startswith("bern:rows"))
                       for a in ("peaked", "uniform")]
        except (KeyError, ValueError):
            out[case] = None
            continue
        r_us = sum(rows_us) / 2
        slope = (f2 - f1) / (k2 - k1) if k2 != k1 else float("nan")
        out[case] = {"fm_us": [f1, f2], "kept": [k1, k2], "rows_us": rows_us,
                     "crossover_kept": round(k1 + (r_us - f1) / slope, 3) if slope and slope == slope else None}
    return out


def write_markdown(report: dict, path: Path) -> None:
    lines = [f"# S²ANTA-prop K stream sweep ({report['device']}, Triton {report['triton']})", "",
             f"Graph µs, cold L2, median of 20; Llama 32/8/128 bf16, S = {BUDGET}. `tb_s`: bytes that must be read "
             "(K and V for dense/FlashInfer, K for the rest) per µs. `ok`: budgets and counts equal to the "
             "float64 reference's up to rare float32 flips, output error < 3e-2. Command: "
             "`python benchmarks/santa_kernels/tune_prop_stream.py --out $OUT`.", "",
             f"Copy rate: {report.get('copy_tb_s')} TB/s (read + written).", "",
             "| case | attention | variant | µs | TB/s | ok | budget flips | count flips | out err | kept |",
             "|---|---|---|---:|---:|---|---|---:|---:|---:|"]
    for r in report["rows"]:
        us = f"{r['median_us']:.1f}" if "median_us" in r else r.get("error", "")
        lines.append(f"| {r['case']} | {r['attention']} | {r['variant']} | {us} | {r.get('tb_s') or ''} | "
                     f"{r.get('ok', '')} | {r.get('budget_flips', '')} | {r.get('count_flips', '')} | "
                     f"{r.get('out_rel_err', '')} | {r.get('kept', '')} |")
    lines += ["", "Fastest correct santa-prop call per case:", ""]
    for key, b in report["best"].items():
        default = b.get("default_us", float("nan"))
        lines.append(f"- {key}: {b['variant']} {b['median_us']:.1f} µs (default {default:.1f})")
    lines += ["", "The default against the former default (v10, `" + FORMER_DEFAULT + "`):", ""]
    for key, v in report.get("versus_former", {}).items():
        lines.append(f"- {key}: {json.dumps(v)}")
    lines += ["", "Bernoulli: kept fraction where whole cache rows start to win (estimate; the rule's bound):", ""]
    for case, c in report.get("bernoulli_crossover", {}).items():
        lines.append(f"- {case}: {json.dumps(c)}")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--check", action="store_true", help="tiny CPU cases under the Triton interpreter, no timing")
    ap.add_argument("--attention", default="peaked,uniform", help="comma list of peaked, uniform")
    ap.add_argument("--quick", action="store_true", help="the default against the former default and a few more")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds; later variants are skipped (default 150, 100 with --quick)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    import triton

    timer, flashinfer, copy = None, None, None
    if not args.check:
        # probe_k_stream's read probe builds a TMA descriptor: Triton allocates its scratch through this
        triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
        from kvsieve.bench.decode import timing_setup

        flashinfer, copy, timer = timing_setup()

    deadline = started + (args.time_limit or (100.0 if args.quick else 150.0))
    rows = []
    report = {}
    cases = [(attention, case) for attention in args.attention.split(",")  # both cases on the first attention
             for case in (CHECK_CASES if args.check else GPU_CASES)]
    for i, (attention, (label, n, batch)) in enumerate(cases):
        # each case gets an equal share of the time left, so that a slow first case leaves the others theirs
        share = time.time() + (deadline - time.time()) / (len(cases) - i)
        rows += run_case(label, n, batch, attention, timer, flashinfer, check_mode=args.check, deadline=share,
                         quick=args.quick)
        if not args.check:  # the case's inputs and references are gone with run_case's frame
            torch.cuda.empty_cache()
        report = {"device": "cpu (interpreter)" if args.check else torch.cuda.get_device_name(),
                  "triton": triton.__version__, "torch": torch.__version__,
                  "copy_tb_s": round(copy / 1e12, 3) if copy else None, "rows": rows, "best": best_rows(rows),
                  "versus_former": versus_former(rows),
                  "bernoulli_crossover": bernoulli_crossover(rows), "seconds": round(time.time() - started, 1)}
        (out / "tune_prop_stream.json").write_text(json.dumps(report, indent=1))
        write_markdown(report, out / "tune_prop_stream.md")
    bad = [r["variant"] for r in rows if r.get("ok") is False]
    print(f"done in {report['seconds']} s; best: {json.dumps(report['best'])}; failed checks: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
