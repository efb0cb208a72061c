"""Which transformers models the runtime serves, and the clear errors for those it does not.

The runtime runs transformers' own modules (projections, RoPE, norms, MLP) and replaces only the
attention function and the cache, so any decoder whose attention goes through transformers'
``AttentionInterface`` and reads a plain causal prefix could run. It is tested on the families listed
in ``SUPPORTED_MODEL_TYPES``; attention features its kernels do not implement are refused by name,
except where ignoring them is exact, which is then recorded in ``stats.fallbacks``.

Sliding-window layers (``layer_types`` marks them; a config with a ``sliding_window`` and no
``layer_types`` slides on every layer) whose window binds within the request are ``window_layers``:
the runtime serves them with exact attention over each row's last ``sliding_window`` keys, and the
decode method serves only the other (full-attention) layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    max_context: int | None
    fallbacks: tuple[str, ...] = field(default=())
    sliding_window: int | None = None  # the window of window_layers (None: no window binds)
    window_layers: tuple[int, ...] = field(default=())


def text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def check_model(model: torch.nn.Module, total_length: int) -> ModelShape:
    """The model's attention shape, or a ValueError naming what the runtime cannot serve.

    ``total_length`` is the longest row's prompt plus its new tokens: a sliding window at least that
    long never binds, so ignoring it is exact (recorded as a fallback); a shorter one makes its layers
    ``window_layers``.
    """
    cfg = text_config(model)
    model_type = getattr(cfg, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: the decode runtime serves the {', '.join(SUPPORTED_MODEL_TYPES)} families, got "
            f"model_type {model_type!r}; use kvsieve.sparsify with transformers' generate for other models"
        )
    fallbacks: list[str] = []
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"model: attention logit soft-capping ({model_type}, attn_logit_softcapping={softcap}) is not "
            "implemented by the runtime's decode kernels"
        )
    if any(getattr(m, "sinks", None) is not None for m in model.modules() if type(m).__name__.endswith("Attention")):
        raise ValueError(f"model: attention sinks ({model_type}) are not implemented by the runtime's decode kernels")
    window = _sliding_window(cfg)
    window_layers: tuple[int, ...] = ()
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"model: sliding_window must be a positive integer, got {window!r}")
        if window < total_length:
            window_layers = sliding_layers(cfg)
        else:
            fallbacks.append(f"sliding_window={window} >= {total_length} tokens: the window never binds, "
                             "attention over the whole prefix is exact")
            window = None
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"model: {heads} query heads is not a multiple of {kv_heads} KV heads")
    return ModelShape(model_type, cfg.num_hidden_layers, heads, kv_heads, head_dim,
                      getattr(cfg, "max_position_embeddings", None), tuple(fallbacks), window, window_layers)


def sliding_layers(cfg) -> tuple[int, ...]:
    """The layers that slide: those ``layer_types`` marks ``sliding_attention``, or every layer of a
    config that has a window and no ``layer_types`` (Mistral)."""
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return tuple(range(cfg.num_hidden_layers))
    return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")


def _sliding_window(cfg) -> int | None:
    """The window of the model's sliding layers, or None when no layer slides."""
    window = getattr(cfg, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if getattr(cfg, "use_sliding_window", True) is False:  # Qwen2 configs carry a window they do not use
        return None
    return window
