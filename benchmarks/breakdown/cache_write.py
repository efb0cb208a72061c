"""The decode step's K/V cache writes, every layer's, timed per way of writing (``runtime/cache.py``).

A captured Llama-3.1-8B decode step writes each layer's new key and value into the runtime's cache; with two
eager ``scatter_`` a layer these were the step's costliest "other" kernels on an H200 (64 launches, 0.24 ms).
This bench builds the runtime's own cache (``RuntimeCache``, random contents, rows at ragged positions) and
runs one step's writes through ``RuntimeLayer.update`` for every layer, each way:

- ``scatter``: the cache's eager path (two ``scatter_`` a layer);
- ``index_put``: ``cache.index_write`` run eagerly (two ``index_put_`` a layer);
- ``compiled``: ``cache.index_write`` compiled by inductor, what the runtime's compiled decode steps call
  (``runtime/compiled.py``: one kernel a layer for K and V).

Each way is captured once in a CUDA graph and replayed with a cold L2 (``bench.timing.ColdL2Timer``); its
kernels per step are counted (torch profiler) and its cache is checked bit for bit against ``scatter``'s.

    python benchmarks/breakdown/cache_write.py --out DIR [--cases 1x32k,8x32k] [--layers 32 --kv-heads 8 --head-dim 128]

``--device cpu`` runs the checks alone (no timing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvsieve.runtime.cache import RuntimeCache, index_write  # noqa: E402
from kvsieve.runtime.compiled import compiled_cache_write  # noqa: E402

WAYS = ("scatter", "index_put", "compiled")


def parse_case(text: str) -> tuple[int, int]:
    try:
        batch, context = text.lower().split("x")
        return int(batch), int(context[:-1]) * 1024 if context.endswith("k") else int(context)
    except ValueError:
        raise ValueError(f"--cases: expected batch×context items like 1x32k, got {text!r}") from None


def make_cache(args, batch: int, context: int, device: torch.device, seed: int) -> RuntimeCache:
    """The runtime's cache in decode mode, random contents, rows at ragged positions below ``context``."""
    from transformers import LlamaConfig

    d, h = args.head_dim, args.kv_heads
    config = LlamaConfig(num_hidden_layers=args.layers, num_attention_heads=4 * h, num_key_value_heads=h,
                         hidden_size=4 * h * d, head_dim=d, max_position_embeddings=context + 1)
    cache = RuntimeCache(config, batch=batch, capacity=context + 1, dtype=torch.bfloat16, device=device,
                         kv_heads=h, k_dim=d, v_dim=d, n_layers=args.layers)
    g = torch.Generator(device).manual_seed(seed)
    for layer in cache.layers:
        layer.keys.normal_(generator=g)
        layer.values.normal_(generator=g)
    cache.mode = "decode"
    positions = torch.randint(context // 2, context + 1, (batch,), generator=g, device=device)
    cache.positions.copy_(positions)
    return cache


def step_fn(cache: RuntimeCache, way: str, new_kv: list[tuple[torch.Tensor, torch.Tensor]]):
    if way not in WAYS:
        raise ValueError(f"--ways: expected names from {', '.join(WAYS)}, got {way!r}")
    cache.compiled_write = {"scatter": None, "index_put": index_write,
                            "compiled": compiled_cache_write()}[way]

    def step():
        for layer, (k, v) in zip(cache.layers, new_kv, strict=True):
            layer.update(k, v)

    return step


def run_case(args, batch: int, context: int, device: torch.device) -> list[dict]:
    from kvsieve.bench.timing import ColdL2Timer, capture_graph, count_launches, kernel_totals

    g = torch.Generator(device).manual_seed(batch + context)
    new_kv = [tuple(torch.randn(batch, args.kv_heads, 1, args.head_dim, generator=g, device=device)
                    .to(torch.bfloat16) for _ in range(2)) for _ in range(args.layers)]
    reference, rows = None, []
    for way in args.ways.split(","):
        cache = make_cache(args, batch, context, device, seed=7)
        step = step_fn(cache, way, new_kv)
        row = {"way": way, "batch": batch, "context": context, "layers": args.layers}
        if device.type == "cuda":
            graph = capture_graph(step)  # its warm-up calls write the same slots the check reads
            row["launches_per_step"] = count_launches(graph.replay)
            row.update(ColdL2Timer(device).time_us(graph.replay, warmup=args.warmup, iters=args.iters))
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            row["kernels"] = {name: n for name, (_, n) in kernel_totals(prof, width=70).items()}
        else:
            step()
        state = [(layer.keys, layer.values) for layer in cache.layers]
        if reference is None:
            reference = state
        row["equal_to_first"] = all(torch.equal(k.view(torch.int16), rk.view(torch.int16))
                                    and torch.equal(v.view(torch.int16), rv.view(torch.int16))
                                    for (k, v), (rk, rv) in zip(state, reference, strict=True))
        del state, cache, step  # the next way's cache in this one's memory (the reference stays)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def write_report(out: Path, name: str, rows: list[dict], argv: list[str]) -> None:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (out / f"{name}.json").write_text(json.dumps({"device": device, "argv": argv, "rows": rows}, indent=1))
    lines = [f"# The decode step's K/V cache writes, every layer's, per way ({device})", "",
             f"Command: `python benchmarks/breakdown/cache_write.py {' '.join(argv)}`. One step's writes of "
             "every layer captured in a CUDA graph, cold L2, median of the replays; `equal` compares each way's "
             f"cache bit for bit with the first way's ({rows[0]['way'] if rows else '-'}).", "",
             "| way | batch × context | layers | µs per step | min µs | launches per step | equal | kernels |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        kernels = "; ".join(f"{n}× {k}" for k, n in r.get("kernels", {}).items())
        lines.append(f"| {r['way']} | {r['batch']} × {r['context']} | {r['layers']} | "
                     f"{r.get('median_us', float('nan')):.1f} | {r.get('min_us', float('nan')):.1f} | "
                     f"{r.get('launches_per_step', '-')} | {r['equal_to_first']} | {kernels} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder of the JSON and markdown results")
    ap.add_argument("--name", default="cache_write", help="file stem")
    ap.add_argument("--cases", default="1x32k,8x32k", help="comma list of batch×context, e.g. 1x32k,8x32k")
    ap.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)} (the first: reference)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda", help="cuda (timed) or cpu (the checks alone)")
    args = ap.parse_args(argv)
    for key in ("layers", "kv_heads", "head_dim", "iters"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')}: expected a positive count, got {getattr(args, key)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda asked for, but torch sees no CUDA GPU (use --device cpu for the checks)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, rows = time.perf_counter(), []
    for case in args.cases.split(","):
        rows += run_case(args, *parse_case(case), device)
    write_report(out, args.name, rows, argv)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s -> {out / args.name}.md", flush=True)
    return 0 if all(r["equal_to_first"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
