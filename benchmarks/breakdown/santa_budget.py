"""S²ANTA-prop's tile budgets by each way of finding the largest-remainder +1s (``santa/common.py``:
``BUDGET_SELECT`` and its settings), each checked against the sort and the torch reference in the same run.

- The budget launch alone (``two_pass.prop_budgets``: programmatic dependent launch off, so nothing waits),
  captured in a CUDA graph and replayed with a cold L2 (``ColdL2Timer.time_graph_us``), on the (m, l) of a real
  stats pass over the bench's peaked inputs (Llama-3.1-8B shape: 32 q heads, 8 KV heads, d 128, bf16), tile 256,
  budget 128, at each ``--shapes`` entry BATCH:TILES (TILES·256 − 192 keys when TILES is odd: a last tile
  partly filled, as the runtime's cache of 128k + new tokens has).
- The whole santa-prop call and Bernoulli qKᵀ's (values by santa-prop) through ``kvsieve.method(...).decode``,
  graph-timed the same way, at each ``--calls`` entry (batch 1).
- Checks, per variant: the budgets equal the sort's bit for bit (real stats, and synthetic rows with tied
  fractions, zero remainders, tiles of no mass and rows of different lengths), sum to the budget, and the
  sort's equal ``systematic.largest_remainder`` on the same masses (rows that differ are counted: the
  kernel's float32 exp is not torch's, so a near-tie may fall the other way; 0 expected).

Writes ``santa_budget.json`` and ``santa_budget.md`` to the folder given. ``--check`` runs the synthetic checks
of every variant on the CPU (under ``TRITON_INTERPRET=1``), without timing.

    python benchmarks/breakdown/santa_budget.py OUT [--variants sort,radix:2,histogram:4,count:64]
        [--shapes 1:512,1:513,1:1024,8:128,8:129] [--calls 512,513]

Variants: ``sort``, ``radix:BITS`` (1, 2, 4), ``histogram:BITS`` (2, 4, 5, 10), ``count:COLS[:CHUNK]`` (columns
per program of the two-pass launch, columns ranked per step (default ``BUDGET_CHUNK``); ``count:0`` one program
per row, what v10's budget kernel runs: run at rows
of at most ``COUNT_ONE_MAX`` tiles only, its unrolled count grows with the square of the row). The budget
launches are compiled first by ``--jobs`` processes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvsieve.kernels.santa import common  # noqa: E402

DEFAULT_VARIANTS = ("sort,radix:2,radix:4,histogram:4,histogram:5,histogram:10,count:16,count:32,count:64,count:64:64,"
                    "count:128,count:0")
TILE = 256
BUDGET = 128
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
COUNT_ONE_MAX = 256  # count:0 is timed at rows of at most this many tiles
SEED = 11
DEVICE = "cuda"


def variant_settings(name: str) -> dict:
    """``common``'s settings of a variant name (``"radix:2"`` -> select radix, 2 bits a step)."""
    select, _, arg = name.partition(":")
    if select == "sort" and not arg:
        return {"BUDGET_SELECT": "sort"}
    if select in ("radix", "histogram") and arg.isdigit():
        return {"BUDGET_SELECT": select, "BUDGET_RADIX_BITS": int(arg)}
    cols, _, chunk = arg.partition(":")
    if select == "count" and cols.isdigit() and (chunk.isdigit() or not chunk):
        out = {"BUDGET_SELECT": "count", "BUDGET_COUNT_COLS": int(cols)}
        return {**out, "BUDGET_CHUNK": int(chunk)} if chunk else out
    raise ValueError(f"--variants: {name!r} (expected sort, radix:BITS, histogram:BITS or count:COLS[:CHUNK])")


@contextlib.contextmanager
def variant(name: str):
    """``common``'s budget settings of the variant while the block runs (read at launch time)."""
    values = variant_settings(name)
    before = {key: getattr(common, key) for key in values}
    for key, val in values.items():
        setattr(common, key, val)
    try:
        yield
    finally:
        for key, val in before.items():
            setattr(common, key, val)


def budgets(name: str, m, l, lens, t: int, budget: int = BUDGET, tile: int = TILE) -> torch.Tensor:
    """The variant's tile budgets ``[B, Hq, T]`` of the stats ``m, l [B, Hq, T]`` (one budget launch)."""
    from kvsieve.kernels.santa.two_pass import prop_budgets

    b, hq, _ = m.shape
    buf = types.SimpleNamespace(m=m.reshape(-1), l=l.reshape(-1),
                                budgets=torch.full((b, hq, t), -1, device=m.device, dtype=torch.int32))
    with variant(name):
        prop_budgets(lens, buf, budget, tile, SEED, b, hq, t, rounding="largest-remainder", pdl=False)
    return buf.budgets


