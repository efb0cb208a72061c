"""Our sparse attention kernels against FlashInfer's paged decode over the *same* keys: how far each is from
what the field's best decode kernel does with the bytes our selections leave.

Sketch&Walk (issue 17) and SAAP (issue 18) miss 5× dense FlashInfer at 128k, and in both the attention
launch is the largest part of the step (21 µs and 20 µs on the H200 against byte floors of 11 and 6 µs).
Whether that kernel is where the missing microseconds are depends on what a mature kernel does with the
same gather. Cases (Llama-3.1-8B heads, 32/8/128, bf16, batch 1, CUDA graph, cold L2, medians):

- ``blocks``: a list of 64-key blocks at density ρ (block 0, the last block and random distinct others),
  one list for all KV heads (Sketch&Walk's decode). Ours: ``sparse_decode_triton(page_size=64)``;
  FlashInfer: ``BatchDecodeWithPagedKVCacheWrapper`` with page size 64 over a copy of the cache in its
  HND page layout, the list as the page table (CUDA cores and tensor cores).
- ``tokens``: per KV head, ``window`` recent keys plus random distinct earlier tokens up to ρ·N keys
  (SAAP's dense part + buckets: scattered rows). Ours: ``sparse_decode_triton(page_size=1)`` with the
  window as its dense part; FlashInfer: page size 1, each KV head one request of G query heads (its
  own page table), over a copy of the cache laid out [Hkv·N pages, 1, 1, d].
- ``bucket-fixed``: SAAP's bucket kernel with no bucket chosen and a one-key dense list, and
  ``triton-empty``: an empty one-program Triton kernel — the fixed costs under the same timer.

Each row is checked against the torch reference (max abs error of the output). Writes
``vs_flashinfer_paged.json`` and ``.md`` under OUT.

    PYTHONPATH=src python docs/results/studies/sparse-decode/vs_flashinfer_paged.py OUT [--contexts 32768 131072]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from kvsieve.bench.decode import library_version, timing_setup
from kvsieve.kernels.saap import buckets as bucket_kernels
from kvsieve.kernels.shared.triton_utils import triton
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference, sparse_decode_triton

HQ, HKV, D = 32, 8, 128
BLOCK = 64

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _empty_kernel(x_ptr):
        tl.store(x_ptr, 1.0)


def block_list(n_blocks: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Block 0, the last block and random distinct others: ⌈ρ·n⌉ blocks, ascending."""
    k = max(2, -(-int(density * n_blocks * 1000) // 1000))
    middle = torch.randperm(n_blocks - 2, generator=gen)[: k - 2] + 1
    return torch.cat([torch.tensor([0]), middle.sort().values, torch.tensor([n_blocks - 1])])


def token_lists(n: int, density: float, window: int, gen: torch.Generator) -> torch.Tensor:
    """[Hkv, M] earlier tokens (random, distinct, ascending) so that with the window each head reads ρ·N keys."""
    extra = max(1, int(density * n) - window)
    return torch.stack([torch.randperm(n - window, generator=gen)[:extra].sort().values for _ in range(HKV)])


def flashinfer_paged(fi, q, k_pages, v_pages, tables: list[torch.Tensor], page_size: int, heads_per_req: int,
                     kv_heads_per_req: int, tensor_cores: bool):
    """A planned FlashInfer paged decode: one request per table (full pages), returns ``run``."""
    dev = q.device
    indptr = torch.tensor([0] + [int(t.numel()) for t in tables], dtype=torch.int32).cumsum(0).to(torch.int32)
    indices = torch.cat(tables).to(torch.int32)
    last = torch.full((len(tables),), page_size, dtype=torch.int32)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=dev),
                                                     kv_layout="HND", use_tensor_cores=tensor_cores)
    wrapper.plan(indptr.to(dev), indices.to(dev), last.to(dev), heads_per_req, kv_heads_per_req, D, page_size,
                 q_data_type=q.dtype, kv_data_type=k_pages.dtype)
    return lambda: wrapper.run(q, (k_pages, v_pages))


def dense_reference(q, k, v) -> torch.Tensor:
    """Softmax attention in float32, a batch row at a time (the float32 cache of 8 rows would be 8 GB)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    out = []
    for i in range(b):
        s = q[i].float().view(hkv, hq // hkv, d) @ k[i].float().transpose(1, 2) * d ** -0.5
        out.append((torch.softmax(s, -1) @ v[i].float()).reshape(hq, d))
    return torch.stack(out)


def max_err(out, ref) -> float:
    """Max abs error of a call's output (or of the first of its outputs) against a reference."""
    out = out[0] if isinstance(out, tuple) else out
    return float((out.float().reshape(ref.shape) - ref.float()).abs().max())


def timed(timer, fn, iters):
    """Captured in a CUDA graph when the call allows it, else eager (the flush hides host launch time)."""
    try:
        return {**timer.time_graph_us(fn, iters=iters), "graph": True}
    except Exception as exc:  # noqa: BLE001 - a library call that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        return {**timer.time_us(fn, iters=iters), "graph": False, "graph_error": str(exc)[:200]}


