"""variant=authors' step, second half (``kernels/sketchwalk/authors_walk.py``), on the CPU through Triton's interpreter:
the tail, the hops and the selection against the torch references over several steps from random states
(restarts mid-block and on a block boundary, new blocks, fresh rows, ragged rows, rows reaching the capacity),
the hops over one or several row splits and column tiles. Not collected on its own:
``tests/test_sketchwalk_authors_walk.py`` runs this file in a subprocess with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_sketchwalk_authors_walk.py (needs TRITON_INTERPRET=1 before triton is "
                "imported)", allow_module_level=True)

import torch  # noqa: E402

pytest.importorskip("triton")

import copy  # noqa: E402

from sketchwalk_authors_decode_interpreter_cases import crafted_state, with_logit_cache  # noqa: E402

from kvsieve.kernels.sketchwalk import authors_decode as kd  # noqa: E402
from kvsieve.kernels.sketchwalk import authors_reference as kr  # noqa: E402
from kvsieve.kernels.sketchwalk import authors_walk as aw  # noqa: E402

pytestmark = pytest.mark.triton

STATE = ("u", "sigma", "rsum", "qs", "ks", "ksum")
COUNTERS = ("n_blocks", "n_queries", "last_pos", "order_error")


def assert_same_state(got, want, msg=""):
    for name in STATE:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-6, rtol=1e-5,
                                   msg=f"{msg} {name}")
    for name in COUNTERS:
        assert torch.equal(getattr(got, name), getattr(want, name)), (msg, name)


def step_inputs(seed, b, hq, hkv, n_keys, d=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, d, generator=g).bfloat16(), torch.randn(b, hkv, n_keys, d, generator=g).bfloat16()


def prompt_from_u(st):
    """``st`` with the prompt's copies taken from its U (row and column n0 − 1, the row sums), as a prompt's state
    would have them: crafted_state's random copies make the row sums after a restart disagree with U, and a few
    steps later the scales overflow (in the reference too)."""
    rows = torch.arange(st.u.shape[0])
    n0i = (st.p_nblocks - 1).clamp(min=0)
    st.p_row, st.p_col, st.p_rsum = st.u[rows, n0i].clone(), st.u[rows, :, n0i].clone(), st.u.sum(-1)
    st.sigma = 1 / st.rsum
    return st


def no_prompt_after(st, row):
    """``st`` with ``row``'s prompt gone (its logit cache remade): crafted_state gives row 4 a prompt that ends
    after its last key, which no decode reaches; over several steps it would restart from the prompt's logit copies
    after its own steps rewrote a block before the prompt's end, while the reference reads the blocks as they are
    now."""
    st.prompt_len[row], st.p_nblocks[row], st.p_nq[row] = -1, 0, 0
    return with_logit_cache(st, st.logit_scale)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("fresh", [False, True])
def test_the_tail_follows_the_reference_over_steps(seed, fresh):
    """Eleven steps of five ragged rows of 8-key blocks (crafted_state: row 0 restarts mid-block, row 1 on a block
    boundary so that its block c is new and its restart row is another, row 2 continues, row 3 has no prompt and
    starts a block, row 4 jumps), crossing block boundaries; ``fresh``: rows past the block count start as the
    block row. The state after each step within rounding of the reference, the counters exactly."""
    st = no_prompt_after(prompt_from_u(crafted_state(seed)), 4)
    st.fresh_rows = fresh
    if fresh:
        st.n_blocks = torch.tensor([3, 0, 6, 10, 2])
    want, got = copy.deepcopy(st), copy.deepcopy(st)
    lengths = torch.tensor([59, 65, 48, 81, 44], dtype=torch.int32)
    for i in range(11):
        q, k = step_inputs(seed * 100 + i, 5, 4, 2, 96)
        r_want = kr.row_update_reference(want, q, k, lengths, scale=0.05)
        r_got = kd.row_update_triton(got, q, k, lengths, scale=0.05, block_n=16)
        torch.testing.assert_close(r_got, r_want, atol=1e-6, rtol=1e-5)
        assert want.sigma.isfinite().all()
        assert_same_state(got, want, f"step {i}")
        lengths = lengths + 1


@pytest.mark.parametrize("seed", [3, 4])
def test_the_tail_at_the_capacity(seed):
    """A capacity of 16 blocks (the registers tail's whole width, no masked lanes): a row at the last key the state
    holds, rows starting a block (one of them the capacity's last), a restart whose restart row is block c, a row
    in its first block, equal to the reference."""
    st = crafted_state(seed, cap=16, scale=0.1)
    st.n_blocks = torch.tensor([15, 16, 9, 12, 1])
    st.prompt_len = torch.tensor([-1, -1, 70, -1, -1])
    st.p_nblocks = torch.tensor([0, 0, 9, 0, 0])
    st.last_pos = torch.tensor([119, 126, 60, 95, 6])
    st = with_logit_cache(st, 0.1)
    lengths = torch.tensor([121, 128, 71, 97, 8], dtype=torch.int32)  # blocks c = 15, 15, 8, 12, 0
    q, k = step_inputs(seed, 5, 4, 2, 136)
    want = copy.deepcopy(st)
    r_want = kr.row_update_reference(want, q, k, lengths, scale=0.1)
    got = copy.deepcopy(st)
    r_got = kd.row_update_triton(got, q, k, lengths, scale=0.1, block_n=16)
    torch.testing.assert_close(r_got, r_want, atol=1e-6, rtol=1e-5)
    assert_same_state(got, want)


def walk_rows(seed, b=5, cap=40):
    """A crafted state and a normalised block row with exact ties at the quantile (rows 1 and 3), a row too short
    for any candidate (row 2)."""
    st = crafted_state(seed, b=b, cap=cap)
    g = torch.Generator().manual_seed(seed + 3)
    lengths = torch.tensor([317, 200, 9, 160, 41], dtype=torch.int32)[:b]  # 40, 25, 2, 20, 6 blocks of 8
    n = (lengths.long() - 1) // 8 + 1
    r = torch.rand(b, cap, generator=g) ** 4
    r[1] = r[1].round(decimals=1)
    r[3] = (r[3] * 4).floor() / 4
    r = torch.where(torch.arange(cap) < n[:, None], r, 0.0)
    return st, r / r.sum(-1, keepdim=True), lengths


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("q,max_pages", [(0.8, 30), (0.5, 3), (0.9375, 100)])
def test_the_selection_equals_the_reference(seed, q, max_pages):
    """The hops and the selection against the reference: ties (β = 0: the walk is the block row), page lists cut
    at a small bound and a bound past the row's width, the hops in two splits of one step (read early) or one
    split of two steps; the walk within rounding, the rest exactly."""
    st, r, lengths = walk_rows(seed)
    for beta, degree, splits in ((0.0, 2, 2), (0.3, 3, None), (0.7, 1, 1)):
        kw = dict(beta=beta, degree=degree, sink=0.04, window=0.1, q=q, max_pages=max_pages)
        want = kr.walk_select_reference(st, r, lengths, **kw)
        got = aw.walk_select_triton(st, r, lengths, splits=splits, **kw)
        torch.testing.assert_close(got["walk"], want["walk"], atol=1e-7, rtol=1e-5)
        for name in ("kept", "pages", "counts", "window_tokens", "n", "short"):
            assert torch.equal(got[name].to(want[name].dtype), want[name]), (name, beta, splits)


@pytest.mark.parametrize("seed,cap", [(0, 64), (1, 160)])
def test_the_selection_keeps_the_reference_blocks_on_random_walks(seed, cap):
    """Random walks without ties over many rows of different lengths (every quantile rank's fraction): the kernels
    keep exactly the reference's blocks, the hops over one column tile or two (160 blocks: the second one partly
    masked), in one split (several steps of rows, the last one partly masked), in splits of one step (read
    early) or in the default splits."""
    g = torch.Generator().manual_seed(seed)
    b = 12
    st = crafted_state(seed, b=5, cap=cap)
    st.sigma = torch.rand(b, cap, generator=g) + 0.5
    st.u = torch.rand(b, cap, cap, generator=g)
    lengths = torch.randint(8, cap * 8 + 1, (b,), generator=g, dtype=torch.int32)
    r = torch.rand(b, cap, generator=g)
    n = (lengths.long() - 1) // 8 + 1
    r = torch.where(torch.arange(cap) < n[:, None], r, 0.0)
    r = r / r.sum(-1, keepdim=True)
    for q in (0.3, 0.77, 0.99):
        kw = dict(beta=0.5, degree=2, sink=0.02, window=0.05, q=q, max_pages=cap)
        want = kr.walk_select_reference(st, r, lengths, **kw)
        for splits in (None, 1, cap // aw.HOP_ROWS):
            got = aw.walk_select_triton(st, r, lengths, splits=splits, **kw)
            torch.testing.assert_close(got["walk"], want["walk"], atol=1e-7, rtol=1e-5)
            for name in ("kept", "pages", "counts"):
                assert torch.equal(got[name].to(want[name].dtype), want[name]), (name, q, splits)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fresh", [False, True])
def test_the_first_hop_reads_again_what_the_tail_rewrote(seed, fresh):
    """The first hop, its split one step (EARLY), loads its tile before the tail has finished: given U as it was
    before the tail for those loads, the walk still equals the reference's on U after the tail over four steps
    (restarts mid-block and on a block boundary, new blocks): the rows and columns the tail rewrites are read again
    after the wait. A step that starts fresh rows (rewritten whole) loads after the wait. The U before differs: the
    test would catch an entry not read again."""
    st = no_prompt_after(prompt_from_u(crafted_state(seed)), 4)
    st.fresh_rows = fresh
    if fresh:
        st.n_blocks = torch.tensor([3, 0, 6, 10, 2])
    lengths = torch.tensor([59, 65, 48, 81, 44], dtype=torch.int32)
    kw = dict(beta=0.5, degree=2, sink=0.04, window=0.1, q=0.6, max_pages=12)
    for i in range(4):
        q, k = step_inputs(seed * 10 + i, 5, 4, 2, 96)
        before = st.u.clone()
        r = kd.row_update_triton(st, q, k, lengths, scale=0.05, block_n=16)
        want = kr.walk_select_reference(st, r, lengths, **kw)
        stale = copy.copy(st)
        stale.u = before
        assert not torch.allclose(kr.walk_select_reference(stale, r, lengths, **kw)["walk"], want["walk"])
        got = aw.walk_select_triton(st, r.clone(), lengths, splits=1, u_before=before, **kw)
        torch.testing.assert_close(got["walk"], want["walk"], atol=1e-7, rtol=1e-5)
        assert torch.equal(got["kept"], want["kept"])
        lengths = lengths + 1
