"""Checked decode-step inputs: query rows against a KV cache in the transformers layout.

A call holds ``Q ≥ 1`` query rows per batch row (``q [B, Hq, Q, d]``; ``q [B, Hq, d]`` is ``Q = 1``):
the rows of a question chunk, speculative tokens or teacher-forced rows. Query row ``j`` of batch row
``b`` sees the keys ``[0, len_b − Q + 1 + j)`` (causal: the chunk's last row sits at the end of the
row's valid keys). Methods see the rows flattened, ``R = B·Q`` rows with ``r = b·Q + j``, each with
its own lengths, key mask and KV view; so a method written for one query row per batch row serves a
chunk unchanged.
"""

from __future__ import annotations

import math

import torch

from .context import NO_CONTEXT, CallContext

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DecodeInputs:
    """q ``[R, Hq, d]``; k ``[R, Hkv, N, d]``; v ``[R, Hkv, N, dv]``; key_mask ``[R, N]`` (True = valid).

    ``R = B·Q`` query rows (row ``r = b·Q + j``). ``k``/``v`` are per query row: the cache itself when
    ``Q = 1``, a stride-0 view of it when ``B = 1``, else a copy per row (``B > 1`` and ``Q > 1``).
    ``cache_k``/``cache_v`` are the cache ``[B, Hkv, N, d]``; :meth:`scores` and
    :meth:`weighted_values` use it to score the ``Q`` rows of a batch row as one matrix product.
    ``lengths`` is set when the valid keys of every row are a prefix ``[0, length)``; kernels that
    take lengths can serve exactly those calls. ``checked``: the value checks (non-finite inputs,
    lengths in range) ran.

    With ``lengths``, ``key_mask`` and ``n_valid`` (``[R]`` int64) are built on first use: a kernel
    path that needs only the lengths launches nothing for them (each is a device op per call).
    ``kernel_lengths`` is the int32 ``[R]`` form the kernels take (the caller's tensor when it is one).
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                 n_valid: torch.Tensor | None = None, lengths: torch.Tensor | None = None, scale: float = 1.0,
                 q_len: int = 1, cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None,
                 checked: bool = False) -> None:
        if key_mask is None and lengths is None:
            raise ValueError("DecodeInputs: give key_mask or lengths")
        self.q, self.k, self.v = q, k, v
        self._key_mask, self._n_valid, self.lengths = key_mask, n_valid, lengths
        self.scale, self.q_len, self.checked = scale, q_len, checked
        self.cache_k, self.cache_v = cache_k, cache_v
        self._kernel_lengths = None
        #: What the caller knows of the call (layer, whether stats are read, ...): set by Method.decode.
        self.context: CallContext = NO_CONTEXT

    @property
    def key_mask(self) -> torch.Tensor:
        if self._key_mask is None:
            positions = torch.arange(self.n_keys, device=self.q.device)
            self._key_mask = positions[None, :] < self.lengths[:, None]
        return self._key_mask

    @property
    def n_valid(self) -> torch.Tensor:
        if self._n_valid is None:
            self._n_valid = self.lengths.long() if self.lengths is not None else self.key_mask.sum(-1)
        return self._n_valid

    @property
    def kernel_lengths(self) -> torch.Tensor:
        """``lengths`` as int32 (converted once)."""
        if self._kernel_lengths is None:
            self._kernel_lengths = self.lengths.to(torch.int32)
        return self._kernel_lengths

    @property
    def batch(self) -> int:
        """Query rows R (= batch rows when Q = 1)."""
        return self.q.shape[0]

    @property
    def cache_batch(self) -> int:
        return self.batch // self.q_len

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

    def batch_row(self) -> torch.Tensor:
        """``[R]`` the cache's batch row of each query row."""
        return torch.arange(self.batch, device=self.q.device) // self.q_len

    def kv_head_of(self) -> torch.Tensor:
        """Index of the KV head that serves each query head: ``h // G``."""
        return torch.arange(self.heads, device=self.q.device) // self.group

    def expand_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``[R, Hkv, ...]`` -> ``[R, Hq, ...]``, query head h using KV head h // G (a copy for ≥ 2 dims
        after the head)."""
        b, hkv = t.shape[:2]
        rest = t.shape[2:]
        return t.unsqueeze(2).expand(b, hkv, self.group, *rest).reshape(b, hkv * self.group, *rest)

    def _grouped_q(self, dtype: torch.dtype) -> torch.Tensor:
        """q as ``[B, Hkv, Q·G, d]`` (rows j, then heads g of the group) for one product per batch row."""
        r, hq, d = self.q.shape
        qv = self.q.to(dtype).view(self.cache_batch, self.q_len, self.kv_heads, self.group, d)
        return qv.permute(0, 2, 1, 3, 4).reshape(self.cache_batch, self.kv_heads, self.q_len * self.group, d)

    def _ungroup(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv, Q·G, X]`` -> ``[R, Hq, X]``."""
        x = t.shape[-1]
        t = t.view(self.cache_batch, self.kv_heads, self.q_len, self.group, x).permute(0, 2, 1, 3, 4)
        return t.reshape(self.batch, self.heads, x)

    def scores(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Scaled scores ``q·k * scale`` ``[R, Hq, N]`` with invalid keys at -inf, in ``dtype``."""
        if self.q_len > 1:
            s = self._ungroup(torch.matmul(self._grouped_q(dtype), self.cache_k.to(dtype).transpose(-1, -2)))
            s = s * self.scale
        else:
            b, hq, d = self.q.shape
            qg = self.q.to(dtype).view(b, self.kv_heads, self.group, d)
            s = torch.matmul(qg, self.k.to(dtype).transpose(-1, -2)).view(b, hq, self.n_keys) * self.scale
        return s.masked_fill(~self.key_mask[:, None, :], float("-inf"))

    def probs(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact attention weights ``softmax(q·k * scale)`` ``[R, Hq, N]`` (zero on invalid keys)."""
        return torch.softmax(self.scores(dtype), dim=-1)

    def weighted_values(self, weights: torch.Tensor) -> torch.Tensor:
        """``Σ_n weights[r, h, n] V[r, h // G, n]`` -> ``[R, Hq, dv]`` in the weights' dtype."""
        r, hq, n = weights.shape
        if self.q_len > 1:
            w = weights.view(self.cache_batch, self.q_len, self.kv_heads, self.group, n).permute(0, 2, 1, 3, 4)
            w = w.reshape(self.cache_batch, self.kv_heads, self.q_len * self.group, n)
            return self._ungroup(torch.matmul(w, self.cache_v.to(weights.dtype)))
        w = weights.view(r, self.kv_heads, self.group, n)
        out = torch.matmul(w, self.v.to(weights.dtype))
        return out.view(r, hq, -1)

    def gather_values(self, idx: torch.Tensor) -> torch.Tensor:
        """V rows at ``idx [R, Hq, M]`` -> ``[R, Hq, M, dv]`` (each query head from its KV head)."""
        return index_rows(self.v, idx, self.kv_head_of())


def index_rows(t: torch.Tensor, idx: torch.Tensor, head_of: torch.Tensor) -> torch.Tensor:
    """Rows of ``t [R, Hkv, N, x]`` at ``idx [R, Hs, M]``, head h of idx reading KV head ``head_of[h]``,
    as one ``index_select`` over the flattened rows (whole rows copied; a stride-0 batch, the per-row
    view of a one-row cache, is read from its single copy)."""
    r, hkv, n, x = t.shape
    hs, m = idx.shape[1], idx.shape[2]
    rows = torch.arange(r, device=idx.device)
    if r > 1 and t.stride(0) == 0:
        t, rows = t[:1], torch.zeros_like(rows)
    base = (rows[:, None] * hkv + head_of[None, :]) * n  # [R, Hs]
    flat = (base[..., None] + idx).reshape(-1)
    return torch.index_select(t.reshape(-1, x), 0, flat).view(r, hs, m, x)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _per_row_kv(t: torch.Tensor, q_len: int) -> torch.Tensor:
    """``[B, ...]`` -> ``[B·Q, ...]``: a stride-0 view for B = 1, else a copy per row."""
    if q_len == 1:
        return t
    if t.shape[0] == 1:
        return t.expand(q_len, *t.shape[1:])
    return t.repeat_interleave(q_len, dim=0)


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
    """Validate one decode step's inputs and return them as query rows with key masks.

    Shape, dtype and device checks always run and read no tensor data. With ``check_finite`` (the
    debug checks) the values are checked too — non-finite q/K/V, lengths in ``[Q, N]``, at least one
    valid key per row — and a ``key_mask`` that is a prefix of each row is detected so that kernels
    taking lengths can serve it; these read device data (host synchronisation on CUDA).

    ``lengths [B]`` are the valid keys of each batch row's last query row; ``key_mask`` is ``[B, N]``
    (the last row's keys; row j also drops the Q − 1 − j newest keys) or ``[B, Q, N]`` (each row's).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        _require(
            t.dtype in FLOAT_DTYPES,
            f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}",
        )
    _require(q.dim() in (3, 4), f"q: expected shape [B, Hq, d] or [B, Hq, Q, d], got {tuple(q.shape)}")
    _require(k.dim() == 4, f"k: expected shape [B, Hkv, N, d], got {tuple(k.shape)}")
    _require(v.dim() == 4, f"v: expected shape [B, Hkv, N, dv], got {tuple(v.shape)}")
    _require(q.dtype == k.dtype == v.dtype, f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _require(q.device == k.device == v.device, f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    q_len = 1 if q.dim() == 3 else q.shape[2]
    b, hq, d = q.shape[0], q.shape[1], q.shape[-1]
    _require(q_len >= 1, f"q: no query rows (Q = 0) in {tuple(q.shape)}")
    _require(k.shape[0] == b and v.shape[0] == b, f"k, v: batch {k.shape[0]}, {v.shape[0]} != q's batch {b}")
    _require(k.shape[3] == d, f"k: head dim {k.shape[3]} != q's head dim {d} (expected k as [B, Hkv, N, d])")
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
    _require(q_len <= n, f"q: {q_len} query rows but the cache holds only {n} keys")

    if lengths is not None and key_mask is not None:
        raise ValueError("lengths, key_mask: give at most one of them")
    device = q.device
    mask = n_valid = None
    if lengths is not None:
        if not isinstance(lengths, torch.Tensor) or lengths.device != device:
            lengths = torch.as_tensor(lengths, device=device)
        _require(lengths.shape == (b,), f"lengths: expected shape [{b}], got {tuple(lengths.shape)}")
        _require(not lengths.is_floating_point() and lengths.dtype != torch.bool,
                 f"lengths: expected an integer tensor, got {lengths.dtype}")
        if check_finite:
            lo, hi = int(lengths.min()), int(lengths.max())
            _require(lo >= q_len and hi <= n,
                     f"lengths: expected values in [{q_len}, {n}] (the query rows, the cache length), "
                     f"got min {lo}, max {hi}")
        if q_len > 1:  # row j sees Q - 1 - j keys fewer than the last row
            back = torch.arange(q_len - 1, -1, -1, device=device)
            lengths = (lengths.long()[:, None] - back[None, :]).reshape(-1)
        # (one query row: the caller's tensor as it is; key_mask and n_valid are built when used)
    elif key_mask is not None:
        positions = torch.arange(n, device=device)
        back = torch.arange(q_len - 1, -1, -1, device=device)  # keys row j does not see yet: Q - 1 - j
        _require(isinstance(key_mask, torch.Tensor) and key_mask.dtype == torch.bool,
                 "key_mask: expected a bool tensor")
        _require(key_mask.shape in ((b, n), (b, q_len, n)),
                 f"key_mask: expected shape [{b}, {n}] or [{b}, {q_len}, {n}], got {tuple(key_mask.shape)}")
        mask = key_mask.to(device)
        if mask.dim() == 2:
            causal = positions[None, :] < (n - back)[:, None]  # [Q, N]
            mask = mask[:, None, :] & causal[None]
        mask = mask.reshape(b * q_len, n)
        n_valid = mask.sum(-1)
        lengths = None
        if check_finite:
            _require(bool((n_valid >= 1).all()),
                     "key_mask: every batch row needs at least one valid key (for each query row)")
            # A prefix mask can be served by kernels that take lengths.
            if bool((mask == (positions[None, :] < n_valid[:, None])).all()):
                lengths = n_valid
    else:
        back = torch.arange(q_len - 1, -1, -1, device=device)
        lengths = (n - back).repeat(b)

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
    q_rows = q if q_len == 1 and q.dim() == 3 else q.transpose(1, 2).reshape(b * q_len, hq, d)
    return DecodeInputs(q=q_rows, k=_per_row_kv(k, q_len), v=_per_row_kv(v, q_len), key_mask=mask,
                        n_valid=n_valid, lengths=lengths, scale=float(scale), q_len=q_len,
                        cache_k=k, cache_v=v, checked=check_finite)
