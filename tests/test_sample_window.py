"""The uniform sample's windowed cut (``sample_triton``: a scan spread over the row counts the keys below a
hash window and appends those inside it to the row's list, one program per row finds the cut among them, a
third launch writes the list) draws the very keys of the one-program select (the list's other way) and of
the torch reference, on
the CPU through Triton's interpreter (a subprocess: the interpreter is chosen when triton is imported), and
at decode sizes on the GPU."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_script

WINDOW = """
import torch
from kvsieve.core.rng import RandomKey, RowStreams
from kvsieve.kernels.shared import sample_triton as st
from kvsieve.kernels.vattention.attend_triton import in_sample_reference

g = torch.Generator().manual_seed({seed})
# (rows, heads, keys, sizes, block, page, cand_block, sigmas): small, empty, whole, over-full and large samples;
# the window path (cand_block None), its fallback to every key (a window wider than cand_block, or one that
# misses the cut: sigmas 0 keeps 16 keys of margin), pages of excluded keys
cases = [(2, 3, 300, [30, 5, 0], 32, 1, None, 6.0), (1, 2, 3000, [1500, 2999], 64, 1, None, 6.0),
         (3, 2, 700, [1000, 1], 32, 16, None, 6.0), (1, 2, 2000, [900, 40], 64, 1, 16, 6.0),
         (2, 2, 2000, [1000, 700], 64, 16, None, 0.0), (1, 1, 4000, [100], 128, 1, None, 6.0)]
