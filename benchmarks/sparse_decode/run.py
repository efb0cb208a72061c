"""Sparse decode on the GPU: the Triton weighted sparse kernel and the device-side selections of
``streaming``, ``quest`` and ``oracle-topk`` against FlashInfer and SDPA in the same run.

``quest-*`` and ``oracle-topk-*`` run the default selection (``select="triton"``: the scoring launch and
one select launch, ``kernels/shared/select_triton.py``: the register select for rows of at most
``REGISTER_SELECT_MAX`` units, Quest's pages); at batch 1 the same selections also run as
``…@torch-select`` (partials-based group sum + ``torch.topk``; the earlier path, ``logsumexp`` +
a group-sum launch + ``torch.topk``, is the ``…@legacy`` rows of ``2026-11-25-h100-sparse-decode-select``)
and ``…@row-select`` (``topk_rows_triton``, the default before the register select; ``quest-kv@register-select``:
the register select on group-summed pages whatever their number, by default up to 4096);
``quest-*@split-select``: the split select (``select_split.topk_rows_split``; by default for at most
``select_triton.SPLIT_ROWS_MAX`` rows of the rows path) whatever the rows and their length;
``quest-kv@split-group-sum`` / ``@group-sum-in-select`` run the rows select with the pages group-summed
in a parallel launch of their own / inside it whatever the row length (for tuning
``select_triton.ROW_GROUP_SUM_MAX``). ``--variants`` limits the run to some variants (FlashInfer is the
baseline of the speedups: keep it).

    python benchmarks/sparse_decode/run.py OUT_DIR [--contexts 32768 131072] [--batch8-context 32768]
                                          [--variants quest oracle-topk flashinfer]

Llama-3.1-8B shapes (32 query heads, 8 KV heads, d 128), bf16, i.i.d. Gaussian inputs, ≈5% density.
Every call is captured in a CUDA graph and replayed with a 512 MB L2 flush before each replay (CUDA
events, median; ``kvsieve.bench.timing``); eager times are given too. Selection (page bounds, top-k)
and attention are also timed apart. "floor" = bytes the call must touch / the measured device copy
rate. Writes ``sparse_decode.json``, ``sparse_decode.md`` and ``sparse_decode.png`` into OUT_DIR.
About 2–3 minutes on an H100.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager, nullcontext
from functools import partial
from itertools import product
from pathlib import Path

import torch

from kvsieve.bench.decode import VARIANTS, Case, Inputs, library_version, timing_setup
from kvsieve.bench.timing import count_launches
from kvsieve.kernels.oracle_topk import topk
from kvsieve.kernels.quest import quest_pages
from kvsieve.kernels.shared import scores as score_kernels
from kvsieve.kernels.shared import select_triton
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference, sparse_decode_triton

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SINK = WINDOW = 128  # the methods' default sink + window around quest and oracle-topk
QUEST_PAGE = 16
TARGETS = {  # the targets: speedup over FlashInfer at (32k, 128k), batch 1
    "sparse-pages16": (6, 12), "streaming": (6, 12), "quest-q": (4, 7), "quest-kv": (4, 7),
    "oracle-topk-q": (1.3, 1.5), "oracle-topk-kv": (1.3, 1.5),
}


@contextmanager
def _select_limits(group_sum_in_select: int, registers: int, grouped: int, split_rows: int | None = None):
    """Rows of at most ``group_sum_in_select`` group-summed units are group-summed inside the rows select
    launch, rows of at most ``registers`` units take the register select, group-summed ones up to
    ``grouped`` units; Quest's rows select goes to the split select for at most ``split_rows`` rows (None:
    as set) (module constants; changed around a call, also while a CUDA graph captures it)."""
    names = ("ROW_GROUP_SUM_MAX", "REGISTER_SELECT_MAX", "REGISTER_SELECT_GROUPED_MAX", "SPLIT_ROWS_MAX")
    if split_rows is None:
        split_rows = select_triton.SPLIT_ROWS_MAX
    before = [getattr(select_triton, name) for name in names]
    for name, value in zip(names, (group_sum_in_select, registers, grouped, split_rows), strict=True):
        setattr(select_triton, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, before, strict=True):
            setattr(select_triton, name, value)


def _first(fn):
    """A call returning the first output of ``fn`` (the attention output, not the LSE)."""
    return lambda: fn()[0]


def quest_budget(n: int, density: float, sink: int = SINK, window_qt: int = WINDOW,
                 page: int = QUEST_PAGE) -> tuple[int, int]:
    """``(tokens wanted, most pages)`` of quest's selection: ``density`` of an ``n``-key context, less the
    sink and window it attends anyway (a page at least)."""
    tokens_wanted = max(page, int(density * n) - sink - window_qt)
    return tokens_wanted, -(-tokens_wanted // page)


def quest_calls(x, summaries, share: bool, tokens_wanted: int, max_pages: int, *, sink: int = SINK,
                window_qt: int = WINDOW, page: int = QUEST_PAGE, select: str = "triton", launch_opts=None,
                limits=nullcontext):
    """``(selection call, whole call)`` of one quest decode step on ``x`` (``Inputs``): the page summaries
    refreshed, ``quest_select`` (with ``select`` and ``launch_opts``, inside ``limits()``), and for the
    whole call the attention over its pages with the ``sink`` / ``window_qt`` dense part."""
    def select_pages():
        kmin, kmax = summaries.update(x.k, x.lens)
        with limits():
            return quest_pages.quest_select(x.q, kmin, kmax, x.lens, page_size=page, sink=sink, window=window_qt,
                                            size=tokens_wanted, max_pages=max_pages, share_kv_group=share,
                                            select=select, launch_opts=launch_opts)

    def call():
        p, c = select_pages()
        return sparse_decode_triton(x.q, x.k, x.v, p, c, page_size=page, lengths=x.lens, sink=sink,
                                    window=window_qt)[0]

    return select_pages, call


def random_pages(b, hs, n, page, count, gen):
    """``count`` distinct random pages per (row, head), ascending (a selection's usual output order)."""
    p = -(-n // page)
    pages = torch.rand(b, hs, p, device=gen.device, generator=gen).argsort(-1)[..., :count]
    return pages.sort(-1).values.contiguous(), torch.full((b, hs), count, device=gen.device, dtype=torch.long)


def unique_rows(n, pages, counts, page, kv_heads, lengths, sink=0, window=0):
    """K/V rows per (row, KV head) read from DRAM at least once: the union over a GQA group's lists."""
    b, hs, m = pages.shape
    dev = pages.device
    pos = (pages[..., None] * page + torch.arange(page, device=dev)).view(b, hs, -1)
    used = (torch.arange(m, device=dev) < counts[..., None]).repeat_interleave(page, -1)
    sink_end, win_start = score_kernels.dense_bounds(lengths, sink, window)
    used &= (pos >= sink_end[:, None, None]) & (pos < win_start[:, None, None])
    mark = torch.zeros(b, hs, n + 1, dtype=torch.bool, device=dev)
    mark.scatter_(2, torch.where(used, pos, n), True)
    mark = mark[..., :n].view(b, kv_heads, hs // kv_heads, n).any(2)
    dense = (sink_end + lengths.long() - win_start)[:, None]
    return float((mark.sum(-1) + dense).sum())


def variants(case: Case, x: Inputs, density: float, sink: int = SINK, window_qt: int = WINDOW):
    """``name -> (call, selection-only call or None, attention-only call, bytes, reference call)``;
    ``sink``/``window_qt``: the dense part around quest's and oracle-topk's selections."""
    b, n, d = case.batch, case.n, case.head_dim
    heads, kv_heads = case.heads, case.kv_heads
    lens = x.lens
    dev = x.q.device
    gen = torch.Generator(device=dev).manual_seed(1)
    row = d * x.k.element_size()
    budget = int(density * n)
    out = {}

    # the kernel alone, given page / token lists at `density` (and a few launch settings at batch 1)
    kernel_cases = [("sparse-pages16", 16, False, {}), ("sparse-pages32", 32, False, {}),
                    ("sparse-pages64", 64, False, {}), ("sparse-tokens", 1, False, {}),
                    ("sparse-pages16-per-q-head", 16, True, {})]
    if b == 1:
        kernel_cases += [("sparse-pages16+fused-merge", 16, False, {"fused_merge": True}),
                         ("sparse-pages16@528-programs", 16, False, {"target_programs": 528}),
                         ("sparse-pages16@132-programs", 16, False, {"target_programs": 132}),
                         ("sparse-pages16@block32", 16, False, {"block_n": 32})]
    for name, page, per_q, opts in kernel_cases:
        hs = heads if per_q else kv_heads
        pages, counts = random_pages(b, hs, n, page, max(1, budget // page), gen)
        call = _first(partial(sparse_decode_triton, x.q, x.k, x.v, pages, counts, page_size=page, lengths=lens,
                              **opts))
        ref = _first(partial(sparse_decode_reference, x.q, x.k, x.v, pages, counts, page_size=page, lengths=lens,
                             check=False))
        out[name] = (call, None, call, 2 * row * unique_rows(n, pages, counts, page, kv_heads, lens), ref)

    # streaming: sink 128 + window, together `density` of the context
    window = max(0, budget - sink)
    dense_opts = {"lengths": lens, "sink": sink, "window": window}
    stream = _first(partial(sparse_decode_triton, x.q, x.k, x.v, **dense_opts))
    stream_ref = _first(partial(sparse_decode_reference, x.q, x.k, x.v, **dense_opts))
    out["streaming"] = (stream, None, stream, 2.0 * row * b * kv_heads * min(n, sink + window), stream_ref)
    if b == 1:
        fused = _first(partial(sparse_decode_triton, x.q, x.k, x.v, fused_merge=True, **dense_opts))
        out["streaming+fused-merge"] = (fused, None, fused, out["streaming"][3], stream_ref)

    # selection paths: the default (rows up to select_triton.REGISTER_SELECT_MAX units: the register
    # select), and at batch 1 torch.topk in place of the select launch and the rows select launch
    # (topk_rows_triton, the path before the register select): for Quest's group-summed pages by the row
    # length (select_triton.ROW_GROUP_SUM_MAX), with the group sum inside it or in a parallel launch
    # (one program per row); Quest's split select (select_split.topk_rows_split, by default for few rows of
    # the rows path) whatever the rows and their length
    selections = [("", "triton")] + ([("@torch-select", "torch"), ("@row-select", "triton-rows"),
                                      ("@register-select", "triton-registers"),
                                      ("@group-sum-in-select", "triton-fold"),
                                      ("@split-group-sum", "triton-split"),
                                      ("@split-select", "triton-splitselect")] if b == 1 else [])
    fold_limit = {"triton-fold": 1 << 30, "triton-split": 0}
    tuning = ("triton-fold", "triton-split", "triton-registers")  # Quest's group-summed pages only

    def limits(how):
        registers = select_triton.REGISTER_SELECT_MAX
        splitting = how == "triton-splitselect"
        return _select_limits(fold_limit.get(how, select_triton.ROW_GROUP_SUM_MAX),
                              0 if how in ("triton-rows", "triton-splitselect", *fold_limit) else registers,
                              1 << 30 if how == "triton-registers" else select_triton.REGISTER_SELECT_GROUPED_MAX,
                              (1 << 30) if splitting else (0 if how in ("triton-rows", *fold_limit) else None))

    # quest, page 16: sink + window 128 each, top pages for the rest of the budget
    page = QUEST_PAGE
    tokens_wanted, max_pages = quest_budget(n, density, sink, window_qt, page)
    summaries = quest_pages.PageSummaries(page)
    summaries.update(x.k, lens)  # the prefill's summary; each timed step refreshes the last pages
    for (base, share), (suffix, how) in product((("quest-kv", True), ("quest-q", False)), selections):
        name = base + suffix
        if how in tuning and not share:
            continue
        select, call = quest_calls(x, summaries, share, tokens_wanted, max_pages, sink=sink, window_qt=window_qt,
                                   page=page, select=how.split("-")[0], limits=partial(limits, how))
        pages, counts = select()
        quest_opts = {"page_size": page, "lengths": lens, "sink": sink, "window": window_qt}
        attend = _first(partial(sparse_decode_triton, x.q, x.k, x.v, pages, counts, **quest_opts))
        summary_bytes = 2.0 * b * kv_heads * (-(-n // page)) * row
        ref = _first(partial(sparse_decode_reference, x.q, x.k, x.v, pages, counts, check=False, **quest_opts))
        rows_read = unique_rows(n, pages, counts, page, kv_heads, lens, sink, window_qt)
        out[name] = (call, select, attend, summary_bytes + 2 * row * rows_read, ref)

    # oracle top-k: every score (one Triton pass over K), top-k tokens outside sink + window
    for (base, share), (suffix, how) in product((("oracle-topk-kv", True), ("oracle-topk-q", False)), selections):
        name = base + suffix
        if how in (*tuning, "triton-splitselect") or (how == "triton-rows" and n > select_triton.REGISTER_SELECT_MAX):
            continue  # keys rows this long take the rows select anyway

        def select(share=share, how=how):
            with limits(how):
                return topk.topk_select(x.q, x.k, lens, sink=sink, window=window_qt, size=tokens_wanted,
                                        max_k=tokens_wanted, share_kv_group=share, select=how.split("-")[0])

        idx, counts = select()
        topk_opts = {"lengths": lens, "sink": sink, "window": window_qt}
        attend = _first(partial(sparse_decode_triton, x.q, x.k, x.v, idx, counts, **topk_opts))

        def call(select=select):
            i, c = select()
            return sparse_decode_triton(x.q, x.k, x.v, i, c, lengths=lens, sink=sink, window=window_qt)[0]

        ref = _first(partial(sparse_decode_reference, x.q, x.k, x.v, idx, counts, check=False, **topk_opts))
        rows_read = unique_rows(n, idx, counts, 1, kv_heads, lens, sink, window_qt)
        out[name] = (call, select, attend, b * kv_heads * n * row + row * rows_read, ref)  # all of K + V rows
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batch8-context", type=int, default=32768, help="context of the batch-8 case (0: none)")
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--variants", nargs="+", default=None, metavar="PREFIX",
                    help="time only the variants whose name starts with one of these (e.g. quest oracle-topk "
                         "flashinfer); default: all")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    flashinfer, peak, timer = timing_setup()
    cases = [Case("llama-3.1-8b", HEADS, KV_HEADS, HEAD_DIM, n, 1) for n in args.contexts]
    if args.batch8_context:
        cases.append(Case("llama-3.1-8b", HEADS, KV_HEADS, HEAD_DIM, args.batch8_context, 8))
    rows = []
    for case in cases:
        x = Inputs(case, torch.bfloat16, seed=0)
        calls = {}
        for name in ("flashinfer", "sdpa", "dense"):
            try:
                calls[name] = (VARIANTS[name].make(x, None, 0)[0], None, None,
                               2.0 * case.batch * KV_HEADS * case.n * HEAD_DIM * 2, None)
            except Exception as exc:  # noqa: BLE001 - a missing baseline must not lose the others
                rows.append({"n": case.n, "batch": case.batch, "variant": name, "error": str(exc)[:200]})
        calls.update(variants(case, x, args.density))
        if args.variants:
            calls = {name: c for name, c in calls.items() if name.startswith(tuple(args.variants))}
        for name, (call, select, attend, n_bytes, ref) in calls.items():
            r = {"n": case.n, "batch": case.batch, "variant": name, "bytes": n_bytes,
                 "floor_us": n_bytes / peak * 1e6}
            try:
                got = call()
                torch.cuda.synchronize()
                if ref is not None:
                    want = ref()
                    r["rel_error_vs_reference"] = float((got.float() - want.float()).norm() / want.float().norm())
                r["eager_us"] = timer.time_us(call, warmup=args.warmup, iters=args.iters)["median_us"]
                try:
                    r["graph_us"] = timer.time_graph_us(call, warmup=args.warmup, iters=args.iters)["median_us"]
                    if name in ("flashinfer", "sdpa", "dense") and r["graph_us"] > 1.5 * r["eager_us"]:
                        # a baseline's replay far slower than its eager launches is a measuring fault (seen
                        # once: FlashInfer at 32k, 285 µs captured vs 66 eager and 62 of kernels),
                        # and every speedup of its case divides by it: capture and time it again, keep both
                        r["graph_us_first"] = r["graph_us"]
                        r["graph_us"] = timer.time_graph_us(call, warmup=args.warmup, iters=args.iters)["median_us"]
                except Exception as exc:  # noqa: BLE001 - a call that cannot be captured keeps its eager time
                    r["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
                    torch.cuda.synchronize()
                if select is not None:
                    r["selection_graph_us"] = timer.time_graph_us(select, warmup=args.warmup,
                                                                  iters=args.iters)["median_us"]
                if attend is not None and attend is not call:
                    r["attention_graph_us"] = timer.time_graph_us(attend, warmup=args.warmup,
                                                                  iters=args.iters)["median_us"]
                r["launches"] = count_launches(call)
                if select is not None:
                    r["selection_launches"] = count_launches(select)
                r["kernels_us"] = timer.kernel_breakdown(call)
                print(f"n={case.n} b={case.batch} {name}: graph {r.get('graph_us', float('nan')):.1f} us, "
                      f"eager {r['eager_us']:.1f} us,"
                      f" floor {r['floor_us']:.1f} us, err {r.get('rel_error_vs_reference', float('nan')):.2e}")
            except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others' rows
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"n={case.n} b={case.batch} {name}: {r['error']}")
            rows.append(r)
        base = next((r for r in rows if r["n"] == case.n and r["batch"] == case.batch
                     and r["variant"] == "flashinfer" and "graph_us" in r), None)
        eager_base = next((r for r in rows if r["n"] == case.n and r["batch"] == case.batch
                           and r["variant"] == "flashinfer" and "eager_us" in r), None)
        for r in rows:
            if r["n"] != case.n or r["batch"] != case.batch:
                continue
            if base is not None and "graph_us" in r:
                r["speedup_vs_flashinfer"] = base["graph_us"] / r["graph_us"]
            if eager_base is not None and "eager_us" in r:
                r["eager_speedup_vs_flashinfer"] = eager_base["eager_us"] / r["eager_us"]
        del x, calls
        torch.cuda.empty_cache()
    results = {
        "kind": "sparse_decode",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else "run.py " + " ".join(argv),
        "torch": torch.__version__, "triton": library_version("triton"),
        "flashinfer": None if isinstance(flashinfer, Exception) else library_version("flashinfer"),
        "shape": f"{HEADS}/{KV_HEADS}/{HEAD_DIM} bf16", "density": args.density,
        "protocol": f"CUDA graph replays with a 512 MB L2 flush before each, CUDA events, {args.warmup} warm-up + "
                    f"{args.iters} timed, median (eager: the same without the graph)",
        "copy_bandwidth_bytes_per_s": peak,
        "rows": rows,
    }
    (args.out_dir / "sparse_decode.json").write_text(json.dumps(results, indent=1))
    (args.out_dir / "sparse_decode.md").write_text(markdown(results))
    try:
        plot(results, args.out_dir / "sparse_decode.png")
    except Exception as exc:  # noqa: BLE001 - matplotlib is optional
        print(f"no plot: {exc}")
    print(markdown(results))
    return 0


def _f(v, spec=".1f"):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(res: dict) -> str:
    lines = [f"# Sparse decode on {res['device']} ({res['date']})", "",
             f"- command: `{res['command']}`; torch {res['torch']}, triton {res['triton']}, "
             f"FlashInfer {res['flashinfer']}", f"- shape {res['shape']}, density ≈ {res['density']:.0%}; "
             f"{res['protocol']}",
             f"- floor = bytes touched / device copy rate ({res['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s); "
             "bytes = unique K+V rows per KV head (+ the page min/max for quest; oracle-topk: all of K + the V rows "
             "it selects)", "",
             "| n | batch | variant | graph µs | eager µs | × FlashInfer (graph) | × FlashInfer (eager) | target "
             "| selection µs | attention µs | floor µs | MB | launches | selection launches | rel err |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['n']:,} | {r['batch']} | {r['variant']} | error: {r['error'][:90]} |"
                         " | | | | | | | | | | |")
            continue
        tgt = TARGETS.get(r["variant"])
        target = "—" if tgt is None or r["batch"] != 1 else f"≥ {tgt[0 if r['n'] <= 32768 else 1]}×"
        lines.append(
            f"| {r['n']:,} | {r['batch']} | {r['variant']} | {_f(r.get('graph_us'))} | {_f(r.get('eager_us'))} | "
            f"{_f(r.get('speedup_vs_flashinfer'), '.2f')} | {_f(r.get('eager_speedup_vs_flashinfer'), '.2f')} | "
            f"{target} | {_f(r.get('selection_graph_us'))} | "
            f"{_f(r.get('attention_graph_us'))} | {_f(r.get('floor_us'))} | {r['bytes'] / 1e6:.1f} | "
            f"{r.get('launches')} | {r.get('selection_launches', '—')} | "
            f"{_f(r.get('rel_error_vs_reference'), '.1e')} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["n"], r["batch"]) for r in res["rows"]})
    names = [v for v in dict.fromkeys(r["variant"] for r in res["rows"])]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(cases)
    for i, (n, b) in enumerate(cases):
        ys = []
        for v in names:
            r = next((r for r in res["rows"] if r["n"] == n and r["batch"] == b and r["variant"] == v), {})
            ys.append(r.get("graph_us", float("nan")))
        ax.bar([j + i * width for j in range(len(names))], ys, width, label=f"n={n:,} batch {b}")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=35, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (CUDA graph, cold L2)")
    ax.set_title(f"Sparse decode, {res['shape']}, ≈{res['density']:.0%} density — {res['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
