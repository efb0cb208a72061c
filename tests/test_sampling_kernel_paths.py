"""The kernel paths of the sampling and selection baselines (issue 15): ``random``, ``vattention``,
``magicpig`` and ``oracle-topp`` run their own torch selection and hand it to the Triton weighted sparse
kernel (``methods/shared/staged.py``).

The kernel path must choose what the reference chooses from the same seed (same counter-based draws) and
compute the same estimator: checked through every stat both paths derive from their selection (keys,
V rows, K rows scored, bytes, exact rows and the method's extras such as vAttention's budget) and
through the outputs, on ragged batches, GQA, float32 and bfloat16, one or several query rows per call,
and a decode loop whose per-request state (MagicPIG's codes, vAttention's Quest page summaries) grows
with the cache. On the CPU through Triton's interpreter (chosen when triton is imported, hence a
subprocess); the ``gpu`` twin runs the same cases on CUDA, where ``auto`` must pick the kernel, with no
host sync and a CUDA-graph replay equal to eager calls. (``tests/test_decode_contract.py``'s GPU tests
also run these methods with their defaults, which now take the kernel path.)
"""

from __future__ import annotations

import pytest
import torch
from interpreted import run_script

CASES = """
import torch
import kvsieve
from kvsieve.core.rng import RandomKey

device = "{device}"
on_gpu = device == "cuda"
SPECS = {specs}
LOOPS = {loops}
STATS = ("n_keys", "k_rows_scored", "v_rows_read", "kv_rows_read", "density", "kv_density", "bytes_read",
         "exact_rows")
TOL = {{torch.float32: 2e-5 if not on_gpu else 2e-3, torch.bfloat16: 1.2e-2}}  # relative, per output
worst = {{}}


def same_selection(stats, ref, where):
    assert stats.backend == "triton" and ref.backend == "reference", (where, stats.backend, ref.backend)
    for f in STATS:
        assert stats[f] == ref[f], (where, f, stats[f], ref[f])
    for key, value in ref.extra.items():
        got = stats.raw(key)  # deferred stats resolve on read
        if key == "budget_raw":
            # float64 sums over the same keys in another order (vAttention's fused budget statistics); the
            # tested-key path takes the lists' logits from the scores pass's float32 scores
            tol = 1e-5 if stats.extra.get("kernel") == "vattention attend_triton" else 1e-12
            torch.testing.assert_close(got, value, rtol=tol, atol=0, msg=str((where, key)))
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got, value), (where, key)
        else:
            assert got == value, (where, key, got, value)


def close(out, ref, where):
    assert out.shape == ref.shape and out.dtype == ref.dtype, where
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    worst[out.dtype] = max(worst.get(out.dtype, 0.0), err)
    assert err < TOL[out.dtype], (where, err)


def tensors(seed, dtype, b=2, hq=4, hkv=2, n=300, d=64, q_len=None):
    g = torch.Generator().manual_seed(seed)
    shape = (b, hq, d) if q_len is None else (b, hq, q_len, d)
    q = (torch.randn(shape, generator=g) * 2).to(device, dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(device, dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(device, dtype)
    return q, k, v


calls = 0
for spec in SPECS:
    fast = kvsieve.method(spec) if on_gpu else kvsieve.method(spec + ",backend=triton")  # auto picks it on CUDA
    slow = kvsieve.method(spec + ",backend=reference")
    for dtype, seed in ((torch.float32, 0), (torch.float32, 1), (torch.bfloat16, 2)):
        q, k, v = tensors(seed, dtype)
        lens = torch.tensor([300, 97 + 61 * seed], device=device)  # ragged rows
        key = RandomKey(seed, (1, 2))
        out, st = fast.decode(q, k, v, lengths=lens, seed=key)
        ref, rst = slow.decode(q, k, v, lengths=lens, seed=key)
        where = (spec, str(dtype), seed)
        same_selection(st, rst, where)
        close(out, ref, where)
        calls += 1
    # rows no longer than sink + window: no key is left to select (an empty list on the CPU), exact
    q, k, v = tensors(5, torch.float32)
    lens = torch.tensor([3, 6], device=device)
    out, st = fast.decode(q, k, v, lengths=lens, seed=RandomKey(2))
    ref, rst = slow.decode(q, k, v, lengths=lens, seed=RandomKey(2))
    same_selection(st, rst, (spec, "covered"))
    close(out, ref, (spec, "covered"))
    if "sink=0,window=0" not in spec:
        assert st.exact_rows == 2, (spec, st.exact_rows)
        exact, _ = kvsieve.method("dense").decode(q, k, v, lengths=lens)
        close(out, exact, (spec, "covered vs exact"))
    # several query rows per call (a question chunk): each row its own length and draws
    q4, k, v = tensors(7, torch.float32, q_len=3)
    lens = torch.tensor([290, 150], device=device)
    out, st = fast.decode(q4, k, v, lengths=lens, seed=RandomKey(4))
    ref, rst = slow.decode(q4, k, v, lengths=lens, seed=RandomKey(4))
    same_selection(st, rst, (spec, "chunk"))
    close(out, ref, (spec, "chunk"))

# A decode loop: the cache grows by one key per row and step, state is kept per path across steps, and
# the step counter gives fresh draws; the paths stay equal at every step (row 1 starts a new page at step 1).
for spec in LOOPS:
    fast = kvsieve.method(spec) if on_gpu else kvsieve.method(spec + ",backend=triton")
    slow = kvsieve.method(spec + ",backend=reference")
    q_all, k, v = tensors(11, torch.bfloat16, q_len=4, n=212)
    fs, ss = fast.new_state(), slow.new_state()
    for step in range(4):
        lens = torch.tensor([200 + step, 64 + step], device=device)
        n = 200 + step + 1
        key = RandomKey(5, (0, step))
        q = q_all[:, :, step].contiguous()
        out, st = fast.decode(q, k[:, :, :n], v[:, :, :n], lengths=lens, seed=key, state=fs, check_finite=False)
        ref, rst = slow.decode(q, k[:, :, :n], v[:, :, :n], lengths=lens, seed=key, state=ss, check_finite=False)
        same_selection(st, rst, (spec, "step", step))
        close(out, ref, (spec, "step", step))
print("CALLS", calls, "WORST", {{str(k): v for k, v in worst.items()}})
print("OK")
"""

