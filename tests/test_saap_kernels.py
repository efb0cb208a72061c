"""SAAP's Triton kernels against their references (interpreter, CUDA), their sm_90 compiles, a decode's launches."""

from __future__ import annotations

import pytest
import torch
from saap_helpers import qkv

from kvsieve.kernels.saap.buckets import bucket_sparse_decode_reference, build_csr, list_width

TRITON_CASES = r"""
import torch, kvsieve
from kvsieve.kernels.saap.buckets import (build_csr, list_width, bucket_sparse_decode_reference,
                                            bucket_sparse_decode_triton)
g = torch.Generator().manual_seed(0)
worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
# one program per list, the default split, splits that leave programs empty; the merge fused into the
# kernel (ticket counter), and once as its own launch (the comparison path). Each case's four
# (dtype, dense range) runs take the next four launch settings in turn: over the six cases every
# (dtype, range, setting) triple runs at least once, at a tenth of the interpreter time of all of them.
# The cases run in two halves (PART, set before this script), one test each; the settings go on counting in the
# second half.
LAUNCHES = [(1, True), (None, True), (3, True), (40, True), (40, False)]
SHAPES = [(2, 8, 2, 16, 300, 12, 5), (1, 3, 3, 32, 200, 6, 0), (1, 4, 1, 16, 150, 8, 8),
          (2, 6, 2, 32, 97, 5, 3), (1, 8, 2, 16, 260, 40, 17), (1, 4, 2, 32, 130, 7, 7)]
case = 12 * PART
for (b, hq, hkv, d, n, c, probes) in SHAPES[3 * PART:3 * PART + 3]:
    assign = torch.randint(0, c + 1, (b, hkv, n), generator=g)
    assign[0, 0, assign[0, 0] == 2] = 3  # bucket 2 empty in one list
    assign[..., 10:80] = 1  # a bucket longer than a block, not a multiple of it
    assign[..., 5] = 0
    assign[0, -1, assign[0, -1] == 4] = 0
    assign[0, -1, 7] = 4  # a bucket of one key
    assign[..., 0] = c
    offsets, ids = build_csr(assign, c)
    bk = torch.stack([torch.randperm(c, generator=g)[:probes] for _ in range(b * hkv)]).view(b, hkv, probes)
    if probes:
        bk[0, 0, 0] = 2
        bk[0, -1, -1] = 4
    dense = torch.arange(n - 40, n).expand(b, hkv, -1).contiguous()
    dc = torch.full((b, hkv), 40)
    dc[0, 0] = 1
    w = list_width(offsets, probes)
    # keys added since the build: a range per batch row after the list (empty in the first row)
    lo = torch.full((b,), n - 45)
    hi = torch.full((b,), n - 41)
    hi[0] = lo[0] - 3
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(b, hq, d, generator=g).to(dtype)
        k, v = torch.randn(2, b, hkv, n, d, generator=g).to(dtype)
        for rng in (None, (lo, hi)):
            ref = bucket_sparse_decode_reference(q.float(), k.float(), v.float(), dense, dc, offsets, ids, bk, w,
                                                 dense_range=rng)
            splits, fused = LAUNCHES[case % len(LAUNCHES)]
            case += 1
            got = bucket_sparse_decode_triton(q, k, v, dense, dc, offsets, ids, bk, w, block_n=16,
                                              splits=splits, dense_range=rng, fused_merge=fused)
            assert torch.equal(ref[2], got[2]), (ref[2], got[2])
            assert got[0].dtype == dtype
            worst[dtype] = max(worst[dtype], float((ref[0] - got[0].float()).abs().max()),
                               float((ref[1] - got[1]).abs().max()))
    # One dense list shared by the KV heads, read through a head stride of 0 (as SAAP passes it).
    q = torch.randn(b, hq, d, generator=g)
    k, v = torch.randn(2, b, hkv, n, d, generator=g)
    shared, shared_counts = dense[:, :1].expand(b, hkv, -1), dc[:, :1].expand(b, hkv)
    ref = bucket_sparse_decode_reference(q, k, v, shared.contiguous(), shared_counts.contiguous(), offsets, ids,
                                         bk, w, dense_range=(lo, hi))
    got = bucket_sparse_decode_triton(q, k, v, shared, shared_counts, offsets, ids, bk, w, block_n=16,
                                      dense_range=(lo, hi))
    assert torch.equal(ref[2], got[2])
    worst[torch.float32] = max(worst[torch.float32], float((ref[0] - got[0]).abs().max()),
                               float((ref[1] - got[1]).abs().max()))
from kvsieve.kernels.shared.triton_utils import _WORKSPACE
tickets = [t for key, t in _WORKSPACE.items() if key[0] == "bucket_ticket"]
assert tickets and all(not t.any() for t in tickets)  # the fused merge leaves its counters at 0
assert case == 12 * PART + 12, case
print("worst", worst[torch.float32], worst[torch.bfloat16])
"""


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1])
def test_triton_bucket_kernel_matches_the_reference(part):
    """Bucket sizes 0, 1 and longer than a block (not a multiple of it), GQA groups 1-4, ℓ from 0 to 17,
    float32 and bfloat16, with and without a dense range (empty in one row), 1 to 40 programs per list,
    under the interpreter (chosen before triton is imported, hence the subprocess)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    res = subprocess.run([sys.executable, "-c", f"PART = {part}\n" + TRITON_CASES], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    worst32, worst16 = (float(x) for x in res.stdout.split("worst")[-1].split())
    assert worst32 < 1e-5  # float32 sums of <= 300 terms in another order
    assert worst16 < 2e-2  # bfloat16 output and probabilities (the kernel's P·V) against a float32 reference


@pytest.mark.gpu
def test_bucket_decode_on_cuda_matches_the_float64_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    c, n = 64, 5000
    g = torch.Generator().manual_seed(12)
    assign = torch.randint(0, c + 1, (2, 4, n), generator=g)
    offsets, ids = build_csr(assign, c)
    buckets = torch.stack([torch.randperm(c, generator=g)[:7] for _ in range(8)]).view(2, 4, 7)
    dense = torch.arange(n - 300, n).expand(2, 4, -1).contiguous()
    q, k, v = qkv(2, 16, 4, n, d=128, seed=13)
    width = list_width(offsets, 7)
    ref, lse_ref, _ = bucket_sparse_decode_reference(q, k, v, dense, torch.full((2, 4), 300), offsets, ids, buckets,
                                                     width)
    from kvsieve.kernels.saap.buckets import bucket_sparse_decode, bucket_sparse_decode_triton

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        cuda = [t.cuda() for t in (q.to(dtype), k.to(dtype), v.to(dtype), dense, torch.full((2, 4), 300), offsets,
                                   ids, buckets)]
        for run in (bucket_sparse_decode, bucket_sparse_decode_triton):
            out, lse, _ = run(*cuda, width)
            assert torch.allclose(out.double().cpu(), ref, atol=tol, rtol=tol)
            assert torch.allclose(lse.double().cpu(), lse_ref, atol=tol, rtol=tol)


COMPILE_FOR_H100 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvsieve.kernels.saap import probe
from kvsieve.kernels.saap import buckets
from kvsieve.kernels.saap import index


def compile_(kernel, pointers, meta, floats=(), warps=4):
    signature, constexprs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in meta:
            signature[name], constexprs[(i,)] = "constexpr", meta[name]
        else:
            signature[name] = pointers.get(name, "fp32" if name in floats else "i32")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs={})
    print("shared", triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).metadata.shared)


# Every constexpr combination the launcher makes, as it makes them: SAAP's sliding window and the keys that
# joined their buckets after the build (HAS_TAIL, the runtime's path) and the plain and ranged modes, the fused
# and the separate merge, each dtype (float32 takes IEEE dots), head dims 64 and 128, groups of 1 to 8 query heads
# and up to 64 probes. Triton 3.6's layout pass rejected the tail scan while 3.9 compiled it.
from kvsieve.kernels.shared.triton_utils import dot_precision, next_pow2
import torch
dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bucket_case(mode, fused, dtype, d, group, n_probe, splits=48, ahead=False):
    group_p = max(2, next_pow2(group))
    pointers = {"q_ptr": "*" + dtype, "k_ptr": "*" + dtype, "v_ptr": "*" + dtype, "out_ptr": "*" + dtype,
                "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "lse_ptr": "*fp32",
                "dense_ptr": "*i64", "dense_cnt_ptr": "*i64", "lo_ptr": "*i64", "hi_ptr": "*i64", "off_ptr": "*i64",
                "ids_ptr": "*i64", "bkt_ptr": "*i64", "counts_ptr": "*i64", "sem_ptr": "*i32" if fused else "*i64",
                "tail_lo_ptr": "*i64", "assign_ptr": "*i64", "cent_ptr": "*fp32", "freq_ptr": "*fp32"}
    meta = {"GROUP": group, "BLOCK_G": max(16, next_pow2(group)), "BLOCK_N": 64, "D": d, "DV": d,
            "BLOCK_L": max(16, next_pow2(n_probe)), "SPLITS": splits, "HAS_RANGE": mode == "range",
            "HAS_TAIL": mode == "tail", "DOT_PRECISION": dot_precision(dtypes[dtype]), "DOT_F32": False,
            "FUSED_MERGE": fused, "GROUP_P": group_p, "BLOCK_S": max(16, next_pow2(splits)),
            "MERGE_S": max(1, min(32 // group_p, next_pow2(splits))), "AHEAD": index.UPDATE_SPAN if ahead else 0,
            "A_HALF": d // 2, "A_BLOCK_C": index.AHEAD_BLOCK_C, "A_DEROPE": True}
    compile_(buckets._bucket_parts_kernel, pointers, meta, floats=("scale", "a_scaling"))


shapes = {("bf16", 128): (4, 32), ("fp16", 128): (8, 64), ("fp32", 128): (1, 7),
          ("bf16", 64): (2, 16), ("fp16", 64): (4, 20), ("fp32", 64): (8, 32)}
# PART (set before this script) picks the runtime's combination and the other kernels, or the other combinations
for mode in ("tail", "range", "none"):
    for fused in (True, False):
        for (dtype, d), (group, n_probe) in shapes.items():
            if mode == "tail" or (dtype, d) in (("bf16", 128), ("fp32", 64)):
                # the runtime's: both merges (the fused one at batch 8, the separate launch at batch 1)
                if ((mode, dtype, d) == ("tail", "bf16", 128)) == (PART == "runtime"):
                    bucket_case(mode, fused, dtype, d, group, n_probe)
if PART != "runtime":
    raise SystemExit(0)
# index_update=ahead: the update one step ahead as the first programs of the runtime's launch (with the separate
# merge at batch 1, 48 programs a row; the fused one at batch 8, 6 a row) and alone
bucket_case("tail", False, "bf16", 128, 4, 32, ahead=True)
bucket_case("tail", True, "bf16", 128, 4, 32, splits=6, ahead=True)
compile_(index._assign_ahead_kernel, {"k_ptr": "*bf16", "cent_ptr": "*fp32", "freq_ptr": "*fp32", "assign_ptr": "*i64",
                                      "t_lo_ptr": "*i64", "len_ptr": "*i32", "win_ptr": "*i64"},
         {"D": 128, "HALF": 64, "BLOCK_C": index.AHEAD_BLOCK_C, "DEROPE": True},
         floats=("scaling",))
compile_(index._assign_tail_kernel, {"k_ptr": "*bf16", "cent_ptr": "*fp32", "freq_ptr": "*fp32", "assign_ptr": "*i64",
                                     "t_lo_ptr": "*i64", "len_ptr": "*i32", "win_ptr": "*i64"},
         {"D": 128, "HALF": 64, "BLOCK_C": 128, "DEROPE": True}, floats=("scaling",))
# the probe at Llama-3.1-8B shapes: bfloat16 weights (three-term tensor-core products), the logits in four
# parts, the top-l of 1024 scores by rank, 32 buckets a program
# the hidden layer alone, and with the index update's work items in the same launch (the method's path)
hidden_pointers = {"q_ptr": "*bf16", "pos_ptr": "*i32", "freq_ptr": "*fp32", "w1_ptr": "*bf16", "b1_ptr": "*fp32",
                   "h_ptr": "*fp32", "tk_ptr": "*bf16", "tc_ptr": "*fp32", "tf_ptr": "*fp32", "ta_ptr": "*i64",
                   "tlo_ptr": "*i64", "tlen_ptr": "*i32", "twin_ptr": "*i64"}
for tail in (False, True):
    compile_(probe._hidden_kernel, hidden_pointers,
             {"HALF": 64, "HALF_P": 64, "BLOCK_R": probe.HIDDEN_TILE_R, "BLOCK_H": probe.HIDDEN_TILE_H, "TAIL": tail,
              "T_D": 128, "T_HALF": 64, "T_BLOCK_C": probe.TAIL_BLOCK_C, "T_DEROPE": True},
             floats=("scaling", "t_scaling"), warps=probe.TAIL_WARPS if tail else 4)
compile_(probe._logits_kernel, {"h_ptr": "*fp32", "w2_ptr": "*bf16", "b2_ptr": "*fp32", "out_ptr": "*fp32"},
         {"BLOCK_R": 16, "BLOCK_K": 32, "BLOCK_C": 64, "W_BF16": True, "DOT_F32": False})
rank_pointers = {"logits_ptr": "*fp32", "out_ptr": "*fp32", "top_ptr": "*i64", "rps_ptr": "*fp32", "rpi_ptr": "*i32",
                 "rassign_ptr": "*i64", "rlo_ptr": "*i64", "rlen_ptr": "*i32", "rwin_ptr": "*i64"}
# the rank launch alone (batch > 1: the serial update) and with the parallel update's second stage (batch 1)
for tail in (False, True):
    compile_(probe._group_rank_kernel, rank_pointers, {"GROUP": 4, "BLOCK_C": 1024, "CHUNK": 32, "SUB": 32, "PARTS": 4,
                                                       "TOP": True, "TAIL": tail, "R_BLOCKS_P": 16})
# at batch 1 the hidden layer with the parallel update's first stage; and the parallel update in launches of its
# own (probes = 0, the k-means baselines)
compile_(probe._hidden_partial_kernel,
         {"q_ptr": "*bf16", "pos_ptr": "*i32", "freq_ptr": "*fp32", "w1_ptr": "*bf16", "b1_ptr": "*fp32",
          "h_ptr": "*fp32", "tk_ptr": "*bf16", "tc_ptr": "*fp32", "tf_ptr": "*fp32", "tps_ptr": "*fp32",
          "tpi_ptr": "*i32", "tlo_ptr": "*i64", "tlen_ptr": "*i32", "twin_ptr": "*i64"},
         {"HALF": 64, "HALF_P": 64, "BLOCK_R": probe.HIDDEN_TILE_R, "BLOCK_H": probe.HIDDEN_TILE_H, "T_D": 128,
          "T_HALF": 64, "T_BLOCK_C": index.PARALLEL_BLOCK_C, "T_BLOCK_R": 16, "T_DEROPE": True},
         floats=("scaling", "t_scaling"))
update_pointers = {"k_ptr": "*bf16", "cent_ptr": "*fp32", "freq_ptr": "*fp32", "ps_ptr": "*fp32", "pi_ptr": "*i32",
                   "assign_ptr": "*i64", "t_lo_ptr": "*i64", "len_ptr": "*i32", "win_ptr": "*i64"}
compile_(index._assign_partial_kernel, update_pointers,
         {"D": 128, "HALF": 64, "BLOCK_C": index.PARALLEL_BLOCK_C, "BLOCK_R": index.PARALLEL_BLOCK_R, "DEROPE": True},
         floats=("scaling",))
compile_(index._assign_reduce_kernel, update_pointers, {"BLOCKS_P": 16}, warps=1)
"""


