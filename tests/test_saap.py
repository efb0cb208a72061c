"""SAAP on tiny models: RoPE inversion, labels, the CSR index and bucketed decode, the method (CPU, CUDA), bad input."""

from __future__ import annotations

import pytest
import torch
from saap_helpers import CharTokenizer, exact, qkv, tiny_llama, write_artifacts

import kvsieve
from kvsieve import CallContext
from kvsieve.fit.saap import FitConfig, bucket_mass, spherical_kmeans, text_prompts
from kvsieve.kernels.saap.buckets import (
    bucket_lists,
    bucket_sparse_decode_reference,
    build_csr,
    list_width,
    merge_partials,
)
from kvsieve.kernels.shared.weighted import weighted_sparse_decode
from kvsieve.methods.saap import model_rope

# ---- RoPE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rope_parameters", [
    None,
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
])
def test_derope_inverts_the_models_rope(rope_parameters):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_llama(rope_parameters=rope_parameters)
    rope = model_rope(model)
    if rope_parameters and rope_parameters["rope_type"] == "yarn":
        assert rope.attention_scaling != 1.0  # the test covers the scaled case
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 50, 16, generator=g)
    pos = torch.randint(0, 4000, (2, 50), generator=g)
    cos, sin = model.model.rotary_emb(x, pos)
    roped, _ = apply_rotary_pos_emb(x, x, cos, sin)
    assert torch.allclose(rope.apply(x, pos[:, None]), roped, atol=1e-5, rtol=1e-5)
    assert torch.allclose(rope.invert(roped, pos[:, None]), x, atol=1e-4, rtol=1e-4)
    # Relative positions: <rope(q, m), rope(k, n)> = a^2 <q, rope(k, n - m)> / a^2 ... for a = 1 exactly.
    if rope.attention_scaling == 1.0:
        q, k = x[0, 0, :1], x[0, 1, :1]
        m, n = torch.tensor([700]), torch.tensor([250])
        lhs = (rope.apply(q, m) * rope.apply(k, n)).sum()
        rhs = (q * rope.apply(k, n - m)).sum()
        assert torch.allclose(lhs, rhs, atol=1e-4)


def test_derope_of_captured_keys_gives_the_key_projection():
    from kvsieve.integrations.hf import capture_attention

    model = tiny_llama()
    rope = model_rope(model)
    seen = {}
    hook = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda m, i, o: seen.setdefault("k", o))
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad(), capture_attention(model, layers=[1], only_decode=False) as cap:
        model(ids)
    hook.remove()
    _, _, k, _ = cap.calls[0]
    pre = seen["k"].view(1, 40, 2, 16).transpose(1, 2)
    assert torch.allclose(rope.invert(k, torch.arange(40)[None, None]), pre, atol=1e-5)