# The cases' specs, in groups of one interpreter run each (so no single test runs them all); LOOPS are also
# run as a decode loop whose per-request state grows with the cache.
SPEC_GROUPS = {
    "random-topp": dict(specs=[
        "random:sink=4,window=8,budget=30",
        "random:sink=0,window=0,budget=0.1,replacement=True,share_kv_group=True",
        "oracle-topp:sink=4,window=4,top_p=0.8",
        "oracle-topp:sink=2,window=6,top_p=0.6,mass=residual,share_kv_group=True",
    ], loops=[]),
    "magicpig": dict(specs=[
        "magicpig:bits=4,tables=8,sink=4,window=4,budget=40",
        "magicpig:bits=3,tables=6,sink=2,window=4,transform=mips,min_tables=1,weight_eps=0",
        "magicpig:bits=2,tables=9,sink=3,window=5,min_tables=3",
    ], loops=["magicpig:bits=4,tables=8,sink=4,window=4,budget=40"]),
    "vattention": dict(specs=[
        "vattention:sink=4,window=4,top_k=8,epsilon=0.1,delta=0.1",
        "vattention:sink=4,window=8,top_k=0.05,epsilon=0.2,delta=0.2,bound=denominator,residual=includes-topk",
        "vattention:sink=4,window=4,top_k=16,epsilon=0.3,delta=0.3,predictor=quest,page_size=16,share_kv_group=True",
        "vattention:sink=4,window=4,top_k=8,epsilon=0.2,delta=0.2,replacement=True,budget_floor=base",
        # every hub flag: the torch selection (de-duplicated sample) handed to the kernel
        "vattention:sink=4,window=4,top_k=8,epsilon=0.2,delta=0.2,bound=denominator,quantile=one-sided,"
        "replacement=True,residual=includes-topk,budget_floor=base,rounding=down,duplicates=collapse",
    ], loops=[]),
    # the fused Quest path (kernel_stages): per-query-head pages, bound=full; Hoeffding with budget_floor=base
    "vattention-fused": dict(specs=[
        "vattention:sink=4,window=4,top_k=0.05,epsilon=0.2,delta=0.1,predictor=quest,page_size=16",
        "vattention:sink=4,window=4,top_k=0.05,epsilon=0.3,delta=0.3,predictor=quest,page_size=8,bound=denominator,"
        "concentration=hoeffding,budget_floor=base",
    ], loops=["vattention:sink=4,window=4,top_k=16,epsilon=0.3,delta=0.3,predictor=quest,page_size=16"]),
}


ERRORS = """
import pytest
import torch
import kvsieve

g = torch.Generator().manual_seed(0)
q, k, v = torch.randn(2, 4, 64, generator=g), torch.randn(2, 2, 80, 64, generator=g), torch.randn(2, 2, 80, 64,
                                                                                                    generator=g)
for name in ("random", "vattention", "magicpig", "oracle-topp"):
    # off the GPU, auto is the reference by design: no fallback to explain
    _, st = kvsieve.method(name, sink=4, window=4).decode(q, k, v)
    assert st.backend == "reference" and "backend_reason" not in st.extra, name
    m = kvsieve.method(name, sink=4, window=4, backend="triton")
    with pytest.raises(ValueError, match="backend: 'triton' cannot serve this call: .*float64"):
        m.decode(q.double(), k.double(), v.double())
    mask = torch.ones(2, 80, dtype=torch.bool)
    mask[0, 10] = False  # a hole: not a prefix, the kernel takes lengths
    with pytest.raises(ValueError, match="key_mask is not a prefix"):
        m.decode(q, k, v, key_mask=mask)
    with pytest.raises(ValueError, match="head dim 48"):
        m.decode(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous())
    _, st = kvsieve.method(name, sink=4, window=4).decode(q, k, v, key_mask=mask)  # auto: the reference serves it
    assert st.backend == "reference", name
    with pytest.raises(ValueError, match="backend: expected one of"):
        kvsieve.method(name, backend="cuda")
# nothing selected and no dense part: the kernel path raises as the reference does
with pytest.raises(ValueError, match="selected no key"):
    kvsieve.method("random", sink=0, window=0, budget=0, backend="triton").decode(
        q, k, v, lengths=torch.tensor([80, 80]), seed=1)
print("OK")
"""


