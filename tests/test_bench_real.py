"""``kvsieve bench real`` (bench/real.py): the table it assembles, a run on a tiny model with a real
tokenizer's needle prompts, and the CLI's checks before a model is loaded."""

import pytest
import torch
from test_runtime import tiny_model

from kvsieve.bench import real


def _row(method, prompt, ms, tokens, found, density=None, graph=True, **extra):
    return {"model": "m", "context": 1000, "prompt": prompt, "method": method, "ms": ms, "tokens": tokens,
            "found": found, "density": density, "graph": graph, "graph_reason": None if graph else "eager only",
            "same_as_dense": False, "method_layers": [1], "window_layers": [0, 2], **extra}


def test_summary_counts_speed_density_and_answers_per_method():
    rows = [_row("dense", 0, 2.0, [1, 2], 1.0, 1.0), _row("dense", 1, 4.0, [3, 4], 0.0, 1.0),
            _row("quest", 0, 1.0, [1, 2], 1.0, 0.2, backends=["triton"]),
            _row("quest", 1, 2.0, [3, 5], 0.0, 0.4, backends=["triton"]),
            _row("vattention", 0, 6.0, [1, 9], 0.0, 0.9, graph=False), _row("vattention", 1, 6.0, [3, 4], 0.0, 0.7,
                                                                            graph=False),
            {"model": "m", "context": 1000, "prompt": 0, "method": "saap", "skipped": "ValueError: needs a fit"},
            {"model": "m", "context": 1000, "prompt": 1, "method": "saap", "skipped": "ValueError: needs a fit"}]
    for r in rows:
        if "tokens" in r:
            r["same_as_dense"] = r["tokens"] == next(d["tokens"] for d in rows
                                                     if d["method"] == "dense" and d["prompt"] == r["prompt"])
    by = {s["method"]: s for s in real.summarize({"rows": rows})}
    assert by["dense"]["speedup"] == pytest.approx(1.0) and by["dense"]["same_as_dense"] == 2
    q = by["quest"]
    assert q["ms"] == pytest.approx(1.5) and q["speedup"] == pytest.approx(2.0) and q["density"] == pytest.approx(0.3)
    assert (q["same_as_dense"], q["same_where_dense_found"], q["dense_found"], q["found"]) == (1, 1, 1, 1)
    v = by["vattention"]
    assert v["graph"] is False and v["graph_reason"] == "eager only" and v["speedup"] == pytest.approx(0.5)
    assert (v["same_as_dense"], v["same_where_dense_found"], v["found"]) == (1, 0, 0)
    assert by["saap"]["skipped"] == "ValueError: needs a fit" and "ms" not in by["saap"]
    results = {"rows": rows, "models": [{"model": "m", "context": 1000, "layers": 3}], "device": "cpu", "date": "d",
               "torch": "t", "transformers": "x", "triton": None, "dtype": "float32", "prompts": 2, "task": "niah",
               "seed": 0, "new_tokens": 4}
    text = real.markdown(results, "kvsieve bench real")
    assert "| quest | 1.50 | 2.00× | 0.300 | yes | triton | 1/2 | 1/1 | 1/2 |" in text
    assert "| vattention | 6.00 | 0.50× | 0.800 | no (eager only) | — | 1/2 | 0/1 | 0/2 |" in text
    assert "| saap | cannot run: ValueError: needs a fit |" in text
    assert "2 sliding-window layers run exact window attention, methods serve layers [1]" in text


@pytest.mark.model
def test_a_run_on_a_tiny_model_with_needle_prompts(default_model):
    """A tiny random Gemma 3 (a binding window on layers 0 and 2) under SmolLM2's tokenizer: every variant
    decodes from the prefilled prompt, dense equals itself, the methods serve layer 1 only, a method that
    cannot run is reported with its reason."""
    _, tokenizer = default_model
    model = tiny_model("gemma3", num_hidden_layers=3, sliding_window=32, vocab_size=len(tokenizer),
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       max_position_embeddings=1024)
    loads = []

    def load(name, dtype, device):
        loads.append((name, dtype, str(device)))
        return model, tokenizer

    results = real.run_real_bench(models=("tiny",), contexts={"tiny": 300}, load=load, prompts=2, new_tokens=4,
                                  methods=("streaming:sink=4,window=16", "saap"), device="cpu", dtype=torch.float32,
                                  log=lambda line: None)
    assert loads == [("tiny", torch.float32, "cpu")]
    rows = results["rows"]
    assert [(r["prompt"], r["method"]) for r in rows] == [(p, m) for p in (0, 1)
                                                          for m in ("dense", "streaming:sink=4,window=16", "saap")]
    for r in rows:
        assert r["prompt_tokens"] <= 300 - 4
        if r["method"] == "saap":
            assert "artifacts" in r["skipped"]
            continue
        assert len(r["tokens"]) == 4 and r["graph"] is False and "CUDA" in r["graph_reason"]
        assert r["window_layers"] == [0, 2] and r["found"] in (0.0, 1.0)
        if r["method"] == "dense":
            assert r["same_as_dense"] and r["density"] == 1.0 and r["method_layers"] == []
        else:
            assert r["method_layers"] == [1] and 0 < r["density"] < 1
    text = real.markdown(results, "cmd")
    assert "| streaming:sink=4,window=16 |" in text and "| saap | cannot run" in text


def test_cli_refuses_bad_arguments_before_loading_a_model(capsys):
    from kvsieve.cli.main import main

    assert main(["bench", "real", "--methods", "questt", "--device", "cpu"]) == 2
    assert "unknown method 'questt'" in capsys.readouterr().err
    assert main(["bench", "real", "--models", "a,b", "--contexts", "8k", "--device", "cpu"]) == 2
    assert "--contexts: expected one context per model (2), got 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prompts: expected an integer >= 1"):
        real.run_real_bench(models=(), prompts=0, device="cpu")


def test_a_spent_time_budget_is_reported_not_hidden():
    def load(*a, **k):
        raise AssertionError("no model is loaded once the budget is spent")

    saved = []
    results = real.run_real_bench(models=("a",), load=load, budget_s=0.0, device="cpu", checkpoint=saved.append)
    assert [r["method"] for r in results["rows"]] == ["*"] and "time budget" in results["rows"][0]["skipped"]
    assert saved == [] and "## a: not run (the time budget of 0 s" in real.markdown(results, "cmd")


@pytest.mark.gpu
@pytest.mark.model
def test_captured_methods_on_the_gpu_report_graph_timing_and_eager_density(default_model):
    _, tokenizer = default_model
    model = tiny_model("gemma3", device="cuda", num_hidden_layers=3, sliding_window=64, head_dim=64,
                       query_pre_attn_scalar=64, vocab_size=len(tokenizer), max_position_embeddings=2048,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    results = real.run_real_bench(models=("tiny",), contexts={"tiny": 1200}, load=lambda *a, **k: (model, tokenizer),
                                  methods=("quest", "streaming"), prompts=1, new_tokens=8, device="cuda",
                                  dtype=torch.float32, log=lambda line: None)
    for r in results["rows"]:
        assert r["graph"] is True and r["ms"] > 0 and len(r["tokens"]) == 8, r
        assert r["method"] == "dense" or (r["method_layers"] == [1] and 0 < r["density"] < 1), r
