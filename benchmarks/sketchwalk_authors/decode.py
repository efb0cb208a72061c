"""variant=authors' batched decode per layer at Llama-3.1-8B heads (32/8/128, bf16) vs FlashInfer and the dense
Triton kernel, captured in a CUDA graph, cold L2; writes ``decode.json`` to ``--out``.

    python benchmarks/sketchwalk_authors/decode.py --out "$OUT" [--n 131072] [--batch 1] [--spec SPEC]
    TRITON_INTERPRET=1 python benchmarks/sketchwalk_authors/decode.py --out /tmp/x --check   # CPU, tiny shapes

The prompt state comes from the method's own prefill record (``prefill(sparse=False)``, the torch block matrix)
of ``n − 1`` random tokens; every timed replay is the first step after the prompt (a restart, the same work as
any step). Rows: the whole step (selection + attention), the attention alone on the step's pages (so the
selection's share is the difference), FlashInfer (batch 1) and the dense Triton decode; ``launches`` is the
kernels of one layer's step (torch profiler), ``kernels_us`` the step's mean device µs per kernel (eager, cold
L2; a kernel launched with programmatic dependent launch counts its wait). ``--check`` runs one step on the CPU
through Triton's interpreter (tiny shapes, no timing) and reports what it would launch (``count_dispatched``:
Triton launches and torch ops).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.bench.timing import count_dispatched
from kvsieve.methods.sketchwalk import SketchWalkState, authors


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
    ap.add_argument("--check", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes, launches only")
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
    state = prompt_state(m, q, k, v, n)
    del q
    qd = torch.randn(b, hq, d, device=dev, generator=g).bfloat16()
    lengths = torch.full((b,), n, device=dev, dtype=torch.int32)
    ctx = CallContext(capacity=n, count_reads=False)

    def step():
        return m.decode(qd, k, v, lengths=lengths, state=state, context=ctx, check_finite=False)[0]

    _, stats = m.decode(qd, k, v, lengths=lengths, state=state, context=CallContext(capacity=n))
    res = {"n": n, "batch": b, "spec": m.spec, "device": "cpu (interpreter)" if check else torch.cuda.get_device_name(),
           "density": float(stats.density), "block_density": float(stats["block_density"]),
           "blocks_kept": float(stats["blocks_kept"]), "selection": stats.extra["selection"],
           "backend": stats.backend, "rows": {}}
    dispatched = count_dispatched(step)
    res["step_dispatch"] = {key: dispatched[key] for key in ("triton_launches", "torch_ops", "host_reads", "ops")}
    if not check:
        time_on_gpu(res, cfg, state, step, qd, k, v, lengths, n, b)
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


def time_on_gpu(res, cfg, state, step, qd, k, v, lengths, n, b) -> None:
    """The timed rows (module docstring) into ``res``."""
    from kvsieve.bench.decode import load_flashinfer
    from kvsieve.bench.timing import ColdL2Timer, count_launches
    from kvsieve.kernels.shared.dense import dense_decode_triton
    from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton

    hkv = k.shape[1]
    sel = state.authors_device.last_step
    pages, counts = sel.pages, sel.counts
    prefix = authors.reserved(cfg.window, n, cfg.block_size, -(-n // cfg.block_size))[0]
    window_tokens = sel.window_tokens.to(torch.int32)
    res["max_pages"] = int(pages.shape[1])

    def attention():
        return sparse_decode_triton(qd, k, v, pages[:, None].expand(b, hkv, -1), counts[:, None].expand(b, hkv),
                                    page_size=cfg.block_size, lengths=lengths, sink=prefix,
                                    sink_lengths=window_tokens)[0]

    timer = ColdL2Timer()
    rows = res["rows"]
    rows["sketchwalk_step"] = {**timer.time_graph_us(step), "launches": count_launches(step),
                               "kernels_us": timer.kernel_breakdown(step)}
    rows["sketchwalk_attention_only"] = {**timer.time_graph_us(attention), "launches": count_launches(attention)}
    rows["dense_triton"] = timer.time_graph_us(lambda: dense_decode_triton(qd, k, v, lengths, qd.shape[-1] ** -0.5))
    fi = load_flashinfer()
    if not isinstance(fi, Exception) and b == 1:
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        rows["flashinfer"] = timer.time_graph_us(lambda: fi.single_decode_with_kv_cache(qd[0], kn, vn, kv_layout="NHD"))
    else:
        res["flashinfer_note"] = str(fi) if isinstance(fi, Exception) else "batch > 1: not run"
    base = rows.get("flashinfer", rows["dense_triton"])["median_us"]
    for row in rows.values():
        row["speedup_vs_flashinfer_or_dense"] = base / row["median_us"]
    res["selection_share"] = 1 - rows["sketchwalk_attention_only"]["median_us"] / rows["sketchwalk_step"]["median_us"]


if __name__ == "__main__":
    main()
