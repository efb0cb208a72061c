"""Bernoulli qKᵀ (spec §3, §8.13; paper Sec. 5, App. C): the estimators, their statistics, the method.

Statistical tests draw R independent estimates in one call (R copies of a row, each with its own
uniforms) and bound z-scores with a Bonferroni correction over the coordinates tested; variance
tolerances come from the measured fourth moment. Nothing is compared with a loose constant except
the paper's and the spec's Fig. 6 figures, whose tolerance is the measured standard error plus the
rounding of the quoted figure.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from interpreted import printed_worst, run_script

import kvsieve
from kvsieve.kernels.bernoulli.reference import (
    bernoulli_counts,
    bernoulli_query,
    estimated_scores,
    inclusion_probabilities,
    mean_group_query,
    ternary_queries,
    ternary_scores_gather_add,
)
from kvsieve.methods.bernoulli import sample_values

R = 20000
FAMILY_ALPHA = 1e-4
DRAW_KINDS = [("iid", "per-feature"), ("stratified", "per-feature"), ("stratified", "shared")]


def z_bound(n_tests: int, alpha: float = FAMILY_ALPHA) -> float:
    return NormalDist().inv_cdf(1.0 - alpha / (2 * n_tests))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def query_and_keys(seed=0, d=16, n=40, heads=1):
    g = gen(seed)
    q = torch.randn(heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(n, d, generator=g, dtype=torch.float64)
    return q, k


def assert_mean_matches(samples: torch.Tensor, target: torch.Tensor, sd: torch.Tensor | None = None) -> None:
    """z-test of the mean of ``samples [R, ...]`` against ``target [...]`` with the measured spread
    (or the known standard deviation ``sd`` of one sample)."""
    mean = samples.mean(0)
    se = (samples.std(0) if sd is None else sd) / math.sqrt(samples.shape[0])
    dev = (mean - target).abs()
    exact = se == 0
    assert torch.equal(mean[exact], target[exact].to(mean.dtype)) or bool((dev[exact] < 1e-12).all())
    z = dev[~exact] / se[~exact]
    assert float(z.max()) < z_bound(z.numel()), f"max z {float(z.max()):.2f}"


# --- unbiasedness ------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling,strata", DRAW_KINDS)
@pytest.mark.parametrize("draws", [1, 3, 4])
def test_score_estimate_is_unbiased(sampling, strata, draws):
    q, k = query_and_keys(seed=draws)
    q_est, _ = bernoulli_query(q.expand(R, -1), draws, sampling=sampling, strata=strata, generator=gen(1))
    assert_mean_matches(q_est @ k.T, (q @ k.T)[0])


@pytest.mark.parametrize("sampling,strata", DRAW_KINDS)
def test_mean_group_estimate_is_unbiased_for_every_head(sampling, strata):
    q, k = query_and_keys(seed=5, heads=4)
    q[1] *= 3.0  # heads of very different scale share one feature set
    q_est, read = mean_group_query(q.expand(R, 4, 16), 4, sampling=sampling, strata=strata, generator=gen(2))
    assert read.shape == (R, 16)
    p_hat = torch.einsum("rgd,nd->rgn", q_est, k)
    assert_mean_matches(p_hat, q @ k.T)


# --- variance ----------------------------------------------------------------------------------


def _check_variance(draws_per_feature: torch.Tensor, predicted: torch.Tensor) -> None:
    """Empirical variance of ``draws_per_feature [R, d]`` against ``predicted [d]`` with a tolerance
    from the measured fourth central moment: ``Var(s²) ≈ (μ4 − σ⁴) / R``."""
    x = draws_per_feature
    centered = x - x.mean(0)
    var = centered.pow(2).mean(0)
    mu4 = centered.pow(4).mean(0)
    zero = predicted == 0
    assert bool((x[:, zero] == x[:1, zero]).all()), "a deterministic feature varied"
    se = ((mu4 - var**2).clamp_min(0) / x.shape[0]).sqrt()[~zero]
    z = (var[~zero] - predicted[~zero]).abs() / se
    assert float(z.max()) < z_bound(int((~zero).sum())), f"max z {float(z.max()):.2f}"


@pytest.mark.parametrize("strata", ["per-feature", "shared"])
@pytest.mark.parametrize("draws", [2, 4, 7])
def test_stratified_per_feature_variance_is_frac_times_one_minus_frac_over_b_squared(strata, draws):
    f = torch.rand(24, generator=gen(draws), dtype=torch.float64)
    f[:4] = torch.tensor([0.0, 1.0, 1.0 / draws, 2.0 / draws], dtype=torch.float64)  # B·f integer: no randomness at all
    c = bernoulli_counts(f.expand(R, -1), draws, sampling="stratified", strata=strata, generator=gen(3))
    r = torch.frac(draws * f)
    r = torch.where((r < 1e-12) | (r > 1 - 1e-12), torch.zeros_like(r), r)  # B·f integer up to rounding
    _check_variance(c.to(torch.float64) / draws, r * (1 - r) / draws**2)


@pytest.mark.parametrize("draws", [1, 4])
def test_iid_per_feature_variance_is_f_times_one_minus_f_over_b(draws):
    f = torch.rand(24, generator=gen(11), dtype=torch.float64)
    c = bernoulli_counts(f.expand(R, -1), draws, sampling="iid", generator=gen(4))
    _check_variance(c.to(torch.float64) / draws, f * (1 - f) / draws)


def test_shared_strata_correlate_features_that_per_feature_strata_keep_independent():
    f = torch.full((2,), 0.3, dtype=torch.float64)  # B·f = 1.2: both features decide in stratum 1
    corr = {}
    for strata in ("per-feature", "shared"):
        c = bernoulli_counts(f.expand(R, -1), 4, sampling="stratified", strata=strata, generator=gen(5))
        corr[strata] = float(torch.corrcoef(c.T.to(torch.float64))[0, 1])
    bound = z_bound(2) / math.sqrt(R)  # sd of a sample correlation near 0
    assert abs(corr["per-feature"]) < bound
    assert corr["shared"] > 1 - 1e-9  # one uniform decides both


# --- Fig. 6 ------------------------------------------------------------------------------------


def fig6_errors(draws: int, sampling: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-instance ``‖p̂ − p‖ / ‖p‖`` and its predicted mean square, Fig. 6's setup: d = 128,
    n = 1024, 100 instances, q ~ N(0, 1), K ~ N(0, 1)/√d, norm = max|q|."""
    g = gen(seed)
    d, n, inst = 128, 1024, 100
    q = torch.randn(inst, d, generator=g, dtype=torch.float64)
    k = torch.randn(inst, n, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    p = torch.einsum("id,ind->in", q, k)
    q_est, _ = bernoulli_query(q, draws, sampling=sampling, generator=g)
    err = (torch.einsum("id,ind->in", q_est, k) - p).norm(dim=-1) / p.norm(dim=-1)
    f, norm = inclusion_probabilities(q.abs())
    if sampling == "iid":
        var = norm**2 * f * (1 - f) / draws
    else:
        r = torch.frac(draws * f)
        var = norm**2 * r * (1 - r) / draws**2
    predicted_sq = torch.einsum("id,ind->i", var, k**2) / p.pow(2).sum(-1)
    return err, predicted_sq


@pytest.mark.parametrize("sampling,quoted", [("iid", 0.56), ("stratified", 0.28)])
def test_fig6_error_at_b4_matches_the_spec_and_the_variance_formula(sampling, quoted):
    err, predicted_sq = fig6_errors(4, sampling)
    se = float(err.std() / math.sqrt(err.numel()))
    # The spec quotes two digits (the paper: "about 60%" and "30%").
    assert abs(float(err.mean()) - quoted) < 3 * se + 0.005
    sq = err**2
    assert abs(float(sq.mean() - predicted_sq.mean())) < z_bound(1) * float(sq.std()) / math.sqrt(sq.numel())


def test_fig6_error_scales_as_b_to_minus_half_iid_and_b_to_minus_one_stratified():
    bs = torch.tensor([4.0, 8.0, 16.0, 32.0], dtype=torch.float64)
    x = bs.log() - bs.log().mean()
    for sampling, slope_expected, tol in [("iid", -0.5, 0.05), ("stratified", -1.0, 0.1)]:
        y = torch.tensor([float(fig6_errors(int(b), sampling, seed=int(b))[0].mean()) for b in bs]).log()
        slope = float((x * (y - y.mean())).sum() / (x * x).sum())
        assert abs(slope - slope_expected) < tol, (sampling, slope)


# --- access rate, limits, the multiplier-free form ----------------------------------------------


@pytest.mark.parametrize("sampling,strata", DRAW_KINDS)
def test_feature_access_rate_matches_its_closed_form(sampling, strata):
    f = torch.rand(24, generator=gen(6), dtype=torch.float64)
    draws = 3
    c = bernoulli_counts(f.expand(R, -1), draws, sampling=sampling, strata=strata, generator=gen(7))
    expected = 1 - (1 - f) ** draws if sampling == "iid" else (draws * f).clamp(max=1.0)
    assert_mean_matches((c > 0).to(torch.float64), expected, sd=(expected * (1 - expected)).sqrt())


def test_b_large_gives_exact_scores():
    q, k = query_and_keys(seed=8)
    p = (q @ k.T)[0]
    draws = 4096
    q_est, read = bernoulli_query(q[0], draws, sampling="stratified", generator=gen(9))
    # Stratified draws miss f by less than 1/B per feature, deterministically.
    norm = q.abs().max()
    bound = norm / draws * k.abs().sum(1)
    assert bool(((q_est @ k.T) - p).abs().le(bound).all())
    q_iid, _ = bernoulli_query(q[0], draws, sampling="iid", generator=gen(9))
    f = q[0].abs() / norm
    sd = (norm**2 * f * (1 - f) / draws) @ (k**2).T
    assert bool(((q_iid @ k.T) - p).abs().le(z_bound(k.shape[0]) * sd.sqrt()).all())


def test_stratified_is_exact_when_every_b_f_is_an_integer():
    q = torch.tensor([[1.0, -0.25, 0.5, -0.75, 0.0, 0.25]], dtype=torch.float64)
    q_est, read = bernoulli_query(q.expand(50, -1), 4, sampling="stratified", generator=gen(10))
    assert torch.equal(q_est, q.expand(50, -1))
    assert torch.equal(read, (q != 0).expand(50, -1))


@pytest.mark.parametrize("sampling,strata", DRAW_KINDS)
def test_gather_add_form_equals_the_effective_query(sampling, strata):
    q, k = query_and_keys(seed=12, d=32, n=20)
    q_hat, norm = ternary_queries(q[0], 5, sampling=sampling, strata=strata, generator=gen(13))
    assert set(q_hat.unique().tolist()) <= {-1, 0, 1}
    q_est, read = bernoulli_query(q[0], 5, sampling=sampling, strata=strata, generator=gen(13))
    assert torch.equal(read, (q_hat != 0).any(0))
    torch.testing.assert_close(ternary_scores_gather_add(q_hat, k, norm), q_est @ k.T, rtol=1e-12, atol=1e-12)


def test_zero_query_gives_zero_scores_and_reads_nothing():
    q_est, read = bernoulli_query(torch.zeros(3, 8), 4, generator=gen(0))
    assert torch.equal(q_est, torch.zeros(3, 8, dtype=torch.float64)) and not bool(read.any())


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda q: bernoulli_query(q, 0), "draws"),
        (lambda q: bernoulli_query(q, -2), "draws"),
        (lambda q: bernoulli_query(q, 2.0), "draws"),
        (lambda q: bernoulli_query(q, True), "draws"),
        (lambda q: bernoulli_query(q, 4, norm=0.0), "norm"),
        (lambda q: bernoulli_query(q, 4, norm=-1.0), "norm"),
        (lambda q: bernoulli_query(q, 4, norm=0.5 * float(q.abs().max())), "norm >= max"),
        (lambda q: bernoulli_query(q, 4, norm_factor=0.9), "norm_factor"),
        (lambda q: bernoulli_query(q, 4, sampling="systematic"), "sampling"),
        (lambda q: bernoulli_query(q, 4, sampling="iid", strata="shared"), "strata"),
        (lambda q: bernoulli_query(torch.where(q > 1, float("nan"), q), 4), "q: contains NaN"),
        (lambda q: mean_group_query(torch.where(q > 1, float("inf"), q), 4), "q: contains NaN"),
        (lambda q: mean_group_query(q[0, 0], 4), "q: expected shape"),
    ],
)
def test_bad_input_is_a_clear_value_error(call, match):
    q = torch.randn(2, 3, 8, generator=gen(0)) * 2
    with pytest.raises(ValueError, match=match):
        call(q)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("bernoulli-qk:draws=0", "draws"),
        ("bernoulli-qk:norm_factor=0.5", "norm_factor"),
        ("bernoulli-qk:norm_factor=-1", "norm_factor"),
        ("bernoulli-qk:sampling=iid,strata=shared", "strata"),
        ("bernoulli-qk:query=group", "query"),
        ("bernoulli-qk:values=santa-prop,budget=0", "budget"),
        ("bernoulli-qk:values=topk", "values"),
    ],
)
def test_bad_config_is_a_clear_value_error(spec, match):
    with pytest.raises(ValueError, match=match):
        kvsieve.method(spec)


