"""How fast can a Triton kernel stream K on this GPU? Probes for the stats pass of the santa kernels.

The ordered stats pass (``kernels/santa/overlap.py``) reads all of K at about 2.5 TB/s under the protocol, while
our dense kernel reads K and V at about 2.75. These probes time, in the same run (graph µs, cold L2):

- ``read-ptr`` / ``read-tma``: the same unit-ordered persistent loop over K that only sums each block (no dot,
  no stores), with pointer loads (cp.async) or with TMA tensor-descriptor loads;
- ``stats-tma``: the stats loop (dot, per-tile max and sum, optional stash) with TMA loads of K;
- ``dense``: our dense decode (K and V), for its bytes per µs.

``--ceiling`` times, per context, what bounds any method that reads all of K once: an empty kernel (the fixed
cost of a call under the protocol), the fastest K read of the grid (TMA, no stores), the TMA stats loop with the
float32 stash (K read once plus the stash written, which S²ANTA's two-pass form needs), the santa defaults and
FlashInfer, all in one run, and writes the ratios FlashInfer / each.

Run on the GPU machine: ``python benchmarks/santa_kernels/probe_k_stream.py --contexts 32k,128k``; ``--check``
compares the TMA stats with the reference's tile statistics on a small case first (also under
``TRITON_INTERPRET=1``). The grid's rows of the shipped stats pass with and without its stash and tile counters
(``docs/results/studies/santa-kernels/results/``) came from switches the kernels no longer have.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from kvsieve.cli.bench import parse_sizes  # noqa: E402
from kvsieve.kernels.santa.reference import n_tiles, tile_statistics  # noqa: E402


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


@triton.jit
def _read_kernel(k_ptr, k_desc, out_ptr, n_tiles, n_units, rounds, n_keys,
                 D: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    SUBS: tl.constexpr = TILE // BLOCK_N
    p = tl.program_id(0)
    n_programs = tl.num_programs(0)
    total = n_units * n_tiles
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    for j in range(0, rounds * SUBS):
        sub = j % SUBS
        tile_id = (j // SUBS) * n_programs + p
        tile_id = tl.where(tile_id < total, tile_id, 0)
        row = (tile_id // n_tiles) * n_keys + (tile_id % n_tiles) * TILE + sub * BLOCK_N
        if TMA:
            k = k_desc.load([row, 0])
        else:
            k = tl.load(k_ptr + (row + tl.arange(0, BLOCK_N))[:, None] * D + tl.arange(0, D)[None, :])
        acc += k.to(tl.float32)
    tl.store(out_ptr + p, tl.sum(acc))


@triton.jit
def _stats_tma_kernel(q_ptr, k_desc, m_ptr, l_ptr, stash_ptr, scale, n_tiles, hkv, n_units, rounds, n_keys,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                      BLOCK_N: tl.constexpr, STASH: tl.constexpr):
    SUBS: tl.constexpr = TILE // BLOCK_N
    p = tl.program_id(0)
    n_programs = tl.num_programs(0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_ok = offs_g < G
    total = n_units * n_tiles
    hq = hkv * G
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    for j in range(0, rounds * SUBS):
        sub = j % SUBS
        tile_id = (j // SUBS) * n_programs + p
        live = tile_id < total
        tile_id = tl.where(live, tile_id, 0)
        u = tile_id // n_tiles
        t = tile_id % n_tiles
        b = u // hkv
        heads = (u % hkv) * G + offs_g
        q = tl.load(q_ptr + (b * hq + heads)[:, None] * D + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        k = k_desc.load([u * n_keys + t * TILE + sub * BLOCK_N, 0])
        s = tl.dot(q, tl.trans(k)) * scale
        offs_n = t * TILE + sub * BLOCK_N + tl.arange(0, BLOCK_N)
        g_live = offs_g < tl.where(live, G, 0)
        if STASH:
            tl.store(stash_ptr + (b * hq + heads)[:, None] * (n_tiles * TILE) + offs_n[None, :], s,
                     mask=g_live[:, None])
        first = sub == 0
        m = tl.where(first, float("-inf"), m)
        l = tl.where(first, 0.0, l)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
        g_done = offs_g < tl.where(live & (sub == SUBS - 1), G, 0)
        ml = (b * hq + heads) * n_tiles + t
        tl.store(m_ptr + ml, m, mask=g_done)
        tl.store(l_ptr + ml, l, mask=g_done)


def _k_desc(k, block_n):
    b, hkv, n, d = k.shape
    return TensorDescriptor.from_tensor(k.view(b * hkv * n, d), [block_n, d])


def read_call(k, tile=256, block_n=128, programs=528, num_warps=4, num_stages=2, tma=False):
    b, hkv, n, d = k.shape
    t = n_tiles(n, tile)
    units = b * hkv
    out = torch.empty(programs, device=k.device)
    desc = _k_desc(k, block_n)
    rounds = -(-units * t // programs)
    return lambda: _read_kernel[(programs,)](k, desc, out, t, units, rounds, n, D=d, TILE=tile, BLOCK_N=block_n,
                                             TMA=tma, num_warps=num_warps, num_stages=num_stages)


def stats_tma_call(q, k, tile=256, block_n=128, programs=528, num_warps=4, num_stages=2, stash=True):
    b, hq, d = q.shape
    _, hkv, n, _ = k.shape
    t = n_tiles(n, tile)
    units = b * hkv
    m = torch.empty(b * hq * t, device=q.device)
    l = torch.empty_like(m)
    st = torch.empty(b * hq * t * tile, device=q.device)
    desc = _k_desc(k, block_n)
    rounds = -(-units * t // programs)
    g = hq // hkv

    def call():
        _stats_tma_kernel[(programs,)](q, desc, m, l, st, d ** -0.5, t, hkv, units, rounds, n, G=g,
                                       BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, TILE=tile, BLOCK_N=block_n,
                                       STASH=stash, num_warps=num_warps, num_stages=num_stages)
        return m, l, st
    return call


def check(device: str) -> bool:
    """TMA stats against the reference's tile statistics (m, l, and the stash = the scores) on a small case."""
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's dot mishandles bf16
    q = torch.randn(2, 8, 64, device=device, generator=g).to(dtype)
    k = torch.randn(2, 2, 512, 64, device=device, generator=g).to(dtype)
    m, l, st = stats_tma_call(q, k, tile=64, block_n=32, programs=5)()
    scores = torch.einsum("bkgd,bknd->bkgn", q.double().view(2, 2, 4, 64), k.double()).reshape(2, 8, 512) * 64 ** -0.5
    m0, _, l0 = tile_statistics(scores, 64)
    ok = (torch.allclose(m.double(), m0.flatten(), atol=1e-3) and torch.allclose(l.double(), l0.flatten(), rtol=1e-3)
          and torch.allclose(st.double(), scores.flatten(), atol=1e-3))
    print(f"CHECK tma stats vs reference tile statistics: ok {ok}")
    return ok


