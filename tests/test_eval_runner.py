"""The runner: resume, adding methods, refusing foreign/corrupt/mismatched folders, the report."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvsieve.eval import tasks
from kvsieve.eval.report import write_report
from kvsieve.eval.runner import EvalConfig, Prefill, Timer, prefill, run_eval, run_method
from kvsieve.eval.store import ResultsFolderError, ResultStore


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The CI machine's 2 cores are shared; two threads contending with other work run several times slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny(tmp_path, **kw) -> EvalConfig:
    base = dict(tasks=("niah_single_2",), lengths=(384,), methods=("santa-sys:budget=16",), samples=1,
                output=str(tmp_path / "run"), max_new_tokens=4, track_error=2)
    base.update(kw)
    return EvalConfig(**base)


@pytest.mark.model
def test_interrupt_resume_and_new_method_compute_only_missing_cells(default_model, tmp_path):
    model, tok = default_model
    cfg = tiny(tmp_path)
    seen = []

    def interrupt_after_first(row):
        seen.append(row)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_eval(cfg, model=model, tokenizer=tok, progress=False, on_cell=interrupt_after_first)
    root = tmp_path / "run"
    (first,) = ResultStore.open_existing(root).rows()
    assert first == seen[0]

    res = run_eval(cfg, model=model, tokenizer=tok, progress=False)
    assert (res.computed, res.skipped) == (1, 1)
    # The finished cell was skipped, not recomputed: its timings are those of the first run.
    assert res.store.read(first["task"], first["length"], first["sample"], first["method"]) == first
    assert run_eval(cfg, model=model, tokenizer=tok, progress=False).computed == 0

    more = dataclasses.replace(cfg, methods=cfg.methods + ("santa:budget=16",))
    res = run_eval(more, model=model, tokenizer=tok, progress=False)
    assert (res.computed, res.skipped) == (1, 2)

    rows = ResultStore.open_existing(root).rows()
    assert {r["method"] for r in rows} == {"dense", "santa-sys:budget=16", "santa:budget=16"}
    for r in rows:
        assert 0.0 <= r["score"] <= 1.0 and r["n_tokens"] <= 384
        if r["method"] == "dense":
            assert r["density"] == 1.0 and r["kl_mean"] == 0.0
        else:
            assert 0 < r["density"] < 0.5 and r["sparse_calls"] > 0
            assert r["rel_error"] > 0 and len(r["rel_error_by_layer"]) == model.config.num_hidden_layers
            assert r["kl_mean"] >= 0 and 0 <= r["top1_agree"] <= 1 and r["tf_tokens"] > 0
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["grid"]["methods"] == ["dense", "santa-sys:budget=16", "santa:budget=16"]
    assert len(manifest["runs"]) == 3  # a run with nothing to compute logs nothing

    report = write_report(root)
    assert report.read_text().startswith("# kvsieve eval report")
    for name in ("summary.csv", "summary.md", "score_vs_density.png", "error_vs_budget.png",
                 "layer_error_heatmap.png", "kl_vs_budget.png"):
        assert (root / name).is_file() and (root / name).stat().st_size > 0, name
    assert (root / "score_vs_density.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The folder keeps its cells in the database alone: no per-cell files, no leftover log.
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith((".png", ".md", ".csv"))) == [
        "cells.sqlite", "manifest.json"]

    with pytest.raises(ResultsFolderError, match="other settings.*seed"):
        run_eval(dataclasses.replace(cfg, seed=1), model=model, tokenizer=tok, progress=False)


@pytest.mark.model
def test_dense_cell_is_plain_greedy_decoding(default_model):
    model, tok = default_model
    sample = tasks.make_sample("niah_single_2", tok, 384, 0)
    cfg = EvalConfig(tasks=("niah_single_2",), lengths=(384,), methods=(), samples=1, output="unused",
                     stop_when_solved=False, max_new_tokens=6)
    timer = Timer()
    out = run_method(model, tok, sample, prefill(model, sample, "question", timer), "dense", cfg, timer)
    ids = torch.tensor([list(sample.input_ids)])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert out.text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.model
def test_shared_teacher_forced_pass_does_not_change_generation(default_model):
    """Question + target in one forward, then a cache crop: same tokens as running the question alone."""
    model, tok = default_model
    sample = tasks.make_sample("niah_single_2", tok, 384, 1)
    cfg = EvalConfig(tasks=("niah_single_2",), lengths=(384,), methods=(), samples=1, output="unused",
                     stop_when_solved=False, max_new_tokens=3, track_error=0)
    timer = Timer()
    pre: Prefill = prefill(model, sample, "question", timer)
    fused = run_method(model, tok, sample, pre, "santa-sys:budget=8", cfg, timer, teacher_force=True)
    alone = run_method(model, tok, sample, pre, "santa-sys:budget=8", cfg, timer, teacher_force=False)
    assert fused.text == alone.text and fused.new_tokens == alone.new_tokens == 3
    assert fused.tf_logits is not None and alone.tf_logits is None
    # The prefill cache is shared, never modified by a method's run.
    assert pre.cache.get_seq_length() == sample.question_start


@pytest.mark.model
def test_setup_a_makes_only_generated_tokens_sparse(default_model, tmp_path):
    model, tok = default_model
    cfg = tiny(tmp_path, phase="decode", stop_when_solved=False, max_new_tokens=3)
    res = run_eval(cfg, model=model, tokenizer=tok, progress=False)
    assert res.computed == 2
    row = res.store.read("niah_single_2", 384, 0, "santa-sys:budget=16")
    target = len(tok(tasks.make_sample("niah_single_2", tok, 384, 0).target, add_special_tokens=False)["input_ids"])
    n_layers = model.config.num_hidden_layers
    # 2 generated tokens fed back (the first comes from the exact prefill) + target tokens but the last.
    assert row["sparse_calls"] == n_layers * (2 + target - 1)
    assert row["tf_tokens"] == target - 1 and row["new_tokens"] == 3
    assert 0 < row["density"] < 1


@pytest.mark.model
def test_sketchwalk_cells_run_their_prompt_inside_the_session(default_model, tmp_path):
    """Setup A for a prefill method: its session sees the prompt (the walk needs the prompt's sketches);
    at density 1 every block is kept, so greedy decoding and teacher forcing are dense's."""
    import kvsieve

    model, tok = default_model
    spec, sparse_spec = (kvsieve.method(f"sketchwalk:variant=reconstruction,density={d},block_size=16").spec
                         for d in (1.0, 0.2))
    cfg = tiny(tmp_path, phase="decode", stop_when_solved=False, max_new_tokens=3,
               methods=("dense", spec, sparse_spec))
    res = run_eval(cfg, model=model, tokenizer=tok, progress=False)
    assert res.computed == 3
    dense = res.store.read("niah_single_2", 384, 0, "dense")
    full = res.store.read("niah_single_2", 384, 0, spec)
    assert full["prediction"] == dense["prediction"]
    assert full["kl_mean"] < 1e-6
    sparse = res.store.read("niah_single_2", 384, 0, sparse_spec)
    assert 0 < sparse["density"] < 1 and sparse["sparse_calls"] > 0


@pytest.mark.model
def test_sketchwalk_cells_in_setup_b_take_the_question_as_one_chunk(default_model, tmp_path):
    """Setup B for a prefill method: its session records the context, the question (+ the forced target)
    goes through its decode as one multi-row call per layer, each row with its own walk; at density 1
    greedy decoding and teacher forcing are dense's (a sparse run's chunk is compared with single-token
    steps in tests/test_sketchwalk.py, on a tiny model)."""
    import kvsieve

    model, tok = default_model
    spec = kvsieve.method("sketchwalk:variant=reconstruction,density=1.0,block_size=16").spec
    cfg = tiny(tmp_path, phase="question", stop_when_solved=False, max_new_tokens=3, methods=("dense", spec))
    res = run_eval(cfg, model=model, tokenizer=tok, progress=False)
    assert res.computed == 2
    dense = res.store.read("niah_single_2", 384, 0, "dense")
    full = res.store.read("niah_single_2", 384, 0, spec)
    assert full["prediction"] == dense["prediction"] and full["new_tokens"] == 3
    assert full["kl_mean"] < 1e-6 and full["top1_agree"] == 1.0 and full["tf_tokens"] == dense["tf_tokens"]
    sparse_layers = model.config.num_hidden_layers - 2  # layers 0 and 1 stay dense
    # per sparse layer: the teacher-forced chunk, the question again, 2 generated tokens fed back
    assert full["sparse_calls"] == sparse_layers * 4


@pytest.mark.model
@pytest.mark.parametrize("phase", ["prefill", "all"])
def test_sketchwalk_cells_with_a_sparse_prefill_of_the_context(default_model, tmp_path, phase):
    """prefill: the context through the sparse prefill, question + answer exact; all: then the question
    chunk and the answer through the decode as in setup B. At density 1 every block is kept, so the cells
    are dense's; an interrupted folder resumes, and refuses another phase."""
    import kvsieve

    model, tok = default_model
    spec, sparse_spec = (kvsieve.method(f"sketchwalk:variant=reconstruction,density={d},block_size=16").spec
                         for d in (1.0, 0.2))
    cfg = tiny(tmp_path, phase=phase, stop_when_solved=False, max_new_tokens=3, methods=("dense", spec, sparse_spec))

    def interrupt_after_first(row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_eval(cfg, model=model, tokenizer=tok, progress=False, on_cell=interrupt_after_first)
    res = run_eval(cfg, model=model, tokenizer=tok, progress=False)
    assert (res.computed, res.skipped) == (2, 1)
    assert run_eval(cfg, model=model, tokenizer=tok, progress=False).computed == 0
    with pytest.raises(ResultsFolderError, match="other settings.*phase"):
        run_eval(dataclasses.replace(cfg, phase="question"), model=model, tokenizer=tok, progress=False)

    dense = res.store.read("niah_single_2", 384, 0, "dense")
    full = res.store.read("niah_single_2", 384, 0, spec)
    sparse = res.store.read("niah_single_2", 384, 0, sparse_spec)
    assert full["prediction"] == dense["prediction"] and full["new_tokens"] == dense["new_tokens"] == 3
    assert full["kl_mean"] < 1e-6 and full["top1_agree"] == 1.0 and full["tf_tokens"] == dense["tf_tokens"]
    assert dense["prefill_density"] == dense["decode_density"] == 1.0
    assert full["prefill_density"] == pytest.approx(1.0) and full["prefill_block_density"] == pytest.approx(1.0)
    assert 0 < sparse["prefill_density"] < 0.5 and 0 < sparse["prefill_block_density"] < 0.5
    assert sparse["kl_mean"] > 1e-3  # the sparse prefill reaches the question's logits
    sparse_layers = model.config.num_hidden_layers - 2  # layers 0 and 1 stay dense
    if phase == "prefill":
        # the context's prefill, nothing after it
        assert full["sparse_calls"] == sparse["sparse_calls"] == sparse_layers
        assert sparse["decode_density"] == 1.0 and sparse["density"] == sparse["prefill_density"]
    else:
        # per sparse layer: the prefill, the teacher-forced chunk, the question again, 2 generated tokens
        assert full["sparse_calls"] == sparse["sparse_calls"] == sparse_layers * 5
        assert 0 < sparse["decode_density"] < 1 and full["decode_density"] == pytest.approx(1.0)


@pytest.mark.model
def test_length_above_model_maximum_is_refused_before_writing(default_model, tmp_path):
    model, tok = default_model
    with pytest.raises(ValueError, match="maximum context of 8192"):
        run_eval(tiny(tmp_path, lengths=(9000,)), model=model, tokenizer=tok, progress=False)
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_foreign_corrupt_and_mismatched_folders(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ResultsFolderError, match="not a kvsieve eval results folder"):
        run_eval(tiny(tmp_path, output=str(foreign)), progress=False)
    with pytest.raises(ResultsFolderError, match="no manifest.json"):
        write_report(foreign)

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "manifest.json").write_text("{not json")
    with pytest.raises(ResultsFolderError, match="corrupt"):
        run_eval(tiny(tmp_path, output=str(corrupt)), progress=False)
    (corrupt / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ResultsFolderError, match="not a kvsieve eval manifest"):
        ResultStore.open_existing(corrupt)

    cfg = tiny(tmp_path, output=str(tmp_path / "ok"))
    store = ResultStore.open_for_run(cfg.output, cfg.settings(), cfg.grid())
    store.save_manifest()
    row = {"task": "niah_single_2", "length": 512, "sample": 0, "method": "dense", "score": 1.0}
    store.write(row)
    assert store.rows() == [row]
    (store.root / "cells.sqlite").write_bytes(b"garbage" * 1000)
    with pytest.raises(ResultsFolderError, match="cells.sqlite: file is not a database"):
        run_eval(cfg, progress=False)
    with pytest.raises(ResultsFolderError, match="other settings.*phase"):
        run_eval(dataclasses.replace(cfg, phase="decode"), progress=False)


def test_bad_grid_names_list_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown task.*Valid tasks"):
        run_eval(tiny(tmp_path, tasks=("needle",)), progress=False)
    with pytest.raises(ValueError, match="unknown method.*Registered methods"):
        run_eval(tiny(tmp_path, methods=("santa-sy",)), progress=False)
    with pytest.raises(ValueError, match="unknown model 'nope'.*'default'"):
        run_eval(tiny(tmp_path, model="nope"), progress=False)
    with pytest.raises(ValueError, match="phase"):
        run_eval(tiny(tmp_path, phase="question-and-answer"), progress=False)
    # No dense fallback: a method without a sparse prefill is refused in the phases that need one.
    for phase in ("prefill", "all"):
        with pytest.raises(ValueError, match=f"phase: '{phase}'.*santa-sys:budget=16 has none.*sketchwalk"):
            run_eval(tiny(tmp_path, phase=phase, methods=("sketchwalk", "santa-sys:budget=16")), progress=False)
    assert not (tmp_path / "run").exists()


def test_cli_errors(capsys, tmp_path):
    from kvsieve.cli.main import main

    assert main(["eval", "--tasks", "vt,nope", "--lengths", "512", "--output", str(tmp_path / "o")]) == 2
    assert "Valid tasks" in capsys.readouterr().err
    assert main(["eval", "--tasks", "vt", "--lengths", "5x", "--output", str(tmp_path / "o")]) == 2
    assert "lengths" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "not a kvsieve eval results folder" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["eval", "--tasks", "vt", "--lengths", "512", "--device", "cuda", "--output",
                     str(tmp_path / "o")]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    assert main(["eval", "--tasks", "vt", "--lengths", "512", "--workers", "0", "--output", str(tmp_path / "o")]) == 2
    assert "workers" in capsys.readouterr().err


@pytest.mark.model
def test_a_prompt_that_leaves_no_room_to_generate_is_refused(default_model, tmp_path):
    model, tok = default_model
    cfg = tiny(tmp_path, lengths=(8190,), methods=("dense",), max_new_tokens=4, track_error=0)
    with pytest.raises(ValueError, match="maximum context of 8192"):
        run_eval(cfg, model=model, tokenizer=tok, progress=False)


@pytest.mark.slow
@pytest.mark.model
def test_full_length_8k_cell_runs_in_bounded_memory(default_model, tmp_path):
    import resource

    model, tok = default_model
    n = 8192 - 4  # the prompt and its 4 new tokens fill the model's whole 8192-token context
    cfg = tiny(tmp_path, lengths=(n,), methods=("santa-sys:budget=64",), max_new_tokens=4, track_error=0)
    res = run_eval(cfg, model=model, tokenizer=tok, progress=False)
    assert res.computed == 2
    row = res.store.read("niah_single_2", n, 0, "santa-sys:budget=64")
    assert row["n_tokens"] >= 0.98 * n and row["density"] < 0.05
    # An [N, N] fp32 score matrix per head at 8k would alone be 256 MB x 9 heads.
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    assert peak_gb < 6, peak_gb


@pytest.mark.model
def test_workers_write_the_cells_one_process_writes(default_model, tmp_path):
    """Two worker processes (each loading the model, pulling prompts from a queue) = the serial run."""
    model, tok = default_model
    cfg = tiny(tmp_path, samples=2, methods=("santa-sys:budget=16", "santa:budget=16"))
    run_eval(cfg, model=model, tokenizer=tok, progress=False)
    par = dataclasses.replace(cfg, output=str(tmp_path / "par"))
    res = run_eval(par, progress=False, workers=2, threads=1)
    assert (res.computed, res.skipped, res.left) == (6, 0, 0) and res.busy_s > res.forward_s > 0
    serial = {(r["sample"], r["method"]): r for r in ResultStore.open_existing(tmp_path / "run").rows()}
    parallel = {(r["sample"], r["method"]): r for r in res.store.rows()}
    assert serial.keys() == parallel.keys() and len(serial) == 6
    for key, a in serial.items():
        b = parallel[key]
        # Same prompts, same seeds, same sampled keys: only float summation order may differ.
        assert (a["fingerprint"], a["prediction"], a["new_tokens"]) == (b["fingerprint"], b["prediction"],
                                                                         b["new_tokens"]), key
        assert a["density"] == pytest.approx(b["density"], abs=1e-9), key
        assert a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-3, abs=1e-6), key
    run = res.store.manifest["runs"][-1]
    assert (run["workers"], run["threads"], run["cells"], run["device"]) == (2, 1, 6, "cpu")
    assert run_eval(par, progress=False, workers=2).computed == 0