SAMPLE = """
import torch
from kvsieve.core.rng import STREAM_SUBSET, RandomKey, RowStreams, row_words
from kvsieve.kernels.shared.sample_triton import (row_words_triton, sample_rows_reference, sample_rows_triton,
                                                  sample_splits)
from kvsieve.methods.shared.selection import uniform_sample

# the fused row words equal core.rng's: int and device counters, host-int prefixes, per-row seeds, chunks
pos = torch.tensor([300, 97, 55, 1000])
for key, q_len in [(RandomKey(3, (1, 2)), 1), (RandomKey(7, (0, torch.tensor(5))), 2), (RandomKey(2**40 + 5), 1),
                   (RandomKey(9, (torch.tensor(3), 4, torch.tensor(2**33 + 7))), 4),
                   (RandomKey(0, (), torch.tensor([11, -5])), 2)]:
    got = row_words_triton(key, pos, q_len)
    want = row_words(key, torch.arange(4) // q_len, pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), key

g = torch.Generator().manual_seed(0)
# sizes: small, the whole range, 0, more than available (capped), a large share (the prefilter's fallback
# and the candidates' multi-block loop: the interpreter keeps 256 candidates per block)
for r, hs, n, sizes in [(2, 3, 300, [30, 5, 0]), (1, 2, 3000, [600, 2999]), (3, 2, 700, [1000, 1]),
                        (1, 1, 5000, [4000])]:
    rs = RowStreams(RandomKey(3, (1, 2)), torch.arange(r), torch.full((r,), n))
    start = torch.tensor([4, 10, 0][:r])
    end = torch.tensor([n - 8, n - 100, 5][:r])
    size = torch.tensor(sizes).repeat(r, 1)[:, :hs]
    p = torch.arange(n)
    rng_ok = ((p >= start[:, None]) & (p < end[:, None]))[:, None].expand(r, hs, n)
    for excl in (None, torch.rand(r, hs, -(-n // 16), generator=g) < 0.3):
        avail = rng_ok if excl is None else rng_ok & ~excl[:, :, p // 16]
        n_av = avail.sum(-1)
        idx, w = sample_rows_triton(rs.lo, rs.hi, STREAM_SUBSET, start, end, size, n_av, n + 5, n, excluded=excl,
                                    page=16)
        take = torch.minimum(size, n_av)
        assert torch.equal(idx, sample_rows_reference(rs.lo, rs.hi, STREAM_SUBSET, start, end, take, n + 5, n,
                                                      excl, 16))
        ref = uniform_sample(avail, size, rs)  # the methods' reference: the same set (no tie at these sizes)
        assert torch.equal(ref.counts, take)
        for a in range(r):
            for b in range(hs):
                c = int(take[a, b])
                assert set(idx[a, b, :c].tolist()) == set(ref.indices[a, b, :c].tolist()), (n, a, b)
                assert torch.equal(w[a, b, :c], ref.weights[a, b, :c].double())
                assert bool((idx[a, b, c:] == 0).all()) and bool((w[a, b, c:] == 1).all())
# the split scan (counts, then candidates, in splits x heads x rows programs) writes the one-program scan's
# list: many splits of small blocks, a chunk cut inside the range, N not a multiple of the chunk, pages
for r, hs, n, block, target, page in [(1, 2, 1000, 16, 64, 1), (2, 3, 777, 32, 100, 16), (1, 1, 130, 16, 528, 16)]:
    assert sample_splits(n, r * hs, block, target)[0] > 4
    rs = RowStreams(RandomKey(n, (1, 2)), torch.arange(r), torch.full((r,), n))
    start, end = torch.tensor([3, 17, 0][:r]), torch.tensor([n - 5, n - 29, n][:r])
    p = torch.arange(n)
    excl = torch.rand(r, hs, -(-n // page), generator=g) < 0.4
    avail = ((p >= start[:, None]) & (p < end[:, None]))[:, None] & ~excl[:, :, p // page]
    n_av = avail.sum(-1)
    for frac in (0.0, 0.03, 0.3, 1.5):
        size = (n_av.double() * frac).long() + torch.randint(0, 3, (r, hs), generator=g)
        want = sample_rows_reference(rs.lo, rs.hi, STREAM_SUBSET, start, end, torch.minimum(size, n_av), n + 3, n,
                                     excl, page)
        idx, w = sample_rows_triton(rs.lo, rs.hi, STREAM_SUBSET, start, end, size, n_av, n + 3, n, excluded=excl,
                                    page=page, block=block, target_programs=target)
        one, w1 = sample_rows_triton(rs.lo, rs.hi, STREAM_SUBSET, start, end, size, n_av, n + 3, n, excluded=excl,
                                     page=page, block=block, target_programs=1)
        assert torch.equal(idx, want) and torch.equal(idx, one) and torch.equal(w, w1), (n, block, frac)
# written from an offset: the columns before it are kept
off = torch.tensor([[3, 0]])
out = torch.full((1, 2, 40), -7, dtype=torch.int64)
wts = torch.full((1, 2, 40), -7.0, dtype=torch.float64)
rs = RowStreams(RandomKey(1), torch.arange(1), torch.tensor([200]))
size, n_av = torch.tensor([[10, 20]]), torch.tensor([[100, 100]])
sample_rows_triton(rs.lo, rs.hi, 4, torch.tensor([50]), torch.tensor([150]), size, n_av, 40, 200, offset=off,
                   out=out, weights=wts)
plain, _ = sample_rows_triton(rs.lo, rs.hi, 4, torch.tensor([50]), torch.tensor([150]), size, n_av, 40, 200)
assert bool((out[0, 0, :3] == -7).all()) and torch.equal(out[0, 0, 3:13], plain[0, 0, :10])
assert torch.equal(out[0, 1, :20], plain[0, 1, :20]) and bool((out[0, 0, 13:] == 0).all())
assert bool((wts[0, 0, 3:13] == 10.0).all()) and bool((wts[0, 1, 20:] == 1.0).all())
# fill=False: the columns after the sample keep what they held
out2 = torch.full((1, 2, 40), -7, dtype=torch.int64)
sample_rows_triton(rs.lo, rs.hi, 4, torch.tensor([50]), torch.tensor([150]), size, n_av, 40, 200, offset=off,
                   out=out2, weights=torch.zeros(1, 2, 40, dtype=torch.float64), fill=False)
assert torch.equal(out2[0, 0, 3:13], plain[0, 0, :10]) and bool((out2[0, 0, 13:] == -7).all())
assert bool((out2[0, 1, 20:] == -7).all())
print("OK")
"""


