"""Composable selection on index sets: sink, local window, top-k, top-p, pages, uniform sampling.

The composition idea of sparse-attention-hub's maskers (sink + window + top-k + one sampling stage,
each adding indices with an inclusion probability), executed sparse: every stage returns an
:class:`IndexSet` — per (batch row, selection head) a list of key positions, its length and the
weights ``1/p`` — and stages are joined with :func:`union`. The result feeds
:func:`kvsieve.kernels.shared.weighted.weighted_sparse_decode` directly.

Selection heads are either the KV heads (``Hs = Hkv``: one set shared by a GQA group, read once) or
the query heads (``Hs = Hq``). Stages that must avoid positions already chosen take an
``available [B, Hs, N]`` bool tensor (valid keys not yet selected): per step this is O(N), the same
size as one row of scores; there is never a ``[B, H, Q, N]`` mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.inputs import DecodeInputs
from ...core.rng import STREAM_SUBSET, RowStreams
from ...core.sync import host_reads_allowed, max_or_bound

Draws = RowStreams | torch.Generator
"""Where random numbers come from: the call's counter-based row streams, or (methods written against
the generator API) a ``torch.Generator``."""


def uniforms(rng: Draws, stream: int, shape: tuple[int, ...], device: torch.device,
             dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Uniforms in [0, 1) of ``shape`` (rows first): from the row streams (``stream`` names the draw)
    or from a generator."""
    if isinstance(rng, torch.Generator):
        return torch.rand(shape, generator=rng, device=device, dtype=dtype)
    return rng.uniform(stream, tuple(shape[1:]), dtype)


