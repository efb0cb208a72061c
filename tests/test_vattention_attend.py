"""vAttention's tested-key attention pass (``kernels/vattention/attend_triton.py``) and the sample's cut
(``sample_triton.sample_cut_triton``), on the CPU through Triton's interpreter (a subprocess: the
interpreter is chosen when triton is imported). The method's kernel path through them is compared with
the reference in ``tests/test_sampling_kernel_paths.py`` (same keys, same budgets, same estimate)."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_script

CUT = """
import torch
from kvsieve.core.rng import STREAM_SUBSET2, RandomKey, RowStreams
from kvsieve.kernels.shared.sample_triton import sample_cut_triton, sample_rows_reference, sample_rows_triton
from kvsieve.kernels.vattention.attend_triton import in_sample_reference

g = torch.Generator().manual_seed(0)
# sizes: small, 0, the whole range, more than available, a long list (the radix passes: the interpreter keeps
# 256 candidates in registers), and the split scan (block 64)
for r, hs, n, sizes, block in [(2, 3, 300, [30, 5, 0], None), (1, 2, 3000, [600, 2999], None),
                               (3, 2, 700, [1000, 1], None), (1, 1, 5000, [4000], None),
                               (1, 2, 3000, [1500, 200], 64)]:
    rs = RowStreams(RandomKey(3, (1, 2)), torch.arange(r), torch.full((r,), n))
    start = torch.tensor([4, 10, 0][:r])
    end = torch.tensor([n - 8, n - 100, 5][:r])
    excl = torch.rand(r, hs, n, generator=g) < 0.1
    p = torch.arange(n)
    nav = (((p >= start[:, None]) & (p < end[:, None]))[:, None] & ~excl).sum(-1)
    size = torch.minimum(torch.tensor(sizes).repeat(r, 1)[:, :hs], nav)
    kw = {{}} if block is None else {{"block": block}}
    cut = sample_cut_triton(rs.lo, rs.hi, STREAM_SUBSET2, start, end, size, nav, n, excluded=excl, **kw)
    got = in_sample_reference(rs.lo, rs.hi, STREAM_SUBSET2, start, end, excl, cut[0], cut[1], n)
    ref = sample_rows_reference(rs.lo, rs.hi, STREAM_SUBSET2, start, end, size, n, n, excluded=excl)
    used = torch.arange(n) < size[..., None]
    mark = torch.zeros(r, hs, n + 1, dtype=torch.bool).scatter_(2, torch.where(used, ref, n), True)[..., :n]
    assert torch.equal(got, mark), (r, hs, n, sizes, int((got != mark).sum()))
    assert torch.equal(got.sum(-1), size)
    listed, _ = sample_rows_triton(rs.lo, rs.hi, STREAM_SUBSET2, start, end, size, nav, n, n, excluded=excl, **kw)
    assert torch.equal(torch.where(used, listed, 0), torch.where(used, ref, 0)), (r, hs, n, sizes)
print("OK")
"""

ATTEND = """
import torch
from kvsieve.core.rng import STREAM_SUBSET2, RandomKey, RowStreams
from kvsieve.kernels.shared.sample_triton import sample_cut_triton
from kvsieve.kernels.shared.scores import scores_reference
from kvsieve.kernels.vattention.attend_triton import attend_reference, attend_triton, in_sample_reference