def test_method_rejects_non_finite_queries():
    q, k, v = model_like_inputs()
    q[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="q: contains NaN"):
        kvsieve.method("bernoulli-qk").decode(q, k, v, seed=0)


# --- the method --------------------------------------------------------------------------------


def model_like_inputs(batch=2, heads=6, kv_heads=2, n=48, d=16, dv=8, dtype=torch.float64, seed=0, peaked=1.0):
    g = gen(seed)
    q = torch.randn(batch, heads, d, generator=g, dtype=torch.float64) * peaked
    k = torch.randn(batch, kv_heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, n, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    "spec",
    ["bernoulli-qk", "bernoulli-qk:query=mean-group", "bernoulli-qk:draws=2,sampling=iid",
     "bernoulli-qk:query=mean-group,values=santa-sys,budget=16",
     "bernoulli-qk:query=mean-group,values=santa-prop,budget=16,tile_size=8",
     "bernoulli-qk:values=santa-flash,budget=16,tile_size=8", "bernoulli-qk:values=santa,budget=8"],
)
def test_decode_shapes_stats_and_padding_invariance(spec, dtype):
    m = kvsieve.method(spec)
    assert m.spec == spec and m.stochastic
    q, k, v = model_like_inputs(dtype=dtype)
    lengths = torch.tensor([48, 30])
    out, stats = m.decode(q, k, v, lengths=lengths, seed=3)
    assert out.shape == (2, 6, 8) and out.dtype == dtype and bool(torch.isfinite(out).all())
    assert 0 < stats.k_access_head <= stats.k_access_group <= 1
    assert stats.backend == "reference" and stats.draws == m.config.draws
    # What lies past a row's length is never read: other junk there gives the same output.
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 30:] = 100.0
    v2[1, :, 30:] = -100.0
    out2, stats2 = m.decode(q, k2, v2, lengths=lengths, seed=3)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    assert stats2.bytes_read == stats.bytes_read