LSH = """
import torch
from kvsieve.kernels.magicpig.lsh_triton import LshCodes
from kvsieve.methods.magicpig import KeyCodes, MagicPigConfig, _codes, _KeyHashes

g = torch.Generator().manual_seed(0)
k = torch.randn(2, 2, 140, 64, generator=g)
proj = torch.randn(65, 4 * 8, generator=g)
for transform in ("mips", "center"):
    cfg = MagicPigConfig(bits=4, tables=8, transform=transform)
    codes = LshCodes(proj if transform == "mips" else proj[:64], 4, 8, transform, sink=3, window=5)
    kk = k.clone()
    for step in range(5):
        lens = torch.tensor([100 + step, 60 + 3 * step])
        if step == 3:
            kk[1, 0, lens[1] - 1] *= 10  # a new longest key: row 1, head 0 is hashed again from its start
        done = codes.done.clone() if codes.codes is not None else torch.zeros(2, 2, dtype=torch.int32)
        c = codes.update(kk[:, :, :110 + step], lens)
        valid = torch.arange(110 + step)[None, :] < lens[:, None]
        kv = kk[:, :, :110 + step] * valid[:, None, :, None]
        if transform == "mips":
            m = kv.norm(dim=-1).amax(-1)
            torch.testing.assert_close(codes.norm_max, m)
            const = KeyCodes(n=0, proj=codes.proj, codes=codes.proj, norm_max=m)
            if step:
                grew = (codes.lo == 0) & (done > 0)
                assert grew.tolist() == ([[False, False], [step == 3, False]]), (step, codes.lo)
        else:
            const = KeyCodes(n=0, proj=codes.proj, codes=codes.proj, mean=codes.mean)
            # the first call's middle keys: neither the 3 sink nor the 5 window keys of each row
            first = torch.stack([kk[0, :, 3:95].mean(1), kk[1, :, 3:55].mean(1)])
            torch.testing.assert_close(codes.mean, first, rtol=1e-6, atol=1e-6)
        want = _codes(_KeyHashes.transform(cfg, const, kk[:, :, :110 + step]), codes.proj, 4, 8)
        for b in range(2):
            n = int(lens[b])
            assert torch.equal(c[b, :, :n].long(), want[b, :, :n]), (transform, step, b)
        assert torch.equal(codes.done, lens[:, None].expand(2, 2).int())
print("OK")
"""


LSH_SPLIT = """
# MagicPIG's collision launch (query codes, then chunks of a KV head's codes for its query heads) and the
# key dots, cut over 1..528 programs: the same marks and counts as torch's codes, the same dots per entry
import torch
from kvsieve.kernels.magicpig.lsh_triton import LshCodes, key_dots_triton, retrieve_triton
from kvsieve.methods.magicpig import KeyCodes, MagicPigConfig, _codes, _KeyHashes

g = torch.Generator().manual_seed(3)
for (b, hq, hkv, n, d, bits, tables, transform, dtype, t) in [
        (2, 8, 2, 300, 64, 4, 8, "mips", torch.float32, 1), (1, 4, 4, 1000, 32, 3, 5, "center", torch.bfloat16, 2),
        (2, 4, 1, 77, 64, 2, 16, "mips", torch.bfloat16, 3)]:
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    lens = torch.tensor([n, n - 13][:b])
    mips = transform == "mips"
    proj = torch.randn(d + mips, bits * tables, generator=g)
    codes = LshCodes(proj, bits, tables, transform)
    codes.update(k, lens)
    sink, window = 3, 5
    ref = None
    for target in (1, 7, 64, 528):
        excl, cnt = retrieve_triton(q, codes, lens, sink, window, n, t, target_programs=target)
        lo = torch.clamp(lens, max=sink); hi = torch.maximum(lens - window, lo)
        m = (torch.arange(n)[None, :] >= lo[:, None]) & (torch.arange(n)[None, :] < hi[:, None])
        e = excl & m[:, None, :]
        if ref is None:
            ref = (e, cnt)
            # torch: the query codes and collisions
            cfg = MagicPigConfig(bits=bits, tables=tables, transform=transform)
            qf = q.float()
            qt = torch.cat([qf / qf.norm(dim=-1, keepdim=True), torch.zeros_like(qf[..., :1])], -1) if mips else qf
            qc = _codes(qt, codes.proj, bits, tables)
            kc = codes.codes[:, :, :n].long()
            coll = (kc[:, :, None] == qc.view(b, hkv, hq // hkv, 1, tables)).sum(-1).view(b, hq, n)
            hit = (coll >= t) & m[:, None, :]
            if t > 1:  # keys colliding in fewer than t tables exist: the threshold matters
                assert bool(((coll > 0) & (coll < t) & m[:, None, :]).any())
            assert torch.equal(e, ~hit & m[:, None, :]), "excl vs torch"
            assert torch.equal(cnt.long(), hit.sum(-1)), "count vs torch"
        else:
            assert torch.equal(e, ref[0]) and torch.equal(cnt, ref[1]), target
    width = 50
    idx = torch.randint(0, n, (b, hq, width), generator=g)
    kept = torch.randint(0, width + 1, (b, hq), generator=g)
    d1, n1 = key_dots_triton(q, k, codes, idx, kept, target_programs=1)
    used = torch.arange(width)[None, None] < kept[..., None]
    for target in (5, 528):
        d2, n2 = key_dots_triton(q, k, codes, idx, kept, target_programs=target)
        assert torch.equal(d1[used], d2[used]), target
        if n1 is not None:
            assert torch.equal(n1[used], n2[used])
    kr = torch.gather(k.float().repeat_interleave(hq // hkv, 1), 2, idx[..., None].expand(b, hq, width, d))
    torch.testing.assert_close(d1[used], (kr * q.float()[:, :, None]).sum(-1)[used], rtol=1e-5, atol=1e-4)
print("OK")
"""


