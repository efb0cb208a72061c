"""Does vAttention's (ε, δ) guarantee hold on real attention? And how do the baselines compare?

Real q/k/v of decode steps are captured from the default model (SmolLM2-135M-Instruct) after
contexts of Paul Graham essays (2k-8k tokens), at several layers, all 9 query heads. On each
captured call:

- guarantee: ``vattention`` with ``bound=denominator`` and ``bound=full`` at several (ε, δ), several
  seeds per call; a *trial* is one (call, query head, seed); it fails when ‖ô − o‖/‖o‖ > ε. The
  theorem says the failure probability of each head-step is ≤ δ, hence the mean over trials too;
  we compare the failure rate with δ + 3 binomial standard errors. A diagnostic variant uses the
  *true* residual statistics instead of the base-sample plug-ins (``truestats``), separating the
  plug-in error from the CLT error.
- fidelity: every method at a grid of budgets; mean relative error vs achieved density.

    python docs/results/studies/vattention-guarantee/verify_vattention_guarantee.py \
        --out docs/results/vattention-guarantee

Keep it small on a shared CPU: ``--lengths 2048 4096 8192 --layers 2 8 14 20 26 29 --steps 8``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

import kvsieve
from kvsieve.assets import essay_texts
from kvsieve.integrations.hf import capture_attention
from kvsieve.methods.shared.selection import available_after, compact
from kvsieve.methods.vattention import VAttention


class TrueStatsVAttention(VAttention):
    """vAttention whose budget uses the whole residual as its 'base sample' (exact statistics).

    A diagnostic only (it reads everything): failures left are the CLT's, not the plug-in's.
    """

    name = "vattention-truestats-diagnostic"  # never registered

    def budget(self, inputs, fixed, base, n_s, n_base):
        residual = available_after(inputs, fixed)
        n = inputs.n_keys
        idx = torch.arange(n, device=residual.device).expand(*residual.shape)
        everything = compact(idx, residual, None)
        return super().budget(inputs, fixed, everything, everything.counts, everything.counts)


def essay_prompt(tok, n_tokens: int, offset: int) -> torch.Tensor:
    text = "\n\n".join(essay_texts()[offset:] + essay_texts()[:offset])
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"the essays hold only {ids.shape[1]} tokens")
    return ids


def decode_calls(model, tok, n_tokens, layers, steps, offset):
    """Yield the captured calls of each decode step after an essay context of ``n_tokens``."""
    ids = essay_prompt(tok, n_tokens - steps, offset)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(ids, past_key_values=cache)
        nxt = out.logits[:, -1:].argmax(-1)
        for step in range(steps):
            with capture_attention(model, layers=layers) as cap:
                out = model(nxt, past_key_values=cache)
            nxt = out.logits[:, -1:].argmax(-1)
            yield step, [(layer, q[:, :, 0], k, v) for layer, q, k, v in cap.calls]


def guarantee_configs(args):
    flags = f",{args.flags}" if args.flags else ""
    common = f"top_k={args.top_k},base_rate={args.base_rate}{flags}"
    configs = []
    for bound in ("denominator", "full"):
        for eps, delta in args.eps_delta:
            configs.append(dict(kind="plugin", bound=bound, epsilon=eps, delta=delta,
                                spec=f"vattention:bound={bound},epsilon={eps},delta={delta},{common}"))
    if not args.diagnostics:
        return configs
    eps, delta = args.eps_delta[len(args.eps_delta) // 2]
    for bound in ("denominator", "full"):
        configs.append(dict(kind="truestats", bound=bound, epsilon=eps, delta=delta,
                            spec=f"bound={bound},epsilon={eps},delta={delta},{common}"))
    configs.append(dict(kind="hoeffding", bound="denominator", epsilon=eps, delta=delta,
                        spec=f"vattention:bound=denominator,concentration=hoeffding,epsilon={eps},delta={delta},{common}"))
    return configs


def build(config):
    if config["kind"] == "truestats":
        values = dict(item.split("=") for item in config["spec"].split(","))
        return TrueStatsVAttention(VAttention.config_class.from_strings("vattention", values))
    return kvsieve.method(config["spec"])


def fidelity_specs(sw: str):
    specs = [f"streaming:{sw.replace('window=32', f'window={w}')}" for w in (96, 224, 480, 992)]
    specs += [f"oracle-topk:{sw},top_k={f}" for f in (0.02, 0.05, 0.1, 0.2)]
    specs += [f"oracle-topp:{sw},top_p={p}" for p in (0.5, 0.7, 0.8, 0.9, 0.95)]
    specs += [f"random:{sw},budget={f}" for f in (0.02, 0.05, 0.1, 0.2)]
    specs += [f"quest:{sw},top_k={f}" for f in (0.02, 0.05, 0.1, 0.2)]
    specs += [f"magicpig:{sw},bits={k},tables={n}" for k, n in ((10, 16), (8, 16), (8, 48), (6, 32))]
    specs += [f"vattention:{sw},bound=denominator,top_k={t},base_rate={t},epsilon={e},delta={e}"
              for t, e in ((0.01, 0.3), (0.02, 0.2), (0.03, 0.1), (0.05, 0.05))]
    specs += [f"vattention:{sw},bound=denominator,top_k={t},base_rate=0.02,epsilon={e},delta={e}"
              for t, e in ((0.08, 0.1), (0.15, 0.1), (0.15, 0.05))]
    specs += [f"vattention:{sw},bound=full,top_k={t},base_rate=0.02,epsilon={e},delta={e}"
              for t, e in ((0.05, 0.3), (0.1, 0.3))]
    specs += [f"vattention:{sw},bound=denominator,predictor=quest,top_k={t},base_rate={t},epsilon={e},delta={e}"
              for t, e in ((0.01, 0.3), (0.02, 0.2), (0.03, 0.1), (0.05, 0.05))]
    specs += [f"vattention:{sw},bound=denominator,predictor=quest,top_k={t},base_rate=0.02,epsilon=0.1,delta=0.1"
              for t in (0.08, 0.15)]
    return specs


def rel_error(est, ref):
    return (est.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)


def run(args):
    torch.set_num_threads(args.threads)
    model, tok = kvsieve.load_model("default")
    dense = kvsieve.method("dense")
    configs = guarantee_configs(args) if args.part in ("both", "guarantee") else []
    methods = [build(c) for c in configs]
    fid_specs = fidelity_specs(args.fidelity_sink_window) if args.part in ("both", "fidelity") else []
    fid_methods = [kvsieve.method(s) for s in fid_specs]
    trials = []  # guarantee: one row per (config, length, layer, step) with per-head/seed arrays
    fidelity = []
    t0 = time.time()
    total = len(args.lengths) * args.steps
    bar = tqdm(total=total, desc="decode steps")
    for li, n_tokens in enumerate(args.lengths):
        for step, calls in decode_calls(model, tok, n_tokens, args.layers, args.steps, offset=li * 7):
            for layer, q, k, v in calls:
                ref, _ = dense.decode(q, k, v)
                for ci, m in enumerate(methods):
                    errs, budgets, dens, kvd = [], [], [], []
                    for seed in range(args.seeds):
                        est, st = m.decode(q, k, v, seed=kvsieve.core.rng.derive_seed(seed, layer, step, li, ci))
                        errs.append(rel_error(est, ref)[0])
                        budgets.append(st.budget_per_head.double().reshape(-1))
                        dens.append(st.density)
                        kvd.append(st.kv_density)
                    trials.append(dict(config=ci, length=n_tokens, layer=layer, step=step,
                                       errors=torch.stack(errs).tolist(), budgets=torch.stack(budgets).tolist(),
                                       density=sum(dens) / len(dens), kv_density=sum(kvd) / len(kvd)))
                for si, (spec, m) in enumerate(zip(fid_specs, fid_methods, strict=True)):
                    est, st = m.decode(q, k, v, seed=kvsieve.core.rng.derive_seed(7, layer, step, li, si))
                    fidelity.append(dict(spec=spec, length=n_tokens, layer=layer, step=step,
                                         errors=rel_error(est, ref)[0].tolist(), density=st.density,
                                         kv_density=st.kv_density))
            bar.update()
    bar.close()
    return dict(configs=configs, trials=trials, fidelity_specs=fid_specs, fidelity=fidelity,
                seconds=time.time() - t0, args=vars(args) | {"argv": sys.argv[1:]})


def binomial_limit(delta, n):
    return delta + 3 * math.sqrt(delta * (1 - delta) / max(n, 1))


def summarize_guarantee(data):
    rows = []
    for ci, cfg in enumerate(data["configs"]):
        ts = [t for t in data["trials"] if t["config"] == ci]
        if not ts:
            continue
        err = torch.tensor([t["errors"] for t in ts], dtype=torch.float64)  # [calls, seeds, Hq]
        fail = err > cfg["epsilon"]
        n = fail.numel()
        by_len = {}
        for length in sorted({t["length"] for t in ts}):
            sel = torch.tensor([t["length"] == length for t in ts])
            by_len[length] = float(fail[sel].double().mean())
        by_layer = {}
        for layer in sorted({t["layer"] for t in ts}):
            sel = torch.tensor([t["layer"] == layer for t in ts])
            by_layer[layer] = float(fail[sel].double().mean())
        # Per head-step failure frequency over seeds: how many head-steps fail more often than δ allows.
        per_head_step = fail.double().mean(1)  # [calls, Hq]
        seeds = err.shape[1]
        bad_heads = float((per_head_step > binomial_limit(cfg["delta"], seeds)).double().mean())
        budgets = torch.tensor([t["budgets"] for t in ts], dtype=torch.float64)
        rows.append(dict(
            kind=cfg["kind"], bound=cfg["bound"], epsilon=cfg["epsilon"], delta=cfg["delta"], trials=n,
            failure_rate=float(fail.double().mean()), limit=binomial_limit(cfg["delta"], n),
            holds=bool(fail.double().mean() <= binomial_limit(cfg["delta"], n)),
            mean_error=float(err.mean()), p95_error=float(err.flatten().quantile(0.95)),
            density=sum(t["density"] for t in ts) / len(ts), kv_density=sum(t["kv_density"] for t in ts) / len(ts),
            mean_budget=float(budgets.mean()), by_length=by_len, by_layer=by_layer,
            head_steps_over_delta=bad_heads,
        ))
    return rows


def summarize_fidelity(data):
    rows = []
    for spec in data["fidelity_specs"]:
        fs = [f for f in data["fidelity"] if f["spec"] == spec]
        err = torch.tensor([f["errors"] for f in fs], dtype=torch.float64)
        method = spec.split(":")[0] + ("(quest)" if "predictor=quest" in spec else "")
        method += ",full" if "bound=full" in spec else ""
        rows.append(dict(spec=spec, method=method,
                         mean_error=float(err.mean()), median_error=float(err.median()),
                         p90_error=float(err.flatten().quantile(0.9)),
                         density=sum(f["density"] for f in fs) / len(fs),
                         kv_density=sum(f["kv_density"] for f in fs) / len(fs), n=int(err.numel())))
    return rows


def plot(guarantee, fidelity, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if guarantee:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        ax = axes[0]
        for bound, marker in (("denominator", "o"), ("full", "s")):
            rs = [r for r in guarantee if r["bound"] == bound and r["kind"] == "plugin"]
            ax.scatter([r["delta"] for r in rs], [r["failure_rate"] for r in rs], marker=marker,
                       label=f"bound={bound}")
            for r in rs:
                ax.annotate(f"ε={r['epsilon']}", (r["delta"], r["failure_rate"]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
        lim = max(r["delta"] for r in guarantee) * 1.2
        ax.plot([0, lim], [0, lim], "k--", lw=1, label="failure rate = δ")
        ax.set_xlabel("δ (promised failure probability)")
        ax.set_ylabel("observed Pr(‖ô−o‖ > ε‖o‖)")
        ax.set_title("vAttention guarantee on real attention")
        ax.set_yscale("symlog", linthresh=0.01)
        ax.legend(fontsize=8)
        ax = axes[1]
        for bound, marker in (("denominator", "o"), ("full", "s")):
            rs = [r for r in guarantee if r["bound"] == bound and r["kind"] == "plugin"]
            ax.scatter([r["epsilon"] for r in rs], [r["mean_error"] for r in rs], marker=marker,
                       label=f"mean error, bound={bound}")
            ax.scatter([r["epsilon"] for r in rs], [r["density"] for r in rs], marker=marker, facecolors="none",
                       edgecolors="C2" if bound == "full" else "C3", label=f"density, bound={bound}")
        ax.plot([0, 0.25], [0, 0.25], "k:", lw=1)
        ax.set_xlabel("ε")
        ax.set_title("mean relative error and density vs ε")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        plt.close(fig)
    if fidelity:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for i, method in enumerate(dict.fromkeys(r["method"] for r in fidelity)):
            rs = sorted([r for r in fidelity if r["method"] == method], key=lambda r: r["density"])
            ax.scatter([r["density"] for r in rs], [r["mean_error"] for r in rs], s=14, color=f"C{i}")
            front, best = [], float("inf")  # Pareto front: each point better than every sparser one
            for r in rs:
                if r["mean_error"] < best:
                    front.append(r)
                    best = r["mean_error"]
            ax.plot([r["density"] for r in front], [r["mean_error"] for r in front], label=method, color=f"C{i}")
        for x in (0.05, 0.1, 0.2):
            ax.axvline(x, color="grey", lw=0.5, ls=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density (V rows read / N, per query head)")
        ax.set_ylabel("mean ‖ô−o‖/‖o‖")
        ax.set_title("attention error vs density, real attention (lines: Pareto fronts)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out.parent / (out.name.replace("guarantee", "fidelity") + ".png"), dpi=120)
        plt.close(fig)


def tables(guarantee, fidelity, args_text: str) -> str:
    """Markdown tables of both summaries (the analysis around them is written by hand)."""
    script = "docs/results/studies/vattention-guarantee/verify_vattention_guarantee.py"
    lines = [f"Command: `python {script} {args_text}`", ""]
    if guarantee:
        layers = sorted({int(k) for r in guarantee for k in r["by_layer"]})
        lengths = sorted({int(k) for r in guarantee for k in r["by_length"]})
        lines += ["| variant | bound | ε | δ | trials | failure rate | δ + 3 s.e. | holds | mean err | p95 err | "
                  "density | kv density | mean b | head-steps over δ | "
                  + " | ".join(f"fail @{n}" for n in lengths) + " | "
                  + " | ".join(f"fail L{layer}" for layer in layers) + " |",
                  "|" + "---|" * (14 + len(lengths) + len(layers))]
        for r in guarantee:
            lines.append(
                f"| {r['kind']} | {r['bound']} | {r['epsilon']} | {r['delta']} | {r['trials']} | "
                f"{r['failure_rate']:.3f} | {r['limit']:.3f} | {'yes' if r['holds'] else '**no**'} | "
                f"{r['mean_error']:.4f} | {r['p95_error']:.4f} | {r['density']:.3f} | {r['kv_density']:.3f} | "
                f"{r['mean_budget']:.0f} | {r['head_steps_over_delta']:.3f} | "
                + " | ".join(f"{r['by_length'][str(n)] if str(n) in r['by_length'] else r['by_length'][n]:.3f}"
                             for n in lengths) + " | "
                + " | ".join(f"{r['by_layer'][str(la)] if str(la) in r['by_layer'] else r['by_layer'][la]:.3f}"
                             for la in layers) + " |")
        lines.append("")
    if fidelity:
        lines += ["| method | spec | mean err | median | p90 | density | kv density | head-steps |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sorted(fidelity, key=lambda r: (r["method"], r["density"])):
            lines.append(f"| {r['method']} | `{r['spec'].split(':', 1)[1]}` | {r['mean_error']:.4f} | "
                         f"{r['median_error']:.4f} | {r['p90_error']:.4f} | {r['density']:.3f} | "
                         f"{r['kv_density']:.3f} | {r['n']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/results/vattention-guarantee")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 14, 20, 26, 29])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--top-k", type=float, default=0.025)
    p.add_argument("--base-rate", type=float, default=0.025)
    p.add_argument("--eps-delta", type=lambda s: tuple(float(x) for x in s.split("/")), nargs="+",
                   default=[(0.05, 0.05), (0.1, 0.1), (0.2, 0.2), (0.1, 0.2), (0.2, 0.05)])
    p.add_argument("--flags", default="", help="extra vattention parameters for every guarantee setting, e.g. "
                   "quantile=one-sided,replacement=true,residual=includes-topk,budget_floor=base (the hub's code)")
    p.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                   help="skip the true-statistics and Hoeffding variants")
    p.add_argument("--fidelity-sink-window", default="sink=32,window=32")
    p.add_argument("--part", choices=("both", "guarantee", "fidelity"), default="both")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--from-json", action="store_true", help="only redo tables and plots from <out>.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        saved = json.loads(out.with_suffix(".json").read_text())
        plot(saved["guarantee"], saved["fidelity"], out)
        text = tables(saved["guarantee"], saved["fidelity"], " ".join(saved["args"]["argv"]))
        out.with_name(out.name + "-tables.md").write_text(text)
        print(text)
        return 0
    data = run(args)
    guarantee = summarize_guarantee(data)
    fidelity = summarize_fidelity(data)
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(dict(guarantee=guarantee, fidelity=fidelity, configs=data["configs"],
                                         seconds=data["seconds"], args=data["args"]), indent=1))
    plot(guarantee, fidelity, out)
    text = tables(guarantee, fidelity, " ".join(sys.argv[1:]))
    out.with_name(out.name + "-tables.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
