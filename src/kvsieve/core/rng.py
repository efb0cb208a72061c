"""Randomness: counter-based, reproducible, fresh per (seed, request, layer, step, row), sync-free.

Every random number a method draws is a pure function of a *key* and a *counter*:
``hash_uniform(lo, hi, stream, counter)`` runs three rounds of the ``lowbias32`` integer mix over
the key's two 32-bit words (``lo``, ``hi``), a ``stream`` number naming the purpose (tile offsets,
base sample, ...) and a 32-bit ``counter`` naming the draw (head, position, ...), and returns the
top 24 bits as ``k / 2**24`` in [0, 1). It is the function the Triton kernels evaluate
(``kernels/shared/triton_utils.py``: ``hash_uniform``), computed here with torch integer ops on any device,
so a draw costs no host round trip, no ``torch.Generator`` and nothing a CUDA graph cannot replay.

Keys
----
A :class:`RandomKey` names one call: ``seed`` (an int) and counters such as request, layer and step;
a counter may be a 0-dim integer tensor in device memory (a step counter that a captured CUDA graph
reads, so that every replay draws fresh numbers). Each query row of a call then gets its own key,
mixed from the call's key, the batch row ``b`` and the row's number of visible keys (its position):
a row draws the same numbers whether it is decoded alone or inside a chunk of rows, and no two rows
of a batch or steps of a decode share a stream.

An int ``seed`` is the key ``RandomKey(seed)``; ``None`` draws a fresh seed from the OS. A
``torch.Generator`` is still accepted by methods written against the generator API
(:func:`as_generator`); the methods shipped with kvsieve use keys.

Until 2026-11 the references drew from ``torch.Generator`` streams seeded by SplitMix64 of the
seed, layer and step: the same distributions, different numbers (see docs/decode-contract.md).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
MASK32 = 0xFFFFFFFF
MIX1 = 0x7FEB352D
MIX2 = 0x846CA68B
GOLDEN = 0x9E3779B9

IntOrTensor = int | torch.Tensor


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(seed: int, *counters: int) -> int:
    """A 63-bit seed for the stream named by ``seed`` and the counters (e.g. layer, step); host ints."""
    x = splitmix64(int(seed) & _MASK64)
    for c in counters:
        x = splitmix64(x ^ (int(c) & _MASK64))
    return x >> 1


def mix32(x: IntOrTensor) -> IntOrTensor:
    """``lowbias32`` on a 32-bit value held in a Python int or an int64 tensor (products wrap; the
    mask keeps the low word, as in the Triton kernels)."""
    x = x ^ (x >> 16)
    x = (x * MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX2) & MASK32
    return x ^ (x >> 16)


def seed_words(seed: int) -> tuple[int, int]:
    seed = int(seed) & _MASK64
    return seed & MASK32, (seed >> 32) & MASK32


def hash_bits(lo: IntOrTensor, hi: IntOrTensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """The kernels' 32-bit hash of (key words, stream, counter), int64 in [0, 2**32)."""
    x = counters.to(torch.int64) & MASK32
    x = mix32(x ^ lo)
    x = mix32(x ^ hi)
    return mix32(x ^ ((stream * GOLDEN) & MASK32))


