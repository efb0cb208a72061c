"""variant=authors' step on the GPU with each form of its second half (``authors_walk.WalkPath``): graph replays equal
eager calls bit for bit, and each step keeps the torch step's blocks from the same state (skipped without CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cuda_capture import warm_check_and_capture
from test_sketchwalk_authors_device import stacked_state

import kvsieve
from kvsieve import CallContext
from kvsieve.kernels.sketchwalk import authors_walk as aw
from kvsieve.methods.sketchwalk import authors_device as ad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PATHS = {"chunked": aw.WalkPath(tail="chunked", select="chunked"), "registers": aw.WalkPath(),
         "registers-bf16": aw.WalkPath(walk_dtype=torch.bfloat16),
         "registers-i128-w8": aw.WalkPath(block_i=128, hop_warps=8)}


@pytest.mark.parametrize("name", list(PATHS))
def test_each_walk_path_replays_in_a_graph_and_keeps_the_torch_steps_blocks(name):
    """Two rows of different prompts (Llama-3.1-8B heads, bf16, capacity 16k), 40 replayed steps (blocks complete,
    the ring wraps) equal to eager calls from the restart again; at every step the kept blocks of the path's
    step equal those of the torch step from a copy of the same state (float32 U: at most 2 flips at near ties in
    all; a bf16 U, whose rounding moves near ties on random data: at most 5% of the kept blocks, the benchmark
    reports the count)."""
    before = aw.set_path(PATHS[name])
    try:
        cap, prompts, steps = 16384, [64 * 150 + 37, 64 * 120], 40
        g = torch.Generator(device="cuda").manual_seed(7)
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
        bound = 2 if PATHS[name].walk_dtype == torch.float32 else kept // 20
        assert flips <= bound, (flips, kept)
    finally:
        aw.set_path(before)
