"""Peaked attention for the speed benchmarks: random-weight models (``bench e2e``) and decode inputs
(``bench decode``) whose attention has sink tokens, a local window and a few strong matches per head, at
the rates measured on the offline real models (``attention_shape``, ``attention_calibration.json``).

Random weights give flat attention, and methods whose density adapts to the attention (vAttention,
top-p, MagicPIG) then keep nearly every key: ``--attention uniform`` stays as that flat worst case.

The construction (no training; a few matrix fills on the device). A head's attention logit of key j
for a query at distance Δ = i − j is, with per-head strengths drawn around ``PeakedAttention``'s:

    sink_logit · [j is the first token] + local_logit · κ_w(Δ) + match_logit · [same token] · ρ(Δ) + noise

- the sink lives in the lowest-frequency RoPE pair, where rotation barely moves over the context, and
  only the first token's key has it; every query has it;
- the window: every key and query share one vector on the high-frequency pairs; each head's query keeps
  the pairs of frequency ≥ 1/window, so the score decays from Δ = 0 to about Δ = window
  (κ_w(Δ) ≈ 1 − ln Δ / ln window);
- strong matches: keys carry a random code of their token on the lower-frequency pairs, and queries the
  same code of their own token turned by a quarter turn in each pair (k_proj tied to q_proj per KV group),
  so a query matches the earlier copies of its token by Σ sin(θ Δ) — nothing on its own key, which would
  otherwise take all the mass — (prompts draw tokens from ``vocab`` ids: about N / vocab copies per
  query); other tokens' codes give the noise.

In a model (``peak_model``): the hidden state is the token's embedding in every layer (the attention and
MLP outputs are scaled by ``RESIDUAL_SCALE``), so each layer's q_proj/k_proj map it to the vectors above;
dimension 0 of the hidden state is the part every token shares, dimension 1 the first token's (id 0),
the rest the token's random direction. ``synthetic_qk`` builds the same vectors directly for the kernel
bench. ``fit`` chooses the strengths so that the profile (``attention_profile``) matches a real model's.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from .attention_shape import (
    CALIBRATION_FILE,
    STATS,
    attention_profile,
    load_calibration,
    summarize,
    write_calibration,
)

ATTENTION_MODES = ("peaked", "uniform")
ATTENTION_LABELS = {
    "peaked": "peaked: the random weights rebuilt so attention has sink tokens, a local window and strong matches at "
              "the strengths fitted to the offline real models' profile (bench/peaked.py); prompt rows are token 0 "
              "then ids drawn from the fit's prompt vocabulary",
    "uniform": "uniform: random weights and random prompt ids, flat attention (the flat worst case: adaptive "
               "methods keep nearly every key)"}
FIT_STATS = ("entropy", "top1", "top5", "sink", "window64", "window256")
DEFAULT_TARGET = "smollm2-135m@8192"
# RoPE bases of the real models the bench shapes stand for (the random-weight configs leave the default)
ROPE_THETA = {"llama-3.1-8b": 500000.0, "llama-3.1-70b": 500000.0, "qwen2.5-7b": 1000000.0,
              "smollm2-135m": 100000.0}
RESIDUAL_SCALE = 1e-3
SHARED = 0.5  # the shared part's share of a token's hidden-state norm
SINK_KEY = 4.0  # the first token's key in the sink pair (queries scale to the logit)
BOS = 0  # the synthetic model's first token


@dataclass(frozen=True)
class PeakedAttention:
    """Mean strengths (in logits, after the 1/sqrt(head_dim) scale) across heads; each head's are these
    plus spread · z (at least 0), z over a layer's heads the standard normal's quantiles in a random order
    per strength; its window is ``window`` times exp(spread · z / 4)."""

    sink_logit: float = 6.0
    local_logit: float = 6.0
    window: float = 64.0
    match_logit: float = 8.0
    vocab: int = 2048
    spread: float = 0.5

    RANGES = {"sink_logit": (0.0, 40.0), "local_logit": (0.0, 40.0), "window": (2.0, 65536.0),
              "match_logit": (0.0, 40.0), "vocab": (2, 1 << 20), "spread": (0.0, 8.0)}

    def __post_init__(self):
        for f in fields(self):
            low, high = self.RANGES[f.name]
            v = getattr(self, f.name)
            bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            if f.name == "vocab":
                bad = bad or not isinstance(v, int)
            if bad or not low <= v <= high:
                raise ValueError(f"peaked attention {f.name}: expected a {'whole ' if f.name == 'vocab' else ''}"
                                 f"number in [{low}, {high}], got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Layout:
    """Which RoPE pairs (rotate-half layout: dims i and i + d/2) carry what, for head dim ``head_dim``."""

    head_dim: int
    theta: float

    def __post_init__(self):
        if self.head_dim < 8 or self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even number >= 8, got {self.head_dim}")
        if not self.theta > 1:
            raise ValueError(f"rope theta: expected > 1, got {self.theta}")

    @property
    def pairs(self) -> int:
        return self.head_dim // 2

    @property
    def local_pairs(self) -> int:  # pairs [0, local_pairs): the window (down to frequency ~ 1/1000 and below)
        return (5 * self.pairs) // 8

    @property
    def sink_pair(self) -> int:
        return self.pairs - 1

    def id_dims(self) -> torch.Tensor:  # both dims of pairs [local_pairs, sink_pair): token codes
        p = torch.arange(self.local_pairs, self.sink_pair)
        return torch.cat([p, p + self.pairs])

    def freqs(self) -> torch.Tensor:
        return self.theta ** (-torch.arange(self.pairs, dtype=torch.float64) * 2 / self.head_dim)


def head_strengths(p: PeakedAttention, heads: int, layer: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-head sink, local and match logits and windows [heads] of one layer (float64)."""
    g = torch.Generator().manual_seed(seed * 100003 + layer)
    # the normal's quantiles at (i + 0.5) / heads, in another order per strength: every layer holds the same
    # spread of strengths (far less variance over seeds than independent draws), assigned to other heads
    quantiles = torch.special.ndtri((torch.arange(heads, dtype=torch.float64) + 0.5) / heads)
    z = torch.stack([quantiles[torch.randperm(heads, generator=g)] for _ in range(4)])
    def add(mean, i):
        return (mean + p.spread * z[i]).clamp_min(0.0)

    return {"sink": add(p.sink_logit, 0), "local": add(p.local_logit, 1), "match": add(p.match_logit, 2),
            "window": (p.window * torch.exp(p.spread * z[3] / 4)).clamp(2.0, 1 << 20)}


