"""Shared pieces of the Triton decode kernels: support checks, the counter-based RNG, the merge.

Counter-based randomness
------------------------
Every uniform a kernel draws is ``row_uniform(seed, length, stream, counter)``: the seed's two words
mixed with the row's valid length (its position: a new step of a row draws new numbers, with nothing
for the host to update between CUDA-graph replays), then ``hash_uniform``: three rounds of the
``lowbias32`` integer mix over the 64-bit ``seed`` (low word, high word), a ``stream`` number and a
32-bit ``counter``; the top 24 bits of the result give ``k / 2**24`` in [0, 1), a value that float32
and float64 hold exactly. The counters are

- tile offset of (batch row b, query head h, tile t): stream 1, ``counter = (b·Hq + h)·T + t``
  with ``T`` the launch's tile count ``ceil(N / tile)``;
- budget offset of (b, h) (S²ANTA-prop's systematic rounding of tile budgets): stream 2,
  ``counter = b·Hq + h``.

``uniforms(seed, stream, counters)`` evaluates the same function with torch on any device, so a
reference can be fed the kernel's uniforms (that is how the tests compare counts). The caller mixes
layer and decode step into ``seed`` (``core.rng.derive_seed``), so no two calls share offsets.

The merge kernel
----------------
Every kernel writes per-part partials ``acc [B, Hq, P, d]`` (an unnormalised weighted sum of V
rows), ``m [B, Hq, P]`` (a log-scale) and ``l [B, Hq, P]`` (a weight), and one merge gives
``out = Σ_p e^{m_p − m*} acc_p / Σ_p e^{m_p − m*} l_p`` (FlashDecoding's split-KV combine). Parts
past a row's length are never read; parts with ``l = 0`` are skipped without memory traffic.
"""

from __future__ import annotations

import functools

import torch

from ...core import rng as _rng

try:  # triton is an optional dependency at run time (CPU-only installs run the references)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

gdc_launch_dependents = gdc_wait = None  # programmatic dependent launch, where Triton and the GPU have it
if triton is not None:
    try:  # programmatic dependent launch (Hopper); absent from older Triton releases
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401 - used by the kernels
    except ImportError:  # pragma: no cover - depends on the installed Triton
        pass

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_BUDGET = 65535  # counts are split into two 8-bit halves for 16-bit dots (see santa kernels)

_MASK32 = 0xFFFFFFFF
_MIX1 = 0x7FEB352D
_MIX2 = 0x846CA68B
_GOLDEN = 0x9E3779B9

STREAM_TILE = 1
STREAM_BUDGET = 2


