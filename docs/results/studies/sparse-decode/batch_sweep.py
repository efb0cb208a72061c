"""Sketch&Walk and SAAP decode steps against FlashInfer's dense batch decode as the batch grows.

At 128k keys and batch 1 both methods' captured ``m.decode`` miss 5× FlashInfer (H200: about 52 and 51 µs
against 189 µs): the gap is the fixed latency of their chains of small kernels, which batch rows should
amortise while the dense decode's bytes grow with B. This measures at which batch each method reaches 5×.

One layer, Llama-3.1-8B heads (32 query, 8 KV, d = 128), bf16, every row N keys long, for each N and B:

- ``flashinfer``: ``BatchDecodeWithPagedKVCacheWrapper`` (HND, pages of 64 keys, row b's pages b·N/64 ...)
  over a copy of the cache, checked against a float32 softmax; at B = 1 also ``single_decode_with_kv_cache``
  (the other benches' baseline), so that the two baselines can be compared;
- ``sdpa``: ``scaled_dot_product_attention`` (GQA) over the cache;
- ``sketchwalk``: ``kvsieve.method("sketchwalk:density=0.1")`` as a walk layer after a seen prompt
  (``docs/results/studies/sketchwalk/bench_decode.py``'s ``method-walk``), checked against ``backend=reference``;
- ``saap``: ``kvsieve.method("saap:artifacts=DIR,probes=32,window=2047,window_scale=1.0")`` after its index
  build (``docs/results/studies/saap/bench_decode.py``'s method rows), checked against ``backend=reference``.

All read the same caches: SAAP's mixture keys (``make_case``, a row per batch row from one mixture), since
neither the dense decode's nor Sketch&Walk's cost depends on the values. CUDA graphs (FlashInfer eager if
its capture fails, marked), cold L2, medians. Each time has a byte floor: the K/V bytes the call reads
(``stats.bytes_read`` for the methods; Sketch&Walk adds the causal half of Ã its walk GEMV reads) at the
device's copy rate. Writes ``batch_sweep.json``, ``batch_sweep.md`` and ``batch_sweep.png`` under OUT.

    PYTHONPATH=src python docs/results/studies/sparse-decode/batch_sweep.py OUT \\
        [--contexts 131072] [--batches 1,2,4,8] \\
        [--iters 20]

``--smoke`` runs the setup and one call per variant on CPU at tiny shapes (no timing, no FlashInfer).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.bench.decode import library_version, timing_setup

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vs_flashinfer_paged import dense_reference, flashinfer_paged, max_err, timed  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 64
SW_SPEC = "sketchwalk:density=0.1"


def load(path: Path, name: str):
    """A bench script as a module (both are named bench_decode.py)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sw_bench = load(HERE.parent / "sketchwalk" / "bench_decode.py", "sketchwalk_bench_decode")
saap_bench = load(HERE.parent / "saap" / "bench_decode.py", "saap_bench_decode")


