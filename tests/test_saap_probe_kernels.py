"""SAAP's shorter decode step: the index update parallel over the centroids (two stages, alone and inside the
probe's launches) and the probe's classifier in one launch (``kernels="fused"``), each against its torch reference
on random data — several shapes and seeds, ragged batches, block sizes that cut C and the keys unevenly, tied
centroids — under the interpreter, and the same cases on CUDA (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

PARALLEL_UPDATE_CASES = r"""
import torch
from kvsieve.kernels.saap.index import (assign_tail_parallel_triton, assign_tail_reference, assign_keys_reference,
                                        build_assign, derope_keys, tail_end, tail_positions)
dev = "{device}"
checked = ties = 0
# (seed, b, hkv, d, n, c, block_c, block_r): C a multiple of the block and not, one block and many, 1 to 4 rows
for seed, b, hkv, d, n, c, block_c, block_r in [(0, 2, 2, 16, 260, 12, 16, 16), (1, 1, 3, 32, 200, 40, 16, 16),
                                                (2, 3, 1, 16, 150, 100, 32, 16), (3, 4, 2, 64, 180, 64, 16, 32),
                                                (4, 2, 2, 16, 120, 33, 64, 16)]:
    g = torch.Generator().manual_seed(seed)
    freq = (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))).to(dev)
    k = torch.randn(b, hkv, n, d, generator=g).to(dev)
    # ragged rows: each its own length and window (fixed at the build), one row shorter than its window at first
    start = torch.randint(n // 2, n - 40, (b,), generator=g)
    start[-1] = 20
    window = torch.randint(10, 40, (b,), generator=g)
    start, window = start.to(dev), window.to(dev)
    unit = torch.nn.functional.normalize(torch.randn(hkv, c, d, generator=g), dim=-1)
    # tied centroids: every centroid a copy of one of 3, so each key's best product is reached several times, in
    # one block and across blocks; the first index must win, as in torch.argmax. Small integers against keys of
    # small integers compared as stored: every product is exact in float32 whatever the summation order, so the
    # ties are ties in the reference too.
    tied = torch.randint(-2, 3, (hkv, 3, d), generator=g).float()[:, torch.randint(0, 3, (c,), generator=g)]
    k_int = torch.randint(-3, 4, (b, hkv, n, d), generator=g).float().to(dev)
    for cent, inverse, k in ((unit.to(dev), (freq, None), k), (tied.contiguous().to(dev), (None,), k_int)):
        for inv in inverse:
            assign, t_lo = build_assign(k, start, window, 1, cent, inv, 1.3, n)
            ref, got = assign.clone(), assign.clone()
            for step, span in ((1, 4), (2, 4), (3, 1), (9, 16), (30, 16)):
                lengths = (start + step).int()
                assign_tail_reference(ref, k, t_lo, lengths, window, span, cent, inv, 1.3)
                assign_tail_parallel_triton(got, k, t_lo, lengths, window, span, cent, inv, 1.3, block_c=block_c,
                                            block_r=block_r)
                assert torch.equal(got, ref), (seed, step, (got != ref).nonzero()[:5])
                # the tie case reaches its maximum more than once in the reference's own products
                pos = tail_positions(t_lo, tail_end(t_lo, lengths, window), span)
                rows = k.gather(2, pos[:, None, :, None].expand(b, hkv, span, d))
                s = torch.einsum("bhud,hcd->bhuc", derope_keys(rows, pos, inv, 1.3), cent)
                ties += int(((s == s.max(-1, keepdim=True).values).sum(-1) > 1).sum())
                checked += 1
            # a repeated step writes the same buckets
            again = got.clone()
            assign_tail_parallel_triton(again, k, t_lo, lengths, window, span, cent, inv, 1.3, block_c=block_c)
            assert torch.equal(again, got)
assert ties > 0, "the tied centroids gave no tie"
print("checked", checked, "ties", ties)
"""

FUSED_PROBE_CASES = r"""
import torch
from kvsieve.kernels.saap import probe
from kvsieve.kernels.saap.probe import (probe_scores_reference, probe_scores_triton, serve_weights,
                                        top_buckets_reference)
dev = "{device}"
worst = 0.0
# (seed, b, hq, hkv, d, hidden, c, per_kv, block_c, block_k, parts): hidden and C off the blocks, one model per
# KV head or per query head, the hidden units in 1 to 4 slices of 1 to 4 blocks
for seed, b, hq, hkv, d, hidden, c, per_kv, block_c, block_k, parts in [
        (0, 1, 8, 2, 32, 48, 40, True, 16, 16, 4), (1, 2, 6, 3, 16, 16, 8, False, 16, 16, 1),
        (2, 2, 4, 1, 64, 100, 257, True, 64, 32, 2), (3, 3, 4, 4, 32, 200, 64, True, 32, 16, 3),
        (4, 5, 8, 2, 32, 64, 100, False, 64, 64, 4)]:
    g = torch.Generator().manual_seed(seed)
    models = hkv if per_kv else hq
    w = [(torch.randn(*shape, generator=g) * 0.5).to(dev)
         for shape in ((models, d, hidden), (models, hidden), (models, hidden, c), (models, c))]
    inv_freq = (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))).to(dev)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16).to(dev)
    pos = torch.randint(0, 5000, (b,), generator=g).to(dev)  # ragged: each row's query at its own position
    probe.MLP_BLOCK_C, probe.MLP_BLOCK_K, probe.MLP_PARTS = block_c, block_k, parts
    for ws in (w, serve_weights(*w)):  # float32 weights, and the serve-time bfloat16 ones (three-term products)
        ref = probe_scores_reference(q, pos, inv_freq, 1.3, *ws, kv_heads=hkv)
        split = probe_scores_triton(q, pos + 1, inv_freq, 1.3, *ws, kv_heads=hkv, position_offset=-1, kernels="split")
        for probes in sorted({{1, 3, c // 2, c}}):
            got, top = probe_scores_triton(q, pos + 1, inv_freq, 1.3, *ws, kv_heads=hkv, probes=probes,
                                           position_offset=-1, kernels="fused")
            assert torch.equal(top, top_buckets_reference(got, probes)), (seed, probes)
            worst = max(worst, float((got - ref).abs().max()), float((got - split).abs().max()))
probe.MLP_BLOCK_C, probe.MLP_BLOCK_K, probe.MLP_PARTS = 64, 64, 4
print("worst", worst)
"""


@pytest.mark.triton
def test_parallel_update_equals_the_reference():
    """The two-stage update writes the reference's buckets bit for bit: de-roped keys and keys as stored, spans 1
    to 16, ragged rows, centroid blocks that cut C unevenly, and exact ties (the first index wins)."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(PARALLEL_UPDATE_CASES, "cpu", interpret=True)
    assert int(out.split("ties")[-1]) > 0


@pytest.mark.triton
def test_fused_classifier_launch_matches_the_reference():
    """The classifier's two layers in one launch (then the rank launch) give the reference's group scores (float32
    and bfloat16 weights, one model per KV head or per query head, hidden units in 1 to 4 slices), the top-ℓ of
    those scores, and the split path's scores."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(FUSED_PROBE_CASES, "cpu", interpret=True)
    assert float(out.split("worst")[-1]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("cases,bound", [(PARALLEL_UPDATE_CASES, None), (FUSED_PROBE_CASES, 1e-4)])
def test_parallel_update_and_fused_probe_on_cuda(cases, bound):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from interpreted import run_script

    out = run_script(cases, "cuda", interpret=False)
    if bound is not None:  # libdevice cos/sin and float32 sums in another order
        assert float(out.split("worst")[-1]) < bound


def test_bad_kernel_choices_are_refused_by_name():
    pytest.importorskip("triton")
    from kvsieve.kernels.saap.probe import probe_scores_triton
    from kvsieve.methods.saap import SaapConfig

    w = (torch.zeros(1, 16, 16), torch.zeros(1, 16), torch.zeros(1, 16, 16), torch.zeros(1, 16))
    with pytest.raises(ValueError, match="kernels: expected 'fused' or 'split'"):
        probe_scores_triton(torch.randn(1, 2, 16), torch.ones(1, dtype=torch.long), torch.ones(8), 1.0, *w,
                            kv_heads=1, kernels="three")
    with pytest.raises(ValueError, match="probe_kernels"):
        SaapConfig(artifacts="x", probe_kernels="three")


@pytest.mark.triton
def test_the_probe_benchmark_checks_every_variant(tmp_path):
    """``benchmarks/saap_probe/run.py --check``: every timed variant on tiny inputs under the interpreter, each
    passing its checks against the references, the report written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"))
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "saap_probe" / "run.py"), "--check", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = (tmp_path / "saap_probe.md").read_text()
    for variant in ("update-serial", "update-parallel", "step-split", "step-fused", "step-fused-pdl", "layer-split",
                    "layer-fused-pdl"):
        assert f"| {variant} |" in table
    # two cases, each with two updates alone, three probes with the update and three layer steps
    assert "FAIL" not in table and table.count("assign True") == 2 * 8 and table.count("out err") == 2 * 3
