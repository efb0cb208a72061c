"""The block-sparse prefill Triton kernel (Sketch&Walk's sparse prefill) against the torch reference, on the
CPU through Triton's interpreter. Not collected on its own: ``tests/test_sketchwalk_prefill_kernel.py`` runs
this file in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen when triton is imported).

Shapes are tiny (16-key blocks, a few hundred tokens); the data is random (never zeros), q scaled up so
the softmax is far from uniform. bfloat16/float16 tiles are upcast to float32 before ``tl.dot`` under the
interpreter (its bf16 dot is wrong), so those cases check loads, masks, strides and the output cast; the
``gpu`` tests check 16-bit dots on the device.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_sketchwalk_prefill_kernel.py (needs TRITON_INTERPRET=1 before triton is "
                "imported)", allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

import kvsieve  # noqa: E402
from kvsieve.kernels.shared.block_sparse import block_sparse_prefill, block_sparse_prefill_reference  # noqa: E402
from kvsieve.kernels.shared.block_sparse_triton import block_sparse_prefill_triton  # noqa: E402
from kvsieve.methods.sketchwalk import block_budget, max_block_budget, select_blocks  # noqa: E402

pytestmark = pytest.mark.triton

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def qkv(b, hq, hkv, n_tok, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_tok, d, generator=g) * 2
    k = torch.randn(b, hkv, n_tok, d, generator=g)
    v = torch.randn(b, hkv, n_tok, d, generator=g) + 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_selection(b, n, density, seed, *, junk_padding=True):
    """Sketch&Walk-shaped lists (block 0, the top of random scores, the diagonal; ragged counts), padding
    entries set to random blocks (they must never be read)."""
    g = torch.Generator().manual_seed(1000 + seed)
    w = torch.rand(b, n, n, generator=g, dtype=torch.float64).tril()
    rows = torch.arange(n)[None].expand(b, n)
    idx, cnt = select_blocks(w, rows, block_budget(rows, density, fixed_k=False, n_blocks=n),
                             max_block_budget(n, density, fixed_k=False))
    if junk_padding:
        pad = torch.arange(idx.shape[-1]) >= cnt[..., None]
        idx = torch.where(pad, torch.randint(0, n, idx.shape, generator=g), idx)
    return idx, cnt


def compare(q, k, v, idx, cnt, bs, **kw):
    out, lse = block_sparse_prefill_triton(q, k, v, idx, cnt, block_size=bs, check=True, **kw)
    ref, ref_lse = block_sparse_prefill_reference(q, k, v, idx, cnt, block_size=bs, scale=kw.get("scale"))
    assert out.shape == ref.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.isfinite(lse).all()
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < TOL[q.dtype], err
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    return out, lse


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_matches_reference_over_groups_and_head_dims(group, d):
    # ragged counts, N not a multiple of the block, batch 2, two seeds
    for seed in range(2):
        n_tok = 150 + 29 * seed
        q, k, v = qkv(2, 2 * group, 2, n_tok, d, seed=10 * group + d + seed)
        idx, cnt = random_selection(2, -(-n_tok // 16), 0.35, seed)
        assert cnt.min() < cnt.max()
        compare(q, k, v, idx, cnt, 16)


@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_sub_tiles_of_the_packed_rows(block_m):
    # G·B = 4·32 = 128 packed rows: 8, 4 or 1 programs per (KV head, query block); 16 splits a head's rows
    q, k, v = qkv(1, 8, 2, 200, 64, seed=block_m)
    idx, cnt = random_selection(1, -(-200 // 32), 0.4, block_m)
    compare(q, k, v, idx, cnt, 32, block_m=block_m)


@pytest.mark.parametrize("group,block_m", [(3, None), (3, 32), (5, 64)])
def test_group_sizes_that_are_not_powers_of_two(group, block_m):
    # packed rows G·B = 48 / 80: the tile's last rows are masked (SmolLM2 has G = 3)
    q, k, v = qkv(2, group, 1, 90, 64, seed=group)
    idx, cnt = random_selection(2, -(-90 // 16), 0.5, group)
    compare(q, k, v, idx, cnt, 16, block_m=block_m)


def test_count_one_is_the_diagonal_block_alone():
    b, n_tok, bs = 2, 100, 16
    n = -(-n_tok // bs)
    q, k, v = qkv(b, 4, 2, n_tok, 64, seed=7)
    idx = torch.randint(0, n, (b, n, 3), generator=torch.Generator().manual_seed(7))
    idx[:, :, 0] = torch.arange(n)
    cnt = torch.ones(b, n, dtype=torch.long)
    out, lse = compare(q, k, v, idx, cnt, bs)
    # the first row of each block sees only itself: its output is its own value row
    first = torch.arange(0, n_tok, bs)
    torch.testing.assert_close(out[:, :, first], v.repeat_interleave(2, 1)[:, :, first], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("n_tok,bs", [(130, 16), (64, 32)])
def test_every_block_selected_is_dense_causal_attention(n_tok, bs):
    b, n = 2, -(-n_tok // bs)
    q, k, v = qkv(b, 4, 2, n_tok, 64, seed=n_tok)
    idx = torch.arange(n).expand(b, n, n).contiguous()
    cnt = torch.arange(1, n + 1).expand(b, n).contiguous()
    out, lse = compare(q, k, v, idx, cnt, bs)
    kx, vx = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q, kx, vx, is_causal=True)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
    logits = (q @ kx.transpose(-1, -2)) / 8.0
    causal = torch.ones(n_tok, n_tok, dtype=torch.bool).tril()
    torch.testing.assert_close(lse, torch.logsumexp(logits.masked_fill(~causal, float("-inf")), -1),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bs,block_n", [(64, None), (128, None), (64, 16), (32, 16)])
def test_large_blocks_and_key_sub_tiles(bs, block_n):
    # block 128 runs as two 64-key tiles by default; block_n=16 cuts a block into 4 or 2 key tiles
    n_tok = 2 * bs + 37
    q, k, v = qkv(1, 2, 1, n_tok, 64, seed=bs)
    idx, cnt = random_selection(1, -(-n_tok // bs), 0.7, bs)
    compare(q, k, v, idx, cnt, bs, block_n=block_n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs(dtype):
    q, k, v = qkv(2, 4, 1, 120, 128, seed=3, dtype=dtype)
    idx, cnt = random_selection(2, -(-120 // 16), 0.4, 3)
    compare(q, k, v, idx, cnt, 16)


def test_strided_inputs_int32_lists_and_a_scale():
    # q as transformers lays it out before the transpose ([B, N, H, d] memory), int32 lists and counts
    b, n_tok, bs = 2, 97, 16
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(b, n_tok, 4, 64, generator=g) * 2).transpose(1, 2)
    k = torch.randn(b, n_tok, 2, 64, generator=g).transpose(1, 2)
    v = torch.randn(b, 2, n_tok, 64, generator=g)
    assert not q.is_contiguous() and not k.is_contiguous()
    idx, cnt = random_selection(b, -(-n_tok // bs), 0.5, 5)
    compare(q, k, v, idx.to(torch.int32), cnt.to(torch.int32), bs, scale=0.07)


def test_backend_option_runs_the_kernel():
    q, k, v = qkv(1, 4, 2, 80, 64, seed=11)
    idx, cnt = random_selection(1, 5, 0.5, 11)
    out, lse, backend = block_sparse_prefill(q, k, v, idx, cnt, block_size=16, backend="triton")
    ref, ref_lse, ref_backend = block_sparse_prefill(q, k, v, idx, cnt, block_size=16, backend="auto")
    assert (backend, ref_backend) == ("triton", "reference")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="block_n: expected a power of two in \\[16, block_size=16\\], got 32"):
        block_sparse_prefill_triton(q, k, v, idx, cnt, block_size=16, block_n=32)
    with pytest.raises(ValueError, match="block_m: expected a power of two ≥ 16, got 24"):
        block_sparse_prefill_triton(q, k, v, idx, cnt, block_size=16, block_m=24)
    with pytest.raises(ValueError, match="block_size 8"):
        block_sparse_prefill(q, k, v, torch.zeros(1, 10, 1, dtype=torch.long), torch.ones(1, 10, dtype=torch.long),
                             block_size=8, backend="triton")


def test_sketchwalk_prefill_backend_triton_equals_reference():
    q, k, v = qkv(1, 4, 2, 200, 64, seed=13)
    outs = {}
    for backend in ("reference", "triton"):
        m = kvsieve.method(f"sketchwalk:variant=reconstruction,density=0.3,block_size=16,prefill_backend={backend}")
        out, stats = m.prefill(q, k, v, scale=None, state=None, sparse=True)
        outs[backend] = (out, stats)
    assert outs["triton"][1].backend == "triton" and outs["reference"][1].backend == "reference"
    assert outs["triton"][1]["block_density"] == outs["reference"][1]["block_density"] < 1  # deferred: read by key
    torch.testing.assert_close(outs["triton"][0], outs["reference"][0], atol=1e-5, rtol=1e-5)


def test_runtime_sparse_prefill_takes_the_backend_from_the_method():
    from kvsieve.runtime import DecodeRuntime
    from tests.test_runtime import random_ids, tiny_model

    model = tiny_model("llama", num_hidden_layers=3, head_dim=64)
    ids = random_ids(1, 120, seed=4)
    logits = {}
    for backend in ("reference", "triton"):
        spec = f"sketchwalk:variant=reconstruction,density=0.3,block_size=16,sketch_dim=16,prefill_backend={backend}"
        with DecodeRuntime(model, "dense", batch_size=1, capacity=124, max_new_tokens=2, prefill=spec) as rt:
            rt.prefill([ids[0]])
            logits[backend] = rt.last_logits.clone()
            assert rt.stats.as_dict()["prefill_backends"] == [backend]
    torch.testing.assert_close(logits["triton"], logits["reference"], atol=1e-4, rtol=1e-4)
