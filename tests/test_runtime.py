"""The decode runtime (issue 16): same tokens as transformers' generate, per-row lengths, EOS,
counter-based sampling, methods, bad input; on CPU eagerly, on CUDA with the graph (``gpu`` tests)."""

import math

import pytest
import torch

import kvsieve
from kvsieve.runtime import DecodeRuntime, SamplingConfig, generate, prompt_rows
from kvsieve.runtime.sampling import choose_tokens, counter_uniforms


def tiny_model(family="llama", seed=0, dtype=torch.float32, device="cpu", **overrides):
    """A randomly initialised 2-layer causal LM of ``family`` (GQA 4 query / 2 KV heads)."""
    import transformers as tf

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  attn_implementation="sdpa", eos_token_id=None, bos_token_id=None, pad_token_id=None)
    common.update(overrides)
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "mistral":
        common.setdefault("sliding_window", None)
        cfg, cls = tf.MistralConfig(**common), tf.MistralForCausalLM
    elif family == "gemma":
        cfg, cls = tf.GemmaConfig(**{**common, "head_dim": 16}), tf.GemmaForCausalLM
    elif family == "gemma2":
        cfg, cls = tf.Gemma2Config(**{**common, "head_dim": 16}), tf.Gemma2ForCausalLM
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**{"head_dim": 16, "query_pre_attn_scalar": 16, **common})
        cls = tf.Gemma3ForCausalLM
    else:
        raise AssertionError(family)
    torch.manual_seed(seed)
    return cls(cfg).eval().to(device=device, dtype=dtype)


def random_ids(batch, length, seed=0, vocab=97, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)


def hf_greedy(model, ids, new, **kw):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, **kw)
    return out[:, ids.shape[1]:].cpu()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma"])
@pytest.mark.parametrize("chunk", [8192, 7])
def test_dense_greedy_equals_transformers_generate(family, chunk):
    model = tiny_model(family)
    ids = random_ids(1, 23, seed=1)
    ref = hf_greedy(model, ids, 16, pad_token_id=0)
    result = generate(model, ids, max_new_tokens=16, prefill_chunk=chunk)
    assert result.tokens.tolist() == ref.tolist()
    s = result.stats
    assert s.graph is False and s.attention_backend == "sdpa" and s.decode_steps == 15
    assert s.new_tokens == [16] and s.prompt_lengths == [23] and s.capacity == 23 + 16
    assert model.config._attn_implementation == "sdpa"  # restored


def test_compiled_decode_ops_give_transformers_greedy_output_and_come_off_cleanly():
    """compile_ops=True (on the CPU here: inductor's C++ backend) runs the decoder layers' norms, adds,
    MLP and RoPE compiled in decode steps: same greedy tokens as transformers, logits within float32
    rounding of the uncompiled runtime, and the model's modules are as before once the runtime closes."""
    import transformers.models.llama.modeling_llama as modeling

    model = tiny_model("llama")
    ids = random_ids(2, 20, seed=5)
    rope, layer = modeling.apply_rotary_pos_emb, model.model.layers[0]
    plain = generate(model, ids, "dense", max_new_tokens=6, compile_ops=False)
    fused = generate(model, ids, "dense", max_new_tokens=6, compile_ops=True)
    assert fused.stats.compiled_ops and not plain.stats.compiled_ops
    assert torch.equal(fused.tokens, plain.tokens)
    assert torch.equal(fused.tokens, hf_greedy(model, ids, 6))
    assert modeling.apply_rotary_pos_emb is rope and "forward" not in vars(layer)
    assert "forward" not in vars(layer.self_attn)


def test_rows_keep_their_own_lengths():
    model = tiny_model("llama")
    lengths = [9, 21, 14]
    ids = random_ids(3, 21, seed=2)
    mask = torch.zeros(3, 21, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, 21 - n:] = 1  # left padding, as the tokenizer pads
    result = generate(model, ids, attention_mask=mask, max_new_tokens=10)
    for b, n in enumerate(lengths):
        alone = hf_greedy(model, ids[b:b + 1, 21 - n:], 10, pad_token_id=0)
        assert result.tokens[b].tolist() == alone[0].tolist(), f"row {b}"
    assert result.stats.prompt_lengths == lengths
    # the same prompts given as a list of 1-D tensors
    rows = [ids[b, 21 - n:] for b, n in enumerate(lengths)]
    assert torch.equal(generate(model, rows, max_new_tokens=10).tokens, result.tokens)