def _ceiling_calls(flashinfer, q, k, v, lens) -> dict:
    from kvsieve.kernels.santa.decode import santa_flash_triton, santa_prop_triton

    kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
    q0 = q[0]
    one = torch.empty(1, device="cuda")
    return {"flashinfer": lambda: flashinfer.single_decode_with_kv_cache(q0, kn, vn, kv_layout="NHD"),
            "empty-kernel": lambda: _empty_kernel[(1,)](one),
            "k-read-tma": read_call(k, programs=264, tma=True),
            "k-read-tma-p528": read_call(k, programs=528, tma=True),
            "k-stats-tma-stash": stats_tma_call(q, k, programs=528),
            "santa-prop:128": lambda: santa_prop_triton(q, k, v, lens, 128 ** -0.5, 128, 256, 0)[0],
            "santa-flash:2048": lambda: santa_flash_triton(q, k, v, lens, 128 ** -0.5, 2048, 256, 0)[0]}


def _grid_calls(q, k, v, lens) -> dict:
    from kvsieve.kernels.shared.dense import dense_decode_triton

    calls = {"dense": lambda: dense_decode_triton(q, k, v, lens, 128 ** -0.5)}
    for tma in (False, True):
        for w, bn, st, p in ((4, 128, 2, 528), (4, 128, 3, 528), (8, 128, 2, 264), (4, 64, 4, 528),
                             (8, 256, 2, 264), (4, 128, 2, 264)):
            calls[f"read-{'tma' if tma else 'ptr'}-w{w}-b{bn}-s{st}-p{p}"] = read_call(
                k, block_n=bn, programs=p, num_warps=w, num_stages=st, tma=tma)
    for w, bn, st, p in ((4, 128, 2, 528), (4, 128, 3, 528), (8, 128, 2, 264), (8, 128, 3, 264),
                         (4, 64, 3, 528), (4, 128, 4, 264)):
        for stash in (True, False):
            calls[f"stats-tma-w{w}-b{bn}-s{st}-p{p}-stash{int(stash)}"] = stats_tma_call(
                q, k, block_n=bn, programs=p, num_warps=w, num_stages=st, stash=stash)
    return calls


