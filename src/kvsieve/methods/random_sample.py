"""``random``: sink + window + a uniform sample of the other keys, weighted by n_rest / b (unbiased sums)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.config import param
from ..core.registry import register_method
from ..core.rng import STREAM_SUBSET2
from .shared.base import Selected, SelectionMethod, SinkWindowConfig, fixed_part
from .shared.selection import require_size, resolve_size, size_bound, uniform_sample, union


@dataclass(frozen=True)
class RandomConfig(SinkWindowConfig):
    budget: int | float = param(0.05, "keys sampled uniformly from the rest: a count, or a fraction of the context")
    replacement: bool = param(False, "draw with replacement (sparse-attention-hub); the paper samples without")
    share_kv_group: bool = param(False, "one sample per KV head shared by its query heads")

    def __post_init__(self) -> None:
        super().__post_init__()
        require_size("budget", self.budget)


@register_method
class RandomSample(SelectionMethod):
    name = "random"
    config_class = RandomConfig
    summary = "sink + window + uniform sample of the rest, weighted by n_rest / b (unbiased sums)"
    multi_row = True
    random_keys = True
    graph_capturable = True
    stochastic = True
    small_config = {"sink": 4, "window": 8, "budget": 16}
    exact_config = {"budget": 1.0}

    def select(self, inputs, gen, state):
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
            chosen = union(fixed, union(sample, rest))
        else:
            chosen = union(fixed, uniform_sample(available, size, gen, size_bound=bound))
        return Selected(chosen)