def test_bucket_kernel_refuses_bad_splits():
    pytest.importorskip("triton")
    from kvsieve.kernels.saap.buckets import bucket_sparse_decode_triton

    q, k, v = qkv(1, 4, 2, 50, dtype=torch.float32)
    offsets, ids = build_csr(torch.zeros(1, 2, 50, dtype=torch.long), 4)
    dense, counts = torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)
    buckets = torch.zeros(1, 2, 1, dtype=torch.long)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="splits: expected an integer >= 1"):
            bucket_sparse_decode_triton(q, k, v, dense, counts, offsets, ids, buckets, splits=bad)


PROBE_CASES = r"""
import itertools
import tempfile
from pathlib import Path
import torch, kvsieve
from kvsieve.methods.saap import QueryClassifier
from kvsieve.kernels.saap import probe
from kvsieve.kernels.saap.probe import (derope_reference, fold_batchnorm, probe_scores_reference,
                                        probe_scores_triton, serve_weights, top_buckets_reference)
from tests.saap_helpers import write_artifacts
dev = "{device}"
g = torch.Generator().manual_seed(0)
worst = worst16 = 0.0


# (value, rank chunk) pairs: every pair on the GPU; under the interpreter (slow per launch) each value
# with the next chunk size in turn, so every value and every chunk size still runs.
def with_chunks(values, chunks):
    if dev != "cpu":
        return list(itertools.product(values, chunks))
    return [(value, chunks[i % len(chunks)]) for i, value in enumerate(values)]


# The kernels against their reference and against the unfolded module (one model per KV head or per query
# head; head dims whose half is below and above tl.dot's 16; hidden and bucket counts off the blocks).
# SHAPES and WITH_METHOD pick the part of the cases one test runs (the interpreter's is cut in two).
SHAPES = {shapes}
WITH_METHOD = {with_method}
for i, (b, hq, hkv, d, hidden, c, per_kv) in enumerate([(1, 8, 2, 32, 48, 40, True), (2, 6, 3, 16, 16, 8, False),
                                                        (2, 4, 1, 64, 100, 257, True), (3, 4, 4, 32, 64, 64, True)]):
    if i not in SHAPES:
        continue
    models = hkv if per_kv else hq
    net = QueryClassifier(models, d, hidden, c)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        net.norm.running_mean.copy_(torch.randn(net.norm.running_mean.shape, generator=g))
        net.norm.running_var.copy_(torch.rand(net.norm.running_var.shape, generator=g) + 0.5)
    net.eval()
    w = [t.to(dev) for t in fold_batchnorm(net.w1, net.b1, net.w2, net.b2, net.norm.running_mean,
                                           net.norm.running_var, net.norm.weight, net.norm.bias, net.norm.eps)]
    inv_freq = (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))).to(dev)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16).to(dev)
    pos = torch.randint(0, 5000, (b,), generator=g).to(dev)
    # The serve-time weights (bfloat16 W1', W2: three-term products in the logits kernel) against the
    # reference on the same rounded tensors; the positions given as lengths with the kernel's - 1.
    ws = serve_weights(*w)
    assert ws[0].dtype == ws[2].dtype == torch.bfloat16
    ref16 = probe_scores_reference(q, pos, inv_freq, 1.3, *ws, kv_heads=hkv)
    got16, top16 = probe_scores_triton(q, pos + 1, inv_freq, 1.3, *ws, kv_heads=hkv, probes=min(c, 5),
                                       position_offset=-1)
    assert torch.equal(top16, top_buckets_reference(got16, min(c, 5)))
    assert torch.equal(top16.sort(-1).values, torch.topk(got16, min(c, 5), dim=-1).indices.sort(-1).values)
    worst16 = max(worst16, float((got16 - ref16).abs().max()))
    ref = probe_scores_reference(q, pos, inv_freq, 1.3, *w, kv_heads=hkv)
    got = probe_scores_triton(q, pos, inv_freq, 1.3, *w, kv_heads=hkv)
    # The in-kernel top-l (each bucket's rank against all C, no sort): torch.topk's set, best first (random
    # weights: no ties), every l up to C; chunks of 4 buckets a program to more than C (one chunk).
    for probes, chunk in with_chunks(sorted(set([1, 2, 3, c // 2, c - 1, c])), (4, 32, 1024)):
        probe.RANK_CHUNK = chunk
        scores, top = probe_scores_triton(q, pos, inv_freq, 1.3, *w, kv_heads=hkv, probes=probes)
        assert torch.equal(top.sort(-1).values, torch.topk(scores, probes, dim=-1).indices.sort(-1).values)
        assert torch.equal(top, top_buckets_reference(scores, probes)), (c, probes, chunk)
        assert torch.equal(scores, got)
    probe.RANK_CHUNK = 32
    # Ties: W2 columns and biases copied from 3 buckets (equal logits, bit-equal scores), and logits
    # scaled up so that most probabilities underflow to 0 (a tie at the threshold 0): the lowest indices.
    src = torch.randint(0, 3, (c,), generator=g).to(dev)
    for gain in (1.0, 300.0):
        wt = (w[0], w[1], (w[2][..., src] * gain).contiguous(), (w[3][..., src] * gain).contiguous())
        for probes, chunk in with_chunks(sorted(set([1, 2, 3, 4, c // 3, c // 2, c - 1, c])), (4, 32, 128)):
            probe.RANK_CHUNK = chunk  # tied buckets in one chunk and across chunks
            scores, top = probe_scores_triton(q, pos, inv_freq, 1.3, *wt, kv_heads=hkv, probes=probes)
            ties = (scores[..., :, None] == scores[..., None, :]).sum() > scores.numel()
            assert ties and torch.equal(top, top_buckets_reference(scores, probes)), (c, probes, gain, chunk)
            assert torch.equal(scores.gather(-1, top).sort(-1).values,
                               torch.topk(scores, probes, dim=-1).values.sort(-1).values)
        probe.RANK_CHUNK = 32
        zeros = int((scores == 0).sum()) if gain > 1 else 0
        assert gain == 1 or zeros > 0 or c < 16, "the large gain gives probabilities of 0"
    x = derope_reference(q, pos, inv_freq, 1.3).cpu()
    xm = x.view(b, models, hq // models, d).permute(1, 0, 2, 3).reshape(models, -1, d)
    with torch.no_grad():
        pr = torch.softmax(net(xm), -1).view(models, b, hq // models, c).permute(1, 0, 2, 3).reshape(b, hq, c)
    module = pr.view(b, hkv, hq // hkv, c).sum(2)
    assert got.shape == (b, hkv, c)
    worst = max(worst, float((got - ref).abs().max()), float((module - ref.cpu()).abs().max()))
if not WITH_METHOD:
    print("worst16", worst16)
    print("WORST", worst)
    raise SystemExit(0)
# The kernels' de-rope is the method's (Rope.invert) with a non-trivial attention scaling.
from kvsieve.methods.saap import Rope
rope = Rope(1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32)), 1.3)
q = torch.randn(2, 4, 32, generator=g)
pos = torch.tensor([7, 3000])
inverted = rope.invert(q[:, :, None, :], pos[:, None, None])[:, :, 0]
worst = max(worst, float((derope_reference(q, pos, rope.inv_freq, 1.3) - inverted).abs().max()))
# The method: the Triton probe (with the update of the batch's rule) picks the reference path's buckets and gives
# its output.
from kvsieve import CallContext
for per in ("kv", "query"):
    folder = Path(tempfile.mkdtemp())
    write_artifacts(folder, heads=8, kv_heads=2, head_dim=32, layers=3, clusters=16, per=per)
    # (2 rows, 300 keys): 5 programs a row, the fused merge; (1 row, 600 keys): 10, the separate merge launch
    for b, n, merge in ((2, 300, "fused"), (1, 600, "separate launch")):
        q = torch.randn(b, 8, 32, generator=g).to(dev)
        k, v = torch.randn(2, b, 2, n, 32, generator=g).to(dev)
        lengths = torch.tensor([n, n - 50][:b], device=dev)
        spec = f"saap:artifacts={{folder}},probes=4,index_update=step"  # the batch's rule (ahead: test_saap_index)
        ctx = CallContext(layer=1)
        out_t, st_t = kvsieve.method(spec + ",backend=triton").decode(q, k, v, lengths=lengths, context=ctx)
        out_r, st_r = kvsieve.method(spec + ",backend=reference").decode(q, k, v, lengths=lengths, context=ctx)
        assert st_t["probe"] == "triton" and st_t.backend == "triton", (st_t.backend, st_t["probe"])
        assert st_t["update"] == ("parallel" if b == 1 else "serial") and st_r["update"] == "reference"
        assert st_t["merge"] == merge, st_t["merge"]
        assert st_t["bucket_keys"] == st_r["bucket_keys"] and st_t["selectivity"] == st_r["selectivity"]
        worst = max(worst, float((out_t.float() - out_r.float()).abs().max()))
print("worst16", worst16)
print("WORST", worst)
"""