def triton_available() -> bool:
    return triton is not None


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under ``TRITON_INTERPRET=1`` (runs on CPU tensors)."""
    return type(kernel).__name__ == "InterpretedFunction"


def kernels_interpreted() -> bool:
    """True when the kernels were decorated under ``TRITON_INTERPRET=1`` (they then run on CPU tensors only):
    every kernel module imports this one first, so its own jit function tells."""
    return triton is not None and is_interpreted(hash_uniform)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                       head_dims: tuple[int, ...] = SUPPORTED_HEAD_DIMS,
                       kernels: str = "the Triton kernels") -> str | None:
    """Why the Triton kernels cannot serve these tensors (None when they can); ``head_dims`` and the
    ``kernels`` named in the message let one kernel family state its own limits."""
    if triton is None:
        return "triton is not installed"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} ({kernels} take float16, bfloat16 or float32)"
    d = q.shape[-1]
    if d not in head_dims or v.shape[-1] != d:
        dims = ", ".join(str(x) for x in head_dims[:-1]) + f" or {head_dims[-1]}"
        return f"head dim {d} / value dim {v.shape[-1]} ({kernels} take equal q/k/v head dims of {dims})"
    if q.device.type == "cuda":
        if kernels_interpreted():
            return "TRITON_INTERPRET=1 was set when the kernels were imported, and they cannot run on CUDA tensors"
        return None
    if q.device.type == "cpu":
        if kernels_interpreted():
            return None
        return ("CPU tensors: the Triton kernels run on CPU only through the interpreter "
                "(set TRITON_INTERPRET=1 before kvsieve's Triton kernels are imported)")
    return f"device {q.device.type}"


@functools.cache
def _hopper_or_newer(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_available() -> bool:
    """Programmatic dependent launch (PDL): the kernels are compiled (the interpreter has no grid
    dependency control), Triton has it and the GPU too (compute capability 9.0 and newer).

    A kernel launched with PDL (:func:`pdl_launch`) may start while the one before it in the stream still
    runs, so it must call ``gdc_wait()`` before it reads anything an earlier kernel writes (and before it
    writes anything an earlier kernel reads); ``gdc_launch_dependents()`` lets the next one launch. Waiting
    covers every kernel before: each PDL kernel waits before it finishes, so completions chain."""
    return (gdc_wait is not None and not kernels_interpreted()
            and _hopper_or_newer(torch.cuda.current_device()))


def pdl_launch(pdl: bool) -> dict:
    """The launch option that turns programmatic dependent launch on (see :func:`pdl_available`)."""
    return {"launch_pdl": True} if pdl else {}


# The split-K merge (:func:`merge_partials`) of the dense and sparse decode kernels launched with programmatic
# dependent launch: its programs start while the partials' launch runs and wait for it, hiding the launch gap
# between the two (a tensor-parallel rank of the 70B shape runs 80 dense layers of about 40 µs a step). Off until
# timed on the GPU (benchmarks/breakdown/dense_splits.py times the dense kernel both ways)
MERGE_PDL = False


def merge_pdl() -> bool:
    """Whether the dense and sparse decode kernels launch their merge with programmatic dependent launch now."""
    return MERGE_PDL and pdl_available()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``): how many blocks of ``b`` cover ``a``."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: exact for float32 inputs, tensor cores (inputs are 16-bit) otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def group_block(group: int) -> int:
    """Rows of the query block: ``tl.dot`` needs at least 16."""
    return max(16, next_pow2(group))


def seed_words(seed: int) -> tuple[int, int]:
    return _rng.seed_words(seed)


def uniforms(seed: int, stream: int, counters: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The kernels' uniforms ``[B, ...]`` for ``counters`` (an int tensor whose first axis is the batch
    row) of rows with valid lengths ``lengths [B]``, as float64 ``k / 2**24``: the torch twin of
    ``row_uniform`` below, shared with the references (``core.rng``)."""
    lo, hi = _rng.length_words(*seed_words(seed), lengths.to(counters.device))
    view = (-1,) + (1,) * (counters.dim() - 1)
    return _rng.hash_uniform(lo.view(view), hi.view(view), stream, counters)


def tile_uniforms(seed: int, batch: int, heads: int, tiles: int, lengths: torch.Tensor, device=None) -> torch.Tensor:
    """``[B, Hq, T]`` tile offsets as the kernels draw them for rows of valid lengths ``lengths [B]``."""
    c = torch.arange(batch * heads * tiles, device=device, dtype=torch.int64).view(batch, heads, tiles)
    return uniforms(seed, STREAM_TILE, c, lengths)


def budget_uniforms(seed: int, batch: int, heads: int, lengths: torch.Tensor, device=None) -> torch.Tensor:
    """``[B, Hq]`` budget offsets (prop's systematic rounding) as the kernels draw them."""
    c = torch.arange(batch * heads, device=device, dtype=torch.int64).view(batch, heads)
    return uniforms(seed, STREAM_BUDGET, c, lengths)