g = torch.Generator().manual_seed(1)
worst = 0.0
for r, hq, hkv, n, d, sink, window, dtype in [(2, 8, 2, 300, 64, 4, 8, torch.float32),
                                              (1, 4, 1, 700, 128, 16, 32, torch.bfloat16),
                                              (2, 4, 4, 200, 64, 0, 0, torch.float32),
                                              (1, 6, 2, 257, 64, 4, 8, torch.bfloat16)]:
    q = (torch.randn(r, hq, d, generator=g) * 2).to(dtype)
    k = torch.randn(r, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(r, hkv, n, d, generator=g).to(dtype)
    lens = torch.tensor([n, n // 2 + 7][:r], dtype=torch.int32)
    scale = d ** -0.5
    scores = scores_reference(q, k, lens, sink, window, scale)
    sink_end = torch.clamp(lens.long(), max=sink)
    win = torch.maximum(lens.long() - window, sink_end)
    p = torch.arange(n)
    mid = (p >= sink_end[:, None]) & (p < win[:, None])
    excl = (torch.rand(r, hq, n, generator=g) < 0.05) & mid[:, None]
    n_s = (mid[:, None] & ~excl).sum(-1)
    size = torch.minimum(torch.randint(0, n, (r, hq), generator=g), n_s)
    size[0, 0] = n_s[0, 0]  # the whole residual, weight 1
    rs = RowStreams(RandomKey(5, (2,)), torch.arange(r), lens.long())
    cut = sample_cut_triton(rs.lo, rs.hi, STREAM_SUBSET2, sink_end, win, size, n_s, n, excluded=excl)
    samp = in_sample_reference(rs.lo, rs.hi, STREAM_SUBSET2, sink_end, win, excl, cut[0], cut[1], n)
    ref = attend_reference(q, k, v, lens, sink, window, scale, scores, excl, samp, n_s, size)
    # launch settings (the same estimate): the default, other blocks, warps, stages and programs (the last two as
    # vattention_stages.py's b32-s3-6/sm and b32-s4-6/sm on 132 SMs)
    for opts in ({{}}, {{"block_n": 64, "programs": 528}}, {{"block_n": 128, "programs": 7}},
                 {{"block_n": 32, "num_warps": 8, "num_stages": 2, "programs": 1000}},
                 {{"block_n": 32, "programs": 792}}, {{"block_n": 32, "num_stages": 4, "programs": 792}}):
        out = attend_triton(q, k, v, lens, sink, window, scale, scores, excl, rs.lo, rs.hi, STREAM_SUBSET2, cut[0],
                            cut[1], n_s, size, **opts)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        worst = max(worst, err)
        assert err < (2e-5 if dtype == torch.float32 else 1.2e-2), (r, hq, hkv, n, dtype, opts, err)
print("OK", worst)
"""


# vattention_stages.py's launch settings at the Llama-3.1-8B shape (programs per SM as there), on the GPU, where
# 16-key blocks once gave estimates 1.3-2.0 off the reference (they are refused now; see the test below)
ATTEND_SETTINGS_GPU = """
import torch
from kvsieve.core.rng import STREAM_SUBSET2, RandomKey, RowStreams
from kvsieve.kernels.shared.sample_triton import sample_cut_triton
from kvsieve.kernels.shared.scores import scores_reference
from kvsieve.kernels.shared.select_common import sm_count
from kvsieve.kernels.vattention.attend_triton import attend_reference, attend_triton, in_sample_reference

dev = torch.device("{device}")
sms = sm_count(dev)
settings = {{"default": {{}}, "b64-4/sm": {{"block_n": 64, "programs": 4 * sms}},
            "b32-s4-4/sm": {{"num_stages": 4, "programs": 4 * sms}}, "b32-s3-6/sm": {{"programs": 6 * sms}},
            "b32-s4-5/sm": {{"num_stages": 4}}}}
g = torch.Generator(device=dev).manual_seed(3)
bad = []
# groups of 4 (Llama-3.1-8B), 2 and 1: at G <= 2 a block of BLOCK_H x 32 keys is fewer values than 4 warps' threads
for r, hq, hkv, n, sink, window in [(1, 32, 8, 131072, 128, 128), (2, 32, 8, 20000, 128, 128), (2, 8, 2, 3000, 4, 8),
                                    (2, 8, 4, 3000, 4, 8), (1, 8, 8, 5000, 16, 32)]:
    q = (torch.randn(r, hq, 128, device=dev, generator=g) * 2).to(torch.bfloat16)
    k = torch.randn(r, hkv, n, 128, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(r, hkv, n, 128, device=dev, generator=g).to(torch.bfloat16)
    lens = torch.tensor([n, n // 2 + 7][:r], dtype=torch.int32, device=dev)
    scale = 128 ** -0.5
    scores = scores_reference(q, k, lens, sink, window, scale)
    sink_end = torch.clamp(lens.long(), max=sink)
    win = torch.maximum(lens.long() - window, sink_end)
    p = torch.arange(n, device=dev)
    mid = (p >= sink_end[:, None]) & (p < win[:, None])
    excl = (torch.rand(r, hq, n, device=dev, generator=g) < 0.025) & mid[:, None]
    n_s = (mid[:, None] & ~excl).sum(-1)
    size = (n_s.double() * torch.rand(r, hq, device=dev, generator=g, dtype=torch.float64)).long()
    rs = RowStreams(RandomKey(5, (2,)), torch.arange(r, device=dev), lens.long())
    cut = sample_cut_triton(rs.lo, rs.hi, STREAM_SUBSET2, sink_end, win, size, n_s, n, excluded=excl)
    samp = in_sample_reference(rs.lo, rs.hi, STREAM_SUBSET2, sink_end, win, excl, cut[0], cut[1], n)
    ref = attend_reference(q, k, v, lens, sink, window, scale, scores, excl, samp, n_s, size).float()
    for name, opts in settings.items():
        out = attend_triton(q, k, v, lens, sink, window, scale, scores, excl, rs.lo, rs.hi, STREAM_SUBSET2, cut[0],
                            cut[1], n_s, size, **opts).float()
        err = float((out - ref).norm() / ref.norm())
        print(f"G={{hq // hkv}} n={{n}} {{name}}: {{err:.2e}}")
        if not err < 1.2e-2:
            bad.append((hq // hkv, n, name, err))
assert not bad, bad
print("OK")
"""


def test_sample_cut_is_the_listed_sample():
    """The residual sample as a cut (hash below ``cut``, ties to the lowest positions up to ``tie``) holds
    exactly the keys the list and its torch reference hold: small, empty, whole and long samples (the
    radix passes), one program per row or a split scan."""
    pytest.importorskip("triton")
    assert "OK" in run_script(CUT, "cpu", True)


def test_attention_pass_equals_its_reference():
    """The tested-key pass (top-k from the marks, sample from the cut, logits from the scores pass, one
    program per KV head for its query heads) equals the torch estimate on random data: GQA groups of 4, 3 and
    1, ragged rows, each launch setting (blocks, warps, stages, programs), float32 and bfloat16,
    with and without sink and window, a head taking its whole residual."""
    pytest.importorskip("triton")
    assert "OK" in run_script(ATTEND, "cpu", True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_attention_pass_equals_its_reference_at_every_bench_setting():
    """On the GPU, each of ``vattention_stages.py``'s launch settings of the attention pass (blocks of 16, 32 and
    64 keys, 3 and 4 stages, 4 to 6 programs per SM) at 128k keys, batch 1, Llama-3.1-8B heads, and on
    ragged shorter rows with groups of 4, 2 and 1: the reference's estimate. Prints each setting's error (``-s``)."""
    pytest.importorskip("triton")
    out = run_script(ATTEND_SETTINGS_GPU, "cuda", False)
    print(out)
    assert "OK" in out


def test_attention_pass_refuses_16_key_blocks():
    """16-key blocks gave a wrong estimate on the GPU (the interpreter's is right), so the launch refuses them by
    name rather than run a path that cannot be trusted."""
    from kvsieve.kernels.vattention.attend_triton import attend_triton

    q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    rows, lens = torch.zeros(1, 4), torch.tensor([64], dtype=torch.int32)
    scores, excl = torch.zeros(1, 4, 64), torch.zeros(1, 4, 64, dtype=torch.bool)
    word = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_n: expected a power of two in 32..256, got 16"):
        attend_triton(q, k, v, lens, 4, 4, 0.25, scores, excl, word, word, 0, rows.long(), rows.long(), rows.long(),
                      rows.long(), block_n=16)


def test_reference_estimate_is_the_weighted_softmax():
    """The twin itself: with every selectable key kept at weight 1 it is exact attention."""
    from kvsieve.kernels.vattention.attend_triton import attend_reference

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 16, generator=g), torch.randn(1, 2, 50, 16, generator=g), torch.randn(1, 2, 50, 16,
                                                                                                     generator=g)
    lens = torch.tensor([50])
    scores = torch.einsum("rhd,rhnd->rhn", q, k.repeat_interleave(2, 1)) * 0.25
    everything = torch.ones(1, 4, 50, dtype=torch.bool)
    ones = torch.full((1, 4), 40)
    out = attend_reference(q, k, v, lens, 4, 6, 0.25, scores, ~everything, everything, ones, ones)
    want = torch.einsum("rhn,rhnd->rhd", torch.softmax(scores, -1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


TOPK_WAYS = """
import torch
import kvsieve
from kvsieve.kernels.oracle_topk import topk
from kvsieve.kernels.shared import select_radix, select_triton

# rows this short count as long: the oracle top-k runs the split select and its merge launch up to 700 keys,
# the radix select above
select_triton.REGISTER_SELECT_MAX = 64
select_triton.SEGMENT = 64
topk.RADIX_SELECT_ABOVE = 700
launched = []
plain_launch = select_triton.launch


def spy(kernel, *args, **meta):
    launched.append(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel))
    return plain_launch(kernel, *args, **meta)


select_triton.launch = select_radix.launch = spy
g = torch.Generator().manual_seed(2)
ways = []
for r, n, seed in [(1, 600, 3), (2, 650, 5), (2, 900, 4), (1, 1000, 6)]:
    launched.clear()
    q = torch.randn(r, 4, 64, generator=g) * 2
    k = torch.randn(r, 2, n, 64, generator=g)
    v = torch.randn(r, 2, n, 64, generator=g)
    lens = torch.tensor([n, n - 77][:r])
    spec = "vattention:sink=4,window=8,top_k=0.05,base_rate=0.05,epsilon=0.2,delta=0.2"
    out, st = kvsieve.method(spec + ",backend=triton").decode(q, k, v, lengths=lens, seed=seed)
    ref, rst = kvsieve.method(spec + ",backend=reference").decode(q, k, v, lengths=lens, seed=seed)
    assert st.backend == "triton" and st.extra.get("kernel") == "vattention attend_triton", st.extra
    way = "radix" if n > 700 else "triton"
    assert st.extra.get("topk_select") == way, (n, st.extra)
    assert ("_merge_rows_kernel" in launched) == (way == "triton"), (n, launched)
    assert "_topk_rows_kernel" not in launched or way == "triton", (n, launched)
    assert ("_radix_hist_kernel" in launched) == ("_radix_emit_kernel" in launched) == (way == "radix"), launched
    ways.append(way)
    for f in ("density", "kv_density", "v_rows_read"):
        assert st[f] == rst[f], (f, st[f], rst[f])
    assert torch.equal(st.raw("budget_per_head"), rst.raw("budget_per_head"))
    err = float((out - ref).norm() / ref.norm())
    assert err < 2e-5, err
assert ways == ["triton", "triton", "radix", "radix"], ways
print("OK")
"""


def test_topk_way_chosen_by_the_row_length_selects_as_the_reference():
    """vAttention's kernel path with the oracle top-k through each of its two ways, chosen by the row length
    (the limits lowered so that short rows take them): the Triton split select with its merge launch, and
    the radix select above ``RADIX_SELECT_ABOVE`` keys; the stats name the way; ragged rows; the reference's keys,
    budgets and estimate."""
    pytest.importorskip("triton")
    assert "OK" in run_script(TOPK_WAYS, "cpu", True)
