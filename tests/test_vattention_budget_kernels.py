"""vAttention's budget kernels (``kernels/vattention/budget_triton.py``) against direct sums and the method's
torch formulas, under Triton's interpreter in a subprocess: the budget statistics split over programs and
merged, and the budget rule with the residual setup folded into the combine launch."""

import pytest
from interpreted import run_script

BUDGET_INPUTS = """
import torch


def budget_inputs(g, r, hq, hkv, hs, n, d, dtype, kt, kb):
    \"\"\"Random inputs of the budget statistics: q, k, v, each row's length and [start, end), a top-k list
    and a base list of ``kt`` / ``kb`` entries per selection head with ragged counts.\"\"\"
    q = (torch.randn(r, hq, d, generator=g) * 2).to(dtype)
    k = torch.randn(r, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(r, hkv, n, d, generator=g).to(dtype)
    length = torch.tensor([n, n - 37][:r])
    start = torch.clamp(length, max=5)
    end = torch.maximum(length - 7, start)
    top = torch.randint(5, n - 40, (r, hs, kt), generator=g)
    tc = torch.randint(0, kt + 1, (r, hs), generator=g)
    base = torch.randint(5, n - 40, (r, hs, kb), generator=g)
    bc = torch.randint(0, kb + 1, (r, hs), generator=g)
    return q, k, v, length, start, end, top, tc, base, bc
"""


BUDGET = BUDGET_INPUTS + """
# vAttention's budget statistics (split launch + combine) against a direct float64 reference, for every
# number of splits: GQA 1/4/2 with per-query-head or per-KV-head lists, ragged counts, fp32 and bf16
import torch
from kvsieve.kernels.vattention.budget_triton import budget_stats_reference, budget_stats_triton

def ref_stats(q, k, v, start, end, length, top, tc, base, bc, n_s, scale, full, logits=None):
    r, hq, d = q.shape
    hkv = k.shape[1]; hs = top.shape[1]
    out = torch.zeros(r, hq, 5, dtype=torch.float64)
    for a in range(r):
        for h in range(hq):
            kv, sh = h // (hq // hkv), h // (hq // hs)
            fpos = torch.cat([torch.arange(int(start[a])), torch.arange(int(end[a]), int(length[a])),
                              top[a, sh, :int(tc[a, sh])]])
            bpos = base[a, sh, :int(bc[a, sh])]
            qq = q[a, h].double()
            sf = (k[a, kv, fpos].double() @ qq) * scale
            sb = (k[a, kv, bpos].double() @ qq) * scale
            if logits is not None:  # the lists' logits given, sink and window from K
                n_range = len(fpos) - int(tc[a, sh])
                sf[n_range:] = logits[a, h, fpos[n_range:]].double()
                sb = logits[a, h, bpos].double()
            m = torch.cat([sf, sb]).max() if len(sf) + len(sb) else torch.tensor(0.0, dtype=torch.float64)
            ef, eb = torch.exp(sf - m), torch.exp(sb - m)
            nb = len(bpos); ns = float(n_s[a, sh])
            ratio = ns / max(nb, 1)
            mean = eb.sum() / max(nb, 1)
            out[a, h, 0] = ef.sum() + ratio * eb.sum()
            out[a, h, 1] = (((eb - mean) ** 2).sum() / (max(nb, 2) - 1)).sqrt()
            out[a, h, 4] = (eb.max() - eb.min()) if nb else 0.0
            if full:
                rb = eb[:, None] * v[a, kv, bpos].double()
                nh = (ef[:, None] * v[a, kv, fpos].double()).sum(0) + ratio * rb.sum(0)
                mr = rb.sum(0) / max(nb, 1)
                out[a, h, 2] = nh.norm()
                out[a, h, 3] = ((rb - mr) ** 2).sum() / (max(nb, 2) - 1)
    return out

g = torch.Generator().manual_seed(1)
worst = 0.0
# each shape in both dtypes and with both bounds, not their product (the interpreter runs every program in
# turn): 1 split (no merge), 2, 13 (more splits than sink or window keys: empty parts) and, once, 64
f32, bf16, few = torch.float32, torch.bfloat16, (1, 2, 13)
for (r, hq, hkv, hs_kind, n, d), dtype, full, split_counts in [
        ((2, 4, 1, "q", 300, 64), f32, False, few), ((2, 4, 1, "q", 300, 64), bf16, True, few),
        ((1, 8, 2, "kv", 157, 128), bf16, False, few), ((1, 8, 2, "kv", 157, 128), f32, True, few),
        ((2, 4, 4, "q", 90, 32), f32, True, (1, 13, 64)), ((2, 4, 4, "q", 90, 32), bf16, False, few)]:
    hs = hq if hs_kind == "q" else hkv
    kt, kb = 40, 23
    q, k, v, length, start, end, top, tc, base, bc = budget_inputs(g, r, hq, hkv, hs, n, d, dtype, kt, kb)
    tc[0, 0] = kt
    bc[0, 0] = kb
    bc[-1, -1] = 1
    n_s = torch.randint(50, 200, (r, hs), generator=g)
    want = ref_stats(q, k, v, start, end, length, top, tc, base, bc, n_s, d ** -0.5, full)
    if not full:
        want[..., 2:4] = 0
    twin = budget_stats_reference(q, k, v, start, end, length, top, tc, base, bc, n_s, d ** -0.5, full, 12)
    torch.testing.assert_close(twin, want, rtol=1e-13, atol=1e-300)
    for splits in split_counts:
        got = budget_stats_triton(q, k, v, start, end, length, top, tc, base, bc, n_s, d ** -0.5, full, 12,
                                  splits=splits)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-300)
        worst = max(worst, float(((got - want).abs() / want.abs().clamp(min=1e-300)).max()))
    # the lists' logits from kept float32 scores (random, not K's: a kernel that ignored them fails)
    logits = torch.randn(r, hq, n, generator=g) * 3
    want = ref_stats(q, k, v, start, end, length, top, tc, base, bc, n_s, d ** -0.5, full, logits)
    if not full:
        want[..., 2:4] = 0
    twin = budget_stats_reference(q, k, v, start, end, length, top, tc, base, bc, n_s, d ** -0.5, full, 12, logits)
    torch.testing.assert_close(twin, want, rtol=1e-13, atol=1e-300)
    # launch settings too (blocks of 8 and 64 entries, other warps): the same statistics
    for splits, block, warps in ((2, None, None), (13, None, None), (5, 8, 2), (3, 64, 8), (1, 8, None)):
        got = budget_stats_triton(q, k, v, start, end, length, top, tc, base, bc, n_s, d ** -0.5, full, 12,
                                  splits=splits, logits=logits, block=block, num_warps=warps)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-300)
print("WORST", worst)
print("OK")
"""


