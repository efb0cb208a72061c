"""Sketch&Walk's GPU paths (``backend=triton``) against its reference path: the decode kernel path, a chunk of query
rows on it, the fused selection (state update, the walk, the chosen blocks) step by step, inside a model, and its
launches — under Triton's interpreter on the CPU and on the GPU (``-m gpu``). Each case is a script run in a
subprocess (``interpreted.run_script``)."""

import pytest
import torch
from interpreted import interpreter_and_gpu, printed_worst, run_script

# the worst relative error each place allows against the reference path (float32 under the interpreter)
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}

# -- the decode kernel path -------------------------------------------------------------------------------

KERNEL_DECODE = """
import torch
import kvsieve
from kvsieve import CallContext
from kvsieve.methods.sketchwalk import SketchWalkState, WalkState
device = "{device}"
gen = torch.Generator().manual_seed(3)
b, hq, hkv, d, bs, n0, steps = 2, 6, 2, 64, 16, 150, 5
layers = [[torch.randn(b, h, n0 + steps, d, generator=gen).to(device) for h in (hq, hkv, hkv)] for _ in range(3)]
outs = {{}}
for backend in ("triton", "reference"):
    m = kvsieve.method(f"sketchwalk:variant=reconstruction,block_size={{bs}},sketch_dim=32,density=0.3,"
                       f"dense_layers=0,backend={{backend}}")
    states = [SketchWalkState() for _ in layers]
    forward = WalkState()
    for (q, k, v), st in zip(layers, states):
        ctx = CallContext(forward=forward)
        m.prefill(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], scale=None, state=st, context=ctx, sparse=True)
    res = []
    for t in range(n0, n0 + steps):
        forward = WalkState()
        for (q, k, v), st in zip(layers, states):
            lengths = torch.tensor([t + 1, t - 20], device=device)  # ragged rows: row 1 is shorter
            ctx = CallContext(forward=forward)
            out, stats = m.decode(q[:, :, t], k[:, :, :t + 1], v[:, :, :t + 1], lengths=lengths, state=st, context=ctx)
            assert stats.backend == backend, stats.backend
            res.append((out, stats.kv_rows_read, stats.block_density))
    outs[backend] = res
worst = 0.0
for (a, ra, da), (r, rr, dr) in zip(outs["triton"], outs["reference"]):
    assert ra == rr and da == dr  # the same blocks
    worst = max(worst, float((a.double() - r.double()).norm() / r.double().norm()))
print("WORST", worst)
"""


@pytest.mark.parametrize("device", interpreter_and_gpu())
def test_decode_kernel_path_equals_the_reference_path(device):
    """backend=triton (the weighted sparse kernel with the blocks as pages, lengths masking the partial
    block) selects the same blocks and gives the reference path's outputs, ragged rows included."""
    pytest.importorskip("triton")
    assert printed_worst(run_script(KERNEL_DECODE, device, device == "cpu")) < TOLERANCE[device]


