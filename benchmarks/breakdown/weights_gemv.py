"""The decode step's weight products, timed the ways torch offers, against the copy rate (GPU).

In the end-to-end bench the runtime's dense decode spends 4.47 ms a step (Llama-3.1-8B shape, batch 1, H200) in
the weights' matrix products: 15.0 GB read at 79 % of the device's copy rate, 0.94 ms above their floor at every
context (``docs/results/gpu-bench/2026-11-29-h200-seed-methods-midday-summary.md``). That time is common to
dense and every method, so a faster product raises every row's tokens/s and every sparse method's ratio to
dense. This bench times each projection of one Llama-3.1-8B layer and the LM head at batch 1 and 8 in the ways
torch's own libraries offer, none of them code of ours:

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
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 4096, 14336, 32, 8, 128, 128256, 32

#: (name, in features, out features) of one Llama-3.1-8B layer's products and the LM head
PRODUCTS = (
    ("q", HIDDEN, HEADS * HEAD_DIM), ("k", HIDDEN, KV_HEADS * HEAD_DIM), ("v", HIDDEN, KV_HEADS * HEAD_DIM),
    ("o", HEADS * HEAD_DIM, HIDDEN), ("gate", HIDDEN, INTERMEDIATE), ("up", HIDDEN, INTERMEDIATE),
    ("down", INTERMEDIATE, HIDDEN), ("lm_head", HIDDEN, VOCAB),
    ("qkv", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), ("gate_up", HIDDEN, 2 * INTERMEDIATE),
)
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
    for batch in args.batches:
        for name, k, n in PRODUCTS:
            x, w = operands(batch, k, n, dev, torch.bfloat16)
            floor_us = (w.numel() + x.numel() + batch * n) * 2 / rate * 1e6
            for way in ways:
                t0 = time.time()
                row = {"batch": batch, "product": name, "in": k, "out": n, "way": way, "floor_us": floor_us}
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
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_rate_bytes_per_s": rate,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}


def _line(r: dict) -> str:
    if "error" in r:
        return f"b{r['batch']} {r['product']:8s} {r['way']:18s} ERROR {r['error']}"
    return (f"b{r['batch']} {r['product']:8s} {r['way']:18s} {r['median_us']:8.1f} µs  "
            f"{r['of_copy_rate']:.0%} of copy  err {r['rel_err']:.1e}")


def step_ms(rows: list[dict], batch: int, way: str, products) -> float | None:
    """32 layers of ``products`` + the LM head, ms, where every product ran."""
    us = {r["product"]: r["median_us"] for r in rows if r["batch"] == batch and r["way"] == way and "median_us" in r}
    if any(p not in us for p in (*products, "lm_head")):
        return None
    return (LAYERS * sum(us[p] for p in products) + us["lm_head"]) / 1e3


def markdown(res: dict, command: str) -> str:
    rows = res["rows"]
    lines = [f"# The decode step's weight products ({res['device']})", "",
             f"- date: {res['date']}; torch {res['torch']}; bf16; Llama-3.1-8B products; copy rate "
             f"{res['copy_rate_bytes_per_s'] / 1e12:.2f} TB/s", f"- command: `{command}`",
             "- µs: captured, cold L2, median; of copy = the bytes (weights + input + output) at the copy rate / µs; "
             "err: relative to a float32 product", "",
             "| batch | product | in → out | way | µs | of copy | rel err |", "|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        cells = (f"{r['median_us']:.1f} | {r['of_copy_rate']:.0%} | {r['rel_err']:.1e}" if "median_us" in r
                 else f"error: {r.get('error', '')[:80]} | | ")
        lines.append(f"| {r['batch']} | {r['product']} | {r['in']} → {r['out']} | {r['way']} | {cells} |")
    lines += ["", "A step's products (32 layers + the LM head), ms:", "",
              "| batch | way | separate q, k, v, gate, up | fused qkv, gate_up |", "|---:|---|---:|---:|"]
    for batch in sorted({r["batch"] for r in rows}):
        for way in dict.fromkeys(r["way"] for r in rows):
            sep, fused = step_ms(rows, batch, way, SEPARATE), step_ms(rows, batch, way, FUSED)
            lines.append(f"| {batch} | {way} | {'' if sep is None else f'{sep:.2f}'} | "
                         f"{'' if fused is None else f'{fused:.2f}'} |")
    return "\n".join(lines) + "\n"


def check() -> None:
    """On the CPU: every product's shapes, the eager way against the float32 product, the step sums."""
    rows = []
    for name, k, n in PRODUCTS:
        x, w = operands(2, k // 64, n // 64, "cpu", torch.float32)
        fn, library = make_way("cublaslt")
        assert library is None
        err = rel_err(fn(x, w), x, w)
        assert err < 1e-5, (name, err)
        rows.append({"batch": 2, "product": name, "way": "cublaslt", "median_us": 1.0})
    assert step_ms(rows, 2, "cublaslt", SEPARATE) == (LAYERS * 7 + 1) / 1e3
    assert step_ms(rows, 2, "cublaslt", FUSED) == (LAYERS * 4 + 1) / 1e3
    qkv = dict((p[0], p[1:]) for p in PRODUCTS)
    assert qkv["qkv"][1] == qkv["q"][1] + qkv["k"][1] + qkv["v"][1]
    assert qkv["gate_up"][1] == qkv["gate"][1] + qkv["up"][1]
    try:
        make_way("triton-by-hand")
    except ValueError as exc:
        assert "--ways" in str(exc)
    else:
        raise AssertionError("an unknown way was accepted")
    print("check ok")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for weights_gemv.json and .md")
    p.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma list of {', '.join(WAYS)}")
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
