"""variant=authors' batched decode with the Triton sparse kernel (the kept blocks as pages, the first
``window_tokens`` keys as a per-row dense prefix: ``sink_lengths``) against the same step with the torch
attention, on the CPU through Triton's interpreter. Not collected on its own:
``tests/test_sketchwalk_authors_device.py`` runs this file in a subprocess with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_sketchwalk_authors_device.py (needs TRITON_INTERPRET=1 before triton is "
                "imported)", allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

from test_sketchwalk_authors_device import stacked_state  # noqa: E402

import kvsieve  # noqa: E402
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference, sparse_decode_triton  # noqa: E402

pytestmark = pytest.mark.triton


def data(b, hq, hkv, n, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


# each dtype once, on its own seed (the interpreter runs every program of every launch in turn)
@pytest.mark.parametrize("seed,dtype", [(0, torch.float32), (1, torch.bfloat16)])
def test_sink_lengths_match_the_reference(seed, dtype):
    b, hq, hkv, n, d, page = 3, 4, 2, 200, 64, 16
    q, k, v = (t[:, :, 0] if i == 0 else t for i, t in enumerate(data(b, hq, hkv, n, d, seed, dtype)))
    g = torch.Generator().manual_seed(seed + 10)
    lengths = torch.tensor([200, 131, 77], dtype=torch.int32)
    sink_lengths = torch.tensor([19, 40, 1], dtype=torch.int32)
    pages = torch.randint(0, 5, (b, hkv, 6), generator=g, dtype=torch.int32) + torch.tensor([[[0]], [[3]], [[0]]],
                                                                                            dtype=torch.int32)
    pages = pages.sort(-1).values.contiguous()
    counts = torch.tensor([[6, 4], [5, 6], [2, 0]], dtype=torch.int32)
    kw = dict(page_size=page, lengths=lengths, sink=40, sink_lengths=sink_lengths)
    out, lse = sparse_decode_triton(q, k, v, pages, counts, **kw)
    ref, ref_lse = sparse_decode_reference(q, k, v, pages, counts, **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed,dtype", [(0, torch.float32), (1, torch.bfloat16)])
def test_batched_decode_kernel_matches_torch_attention(seed, dtype):
    spec = "sketchwalk:block_size=16,window=0.1,sink=0.05,kblocks_frac=0.2,query_window=8"
    b, hq, hkv, d = 2, 4, 2, 64
    prompts, steps = [150, 101], 12  # each row completes a block (at 160 and 112 keys)
    q, k, v = data(b, hq, hkv, 180, d, seed, dtype)
    outs = {}
    for backend in ("triton", "reference-attention"):
        m = kvsieve.method(spec + (",backend=triton" if backend == "triton" else ""))
        state = stacked_state(m, q, k, v, prompts)
        got = []
        for i in range(steps):
            lengths = torch.tensor(prompts) + 1 + i
            out, stats = m.decode(q[torch.arange(b), :, lengths - 1], k, v, lengths=lengths, state=state,
                                  context=kvsieve.CallContext(capacity=k.shape[2]))
            assert stats.backend == ("triton" if backend == "triton" else "reference")
            got.append(out.float())
        outs[backend] = torch.stack(got)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs["triton"], outs["reference-attention"], atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selection_kernel_matches_its_reference(seed):
    from kvsieve.kernels.sketchwalk.authors_decode import select_pages_reference, select_pages_triton

    g = torch.Generator().manual_seed(seed)
    b, c = 5, 100
    w = torch.rand(b, c, generator=g) ** 4  # entries over decades
    w[1] = w[1].round(decimals=1)  # exact ties
    n = torch.tensor([100, 57, 3, 80, 9])
    sb, wb = torch.tensor([3, 2, 1, 5, 4]), torch.tensor([6, 4, 2, 9, 5])  # row 4: no candidate
    wt = torch.tensor([150, 40, 1, 600, 30])
    for q in (0.875, 0.5, 0.01):
        want = select_pages_reference(w, n, sb, wb, wt, q=q, block_size=16, max_pages=40)
        got = select_pages_triton(w, n, sb, wb, wt, q=q, block_size=16, max_pages=40)
        for name, x, y in zip(("kept", "pages", "counts"), want, got, strict=True):
            assert torch.equal(x, y), (name, q)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matrix_update_kernel_matches_its_reference(seed):
    """Rows that restart (prompt ending mid-block or on a block boundary), start a block, or continue one."""
    from kvsieve.kernels.sketchwalk.authors_decode import update_matrix_reference, update_matrix_triton

    g = torch.Generator().manual_seed(seed)
    b, cap, bs = 5, 40, 8
    u = torch.rand(b, cap, cap, generator=g) ** 3
    sigma = 1 / u.sum(-1) * (1 + 0.1 * torch.rand(b, cap, generator=g))
    rsum = u.sum(-1)
    n_blocks = torch.tensor([12, 20, 9, 30, 13])
    pos = torch.tensor([90, 160, 71, 237, 96])  # block 11 (restart mid-block), 20 (new), 8, 29, 12 (restart, new)
    restart = torch.tensor([True, False, False, False, True])
    p_nblocks = torch.tensor([12, 0, 0, 0, 12])
    p_row, p_col = torch.rand(b, cap, generator=g), torch.rand(b, cap, generator=g)
    p_rsum = torch.rand(b, cap, generator=g) + 0.5
    r = torch.rand(b, cap, generator=g) * (torch.arange(cap) <= pos[:, None] // bs)
    r = r / r.sum(-1, keepdim=True)
    args = [t.clone() for t in (u, sigma, rsum, n_blocks)]
    want = [t.clone() for t in (u, sigma, rsum, n_blocks)]
    update_matrix_reference(*want, r, pos, restart, p_nblocks, p_row, p_col, p_rsum, block_size=bs, eps=1e-12)
    update_matrix_triton(*args, r, pos, restart, p_nblocks, p_row, p_col, p_rsum, block_size=bs, eps=1e-12)
    assert torch.equal(args[3], want[3])
    for got, ref in zip(args[:3], want[:3], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_block_row_kernel_matches_its_reference(seed):
    """GQA groups, ragged block counts, a ring with invalid slots, a sketch dim that is no power of two."""
    from kvsieve.kernels.sketchwalk.authors_decode import block_row_reference, block_row_triton

    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, w_len, m, cap = 3, 4, 2, 5, 12, 40
    qs = torch.randn(b, hq, w_len, m, generator=g) * 4
    ks = torch.randn(b, hkv, cap, m, generator=g) * 4
    n = torch.tensor([40, 17, 1])
    slot_ok = torch.rand(b, w_len, generator=g) < 0.7
    slot_ok[:, 0] = True
    want = block_row_reference(qs, ks, n, slot_ok, 0.3)
    got = block_row_triton(qs, ks, n, slot_ok, 0.3, block_n=16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not got[1, 17:].any() and not got[2, 1:].any()
