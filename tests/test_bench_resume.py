"""``kvsieve bench e2e --resume``: one run's cases spread over processes, joined into one results file."""

import gzip
import json

import pytest
import torch

TINY = dict(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
METHOD = "streaming:sink=4,window=8"


def _run(e2e, cases):
    return e2e.run_e2e_bench(shapes=("tiny",), cases=cases, methods=(METHOD,), baselines=("runtime",), steps=2,
                             method_steps=2, hf_steps=2, warmup=1, device="cpu", dtype=torch.float32,
                             log=lambda s: None)


def test_two_processes_make_one_table(monkeypatch, tmp_path):
    from kvsieve.bench import e2e, resume

    monkeypatch.setitem(e2e.MODEL_SHAPES, "tiny", TINY)
    first = _run(e2e, [(1, 40)])
    path = tmp_path / "first.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(first, command="kvsieve bench e2e --cases 1x40"), f)
    previous = resume.load_previous(path)
    variants = [METHOD, "runtime"]
    left = resume.remaining_cases(previous, ["tiny"], [(1, 40), (1, 48)], variants)
    assert left == [(1, 48)]
    second = _run(e2e, left)
    joined = resume.join(previous, second, previous["command"], "kvsieve bench e2e --cases 1x48 --resume first")
    assert sorted({r["n"] for r in joined["rows"]}) == [40, 48]
    assert len(joined["rows"]) == len(first["rows"]) + len(second["rows"])
    assert joined["dates"] == [first["date"], second["date"]] and len(joined["commands"]) == 2
    header = resume.joined_command(joined)
    assert header.startswith("(1) kvsieve bench e2e --cases 1x40") and "(2) kvsieve bench e2e --cases 1x48" in header
    table = e2e.markdown(dict(joined, command=header), header)
    assert "| 40 |" in table and "| 48 |" in table
    # the joined file resumes again: nothing left of these cases
    with pytest.raises(ValueError, match="--resume: every requested case is already in the earlier results"):
        resume.remaining_cases(joined, ["tiny"], [(1, 40), (1, 48)], variants)
    # a case run again replaces its earlier rows
    again = resume.join(joined, second, header, "kvsieve bench e2e --cases 1x48")
    assert len(again["rows"]) == len(joined["rows"]) and len(again["commands"]) == 3


def test_runs_that_would_not_make_one_table_are_refused(tmp_path):
    from kvsieve.bench import resume

    base = {"kind": "e2e", "device": "NVIDIA H200", "torch": "2.11", "transformers": "5.17", "triton": "3.6",
            "dtype": "bfloat16", "attention": "peaked", "protocol": "p", "date": "d1",
            "rows": [{"shape": "s", "batch": 1, "n": 8, "variant": "runtime", "ms": 1.0}]}
    with pytest.raises(ValueError, match="--resume: attention differs between the runs"):
        resume.join(base, dict(base, attention="uniform", date="d2"), "a", "b")
    with pytest.raises(ValueError, match="--resume: device differs"):
        resume.join(base, dict(base, device="NVIDIA H100", date="d2"), "a", "b")
    with pytest.raises(ValueError, match="the earlier run timed \\['runtime'\\], this one would time"):
        resume.remaining_cases(base, ["s"], [(1, 16)], ["runtime", "quest"])
    with pytest.raises(ValueError, match="--resume: expected an earlier results file"):
        resume.load_previous(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="is not a results file of kvsieve bench e2e"):
        resume.load_previous(tmp_path / "other.json")


def test_cli_resume_refuses_a_missing_file_before_building_a_model(capsys, tmp_path):
    from kvsieve.cli.main import main

    assert main(["bench", "e2e", "--resume", str(tmp_path / "nothing.json")]) == 2
    assert "--resume: expected an earlier results file" in capsys.readouterr().err
    assert main(["bench", "e2e", "--tp", "2", "--resume", str(tmp_path / "nothing.json")]) == 2
    assert "--resume: not with --tp" in capsys.readouterr().err
