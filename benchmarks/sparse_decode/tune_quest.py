"""Launch settings of Quest's device selection (``quest_pages.quest_select``), swept on the GPU: the page
bounds launch ran at ~53 % of its byte floor at 128k (15.0 µs for 33.5 MB on an H200), and the select
launches (register select; rows select and its group-sum launch beyond 4096 group-summed pages) were set
by cost models, not measurements.

Cases: 32k and 128k keys at batch 1, 32k at batch 8; quest-kv (group-summed pages) and quest-q (per query
head); Llama-3.1-8B shapes 32/8/128 bf16, page 16, ≈ 5 % density, sink + window 128 — ``run.py``'s
quest rows, built by its helpers and timed as there (CUDA graph, 512 MB L2 flush before each replay,
median). A coordinate sweep: each launch that runs in a case gets its settings varied one launch at a
time around the defaults (``SWEEP``), the others at theirs. Before timing, each setting's selection is
compared with the default settings' (as sets per row); a row that differs must be a near-tie of the
torch reference scores (the group-summed ranking sums float32 in another order under some settings) or
the setting is dropped. Timed per setting: the captured selection (summary update + selection launches)
and the whole call (+ the attention). The default settings are timed at the start and the end of each
case (their mean is the baseline; the drift is reported).

Proposed default per launch: the setting whose selection gain over the default is largest at its worst
case, if that gain is at least ``--min-gain`` (2 %) at every case where the setting applies; else the
default stays. The proposals together are then timed against the defaults at every case.

    PYTHONPATH=src python benchmarks/sparse_decode/tune_quest.py OUT [--iters 40]
    PYTHONPATH=src python benchmarks/sparse_decode/tune_quest.py OUT --quick   # CPU smoke run (interpreter)
    PYTHONPATH=src python benchmarks/sparse_decode/tune_quest.py OUT --split-select [--quick]

``--split-select``: instead of the sweep, the split top-k (``select_split.topk_rows_split``) against the
one-program rows select (``topk_rows_triton``) and the register select, alone on quest-kv-like rows (2 rows
of 8192 pages, 8 of 8192, 64 of 2048), indices checked equal to the old kernel's and the reference's (also on
scores with many ties), and Quest's whole step (quest-kv) on each path at the same shapes (Llama-3.1-70B at
tensor parallel 4, 128k; Llama-3.1-8B at 128k batch 1 and 32k batch 8), pages checked equal to the path before
the split. Writes ``split_select.json`` and ``split_select.md``; exits 1 if a selection differs.

About 3 minutes on an H100 / H200 (an estimate, not yet measured: 113 settings and ~290 graph timings of
~25 ms, most of the time Triton compiling ~70 kernel variants at 1.5–2.5 s). ``--launches`` limits the
sweep to some launches. Writes ``tune_quest.json`` and ``tune_quest.md``. ``--quick``: tiny shapes through
the Triton interpreter on the CPU (wall-clock times, meaningless as timings), the select limits lowered in
one case so that every launch runs; it checks the script, not the kernels (~45 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if __name__ == "__main__" and "--quick" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by run.py's imports)

import torch  # noqa: E402
from run import HEAD_DIM, HEADS, KV_HEADS, QUEST_PAGE, SINK, _select_limits, quest_budget, quest_calls  # noqa: E402

from kvsieve.bench.decode import Case, Inputs, library_version, timing_setup  # noqa: E402
from kvsieve.kernels.quest import quest_pages  # noqa: E402
from kvsieve.kernels.shared import select_triton  # noqa: E402
from kvsieve.kernels.shared.select_split import row_maxima, topk_rows_split  # noqa: E402

LAUNCHES = ("bounds", "group_sum", "rows", "registers", "split")
KERNELS = {"bounds": "_page_bounds_kernel", "group_sum": "_group_sum_parts_kernel", "rows": "_topk_rows_kernel",
           "registers": "_select_regs_kernel", "split": "_split_hist_kernel + _split_select_kernel"}
# Per launch, the settings tried (each alone; the launch's other settings at their defaults). Defaults:
# bounds block_p 64, tiles 1, warps 4, stages 1; group_sum block_x 1024 (4096 from 64k units), chunk 512
# (group 4), warps 4; rows warps 8 (4 below 2048-unit chunks), segment 8192 (so 128k's 8192 pages: one
# program per row); registers warps 8 (4 below 2048 units, 16 above 8192), programs 128.
SWEEP = {
    "bounds": [{"block_p": 32}, {"block_p": 128}, {"num_warps": 2}, {"num_warps": 8}, {"tiles": 2}, {"tiles": 4},
               {"tiles": 8}, {"tiles": 2, "num_stages": 2}, {"tiles": 4, "num_stages": 2},
               {"tiles": 4, "num_stages": 3}, {"tiles": 8, "num_stages": 3}, {"block_p": 128, "num_warps": 8},
               {"block_p": 32, "tiles": 4, "num_stages": 2}],
    "group_sum": [{"block_x": 256, "chunk": 256}, {"block_x": 512}, {"block_x": 2048}, {"block_x": 4096},
                  {"chunk": 128}, {"chunk": 256}, {"chunk": 1024}, {"num_warps": 2}, {"num_warps": 8}],
    "rows": [{"num_warps": 4}, {"num_warps": 16}, {"segment": 512}, {"segment": 1024}, {"segment": 2048},
             {"segment": 4096}, {"segment": 512, "num_warps": 8}, {"segment": 1024, "num_warps": 8}],
    "registers": [{"num_warps": 4}, {"num_warps": 16}, {"programs": 32}, {"programs": 64}, {"programs": 256},
                  {"programs": 512}],
    "split": [{"num_warps": 2}, {"num_warps": 8}, {"programs": 64}, {"programs": 264}, {"programs": 528},
              {"digit_bits": 6}, {"digit_bits": 10}],
}
QUICK_SWEEP = {
    "bounds": [{"block_p": 16, "tiles": 2, "num_stages": 2}, {"block_p": 128, "num_warps": 8}],
    "group_sum": [{"block_x": 16, "chunk": 8}],
    "rows": [{"segment": 8, "num_warps": 2}],
    "registers": [{"programs": 3, "num_warps": 2}],
    "split": [{"programs": 3, "num_warps": 2}],
}


@dataclass
class TuneCase:
    n: int
    batch: int
    limits: tuple[int, ...] | None = None  # select_triton's limits for run.py's _select_limits

    @property
    def name(self) -> str:
        if self.limits is None:
            return f"{self.n // 1024}k b{self.batch}"
        no_split = len(self.limits) > 3 and self.limits[3] == 0
        return f"{self.n // 1024}k b{self.batch} (limits lowered{', no split select' if no_split else ''})"


def applies(launch: str, setting: dict, share: bool) -> bool:
    """Whether ``setting`` can change anything where ``launch`` runs: the register select's programs only
    split group-summed rows."""
    return not (launch == "registers" and not share and set(setting) <= {"programs"})


def config_key(launch: str, setting: dict) -> str:
    return launch + ":" + ",".join(f"{k}={v}" for k, v in setting.items())


def selection_check(got, want, scores) -> dict:
    """The rows (of ``[B, Hs]``) whose page sets differ from ``want``'s, and whether each of them is a
    near-tie: no repeated page, and every page it takes scores (in ``scores``, the torch reference) at
    least ``want``'s worst less a float32 rounding margin."""
    (gi, gc), (wi, wc) = got, want
    if not torch.equal(gc, wc):
        return {"same": False, "ok": False, "why": "counts differ"}
    take = torch.arange(gi.shape[-1], device=gi.device) < gc[..., None]
    gs = torch.where(take, gi, -1).sort(-1).values
    ws = torch.where(take, wi, -1).sort(-1).values
    differ = (gs != ws).any(-1)
    n_diff = int(differ.sum())
    if n_diff == 0:
        return {"same": True, "ok": True, "rows_differ": 0}
    dup = ((gs[..., 1:] == gs[..., :-1]) & (gs[..., 1:] >= 0)).any(-1)
    worst = lambda idx: torch.where(take, scores.gather(-1, idx), float("inf")).amin(-1)  # noqa: E731
    g_min, w_min = worst(gi), worst(wi)
    near = (g_min >= w_min - 1e-3 * (1 + w_min.abs())) & ~dup
    ok = bool(near[differ].all())
    return {"same": False, "ok": ok, "rows_differ": n_diff, "why": None if ok else "not near-ties"}


