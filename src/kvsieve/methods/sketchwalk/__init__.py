"""``sketchwalk``: Sketch&Walk sparse attention (sketched block scores + a walk across layers).

"Scout Before You Attend: Sketch-and-Walk Sparse Attention for Efficient LLM Inference" (arXiv
2602.07397). Two variants:

- ``variant=authors`` (the default): the algorithm of the authors' released code — per-head Hadamard
  block sketches, a damped multi-step walk, quantile selection with sink and window fractions — in
  :mod:`kvsieve.methods.sketchwalk.authors` (math, per-layer state and the per-row decode step; this class
  routes ``prefill`` and ``_decode`` there); its decode batched on the device, capturable, in
  :mod:`kvsieve.methods.sketchwalk.authors_device` (kernels: ``kernels/sketchwalk/authors_decode.py``).
- ``variant=reconstruction``: the earlier reconstruction from the paper's prose, described below, with
  its Triton kernels.

The reconstruction, per sparse layer, with B-token blocks and one SRHT ``Φ = √(d/m)·P·H·D`` (m × d):

1. head-averaged, post-RoPE q and k are mean-pooled per block and sketched: ``q̃_i = Φ q̄_i``,
   ``k̃_j = Φ k̄_j``;
2. ``Â_ij = softmax_{j ≤ i}(⟨q̃_i, k̃_j⟩ · logit_scale)`` (zero above the diagonal), and
   ``Ã = Â^α`` (element-wise by default, matrix power as a flag);
3. the walk ``W ← W·Ã`` across the sparse layers of one forward pass (``W = Ã`` at the first one),
   in float32, each row divided by its maximum (which never changes a row's ranking);
4. query block ``i`` keeps block 0, its own block ``i`` and the top ``k_i − 2`` of ``W_i,1..i−1``,
   ``k_i = max(2, ⌈ρ(i+1)⌉)`` (or a fixed ``k = ⌈ρn⌉``), shared by every head;
5. exact attention inside the kept blocks: block-sparse causal attention in the prefill
   (:mod:`kvsieve.kernels.shared.block_sparse`), the weighted sparse decode with block-granular
   lists in decode (:mod:`kvsieve.kernels.shared.weighted`).

Decode keeps, per layer (``state``), running block sums of the head-averaged keys and queries, the
key sketches and the rows of ``Ã`` of completed blocks (append-only, by causality); the current
token's row of ``Â`` comes from its own query, and the walk runs over the token's pass through the
layers (the forward pass's :class:`WalkState`, ``context.forward``). A call with ``Q > 1`` query
rows per batch row (a question chunk, setup B) leaves the state as ``Q`` single-token steps would and
gives each row its own walk across the layers of the forward (``[B·Q, n]`` in the walk state).
Every choice of both variants is listed in ``docs/methods/sketchwalk.md``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...core.config import MethodConfig, param, require_choice, require_fraction, require_int
from ...core.context import NO_CONTEXT, ForwardState, MethodState
from ...core.inputs import DecodeInputs
from ...core.method import Method, read_stats, select_rows
from ...core.registry import register_method
from ...core.rng import derive_seed
from ...core.stats import StepStats
from ...kernels.shared.block_sparse import BACKENDS as PREFILL_BACKENDS
from ...kernels.shared.block_sparse import TRITON_MAX_BLOCK, block_sparse_prefill
from ...kernels.shared.weighted import weighted_sparse_decode
from ..shared.backend import BACKENDS, kernel_operands
from ..shared.sparse_path import choose_sparse_backend
from . import authors, authors_prefill
from .authors import device_sketch
from .authors_device import AuthorsDeviceState, decode_batched, decode_rows
from .reconstruction import (  # noqa: F401 - the reconstruction's math, re-exported for its users
    DEFAULT_SKETCH_DIM,
    TIE_BREAK,
    LayerSketch,
    block_budget,
    block_means,
    block_sums,
    block_token_counts,
    causal_log_scores,
    hadamard_power,
    head_mean,
    max_block_budget,
    normalize_rows,
    oracle_block_mass,
    select_blocks,
    srht_matrix,
    times_with_row,
    times_with_rows,
)

VARIANTS = ("authors", "reconstruction")
RECONSTRUCTION_ONLY = ("density", "sketch_dim", "alpha", "walk_power", "walk", "fixed_k", "logit_scale")
AUTHORS_ONLY = ("walk_damping", "degree", "query_window", "sink", "window", "kblocks_frac", "hadamard_dim", "causal",
                "dense_last_blocks")
# -- config --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SketchWalkConfig(MethodConfig):
    variant: Literal["authors", "reconstruction"] = param(
        "authors", "authors = the algorithm of the authors' released code (default); reconstruction = the earlier "
                   "reconstruction from the paper's prose (density, sketch_dim, alpha, walk_power, walk, fixed_k, "
                   "logit_scale are its parameters)")
    density: float = param(0.2, "ρ in (0, 1]: query block i keeps max(2, ⌈ρ(i+1)⌉) of its i+1 causal blocks "
                                "(variant=reconstruction)")
    block_size: int = param(64, "B: tokens per block (a power of two)")
    walk_damping: float = param(0.25, "β in [0, 1] (variant=authors): the walk W ← (1 − β)·A + β·W·A; β = 0 is "
                                      "the one-hop control")
    degree: int = param(3, "walk steps per layer, ≥ 1 (variant=authors)")
    query_window: int = param(32, "decode: the last queries pooled into a step's block row, ≥ 1 (variant=authors)")
    sink: float = param(0.025, "sink: first max(1, ⌊sink·T⌋) keys of T, as whole blocks, in (0, 1) (variant=authors)")
    window: float = param(0.05, "window: last max(1, ⌊window·T⌋) keys of T, as whole blocks ending at the query's, "
                                "in (0, 1) (variant=authors)")
    kblocks_frac: float = param(0.125, "keep the blocks whose walk score exceeds the 1 − kblocks_frac quantile of the "
                                       "other causal blocks, in (0, 1) (variant=authors)")
    hadamard_dim: int = param(128, "m: Hadamard sketch features, at most the head dim rounded up to a power of two "
                                   "(variant=authors)")
    causal: bool = param(False, "block scores softmaxed over the causal blocks only; the authors' code softmaxes "
                                "over every block (variant=authors)")
    dense_last_blocks: int = param(4, "prefill: the last query blocks that keep every block, ≥ 0 (variant=authors)")
    sketch_dim: int | None = param(
        None, "m: SRHT features per block sketch, at most the head dim (default: 64, or the head dim if smaller)")
    alpha: float = param(8.0, "α > 0: sparsity exponent of Ã = Â^α (an integer for walk_power=matrix)")
    walk_power: Literal["hadamard", "matrix"] = param(
        "hadamard", "α as an element-wise power (default) or a matrix power (α-step walk inside a layer)")
    walk: Literal["walk", "one-hop", "diagonal", "oracle"] = param(
        "walk", "rank blocks by the walk W·Ã across layers, by this layer's Ã alone (one-hop control), "
                "by W⊙Ã (diagonal-walk control), or by the exact head-averaged attention mass per block "
                "(oracle block top-k: costs dense attention, for evaluation)")
    dense_layers: tuple[int, ...] = param((0, 1), "layers kept exact and left out of the walk ('/'-separated)")
    fixed_k: bool = param(False, "keep k = ⌈ρ·n⌉ blocks per query block (n: blocks of the context) instead of ⌈ρ(i+1)⌉")
    logit_scale: Literal["sqrt_d", "sqrt_m"] = param(
        "sqrt_d", "sketched logits divided by √d (pairs with the unbiased Φ) or by √m (third-party code)")
    seed: int = param(0, "seed of the SRHT (signs and sampled rows): one Φ for every layer")
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "decode attention: auto = the weighted sparse Triton kernel with the blocks as pages on CUDA, "
                "the torch reference elsewhere; reference; triton (error if it cannot). Also picks the "
                "selection's path (decode and prefill): the Triton kernels where this asks for them and they can "
                "serve the call (the stats' selection key), the torch reference otherwise. variant=authors: "
                "reference = the per-row decode loop (not capturable); auto and triton = the batched decode "
                "on the device")
    prefill_backend: Literal["auto", "flex", "triton", "reference"] = param(
        "auto", "sparse prefill attention: auto = on CUDA the block-sparse Triton kernel for blocks of up to "
                f"{TRITON_MAX_BLOCK} keys and FlexAttention for larger ones (the faster of the two, measured), the "
                "torch reference elsewhere; flex; triton (the kernel that shares each K/V block's read among a "
                "KV-head group's query heads; error if it cannot); reference. variant=authors: auto = on CUDA its "
                "Triton kernel (full and partial key blocks, the token windows inside the partial ones; "
                "FlexAttention where the kernel cannot serve), the torch reference elsewhere")

    def __post_init__(self) -> None:
        require_choice("variant", self.variant, VARIANTS)
        require_fraction("walk_damping", self.walk_damping, low_open=False, high_open=False)
        require_int("degree", self.degree, minimum=1)
        require_int("query_window", self.query_window, minimum=1)
        for name in ("sink", "window", "kblocks_frac"):
            require_fraction(name, getattr(self, name))
        require_int("hadamard_dim", self.hadamard_dim, minimum=1)
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal: expected True or False, got {self.causal!r}")
        require_int("dense_last_blocks", self.dense_last_blocks, minimum=0)
        # A parameter of the other variant would be ignored: refuse it rather than run without it.
        other = RECONSTRUCTION_ONLY if self.variant == "authors" else AUTHORS_ONLY
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in other:
            if getattr(self, name) != defaults[name]:
                owner = "reconstruction" if self.variant == "authors" else "authors"
                raise ValueError(f"{name}: a parameter of variant={owner}, not of variant={self.variant}; set "
                                 f"variant={owner} or leave {name} out")
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d) or not 0 < d <= 1:
            raise ValueError(f"density: expected a value in (0, 1], got {d!r}")
        require_int("block_size", self.block_size, minimum=1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: expected a power of two, got {self.block_size}")
        if self.sketch_dim is not None:
            require_int("sketch_dim", self.sketch_dim, minimum=1)
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 0:
            raise ValueError(f"alpha: expected a positive number, got {a!r}")
        require_choice("walk_power", self.walk_power, ("hadamard", "matrix"))
        if self.walk_power == "matrix" and float(a) != int(a):
            raise ValueError(f"alpha: walk_power=matrix needs an integer power, got {a!r}")
        require_choice("walk", self.walk, ("walk", "one-hop", "diagonal", "oracle"))
        require_choice("logit_scale", self.logit_scale, ("sqrt_d", "sqrt_m"))
        if not isinstance(self.dense_layers, tuple):
            raise ValueError(f"dense_layers: expected a tuple of layer indices, got {self.dense_layers!r}")
        for layer in self.dense_layers:
            require_int("dense_layers", layer, minimum=0)
        require_int("seed", self.seed, minimum=0)
        require_choice("backend", self.backend, BACKENDS)
        require_choice("prefill_backend", self.prefill_backend, PREFILL_BACKENDS)


@dataclass
class SketchWalkState(MethodState):
    """One layer's state for one request: its block sketches (None until a prompt or a decode step made
    them)."""

    sketch: LayerSketch | None = None
    #: variant=authors: its running block matrix and query window (an ``AuthorsLayerState``)
    authors: authors.AuthorsLayerState | None = None
    #: variant=authors' batched decode: the same at capacity on the device (made from ``authors``)
    authors_device: AuthorsDeviceState | None = None


@dataclass
class WalkState(ForwardState):
    """The walk across the sparse layers of one forward pass: the last layer's walk rows ``[R, n]`` and
    how many layers it has crossed."""

    walk: torch.Tensor | None = None
    hops: int = 0
    #: variant=authors: the sparse layers seen so far in this forward (each layer draws its own sketch)
    layer: int = 0


# -- the method -------------------------------------------------------------------------------------------


@register_method
class SketchWalk(Method):
    name = "sketchwalk"
    config_class = SketchWalkConfig
    # The contract test's contexts are 100-300 keys: 16-key blocks make ρ = 0.3 actually sparse.
    small_config = {"block_size": 16, "dense_layers": (0,)}
    # A window of all but half a key of the longest context covers every block of every row.
    exact_config = {"window": lambda n_keys: 1 - 1 / (2 * n_keys)}
    exact_note = "a window fraction that covers the context keeps every block, so decode attends to every valid key"
    prefix_only_note = "blocks are cache positions: left padding would shift every block boundary"
    # Q > 1 query rows per batch row (a question chunk) in one call: the torch selection for all rows,
    # each with its own walk (the fused selection serves one row per batch row).
    multi_row = True
    # The prompt's forward feeds the decode (block sketches of its queries and keys), the walk crosses
    # the layers of each forward, and the prompt itself can be served block-sparse.
    sparse_prefill = True
    observes_prefill = True
    cross_layer = True
    summary = ("Sketch&Walk: Hadamard block sketches, a damped walk over layers, block-sparse prefill and decode "
               "(the authors' code; variant=reconstruction for the earlier reading of the paper)")

    # -- shared pieces ----------------------------------------------------------------------------------

    def new_state(self) -> SketchWalkState:
        return SketchWalkState()

    def new_forward_state(self) -> WalkState:
        return WalkState()

    def exact_layers(self, n_layers: int, max_positions: int | None) -> frozenset[int]:
        cfg = self.config
        bad = sorted(i for i in cfg.dense_layers if not 0 <= i < n_layers)
        if bad:
            raise ValueError(f"dense_layers: layers {bad} do not exist; the model has layers 0..{n_layers - 1}")
        if max_positions is not None and cfg.block_size > max_positions:
            raise ValueError(f"block_size: {cfg.block_size} is larger than the model's context of "
                             f"{max_positions} tokens")
        return frozenset(cfg.dense_layers)

    def sketch_dim(self, d: int) -> int:
        """m for head dim ``d``: the configured one (at most ``d``), else 64 or ``d`` if smaller."""
        m = self.config.sketch_dim
        if m is None:
            return min(DEFAULT_SKETCH_DIM, d)
        if m > d:
            raise ValueError(f"sketch_dim: m = {m} exceeds the head dim d = {d}; expected m <= d")
        return m

    def _dims(self, d: int, dtype: torch.dtype) -> tuple[torch.dtype, float]:
        """Compute dtype and the sketched-logit scale for head dim ``d``."""
        m = self.sketch_dim(d)
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        scale = 1.0 / math.sqrt(d if self.config.logit_scale == "sqrt_d" else m)
        return compute, scale

    def _phi(self, d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return srht_matrix(d, self.sketch_dim(d), self.config.seed, device=device, dtype=dtype)

    def transition(self, log_a: torch.Tensor) -> torch.Tensor:
        """``Ã`` from ``log Â [B, n, n]`` (full causal square)."""
        cfg = self.config
        if cfg.walk_power == "hadamard":
            return hadamard_power(log_a, cfg.alpha)
        return torch.linalg.matrix_power(torch.exp(log_a), int(cfg.alpha))

    def walk_step(self, previous: torch.Tensor | None, a_tilde: torch.Tensor, times) -> torch.Tensor:
        """The new (row-normalised) walk state from the previous one and this layer's ``Ã``;
        ``times(previous)`` is ``previous · Ã``."""
        mode = self.config.walk
        if previous is None or mode in ("one-hop", "oracle"):
            return normalize_rows(a_tilde)
        if mode == "walk":
            return normalize_rows(times(previous))
        return normalize_rows(previous * a_tilde)

    # -- variant=authors ----------------------------------------------------------------------------------

    @staticmethod
    def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def _authors_phi(self, d: int, device: torch.device, dtype: torch.dtype, forward: WalkState | None
                     ) -> torch.Tensor:
        """This layer's sketch: one per sparse layer (the authors draw one per attention module), told apart by
        the layer's rank among the sparse layers of the forward pass (counted in ``forward``)."""
        ordinal = 0
        if forward is not None:
            ordinal = forward.layer
            forward.layer = ordinal + 1
        return device_sketch(d, self.config.hadamard_dim, derive_seed(self.config.seed, ordinal), torch.device(device),
                             dtype)

    def _authors_backend_reason(self, device: torch.device, backend: str) -> str | None:
        """Why a CUDA call asking for the automatic backend runs the torch reference."""
        if device.type == "cuda" and backend == "auto":
            return ("variant=authors: the Triton selection, decode and block-sparse kernels serve "
                    "variant=reconstruction; the torch reference ran")
        return None

    def _prefill_authors(self, q, k, v, *, scale, state, context, sparse):
        cfg = self.config
        forward = context.forward if context.forward is not None else WalkState()
        b, hq, n_tok, d = q.shape
        dtype = self._compute_dtype(q.dtype)
        bs = cfg.block_size
        path, reason = authors_prefill.prefill_path(cfg.prefill_backend, q, k, v, bs)
        phi = self._authors_phi(d, q.device, dtype, forward)
        if path == "reference":
            a = authors.block_matrix(q, k, phi, bs, causal=cfg.causal, dtype=dtype)
        else:
            a = authors_prefill.block_matrix(q, k, phi, bs, causal=cfg.causal, dtype=dtype)
        state.authors = authors.AuthorsLayerState.from_prompt(phi, a, q, cfg.query_window)
        if not sparse:
            return None, None
        n = a.shape[-1]
        previous = forward.walk
        if previous is not None and (previous.dim() != 3 or previous.shape[0] != b or previous.dtype != a.dtype):
            previous = None  # another request's walk (a forward state reused): start anew
        start = a if previous is None else authors.resized_walk(previous, n)
        w = authors.damped_walk(a, start, a, cfg.walk_damping, cfg.degree)
        forward.walk = w
        forward.hops += 1
        hops = forward.hops
        sel = authors.prefill_selection(w, n_tok, block_size=bs, sink=cfg.sink, window=cfg.window,
                                        kblocks_frac=cfg.kblocks_frac, dense_last_blocks=cfg.dense_last_blocks)
        short = n <= cfg.dense_last_blocks
        scale = scale if scale is not None else d ** -0.5
        extra: dict[str, Any] = {"phase": "prefill", "walk_hops": hops, "variant": "authors",
                                 "selection": "reference" if path == "reference" else "device"}
        if reason is not None:
            extra["backend_reason"] = reason
        if short:
            extra["exact_reason"] = (f"{n} blocks: every query block is among the last dense_last_blocks="
                                     f"{cfg.dense_last_blocks}, which keep every block")
        if path == "reference":
            out, kept, touched = authors.prefill_attention(q, k, v, None if short else sel, block_size=bs,
                                                           scale=scale, dtype=dtype)
            return out.to(q.dtype), authors_prefill.prefill_stats(k, kept, touched, extra, block_size=bs)
        blocks = torch.ones(b, n, n, dtype=torch.bool, device=q.device).tril() if short else sel.blocks
        out, lists = authors_prefill.sparse_attention(q, k, v, blocks, sel.window_tokens, block_size=bs, scale=scale,
                                                      path=path)

        def stats() -> StepStats:  # built when read: its host reads would stall the next layers' launches
            from ...kernels.sketchwalk.authors_prefill import kept_keys

            kept = kept_keys(lists.blocks, lists.window_tokens, n_tokens=n_tok, block_size=bs)
            return authors_prefill.prefill_stats(k, kept, lists.touched, {}, block_size=bs, backend=path)

        return out, StepStats.deferred(stats, path, extra)

    @property
    def graph_capturable(self) -> bool:  # type: ignore[override]
        """variant=authors' batched decode reads nothing on the host (:meth:`_decode_authors_device`); the
        per-row reference (backend=reference) and variant=reconstruction are not declared capturable."""
        return self.config.variant == "authors" and self.config.backend != "reference"

    def _decode_authors(self, inputs: DecodeInputs, state: SketchWalkState):
        """Their decode step: every row at once on the device (one token per batch row; ``Q > 1`` query rows
        per batch row as ``Q`` such steps in order, on the state the steps after them continue), or the
        per-row reference (backend=reference, or query rows whose keys are not a prefix)."""
        if self.config.backend != "reference":
            if inputs.q_len == 1:
                return self._decode_authors_device(inputs, state)
            if inputs.lengths is not None:
                return self._decode_rows_one_by_one(inputs, None, state)
        return self._decode_authors_rows(inputs, state)

    def _authors_layer_state(self, inputs: DecodeInputs, state: SketchWalkState, phi: torch.Tensor
                             ) -> authors.AuthorsLayerState:
        cfg = self.config
        hq, d = inputs.q.shape[1:]
        st = state.authors
        if (not isinstance(st, authors.AuthorsLayerState) or st.queries.shape[:3] != (inputs.cache_batch, hq,
                                                                                   cfg.query_window)
                or st.phi.shape[1] != d or st.phi.dtype != phi.dtype or st.phi.device != phi.device):
            st = authors.AuthorsLayerState.fresh(phi, inputs.cache_batch, hq, cfg.query_window, phi.dtype)
        state.authors = st
        return st

    def _decode_authors_device(self, inputs: DecodeInputs, state: SketchWalkState):
        """Their decode step for every row in one go (:func:`.authors_device.decode_batched`)."""
        phi = self._authors_phi(inputs.q.shape[2], inputs.q.device, self._compute_dtype(inputs.q.dtype),
                                inputs.context.forward)
        return decode_batched(self.config, inputs, state, self._authors_layer_state(inputs, state, phi))

    def _decode_authors_rows(self, inputs: DecodeInputs, state: SketchWalkState):
        """Their decode step, one query row at a time (:func:`.authors_device.decode_rows`)."""
        phi = self._authors_phi(inputs.q.shape[2], inputs.q.device, self._compute_dtype(inputs.q.dtype),
                                inputs.context.forward)
        st = self._authors_layer_state(inputs, state, phi)
        return decode_rows(self.config, inputs, st, self._authors_backend_reason(inputs.q.device, self.config.backend))

    # -- prefill ----------------------------------------------------------------------------------------

    def prefill_selection_path(self, x: torch.Tensor, n_blocks: int) -> tuple[str, str | None]:
        """``(path, reason)`` of the prefill selection for a prompt of ``n_blocks`` blocks on ``x``'s device
        and dtype: ``"triton"`` (:mod:`kvsieve.kernels.sketchwalk.prefill_select`, a handful of launches) or
        ``"reference"`` (the torch functions above); ``reason`` says why the kernels did not run where
        ``backend`` asked for them (None where the reference is the expected path)."""
        cfg = self.config
        if cfg.backend == "reference" or (cfg.backend == "auto" and x.device.type != "cuda"):
            return "reference", None
        if cfg.walk_power == "matrix":
            return "reference", "walk_power=matrix (the kernels compute the element-wise power)"
        from ...kernels.shared.triton_utils import kernels_interpreted
        from ...kernels.sketchwalk.prefill_select import unsupported_reason

        reason = unsupported_reason(n_blocks, x.dtype)
        if reason is None and (x.device.type == "cuda") == kernels_interpreted():
            reason = f"{x.device.type} tensors with TRITON_INTERPRET={int(kernels_interpreted())}"
        return ("reference", reason) if reason is not None else ("triton", None)

    def prefill_sketch(self, q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
        """Block sums, key sketches, ``log Â`` and ``Ã`` of a prompt (q ``[B, Hq, N, d]``, k ``[B, Hkv, N, d]``);
        on the kernel path (:meth:`prefill_selection_path`) without ``log_a``, which only the matrix power needs."""
        cfg = self.config
        b, _, n_tok, d = q.shape
        dtype, logit_scale = self._dims(d, q.dtype)
        bs = cfg.block_size
        n = -(-n_tok // bs)
        phi = self._phi(d, q.device, dtype)
        if self.prefill_selection_path(q, n)[0] == "triton":
            from ...kernels.sketchwalk import prefill_select as kernels

            q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
            return kernels.prefill_sketch(q, k, phi, block_size=bs, logit_scale=logit_scale, alpha=cfg.alpha)
        q_avg = head_mean(q, dtype)
        q_sum = block_sums(q_avg, bs)
        k_sum = block_sums(head_mean(k, dtype), bs)
        q_sketch = block_means(q_sum, n_tok, bs) @ phi.T
        k_sketch = block_means(k_sum, n_tok, bs) @ phi.T
        rows = torch.arange(n, device=q.device)[None].expand(b, n)
        log_a = causal_log_scores(q_sketch, k_sketch, logit_scale, rows)
        return {"q_avg": q_avg, "q_sum": q_sum, "k_sum": k_sum, "k_sketch": k_sketch, "log_a": log_a,
                "a_tilde": self.transition(log_a)}

    def prefill_select(self, a_tilde: torch.Tensor,
                       previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(W, block_idx [B, n, K], block_counts [B, n])`` from this layer's ``Ã`` and the walk so far."""
        cfg = self.config
        b, n, _ = a_tilde.shape
        kmax = max_block_budget(n, cfg.density, fixed_k=cfg.fixed_k)
        if self.prefill_selection_path(a_tilde, n)[0] == "triton" and a_tilde.dtype == torch.float32:
            from ...kernels.sketchwalk import prefill_select as kernels

            mode = "one-hop" if cfg.walk == "oracle" else cfg.walk
            return kernels.prefill_select(a_tilde, previous, mode=mode, density=cfg.density, fixed_k=cfg.fixed_k,
                                          kmax=kmax, tie=TIE_BREAK)
        w = self.walk_step(previous, a_tilde, lambda prev: torch.matmul(prev, a_tilde))
        rank = w + TIE_BREAK * normalize_rows(a_tilde)
        rows = torch.arange(n, device=a_tilde.device)[None].expand(b, n)
        budget = block_budget(rows, cfg.density, fixed_k=cfg.fixed_k, n_blocks=n)
        block_idx, block_counts = select_blocks(rank, rows, budget, kmax)
        return w, block_idx, block_counts

    def prefill(self, q, k, v, *, scale, state, context=NO_CONTEXT, sparse):
        cfg = self.config
        b, hq, n_tok, d = q.shape
        if k.shape[2] != n_tok:
            raise ValueError(f"k: sketchwalk's prefill takes a prompt without past keys (N = {k.shape[2]} keys "
                             f"for {n_tok} queries)")
        state = self.checked_state(state)
        if cfg.variant == "authors":
            return self._prefill_authors(q, k, v, scale=scale, state=state, context=context, sparse=sparse)
        sk = self.prefill_sketch(q, k)
        if sparse and cfg.walk == "oracle":
            sk = dict(sk, a_tilde_select=oracle_block_mass(q, k, scale or d ** -0.5, cfg.block_size))
        state.sketch = LayerSketch(
            q_tok=sk["q_avg"], k_sum=sk["k_sum"], q_sum=sk["q_sum"], k_sketch=sk["k_sketch"],
            a_hat=torch.exp(sk["log_a"]) if cfg.walk_power == "matrix" else None, a_tilde=sk["a_tilde"],
            has_history=True)
        if not sparse:
            return None, None
        forward = context.forward if context.forward is not None else WalkState()
        w, block_idx, block_counts = self.prefill_select(sk.get("a_tilde_select", sk["a_tilde"]), forward.walk)
        forward.walk = w
        forward.hops += 1
        hops = forward.hops
        out, _, backend = block_sparse_prefill(q, k, v, block_idx, block_counts, block_size=cfg.block_size,
                                               scale=scale, backend=cfg.prefill_backend)
        path, reason = self.prefill_selection_path(q, block_counts.shape[1])
        extra = {"selection": path} if reason is None else {"selection": path, "selection_reason": reason}
        stats = self._prefill_stats(k, block_counts, n_tok, backend, hops, extra)
        return out.to(q.dtype), stats

    def _prefill_stats(self, k, block_counts, n_tok, backend, hops, extra) -> StepStats:
        # Built when read: its host reads would wait for this layer's attention, and the next layer's
        # launches would then start on an idle device.
        bs = self.config.block_size
        _, hkv, _, d = k.shape
        n = block_counts.shape[1]
        dev, itemsize = k.device, k.element_size()

        def compute() -> StepStats:
            rows_in = block_token_counts(n_tok, bs, dev).to(torch.float64)  # query rows per block
            kept = block_counts.to(torch.float64)
            causal = torch.arange(1, n + 1, device=dev, dtype=torch.float64)
            # keys each query row reads (its diagonal block causally) and the causal keys it could read
            diag = (rows_in + 1) / 2
            keys_read = ((kept - 1) * bs * rows_in + rows_in * diag).sum(-1)  # [B]
            pairs = n_tok * (n_tok + 1) / 2
            exact = int((block_counts == causal.long()).all(-1).sum())
            per_row = float(keys_read.mean()) / n_tok
            return StepStats(
                n_keys=float(n_tok), k_rows_scored=float(n_tok), v_rows_read=per_row, kv_rows_read=per_row,
                density=float(keys_read.mean()) / pairs, kv_density=float(keys_read.mean()) / pairs,
                bytes_read=int(kept.sum() * bs * hkv * 2 * d * itemsize), backend=backend, exact_rows=exact,
                extra={"block_density": float(kept.sum(-1).mean() / causal.sum()), "blocks_kept": float(kept.mean())})

        return StepStats.deferred(compute, backend, {"phase": "prefill", "walk_hops": hops, **extra})

    # -- decode -----------------------------------------------------------------------------------------

    def _fresh_sketch(self, inputs: DecodeInputs, phi: torch.Tensor, dtype: torch.dtype) -> LayerSketch:
        """Block sums of the keys before each row's new token (no queries of the past are known)."""
        cfg = self.config
        b, hkv, n_tok, d = inputs.k.shape
        before = torch.arange(n_tok, device=inputs.k.device)[None, :] < (inputs.lengths - 1)[:, None]
        k_avg = head_mean(inputs.k, dtype) * before[..., None]
        k_sum = block_sums(k_avg, cfg.block_size)
        counts = torch.clamp((inputs.lengths - 1)[:, None] - torch.arange(k_sum.shape[1], device=k_sum.device)
                             * cfg.block_size, min=1, max=cfg.block_size).to(dtype)
        cap = k_sum.shape[1]
        return LayerSketch(
            q_tok=k_sum.new_zeros(b, n_tok, d), k_sum=k_sum, q_sum=torch.zeros_like(k_sum),
            k_sketch=(k_sum / counts[..., None]) @ phi.T,
            a_hat=k_sum.new_zeros(b, cap, cap) if cfg.walk_power == "matrix" else None,
            a_tilde=k_sum.new_zeros(b, cap, cap), has_history=False)

    def _row_transition(self, sk: LayerSketch, log_row: torch.Tensor, c: torch.Tensor, n: int) -> torch.Tensor:
        """Row ``c`` of ``Ã`` given row ``c`` of ``log Â`` (rows ``< c`` from the cache)."""
        return self._rows_transition(sk, log_row[:, None], c[:, None], n)[:, 0]

    def _decode(self, inputs: DecodeInputs, seed, state: SketchWalkState):
        cfg = self.config
        if inputs.lengths is None:
            raise ValueError("key_mask: sketchwalk needs each row's valid keys to be a prefix [0, length) "
                             "(blocks are positions); left padding is not supported")
        if cfg.variant == "authors":
            return self._decode_authors(inputs, state)
        b, hq, d = inputs.q.shape  # b: query rows (B·Q)
        chunk = inputs.q_len > 1
        n_tok, bs = inputs.n_keys, cfg.block_size
        dtype, logit_scale = self._dims(d, inputs.q.dtype)
        dev = inputs.q.device
        phi = self._phi(d, dev, dtype)
        n = -(-n_tok // bs)
        sk = state.sketch
        if (sk is None or sk.k_sum.shape[0] != inputs.cache_batch or sk.k_sum.shape[2] != d
                or sk.k_sum.dtype != dtype or sk.k_sum.device != dev):
            # a chunk's state starts before its first row's token
            first = torch.arange(inputs.cache_batch, device=dev) * inputs.q_len
            sk = self._fresh_sketch(select_rows(inputs, first) if chunk else inputs, phi, dtype)
        sk.grow(n, n_tok)
        length = inputs.lengths
        forward = inputs.context.forward
        previous = forward.walk if forward is not None else None
        if previous is not None and previous.shape != (b, n):
            previous = None  # another request's or step's walk (a forward state reused): start anew
        kmax = max_block_budget(n, cfg.density, fixed_k=cfg.fixed_k)  # n: blocks of the longest row
        path, reason = choose_sparse_backend(cfg.backend, inputs, bs)
        # The fused selection serves the paper's configuration; the controls that need the full Â row
        # (matrix power) or dense attention (oracle) keep the torch selection before the kernel.
        fused = path == "triton" and cfg.walk_power == "hadamard" and cfg.walk != "oracle" and not chunk
        if fused:
            from ...kernels.sketchwalk.decode import sketch_walk_select

            state.sketch = sk
            self._check_walk_history(previous, sk)
            q, k, _, lens = kernel_operands(inputs)
            w, pages, n_pages = sketch_walk_select(
                q, k, lens, q_tok=sk.q_tok, q_sum=sk.q_sum, k_sum=sk.k_sum, k_sketch=sk.k_sketch,
                a_tilde=sk.a_tilde, phi=phi, n_blocks=n, block_size=bs, logit_scale=logit_scale,
                alpha=cfg.alpha, mode=cfg.walk, previous=previous, density=cfg.density, fixed_k=cfg.fixed_k,
                kmax=kmax, tie=TIE_BREAK)

            def selection():  # for the stats only: a captured step launches none of it
                c = torch.div(length - 1, bs, rounding_mode="floor")
                return pages[:, 0].long(), n_pages[:, 0].long(), c
        else:
            select = self._select_reference_rows if chunk else self._select_reference
            w, blocks, counts, c = select(inputs, sk, phi, dtype, logit_scale, previous, kmax, state)
            pages = n_pages = None

            def selection():
                return blocks, counts, c
        hops = 1
        if forward is not None:
            hops = forward.hops + 1 if previous is not None else 1
            forward.walk, forward.hops = w, hops

        # Block-granular token lists: every used block but the last (the current one) is complete, so
        # the valid positions form a prefix of the list.
        def token_lists():
            blocks, counts, _ = selection()
            tokens = (blocks[..., None] * bs + torch.arange(bs, device=dev)).reshape(b, -1)
            used = (torch.arange(kmax, device=dev) < counts[:, None]).repeat_interleave(bs, dim=1)
            return tokens, used & (tokens < length[:, None])

        if path == "triton":  # the blocks are pages of the weighted sparse kernel; lengths mask the partial one
            from ...kernels.shared.weighted_triton import sparse_decode_triton

            q, k, v, lens = kernel_operands(inputs)
            if pages is None:
                pages = blocks[:, None, :].expand(b, inputs.kv_heads, kmax).to(torch.int32).contiguous()
                n_pages = counts[:, None].expand(b, inputs.kv_heads).to(torch.int32).contiguous()
            if chunk:  # the Q rows of a batch row read its cache (no per-row copy of K/V)
                k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (inputs.cache_k, inputs.cache_v))
            out, _ = sparse_decode_triton(q, k, v, pages, n_pages, page_size=bs, lengths=lens, scale=inputs.scale,
                                          rows_per_batch=inputs.q_len)
        else:
            tokens, valid = token_lists()
            idx = torch.where(valid, tokens, 0)[:, None].expand(b, inputs.kv_heads, -1)
            out, _ = weighted_sparse_decode(inputs.q, inputs.k, inputs.v, idx,
                                            valid.sum(-1)[:, None].expand(b, inputs.kv_heads), None,
                                            scale=inputs.scale, check=False)
        extra = {"phase": "decode", "walk_hops": hops}
        if reason is not None:
            extra["backend_reason"] = reason
        if fused:
            extra["selection"] = "fused"
        elif chunk:
            extra["selection"] = "reference"  # the torch selection of Q rows per batch row, whatever the attention

        def stats():  # built when read: a captured step (nobody reads it) launches none of this
            _, counts, c = selection()
            tokens, valid = token_lists()
            v_read = torch.zeros(b, n_tok + 1, dtype=torch.bool, device=dev)
            v_read.scatter_(1, torch.where(valid, tokens, n_tok), True)  # unused entries land in the spare column
            v_read = v_read[:, None, :n_tok].expand(b, hq, n_tok).contiguous()
            more = {"block_density": (counts / (c + 1)).to(torch.float64).mean(),
                    "blocks_kept": counts.to(torch.float64).mean()}
            # The sketches read no K rows beyond the new token's; attention reads the selected rows.
            return read_stats(inputs, v_read, k_scored=valid.sum(-1)[:, None].expand(b, inputs.kv_heads),
                              exact_rows=(counts == c + 1).sum(), backend=path, extra=more)

        stats = StepStats.deferred(stats, path, extra)
        return out, stats

    def _check_walk_history(self, previous: torch.Tensor | None, sk: LayerSketch) -> None:
        if previous is not None and self.config.walk == "walk" and not sk.has_history:
            raise ValueError("sketchwalk: the walk needs the prompt's block sketches; run the prompt inside "
                             "the sparsify block (its prefill records them) or use walk=one-hop")

    def _select_reference(self, inputs: DecodeInputs, sk: LayerSketch, phi: torch.Tensor, dtype: torch.dtype,
                          logit_scale: float, previous: torch.Tensor | None, kmax: int, state: SketchWalkState):
        """The spec's decode step in torch: the state update, the token's row of Ã, the walk and the
        selection. Returns ``(w [B, n], blocks [B, kmax], counts [B], c [B])``."""
        cfg = self.config
        b, _, d = inputs.q.shape
        n_tok, bs = inputs.n_keys, cfg.block_size
        dev = inputs.q.device
        n = -(-n_tok // bs)
        length = inputs.lengths
        pos = length - 1  # the new token of each row
        c = torch.div(pos, bs, rounding_mode="floor")  # its (current, possibly partial) block
        batch = torch.arange(b, device=dev)
        q_new = inputs.q.to(dtype).mean(1)
        sk.q_tok[batch, pos] = q_new
        # Block c from its tokens so far (queries kept, keys from the cache): recomputed, not accumulated.
        tok = c[:, None] * bs + torch.arange(bs, device=dev)  # [B, bs]
        seen = (tok <= pos[:, None]).to(dtype)[..., None]
        q_rows = sk.q_tok.gather(1, tok.clamp(max=sk.q_tok.shape[1] - 1)[..., None].expand(b, bs, d))
        k_rows = inputs.k.gather(2, tok.clamp(max=n_tok - 1)[:, None, :, None].expand(b, inputs.kv_heads, bs, d))
        sk.q_sum[batch, c] = (q_rows * seen).sum(1)
        sk.k_sum[batch, c] = (head_mean(k_rows, dtype) * seen).sum(1)
        in_block = (pos - c * bs + 1).to(dtype)[:, None]  # tokens of block c so far
        sk.k_sketch[batch, c] = (sk.k_sum[batch, c] / in_block) @ phi.T
        k_sketch = sk.k_sketch[:, :n]
        # Block c completed with this token: its row of Â/Ã is final from now on.
        complete = pos - c * bs + 1 == bs
        q_block = ((sk.q_sum[batch, c] / in_block) @ phi.T)[:, None]
        log_block = causal_log_scores(q_block, k_sketch, logit_scale, c[:, None])[:, 0]
        if cfg.walk_power == "matrix":
            old = sk.a_hat[batch, c, :n]
            sk.a_hat[batch, c, :n] = torch.where(complete[:, None], torch.exp(log_block), old)
        row_block = self._row_transition(sk, log_block, c, n)
        sk.a_tilde[batch, c, :n] = torch.where(complete[:, None], row_block, sk.a_tilde[batch, c, :n])
        state.sketch = sk
        # The token's own row, and the walk over this forward pass's layers.
        log_token = causal_log_scores((q_new @ phi.T)[:, None], k_sketch, logit_scale, c[:, None])[:, 0]
        a_token = self._row_transition(sk, log_token, c, n)
        if cfg.walk == "oracle":
            probs = inputs.probs(dtype).mean(1)  # [B, N]: exact attention mass, head-averaged
            a_token = block_sums(probs[..., None], bs)[..., 0]
        self._check_walk_history(previous, sk)
        w = self.walk_step(previous, a_token, lambda prev: times_with_row(prev, sk.a_tilde[:, :n, :n], a_token, c))
        rank = w + TIE_BREAK * normalize_rows(a_token)
        budget = block_budget(c, cfg.density, fixed_k=cfg.fixed_k, n_blocks=n)  # n: blocks of the longest row
        blocks, counts = select_blocks(rank[:, None], c[:, None], budget[:, None], kmax)
        return w, blocks[:, 0], counts[:, 0], c

    def _rows_transition(self, sk: LayerSketch, log_rows: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
        """:meth:`_row_transition` for ``Q`` rows per batch row: ``log_rows [B, Q, n]``, ``rows [B, Q]``."""
        cfg = self.config
        if cfg.walk_power == "hadamard":
            return hadamard_power(log_rows, cfg.alpha)
        a_rows = torch.exp(log_rows)
        x = a_rows
        for _ in range(int(cfg.alpha) - 1):
            x = times_with_rows(x, sk.a_hat[:, :n, :n], a_rows, rows)
        return x

    def _select_reference_rows(self, inputs: DecodeInputs, sk: LayerSketch, phi: torch.Tensor, dtype: torch.dtype,
                               logit_scale: float, previous: torch.Tensor | None, kmax: int, state: SketchWalkState):
        """:meth:`_select_reference` for ``Q > 1`` query rows per batch row (positions ``p .. p+Q−1``), in
        torch: the state as the ``Q`` single-token steps leave it, and each row's Ã row, walk and selection
        as its own step computes them — its block's key sketch from its keys so far, the Ã rows of the
        blocks completed before it (in this chunk too), the previous layer's walk of the same row.
        Returns ``(w [R, n], blocks [R, kmax], counts [R], c [R])`` for the ``R = B·Q`` rows."""
        cfg = self.config
        r_rows, _, d = inputs.q.shape
        bq, ql = inputs.cache_batch, inputs.q_len
        n_tok, bs = inputs.n_keys, cfg.block_size
        dev = inputs.q.device
        n = -(-n_tok // bs)
        m = phi.shape[0]
        pos = inputs.lengths.long() - 1  # [R] each row's token (consecutive within a batch row)
        c = torch.div(pos, bs, rounding_mode="floor")
        brow = inputs.batch_row()
        q_new = inputs.q.to(dtype).mean(1)  # [R, d]
        sk.q_tok[brow, pos] = q_new
        # Each row's block so far, as its own step recomputes it (queries kept, keys from the cache).
        tok = c[:, None] * bs + torch.arange(bs, device=dev)  # [R, bs]
        seen = (tok <= pos[:, None]).to(dtype)[..., None]
        q_rows = sk.q_tok[brow[:, None], tok.clamp(max=sk.q_tok.shape[1] - 1)]  # [R, bs, d]
        k_rows = inputs.cache_k[brow[:, None], :, tok.clamp(max=n_tok - 1)]  # [R, bs, Hkv, d]
        q_part = (q_rows * seen).sum(1)
        k_part = (k_rows.to(dtype).mean(2) * seen).sum(1)
        in_block = (pos - c * bs + 1).to(dtype)[:, None]
        k_sketch_part = (k_part / in_block) @ phi.T  # [R, m]: block c's key sketch as row r sees it
        # The state: each block the chunk touches takes the sums of its last row in the chunk. Per batch
        # row the blocks are first_c + i, i < nb (host bound), clamped to the last one (a repeated write of
        # the same values).
        pos2, c2 = pos.view(bq, ql), c.view(bq, ql)
        nb = (ql - 1) // bs + 2
        batch = torch.arange(bq, device=dev)[:, None]
        blk = torch.minimum(c2[:, :1] + torch.arange(nb, device=dev), c2[:, -1:])  # [B, nb]
        end = torch.minimum(blk * bs + bs - 1, pos2[:, -1:])  # the block's last token in the chunk
        last = batch * ql + (end - pos2[:, :1])  # [B, nb] its row
        sk.q_sum[batch, blk] = q_part[last]
        sk.k_sum[batch, blk] = k_part[last]
        sk.k_sketch[batch, blk] = k_sketch_part[last]
        k_sketch = sk.k_sketch[:, :n]
        # Blocks completed in the chunk: their rows of Â/Ã are final (Â first: the matrix power reads the
        # rows of the blocks before, which may have completed in this chunk too).
        complete = (end == blk * bs + bs - 1)[..., None]
        q_block = (q_part[last] / in_block[last]) @ phi.T  # [B, nb, m]
        log_block = causal_log_scores(q_block, k_sketch, logit_scale, blk)
        if cfg.walk_power == "matrix":
            sk.a_hat[batch, blk, :n] = torch.where(complete, torch.exp(log_block), sk.a_hat[batch, blk, :n])
        row_block = self._rows_transition(sk, log_block, blk, n)
        sk.a_tilde[batch, blk, :n] = torch.where(complete, row_block, sk.a_tilde[batch, blk, :n])
        state.sketch = sk
        # Each row's own row of Â: the final key sketches before its block, its own sketch of the block.
        q_sketch = q_new @ phi.T  # [R, m]
        logits = torch.matmul(q_sketch.view(bq, ql, m), k_sketch.transpose(-1, -2)).view(r_rows, n) * logit_scale
        own = (q_sketch * k_sketch_part).sum(-1, keepdim=True) * logit_scale
        logits = logits.scatter(1, c[:, None], own)
        cols = torch.arange(n, device=dev)
        log_token = torch.log_softmax(logits.masked_fill(cols > c[:, None], float("-inf")), dim=-1)
        a_token = self._rows_transition(sk, log_token.view(bq, ql, n), c2, n).view(r_rows, n)
        if cfg.walk == "oracle":
            probs = inputs.probs(dtype).mean(1)  # [R, N]: exact attention mass, head-averaged
            a_token = block_sums(probs[..., None], bs)[..., 0]
        self._check_walk_history(previous, sk)

        def times(prev: torch.Tensor) -> torch.Tensor:
            return times_with_rows(prev.view(bq, ql, n), sk.a_tilde[:, :n, :n], a_token.view(bq, ql, n),
                                   c2).view(r_rows, n)

        w = self.walk_step(previous, a_token, times)
        rank = w + TIE_BREAK * normalize_rows(a_token)
        # fixed_k: row j's context is the cache its own step would hold, N − Q + 1 + j keys
        j = torch.arange(r_rows, device=dev) % ql
        n_rows = torch.div(n_tok - ql + 1 + j + bs - 1, bs, rounding_mode="floor")
        budget = block_budget(c, cfg.density, fixed_k=cfg.fixed_k, n_blocks=n_rows)
        blocks, counts = select_blocks(rank[:, None], c[:, None], budget[:, None], kmax)
        return w, blocks[:, 0], counts[:, 0], c
