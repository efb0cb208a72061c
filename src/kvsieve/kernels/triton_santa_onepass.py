"""S²ANTA-prop and S²ANTA-flash in one launch (v9): the K stream and the sampling overlap. Opt-in
(``onepass=True``): on the H100 it is slower than the v8 passes (below).

The v8 paths run the stats pass over all of K, then the budget kernel, then the sampling pass: the
sampling pass (latency-bound, 12 µs at 32k and 28 µs at 128k on an H100) and the budgets start only
when the last K tile is scored. Here one kernel does all of it, and each (batch row, KV head) — a
*unit* — moves on to its budgets and sampling as soon as its own tiles are scored, while the K tiles
of the next units stream. Only the last unit's budgets and sampling would remain after the K stream.

Persistent programs (``programs_per_sm`` per SM) take work from two queues (atomic counters):

- stats items, in unit order: ``tiles_per_item`` tiles of one unit (``_stats_tiles``). The last stats
  item of a unit (a per-unit counter) computes that unit's tile budgets (prop; ``_group_budgets``) and
  raises the unit's ready flag (release);
- sampling items, in unit order: one tile (``_sample_fold``, the v8 sampling pass with the folded
  merge). A program takes one (fetch-and-add) when the next one's unit looks ready and fewer than
  ``sampler_share`` of the programs are sampling; an item whose unit is not ready yet is held while the
  program does stats items. Deadlock-free: a program waits only when every stats item is taken, and
  those complete without waiting.

Counts, budgets and outputs are those of the v8 paths for the same seed (same helpers, same order of
sums within a tile). The sync words are left at zero for the next call; like the folded merge, one
workspace per device: calls on different streams of one device must not overlap in time.

Measured (H100, llama 32/8/128, bf16, graph µs, ``benchmarks/results/2026-11-22-h100-decode-v9.*`` and
``-v9-sweeps.log``): prop S=128 62.5 at 32k and 206.7 at 128k against v8's 53.3 and 146.7; flash S=2048
69.0 and 206.0 against 57.4 and 153.2. The persistent loop compiles to ~212 registers (2 programs per
SM; a cap of 168 spills), and each item pays 3-5 serial L2 round trips of polls and claims (not
profiled: the split of the time inside the one kernel is not measured). docs/methods/santa-kernels.md
has the three forms tried and their sweeps.
"""

from __future__ import annotations

import functools

import torch

from .triton_common import group_block, is_interpreted, launch, next_pow2, seed_words, triton, workspace
from .triton_santa import (
    _BUDGET_KEY,
    _TILE_KEY,
    _check_rounding,
    _check_tile,
    _dot_precision,
    _fixed_point,
    _pass_buffers,
    _split_at,
    _tiles,
    default_r_max,
)

