"""How many K features Bernoulli qKᵀ's mean-group draws keep: the end-to-end bench's peaked model's queries
against the offline real model's (SmolLM2-135M), on the CPU.

With stratified per-feature draws (the GPU path's), feature i of a GQA group is kept with probability
``min(1, B · m_i / (norm_factor · max_j m_j))``, ``m = mean_g |q_g|`` (``kernels/bernoulli/reference.py``):
the expected kept fraction is a function of the queries alone. For each source this prints, per draws B, the
expected kept fraction over every (layer, row, KV head) — mean and the 10/50/90 % quantiles over units — and
the fraction one draw (``mean_group_query``) kept, and writes ``bernoulli_kept.json``/``.md`` to the folder.

- ``peaked``: the decode queries of the bench's peaked model (``bench.peaked.peaked_decode_qk``, Llama-3.1-8B
  shape, the strengths fitted to the real models) — what ``bench e2e --attention peaked`` runs on;
- ``uniform``: Gaussian queries (the flat bench);
- ``smollm2``: the real model's decode queries (after RoPE, every layer), captured on an essay prompt.

    python benchmarks/breakdown/bernoulli_kept.py OUT [--tokens 1024] [--draws 2,4,8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from kvsieve.kernels.bernoulli.reference import mean_group_query  # noqa: E402


def expected_kept(q: torch.Tensor, draws: int, norm_factor: float = 1.0) -> torch.Tensor:
    """Expected kept fraction per unit for ``q [..., G, d]``: ``mean_i min(1, B m_i / (norm_factor max m))``."""
    m = q.double().abs().mean(-2)
    norm = m.amax(-1, keepdim=True) * norm_factor
    return torch.clamp(draws * m / torch.where(norm > 0, norm, 1.0), max=1.0).mean(-1)


def summarize(q: torch.Tensor, draws_list, seed: int = 0) -> dict:
    """``q [units, G, d]`` -> per B: expected kept fraction (mean, quantiles) and one draw's kept fraction."""
    out = {}
    g = torch.Generator().manual_seed(seed)
    for b in draws_list:
        e = expected_kept(q, b)
        u = torch.rand(*q.shape[:-2], b, q.shape[-1], generator=g, dtype=torch.float64)
        _, read = mean_group_query(q.double(), b, uniforms=u)
        qs = torch.quantile(e, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
        out[b] = {"expected": round(e.mean().item(), 4), "q10": round(qs[0], 4), "q50": round(qs[1], 4),
                  "q90": round(qs[2], 4), "one_draw": round(read.double().mean().item(), 4),
                  "units": int(e.numel())}
    return out


def peaked_queries(n: int, batch: int, layers: int) -> torch.Tensor:
    """[units, G, d] decode queries of the bench's peaked Llama-shape model (one draw of strengths per layer)."""
    from kvsieve.bench.peaked import ROPE_THETA, Layout, fitted, prompt_tokens, synthetic_qk

    p = fitted("llama-3.1-8b")[0]
    lay = Layout(128, ROPE_THETA["llama-3.1-8b"])
    qs = []
    for layer in range(layers):
        for b in range(batch):
            tokens = prompt_tokens(p, n, 1, torch.Generator().manual_seed(1009 * layer + b))
            q, _ = synthetic_qk(p, lay, 32, 8, tokens, 1, layer=layer, device="cpu")
            qs.append(q[0, :, 0].float().view(8, 4, 128))
    return torch.cat(qs)


def smollm2_queries(tokens: int) -> torch.Tensor:
    """[units, G, d] the real model's decode queries (every layer, the prompt's next token, then 3 more)."""
    import kvsieve
    from kvsieve.assets import essay_texts
    from kvsieve.integrations.hf import capture_attention

    model, tok = kvsieve.load_model("default")
    ids = tok(" ".join(essay_texts()), return_tensors="pt").input_ids[:, :tokens]
    qs = []
    with torch.no_grad(), capture_attention(model) as cap:
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)
    for _, q, k, _ in cap.calls:  # q [B, Hq, 1, d], k [B, Hkv, N, d]
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        qs.append(q[:, :, 0].reshape(b * hkv, hq // hkv, d).float())
    return torch.cat(qs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--draws", default="2,4,8")
    ap.add_argument("--sources", default="peaked,uniform,smollm2")
    args = ap.parse_args(argv)
    draws = [int(x) for x in args.draws.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for src in args.sources.split(","):
        if src == "peaked":
            q = peaked_queries(args.tokens, 2, 4)
        elif src == "uniform":
            q = torch.randn(256, 4, 128, generator=torch.Generator().manual_seed(0))
        elif src == "smollm2":
            q = smollm2_queries(args.tokens)
        else:
            raise ValueError(f"--sources: expected peaked, uniform or smollm2, got {src!r}")
        report[src] = {"group": q.shape[-2], "d": q.shape[-1], "draws": summarize(q, draws)}
        print(src, json.dumps(report[src]), flush=True)
    (out / "bernoulli_kept.json").write_text(json.dumps(report, indent=1))
    lines = ["# Features kept by Bernoulli qKᵀ's mean-group draws (stratified, per-feature strata, norm_factor 1)", "",
             "Expected kept fraction per (layer, row, KV head) unit: mean and 10/50/90 % quantiles; one draw's "
             f"kept fraction beside it. Command: `python benchmarks/breakdown/bernoulli_kept.py OUT --tokens "
             f"{args.tokens} --draws {args.draws}`.", "",
             "| source | G × d | B | expected | q10 | q50 | q90 | one draw | units |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for src, r in report.items():
        for b, s in r["draws"].items():
            lines.append(f"| {src} | {r['group']} × {r['d']} | {b} | {s['expected']} | {s['q10']} | {s['q50']} | "
                         f"{s['q90']} | {s['one_draw']} | {s['units']} |")
    (out / "bernoulli_kept.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
