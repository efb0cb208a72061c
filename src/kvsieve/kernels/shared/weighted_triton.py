"""Weighted sparse decode in Triton: the kernel of ``kernels/shared/weighted.py``'s contract, with pages
and a fused sink + window part.

Contract (a superset of ``weighted_sparse_decode``; :func:`sparse_decode_reference` is its torch
reference and the tests compare the two)
---------------------------------------------------------------------------------------------------
- ``q [B, Hq, d]``; ``k [B, Hkv, N, d]``; ``v [B, Hkv, N, d]`` (the transformers cache layout,
  last dim contiguous); float16, bfloat16 or float32; ``d`` in 64, 128, 256; fp32 accumulation.
- ``indices [B, Hs, M]`` (int32 or int64), ``counts [B, Hs]``, ``weights [B, Hs, M]`` or None, as in
  the contract, with ``Hs = Hkv`` (one list per KV head: its K/V rows are loaded once and scored for
  the ``G`` query heads of the group) or ``Hs = Hq``. ``counts`` may be 0 here.
- ``page_size = P``: an entry ``i`` stands for the keys ``[i·P, i·P + P)`` (a page read as one
  contiguous tile), all with the entry's weight; ``P = 1`` is the token-granular contract. ``P`` is a
  power of two ≤ 128.
- ``lengths [B]`` (int32, optional, default ``N``): keys at or past a row's length are never read, so
  the last, partial page of a ragged row is clipped.
- ``sink, window`` (ints, default 0): the dense part. Row ``b`` attends to ``[0, sink_end)`` and
  ``[window_start, len_b)`` at weight 1, with ``sink_end = min(sink, sink_b, len_b)`` (``sink_lengths [B]``,
  optional: a per-row sink under the host bound ``sink``, which sizes the launch) and
  ``window_start = max(len_b − window, sink_end)``, read as ranges (no index list); listed keys outside
  ``[sink_end, window_start)`` are skipped, so a key is never counted by both parts. Without a dense
  part (sink = window = 0) that interval is the whole row ``[0, len_b)``.
- Output ``out [B, Hq, d]`` (q's dtype) ``= Σ w e^s v / Σ w e^s`` over the dense keys and the listed
  keys (an entry listed twice counts twice: Hansen–Hurwitz), ``lse [B, Hq]`` float32
  ``= log Σ w e^s`` (natural log of scaled logits). A head with no key at all gets ``out = 0`` and
  ``lse = −inf``.

Execution
---------
One launch scores and accumulates split-K partials, a second merges them and writes the LSE. The
split launch's grid is ``(parts, Hs, B)`` from static shapes only: ``parts`` = the list's splits
(``M`` entries cut into chunks of whole blocks) + the dense part's splits (``sink + window`` keys cut
the same way). A program reads its row's count and length from device memory, so no host sync is
needed and the launch can be captured in a CUDA graph; every program writes its partial (empty ones
write ``l = 0``), so the merge never reads stale workspace. Host-side value checks (``check=True``)
synchronise and are meant for tests and debugging.
"""

from __future__ import annotations

import math

import torch

from .triton_utils import cdiv, is_interpreted, launch, merge_partials, merge_pdl, next_pow2, triton, workspace
from .triton_utils import unsupported_reason as _triton_unsupported_reason

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_PAGE_SIZE = 128
_LOG2E = math.log2(math.e)

