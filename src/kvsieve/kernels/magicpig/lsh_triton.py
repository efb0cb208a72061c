"""MagicPIG's SimHash retrieval on the device: key codes kept as the cache grows, the
collision test in one launch, the retrieved keys' cosines in one launch.

``methods/magicpig`` (the reference) hashes every key with ``x @ proj`` in torch — on a GPU every call,
since noticing that the MIPS norm bound ``M`` grew needs a host read — then compares ``[B, Hkv, G, N, L]``
codes, computes ``θ`` and ``p`` for every key and ranks the retrieved ones by two argsorts for the cap.
Here:

- :class:`LshCodes` keeps the codes ``[B, Hkv, capacity, L]`` in the method's state with a device
  counter of the keys hashed per row (as Quest's ``PageSummaries``): one launch updates ``M`` (MIPS) from
  the new keys and says per row whether it grew; a second hashes only the blocks of new keys — every
  block of a row whose ``M`` grew (all its codes change). No host read.
- :func:`retrieve_triton`: one program per (row, query head) hashes the query, then chunks of
  ``[sink_end, window_start)`` over ~528 programs (each reading a KV head's codes once for its query
  heads) mark the keys colliding in at least ``min_tables`` tables; they write the complement
  (what :func:`~kvsieve.kernels.shared.sample_triton.sample_rows_triton` takes as excluded keys) and add
  up the retrieved counts (integer atomics).
- :func:`key_dots_triton`: ``q·k`` (and, for the ``center`` transform, ``‖k − μ‖``) of the kept keys only,
  for their cosines, the list cut over ~528 programs.

Codes are the signs of float32 dot products summed in another order than torch's matmul: a key whose
projection on a hyperplane is within float32 rounding of 0 may get the other bit (then the paths
retrieve different keys; random data makes it rare).
"""

from __future__ import annotations

import math

import torch

from ..shared.triton_utils import is_interpreted, launch, next_pow2, triton

#: programs of the retrieval and key-dot launches in all (4 per H100 SM)
SPLIT_PROGRAMS = 528


def usable(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or is_interpreted(_codes_kernel))