def ceiling(timer, contexts, out: Path) -> int:
    import flashinfer

    rows = []
    for n in contexts:
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
        k = torch.randn(1, 8, n, 128, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(1, 8, n, 128, device="cuda", generator=g).to(torch.bfloat16)
        lens = torch.full((1,), n, device="cuda", dtype=torch.int32)
        calls = _ceiling_calls(flashinfer, q, k, v, lens)
        times = {}
        for name, fn in calls.items():
            r = timer.time_graph_us(fn, warmup=3, iters=30)
            times[name] = r["median_us"]
            print(f"CEILING n={n} {name}: {r['median_us']:.1f} µs", flush=True)
        fi = times["flashinfer"]
        best_read = min(times["k-read-tma"], times["k-read-tma-p528"])
        row = {"n": n, "us": times, "flashinfer_over_k_read": round(fi / best_read, 3),
               "flashinfer_over_k_stats_stash": round(fi / times["k-stats-tma-stash"], 3),
               "flashinfer_over_prop": round(fi / times["santa-prop:128"], 3),
               "flashinfer_over_flash": round(fi / times["santa-flash:2048"], 3)}
        rows.append(row)
        print("CEILING " + json.dumps(row), flush=True)
        del q, k, v, calls
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rows": rows}
    (out / "k_stream_ceiling.json").write_text(json.dumps(report, indent=1))
    write_ceiling_report(report, out / "k_stream_ceiling")
    return 0


CEILING_COLUMNS = (("flashinfer", "FlashInfer"), ("empty-kernel", "empty kernel"), ("k-read-tma", "K read"),
                   ("k-stats-tma-stash", "K stats + stash"), ("santa-prop:128", "santa-prop S=128"),
                   ("santa-flash:2048", "santa-flash S=2048"))


def write_ceiling_report(report: dict, stem: Path) -> None:
    """``stem``.md (µs and FlashInfer's time over each) and ``stem``.png (the ratios against context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = " | ".join(label for _, label in CEILING_COLUMNS)
    lines = [f"# What bounds a method that reads all of K once ({report['device']}, torch {report['torch']}, "
             f"Triton {report['triton']})", "",
             "Graph µs, L2 flushed before every call (median of 30); llama 32/8/128, bf16, batch 1. In brackets: "
             "FlashInfer's time over each (the speedup it would have). `K read`: the faster of the TMA read probes "
             "(264 or 528 programs, no stores); `K stats + stash`: scores, per-tile max and sum and the float32 stash "
             "(TMA loads, 528 programs), what S²ANTA's first pass must do. Command: "
             "`python benchmarks/santa_kernels/probe_k_stream.py --ceiling --contexts 8k,16k,32k,64k,128k,256k`.", "",
             f"| n | {head} |", "|---:|" + "---:|" * len(CEILING_COLUMNS)]
    for row in report["rows"]:
        us = dict(row["us"])
        us["k-read-tma"] = min(us["k-read-tma"], us["k-read-tma-p528"])
        cells = []
        for key, _ in CEILING_COLUMNS:
            ratio = "" if key in ("flashinfer", "empty-kernel") else f" ({us['flashinfer'] / us[key]:.2f}x)"
            cells.append(f"{us[key]:.1f}{ratio}")
        lines.append(f"| {row['n'] // 1024}k | " + " | ".join(cells) + " |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ns = [row["n"] for row in report["rows"]]
    for key, label in CEILING_COLUMNS[2:]:
        ratios = [row["us"]["flashinfer"] / (min(row["us"]["k-read-tma"], row["us"]["k-read-tma-p528"])
                                             if key == "k-read-tma" else row["us"][key]) for row in report["rows"]]
        ax.plot(ns, ratios, marker="o", linestyle="--" if key.startswith("k-") else "-", label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [f"{n // 1024}k" for n in ns])
    ax.set_xlabel("context n (keys)")
    ax.set_ylabel("FlashInfer µs / µs (speedup)")
    ax.set_title("Speedup over FlashInfer: our kernels and the K-stream bounds (H100)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="32k,128k")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--ceiling", action="store_true", help="the bounds above, per context, against FlashInfer")
    ap.add_argument("--report", default=None, help="only write the .md and .png of a --ceiling JSON")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.report:
        path = Path(args.report)
        write_ceiling_report(json.loads(path.read_text()), path.with_suffix(""))
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    if args.check and not check(device):
        return 2
    if device != "cuda":
        return 0
    from kvsieve.bench.timing import ColdL2Timer

    timer = ColdL2Timer()
    if args.ceiling:
        return ceiling(timer, parse_sizes(args.contexts), Path(args.out))
    rows = []
    for n in parse_sizes(args.contexts):
        g = torch.Generator(device=device).manual_seed(1)
        q = torch.randn(1, 32, 128, device=device, generator=g).to(torch.bfloat16)
        k = torch.randn(1, 8, n, 128, device=device, generator=g).to(torch.bfloat16)
        v = torch.randn(1, 8, n, 128, device=device, generator=g).to(torch.bfloat16)
        lens = torch.full((1,), n, device=device, dtype=torch.int32)
        calls = _grid_calls(q, k, v, lens)
        kv_bytes = k.numel() * k.element_size()
        for name, fn in calls.items():
            try:
                r = timer.time_graph_us(fn, warmup=3, iters=20)
            except Exception as exc:  # noqa: BLE001 - a probe that fails is recorded, not fatal
                r = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            us = r.get("median_us")
            bytes_read = kv_bytes * (2 if name == "dense" else 1)
            row = {"n": n, "variant": name, **r, "k_tb_s": round(bytes_read / us / 1e6, 3) if us else None}
            rows.append(row)
            print(f"PROBE n={n} {name}: {us} µs, {row['k_tb_s']} TB/s", flush=True)
    Path(args.out, "probe_k_stream.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