class WallTimer:
    """``--quick``: ColdL2Timer's interface on the CPU (wall clock, no graph, no flush)."""

    def time_graph_us(self, fn, *, warmup: int = 0, iters: int = 1) -> dict[str, float]:
        times = []
        for _ in range(max(1, iters)):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return {"median_us": statistics.median(times)}


def run_case(case: TuneCase, args, timer, sweep: dict, log, combined: dict | None = None) -> list[dict]:
    """One case's rows: per method the defaults (start), each applicable setting of ``sweep`` for the
    launches that run (checked, then timed), ``combined`` launch options if given, the defaults (end)."""
    dev = "cpu" if args.quick else "cuda"
    heads, kv_heads, d = (8, 2, 64) if args.quick else (HEADS, KV_HEADS, HEAD_DIM)
    x = Inputs(Case("llama-3.1-8b", heads, kv_heads, d, case.n, case.batch),
               torch.float32 if args.quick else torch.bfloat16, seed=0, device=dev)
    sink = window = 16 if args.quick else SINK
    tokens, max_pages = quest_budget(case.n, args.density, sink, window)
    summaries = quest_pages.PageSummaries(QUEST_PAGE)
    summaries.update(x.k, x.lens)  # the prefill's summary; each timed step refreshes the last page
    limits = nullcontext if case.limits is None else partial(_select_limits, *case.limits)
    n_pages = -(-case.n // QUEST_PAGE)
    rows = []

    def calls(share, launch_opts):
        return quest_calls(x, summaries, share, tokens, max_pages, sink=sink, window_qt=window,
                           launch_opts=launch_opts, limits=limits)

    def timed(select, call):
        return {"selection_us": timer.time_graph_us(select, warmup=args.warmup, iters=args.iters)["median_us"],
                "call_us": timer.time_graph_us(call, warmup=args.warmup, iters=args.iters)["median_us"]}

    def checked_and_timed(r, share, launch_opts, want, scores):
        try:
            select, call = calls(share, launch_opts)
            r.update(selection_check(select(), want, scores))
            if r["ok"]:
                r.update(timed(select, call))
        except Exception as exc:  # noqa: BLE001 - a setting that fails to compile or run loses its row only
            r["error"] = f"{type(exc).__name__}: {exc}"[:300]
            if not args.quick:
                torch.cuda.synchronize()
        rows.append(r)
        log(r)

    for method, share in (("quest-kv", True), ("quest-q", False)):
        base = {"n": case.n, "batch": case.batch, "case": case.name, "method": method}
        with limits():
            ran = ("bounds", *select_triton.select_launches(n_pages, heads // kv_heads, share,
                                                             rows=case.batch * (kv_heads if share else heads)))
        select, call = calls(share, None)
        want = tuple(t.clone() for t in select())
        kmin, kmax = summaries.update(x.k, x.lens)
        scores = quest_pages.quest_scores_reference(x.q, kmin, kmax, x.lens, QUEST_PAGE, sink, window, share)
        rows.append({**base, "launch": "default", "round": "start", "launches": list(ran), **timed(select, call)})
        log(rows[-1])
        for launch in ran:
            for setting in sweep.get(launch, []):
                if applies(launch, setting, share):
                    checked_and_timed({**base, "launch": launch, "setting": setting,
                                       "config": config_key(launch, setting)}, share, {launch: setting}, want, scores)
        if combined:
            checked_and_timed({**base, "launch": "combined", "setting": combined}, share, combined, want, scores)
        rows.append({**base, "launch": "default", "round": "end", **timed(select, call)})
        log(rows[-1])
    return rows


def baselines(rows: list[dict]) -> dict:
    """``(n, batch, case, method) -> (selection µs, call µs)``: the mean of the start and end default runs."""
    out = {}
    for r in rows:
        if r["launch"] == "default" and r.get("round") in ("start", "end"):
            key = (r["case"], r["method"])
            out.setdefault(key, []).append((r["selection_us"], r["call_us"]))
    return {key: tuple(statistics.mean(v[i] for v in vals) for i in range(2)) for key, vals in out.items()}


def proposals(rows: list[dict], min_gain: float) -> dict:
    """Per launch: every setting's selection gain per case (default µs / setting µs − 1, over the cases
    where the launch runs and the setting applies), the best per case, and the proposed setting (None:
    keep the defaults)."""
    base = baselines(rows)
    out = {}
    for launch in LAUNCHES:
        mine = [r for r in rows if r["launch"] == launch]
        if not mine:
            continue
        cases = sorted({(r["case"], r["method"]) for r in mine})
        settings = {}
        for r in mine:
            entry = settings.setdefault(r["config"], {"setting": r["setting"], "gains": {}, "call_gains": {},
                                                      "complete": True})
            key = (r["case"], r["method"])
            if "selection_us" not in r:
                entry["complete"] = False
                continue
            entry["gains"][f"{key[0]} {key[1]}"] = base[key][0] / r["selection_us"] - 1
            entry["call_gains"][f"{key[0]} {key[1]}"] = base[key][1] / r["call_us"] - 1
        for entry in settings.values():
            entry["worst_gain"] = min(entry["gains"].values()) if entry["gains"] and entry["complete"] else None
        best_per_case = {}
        for key in cases:
            label = f"{key[0]} {key[1]}"
            timed = [(e["gains"][label], c) for c, e in settings.items() if label in e["gains"]]
            if timed:
                gain, config = max(timed)
                best_per_case[label] = {"config": config, "gain": gain}
        ranked = sorted((e["worst_gain"], c) for c, e in settings.items() if e["worst_gain"] is not None)
        chosen = ranked[-1][1] if ranked and ranked[-1][0] >= min_gain else None
        out[launch] = {"settings": settings, "best_per_case": best_per_case, "proposed": chosen,
                       "proposed_setting": settings[chosen]["setting"] if chosen else None}
    return out


def run_header(kind: str, args, peak, argv) -> dict:
    """What a result file starts with: the run's kind, date, device, versions, command and timing protocol."""
    return {"kind": kind, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "device": "cpu (--quick: Triton interpreter)" if args.quick else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": library_version("triton"), "copy_rate": peak,
            "command": "tune_quest.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "protocol": "wall clock, eager, 1 call" if args.quick else
                        f"CUDA graph replays, 512 MB L2 flush before each, {args.warmup} warm-up + {args.iters} "
                        "timed, median"}


# --- the split select against the one-program rows select (--split-select) --------------------------------
# (name, batch, query heads, KV heads, context): quest-kv's rows are batch × KV heads of context / 16 pages —
# Llama-3.1-70B under tensor parallel 4 (2 rows of 8192 pages), Llama-3.1-8B at 128k batch 1 (8 rows of
# 8192) and at 32k batch 8 (64 rows of 2048)
SPLIT_CASES = [("70B tp4 128k b1", 1, 16, 2, 131072), ("8B 128k b1", 1, 32, 8, 131072), ("8B 32k b8", 8, 32, 8, 32768)]
QUICK_SPLIT_CASES = [("tiny 2 rows", 1, 4, 2, 4096), ("tiny 8 rows", 2, 8, 4, 2048)]
# the top-k alone: (label, function of (scores, counts, k, maxima)); topk_rows_triton is the old kernel
TOPK_VARIANTS = {
    "rows (one program per row)": lambda s, c, k, mx: select_triton.topk_rows_triton(s, c, k, maxima=mx),
    "registers (one program per row)": lambda s, c, k, mx: select_triton.topk_rows_registers(s, c, k),
    "split": lambda s, c, k, mx: topk_rows_split(s, c, k, maxima=mx),
    "split programs=64": lambda s, c, k, mx: topk_rows_split(s, c, k, maxima=mx, programs=64),
    "split programs=264": lambda s, c, k, mx: topk_rows_split(s, c, k, maxima=mx, programs=264),
    "split warps=8": lambda s, c, k, mx: topk_rows_split(s, c, k, maxima=mx, num_warps=8),
    "split digit_bits=6": lambda s, c, k, mx: topk_rows_split(s, c, k, maxima=mx, digit_bits=6),
}
# Quest's whole step (quest-kv): select_triton's limits as run.py's _select_limits takes them (None: as set)
STEP_PATHS = {
    "default before (no split)": (None, None, None, 0),
    "rows select (one program per row)": (None, 0, None, 0),
    "default now": (None, None, None, None),
    "split select": (None, 0, None, 1 << 30),
}


def split_rows_data(b: int, h: int, p: int, dev, seed: int, ties: bool) -> torch.Tensor:
    """Scores ``[b, h, p]`` like Quest's group-summed pages (log-probabilities, all negative); ``ties``: rounded
    to a tenth, so that many pages tie at the threshold."""
    g = torch.Generator(device=dev).manual_seed(seed)
    s = torch.randn(b, h, p, device=dev, generator=g) * 2 - 12
    return (s * 10).round() / 10 if ties else s


def split_select_case(name, b, hq, hkv, n, args, timer, log) -> list[dict]:
    dev = "cpu" if args.quick else "cuda"
    p = -(-n // QUEST_PAGE)
    sink = window = 16 if args.quick else SINK
    tokens, max_pages = quest_budget(n, args.density, sink, window)
    k = min(max_pages, p)
    rows = []
    for ties in (False, True):
        s = split_rows_data(b, hkv, p, dev, 7, ties)
        counts = torch.full((b,), k, device=dev, dtype=torch.long)
        maxima = row_maxima(s).contiguous()
        want = select_triton.topk_rows_reference(s, counts, k)
        old = TOPK_VARIANTS["rows (one program per row)"](s, counts, k, maxima).clone()
        for label, fn in TOPK_VARIANTS.items():
            if "registers" in label and p > select_triton.REGISTER_SELECT_MAX:
                continue
            r = {"part": "topk", "case": name, "rows": b * hkv, "pages": p, "k": k, "ties": ties, "variant": label}
            got = fn(s, counts, k, maxima)
            r["equal_old"] = bool(torch.equal(got, old))
            r["equal_reference"] = bool(torch.equal(got, want))
            if not ties:  # timed on the i.i.d. scores
                r["us"] = timer.time_graph_us(partial(fn, s, counts, k, maxima), warmup=args.warmup,
                                              iters=args.iters)["median_us"]
            rows.append(r)
            log(r)
    x = Inputs(Case(name, hq, hkv, 64 if args.quick else HEAD_DIM, n, b),
               torch.float32 if args.quick else torch.bfloat16, seed=0, device=dev)
    summaries = quest_pages.PageSummaries(QUEST_PAGE)
    summaries.update(x.k, x.lens)
    kmin, kmax = summaries.update(x.k, x.lens)
    scores = quest_pages.quest_scores_reference(x.q, kmin, kmax, x.lens, QUEST_PAGE, sink, window, True)
    want = None
    for label, (g, reg, grouped, split) in STEP_PATHS.items():
        limits = partial(_select_limits, select_triton.ROW_GROUP_SUM_MAX if g is None else g,
                         select_triton.REGISTER_SELECT_MAX if reg is None else reg,
                         select_triton.REGISTER_SELECT_GROUPED_MAX if grouped is None else grouped, split)
        select, call = quest_calls(x, summaries, True, tokens, max_pages, sink=sink, window_qt=window, limits=limits)
        with limits():
            ran = select_triton.select_launches(p, hq // hkv, True, rows=b * hkv)
        got = tuple(t.clone() for t in select())
        want = got if want is None else want
        r = {"part": "step", "case": name, "rows": b * hkv, "pages": p, "k": k, "variant": label,
             "launches": ["update", "bounds", *ran, "attention"], "equal_old": bool(torch.equal(got[0], want[0])),
             **{f"check_{key}": v for key, v in selection_check(got, want, scores).items()}}
        r.update({"selection_us": timer.time_graph_us(select, warmup=args.warmup, iters=args.iters)["median_us"],
                  "call_us": timer.time_graph_us(call, warmup=args.warmup, iters=args.iters)["median_us"]})
        rows.append(r)
        log(r)
    return rows


def split_select_markdown(res: dict) -> str:
    out = [f"# Split top-k vs one program per row on {res['device']} ({res['date']})", "",
           f"- command: `{res['command']}`; torch {res['torch']}, triton {res['triton']}; {res['protocol']}",
           f"- ≈ {res['density']:.0%} of the pages (quest-kv budget); top-k alone on scores like Quest's group-summed "
           "pages (i.i.d.; equality also checked on rounded scores with many ties); step = quest-kv's page summary "
           "update + selection (+ attention for the call)", "",
           "## Top-k alone", "", "| case | rows | pages | k | variant | µs | = old (i.i.d. / ties) | = reference |",
           "|---|---:|---:|---:|---|---:|---|---|"]
    topk = [r for r in res["rows"] if r["part"] == "topk"]
    for r in topk:
        if r["ties"]:
            continue
        tie = next(t for t in topk if t["ties"] and t["case"] == r["case"] and t["variant"] == r["variant"])
        out.append(f"| {r['case']} | {r['rows']} | {r['pages']} | {r['k']} | {r['variant']} | {r['us']:.1f} | "
                   f"{r['equal_old']} / {tie['equal_old']} | {r['equal_reference'] and tie['equal_reference']} |")
    out += ["", "## Quest's step (quest-kv)", "", "| case | rows | path | launches | selection µs | call µs | "
            "pages = first path's |", "|---|---:|---|---|---:|---:|---|"]
    for r in res["rows"]:
        if r["part"] == "step":
            same = "yes" if r["equal_old"] else ("near-ties" if r["check_ok"] else f"NO ({r.get('check_why')})")
            out.append(f"| {r['case']} | {r['rows']} | {r['variant']} | {', '.join(r['launches'])} | "
                       f"{r['selection_us']:.1f} | {r['call_us']:.1f} | {same} |")
    return "\n".join(out) + "\n"


def split_select_main(args, timer, peak, argv) -> int:
    cases = QUICK_SPLIT_CASES if args.quick else SPLIT_CASES
    rows = []
    for case in cases:
        rows += split_select_case(*case, args, timer, lambda r: print(json.dumps(r), flush=True))
        if not args.quick:
            torch.cuda.empty_cache()
    res = {**run_header("split_select", args, peak, argv), "density": args.density, "rows": rows}
    ok = all(r["equal_old"] and r["equal_reference"] for r in rows if r["part"] == "topk") and all(
        r["check_ok"] for r in rows if r["part"] == "step")
    (args.out_dir / "split_select.json").write_text(json.dumps(res, indent=1))
    (args.out_dir / "split_select.md").write_text(split_select_markdown(res))
    print(split_select_markdown(res))
    if not ok:
        print("SELECTIONS DIFFER (see the tables)", file=sys.stderr)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--min-gain", type=float, default=0.02, help="a setting must beat the default by this "
                    "fraction of its selection time at every case it applies to (default 0.02)")
    ap.add_argument("--launches", nargs="+", choices=LAUNCHES, default=list(LAUNCHES), help="launches to sweep")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes through the Triton interpreter")
    ap.add_argument("--split-select", action="store_true", help="instead of the sweep: the split top-k against the "
                    "one-program rows select, alone and in Quest's step (split_select.json / .md)")
    args = ap.parse_args(argv)
    if args.quick:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--quick needs TRITON_INTERPRET=1 before triton is imported (run this file as a script)",
                  file=sys.stderr)
            return 2
        args.warmup, args.iters, args.density = 0, 1, 0.2
        cases = [TuneCase(1024, 1), TuneCase(1024, 1, (8, 0, 0)), TuneCase(1024, 2)]
        sweep, timer, peak = QUICK_SWEEP, WallTimer(), None
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --quick)", file=sys.stderr)
            return 2
        cases = [TuneCase(32768, 1), TuneCase(131072, 1), TuneCase(32768, 8)]
        sweep = SWEEP
        _, peak, timer = timing_setup(flashinfer=False)
    sweep = {launch: sweep[launch] for launch in args.launches}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.split_select:
        return split_select_main(args, timer, peak, argv)
    t_start = time.time()

    def log(r):
        print(json.dumps({k: v for k, v in r.items() if k not in ("n", "batch")}), flush=True)

    rows = []
    for case in cases:
        rows += run_case(case, args, timer, sweep, log)
        if not args.quick:
            torch.cuda.empty_cache()  # the case's inputs (0.5 GB of K/V at 128k) are gone with run_case
    t_sweep = time.time() - t_start
    props = proposals(rows, args.min_gain)
    combined = {launch: p["proposed_setting"] for launch, p in props.items() if p["proposed_setting"]}
    check = []
    if combined:  # the proposals together, against the defaults timed again beside them
        for case in cases:
            check += run_case(case, args, timer, {}, log, combined)
    res = {**run_header("tune_quest", args, peak, argv),
           "density": args.density, "min_gain": args.min_gain, "sweep": sweep,
           "seconds_sweep": t_sweep, "seconds": time.time() - t_start,
           "rows": rows, "proposals": props, "combined": combined, "combined_check": check}
    (args.out_dir / "tune_quest.json").write_text(json.dumps(res, indent=1))
    (args.out_dir / "tune_quest.md").write_text(markdown(res))
    print(markdown(res))
    return 0


