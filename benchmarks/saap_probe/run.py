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
``--sweep parallel,rank,ahead,hidden`` (or ``all``) also times a variant over launch constants (:data:`SWEEPS`):
``step-parallel`` over the parallel update's blocks, ``probe`` over the rank launch's chunk (``probe.RANK_CHUNK``:
fewer programs recomputing the group softmax at batch 8) and over the hidden layer's tile, ``layer-ahead`` over the
ahead update's centroid block. ``--rank-forms chunks,scores`` times every variant that runs the probe under each
form of the rank (``probe.RANK_FORM``: the group scores recomputed by every rank program, or computed once per (row,
KV head) in a launch of their own), each checked against the references and equal (scores, buckets, a layer's
output) to the default form's in the same run (``FORM+split``: with ``probe.RANK_SPLIT``, the scores form's
comparison with the tie rule's index test on a pass's own buckets only).

    python benchmarks/saap_probe/run.py --out OUT [--cases 1x131072,8x32768] [--hidden 256] [--iters 40]
        [--variants all|NAME,...] [--rank-forms chunks,scores] [--sweep all]
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
from unittest import mock

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


def layer_step(case: dict, assign: torch.Tensor, ahead: bool = False):
    """The method's step on the Triton path: the probe (with the update of the batch's rule) then the bucket
    attention; with ``ahead`` the probe alone, and the update one step ahead in the attention's launch
    (``index_update=ahead``). Returns ``(out, top)``."""
    b, hkv, n = case["k"].shape[:3]
    _, top = probe_scores_triton(case["q"], case["lengths"], case["inv_freq"], 1.0, *case["w"], kv_heads=hkv,
                                 probes=case["shape"]["probes"], position_offset=-1,
                                 tail=None if ahead else tail_of(case, assign))
    out, _, _ = bucket_sparse_decode_triton(
        case["q"], case["k"], case["v"], case["sink_ids"], case["sink_counts"], case["offsets"], case["ids"], top, 0,
        sliding=(case["lengths"], case["window"], case["t_lo"], assign), fused_merge=fused_merge_default(b * hkv, n),
        ahead=(case["centroids"], case["inv_freq"], 1.0, SPAN) if ahead else None)
    return out, top


def variants(case: dict) -> dict:
    """``{name: (call, assign or None, kind)}``: each call, the index it updates (its own copy) and what it
    returns (``update``: nothing; ``probe``: ``(scores, top)``; ``layer``: ``(out, top)``)."""
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
    return out


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


def rank_form(spec: str):
    """``probe.RANK_FORM`` (and ``probe.RANK_SPLIT``) as ``spec`` says inside: ``FORM`` or ``FORM+split`` (the
    variants' calls take the module's defaults)."""
    form, _, split = spec.partition("+")
    return mock.patch.multiple(probe, RANK_FORM=form, RANK_SPLIT=split == "split")


def rank_form_spec(spec: str) -> bool:
    """Whether ``spec`` is ``FORM`` or ``FORM+split`` with ``FORM`` in ``probe.RANK_FORMS``."""
    form, plus, split = spec.partition("+")
    return form in probe.RANK_FORMS and (not plus or split == "split")


def same_outputs(result, baseline) -> bool:
    """Whether a probe's ``(scores, top)`` or a layer's ``(out, top)`` equal another form's: the buckets to the bit,
    the scores or output to float32 rounding (relative 1e-6): each form compiles its own sum of the group's
    softmaxes, and on the GPU the two orders of the same operations differ in the last bits."""
    (first, top), (first_b, top_b) = result, baseline
    return torch.equal(top, top_b) and torch.allclose(first.float(), first_b.float(), rtol=1e-6, atol=1e-9)


