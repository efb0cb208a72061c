"""The decode step's K/V cache write compiled (``runtime/cache.py``: ``index_write``, installed by
``runtime/compiled.py``): the same cache as the eager scatters bit for bit, one in-place kernel for K and V
together, and through the runtime the same tokens and cache contents on rows of different lengths."""

import collections

import pytest
import torch
from test_runtime import random_ids, run_under_interpreter, tiny_model

from kvsieve.runtime import DecodeRuntime, compiled
from kvsieve.runtime.cache import index_write


def scatter_write(keys, values, positions, key_states, value_states):
    """The cache's eager decode write (``RuntimeLayer.update``), the reference."""
    b, h = keys.shape[:2]
    keys.scatter_(2, positions.view(b, 1, 1, 1).expand(b, h, 1, keys.shape[3]), key_states.to(keys.dtype))
    values.scatter_(2, positions.view(b, 1, 1, 1).expand(b, h, 1, values.shape[3]), value_states.to(values.dtype))


def buffers(batch, heads, capacity, dk, dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, capacity, dk, generator=g).to(dtype)
    values = torch.randn(batch, heads, capacity, dv, generator=g).to(dtype)
    return keys, values


CASES = [  # batch, heads, capacity, k dim, v dim, cache dtype, new K/V dtype
    (3, 2, 16, 8, 8, torch.bfloat16, torch.bfloat16),
    (1, 4, 9, 16, 16, torch.float16, torch.float16),
    (4, 1, 12, 8, 4, torch.float32, torch.float32),
    (2, 2, 10, 8, 8, torch.bfloat16, torch.float32),  # the cast to the cache's dtype inside the write
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("compile_it", [False, True])
def test_index_write_equals_the_scatters_bit_for_bit(case, compile_it):
    batch, heads, capacity, dk, dv, dtype, new_dtype = case
    write = compiled.compiled_cache_write() if compile_it else index_write
    for seed in range(3):  # ragged positions, the first and last slot included; random cache contents around them
        g = torch.Generator().manual_seed(100 + seed)
        positions = torch.randint(0, capacity, (batch,), generator=g)
        positions[0] = capacity - 1 if seed == 1 else 0 if seed == 2 else positions[0]
        k = torch.randn(batch, heads, 1, dk, generator=g).to(new_dtype)
        v = torch.randn(batch, heads, 1, dv, generator=g).to(new_dtype)
        want_k, want_v = buffers(batch, heads, capacity, dk, dv, dtype, seed)
        got_k, got_v = want_k.clone(), want_v.clone()
        scatter_write(want_k, want_v, positions, k, v)
        write(got_k, got_v, positions, k, v)
        assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))  # bits, not values
        assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def test_inductor_writes_k_and_v_in_place_in_one_kernel():
    """The generated code (inductor's C++ backend here; its scheduler also fuses the two writes for the Triton
    one) runs one kernel that stores both, with no buffer allocated: the scatters' functional form would copy
    each whole cache into a new buffer and back."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    keys, values = buffers(2, 2, 8, 8, 8, torch.bfloat16, 0)
    k, v = (torch.randn(2, 2, 1, 8).to(torch.bfloat16) for _ in range(2))
    _, (code,) = run_and_get_code(compiled.compiled_cache_write(), keys, values, torch.tensor([3, 5]), k, v)
    call = code[code.index("def call("):]
    kernels = [line.strip() for line in call.splitlines() if line.strip().startswith(("cpp_fused", "triton_"))]
    assert len(kernels) == 1, kernels
    assert "empty_strided" not in call and "copy_" not in call, call
    assert code.count("out_ptr0 + ") == 1 and code.count("out_ptr1 + ") == 1  # one store into each cache


@pytest.mark.triton
def test_inductors_triton_code_writes_k_and_v_in_one_kernel_at_every_batch():
    """The Triton code inductor generates for a GPU, generated here for the CPU (``cpu_backend="triton"``; not
    run): one kernel storing both K and V, at batch 1 too, where the two writes share 8 bytes of reads (the
    positions), under inductor's default threshold for fusing kernels side by side (``WRITE_OPTIONS``)."""
    run_under_interpreter("""
        import torch
        import torch._inductor.config as config
        import torch.utils._triton as torch_triton
        from torch._inductor.codegen import triton as codegen
        from kvsieve.runtime.compiled import compiled_cache_write

        torch_triton.triton_hash_with_backend = lambda: "0" * 64  # no GPU driver to hash here
        config.cpu_backend, config.force_disable_caches = "triton", True
        sources, generate = [], codegen.TritonKernel.codegen_kernel

        def keep(self, *args, **kwargs):
            sources.append(generate(self, *args, **kwargs))
            return sources[-1]

        codegen.TritonKernel.codegen_kernel = keep
        for batch in (1, 3):
            torch._dynamo.reset()
            sources.clear()
            keys, values = (torch.randn(batch, 2, 16, 8).to(torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(batch, 2, 1, 8).to(torch.bfloat16) for _ in range(2))
            try:
                compiled_cache_write()(keys, values, torch.arange(batch) + 4, k, v)
            except Exception:  # generated for a CPU no Triton driver runs: only the code is checked
                pass
            assert len(sources) == 1 and sources[0].count("tl.store(") == 2, (batch, sources)
        print("ok")
    """)

