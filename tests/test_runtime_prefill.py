"""The runtime's sparse prefill (``prefill="method"`` / a prefill method's spec): the same prompt
attention, K/V cache and first-token logits as ``kvsieve.sparsify(..., phase="prefill")``, the method's
dense layers exact, per-row forward state, stats, and the refusals; the TTFT bench on the CPU."""

import math
import re

import pytest
import torch
from transformers import DynamicCache

import kvsieve
from kvsieve.runtime import DecodeRuntime, generate
from tests.test_runtime import random_ids, tiny_model

# layers 0 and 1 stay exact (the default)
SPEC = "sketchwalk:variant=reconstruction,density=0.3,block_size=16,sketch_dim=16"


def sparsify_prefill(model, ids, spec=SPEC, **kw):
    """sparsify's prompt forward under phase='prefill': last logits [1, V], the cache, the session."""
    cache = DynamicCache()
    with torch.no_grad(), kvsieve.sparsify(model, spec, phase="prefill", **kw) as session:
        logits = model(ids, past_key_values=cache, use_cache=True).logits[:, -1]
    return logits, cache, session


def runtime_prefill(model, rows, method="dense", prefill=SPEC, new=3, **kw):
    rt = DecodeRuntime(model, method, batch_size=len(rows), capacity=max(r.numel() for r in rows) + new,
                       max_new_tokens=new, prefill=prefill, **kw)
    rt.attach()
    rt.prefill(rows)
    return rt


@pytest.mark.parametrize("method,prefill", [("dense", SPEC), (SPEC, "method")])
def test_sparse_prefill_equals_sparsify_prefill_phase(method, prefill):
    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_ids(1, 200, seed=3)
    ref, cache, session = sparsify_prefill(model, ids)
    with torch.no_grad():
        exact = model(ids).logits[:, -1]
    with runtime_prefill(model, [ids[0]], method, prefill) as rt:
        # the sparse prefill changes the answer (else this test could not fail) ...
        assert (exact - ref).abs().max() > 1e-2
        # ... and the runtime's is sparsify's: logits (the dense layers' SDPA may take another kernel),
        # first token, every layer's K/V (layer 3's keys depend on layer 2's sparse output)
        torch.testing.assert_close(rt.last_logits, ref, atol=1e-5, rtol=1e-5)
        assert int(rt.out_tokens[0, 0]) == int(ref.argmax())
        for layer in range(4):
            torch.testing.assert_close(rt.cache.layers[layer].keys[:, :, :200], cache.layers[layer].keys)
            torch.testing.assert_close(rt.cache.layers[layer].values[:, :, :200], cache.layers[layer].values)
        st = rt.stats
        assert st.prefill == "sparse" and st.prefill_method == kvsieve.method(SPEC).spec
        assert st.prefill_sparse_layers == [2, 3]  # sketchwalk's dense layers 0 and 1 stayed exact
        ours = [(r["layer"], r["walk_hops"], r["block_density"], r["backend"]) for r in st.prefill_records]
        theirs = [(r["layer"], r["walk_hops"], r["block_density"], r["backend"]) for r in session.records]
        assert ours == theirs and ours[1][1] == 2  # the walk crossed the two sparse layers
        assert 0 < st.prefill_block_density < 1 and st.prefill_block_density == pytest.approx(
            session.mean("block_density"))
        d = st.as_dict()
        assert d["prefill"] == "sparse" and d["prefill_backends"] == ["reference"] and "prefill_records" not in d
        assert st.records == []  # no decode step ran


def test_exact_prefill_is_unchanged_and_says_so():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_ids(1, 60, seed=4)
    with torch.no_grad():
        exact = model(ids).logits[:, -1]
    with runtime_prefill(model, [ids[0]], SPEC, "exact") as rt:
        torch.testing.assert_close(rt.last_logits, exact, atol=1e-5, rtol=1e-5)
        st = rt.stats
        assert st.prefill == "exact" and st.prefill_method is None and st.prefill_sparse_layers == []
        assert st.prefill_records == [] and math.isnan(st.prefill_block_density)
        # the exact prefill's output is SDPA's; sketchwalk (the decode method) recorded its sketches of the
        # prompt on its sparse layers (prefill(sparse=False), as sparsify's phase="decode"), none on 0 and 1
        assert rt.driver.states[2].sketch.has_history and 1 not in rt.driver.states


