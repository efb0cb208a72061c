"""SAAP's test helpers: a tiny Llama, texts and settings for the fit, random artifacts, decode inputs, dense output."""

from __future__ import annotations

import torch

import kvsieve
from kvsieve.fit.saap import save_layer, write_json
from kvsieve.methods.saap import ARTIFACT_FORMAT, MANIFEST, QueryClassifier, Rope, config_hash, weights_fingerprint


def tiny_llama(heads=4, kv_heads=2, layers=3, seed=0, rope_parameters=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs = {} if rope_parameters is None else {"rope_parameters": rope_parameters}
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=4096, **kwargs)
    return LlamaForCausalLM(cfg).eval()


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}


TEXTS = ["".join(chr(97 + (i * 7 + j * 13 + j // 5) % 26) for j in range(2000)) for i in range(2)]

FIT = dict(model="tiny", clusters=8, prompt_tokens=256, prompts=2, val_prompts=1, queries=64, steps=20, batch=32,
           hidden=16)


def write_artifacts(folder, *, heads, kv_heads, head_dim=16, layers=3, clusters=8, per="kv", seed=0, model=None):
    """Random but well-formed artifacts (no fit): enough for decode tests."""
    gen = torch.Generator().manual_seed(seed)
    rope = Rope(1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)))
    shape = {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    for layer in range(1, layers):
        cent = torch.nn.functional.normalize(torch.randn(kv_heads, clusters, head_dim, generator=gen), dim=-1)
        net = QueryClassifier(kv_heads if per == "kv" else heads, head_dim, 16, clusters)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            net.norm.running_mean.copy_(torch.randn(net.norm.running_mean.shape, generator=gen))
        tensors = {"centroids": cent, "centroids_roped": cent.flip(1).contiguous()}
        tensors.update({f"classifier.{n}": v.detach().clone() for n, v in net.state_dict().items()})
        save_layer(folder, layer, tensors)
    identity = {"name": "synthetic", "config_hash": "-", "weights_fingerprint": "-", "shape": shape}
    if model is not None:
        identity.update(config_hash=config_hash(model.config), weights_fingerprint=weights_fingerprint(model))
    write_json(folder / MANIFEST, {
        "format": ARTIFACT_FORMAT, "complete": True, "model": identity,
        "rope": {"inv_freq": rope.inv_freq.tolist(), "attention_scaling": 1.0},
        "hyperparameters": {"clusters": clusters, "hidden": 16, "per": per}, "layers_done": list(range(1, layers)),
    })
    return folder


def qkv(batch, heads, kv_heads, n, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, d, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, n, d, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, n, d, generator=g, dtype=dtype)
    return q, k, v


def exact(q, k, v, lengths=None):
    out, _ = kvsieve.method("dense").decode(q, k, v, lengths=lengths)
    return out.double()
