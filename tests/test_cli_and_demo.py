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


def test_methods_piped_prints_every_choice_and_bracket_in_full(capsys):
    assert main(["methods", "vattention"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert "[n] minus I_f" in out  # rich markup would have eaten "[n]"
    assert "residual: excludes-topk|includes-topk = excludes-topk" in out
    assert "bound: denominator|full = full" in out
    import kvsieve
    from kvsieve.core.registry import method_class

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in kvsieve.methods():  # from the class: saap cannot be built without its artifacts
        for pname, ptype, _, _ in method_class(name).config_class.parameters():
            assert f"{pname}: {ptype} = " in out, (name, pname)


def test_methods_on_a_narrow_terminal_folds_instead_of_cutting(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "70")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["methods", "vattention"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "[n]" in out


@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading weights fails the test; the model's config says 8192 tokens of context."""
    import types

    import kvsieve
    import kvsieve.integrations.models as models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(kvsieve, "load_model", refuse)
    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_config", lambda name="default": types.SimpleNamespace(
        max_position_embeddings=8192))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-file", "no/such/prompt.txt"], "--prompt-file: 'no/such/prompt.txt' is not a file"),
        (["--demo", "--depth", "1.5"], "--depth: expected a value in [0, 1]"),
        (["--demo", "--context-tokens", "9000"], "--context-tokens: 9000 tokens + 24 new (--max-new-tokens) "
                                                 "exceed the model's maximum context of 8192"),
        (["--demo", "--context-tokens", "10"], "--context-tokens: expected at least 256"),
        (["--demo", "--max-new-tokens", "1000000"], "--max-new-tokens: 1000000 new tokens leave no room for the "
                                                    "prompt in the model's maximum context of 8192"),
        (["--demo", "--max-new-tokens", "0"], "--max-new-tokens: expected >= 1"),
        (["--demo", "--threads", "-1"], "--threads: expected >= 0"),
        (["--demo", "--device", "tpu"], "device: expected 'cpu', 'cuda' or 'cuda:<index>', got 'tpu'"),
        (["--demo", "--method", "santa-sys:budget=0"], "santa-sys: budget: expected an integer >= 1, got 0"),
        (["--demo", "--method", "quest:top_k=2.5"], "quest: top_k: a fraction of the context must lie in (0, 1]"),
    ],
)
def test_generate_checks_its_arguments_before_loading_the_model(no_model_loading, capsys, argv, message):
    assert main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_eval_checks_lengths_against_the_model_before_loading_it(no_model_loading, capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["eval", "--tasks", "vt", "--lengths", "2048,16384", "--output", str(out), "--quiet"]) == 2
    assert "lengths: [16384] exceed the model's maximum context of 8192" in capsys.readouterr().err
    assert not out.exists()


def test_generate_help_states_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    for default in ("santa-sys:budget=64", "default: 24)", "default: 4000)", "default: 0.5)", "default: auto)",
                    "default: float32)", "default: exact)", "(default: none)"):
        assert default in out, default
    assert "default: None" not in out and "default: False" not in out
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: dense)" in out and "(default: 4)" in out and "default: None" not in out


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty hub cache, the hub online (HF_HUB_OFFLINE unset), any change of offline mode undone."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HTTPS_PROXY", "https_proxy",
                     "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    return tmp_path / "hub"


def _cache_hub_model(hub, name):
    snapshot = hub / ("models--" + name.replace("/", "--")) / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")


def test_a_hub_id_missing_from_the_cache_with_the_hub_offline_fails_at_once(hub, monkeypatch):
    from kvsieve.integrations.models import check_model_source

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="'owner/model' is neither a local folder nor in the hub cache .*"
                                         "HF_HUB_OFFLINE is set"):
        check_model_source("owner/model")
    _cache_hub_model(hub, "owner/model")
    check_model_source("owner/model")


def test_a_hub_id_with_the_hub_unreachable_fails_at_once_or_reads_the_cache(hub, monkeypatch):
    import os

    from huggingface_hub import constants

    from kvsieve.integrations.models import check_model_source

    # nothing listens on port 1: the connection is refused at once, as an unreachable hub is
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="cannot be reached .*127.0.0.1:1"):
        check_model_source("owner/model")
    assert "HF_HUB_OFFLINE" not in os.environ
    _cache_hub_model(hub, "owner/model")
    check_model_source("owner/model")  # cached: read offline, with no retries against the hub
    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE is True
    check_model_source("default")  # local models never look at the hub


def test_generate_with_an_unreachable_hub_id_is_one_line(hub, tmp_path):
    import os

    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:1", HF_HUB_CACHE=str(hub))
    cmd = [sys.executable, "-m", "kvsieve.cli.main", "generate", "--demo", "--model", "google-bert/bert-base-uncased"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "kvsieve generate: error: model: 'google-bert/bert-base-uncased' is neither a local folder nor in the hub "
        f"cache ({hub}), and the hub cannot be reached (127.0.0.1:1: [Errno 111] Connection refused); give a "
        "local folder or 'default'"]