def run_context(n: int, density: float, window: int, fi, timer, iters: int, copy_rate: float) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, HQ, D, generator=gen).to(dev, torch.bfloat16)
    k = torch.randn(1, HKV, n, D, generator=gen).to(dev, torch.bfloat16)
    v = torch.randn(1, HKV, n, D, generator=gen).to(dev, torch.bfloat16)
    rows = []

    def add(case, impl, fn, ref, keys_per_head):
        err = max_err(fn(), ref)
        t = timed(timer, fn, iters)
        floor = keys_per_head * HKV * D * 2 * 2 / copy_rate * 1e6 if keys_per_head else 0.0
        rows.append({"n": n, "case": case, "impl": impl, "us": t["median_us"], "graph": t["graph"],
                     "keys_per_kv_head": keys_per_head, "floor_us": floor, "max_abs_err": err,
                     **({"graph_error": t["graph_error"]} if "graph_error" in t else {})})
        print(f"{n:>7} {case:<13} {impl:<26} {t['median_us']:8.1f} µs  floor {floor:5.1f}  err {err:.1e}",
              flush=True)

    # Sketch&Walk's case: 64-key blocks, one list for every KV head.
    n_blocks = n // BLOCK
    blocks = block_list(n_blocks, density, gen)
    idx = blocks.to(dev, torch.int32).expand(1, HKV, -1).contiguous()
    cnt = torch.full((1, HKV), blocks.numel(), dtype=torch.int32, device=dev)
    ref = sparse_decode_reference(q, k, v, idx, cnt, None, page_size=BLOCK)[0]
    keys = blocks.numel() * BLOCK
    add("blocks", "ours", lambda: sparse_decode_triton(q, k, v, idx, cnt, None, page_size=BLOCK), ref, keys)
    if not isinstance(fi, Exception):
        kp = k[0].view(HKV, n_blocks, BLOCK, D).permute(1, 0, 2, 3).contiguous()
        vp = v[0].view(HKV, n_blocks, BLOCK, D).permute(1, 0, 2, 3).contiguous()
        for tc in (False, True):
            run = flashinfer_paged(fi, q, kp, vp, [blocks], BLOCK, HQ, HKV, tc)
            add("blocks", f"flashinfer-paged{'-tc' if tc else ''}", run, ref, keys)
        del kp, vp

    # SAAP's case: the recent window plus scattered earlier tokens, a list per KV head.
    lists = token_lists(n, density, window, gen)
    m = lists.shape[1]
    tidx = lists.to(dev, torch.int32)[None].contiguous()
    tcnt = torch.full((1, HKV), m, dtype=torch.int32, device=dev)
    ref = sparse_decode_reference(q, k, v, tidx, tcnt, None, window=window)[0]
    keys = m + window
    add("tokens", "ours", lambda: sparse_decode_triton(q, k, v, tidx, tcnt, None, window=window), ref, keys)
    if not isinstance(fi, Exception):
        kp = k[0].reshape(HKV * n, 1, 1, D)
        vp = v[0].reshape(HKV * n, 1, 1, D)
        tables = [torch.cat([lists[h], torch.arange(n - window, n)]) + h * n for h in range(HKV)]
        qr = q[0].view(HKV, HQ // HKV, D)
        for tc in (False, True):
            run = flashinfer_paged(fi, qr, kp, vp, tables, 1, HQ // HKV, 1, tc)
            add("tokens", f"flashinfer-paged{'-tc' if tc else ''}", run, ref, keys)

    # Fixed costs: SAAP's bucket kernel with nothing to read but one dense key, and an empty kernel.
    clusters = 1024
    assign = torch.randint(0, clusters, (1, HKV, n), device=dev)
    offsets, ids = bucket_kernels.build_csr(assign, clusters)
    one = torch.zeros(1, HKV, 1, dtype=torch.int64, device=dev)
    one_cnt = torch.ones(1, HKV, dtype=torch.int64, device=dev)
    no_buckets = torch.zeros(1, HKV, 0, dtype=torch.int64, device=dev)
    ref = sparse_decode_reference(q, k, v, one, one_cnt, None)[0]
    for splits in (1, 48):
        def call(s=splits):
            return bucket_kernels.bucket_sparse_decode_triton(q, k, v, one, one_cnt, offsets, ids, no_buckets, 0,
                                                              splits=s)
        add("bucket-fixed", f"bucket-kernel splits={splits}", call, ref, 1)
    flag = torch.zeros(1, device=dev)
    t = timed(timer, lambda: _empty_kernel[(1,)](flag), iters)
    rows.append({"n": n, "case": "triton-empty", "impl": "one program", "us": t["median_us"], "graph": t["graph"],
                 "keys_per_kv_head": 0, "floor_us": 0.0, "max_abs_err": 0.0})
    print(f"{n:>7} triton-empty {t['median_us']:8.1f} µs", flush=True)
    if not isinstance(fi, Exception):
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        add("dense", "flashinfer-single", lambda: fi.single_decode_with_kv_cache(q[0], kn, vn, kv_layout="NHD"),
            dense_reference(q, k, v)[0], n)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Sparse attention kernels vs FlashInfer's paged decode over the same keys ({result['device']}, "
             f"{result['date']})", "", f"- command: `{result['command']}`; torch {result['torch']}, triton "
             f"{result['triton']}, flashinfer {result['flashinfer']}; density {result['density']}, window "
             f"{result['window']}; CUDA graph unless marked (eager), cold L2, median of {result['iters']}", "",
             "| n | case | implementation | µs | floor µs | × floor | max abs err |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        ratio = f"{r['us'] / r['floor_us']:.2f}" if r["floor_us"] else ""
        mark = "" if r["graph"] else " (eager)"
        lines.append(f"| {r['n']:,} | {r['case']} | {r['impl']}{mark} | {r['us']:.1f} | {r['floor_us']:.1f} | "
                     f"{ratio} | {r['max_abs_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    fi, copy_rate, timer = timing_setup()
    rows = []
    for n in args.contexts:
        rows += run_context(n, args.density, args.window, fi, timer, args.iters, copy_rate)
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "torch": torch.__version__,
              "triton": library_version("triton"), "flashinfer": library_version("flashinfer"),
              "copy_rate_bytes_per_s": copy_rate, "density": args.density, "window": args.window,
              "iters": args.iters, "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "vs_flashinfer_paged.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / "vs_flashinfer_paged.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
