"""Sketch&Walk as the project first reconstructed it from the paper's prose (``variant=reconstruction``):
SRHT block sketches of head-averaged queries and keys, causal block scores raised to the power α, the walk
``W ← rownorm(W·Ã)`` across the sparse layers of a forward pass and a top-⌈ρ(i+1)⌉ block selection; the
math as plain functions on tensors, and the per-layer decode state (:class:`LayerSketch`).
The method class in :mod:`kvsieve.methods.sketchwalk` serves this and the authors' algorithm
(:mod:`kvsieve.methods.sketchwalk.authors`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ...core.config import require_int
from ...core.context import MethodState

DEFAULT_SKETCH_DIM = 64  # the paper's m
# Weight of the one-hop score added to the walk score for ranking only: breaks ties and ranks rows
# whose walk entries underflowed to zero, without reordering distinct walk scores.
TIE_BREAK = 1e-6


# -- the math, as plain functions on tensors --------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _srht_cpu(d: int, m: int, seed: int) -> torch.Tensor:
    try:
        from scipy.linalg import hadamard  # the field's own Walsh–Hadamard matrix (Sylvester order)
    except ImportError:
        raise ImportError("sketchwalk needs scipy for its Hadamard transform: "
                          "pip install 'kvsieve[sketchwalk]'") from None

    d_pad = 1 << (d - 1).bit_length()
    gen = torch.Generator().manual_seed(seed)
    signs = (torch.randint(0, 2, (d_pad,), generator=gen) * 2 - 1).to(torch.float64)  # D
    rows = torch.randperm(d_pad, generator=gen)[:m].sort().values  # P: m rows without replacement
    h = torch.from_numpy(hadamard(d_pad)).to(torch.float64) / math.sqrt(d_pad)  # normalized H
    phi = math.sqrt(d_pad / m) * h[rows] * signs[None, :]
    # Zero-padding d up to a power of two keeps every inner product; only the first d columns act.
    return phi[:, :d].contiguous()


def srht_matrix(d: int, m: int, seed: int, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Φ [m, d] = √(d'/m)·P·H·D`` (``d'`` = d rounded up to a power of two): ⟨Φu, Φv⟩ is unbiased
    for ⟨u, v⟩ and exact at ``m = d'``. Reproducible from ``seed``."""
    require_int("sketch_dim", m, minimum=1)
    if m > d:
        raise ValueError(f"sketch_dim: m = {m} exceeds the head dim d = {d}; expected m <= d")
    return _srht_on(int(d), int(m), int(seed), torch.device(device), dtype)


