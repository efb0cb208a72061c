"""Bernoulli K + S²ANTA-prop V, fused over a feature-major K: decode time against K access (issue 19 §4).

Llama-3.1-8B shapes (Hq = 32, Hkv = 8, d = 128, bf16, batch 1) at 32k and 128k, every call captured in
a CUDA graph and replayed cold (``ColdL2Timer.time_graph_us``: L2 flushed, CUDA events, medians):

- ``flashinfer`` and ``sdpa`` decode (the anchors), ``santa-prop`` S = 128 (row layout: reads all of
  K, the ≈1.84× FlashInfer cap that reading K sets);
- ``bernoulli-prop`` (``kernels/bernoulli/decode.py``: draws, feature-major stats, budgets, sampling)
  at B ∈ {2, 4, 8, 16} draws and three query spreads σ: queries ``z ⊙ e^{σ w}`` with one log-normal
  scale per (KV head, feature), the outlier features real queries have; σ = 0 is Gaussian (nearly
  every feature kept). The K access ρ each point reaches is measured (features listed / d), so the
  curve is time against ρ; the default model's mean-group rates (docs/methods/bernoulli.md: 55 / 78 /
  93 % at B = 4 / 8 / 16) place the paper's operating points on it;
- ``api``: ``kvsieve.method("bernoulli-qk:query=mean-group,values=santa-prop,...").decode`` in the
  runtime's form (state kept, ``count_reads=False``), which adds the per-step kT append;
- ``append-kt``: the copy's maintenance (one key per KV head) alone.

Also a check against the float64 reference at 4k, a per-kernel breakdown (torch profiler) of one point,
and the launch parameters of the stats kernel at 128k.

    python docs/results/studies/bernoulli/decode.py --out OUT_DIR [--contexts 32768,131072] [--iters 40]

``--smoke`` runs every path once on the CPU under TRITON_INTERPRET=1 (tiny shapes, no timing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))

import triton  # noqa: E402

import kvsieve  # noqa: E402
from kvsieve.bench.timing import ColdL2Timer  # noqa: E402
from kvsieve.core.rng import RandomKey  # noqa: E402
from kvsieve.kernels.bernoulli.decode import bernoulli_prop_reference, bernoulli_prop_triton  # noqa: E402
from kvsieve.kernels.bernoulli.feature_major import FeatureMajorKeys  # noqa: E402
from kvsieve.kernels.santa.decode import santa_prop_triton  # noqa: E402
from kvsieve.kernels.santa.reference import auto_tile_size  # noqa: E402

HQ, HKV, D, S = 32, 8, 128, 128
DRAWS = (2, 4, 8, 16)
SIGMAS = (0.0, 0.75, 1.25)  # σ = 0.75 gives the default model's access rates at every B (measured)
MODEL_ACCESS = {4: 0.55, 8: 0.78, 16: 0.93}  # SmolLM2-135M, mean-group, docs/methods/bernoulli.md
DEVICE = "cuda"
DTYPE = torch.bfloat16  # float16 in --smoke: the interpreter's bf16 tl.dot is wrong


class _SmokeTimer:
    def time_graph_us(self, fn, **_):
        fn()
        return {"median_us": float("nan"), "min_us": float("nan")}

    time_us = time_graph_us

    def kernel_breakdown(self, fn, **_):
        return None


def queries(sigma: float, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(HKV, 1, D, generator=gen)
    z = torch.randn(HKV, HQ // HKV, D, generator=gen)
    return (z * torch.exp(sigma * w)).reshape(1, HQ, D).to(DTYPE).to(DEVICE)


def check(gen: torch.Generator, n: int) -> dict:
    q = queries(0.75, gen)
    k = torch.randn(1, HKV, n, D, generator=gen).to(DTYPE).to(DEVICE)
    v = torch.randn(1, HKV, n, D, generator=gen).to(DTYPE).to(DEVICE)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    kt = FeatureMajorKeys().update(k, lens)
    key = RandomKey(1, (0, 3))
    out, counts, budgets, n_feat = bernoulli_prop_triton(q, kt, v, lens, D ** -0.5, 8, S, 256, key, 5,
                                                         write_counts=True)
    ref, read = bernoulli_prop_reference(q.double(), k.double(), v.double(), lens, D ** -0.5, 8, S, 256, key, 5)
    return {"n": n, "features_equal": bool(torch.equal(n_feat.long(), read.sum(-1))),
            "budget_flips": int((budgets.long() != ref.tile_budgets).sum()),
            "count_flips": int((counts.long() != ref.counts).sum()),
            "out_rel_err": float((out.double() - ref.out).norm() / ref.out.norm())}


def time_context(n: int, gen, timer, iters: int, flashinfer) -> list[dict]:
    k = torch.randn(1, HKV, n, D, generator=gen).to(DTYPE).to(DEVICE)
    v = torch.randn(1, HKV, n, D, generator=gen).to(DTYPE).to(DEVICE)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    keys = FeatureMajorKeys()
    kt = keys.update(k, lens)
    scale, tile = D ** -0.5, auto_tile_size(n)
    k_bytes = k.numel() * k.element_size()
    v_row = D * v.element_size() * HKV  # one V row of every KV head
    rows = []

    def record(variant, fn, *, rho=None, draws=None, sigma=None, bytes_read=None, **more):
        t = timer.time_graph_us(fn, iters=iters)
        row = {"n": n, "variant": variant, "draws": draws, "sigma": sigma, "rho": rho,
               "median_us": round(t["median_us"], 2), "min_us": round(t["min_us"], 2), **more}
        if bytes_read is not None:
            row["bytes"] = int(bytes_read)
            row["gb_per_s"] = round(bytes_read / t["median_us"] / 1e3, 1)
        rows.append(row)
        print(row, flush=True)

    q0 = queries(0.0, gen)
    if flashinfer is not None:
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        record("flashinfer", lambda: flashinfer.single_decode_with_kv_cache(q0[0], kn, vn, kv_layout="NHD"),
               bytes_read=2 * k_bytes)
    record("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q0[:, :, None], k, v, enable_gqa=True),
           bytes_read=2 * k_bytes)
    record("santa-prop", lambda: santa_prop_triton(q0, k, v, lens, scale, S, tile, 7), rho=1.0,
           bytes_read=k_bytes + S * v_row)
    for sigma in SIGMAS:
        q = queries(sigma, gen)
        for draws in DRAWS:
            key = RandomKey(3, (0, draws))
            _, _, _, n_feat = bernoulli_prop_triton(q, kt, v, lens, scale, draws, S, tile, key, 7)
            rho = float(n_feat.double().mean()) / D
            record("bernoulli-prop", lambda q=q, draws=draws, key=key: bernoulli_prop_triton(
                q, kt, v, lens, scale, draws, S, tile, key, 7), rho=round(rho, 4), draws=draws, sigma=sigma,
                bytes_read=k_bytes * rho + S * v_row)
    # the method as the runtime calls it: state kept (kT appended each step), no per-key counts
    for draws in (4, 8):
        m = kvsieve.method(f"bernoulli-qk:query=mean-group,values=santa-prop,budget={S},draws={draws}")
        state = {"count_reads": False, "min_length": n}
        q = queries(0.75, gen)
        record("api", lambda m=m, q=q, state=state: m.decode(q, k, v, lengths=lens, seed=RandomKey(3, (0, 1)),
                                                               state=state, check_finite=False),
               draws=draws, sigma=0.75)
    record("append-kt", lambda: keys.update(k, lens), bytes_read=HKV * D * 2 * 2)
    return rows


def tuning(gen, timer, iters: int, n: int) -> list[dict]:
    """The stats kernel's launch parameters at one point (B = 8, σ = 0.75)."""
    k = torch.randn(1, HKV, n, D, generator=gen).to(DTYPE).to(DEVICE)
    v = torch.randn(1, HKV, n, D, generator=gen).to(DTYPE).to(DEVICE)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    kt = FeatureMajorKeys().update(k, lens)
    q = queries(0.75, gen)
    key = RandomKey(3, (0, 8))
    tile = auto_tile_size(n)
    rows = []
    grid = [(bn, p, 16, 4) for bn in (64, 128, 256) for p in (264, 1056, 4224)]
    grid += [(256, 4224, 32, 4), (256, 4224, 16, 8), (256, 4224, 32, 8)]
    for block_n, programs, fb, warps in grid:
        if block_n > tile:
            continue
        t = timer.time_graph_us(lambda b=block_n, p=programs, f=fb, w=warps: bernoulli_prop_triton(
            q, kt, v, lens, D ** -0.5, 8, S, tile, key, 7, block_n=b, stats_programs=p, feature_block=f,
            stats_warps=w), iters=iters)
        rows.append({"n": n, "block_n": block_n, "stats_programs": programs, "feature_block": fb, "warps": warps,
                     "median_us": round(t["median_us"], 2)})
        print(rows[-1], flush=True)
    breakdown = timer.kernel_breakdown(lambda: bernoulli_prop_triton(q, kt, v, lens, D ** -0.5, 8, S, tile, key, 7))
    return rows, breakdown


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--smoke", action="store_true", help="every path once on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    global DEVICE, DTYPE
    if args.smoke:
        DEVICE, DTYPE = "cpu", torch.float16
        args.contexts, args.iters = "512", 1
    contexts = [int(x) for x in args.contexts.split(",")]
    gen = torch.Generator().manual_seed(0)
    timer = _SmokeTimer() if args.smoke else ColdL2Timer()
    notes = []
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - optional anchor
        flashinfer = None
        notes.append(f"flashinfer not importable ({type(e).__name__}: {e}); its rows are absent")
    checks = [check(gen, 300 if args.smoke else 4096)]
    print("check", checks, flush=True)
    rows = []
    for n in contexts:
        rows += time_context(n, gen, timer, args.iters, flashinfer)
    tune, breakdown = tuning(gen, timer, args.iters, contexts[-1])
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": "CPU smoke run (interpreter)" if args.smoke else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "command": "python docs/results/studies/bernoulli/decode.py " + " ".join(argv or sys.argv[1:]),
            "shapes": f"Hq={HQ}, Hkv={HKV}, d={D}, bf16, batch 1, S={S}",
            "protocol": "CUDA graph replays, cold L2, CUDA events, median", "notes": notes, "checks": checks,
            "model_access": MODEL_ACCESS}
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "rows": rows, "tuning": tune, "breakdown_128k_B8": breakdown}
    (args.out / "bernoulli_decode.json").write_text(json.dumps(result, indent=1) + "\n")
    write_markdown(args.out / "bernoulli_decode.md", result)
    if not args.smoke:
        plot(args.out / "bernoulli_decode.png", rows)
    print("wrote", args.out)


