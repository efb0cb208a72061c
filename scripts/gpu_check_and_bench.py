"""The one script sent to the GPU machine: check every Triton kernel against its float64 reference,
then time everything (``kvsieve bench decode``), writing under ``$OUT`` (or ``--out``).

    python scripts/gpu_check_and_bench.py --check --stats --host --sweep-prop \
        --bench "--shapes llama-3.1-8b --batches 1"

Checks: random data (never zeros), many shapes (batch, GQA group 1/3/4, head dim 64/128, N not a
multiple of the tile, N < S, one tile, ragged lengths), bf16/fp16/fp32; outputs poisoned with NaN
before each call and required finite afterwards; dense against exact attention; santa-flash and
santa-prop (largest remainder and systematic rounding) against the references fed the kernels'
uniforms: counts (fraction of keys that differ), tile budgets, outputs. Statistics: the mean over
many seeds against exact attention (z-scores from the measured per-coordinate spread).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvsieve.cli.bench import parse_sizes  # noqa: E402
from kvsieve.core.inputs import check_decode_inputs  # noqa: E402
from kvsieve.kernels.dense import dense_decode_triton  # noqa: E402
from kvsieve.kernels.santa.kernels import santa_flash_triton, santa_prop_triton  # noqa: E402
from kvsieve.kernels.santa.reference import santa_flash_reference, santa_prop_reference  # noqa: E402
from kvsieve.kernels.triton_utils import budget_uniforms, tile_uniforms  # noqa: E402
from kvsieve.methods.shared.exact import exact_attention  # noqa: E402

DEVICE = os.environ.get("KVSIEVE_CHECK_DEVICE", "cuda")  # "cpu" with TRITON_INTERPRET=1 to dry-run here
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-4}
# (key, rounding, options): the default path (the merge folded into the sampling pass: 3 launches) and
# the 4-launch path with the merge kernel
PROP_VARIANTS = [
    ("prop_lr", "largest-remainder", {"compact": True, "overlap": False}),
    ("prop_sys", "systematic", {"compact": True, "overlap": False}),
    ("prop_lr_inline", "largest-remainder", {"compact": True, "inline_budgets": True}),
    ("prop_lr_v7", "largest-remainder", {"compact": False}),
    ("prop_lr_v10", "largest-remainder", {"overlap": True}),
    ("prop_sys_v10", "systematic", {"overlap": True}),
    ("prop_lr_default", "largest-remainder", {}),  # the path a caller who names none gets (v8 or v10 by length)
]
# santa-flash: v8 (stats + compacted sampling, merge folded), the fused kernel (v6/v7 default), v10 (overlapped)
FLASH_VARIANTS = [
    ("flash_v8", {"fused": False, "fold_merge": True}),
    ("flash_fused", {"fused": True}),
    ("flash_v10", {"overlap": True}),
    ("flash_default", {}),
]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def random_case(b, hq, hkv, n, d, dtype, lens, seed, peaked=1.5):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = (torch.randn(b, hq, d, device=DEVICE, generator=g) * peaked).to(dtype)
    k = torch.randn(b, hkv, n, d, device=DEVICE, generator=g).to(dtype)
    v = torch.randn(b, hkv, n, d, device=DEVICE, generator=g).to(dtype)
    lens_t = torch.tensor(lens, device=DEVICE, dtype=torch.int64)
    inp = check_decode_inputs(q.double(), k.double(), v.double(), lengths=lens_t)
    return q, k, v, lens_t.to(torch.int32), inp


def check_kernels(log, quick: bool = False, only: str | None = None) -> list[dict]:
    cases = []
    # (B, Hq, Hkv, N, d, lens, S, tile)
    shapes = [
        (1, 32, 8, 4096 + 17, 128, [4096 + 17], 128, 256),
        (1, 32, 8, 20000, 128, [20000], 2048, 256),
        (2, 32, 8, 9000, 128, [9000, 5000], 256, 256),
        (3, 9, 3, 3000, 64, [3000, 1, 2047], 64, 64),
        (2, 9, 3, 700, 64, [700, 333], 1024, 32),      # N < S
        (1, 8, 8, 1000, 128, [1000], 128, 32),         # G = 1
        (2, 12, 4, 200, 64, [200, 150], 16, 256),      # one tile
        (1, 16, 4, 70000, 128, [70000], 128, 256),     # many tiles
        (1, 16, 4, 5000, 64, [5000], 4096, 256),       # counts > 256 per key possible (bf16 split dots)
    ]
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    if quick:
        shapes = [(3, 9, 3, 300, 64, [300, 1, 200], 64, 32), (2, 12, 4, 200, 64, [200, 150], 16, 256)]
        dtypes = (torch.float16, torch.float32)
    picked = None
    if only:  # "bf16:0,1,7": those shape indices in those dtypes (a short first pass on the device)
        names, _, idx = only.partition(":")
        dtypes = tuple({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[x]
                       for x in names.split(","))
        picked = {int(i) for i in idx.split(",")} if idx else None
    for dtype in dtypes:
        for i, (b, hq, hkv, n, d, lens, s, tile) in enumerate(shapes):
            if picked is not None:
                if i not in picked:
                    continue
            elif dtype != torch.bfloat16 and i % 2 and not quick:
                continue
            seed = 1000 + i
            q, k, v, lens32, inp = random_case(b, hq, hkv, n, d, dtype, lens, seed)
            scale = d ** -0.5
            exact = exact_attention(inp)
            t = -(-n // tile)
            row = {"dtype": str(dtype).replace("torch.", ""), "B": b, "Hq": hq, "Hkv": hkv, "N": n, "d": d,
                   "lens": lens, "S": s, "tile": tile}
            out = torch.full((b, hq, d), float("nan"), device=DEVICE, dtype=dtype)
            dense_decode_triton(q, k, v, lens32, scale, out=out)
            row["dense_finite"] = bool(torch.isfinite(out).all())
            row["dense_err"] = rel(out, exact)
            tu = tile_uniforms(seed, b, hq, t, device=DEVICE)
            ref = santa_flash_reference(inp.scores(torch.float64), inp.v, s, tile, tile_offsets=tu)
            for key, opts in FLASH_VARIANTS:
                out = torch.full((b, hq, d), float("nan"), device=DEVICE, dtype=dtype)
                _, c = santa_flash_triton(q, k, v, lens32, scale, s, tile, seed, write_counts=True, out=out, **opts)
                row[f"{key}_finite"] = bool(torch.isfinite(out).all())
                row[f"{key}_count_mismatch"] = float((c.long() != ref.counts).double().mean())
                row[f"{key}_err_vs_ref"] = rel(out, ref.out)
            refs = {}
            for key, rounding, opts in PROP_VARIANTS:
                out = torch.full((b, hq, d), float("nan"), device=DEVICE, dtype=dtype)
                _, c, bud = santa_prop_triton(q, k, v, lens32, scale, s, tile, seed, rounding=rounding,
                                              write_counts=True, out=out, **opts)
                if rounding not in refs:
                    scores64 = inp.scores(torch.float64)
                    refs[rounding] = santa_prop_reference(scores64, inp.v, s, tile, rounding=rounding, tile_offsets=tu,
                                                          budget_offset=budget_uniforms(seed, b, hq, device=DEVICE))
                ref = refs[rounding]
                row[f"{key}_finite"] = bool(torch.isfinite(out).all())
                row[f"{key}_budget_sum_ok"] = bool((bud.sum(-1) == s).all())
                row[f"{key}_budget_mismatch"] = float((bud.long() != ref.tile_budgets).double().mean())
                row[f"{key}_count_mismatch"] = float((c.long() != ref.counts).double().mean())
                row[f"{key}_err_vs_ref"] = rel(out, ref.out)
            tol = TOL[dtype]
            props = [key for key, _, _ in PROP_VARIANTS]
            flashes = [key for key, _ in FLASH_VARIANTS]
            ok = all(row[f"{p}_finite"] for p in ("dense", *flashes, *props))
            ok &= row["dense_err"] < tol and all(row[f"{p}_budget_sum_ok"] for p in props)
            for p in (*flashes, *props):
                ok &= row[f"{p}_count_mismatch"] < 1e-3 and row[f"{p}_err_vs_ref"] < max(tol, 2e-2)
            row["ok"] = bool(ok)
            log(("PASS " if ok else "FAIL ") + json.dumps(row))
            cases.append(row)
    return cases


def check_statistics(log, seeds: int = 512) -> list[dict]:
    """Mean over seeds vs exact attention: z² per coordinate should average ≈ 1 for unbiased kernels."""
    rows = []
    b, hq, hkv, n, d = 1, 8, 2, 3000, 64
    q, k, v, lens32, inp = random_case(b, hq, hkv, n, d, torch.float32, [n], 7, peaked=2.0)
    exact = exact_attention(inp)
    for name, _budget, fn in (
        ("santa-flash S=256 tile=64", 256,
         lambda sd: santa_flash_triton(q, k, v, lens32, d ** -0.5, 256, 64, sd)[0]),
        ("santa-prop sys S=64 tile=64", 64,
         lambda sd: santa_prop_triton(q, k, v, lens32, d ** -0.5, 64, 64, sd, rounding="systematic")[0]),
        ("santa-prop LR S=64 tile=64 (biased by design)", 64,
         lambda sd: santa_prop_triton(q, k, v, lens32, d ** -0.5, 64, 64, sd)[0]),
    ):
        outs = torch.stack([fn(sd).double() for sd in range(seeds)])
        mean, sd_ = outs.mean(0), outs.std(0)
        z = (mean - exact) / (sd_ / math.sqrt(seeds)).clamp_min(1e-12)
        row = {"kernel": name, "seeds": seeds, "mean_z2": float((z**2).mean()), "max_abs_z": float(z.abs().max()),
               "rel_err_single": float((outs[0] - exact).norm() / exact.norm()),
               "rel_err_mean": float((mean - exact).norm() / exact.norm())}
        log(json.dumps(row))
        rows.append(row)
    return rows


def sweep(log) -> list[dict]:
    """Launch configurations of each pass alone (llama shapes, batch 1, cold L2, CUDA-graph replay so
    that host launch cost does not blur the device times)."""
    from functools import partial

    from kvsieve.bench.timing import ColdL2Timer
    from kvsieve.kernels.santa.kernels import _tile_sample, _tile_stats

    timer = ColdL2Timer()
    rows = []
    scale = 128 ** -0.5
    for n in (32768, 131072):
        q, k, v, lens32 = _llama_inputs(n)
        configs = []
        for block_n in (64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    cfg = {"kernel": "dense", "block_n": block_n, "warps": warps, "stages": stages}
                    configs.append((cfg, partial(dense_decode_triton, q, k, v, lens32, scale, block_n=block_n,
                                                 num_warps=warps, num_stages=stages)))
        for block_n in (64, 128):
            for warps in (4, 8):
                for programs in (132, 264, 528):
                    cfg = {"kernel": "stats", "block_n": block_n, "warps": warps, "programs": programs}
                    configs.append((cfg, partial(_tile_stats, q, k, lens32, scale, 256, block_n=block_n,
                                                 num_warps=warps, num_stages=3, stats_programs=programs)))
        m, l, stash = _tile_stats(q, k, lens32, scale, 256, block_n=64, num_warps=4, num_stages=3,
                                  stats_programs=264)
        _, _, budgets = santa_prop_triton(q, k, v, lens32, scale, 128, 256, 0)
        for sample_n in (64, 128, 256):
            for warps in (2, 4, 8):
                for stages in (1, 2, 3):
                    cfg = {"sample_n": sample_n, "warps": warps, "stages": stages}
                    configs.append(({"kernel": "prop-sample", **cfg},
                                    partial(_tile_sample, v, lens32, m, l, stash, budgets, 128, 256, 0, flash=False,
                                            write_counts=False, sample_n=sample_n, num_warps=warps,
                                            num_stages=stages)))
                    configs.append(({"kernel": "flash-sample", **cfg},
                                    partial(_tile_sample, v, lens32, m, l, stash, None, 2048, 256, 0, flash=True,
                                            write_counts=False, sample_n=sample_n, num_warps=warps,
                                            num_stages=stages)))
        for block_n in (64, 128):
            for sample_n in (64, 256):
                for warps in (4, 8):
                    cfg = {"kernel": "flash-fused", "block_n": block_n, "sample_n": sample_n, "warps": warps}
                    configs.append((cfg, partial(santa_flash_triton, q, k, v, lens32, scale, 2048, 256, 0,
                                                 fused=True, block_n=block_n, sample_n=sample_n, num_warps=warps)))
        for cfg, fn in configs:
            try:
                r = timer.time_graph_us(fn, warmup=3, iters=15)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is recorded, not fatal
                r = {"error": str(exc)[:200]}
            rows.append({"n": n, **cfg, **r})
            log(f"SWEEP n={n} {cfg} {r.get('median_us', r.get('error'))}")
    best = {}
    for r in rows:
        if "median_us" in r:
            key = (r["kernel"], r["n"])
            if key not in best or r["median_us"] < best[key]["median_us"]:
                best[key] = r
    for r in best.values():
        log("BEST " + json.dumps(r))
    return rows


def host_overhead(log) -> list[dict]:
    """Host µs per eager call of each wrapper, llama shape at 32k, batch 1: a CPU timer around the
    call with the GPU idle (synchronised before each call; median of 200), with the launch cache and
    workspaces on (the default) and off (``kernel[grid]`` launches, fresh buffers: the earlier path)."""
    import statistics

    from kvsieve.kernels import triton_utils

    n, scale = 32768, 128 ** -0.5
    q, k, v, lens32 = _llama_inputs(n, seed=3)
    calls = {
        "dense": lambda: dense_decode_triton(q, k, v, lens32, scale),
        "santa-prop:128": lambda: santa_prop_triton(q, k, v, lens32, scale, 128, 256, 0),
        "santa-prop-4launch:128": lambda: santa_prop_triton(q, k, v, lens32, scale, 128, 256, 0, fold_merge=False),
        "santa-flash:2048": lambda: santa_flash_triton(q, k, v, lens32, scale, 2048, 256, 0),
    }
    try:
        import flashinfer

        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        calls["flashinfer"] = lambda: flashinfer.single_decode_with_kv_cache(q[0], kn, vn, kv_layout="NHD")
    except Exception as exc:  # noqa: BLE001 - FlashInfer is optional here
        log(f"host overhead: no FlashInfer ({exc})")
    rows = []
    for fast in (False, True):
        triton_utils.FAST_HOST_PATH = fast
        for name, fn in calls.items():
            if name == "flashinfer" and not fast:
                continue
            for _ in range(5):
                fn()
            times = []
            for _ in range(200):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            row = {"call": name, "fast_host_path": fast, "host_us_median": statistics.median(times),
                   "host_us_p10": sorted(times)[20]}
            log("HOST " + json.dumps(row))
            rows.append(row)
    triton_utils.FAST_HOST_PATH = True
    return rows


def sweep_prop(log) -> list[dict]:
    """santa-prop S=128 whole calls (llama shape, batch 1, cold L2, CUDA-graph replay): 4 launches
    against the folded merge (3 launches)."""
    from kvsieve.bench.timing import ColdL2Timer

    timer = ColdL2Timer()
    rows = []
    scale = 128 ** -0.5
    for n in (32768, 131072):
        q, k, v, lens32 = _llama_inputs(n)
        configs = [{"fold_merge": False}, {}, {"sample_warps": 4}]
        for cfg in configs:
            def fn(cfg=cfg, q=q, k=k, v=v, lens32=lens32):
                return santa_prop_triton(q, k, v, lens32, scale, 128, 256, 0, **cfg)[0]
            try:
                r = timer.time_graph_us(fn, warmup=3, iters=20)
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile is recorded, not fatal
                r = {"error": str(exc)[:200]}
            rows.append({"n": n, **cfg, **r})
            log(f"SWEEP-PROP n={n} {cfg} {r.get('median_us', r.get('error'))}")
    return rows


def _llama_inputs(n: int, seed: int = 1, batch: int = 1):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, 32, 128, device=DEVICE, generator=g).to(torch.bfloat16)
    k = torch.randn(batch, 8, n, 128, device=DEVICE, generator=g).to(torch.bfloat16)
    v = torch.randn(batch, 8, n, 128, device=DEVICE, generator=g).to(torch.bfloat16)
    lens32 = torch.full((batch,), n, device=DEVICE, dtype=torch.int32)
    return q, k, v, lens32


def v8_calls(q, k, v, lens32, *, full: bool = True) -> dict:
    """Whole calls (llama shape, S = 128 prop / 2048 flash) of the v7 and v8 paths and their variants."""
    from kvsieve.kernels.santa import kernels as triton_santa

    scale = 128 ** -0.5
    tile = 256

    def prop(**o):
        o.setdefault("compact", True)
        o.setdefault("overlap", False)
        return lambda: santa_prop_triton(q, k, v, lens32, scale, 128, tile, 0, **o)[0]

    def flash(**o):
        o.setdefault("fused", False)
        o.setdefault("overlap", False)
        return lambda: santa_flash_triton(q, k, v, lens32, scale, 2048, tile, 0, **o)[0]

    def pdl(fn):
        """``fn`` with programmatic dependent launch on (the module flag is read at launch time)."""
        def call():
            with triton_santa.programmatic_dependent_launch(True):
                return fn()
        return call

    calls = {}
    try:
        import flashinfer

        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        q0 = q[0]
        calls["flashinfer"] = lambda: flashinfer.single_decode_with_kv_cache(q0, kn, vn, kv_layout="NHD")
    except Exception:  # noqa: BLE001 - FlashInfer is optional here
        pass
    calls.update({
        "dense": lambda: dense_decode_triton(q, k, v, lens32, scale),
        "prop-v7": prop(compact=False),
        "prop-v8": prop(),
        "flash-fused-v7": flash(fused=True),
        "flash-v8": flash(),
    })
    if full:
        calls.update({
            "prop-v8-inline": prop(inline_budgets=True),
            "prop-v8-rank": prop(rank_budgets=True),
            "prop-v8-w2": prop(sample_warps=2),
            "prop-v8-w8": prop(sample_warps=8),
            "prop-v8-r32": prop(r_max=32),
            "prop-v8-pdl": pdl(prop()),
            "prop-v8-rank-pdl": pdl(prop(rank_budgets=True)),
            "flash-v8-w2": flash(sample_warps=2),
            "flash-v8-w8": flash(sample_warps=8),
            "flash-v8-r16": flash(r_max=16),
            "flash-v8-r32": flash(r_max=32),
            "flash-v8-r64": flash(r_max=64),
            "flash-v8-pdl": pdl(flash()),
        })
    return calls


TIMELINE_CALLS = ("prop-v8", "flash-v8", "prop-v10-w4-b128-s2-p528", "flash-v10-w4-b128-s2-p528",
                  "stats-v10-w4-b128-s2-p528", "prop-v10-systematic")


def v10_calls(q, k, v, lens32) -> dict:
    """Whole calls (llama shape, S = 128 prop / 2048 flash): v8 against the overlapped passes (v10), the
    ordered stats pass alone over a grid of launch parameters (warps, key block, stages, programs) and
    without its stash stores or tile counters (what each costs), and the whole v10 calls with the best
    candidates, the sampling kernel's warps and systematic rounding (where the tail after the stream goes).
    Measured and left out since: a register cap on the stats kernel (room for more sampling programs),
    the budget kernel's warps, budgets ranked by several programs per head without a sort (all slower or
    no better; docs/methods/santa-kernels.md)."""
    from kvsieve.kernels.santa import kernels as triton_santa
    from kvsieve.kernels.santa.overlap import ordered_stats_only, santa_overlap_triton

    scale, tile = 128 ** -0.5, 256
    calls = {name: fn for name, fn in v8_calls(q, k, v, lens32, full=False).items()
             if name in ("flashinfer", "dense", "prop-v8", "flash-v8")}

    def v10(flash, **o):
        def call():
            with triton_santa.programmatic_dependent_launch(True):
                return santa_overlap_triton(q, k, v, lens32, scale, 2048 if flash else 128, tile, 0, flash=flash,
                                            **o)[0]
        return call

    calls["stats-v8"] = lambda: triton_santa._tile_stats(q, k, lens32, scale, tile, block_n=64, num_warps=4,
                                                         num_stages=3, stats_programs=264)
    # the ordered stats pass alone (its counters are reset after each timing)
    for w in (4, 8):
        for block_n, stages in ((64, 3), (64, 4), (128, 2), (128, 3), (128, 4), (256, 2)):
            for programs in (264, 528, 792):
                calls[f"stats-v10-w{w}-b{block_n}-s{stages}-p{programs}"] = (
                    lambda w=w, b=block_n, s=stages, p=programs: ordered_stats_only(
                        q, k, lens32, scale, tile, stats_programs=p, block_n=b, num_warps=w, num_stages=s))
    for stash, release in ((False, True), (True, False), (False, False)):
        calls[f"stats-v10-default-stash{int(stash)}-release{int(release)}"] = (
            lambda st=stash, r=release: ordered_stats_only(q, k, lens32, scale, tile, stash=st, release=r))
    for flash, tag in ((False, "prop"), (True, "flash")):
        for w, block_n, stages, programs in ((4, 128, 2, 528), (4, 128, 3, 528), (8, 128, 2, 264), (8, 128, 3, 264),
                                             (8, 128, 2, 528), (8, 64, 3, 528)):
            calls[f"{tag}-v10-w{w}-b{block_n}-s{stages}-p{programs}"] = v10(
                flash, num_warps=w, block_n=block_n, num_stages=stages, stats_programs=programs)
        calls[f"{tag}-v10-naps2"] = v10(flash, naps=2)
        calls[f"{tag}-v10-p396"] = v10(flash, stats_programs=396)
        calls[f"{tag}-v10-p396-sample-w2"] = v10(flash, stats_programs=396, sample_warps=2)
        calls[f"{tag}-v10-sample-w2"] = v10(flash, sample_warps=2)
        calls[f"{tag}-v10-sample-w8"] = v10(flash, sample_warps=8)
    calls["prop-v10-systematic"] = v10(False, rounding="systematic")
    calls["prop-v10-s1"] = lambda: santa_overlap_triton(q, k, v, lens32, scale, 1, tile, 0, flash=False)[0]
    return calls


def kernel_timeline(timer, fn, iters: int = 5) -> dict:
    """Per kernel of one cold-L2 call: mean start and end (µs) from the call's first kernel start (torch
    profiler), to see how long each overlapped kernel runs past the K stream."""
    from torch.profiler import ProfilerActivity, profile

    spans: dict[str, list] = {}
    for _ in range(iters):
        timer.flush()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        t0 = min(e.time_range.start for e in events)
        for e in events:
            spans.setdefault(e.name[:40], []).append((e.time_range.start - t0, e.time_range.end - t0))
    return {name: [round(sum(a for a, _ in v) / len(v), 1), round(sum(b for _, b in v) / len(v), 1)]
            for name, v in spans.items()}


def _traced_units(timer, q, k, v, lens32, flash: bool, opts: dict) -> dict:
    """One v10 call replayed from a CUDA graph with cold L2, its kernels stamping ``%globaltimer``."""
    from kvsieve.kernels.santa.overlap import santa_overlap_triton

    trace: dict = {}

    def call():
        return santa_overlap_triton(q, k, v, lens32, 128 ** -0.5, 2048 if flash else 128, 256, 0, flash=flash,
                                    trace=trace, **opts)[0]

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        timer.flush()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
    units_n = k.shape[0] * k.shape[1]
    tiles = trace["tiles"].view(units_n, -1).double()
    smp = trace["samples"].view(units_n, -1, 3).double()
    bud = trace["budgets"].view(units_n, -1, 2).double()
    t0 = min(float(tiles.min()), float(smp[..., 0].min()))

    def us(x) -> float:
        return round((float(x) - t0) / 1e3, 1)

    units = []
    for u in range(units_n):
        scored = tiles[u].max()
        row = {"unit": u, "scored": us(scored), "sample_first_start": us(smp[u, :, 0].min()),
               "sample_last_start": us(smp[u, :, 0].max()), "sample_last_waited": us(smp[u, :, 1].max()),
               "sample_last_end": us(smp[u, :, 2].max()), "late_starts": int((smp[u, :, 0] > scored).sum())}
        if not flash:
            row["budget_waits_done"] = us(bud[u, :, 0].max())
            row["budgets_raised"] = us(bud[u, :, 1].max())
        units.append(row)
    return {"first_tile_scored": us(tiles.min()), "last_tile_scored": us(tiles.max()), "end": us(smp[..., 2].max()),
            "units": units}


def ragged(log, contexts) -> list[dict]:
    """v8 against v10 on a padded ragged batch (llama shape, batch 8, rows at 1, 3/4, 1/2 and 1/4 of the
    cache, twice): v10's stats pass streams every row up to the cache's length, v8 stops at each row's
    length. Graph µs, cold L2; the uniform batch of the same cache beside it."""
    from kvsieve.bench.timing import ColdL2Timer
    from kvsieve.kernels.santa import kernels as triton_santa

    timer = ColdL2Timer()
    rows = []
    for n in contexts:
        q, k, v, full = _llama_inputs(n, batch=8)
        fractions = torch.tensor([1.0, 0.75, 0.5, 0.25] * 2, device=DEVICE)
        ragged_lens = (fractions * n).to(torch.int32)
        for lens_tag, lens32 in (("uniform", full), ("ragged", ragged_lens)):
            for name, run, opts in (("prop-v8", triton_santa.santa_prop_triton, {"overlap": False}),
                                    ("prop-v10", triton_santa.santa_prop_triton, {"overlap": True}),
                                    ("flash-v8", triton_santa.santa_flash_triton, {"overlap": False, "fused": False}),
                                    ("flash-v10", triton_santa.santa_flash_triton, {"overlap": True})):
                budget = 2048 if name.startswith("flash") else 128

                def call(run=run, opts=opts, budget=budget, lens32=lens32, qkv=(q, k, v)):
                    return run(*qkv, lens32, 128 ** -0.5, budget, 256, 0, **opts)[0]

                r = timer.time_graph_us(call, warmup=3, iters=20)
                rows.append({"n": n, "lengths": lens_tag, "variant": name, **r})
                log(f"RAGGED n={n} {lens_tag} {name}: {r.get('median_us')}")
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def timeline(log, contexts) -> list[dict]:
    """Where the time of a v10 call goes, per (row, KV head) unit, in µs from the call's first stamp: when
    its last tile was scored, when its budgets were raised (prop), the first start and the last end of its
    sampling programs, and how many of them started only after the unit was scored."""
    from kvsieve.bench.timing import ColdL2Timer

    timer = ColdL2Timer()
    rows = []
    for n in contexts:
        q, k, v, lens32 = _llama_inputs(n)
        for tag, flash, opts in (("prop", False, {}), ("prop-systematic", False, {"rounding": "systematic"}),
                                 ("flash", True, {})):
            row = {"n": n, "variant": tag, **_traced_units(timer, q, k, v, lens32, flash, opts)}
            rows.append(row)
            log(f"TIMELINE n={n} {tag}: first tile {row['first_tile_scored']}, last tile {row['last_tile_scored']}, "
                f"end {row['end']} µs")
            for x in row["units"]:
                log("  " + json.dumps(x))
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def sweep_v8(log, contexts=(32768, 131072), calls_of=None, tag: str = "V8", only: str | None = None) -> list[dict]:
    """v7 against v8 and the v8 launch variants (or ``calls_of``'s calls), whole calls, graph-timed (cold
    L2), with the per-kernel breakdown of the main ones."""
    from kvsieve.bench.timing import ColdL2Timer
    from kvsieve.kernels.santa.overlap import reset_sync

    timer = ColdL2Timer()
    rows = []
    for n in contexts:
        q, k, v, lens32 = _llama_inputs(n)
        calls = (calls_of or (lambda *a: v8_calls(*a, full=True)))(q, k, v, lens32)
        for name, fn in calls.items():
            if only and not re.search(only, name):
                continue
            try:
                r = timer.time_graph_us(fn, warmup=3, iters=20)
            except Exception as exc:  # noqa: BLE001 - a variant that fails is recorded, not fatal
                r = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if name.startswith("stats-v10"):
                torch.cuda.synchronize()
                reset_sync(q)
            row = {"n": n, "variant": name, **r}
            if "error" not in r and name in ("prop-v7", "prop-v8", "prop-v8-inline", "prop-v8-rank", "flash-fused-v7",
                                             "flash-v8", "dense", "flashinfer"):
                row["kernels_us"] = timer.kernel_breakdown(fn)
            if "error" not in r and name in TIMELINE_CALLS:
                try:
                    row["timeline_us"] = kernel_timeline(timer, fn)
                except Exception as exc:  # noqa: BLE001 - the profiler is optional; the sweep goes on
                    row["timeline_us"] = f"{type(exc).__name__}: {exc}"[:200]
                finally:
                    if name.startswith("stats-v10"):
                        torch.cuda.synchronize()
                        reset_sync(q)
                log(f"{tag} n={n} {name} timeline (start, end µs): {json.dumps(row['timeline_us'])}")
            rows.append(row)
            kern = ", ".join(f"{a[:24]} {b:.1f}" for a, b in (row.get("kernels_us") or {}).items())
            log(f"{tag} n={n} {name}: {r.get('median_us', r.get('error'))} {kern}")
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def compiled_resources(log) -> list[dict]:
    """Registers, spills and shared memory of every kernel the launch cache compiled."""
    from kvsieve.kernels import triton_utils

    rows = []
    for key, (compiled, _constexprs) in triton_utils._COMPILED.items():
        meta = key[2]
        row = {"kernel": compiled.name, "meta": [str(x) for x in meta], "n_regs": getattr(compiled, "n_regs", None),
               "n_spills": getattr(compiled, "n_spills", None),
               "shared": getattr(getattr(compiled, "metadata", None), "shared", None)}
        rows.append(row)
        log("COMPILED " + json.dumps(row))
    return rows


def smoke(n: int = 32768) -> int:
    """Each v8 path once on the llama shape (bf16) against the v7 path of the same seed: same budgets,
    counts up to floor-boundary flips, outputs up to bf16 rounding. Run first in its own process, so
    that a kernel fault cannot take the timings with it. Exit 2 when a path failed, else 0."""
    q, k, v, lens32 = _llama_inputs(n)
    scale, tile, bad = 128 ** -0.5, 256, 0
    o7, c7, b7 = santa_prop_triton(q, k, v, lens32, scale, 128, tile, 0, compact=False, write_counts=True)
    f7, fc7 = santa_flash_triton(q, k, v, lens32, scale, 2048, tile, 0, fused=True, write_counts=True)
    from kvsieve.kernels.santa import kernels as triton_santa

    cases = [("prop", o) for o in ({"compact": True}, {"compact": True, "inline_budgets": True},
                                   {"compact": True, "rank_budgets": True}, {"compact": True, "pdl": True},
                                   {"compact": True, "r_max": 32})]
    cases += [("flash", o) for o in ({"fused": False}, {"fused": False, "pdl": True}, {"fused": False, "r_max": 16})]
    v10_opts = ({"pdl": True}, {"pdl": False}, {"pdl": True, "stats_programs": 528, "block_n": 128, "num_stages": 2},
                {"pdl": True, "num_warps": 8, "stats_programs": 264, "num_stages": 3})
    cases += [("prop10", o) for o in v10_opts] + [("flash10", o) for o in v10_opts]
    from kvsieve.kernels.santa.overlap import santa_overlap_triton

    for kind, o in cases:
        o = dict(o)
        pdl_on = o.pop("pdl", False)
        if kind in ("prop", "flash"):  # the v7/v8 paths by name (v10 is the default from 1,024/2,048 tiles in all)
            o.setdefault("overlap", False)
        try:
            with triton_santa.programmatic_dependent_launch(pdl_on):
                if kind in ("prop10", "flash10"):  # twice: the sync words must reset
                    flash = kind.startswith("flash")
                    for _ in range(2):
                        o8, c8, b8 = santa_overlap_triton(q, k, v, lens32, scale, 2048 if flash else 128, tile, 0,
                                                          flash=flash, write_counts=True, **o)
                    torch.cuda.synchronize()
                    same_budgets = flash or bool(torch.equal(b7, b8))
                    ref_o, ref_c = (f7, fc7) if flash else (o7, c7)
                elif kind == "prop":
                    o8, c8, b8 = santa_prop_triton(q, k, v, lens32, scale, 128, tile, 0, write_counts=True, **o)
                    same_budgets = bool(torch.equal(b7, b8))
                    ref_o, ref_c = o7, c7
                else:
                    o8, c8 = santa_flash_triton(q, k, v, lens32, scale, 2048, tile, 0, write_counts=True, **o)
                    same_budgets = True
                    ref_o, ref_c = f7, fc7
                torch.cuda.synchronize()
                mis, err = float((ref_c != c8).double().mean()), rel(o8, ref_o)
                ok = same_budgets and mis < 1e-4 and err < 2e-2
                print(f"SMOKE {kind} {o} pdl={pdl_on}: ok {ok}, budgets equal {same_budgets}, "
                      f"count mismatch {mis:.1e}, rel {err:.1e}")
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is reported, the others still run
            ok = False
            print(f"SMOKE {kind} {o} pdl={pdl_on}: {type(exc).__name__}: {str(exc)[:400]}")
        bad += not ok
    for overlap in (False, True):  # budget = 1: Triton would compile an argument equal to 1 as a constexpr
        try:
            with triton_santa.programmatic_dependent_launch(True):
                o1, c1, b1 = santa_prop_triton(q, k, v, lens32, scale, 1, tile, 0, write_counts=True, overlap=overlap)
                torch.cuda.synchronize()
            ok = bool((c1.sum(-1) == 1).all() and (b1.sum(-1) == 1).all() and torch.isfinite(o1).all())
            print(f"SMOKE prop budget=1 overlap={overlap}: ok {ok}")
        except Exception as exc:  # noqa: BLE001 - reported, the others still run
            ok = False
            print(f"SMOKE prop budget=1 overlap={overlap}: {type(exc).__name__}: {str(exc)[:400]}")
        bad += not ok
    return 2 if bad else 0


def profile_once(n: int = 32768) -> None:
    """For Nsight Compute (--profile-from-start off): the v8 calls once after a warm-up, inside
    cudaProfilerStart/Stop, so that only those launches are profiled."""
    q, k, v, lens32 = _llama_inputs(n)
    calls = v8_calls(q, k, v, lens32, full=False)
    names = ("prop-v8", "flash-v8")
    for name in names:
        calls[name]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name in names:
        calls[name]()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def check_model_attention(log, path: str, seeds: int = int(os.environ.get("KVSIEVE_MODEL_SEEDS", "64"))) -> list[dict]:
    """Error statistics of kernel vs reference path on attention captured from the default model
    (SmolLM2-135M, 9/3/64, last token of a 2047-token essay prompt; see docs/methods/santa-kernels.md)."""
    import kvsieve

    data = torch.load(path)
    rows = []
    for layer, (q, k, v) in sorted(data.items()):
        q, k, v = (t.to(DEVICE) for t in (q, k, v))
        if DEVICE == "cpu":  # the interpreter's dot mishandles bf16 (dry runs only)
            q, k, v = (t.to(torch.float16) for t in (q, k, v))
        inputs = check_decode_inputs(q.double(), k.double(), v.double())
        exact = exact_attention(inputs)
        for spec in ("santa-prop:budget=128", "santa-prop:budget=128,rounding=systematic",
                     "santa-flash:budget=2048", "santa-flash:budget=256"):
            row = {"layer": int(layer), "method": spec, "seeds": seeds}
            for backend in ("triton", "reference"):
                method = kvsieve.method(f"{spec},backend={backend}")
                errs, outs = [], []
                for sd in range(seeds):
                    out, stats = method.decode(q, k, v, seed=sd)
                    assert stats.backend == backend
                    outs.append(out.double())
                    errs.append(float((out.double() - exact).norm() / exact.norm()))
                errs_t = torch.tensor(errs, dtype=torch.float64)
                mean = torch.stack(outs).mean(0)
                row[f"{backend}_err_mean"] = float(errs_t.mean())
                row[f"{backend}_err_se"] = float(errs_t.std() / math.sqrt(seeds))
                row[f"{backend}_err_of_mean"] = float((mean - exact).norm() / exact.norm())
                row[f"{backend}_density"] = float(stats.density)
            se = math.sqrt(row["triton_err_se"] ** 2 + row["reference_err_se"] ** 2)
            row["z_err_diff"] = (row["triton_err_mean"] - row["reference_err_mean"]) / max(se, 1e-12)
            log("MODEL " + json.dumps(row))
            rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--quick", action="store_true", help="two small shapes, no bf16 (interpreter dry run)")
    ap.add_argument("--stats", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--host", action="store_true", help="host µs per eager call, launch cache on and off")
    ap.add_argument("--sweep-prop", action="store_true", help="santa-prop whole-call variants (graph µs)")
    ap.add_argument("--check-only", default=None, help='a subset of the checks, e.g. "bf16:0,1,7" (dtypes:shapes)')
    ap.add_argument("--sweep-v8", default=None, help="v7 against v8 and v8 variants at these contexts (e.g. 8k,32k)")
    ap.add_argument("--sweep-v10", default=None, help="v8 against the overlapped passes' variants at these contexts")
    ap.add_argument("--timeline", default=None, help="v10's timeline per unit (globaltimer stamps) at these contexts")
    ap.add_argument("--ragged", default=None, help="v8 against v10 on a padded ragged batch 8 at these contexts")
    ap.add_argument("--only", default=None, help="regular expression: the sweeps time only the variants it finds")
    ap.add_argument("--smoke", action="store_true", help="v8/v10 paths once at 32k against v7 (exit 2 on a mismatch)")
    ap.add_argument("--profile-once", action="store_true", help="each main call once inside cudaProfilerStart/Stop")
    ap.add_argument("--model-attention", default=None, help="captured q/k/v (.pt) of the default model")
    ap.add_argument("--bench", default=None, help="arguments of `kvsieve bench decode` (quoted)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    if args.profile_once:
        profile_once()
        return 0
    if args.smoke:
        return smoke()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "gpu_log.txt", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    log(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} {device_name} "
        f"torch {torch.__version__}")
    report = {}
    failures = 0
    if args.check:
        t0 = time.time()
        report["checks"] = check_kernels(log, quick=args.quick, only=args.check_only)
        failures += sum(not r["ok"] for r in report["checks"])
        log(f"checks: {len(report['checks'])} cases, {failures} failed, {time.time() - t0:.0f}s")
    if args.stats:
        t0 = time.time()
        report["statistics"] = check_statistics(log)
        log(f"statistics: {time.time() - t0:.0f}s")
    if args.host:
        report["host"] = host_overhead(log)
    if args.sweep_prop:
        t0 = time.time()
        report["sweep_prop"] = sweep_prop(log)
        log(f"sweep-prop: {time.time() - t0:.0f}s")
    if args.sweep:
        t0 = time.time()
        report["sweep"] = sweep(log)
        log(f"sweep: {time.time() - t0:.0f}s")
    for key, calls_of, contexts in (("v8", None, args.sweep_v8), ("v10", v10_calls, args.sweep_v10)):
        if contexts:
            t0 = time.time()
            report[f"sweep_{key}"] = sweep_v8(log, parse_sizes(contexts), calls_of=calls_of, tag=key.upper(),
                                              only=args.only)
            log(f"sweep-{key}: {time.time() - t0:.0f}s")
            report["compiled"] = compiled_resources(log)
    if args.ragged:
        report["ragged"] = ragged(log, parse_sizes(args.ragged))
    if args.timeline:
        report["timeline"] = timeline(log, parse_sizes(args.timeline))
    if args.model_attention:
        t0 = time.time()
        report["model_attention"] = check_model_attention(log, args.model_attention)
        log(f"model attention: {time.time() - t0:.0f}s")
    (out / "checks.json").write_text(json.dumps(report, indent=1))
    if args.bench is not None:
        from kvsieve.cli.main import main as cli_main

        argv = ["bench", "decode", "--out", str(out), *shlex.split(args.bench)]
        argv += ["--record-command", "python scripts/gpu_check_and_bench.py --bench " + shlex.quote(args.bench)]
        log("kvsieve " + " ".join(argv))
        rc = cli_main(argv)
        if rc:
            return rc
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