@pytest.mark.model
def test_stop_after_starts_no_new_prompt_and_resume_finishes(default_model, tmp_path):
    model, tok = default_model
    cfg = tiny(tmp_path, samples=2)
    res = run_eval(cfg, model=model, tokenizer=tok, progress=False, stop_after=1e-9)
    assert (res.computed, res.left) == (0, 4)
    res = run_eval(cfg, model=model, tokenizer=tok, progress=False)
    assert (res.computed, res.left) == (4, 0)


def test_device_is_checked_and_is_a_folder_setting(tmp_path):
    from kvsieve.eval.runner import check_device

    for bad in ("tpu", "cpu:1", "cuda:x"):
        with pytest.raises(ValueError, match="device: expected 'cpu', 'cuda'"):
            check_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            run_eval(tiny(tmp_path, device="cuda"), progress=False)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="workers"):
            run_eval(tiny(tmp_path), progress=False, workers=bad)
    with pytest.raises(ValueError, match="stop_after"):
        run_eval(tiny(tmp_path), progress=False, stop_after=0)

    # A folder written before the device became a setting was written on the CPU: it resumes as such.
    cfg = tiny(tmp_path)
    legacy = {k: v for k, v in cfg.settings().items() if k != "device"}
    ResultStore.open_for_run(cfg.output, legacy, cfg.grid()).save_manifest()
    ResultStore.open_for_run(cfg.output, cfg.settings(), cfg.grid())
    cuda_settings = {**cfg.settings(), "device": "cuda"}
    with pytest.raises(ResultsFolderError, match="device: folder has 'cpu', this run 'cuda'"):
        ResultStore.open_for_run(cfg.output, cuda_settings, cfg.grid())