# A chunk of query rows on the kernel path: the torch selection of every row (the fused one serves one row
# per batch row), then the weighted sparse kernel reading the batch row's cache for its Q rows.
KERNEL_CHUNK = """
import torch
import kvsieve
from kvsieve import CallContext
from kvsieve.methods.sketchwalk import SketchWalkState, WalkState
device = "{device}"
gen = torch.Generator().manual_seed(4)
b, hq, hkv, d, bs, n0, q_len = 2, 6, 2, 64, 16, 150, 12
layers = [[torch.randn(b, h, n0 + q_len, d, generator=gen).to(device) for h in (hq, hkv, hkv)] for _ in range(2)]
outs = {{}}
for backend in ("triton", "reference"):
    spec = f"sketchwalk:variant=reconstruction,block_size={{bs}},sketch_dim=32,density=0.3,dense_layers=0"
    m = kvsieve.method(f"{{spec}},backend={{backend}}")
    # the context through the torch selection for both (the kernels' prefill state equals it to rounding only,
    # and this compares the chunk's walks bit for bit)
    states, forward = [SketchWalkState() for _ in layers], WalkState()
    for (q, k, v), st in zip(layers, states):
        ctx = CallContext(forward=forward)
        kvsieve.method(f"{{spec}},backend=reference").prefill(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], scale=None,
                                                              state=st, context=ctx, sparse=True)
    forward, res = WalkState(), []
    lengths = torch.tensor([n0 + q_len, n0 + q_len - 9], device=device)  # ragged rows
    for (q, k, v), st in zip(layers, states):
        out, stats = m.decode(q[:, :, n0:], k, v, lengths=lengths, state=st, context=CallContext(forward=forward))
        assert stats.backend == backend and stats.extra["selection"] == "reference", stats.extra
        res.append((out, stats.kv_rows_read, stats.block_density, forward.walk.clone()))
    outs[backend] = res
worst = 0.0
for (a, ra, da, wa), (r, rr, dr, wr) in zip(outs["triton"], outs["reference"]):
    assert ra == rr and da == dr and torch.equal(wa, wr)  # the same selection
    worst = max(worst, float((a.double() - r.double()).norm() / r.double().norm()))
print("WORST", worst)
"""


@pytest.mark.parametrize("device", interpreter_and_gpu())
def test_chunk_on_the_kernel_path_equals_the_reference_path(device):
    pytest.importorskip("triton")
    assert printed_worst(run_script(KERNEL_CHUNK, device, device == "cpu")) < TOLERANCE[device]