def write_markdown(path: Path, result: dict) -> None:
    meta, rows = result["meta"], result["rows"]
    lines = [f"# Bernoulli K + S²ANTA-prop V over a feature-major K ({meta['device']}, {meta['date']})", "",
             f"`{meta['command']}`; {meta['shapes']}; {meta['protocol']}.", "",
             f"- check vs float64 reference: {meta['checks']}", *[f"- {x}" for x in meta["notes"]], "",
             "| N | variant | B | σ | ρ (K features read) | median µs | vs FlashInfer | vs SDPA | vs santa-prop | "
             "GB/s of the bytes it must read |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["n"] for r in rows}):
        at = {r["variant"]: r["median_us"] for r in rows if r["n"] == n and r["variant"] in
              ("flashinfer", "sdpa", "santa-prop")}

        def ratio(base, us, at=at):
            return f"{at[base] / us:.2f}×" if base in at and us == us and us > 0 else "–"

        for r in (x for x in rows if x["n"] == n):
            us = r["median_us"]
            lines.append(f"| {n} | {r['variant']} | {r['draws'] or ''} | {'' if r['sigma'] is None else r['sigma']} | "
                         f"{'' if r['rho'] is None else r['rho']} | {us} | {ratio('flashinfer', us)} | "
                         f"{ratio('sdpa', us)} | {ratio('santa-prop', us)} | {r.get('gb_per_s', '')} |")
    lines += ["", "Stats-kernel launch parameters (B = 8, σ = 0.75; default 256 / 4224 / 16 / 4):", "",
              "| N | block_n | stats programs | features per step | warps | µs |", "|---|---|---|---|---|---|"]
    lines += [f"| {t['n']} | {t['block_n']} | {t['stats_programs']} | {t['feature_block']} | {t['warps']} | "
              f"{t['median_us']} |" for t in result["tuning"]]
    if result.get("breakdown_128k_B8"):
        lines += ["", "Per-kernel device µs (profiler, B = 8, σ = 0.75, last context):", ""]
        lines += [f"- {k}: {v:.1f}" for k, v in result["breakdown_128k_B8"].items()]
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len({r["n"] for r in rows}), figsize=(11, 4), squeeze=False)
    for ax, n in zip(axes[0], sorted({r["n"] for r in rows}), strict=True):
        at = {r["variant"]: r["median_us"] for r in rows if r["n"] == n}
        base = at.get("flashinfer") or at.get("sdpa")
        pts = sorted((r["rho"], base / r["median_us"], r["draws"]) for r in rows
                     if r["n"] == n and r["variant"] == "bernoulli-prop")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label="bernoulli-prop (B, σ sweep)")
        for rho, sp, b in pts:
            ax.annotate(f"B={b}", (rho, sp), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(base / at["santa-prop"], color="C1", ls="--", label="santa-prop S=128 (all of K)")
        ax.axhline(2.0, color="C3", ls=":", label="target 2.0×")
        for b, rho in MODEL_ACCESS.items():
            ax.axvline(rho, color="grey", lw=0.6)
            ax.text(rho, ax.get_ylim()[0], f" SmolLM2 B={b}", rotation=90, fontsize=7, va="bottom")
        ax.set_xlabel("K access ρ (features read / d)")
        ax.set_ylabel("speedup vs " + ("FlashInfer" if at.get("flashinfer") else "SDPA"))
        ax.set_title(f"N = {n}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
