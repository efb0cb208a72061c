"""vAttention: quantiles, the CLT budget, exactness, flags, GQA, the (ε, δ) claim on synthetic data."""

import math

import pytest
import torch
from conftest import random_qkv

import kvsieve
from kvsieve.core.inputs import check_decode_inputs
from kvsieve.methods.shared.selection import IndexSet, uniform_sample
from kvsieve.methods.vattention import clt_budget, full_budget, hoeffding_budget, normal_quantile


def dense(q, k, v, **kw):
    return kvsieve.method("dense").decode(q, k, v, **kw)[0]


def rel_err(a, b):
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def test_normal_quantiles():
    two = normal_quantile(torch.tensor([0.05, 0.1, 0.2, 0.3]), True)
    one = normal_quantile(torch.tensor([0.05, 0.1, 0.2, 0.3]), False)
    torch.testing.assert_close(two, torch.tensor([1.95996, 1.64485, 1.28155, 1.03643], dtype=torch.float64),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(one, torch.tensor([1.64485, 1.28155, 0.84162, 0.52440], dtype=torch.float64),
                               atol=1e-5, rtol=0)


def test_budget_scales_as_the_formula_says():
    z = normal_quantile(0.05, True)
    b = clt_budget(z, torch.tensor(1000.0), torch.tensor(2.0), 0.1, torch.tensor(500.0))
    assert float(b) == pytest.approx((1.959964 * 1000 * 2 / (0.1 * 500)) ** 2, rel=1e-6)
    assert float(clt_budget(z, torch.tensor(1000.0), torch.tensor(2.0), 0.05, torch.tensor(500.0)) / b) == \
        pytest.approx(4.0)
    ratio = clt_budget(normal_quantile(0.05, True), 1.0, 1.0, 1.0, 1.0) / clt_budget(normal_quantile(0.1, True), 1.0,
                                                                                    1.0, 1.0, 1.0)
    assert float(ratio) == pytest.approx((1.959964 / 1.644854) ** 2, rel=1e-5)
    assert float(clt_budget(z, torch.tensor(2000.0), torch.tensor(2.0), 0.1, torch.tensor(500.0)) / b) == \
        pytest.approx(4.0)
    # Hoeffding on values in [0, R] needs more than the CLT whenever σ ≤ R/2 (always true for such values).
    h = hoeffding_budget(0.05, torch.tensor(1000), torch.tensor(4.0), 0.1, torch.tensor(500.0))
    assert float(h) > float(b)


def test_full_budget_is_at_least_each_single_bound_at_the_split():
    """Theorem 4.3's budget covers b_D(ε'/2, δ') and b_N((ε−ε')/2, δ−δ') at its best split, and is no
    larger than the budget of the simple split ε' = ε/2, δ' = δ/2 (which is on the grid for odd sizes)."""
    cfg = kvsieve.method("vattention", bound="full", epsilon=0.1, delta=0.1, grid=19).config
    n_s, sigma, d_hat, tr, n_norm = (torch.tensor([[1000.0]]), torch.tensor([[3.0]]), torch.tensor([[800.0]]),
                                     torch.tensor([[50.0]]), torch.tensor([[300.0]]))
    b = full_budget(cfg, n_s, sigma, d_hat, tr, n_norm)
    z = normal_quantile(0.05, True)
    simple = max(float(clt_budget(z, n_s, sigma, 0.025, d_hat)), float(clt_budget(z, n_s, tr.sqrt(), 0.025, n_norm)))
    assert float(b) <= simple * (1 + 1e-9)
    assert float(b) >= float(clt_budget(normal_quantile(0.1, True), n_s, sigma, 0.05, d_hat))


def _budget_with_base(method, q, k, v, base_idx):
    """The method's budget when its base sample is ``base_idx`` (the whole residual, here)."""
    inputs = check_decode_inputs(q, k, v)
    b, hq = q.shape[:2]
    n = k.shape[2]
    empty = IndexSet(torch.zeros(b, hq, 0, dtype=torch.long), torch.zeros(b, hq, dtype=torch.long))
    m = base_idx.shape[-1]
    base = IndexSet(base_idx.expand(b, hq, m).contiguous(), torch.full((b, hq), m))
    n_s = torch.full((b, hq), m)
    return method.budget(inputs, empty, base, n_s, n_s), inputs, n


def test_denominator_budget_from_exact_statistics():
    """Base sample = the whole residual: the plug-in budget is the formula on the true population."""
    q, k, v = random_qkv(batch=1, heads=3, kv_heads=3, n=500, d=16, seed=1, peaked=2.0)
    m = kvsieve.method("vattention", epsilon=0.1, delta=0.1, bound="denominator")
    b, inputs, n = _budget_with_base(m, q, k, v, torch.arange(500)[None, None])
    e = torch.exp(inputs.scores(torch.float64))
    sigma = e.std(-1)  # unbiased, the estimator's convention
    expected = (1.644854 * 500 * sigma / (0.1 * e.sum(-1))) ** 2
    torch.testing.assert_close(b, expected, rtol=1e-5, atol=0)


def test_full_budget_from_exact_statistics():
    q, k, v = random_qkv(batch=1, heads=2, kv_heads=2, n=300, d=8, seed=2)
    m = kvsieve.method("vattention", epsilon=0.2, delta=0.1, bound="full", grid=9)
    b, inputs, n = _budget_with_base(m, q, k, v, torch.arange(300)[None, None])
    e = torch.exp(inputs.scores(torch.float64))  # [1, H, N]
    r = e[..., None] * v.double()
    tr = r.var(2).sum(-1)
    expected = full_budget(m.config, torch.full((1, 2), 300.0), e.std(-1), e.sum(-1), tr, r.sum(2).norm(dim=-1))
    torch.testing.assert_close(b, expected, rtol=1e-6, atol=0)


def test_budget_is_shift_invariant():
    """A constant added to every logit (through an extra feature) changes neither budget nor output."""
    q, k, v = random_qkv(batch=1, heads=2, kv_heads=2, n=800, d=16, seed=3, peaked=1.0)
    q2 = torch.cat([q, torch.full((1, 2, 1), 3.0, dtype=q.dtype)], -1)
    k2 = torch.cat([k, torch.ones(1, 2, 800, 1, dtype=k.dtype)], -1)
    m = kvsieve.method("vattention", epsilon=0.1, delta=0.1, sink=16, window=16, top_k=0.02, base_rate=0.05)
    out1, st1 = m.decode(q, k, v, seed=5, scale=0.25)
    out2, st2 = m.decode(q2, k2, v, seed=5, scale=0.25)
    torch.testing.assert_close(st1.budget_per_head, st2.budget_per_head)
    torch.testing.assert_close(out1, out2, atol=1e-10, rtol=1e-10)


def test_clt_coverage_of_the_denominator_with_true_statistics():
    """Spec §2 item 4: b = b_D(ε, δ) from the true σ and D ⇒ Pr(|D̂ − D| > εD) ≈ δ with replacement (the
    CLT's setting) and ≤ that without (finite-population factor). Binomial tolerance of 3 standard errors."""
    trials, n = 2000, 10000
    gen = torch.Generator().manual_seed(0)
    tol = 3 * math.sqrt(0.1 * 0.9 / trials)
    for dist in ("lognormal", "exponential"):
        e = torch.exp(torch.randn(n, generator=gen, dtype=torch.float64)) if dist == "lognormal" else \
            -torch.log(torch.rand(n, generator=gen, dtype=torch.float64))
        d_true, sigma = e.sum(), e.std(unbiased=False)
        eps, delta = 0.15, 0.1
        b = int(math.ceil(float(clt_budget(normal_quantile(delta, True), n, sigma, eps, d_true))))
        assert 50 < b < n // 20
        rates = {}
        for replacement in (True, False):
            smp = uniform_sample(torch.ones(trials, 1, n, dtype=torch.bool), torch.full((trials, 1), b), gen,
                                 replacement=replacement)
            est = (e[smp.indices] * smp.weights).sum(-1)[:, 0]
            rates[replacement] = float(((est - d_true).abs() > eps * d_true).double().mean())
        assert rates[True] <= delta + tol and rates[False] <= delta + tol
        # Not vacuous: the CLT budget is tight, the failure rate is near δ (skewed tails make it a bit higher
        # or lower; far below would mean the budget is wastefully large).
        assert rates[True] > delta / 2


def test_guarantee_holds_on_a_long_flat_tail():
    """Theorem 4.3 (bound=full) end to end where the CLT is in its element: many residual keys with
    comparable scores. The failure rate must stay ≤ δ within a binomial tolerance. Each batch row is one
    independent trial (the rows draw their own samples)."""
    trials, heads, n = 150, 4, 4000
    q, k, v = random_qkv(batch=1, heads=heads, kv_heads=heads, n=n, d=16, seed=4, peaked=0.5)
    v = v + 1.0  # outputs far from zero, so that relative error is meaningful
    q, k, v = q.expand(trials, -1, -1), k.expand(trials, -1, -1, -1), v.expand(trials, -1, -1, -1)
    exact = dense(q, k, v)
    eps, delta = 0.1, 0.2
    total = trials * heads
    rates, density = {}, {}
    for bound in ("full", "denominator"):
        m = kvsieve.method("vattention", epsilon=eps, delta=delta, bound=bound, sink=16, window=16, top_k=0.01,
                           base_rate=0.05)
        out, st = m.decode(q, k, v, seed=0)
        rates[bound] = float((rel_err(out, exact) > eps).double().mean())
        density[bound] = st.density
    assert rates["full"] <= delta + 3 * math.sqrt(delta * (1 - delta) / total), rates
    assert density["full"] < 0.9  # it did not just read everything
    # The truth about the relaxation: with flat scores the denominator needs few samples, but the output
    # error comes from the spread of the values, which bound=denominator does not see. It fails here.
    assert rates["denominator"] > delta and density["denominator"] < density["full"] / 3, (rates, density)


def test_exact_when_epsilon_demands_the_whole_residual():
    q, k, v = random_qkv(batch=2, heads=4, kv_heads=2, n=600, d=16, seed=5)
    out, st = kvsieve.method("vattention", epsilon=1e-6).decode(q, k, v, seed=0, lengths=torch.tensor([600, 333]))
    assert rel_err(out, dense(q, k, v, lengths=torch.tensor([600, 333]))).max() < 1e-12
    assert st.exact_rows == 2 and st.sampled_fraction == 1.0


def test_stats_report_the_budget_per_head_and_reads():
    q, k, v = random_qkv(batch=2, heads=6, kv_heads=2, n=3000, d=16, seed=6)
    m = kvsieve.method("vattention", epsilon=0.3, delta=0.3, sink=32, window=32, top_k=0.02, base_rate=0.02,
                       bound="denominator")
    _, st = m.decode(q, k, v, seed=1)
    b = st.budget_per_head
    assert b.shape == (2, 6)
    fixed = 64 + 60
    assert st.v_rows_read == pytest.approx(fixed + float(b.double().mean()))
    assert st.k_rows_scored == 3000  # the oracle predictor scores everything
    _, stq = kvsieve.method(m.spec + ",predictor=quest").decode(q, k, v, seed=1)
    assert stq.k_rows_scored < 3000  # quest scores the chosen rows and the base sample only
    _, stf = kvsieve.method(m.spec.replace("bound=denominator", "bound=full")).decode(q, k, v, seed=1)
    assert stf.v_rows_read > fixed + float(stf.budget_per_head.double().mean()) - 1e-9  # + base sample V rows


def test_gqa_shared_budget_is_the_group_max():
    q, k, v = random_qkv(batch=1, heads=6, kv_heads=2, n=2000, d=16, seed=7, peaked=1.0)
    m = kvsieve.method("vattention", epsilon=0.05, delta=0.2, sink=16, window=16, top_k=0.02, share_kv_group=True)
    _, st = m.decode(q, k, v, seed=0)
    assert st.budget_per_head.shape == (1, 2)
    assert st.density == pytest.approx(st.kv_density)
    # Replay the method's draws: the base sample is the row streams' subset draw. Each KV
    # head's budget must be the max of its query heads' budgets on that shared base sample.
    from kvsieve.core.rng import RandomKey, RowStreams
    from kvsieve.methods.shared.selection import available_after, sink_and_window, union

    inputs = check_decode_inputs(q, k, v)
    fixed = sink_and_window(inputs, 16, 16, 2)
    top = m.predicted_top(inputs, available_after(inputs, fixed), {})
    static = union(fixed, top)
    residual = available_after(inputs, static)
    n_s = residual.sum(-1)
    n_base = torch.clamp(torch.floor(0.025 * n_s.double()).long(), min=2)
    base = uniform_sample(residual, n_base, RowStreams(RandomKey(0), inputs.batch_row(), inputs.n_valid),
                          size_bound=max(2, int(0.025 * inputs.n_keys)))
    per_query = m.budget(inputs, static, base, n_s, n_base)  # [1, 6]
    expected = torch.ceil(per_query.view(1, 2, 3).amax(-1)).long().clamp(min=1)
    expected = torch.minimum(expected, n_s)
    torch.testing.assert_close(st.budget_per_head, expected.double())


def test_hub_flags_change_what_they_say():
    q, k, v = random_qkv(batch=1, heads=4, kv_heads=4, n=3000, d=16, seed=8)
    base = "vattention:epsilon=0.2,delta=0.2,sink=16,window=16,top_k=0.02,bound=denominator"
    _, two = kvsieve.method(base).decode(q, k, v, seed=3)
    _, one = kvsieve.method(base + ",quantile=one-sided").decode(q, k, v, seed=3)
    # Same base sample (same seed, same draws), smaller quantile: budget ratio (z1/z2)² before rounding.
    ratio = one.budget_raw / two.budget_raw
    assert ratio == pytest.approx((0.841621 / 1.281552) ** 2, rel=1e-3)
    _, hub = kvsieve.method(base + ",residual=includes-topk").decode(q, k, v, seed=3)
    assert hub.residual_keys == 3000 - 32
    loose = "vattention:epsilon=0.99,delta=0.99,sink=16,window=16,top_k=0.02,budget_floor=base"
    _, floor = kvsieve.method(loose).decode(q, k, v, seed=3)
    assert (floor.budget_per_head >= floor.base_sample - 1e-9).all()


def test_hoeffding_needs_more_samples_than_the_clt():
    q, k, v = random_qkv(batch=1, heads=4, kv_heads=4, n=3000, d=16, seed=9, peaked=1.0)
    spec = "vattention:epsilon=0.1,delta=0.1,sink=16,window=16,top_k=0.02,bound=denominator"
    _, clt = kvsieve.method(spec).decode(q, k, v, seed=0)
    _, hoeff = kvsieve.method(spec + ",concentration=hoeffding").decode(q, k, v, seed=0)
    assert (hoeff.budget_per_head >= clt.budget_per_head).all()
    assert hoeff.budget > clt.budget


def test_residual_sample_is_unbiased_inside_vattention():
    """E over seeds of the sampled part: with the fixed part removed (sink = window = top-k = 0) the
    estimator's denominator exp(lse) is unbiased for Σ e^s, checked through the kernel contract."""
    from kvsieve.kernels.shared.weighted import weighted_sparse_decode_reference
    from kvsieve.methods.shared.selection import available_after, sink_and_window

    trials, n = 1500, 600
    q, k, v = random_qkv(batch=1, heads=2, kv_heads=2, n=n, d=8, seed=10, peaked=1.0)
    m = kvsieve.method("vattention", sink=0, window=0, top_k=0, epsilon=0.5, delta=0.5)
    qt, kt, vt = q.expand(trials, -1, -1), k.expand(trials, -1, -1, -1), v.expand(trials, -1, -1, -1)
    inputs = check_decode_inputs(qt, kt, vt)
    residual = available_after(inputs, sink_and_window(inputs, 0, 0, 2))
    gen = torch.Generator().manual_seed(0)
    b = torch.full((trials, 2), 40)
    smp = m.sample_residual(residual, b, residual.sum(-1), gen)
    out, lse = weighted_sparse_decode_reference(qt, kt, vt, smp.indices, smp.counts, smp.weights)
    est = torch.exp(lse)
    true = torch.exp(inputs.scores(torch.float64)[0]).sum(-1)
    se = est.std(0) / math.sqrt(trials)
    assert ((est.mean(0) - true).abs() < 4 * se).all()


def test_lemma_4_2_deterministic_form():
    """‖N̂−N‖ ≤ ε₁‖N‖ and |D̂−D| ≤ ε₂D with ε₂ < 0.5 ⇒ ‖N̂/D̂ − N/D‖ ≤ 2(ε₁+ε₂)‖N/D‖."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        n = torch.randn(8, generator=gen, dtype=torch.float64)
        d = float(torch.rand(1, generator=gen)) + 0.1
        e1, e2 = float(torch.rand(1, generator=gen)), float(torch.rand(1, generator=gen)) * 0.5
        u = torch.randn(8, generator=gen, dtype=torch.float64)
        n_hat = n + u / u.norm() * e1 * n.norm() * float(torch.rand(1, generator=gen))
        d_hat = d * (1 + e2 * (2 * float(torch.rand(1, generator=gen)) - 1))
        lhs = (n_hat / d_hat - n / d).norm()
        assert lhs <= (e1 + e2) / (1 - e2) * (n / d).norm() + 1e-12
        assert lhs <= 2 * (e1 + e2) * (n / d).norm() + 1e-12


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": 1.0}, "epsilon"),
        ({"epsilon": -0.1}, "epsilon"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.5}, "delta"),
        ({"base_rate": 0.0}, "base_rate"),
        ({"top_k": 2.0}, "top_k"),
        ({"bound": "numerator"}, "bound"),
        ({"concentration": "hoeffding", "bound": "full"}, "hoeffding"),
        ({"predictor": "hat"}, "predictor"),
        ({"grid": 0}, "grid"),
        ({"rounding": "nearest"}, "rounding: expected one of up, down"),
        ({"duplicates": "drop", "replacement": True}, "duplicates: expected one of keep, collapse"),
    ],
)
def test_bad_parameters_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvsieve.method("vattention", **kwargs)


def test_spec_string_round_trip():
    m = kvsieve.method("vattention:epsilon=0.1,delta=0.2,bound=full,top_k=64,predictor=quest")
    assert m.config.top_k == 64 and isinstance(m.config.top_k, int)
    assert kvsieve.method(m.spec).config == m.config
    assert kvsieve.method("vattention:top_k=0.05").config.top_k == 0.05


@pytest.mark.parametrize("hub_rules", [False, True])
def test_hub_budget_rounding_and_duplicates(hub_rules):
    """sparse-attention-hub's AdaptiveSamplingMasker truncates the budget (``.long()``) and builds its base
    mask by ``scatter_`` into a dense mask, so D̂ holds a key drawn twice once, while σ̂ (``torch.std``)
    uses every draw. Replaying the method's base sample with the other hub flags on: with
    ``rounding=down,duplicates=collapse`` the budget is the hub's formula re-stated on the same sample,
    exactly; by default ours is the ceiling of the formula over every draw, which differs from the hub's
    by the rounding (rows without duplicates: one key more) and by D̂ (rows with duplicates: the hub's
    D̂ is lower, its budget larger)."""
    from kvsieve.core.rng import RandomKey, RowStreams
    from kvsieve.methods.shared.selection import available_after, sink_and_window, union

    q, k, v = random_qkv(batch=1, heads=8, kv_heads=8, n=400, d=16, seed=13, peaked=1.0)
    flags = ",rounding=down,duplicates=collapse" if hub_rules else ""
    m = kvsieve.method("vattention:epsilon=0.05,delta=0.2,sink=16,window=16,top_k=8,base_rate=0.2,bound=denominator,"
                       "quantile=one-sided,replacement=true,residual=includes-topk,budget_floor=base" + flags)
    _, st = m.decode(q, k, v, seed=0)
    inputs = check_decode_inputs(q, k, v)
    fixed = sink_and_window(inputs, 16, 16, 8)
    residual = available_after(inputs, fixed)  # includes-topk: all but sink and window (the hub's range)
    static = union(fixed, m.predicted_top(inputs, residual, {}))
    n_s = residual.sum(-1)
    n_base = torch.clamp(torch.floor(0.2 * n_s.double()).long(), min=2)
    base = uniform_sample(residual, n_base, RowStreams(RandomKey(0), inputs.batch_row(), inputs.n_valid),
                          replacement=True, size_bound=max(2, int(0.2 * inputs.n_keys)))
    raw = m.budget(inputs, static, base, n_s, n_base)
    rounded = torch.floor(raw) if hub_rules else torch.ceil(raw)
    torch.testing.assert_close(st.budget_per_head, torch.minimum(torch.maximum(rounded.long(), n_base), n_s).double())

    # the hub (adaptive_sampling.py): D̂ = static sum + (range/|base|)·Σ over distinct base keys,
    # σ̂ = torch.std over all draws, b = clamp((z σ̂ range / (ε D̂))², 1, range).long(), then [|base|, range]
    s = inputs.scores(torch.float64)  # [1, 8, N]
    e = torch.exp(s - s.amax(-1, keepdim=True))
    z = float(normal_quantile(0.2, False))
    dups = 0
    for h in range(8):
        draws = base.indices[0, h, : int(base.counts[0, h])]
        distinct = torch.unique(draws)
        static_idx = static.indices[0, h, : int(static.counts[0, h])]
        sigma, n_sh = e[0, h, draws].std(), float(n_s[0, h])
        d_all, d_hub = (e[0, h, static_idx].sum() + n_sh / len(draws) * e[0, h, keys].sum()
                        for keys in (draws, distinct))
        raw_all, raw_hub = ((z * sigma * n_sh / (0.05 * d)) ** 2 for d in (d_all, d_hub))
        hub = int(torch.clamp(torch.clamp(raw_hub, min=1.0, max=n_sh).long(), min=int(n_base[0, h]), max=int(n_sh)))
        got = int(st.budget_per_head[0, h])
        if hub_rules:
            torch.testing.assert_close(raw_hub, raw[0, h], rtol=1e-9, atol=0)
            assert got == hub, h
            continue
        torch.testing.assert_close(raw_all, raw[0, h], rtol=1e-9, atol=0)  # only de-duplication and rounding differ
        if float(raw[0, h]) >= n_sh:
            continue
        dups += len(distinct) < len(draws)
        if len(distinct) == len(draws):  # truncated where we round up
            assert hub == got - (float(raw[0, h]) % 1 > 0), h
        else:  # D̂ lower: a larger budget
            assert raw_hub > raw[0, h] and hub > got, h
    assert hub_rules or dups >= 4  # most rows below the cap have duplicates in their base sample


def test_collapsed_sample_holds_each_drawn_key_once():
    """``duplicates=collapse``: the residual sample is the same draws as ``keep`` with each key once, at the
    draws' weight n_s/b (the hub's dense mask), and b = n_s is not the whole residual; ``keep`` holds every
    draw. Without replacement it is a clear error."""
    from kvsieve.methods.shared.selection import available_after, sink_and_window

    q, k, v = random_qkv(batch=1, heads=4, kv_heads=4, n=200, d=8, seed=14)
    keep = kvsieve.method("vattention", sink=4, window=4, replacement=True)
    collapse = kvsieve.method("vattention", sink=4, window=4, replacement=True, duplicates="collapse")
    inputs = check_decode_inputs(q, k, v)
    residual = available_after(inputs, sink_and_window(inputs, 4, 4, 4))
    n_s = residual.sum(-1)
    repeats = 0
    for b in (torch.tensor([[60, 120, 90, 30]]), torch.full((1, 4), 192)):  # n_s = 192
        kept = keep.sample_residual(residual, b, n_s, torch.Generator().manual_seed(0))
        one = collapse.sample_residual(residual, b, n_s, torch.Generator().manual_seed(0))
        for h in range(4):
            draws = one.indices[0, h, : int(one.counts[0, h])]
            assert len(torch.unique(draws)) == len(draws)
            torch.testing.assert_close(one.weights[0, h, : len(draws)],
                                       torch.full((len(draws),), 192 / float(b[0, h]), dtype=torch.float64))
            every = kept.indices[0, h, : int(kept.counts[0, h])]
            if int(b[0, h]) < 192:  # keep holds the same draws with their repeats
                assert len(every) == int(b[0, h]) and set(every.tolist()) == set(draws.tolist())
                repeats += len(every) - len(draws)
            else:  # b = n_s: keep takes the whole residual, collapse its distinct draws
                assert len(every) == 192 and len(draws) < 192
    assert repeats > 0
    with pytest.raises(ValueError, match="duplicates: 'collapse' needs replacement=true"):
        kvsieve.method("vattention", duplicates="collapse")
