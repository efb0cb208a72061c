"""Bernoulli qKᵀ with S²ANTA-prop's V sampling, over a feature-major copy of K: the GPU decode path of
``bernoulli-qk:query=mean-group,values=santa-prop`` (stratified, per-feature strata), and its reference.

Four launches per call, five where the cache rows ``k`` are given (the method's path):

1. ``_mean_group_draw_kernel``, one program per (row, KV head): with ``append``, first the new keys of the
   cache copied into the feature-major copy (``feature_major.append_new_keys``; no launch of its own), then
   ``m = mean_g |q_g|``, ``f = m / norm``
   (``norm = norm_factor · max m``), the stratified counts ``c_i = ⌊B f_i⌋ + 1{u_i < frac(B f_i)}``
   with ``u_i`` the uniform of stratum ``⌊B f_i⌋`` (the only one a stratified draw reads), the
   effective queries ``q_est_g = (norm/B) c ⊙ q_g / m`` and the kept features listed first
   (``feature_major.compact_features``'s order). ``u_i`` is the number the reference path draws:
   ``hash_uniform`` of the row's words (``core.rng.row_words``: the call's key, batch row, position),
   stream ``STREAM_BERNOULLI``, counter ``(kvh·B + ⌊B f_i⌋)·2^22 + i``.
2. ``_feature_major_stats_kernel`` (launched under the draw launch, PDL): S²ANTA's stats pass (per-tile max m,
   Σ e^{s−m} and the float32 score stash, ``santa/two_pass.py``) with the scores ``scale · q_est · kT`` read
   over the listed features only: the K bytes read are the kept fraction of K's. ``stream_stats`` sums them
   in one flat pipelined loop per program (K loads stay in flight across sub-blocks and tiles), a few long
   programs per unit, over the effective queries in the list's order, which the draw launch also writes.
3. ``_row_stats_kernel`` (given ``k``): the same statistics for each (row, KV head) whose draws kept more
   than ``ROW_LAYOUT_ABOVE`` of the features, from whole rows of the cache, in santa-prop's stats loop
   (long pipelined streams, several tiles per program): the feature rows cost more per byte, and with most
   features kept they cost more in all. Each unit is served by exactly one of the two launches (the other's
   programs for it return at once), so a call whose draws keep most features streams K as santa-prop's
   stats pass does, plus the draw launch and a near-empty one; with programmatic dependent launch the two
   stats launches run side by side. Gaussian queries keep ~98 % at B = 4, the
   real SmolLM2-135M's ~52 % (39–69 % over units), the bench's peaked model's ~29 % (~52 % at B = 8)
   (``benchmarks/breakdown/bernoulli_kept.py``).
4.–5. S²ANTA-prop's budget and compacted sampling passes, unchanged (``two_pass.prop_sampling_passes``).

The V stage takes its seed by value and keys each row by its length, as ``santa-prop``'s kernels do;
the score stage draws the reference path's numbers. ``bernoulli_prop_reference`` is the float64 twin
(given the same seed and lengths it draws the same features, tile budgets and counts, up to rare float32
boundary flips).
"""

from __future__ import annotations

import torch

from ...core.rng import GOLDEN, MASK32, STREAM_BERNOULLI, RandomKey, RowStreams
from ..santa.common import begin_call
from ..santa.reference import n_tiles, santa_prop_reference
from ..santa.two_pass import prop_sampling_passes
from ..shared.sample_triton import row_words_triton
from ..shared.triton_utils import (
    budget_uniforms,
    cdiv,
    group_block,
    launch,
    pdl_launch,
    tile_uniforms,
    triton,
    workspace,
)
from .feature_major import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, split_dots
from .reference import check_draws, estimated_scores, mean_group_query

STREAM_KEY = (STREAM_BERNOULLI * GOLDEN) & MASK32

