"""Launch settings of Sketch&Walk's sparse prefill attention (FlexAttention's ``kernel_options`` and the Triton
kernel's tiles, warps and stages), swept on the GPU against SDPA (issue 17: 7× SDPA per layer at 128k).

One layer of Llama-3.1-8B (32 query / 8 KV heads, d 128), bf16, batch 1, at ``--density`` (10 %), over
the Sketch&Walk selection of ``bench_prefill.py`` (its ``make_qkv`` and ``sketchwalk_selection``: the same
inputs and lists as its rows). In one run:

- ``sdpa``: flash SDPA (``is_causal``, K/V expanded to the query heads), once per length: the baseline.
- ``flex``: ``block_sparse_prefill_flex`` with the prebuilt BlockMask and each ``kernel_options`` of the
  grid ``BLOCK_M`` × ``BLOCK_N`` × ``num_warps`` × ``num_stages`` (the keys of torch's ``FlexKernelOptions``
  as torch 2.13's and pytorch main's source spell them; a tile must divide the BlockMask's blocks, so
  64-key blocks take 64 × 64 only), then on the best of them for blocks ``auto`` gives to Flex, each of
  ``--flex-flags`` (``ROWS_GUARANTEED_SAFE``: every row sees its diagonal key; ``USE_TMA``), each alone and
  all together (``kind=refine``).
- ``triton``: ``block_sparse_prefill_triton`` with each ``block_m`` × ``block_n`` × ``num_warps`` ×
  ``num_stages`` (``block_n`` ≤ the block size).

Each (backend, block size) starts with the library's default (``kind=default``). A grid entry whose
accumulator and score tiles need more than 255 fp32 registers per thread (``(BLOCK_M·d + BLOCK_M·BLOCK_N) /
(32·warps)``, the hardware limit, so a sure spill) is listed as skipped, not compiled. Every variant's
output is checked before it is timed: against a float64 reference on a few query blocks (first, middle,
last; their selected keys, causal) with ``|out − ref| ≤ atol + rtol·|ref|``, and on every row against the
first variant of that (length, block size) that passed (bf16 agreement). A config that fails to compile or
launch is recorded with its error, one that fails the check is not timed.

The full grid runs at ``--grid-length`` (the longest length), in the order of the cases nearest the target
(``auto``'s backend per block size first, then Triton, then Flex), each case's configs nearest its default
first; the other lengths re-time the default and the ``--top`` best of each case (their compiled Triton
kernels are reused; Flex compiles once per shape). Grid entries start only while the run is under
``--budget-s`` seconds (recorded as skipped after; defaults, refines and the other lengths' rows still
run), nothing starts after ``--hard-stop-s``. Results are rewritten after every row, so a killed run keeps
what it measured.

Timing: CUDA events, cold L2 (``kvsieve.bench.timing.ColdL2Timer``), ``--warmup`` calls, median of
``--iters``; ``first_call_s`` is the first call's wall time (compile + one run).

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=src python docs/results/studies/sketchwalk/tune_prefill.py OUT_DIR
    PYTHONPATH=src python docs/results/studies/sketchwalk/tune_prefill.py OUT_DIR --quick   # CPU smoke test

Writes OUT_DIR/tune_prefill.json and tune_prefill.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from itertools import product
from pathlib import Path

import torch
from bench_prefill import make_qkv, sketchwalk_selection, time_dense  # docs/results/studies/sketchwalk/bench_prefill.py

MAX_REGISTERS = 255  # per thread, sm_70 and later


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke test: tiny shapes, a few configs, the Triton interpreter, eager Flex")
    p.add_argument("--lengths", default="131072,65536")
    p.add_argument("--grid-length", type=int, default=None, help="length of the full grid (default: the longest)")
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--block-sizes", default="64,128")
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    p.add_argument("--flex-block-m", default="64,128")
    p.add_argument("--flex-block-n", default="64,128")
    p.add_argument("--flex-warps", default="4,8")
    p.add_argument("--flex-stages", default="2,3,4")
    p.add_argument("--flex-flags", default="ROWS_GUARANTEED_SAFE,USE_TMA",
                   help="boolean kernel_options tried on the best grid config (each alone, then all); '' for none")
    p.add_argument("--triton-block-m", default="128,256")
    p.add_argument("--triton-block-n", default="32,64,128")
    p.add_argument("--triton-warps", default="4,8")
    p.add_argument("--triton-stages", default="2,3,4")
    p.add_argument("--top", type=int, default=2, help="best grid configs per case re-timed at the other lengths")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--atol", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-2)
    p.add_argument("--budget-s", type=float, default=270.0, help="start no grid entry after this many seconds")
    p.add_argument("--hard-stop-s", type=float, default=540.0, help="start nothing after this many seconds")
    p.add_argument("--min-gain", type=float, default=0.02,
                   help="a config is proposed as the default when it beats it by this fraction at every length")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:  # tiny shapes; stages and warps mean nothing to the interpreter, so one each
        args.lengths, args.block_sizes, args.heads = "512,384", "32,128", "4,2,64"
        args.flex_block_m = args.flex_block_n = "32,64"
        args.flex_warps, args.flex_stages, args.flex_flags = "4", "2", "ROWS_GUARANTEED_SAFE"
        args.triton_block_m, args.triton_block_n, args.triton_warps, args.triton_stages = "32,64", "16,32", "4", "2"
        args.top, args.warmup, args.iters = 1, 0, 1
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def tile_registers(block_m: int, block_n: int, d: int, warps: int) -> float:
    """fp32 registers per thread that the [block_m, d] accumulator and the [block_m, block_n] scores take."""
    return (block_m * d + block_m * block_n) / (32 * warps)


def triton_grid(args, bs: int, d: int) -> list[tuple[dict, str | None]]:
    """``(launch overrides, why skipped or None)`` for the Triton kernel at this block size."""
    out = []
    for bm, bn, w, s in product(ints(args.triton_block_m), ints(args.triton_block_n), ints(args.triton_warps),
                                ints(args.triton_stages)):
        if bn > bs:
            continue  # not a configuration of this block size (block_n ≤ block_size)
        cfg = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": s}
        regs = tile_registers(bm, bn, d, w)
        out.append((cfg, f"{regs:.0f} fp32 registers per thread for the tiles (> {MAX_REGISTERS})"
                    if regs > MAX_REGISTERS else None))
    return out


def flex_grid(args, bs: int, d: int) -> list[tuple[dict, str | None]]:
    """``(kernel_options, why skipped or None)`` for FlexAttention at this block size."""
    out = []
    for bm, bn, w, s in product(ints(args.flex_block_m), ints(args.flex_block_n), ints(args.flex_warps),
                                ints(args.flex_stages)):
        if bs % bm or bs % bn:
            continue  # torch requires the tiles to divide the BlockMask's blocks
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
        regs = tile_registers(bm, bn, d, w)
        out.append((cfg, f"{regs:.0f} fp32 registers per thread for the tiles (> {MAX_REGISTERS})"
                    if regs > MAX_REGISTERS else None))
    return out


class CpuTimer:
    """``ColdL2Timer.time_us``'s contract on the host clock (the --quick smoke test)."""

    def time_us(self, fn, *, warmup: int, iters: int) -> dict[str, float]:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(max(iters, 1)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times)}


