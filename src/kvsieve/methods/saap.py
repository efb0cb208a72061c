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
from typing import Any, Literal

import torch

from ..core.config import MethodConfig, param, require_choice, require_int
from ..core.context import MethodState
from ..core.inputs import DecodeInputs
from ..core.method import Method, read_stats
from ..core.registry import register_method
from ..core.stats import StepStats
from ..core.sync import host_reads_allowed
from ..kernels.saap.buckets import bucket_sparse_decode, bucket_sparse_decode_triton, build_csr, list_width
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
    if not rotary or not hasattr(rotary[0], "inv_freq"):
        raise ValueError(f"model: {type(model).__name__} has no rotary_emb module with inv_freq; SAAP "
                         "needs a RoPE model (Llama, Qwen, Mistral families)")
    rot = rotary[0]
    rope_type = getattr(rot, "rope_type", "default")
    if "dynamic" in str(rope_type):
        raise ValueError(f"model: rope type {rope_type!r} changes with the context length; SAAP de-ropes "
                         "with fixed frequencies and supports static RoPE types only")
    return Rope(rot.inv_freq.detach().float().cpu().clone(), float(getattr(rot, "attention_scaling", 1.0)))


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


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (16 hex digits) of the first attention layer's key projection: tells two checkpoints of
    one architecture apart (a fine-tune shares the config hash)."""
    for name, p in model.named_parameters():
        if name.endswith("k_proj.weight"):
            data = p.detach().float().cpu().contiguous().numpy().tobytes()
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
        (built once per device). Both the fused probe and the torch path score with these tensors."""
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
        if self.backend == "triton" and self.probing != "batched":
            raise ValueError("backend: the triton kernel probes per KV head; use probing=batched or backend=reference")


@dataclass
class SaapIndex:
    """One layer's key index for a request: the valid keys outside sink + window in their buckets (CSR
    ``offsets``/``ids`` per KV head, ``assign`` per key), the dense part's positions, and what the build
    saw (``n_keys`` positions of ``batch`` rows; ``seen_*``: each row's last valid position then)."""

    n_keys: int
    batch: int
    window: int
    seen_end: int
    seen_last: torch.Tensor
    seen_next: torch.Tensor
    offsets: torch.Tensor
    ids: torch.Tensor
    assign: torch.Tensor
    dense_ids: torch.Tensor
    dense_counts: torch.Tensor
    indexed: torch.Tensor
    width: int