class LshCodes:
    """Per-(request, layer) SimHash codes of the keys, updated as the cache grows (one or two launches).

    ``proj [d', L·K]`` float32 are the hyperplanes (``d' = d + 1`` for ``mips``); ``center`` takes the
    mean of the first call's middle keys (:func:`middle_mean` with ``sink`` and ``window``, as the
    reference: the prefill keys). A cache that changed its batch, heads, head dim or device is hashed
    from scratch.
    """

    def __init__(self, proj: torch.Tensor, bits: int, tables: int, transform: str, sink: int = 0, window: int = 0):
        self.proj, self.bits, self.tables, self.transform = proj.float().contiguous(), bits, tables, transform
        self.sink, self.window = sink, window
        self.codes: torch.Tensor | None = None

    def _fresh(self, k: torch.Tensor, lengths: torch.Tensor) -> None:
        b, hkv, n, d = k.shape
        cap = n + n // 8 + 16
        dtype = torch.int32 if self.bits <= 30 else torch.int64
        self.codes = torch.zeros(b, hkv, cap, self.tables, device=k.device, dtype=dtype)
        self.done = torch.zeros(b, hkv, device=k.device, dtype=torch.int32)
        self.lo = torch.zeros(b, hkv, device=k.device, dtype=torch.int32)
        self.norm_max = torch.zeros(b, hkv, device=k.device, dtype=torch.float32)
        self.mean = torch.zeros(b, hkv, d, device=k.device, dtype=torch.float32)
        if self.transform == "center":
            pos = torch.arange(n, device=k.device)[None, :]
            valid = pos < lengths.long()[:, None]
            self.mean = middle_mean(k.float(), valid, pos, lengths.long(), self.sink, self.window)
        self.shape = (b, hkv, d, k.device)

    def update(self, k: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The codes ``[B, Hkv, capacity, L]`` (first ``length`` keys of each row current)."""
        b, hkv, n, d = k.shape
        if self.codes is None or self.shape != (b, hkv, d, k.device):
            self._fresh(k, lengths)
        if n > self.codes.shape[2]:
            grow = torch.zeros(b, hkv, n + n // 8 + 16 - self.codes.shape[2], self.tables, device=k.device,
                               dtype=self.codes.dtype)
            self.codes = torch.cat([self.codes, grow], 2)
        lengths = lengths.to(torch.int32)
        mips = self.transform == "mips"
        launch(_norms_kernel, (hkv, b), k, lengths, self.done, self.lo, self.norm_max,
               k.stride(0), k.stride(1), k.stride(2), MIPS=mips, BLOCK=64, D=next_pow2(d), num_warps=4)
        block = 32
        kp = max(16, next_pow2(self.bits))
        launch(_codes_kernel, (triton.cdiv(n, block), hkv, b), k, lengths, self.lo, self.norm_max, self.mean,
               self.proj, self.codes, hkv, k.stride(0), k.stride(1), k.stride(2), self.codes.stride(0),
               self.codes.stride(1), self.codes.stride(2), self.bits, self.tables, d, self.proj.shape[0],
               MIPS=mips, BLOCK=block, D=next_pow2(d + mips), KP=kp, num_warps=4, num_stages=1)
        return self.codes


if triton is not None:
    import triton.language as tl

    from ..shared.triton_utils import dense_range

    @triton.jit
    def _norms_kernel(k_ptr, len_ptr, done_ptr, lo_ptr, m_ptr, s_k_b, s_k_h, s_k_n, MIPS: tl.constexpr,
                      BLOCK: tl.constexpr, D: tl.constexpr):
        """Per (row, KV head): the largest norm of the keys new since the last update; ``lo`` = the first
        key to hash again (0 where ``M`` grew), ``done`` = the row's length."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        at = b * tl.num_programs(0) + h
        length = tl.load(len_ptr + b)
        start = tl.minimum(tl.load(done_ptr + at), length)
        m_old = tl.load(m_ptr + at)
        lo = start
        if MIPS:
            offs = tl.arange(0, BLOCK)
            offs_d = tl.arange(0, D)
            base = k_ptr + b.to(tl.int64) * s_k_b + h * s_k_h
            m = m_old
            for j0 in range(start, length, BLOCK):
                pos = j0 + offs
                ok = pos < length
                kr = tl.load(base + pos.to(tl.int64)[:, None] * s_k_n + offs_d[None, :], mask=ok[:, None],
                             other=0.0).to(tl.float32)
                nrm = tl.sqrt(tl.sum(kr * kr, 1))
                m = tl.maximum(m, tl.max(tl.where(ok, nrm, 0.0), 0))
            tl.store(m_ptr + at, m)
            lo = tl.where(m > m_old, 0, start)
        tl.store(lo_ptr + at, lo)
        tl.store(done_ptr + at, length)

    @triton.jit
    def _codes_kernel(k_ptr, len_ptr, lo_ptr, m_ptr, mean_ptr, proj_ptr, codes_ptr, hkv, s_k_b, s_k_h, s_k_n,
                      s_c_b, s_c_h, s_c_n, bits, tables, d, dp, MIPS: tl.constexpr, BLOCK: tl.constexpr,
                      D: tl.constexpr, KP: tl.constexpr):
        """Codes of one block of keys, where it holds a key at or after the row's ``lo``."""
        blk = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        at = b * hkv + h
        length = tl.load(len_ptr + b)
        lo = tl.load(lo_ptr + at)
        j0 = blk * BLOCK
        if (j0 + BLOCK > lo) & (j0 < length):
            offs = j0 + tl.arange(0, BLOCK)
            offs_d = tl.arange(0, D)
            ok = offs < length
            kr = tl.load(k_ptr + b.to(tl.int64) * s_k_b + h * s_k_h + offs.to(tl.int64)[:, None] * s_k_n
                         + offs_d[None, :], mask=ok[:, None] & (offs_d < d)[None, :], other=0.0).to(tl.float32)
            if MIPS:
                m = tl.maximum(tl.load(m_ptr + at), 1e-30)
                kr = kr / m
                extra = tl.sqrt(tl.maximum(1.0 - tl.sum(kr * kr, 1), 0.0))
                kr = tl.where((offs_d == d)[None, :], extra[:, None], kr)
            else:
                mu = tl.load(mean_ptr + at * d + offs_d, mask=offs_d < d, other=0.0)
                kr = tl.where((offs_d < d)[None, :], kr - mu[None, :], 0.0)
            cols = tl.arange(0, KP)
            col_ok = cols < bits
            out = codes_ptr + b.to(tl.int64) * s_c_b + h * s_c_h + offs.to(tl.int64) * s_c_n
            width = tables * bits
            for t in range(tables):
                # MIPS: the extra coordinate is column d of the keys and row d of the planes
                p = tl.load(proj_ptr + offs_d[:, None] * width + t * bits + cols[None, :],
                            mask=(offs_d < dp)[:, None] & col_ok[None, :], other=0.0)
                s = tl.dot(kr, p, input_precision="ieee")
                bit = ((s > 0) & col_ok[None, :]).to(tl.int64) << cols.to(tl.int64)[None, :]
                code = tl.sum(bit, 1)
                tl.store(out + t, code.to(codes_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _query_codes_kernel(q_ptr, proj_ptr, qc_ptr, count_ptr, hq, s_q_b, s_q_h, bits, tables, d,
                            MIPS: tl.constexpr, D: tl.constexpr, KP: tl.constexpr, LP: tl.constexpr):
        """The query's code per table (``-2`` past ``tables``) into ``qc [B, Hq, LP]``; the count zeroed."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + b.to(tl.int64) * s_q_b + h * s_q_h + offs_d, mask=offs_d < d, other=0.0).to(tl.float32)
        if MIPS:
            q = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-30)  # the extra coordinate is 0
        cols = tl.arange(0, KP)
        col_ok = cols < bits
        tl_idx = tl.arange(0, LP)
        qc = tl.full([LP], -2, tl.int64)
        width = tables * bits
        for t in range(tables):
            p = tl.load(proj_ptr + offs_d[:, None] * width + t * bits + cols[None, :],
                        mask=(offs_d < d)[:, None] & col_ok[None, :], other=0.0)
            s = tl.sum(q[:, None] * p, 0)
            code = tl.sum(((s > 0) & col_ok).to(tl.int64) << cols.to(tl.int64), 0)
            qc = tl.where(tl_idx == t, code, qc)
        tl.store(qc_ptr + (b * hq + h).to(tl.int64) * LP + tl_idx, qc)
        tl.store(count_ptr + b * hq + h, 0)

    @triton.jit
    def _retrieve_kernel(qc_ptr, codes_ptr, len_ptr, excl_ptr, count_ptr, hq, sink, window, chunk,
                         s_c_b, s_c_h, s_c_n, s_x_b, s_x_h, tables, min_tables,
                         G: tl.constexpr, BLOCK: tl.constexpr, LP: tl.constexpr):
        """One chunk ``[s·chunk, (s+1)·chunk) ∩ [sink_end, window_start)`` of (row, KV head): each block
        of key codes is read once for the group's ``G`` query heads; a key is retrieved where it collides
        in at least ``min_tables`` tables; the marks are written and the counts added atomically
        (integers: the order does not matter)."""
        s = tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        length, lo, hi = dense_range(len_ptr, b, sink, window)
        c_lo = tl.maximum(lo, s * chunk)
        c_hi = tl.minimum(hi, s * chunk + chunk)
        tl_idx = tl.arange(0, LP)
        cbase = codes_ptr + b.to(tl.int64) * s_c_b + kvh * s_c_h
        offs = tl.arange(0, BLOCK)
        for g in tl.static_range(G):
            h = kvh * G + g
            qc = tl.load(qc_ptr + (b * hq + h).to(tl.int64) * LP + tl_idx)
            xbase = excl_ptr + b.to(tl.int64) * s_x_b + h * s_x_h
            count = tl.zeros([], tl.int32)
            for j0 in range(c_lo, c_hi, BLOCK):
                pos = j0 + offs
                ok = pos < c_hi
                c = tl.load(cbase + pos.to(tl.int64)[:, None] * s_c_n + tl_idx[None, :],
                            mask=ok[:, None] & (tl_idx < tables)[None, :], other=-1).to(tl.int64)
                hit = tl.sum((c == qc[None, :]).to(tl.int32), 1) >= min_tables
                tl.store(xbase + pos, (~hit).to(tl.int8), mask=ok)
                count += tl.sum((hit & ok).to(tl.int32), 0)
            if c_hi > c_lo:
                tl.atomic_add(count_ptr + b * hq + h, count)

    @triton.jit
    def _key_dots_kernel(q_ptr, k_ptr, mean_ptr, idx_ptr, cnt_ptr, dot_ptr, knorm_ptr, group, hs_div, hkv, chunk,
                         s_q_b, s_q_h, s_k_b, s_k_h, s_k_n, s_i_b, s_i_h, s_c_b, s_c_h, s_o_b, s_o_h, d,
                         CENTER: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr):
        # entries [s·chunk, (s+1)·chunk) of the list of (row, query head)
        s = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        kvh = h // group
        sh = h // hs_div
        offs_d = tl.arange(0, D)
        dm = offs_d < d
        q = tl.load(q_ptr + b.to(tl.int64) * s_q_b + h * s_q_h + offs_d, mask=dm, other=0.0).to(tl.float32)
        cnt = tl.load(cnt_ptr + b.to(tl.int64) * s_c_b + sh * s_c_h)
        lst = idx_ptr + b.to(tl.int64) * s_i_b + sh * s_i_h
        kbase = k_ptr + b.to(tl.int64) * s_k_b + kvh * s_k_h
        obase = b.to(tl.int64) * s_o_b + h * s_o_h
        if CENTER:
            mu = tl.load(mean_ptr + (b * hkv + kvh) * d + offs_d, mask=dm, other=0.0)
        offs = tl.arange(0, BLOCK)
        for j0 in range(s * chunk, tl.minimum(cnt, s * chunk + chunk), BLOCK):
            j = j0 + offs
            ok = j < cnt
            pos = tl.load(lst + j, mask=ok, other=0)
            kr = tl.load(kbase + pos.to(tl.int64)[:, None] * s_k_n + offs_d[None, :], mask=ok[:, None] & dm[None, :],
                         other=0.0).to(tl.float32)
            tl.store(dot_ptr + obase + j, tl.sum(kr * q[None, :], 1), mask=ok)
            if CENTER:
                kc = tl.where(dm[None, :], kr - mu[None, :], 0.0)
                tl.store(knorm_ptr + obase + j, tl.sqrt(tl.sum(kc * kc, 1)), mask=ok)


def _chunk(n: int, splits: int, block: int) -> int:
    """``ceil(n / splits)`` rounded up to a multiple of ``block``."""
    per = -(-n // splits)
    return -(-per // block) * block


def retrieve_triton(q: torch.Tensor, codes: LshCodes, lengths: torch.Tensor, sink: int, window: int,
                    n_keys: int, min_tables: int, target_programs: int = SPLIT_PROGRAMS
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(excluded [B, Hq, N] bool, retrieved [B, Hq] int32)``: in ``[sink_end, window_start)`` of each
    row, the keys whose code equals the query's in fewer than ``min_tables`` tables (entries outside that
    range are not written), and how many are retrieved. Two launches: the query codes (one program per
    query head), then the collisions in ``splits x Hkv x B`` programs (about ``target_programs``), each
    reading a chunk of a KV head's codes once for its query heads."""
    b, hq, d = q.shape
    hkv = codes.codes.shape[1]
    excl = torch.empty(b, hq, n_keys, device=q.device, dtype=torch.bool)
    count = torch.empty(b, hq, device=q.device, dtype=torch.int32)
    c = codes.codes
    lp = max(2, next_pow2(codes.tables))
    qc = torch.empty(b, hq, lp, device=q.device, dtype=torch.int64)
    launch(_query_codes_kernel, (hq, b), q, codes.proj, qc, count, hq, q.stride(0), q.stride(1), codes.bits,
           codes.tables, d, MIPS=codes.transform == "mips", D=next_pow2(d), KP=max(16, next_pow2(codes.bits)),
           LP=lp, num_warps=4, num_stages=1)
    block = 64
    splits = max(1, min(-(-target_programs // (b * hkv)), -(-n_keys // (2 * block))))
    chunk = _chunk(n_keys, splits, block)
    launch(_retrieve_kernel, (-(-n_keys // chunk), hkv, b), qc, c, lengths.to(torch.int32), excl.view(torch.int8),
           count, hq, sink, window, chunk, c.stride(0), c.stride(1), c.stride(2), excl.stride(0), excl.stride(1),
           codes.tables, min_tables, G=hq // hkv, BLOCK=block, LP=lp, num_warps=4, num_stages=1)
    return excl, count


def key_dots_triton(q: torch.Tensor, k: torch.Tensor, codes: LshCodes, idx: torch.Tensor,
                    counts: torch.Tensor, target_programs: int = SPLIT_PROGRAMS
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q·k`` (float32, unscaled) of the first ``counts`` keys of ``idx [B, Hs, M]`` for every query head
    (``[B, Hq, M]``), and for ``center`` their ``‖k − μ‖``; the list cut into chunks over about
    ``target_programs`` programs (each entry's value does not depend on the cut)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    hs, m = idx.shape[1], idx.shape[2]
    dots = torch.empty(b, hq, m, device=q.device, dtype=torch.float32)
    center = codes.transform == "center"
    knorm = torch.empty_like(dots) if center else dots
    if m:
        block = 32
        splits = max(1, min(-(-target_programs // (b * hq)), -(-m // block)))
        chunk = _chunk(m, splits, block)
        launch(_key_dots_kernel, (-(-m // chunk), hq, b), q, k, codes.mean, idx, counts, dots, knorm, hq // hkv,
               hq // hs, hkv, chunk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), idx.stride(0),
               idx.stride(1),
               counts.stride(0), counts.stride(1), dots.stride(0), dots.stride(1), d, CENTER=center, BLOCK=block,
               D=next_pow2(d), num_warps=4, num_stages=1)
    return dots, (knorm if center else None)


def middle_mean(k: torch.Tensor, valid: torch.Tensor, rank: torch.Tensor, n_valid: torch.Tensor, sink: int,
                window: int) -> torch.Tensor:
    """``[B, Hkv, d]`` float32 mean of the keys ``k [B, Hkv, N, d]`` whose rank among the valid keys
    (``valid``, ``rank [B, N]``) lies in ``[sink, n_valid − window)``: neither sink nor window, the keys
    MagicPIG's code centres by; a row without such keys takes the mean of its valid keys. Summed in
    float64 (one KV head at a time, to bound the copy) so that padding, which moves the keys within the
    reduction, does not change the float32 result. Torch ops, no host read."""
    middle = valid & (rank >= sink) & (rank < (n_valid.long() - window)[:, None])
    use = torch.where(middle.any(-1, keepdim=True), middle, valid)
    total = torch.stack([(k[:, h].double() * use[..., None]).sum(1) for h in range(k.shape[1])], 1)
    return (total / use.sum(-1).clamp(min=1).double()[:, None, None]).float()


def retrieval_probability(cos: torch.Tensor, bits: int, tables: int, min_tables: int) -> torch.Tensor:
    """``P[Binomial(L, p) ≥ t] = 1 − Σ_{j<t} C(L, j) p^j (1 − p)^{L−j}`` with ``p = (1 − θ/π)^K`` the
    probability that one table collides, ``θ = arccos(cos)``, ``t = min_tables``; float64. ``t = 1``
    is ``1 − (1 − p)^L``, ``t = 2`` MagicPIG's ``1 − (1 − p)^{L−1}(Lp + 1 − p)``."""
    theta = torch.arccos(torch.clamp(cos.double(), -1.0, 1.0))
    p = (1 - theta / math.pi) ** bits
    miss = 1 - p
    below = torch.zeros_like(p)
    for j in range(min_tables):
        below = below + float(math.comb(tables, j)) * p**j * miss ** (tables - j)
    return torch.clamp(1 - below, min=0.0, max=1.0)


def retrieval_weights(cos: torch.Tensor, bits: int, tables: int, min_tables: int, eps: float) -> torch.Tensor:
    """Importance weights ``1 / (P + eps)`` of retrieved keys (:func:`retrieval_probability`), float64;
    ``eps = 0`` is the exact inverse (``P`` floored at 1e-300)."""
    p = retrieval_probability(cos, bits, tables, min_tables)
    return 1.0 / (p + eps) if eps > 0 else 1.0 / p.clamp(min=1e-300)


__all__ = ["SPLIT_PROGRAMS", "LshCodes", "key_dots_triton", "middle_mean", "retrieval_probability", "retrieval_weights",
           "retrieve_triton", "usable"]
