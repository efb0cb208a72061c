"""Every Triton launch of a method's decode call timed alone, with its warps and pipeline stages swept (GPU).

Per-kernel profiles of a call count a kernel launched with programmatic dependent launch (PDL) together with its
wait for the kernel before it. Here one call's launches (through ``triton_utils.launch``, which every kernel
module calls) are recorded — kernel, grid, arguments, constexprs — and each is captured alone in a CUDA graph
without PDL and replayed with a cold L2 (``ColdL2Timer``), at its own settings and at every other ``num_warps``
and ``num_stages`` of the sweep. A launch replayed alone repeats its work on the buffers the call left (the same
shapes and branches); kernels that wait on flags another launch raises (``SLEEP`` in their constexprs: S²ANTA's
overlapped form) are timed only inside the call. A setting that wins here still needs its method's tests and an
end-to-end run before it becomes a default.

The operands are random bf16 at Llama-3.1-8B heads (32/8/128), with attention made peaked the way the bench's
model is (sink keys, a recent window and a few strong keys per KV head aligned with the group's queries), the
lengths one below a capacity-sized cache as in the runtime.

    python benchmarks/breakdown/launch_sweep.py --out DIR [--cases 1x128k,8x32k] [--methods 'quest:...;santa-prop:...']
"""

# ruff: noqa: B023 - every closure below is captured and timed before its loop variables change

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

DEFAULT_METHODS = ("santa-prop:budget=128;bernoulli-qk:query=mean-group,values=santa-prop,budget=128,draws=8;"
                   "quest:top_k=0.05,share_kv_group=true")


def kernel_name(kernel) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))


_OVERRIDES: dict[str, dict] = {}  # kernel name → settings taken over its launches' own
_RECORDS: list[list] = []  # the lists recording launches


@contextlib.contextmanager
def spying():
    """Every ``launch`` of kvsieve's kernel modules through one wrapper: it records the launch in the open
    :func:`recording` lists and applies the :func:`overriding` settings of its kernel."""
    from kvsieve.kernels.shared import triton_utils

    real = triton_utils.launch

    def spy(kernel, grid, *args, **meta):
        meta = {**meta, **_OVERRIDES.get(kernel_name(kernel), {})}
        for seen in _RECORDS:
            seen.append((kernel, tuple(grid), args, dict(meta)))
        real(kernel, grid, *args, **meta)

    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("kvsieve.kernels.") and getattr(module, "launch", None) is real:
                stack.enter_context(mock.patch.object(module, "launch", spy))
        yield


@contextlib.contextmanager
def recording(seen: list):
    """Within it (and :func:`spying`) every launch appends ``(kernel, grid, args, meta)`` to ``seen``."""
    _RECORDS.append(seen)
    try:
        yield
    finally:
        _RECORDS.remove(seen)


@contextlib.contextmanager
def overriding(kernel: str, meta: dict):
    """Within it (and :func:`spying`) the launches of ``kernel`` (by name) take ``meta`` over their own."""
    before = _OVERRIDES.get(kernel)
    _OVERRIDES[kernel] = {**(before or {}), **meta}
    try:
        yield
    finally:
        if before is None:
            del _OVERRIDES[kernel]
        else:
            _OVERRIDES[kernel] = before


@contextlib.contextmanager
def applying(settings: dict[str, dict]):
    """Within it every launch goes through :func:`spying`, the kernels of ``settings`` (``parse_settings``' form)
    at those settings."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(spying())
        for kernel, change in settings.items():
            stack.enter_context(overriding(kernel, change))
        yield


def alone(kernel, grid, args, meta):
    """The launch without PDL (its constexpr off, the launch option dropped)."""
    meta = {k: v for k, v in meta.items() if k != "launch_pdl"}
    if "PDL" in meta:
        meta["PDL"] = False
    return lambda: kernel[grid](*args, **meta)


def settings(meta, warps=(2, 4, 8), stages=(1, 2, 3, 4)):
    """``(label, meta)``: the launch's own settings, then each other warp count and stage count."""
    out = [("default", meta)]
    out += [(f"warps={w}", {**meta, "num_warps": w}) for w in warps if w != meta.get("num_warps", 4)]
    out += [(f"stages={s}", {**meta, "num_stages": s}) for s in stages if s != meta.get("num_stages", 3)]
    return out