def test_density_one_sparse_prefill_is_exact():
    model = tiny_model("llama", num_hidden_layers=3)
    ids = random_ids(1, 90, seed=5)
    with torch.no_grad():
        exact = model(ids).logits[:, -1]
    spec = "sketchwalk:variant=reconstruction,density=1.0,block_size=16,dense_layers=0"
    with runtime_prefill(model, [ids[0]], prefill=spec) as rt:
        torch.testing.assert_close(rt.last_logits, exact, atol=1e-4, rtol=1e-4)
        assert rt.stats.prefill_sparse_layers == [1, 2] and rt.stats.prefill_block_density == 1.0


def test_runtime_dense_layers_stay_exact_in_the_sparse_prefill():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_ids(1, 120, seed=6)
    ref, _, session = sparsify_prefill(model, ids, dense_layers=[2])
    with runtime_prefill(model, [ids[0]], dense_layers=[2]) as rt:
        assert rt.stats.prefill_sparse_layers == [3]
        assert [r["walk_hops"] for r in rt.stats.prefill_records] == [1]
        torch.testing.assert_close(rt.last_logits, ref, atol=1e-5, rtol=1e-5)
        assert {r["layer"] for r in session.records} == {3}


def test_rows_prefill_with_their_own_walk():
    """Two rows of different lengths (one forward each): each row's first token and logits are those of
    the row prefilled alone, so the walk (forward state) starts anew per row."""
    model = tiny_model("llama", num_hidden_layers=4)
    rows = [random_ids(1, n, seed=n)[0] for n in (150, 97)]
    with runtime_prefill(model, rows) as rt:
        both = rt.last_logits.clone()
        assert [(r["row"], r["layer"]) for r in rt.stats.prefill_records] == [(0, 2), (0, 3), (1, 2), (1, 3)]
        assert [r["walk_hops"] for r in rt.stats.prefill_records] == [1, 2, 1, 2]
    for b, row in enumerate(rows):
        ref, _, _ = sparsify_prefill(model, row[None])
        torch.testing.assert_close(both[b:b + 1], ref, atol=1e-5, rtol=1e-5)


def test_method_prefill_hands_its_sketches_to_the_decode_and_rewind_repeats_it():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_ids(1, 100, seed=7)
    with runtime_prefill(model, [ids[0]], SPEC, "method", new=6) as rt:
        assert rt.driver.states[2].sketch.has_history  # the prompt's sketches, from the sparse prefill
        rt.decode()
        first = rt.tokens().clone()
        assert {r["phase"] for r in rt.stats.records} == {"decode"}
        rt.rewind()
        assert rt.driver.states[2].sketch.has_history
        rt.decode()
        assert torch.equal(rt.tokens(), first)
    # kvsieve.generate: the same tokens, and the decode steps after a separate prefill method are dense
    result = generate(model, ids, SPEC, max_new_tokens=6, prefill="method")
    assert torch.equal(result.tokens, first) and result.stats.prefill == "sparse"
    dense_decode = generate(model, ids, "dense", max_new_tokens=6, prefill=SPEC)
    assert dense_decode.stats.records == [] and dense_decode.stats.prefill_sparse_layers == [2, 3]
    assert int(dense_decode.tokens[0, 0]) == int(first[0, 0])  # the first token comes from the prefill alone


def test_bad_prefill_arguments_are_refused_by_name():
    model = tiny_model("llama", num_hidden_layers=4)
    ids = random_ids(1, 40, seed=8)
    with pytest.raises(ValueError, match="prefill: 'method' needs a method with a sparse prefill"):
        generate(model, ids, "streaming:sink=4,window=8", max_new_tokens=2, prefill="method")
    with pytest.raises(ValueError, match="prefill: streaming has no sparse prefill"):
        generate(model, ids, "dense", max_new_tokens=2, prefill="streaming:sink=4,window=8")
    with pytest.raises(ValueError, match="prefill: expected 'exact', 'method'"):
        generate(model, ids, "dense", max_new_tokens=2, prefill="sparse")
    with pytest.raises(ValueError, match="prefill: expected 'exact', 'method'"):
        generate(model, ids, "dense", max_new_tokens=2, prefill=True)
    with pytest.raises(ValueError, match="prefill_chunk: chunked prefill is exact only"):
        generate(model, ids, "dense", max_new_tokens=2, prefill=SPEC, prefill_chunk=16)
    with pytest.raises(ValueError, match="prefill: .* would prefill no layer sparsely"):
        generate(model, ids, "dense", max_new_tokens=2, prefill=SPEC, dense_layers=[2, 3])
    with pytest.raises(ValueError, match="dense_layers: layers \\[7\\]"):
        generate(model, ids, "dense", max_new_tokens=2, prefill="sketchwalk:dense_layers=0/7")
    # set_method keeps the prefill choice and refuses a method it does not fit, leaving the runtime as it was
    with DecodeRuntime(model, SPEC, batch_size=1, capacity=50, max_new_tokens=4, prefill="method") as rt:
        with pytest.raises(ValueError, match="prefill: 'method'"):
            rt.set_method("dense")
        assert rt.method.name == "sketchwalk" and rt.prefill_choice == "method"
        rt.set_method("dense", prefill="exact")
        assert rt.prefill_driver is None