def check_blocks(n_blocks: int) -> list[int]:
    """Query blocks checked against the reference: the shortest lists, the middle, the longest."""
    return sorted({0, 1, n_blocks // 3, n_blocks // 2, n_blocks - 2, n_blocks - 1} & set(range(n_blocks)))


def slice_reference(qkv, idx, cnt, bs: int, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(query positions, out [Hq, rows, d] float64)`` per checked query block: softmax attention over its
    selected blocks' keys at positions ≤ the row's, as the contract defines it (batch row 0)."""
    q, k, v = qkv
    n_tok = q.shape[2]
    group = q.shape[1] // k.shape[1]
    offs = torch.arange(bs, device=q.device)
    refs = []
    for i in blocks:
        sel = idx[0, i, : int(cnt[0, i])].long()
        key_pos = (sel[:, None] * bs + offs).reshape(-1)
        key_pos = key_pos[key_pos < n_tok]
        q_pos = torch.arange(i * bs, min((i + 1) * bs, n_tok), device=q.device)
        qi = q[0][:, q_pos].double()
        ki = k[0][:, key_pos].double().repeat_interleave(group, 0)
        vi = v[0][:, key_pos].double().repeat_interleave(group, 0)
        s = (qi @ ki.transpose(1, 2)) * q.shape[-1] ** -0.5
        s = s.masked_fill(key_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        refs.append((q_pos, torch.softmax(s, -1) @ vi))
    return refs


def check(out: torch.Tensor, refs, anchor: torch.Tensor | None, args) -> dict:
    """Errors of ``out`` against the reference slices and (all rows) the anchor; ``check_ok``."""
    err, ok = 0.0, True
    for q_pos, ref in refs:
        got = out[0][:, q_pos].double()
        diff = (got - ref).abs()
        err = max(err, float(diff.max()))
        ok &= bool((diff <= args.atol + args.rtol * ref.abs()).all())
    row = {"max_abs_err_vs_reference": err}
    if anchor is not None:  # head by head: a float copy of the whole output is 2 GiB at 128k
        worst = 0.0
        for h in range(out.shape[1]):
            a, b = out[:, h].float(), anchor[:, h].float()
            diff = (a - b).abs()
            worst = max(worst, float(diff.max()))
            ok &= bool((diff <= 2 * (args.atol + args.rtol * b.abs())).all())  # two bf16 roundings
        row["max_abs_diff_vs_anchor"] = worst
    row["check_ok"] = ok
    return row


def triton_resources(compiled_before: set) -> dict:
    """Registers and spills of the kernel that the last call compiled (launch's cache), where Triton says."""
    from kvsieve.kernels.shared.triton_utils import compiled_launches

    new = [v[0] for key, v in compiled_launches().items() if key not in compiled_before]
    if not new:
        return {}
    return {k: getattr(new[-1], k) for k in ("n_regs", "n_spills") if getattr(new[-1], k, None) is not None}


def torch_flex_default(d: int) -> dict | None:
    """torch's own forward config for bf16 at head dim d on this device (internal API; None where it moved)."""
    try:
        from torch._inductor.choices import InductorChoices

        conf = InductorChoices().get_flex_attention_fwd_configs(d, torch.bfloat16, "cuda")[-1]
        return {"BLOCK_M": conf.block_m, "BLOCK_N": conf.block_n, "num_warps": conf.num_warps,
                "num_stages": conf.num_stages}
    except Exception:  # noqa: BLE001 - informational only
        return None


def nearest_first(grid: list[tuple[dict, str | None]], default: dict) -> list[tuple[dict, str | None]]:
    """The grid with the configs that differ from the default in fewest settings first, so that a run
    cut short by the budget has timed the default's neighbourhood."""
    return sorted(grid, key=lambda e: sum(e[0][k] != default.get(k) for k in e[0]))


class Sweep:
    def __init__(self, args, timer, device):
        self.args, self.timer, self.device = args, timer, device
        self.t0 = time.perf_counter()
        self.rows: list[dict] = []
        self.meta: dict = {}
        self.sdpa: dict[int, float] = {}
        self.triton_res: dict[tuple[int, str], dict] = {}  # compiled once, reused at every length

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def write(self) -> None:
        self.meta["wall_s"] = round(self.elapsed(), 1)
        (self.args.out / "tune_prefill.json").write_text(json.dumps({"meta": self.meta, "rows": self.rows}, indent=1))
        (self.args.out / "tune_prefill.md").write_text(markdown(self.meta, self.rows, self.args))

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.write()
        return row

    def variant(self, ctx: dict, backend: str, kind: str, cfg: dict | None, *, skip: str | None = None) -> dict:
        """Check, then time, one configuration; the row."""
        args, n, bs = self.args, ctx["n"], ctx["bs"]
        row = {"n": n, "backend": backend, "block_size": bs, "kind": kind, "config": cfg}
        if skip is None and self.elapsed() > args.hard_stop_s:
            skip = f"hard stop ({args.hard_stop_s:.0f} s)"
        if skip is None and kind == "grid" and self.elapsed() > args.budget_s:  # defaults, tops, refines run
            skip = f"budget ({args.budget_s:.0f} s)"
        if skip is not None:
            return self.add({**row, "skipped": skip})
        fn = self.call(ctx, backend, cfg)
        from kvsieve.kernels.shared.triton_utils import compiled_launches

        before = set(compiled_launches())
        t0 = time.perf_counter()
        try:
            out = fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile or launch is a result, not a crash
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            if "CUDA error" in row["error"]:  # the context is gone: nothing after this can run
                self.add(row)
                raise
            return self.add(row)
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        if backend == "triton":
            row.update(self.triton_res.setdefault((bs, json.dumps(cfg)), triton_resources(before)))
        row.update(check(out, ctx["refs"], ctx["anchor"], args))
        if not row["check_ok"]:
            return self.add(row)
        if ctx["anchor"] is None:
            ctx["anchor"] = out
        del out
        try:
            row.update(self.timer.time_us(fn, warmup=args.warmup, iters=args.iters))
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"timing: {type(exc).__name__}: {exc}"[:500]
            return self.add(row)
        if n in self.sdpa:
            row["speedup_vs_sdpa"] = self.sdpa[n] / row["median_us"]
        return self.add(row)

    @staticmethod
    def call(ctx: dict, backend: str, cfg: dict | None):
        from kvsieve.kernels.shared.block_sparse import block_sparse_prefill_flex
        from kvsieve.kernels.shared.block_sparse_triton import block_sparse_prefill_triton

        q, k, v = ctx["qkv"]
        idx, cnt, bs = ctx["idx"], ctx["cnt"], ctx["bs"]
        if backend == "flex":
            return lambda: block_sparse_prefill_flex(q, k, v, idx, cnt, block_size=bs, block_mask=ctx["mask"],
                                                     kernel_options=cfg)[0]
        return lambda: block_sparse_prefill_triton(q, k, v, idx, cnt, block_size=bs, **(cfg or {}))[0]


def resolved_default(backend: str, bs: int, group: int, d: int, torch_default: dict | None) -> dict:
    """The settings the library's default call runs with (Flex: its kernel_options over torch's config)."""
    if backend == "flex":
        from kvsieve.kernels.shared.block_sparse import flex_kernel_options

        # torch's sm_90 bf16 d 128 forward config (torch 2.13's template heuristics) where it cannot be read
        base = torch_default or {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
        return {**base, **(flex_kernel_options(bs) or {})}
    from kvsieve.kernels.shared.block_sparse_triton import launch_config

    return dict(zip(("block_m", "block_n", "num_warps", "num_stages"), launch_config(group, bs, d), strict=True))


def main(argv=None) -> int:
    args = parse(argv)
    cuda = torch.cuda.is_available() and not args.quick
    if not cuda and not args.quick:
        print("needs a CUDA GPU (or --quick for the CPU smoke test)", file=sys.stderr)
        return 2
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel module is imported, below
    from kvsieve.kernels.shared.block_sparse import TRITON_MAX_BLOCK

    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        from kvsieve.bench.timing import ColdL2Timer

        timer = ColdL2Timer(dev)
        torch.backends.cuda.matmul.allow_tf32 = True  # the walk GEMM in TF32, as bench_prefill's selection
        # Each kernel_options dict and shape is a recompile of the one compiled flex_attention; past the
        # limit torch would run eager FlexAttention (dense math, hundreds of GiB at 128k): raise instead.
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 4096)
        if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
            torch._dynamo.config.fail_on_recompile_limit_hit = True
    else:
        timer = CpuTimer()
    hq, hkv, d = ints(args.heads)
    group = hq // hkv
    lengths = ints(args.lengths)
    grid_n = args.grid_length or max(lengths)
    if grid_n not in lengths:
        sys.exit(f"--grid-length {grid_n} is not among --lengths {args.lengths}")
    lengths = [grid_n] + [n for n in lengths if n != grid_n]
    block_sizes = ints(args.block_sizes)
    # auto's backend per block size first: the targets hinge on those; then the other backend, Triton first
    # (its kernels compile in seconds, a Flex config costs a torch.compile)
    cases = [("triton" if bs <= TRITON_MAX_BLOCK else "flex", bs) for bs in block_sizes]
    cases += sorted((("flex" if b == "triton" else "triton", bs) for b, bs in cases), key=lambda c: c[0] == "flex")
    sweep = Sweep(args, timer, dev)
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    sweep.meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
        "command": " ".join(sys.argv), "quick": args.quick,
        "shape": {"hq": hq, "hkv": hkv, "d": d, "dtype": "bfloat16", "batch": 1}, "density": args.density,
        "timing": (f"CUDA events, cold L2 (ColdL2Timer), {args.warmup} warm-up, median of {args.iters}" if cuda
                   else f"host clock, {args.warmup} warm-up, median of {args.iters} (smoke test: not a measurement)"),
        "check": f"|out - ref| <= {args.atol} + {args.rtol}|ref| on query blocks vs float64; all rows vs the "
                 "case's first passing variant at twice that",
        "torch_flex_default": torch_flex_default(d) if cuda else None,
        "grid_length": grid_n, "budget_s": args.budget_s, "hard_stop_s": args.hard_stop_s,
    }
    sweep.meta["defaults"] = {f"{b}@{bs}": resolved_default(b, bs, group, d, sweep.meta["torch_flex_default"])
                              for b, bs in cases}
    if not cuda:
        print("--quick: CPU smoke test (Triton interpreter; FlexAttention runs eager off CUDA, so its "
              "kernel_options are passed but not compiled; where it fails, its rows say why): the times are "
              "not measurements", flush=True)
    best: dict[tuple[str, int], list[dict]] = {}
    for n in lengths:
        qkv = make_qkv(n, hq, hkv, d, seed=args.seed, device=dev)

        def timed(name, n, fn, **extra):
            row = {"n": n, "backend": name, "kind": "baseline", "config": "flash" if cuda else "math"}
            try:
                row.update(timer.time_us(fn, warmup=args.warmup, iters=args.iters))
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            return sweep.add(row)

        flash = contextlib.nullcontext()
        if cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            flash = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
        with flash:
            base = time_dense(timed, n, qkv, None)
        if "median_us" in base:
            sweep.sdpa[n] = base["median_us"]
        ctxs = {}
        for bs in block_sizes:
            _, _, selection = sketchwalk_selection(qkv[0], qkv[1], bs, args.density)
            mask, idx, cnt = selection()
            nb = idx.shape[1]
            ctxs[bs] = {"n": n, "bs": bs, "qkv": qkv, "mask": mask, "idx": idx, "cnt": cnt, "anchor": None,
                        "refs": slice_reference(qkv, idx, cnt, bs, check_blocks(nb)),
                        "block_density": float(cnt.double().sum() / (nb * (nb + 1) / 2))}
        for backend, bs in cases:
            ctx = ctxs[bs]
            sweep.variant(ctx, backend, "default", None)
            if n == grid_n:
                grid = (triton_grid if backend == "triton" else flex_grid)(args, bs, d)
                grid = nearest_first(grid, resolved_default(backend, bs, group, d, sweep.meta["torch_flex_default"]))
                done = [sweep.variant(ctx, backend, "grid", cfg, skip=why) for cfg, why in grid]
                if backend == "flex" and bs > TRITON_MAX_BLOCK and args.flex_flags:
                    done += flex_refine(sweep, ctx, done, args.flex_flags.split(","))
                timed_rows = sorted((r for r in done if "median_us" in r), key=lambda r: r["median_us"])
                best[backend, bs] = [r["config"] for r in timed_rows[: args.top]]
            else:
                for cfg in best.get((backend, bs), []):
                    sweep.variant(ctx, backend, "top", cfg)
        del ctxs, qkv
        if cuda:
            torch.cuda.empty_cache()
    sweep.write()
    print((args.out / "tune_prefill.md").read_text())
    return 0


def flex_refine(sweep: Sweep, ctx: dict, done: list[dict], flags: list[str]) -> list[dict]:
    """The best grid config with each boolean flag, then with all of them."""
    timed = [r for r in done if "median_us" in r]
    if not timed:
        return []
    top = min(timed, key=lambda r: r["median_us"])["config"]
    sets = [[f] for f in flags] + ([flags] if len(flags) > 1 else [])
    return [sweep.variant(ctx, "flex", "refine", {**top, **dict.fromkeys(s, True)}) for s in sets]


def fmt_cfg(cfg) -> str:
    if cfg is None:
        return "default"
    if isinstance(cfg, str):
        return cfg
    short = {"block_m": "m", "block_n": "n", "num_warps": "w", "num_stages": "s", "BLOCK_M": "M", "BLOCK_N": "N"}
    return " ".join(f"{short.get(k, k)}{'' if v is True else v}" for k, v in cfg.items())


def markdown(meta: dict, rows: list[dict], args) -> str:
    lines = [f"# Sketch&Walk prefill launch sweep, one layer ({meta['device']}, {meta['date']})", "",
             f"Command: `{meta['command']}`; torch {meta['torch']}, Triton {meta['triton']}; {meta['timing']}; "
             f"density {meta['density']}; shape {meta['shape']}; check: {meta['check']}; "
             f"wall {meta.get('wall_s')} s.", "",
             f"Defaults as run (Flex: the library's kernel_options over torch's config): {meta['defaults']}; "
             f"torch's Flex config read on this device: {meta['torch_flex_default']}.", ""]
    sdpa = {r["n"]: r["median_us"] for r in rows if r["backend"] == "sdpa" and "median_us" in r}
    for n, us in sdpa.items():
        lines.append(f"- SDPA at {n}: {us / 1000:.2f} ms; 7× needs ≤ {us / 7000:.2f} ms, 5× ≤ {us / 5000:.2f} ms")
    lines += ["", "## Best per backend × block × length", "",
              "| n | backend | block | default ms | × SDPA | best ms | × SDPA | best config | gain | configs timed |",
              "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    keys = sorted({(r["n"], r["backend"], r["block_size"]) for r in rows if "block_size" in r},
                  key=lambda t: (-t[0], t[2], t[1]))
    proposals = {}
    for n, b, bs in keys:
        case = [r for r in rows if (r["n"], r["backend"], r.get("block_size")) == (n, b, bs) and "median_us" in r]
        dflt = next((r for r in case if r["kind"] == "default"), None)
        if not case:
            lines.append(f"| {n} | {b} | {bs} | | | | | nothing timed | | 0 |")
            continue
        top = min(case, key=lambda r: r["median_us"])
        def x(r, n=n):
            return f"{sdpa[n] / r['median_us']:.2f}×" if n in sdpa else ""

        d_ms = f"{dflt['median_us'] / 1000:.2f}" if dflt else ""
        gain = dflt["median_us"] / top["median_us"] - 1 if dflt else None
        lines.append(f"| {n} | {b} | {bs} | {d_ms} | {x(dflt) if dflt else ''} | {top['median_us'] / 1000:.2f} "
                     f"| {x(top)} | {fmt_cfg(top['config'])} | {'' if gain is None else f'{100 * gain:+.1f}%'} "
                     f"| {len(case)} |")
        proposals.setdefault((b, bs), []).append((n, top, dflt, case))
    lines += ["", "## Proposed defaults", ""]
    said = meta["quick"]
    if said:
        lines.append("- none: a --quick smoke test is not a measurement")
    for (b, bs), per_n in ({} if meta["quick"] else proposals).items():
        # a config the grid length picked, that beats the default by min_gain at every length it was timed at
        grid_top = next((t for n, t, _, _ in per_n if n == meta["grid_length"]), None)
        if grid_top is None or grid_top["kind"] == "default":
            continue
        cfg, wins = grid_top["config"], []
        for _n, _, dflt, case in per_n:
            same = next((r for r in case if r["config"] == cfg), None)
            wins.append(bool(same and dflt and same["median_us"] <= dflt["median_us"] * (1 - args.min_gain)))
        if all(wins):
            said = True
            where = (f"`FLEX_TUNED_OPTIONS[{bs}] = {cfg}` in kernels/shared/block_sparse.py" if b == "flex" else
                     f"`launch_config` (kernels/shared/block_sparse_triton.py) to return "
                     f"({cfg['block_m']}, {cfg['block_n']}, {cfg['num_warps']}, {cfg['num_stages']}) for "
                     f"{bs}-key blocks at G = {meta['shape']['hq'] // meta['shape']['hkv']}, d = {meta['shape']['d']}")
            lines.append(f"- {b} at {bs}-key blocks: {fmt_cfg(cfg)} beats the default by ≥ "
                         f"{100 * args.min_gain:.0f}% at every length: set {where}")
    if not said:
        lines.append(f"- none: no grid config beat its default by {100 * args.min_gain:.0f}% at every length")
    lines += ["", "## Every row", "",
              "| n | backend | block | kind | config | median ms | min–max ms | × SDPA | first call s | regs/spills "
              "| err vs ref | diff vs anchor | note |",
              "|---:|---|---:|---|---|---:|---|---:|---:|---|---:|---:|---|"]
    for r in rows:
        ms = f"{r['median_us'] / 1000:.3f}" if "median_us" in r else ""
        rng = f"{r['min_us'] / 1000:.3f}–{r['max_us'] / 1000:.3f}" if "min_us" in r else ""
        sp = f"{r['speedup_vs_sdpa']:.2f}×" if "speedup_vs_sdpa" in r else ""
        regs = f"{r['n_regs']}/{r.get('n_spills', '')}" if "n_regs" in r else ""
        err = f"{r['max_abs_err_vs_reference']:.1e}" if "max_abs_err_vs_reference" in r else ""
        anc = f"{r['max_abs_diff_vs_anchor']:.1e}" if "max_abs_diff_vs_anchor" in r else ""
        note = r.get("skipped") and f"skipped: {r['skipped']}" or r.get("error", "")
        if r.get("check_ok") is False:
            note = "check failed: not timed"
        note = note.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['n']} | {r['backend']} | {r.get('block_size', '')} | {r['kind']} | {fmt_cfg(r['config'])} "
                     f"| {ms} | {rng} | {sp} | {r.get('first_call_s', '')} | {regs} | {err} | {anc} | {note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
