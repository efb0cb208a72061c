"""Launch settings of the weighted sparse kernel (``weighted_triton.sparse_decode_triton``) on the page lists the
methods hand it at batch 1 and 8, swept on the GPU: the split into programs (``target_programs``), warps,
stages, key block, and the one-launch merge (``fused_merge``) against the separate merge launch.

Why: the attention over Sketch&Walk's kept blocks (ρ ≈ 0.1 at 128k, 64-key pages + a dense prefix) measured
53 µs a layer with ``fused_merge=True`` against 28 µs for the two-launch form in an earlier run on the same
H200, both far from the ≈ 13 µs its 54 MB would take at the copy rate; Quest's 5 % pages of 16 run at about
half the copy rate too.

Cases (Llama-3.1-8B heads 32/8/128, bf16, random data): ``sw-128k-b1`` (187 random 64-key blocks of 2,048 per
row, a dense prefix of 2,621 keys read through ``sink_lengths``; the lists shared by the KV group as
Sketch&Walk passes them), ``sw-32k-b8`` (the same at 32k and 8 rows), ``quest-128k-b1`` (5 % of the 16-key pages
per KV head, sink + window 128). Each setting's output is compared with the torch reference
(``sparse_decode_reference``) before it is timed (captured in a CUDA graph, 512 MB L2 flush before each
replay, median); "floor" = K/V bytes read / the measured device copy rate.

    PYTHONPATH=src python benchmarks/sparse_decode/tune_gather.py --out OUT
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/sparse_decode/tune_gather.py --out /tmp/x --check

Writes ``tune_gather.json`` to ``--out``. ``--check``: tiny shapes through the interpreter, two settings, no
timing (it checks the script).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvsieve.kernels.shared.weighted_triton import TARGET_PROGRAMS, sparse_decode_reference, sparse_decode_triton

HQ, HKV, D = 32, 8, 128
SETTINGS = [dict(fused_merge=fm, target_programs=tp) for fm in (True, False) for tp in (264, 528, 1056, 2112)]
SETTINGS += [dict(fused_merge=False, num_warps=w, num_stages=s) for w, s in ((2, 2), (4, 3), (4, 4), (8, 2))]
SETTINGS += [dict(fused_merge=False, block_n=bn) for bn in (32, 128)]
SETTINGS += [dict(fused_merge=False, target_programs=1056, num_stages=3), dict(fused_merge=False, target_programs=2112,
                                                                              num_stages=3)]


def case_inputs(name: str, dev: str, tiny: bool):
    """``(q, k, v, kwargs)`` of one case (module docstring); ``kwargs`` the call's list arguments."""
    g = torch.Generator(device=dev).manual_seed(0)
    hq, hkv, d = (8, 2, 64) if tiny else (HQ, HKV, D)
    if name.startswith("sw"):
        n, b = ((2048, 1) if tiny else (131072, 1)) if "128k" in name else ((1024, 2) if tiny else (32768, 8))
        page, blocks = 64, n // 64
        kept = max(2, round(blocks * 0.0913))
        prefix = round(0.02 * n)
        rows = [torch.randperm(blocks - prefix // page - 2, generator=g, device=dev)[:kept] + prefix // page + 1
                for _ in range(b)]
        idx = torch.stack([r.sort().values for r in rows]).to(torch.int32)[:, None].expand(b, hkv, -1)
        cnt = torch.full((b, hkv), kept, dtype=torch.int32, device=dev)
        kwargs = dict(indices=idx, counts=cnt, page_size=page, sink=prefix,
                      sink_lengths=torch.full((b,), prefix, dtype=torch.int32, device=dev))
    else:
        n, b, page = (2048, 1, 16) if tiny else (131072, 1, 16)
        pages = n // page
        kept = max(2, round(pages * 0.05))
        idx = torch.stack([torch.randperm(pages, generator=g, device=dev)[:kept].sort().values
                           for _ in range(b * hkv)]).view(b, hkv, kept).to(torch.int32)
        cnt = torch.full((b, hkv), kept, dtype=torch.int32, device=dev)
        kwargs = dict(indices=idx, counts=cnt, page_size=page, sink=128, window=128)
    q = torch.randn(b, hq, d, device=dev, generator=g).bfloat16()
    k = torch.randn(b, hkv, n, d, device=dev, generator=g).bfloat16()
    v = torch.randn(b, hkv, n, d, device=dev, generator=g).bfloat16()
    kwargs["lengths"] = torch.full((b,), n, dtype=torch.int32, device=dev)
    return q, k, v, kwargs


def keys_read(kwargs, n: int) -> float:
    """Keys each (row, KV head) reads: the listed pages' plus the dense ranges."""
    listed = float(kwargs["counts"].float().mean()) * kwargs["page_size"]
    return listed + min(kwargs.get("sink", 0) + kwargs.get("window", 0), n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    dev = "cpu" if args.check else "cuda"
    res = {"device": "cpu (interpreter)" if args.check else torch.cuda.get_device_name(),
           "default_target_programs": TARGET_PROGRAMS, "cases": {}}
    timer = None
    if not args.check:
        from kvsieve.bench.timing import ColdL2Timer, copy_bandwidth

        timer = ColdL2Timer()
        res["copy_bytes_per_s"] = copy_bandwidth()
    settings = SETTINGS[:2] if args.check else SETTINGS
    for name in ("sw-128k-b1", "sw-32k-b8", "quest-128k-b1"):
        q, k, v, kw = case_inputs(name, dev, args.check)
        ref = sparse_decode_reference(q.float(), k.float(), v.float(), **kw)[0]
        b, hkv, n, d = k.shape
        kv_bytes = keys_read(kw, n) * b * hkv * 2 * d * k.element_size()
        rows = []
        for s in settings:
            row = dict(s)
            try:
                out = sparse_decode_triton(q, k, v, **kw, **s)[0]
                row["max_err"] = float((out.float() - ref).abs().max())
                if row["max_err"] > 3e-2:
                    row["error"] = "output differs from the reference"
                elif timer is not None:
                    call = lambda s=s, q=q, k=k, v=v, kw=kw: sparse_decode_triton(q, k, v, **kw, **s)  # noqa: E731
                    row.update(timer.time_graph_us(call))
                    row["of_copy_rate"] = kv_bytes / (row["median_us"] * 1e-6) / res["copy_bytes_per_s"]
            except Exception as exc:  # noqa: BLE001 - a setting that cannot launch is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(row)
            print(name, row, flush=True)
        res["cases"][name] = {"kv_bytes": kv_bytes, "rows": rows}
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune_gather.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
