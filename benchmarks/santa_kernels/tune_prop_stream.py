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
  ``overlap``, v8 ``two-pass``) over its launch parameters.

Every ``prop:*`` variant is checked against the float64 reference fed the kernels' uniforms (tile budgets equal,
counts equal up to rare float32 floor flips, output error), and the fastest correct one per case is named in
``best``. Writes ``tune_prop_stream.json`` and ``.md`` under ``--out``. ``--check`` runs a reduced sweep on tiny
CPU inputs under the Triton interpreter (correctness only, no timing).

    python benchmarks/santa_kernels/tune_prop_stream.py --out $OUT          # GPU, well under 3 min
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
from kvsieve.kernels.santa import overlap, two_pass  # noqa: E402
from kvsieve.kernels.santa.common import begin_call  # noqa: E402
from kvsieve.kernels.santa.decode import prop_path, santa_prop_triton  # noqa: E402
from kvsieve.kernels.santa.reference import auto_tile_size, santa_prop_reference  # noqa: E402
from kvsieve.kernels.shared import triton_utils  # noqa: E402

BUDGET = 128
SEED = 11

# (label, n keys, batch): the end-to-end bench's two points
GPU_CASES = (("128k-b1", 131072, 1), ("32k-b8", 32768, 8))
CHECK_CASES = (("tiny-b1", 1024, 1), ("tiny-b2", 512, 2))

# stats kernel alone: (block_n, programs, warps, stages); (128, 264, 8, 2) is the dense kernel's shape at 128k
STATS_GRID = ((64, 264, 4, 3), (128, 264, 8, 2), (128, 264, 4, 2), (128, 528, 4, 2), (128, 528, 8, 2),
              (64, 528, 4, 3), (128, 1056, 4, 2), (256, 264, 8, 2), (128, 264, 8, 3))
# whole call: (form, block_n, programs, warps, stages)
PROP_GRID = (("overlap", 128, 528, 4, 2), ("overlap", 128, 264, 8, 2), ("overlap", 128, 1056, 4, 2),
             ("overlap", 128, 528, 8, 2), ("overlap", 64, 528, 4, 3), ("overlap", 128, 264, 4, 3),
             ("two-pass", 64, 264, 4, 3), ("two-pass", 128, 264, 8, 2), ("two-pass", 128, 528, 4, 2),
             ("two-pass", 128, 528, 8, 2), ("two-pass", 256, 264, 8, 2))
CHECK_STATS_GRID = ((16, 3, 4, 2), (32, 5, 4, 2))
CHECK_PROP_GRID = (("overlap", 16, 3, 4, 2), ("overlap", 32, 7, 8, 2), ("two-pass", 16, 3, 4, 3),
                   ("two-pass", 32, 5, 8, 2))


def _prop_call(x: Inputs, tile: int, form: str, block_n: int, programs: int, warps: int, stages: int,
               write_counts: bool = False):
    run = overlap.santa_prop_overlap if form == "overlap" else two_pass.santa_prop_two_pass
    return lambda: run(x.q, x.k, x.v, x.lens, x.scale, BUDGET, tile, SEED, write_counts=write_counts,
                       block_n=block_n, stats_programs=programs, stats_warps=warps, stats_stages=stages)


def _default_call(x: Inputs, tile: int, write_counts: bool = False):
    return lambda: santa_prop_triton(x.q, x.k, x.v, x.lens, x.scale, BUDGET, tile, SEED, write_counts=write_counts)


def _stats_call(x: Inputs, tile: int, block_n: int, programs: int, warps: int, stages: int):
    _, pdl, buf = begin_call(x.q, x.k, x.v, tile, flash=False, rounding="largest-remainder", write_counts=False,
                             out=None)
    return lambda: two_pass._stats_pass(x.q, x.k, x.lens, buf, x.scale, tile, flash=False, pdl=pdl,
                                        block_n=block_n, stats_programs=programs, num_warps=warps,
                                        num_stages=stages)


def _tail_call(x: Inputs, tile: int):
    """The budget and sampling launches alone, over the buffers one stats call filled."""
    b, hq, _ = x.q.shape
    t, pdl, buf = begin_call(x.q, x.k, x.v, tile, flash=False, rounding="largest-remainder", write_counts=False,
                             out=None)
    two_pass._stats_pass(x.q, x.k, x.lens, buf, x.scale, tile, flash=False, pdl=pdl, block_n=64,
                         stats_programs=264)
    return lambda: two_pass.prop_sampling_passes(x.v, x.lens, buf, BUDGET, tile, SEED, b, hq, t,
                                                 rounding="largest-remainder", write_counts=False, pdl=pdl)


