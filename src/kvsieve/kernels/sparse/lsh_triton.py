"""MagicPIG's SimHash retrieval on the device (issues 15 and 16): codes kept as the cache grows, and the
whole selection — query codes, collisions, retrieval probabilities, the budget's uniform cap — in three
launches whose grids come from static shapes only (no host read, CUDA-graph safe).

``methods/magicpig`` (the reference) hashes every key with ``x @ proj`` in torch, compares
``[B, Hkv, G, N, L]`` codes, computes ``θ`` and ``p`` for every key and ranks the retrieved ones by two
argsorts for the cap. Here (:func:`select_triton`):

1. ``_prepare_kernel``, one program per (row, query head): the query's code per table, and (one program
   per KV head) the MIPS norm bound ``M`` from the keys new since the last call, with ``lo`` = the first
   key whose code is stale (0 where ``M`` grew: every transformed key changed).
2. ``_collide_kernel``, chunks of each (row, KV head)'s keys over about ``SPLIT_PROGRAMS`` programs:
   hashes the chunk's stale keys into the codes (``LshCodes``: one byte per table at ``bits <= 8``), reads
   the chunk's codes once for the group's query heads, and for each head lists the colliding keys of
   ``[sink_end, window_start)`` in a segment of its own (``hash24 << 22 | position``, the cap's draw packed
   with the key, in position order) with their retrieval probability ``p = 1 − (1 − (1 − θ/π)^K)^L``
   (float64, ``θ`` from the key's dot with the query; K rows read for retrieved keys only). The listing
   and the dots are two passes over the chunk, so each pass is a few long vector loads, not a chain of
   dependent small ones.
3. ``_cap_kernel``, one program per (row, query head): joins its segments (in position order), keeps
   every retrieved key or, past the cap, the ``cap`` smallest draws (bisection over the 24 bits, ties to
   the lowest position: ``sample_triton``'s cut) and writes the list, its count and weights
   ``1/p`` (``p`` scaled by ``cap/R`` when capped), then padding (position 0, weight 1).

:func:`select_reference` is the torch twin given the same codes and draws. Key codes are the signs of
float32 dot products summed in another order than torch's matmul: a key whose projection on a hyperplane
is within float32 rounding of 0 may get the other bit (random data makes it rare); ``θ`` is computed from
sqrt and division only (:func:`_acos_f64`), within a few float64 ulps of ``torch.arccos``.
"""

from __future__ import annotations

import math
import struct

import torch

from ...core.rng import GOLDEN, MASK32, hash_bits
from ..triton_utils import is_interpreted, launch, next_pow2, triton, workspace

#: programs of the collision launch in all (4 per H100 SM)
SPLIT_PROGRAMS = 528
CAND_BLOCK = 8192  # a head's retrieved keys kept in registers for the cap's bisection (≈ 6% of 128k keys)


def usable(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or is_interpreted(_collide_kernel))


def code_dtype(bits: int) -> torch.dtype:
    """The narrowest integer holding a ``bits``-bit code: the codes are the launch's only large read
    besides the retrieved K rows (``L`` bytes per key at ``bits <= 8``)."""
    for dtype, width in ((torch.uint8, 8), (torch.int16, 15), (torch.int32, 31)):
        if bits <= width:
            return dtype
    return torch.int64


