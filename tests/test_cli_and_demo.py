"""The command line, the default model loader and the demo prompt."""

import subprocess
import sys

import pytest

from kvsieve.cli.main import main


def test_methods_lists_every_method_with_parameters(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    import kvsieve

    for name in kvsieve.methods():
        assert name in out
    assert "budget" in out


def test_unknown_method_is_an_error_with_a_suggestion(capsys):
    assert main(["methods", "santa-sis"]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'santa-sis'" in err and "santa-sys" in err


def test_generate_rejects_a_bad_spec_before_loading_the_model(capsys):
    assert main(["generate", "--demo", "--method", "santa-sys:budget=zero"]) == 2
    assert "budget" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2


@pytest.mark.model
def test_default_model_is_the_offline_smollm2(default_model):
    model, tok = default_model
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.max_position_embeddings == 8192
    assert tok.padding_side == "left" and tok.pad_token is not None


@pytest.mark.model
@pytest.mark.parametrize("n_tokens,depth", [(600, 0.1), (1500, 0.9)])
def test_demo_prompt_hides_the_number_at_the_requested_place(default_model, n_tokens, depth):
    from kvsieve.demo import ANSWER_PREFIX, needle_prompt

    _, tok = default_model
    p = needle_prompt(tok, n_tokens, depth, seed=3)
    ids = p.input_ids[0].tolist()
    assert abs(len(ids) - n_tokens) <= 0.02 * n_tokens
    text = tok.decode(ids)
    assert text.count(p.answer) == 1 and text.endswith(ANSWER_PREFIX)
    where = text.index(p.answer) / len(text)
    assert abs(where - depth) < 0.1
    # everything from question_start on is the question and the answer prefix, not the context
    assert p.answer not in tok.decode(ids[p.question_start:])
    assert "magic number" in tok.decode(ids[p.question_start:])


@pytest.mark.model
def test_generate_demo_runs_end_to_end():
    # A subprocess, as a user runs it: the installed entry point, a short demo.
    cmd = [sys.executable, "-m", "kvsieve.cli.main", "generate", "--demo", "--context-tokens", "700",
           "--max-new-tokens", "9", "--method", "santa-sys:budget=32", "--phase", "question"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "santa-sys" in res.stdout and "per-layer" in res.stdout