def hnd_pages(t: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, N, d] -> FlashInfer's HND pages [B·N/PAGE, Hkv, PAGE, d], row b's pages b·N/PAGE ... ."""
    b, h, n, d = t.shape
    pages = t.view(b, h, n // PAGE, PAGE, d).permute(0, 2, 1, 3, 4).contiguous().view(b * n // PAGE, h, PAGE, d)
    last = pages[(b - 1) * n // PAGE:].permute(1, 0, 2, 3).reshape(h, n, d)  # the page table's view of a row
    if not torch.equal(last, t[-1]):
        raise AssertionError("the HND page copy does not hold the cache's last row")
    return pages


class Timing:
    """Cold-L2 medians on the GPU; under --smoke one call and no time."""

    def __init__(self, timer, iters: int, copy_rate: float | None):
        self.timer, self.iters, self.copy_rate = timer, iters, copy_rate

    def __call__(self, fn, graph: bool = True) -> dict:
        if self.timer is None:
            fn()
            return {"median_us": None, "graph": graph}
        if graph:
            return {**self.timer.time_graph_us(fn, iters=self.iters), "graph": True}
        return timed(self.timer, fn, self.iters)  # a library call: captured if it can be, else eager

    def floor_us(self, n_bytes: float) -> float | None:
        return n_bytes / self.copy_rate * 1e6 if self.copy_rate else None


def dense_rows(row: dict, q, k, v, fi, time) -> None:
    """SDPA and FlashInfer's paged batch decode (and at B = 1 its single decode) over all keys."""
    b, n = k.shape[0], k.shape[2]
    ref = dense_reference(q, k, v)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    row["sdpa_err"] = max_err(sdpa(), ref)
    row["sdpa_us"] = time(sdpa)["median_us"]
    kp, vp = hnd_pages(k), hnd_pages(v)  # checked even without FlashInfer (--smoke)
    if fi is None:
        return
    tables = [torch.arange(i * n // PAGE, (i + 1) * n // PAGE) for i in range(b)]
    run = flashinfer_paged(fi, q, kp, vp, tables, PAGE, HQ, HKV, tensor_cores=False)
    row["flashinfer_err"] = max_err(run(), ref)
    t = time(run, graph=False)
    row["flashinfer_us"], row["flashinfer_graph"] = t["median_us"], t["graph"]
    if b == 1:
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()

        def single():
            return fi.single_decode_with_kv_cache(q[0], kn, vn, kv_layout="NHD")
        row["flashinfer_single_err"] = max_err(single(), ref[0])
        t = time(single, graph=False)
        row["flashinfer_single_us"], row["flashinfer_single_graph"] = t["median_us"], t["graph"]


def sketchwalk_row(row: dict, q, k, v, lens, gen, time) -> None:
    """A walk layer after a seen prompt, as docs/results/studies/sketchwalk/bench_decode.py's method-walk."""
    m = kvsieve.method(SW_SPEC)
    state, w_prev = sw_bench.seen_prompt_state(m, q, k, v, lens, gen)
    if q.is_cuda:  # the fused path against backend=reference on copies of the state
        try:
            row["sw_check"] = sw_bench.check_against_reference(SW_SPEC, q, k, v, lens, state, w_prev)
        except SystemExit as exc:  # timed anyway, the failure kept beside the time
            row["sw_check"] = {"failed": str(exc)}
    call = sw_bench.walk_call(m, q, k, v, lens, state, w_prev)
    _, stats = call()
    nb = w_prev.shape[1]
    a_tilde = q.shape[0] * nb * (nb + 1) // 2 * state.sketch.a_tilde.element_size()  # the GEMV's
    row.update(sw_blocks_kept=stats.blocks_kept, sw_backend=stats.backend, sw_selection=stats.extra.get("selection"),
               sw_kv_bytes=stats.bytes_read, sw_a_tilde_bytes=a_tilde,
               sw_floor_us=time.floor_us(stats.bytes_read + a_tilde), sw_us=time(call)["median_us"])


def saap_row(row: dict, q, k, v, lens, spec: str, time) -> None:
    """The first m.decode builds the index, the captured call reads it (saap/bench_decode.py's method rows)."""
    n = k.shape[2]
    m, ref = kvsieve.method(spec), kvsieve.method(spec + ",backend=reference")
    state, ctx = m.new_state(), CallContext(layer=1, min_length=n)
    out, stats = m.decode(q, k, v, lengths=lens, state=state, context=ctx, check_finite=False)
    ref_out, _ = ref.decode(q, k, v, lengths=lens, context=CallContext(layer=1), check_finite=False)
    row.update(saap_err_vs_reference=max_err(out, ref_out), saap_backend=stats.backend,
               saap_selectivity=float(stats["selectivity"]), saap_kv_bytes=stats.bytes_read,
               saap_floor_us=time.floor_us(stats.bytes_read))
    row["saap_us"] = time(lambda: m.decode(q, k, v, lengths=lens, state=state, context=ctx,
                                           check_finite=False))["median_us"]


def sweep_context(n: int, batches: list[int], smoke: bool, fi, time: Timing, dev) -> list[dict]:
    clusters, probes, window = (64, 4, 127) if smoke else (1024, 32, 2047)
    torch.manual_seed(n)  # make_case draws the mixture weights from the global generator
    case = saap_bench.make_case(n, HQ, HKV, D, clusters, window, dev, torch.bfloat16, seed=n, batch=max(batches))
    gen = torch.Generator(device=dev).manual_seed(n)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        saap_bench.write_artifacts(case, Path(folder), HQ)
        spec = f"saap:artifacts={folder},probes={probes},window={window},window_scale=1.0"
        for b in batches:
            q, k, v = case["q"][:b], case["k"][:b], case["v"][:b]  # leading rows of contiguous tensors: views
            lens = torch.full((b,), n, dtype=torch.int32, device=dev)
            row = {"n": n, "batch": b, "dense_floor_us": time.floor_us(b * n * HKV * D * 2 * 2)}
            dense_rows(row, q, k, v, fi, time)
            sketchwalk_row(row, q, k, v, lens, gen, time)
            saap_row(row, q, k, v, lens, spec, time)
            for key in ("sdpa", "flashinfer", "sw", "saap"):
                if row.get(f"{key}_us") is not None:
                    row[f"{key}_us_per_row"] = row[f"{key}_us"] / b
                if key in ("sw", "saap") and row.get("flashinfer_us") is not None:
                    row[f"{key}_x_flashinfer"] = row["flashinfer_us"] / row[f"{key}_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if dev.type == "cuda":  # the HND copies and the methods' states of this B
                torch.cuda.empty_cache()
    return rows


def fmt(x, spec=".1f") -> str:
    return "–" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    rate = result["copy_rate_bytes_per_s"]
    lines = [f"# Sketch&Walk and SAAP decode vs FlashInfer's batch decode by batch ({result['device']}, "
             f"{result['date']})", "", f"- command: `{result['command']}`; torch {result['torch']}, triton "
             f"{result['triton']}, flashinfer {result['flashinfer'] or 'absent: its columns are empty'}; "
             f"copy rate {fmt(rate / 1e12 if rate else None, '.2f')} TB/s; {result['shapes']}; {result['protocol']}"]
    for n in sorted({r["n"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["n"] == n]
        single = next((r for r in rows if "flashinfer_single_us" in r), None)
        lines += ["", f"## N = {n:,}", "",
                  "| B | FlashInfer paged µs | /B | SDPA µs | /B | SW µs | SW × FI | /B | SAAP µs | SAAP × FI | /B | "
                  "dense floor µs | SW floor µs | SAAP floor µs |", "|---:" * 14 + "|"]
        for r in rows:
            mark = "" if r.get("flashinfer_graph", True) else " (eager)"
            cells = [str(r["batch"]), fmt(r.get("flashinfer_us")) + mark, fmt(r.get("flashinfer_us_per_row")),
                     fmt(r["sdpa_us"]), fmt(r.get("sdpa_us_per_row")), fmt(r["sw_us"]),
                     fmt(r.get("sw_x_flashinfer"), ".2f"), fmt(r.get("sw_us_per_row")), fmt(r["saap_us"]),
                     fmt(r.get("saap_x_flashinfer"), ".2f"), fmt(r.get("saap_us_per_row")), fmt(r["dense_floor_us"]),
                     fmt(r["sw_floor_us"]), fmt(r["saap_floor_us"])]
            lines.append("| " + " | ".join(cells) + " |")
        if single is not None:
            lines += ["", f"B = 1 `single_decode_with_kv_cache`: {fmt(single['flashinfer_single_us'])} µs"
                      f"{'' if single['flashinfer_single_graph'] else ' (eager)'} (paged: "
                      f"{fmt(single['flashinfer_us'])} µs)."]
        lines += ["", "Checks: FlashInfer and SDPA max abs error vs float32 softmax, SAAP's vs backend=reference, "
                  "Sketch&Walk's output relative error vs backend=reference (and its selection path):"]
        for r in rows:
            sw = r.get("sw_check", {})
            sw = sw.get("failed") or (f"{fmt(sw['out_rel_err'], '.1e')}, same blocks {sw['same_reads']}" if sw
                                      else "not checked (CPU)")
            lines.append(f"- B = {r['batch']}: FI {fmt(r.get('flashinfer_err'), '.1e')}, SDPA "
                         f"{fmt(r['sdpa_err'], '.1e')}, SAAP {fmt(r['saap_err_vs_reference'], '.1e')}, SW {sw} "
                         f"({r['sw_selection']}), SW blocks kept {fmt(r['sw_blocks_kept'], '.0f')}, "
                         f"SAAP selectivity {fmt(r['saap_selectivity'], '.3f')}")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    if not any("sw_x_flashinfer" in r for r in result["rows"]):  # no FlashInfer, no ratios
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r["n"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["n"] == n and "sw_x_flashinfer" in r]
        for key, label in (("sw", "Sketch&Walk"), ("saap", "SAAP")):
            ax.plot([r["batch"] for r in rows], [r[f"{key}_x_flashinfer"] for r in rows], "o-", label=f"{label}, N={n}")
    ax.axhline(5.0, color="k", ls="--", lw=1, label="target 5×")
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in result["rows"]})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set(xlabel="batch B", ylabel="× FlashInfer batch decode", title=result["device"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, one call per variant, no timing")
    args = ap.parse_args(argv)
    contexts, batches = ([2048], [1, 2]) if args.smoke else \
        ([int(x) for x in args.contexts.split(",")], [int(x) for x in args.batches.split(",")])
    if args.smoke:
        dev, fi, copy_rate, timer = torch.device("cpu"), None, None, None
    elif not torch.cuda.is_available():
        print("needs a CUDA device (--smoke checks the script on CPU)", file=sys.stderr)
        return 2
    else:
        dev = torch.device("cuda")
        fi, copy_rate, timer = timing_setup()
        fi = None if isinstance(fi, Exception) else fi
    rows, time = [], Timing(timer, args.iters, copy_rate)
    with torch.no_grad():
        for n in contexts:
            rows += sweep_context(n, batches, args.smoke, fi, time, dev)
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)",
              "command": " ".join(sys.argv), "torch": torch.__version__, "triton": library_version("triton"),
              "flashinfer": library_version("flashinfer") if fi is not None else None,
              "copy_rate_bytes_per_s": copy_rate, "iters": args.iters,
              "shapes": f"Hq={HQ}, Hkv={HKV}, d={D}, bf16, FlashInfer pages of {PAGE}",
              "protocol": f"CUDA graph replays unless marked eager, 512 MB L2 flush before each, "
                          f"median of {args.iters}",
              "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "batch_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "batch_sweep.md").write_text(markdown(result))
    plot(result, args.out_dir / "batch_sweep.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
