"""``kvsieve bench e2e --tp N --attention peaked``: the peaked construction on a model sharded by transformers'
tensor-parallel plan (2 CPU processes, gloo) holds exactly the single-process construction's tensors, the
ranks draw the same prompts, and the bench runs it and records it."""

import functools

import pytest
import torch

from kvsieve.bench import peaked as pk
from kvsieve.runtime.parallel import launch

P = pk.PeakedAttention(sink_logit=8.0, local_logit=6.0, window=16.0, match_logit=10.0, vocab=200, spread=1.0)
THETA = 5e5  # not the config's default: the real base must reach every rank's config
REWRITTEN = ("model.embed_tokens.weight", "lm_head.weight") + tuple(
    f"model.layers.{i}.self_attn.{m}_proj.{w}" for i in range(2) for m in "qk" for w in ("weight", "bias"))
SCALED = tuple(f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj"))


def _full(model) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _rank(rank, size, out):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from kvsieve.bench.attention_shape import model_attention_profile
    from kvsieve.bench.e2e_tp import build_sharded_model, gather_heads

    torch.set_num_threads(1)
    res = {}
    pk.ROPE_THETA["tiny-llama"] = THETA  # this process only: the bench's path for a shape with a real base
    build = functools.partial(build_sharded_model, size=size)
    for model_type in ("llama", "qwen2"):  # qwen2: q/k biases, sharded too
        kw = dict(device="cpu", dtype=torch.float32, model_type=model_type)
        if model_type == "llama":  # the bench's own path
            model = pk.build_bench_model(build, "tiny-llama", "peaked", P, **kw)
        else:
            model = pk.peak_model(build("tiny-llama", rope_theta=THETA, **kw), P)
        plain = build("tiny-llama", rope_theta=THETA, **kw)  # the same random shards, not rewritten
        res[model_type] = {"peaked": _full(model), "plain": _full(plain), "theta": pk.model_layout(model.config).theta,
                           "local_q": tuple(model.model.layers[0].self_attn.q_proj.weight.to_local().shape)}
        if model_type == "llama":
            res["prompts"] = torch.stack(pk.bench_prompts(model, 40, 2, torch.Generator().manual_seed(7)))
            res["profile"] = gather_heads(model_attention_profile(model, res["prompts"][:1], last=8))
    # set_param on the other placements: replicated, sharded along dim 1, unevenly sharded, and a wrong shape
    mesh = model.model.layers[0].self_attn.q_proj.weight.device_mesh
    full = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    for label, placement in (("replicate", Replicate()), ("shard1", Shard(1)), ("shard0", Shard(0))):
        t = distribute_tensor(torch.zeros(3, 6), mesh, [placement], src_data_rank=None)
        pk.set_param(t, full)
        res[label] = (t.to_local().clone(), t.full_tensor())
    try:
        pk.set_param(t, full[:2])
    except ValueError as exc:
        res["wrong shape"] = str(exc)
    torch.save(res, f"{out}/rank{rank}.pt")


def _reference(model_type):
    from transformers import AutoModelForCausalLM

    from kvsieve.bench.e2e_tp import shape_config

    cfg = shape_config("tiny-llama", rope_theta=THETA, model_type=model_type)
    return pk.peak_model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), P)