# The fused selection (kernels/sketchwalk/decode.py): the state update, the Ã rows, the walk and the chosen
# blocks of backend=triton against the reference path, step by step and layer by layer. Both attention
# calls are wrapped to record the blocks they read (sorted: the reference reads token lists).
FUSED_DECODE = """
import sys
import torch
import kvsieve
import kvsieve.kernels.sketchwalk.decode as sketch_decode
import kvsieve.kernels.shared.weighted_triton as wt
from kvsieve import CallContext
from kvsieve.methods.sketchwalk import SketchWalkState, WalkState
sw = sys.modules["kvsieve.methods.sketchwalk"]  # kvsieve.methods is also a function's name
device = "{device}"
CASES = [
    # ragged rows that each complete a block during the steps (at 160 and 144 keys); GQA 3
    dict(dtype=torch.float32, b=2, hq=6, hkv=2, d=64, n0=155, steps=6, short=(0, 17), layers=3,
         spec="block_size=16,sketch_dim=32,density=0.3"),
    # the paper's block and sketch sizes, head dim 128, bf16: a block completes at 768
    dict(dtype=torch.bfloat16, b=1, hq=8, hkv=2, d=128, n0=64 * 12 - 3, steps=5, short=(0,), layers=3,
         spec="density=0.25"),
    # fp16, no GQA, the diagonal-walk control with a fixed k; row 2 sits in its first block (c = 0)
    dict(dtype=torch.float16, b=3, hq=4, hkv=4, d=64, n0=200, steps=4, short=(0, 40, 195), layers=3,
         spec="block_size=16,sketch_dim=16,density=0.2,walk=diagonal,fixed_k=true"),
    # no prompt seen (fresh state, one-hop), 1/√m logits, α = 4, crossing into the second 64-block (row 0 at
    # 128 keys, row 1 from 64)
    dict(dtype=torch.float32, b=2, hq=4, hkv=2, d=64, n0=120, steps=10, short=(0, 57), layers=2, prefill=False,
         spec="density=0.5,walk=one-hop,logit_scale=sqrt_m,alpha=4"),
    # GQA 8, a sketch dim that is not a power of two, four walk layers
    dict(dtype=torch.bfloat16, b=2, hq=8, hkv=1, d=128, n0=300, steps=4, short=(0, 9), layers=4,
         spec="block_size=32,sketch_dim=48,density=0.4"),
    # 63-64 blocks over several column tiles and row splits of the walk's GEMV (its long-context tiling), and
    # the walk row in tiles of 32 (the select over memory of rows past 2048 blocks)
    dict(dtype=torch.float32, b=2, hq=4, hkv=2, d=64, n0=1005, steps=6, short=(0, 333), layers=3, tiles=(16, 16, 32),
         spec="block_size=16,sketch_dim=32,density=0.1,alpha=1"),
    # 261 blocks at ρ = 0.6: 157 blocks chosen of a row of 512 held in registers
    dict(dtype=torch.float32, b=1, hq=4, hkv=2, d=64, n0=16 * 260 + 14, steps=3, short=(0,), layers=2,
         spec="block_size=16,sketch_dim=16,density=0.6"),
]
seen = []
_kernel, _reference = wt.sparse_decode_triton, sw.weighted_sparse_decode


def kernel(q, k, v, pages, n_pages, **kw):
    rows = [pages[r, 0, :int(n_pages[r, 0])].tolist() for r in range(pages.shape[0])]
    assert all(row == sorted(row) and len(set(row)) == len(row) for row in rows), rows
    assert all(torch.equal(pages[:, 0], pages[:, h]) for h in range(pages.shape[1]))  # one list for all heads
    seen.append(rows)
    return _kernel(q, k, v, pages, n_pages, **kw)


def reference(q, k, v, idx, counts, w, **kw):
    seen.append([sorted({{t // BS for t in idx[r, 0, :int(counts[r, 0])].tolist()}}) for r in range(idx.shape[0])])
    return _reference(q, k, v, idx, counts, w, **kw)


wt.sparse_decode_triton, sw.weighted_sparse_decode = kernel, reference
select = sketch_decode.sketch_walk_select


def run(case, backend):
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, d, n0, steps = (case[x] for x in ("b", "hq", "hkv", "d", "n0", "steps"))
    layers = [[torch.randn(b, h, n0 + steps, d, generator=gen).to(device, case["dtype"]) for h in (hq, hkv, hkv)]
              for _ in range(case["layers"])]
    m = kvsieve.method(f"sketchwalk:variant=reconstruction,{{case['spec']}},backend={{backend}}")
    cols, rows, row_tile = case.get("tiles", (None, None, None))
    sketch_decode.sketch_walk_select = lambda *a, **kw: select(*a, tile_cols=cols, split_rows=rows, row_tile=row_tile,
                                                               **kw)
    states = [SketchWalkState() for _ in layers]
    if case.get("prefill", True):
        forward = WalkState()
        for (q, k, v), st in zip(layers, states):
            ctx = CallContext(forward=forward)
            m.prefill(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], scale=None, state=st, context=ctx, sparse=True)
    seen.clear()
    res = []
    for t in range(n0, n0 + steps):
        forward = WalkState()
        for (q, k, v), st in zip(layers, states):
            lengths = torch.tensor([t + 1 - s for s in case["short"]], device=device)
            ctx = CallContext(forward=forward)
            out, stats = m.decode(q[:, :, t], k[:, :, :t + 1], v[:, :, :t + 1], lengths=lengths, state=st, context=ctx)
            fused = "fused" if backend == "triton" else None
            assert stats.backend == backend and stats.extra.get("selection") == fused, stats.extra
            sk = st.sketch
            n = -(-(t + 1) // BS)
            res.append(dict(out=out.double(), w=forward.walk.double(), hops=stats.walk_hops,
                            density=stats.block_density, q_tok=sk.q_tok[:, :t + 1].clone(),
                            q_sum=sk.q_sum[:, :n].clone(), k_sum=sk.k_sum[:, :n].clone(),
                            k_sketch=sk.k_sketch[:, :n].clone(), a_tilde=sk.a_tilde[:, :n, :n].clone()))
    return res, list(seen)


assert len(CASES) == {n_cases}, "FUSED_CASES must count the cases"
worst = 0.0
for i, case in enumerate(CASES):
    if i not in {cases}:
        continue
    BS = int(dict(x.split("=") for x in case["spec"].split(",")).get("block_size", 64))
    (fused, fused_blocks), (ref, ref_blocks) = run(case, "triton"), run(case, "reference")
    assert len(fused_blocks) == len(ref_blocks) == len(ref)
    for j, (a, r, ba, br) in enumerate(zip(fused, ref, fused_blocks, ref_blocks)):
        where = f"case {{i}} call {{j}}"
        assert ba == br, (where, ba, br)
        assert a["hops"] == r["hops"] and a["density"] == r["density"], where
        for key in ("q_tok", "q_sum", "k_sum", "k_sketch"):
            torch.testing.assert_close(a[key], r[key], atol=1e-5, rtol=1e-5, msg=lambda s: f"{{where}} {{key}}: {{s}}")
        # entry by entry (Ã^α and the walk span tens of decades: an absolute tolerance would hide the small ones)
        torch.testing.assert_close(a["a_tilde"], r["a_tilde"], atol=1e-30, rtol=2e-4,
                                   msg=lambda s: f"{{where}} a_tilde: {{s}}")
        torch.testing.assert_close(a["w"], r["w"], atol=1e-30, rtol=2e-4, msg=lambda s: f"{{where}} w: {{s}}")
        err = float((a["out"] - r["out"]).norm() / r["out"].norm())
        assert err < (1e-5 if case["dtype"] == torch.float32 else 1e-2), (where, err)
        if case["dtype"] == torch.float32:
            worst = max(worst, err)
    print("case", i, "ok", len(ref), "calls")
print("WORST", worst)
"""


