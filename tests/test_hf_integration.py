"""The transformers integration on tiny random models of several families and on the default model."""

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from kvsieve.integrations.hf import capture_attention

FAMILIES = ["llama", "qwen2", "mistral", "gemma3"]


def tiny_model(family: str, seed: int = 0):
    """A randomly initialised 2-layer causal LM of ``family`` (GQA 4 query / 2 KV heads)."""
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  attn_implementation="sdpa")
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "mistral":
        cfg, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=24, query_pre_attn_scalar=16)
        cls = tf.Gemma3ForCausalLM
    else:
        raise AssertionError(family)
    torch.manual_seed(seed)
    return cls(cfg).eval()


def random_ids(batch, length, seed=0, vocab=97):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_method_reproduces_the_model(family):
    model = tiny_model(family)
    ids = random_ids(2, 40)
    with torch.no_grad():
        ref = model(ids).logits
        cache = DynamicCache()
        model(ids[:, :30], past_key_values=cache)
        ref_step = model(ids[:, 30:31], past_key_values=cache).logits
        with kvsieve.sparsify(model, "dense", phase="question", question_start=20,
                              sparse_everywhere=True) as session:
            out = model(ids).logits
        cache = DynamicCache()
        model(ids[:, :30], past_key_values=cache)
        with kvsieve.sparsify(model, "dense", phase="decode", sparse_everywhere=True) as decode_session:
            step = model(ids[:, 30:31], past_key_values=cache).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, ref_step, rtol=1e-4, atol=1e-4)
    # question rows 20..39 of both batch rows ran the method in both layers, in one call per layer
    assert [(r["layer"], r["first_position"], r["position"], r["rows"]) for r in session.records] == [
        (0, 20, 39, 20), (1, 20, 39, 20)]
    assert session.layer_paths == {0: "method", 1: "method"}
    assert len(decode_session.records) == 2 and decode_session.records[0]["q_len"] == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_method_runs_and_budget_covering_context_is_exact(family):
    model = tiny_model(family)
    ids = random_ids(2, 48, seed=1)
    with torch.no_grad():
        ref = model(ids).logits
        with kvsieve.sparsify(model, "santa-sys:budget=64", phase="question", question_start=0,
                              sparse_everywhere=True) as s:
            covered = model(ids).logits
        with kvsieve.sparsify(model, "santa-sys:budget=64", phase="question", question_start=0) as s_policy:
            model(ids)
        with kvsieve.sparsify(model, "santa-sys:budget=4", phase="question", question_start=0,
                              sparse_everywhere=True) as s4:
            sampled = model(ids).logits
    torch.testing.assert_close(covered, ref, rtol=1e-4, atol=1e-4)
    # every query row of both batch rows is covered by the budget: exact, and counted as such
    assert s.records and all(r["exact_rows"] == 2 * 48 for r in s.records)
    # by default a context within the method's fixed part (64 samples > 48 keys) stays exact
    assert not s_policy.records and all(p.startswith("exact: ") for p in s_policy.layer_paths.values())
    assert torch.isfinite(sampled).all()
    assert not torch.allclose(sampled[:, 10:], ref[:, 10:], atol=1e-3)
    assert s4.records and max(r["v_rows_read"] for r in s4.records) <= 4


def test_model_is_restored_after_the_block_and_after_an_error():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    with kvsieve.sparsify(model, "santa:budget=8"):
        assert model.config._attn_implementation == "kvsieve"
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError, match="boom"):
        with kvsieve.sparsify(model, "santa:budget=8"):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == before
    ids = random_ids(1, 12)
    with torch.no_grad():
        a = model(ids).logits
    model2 = tiny_model("llama")
    with torch.no_grad():
        torch.testing.assert_close(a, model2(ids).logits)


