"""S²ANTA-prop's K stream: the current path against each ``santa/common.py`` ``StreamHints`` candidate (GPU), timed
and checked against the current path in the same run, or ``--check`` (CPU, the interpreter, no timing).

At each case (``--cases``, KEYS:BATCH; default 131072:1 and 32768:8, the end-to-end bench's two points) on the
bench's peaked inputs (Llama-3.1-8B heads 32/8/128, bf16, tile 256, budget 128), the path the default takes there
(``decode.prop_path``: the v8 stats pass at ``PROP_WIDE_STATS`` with the merge launch at 128k batch 1, v10 at 32k
batch 8) runs with ``stream=None`` (the current path) and with each candidate:

- ``call``: the santa-prop call (the path's function, its launch defaults, programmatic dependent launch where
  the GPU has it), captured in a CUDA graph and replayed with a cold L2 (``ColdL2Timer.time_graph_us``; median µs);
  the current path is timed first and again last (``current (again)``), which shows the drift of the run;
- ``stats``: the stats kernel alone, the same way (v10's on a private counter buffer nobody waits on);
- ``kernels``: the call's per-kernel device µs (``ColdL2Timer.kernel_breakdown``; PDL-launched kernels include
  their waits), unless ``--no-kernels``;
- checks against the current path's call with the same seed (``write_counts=True``): m, l and the score stash
  (bitwise), tile budgets and counts (exact), the output (max abs difference; the sampling adds float32 atomics
  in any order, so the current path against itself, ``repeat``, gives the scale of that difference);
- ``bernoulli: *`` (unless ``--no-bernoulli``): Bernoulli qKᵀ with santa-prop's values (mean-group, 8 draws, as
  the end-to-end bench), whose values take v8's sampling with the folded merge, with the module default
  ``common.STREAM`` and with its ``lazy_stash`` set: call timed, budgets and counts checked against the first.

The byte floor: (K + the float32 stash) at the device's copy rate (``timing.copy_bandwidth``).

Writes ``santa_stream.json`` and ``santa_stream.md`` under ``--out``.

    python benchmarks/breakdown/santa_stream.py --out $OUT [--cases 131072:1,32768:8] [--iters 30]
    python benchmarks/breakdown/santa_stream.py --check
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvsieve.kernels.santa.common import StreamHints  # noqa: E402

TILE = 256
BUDGET = 128
BERNOULLI_DRAWS = 8  # the end-to-end bench's Bernoulli qKᵀ (draws=8, query=mean-group)
SEED = 5
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

KEF = StreamHints(k_eviction="evict_first")
KEF_SEL = KEF._replace(stash_eviction="evict_last")
# candidates of both paths (cache hints of the K loads and the stash stores, the sampling's lazy stash read), in the
# order they run (the likeliest first: ``--time-limit`` skips the rest)
COMMON = {
    "k-evict-first": KEF,
    "k-evict-first+stash-evict-last": KEF_SEL,
    "lazy-stash": StreamHints(lazy_stash=True),
    "k-evict-first+stash-evict-last+lazy-stash": KEF_SEL._replace(lazy_stash=True),
    "stash-cs": StreamHints(stash_cache=".cs"),
}
# and of v10 only (batched releases, balanced rounds), run after the first
OVERLAP_ONLY = {
    "release-2": StreamHints(release_every=2),
    "release-4": StreamHints(release_every=4),
    "balanced": StreamHints(balanced_rounds=True),
    "k-evict-first+release-2+balanced": KEF._replace(release_every=2, balanced_rounds=True),
    "k-evict-first+stash-evict-last+lazy-stash+release-4+balanced": KEF_SEL._replace(
        lazy_stash=True, release_every=4, balanced_rounds=True),
}


def variants(path: str) -> dict[str, StreamHints]:
    """The candidates of ``path`` in the order they run."""
    if path != "overlap":
        return dict(COMMON)
    first, *rest = COMMON.items()
    return dict([first, *list(OVERLAP_ONLY.items())[:3], *rest, *list(OVERLAP_ONLY.items())[3:]])


def path_call(path: str):
    """``(function, launch options)`` of the santa-prop path ``path`` as ``decode.santa_prop_triton`` runs it."""
    from kvsieve.kernels.santa import decode
    from kvsieve.kernels.santa.overlap import santa_prop_overlap
    from kvsieve.kernels.santa.split_merge import santa_prop_split
    from kvsieve.kernels.santa.two_pass import santa_prop_two_pass

    if path == "split":
        return santa_prop_split, dict(decode.PROP_WIDE_STATS)
    return (santa_prop_overlap if path == "overlap" else santa_prop_two_pass), {}


def call_once(path, x, stream, *, write_counts=False, out=None, budget=BUDGET, tile=TILE):
    run, opts = path_call(path)
    return run(x.q, x.k, x.v, x.lens, x.scale, budget, tile, SEED, write_counts=write_counts, out=out,
               stream=stream, **opts)


def stats_call(path, x, stream, tile=TILE):
    """The path's stats kernel alone into the workspace buffers; v10's on a private counter buffer. Compiled as in
    the call (its ``PDL`` only lets a next launch start early; none follows here), so nothing compiles twice."""
    from kvsieve.kernels.santa import overlap
    from kvsieve.kernels.santa.common import begin_call
    from kvsieve.kernels.santa.two_pass import stats_pass

    b, hq, _ = x.q.shape
    _, pdl, buf = begin_call(x.q, x.k, x.v, tile, flash=False, rounding="largest-remainder", write_counts=False,
                             out=None)
    if path == "overlap":
        sync = torch.zeros(b * x.k.shape[1] * 32 * overlap.STATS_WARPS + b * hq, dtype=torch.int32,
                           device=x.q.device)
        return lambda: overlap.ordered_stats_pass(
            x.q, x.k, x.lens, buf, sync, x.scale, tile, flash=False, pdl=pdl, block_n=128,
            stats_programs=overlap.STATS_PROGRAMS, stats_warps=overlap.STATS_WARPS, stats_stages=2, stream=stream)
    _, opts = path_call(path)
    return lambda: stats_pass(x.q, x.k, x.lens, buf, x.scale, tile, flash=False, pdl=pdl,
                              block_n=opts.get("block_n", 64), stats_programs=opts.get("stats_programs", 264),
                              num_warps=opts.get("stats_warps", 4), num_stages=opts.get("stats_stages", 3),
                              stream=stream)


def snapshot(path, x, stream, tile=TILE, budget=BUDGET) -> dict:
    """One checked call: ``{out, counts, budgets, m, l, stash}``, the stats copied out of the workspace (zeroed
    first: v8 leaves the tiles past a row's length unwritten)."""
    from kvsieve.kernels.santa.common import stats_buffers, tile_count

    b, hq, d = x.q.shape
    t = tile_count(x.k.shape[2], tile)
    m, l, stash = stats_buffers(x.q, b, hq, t, tile)
    for buf in (m, l, stash):
        buf.zero_()
    out = torch.full((b, hq, d), float("nan"), dtype=x.q.dtype, device=x.q.device)
    res = call_once(path, x, stream, write_counts=True, out=out, budget=budget, tile=tile)
    return {"out": res[0].clone(), "counts": res[1].clone(), "budgets": res[2].clone(),
            "m": m[:b * hq * t].clone(), "l": l[:b * hq * t].clone(), "stash": stash[:b * hq * t * tile].clone()}


def compare(got: dict, base: dict) -> dict:
    """Exact equality of the stats, budgets and counts; the output's max abs difference."""
    res = {name: bool(torch.equal(got[name], base[name])) for name in ("m", "l", "stash", "budgets", "counts")}
    res["finite"] = bool(torch.isfinite(got["out"]).all())
    res["out_max_abs_diff"] = float((got["out"].float() - base["out"].float()).abs().max())
    res["out_abs_max"] = max(1.0, float(base["out"].float().abs().max()))
    return res


def verdict(check: dict, repeat: dict, names=("m", "l", "stash", "budgets", "counts")) -> bool:
    """Equal to the current path: stats, budgets and counts exact (``names``), output finite and no further from the
    current path than twice the current path from itself, or two 16-bit rounding steps (2^-7 each) of the output's
    scale."""
    exact = all(check[name] for name in names) and check["finite"]
    return exact and check["out_max_abs_diff"] <= max(2 * repeat["out_max_abs_diff"], 2 ** -6 * repeat["out_abs_max"])


def bernoulli_rows(x, timer, args, opts: dict | None = None) -> list[dict]:
    """Bernoulli qKᵀ with santa-prop's values (``kernels/bernoulli/decode.py``: its own stats kernels, then v8's
    budgets and sampling with the folded merge, which take ``common.STREAM``'s ``lazy_stash``), with the module
    default as it is and with ``lazy_stash`` set: each row checked (budgets, counts exact; output) against the
    first and, unless ``timer`` is None, timed as ``run_case`` times the santa-prop calls."""
    from kvsieve.core.rng import RandomKey
    from kvsieve.kernels.bernoulli.decode import bernoulli_prop_triton
    from kvsieve.kernels.bernoulli.feature_major import FeatureMajorKeys
    from kvsieve.kernels.santa import common

    kt = FeatureMajorKeys().update(x.k, x.lens)

    def call(write_counts=False):
        return bernoulli_prop_triton(x.q, kt, x.v, x.lens, x.scale, BERNOULLI_DRAWS, args.budget, args.tile,
                                     RandomKey(SEED), SEED, write_counts=write_counts, k=x.k, **(opts or {}))

    def snap():
        out, counts, budgets, _ = call(True)
        return {"out": out.clone(), "counts": counts.clone(), "budgets": budgets.clone()}

    rows, base, repeat, former = [], None, None, common.STREAM
    for name, hints in (("bernoulli: current", common.STREAM), ("bernoulli: lazy-stash",
                                                                common.STREAM._replace(lazy_stash=True))):
        row = {"variant": name, "hints": hints._asdict()}
        if timer is not None and time.time() > args.deadline:
            rows.append({**row, "error": f"skipped: past this case's share of --time-limit {args.time_limit} s"})
            continue
        t0 = time.time()
        common.STREAM = hints
        try:
            got = snap()
            if base is None:
                base = got
                repeat = compare_some(snap(), base)
            else:
                row["check"] = compare_some(got, base)
                row["equal"] = verdict(row["check"], repeat, names=("budgets", "counts"))
            if timer is not None:
                row["call"] = timer.time_graph_us(call, warmup=5, iters=args.iters)
                if not args.no_kernels:
                    row["kernels"] = timer.kernel_breakdown(call, iters=2)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        finally:
            common.STREAM = former
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "hints")}), flush=True)
    return rows