def hash_uniform(lo: IntOrTensor, hi: IntOrTensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms ``k / 2**24`` in [0, 1), float64, one per counter (``lo``/``hi`` broadcast)."""
    return (hash_bits(lo, hi, stream, counters) >> 8).to(torch.float64) * 2.0**-24


def length_words(lo: IntOrTensor, hi: IntOrTensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernels' per-row key: the call's words mixed with each row's valid length (its
    position), so that a decode step draws fresh numbers from the same seed, with no counter that the
    host must update (a replayed CUDA graph reads the lengths from device memory). ``[B]`` int64 each."""
    p = lengths.to(torch.int64) & MASK32
    lo = mix32(lo ^ p ^ 0x243F6A88)
    return lo, mix32(hi ^ lo ^ 0x85A308D3)


def _as_word(c: IntOrTensor, device: torch.device | None) -> IntOrTensor:
    if isinstance(c, torch.Tensor):
        return c.to(device=device, dtype=torch.int64) & MASK32
    return int(c) & MASK32


@dataclass(frozen=True)
class RandomKey:
    """The key of one call's random numbers: ``seed`` and counters (ints or int tensors on the device)."""

    seed: int
    counters: tuple[IntOrTensor, ...] = ()
    #: ``[B]`` int64 seeds, one per batch row (replaces ``seed``): row b draws what it draws alone
    #: with ``seed=row_seeds[b]``.
    row_seeds: torch.Tensor | None = None

    def host(self) -> bool:
        return not any(isinstance(c, torch.Tensor) for c in self.counters)

    def host_seed(self) -> int:
        """One 63-bit int for kernels that take their seed by value (reads device counters: a sync)."""
        flat = [] if self.row_seeds is None else self.row_seeds.reshape(-1).tolist()
        for c in self.counters:
            flat.extend(c.reshape(-1).tolist() if isinstance(c, torch.Tensor) else [c])
        return derive_seed(self.seed, *flat)

    def words(self, device: torch.device | None = None) -> tuple[IntOrTensor, IntOrTensor]:
        """The key's two 32-bit words: ints when every counter is an int, else 0-dim device tensors."""
        lo, hi = seed_words(self.seed)
        for i, c in enumerate(self.counters):
            w = _as_word(c, device)
            lo = mix32(lo ^ w ^ ((GOLDEN * (2 * i + 1)) & MASK32))
            hi = mix32(hi ^ lo ^ ((GOLDEN * (2 * i + 2)) & MASK32))
        return lo, hi

    def child(self, *counters: IntOrTensor) -> RandomKey:
        return RandomKey(self.seed, (*self.counters, *counters))


def as_key(seed: int | RandomKey | torch.Tensor | None) -> RandomKey:
    """A :class:`RandomKey` from an int seed, a key, fresh OS entropy (``None``), or an integer tensor
    of seeds in device memory — 0-dim, or ``[B]`` one per batch row (what a captured decode step
    passes: the runtime hashes them from its step counter inside the graph)."""
    if isinstance(seed, RandomKey):
        return seed
    if isinstance(seed, torch.Tensor):
        if seed.is_floating_point() or seed.dtype == torch.bool or seed.dim() > 1:
            raise ValueError("seed: expected an int, a torch.Generator or None, or B ints (one per batch row) "
                             f"as a 0-dim or [B] integer tensor, got {seed.dtype} {tuple(seed.shape)}")
        if seed.dim() == 1:
            return RandomKey(0, (), seed.to(torch.int64))
        return RandomKey(0, (seed.to(torch.int64) & MASK32, (seed.to(torch.int64) >> 32) & MASK32))
    if seed is None:
        return RandomKey(secrets.randbits(63))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError("seed: expected an int, a torch.Generator or None (or a kvsieve RandomKey), "
                         f"got {type(seed).__name__}")
    return RandomKey(seed)


def per_row_key(seeds, batch: int, device: torch.device) -> RandomKey:
    """A key from ``batch`` per-row seeds (a sequence of ints or a 1-D integer tensor; shape checked
    only, no value read)."""
    t = None
    if isinstance(seeds, torch.Tensor):
        if seeds.dim() == 1 and not seeds.is_floating_point() and seeds.dtype != torch.bool:
            t = seeds.to(device=device, dtype=torch.int64)
    elif all(isinstance(s, int) and not isinstance(s, bool) and -(1 << 63) <= s < (1 << 63) for s in seeds):
        t = torch.tensor(list(seeds), dtype=torch.int64, device=device)
    if t is None or t.shape[0] != batch:
        raise ValueError(f"seed: expected an int, a torch.Generator or None, or {batch} ints (one per batch "
                         f"row), got {seeds!r}")
    return RandomKey(0, (), t)


def row_words(key: RandomKey, batch_row: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row words ``[R]`` from the call's key, the row's batch row and its position
    (number of visible keys); pure device arithmetic."""
    if key.row_seeds is not None:
        # Row b's seed as the int seed of a call with that row alone: its words, and batch row 0.
        s = key.row_seeds[batch_row]
        lo, hi = s & MASK32, (s >> 32) & MASK32
        batch_row = torch.zeros_like(batch_row)
    else:
        lo, hi = key.words(batch_row.device)
    b = batch_row.to(torch.int64) & MASK32
    p = position.to(torch.int64) & MASK32
    lo = mix32(lo ^ b ^ 0x243F6A88)
    hi = mix32(hi ^ lo ^ p ^ 0x85A308D3)
    lo = mix32(lo ^ hi)
    return lo, hi


POSITION_BITS = 22


class RowStreams:
    """Uniforms for the query rows of one call: ``uniform(stream, shape)`` -> float64 ``[R, *shape]``.

    The draw at (leading index i, last index j) of row ``r`` is ``hash_uniform(row key r, stream,
    i·2**22 + j)``: a row's numbers depend neither on the other rows of the call nor on the length
    of the last axis. Last axes past 2**22 entries (4M keys) or more than 1024 leading entries (heads)
    would reuse counters.
    """

    def __init__(self, key: RandomKey, batch_row: torch.Tensor, position: torch.Tensor) -> None:
        self.key = key
        self.lo, self.hi = row_words(key, batch_row, position)
        self.device = batch_row.device

    @property
    def rows(self) -> int:
        return self.lo.shape[0]

    def uniform(self, stream: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``[R, *shape]`` uniforms; the draw at (leading index i, last index j) has counter
        ``i·2**22 + j``, so it does not depend on the size of the last axis (a key position is the
        same draw whatever the cache length)."""
        if not shape:
            shape = (1,)
            squeeze = True
        else:
            squeeze = False
        lead = 1
        for s in shape[:-1]:
            lead *= s
        c = (torch.arange(lead, device=self.device, dtype=torch.int64)[:, None] << POSITION_BITS) + torch.arange(
            shape[-1], device=self.device, dtype=torch.int64)[None, :]
        c = c.view(1, *shape)
        view = (self.rows,) + (1,) * len(shape)
        u = hash_uniform(self.lo.view(view), self.hi.view(view), stream, c)
        if squeeze:
            u = u[:, 0]
        return u if dtype == torch.float64 else u.to(dtype)

    @classmethod
    def from_words(cls, key: RandomKey, lo: torch.Tensor, hi: torch.Tensor) -> RowStreams:
        """Streams whose row words ``lo, hi [R]`` were computed elsewhere (a fused kernel of
        :func:`row_words`); they must equal ``row_words``'s."""
        out = cls.__new__(cls)
        out.key, out.lo, out.hi, out.device = key, lo, hi, lo.device
        return out

    def select(self, rows: torch.Tensor) -> RowStreams:
        """The streams of a subset of rows (index tensor)."""
        out = RowStreams.__new__(RowStreams)
        out.key, out.lo, out.hi, out.device = self.key, self.lo[rows], self.hi[rows], self.device
        return out


# Streams: one number per purpose, so that two draws of one call never share numbers.
STREAM_TILE = 1  # the Triton kernels' tile offsets
STREAM_BUDGET = 2  # the Triton kernels' budget offsets
STREAM_SAMPLE = 3  # santa family: thresholds
STREAM_SUBSET = 4  # uniform subsets (random, vattention's base sample)
STREAM_SUBSET2 = 5  # a second subset of the same call (vattention's residual sample)
STREAM_CAP = 6  # magicpig's budget cap
STREAM_BERNOULLI = 7  # bernoulli-qk: the draws of the ternary queries


def as_generator(seed, device: torch.device) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` from an int seed, a :class:`RandomKey`, an existing generator,
    or fresh OS entropy — for methods written against the generator API (not capturable, syncs on a
    key with device counters)."""
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
    elif isinstance(seed, RandomKey):
        gen.manual_seed(seed.host_seed())
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, a torch.Generator or None, got {type(seed).__name__}")
    else:
        gen.manual_seed(derive_seed(seed))
    return gen


def seed_int(seed, device: torch.device) -> int:
    """One 63-bit integer from any accepted seed, for kernels that take their seed by value."""
    if isinstance(seed, RandomKey):
        return seed.host_seed()
    if isinstance(seed, torch.Generator) or seed is None:
        gen = as_generator(seed, device)
        return int(torch.randint(0, 2**62, (1,), generator=gen, device=device).item())
    return as_generator(seed, device).initial_seed()