def test_generate_with_left_padding_and_batch():
    model = tiny_model("qwen2")
    ids = random_ids(2, 20, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # row 1 is left-padded
    ids[1, :6] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        with kvsieve.sparsify(model, "dense") as s:
            out = model.generate(ids, **kwargs)
        with kvsieve.sparsify(model, "santa-strat:budget=8", seed=1) as s8:
            sampled = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert sampled.shape == ref.shape
    # 5 decode steps (the first new token comes from the exact prefill) x 2 layers
    assert len(s.records) == 10 and len(s8.records) == 10
    # the padded row has 6 fewer valid keys
    assert s.records[0]["n_keys"] == pytest.approx((21 + 15) / 2)


def test_dense_layers_stay_exact_and_stats_cover_the_rest():
    model = tiny_model("mistral")
    ids = random_ids(1, 30, seed=4)
    with torch.no_grad():
        with kvsieve.sparsify(model, "santa:budget=4", phase="question", question_start=25,
                              dense_layers=(0,), track_error=1) as s:
            model(ids)
    assert {r["layer"] for r in s.records} == {1}
    assert all("rel_error" in r and r["rel_error"] >= 0 for r in s.records)
    summary = s.layer_summary()
    assert set(summary) == {1} and summary[1]["calls"] == 1 and summary[1]["rows"] == 5
    assert summary[1]["rel_error"] == pytest.approx(s.records[0]["rel_error"])
    assert s.layer_paths == {0: "exact: dense_layers", 1: "method"}


def test_sliding_window_layers_stay_exact_unless_asked():
    model = tiny_model("gemma3")  # both layers of the tiny model are sliding-window layers (24 keys)
    ids = random_ids(1, 40, seed=6)
    with torch.no_grad():
        ref = model(ids).logits
        with kvsieve.sparsify(model, "santa:budget=4", phase="question", question_start=30) as s:
            out = model(ids).logits
        with kvsieve.sparsify(model, "santa:budget=4", phase="question", question_start=30,
                              sparse_everywhere=True) as s_all:
            model(ids)
    torch.testing.assert_close(out, ref)
    assert not s.records and set(s.layer_paths.values()) == {"exact: sliding window of 24 keys"}
    assert {r["layer"] for r in s_all.records} == {0, 1}


def test_chunk_rows_equal_rows_decoded_one_at_a_time():
    """One call per layer for a question chunk gives the rows that single-token steps give."""
    model = tiny_model("llama")
    ids = random_ids(1, 36, seed=7)
    with torch.no_grad():
        with kvsieve.sparsify(model, "random:budget=5,sink=2,window=2", phase="question",
                              question_start=30, seed=3) as s_chunk:
            chunk = model(ids).logits[:, 29:]
        cache = DynamicCache()
        model(ids[:, :30], past_key_values=cache)
        rows = []
        with kvsieve.sparsify(model, "random:budget=5,sink=2,window=2", phase="question",
                              question_start=30, seed=3) as s_steps:
            for i in range(30, 36):
                rows.append(model(ids[:, i:i + 1], past_key_values=cache).logits)
    assert len(s_chunk.records) == 2 and len(s_steps.records) == 12
    # a row's stream is keyed by (seed, request, layer, batch row, position): the same either way
    torch.testing.assert_close(chunk[:, 1:], torch.cat(rows, dim=1), rtol=1e-5, atol=1e-5)


def test_fresh_randomness_per_layer_and_step_reproducible_from_seed():
    model = tiny_model("llama")
    ids = random_ids(1, 40, seed=5)
    outs = []
    for seed in (0, 0, 1):
        with torch.no_grad(), kvsieve.sparsify(model, "santa:budget=3", phase="question",
                                               question_start=30, seed=seed):
            outs.append(model(ids).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert not torch.allclose(outs[0], outs[2])


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="phase"):
        with kvsieve.sparsify(model, "santa", phase="prefill"):
            pass
    with pytest.raises(ValueError, match="dense_layers"):
        with kvsieve.sparsify(model, "santa", dense_layers=(5,)):
            pass
    with pytest.raises(ValueError, match="unknown method"):
        with kvsieve.sparsify(model, "santa-sis"):
            pass
    with pytest.raises(ValueError, match="mark_question"):
        with torch.no_grad(), kvsieve.sparsify(model, "santa", phase="question"):
            model(random_ids(1, 8))
    with pytest.raises(ValueError, match="start"):
        with kvsieve.sparsify(model, "santa", phase="question") as s:
            s.mark_question(-1)
    with kvsieve.sparsify(model, "santa"):
        with pytest.raises(ValueError, match="already inside"):
            with kvsieve.sparsify(model, "dense"):
                pass


def test_capture_attention_records_decode_steps():
    model = tiny_model("llama")
    ids = random_ids(1, 16)
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :15], past_key_values=cache)
        with capture_attention(model, layers=[1]) as cap:
            model(ids[:, 15:], past_key_values=cache)
    assert len(cap.calls) == 1
    layer, q, k, v = cap.calls[0]
    assert layer == 1 and q.shape == (1, 4, 1, 16) and k.shape == (1, 2, 16, 16) == v.shape


@pytest.mark.model
def test_default_model_dense_method_generates_identically(default_model):
    model, tok = default_model
    ids = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        with kvsieve.sparsify(model, "dense") as s:
            out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert {r["layer"] for r in s.records} == set(range(30))