@dataclass
class SaapState(MethodState):
    """SAAP's per-(request, layer) state: the key index, built after prefill, rebuilt as keys leave the
    window."""

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

    # -- model identity ------------------------------------------------------------------------

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise ValueError unless ``model`` is the model the artifacts were fitted on."""
        want = self.artifacts.manifest["model"]
        got_hash, got_fp = config_hash(model.config), weights_fingerprint(model)
        if got_hash != want["config_hash"] or got_fp != want["weights_fingerprint"]:
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

    def _key_vectors(self, inputs: DecodeInputs, positions: torch.Tensor) -> torch.Tensor:
        """Keys as the partition sees them: de-roped (float32), or as stored for the roped baseline."""
        k = inputs.k.float()
        return k if self.roped else self.artifacts.rope.invert(k, positions[:, None, :])

    def _centroids(self, layer: int, device: torch.device) -> torch.Tensor:
        return self.artifacts.on_device(layer, "centroids_roped" if self.roped else "centroids", device)

    def _build(self, inputs: DecodeInputs, layer: int) -> SaapIndex:
        """Index the valid keys outside sink + window: assignment, CSR, dense list. Where the host may
        read the device (CPU tensors) the list width and the first position not yet seen are read; on
        a GPU (``core.sync``) host-known bounds stand in: the width is the key count (only the reference
        path uses it; the kernel reads the CSR lists directly) and the scan for keys added after the
        build starts at ``context.min_length`` (the runtime's bound on every row's length) or 0."""
        cfg = self.config
        n = inputs.n_keys
        window = effective_window(n, cfg.window, cfg.window_scale, cfg.window_min)
        mask = inputs.key_mask
        rank = torch.cumsum(mask, dim=-1) - 1  # position ids (left padding starts at 0)
        n_valid = inputs.n_valid[:, None]
        dense = mask & ((rank < cfg.sink) | (rank >= n_valid - window))
        indexed = mask & ~dense
        c = self.artifacts.buckets
        cent = self._centroids(layer, inputs.q.device)  # [Hkv, C, d]
        keys = self._key_vectors(inputs, rank.clamp(min=0))  # [B, Hkv, N, d]
        assign = torch.einsum("bhnd,hcd->bhnc", keys, cent).argmax(-1)  # spherical: largest inner product
        assign = torch.where(indexed[:, None, :], assign, torch.full_like(assign, c))
        offsets, ids = build_csr(assign, c)
        # Positions seen so far: keys past them (this chunk's later rows, generated tokens) join the
        # dense part when they become visible.
        last = torch.where(mask, torch.arange(n, device=mask.device), -1).amax(-1)
        dense_width = min(n, cfg.sink + window)
        dense_ids = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True)[:, :dense_width]
        if host_reads_allowed(last):
            seen_end, width = int(last.min()) + 1, list_width(offsets, self.probes)
        else:
            seen_end, width = min(n, inputs.context.min_length), n
        return SaapIndex(n_keys=n, batch=inputs.batch, window=window, seen_end=seen_end, seen_last=last,
                         seen_next=last + 1, offsets=offsets, ids=ids, assign=assign, dense_ids=dense_ids,
                         dense_counts=dense.sum(-1), indexed=indexed.sum(-1), width=width)

    def _index(self, inputs: DecodeInputs, layer: int, state: SaapState) -> SaapIndex:
        """The request's index for this layer, built after prefill and rebuilt once the keys added since
        outnumber the window (so that keys leaving the window join their buckets)."""
        idx = state.index
        n = inputs.n_keys
        if idx is None or idx.batch != inputs.batch or n < idx.n_keys or n - idx.n_keys > idx.window:
            idx = state.index = self._build(inputs, layer)
        return idx

    def _dense_list(self, inputs: DecodeInputs, idx: SaapIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """Build-time dense positions followed by the visible positions added since, compacted."""
        ids, counts = idx.dense_ids, idx.dense_counts
        lo = idx.seen_end
        new = torch.arange(lo, inputs.n_keys, device=ids.device).expand(inputs.batch, -1)
        if new.shape[-1] == 0:
            return ids, counts
        visible = inputs.key_mask[:, lo:] & (new > idx.seen_last[:, None])
        width = ids.shape[-1] + new.shape[-1]
        dest = torch.where(visible, counts[:, None] + torch.cumsum(visible, dim=-1) - 1, width)
        out = torch.zeros(inputs.batch, width + 1, dtype=ids.dtype, device=ids.device)
        out[:, : ids.shape[-1]] = ids
        out.scatter_(1, dest, new)
        return out[:, :width], counts + visible.sum(-1)

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

        weights = self.artifacts.probe_weights(layer, q.device)  # the fused probe's (bfloat16) weights
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
        idx = self._index(inputs, layer, state)
        hkv, group = inputs.kv_heads, inputs.group
        probing_heads = hkv if self.config.probing == "batched" else inputs.heads
        backend = self._backend(inputs)
        copy = backend != "triton"
        dense_range = None
        if backend == "triton" and inputs.lengths is not None:
            # Prefix rows: the keys added since the build are [last seen + 1, length) of each row, passed to
            # the kernel as a range (no per-step list: _dense_list would launch about ten ops per step).
            dense_ids, dense_counts = idx.dense_ids, idx.dense_counts
            dense_range = (idx.seen_next, inputs.lengths)
        else:
            dense_ids, dense_counts = self._dense_list(inputs, idx)

        def per_head(t: torch.Tensor) -> torch.Tensor:
            # The kernel reads the shared dense list through a head stride of 0; the reference wants copies.
            e = t[:, None].expand(t.shape[0], probing_heads, *t.shape[1:])
            return e.contiguous() if copy else e
        offsets, ids = idx.offsets, idx.ids
        fused_probe = backend == "triton" and self.query_scoring == "classifier" and not self.roped
        if self.probes > 0:
            if fused_probe:  # de-rope + classifier + group sum in three launches (kernels/saap/probe.py)
                from ..kernels.saap.probe import probe_scores_triton

                # the query sits at the last visible position: n_valid - 1, the - 1 added in the kernel
                lengths = inputs.lengths if inputs.lengths is not None else inputs.n_valid
                _, buckets = probe_scores_triton(inputs.q, lengths, self.artifacts.rope.inv_freq_on(
                    inputs.q.device), self.artifacts.rope.attention_scaling,
                    *self.artifacts.probe_weights(layer, inputs.q.device), kv_heads=hkv, probes=self.probes,
                    position_offset=-1)
            else:
                scores = self.bucket_scores(inputs, layer)
                if probing_heads == hkv:
                    scores = scores.view(inputs.batch, hkv, group, -1).sum(2)
                else:
                    offsets, ids = (t.repeat_interleave(group, dim=1) for t in (offsets, ids))
                buckets = torch.topk(scores, self.probes, dim=-1).indices
        else:
            buckets = torch.zeros(inputs.batch, probing_heads, 0, dtype=torch.long, device=inputs.q.device)
        if backend == "triton":
            out, _, bucket_counts = bucket_sparse_decode_triton(
                inputs.q, inputs.k, inputs.v, per_head(dense_ids), per_head(dense_counts), offsets, ids, buckets,
                idx.width, scale=inputs.scale, dense_range=dense_range)

            def deferred():  # the dense list is materialised only when the stats are read
                d_ids, d_counts = self._dense_list(inputs, idx)
                return self._stats(inputs, idx, d_ids, d_counts, buckets, bucket_counts, backend)

            # built on first read: the read mask is O(N) work that a captured step nobody reads would repeat
            stats = StepStats.deferred(
                deferred, backend,
                {"saap_path": "index", "probes": self.probes, "buckets": self.artifacts.buckets,
                 "probe": "fused" if fused_probe and self.probes > 0 else "torch"})
            # the kernel's output in q's dtype as it is (decode returns q's dtype: a float32 copy here and
            # the copy back were two launches per step)
            return out, stats
        out, _, bucket_counts = bucket_sparse_decode(inputs.q, inputs.k, inputs.v, per_head(dense_ids),
                                                     per_head(dense_counts), offsets, ids, buckets, idx.width,
                                                     scale=inputs.scale)
        stats = self._stats(inputs, idx, dense_ids, dense_counts, buckets, bucket_counts, backend)
        return out.to(compute_dtype(inputs)), stats

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
        v_read = inputs.key_mask[:, None, :].expand(inputs.batch, inputs.heads, inputs.n_keys)
        stats = read_stats(inputs, v_read, exact_rows=inputs.batch,
                           extra={"saap_path": why, "selectivity": 1.0, "selectivity_indexed": 1.0})
        return exact_attention(inputs), stats

    def _stats(self, inputs, idx, dense_ids, dense_counts, buckets, bucket_counts, backend):
        b, n = inputs.batch, inputs.n_keys
        heads = buckets.shape[1]
        # V rows read per probing head: the dense list and every key of the chosen buckets.
        read = torch.zeros(b, heads, n + 1, dtype=torch.bool, device=inputs.q.device)
        used_d = torch.arange(dense_ids.shape[-1], device=read.device) < dense_counts[:, None]
        read.scatter_(2, torch.where(used_d, dense_ids, n)[:, None, :].expand(b, heads, -1), True)
        if buckets.shape[-1]:
            c = self.artifacts.buckets
            chosen = torch.zeros(b, heads, c + 1, dtype=torch.bool, device=read.device)
            chosen.scatter_(2, buckets, True)
            chosen[..., c] = False  # "not indexed"
            assign = idx.assign
            if heads != assign.shape[1]:
                assign = assign.repeat_interleave(inputs.group, dim=1)
            read[..., : assign.shape[-1]] |= chosen.gather(2, assign)
        read = read[..., :n]
        v_read = read if heads == inputs.heads else read.repeat_interleave(inputs.group, dim=1)
        k_scored = v_read.view(b, inputs.kv_heads, inputs.group, n).any(2).sum(-1)
        rows = bucket_counts.float() + dense_counts[:, None].float()  # [B, heads]
        indexed = idx.indexed[:, None].float()
        sel_indexed = torch.where(indexed > 0, bucket_counts.float() / indexed.clamp(min=1), torch.zeros_like(rows))
        extra = {  # device tensors: StepStats turns them into numbers when read
            "saap_path": "index", "probes": self.probes, "buckets": self.artifacts.buckets, "window": idx.window,
            "selectivity": (rows / inputs.n_valid[:, None].float()).mean(),
            "selectivity_indexed": sel_indexed.mean(),
            "dense_keys": dense_counts.float().mean(), "bucket_keys": bucket_counts.float().mean(),
        }
        # Rows whose context is no longer than the dense part have nothing indexed: they ran exact.
        exact_rows = (idx.indexed == 0).sum()
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