def query_key_parts(p: PeakedAttention, lay: Layout, heads: int, layer: int, seed: int = 0):
    """Pre-RoPE vectors: the query part every token shares [heads, d], the code scale per head [heads],
    the key part every token but the first shares [d] and the first token's key [d]."""
    s = head_strengths(p, heads, layer, seed)
    d, scale = lay.head_dim, lay.head_dim ** -0.5
    freqs = lay.freqs()
    key_shared = torch.zeros(d, dtype=torch.float64)
    key_shared[:lay.local_pairs] = 1.0
    key_first = torch.zeros(d, dtype=torch.float64)
    key_first[lay.sink_pair] = SINK_KEY
    q_shared = torch.zeros(heads, d, dtype=torch.float64)
    band = freqs[None, :lay.local_pairs] >= 1.0 / s["window"][:, None]  # [heads, local pairs]
    band[:, 0] = True
    q_shared[:, :lay.local_pairs] = band * (s["local"] / (scale * band.sum(1)))[:, None]
    q_shared[:, lay.sink_pair] = s["sink"] / (scale * SINK_KEY)
    code = s["match"] / (scale * lay.id_dims().numel())  # codes have unit variance per dim
    return q_shared, code, key_shared, key_first


@functools.lru_cache(maxsize=4)
def _rope_tables(end: int, lay: Layout, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.arange(end, dtype=torch.float64, device=device)[:, None] * lay.freqs().to(device)[None, :]
    return ang.cos().float(), ang.sin().float()  # angles in float64: they reach 1e5 radians


def quarter_turn(code: torch.Tensor) -> torch.Tensor:
    """A token code (last dim: the x then the y components of its RoPE pairs) turned by -90° in every pair:
    a query holding the turned code scores sin(θ Δ) against the same code Δ positions back, 0 at Δ = 0."""
    m = code.shape[-1] // 2
    return torch.cat([code[..., m:], -code[..., :m]], -1)


def rope(x: torch.Tensor, start: int, lay: Layout) -> torch.Tensor:
    """``x`` [..., P, d] rotated to positions start..start+P-1 (the rotate-half convention of Llama/Qwen/Gemma)."""
    end = start + x.shape[-2]
    cos, sin = (t[start:end].to(x.dtype) for t in _rope_tables(end, lay, str(x.device)))
    half = lay.pairs
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], -1)


