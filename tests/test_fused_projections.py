"""Each layer's q/k/v and gate/up as one product in the runtime's compiled decode steps
(``runtime/fused_projections.py``): the same outputs as the separate products whatever the call order, the
weights moved once into one buffer with no copy left behind, refusals named, and through the runtime the
same tokens with fewer products per step."""

import collections

import pytest
import torch
from test_runtime import hf_greedy, random_ids, tiny_model

from kvsieve.runtime import DecodeRuntime, generate
from kvsieve.runtime.fused_projections import FusedProjections, SharedProduct, _fusable


def linears(widths, in_features=24, bias=False, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Linear(in_features, w, bias=bias) for w in widths]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_shared_product_gives_each_projection_its_own_output_in_any_order(bias, order):
    mods = linears((16, 8, 8), bias=bias, seed=len(order) + bias)
    x = torch.randn(3, 1, 24)
    want = [m(x) for m in mods]
    product = SharedProduct(mods)
    fwd = [product.forward(i, mods[i].forward, lambda: True) for i in range(3)]
    got = {i: fwd[i](x) for i in order}
    for i in range(3):
        torch.testing.assert_close(got[i], want[i], rtol=1e-6, atol=1e-6)
    assert product.input is None and not product.pending  # nothing held between steps
    # another input in between: each call computes what its own module would
    y = torch.randn(3, 1, 24)
    first = fwd[order[0]](x)
    torch.testing.assert_close(fwd[order[1]](y), mods[order[1]](y), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(first, want[order[0]], rtol=1e-6, atol=1e-6)
    # inactive: the module's own product
    eager = product.forward(1, mods[1].forward, lambda: False)
    torch.testing.assert_close(eager(y), mods[1](y))


def test_packing_moves_the_weights_into_one_buffer_once():
    mods = linears((16, 8, 8), bias=True, seed=3)
    before = [m.weight.detach().clone() for m in mods]
    params = [m.weight for m in mods]
    product = SharedProduct(mods)
    assert product.weight.shape == (32, 24) and product.bias.shape == (32,)
    for m, p, w in zip(mods, params, before, strict=True):
        assert m.weight is p  # the same Parameter objects, now slices of one buffer
        assert torch.equal(m.weight, w) and same_memory(m.weight, product.weight)
    again = SharedProduct(mods)  # a second runtime on the same model: no new buffer
    assert same_memory(again.weight, product.weight) and again.weight.data_ptr() == product.weight.data_ptr()
    assert same_memory(again.bias, product.bias) and torch.equal(again.weight, product.weight)
    torch.testing.assert_close(again.forward(2, mods[2].forward, lambda: True)(torch.ones(1, 24)),
                               mods[2](torch.ones(1, 24)))


def same_memory(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_refusals_are_named():
    assert _fusable(linears((8, 8)), None) is None
    assert "input width" in _fusable([*linears((8,)), *linears((8,), in_features=16)], None)
    assert "bias" in _fusable([*linears((8,)), *linears((8,), bias=True)], None)
    assert "nn.Linear" in _fusable([*linears((8,)), torch.nn.Identity()], None)
    assert "device, dtype" in _fusable([*linears((8,)), linears((8,))[0].to(torch.float64)], None)
    # on a tensor-parallel rank: only modules the plan shards by columns with a local output
    mods = linears((8, 8))
    shards = {id(mods[0]): (mods[0].weight, None)}
    assert "column-parallel" in _fusable(mods, shards)
    assert _fusable(mods, {**shards, id(mods[1]): (mods[1].weight, None)}) is None


def step_products(model, ids):
    """Matrix products of one compiled decode step on the CPU, by profiler name."""
    from torch.profiler import ProfilerActivity, profile

    with DecodeRuntime(model, "dense", batch_size=ids.shape[0], capacity=ids.shape[1] + 3, max_new_tokens=3,
                       compile_ops=True) as rt:
        rt.prefill(list(ids))
        rt.step()  # compiles
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rt.step()
        summary = rt.stats.fused_projections
    counts = collections.Counter(e.name for e in prof.events() if e.name in ("aten::mm", "aten::addmm"))
    return counts, summary


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_runtime_fuses_each_layers_projections_same_tokens_fewer_products(family):
    model = tiny_model(family, num_hidden_layers=3)
    ids = random_ids(2, 20, seed=7)
    plain = generate(model, ids, "dense", max_new_tokens=6, compile_ops=False)
    assert plain.stats.fused_projections is None
    fused = generate(model, ids, "dense", max_new_tokens=6, compile_ops=True)
    assert fused.stats.fused_projections == {"groups": 2 * 3, "refused": {}}
    assert torch.equal(fused.tokens, plain.tokens) and torch.equal(fused.tokens, hf_greedy(model, ids, 6))
    counts, _ = step_products(model, ids)
    # per layer: q/k/v, o, gate/up, down (7 separate products before); the LM head
    assert sum(counts.values()) == 4 * 3 + 1, counts
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert "forward" not in vars(attn.q_proj) and "forward" not in vars(mlp.up_proj)  # detached
    assert same_memory(attn.k_proj.weight, attn.q_proj.weight)


def test_a_model_whose_projections_were_fused_still_saves_and_loads(tmp_path):
    """The runtime leaves the weights as slices of one buffer: transformers still saves them (safetensors)
    and the saved model gives the same tokens."""
    import transformers as tf

    model = tiny_model("llama")
    ids = random_ids(1, 12, seed=2)
    tokens = generate(model, ids, "dense", max_new_tokens=4, compile_ops=True).tokens
    model.save_pretrained(tmp_path)
    loaded = tf.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(generate(loaded, ids, "dense", max_new_tokens=4, compile_ops=False).tokens, tokens)


def test_layers_without_the_groups_are_left_alone():
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = torch.nn.Linear(8, 24)  # already one product (Phi-3's layout)
    fused = FusedProjections([layer], lambda: True)
    fused.attach()
    assert fused.summary() == {"groups": 0, "refused": {}}
    fused.detach()
