"""Bernoulli qKᵀ on the default model: K access, score and output error, next-token KL.

For each prompt (a stretch of the Paul Graham essays, ``--tokens`` long) the context is prefilled
exactly; then ``--steps`` next tokens of the essay are fed one at a time (teacher forcing).

- Attention metrics: q/k/v of every layer at the first decode step are captured; each config runs
  on them with ``--seeds`` seeds. Score error ``‖ŝ − s‖ / ‖s‖`` (the paper's Fig. 6 metric, on the
  raw scores of the valid keys), output error ``‖ô − o‖ / ‖o‖``, per (layer, query head).
- Next-token KL: the same steps under ``kvsieve.sparsify(phase="decode")``, KL(dense ‖ method) of
  each step's next-token distribution, per seed; K access and V density come from the session's
  records of those steps.

    python docs/results/studies/bernoulli/study.py --out docs/results/bernoulli
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import kvsieve
from kvsieve.assets import essay_texts
from kvsieve.core.inputs import check_decode_inputs
from kvsieve.core.rng import as_generator
from kvsieve.eval.metrics import next_token_agreement
from kvsieve.integrations.hf import capture_attention

DRAWS = (2, 4, 8, 16)
BUDGETS = (32, 64, 128)


def configs(draws, budgets):
    """dense; S²ANTA alone; Bernoulli alone (head, mean-group; i.i.d. at B = 4 only); mean-group with
    santa-prop at every (B, S) (Table 7 composes the mean-group query with SANTA) and with santa-sys
    at B = 4."""
    rows = [("dense", "dense")]
    rows += [(f"santa-prop:budget={s}", "santa-prop alone") for s in budgets]
    rows += [(f"santa-sys:budget={s}", "santa-sys alone") for s in budgets if s == 64]
    for b in draws:
        rows += [(f"bernoulli-qk:draws={b}", "bernoulli head"),
                 (f"bernoulli-qk:draws={b},query=mean-group", "bernoulli mean-group")]
        if b == 4:
            rows.append((f"bernoulli-qk:draws={b},sampling=iid", "bernoulli head iid"))
        for s in budgets:
            rows.append((f"bernoulli-qk:draws={b},query=mean-group,values=santa-prop,budget={s}",
                         "mean-group + santa-prop"))
            if b == 4:
                rows.append((f"bernoulli-qk:draws={b},query=mean-group,values=santa-sys,budget={s}",
                             "mean-group + santa-sys"))
    return rows


def prompts(tok, n_prompts, n_tokens, steps):
    ids = tok(" ".join(essay_texts()), return_tensors="pt").input_ids[0]
    stride = (ids.numel() - n_tokens - steps) // max(n_prompts, 1)
    return [ids[i * stride: i * stride + n_tokens + steps][None] for i in range(n_prompts)]


def attention_metrics(calls, spec, seeds):
    """Mean score error, output error, K access (head, group) and V density over layers, heads, seeds."""
    m = kvsieve.method(spec)
    dense = kvsieve.method("dense")
    acc = {"score_err": [], "out_err": [], "k_access_head": [], "k_access_group": [], "kv_density": []}
    for _layer, q, k, v in calls:
        q = q[:, :, -1].double()
        k, v = k.double(), v.double()
        exact, _ = dense.decode(q, k, v)
        s_exact = None
        for seed in seeds:
            out, stats = m.decode(q, k, v, seed=seed)
            err = (out - exact).norm(dim=-1) / exact.norm(dim=-1)
            acc["out_err"].append(err.flatten())
            acc["kv_density"].append(torch.tensor([stats.kv_density]))
            if spec.startswith("bernoulli"):
                acc["k_access_head"].append(torch.tensor([stats.k_access_head]))
                acc["k_access_group"].append(torch.tensor([stats.k_access_group]))
                inputs = check_decode_inputs(q, k, v)
                if s_exact is None:
                    s_exact = inputs.scores(torch.float64)
                s_hat, _, _ = m.estimate_scores(inputs, as_generator(seed, q.device))
                acc["score_err"].append(((s_hat - s_exact).norm(dim=-1) / s_exact.norm(dim=-1)).flatten())
    return {key: float(torch.cat(vals).mean()) if vals else None for key, vals in acc.items()}


def kl_metrics(model, cache, ids, n_ctx, dense_logits, spec, seeds):
    kls, top1, k_head, k_group, kv_density = [], [], [], [], []
    for seed in seeds:
        c = copy.deepcopy(cache)
        logits = []
        with torch.no_grad(), kvsieve.sparsify(model, spec, phase="decode", seed=seed) as session:
            for t in range(ids.shape[1] - n_ctx):
                logits.append(model(ids[:, n_ctx + t - 1: n_ctx + t], past_key_values=c).logits[0, -1])
        agree = next_token_agreement(dense_logits, torch.stack(logits))
        kls.append(agree["kl_mean"])
        top1.append(agree["top1_agree"])
        if spec.startswith("bernoulli"):
            k_head.append(session.mean("k_access_head"))
            k_group.append(session.mean("k_access_group"))
        if spec != "dense":
            kv_density.append(session.mean("kv_density"))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"kl": mean(kls), "kl_seeds": kls, "top1": mean(top1), "k_access_head_tf": mean(k_head),
            "k_access_group_tf": mean(k_group), "kv_density_tf": mean(kv_density)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--draws", type=str, default=",".join(map(str, DRAWS)))
    ap.add_argument("--budgets", type=str, default=",".join(map(str, BUDGETS)))
    ap.add_argument("--report-only", action="store_true", help="rewrite study.md/.png from study.json")
    args = ap.parse_args(argv)
    if args.report_only:
        report(args.out)
        return
    torch.manual_seed(0)
    draws = tuple(int(x) for x in args.draws.split(","))
    budgets = tuple(int(x) for x in args.budgets.split(","))
    t0 = time.time()
    model, tok = kvsieve.load_model("default")
    model.eval()
    seeds = list(range(args.seeds))
    table = configs(draws, budgets)
    sums: dict[str, dict[str, list]] = {spec: {} for spec, _ in table}
    for pi, ids in enumerate(prompts(tok, args.prompts, args.tokens, args.steps)):
        n_ctx = args.tokens
        cache = DynamicCache()
        with torch.no_grad():
            model(ids[:, : n_ctx - 1], past_key_values=cache)
            c = copy.deepcopy(cache)
            dense_logits = []
            for t in range(args.steps):
                with capture_attention(model, layers=range(100) if t == 0 else ()) as cap:
                    dense_logits.append(model(ids[:, n_ctx + t - 1: n_ctx + t], past_key_values=c).logits[0, -1])
                if t == 0:
                    calls = cap.calls
            dense_logits = torch.stack(dense_logits)
        for spec, _ in table:
            row = {}
            row.update(attention_metrics(calls, spec, seeds))
            row.update(kl_metrics(model, cache, ids, n_ctx, dense_logits, spec, seeds))
            for key, val in row.items():
                sums[spec].setdefault(key, []).append(val)
            print(f"prompt {pi} {spec}: kl {row['kl']:.4f} out_err {row['out_err']:.4f} "
                  f"k_group {row['k_access_group']} ({time.time() - t0:.0f}s)", flush=True)
        del calls
    results = []
    for spec, family in table:
        agg = {}
        for key, vals in sums[spec].items():
            if key == "kl_seeds":
                agg["kl_per_prompt_seed"] = [x for v in vals for x in v]
                continue
            vals = [v for v in vals if v is not None]
            agg[key] = sum(vals) / len(vals) if vals else None
        kls = agg["kl_per_prompt_seed"]
        agg["kl_se"] = (torch.tensor(kls).std().item() / math.sqrt(len(kls))) if len(kls) > 1 else None
        cfg = kvsieve.method(spec).config
        results.append({"spec": spec, "family": family, "draws": getattr(cfg, "draws", None),
                        "budget": getattr(cfg, "budget", None) if "santa" in spec else None, **agg})
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, float64 methods",
        "model": "default (SmolLM2-135M-Instruct: 30 layers, 9 query / 3 KV heads, d = 64)",
        "command": "python docs/results/studies/bernoulli/study.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "prompts": args.prompts, "context_tokens": args.tokens, "teacher_forced_steps": args.steps,
        "seeds": args.seeds, "seconds": round(time.time() - t0),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    report(args.out)
    print("wrote", args.out / "study.json", args.out / "study.md", args.out / "study.png")

# Paper figures for the comparison (specs/santa.md §7.7-7.9): K access %, by B.
PAPER_T5_HEAD = {2: (46.3, 88.0), 4: (67.5, 97.9), 8: (82.6, 99.8), 16: (91.1, 100.0)}  # BitNet, (head, group)
PAPER_T5_MEAN_GROUP = {2: 57.9, 4: 84.7, 8: 97.1, 16: 99.7}  # BitNet 2B
PAPER_T6_MEAN_GROUP = {4: 47.3, 8: 72.8, 16: 92.1}  # Llama 8B
PAPER_T7_V = {32: 6.2, 64: 10.8, 128: 14.3}  # BitNet, mean-group B=4 + SANTA: V group access %


def _pct(x):
    return "–" if x is None else f"{100 * x:.1f}"


def _num(x, fmt=".3f"):
    return "–" if x is None else format(x, fmt)


def _kl(r):
    if r.get("kl") is None:
        return "–"
    return f"{r['kl']:.3f} ± {r['kl_se']:.3f}" if r.get("kl_se") is not None else f"{r['kl']:.3f}"


def report(out: Path) -> None:
    data = json.loads((out / "study.json").read_text())
    meta, res = data["meta"], data["results"]
    by = {r["spec"]: r for r in res}
    draws = sorted({r["draws"] for r in res if r["draws"]})
    budgets = sorted({r["budget"] for r in res if r["budget"]})
    L = [f"# Bernoulli qKᵀ on the default model ({meta['date'][:10]})", "",
         f"- command: `{meta['command']}`",
         f"- device: {meta['device']}; model: {meta['model']}",
         f"- {meta['prompts']} essay prompts of {meta['context_tokens']} tokens, {meta['teacher_forced_steps']} "
         f"teacher-forced decode steps each, {meta['seeds']} seeds; all layers sparse (decode only); "
         f"{meta['seconds']} s",
         "- K access = fraction of the d = 64 K features read (per query head / per KV head, mean over layers, "
         "heads, prompts, seeds; first decode step). Score error = ‖ŝ − s‖/‖s‖ (Fig. 6's metric, real q/K). "
         "Output error = ‖ô − o‖/‖o‖ per (layer, head). KL = KL(dense ‖ method) of the next-token "
         "distribution, nats, mean over steps ± standard error over (prompt, seed).",
         "", "## Bernoulli alone (exact softmax over the estimated scores, all V rows)", "",
         "| B | K access head % (head query) | K access group % (head query) | K access % (mean-group) "
         "| score err head | score err mean-group | out err head | out err mean-group | KL head | KL mean-group "
         "| top-1 head / mg |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in draws:
        h, g = by.get(f"bernoulli-qk:draws={b}"), by.get(f"bernoulli-qk:draws={b},query=mean-group")
        if not (h and g):
            continue
        L.append(f"| {b} | {_pct(h['k_access_head'])} | {_pct(h['k_access_group'])} | {_pct(g['k_access_group'])} "
                 f"| {_num(h['score_err'])} | {_num(g['score_err'])} | {_num(h['out_err'])} | {_num(g['out_err'])} "
                 f"| {_kl(h)} | {_kl(g)} | {_num(h['top1'], '.2f')} / {_num(g['top1'], '.2f')} |")
    iid = by.get("bernoulli-qk:draws=4,sampling=iid")
    if iid:
        L += ["", f"i.i.d. draws at B = 4 (head query): K access head {_pct(iid['k_access_head'])} %, group "
              f"{_pct(iid['k_access_group'])} %, score error {_num(iid['score_err'])}, output error "
              f"{_num(iid['out_err'])}, KL {_kl(iid)}."]
    L += ["", "## Mean-group query with S²ANTA-prop (Table 7's composition)", "",
          "| B | S | K access % | V access % (KV head) | out err | KL | top-1 |", "|---|---|---|---|---|---|---|"]
    for b in draws:
        for s_ in budgets:
            r = by.get(f"bernoulli-qk:draws={b},query=mean-group,values=santa-prop,budget={s_}")
            if r:
                L.append(f"| {b} | {s_} | {_pct(r['k_access_group'])} | {_pct(r['kv_density'])} | {_num(r['out_err'])} "
                         f"| {_kl(r)} | {_num(r['top1'], '.2f')} |")
    L += ["", "Same at B = 4 with santa-sys, and S²ANTA alone (all K features):", "",
          "| config | K access % | V access % | out err | KL | top-1 |", "|---|---|---|---|---|---|"]
    for r in res:
        if r["family"] in ("mean-group + santa-sys", "santa-prop alone", "santa-sys alone", "dense"):
            k = r["k_access_group"] if r["k_access_group"] is not None else 1.0
            L.append(f"| `{r['spec']}` | {_pct(k)} | {_pct(r['kv_density'])} | {_num(r['out_err'])} | {_kl(r)} "
                     f"| {_num(r['top1'], '.2f')} |")
    L += ["", "## Against the paper", "",
          "| B | ours: head / group % (head query) | BitNet T5: head / group % | ours: mean-group % "
          "| BitNet T5 mean-group % | Llama-8B T6 mean-group % |", "|---|---|---|---|---|---|"]
    for b in draws:
        h, g = by.get(f"bernoulli-qk:draws={b}"), by.get(f"bernoulli-qk:draws={b},query=mean-group")
        if not (h and g):
            continue
        t5 = PAPER_T5_HEAD.get(b)
        L.append(f"| {b} | {_pct(h['k_access_head'])} / {_pct(h['k_access_group'])} | "
                 f"{'–' if not t5 else f'{t5[0]} / {t5[1]}'} | {_pct(g['k_access_group'])} | "
                 f"{PAPER_T5_MEAN_GROUP.get(b, '–')} | {PAPER_T6_MEAN_GROUP.get(b, '–')} |")
    L += ["", "Table 7 (BitNet, mean-group B = 4 + SANTA): (K, V) group access (84.7, 6.2 / 10.8 / 14.3) % at "
          "S = 32 / 64 / 128; ours above at B = 4. The paper's access figures are for its models and "
          "contexts (GSM8K on BitNet, 4k RULER on Llama-8B); V access scales as G·S/N, so it is not comparable "
          "across contexts."]
    (out / "study.md").write_text("\n".join(L) + "\n")
    plot(out, res, draws, budgets)


def plot(out: Path, res, draws, budgets) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {r["spec"]: r for r in res}
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))

    def series(fmt, key):
        pts = [(b, by[fmt.format(b=b)][key]) for b in draws if fmt.format(b=b) in by]
        return [p[0] for p in pts], [p[1] for p in pts]

    for fmt, key, label in [("bernoulli-qk:draws={b}", "k_access_head", "head query, per head"),
                            ("bernoulli-qk:draws={b}", "k_access_group", "head query, per group"),
                            ("bernoulli-qk:draws={b},query=mean-group", "k_access_group", "mean-group")]:
        x, y = series(fmt, key)
        ax[0].plot(x, [100 * v for v in y], marker="o", label=f"ours: {label}")
    ax[0].plot(list(PAPER_T5_MEAN_GROUP), list(PAPER_T5_MEAN_GROUP.values()), "k--", label="paper T5 BitNet mean-group")
    ax[0].plot(list(PAPER_T6_MEAN_GROUP), list(PAPER_T6_MEAN_GROUP.values()), "k:",
               label="paper T6 Llama-8B mean-group")
    ax[0].set_ylabel("K features read %")
    for i, key in ((1, "out_err"), (2, "kl")):
        for fmt, label in [("bernoulli-qk:draws={b}", "head"),
                           ("bernoulli-qk:draws={b},query=mean-group", "mean-group")]:
            x, y = series(fmt, key)
            ax[i].plot(x, y, marker="o", label=label)
        for s_ in budgets:
            x, y = series("bernoulli-qk:draws={b},query=mean-group,values=santa-prop,budget=" + str(s_), key)
            ax[i].plot(x, y, marker=".", ls="--", label=f"mean-group + santa-prop S={s_}")
            alone = by.get(f"santa-prop:budget={s_}")
            if alone and alone.get(key) is not None:
                ax[i].axhline(alone[key], ls=":", lw=0.8, color=ax[i].lines[-1].get_color())
        ax[i].set_yscale("log")
    ax[1].set_ylabel("attention output error ‖ô−o‖/‖o‖")
    ax[2].set_ylabel("next-token KL (nats); dotted: santa-prop alone")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("Bernoulli draws B")
        a.legend(fontsize=7)
    fig.suptitle("Bernoulli qKᵀ on SmolLM2-135M (2k context, decode)")
    fig.tight_layout()
    fig.savefig(out / "study.png", dpi=110)


if __name__ == "__main__":
    main()
