"""Checked decode-step inputs: one query per head against a KV cache in the transformers layout."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class DecodeInputs:
    """q ``[B, Hq, d]``; k ``[B, Hkv, N, d]``; v ``[B, Hkv, N, dv]``; key_mask ``[B, N]`` (True = valid).

    ``lengths`` is set when the valid keys of every row are a prefix ``[0, length)``; kernels that
    take lengths can serve exactly those calls.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_mask: torch.Tensor
    n_valid: torch.Tensor  # [B] int64
    lengths: torch.Tensor | None
    scale: float

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def n_keys(self) -> int:
        return self.k.shape[2]

    def kv_head_of(self) -> torch.Tensor:
        """Index of the KV head that serves each query head: ``h // G``."""
        return torch.arange(self.heads, device=self.q.device) // self.group

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, ...]`` -> ``[B, Hq, ...]`` as a view (no copy), query head h using KV head h // G."""
        b, hkv = t.shape[:2]
        rest = t.shape[2:]
        return t.unsqueeze(2).expand(b, hkv, self.group, *rest).reshape(b, hkv * self.group, *rest)

    def scores(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Scaled scores ``q·k * scale`` ``[B, Hq, N]`` with invalid keys at -inf, in ``dtype``."""
        b, hq, d = self.q.shape
        qg = self.q.to(dtype).view(b, self.kv_heads, self.group, d)
        s = torch.matmul(qg, self.k.to(dtype).transpose(-1, -2)).view(b, hq, self.n_keys) * self.scale
        return s.masked_fill(~self.key_mask[:, None, :], float("-inf"))

    def probs(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact attention weights ``softmax(q·k * scale)`` ``[B, Hq, N]`` (zero on invalid keys)."""
        return torch.softmax(self.scores(dtype), dim=-1)

    def weighted_values(self, weights: torch.Tensor) -> torch.Tensor:
        """``Σ_n weights[b, h, n] V[b, h // G, n]`` -> ``[B, Hq, dv]`` in the weights' dtype."""
        b, hq, n = weights.shape
        w = weights.view(b, self.kv_heads, self.group, n)
        out = torch.matmul(w, self.v.to(weights.dtype))
        return out.view(b, hq, -1)

    def gather_values(self, idx: torch.Tensor) -> torch.Tensor:
        """V rows at ``idx [B, Hq, M]`` -> ``[B, Hq, M, dv]`` (each query head from its KV head)."""
        b, hq, m = idx.shape
        dv = self.v.shape[-1]
        v = self.expand_kv(self.v)  # view [B, Hq, N, dv]
        return torch.gather(v, 2, idx.unsqueeze(-1).expand(b, hq, m, dv))


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_decode_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    check_finite: bool = True,
) -> DecodeInputs:
    """Validate one decode step's inputs and return them with a key mask; raise ValueError otherwise."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        _require(
            t.dtype in FLOAT_DTYPES,
            f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}",
        )
    _require(q.dim() == 3, f"q: expected shape [B, Hq, d], got {tuple(q.shape)}")
    _require(k.dim() == 4, f"k: expected shape [B, Hkv, N, d], got {tuple(k.shape)}")
    _require(v.dim() == 4, f"v: expected shape [B, Hkv, N, dv], got {tuple(v.shape)}")
    _require(q.dtype == k.dtype == v.dtype, f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _require(q.device == k.device == v.device, f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    b, hq, d = q.shape
    _require(k.shape[0] == b and v.shape[0] == b, f"k, v: batch {k.shape[0]}, {v.shape[0]} != q's batch {b}")
    _require(k.shape[3] == d, f"k: head dim {k.shape[3]} != q's head dim {d}")
    _require(k.shape[:3] == v.shape[:3],
             f"v: shape {tuple(v.shape)} does not match k's [B, Hkv, N] {tuple(k.shape[:3])}")
    hkv, n = k.shape[1], k.shape[2]
    _require(hkv >= 1 and hq >= 1 and d >= 1,
             f"q, k: empty head or feature dimension in {tuple(q.shape)}, {tuple(k.shape)}")
    if hq % hkv != 0 and hq % n == 0:  # the likely cause: k laid out [B, N, Hkv, d]
        raise ValueError(f"k: expected shape [B, Hkv, N, d] (the transformers cache layout) with q's {hq} "
                         f"query heads a multiple of Hkv, got {tuple(k.shape)}; if k is [B, N, Hkv, d], "
                         "pass k.transpose(1, 2) (and v likewise)")
    _require(hq % hkv == 0, f"q: {hq} query heads is not a multiple of k's {hkv} KV heads")
    _require(n >= 1, f"k: the cache holds no keys (N = {n})")
    _require(b >= 1, "q: empty batch")

    if lengths is not None and key_mask is not None:
        raise ValueError("lengths, key_mask: give at most one of them")
    positions = torch.arange(n, device=q.device)
    if lengths is not None:
        lengths = torch.as_tensor(lengths, device=q.device)
        _require(lengths.shape == (b,), f"lengths: expected shape [{b}], got {tuple(lengths.shape)}")
        _require(not lengths.is_floating_point() and lengths.dtype != torch.bool,
                 f"lengths: expected an integer tensor, got {lengths.dtype}")
        lengths = lengths.long()
        lo, hi = int(lengths.min()), int(lengths.max())
        _require(lo >= 1 and hi <= n,
                 f"lengths: expected values in [1, {n}] (the cache length), got min {lo}, max {hi}")
        mask = positions[None, :] < lengths[:, None]
        n_valid = lengths
    elif key_mask is not None:
        _require(isinstance(key_mask, torch.Tensor) and key_mask.dtype == torch.bool,
                 "key_mask: expected a bool tensor")
        _require(key_mask.shape == (b, n), f"key_mask: expected shape [{b}, {n}], got {tuple(key_mask.shape)}")
        mask = key_mask.to(q.device)
        n_valid = mask.sum(-1)
        _require(bool((n_valid >= 1).all()), "key_mask: every batch row needs at least one valid key")
        # A prefix mask can be served by kernels that take lengths.
        is_prefix = bool((mask == (positions[None, :] < n_valid[:, None])).all())
        lengths = n_valid if is_prefix else None
    else:
        mask = torch.ones(b, n, dtype=torch.bool, device=q.device)
        n_valid = torch.full((b,), n, dtype=torch.long, device=q.device)
        lengths = n_valid

    if check_finite:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _require(bool(torch.isfinite(t).all()), f"{name}: contains NaN or infinite values")

    if scale is None:
        scale = d ** -0.5
    _require(
        isinstance(scale, (int, float)) and not isinstance(scale, bool)
        and math.isfinite(scale) and scale > 0,
        f"scale: expected a positive finite number, got {scale!r}",
    )
    return DecodeInputs(q=q, k=k, v=v, key_mask=mask, n_valid=n_valid, lengths=lengths, scale=float(scale))