@pytest.mark.model
def test_the_runtime_engine_gives_the_sparsify_engines_answers(default_model, tmp_path):
    """Setup A through ``kvsieve.generate`` (the engine ``auto`` takes on CUDA) answers as the loop over
    transformers' forward does, for dense, a deterministic method and a method that records the prompt."""
    model, tok = default_model
    methods = ("dense", "quest:top_k=4,page_size=16", "sketchwalk:block_size=16")
    rows = {}
    for engine in ("sparsify", "runtime"):
        cfg = tiny(tmp_path, phase="decode", stop_when_solved=False, max_new_tokens=4, methods=methods,
                   engine=engine, output=str(tmp_path / engine))
        res = run_eval(cfg, model=model, tokenizer=tok, progress=False)
        assert res.store.manifest["settings"]["engine"] == engine
        rows[engine] = {m: res.store.read("niah_single_2", 384, 0, m) for m in res.store.manifest["grid"]["methods"]}
    for m, row in rows["sparsify"].items():
        other = rows["runtime"][m]
        assert other["prediction"] == row["prediction"], m
        assert other["new_tokens"] == row["new_tokens"] == 4, m
        if m != "dense":
            assert 0 < other["density"] < 1, m


def test_engine_is_checked_and_auto_resolves_by_device_and_phase(tmp_path):
    with pytest.raises(ValueError, match="engine: expected one of auto, sparsify, runtime"):
        run_eval(tiny(tmp_path, engine="vllm"), progress=False)
    with pytest.raises(ValueError, match="engine: the runtime serves phase 'decode'"):
        run_eval(tiny(tmp_path, engine="runtime", phase="question"), progress=False)
    assert tiny(tmp_path, phase="decode").resolved_engine == "sparsify"  # on the CPU
    assert tiny(tmp_path, phase="decode", device="cuda").resolved_engine == "runtime"
    assert tiny(tmp_path, phase="question", device="cuda").resolved_engine == "sparsify"
    # A folder written before the engine became a setting was generated by sparsify: it resumes as such.
    cfg = tiny(tmp_path)
    legacy = {k: v for k, v in cfg.settings().items() if k != "engine"}
    ResultStore.open_for_run(cfg.output, legacy, cfg.grid()).save_manifest()
    ResultStore.open_for_run(cfg.output, cfg.settings(), cfg.grid())