def compare_some(got: dict, base: dict) -> dict:
    """``compare`` over the entries both have."""
    res = {name: bool(torch.equal(got[name], base[name])) for name in ("budgets", "counts")}
    res["finite"] = bool(torch.isfinite(got["out"]).all())
    res["out_max_abs_diff"] = float((got["out"].float() - base["out"].float()).abs().max())
    res["out_abs_max"] = max(1.0, float(base["out"].float().abs().max()))
    return res


def run_case(n: int, batch: int, args, timer) -> dict:
    from kvsieve.bench.decode import Case, Inputs
    from kvsieve.kernels.santa.decode import prop_path

    x = Inputs(Case("llama-3.1-8b", HEADS, KV_HEADS, HEAD_DIM, n, batch), torch.bfloat16, seed=0,
               attention=args.attention, device="cuda")
    path = prop_path(x.k, TILE)
    k_bytes = x.k.numel() * x.k.element_size()
    stash_bytes = batch * HEADS * -(-n // TILE) * TILE * 4
    case = {"keys": n, "batch": batch, "path": path, "k_mb": k_bytes / 1e6, "stash_mb": stash_bytes / 1e6,
            "floor_us": (k_bytes + stash_bytes) / args.copy_rate * 1e6, "rows": []}
    base = snapshot(path, x, None)
    repeat = compare(snapshot(path, x, None), base)
    case["repeat"] = repeat
    names = ["current", *variants(path), "bernoulli", "current (again)"]
    for name in names:
        if name == "bernoulli":
            if args.bernoulli:
                case["rows"] += bernoulli_rows(x, timer, args)
            continue
        hints = None if name.startswith("current") else variants(path)[name]
        row = {"variant": name, "hints": (hints or StreamHints())._asdict()}
        if time.time() > args.deadline:
            row["error"] = f"skipped: past this case's share of --time-limit {args.time_limit} s"
            case["rows"].append(row)
            continue
        t0 = time.time()
        try:
            if hints is not None:
                row["check"] = compare(snapshot(path, x, hints), base)
                row["equal"] = verdict(row["check"], repeat)
            row["call"] = timer.time_graph_us(lambda h=hints: call_once(path, x, h), warmup=5, iters=args.iters)
            row["stats"] = timer.time_graph_us(stats_call(path, x, hints), warmup=5, iters=args.iters)
            if not args.no_kernels and name != "current (again)":
                row["kernels"] = timer.kernel_breakdown(lambda h=hints: call_once(path, x, h), iters=2)
        except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        row["seconds"] = round(time.time() - t0, 1)
        case["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "hints")}), flush=True)
    return case


def markdown(report: dict) -> str:
    lines = [f"# S²ANTA-prop K stream candidates ({report['device']})", "",
             f"`{report['command']}`", "",
             f"- {report['date']}; Llama-3.1-8B heads {HEADS}/{KV_HEADS}/{HEAD_DIM}, bf16, tile {TILE}, "
             f"budget {BUDGET}, attention {report['attention']}; copy rate {report['copy_rate'] / 1e12:.2f} TB/s",
             "- call / stats: graph-replayed, cold L2, median µs (min–max); Δ against the current path timed first; "
             "`=`: m, l, stash, budgets, counts equal the current path's exactly and the output within its own "
             "repeat difference", ""]
    for case in report["cases"]:
        lines += [f"## {case['keys']:,} keys, batch {case['batch']} (path `{case['path']}`)", "",
                  f"K {case['k_mb']:.0f} MB + stash {case['stash_mb']:.0f} MB: byte floor {case['floor_us']:.1f} µs; "
                  f"current against itself: output max abs diff {case['repeat']['out_max_abs_diff']:.2e}", "",
                  "| variant | call µs | Δ call | stats µs | Δ stats | check | top kernels (µs) |",
                  "|---|---:|---:|---:|---:|---|---|"]
        firsts = {group: next((r for r in case["rows"] if r["variant"] == name and "call" in r), None)
                  for group, name in (("", "current"), ("bernoulli", "bernoulli: current"))}
        for r in case["rows"]:
            if "error" in r:
                lines.append(f"| {r['variant']} | error: {r['error'][:150]} | | | | | |")
                continue
            first = firsts["bernoulli" if r["variant"].startswith("bernoulli") else ""]
            dc = r["call"]["median_us"] - first["call"]["median_us"] if first else float("nan")
            s = r.get("stats")
            ds = s["median_us"] - first["stats"]["median_us"] if s and first and "stats" in first else float("nan")
            check = "current" if "check" not in r else ("=" if r["equal"] else
                                                        "≠ " + ", ".join(k for k, v in r["check"].items()
                                                                         if v is False))
            if "check" in r:
                check += f" (out Δ {r['check']['out_max_abs_diff']:.1e})"
            kern = ""
            if r.get("kernels"):
                top = sorted(r["kernels"].items(), key=lambda kv: -kv[1])[:3]
                kern = ", ".join(f"{k.strip()[:28]} {v:.1f}" for k, v in top)
            c = r["call"]
            stats = f"{s['median_us']:.1f} | {ds:+.1f}" if s else "— | —"
            lines.append(f"| {r['variant']} | {c['median_us']:.1f} ({c['min_us']:.1f}–{c['max_us']:.1f}) | "
                         f"{dc:+.1f} | {stats} | {check} | {kern} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def check() -> None:
    """On the CPU (the interpreter): every candidate of both paths equals the current path on small inputs (the
    bench's checks, no timing), the stats kernels alone run, and the report renders."""
    import types

    from kvsieve.kernels.santa import decode

    g = torch.Generator().manual_seed(0)
    fake = {"median_us": 1.0, "min_us": 1.0, "max_us": 1.0}
    report = {"device": "cpu", "date": "", "command": "--check", "attention": "gaussian", "copy_rate": 1e12,
              "cases": []}
    for path in ("split", "overlap"):
        b, hq, hkv, n, d, tile = 2, 8, 2, 96, 64, 32
        x = types.SimpleNamespace(q=(torch.randn(b, hq, d, generator=g) * 2).half(),
                                  k=torch.randn(b, hkv, n, d, generator=g).half(),
                                  v=torch.randn(b, hkv, n, d, generator=g).half(),
                                  lens=torch.tensor([n, 45], dtype=torch.int32), scale=d ** -0.5)
        old = dict(decode.PROP_WIDE_STATS)
        decode.PROP_WIDE_STATS.update(block_n=16, stats_programs=3)  # small launches for the small inputs
        try:
            base = snapshot(path, x, None, tile=tile, budget=24)
            repeat = compare(snapshot(path, x, None, tile=tile, budget=24), base)
            rows = [{"variant": "current", "call": fake, "stats": fake}]
            for name, hints in variants(path).items():
                res = compare(snapshot(path, x, hints, tile=tile, budget=24), base)
                assert verdict(res, repeat), (path, name, res)
                rows.append({"variant": name, "call": fake, "stats": fake, "check": res, "equal": True})
            stats_call(path, x, variants(path)["k-evict-first"], tile=tile)()
            brows = bernoulli_rows(x, None, types.SimpleNamespace(budget=24, tile=tile),
                                   opts={"block_n": 16, "stats_programs": 3})
            assert all(r.get("equal", True) and "error" not in r for r in brows), brows
            rows += [{**r, "call": fake} for r in brows]
            report["cases"].append({"keys": n, "batch": b, "path": path, "k_mb": 0.0, "stash_mb": 0.0, "floor_us": 0.0,
                                    "repeat": repeat, "rows": rows})
        finally:
            decode.PROP_WIDE_STATS.clear()
            decode.PROP_WIDE_STATS.update(old)
    assert "| k-evict-first |" in markdown(report)
    print("check: ok")


def parse_cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        n, _, b = item.partition(":")
        if not (n.isdigit() and b.isdigit()):
            raise ValueError(f"--cases: {item!r} (expected KEYS:BATCH)")
        out.append((int(n), int(b)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for santa_stream.json and santa_stream.md")
    p.add_argument("--cases", default="131072:1,32768:8", help="KEYS:BATCH list")
    p.add_argument("--attention", default="peaked", choices=("peaked", "uniform"))
    p.add_argument("--iters", type=int, default=30, help="timed graph replays per measurement")
    p.add_argument("--no-kernels", action="store_true", help="skip the per-kernel breakdown (torch profiler)")
    p.add_argument("--no-bernoulli", dest="bernoulli", action="store_false",
                   help="skip Bernoulli qKᵀ + santa-prop (current and lazy-stash) at each case")
    p.add_argument("--time-limit", type=float, default=115.0,
                   help="seconds after which the variants left are recorded as skipped")
    p.add_argument("--check", action="store_true", help="the checks on the CPU (TRITON_INTERPRET=1), no timing")
    args = p.parse_args(argv)
    if args.check:
        check()
        return 0
    if not args.out:
        p.error("--out: give a folder for the results")
    if not torch.cuda.is_available():
        print("santa_stream.py needs a CUDA GPU (use --check on a CPU)", file=sys.stderr)
        return 2
    cases = parse_cases(args.cases)
    args.budget, args.tile = BUDGET, TILE
    from kvsieve.bench.timing import ColdL2Timer, copy_bandwidth

    t0 = time.time()
    args.copy_rate = copy_bandwidth()
    timer = ColdL2Timer()
    report = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "attention": args.attention, "copy_rate": args.copy_rate, "torch": torch.__version__, "cases": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (n, b) in enumerate(cases):
        args.deadline = t0 + args.time_limit * (i + 1) / len(cases)  # each case its share, and what the last left
        report["cases"].append(run_case(n, b, args, timer))
        torch.cuda.empty_cache()
        report["seconds"] = round(time.time() - t0, 1)
        (out / "santa_stream.json").write_text(json.dumps(report, indent=1))
        (out / "santa_stream.md").write_text(markdown(report))
    print(markdown(report))
    print(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
