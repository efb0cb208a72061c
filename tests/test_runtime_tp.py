"""The runtime on a model sharded by transformers' tensor-parallel plan: 2 CPU processes, gloo.

One launch (loading is the slow part) checks everything that needs ranks: the same greedy tokens as the
single-process runtime for dense and for deterministic methods, the same sampled tokens on every rank,
each rank's cache holding its own KV heads only, the tp stats, and ranks that disagree on the seed
getting the same error without a hang."""

import pytest
import torch

from kvsieve.runtime import DecodeRuntime, generate
from kvsieve.runtime.parallel import TensorParallel, launch, spec_of, tensor_parallel
from kvsieve.runtime.support import ModelShape

SPECS = ("dense", "streaming:sink=4,window=8", "quest:top_k=16,sink=4,window=8,page_size=4")
COMPILED_SPECS = ("dense", SPECS[2])
NEW = 6
# profiler names of work done per decode step: an op not inside another, no view; inductor's CPU kernels
VIEW_OPS = {"aten::view", "aten::reshape", "aten::transpose", "aten::unsqueeze", "aten::expand", "aten::slice",
            "aten::select", "aten::as_strided", "aten::t", "aten::permute", "aten::_unsafe_view", "aten::squeeze",
            "aten::detach", "aten::alias", "aten::split", "aten::chunk", "aten::contiguous", "aten::empty",
            "aten::empty_strided", "aten::lift_fresh", "aten::_reshape_alias", "aten::view_as", "aten::narrow",
            "aten::unbind", "aten::empty_like", "aten::item", "aten::_local_scalar_dense"}


def tiny_llama(seed=0, **overrides):
    import transformers as tf

    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
              pad_token_id=None)
    cfg = tf.LlamaConfig(**{**kw, **overrides})
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(cfg).eval()


def step_ops(model, ids, compile_ops):
    """What one decode step runs, by name (see VIEW_OPS), as the CPU profiler records it."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    with DecodeRuntime(model, "dense", batch_size=ids.shape[0], capacity=ids.shape[1] + 3, max_new_tokens=3,
                       compile_ops=compile_ops) as rt:
        rt.prefill(list(ids))  # the first new token
        rt.step()  # compiles
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rt.step()
    ops = collections.Counter()
    for event in prof.events():
        if "cpp_fused" in event.name:
            ops["inductor kernel"] += 1
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None and not nested:
            nested, parent = parent.name.startswith(("aten::", "c10d::")), parent.cpu_parent
        if event.name.startswith(("aten::", "c10d::")) and not nested and event.name not in VIEW_OPS:
            ops[event.name] += 1
    return ops


def _compiled_checks(model, ids, res):
    """compile_ops=True on the sharded model: tokens and stats per spec, what the compiled graphs hold, and
    the ops of one step with and without it."""
    import torch._inductor.config
    from torch._inductor.compile_fx import compile_fx

    import kvsieve.runtime.compiled as compiled

    torch._inductor.config.cpp.enable_kernel_profile = True  # inductor's kernels appear as profiler events
    graphs = []

    def recording(gm, example_inputs):  # inductor, keeping each graph it is given
        graphs.append(sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"}))
        return compile_fx(gm, example_inputs)

    compiled.BACKEND = recording
    try:
        res["compiled"] = {}
        for spec in COMPILED_SPECS:
            r = generate(model, ids, spec, max_new_tokens=NEW, seed=3, compile_ops=True)
            res["compiled"][spec] = (r.tokens, r.stats.compiled_ops, r.stats.tp["fallbacks"], r.stats.fallbacks,
                                     r.stats.fused_projections)
        res["graphs"] = graphs
        res["ops"] = {co: step_ops(model, ids, co) for co in (False, True)}
        res["row_reduced"] = _row_reduced(model, ids)
    finally:
        compiled.BACKEND = "inductor"


class CountingAllReduce:
    """A stand-in for the symmetric-memory reducer on gloo ranks: the same interface, a plain all-reduce."""

    def __init__(self):
        self.calls = 0

    def serves(self, x, weight):
        return True

    def linear(self, x, weight):
        import torch.distributed as dist

        self.calls += 1
        out = x @ weight.t()
        dist.all_reduce(out)
        return out


def _row_reduced(model, ids):
    """compile_ops=True with the runtime's row-parallel forwards summing through a reducer of its choosing
    (here one that counts): tokens per spec, the reducer's calls, and the note a CPU rank records by default."""
    import kvsieve.runtime.engine as engine

    out, chosen = {}, engine.step_all_reduce
    try:
        for spec in COMPILED_SPECS:
            reducer = CountingAllReduce()
            engine.step_all_reduce = lambda *a, reducer=reducer: (reducer, "row-parallel all-reduces: counting")
            r = generate(model, ids, spec, max_new_tokens=NEW, seed=3, compile_ops=True)
            out[spec] = (r.tokens, reducer.calls, r.stats.tp["fallbacks"])
    finally:
        engine.step_all_reduce = chosen
    out["default"] = generate(model, ids, "dense", max_new_tokens=2, compile_ops=True).stats.tp["fallbacks"]
    return out


