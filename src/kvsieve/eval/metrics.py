"""Scores and fidelity metrics.

- RULER's string-match recall: ``string_match_all`` (fraction of the references found in the
  prediction, case-insensitive) and ``string_match_part`` (1 if any reference is found).
- Teacher-forced next-token agreement between dense and a method: per position
  KL(p_dense ‖ p_method) in nats and top-1 agreement (argmax equal).
- Relative attention-output error ‖ô − o‖/‖o‖ comes from the integration's ``track_error``
  records; :func:`summarize_records` turns a session's records into per-cell numbers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch


def _check_refs(references: Sequence[str]) -> None:
    if isinstance(references, str) or not references:
        raise ValueError(f"references: expected a non-empty sequence of strings, got {references!r}")


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER ``string_match_all``: the fraction of references contained in the prediction."""
    _check_refs(references)
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER ``string_match_part``: 1.0 if any reference is contained in the prediction."""
    _check_refs(references)
    pred = prediction.lower()
    return float(max(ref.lower() in pred for ref in references))


def kl_per_position(dense_logits: torch.Tensor, method_logits: torch.Tensor) -> torch.Tensor:
    """KL(dense ‖ method) of each position's next-token distribution, nats, float64, ``[..., V] -> [...]``."""
    log_p = torch.log_softmax(dense_logits.double(), dim=-1)
    log_q = torch.log_softmax(method_logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0)


def next_token_agreement(dense_logits: torch.Tensor, method_logits: torch.Tensor) -> dict[str, float]:
    """KL(dense ‖ method) per position (nats, mean and max) and top-1 agreement, logits ``[T, V]``."""
    if dense_logits.shape != method_logits.shape or dense_logits.dim() != 2:
        raise ValueError(
            f"logits: expected two [T, V] tensors of one shape, got {tuple(dense_logits.shape)} "
            f"and {tuple(method_logits.shape)}"
        )
    if dense_logits.shape[0] == 0:
        return {"kl_mean": float("nan"), "kl_max": float("nan"), "top1_agree": float("nan"), "tf_tokens": 0}
    kl = kl_per_position(dense_logits, method_logits)
    top1 = (dense_logits.argmax(-1) == method_logits.argmax(-1)).double()
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1_agree": float(top1.mean()),
        "tf_tokens": int(dense_logits.shape[0]),
    }


def _finite_mean(values: Iterable[float]) -> float | None:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return sum(vals) / len(vals) if vals else None


def _weighted_mean(records: Sequence[dict[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over query tokens (each record weighs its ``rows``), finite values only."""
    pairs = [(float(r[key]), int(r.get("rows", 1))) for r in records
             if r.get(key) is not None and math.isfinite(float(r[key]))]
    total = sum(n for _, n in pairs)
    return sum(v * n for v, n in pairs) / total if total else None


def summarize_records(records: Sequence[dict[str, Any]], n_layers: int) -> dict[str, Any]:
    """Per-cell density, bytes and attention error from a ``sparsify`` session's records.

    Means are over the (layer, step) calls the method served; ``rel_error_by_layer`` is a list of
    length ``n_layers`` (``None`` where a layer had no tracked step, e.g. a dense layer).
    """
    if not records:
        return {"density": None, "kv_density": None, "bytes_read_per_step": None, "rel_error": None,
                "rel_error_by_layer": [None] * n_layers, "sparse_calls": 0, "backends": []}
    by_layer: dict[int, list[float]] = defaultdict(list)
    for r in records:
        err = r.get("rel_error")
        if err is not None:
            by_layer[int(r["layer"])].append(float(err))
    # A record is one method call: ``rows`` query tokens of one layer (one token per decode step; a
    # question chunk holds many). Means are per query token, as if each token were its own step.
    steps: dict[tuple[Any, Any], list[float]] = defaultdict(lambda: [0.0, 0])
    for r in records:
        rows = int(r.get("rows", 1))
        acc = steps[(r.get("request"), r.get("step"), r.get("position"))]
        acc[0] += float(r.get("bytes_read") or 0) / rows
        acc[1] = rows
    token_bytes = sum(b * n for b, n in steps.values())
    tokens = sum(n for _, n in steps.values())
    out = {
        "density": _weighted_mean(records, "density"),
        "kv_density": _weighted_mean(records, "kv_density"),
        "bytes_read_per_step": token_bytes / tokens if tokens else None,
        "rel_error": _finite_mean(e for errs in by_layer.values() for e in errs),
        "rel_error_by_layer": [_finite_mean(by_layer.get(i, [])) for i in range(n_layers)],
        "sparse_calls": len(records),
        "backends": sorted({str(r.get("backend")) for r in records if r.get("backend") is not None}),
    }
    prefill = [r for r in records if r.get("phase") == "prefill"]
    if prefill:
        # A sparse prefill's call serves every context token, so the mean above is nearly the prefill's
        # alone: the two parts are kept apart as well (decode: None when no sparse decode call ran).
        decode = [r for r in records if r.get("phase") != "prefill"]
        out["prefill_density"] = _weighted_mean(prefill, "density")
        out["prefill_block_density"] = _weighted_mean(prefill, "block_density")
        out["decode_density"] = _weighted_mean(decode, "density")
    return out
