"""variant=authors' batched decode per layer at Llama-3.1-8B heads (32/8/128, bf16) vs FlashInfer and the dense
Triton kernel, captured in a CUDA graph, cold L2; writes ``decode.json`` and ``decode.md`` to ``--out``.

    python benchmarks/sketchwalk_authors/decode.py --out "$OUT" [--n 131072] [--batch 1] [--spec SPEC] [--paths P,..]
    TRITON_INTERPRET=1 python benchmarks/sketchwalk_authors/decode.py --out /tmp/x --check   # CPU, tiny shapes

``--paths``: the forms of the step's second half (``kernels/sketchwalk/authors_walk.py``'s ``WalkPath``), each timed
with its own state: ``chunked`` (the tail and the selection in passes over memory, the hops over float32 U),
``registers`` (the row in registers), ``registers-bf16`` / ``registers-fp16`` (and the hops over a 16-bit copy of U);
``-jN`` / ``-iN`` / ``-wN`` / ``-sN`` set the hops' tile (columns; rows per step), warps and row splits. Each path
is first checked against the step's torch reference (``device_step(kernels=False)``) from the same state, step by
step over ``--check-steps`` steps up to the timed position: kept blocks that differ (flips: near ties, or the 16-bit
U's rounding) out of those kept, the walk's and the row scales' largest relative difference, whether the page lists
are equal, and the attention on the path's pages against masked attention over the reference's kept keys (a flip
moves it) and over the path's own (the attention alone). Rows ``sketchwalk_step[P]`` and ``sketchwalk_step`` (the
first path's).

The prompt state comes from the method's own prefill record (``prefill(sparse=False)``, the torch block matrix)
of ``n − 1`` random tokens; every timed replay is the first step after the prompt (a restart, the same work as
any step). Rows: the whole step (selection + attention), the attention alone on the step's pages (so the
selection's share is the difference), FlashInfer (batch 1) and the dense Triton decode; ``launches`` is the
kernels of one layer's step (torch profiler), ``kernels_us`` the step's mean device µs per kernel (eager, cold
L2; a kernel launched with programmatic dependent launch counts its wait). ``--check`` runs the paths'
checks and one step each on the CPU through Triton's interpreter (tiny shapes, no timing) and reports what a step
would launch (``count_dispatched``: Triton launches and torch ops).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.bench.timing import count_dispatched
from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton
from kvsieve.kernels.sketchwalk import authors_walk as aw
from kvsieve.methods.sketchwalk import SketchWalkState, authors
from kvsieve.methods.sketchwalk import authors_device as ad

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def walk_path(name: str) -> aw.WalkPath:
    """``chunked`` | ``registers``, then ``-bf16`` / ``-fp16`` (the hops' U), ``-jN`` / ``-iN`` (their tile), ``-wN``
    (their warps), ``-sN`` (their row splits)."""
    form, *opts = name.split("-")
    kw = {"tail": form, "select": form}
    for opt in opts:
        if opt in DTYPES:
            kw["walk_dtype"] = DTYPES[opt]
        elif opt[:1] in ("i", "j", "w", "s") and opt[1:].isdigit():
            key = {"i": "block_i", "j": "block_j", "w": "hop_warps", "s": "splits"}[opt[0]]
            kw[key] = int(opt[1:])
        else:
            raise ValueError(f"--paths: unknown option {opt!r} in {name!r}")
    return aw.WalkPath(**kw)


def cloned(dst):
    """A device state with tensors of its own (no selection record)."""
    tensors = {f.name: getattr(dst, f.name).clone() for f in dataclasses.fields(dst)
               if isinstance(getattr(dst, f.name), torch.Tensor)}
    return dataclasses.replace(dst, **tensors, last_step=None)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-30)).nan_to_num(0.0).max())


def check_path(m, layer, hq: int, k, v, n: int, steps: int, g) -> dict:
    """The module's current path against the torch step from the same state (module docstring); the device state
    is made by the method at position ``n − steps`` from the prompt's record ``layer``."""
    cfg = m.config
    b, _, n_keys, d = k.shape
    dev = k.device
    state = SketchWalkState(authors=layer)
    bound = ad.max_kept_pages(n_keys, cfg.block_size, sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac)
    kw = dict(beta=cfg.walk_damping, degree=cfg.degree, sink=cfg.sink, window=cfg.window,
              kblocks_frac=cfg.kblocks_frac, max_pages=bound)
    prefix = authors.reserved(cfg.window, n_keys, cfg.block_size, -(-n_keys // cfg.block_size))[0]
    res = {"steps": steps, "flips": 0, "kept_blocks": 0, "walk_max_rel": 0.0, "sigma_max_rel": 0.0,
           "pages_equal": True, "out_max_abs": 0.0, "out_own_max_abs": 0.0}
    for t in range(n - steps, n + 1):
        q = torch.randn(b, hq, d, device=dev, generator=g).to(k.dtype)
        lengths = torch.full((b,), t, device=dev, dtype=torch.int32)
        if t == n - steps:  # the state, made by the method from the prompt's record, and its first step
            m.decode(q, k, v, lengths=lengths, state=state, context=CallContext(capacity=n_keys), check_finite=False)
            continue
        dst = state.authors_device
        ref = cloned(dst)
        got = ad.device_step(dst, q, k, lengths, kernels=True, **kw)
        want = ad.device_step(ref, q, k, lengths, kernels=False, **kw)
        res["flips"] += int((got.kept_blocks != want.kept_blocks).sum())
        res["kept_blocks"] += int(want.kept_blocks.sum())
        res["walk_max_rel"] = max(res["walk_max_rel"], rel_diff(got.walk, want.walk))
        res["sigma_max_rel"] = max(res["sigma_max_rel"], rel_diff(dst.sigma, ref.sigma))
        res["pages_equal"] &= bool(torch.equal(got.pages, want.pages) and torch.equal(got.counts, want.counts))
        keep = ad.kept_token_mask(want, n_keys, cfg.block_size, lengths)
        out_ref = authors.masked_attention(q[:, :, None], k, v, keep[:, None], d ** -0.5, torch.float32)[:, :, 0]
        out, _ = sparse_decode_triton(q, k, v, got.pages[:, None].expand(b, k.shape[1], -1),
                                      got.counts[:, None].expand(b, k.shape[1]), page_size=cfg.block_size,
                                      lengths=lengths, sink=prefix, sink_lengths=got.window_tokens)
        res["out_max_abs"] = max(res["out_max_abs"], float((out.float() - out_ref).abs().max()))
        own = ad.kept_token_mask(got, n_keys, cfg.block_size, lengths)  # the attention alone: over the path's keys
        out_own = authors.masked_attention(q[:, :, None], k, v, own[:, None], d ** -0.5, torch.float32)[:, :, 0]
        res["out_own_max_abs"] = max(res["out_own_max_abs"], float((out.float() - out_own).abs().max()))
    return res


def prompt_state(m, q, k, v, n: int) -> SketchWalkState:
    """Each row's prompt of ``n − 1`` tokens recorded alone, the rows stacked (as the runtime does)."""
    rows = []
    for r in range(q.shape[0]):
        st = m.new_state()
        m.prefill(q[r:r + 1, :, :n - 1], k[r:r + 1, :, :n - 1], v[r:r + 1, :, :n - 1], scale=None, state=st,
                  sparse=False)
        rows.append(st.authors)
    return SketchWalkState(authors=rows[0] if len(rows) == 1 else type(rows[0]).stack_rows(rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", default="sketchwalk:sink=0.01,window=0.02,kblocks_frac=0.0625")
    ap.add_argument("--paths", default="registers,chunked,registers-bf16,registers-fp16,registers-i128-w8,"
                                       "registers-bf16-i128-w8",
                    help="the step's second half: comma-separated WalkPath names (module docstring)")
    ap.add_argument("--check-steps", type=int, default=8, help="steps of each path's check against the torch step")
    ap.add_argument("--check", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes, no timing")
    args = ap.parse_args()
    t0 = time.time()
    check = args.check
    dev = "cpu" if check else "cuda"
    n, b = (600, 2) if check else (args.n, args.batch)
    hq, hkv, d = (8, 2, 64) if check else (32, 8, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, hq, n, d, device=dev, generator=g).bfloat16()
    k = torch.randn(b, hkv, n, d, device=dev, generator=g).bfloat16()
    v = torch.randn(b, hkv, n, d, device=dev, generator=g).bfloat16()
    m = kvsieve.method(args.spec + (",block_size=16,backend=triton" if check else ""))
    cfg = m.config
    paths = {name: walk_path(name) for name in args.paths.split(",")}
    steps = min(args.check_steps, n - 2)
    check_layer = prompt_state(m, q, k, v, n - steps).authors  # (a prompt of n − steps − 1 tokens)
    state = prompt_state(m, q, k, v, n)
    del q
    qd = torch.randn(b, hq, d, device=dev, generator=g).bfloat16()
    lengths = torch.full((b,), n, device=dev, dtype=torch.int32)
    ctx = CallContext(capacity=n, count_reads=False)
    res = {"n": n, "batch": b, "spec": m.spec, "device": "cpu (interpreter)" if check else torch.cuda.get_device_name(),
           "rows": {}, "paths": {}}
    default = aw.PATH
    try:
        for i, (name, path) in enumerate(paths.items()):
            aw.set_path(path)
            res["paths"][name] = {"path": {**dataclasses.asdict(path), "walk_dtype": str(path.walk_dtype)},
                                  "check": check_path(m, check_layer, hq, k, v, n, steps, g)}
            st = state if i == 0 else SketchWalkState(authors=state.authors)

            def step(st=st):
                return m.decode(qd, k, v, lengths=lengths, state=st, context=ctx, check_finite=False)[0]

            _, stats = m.decode(qd, k, v, lengths=lengths, state=st, context=CallContext(capacity=n))
            res["paths"][name].update(density=float(stats.density), block_density=float(stats["block_density"]),
                                      blocks_kept=float(stats["blocks_kept"]), selection=stats.extra["selection"],
                                      backend=stats.backend)
            dispatched = count_dispatched(step)
            res["paths"][name]["step_dispatch"] = {key: dispatched[key] for key in
                                                   ("triton_launches", "torch_ops", "host_reads", "ops")}
            if not check:
                time_on_gpu(res, cfg, st, step, qd, k, v, lengths, n, b, name, first=i == 0)
    finally:
        aw.set_path(default)
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(res, indent=2))
    (out / "decode.md").write_text(markdown(res))
    print(json.dumps(res, indent=2))


def markdown(res) -> str:
    """The paths' checks and times, and the other rows, as tables."""
    lines = [f"# Sketch&Walk authors' decode step, {res['n']} tokens, batch {res['batch']} ({res['device']})", "",
             f"spec `{res['spec']}`", "",
             "| path | µs (median) | flips / kept | walk max rel | σ max rel | pages equal | out max abs (own keys) "
             "| launches |", "|---|---|---|---|---|---|---|---|"]
    for name, p in res["paths"].items():
        c = p["check"]
        row = res["rows"].get(f"sketchwalk_step[{name}]", {})
        us = f"{row['median_us']:.1f}" if row else "-"
        lines.append(f"| {name} | {us} | {c['flips']} / {c['kept_blocks']} | {c['walk_max_rel']:.2e} | "
                     f"{c['sigma_max_rel']:.2e} | {c['pages_equal']} | "
                     f"{c['out_max_abs']:.2e} ({c['out_own_max_abs']:.2e}) | "
                     f"{p['step_dispatch']['triton_launches']} |")
    lines += ["", "| row | µs (median) |", "|---|---|"]
    lines += [f"| {name} | {row['median_us']:.1f} |" for name, row in res["rows"].items()]
    for name in res["paths"]:
        kernels = res["rows"].get(f"sketchwalk_step[{name}]", {}).get("kernels_us") or {}
        if kernels:
            lines += ["", f"kernels of `{name}` (µs):", "", "| kernel | µs |", "|---|---|"]
            lines += [f"| {k} | {v:.1f} |" for k, v in kernels.items()]
    return "\n".join(lines) + "\n"


def time_on_gpu(res, cfg, state, step, qd, k, v, lengths, n, b, name: str, *, first: bool) -> None:
    """The timed rows (module docstring) into ``res``: the path's step, and the other rows with the first path."""
    from kvsieve.bench.decode import load_flashinfer
    from kvsieve.bench.timing import ColdL2Timer, count_launches
    from kvsieve.kernels.shared.dense import dense_decode_triton

    hkv = k.shape[1]
    timer = ColdL2Timer()
    rows = res["rows"]
    row = {**timer.time_graph_us(step), "launches": count_launches(step), "kernels_us": timer.kernel_breakdown(step)}
    rows[f"sketchwalk_step[{name}]"] = row
    if not first:
        return
    rows["sketchwalk_step"] = row
    sel = state.authors_device.last_step
    pages, counts = sel.pages, sel.counts
    prefix = authors.reserved(cfg.window, n, cfg.block_size, -(-n // cfg.block_size))[0]
    window_tokens = sel.window_tokens.to(torch.int32)
    res["max_pages"] = int(pages.shape[1])

    def attention():
        return sparse_decode_triton(qd, k, v, pages[:, None].expand(b, hkv, -1), counts[:, None].expand(b, hkv),
                                    page_size=cfg.block_size, lengths=lengths, sink=prefix,
                                    sink_lengths=window_tokens)[0]

    rows["sketchwalk_attention_only"] = {**timer.time_graph_us(attention), "launches": count_launches(attention)}
    rows["dense_triton"] = timer.time_graph_us(lambda: dense_decode_triton(qd, k, v, lengths, qd.shape[-1] ** -0.5))
    fi = load_flashinfer()
    if not isinstance(fi, Exception) and b == 1:
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        rows["flashinfer"] = timer.time_graph_us(lambda: fi.single_decode_with_kv_cache(qd[0], kn, vn, kv_layout="NHD"))
    else:
        res["flashinfer_note"] = str(fi) if isinstance(fi, Exception) else "batch > 1: not run"
    base = rows.get("flashinfer", rows["dense_triton"])["median_us"]
    for r in rows.values():
        r["speedup_vs_flashinfer_or_dense"] = base / r["median_us"]
    res["selection_share"] = 1 - rows["sketchwalk_attention_only"]["median_us"] / row["median_us"]


if __name__ == "__main__":
    main()
