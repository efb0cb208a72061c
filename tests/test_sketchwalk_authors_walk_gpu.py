"""variant=authors' step on the GPU (``kernels/sketchwalk/authors_walk.py``'s second half): graph replays equal eager
calls bit for bit, and each step keeps the torch step's blocks from the same state (skipped without CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cuda_capture import warm_check_and_capture
from test_sketchwalk_authors_device import stacked_state

import kvsieve
from kvsieve import CallContext
from kvsieve.methods.sketchwalk import authors_device as ad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("seed,cap,prompts", [(7, 16384, [64 * 150 + 37, 64 * 120]),
                                              (8, 8192, [64 * 20 + 5, 64 * 100 + 63]),
                                              (9, 32768, [64 * 400 + 17, 64 * 310])])
def test_the_step_replays_in_a_graph_and_keeps_the_torch_steps_blocks(seed, cap, prompts):
    """Two rows of different prompts (Llama-3.1-8B heads, bf16, capacities of 8k to 32k: 128 to 512 blocks, one
    to four column tiles of the hops, several row splits), 40 replayed steps (blocks complete, the ring wraps)
    equal to eager calls from the restart again; at every step the kept blocks equal those of the torch step from
    a copy of the same state (at most 2 flips at near ties in all)."""
    steps = 40
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(2, h, cap, 128, device="cuda", generator=g).bfloat16() for h in (32, 8, 8))
    m = kvsieve.method("sketchwalk")
    cfg = m.config
    state = stacked_state(m, q, k, v, prompts)
    lengths = torch.tensor(prompts, device="cuda", dtype=torch.int32) + 1
    q_in = torch.empty(2, 32, 128, device="cuda", dtype=torch.bfloat16)

    def call():
        q_in.copy_(q[torch.arange(2, device="cuda"), :, lengths.long() - 1])
        return m.decode(q_in, k, v, lengths=lengths, state=state, check_finite=False,
                        context=CallContext(capacity=cap, count_reads=False))

    _, graph, (out, _) = warm_check_and_capture(call)
    replayed = []
    for i in range(steps):
        lengths.copy_(torch.tensor(prompts, device="cuda") + 1 + i)
        graph.replay()
        replayed.append(out.clone())
    flips = kept = 0
    kw = dict(beta=cfg.walk_damping, degree=cfg.degree, sink=cfg.sink, window=cfg.window,
              kblocks_frac=cfg.kblocks_frac, max_pages=ad.max_kept_pages(cap, cfg.block_size, sink=cfg.sink,
                                                                         window=cfg.window,
                                                                         kblocks_frac=cfg.kblocks_frac))
    for i in range(steps):
        lengths.copy_(torch.tensor(prompts, device="cuda") + 1 + i)
        dst = state.authors_device
        ref = dataclasses.replace(dst, **{f.name: getattr(dst, f.name).clone() for f in dataclasses.fields(dst)
                                          if isinstance(getattr(dst, f.name), torch.Tensor)})
        q_in.copy_(q[torch.arange(2, device="cuda"), :, lengths.long() - 1])
        want = ad.device_step(ref, q_in, k, lengths, kernels=False, **kw)
        eager, _ = call()
        torch.testing.assert_close(eager, replayed[i], atol=0, rtol=0)
        got = dst.last_step
        flips += int((got.kept_blocks != want.kept_blocks).sum())
        kept += int(want.kept_blocks.sum())
    assert kept > 0 and flips <= 2, (flips, kept)