class LshCodes:
    """Per-(request, layer) SimHash codes of the keys ``[B, Hkv, capacity, L]``, updated by the launches of
    :func:`select_triton` as the cache grows.

    ``proj [d', L·K]`` float32 are the hyperplanes (``d' = d + 1`` for ``mips``); ``center`` takes the
    mean of the first call's valid keys (as the reference: the prefill keys). A cache that changed its
    batch, heads, head dim or device is hashed from scratch. ``done [B, Hkv]`` counts the keys hashed
    per row (a device counter), ``lo`` the first stale key of the current call.
    """

    def __init__(self, proj: torch.Tensor, bits: int, tables: int, transform: str):
        self.proj, self.bits, self.tables, self.transform = proj.float().contiguous(), bits, tables, transform
        self.codes: torch.Tensor | None = None

    def _fresh(self, k: torch.Tensor, lengths: torch.Tensor) -> None:
        b, hkv, n, d = k.shape
        self.codes = torch.zeros(b, hkv, n + n // 8 + 16, self.tables, device=k.device, dtype=code_dtype(self.bits))
        self.done = torch.zeros(b, hkv, device=k.device, dtype=torch.int32)
        self.lo = torch.zeros(b, hkv, device=k.device, dtype=torch.int32)
        self.norm_max = torch.zeros(b, hkv, device=k.device, dtype=torch.float32)
        self.mean = torch.zeros(b, hkv, d, device=k.device, dtype=torch.float32)
        if self.transform == "center":
            valid = torch.arange(n, device=k.device)[None, :] < lengths.long()[:, None]
            kf = k.float() * valid[:, None, :, None]
            self.mean = kf.sum(2) / lengths.float().clamp(min=1)[:, None, None]
        self.shape = (b, hkv, d, k.device)

    def reserve(self, k: torch.Tensor, lengths: torch.Tensor) -> None:
        """Storage for ``k``'s keys (host decisions from static shapes only)."""
        b, hkv, n, d = k.shape
        if self.codes is None or self.shape != (b, hkv, d, k.device):
            self._fresh(k, lengths)
        if n > self.codes.shape[2]:
            grow = torch.zeros(b, hkv, n + n // 8 + 16 - self.codes.shape[2], self.tables, device=k.device,
                               dtype=self.codes.dtype)
            self.codes = torch.cat([self.codes, grow], 2)


if triton is not None:
    import triton.language as tl

    from ..triton_utils import dense_range
    from .sample_triton import _cut, _hash24

    @triton.jit
    def _acos_f64(x):
        """``arccos`` of float64 ``x`` in [-1, 1] from sqrt and division only (the interpreter has no
        libdevice): ``acos|x| = 2·atan(t)``, ``t = tan(acos|x| / 2) = sqrt((1 − |x|)/(1 + |x|)) <= 1``, the
        angle halved 4 times (``tan(φ/2) = t / (1 + sqrt(1 + t²))``) to ``t <= tan(π/64)``, then atan's
        series to ``t^17`` (the next term is below 1e-22)."""
        a = tl.abs(x)
        t = tl.sqrt((1.0 - a) / (1.0 + a))
        for _ in tl.static_range(4):
            t = t / (1.0 + tl.sqrt(1.0 + t * t))
        u = t * t
        s = u * (-1.0 / 17.0) + 1.0 / 15.0
        s = u * s - 1.0 / 13.0
        s = u * s + 1.0 / 11.0
        s = u * s - 1.0 / 9.0
        s = u * s + 1.0 / 7.0
        s = u * s - 1.0 / 5.0
        s = u * s + 1.0 / 3.0
        s = 1.0 - u * s
        theta = 32.0 * t * s
        return tl.where(x < 0, 3.141592653589793 - theta, theta)

    @triton.jit
    def _retrieval_p(cos, bits, tables):
        """``1 − (1 − (1 − θ/π)^K)^L`` in float64 for float32 ``cos`` (the reference's formula; integer
        powers as products)."""
        theta = _acos_f64(tl.minimum(tl.maximum(cos.to(tl.float64), -1.0), 1.0))
        base = 1.0 - theta / 3.141592653589793
        pt = tl.full(cos.shape, 1.0, tl.float64)
        for _ in range(bits):
            pt = pt * base
        miss = 1.0 - pt
        pm = tl.full(cos.shape, 1.0, tl.float64)
        for _ in range(tables):
            pm = pm * miss
        return 1.0 - pm

    @triton.jit
    def _prepare_kernel(q_ptr, proj_ptr, qc_ptr, k_ptr, len_ptr, done_ptr, lo_ptr, m_ptr, hq, hkv, s_q_b, s_q_h,
                        s_k_b, s_k_h, s_k_n, bits, tables, d, MIPS: tl.constexpr, G: tl.constexpr,
                        DQ: tl.constexpr, DC: tl.constexpr, KP: tl.constexpr, LP: tl.constexpr,
                        BLOCK: tl.constexpr):
        """Program (h, b): the query's code per table into ``qc [B, Hq, LP]`` (``-2`` past ``tables``); the
        first program of each KV head updates ``M`` (MIPS) from the keys new since the last call, and
        writes ``lo`` (the first key to hash again: 0 where ``M`` grew) and ``done`` (the row's length)."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        tl_idx = tl.arange(0, LP)
        cols = tl.arange(0, KP)
        dc = tl.arange(0, DC)
        width = tables * bits
        qbase = q_ptr + b.to(tl.int64) * s_q_b + h * s_q_h
        # the projections of all tables at once, D in slices of DC: [LP, KP] sums (MIPS: the query's
        # extra coordinate is 0, so the planes' last row is never read)
        s = tl.zeros([LP, KP], tl.float32)
        pm = (tl_idx < tables)[:, None] & (cols < bits)[None, :]
        inv = 1.0
        if MIPS:
            qd = tl.arange(0, DQ)
            qf = tl.load(qbase + qd, mask=qd < d, other=0.0).to(tl.float32)
            inv = 1.0 / tl.maximum(tl.sqrt(tl.sum(qf * qf, 0)), 1e-30)
        for d0 in range(0, d, DC):
            dd = d0 + dc
            qv = tl.load(qbase + dd, mask=dd < d, other=0.0).to(tl.float32) * inv
            p = tl.load(proj_ptr + dd[:, None, None] * width + (tl_idx * bits)[None, :, None] + cols[None, None, :],
                        mask=(dd < d)[:, None, None] & pm[None, :, :], other=0.0)
            s += tl.sum(qv[:, None, None] * p, 0)
        code = tl.sum(((s > 0) & pm).to(tl.int64) << cols.to(tl.int64)[None, :], 1)
        tl.store(qc_ptr + (b * hq + h).to(tl.int64) * LP + tl_idx, tl.where(tl_idx < tables, code, -2))
        if h % G == 0:
            kvh = h // G
            at = b * hkv + kvh
            length = tl.load(len_ptr + b).to(tl.int32)
            start = tl.minimum(tl.load(done_ptr + at), length)
            lo = start
            if MIPS:
                m_old = tl.load(m_ptr + at)
                offs = tl.arange(0, BLOCK)
                kd = tl.arange(0, DQ)
                kbase = k_ptr + b.to(tl.int64) * s_k_b + kvh * s_k_h
                m = m_old
                for j0 in range(start, length, BLOCK):
                    pos = j0 + offs
                    ok = pos < length
                    kr = tl.load(kbase + pos.to(tl.int64)[:, None] * s_k_n + kd[None, :],
                                 mask=ok[:, None] & (kd < d)[None, :], other=0.0).to(tl.float32)
                    nrm = tl.sqrt(tl.sum(kr * kr, 1))
                    m = tl.maximum(m, tl.max(tl.where(ok, nrm, 0.0), 0))
                tl.store(m_ptr + at, m)
                lo = tl.where(m > m_old, 0, start)
            tl.store(lo_ptr + at, lo)
            tl.store(done_ptr + at, length)

    @triton.jit
    def _hash_keys(kbase, cbase, j0, j1, m, mean_ptr, proj_ptr, s_k_n, s_c_n, bits, tables, d,
                   MIPS: tl.constexpr, BLOCK: tl.constexpr, DQ: tl.constexpr, KP: tl.constexpr):
        """Codes of the keys ``[j0, j1)`` (``mean_ptr``: the KV head's mean, ``center`` only). MIPS's extra
        coordinate (row ``d`` of the planes) is added apart, so the tiles stay ``d`` wide (a ``d + 1``
        column tile would double to 256 and its dot's shared memory with it)."""
        offs_d = tl.arange(0, DQ)
        dm = offs_d < d
        cols = tl.arange(0, KP)
        col_ok = cols < bits
        width = tables * bits
        if not MIPS:
            mu = tl.load(mean_ptr + offs_d, mask=dm, other=0.0)
        for b0 in range(j0, j1, BLOCK):
            pos = b0 + tl.arange(0, BLOCK)
            ok = pos < j1
            kr = tl.load(kbase + pos.to(tl.int64)[:, None] * s_k_n + offs_d[None, :], mask=ok[:, None] & dm[None, :],
                         other=0.0).to(tl.float32)
            if MIPS:
                kr = kr / m
                extra = tl.sqrt(tl.maximum(1.0 - tl.sum(kr * kr, 1), 0.0))
            else:
                kr = tl.where(dm[None, :], kr - mu[None, :], 0.0)
            out = cbase + pos.to(tl.int64) * s_c_n
            for t in range(tables):
                p = tl.load(proj_ptr + offs_d[:, None] * width + t * bits + cols[None, :],
                            mask=dm[:, None] & col_ok[None, :], other=0.0)
                sc = tl.dot(kr, p, input_precision="ieee")
                if MIPS:
                    pe = tl.load(proj_ptr + d * width + t * bits + cols, mask=col_ok, other=0.0)
                    sc += extra[:, None] * pe[None, :]
                code = tl.sum(((sc > 0) & col_ok[None, :]).to(tl.int64) << cols.to(tl.int64)[None, :], 1)
                tl.store(out + t, code.to(cbase.dtype.element_ty), mask=ok)

    @triton.jit
    def _collide_kernel(q_ptr, k_ptr, proj_ptr, codes_ptr, qc_ptr, len_ptr, lo_ptr, m_ptr, mean_ptr, wlo_ptr,
                        whi_ptr, cand_ptr, p_ptr, cnt_ptr,
                        hq, hkv, sink, window, chunk, seg_stride, stream_key, bits, tables, d,
                        s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_c_b, s_c_h, s_c_n,
                        G: tl.constexpr, GP: tl.constexpr, MIPS: tl.constexpr, DQ: tl.constexpr,
                        KP: tl.constexpr, LP: tl.constexpr, HBLOCK: tl.constexpr, CBLOCK: tl.constexpr,
                        KBLOCK: tl.constexpr):
        """Keys ``[s·chunk, (s+1)·chunk)`` of (row b, KV head): hash the stale ones, then for each of the
        group's query heads list the colliding keys of ``[sink_end, window_start)`` (packed with their
        draw) in the head's segment ``s`` and their retrieval probabilities beside them, and the count."""
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        n_seg = tl.num_programs(0)
        at = b * hkv + kvh
        length, sink_end, win_start = dense_range(len_ptr, b, sink, window)
        c_lo = s * chunk
        c_hi = tl.minimum(length, c_lo + chunk)
        kbase = k_ptr + b.to(tl.int64) * s_k_b + kvh * s_k_h
        cbase = codes_ptr + b.to(tl.int64) * s_c_b + kvh * s_c_h
        m = tl.maximum(tl.load(m_ptr + at), 1e-30)
        # 1. stale codes (new keys; every key of a row whose M grew)
        lo = tl.maximum(tl.load(lo_ptr + at), c_lo)
        if lo < c_hi:
            _hash_keys(kbase, cbase, lo, c_hi, m, mean_ptr + at * d, proj_ptr, s_k_n, s_c_n, bits, tables, d, MIPS,
                       HBLOCK, DQ, KP)
            tl.debug_barrier()  # the codes were written by other threads of this program
        # 2. collisions: the chunk's codes read once for the G query heads
        gi = tl.arange(0, GP)
        heads = kvh * G + gi
        rows = b.to(tl.int64) * hq + heads  # [GP] flat (row, query head)
        tl_idx = tl.arange(0, LP)
        qcm = tl.load(qc_ptr + rows[:, None] * LP + tl_idx[None, :], mask=(gi < G)[:, None], other=-2)
        wlo = tl.load(wlo_ptr + b)
        whi = tl.load(whi_ptr + b)
        counts = tl.zeros([GP], tl.int32)
        r_lo = tl.maximum(c_lo, sink_end)
        r_hi = tl.minimum(c_hi, win_start)
        offs = tl.arange(0, CBLOCK)
        for j0 in range(r_lo, r_hi, CBLOCK):
            pos = j0 + offs
            ok = pos < r_hi
            cm = tl.load(cbase + pos.to(tl.int64)[:, None] * s_c_n + tl_idx[None, :],
                         mask=ok[:, None] & (tl_idx < tables)[None, :], other=0).to(tl.int64)
            for g in tl.static_range(G):
                qcg = tl.sum(tl.where((gi == g)[:, None], qcm, 0), 0)  # padding -2 never equals a code
                hit = (tl.max((cm == qcg[None, :]).to(tl.int32), 1) > 0) & ok
                hv = _hash24(wlo, whi, stream_key, ((kvh * G + g).to(tl.int64) << 22) + pos)
                before = tl.sum(tl.where(gi == g, counts, 0), 0)
                dest = before + tl.cumsum(hit.to(tl.int32), 0) - 1
                seg = (b.to(tl.int64) * hq + kvh * G + g) * seg_stride + c_lo
                tl.store(cand_ptr + seg + dest, (hv << 22) | pos.to(tl.int64), mask=hit)
                counts = tl.where(gi == g, before + tl.sum(hit.to(tl.int32), 0), counts)
        tl.store(cnt_ptr + rows * n_seg + s, counts, mask=gi < G)
        tl.debug_barrier()  # the lists were written by other threads of this program
        # 3. the listed keys' probabilities: their K rows only
        kd = tl.arange(0, DQ)
        dm = kd < d
        if not MIPS:
            mu = tl.load(mean_ptr + at * d + kd, mask=dm, other=0.0)
        ko = tl.arange(0, KBLOCK)
        for g in tl.static_range(G):
            h = kvh * G + g
            q = tl.load(q_ptr + b.to(tl.int64) * s_q_b + h * s_q_h + kd, mask=dm, other=0.0).to(tl.float32)
            qn = tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-30)
            if not MIPS:
                q_mu = tl.sum(q * mu, 0)
            seg = (b.to(tl.int64) * hq + h) * seg_stride + c_lo
            cnt = tl.sum(tl.where(gi == g, counts, 0), 0)
            for e0 in range(0, cnt, KBLOCK):
                e = e0 + ko
                ok = e < cnt
                pos = tl.load(cand_ptr + seg + e, mask=ok, other=0) & 0x3FFFFF
                kr = tl.load(kbase + pos[:, None] * s_k_n + kd[None, :], mask=ok[:, None] & dm[None, :],
                             other=0.0).to(tl.float32)
                dot = tl.sum(kr * q[None, :], 1)
                if MIPS:
                    cos = dot / (qn * m)
                else:
                    kc = tl.where(dm[None, :], kr - mu[None, :], 0.0)
                    cos = (dot - q_mu) / (qn * tl.maximum(tl.sqrt(tl.sum(kc * kc, 1)), 1e-30))
                tl.store(p_ptr + seg + e, _retrieval_p(cos, bits, tables), mask=ok)

    @triton.jit
    def _cap_kernel(cand_ptr, p_ptr, cnt_ptr, len_ptr, work_ptr, wp_ptr, idx_ptr, w_ptr, kept_ptr, ret_ptr,
                    hq, n_seg, chunk, seg_stride, width, budget, frac_bits, s_o_b, s_o_h,
                    CAP: tl.constexpr, SG: tl.constexpr, SB: tl.constexpr, BLOCK: tl.constexpr,
                    CBLOCK: tl.constexpr):
        """Program (h, b): the head's segments joined (position order), cut to the cap, written out."""
        PAD: tl.constexpr = 1 << 46
        h = tl.program_id(0)
        b = tl.program_id(1)
        rh = b.to(tl.int64) * hq + h
        seg0 = rh * seg_stride
        work = work_ptr + seg0
        wp = wp_ptr + seg0
        # 1. join: SG segments at a time, each copied SB entries per step
        r = tl.zeros([], tl.int32)
        sg = tl.arange(0, SG)
        sb = tl.arange(0, SB)
        for s0 in range(0, n_seg, SG):
            si = s0 + sg
            cs = tl.load(cnt_ptr + rh * n_seg + si, mask=si < n_seg, other=0)
            dst = r + tl.cumsum(cs, 0) - cs
            for c0 in range(0, tl.max(cs, 0), SB):
                col = c0 + sb
                mk = col[None, :] < cs[:, None]
                src = seg0 + si.to(tl.int64)[:, None] * chunk + col[None, :]
                tl.store(work + dst[:, None] + col[None, :], tl.load(cand_ptr + src, mask=mk), mask=mk)
                tl.store(wp + dst[:, None] + col[None, :], tl.load(p_ptr + src, mask=mk), mask=mk)
            r += tl.sum(cs, 0)
        tl.debug_barrier()  # the joined list was written by other threads of this program
        # 2. the cap (resolve_size: a count, or floor(n_valid · fraction) and at least 1)
        length = tl.load(len_ptr + b).to(tl.int64)
        if CAP == 2:
            frac = tl.full([], frac_bits, tl.int64).to(tl.float64, bitcast=True)
            cap = tl.maximum((length.to(tl.float64) * frac).to(tl.int64), 1)
        elif CAP == 1:
            cap = tl.zeros([], tl.int64) + budget
        else:
            cap = r.to(tl.int64)
        kept = tl.minimum(cap, r.to(tl.int64)).to(tl.int32)
        t_lo, need = _cut(work, r, kept, tl.full([], 16777216, tl.int64), BLOCK, CBLOCK)
        scale = tl.where(r > cap, cap.to(tl.float64) / tl.maximum(r, 1).to(tl.float64), 1.0)
        # 3. the kept keys in position order, weights 1/p (p scaled by cap/R where capped), then padding
        out = idx_ptr + b.to(tl.int64) * s_o_b + h * s_o_h
        w = w_ptr + b.to(tl.int64) * s_o_b + h * s_o_h
        offs = tl.arange(0, BLOCK)
        written = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for c0 in range(0, r, BLOCK):
            co = c0 + offs
            packed = tl.load(work + co, mask=co < r, other=PAD)
            kk = packed >> 22
            eq = (kk == t_lo) & (co < r)
            tie_rank = ties + tl.cumsum(eq.to(tl.int32), 0)
            take = (co < r) & ((kk < t_lo) | (eq & (tie_rank <= need)))
            dest = written + tl.cumsum(take.to(tl.int32), 0) - 1
            p = tl.load(wp + co, mask=take, other=1.0) * scale
            tl.store(out + dest, packed & 0x3FFFFF, mask=take)
            tl.store(w + dest, 1.0 / tl.maximum(p, 1e-300), mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)
        for z0 in range(kept, width, BLOCK):
            zo = z0 + offs
            zm = zo < width
            tl.store(out + zo, tl.zeros([BLOCK], tl.int64), mask=zm)
            tl.store(w + zo, tl.full([BLOCK], 1.0, tl.float64), mask=zm)
        tl.store(kept_ptr + rh, kept.to(tl.int64))
        tl.store(ret_ptr + rh, r)


def _chunk(n: int, splits: int, block: int) -> int:
    """``ceil(n / splits)`` rounded up to a multiple of ``block``."""
    per = -(-n // splits)
    return -(-per // block) * block


def _budget_args(budget: int | float) -> tuple[int, int, int]:
    """``(mode, count, fraction's float64 bits)``: mode 0 no cap, 1 a count, 2 a fraction of the row."""
    if isinstance(budget, float):
        return 2, 0, struct.unpack("<q", struct.pack("<d", budget))[0]
    return (1 if budget else 0), int(budget), 0


def select_triton(q: torch.Tensor, k: torch.Tensor, codes: LshCodes, lengths: torch.Tensor, lo: torch.Tensor,
                  hi: torch.Tensor, stream: int, sink: int, window: int, budget: int | float, width: int,
                  target_programs: int = SPLIT_PROGRAMS
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MagicPIG's selection of one decode step in three launches (module docstring): ``(indices [B, Hq,
    width] int64, kept [B, Hq] int64, weights [B, Hq, width] float64, retrieved [B, Hq] int32)``.

    ``q [B, Hq, d]``, ``k [B, Hkv, N, d]`` (last dim contiguous), ``lengths [B]`` int32, ``lo, hi [B]`` the
    rows' random words (``core.rng.RowStreams``) and ``stream`` the cap's stream; ``budget`` as
    ``resolve_size`` takes it (0: no cap) and ``width`` at least the cap's bound (N without a cap).
    Updates ``codes`` for the keys new since its last call. No host read."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if hq % hkv or k.shape[0] != b or k.shape[-1] != d or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"select_triton: q {tuple(q.shape)} and k {tuple(k.shape)}: expected [B, Hq, d] and "
                         "[B, Hkv, N, d] with Hkv dividing Hq and contiguous last dims")
    if n >= 1 << 22:
        raise ValueError(f"select_triton: {n} keys (the draws' counters hold positions below 2^22)")
    dev = q.device
    idx = torch.empty(b, hq, width, device=dev, dtype=torch.int64)
    weights = torch.empty(b, hq, width, device=dev, dtype=torch.float64)
    kept = torch.empty(b, hq, device=dev, dtype=torch.int64)
    retrieved = torch.empty(b, hq, device=dev, dtype=torch.int32)
    codes.reserve(k, lengths)
    g = hq // hkv
    mips = codes.transform == "mips"
    lengths = lengths.to(torch.int32)
    lp = max(2, next_pow2(codes.tables))
    kp = max(16, next_pow2(codes.bits))
    dq = next_pow2(d)
    qc = workspace("lsh_query_codes", q, b * hq * lp, torch.int64)
    launch(_prepare_kernel, (hq, b), q, codes.proj, qc, k, lengths, codes.done, codes.lo, codes.norm_max, hq, hkv,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), codes.bits, codes.tables, d,
           MIPS=mips, G=g, DQ=dq, DC=max(1, 8192 // (lp * kp)), KP=kp, LP=lp, BLOCK=64, num_warps=4)
    cblock = 256
    splits = max(1, min(-(-target_programs // (b * hkv)), -(-n // cblock)))
    chunk = _chunk(max(n, 1), splits, cblock)
    n_seg = -(-max(n, 1) // chunk)
    seg_stride = n_seg * chunk
    cand = workspace("lsh_candidates", q, b * hq * seg_stride, torch.int64)
    prob = workspace("lsh_probabilities", q, b * hq * seg_stride, torch.float64)
    seg_counts = workspace("lsh_segment_counts", q, b * hq * n_seg, torch.int32)
    c = codes.codes
    launch(_collide_kernel, (n_seg, hkv, b), q, k, codes.proj, c, qc, lengths, codes.lo, codes.norm_max,
           codes.mean, lo.contiguous(), hi.contiguous(), cand, prob, seg_counts,
           hq, hkv, sink, window, chunk, seg_stride, (stream * GOLDEN) & MASK32, codes.bits, codes.tables, d,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), c.stride(0),
           c.stride(1), c.stride(2),
           G=g, GP=max(2, next_pow2(g)), MIPS=mips, DQ=dq, KP=kp, LP=lp, HBLOCK=32,
           CBLOCK=cblock, KBLOCK=64, num_warps=4, num_stages=1)
    mode, count, frac_bits = _budget_args(budget)
    work = workspace("lsh_joined", q, b * hq * seg_stride, torch.int64)
    work_p = workspace("lsh_joined_p", q, b * hq * seg_stride, torch.float64)
    sg = min(16, next_pow2(n_seg))
    launch(_cap_kernel, (hq, b), cand, prob, seg_counts, lengths, work, work_p, idx, weights, kept, retrieved,
           hq, n_seg, chunk, seg_stride, width, count, frac_bits, idx.stride(0), idx.stride(1),
           CAP=mode, SG=sg, SB=max(16, 2048 // sg), BLOCK=1024,
           CBLOCK=256 if is_interpreted(_cap_kernel) else CAND_BLOCK, num_warps=8, num_stages=1)
    return idx, kept, weights, retrieved


def retrieval_probability(cos: torch.Tensor, bits: int, tables: int) -> torch.Tensor:
    """``1 − (1 − (1 − θ/π)^K)^L`` for ``θ = arccos(cos)``, float64 (the reference's formula)."""
    theta = torch.arccos(torch.clamp(cos.double(), -1.0, 1.0))
    return 1 - (1 - (1 - theta / math.pi) ** bits) ** tables


def select_reference(q: torch.Tensor, k: torch.Tensor, key_codes: torch.Tensor, query_codes: torch.Tensor,
                     transform: str, norm_max: torch.Tensor, mean: torch.Tensor, lengths: torch.Tensor,
                     lo: torch.Tensor, hi: torch.Tensor, stream: int, sink: int, window: int,
                     budget: int | float, width: int, bits: int, tables: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch twin of :func:`select_triton` given the same codes ``key_codes [B, Hkv, ≥N, L]``,
    ``query_codes [B, Hq, L]``, ``norm_max [B, Hkv]`` (mips) or ``mean [B, Hkv, d]`` (center): the keys of
    ``[sink_end, window_start)`` colliding in a table, past the cap the ``cap`` smallest draws (ties to the
    lowest position), in position order, weights ``1/p``, padding (0, 1); the same outputs."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    pos = torch.arange(n, device=q.device)
    lens = lengths.long()
    sink_end = torch.clamp(lens, max=sink)
    win_start = torch.maximum(lens - window, sink_end)
    rng = (pos >= sink_end[:, None]) & (pos < win_start[:, None])  # [B, N]
    kc = key_codes[:, :, :n].long()
    hit = (kc[:, :, None] == query_codes.long().view(b, hkv, g, 1, tables)).any(-1).view(b, hq, n) & rng[:, None]
    r = hit.sum(-1)
    if isinstance(budget, float):
        cap = torch.clamp(torch.floor(lens.double() * budget).long(), min=1)[:, None].expand(b, hq)
    else:
        cap = torch.full((b, hq), int(budget), device=q.device) if budget else r
    c = (torch.arange(hq, device=q.device)[:, None] << 22) + pos[None, :]
    draw = hash_bits(lo.view(b, 1, 1), hi.view(b, 1, 1), stream, c[None]) >> 8
    key = torch.where(hit, (draw << 22) + pos, torch.iinfo(torch.int64).max)  # unique: ties to the lowest position
    rank = torch.argsort(torch.argsort(key, dim=-1), dim=-1)
    kept_mask = hit & (rank < cap[..., None])
    kept = kept_mask.sum(-1)
    qf = q.float()
    kf = k.float().repeat_interleave(g, 1)
    dots = (kf @ qf[..., None])[..., 0]
    qn = qf.norm(dim=-1).clamp(min=1e-30)[..., None]
    if transform == "mips":
        cos = dots / (qn * norm_max.repeat_interleave(g, 1)[..., None].clamp(min=1e-30))
    else:
        mu = mean.repeat_interleave(g, 1)
        kn = (kf - mu[:, :, None]).norm(dim=-1).clamp(min=1e-30)
        cos = (dots - (qf * mu).sum(-1, keepdim=True)) / (qn * kn)
    p = retrieval_probability(cos, bits, tables)
    p = p * torch.where(r > cap, cap.double() / r.clamp(min=1).double(), 1.0)[..., None]
    w = 1.0 / p.clamp(min=1e-300)
    slot = torch.where(kept_mask, torch.cumsum(kept_mask, -1) - 1, width)
    idx = torch.zeros(b, hq, width + 1, dtype=torch.int64, device=q.device).scatter_(-1, slot, pos.expand(b, hq, n))
    wt = torch.ones(b, hq, width + 1, dtype=torch.float64, device=q.device).scatter_(-1, slot, w)
    return idx[..., :width], kept, wt[..., :width], r.to(torch.int32)


__all__ = ["CAND_BLOCK", "SPLIT_PROGRAMS", "LshCodes", "code_dtype", "retrieval_probability", "select_reference",
           "select_triton", "usable"]
