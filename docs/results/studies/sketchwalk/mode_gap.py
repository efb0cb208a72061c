"""Why does Sketch&Walk's end-to-end KL on fwe sit below setup B's? A per-prompt decomposition.

For each prompt the context is run twice inside a session: exactly (setup B's recording prefill: cache
``Ce``, decode state ``Se``) and through the sparse prefill (end to end: ``Cs``, ``Ss``). The question +
gold target then go through the method's decode as one multi-row chunk (what both eval phases do) from
each (cache, state) pair — the two modes and the two swaps:

- ``B``  = (Ce, Se): setup B;             ``E``  = (Cs, Ss): end to end;
- ``Xk`` = (Ce, Ss): exact K/V, the sparse prefill's sketches and Ã rows;
- ``Xs`` = (Cs, Se): sparse-prefill K/V, the exact prefill's sketches.

and exactly from each cache (``D``: dense, ``P``: prefill-only). Reported: the KL against dense over the
question rows and the answer rows (as the eval's ``kl_mean`` / ``kl_answer``), ``KL(P ‖ E)`` (what the
sparse question costs on the sparse cache), and per layer the decode's attention error and the head-averaged
exact attention mass that the chosen blocks hold (against the mass of the best blocks of the same budget).

Usage (CPU, ~1 min per prompt at 2k)::

    python docs/results/studies/sketchwalk/mode_gap.py --task fwe --length 2048 --samples 0,1,2 --out gap.json
"""

from __future__ import annotations

import argparse
import copy
import json
from collections import defaultdict
from typing import Any

import torch

from kvsieve.eval import tasks as task_registry
from kvsieve.eval.metrics import kl_per_position
from kvsieve.integrations.hf import sparsify
from kvsieve.integrations.models import load_model
from kvsieve.methods import sketchwalk as sw


class SelectionProbe:
    """Wraps the chunk selection: per layer, the exact head-averaged attention mass of each row's chosen
    blocks, the best mass reachable with the same blocks forced (0 and the row's own) and budget, and
    the overlap of the two block sets."""

    def __init__(self) -> None:
        self.rows: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
        self.heads: dict[int, torch.Tensor] = {}  # layer -> [R, Hq] exact mass each head keeps
        self.active = False
        self._orig = sw.SketchWalk._select_reference_rows

    def __enter__(self):
        probe = self

        def wrapped(method, inputs, sk, phi, dtype, logit_scale, previous, kmax, state):
            out = probe._orig(method, inputs, sk, phi, dtype, logit_scale, previous, kmax, state)
            if probe.active:
                probe.record(method, inputs, inputs.context.layer, out)
            return out

        sw.SketchWalk._select_reference_rows = wrapped
        return self

    def __exit__(self, *exc) -> None:
        sw.SketchWalk._select_reference_rows = self._orig

    def record(self, method, inputs, layer: int, out) -> None:
        _, blocks, counts, c = out
        bs = method.config.block_size
        dev = blocks.device
        probs = inputs.probs(torch.float64)  # [R, Hq, N]
        mass = sw.block_sums(probs.mean(1)[..., None], bs)[..., 0]  # [R, n]
        n = mass.shape[1]
        used = torch.arange(blocks.shape[1], device=dev)[None] < counts[:, None]
        chosen = torch.zeros_like(mass, dtype=torch.bool).scatter_(1, torch.where(used, blocks, 0), used)
        keys_chosen = chosen.repeat_interleave(bs, 1)[:, : probs.shape[-1]]
        self.heads[layer] = (probs * keys_chosen[:, None]).sum(-1)
        got = (mass * chosen).sum(-1)
        # The best blocks of the same budget: 0 and c forced, the heaviest counts − 2 of 1..c−1.
        cols = torch.arange(n, device=dev)[None]
        middle = (cols >= 1) & (cols < c[:, None])
        ranked = torch.where(middle, mass, -1.0).sort(-1, descending=True).indices
        best = torch.zeros_like(chosen)
        take = torch.arange(n, device=dev)[None] < (counts - 2).clamp_min(0)[:, None]
        best.scatter_(1, ranked, take)
        best[:, 0] = True
        best[torch.arange(len(c), device=dev), c] = True
        top = (mass * best).sum(-1)
        overlap = (chosen & best).sum(-1).double() / counts.double()
        for g, t, o in zip(got.tolist(), top.tolist(), overlap.tolist(), strict=True):
            self.rows[layer].append((g, t, o))

    def take(self, n_ans: int) -> dict[int, dict[str, float]]:
        """Per layer, means over every row and over the answer rows (the last ``n_ans``) alone."""
        out = {}
        for layer, vals in sorted(self.rows.items()):
            t = torch.tensor(vals, dtype=torch.float64)
            a = t[-n_ans:]
            out[layer] = {"mass": float(t[:, 0].mean()), "best_mass": float(t[:, 1].mean()),
                          "overlap": float(t[:, 2].mean()), "answer_mass": float(a[:, 0].mean()),
                          "answer_best_mass": float(a[:, 1].mean()), "answer_overlap": float(a[:, 2].mean())}
        self.rows.clear()
        return out

    def take_heads(self, n_ans: int, threshold: float = 0.5) -> dict[str, float]:
        """Over (row, sparse layer, head): the mean mass kept and the share of heads that keep less than
        ``threshold`` of their exact attention, for the question rows and the answer rows apart."""
        kept = torch.stack([self.heads[k] for k in sorted(self.heads)])  # [L, R, Hq]
        self.heads = {}
        parts = {"question": kept[:, :-n_ans], "answer": kept[:, -n_ans:]}
        out = {}
        for name, t in parts.items():
            out[f"{name}_head_mass"] = float(t.mean())
            out[f"{name}_heads_below_{threshold}"] = float((t < threshold).double().mean())
        return out


