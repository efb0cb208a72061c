"""Sketch&Walk's prefill selection kernels (``kernels/sketchwalk/prefill_select.py``) against the method's torch
path, on the CPU through Triton's interpreter. Not collected on its own: ``tests/test_sketchwalk_pselect.py``
runs this file in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen when triton is imported).

Random data (q scaled up so that the block scores are far from uniform). Blocks and counts must be equal; the
sketch state equal to float32 rounding; ``Ã`` and the walk entry by entry to a relative tolerance (their
entries span tens of decades, an absolute one would hide the small ones).
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_sketchwalk_pselect.py (needs TRITON_INTERPRET=1 before triton is "
                "imported)", allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

import kvsieve  # noqa: E402
from kvsieve import CallContext  # noqa: E402
from kvsieve.kernels.sketchwalk import prefill_select as kernels  # noqa: E402
from kvsieve.methods.sketchwalk import TIE_BREAK, block_budget, max_block_budget, normalize_rows  # noqa: E402

pytestmark = pytest.mark.triton


def method(spec: str, backend: str):
    base = "sketchwalk:variant=reconstruction"
    return kvsieve.method(f"{base},{spec},backend={backend}" if spec else f"{base},backend={backend}")


def qk(b, hq, hkv, n_tok, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_tok, d, generator=g) * 3
    k = torch.randn(b, hkv, n_tok, d, generator=g)
    return q.to(dtype), k.to(dtype)


def close(a, r, what, rtol=2e-5):
    torch.testing.assert_close(a, r, atol=1e-30, rtol=rtol, msg=lambda s: f"{what}: {s}")


def random_causal(b, n, seed, levels=None):
    """A causal ``[b, n, n]`` float32 matrix of positive entries spanning many decades (zero above the diagonal);
    with ``levels``, values from a few levels only (exact ties, zeros included)."""
    g = torch.Generator().manual_seed(seed)
    if levels is None:
        x = torch.exp(torch.randn(b, n, n, generator=g) * 8)
    else:
        x = torch.randint(0, levels, (b, n, n), generator=g).float() / levels
    return x.tril().contiguous()


@pytest.mark.parametrize("n_tok,bs", [(5, 16), (16, 16), (33, 16), (48, 16), (300, 16), (1000, 32), (515, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sketch_matches_the_reference(n_tok, bs, dtype):
    """Short contexts of 1–3 blocks, partial last blocks, n not a power of two, 16-bit inputs."""
    q, k = qk(2, 6, 2, n_tok, 64, seed=n_tok, dtype=dtype)
    spec = f"block_size={bs}"
    a, r = method(spec, "triton").prefill_sketch(q, k), method(spec, "reference").prefill_sketch(q, k)
    assert set(a) == set(r) - {"log_a"}
    for key in ("q_avg", "q_sum", "k_sum", "k_sketch"):
        assert a[key].shape == r[key].shape and a[key].dtype == torch.float32, key
        torch.testing.assert_close(a[key], r[key], atol=1e-5, rtol=1e-5, msg=lambda s, key=key: f"{key}: {s}")
    close(a["a_tilde"], r["a_tilde"], "a_tilde", rtol=1e-4)
    assert torch.equal(a["a_tilde"] == 0, r["a_tilde"] == 0)


@pytest.mark.parametrize("d,hq,hkv,m", [(48, 4, 4, 32), (128, 8, 2, 64), (32, 3, 1, 16)])
def test_sketch_head_dims_groups_and_strided_inputs(d, hq, hkv, m):
    """A head dim that is not a power of two (masked features), GQA groups of 1–4, q/k as transposed views of
    a [B, N, H, d] layout (what a model hands over)."""
    g = torch.Generator().manual_seed(d)
    q = (torch.randn(2, 200, hq, d, generator=g) * 3).transpose(1, 2)
    k = torch.randn(2, 200, hkv, d, generator=g).transpose(1, 2)
    spec = f"block_size=16,sketch_dim={m}"
    a, r = method(spec, "triton").prefill_sketch(q, k), method(spec, "reference").prefill_sketch(q, k)
    for key in ("q_avg", "q_sum", "k_sum", "k_sketch"):
        torch.testing.assert_close(a[key], r[key], atol=1e-5, rtol=1e-5, msg=lambda s, key=key: f"{key}: {s}")
    close(a["a_tilde"], r["a_tilde"], "a_tilde", rtol=1e-4)


@pytest.mark.parametrize("n", [1, 2, 3, 37, 70])
@pytest.mark.parametrize("walk,density,fixed_k", [("walk", 0.1, False), ("walk", 0.3, True), ("walk", 1.0, False),
                                                  ("one-hop", 0.3, False), ("diagonal", 0.2, False)])
def test_select_matches_the_reference(n, walk, density, fixed_k):
    """The same walk and the same lists, with and without a previous layer's walk, every control."""
    spec = f"density={density},fixed_k={fixed_k},walk={walk}"
    a_tilde = random_causal(2, n, seed=n)
    previous = normalize_rows(random_causal(2, n, seed=n + 1))
    for prev in (None, previous):
        a = method(spec, "triton").prefill_select(a_tilde, prev)
        r = method(spec, "reference").prefill_select(a_tilde, prev)
        close(a[0], r[0], f"w (previous: {prev is not None})", rtol=1e-6)
        assert torch.equal(a[1], r[1]) and torch.equal(a[2], r[2]), (prev is not None, a[1], r[1])
        assert a[1].dtype == r[1].dtype == torch.int64 and a[2].dtype == torch.int64