def prompt_tokens(p: PeakedAttention, n: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, n]: the first token (id 0) then ids drawn uniformly from 1..vocab."""
    t = torch.randint(1, p.vocab + 1, (batch, n), generator=generator)
    t[:, 0] = BOS
    return t


def synthetic_qk(p: PeakedAttention, lay: Layout, heads: int, kv_heads: int, tokens: torch.Tensor,
                 queries: int, *, layer: int = 0, seed: int = 0, dtype=torch.float32, device="cpu"):
    """Post-RoPE queries [B, heads, queries, d] of the last ``queries`` positions of ``tokens`` [B, n] and
    keys [B, kv_heads, n, d], as one layer of ``peak_model``'s model makes them (token codes drawn here)."""
    if heads % kv_heads:
        raise ValueError(f"heads: expected a multiple of kv_heads ({kv_heads}), got {heads}")
    b, n = tokens.shape
    q_shared, code, key_shared, key_first = query_key_parts(p, lay, heads, layer, seed)
    ids = lay.id_dims().to(device)
    g = torch.Generator().manual_seed(seed * 7919 + layer + 1)
    table = torch.randn(kv_heads, p.vocab + 1, ids.numel(), generator=g).to(device)  # each group's token codes
    tok = tokens.to(device)
    k = torch.zeros(b, kv_heads, n, lay.head_dim, device=device)
    k[..., ids] = table[:, tok].permute(1, 0, 2, 3)
    k += key_shared.float().to(device)
    first = tok == BOS
    k[first[:, None, :].expand(b, kv_heads, n)] = key_first.float().to(device)
    group = torch.arange(heads, device=device) // (heads // kv_heads)
    q = q_shared.float().to(device)[None, :, None, :].repeat(b, 1, queries, 1)
    own = k[:, :, n - queries:][:, group][..., ids]  # the query tokens' codes
    q[..., ids] += code.float().to(device)[None, :, None, None] * quarter_turn(own)
    k = rope(k, 0, lay)
    q = rope(q, n - queries, lay)
    return q.to(dtype), k.to(dtype)


def synthetic_profile(p: PeakedAttention, lay: Layout, heads: int, kv_heads: int, n: int, *, layers: int = 2,
                      queries: int = 16, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """``attention_profile``'s statistics [layers, heads] of ``synthetic_qk`` (one prompt of ``n`` tokens)."""
    tokens = prompt_tokens(p, n, 1, torch.Generator().manual_seed(seed))
    per_layer = []
    for layer in range(layers):
        q, k = synthetic_qk(p, lay, heads, kv_heads, tokens, queries, layer=layer, seed=seed, device=device)
        k = k.repeat_interleave(heads // kv_heads, 1)
        logits = (q @ k.transpose(-1, -2)) * lay.head_dim ** -0.5
        pos = torch.arange(n - queries, n, device=device)
        causal = torch.arange(n, device=device)[None, :] <= pos[:, None]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
        per_layer.append({s: v.mean(dim=(0, -1)).cpu() for s, v in attention_profile(probs, pos).items()})
    return {s: torch.stack([x[s] for x in per_layer]) for s in STATS}


# -- models ----------------------------------------------------------------------------------------------


def model_layout(config) -> Layout:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope_params = getattr(config, "rope_parameters", None) or {}
    theta = rope_params.get("rope_theta", getattr(config, "rope_theta", None))
    if rope_params.get("rope_type", "default") != "default":
        raise ValueError(f"model: the peaked construction needs plain RoPE, got {rope_params.get('rope_type')!r}")
    return Layout(head_dim, float(theta))


def _shard_of(param, full: torch.Tensor, name: str) -> torch.Tensor:
    """What this process holds of ``full`` (a parameter's whole values) for ``param``: all of it for a plain
    or replicated parameter, this rank's chunk along the sharded dimension for a DTensor sharded on a
    one-dimensional mesh (DTensor's chunking: ``torch.chunk``, the last ranks' chunks possibly empty)."""
    from ..runtime.parallel import shard_dim

    if not hasattr(param, "to_local"):
        return full
    dim = shard_dim(param)
    if dim is not None:
        mesh = param.device_mesh
        chunks, rank = full.chunk(mesh.size(), dim), mesh.get_local_rank()
        part = chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)
    elif all(type(pl).__name__ == "Replicate" for pl in param.placements):
        part = full
    else:
        raise ValueError(f"model: {name} is a DTensor placed {tuple(param.placements)}; the peaked construction "
                         "writes plain, replicated or one-dimensionally sharded parameters")
    if part.shape != param.to_local().shape:
        raise ValueError(f"model: {name}'s local shard has shape {tuple(param.to_local().shape)}, its placement "
                         f"{tuple(param.placements)} gives {tuple(part.shape)}")
    return part


def set_param(param, full: torch.Tensor, name: str = "parameter") -> None:
    """Writes ``full`` (the parameter's whole values, any dtype) into ``param`` in place: all of it into a
    plain parameter, this rank's part into a DTensor one (a tensor-parallel model: every rank computes the
    same ``full``, so the shards together hold it)."""
    from ..runtime.parallel import local_tensor

    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"model: {name} has shape {tuple(param.shape)}, the values written have {tuple(full.shape)}")
    local_tensor(param).copy_(_shard_of(param, full, name))