for r, hs, n, sizes, block, page, cb, sigmas in cases:
    st.WINDOW_SIGMAS = sigmas
    rs = RowStreams(RandomKey({seed}, (1, 2)), torch.arange(r), torch.full((r,), n))
    start = torch.tensor([4, 10, 0][:r])
    end = torch.tensor([n - 8, n - 100, 5][:r])
    p = torch.arange(n)
    excl = torch.rand(r, hs, -(-n // page), generator=g) < 0.2
    avail = ((p >= start[:, None]) & (p < end[:, None]))[:, None] & ~excl[:, :, p // page]
    nav = avail.sum(-1)
    size = torch.tensor(sizes).repeat(r, 1)[:, :hs] + torch.randint(0, 3, (r, hs), generator=g)
    take = torch.minimum(size, nav)
    kw = dict(excluded=excl, page=page, block=block, cand_block=cb)
    ref = st.sample_rows_reference(rs.lo, rs.hi, 9, start, end, take, n + 5, n, excl, page)
    for window in (True, False):
        idx, w = st.sample_rows_triton(rs.lo, rs.hi, 9, start, end, size, nav, n + 5, n, window=window, **kw)
        assert torch.equal(idx, ref), (window, r, hs, n, sizes, cb, sigmas)
        used = torch.arange(n + 5) < take[..., None]
        want_w = torch.where(used, nav[..., None].double() / take.clamp(min=1)[..., None].double(), 1.0)
        assert torch.equal(w, want_w), (window, r, hs, n, sizes)
    if page == 1:
        cut = st.sample_cut_triton(rs.lo, rs.hi, 9, start, end, size, nav, n, **kw)
        got = in_sample_reference(rs.lo, rs.hi, 9, start, end, excl, cut[0], cut[1], n)
        assert torch.equal(got.sum(-1), take)
        mark = torch.zeros(r, hs, n + 6, dtype=torch.bool).scatter_(2, torch.where(used, ref, n + 5), True)[..., :n]
        assert torch.equal(got, mark), (r, hs, n, sizes)
# from an offset, without the fill: the columns before the offset and after the sample keep what they held
st.WINDOW_SIGMAS = 6.0
rs = RowStreams(RandomKey({seed}), torch.arange(1), torch.tensor([200]))
size, nav = torch.tensor([[10, 20]]), torch.tensor([[100, 100]])
plain, _ = st.sample_rows_triton(rs.lo, rs.hi, 4, torch.tensor([50]), torch.tensor([150]), size, nav, 40, 200,
                                 window=False)
for fill in (True, False):
    out = torch.full((1, 2, 40), -7, dtype=torch.int64)
    wts = torch.full((1, 2, 40), -7.0, dtype=torch.float64)
    st.sample_rows_triton(rs.lo, rs.hi, 4, torch.tensor([50]), torch.tensor([150]), size, nav, 40, 200,
                          offset=torch.tensor([[3, 0]]), out=out, weights=wts, fill=fill, window=True, block=16,
                          target_programs=64)
    assert bool((out[0, 0, :3] == -7).all()) and torch.equal(out[0, 0, 3:13], plain[0, 0, :10])
    assert torch.equal(out[0, 1, :20], plain[0, 1, :20]) and bool((wts[0, 0, 3:13] == 10.0).all())
    tail = out[0, 0, 13:], wts[0, 0, 13:], out[0, 1, 20:]
    if fill:
        assert bool((tail[0] == 0).all()) and bool((tail[1] == 1.0).all()) and bool((tail[2] == 0).all())
    else:
        assert bool((tail[0] == -7).all()) and bool((tail[1] == -7.0).all()) and bool((tail[2] == -7).all())
print("OK")
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_windowed_cut_draws_the_reference_sample(seed):
    """The list (windowed or one program per row) and the cut equal ``sample_rows_reference`` (the keys of smallest
    hash, ties to the lowest positions) on small, empty, whole, over-full and large samples, with pages excluded,
    through the window and through its fallback (window too wide for the registers, or missing the cut)."""
    pytest.importorskip("triton")
    assert "OK" in run_script(WINDOW, "cpu", True, seed=seed)


TIE = """
import torch
import triton
import triton.language as tl
from kvsieve.kernels.shared.sample_triton import tie_position

@triton.jit
def tie_kernel(p_ptr, eq_ptr, at, out_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(out_ptr, tie_position(tl.load(eq_ptr + o) != 0, tl.load(p_ptr + o), at))

g = torch.Generator().manual_seed(0)
out = torch.zeros(1, dtype=torch.int32)
for n_eq in (1, 2, 3, 7, 64):
    for _ in range(3):
        p = torch.randperm(1 << 22, generator=g)[:64].to(torch.int32)
        eq = torch.zeros(64, dtype=torch.int8)
        eq[torch.randperm(64, generator=g)[:n_eq]] = 1
        chosen = p[eq.bool()].sort().values
        for at in range(1, n_eq + 1):
            tie_kernel[(1,)](p, eq, at, out, N=64)
            assert int(out) == int(chosen[at - 1]), (n_eq, at, int(out), chosen.tolist())
print("OK")
"""


def test_tie_position_is_the_at_th_lowest_position():
    """Several keys sharing the cut's hash (about one row in a hundred at 128k keys): the sample takes the
    lowest positions, so its last one is the ``at``-th lowest of them."""
    pytest.importorskip("triton")
    assert "OK" in run_script(TIE, "cpu", True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("r,n", [(1, 131072), (8, 32768)])
def test_windowed_cut_and_split_select_at_decode_sizes_on_the_gpu(r, n):
    """vAttention's sizes on the GPU (32 heads; a residual sample of about half the keys, a base sample and
    a top-k of 2.5 %): the list, windowed or one program per row, equals the reference, and the cut holds
    its keys; the split top-k merged by a launch equals the ticket's and the reference's."""
    from kvsieve.core.rng import RandomKey, RowStreams
    from kvsieve.kernels.shared import sample_triton as st
    from kvsieve.kernels.shared.select_triton import GROUP_MAX, topk_rows_reference, topk_rows_triton
    from kvsieve.kernels.vattention.attend_triton import in_sample_reference

    dev, hs = "cuda", 32
    g = torch.Generator(device=dev).manual_seed(n)
    rs = RowStreams(RandomKey(5, (1,)), torch.arange(r, device=dev), torch.full((r,), n, device=dev))
    start, end = torch.full((r,), 128, device=dev), torch.full((r,), n - 128, device=dev)
    excl = torch.rand(r, hs, n, generator=g, device=dev) < 0.025
    p = torch.arange(n, device=dev)
    nav = (((p >= start[:, None]) & (p < end[:, None]))[:, None] & ~excl).sum(-1)
    for frac in (0.5, 0.025, 0.97):
        size = (nav.double() * (frac + 0.02 * torch.rand(r, hs, generator=g, device=dev, dtype=torch.float64))).long()
        size = torch.minimum(size, nav)
        ref = st.sample_rows_reference(rs.lo, rs.hi, 4, start, end, size, n, n, excl)
        for window in (True, False):
            idx, _ = st.sample_rows_triton(rs.lo, rs.hi, 4, start, end, size, nav, n, n, excluded=excl, window=window)
            assert torch.equal(idx, ref), (frac, window)
        cut = st.sample_cut_triton(rs.lo, rs.hi, 4, start, end, size, nav, n, excluded=excl)
        got = in_sample_reference(rs.lo, rs.hi, 4, start, end, excl, cut[0], cut[1], n)
        used = torch.arange(n, device=dev) < size[..., None]
        mark = torch.zeros(r, hs, n + 1, dtype=torch.bool, device=dev)
        mark = mark.scatter_(2, torch.where(used, ref, n), True)[..., :n]
        assert torch.equal(got, mark), frac
    s = torch.randn(r, hs, n, generator=g, device=dev) * 2
    s[..., :128] = float("-inf")
    counts = torch.full((r,), n // 40, device=dev)
    maxima = s.view(r, hs, -1, GROUP_MAX).amax(-1).contiguous()
    want = topk_rows_reference(s, counts, n // 40)
    for merge in ("ticket", "launch"):
        for _ in range(2):
            assert torch.equal(topk_rows_triton(s, counts, n // 40, maxima=maxima, merge=merge), want), merge