# ---- labels ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_streamed_labels_equal_the_dense_computation(causal):
    g = torch.Generator().manual_seed(2)
    n, c, d = 300, 7, 8
    k = torch.randn(n, d, generator=g, dtype=torch.float64)
    q = torch.randn(40, d, generator=g, dtype=torch.float64) * 2
    k_pos = torch.arange(n)
    q_pos = torch.randint(0, n, (40,), generator=g)
    assign = torch.randint(0, c, (n,), generator=g)
    assign[5] = c  # a key outside the index
    y, top1 = bucket_mass(q, q_pos, k, k_pos, assign, c, scale=0.3, window=20, sink=2, causal=causal, chunk=37)
    z = q @ k.T * 0.3
    ok = (k_pos[None] >= 2) & ((q_pos[:, None] - k_pos[None]).abs() > 20) & (assign[None] < c)
    if causal:
        ok &= k_pos[None] <= q_pos[:, None]
    a = torch.softmax(z.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    dense = a @ (torch.nn.functional.one_hot(assign.clamp(max=c - 1), c).double() * (assign < c)[:, None])
    assert torch.allclose(y, dense, atol=1e-12)
    has = ok.any(-1)
    assert torch.allclose(y[has].sum(-1), torch.ones(int(has.sum()), dtype=torch.float64))
    assert (y[~has] == 0).all() and (y >= 0).all()
    zc = z.masked_fill(~((k_pos[None] <= q_pos[:, None]) & (k_pos[None] >= 2)), float("-inf"))
    expect = torch.where(torch.isfinite(zc.max(-1).values), zc.argmax(-1), -1)
    assert torch.equal(top1, expect)


# ---- CSR, lists, merge -----------------------------------------------------------------------------


def test_csr_invariants():
    g = torch.Generator().manual_seed(3)
    c = 9
    assign = torch.randint(0, c + 1, (2, 3, 200), generator=g)
    assign[0, 0] = c  # nothing indexed
    assign[1, 1, :] = 4  # one bucket holds all
    offsets, ids = build_csr(assign, c)
    assert (offsets[..., 0] == 0).all()
    assert torch.equal(offsets[..., c], (assign < c).sum(-1))
    assert (offsets[..., 1:] >= offsets[..., :-1]).all()
    for b in range(2):
        for h in range(3):
            n_idx = int(offsets[b, h, c])
            listed = ids[b, h, :n_idx]
            assert torch.equal(listed.sort().values, (assign[b, h] < c).nonzero().squeeze(1))
            for bucket in range(c):
                part = ids[b, h, offsets[b, h, bucket]:offsets[b, h, bucket + 1]]
                assert (assign[b, h, part] == bucket).all()
                assert (part[1:] > part[:-1]).all()  # positions in cache order within a bucket


def test_bucket_lists_concatenate_the_chosen_buckets():
    g = torch.Generator().manual_seed(4)
    c = 12
    assign = torch.randint(0, c + 1, (2, 2, 150), generator=g)
    assign[0, 1, assign[0, 1] == 3] = 5  # bucket 3 empty there
    offsets, ids = build_csr(assign, c)
    buckets = torch.stack([torch.randperm(c, generator=g)[:5] for _ in range(4)]).view(2, 2, 5)
    buckets[0, 1, 0] = 3
    width = list_width(offsets, 5)
    idx, counts = bucket_lists(offsets, ids, buckets, width)
    for b in range(2):
        for h in range(2):
            expect = torch.cat([(assign[b, h] == x).nonzero().squeeze(1) for x in buckets[b, h]])
            assert int(counts[b, h]) == len(expect)
            assert torch.equal(idx[b, h, : len(expect)], expect)
            assert (idx[b, h, len(expect):] == 0).all()


def test_merge_is_order_invariant_and_empty_parts_are_identities():
    q, k, v = qkv(2, 4, 2, 60)
    parts = [torch.arange(0, 10), torch.arange(10, 35), torch.arange(35, 60)]
    outs, lses = [], []
    for p in parts:
        idx = p.expand(2, 2, -1).contiguous()
        o, lse = weighted_sparse_decode(q, k, v, idx, torch.full((2, 2), len(p)), None)
        outs.append(o)
        lses.append(lse)
    full, _ = merge_partials(outs, lses)
    assert torch.allclose(full, exact(q, k, v), atol=1e-12)
    rev, lse_rev = merge_partials(outs[::-1], lses[::-1])
    assert torch.allclose(rev, full, atol=1e-12)
    empty_out = torch.randn_like(outs[0])  # whatever an empty part holds, it must not count
    with_empty, lse_e = merge_partials(outs + [empty_out], lses + [torch.full_like(lses[0], float("-inf"))])
    assert torch.allclose(with_empty, full, atol=1e-12) and torch.allclose(lse_e, lse_rev)
    nothing, lse_n = merge_partials([empty_out], [torch.full_like(lses[0], float("-inf"))])
    assert (nothing == 0).all() and torch.isinf(lse_n).all()


@pytest.mark.parametrize("sizes", [(0, 0, 0), (1, 0, 1), (5, 67, 1), (64, 128, 3)])
def test_bucket_decode_matches_exact_attention_over_its_keys(sizes):
    """Bucket sizes 0, 1 and non-multiples of a tile: the merged result is softmax over dense ∪ buckets."""
    c = len(sizes) + 1
    n = 8 + sum(sizes) + 10
    q, k, v = qkv(1, 4, 2, n, seed=sum(sizes))
    assign = torch.full((1, 2, n), c, dtype=torch.long)
    pos = 8
    for bucket, s in enumerate(sizes):
        assign[..., pos:pos + s] = bucket
        pos += s
    assign[..., pos:pos + 10] = c - 1  # a bucket never chosen
    offsets, ids = build_csr(assign, c)
    buckets = torch.arange(len(sizes)).expand(1, 2, -1).contiguous()
    dense = torch.arange(8).expand(1, 2, -1).contiguous()
    out, lse, counts = bucket_sparse_decode_reference(q, k, v, dense, torch.full((1, 2), 8), offsets, ids, buckets,
                                                      list_width(offsets, len(sizes)))
    keep = torch.arange(8 + sum(sizes))
    ref = exact(q, k[:, :, keep], v[:, :, keep])
    assert torch.allclose(out, ref, atol=1e-12)
    assert int(counts[0, 0]) == sum(sizes)


# ---- the method ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    return write_artifacts(tmp_path_factory.mktemp("saap_art"), heads=4, kv_heads=2, clusters=8)


def run(spec, q, k, v, layer=1, state=None, **kw):
    m = kvsieve.method(spec)
    return m.decode(q, k, v, state=state, context=CallContext(layer=layer), **kw)


@pytest.mark.parametrize("name", ["saap", "saap-kmeans", "saap-kmeans-roped"])
def test_all_buckets_is_exact_and_no_bucket_is_streaming(arts, name):
    q, k, v = qkv(2, 4, 2, 500, seed=5)
    lengths = torch.tensor([500, 380])
    out, stats = run(f"{name}:artifacts={arts},probes=8", q, k, v, lengths=lengths)
    assert torch.allclose(out.double(), exact(q, k, v, lengths), atol=1e-10)
    assert stats.selectivity == pytest.approx(1.0) and stats.selectivity_indexed == pytest.approx(1.0)
    out0, stats0 = run(f"{name}:artifacts={arts},probes=0", q, k, v, lengths=lengths)
    window = int(stats0.window)
    assert stats0.window == 63  # max(window_min, 500 // 16) and max(window_min, 380 // 16)
    ref, _ = kvsieve.method(f"streaming:sink=1,window={window}").decode(q, k, v, lengths=lengths)
    assert torch.allclose(out0.double(), ref.double(), atol=1e-10)
    assert stats0.selectivity_indexed == 0


def test_dense_and_indexed_sets_are_disjoint_and_complete(arts):
    q, k, v = qkv(2, 4, 2, 300, seed=6)
    lengths = torch.tensor([300, 260])
    spec = f"saap:artifacts={arts},probes=3"
    state = kvsieve.method(spec).new_state()
    run(spec, q, k, v, layer=2, state=state, lengths=lengths)
    idx = state.index
    for b in range(2):
        n, window = int(lengths[b]), int(idx.window[b])
        dense = {0} | set(range(n - window, n))  # the sink and the window
        for h in range(2):
            n_idx = int(idx.offsets[b, h, -1])
            indexed = set(idx.ids[b, h, :n_idx].tolist())
            assert not dense & indexed
            assert dense | indexed == set(range(n))


def test_selectivity_is_monotone_in_probes(arts):
    q, k, v = qkv(1, 4, 2, 800, seed=7)
    seen = []
    for probes in range(0, 9):
        _, stats = run(f"saap:artifacts={arts},probes={probes}", q, k, v)
        seen.append((stats.selectivity, stats.selectivity_indexed, stats.kv_rows_read))
    for a, b in zip(seen[:-1], seen[1:], strict=True):
        assert all(y >= x for x, y in zip(a, b, strict=True))
    assert seen[-1][1] == pytest.approx(1.0)


def test_group_of_one_batched_equals_independent(tmp_path):
    folder = write_artifacts(tmp_path, heads=3, kv_heads=3, clusters=8)
    q, k, v = qkv(2, 3, 3, 400, seed=8)
    a, sa = run(f"saap:artifacts={folder},probes=3", q, k, v)
    b, sb = run(f"saap:artifacts={folder},probes=3,probing=independent", q, k, v)
    assert torch.equal(a, b) and sa.kv_rows_read == sb.kv_rows_read


@pytest.mark.parametrize("per", ["kv", "q"])
def test_artifacts_sliced_to_a_ranks_heads_select_what_the_whole_does_for_them(tmp_path, per):
    """A tensor-parallel rank holding KV head 1 of 2 (query heads 2, 3): the method on its slice of the
    artifacts gives those heads' outputs and stats of the whole method, and refuses the whole's head count."""
    folder = write_artifacts(tmp_path, heads=4, kv_heads=2, clusters=8, per=per, seed=3)
    q, k, v = qkv(2, 4, 2, 500, seed=12)
    spec = f"saap:artifacts={folder},probes=2"
    whole, _ = run(spec, q, k, v)
    rank = kvsieve.method(spec)
    note = rank.use_local_heads(1, 1)
    assert "KV heads [1, 2)" in note and rank.artifacts.shape["heads"] == 2
    part, _ = run(rank, q[:, 2:], k[:, 1:], v[:, 1:])
    torch.testing.assert_close(part, whole[:, 2:], rtol=0, atol=1e-12)
    other = kvsieve.method(spec)
    other.use_local_heads(0, 1)
    first, _ = run(other, q[:, :2], k[:, :1], v[:, :1])
    torch.testing.assert_close(first, whole[:, :2], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="4 query heads, 2 KV heads, head dim 16; the artifacts were fitted for 2, 1"):
        run(rank, q, k, v)


def test_batched_probing_ranks_the_summed_group_probabilities(arts):
    q, k, v = qkv(1, 4, 2, 600, seed=9)
    m = kvsieve.method(f"saap:artifacts={arts},probes=3")
    state = m.new_state()
    out, _ = m.decode(q, k, v, state=state, context=CallContext(layer=1))
    from kvsieve.core.inputs import check_decode_inputs

    inputs = check_decode_inputs(q, k, v)
    p = m.bucket_scores(inputs, 1).view(1, 2, 2, -1)
    assert torch.allclose(p.sum(-1), torch.ones(1, 2, 2, dtype=p.dtype), atol=1e-5)  # probabilities
    top = torch.topk(p.sum(2), 3, dim=-1).indices  # [1, Hkv, 3]
    idx = state.index
    assign = idx.assign  # [1, Hkv, N]
    chosen = torch.stack([torch.isin(assign[0, h], top[0, h]) for h in range(2)])[None]
    dense = torch.zeros(1, 600, dtype=torch.bool)
    dense[0, 0] = True
    dense[0, 600 - int(idx.window[0]):] = True
    for h in range(4):
        keep = (chosen[0, h // 2] | dense[0]).nonzero().squeeze(1)
        ref = exact(q[:, h:h + 1], k[:, h // 2:h // 2 + 1, keep], v[:, h // 2:h // 2 + 1, keep])
        assert torch.allclose(out[:, h:h + 1].double(), ref, atol=1e-10)


def test_keys_leaving_the_window_join_their_buckets(arts):
    q, k, v = qkv(1, 4, 2, 700, seed=10)
    m = kvsieve.method(f"saap:artifacts={arts},probes=8")  # all buckets: exact at every step
    state = m.new_state()
    for n in (600, 601, 650, 664, 665, 700):
        out, stats = m.decode(q, k[:, :, :n], v[:, :, :n], state=state, context=CallContext(layer=1))
        assert torch.allclose(out.double(), exact(q, k[:, :, :n], v[:, :, :n]), atol=1e-10)
        assert stats.dense_keys == 1 + 63  # the window slides: sink + 63 keys whatever the length
        assert stats.bucket_keys == n - 64
    idx = state.index
    assert int(idx.done[0]) == 700 - 63 and (idx.assign[0, :, 600 - 63:700 - 63] < 8).all()


def test_decode_loop_without_host_reads_equals_the_cpu_path(arts):
    """The decode contract for SAAP (tested here: it needs artifacts): under ``no_host_reads()`` (what a GPU
    gets) a decode loop reads nothing on the host — the index build and its updates included — and gives
    the CPU path's outputs."""
    import test_decode_contract as contract

    from kvsieve.core.sync import no_host_reads

    q, k, v = qkv(1, 4, 2, 700, seed=21)
    spec = f"saap:artifacts={arts},probes=3"
    m = kvsieve.method(spec)
    cpu_state, gpu_state = m.new_state(), m.new_state()
    layer1, hinted = CallContext(layer=1), CallContext(layer=1, min_length=600)
    for n in (600, 601, 640, 664, 665, 700):  # K grows by up to 39 keys: as many join their buckets
        a, sa = m.decode(q, k[:, :, :n], v[:, :, :n], state=cpu_state, context=layer1, check_finite=False)
        with contract.host_reads_raise():
            b, sb = m.decode(q, k[:, :, :n], v[:, :, :n], state=gpu_state, context=hinted, check_finite=False)
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert sb.selectivity == pytest.approx(sa.selectivity)
        assert torch.equal(cpu_state.index.assign, gpu_state.index.assign)
    layer2 = CallContext(layer=2)
    with no_host_reads():  # a ragged batch
        q2, k2, v2 = qkv(2, 4, 2, 500, seed=22)
        out, _ = m.decode(q2, k2, v2, lengths=torch.tensor([500, 420]), context=layer2, check_finite=False)
    ref, _ = m.decode(q2, k2, v2, lengths=torch.tensor([500, 420]), context=layer2, check_finite=False)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("update", ["step", "ahead"])
def test_decode_on_cuda_has_no_sync_and_replays_in_a_graph(tmp_path, update):
    """The SAAP step (index update, Triton probe, bucket kernel with the tail scan) on a capacity-sized cache, and
    layer 0's exact step (the dense kernel): no host synchronisation, captured once, replayed at later lengths
    (keys leaving the window join their buckets inside the graph) with the eager step's outputs and index; close
    to the torch path. Both index updates: in the step, and one step ahead in the attention's launch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder = write_artifacts(tmp_path, heads=8, kv_heads=2, head_dim=64, clusters=16)
    q, k, v = (t.cuda().to(torch.bfloat16) for t in qkv(2, 8, 2, 3000, d=64, seed=23))
    lengths = torch.tensor([2900, 1700], device="cuda")
    m = kvsieve.method(f"saap:artifacts={folder},probes=4,index_update={update}")
    ctx = CallContext(layer=1, capacity=3000, count_reads=False)
    state, eager_state, ref_state = m.new_state(), m.new_state(), m.new_state()
    ref_m = kvsieve.method(f"saap:artifacts={folder},probes=4,backend=reference")
    for st in (state, eager_state):
        m.decode(q, k, v, lengths=lengths, state=st, context=ctx, check_finite=False)  # builds the index
    ref_m.decode(q, k, v, lengths=lengths, state=ref_state, context=ctx, check_finite=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, stats = m.decode(q, k, v, lengths=lengths, state=state, context=ctx, check_finite=False)
        exact0, stats0 = m.decode(q, k, v, lengths=lengths.int(), context=CallContext(layer=0, count_reads=False),
                                  check_finite=False)  # layer 0: the dense kernel
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref0, _ = ref_m.decode(q, k, v, lengths=lengths, context=CallContext(layer=0), check_finite=False)
    assert stats0.backend == "triton" and "layer 0" in stats0.saap_path
    torch.testing.assert_close(exact0.float(), ref0.float(), rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        m.decode(q, k, v, lengths=lengths, state=state, context=ctx, check_finite=False)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        captured, _ = m.decode(q, k, v, lengths=lengths, state=state, context=ctx, check_finite=False)
    assert stats.backend == "triton" and stats.saap_path == "device index" and torch.isfinite(out.float()).all()
    steps = torch.tensor([[2900 + step, 1700 + step] for step in range(40)], device="cuda")
    for step in range(1, 40):  # one key a step leaves each row's window and joins its bucket
        lengths.copy_(steps[step])
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        now = lengths.clone()
        eager, _ = m.decode(q, k, v, lengths=now, state=eager_state, context=ctx, check_finite=False)
        torch.testing.assert_close(captured, eager, rtol=0, atol=0)
        torch.testing.assert_close(state.index.assign, eager_state.index.assign, rtol=0, atol=0)
        ref, _ = ref_m.decode(q, k, v, lengths=now, state=ref_state, context=ctx, check_finite=False)
        torch.testing.assert_close(captured.float(), ref.float(), rtol=3e-2, atol=3e-2)
    # the Triton update = the torch update (ahead: below each window start, where a step reads)
    below = (torch.arange(3000, device="cuda")[None, :] < (lengths - state.index.window)[:, None])[:, None]
    assert torch.equal(state.index.assign.masked_fill(~below, -1), ref_state.index.assign.masked_fill(~below, -1))
    assert update == "ahead" or torch.equal(state.index.assign, ref_state.index.assign)
    assert stats["update"] == ("ahead" if update == "ahead" else "serial")
    w = state.index.window.cpu()
    assert (state.index.assign[0, :, 2900 - w[0]:2939 - w[0]] < 16).all()  # joined their buckets


@pytest.mark.gpu
@pytest.mark.parametrize("update", ["step", "ahead"])
def test_generate_captures_saap_and_equals_its_eager_run(tmp_path, update):
    """``kvsieve.generate`` on CUDA captures the SAAP step (rows of different lengths, more new tokens than
    the window so keys join their buckets in the graph) and gives the eager run's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg).eval().cuda()
    folder = write_artifacts(tmp_path, heads=8, kv_heads=2, head_dim=64, layers=4, clusters=16, model=model)
    spec = f"saap:artifacts={folder},probes=4,window=64,index_update={update}"
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 1000, (n,), generator=g).cuda() for n in (1500, 700)]
    runs = {graph: kvsieve.generate(model, rows, spec, max_new_tokens=96, graph=graph, eos_token_id=None)
            for graph in (True, False)}
    assert runs[True].stats.graph and runs[True].stats.graph_reason is None
    assert not runs[False].stats.graph
    assert {r["backend"] for r in runs[False].stats.records if r["saap_path"] == "device index"} == {"triton"}
    assert {r["backend"] for r in runs[False].stats.records if r["layer"] == 0} == {"triton"}  # the dense kernel
    assert torch.equal(runs[True].tokens, runs[False].tokens)


# ---- bad input -------------------------------------------------------------------------------------


def test_bad_input(arts, tmp_path):
    with pytest.raises(ValueError, match="artifacts"):
        kvsieve.method("saap")
    with pytest.raises(ValueError, match="not a SAAP artifact directory"):
        kvsieve.method(f"saap:artifacts={tmp_path}")
    with pytest.raises(ValueError, match="probes: expected at most C = 8"):
        kvsieve.method(f"saap:artifacts={arts},probes=9")
    q, k, v = qkv(1, 4, 2, 100)
    with pytest.raises(ValueError, match="layer"):
        kvsieve.method(f"saap:artifacts={arts}").decode(q, k, v)
    with pytest.raises(ValueError, match="no layer 3|layer in"):
        run(f"saap:artifacts={arts}", q, k, v, layer=3)
    q8, k8, v8 = qkv(1, 8, 2, 100)
    with pytest.raises(ValueError, match="query heads"):
        run(f"saap:artifacts={arts}", q8, k8, v8)
    from kvsieve.kernels.shared.triton_utils import kernels_interpreted

    if not kernels_interpreted():
        with pytest.raises(ValueError, match="backend: the triton kernel cannot serve"):
            run(f"saap:artifacts={arts},backend=triton", q, k, v)
    assert run(f"saap:artifacts={arts}", q, k, v)[1].backend == "reference"
    with pytest.raises(ValueError, match="empty"):
        text_prompts(CharTokenizer(), ["", "  "], 64, 1, "text")
    with pytest.raises(ValueError, match="larger than the"):
        spherical_kmeans(torch.randn(10, 4), 16, niter=2, seed=0)
    with pytest.raises(ValueError, match="clusters"):
        FitConfig(clusters=1).validate()


def test_short_context_runs_exact_and_says_so(arts):
    q, k, v = qkv(2, 4, 2, 50, seed=11)
    out, stats = run(f"saap:artifacts={arts},probes=2", q, k, v)
    assert torch.allclose(out.double(), exact(q, k, v), atol=1e-10)
    assert stats.exact_rows == 2 and stats.selectivity == pytest.approx(1.0)
    out0, stats0 = run(f"saap:artifacts={arts}", q, k, v, layer=0)
    assert torch.allclose(out0.double(), exact(q, k, v), atol=1e-10) and "layer 0" in stats0.saap_path
