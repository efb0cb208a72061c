"""Quest's decode layer (page summary update, page selection, sparse attention) on the GPU: the current
device path against the variants that cut its chain of dependent launches, with FlashInfer's dense decode
as the baseline when importable.

Variants (``quest_select``'s ``select`` and ``pdl``; the same pages, up to near-ties):

- ``main``: the bounds launch, then the select launches of ``select_triton`` (at 128k with pages
  group-summed: a group-sum launch and one select program per row), then the attention's split and merge;
- ``chunked``: the bounds launch with softmax partials, then ``select_chunked.topk_rows_chunked`` (several
  programs per row bin the row by its distance below a bound from the partials; the last to finish selects
  within one bin): one select launch;
- ``+pdl``: every launch of the layer after the page update with programmatic dependent launch (each
  program waits on the device for the launch before: the next launch's start overlaps this one's tail);
- ``+fused-update``: the page summaries' update folded into the bounds launch (one launch fewer);
- ``chunked@programs=N``: the chunked select with about N programs in all (default 128).

Cases: Llama-3.1-8B heads 32/8/128, bf16, page 16, 5 % of the context (sink + window 128 each), per KV head
(``share_kv_group``; the end-to-end table's quest) and, at batch 1, per query head: 32k and 128k at batch 1,
32k at batch 8, and 128k batch 1 on the peaked attention of ``kvsieve bench e2e --attention peaked``.
Rows are 5 keys short of the cache, so that each call refreshes the last, partial page as a decode step does.
Timed: the whole layer call and its selection alone (page update + selection), captured in a CUDA graph,
512 MB L2 flush before each replay, median (``kvsieve.bench.timing``); at 128k batch 1 also the device µs
per kernel (torch profiler, eager). Checked per variant: the pages against the torch reference selection
(as sets, up to near-ties) and the output against the reference attention over the reference's pages.

    PYTHONPATH=src python benchmarks/sparse_decode/quest_fused.py --out OUT [--iters 30]
    PYTHONPATH=src python benchmarks/sparse_decode/quest_fused.py --out OUT --check   # CPU, interpreter

About 1–2 minutes on an H100/H200 (mostly Triton compiling). ``--check``: tiny shapes through the Triton
interpreter on the CPU (wall-clock times, meaningless): it checks the script and the selections. Writes
``quest_fused.json`` and ``quest_fused.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "--check" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from run import quest_budget  # noqa: E402
from tune_quest import WallTimer, interpreter_set, selection_check  # noqa: E402

from kvsieve.bench.decode import VARIANTS, Case, Inputs, library_version, timing_setup  # noqa: E402
from kvsieve.kernels.quest import quest_pages  # noqa: E402
from kvsieve.kernels.shared.triton_utils import pdl_available  # noqa: E402
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference, sparse_decode_triton  # noqa: E402

PAGE = 16
# name -> (select, pdl, fused update, launch_opts)
VARIANT_OPTS = {
    "main": ("triton", False, False, None),
    "main+pdl": ("triton", True, False, None),
    "main+fused-update": ("triton", False, True, None),
    "chunked": ("chunked", False, False, None),
    "chunked+pdl": ("chunked", True, False, None),
    "chunked+fused-update": ("chunked", False, True, None),
    "chunked+fused-update+pdl": ("chunked", True, True, None),
    "chunked@programs=64": ("chunked", False, False, {"chunked": {"programs": 64}}),
    "chunked@programs=256": ("chunked", False, False, {"chunked": {"programs": 256}}),
}
BATCH1_ONLY = ("chunked@programs=64", "chunked@programs=256")


def layer_calls(x, summaries, share, tokens, max_pages, sink, window, select, pdl, fused, launch_opts):
    """``(selection call, whole layer call)``: the page summaries refreshed (by their own launch, or with
    ``fused`` by the bounds launch), the pages, the attention."""
    def select_pages():
        refresh = None
        if fused:
            kmin, kmax, refresh = summaries.pending(x.k, x.lens)
        else:
            kmin, kmax = summaries.update(x.k, x.lens, pdl=pdl)
        return quest_pages.quest_select(x.q, kmin, kmax, x.lens, page_size=PAGE, sink=sink, window=window,
                                        size=tokens, max_pages=max_pages, share_kv_group=share, select=select,
                                        launch_opts=launch_opts, pdl=pdl, refresh=refresh)

    def call():
        p, c = select_pages()
        return sparse_decode_triton(x.q, x.k, x.v, p, c, page_size=PAGE, lengths=x.lens, sink=sink, window=window,
                                    pdl=pdl)[0]

    return select_pages, call


def run_case(n, batch, attention, args, timer, log) -> list[dict]:
    dev = "cpu" if args.check else "cuda"
    heads, kv_heads, d = (8, 2, 64) if args.check else (32, 8, 128)
    dtype = torch.float32 if args.check else torch.bfloat16
    x = Inputs(Case("llama-3.1-8b", heads, kv_heads, d, n, batch), dtype, seed=0, device=dev, attention=attention)
    sink = window = 16 if args.check else 128
    tokens, max_pages = quest_budget(n, args.density, sink, window, PAGE)
    # rows 5 keys short of the cache: every call refreshes the last, partial page, as a decode step does
    x.lens.fill_(n - 5)
    summaries = quest_pages.PageSummaries(PAGE)
    summaries.update(x.k, x.lens)  # the prefill's summary
    base = {"n": n, "batch": batch, "attention": attention}
    rows = []
    if not args.check and not isinstance(args.flashinfer, Exception) and args.flashinfer is not None:
        try:
            fi = VARIANTS["flashinfer"].make(x, None, 0)[0]
            rows.append({**base, "method": "flashinfer", "variant": "flashinfer",
                         "call_us": timer.time_graph_us(fi, warmup=args.warmup, iters=args.iters)["median_us"]})
            log(rows[-1])
        except Exception as exc:  # noqa: BLE001 - a missing baseline must not lose the others
            rows.append({**base, "method": "flashinfer", "variant": "flashinfer", "error": str(exc)[:300]})
    methods = [("quest-kv", True)] + ([("quest-q", False)] if batch == 1 and attention == "uniform" else [])
    for method, share in methods:
        kmin, kmax = summaries.update(x.k, x.lens)
        scores = quest_pages.quest_scores_reference(x.q, kmin, kmax, x.lens, PAGE, sink, window, share)
        want = quest_pages.quest_select(x.q, kmin, kmax, x.lens, page_size=PAGE, sink=sink, window=window,
                                        size=tokens, max_pages=max_pages, share_kv_group=share, bounds="reference")
        ref_out = sparse_decode_reference(x.q, x.k, x.v, *want, page_size=PAGE, lengths=x.lens, sink=sink,
                                          window=window, check=False)[0].float()
        for name, (select, pdl, fused, opts) in VARIANT_OPTS.items():
            if name in BATCH1_ONLY and (batch != 1 or n < 65536):
                continue
            r = {**base, "method": method, "variant": name, "pdl": pdl and args.pdl_ok}
            try:
                sel, call = layer_calls(x, summaries, share, tokens, max_pages, sink, window, select,
                                        pdl and args.pdl_ok, fused, opts)
                got = tuple(t.clone() for t in sel())
                r.update(selection_check(got, want, scores))
                out = call().float()
                r["out_rel_err"] = float((out - ref_out).norm() / ref_out.norm())
                r["call_us"] = timer.time_graph_us(call, warmup=args.warmup, iters=args.iters)["median_us"]
                r["selection_us"] = timer.time_graph_us(sel, warmup=args.warmup, iters=args.iters)["median_us"]
                if not args.check:
                    from kvsieve.bench.timing import count_launches

                    r["launches"] = count_launches(call)
                    if n >= 131072 and batch == 1 and attention == "uniform" and name in ("main", "chunked"):
                        r["kernels_us"] = timer.kernel_breakdown(call)
            except Exception as exc:  # noqa: BLE001 - a variant that fails loses its row only
                r["error"] = f"{type(exc).__name__}: {exc}"[:400]
                if not args.check:
                    torch.cuda.synchronize()
            rows.append(r)
            log(r)
    return rows


def markdown(res: dict) -> str:
    out = [f"# Quest decode layer: fused / overlapped selection variants on {res['device']} ({res['date']})", "",
           f"- command: `{res['command']}`; torch {res['torch']}, triton {res['triton']}; {res['protocol']}; "
           f"PDL available: {res['pdl_available']}",
           "- page 16, 5 % of the context (sink + window 128), Llama-3.1-8B heads 32/8/128 bf16; call = page update "
           "+ selection + attention; selection = page update + selection; pages checked against the torch "
           "reference (sets, near-ties allowed); rel err: output vs the reference attention over the reference's "
           "pages", f"- {res['seconds']:.0f} s", "",
           "| n | batch | attention | method | variant | call µs | × FlashInfer | selection µs | launches | pages | "
           "rel err |", "|---:|---:|---|---|---|---:|---:|---:|---:|---|---:|"]
    fi = {(r["n"], r["batch"], r["attention"]): r["call_us"] for r in res["rows"]
          if r["variant"] == "flashinfer" and "call_us" in r}
    for r in res["rows"]:
        if r["variant"] == "flashinfer":
            continue
        key = (r["n"], r["batch"], r["attention"])
        if "error" in r:
            out.append(f"| {r['n']:,} | {r['batch']} | {r['attention']} | {r['method']} | {r['variant']} | "
                       f"error: {r['error'][:100]} | | | | | |")
            continue
        speed = f"{fi[key] / r['call_us']:.2f}" if key in fi else "—"
        pages = "same" if r.get("same") else ("near-ties" if r.get("ok") else f"DIFFER ({r.get('why')})")
        out.append(f"| {r['n']:,} | {r['batch']} | {r['attention']} | {r['method']} | {r['variant']} | "
                   f"{r['call_us']:.1f} | {speed} | {r['selection_us']:.1f} | {r.get('launches', '—')} | {pages} | "
                   f"{r['out_rel_err']:.1e} |")
    if fi:
        out += ["", "FlashInfer µs: " + ", ".join(f"{n // 1024}k b{b} {a}: {v:.1f}" for (n, b, a), v in fi.items())]
    for r in res["rows"]:
        if r.get("kernels_us"):
            where = f"{r['n'] // 1024}k b{r['batch']}, {r['method']} {r['variant']}"
            out += ["", f"Kernels at {where} (device µs, eager):", ""]
            out += [f"- {name}: {us:.1f}" for name, us in r["kernels_us"].items()]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="CPU run: tiny shapes through the Triton interpreter")
    args = ap.parse_args(argv)
    if args.check:
        if not interpreter_set("--check"):
            return 2
        args.warmup, args.iters, args.density = 0, 1, 0.2
        cases = [(1024, 1, "uniform"), (2048, 2, "uniform")]
        timer, args.flashinfer, args.pdl_ok = WallTimer(), None, False
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --check)", file=sys.stderr)
            return 2
        cases = [(32768, 1, "uniform"), (131072, 1, "uniform"), (32768, 8, "uniform"), (131072, 1, "peaked")]
        args.flashinfer, _, timer = timing_setup()
        args.pdl_ok = pdl_available()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(r):
        print(json.dumps({k: v for k, v in r.items() if k != "kernels_us"}), flush=True)

    rows = []
    for n, batch, attention in cases:
        rows += run_case(n, batch, attention, args, timer, log)
        if not args.check:
            torch.cuda.empty_cache()
    res = {"kind": "quest_fused", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "device": "cpu (--check: Triton interpreter)" if args.check else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": library_version("triton"), "pdl_available": args.pdl_ok,
           "command": "quest_fused.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "protocol": "wall clock, eager" if args.check else
                       f"CUDA graph replays, 512 MB L2 flush before each, {args.warmup} warm-up + {args.iters} "
                       "timed, median",
           "seconds": time.time() - t0, "rows": rows}
    (args.out / "quest_fused.json").write_text(json.dumps(res, indent=1))
    (args.out / "quest_fused.md").write_text(markdown(res))
    print(markdown(res))
    bad = [r for r in rows if r["variant"] != "flashinfer" and ("error" in r or not r.get("ok", False))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
