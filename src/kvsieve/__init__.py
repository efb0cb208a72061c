"""kvsieve: sparse attention for long-context LLM decoding, with exact references, Triton kernels,
a transformers integration and an evaluation harness.

    import kvsieve
    kvsieve.methods()
    m = kvsieve.method("santa-sys", budget=128)
    out, stats = m.decode(q, k, v, seed=0)
    with kvsieve.sparsify(model, "santa-sys:budget=64", phase="decode") as session:
        model.generate(...)
    result = kvsieve.generate(model, input_ids, "dense", max_new_tokens=64)  # the decode runtime

Layers, each importing only from the ones below it (docs/architecture.md; tests/test_architecture.py):
core ← kernels ← methods ← integrations ← runtime ← eval, bench, fit ← cli.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Import the built-in methods first: importing a subpackage binds its name on this package, and the
# public function `kvsieve.methods()` below must be what that name means afterwards. The subpackage
# only declares the method names; nothing here imports torch, so that the command line checks its
# arguments before paying for torch (CallContext, Method and StepStats are imported when first used).
from . import methods as _builtin_methods  # noqa: F401,I001
from .core.registry import method, methods, parse_spec  # noqa: E402

if TYPE_CHECKING:
    from .core.context import CallContext
    from .core.method import Method
    from .core.stats import StepStats

__version__ = "0.1.0"

__all__ = ["CallContext", "Method", "StepStats", "generate", "load_model", "method", "methods", "parse_spec",
           "sparsify", "__version__"]


_LAZY = {"CallContext": ".core.context", "Method": ".core.method", "StepStats": ".core.stats"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sparsify(model: Any, method: Any, **kwargs: Any):
    """Attach a method to a transformers causal LM for the duration of a ``with`` block.

    See :func:`kvsieve.integrations.hf.sparsify`.
    """
    from .integrations.hf import sparsify as _sparsify

    return _sparsify(model, method, **kwargs)


def load_model(name: str = "default", **kwargs: Any):
    """``(model, tokenizer)``; ``"default"`` is the offline SmolLM2-135M-Instruct.

    See :func:`kvsieve.integrations.models.load_model`.
    """
    from .integrations.models import load_model as _load

    return _load(name, **kwargs)


def generate(model: Any, input_ids: Any, method: Any = "dense", **kwargs: Any):
    """Generate with the decode runtime: a static KV cache, exact prefill, the method in every decode
    step, the step captured in a CUDA graph on CUDA. See :func:`kvsieve.runtime.generate`."""
    from .runtime import generate as _generate

    return _generate(model, input_ids, method, **kwargs)
