"""Sketch&Walk decode on the GPU: one layer's decode step through the method, against its attention alone and
FlashInfer / SDPA (issue 17 §3).

Llama-3.1-8B heads (32/8/128), bf16, batch 1, at 32k and 128k, CUDA graphs, cold L2 (``ColdL2Timer``):

- ``method``: ``kvsieve.method("sketchwalk:density=ρ,...").decode`` captured with its state (block sums,
  sketches, cached Ã rows) kept, as the runtime would run it: the block update, the token's Ã row, the
  walk step (one layer: one-hop), the top-k and the weighted sparse kernel over the chosen blocks;
- ``attention``: the weighted sparse kernel alone over the same blocks (``sparse_decode_triton``, pages of
  ``block_size`` keys);
- ``flashinfer`` (if importable) and ``sdpa`` dense decode.

    python benchmarks/sketchwalk/bench_decode.py --out OUT [--contexts 32768,131072] [--densities 0.05,0.1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import kvsieve  # noqa: E402
from kvsieve.bench.timing import ColdL2Timer  # noqa: E402
from kvsieve.kernels.sparse.weighted_triton import sparse_decode_triton  # noqa: E402

HQ, HKV, D = 32, 8, 128


def bench_context(n: int, args, timer, flashinfer, gen) -> list[dict]:
    rows = []
    q = torch.randn(1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(1, HKV, n, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(1, HKV, n, D, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.tensor([n], device="cuda", dtype=torch.int32)

    def record(variant, fn, density=None, **more):
        t = timer.time_graph_us(fn, iters=args.iters)
        rows.append({"n": n, "variant": variant, "density": density, "median_us": round(t["median_us"], 2),
                     **more})
        print(rows[-1], flush=True)

    if flashinfer is not None:
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        record("flashinfer", lambda: flashinfer.single_decode_with_kv_cache(q[0], kn, vn, kv_layout="NHD"))
    record("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
    for density in (float(x) for x in args.densities.split(",")):
        m = kvsieve.method(f"sketchwalk:density={density},block_size={args.block_size},walk=one-hop")
        state = {}
        _, stats = m.decode(q, k, v, lengths=lens, state=state, check_finite=False)
        blocks = stats.blocks_kept
        record("method", lambda m=m, state=state: m.decode(q, k, v, lengths=lens, state=state,
                                                           check_finite=False),
               density, blocks_kept=blocks, backend=stats.backend)
        kmax = int(round(blocks))
        pages = torch.sort(torch.randperm(n // args.block_size, device="cuda")[:kmax]).values
        pages = pages.to(torch.int32)[None, None].expand(1, HKV, kmax).contiguous()
        counts = torch.full((1, HKV), kmax, device="cuda", dtype=torch.int32)
        record("attention", lambda pages=pages, counts=counts: sparse_decode_triton(
            q, k, v, pages, counts, page_size=args.block_size, lengths=lens), density, blocks_kept=kmax)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--densities", default="0.05,0.1")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    timer = ColdL2Timer()
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - optional anchor
        flashinfer = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in (int(x) for x in args.contexts.split(",")):
        rows += bench_context(n, args, timer, flashinfer, gen)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python benchmarks/sketchwalk/bench_decode.py " + " ".join(argv or sys.argv[1:]),
            "shapes": f"Hq={HQ}, Hkv={HKV}, d={D}, bf16, batch 1, block {args.block_size}",
            "protocol": "CUDA graph replays, cold L2, CUDA events, median"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sketchwalk_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Sketch&Walk decode step ({meta['device']}, {meta['date']})", "", f"`{meta['command']}`; "
             f"{meta['shapes']}; {meta['protocol']}.", "",
             "| N | variant | ρ | blocks kept | µs | vs FlashInfer | vs SDPA |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        at = {x["variant"]: x["median_us"] for x in rows if x["n"] == r["n"] and x["density"] is None}
        ratio = {b: f"{at[b] / r['median_us']:.2f}×" if b in at else "–" for b in ("flashinfer", "sdpa")}
        lines.append(f"| {r['n']} | {r['variant']} | {r['density'] or ''} | {r.get('blocks_kept', '')} | "
                     f"{r['median_us']} | {ratio['flashinfer']} | {ratio['sdpa']} |")
    (args.out / "sketchwalk_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
