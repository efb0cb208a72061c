"""S²ANTA-prop and S²ANTA-flash with the sampling pass overlapping the K stream (v10).

v8 runs the stats pass over all of K, then the budgets, then the sampling pass; v9 put all of it in one
persistent kernel and lost the stream's speed (since removed; docs/methods/santa-kernels.md).
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
program of each (row, KV head): a call cut short leaves them set, and the next call would then not
wait. One workspace per device: calls on different streams of one device must not overlap in time.

This form gains over ``two_pass.py`` only when the stats programs go through several rounds of tiles,
hence the thresholds in ``decode.py`` (measured: ``docs/results/gpu-bench/2026-11-22-h100-decode-v10d.md``).
K is read up to each row's length, so the short rows of a padded batch do not stream their padding.
"""

from __future__ import annotations

import torch

from ..shared.triton_utils import (
    cdiv,
    dot_precision,
    group_block,
    is_interpreted,
    launch,
    next_pow2,
    pdl_launch,
    seed_words,
    triton,
    workspace,
)
from .common import BUDGET_KEY, TILE_KEY, begin_call, budget_meta, sample_constexprs, sample_strides, tile_count

if triton is not None:
    import triton.language as tl

    from ..shared.triton_utils import gdc_launch_dependents
    from .common import budget_jit, group_budgets, sample_fold

    @triton.jit
    def _nap(x, SLEEP: tl.constexpr):
        """A short sleep (``nanosleep``) between polls, so that idle programs leave L2 to the stream; a no-op
        under the interpreter, which has no inline assembly (and never waits: it runs programs in order)."""
        if SLEEP:
            x = tl.inline_asm_elementwise("nanosleep.u32 100; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                          is_pure=False, pack=1)
        return x

    @triton.jit
    def _ordered_stats_kernel(
        q_ptr, k_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, mstar_ptr, sync_ptr,
        scale, n_tiles, hq, hkv, n_units, rounds,
        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_PRECISION: tl.constexpr, TRACK_MAX: tl.constexpr, PDL: tl.constexpr, THREADS: tl.constexpr,
        BLOCK_B: tl.constexpr,
    ):
        """Per-tile max m, sum l and the score stash as the v8 stats pass (``two_pass.py``), tiles taken in
        unit order; each finished tile adds 1 to each of the unit's THREADS counters ``sync[u·THREADS +
        lane]``, every thread releasing its own stores, tiles past a row's length included. K rows are
        loaded up to the row's length, picked from the BLOCK_B lengths loaded before the loop (a mask from
        a value loaded in the loop would keep Triton from pipelining the K loads)."""
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
        m_ptr, l_ptr, lens_ptr, budgets_ptr, sync_ptr,
        budget, seed_lo, seed_hi, budget_key, n_tiles, hq, hkv, n_units, s_ml_b, s_ml_h,
        G: tl.constexpr, TILE: tl.constexpr, BLOCK_T: tl.constexpr, SYSTEMATIC: tl.constexpr,
        DIGIT_BITS: tl.constexpr, EARLY_EXIT: tl.constexpr, PDL: tl.constexpr,
        SLEEP: tl.constexpr, STATS_THREADS: tl.constexpr, NAPS: tl.constexpr,
    ):
        """prop: one program per (head, row), launched early (PDL) like the sampling kernel after it: waits
        for its unit's tiles, computes the head's tile budgets (``common.group_budgets``) and raises the head's
        flag ``sync[U·STATS_THREADS + b·Hq + h]`` (release)."""
        if PDL:  # the sampling kernel may start now: it waits for these flags, not for this grid
            gdc_launch_dependents()
        h = tl.program_id(0)
        b = tl.program_id(1)
        _wait_scored(sync_ptr, b * hkv + h // G, n_tiles, SLEEP, STATS_THREADS, NAPS)
        length = tl.load(lens_ptr + b)
        one = tl.arange(0, 1)
        group_budgets(m_ptr, l_ptr, budgets_ptr, h + one, one < 1, b, length, (length + TILE - 1) // TILE, budget,
                      seed_lo, seed_hi, budget_key, n_tiles, hq, s_ml_b, s_ml_h, BLOCK_T, SYSTEMATIC, DIGIT_BITS,
                      EARLY_EXIT)
        tl.debug_barrier()  # every thread's stores of the budgets are issued before the release below
        tl.atomic_xchg(sync_ptr + n_units * STATS_THREADS + b * hq + h, 1, sem="release")

    @budget_jit
    def _overlap_sample_kernel(
        v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
        oacc_ptr, oden_ptr, done_ptr, sync_ptr, out_ptr,
        budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv, n_units,
        s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
        G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
        R_MAX: tl.constexpr, FLASH: tl.constexpr, SPLIT_AT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WRITE_COUNTS: tl.constexpr, FIX_BITS: tl.constexpr, WIDE: tl.constexpr, SLEEP: tl.constexpr,
        STATS_THREADS: tl.constexpr, NAPS: tl.constexpr,
    ):
        """One program per (tile, KV head, row): wait for the unit's stats (flash) or for the budget flags
        of its heads (prop: the budget kernel raised them after the stats), then ``common.sample_fold``.
        sync words: [u·STATS_THREADS + lane] tiles scored of unit u (per stats thread),
        [U·STATS_THREADS + b·Hq + h] budget flag of head h."""
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        u = b * hkv + kvh
        flags = sync_ptr + n_units * STATS_THREADS + b * hq + kvh * G
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
        last = sample_fold(v_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr, budgets_ptr, counts_ptr, mstar_ptr, scr_ptr,
                           oacc_ptr, oden_ptr, done_ptr, out_ptr, t, kvh, b,
                           budget, seed_lo, seed_hi, tile_key, n_tiles, hq, hkv,
                           s_v_b, s_v_h, s_v_n, s_ml_b, s_ml_h, s_u_b, s_u_h, s_c_b, s_c_h, s_o_b, s_o_h,
                           G, GP, BLOCK_G, D, TILE, R_MAX, FLASH, SPLIT_AT, DOT_PRECISION, WRITE_COUNTS, FIX_BITS,
                           WIDE, ".cg")
        if last:  # every program of the unit has passed its waits: the unit's sync words back to zero
            tl.atomic_xchg(sync_ptr + u * STATS_THREADS + tl.arange(0, STATS_THREADS), 0, sem="relaxed")
            if not FLASH:
                for gi in tl.static_range(G):
                    tl.atomic_xchg(flags + gi, 0, sem="relaxed")


# Launch parameters, swept on the H100 (docs/methods/santa-kernels.md): 528 stats programs (4 per SM), 128-key
# sub-blocks, 2 stages, 4 warps; 8 sleeps of 100 ns between two polls of a waiting program.
STATS_PROGRAMS = 528
STATS_WARPS = 4
NAPS = 8


def ordered_stats_pass(q, k, lens, buf, sync, scale: float, tile: int, *, flash: bool, pdl: bool, block_n: int,
                       stats_programs: int, stats_warps: int, stats_stages: int) -> None:
    """The ordered stats launch into ``buf`` (``common.PassBuffers``), raising the tile counters in ``sync``
    (``B·Hkv·32·stats_warps`` int32, zero before; the sampling kernel clears them)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    t = tile_count(k.shape[2], tile)
    units = b * hkv
    programs = max(1, min(stats_programs, units * t))
    # as many rounds with fewer programs, every round full but the last program's (at 32k batch 8: 516 instead
    # of 528, whose 16th round held 336 tiles), so no round runs a third full; the statistics do not change
    programs = cdiv(units * t, cdiv(units * t, programs))
    launch(_ordered_stats_kernel, (programs, 1, 1),
           q, k, lens, buf.m, buf.l, buf.stash, buf.mstar, sync, scale, t, hq, hkv, units, cdiv(units * t, programs),
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), hq * t, t, hq * t * tile, t * tile,
           G=g, BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(block_n, tile),
           DOT_PRECISION=dot_precision(q.dtype), TRACK_MAX=flash, PDL=pdl, THREADS=32 * stats_warps,
           BLOCK_B=max(2, next_pow2(b)), num_warps=stats_warps, num_stages=stats_stages)


def _overlap(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *, flash: bool, rounding: str,
             write_counts: bool, out, block_n: int, stats_programs: int, r_max: int | None,
             stats_warps: int = STATS_WARPS, stats_stages: int = 2):
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    t, pdl, buf = begin_call(q, k, v, tile, flash=flash, rounding=rounding, write_counts=write_counts, out=out)
    units = b * hkv
    threads = 32 * stats_warps
    sleep = not is_interpreted(_overlap_sample_kernel)
    # one tile counter per (unit, stats thread), then one budget flag per (row, head); zero between calls
    sync = workspace("overlap_sync", q, units * threads + b * hq, torch.int32, zeroed=True)
    ordered_stats_pass(q, k, lens, buf, sync, scale, tile, flash=flash, pdl=pdl, block_n=block_n,
                       stats_programs=stats_programs, stats_warps=stats_warps, stats_stages=stats_stages)
    lo, hi = seed_words(seed)
    if not flash:
        # one program per (head, row): each raises its head's flag
        launch(_unit_budget_kernel, (hq, b, 1),
               buf.m, buf.l, lens, buf.budgets, sync, budget, lo, hi, BUDGET_KEY, t, hq, hkv, units, hq * t, t,
               G=g, TILE=tile, **budget_meta(t, rounding=rounding), PDL=pdl, SLEEP=sleep, STATS_THREADS=threads,
               NAPS=NAPS, num_warps=4, **pdl_launch(pdl))
    launch(_overlap_sample_kernel, (t, hkv, b),
           v, lens, buf.m, buf.l, buf.stash, buf.budgets if buf.budgets is not None else buf.m,
           buf.counts if write_counts else buf.m, buf.mstar, buf.scr, buf.oacc, buf.oden, buf.done, sync, buf.out,
           budget, lo, hi, TILE_KEY, t, hq, hkv, units, *sample_strides(v, buf, hq, t, tile, write_counts),
           **sample_constexprs(v, hq, budget, t, tile, flash=flash, write_counts=write_counts, r_max=r_max),
           SLEEP=sleep, STATS_THREADS=threads, NAPS=NAPS, num_warps=4, **pdl_launch(pdl))
    return buf


def santa_prop_overlap(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                       rounding: str = "largest-remainder", write_counts: bool = False,
                       out: torch.Tensor | None = None, block_n: int = 128, stats_programs: int = STATS_PROGRAMS,
                       r_max: int | None = None, stats_warps: int = STATS_WARPS, stats_stages: int = 2):
    """S²ANTA-prop with the budgets and the sampling overlapping the K stream (3 launches). Returns ``(out
    [B, Hq, d] in q's dtype, counts [B, Hq, N] int32 or None, tile budgets [B, Hq, T] int32)``: the
    counts and budgets of ``two_pass.santa_prop_two_pass`` for the same seed. ``block_n``,
    ``stats_programs``, ``stats_warps``, ``stats_stages`` and ``r_max`` are launch parameters; they change
    no count."""
    buf = _overlap(q, k, v, lens, scale, budget, tile, seed, flash=False, rounding=rounding,
                   write_counts=write_counts, out=out, block_n=block_n, stats_programs=stats_programs, r_max=r_max,
                   stats_warps=stats_warps, stats_stages=stats_stages)
    return buf.out, buf.counts, buf.budgets


def santa_flash_overlap(q, k, v, lens, scale: float, budget: int, tile: int, seed: int, *,
                        write_counts: bool = False, out: torch.Tensor | None = None, block_n: int = 128,
                        stats_programs: int = STATS_PROGRAMS, r_max: int | None = None):
    """S²ANTA-flash with the sampling overlapping the K stream (2 launches). Returns ``(out, counts or
    None)``, the counts of ``two_pass.santa_flash_two_pass`` for the same seed."""
    buf = _overlap(q, k, v, lens, scale, budget, tile, seed, flash=True, rounding="largest-remainder",
                   write_counts=write_counts, out=out, block_n=block_n, stats_programs=stats_programs, r_max=r_max)
    return buf.out, buf.counts


__all__ = ["ordered_stats_pass", "santa_flash_overlap", "santa_prop_overlap"]