def test_generate_refuses_a_bad_name_number_file_or_hub_id_before_importing_torch(hub):
    import os

    code = ("import sys\nfrom kvsieve.cli.main import main\n"
            "for argv in sys.argv[1:]:\n    print(main(argv.split()))\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    argvs = ["generate --demo --method nosuch", "generate --demo --model bert-base-uncased",
             "generate --demo --model owner/model", "generate --demo --depth 2",
             "generate --prompt-file no/such.txt", "generate --demo --max-new-tokens 0"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub))
    res = subprocess.run([sys.executable, "-c", code, *argvs], capture_output=True, text=True, env=env)
    assert res.stdout.splitlines() == ["2"] * len(argvs) + ["[]"], res.stderr
    errors = res.stderr.splitlines()
    assert len(errors) == len(argvs)  # one line each, no traceback
    for line, needle in zip(errors, ("unknown method 'nosuch'", "unknown model 'bert-base-uncased'",
                                     "HF_HUB_OFFLINE is set", "--depth", "--prompt-file", "--max-new-tokens"),
                            strict=True):
        assert line.startswith("kvsieve generate: error:") and needle in line, line


def test_a_run_in_which_the_method_served_no_call_is_an_error():
    from kvsieve.cli.generate import check_method_ran

    check_method_ran([{"density": 0.1}], {0: "method"}, "m", "santa-sys:budget=64")
    with pytest.raises(ValueError, match="--model: no attention call of 'bert' reached santa-sys"):
        check_method_ran([], {}, "bert", "santa-sys:budget=64")
    with pytest.raises(ValueError, match=r"every layer stayed exact \(layers 0-2, 5: exact: dense_layers; "
                                         r"layers 3-4: exact: sliding window of 512 keys\)"):
        check_method_ran([], {0: "exact: dense_layers", 1: "exact: dense_layers", 2: "exact: dense_layers",
                              3: "exact: sliding window of 512 keys", 4: "exact: sliding window of 512 keys",
                              5: "exact: dense_layers"}, "m", "santa-sys:budget=64")


def test_the_demo_says_why_a_method_lost_the_number_dense_found():
    from kvsieve.cli.generate import miss_note

    note = miss_note("1234567", "The number is 1234567.", "The number is 1234.", "quest:top_k=0.05", 0.0712)
    assert note.startswith("note: quest:top_k=0.05 lost the number that dense attention found: reading 7.1% of")
    assert "kvsieve methods quest lists its parameters" in note and "--dense-layers" in note
    assert "with its selection" in miss_note("1234567", "1234567", "", "sketchwalk", None)
    assert miss_note("1234567", "1234567", "it is 1234567", "quest", 0.07) is None  # found
    assert miss_note("1234567", "no idea", "no idea", "quest", 0.07) is None  # dense missed it too
    assert miss_note(None, "a", "b", "quest", 0.07) is None  # a prompt file: no known answer


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
def test_default_model_cache_holds_exactly_the_gguf_model(tmp_path, monkeypatch):
    """The first load converts the GGUF into the cache folder; what later loads read from there has
    the GGUF model's weights, config, tokenizer and chat template, bit for bit."""
    import torch

    from kvsieve.integrations import models

    monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVSIEVE_MODEL_CACHE", "1")
    from_gguf = {}
    write = models._write_cache
    monkeypatch.setattr(models, "_write_cache",
                        lambda model, tok, *name: (from_gguf.update(model=model, tok=tok), write(model, tok, *name)))
    model, tok = models.load_model("default")
    assert from_gguf, "the first load must convert the GGUF"
    folder = models._cache_folder()
    assert folder.parent == tmp_path / "models" and (folder / models._COMPLETE).is_file()
    assert models._pretrained_source("default") == (str(folder), {})
    text = "The quick brown fox jumps over 12345 lazy dogs. éà 🙂\nA second line."
    ids = tok(text).input_ids
    assert ids == from_gguf["tok"](text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == from_gguf["tok"].apply_chat_template(chat, tokenize=False)
    def settings(m):
        return {k: v for k, v in m.config.to_dict().items() if k != "_name_or_path"}

    assert settings(model) == settings(from_gguf["model"])
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(x).logits, from_gguf["model"](x).logits)
    # a second load reads the folder only
    monkeypatch.setattr(models, "_write_cache", lambda *a: pytest.fail("converted twice"))
    assert models.load_model("default", dtype=torch.bfloat16)[0].dtype == torch.bfloat16


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
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "santa-sys" in res.stdout and "per-layer" in res.stdout
    assert "Warning" not in res.stderr, res.stderr[-2000:]  # our calls into transformers use its current API


def test_sketchwalk_help_states_the_triton_prefills_block_limit(capsys):
    from kvsieve.kernels.shared.block_sparse import TRITON_MAX_BLOCK

    assert main(["methods", "sketchwalk"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"for blocks of up to {TRITON_MAX_BLOCK} keys and FlexAttention for larger ones" in out


def test_saap_without_artifacts_shows_the_command_line_form(capsys):
    assert main(["generate", "--demo", "--method", "saap"]) == 2
    err = capsys.readouterr().err
    assert "kvsieve fit saap --out DIR" in err and "--method saap:artifacts=DIR" in err


def test_an_os_error_of_a_command_is_one_line(capsys, monkeypatch):
    import kvsieve.cli.methods as methods_command

    def fail(args):
        raise OSError("owner/model is not a valid model identifier listed on the hub")

    monkeypatch.setattr(methods_command, "run", fail)
    assert main(["methods"]) == 2
    assert capsys.readouterr().err == "kvsieve methods: error: owner/model is not a valid model identifier listed " \
                                      "on the hub\n"
