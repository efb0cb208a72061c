"""S²ANTA-prop's tile budgets (``santa/common.py``: ``group_budgets``, the largest-remainder +1s by a histogram
threshold select), timed alone and in the whole call, checked against ``systematic.largest_remainder`` in the
same run.

- The budget launch alone (``two_pass.prop_budgets``: programmatic dependent launch off, so nothing waits),
  captured in a CUDA graph and replayed with a cold L2 (``ColdL2Timer.time_graph_us``), on the (m, l) of a real
  stats pass over the bench's peaked inputs (Llama-3.1-8B shape: 32 q heads, 8 KV heads, d 128, bf16), tile 256,
  budget 128, at each ``--shapes`` entry BATCH:TILES (TILES·256 − 192 keys when TILES is odd: a last tile
  partly filled, as the runtime's cache of 128k + new tokens has).
- The whole santa-prop call and Bernoulli qKᵀ's (values by santa-prop) through ``kvsieve.method(...).decode``,
  graph-timed the same way, at each ``--calls`` entry (batch 1). Both take their seed by value (the kernels
  mix each row's length in on the device), so the call's key has host counters, as the runtime's driver
  gives (``RandomKey(seed, (request, layer))``): a device counter would be read back to the host
  (``RandomKey.host_seed``), a copy that graph capture refuses.
- Checks: the budgets sum to the budget (0 for a row of no mass) and equal ``largest_remainder`` on the same
  masses, on the real stats and on synthetic rows (tied fractions, zero remainders, tiles of no mass, rows
  of different lengths); rows that differ are counted (the kernel's float32 exp is not torch's, so a
  near-tie may fall the other way; 0 expected).

The other ways of finding the +1s (a sort of the padded row, a radix select, rank counting) were measured
and dropped: their numbers are in ``docs/methods/santa-kernels.md`` and
``docs/results/gpu-bench/2026-11-29-h200-santa-budget-selects.md``.

``--early-exit``: every launch and call timed with the threshold's every step and with its steps skipped once it
is known (``common.BUDGET_EARLY_EXIT``), their budgets compared (equal to the bit expected).

Writes ``santa_budget.json`` and ``santa_budget.md`` to the folder given. ``--check`` runs the synthetic checks
and the whole calls once on the CPU (under ``TRITON_INTERPRET=1``), without timing.

    python benchmarks/breakdown/santa_budget.py OUT [--shapes 1:512,1:513,1:1024,8:128,8:129] [--calls 512,513]
        [--early-exit]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

TILE = 256
BUDGET = 128
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SEED = 11
DEVICE = "cuda"
CALLS = {"santa-prop": "santa-prop:budget=128",
         "bernoulli-qk+santa-prop": "bernoulli-qk:query=mean-group,values=santa-prop,budget=128"}


def budgets(m, l, lens, t: int, budget: int = BUDGET, tile: int = TILE) -> torch.Tensor:
    """The tile budgets ``[B, Hq, T]`` of the stats ``m, l [B, Hq, T]`` (one budget launch)."""
    from kvsieve.kernels.santa.two_pass import prop_budgets

    b, hq, _ = m.shape
    buf = types.SimpleNamespace(m=m.reshape(-1), l=l.reshape(-1),
                                budgets=torch.full((b, hq, t), -1, device=m.device, dtype=torch.int32))
    prop_budgets(lens, buf, budget, tile, SEED, b, hq, t, rounding="largest-remainder", pdl=False)
    return buf.budgets


def reference(m, l, lens, budget: int = BUDGET, tile: int = TILE) -> torch.Tensor:
    """``largest_remainder`` of the tile masses ``e^{m - m*} l`` (float32, as the kernels), tiles past each
    row's length left out."""
    from kvsieve.kernels.santa.reference import tile_masses
    from kvsieve.kernels.santa.systematic import largest_remainder

    t = m.shape[-1]
    valid = (torch.arange(t, device=m.device) < ((lens.long() + tile - 1) // tile)[:, None])[:, None, :]
    w = tile_masses(torch.where(valid, m, float("-inf")), torch.where(valid, l, 0.0))
    return largest_remainder(w.double(), budget).to(torch.int32)


def synthetic_cases(device, shapes, heads: int) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(name, m, l, lens)`` per BATCH:TILES shape, rows that the real stats rarely give, by head h mod 4: random;
    tied fractions (equal masses); equal masses over the row (no remainder where its tiles divide the budget);
    random with every third tile of no mass. The rows' lengths differ (a last tile partly filled, a row cut to
    half). On the GPU these are the timed shapes, so that the checks compile nothing more."""
    cases = []
    for b, t in shapes:
        g = torch.Generator().manual_seed(1000 * b + t)
        m = torch.randn(b, heads, t, generator=g) * 2
        l = torch.rand(b, heads, t, generator=g) * 50 + 1
        m[:, 1::4], m[:, 2::4] = 0.0, 0.0
        l[:, 1::4] = torch.randint(1, 4, l[:, 1::4].shape, generator=g).float()
        l[:, 2::4] = 1.0
        m[:, 3::4, ::3], l[:, 3::4, ::3] = float("-inf"), 0.0
        lens = torch.tensor([t * TILE - (0 if r % 3 == 0 else 37 if r % 3 == 1 else (t - t // 2) * TILE)
                             for r in range(b)], dtype=torch.int32).clamp(min=1)
        cases.append((f"synthetic b={b} t={t}", m.to(device), l.to(device), lens.to(device)))
    return cases


def check_case(m, l, lens) -> dict:
    """The budgets against the reference: ``{"sums_ok" (each row sums to the reference's: the budget, or 0 for
    a row of no mass), "rows_off_reference"}``."""
    got = budgets(m, l, lens, m.shape[-1])
    ref = reference(m, l, lens)
    return {"sums_ok": bool(torch.equal(got.sum(-1), ref.sum(-1))),
            "rows_off_reference": int((got != ref).any(-1).sum())}


def stats(b: int, t: int, attention: str):
    """``(inputs, m, l [B, Hq, T])``: a real stats pass (v8's, the wide launch) over the bench's inputs of
    ``t`` tiles (``t·256 − 192`` keys when t is odd)."""
    from kvsieve.bench.decode import Case, Inputs
    from kvsieve.kernels.santa.common import begin_call
    from kvsieve.kernels.santa.two_pass import stats_pass

    n = t * TILE - (192 if t % 2 else 0)
    x = Inputs(Case("llama-3.1-8b", HEADS, KV_HEADS, HEAD_DIM, n, b), torch.bfloat16, seed=0, attention=attention,
               device=DEVICE)
    _, _, buf = begin_call(x.q, x.k, x.v, TILE, flash=False, rounding="largest-remainder", write_counts=False,
                           out=None)
    stats_pass(x.q, x.k, x.lens, buf, x.scale, TILE, flash=False, pdl=False, block_n=128, stats_programs=528,
               num_warps=4, num_stages=2)
    torch.cuda.synchronize()
    size = b * HEADS * t  # the workspace buffers may be longer
    return x, buf.m[:size].view(b, HEADS, t).clone(), buf.l[:size].view(b, HEADS, t).clone()


def load_stages():
    spec = importlib.util.spec_from_file_location("breakdown_stages", Path(__file__).with_name("stages.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def whole_calls(stages, q, k, v, lens, backend: str | None = None) -> dict:
    """``label -> call`` of each ``CALLS`` spec on tensors made before any capture; ``stages.make_call`` keys them
    on host counters, which the seed-by-value kernels take without a device read."""
    return {label: stages.make_call(spec, q, k, v, lens, backend=backend)[0] for label, spec in CALLS.items()}


def run(args) -> dict:
    from unittest import mock

    from kvsieve.bench.timing import ColdL2Timer
    from kvsieve.kernels.santa import common
    from kvsieve.kernels.santa.two_pass import prop_budgets

    timer = ColdL2Timer()
    report = {"budget": [], "calls": [], "checks": {}}
    t0 = time.time()
    for name, m, l, lens in synthetic_cases(DEVICE, args.shapes, HEADS):
        report["checks"][name] = check_case(m, l, lens)
    print(f"synthetic checks ({time.time() - t0:.1f} s)", flush=True)
    stages = load_stages() if args.calls else None
    for b, t in args.shapes:
        t1 = time.time()
        x, m, l = stats(b, t, args.attention)
        report["checks"][f"real b={b} t={t}"] = check_case(m, l, x.lens)
        buf = types.SimpleNamespace(m=m.reshape(-1), l=l.reshape(-1),
                                    budgets=torch.empty(b, HEADS, t, device=DEVICE, dtype=torch.int32))
        one_launch = functools.partial(prop_budgets, x.lens, buf, BUDGET, TILE, SEED, b, HEADS, t,
                                       rounding="largest-remainder", pdl=False)
        ways = (False, True) if args.early_exit else (common.BUDGET_EARLY_EXIT,)
        got = {}
        for early in ways:
            with mock.patch.object(common, "BUDGET_EARLY_EXIT", early):
                r = {"batch": b, "tiles": t, "programs": b * HEADS, "early_exit": early}
                r.update(timer.time_graph_us(one_launch, warmup=5, iters=args.iters))
                one_launch()
                got[early] = buf.budgets.clone()
                report["budget"].append(r)
                print(f"budget b={b} t={t} early_exit={early}: {r['median_us']:.1f}", flush=True)
                if b == 1 and t in args.calls:
                    for label, call in whole_calls(stages, x.q, x.k, x.v, x.lens).items():
                        r = {"batch": b, "tiles": t, "call": label, "early_exit": early}
                        try:
                            r.update(timer.time_graph_us(call, warmup=3, iters=args.iters))
                        except Exception as exc:  # noqa: BLE001 - one failing call must not lose the others
                            r["error"] = f"{type(exc).__name__}: {exc}"[:300]
                        report["calls"].append(r)
                        print(f"call {label} t={t}: {r.get('median_us', r.get('error'))}", flush=True)
        if len(got) == 2:
            report["checks"][f"real b={b} t={t}"]["early_exit_equal"] = bool(torch.equal(got[False], got[True]))
        del x
        torch.cuda.empty_cache()
        print(f"shape b={b} t={t} ({time.time() - t1:.1f} s)", flush=True)
    return report


def markdown(report: dict, device: str, command: str) -> str:
    lines = [f"# S²ANTA-prop tile budgets, histogram threshold select ({device})", "",
             f"`{command}`", "",
             "Budget launch alone (two-pass launch, PDL off), graph-replayed, cold L2, median µs; (m, l) of a real "
             f"stats pass over peaked inputs; {HEADS} q heads, tile {TILE}, budget {BUDGET}. `=` the budgets equal "
             "`largest_remainder` on the same stats and sum to the budget.", "",
             "| batch:tiles | programs | early exit | µs | check |", "|---|---:|---|---:|---|"]
    for r in report["budget"]:
        c = report["checks"].get(f"real b={r['batch']} t={r['tiles']}", {})
        ok = "=" if c.get("sums_ok") and not c.get("rows_off_reference") else "≠"
        if "early_exit_equal" in c:
            ok += ", both ways " + ("equal" if c["early_exit_equal"] else "DIFFER")
        lines.append(f"| {r['batch']}:{r['tiles']} | {r['programs']} | {r.get('early_exit')} | {r['median_us']:.1f} | "
                     f"{ok} |")
    if report["calls"]:
        lines += ["", "Whole call (`kvsieve.method(...).decode`, batch 1), graph-replayed, cold L2, median µs:", "",
                  "| call | tiles | early exit | µs |", "|---|---:|---|---:|"]
        for r in report["calls"]:
            cell = f"{r['median_us']:.1f}" if "median_us" in r else r.get("error", "—")[:80]
            lines.append(f"| {r['call']} | {r['tiles']} | {r.get('early_exit')} | {cell} |")
    lines += ["", "Checks: cases whose budgets do not sum to the budget or differ from `largest_remainder` "
              "(float32 exp of torch, not the kernel's):", ""]
    bad = [f"- {case}: {'bad sums' if not r['sums_ok'] else ''} {r['rows_off_reference']} rows off the reference"
           for case, r in report["checks"].items() if not r["sums_ok"] or r["rows_off_reference"]]
    lines += bad or ["- none"]
    return "\n".join(lines) + "\n"


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        b, _, t = item.partition(":")
        if not (b.isdigit() and t.isdigit()):
            raise ValueError(f"--shapes: {item!r} (expected BATCH:TILES)")
        out.append((int(b), int(t)))
    return out


def check() -> None:
    """On the CPU (the interpreter), no timing: the synthetic checks, then each whole call once on small
    inputs, built as the timed run builds them (the kernels' path: ``backend=triton``)."""
    from unittest import mock

    from kvsieve.kernels.santa import common

    for early in (False, True):
        with mock.patch.object(common, "BUDGET_EARLY_EXIT", early):
            for name, m, l, lens in synthetic_cases("cpu", [(3, t) for t in (1, 2, 15, 16, 17, 129)], 4):
                r = check_case(m, l, lens)
                assert r["sums_ok"] and r["rows_off_reference"] == 0, (name, early, r)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g)
    k, v = torch.randn(2, 2, 600, 64, generator=g), torch.randn(2, 2, 600, 64, generator=g)
    lens = torch.tensor([600, 333], dtype=torch.int32)
    for label, call in whole_calls(load_stages(), q, k, v, lens, backend="triton").items():
        out = call()
        assert out.shape == q.shape and torch.isfinite(out).all(), label
    print("check: ok")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for santa_budget.json and santa_budget.md")
    p.add_argument("--out", dest="out_opt", help="the folder, as an option")
    p.add_argument("--shapes", default="1:512,1:513,1:1024,8:128,8:129", help="BATCH:TILES list (budget launch)")
    p.add_argument("--calls", default="512,513", help="tiles (batch 1) at which the whole calls are timed; '' none")
    p.add_argument("--attention", default="peaked", choices=("peaked", "uniform"))
    p.add_argument("--iters", type=int, default=30, help="timed graph replays")
    p.add_argument("--check", action="store_true", help="the checks on the CPU (TRITON_INTERPRET=1), no timing")
    p.add_argument("--early-exit", action="store_true", help="time both forms of the threshold select (docstring)")
    args = p.parse_args(argv)
    if args.check:
        check()
        return 0
    out_dir = args.out_opt or args.out
    if not out_dir:
        p.error("out: give a folder for the results")
    if not torch.cuda.is_available():
        print("santa_budget.py needs a CUDA GPU (use --check on a CPU)", file=sys.stderr)
        return 2
    args.shapes = parse_shapes(args.shapes)
    args.calls = [int(t) for t in args.calls.split(",") if t]
    t0 = time.time()
    report = run(args)
    device = torch.cuda.get_device_name()
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "santa_budget.json").write_text(json.dumps({"device": device, "seconds": round(time.time() - t0, 1),
                                                        "command": command, **report}, indent=1))
    md = markdown(report, device, command)
    (out / "santa_budget.md").write_text(md)
    print(md)
    print(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