def test_stats_count_feature_reads_and_bytes():
    q, k, v = model_like_inputs(batch=1)
    for query in ("head", "mean-group"):
        m = kvsieve.method("bernoulli-qk", query=query, draws=2)
        scores, read_head, read_group = m.estimate_scores(
            kvsieve.core.inputs.check_decode_inputs(q, k, v), gen(21))
        _, stats = m.decode(q, k, v, seed=gen(21))
        d = q.shape[-1]
        assert stats.k_access_head == pytest.approx(float(read_head.double().mean()))
        assert stats.k_access_group == pytest.approx(float(read_group.double().mean()))
        assert stats.bytes_read == int(read_group.sum()) * k.shape[2] * 8 + 2 * k.shape[2] * v.shape[-1] * 8
        if query == "mean-group":
            assert stats.k_access_head == stats.k_access_group
        assert stats.k_features_group == pytest.approx(stats.k_access_group * d)


def test_access_equals_the_fraction_of_non_zero_effective_queries():
    q, k, v = model_like_inputs(batch=3, peaked=1.0)
    for query in ("head", "mean-group"):
        m = kvsieve.method("bernoulli-qk", query=query, draws=3)
        inputs = kvsieve.core.inputs.check_decode_inputs(q, k, v)
        g = gen(30)
        # estimate_scores draws first; rebuild the effective queries with the same stream
        if query == "head":
            q_est, _ = bernoulli_query(q, 3, generator=g)
        else:
            q_est, _ = mean_group_query(q.view(3, 2, 3, 16), 3, generator=g)
            q_est = q_est.view(3, 6, 16)
        _, read_head, read_group = m.estimate_scores(inputs, gen(30))
        assert torch.equal(read_head, q_est != 0)
        assert torch.equal(read_group, (q_est != 0).view(3, 2, 3, 16).any(2))