def step_ops(step):
    """The torch ops one decode step runs on the CPU, by profiler name (a compiled kernel runs none)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def decode(model, rows, new, **kw):
    """Tokens, every layer's K/V cache after ``new`` tokens, stats, and the torch ops of one more step."""
    with DecodeRuntime(model, "dense", batch_size=len(rows), capacity=max(map(len, rows)) + new + 1,
                       max_new_tokens=new + 1, **kw) as rt:
        rt.prefill(rows)
        for _ in range(new - 1):
            rt.step()
        tokens = rt.out_tokens[:, :new].clone()
        cache = [(layer.keys.clone(), layer.values.clone()) for layer in rt.cache.layers]
        ops = step_ops(rt.step)
        stats = rt.stats
    assert rt.cache.compiled_write is None  # detached with the other compiled pieces
    return tokens, cache, stats, ops


def test_the_runtime_writes_the_same_cache_with_the_compiled_write(monkeypatch):
    """Rows of different lengths: compiled decode steps with and without the compiled write give the same tokens
    and the same cache bit for bit (the slots past each row's length still zero), the stats say which write ran,
    and the compiled one dispatches no scatter; the eager runtime keeps its scatters."""
    model = tiny_model("llama")
    rows = [random_ids(1, n, seed=n)[0] for n in (5, 13, 9)]
    tokens, cache, stats, ops = decode(model, rows, 5, compile_ops=True)
    assert stats.compiled_ops and stats.cache_write == "compiled" and stats.as_dict()["cache_write"] == "compiled"
    # the one scatter left: the new tokens into the output buffer (the runtime's _emit)
    assert ops["aten::scatter_"] == 1 and "aten::index_put_" not in ops, ops
    monkeypatch.setattr(compiled, "CACHE_WRITE", False)
    ref_tokens, ref_cache, ref_stats, ref_ops = decode(model, rows, 5, compile_ops=True)
    assert ref_stats.compiled_ops and ref_stats.cache_write == "scatter" and ref_ops["aten::scatter_"] == 1 + 2 * 2
    assert torch.equal(tokens, ref_tokens)
    for (k, v), (rk, rv) in zip(cache, ref_cache, strict=True):
        assert torch.equal(k.view(torch.int32), rk.view(torch.int32))
        assert torch.equal(v.view(torch.int32), rv.view(torch.int32))
    for b, n in enumerate(map(len, rows)):  # written: the prompt and the new tokens' K/V (the last one's not yet)
        assert cache[0][0][b, :, :n + 4].abs().sum(-1).gt(0).all() and not cache[0][0][b, :, n + 4:].any()
    eager_tokens, _, eager_stats, eager_ops = decode(model, rows, 5, compile_ops=False)
    assert not eager_stats.compiled_ops and eager_stats.cache_write == "scatter"
    assert eager_ops["aten::scatter_"] == 1 + 2 * 2
    assert torch.equal(eager_tokens, tokens)


def test_the_bench_checks_every_way_on_the_cpu(tmp_path):
    """``benchmarks/breakdown/cache_write.py --device cpu``: every way's cache equals the scatters', the table is
    written; bad input is refused by name."""
    from bench_scripts import load_bench

    bench = load_bench("breakdown/cache_write.py")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--cases", "2x40,3x1k", "--layers", "2", "--kv-heads", "2",
            "--head-dim", "8"]
    assert bench.main(argv) == 0
    table = (tmp_path / "cache_write.md").read_text()
    assert table.count("| True |") == 2 * 3 and "| compiled | 3 × 1024 |" in table
    with pytest.raises(ValueError, match="--cases"):
        bench.main([*argv[:4], "--cases", "32k"])
    with pytest.raises(ValueError, match="--ways"):
        bench.main([*argv, "--ways", "scatter,atomic"])


@pytest.mark.gpu
def test_the_captured_step_writes_k_and_v_in_one_kernel_per_layer(monkeypatch):
    """On a GPU, captured: the same tokens and cache bit for bit with and without the compiled write, and the
    step's scatter kernels down to the one of the new tokens (the cache's two per layer gone)."""
    from torch.profiler import ProfilerActivity, profile

    from kvsieve.bench.timing import kernel_totals

    model = tiny_model("llama", dtype=torch.bfloat16, device="cuda", hidden_size=512, intermediate_size=1024,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    rows = [random_ids(1, n, seed=n, vocab=1000, device="cuda")[0] for n in (300, 41, 170)]
    runs = {}
    for write in (True, False):
        monkeypatch.setattr(compiled, "CACHE_WRITE", write)
        with DecodeRuntime(model, "dense", batch_size=3, capacity=400, max_new_tokens=12, eos_token_id=None) as rt:
            rt.prefill(rows)
            rt.decode(10)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                rt.step()
                torch.cuda.synchronize()
            scatters = sum(n for name, (_, n) in kernel_totals(prof).items() if "_scatter_gather" in name)
            runs[write] = (rt.out_tokens.clone(), [(layer.keys.clone(), layer.values.clone())
                                                  for layer in rt.cache.layers], rt.stats, scatters)
    (tokens, cache, stats, scatters), (ref_tokens, ref_cache, ref_stats, ref_scatters) = runs[True], runs[False]
    assert stats.graph and stats.cache_write == "compiled" and ref_stats.cache_write == "scatter"
    assert torch.equal(tokens, ref_tokens)
    for (k, v), (rk, rv) in zip(cache, ref_cache, strict=True):
        assert torch.equal(k.view(torch.int16), rk.view(torch.int16)) and torch.equal(v.view(torch.int16),
                                                                                      rv.view(torch.int16))
    assert ref_scatters - scatters == 2 * 4, (scatters, ref_scatters)
