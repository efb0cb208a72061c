"""S²ANTA-prop and S²ANTA-flash with the sampling pass overlapping the K stream (v10).

v8 runs the stats pass over all of K, then the budgets, then the sampling pass; v9 put all of it in one
persistent kernel and lost the stream's speed (since removed; docs/methods/santa-kernels.md, version log).
Here the passes stay separate kernels with their own registers and shared memory (flash 2 launches, prop 3):

- ``_ordered_stats_kernel`` scores the tiles in *unit order* (a unit is a (batch row, KV head)): tile
  ``g = i·P + p`` of the unit-major tile list is program p's i-th, so round i of all P programs covers
  the next P tiles and the units are finished one after the other while every program keeps one
  pipelined loop (q is reloaded per sub-block, and the rows' lengths are loaded once before the loop:
  a mask from a value loaded in the loop, or a barrier in it, keeps Triton from pipelining the loop).
  At the end of each tile every thread adds 1 to its own counter of the unit with release semantics
  (its own stores of the tile before it).
- prop: ``_unit_budget_kernel``, one program per (head, row), launched early with programmatic dependent
  launch (Hopper and newer): it waits for its unit's tiles, computes the head's tile budgets and raises
  the head's flag.
- The sampling kernel, also launched early, the v8 sampling pass with the merge folded in: each program
  waits for its unit (flash: the tile counters, one polled sparsely, then all with acquire) or for its
  heads' budget flags (prop), so the units that are done sample while the later ones stream.

Safe from deadlock: a dependent grid starts only after every program of the grid before it has started,
and the stats programs never wait. Without programmatic dependent launch (the interpreter, older GPUs)
the kernels run one after the other and nothing waits. Counts, budgets and outputs are those of the v8
paths for the same seed. The sync words are left at zero for the next call, by the last sampling
program of each (row, KV head): a call cut short (or ``ordered_stats_only`` without ``reset_sync``)
leaves them set, and the next call would then not wait. One workspace per device: calls on different
streams of one device must not overlap in time.

Measured (H100, llama 32/8/128, bf16, graph µs, ``benchmarks/results/2026-11-22-h100-decode-v10b.*``),
v10 against v8: flash S=2048 56.1 / 57.9 at 32k, 85.6 / 91.2 at 64k, 140.0 / 152.8 at 128k, 253.5 / 294.7
at 256k; prop S=128 54.2 / 51.7 at 32k, 84.2 / 86.3 at 64k, 135.9 / 144.1 at 128k, 245.9 / 263.4 at 256k.
The defaults (``triton_santa``): flash from 1,024 tiles in all (rows × KV heads × tiles), prop from 2,048,
since v10 gains only when the stats programs go through several rounds of tiles (``…-decode-v10d``).
The ordered stats pass alone takes 38.2 µs at 32k and 112.5 at 128k against v8's 37.0 and 110.3
(``…-v10-timeline-probes.log``); ``trace=`` shows where a call's time goes, per unit. K is read up to
each row's length (until this round it was read up to the cache's, so short rows of a padded batch
streamed their padding and v10 lost to v8 there: ``--ragged``).
"""

from __future__ import annotations

import torch

from ..triton_utils import group_block, is_interpreted, launch, next_pow2, seed_words, triton, workspace
from .kernels import (
    _BUDGET_KEY,
    _TILE_KEY,
    _check_rounding,
    _check_tile,
    _dot_precision,
    _fixed_point,
    _pass_buffers,
    _pdl,
    _split_at,
    _stats_buffers,
    _tiles,
    default_r_max,
)

