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
from ..core.rng import STREAM_SUBSET2
from .shared.backend import BACKENDS
from .shared.base import SinkWindowConfig, fixed_part
from .shared.selection import require_size, resolve_size, size_bound, uniform_sample, union
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
