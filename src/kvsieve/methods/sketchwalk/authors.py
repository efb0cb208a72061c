"""Sketch&Walk as its authors' released code computes it: the math of ``sketchwalk``'s default variant.

Per sparse layer, with B-token blocks, head dim d (zero-padded to a power of two n) and
``m = min(hadamard_dim, n)`` sketch features:

1. **Sketch.** Per head, queries and keys are averaged per block (a partial last block is divided by
   B, as averaging a zero-padded block does) and multiplied by ``Φ = (H·D)[P] / √(n/m)``: H the
   *unnormalised* Walsh–Hadamard matrix (entries ±1), D random signs, P the first m entries of a random
   permutation. ``⟨Φu, Φv⟩ = n·⟨u, v⟩`` at m = n. One Φ per layer.
2. **Block scores.** Per head, ``softmax_j(⟨Φq̄_i, Φk̄_j⟩ / √m / 100)`` over *every* key block (their
   code masks nothing; ``causal=True`` masks ``j > i``), summed over heads, each row divided by its sum
   (+1e-12): the block matrix ``A`` (rows sum to 1).
3. **Walk.** ``W ← (1 − β)·A + β·W·A``, ``degree`` times per layer, starting from the previous sparse
   layer's W (from A itself at the first one). In decode the walk stays within the layer: a running
   block matrix (rows = running averages of the rows of recent steps) stands for A, and the row of the
   new step, pooled over the last ``query_window`` queries, is both the start and the anchor.
4. **Selection.** With T keys: ``w = max(1, ⌊window·T⌋)`` window tokens and ``s = max(1, ⌊sink·T⌋)``
   sink tokens, i.e. ``⌈w/B⌉`` window blocks (ending at the query's block) and ``⌈s/B⌉`` sink blocks.
   The threshold of query block i is the ``1 − kblocks_frac`` quantile (linear interpolation) of ``W_i``
   over the causal blocks that are neither sink nor window blocks (none: no block passes); a block is
   kept where ``W_ij`` exceeds it. Prefill: the last ``dense_last_blocks`` query blocks use threshold 0
   (every block), and at the token level the last w keys of each query and the first w keys (their
   sink mask uses the window size) are kept too. Decode: the sink and window blocks are kept, and the
   first w keys.
5. Exact softmax attention over the kept keys (causal), per head.

Their code runs the sketch, the block scores and the walk in bfloat16; this module computes in float32
(float64 for float64 inputs). Every choice, with a line reference into their repository, is listed in
``docs/methods/sketchwalk.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from ...core.context import MethodState
from ...kernels.sketchwalk.authors_reference import ROW_EPS

#: Their sketched logits are divided by √m and then by this constant before the softmax.
LOGIT_DIVISOR = 100.0
# Query rows times keys scored at once by the reference attention (bounds its memory).
_CHUNK_ELEMENTS = 1 << 24


# -- sketch --------------------------------------------------------------------------------------------


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The unnormalised ``n × n`` Walsh–Hadamard matrix in Sylvester (natural) order, float64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n: expected a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sketch_params(d: int, hadamard_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(signs [n] ±1 float64, rows [m] long, m)`` of one layer's sketch for head dim ``d``:
    n = d rounded up to a power of two, m = min(hadamard_dim, n); reproducible from ``seed``."""
    n = 1 << (d - 1).bit_length()
    m = min(hadamard_dim, n)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1
    rows = torch.randperm(n, generator=gen)[:m]
    return signs, rows, m


@functools.lru_cache(maxsize=256)
def _sketch_cpu(d: int, hadamard_dim: int, seed: int) -> torch.Tensor:
    signs, rows, m = sketch_params(d, hadamard_dim, seed)
    n = signs.shape[0]
    phi = (sylvester_hadamard(n) * signs[None, :])[rows] / math.sqrt(n / m)
    # Zero-padding d up to n: only the first d columns ever multiply a nonzero entry.
    return phi[:, :d].contiguous()