@pytest.mark.triton
def test_lsh_retrieval_and_key_dots_split_over_programs():
    """MagicPIG's retrieval and key dots give the same marks, counts (integer atomics) and dots whatever
    the number of programs, equal to torch's collision test."""
    pytest.importorskip("triton")
    assert "OK" in run_script(LSH_SPLIT, "cpu", True)


COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvsieve.kernels.vattention import budget_triton as bt
from kvsieve.kernels.magicpig import lsh_triton as lt
from kvsieve.kernels.shared import sample_triton as st


def compile_(kernel, pointers, meta, ints64=(), floats=(), num_warps=4, fp32=()):
    signature, constexprs = {{}}, {{}}
    for i, name in enumerate(kernel.arg_names):
        if name in meta:
            signature[name], constexprs[(i,)] = "constexpr", meta[name]
        else:
            signature[name] = pointers.get(name, "fp64" if name in floats else "fp32" if name in fp32 else
                                           ("i64" if name in ints64 else "i32"))
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs={{}})
    md = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": num_warps}}).metadata
    print(kernel.fn.__name__, meta.get("FULL", meta.get("WRITE", "")), "shared", md.shared)

i64 = "*i64"
sp = {{n: i64 for n in ("lo_ptr", "hi_ptr", "start_ptr", "end_ptr", "size_ptr", "nav_ptr", "off_ptr", "out_ptr",
                       "cand_ptr")}}
sp.update(excl_ptr="*i8", cnt_ptr="*i32", w_ptr="*fp64")
for write in (False, True):
    compile_(st._split_candidates_kernel, sp, dict(PAGE=16, HAS_EXCL=True, WRITE=write, SPLITS=16, SP=16, BLOCK=1024),
             ints64=("stream_key",), num_warps=8)
sp.update(cut_ptr=i64)
for page, listed in ((16, True), (1, False)):  # with and without the offset and the weights
    compile_(st._sample_rows_kernel, sp, dict(PAGE=page, HAS_EXCL=True, HAS_OFF=listed, HAS_W=listed, FILL=False,
                                              BLOCK=1024, CBLOCK=8192, SPLITS=16, SP=16), ints64=("stream_key",),
             num_warps=8)
sp.update(list_ptr=i64, dest_ptr="*i32", fill_ptr="*i32")
compile_(st._window_scan_kernel, sp, dict(PAGE=16, HAS_EXCL=True, SP=32, SIGMAS=6.0, BLOCK=1024),
         ints64=("stream_key",), num_warps=8)
for listed in (False, True):
    compile_(st._window_cut_kernel, sp, dict(PAGE=1, HAS_EXCL=True, HAS_OFF=listed, LIST=listed, SP=32, BLOCK=1024,
                                             CBLOCK=8192), ints64=("stream_key",), num_warps=8)
compile_(st._window_write_kernel, sp, dict(PAGE=16, HAS_EXCL=True, HAS_OFF=True, HAS_W=True, FILL=True, SP=32,
                                           BLOCK=1024), ints64=("stream_key",), num_warps=8)
from kvsieve.kernels.vattention import attend_triton as at
ap = {{n: i64 for n in ("lo_ptr", "hi_ptr", "cut_ptr", "tie_ptr", "ns_ptr", "bs_ptr")}}
ap.update(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", sc_ptr="*fp32", x_ptr="*i8", lens_ptr="*i32", acc_ptr="*fp32",
          m_ptr="*fp32", l_ptr="*fp32")
compile_(at._attend_kernel, ap, dict(G=4, BLOCK_G=16, BLOCK_H=4, D=128, BLOCK_N=at.BLOCK_N, DOT_PRECISION="tf32",
                                     DOT_F32=False), ints64=("stream_key",), fp32=("scale_log2",))
bp = {{n: i64 for n in ("start_ptr", "end_ptr", "len_ptr", "top_ptr", "tc_ptr", "base_ptr", "bc_ptr", "ns_ptr",
                       "bi_ptr", "cnt_ptr", "pages_ptr", "pcnt_ptr", "idx_ptr", "nb_ptr")}}
bp.update(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", part_ptr="*fp64", out_ptr="*fp64",
          scale_ptr="*fp64", b_ptr="*fp64", c_ptr="*fp64", rate_ptr="*fp64", w_ptr="*fp64", excl_ptr="*i8")