def test_mean_group_with_one_head_per_group_is_the_per_head_estimator():
    q, k, v = model_like_inputs(heads=2, kv_heads=2)
    a, sa = kvsieve.method("bernoulli-qk", query="head").decode(q, k, v, seed=4)
    b, sb = kvsieve.method("bernoulli-qk", query="mean-group").decode(q, k, v, seed=4)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert sa.k_access_group == sb.k_access_group


def test_many_draws_give_exact_attention():
    q, k, v = model_like_inputs(peaked=2.0)
    exact, _ = kvsieve.method("dense").decode(q, k, v)
    for query in ("head", "mean-group"):
        out, stats = kvsieve.method("bernoulli-qk", query=query, draws=20000).decode(q, k, v, seed=1)
        rel = float((out - exact).norm() / exact.norm())
        assert rel < 1e-3, (query, rel)
        assert stats.k_access_group == 1.0


# --- composition with S²ANTA --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,kwargs",
    [("santa", {}), ("santa-strat", {}), ("santa-sys", {}), ("santa-prop", {"rounding": "systematic"}),
     ("santa-flash", {})],
)
def test_value_sampling_is_unbiased_for_the_softmax_of_the_estimated_scores(kind, kwargs):
    """Given one draw of the estimated scores ŝ, S²ANTA's mean is softmax(ŝ)V: V sampling adds no bias."""
    q, k, v = model_like_inputs(batch=1, heads=2, kv_heads=1, n=40, d=16, dv=4, peaked=1.5)
    q_est, _ = bernoulli_query(q, 2, generator=gen(40))
    scores = estimated_scores(q_est, k, 0.25)  # one fixed draw
    reps = 4000
    out, v_read, samples = sample_values(kind, scores.expand(reps, -1, -1), v.expand(reps, -1, -1, -1), 8,
                                         gen(41), tile_size=8, **kwargs)
    target = torch.einsum("hn,nd->hd", torch.softmax(scores[0], -1), v[0, 0])
    assert_mean_matches(out, target)
    assert v_read.shape == (reps, 2, 40)