def _rank(rank, size, path, ids, out):
    """One rank: load the checkpoint sharded, run every check, save what the parent compares."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=size),
                                                 dtype=torch.float32).eval()
    res = {"tokens": {}, "stats": {}, "density": {}}
    for spec in SPECS + (saap_spec(path),):
        result = generate(model, ids, spec, max_new_tokens=NEW, seed=3)
        res["tokens"][spec] = result.tokens
        res["stats"][spec] = result.stats.tp
        res["density"][spec] = result.stats.mean("density")
    _compiled_checks(model, ids, res)
    res["sampled"] = generate(model, ids, "dense", max_new_tokens=NEW, do_sample=True, temperature=2.0,
                              seed=11).tokens
    with DecodeRuntime(model, "dense", batch_size=ids.shape[0], capacity=ids.shape[1] + 2, max_new_tokens=2) as rt:
        rt.prefill(list(ids))
        res["keys"] = [layer.keys.clone() for layer in rt.cache.layers]
        res["cache_bytes"] = rt.stats.cache_bytes
    # the benchmark's builder: random shards made on each rank from transformers' plan, no checkpoint
    from kvsieve.bench.e2e_tp import build_sharded_model, collectives

    built = build_sharded_model("tiny-llama", size, device="cpu", dtype=torch.float32, seed=5)
    res["built_state"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                          for k, v in built.state_dict().items()}
    res["built_local_k"] = tuple(built.model.layers[0].self_attn.k_proj.weight.to_local().shape)
    res["built_tokens"] = generate(built, ids, "dense", max_new_tokens=NEW).tokens
    res["collectives"] = collectives(built, 2, iters=3)
    try:  # a rank that asks for another seed: every rank gets the error, none waits forever
        generate(model, ids, "dense", max_new_tokens=2, seed=rank)
        res["disagree"] = None
    except ValueError as exc:
        res["disagree"] = str(exc)
    torch.save(res, f"{out}/rank{rank}.pt")


def saap_spec(path):
    """SAAP on the artifacts beside the checkpoint at ``path`` (a short window, so buckets decide)."""
    return f"saap:artifacts={path}-saap,probes=2,window=8,window_min=8,window_scale=0.0"


def test_tp2_gives_the_single_process_tokens_and_shards_the_cache(tmp_path):
    from saap_helpers import write_artifacts

    model = tiny_llama()
    model.save_pretrained(tmp_path / "model")
    # artifacts of this model (random, well formed): each rank takes its KV head's slice of them
    (tmp_path / "model-saap").mkdir()
    write_artifacts(tmp_path / "model-saap", heads=4, kv_heads=2, head_dim=16, layers=2, clusters=8, per="q",
                    model=model)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    launch(_rank, 2, str(tmp_path / "model"), ids, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    for spec in SPECS + (saap_spec(tmp_path / "model"),):
        ref = generate(model, ids, spec, max_new_tokens=NEW, seed=3).tokens
        for r, res in enumerate(ranks):
            assert res["tokens"][spec].tolist() == ref.tolist(), (spec, r)
            tp = res["stats"][spec]
            assert (tp["ranks"], tp["rank"], tp["heads"], tp["kv_heads"], tp["kv_head_offset"]) == (2, r, 2, 1, r)
            assert spec == "dense" or res["density"][spec] < 0.9  # the method ran, and sparsely
            if spec.startswith("saap"):  # its artifacts sliced to the rank's KV head
                assert any(f"KV heads [{r}, {r + 1})" in n for n in tp["fallbacks"]), tp["fallbacks"]
            assert tp["backend"] == "gloo" and tp["plan"]["model.layers.*.self_attn.k_proj"] == "colwise"
    for spec in COMPILED_SPECS:  # the compiled pieces on local tensors: the same tokens as one process
        ref = generate(model, ids, spec, max_new_tokens=NEW, seed=3).tokens
        for r, res in enumerate(ranks):
            tokens, compiled, tp_notes, fallbacks, fused_projections = res["compiled"][spec]
            assert tokens.tolist() == ref.tolist() and compiled and not fallbacks, (spec, r)
            # each layer's q/k/v and gate/up as one product over the rank's column shards
            assert fused_projections == {"groups": 2 * 2, "refused": {}}, fused_projections
            # the row-parallel products (o_proj, down_proj) summed by the runtime's reducer in decode steps
            row_tokens, calls, notes = res["row_reduced"][spec]
            assert row_tokens.tolist() == ref.tolist() and calls == (NEW - 1) * 2 * 2, (spec, calls)
            assert "row-parallel all-reduces: counting" in notes
            assert any("symmetric memory needs CUDA ranks" in n for n in res["row_reduced"]["default"])
            assert any("sharded modules mlp.down_proj left out" in n and "Linears mlp.gate_proj, mlp.up_proj traced"
                       in n for n in tp_notes), tp_notes
    for res in ranks:
        # every traced graph is local: no collective, no DTensor; together they hold the norms, the MLP's local
        # column-parallel matmuls and its SiLU
        traced = [op for graph in res["graphs"] for op in graph]
        assert res["graphs"] and not [op for op in traced if "c10d" in op or "DTensor" in op or "reduce" in op]
        assert {"rsqrt", "silu", "linear"} <= {name for name in ("rsqrt", "silu", "linear") for op in traced
                                                if name in op}
        plain, fused = res["ops"][False], res["ops"][True]
        # the same collectives (transformers runs them, eagerly, between the graphs) and fewer ops per step
        assert plain["c10d::allreduce_"] == fused["c10d::allreduce_"] == 5
        assert fused["inductor kernel"] > 0 and plain["inductor kernel"] == 0
        assert fused["aten::rsqrt"] == 1 and plain["aten::rsqrt"] == 5  # only the final norm left uncompiled
        # per layer 6 kernels, as in one process: norm; RoPE; the K/V cache write; add and norm; SiLU·mul; add
        assert fused["inductor kernel"] == 2 * 6 and fused["aten::silu"] == plain["aten::mm"] == 0
        assert fused["aten::scatter_"] == plain["aten::scatter_"] - 2 * 2  # the cache's two scatters per layer
        # a layer's gate/up: one product, traced (mm); its q/k/v: one product (linear), eager inside attention
        assert fused["aten::mm"] == 2 and fused["aten::linear"] == plain["aten::linear"] - 2 * 2 - 2 * 2
        assert sum(fused.values()) < 0.7 * sum(plain.values()), (plain, fused)
    sampled = generate(model, ids, "dense", max_new_tokens=NEW, do_sample=True, temperature=2.0, seed=11).tokens
    assert ranks[0]["sampled"].tolist() == ranks[1]["sampled"].tolist() == sampled.tolist()

    # each rank's cache: its own KV head (rank r holds global head r of 2), the prompt's keys as one process has them
    with DecodeRuntime(model, "dense", batch_size=2, capacity=42, max_new_tokens=2) as rt:
        rt.prefill(list(ids))
        full = [layer.keys.clone() for layer in rt.cache.layers]
        full_bytes = rt.stats.cache_bytes
    for r, res in enumerate(ranks):
        assert res["cache_bytes"] * 2 == full_bytes
        for layer, keys in enumerate(res["keys"]):
            assert keys.shape == (2, 1, 42, 16)
            torch.testing.assert_close(keys[:, :, :40], full[layer][:, r:r + 1, :40], rtol=1e-5, atol=1e-5)

    # the sharded random build is one consistent model: its gathered weights give the same tokens in one process
    from kvsieve.bench.e2e_tp import shape_config

    assert ranks[0]["built_local_k"] == (16 * 1, 64)  # tiny-llama: 2 KV heads of 16 over 2 ranks
    for k, v in ranks[0]["built_state"].items():
        torch.testing.assert_close(v, ranks[1]["built_state"][k])
    import transformers as tf

    whole = tf.LlamaForCausalLM(shape_config("tiny-llama")).eval()
    whole.load_state_dict(ranks[0]["built_state"], strict=False)
    missing = {n for n, _ in whole.named_parameters()} - set(ranks[0]["built_state"])
    assert not missing
    assert ranks[0]["built_tokens"].tolist() == ranks[1]["built_tokens"].tolist()
    assert generate(whole, ids, "dense", max_new_tokens=NEW).tokens.tolist() == ranks[0]["built_tokens"].tolist()
    comm = ranks[0]["collectives"]
    assert comm["all_reduces"] == 5 and comm["collective_ms"] > 0 and len(comm["collective_ms_by_rank"]) == 2
    assert comm["collective_path"] == "gloo"  # symmetric memory's one-shot is for CUDA ranks only

    for res in ranks:
        assert res["disagree"] is not None and "the tensor-parallel ranks disagree" in res["disagree"]
        assert "'seed', 0" in res["disagree"] and "'seed', 1" in res["disagree"]


class _Sharded(torch.nn.Module):
    def __init__(self, size, **plan):
        super().__init__()
        self._tp_size = size
        self._tp_plan = {f"model.layers.*.{k}": v for k, v in plan.items()}


def test_head_counts_that_do_not_shard_are_refused():
    shape = ModelShape("llama", 2, heads=8, kv_heads=2, head_dim=16, max_context=None)
    with pytest.raises(ValueError, match="2 KV heads do not divide by the tensor-parallel size 4: GQA groups"):
        tensor_parallel(_Sharded(4), shape)
    with pytest.raises(ValueError, match="6 query heads do not divide by the tensor-parallel size 4"):
        tensor_parallel(_Sharded(4), ModelShape("llama", 2, heads=6, kv_heads=2, head_dim=16, max_context=None))
    assert tensor_parallel(_Sharded(1), shape) is None
    with pytest.raises(ValueError, match="the tensor-parallel plan does not shard k_proj by heads"):
        tensor_parallel(_Sharded(2), shape)
    with pytest.raises(ValueError, match="shards k_proj as \\['rowwise'\\]; the runtime expects 'colwise'"):
        tensor_parallel(_Sharded(2, k_proj="rowwise"), shape)
    with pytest.raises(ValueError, match="leaves lm_head's logits sharded"):
        tensor_parallel(_Sharded(2, k_proj="colwise", **{"lm_head": "colwise"}), shape)
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        tensor_parallel(_Sharded(2, k_proj="colwise"), shape)


def test_sharded_modules_are_the_outermost_ones_the_plan_wrapped_or_gave_dtensors():
    from kvsieve.runtime.parallel import layer_sharding, sharded_modules

    def split(model):
        sharding = layer_sharding(model)
        return sharding.left_out_names, sharding.local_names, sharding.blocker

    model = tiny_llama()
    layer = model.model.layers[0]
    assert sharded_modules(layer) == [] and split(model) == ([], [], None)
    layer.mlp.down_proj.forward = layer.mlp.down_proj.forward  # a forward replaced on the instance, as the plan does
    layer.self_attn.q_proj.forward = layer.self_attn.q_proj.forward
    class Shard(torch.Tensor):  # what a DTensor parameter shows: its local tensor and placements
        placements = ()

        def to_local(self):
            return self

    layer.mlp.up_proj._parameters["weight"] = torch.zeros(2).as_subclass(Shard)
    layer.mlp.gate_proj.forward = layer.mlp.gate_proj.forward
    names = [n for n, _ in sharded_modules(layer, skip=(layer.self_attn,))]
    assert names == ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert [n for n, _ in sharded_modules(layer)][0] == "self_attn.q_proj"
    # gate_proj is "colwise" in the plan but its weight is no column-sharded DTensor: left out, as the others
    assert split(model) == (["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"], [], None)
    layer.mlp.forward = layer.mlp.forward  # the whole MLP wrapped: it is left out whole, not its projections
    assert split(model) == (["mlp"], [], None)
    model.model.layers[1].forward = model.model.layers[1].forward
    assert split(model)[2] == "the plan shards the decoder layer LlamaDecoderLayer itself"


def test_methods_that_cannot_run_on_local_heads_are_refused():
    from kvsieve.core.registry import method

    tp = TensorParallel(rank=0, size=2, group=None, heads=2, kv_heads=1, plan={}, backend="gloo")
    fitted = type("Fitted", (), {"name": "saap", "needs_fit": True, "stochastic": False, "spec": "saap"})()
    with pytest.raises(ValueError, match="method: saap runs on artifacts fitted per global head of the whole model "
                                         "and cannot slice them"):
        tp.check_method(fitted)
    assert tp.check_method(method("quest")) == []
    notes = tp.check_method(method("random"))
    assert len(notes) == 1 and "local head index" in notes[0]
    assert tp.as_dict("quest")["fallbacks"] == [] and tp.as_dict("quest", method("random").spec)["fallbacks"] == notes
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tp.compile_ops(False, cuda) is False and tp.compile_ops("auto", cpu) == "auto"
    assert tp.notes == []  # nothing compiles there
    assert tp.compile_ops(True, cpu) is True and "each decoder layer compiled" in tp.notes[0]
    tp.sharding.blocker, tp.notes = "the plan shards the decoder layer Layer itself", []
    with pytest.raises(ValueError, match=r"compile_ops: True is not served on this tensor-parallel model \(the plan"):
        tp.compile_ops(True, cpu)
    assert tp.compile_ops("auto", cuda) is False and tp.notes[0].startswith("compile_ops: off: the plan")
    assert spec_of(" dense ") == "dense" and spec_of(method("quest")) == method("quest").spec and spec_of(None) is None


def test_bench_e2e_tp_runs_every_variant_on_two_cpu_ranks():
    from kvsieve.bench.e2e_tp import markdown, run_tp_bench

    results = run_tp_bench(shape="tiny-llama", tp=2, cases=[(1, 48), (2, 32)], methods=("streaming:sink=4,window=8",),
                           device="cpu", steps=2, method_steps=2, warmup=1, hf_steps=2, dtype=torch.float32)
    # each case from ranks of its own, in the order asked
    assert [(r["batch"], r["n"]) for r in results["rows"]] == [(1, 48)] * 3 + [(2, 32)] * 3
    rows = {r["variant"]: r for r in results["rows"] if r["n"] == 48}
    assert set(rows) == {"runtime", "streaming:sink=4,window=8", "hf-eager"}
    for r in rows.values():
        assert r["ms"] > 0 and len(r["ms_by_rank"]) == 2 and r["collective_ms"] > 0 and r["tp"] == 2
    # each rank reads its own shard: 2 layers of (4 + 2 + 2 + 4) heads × 16 × 64 attention + 3 × 64 × 128 MLP floats
    # over 2 ranks, and half the lm_head, plus the replicated norms
    per_rank = (2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128) // 2 + 256 * 64 // 2 + 5 * 64) * 4
    assert rows["runtime"]["weights_bytes"] == per_rank
    assert rows["runtime"]["tp_stats"]["kv_heads"] == 1 and rows["runtime"]["graph"] is False
    assert rows["streaming:sink=4,window=8"]["density"] < 1
    assert "| tiny-llama | 2 | 1 | 48 | runtime |" in markdown(results, "kvsieve bench e2e --tp 2")


def test_bench_e2e_tp_bad_input(capsys):
    from kvsieve.bench.e2e_tp import run_tp_bench
    from kvsieve.cli.main import main

    with pytest.raises(ValueError, match="tp: llama-3.1-8b has 32 attention heads, not a multiple of --tp 3"):
        run_tp_bench(shape="llama-3.1-8b", tp=3, device="cpu")
    with pytest.raises(ValueError, match="tp: llama-3.1-70b has 8 key value heads, not a multiple of --tp 16"):
        run_tp_bench(shape="llama-3.1-70b", tp=16, device="cpu")
    with pytest.raises(ValueError, match="tp: expected an integer >= 2"):
        run_tp_bench(shape="tiny-llama", tp=1, device="cpu")
    assert main(["bench", "e2e", "--tp", "2", "--shapes", "smollm2-135m"]) == 2
    assert "--shapes: --tp runs one shape of" in capsys.readouterr().err
    if torch.cuda.device_count() < 8:
        assert main(["bench", "e2e", "--tp", "8", "--shapes", "llama-3.1-70b"]) == 2
        assert "--tp: 8 ranks need 8 GPUs (one each)" in capsys.readouterr().err


def test_tp_tables_break_a_step_down_with_its_collectives():
    from kvsieve.bench import e2e, e2e_tp

    def row(variant, **kinds):
        b = dict(attention_ms=2.0, gemm_ms=3.0, other_ms=0.5, kernels=600.0, **kinds)
        return {"shape": "s", "tp": 2, "batch": 1, "n": 8, "variant": variant, "ms": 6.0, "tokens_per_s": 1.0,
                "breakdown": b}

    # a tensor-parallel run: a collectives column, its values in their rows
    results = {"tp": 2, "device": "d", "date": "t", "protocol": "p",
               "rows": [row("runtime", collective_ms=0.75), row("quest", collective_ms=0.5)]}
    text = e2e_tp.markdown(results, "cmd")
    assert "kernel kind on rank 0" in text and "| collectives ms |" in text
    assert "| s | 1 | 8 | runtime | 2.00 | 3.00 | 0.75 | 0.50 | 600 |" in text
    # one GPU: no collectives, no column (rows from before the kind existed have no key for it)
    lines = e2e.breakdown_lines([row("runtime"), row("quest", collective_ms=0.0)])
    assert "collectives" not in "\n".join(lines) and "| s | 1 | 8 | quest | 2.00 | 3.00 | 0.50 | 600 |" in lines
    assert e2e.breakdown_lines([{"variant": "x"}]) == []


# -- GPU: NCCL, the step captured in a CUDA graph per rank --------------------------------------------

GPU_SHAPE = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                 num_attention_heads=8, max_position_embeddings=4096)
GPU_SPECS = ("dense", "quest:top_k=0.05,sink=16,window=64", "streaming:sink=16,window=256")


def _rank_gpu(rank, size, path, rows, out):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=size),
                                                 dtype=torch.float32).eval()
    rows = [r.to(f"cuda:{rank}") for r in rows]
    res = {}
    for spec in GPU_SPECS + (saap_spec(path),):
        r = generate(model, rows, spec, max_new_tokens=24, graph=True, eos_token_id=None)
        res[spec] = (r.tokens, r.stats.graph, r.stats.attention_backend, r.stats.tp, r.stats.compiled_ops)
    res["sampled"] = generate(model, rows, "dense", max_new_tokens=24, graph=True, do_sample=True, seed=3,
                              eos_token_id=None).tokens
    r = generate(model, rows, "dense", max_new_tokens=24, graph=True, eos_token_id=None, compile_ops=False)
    res["uncompiled"] = (r.tokens, r.stats.compiled_ops)
    torch.save(res, f"{out}/rank{rank}.pt")


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 4])
def test_tp_on_gpus_gives_the_single_gpu_tokens_with_the_step_captured(tmp_path, size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs")
    from saap_helpers import write_artifacts

    # one KV head a rank (the fewest a rank can hold); float32: no argmax tie
    # between a sharded and a whole matmul
    model = tiny_llama(**GPU_SHAPE, num_key_value_heads=size)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "model-saap").mkdir()  # SAAP's artifacts of this model: each rank takes its KV head's slice
    write_artifacts(tmp_path / "model-saap", heads=8, kv_heads=size, head_dim=64, layers=4, clusters=16, per="q",
                    model=model)
    rows = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)) for n in (1500, 700)]
    launch(_rank_gpu, size, str(tmp_path / "model"), rows, str(tmp_path), backend="nccl")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    model = model.to("cuda:0")
    rows = [r.to("cuda:0") for r in rows]
    for spec in GPU_SPECS + (saap_spec(tmp_path / "model"),):
        ref = generate(model, rows, spec, max_new_tokens=24, graph=True, eos_token_id=None)
        for r, res in enumerate(ranks):
            tokens, graph, backend, tp, compiled = res[spec]
            assert graph and backend == ref.stats.attention_backend and tp["backend"] == "nccl", (spec, r)
            # the decoder layers compiled around transformers' sharded modules, captured with the collectives
            assert compiled and ref.stats.compiled_ops, (spec, r, tp["fallbacks"])
            assert any(n.startswith("compile_ops: each decoder layer compiled") for n in tp["fallbacks"])
            # the row-parallel products summed through symmetric memory in the captured decode steps
            assert any("symmetric memory's one-shot in decode steps" in n for n in tp["fallbacks"]), tp["fallbacks"]
            assert tokens.tolist() == ref.tokens.tolist(), (spec, r)
    assert all(res["sampled"].tolist() == ranks[0]["sampled"].tolist() for res in ranks)
    dense = generate(model, rows, "dense", max_new_tokens=24, graph=True, eos_token_id=None, compile_ops=False).tokens
    for res in ranks:  # the captured step without compile_ops, as before it served sharded models
        assert res["uncompiled"][0].tolist() == dense.tolist() and not res["uncompiled"][1]
