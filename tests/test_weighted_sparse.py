"""The weighted sparse decode contract (kernels/shared/weighted.py) against a dense brute force."""

import itertools

import pytest
import torch
from conftest import random_qkv

from kvsieve.kernels.shared.weighted import weighted_sparse_decode_reference


def brute_force(q, k, v, idx, counts, weights, scale):
    """Dense per-key weight vector (duplicates add up), then Σ w e^s v / Σ w e^s, in float64."""
    b, hq, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    hs = idx.shape[1]
    w_dense = torch.zeros(b, hs, n, dtype=torch.float64)
    used = torch.arange(idx.shape[2]) < counts[..., None]
    w = torch.ones(idx.shape, dtype=torch.float64) if weights is None else weights.double()
    w_dense.scatter_add_(2, idx, torch.where(used, w, torch.zeros_like(w)))
    if hs == hkv:
        w_dense = w_dense.repeat_interleave(g, dim=1)
    ke = k.double().repeat_interleave(g, dim=1)
    ve = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("bhd,bhnd->bhn", q.double(), ke) * scale
    logits = torch.where(w_dense > 0, s + torch.log(w_dense.clamp(min=1e-300)), torch.tensor(float("-inf"),
                                                                                           dtype=torch.float64))
    lse = torch.logsumexp(logits, -1)
    out = torch.einsum("bhn,bhnd->bhd", torch.exp(logits - lse[..., None]), ve)
    return out, lse


def random_index_lists(b, hs, n, m, gen, duplicates=False):
    counts = torch.randint(1, m + 1, (b, hs), generator=gen)
    if duplicates:
        idx = torch.randint(0, n, (b, hs, m), generator=gen)
    else:
        idx = torch.stack([torch.randperm(n, generator=gen)[:m] for _ in range(b * hs)]).view(b, hs, m)
    weights = torch.rand(b, hs, m, generator=gen, dtype=torch.float64) * 10 + 0.1
    return idx, counts, weights


@pytest.mark.parametrize(
    "heads,kv_heads,per_query_head,d,dtype,duplicates,seed",
    [
        (hq, hkv, pq, d, dt, dup, seed)
        for (hq, hkv), pq, d, dt, dup, seed in itertools.product(
            [(4, 4), (6, 2), (8, 2)], [False, True], [64, 128], [torch.float64, torch.float32], [False, True], [0]
        )
        if not (pq and hq == hkv)
    ],
)
def test_matches_brute_force(heads, kv_heads, per_query_head, d, dtype, duplicates, seed):
    n, m, b = 300, 40, 2
    q, k, v = random_qkv(batch=b, heads=heads, kv_heads=kv_heads, n=n, d=d, dtype=dtype, seed=seed, peaked=2.0)
    gen = torch.Generator().manual_seed(seed + 100)
    hs = heads if per_query_head else kv_heads
    idx, counts, weights = random_index_lists(b, hs, n, m, gen, duplicates)
    scale = d ** -0.5
    out, lse = weighted_sparse_decode_reference(q, k, v, idx, counts, weights, scale=scale)
    ref_out, ref_lse = brute_force(q, k, v, idx, counts, weights, scale)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    q, k, v = random_qkv(batch=2, heads=6, kv_heads=2, n=200, d=64, dtype=dtype, seed=3)
    gen = torch.Generator().manual_seed(0)
    idx, counts, weights = random_index_lists(2, 2, 200, 50, gen)
    out, lse = weighted_sparse_decode_reference(q, k, v, idx, counts, weights)
    ref_out, ref_lse = brute_force(q, k, v, idx, counts, weights, 64 ** -0.5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)


def test_all_indices_weight_one_is_dense_attention():
    q, k, v = random_qkv(batch=2, heads=6, kv_heads=3, n=128, d=32, seed=5, peaked=3.0)
    idx = torch.arange(128).expand(2, 3, 128).contiguous()
    counts = torch.full((2, 3), 128)
    out, lse = weighted_sparse_decode_reference(q, k, v, idx, counts, None)
    s = torch.einsum("bhd,bhnd->bhn", q, k.repeat_interleave(2, 1)) * 32 ** -0.5
    dense = torch.einsum("bhn,bhnd->bhd", torch.softmax(s, -1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, dense, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-12, rtol=1e-12)


def test_constant_weight_leaves_output_unchanged_and_shifts_lse():
    q, k, v = random_qkv(batch=1, heads=4, kv_heads=2, n=100, d=16, seed=2)
    gen = torch.Generator().manual_seed(1)
    idx, counts, _ = random_index_lists(1, 2, 100, 30, gen)
    out1, lse1 = weighted_sparse_decode_reference(q, k, v, idx, counts, None)
    out2, lse2 = weighted_sparse_decode_reference(q, k, v, idx, counts, torch.full(idx.shape, 7.5, dtype=torch.float64))
    torch.testing.assert_close(out1, out2, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse2 - lse1, torch.full_like(lse1, float(torch.log(torch.tensor(7.5)))))


def test_padding_entries_are_never_read():
    """Poisoned rows that only padding points at must not reach the output."""
    q, k, v = random_qkv(batch=2, heads=4, kv_heads=2, n=50, d=16, seed=4)
    idx = torch.randint(1, 50, (2, 2, 10), generator=torch.Generator().manual_seed(0))
    counts = torch.tensor([[3, 10], [1, 7]])
    used = torch.arange(10) < counts[..., None]
    idx = torch.where(used, idx, torch.zeros_like(idx))  # padding points at row 0 ...
    k = k.clone()
    v = v.clone()
    k[:, :, 0] = float("nan")  # ... which is poisoned
    v[:, :, 0] = float("nan")
    weights = torch.where(used, torch.rand(idx.shape, dtype=torch.float64) + 0.5, torch.full(idx.shape, float("nan"),
                                                                                             dtype=torch.float64))
    out, lse = weighted_sparse_decode_reference(q, k, v, idx, counts, weights, check=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda i, c, w: (i + 1000, c, w), "indices: used entries"),
        (lambda i, c, w: (i - 1000, c, w), "indices: used entries"),
        (lambda i, c, w: (i, c * 0, w), "counts"),
        (lambda i, c, w: (i, c + 100, w), "counts"),
        (lambda i, c, w: (i, c, -w), "weights"),
        (lambda i, c, w: (i, c, w * float("inf")), "weights"),
        (lambda i, c, w: (i[:, :1], c[:, :1], w[:, :1]), None),  # one list per batch row is not a head layout
        (lambda i, c, w: (i.float(), c, w), "indices"),
        (lambda i, c, w: (i, c, w[..., :-1]), "weights"),
    ],
)
def test_bad_input_is_a_clear_error(change, match):
    q, k, v = random_qkv(batch=2, heads=6, kv_heads=2, n=50, d=16, seed=0)
    gen = torch.Generator().manual_seed(0)
    idx, counts, weights = random_index_lists(2, 2, 50, 8, gen)
    i, c, w = change(idx, counts, weights)
    with pytest.raises(ValueError, match=match or "indices"):
        weighted_sparse_decode_reference(q, k, v, i, c, w)
