"""The decode runtime: a static KV cache kvsieve owns and a decode step captured once in a CUDA graph.

gpt-fast's design on transformers' own modules. The model runs unchanged (its projections, RoPE, norms
and MLP); two things are ours:

- the cache (:class:`~kvsieve.runtime.cache.RuntimeCache`), allocated once for the request, one
  write position per batch row held in device memory;
- the attention function ``"kvsieve-runtime"`` registered in transformers' ``AttentionInterface``:
  prefill is exact SDPA over the row's prefix (or, with ``prefill="method"`` or the spec of a method
  with a sparse prefill, that method's prefill on the layers it does not keep exact); a decode step
  reads each row's valid length from
  device memory and runs kvsieve's dense split-KV Triton kernel (or the method's decode), never a
  padded mask over the whole cache (except the recorded ``sdpa-masked`` fallback for head dims the
  kernel does not take). Sliding-window layers whose window binds within the request (Gemma 3's local
  layers) run exact attention over each row's last ``sliding_window`` keys, in prefill and decode, whatever
  the method: the method serves the other layers (``stats.method_decode_layers``).

One decode step = forward of the last tokens → logits → next tokens (greedy or counter-based
sampling) → EOS bookkeeping, all on the device with no host synchronisation, so it is captured in a
CUDA graph once and replayed per token. The host looks at ``finished`` only every ``check_every``
steps. Per-request state (positions, step counter) lives on the runtime object; how the method is
served (its state per layer, seeds, prefill hooks, stats) is the :class:`~kvsieve.driver.LayerDriver`'s,
the same one ``kvsieve.sparsify`` uses; nothing lives on the model's modules.
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..core.method import Method
from ..core.registry import method as build_method
from ..core.rng import derive_seed
from ..driver import LayerDriver
from ..integrations.hf import attention_modules
from ..integrations.models import cache_argument
from .cache import RuntimeCache
from .compiled import CompiledOps
from .parallel import TensorParallel, spec_of, step_all_reduce, tensor_parallel
from .sampling import SamplingConfig, choose_tokens, mix32
from .stats import GenerateResult, RuntimeStats
from .support import ModelShape, check_model, text_config

__all__ = ["DecodeRuntime", "GenerateResult", "RuntimeStats"]

ATTENTION_NAME = "kvsieve-runtime"
GRAPH_CHOICES = ("auto", True, False)
ATTENTION_BACKENDS = ("auto", "triton", "sdpa", "sdpa-masked")
PREFILL_CHOICES = ("exact", "method")  # or the spec / instance of a method with a sparse prefill

# attention module -> the runtime serving it (weak: a dropped model leaves nothing behind)
_RUNTIMES: weakref.WeakKeyDictionary[torch.nn.Module, DecodeRuntime] = weakref.WeakKeyDictionary()
_REGISTERED = False


def _register_attention() -> None:
    # No mask function is registered under this name on purpose: transformers then builds no mask at
    # all ("custom attention without mask creation"), so a decode step never materialises one.
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _runtime_attention)
        _REGISTERED = True


def _runtime_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    runtime = _RUNTIMES.get(module)
    if runtime is None:
        raise RuntimeError(f"{ATTENTION_NAME}: attention module of layer {module.layer_idx} is not attached to a "
                           "DecodeRuntime (use kvsieve.generate or DecodeRuntime as a context manager)")
    return runtime.attend(module, query, key, value, scaling, kwargs), None


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


class DecodeRuntime:
    """A model under one method, for one request of ``batch_size`` rows and ``capacity`` tokens a row.

    Use as a context manager (it points the model's attention at kvsieve for its lifetime)::

        with DecodeRuntime(model, "dense", batch_size=1, capacity=4096, max_new_tokens=64) as rt:
            rt.prefill([ids])              # exact, emits the first new token
            rt.decode(63)                  # graph replays
            rt.tokens(), rt.stats

    ``prefill`` chooses the prompt's attention: ``"exact"`` (SDPA, the default), ``"method"`` (the
    method's own sparse prefill, for a method that declares ``sparse_prefill``; its state from the
    prompt — Sketch&Walk's block sketches — is the state its decode steps start from), or the spec of
    a method with a sparse prefill (its prefill, then ``method`` in the decode steps, e.g.
    ``DecodeRuntime(model, "dense", prefill="sketchwalk:variant=reconstruction,density=0.1", ...)``). The
    sparse prefill runs on every layer except ``dense_layers`` and the layers the method keeps exact (sketchwalk's
    ``dense_layers``), one forward per row; chunked prefill stays exact-only.

    Both are served through a :class:`~kvsieve.driver.LayerDriver`, as ``kvsieve.sparsify`` serves them:
    the method's exact layers run the dense decode (``stats.dense_decode_layers``), each forward gets
    a fresh cross-layer state (Sketch&Walk's walk), and a method that ``observes_prefill`` records each
    row's prompt (``prefill(sparse=False)``) after an exact prefill or another method's; the rows'
    records are stacked into one batch state, so rows of different lengths decode together.
    """

    def __init__(self, model: torch.nn.Module, method: str | Method = "dense", *, batch_size: int, capacity: int,
                 max_new_tokens: int, sampling: SamplingConfig | None = None,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 graph: bool | str = "auto", attention_backend: str = "auto", dense_layers: Sequence[int] = (),
                 seed: int = 0, check_every: int = 8, prefill_chunk: int | None = None,
                 compile_ops: bool | str = "auto", prefill: str | Method = "exact"):
        if graph not in GRAPH_CHOICES:
            raise ValueError(f"graph: expected 'auto', True or False, got {graph!r}")
        if compile_ops not in GRAPH_CHOICES:
            raise ValueError(f"compile_ops: expected 'auto', True or False, got {compile_ops!r}")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: expected one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        for name, value, low in (("batch_size", batch_size, 1), ("capacity", capacity, 2),
                                 ("max_new_tokens", max_new_tokens, 1), ("check_every", check_every, 1),
                                 ("prefill_chunk", capacity if prefill_chunk is None else prefill_chunk, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        self.model = model
        self.sampling = sampling or SamplingConfig()
        self.shape: ModelShape = check_model(model, capacity)
        # layers whose sliding window binds: exact window attention, never the method (see support.py)
        self.window, self.window_layers = self.shape.sliding_window, frozenset(self.shape.window_layers)
        # a model sharded by transformers' tensor-parallel plan: this rank's heads (runtime/parallel.py)
        self.tp: TensorParallel | None = tensor_parallel(model, self.shape)
        if self.tp is not None:  # before anything a rank could refuse alone: a disagreement must not hang
            self.tp.agree(method=spec_of(method), prefill=spec_of(prefill), seed=seed, sampling=self.sampling,
                          batch=batch_size, capacity=capacity, max_new_tokens=max_new_tokens, graph=graph,
                          dense_layers=sorted(int(i) for i in dense_layers), attention_backend=attention_backend,
                          compile_ops=compile_ops, prefill_chunk=prefill_chunk)
            compile_ops = self.tp.compile_ops(compile_ops, next(model.parameters()).device)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.batch, self.capacity, self.max_new = batch_size, capacity, max_new_tokens
        # one forward per row by default: causal SDPA without a mask (flash); chunks trade that for memory
        self.seed, self.check_every = seed, check_every
        self.prefill_chunk = capacity if prefill_chunk is None else prefill_chunk
        self._chunked = prefill_chunk is not None
        self.modules = attention_modules(model)
        n_layers = len(self.modules)
        self.dense_layers = frozenset(int(i) for i in dense_layers)
        self.driver = self._new_driver(method)
        self._set_prefill(prefill)
        self._set_decode_layers()

        # every refusal before the cache is allocated
        fallbacks = list(self.shape.fallbacks)
        self.attention_backend, reason = self._choose_attention_backend(attention_backend)
        if reason:
            fallbacks.append(reason)
        self.use_graph, graph_reason = self._choose_graph(graph)

        dev, b = self.device, batch_size
        head_dim = self.shape.head_dim
        kv_heads = self.tp.kv_heads if self.tp else self.shape.kv_heads  # a tensor-parallel rank caches its own
        self.cache = RuntimeCache(text_config(model), batch=b, capacity=capacity, dtype=self.dtype, device=dev,
                                  kv_heads=kv_heads, k_dim=head_dim, v_dim=head_dim, n_layers=n_layers)
        # static buffers of the decode step (their addresses are what a captured graph reads)
        self.position_ids = self.cache.positions.view(b, 1)
        self.lengths64 = torch.ones(b, dtype=torch.int64, device=dev)
        self.lengths32 = torch.ones(b, dtype=torch.int32, device=dev)
        self.tokens_in = torch.zeros(b, 1, dtype=torch.int64, device=dev)
        self.step_counter = torch.zeros(1, dtype=torch.int64, device=dev)
        self.finished = torch.zeros(b, dtype=torch.bool, device=dev)
        self.out_tokens = torch.zeros(b, max_new_tokens, dtype=torch.int64, device=dev)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos = torch.tensor(eos, dtype=torch.int64, device=dev) if eos else None
        self.pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.sample_rows = torch.arange(b, device=dev, dtype=torch.int64).view(b, 1)
        self.sample_cols = torch.arange(vocab, device=dev, dtype=torch.int64).view(1, vocab)
        self.key_index = torch.arange(capacity, device=dev)

        # per-layer seed words for captured methods: each step's per-row seeds are hashed from these and
        # the device step counter inside the graph (see _plan_step)
        words = [derive_seed(seed, 0, layer) for layer in range(n_layers)]
        self.layer_seed_words = torch.tensor([[w & 0xFFFFFFFF, (w >> 32) & 0x7FFFFFFF] for w in words],
                                             dtype=torch.int64, device=dev)
        self.row_seeds = torch.zeros(n_layers, b, dtype=torch.int64, device=dev)
        self._prefill_calls: list[tuple[int, int, Any]] = []
        self.prompt_lengths: list[int] = []
        self.emitted = 0  # host count of tokens written to out_tokens (no sync needed to know it)
        self.graph_obj: torch.cuda.CUDAGraph | None = None
        self.last_logits: torch.Tensor | None = None
        # transformers before 5.2x take the cache write position as `cache_position` (used here only for
        # its mask and rope bookkeeping: the runtime's cache writes where `positions` says)
        self._pass_cache_position = _accepts(model.forward, "cache_position")
        self._attached = False
        # the decoder layers' elementwise work compiled (runtime/compiled.py): by default wherever the step
        # is captured in a CUDA graph, the only place the fused kernels pay without per-call guard costs
        self.compile_ops = compile_ops
        self._compiled: CompiledOps | None = None
        self.stats = RuntimeStats(method=self.method.spec, attention_backend=self.attention_backend,
                                  graph=self.use_graph, graph_reason=graph_reason, batch=b, prompt_lengths=[],
                                  capacity=capacity, cache_bytes=self.cache.nbytes, fallbacks=fallbacks,
                                  dense_decode_layers=sorted(self.decode_dense_layers), log=self.driver.log,
                                  sliding_window=self.window, window_layers=sorted(self.window_layers),
                                  method_decode_layers=self._method_decode_layers())
        if self.tp is not None:
            self.stats.tp = self.tp.as_dict(*self._method_specs())

    @property
    def method(self) -> Method:
        return self.driver.method

    @property
    def is_dense(self) -> bool:
        return self.method.name == "dense"

    @property
    def capturable(self) -> bool:
        """The decode step runs the method's graph-capturable path (its seeds are planned on the device)."""
        return not self.is_dense and self.method.graph_capturable

    @property
    def records_prompt(self) -> bool:
        """The decode method starts from what it records of each row's prompt."""
        return not self.is_dense and self.driver.records_prompt

    def _new_driver(self, method: str | Method) -> LayerDriver:
        max_positions = getattr(text_config(self.model), "max_position_embeddings", None)
        driver = LayerDriver(method, n_layers=len(self.modules), dense_layers=self.dense_layers | self.window_layers,
                             seed=self.seed, max_positions=max_positions, capacity=self.capacity, model=self.model)
        if self.tp is not None:
            self.tp.check_method(driver.method)
        return driver

    def set_method(self, method: str | Method, graph: bool | str = "auto", prefill: str | Method | None = None) -> None:
        """Serve later decode steps with another method (the prefilled cache stays; benchmarks use this
        with ``rewind``): drops the captured graph and every layer's method state (the new method has
        not seen the prompt: a prefill records it again). ``prefill`` (default: keep the current choice,
        checked against the new method) is the next ``prefill()``'s mode."""
        if self.tp is not None:
            self.tp.agree(method=spec_of(method), prefill=spec_of(prefill), graph=graph)
        previous, previous_prefill = self.driver, self.prefill_choice
        self.driver = self._new_driver(method)
        try:
            self._set_prefill(self.prefill_choice if prefill is None else prefill)
            self._set_decode_layers()
        except Exception:
            self.driver = previous  # the runtime as it was (both choices were valid with it)
            self._set_prefill(previous_prefill)
            self._set_decode_layers()
            raise
        self.driver.min_length = min(self.prompt_lengths, default=0)
        self.graph_obj = None
        self.use_graph, reason = self._choose_graph(graph)
        self.stats.method, self.stats.graph, self.stats.graph_reason = self.method.spec, self.use_graph, reason
        self.stats.dense_decode_layers = sorted(self.decode_dense_layers)
        self.stats.method_decode_layers = self._method_decode_layers()
        self.stats.log = self.driver.log
        if self.tp is not None:
            self.stats.tp = self.tp.as_dict(*self._method_specs())

    def _method_specs(self) -> list[str]:
        return [self.method.spec] + ([self.prefill_driver.method.spec] if self.prefill_driver else [])

    def _set_prefill(self, prefill: str | Method) -> None:
        """Check and record the prefill choice (see the class docstring); every refusal names ``prefill``."""
        if isinstance(prefill, str) and prefill.strip() == "exact":
            self.prefill_choice, self.prefill_driver = "exact", None
            self.prefill_dense_layers: frozenset[int] = frozenset(range(len(self.modules)))
            return
        if isinstance(prefill, str) and prefill.strip() == "method":
            driver = self.driver
            if not driver.method.sparse_prefill:
                raise ValueError(f"prefill: 'method' needs a method with a sparse prefill (sketchwalk); "
                                 f"{driver.method.name} has none (use prefill='exact', or prefill='<spec>' with the "
                                 "spec of a method that has one)")
        elif isinstance(prefill, (str, Method)):
            try:
                method = build_method(prefill)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"prefill: expected 'exact', 'method' or the spec of a method with a sparse "
                                 f"prefill, got {prefill!r} ({exc})") from None
            if not method.sparse_prefill:
                raise ValueError(f"prefill: {method.name} has no sparse prefill; expected 'exact', 'method' or "
                                 "the spec of a method with one (sketchwalk)")
            driver = self._new_driver(method)
        else:
            raise ValueError(f"prefill: expected 'exact', 'method' or a method spec, got {prefill!r}")
        if self._chunked:
            raise ValueError(f"prefill_chunk: chunked prefill is exact only; {driver.method.name}'s sparse prefill "
                             "takes the whole prompt in one forward (drop prefill_chunk, or use prefill='exact')")
        n_layers = len(self.modules)
        exact = driver.exact_layers
        if len(exact) >= n_layers:
            raise ValueError(f"prefill: {driver.method.spec} would prefill no layer sparsely: layers {sorted(exact)} "
                             f"stay exact (dense_layers and the method's own) and the model has {n_layers}")
        self.prefill_dense_layers = exact
        self.prefill_choice = prefill if isinstance(prefill, str) else driver.method
        self.prefill_driver = driver

    @property
    def prefill_shared(self) -> bool:
        """The decode method's own sparse prefill serves the prompt (``prefill="method"``)."""
        return self.prefill_driver is self.driver

    def _set_decode_layers(self) -> None:
        """The layers the decode steps serve densely: ``dense_layers`` and those the method keeps exact
        (sketchwalk's ``dense_layers``, also left out of its walk), as sparsify does."""
        self.decode_dense_layers = frozenset(range(len(self.modules))) if self.is_dense else self.driver.exact_layers

    def _method_decode_layers(self) -> list[int]:
        """The layers the decode method serves (none for dense)."""
        return [] if self.is_dense else sorted(set(range(len(self.modules))) - self.decode_dense_layers)

    # -- choices made once --------------------------------------------------------------------

    def _choose_attention_backend(self, wanted: str) -> tuple[str, str | None]:
        """Dense decode path: the Triton split-KV kernel on CUDA; torch SDPA on the CPU.

        ``sdpa-masked`` (any device) reads the lengths from device memory as the graph does, with a
        length mask over the whole cache; ``triton`` on the CPU runs the kernel through Triton's
        interpreter (``TRITON_INTERPRET=1``): both let CPU tests walk the captured step's path."""
        if wanted == "sdpa-masked":
            return "sdpa-masked", "dense decode through SDPA with a length mask over the whole cache (asked for)"
        if self.device.type != "cuda":
            if wanted == "triton":
                from ..kernels.shared.triton_utils import kernels_interpreted

                if not kernels_interpreted():
                    raise ValueError("attention_backend: 'triton' needs the model on a CUDA device (or "
                                     "TRITON_INTERPRET=1 for Triton's interpreter on the CPU)")
                return "triton", "the dense Triton kernel through Triton's interpreter (TRITON_INTERPRET=1)"
            return "sdpa", None
        from ..kernels.shared.dense import DENSE_HEAD_DIMS
        from ..kernels.shared.triton_utils import SUPPORTED_DTYPES, triton_available

        why = None
        if not triton_available():
            why = "triton is not installed"
        elif self.shape.head_dim not in DENSE_HEAD_DIMS:
            why = f"head_dim {self.shape.head_dim} (the dense kernel takes {DENSE_HEAD_DIMS})"
        elif self.dtype not in SUPPORTED_DTYPES:
            why = f"dtype {self.dtype}"
        if why is None and wanted != "sdpa":
            return "triton", None
        if wanted == "triton":
            raise ValueError(f"attention_backend: 'triton' cannot serve this model: {why}")
        return "sdpa-masked", (f"dense decode through SDPA with a length mask over the whole cache ({why})"
                               if why else "dense decode through SDPA with a length mask (asked for)")

    def _choose_graph(self, wanted) -> tuple[bool, str | None]:
        if wanted is False:
            return False, "graph=False"
        why = None
        if self.device.type != "cuda":
            why = "the model is not on a CUDA device (eager decode)"
        elif not self.is_dense and not self.method.graph_capturable:
            why = (f"{self.method.name}: its decode does not declare graph_capturable (a host read or a shape that "
                   "depends on the data); decode steps run eagerly")
        if why is None:
            return True, None
        if wanted is True:
            raise ValueError(f"graph: True but the decode step cannot be captured: {why}")
        return False, why

    # -- context: the model's attention points at the runtime -------------------------------

    def __enter__(self) -> DecodeRuntime:
        self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def attach(self) -> None:
        if self._attached:
            return
        busy = [m for m in self.modules if m in _RUNTIMES]
        if busy:
            raise ValueError("model: already attached to another DecodeRuntime; close it first")
        _register_attention()
        self._configs = {id(m.config): m.config for m in self.modules}
        self._previous = {k: c._attn_implementation for k, c in self._configs.items()}
        for c in self._configs.values():
            c._attn_implementation = ATTENTION_NAME
        for m in self.modules:
            _RUNTIMES[m] = self
        if self.compile_ops is True or (self.compile_ops == "auto" and self.use_graph):
            reducer = None
            if self.tp is not None and self.tp.sharding.row:  # a collective: every rank attaches alike
                reducer, note = step_all_reduce(self.tp, self.batch, self.dtype, self.device)
                self.tp.notes.append(note)  # kept when set_method rebuilds stats.tp
                self.stats.tp = self.tp.as_dict(*self._method_specs())
            self._compiled = CompiledOps(self.model, self.modules,
                                         lambda: self.cache.mode != "prefill" and (self.use_graph
                                                                                    or self.compile_ops is True),
                                         sharding=None if self.tp is None else self.tp.sharding, row_reducer=reducer,
                                         cache=self.cache)
            self._compiled.attach()
            self.stats.compiled_ops = True
            self.stats.fused_projections = self._compiled.projections.summary()
            self.stats.cache_write = self._compiled.cache_write
        self._attached = True

    def close(self) -> None:
        if not self._attached:
            return
        for m in self.modules:
            _RUNTIMES.pop(m, None)
        for k, c in self._configs.items():
            c._attn_implementation = self._previous[k]
        self._drop_compiled()
        self.graph_obj = None
        self._attached = False

    def _drop_compiled(self, reason: str | None = None) -> None:
        if self._compiled is not None:
            self._compiled.detach()
            self._compiled = None
        if reason is not None:
            self.stats.compiled_ops = False
            self.stats.fused_projections = None
            self.stats.cache_write = "scatter"
            self.stats.fallbacks.append(reason)

    # -- attention --------------------------------------------------------------------------

    def attend(self, module, query, key, value, scaling, kwargs) -> torch.Tensor:
        """Output ``[B, Q, Hq, dv]``, the layout transformers' attention functions return."""
        if kwargs.get("softcap") is not None:
            raise ValueError("model: attention soft-capping is not implemented by the runtime's decode kernels")
        for sink in ("s_aux", "sinks"):
            if kwargs.get(sink) is not None:
                raise ValueError("model: attention sinks are not implemented by the runtime's decode kernels")
        layer = module.layer_idx
        window = self.window if layer in self.window_layers else None
        asked = kwargs.get("sliding_window")
        if asked is not None and asked < self.capacity and asked != window:
            raise ValueError(f"model: layer {layer} asks for sliding_window={asked}, which binds within the cache "
                             f"of {self.capacity} tokens, but its config marks the window layers "
                             f"{sorted(self.window_layers)} with sliding_window={self.window}")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if self.cache.mode == "prefill":
            sparse = layer not in self.prefill_dense_layers
            if self.records_prompt and layer not in self.decode_dense_layers and not (self.prefill_shared and sparse):
                self._observe_prompt(layer, query, key, value, scaling)
            if sparse:
                return self._method_prefill(module, query, key, value, scaling)
            return self._prefill_attention(module, query, key, value, scaling, window)
        if layer in self.decode_dense_layers:  # every layer for dense; the runtime's and the method's exact layers
            return self._dense_decode(module, query, key, value, scaling, window)
        return self._method_decode(layer, query, key, value, scaling)

    def _prefill_attention(self, module, query, key, value, scaling, window=None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        start, q_len, n_keys = self.cache.prefill_start, query.shape[2], key.shape[2]
        if window is not None and n_keys > window:
            return self._window_prefill(module, query, key, value, scaling, window)
        mask = None
        if start:  # a later chunk: query i (position start + i) sees keys [0, start + i]
            mask = (self.key_index[None, :n_keys] <= start + self.key_index[:q_len, None])[None, None]
        return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling)[0]

    def _window_prefill(self, module, query, key, value, scaling, window):
        """Exact sliding-window attention over a prompt chunk: query position p sees keys ``(p - window, p]``
        (transformers' sliding mask). Blocks of ``window`` queries, each against the ``2 window - 1`` keys
        it can see, so the work and the masks grow linearly with the prompt."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        start, q_len = self.cache.prefill_start, query.shape[2]
        out = []
        for a in range(0, q_len, window):
            b = min(a + window, q_len)
            lo, hi = max(0, start + a - window + 1), start + b
            q_pos, k_pos = self.key_index[start + a:start + b, None], self.key_index[None, lo:hi]
            mask = ((k_pos <= q_pos) & (k_pos > q_pos - window))[None, None]
            out.append(sdpa_attention_forward(module, query[:, :, a:b], key[:, :, lo:hi], value[:, :, lo:hi], mask,
                                              dropout=0.0, scaling=scaling)[0])
        return torch.cat(out, dim=1)

    def _method_prefill(self, module, query, key, value, scaling):
        """One layer of one row's prompt through the prefill method's sparse prefill."""
        layer = module.layer_idx
        if self.cache.prefill_start:  # chunks are refused up front
            raise RuntimeError(f"prefill: {self.prefill_driver.method.name}'s sparse prefill needs the whole "
                               "prompt in one forward")
        out, stats = self.prefill_driver.prefill(layer, query, key, value, scale=scaling, sparse=True)
        self._prefill_calls.append((self.cache.prefill_row, layer, stats))
        return out.transpose(1, 2)

    def _observe_prompt(self, layer, query, key, value, scaling):
        """The decode method records what its decode needs from this layer's prompt (Sketch&Walk's block
        sketches) without computing attention: ``prefill(..., sparse=False)``, as sparsify does under
        ``phase="decode"``; the layer's output comes from the prefill that runs (exact or another method's)."""
        if self.cache.prefill_start:  # chunks are refused up front
            raise RuntimeError(f"prefill: {self.method.name}'s decode needs the whole prompt in one forward")
        self.driver.prefill(layer, query, key, value, scale=scaling, sparse=False)

    def _dense_decode(self, module, query, key, value, scaling, window=None):
        """Exact decode attention over each row's valid keys, or its last ``window`` keys."""
        if self.attention_backend == "triton":
            from ..kernels.shared.dense import dense_decode_triton

            return dense_decode_triton(query[:, :, 0], key, value, self.lengths32, scaling, window=window)[:, None]
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.attention_backend == "sdpa-masked":
            if window is not None:  # gather each row's window at its device length: fixed shapes, no host read
                pos = self.lengths64[:, None] + self.key_index[None, :window] - window  # [B, window]
                index = pos.clamp(min=0)[:, None, :, None]
                k = key.gather(2, index.expand(-1, key.shape[1], -1, key.shape[3]))
                v = value.gather(2, index.expand(-1, value.shape[1], -1, value.shape[3]))
                return sdpa_attention_forward(module, query, k, v, (pos >= 0)[:, None, None, :], dropout=0.0,
                                              scaling=scaling)[0]
            mask = (self.key_index[None, :] < self.lengths64[:, None])[:, None, None, :]
            return sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=scaling)[0]
        # CPU, eager: the host knows every row's length without asking the device
        lengths = self.host_lengths()
        n = max(lengths)
        lo = 0 if window is None else max(0, min(lengths) - window)
        k, v = key[:, :, lo:n], value[:, :, lo:n]
        mask = None
        if min(lengths) != n or (window is not None and n - window > lo):
            index = self.key_index[None, lo:n]
            mask = index < self.lengths64[:, None]
            if window is not None:
                mask &= index >= self.lengths64[:, None] - window
            mask = mask[:, None, None, :]
        return sdpa_attention_forward(module, query, k, v, mask, dropout=0.0, scaling=scaling)[0]

    def _method_decode(self, layer, query, key, value, scaling):
        # The driver's key for request 0, (seed, 0, layer); each row adds its batch row and position
        # (core.rng.RowStreams), which live in device memory — fresh draws every step and every graph
        # replay, and the same draws as sparsify + transformers' generate.
        if not self.use_graph:
            n = max(self.host_lengths())  # eager: the method need not look past the longest row
            key, value = key[:, :, :n], value[:, :, :n]
        # captured steps read no per-step stats: kernel paths may skip what only the stats need
        est, stats = self.driver.decode(layer, query[:, :, 0], key, value, lengths=self.lengths32, scale=scaling,
                                        count_reads=not self.use_graph)
        if not self.use_graph:
            self.driver.log.add({"layer": layer, "step": self.emitted, "rows": self.batch}, stats)
        return est.to(query.dtype)[:, None]

    # -- host-side bookkeeping (never reads the device) ---------------------------------------

    def host_lengths(self) -> list[int]:
        """Valid keys of each row during the current decode step (prompt + tokens fed so far)."""
        return [n + self.emitted for n in self.prompt_lengths]

    # -- prefill ------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, rows: Sequence[torch.Tensor]) -> None:
        """Prefill every row (exactly: SDPA over the row, or chunks of ``prefill_chunk`` tokens, each seeing
        the row's earlier keys; or through the prefill method, see the class docstring) and emit its first
        new token."""
        if len(rows) != self.batch:
            raise ValueError(f"rows: expected {self.batch} prompts, got {len(rows)}")
        lengths = [int(r.numel()) for r in rows]
        if min(lengths) < 1:
            raise ValueError("input_ids: every row needs at least one token")
        if max(lengths) + self.max_new > self.capacity:
            raise ValueError(f"max_new_tokens: a prompt of {max(lengths)} tokens + {self.max_new} new tokens exceed "
                             f"the allocated cache of {self.capacity}")
        if self.records_prompt and max(lengths) > self.prefill_chunk:
            raise ValueError(f"prefill_chunk: {self.method.name}'s decode starts from the state its prefill records "
                             f"of the whole prompt in one forward; a prompt of {max(lengths)} tokens does not fit "
                             f"prefill_chunk={self.prefill_chunk} (drop prefill_chunk or raise it)")
        self.attach()
        t0 = time.perf_counter()
        self.prompt_lengths = lengths
        self.emitted = 0
        drivers = [self.driver] + ([self.prefill_driver] if self.prefill_driver not in (None, self.driver) else [])
        for driver in drivers:  # every row's prompt is recorded alone, then the rows are stacked
            driver.begin_request(new=False, min_length=min(lengths))
            driver.begin_prefill_rows()
        self.driver.log.clear()
        self._prefill_calls = []
        self.graph_obj = None
        self.cache.mode = "prefill"
        last_logits = []
        for b, row in enumerate(rows):
            row = row.reshape(1, -1).to(self.device)
            for driver in drivers:
                driver.begin_forward()  # one forward per row: the walk starts anew
            for start in range(0, row.shape[1], self.prefill_chunk):
                chunk = row[:, start:start + self.prefill_chunk]
                self.cache.prefill_row, self.cache.prefill_start = b, start
                self.cache.seen_tokens = start
                positions = torch.arange(start, start + chunk.shape[1], device=self.device)
                extra = {"cache_position": positions} if self._pass_cache_position else {}
                out = self.model(input_ids=chunk, position_ids=positions[None], use_cache=True,
                                 logits_to_keep=1, **extra, **{cache_argument(): self.cache})
            last_logits.append(out.logits[:, -1])
        self.cache.mode = "decode"
        self.cache.seen_tokens = max(lengths)
        self.cache.positions.copy_(torch.tensor(lengths, device=self.device))
        self.step_counter.zero_()
        self.finished.zero_()
        self.out_tokens.zero_()
        self.last_logits = torch.cat(last_logits)  # [B, V]: the logits the first new tokens came from
        self._emit(self.last_logits)
        self.emitted = 1
        self._after_prefill = self._snapshot()
        for driver in drivers:
            driver.end_prefill()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.prompt_lengths = lengths
        self.stats.prefill_s = time.perf_counter() - t0
        self.stats.decode_steps = self.stats.host_checks = 0
        self.stats.decode_s = self.stats.capture_s = 0.0
        self._record_prefill()

    def _record_prefill(self) -> None:
        """Which prefill ran, and the method's stats per (row, layer), read after the prefill was timed."""
        st = self.stats
        st.prefill = "sparse" if self._prefill_calls else "exact"
        st.prefill_method = None if self.prefill_driver is None else self.prefill_driver.method.spec
        st.prefill_sparse_layers = sorted({layer for _, layer, _ in self._prefill_calls})
        st.prefill_records = [{"row": row, "layer": layer, **stats.as_dict()}
                              for row, layer, stats in self._prefill_calls]
        self._prefill_calls = []

    def rewind(self) -> None:
        """Back to just after prefill (the prompt's K/V stay; later writes are overwritten), for benchmarks.
        Every layer's method state is dropped, except the state a method recorded of the prompt
        (``observes_prefill``: its sparse prefill with ``prefill="method"``, or its observation of another
        prefill): it holds the prompt (Sketch&Walk's sketches), and a decode step recomputes what it writes
        there, so repeating the steps gives the same state. With a captured step every state stays: the graph
        holds its buffers (freed, they would be handed out again while the replays write into them), and the
        methods it captures bring their state up to date from the rewound device lengths."""
        self._restore(self._after_prefill)
        self.emitted = 1
        if self.graph_obj is None:
            self.driver.rewind()
        self.driver.log.clear()
        self.stats.decode_steps = self.stats.host_checks = 0
        self.stats.decode_s = self.stats.capture_s = 0.0

    # -- the decode step ----------------------------------------------------------------------

    def _emit(self, logits: torch.Tensor) -> None:
        """Choose the next tokens from ``logits [B, V]`` and do the EOS bookkeeping, on the device."""
        nxt = choose_tokens(logits, self.step_counter, self.sampling, self.sample_rows, self.sample_cols)
        if self.pad_token_id is not None:
            nxt = torch.where(self.finished, torch.full_like(nxt, self.pad_token_id), nxt)
        self.out_tokens.scatter_(1, self.step_counter.view(1, 1).expand(self.batch, 1), nxt[:, None])
        if self.eos is not None:
            self.finished |= (nxt[:, None] == self.eos[None, :]).any(1)
        self.tokens_in.copy_(nxt[:, None])
        self.step_counter.add_(1)

    def _plan_step(self) -> None:
        """What every layer of this step shares, computed once: valid lengths and the methods' seeds."""
        torch.add(self.cache.positions, 1, out=self.lengths64)
        self.lengths32.copy_(self.lengths64)
        if self.capturable and (self.method.stochastic or self.method.random_keys):  # a deterministic one draws none
            rows = self.sample_rows.view(1, -1)
            lo = mix32(self.layer_seed_words[:, :1] ^ mix32(self.step_counter.view(1, 1) ^ mix32(rows)))
            hi = mix32(self.layer_seed_words[:, 1:] ^ lo) & 0x7FFFFFFF
            self.row_seeds.copy_((hi << 32) | lo)

    def _step_body(self) -> None:
        # This token's forward: a fresh cross-layer state (Sketch&Walk's walk), as sparsify gives every
        # forward. Host-side only: a captured step builds it while capturing and replays the kernels that
        # fill it; an eager step gets a new one every token.
        self.driver.begin_forward()
        self._plan_step()
        extra = {"cache_position": self.cache.positions[:1]} if self._pass_cache_position else {}
        out = self.model(input_ids=self.tokens_in, position_ids=self.position_ids, use_cache=True,
                         logits_to_keep=1, **extra, **{cache_argument(): self.cache})
        logits = out.logits[:, -1]
        self.cache.positions.add_(1)
        self._emit(logits)
        self.last_logits = logits

    def _step_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers a decode step advances: positions, step counter, tokens in and out, EOS flags."""
        return self.cache.positions, self.step_counter, self.tokens_in, self.finished, self.out_tokens

    def _snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._step_buffers()]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self._step_buffers(), saved, strict=True):
            t.copy_(s)

    def _capture(self) -> None:
        saved = self._snapshot()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: compiles kernels, allocates workspaces and handles
            try:
                self._step_body()
            except Exception as exc:  # noqa: BLE001 - only a failure of the compiled pieces is recovered
                if self._compiled is None:
                    raise
                self._drop_compiled(f"compile_ops: torch.compile failed ({type(exc).__name__}: {str(exc)[:200]}); "
                                    "the decode step runs the model's modules uncompiled")
                self._restore(saved)
                self._step_body()
            self._step_body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._restore(saved)
        # The methods' per-layer state made by the warm-up stays: the captured step must run a method's
        # steady-state path (Quest's incremental page update), not its first-call one (every page summary
        # recomputed from all of K, at every replay). States are keyed by the device lengths, which were
        # just rewound: Quest re-summarises from min(summarised, length), so the rewind costs nothing.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step_body()
        self.graph_obj = graph

    @torch.no_grad()
    def step(self) -> None:
        """One decode step: feed the last tokens, emit the next ones."""
        if self.emitted >= self.max_new:
            raise ValueError(f"max_new_tokens: all {self.max_new} new tokens were already generated")
        if not self.prompt_lengths:
            raise ValueError("prefill: call prefill(rows) before decoding")
        if self.records_prompt and not self.driver.prompt_recorded:
            raise ValueError(f"prefill: {self.method.name}'s decode needs the prompt's sketches, recorded by a "
                             "prefill with it in place; set_method dropped them: call prefill(rows) again")
        if self.use_graph:
            if self.graph_obj is None:  # once per request: warm-up steps, torch.compile, the capture
                torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                self._capture()
                torch.cuda.synchronize(self.device)
                self.stats.capture_s += time.perf_counter() - t0
            self.graph_obj.replay()
        else:
            self._step_body()
        self.emitted += 1

    @torch.no_grad()
    def decode(self, steps: int | None = None) -> int:
        """Up to ``steps`` decode steps (default: until ``max_new_tokens``), stopping once every row has
        emitted EOS (checked every ``check_every`` steps). Returns the steps run."""
        steps = self.max_new - self.emitted if steps is None else min(steps, self.max_new - self.emitted)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        done = 0
        for i in range(steps):
            self.step()
            done += 1
            if self.eos is not None and (i + 1) % self.check_every == 0:
                self.stats.host_checks += 1
                if bool(self.finished.all()):
                    break
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_steps += done
        return done

    def tokens(self) -> torch.Tensor:
        """New tokens ``[B, T]``: up to the step at which the last row emitted EOS (as transformers returns)."""
        out = self.out_tokens[:, :self.emitted].cpu()
        counts = [out.shape[1]] * self.batch
        if self.eos is not None:
            is_eos = (out[:, :, None] == self.eos.cpu()[None, None, :]).any(-1)
            counts = [int(row.nonzero()[0]) + 1 if row.any() else out.shape[1] for row in is_eos]
            if all(row.any() for row in is_eos):  # every row stopped: cut where the last one did
                out = out[:, :max(counts)]
        self.stats.new_tokens = counts
        return out