def test_composition_has_the_score_stage_bias_and_no_more():
    """E[output] = E_ŝ[softmax(ŝ)]V with or without V sampling, and that differs from softmax(s)V."""
    q, k, v = model_like_inputs(batch=1, heads=2, kv_heads=1, n=24, d=8, dv=4, peaked=3.0)
    reps = 6000
    qs, ks, vs = q.expand(reps, -1, -1), k.expand(reps, -1, -1, -1), v.expand(reps, -1, -1, -1)
    exact, _ = kvsieve.method("dense").decode(q, k, v)
    alone, _ = kvsieve.method("bernoulli-qk", draws=1).decode(qs, ks, vs, seed=50)
    composed, _ = kvsieve.method("bernoulli-qk", draws=1, values="santa-sys", budget=4).decode(qs, ks, vs, seed=51)
    se_alone = alone.std(0) / math.sqrt(reps)
    se_composed = composed.std(0) / math.sqrt(reps)
    # No extra bias from the V stage: the two means agree.
    z = (alone.mean(0) - composed.mean(0)).abs() / (se_alone**2 + se_composed**2).sqrt()
    assert float(z.max()) < z_bound(z.numel())
    # The score stage's Jensen bias is there and far beyond noise at B = 1 and peaked attention.
    z_bias = (alone.mean(0) - exact[0]).abs() / se_alone
    assert float(z_bias.max()) > 10 * z_bound(z_bias.numel())


# --- the feature-major score kernel --------------------------------------------------------------

KERNEL_CASES = """
import torch
from kvsieve.kernels.bernoulli.feature_major import (compact_features, feature_major_scores,
    feature_major_scores_reference, to_feature_major, append_feature_major)
from kvsieve.kernels.bernoulli.reference import bernoulli_query, mean_group_query
device = "{device}"
cases = [(1, 1, 1, 33, 64, torch.float32, "head"), (2, 2, 3, 300, 64, torch.bfloat16, "mean-group"),
         (1, 8, 4, 513, 128, torch.float16, "mean-group"), (3, 1, 2, 70, 128, torch.float32, "head"),
         (1, 2, 4, 17, 256, torch.bfloat16, "head")]
worst = 0.0
for seed, (b, hkv, g, n, d, dtype, query) in enumerate(cases):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, d, generator=gen) * 2
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    draws = 1 + seed % 5
    if query == "head":
        q_est, read = bernoulli_query(q, draws, generator=gen)
        read = read.view(b, hkv, g, d).any(2)
    else:
        q_est, read = mean_group_query(q.view(b, hkv, g, d), draws, generator=gen)
        q_est = q_est.view(b, hkv * g, d)
    lengths = torch.randint(1, n + 1, (b,), generator=gen)
    lengths[0] = n
    idx, nf = compact_features(read)
    q_est, k, idx, nf, lengths = (t.to(device) for t in (q_est, k, idx, nf, lengths))
    kt = to_feature_major(k)
    ref = feature_major_scores_reference(q_est, kt, idx, nf, lengths, d ** -0.5)
    out = feature_major_scores(q_est, kt, idx, nf, lengths, d ** -0.5)
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out)), "masking differs"
    err = float((out.double() - ref)[finite].abs().max() / ref[finite].abs().max())
    worst = max(worst, err)
# append: one new key written into both layouts agrees
kt2 = to_feature_major(k[..., :-1, :].contiguous().to(device))
kt2 = torch.cat([kt2, torch.zeros_like(kt2[..., :1])], -1).contiguous()
append_feature_major(kt2, k[..., -1, :], torch.full((k.shape[0],), k.shape[2] - 1, device=device))
assert torch.equal(kt2, to_feature_major(k))
print("WORST", worst)
"""


def _run_kernel_cases(device: str, interpret: bool) -> float:
    return printed_worst(run_script(KERNEL_CASES, device, interpret))


@pytest.mark.triton
def test_feature_major_kernel_matches_its_reference_under_the_interpreter():
    pytest.importorskip("triton")
    # The interpreter computes the tf32 dot in float32: agreement to float32 rounding.
    assert _run_kernel_cases("cpu", True) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_feature_major_kernel_matches_its_reference_on_the_gpu():
    # tf32 tensor-core dots: q_est rounded to 10 mantissa bits.
    assert _run_kernel_cases("cuda", False) < 3e-3


@pytest.mark.parametrize(
    "change,match",
    [(dict(d=32), "head dim 32"), (dict(dtype=torch.float64), "dtype"), (dict(kt_shape="bad"), "kt: shape"),
     (dict(lengths="bad"), "lengths")],
)
def test_feature_major_inputs_it_does_not_serve_are_clear_errors(change, match):
    from kvsieve.kernels.bernoulli.feature_major import check_feature_major_inputs

    d = change.get("d", 64)
    dtype = change.get("dtype", torch.bfloat16)
    q_est = torch.zeros(1, 4, d)
    kt = torch.zeros(1, 2, d if change.get("kt_shape") is None else d + 1, 10, dtype=dtype)
    idx, nf = torch.zeros(1, 2, d, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32)
    lengths = torch.tensor([10]) if change.get("lengths") is None else torch.tensor([10, 10])
    with pytest.raises(ValueError, match=match):
        check_feature_major_inputs(q_est, kt, idx, nf, lengths)


