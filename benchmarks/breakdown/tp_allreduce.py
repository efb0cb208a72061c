"""The decode step's all-reduces under tensor parallelism, timed the ways torch offers (GPUs, one process each).

A tensor-parallel decode step of Llama-3.1-8B at TP 2 runs 65 all-reduces of one ``[batch, hidden]`` row each
(two a layer: after ``o_proj`` and ``down_proj``; one for the vocabulary-parallel embedding): 0.80 ms of a 5.89 ms
step through NCCL (``docs/results/gpu-bench/2026-11-29-h200-fused-projections-summary.md``), about 12 µs apiece
for 8 KB. This bench captures ``--count`` all-reduces back to back in one CUDA graph per way and replays it:

- ``nccl``: ``dist.all_reduce`` (what transformers' row-parallel modules call);
- ``one-shot``: the row copied into a buffer of torch's symmetric memory, then
  ``torch.ops.symm_mem.one_shot_all_reduce`` (each rank reads every peer's buffer over NVLink and sums);
- ``two-shot``: the same with ``two_shot_all_reduce_`` (reduce-scatter then all-gather through the buffers).

NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set here too); no multimem operation is
used. Each way's sums are checked against float64 sums of every rank's rows. Launch:
``python -m torch.distributed.run --nproc-per-node 2 benchmarks/breakdown/tp_allreduce.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

WAYS = ("nccl", "one-shot", "two-shot")


def make_way(way: str, x: torch.Tensor, group_name: str):
    """``fn()`` reducing ``x``'s row across the ranks, and ``result() -> tensor`` reading the sum it left."""
    if way not in WAYS:
        raise ValueError(f"--ways: expected names from {', '.join(WAYS)}, got {way!r}")
    if way == "nccl":
        return (lambda: dist.all_reduce(x)), (lambda: x)
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, group_name)
    out = {}
    if way == "one-shot":
        def fn():
            buf.copy_(x)
            out["y"] = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
        return fn, (lambda: out["y"])
    def fn():
        buf.copy_(x)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)
    return fn, (lambda: buf)


def run(args) -> dict:
    from kvsieve.bench.timing import capture_graph

    rank, size = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    group_name = dist.group.WORLD.group_name
    rows = []
    for batch in args.batches:
        g = torch.Generator(device=dev).manual_seed(rank)
        base = torch.randn(batch, args.hidden, device=dev, generator=g, dtype=torch.float32)
        every = [torch.empty_like(base) for _ in range(size)]
        dist.all_gather(every, base)
        want = torch.stack(every).double().sum(0)
        for way in args.ways:
            row = {"batch": batch, "hidden": args.hidden, "way": way, "ranks": size, "count": args.count}
            try:
                x = base.to(torch.bfloat16).clone()
                fn, result = make_way(way, x, group_name)
                x.copy_(base)
                fn()
                torch.cuda.synchronize()
                row["max_err"] = float((result().double() - want).abs().max() / want.abs().max())
                graph = capture_graph(lambda fn=fn: [fn() for _ in range(args.count)])
                times = []
                for _ in range(args.iters):
                    dist.barrier()
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / args.count)
                times.sort()
                row["us_each"] = times[len(times) // 2]
                row["us_each_min"] = times[0]
            except Exception as exc:  # noqa: BLE001 - one way failing must not lose the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            rows.append(row)
            if rank == 0:
                print(row, flush=True)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ranks": size,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows,
            "multicast_disabled": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")}


def markdown(res: dict, command: str) -> str:
    lines = [f"# The decode step's all-reduces, {res['ranks']} ranks ({res['device']})", "",
             f"- date: {res['date']}; torch {res['torch']}; bf16 rows; TORCH_SYMM_MEM_DISABLE_MULTICAST="
             f"{res['multicast_disabled']}", f"- command: `{command}`",
             "- µs each: a CUDA graph of `count` all-reduces back to back, replayed; median over replays (rank 0); "
             "err: against float64 sums", "",
             "| batch | hidden | way | µs each (min) | rel err |", "|---:|---:|---|---:|---:|"]
    for r in res["rows"]:
        cell = (f"{r['us_each']:.2f} ({r['us_each_min']:.2f}) | {r['max_err']:.1e}" if "us_each" in r
                else f"error: {r.get('error', '')[:100]} |")
        lines.append(f"| {r['batch']} | {r['hidden']} | {r['way']} | {cell} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ways", type=lambda s: [w for w in s.split(",") if w], default=list(WAYS))
    p.add_argument("--count", type=int, default=65, help="all-reduces per graph (a decode step's count)")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    try:
        res = run(args)
    finally:
        dist.barrier()
    if dist.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        command = "python -m torch.distributed.run --nproc-per-node N benchmarks/breakdown/tp_allreduce.py " + " ".join(
            argv if argv is not None else sys.argv[1:])
        (out / "tp_allreduce.json").write_text(json.dumps(res, indent=1))
        (out / "tp_allreduce.md").write_text(markdown(res, command))
        print(markdown(res, command))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