def time_in_call(call, launches, timer, iters: int) -> list[dict]:
    """The whole call captured and timed with one kernel's launches at each other setting (the rest at theirs):
    what a setting changes where the launches overlap (PDL, flags)."""
    rows = []
    done = set()
    for kernel, _grid, _, meta in launches:
        name = kernel_name(kernel)
        if name in done:
            continue
        done.add(name)
        for label, me in settings(meta)[1:]:
            change = {key: val for key, val in me.items() if meta.get(key) != val}
            try:
                with overriding(name, change):
                    t = timer.time_graph_us(call, iters=iters)
                row = {"kernel": name, "setting": label, **t}
            except Exception as e:  # noqa: BLE001 - a setting that fails to compile or launch is reported
                row = {"kernel": name, "setting": label, "error": repr(e)[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def time_launches(launches, timer, iters: int, sweep: bool, extra=None) -> list[dict]:
    """Each recorded launch alone at its settings (and, with ``sweep``, at the others; ``extra(kernel, grid,
    meta)`` adds ``(label, grid, meta)`` variants of its own)."""
    rows = []
    for i, (kernel, grid, args, meta) in enumerate(launches):
        name = kernel_name(kernel)
        if "SLEEP" in meta:
            rows.append({"i": i, "kernel": name, "grid": list(grid), "setting": "default",
                         "skipped": "waits on flags raised by another launch"})
            continue
        variants = [(label, grid, me) for label, me in (settings(meta) if sweep else [("default", meta)])]
        if sweep and extra is not None:
            variants += extra(kernel, grid, meta)
        for label, gr, me in variants:
            try:
                t = timer.time_graph_us(alone(kernel, gr, args, me), iters=iters)
                row = {"i": i, "kernel": name, "grid": list(gr), "setting": label, **t}
            except Exception as e:  # noqa: BLE001 - a setting that fails to compile or launch is reported
                row = {"i": i, "kernel": name, "grid": list(gr), "setting": label, "error": repr(e)[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def peaked_operands(batch: int, n: int, g: torch.Generator, dev, *, hq=32, hkv=8, d=128, strong=16):
    """``q [B, Hq, d]``, ``k, v [B, Hkv, n + 16, d]`` bf16 with peaked attention (module docstring), lengths ``n``."""
    q = torch.randn(batch, hq, d, device=dev, generator=g)
    k = torch.randn(batch, hkv, n + 16, d, device=dev, generator=g)
    v = torch.randn(batch, hkv, n + 16, d, device=dev, generator=g)
    mean_q = q.view(batch, hkv, hq // hkv, d).mean(2)  # [B, Hkv, d]
    unit = mean_q / mean_q.norm(dim=-1, keepdim=True)
    k[:, :, :4] += 6.0 * unit[:, :, None]  # sinks
    k[:, :, n - 1024:n] += 2.0 * unit[:, :, None]  # the recent window
    picks = torch.randint(4, n - 1024, (strong,), device=dev, generator=g)
    k[:, :, picks] += 5.0 * unit[:, :, None]
    lengths = torch.full((batch,), n, dtype=torch.int32, device=dev)
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), lengths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="1x128k,8x32k")
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="each launch at its own settings only")
    ap.add_argument("--in-call", action="store_true", help="also time the whole call with each launch's settings "
                    "swept inside it")
    ap.add_argument("--set", default="", help="KERNEL:key=value,...;... settings applied to every timing (e.g. "
                    "'_prop_sample_kernel:num_warps=2')")
    args = ap.parse_args(argv)
    import kvsieve
    from kvsieve.bench.report import environment
    from kvsieve.bench.timing import ColdL2Timer
    from kvsieve.cli.bench import parse_cases
    from kvsieve.core.context import CallContext

    fixed = parse_settings(args.set)
    dev = torch.device("cuda")
    timer = ColdL2Timer(dev)
    g = torch.Generator(dev).manual_seed(0)
    results = []
    for case, (batch, n) in zip(args.cases.split(","), parse_cases(args.cases), strict=True):
        q, k, v, lengths = peaked_operands(batch, n, g, dev)
        for spec in args.methods.split(";"):
            m = kvsieve.method(spec)
            state = m.new_state()
            ctx = CallContext(layer=0, count_reads=False, min_length=n, capacity=n + 16)

            def call():
                return m.decode(q, k, v, lengths=lengths, seed=1, state=state, context=ctx, check_finite=False)[0]

            call()  # (imports the kernel modules, which spying() patches)
            torch.cuda.synchronize()
            with applying(fixed):
                whole = timer.time_graph_us(call, iters=args.iters)
                seen: list = []
                with recording(seen):
                    call()
                torch.cuda.synchronize()
                print(json.dumps({"case": case, "method": spec, "call_us": whole["median_us"],
                                  "launches": len(seen)}), flush=True)
                rows = time_launches(seen, timer, args.iters, not args.no_sweep)
                in_call = time_in_call(call, seen, timer, args.iters) if args.in_call else []
            results.append({"case": case, "method": spec, "call_us": whole, "launches": len(seen), "rows": rows,
                            "in_call": in_call, "set": args.set})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**environment("launch-sweep", dev, torch.bfloat16), "command": " ".join(sys.argv)}
    (out / "launch_sweep.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "launch_sweep.md").write_text(markdown(meta, results))
    return 0


def parse_settings(text: str) -> dict[str, dict]:
    """``KERNEL:key=value,...;...`` → ``{kernel: {key: int value}}``."""
    out: dict[str, dict] = {}
    for item in filter(None, text.split(";")):
        try:
            kernel, pairs = item.split(":")
            out[kernel] = {key: int(val) for key, val in (pair.split("=") for pair in pairs.split(","))}
        except ValueError:
            raise ValueError(f"--set: expected KERNEL:key=value,... items, got {item!r}") from None
    return out


def markdown(meta, results) -> str:
    """Per method and case: each launch's own µs and its best other setting where that is faster."""
    lines = [f"# Launches alone, settings swept ({meta['device']})", "",
             f"- date: {meta['date']}; torch {meta['torch']}", f"- command: `{meta['command']}`",
             "- µs: the launch alone, captured, no PDL, cold L2, median", "",
             "| case | method | call µs | # | kernel | own µs | best other | µs |",
             "|---|---|---:|---:|---|---:|---|---:|"]
    for res in results:
        by_launch: dict[int, list] = {}
        for row in res["rows"]:
            by_launch.setdefault(row["i"], []).append(row)
        for i, rows in by_launch.items():
            own = next((r for r in rows if r["setting"] == "default"), rows[0])
            others = [r for r in rows if r["setting"] != "default" and "median_us" in r]
            best = min(others, key=lambda r: r["median_us"]) if others else None
            own_us = f"{own['median_us']:.1f}" if "median_us" in own else own.get("skipped", own.get("error", ""))
            best_label, best_us = (best["setting"], f"{best['median_us']:.1f}") if best else ("–", "–")
            lines.append(f"| {res['case']} | `{res['method']}` | {res['call_us']['median_us']:.1f} | {i} | "
                         f"{own['kernel']} | {own_us} | {best_label} | {best_us} |")
    calls = [(res, row) for res in results for row in res["in_call"]]
    if calls:
        lines += ["", "Inside the whole call (one kernel's launches at another setting, the rest at theirs):", "",
                  "| case | method | call µs | kernel | setting | call µs there |", "|---|---|---:|---|---|---:|"]
        for res, row in calls:
            us = f"{row['median_us']:.1f}" if "median_us" in row else row.get("error", "")
            lines.append(f"| {res['case']} | `{res['method']}` | {res['call_us']['median_us']:.1f} | {row['kernel']} | "
                         f"{row['setting']} | {us} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