# --- the fused decode path: feature-major Bernoulli scores + S²ANTA-prop --------------------------

DECODE_CASES = """
import torch
from kvsieve.core.rng import RandomKey
from kvsieve.kernels.bernoulli.decode import bernoulli_prop_reference, bernoulli_prop_triton
from kvsieve.kernels.bernoulli.feature_major import FeatureMajorKeys, to_feature_major
device = "{device}"
# (B, Q rows per batch row, Hkv, G, N, d, dtype, S, tile, draws, device counter in the key)
cases = [(1, 1, 2, 4, 300, 64, torch.float32, 16, 32, 4, False),
         (2, 1, 1, 3, 200, 128, torch.float16, 32, 64, 8, False),
         (2, 2, 2, 1, 90, 64, torch.float32, 8, 32, 2, True),
         (1, 3, 1, 4, 70, 64, torch.float32, 128, 32, 16, False)]
worst, flips = {{}}, 0
rows_seen = set()
for seed, (b, ql, hkv, g, n, d, dtype, s, tile, draws, dev_counter) in enumerate(cases):
    gen = torch.Generator().manual_seed(100 + seed)
    hq = hkv * g
    # queries with outlier features, as real ones have: some features' f is small, so draws skip them
    q = (torch.randn(b * ql, hq, d, generator=gen) * torch.rand(d, generator=gen) ** 3 * 4).to(dtype).to(device)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype).to(device)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype).to(device)
    last = torch.randint(ql, n + 1, (b,), generator=gen)
    last[0] = n
    lens = (last[:, None] - ql + 1 + torch.arange(ql)[None, :]).reshape(-1).to(torch.int32).to(device)
    keys = FeatureMajorKeys()
    # the cache as a decode loop grows it: all but the last key first, then one step more
    kt = keys.update(k, (lens - 1).clamp(min=1).to(torch.int32), ql)
    kt = keys.update(k, lens, ql)
    for row in range(b):
        nb = int(last[row])
        assert torch.equal(kt[row, :, :, :nb], to_feature_major(k)[row, :, :, :nb]), "kT copy differs"
    step = torch.tensor(seed + 2, device=device)
    key = RandomKey(7 + seed, (0, step) if dev_counter else (0, seed + 2))
    k_rows = k.repeat_interleave(ql, 0)
    v_rows = v.repeat_interleave(ql, 0)
    # the K layouts: feature-major only; whole cache rows for every unit (row_above=0); mixed, with the
    # feature-major copy brought up to date by the draw launch (append) from half the keys
    runs = [("largest-remainder", dict()), ("systematic", dict()), ("largest-remainder", dict(k=k_rows, row_above=0.0))]
    fresh = FeatureMajorKeys()
    kt_half = fresh.update(k, torch.full_like(lens, max(1, n // 2)), ql)
    runs.append(("systematic", dict(k=k_rows, row_above=0.5, append=(k, fresh.done))))
    for rounding, extra in runs:
        kt_run = kt_half if "append" in extra else kt
        out, counts, budgets, n_feat = bernoulli_prop_triton(q, kt_run, v_rows, lens, d ** -0.5, draws, s, tile, key,
                                                             99, rounding=rounding, rows_per_batch=ql,
                                                             write_counts=True, block_n=16, stats_programs=3,
                                                             **extra)
        if "append" in extra:
            assert torch.equal(kt_half[..., :n], kt[..., :n]), "the draw launch's append differs from update"
            rows_seen |= set((n_feat > d // 2).reshape(-1).tolist())
        ref, read = bernoulli_prop_reference(q.double(), k_rows.double(), v_rows.double(), lens, d ** -0.5, draws, s,
                                             tile, key, 99, rounding=rounding, rows_per_batch=ql)
        assert torch.equal(n_feat.long(), read.sum(-1)), (n_feat, read.sum(-1))
        assert (read.double().mean() < 1).item(), "the case should skip some features"
        assert (budgets.sum(-1) == s).all()
        flips += int((budgets.long() != ref.tile_budgets).sum()) + int((counts.long() != ref.counts).sum())
        # a flipped count moves one sample to a neighbouring key: compare the heads without one
        same = (counts.long() == ref.counts).all(-1) & (budgets.long() == ref.tile_budgets).all(-1)
        err = float((out.double() - ref.out)[same].norm() / ref.out[same].norm())
        worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
assert rows_seen == {{True, False}}, "the mixed runs should read both layouts"
print("FLIPS", flips)
print("WORST", worst)
"""


