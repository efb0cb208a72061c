"""Sketch&Walk on the GPU: FlexAttention block-sparse prefill vs the torch reference, and the method's
prefill on CUDA (skipped without CUDA)."""

import pytest
import torch
from cuda_capture import warm_check_and_capture

import kvsieve
from kvsieve.kernels.shared.block_sparse import block_sparse_prefill_flex, block_sparse_prefill_reference
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


@pytest.mark.parametrize("kernel_options", [{}, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
                                            {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3,
                                             "ROWS_GUARANTEED_SAFE": True}])
def test_flex_prefill_kernel_options_match_reference_bf16(kernel_options):
    # the launch sweep's configurations (docs/results/studies/sketchwalk/tune_prefill.py) at 128-key blocks
    n_tok, d, bs = 4096 + 37, 128, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, 8, n_tok, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, 2, n_tok, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, 2, n_tok, d, device="cuda", generator=g).bfloat16()
    idx, cnt = selection(-(-n_tok // bs), 0.1, seed=5)
    out, lse = block_sparse_prefill_flex(q, k, v, idx, cnt, block_size=bs, check=True, kernel_options=kernel_options)
    ref, ref_lse = block_sparse_prefill_reference(q, k, v, idx, cnt, block_size=bs)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.float(), ref_lse, atol=2e-2, rtol=1e-3)


def test_method_prefill_and_decode_on_cuda_match_cpu():
    from kvsieve import CallContext

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2048 + 5, 64, generator=g)
    k = torch.randn(1, 2, 2048 + 5, 64, generator=g)
    v = torch.randn(1, 2, 2048 + 5, 64, generator=g)
    m = kvsieve.method("sketchwalk:variant=reconstruction,density=0.2")
    results = {}
    for dev in ("cpu", "cuda"):
        state = m.new_state()
        out, stats = m.prefill(q[:, :, :-1].to(dev), k[:, :, :-1].to(dev), v[:, :, :-1].to(dev), scale=None,
                               state=state, sparse=True)
        dec, dstats = m.decode(q[:, :, -1].to(dev), k.to(dev), v.to(dev), state=state,
                               context=CallContext(forward=m.new_forward_state()))
        results[dev] = (out.cpu(), dec.cpu(), stats.backend, dstats.blocks_kept)
    assert results["cuda"][2] == "triton" and results["cpu"][2] == "reference"  # 64-key blocks: the kernel
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(results["cuda"][1], results["cpu"][1], atol=1e-4, rtol=1e-4)
    assert results["cuda"][3] == results["cpu"][3]


# -- the fused decode selection at the paper's shapes ---------------------------------------------------------