def _reference(x: Inputs, tile: int):
    b, hq, _ = x.q.shape
    hkv, n = x.k.shape[1], x.k.shape[2]
    g = hq // hkv
    qg = x.q.double().view(b, hkv, g, -1)
    scores = torch.matmul(qg, x.k.double().transpose(-1, -2)).reshape(b, hq, n) * x.scale
    t = -(-n // tile)
    return santa_prop_reference(scores, x.v, BUDGET, tile, rounding="largest-remainder",
                                budget_offset=triton_utils.budget_uniforms(SEED, b, hq, x.lens, x.q.device),
                                tile_offsets=triton_utils.tile_uniforms(SEED, b, hq, t, x.lens, x.q.device))


def _check(fn, ref) -> dict:
    """Tile budgets and counts against the reference's, and the output's relative error."""
    out, counts, budgets = fn()
    flips = (counts.long() != ref.counts).sum().item()
    err = ((out.double() - ref.out.double()).norm() / ref.out.double().norm()).item()
    ok = torch.equal(budgets.long(), ref.tile_budgets) and flips <= max(2, counts.numel() // 10000) and err < 3e-2
    return {"budgets_equal": torch.equal(budgets.long(), ref.tile_budgets), "count_flips": flips,
            "out_rel_err": round(err, 5), "ok": bool(ok)}


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
    return 0 if name.startswith("tail:") else kb


def run_case(label: str, n: int, batch: int, attention: str, timer, flashinfer, *, check_mode: bool,
             log=print) -> dict:
    device = "cpu" if check_mode else "cuda"
    dtype = torch.float16 if check_mode else torch.bfloat16  # the interpreter's dot mishandles bf16
    shape = "llama-3.1-8b"
    heads, kv_heads, d = (8, 2, 64) if check_mode else (32, 8, 128)
    case = Case(shape, heads, kv_heads, d, n, batch)
    x = Inputs(case, dtype, SEED, device=device, attention=attention)
    tile = 64 if check_mode else auto_tile_size(n)
    ref = _reference(x, tile)
    k_bytes = x.k.numel() * x.k.element_size()
    rows = []

    def record(name, fn, checked=None):
        row = {"case": label, "attention": attention, "variant": name}
        if checked is not None:
            row.update(checked)
        if timer is not None:
            try:
                r = timer.time_graph_us(fn, warmup=3, iters=20)
                row.update(r)
                nbytes = _bytes(name, k_bytes)
                row["tb_s"] = round(nbytes / r["median_us"] / 1e6, 3) if nbytes else None
            except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded, the sweep goes on
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        log(f"{label} {attention} {name}: " + json.dumps({k: v for k, v in row.items()
                                                             if k not in ("case", "attention", "variant")}))

    stats_grid, prop_grid = (CHECK_STATS_GRID, CHECK_PROP_GRID) if check_mode else (STATS_GRID, PROP_GRID)
    record(f"prop:default({prop_path(x.k, tile)})", _default_call(x, tile),
           _check(_default_call(x, tile, write_counts=True), ref))
    for form, bn, p, w, s in prop_grid:
        name = f"prop:{form}-b{bn}-p{p}-w{w}-s{s}"
        try:
            checked = _check(_prop_call(x, tile, form, bn, p, w, s, write_counts=True), ref)
        except Exception as exc:  # noqa: BLE001
            checked = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
        record(name, _prop_call(x, tile, form, bn, p, w, s), checked)
    if attention == "peaked" or check_mode:  # the stream and the references do not depend on the attention
        for bn, p, w, s in stats_grid:
            record(f"stats:b{bn}-p{p}-w{w}-s{s}", _stats_call(x, tile, bn, p, w, s))
        record("tail:two-pass", _tail_call(x, tile))
        if not check_mode:
            for name, fn in _reference_calls(x, flashinfer).items():
                record(name, fn)
    del x, ref
    if not check_mode:
        torch.cuda.empty_cache()
    return {"rows": rows}


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


def write_markdown(report: dict, path: Path) -> None:
    lines = [f"# S²ANTA-prop K stream sweep ({report['device']}, Triton {report['triton']})", "",
             f"Graph µs, cold L2, median of 20; Llama 32/8/128 bf16, S = {BUDGET}. `tb_s`: bytes that must be read "
             "(K and V for dense/FlashInfer, K for the rest) per µs. `ok`: budgets equal to the float64 "
             "reference's, counts up to rare float32 flips, output error < 3e-2. Command: "
             "`python benchmarks/santa_kernels/tune_prop_stream.py --out $OUT`.", "",
             f"Copy rate: {report.get('copy_tb_s')} TB/s (read + written).", "",
             "| case | attention | variant | µs | TB/s | ok | budgets equal | count flips | out err |",
             "|---|---|---|---:|---:|---|---|---:|---:|"]
    for r in report["rows"]:
        us = f"{r['median_us']:.1f}" if "median_us" in r else r.get("error", "")
        lines.append(f"| {r['case']} | {r['attention']} | {r['variant']} | {us} | {r.get('tb_s') or ''} | "
                     f"{r.get('ok', '')} | {r.get('budgets_equal', '')} | {r.get('count_flips', '')} | "
                     f"{r.get('out_rel_err', '')} |")
    lines += ["", "Fastest correct santa-prop call per case:", ""]
    for key, b in report["best"].items():
        default = b.get("default_us", float("nan"))
        lines.append(f"- {key}: {b['variant']} {b['median_us']:.1f} µs (default {default:.1f})")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--check", action="store_true", help="tiny CPU cases under the Triton interpreter, no timing")
    ap.add_argument("--attention", default="peaked,uniform", help="comma list of peaked, uniform")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    timer, flashinfer, copy = None, None, None
    if not args.check:
        import triton

        triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
        from kvsieve.bench.decode import timing_setup

        flashinfer, copy, timer = timing_setup()
    rows = []
    for label, n, batch in (CHECK_CASES if args.check else GPU_CASES):
        for attention in args.attention.split(","):
            rows += run_case(label, n, batch, attention, timer, flashinfer, check_mode=args.check)["rows"]
    import triton

    report = {"device": "cpu (interpreter)" if args.check else torch.cuda.get_device_name(),
              "triton": triton.__version__, "torch": torch.__version__,
              "copy_tb_s": round(copy / 1e12, 3) if copy else None, "rows": rows, "best": best_rows(rows),
              "seconds": round(time.time() - started, 1)}
    (out / "tune_prop_stream.json").write_text(json.dumps(report, indent=1))
    write_markdown(report, out / "tune_prop_stream.md")
    bad = [r["variant"] for r in rows if r.get("ok") is False]
    print(f"done in {report['seconds']} s; best: {json.dumps(report['best'])}; failed checks: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
