"""Sketch&Walk decode on the GPU: one layer's decode step through the method, against its attention alone and
FlashInfer / SDPA (issue 17 §3).

Llama-3.1-8B heads (32/8/128), bf16, batch 1, at 32k and 128k, CUDA graphs, cold L2 (``ColdL2Timer``). The
layer's state is that of a request whose prompt was seen (block sums, sketches, the cached Ã rows of every
completed block: random causal rows, since their values do not change the work):

- ``method-walk``: ``kvsieve.method("sketchwalk:variant=reconstruction,density=ρ").decode`` captured as a walk
  layer (the previous sparse layer's walk in the forward dict, as from layer 3 on): the fused sketch update, Ã row
  and walk GEMV over Ã's causal half, the top-k and the weighted sparse kernel over the chosen blocks;
- ``method-one-hop``: the same call as the first sparse layer of a pass (no previous walk: no GEMV);
- ``method-torch-sel``: the torch selection before the same kernel (``walk_power=matrix,alpha=1``: the
  pre-fusion path's ops, which ``matrix`` keeps) as a walk layer, for comparison;
- ``attention``: the weighted sparse kernel alone over as many blocks (``sparse_decode_triton``, pages of
  ``block_size`` keys, random blocks);
- ``flashinfer`` (if importable) and ``sdpa`` dense decode.

``launches`` counts the kernels of one eager call (torch profiler); ``--breakdown`` adds per-kernel device µs
of the method calls. Once per run the fused path is checked against ``backend=reference`` on copies of the
same state (same blocks, walk and output within bf16 tolerance); a failed check stops the run.

    python docs/results/studies/sketchwalk/bench_decode.py --out OUT [--contexts 32768,131072] [--densities 0.05,0.1]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "src"))

import kvsieve  # noqa: E402
from kvsieve import CallContext  # noqa: E402
from kvsieve.bench.timing import ColdL2Timer, count_launches  # noqa: E402
from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton  # noqa: E402
from kvsieve.methods.sketchwalk import WalkState  # noqa: E402

HQ, HKV, D = 32, 8, 128


def seen_prompt_state(m, q, k, v, lens, gen):
    """A layer state as after a prompt (history, random causal Ã rows) and a previous layer's walk
    (``[B, n_blocks]``, a row per batch row of ``q``)."""
    state = m.new_state()
    m.decode(q, k, v, lengths=lens, state=state, check_finite=False)  # allocates the state from the cache
    sk = state.sketch
    sk.a_tilde.copy_(torch.rand(sk.a_tilde.shape, device=q.device, generator=gen).tril() ** 8)
    if sk.a_hat is not None:
        sk.a_hat.copy_(torch.rand(sk.a_hat.shape, device=q.device, generator=gen).tril())
    sk.has_history = True
    n_blocks = -(-k.shape[2] // m.config.block_size)
    return state, torch.rand(q.shape[0], n_blocks, device=q.device, generator=gen)


def walk_call(m, q, k, v, lens, state, w_prev, forward=None):
    """A decode call from ``w_prev`` (None: the first walk layer); ``forward`` receives the walk."""
    forward = WalkState() if forward is None else forward

    def call():
        forward.walk, forward.hops = (None, 0) if w_prev is None else (w_prev, 1)  # as after one sparse layer
        return m.decode(q, k, v, lengths=lens, state=state, context=CallContext(forward=forward), check_finite=False)
    return call


def check_against_reference(spec, q, k, v, lens, state, w_prev) -> dict:
    """The fused path and backend=reference from copies of one state: blocks, walk, output."""
    res = {}
    for backend in ("triton", "reference"):
        m = kvsieve.method(f"{spec},backend={backend}")
        st, forward = copy.deepcopy(state), WalkState()
        out, stats = walk_call(m, q, k, v, lens, st, w_prev, forward)()
        res[backend] = (out.float(), forward.walk, stats.kv_rows_read, stats.blocks_kept,
                        stats.extra.get("selection"))
    (out, w, reads, kept, sel), (ref, ref_w, ref_reads, ref_kept, _) = res["triton"], res["reference"]
    check = {"spec": spec, "n": k.shape[2], "selection": sel, "same_reads": reads == ref_reads and kept == ref_kept,
             "out_rel_err": float((out - ref).norm() / ref.norm()),
             "walk_rel_err": float(((w - ref_w).abs() / ref_w.abs().clamp_min(1e-30)).max())}
    print("check", check, flush=True)
    if sel != "fused" or not check["same_reads"] or check["out_rel_err"] > 2e-2 or check["walk_rel_err"] > 1e-3:
        raise SystemExit(f"the fused path does not match the reference path: {check}")
    return check


def bench_context(n: int, args, timer, flashinfer, gen, checks: list) -> list[dict]:
    rows = []
    q = torch.randn(1, HQ, D, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(1, HKV, n, D, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(1, HKV, n, D, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.tensor([n], device="cuda", dtype=torch.int32)

    def record(variant, fn, density=None, **more):
        t = timer.time_graph_us(fn, iters=args.iters)
        rows.append({"n": n, "variant": variant, "density": density, "median_us": round(t["median_us"], 2),
                     **more})
        if variant.startswith("method"):
            rows[-1]["launches"] = count_launches(fn)
            if args.breakdown:
                rows[-1]["breakdown_us"] = timer.kernel_breakdown(fn)
        print(rows[-1], flush=True)

    if flashinfer is not None:
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        record("flashinfer", lambda: flashinfer.single_decode_with_kv_cache(q[0], kn, vn, kv_layout="NHD"))
    record("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True))
    for density in (float(x) for x in args.densities.split(",")):
        spec = f"sketchwalk:variant=reconstruction,density={density},block_size={args.block_size}"
        m = kvsieve.method(spec)
        state, w_prev = seen_prompt_state(m, q, k, v, lens, gen)
        if not checks:
            checks.append(check_against_reference(spec, q, k, v, lens, state, w_prev))
        _, stats = walk_call(m, q, k, v, lens, state, w_prev)()
        blocks = stats.blocks_kept
        record("method-walk", walk_call(m, q, k, v, lens, state, w_prev), density, blocks_kept=blocks,
               backend=stats.backend, selection=stats.extra.get("selection"))
        record("method-one-hop", walk_call(m, q, k, v, lens, state, None), density, blocks_kept=blocks)
        m_torch = kvsieve.method(f"{spec},walk_power=matrix,alpha=1")
        state_torch, _ = seen_prompt_state(m_torch, q, k, v, lens, gen)
        record("method-torch-sel", walk_call(m_torch, q, k, v, lens, state_torch, w_prev), density,
               blocks_kept=blocks)
        kmax = int(round(blocks))
        pages = torch.sort(torch.randperm(n // args.block_size, device="cuda")[:kmax]).values
        pages = pages.to(torch.int32)[None, None].expand(1, HKV, kmax).contiguous()
        counts = torch.full((1, HKV), kmax, device="cuda", dtype=torch.int32)
        record("attention", lambda pages=pages, counts=counts: sparse_decode_triton(
            q, k, v, pages, counts, page_size=args.block_size, lengths=lens), density, blocks_kept=kmax)
        del state, state_torch
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--densities", default="0.05,0.1")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--breakdown", action="store_true", help="per-kernel device µs of the method calls")
    ap.add_argument("--split-rows", type=int, default=None,
                    help="rows of Ã per walk-GEMV program (a power of two >= 16; default 64)")
    args = ap.parse_args(argv)
    if args.split_rows is not None:  # the method looks the function up at each call, as the tests' overrides rely on
        from kvsieve.kernels.sketchwalk import decode as sketchwalk_decode

        sketchwalk_decode.sketch_walk_select = functools.partial(sketchwalk_decode.sketch_walk_select,
                                                                 split_rows=args.split_rows)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py times CUDA graphs: it needs a GPU")
    timer = ColdL2Timer()
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - optional anchor
        flashinfer = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, checks = [], []
    for n in (int(x) for x in args.contexts.split(",")):
        rows += bench_context(n, args, timer, flashinfer, gen, checks)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python docs/results/studies/sketchwalk/bench_decode.py " + " ".join(argv or sys.argv[1:]),
            "shapes": f"Hq={HQ}, Hkv={HKV}, d={D}, bf16, batch 1, block {args.block_size}",
            "protocol": "CUDA graph replays, cold L2, CUDA events, median", "check": checks}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sketchwalk_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Sketch&Walk decode step ({meta['device']}, {meta['date']})", "", f"`{meta['command']}`; "
             f"{meta['shapes']}; {meta['protocol']}.", "",
             f"Check against backend=reference: {checks}", "",
             "| N | variant | ρ | blocks kept | launches | µs | vs FlashInfer | vs SDPA |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        at = {x["variant"]: x["median_us"] for x in rows if x["n"] == r["n"] and x["density"] is None}
        ratio = {b: f"{at[b] / r['median_us']:.2f}×" if b in at else "–" for b in ("flashinfer", "sdpa")}
        lines.append(f"| {r['n']} | {r['variant']} | {r['density'] or ''} | {r.get('blocks_kept', '')} | "
                     f"{r.get('launches', '')} | {r['median_us']} | {ratio['flashinfer']} | {ratio['sdpa']} |")
    (args.out / "sketchwalk_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
