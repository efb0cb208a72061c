"""Does reading a subset of K's features save time? (issue 19 §4)

Bernoulli qKᵀ reads, per KV head, the K features its draws kept (an access rate ρ of d). This
benchmark times the score stage ``scale · q_est Kᵀ`` for the G query heads of each KV head over
those features only, Llama-3.1-8B shapes (Hq = 32, Hkv = 8, d = 128, bf16, batch 1), at several ρ
and contexts, in one run, cold L2 (``kvsieve.bench.timing``), CUDA events, medians:

- ``row``: K in the cache layout ``[Hkv, N, d]``; the kernel loads each ``[keys, d]`` tile once,
  masked to the kept features (the hardware fetches only sectors with an active lane). A 32-byte
  sector holds 16 features of one key, so a random subset touches ``1 − (1 − ρ)^16`` of the
  sectors: expect no saving unless ρ is small.
- ``row-aligned``: the same kernel with the subset made of whole 16-feature (sector) blocks, what a
  block-structured draw would read in the row layout.
- ``feature-major``: ``kvsieve.kernels.bernoulli.feature_major`` over the copy ``[Hkv, d, N]``:
  each kept feature is a contiguous run of N values; bytes read = ρ of K.
- ``dense-row`` / ``dense-feature-major``: all features (ρ = 1) in each layout.
- ``flashinfer`` (full decode, K and V; skipped with a note if not importable) and ``sdpa`` (torch
  SDPA decode, K and V): the anchors a full method is set against.
- ``pipeline-mean-group-B{4,8}``: the whole score stage as the method runs it on the device: the
  mean-group draws (torch ops), ``compact_features``, the feature-major kernel.
- ``append-row`` / ``append-feature-major``: writing one new key into each layout (the copy's
  maintenance cost per decode step).

    python docs/results/studies/bernoulli/feature_read.py --out OUT_DIR [--contexts 32768,131072]

Writes OUT_DIR/feature_read.json, .md and .png; first checks both score kernels against the
float64 reference. ``--smoke`` runs every path once on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvsieve.bench.timing import ColdL2Timer  # noqa: E402
from kvsieve.kernels.bernoulli.feature_major import (  # noqa: E402
    FEATURE_BLOCK,
    append_feature_major,
    compact_features,
    feature_major_scores,
    feature_major_scores_reference,
    to_feature_major,
)
from kvsieve.kernels.bernoulli.reference import mean_group_query  # noqa: E402
from kvsieve.kernels.shared.triton_utils import group_block  # noqa: E402

HQ, HKV, D = 32, 8, 128
DEVICE = "cuda"


class _SmokeTimer:
    """CPU stand-in for ColdL2Timer under ``--smoke`` (TRITON_INTERPRET=1): runs each call once."""

    def time_us(self, fn, iters=1):
        import time

        t = time.perf_counter()
        fn()
        us = (time.perf_counter() - t) * 1e6
        return {"median_us": us, "min_us": us, "max_us": us}
RHOS = (0.25, 0.5, 0.73, 0.85, 1.0)


@triton.jit
def _row_masked_scores_kernel(q_ptr, k_ptr, read_ptr, out_ptr, n_keys, scale,
                              G: tl.constexpr, G_BLOCK: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores with K in the row layout ``[Hkv, N, D]`` (batch 1): one coalesced load of each
    ``[BLOCK_N, D]`` tile masked to the read features, so the memory system fetches only the
    32-byte sectors that hold at least one of them."""
    kvh = tl.program_id(0)
    nb = tl.program_id(1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = offs_n < n_keys
    offs_g = tl.arange(0, G_BLOCK)
    head_ok = offs_g < G
    offs_d = tl.arange(0, D)
    f_ok = tl.load(read_ptr + kvh * D + offs_d) != 0
    k = tl.load(k_ptr + kvh.to(tl.int64) * n_keys * D + offs_n[:, None].to(tl.int64) * D + offs_d[None, :],
                mask=key_ok[:, None] & f_ok[None, :], other=0.0)  # [BLOCK_N, D]
    qv = tl.load(q_ptr + (kvh * G + offs_g[:, None]) * D + offs_d[None, :], mask=head_ok[:, None], other=0.0)
    acc = tl.dot(qv.to(tl.float32), tl.trans(k).to(tl.float32))
    tl.store(out_ptr + (kvh * G + offs_g[:, None]) * n_keys + offs_n[None, :], acc * scale,
             mask=head_ok[:, None] & key_ok[None, :])


def row_masked_scores(q_est, k, read, scale, out, block_keys=64):
    """``q_est [Hq, D]`` fp32 (zero off the read features), ``k [Hkv, N, D]``, ``read [Hkv, D]`` -> ``out [Hq, N]``."""
    hkv, n, d = k.shape
    g = q_est.shape[0] // hkv
    _row_masked_scores_kernel[(hkv, triton.cdiv(n, block_keys))](
        q_est, k, read, out, n, scale, G=g, G_BLOCK=group_block(g), D=d, BLOCK_N=block_keys, num_warps=4)
    return out


def feature_sets(rho: float, aligned: bool, gen: torch.Generator) -> torch.Tensor:
    """``read [Hkv, D]``: round(ρ·D) features per KV head, random or as whole 16-feature blocks."""
    count = max(1, round(rho * D))
    read = torch.zeros(HKV, D, dtype=torch.bool)
    for h in range(HKV):
        if aligned:
            blocks = max(1, round(count / FEATURE_BLOCK))
            chosen = torch.randperm(D // FEATURE_BLOCK, generator=gen)[:blocks]
            for blk in chosen.tolist():
                read[h, blk * FEATURE_BLOCK:(blk + 1) * FEATURE_BLOCK] = True
        else:
            read[h, torch.randperm(D, generator=gen)[:count]] = True
    return read


def check(n: int, gen: torch.Generator) -> dict:
    """Both score kernels against the float64 reference on one case (bf16 K, mean-group-like q_est)."""
    q = torch.randn(1, HQ, D, generator=gen)
    k = torch.randn(1, HKV, n, D, generator=gen).to(torch.bfloat16)
    read = feature_sets(0.5, False, gen)
    q_est = (q.view(1, HKV, HQ // HKV, D) * read[None, :, None, :]).view(1, HQ, D)
    idx, nf = compact_features(read[None])
    q_est, k, idx, nf = q_est.to(DEVICE), k.to(DEVICE), idx.to(DEVICE), nf.to(DEVICE)
    lengths = torch.tensor([n], device=DEVICE)
    kt = to_feature_major(k)
    ref = feature_major_scores_reference(q_est, kt, idx, nf, lengths, D ** -0.5)
    fm = feature_major_scores(q_est, kt, idx, nf, lengths, D ** -0.5)
    row = row_masked_scores(q_est[0].contiguous(), k[0].contiguous(), read.to(DEVICE).to(torch.int8), D ** -0.5,
                            torch.empty(HQ, n, device=DEVICE))
    scale = float(ref.abs().max())
    return {"n": n, "feature_major_max_rel_err": float((fm.double() - ref).abs().max()) / scale,
            "row_max_rel_err": float((row.double() - ref[0]).abs().max()) / scale}


def score_pipeline(qg, draws, gen, kt, lengths, scale, out):
    """The score stage as the method runs it on the device: mean-group draws (torch ops),
    compaction, the feature-major kernel."""
    q_est, read = mean_group_query(qg, draws, generator=gen, check_values=False)
    idx, nf = compact_features(read)
    return feature_major_scores(q_est.view(1, HQ, D), kt, idx, nf, lengths, scale, out=out)


def time_context(n, rhos, gen, timer, iters, flashinfer) -> list[dict]:
    q = torch.randn(HQ, D, generator=gen).to(DEVICE).to(torch.bfloat16)
    k = torch.randn(HKV, n, D, generator=gen).to(DEVICE).to(torch.bfloat16)
    v = torch.randn(HKV, n, D, generator=gen).to(DEVICE).to(torch.bfloat16)
    kt = to_feature_major(k[None])
    lengths = torch.tensor([n], device=DEVICE)
    out = torch.empty(1, HQ, n, device=DEVICE)
    scale = D ** -0.5
    k_bytes = k.numel() * k.element_size()
    rows = []

    def record(name, rho, call, bytes_read):
        t = timer.time_us(call, iters=iters)
        rows.append({"n": n, "variant": name, "rho": rho, "median_us": round(t["median_us"], 2),
                     "min_us": round(t["min_us"], 2), "bytes": int(bytes_read),
                     "gb_per_s": round(bytes_read / t["median_us"] / 1e3, 1)})
        print(rows[-1], flush=True)

    for rho in rhos:
        for aligned in (False, True):
            read = feature_sets(rho, aligned, gen).to(DEVICE)
            q_est = (q.float().view(HKV, HQ // HKV, D) * read[:, None, :]).view(HQ, D).contiguous()
            idx, nf = compact_features(read)
            kept = int(nf.sum())
            sectors = int(read.view(HKV, D // FEATURE_BLOCK, FEATURE_BLOCK).any(-1).sum())
            row_bytes = k_bytes * sectors / (HKV * D // FEATURE_BLOCK)
            record("row-aligned" if aligned else "row", kept / (HKV * D),
                   partial(row_masked_scores, q_est, k, read.to(torch.int8), scale, out[0]), row_bytes)
            if not aligned:
                record("feature-major", kept / (HKV * D),
                       partial(feature_major_scores, q_est[None], kt, idx[None], nf[None], lengths, scale, out=out),
                       k_bytes * kept / (HKV * D))
    # ρ here is whatever mean-group draws give on Gaussian queries (high: their m is flat).
    qg = q.float().view(1, HKV, HQ // HKV, D)
    for draws in (4, 8):
        dev_gen = torch.Generator(device=DEVICE).manual_seed(draws)
        _, read = mean_group_query(qg, draws, generator=dev_gen, check_values=False)
        rho = float(read.double().mean())
        record(f"pipeline-mean-group-B{draws}", rho,
               partial(score_pipeline, qg, draws, dev_gen, kt, lengths, scale, out), k_bytes * rho)
    all_read = torch.ones(HKV, D, dtype=torch.bool, device=DEVICE)
    idx, nf = compact_features(all_read)
    qf = q.float().contiguous()
    record("dense-row", 1.0, partial(row_masked_scores, qf, k, all_read.to(torch.int8), scale, out[0]), k_bytes)
    record("dense-feature-major", 1.0,
           partial(feature_major_scores, qf[None], kt, idx[None], nf[None], lengths, scale, out=out), k_bytes)
    record("sdpa", None, partial(torch.nn.functional.scaled_dot_product_attention, q[None, :, None, :], k[None],
                                 v[None], enable_gqa=True), 2 * k_bytes)
    if flashinfer is not None:
        kn, vn = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
        record("flashinfer", None, partial(flashinfer.single_decode_with_kv_cache, q, kn, vn, kv_layout="NHD"),
               2 * k_bytes)
    k_new = torch.randn(1, HKV, D, device=DEVICE).to(torch.bfloat16)
    pos = torch.tensor([n - 1], device=DEVICE)
    record("append-row", None, partial(k[None].index_copy_, 2, pos, k_new[:, :, None, :]), HKV * D * 2)
    record("append-feature-major", None, partial(append_feature_major, kt, k_new, pos), HKV * D * 2)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--rhos", default=",".join(map(str, RHOS)))
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--smoke", action="store_true",
                    help="run every code path once on the CPU (needs TRITON_INTERPRET=1; tiny contexts; no timing)")
    args = ap.parse_args(argv)
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
        args.contexts, args.iters = "256", 1
    contexts = [int(x) for x in args.contexts.split(",")]
    rhos = [float(x) for x in args.rhos.split(",")]
    gen = torch.Generator().manual_seed(0)
    timer = _SmokeTimer() if args.smoke else ColdL2Timer()
    notes = []
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - optional
        flashinfer = None
        notes.append(f"flashinfer not importable ({type(e).__name__}: {e}); its rows are absent")
    checks = [check(300 if args.smoke else 4096, gen)]
    rows = []
    for n in contexts:
        rows += time_context(n, rhos, gen, timer, args.iters, flashinfer)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": "CPU smoke run (interpreter)" if args.smoke else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": "python docs/results/studies/bernoulli/feature_read.py " + " ".join(argv or sys.argv[1:]),
            "shapes": f"Hq={HQ}, Hkv={HKV}, d={D}, bf16, batch 1", "protocol": "cold L2, CUDA events, median",
            "notes": notes, "checks": checks}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "feature_read.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    write_markdown(args.out / "feature_read.md", meta, rows)
    plot(args.out / "feature_read.png", rows)
    print("wrote", args.out)


def write_markdown(path, meta, rows):
    lines = [f"# Feature-sparse K reads ({meta['device']}, {meta['date']})", "",
             f"`{meta['command']}`; {meta['shapes']}; {meta['protocol']}.", ""]
    lines += [f"- {n}" for n in meta["notes"]]
    lines += [f"- check vs float64 reference: {c}" for c in meta["checks"]]
    lines += ["", "| N | variant | ρ (features kept) | median µs | GB/s (bytes the layout must read) | vs dense-row |",
              "|---|---|---|---|---|---|"]
    for n in sorted({r["n"] for r in rows}):
        dense = next(r["median_us"] for r in rows if r["n"] == n and r["variant"] == "dense-row")
        for r in (r for r in rows if r["n"] == n):
            rho = "" if r["rho"] is None else f"{r['rho']:.3f}"
            lines.append(f"| {n} | {r['variant']} | {rho} | {r['median_us']:.1f} | {r['gb_per_s']:.0f} | "
                         f"{dense / r['median_us']:.2f}x |")
    path.write_text("\n".join(lines) + "\n")


def plot(path, rows):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ns = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 4), squeeze=False)
    for ax, n in zip(axes[0], ns, strict=True):
        for variant in ("row", "row-aligned", "feature-major"):
            pts = sorted((r["rho"], r["median_us"]) for r in rows if r["n"] == n and r["variant"] == variant)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=variant)
        for variant, style in (("dense-row", "--"), ("flashinfer", ":"), ("sdpa", "-.")):
            t = [r["median_us"] for r in rows if r["n"] == n and r["variant"] == variant]
            if t:
                ax.axhline(t[0], ls=style, color="gray", label=variant)
        ax.set_xlabel("K features kept ρ")
        ax.set_ylabel("µs (cold L2, median)")
        ax.set_title(f"score stage, N = {n}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