@pytest.mark.triton
@pytest.mark.parametrize("shapes,with_method", [([2], False), ([0, 1, 3], True)])
def test_probe_kernels_match_the_reference_and_the_method_path(shapes, with_method):
    pytest.importorskip("triton")
    from interpreted import printed_worst, run_script

    out = run_script(PROBE_CASES, "cpu", interpret=True, shapes=shapes, with_method=with_method)
    assert printed_worst(out) < 1e-5
    assert float(out.split("worst16")[-1].split()[0]) < 1e-5  # the same rounded weights on both sides


@pytest.mark.gpu
def test_probe_kernels_on_cuda_match_the_reference():
    from interpreted import printed_worst, run_script

    out = run_script(PROBE_CASES, "cuda", interpret=False, shapes=[0, 1, 2, 3], with_method=True)
    assert printed_worst(out) < 1e-4  # libdevice cos/sin and fp32 sums in another order


@pytest.mark.triton
@pytest.mark.parametrize("part,compiled", [
    ("runtime", 14),
    # the other 18 combinations, one sm_90 compile each
    pytest.param("rest", 18, marks=pytest.mark.slow),
])
def test_triton_bucket_kernel_compiles_for_the_h100(part, compiled):
    """The interpreter does not type-check branches; compiling for sm_90 here (no GPU needed) does, under the
    installed Triton: the bucket kernel in every constexpr combination its launcher makes (the runtime's, with
    keys that joined their buckets, either merge, bfloat16 and head dim 128, by default; the rest under
    ``slow``), the index update and the probe's kernels (bfloat16 weights, the top-l by rank over 1024 scores)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", f"PART = {part!r}\n" + COMPILE_FOR_H100], capture_output=True,
                         text=True, env=env)
    if "ptxas" in res.stderr and "not found" in res.stderr:
        pytest.skip("this triton install has no ptxas")
    assert res.returncode == 0 and res.stdout.count("shared") == compiled, res.stderr[-3000:]


# What SAAP's captured decode launches per call on the kernel path: the probe's three kernels (the index update in
# the first, and at batch 1 its second stage in the rank launch), the bucket kernel, and no torch op (each would be
# a kernel launch and a graph node on the GPU).
SAAP_LAUNCHES = r"""
import tempfile
from pathlib import Path
import torch
import kvsieve
from kvsieve import CallContext
from tests.saap_helpers import write_artifacts
from tests.launch_log import Ops, log
folder = Path(tempfile.mkdtemp())
write_artifacts(folder, heads=8, kv_heads=2, head_dim=32, layers=3, clusters=16)
g = torch.Generator().manual_seed(0)
n = 300
q = torch.randn(2, 8, 32, generator=g).bfloat16()[:{batch}]
k, v = torch.randn(2, 2, 2, n + 2, 32, generator=g).bfloat16()[:, :{batch}]
m = kvsieve.method(f"saap:artifacts={{folder}},probes=4,window=63,window_scale=1.0,backend=triton,"
                   f"index_update={update}")