def test_the_graph_path_with_device_lengths_equals_transformers():
    """``sdpa-masked`` reads every length from device memory, as the captured step does."""
    model = tiny_model("qwen2")
    rows = [random_ids(1, n, seed=n)[0] for n in (7, 19, 12)]
    result = generate(model, rows, max_new_tokens=9, attention_backend="sdpa-masked")
    assert result.stats.attention_backend == "sdpa-masked" and result.stats.fallbacks
    for b, row in enumerate(rows):
        assert result.tokens[b].tolist() == hf_greedy(model, row[None], 9, pad_token_id=0)[0].tolist()


def run_under_interpreter(code: str) -> None:
    """Run ``code`` (which prints "ok" at its end) in a subprocess with Triton's interpreter chosen before
    triton is imported."""
    import os
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=root, env=env, capture_output=True,
                         text=True)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.triton
def test_the_dense_kernel_path_under_the_triton_interpreter():
    """The decode step's own kernel (kernels/shared/dense.py) on rows of different lengths, via the interpreter."""
    run_under_interpreter("""
        import torch
        from tests.test_runtime import tiny_model, random_ids, hf_greedy
        from kvsieve.runtime import generate
        model = tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)  # d = 64
        rows = [random_ids(1, n, seed=n)[0] for n in (9, 30)]
        r = generate(model, rows, max_new_tokens=6, attention_backend="triton")
        assert r.stats.attention_backend == "triton", r.stats
        for b, row in enumerate(rows):
            ref = hf_greedy(model, row[None], 6, pad_token_id=0)[0].tolist()
            assert r.tokens[b].tolist() == ref, (b, r.tokens[b].tolist(), ref)
        print("ok")
    """)


def test_eos_stops_rows_and_pads_like_transformers():
    model = tiny_model("llama")
    ids = random_ids(2, 15, seed=3)
    free = hf_greedy(model, ids, 12, pad_token_id=0)
    eos = int(free[0, 4])  # row 0 emits this token at step 4 (maybe earlier)
    ref = hf_greedy(model, ids, 12, eos_token_id=eos, pad_token_id=1)
    result = generate(model, ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=1, check_every=3)
    assert result.tokens.tolist() == ref.tolist()
    first = [next((i for i, t in enumerate(row) if t == eos), None) for row in free.tolist()]
    assert result.stats.new_tokens[0] == first[0] + 1
    if all(f is not None for f in first):  # every row stopped: the host noticed within check_every steps
        assert result.stats.decode_steps <= max(first) + 3


def test_methods_match_sparsify_with_the_same_seed():
    model = tiny_model("llama")
    ids = random_ids(1, 40, seed=4)
    for spec in ("streaming:sink=4,window=8", "santa-sys:budget=8", "oracle-topk:top_k=6"):
        # the runtime runs the method on every layer; sparsify would keep oracle-topk's 47-key contexts
        # (within its default sink + window) exact unless told to run it everywhere
        with kvsieve.sparsify(model, spec, seed=5, sparse_everywhere=True) as session:
            ref = hf_greedy(model, ids, 8, pad_token_id=0)
        result = generate(model, ids, spec, max_new_tokens=8, seed=5)
        assert result.tokens.tolist() == ref.tolist(), spec
        assert result.stats.graph is False
        # one record per layer per decode step, the same densities sparsify saw
        assert len(result.stats.records) == 2 * 7
        ours = sorted((r["layer"], r["step"], r["density"]) for r in result.stats.records)
        theirs = sorted((r["layer"], r["step"], r["density"]) for r in session.records)
        assert [x[2] for x in ours] == pytest.approx([x[2] for x in theirs])


def test_dense_layers_stay_exact():
    model = tiny_model("llama")
    ids = random_ids(1, 30, seed=6)
    result = generate(model, ids, "streaming:sink=2,window=4", max_new_tokens=5, dense_layers=[0])
    assert {r["layer"] for r in result.stats.records} == {1}


def test_sampling_is_reproducible_and_seeded():
    model = tiny_model("llama")
    ids = random_ids(2, 12, seed=7)
    a = generate(model, ids, max_new_tokens=20, do_sample=True, seed=3, temperature=1.5)
    b = generate(model, ids, max_new_tokens=20, do_sample=True, seed=3, temperature=1.5)
    c = generate(model, ids, max_new_tokens=20, do_sample=True, seed=4, temperature=1.5)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.8)])