def _run_decode_cases(device: str, interpret: bool) -> tuple[int, dict]:
    import ast

    out = run_script(DECODE_CASES, device, interpret)
    return int(out.split("FLIPS")[-1].split()[0]), ast.literal_eval(out.split("WORST")[-1].strip())


@pytest.mark.triton
def test_fused_decode_path_matches_its_reference_under_the_interpreter():
    """Same features kept (the draw kernel reads the reference's uniforms), same tile budgets and
    counts (float32 scores against float64: no boundary flip on these cases), output to the output
    dtype's rounding; multi-row calls, a device step counter in the key, ragged rows; K read from the
    feature-major copy, from the cache's rows (every unit, or those above half the features), and the copy
    brought up to date by the draw launch itself."""
    pytest.importorskip("triton")
    flips, worst = _run_decode_cases("cpu", True)
    assert flips == 0
    assert worst["torch.float32"] < 1e-5 and worst["torch.float16"] < 2e-3, worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_decode_path_matches_its_reference_on_the_gpu():
    flips, worst = _run_decode_cases("cuda", False)
    assert flips <= 4, flips  # float32 scores against float64 may move a floor boundary (4 runs per case)
    assert worst["torch.float32"] < 1e-4 and worst["torch.float16"] < 3e-3, worst


METHOD_CASES = """
import torch
import kvsieve
from kvsieve.core.rng import RandomKey
device = "{device}"
spec = "bernoulli-qk:query=mean-group,values=santa-prop,budget=16,tile_size=32,draws=4"
m_fused = kvsieve.method(spec + ",backend=triton")
m_ref = kvsieve.method(spec + ",backend=reference")
gen = torch.Generator().manual_seed(5)
b, hkv, g, n, d = 2, 2, 3, 160, 64
q_all = (torch.randn(8, b, hkv * g, d, generator=gen) * torch.rand(d, generator=gen) ** 3 * 4).to(device)
k = torch.randn(b, hkv, n, d, generator=gen).to(device)
v = torch.randn(b, hkv, n, d, generator=gen).to(device)
state = m_fused.new_state()
for step in range(8):  # a decode loop: the cache grows by one key per row and step, the state follows it
    lengths = torch.tensor([n - 8 + step + 1, 12 + step], device=device)  # row 1 is covered until 16 keys
    key = RandomKey(3, (0, 4))
    out, stats = m_fused.decode(q_all[step], k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    fresh, _ = m_fused.decode(q_all[step], k, v, lengths=lengths, seed=key, check_finite=False)
    assert torch.equal(out, fresh), "the incrementally kept kT differs from a fresh copy"
    ref, rstats = m_ref.decode(q_all[step], k, v, lengths=lengths, seed=key, check_finite=False)
    assert stats.backend == "triton" and rstats.backend == "reference"
    # the score stage draws the same features on both paths
    assert abs(stats.k_access_group - rstats.k_access_group) < 1e-12, (stats.k_access_group, rstats.k_access_group)
    assert stats.k_access_group < 1
    covered = int(lengths[1]) <= 16
    assert stats.exact_rows == int(covered)
    if covered:  # exact attention on both paths
        exact, _ = kvsieve.method("dense").decode(q_all[step], k, v, lengths=lengths)
        torch.testing.assert_close(out[1], exact[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ref[1], exact[1], rtol=1e-5, atol=1e-5)
# a chunk of 3 query rows per batch row in one call (kT follows the cache, rows share it)
chunk = q_all[:3].permute(1, 2, 0, 3).contiguous()  # [B, Hq, 3, d]
lengths = torch.tensor([n, n - 30], device=device)
out, stats = m_fused.decode(chunk, k, v, lengths=lengths, seed=RandomKey(9), check_finite=False)
_, rstats = m_ref.decode(chunk, k, v, lengths=lengths, seed=RandomKey(9), check_finite=False)
assert out.shape == chunk.shape and bool(torch.isfinite(out).all())
assert abs(stats.k_access_group - rstats.k_access_group) < 1e-12
# queries without outlier features at many draws keep every feature: whole cache rows are read, and counted
flat = kvsieve.method(spec.replace("draws=4", "draws=32") + ",backend=triton")
q_flat = torch.randn(b, hkv * g, d, generator=gen).to(device)
lengths = torch.tensor([n, n - 30], device=device)
out, stats = flat.decode(q_flat, k, v, lengths=lengths, seed=RandomKey(2), check_finite=False)
assert stats["k_row_layout"] == 1.0 and stats.k_access_group > 0.8, (stats["k_row_layout"], stats.k_access_group)
v_rows = stats.kv_rows_read * b * hkv  # distinct V rows summed over the units
assert abs(stats.bytes_read - (float(lengths.sum()) * hkv * d + v_rows * d) * 4) < 1e-6 * stats.bytes_read
assert bool(torch.isfinite(out).all())
print("OK")
"""


