"""Pieces shared by several methods: compute dtype, exact attention, the covered-budget fallback."""

from __future__ import annotations

import torch

from ...core.inputs import DecodeInputs
from ...core.rng import RandomKey, RowStreams, as_generator
from ...core.sync import any_or_true


def compute_dtype(inputs: DecodeInputs) -> torch.dtype:
    """float64 for float64 inputs (tests), else float32 accumulation."""
    return torch.float64 if inputs.q.dtype == torch.float64 else torch.float32


def exact_attention(inputs: DecodeInputs) -> torch.Tensor:
    """``softmax(q·k · scale) V`` ``[B, Hq, dv]`` in the compute dtype, over valid keys only."""
    dtype = compute_dtype(inputs)
    return inputs.weighted_values(inputs.probs(dtype))


def covered_rows(inputs: DecodeInputs, budget: int) -> torch.Tensor:
    """``[B]`` bool: rows whose whole valid context fits in ``budget`` key reads."""
    return inputs.n_valid <= budget


def merge_exact_rows(
    inputs: DecodeInputs, out: torch.Tensor, v_read: torch.Tensor, rows: torch.Tensor, budget: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replace the estimate of ``rows [R]`` by exact attention; their V reads become every valid key.

    Returns the row count as a device scalar. Where the host may not read ``rows`` (CUDA) exact
    attention is computed for every row and selected per row; with ``budget`` (the rows are those
    with at most ``budget`` valid keys) and prefix lengths it reads only the first ``budget`` keys,
    which hold every valid key of such a row.
    """
    n_rows = rows.sum()
    if not any_or_true(rows):
        return out, v_read, n_rows
    if budget is not None and inputs.lengths is not None and budget < inputs.n_keys:
        head = DecodeInputs(q=inputs.q, k=inputs.k[:, :, :budget], v=inputs.v[:, :, :budget],
                            key_mask=inputs.key_mask[:, :budget], n_valid=inputs.n_valid, lengths=inputs.lengths,
                            scale=inputs.scale)
        exact = exact_attention(head).to(out.dtype)
    else:
        exact = exact_attention(inputs).to(out.dtype)
    out = torch.where(rows[:, None, None], exact, out)
    v_read = torch.where(rows[:, None, None], inputs.key_mask[:, None, :].expand_as(v_read), v_read)
    return out, v_read, n_rows


def sampled_v_read(inputs: DecodeInputs, counts: torch.Tensor | None, drawn: torch.Tensor, budget: int,
                   exact_when_covered: bool) -> tuple[torch.Tensor, torch.Tensor | int, dict]:
    """The V rows a S²ANTA kernel path read, for its stats: ``(v_read [R, Hq, N], exact_rows, extra)``.

    ``counts [R, Hq, N]`` are the kernel's per-key counts, or None when the caller turned them off; then
    the first ``drawn [R, Hq]`` keys stand in (the samples drawn: an upper bound on the distinct rows, and
    ``extra`` says so). Rows the budget covers read every valid key (they ran exact attention)."""
    extra = {}
    if counts is not None:
        v_read = counts > 0
    else:
        v_read = torch.arange(inputs.n_keys, device=drawn.device) < drawn[..., None]
        extra["v_rows_read_is"] = "samples drawn (an upper bound; per-key counts were off)"
    exact_rows = 0
    if exact_when_covered:
        covered = covered_rows(inputs, budget)
        v_read = torch.where(covered[:, None, None], inputs.key_mask[:, None, :], v_read)
        exact_rows = covered.sum()
    return v_read, exact_rows, extra


def row_draws(inputs: DecodeInputs, seed) -> RowStreams | torch.Generator:
    """Where a stochastic method's numbers come from: the row streams of a key, or a generator."""
    if isinstance(seed, RandomKey):
        return RowStreams(seed, inputs.batch_row(), inputs.n_valid)
    return as_generator(seed, inputs.q.device)