def context_pass(model, spec: str, ctx: list[int], phase: str, qs: int):
    from transformers import DynamicCache

    cache = DynamicCache()
    with sparsify(model, spec, phase=phase, question_start=qs if phase == "question" else None) as s:
        with torch.no_grad():
            model(input_ids=torch.tensor([ctx], device=model.device), past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        state = {k: copy.deepcopy(v) for k, v in s.driver.states.items()}
    return cache, state


def question_pass(model, spec: str, run: list[int], cache, state, probe: SelectionProbe | None, n_ans: int = 1):
    """The chunk through the method's decode from (cache, state), or exactly when ``state`` is None."""
    cache = copy.deepcopy(cache)
    ids = torch.tensor([run], device=model.device)
    if state is None:
        with torch.no_grad():
            return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float(), None, None
    with sparsify(model, spec, phase="all", track_error=1) as s:
        for layer, st in state.items():
            s.driver.states[layer] = copy.deepcopy(st)
        if probe is not None:
            probe.active = True
        with torch.no_grad():
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0].float()
        if probe is not None:
            probe.active = False
        errs = {r["layer"]: r["rel_error"] for r in s.records if "rel_error" in r}
    return logits, errs, probe.take(n_ans) if probe is not None else None


def mixed_cache(exact, sparse, layers, parts=("keys", "values")):
    """The exact context's cache with the sparse prefill's keys and/or values at ``layers``."""
    mixed = copy.deepcopy(exact)
    for layer in layers:
        for part in parts:
            setattr(mixed.layers[layer], part, getattr(sparse.layers[layer], part).clone())
    return mixed


