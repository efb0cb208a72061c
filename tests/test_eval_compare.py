"""kvsieve compare: paired A − B per (task, length), its CI, the errors, and the CLI on a real folder layout."""

from __future__ import annotations

import numpy as np
import pytest

from kvsieve.cli.main import main
from kvsieve.eval.compare import compare_methods, comparison_table
from kvsieve.eval.store import ResultStore

A, B = "santa-sys:budget=16", "santa:budget=16"


def rows_for(a_scores, b_scores, *, task="niah_single_2", length=512, a_kl=None, b_kl=None):
    rows = []
    for method, scores, kls in ((A, a_scores, a_kl), (B, b_scores, b_kl)):
        for i, s in enumerate(scores):
            rows.append({"task": task, "length": length, "sample": i, "method": method, "score": s,
                         "kl_mean": None if kls is None else kls[i], "top1_agree": 1.0})
    return rows


def test_paired_delta_is_the_mean_difference_on_shared_prompts_and_the_ci_covers_it():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2, 30).astype(float).tolist()
    b = rng.integers(0, 2, 30).astype(float).tolist()
    kl_b = rng.uniform(0.1, 0.3, 30)
    kl_a = (kl_b - 0.05 + rng.normal(0, 0.002, 30)).tolist()  # A always lower: the paired CI must exclude 0
    rows = rows_for(a, b, a_kl=kl_a, b_kl=kl_b.tolist())
    rows = [r for r in rows if not (r["method"] == A and r["sample"] == 29)]  # B-only prompt: not paired
    (res,) = compare_methods(rows, A, B)
    assert res["n"] == 29
    want = 100 * (np.mean(a[:29]) - np.mean(b[:29]))
    assert res["score"]["delta"] == pytest.approx(want)
    assert res["score"]["lo"] <= want <= res["score"]["hi"]
    assert res["score"]["a"] == pytest.approx(100 * np.mean(a[:29]))
    kl = res["kl_mean"]
    assert kl["delta"] == pytest.approx(np.mean(np.array(kl_a[:29]) - kl_b[:29]))
    assert kl["hi"] < 0  # a steady paired gap is detected although the two KL ranges overlap
    assert res["top1_agree"]["delta"] == 0.0
    header, body = comparison_table([res], ["score", "kl_mean"])
    assert len(header) == len(body[0]) == 3 + 2 * 3 and body[0][-1].endswith("*")


def test_groups_by_task_and_length_and_skips_lengths_one_method_lacks():
    rows = rows_for([1, 0], [0, 0]) + rows_for([1, 1], [1, 0], length=1024)
    rows += [{"task": "vt", "length": 512, "sample": 0, "method": A, "score": 1.0}]
    res = compare_methods(rows, A, B, metrics=["score"])
    assert [(r["task"], r["length"], r["score"]["delta"]) for r in res] == [
        ("niah_single_2", 512, 50.0), ("niah_single_2", 1024, 50.0)]


def test_errors_name_the_argument_and_the_choices():
    rows = rows_for([1.0], [0.0])
    with pytest.raises(ValueError, match=r"(?s)method .quest:top_k=0.1. has no cells.*santa-sys:budget=16"):
        compare_methods(rows, "quest:top_k=0.1", B)
    with pytest.raises(ValueError, match=r"metrics: unknown \['f1'\]"):
        compare_methods(rows, A, B, metrics=["f1"])
    with pytest.raises(ValueError, match="both methods are"):
        compare_methods(rows, A, "santa-sys:budget=16")
    with pytest.raises(ValueError, match="unknown method"):
        compare_methods(rows, "no-such-method", B)


