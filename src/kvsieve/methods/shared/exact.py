"""Pieces shared by several methods: compute dtype, exact attention, the covered-budget fallback."""

from __future__ import annotations

import torch

from ...core.inputs import DecodeInputs


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
    inputs: DecodeInputs, out: torch.Tensor, v_read: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Replace the estimate of ``rows [B]`` by exact attention; their V reads become every valid key."""
    n_rows = int(rows.sum())
    if n_rows == 0:
        return out, v_read, 0
    exact = exact_attention(inputs).to(out.dtype)
    out = torch.where(rows[:, None, None], exact, out)
    v_read = torch.where(rows[:, None, None], inputs.key_mask[:, None, :].expand_as(v_read), v_read)
    return out, v_read, n_rows
