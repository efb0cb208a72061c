"""Statistical claims of the SANTA family (spec §4, §8.1-8.4, §8.7), tested against standard errors.

Every test draws R independent estimates in one call: the batch holds R copies of the same row,
and each batch row draws its own uniforms. Tolerances come from the measured spread of those R
draws (z-scores with a Bonferroni bound over the coordinates tested), never from a loose constant.
"""

from __future__ import annotations

from statistics import NormalDist

import pytest
import torch

import kvsieve

R = 20000  # draws per estimate (spec §8.1: R >= 2e4)
FAMILY_ALPHA = 1e-4  # chance that a correct method fails one test (Bonferroni over its coordinates)


def z_bound(n_tests: int, alpha: float = FAMILY_ALPHA) -> float:
    """Two-sided normal quantile with a Bonferroni correction over ``n_tests`` statistics."""
    return NormalDist().inv_cdf(1.0 - alpha / (2 * n_tests))


def make_instance(seed=0, heads=2, kv_heads=1, n=40, d=8, dv=6, peaked=2.0):
    """A float64 instance with moderately peaked attention (a few dominant keys, long tail)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, d, generator=g, dtype=torch.float64) * peaked
    k = torch.randn(1, kv_heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, kv_heads, n, dv, generator=g, dtype=torch.float64)
    return q, k, v


def exact_probs(q, k):
    """softmax(q·k/√d) ``[Hq, N]`` for batch row 0, computed without the library."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k[0].repeat_interleave(hq // hkv, dim=0)  # [Hq, N, d]
    s = torch.einsum("hd,hnd->hn", q[0], kk) / q.shape[-1] ** 0.5
    return torch.softmax(s, dim=-1)