bp.update(len_ptr="*i32", lens_ptr="*i32", l_ptr="*fp32")
for full, kept, block in ((False, False, 32), (True, False, 32), (True, True, 32), (True, True, 64)):
    compile_(bt._budget_parts_kernel, bp, dict(FULL=full, KEPT=kept, BLOCK=block, D=128, W=8 + 256 * full),
             num_warps=block // 8)
for full in (False, True):
    for rule in (0, 1, 2, 3):
        compile_(bt._budget_combine_kernel, bp, dict(FULL=full, SP=32, D=128, W=8 + 256 * full, RULE=rule, GP=32,
                                                     FLOOR_BASE=rule == 3))
for has_top, pp in ((True, 16), (True, 1), (False, 1)):
    compile_(bt._residual_setup_kernel, bp, dict(HAS_TOP=has_top, PP=pp, CH=64, BLOCK=1024))
lp = dict(q_ptr="*bf16", proj_ptr="*fp32", qc_ptr=i64, count_ptr="*i32", codes_ptr="*i32", len_ptr="*i32",
          excl_ptr="*i8", k_ptr="*bf16", mean_ptr="*fp32", idx_ptr=i64, cnt_ptr=i64, dot_ptr="*fp32", knorm_ptr="*fp32")
compile_(lt._query_codes_kernel, lp, dict(MIPS=True, D=128, KP=16, LP=16))
compile_(lt._retrieve_kernel, lp, dict(G=4, BLOCK=64, LP=16))
compile_(lt._key_dots_kernel, lp, dict(CENTER=False, BLOCK=32, D=128))
from kvsieve.kernels.oracle_topp import topp_triton as tt
tp = {{n: "*fp32" for n in ("s_ptr", "pm_ptr", "pl_ptr", "p_ptr", "sum_ptr", "hist_ptr", "goal_ptr")}}
tp.update(lens_ptr="*i32", pre_ptr="*i32", cnt_ptr="*i32", idx_ptr="*i32", out_cnt_ptr="*i32",
          top_p="fp32")  # a Python float launches as fp32
for stage in range(4):
    for g, res in ((1, False), (4, True)):
        compile_(tt._topp_pass_kernel, tp, dict(STAGE=stage, G=g, BLOCK_G=max(2, g), RESIDUAL=res, BINS=16, BLOCK_S=32,
                                                BLOCK_X=512, BLOCK_PART=max(64, 2048 // max(2, g))))
print("COMPILED")
"""


@pytest.mark.triton
def test_split_sampling_kernels_compile_for_the_h100():
    """The interpreter does not type-check branches; compiling for sm_90 (no GPU needed) does: the split
    sample scan, the windowed cut, the budget statistics' two launches (both bounds), vAttention's attention pass,
    MagicPIG's retrieval and dots, and oracle-topp's select passes (every stage)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    from interpreted import ROOT

    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", COMPILE_FOR_H100.format()], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    assert res.returncode == 0 and "COMPILED" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


@pytest.mark.triton
def test_lsh_codes_are_kept_incrementally():
    """MagicPIG's kernel-path codes: only new keys are hashed, every key of a row again where the MIPS
    bound grew, and the codes equal the reference's hashing of the valid keys."""
    pytest.importorskip("triton")
    assert "OK" in run_script(LSH, "cpu", True)


@pytest.mark.triton
def test_sample_kernel_draws_the_references_sample():
    """The one-launch sample (hashes in registers, prefilter, bisection) picks the set the references'
    ``uniform_sample`` picks from the same row streams, and the fused row words equal ``core.rng``'s."""
    pytest.importorskip("triton")
    assert "OK" in run_script(SAMPLE, "cpu", True)


TOPP = """
import itertools
import torch
from kvsieve.kernels.oracle_topp.topp_triton import topp_select
from kvsieve.methods.oracle_topp import topp_reference

device = "{device}"


def as_mask(idx, counts, n):
    b, h, m = idx.shape
    used = torch.arange(m, device=idx.device) < counts[..., None].long()
    out = torch.zeros(b, h, n + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(2, torch.where(used, idx.long(), n), True)
    return out[..., :n], used


def near_tie(got, ref, probs, target):
    # float32 masses against the reference's float64: only a set that is the reference's plus or minus
    # keys at the boundary, where the cumulative mass is within float32 rounding of the target, may differ
    small, big = (got, ref) if int(got.sum()) <= int(ref.sum()) else (ref, got)
    if bool((small & ~big).any()):
        return False
    return abs(float((probs * small).sum()) - float(target)) < 1e-5 * max(1.0, float(probs.sum()))


checked = ties = 0
# each axis covered, not their product (the interpreter runs ~11 launches per call): N (none a multiple
# of the 512-key chunks) with programs per row; Hq, Hkv, share_kv_group (groups of 4, and of 1 head)
shapes = [((300, 1), (8, 2, False)), ((1000, 3), (8, 2, True)), ((2500, 5), (4, 1, True)), ((700, 2), (8, 2, False))]
settings = list(itertools.product([torch.float32, torch.bfloat16], [0.5, 0.9, 0.99, 1.0], ["total", "residual"]))
# two settings per shape: over the eight cases each dtype, top_p, mass mode and sink/window choice runs
cases = [(shape, hs, *settings[(3 * j + 5 * r) % len(settings)])
         for j, (shape, hs) in enumerate(shapes) for r in range(2)]
for axis in range(3):
    assert {{c[2 + axis] for c in cases}} == {{s[axis] for s in settings}}, axis
for i, ((n, segs), (hq, hkv, share), dtype, p, mass) in enumerate(cases):
    g = torch.Generator().manual_seed(i)
    q = (torch.randn(2, hq, 64, generator=g) * (3 if i % 2 else 1)).to(device, dtype)
    k = torch.randn(2, hkv, n, 64, generator=g).to(device, dtype)
    lens = torch.tensor([n, 1 + i * 37 % (n - 1)], device=device, dtype=torch.int32)  # ragged
    sink, window = (4, 8) if i % 2 else (0, 0)
    kw = dict(sink=sink, window=window, top_p=p, mass=mass, share_kv_group=share)
    idx, counts = topp_select(q, k, lens, segments=segs, **kw)
    got, used = as_mask(idx, counts, n)
    lists = torch.where(used, idx.long(), n)
    assert bool((lists[..., 1:] > lists[..., :-1])[used[..., 1:]].all()), "ascending, distinct"
    ref = topp_reference(q, k, lens, **kw)
    if not torch.equal(got, ref):
        # the reference's float64 probabilities and target, to tell a near-tie from a wrong set
        from kvsieve.kernels.shared.scores import candidate_mask, scores_reference
        pr = torch.softmax(scores_reference(q, k, lens).double(), -1)
        if share:
            pr = pr.view(2, hkv, hq // hkv, n).sum(2) / (hq // hkv)
        pr = pr * candidate_mask(lens, n, 1, sink, window)[:, None, :]
        rest = pr.sum(-1)
        tgt = (rest - (1 - p)).clamp(min=0) if mass == "total" else p * rest
        for bh in zip(*torch.nonzero((got != ref).any(-1), as_tuple=True)):
            assert near_tie(got[bh], ref[bh], pr[bh], tgt[bh]), (n, segs, hq, hkv, share, dtype, p, mass, bh)
            ties += 1
    again = topp_select(q, k, lens, segments=segs, **kw)
    assert torch.equal(again[1], counts) and torch.equal(as_mask(*again, n)[0], got), "deterministic"
    checked += 1
if device == "cuda":  # Llama-3.1-8B heads at 128k keys, the default programs per row
    for share, p in ((False, 0.9), (True, 0.9), (False, 0.5)):
        g = torch.Generator(device=device).manual_seed(3)
        q = torch.randn(1, 32, 128, generator=g, device=device, dtype=torch.bfloat16) * 2
        k = torch.randn(1, 8, 131072, 128, generator=g, device=device, dtype=torch.bfloat16)
        lens = torch.tensor([131072 - 5], device=device, dtype=torch.int32)
        kw = dict(sink=128, window=128, top_p=p, mass="total", share_kv_group=share)
        idx, counts = topp_select(q, k, lens, **kw)
        got = as_mask(idx, counts, 131072)[0]
        ref = topp_reference(q, k, lens, **kw)
        diff = int((got != ref).sum())
        print("128k", share, p, "keys", int(counts.sum()), "differ", diff)
        assert diff <= 2 * got.shape[1], diff  # at most a near-tie key or two per row
print("CHECKED", checked, "NEAR_TIES", ties)
print("OK")
"""


@pytest.mark.triton
def test_device_topp_selection_equals_the_reference_set_under_the_interpreter():
    """oracle-topp's device selection (scores launch, radix select by mass split over programs, count and
    emit) lists the reference's top-p set: several N and programs per row, groups of 1 and 4 (and KV
    heads of one query head), float32/bf16, top_p 0.5 to 1, both mass modes, ragged rows."""
    pytest.importorskip("triton")
    out = run_script(TOPP, "cpu", True)
    assert "OK" in out, out[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_topp_selection_equals_the_reference_set_on_the_gpu():
    """The same cases compiled for the GPU, plus Llama heads at 128k keys with the default split."""
    out = run_script(TOPP, "cuda", False)
    assert "OK" in out, out[-2000:]
    print(out[-1500:])


@pytest.mark.triton
@pytest.mark.parametrize("group", SPEC_GROUPS)
def test_kernel_paths_select_and_estimate_as_their_references_under_the_interpreter(group):
    pytest.importorskip("triton")
    specs, loops = SPEC_GROUPS[group]["specs"], SPEC_GROUPS[group]["loops"]
    out = run_script(CASES, "cpu", True, specs=specs, loops=loops)
    assert "OK" in out and f"CALLS {3 * len(specs)} " in out, out[-2000:]


@pytest.mark.triton
def test_triton_backend_says_why_it_cannot_serve():
    pytest.importorskip("triton")
    assert "OK" in run_script(ERRORS, "cpu", True)


BENCH = """
import importlib.util
from types import SimpleNamespace
import torch

spec = importlib.util.spec_from_file_location("sampling_bench", "benchmarks/sparse_decode/sampling.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
assert bench.parse_args(["out", "--iters", "20"]).iters == 20
g = torch.Generator().manual_seed(0)
n = 1024
x = SimpleNamespace(q=torch.randn(1, 8, 64, generator=g), k=torch.randn(1, 2, n, 64, generator=g),
                    v=torch.randn(1, 2, n, 64, generator=g), lens=torch.tensor([n - 5], dtype=torch.int32))
step = torch.zeros((), dtype=torch.int64)
for name, s in bench.method_specs(n, 0.2).items():
    c = bench.method_calls(s + ",sink=16,window=16", x, step)
    out = c["call"]()  # the reference on the CPU (auto)
    assert bench.rel_error(c["attend"](), out) < 1e-5, name  # the kernel alone on the same selection
    assert bench.rel_error(c["reference"](), out) == 0, name
    assert c["select"]().shape[:2] == (1, 8), name
print("OK")
"""


@pytest.mark.triton
def test_benchmark_calls_run_and_agree():
    """The GPU benchmark's calls on tiny CPU inputs: its attention-only call (the kernel on the method's
    selection) computes what the method computes."""
    pytest.importorskip("triton")
    assert "OK" in run_script(BENCH, "cpu", True)


def test_stats_of_the_kernel_path_are_deferred(monkeypatch):
    """A kernel-path call whose stats nobody reads builds none: the selection and the kernel run, the
    stats' marks and sums only on read (the kernel is stubbed, so this runs on any machine)."""
    import kvsieve
    from kvsieve.kernels.shared import weighted_triton
    from kvsieve.methods.shared import staged

    seen = {}

    def fake_kernel(q, k, v, idx, counts, weights, **kw):
        seen.update(idx=idx, counts=counts, weights=weights, **kw)
        return torch.zeros_like(q), torch.zeros(q.shape[:2])

    monkeypatch.setattr(staged, "sparse_unsupported", lambda inputs: None)
    monkeypatch.setattr(weighted_triton, "sparse_decode_triton", fake_kernel)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 64, generator=g), torch.randn(2, 2, 120, 64, generator=g), torch.randn(
        2, 2, 120, 64, generator=g)
    lens = torch.tensor([120, 70])
    _, st = kvsieve.method("vattention:sink=4,window=6,top_k=8,backend=triton").decode(q, k, v, lengths=lens, seed=3)
    assert st.backend == "triton" and st._pending is not None  # nothing built yet
    assert seen["sink"] == 4 and seen["window"] == 6 and torch.equal(seen["lengths"], lens.to(torch.int32))
    # the list holds no sink or window key: those are the kernel's ranges
    used = torch.arange(seen["idx"].shape[-1]) < seen["counts"][..., None]
    pos = torch.where(used, seen["idx"], 50)
    tail = (lens - 6)[:, None, None]
    assert bool(((pos >= 4) & (pos < tail)).all())
    _, ref = kvsieve.method("vattention:sink=4,window=6,top_k=8,backend=reference").decode(q, k, v, lengths=lens,
                                                                                          seed=3)
    assert st.density == ref.density and st["budget"] == ref["budget"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group", SPEC_GROUPS)
def test_kernel_paths_match_their_references_on_the_gpu(group):
    """auto picks the kernel on CUDA; same cases as the interpreter test (fp32 dots may run as tf32); one
    process per group, so that ``-k`` runs one method's cases only."""
    specs, loops = SPEC_GROUPS[group]["specs"], SPEC_GROUPS[group]["loops"]
    out = run_script(CASES, "cuda", False, specs=specs, loops=loops)
    assert "OK" in out and f"CALLS {3 * len(specs)} " in out, out[-2000:]


GPU_SPECS = ["random:budget=0.05", "random:budget=0.05,replacement=True,share_kv_group=True",
             "oracle-topp:top_p=0.9", "magicpig:bits=8,tables=16,budget=0.05",
             "vattention:top_k=0.025,base_rate=0.025", "vattention:predictor=quest,top_k=0.025,bound=denominator"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", GPU_SPECS)
def test_gpu_kernel_paths_do_not_sync_and_replay_in_a_graph(spec):
    """Llama-3.1-8B heads (32/8, d 128, bf16) at 8k keys, ragged batch of 2: the default path is the
    kernel, reads nothing on the host, and a captured call replays what eager calls compute at each new
    step counter and length."""
    import kvsieve
    from kvsieve.core.rng import RandomKey

    g = torch.Generator(device="cuda").manual_seed(0)
    b, n = 2, 8192
    q = torch.randn(b, 32, 128, generator=g, device="cuda", dtype=torch.bfloat16) * 2
    k = torch.randn(b, 8, n, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, 8, n, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([n - 3, 5000], device="cuda")
    m = kvsieve.method(spec)
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    key = RandomKey(3, (0, step))
    state = m.new_state()
    out, stats = m.decode(q, k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    ref, ref_stats = kvsieve.method(spec + ",backend=reference").decode(q, k, v, lengths=lengths, seed=key)
    assert stats.backend == "triton" and ref_stats.backend == "reference"
    assert stats.density == ref_stats.density
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 1.2e-2
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.decode(q, k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        m.decode(q, k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = m.decode(q, k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    replays = []
    # Step by step, each replay then its eager twin: state a method keeps across steps (magicpig's codes
    # and norm bound, vattention's page summaries) is then the same for both calls of a step.
    for i in range(3):
        step.fill_(i + 1)
        lengths[0] = n - 2 + i
        graph.replay()
        replays.append(captured.clone())
        lens_i = torch.tensor([n - 2 + i, 5000], device="cuda")
        eager, _ = m.decode(q, k, v, lengths=lens_i, seed=RandomKey(3, (0, torch.tensor(i + 1, device="cuda"))),
                            state=state, check_finite=False)
        torch.testing.assert_close(replays[i], eager, rtol=0, atol=0)
    if m.stochastic:
        assert not torch.equal(replays[0], replays[1])  # fresh draws per replayed step
