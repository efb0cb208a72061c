"""Each method's decode call per layer on the operands of the end-to-end bench's own model, beside the
end-to-end step it is part of (GPU): where a method's end-to-end saving differs from its per-layer one.

The end-to-end bench (``kvsieve bench e2e``) times whole captured steps; the per-layer benches time a method on
the decode bench's synthetic inputs. This script builds the end-to-end bench's model (``--shape``, random weights,
``--attention peaked`` by default), prefills ``--batch`` prompts of ``--n`` tokens into a
:class:`~kvsieve.runtime.DecodeRuntime` once, and for each method (and dense):

- ``step_ms``: the runtime's captured step (median of ``--steps`` replays, CUDA events), as the e2e bench;
- ``layers``: for ``--layers`` layers (each the nearest layer the method serves), the operands the runtime's
  decode hands the method in one eager step (q, the capacity-sized K/V cache views, the device lengths, the
  scale) are kept, and the call the runtime makes (``driver.decode(..., count_reads=False)``, the driver's own
  state) is captured in a CUDA graph and replayed with a cold L2 (``ColdL2Timer.time_graph_us``); dense's
  kernel (``dense_decode_triton``) on the same operands beside;
- ``kernels``: the per-kernel device µs of that layer call (``ColdL2Timer.kernel_breakdown``; PDL-launched kernels
  include their waits).

Then ``(step − dense step) / layers`` against ``layer − dense layer`` says how much of a method's end-to-end
difference its attention calls account for.

Launch settings on these operands (``launch_sweep.py``'s tools): ``--set 'KERNEL:num_warps=2;...'`` times every
method's step and layer calls a second time, in the same process, with those kernels' launches at those settings
(``step_ms_set``, ``method_us_set``): an A/B on the model a setting is for. ``--in-call`` times the first layer's
call with each of its kernels at each other warp and stage count (``in_call``).

    python benchmarks/breakdown/e2e_layers.py --out $OUT/layers [--n 131072] [--batch 1]
        [--methods 'santa-prop:budget=128;quest:top_k=0.05,share_kv_group=true'] [--layers 0,15,31]
        [--set '_prop_sample_kernel:num_warps=4'] [--in-call]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch_sweep import applying, parse_settings, recording, spying, time_in_call  # noqa: E402

# Sketch&Walk is left out: its decode call copies a host-planned step to the device, which a capture of the call
# alone refuses (the runtime makes that copy before its capture); benchmarks/sketchwalk_authors/decode.py times it.
DEFAULT_METHODS = ("santa-prop:budget=128;bernoulli-qk:query=mean-group,values=santa-prop,budget=128,draws=8;"
                   "quest:top_k=0.05,share_kv_group=true")


def record_layers(rt, layers: set[int]) -> dict[int, tuple]:
    """One eager step of ``rt``; for each layer in ``layers`` the arguments its method decode got (q cloned, K/V
    as the capacity-sized cache views a captured step passes)."""
    kept: dict[int, tuple] = {}
    driver = rt.driver
    real = driver.decode

    def whole(t):  # an eager step hands the method the cache up to the longest row; a captured step all of it
        b, h, _, d = t.shape
        return t.as_strided((b, h, rt.capacity, d), t.stride(), t.storage_offset())

    def spy(layer, q, k, v, **kw):
        if layer in layers:
            kept[layer] = (q.clone(), whole(k), whole(v), kw["lengths"].clone(), kw.get("scale"))
        return real(layer, q, k, v, **kw)

    driver.decode = spy
    try:
        rt.step()
    finally:
        driver.decode = real
    return kept


def run(args) -> dict:
    from kvsieve.bench.e2e import build_model, time_steps
    from kvsieve.bench.peaked import bench_prompts, build_bench_model
    from kvsieve.bench.timing import ColdL2Timer
    from kvsieve.kernels.shared.dense import dense_decode_triton
    from kvsieve.runtime import DecodeRuntime

    model = build_bench_model(build_model, args.shape, args.attention, device="cuda", dtype=torch.bfloat16)
    n_layers = model.config.num_hidden_layers
    layers = sorted({int(x) % n_layers for x in args.layers.split(",")})
    prompts = bench_prompts(model, args.n, args.batch, torch.Generator().manual_seed(args.n + args.batch))
    new = 2 * args.steps + 16
    timer = ColdL2Timer()
    settings = parse_settings(args.set)
    out = {"shape": args.shape, "n": args.n, "batch": args.batch, "attention": args.attention, "layers": layers,
           "set": args.set,
           "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "torch": torch.__version__, "rows": []}
    rt = DecodeRuntime(model, "dense", batch_size=args.batch, capacity=args.n + new, max_new_tokens=new,
                       eos_token_id=[], graph="auto")
    specs = ["dense"] + [s for s in args.methods.split(";") if s]
    rows = {spec: {"variant": spec} for spec in specs}

    def start(spec, graph):
        rt.set_method(spec, graph=graph)
        if rt.records_prompt:
            rt.prefill(prompts)
        rt.rewind()

    with rt:
        rt.prefill(prompts)
        for spec in specs:  # every step time before the profiler attaches (it adds to later launches)
            try:
                start(spec, "auto")
                rt.step()  # the capture
                rows[spec].update(step_ms=time_steps(rt.step, args.steps, True)["ms"], graph=rt.use_graph)
            except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others
                rows[spec]["error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(json.dumps(rows[spec]), flush=True)
        if settings:
            with applying(settings):
                for spec in specs[1:]:
                    if "error" in rows[spec]:
                        continue
                    start(spec, "auto")
                    rt.step()  # the capture, with the settings
                    rows[spec]["step_ms_set"] = time_steps(rt.step, args.steps, True)["ms"]
                    print(json.dumps({"variant": spec, "step_ms_set": rows[spec]["step_ms_set"]}), flush=True)
        for spec in specs[1:]:
            row = rows[spec]
            if "error" in row:
                continue
            try:
                start(spec, False)  # the first step after the prompt: Sketch&Walk's decode restarts there
                served = rt.stats.method_decode_layers  # the method's layers (Sketch&Walk keeps some exact)
                mine = sorted({min(served, key=lambda s, x=x: (abs(s - x), s)) for x in layers})
                ops = record_layers(rt, set(mine))
                row["layers"] = {}
                for layer in mine:
                    q, k, v, lengths, scale = ops[layer]

                    def method_call(layer=layer, q=q, k=k, v=v, lengths=lengths, scale=scale):
                        return rt.driver.decode(layer, q, k, v, lengths=lengths, scale=scale, count_reads=False)

                    def dense_call(q=q, k=k, v=v, lengths=lengths, scale=scale):
                        return dense_decode_triton(q, k, v, lengths, scale)

                    row["layers"][str(layer)] = {"method_us": timer.time_graph_us(method_call)["median_us"],
                                                 "dense_us": timer.time_graph_us(dense_call)["median_us"]}
                    if settings:
                        with applying(settings):
                            row["layers"][str(layer)]["method_us_set"] = timer.time_graph_us(method_call)["median_us"]
                q, k, v, lengths, scale = ops[mine[0]]
                if args.in_call:
                    def first_call(q=q, k=k, v=v, lengths=lengths, scale=scale, layer=mine[0]):
                        return rt.driver.decode(layer, q, k, v, lengths=lengths, scale=scale, count_reads=False)

                    with spying():
                        launches: list = []
                        with recording(launches):
                            first_call()
                        row["in_call"] = time_in_call(first_call, launches, timer, 20)
                row["layers"][str(mine[0])]["kernels"] = timer.kernel_breakdown(
                    lambda q=q, k=k, v=v, lengths=lengths, scale=scale, layer=mine[0]: rt.driver.decode(
                        layer, q, k, v, lengths=lengths, scale=scale, count_reads=False))
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            print(json.dumps({k: v for k, v in row.items() if k != "layers"}), flush=True)
    out["rows"] = [rows[s] for s in specs]
    dense_ms = next((r["step_ms"] for r in out["rows"] if r["variant"] == "dense" and "step_ms" in r), None)
    for r in out["rows"]:
        if dense_ms is not None and "step_ms" in r:
            r["step_minus_dense_us_per_layer"] = (r["step_ms"] - dense_ms) * 1e3 / n_layers
        if r.get("layers"):
            ls = r["layers"].values()
            r["layer_minus_dense_us"] = sum(x["method_us"] - x["dense_us"] for x in ls) / len(r["layers"])
    return out


def markdown(res: dict) -> str:
    lines = [f"# Method calls per layer on the end-to-end model's operands — {res['device']}", "",
             f"- date: {res['date']}; torch {res['torch']}; {res['shape']}, batch {res['batch']}, N = {res['n']:,}, "
             f"attention {res['attention']}; layers {res['layers']}",
             "- step ms: the runtime's captured step (median); per layer: the runtime's method call on one eager "
             "step's operands, captured and replayed with a cold L2 (median µs), dense's kernel on the same"
             " operands", "",
             "| variant | step ms | (step − dense) / layer µs | layer µs (method / dense, per layer) | "
             "layer − dense µs | top kernels of the first layer (µs) |",
             "|---|---:|---:|---|---:|---|"]
    sets: list[str] = []
    calls: list[str] = []
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error'][:120]} | | | | |")
            continue
        if "step_ms_set" in r:
            per_set = "; ".join(f"L{k}: {v['method_us_set']:.1f}" for k, v in (r.get("layers") or {}).items()
                                if "method_us_set" in v)
            sets.append(f"| {r['variant']} | {r['step_ms']:.2f} | {r['step_ms_set']:.2f} | {per_set} |")
        for c in r.get("in_call", []):
            calls.append(f"| {r['variant']} | {c['kernel']} | {c['setting']} | "
                         f"{c['median_us']:.1f} |" if "median_us" in c else
                         f"| {r['variant']} | {c['kernel']} | {c['setting']} | {c.get('error', '')[:80]} |")
        per = "; ".join(f"L{k}: {v['method_us']:.1f} / {v['dense_us']:.1f}" for k, v in (r.get("layers") or {}).items())
        first = next(iter((r.get("layers") or {}).values()), None)
        kern = ""
        if first and first.get("kernels"):
            top = sorted(first["kernels"].items(), key=lambda kv: -kv[1])[:6]
            kern = ", ".join(f"{k[:32]} {v:.1f}" for k, v in top)
        diff = r.get("step_minus_dense_us_per_layer")
        lmd = r.get("layer_minus_dense_us")
        lines.append(f"| {r['variant']} | {r['step_ms']:.2f} | {'' if diff is None else f'{diff:+.1f}'} | {per} | "
                     f"{'' if lmd is None else f'{lmd:+.1f}'} | {kern} |")
    if sets:
        lines += ["", f"With `--set {res.get('set', '')}` (same process):", "",
                  "| variant | step ms | step ms with the settings | layer µs with them |", "|---|---:|---:|---|",
                  *sets]
    if calls:
        lines += ["", "The first layer's call with one kernel at another setting (`--in-call`):", "",
                  "| variant | kernel | setting | call µs |", "|---|---|---|---:|", *calls]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for e2e_layers.json and .md")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--attention", default="peaked", choices=("peaked", "uniform"))
    p.add_argument("--n", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--methods", default=DEFAULT_METHODS, help="';'-separated method specs")
    p.add_argument("--layers", default="1,16,31", help="comma list of layers to time per call")
    p.add_argument("--steps", type=int, default=10, help="timed captured steps per variant")
    p.add_argument("--set", default="", help="KERNEL:key=value,...;... launch settings timed beside the defaults "
                   "(module docstring)")
    p.add_argument("--in-call", action="store_true", help="sweep the first layer's launches inside its call")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("e2e_layers.py needs a CUDA GPU", file=sys.stderr)
        return 2
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e_layers.json").write_text(json.dumps(res, indent=1))
    (out / "e2e_layers.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
