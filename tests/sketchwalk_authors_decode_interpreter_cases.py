"""variant=authors' batched decode on its Triton path, on the CPU through Triton's interpreter: the step's kernels
(``kernels/sketchwalk/authors_decode.py``) against their torch references on crafted states (restarts, new
blocks, a fresh state, an out-of-order row, ties at the quantile), the whole step against the per-row reference
``decode_row`` (the same kept blocks, ragged rows, bf16), and the sparse kernel's per-row dense prefix
(``sink_lengths``). Not collected on its own: ``tests/test_sketchwalk_authors_device.py`` runs this file in a
subprocess with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_sketchwalk_authors_device.py (needs TRITON_INTERPRET=1 before triton is "
                "imported)", allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

import copy  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from test_sketchwalk_authors_device import (  # noqa: E402
    assert_same_state,
    block_row_follows_the_torch_step,
    reference_rows,
    rewinds_and_jumps,
    stacked_state,
)
from test_sketchwalk_authors_device import data as rows_data  # noqa: E402

import kvsieve  # noqa: E402
from kvsieve.kernels.shared.weighted_triton import sparse_decode_reference, sparse_decode_triton  # noqa: E402
from kvsieve.kernels.sketchwalk import authors_decode as kd  # noqa: E402
from kvsieve.kernels.sketchwalk import authors_reference as kr  # noqa: E402
from kvsieve.kernels.sketchwalk import authors_walk as aw  # noqa: E402
from kvsieve.methods.sketchwalk.authors import sketch_matrix  # noqa: E402
from kvsieve.methods.sketchwalk.authors_device import max_kept_pages  # noqa: E402

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



@pytest.mark.parametrize("spec,shape,prompts,steps,dtype", [
    ("sketchwalk:block_size=16", (4, 2, 64), [150, 97, 128], 12, torch.float32),
    ("sketchwalk:block_size=16,query_window=5,window=0.1,sink=0.05,kblocks_frac=0.3,walk_damping=0.4", (8, 2, 64),
     [64, 81], 14, torch.bfloat16),
    ("sketchwalk:block_size=8,degree=1,query_window=3", (2, 1, 64), [40, 33, 8], 10, torch.float16),
])
def test_the_triton_step_keeps_the_blocks_of_decode_row(spec, shape, prompts, steps, dtype):
    """Ragged rows decoded together through the Triton step and the sparse kernel keep, step by step, exactly the
    blocks each row keeps alone through ``decode_row`` (blocks complete, the ring wraps), with its walk and output
    within rounding; the state ends where the torch step's does, and the page list is the host bound's."""
    hq, hkv, d = shape
    n = max(prompts) + steps + 5
    q, k, v = rows_data(len(prompts), hq, hkv, n, d, seed=len(prompts), dtype=dtype)
    ref = reference_rows(spec, q, k, v, prompts, steps)
    m, m_torch = kvsieve.method(spec + ",backend=triton"), kvsieve.method(spec)
    state, state_torch = stacked_state(m, q, k, v, prompts), stacked_state(m_torch, q, k, v, prompts)
    cfg = m.config
    bound = max_kept_pages(n, cfg.block_size, sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(steps):
        lengths = torch.tensor(prompts) + 1 + i
        qi = q[torch.arange(len(prompts)), :, lengths - 1]
        out, stats = m.decode(qi, k, v, lengths=lengths, state=state, context=kvsieve.CallContext(capacity=n))
        m_torch.decode(qi, k, v, lengths=lengths, state=state_torch, context=kvsieve.CallContext(capacity=n))
        assert stats.extra["selection"] == "device-triton" and stats.backend == "triton"
        step = state.authors_device.last_step
        assert torch.equal(step.pages, kr.page_list(step.kept_blocks, step.window_tokens, cfg.block_size, bound)[0])
        for b, rows in enumerate(ref):
            r = rows[i]
            nb = r.kept_blocks.shape[0]
            assert torch.equal(step.kept_blocks[b, :nb], r.kept_blocks), (i, b)
            assert not step.kept_blocks[b, nb:].any()
            torch.testing.assert_close(step.walk[b, :nb], r.walk, atol=1e-6, rtol=1e-4)
            torch.testing.assert_close(out[b].float(), r.out.float(), atol=tol, rtol=tol)
    got, want = state.authors_device, state_torch.authors_device
    for name in ("u", "sigma", "rsum", "qs", "ks", "ksum"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-6, rtol=1e-4, msg=name)
    for name in ("n_blocks", "n_queries", "last_pos", "order_error"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def with_logit_cache(st, scale):
    """``st`` with the logit cache of its ring and sketches (the blocks before its last step's closed) and the
    prompt's copies (the prompt's ring against its closed blocks)."""
    bs = st.block_size
    n_closed = torch.div(st.last_pos.clamp(min=0), bs, rounding_mode="floor")
    st.logits, st.closed_max, st.closed_sum = kr.logit_cache_reference(st.qs, st.ks, n_closed, scale)
    st.n_closed = n_closed[:, None].expand(-1, st.ks.shape[1]).contiguous()
    p_closed = torch.div(st.prompt_len.clamp(min=0), bs, rounding_mode="floor")
    st.p_logits, st.p_closed_max, st.p_closed_sum = kr.logit_cache_reference(st.p_qs, st.ks, p_closed, scale)
    st.logit_scale = scale
    return st


def crafted_state(seed, *, b=5, hq=4, hkv=2, w_len=5, d=64, cap=12, bs=8, hadamard_dim=12, scale=0.05):
    """A state of random contents (not one a decode would reach; the kernels' arithmetic does not care), its
    logit cache consistent with its ring and sketches."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    u = rand(b, cap, cap) ** 3
    return with_logit_cache(SimpleNamespace(
        phi=sketch_matrix(d, hadamard_dim, seed), u=u, sigma=1 / u.sum(-1) * (1 + 0.1 * rand(b, cap)), rsum=u.sum(-1),
        n_blocks=torch.tensor([8, 9, 6, 10, 7]), qs=torch.randn(b, hq, w_len, hadamard_dim, generator=g),
        n_queries=torch.tensor([5, 3, 5, 2, 5]), ksum=torch.randn(b, hkv, cap, d, generator=g),
        ks=torch.randn(b, hkv, cap, hadamard_dim, generator=g), last_pos=torch.tensor([60, 64, 46, 79, 40]),
        order_error=torch.tensor([False, False, False, True, False]), prompt_len=torch.tensor([58, 64, 45, -1, 48]),
        p_nblocks=torch.tensor([8, 8, 6, 0, 6]), p_row=rand(b, cap), p_col=rand(b, cap), p_rsum=rand(b, cap) + 0.5,
        p_qs=torch.randn(b, hq, w_len, hadamard_dim, generator=g), p_nq=torch.tensor([4, 5, 1, 0, 5]),
        p_kpart=torch.randn(b, hkv, d, generator=g), fresh_rows=False, block_size=bs), scale)


@pytest.mark.parametrize("seed,sketch_dim,block_m,block_l", [(0, 12, None, 8), (1, 12, None, 4), (2, 40, 16, 4),
                                                            (3, 40, None, 16)])
@pytest.mark.parametrize("fresh", [False, True])
def test_row_update_kernels_match_their_reference(seed, fresh, sketch_dim, block_m, block_l):
    """Row 0 restarts mid-block, row 1 restarts on a block boundary, row 2 continues its block, row 3 starts a
    new block (its order flag already set), row 4 jumps (sets it); ``fresh``: rows past the block count start as
    the block row. GQA, a sketch dim that is no power of two, bf16 queries and keys; the logits' dots over the
    sketch at once or in chunks of features (``block_m``, the last one partial), the logits' tiles of
    ``block_l`` blocks (several tiles, or one over the row)."""
    st = crafted_state(seed, hadamard_dim=sketch_dim)
    st.fresh_rows = fresh
    if fresh:
        st.n_blocks = torch.tensor([3, 0, 6, 10, 2])
    g = torch.Generator().manual_seed(seed + 7)
    q = torch.randn(5, 4, 64, generator=g).bfloat16()
    k = torch.randn(5, 2, 90, 64, generator=g).bfloat16()
    lengths = torch.tensor([59, 65, 48, 81, 44], dtype=torch.int32)
    want, got = copy.deepcopy(st), copy.deepcopy(st)
    r_want = kr.row_update_reference(want, q, k, lengths, scale=0.05)
    r_got = kd.row_update_triton(got, q, k, lengths, scale=0.05, block_n=16, block_m=block_m, block_l=block_l)
    torch.testing.assert_close(r_got, r_want, atol=1e-6, rtol=1e-5)
    assert not r_got[0, 8:].any() and not r_got[4, 6:].any()
    assert not got.fresh_rows
    assert_same_state(got, want, lengths)
    assert got.order_error.tolist() == [False, False, False, True, True]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_walk_select_kernels_match_their_reference(seed):
    """The walk's hops over one or several row splits and the selection: rows with ties at the quantile (β = 0: the
    walk is the block row) and a row too short for any candidate block; walks within rounding, the rest exactly."""
    st = crafted_state(seed, b=5, cap=40)
    g = torch.Generator().manual_seed(seed + 3)
    lengths = torch.tensor([317, 200, 9, 160, 41], dtype=torch.int32)  # 40, 25, 2, 20, 6 blocks of 8
    n = (lengths.long() - 1) // 8 + 1
    r = torch.rand(5, 40, generator=g) ** 4
    r[1] = r[1].round(decimals=1)  # exact ties
    r[3] = (r[3] * 4).floor() / 4
    r = torch.where(torch.arange(40) < n[:, None], r, 0.0)
    r = r / r.sum(-1, keepdim=True)
    for beta, degree, splits in ((0.0, 3, 3), (0.0, 1, 1), (0.25, 3, 2), (0.6, 1, 1), (0.3, 2, None)):
        kw = dict(beta=beta, degree=degree, sink=0.04, window=0.1, q=0.8, max_pages=30)
        want = kr.walk_select_reference(st, r, lengths, **kw)
        got = aw.walk_select_triton(st, r, lengths, splits=splits, **kw)
        torch.testing.assert_close(got["walk"], want["walk"], atol=1e-7, rtol=1e-5)
        for name in ("kept", "pages", "counts", "window_tokens", "n", "short"):
            assert torch.equal(got[name].to(want[name].dtype), want[name]), (name, beta)
        assert want["short"][2] and not want["short"][0]


def layer_calls(m, prompts=(150, 97)):
    """Two steps of a layer of two rows (the first call makes the state)."""
    q, k, v = rows_data(2, 8, 2, 200, 64, seed=5, dtype=torch.bfloat16)
    state = stacked_state(m, q, k, v, list(prompts))
    ctx = kvsieve.CallContext(capacity=200, count_reads=False)
    calls = []
    for i in (1, 2):
        lengths = torch.tensor(prompts, dtype=torch.int32) + i
        q_i = q[torch.arange(2), :, lengths.long() - 1].contiguous()
        calls.append(lambda q_i=q_i, lengths=lengths: m.decode(q_i, k, v, lengths=lengths, state=state, context=ctx,
                                                               check_finite=False))
    return calls


def test_a_layer_step_is_five_launches_plus_the_hops_plus_the_attention():
    """The step up to the attention is 5 + degree Triton launches (the state's step, the logit cache's step, the
    probabilities' tiles and the row's tail, the hops, the selection) and no torch op; the attention two (its
    splits, then their merge); no other torch op runs on the device path but the CPU's order check (``any`` and
    its host read; on CUDA it is not made)."""
    from kvsieve.bench.timing import count_dispatched

    m = kvsieve.method("sketchwalk:block_size=16,sink=0.01,window=0.02,kblocks_frac=0.0625,backend=triton")
    calls = layer_calls(m)
    calls[0]()
    got = count_dispatched(calls[1])
    assert got["triton_launches"] == 5 + m.config.degree + 2, got
    assert set(got["ops"]) <= {"any.default"}, got
    assert got["host_reads"] <= 1, got


def test_rows_past_the_kernels_width_take_the_torch_step(monkeypatch):
    """Rows of more blocks than the kernels hold (``MAX_BLOCKS``, here 8 against 13 blocks of 16): the torch step
    selects (no Triton launch but the attention's two), its pages the same as the kernels' step."""
    from kvsieve.bench.timing import count_dispatched

    spec = "sketchwalk:block_size=16,sink=0.01,window=0.02,kblocks_frac=0.0625,backend=triton"
    want = layer_calls(kvsieve.method(spec))
    want[0]()
    out_want, stats_want = want[1]()
    monkeypatch.setattr(aw, "MAX_BLOCKS", 8)
    calls = layer_calls(kvsieve.method(spec))
    calls[0]()
    seen = []
    got = count_dispatched(lambda: seen.append(calls[1]()))
    assert got["triton_launches"] == 2, got
    out, stats = seen[0]
    assert stats.extra["selection"] == "device" and stats_want.extra["selection"] == "device-triton"
    torch.testing.assert_close(out, out_want, atol=2e-2, rtol=2e-2)
    assert stats["blocks_kept"] == stats_want["blocks_kept"] > 0


@pytest.mark.parametrize("seed,prompted,ring,block_l", [(0, True, 3, 4), (1, True, 12, 16), (2, False, 12, 4)])
def test_the_block_row_follows_the_reference_over_steps(seed, prompted, ring, block_l):
    """The logit cache's step (tiles of ``block_l`` blocks, and the default tiles) against the torch step over
    many steps of ragged rows from a recorded prompt (or none: a fresh state): blocks of 4 keys (block
    boundaries), a ring of 3 or 12 queries (it wraps; 36 ring rows a KV head take two programs of the logits'
    launch, one more than its tiles of ``block_l`` blocks), groups of 3 query heads; row 0 rewinds to its prompt
    (a restart), row 1 skips 6 positions ahead (3 blocks: every skipped block folds) and later steps 3 back (the
    closed sums again over fewer blocks), both out of order. The block row and the whole state after every step."""
    from kvsieve.methods.sketchwalk.authors import AuthorsLayerState
    from kvsieve.methods.sketchwalk.authors_device import AuthorsDeviceState

    spec = f"sketchwalk:block_size=4,query_window={ring}"
    prompts = [21, 14, 9 + seed]
    n = 64
    q, k, v = data(3, 6, 2, n, 64, seed, torch.float32)
    m = kvsieve.method(spec)
    if prompted:
        st = stacked_state(m, q, k, v, prompts).authors
    else:
        phi = stacked_state(m, q, k, v, prompts).authors.phi
        st = AuthorsLayerState.fresh(phi, 3, 6, ring, torch.float32)
    ref = AuthorsDeviceState.from_layer_state(st, k, torch.tensor(prompts) + 1, block_size=4, capacity=n)
    block_row_follows_the_torch_step(ref, q, k, rewinds_and_jumps(prompts, 16, skip=6, back=3), atol=1e-6, rtol=1e-5,
                                block_l=block_l, block_n=8, partial_chunk=2)
    assert ref.order_error.tolist() == [not prompted, True, False]  # without a prompt a rewind is out of order
