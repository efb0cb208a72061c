"""95% bootstrap confidence intervals (percentile method), seeded so reports are reproducible."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bootstrap_mean_ci(values: Sequence[float], *, level: float = 0.95, resamples: int = 2000,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of ``values``; with one value the interval collapses to that value."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan"), float("nan")
    if not 0 < level < 1:
        raise ValueError(f"level: expected a fraction in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1 - level) / 2
    return float(x.mean()), float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def paired_delta_ci(method: Sequence[float], dense: Sequence[float], **kwargs) -> tuple[float, float, float]:
    """Bootstrap CI of mean(method − dense) over paired samples (same prompt for both)."""
    if len(method) != len(dense):
        raise ValueError(f"paired samples: got {len(method)} method scores and {len(dense)} dense scores")
    return bootstrap_mean_ci([m - d for m, d in zip(method, dense, strict=True)], **kwargs)
