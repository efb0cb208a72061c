"""Decode runtime: a KV cache kvsieve owns, exact prefill (or a method's sparse prefill), and
the decode step captured once in a CUDA graph and replayed per token. ``generate`` is the public face;
``DecodeRuntime`` the engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .engine import ATTENTION_NAME, DecodeRuntime, GenerateResult, RuntimeStats
from .sampling import SamplingConfig
from .support import SUPPORTED_MODEL_TYPES, check_model, text_config

__all__ = ["ATTENTION_NAME", "DecodeRuntime", "GenerateResult", "RuntimeStats", "SamplingConfig",
           "SUPPORTED_MODEL_TYPES", "check_model", "generate", "prompt_rows"]


def prompt_rows(input_ids: torch.Tensor | Sequence[torch.Tensor],
                attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The prompt of each row, padding removed: from ``[L]``, ``[B, L]`` (+ a 0/1 ``attention_mask``,
    left or right padding) or a list of 1-D tensors."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"input_ids: expected integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape [B, L] or [L], got {tuple(input_ids.shape)}")
        if attention_mask is None:
            return [row.long() for row in input_ids]
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask: shape {tuple(attention_mask.shape)} != input_ids' "
                             f"{tuple(input_ids.shape)}")
        keep = attention_mask.to(torch.bool)
        return [row[k].long() for row, k in zip(input_ids, keep, strict=True)]
    rows = [torch.as_tensor(r).reshape(-1).long() for r in input_ids]
    if not rows:
        raise ValueError("input_ids: expected at least one prompt")
    return rows


def generate(model: torch.nn.Module, input_ids: torch.Tensor | Sequence[torch.Tensor], method: Any = "dense", *,
             max_new_tokens: int = 32, attention_mask: torch.Tensor | None = None, do_sample: bool = False,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
             device: str | torch.device | None = None, graph: bool | str = "auto", attention_backend: str = "auto",
             dense_layers: Sequence[int] = (), check_every: int = 8, prefill_chunk: int | None = None,
             max_length: int | None = None, compile_ops: bool | str = "auto",
             prefill: str | Any = "exact") -> GenerateResult:
    """Generate with ``method`` in every decode step; the prompt is prefilled exactly by default.

    Rows may differ in length (``attention_mask`` or a list of prompts); each keeps its own length.
    ``eos_token_id``/``pad_token_id`` default to the model's generation config. ``graph="auto"``
    captures the decode step in a CUDA graph on CUDA when the method can be captured (``stats.graph``
    and ``stats.graph_reason`` say what ran). ``max_length`` caps the cache (default: longest prompt +
    ``max_new_tokens``). ``prefill_chunk`` splits each prompt's prefill into chunks of that many tokens
    (less activation memory; default: one forward per row). ``compile_ops`` (default: wherever the step is
    captured) runs the decoder layers' norms, residual adds, MLP and RoPE through ``torch.compile`` in
    decode steps (``kvsieve.runtime.compiled``). ``prefill``: ``"exact"`` (SDPA), ``"method"`` (the
    method's own sparse prefill, e.g. sketchwalk's block-sparse prefill; one row) or the spec of a method
    with a sparse prefill (``"sketchwalk:variant=reconstruction,density=0.1"``: its prefill, then ``method``
    decodes); layers in ``dense_layers`` or kept exact by the method stay exact, and ``stats.prefill`` /
    ``prefill_method`` / ``prefill_sparse_layers`` / ``prefill_block_density`` say what ran. Not with ``prefill_chunk``.
    Returns the new tokens and the run's stats.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    param = next(model.parameters())
    if device is not None and torch.device(device).type != param.device.type:
        raise ValueError(f"device: {str(device)!r} asked for, but the model's weights are on {param.device}; "
                         f"move the model first (model.to({str(device)!r}))")
    rows = prompt_rows(input_ids, attention_mask)
    for r in rows:
        if r.device.type != param.device.type:
            raise ValueError(f"input_ids: on {r.device} but the model is on {param.device}; "
                             f"pass input_ids.to({str(param.device)!r})")
    longest = max(int(r.numel()) for r in rows)
    cfg = text_config(model)
    context = getattr(cfg, "max_position_embeddings", None)
    if context is not None and longest + max_new_tokens > context:
        raise ValueError(f"input_ids: a prompt of {longest} tokens + {max_new_tokens} new tokens exceed the "
                         f"model's maximum context of {context} (max_position_embeddings)")
    capacity = longest + max_new_tokens if max_length is None else max_length
    if capacity < longest + max_new_tokens:
        raise ValueError(f"max_new_tokens: a prompt of {longest} tokens + {max_new_tokens} new tokens exceed the "
                         f"allocated cache of max_length={max_length}")
    gen_cfg = getattr(model, "generation_config", None)
    if eos_token_id is None and gen_cfg is not None:
        eos_token_id = gen_cfg.eos_token_id
    if pad_token_id is None and gen_cfg is not None:
        pad_token_id = gen_cfg.pad_token_id
    sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    with DecodeRuntime(model, method, batch_size=len(rows), capacity=capacity, max_new_tokens=max_new_tokens,
                       sampling=sampling, eos_token_id=eos_token_id, pad_token_id=pad_token_id, graph=graph,
                       attention_backend=attention_backend, dense_layers=dense_layers, seed=seed,
                       check_every=check_every, prefill_chunk=prefill_chunk, compile_ops=compile_ops,
                       prefill=prefill) as runtime:
        runtime.prefill(rows)
        runtime.decode()
        tokens = runtime.tokens()
        return GenerateResult(tokens=tokens, stats=runtime.stats)