def test_counter_sampling_draws_from_the_softmax(top_k, top_p):
    """Chi-square test of 20,000 draws (step counter 0..19,999) against the filtered softmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, generator=g) * 0.8
    cfg = SamplingConfig(do_sample=True, temperature=1.0, top_k=top_k, top_p=top_p, seed=11)
    n = 20000
    steps = torch.arange(n).view(n, 1)
    rows = torch.zeros(1, 1, dtype=torch.int64)
    cols = torch.arange(6).view(1, 6)
    draws = choose_tokens(logits.expand(n, 6), steps, cfg, rows, cols)
    p = torch.softmax(logits[0].double(), -1)
    keep = torch.ones(6, dtype=torch.bool)
    if top_k:
        keep = p >= p.topk(top_k).values[-1]
    if top_p < 1:
        order = p.argsort()
        drop = p[order].cumsum(0) <= 1 - top_p
        keep = torch.ones(6, dtype=torch.bool)
        keep[order[drop]] = False
    p = torch.where(keep, p, 0) / p[keep].sum()
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[~keep].sum() == 0
    expected = p[keep] * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    # P(chi2 > dof + 6 sqrt(2 dof)) is far below 1e-4 for these dof
    assert chi2 < dof + 6 * math.sqrt(2 * dof), chi2


def test_counter_uniforms_are_uniform_and_distinct():
    u = counter_uniforms(7, torch.arange(64).view(64, 1), torch.zeros(1, 1, dtype=torch.int64),
                         torch.arange(4096).view(1, 4096)).flatten().double()
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5
    # distinct values as for independent draws from the 2**23 grid (birthday count, 6 sigma)
    grid, n = 2**23, u.numel()
    expected = grid * (1 - math.exp(-n / grid))
    assert abs(u.unique().numel() - expected) < 6 * math.sqrt(n - expected)


def test_rewind_repeats_the_same_decode():
    model = tiny_model("llama")
    ids = random_ids(2, 10, seed=8)
    with DecodeRuntime(model, "dense", batch_size=2, capacity=30, max_new_tokens=12) as rt:
        rt.prefill(prompt_rows(ids))
        rt.decode()
        first = rt.tokens().clone()
        rt.rewind()
        rt.decode()
        assert torch.equal(rt.tokens(), first)
        with pytest.raises(ValueError, match="max_new_tokens"):
            rt.step()


# -- bad input ------------------------------------------------------------------------------------

def test_soft_capping_is_refused_by_name():
    model = tiny_model("gemma2", attn_logit_softcapping=50.0, attn_implementation="eager")
    with pytest.raises(ValueError, match="soft-capping"):
        generate(model, random_ids(1, 8), max_new_tokens=2)


def test_a_loose_sliding_window_is_recorded():
    """(A binding window is served: tests/test_runtime_window.py.)"""
    model = tiny_model("mistral", sliding_window=16)
    result = generate(model, random_ids(1, 8), max_new_tokens=4)
    assert result.tokens.tolist() == hf_greedy(model, random_ids(1, 8), 4, pad_token_id=0).tolist()
    assert any("never binds" in f for f in result.stats.fallbacks)
    assert result.stats.window_layers == []


def test_unsupported_family_is_refused_by_name():
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        generate(gpt2, random_ids(1, 5, vocab=50), max_new_tokens=2)


def test_lengths_beyond_cache_or_context_are_refused():
    model = tiny_model("llama", max_position_embeddings=32)
    with pytest.raises(ValueError, match="maximum context of 32"):
        generate(model, random_ids(1, 30), max_new_tokens=5)
    with pytest.raises(ValueError, match="allocated cache of max_length=20"):
        generate(model, random_ids(1, 10), max_new_tokens=15, max_length=20)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, random_ids(1, 10), max_new_tokens=0)


def test_device_mismatch_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="device: 'cuda'"):
        generate(model, random_ids(1, 5), max_new_tokens=2, device="cuda")
    with pytest.raises(ValueError, match="graph: True"):
        generate(model, random_ids(1, 5), max_new_tokens=2, graph=True)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, random_ids(1, 5), max_new_tokens=2, do_sample=True, temperature=0)


@pytest.mark.model
def test_default_model_greedy_equals_transformers(default_model):
    from kvsieve.demo import needle_prompt

    model, tok = default_model
    prompt = needle_prompt(tok, 600, 0.5, seed=0)
    ids = prompt.input_ids
    ref = hf_greedy(model, ids, 12, pad_token_id=tok.pad_token_id)
    result = generate(model, ids, max_new_tokens=12)
    assert result.tokens.tolist() == ref.tolist()


# -- GPU: the captured step ------------------------------------------------------------------------

def gpu_model(dtype=torch.bfloat16):
    """4 layers, 8 query / 2 KV heads of dim 64: shapes the Triton dense kernel takes."""
    return tiny_model("llama", dtype=dtype, device="cuda", hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                      max_position_embeddings=4096)


@pytest.mark.gpu
@pytest.mark.parametrize("do_sample", [False, True])
def test_graph_replay_equals_eager_decode(do_sample):
    model = gpu_model(torch.float32)  # float32: no argmax tie between two runs of the same kernels
    lengths = [700, 1500, 33]
    rows = [random_ids(1, n, seed=i, vocab=1000, device="cuda")[0] for i, n in enumerate(lengths)]
    runs = {}
    for graph in (True, False):
        r = generate(model, rows, max_new_tokens=40, graph=graph, do_sample=do_sample, seed=1, eos_token_id=None)
        runs[graph] = r
    assert runs[True].stats.graph and runs[True].stats.attention_backend == "triton"
    assert not runs[False].stats.graph
    assert torch.equal(runs[True].tokens, runs[False].tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["quest:top_k=0.05,sink=16,window=64", "streaming:sink=16,window=256",
                                  "oracle-topk:top_k=0.05,sink=16,window=64"])
def test_captured_selection_methods_equal_their_eager_runs(spec):
    """The captured step runs the method's steady state (Quest's incremental page summaries, kept from
    the warm-up and rewound by the device lengths) and gives the eager run's tokens."""
    model = gpu_model(torch.float32)
    rows = [random_ids(1, n, seed=i, vocab=1000, device="cuda")[0] for i, n in enumerate((1500, 700))]
    runs = {g: generate(model, rows, spec, max_new_tokens=24, graph=g, eos_token_id=None) for g in (True, False)}
    assert runs[True].stats.graph and not runs[False].stats.graph
    assert torch.equal(runs[True].tokens, runs[False].tokens)