@functools.lru_cache(maxsize=64)
def _srht_on(d: int, m: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # Kept per device: a host-to-device copy on every layer would wait for the device's queue.
    return _srht_cpu(d, m, seed).to(device=device, dtype=dtype)


def head_mean(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, T, d]`` -> ``[B, T, d]``: the mean over heads (under GQA, that of the KV heads equals
    that of their repeats)."""
    # mean(dtype=) reads bf16/fp16 as it is on CUDA and accumulates in float32 (the same sums); x.to(dtype)
    # first wrote an fp32 copy of every head and read it back: 5 GiB of traffic for a 128k-token Llama
    # layer's queries against 1 GiB.
    return x.mean(1, dtype=dtype)


def block_sums(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, T, d]`` -> ``[B, ⌈T/bs⌉, d]``: per-block sums (the last block may be partial)."""
    b, t, d = x.shape
    n = -(-t // block_size)
    if t % block_size:  # pad copies x even when it adds nothing
        x = torch.nn.functional.pad(x, (0, 0, 0, n * block_size - t))
    return x.reshape(b, n, block_size, d).sum(2)


def block_means(sums: torch.Tensor, n_tokens: int, block_size: int) -> torch.Tensor:
    """``sums [B, n, d]`` of an ``n_tokens`` prefix divided by the tokens of each block: the same floats
    as dividing by :func:`block_token_counts`, in one division (plus one when the last block is partial)."""
    means = sums / block_size
    tail = n_tokens - (sums.shape[1] - 1) * block_size
    if tail != block_size:
        means[:, -1] = sums[:, -1] / tail
    return means


def block_token_counts(n_tokens: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n]`` tokens per block of an ``n_tokens`` prefix."""
    n = -(-n_tokens // block_size)
    start = torch.arange(n, device=device) * block_size
    return torch.clamp(n_tokens - start, max=block_size)


def causal_log_scores(q_sketch: torch.Tensor, k_sketch: torch.Tensor, logit_scale: float,
                      rows: torch.Tensor) -> torch.Tensor:
    """``log Â [B, R, n]``: log-softmax over key blocks ``j ≤ rows[b, r]`` of the sketched logits,
    ``-inf`` above. ``q_sketch [B, R, m]``, ``k_sketch [B, n, m]``, ``rows [B, R]`` (block index of each
    query row)."""
    logits = torch.matmul(q_sketch, k_sketch.transpose(-1, -2)) * logit_scale
    cols = torch.arange(k_sketch.shape[1], device=k_sketch.device)
    logits = logits.masked_fill(cols > rows[..., None], float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def oracle_block_mass(q: torch.Tensor, k: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """``A* [B, n, n]``: the exact causal attention mass of query block ``i`` on key block ``j``,
    averaged over the block's query rows and over heads (the spec's Definition 2.1 (b)). Chunked
    over query blocks; costs dense attention."""
    b, hq, n_tok, d = q.shape
    group = hq // k.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    n = -(-n_tok // block_size)
    kk = k.to(dtype).repeat_interleave(group, 1)
    out = q.new_zeros(b, n, n, dtype=dtype)
    cols = torch.arange(n_tok, device=q.device)
    step = max(1, (1 << 24) // max(1, hq * block_size * n_tok))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        rows = torch.arange(lo * block_size, min(hi * block_size, n_tok), device=q.device)
        logits = torch.matmul(q[:, :, rows].to(dtype), kk.transpose(-1, -2)) * scale
        probs = torch.softmax(logits.masked_fill(cols[None, :] > rows[:, None], float("-inf")), -1).mean(1)
        mass = block_sums(probs.transpose(1, 2), block_size).transpose(1, 2)  # [B, rows, n]
        per_block = block_sums(mass, block_size)[:, : hi - lo]
        out[:, lo:hi] = per_block / block_token_counts(n_tok, block_size, q.device)[lo:hi, None].to(dtype)
    return out


def hadamard_power(log_a: torch.Tensor, alpha: float) -> torch.Tensor:
    """``Â^α`` element-wise, from ``log Â`` (so that small entries lose no precision before ``exp``)."""
    return torch.exp(alpha * log_a)


def times_with_row(x: torch.Tensor, rows_cache: torch.Tensor, last_row: torch.Tensor,
                   last: torch.Tensor) -> torch.Tensor:
    """``x · M`` where ``M`` holds ``rows_cache[b, j]`` for ``j < last[b]`` and ``last_row[b]`` as row
    ``last[b]`` (rows beyond it are never reached, by causality). ``x [B, n]``, ``rows_cache
    [B, n, n]``, ``last_row [B, n]``, ``last [B]``."""
    return times_with_rows(x[:, None], rows_cache, last_row[:, None], last[:, None])[:, 0]


def times_with_rows(x: torch.Tensor, rows_cache: torch.Tensor, last_row: torch.Tensor,
                    last: torch.Tensor) -> torch.Tensor:
    """:func:`times_with_row` for ``Q`` rows per batch row, each with its own last row: ``x [B, Q, n]``,
    ``rows_cache [B, n, n]``, ``last_row [B, Q, n]``, ``last [B, Q]``; row ``(b, j)`` is ``x[b, j] · M``
    with ``M`` holding ``rows_cache[b]`` above row ``last[b, j]`` and ``last_row[b, j]`` as that row."""
    cols = torch.arange(x.shape[-1], device=x.device)
    before = torch.where(cols < last[..., None], x, 0.0)
    at_last = x.gather(-1, last[..., None])
    return torch.matmul(before, rows_cache) + at_last * last_row


def normalize_rows(w: torch.Tensor) -> torch.Tensor:
    """Each row divided by its maximum: exact for row-wise top-k (``D·W`` then ``·Ã`` ranks as ``W·Ã``)."""
    return w / w.amax(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)


def block_budget(rows: torch.Tensor, density: float, *, fixed_k: bool, n_blocks: int | torch.Tensor) -> torch.Tensor:
    """Blocks kept by query block ``rows`` (any int tensor): ``max(2, ⌈ρ(i+1)⌉)`` or, with ``fixed_k``,
    ``max(2, ⌈ρ·n_blocks⌉)``, never more than its ``i + 1`` causal blocks. ``n_blocks``: an int, or a
    tensor shaped like ``rows`` (one context per row)."""
    causal = rows.to(torch.float64) + 1
    if not fixed_k:
        base = causal
    elif isinstance(n_blocks, torch.Tensor):
        base = n_blocks.to(torch.float64).expand_as(causal)
    else:
        base = torch.full_like(causal, float(n_blocks))
    # The 1e-9 keeps ρ·(i+1) that is an integer in exact arithmetic (0.7·10) from rounding up.
    k = torch.clamp(torch.ceil(density * base - 1e-9), min=2)
    return torch.minimum(k, causal).long()


def max_block_budget(n_blocks: int, density: float, *, fixed_k: bool) -> int:
    """The largest :func:`block_budget` over query blocks ``0..n_blocks-1`` (a host integer)."""
    # block_budget's arithmetic on host floats (the same IEEE doubles), for the last query block
    k = max(2.0, math.ceil(density * float(n_blocks) - 1e-9))
    return int(min(k, float(n_blocks)))


def select_blocks(scores: torch.Tensor, rows: torch.Tensor, budget: torch.Tensor,
                  kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block 0, block ``rows`` and the top ``budget − 2`` of ``scores`` over blocks ``1..rows−1``.

    ``scores [B, R, n]``, ``rows [B, R]``, ``budget [B, R]`` (≤ rows + 1), ``kmax`` ≥ every budget.
    Returns ``(block_idx [B, R, kmax], counts [B, R])``: used entries ascending (so the diagonal is
    last), padding entries 0.
    """
    b, r, n = scores.shape
    cols = torch.arange(n, device=scores.device)
    middle = (cols >= 1) & (cols < rows[..., None])
    parts = [torch.zeros(b, r, 1, dtype=torch.long, device=scores.device)]
    extra = min(kmax - 2, n)
    if extra > 0:
        top = torch.topk(torch.where(middle, scores, float("-inf")), extra, dim=-1).indices
        used = torch.arange(extra, device=scores.device) < (budget - 2)[..., None]
        parts.append(torch.where(used, top, n))
    parts.append(torch.where(rows > 0, rows, n)[..., None])
    chosen = torch.cat(parts, dim=-1).sort(dim=-1).values
    if chosen.shape[-1] < kmax:
        chosen = torch.nn.functional.pad(chosen, (0, kmax - chosen.shape[-1]), value=n)
    valid = chosen < n
    return torch.where(valid, chosen, 0)[..., :kmax], valid.sum(-1)


# -- per-layer decode state ------------------------------------------------------------------------------


@dataclass
class LayerSketch(MethodState):
    """What one layer keeps for decode (one request): the head-averaged query of every token seen, sums
    over blocks of head-averaged keys and queries, key sketches, and ``Â``/``Ã`` rows of completed blocks;
    capacities in tokens and blocks.

    A decode call recomputes its token's block (sums and sketch) from ``q_tok`` and the cache's keys
    rather than adding to running sums: a repeated call, a rewound cache or a replayed CUDA graph
    gives the same state as the first call, with nothing for the host to check. Blocks before the
    token's are final (append-only cache); rows of ``Ã`` are written when their block completes."""

    q_tok: torch.Tensor  # [B, cap_tokens, d] head-averaged queries (zero where not seen)
    k_sum: torch.Tensor  # [B, cap, d]
    q_sum: torch.Tensor  # [B, cap, d]
    k_sketch: torch.Tensor  # [B, cap, m]
    a_hat: torch.Tensor | None  # [B, cap, cap] rows of Â (walk_power=matrix only)
    a_tilde: torch.Tensor  # [B, cap, cap] rows of Ã
    has_history: bool  # True when the queries of every token since position 0 were seen

    @property
    def capacity(self) -> int:
        return self.k_sum.shape[1]

    def grow(self, n_blocks: int, n_tokens: int) -> None:
        """Room for ``n_blocks`` blocks and ``n_tokens`` tokens (doubling: a decode loop grows rarely)."""
        pad = torch.nn.functional.pad
        if n_tokens > self.q_tok.shape[1]:
            self.q_tok = pad(self.q_tok, (0, 0, 0, max(n_tokens, 2 * self.q_tok.shape[1]) - self.q_tok.shape[1]))
        if n_blocks <= self.capacity:
            return
        extra = max(n_blocks, 2 * self.capacity) - self.capacity
        self.k_sum = pad(self.k_sum, (0, 0, 0, extra))
        self.q_sum = pad(self.q_sum, (0, 0, 0, extra))
        self.k_sketch = pad(self.k_sketch, (0, 0, 0, extra))
        self.a_tilde = pad(self.a_tilde, (0, extra, 0, extra))
        if self.a_hat is not None:
            self.a_hat = pad(self.a_hat, (0, extra, 0, extra))
