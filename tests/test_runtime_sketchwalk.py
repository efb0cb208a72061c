"""Sketch&Walk's decode in the runtime: the walk across the layers of each token's forward (a fresh
forward dict per decode step), its dense layers served by the runtime's dense decode, the prompt's
sketches recorded by an exact prefill; greedy tokens and every step's logits equal
``kvsieve.sparsify`` + transformers' ``generate`` (phase="decode" after an exact prefill, phase="all"
after the method's sparse prefill)."""

import pytest
import torch

import kvsieve
from kvsieve.runtime import DecodeRuntime, generate
from tests.test_runtime import random_ids, tiny_model

# 5 layers: 0 and 1 are sketchwalk's dense layers (default), the walk crosses 2, 3 and 4
SPEC = "sketchwalk:variant=reconstruction,density=0.3,block_size=16,sketch_dim=16"
NEW = 6
PHASE = {"exact": "decode", "method": "all"}


def sparsify_generate(model, ids, spec, phase, new=NEW, **kw):
    """sparsify + transformers' greedy generate: new tokens [1, T], each step's logits [T, V], decode records."""
    with torch.no_grad(), kvsieve.sparsify(model, spec, phase=phase, **kw) as session:
        out = model.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    logits = torch.cat(out.logits)  # one [1, V] per new token: the prompt's, then each decode step's
    return out.sequences[:, ids.shape[1]:], logits, [r for r in session.records if r["phase"] == "decode"]


def runtime_generate(model, ids, spec, prefill, new=NEW, **kw):
    """The runtime step by step: new tokens [1, T], each step's last logits [T, V], the runtime."""
    rt = DecodeRuntime(model, spec, batch_size=1, capacity=ids.shape[1] + new, max_new_tokens=new,
                       prefill=prefill, **kw)
    with rt:
        rt.prefill([ids[0]])
        logits = [rt.last_logits.clone()]
        for _ in range(new - 1):
            rt.step()
            logits.append(rt.last_logits.clone())
        return rt.tokens(), torch.cat(logits), rt


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=5)


@pytest.mark.parametrize("prefill", ["method", "exact"])
def test_sketchwalk_decode_equals_sparsify(model, prefill):
    ids = random_ids(1, 150, seed=11)
    ref_tokens, ref_logits, ref_records = sparsify_generate(model, ids, SPEC, PHASE[prefill])
    tokens, logits, rt = runtime_generate(model, ids, SPEC, prefill)
    # the sparse decode changes the logits (else this comparison could not fail)
    with torch.no_grad():
        dense = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0)
    assert (torch.cat(dense.logits)[1:] - ref_logits[1:]).abs().max() > 1e-3
    assert tokens.tolist() == ref_tokens.tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    st = rt.stats
    # the method's dense layers 0 and 1 ran the runtime's dense decode: no method record there
    assert st.dense_decode_layers == [0, 1]
    assert {r["layer"] for r in st.records} == {2, 3, 4}
    # one record per sparse layer per decode step; the walk grows across the layers of each step
    ours = [(r["step"], r["layer"], r["walk_hops"], r["block_density"]) for r in st.records]
    theirs = [(r["step"], r["layer"], r["walk_hops"], r["block_density"]) for r in ref_records]
    assert ours == theirs
    assert [r["walk_hops"] for r in st.records] == [1, 2, 3] * (NEW - 1)
    assert rt.driver.states[2].sketch.has_history  # the prompt's sketches, whichever prefill ran


def test_the_walk_changes_this_decode(model):
    """The equality above checks the walk: one-hop ranking (each layer's own Ã, what the runtime did
    without a forward dict) gives other logits on this prompt."""
    ids = random_ids(1, 150, seed=11)
    _, walk, _ = runtime_generate(model, ids, SPEC, "exact")
    _, hop, _ = runtime_generate(model, ids, SPEC + ",walk=one-hop", "exact")
    assert (walk[1:] - hop[1:]).abs().max() > 1e-4


def test_runtime_dense_layers_join_the_methods_and_stay_out_of_the_walk(model):
    ids = random_ids(1, 100, seed=12)
    ref_tokens, ref_logits, ref_records = sparsify_generate(model, ids, SPEC, "decode", dense_layers=[3])
    tokens, logits, rt = runtime_generate(model, ids, SPEC, "exact", dense_layers=[3])
    assert tokens.tolist() == ref_tokens.tolist()
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert rt.stats.dense_decode_layers == [0, 1, 3]  # the runtime's and the method's
    assert [(r["layer"], r["walk_hops"]) for r in rt.stats.records] == [(2, 1), (4, 2)] * (NEW - 1)
    assert [(r["layer"], r["walk_hops"]) for r in ref_records] == [(2, 1), (4, 2)] * (NEW - 1)