def reference(m, l, lens, budget: int = BUDGET, tile: int = TILE) -> torch.Tensor:
    """``largest_remainder`` of the tile masses ``e^{m - m*} l`` (float32, as the kernels), tiles past each
    row's length left out."""
    from kvsieve.kernels.santa.systematic import largest_remainder

    t = m.shape[-1]
    valid = (torch.arange(t, device=m.device) < ((lens.long() + tile - 1) // tile)[:, None])[:, None, :]
    m = torch.where(valid, m, float("-inf"))
    m_star = m.amax(-1, keepdim=True)
    w = torch.where(valid, torch.exp(m - torch.where(torch.isfinite(m_star), m_star, 0.0)) * l, 0.0)
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


def runs(name: str, t: int) -> bool:
    """Whether the variant runs at rows of t tiles on the GPU (count:0 only up to ``COUNT_ONE_MAX``)."""
    return not (name == "count:0" and t > COUNT_ONE_MAX)


def check_case(names, m, l, lens) -> dict:
    """Every variant's budgets against the sort's and the reference: ``{variant: {"equal_sort", "sums_ok" (each
    row sums to the reference's: the budget, or 0 for a row of no mass), "rows_off_reference"}}`` (the last for
    the sort only)."""
    t = m.shape[-1]
    want = budgets("sort", m, l, lens, t)
    ref = reference(m, l, lens)
    out = {}
    for name in (name for name in names if runs(name, t)):
        got = want if name == "sort" else budgets(name, m, l, lens, t)
        # rows of no mass at all get no budget (the reference's too)
        r = {"equal_sort": bool(torch.equal(got, want)), "sums_ok": bool(torch.equal(got.sum(-1), ref.sum(-1)))}
        if name == "sort":
            r["rows_off_reference"] = int((got != ref).any(-1).sum())
        out[name] = r
    return out


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


def _compile_one(name: str, b: int, t: int) -> float:
    """One budget launch of the variant at (b, t) on dummy stats: compiles it into Triton's cache (a worker of
    :func:`precompile`); returns the seconds it took."""
    t0 = time.time()
    m = torch.zeros(b, HEADS, t, device=DEVICE)
    budgets(name, m, torch.ones_like(m), torch.full((b,), t * TILE, device=DEVICE, dtype=torch.int32), t)
    torch.cuda.synchronize()
    return time.time() - t0


def precompile(variants, shapes, jobs: int) -> float:
    """Compile every (variant, shape) budget launch in ``jobs`` worker processes first (Triton's on-disk cache
    then serves the timed process): some forty compiles, one at a time, would take most of the two minutes.
    The launches take the timed ones' arguments (32 heads, the shapes' tiles), hence their specialisations."""
    import concurrent.futures
    import multiprocessing

    t0 = time.time()
    todo = [(name, b, t) for b, t in shapes for name in variants if runs(name, t)]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_one, *zip(*todo, strict=True)))
    return time.time() - t0