if triton is not None:

    @triton.jit
    def hash_mix32(x):
        # x: int64 holding a 32-bit value; products wrap, the mask keeps the low word.
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def hash_uniform(seed_lo, seed_hi, stream_key, counter):
        """Uniform ``k / 2**24`` in [0, 1) (float32) for an int64 ``counter`` tensor."""
        x = counter.to(tl.int64) & 0xFFFFFFFF
        x = hash_mix32(x ^ seed_lo)
        x = hash_mix32(x ^ seed_hi)
        x = hash_mix32(x ^ stream_key)
        return (x >> 8).to(tl.float32) * 5.9604644775390625e-08

    @triton.jit
    def row_uniform(seed_lo, seed_hi, length, stream_key, counter):
        """``hash_uniform`` under the row's key: the call's words mixed with the row's valid ``length``
        (``core.rng.length_words``), so each decode step of a row draws fresh numbers."""
        lo = hash_mix32((seed_lo ^ length.to(tl.int64) ^ 0x243F6A88) & 0xFFFFFFFF)
        hi = hash_mix32(seed_hi ^ lo ^ 0x85A308D3)
        return hash_uniform(lo, hi, stream_key, counter)

    @triton.jit
    def attend_tile(q, k_base, v_base, pos, ok, log2_w, m_i, l_i, acc, s_k_n, s_v_n, offs_d, scale_log2,
                     HAS_W: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
        """One online-softmax step over the key rows at ``pos`` (``ok`` masks them) of the K/V rows at
        ``k_base``/``v_base``, in log2 units (``scale_log2`` = scale·log2 e): returns the new running max,
        sum and ``[G, D]`` accumulator. ``log2_w`` adds the rows' log2-weights when HAS_W."""
        k = tl.load(k_base + pos[:, None] * s_k_n + offs_d[None, :], mask=ok[:, None], other=0.0)
        if DOT_F32:  # the interpreter's bf16 tl.dot is wrong; its tests upcast the tiles instead
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if HAS_W:
            s = s + log2_w[None, :]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile with no key adds nothing
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + pos[:, None] * s_v_n + offs_d[None, :], mask=ok[:, None], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def attend_dense_split(q, k_base, v_base, split, chunk, sink_end, win_start, length, m_i, l_i, acc, s_k_n, s_v_n,
                           offs_n, offs_d, scale_log2, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                           DOT_F32: tl.constexpr):
        """Split ``split`` (``chunk`` keys) of a row's dense part, the concatenation ``[0, sink_end) ++
        [win_start, length)`` read at weight 1, through :func:`attend_tile`."""
        n_dense = sink_end + (length - win_start)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_dense)
        for t0 in range(lo, hi, BLOCK_N):
            t = t0 + offs_n
            ok = t < hi
            pos = tl.where(t < sink_end, t, win_start + (t - sink_end))
            m_i, l_i, acc = attend_tile(q, k_base, v_base, pos, ok, 0.0, m_i, l_i, acc, s_k_n, s_v_n,
                                         offs_d, scale_log2, False, DOT_PRECISION, DOT_F32)
        return m_i, l_i, acc

    @triton.jit
    def store_partials(m_ptr, l_ptr, acc_ptr, rows, row_ok, n_parts, part, m_i, l_i, acc, offs_d, D: tl.constexpr):
        """Part ``part``'s partials of the query rows ``rows`` (``b·Hq + h``), laid out ``[B, Hq, parts(, D)]``
        for :func:`merge_partials`: ``m`` in natural-log units (``m_i`` is log2), ``l`` and ``acc``."""
        ml = rows * n_parts + part
        tl.store(m_ptr + ml, m_i * 0.6931471805599453, mask=row_ok)
        tl.store(l_ptr + ml, l_i, mask=row_ok)
        tl.store(acc_ptr + ml[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def dense_range(lens_ptr, b, sink, window, n_keys=0, HAS_LENS: tl.constexpr = True):
        """Row ``b``'s length (``lens_ptr[b]``, or ``n_keys`` without lengths) and the bounds of its dense
        part: sink ``[0, sink_end)`` and window ``[win_start, length)``; the selectable keys are
        ``[sink_end, win_start)``."""
        if HAS_LENS:
            length = tl.load(lens_ptr + b).to(tl.int32)
        else:
            length = n_keys
        sink_end = tl.minimum(sink, length)
        win_start = tl.maximum(length - window, sink_end)
        return length, sink_end, win_start

    @triton.jit
    def _merge_partials_kernel(
        acc_ptr, m_ptr, l_ptr, lens_ptr, out_ptr, lse_ptr,
        n_parts, part_keys,
        s_acc_b, s_acc_h, s_acc_p,
        s_ml_b, s_ml_h,
        s_out_b, s_out_h,
        D_CHUNK: tl.constexpr, CHUNK_P: tl.constexpr, HAS_LENS: tl.constexpr, HAS_LSE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # One program per (head, batch row, slice of D_CHUNK features): many small programs, so
        # that reading the partials is not bound by the latency of a few SMs. Slice 0 writes the LSE.
        if PDL:  # launched while the partials' launch runs: nothing is read or written before it is done
            gdc_wait()
        h = tl.program_id(0)
        b = tl.program_id(1)
        d0 = tl.program_id(2) * D_CHUNK
        b64 = b.to(tl.int64)
        if HAS_LENS:  # parts past the row's length were never written
            parts_b = (tl.load(lens_ptr + b) + part_keys - 1) // part_keys
        else:
            parts_b = n_parts
        ml_base = b64 * s_ml_b + h * s_ml_h
        m_star = tl.full([CHUNK_P], float("-inf"), tl.float32)
        for p0 in range(0, n_parts, CHUNK_P):
            offs_c = p0 + tl.arange(0, CHUNK_P)
            in_row = offs_c < parts_b
            mc = tl.load(m_ptr + ml_base + offs_c, mask=in_row, other=float("-inf"))
            lc = tl.load(l_ptr + ml_base + offs_c, mask=in_row, other=0.0)
            m_star = tl.maximum(m_star, tl.where(lc > 0, mc, float("-inf")))
        m_max = tl.max(m_star, axis=0)
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
        offs_d = d0 + tl.arange(0, D_CHUNK)
        out = tl.zeros([D_CHUNK], dtype=tl.float32)
        z = tl.zeros([CHUNK_P], dtype=tl.float32)
        for p0 in range(0, n_parts, CHUNK_P):
            offs_c = p0 + tl.arange(0, CHUNK_P)
            in_row = offs_c < parts_b
            mc = tl.load(m_ptr + ml_base + offs_c, mask=in_row, other=float("-inf"))
            lc = tl.load(l_ptr + ml_base + offs_c, mask=in_row, other=0.0)
            live = in_row & (lc > 0)  # empty parts cost no traffic
            wc = tl.where(live, tl.exp(mc - m_ref), 0.0)
            z += wc * lc
            a = tl.load(acc_ptr + b64 * s_acc_b + h * s_acc_h + offs_c[:, None] * s_acc_p + offs_d[None, :],
                        mask=live[:, None], other=0.0)
            out += tl.sum(wc[:, None] * a, axis=0)
        total = tl.sum(z, axis=0)
        safe = tl.where(total > 0, total, 1.0)
        out = tl.where(total > 0, out / safe, 0.0)  # a row with no key at all gives 0 and LSE −inf
        tl.store(out_ptr + b64 * s_out_b + h * s_out_h + offs_d, out.to(out_ptr.dtype.element_ty))
        if HAS_LSE:
            if d0 == 0:
                tl.store(lse_ptr + b64 * tl.num_programs(0) + h,
                         tl.where(total > 0, m_ref + tl.log(safe), float("-inf")))


def merge_partials(acc, m, l, lens, out, b: int, hq: int, p: int, d: int, part_keys: int,
                   s_acc: tuple[int, int, int], s_ml: tuple[int, int], *, lse: torch.Tensor | None = None,
                   d_chunk: int = 16, num_warps: int = 4, num_stages: int = 3, pdl: bool = False) -> torch.Tensor:
    """``out [B, Hq, d]`` from partials ``acc [B, Hq, P, d]``, ``m, l [B, Hq, P]`` in flat buffers with explicit
    strides (see the module doc; no tensor views on the host path). ``lens [B]`` (None: every row has
    all ``P`` parts) limits row b to its first ``ceil(lens[b] / part_keys)`` parts; with ``lse [B, Hq]``
    (float32, contiguous) the row's log-sum-exp is written too. ``pdl``: launched with programmatic dependent
    launch (see :func:`pdl_available`; the partials' kernel should call ``gdc_launch_dependents``)."""
    launch(_merge_partials_kernel, (hq, b, d // d_chunk),
           acc, m, l, out if lens is None else lens, out, out if lse is None else lse, p, part_keys,
           s_acc[0], s_acc[1], s_acc[2], s_ml[0], s_ml[1],
           out.stride(0), out.stride(1),
           D_CHUNK=d_chunk, CHUNK_P=min(64, max(16, next_pow2(p))), HAS_LENS=lens is not None,
           HAS_LSE=lse is not None, PDL=pdl, num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl))
    return out


# --- host path: direct launches of compiled kernels, cached workspaces ------------------------------
#
# ``kernel[grid](...)`` costs tens of µs of Python per launch (binding, specialisation, cache key) on
# the H100 machine. ``launch`` keeps the compiled kernel of each specialisation and calls it directly.
# Its cache key covers everything Triton specialises a launch on: per tensor its dtype and the
# pointer's residue mod 16, per int whether it equals 1, its residue mod 16 and its integer width,
# per float its type, and the constexprs, num_warps and num_stages; so a key hit can only be a launch
# that Triton itself would have served with the same binary.

_COMPILED: dict = {}


def compiled_launches() -> dict:
    """A copy of what :func:`launch` keeps: the compiled kernel (and its constexprs) by specialisation key."""
    return dict(_COMPILED)
_INT32 = 1 << 31


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15
    if isinstance(a, bool):
        return "b", a
    if isinstance(a, int):
        return a == 1, a & 15, -_INT32 <= a < _INT32, a >= 1 << 63
    return type(a)


_TENSOR = torch.Tensor


def _spec_key(args) -> tuple:
    # the common cases inline (exact tensors; ints in (1, 2^31), which Triton types i32 and
    # specialises only on divisibility by 16), everything else through _arg_key
    return tuple([(a.data_ptr() & 15, a.dtype) if type(a) is _TENSOR
                  else a & 15 if type(a) is int and 1 < a < _INT32 else _arg_key(a) for a in args])


def launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)`` through the cache of compiled kernels. ``args`` are the kernel's
    runtime parameters in order, ``meta`` its constexprs (after them in the signature) plus
    num_warps/num_stages. Under the interpreter it is the plain launch."""
    if is_interpreted(kernel):
        kernel[grid](*args, **meta)
        return
    device = torch.cuda.current_device()
    key = (id(kernel), device, tuple(meta.values()), _spec_key(args))
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **meta)
        names = [p.name for p in kernel.params]
        constexprs = tuple(meta[name] for name in names[len(args):])
        if any(p.is_constexpr for p in kernel.params[:len(args)]):
            raise TypeError(f"launch: {kernel.__name__} takes a constexpr among its first {len(args)} parameters")
        _COMPILED[key] = (compiled, constexprs)
        return
    compiled, constexprs = hit
    compiled[grid if len(grid) == 3 else (*grid, 1, 1)[:3]](*args, *constexprs)


_CONSTANTS: dict = {}


def float64_constants(values: tuple[float, ...], device) -> torch.Tensor:
    """A cached float64 vector of ``values`` on ``device``, for kernels that must compute in float64 with
    constants the host knows: Triton passes a Python float as float32. Created on first use (a copy from
    the host: outside any graph capture), then reused."""
    key = (tuple(float(v) for v in values), str(device))
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.tensor(key[0], dtype=torch.float64, device=device)
    return t


_WORKSPACE: dict = {}


def workspace(tag: str, like: torch.Tensor, numel: int, dtype: torch.dtype, *, zeroed: bool = False,
              fill: float | None = None) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, cached per (tag, device, dtype) and grown by 1/8
    when too small (a decode loop grows N by one key per step). ``zeroed`` buffers are zero when
    allocated (``fill``: that value) and the kernels that use them leave them so. One workspace per
    device: calls on different streams of one device must not overlap in time."""
    if fill is None and zeroed:
        fill = 0
    key = (tag, like.get_device(), dtype)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        size = max(numel, numel + numel // 8) if buf is not None else numel
        if fill is None:
            buf = torch.empty(size, device=like.device, dtype=dtype)
        else:
            buf = torch.full((size,), fill, device=like.device, dtype=dtype)
        _WORKSPACE[key] = buf
    return buf
