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