@pytest.mark.triton
def test_budget_statistics_split_over_programs_equal_a_direct_float64_sum():
    """The statistics launch cut into 1-64 splits per (row, query head) and merged (shift to the row's
    max, Chan's merge of the spreads), at several blocks and warps, equals a direct float64 two-pass
    computation to 1e-13 relative."""
    pytest.importorskip("triton")
    assert "OK" in run_script(BUDGET, "cpu", True)


BUDGET_RULE = BUDGET_INPUTS + """
# The budget folded into the statistics' combine launch (every rule, per query or per KV head, both floors)
# equals the torch formulas of methods/vattention on the kernel's own statistics; the residual setup
# launch writes the top-k list, the marks and the sizes the reference computes
import torch
from kvsieve.kernels.vattention.budget_triton import (BudgetRule, budget_triton, residual_setup_reference,
                                                  residual_setup_triton)
from kvsieve.methods.vattention import (VAttentionConfig, budget_constants, clt_budget, full_budget,
                                        hoeffding_budget, normal_quantile)

g = torch.Generator().manual_seed(2)
for (r, hq, hkv, hs, n, d, dtype) in [(2, 8, 2, 8, 300, 64, torch.float32), (1, 8, 2, 2, 200, 128, torch.bfloat16),
                                      (2, 4, 4, 4, 120, 32, torch.bfloat16)]:
    q, k, v, length, start, end, top, tc, base, bc = budget_inputs(g, r, hq, hkv, hs, n, d, dtype, 30, 20)
    bc[0, 0] = 1  # one key: no spread (σ̂ = 0)
    n_s = torch.randint(0, 200, (r, hs), generator=g)
    n_s[-1, -1] = 0
    for cfg in (VAttentionConfig(bound="denominator", epsilon=0.1, delta=0.05),
                VAttentionConfig(epsilon=0.05, delta=0.05, grid=19), VAttentionConfig(epsilon=0.2, delta=0.1, grid=4,
                                                                                      quantile="one-sided"),
                VAttentionConfig(bound="denominator", concentration="hoeffding", epsilon=0.3, delta=0.3,
                                 budget_floor="base")):
        full = cfg.bound == "full"
        rule = BudgetRule(3 if cfg.concentration == "hoeffding" else 1 if not full else 2,
                          budget_constants(cfg, q.device), cfg.grid, cfg.budget_floor == "base", n)
        res = budget_triton(q, k, v, start, end, length, top, tc, base, bc, n_s, d ** -0.5, full, 12, rule=rule)
        d_hat, sigma, n_norm, tr, rng = res.stats.unbind(-1)
        nq = n_s.repeat_interleave(hq // hs, dim=1).double()
        if cfg.concentration == "hoeffding":
            b = hoeffding_budget(cfg.delta, nq, rng, cfg.epsilon, d_hat)
        elif not full:
            b = clt_budget(normal_quantile(cfg.delta, cfg.quantile == "two-sided"), nq, sigma, cfg.epsilon, d_hat)
        else:
            b = full_budget(cfg, nq, sigma, d_hat, tr, n_norm)
        b = torch.nan_to_num(b, nan=0.0, posinf=float("inf")).view(r, hs, hq // hs).amax(-1)
        floor = bc if cfg.budget_floor == "base" else torch.ones_like(n_s)
        b_int = torch.minimum(torch.maximum(torch.ceil(torch.clamp(b, max=float(n))).long(), floor), n_s)
        assert torch.equal(res.raw, b), (cfg, res.raw, b)  # the same float64 operations in the same order
        assert torch.equal(res.size, b_int) and torch.equal(res.counts, tc + b_int), cfg
        assert int(b_int[-1, -1]) == 0  # an empty residual takes no sample

# the residual setup: pages (or keys, page 1) listed in [start, end), marked; sizes as the reference's
for r, hs, n, page, k_pages in [(2, 3, 300, 16, 4), (2, 2, 157, 1, 9), (1, 4, 64, 8, 3)]:
    lens = torch.tensor([n, n // 2][:r], dtype=torch.int32)
    p_total = -(-n // page)
    pages = torch.stack([torch.stack([torch.randperm(p_total, generator=g)[:k_pages] for _ in range(hs)])
                         for _ in range(r)])
    pc = torch.randint(0, k_pages + 1, (r, hs), generator=g)
    for sink, window, rate in [(4, 8, 0.025), (0, 0, 0.1), (200, 200, 0.3)]:
        idx = torch.full((r, hs, k_pages * page + n), -1, dtype=torch.int64)
        w = torch.zeros(r, hs, k_pages * page + n, dtype=torch.float64)
        st = residual_setup_triton(lens, sink, window, rate, hs, pages, pc, page, p_total, idx, w)
        want_tc = torch.zeros(r, hs, dtype=torch.int64)
        for a in range(r):
            lo, hi = min(sink, int(lens[a])), max(int(lens[a]) - window, min(sink, int(lens[a])))
            for h in range(hs):
                chosen = pages[a, h, :int(pc[a, h])]
                keys = [int(p) * page + j for p in chosen for j in range(page) if lo <= int(p) * page + j < hi]
                want_tc[a, h] = len(keys)
                assert idx[a, h, :len(keys)].tolist() == keys and bool((w[a, h, :len(keys)] == 1).all())
                mark = torch.zeros(p_total, dtype=torch.bool)
                mark[chosen] = True
                assert torch.equal(st.excluded[a, h], mark)
        s0, e0, ns, nb = residual_setup_reference(lens, sink, window, rate, want_tc)
        assert torch.equal(st.top_counts, want_tc) and torch.equal(st.start, s0) and torch.equal(st.end, e0)
        assert torch.equal(st.n_s, ns) and torch.equal(st.n_base, nb), (sink, window, rate)
    none = residual_setup_triton(lens, 4, 8, 0.025, hs)  # no top-k
    s0, e0, ns, nb = residual_setup_reference(lens, 4, 8, 0.025, torch.zeros(r, hs, dtype=torch.int64))
    assert none.excluded is None and bool((none.top_counts == 0).all()) and torch.equal(none.n_s, ns)
    assert torch.equal(none.n_base, nb)
print("OK")
"""


@pytest.mark.triton
def test_budget_rule_and_residual_setup_equal_the_torch_formulas():
    """vAttention's budget in the combine launch (CLT denominator, Theorem 4.3's grid, Hoeffding; group
    max, rounding, both floors) equals the method's torch formulas bit for bit on the same statistics,
    and the residual setup launch writes the top-k list, marks and sizes of the reference."""
    pytest.importorskip("triton")
    assert "OK" in run_script(BUDGET_RULE, "cpu", True)