@torch.no_grad()
def peak_model(model, p: PeakedAttention, *, seed: int = 0):
    """Rewrites a random-weight Llama/Qwen2-style model's embedding, q_proj/k_proj (and their biases) and the
    residual branches' output projections in place so that its attention follows ``p`` (see the module
    docstring); returns the model, with ``model.peaked_attention = p``. On a tensor-parallel model (DTensor
    parameters, ``bench/e2e_tp.py``; call on every rank) each rank computes the whole tensors from the same
    seed and keeps its shard of them."""
    from ..runtime.parallel import local_tensor

    cfg = model.config
    if cfg.model_type not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"model: the peaked construction covers llama/qwen2/mistral shapes, got {cfg.model_type!r}")
    if p.vocab + 1 > cfg.vocab_size:
        raise ValueError(f"peaked attention vocab: expected at most {cfg.vocab_size - 1} (the model's vocabulary "
                         f"less the first token), got {p.vocab}")
    lay = model_layout(cfg)
    hidden, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    emb_param = model.get_input_embeddings().weight
    device, dtype = local_tensor(emb_param).device, emb_param.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    # every token: sqrt(D) * (SHARED on dim 0 + a random unit direction on dims 2.. of weight sqrt(1 - SHARED²))
    rand = torch.randn(emb_param.shape[0], hidden - 2, device=device, generator=g)
    rand = rand / rand.norm(dim=1, keepdim=True)
    scale = hidden ** 0.5
    emb = torch.empty(emb_param.shape, device=device, dtype=dtype)
    emb[:, 0] = scale * SHARED
    emb[:, 1] = 0
    emb[:, 2:] = (rand * scale * (1 - SHARED ** 2) ** 0.5).to(dtype)
    emb[BOS] = 0
    emb[BOS, 1] = scale
    del rand
    set_param(emb_param, emb, "the input embedding")
    out_param = model.get_output_embeddings().weight
    if local_tensor(out_param).data_ptr() != local_tensor(emb_param).data_ptr():
        # greedy decoding moves to the next id of the prompt vocabulary, so decode queries have matches too
        out = torch.zeros(out_param.shape, device=device, dtype=out_param.dtype)
        ids = torch.arange(1, p.vocab + 1, device=device)
        out[ids % p.vocab + 1, 2:] = emb[ids, 2:]
        set_param(out_param, out, "the output embedding")
        del out
    del emb
    ids = lay.id_dims().to(device)
    r_norm = scale * (1 - SHARED ** 2) ** 0.5
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        q_shared, code, key_shared, key_first = (t.to(device) for t in query_key_parts(p, lay, heads, i, seed))
        codes = torch.randn(kv_heads, ids.numel(), hidden - 2, device=device, generator=g, dtype=torch.float64)
        codes /= r_norm  # a unit direction times r_norm gives unit-variance codes
        wk = torch.zeros(kv_heads, lay.head_dim, hidden, device=device, dtype=torch.float64)
        wk[:, :, 0] = key_shared / (scale * SHARED)
        wk[:, :, 1] = key_first / scale
        wk[:, ids, 2:] = codes
        wq = torch.zeros(heads, lay.head_dim, hidden, device=device, dtype=torch.float64)
        wq[:, :, 0] = q_shared / (scale * SHARED)
        wq[:, ids, 2:] = code[:, None, None] * quarter_turn(codes.transpose(1, 2)).transpose(1, 2).repeat_interleave(
            heads // kv_heads, 0)
        set_param(att.k_proj.weight, wk.reshape(-1, hidden), f"layer {i}'s k_proj")
        set_param(att.q_proj.weight, wq.reshape(-1, hidden), f"layer {i}'s q_proj")
        for proj in (att.q_proj, att.k_proj):
            if proj.bias is not None:
                local_tensor(proj.bias).zero_()
        # elementwise: each rank scales its own shard
        local_tensor(att.o_proj.weight).mul_(RESIDUAL_SCALE)
        local_tensor(layer.mlp.down_proj.weight).mul_(RESIDUAL_SCALE)
        del wk, wq, codes
    model.peaked_attention = p
    return model


def bench_prompts(model, n: int, batch: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Prompt rows for a bench model: random ids over the whole vocabulary, or for a peaked model
    (``peak_model``) its first token then ids of its prompt vocabulary."""
    p = getattr(model, "peaked_attention", None)
    device = next(model.parameters()).device
    if p is None:
        return [torch.randint(0, model.config.vocab_size, (n,), generator=generator).to(device) for _ in range(batch)]
    return list(prompt_tokens(p, n, batch, generator).to(device))


# -- calibration: fit and read ---------------------------------------------------------------------------


SPREAD_STATS = ("entropy", "sink", "window64")  # their 10 % and 90 % quantiles over heads are fitted too
FIT_HEADS = 27  # heads profiled per evaluation (layers of the shape): the spread over heads is fitted
FIT_QUERIES = 4
CHECK_SEEDS = tuple(range(1, 17))  # the fitted strengths' profile over these seeds gives its mean and spread
FIT_BOUNDS = {"vocab": (32, 16384), "spread": (0.0, 6.0)}


def tolerances(entry: dict, synthetic_std: dict[str, float] | None = None) -> dict[str, float]:
    """How far the synthetic mean may sit from the real one, per statistic: 3 × the larger of the real
    measurement's spread over prompts (standard deviation of the per-prompt means; one prompt: the spread
    over heads / sqrt(heads)) and the synthetic mean's spread over seeds, floored at 0.03 (masses) or
    0.15 nats (entropy)."""
    out = {}
    heads = sum(1 for row in entry["per_layer_head"]["entropy"] for _ in row)
    for s in FIT_STATS:
        per = torch.tensor(entry["per_prompt_mean"][s], dtype=torch.float64)
        real = float(per.std()) if per.numel() > 1 else entry["summary"][s]["std"] / heads ** 0.5
        syn = (synthetic_std or {}).get(s, 0.0)
        out[s] = max(3 * max(real, syn), 0.15 if s == "entropy" else 0.03)
    return out


def fit_layers(heads: int) -> int:
    return max(1, math.ceil(FIT_HEADS / heads))


def _residuals(p: PeakedAttention, lay, heads, kv_heads, n, summary, tol, seed) -> list[float]:
    prof = synthetic_profile(p, lay, heads, kv_heads, n, layers=fit_layers(heads), queries=FIT_QUERIES, seed=seed)
    syn = summarize(prof)
    out = [(syn[s]["mean"] - summary[s]["mean"]) / tol[s] for s in FIT_STATS]
    # the spread over heads, looser: 2 x the mean's tolerance
    out += [(syn[s][q] - summary[s][q]) / (2 * tol[s]) for s in SPREAD_STATS for q in ("p10", "p90")]
    return out


def _from_vector(x) -> PeakedAttention:
    s, l_, lw, m, lv, sp = (float(v) for v in x)
    top = PeakedAttention.RANGES["sink_logit"][1]
    (v0, v1), (s0, s1) = FIT_BOUNDS["vocab"], FIT_BOUNDS["spread"]
    return PeakedAttention(
        sink_logit=min(max(s, 0.0), top), local_logit=min(max(l_, 0.0), top),
        window=min(max(math.exp(lw), 2.0), 4096.0), match_logit=min(max(m, 0.0), top),
        vocab=int(min(max(round(math.exp(lv)), v0), v1)), spread=min(max(sp, s0), s1))


def fit(entry: dict, lay: Layout, heads: int, kv_heads: int, *, seed: int = 0,
        start: PeakedAttention | None = None, max_evals: int = 300, log=print) -> dict:
    """Strengths whose synthetic profile at the entry's length matches its means and its spread over heads
    (the 10/90 % quantiles of entropy, sink and window64): Nelder-Mead over the six parameters on
    ``FIT_HEADS`` heads with a fixed seed (a deterministic objective); then the synthetic summary over three
    other seeds, from which the tolerances take the synthetic spread."""
    from scipy.optimize import minimize

    n, summary = entry["n"], entry["summary"]
    tol0 = tolerances(entry)
    p0 = start or PeakedAttention(sink_logit=14.0, local_logit=9.0, window=1024.0, match_logit=14.0, vocab=1024,
                                  spread=2.0)
    x0 = [p0.sink_logit, p0.local_logit, math.log(p0.window), p0.match_logit, math.log(p0.vocab), p0.spread]
    evals = {"n": 0}

    def f(x):
        evals["n"] += 1
        value = sum(r * r for r in _residuals(_from_vector(x), lay, heads, kv_heads, n, summary, tol0, seed))
        if evals["n"] % 10 == 0:
            log(f"  {evals['n']} profiles; {_from_vector(x)}: {value:.3f}")
        return value

    if max_evals > 0:
        res = minimize(f, x0, method="Nelder-Mead", options={"maxfev": max_evals, "xatol": 1e-2, "fatol": 1e-3,
                                                              "initial_simplex": _simplex(x0)})
        best, objective = _from_vector(res.x), float(res.fun)
    else:  # no search: the start, checked
        best, objective = p0, f(x0)
    check = [summarize(synthetic_profile(best, lay, heads, kv_heads, n, layers=fit_layers(heads),
                                         queries=FIT_QUERIES, seed=s)) for s in CHECK_SEEDS]
    means = {s: torch.tensor([c[s]["mean"] for c in check], dtype=torch.float64) for s in STATS}
    tol = tolerances(entry, {s: float(means[s].std()) for s in FIT_STATS})
    log(f"fit ({evals['n']} profiles): {best}; objective {objective:.3f}")
    return {"params": best.to_dict(), "objective": objective, "profiles": evals["n"],
            "synthetic_mean": {s: float(means[s].mean()) for s in STATS},
            "synthetic_seed_std": {s: float(means[s].std()) for s in STATS},
            "synthetic_quantiles": {s: {q: sum(c[s][q] for c in check) / len(check) for q in ("p10", "p50", "p90")}
                                    for s in STATS},
            "target_mean": {s: summary[s]["mean"] for s in FIT_STATS}, "tolerance": tol, "n": n,
            # met: the synthetic mean lies inside the tolerance by more than 3 standard errors over the seeds
            "within": {s: abs(float(means[s].mean()) - summary[s]["mean"])
                       + 3 * float(means[s].std()) / len(check) ** 0.5 <= tol[s] for s in FIT_STATS},
            "heads_profiled": fit_layers(heads) * heads, "queries": FIT_QUERIES, "head_dim": lay.head_dim,
            "rope_theta": lay.theta, "heads": heads, "kv_heads": kv_heads}


def _simplex(x0):
    steps = [3.0, 2.0, 1.0, 4.0, 1.0, 1.0]
    out = [list(x0)]
    for i, st in enumerate(steps):
        x = list(x0)
        x[i] += st
        out.append(x)
    return out


def fitted(shape: str, calibration: dict | None = None) -> tuple[PeakedAttention, dict]:
    """The committed fit for a bench shape: its parameters and the fit's record (target, tolerances)."""
    data = calibration if calibration is not None else load_calibration()
    fits = data.get("fits", {})
    if shape not in fits:
        raise ValueError(f"shape: no peaked-attention fit for {shape!r} in the calibration (fits for: "
                         f"{', '.join(fits) or 'none'}); run python -m kvsieve.bench.peaked --shapes {shape}")
    return PeakedAttention(**fits[shape]["params"]), fits[shape]


def check_attention(attention: str, peaked: PeakedAttention | None = None) -> None:
    """ValueError naming ``attention`` (one of ``ATTENTION_MODES``) or ``peaked`` (only with ``peaked``)."""
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention: expected one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
    if peaked is not None and (attention != "peaked" or not isinstance(peaked, PeakedAttention)):
        raise ValueError(f"peaked: expected a PeakedAttention with attention='peaked', got {peaked!r} "
                         f"with attention={attention!r}")


def build_bench_model(build, shape: str, attention: str, peaked: PeakedAttention | None = None, **kw):
    """``build(shape, **kw)`` (the bench's random-weight model); for ``attention="peaked"`` with the real
    model's RoPE base and rewritten by ``peak_model`` with ``peaked`` (default: the committed fit for the
    shape)."""
    check_attention(attention, peaked)
    if attention == "uniform":
        return build(shape, **kw)
    params = peaked if peaked is not None else fitted(shape)[0]
    extra = {"rope_theta": ROPE_THETA[shape]} if shape in ROPE_THETA else {}
    model = build(shape, **kw, **extra)
    if extra and model_layout(model.config).theta != extra["rope_theta"]:
        # the sink pair must barely rotate over the context: the real base, not the config's default
        raise ValueError(f"model: this transformers release ignored rope_theta={extra['rope_theta']} for {shape} "
                         f"(the config has {model_layout(model.config).theta})")
    return peak_model(model, params)


def peaked_decode_qk(shape: str, batch: int, heads: int, kv_heads: int, head_dim: int, n: int, seed: int,
                     dtype, device, peaked: PeakedAttention | None = None):
    """Decode inputs of the kernel bench: q [B, heads, d] (each row's last token) and K [B, kv_heads, n, d]
    of ``synthetic_qk`` (one layer; each row its own prompt), with ``peaked`` or the shape's fit."""
    p = peaked if peaked is not None else fitted(shape)[0]
    lay = Layout(head_dim, ROPE_THETA.get(shape, 10000.0))
    q = torch.empty(batch, heads, head_dim, device=device, dtype=dtype)
    k = torch.empty(batch, kv_heads, n, head_dim, device=device, dtype=dtype)
    for b in range(batch):  # a row at a time: float32 K of the whole batch can exceed memory
        tokens = prompt_tokens(p, n, 1, torch.Generator().manual_seed(seed * 1009 + b))
        qb, kb = synthetic_qk(p, lay, heads, kv_heads, tokens, 1, seed=seed, device=device)
        q[b], k[b] = qb[0, :, 0], kb[0]
    return q, k


@torch.no_grad()
def decode_profile(q: torch.Tensor, k: torch.Tensor, scale: float) -> dict[str, float]:
    """Means over rows and heads of ``attention_profile`` for decode inputs q [B, H, d], K [B, Hkv, n, d]
    (the query at position n − 1 attends all n keys)."""
    b, h, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    pos = torch.tensor([n - 1], device=q.device)
    sums: dict[str, float] = {}
    for i in range(b):  # a row at a time, K not expanded to every head
        logits = (q[i].view(hkv, h // hkv, d) @ k[i].transpose(-1, -2)).float() * scale
        stats = attention_profile(torch.softmax(logits, -1).reshape(h, 1, n), pos)
        for s_, v in stats.items():
            sums[s_] = sums.get(s_, 0.0) + float(v.mean()) / b
    return sums


PROFILE_MAX_N = 32768


def run_profile(model, contexts, *, seed: int = 0, log=print, combine=None) -> dict | None:
    """The attention profile (``summarize`` of ``model_attention_profile``) of a bench model on one of its
    bench prompts, at the smallest of ``contexts`` capped at ``PROFILE_MAX_N`` tokens; None where that
    exceeds the model's positions. ``combine`` maps the profile this process measured to the whole model's
    (a tensor-parallel rank sees its own heads only: ``bench/e2e_tp.py`` gathers the ranks')."""
    import time

    from .attention_shape import model_attention_profile

    n = min(min(contexts), PROFILE_MAX_N)
    if n + 1 > model.config.max_position_embeddings or n < 2:
        return None
    t0 = time.perf_counter()
    ids = bench_prompts(model, n, 1, torch.Generator().manual_seed(seed))[0][None]
    prof = model_attention_profile(model, ids, last=min(16, n))
    if combine is not None:
        prof = combine(prof)
    out = {"n": n, "summary": summarize(prof), "seconds": round(time.perf_counter() - t0, 2)}
    log(f"attention profile at {n} tokens ({out['seconds']} s): "
        + ", ".join(f"{s} {out['summary'][s]['mean']:.3f}" for s in STATS))
    return out


def calibration_record(shape: str, p: PeakedAttention | None, measured: dict | None) -> dict:
    """What a results file carries about a bench's attention on ``shape`` (``p``: the peaked parameters,
    None for uniform): its mode and parameters, the committed fit for the shape where ``p`` is the fit,
    the real models' profiles, and ``measured`` (``run_profile``'s output on the bench's model)."""
    data = load_calibration()
    real = {k: {s: e["summary"][s]["mean"] for s in STATS} | {"n": e["n"], "layers": len(e["layers_profiled"])}
            for k, e in data["entries"].items()}
    out = {"attention": "uniform" if p is None else "peaked", "params": None if p is None else p.to_dict(),
           "real": real}
    fit_rec = data.get("fits", {}).get(shape)
    if p is not None and fit_rec is not None and fit_rec["params"] == p.to_dict():
        out.update(fit_target=fit_rec["target"], fit_n=fit_rec["n"], fit_synthetic=fit_rec["synthetic_mean"],
                   tolerance=fit_rec["tolerance"], within=fit_rec.get("within"))
    if measured is not None:
        out["synthetic_measured"] = {"n": measured["n"], **{s: measured["summary"][s]["mean"] for s in STATS}}
    return out


def calibration_markdown(cal: dict, shape: str = "") -> list[str]:
    """Markdown lines: the real models' profiles, the fitted synthetic one and the one measured in the run."""
    cols = ("entropy", "top1", "top5", "sink", "window64", "window256", "keys90")
    what = ("random weights, flat attention: the flat worst case" if cal["attention"] == "uniform"
            else f"peaked, parameters {cal['params']}"
            + (f", fitted to {cal['fit_target']} at {cal['fit_n']:,} tokens" if "fit_target" in cal else ""))
    lines = [f"Attention of {shape or 'the model'}: {what}. Profile = mean over heads and the last query positions "
             "(entropy in nats; top1/top5 = mass of the top 1 %/5 % of keys; sink = first 4 keys; window64/256 = "
             "last 64/256 keys; keys90 = fraction of keys holding 90 % of the mass).", "",
             "| attention | N | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for name, r in cal["real"].items():
        lines.append(f"| real: {name} ({r['layers']} full-attention layers) | {r['n']:,} | "
                     + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    if "fit_synthetic" in cal:
        lines.append(f"| synthetic, at the fit | {cal['fit_n']:,} | "
                     + " | ".join(f"{cal['fit_synthetic'][c]:.3f}" for c in cols) + " |")
        within = cal.get("within") or {}
        lines.append("| fit tolerance (✗: the fit misses it) | | " + " | ".join(
            f"±{cal['tolerance'][c]:.3f}{'' if within.get(c, True) else ' ✗'}" if c in cal["tolerance"] else "—"
            for c in cols) + " |")
    m = cal.get("synthetic_measured")
    if m:
        lines.append(f"| {cal['attention']}: this run's model | {m['n']:,} | "
                     + " | ".join(f"{m[c]:.3f}" for c in cols) + " |")
    return lines + [""]


SHAPE_HEADS = {"llama-3.1-8b": (32, 8, 128), "llama-3.1-70b": (64, 8, 128), "qwen2.5-7b": (28, 4, 128),
               "smollm2-135m": (9, 3, 64)}


def main(argv=None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m kvsieve.bench.peaked",
                                 description="fit the peaked-attention strengths per bench shape to a real profile")
    ap.add_argument("--shapes", default=",".join(SHAPE_HEADS))
    ap.add_argument("--target", default=DEFAULT_TARGET, help="calibration entry to match, e.g. smollm2-135m@8192")
    ap.add_argument("--max-evals", type=int, default=300, help="profiles the search may take (0: check --start)")
    ap.add_argument("--start", default=None, help="start from this shape's committed fit (default: a fixed guess)")
    ap.add_argument("--calibration", default=str(CALIBRATION_FILE))
    args = ap.parse_args(argv)
    path = Path(args.calibration)
    data = json.loads(path.read_text())
    if args.target not in data["entries"]:
        raise ValueError(f"--target: expected one of {', '.join(data['entries'])}, got {args.target!r}")
    entry = data["entries"][args.target]
    # each shape starts from --start's fit or the previous shape's (the strengths are in logits)
    start = PeakedAttention(**data["fits"][args.start]["params"]) if args.start else None
    for shape in (s.strip() for s in args.shapes.split(",")):
        if shape not in SHAPE_HEADS:
            raise ValueError(f"--shapes: expected names from {', '.join(SHAPE_HEADS)}, got {shape!r}")
        heads, kv_heads, d = SHAPE_HEADS[shape]
        rec = fit(entry, Layout(d, ROPE_THETA[shape]), heads, kv_heads, max_evals=args.max_evals, start=start)
        rec["target"] = args.target
        rec["started_from"] = None if start is None else start.to_dict()
        start = PeakedAttention(**rec["params"])
        rec["command"] = "python -m kvsieve.bench.peaked " + " ".join(argv if argv is not None else sys.argv[1:])
        data.setdefault("fits", {})[shape] = rec
        write_calibration(data, path)
        print(f"{shape}: " + ", ".join(f"{s} {rec['synthetic_mean'][s]:.3f} (real {rec['target_mean'][s]:.3f} "
                                       f"± {rec['tolerance'][s]:.3f})" for s in FIT_STATS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
