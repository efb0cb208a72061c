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


AHEAD_ROW_CASES = r"""
import torch
from kvsieve.kernels.saap.index import assign_ahead_reference, assign_ahead_triton, build_assign
dev = "{device}"
checked = tie_checks = 0
# (seed, b, hkv, d, n, c, span, block_c): spans of 4 (one pass of four keys), 5 and 16 (several, the last one partial),
# C a multiple of the tile and not, ragged rows, one row shorter than its window
for seed, b, hkv, d, n, c, span, block_c in [(0, 3, 2, 16, 200, 40, 4, 16), (1, 2, 1, 32, 150, 100, 16, 32),
                                             (2, 1, 2, 16, 90, 17, 5, 16)]:
    g = torch.Generator().manual_seed(seed)
    freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    start = torch.randint(n // 2, n - 40, (b,), generator=g)
    start[-1] = 20
    window = torch.randint(10, 40, (b,), generator=g)
    unit = torch.nn.functional.normalize(torch.randn(hkv, c, d, generator=g), dim=-1)
    # tied centroids (each a copy of one of 3: every key's best product reached by several) against small-integer keys
    # compared as stored (exact products): the first index must win, within a tile and across tiles
    tied = torch.randint(-2, 3, (hkv, 3, d), generator=g).float()[:, torch.randint(0, 3, (c,), generator=g)]
    k_int = torch.randint(-3, 4, (b, hkv, n, d), generator=g).float()
    k = torch.randn(b, hkv, n, d, generator=g)
    for cent, inv, keys in ((unit, freq, k), (tied.contiguous(), None, k_int)):
        cent, keys, inv = cent.to(dev), keys.to(dev), None if inv is None else inv.to(dev)
        assign, t_lo = build_assign(keys, start.to(dev), window.to(dev), 1, cent, inv, 1.3, n)
        for step in (1, 7) if seed == 0 else (5,):
            lengths, win = (start + step).int().to(dev), window.to(dev)
            ref, key, row = assign.clone(), assign.clone(), assign.clone()
            assign_ahead_reference(ref, keys, t_lo, lengths, win, span, cent, inv, 1.3)
            assign_ahead_triton(key, keys, t_lo, lengths, win, span, cent, inv, 1.3, block_c=block_c, per="key")
            assign_ahead_triton(row, keys, t_lo, lengths, win, span, cent, inv, 1.3, block_c=block_c, per="row")
            assert torch.equal(key, ref) and torch.equal(row, ref), (seed, step, (row != ref).nonzero()[:5])
            tie_checks += int(inv is None)
            checked += 1
print("checked", checked, "tie_checks", tie_checks)
"""


@pytest.mark.triton
def test_the_update_ahead_one_program_a_row_equals_one_a_key():
    """The update one step ahead as one program a (row, KV head) (``per="row"``: four keys a pass over the centroid
    tiles, each key's best kept per tile row) writes the reference's buckets and the one-program-a-key form's, bit for
    bit: de-roped keys and integer keys as stored, spans 4, 5 and 16, ragged rows, tiles that cut C unevenly, exact
    ties."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(AHEAD_ROW_CASES, "cpu", interpret=True)
    assert int(out.split()[1]) == 8 and int(out.split("tie_checks")[-1]) > 0


@pytest.mark.gpu
def test_the_update_ahead_one_program_a_row_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from interpreted import run_script

    out = run_script(AHEAD_ROW_CASES, "cuda", interpret=False)
    assert int(out.split()[1]) == 8 and int(out.split("tie_checks")[-1]) > 0


def test_the_update_ahead_form_is_checked_and_follows_its_module_constant(monkeypatch):
    """``per`` names one of the two forms; left out, :data:`index.AHEAD_PER` picks (the method passes none)."""
    from kvsieve.kernels.saap import index

    k, cent = torch.zeros(1, 2, 8, 16), torch.zeros(2, 40, 16)
    assert index.ahead_launch_meta(k, 4, cent, None, per="row")["PROGRAMS"] == 1
    assert index.ahead_launch_meta(k, 4, cent, None, per="key")["PROGRAMS"] == 4
    assert index.ahead_launch_meta(k, 4, cent, None)["PROGRAMS"] == 4
    monkeypatch.setattr(index, "AHEAD_PER", "row")
    assert index.ahead_launch_meta(k, 4, cent, None)["PROGRAMS"] == 1
    with pytest.raises(ValueError, match="per"):
        index.ahead_launch_meta(k, 4, cent, None, per="rows")


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


@pytest.mark.triton
def test_the_probe_benchmark_checks_the_batch_8_variants(tmp_path):
    """``--variants b8`` on one tiny batch of 2 under the interpreter: every batch-8 variant passes the references'
    checks and equals the current path it replaces (same top-ℓ, scores, index; the layer's output within 2e-2)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    bench = root / "benchmarks" / "saap_probe" / "run.py"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"))
    res = subprocess.run([sys.executable, str(bench), "--check", "--cases", "2x120", "--variants", "b8", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = (tmp_path / "saap_probe.md").read_text()
    import importlib.util

    spec = importlib.util.spec_from_file_location("saap_probe_run", bench)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for variant in module.B8_VARIANTS:
        assert f"| {variant} |" in table
    assert "FAIL" not in table and table.count("same as current True") == len(module.B8_VARIANTS)