def load_stages():
    spec = importlib.util.spec_from_file_location("breakdown_stages", Path(__file__).with_name("stages.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CALLS = {"santa-prop": "santa-prop:budget=128",
         "bernoulli-qk+santa-prop": "bernoulli-qk:query=mean-group,values=santa-prop,budget=128"}


def run(args) -> dict:
    from kvsieve.bench.timing import ColdL2Timer
    from kvsieve.kernels.santa.two_pass import prop_budgets

    timer = ColdL2Timer()
    report = {"budget": [], "calls": [], "checks": {}}
    if args.jobs > 1:
        print(f"precompiled in {precompile(args.variants, args.shapes, args.jobs):.1f} s", flush=True)
    t0 = time.time()
    for name, m, l, lens in synthetic_cases(DEVICE, args.shapes, HEADS):
        report["checks"][name] = check_case(args.variants, m, l, lens)
    print(f"synthetic checks ({time.time() - t0:.1f} s)", flush=True)
    call_ts = set(args.calls)
    stages = load_stages() if call_ts else None
    for b, t in args.shapes:
        t1 = time.time()
        x, m, l = stats(b, t, args.attention)
        report["checks"][f"real b={b} t={t}"] = check_case(args.variants, m, l, x.lens)
        buf = types.SimpleNamespace(m=m.reshape(-1), l=l.reshape(-1),
                                    budgets=torch.empty(b, HEADS, t, device=DEVICE, dtype=torch.int32))
        one_launch = functools.partial(prop_budgets, x.lens, buf, BUDGET, TILE, SEED, b, HEADS, t,
                                       rounding="largest-remainder", pdl=False)
        for name in args.variants:
            r = {"batch": b, "tiles": t, "variant": name}
            if not runs(name, t):
                r["skipped"] = f"count:0 runs at rows of at most {COUNT_ONE_MAX} tiles"
            else:
                with variant(name):
                    r["programs"] = common.budget_meta(t, rounding="largest-remainder", split=True)[0] * b * HEADS
                    r.update(timer.time_graph_us(one_launch, warmup=5, iters=args.iters))
            report["budget"].append(r)
            print(f"budget b={b} t={t} {name}: {r.get('median_us', r.get('skipped'))}", flush=True)
        if b == 1 and t in call_ts:
            step = torch.zeros((), dtype=torch.int64, device=DEVICE)
            for label, spec in CALLS.items():
                call, _ = stages.make_call(spec, x.q, x.k, x.v, x.lens, step)
                for name in (name for name in args.variants if runs(name, t)):
                    r = {"batch": b, "tiles": t, "call": label, "variant": name}
                    try:
                        with variant(name):
                            r.update(timer.time_graph_us(call, warmup=3, iters=args.iters))
                    except Exception as exc:  # noqa: BLE001 - one failing call must not lose the others
                        r["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    report["calls"].append(r)
                    print(f"call {label} t={t} {name}: {r.get('median_us', r.get('error'))}", flush=True)
        del x
        torch.cuda.empty_cache()
        print(f"shape b={b} t={t} ({time.time() - t1:.1f} s)", flush=True)
    return report


def markdown(report: dict, device: str, command: str) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in report["budget"]))
    lines = [f"# S²ANTA-prop tile budgets by each largest-remainder select ({device})", "",
             f"`{command}`", "",
             "Budget launch alone (two-pass launch, PDL off), graph-replayed, cold L2, median µs; (m, l) of a real "
             f"stats pass over peaked inputs; {HEADS} q heads, tile {TILE}, budget {BUDGET}. `=` the budgets equal the "
             "sort's on the same stats.", "",
             "| batch:tiles | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    shapes = list(dict.fromkeys((r["batch"], r["tiles"]) for r in report["budget"]))
    for b, t in shapes:
        check = report["checks"].get(f"real b={b} t={t}", {})
        cells = []
        for name in variants:
            r = next(r for r in report["budget"] if (r["batch"], r["tiles"], r["variant"]) == (b, t, name))
            ok = "=" if check.get(name, {}).get("equal_sort") and check[name]["sums_ok"] else "≠"
            cells.append(f"{r['median_us']:.1f} {ok}" if "median_us" in r else "—")
        lines.append(f"| {b}:{t} | " + " | ".join(cells) + " |")
    if report["calls"]:
        lines += ["", "Whole call (`kvsieve.method(...).decode`, batch 1), graph-replayed, cold L2, median µs:", "",
                  "| call | tiles | " + " | ".join(variants) + " |", "|---|---:|" + "---:|" * len(variants)]
        for label, t in dict.fromkeys((r["call"], r["tiles"]) for r in report["calls"]):
            cells = []
            for name in variants:
                r = next((r for r in report["calls"] if (r["call"], r["tiles"], r["variant"]) == (label, t, name)),
                         {})
                cells.append(f"{r['median_us']:.1f}" if "median_us" in r else r.get("error", "—")[:40])
            lines.append(f"| {label} | {t} | " + " | ".join(cells) + " |")
    lines += ["", "Checks: variants whose budgets differ from the sort's or do not sum to the budget, and rows where "
              "the sort differs from `largest_remainder` (float32 exp of torch, not the kernel's):", ""]
    bad = []
    for case, per in report["checks"].items():
        for name, r in per.items():
            if not (r["equal_sort"] and r["sums_ok"]):
                bad.append(f"- {case}: {name} {'differs from the sort' if not r['equal_sort'] else 'bad sums'}")
        off = per.get("sort", {}).get("rows_off_reference")
        if off:
            bad.append(f"- {case}: sort differs from largest_remainder in {off} rows")
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


def check(variants) -> None:
    """The synthetic checks of every variant on the CPU (the interpreter), no timing."""
    for name, m, l, lens in synthetic_cases("cpu", [(3, t) for t in (1, 2, 15, 16, 17, 129)], 4):
        for var, r in check_case(variants, m, l, lens).items():
            assert r["equal_sort"] and r["sums_ok"], (name, var, r)
            assert r.get("rows_off_reference", 0) == 0, (name, var, r)
    print("check: ok")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for santa_budget.json and santa_budget.md")
    p.add_argument("--out", dest="out_opt", help="the folder, as an option")
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--shapes", default="1:512,1:513,1:1024,8:128,8:129", help="BATCH:TILES list (budget launch)")
    p.add_argument("--calls", default="512,513", help="tiles (batch 1) at which the whole calls are timed; '' none")
    p.add_argument("--attention", default="peaked", choices=("peaked", "uniform"))
    p.add_argument("--iters", type=int, default=30, help="timed graph replays")
    p.add_argument("--jobs", type=int, default=8, help="processes that compile the budget launches first (1: none)")
    p.add_argument("--check", action="store_true", help="the synthetic checks on the CPU (TRITON_INTERPRET=1)")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    for name in args.variants:
        variant_settings(name)
    if "sort" not in args.variants:
        args.variants.insert(0, "sort")  # the reference of the checks
    if args.check:
        check(args.variants)
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
