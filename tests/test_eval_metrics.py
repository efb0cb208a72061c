"""Scorers, teacher-forced agreement, bootstrap intervals and record summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvsieve.eval.bootstrap import bootstrap_mean_ci, paired_delta_ci
from kvsieve.eval.metrics import (
    kl_per_position,
    next_token_agreement,
    string_match_all,
    string_match_part,
    summarize_records,
)


def test_string_match_all_is_recall_over_references():
    refs = ["1234567", "7654321", "5555555"]
    assert string_match_all("They are 1234567, 7654321 and 5555555.", refs) == 1.0
    assert string_match_all("1234567 and 5555555", refs) == pytest.approx(2 / 3)
    assert string_match_all("nothing", refs) == 0.0
    assert string_match_all("APPLE-tree", ["apple-TREE"]) == 1.0  # case-insensitive, as RULER


def test_string_match_part_is_best_reference():
    assert string_match_part("It was George Westinghouse.", ["Westinghouse", "Tesla"]) == 1.0
    assert string_match_part("Edison", ["Westinghouse", "Tesla"]) == 0.0


def test_scorers_reject_bad_references():
    with pytest.raises(ValueError, match="references"):
        string_match_all("x", [])
    with pytest.raises(ValueError, match="references"):
        string_match_part("x", "abc")


def test_kl_zero_for_identical_and_matches_definition():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 50, generator=g)
    same = next_token_agreement(a, a.clone())
    assert same["kl_mean"] == pytest.approx(0.0, abs=1e-12) and same["top1_agree"] == 1.0
    b = a + 0.5 * torch.randn(7, 50, generator=g)
    res = next_token_agreement(a, b)
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    expected = (p * (p.log() - q.log())).sum(-1)
    assert res["kl_mean"] == pytest.approx(float(expected.mean()), rel=1e-9)
    assert res["kl_max"] == pytest.approx(float(expected.max()), rel=1e-9)
    assert res["top1_agree"] == pytest.approx(float((a.argmax(-1) == b.argmax(-1)).double().mean()))
    assert res["tf_tokens"] == 7
    with pytest.raises(ValueError, match="logits"):
        next_token_agreement(a, b[:3])
    # per position, and over leading batch dimensions
    assert torch.allclose(kl_per_position(a, b), expected, rtol=1e-9, atol=0)
    assert torch.allclose(kl_per_position(a.view(7, 1, 50), b.view(7, 1, 50))[:, 0], expected, rtol=1e-9, atol=0)


def test_bootstrap_ci_covers_true_mean_at_nominal_rate():
    rng = np.random.default_rng(1)
    trials, covered = 300, 0
    for t in range(trials):
        x = rng.normal(3.0, 2.0, size=40)
        _, lo, hi = bootstrap_mean_ci(x, seed=t, resamples=1000)
        covered += lo <= 3.0 <= hi
    # Percentile bootstrap at n=40 covers slightly under 95%; 300 trials give a binomial SE of ~1.3%.
    assert 0.89 <= covered / trials <= 0.99


def test_bootstrap_degenerate_cases():
    assert bootstrap_mean_ci([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    assert bootstrap_mean_ci([5.0]) == (5.0, 5.0, 5.0)
    m, lo, hi = bootstrap_mean_ci([])
    assert math.isnan(m) and math.isnan(lo) and math.isnan(hi)
    d, lo, hi = paired_delta_ci([1, 0, 1, 1], [1, 1, 1, 1])
    assert d == pytest.approx(-0.25) and lo <= d <= hi
    with pytest.raises(ValueError, match="paired"):
        paired_delta_ci([1, 0], [1])


def test_summarize_records_per_token_bytes_and_layer_errors():
    records = []
    for pos in (10, 11):  # one question forward holding two query tokens, then one decode step
        for layer in (0, 1):
            records.append({"request": 0, "step": 0, "position": pos, "layer": layer, "density": 0.1,
                            "kv_density": 0.2, "bytes_read": 100, "rel_error": 0.1 * (layer + 1), "backend": "r"})
    for layer in (0, 1):
        records.append({"request": 0, "step": 1, "position": 12, "layer": layer, "density": 0.4,
                        "kv_density": 0.5, "bytes_read": 300, "backend": "r"})
    s = summarize_records(records, n_layers=3)
    assert s["density"] == pytest.approx((4 * 0.1 + 2 * 0.4) / 6)
    assert s["bytes_read_per_step"] == pytest.approx((200 + 200 + 600) / 3)
    assert s["rel_error_by_layer"][:2] == pytest.approx([0.1, 0.2]) and s["rel_error_by_layer"][2] is None
    assert s["rel_error"] == pytest.approx(0.15)
    assert s["sparse_calls"] == 6 and s["backends"] == ["r"]
    empty = summarize_records([], n_layers=2)
    assert empty["density"] is None and empty["rel_error_by_layer"] == [None, None]
