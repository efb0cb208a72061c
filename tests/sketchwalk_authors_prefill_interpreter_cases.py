"""Sketch&Walk's ``variant=authors`` prefill Triton kernel against the token-mask reference, on the CPU through
Triton's interpreter. Not collected on its own: ``tests/test_sketchwalk_authors_prefill.py`` runs this file
in a subprocess with ``TRITON_INTERPRET=1`` (the interpreter is chosen when triton is imported).

Tiny shapes (16-key blocks, a few hundred tokens), random data (never zeros), q scaled up so the softmax is
far from uniform. bfloat16 tiles are upcast to float32 before ``tl.dot`` under the interpreter (its bf16 dot
is wrong), so that case checks loads, masks and the output cast; the ``gpu`` tests check 16-bit dots.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_sketchwalk_authors_prefill.py (needs TRITON_INTERPRET=1 before triton is "
                "imported)", allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

import kvsieve  # noqa: E402
from kvsieve import CallContext  # noqa: E402
from kvsieve.kernels.sketchwalk.authors_prefill import authors_block_lists, authors_prefill_triton  # noqa: E402
from kvsieve.methods.sketchwalk import SketchWalkState, WalkState, authors  # noqa: E402

pytestmark = pytest.mark.triton


def qkv(b, hq, hkv, n_tok, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n_tok, d, generator=g) * 2
    k = torch.randn(b, hkv, n_tok, d, generator=g)
    v = torch.randn(b, hkv, n_tok, d, generator=g) + 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype)


def selection(b, n_tok, bs, window_tokens, share, seed):
    n = -(-n_tok // bs)
    g = torch.Generator().manual_seed(seed)
    blocks = (torch.rand(b, n, n, generator=g) < share) & torch.ones(n, n, dtype=torch.bool).tril()
    return authors.PrefillSelection(blocks=blocks, window_tokens=window_tokens, sink_blocks=1, window_blocks=1)


@pytest.mark.parametrize("n_tok,bs,w,share,hq,hkv", [
    (200, 16, 5, 0.3, 4, 2), (203, 16, 23, 0.4, 4, 1), (150, 32, 40, 0.2, 2, 2), (97, 16, 1, 0.5, 8, 2),
])
def test_kernel_equals_the_token_mask_reference_fp32(n_tok, bs, w, share, hq, hkv):
    sel = selection(2, n_tok, bs, w, share, seed=n_tok + w)
    q, k, v = qkv(2, hq, hkv, n_tok, 64, seed=w)
    ref, _, _ = authors.prefill_attention(q, k, v, sel, block_size=bs, scale=0.2, dtype=torch.float32)
    lists = authors_block_lists(sel.blocks, w, n_tokens=n_tok, block_size=bs)
    out = authors_prefill_triton(q, k, v, lists, scale=0.2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_kernel_bf16_with_strided_q():
    n_tok, bs, w = 180, 16, 9
    sel = selection(1, n_tok, bs, w, 0.3, seed=1)
    q, k, v = qkv(1, 4, 2, n_tok, 64, seed=2, dtype=torch.bfloat16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, N, H, d] memory, as a model's projections give
    ref, _, _ = authors.prefill_attention(q, k, v, sel, block_size=bs, scale=64 ** -0.5, dtype=torch.float32)
    lists = authors_block_lists(sel.blocks, w, n_tokens=n_tok, block_size=bs)
    out = authors_prefill_triton(q, k, v, lists)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_method_prefill_through_the_kernel_equals_the_reference():
    """``prefill_backend=triton``: the method's output and stats equal the reference's, across two layers."""
    q, k, v = qkv(1, 4, 2, 330, 64, seed=3)  # 21 blocks of 16
    results = {}
    for backend in ("reference", "triton"):
        m = kvsieve.method(f"sketchwalk:block_size=16,prefill_backend={backend}")
        forward = WalkState()
        results[backend] = [m.prefill(q, k, v, scale=None, state=SketchWalkState(),
                                      context=CallContext(forward=forward), sparse=True) for _ in range(2)]
    for (ref, ref_st), (out, st) in zip(results["reference"], results["triton"], strict=True):
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        assert st.backend == "triton" and ref_st["block_density"] < 0.9, ref_st["block_density"]
        for key in ("density", "bytes_read", "exact_rows", "block_density", "blocks_kept"):
            assert st[key] == pytest.approx(ref_st[key]), key
