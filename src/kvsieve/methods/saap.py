"""``saap``: Self-Attention with Asymmetric Partitions (Mazaré et al., FAIR 2025), and its baselines.

Offline (``kvsieve fit saap``, :mod:`kvsieve.fit.saap`), per layer >= 1 and KV head: spherical
k-means of the pre-RoPE keys into ``C`` buckets, and a query classifier (Linear → BatchNorm → ReLU →
Linear → softmax) trained to predict which buckets hold a query's attention mass. Online, after
prefill: the keys outside the dense part (sink + recent window) are de-roped, assigned to their
nearest centroid and listed per bucket (CSR, :mod:`kvsieve.kernels.saap.buckets`); each decode
step de-ropes the queries of a GQA group, sums the classifier's probabilities over the group, and
attends exactly over every key of the ``probes`` best buckets plus the dense part, the two partial
attentions merged by log-sum-exp. Layer 0 runs exact attention (the paper's Fig. 3).

Registered here:

- ``saap``: the classifier (asymmetric partition), the paper's method;
- ``saap-kmeans``: the same index, queries probing their nearest centroids (k-means without RoPE);
- ``saap-kmeans-roped``: k-means fitted on post-RoPE keys, post-RoPE queries probe nearest centroids;
- ``probes=0`` of any of them is StreamingLLM (sink + window only).

The artifacts (one directory: ``manifest.json`` + ``layer_XX.safetensors``) name the model they were
fitted on; :meth:`Saap.check_model` (called by ``kvsieve.sparsify``) refuses another model. The layer a
call serves comes from ``context.layer``, which the model drivers set. Every decision the paper leaves
open is recorded in ``docs/methods/saap.md``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from ..core.config import MethodConfig, param, require_choice, require_int
from ..core.context import MethodState
from ..core.inputs import DecodeInputs
from ..core.method import Method, read_stats
from ..core.registry import register_method
from ..core.stats import StepStats
from ..core.sync import host_reads_allowed
from ..kernels.saap.buckets import bucket_sparse_decode_triton, build_csr, fused_merge_default
from ..kernels.saap.index import (
    UPDATE_SPAN,
    assign_tail_parallel_triton,
    assign_tail_reference,
    assign_tail_triton,
    build_assign,
    index_decode_reference,
    index_read_mask,
    parallel_update,
    tail_end,
)
from .shared.exact import compute_dtype, exact_attention

ARTIFACT_FORMAT = "kvsieve-saap/1"
MANIFEST = "manifest.json"

# ---- RoPE ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rope:
    """The model's rotary embedding in transformers' ``rotate_half`` layout.

    ``inv_freq [d/2]`` and ``attention_scaling`` are what the model's rotary module computed (so any
    static scaling, llama3 or YaRN, is included): ``cos = cos(p·f)·a``, ``sin = sin(p·f)·a``, and
    ``rope(x, p) = x·cos + rotate_half(x)·sin`` is ``a`` times a rotation. Its inverse is
    ``derope(y, p) = (y·cos − rotate_half(y)·sin) / a²``.
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    # inv_freq per device, copied once: a host-to-device copy per call would synchronise a decode step
    _on_device: dict = field(default_factory=dict, compare=False, repr=False)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = self.inv_freq.to(device=device, dtype=torch.float32)
        return self._on_device[key]

    def cos_sin(self, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # The same float32 arithmetic as the model's rotary module, so that de-roping undoes it exactly.
        freqs = positions[..., None].float() * self.inv_freq_on(device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [..., N, d]`` at ``positions`` (broadcastable to ``[..., N]``), in float32 or x's dtype if wider."""
        cos, sin = self.cos_sin(positions, x.device)
        dtype = torch.promote_types(x.dtype, torch.float32)
        x = x.to(dtype)
        return x * cos.to(dtype) + _rotate_half(x) * sin.to(dtype)

    def invert(self, y: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The pre-RoPE vector of ``y [..., N, d]`` seen at ``positions``."""
        cos, sin = self.cos_sin(positions, y.device)
        dtype = torch.promote_types(y.dtype, torch.float32)
        y = y.to(dtype)
        return (y * cos.to(dtype) - _rotate_half(y) * sin.to(dtype)) / (self.attention_scaling ** 2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def model_rope(model: torch.nn.Module) -> Rope:
    """The :class:`Rope` of a transformers model (its ``rotary_emb`` module)."""
    rotary = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
    rot = rotary[0] if rotary else None
    # A model with sliding-window and full-attention layers (Gemma 3) keeps one set of frequencies per layer
    # type; SAAP serves its full-attention layers (the sliding ones run exact window attention).
    prefix = "" if hasattr(rot, "inv_freq") else "full_attention_" if hasattr(rot, "full_attention_inv_freq") \
        else None
    if prefix is None:
        raise ValueError(f"model: {type(model).__name__} has no rotary_emb module with inv_freq; SAAP "
                         "needs a RoPE model (Llama, Qwen, Mistral, Gemma 3 families)")
    rope_type = getattr(rot, "rope_type", "default")
    if isinstance(rope_type, dict):
        rope_type = rope_type.get("full_attention", "default")
    if "dynamic" in str(rope_type):
        raise ValueError(f"model: rope type {rope_type!r} changes with the context length; SAAP de-ropes "
                         "with fixed frequencies and supports static RoPE types only")
    return Rope(getattr(rot, f"{prefix}inv_freq").detach().float().cpu().clone(),
                float(getattr(rot, f"{prefix}attention_scaling", 1.0)))


def full_attention_layers(model: torch.nn.Module) -> list[int] | None:
    """The full-attention layers of a model whose config lists ``layer_types`` with sliding-window layers
    (Gemma 3), else None (every layer attends to the whole context)."""
    types = getattr(model.config, "layer_types", None)
    if not types or all(t == "full_attention" for t in types):
        return None
    return [i for i, t in enumerate(types) if t == "full_attention"]


# ---- model identity --------------------------------------------------------------------------------

_IDENTITY_KEYS = (
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
)


def config_hash(config: Any) -> str:
    """sha256 (16 hex digits) of the architecture fields of a transformers config."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    picked = {key: d.get(key) for key in _IDENTITY_KEYS}
    text = json.dumps(picked, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def weights_fingerprint(model: torch.nn.Module, *, rounded: bool = True) -> str:
    """sha256 (16 hex digits) of the first attention layer's key projection: tells two checkpoints of
    one architecture apart (a fine-tune shares the config hash). The weights are rounded to bfloat16 first,
    so one checkpoint loaded in float32 (as the fit loads it) or in bfloat16 (as a GPU run does) has one
    fingerprint; ``rounded=False`` hashes the float32 values as loaded (what older artifacts recorded)."""
    for name, p in model.named_parameters():
        if name.endswith("k_proj.weight"):
            if hasattr(p, "full_tensor"):  # a tensor-parallel shard: the whole weight (every rank calls this)
                p = p.full_tensor()
            w = p.detach().to(torch.bfloat16) if rounded else p.detach()
            data = w.float().cpu().contiguous().numpy().tobytes()
            return hashlib.sha256(data).hexdigest()[:16]
    raise ValueError(f"model: no k_proj.weight parameter in {type(model).__name__}")


def model_shape(model: torch.nn.Module) -> dict[str, int]:
    cfg = model.config
    hq = cfg.num_attention_heads
    return {
        "layers": int(cfg.num_hidden_layers),
        "heads": int(hq),
        "kv_heads": int(getattr(cfg, "num_key_value_heads", None) or hq),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq),
    }


# ---- the query classifier --------------------------------------------------------------------------


class QueryClassifier(torch.nn.Module):
    """``M`` independent MLPs ``Linear(d→H) → BatchNorm(H) → ReLU → Linear(H→C)`` run as one batch.

    ``forward(x [M, R, d]) -> logits [M, R, C]``; model ``m`` sees only ``x[m]``. One model per KV head
    (``M = Hkv``) or per query head (``M = Hq``) of a layer.
    """

    def __init__(self, models: int, dim: int, hidden: int, buckets: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(models, dim, hidden) / math.sqrt(dim))
        self.b1 = torch.nn.Parameter(torch.zeros(models, hidden))
        self.norm = torch.nn.BatchNorm1d(models * hidden)
        self.w2 = torch.nn.Parameter(torch.randn(models, hidden, buckets) / math.sqrt(hidden))
        self.b2 = torch.nn.Parameter(torch.zeros(models, buckets))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, r, _ = x.shape
        h = torch.baddbmm(self.b1[:, None, :], x, self.w1)  # [M, R, H]
        # BatchNorm statistics per (model, hidden unit) over that model's rows.
        h = self.norm(h.transpose(0, 1).reshape(r, -1)).view(r, m, -1).transpose(0, 1)
        return torch.baddbmm(self.b2[:, None, :], torch.relu(h), self.w2)


# ---- artifacts -------------------------------------------------------------------------------------


@dataclass
class SaapArtifacts:
    """A loaded ``kvsieve fit saap`` directory. ``layers[l]`` holds that layer's tensors:
    ``centroids [Hkv, C, d]`` (unit norm, pre-RoPE keys), ``centroids_roped [Hkv, C, d]`` and the
    classifier's state dict (``classifier.*``)."""

    path: Path
    manifest: dict[str, Any]
    layers: dict[int, dict[str, torch.Tensor]]
    rope: Rope
    _classifiers: dict[tuple[int, str], QueryClassifier] = field(default_factory=dict, repr=False)
    _tensors: dict[tuple[int, str, str], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def buckets(self) -> int:
        return int(self.manifest["hyperparameters"]["clusters"])

    @property
    def shape(self) -> dict[str, int]:
        return self.manifest["model"]["shape"]

    def for_heads(self, kv_offset: int, kv_heads: int) -> SaapArtifacts:
        """These artifacts for the KV heads ``[kv_offset, kv_offset + kv_heads)`` and their query heads (a
        tensor-parallel rank's): the centroids of those KV heads and the classifiers of those KV heads (or of
        their query heads, for classifiers per query head), with the shape the rank sees."""
        shape = self.shape
        group = shape["heads"] // shape["kv_heads"]
        layers = {}
        for layer, tensors in self.layers.items():
            models = tensors["classifier.w1"].shape[0]
            per = group if models == shape["heads"] else 1  # models per KV head
            lo, n = kv_offset * per, kv_heads * per
            hidden = tensors["classifier.w1"].shape[-1]
            out = {}
            for name, t in tensors.items():
                if name.startswith("centroids"):
                    out[name] = t[kv_offset:kv_offset + kv_heads].contiguous()
                elif name.startswith("classifier.norm.") and t.dim() == 1:  # BatchNorm over (model, unit)
                    out[name] = t[lo * hidden:(lo + n) * hidden].contiguous()
                elif name.startswith("classifier.") and t.dim() >= 1 and t.shape[0] == models:
                    out[name] = t[lo:lo + n].contiguous()
                else:  # BatchNorm's batch count
                    out[name] = t
            layers[layer] = out
        model = {**self.manifest["model"], "shape": {**shape, "heads": kv_heads * group, "kv_heads": kv_heads}}
        return SaapArtifacts(self.path, {**self.manifest, "model": model}, layers, self.rope)

    def on_device(self, layer: int, name: str, device: torch.device) -> torch.Tensor:
        """A layer's tensor on ``device``, copied once (weights, not request state)."""
        key = (layer, name, str(device))
        if key not in self._tensors:
            self._tensors[key] = self.layers[layer][name].to(device)
        return self._tensors[key]

    def classifier(self, layer: int, device: torch.device) -> QueryClassifier:
        """The layer's classifier in eval mode on ``device`` (built once per device: weights, not
        request state)."""
        key = (layer, str(device))
        if key not in self._classifiers:
            hp = self.manifest["hyperparameters"]
            tensors = self.layers[layer]
            models = tensors["classifier.w1"].shape[0]
            net = QueryClassifier(models, self.shape["head_dim"], int(hp["hidden"]), self.buckets)
            net.load_state_dict({k.removeprefix("classifier."): v for k, v in tensors.items()
                                 if k.startswith("classifier.")})
            self._classifiers[key] = net.to(device).eval()
        return self._classifiers[key]

    def probe_weights(self, layer: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The layer's classifier as decoding reads it: BatchNorm folded into the first map, the two weight
        matrices rounded to bfloat16 (:func:`kvsieve.kernels.saap.probe.serve_weights`), on ``device``
        (built once per device). Both the Triton probe and the torch path score with these tensors."""
        key = (layer, "probe", str(device))
        if key not in self._tensors:
            from ..kernels.saap.probe import fold_batchnorm, serve_weights

            net = self.classifier(layer, device)
            self._tensors[key] = serve_weights(*fold_batchnorm(
                net.w1, net.b1, net.w2, net.b2, net.norm.running_mean, net.norm.running_var, net.norm.weight,
                net.norm.bias, net.norm.eps))
        return self._tensors[key]


def load_artifacts(path: str | Path, *, allow_incomplete: bool = False) -> SaapArtifacts:
    """Read a SAAP artifact directory (cached per path and manifest modification time). Studies may
    read the finished layers of a fit still running (``allow_incomplete``); the method never does."""
    p = Path(path).expanduser()
    manifest_file = p / MANIFEST
    if not manifest_file.is_file():
        raise ValueError(f"artifacts: {str(p)!r} is not a SAAP artifact directory (no {MANIFEST}); "
                         "create one with `kvsieve fit saap --out DIR`")
    return _load_artifacts(str(p.resolve()), manifest_file.stat().st_mtime_ns, allow_incomplete)


@lru_cache(maxsize=4)
def _load_artifacts(path: str, mtime: int, allow_incomplete: bool = False) -> SaapArtifacts:
    from safetensors.torch import load_file

    p = Path(path)
    manifest = json.loads((p / MANIFEST).read_text())
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise ValueError(f"artifacts: {path} has format {manifest.get('format')!r}, expected {ARTIFACT_FORMAT!r}")
    if not manifest.get("complete") and not allow_incomplete:
        raise ValueError(f"artifacts: the fit in {path} is incomplete (layers done: "
                         f"{manifest.get('layers_done')}); resume it with the same `kvsieve fit saap` command")
    layers = {}
    for layer in manifest["layers_done"]:
        file = p / f"layer_{layer:03d}.safetensors"
        if not file.is_file():
            raise ValueError(f"artifacts: {file} is missing although the manifest lists layer {layer}")
        layers[int(layer)] = load_file(str(file))
    rope = manifest["rope"]
    return SaapArtifacts(p, manifest, layers, Rope(torch.tensor(rope["inv_freq"], dtype=torch.float32),
                                                   float(rope["attention_scaling"])))


# ---- the method ------------------------------------------------------------------------------------


def effective_window(n_keys: int, window: int, window_scale: float, window_min: int) -> int:
    """The recent-window size for a cache of ``n_keys``: ``min(window, max(window_min, ⌊n·scale⌋))``.

    The paper's 1 + 2047 is for 100k–500k tokens (≤ 2% of the context); a fixed 2047 would cover a
    whole 2k context. Scaled by 1/16, the window reaches 2047 at 32k and is 256 at 4k.
    """
    return min(window, max(window_min, int(n_keys * window_scale)))


@dataclass(frozen=True)
class SaapConfig(MethodConfig):
    artifacts: str = param("", "directory written by `kvsieve fit saap` (required)")
    probes: int | None = param(None, "buckets visited per KV head (ℓ); none: C/32, the paper's 32 of 1024; "
                                     "0 = StreamingLLM")
    sink: int = param(1, "first keys always attended exactly (the paper: 1)")
    window: int = param(2047, "largest recent window attended exactly (the paper: 2047)")
    window_scale: float = param(0.0625, "recent window = min(window, max(window_min, context · window_scale))")
    window_min: int = param(63, "smallest recent window (the paper's smallest ablation: 1 + 63)")
    probing: Literal["batched", "independent"] = param(
        "batched", "batched: one bucket ranking per KV head from the group's summed scores (the paper); "
                   "independent: each query head ranks its own")
    index_update: Literal["step", "ahead"] = param(
        "ahead", "Triton path: step: the keys leaving the window join their buckets in the probe's first launch, "
                "before the attention; ahead: one step early, in the bucket attention's launch (off the critical "
                "path; needs min(window, window_min) >= 4, else step)")
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the Triton bucket kernel on CUDA (batched probing), else the torch reference")

    def __post_init__(self) -> None:
        if not isinstance(self.artifacts, str):
            raise ValueError(f"artifacts: expected a directory path, got {self.artifacts!r}")
        if self.probes is not None:
            require_int("probes", self.probes, minimum=0)
        require_int("sink", self.sink, minimum=0)
        require_int("window", self.window, minimum=0)
        require_int("window_min", self.window_min, minimum=0)
        if isinstance(self.window_scale, bool) or not isinstance(self.window_scale, (int, float)) \
                or not 0 <= self.window_scale <= 1:
            raise ValueError(f"window_scale: expected a number in [0, 1], got {self.window_scale!r}")
        if self.sink + max(self.window, self.window_min) < 1:
            raise ValueError("sink, window: the dense part needs at least one key (sink + window >= 1)")
        require_choice("probing", self.probing, ("batched", "independent"))
        require_choice("backend", self.backend, ("auto", "reference", "triton"))
        require_choice("index_update", self.index_update, ("step", "ahead"))
        if self.backend == "triton" and self.probing != "batched":
            raise ValueError("backend: the triton kernel probes per KV head; use probing=batched or backend=reference")


@dataclass
class SaapIndex:
    """One layer's key index for a request, in buffers sized once (:mod:`kvsieve.kernels.saap.index`):
    ``assign [B, Hkv, A]`` the bucket of each position (``C``: not indexed; ``A`` the cache capacity when
    the caller owns one), the build's CSR lists (``offsets``/``ids``) of the positions ``[sink, tail_lo_b)``,
    each row's window ``window [B]`` (fixed at the build) and ``done [B]``, the end of the positions
    assigned so far (kept where the host may read it, to refuse a jump the update would not cover); ``sink``
    the sink's positions and ``sink_counts`` its size per (row, KV head), read by the kernel. ``n_keys``: K's
    length at the last call (host), which bounds the next step's update."""

    batch: int
    n_keys: int
    window: torch.Tensor
    tail_lo: torch.Tensor
    done: torch.Tensor
    offsets: torch.Tensor
    ids: torch.Tensor
    assign: torch.Tensor
    sink_ids: torch.Tensor
    sink_counts: torch.Tensor


class IndexUpdate(NamedTuple):
    """The arguments of :func:`~kvsieve.kernels.saap.index.assign_tail_reference` (in its order) that bring a
    layer's index up to date: the keys that left the window since the last call join their buckets."""

    assign: torch.Tensor
    k: torch.Tensor
    tail_lo: torch.Tensor
    lengths: torch.Tensor
    window: torch.Tensor
    span: int
    centroids: torch.Tensor
    inv_freq: torch.Tensor | None
    scaling: float


@dataclass
class SaapState(MethodState):
    """SAAP's per-(request, layer) state: the key index, built at the first decode call after prefill; keys
    join their buckets as they leave the window."""

    index: SaapIndex | None = None


@register_method
class Saap(Method):
    name = "saap"
    contract_tested_in = ("tests/test_saap.py: decoding needs fitted artifacts for the model's shape and the "
                          "layer index from the session; test_saap.py writes such artifacts and checks exactness "
                          "at probes = C, streaming at probes = 0, GQA probing, stats and bad input")
    config_class = SaapConfig
    summary = ("SAAP: sink + window + every key of the buckets a trained query classifier ranks best "
               "(needs `kvsieve fit saap`)")
    #: How queries rank buckets: the classifier, or inner products with the key centroids.
    query_scoring: str = "classifier"
    #: Whether keys and queries are compared after RoPE (the roped k-means baseline).
    roped: bool = False
    needs_fit = True
    #: The step updates the index in place with fixed shapes and reads nothing on the host (the Triton path
    #: on CUDA; the torch path too): the runtime captures it.
    graph_capturable = True
    prefix_only_note = "the window and the buckets' positions are cache positions"

    def new_state(self) -> SaapState:
        return SaapState()

    def __init__(self, config: SaapConfig | None = None) -> None:
        super().__init__(config)
        if not self.config.artifacts:
            raise ValueError(f"{self.name}: artifacts: expected the directory written by `kvsieve fit saap --out "
                             f"DIR`, e.g. --method {self.name}:artifacts=DIR (kvsieve.method('{self.name}:"
                             "artifacts=DIR') in Python)")
        self.artifacts = load_artifacts(self.config.artifacts)
        c = self.artifacts.buckets
        self.probes = c // 32 if self.config.probes is None else self.config.probes
        if self.probes > c:
            raise ValueError(f"probes: expected at most C = {c} (the buckets of {self.config.artifacts}), "
                             f"got {self.probes}")

    def use_local_heads(self, kv_offset: int, kv_heads: int) -> str:
        """Serve a tensor-parallel rank holding the KV heads ``[kv_offset, kv_offset + kv_heads)`` (and their
        query heads): the artifacts sliced to them. The method is per KV head (the index, the probe's group
        sum) and per query head (the classifier) already, so the rank selects what one process selects for
        those heads."""
        self.artifacts = self.artifacts.for_heads(kv_offset, kv_heads)
        return (f"{self.name}: centroids and classifiers sliced to this rank's KV heads [{kv_offset}, "
                f"{kv_offset + kv_heads}): the same buckets as one process for those heads")

    # -- model identity ------------------------------------------------------------------------

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise ValueError unless ``model`` is the model the artifacts were fitted on."""
        want = self.artifacts.manifest["model"]
        got_shape = model_shape(model)
        if got_shape != want["shape"]:
            raise ValueError(f"artifacts: {self.config.artifacts} were fitted for the model shape {want['shape']} "
                             f"({want['name']!r}); this model's shape is {got_shape}. Fit SAAP for this model with "
                             "`kvsieve fit saap --model ...`")
        got_hash, got_fp = config_hash(model.config), weights_fingerprint(model)
        # artifacts that recorded the unrounded weights: their fingerprint, hashed only where the rounded one differs
        same_weights = (want["weights_fingerprint"] == got_fp
                        or want["weights_fingerprint"] == weights_fingerprint(model, rounded=False))
        if got_hash != want["config_hash"] or not same_weights:
            raise ValueError(
                f"artifacts: {self.config.artifacts} were fitted on {want['name']!r} (config hash "
                f"{want['config_hash']}, weights {want['weights_fingerprint']}); this model has config hash "
                f"{got_hash}, weights {got_fp}. Fit SAAP for this model with `kvsieve fit saap --model ...`")

    def _check_shapes(self, inputs: DecodeInputs, layer: int) -> None:
        s = self.artifacts.shape
        got = (inputs.heads, inputs.kv_heads, inputs.q.shape[-1])
        if got != (s["heads"], s["kv_heads"], s["head_dim"]):
            raise ValueError(f"q, k: {got[0]} query heads, {got[1]} KV heads, head dim {got[2]}; the artifacts "
                             f"were fitted for {s['heads']}, {s['kv_heads']}, {s['head_dim']} "
                             f"({self.artifacts.manifest['model']['name']})")
        if not 0 <= layer < s["layers"]:
            raise ValueError(f"context.layer: expected a layer in [0, {s['layers']}), got {layer}")

    # -- index ----------------------------------------------------------------------------------

    def _centroids(self, layer: int, device: torch.device) -> torch.Tensor:
        return self.artifacts.on_device(layer, "centroids_roped" if self.roped else "centroids", device)

    def _derope_freq(self, device: torch.device) -> torch.Tensor | None:
        return None if self.roped else self.artifacts.rope.inv_freq_on(device)

    def windows(self, lengths: torch.Tensor) -> torch.Tensor:
        """``[B]`` each row's window for its length (:func:`effective_window`, on the device)."""
        cfg = self.config
        scaled = torch.floor(lengths.double() * cfg.window_scale).long()
        return scaled.clamp(min=cfg.window_min).clamp(max=cfg.window)

    def _build(self, inputs: DecodeInputs, layer: int) -> SaapIndex:
        """Index the keys outside sink + window: each row's window from its length now, every key of
        ``[sink, L_b − W_b)`` assigned and listed by bucket, in buffers of the capacity's width (or K's
        length). No host read."""
        cfg = self.config
        lengths = inputs.n_valid
        window = self.windows(lengths)
        width = max(inputs.n_keys, inputs.context.capacity or 0)
        cent = self._centroids(layer, inputs.q.device)
        assign, tail_lo = build_assign(inputs.k, lengths, window, cfg.sink, cent, self._derope_freq(inputs.q.device),
                                       self.artifacts.rope.attention_scaling, width)
        offsets, ids = build_csr(assign[..., :inputs.n_keys], self.artifacts.buckets)
        return SaapIndex(batch=inputs.batch, n_keys=inputs.n_keys, window=window, tail_lo=tail_lo, done=tail_lo.clone(),
                         offsets=offsets, ids=ids, assign=assign,
                         sink_ids=torch.arange(max(cfg.sink, 1), device=inputs.q.device).expand(inputs.batch,
                                                                                                inputs.kv_heads, -1),
                         sink_counts=torch.full((inputs.batch, inputs.kv_heads), cfg.sink, device=inputs.q.device))

    def _index(self, inputs: DecodeInputs, layer: int, state: SaapState) -> tuple[SaapIndex, IndexUpdate]:
        """The request's index for this layer, built on the first call, and the arguments of the update that
        brings it up to date (:func:`~kvsieve.kernels.saap.index.assign_tail_reference`'s): the keys that left
        the window since the last call join their buckets (:data:`UPDATE_SPAN` positions a step, or K's growth
        since the last call if larger). The caller runs the update before the step reads ``assign``."""
        idx = state.index
        if idx is None or idx.batch != inputs.batch or inputs.n_keys < idx.n_keys:
            idx = state.index = self._build(inputs, layer)
        n = inputs.n_keys
        if n > idx.assign.shape[-1]:  # K grew past the buffers (no capacity given): host-known, eager only
            c = self.artifacts.buckets
            idx.assign = torch.nn.functional.pad(idx.assign, (0, n - idx.assign.shape[-1]), value=c)
        span = max(UPDATE_SPAN, n - idx.n_keys)
        idx.n_keys = n
        lengths = inputs.lengths
        if host_reads_allowed(lengths):  # the host may look: refuse a jump the update would not cover
            t_hi = tail_end(idx.tail_lo, lengths, idx.window)
            if bool((t_hi - idx.done > span).any()):
                raise ValueError(f"lengths: a row advanced by more than {span} keys since the last call with K's "
                                 f"shape unchanged; {self.name} assigns at most that many keys leaving the window "
                                 "per call")
            torch.maximum(idx.done, t_hi, out=idx.done)
        return idx, IndexUpdate(idx.assign, inputs.k, idx.tail_lo, lengths, idx.window, span,
                                self._centroids(layer, inputs.q.device), self._derope_freq(inputs.q.device),
                                self.artifacts.rope.attention_scaling)

    # -- scoring ----------------------------------------------------------------------------------

    def bucket_scores(self, inputs: DecodeInputs, layer: int) -> torch.Tensor:
        """``[B, Hq, C]`` per-query-head bucket scores: classifier probabilities (``saap``) or inner
        products with the centroids (k-means baselines)."""
        b, hq, d = inputs.q.shape
        q = inputs.q.float()
        if not self.roped:
            pos = (inputs.n_valid - 1)[:, None, None]  # the query sits at the last visible position
            q = self.artifacts.rope.invert(q[:, :, None, :], pos)[:, :, 0]
        if self.query_scoring == "centroids":
            cent = self._centroids(layer, q.device)  # [Hkv, C, d]
            qg = q.view(b, inputs.kv_heads, inputs.group, d)
            return torch.einsum("bhgd,hcd->bhgc", qg, cent).reshape(b, hq, -1)
        from ..kernels.saap.probe import classifier_logits_reference

        weights = self.artifacts.probe_weights(layer, q.device)  # the Triton probe's (bfloat16) weights
        models = weights[0].shape[0]
        # Rows of model m: per KV head, the group's queries of every batch row; per query head, its own.
        x = q.view(b, models, -1, d).transpose(0, 1).reshape(models, -1, d)
        with torch.no_grad():
            probs = torch.softmax(classifier_logits_reference(x, *weights), dim=-1)  # [M, B·rows, C]
        return probs.view(models, b, -1, probs.shape[-1]).transpose(0, 1).reshape(b, hq, -1)

    # -- decode ---------------------------------------------------------------------------------

    def _decode(self, inputs, seed, state):
        layer = inputs.context.layer
        if layer is None:
            raise ValueError(f"{self.name}: context.layer: expected the layer index (the model drivers set it; "
                             "direct callers pass context=kvsieve.CallContext(layer=i))")
        self._check_shapes(inputs, layer)
        if layer == 0:
            return self._exact(inputs, "layer 0 runs exact attention (the paper)")
        if layer not in self.artifacts.layers:
            raise ValueError(f"{self.name}: the artifacts have no layer {layer} (fitted: "
                             f"{sorted(self.artifacts.layers)}); fit it or keep it exact with "
                             f"sparsify(..., dense_layers=[{layer}])")
        if inputs.lengths is None:
            raise ValueError(f"key_mask: {self.name} needs each row's valid keys to be a prefix [0, length) "
                             f"({self.prefix_only_note}); give lengths (the model drivers serve left-padded rows "
                             "one at a time)")
        backend = self._backend(inputs)
        idx, update = self._index(inputs, layer, state)
        hkv, group = inputs.kv_heads, inputs.group
        probing_heads = hkv if self.config.probing == "batched" else inputs.heads
        lengths = inputs.lengths
        device_probe = (backend == "triton" and self.query_scoring == "classifier" and not self.roped
                        and self.probes > 0)
        parallel = parallel_update(inputs.batch)  # a host rule on the batch: the step stays capturable
        ahead = backend == "triton" and self._ahead()
        # the step's update in launches of its own where neither the probe's nor the attention's launch runs it;
        # ahead, only where K grew by more keys than the last step assigned (eager calls): the rest join now
        if (update.span > UPDATE_SPAN) if ahead else (not device_probe):
            if backend == "triton":
                (assign_tail_parallel_triton if parallel else assign_tail_triton)(*update)
            else:
                assign_tail_reference(*update)
        if self.probes > 0:
            if device_probe:  # index update + de-rope + classifier + group sum + top-l (kernels/saap/probe.py)
                from ..kernels.saap.probe import probe_scores_triton

                # the query sits at the last visible position: length - 1, the - 1 added in the kernel
                _, buckets = probe_scores_triton(inputs.q, lengths, self.artifacts.rope.inv_freq_on(
                    inputs.q.device), self.artifacts.rope.attention_scaling,
                    *self.artifacts.probe_weights(layer, inputs.q.device), kv_heads=hkv, probes=self.probes,
                    position_offset=-1, tail=None if ahead else update, parallel_tail=parallel)
            else:
                scores = self.bucket_scores(inputs, layer)
                if probing_heads == hkv:
                    scores = scores.view(inputs.batch, hkv, group, -1).sum(2)
                buckets = torch.topk(scores, self.probes, dim=-1).indices
        else:
            buckets = torch.zeros(inputs.batch, probing_heads, 0, dtype=torch.long, device=inputs.q.device)
        assign = idx.assign if probing_heads == hkv else idx.assign.repeat_interleave(group, dim=1)
        extra = {"saap_path": "device index", "probes": self.probes, "buckets": self.artifacts.buckets,
                 "update": "reference" if backend != "triton" else "ahead" if ahead else
                 "parallel" if parallel else "serial"}
        if backend == "triton":
            # the sink list and its size are shared by the KV heads (head stride 0); the window's bounds come
            # from the lengths in the kernel. The kernel's default splits are those of the cache's keys (width 0);
            # many programs a row make the fused merge's counter slow (batch 1), few make its launch saved worth it.
            fused = fused_merge_default(inputs.batch * hkv, inputs.k.shape[2])
            extra["merge"] = "fused" if fused else "separate launch"
            out, _, _ = bucket_sparse_decode_triton(
                inputs.q, inputs.k, inputs.v, idx.sink_ids, idx.sink_counts, idx.offsets, idx.ids, buckets, 0,
                scale=inputs.scale, sliding=(lengths, idx.window, idx.tail_lo, idx.assign), fused_merge=fused,
                ahead=(update.centroids, update.inv_freq, update.scaling, UPDATE_SPAN) if ahead else None)

            def deferred():  # the keys read, listed only when the stats are read
                read = index_read_mask(inputs.n_keys, lengths, idx.window, self.config.sink, assign, buckets)
                return self._stats(inputs, idx, read, backend, extra)

            # built on first read: the read mask is O(N) work that a captured step nobody reads would repeat
            stats = StepStats.deferred(deferred, backend, {**extra, "probe": "triton" if device_probe else "torch"})
            return out, stats
        out, read = index_decode_reference(inputs.q, inputs.k, inputs.v, lengths, idx.window, self.config.sink,
                                           assign, buckets, scale=inputs.scale)
        return out.to(compute_dtype(inputs)), self._stats(inputs, idx, read, backend, extra)

    def _ahead(self) -> bool:
        """Whether the Triton step assigns the keys leaving the window one step early, in the attention's launch
        (:func:`~kvsieve.kernels.saap.index.assign_ahead_reference`): asked for, and every window (at least
        ``min(window, window_min)``) holds the :data:`UPDATE_SPAN` keys it assigns, so that they are in K."""
        cfg = self.config
        return cfg.index_update == "ahead" and min(cfg.window, cfg.window_min) >= UPDATE_SPAN

    def _backend(self, inputs: DecodeInputs) -> str:
        """Which path runs: a method policy, named in ``stats.backend``."""
        choice = self.config.backend
        if choice == "reference":
            return "reference"
        from ..kernels.shared.triton_utils import kernels_interpreted, triton_available

        # Interpreted kernels (TRITON_INTERPRET=1 at import) run on CPU tensors only, compiled ones on CUDA only.
        usable = (triton_available() and inputs.q.is_cuda != kernels_interpreted()
                  and self.config.probing == "batched" and inputs.q.dtype != torch.float64
                  and inputs.q.shape[-1] in (16, 32, 64, 128, 256) and inputs.v.shape[-1] == inputs.q.shape[-1])
        if choice == "triton":
            if not usable:
                raise ValueError(f"backend: the triton kernel cannot serve this call (needs triton, CUDA or "
                                 f"TRITON_INTERPRET=1, float16/bfloat16/float32 and a power-of-two head dim >= 16; "
                                 f"got {inputs.q.device.type}, {inputs.q.dtype}, d = {inputs.q.shape[-1]})")
            return "triton"
        return "triton" if usable and inputs.q.is_cuda else "reference"

    def _exact(self, inputs: DecodeInputs, why: str):
        """Exact attention over every valid key. On the Triton backend the dense split-KV kernel that serves the
        runtime's dense layers (two launches, stats built when read): the torch path upcasts all of K and V to
        float32 and multiplies them in batched GEMVs, milliseconds at 128k keys."""
        extra = {"saap_path": why, "selectivity": 1.0, "selectivity_indexed": 1.0}

        def stats(backend: str) -> StepStats:
            v_read = inputs.key_mask[:, None, :].expand(inputs.batch, inputs.heads, inputs.n_keys)
            return read_stats(inputs, v_read, exact_rows=inputs.batch, backend=backend, extra=extra)

        if inputs.lengths is not None and self._backend(inputs) == "triton":
            from ..kernels.shared.dense import dense_decode_triton

            out = dense_decode_triton(inputs.q, inputs.k, inputs.v, inputs.kernel_lengths, inputs.scale)
            return out, StepStats.deferred(lambda: stats("triton"), "triton", {**extra, "exact": "dense kernel"})
        return exact_attention(inputs), stats("reference")

    def _stats(self, inputs, idx, read, backend, extra):
        """Stats from the keys each probing head read (``read [B, P, N]``)."""
        b, n = inputs.batch, inputs.n_keys
        v_read = read if read.shape[1] == inputs.heads else read.repeat_interleave(inputs.group, dim=1)
        k_scored = v_read.view(b, inputs.kv_heads, inputs.group, n).any(2).sum(-1)
        lengths = inputs.n_valid
        lo = (lengths - idx.window).clamp(min=self.config.sink)
        indexed = (lo - self.config.sink).clamp(min=0).float()[:, None]  # [B, 1]
        dense = lengths.clamp(max=self.config.sink) + (lengths - lo).clamp(min=0)
        rows = read.sum(-1).float()  # [B, P]
        bucket_keys = rows - dense[:, None].float()
        extra = {  # device tensors: StepStats turns them into numbers when read
            **extra, "window": idx.window.float().mean(),
            "selectivity": (rows / lengths[:, None].float()).mean(),
            "selectivity_indexed": torch.where(indexed > 0, bucket_keys / indexed.clamp(min=1),
                                               torch.zeros_like(rows)).mean(),
            "dense_keys": dense.float().mean(), "bucket_keys": bucket_keys.mean(),
        }
        # Rows whose context is no longer than the dense part have nothing indexed: they ran exact.
        exact_rows = (indexed[:, 0] == 0).sum()
        return read_stats(inputs, v_read, k_scored=k_scored, backend=backend, exact_rows=exact_rows, extra=extra)


@register_method
class SaapKMeans(Saap):
    name = "saap-kmeans"
    summary = ("SAAP's index with symmetric probing: de-roped queries visit their nearest key centroids "
               "(k-means, no RoPE)")
    query_scoring = "centroids"


@register_method
class SaapKMeansRoped(Saap):
    name = "saap-kmeans-roped"
    summary = "k-means on post-RoPE keys; post-RoPE queries visit their nearest centroids (the paper's roped baseline)"
    query_scoring = "centroids"
    roped = True
