"""SAAP's probe and index update, one layer, Llama-3.1-8B heads (32 query heads, 8 KV heads, d 128; C = 1024,
ℓ = 32, window 2047): the probe's three launches (hidden layer, logits, rank) alone (``probe``) and with each index
update inside them (``step-serial``: the serial update in the hidden-layer launch; ``step-parallel``: the parallel
update's first stage there, its second in the rank launch), each update alone (serial: one launch; parallel: two),
and the layer's whole step as the method runs it (``layer``: the probe with the update its batch rule picks,
:func:`kvsieve.kernels.saap.index.parallel_update`, then the bucket attention); and ``index_update=ahead``'s
(``layer-ahead``: the probe alone, the update one step ahead in the bucket attention's launch; ``update-ahead``: that
update in a launch of its own). Every variant is captured in a CUDA
graph and replayed on a cold L2 (``kvsieve.bench.timing``), profiled per kernel (torch.profiler names), and checked
in the same run against the torch references: the group scores against ``probe_scores_reference``, the top-ℓ
against ``top_buckets_reference`` of the variant's own scores (exactly) and of the reference's (agreement reported:
near ties may differ), the index after the update against ``assign_tail_reference`` (exactly; the ahead variants
against ``assign_ahead_reference``), the layer's attention against exact attention over the keys of its buckets in
the reference's index (``index_decode_reference``).
``--variants b8`` times the batch-8 variants (:data:`B8_VARIANTS`: the update ahead one program a (row, KV head),
chunks of 32 keys in the bucket loop, larger rank chunks, rank passes that skip, and combinations) with the current
paths they replace (``update-ahead``, ``probe``, ``layer-ahead``), each checked against the references as above and
against its current path on the same inputs (the same top-ℓ, scores and index bit for bit; the layer's output bit for
bit, or within 2e-2 where the bucket loop's chunk changes its float32 sums).
``--sweep parallel,rank,ahead,ahead-row,hidden`` (or ``all``) also times a variant over launch constants
(:data:`SWEEPS`): ``step-parallel`` over the parallel update's blocks, ``probe`` over the rank launch's chunk
(``probe.RANK_CHUNK``: fewer programs recomputing the group softmax at batch 8) and over the hidden layer's tile,
``layer-ahead`` over the ahead update's centroid block, ``layer-ahead-row`` over the row form's tile.

    python benchmarks/saap_probe/run.py --out OUT [--cases 1x131072,8x32768] [--hidden 256] [--iters 40]
        [--variants all|b8|NAME,...] [--sweep all]
    TRITON_INTERPRET=1 python benchmarks/saap_probe/run.py --check   # tiny shapes on the CPU: the checks only

Writes ``saap_probe.json`` and ``saap_probe.md`` into OUT. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from kvsieve.kernels.saap import index, probe
from kvsieve.kernels.saap.buckets import bucket_sparse_decode_triton, build_csr, fused_merge_default
from kvsieve.kernels.saap.index import (
    assign_ahead_reference,
    assign_ahead_triton,
    assign_tail_parallel_triton,
    assign_tail_reference,
    assign_tail_triton,
    build_assign,
    index_decode_reference,
)
from kvsieve.kernels.saap.probe import probe_scores_reference, probe_scores_triton, serve_weights, top_buckets_reference

LLAMA = dict(hq=32, hkv=8, d=128, buckets=1024, probes=32, window=2047, theta=500000.0)
TINY = dict(hq=8, hkv=2, d=32, buckets=64, probes=4, window=40, theta=10000.0)
SPAN = index.UPDATE_SPAN


def make_case(batch: int, n_keys: int, hidden: int, shape: dict, dev: torch.device, seed: int = 0) -> dict:
    """Random inputs of one layer's step: queries, the key and value caches, centroids, the classifier (serve
    weights), and the index built three steps ago (``3·SPAN`` keys before: the update has ``SPAN`` keys to assign;
    ragged lengths at batch > 1)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, c = shape["hq"], shape["hkv"], shape["d"], shape["buckets"]
    w = serve_weights(torch.randn(hkv, d, hidden, generator=g) * d ** -0.5, torch.randn(hkv, hidden, generator=g),
                      torch.randn(hkv, hidden, c, generator=g) * hidden ** -0.5, torch.randn(hkv, c, generator=g))
    lengths = n_keys - torch.randint(0, max(1, n_keys // 64), (batch,), generator=g)
    lengths[0] = n_keys
    window = torch.full((batch,), shape["window"])
    torch.manual_seed(seed)  # the key cache is drawn on the device (537 MB at 8 × 32k)
    case = {
        "q": torch.randn(batch, hq, d, generator=g).to(torch.bfloat16).to(dev),
        "k": torch.randn(batch, hkv, n_keys, d, device=dev, dtype=torch.bfloat16),
        "v": torch.randn(batch, hkv, n_keys, d, device=dev, dtype=torch.bfloat16),
        "w": [t.to(dev) for t in w],
        "lengths": lengths.to(dev),
        "window": window.to(dev),
        "centroids": torch.nn.functional.normalize(torch.randn(hkv, c, d, generator=g), dim=-1).to(dev),
        "inv_freq": (1.0 / (shape["theta"] ** (torch.arange(0, d, 2).float() / d))).to(dev),
        "sink_ids": torch.zeros(batch, hkv, 1, dtype=torch.long, device=dev),  # the sink: position 0
        "sink_counts": torch.ones(batch, hkv, dtype=torch.long, device=dev),
        "shape": shape,
    }
    case["assign"], case["t_lo"] = build_assign(case["k"], case["lengths"] - 3 * SPAN, case["window"], 1,
                                                case["centroids"], case["inv_freq"], 1.0, n_keys)
    case["offsets"], case["ids"] = build_csr(case["assign"], c)
    return case


def tail_of(case: dict, assign: torch.Tensor) -> tuple:
    return (assign, case["k"], case["t_lo"], case["lengths"], case["window"], SPAN, case["centroids"],
            case["inv_freq"], 1.0)


def layer_step(case: dict, assign: torch.Tensor, ahead: bool = False, ahead_per: str | None = None,
               block_n: int | None = None, rank_chunk: int | None = None, rank_skip: bool | None = None):
    """The method's step on the Triton path: the probe (with the update of the batch's rule) then the bucket
    attention; with ``ahead`` the probe alone, and the update one step ahead in the attention's launch
    (``index_update=ahead``). The batch-8 variants: ``ahead_per`` (which programs run the update ahead),
    ``block_n`` (the bucket loop's chunk), ``rank_chunk`` (buckets a rank program ranks), ``rank_skip`` (rank
    passes skipped where they cannot reach the top-ℓ). Returns ``(out, top)``."""
    b, hkv, n = case["k"].shape[:3]
    _, top = probe_scores_triton(case["q"], case["lengths"], case["inv_freq"], 1.0, *case["w"], kv_heads=hkv,
                                 probes=case["shape"]["probes"], position_offset=-1,
                                 tail=None if ahead else tail_of(case, assign), rank_chunk=rank_chunk,
                                 rank_skip=rank_skip)
    fused = fused_merge_default(b * hkv, n, block_n)
    out, _, _ = bucket_sparse_decode_triton(
        case["q"], case["k"], case["v"], case["sink_ids"], case["sink_counts"], case["offsets"], case["ids"], top, 0,
        sliding=(case["lengths"], case["window"], case["t_lo"], assign), fused_merge=fused,
        ahead=(case["centroids"], case["inv_freq"], 1.0, SPAN) if ahead else None, ahead_per=ahead_per,
        block_n=block_n)
    return out, top


#: The current paths (``--variants all``), as :func:`variants` names them.
CURRENT_VARIANTS = ("update-serial", "update-parallel", "probe", "step-serial", "step-parallel", "layer",
                    "update-ahead", "layer-ahead")
#: The batch-8 variants (``--variants b8`` times them with the current path they replace): name → (the current
#: variant it is checked against, :func:`layer_step`'s keywords, or ``rank_chunk`` / ``rank_skip`` / ``per`` for a
#: probe / an update alone). ``row``: the update ahead one program a (row, KV head) (``index.AHEAD_PER``); ``n32``:
#: chunks of 32 keys in the bucket loop (``buckets.BUCKET_BLOCK_N``); ``rank N``: the rank launch's programs rank N
#: buckets each, B·Hkv·C / N programs (``probe.RANK_CHUNK``); ``skip``: a rank pass skips its comparisons where ℓ
#: scores beat all of its buckets (``probe.RANK_SKIP``).
B8_VARIANTS = {
    "update-ahead-row": ("update-ahead", dict(per="row")),
    "layer-ahead-row": ("layer-ahead", dict(ahead_per="row")),
    "layer-ahead-n32": ("layer-ahead", dict(block_n=32)),
    "layer-ahead-row-n32": ("layer-ahead", dict(ahead_per="row", block_n=32)),
    "probe-rank128": ("probe", dict(rank_chunk=128)),
    "probe-rank256": ("probe", dict(rank_chunk=256)),
    "probe-skip": ("probe", dict(rank_skip=True)),
    "probe-rank128-skip": ("probe", dict(rank_chunk=128, rank_skip=True)),
    "layer-ahead-row-rank128-skip": ("layer-ahead", dict(ahead_per="row", rank_chunk=128, rank_skip=True)),
    "layer-ahead-row-n32-rank128-skip": ("layer-ahead", dict(ahead_per="row", block_n=32, rank_chunk=128,
                                                             rank_skip=True)),
}


def variants(case: dict) -> dict:
    """``{name: (call, assign or None, kind)}``: each call, the index it updates (its own copy) and what it
    returns (``update``: nothing; ``probe``: ``(scores, top)``; ``layer``: ``(out, top)``); the current paths, then
    :data:`B8_VARIANTS`."""
    hkv, probes = case["shape"]["hkv"], case["shape"]["probes"]
    out = {}
    for name in ("update-serial", "update-parallel"):
        a = case["assign"].clone()
        fn = assign_tail_triton if name == "update-serial" else assign_tail_parallel_triton
        out[name] = ((lambda fn=fn, a=a: fn(*tail_of(case, a))), a, "update")
    for name, parallel in (("probe", None), ("step-serial", False), ("step-parallel", True)):
        a = case["assign"].clone() if parallel is not None else None

        def call(parallel=parallel, a=a):
            return probe_scores_triton(case["q"], case["lengths"], case["inv_freq"], 1.0, *case["w"],
                                       kv_heads=hkv, probes=probes, position_offset=-1,
                                       tail=tail_of(case, a) if a is not None else None, parallel_tail=parallel)

        out[name] = (call, a, "probe")
    a = case["assign"].clone()
    out["layer"] = ((lambda a=a: layer_step(case, a)), a, "layer")
    # index_update=ahead: the keys leaving the window at this step were assigned at the step before (the index as
    # the step update leaves it); this step assigns the next ones, alone or in the attention's launch
    stepped = case["assign"].clone()
    assign_tail_reference(*tail_of(case, stepped))
    a = stepped.clone()
    out["update-ahead"] = ((lambda a=a: assign_ahead_triton(*tail_of(case, a))), a, "update")
    a = stepped.clone()
    out["layer-ahead"] = ((lambda a=a: layer_step(case, a, ahead=True)), a, "layer")
    for name, (base, kw) in B8_VARIANTS.items():
        a = None if base == "probe" else stepped.clone()
        if base == "probe":
            def call(kw=kw):
                return probe_scores_triton(case["q"], case["lengths"], case["inv_freq"], 1.0, *case["w"],
                                           kv_heads=hkv, probes=probes, position_offset=-1, **kw)
        elif base == "update-ahead":
            def call(kw=kw, a=a):
                return assign_ahead_triton(*tail_of(case, a), **kw)
        else:
            def call(kw=kw, a=a):
                return layer_step(case, a, ahead=True, **kw)
        out[name] = (call, a, out[base][2])
    return out


def same_as_current(result, assign, kind: str, current: tuple) -> dict:
    """A batch-8 variant against the current path it replaces, run on the same inputs: the same top-ℓ, scores and
    index bit for bit, and the layer's output (bit for bit unless the bucket loop's chunk changes its float32 sums)."""
    cur_result, cur_assign = current
    got = {}
    if assign is not None:
        got["assign_same_as_current"] = bool(torch.equal(assign, cur_assign))
    if kind == "probe":
        got["top_same_as_current"] = bool(torch.equal(result[1], cur_result[1]))
        got["scores_same_as_current"] = bool(torch.equal(result[0], cur_result[0]))
    if kind == "layer":
        got["top_same_as_current"] = bool(torch.equal(result[1], cur_result[1]))
        got["out_diff_to_current"] = float((result[0].float() - cur_result[0].float()).abs().max())
    got["same_as_current"] = all(v for k, v in got.items() if k.endswith("_same_as_current")) \
        and got.get("out_diff_to_current", 0.0) < 2e-2
    return got


def references(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores, top, assign, assign_ahead)`` of the torch references for the case's step (``assign_ahead``: the
    index after the step update and the update one step ahead)."""
    scores = probe_scores_reference(case["q"], case["lengths"] - 1, case["inv_freq"], 1.0, *case["w"],
                                    kv_heads=case["shape"]["hkv"])
    assign = case["assign"].clone()
    assign_tail_reference(*tail_of(case, assign))
    ahead = assign.clone()
    assign_ahead_reference(*tail_of(case, ahead))
    return scores, top_buckets_reference(scores, case["shape"]["probes"]), assign, ahead


def check(result, assign, kind: str, ref: tuple, case: dict, ahead: bool = False) -> dict:
    """The variant's outputs against the references (after its calls: a repeated update writes the same values);
    a layer's attention against exact attention over the keys its buckets select in the reference's index
    (``ahead``: the index is the one-step-ahead update's)."""
    ref_scores, ref_top, ref_assign, ref_ahead = ref
    if ahead:
        ref_assign = ref_ahead
    got = {}
    if kind == "layer":
        out, top = result
        want, _ = index_decode_reference(case["q"], case["k"], case["v"], case["lengths"], case["window"], 1,
                                         ref_assign, top)
        got["out_max_abs_err"] = float((out.float() - want.float()).abs().max())
        got["top_set_agreement"] = float((top.sort(-1).values == ref_top.sort(-1).values).float().mean())
    if kind == "probe":
        scores, top = result
        got["scores_max_abs_err"] = float((scores - ref_scores).abs().max())
        got["top_equal_own_scores"] = bool(torch.equal(top, top_buckets_reference(scores, top.shape[-1])))
        got["top_set_agreement"] = float((top.sort(-1).values == ref_top.sort(-1).values).float().mean())
    if assign is not None:
        got["assign_equal"] = bool(torch.equal(assign, ref_assign))
    got["ok"] = (got.get("assign_equal", True) and got.get("top_equal_own_scores", True)
                 and got.get("scores_max_abs_err", 0.0) < 1e-4 and got.get("out_max_abs_err", 0.0) < 2e-2)
    return got


def run_case(batch: int, n_keys: int, hidden: int, shape: dict, dev: torch.device, timer, iters: int,
             only: list[str] | None = None) -> list[dict]:
    """The variants (those in ``only``, default all) timed and checked."""
    from kvsieve.bench.timing import count_launches

    case = make_case(batch, n_keys, hidden, shape, dev)
    ref = references(case)
    rows = []
    table = variants(case)
    bases = {base for name, (base, _) in B8_VARIANTS.items() if only is None or name in only}
    current = {}
    with torch.inference_mode():
        for name, (call, assign, kind) in table.items():
            if only is not None and name not in only:
                if name in bases:  # the current path a variant is checked against: run, not timed
                    result = call()
                    current[name] = (result, None if assign is None else assign.clone())
                continue
            row = {"batch": batch, "n_keys": n_keys, "hidden": hidden, "variant": name}
            try:
                result = call()
                if name in bases:
                    current[name] = (result, None if assign is None else assign.clone())
                if timer is not None:
                    row["graph_us"] = timer.time_graph_us(call, iters=iters)["median_us"]
                    row["kernels_us"] = timer.kernel_breakdown(call)
                    row["launches"] = count_launches(call)
                row.update(check(result, assign, kind, ref, case, ahead="ahead" in name))
                if name in B8_VARIANTS:
                    row.update(same_as_current(result, assign, kind, current[B8_VARIANTS[name][0]]))
                    row["ok"] = row["ok"] and row["same_as_current"]
            except Exception as err:  # a variant that fails to compile or run on this device: reported, the rest run
                if name in bases:
                    raise
                row.update(ok=False, error=f"{type(err).__name__}: {str(err)[:300]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


#: ``--sweep``: (module, constants and their values, variant timed) — the parallel update's launch constants, the
#: rank launch's chunk (programs per row and KV head: C / RANK_CHUNK), the ahead update's centroid block (one program
#: a key, one a row), the hidden layer's tile.
SWEEPS = {
    "parallel": (index, {"PARALLEL_BLOCK_C": (32, 64, 128), "PARALLEL_BLOCK_R": (16, 32, 64)}, "step-parallel"),
    "rank": (probe, {"RANK_CHUNK": (32, 64, 128, 256)}, "probe"),
    "ahead": (index, {"AHEAD_BLOCK_C": (32, 64, 128)}, "layer-ahead"),
    "ahead-row": (index, {"AHEAD_ROW_BLOCK_C": (16, 32, 64)}, "layer-ahead-row"),
    "hidden": (probe, {"HIDDEN_TILE_H": (16, 32, 64), "HIDDEN_TILE_R": (16, 32)}, "probe"),
}


def sweep(batch: int, n_keys: int, hidden: int, shape: dict, dev: torch.device, timer, iters: int,
          which: str) -> list[dict]:
    """A variant over every combination of a module's launch constants (:data:`SWEEPS`), each checked (and timed
    with a ``timer``)."""
    module, grid, variant = SWEEPS[which]
    case = make_case(batch, n_keys, hidden, shape, dev)
    ref = references(case)
    before = {name: getattr(module, name) for name in grid}
    rows = []
    try:
        for values in itertools.product(*grid.values()):
            setting = dict(zip(grid, values, strict=True))
            for name, value in setting.items():
                setattr(module, name, value)
            call, assign, kind = variants(case)[variant]
            with torch.inference_mode():
                result = call()
                row = {"batch": batch, "n_keys": n_keys, "hidden": hidden, "variant": variant, "constants": setting}
                if timer is not None:
                    row["graph_us"] = timer.time_graph_us(call, iters=iters)["median_us"]
                row.update(check(result, assign, kind, ref, case, ahead="ahead" in variant))
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for name, value in before.items():
            setattr(module, name, value)
    return rows


def markdown(meta: dict, rows: list[dict], sweep_rows: list[dict]) -> str:
    lines = [f"# SAAP probe + index update, one layer ({meta['device']})", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}; torch {meta['torch']}",
             f"- {meta['shape']}, bf16 queries and keys, bf16 serve weights; graph replay on a cold L2, median µs; "
             "kernels: profiler device µs per kernel name", "",
             "| batch | keys | hidden | variant | graph µs | launches | kernels (µs) | check |",
             "|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        ks = ", ".join(f"{k.split('(')[0][:28]} {v:.1f}" for k, v in sorted((r.get("kernels_us") or {}).items()))
        verdict = "ok" if r["ok"] else "FAIL"
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['n_keys']:,} | {r['hidden']} | {r['variant']} | – | – |  | FAIL "
                         f"({r['error'][:120].replace('|', '/')}) |")
            continue
        details = [f"err {r['scores_max_abs_err']:.1e}", f"top/own {r['top_equal_own_scores']}"] \
            if "scores_max_abs_err" in r else []
        if "out_max_abs_err" in r:
            details.append(f"out err {r['out_max_abs_err']:.1e}")
        if "top_set_agreement" in r:
            details.append(f"top/ref {r['top_set_agreement']:.3f}")
        if "assign_equal" in r:
            details.append(f"assign {r['assign_equal']}")
        if "same_as_current" in r:
            diff = f", out diff {r['out_diff_to_current']:.1e}" if "out_diff_to_current" in r else ""
            details.append(f"same as current {r['same_as_current']}{diff}")
        graph = f"{r['graph_us']:.1f}" if "graph_us" in r else "–"
        lines.append(f"| {r['batch']} | {r['n_keys']:,} | {r['hidden']} | {r['variant']} | {graph} | "
                     f"{r.get('launches', '–')} | {ks} | {verdict} ({', '.join(details)}) |")
    regs = meta.get("kernel_registers") or {}
    if regs:
        lines += ["", "## Registers a thread as launched (Triton's caches: regs / spills / shared bytes)", ""]
        for name, entries in sorted(regs.items()):
            got = sorted({(e.get("regs"), e.get("spills"), e.get("shared")) for e in entries if "regs" in e},
                         key=str)
            lines.append(f"- {name}: " + ", ".join(f"{r} / {sp} / {sh}" for r, sp, sh in got))
    if sweep_rows:
        lines += ["", "## Variants over launch constants (--sweep)", "",
                  "| batch | keys | variant | constants | graph µs | check |", "|---:|---:|---|---|---:|---|"]
        for r in sorted(sweep_rows, key=lambda r: (r["variant"], r["batch"], r.get("graph_us", 0.0))):
            consts = ", ".join(f"{k} {v}" for k, v in r["constants"].items())
            graph = f"{r['graph_us']:.1f}" if "graph_us" in r else "–"
            lines.append(f"| {r['batch']} | {r['n_keys']:,} | {r['variant']} | {consts} | {graph} | "
                         f"{'ok' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def kernel_registers() -> dict:
    """``{kernel: [{regs, spills, shared, key}]}``: what each SAAP kernel compiled in this process uses as launched
    (the launch's specialisation: aligned pointers, strides that are multiples of 16), read from Triton's caches;
    empty where this Triton keeps them elsewhere or under the interpreter."""
    from kvsieve.kernels.saap import buckets as bucket_module

    found = {}
    for module in (bucket_module, index, probe):
        for name in dir(module):
            caches = getattr(getattr(module, name), "device_caches", None)
            if not isinstance(caches, dict):
                continue
            try:
                for per_device in caches.values():
                    cache = per_device[0] if isinstance(per_device, tuple) else per_device
                    for key, compiled in cache.items():
                        found.setdefault(name, []).append({
                            "regs": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
                            "shared": getattr(getattr(compiled, "metadata", None), "shared", None),
                            "key": str(key)[:400]})
            except Exception as err:  # a report, not a check: say why it is missing
                found[name] = [{"error": repr(err)[:200]}]
    return found


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for saap_probe.json and saap_probe.md")
    p.add_argument("--cases", help="BATCHxKEYS, comma-separated (default 1x131072,8x32768; with --check 1x300,3x200)")
    p.add_argument("--hidden", type=int, default=256, help="classifier width (the e2e bench fit's: 256)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--sweep", default="", help="comma-separated from " + ", ".join(SWEEPS) + ": also time a "
                   "variant over those launch constants (all: every one)")
    p.add_argument("--variants", default="all", help="comma-separated variants to time (all: every current path; "
                   "b8: the batch-8 variants of B8_VARIANTS and the current paths they replace)")
    p.add_argument("--check", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): checks only")
    args = p.parse_args(argv)
    if args.check:
        dev, timer, shape = torch.device("cpu"), None, TINY
        cases, hidden = [(1, 300), (3, 200)] if args.cases is None else parse_cases(args.cases), 48
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device (or --check under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        from kvsieve.bench.timing import ColdL2Timer

        dev, shape = torch.device("cuda"), LLAMA
        timer = ColdL2Timer(dev)
        cases = parse_cases(args.cases or "1x131072,8x32768")
        hidden = args.hidden
    presets = {"all": CURRENT_VARIANTS, "b8": ("update-ahead", "probe", "layer-ahead", *B8_VARIANTS)}
    only = list(dict.fromkeys(n for v in args.variants.split(",") if v for n in presets.get(v, (v,))))
    unknown = [v for v in only if v not in CURRENT_VARIANTS and v not in B8_VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; expected all, b8 or some of {[*CURRENT_VARIANTS, *B8_VARIANTS]}")
    rows = [r for b, n in cases for r in run_case(b, n, hidden, shape, dev, timer, args.iters, only)]
    which = list(SWEEPS) if args.sweep == "all" else [w for w in args.sweep.split(",") if w]
    unknown = [w for w in which if w not in SWEEPS]
    if unknown:
        p.error(f"--sweep: unknown {unknown}; expected some of {list(SWEEPS)} or all")
    sweep_rows = [r for w in which for b, n in cases for r in sweep(b, n, hidden, shape, dev, timer, args.iters, w)]
    meta = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "torch": torch.__version__,
            "shape": "{hq}/{hkv}/{d} heads, C = {buckets}, ℓ = {probes}, window {window}".format(**shape)}
    meta["kernel_registers"] = kernel_registers()
    text = markdown(meta, rows, sweep_rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "saap_probe.json").write_text(json.dumps({"meta": meta, "rows": rows, "sweep": sweep_rows},
                                                             indent=1))
        (args.out / "saap_probe.md").write_text(text)
    return 0 if all(r["ok"] for r in rows + sweep_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