def _pct(g):
    return "—" if g is None else f"{100 * g:+.1f} %"


def _vs(r: dict, base: tuple[float, float]) -> str:
    """Table cells: selection µs, its gain, call µs, its gain (dashes for a row that was not timed)."""
    if "selection_us" not in r:
        return "— | — | — | —"
    return (f"{r['selection_us']:.1f} | {_pct(base[0] / r['selection_us'] - 1)} | {r['call_us']:.1f} | "
            f"{_pct(base[1] / r['call_us'] - 1)}")


def markdown(res: dict) -> str:
    rows = res["rows"]
    base = baselines(rows)
    out = [f"# Quest selection launch settings on {res['device']} ({res['date']})", "",
           f"- command: `{res['command']}`; torch {res['torch']}, triton {res['triton']}; {res['protocol']}",
           f"- quest-kv / quest-q, page 16, ≈ {res['density']:.0%} density, sink + window 128; selection = page "
           "summary update + the selection launches; call = selection + attention; gain = default µs / setting µs − 1 "
           "(selection); default = mean of the start and end runs (drift: end / start − 1)",
           f"- sweep {res['seconds_sweep']:.0f} s, total {res['seconds']:.0f} s", "",
           "## Defaults", "", "| case | method | launches | selection µs | call µs | drift (selection) |",
           "|---|---|---|---:|---:|---:|"]
    for (case, method), (sel, call) in base.items():
        start = next(r for r in rows if r["case"] == case and r["method"] == method and r.get("round") == "start")
        end = next(r for r in rows if r["case"] == case and r["method"] == method and r.get("round") == "end")
        out.append(f"| {case} | {method} | {', '.join(start['launches'])} | {sel:.1f} | {call:.1f} | "
                   f"{_pct(end['selection_us'] / start['selection_us'] - 1)} |")
    out += ["", "## Every setting", "", "| launch | setting | case | method | selection µs | gain | call µs | "
            "call gain | selection vs default |", "|---|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["launch"] not in LAUNCHES:
            continue
        b = base[(r["case"], r["method"])]
        setting = ", ".join(f"{k} {v}" for k, v in r["setting"].items())
        why = "near-ties" if r.get("ok") else r.get("why")
        check = r.get("error") or ("same" if r.get("same") else f"{r.get('rows_differ')} rows differ: {why}")
        out.append(f"| {r['launch']} | {setting} | {r['case']} | {r['method']} | {_vs(r, b)} | {check[:80]} |")
    out += ["", "## Best per launch and case", "", "| launch | case | best setting | gain |", "|---|---|---|---:|"]
    for launch, p in res["proposals"].items():
        for label, best in p["best_per_case"].items():
            out.append(f"| {launch} ({KERNELS[launch]}) | {label} | {best['config'].split(':', 1)[1]} | "
                       f"{_pct(best['gain'])} |")
    out += ["", f"## Proposed defaults (≥ {100 * res['min_gain']:.0f} % at every case the setting applies to)", "",
            "| launch | proposed | worst gain | gains per case |", "|---|---|---:|---|"]
    for launch, p in res["proposals"].items():
        if p["proposed"]:
            e = p["settings"][p["proposed"]]
            gains = "; ".join(f"{k} {_pct(v)}" for k, v in e["gains"].items())
            out.append(f"| {launch} | {p['proposed'].split(':', 1)[1]} | {_pct(e['worst_gain'])} | {gains} |")
        else:
            ranked = [(e["worst_gain"], c) for c, e in p["settings"].items() if e["worst_gain"] is not None]
            top = max(ranked) if ranked else None
            note = f"best worst-case: {top[1].split(':', 1)[1]} {_pct(top[0])}" if top else "nothing timed"
            out.append(f"| {launch} | keep the defaults | — | {note} |")
    if res["combined_check"]:
        check = res["combined_check"]
        cbase = baselines(check)
        out += ["", f"## The proposals together: `{json.dumps(res['combined'])}`", "",
                "| case | method | default selection / call µs | selection µs | gain | call µs | call gain | "
                "selection vs default |", "|---|---|---:|---:|---:|---:|---:|---|"]
        for r in check:
            if r["launch"] != "combined":
                continue
            b = cbase[(r["case"], r["method"])]
            check = r.get("error") or ("same" if r.get("same") else r.get("why") or "near-ties")
            out.append(f"| {r['case']} | {r['method']} | {b[0]:.1f} / {b[1]:.1f} | {_vs(r, b)} | {check[:80]} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