def test_rewind_after_an_exact_prefill_repeats_the_decode(model):
    ids = random_ids(1, 90, seed=13)
    with DecodeRuntime(model, SPEC, batch_size=1, capacity=100, max_new_tokens=NEW) as rt:
        rt.prefill([ids[0]])
        rt.decode()
        first, records = rt.tokens().clone(), list(rt.stats.records)
        rt.rewind()
        assert rt.driver.states[2].sketch.has_history  # the prompt's sketches survive the rewind
        rt.decode()
        assert torch.equal(rt.tokens(), first) and rt.stats.records == records
    result = generate(model, ids, SPEC, max_new_tokens=NEW)
    assert torch.equal(result.tokens, first)


def test_a_separate_prefill_method_leaves_the_decode_its_own_sketches(model):
    ids = random_ids(1, 120, seed=14)
    other = "sketchwalk:variant=reconstruction,density=0.5,block_size=32,sketch_dim=16,dense_layers=0"
    result = generate(model, ids, SPEC, max_new_tokens=NEW, prefill=other)
    st = result.stats
    assert st.prefill == "sparse" and st.prefill_sparse_layers == [1, 2, 3, 4]
    assert st.dense_decode_layers == [0, 1]
    assert [r["walk_hops"] for r in st.records] == [1, 2, 3] * (NEW - 1)


def test_what_sketchwalk_decode_refuses(model):
    ids = random_ids(2, 40, seed=15)
    with pytest.raises(ValueError, match="prefill_chunk: sketchwalk's decode"):
        generate(model, ids[:1], SPEC, max_new_tokens=2, prefill_chunk=16)
    generate(model, ids[:1], SPEC, max_new_tokens=2, prefill_chunk=64)  # one chunk: the whole prompt
    with DecodeRuntime(model, "dense", batch_size=1, capacity=50, max_new_tokens=4) as rt:
        rt.prefill([ids[0]])
        rt.set_method(SPEC)  # the prompt went by without sketchwalk seeing it
        with pytest.raises(ValueError, match="prefill: sketchwalk's decode needs the prompt's sketches"):
            rt.step()
        rt.prefill([ids[0]])
        rt.decode()
        assert rt.stats.records


@pytest.mark.parametrize("prefill", ["exact", "method"])
def test_rows_of_different_lengths_decode_together_as_each_alone(prefill):
    """A method that records each row's prompt (Sketch&Walk) serves a batch of rows of different lengths:
    the rows' prompt records are stacked into one batch state, and every row's tokens and per-step logits
    equal what it gets alone."""
    model = tiny_model("llama", num_hidden_layers=5)
    rows = [random_ids(1, 70, seed=31)[0], random_ids(1, 45, seed=32)[0]]
    together = DecodeRuntime(model, SPEC, batch_size=2, capacity=70 + NEW, max_new_tokens=NEW, prefill=prefill)
    with together:
        together.prefill(rows)
        logits = [together.last_logits.clone()]
        for _ in range(NEW - 1):
            together.step()
            logits.append(together.last_logits.clone())
        tokens = together.tokens()
        assert together.stats.records and {r["backend"] for r in together.stats.records} == {"reference"}
    for b, row in enumerate(rows):
        alone, alone_logits, _ = runtime_generate(model, row[None], SPEC, prefill)
        assert tokens[b].tolist() == alone[0].tolist()
        torch.testing.assert_close(torch.stack([step[b] for step in logits]), alone_logits, atol=1e-5, rtol=1e-5)


def test_sparsify_serves_left_padded_rows_apart_as_each_alone():
    """sparsify + transformers' generate with left-padded rows of different lengths: Sketch&Walk's blocks
    are positions, so each row is served from its first real token (its stats say so), and every row's
    greedy tokens equal its run alone."""
    model = tiny_model("llama", num_hidden_layers=5)
    rows = [random_ids(1, 70, seed=41)[0], random_ids(1, 45, seed=42)[0]]
    ids = torch.zeros(2, 70, dtype=torch.long)
    mask = torch.zeros(2, 70, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, 70 - row.numel():] = row
        mask[b, 70 - row.numel():] = 1
    for phase in ("decode", "all"):
        with torch.no_grad(), kvsieve.sparsify(model, SPEC, phase=phase) as session:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert any("apart" in str(r.get("rows_served", "")) for r in session.records)
        for b, row in enumerate(rows):
            alone, _, _ = sparsify_generate(model, row[None], SPEC, phase)
            assert out[b, 70:].tolist() == alone[0].tolist(), (phase, b)
