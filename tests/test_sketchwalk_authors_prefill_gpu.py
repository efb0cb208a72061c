"""Sketch&Walk ``variant=authors``' device prefill on the GPU: the Triton kernel and FlexAttention against the
token-mask reference in bfloat16 at Llama-3.1-8B head shapes, the method's default CUDA path against its
reference path, and no host sync in it (skipped without CUDA)."""

import pytest
import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.kernels.sketchwalk.authors_prefill import authors_block_lists, authors_prefill_flex, authors_prefill_triton
from kvsieve.methods.sketchwalk import SketchWalkState, WalkState, authors
from kvsieve.methods.sketchwalk import authors_prefill as fast

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def qkv(hq, hkv, n_tok, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, hq, n_tok, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, hkv, n_tok, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, hkv, n_tok, d, device="cuda", generator=g).bfloat16()
    return q, k, v


def default_selection(q, k, bs=64):
    """The default rule's selection of this prompt (one layer, its own walk)."""
    cfg = kvsieve.method("sketchwalk").config
    phi = authors.sketch_matrix(q.shape[-1], cfg.hadamard_dim, 0, device="cuda")
    a = fast.block_matrix(q, k, phi, bs, causal=False, dtype=torch.float32)
    w = authors.damped_walk(a, a, a, cfg.walk_damping, cfg.degree)
    return authors.prefill_selection(w, q.shape[2], block_size=bs, sink=cfg.sink, window=cfg.window,
                                     kblocks_frac=cfg.kblocks_frac, dense_last_blocks=cfg.dense_last_blocks)


@pytest.mark.parametrize("n_tok,d,hq,hkv", [(8192 + 37, 128, 32, 8), (4096, 64, 8, 2), (2048 + 1, 128, 4, 4)])
def test_triton_and_flex_match_the_reference_bf16(n_tok, d, hq, hkv):
    q, k, v = qkv(hq, hkv, n_tok, d, seed=n_tok)
    sel = default_selection(q, k)
    ref, _, _ = authors.prefill_attention(q, k, v, sel, block_size=64, scale=d ** -0.5, dtype=torch.float32)
    lists = authors_block_lists(sel.blocks, sel.window_tokens, n_tokens=n_tok, block_size=64)
    out = authors_prefill_triton(q, k, v, lists)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    if hq == 32:  # FlexAttention compiles per shape: the Llama heads only
        flex = authors_prefill_flex(q, k, v, lists)
        torch.testing.assert_close(flex.float(), ref, atol=2e-2, rtol=2e-2)


def test_device_block_matrix_matches_the_reference():
    q, k, _ = qkv(32, 8, 16384, 128, seed=1)
    phi = authors.sketch_matrix(128, 128, 0, device="cuda")
    ref = authors.block_matrix(q, k, phi, 64, causal=False, dtype=torch.float32)
    torch.testing.assert_close(fast.block_matrix(q, k, phi, 64, causal=False, dtype=torch.float32), ref,
                               atol=1e-6, rtol=1e-4)


def test_method_default_on_cuda_runs_the_kernel_and_equals_its_reference(monkeypatch):
    # one block matrix for both paths, so that both select the same blocks (float sums in another order
    # could flip a block at the quantile's edge)
    monkeypatch.setattr(fast, "block_matrix", authors.block_matrix)
    q, k, v = qkv(32, 8, 8192 + 5, 128, seed=2)
    results = {}
    for backend in ("auto", "reference"):
        m = kvsieve.method(f"sketchwalk:prefill_backend={backend}")
        forward = WalkState()
        results[backend] = [m.prefill(q, k, v, scale=None, state=SketchWalkState(),
                                      context=CallContext(forward=forward), sparse=True) for _ in range(2)]
    for (out, st), (ref, ref_st) in zip(results["auto"], results["reference"], strict=True):
        assert st.backend == "triton" and st.extra["selection"] == "device"
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        for key in ("density", "bytes_read", "exact_rows", "block_density", "blocks_kept"):
            assert st[key] == pytest.approx(ref_st[key]), key


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_method_prefill_makes_no_host_sync(backend):
    m = kvsieve.method(f"sketchwalk:prefill_backend={backend}")
    q, k, v = qkv(32, 8, 8192, 128, seed=3)

    def run():
        forward = WalkState()
        for _ in range(2):
            out, stats = m.prefill(q, k, v, scale=None, state=SketchWalkState(), context=CallContext(forward=forward),
                                   sparse=True)
        return out, stats

    run()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, stats = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stats.backend == backend and 0 < stats.density < 1
