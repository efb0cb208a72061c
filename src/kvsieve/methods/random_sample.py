"""``random``: sink + window + a uniform sample of the other keys, weighted by n_rest / b (unbiased sums).

``backend``: "auto" (default) runs the kernel path on CUDA tensors it can serve: the same sample (the
same torch ops on the same counter-based draws, no host read) handed to the Triton weighted sparse
kernel (:mod:`kvsieve.methods.shared.staged`) with sink and window as key ranges and the sample as an
index list weighted ``n_rest / b`` (with replacement a key drawn twice is listed twice:
Hansen–Hurwitz); elsewhere the torch reference. "reference" and "triton" force a path;
``stats.backend`` names the path that ran, ``stats.extra["backend_reason"]`` why the kernel did not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..core.config import param, require_choice
from ..core.registry import register_method
from ..core.rng import STREAM_SUBSET, STREAM_SUBSET2, RowStreams
from .shared.backend import BACKENDS
from .shared.base import SinkWindowConfig, fixed_part
from .shared.selection import IndexSet, require_size, resolve_size, size_bound, uniform_sample, union
from .shared.staged import StagedSelection, Stages


@dataclass(frozen=True)
class RandomConfig(SinkWindowConfig):
    budget: int | float = param(0.05, "keys sampled uniformly from the rest: a count, or a fraction of the context")
    replacement: bool = param(False, "draw with replacement (sparse-attention-hub); the paper samples without")
    share_kv_group: bool = param(False, "one sample per KV head shared by its query heads")
    backend: Literal["auto", "reference", "triton"] = param(
        "auto", "auto: the same sample through the Triton sparse kernel on CUDA, else the torch reference; "
                "reference; triton (error if it cannot)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("budget", self.budget)
        require_choice("backend", self.backend, BACKENDS)


@register_method
class RandomSample(StagedSelection):
    name = "random"
    config_class = RandomConfig
    summary = "sink + window + uniform sample of the rest, weighted by n_rest / b (unbiased sums)"
    multi_row = True
    random_keys = True
    graph_capturable = True  # both paths: counter-based draws, static widths, no host read
    stochastic = True
    small_config = {"sink": 4, "window": 8, "budget": 16}
    exact_config = {"budget": 1.0}

    def stages(self, inputs, gen, state):
        fixed, available = fixed_part(self, inputs)
        size = resolve_size(self.config.budget, inputs.n_valid)[:, None].expand(inputs.batch, fixed.heads)
        n_av = available.sum(-1)
        bound = size_bound(self.config.budget, inputs.n_keys)
        if self.config.replacement:
            # Sampling all of the rest with replacement would not be exact: cover it instead.
            size = torch.where(size >= n_av, n_av, size)
            full = size >= n_av
            sample = uniform_sample(available, torch.where(full, 0, size), gen, replacement=True, size_bound=bound)
            rest = uniform_sample(available & full[..., None], torch.where(full, n_av, 0), gen, stream=STREAM_SUBSET2)
            drawn = union(sample, rest)
        else:
            drawn = uniform_sample(available, size, gen, size_bound=bound)
        return Stages(fixed, drawn)

    def kernel_stages(self, inputs, gen, state):
        cfg = self.config
        from ..kernels.shared.sample_triton import sample_rows_triton, usable

        if cfg.replacement or not isinstance(gen, RowStreams) or inputs.lengths is None or not usable(inputs.q):
            return self.stages(inputs, gen, state)

        # The kernel path serves prefix rows: the available keys are the range between sink and window,
        # so the sample is drawn in one launch (hashes in registers, no sort over the row).
        heads = self.selection_heads(inputs)
        nv = inputs.n_valid
        start = torch.clamp(nv, max=cfg.sink)
        end = torch.maximum(nv - cfg.window, start)
        n_av = (end - start)[:, None].expand(inputs.batch, heads)
        size = resolve_size(cfg.budget, nv)[:, None].expand(inputs.batch, heads)
        width = min(size_bound(cfg.budget, inputs.n_keys), inputs.n_keys)
        idx, w = sample_rows_triton(gen.lo, gen.hi, STREAM_SUBSET, start, end, size, n_av, width, inputs.n_keys)
        drawn = IndexSet(idx, torch.minimum(size, n_av), w)
        return Stages(lambda: fixed_part(self, inputs)[0], drawn)
