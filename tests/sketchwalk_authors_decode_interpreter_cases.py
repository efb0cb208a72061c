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

import kvsieve  # noqa: E402
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference, sparse_decode_triton  # noqa: E402
from kvsieve.methods.sketchwalk import SketchWalkState  # noqa: E402

pytestmark = pytest.mark.triton


def data(b, hq, hkv, n, d, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_kernel_matches_torch_attention(seed, dtype):
    spec = "sketchwalk:block_size=16,window=0.1,sink=0.05,kblocks_frac=0.2,query_window=8"
    b, hq, hkv, d = 2, 4, 2, 64
    prompts, steps = [150, 101], 20
    q, k, v = data(b, hq, hkv, 180, d, seed, dtype)
    outs = {}
    for backend in ("triton", "reference-attention"):
        m = kvsieve.method(spec + (",backend=triton" if backend == "triton" else ""))
        rows = []
        for r, p in enumerate(prompts):
            st = m.new_state()
            m.prefill(q[r:r + 1, :, :p], k[r:r + 1, :, :p], v[r:r + 1, :, :p], scale=None, state=st, sparse=False)
            rows.append(st.authors)
        state = SketchWalkState(authors=type(rows[0]).stack_rows(rows))
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
