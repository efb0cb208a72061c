"""The decode step's weight products, timed the ways torch offers, against the copy rate (GPU).

In the end-to-end bench the runtime's dense decode spends 4.47 ms a step (Llama-3.1-8B shape, batch 1, H200) in
the weights' matrix products: 15.0 GB read at 79 % of the device's copy rate, 0.94 ms above their floor at every
context (``docs/results/gpu-bench/2026-11-29-h200-seed-methods-midday-summary.md``). That time is common to
dense and every method, so a faster product raises every row's tokens/s and every sparse method's ratio to
dense; under tensor parallelism a rank's narrower shards read slower still (2.6 TB/s at TP 2,
``2026-11-28-tp-compiled-summary.md``). This bench times each projection of one Llama-3.1-8B layer (or the
70B shape's: ``--shape``; or one rank's shard of each under transformers' tensor-parallel plan: ``--shards 2,4``)
and the LM head at batch 1 and 8 in the ways torch's own libraries offer, none of them code of ours:

- ``cublaslt``: ``F.linear`` with torch's default BLAS (cuBLASLt on Hopper: the split-K GEMVs the runtime gets);
- ``cublas``: the same with ``torch.backends.cuda.preferred_blas_library("cublas")``;
- ``inductor``: ``torch.compile`` of ``F.linear`` as the runtime's compiled layers build it;
- ``inductor-autotune``: with ``max_autotune_gemm`` (Triton templates tried against ATen at compile time);
- ``inductor-decompose``: with ``decompose_mem_bound_mm`` (small-M products as a multiply and a reduction);

and the fused projections a runtime can build by concatenating weights (``qkv``: q, k and v in one product,
``gate_up``: the MLP's two input products in one), the usual serving-engine layout.

Every way is captured in a CUDA graph and replayed with a cold L2 (``kvsieve.bench.timing.ColdL2Timer``), checked
against a float32 product in the same run, and reported as µs, the fraction of the copy rate, and for a whole
layer (q, k, v, o, gate, up, down: separate or fused) the ms a step of 32 layers + the LM head would take.
Writes ``weights_gemv.json`` and ``.md`` to ``--out``. ``--check`` runs the shapes and checks on the CPU (the
eager ``cublaslt`` way only), no timing. ``inductor-autotune`` compiles and times Triton templates for every
product at compile time (tens of seconds each): give it a call of its own (``--ways inductor-autotune``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

#: (hidden, intermediate, heads, KV heads, head dim, vocabulary, layers) of the model shapes the benches build
SHAPES = {"llama-3.1-8b": (4096, 14336, 32, 8, 128, 128256, 32),
          "llama-3.1-70b": (8192, 28672, 64, 8, 128, 128256, 80)}
#: the products transformers' tensor-parallel plan shards by output columns (the rest, o and down, by input rows)
COLUMN_PARALLEL = ("q", "k", "v", "gate", "up", "lm_head", "qkv", "gate_up")


def products(shape: str, shard: int = 1) -> tuple[tuple[str, int, int], ...]:
    """(name, in features, out features) of one layer's products and the LM head, as one of ``shard`` ranks
    of a tensor-parallel model holds them (``shard`` 1: the whole model)."""
    if shape not in SHAPES:
        raise ValueError(f"--shape: expected one of {', '.join(SHAPES)}, got {shape!r}")
    hidden, inter, heads, kv_heads, head_dim, vocab, _ = SHAPES[shape]
    if shard < 1 or kv_heads % shard:
        raise ValueError(f"--shards: expected divisors of the {kv_heads} KV heads of {shape}, got {shard}")
    whole = (("q", hidden, heads * head_dim), ("k", hidden, kv_heads * head_dim),
             ("v", hidden, kv_heads * head_dim), ("o", heads * head_dim, hidden), ("gate", hidden, inter),
             ("up", hidden, inter), ("down", inter, hidden), ("lm_head", hidden, vocab),
             ("qkv", hidden, (heads + 2 * kv_heads) * head_dim), ("gate_up", hidden, 2 * inter))
    return tuple((name, k, n // shard) if name in COLUMN_PARALLEL else (name, k // shard, n)
                 for name, k, n in whole)


SEPARATE = ("q", "k", "v", "o", "gate", "up", "down")
FUSED = ("qkv", "o", "gate_up", "down")
WAYS = ("cublaslt", "cublas", "inductor", "inductor-autotune", "inductor-decompose")


@contextlib.contextmanager
def blas(library: str | None):
    """``torch.backends.cuda.preferred_blas_library`` set for the block (None: leave it)."""
    if library is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def make_way(way: str):
    """``(fn(x, w) -> y, blas library or None)`` for a way of ``WAYS``."""
    if way == "cublaslt":
        return F.linear, None
    if way == "cublas":
        return F.linear, "cublas"
    options = {"inductor": {}, "inductor-autotune": {"max_autotune_gemm": True},
               "inductor-decompose": {"decompose_mem_bound_mm": True}}
    if way not in options:
        raise ValueError(f"--ways: expected names from {', '.join(WAYS)}, got {way!r}")
    # a fresh compile per product: Dynamo keys its cache on the code compiled, and past its recompile limit (8
    # shapes) it would run the product eagerly, which would time cuBLAS under an inductor way's name
    torch._dynamo.reset()
    return torch.compile(F.linear, dynamic=False, options=options[way] or None), None


def operands(batch: int, k: int, n: int, device, dtype, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, k, device=device, generator=g).to(dtype)
    w = (torch.randn(n, k, device=device, generator=g) * k ** -0.5).to(dtype)
    return x, w


def rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.float() @ w.float().t()
    return float((y.float() - ref).norm() / ref.norm())


def run(args) -> dict:
    from kvsieve.bench.timing import ColdL2Timer, copy_bandwidth

    dev = torch.device("cuda")
    rate = copy_bandwidth(dev)
    timer = ColdL2Timer(dev)
    rows = []
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    for shard, batch in itertools.product(args.shards, args.batches):
        for name, k, n in products(args.shape, shard):
            x, w = operands(batch, k, n, dev, torch.bfloat16)
            floor_us = (w.numel() + x.numel() + batch * n) * 2 / rate * 1e6
            for way in ways:
                t0 = time.time()
                row = {"shard": shard, "batch": batch, "product": name, "in": k, "out": n, "way": way,
                       "floor_us": floor_us}
                try:
                    fn, library = make_way(way)
                    with blas(library):
                        row["rel_err"] = rel_err(fn(x, w), x, w)
                        row.update(timer.time_graph_us(lambda fn=fn, x=x, w=w: fn(x, w), warmup=5, iters=args.iters))
                    row["of_copy_rate"] = floor_us / row["median_us"]
                except Exception as exc:  # noqa: BLE001 - one way failing must not lose the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                row["wall_s"] = time.time() - t0
                rows.append(row)
                print(_line(row), flush=True)
    steps = time_step(args, timer, rate) if args.step else []
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_rate_bytes_per_s": rate,
            "shape": args.shape, "steps": steps, "layers": SHAPES[args.shape][6],
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}


def time_step(args, timer, rate: float) -> list[dict]:
    """Every layer's products and the LM head back to back in one captured graph, each layer with weights of
    its own (the step reads them all from HBM, as a decode step does): separate against fused q/k/v and
    gate/up, eager BLAS. Timing one product alone adds the graph launch and the first wave's ramp to every
    product; this is the figure a decode step sees."""
    dev = torch.device("cuda")
    rows = []
    layers = SHAPES[args.shape][6]
    for shard, batch in itertools.product(args.shards, args.batches):
        dims = {name: (k, n) for name, k, n in products(args.shape, shard)}
        for layout, names in (("separate", SEPARATE), ("fused", FUSED)):
            t0 = time.time()
            weights = [{p: operands(1, *dims[p], dev, torch.bfloat16, seed=i)[1] for p in names}
                       for i in range(layers)]
            head = operands(1, *dims["lm_head"], dev, torch.bfloat16)[1]
            inputs = {p: torch.randn(batch, dims[p][0], device=dev, dtype=torch.bfloat16) for p in names}
            x_head = torch.randn(batch, dims["lm_head"][0], device=dev, dtype=torch.bfloat16)

            def step(weights=weights, head=head, inputs=inputs, x_head=x_head):
                for layer in weights:
                    for p, w in layer.items():
                        F.linear(inputs[p], w)
                F.linear(x_head, head)

            nbytes = 2 * (sum(w.numel() for layer in weights for w in layer.values()) + head.numel())
            row = {"shard": shard, "batch": batch, "layout": layout, "layers": layers, "weight_bytes": nbytes,
                   "floor_us": nbytes / rate * 1e6}
            row.update(timer.time_graph_us(step, warmup=3, iters=args.iters))
            row["of_copy_rate"] = row["floor_us"] / row["median_us"]
            row["wall_s"] = time.time() - t0
            rows.append(row)
            print(f"step tp{shard} b{batch} {layout:8s} {row['median_us'] / 1e3:7.3f} ms  "
                  f"{row['of_copy_rate']:.0%} of copy ({nbytes / 1e9:.2f} GB)", flush=True)
            del weights, head, inputs, step
            torch.cuda.empty_cache()
    return rows


def _line(r: dict) -> str:
    if "error" in r:
        return f"tp{r['shard']} b{r['batch']} {r['product']:8s} {r['way']:18s} ERROR {r['error']}"
    return (f"tp{r['shard']} b{r['batch']} {r['product']:8s} {r['way']:18s} {r['median_us']:8.1f} µs  "
            f"{r['of_copy_rate']:.0%} of copy  err {r['rel_err']:.1e}")


def step_ms(rows: list[dict], layers: int, shard: int, batch: int, way: str, names) -> float | None:
    """``layers`` layers of the products ``names`` + the LM head, ms, where every product ran."""
    us = {r["product"]: r["median_us"] for r in rows
          if (r["shard"], r["batch"], r["way"]) == (shard, batch, way) and "median_us" in r}
    if any(p not in us for p in (*names, "lm_head")):
        return None
    return (layers * sum(us[p] for p in names) + us["lm_head"]) / 1e3


def markdown(res: dict, command: str) -> str:
    rows, layers = res["rows"], res["layers"]
    lines = [f"# The decode step's weight products ({res['device']})", "",
             f"- date: {res['date']}; torch {res['torch']}; bf16; {res['shape']} products (tp N: one rank's shard "
             f"of transformers' tensor-parallel plan); copy rate {res['copy_rate_bytes_per_s'] / 1e12:.2f} TB/s",
             f"- command: `{command}`",
             "- µs: captured, cold L2, median; of copy = the bytes (weights + input + output) at the copy rate / µs; "
             "err: relative to a float32 product", "",
             "| tp | batch | product | in → out | way | µs | of copy | rel err |",
             "|---:|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        cells = (f"{r['median_us']:.1f} | {r['of_copy_rate']:.0%} | {r['rel_err']:.1e}" if "median_us" in r
                 else f"error: {r.get('error', '')[:80]} | | ")
        lines.append(f"| {r['shard']} | {r['batch']} | {r['product']} | {r['in']} → {r['out']} | {r['way']} | "
                     f"{cells} |")
    if res.get("steps"):
        lines += ["", f"A whole step's products in one graph ({layers} layers, each with weights of its own, + the "
                  "LM head; eager BLAS), ms:", "", "| tp | batch | layout | GB | ms | of copy |",
                  "|---:|---:|---|---:|---:|---:|"]
        lines += [f"| {r['shard']} | {r['batch']} | {r['layout']} | {r['weight_bytes'] / 1e9:.2f} | "
                  f"{r['median_us'] / 1e3:.3f} | {r['of_copy_rate']:.0%} |" for r in res["steps"]]
    lines += ["", f"The products timed one by one, summed to a step ({layers} layers + the LM head) on one rank, "
              "ms (each includes a graph launch and its first wave's ramp):", "",
              "| tp | batch | way | separate q, k, v, gate, up | fused qkv, gate_up |", "|---:|---:|---|---:|---:|"]
    for shard, batch in sorted({(r["shard"], r["batch"]) for r in rows}):
        for way in dict.fromkeys(r["way"] for r in rows):
            sep = step_ms(rows, layers, shard, batch, way, SEPARATE)
            fused = step_ms(rows, layers, shard, batch, way, FUSED)
            lines.append(f"| {shard} | {batch} | {way} | {'' if sep is None else f'{sep:.2f}'} | "
                         f"{'' if fused is None else f'{fused:.2f}'} |")
    return "\n".join(lines) + "\n"


def check() -> None:
    """On the CPU: every product's shapes (whole and sharded), the eager way against float32, the step sums."""
    for shape, shard in itertools.product(SHAPES, (1, 2, 4)):
        rows = []
        for name, k, n in products(shape, shard):
            x, w = operands(2, k // 64, n // 64, "cpu", torch.float32)
            fn, library = make_way("cublaslt")
            assert library is None
            err = rel_err(fn(x, w), x, w)
            assert err < 1e-5, (name, err)
            rows.append({"shard": shard, "batch": 2, "product": name, "way": "cublaslt", "median_us": 1.0})
        layers = SHAPES[shape][6]
        assert step_ms(rows, layers, shard, 2, "cublaslt", SEPARATE) == (layers * 7 + 1) / 1e3
        assert step_ms(rows, layers, shard, 2, "cublaslt", FUSED) == (layers * 4 + 1) / 1e3
        dims = {p[0]: p[1:] for p in products(shape, shard)}
        assert dims["qkv"][1] == dims["q"][1] + dims["k"][1] + dims["v"][1]
        assert dims["gate_up"][1] == dims["gate"][1] + dims["up"][1]
        whole = {p[0]: p[1:] for p in products(shape)}
        # a rank's shards are 1/shard of the whole model's weights
        assert sum(k * n for k, n in dims.values()) * shard == sum(k * n for k, n in whole.values())
    for bad in (lambda: make_way("triton-by-hand"), lambda: products("llama-3.1-8b", 3),
                lambda: products("llama-9", 1)):
        try:
            bad()
        except ValueError as exc:
            assert "--" in str(exc)
        else:
            raise AssertionError("bad input was accepted")
    print("check ok")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for weights_gemv.json and .md")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}")
    p.add_argument("--shape", default="llama-3.1-8b", help=f"one of {', '.join(SHAPES)}")
    p.add_argument("--shards", type=lambda s: [int(n) for n in s.split(",")], default=[1],
                   help="comma list of tensor-parallel sizes: time one rank's shard of each product (1: whole)")
    p.add_argument("--step", action="store_true",
                   help="also time a whole step's products in one graph, separate and fused (--ways '' for that only)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--check", action="store_true", help="the shapes and checks on the CPU, no timing")
    args = p.parse_args(argv)
    if args.check:
        check()
        return 0
    if not torch.cuda.is_available():
        print("weights_gemv.py needs a CUDA GPU (use --check on a CPU)", file=sys.stderr)
        return 2
    if not args.out:
        p.error("--out is required")
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/breakdown/weights_gemv.py " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "weights_gemv.json").write_text(json.dumps(res, indent=1))
    (out / "weights_gemv.md").write_text(markdown(res, command))
    print(markdown(res, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
