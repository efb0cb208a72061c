"""The bench's SAAP fit before and after it draws its keys from the bench's own prompts: selectivity (keys a
step reads / keys indexed) and recall of attention mass at ℓ = 32 on a held-out peaked prompt.

``before``: one 4096-token prompt of ids over the whole vocabulary, 4 k-means rounds (the old bench fit);
``after``: :data:`kvsieve.bench.saap_fit.BENCH_FIT` on prompts drawn as the bench draws them. Both validate on
one more prompt drawn as the bench draws its prompts (the fit's ``val_prompts``). That prompt is short (its index
holds a few keys per bucket), so the script also gives each fit's long-context limit: in a peaked model a token's
de-roped key and query do not depend on its position, so at N keys of a prompt over V ids each id has N/V copies
and a step's selectivity is (ids in the visited buckets) / V — measured for every id as the query.

    PYTHONPATH=src python docs/results/studies/saap/bench_fit_density.py --shape smollm2-135m --device cpu \\
        --layers 1,8,16 --out /tmp/density
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvsieve.bench.e2e import build_model
from kvsieve.bench.peaked import build_bench_model
from kvsieve.bench.saap_fit import BENCH_FIT, RandomTokens
from kvsieve.fit.saap import FitConfig, fit_saap


class TrainThenServe:
    """Ids of the fit's training prompts from ``train``, then its validation prompts from ``serve``."""

    def __init__(self, train: RandomTokens, serve: RandomTokens, train_tokens: int) -> None:
        self.train, self.serve, self.train_tokens = train, serve, train_tokens

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        head = self.train("x" * self.train_tokens)["input_ids"]
        tail = self.serve("x" * (len(text) - self.train_tokens))["input_ids"]
        return {"input_ids": head + tail}


def limit_selectivity(model, folder: Path, layers, probes: int = 32) -> dict[str, float]:
    """Per layer: mean over the prompt vocabulary's ids (as queries) of the share of the ids whose keys lie in the
    ``probes`` buckets the classifier visits (its group's summed softmaxes), and the largest bucket's share."""
    from safetensors.torch import load_file

    from kvsieve.fit.saap import classifier_logits, model_rope
    from kvsieve.integrations.hf import capture_attention
    from kvsieve.methods.saap import QueryClassifier

    p, rope = model.peaked_attention, model_rope(model)
    device = next(model.parameters()).device
    ids = torch.arange(0, p.vocab + 1, device=device)[None]  # the first token (excluded below), then every id
    with torch.no_grad(), capture_attention(model, layers=layers, only_decode=False) as cap:
        model(ids, use_cache=False)
    pos = torch.arange(ids.shape[1], device=device)
    out = {}
    for li, q, k, _v in cap.calls:
        t = load_file(str(folder / f"layer_{li:03d}.safetensors"))
        cent = t["centroids"].float()
        hkv, c, d = cent.shape
        group = q.shape[1] // hkv
        q_de = rope.invert(q[0].float(), pos)[:, 1:]  # [Hq, V, d]
        k_de = rope.invert(k[0].float(), pos)[:, 1:]  # [Hkv, V, d]
        hidden = t["classifier.w1"].shape[-1]
        net = QueryClassifier(t["classifier.w1"].shape[0], d, hidden, c)
        net.load_state_dict({n[len("classifier."):]: v for n, v in t.items() if n.startswith("classifier.")})
        net.eval()
        sel, top_share = [], []
        with torch.no_grad():
            for g in range(hkv):
                sizes = torch.bincount((k_de[g] @ cent[g].T).argmax(-1), minlength=c).float()
                xs = [torch.zeros(0, d)] * net.w1.shape[0]
                xs[g] = q_de[g * group:(g + 1) * group].reshape(-1, d)
                probs = torch.softmax(classifier_logits(net, xs)[g], -1).view(group, -1, c).sum(0)
                top = torch.topk(probs, probes, dim=-1).indices
                sel.append(sizes[top].sum(-1).mean() / sizes.sum())
                top_share.append(sizes.max() / sizes.sum())
        out[str(li)] = {f"limit_selectivity@{probes}": round(float(torch.stack(sel).mean()), 4),
                        "largest_bucket_share": round(float(torch.stack(top_share).mean()), 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", default="1,8,16", help="comma-separated layers to fit (all: 'all')")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="before,after", help="comma-separated: before, after, "
                    "after-1prompt-4iters (the bench's prompts with the old fit's size)")
    ap.add_argument("--measure-only", action="store_true", help="take the fits already in --out")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_bench_model(build_model, args.shape, "peaked", device=args.device, dtype=dtype)
    peaked, vocab = model.peaked_attention, model.get_input_embeddings().weight.shape[0]
    layers = None if args.layers == "all" else tuple(int(x) for x in args.layers.split(","))
    out = Path(args.out)
    variants = {
        "before": ({**BENCH_FIT, "kmeans_iters": 4, "prompts": 1}, RandomTokens(vocab, seed=0)),
        "after": (dict(BENCH_FIT), None),
        "after-1prompt-4iters": ({**BENCH_FIT, "kmeans_iters": 4, "prompts": 1}, None),
    }
    variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    rows = {}
    for name, (settings, train_src) in variants.items():
        cfg = FitConfig(model=f"random-weights {args.shape}", **{**settings, "val_prompts": 1}, layers=layers)
        serve = RandomTokens(vocab, seed=0, peaked=peaked, prompt_tokens=cfg.prompt_tokens)
        train_tokens = cfg.prompt_tokens * cfg.prompts
        if train_src is None:
            tok = serve  # the validation prompt is the stream's next prompt, unseen by the training
        else:
            tok = TrainThenServe(train_src, RandomTokens(vocab, seed=1, peaked=peaked,
                                                         prompt_tokens=cfg.prompt_tokens), train_tokens)
        if args.measure_only:
            rows[name] = {"limit": limit_selectivity(model, out / name, layers)}
            print(name, rows[name]["limit"])
            continue
        t0 = time.perf_counter()
        man = fit_saap(cfg, out / name, overwrite=True, log=lambda s: None, model_and_tokenizer=(model, tok),
                       texts=["x" * (train_tokens + cfg.prompt_tokens)])
        wall = time.perf_counter() - t0
        lm = man["layer_metrics"]
        mean = {k: round(sum(m[k] for m in lm.values()) / len(lm), 4)
                for k in next(iter(lm.values())) if k.startswith(("recall@", "selectivity@"))}
        rows[name] = {"settings": settings, "fit_s": round(wall, 1), "device": args.device, "layers": sorted(lm),
                      "mean": mean, "per_layer": {li: {k: m[k] for k in ("recall@32/saap", "selectivity@32/saap")}
                                                  for li, m in lm.items()},
                      "limit": limit_selectivity(model, out / name, layers)}
        print(name, rows[name]["fit_s"], "s", {k: v for k, v in mean.items() if "@32/" in k})
    out.mkdir(parents=True, exist_ok=True)
    name = f"{'limit' if args.measure_only else 'bench_fit_density'}-{'-'.join(variants)}.json"
    (out / name).write_text(json.dumps({"shape": args.shape, "peaked": peaked.to_dict(), "variants": rows}, indent=1))


if __name__ == "__main__":
    main()