if triton is not None:
    import triton.language as tl

    from .kernels import _group_budgets, _sample_fold, budget_jit, gdc_launch_dependents

    @triton.jit
    def _nap(x, SLEEP: tl.constexpr):
        """A short sleep (``nanosleep``) between polls, so that idle programs leave L2 to the stream; a no-op
        under the interpreter, which has no inline assembly (and never waits: it runs programs in order)."""
        if SLEEP:
            x = tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                          is_pure=False, pack=1)
        return x

    @triton.jit
    def _now(like):
        """The GPU's global nanosecond timer (``%globaltimer``), for the opt-in timeline trace."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [like], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _ordered_stats_kernel(
        q_ptr, k_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, mstar_ptr, sync_ptr, trace_ptr,
        scale, n_tiles, hq, hkv, n_units, rounds,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, TRACK_MAX: tl.constexpr, PDL: tl.constexpr, THREADS: tl.constexpr,
        BLOCK_B: tl.constexpr, STASH: tl.constexpr, RELEASE: tl.constexpr, TRACE: tl.constexpr,
    ):
        """Per-tile max m, sum l and the score stash as ``_stats_tiles``, tiles taken in unit order; each
        finished tile adds 1 to each of the unit's THREADS counters ``sync[u·THREADS + lane]``, every thread
        releasing its own stores, tiles past a row's length included (``STASH``/``RELEASE`` False: no stash
        stores / no counters, only to time what they cost). K rows are loaded up to the row's length,
        picked from the BLOCK_B lengths loaded before the loop (a mask from a value loaded in the loop
        would keep Triton from pipelining the K loads)."""
        SUBS: tl.constexpr = TILE // BLOCK_N
        if PDL:  # the sampling kernel may start now: its programs wait per unit, not for this grid
            gdc_launch_dependents()
        p = tl.program_id(0)
        n_programs = tl.num_programs(0)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        g_ok = offs_g < G
        total = n_units * n_tiles
        # every row's length, loaded once before the loop: a mask from a value loaded in the loop would keep
        # Triton from pipelining it, one picked from registers does not
        offs_b = tl.arange(0, BLOCK_B)
        row_lens = tl.load(lens_ptr + offs_b, mask=offs_b < n_units // hkv, other=0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        for j in range(0, rounds * SUBS):
            sub = j % SUBS
            tile_id = (j // SUBS) * n_programs + p
            live = tile_id < total
            tile_id = tl.where(live, tile_id, 0)
            u = tile_id // n_tiles
            t = tile_id % n_tiles
            b = u // hkv
            kvh = u % hkv
            heads = kvh * G + offs_g
            # q changes with the unit: reloaded per sub-block (4 KB, from L1/L2) so that one loop stays pipelined
            q = tl.load(q_ptr + b * s_q_b + heads[:, None] * s_q_h + offs_d[None, :], mask=g_ok[:, None],
                        other=0.0)
            offs_n = t * TILE + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            # masks from one comparison each (the interpreter rejects a mask formed with `& live`)
            length = tl.sum(tl.where(offs_b == b, row_lens, 0), axis=0)
            in_row = offs_n < tl.where(live, length, 0)
            k = tl.load(k_ptr + b * s_k_b + kvh * s_k_h + offs_n[:, None] * s_k_n + offs_d[None, :],
                        mask=in_row[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            s = tl.where(in_row[None, :], s, float("-inf"))
            g_live = offs_g < tl.where(live, G, 0)
            if STASH:
                tl.store(stash_ptr + b * s_u_b + heads[:, None] * s_u_h + offs_n[None, :], s, mask=g_live[:, None])
            first = sub == 0
            m = tl.where(first, float("-inf"), m)
            l = tl.where(first, 0.0, l)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # a tile past the row's length stays (-inf, 0)
            l = l * tl.exp(m - m_use) + tl.sum(tl.exp(s - m_use[:, None]), axis=1)
            m = m_new
            done = live & (sub == SUBS - 1)
            g_done = offs_g < tl.where(done, G, 0)
            ml = b * s_ml_b + heads * s_ml_h + t
            tl.store(m_ptr + ml, m, mask=g_done)
            tl.store(l_ptr + ml, l, mask=g_done)
            if TRACK_MAX:
                tl.atomic_max(mstar_ptr + b * hq + heads, m, mask=g_done, sem="relaxed")
            # Every thread releases its own stores of the tile (a barrier in the loop would stop Triton from
            # pipelining it), each on its own counter of the unit (one address for all would serialise).
            if TRACE:  # when each tile was scored (ns): trace[tile]
                tl.store(trace_ptr + tile_id, _now(p), mask=done)
            if RELEASE:
                lanes = tl.arange(0, THREADS)
                tl.atomic_add(sync_ptr + u * THREADS + lanes, tl.full([THREADS], 1, tl.int32),
                              mask=lanes < tl.where(done, THREADS, 0), sem="release")

    @triton.jit
    def _wait_scored(sync_ptr, u, n_tiles, SLEEP: tl.constexpr, STATS_THREADS: tl.constexpr, NAPS: tl.constexpr):
        """Until every tile of unit u is scored. Polls one lane (the threads of a stats program count their
        tile together), sparsely: waiting programs poll while the stats kernel streams K. Then all lanes
        with acquire, each pairing with the release of one stats thread; a barrier puts every thread's
        acquire before any thread's loads that follow."""
        lane0 = tl.atomic_add(sync_ptr + u * STATS_THREADS, 0, sem="relaxed")
        while lane0 < n_tiles:
            for _ in tl.static_range(NAPS):
                lane0 = _nap(lane0, SLEEP)
            lane0 = tl.atomic_add(sync_ptr + u * STATS_THREADS, 0, sem="relaxed")
        lanes = sync_ptr + u * STATS_THREADS + tl.arange(0, STATS_THREADS)
        scored = tl.sum(tl.atomic_add(lanes, 0, sem="acquire"), axis=0)
        while scored < n_tiles * STATS_THREADS:
            scored = _nap(scored, SLEEP)
            scored = tl.sum(tl.atomic_add(lanes, 0, sem="acquire"), axis=0)
        tl.debug_barrier()

    @budget_jit
    def _unit_budget_kernel(
        m_ptr, l_ptr, lens_ptr, budgets_ptr, sync_ptr, trace_ptr,
        budget, seed_lo, seed_hi, budget_key, n_tiles, hq, hkv, n_units, s_ml_b, s_ml_h,
        G: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr, SYSTEMATIC: tl.constexpr, PDL: tl.constexpr,
        SLEEP: tl.constexpr, STATS_THREADS: tl.constexpr, NAPS: tl.constexpr, TRACE: tl.constexpr,
    ):
        """prop: one program per (head, row), launched early (PDL) like the sampling kernel after it: waits
        for its unit's tiles, computes the head's tile budgets (``_group_budgets``) and raises the head's
        flag ``sync[U·STATS_THREADS + b·Hq + h]`` (release)."""
        if PDL:  # the sampling kernel may start now: it waits for these flags, not for this grid
            gdc_launch_dependents()
        h = tl.program_id(0)
        b = tl.program_id(1)
        _wait_scored(sync_ptr, b * hkv + h // G, n_tiles, SLEEP, STATS_THREADS, NAPS)
        if TRACE:  # trace[(b·Hq + h)·2 + 0/1]: after the wait, before the flag (ns)
            tl.store(trace_ptr + (b * hq + h) * 2, _now(h))
        length = tl.load(lens_ptr + b)
        one = tl.arange(0, 1)
        _group_budgets(m_ptr, l_ptr, budgets_ptr, h + one, one < 1, b, (length + TILE - 1) // TILE, budget,
                       seed_lo, seed_hi, budget_key, n_tiles, hq, s_ml_b, s_ml_h, BLOCK_T, SYSTEMATIC)
        tl.debug_barrier()  # every thread's stores of the budgets are issued before the release below
        if TRACE:
            tl.store(trace_ptr + (b * hq + h) * 2 + 1, _now(h))
        tl.atomic_xchg(sync_ptr + n_units * STATS_THREADS + b * hq + h, 1, sem="release")

    @budget_jit
    def _overlap_sample_kernel(
        v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
        oacc_ptr, oden_ptr, done_ptr, sync_ptr, out_ptr, trace_ptr,
        budget, seed_lo, seed_hi, tile_key, budget_key, n_tiles, hq, hkv, n_units,
        s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
        G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        R_MAX: tl.constexpr, FLASH: tl.constexpr, SYSTEMATIC: tl.constexpr,
        SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr, WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr,
        WIDE: tl.constexpr, SLEEP: tl.constexpr, STATS_THREADS: tl.constexpr, NAPS: tl.constexpr,
        TRACE: tl.constexpr,
    ):
        """One program per (tile, KV head, row): wait for the unit's stats (flash) or for the budget flags
        of its heads (prop: the budget kernel raised them after the stats), then ``_sample_fold``.
        sync words: [u·STATS_THREADS + lane] tiles scored of unit u (per stats thread),
        [U·STATS_THREADS + b·Hq + h] budget flag of head h."""
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        u = b * hkv + kvh
        flags = sync_ptr + n_units * STATS_THREADS + b * hq + kvh * G
        trace = trace_ptr + (u * n_tiles + t) * 3  # start, after the wait, end (ns)
        if TRACE:
            tl.store(trace, _now(t))
        if FLASH:
            _wait_scored(sync_ptr, u, n_tiles, SLEEP, STATS_THREADS, NAPS)
        else:
            for gi in tl.static_range(G):
                flag = tl.atomic_add(flags + gi, 0, sem="acquire")  # pairs with the budget kernel's release
                while flag == 0:
                    for _ in tl.static_range(NAPS):
                        flag = _nap(flag, SLEEP)
                    flag = tl.atomic_add(flags + gi, 0, sem="acquire")
            tl.debug_barrier()
        if TRACE:
            tl.store(trace + 1, _now(t))
        last = _sample_fold(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
                            oacc_ptr, oden_ptr, done_ptr, out_ptr, t, kvh, b,
                            budget, seed_lo, seed_hi, tile_key, budget_key, n_tiles, hq, hkv,
                            s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
                            G, GP, BLOCK_G, D, TILE, R_MAX, FLASH, False, SYSTEMATIC, 16, SPLIT_AT,
                            DOT_PRECISION, WRITE_COUNTS, FIX_BITS, WIDE, ".cg")
        if TRACE:
            tl.store(trace + 2, _now(t))
        if last:  # every program of the unit has passed its waits: the unit's sync words back to zero
            tl.atomic_xchg(sync_ptr + u * STATS_THREADS + tl.arange(0, STATS_THREADS), 0, sem="relaxed")
            if not FLASH:
                for gi in tl.static_range(G):
                    tl.atomic_xchg(flags + gi, 0, sem="relaxed")


def _ordered_stats_raw(q, k, lens, m, l, stash, mstar, sync, scale, t, hq, hkv, units, programs, rounds, d, g, tile,
                       *, flash, pdl, block_n, num_warps, num_stages, store_stash=True, release=True,
                       trace=None):
    launch(_ordered_stats_kernel, (programs, 1, 1),
           q, k, lens, m, l, stash, mstar, sync, sync if trace is None else trace, scale, t, hq, hkv, units, rounds,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), hq * t, t, hq * t * tile, t * tile,
           G=g, BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(block_n, tile),
           DOT_PRECISION=_dot_precision(q.dtype), TRACK_MAX=flash, PDL=pdl, THREADS=32 * num_warps,
           BLOCK_B=max(2, next_pow2(q.shape[0])), STASH=store_stash, RELEASE=release, TRACE=trace is not None,
           num_warps=num_warps, num_stages=num_stages)


