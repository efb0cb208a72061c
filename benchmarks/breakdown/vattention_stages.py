"""vAttention's kernel stages, each timed alone on the operands of one real decode step and checked against its
torch reference in the same run.

One ``vattention`` decode (defaults, the kernel path) runs on the bench's inputs with its stage functions
spied on: the arguments of the oracle top-k (``topk_select``), of the base sample (``sample_rows_triton``),
of the residual sample's cut (``sample_cut_triton``), of the budget (``budget_triton``) and of the tested-key
attention (``attend_triton``) are kept. Each stage is then called again on them — captured in a CUDA graph,
replayed with a cold L2 (``ColdL2Timer.time_graph_us``) — and its outputs compared:

- top-k (the scores pass over K and the select): the ways the method's shape rule (``oracle_topk.select_path``)
  picks between, ``torch`` (``torch.topk`` of the kept scores), ``triton`` (the Triton select, a long row's
  candidates merged by a second launch) and ``radix`` (``select_radix.topk_rows_radix``, spread over many
  programs per row; its chunk settings ``RADIX_WAYS``), with ``rule`` naming the one the decode ran; each the
  same set as the reference's sorted top-k up to ties (checked by the scores: the k-th largest equal, every
  chosen score at least it), and the Triton and radix lists equal to ``topk_rows_reference``'s (ascending, ties
  to the lowest index);
- top-k select alone: the same selects on the kept scores (the Triton select given the maxima of every 8
  scores, computed untimed), each with its launches' device times (``kernel µs``, torch profiler);
- base sample (a list, one program per row): equal to ``sample_rows_reference``;
- residual sample (the windowed cut): the keys it holds equal to the reference's;
- budget statistics: each launch setting (``BUDGET_WAYS``) against ``budget_stats_reference`` (float64 torch),
  the default's sizes against the kernel's rounding of its own sizes;
- attention: each launch setting (``ATTEND_WAYS``) and its own error against ``attend_reference`` (``way's rel
  err``, in its row), its worst query head's and its difference from the default setting's output.

A stage's checks common to its ways are repeated in every row of it; ``per way`` checks go to their way's row.

    python benchmarks/breakdown/vattention_stages.py OUT [--n 131072] [--batch 1] [--attention peaked]

Writes ``vattention_stages.json`` and ``.md`` to OUT. ``--check`` runs the spying and the checks on tiny CPU
inputs under Triton's interpreter (``TRITON_INTERPRET=1``), no timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

SPIED = (("kvsieve.kernels.oracle_topk.topk", "topk_select"),
         ("kvsieve.kernels.shared.sample_triton", "sample_rows_triton"),
         ("kvsieve.kernels.shared.sample_triton", "sample_cut_triton"),
         ("kvsieve.kernels.vattention.budget_triton", "budget_triton"),
         ("kvsieve.kernels.vattention.attend_triton", "attend_triton"))


def attempt(fn):
    """``fn()``, or the exception it raised (one failing way must not lose the others' checks)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return exc


def failures(results: dict) -> dict:
    """``{"failed": "way: error; ..."}`` for the ways whose call raised, else {}."""
    bad = {name: f"{type(x).__name__}: {x}"[:200] for name, x in results.items() if isinstance(x, Exception)}
    return {"failed": "; ".join(f"{k}: {v}" for k, v in bad.items())} if bad else {}


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def record_step(method, q, k, v, lens, key) -> dict[str, list[tuple[tuple, dict]]]:
    """``function name -> [(args, kwargs), ...]``: the spied functions' arguments (cloned before the call) in
    one decode of ``method``."""
    import importlib

    calls: dict[str, list[tuple[tuple, dict]]] = {name: [] for _, name in SPIED}
    saved = []
    for module, name in SPIED:
        mod = importlib.import_module(module)
        fn = getattr(mod, name)
        saved.append((mod, name, fn))

        def spy(*args, _fn=fn, _name=name, **kwargs):
            calls[_name].append((_clone(args), _clone(kwargs)))
            return _fn(*args, **kwargs)

        setattr(mod, name, spy)
    try:
        method.decode(q, k, v, lengths=lens, seed=key, state=method.new_state(), check_finite=False)
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    return calls


# The radix select's launch settings timed (topk_rows_radix's keywords; "sms": programs = that many per SM).
# The default: chunks giving about RADIX_PROGRAMS_PER_SM (8) programs per SM, at least 1024 units each, 6-bit
# digits (6 histogram launches), the histograms masked where tl.histogram has a mask.
RADIX_WAYS = {
    "radix": {},
    "radix-b8": {"digit_bits": 8},
    "radix-4/sm": {"sms": 4},
    "radix-16/sm": {"sms": 16},
    "radix-c16384": {"chunk": 16384},
    "radix-unmasked": {"hist_mask": False},
    "radix-pdl": {"pdl": True},
}


def topk_ways(args, kwargs) -> dict:
    """The top-k's ways on the recorded arguments: ``name -> call`` returning ``(indices, counts, scores)``."""
    from kvsieve.kernels.oracle_topk.topk import topk_select

    base = {k: v for k, v in kwargs.items() if k not in ("select", "launch_opts")}
    ways = {"torch": lambda: topk_select(*args, **base, select="torch"),
            "triton": lambda: topk_select(*args, **base, select="triton", launch_opts={"rows": {"merge": "launch"}})}
    for name, opts in RADIX_WAYS.items():
        kw = launch_opts(opts, args[0].device)
        ways[name] = lambda _kw=kw: topk_select(*args, **base, select="radix", launch_opts={"radix": _kw})
    return ways


def select_ways(scores, counts, k: int) -> dict:
    """The select alone on the kept ``scores [B, Hq, N]`` and ``counts [B]``: ``name -> call`` returning the
    indices (torch.topk sorted, highest first; the others ascending)."""
    from kvsieve.kernels.shared.select_radix import topk_rows_radix
    from kvsieve.kernels.shared.select_split import row_maxima
    from kvsieve.kernels.shared.select_triton import topk_rows_triton

    maxima = row_maxima(scores).contiguous()
    ways = {"torch": lambda: torch.topk(scores, k, dim=-1, sorted=True).indices,
            "triton": lambda: topk_rows_triton(scores, counts, k, maxima=maxima, merge="launch")}
    for name, opts in RADIX_WAYS.items():
        kw = launch_opts(opts, scores.device)
        ways[name] = lambda _kw=kw: topk_rows_radix(scores, counts, k, **_kw)
    return ways


def list_mismatches(idx, counts, scores) -> int:
    """Rows of an ascending list (the Triton and radix selects) that differ from ``topk_rows_reference``'s."""
    from kvsieve.kernels.shared.select_triton import topk_rows_reference

    want = topk_rows_reference(scores, counts[:, 0], idx.shape[-1])
    return int((idx != want).any(-1).sum())


# The attention pass's launch settings timed (attend_triton's keywords; "sms": programs = that many per SM, the
# SM count read on the device). The default: 32-key blocks, 4 warps, 3 stages, 5 programs per SM. 16-key blocks
# are refused by attend_triton (a wrong estimate on the H200).
ATTEND_WAYS = {
    "default": {},
    "b64-4/sm": {"block_n": 64, "sms": 4},
    "b32-s4-4/sm": {"block_n": 32, "num_stages": 4, "sms": 4},
    "b32-s3-6/sm": {"block_n": 32, "num_stages": 3, "sms": 6},
    "b32-s4-5/sm": {"block_n": 32, "num_stages": 4, "sms": 5},
}


def launch_opts(opts: dict, device) -> dict:
    """A way's keywords with ``sms`` (programs per SM) turned into ``programs``."""
    from kvsieve.kernels.shared.select_common import sm_count

    kw = {k: v for k, v in opts.items() if k != "sms"}
    if "sms" in opts:
        kw["programs"] = opts["sms"] * sm_count(device)
    return kw


def attend_ways(args, kwargs) -> dict:
    """The attention pass's ways on the recorded arguments (``ATTEND_WAYS``)."""
    from kvsieve.kernels.vattention.attend_triton import attend_triton

    settings = {name: launch_opts(opts, args[0].device) for name, opts in ATTEND_WAYS.items()}
    return {name: lambda _kw=kw: attend_triton(*args, **kwargs, **_kw) for name, kw in settings.items()}


def topk_error(idx, counts, scores) -> int:
    """Rows whose first ``count`` entries are not a top ``count`` of their scores (ties allowed): the chosen
    scores' smallest must equal the ``count``-th largest score, with no repeated index."""
    bad = 0
    s_sorted = torch.sort(scores, dim=-1, descending=True).values
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            c = int(counts[b, h])
            if c == 0:
                continue
            chosen = idx[b, h, :c]
            ok = chosen.unique().numel() == c and bool(scores[b, h, chosen].min() == s_sorted[b, h, c - 1])
            bad += not ok
    return bad


def sample_checks(call, listed: bool) -> dict:
    """The sample (the base list, or the residual cut) on one recorded call: mismatches against the
    reference's keys."""
    from kvsieve.kernels.shared import sample_triton as st
    from kvsieve.kernels.vattention.attend_triton import in_sample_reference

    args, kwargs = call
    fn = st.sample_rows_triton if listed else st.sample_cut_triton
    got = _clone(fn(*args, **kwargs))
    lo, hi, stream, start, end, size, n_av = args[:7]
    n = args[8] if listed else args[7]
    take = torch.minimum(size, n_av)
    excl, page = kwargs.get("excluded"), kwargs.get("page", 1)
    if listed:
        ref = st.sample_rows_reference(lo, hi, stream, start, end, take, args[7], n, excl, page)
        err = int((got[0] != ref).sum())
    else:
        ref = st.sample_rows_reference(lo, hi, stream, start, end, take, n, n, excl, page)
        used = torch.arange(n, device=ref.device) < take[..., None]
        mark = torch.zeros(*take.shape, n + 1, dtype=torch.bool, device=ref.device)
        mark = mark.scatter_(2, torch.where(used, ref, n), True)[..., :n]
        x = excl if page == 1 else excl[:, :, torch.arange(n, device=ref.device) // page]
        err = int((in_sample_reference(lo, hi, stream, start, end, x, got[0], got[1], n) != mark).sum())
    return {"ways": {"window" if not listed else "one program per row": lambda: fn(*args, **kwargs)},
            "mismatches vs reference": err, "size": float(take.double().mean())}


# The budget statistics' launch settings timed (budget_triton's keywords; "sms": splits per (row, query head)
# such that the split launch holds that many programs per SM, the SM count read on the device). The default
# (blocks of 32 entries, 4 warps, each step issuing the next block's gathers first) compiles (Triton 3.6, sm_90)
# to about 245 registers a thread: 2 programs per SM (SPLITS_PER_SM) are one wave.
BUDGET_WAYS = {
    "default": {},
    "4/sm": {"sms": 4},
    "b16-2/sm": {"block": 16, "sms": 2},
    "b64-w8-1/sm": {"block": 64, "num_warps": 8, "sms": 1},
}


def budget_ways(args, kwargs) -> dict:
    """The budget statistics' ways on the recorded arguments (``BUDGET_WAYS``)."""
    from kvsieve.kernels.shared.select_common import sm_count
    from kvsieve.kernels.vattention.budget_triton import budget_triton

    q = args[0]
    rows = q.shape[0] * q.shape[1]
    settings = {}
    for name, opts in BUDGET_WAYS.items():
        kw = {k: v for k, v in opts.items() if k != "sms"}
        if "sms" in opts:
            kw["splits"] = max(1, opts["sms"] * sm_count(q.device) // rows)
        settings[name] = kw
    return {name: lambda _kw=kw: budget_triton(*args, **kwargs, **_kw) for name, kw in settings.items()}


def budget_checks(call) -> dict:
    """The budget on one recorded call: its statistics against ``budget_stats_reference`` and its sizes the
    rounding of its own raw sizes (as the method clamps them)."""
    from kvsieve.kernels.vattention.budget_triton import budget_stats_reference, budget_triton

    args, kwargs = call
    got = _clone(budget_triton(*args, **kwargs))
    ref_kw = {k: v for k, v in kwargs.items() if k == "logits"}
    want = budget_stats_reference(*args[:14], **ref_kw)
    diff = (got.stats - want).abs() / want.abs().clamp(min=1e-300)
    ways = budget_ways(args, kwargs)
    res = {name: attempt(f) for name, f in ways.items()}
    worst = max(float(((x.stats - want).abs() / want.abs().clamp(min=1e-300)).max()) for x in res.values()
                if not isinstance(x, Exception))
    out = {"ways": ways, "stats max rel diff": float(diff.max()), "worst way's stats rel diff": worst,
           **failures(res)}
    rule = kwargs.get("rule")
    if rule is not None:
        n_s, base_counts = args[10], args[9]
        floor = base_counts if rule.floor_base else torch.ones_like(n_s)
        size = torch.ceil(torch.clamp(got.raw, max=float(rule.n_keys))).long()
        size = torch.minimum(torch.maximum(size, floor), n_s)
        out["same sizes"] = bool(torch.equal(size, got.size))
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


def worst_head(x: torch.Tensor, ref: torch.Tensor) -> tuple[float, int, int]:
    """``(rel err, row, head)`` of the query head of ``x [R, Hq, d]`` farthest from ``ref``'s."""
    per = (x - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)
    i = int(per.argmax())
    return float(f"{float(per.flatten()[i]):.3e}"), i // per.shape[1], i % per.shape[1]


def stage_calls(calls) -> dict[str, dict]:
    """``stage -> {"ways": {name: call}, checks...}`` from the recorded calls."""
    from kvsieve.kernels.vattention.attend_triton import attend_reference, attend_triton, in_sample_reference

    out: dict[str, dict] = {}
    if calls["topk_select"]:
        args, kwargs = calls["topk_select"][0]
        ways = topk_ways(args, kwargs)
        res = {name: attempt(f) for name, f in ways.items()}
        scores = res["torch"][2].clone()
        counts = res["torch"][1]
        ok = {name: r for name, r in res.items() if not isinstance(r, Exception)}
        out["top-k"] = {"ways": ways, "rule": kwargs.get("select"),
                        "bad rows": {name: topk_error(r[0], r[1], scores) for name, r in ok.items()},
                        "list mismatches": {name: list_mismatches(r[0], r[1], scores) for name, r in ok.items()
                                            if name != "torch"},
                        "size": float(counts.double().mean()), **failures(res)}
        if not kwargs.get("share_kv_group") or args[0].shape[1] == args[1].shape[1]:  # per-query-head rows
            k = res["torch"][0].shape[-1]
            ways = select_ways(scores, counts[:, 0].contiguous(), k)
            res = {name: attempt(f) for name, f in ways.items()}
            ok = {name: r for name, r in res.items() if not isinstance(r, Exception)}
            out["top-k select alone"] = {
                "ways": ways, "profile": True,
                "bad rows": {name: topk_error(r, counts, scores) for name, r in ok.items()},
                "list mismatches": {name: list_mismatches(r, counts, scores) for name, r in ok.items()
                                    if name != "torch"}, **failures(res)}
    if calls["sample_rows_triton"]:
        out["base sample (list)"] = sample_checks(calls["sample_rows_triton"][0], True)
    if calls["sample_cut_triton"]:
        out["residual sample (cut)"] = sample_checks(calls["sample_cut_triton"][0], False)
    if calls["budget_triton"]:
        out["budget statistics"] = budget_checks(calls["budget_triton"][0])
    if calls["attend_triton"]:
        args, kwargs = calls["attend_triton"][0]
        q, k, v, lengths, sink, window, scale, scores, excluded, lo, hi, stream, cut, tie, n_s, size = args
        got = attend_triton(*args, **kwargs).float()
        samp = in_sample_reference(lo, hi, stream, torch.clamp(lengths.long(), max=sink),
                                   torch.maximum(lengths.long() - window, torch.clamp(lengths.long(), max=sink)),
                                   excluded, cut, tie, k.shape[2])
        ref = attend_reference(q, k, v, lengths, sink, window, scale, scores, excluded, samp, n_s, size).float()
        ways = attend_ways(args, kwargs)
        res = {name: attempt(f) for name, f in ways.items()}
        ok = {name: x.float() for name, x in res.items() if not isinstance(x, Exception)}
        errs = {name: rel_err(x, ref) for name, x in ok.items()}
        worst = max(errs, key=errs.get) if errs else None
        out["attention"] = {"ways": ways, "rel err vs reference": rel_err(got, ref),
                            "worst way's rel err": errs.get(worst, float("nan")), "worst way": worst, **failures(res),
                            "per way": {"way's rel err": errs,
                                        "way's worst head (rel err, row, head)": {
                                            name: worst_head(x, ref) for name, x in ok.items()},
                                        "way's rel diff from the default": {
                                            name: rel_err(x, got) for name, x in ok.items()}}}
    return out


def run(args) -> list[dict]:
    import kvsieve
    from kvsieve.bench.decode import Case, Inputs
    from kvsieve.bench.timing import ColdL2Timer
    from kvsieve.core.rng import RandomKey

    timer = ColdL2Timer()
    x = Inputs(Case("llama-3.1-8b", 32, 8, 128, args.n, args.batch), torch.bfloat16, seed=0,
               attention=args.attention)
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    calls = record_step(kvsieve.method("vattention:backend=triton"), x.q, x.k, x.v, x.lens, RandomKey(7, (0, step)))
    rows = []
    for stage, info in stage_calls(calls).items():
        for name, fn in info["ways"].items():
            r = {"stage": stage, "way": name, "n": args.n, "batch": args.batch, "attention": args.attention,
                 **{k: v for k, v in info.items() if k not in ("ways", "profile", "per way")},
                 **{k: by_way[name] for k, by_way in info.get("per way", {}).items() if name in by_way}}
            try:
                r["graph_us"] = timer.time_graph_us(fn, warmup=3, iters=args.iters)["median_us"]
                if info.get("profile"):
                    kernels = timer.kernel_breakdown(fn)
                    if kernels:
                        r["kernel µs"] = {k: round(v, 1) for k, v in kernels.items()}
            except Exception as exc:  # noqa: BLE001 - one failing way must not lose the others
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(r)
            way_err = r.get("way's rel err")
            err = "" if way_err is None else f" (rel err {way_err:.2e})"
            print(f"{stage} / {name}: {r.get('graph_us', r.get('error'))}{err}", flush=True)
    return rows


def markdown(rows: list[dict], device: str) -> str:
    lines = [f"# vAttention stages ({device})", "",
             "shape 32/8/128 bf16, the operands of one decode step; µs = the stage alone captured in a CUDA graph, "
             "cold L2, median", "", "| n | batch | stage | way | µs | checks |", "|---:|---:|---|---|---:|---|"]
    for r in rows:
        checks = ", ".join(f"{k}={v}" for k, v in r.items()
                           if k not in ("stage", "way", "n", "batch", "attention", "graph_us"))
        us = f"{r['graph_us']:.1f}" if "graph_us" in r else "—"
        lines.append(f"| {r['n']} | {r['batch']} | {r['stage']} | {r['way']} | {us} | {checks} |")
    return "\n".join(lines) + "\n"


def check() -> None:
    """The spying and every stage's ways and checks on tiny CPU inputs (under the interpreter), no timing."""
    import kvsieve
    from kvsieve.core.rng import RandomKey

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from stages import tiny_inputs

    q, k, v, lens = tiny_inputs(torch.Generator().manual_seed(0))
    m = kvsieve.method("vattention:sink=4,window=8,top_k=0.05,base_rate=0.05,backend=triton")
    calls = record_step(m, q, k, v, lens, RandomKey(3, (0, 1)))
    stages = stage_calls(calls)
    assert set(stages) == {"top-k", "top-k select alone", "base sample (list)", "residual sample (cut)",
                           "budget statistics", "attention"}, set(stages)
    for stage, info in stages.items():
        for fn in info["ways"].values():
            fn()
        assert "failed" not in info, (stage, info)
        assert all(v == 0 for v in info.get("bad rows", {}).values()), (stage, info)
        assert all(v == 0 for v in info.get("list mismatches", {}).values()), (stage, info)
        assert info.get("mismatches vs reference", 0) == 0, (stage, info)
        assert info.get("rel err vs reference", 0.0) < 1e-4, (stage, info)
        assert info.get("worst way's rel err", 0.0) < 1e-4, (stage, info)
        assert all(v < 1e-4 for v in info.get("per way", {}).get("way's rel err", {}).values()), (stage, info)
        assert info.get("stats max rel diff", 0.0) < 1e-12 and info.get("same sizes", True), (stage, info)
        assert info.get("worst way's stats rel diff", 0.0) < 1e-12, (stage, info)
    assert stages["top-k"]["rule"] == "triton", stages["top-k"]  # a short row
    assert {"torch", "triton", *RADIX_WAYS} <= set(stages["top-k select alone"]["bad rows"]), stages
    assert set(stages["attention"]["per way"]["way's rel err"]) == set(ATTEND_WAYS), stages["attention"]
    print("check: ok")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for vattention_stages.json and .md")
    p.add_argument("--n", type=int, default=131072, help="context length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attention", default="peaked", choices=("peaked", "uniform"),
                   help="the bench's inputs: peaked (fitted to real models) or uniform (Gaussian q and K)")
    p.add_argument("--iters", type=int, default=20, help="timed graph replays")
    p.add_argument("--check", action="store_true", help="tiny CPU inputs under the interpreter, no timing")
    args = p.parse_args(argv)
    if args.check:
        check()
        return 0
    if not args.out:
        p.error("out: give a folder for the results")
    if not torch.cuda.is_available():
        print("vattention_stages.py needs a CUDA GPU (use --check under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    from kvsieve.bench.report import write_results

    t0 = time.time()
    rows = run(args)
    res = {"device": torch.cuda.get_device_name(), "seconds": round(time.time() - t0, 1), "rows": rows}
    paths = write_results(res, args.out, "vattention_stages", " ".join(sys.argv),
                          to_markdown=lambda r, _command: markdown(r["rows"], r["device"]), to_plot=lambda *_: False)
    print(paths[1].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