def _llama_layers(n, layers, seed=0):
    """Llama-3.1-8B heads (32/8/128), bf16, ``layers`` layers of random q/k/v over ``n`` positions."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [[torch.randn(1, h, n, 128, device="cuda", generator=g).bfloat16() for h in (32, 8, 8)]
            for _ in range(layers)]


def _decode_steps(spec, layers, n0, steps, monkeypatch):
    """Prefill ``n0`` positions through every layer (the torch selection, whatever ``spec``'s backend: the
    prefill kernels' state equals it to rounding only, and the decode paths are compared block for block),
    then decode ``steps`` tokens; per call the blocks the attention read, the walk and the output."""
    import sys

    import kvsieve.kernels.shared.weighted_triton as wt
    from kvsieve import CallContext
    from kvsieve.methods.sketchwalk import SketchWalkState, WalkState

    sw = sys.modules["kvsieve.methods.sketchwalk"]
    seen = []
    kernel, reference = wt.sparse_decode_triton, sw.weighted_sparse_decode
    bs = 64

    def kernel_hook(q, k, v, pages, n_pages, **kw):
        seen.append(pages[0, 0, :int(n_pages[0, 0])].tolist())
        return kernel(q, k, v, pages, n_pages, **kw)

    def reference_hook(q, k, v, idx, counts, w, **kw):
        seen.append(sorted({t // bs for t in idx[0, 0, :int(counts[0, 0])].tolist()}))
        return reference(q, k, v, idx, counts, w, **kw)

    monkeypatch.setattr(wt, "sparse_decode_triton", kernel_hook)
    monkeypatch.setattr(sw, "weighted_sparse_decode", reference_hook)
    m = kvsieve.method(spec)
    prefill = kvsieve.method(spec.rsplit(",backend=", 1)[0] + ",backend=reference")
    states = [SketchWalkState() for _ in layers]
    forward = WalkState()
    for (q, k, v), st in zip(layers, states, strict=True):
        prefill.prefill(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], scale=None, state=st,
                        context=CallContext(forward=forward), sparse=True)
    res = []
    for t in range(n0, n0 + steps):
        forward = WalkState()
        for (q, k, v), st in zip(layers, states, strict=True):
            lengths = torch.tensor([t + 1], device="cuda", dtype=torch.int32)
            out, _ = m.decode(q[:, :, t], k[:, :, :t + 1], v[:, :, :t + 1], lengths=lengths, state=st,
                              context=CallContext(forward=forward), check_finite=False)
            res.append((seen[-1], forward.walk.clone(), out.float()))
    monkeypatch.undo()
    return res, states


@pytest.mark.parametrize("walk", ["walk", "one-hop"])
def test_fused_selection_matches_the_reference_at_long_context(walk, monkeypatch):
    """300 blocks of 64 (the default tiling: several column tiles and row splits of the walk's GEMV), a block
    completing mid-run, three walk layers: the same blocks, walks and outputs as the torch path."""
    n0, steps = 64 * 300 + 10, 60
    layers = _llama_layers(n0 + steps, 3)
    spec = f"sketchwalk:variant=reconstruction,density=0.1,dense_layers=0,walk={walk}"
    fused, fused_states = _decode_steps(spec + ",backend=triton", layers, n0, steps, monkeypatch)
    ref, ref_states = _decode_steps(spec + ",backend=reference", layers, n0, steps, monkeypatch)
    for i, ((blocks, w, out), (ref_blocks, ref_w, ref_out)) in enumerate(zip(fused, ref, strict=True)):
        assert blocks == ref_blocks, i
        torch.testing.assert_close(w, ref_w, atol=1e-30, rtol=1e-3)
        torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)
    n = -(-(n0 + steps) // 64)
    for a, r in zip(fused_states, ref_states, strict=True):
        sa, sr = a.sketch, r.sketch
        torch.testing.assert_close(sa.k_sketch[:, :n], sr.k_sketch[:, :n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(sa.a_tilde[:, :n, :n], sr.a_tilde[:, :n, :n], atol=1e-30, rtol=1e-3)


def test_fused_decode_with_a_walk_replays_in_a_graph_without_host_reads():
    """The fused path with a previous layer's walk: no host read (sync debug mode "error"), and graph replays
    at three lengths (one completes a block) equal eager calls bit for bit."""
    from kvsieve import CallContext
    from kvsieve.methods.sketchwalk import WalkState

    n0 = 64 * 100 + 61
    (q, k, v), = _llama_layers(n0 + 3, 1, seed=1)
    m = kvsieve.method("sketchwalk:variant=reconstruction,density=0.1")
    state = m.new_state()
    m.prefill(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], scale=None, state=state, sparse=True)
    n = -(-(n0 + 3) // 64)
    g = torch.Generator(device="cuda").manual_seed(2)
    w_prev = torch.rand(1, n, device="cuda", generator=g)
    lengths = torch.full((1,), n0 + 3, device="cuda", dtype=torch.int32)
    forward = WalkState()

    def call():
        forward.walk, forward.hops = w_prev, 1  # as after one sparse layer
        return m.decode(q[:, :, n0 + 2], k, v, lengths=lengths, state=state, context=CallContext(forward=forward),
                        check_finite=False)

    (_, stats), graph, (out, _) = warm_check_and_capture(call)
    assert stats.extra.get("selection") == "fused" and stats.walk_hops == 2
    outs, walks = [], []
    for i in range(3):  # 6462..6464 keys: the last one completes block 100
        lengths.fill_(n0 + 1 + i)
        graph.replay()
        outs.append(out.clone())
        walks.append(forward.walk.clone())
    for i in range(3):
        lengths.fill_(n0 + 1 + i)
        ref, _ = call()
        torch.testing.assert_close(outs[i], ref, atol=0, rtol=0)
        torch.testing.assert_close(walks[i], forward.walk, atol=0, rtol=0)


# -- variant=authors: the batched device decode ---------------------------------------------------------------


@pytest.mark.parametrize("seed,prompts", [(3, [64 * 150 + 37, 64 * 120]), (4, [64 * 40 + 63, 64 * 200 + 1])])
def test_authors_decode_replays_in_a_graph_without_host_reads_and_matches_the_reference(seed, prompts):
    """Two rows of different prompt lengths (Llama-3.1-8B heads, bf16, capacity 16k): no host read in a step
    (sync debug mode "error"), graph replays over 70 steps (blocks complete, the ring wraps) equal eager calls
    bit for bit, a replay at the first position after the prompts restarts, every step keeps the blocks the per-row
    reference keeps (up to a flip at a near tie) with outputs within bf16 rounding, and a step is at most eleven
    launches at degree 3."""
    from test_sketchwalk_authors_device import stacked_state

    from kvsieve import CallContext
    from kvsieve.methods.sketchwalk import authors

    cap, steps = 16384, 70
    (q, k, v), = _llama_layers(cap, 1, seed=seed)
    k, v = k.expand(2, -1, -1, -1).contiguous(), v.expand(2, -1, -1, -1).contiguous()
    q = torch.cat([q, q.roll(1, dims=2)])
    m = kvsieve.method("sketchwalk")
    cfg = m.config
    state = stacked_state(m, q, k, v, prompts)
    ref_states = [stacked_state(m, q[b:b + 1], k[b:b + 1], v[b:b + 1], [p]) for b, p in enumerate(prompts)]
    lengths = torch.tensor(prompts, device="cuda", dtype=torch.int32) + 1
    q_in = torch.empty(2, 32, 128, device="cuda", dtype=torch.bfloat16)

    def call():
        q_in.copy_(q[torch.arange(2, device="cuda"), :, lengths.long() - 1])
        return m.decode(q_in, k, v, lengths=lengths, state=state, context=CallContext(capacity=cap, count_reads=False),
                        check_finite=False)

    # the state is made in the warm-up; both warm-up calls are the first step (a restart the second time)
    (_, stats), graph, (out, _) = warm_check_and_capture(call)
    assert stats.extra["selection"] == "device-triton" and stats.backend == "triton"
    assert m.graph_capturable
    replayed, kept = [], []
    for i in range(steps):
        lengths.copy_(torch.tensor(prompts, device="cuda") + 1 + i)
        graph.replay()
        replayed.append(out.clone())
        kept.append(state.authors_device.last_step.kept_blocks.clone())
    for i in range(steps):  # eager from the restart again: the same bits
        lengths.copy_(torch.tensor(prompts, device="cuda") + 1 + i)
        eager, _ = call()
        torch.testing.assert_close(eager, replayed[i], atol=0, rtol=0)
    flips = 0
    for b, p in enumerate(prompts):
        st = ref_states[b].authors
        for i in range(steps):
            t = p + 1 + i
            r = authors.decode_row(st, 0, q[b, :, t - 1], k[b, :, :t], v[b, :, :t], block_size=cfg.block_size,
                                   beta=cfg.walk_damping, degree=cfg.degree, query_window=cfg.query_window,
                                   sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac,
                                   scale=128 ** -0.5, dtype=torch.float32)
            nb = r.kept_blocks.shape[0]
            step_flips = int((kept[i][b, :nb] != r.kept_blocks).sum())
            flips += step_flips
            if step_flips == 0:  # a flipped block changes the output by that block's share, beyond rounding
                torch.testing.assert_close(replayed[i][b].float(), r.out, atol=2e-2, rtol=2e-2,
                                           msg=lambda m, b=b, i=i: f"row {b}, step {i}: {m}")
    assert flips <= 2, flips
    # a layer's step: up to the attention 5 + degree Triton launches; two for it (a restart: the same work)
    from kvsieve.bench.timing import count_launches

    lengths.copy_(torch.tensor(prompts, device="cuda") + 1)
    launches = count_launches(lambda: m.decode(q_in, k, v, lengths=lengths, state=state, check_finite=False,
                                               context=CallContext(capacity=cap, count_reads=False)))
    assert launches is not None and launches <= 5 + cfg.degree + 2, launches


@pytest.mark.parametrize("seed", [0, 1])
def test_authors_block_row_follows_the_torch_step_over_rewinds_and_jumps(seed):
    """The compiled block row (the logit cache's step, at the default tiles and at tiles of 32 blocks) against the
    torch step from the same device state over 16 steps of two ragged rows at Llama-3.1-8B heads (a ring of 32, blocks
    of 64): row 0 rewinds to its prompt (a restart: the prompt's logits), row 1 skips 3 blocks ahead (each skipped
    block folds) and steps back across a block (the closed sums again from the cache); the block row and the
    state after every step within float32 rounding."""
    from test_sketchwalk_authors_device import block_row_follows_the_torch_step, rewinds_and_jumps, stacked_state

    from kvsieve.methods.sketchwalk.authors_device import AuthorsDeviceState

    n, prompts = 8192, [64 * 40 + 37, 64 * 25 + 63]
    (q, k, v), = _llama_layers(n, 1, seed=seed)
    k, v = k.expand(2, -1, -1, -1).contiguous(), v.expand(2, -1, -1, -1).contiguous()
    q = torch.cat([q, q.roll(1, dims=2)])
    m = kvsieve.method("sketchwalk")
    st = stacked_state(m, q, k, v, prompts).authors
    ref = AuthorsDeviceState.from_layer_state(st, k, torch.tensor(prompts, device="cuda") + 1, block_size=64,
                                              capacity=n)
    block_row_follows_the_torch_step(ref, q, k, rewinds_and_jumps(prompts, 16, skip=3 * 64 + 5, back=70), atol=1e-6,
                                     rtol=1e-4, block_l=32, block_n=32)
    assert ref.order_error.tolist() == [False, True]
