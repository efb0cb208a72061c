"""SAAP's index update parallel over the centroids (two stages) against its torch reference on random data —
several shapes and seeds, ragged batches, block sizes that cut C and the keys unevenly, tied centroids — under the
interpreter and on CUDA (``-m gpu``); the host rule that picks it; the probe benchmark's checks."""

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


@pytest.mark.triton
def test_parallel_update_equals_the_reference():
    """The two-stage update writes the reference's buckets bit for bit: de-roped keys and keys as stored, spans 1
    to 16, ragged rows, centroid blocks that cut C unevenly, and exact ties (the first index wins)."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(PARALLEL_UPDATE_CASES, "cpu", interpret=True)
    assert int(out.split("ties")[-1]) > 0


@pytest.mark.gpu
def test_parallel_update_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from interpreted import run_script

    out = run_script(PARALLEL_UPDATE_CASES, "cuda", interpret=False)
    assert int(out.split("ties")[-1]) > 0


def test_the_update_is_parallel_at_batch_one_only():
    """The measured rule (docs/methods/saap.md): parallel at batch 1, serial from batch 2 on."""
    from kvsieve.kernels.saap.index import parallel_update

    assert parallel_update(1)
    assert not any(parallel_update(b) for b in (2, 3, 4, 8, 64))


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
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "saap_probe" / "run.py"), "--check", "--sweep",
                          "rank,ahead", "--out", str(tmp_path)], capture_output=True, text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = (tmp_path / "saap_probe.md").read_text()
    for variant in ("update-serial", "update-parallel", "probe", "step-serial", "step-parallel", "layer",
                    "update-ahead", "layer-ahead"):
        assert f"| {variant} |" in table
    # two cases, each with two updates alone, two probes with the update and the layer's step, and the update one
    # step ahead alone and in the layer's step
    assert "FAIL" not in table and table.count("assign True") == 2 * 7 and table.count("out err") == 2 * 2
    # the sweeps: the rank launch's chunk (several comparison passes a program past 32) and the ahead update's block
    assert table.count("| probe | RANK_CHUNK") == 2 * 4 and table.count("| layer-ahead | AHEAD_BLOCK_C") == 2 * 3
