"""Sketch&Walk prefill on one layer: block-sparse FlexAttention and Triton vs SDPA (and FlashInfer), plus the
sketch + walk + selection overhead and the method's decode step.

One layer of Llama-3.1-8B (32 query / 8 KV heads, d 128), bf16, batch 1, random q/k/v, at each
length. Timed with CUDA events and a cold L2 (``kvsieve.bench.timing.ColdL2Timer``), medians.

- ``sdpa``: ``scaled_dot_product_attention(is_causal=True)`` on K/V expanded to 32 heads (flash).
- ``flashinfer``: ``single_prefill_with_kv_cache(causal=True)`` (skipped with a note if absent).
- ``flex_sparse``: compiled FlexAttention over the Sketch&Walk selection at ``--density``, BlockMask
  prebuilt (the attention alone).
- ``selection``: head-mean + block means + SRHT sketch + ``log Â`` + ``Ã = Â^α`` + the walk GEMM
  (against a previous layer's W) + top-k selection + the BlockMask build, all on the device.
- ``sparse_layer``: selection + FlexAttention, as the method runs them (``SketchWalk.prefill``'s
  pieces without the decode-state bookkeeping).
- ``triton_sparse``: the block-sparse Triton kernel (``block_sparse_prefill_triton``: a KV head's query
  heads packed into one tile, each selected K/V block read once per KV-head group) over the same
  selection, once per ``--triton-tiles`` entry (``default`` = ``launch_config``, or ``BLOCK_MxBLOCK_N``);
  before timing, its output is compared with FlexAttention's on the same lists (``max_abs_err_vs_flex``).
- ``selection_nomask``: the selection without the BlockMask (the Triton kernel's path; the method's prefill
  selection kernels on CUDA where the tree has them, ``selection_path``), its share of the default-tile
  ``triton_sparse`` time (issue 17: at most 10 % at >= 32k keys).
- ``triton_layer``: selection (without the BlockMask, which the kernel does not need) + the Triton kernel
  at its default tiles, i.e. the method with ``prefill_backend=triton``.
- ``triton_dense`` (up to ``--dense-flex-max``): the Triton kernel with every causal block, checked
  against SDPA first (``max_abs_err_vs_sdpa``).
- ``flex_dense``: FlexAttention with every causal block (how far FlexAttention is from flash).
- ``decode_step`` (``--decode``): ``SketchWalk.decode`` of one token at the end of the context
  (incremental sketch update, walk row, selection, weighted sparse decode) vs FlashInfer's decode.

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=src python docs/results/studies/sketchwalk/bench_prefill.py OUT_DIR [--lengths 16384,65536,131072]

Writes OUT_DIR/sketchwalk_prefill.json and .md (and a PNG when matplotlib is there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--lengths", default="16384,65536,131072")
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--block-sizes", default="64,128", help="Sketch&Walk block sizes to time (64 is the paper's)")
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    p.add_argument("--dense-flex-max", type=int, default=65536, help="time flex_dense up to this length")
    p.add_argument("--triton-tiles", default="default,256x32",
                   help="Triton kernel tiles to time: 'default' (launch_config) or BLOCK_MxBLOCK_N, comma-separated")
    p.add_argument("--decode", action="store_true", help="also time one decode step of the method")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    from kvsieve.bench.timing import ColdL2Timer

    torch.backends.cuda.matmul.allow_tf32 = True  # the walk GEMM in TF32, as the spec allows
    torch._dynamo.config.cache_size_limit = 64
    args.out.mkdir(parents=True, exist_ok=True)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    lengths = [int(x) for x in args.lengths.split(",")]
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    dev = torch.device("cuda")
    timer = ColdL2Timer(dev)
    try:
        import flashinfer
    except Exception as exc:  # optional
        flashinfer, fi_note = None, f"FlashInfer not importable ({exc}); its rows are skipped"
    else:
        fi_note = f"FlashInfer {getattr(flashinfer, '__version__', '?')}"
    print(fi_note, flush=True)
    rows: list[dict] = []

    def timed(name, n, fn, iters=args.iters, **extra):
        t0 = time.perf_counter()
        try:
            r = timer.time_us(fn, warmup=3, iters=iters)
        except Exception as exc:  # one failing variant must not abort the sweep
            row = {"variant": name, "n": n, "error": f"{type(exc).__name__}: {exc}"[:300], **extra}
        else:
            row = {"variant": name, "n": n, **r, **extra}
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    for n in lengths:
        qkv = make_qkv(n, hq, hkv, d, seed=args.seed, device=dev)
        sdpa = time_dense(timed, n, qkv, flashinfer)
        for bs in block_sizes:
            time_sketchwalk(timed, n, qkv, bs, args, sdpa, flashinfer)
        del qkv
        torch.cuda.empty_cache()

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "shape": {"hq": hq, "hkv": hkv, "d": d, "dtype": "bfloat16", "batch": 1}, "flashinfer": fi_note,
            "command": " ".join(sys.argv), "timing": "CUDA events, cold L2 (ColdL2Timer), median"}
    (args.out / "sketchwalk_prefill.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "sketchwalk_prefill.md").write_text(markdown(meta, rows))
    plot(rows, args.out / "sketchwalk_prefill.png")
    print((args.out / "sketchwalk_prefill.md").read_text())


def make_qkv(n: int, hq: int, hkv: int, d: int, *, seed: int, device: torch.device,
             dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q [1, hq, n, d]``, ``k, v [1, hkv, n, d]`` from one seeded generator (the rows' inputs)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(1, hq, n, d, device=device, dtype=dtype, generator=g),
            torch.randn(1, hkv, n, d, device=device, dtype=dtype, generator=g),
            torch.randn(1, hkv, n, d, device=device, dtype=dtype, generator=g))


def sketchwalk_selection(q: torch.Tensor, k: torch.Tensor, block_size: int, density: float):
    """``(method, prev, selection)``: the Sketch&Walk method at this density and block size, a previous
    layer's walk state ``prev`` (so that the selection includes the walk GEMM), and ``selection()``, which
    runs sketch + walk + top-k and returns ``(block_mask, block_idx, block_counts)``."""
    import kvsieve
    from kvsieve.kernels.shared.block_sparse import flex_block_mask

    m = kvsieve.method(f"sketchwalk:variant=reconstruction,density={density},block_size={block_size}")
    nb = -(-q.shape[2] // block_size)
    prev = m.prefill_select(m.prefill_sketch(q, k)["a_tilde"], None)[0]

    def selection():
        a_tilde = m.prefill_sketch(q, k)["a_tilde"]
        _, idx, cnt = m.prefill_select(a_tilde, prev)
        return flex_block_mask(idx, cnt, block_size=block_size, n_tokens=nb * block_size), idx, cnt

    return m, prev, selection


def time_dense(timed, n, qkv, flashinfer) -> dict:
    """SDPA (flash, K/V expanded to the query heads) and FlashInfer's causal prefill; returns SDPA's row."""
    q, k, v = qkv
    group = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sdpa = timed("sdpa", n, lambda: torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True))
    if flashinfer is not None:
        qn, kn, vn = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
        timed("flashinfer", n, lambda: flashinfer.single_prefill_with_kv_cache(qn, kn, vn, causal=True))
    return sdpa


def time_sketchwalk(timed, n, qkv, bs, args, sdpa, flashinfer) -> None:
    from kvsieve.kernels.shared.block_sparse import block_sparse_prefill_flex, flex_block_mask

    q, k, v = qkv
    dev = q.device
    nb = -(-n // bs)
    m, prev, selection = sketchwalk_selection(q, k, bs, args.density)
    mask, idx, cnt = selection()
    kept = float(cnt.double().sum() / (nb * (nb + 1) / 2))
    extra = {"block_size": bs, "density": args.density, "block_density": kept,
             "selection_path": m.prefill_selection_path(q, nb)[0] if hasattr(m, "prefill_selection_path")
             else "reference"}
    sparse = timed("flex_sparse", n, lambda: block_sparse_prefill_flex(
        q, k, v, idx, cnt, block_size=bs, block_mask=mask), **extra)
    sel = timed("selection", n, selection, **extra)
    layer = timed("sparse_layer", n, lambda: block_sparse_prefill_flex(
        q, k, v, *selection()[1:], block_size=bs), **extra)
    for r in (sparse, layer):
        if "median_us" in r and "median_us" in sdpa:
            r["speedup_vs_sdpa"] = sdpa["median_us"] / r["median_us"]
    if "median_us" in sel and "median_us" in sparse:
        sel["share_of_sparse_attention"] = sel["median_us"] / sparse["median_us"]
    if n <= args.dense_flex_max:
        all_idx = torch.arange(nb, device=dev).expand(1, nb, nb).contiguous()
        all_cnt = torch.arange(1, nb + 1, device=dev)[None]
        dmask = flex_block_mask(all_idx, all_cnt, block_size=bs, n_tokens=nb * bs)
        timed("flex_dense", n, lambda: block_sparse_prefill_flex(
            q, k, v, all_idx, all_cnt, block_size=bs, block_mask=dmask), block_size=bs)
    time_triton(timed, n, qkv, bs, args, sdpa, m, prev, idx, cnt, extra)
    if args.decode and bs == 64:
        state = m.new_state()
        m.prefill(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], scale=None, state=state, sparse=False)
        qt = q[:, :, -1]
        lengths_t = torch.tensor([n], device=dev)

        def step():
            # a repeated call at the same length does not add the token again (see SketchWalk._decode)
            from kvsieve import CallContext

            ctx = CallContext(forward=m.new_forward_state())
            return m.decode(qt, k, v, lengths=lengths_t, state=state, context=ctx, check_finite=False)

        timed("decode_step", n, step, iters=5, **extra)
        if flashinfer is not None:
            kn, vn = (t[0].transpose(0, 1).contiguous() for t in (k, v))
            timed("flashinfer_decode", n, lambda: flashinfer.single_decode_with_kv_cache(
                qt[0], kn, vn, kv_layout="NHD"))


def time_triton(timed, n, qkv, bs, args, sdpa, m, prev, idx, cnt, extra) -> None:
    """``triton_sparse`` per tile setting and ``triton_layer``, each after a check against FlexAttention."""
    from kvsieve.kernels.shared.block_sparse import block_sparse_prefill_flex
    from kvsieve.kernels.shared.block_sparse_triton import block_sparse_prefill_triton

    q, k, v = qkv
    flex_out = block_sparse_prefill_flex(q, k, v, idx, cnt, block_size=bs)[0]

    def err_vs_flex(fn) -> dict:
        try:
            out = fn()[0]
        except Exception as exc:  # reported in the row; the timing below reports it too
            return {"check_error": f"{type(exc).__name__}: {exc}"[:300]}
        return {"max_abs_err_vs_flex": float((out.float() - flex_out.float()).abs().max())}

    default_row = None
    for tiles in args.triton_tiles.split(","):
        kw = {}
        if tiles != "default":
            block_m, block_n = (int(x) for x in tiles.split("x"))
            kw = {"block_m": block_m, "block_n": block_n}

        def run(kw=kw):
            return block_sparse_prefill_triton(q, k, v, idx, cnt, block_size=bs, **kw)

        row = timed("triton_sparse", n, run, tiles=tiles, **err_vs_flex(run), **extra)
        if "median_us" in row and "median_us" in sdpa:
            row["speedup_vs_sdpa"] = sdpa["median_us"] / row["median_us"]
        if tiles == "default":
            default_row = row

    # issue 17's measure: the selection the kernel path runs (no BlockMask) against the kernel's attention
    sel = timed("selection_nomask", n, lambda: m.prefill_select(m.prefill_sketch(q, k)["a_tilde"], prev), **extra)
    if default_row is not None and "median_us" in sel and "median_us" in default_row:
        sel["share_of_sparse_attention"] = sel["median_us"] / default_row["median_us"]

    if n <= args.dense_flex_max:  # every causal block: the kernel against SDPA
        nb = idx.shape[1]
        all_idx = torch.arange(nb, device=q.device).expand(1, nb, nb).contiguous()
        all_cnt = torch.arange(1, nb + 1, device=q.device)[None]
        group = q.shape[1] // k.shape[1]
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                                               v.repeat_interleave(group, 1), is_causal=True)

        def dense():
            return block_sparse_prefill_triton(q, k, v, all_idx, all_cnt, block_size=bs)

        err = {"max_abs_err_vs_sdpa": float((dense()[0].float() - ref.float()).abs().max())}
        del ref
        row = timed("triton_dense", n, dense, tiles="default", block_size=bs, **err)
        if "median_us" in row and "median_us" in sdpa:
            row["speedup_vs_sdpa"] = sdpa["median_us"] / row["median_us"]

    def layer():
        _, sel_idx, sel_cnt = m.prefill_select(m.prefill_sketch(q, k)["a_tilde"], prev)
        return block_sparse_prefill_triton(q, k, v, sel_idx, sel_cnt, block_size=bs)

    row = timed("triton_layer", n, layer, tiles="default", **err_vs_flex(layer), **extra)
    if "median_us" in row and "median_us" in sdpa:
        row["speedup_vs_sdpa"] = sdpa["median_us"] / row["median_us"]


def markdown(meta, rows) -> str:
    lines = [f"# Sketch&Walk prefill, one layer ({meta['device']}, {meta['date']})", "",
             f"Command: `{meta['command']}`; torch {meta['torch']}; {meta['flashinfer']}; {meta['timing']}.", "",
             "| n | variant | block | tiles | median ms | vs SDPA | block density | selection / sparse attn "
             "| max abs err vs flex |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "median_us" not in r:
            err = r.get("error", "")
            lines.append(f"| {r['n']} | {r['variant']} | {r.get('block_size', '')} | {r.get('tiles', '')} "
                         f"| error: {err} | | | | |")
            continue
        sp = f"{r['speedup_vs_sdpa']:.2f}x" if "speedup_vs_sdpa" in r else ""
        bd = f"{r['block_density']:.3f}" if "block_density" in r else ""
        sh = f"{100 * r['share_of_sparse_attention']:.1f}%" if "share_of_sparse_attention" in r else ""
        ea = r.get("check_error", "")
        for key, what in (("max_abs_err_vs_flex", ""), ("max_abs_err_vs_sdpa", " (vs SDPA)")):
            if key in r:
                ea = f"{r[key]:.2e}{what}"
        lines.append(f"| {r['n']} | {r['variant']} | {r.get('block_size', '')} | {r.get('tiles', '')} "
                     f"| {r['median_us'] / 1000:.3f} | {sp} | {bd} | {sh} | {ea} |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    series = {}
    for r in rows:
        if "median_us" in r:
            key = r["variant"] + (f" B={r['block_size']}" if "block_size" in r else "") + (
                f" {r['tiles']}" if r.get("tiles", "default") != "default" else "")
            series.setdefault(key, []).append((r["n"], r["median_us"] / 1000))
    for key, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("ms (one layer)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