ref = kvsieve.method(f"saap:artifacts={{folder}},probes=4,window=63,window_scale=1.0,backend=reference")
state, ref_state = m.new_state(), ref.new_state()
from kvsieve.core.sync import no_host_reads
ctx, ref_ctx = CallContext(layer=1, capacity=n + 2), CallContext(layer=1)  # buffers sized once, as the runtime's
worst = 0.0
for step in range(3):  # the build, then two generated tokens: a key leaves each row's window per step
    lengths = torch.tensor([n + step, n - 20 + step])[:{batch}]
    kk, vv = k[:, :, : n + step], v[:, :, : n + step]
    log.clear()
    with Ops(), no_host_reads():  # what a GPU gets
        out, stats = m.decode(q, kk, vv, lengths=lengths, state=state, context=ctx, check_finite=False)
    print("CALL", " ".join(log))
    assert stats["update"] == "{expect}", stats["update"]
    ref_out, ref_stats = ref.decode(q, kk, vv, lengths=lengths, state=ref_state, context=ref_ctx, check_finite=False)
    assert out.dtype == torch.bfloat16
    assert stats["bucket_keys"] == ref_stats["bucket_keys"] and stats["dense_keys"] == ref_stats["dense_keys"]
    assert stats["selectivity"] == ref_stats["selectivity"], (stats["selectivity"], ref_stats["selectivity"])
    worst = max(worst, float((out.float() - ref_out.float()).abs().max()))