# The cases of FUSED_DECODE in groups of one interpreter run each: the long-context ones alone.
FUSED_GROUPS = [(0, 1, 2, 3), (4, 5), (6,)]
FUSED_CASES = sum(len(group) for group in FUSED_GROUPS)


@pytest.mark.triton
@pytest.mark.parametrize("cases", FUSED_GROUPS, ids=lambda group: "-".join(map(str, group)))
def test_fused_selection_equals_the_reference_path_under_the_interpreter(cases):
    """backend=triton's fused state update and selection write the reference path's state (block sums,
    sketches, Ã rows of completed blocks), give its walk and choose its blocks, in every dtype, for ragged
    rows, several block and sketch sizes, the walk controls and a standalone decode."""
    pytest.importorskip("triton")
    assert sorted(sum(FUSED_GROUPS, ())) == list(range(FUSED_CASES))
    out = run_script(FUSED_DECODE, "cpu", True, cases=list(cases), n_cases=FUSED_CASES)
    assert all(f"case {case} ok" in out for case in cases) and printed_worst(out) < TOLERANCE["cpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_selection_equals_the_reference_path_on_the_gpu():
    out = run_script(FUSED_DECODE, "cuda", False, cases=list(range(FUSED_CASES)), n_cases=FUSED_CASES)
    assert out.count(" ok ") == FUSED_CASES and printed_worst(out) < TOLERANCE["cuda"]


# The fused path inside a model: greedy generation through sparsify with a dense layer between the two sparse
# ones (the walk crosses it), blocks completing during the answer.
FUSED_GENERATE = """
import torch
import transformers as tf
import kvsieve
device = "{device}"
cfg = tf.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=1024, attn_implementation="sdpa")
torch.manual_seed(0)
model = tf.LlamaForCausalLM(cfg).eval().to(device)
x = torch.randint(3, 97, (1, 300), generator=torch.Generator().manual_seed(1)).to(device)
res = {{}}
for backend in ("triton", "reference"):
    spec = (f"sketchwalk:variant=reconstruction,density=0.3,block_size=16,sketch_dim=32,dense_layers=0/2,"
            f"backend={{backend}}")
    with torch.no_grad(), kvsieve.sparsify(model, spec, phase="all") as s:
        out = model.generate(x, max_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    dec = [r for r in s.records if r["phase"] == "decode"]
    # the first new token comes from the prompt's forward: 19 decode steps
    assert [r["layer"] for r in dec] == [1, 3] * 19 and [r["walk_hops"] for r in dec] == [1, 2] * 19
    assert {{r["backend"] for r in dec}} == {{backend}}
    assert {{r.get("selection") for r in dec}} == {{"fused" if backend == "triton" else None}}
    res[backend] = (out.sequences, torch.stack(out.scores).double(),
                    [(r["kv_rows_read"], r["block_density"]) for r in dec])
(seq, scores, reads), (ref_seq, ref_scores, ref_reads) = res["triton"], res["reference"]
assert torch.equal(seq, ref_seq)
assert reads == ref_reads
assert len({{r[0] for r in reads}}) > 1  # the selection moves as the context grows
print("WORST", float((scores - ref_scores).abs().max() / ref_scores.abs().max()))
"""


@pytest.mark.parametrize("device", interpreter_and_gpu())
def test_fused_selection_in_a_model_generates_what_the_reference_path_does(device):
    pytest.importorskip("triton")
    assert printed_worst(run_script(FUSED_GENERATE, device, device == "cpu")) < TOLERANCE[device]


# The fused select on its own: the walk row kernel's top k − 2 (one-hop without the tie-break term, so the
# ranking is the returned walk) against a stable sort, with exact ties (few distinct key sketches: ties go to
# the lower block), budgets near the row's blocks, c = 0 and 1, a fixed k, and rows in registers or over
# memory in tiles.
FUSED_SELECT = """
import torch
from kvsieve.kernels.sketchwalk.decode import sketch_walk_select
from kvsieve.methods.sketchwalk import block_budget, max_block_budget
device = "{device}"
f32 = torch.float32
TIE = 0.0  # the ranking is then w itself (a GPU may fuse w + tie·w into one rounding, torch does not)
# (n_tok, bs, density, fixed_k, distinct sketches (ties when few), row_tile, lengths short by)
CASES = [
    (16 * 37 + 5, 16, 0.3, False, 3, None, (0, 17, 16 * 30)),   # 38 blocks, one tile, heavy ties
    (16 * 37 + 5, 16, 0.3, False, 3, 16, (0, 17, 16 * 30)),     # the same over memory in tiles of 16
    (16 * 50, 16, 0.95, False, 1000, None, (0, 1, 16 * 3)),     # k near c + 1, no ties
    (16 * 50, 16, 0.95, True, 2, 32, (0, 1, 16 * 48)),          # fixed k near n, ties, tiles of 32
    (32 * 23 + 31, 32, 0.5, False, 1, None, (0, 32 * 22, 32 * 23 + 30)),  # every score tied; c = 1 and 0
    (16 * 70 + 3, 16, 0.1, True, 4, 64, (0, 5)),                # n = 71, a partial last tile
]
gen = torch.Generator().manual_seed(11)
for i, (n_tok, bs, rho, fixed, distinct, row_tile, short) in enumerate(CASES):
    b, hq, hkv, d, m = len(short), 4, 2, 64, 32
    n = -(-n_tok // bs)
    q = torch.randn(b, hq, d, generator=gen).to(device)
    k = torch.randn(b, hkv, n_tok, d, generator=gen).to(device)
    lengths = torch.tensor([n_tok - s for s in short], dtype=torch.int32, device=device)
    pool = torch.randn(distinct, m, generator=gen)
    k_sketch = pool[torch.randint(0, distinct, (b, n), generator=gen)].to(device).contiguous()
    q_tok = torch.randn(b, n_tok, d, generator=gen).to(device)
    q_sum = torch.zeros(b, n, d, device=device)
    k_sum = torch.zeros(b, n, d, device=device)
    a_tilde = torch.zeros(b, n, n, device=device)
    phi = (torch.randn(m, d, generator=gen) / m ** 0.5).to(device)
    kmax = max_block_budget(n, rho, fixed_k=fixed)
    w, pages, n_pages = sketch_walk_select(
        q, k, lengths, q_tok=q_tok, q_sum=q_sum, k_sum=k_sum, k_sketch=k_sketch, a_tilde=a_tilde, phi=phi,
        n_blocks=n, block_size=bs, logit_scale=d ** -0.5, alpha=2.0, mode="one-hop", previous=None,
        density=rho, fixed_k=fixed, kmax=kmax, tie=TIE, row_tile=row_tile)
    c = (lengths.long() - 1) // bs
    budget = block_budget(c, rho, fixed_k=fixed, n_blocks=n)
    rank = w
    for r in range(b):
        cr, kr = int(c[r]), int(budget[r])
        mid = rank[r, 1:cr].cpu()
        order = torch.sort(mid, descending=True, stable=True).indices[: max(kr - 2, 0)] + 1  # ties: lower block
        want = ([0] + sorted(order.tolist()) + ([cr] if cr > 0 else []) + [0] * kmax)[:kmax]
        for h in range(hkv):
            assert int(n_pages[r, h]) == kr, (i, r, int(n_pages[r, h]), kr)
            assert pages[r, h].tolist() == want, (i, r, h, pages[r, h].tolist(), want)
        assert len(set(mid.tolist())) < len(mid) or distinct > 100 or cr < 3, (i, r)  # ties were there
    print("case", i, "ok n", n, "kmax", kmax)
print("DONE")
"""


@pytest.mark.parametrize("device", interpreter_and_gpu())
def test_fused_select_takes_the_top_blocks_with_ties_to_the_lower_block(device):
    pytest.importorskip("triton")
    assert "DONE" in run_script(FUSED_SELECT, device, device == "cpu")


# What the fused path launches per call: its two kernels before the attention's own launches,
# and no other torch op (each would be a kernel launch and a graph node on the GPU).
FUSED_LAUNCHES = """
import torch
import kvsieve
from kvsieve import CallContext
from kvsieve.methods.sketchwalk import SketchWalkState, WalkState
gen = torch.Generator().manual_seed(0)
b, n0 = 2, 400
layers = [[torch.randn(b, h, n0 + 1, 64, generator=gen).bfloat16() for h in (8, 2, 2)] for _ in range(2)]
m = kvsieve.method("sketchwalk:variant=reconstruction,block_size=16,density=0.2,backend=triton")
states = [SketchWalkState() for _ in layers]
forward = WalkState()
for (q, k, v), st in zip(layers, states):
    ctx = CallContext(forward=forward)
    m.prefill(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], scale=None, state=st, context=ctx, sparse=True)
from tests.launch_log import Ops, log
lengths = torch.tensor([n0 + 1, n0 - 30], dtype=torch.int32)
for step in range(2):  # the second pass: nothing left to allocate or grow
    forward = WalkState()
    for (q, k, v), st in zip(layers, states):
        log.clear()
        with Ops():
            ctx = CallContext(forward=forward)
            out, stats = m.decode(q[:, :, n0], k, v, lengths=lengths, state=st, context=ctx, check_finite=False)
        print("CALL", " ".join(log))
"""


@pytest.mark.triton
def test_fused_path_launches_its_two_kernels_under_the_interpreter():
    """Per call (a first walk layer and a walk layer): the sketch update with the walk's GEMV, then the scores
    with the walk row and the select, then only the attention kernel's launches; the stats are deferred
    (nothing built when unread)."""
    pytest.importorskip("triton")
    calls = [line.split()[1:] for line in run_script(FUSED_LAUNCHES, "cpu", True).splitlines()
             if line.startswith("CALL")]
    assert len(calls) == 4
    for ops in calls[2:]:
        assert ops[:2] == ["triton:_update_walk_kernel", "triton:_scores_select_kernel"], ops
        assert ops[2:] and all(op.startswith("triton:") for op in ops[2:]), ops  # the attention's launches