@dataclass
class IndexSet:
    """Key positions ``indices [B, Hs, M]`` (first ``counts [B, Hs]`` entries used), weights ``1/p``.

    ``weights`` is None when every weight is 1 (a deterministic set). Padding entries hold position
    0 and weight 1.
    """

    indices: torch.Tensor
    counts: torch.Tensor
    weights: torch.Tensor | None = None

    @property
    def heads(self) -> int:
        return self.indices.shape[1]

    @property
    def width(self) -> int:
        return self.indices.shape[2]

    def used(self) -> torch.Tensor:
        """``[B, Hs, M]`` bool: which entries are used."""
        return torch.arange(self.width, device=self.indices.device) < self.counts[..., None]

    def weight_tensor(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        if self.weights is None:
            return torch.ones(self.indices.shape, dtype=dtype, device=self.indices.device)
        return self.weights.to(dtype)

    def mark(self, n_keys: int) -> torch.Tensor:
        """``[B, Hs, N]`` bool: positions in the set (O(N) per row)."""
        b, h, _ = self.indices.shape
        # Padding entries land on an extra column N that is dropped.
        out = torch.zeros(b, h, n_keys + 1, dtype=torch.bool, device=self.indices.device)
        idx = torch.where(self.used(), self.indices, torch.full_like(self.indices, n_keys))
        out.scatter_(2, idx, True)
        out = out[..., :n_keys]
        return out

    def to_heads(self, heads: int) -> IndexSet:
        """The same sets for ``heads`` selection heads (KV-head sets repeated for their group)."""
        if heads == self.heads:
            return self
        g = heads // self.heads
        rep = lambda t: None if t is None else t.repeat_interleave(g, dim=1)  # noqa: E731
        return IndexSet(rep(self.indices), rep(self.counts), rep(self.weights))


def empty_set(batch: int, heads: int, device: torch.device) -> IndexSet:
    return IndexSet(
        torch.zeros(batch, heads, 0, dtype=torch.long, device=device),
        torch.zeros(batch, heads, dtype=torch.long, device=device),
    )


def compact(indices: torch.Tensor, keep: torch.Tensor, weights: torch.Tensor | None,
            bound: int | None = None) -> IndexSet:
    """Keep the entries where ``keep`` is True, moved to the front of each row (order preserved).

    O(M) per row: each kept entry goes to slot ``cumsum(keep) − 1``; dropped ones to a spare slot.
    The width is the largest count where the host may read it (CPU), else the input width M or
    ``bound``, a host-known bound of the counts the caller guarantees (no host synchronisation; the
    extra columns are padding).
    """
    counts = keep.sum(-1)
    width = max_or_bound(counts, keep.shape[-1] if bound is None else min(int(bound), keep.shape[-1]))
    dest = torch.where(keep, torch.cumsum(keep, dim=-1) - 1, width)
    shape = (*keep.shape[:-1], width + 1)
    idx = torch.zeros(shape, dtype=indices.dtype, device=indices.device).scatter_(-1, dest, indices)[..., :width]
    used = torch.arange(width, device=indices.device) < counts[..., None]
    idx = torch.where(used, idx, torch.zeros_like(idx))  # the spare slot may have leaked nothing; be explicit
    w = None
    if weights is not None:
        w = torch.ones(shape, dtype=weights.dtype, device=weights.device).scatter_(-1, dest, weights)[..., :width]
        w = torch.where(used, w, torch.ones_like(w))
    return IndexSet(idx, counts, w)


def positions_where(mask: torch.Tensor) -> IndexSet:
    """Positions where ``mask [..., N]`` is True, in order (O(N))."""
    n = mask.shape[-1]
    return compact(torch.arange(n, device=mask.device).expand(mask.shape), mask, None)


def union(*sets: IndexSet) -> IndexSet:
    """Concatenate disjoint sets row by row (the caller keeps them disjoint, see ``available``)."""
    sets = tuple(s for s in sets if s.width > 0) or sets[:1]
    if len(sets) == 1:
        return sets[0]
    idx = torch.cat([s.indices for s in sets], dim=-1)
    keep = torch.cat([s.used() for s in sets], dim=-1)
    weights = None
    if any(s.weights is not None for s in sets):
        weights = torch.cat([s.weight_tensor() for s in sets], dim=-1)
    return compact(idx, keep, weights)


def valid_positions(inputs: DecodeInputs) -> torch.Tensor:
    """``[B, N]``: positions of the valid keys in order, first ``n_valid`` entries (O(N) per row)."""
    n = inputs.n_keys
    pos = torch.arange(n, device=inputs.q.device)
    if inputs.lengths is not None:
        return pos.expand(inputs.batch, n)
    return positions_where(inputs.key_mask).indices  # [B, max n_valid]


def sink_and_window(inputs: DecodeInputs, sink: int, window: int, heads: int) -> IndexSet:
    """The first ``sink`` and last ``window`` valid keys of each row (their union), weight 1."""
    nv = inputs.n_valid
    width = min(sink + window, inputs.n_keys)
    device = inputs.q.device
    if width == 0:
        return empty_set(inputs.batch, heads, device)
    s_cnt = torch.clamp(nv, max=sink)
    w_start = torch.maximum(nv - window, torch.full_like(nv, sink))
    w_cnt = torch.clamp(nv - w_start, min=0)
    j = torch.arange(width, device=device)[None, :]
    rank = torch.where(j < s_cnt[:, None], j, w_start[:, None] + (j - s_cnt[:, None]))
    counts = s_cnt + w_cnt
    rank = torch.where(j < counts[:, None], rank, torch.zeros_like(rank))
    pos = torch.gather(valid_positions(inputs), 1, rank)
    idx = pos[:, None, :].expand(inputs.batch, heads, width).contiguous()
    return IndexSet(idx, counts[:, None].expand(inputs.batch, heads).contiguous())


def top_k(scores: torch.Tensor, available: torch.Tensor, k: torch.Tensor, k_bound: int | None = None) -> IndexSet:
    """The ``k [B] or [B, Hs]`` highest ``scores [B, Hs, N]`` among ``available`` positions, weight 1.

    ``k_bound``: a host-known upper bound of ``k`` (default N), the width where the host may not read k.
    """
    n_av = available.sum(-1)
    k = k if k.dim() == 2 else k[:, None].expand_as(n_av)
    k = torch.minimum(k, n_av)
    bound = scores.shape[-1] if k_bound is None else min(int(k_bound), scores.shape[-1])
    kmax = max_or_bound(k, bound)
    if kmax == 0:
        return empty_set(scores.shape[0], scores.shape[1], scores.device)
    s = scores.masked_fill(~available, float("-inf"))
    idx = torch.topk(s, kmax, dim=-1, sorted=True).indices
    # Sorted, so the first k entries of a row are its k best; the rest is masked.
    used = torch.arange(kmax, device=scores.device) < k[..., None]
    return compact(idx, used & torch.gather(available, 2, idx), None)


def top_p(probs: torch.Tensor, available: torch.Tensor, target: torch.Tensor, iterations: int = 48) -> IndexSet:
    """Smallest set of ``available`` positions, highest ``probs`` first, whose mass reaches ``target [B, Hs]``.

    The threshold ``τ`` (largest with ``Σ_{p ≥ τ} p ≥ target``) is found by bisection: O(N) per
    iteration and no sort, which is much faster than sorting on a CPU. Keys within ``max p · 2^-48`` of
    the threshold (ties, in practice) may all be taken. A target of the whole available mass takes
    every available key (exact).
    """
    p = probs.to(torch.float64).masked_fill(~available, 0.0)
    rest = p.sum(-1)
    goal = target.to(torch.float64) * (1 - 1e-12)
    lo = torch.zeros_like(rest)
    hi = p.amax(-1) * (1 + 1e-12) + 1e-300
    for _ in range(iterations):
        mid = (lo + hi) / 2
        ok = (p * (p >= mid[..., None])).sum(-1) >= goal
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    keep = available & (p >= lo[..., None])
    keep = keep | (available & (goal >= rest * (1 - 1e-12))[..., None])
    keep = keep & (target > 0)[..., None]
    return positions_where(keep)


def uniform_sample(
    available: torch.Tensor, size: torch.Tensor, gen: Draws, *, replacement: bool = False,
    stream: int = STREAM_SUBSET, size_bound: int | None = None,
) -> IndexSet:
    """``size [B, Hs]`` positions drawn uniformly from ``available [B, Hs, N]``, weight ``n_avail / size``.

    Without replacement (default) the entries are distinct and each available position has inclusion
    probability ``size / n_avail``: every available position gets a uniform key and the ``size``
    smallest keys are the sample. With replacement the draws are i.i.d. and duplicates are kept
    (the Hansen–Hurwitz estimator: each draw weighs ``n_avail / size``); both are unbiased for the
    sum over the available positions. ``size`` is capped at ``n_avail`` without replacement.
    ``stream`` names the draw among the call's (two samples of one call need two streams);
    ``size_bound`` is a host-known bound of ``size`` (default N), the sample width without host reads.
    """
    b, h, n = available.shape
    n_av = available.sum(-1)
    size = size if replacement else torch.minimum(size, n_av)
    size = torch.where(n_av > 0, size, torch.zeros_like(size))
    kmax = max_or_bound(size, n if size_bound is None else size_bound)
    if kmax == 0:
        return empty_set(b, h, available.device)
    if replacement:
        u = uniforms(gen, stream, (b, h, kmax), available.device)
        ranks = torch.floor(u * n_av[..., None].to(torch.float64)).to(torch.long)
        ranks = torch.minimum(ranks, torch.clamp(n_av[..., None] - 1, min=0))
        order = positions_where(available).indices
        if order.shape[-1] == 0:
            order = torch.zeros(b, h, 1, dtype=torch.long, device=available.device)
        idx = torch.gather(order, 2, ranks.clamp(max=order.shape[-1] - 1))
    else:
        keys = uniforms(gen, stream, (b, h, n), available.device, torch.float32)
        idx = _smallest_keys(keys.masked_fill(~available, 2.0), available, size, kmax)
    used = torch.arange(kmax, device=available.device) < size[..., None]
    w = (n_av.to(torch.float64) / torch.clamp(size, min=1).to(torch.float64))[..., None].expand(b, h, kmax)
    return compact(idx, used, w.contiguous())


def _smallest_keys(keys: torch.Tensor, available: torch.Tensor, size: torch.Tensor, kmax: int) -> torch.Tensor:
    """``[B, Hs, kmax]`` positions whose first ``size`` per row are the available positions with the
    smallest ``keys`` (a uniform sample without replacement; unavailable keys hold 2).

    Where the host may read values (CPU) two shortcuts give the same set: rows that take more than
    half of their keys find the keys left out (the largest), and otherwise only keys below a threshold
    a few standard deviations above the ``size``-th order statistic are sorted.
    """
    n = keys.shape[-1]
    if not host_reads_allowed(keys):
        return torch.topk(keys, kmax, dim=-1, largest=False, sorted=True).indices
    n_av = available.sum(-1)
    big = 2 * size > n_av
    if bool(big.any()):
        if not bool(big.all()):
            return torch.topk(keys, kmax, dim=-1, largest=False, sorted=True).indices
        out_size = n_av - size
        k_out = int(out_size.max())
        left_out = torch.zeros_like(available)
        if k_out > 0:
            top = torch.topk(keys.masked_fill(~available, -1.0), k_out, dim=-1, largest=True, sorted=True).indices
            drop = torch.arange(k_out, device=keys.device) < out_size[..., None]
            left_out.scatter_(2, top, drop)
        taken = positions_where(available & ~left_out).indices
        if taken.shape[-1] < kmax:
            taken = torch.nn.functional.pad(taken, (0, kmax - taken.shape[-1]))
        return taken[..., :kmax]
    want = size.to(torch.float32)
    thresh = (want + 4 * torch.sqrt(want) + 16) / n_av.clamp(min=1).to(torch.float32)
    if bool((thresh < 0.5).all()):
        cand = positions_where(keys < thresh[..., None])
        if bool((cand.counts >= size).all()) and cand.width >= kmax:
            ck = torch.gather(keys, 2, cand.indices).masked_fill(~cand.used(), 3.0)
            order = torch.topk(ck, kmax, dim=-1, largest=False, sorted=True).indices
            return torch.gather(cand.indices, 2, order)
    return torch.topk(keys, min(kmax, n), dim=-1, largest=False, sorted=True).indices


def group_scores(scores: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, Hq, X]`` -> ``[B, Hkv, X]``: log of the summed per-head softmax over the GQA group.

    Ranking by it picks the keys with the most attention mass summed over the group's query heads.
    """
    b, hq, x = scores.shape
    logp = torch.log_softmax(scores, dim=-1)
    return torch.logsumexp(logp.view(b, hq // group, group, x), dim=2)


def available_after(inputs: DecodeInputs, chosen: IndexSet) -> torch.Tensor:
    """``[B, Hs, N]`` bool: valid keys not in ``chosen``."""
    mask = inputs.key_mask[:, None, :].expand(inputs.batch, chosen.heads, inputs.n_keys)
    return mask & ~chosen.mark(inputs.n_keys)


def v_read_mask(inputs: DecodeInputs, chosen: IndexSet) -> torch.Tensor:
    """``[B, Hq, N]`` bool V rows read per query head, for :func:`kvsieve.core.method.read_stats`."""
    return chosen.to_heads(inputs.heads).mark(inputs.n_keys)


def exact_heads(inputs: DecodeInputs, chosen: IndexSet) -> torch.Tensor:
    """``[B, Hs]`` bool: the set holds every valid key once at weight 1 (the estimate is exact)."""
    full = chosen.counts == inputs.n_valid[:, None]
    if chosen.weights is not None:
        full = full & ((chosen.weights == 1) | ~chosen.used()).all(-1)
    return full


def exact_row_count(inputs: DecodeInputs, chosen: IndexSet) -> torch.Tensor:
    """Query rows whose every head ran exact attention (the documented fallback), a device scalar."""
    return exact_heads(inputs, chosen).all(-1).sum()


def require_size(name: str, value: object, *, allow_zero: bool = True) -> None:
    """A size is an int count (>= 0, or >= 1) or a float fraction of the context in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected an integer count or a fraction in (0, 1], got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or not 0 < value <= 1:
            raise ValueError(f"{name}: a fraction of the context must lie in (0, 1], got {value}")
    elif value < (0 if allow_zero else 1):
        raise ValueError(f"{name}: expected a count >= {0 if allow_zero else 1}, got {value}")


def size_bound(spec: int | float, n_keys: int) -> int:
    """A host-known upper bound of :func:`resolve_size` for rows of at most ``n_keys`` keys."""
    if isinstance(spec, float):
        return max(1, math.floor(n_keys * spec))
    return int(spec)


def resolve_size(spec: int | float, n_valid: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 from a count or a fraction of ``n_valid``; a positive fraction gives at least 1."""
    if isinstance(spec, float):
        return torch.clamp(torch.floor(n_valid.to(torch.float64) * spec).to(torch.long), min=1)
    return torch.full_like(n_valid, int(spec))


def kv_union_count(inputs: DecodeInputs, *sets: IndexSet) -> torch.Tensor:
    """``[B, Hkv]``: distinct positions of all ``sets`` per KV head (union over its query heads)."""
    marks = None
    for s in sets:
        m = s.to_heads(inputs.heads).mark(inputs.n_keys)
        marks = m if marks is None else marks | m
    b = inputs.batch
    return marks.view(b, inputs.kv_heads, inputs.group, inputs.n_keys).any(2).sum(-1)