@pytest.mark.triton
def test_method_kernel_path_keeps_its_feature_major_copy_through_a_decode_loop():
    """bernoulli-qk's kernel path under the interpreter: the kT kept in the state as the cache grows gives
    what a fresh copy gives, the features read equal the reference path's (same uniforms), and rows the
    budget covers get exact attention on both paths."""
    pytest.importorskip("triton")
    assert "OK" in run_script(METHOD_CASES, "cpu", True)


COMPILE_FOR_H100 = """
from kvsieve.kernels.bernoulli import decode as bd

ptrs = dict(q_ptr="*bf16", lens_ptr="*i32", words_ptr="*i64", qest_ptr="*fp32", qc_ptr="*fp32", idx_ptr="*i32",
            nfeat_ptr="*i32", kc_ptr="*bf16", done_ptr="*i32", kt_ptr="*bf16", k_ptr="*bf16", m_ptr="*fp32",
            l_ptr="*fp32", stash_ptr="*fp32")
for append in (False, True):
    compile_(bd._mean_group_draw_kernel, ptrs, dict(G=4, BLOCK_G=16, D=128, ROW_WORDS=True, STREAM=5, APPEND=append,
                                                   PDL=True), floats=("norm_factor",))
    print("draw", append)
for split in (False, True):
    compile_(bd._feature_major_stats_kernel, ptrs, dict(G=4, BLOCK_G=16, D=128, TILE=256, BLOCK_N=256, FB=16,
                                                        SPLIT=split, PDL=True), floats=("scale",))
    compile_(bd._row_stats_kernel, ptrs, dict(G=4, BLOCK_G=16, D=128, TILE=256, BLOCK_N=64, SPLIT=split, PDL=True),
             floats=("scale",))
    print("stats", split)
print("COMPILED")
"""


VECTOR_LOADS = """
import re
from kvsieve.kernels.bernoulli import decode as bd

pointers = dict(qest_ptr="*fp32", kt_ptr="*bf16", idx_ptr="*i32", nfeat_ptr="*i32", lens_ptr="*i32", m_ptr="*fp32",
                l_ptr="*fp32", stash_ptr="*fp32")
# what a launch specialises: 16-byte aligned tensors, and the capacity and kT's strides multiples of 16 (reserve)
aligned = set(pointers) | {"capacity", "s_kt_b", "s_kt_h", "s_kt_f"}
_, stages, block, default_fb = bd.STATS_LAUNCH
for fb in sorted({16, default_fb}):  # 16 features per step, and the default launch's
    meta = dict(G=4, BLOCK_G=16, D=128, TILE=256, BLOCK_N=block, FB=fb, SPLIT=True, PDL=True)
    asm = compile_(bd._feature_major_stats_kernel, pointers, meta, floats=("scale",), num_stages=stages,
                   aligned=aligned).asm
    wide = re.findall(r"cp[.]async[.]cg|ld[.]global[.]v4", asm["ptx"])
    # the K blocks the pipeline keeps in flight: the leading dimension of the K block's shared-memory buffer
    kbuf = re.findall(rf"local_alloc : [(][)] -> !ttg.memdesc<(\\d+)x{fb}x{block}xbf16", asm["ttgir"])
    print("FB", fb, "STAGES", stages, "B16", len(re.findall(r"ld[.]global[.]b16", asm["ptx"])), "WIDE", len(wide),
          "KBUF", max(map(int, kbuf), default=0))
print("COMPILED")
"""


@pytest.mark.triton
def test_feature_major_stats_kernel_reads_feature_rows_in_16_byte_vectors():
    """The feature rows are masked by kT's capacity (a multiple of 16), not by the row length: a length mask on the
    contiguous key axis compiles the K loads to 2-byte loads (measured: the stats pass at ~1.4 TB/s end to end).
    The K loads do not wait on a load of the feature list in the loop, so at the default launch's pipeline stages
    all but one stage keep a K block in flight (a list load in the loop would take one of them), at 16 features
    per step and at the default launch's."""
    pytest.importorskip("triton")
    from interpreted import compile_for_sm90

    out = compile_for_sm90(VECTOR_LOADS)
    lines = out.splitlines()[:-1]
    for line in lines:
        b16, wide, kbuf, stages = (int(line.split(tag)[1].split()[0]) for tag in ("B16", "WIDE", "KBUF", "STAGES"))
        assert b16 == 0 and wide > 0, out
        assert kbuf >= stages - 1 >= 2, out
    assert len(lines) == 2 and out.count("FB 16 ") == 1, out


@pytest.mark.triton
def test_fused_decode_kernels_compile_for_the_h100():
    """The interpreter neither type-checks branches nor runs the 16-bit tensor-core dots: compiling for sm_90 (no
    GPU needed) does, for the draw launch with and without the append and the stats launch with both K layouts."""
    pytest.importorskip("triton")
    from interpreted import compile_for_sm90

    compile_for_sm90(COMPILE_FOR_H100)