def test_ttft_bench_rows_on_a_tiny_shape(monkeypatch, tmp_path):
    from kvsieve.bench import e2e

    monkeypatch.setitem(e2e.MODEL_SHAPES, "tiny", dict(
        model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False))
    seen = []
    res = e2e.run_ttft_bench(shapes=("tiny",), cases=[(1, 200), (1, 600)], methods=(SPEC,), repeats=2, warmup=1,
                             device="cpu", dtype=torch.float32, log=lambda s: None,
                             checkpoint=lambda partial: seen.append(len(partial["rows"])))
    assert res["kind"] == "e2e-ttft" and seen == [3, 4]
    rows = res["rows"]
    done = {r["variant"]: r for r in rows if "ttft_ms" in r}
    assert set(done) == {"runtime", "hf-eager", SPEC}
    assert [r for r in rows if r["n"] == 600][0]["skipped"].startswith("context 600")
    dense, hf, sparse = done["runtime"], done["hf-eager"], done[SPEC]
    assert dense["prefill"] == "exact" and dense["speedup_vs_runtime_dense"] == 1.0
    assert sparse["prefill"] == "sparse" and sparse["prefill_sparse_layers"] == [2, 3]
    assert 0 < sparse["block_density"] < 1 and sparse["prefill_backends"] == ["reference"]
    assert len(sparse["repeats_ms"]) == 2 and sparse["ttft_ms"] > 0
    assert sparse["speedup_vs_runtime_dense"] == pytest.approx(dense["ttft_ms"] / sparse["ttft_ms"])
    # the runtime's exact prefill and transformers' give the same first token; the sparse one is recorded
    assert hf["first_token"] == dense["first_token"] and "first_token" in sparse
    paths = e2e.write_results(res, tmp_path, "ttft", "kvsieve bench e2e --ttft --test")
    text = paths[1].read_text()
    assert all(p.exists() for p in paths) and "time to first token" in text and f"| 200 | {SPEC} |" in text


def test_ttft_bench_refuses_methods_without_a_sparse_prefill():
    from kvsieve.bench import e2e

    with pytest.raises(ValueError, match="methods: streaming has no sparse prefill"):
        e2e.run_ttft_bench(shapes=("smollm2-135m",), cases=[(1, 64)], methods=("streaming",), device="cpu")


def test_cli_bench_ttft_refuses_bad_arguments_before_building_a_model(capsys):
    from kvsieve.cli.main import main

    assert main(["bench", "e2e", "--ttft", "--methods", "streaming:sink=4,window=8"]) == 2
    assert "--methods: streaming has no sparse prefill" in capsys.readouterr().err
    assert main(["bench", "e2e", "--ttft", "--ttft-repeats", "0"]) == 2
    assert "--ttft-repeats: expected an integer >= 1" in capsys.readouterr().err


def test_cli_generate_refuses_bad_prefill_choices(capsys, tmp_path):
    from kvsieve.cli.main import main

    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    cases = [(["--method", "streaming:sink=4,window=8", "--prefill", "method"],
              "--prefill method: streaming (--method) has no sparse prefill"),
             (["--prefill", "streaming"], "--prefill: streaming has no sparse prefill"),
             (["--prefill", "sketchwalk", "--engine", "sparsify"], "--prefill sketchwalk: the sparse prefill runs in "
                                                                   "the runtime")]
    for extra, message in cases:
        assert main(["generate", "--prompt-file", str(prompt), *extra]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow  # about 20 s on 2 cores; the runtime's sparse prefill itself is tested above on tiny models
@pytest.mark.model
def test_cli_generate_with_a_sparse_prefill(capsys):
    from kvsieve.cli.main import main

    assert main(["generate", "--demo", "--context-tokens", "256", "--max-new-tokens", "2",
                 "--method", "sketchwalk:variant=reconstruction,density=0.2,block_size=32", "--prefill", "method"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "sparse prefill by sketchwalk:variant=reconstruction,block_size=32 on layers 2-29 (the others exact)" in out
    assert "block density 0." in out and re.search(r"exact prefill of \d+ tokens: [\d.]+ s \(dense run\)", out)