@pytest.mark.gpu
def test_graph_step_logits_equal_eager_step():
    model = gpu_model()
    rows = [random_ids(1, n, seed=n, vocab=1000, device="cuda")[0] for n in (300, 900)]
    logits = {}
    for graph in (True, False):
        with DecodeRuntime(model, batch_size=2, capacity=1000, max_new_tokens=8, graph=graph) as rt:
            rt.prefill(rows)
            rt.decode(5)
            torch.cuda.synchronize()
            logits[graph] = rt.last_logits.float().clone()
    # the same kernels on the same inputs; only cuBLAS's choices inside a capture could differ
    torch.testing.assert_close(logits[True], logits[False], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_decode_step_has_no_host_sync():
    model = gpu_model()
    rows = [random_ids(1, 500, seed=0, vocab=1000, device="cuda")[0]]
    with DecodeRuntime(model, batch_size=1, capacity=600, max_new_tokens=20, graph=False) as rt:
        rt.prefill(rows)
        rt.step()  # compiles and allocates
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                rt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_dense_runtime_equals_transformers_on_rows_of_different_length():
    model = gpu_model(dtype=torch.float32)
    lengths = [400, 1200]
    rows = [random_ids(1, n, seed=10 + n, vocab=1000, device="cuda")[0] for n in lengths]
    result = generate(model, rows, max_new_tokens=16, eos_token_id=None)
    assert result.stats.graph
    for b, row in enumerate(rows):
        assert result.tokens[b].tolist() == hf_greedy(model, row[None], 16, pad_token_id=0)[0].tolist()


@pytest.mark.gpu
@pytest.mark.model
def test_gpu_default_model_greedy_equals_transformers():
    from kvsieve.demo import needle_prompt

    try:
        model, tok = kvsieve.load_model("default", device="cuda")
        prompt = needle_prompt(tok, 4000, 0.5, seed=0)
    except (ImportError, FileNotFoundError, OSError) as exc:  # the offline assets are not staged there
        pytest.skip(f"the default model or the essays are not installed: {exc}")
    ids = prompt.input_ids.cuda()
    ref = hf_greedy(model, ids, 24, pad_token_id=tok.pad_token_id)
    result = generate(model, ids, max_new_tokens=24)
    assert result.stats.graph and result.stats.attention_backend == "triton"
    assert result.tokens.tolist() == ref.tolist()


class _CapturableDense(kvsieve.Method):
    """Dense attention plus a perturbation drawn, as the santa kernels draw, from the call's key and
    each row's device length: a graph replaying stale numbers would produce other tokens than eager
    decoding."""

    name = "test-capturable-dense"
    graph_capturable = True
    stochastic = True

    def decode(self, q, k, v, *, lengths=None, key_mask=None, seed=None, scale=None, state=None,
               context=None, check_finite=True):
        from kvsieve.core.rng import as_key, hash_uniform, length_words, seed_words
        from kvsieve.kernels.shared.dense import dense_decode_triton

        out = dense_decode_triton(q, k, v, lengths.to(torch.int32), scale)
        lo, hi = length_words(*seed_words(as_key(seed).host_seed()), lengths)
        u = hash_uniform(lo, hi, 7, torch.zeros_like(lengths))
        n = lengths.to(torch.float64).mean()
        stats = kvsieve.StepStats(n_keys=n, k_rows_scored=n, v_rows_read=n, kv_rows_read=n, density=1.0,
                                  kv_density=1.0, bytes_read=0, backend="triton")
        return out + (u.to(out.dtype) * 2e-3)[:, None, None], stats


@pytest.mark.gpu
def test_a_capturable_method_plugs_into_the_graph():
    model = gpu_model(torch.float32)
    rows = [random_ids(1, n, seed=n, vocab=1000, device="cuda")[0] for n in (256, 640)]
    runs = {g: generate(model, rows, _CapturableDense(), max_new_tokens=24, graph=g, eos_token_id=None)
            for g in (True, False)}
    assert runs[True].stats.graph and not runs[False].stats.graph
    assert torch.equal(runs[True].tokens, runs[False].tokens)
    dense = generate(model, rows, max_new_tokens=24, eos_token_id=None)
    assert not torch.equal(dense.tokens, runs[True].tokens)  # the seeds did reach the method


@pytest.mark.gpu
def test_santa_prop_is_captured_on_gpu():
    model = gpu_model()
    rows = [random_ids(1, 2048, seed=0, vocab=1000, device="cuda")[0]]
    result = generate(model, rows, "santa-prop:budget=64", max_new_tokens=6, eos_token_id=None)
    assert result.stats.graph and result.stats.graph_reason is None and result.stats.compiled_ops
    eager = generate(model, rows, "santa-prop:budget=64", max_new_tokens=6, eos_token_id=None, graph=False)
    assert not eager.stats.graph and eager.stats.backends == {"triton"}


# -- the CLI and the benchmark ----------------------------------------------------------------------

def test_cli_generate_refuses_cuda_without_a_gpu(capsys):
    from kvsieve.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["generate", "--demo", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.model
def test_cli_generate_runs_the_runtime(capsys):
    from kvsieve.cli.main import main

    assert main(["generate", "--demo", "--context-tokens", "600", "--max-new-tokens", "5",
                 "--method", "streaming:sink=16,window=64"]) == 0
    out = capsys.readouterr().out
    assert "runtime on cpu" in out and "per-layer" in out


def test_e2e_bench_rows_on_a_tiny_shape(monkeypatch, tmp_path):
    from kvsieve.bench import e2e

    seen = []
    monkeypatch.setitem(e2e.MODEL_SHAPES, "tiny", dict(
        model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False))
    sketchwalk = "sketchwalk:variant=reconstruction,density=0.3,block_size=8,sketch_dim=8,dense_layers=0"
    res = e2e.run_e2e_bench(shapes=("tiny",), cases=[(2, 40), (1, 600)],
                            methods=("streaming:sink=4,window=8", sketchwalk),
                            steps=3, method_steps=2, hf_steps=2, warmup=1, device="cpu", dtype=torch.float32,
                            log=lambda s: None, checkpoint=lambda partial: seen.append(len(partial["rows"])))
    assert seen == [4, 5]  # the results so far, after each case
    rows = res["rows"]
    done = [r for r in rows if "ms" in r]
    assert {r["variant"] for r in done} == {"runtime", "hf-eager", "streaming:sink=4,window=8", sketchwalk}
    # a method that decodes from its record of the prompts (two rows of one batch) is timed like the others
    sw_row = next(r for r in done if r["variant"] == sketchwalk)
    assert sw_row["kv_bytes_source"] == "method stats" and 0 < sw_row["density"] < 1
    assert all(r["batch"] == 2 and r["n"] == 40 for r in done)
    assert [r for r in rows if r["n"] == 600][0]["skipped"].startswith("context 600")
    method_row = next(r for r in done if r["variant"].startswith("streaming"))
    assert method_row["kv_bytes_source"] == "method stats" and method_row["density"] < 1
    dense_row = next(r for r in done if r["variant"] == "runtime")
    # K and V of 2 rows x 42.5 keys (prompt + 2 or 3 fed tokens in the 2 timed steps after prefill and
    # one warm-up step) x 2 KV heads x d 16 x 4 bytes x 2 layers
    assert dense_row["kv_bytes"] == 2 * 42.5 * 2 * 2 * 16 * 4 * 2
    assert dense_row["speedup_vs_runtime_dense"] == 1.0
    paths = e2e.write_results(res, tmp_path, "e2e", "kvsieve bench e2e --test")
    assert all(p.exists() for p in paths) and "| 40 | runtime |" in paths[1].read_text()