def test_peaked_tp2_shards_hold_the_single_process_construction(tmp_path):
    from kvsieve.bench.attention_shape import STATS, model_attention_profile

    launch(_rank, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for model_type in ("llama", "qwen2"):
        ref = dict(_reference(model_type).state_dict())
        for r in ranks:
            got = r[model_type]
            assert got["theta"] == THETA and got["local_q"] == (32, 64)  # sharded: half of q_proj's 64 rows
            for name in REWRITTEN:  # bit for bit what peak_model writes on one process (same seeds, CPU)
                if name in ref:
                    assert torch.equal(got["peaked"][name], ref[name]), (model_type, name)
            bias = "model.layers.0.self_attn.q_proj.bias"  # qwen2's: ones before, zeros after
            assert (bias in ref) == (model_type == "qwen2")
            assert bias not in ref or (got["plain"][bias] == 1).all() and not got["peaked"][bias].any()
            for name in SCALED:  # the residual branches: this model's own random shards, times RESIDUAL_SCALE
                assert torch.equal(got["peaked"][name], got["plain"][name] * pk.RESIDUAL_SCALE), name
            for name, value in got["plain"].items():  # the rest untouched
                if name not in REWRITTEN + SCALED:
                    assert torch.equal(got["peaked"][name], value), name
    # the same prompts on every rank, bench_prompts' peaked ones
    model = _reference("llama")
    want = torch.stack(pk.bench_prompts(model, 40, 2, torch.Generator().manual_seed(7)))
    assert all(torch.equal(r["prompts"], want) for r in ranks)
    assert (want[:, 0] == pk.BOS).all() and int(want[:, 1:].min()) >= 1 and int(want.max()) <= P.vocab
    # the gathered profile is the whole model's, heads in order: close to the single-process model's per
    # (layer, head) (the hidden states differ by the random residual branches, scaled by 1e-3: 2e-3 apart
    # at most here), while the ranks' blocks of heads swapped would be far more than that apart
    single = model_attention_profile(model, want[:1], last=8)
    for r in ranks:
        assert torch.equal(r["profile"]["layers"], single["layers"])
        for s in STATS:
            assert r["profile"][s].shape == single[s].shape == (2, 4)
            assert torch.allclose(r["profile"][s], single[s], atol=1e-2), s
    for s in ("entropy", "sink", "top1"):
        assert float((single[s][:, [2, 3, 0, 1]] - single[s]).abs().amax()) > 0.05, s
    # set_param on a replicated, a dim-1 and an uneven dim-0 shard (3 rows over 2 ranks: 2 and 1)
    for rank, r in enumerate(ranks):
        full = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
        assert torch.equal(r["replicate"][0], full) and torch.equal(r["replicate"][1], full)
        assert torch.equal(r["shard1"][0], full[:, 3 * rank:3 * rank + 3])
        assert torch.equal(r["shard0"][0], full[:2] if rank == 0 else full[2:])
        assert torch.equal(r["shard1"][1], full) and torch.equal(r["shard0"][1], full)
        assert "has shape (3, 6), the values written have (2, 6)" in r["wrong shape"]


def test_bench_e2e_tp_runs_and_records_peaked_attention():
    from kvsieve.bench.e2e_tp import markdown, run_tp_bench

    results = run_tp_bench(shape="tiny-llama", tp=2, cases=[(1, 48)], methods=("streaming:sink=4,window=8",),
                           baselines=("runtime",), device="cpu", steps=1, method_steps=1, warmup=1, hf_steps=1,
                           dtype=torch.float32, attention="peaked", peaked=P)
    assert results["attention"] == "peaked" and results["peaked"] == P.to_dict()
    rows = {r["variant"]: r for r in results["rows"]}
    assert set(rows) == {"runtime", "streaming:sink=4,window=8"} and all(r["ms"] > 0 for r in rows.values())
    cal = results["calibration"]["tiny-llama"]
    assert cal["attention"] == "peaked" and cal["params"] == P.to_dict()
    assert cal["synthetic_measured"]["n"] == 48  # measured on the sharded model, every rank's heads
    text = markdown(results, "kvsieve bench e2e --tp 2 --attention peaked")
    assert f"Attention: {pk.ATTENTION_LABELS['peaked']}; parameters {P.to_dict()}." in text
    assert "peaked: this run's model | 48 |" in text and "rewritten on every rank for peaked attention" in text
    # a results file from before the option: its ranks ran random weights whatever its command line says
    old = {k: v for k, v in results.items() if k not in ("attention", "peaked", "calibration")}
    assert f"Attention: {pk.ATTENTION_LABELS['uniform']}." in markdown(old, "kvsieve bench e2e --tp 2")


def test_bench_e2e_tp_attention_bad_input_and_cli(monkeypatch, tmp_path, capsys):
    from kvsieve.bench import e2e_tp
    from kvsieve.cli.main import main

    with pytest.raises(ValueError, match="attention: expected one of peaked, uniform, got 'flat'"):
        e2e_tp.run_tp_bench(shape="tiny-llama", tp=2, device="cpu", attention="flat")
    with pytest.raises(ValueError, match="peaked: expected a PeakedAttention with attention='peaked'"):
        e2e_tp.run_tp_bench(shape="tiny-llama", tp=2, device="cpu", attention="uniform", peaked=P)
    with pytest.raises(ValueError, match="shape: no peaked-attention fit for 'tiny-llama'"):  # before any rank starts
        e2e_tp.run_tp_bench(shape="tiny-llama", tp=2, device="cpu", attention="peaked")
    with pytest.raises(SystemExit):
        main(["bench", "e2e", "--tp", "2", "--attention", "flat"])
    # the CLI passes --attention through, by default the single-GPU bench's default
    calls = []

    def fake(**kw):
        calls.append(kw)
        return {"device": "fake", "tp": 2, "date": "d", "protocol": "p", "rows": [], "attention": kw["attention"]}

    monkeypatch.setattr(e2e_tp, "run_tp_bench", fake)
    monkeypatch.setattr(e2e_tp, "write_results", lambda *a: [])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for extra, want in (([], "peaked"), (["--attention", "uniform"], "uniform"), (["--attention", "peaked"], "peaked")):
        assert main(["bench", "e2e", "--tp", "2", "--shapes", "tiny-llama", "--out", str(tmp_path)] + extra) == 0
        assert calls[-1]["attention"] == want
        assert f"Attention: {pk.ATTENTION_LABELS[want]}." in capsys.readouterr().out
