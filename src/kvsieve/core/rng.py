"""Seeds: reproducible, and fresh per layer and per decode step.

The public SANTA harness reused one seed at every layer and step, which makes the sampling errors of
different layers and steps correlated. kvsieve derives one independent stream per (seed, layer,
step) with a SplitMix64 mix, so that a run is reproducible from its seed and no two calls share
their random numbers.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *counters: int) -> int:
    """A 63-bit seed for the stream named by ``seed`` and the counters (e.g. layer, step)."""
    x = splitmix64(int(seed) & _MASK64)
    for c in counters:
        x = splitmix64(x ^ (int(c) & _MASK64))
    return x >> 1


def as_generator(seed: int | torch.Generator | None, device: torch.device) -> torch.Generator:
    """A generator on ``device`` from an int seed, an existing generator, or fresh OS entropy."""
    if isinstance(seed, torch.Generator):
        if seed.device.type != torch.device(device).type:
            raise ValueError(
                f"seed: the torch.Generator is on {seed.device} but the inputs are on {device}; "
                "pass a generator on the inputs' device or an int seed"
            )
        return seed
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, a torch.Generator or None, got {type(seed).__name__}")
    else:
        gen.manual_seed(derive_seed(seed))
    return gen


def seed_int(seed: int | torch.Generator | None, device: torch.device) -> int:
    """One 63-bit integer from any accepted seed, for counter-based generators (GPU kernels)."""
    if isinstance(seed, torch.Generator) or seed is None:
        gen = as_generator(seed, device)
        return int(torch.randint(0, 2**62, (1,), generator=gen, device=device).item())
    return as_generator(seed, device).initial_seed()
