"""Sketch&Walk's prefill (``variant=authors``, the default) on the GPU: one layer's attention over the kept keys
against SDPA's causal attention on the same q/k/v, the selection's share, the density.

For each context N (default 64k and 128k tokens), Llama-3.1-8B heads (32 query heads, 8 KV heads, d 128),
bf16, i.i.d. Gaussian q/k/v, one layer, 64-key blocks, the authors' parameters (the method's defaults):

- ``sdpa``: ``scaled_dot_product_attention(..., is_causal=True)`` on the K/V heads repeated to the query heads
  (torch's choice of kernel) and with ``enable_gqa=True`` on the flash kernel: the faster is the baseline (the
  row names it and keeps both times);
- the selection's steps, as the method runs them on the device: ``sketch+scores`` (block sums, the Hadamard
  sketch, the per-head block softmaxes summed: the block matrix A), ``walk`` (W ← (1 − β)A + βWA, ``degree``
  times), ``quantile`` (the thresholds and kept blocks), ``lists`` (full and partial key blocks per query block);
- the attention over the kept keys with each backend (``--backends``: ``triton``, the default on CUDA, at its
  default launch settings and at each other ``--tiles`` entry, ``triton@<tiles>``; and ``flex``, FlexAttention,
  compiled per shape: about 20-40 s more per context);
- ``method``: the whole ``SketchWalk.prefill`` of one sparse layer (selection, attention, state for decode).

Reported: median ms of ``--iters`` calls after warm-up (CUDA events), speedups vs SDPA (attention alone, and
selection + attention), the selection's share of the sparse prefill, the prefill density (keys read / causal
pairs) and block density (key blocks read / causal blocks) from the method's stats, and ``1 / density``, the
speedup an attention as efficient per key as SDPA's would reach. Writes ``authors_prefill.json`` into OUT_DIR.

    python benchmarks/sketchwalk_prefill/authors.py OUT_DIR [--contexts 65536 131072] [--backends triton flex]

About 60 s on an H100 with the Triton kernel alone (two launch settings, each compiled once).
Off CUDA (tests: tiny shapes under ``TRITON_INTERPRET=1``) it runs every step once and checks the kernel's
output against the token-mask reference.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.kernels.shared.block_sparse_triton import launch_config
from kvsieve.kernels.sketchwalk.authors_prefill import (
    authors_block_lists,
    authors_prefill_flex,
    authors_prefill_triton,
)
from kvsieve.methods.sketchwalk import SketchWalkState, WalkState, authors
from kvsieve.methods.sketchwalk import authors_prefill as device_prefill


def timed(fn, iters: int, warmup: int, cuda: bool) -> tuple[float, object]:
    """Median ms of ``iters`` calls of ``fn`` after ``warmup`` ones, and its last result."""
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), out


def sdpa_variants(q, k, v) -> dict:
    """SDPA causal two ways: on K/V heads repeated to the query heads (what transformers' SDPA path runs when it
    repeats them; torch picks the kernel) and with ``enable_gqa=True`` on the flash kernel alone (never the math
    fallback, whose ``[N, N]`` scores would not fit)."""
    f = torch.nn.functional.scaled_dot_product_attention
    group = q.shape[1] // k.shape[1]
    kr, vr = (t.repeat_interleave(group, dim=1) for t in (k, v))

    def gqa():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return f(q, k, v, is_causal=True, enable_gqa=True)

    return {"repeated_kv": lambda: f(q, kr, vr, is_causal=True), "enable_gqa_flash": gqa}


def run_context(n_tok: int, args, device: str, log) -> dict:
    cuda = device == "cuda"
    method = kvsieve.method("sketchwalk")
    cfg = method.config
    bs = cfg.block_size
    g = torch.Generator(device=device).manual_seed(n_tok)
    dtype = torch.bfloat16 if cuda else torch.float32
    q = torch.randn(1, args.heads, n_tok, args.head_dim, device=device, generator=g).to(dtype)
    k = torch.randn(1, args.kv_heads, n_tok, args.head_dim, device=device, generator=g).to(dtype)
    v = torch.randn(1, args.kv_heads, n_tok, args.head_dim, device=device, generator=g).to(dtype)
    scale = args.head_dim ** -0.5
    iters, warmup = (args.iters, 2) if cuda else (1, 0)
    row: dict = {"n": n_tok, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                 "dtype": str(dtype).replace("torch.", ""), "block_size": bs}
    if cuda:  # the baseline: the faster of the two SDPA calls
        for name, fn in sdpa_variants(q, k, v).items():
            try:
                row[f"sdpa_{name}_ms"], _ = timed(fn, iters, warmup, cuda)
            except RuntimeError as exc:
                row[f"sdpa_{name}_error"] = str(exc)[:200]
        timings = {key[5:-3]: val for key, val in row.items() if key.startswith("sdpa_") and key.endswith("_ms")}
        row["sdpa"] = min(timings, key=timings.get)
        row["sdpa_ms"] = timings[row["sdpa"]]
    phi = authors.sketch_matrix(args.head_dim, cfg.hadamard_dim, 0, device=device)
    steps = {}
    steps["sketch+scores"], a = timed(lambda: device_prefill.block_matrix(q, k, phi, bs, causal=cfg.causal,
                                                                          dtype=torch.float32), iters, warmup, cuda)
    steps["walk"], w = timed(lambda: authors.damped_walk(a, a, a, cfg.walk_damping, cfg.degree), iters, warmup, cuda)
    steps["quantile"], sel = timed(lambda: authors.prefill_selection(
        w, n_tok, block_size=bs, sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac,
        dense_last_blocks=cfg.dense_last_blocks), iters, warmup, cuda)
    steps["lists"], lists = timed(lambda: authors_block_lists(sel.blocks, sel.window_tokens, n_tokens=n_tok,
                                                              block_size=bs), iters, warmup, cuda)
    row["selection_ms"] = steps
    selection = sum(steps.values())
    row["selection_total_ms"] = selection
    kernels = {"flex": authors_prefill_flex}
    for tiles in args.tiles:  # the first: the kernel's default launch settings
        name = "triton" if tiles == args.tiles[0] else f"triton@{tiles}"
        kernels[name] = functools.partial(authors_prefill_triton, tiles=tuple(int(x) for x in tiles.split("x")))
    names = [b for b in kernels if b.split("@")[0] in args.backends]
    outs = {}
    for backend in names:
        t0 = time.perf_counter()
        kernels[backend](q, k, v, lists, scale=scale)  # compiles
        if cuda:
            torch.cuda.synchronize()
        row[f"{backend}_compile_s"] = time.perf_counter() - t0
        ms, outs[backend] = timed(lambda b=backend: kernels[b](q, k, v, lists, scale=scale), iters, 0, cuda)
        row[f"{backend}_ms"] = ms
        row[f"{backend}_share_selection"] = selection / (selection + ms)
        if cuda:
            row[f"{backend}_vs_sdpa"] = row["sdpa_ms"] / ms
            row[f"{backend}_with_selection_vs_sdpa"] = row["sdpa_ms"] / (ms + selection)
    if not cuda:  # the tools' test: the kernel against the token-mask reference
        ref, _, _ = authors.prefill_attention(q, k, v, sel, block_size=bs, scale=scale, dtype=torch.float32)
        for backend, out in outs.items():
            torch.testing.assert_close(out.float(), ref, atol=1e-4, rtol=1e-4, msg=f"{backend} vs the reference")

    def whole():
        return method.prefill(q, k, v, scale=scale, state=SketchWalkState(), context=CallContext(forward=WalkState()),
                              sparse=True)

    row["method_ms"], (_, stats) = timed(whole, iters, warmup, cuda)
    row.update(method_backend=stats.backend, density=stats.density, block_density=stats["block_density"],
               ideal_speedup=1 / stats.density)
    if cuda:
        row["method_vs_sdpa"] = row["sdpa_ms"] / row["method_ms"]
    log(line(row, names))
    return row


def line(row: dict, backends) -> str:
    parts = [f"N={row['n']}: density {row['density']:.3f} (blocks {row['block_density']:.3f}, ideal "
             f"{row['ideal_speedup']:.2f}x)"]
    if "sdpa_ms" in row:
        parts.append(f"sdpa {row['sdpa_ms']:.1f} ms")
    sel = " + ".join(f"{k} {v:.2f}" for k, v in row["selection_ms"].items())
    parts.append(f"selection {row['selection_total_ms']:.2f} ms ({sel})")
    for b in backends:
        s = f"{b} {row[f'{b}_ms']:.1f} ms"
        if "sdpa_ms" in row:
            s += (f" = {row[f'{b}_vs_sdpa']:.2f}x sdpa, {row[f'{b}_with_selection_vs_sdpa']:.2f}x with the selection "
                  f"(its share {row[f'{b}_share_selection']:.1%})")
        parts.append(s)
    parts.append(f"method {row['method_ms']:.1f} ms ({row['method_backend']})"
                 + (f" = {row['method_vs_sdpa']:.2f}x sdpa" if "method_vs_sdpa" in row else ""))
    return "; ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--backends", nargs="+", choices=["triton", "flex"], default=["triton"])
    p.add_argument("--tiles", nargs="+", default=None,
                   help="Triton launch settings block_m x block_n x warps x stages, the first as 'triton' (default: "
                        "the kernel's launch_config, then 128x64x8x2, which does not spill)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    if args.tiles is None:
        m, n, warps, stages = launch_config(args.heads // args.kv_heads, kvsieve.method("sketchwalk").config.block_size,
                                            args.head_dim)
        args.tiles = [f"{m}x{n}x{warps}x{stages}"] + (["128x64x8x2"] if m != 128 else [])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = [run_context(n, args, device, print) for n in args.contexts]
    result = {"kind": "sketchwalk-authors-prefill", "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu", "torch": torch.__version__, "config": kvsieve.method("sketchwalk").spec,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows,
              "wall_s": time.perf_counter() - t0}
    (args.out_dir / "authors_prefill.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out_dir / 'authors_prefill.json'} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
