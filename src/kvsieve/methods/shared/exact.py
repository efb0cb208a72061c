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


def row_draws(inputs: DecodeInputs, seed) -> RowStreams | torch.Generator:
    """Where a stochastic method's numbers come from: the row streams of a key, or a generator."""
    if isinstance(seed, RandomKey):
        return RowStreams(seed, inputs.batch_row(), inputs.n_valid)
    return as_generator(seed, inputs.q.device)
