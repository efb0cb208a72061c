"""variant=authors' decode on the device: every row of a batch in one step, no host read, capturable.

The same math as ``kvsieve.methods.sketchwalk.authors.decode_row`` (the per-row reference), on a
state made once per request at capacity (:class:`AuthorsDeviceState`):

- the running block matrix as ``A = diag(σ)·U``: ``U [B, C, C]`` unnormalised, ``σ [B, C]`` per-row
  scales and ``S [B, C]`` the row sums of ``U``. A step rewrites row ``c`` and column ``c`` of ``U`` and
  renormalises every row through ``σ`` alone, so it costs O(C) instead of the reference's O(C²), and the
  walk folds ``σ`` into its vector (``w·A = (w⊙σ)·U``);
- per KV head the pooled key-block sums and their sketches: a step adds the new key to its block's sum
  and re-sketches that block alone (K is read once, when the state is made);
- the sketches of the last ``query_window`` queries in a ring (slot = position mod the window);
- the prompt's copies of what a step changes (row and column of the prompt's last block, the row sums,
  the query ring, the partial last block's key sum), so that a step at the first position after a row's
  prompt (a rewind) restarts from the prompt in O(C).

A step out of order (neither the next position nor the first after the prompt) cannot raise without a
host read: it sets the row's ``order_error`` flag, which the step's stats report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.context import MethodState
from ...core.inputs import DecodeInputs
from ...core.method import read_stats
from ...core.stats import StepStats
from ...kernels.sketchwalk import authors_decode as kd
from ...kernels.sketchwalk import authors_reference as kr
from ...kernels.sketchwalk import authors_walk as kw
from ..shared.backend import kernel_operands
from .authors import (
    LOGIT_DIVISOR,
    AuthorsLayerState,
    decode_row,
    masked_attention,
    pooled_blocks,
    reserved,
)


@dataclass
class AuthorsDeviceState(MethodState):
    """One layer's variant=authors decode state for one request, at capacity (``C`` blocks)."""

    phi: torch.Tensor  # [m, d]
    u: torch.Tensor  # [B, C, C] unnormalised running block matrix
    sigma: torch.Tensor  # [B, C] row scales: A = sigma[:, :, None] * u
    rsum: torch.Tensor  # [B, C] row sums of u over the row's blocks
    n_blocks: torch.Tensor  # [B] int64
    qs: torch.Tensor  # [B, Hq, W, m] query sketches, slot = position % W
    n_queries: torch.Tensor  # [B] int64
    ksum: torch.Tensor  # [B, Hkv, C, d] key sums per block
    ks: torch.Tensor  # [B, Hkv, C, m] key-block sketches (ksum / block_size @ phi.T)
    last_pos: torch.Tensor  # [B] int64, -1: no token seen
    order_error: torch.Tensor  # [B] bool, sticky
    prompt_len: torch.Tensor  # [B] int64, -1: no prompt (no restart point)
    p_nblocks: torch.Tensor  # [B] int64
    p_row: torch.Tensor  # [B, C] the prompt's row n0 - 1
    p_col: torch.Tensor  # [B, C] the prompt's column n0 - 1
    p_rsum: torch.Tensor  # [B, C]
    p_qs: torch.Tensor  # [B, Hq, W, m]
    p_nq: torch.Tensor  # [B] int64
    p_kpart: torch.Tensor  # [B, Hkv, d] key sum of the prompt's partial last block
    logits: torch.Tensor  # [B, Hkv, C, G·W] ring rows' logits against the blocks (valid up to the last step's block)
    closed_max: torch.Tensor  # [B, Hkv, G·W] max of the scaled logits over the closed blocks j < n_closed
    closed_sum: torch.Tensor  # [B, Hkv, G·W] Σ exp(scaled logit − closed_max) over them
    n_closed: torch.Tensor  # [B, Hkv] int64
    p_logits: torch.Tensor  # [B, Hkv, Cp, G·W] the prompt ring's logits against the prompt's blocks
    p_closed_max: torch.Tensor  # [B, Hkv, G·W] over the prompt's closed blocks
    p_closed_sum: torch.Tensor  # [B, Hkv, G·W]
    logit_scale: float  # the factor of the logits in the closed sums
    fresh_rows: bool  # host: the next step is the first of rows that saw no prompt (rows [n_prev, n) appear)
    block_size: int
    source: object = field(default=None, repr=False, compare=False)  # the AuthorsLayerState it was made from
    last_step: DeviceStep | None = field(default=None, repr=False, compare=False)  # the last step's selection
    tail_fresh: bool = field(default=False, repr=False, compare=False)  # host: the last tail started fresh rows

    @property
    def capacity_blocks(self) -> int:
        return self.u.shape[-1]

    def grow(self, n_blocks: int) -> None:
        """Room for ``n_blocks`` blocks (a caller whose cache grows and gives no capacity; not captured)."""
        extra = n_blocks - self.capacity_blocks
        if extra <= 0:
            return
        pad = torch.nn.functional.pad
        self.u = pad(self.u, (0, extra, 0, extra))
        self.sigma = pad(self.sigma, (0, extra), value=1.0)
        for name in ("rsum", "p_row", "p_col", "p_rsum"):
            setattr(self, name, pad(getattr(self, name), (0, extra)))
        self.ksum = pad(self.ksum, (0, 0, 0, extra))
        self.ks = pad(self.ks, (0, 0, 0, extra))
        self.logits = pad(self.logits, (0, 0, 0, extra))

    @classmethod
    def from_layer_state(cls, st: AuthorsLayerState, k: torch.Tensor, lengths: torch.Tensor, *,
                         block_size: int, capacity: int) -> AuthorsDeviceState:
        """The device state of ``st`` (the prompt's record, or a fresh one) at ``capacity`` tokens a row;
        ``k [B, Hkv, N, d]`` the first call's keys (its key sums are made from them once)."""
        phi = st.phi
        dtype, dev = phi.dtype, phi.device
        b, hq, w, d = st.queries.shape
        hkv = k.shape[1]
        bs = block_size
        cap_blocks = -(-capacity // bs)
        n_st = st.blocks.shape[-1]
        if n_st > cap_blocks:
            # the per-row reference grows its matrix by doubling, so its room can exceed the blocks it
            # holds; only those must fit (a host read, once, where the state is made)
            held = int(st.n_blocks.max()) if st.n_blocks.numel() else 0
            if held > cap_blocks:
                raise ValueError(f"context.capacity: {capacity} tokens ({cap_blocks} blocks) is less than the "
                                 f"{held} blocks the prompt already holds")
            n_st = cap_blocks
        u = torch.zeros(b, cap_blocks, cap_blocks, dtype=dtype, device=dev)
        u[:, :n_st, :n_st] = st.blocks[:, :n_st, :n_st].to(dtype)
        rsum = u.sum(-1)
        sigma = torch.ones(b, cap_blocks, dtype=dtype, device=dev)
        prompt_lens, p_nblocks = prompt_rows(st, b, dev)
        has_prompt = prompt_lens >= 0
        n0 = p_nblocks.clamp(min=1)
        pb = torch.zeros(b, cap_blocks, cap_blocks, dtype=dtype, device=dev)
        n_p = st.prompt_blocks.shape[-1]
        pb[:, :n_p, :n_p] = st.prompt_blocks.to(dtype)
        rows = torch.arange(b, device=dev)
        p_row = pb[rows, n0 - 1]
        p_col = pb[rows, :, n0 - 1]
        p_rsum = pb.sum(-1)
        # key sums of the keys each row has seen before its next token
        seen = st.last_pos + 1 if st.has_history else lengths.long().to(dev) - 1
        n_tok = k.shape[2]
        keys = torch.arange(n_tok, device=dev)
        kf = k.to(dtype) * (keys[None, :] < seen[:, None])[:, None, :, None]
        ksum = torch.zeros(b, hkv, cap_blocks, d, dtype=dtype, device=dev)
        pooled = pooled_blocks(kf, bs) * bs  # block sums
        ksum[:, :, :pooled.shape[2]] = pooled[:, :, :cap_blocks]
        ks = (ksum / bs) @ phi.T
        part = (keys[None, :] >= (prompt_lens // bs * bs)[:, None]) & (keys[None, :] < prompt_lens[:, None])
        p_kpart = (k.to(dtype) * part[:, None, :, None]).sum(2)
        qs = ring_sketches(st.queries, st.n_queries, st.last_pos, phi)
        p_last = torch.where(has_prompt, prompt_lens - 1, -1)
        p_qs = ring_sketches(st.prompt_queries, st.prompt_n_queries, p_last, phi)
        scale = logit_scale(phi.shape[0])
        n_closed = torch.div(seen, bs, rounding_mode="floor")  # the next step's block
        logits, closed_max, closed_sum = kr.logit_cache_reference(qs, ks, n_closed, scale)
        p_cap = max(1, n_p)  # the prompt's closed blocks (c at a restart) are below its block count
        p_logits, p_closed_max, p_closed_sum = kr.logit_cache_reference(
            p_qs, ks[:, :, :p_cap], torch.div(prompt_lens.clamp(min=0), bs, rounding_mode="floor"), scale)
        return cls(phi=phi, u=u, sigma=sigma, rsum=rsum, n_blocks=st.n_blocks.clone(), qs=qs,
                   n_queries=st.n_queries.clone(), ksum=ksum, ks=ks, last_pos=st.last_pos.clone(),
                   order_error=torch.zeros(b, dtype=torch.bool, device=dev), prompt_len=prompt_lens,
                   p_nblocks=p_nblocks, p_row=p_row, p_col=p_col, p_rsum=p_rsum, p_qs=p_qs,
                   p_nq=st.prompt_n_queries.clone(), p_kpart=p_kpart, logits=logits, closed_max=closed_max,
                   closed_sum=closed_sum, n_closed=n_closed[:, None].expand(b, hkv).contiguous(),
                   p_logits=p_logits, p_closed_max=p_closed_max, p_closed_sum=p_closed_sum,
                   logit_scale=scale, fresh_rows=not st.has_history, block_size=bs)


def logit_scale(sketch_dim: int) -> float:
    """The factor of the sketch logits before their softmax (``authors.head_summed_probs``')."""
    return sketch_dim ** -0.5 / LOGIT_DIVISOR


def prompt_rows(st: AuthorsLayerState, b: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_len [B], prompt blocks [B])`` of each row (-1 and 0 without a prompt)."""
    if not st.has_history:
        return torch.full((b,), -1, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev)
    if st.prompt_lens is not None:
        lens = st.prompt_lens.to(dev).long()
    else:
        lens = torch.full((b,), st.prompt_len, dtype=torch.long, device=dev)
    n_p = st.prompt_blocks.shape[-1]
    if st.prompt_n_blocks is not None:
        return lens, st.prompt_n_blocks.to(dev).long()
    return lens, torch.full((b,), n_p, dtype=torch.long, device=dev)


def ring_sketches(queries: torch.Tensor, n_queries: torch.Tensor, last_pos: torch.Tensor,
                  phi: torch.Tensor) -> torch.Tensor:
    """Right-aligned queries ``[B, Hq, W, d]`` (the last ``n_queries`` valid, the newest at position
    ``last_pos``) as sketches in ring slots ``position % W``."""
    b, hq, w, _ = queries.shape
    dev = queries.device
    i = torch.arange(w, device=dev)  # i-th newest
    src = w - 1 - i
    slot = torch.remainder(last_pos[:, None] - i[None, :], w)  # [B, W]
    sk = queries.to(phi.dtype) @ phi.T  # [B, Hq, W, m]
    gathered = sk[:, :, src]  # newest first
    valid = (i[None, :] < n_queries[:, None])[:, None, :, None]
    out = torch.zeros_like(sk)
    out.scatter_(2, slot[:, None, :, None].expand_as(sk), torch.where(valid, gathered, torch.zeros_like(gathered)))
    return out


@dataclass(frozen=True)
class DeviceStep:
    """One batched step's results: walk ``[B, C]``, kept blocks ``[B, C]``, first-keys bound
    ``window_tokens [B]``, block counts ``n [B]``, ``short [B]`` (every block a sink or window block), and the
    kept blocks past the first keys as pages ``[B, P]`` with their ``counts [B]`` (the sparse kernel's list)."""

    walk: torch.Tensor
    kept_blocks: torch.Tensor
    window_tokens: torch.Tensor
    n: torch.Tensor
    short: torch.Tensor
    pages: torch.Tensor
    counts: torch.Tensor


def device_step(st: AuthorsDeviceState, q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, *, beta: float,
                degree: int, sink: float, window: float, kblocks_frac: float, max_pages: int,
                kernels: bool = False) -> DeviceStep:
    """One decode step of every row: q ``[B, Hq, d]`` the new tokens' queries, k ``[B, Hkv, N, d]`` the
    cache (the new key at ``lengths − 1``). Updates ``st`` in place; no host read. ``max_pages``: the page
    list's bound. ``kernels``: the Triton step (:mod:`kvsieve.kernels.sketchwalk.authors_decode`: 5 + ``degree``
    Triton launches), or its torch reference (about a hundred launches)."""
    scale = logit_scale(st.phi.shape[0])
    if kernels:
        r = kd.row_update_triton(st, q, k, lengths, scale=scale)
        sel = kw.walk_select_triton(st, r, lengths, beta=beta, degree=degree, sink=sink, window=window,
                                    q=1.0 - kblocks_frac, max_pages=max_pages)
    else:
        r = kr.row_update_reference(st, q, k, lengths, scale=scale)
        sel = kr.walk_select_reference(st, r, lengths, beta=beta, degree=degree, sink=sink, window=window,
                                       q=1.0 - kblocks_frac, max_pages=max_pages)
    return DeviceStep(walk=sel["walk"], kept_blocks=sel["kept"], window_tokens=sel["window_tokens"], n=sel["n"],
                      short=sel["short"], pages=sel["pages"], counts=sel["counts"])


def kept_token_mask(step: DeviceStep, n_keys: int, block_size: int, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` the keys a step keeps: its blocks' keys and the first ``window_tokens``, below the length."""
    keys = torch.arange(n_keys, device=lengths.device)
    blk = torch.div(keys, block_size, rounding_mode="floor").clamp(max=step.kept_blocks.shape[1] - 1)
    return ((step.kept_blocks[:, blk] | (keys[None, :] < step.window_tokens[:, None]))
            & (keys[None, :] < lengths.long()[:, None]))


def max_kept_pages(n_keys: int, block_size: int, *, sink: float, window: float, kblocks_frac: float) -> int:
    """A host bound on :func:`page_list`'s count for rows of at most ``n_keys`` keys: the sink and window
    blocks and the candidates above the quantile (at most ``⌈f·M⌉ + 1`` of M), plus a block of slack
    for the rounding of shorter rows."""
    n = -(-n_keys // block_size)
    _, wb = reserved(window, n_keys, block_size, n)
    _, sb = reserved(sink, n_keys, block_size, n)
    cand = max(0, n - sb - wb)
    return max(1, min(n, sb + wb + math.ceil(kblocks_frac * cand) + 2))


def decode_batched(cfg, inputs: DecodeInputs, state, st: AuthorsLayerState) -> tuple[torch.Tensor, StepStats]:
    """variant=authors' decode step for every row in one go: ``state`` the method's layer state (its
    ``authors_device`` made here from ``st``, the prompt's record, at the call's capacity), the Triton
    kernels for the selection and the attention on CUDA; no host read."""
    b, hq, d = inputs.q.shape
    dtype = st.phi.dtype
    dev = inputs.q.device
    n_tok, bs = inputs.n_keys, cfg.block_size
    lengths = inputs.lengths
    dst = state.authors_device
    capacity = max(inputs.context.capacity or 0, n_tok)
    if (dst is None or dst.source is not st or dst.qs.shape[0] != b or dst.ks.shape[1] != inputs.kv_heads
            or dst.capacity_blocks * bs < n_tok):
        if dst is not None and dst.source is st and dst.qs.shape[0] == b and dst.ks.shape[1] == inputs.kv_heads:
            dst.grow(-(-max(n_tok, 2 * dst.capacity_blocks * bs) // bs))  # a growing cache (no capacity given)
        else:
            dst = AuthorsDeviceState.from_layer_state(st, inputs.k, lengths, block_size=bs, capacity=capacity)
            dst.source = st
        state.authors_device = dst
    path, reason = attention_path(cfg, inputs)
    # the Triton step where the attention kernel runs (it serves float32, float16 and bfloat16 calls; the
    # state is float32 for all three) and the rows fit its registers; longer ones take the torch step
    kernels = path == "triton" and dst.capacity_blocks <= kw.MAX_BLOCKS
    max_pages = max_kept_pages(n_tok, bs, sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac)
    q, k, v, lens = kernel_operands(inputs) if path == "triton" else (inputs.q, inputs.k, inputs.v, lengths)
    step = device_step(dst, q, k, lens, beta=cfg.walk_damping, degree=cfg.degree, sink=cfg.sink, window=cfg.window,
                       kblocks_frac=cfg.kblocks_frac, max_pages=max_pages, kernels=kernels)
    dst.last_step = step
    if dev.type == "cpu" and bool(dst.order_error.any()):  # a host check only where it costs no sync
        row = int(dst.order_error.nonzero()[0, 0])
        dst.order_error[row] = False
        raise ValueError(f"lengths: variant=authors keeps running averages over the decode steps; row {row} "
                         "steps out of order (steps must come one token at a time, or start again right "
                         "after the prompt)")
    if path == "triton":  # kept blocks as pages, the first window_tokens keys as the per-row dense prefix
        from ...kernels.shared.weighted_triton import sparse_decode_triton

        n = -(-n_tok // bs)
        prefix = reserved(cfg.window, n_tok, bs, n)[0]  # the longest row's (host bound)
        hkv = inputs.kv_heads
        pages, counts = step.pages[:, None].expand(b, hkv, -1), step.counts[:, None].expand(b, hkv)
        # two launches: the one-launch merge's per-program ticket made this call 56 µs instead of 30 at 128k
        # batch 1 on an H200 (benchmarks/sparse_decode/tune_gather.py)
        out, _ = sparse_decode_triton(q, k, v, pages, counts, page_size=bs, lengths=lens, sink=prefix,
                                      sink_lengths=step.window_tokens, scale=inputs.scale)
    else:
        keep = kept_token_mask(step, n_tok, bs, lengths)
        out = masked_attention(inputs.q[:, :, None], inputs.k, inputs.v, keep[:, None], inputs.scale,
                                       dtype)[:, :, 0]
    extra: dict[str, Any] = {"phase": "decode", "walk_hops": 1, "variant": "authors",
                             "selection": "device-triton" if kernels else "device"}
    if reason is not None:
        extra["backend_reason"] = reason

    def stats():  # built when read: a captured step launches none of it
        keep = kept_token_mask(step, n_tok, bs, lengths)
        kept = step.kept_blocks.to(torch.float64).sum(-1)
        more = {"block_density": (kept / step.n.to(torch.float64)).mean(), "blocks_kept": kept.mean(),
                "short_rows": step.short.sum(), "order_errors": dst.order_error.sum()}
        exact = (keep.sum(-1) == lengths.long()).sum()
        short = int(step.short.sum())  # read with the stats only
        if short:
            more["exact_reason"] = (f"{short} of {b} rows: a context whose every block is a sink or window "
                                    "block keeps every block")
        return read_stats(inputs, keep[:, None, :].expand(b, hq, n_tok), backend=path, exact_rows=exact,
                          extra=more)

    return out, StepStats.deferred(stats, path, extra)

def attention_path(cfg, inputs: DecodeInputs) -> tuple[str, str | None]:
    """``(path, reason)`` of the batched decode's attention: ``"triton"`` (the weighted sparse kernel, the
    blocks as pages) where backend asks for it and it can serve the call, the torch reference otherwise;
    ``reason`` says why the kernel did not run on CUDA under backend=auto."""
    from ...kernels.shared.triton_utils import kernels_interpreted
    from ...kernels.shared.weighted_triton import unsupported_reason

    dev = inputs.q.device
    if cfg.backend == "auto" and dev.type != "cuda":
        return "reference", None
    reason = unsupported_reason(inputs.q, inputs.k, inputs.v, cfg.block_size)
    if reason is None and (dev.type == "cuda") == kernels_interpreted():
        reason = f"{dev.type} tensors with TRITON_INTERPRET={int(kernels_interpreted())}"
    if reason is None:
        return "triton", None
    if cfg.backend == "triton":
        raise ValueError(f"backend: triton cannot serve this call ({reason})")
    return "reference", f"the sparse decode kernel cannot serve this call ({reason}); the torch attention ran"


def decode_rows(cfg, inputs: DecodeInputs, st: AuthorsLayerState, reason: str | None
                ) -> tuple[torch.Tensor, StepStats]:
    """variant=authors' decode step one query row at a time through ``decode_row`` (rows of a batch row in
    order, as single-token steps), host-indexed: the reference the batched step is tested against."""
    r_rows, hq, d = inputs.q.shape
    dtype = st.phi.dtype
    dev = inputs.q.device
    lengths = inputs.lengths.tolist()
    n_tok = inputs.n_keys
    scale = inputs.scale
    outs, short = [], []
    v_read = torch.zeros(r_rows, n_tok, dtype=torch.bool, device=dev)
    block_share, blocks_kept = [], []
    for r, length in enumerate(lengths):
        res = decode_row(
            st, r // inputs.q_len, inputs.q[r], inputs.k[r, :, :length], inputs.v[r, :, :length],
            block_size=cfg.block_size, beta=cfg.walk_damping, degree=cfg.degree, query_window=cfg.query_window,
            sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac, scale=scale, dtype=dtype)
        outs.append(res.out)
        v_read[r, :length] = res.kept_tokens
        short.append(res.short)
        kept = float(res.kept_blocks.sum())
        blocks_kept.append(kept)
        block_share.append(kept / res.kept_blocks.numel())
    extra: dict[str, Any] = {"phase": "decode", "walk_hops": 1, "variant": "authors", "selection": "reference",
                             "block_density": sum(block_share) / r_rows, "blocks_kept": sum(blocks_kept) / r_rows}
    if reason is not None:
        extra["backend_reason"] = reason
    if any(short):
        extra["exact_reason"] = (f"{sum(short)} of {r_rows} rows: a context whose every block is a sink or "
                                 "window block keeps every block")
    exact = int((v_read.sum(-1) == inputs.lengths.to(dev)).sum())
    stats = read_stats(inputs, v_read[:, None, :].expand(r_rows, hq, n_tok), backend="reference",
                       exact_rows=exact, extra=extra)
    return torch.stack(outs).to(dtype), stats