def assert_lists_break_ties_low(got, ref, a_tilde, density, fixed_k):
    """``got = (w, idx, cnt)`` (the kernel) against ``ref`` (the method's torch path, whose ``torch.topk``
    may pick any of tied blocks): the same counts and ranking values, and each row's list exactly block 0,
    the best ``k − 2`` of blocks 1..i−1 by a stable sort (ties to the lowest index) ascending, block i, then
    zeros. Returns how many rows chose nothing of a non-empty middle (``k − 2 = 0``) and how many had a tie
    across their threshold (the last taken block's ranking equal to the first left out)."""
    (w, idx, cnt), (_, ridx, rcnt) = got, ref
    b, n, _ = a_tilde.shape
    assert torch.equal(cnt, rcnt)
    rank = w + TIE_BREAK * normalize_rows(a_tilde)
    budget = block_budget(torch.arange(n)[None].expand(b, n), density, fixed_k=fixed_k, n_blocks=n)
    kmax = max_block_budget(n, density, fixed_k=fixed_k)
    none_taken = split_ties = 0
    for r in range(b):
        for i in range(n):
            used = int(cnt[r, i])
            got_i, ref_i = idx[r, i, :used], ridx[r, i, :used]
            assert torch.equal(rank[r, i, got_i].sort().values, rank[r, i, ref_i].sort().values), (r, i)
            middle = rank[r, i, 1:i] if i > 1 else rank[r, i, :0]
            extra = max(0, int(budget[r, i]) - 2)
            order = torch.sort(-middle, stable=True).indices
            expect = torch.cat([torch.zeros(1, dtype=torch.long), (order[:extra] + 1).sort().values,
                                torch.tensor([i] if i > 0 else [], dtype=torch.long)])
            assert torch.equal(got_i, expect), (r, i, got_i, expect)
            assert torch.equal(idx[r, i, used:], torch.zeros(kmax - used, dtype=torch.long))
            none_taken += extra == 0 and len(middle) > 0
            split_ties += 0 < extra < len(middle) and bool(middle[order[extra - 1]] == middle[order[extra]])
    return none_taken, split_ties