def sketch_matrix(d: int, hadamard_dim: int, seed: int, *, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``Φ [m, d]`` with ``Φx`` = their Hadamard projection of x (signs, unnormalised transform, scaling by
    ``1/√(n/m)``, m of the n outputs)."""
    return _sketch_cpu(int(d), int(hadamard_dim), int(seed)).to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=512)
def device_sketch(d: int, hadamard_dim: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`sketch_matrix` kept on its device, one tensor per (layer seed, device, dtype): a copy from host
    memory per layer and call would make the host wait for the device, and a captured step must read the
    same tensor on every replay. Callers must not write into it."""
    return sketch_matrix(d, hadamard_dim, seed, device=device, dtype=dtype)


def pooled_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, H, T, d]`` -> ``[B, H, ⌈T/bs⌉, d]``: block sums divided by the block size (a partial last
    block too, as the mean of the zero-padded block)."""
    b, h, t, d = x.shape
    n = -(-t // block_size)
    if t % block_size:
        x = torch.nn.functional.pad(x, (0, 0, 0, n * block_size - t))
    return x.reshape(b, h, n, block_size, d).sum(3) / block_size


def head_summed_probs(q_sketch: torch.Tensor, k_sketch: torch.Tensor, *, causal_rows: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``Σ_h softmax_j(⟨q̃_{h,r}, k̃_{h,j}⟩ / √m / 100)`` ``[B, R, n]`` from ``q_sketch [B, H, R, m]`` and
    ``k_sketch [B, H, n, m]`` (the same heads); ``causal_rows [R]`` (block of each row) masks ``j > row``."""
    m = q_sketch.shape[-1]
    logits = torch.matmul(q_sketch, k_sketch.transpose(-1, -2)) * m ** -0.5 / LOGIT_DIVISOR
    if causal_rows is not None:
        cols = torch.arange(k_sketch.shape[-2], device=k_sketch.device)
        logits = logits.masked_fill(cols > causal_rows[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1).sum(1)


def normalized(rows: torch.Tensor) -> torch.Tensor:
    """Each row divided by its sum plus 1e-12 (theirs)."""
    return rows / (rows.sum(-1, keepdim=True) + ROW_EPS)


def repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """KV heads ``[B, Hkv, ...]`` repeated to ``heads`` (each query head sees its group's KV head)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def block_matrix(q: torch.Tensor, k: torch.Tensor, phi: torch.Tensor, block_size: int, *, causal: bool,
                 dtype: torch.dtype) -> torch.Tensor:
    """The prompt's block matrix ``A [B, n, n]`` from q ``[B, Hq, N, d]`` and k ``[B, Hkv, N, d]``."""
    hq = q.shape[1]
    q_sketch = pooled_blocks(q.to(dtype), block_size) @ phi.T
    k_sketch = repeat_heads(pooled_blocks(k.to(dtype), block_size), hq) @ phi.T
    n = q_sketch.shape[2]
    rows = torch.arange(n, device=q.device) if causal else None
    return normalized(head_summed_probs(q_sketch, k_sketch, causal_rows=rows))


# -- walk ----------------------------------------------------------------------------------------------


def damped_walk(anchor: torch.Tensor, start: torch.Tensor, step: torch.Tensor, beta: float,
                degree: int) -> torch.Tensor:
    """``W ← (1 − β)·anchor + β·W·step``, ``degree`` times from ``start`` (``[B, R, n]``, step ``[B, n, n]``).
    Prefill: anchor = start = step = A (start: the previous layer's walk after the first sparse layer).
    Decode: anchor = start = the step's row (R = 1), step = the running block matrix."""
    w = start
    for _ in range(degree):
        w = (1.0 - beta) * anchor + beta * torch.matmul(w, step)
    return w


def resized_walk(previous: torch.Tensor, n: int) -> torch.Tensor:
    """The previous layer's walk ``[B, n', n']`` made ``n × n``: cropped, or padded with the identity
    (theirs, for a previous walk of another size)."""
    b, n_prev, _ = previous.shape
    if n_prev == n:
        return previous
    if n_prev > n:
        return previous[:, :n, :n]
    out = torch.eye(n, dtype=previous.dtype, device=previous.device).repeat(b, 1, 1)
    out[:, :n_prev, :n_prev] = previous
    return out


# -- selection -----------------------------------------------------------------------------------------


def reserved(fraction: float, n_tokens: int, block_size: int, n_blocks: int) -> tuple[int, int]:
    """``(tokens, blocks)`` of a sink or window fraction of ``n_tokens`` keys: ``max(1, ⌊f·T⌋)`` tokens,
    ``⌈tokens/B⌉`` blocks (at most ``n_blocks``)."""
    tokens = max(1, int(fraction * n_tokens))
    return tokens, min(n_blocks, max(1, -(-tokens // block_size)))


def quantile_thresholds(w: torch.Tensor, rows: torch.Tensor, *, sink_blocks: int, window_blocks: int,
                        kblocks_frac: float) -> torch.Tensor:
    """``[B, R, 1]``: the ``1 − kblocks_frac`` quantile of ``w [B, R, n]`` over the causal blocks of each
    row (``rows [R]``: its query block) that are neither sink nor window blocks; NaN where none is."""
    cols = torch.arange(w.shape[-1], device=w.device)
    candidate = (cols <= rows[:, None]) & (cols >= sink_blocks) & (cols < rows[:, None] - window_blocks + 1)
    masked = torch.where(candidate, w, torch.full_like(w, float("nan")))
    return torch.nanquantile(masked, 1.0 - kblocks_frac, dim=-1, keepdim=True)


@dataclass(frozen=True)
class PrefillSelection:
    """The prompt's kept keys: block-level ``blocks [B, n, n]`` (causal part only), plus, at the token
    level, each query's last ``window_tokens`` keys and the first ``window_tokens`` keys."""

    blocks: torch.Tensor
    window_tokens: int
    sink_blocks: int
    window_blocks: int


def prefill_selection(w: torch.Tensor, n_tokens: int, *, block_size: int, sink: float, window: float,
                      kblocks_frac: float, dense_last_blocks: int) -> PrefillSelection:
    """Their prefill rule on the walk ``w [B, n, n]``."""
    n = w.shape[-1]
    window_tokens, window_blocks = reserved(window, n_tokens, block_size, n)
    _, sink_blocks = reserved(sink, n_tokens, block_size, n)
    rows = torch.arange(n, device=w.device)
    th = quantile_thresholds(w, rows, sink_blocks=sink_blocks, window_blocks=window_blocks,
                             kblocks_frac=kblocks_frac)
    if dense_last_blocks > 0:
        th = torch.where(rows[:, None] >= n - dense_last_blocks, torch.zeros_like(th), th)
    causal = rows[None, :] <= rows[:, None]
    return PrefillSelection(blocks=(w > th) & causal, window_tokens=window_tokens, sink_blocks=sink_blocks,
                            window_blocks=window_blocks)


def prefill_token_mask(sel: PrefillSelection, rows: torch.Tensor, n_tokens: int, block_size: int) -> torch.Tensor:
    """``[B, R, T]`` keys kept by query tokens ``rows [R]``: their blocks, the window and sink tokens, causal."""
    keys = torch.arange(n_tokens, device=rows.device)
    kept = sel.blocks[:, torch.div(rows, block_size, rounding_mode="floor")][:, :, keys // block_size]
    w = sel.window_tokens
    tokens = ((keys[None, :] > rows[:, None] - w) | (keys[None, :] < w))
    return (kept | tokens) & (keys[None, :] <= rows[:, None])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """Softmax attention of q ``[B, Hq, R, d]`` over the keys ``allowed [B, R, T]`` (k/v ``[B, Hkv, T, ·]``)."""
    hq = q.shape[1]
    logits = torch.matmul(q.to(dtype), repeat_heads(k.to(dtype), hq).transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), repeat_heads(v.to(dtype), hq))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: PrefillSelection | None, *,
                      block_size: int, scale: float, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, N, dv], kept [B, N], touched [B, n, n])``: attention over the kept keys (``sel`` None:
    every causal key), chunked over whole query blocks; ``kept`` counts each query's keys, ``touched``
    marks the key blocks a query block reads at least one key of."""
    b, hq, n_tok, _ = q.shape
    n = -(-n_tok // block_size)
    step = max(1, _CHUNK_ELEMENTS // max(1, b * hq * n_tok * block_size)) * block_size
    outs, kept, touched = [], [], []
    keys = torch.arange(n_tok, device=q.device)
    for lo in range(0, n_tok, step):
        rows = torch.arange(lo, min(n_tok, lo + step), device=q.device)
        if sel is None:
            allowed = (keys[None, :] <= rows[:, None]).expand(b, -1, -1)
        else:
            allowed = prefill_token_mask(sel, rows, n_tok, block_size)
        outs.append(masked_attention(q[:, :, rows], k, v, allowed, scale, dtype))
        kept.append(allowed.sum(-1))
        r_pad = -len(rows) % block_size
        grid = torch.nn.functional.pad(allowed, (0, n * block_size - n_tok, 0, r_pad))
        touched.append(grid.view(b, -1, block_size, n, block_size).any(4).any(2))
    return torch.cat(outs, dim=2), torch.cat(kept, dim=1), torch.cat(touched, dim=1)


# -- per-layer state and the decode step -------------------------------------------------------------------


@dataclass
class AuthorsLayerState(MethodState):
    """What one layer keeps for decode (one request, ``B`` rows): its sketch, the running block matrix
    (``blocks[b, :n_blocks[b], :n_blocks[b]]``; their ``a_blk``) and the last queries of every head
    (``queries[b, :, -n_queries[b]:]``, oldest first), and the prompt's copies of both, so that a step
    at the first position after the prompt (a rewind) starts again from them.

    Decode steps update the running matrix as running averages, so a row's steps must come in order:
    ``last_pos`` is the position of the last token each row has seen (-1: none)."""

    phi: torch.Tensor  # [m, d]
    blocks: torch.Tensor  # [B, cap, cap]
    n_blocks: torch.Tensor  # [B] int64
    queries: torch.Tensor  # [B, Hq, W, d]
    n_queries: torch.Tensor  # [B] int64
    last_pos: torch.Tensor  # [B] int64
    prompt_blocks: torch.Tensor  # [B, n0, n0] (n0 = 0 without a prompt)
    prompt_queries: torch.Tensor  # [B, Hq, W, d]
    prompt_n_queries: torch.Tensor  # [B] int64
    prompt_len: int  # the prompt's tokens (0 without one; -1: the rows' prompts differ, see prompt_lens)
    has_history: bool  # True when a prompt was recorded
    prompt_lens: torch.Tensor | None = None  # [B] int64: each row's prompt tokens
    prompt_n_blocks: torch.Tensor | None = None  # [B] int64: each row's prompt blocks

    @classmethod
    def stack_rows(cls, rows: list[MethodState]) -> AuthorsLayerState:
        """One batch state from the rows' (each prefilled alone): their sketch is the layer's, shared; each
        row keeps its own restart point (``prompt_lens``), so rows of different prompt lengths stack."""
        lengths = {r.prompt_len for r in rows}
        head = rows[0]
        common = lengths.pop() if len(lengths) == 1 else -1
        parts = [dataclasses.replace(r, phi=head.phi[None], prompt_len=common) for r in rows]
        stacked = MethodState.stack_rows.__func__(cls, parts)
        stacked.phi = head.phi
        return stacked

    @classmethod
    def from_prompt(cls, phi: torch.Tensor, a: torch.Tensor, q: torch.Tensor, query_window: int) -> AuthorsLayerState:
        """After a prompt: ``a [B, n, n]`` its block matrix, q ``[B, Hq, N, d]`` its queries."""
        b, hq, n_tok, d = q.shape
        win = min(query_window, n_tok)
        queries = a.new_zeros(b, hq, query_window, d)
        queries[:, :, query_window - win:] = q[:, :, n_tok - win:].to(a.dtype)
        n_queries = torch.full((b,), win, dtype=torch.long, device=a.device)
        return cls(phi=phi, blocks=a.clone(), n_blocks=torch.full((b,), a.shape[-1], dtype=torch.long,
                                                                   device=a.device),
                   queries=queries.clone(), n_queries=n_queries.clone(),
                   last_pos=torch.full((b,), n_tok - 1, dtype=torch.long, device=a.device),
                   prompt_blocks=a, prompt_queries=queries, prompt_n_queries=n_queries, prompt_len=n_tok,
                   has_history=True, prompt_lens=torch.full((b,), n_tok, dtype=torch.long, device=a.device),
                   prompt_n_blocks=torch.full((b,), a.shape[-1], dtype=torch.long, device=a.device))

    @classmethod
    def fresh(cls, phi: torch.Tensor, batch: int, heads: int, query_window: int,
              dtype: torch.dtype) -> AuthorsLayerState:
        """No prompt seen: the first step's row fills the block matrix (their growth rule from zero blocks)."""
        dev, d = phi.device, phi.shape[1]
        zeros = torch.zeros(batch, dtype=torch.long, device=dev)
        queries = torch.zeros(batch, heads, query_window, d, dtype=dtype, device=dev)
        return cls(phi=phi, blocks=torch.zeros(batch, 0, 0, dtype=dtype, device=dev), n_blocks=zeros.clone(),
                   queries=queries, n_queries=zeros.clone(), last_pos=zeros - 1,
                   prompt_blocks=torch.zeros(batch, 0, 0, dtype=dtype, device=dev), prompt_queries=queries.clone(),
                   prompt_n_queries=zeros.clone(), prompt_len=0, has_history=False)

    def grow(self, n_blocks: int) -> None:
        """Room for ``n_blocks`` blocks (doubling: a decode loop grows rarely)."""
        cap = self.blocks.shape[1]
        if n_blocks > cap:
            extra = max(n_blocks, 2 * cap) - cap
            self.blocks = torch.nn.functional.pad(self.blocks, (0, extra, 0, extra))

    def begin_step(self, row: int, pos: int) -> None:
        """Check the order of row ``row``'s steps; at the first position after the prompt, restart from it."""
        prompt_len, n0 = self.prompt_len, self.prompt_blocks.shape[-1]
        if self.prompt_lens is not None:
            prompt_len, n0 = int(self.prompt_lens[row]), int(self.prompt_n_blocks[row])
        if self.has_history and pos == prompt_len:
            self.blocks[row] = 0
            self.blocks[row, :n0, :n0] = self.prompt_blocks[row, :n0, :n0]
            self.n_blocks[row] = n0
            self.queries[row] = self.prompt_queries[row]
            self.n_queries[row] = self.prompt_n_queries[row]
            self.last_pos[row] = pos - 1
        last = int(self.last_pos[row])
        if last >= 0 and pos != last + 1:
            raise ValueError(f"lengths: variant=authors keeps running averages over the decode steps; row {row} "
                             f"steps to position {pos} after position {last} (steps must come one token at a "
                             "time, or start again right after the prompt)")
        self.last_pos[row] = pos


@dataclass(frozen=True)
class DecodeRowResult:
    """One query row's decode step: its output ``[Hq, dv]``, kept keys ``[T]``, kept blocks ``[n]``, the
    walk row ``[n]`` and whether the context was too short for the rule (every block kept)."""

    out: torch.Tensor
    kept_tokens: torch.Tensor
    kept_blocks: torch.Tensor
    walk: torch.Tensor
    short: bool


def decode_row(st: AuthorsLayerState, row: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               block_size: int, beta: float, degree: int, query_window: int, sink: float, window: float,
               kblocks_frac: float, scale: float, dtype: torch.dtype) -> DecodeRowResult:
    """Their decode step for state row ``row``: q ``[Hq, d]`` the new token's query, k/v ``[Hkv, T, ·]`` its
    row's keys (the new one last)."""
    hq = q.shape[0]
    n_tok = k.shape[1]
    pos = n_tok - 1
    st.begin_step(row, pos)
    # the last query_window queries, this one included
    nq = int(st.n_queries[row])
    recent = torch.cat([st.queries[row, :, query_window - nq:], q.to(dtype)[:, None]], dim=1)[:, -query_window:]
    nq = recent.shape[1]
    st.queries[row, :, query_window - nq:] = recent
    st.n_queries[row] = nq
    # this step's block row: pooled over heads and the recent queries, every key block of the row
    k_sketch = repeat_heads(pooled_blocks(k[None].to(dtype), block_size), hq) @ st.phi.T  # [1, Hq, n, m]
    probs = head_summed_probs((recent @ st.phi.T)[None], k_sketch)  # [1, W, n]
    r = normalized(probs.sum(1))[0]  # [n]
    n = r.shape[0]
    # the running block matrix: new blocks' rows start as this row; then block c's row and column
    st.grow(n)
    a = st.blocks[row]
    n_prev = int(st.n_blocks[row])
    if n > n_prev:
        a[n_prev:n, :n] = r
        st.n_blocks[row] = n
    c = min(pos // block_size, n - 1)
    s = pos % block_size
    alpha = 1.0 if s == 0 else 1.0 / (s + 1)
    a[c, :n] = (1 - alpha) * a[c, :n] + alpha * r
    a[c, :n] = a[c, :n] / a[c, :n].sum().clamp(min=ROW_EPS)
    a[:n, c] = (1 - alpha) * a[:n, c] + alpha * r
    a[:n, :n] = a[:n, :n] / a[:n, :n].sum(-1, keepdim=True).clamp(min=ROW_EPS)
    walk = damped_walk(r[None, None], r[None, None], a[None, :n, :n], beta, degree)[0, 0]
    # selection: sink and window blocks, and the blocks above the quantile of the others
    window_tokens, window_blocks = reserved(window, n_tok, block_size, n)
    _, sink_blocks = reserved(sink, n_tok, block_size, n)
    qb = pos // block_size
    th = quantile_thresholds(walk[None, None], torch.tensor([qb], device=q.device), sink_blocks=sink_blocks,
                             window_blocks=window_blocks, kblocks_frac=kblocks_frac)[0, 0]
    cols = torch.arange(n, device=q.device)
    kept_blocks = (walk > th) | (cols < sink_blocks) | ((cols >= qb - window_blocks + 1) & (cols <= qb))
    short = n <= sink_blocks + window_blocks  # every block is a sink or window block
    keys = torch.arange(n_tok, device=q.device)
    kept_tokens = kept_blocks[keys // block_size] | (keys < window_tokens)
    out = masked_attention(q[None, :, None], k[None], v[None], kept_tokens[None, None], scale, dtype)[0, :, 0]
    return DecodeRowResult(out=out, kept_tokens=kept_tokens, kept_blocks=kept_blocks, walk=walk, short=short)