if triton is not None:
    import triton.language as tl

    from .triton_utils import attend_dense_split, attend_tile, dense_range, gdc_launch_dependents, store_partials

    # Sizes that may equal 1 stay runtime values (Triton would make a 1 a constexpr and recompile).
    @triton.jit(do_not_specialize=["n_keys", "sink", "window", "n_sel_parts", "sel_chunk", "range_chunk", "n_parts",
                                   "rows_per_batch"])
    def _sparse_split_kernel(
        q_ptr, k_ptr, v_ptr, idx_ptr, cnt_ptr, w_ptr, lens_ptr, sink_lens_ptr,
        acc_ptr, m_ptr, l_ptr, sem_ptr, out_ptr, lse_ptr,
        scale_log2, n_keys, sink, window, rows_per_batch,
        s_q_b, s_q_h,
        s_k_b, s_k_h, s_k_n,
        s_v_b, s_v_h, s_v_n,
        s_i_b, s_i_h,
        s_c_b, s_c_h,
        s_w_b, s_w_h,
        n_sel_parts, sel_chunk, range_chunk, n_parts,
        s_out_b, s_out_h,
        HEADS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        HAS_LENS: tl.constexpr, HAS_W: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
        FUSED_MERGE: tl.constexpr, HAS_SINK_LENS: tl.constexpr = False, PDL: tl.constexpr = False,
    ):
        if PDL:  # the merge may launch now: its programs wait (gdc_wait) until this launch is done
            gdc_launch_dependents()
        part = tl.program_id(0)
        hs = tl.program_id(1)
        b = tl.program_id(2)
        b64 = b.to(tl.int64)
        length, sink_end, win_start = dense_range(lens_ptr, b, sink, window, n_keys, HAS_LENS)
        if HAS_SINK_LENS:
            sink_end = tl.minimum(tl.load(sink_lens_ptr + b).to(tl.int32), sink_end)
            win_start = tl.maximum(length - window, sink_end)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = hs * HEADS + offs_g
        g_ok = offs_g < HEADS
        kvh = (hs * HEADS) // G
        q = tl.load(q_ptr + b64 * s_q_b + heads[:, None] * s_q_h + offs_d[None, :], mask=g_ok[:, None], other=0.0)
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong; its tests upcast the tiles instead
            q = q.to(tl.float32)
        kv_b = b64 // rows_per_batch  # the cache row of query row b (Q query rows per cache row)
        k_base = k_ptr + kv_b * s_k_b + kvh * s_k_h
        v_base = v_ptr + kv_b * s_v_b + kvh * s_v_h

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)

        if part < n_sel_parts:
            # Listed entries [lo, hi): BLOCK_N // PAGE entries (whole pages) per block.
            count = tl.load(cnt_ptr + b64 * s_c_b + hs * s_c_h).to(tl.int32)
            lo = part * sel_chunk
            hi = tl.minimum(lo + sel_chunk, count)
            idx_base = idx_ptr + b64 * s_i_b + hs * s_i_h
            w_base = w_ptr + b64 * s_w_b + hs * s_w_h
            for e0 in range(lo, hi, BLOCK_N // PAGE):
                entry = e0 + offs_n // PAGE
                e_ok = entry < hi
                page = tl.load(idx_base + entry, mask=e_ok, other=0).to(tl.int32)
                pos = page * PAGE + offs_n % PAGE
                ok = e_ok & (pos >= sink_end) & (pos < win_start)
                log2_w = 0.0
                if HAS_W:
                    log2_w = tl.log2(tl.load(w_base + entry, mask=ok, other=1.0).to(tl.float32))
                m_i, l_i, acc = attend_tile(q, k_base, v_base, pos, ok, log2_w, m_i, l_i, acc, s_k_n, s_v_n,
                                             offs_d, scale_log2, HAS_W, DOT_PRECISION, DOT_F32)
        else:
            m_i, l_i, acc = attend_dense_split(q, k_base, v_base, part - n_sel_parts, range_chunk, sink_end, win_start,
                                               length, m_i, l_i, acc, s_k_n, s_v_n, offs_n, offs_d, scale_log2,
                                               BLOCK_N, DOT_PRECISION, DOT_F32)

        # every program writes its partials, empty or not
        store_partials(m_ptr, l_ptr, acc_ptr, b64 * (HEADS * tl.num_programs(1)) + heads, g_ok, n_parts, part, m_i,
                       l_i, acc, offs_d, D)
        if FUSED_MERGE:
            # The last program of (b, hs) to finish merges the row's partials (a ticket counter that it
            # resets): one launch per call instead of two. All threads' stores precede the release.
            tl.debug_barrier()
            ticket = tl.atomic_add(sem_ptr + b * tl.num_programs(1) + hs, 1, sem="acq_rel", scope="gpu")
            if ticket == n_parts - 1:
                _merge_rows(acc_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, b64 * (HEADS * tl.num_programs(1)) + heads,
                            g_ok, n_parts, b64 * s_out_b + heads * s_out_h, D)
                tl.atomic_xchg(sem_ptr + b * tl.num_programs(1) + hs, 0)

    @triton.jit
    def _merge_rows(acc_ptr, m_ptr, l_ptr, out_ptr, lse_ptr, rows, row_ok, n_parts, out_offs, D: tl.constexpr):
        # rows: [BLOCK_G] indices b·Hq + h of the query heads to merge (partials at rows·parts + p)
        m_star = tl.full(rows.shape, float("-inf"), tl.float32)
        for p in range(0, n_parts):
            mp = tl.load(m_ptr + rows * n_parts + p, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
            lp = tl.load(l_ptr + rows * n_parts + p, mask=row_ok, other=0.0, cache_modifier=".cg")
            m_star = tl.maximum(m_star, tl.where(lp > 0, mp, float("-inf")))
        m_ref = tl.where(m_star == float("-inf"), 0.0, m_star)
        offs_d = tl.arange(0, D)
        o = tl.zeros([rows.shape[0], D], tl.float32)
        z = tl.zeros(rows.shape, tl.float32)
        for p in range(0, n_parts):
            mp = tl.load(m_ptr + rows * n_parts + p, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
            lp = tl.load(l_ptr + rows * n_parts + p, mask=row_ok, other=0.0, cache_modifier=".cg")
            live = row_ok & (lp > 0)
            wp = tl.where(live, tl.exp(mp - m_ref), 0.0)
            z += wp * lp
            a = tl.load(acc_ptr + (rows * n_parts + p)[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0,
                        cache_modifier=".cg")
            o += wp[:, None] * a
        safe = tl.where(z > 0, z, 1.0)
        o = tl.where((z > 0)[:, None], o / safe[:, None], 0.0)
        tl.store(out_ptr + out_offs[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + rows, tl.where(z > 0, m_ref + tl.log(safe), float("-inf")), mask=row_ok)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, page_size: int = 1) -> str | None:
    """Why :func:`sparse_decode_triton` cannot serve these tensors (None when it can)."""
    if 1 <= page_size <= MAX_PAGE_SIZE and not page_size & (page_size - 1):
        return _triton_unsupported_reason(q, k, v, head_dims=SUPPORTED_HEAD_DIMS, kernels="the sparse kernels")
    return f"page_size {page_size} (the sparse kernel takes a power of two ≤ {MAX_PAGE_SIZE})"


def check_sparse_inputs(q, k, v, indices, counts, weights, *, page_size: int, lengths, sink: int, window: int,
                        values: bool, rows_per_batch: int = 1, sink_lengths=None) -> None:
    """ValueError naming the argument when a call breaks the contract. Shapes, dtypes and devices are
    always checked (no sync); ``values=True`` also checks the data (indices in range, counts, weights,
    lengths), which synchronises."""
    if q.dim() != 3:
        raise ValueError(f"q: expected shape [B, Hq, d], got {tuple(q.shape)}")
    if k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"k, v: expected shape [B, Hkv, N, d], got {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, d = q.shape
    _, hkv, n, _ = k.shape
    if not isinstance(rows_per_batch, int) or rows_per_batch < 1 or k.shape[0] * rows_per_batch != b:
        raise ValueError(f"rows_per_batch: q's {b} rows must be {rows_per_batch} query rows per cache row of k "
                         f"(k has {k.shape[0]})")
    if k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v: expected [B, Hkv, N, d={d}] with matching v, got {tuple(k.shape)}, "
                         f"{tuple(v.shape)} (k given as [B, N, Hkv, d] must be transposed)")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q: {hq} query heads is not a multiple of k's {hkv} KV heads (k must be [B, Hkv, N, d]; "
                         "a cache laid out [B, N, Hkv, d] must be transposed)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dim (stride 1), got stride {t.stride(-1)}")
    if not isinstance(sink, int) or not isinstance(window, int) or sink < 0 or window < 0:
        raise ValueError(f"sink, window: expected ints >= 0, got {sink!r}, {window!r}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
    if sink_lengths is not None and (sink_lengths.shape != (b,) or sink_lengths.is_floating_point()
                                     or sink_lengths.dtype == torch.bool or sink_lengths.device != q.device):
        raise ValueError(f"sink_lengths: expected an integer tensor of shape [{b}] on {q.device}, got "
                         f"{sink_lengths.dtype} {tuple(sink_lengths.shape)} on {sink_lengths.device}")
    if lengths is not None:
        if lengths.shape != (b,) or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise ValueError(f"lengths: expected an integer tensor of shape [{b}], got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
        if lengths.device != q.device:
            raise ValueError(f"lengths: expected device {q.device}, got {lengths.device}")
    if indices is None:
        if counts is not None or weights is not None:
            raise ValueError("counts, weights: given without indices")
        if sink == 0 and window == 0:
            raise ValueError("indices: expected an index list, or a dense part (sink or window > 0)")
        if values and lengths is not None:
            _check_lengths(lengths, n)
        return
    if indices.dim() != 3 or indices.shape[0] != b or indices.shape[1] not in (hkv, hq):
        raise ValueError(f"indices: expected shape [B={b}, Hkv={hkv} or Hq={hq}, M], got {tuple(indices.shape)}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"indices: expected an int64 or int32 tensor, got {indices.dtype}")
    if indices.shape[2] < 1:
        raise ValueError("indices: expected at least one column (M >= 1)")
    if indices.stride(-1) != 1:
        raise ValueError("indices: expected a contiguous last dim")
    if counts is None or counts.shape != indices.shape[:2]:
        raise ValueError(f"counts: expected shape {tuple(indices.shape[:2])}, got "
                         f"{None if counts is None else tuple(counts.shape)}")
    if counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(f"counts: expected an integer tensor, got {counts.dtype}")
    if weights is not None:
        if weights.shape != indices.shape or not weights.is_floating_point():
            raise ValueError(f"weights: expected a float tensor of shape {tuple(indices.shape)}, got "
                             f"{weights.dtype} {tuple(weights.shape)}")
        if weights.stride(-1) != 1:
            raise ValueError("weights: expected a contiguous last dim")
    for name, t in (("indices", indices), ("counts", counts), ("weights", weights)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device}, got {t.device}")
    if not values:
        return
    m = indices.shape[2]
    lo, hi = int(counts.min()), int(counts.max())
    if lo < 0 or hi > m:
        raise ValueError(f"counts: expected values in [0, M={m}], got min {lo}, max {hi}")
    if lengths is not None:
        _check_lengths(lengths, n)
    used = torch.arange(m, device=indices.device) < counts[..., None]
    n_units = cdiv(n, page_size)
    if bool(used.any()):
        u = indices[used]
        if int(u.min()) < 0 or int(u.max()) >= n_units:
            unit = "pages" if page_size > 1 else "keys"
            raise ValueError(f"indices: used entries must lie in [0, {n_units}) ({unit} of N={n}), got min "
                             f"{int(u.min())}, max {int(u.max())}")
        if weights is not None:
            w = weights[used]
            if not bool(torch.isfinite(w).all()) or not bool((w > 0).all()):
                raise ValueError("weights: used entries must be positive and finite (inverse inclusion probabilities)")


def _check_lengths(lengths: torch.Tensor, n: int) -> None:
    lo, hi = int(lengths.min()), int(lengths.max())
    if lo < 1 or hi > n:
        raise ValueError(f"lengths: expected values in [1, N={n}], got min {lo}, max {hi}")


def sparse_decode_reference(q, k, v, indices=None, counts=None, weights=None, *, page_size: int = 1,
                            lengths=None, sink: int = 0, window: int = 0, scale: float | None = None,
                            check: bool = True, rows_per_batch: int = 1,
                            sink_lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, d], lse [B, Hq])`` of the contract in the module docstring, in torch.

    Every key the kernel would read is listed explicitly (dense part, then each entry's page), so
    the work is O((sink + window + M·P) · d) per head; arithmetic in float32 (float64 for float64).
    """
    from .weighted import gather_rows

    check_sparse_inputs(q, k, v, indices, counts, weights, page_size=page_size, lengths=lengths, sink=sink,
                        window=window, values=check, rows_per_batch=rows_per_batch, sink_lengths=sink_lengths)
    if rows_per_batch > 1:  # one cache row per query row
        k, v = k.repeat_interleave(rows_per_batch, dim=0), v.repeat_interleave(rows_per_batch, dim=0)
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    group = hq // hkv
    dev = q.device
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = d ** -0.5 if scale is None else scale
    hs = hkv if indices is None else indices.shape[1]
    length = torch.full((b,), n, device=dev, dtype=torch.long) if lengths is None else lengths.long()
    sink_end = torch.clamp(length, max=sink)
    if sink_lengths is not None:
        sink_end = torch.minimum(sink_end, sink_lengths.long())
    win_start = torch.maximum(length - window, sink_end)
    # dense part: t < sink_end -> t; else win_start + (t - sink_end); used while t < its total
    t = torch.arange(min(sink + window, n), device=dev)
    dense_pos = torch.where(t < sink_end[:, None], t, win_start[:, None] + t - sink_end[:, None])
    dense_ok = t < (sink_end + length - win_start)[:, None]  # [B, S]
    pos = [dense_pos[:, None, :].expand(b, hs, -1)]
    ok = [dense_ok[:, None, :].expand(b, hs, -1)]
    logw = [torch.zeros(b, hs, t.numel(), dtype=dtype, device=dev)]
    if indices is not None:
        m = indices.shape[2]
        offs = torch.arange(page_size, device=dev)
        p = (indices.long()[..., None] * page_size + offs).reshape(b, hs, m * page_size)
        used = (torch.arange(m, device=dev) < counts[..., None]).repeat_interleave(page_size, dim=-1)
        pos.append(p)
        ok.append(used & (p >= sink_end[:, None, None]) & (p < win_start[:, None, None]))
        w = torch.ones(b, hs, m, dtype=dtype, device=dev) if weights is None else weights.to(dtype)
        logw.append(torch.log(torch.where(used, w.repeat_interleave(page_size, dim=-1), torch.ones((), dtype=dtype,
                                                                                                   device=dev))))
    pos, ok, logw = torch.cat(pos, -1), torch.cat(ok, -1), torch.cat(logw, -1)
    pos = torch.where(ok, pos, torch.zeros_like(pos))  # unused slots read key 0 and are masked below
    head_of = None if hs == hkv else torch.arange(hq, device=dev) // group
    kr = gather_rows(k, pos, head_of).to(dtype)
    vr = gather_rows(v, pos, head_of).to(dtype)
    if hs == hkv:
        logits = torch.matmul(q.to(dtype).view(b, hkv, group, d), kr.transpose(-1, -2)) * scale  # [B, Hs, G, L]
    else:
        logits = torch.einsum("bhd,bhld->bhl", q.to(dtype), kr)[:, :, None, :] * scale
    logits = (logits + logw[:, :, None, :]).masked_fill(~ok[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    p_att = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.matmul(p_att, vr)
    return out.reshape(b, hq, d), lse.reshape(b, hq).float()


# About four programs per SM of an H100/H200 (132 SMs): the best of a sweep over block_n, warps, stages and
# programs at 128k; at 32k fixed costs dominate (H200: docs/results/gpu-bench/2026-11-27-h200-sparse-launch-tune.md).
TARGET_PROGRAMS = 528


def launch_config(d: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) by head dim: K and V tiles of 64 × d (32 × 256 for d = 256) keep
    two stages in shared memory. For d = 128 the H200 sweep (TARGET_PROGRAMS) found no block, warp or
    stage setting faster than these by more than its noise."""
    return (32, 4, 2) if d > 128 else (64, 4, 2)


def split_plan(batch: int, heads: int, entries: int, page_size: int, dense_keys: int, block_n: int,
               target_programs: int = TARGET_PROGRAMS) -> tuple[int, int, int, int]:
    """``(n_sel_parts, sel_chunk entries, n_dense_parts, dense_chunk keys)`` for about
    ``target_programs`` programs, each a whole number of ``block_n``-key blocks."""
    keys = entries * page_size + dense_keys
    want = max(1, cdiv(target_programs, batch * heads))
    chunk = cdiv(keys, want)
    chunk = max(block_n, cdiv(chunk, block_n) * block_n)
    sel_chunk = chunk // page_size
    n_sel = cdiv(entries, sel_chunk) if entries else 0
    n_dense = cdiv(dense_keys, chunk) if dense_keys else 0
    return n_sel, sel_chunk, n_dense, chunk


def sparse_decode_triton(q, k, v, indices=None, counts=None, weights=None, *, page_size: int = 1,
                         lengths=None, sink: int = 0, window: int = 0, scale: float | None = None,
                         check: bool = False, out: torch.Tensor | None = None,
                         lse: torch.Tensor | None = None, block_n: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None,
                         target_programs: int = TARGET_PROGRAMS, fused_merge: bool = False,
                         rows_per_batch: int = 1, sink_lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of the contract (module docstring): ``(out [B, Hq, d] in q's dtype, lse [B, Hq]
    float32)``. ``lengths``: int32 preferred (other integer types are converted, one small copy).
    ``check=True`` adds the value checks (host sync). Workspaces are cached per device and reused.
    ``fused_merge=True``: the last program of each list row merges it (one launch; it relies on a per-row
    ticket counter, so calls on one device must not overlap in time). Measured slower than the two launches at
    batch 1 (H200, 128k: 56 against 30 µs on 64-key pages, 44 against 20 on Quest's; equal at 32k batch 8;
    ``benchmarks/sparse_decode/tune_gather.py``): every program's acquire-release atomic on its row's counter.
    ``rows_per_batch = Q``: q holds ``B·Q`` query rows (row ``r = b·Q + j``) against a cache ``k, v`` of
    ``B`` rows — the multi-row form (a question chunk's rows, each with its own length and lists) without
    a copy of the cache per row. ``sink_lengths [B]``: each row's sink, at most ``sink`` (int32 preferred)."""
    check_sparse_inputs(q, k, v, indices, counts, weights, page_size=page_size, lengths=lengths, sink=sink,
                        window=window, values=check, rows_per_batch=rows_per_batch, sink_lengths=sink_lengths)
    reason = unsupported_reason(q, k, v, page_size)
    if reason is not None:
        raise ValueError(f"sparse_decode_triton cannot serve this call: {reason}")
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    default_block, default_warps, default_stages = launch_config(d)
    block_n = max(block_n or default_block, page_size)
    num_warps = num_warps or default_warps
    num_stages = num_stages or (1 if block_n * d > 16384 else default_stages)  # big pages of d = 256
    hs = hkv if indices is None else indices.shape[1]
    heads_per_list = g if hs == hkv else 1
    m = 0 if indices is None else indices.shape[2]
    dense_keys = min(sink + window, n)
    n_sel, sel_chunk, n_dense, dense_chunk = split_plan(b, hs, m, page_size, dense_keys, block_n, target_programs)
    parts = n_sel + n_dense
    acc = workspace("sparse_acc", q, b * hq * parts * d, torch.float32)
    pm = workspace("sparse_m", q, b * hq * parts, torch.float32)
    pl = workspace("sparse_l", q, b * hq * parts, torch.float32)
    if out is None:
        out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    if lse is None:
        lse = torch.empty(b, hq, device=q.device, dtype=torch.float32)
    if out.shape != (b, hq, d) or out.stride(-1) != 1 or lse.shape != (b, hq) or not lse.is_contiguous():
        raise ValueError(f"out, lse: expected [B, Hq, d] with a contiguous last dim and a contiguous [B, Hq], got "
                         f"{tuple(out.shape)}, {tuple(lse.shape)}")
    sem = workspace("sparse_ticket", q, b * hs, torch.int32, zeroed=True) if fused_merge else pl
    if indices is None:  # a dummy pointer: never read, since no part is a list part
        indices = counts = pl
    if lengths is not None and lengths.dtype != torch.int32:
        lengths = lengths.to(torch.int32)
    if sink_lengths is not None and sink_lengths.dtype != torch.int32:
        sink_lengths = sink_lengths.to(torch.int32)
    wt = weights if weights is not None else indices
    scale = d ** -0.5 if scale is None else scale
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    dot_f32 = q.dtype == torch.bfloat16 and is_interpreted(_sparse_split_kernel)
    pdl = not fused_merge and merge_pdl()
    launch(_sparse_split_kernel, (parts, hs, b),
           q, k, v, indices, counts, wt, lengths if lengths is not None else pl,
           sink_lengths if sink_lengths is not None else pl, acc, pm, pl, sem, out, lse,
           scale * _LOG2E, n, sink, window, rows_per_batch,
           q.stride(0), q.stride(1),
           k.stride(0), k.stride(1), k.stride(2),
           v.stride(0), v.stride(1), v.stride(2),
           indices.stride(0), indices.stride(1) if indices.dim() > 1 else 0,
           counts.stride(0), counts.stride(1) if counts.dim() > 1 else 0,
           wt.stride(0), wt.stride(1) if wt.dim() > 1 else 0,
           n_sel, sel_chunk, dense_chunk, parts,
           out.stride(0), out.stride(1),
           HEADS=heads_per_list, G=g, BLOCK_G=max(16, next_pow2(heads_per_list)), D=d, BLOCK_N=block_n,
           PAGE=page_size, HAS_LENS=lengths is not None, HAS_W=weights is not None, DOT_PRECISION=precision,
           DOT_F32=dot_f32, FUSED_MERGE=fused_merge, HAS_SINK_LENS=sink_lengths is not None, PDL=pdl,
           num_warps=num_warps, num_stages=num_stages)
    if fused_merge:
        return out, lse
    merge_partials(acc, pm, pl, None, out, b, hq, parts, d, 1, (hq * parts * d, parts * d, d), (hq * parts, parts),
                   lse=lse, d_chunk=32, num_warps=1, num_stages=2, pdl=pdl)
    return out, lse


__all__ = ["sparse_decode_reference", "sparse_decode_triton", "split_plan", "unsupported_reason",
           "check_sparse_inputs", "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES"]