@pytest.mark.parametrize("levels", [1, 2, 5])
def test_ties_go_to_the_lower_block(levels):
    """Exact ties in the ranking (a few levels of Ã, zeros included, and no previous walk, so the tie-break
    cannot separate them): the kernel keeps the reference's counts and ranking values, the tied blocks at the
    threshold taken from the lowest index (a stable sort of the ranking)."""
    n, density = 40, 0.3
    a_tilde = random_causal(2, n, seed=levels, levels=levels)
    a_tilde[..., 0] = 1.0  # every row has a positive maximum
    spec = f"density={density},walk=one-hop"
    got = method(spec, "triton").prefill_select(a_tilde, None)
    ref = method(spec, "reference").prefill_select(a_tilde, None)
    assert_lists_break_ties_low(got, ref, a_tilde, density, fixed_k=False)


@pytest.mark.parametrize("walk,density,fixed_k", [("one-hop", 0.1, False), ("diagonal", 0.3, False),
                                                  ("diagonal", 0.15, True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_forced_ties_in_random_rankings(walk, density, fixed_k, seed):
    """Continuous random Ã (and previous walk) spanning many decades, with a few columns copied onto several
    later ones: the copies rank exactly equal (one-hop, and diagonal's element-wise product), some of them
    across a row's threshold. Low densities leave many rows with k − 2 = 0 of a non-empty middle (the
    kernel's guard around the select; with fixed_k only rows 0 and 1, whose middle is empty); the test checks
    that the cases occur."""
    n = 70
    g = torch.Generator().manual_seed(100 + seed)
    a_tilde = random_causal(2, n, seed=seed)
    previous = normalize_rows(random_causal(2, n, seed=seed + 50))
    for src in torch.randperm(n - 1, generator=g)[:8].tolist():
        src += 1  # a middle block: block 0 is always taken
        for dst in torch.randint(src + 1, n, (3,), generator=g).tolist() if src + 1 < n else []:
            a_tilde[..., dst] = a_tilde[..., src]
            previous[..., dst] = previous[..., src]
    a_tilde, previous = a_tilde.tril(), previous.tril()
    spec = f"density={density},fixed_k={fixed_k},walk={walk}"
    none_taken = split_ties = 0
    for prev in (None, previous):
        got = method(spec, "triton").prefill_select(a_tilde, prev)
        ref = method(spec, "reference").prefill_select(a_tilde, prev)
        close(got[0], ref[0], f"w (previous: {prev is not None})", rtol=1e-6)
        counted = assert_lists_break_ties_low(got, ref, a_tilde, density, fixed_k)
        none_taken, split_ties = none_taken + counted[0], split_ties + counted[1]
    assert split_ties > 0 and (none_taken > 0 or fixed_k), (none_taken, split_ties)


def run_layers(spec: str, backend: str, layers, prompt: int):
    m = method(spec, backend)
    forward, outs = m.new_forward_state(), []
    for q, k, v in layers:
        state = m.new_state()
        out, stats = m.prefill(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], scale=None, state=state,
                               context=CallContext(forward=forward), sparse=True)
        sk = state.sketch
        outs.append({"out": out, "w": forward.walk.clone(), "density": stats.block_density,
                     "selection": stats.extra["selection"], "hops": stats.extra["walk_hops"],
                     "q_tok": sk.q_tok, "q_sum": sk.q_sum, "k_sum": sk.k_sum, "k_sketch": sk.k_sketch,
                     "a_tilde": sk.a_tilde})
    return outs


@pytest.mark.parametrize("spec", ["density=0.2,block_size=16", "density=0.1,block_size=16,walk=diagonal",
                                  "density=0.3,block_size=32,walk=one-hop,fixed_k=true",
                                  "density=0.2,block_size=16,walk=oracle"])
def test_method_prefill_paths_agree_across_layers(spec):
    """Three sparse layers through the walk: the same state, walk, blocks (block density) and outputs; the
    stats name the selection's path."""
    g = torch.Generator().manual_seed(7)
    layers = [[torch.randn(1, h, 330, 64, generator=g) * s for h, s in ((4, 3.0), (2, 1.0), (2, 1.0))]
              for _ in range(3)]
    a, r = run_layers(spec, "triton", layers, 330), run_layers(spec, "reference", layers, 330)
    for layer, (x, y) in enumerate(zip(a, r, strict=True)):
        assert (x["selection"], y["selection"]) == ("triton", "reference"), layer
        assert x["density"] == y["density"] and x["hops"] == y["hops"] == layer + 1, layer
        for key in ("q_tok", "q_sum", "k_sum", "k_sketch"):
            torch.testing.assert_close(x[key], y[key], atol=1e-5, rtol=1e-5)
        close(x["a_tilde"], y["a_tilde"], f"layer {layer} a_tilde", rtol=1e-4)
        close(x["w"], y["w"], f"layer {layer} w", rtol=1e-4)
        torch.testing.assert_close(x["out"], y["out"], atol=1e-5, rtol=1e-5)


def test_matrix_power_and_float64_keep_the_reference_and_say_why():
    q, k = qk(1, 4, 2, 100, 64, seed=3)
    v = k.clone()
    m = method("block_size=16,walk_power=matrix,alpha=2", "triton")
    _, stats = m.prefill(q, k, v, scale=None, state=None, sparse=True)
    assert stats.extra["selection"] == "reference" and "matrix" in stats.extra["selection_reason"]
    m = method("block_size=16", "triton")
    _, stats = m.prefill(q.double(), k.double(), v.double(), scale=None, state=None, sparse=True)
    assert stats.extra["selection"] == "reference" and "float64" in stats.extra["selection_reason"]
    assert method("block_size=16", "auto").prefill_selection_path(q, 7) == ("reference", None)  # CPU: expected
    assert method("block_size=16", "triton").prefill_selection_path(q, kernels.MAX_BLOCKS + 1)[0] == "reference"


def test_bad_input_is_refused_with_the_argument_named():
    q, k = qk(1, 4, 2, 64, 64, seed=0)
    phi = torch.randn(32, 64)
    with pytest.raises(ValueError, match="k: expected"):
        kernels.prefill_sketch(q, k[:, :, :32], phi, block_size=16, logit_scale=0.125, alpha=8.0)
    with pytest.raises(ValueError, match="k: expected"):
        kernels.prefill_sketch(q, torch.randn(1, 3, 64, 64), phi, block_size=16, logit_scale=0.125, alpha=8.0)
    with pytest.raises(ValueError, match="phi"):
        kernels.prefill_sketch(q, k, phi.double(), block_size=16, logit_scale=0.125, alpha=8.0)
    with pytest.raises(ValueError, match="block_size"):
        kernels.prefill_sketch(q, k, phi, block_size=24, logit_scale=0.125, alpha=8.0)
    with pytest.raises(ValueError, match="float64"):
        kernels.prefill_sketch(q.double(), k.double(), phi, block_size=16, logit_scale=0.125, alpha=8.0)
    a = random_causal(1, 8, seed=0)
    with pytest.raises(ValueError, match="a_tilde"):
        kernels.prefill_select(a.double(), None, mode="walk", density=0.5, fixed_k=False, kmax=4, tie=1e-6)
    with pytest.raises(ValueError, match="mode"):
        kernels.prefill_select(a, None, mode="matrix", density=0.5, fixed_k=False, kmax=4, tie=1e-6)
    with pytest.raises(ValueError, match="kmax"):
        kernels.prefill_select(a, None, mode="walk", density=0.5, fixed_k=False, kmax=9, tie=1e-6)
    with pytest.raises(ValueError, match="previous"):
        kernels.prefill_select(a, a[:, :4, :4], mode="walk", density=0.5, fixed_k=False, kmax=4, tie=1e-6)