def kv_swap_table(model, spec, run, n_ans, dense, ce, cs, se) -> dict[str, dict[str, float]]:
    """KL against dense of the exact and the sparse question (state ``se``) on caches that take the sparse
    prefill's K and/or V at some layers only: which part of the sparse context changes the sparse question."""
    n_layers = len(ce.layers)
    third = (n_layers - 2) // 3
    groups = {"none": ([], ("keys", "values")), "all": (range(2, n_layers), ("keys", "values")),
              "keys only": (range(2, n_layers), ("keys",)), "values only": (range(2, n_layers), ("values",))}
    for lo in range(2, n_layers, third):
        hi = min(n_layers, lo + third)
        groups[f"layers {lo}-{hi - 1}"] = (range(lo, hi), ("keys", "values"))
    table = {}
    for name, (layers, parts) in groups.items():
        cache = mixed_cache(ce, cs, layers, parts)
        row = {}
        for q_name, state in (("exact_q", None), ("sparse_q", se)):
            lg, _, _ = question_pass(model, spec, run, cache, state, None)
            kl = kl_per_position(dense, lg)
            row[f"{q_name}_kl_mean"] = float(kl.mean())
            row[f"{q_name}_kl_answer"] = float(kl[-n_ans:].mean())
        table[name] = row
        print(name, {k: round(v, 4) for k, v in row.items()}, flush=True)
    return table


def one_prompt(model, tok, spec: str, task: str, length: int, index: int, kv_swaps: bool = False) -> dict[str, Any]:
    sample = task_registry.make_sample(task, tok, length, index, 0)
    qs = sample.question_start
    ctx, question = list(sample.input_ids[:qs]), list(sample.input_ids[qs:])
    target = tok(sample.target, add_special_tokens=False)["input_ids"]
    run = (question + target)[:-1]
    n_ans = len(target)
    ce, se = context_pass(model, spec, ctx, "question", qs)
    cs, ss = context_pass(model, spec, ctx, "all", qs)
    out: dict[str, Any] = {"task": task, "length": length, "sample": index, "question_rows": len(run) - n_ans,
                           "answer_rows": n_ans}
    dense, _, _ = question_pass(model, spec, run, ce, None, None)
    pre_only, _, _ = question_pass(model, spec, run, cs, None, None)
    logits = {"P": pre_only}
    with SelectionProbe() as probe:
        for name, cache, state in (("B", ce, se), ("E", cs, ss), ("Xk", ce, ss), ("Xs", cs, se)):
            logits[name], errs, sel = question_pass(model, spec, run, cache, state, probe, n_ans)
            out[f"{name}_rel_error_by_layer"] = errs
            out[f"{name}_selection_by_layer"] = sel
            out[f"{name}_heads"] = probe.take_heads(n_ans)
    for name, lg in logits.items():
        kl = kl_per_position(dense, lg).cpu()
        out[f"{name}_kl_mean"] = float(kl.mean())
        out[f"{name}_kl_question"] = float(kl[:-n_ans].mean())
        out[f"{name}_kl_answer"] = float(kl[-n_ans:].mean())
        out[f"{name}_kl_rows"] = [round(float(x), 4) for x in kl]
    if kv_swaps:
        out["kv_swaps"] = kv_swap_table(model, spec, run, n_ans, dense, ce, cs, se)
    kl_pe = kl_per_position(pre_only, logits["E"])
    out["E_vs_P_kl_mean"] = float(kl_pe.mean())
    out["E_vs_P_kl_answer"] = float(kl_pe[-n_ans:].mean())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="fwe")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", default="0,1,2")
    ap.add_argument("--method", default="sketchwalk:variant=reconstruction,density=0.1")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-swaps", action="store_true",
                    help="also the layer-group and K-or-V swaps of the sparse prefill's cache (kv_swap_table)")
    args = ap.parse_args()
    model, tok = load_model(args.model, device=args.device)
    results = []
    for index in (int(s) for s in args.samples.split(",")):
        r = one_prompt(model, tok, args.method, args.task, args.length, index, args.kv_swaps)
        results.append(r)
        print(json.dumps({k: round(v, 4) for k, v in r.items() if isinstance(v, float)}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"method": args.method, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