def values_per_head(q, v):
    return v[0].repeat_interleave(q.shape[1] // v.shape[1], dim=0)  # [Hq, N, dv]


def exact_output(q, k, v):
    return torch.einsum("hn,hnd->hd", exact_probs(q, k), values_per_head(q, v))


def draws(spec, q, k, v, r=R, seed=1234, **kw):
    """R independent estimates ``[R, Hq, dv]`` from one call (R identical batch rows)."""
    m = kvsieve.method(spec, **kw)
    rep = lambda t: t.expand(r, *t.shape[1:])  # noqa: E731
    out, stats = m.decode(rep(q), rep(k), rep(v), seed=seed)
    return out, stats


def z_scores(samples, target):
    """Per-coordinate z of the sample mean against ``target``; a zero spread needs an exact match."""
    mean = samples.mean(0)
    se = samples.std(0, correction=1) / samples.shape[0] ** 0.5
    diff = mean - target
    exact = se == 0
    z = torch.where(exact, torch.where(diff == 0, 0.0, torch.inf), diff / torch.where(exact, 1.0, se))
    return z


def tiled_target(q, k, v, budget, tile):
    """Largest-remainder prop expectation ``Σ_t (S_t/S) μ_t`` (spec §8.7), computed independently.

    Returns the target ``[Hq, dv]``, the tile budgets ``[Hq, T]`` and the tile masses ``[Hq, T]``.
    """
    p = exact_probs(q, k)
    vv = values_per_head(q, v)
    hq, n = p.shape
    t = -(-n // tile)
    targets, budgets, masses = [], [], []
    for h in range(hq):
        mass = torch.stack([p[h, i * tile:(i + 1) * tile].sum() for i in range(t)])
        share = budget * mass / mass.sum()
        base = share.floor()
        frac = (share - base).tolist()
        rem = budget - int(base.sum())
        # The rem tiles with the largest fractional part get +1 (ties: lower index first).
        winners = sorted(range(t), key=lambda i: (-frac[i], i))[:rem]
        s_t = base.clone()
        s_t[winners] += 1
        out = torch.zeros(vv.shape[-1], dtype=torch.float64)
        for i in range(t):
            if s_t[i] > 0:
                sl = slice(i * tile, (i + 1) * tile)
                mu_t = (p[h, sl, None] * vv[h, sl]).sum(0) / mass[i]
                out += s_t[i] / budget * mu_t
        targets.append(out)
        budgets.append(s_t)
        masses.append(mass)
    return torch.stack(targets), torch.stack(budgets), torch.stack(masses)


# --- unbiasedness (spec §4.1, §8.1, §8.8) -----------------------------------------------------

UNBIASED = [
    ("santa", {"budget": 8}),
    ("santa-strat", {"budget": 8}),
    ("santa-sys", {"budget": 8}),
    ("santa-flash", {"budget": 16, "tile_size": 8}),  # T = 5 tiles, S_tile = 3
    ("santa-flash", {"budget": 3, "tile_size": 8}),  # S_tile = max(1, 3 // 5) = 1
    ("santa-prop", {"budget": 8, "tile_size": 8, "rounding": "systematic"}),
]


def test_instance_is_moderately_peaked():
    p = exact_probs(*make_instance()[:2])
    effective_keys = 1.0 / (p**2).sum(-1)
    assert ((effective_keys > 2) & (effective_keys < 20)).all(), effective_keys
    assert (p.max(-1).values < 0.7).all()


@pytest.mark.parametrize(("name", "kw"), UNBIASED, ids=[f"{n}-{kw['budget']}" for n, kw in UNBIASED])
@pytest.mark.parametrize("instance_seed", [0, 1])
def test_unbiased(name, kw, instance_seed):
    q, k, v = make_instance(seed=instance_seed)
    out, stats = draws(name, q, k, v, seed=100 + instance_seed, **kw)
    assert stats.exact_rows == 0  # every draw sampled: budget < N
    z = z_scores(out, exact_output(q, k, v))
    assert z.abs().max() < z_bound(z.numel()), z


def test_unbiasedness_check_has_power():
    """The same check rejects a target that is off by a third of the spread of one draw."""
    q, k, v = make_instance()
    out, _ = draws("santa-sys", q, k, v, budget=8)
    sd = out.std(0, correction=1)
    z = z_scores(out, exact_output(q, k, v) + sd / 3)
    assert z.abs().max() > z_bound(z.numel())


def _prop_bias_instance():
    """Four tiles of 8 keys; the last holds ~4% of the mass (< 1/S = 1/8) and values shifted by +3."""
    q, k, v = make_instance(seed=3, heads=1, kv_heads=1, n=32)
    qhat = q[0, 0] / q[0, 0].norm()
    k = k.clone()
    v = v.clone()
    k[0, 0, 24:] -= 1.5 * qhat  # lowers the last tile's scores
    v[0, 0, 24:] += 3.0
    return q, k, v


def test_prop_largest_remainder_has_the_spec_expectation_and_is_biased():
    q, k, v = _prop_bias_instance()
    budget, tile = 8, 8
    target, tile_budgets, masses = tiled_target(q, k, v, budget, tile)
    # The instance is the spec's case: a tile of positive mass below 1/S gets no sample at all.
    assert tile_budgets[0, 3] == 0 and 0 < masses[0, 3] < 1 / budget
    out, stats = draws("santa-prop", q, k, v, budget=budget, tile_size=tile)
    assert stats.samples == budget
    z_lr = z_scores(out, target)
    assert z_lr.abs().max() < z_bound(z_lr.numel()), z_lr
    # ...and that expectation is not the attention output: the bias is many standard errors.
    z_mu = z_scores(out, exact_output(q, k, v))
    assert z_mu.abs().max() > 10, z_mu
    # The bias bound of spec §8.7: ||E O − μ|| <= Σ_t |S_t/S − W_t/Z| ||μ_t||.
    p, vv = exact_probs(q, k)[0], values_per_head(q, v)[0]
    mu_t = torch.stack([(p[i * tile:(i + 1) * tile, None] * vv[i * tile:(i + 1) * tile]).sum(0) / masses[0, i]
                        for i in range(4)])
    bound = ((tile_budgets[0] / budget - masses[0]).abs() * mu_t.norm(dim=-1)).sum()
    assert (target - exact_output(q, k, v)).norm() <= bound + 1e-12


def test_prop_systematic_rounding_removes_that_bias():
    q, k, v = _prop_bias_instance()
    out, stats = draws("santa-prop", q, k, v, budget=8, tile_size=8, rounding="systematic")
    assert stats.samples == 8
    z = z_scores(out, exact_output(q, k, v))
    assert z.abs().max() < z_bound(z.numel()), z


# --- variance (spec §4.2-4.4, §8.2-8.4) -------------------------------------------------------


def value_covariance(p, vv):
    """``Σ = Σ_j p_j (V_j − μ)(V_j − μ)ᵀ`` per head: ``[Hq, dv, dv]``."""
    mu = torch.einsum("hn,hnd->hd", p, vv)
    c = vv - mu[:, None]
    return torch.einsum("hn,hnd,hne->hde", p, c, c)


def strat_covariance(p, vv, budget):
    """``(1/S²) Σ_m Σ^(m)``: key j has weight ``S·|[F(j−1), F(j)) ∩ [m/S, (m+1)/S)|`` in stratum m."""
    cdf = torch.cumsum(p, -1)
    cdf = cdf / cdf[:, -1:]
    lo = torch.nn.functional.pad(cdf[:, :-1], (1, 0))
    out = torch.zeros(p.shape[0], vv.shape[-1], vv.shape[-1], dtype=torch.float64)
    for m in range(budget):
        a, b = m / budget, (m + 1) / budget
        w = budget * (torch.minimum(cdf, torch.tensor(b)) - torch.maximum(lo, torch.tensor(a))).clamp(min=0)
        assert torch.allclose(w.sum(-1), torch.ones(p.shape[0], dtype=torch.float64))
        out += value_covariance(w, vv)
    return out / budget**2


def mse_with_se(out, target):
    """Mean of ``||ô − μ||²`` per head and its standard error."""
    sq = ((out - target) ** 2).sum(-1)  # [R, Hq]
    return sq.mean(0), sq.std(0, correction=1) / sq.shape[0] ** 0.5


@pytest.mark.parametrize("budget", [4, 8, 16])
def test_iid_and_strat_variance_closed_forms(budget):
    q, k, v = make_instance(seed=2)
    p, vv = exact_probs(q, k), values_per_head(q, v)
    mu = exact_output(q, k, v)
    cov_iid = value_covariance(p, vv) / budget
    cov_strat = strat_covariance(p, vv, budget)
    iid_closed = torch.diagonal(cov_iid, dim1=-2, dim2=-1).sum(-1)
    strat_closed = torch.diagonal(cov_strat, dim1=-2, dim2=-1).sum(-1)
    # Thm A.6: Cov_strat ≼ Σ/S in the Loewner order, hence tr and MSE too.
    assert torch.linalg.eigvalsh(cov_iid - cov_strat).min() > -1e-12
    assert (strat_closed < iid_closed).all()

    bound = z_bound(4)  # two heads, two methods
    iid_mse, iid_se = mse_with_se(draws("santa", q, k, v, budget=budget, seed=7)[0], mu)
    strat_mse, strat_se = mse_with_se(draws("santa-strat", q, k, v, budget=budget, seed=8)[0], mu)
    assert ((iid_mse - iid_closed).abs() / iid_se).max() < bound, (iid_mse, iid_closed)
    assert ((strat_mse - strat_closed).abs() / strat_se).max() < bound, (strat_mse, strat_closed)
    # The measured ordering is significant, not within noise.
    gap_z = (iid_mse - strat_mse) / (iid_se**2 + strat_se**2).sqrt()
    assert (gap_z > bound).all(), gap_z


def test_closed_form_variance_check_has_power():
    """Reporting the iid variance for budget S+1 instead of S is caught."""
    q, k, v = make_instance(seed=2)
    p, vv = exact_probs(q, k), values_per_head(q, v)
    wrong = torch.diagonal(value_covariance(p, vv), dim1=-2, dim2=-1).sum(-1) / 9
    mse, se = mse_with_se(draws("santa", q, k, v, budget=8, seed=7)[0], exact_output(q, k, v))
    assert ((mse - wrong).abs() / se).max() > z_bound(4)


def test_systematic_has_no_variance_guarantee():
    """Spec §8.4: n = 2S equiprobable keys, V alternating +1/−1: iid = strat = 1/S, sys = 1."""
    budget = 8
    n = 2 * budget
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 4, generator=g, dtype=torch.float64).expand(1, 1, n, 4)  # equal scores
    v = torch.tensor([1.0, -1.0] * budget, dtype=torch.float64).view(1, 1, n, 1)
    assert torch.equal(exact_probs(q, k), torch.full((1, n), 1 / n, dtype=torch.float64))
    bound = z_bound(3)
    for name in ("santa", "santa-strat"):
        mse, se = mse_with_se(draws(name, q, k, v, budget=budget)[0], torch.zeros(1, 1, dtype=torch.float64))
        assert abs(float(mse) - 1 / budget) / float(se) < bound, (name, mse)
    out, _ = draws("santa-sys", q, k, v, budget=budget)
    # Every systematic draw lands all S thresholds on the same parity: the estimate is ±1 exactly.
    assert torch.equal(out.abs(), torch.ones_like(out))
    plus = (out > 0).double().mean()
    assert abs(float(plus) - 0.5) / (0.25 / R) ** 0.5 < bound  # still unbiased


def test_strat_and_sys_read_more_unique_keys_than_iid():
    """Spec §8.12: unique keys <= S, and typically more of them for strat/sys than for iid."""
    budget = 16
    q, k, v = make_instance(seed=4)
    rows = {}
    for name in ("santa", "santa-strat", "santa-sys"):
        _, stats = draws(name, q, k, v, budget=budget)
        rows[name] = stats.v_rows_read
        assert 1 <= stats.v_rows_read <= budget
    # A per-row count in [1, S] has variance <= S²/4: a conservative standard error of the mean.
    se = budget / 2 / R**0.5
    for name in ("santa-strat", "santa-sys"):
        assert (rows[name] - rows["santa"]) / (2**0.5 * se) > z_bound(2), rows