def test_cli_reads_a_results_folder_and_accepts_any_spelling_of_a_spec(tmp_path, capsys):
    store = ResultStore.open_for_run(tmp_path / "run", {"seed": 0},
                                     {"tasks": ["niah_single_2"], "lengths": [512], "methods": [A, B], "samples": 3})
    store.save_manifest()
    for r in rows_for([1.0, 1.0, 0.0], [0.0, 1.0, 0.0], a_kl=[0.1, 0.2, 0.3], b_kl=[0.2, 0.3, 0.4]):
        store.write(r)
    assert main(["compare", str(tmp_path / "run"), "santa-sys:budget=16", "santa:budget=16", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| niah_single_2 | 512 | 3 | 66.7 | 33.3 | +33.3 [" in out and "-0.1000 [-0.1000, -0.1000] *" in out
    assert main(["compare", str(tmp_path / "run"), A, "dense"]) == 2
    assert "has no cells in this folder" in capsys.readouterr().err


def _folder_with(tmp_path, methods, rows):
    store = ResultStore.open_for_run(tmp_path / "run", {"seed": 0}, {"tasks": ["niah_single_2"], "lengths": [512],
                                                                     "methods": methods, "samples": 3})
    store.save_manifest()
    for r in rows:
        store.write(r)
    return str(tmp_path / "run")


def _cells(method, scores, **fields):
    return [{"task": "niah_single_2", "length": 512, "sample": i, "method": method, "score": s, **fields}
            for i, s in enumerate(scores)]


def test_compare_takes_a_method_name_with_one_spec_in_the_folder_and_explains_its_marks(tmp_path, capsys):
    quest = "quest:top_k=0.1"
    folder = _folder_with(tmp_path, ["dense", quest, A, "santa-sys:budget=32"],
                          _cells("dense", [1.0, 1.0, 1.0], kl_mean=0.0) + _cells(quest, [0.0, 0.0, 0.0], kl_mean=0.5)
                          + _cells(A, [1.0, 0.0, 1.0]) + _cells("santa-sys:budget=32", [1.0, 1.0, 0.0]))
    assert main(["compare", folder, "quest", "dense", "--metrics", "score,kl_mean"]) == 0
    out = capsys.readouterr().out
    assert f"A = {quest}" in out and "B = dense" in out
    assert "+0.5000 [+0.5000, +0.5000] *" in out  # a constant paired gap: its CI excludes 0
    assert "* the 95% CI of A − B excludes 0" in out
    assert main(["compare", folder, "santa-sys", "dense"]) == 2
    err = capsys.readouterr().err
    assert "method 'santa-sys' names 2 specs in this folder; give one of:" in err and "santa-sys:budget=32" in err


def test_piped_tables_keep_every_row_whole(capsys):
    from kvsieve.eval.report import print_text_table

    long_answer = "The magic number is 1234567, " + "and then some more words " * 12
    print_text_table(["attention", "answer", "found 1234567", "density"],
                     [["dense", long_answer, "yes", "1.0000"], ["santa-sys:budget=64", "[1] no\nnewline",
                                                                "[red]no[/red]", "0.0312"]],
                     "a title\nsecond line", left=("attention", "answer"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["a title", "second line"]
    assert lines[2].split() == ["attention", "answer", "found", "1234567", "density"]
    assert lines[4].startswith("dense") and long_answer.strip() in lines[4]
    assert lines[4].split()[-2:] == ["yes", "1.0000"]
    # markup is dropped, literal brackets kept (escaped by the caller), a line break stays inside its row
    assert lines[5].split() == ["santa-sys:budget=64", "[1]", "no", "⏎", "newline", "no", "0.0312"]
    assert len(lines) == 6


def test_report_says_which_plots_it_left_out_and_why(tmp_path, capsys):
    quest = "quest:top_k=0.1"
    folder = _folder_with(tmp_path, ["dense", quest], _cells("dense", [1.0, 1.0, 0.0], density=1.0, kl_mean=0.0)
                          + _cells(quest, [1.0, 0.0, 0.0], density=0.1, kl_mean=0.3))
    assert main(["report", folder]) == 0
    out = capsys.readouterr().out
    notes = ["error_vs_budget.png not drawn: no method with a budget parameter has an attention error",
             "layer_error_heatmap.png not drawn: no cell tracked the per-layer attention error",
             "kl_vs_budget.png not drawn: no method with a budget parameter has a next-token KL",
             f"not in the budget plots (no budget parameter): {quest}"]
    for note in notes:
        assert note in out, note
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Plots not drawn" in report and all(note in report for note in notes)
    assert "score_vs_density.png not drawn" not in out and (tmp_path / "run" / "score_vs_density.png").is_file()


def test_terminal_tables_fold_long_cells_instead_of_cutting_them(capsys, monkeypatch):
    import re
    import sys

    from kvsieve.eval.report import print_text_table

    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cell = "x" * 150
    print_text_table(["method", "value"], [["santa-sys:budget=64", cell]], "title")
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # colours and styles
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 60
    assert "".join(ch for ch in out if ch == "x") == cell
