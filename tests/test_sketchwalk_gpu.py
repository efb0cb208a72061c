"""Sketch&Walk on the GPU: FlexAttention block-sparse prefill vs the torch reference, and the method's
prefill on CUDA (skipped without CUDA)."""

import pytest
import torch

import kvsieve
from kvsieve.kernels.sparse.block_sparse import block_sparse_prefill_flex, block_sparse_prefill_reference
from kvsieve.methods.sketchwalk import block_budget, max_block_budget, select_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def selection(n_blocks, density, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.rand(1, n_blocks, n_blocks, device="cuda", generator=g).tril()
    rows = torch.arange(n_blocks, device="cuda")[None]
    budget = block_budget(rows, density, fixed_k=False, n_blocks=n_blocks)
    return select_blocks(w, rows, budget, max_block_budget(n_blocks, density, fixed_k=False))


@pytest.mark.parametrize("n_tok", [1024, 4096 + 37, 16384])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("density", [0.05, 0.1, 0.2, 1.0])
def test_flex_prefill_matches_reference_bf16(n_tok, d, density):
    bs = 64
    g = torch.Generator(device="cuda").manual_seed(n_tok + d)
    q = torch.randn(1, 8, n_tok, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 2, n_tok, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, 2, n_tok, d, device="cuda", generator=g).bfloat16()
    idx, cnt = selection(-(-n_tok // bs), density, seed=d)
    out, lse = block_sparse_prefill_flex(q, k, v, idx, cnt, block_size=bs, check=True)
    ref, ref_lse = block_sparse_prefill_reference(q, k, v, idx, cnt, block_size=bs)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.float(), ref_lse, atol=2e-2, rtol=1e-3)


def test_method_prefill_and_decode_on_cuda_match_cpu():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2048 + 5, 64, generator=g)
    k = torch.randn(1, 2, 2048 + 5, 64, generator=g)
    v = torch.randn(1, 2, 2048 + 5, 64, generator=g)
    m = kvsieve.method("sketchwalk:density=0.2")
    results = {}
    for dev in ("cpu", "cuda"):
        state, fwd = {}, {}
        out, stats = m.prefill(q[:, :, :-1].to(dev), k[:, :, :-1].to(dev), v[:, :, :-1].to(dev), scale=None,
                               state=state, forward=fwd, sparse=True)
        state["forward"] = {}
        dec, dstats = m.decode(q[:, :, -1].to(dev), k.to(dev), v.to(dev), state=state)
        results[dev] = (out.cpu(), dec.cpu(), stats.backend, dstats.blocks_kept)
    assert results["cuda"][2] == "flex" and results["cpu"][2] == "reference"
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(results["cuda"][1], results["cpu"][1], atol=1e-4, rtol=1e-4)
    assert results["cuda"][3] == results["cpu"][3]