# layer 0 (exact attention): the dense split-KV kernel and its merge, as the runtime's dense layers
# (float32: the interpreter's bfloat16 tl.dot is wrong and this kernel has no upcast switch)
lengths32, q, kk, vv = lengths.int(), q.float(), kk.float(), vv.float()  # the runtime's int32 lengths
log.clear()
with Ops(), no_host_reads():
    out, stats = m.decode(q, kk, vv, lengths=lengths32, context=CallContext(layer=0), check_finite=False)
print("LAYER0", " ".join(log))
ref_out, ref_stats = ref.decode(q, kk, vv, lengths=lengths, context=CallContext(layer=0), check_finite=False)
assert stats.backend == "triton" and ref_stats.backend == "reference" and stats["density"] == ref_stats["density"] == 1
worst = max(worst, float((out.float() - ref_out.float()).abs().max()))
print("WORST", worst)
"""


@pytest.mark.triton
@pytest.mark.parametrize("batch,update,expect,first", [
    (2, "step", "serial", "triton:_hidden_kernel"), (1, "step", "parallel", "triton:_hidden_partial_kernel"),
    (1, "ahead", "ahead", "triton:_hidden_kernel")])
def test_captured_decode_launches_four_kernels_and_no_torch_op(batch, update, expect, first):
    """Per call, after the build, while keys leave the window and join their buckets: the probe's three kernels
    (with ``index_update=step`` the first also runs the index update's work: the serial update at batch 2, the
    parallel update's first stage at batch 1, whose second stage runs in the rank launch; with ``ahead``, the
    default, the bucket kernel runs it one step early) and the bucket kernel (the window's bounds computed from
    the lengths in the kernels; it merges its partials itself), nothing else (before: 12 launches, 7 of them torch
    glue: the positions' - 1, two torch.topk kernels on the main branch, the bucket counts' sub/gather/sum and two
    dtype copies of the output; then 5, the update apart). The output equals the reference path's (bfloat16
    rounding of the output aside). Layer 0 (exact) runs the dense split-KV kernel and its merge, the runtime's dense
    layers' two launches."""
    pytest.importorskip("triton")
    from interpreted import printed_worst, run_script

    out = run_script(SAAP_LAUNCHES, "cpu", True, batch=batch, update=update, expect=expect)
    calls = [line.split()[1:] for line in out.splitlines() if line.startswith("CALL")]
    assert len(calls) == 3
    for ops in calls[1:]:
        assert ops == [first, "triton:_logits_kernel", "triton:_group_rank_kernel", "triton:_bucket_parts_kernel"], ops
    layer0 = [line.split()[1:] for line in out.splitlines() if line.startswith("LAYER0")]
    assert layer0 == [["triton:_dense_split_kernel", "triton:_merge_partials_kernel"]], layer0
    assert printed_worst(out) < 2e-2  # bfloat16 outputs