def run_case(batch: int, n_keys: int, hidden: int, shape: dict, dev: torch.device, timer, iters: int,
             only: list[str] | None = None, forms: list[str] | None = None) -> list[dict]:
    """The variants (those in ``only``, default all) timed and checked; those that run the probe under each rank form
    in ``forms`` (default: ``probe.RANK_FORM`` alone), each also against the default form's outputs."""
    from kvsieve.bench.timing import count_launches

    case = make_case(batch, n_keys, hidden, shape, dev)
    ref = references(case)
    default = probe.RANK_FORM + ("+split" if probe.RANK_SPLIT else "")
    forms = forms or [default]
    rows = []
    with torch.inference_mode():
        for name, (call, assign, kind) in variants(case).items():
            if only is not None and name not in only:
                continue
            baseline = None
            if kind != "update" and forms != [default]:
                baseline = [t.clone() for t in call()]
            for form in forms if kind != "update" else [None]:
                with rank_form(form or default):
                    result = call()
                    row = {"batch": batch, "n_keys": n_keys, "hidden": hidden, "variant": name, "rank_form": form}
                    if form is not None and form.startswith("auto"):
                        row["rank_form"] = f"{form}: {probe.rank_form_for(batch * case['shape']['hkv'], 'auto')}"
                    if timer is not None:
                        row["graph_us"] = timer.time_graph_us(call, iters=iters)["median_us"]
                        row["kernels_us"] = timer.kernel_breakdown(call)
                        row["launches"] = count_launches(call)
                row.update(check(result, assign, kind, ref, case, ahead="ahead" in name))
                if baseline is not None:
                    row["equal_to_default_form"] = same_outputs(result, baseline)
                    row["ok"] = row["ok"] and row["equal_to_default_form"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


#: ``--sweep``: (module, constants and their values, variant timed) — the parallel update's launch constants, the
#: rank launch's chunk (programs per row and KV head: C / RANK_CHUNK), the ahead update's centroid block, the hidden
#: layer's tile.
SWEEPS = {
    "parallel": (index, {"PARALLEL_BLOCK_C": (32, 64, 128), "PARALLEL_BLOCK_R": (16, 32, 64)}, "step-parallel"),
    "rank": (probe, {"RANK_CHUNK": (32, 64, 128, 256)}, "probe"),
    "rank-scores": (probe, {"RANK_FORM": ("scores",), "RANK_SPLIT": (False, True), "RANK_CHUNK": (16, 32, 64, 128)},
                    "probe"),
    "ahead": (index, {"AHEAD_BLOCK_C": (32, 64, 128)}, "layer-ahead"),
    "hidden": (probe, {"HIDDEN_TILE_H": (16, 32, 64), "HIDDEN_TILE_R": (16, 32)}, "probe"),
}


def sweep(batch: int, n_keys: int, hidden: int, shape: dict, dev: torch.device, timer, iters: int,
          which: str) -> list[dict]:
    """A variant over every combination of a module's launch constants (:data:`SWEEPS`), each checked (and timed
    with a ``timer``)."""
    module, grid, variant = SWEEPS[which]
    case = make_case(batch, n_keys, hidden, shape, dev)
    ref = references(case)
    rows = []
    for values in itertools.product(*grid.values()):
        setting = dict(zip(grid, values, strict=True))
        with mock.patch.multiple(module, **setting):
            call, assign, kind = variants(case)[variant]
            with torch.inference_mode():
                result = call()
                row = {"batch": batch, "n_keys": n_keys, "hidden": hidden, "variant": variant, "constants": setting}
                if timer is not None:
                    row["graph_us"] = timer.time_graph_us(call, iters=iters)["median_us"]
                row.update(check(result, assign, kind, ref, case, ahead="ahead" in variant))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(meta: dict, rows: list[dict], sweep_rows: list[dict]) -> str:
    lines = [f"# SAAP probe + index update, one layer ({meta['device']})", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}; torch {meta['torch']}",
             f"- {meta['shape']}, bf16 queries and keys, bf16 serve weights; graph replay on a cold L2, median µs; "
             "kernels: profiler device µs per kernel name", "",
             "| batch | keys | hidden | variant | rank form | graph µs | launches | kernels (µs) | check |",
             "|---:|---:|---:|---|---|---:|---:|---|---|"]
    for r in rows:
        ks = ", ".join(f"{k.split('(')[0][:28]} {v:.1f}" for k, v in sorted((r.get("kernels_us") or {}).items()))
        verdict = "ok" if r["ok"] else "FAIL"
        details = [f"err {r['scores_max_abs_err']:.1e}", f"top/own {r['top_equal_own_scores']}"] \
            if "scores_max_abs_err" in r else []
        if "out_max_abs_err" in r:
            details.append(f"out err {r['out_max_abs_err']:.1e}")
        if "top_set_agreement" in r:
            details.append(f"top/ref {r['top_set_agreement']:.3f}")
        if "assign_equal" in r:
            details.append(f"assign {r['assign_equal']}")
        if "equal_to_default_form" in r:
            details.append(f"= default form {r['equal_to_default_form']}")
        graph = f"{r['graph_us']:.1f}" if "graph_us" in r else "–"
        lines.append(f"| {r['batch']} | {r['n_keys']:,} | {r['hidden']} | {r['variant']} | "
                     f"{r.get('rank_form') or '–'} | {graph} | "
                     f"{r.get('launches', '–')} | {ks} | {verdict} ({', '.join(details)}) |")
    if sweep_rows:
        lines += ["", "## Variants over launch constants (--sweep)", "",
                  "| batch | keys | variant | constants | graph µs | check |", "|---:|---:|---|---|---:|---|"]
        for r in sorted(sweep_rows, key=lambda r: (r["variant"], r["batch"], r.get("graph_us", 0.0))):
            consts = ", ".join(f"{k} {v}" for k, v in r["constants"].items())
            graph = f"{r['graph_us']:.1f}" if "graph_us" in r else "–"
            lines.append(f"| {r['batch']} | {r['n_keys']:,} | {r['variant']} | {consts} | {graph} | "
                         f"{'ok' if r['ok'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for saap_probe.json and saap_probe.md")
    p.add_argument("--cases", default="1x131072,8x32768", help="BATCHxKEYS, comma-separated")
    p.add_argument("--hidden", type=int, default=256, help="classifier width (the e2e bench fit's: 256)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--sweep", default="", help="comma-separated from " + ", ".join(SWEEPS) + ": also time a "
                   "variant over those launch constants (all: every one)")
    p.add_argument("--variants", default="all", help="comma-separated default variants to time (all: every one)")
    p.add_argument("--rank-forms", default="", help="comma-separated from " + ", ".join(probe.RANK_FORMS) + " (each "
                   "may end in +split: probe.RANK_SPLIT): time the variants that run the probe under each (default: "
                   "probe.RANK_FORM alone), each checked equal to the default form's outputs")
    p.add_argument("--check", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1): checks only")
    args = p.parse_args(argv)
    if args.check:
        dev, timer, shape = torch.device("cpu"), None, TINY
        cases, hidden = [(1, 300), (3, 200)], 48
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device (or --check under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        from kvsieve.bench.timing import ColdL2Timer

        dev, shape = torch.device("cuda"), LLAMA
        timer = ColdL2Timer(dev)
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
        hidden = args.hidden
    only = None if args.variants == "all" else [v for v in args.variants.split(",") if v]
    forms = [f for f in args.rank_forms.split(",") if f]
    if not all(rank_form_spec(f) for f in forms):
        p.error(f"--rank-forms: expected some of {list(probe.RANK_FORMS)}, each maybe with +split, got {forms}")
    rows = [r for b, n in cases for r in run_case(b, n, hidden, shape, dev, timer, args.iters, only, forms)]
    which = list(SWEEPS) if args.sweep == "all" else [w for w in args.sweep.split(",") if w]
    unknown = [w for w in which if w not in SWEEPS]
    if unknown:
        p.error(f"--sweep: unknown {unknown}; expected some of {list(SWEEPS)} or all")
    sweep_rows = [r for w in which for b, n in cases for r in sweep(b, n, hidden, shape, dev, timer, args.iters, w)]
    meta = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "torch": torch.__version__,
            "shape": "{hq}/{hkv}/{d} heads, C = {buckets}, ℓ = {probes}, window {window}".format(**shape)}
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