if triton is not None:
    import triton.language as tl

    from .triton_santa import _group_budgets, _sample_fold, _stats_tiles, budget_jit

    @triton.jit
    def _nap(x, SLEEP: tl.constexpr):
        """A short sleep (``nanosleep``) between polls, so that idle programs leave L2 to the stream; a no-op
        under the interpreter, which has no inline assembly (and never waits: it runs programs in order)."""
        if SLEEP:
            x = tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                          is_pure=False, pack=1)
        return x

    @budget_jit
    def _onepass_kernel(
        q_ptr, k_ptr, v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
        oacc_ptr, oden_ptr, done_ptr, sync_ptr, out_ptr,
        scale, budget, seed_lo, seed_hi, tile_key, budget_key, n_tiles, hq, hkv, n_units, stats_items,
        tiles_per_item, n_programs, sampler_cap,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h,
        s_o_b, s_o_h,
        G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, R_MAX: tl.constexpr, FLASH: tl.constexpr,
        SYSTEMATIC: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr, WRITE_COUNTS: tl.constexpr,
        FIX_BITS: tl.constexpr, WIDE: tl.constexpr, SLEEP: tl.constexpr,
    ):
        """Persistent programs over two queues. sync words: [0] next stats item, [1] next sampling item,
        [2] programs finished, [3] programs sampling now, [4 + u] stats items done of unit u,
        [4 + U + u] ready flag of unit u."""
        n_stats = n_units * stats_items
        n_samples = n_units * n_tiles
        ready_ptr = sync_ptr + 4 + n_units
        running = tl.full([], 1, tl.int32)
        held = tl.full([], -1, tl.int32)  # a sampling item this program took and has not done yet
        while running != 0:
            did = tl.full([], 0, tl.int32)
            # Polls are atomics, not volatile loads: a scalar atomic runs on one thread and is broadcast to
            # the program, so every thread takes the same branch (a load could differ between threads).
            s = tl.atomic_add(sync_ptr + 1, 0, sem="relaxed")
            if held < 0:  # take the next sampling item if its unit looks ready and few programs sample now
                if s < n_samples:
                    ready = tl.atomic_add(ready_ptr + s // n_tiles, 0, sem="relaxed")
                    sampling = tl.atomic_add(sync_ptr + 3, 0, sem="relaxed")
                    if (ready != 0) & (sampling < sampler_cap):
                        # fetch-and-add, not compare-and-swap: claims must not serialise. The item taken may
                        # belong to a unit not ready yet: it is held, and stats items are done meanwhile.
                        held = tl.atomic_add(sync_ptr + 1, 1, sem="relaxed")
                        held = tl.where(held < n_samples, held, -1)
            if held >= 0:
                u = held // n_tiles
                if tl.atomic_add(ready_ptr + u, 0, sem="acquire") != 0:  # pairs with the flag's release
                    tl.atomic_add(sync_ptr + 3, 1, sem="relaxed")
                    b = u // hkv
                    kvh = u % hkv
                    last = _sample_fold(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr,
                                        mstar_ptr, scr_ptr, oacc_ptr, oden_ptr, done_ptr, out_ptr,
                                        held % n_tiles, kvh, b, budget, seed_lo, seed_hi, tile_key, budget_key,
                                        n_tiles, hq, hkv, s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
                                        s_c_b, s_c_h, s_o_b, s_o_h,
                                        G, GP, BLOCK_G, D, TILE, R_MAX, FLASH, False, SYSTEMATIC, 16, SPLIT_AT,
                                        DOT_PRECISION, WRITE_COUNTS, FIX_BITS, WIDE, ".cg")
                    if last:  # every item of the unit is done: lower its flag for the next call
                        tl.atomic_xchg(ready_ptr + u, 0, sem="relaxed")
                    tl.atomic_add(sync_ptr + 3, -1, sem="relaxed")
                    held = tl.full([], -1, tl.int32)
                    did = tl.full([], 1, tl.int32)
            if did == 0:  # otherwise the next stats item
                x = tl.atomic_add(sync_ptr, 0, sem="relaxed")
                if x < n_stats:
                    x = tl.atomic_add(sync_ptr, 1, sem="relaxed")
                    if x < n_stats:
                        u = x // stats_items
                        b = u // hkv
                        kvh = u % hkv
                        length = tl.load(lens_ptr + b)
                        tiles_b = (length + TILE - 1) // TILE
                        t0 = (x % stats_items) * tiles_per_item
                        t1 = tl.minimum(t0 + tiles_per_item, tiles_b)
                        if t0 < t1:
                            _stats_tiles(q_ptr, k_ptr, m_ptr, l_ptr, stash_ptr, mstar_ptr, b, kvh, t0, t1, length,
                                         scale, hq, s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
                                         G, BLOCK_G, D, TILE, BLOCK_N, DOT_PRECISION, FLASH)
                        tl.debug_barrier()  # every thread's stores are issued before the release below
                        finished = tl.atomic_add(sync_ptr + 4 + u, 1, sem="acq_rel")
                        if finished == stats_items - 1:  # the unit's last stats item: its budgets, then the flag
                            tl.atomic_xchg(sync_ptr + 4 + u, 0, sem="relaxed")
                            if not FLASH:
                                offs_g = tl.arange(0, GP)
                                _group_budgets(m_ptr, l_ptr, budgets_ptr, kvh * G + offs_g, offs_g < G, b, tiles_b,
                                               budget, seed_lo, seed_hi, budget_key, n_tiles, hq, s_ml_b, s_ml_h,
                                               BLOCK_T, SYSTEMATIC)
                            tl.debug_barrier()
                            tl.atomic_xchg(ready_ptr + u, 1, sem="release")
                        did = tl.full([], 1, tl.int32)
            if did == 0:
                if (held < 0) & (s >= n_samples):  # every item is taken and none is held: this program is done
                    running = tl.full([], 0, tl.int32)
                else:
                    running = _nap(running, SLEEP)
        # the last program to leave resets the queues for the next call
        if tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel") == n_programs - 1:
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed")
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed")


# Defaults: prop's fastest of the H100 sweep (2026-11-22-h100-v9-sweeps.log: 62.6 µs at 32k, 204.3 at 128k);
# flash with them 69.1 and 201.8 (its fastest at 128k: 4 programs per SM with a 128-register cap, 181.0).
# All slower than the v8 paths (docs/methods/santa-kernels.md).
TILES_PER_ITEM = 2
PROGRAMS_PER_SM = 3
SAMPLER_SHARE = 0.5  # at most this share of the programs samples at once; the others keep streaming K
MAXNREG = 168  # the persistent loop compiles to ~212 registers (2 programs per SM) without a cap; 0: none
INTERPRETER_PROGRAMS = 3  # the interpreter runs programs one after the other: the first does all the work


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def santa_onepass_triton(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *, flash: bool,
                         rounding: str = "largest-remainder", write_counts: bool = False,
                         tiles_per_item: int | None = None, programs_per_sm: int | None = None,
                         sampler_share: float | None = None, block_n: int = 64, num_warps: int = 4,
                         num_stages: int = 3, maxnreg: int | None = None, r_max: int | None = None,
                         out: torch.Tensor | None = None):
    """S²ANTA-prop (``flash=False``) or S²ANTA-flash in one launch. Returns ``(out, counts or None, tile
    budgets [B, Hq, T] int32 or None (flash))``; same counts and budgets as the v8 paths for the same seed.

    ``tiles_per_item``: tiles per stats item; ``programs_per_sm``: persistent programs per SM;
    ``sampler_share``: the share of them that may sample at once (the rest keep streaming K);
    ``maxnreg``: a register cap per thread (more programs per SM, at the price of spills)."""
    _check_tile(tile)
    _check_rounding(rounding)
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    t = _tiles(n, tile)
    units = b * hkv
    per_item = max(1, min(t, tiles_per_item or TILES_PER_ITEM))
    stats_items = -(-t // per_item)
    interpreted = is_interpreted(_onepass_kernel)
    if interpreted:
        programs = INTERPRETER_PROGRAMS
    else:
        programs = min(units * (stats_items + t), (programs_per_sm or PROGRAMS_PER_SM) * _sm_count(q.get_device()))
    if maxnreg is None:
        maxnreg = MAXNREG
    cap = max(1, int(programs * (SAMPLER_SHARE if sampler_share is None else sampler_share)))
    m, l, stash, budgets, mstar, oacc, oden, done, scr, counts, out = _pass_buffers(
        q, v, t, tile, flash=flash, write_counts=write_counts, out=out)
    sync = workspace("onepass_sync", q, 4 + 2 * units, torch.int32, zeroed=True)
    lo, hi = seed_words(seed)
    r_max = r_max or default_r_max(g, budget, t)
    launch(_onepass_kernel, (programs, 1, 1),
           q, k, v, lens, m, l, stash, budgets if budgets is not None else m, counts if write_counts else m, mstar,
           scr, oacc, oden, done, sync, out,
           scale, budget, lo, hi, _TILE_KEY, _BUDGET_KEY, t, hq, hkv, units, stats_items, per_item, programs, cap,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
           hq * t, t, hq * t * tile, t * tile, (hq * n) if write_counts else 0, n if write_counts else 0,
           out.stride(0), out.stride(1),
           G=g, GP=next_pow2(g), BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(block_n, tile),
           BLOCK_T=max(16, next_pow2(t)), R_MAX=min(r_max, tile), FLASH=flash, SYSTEMATIC=rounding == "systematic",
           SPLIT_AT=_split_at(v.dtype), DOT_PRECISION=_dot_precision(q.dtype), WRITE_COUNTS=write_counts,
           **_fixed_point(budget), SLEEP=not interpreted, num_warps=num_warps, num_stages=num_stages,
           **({"maxnreg": maxnreg} if maxnreg and not interpreted else {}))
    return out, counts, budgets


__all__ = ["santa_onepass_triton"]