if triton is not None:
    import triton.language as tl

    from ..santa.common import fold_scores
    from ..shared.triton_utils import gdc_launch_dependents, gdc_wait, hash_mix32, hash_uniform
    from .feature_major import append_new_keys, feature_dot, row_scores

    @triton.jit
    def _mean_group_draw_kernel(q_ptr, lens_ptr, words_ptr, qest_ptr, qc_ptr, idx_ptr, nfeat_ptr,
                                kc_ptr, done_ptr, kt_ptr,
                                key_lo, key_hi, draws, norm_factor, rows_per_batch, kv_heads, s_q_r, s_q_h,
                                s_kc_b, s_kc_h, s_kc_n, s_kt_b, s_kt_h, s_kt_f,
                                G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                                ROW_WORDS: tl.constexpr, STREAM: tl.constexpr, APPEND: tl.constexpr,
                                PDL: tl.constexpr):
        if PDL:  # the stats launch may start now: it waits (gdc_wait) for this one before reading anything
            gdc_launch_dependents()
        kvh = tl.program_id(0)
        r = tl.program_id(1)
        if APPEND:  # the batch row's last query row brings its KV head's kT up to the cache (one launch less)
            if r % rows_per_batch == rows_per_batch - 1:
                append_new_keys(kc_ptr, lens_ptr, done_ptr, kt_ptr, r // rows_per_batch, kvh, rows_per_batch,
                                kv_heads, s_kc_b, s_kc_h, s_kc_n, s_kt_b, s_kt_h, s_kt_f, D, 64)
        offs_g = tl.arange(0, BLOCK_G)
        g_ok = offs_g < G
        offs_d = tl.arange(0, D)
        heads = kvh * G + offs_g
        q = tl.load(q_ptr + r * s_q_r + heads[:, None] * s_q_h + offs_d[None, :], mask=g_ok[:, None],
                    other=0.0).to(tl.float32)
        m = tl.sum(tl.abs(q), axis=0) / G
        norm = tl.max(m, axis=0) * norm_factor
        f = tl.where(norm > 0, m / tl.where(norm > 0, norm, 1.0), 0.0)
        bf = f * draws
        whole = tl.floor(bf)
        frac = bf - whole
        stratum = tl.minimum(whole, draws - 1).to(tl.int64)
        if ROW_WORDS:  # keys with device counters or per-row seeds: words computed by core.rng
            lo = tl.load(words_ptr + 2 * r)
            hi = tl.load(words_ptr + 2 * r + 1)
        else:  # core.rng.row_words of the call's words, the batch row and the position (valid length)
            position = tl.load(lens_ptr + r).to(tl.int64)
            brow = (r // rows_per_batch).to(tl.int64)
            lo = hash_mix32((key_lo ^ brow ^ 0x243F6A88) & 0xFFFFFFFF)
            hi = hash_mix32((key_hi ^ lo ^ position ^ 0x85A308D3) & 0xFFFFFFFF)
            lo = hash_mix32(lo ^ hi)
        u = hash_uniform(lo, hi, STREAM, ((kvh * draws + stratum) << 22) + offs_d)
        c = whole + (u < frac).to(tl.float32)
        m_hat = (norm / draws) * c
        q_est = m_hat[None, :] * tl.where(m[None, :] > 0, q / tl.where(m > 0, m, 1.0)[None, :], 0.0)
        tl.store(qest_ptr + (r * kv_heads * G + heads[:, None]) * D + offs_d[None, :], q_est, mask=g_ok[:, None])
        kept = (c > 0).to(tl.int32)
        before = tl.cumsum(kept, axis=0)  # kept features up to and including i
        nf = tl.sum(kept, axis=0)
        slot = tl.where(kept > 0, before - 1, nf + offs_d - before)  # kept first, then the others, ascending
        row = r * kv_heads + kvh
        tl.store(idx_ptr + row * D + slot, offs_d)
        tl.store(nfeat_ptr + row, nf)
        # q_est in the list's order too: the feature-major stats loop reads it without the list
        tl.store(qc_ptr + (r * kv_heads * G + heads[:, None]) * D + slot[None, :], q_est, mask=g_ok[:, None])

    @triton.jit
    def _feature_major_stats_kernel(qest_ptr, kt_ptr, idx_ptr, nfeat_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr,
                                    scale, tiles_per_program, hq, kv_heads, rows_per_batch, row_above, capacity,
                                    s_kt_b, s_kt_h, s_kt_f, s_ml_b, s_ml_h, s_u_b, s_u_h,
                                    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                                    BLOCK_N: tl.constexpr, FB: tl.constexpr, SPLIT: tl.constexpr,
                                    PDL: tl.constexpr):
        """two_pass's stats pass with Bernoulli scores: tiles t0..t1-1 of (row r, KV head kvh), over the
        listed features of the feature-major copy (:func:`stream_stats`, ``qest`` in the list's order); a unit
        whose draws kept more than ``row_above`` features is left to ``_row_stats_kernel``."""
        if PDL:  # launched early: wait for the draw launch (q_est, the feature lists, kT's new keys), then let the
            # next launch (row stats or budgets) start: it reads the draw launch's outputs too
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        r = tl.program_id(2)
        length = tl.load(lens_ptr + r)
        row = r * kv_heads + kvh
        nf = tl.load(nfeat_ptr + row)
        t0 = pid * tiles_per_program
        t1 = tl.minimum(t0 + tiles_per_program, (length + TILE - 1) // TILE)
        if (t0 < t1) & (nf <= row_above):
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = kvh * G + offs_g
            kt_base = kt_ptr + (r // rows_per_batch).to(tl.int64) * s_kt_b + kvh * s_kt_h
            ml_base = r * s_ml_b + heads * s_ml_h
            stream_stats(qest_ptr + (r * hq + heads) * D, kt_base, idx_ptr + row * D, nf,
                         stash_ptr + r * s_u_b + heads[:, None] * s_u_h, m_ptr + ml_base, l_ptr + ml_base, g_ok,
                         t0, t1, length, capacity, scale, s_kt_f, BLOCK_G, D, TILE, BLOCK_N, FB, SPLIT)

    @triton.jit
    def stream_stats(q_rows, kt_base, idx_base, nf, u_base, m_rows, l_rows, g_ok, t0, t1, length, capacity, scale,
                     s_kt_f, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                     FB: tl.constexpr, SPLIT: tl.constexpr):
        """The stats of tiles t0..t1-1 of one unit in one flat loop over (sub-block, feature block) steps, so
        that the compiler's software pipeline keeps feature-row loads in flight across sub-block and tile
        boundaries (nested loops drain it every ⌈nf/FB⌉ steps) and a program can take many tiles. The
        effective queries ``q_rows`` are in the list's order (the draw launch writes them so), and the list
        is held in registers, so that no load in the loop waits on another."""
        SUBS: tl.constexpr = TILE // BLOCK_N
        blocks = tl.maximum((nf + FB - 1) // FB, 1)  # nf = 0: one block of zeros, so every score is 0
        # one row per feature block: a K load whose rows come from a load in the loop costs the pipeline a stage
        # (one K block in flight at 3 stages, in the TTGIR, instead of two)
        lists = tl.arange(0, D // FB)
        listed = tl.load(idx_base + lists[:, None] * FB + tl.arange(0, FB)[None, :])
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
        for i in range(0, (t1 - t0) * SUBS * blocks):
            c = i % blocks
            j = t0 * SUBS + i // blocks  # the sub-block
            offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_f = c * FB + tl.arange(0, FB)
            f_ok = offs_f < nf
            feat = tl.sum(tl.where((lists == c)[:, None], listed, 0), axis=0)
            k = tl.load(kt_base + feat[:, None].to(tl.int64) * s_kt_f + offs_n[None, :],
                        mask=f_ok[:, None] & (offs_n < capacity)[None, :], other=0.0)  # capacity: feature_scores
            qv = tl.load(q_rows[:, None] + offs_f[None, :], mask=g_ok[:, None] & f_ok[None, :], other=0.0)
            acc += feature_dot(qv, k, SPLIT)
            if c == blocks - 1:  # the sub-block's scores are complete
                s = tl.where((offs_n < length)[None, :], acc * scale, float("-inf"))
                tl.store(u_base + offs_n[None, :], s, mask=g_ok[:, None])
                first = (j % SUBS) == 0
                m, l = fold_scores(tl.where(first, float("-inf"), m), tl.where(first, 0.0, l), s)
                if (j % SUBS) == SUBS - 1:
                    tl.store(m_rows + j // SUBS, m, mask=g_ok)
                    tl.store(l_rows + j // SUBS, l, mask=g_ok)
                # reset here, not by a select at the block's first step: that select kept 30-40 more registers
                # live at 4-5 stages (166 against 128 at 5: 3 programs an SM against 4)
                acc = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)

    @triton.jit
    def _row_stats_kernel(qest_ptr, k_ptr, nfeat_ptr, lens_ptr, m_ptr, l_ptr, stash_ptr,
                          scale, tiles_per_program, hq, kv_heads, row_above,
                          s_k_r, s_k_h, s_k_n, s_ml_b, s_ml_h, s_u_b, s_u_h,
                          G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr,
                          BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
        """The units whose draws kept more than ``row_above`` features, from whole rows of the cache layout
        ``k`` (the same sum: ``q_est`` is zero off the kept features): santa-prop's stats loop
        (``santa/two_pass.py``: several tiles per program in one pipelined loop over sub-blocks, (m, l)
        reset at each tile start), so that such a unit streams K as fast as santa-prop does.

        With programmatic dependent launch it runs beside the feature-major launch before it (the units are
        disjoint, and both read only what the draw launch, finished before either started, wrote), and waits
        for it before finishing, so that the budget launch's wait covers both."""
        SUBS: tl.constexpr = TILE // BLOCK_N
        if PDL:  # the budget kernel may launch now: it waits (gdc_wait) until this one is done
            gdc_launch_dependents()
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        r = tl.program_id(2)
        length = tl.load(lens_ptr + r)
        nf = tl.load(nfeat_ptr + r * kv_heads + kvh)
        t0 = pid * tiles_per_program
        t1 = tl.minimum(t0 + tiles_per_program, (length + TILE - 1) // TILE)
        if (t0 < t1) & (nf > row_above):
            offs_g = tl.arange(0, BLOCK_G)
            g_ok = offs_g < G
            heads = kvh * G + offs_g
            q_rows = qest_ptr + (r * hq + heads) * D
            k_base = k_ptr + r.to(tl.int64) * s_k_r + kvh * s_k_h
            u_base = stash_ptr + r * s_u_b + heads[:, None] * s_u_h
            ml_base = r * s_ml_b + heads * s_ml_h
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_G], tl.float32)
            for j in range(t0 * SUBS, t1 * SUBS):
                offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
                n_ok = offs_n < length
                s = row_scores(q_rows, k_base, offs_n, n_ok, g_ok, s_k_n, D, SPLIT)
                s = tl.where(n_ok[None, :], s * scale, float("-inf"))
                tl.store(u_base + offs_n[None, :], s, mask=g_ok[:, None])
                first = (j % SUBS) == 0
                m, l = fold_scores(tl.where(first, float("-inf"), m), tl.where(first, 0.0, l), s)
                done = (j % SUBS) == SUBS - 1
                tl.store(m_ptr + ml_base + j // SUBS, m, mask=g_ok & done)
                tl.store(l_ptr + ml_base + j // SUBS, l, mask=g_ok & done)
        if PDL:  # finish only after the feature-major launch: completions chain
            gdc_wait()


def check_bernoulli_prop_inputs(q, kt, v, lens, draws: int, norm_factor: float) -> None:
    """ValueError unless the shapes, dtypes and head dim are ones the kernels serve."""
    if q.dim() != 3 or kt.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, kt, v: expected [R, Hq, d], [B, Hkv, d, capacity] and [R, Hkv, N, d], got "
                         f"{tuple(q.shape)}, {tuple(kt.shape)}, {tuple(v.shape)}")
    r, hq, d = q.shape
    if kt.shape[2] != d or kt.shape[1] != v.shape[1] or hq % kt.shape[1] or r % kt.shape[0]:
        raise ValueError(f"kt: shape {tuple(kt.shape)} does not fit q {tuple(q.shape)} and v {tuple(v.shape)}")
    if kt.shape[3] < v.shape[2]:
        raise ValueError(f"kt: capacity {kt.shape[3]} is below the {v.shape[2]} keys of v")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: head dim {d} is not served by the feature-major kernels "
                         f"(they take {SUPPORTED_HEAD_DIMS})")
    if kt.dtype not in SUPPORTED_DTYPES or kt.stride(3) != 1:
        raise ValueError(f"kt: expected float16/bfloat16/float32 with contiguous key runs, got {kt.dtype}, "
                         f"strides {kt.stride()}")
    if lens.shape != (r,) or lens.dtype != torch.int32:
        raise ValueError(f"lens: expected int32 [{r}], got {lens.dtype} {tuple(lens.shape)}")
    check_draws(draws)
    if not 1.0 <= norm_factor < float("inf"):
        raise ValueError(f"norm_factor: expected a finite number >= 1, got {norm_factor!r}")


def _key_words(key: RandomKey, q: torch.Tensor, lens: torch.Tensor, rows_per_batch: int):
    """``(key_lo, key_hi, words or None)``: the call's words by value, or per-row words [R, 2] (int64)
    computed on the device where the key has device counters or per-row seeds."""
    if key.host() and key.row_seeds is None:
        lo, hi = key.words()
        return lo, hi, None
    words = row_words_triton(key, lens, rows_per_batch)  # one launch, where the torch form takes dozens
    if words is None:
        batch_row = torch.arange(q.shape[0], device=q.device) // rows_per_batch
        streams = RowStreams(key, batch_row, lens)
        words = streams.lo, streams.hi
    return 0, 0, torch.stack(words, 1).contiguous()


#: A (row, KV head) whose draws kept more than this fraction of the d features is scored from the cache
#: layout: on the H100 the feature-major read of a fraction ρ of K took as long as the row read of all of it
#: near ρ = 0.85 at 128k keys and ρ = 0.7 at 32k (docs/results/gpu-bench/2026-11-23-h100-bernoulli-feature-read.md)
ROW_LAYOUT_ABOVE = 0.8


#: The feature-major stats launch: (programs, pipeline stages, keys per sub-block, features per step). Of the H200
#: sweep (``docs/results/studies/bernoulli/e2e_layer.py``, 2026-11-28) 396 programs (3 an SM, one wave on 132
#: SMs), 3 stages and 32 features per step were fastest at both 128k batch 1 (stats + sampling 91.1 µs) and 32k
#: batch 8 (167.3 µs); 528 programs at 5 stages took 118.8 and 225.8. A launch takes at most this many programs:
#: one more than a wave of resident programs would double the pass's time.
STATS_LAUNCH = (396, 3, 256, 32)

#: The row-layout stats launch: (keys per sub-block, programs, warps, stages). 2 warps: the whole call at 128k
#: batch 1 160.1 → 153.1 µs, at 32k batch 8 341.1 → 328.4 against 4 (H200, cold L2, peaked operands;
#: benchmarks/breakdown/launch_sweep.py --in-call); 8 warps and fewer stages were slower
ROW_LAUNCH = (64, 264, 2, 3)


def row_layout_features(d: int, row_above: float = ROW_LAYOUT_ABOVE) -> int:
    """Units whose draws kept more than this many of the ``d`` features read the cache layout."""
    if not 0.0 <= row_above <= 1.0:
        raise ValueError(f"row_above: expected a fraction in [0, 1], got {row_above!r}")
    return int(row_above * d)


def bernoulli_prop_triton(q, kt, v, lens, scale: float, draws: int, budget: int, tile: int, key: RandomKey,
                          v_seed: int, *, norm_factor: float = 1.0, rounding: str = "largest-remainder",
                          rows_per_batch: int = 1, write_counts: bool = False, out: torch.Tensor | None = None,
                          block_n: int | None = None, stats_programs: int | None = None,
                          feature_block: int | None = None, stats_warps: int = 4,
                          stats_stages: int | None = None, r_max: int | None = None, k: torch.Tensor | None = None,
                          row_above: float = ROW_LAYOUT_ABOVE, append: tuple | None = None,
                          row_launch: tuple[int, int, int, int] | None = None):
    """Mean-group Bernoulli scores over ``kt`` and S²ANTA-prop over them (module docstring).

    q ``[R, Hq, d]``; kt ``[B, Hkv, d, ≥N]`` (``feature_major.FeatureMajorKeys``) with query row r on batch
    row ``r // rows_per_batch``; v ``[R, Hkv, N, d]``; lens ``[R]`` int32. ``key``: the score draws'
    key (the method's); ``v_seed``: the V stage's seed by value. ``k`` (optional, V's layout): the cache
    rows, read instead of ``kt`` by a (row, KV head) whose draws kept more than ``row_above`` of the
    features (:data:`ROW_LAYOUT_ABOVE`), in a launch of their own shaped like santa-prop's stats pass.
    ``append = (k_cache [B, Hkv, N, d], done [B, Hkv] int32)``: the
    draw launch first copies each batch row's keys ``[done, length)`` into ``kt`` (``FeatureMajorKeys.
    reserve`` made room; the separate ``update`` launch is then not needed).
    ``stats_programs``, ``stats_stages``, ``block_n``, ``feature_block`` (None: :data:`STATS_LAUNCH`'s),
    ``stats_warps`` (the feature-major stats launch: at most ``stats_programs`` programs, splitting each unit's
    tiles evenly) and ``row_launch`` (the row launch's keys per sub-block, programs, warps, stages; None:
    :data:`ROW_LAUNCH`) are launch
    parameters; they change no count. Returns ``(out [R, Hq, d], counts [R, Hq, N] int32 or None, tile budgets
    [R, Hq, T] int32, features read [R, Hkv] int32)``."""
    if triton is None:
        raise ValueError("bernoulli_prop_triton: triton is not installed")
    check_bernoulli_prop_inputs(q, kt, v, lens, draws, norm_factor)
    feature_block = feature_block or min(STATS_LAUNCH[3], q.shape[-1])
    if feature_block < 16 or feature_block & (feature_block - 1) or feature_block > q.shape[-1]:
        raise ValueError(f"feature_block: expected a power of two from 16 to the head dim {q.shape[-1]}, "
                         f"got {feature_block}")
    r, hq, d = q.shape
    hkv = kt.shape[1]
    g = hq // hkv
    if k is not None and (k.shape != v.shape[:3] + (d,) or k.stride(-1) != 1 or k.dtype != kt.dtype):
        raise ValueError(f"k: expected {kt.dtype} [{v.shape[0]}, {v.shape[1]}, {v.shape[2]}, {d}] with a contiguous "
                         f"last dim, got {k.dtype} {tuple(k.shape)}")
    row_feats = row_layout_features(d, row_above) if k is not None else d  # d: never (nf <= d)
    if append is not None:
        kc, done = append
        if kc.shape[:2] != kt.shape[:2] or kc.shape[-1] != d or kc.shape[2] > kt.shape[3] or kc.stride(-1) != 1:
            raise ValueError(f"append: cache {tuple(kc.shape)} does not fit kt {tuple(kt.shape)}")
        if done.shape != kt.shape[:2] or done.dtype != torch.int32:
            raise ValueError(f"append: done must be int32 {tuple(kt.shape[:2])}, got {done.dtype} {tuple(done.shape)}")
    else:  # placeholders: the draw kernel reads them only with APPEND
        kc, done = kt, lens
    t, pdl, buf = begin_call(q, v, v, tile, flash=False, rounding=rounding, write_counts=write_counts, out=out)
    q_est = workspace("bernoulli_qest", q, r * hq * d, torch.float32)
    idx = workspace("bernoulli_feat_idx", q, r * hkv * d, torch.int32)
    n_feat = torch.empty(r, hkv, device=q.device, dtype=torch.int32)  # returned: the stats read it later
    q_list = workspace("bernoulli_qest_listed", q, r * hq * d, torch.float32)
    key_lo, key_hi, words = _key_words(key, q, lens, rows_per_batch)
    launch(_mean_group_draw_kernel, (hkv, r), q, lens, words if words is not None else lens, q_est, q_list, idx,
           n_feat,
           kc, done, kt, key_lo, key_hi, draws, float(norm_factor), rows_per_batch, hkv, q.stride(0), q.stride(1),
           kc.stride(0), kc.stride(1), kc.stride(2), kt.stride(0), kt.stride(1), kt.stride(2),
           G=g, BLOCK_G=group_block(g), D=d, ROW_WORDS=words is not None, STREAM=STREAM_KEY,
           APPEND=append is not None, PDL=pdl, num_warps=4)
    programs, stages, block, _ = STATS_LAUNCH
    programs, stages, block = stats_programs or programs, stats_stages or stages, block_n or block
    per_program = cdiv(t, max(1, programs // (hkv * r)))  # at most `programs` (STATS_LAUNCH)
    split = split_dots(kt)
    launch(_feature_major_stats_kernel, (cdiv(t, per_program), hkv, r),
           q_list, kt, idx, n_feat, lens, buf.m, buf.l, buf.stash, scale, per_program, hq, hkv, rows_per_batch,
           row_feats, kt.shape[3], kt.stride(0), kt.stride(1), kt.stride(2), hq * t, t, hq * t * tile, t * tile,
           G=g, BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(block, tile), FB=feature_block, SPLIT=split,
           PDL=pdl, num_warps=stats_warps, num_stages=stages, **pdl_launch(pdl))
    if k is not None:
        row_block, row_programs, row_warps, row_stages = row_launch or ROW_LAUNCH
        per_row_program = max(1, round(t * hkv * r / row_programs))
        launch(_row_stats_kernel, (cdiv(t, per_row_program), hkv, r),
               q_est, k, n_feat, lens, buf.m, buf.l, buf.stash, scale, per_row_program, hq, hkv, row_feats,
               k.stride(0), k.stride(1), k.stride(2), hq * t, t, hq * t * tile, t * tile,
               G=g, BLOCK_G=group_block(g), D=d, TILE=tile, BLOCK_N=min(row_block, tile), SPLIT=split, PDL=pdl,
               num_warps=row_warps, num_stages=row_stages, **pdl_launch(pdl))
    prop_sampling_passes(v, lens, buf, budget, tile, v_seed, r, hq, t, rounding=rounding,
                         write_counts=write_counts, pdl=pdl, r_max=r_max)
    return buf.out, buf.counts, buf.budgets, n_feat


def bernoulli_prop_reference(q, k, v, lens, scale: float, draws: int, budget: int, tile: int, key: RandomKey,
                             v_seed: int, *, norm_factor: float = 1.0,
                             rounding: str = "largest-remainder", rows_per_batch: int = 1):
    """float64 twin of ``bernoulli_prop_triton`` on the row layout ``k [R, Hkv, N, d]``: returns the
    ``SantaSample`` of ``santa_prop_reference`` over the estimated scores, and ``read [R, Hkv, d]`` (the
    features the draws kept: the draw kernel's ``q_est`` and feature lists, in float64)."""
    r, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    streams = RowStreams(key, torch.arange(r, device=q.device) // rows_per_batch, lens.to(torch.int64))
    u = streams.uniform(STREAM_BERNOULLI, (hkv, draws, d))
    q_est, read = mean_group_query(q.view(r, hkv, hq // hkv, d), draws, norm_factor=norm_factor, uniforms=u,
                                   check_values=False)
    valid = torch.arange(n, device=q.device)[None, :] < lens[:, None].to(q.device)
    scores = estimated_scores(q_est.reshape(r, hq, d), k, scale, valid)
    t = n_tiles(n, tile)
    sample = santa_prop_reference(scores, v, budget, tile, rounding=rounding,
                                  budget_offset=budget_uniforms(v_seed, r, hq, lens, q.device),
                                  tile_offsets=tile_uniforms(v_seed, r, hq, t, lens, q.device))
    return sample, read


__all__ = ["ROW_LAYOUT_ABOVE", "STATS_LAUNCH", "bernoulli_prop_reference", "bernoulli_prop_triton",
           "check_bernoulli_prop_inputs", "row_layout_features"]
