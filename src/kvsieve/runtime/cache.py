"""The runtime's KV cache: transformers' ``StaticCache`` allocated once, written at per-row positions.

Every layer holds ``[B, Hkv, capacity, d]`` keys and values, allocated up front for the request's
longest row (prompt + new tokens). Two writing modes:

- ``prefill``: one batch row at a time, a chunk of its prompt at ``[start, start + L)``; the layer
  returns that row's valid prefix ``[0, start + L)`` so that prefill attention is exact SDPA.
- ``decode``: one token per row at the row's own position, read from device memory
  (``positions [B]``); a ``scatter_`` along the sequence dimension, so nothing is read on the host
  and the write can be replayed in a CUDA graph. The layer returns the whole buffer; attention reads
  the valid lengths from device memory too.

Building on ``StaticCache`` keeps everything transformers asks of a cache (``is_sliding``,
``get_mask_sizes``, ...) while the writes are ours: transformers' own static layer writes at one
shared position for the whole batch (its ``cumulative_length``), which per-row lengths cannot use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer


def index_write(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, key_states: torch.Tensor,
                value_states: torch.Tensor) -> None:
    """One decode token per row into ``keys [B, H, capacity, dk]`` and ``values [B, H, capacity, dv]`` at
    ``positions [B]``: what the two ``scatter_`` of :meth:`RuntimeLayer.update` write, as two ``index_put_``
    on the same (row, head, position) indices. Compiled (``compiled.compiled_cache_write``), inductor writes
    both in place in one kernel (a functional ``scatter`` it would apply to a copy of each whole buffer);
    eager, it is two kernels again."""
    rows = torch.arange(keys.shape[0], device=keys.device).view(-1, 1)
    heads = torch.arange(keys.shape[1], device=keys.device).view(1, -1)
    at = positions.view(-1, 1)
    keys.index_put_((rows, heads, at), key_states[:, :, 0].to(keys.dtype))
    values.index_put_((rows, heads, at), value_states[:, :, 0].to(values.dtype))


class RuntimeLayer(StaticLayer):
    """One layer's static K/V buffers; ``owner`` (the :class:`RuntimeCache`) says how to write."""

    def __init__(self, owner: RuntimeCache, batch: int, kv_heads: int, capacity: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(max_cache_len=capacity)
        self.owner = owner
        self.dtype, self.device = dtype, device
        self.batch_size, self.num_heads = batch, kv_heads
        self.k_head_dim, self.v_head_dim = k_dim, v_dim
        self.keys = torch.zeros(batch, kv_heads, capacity, k_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, kv_heads, capacity, v_dim, dtype=dtype, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states, *args, **kwargs) -> None:  # allocated up front
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        owner = self.owner
        if owner.mode == "decode":
            if owner.compiled_write is not None:
                owner.compiled_write(self.keys, self.values, owner.positions, key_states, value_states)
                return self.keys, self.values
            self.keys.scatter_(2, owner.write_index(self.k_head_dim), key_states.to(self.dtype))
            self.values.scatter_(2, owner.write_index(self.v_head_dim), value_states.to(self.dtype))
            return self.keys, self.values
        row, start = owner.prefill_row, owner.prefill_start
        end = start + key_states.shape[2]
        if key_states.shape[0] != 1:
            raise ValueError(f"prefill: the runtime prefills one batch row at a time, got {key_states.shape[0]}")
        self.keys[row, :, start:end] = key_states[0]
        self.values[row, :, start:end] = value_states[0]
        return self.keys[row:row + 1, :, :end], self.values[row:row + 1, :, :end]

    def get_seq_length(self) -> int:
        return self.owner.seen_tokens

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0

    def reset(self) -> None:  # the runtime rewinds by resetting positions; the buffers stay
        return None


class RuntimeCache(StaticCache):
    """``StaticCache`` whose layers are :class:`RuntimeLayer`; ``positions [B]`` (int64, device) is
    where each row writes its next token in decode mode; ``compiled_write`` (None: the eager scatters)
    writes a decode token's K and V where :class:`~.compiled.CompiledOps` installed it."""

    def __init__(self, config, *, batch: int, capacity: int, dtype: torch.dtype, device: torch.device,
                 kv_heads: int, k_dim: int, v_dim: int, n_layers: int):
        super().__init__(config=config, max_cache_len=capacity)
        self.capacity = capacity
        self.mode = "prefill"
        self.prefill_row = 0
        self.prefill_start = 0
        self.seen_tokens = 0
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.compiled_write: Callable[..., None] | None = None
        # views of `positions`, so in-place updates of it move every write (also inside a CUDA graph)
        self._write_index = {
            dim: self.positions.view(batch, 1, 1, 1).expand(batch, kv_heads, 1, dim) for dim in {k_dim, v_dim}
        }
        self.layers = [RuntimeLayer(self, batch, kv_heads, capacity, k_dim, v_dim, dtype, device)
                       for _ in range(n_layers)]

    def write_index(self, dim: int) -> torch.Tensor:
        return self._write_index[dim]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)