def _sync_words(q, units: int, heads: int, num_warps: int) -> torch.Tensor:
    """One tile counter per (unit, stats thread), then one budget flag per (row, head); zero between calls."""
    return workspace("overlap_sync", q, units * 32 * num_warps + heads, torch.int32, zeroed=True)


def ordered_stats_only(q, k, lens, scale: float, tile: int, *, stats_programs: int = 528, block_n: int = 128,
                       num_warps: int = 4, num_stages: int = 2, stash: bool = True, release: bool = True):
    """The ordered stats pass alone (for timing it against the v8 stats pass; ``stash``/``release`` False
    leave out the stash stores / the tile counters, to time what they cost); leaves its counters in the
    workspace, so ``reset_sync(q)`` must follow before the next sampling call."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    t = _tiles(n, tile)
    units = b * hkv
    programs = max(1, min(stats_programs, units * t))
    m, l, stash_buf = _stats_buffers(q, b, hq, t, tile)
    sync = _sync_words(q, units, b * hq, num_warps)
    _ordered_stats_raw(q, k, lens, m, l, stash_buf, m, sync, scale, t, hq, hkv, units, programs,
                       -(-units * t // programs), d, hq // hkv, tile, flash=False, pdl=False, block_n=block_n,
                       num_warps=num_warps, num_stages=num_stages, store_stash=stash, release=release)


def reset_sync(like: torch.Tensor) -> None:
    workspace("overlap_sync", like, 1, torch.int32, zeroed=True).zero_()


def santa_overlap_triton(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *, flash: bool,
                         rounding: str = "largest-remainder", write_counts: bool = False, stats_programs: int = 528,
                         block_n: int = 128, num_warps: int = 4, num_stages: int = 2, sample_warps: int = 4,
                         naps: int = 8, r_max: int | None = None, out: torch.Tensor | None = None,
                         trace: dict | None = None):
    """S²ANTA-prop (``flash=False``) or S²ANTA-flash, the sampling overlapping the K stream (2 launches).
    Returns ``(out, counts or None, tile budgets [B, Hq, T] int32 or None (flash))``; same counts and
    budgets as the v8 paths for the same seed. ``naps``: 100 ns sleeps between two polls of a waiting
    sampling program. ``trace``: a dict that receives the timeline of the call in GPU ns
    (``%globaltimer``, GPU only): "tiles" [B·Hkv·T] when each tile was scored (unit-major), "budgets"
    [B·Hq, 2] after the wait and before the flag (prop), "samples" [B·Hkv·T, 3] start, after the wait
    and end of each sampling program."""
    _check_tile(tile)
    _check_rounding(rounding)
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    t = _tiles(n, tile)
    units = b * hkv
    programs = max(1, min(stats_programs, units * t))
    rounds = -(-units * t // programs)
    interpreted = is_interpreted(_overlap_sample_kernel)
    pdl = _pdl()
    m, l, stash, budgets, mstar, oacc, oden, done, scr, counts, out = _pass_buffers(
        q, v, t, tile, flash=flash, write_counts=write_counts, out=out)
    sync = _sync_words(q, units, b * hq, num_warps)
    if trace is not None:
        if interpreted:
            raise ValueError("trace: the timeline reads the GPU's timer; the interpreter has none")
        trace.update({"tiles": torch.zeros(units * t, device=q.device, dtype=torch.int64),
                      "budgets": torch.zeros(b * hq, 2, device=q.device, dtype=torch.int64),
                      "samples": torch.zeros(units * t, 3, device=q.device, dtype=torch.int64)})
    traced = trace is not None
    _ordered_stats_raw(q, k, lens, m, l, stash, mstar, sync, scale, t, hq, hkv, units, programs, rounds, d, g,
                       tile, flash=flash, pdl=pdl, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                       trace=trace["tiles"] if traced else None)
    lo, hi = seed_words(seed)
    if not flash:
        launch(_unit_budget_kernel, (hq, b, 1),
               m, l, lens, budgets, sync, trace["budgets"] if traced else sync,
               budget, lo, hi, _BUDGET_KEY, t, hq, hkv, units, hq * t, t,
               G=g, TILE=tile, BLOCK_T=max(16, next_pow2(t)), SYSTEMATIC=rounding == "systematic", PDL=pdl,
               SLEEP=not interpreted, STATS_THREADS=32 * num_warps, NAPS=naps, TRACE=traced, num_warps=4,
               **({"launch_pdl": True} if pdl else {}))
    launch(_overlap_sample_kernel, (t, hkv, b),
           v, lens, m, l, stash, budgets if budgets is not None else m, counts if write_counts else m, mstar, scr,
           oacc, oden, done, sync, out, trace["samples"] if traced else sync,
           budget, lo, hi, _TILE_KEY, _BUDGET_KEY, t, hq, hkv, units,
           v.stride(0), v.stride(1), v.stride(2), hq * t, t, hq * t * tile, t * tile,
           (hq * n) if write_counts else 0, n if write_counts else 0, out.stride(0), out.stride(1),
           G=g, GP=next_pow2(g), BLOCK_G=group_block(g), D=d, TILE=tile,
           R_MAX=min(r_max or default_r_max(g, budget, t), tile), FLASH=flash, SYSTEMATIC=rounding == "systematic",
           SPLIT_AT=_split_at(v.dtype), DOT_PRECISION=_dot_precision(v.dtype), WRITE_COUNTS=write_counts,
           **_fixed_point(budget), SLEEP=not interpreted, STATS_THREADS=32 * num_warps, NAPS=naps,
           TRACE=traced,
           num_warps=sample_warps,
           **({"launch_pdl": True} if pdl else {}))
    return out, counts, budgets


__all__ = ["santa_overlap_triton"]
