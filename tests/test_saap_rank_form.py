"""SAAP's probe with the group scores computed once per (row, KV head) (``rank_form="scores"``) against the rank in
chunks (``"chunks"``, every program recomputing them) and the torch references, under the interpreter: the same
scores to the bit, the same top-ℓ (``torch.topk``'s set, ties to the lower index, best first), with and without the
index update riding in the launches; the host rule ``"auto"``; the probe benchmark timing both forms."""

from __future__ import annotations

import pytest

FORMS = r"""
import torch
from kvsieve.kernels.saap import probe
from kvsieve.kernels.saap.index import assign_tail_reference, build_assign
from kvsieve.kernels.saap.probe import probe_scores_reference, probe_scores_triton, serve_weights, top_buckets_reference
checked = ties_seen = zeros_seen = 0
worst = 0.0
# (seed, batch, query heads, KV heads, models, head dim, hidden, C, ℓ of each weight set, rank chunk): one model per
# KV head and per query head, batches 1, 3 and 8, C a multiple of the chunk and not (the last chunk cut), ℓ from 1 to
# C, chunks of one pass (RANK_SUB = 32) and of two; PART picks one
CASES = [(0, 1, 8, 2, 2, 32, 48, 40, (5, 1, 40), 16), (1, 3, 8, 2, 8, 16, 32, 100, (33, 3, 100), 32),
         (2, 8, 4, 2, 2, 16, 16, 64, (8, 64, 17), 16), (3, 3, 6, 3, 6, 32, 40, 70, (7, 2, 32), 64)]
for seed, b, hq, hkv, models, d, hidden, c, ells, chunk in CASES[{part}:{part} + 1]:
    probe.RANK_CHUNK = chunk
    probe.RANK_SPLIT = seed % 2 == 1  # the scores form's two comparisons, a case each in turn
    g = torch.Generator().manual_seed(seed)
    w = serve_weights(torch.randn(models, d, hidden, generator=g) * d ** -0.5, torch.randn(models, hidden, generator=g),
                      torch.randn(models, hidden, c, generator=g) * hidden ** -0.5, torch.randn(models, c, generator=g))
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    lengths = torch.randint(300, 9000, (b,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ref = probe_scores_reference(q, lengths - 1, inv, 1.3, *w, kv_heads=hkv)
    # ties: W2 columns and biases copied from 3 buckets (bit-equal scores within a chunk and across chunks), and a
    # gain that sends most probabilities to 0 (a tie at the threshold)
    src = torch.randint(0, 3, (c,), generator=g)
    tied = [(w[0], w[1], (w[2][..., src] * gain).contiguous(), (w[3][..., src] * gain).contiguous())
            for gain in (1.0, 1000.0)]
    for wi, (weights, ell) in enumerate(zip([w] + tied, ells)):
        got = {{}}
        for form in ("chunks", "scores"):
            got[form] = probe_scores_triton(q, lengths, inv, 1.3, *weights, kv_heads=hkv, probes=ell,
                                            position_offset=-1, rank_form=form)
        (s_c, t_c), (s_s, t_s) = got["chunks"], got["scores"]
        case = (seed, b, c, ell, wi)
        assert torch.equal(s_s, s_c), case
        assert torch.equal(t_s, t_c), case
        assert torch.equal(t_s, top_buckets_reference(s_s, ell)), case
        if wi:
            ties_seen += int((s_s[..., :, None] == s_s[..., None, :]).sum() > s_s.numel())
        else:  # no ties: torch.topk's set, and the reference's scores to float32 rounding
            assert torch.equal(t_s.sort(-1).values, torch.topk(s_s, ell, dim=-1).indices.sort(-1).values), case
            worst = max(worst, float((s_s - ref).abs().max()))
        checked += 1
    zeros_seen += int((s_s == 0).sum())
    # the index update inside the launches, writing the reference's index
    centroids = torch.nn.functional.normalize(torch.randn(hkv, c, d, generator=g), dim=-1)
    keys = torch.randn(b, hkv, int(lengths.max()), d, generator=g).to(torch.bfloat16)
    window = torch.full((b,), 64)
    assign0, t_lo = build_assign(keys, lengths - 12, window, 1, centroids, inv, 1.0, keys.shape[2])
    want = assign0.clone()
    assign_tail_reference(want, keys, t_lo, lengths, window, 4, centroids, inv, 1.0)
    assert not torch.equal(want, assign0), "no key joined a bucket"
    # the parallel update (its second stage in the rank launch) with and without a top-ℓ (then the scores form's rank
    # launch runs the update's programs alone); the serial one (in the first launch) once
    for parallel, probes in ((True, ells[0]), (True, 0)) + (((False, ells[0]),) if seed == 1 else ()):
        out = {{}}
        for form in ("chunks", "scores"):
            a = assign0.clone()
            out[form] = probe_scores_triton(q, lengths, inv, 1.3, *w, kv_heads=hkv, probes=probes,
                                            position_offset=-1, rank_form=form, parallel_tail=parallel,
                                            tail=(a, keys, t_lo, lengths, window, 4, centroids, inv, 1.0))
            assert torch.equal(a, want), (seed, form, parallel, probes)
        if probes:
            assert torch.equal(out["scores"][0], out["chunks"][0]) and torch.equal(out["scores"][1],
                                                                                   out["chunks"][1])
            assert torch.equal(out["scores"][1], top_buckets_reference(out["scores"][0], probes))
        else:
            assert torch.equal(out["scores"], out["chunks"])
        checked += 1
probe.RANK_CHUNK, probe.RANK_SPLIT = 32, True  # the defaults back
assert ties_seen > 0 and zeros_seen > 0, "no tie, or no tie at 0 past the threshold"
print("checked", checked, "worst", worst)
"""


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1, 2, 3])
def test_scores_form_equals_the_chunks_form_and_the_reference(part):
    """``rank_form="scores"`` against ``"chunks"``: bit-equal scores and the same top-ℓ (random weights, tied
    buckets, probabilities of 0) at batches 1, 3 and 8, models per KV head and per query head, C cut by the chunk;
    the scores alone; the serial and the parallel index update inside the launches writing the reference's index."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(FORMS, "cpu", interpret=True, part=part)
    assert int(out.split()[1]) > 0 and float(out.split("worst")[-1]) < 1e-6

SPLIT = r"""
import torch
from kvsieve.kernels.saap import probe
from kvsieve.kernels.saap.probe import top_buckets_reference, top_of_scores_triton
g = torch.Generator().manual_seed({part})
checked = ties = 0
# (C, rank chunk, ℓ values): C a power of two and not, chunks of one pass (SUB 32) and of two, cut by C
for c, chunk, ells in [(16, 16, (1, 16)), (40, 32, (3, 39)), (100, 64, (32, 100)), (257, 32, (5, 200))][{part}::2]:
    probe.RANK_CHUNK = chunk
    # continuous scores; scores drawn from 4 values, 0 among them (ties within a pass, across passes and chunks)
    values = torch.tensor([0.0, 0.25, 1.5, 3.0])
    for scores in (torch.rand(3, c, generator=g) * 4, values[torch.randint(0, 4, (3, c), generator=g)]):
        ties += int((scores[:, :, None] == scores[:, None, :]).sum() > scores.numel())
        for ell in ells:
            want = top_buckets_reference(scores, ell)
            for split in (False, True):
                probe.RANK_SPLIT = split
                assert torch.equal(top_of_scores_triton(scores, ell), want), (c, chunk, ell, split)
                checked += 1
probe.RANK_CHUNK, probe.RANK_SPLIT = 32, True  # the defaults back
assert ties > 0
print("checked", checked)
"""


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1])
def test_split_comparison_ranks_as_the_pairwise_one(part):
    """``RANK_SPLIT`` (the tie rule's index test on the pass's own buckets only) and the pairwise comparison give the
    stable sort's top-ℓ on scores with exact ties (0 among them) within a pass, across passes and across chunks."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(SPLIT, "cpu", interpret=True, part=part)
    assert int(out.split()[-1]) == 16


def test_rank_form_rule_and_bad_values():
    """``"auto"`` takes the scores from :data:`RANK_SCORES_FROM` (row, KV head) pairs on, and is the default;
    an unknown form is refused, naming the argument."""
    from kvsieve.kernels.saap import probe

    assert probe.RANK_FORM == "auto"
    assert probe.rank_form_for(probe.RANK_SCORES_FROM - 1, "auto") == "chunks"
    assert probe.rank_form_for(probe.RANK_SCORES_FROM, "auto") == "scores"
    assert probe.rank_form_for(1, "scores") == "scores" and probe.rank_form_for(10**4, "chunks") == "chunks"
    with pytest.raises(ValueError, match="rank_form"):
        probe.rank_form_for(8, "rows")


@pytest.mark.triton
def test_the_probe_benchmark_times_both_rank_forms(tmp_path):
    """``benchmarks/saap_probe/run.py --check --rank-forms chunks,scores,scores+split``: each probe-running variant
    under each form, checked against the references and equal (scores and buckets; the layer's output) to the
    default form's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"))
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "saap_probe" / "run.py"), "--check",
                          "--variants", "probe,layer-ahead", "--rank-forms", "chunks,scores,scores+split",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "saap_probe.json").read_text())["rows"]
    assert sorted((r["batch"], r["variant"], r["rank_form"]) for r in rows) == sorted(
        (b, v, f) for b in (1, 3) for v in ("probe", "layer-ahead")
        for f in ("chunks", "scores", "scores+split"))
    assert all(r["ok"] and r["equal_to_default_form"] for r in rows)
    table = (tmp_path / "saap_probe.md").read_text()
    assert "FAIL" not in table and table.count("| scores |") == table.count("| scores+split |") == 4


SCORES_KERNELS_SM90 = r"""
from kvsieve.kernels.saap import probe

POINTERS = {"logits_ptr": "*fp32", "out_ptr": "*fp32", "scores_ptr": "*fp32", "top_ptr": "*i64", "rps_ptr": "*fp32",
            "rpi_ptr": "*i32", "rassign_ptr": "*i64", "rlo_ptr": "*i64", "rlen_ptr": "*i32", "rwin_ptr": "*i64"}
# Llama-3.1-8B shapes: groups of 4, C = 1024 scores, the logits in four parts; the rank alone and with the parallel
# update's second stage, each comparison
compile_(probe._group_scores_kernel, POINTERS, {"GROUP": 4, "BLOCK_C": 1024, "PARTS": 4}, num_warps=probe.RANK_WARPS)
for tail, split in ((False, False), (True, False), (False, True), (True, True)):
    compile_(probe._scores_rank_kernel, POINTERS, {"BLOCK_C": 1024, "CHUNK": 32, "SUB": 32, "SPLIT": split,
                                                   "TAIL": tail, "R_BLOCKS_P": 16}, num_warps=probe.RANK_WARPS)
print("COMPILED")
"""


@pytest.mark.triton
def test_scores_form_kernels_compile_for_the_h100():
    """The interpreter does not type-check; the scores form's two kernels compile for sm_90 (no GPU needed)."""
    from interpreted import compile_for_sm90

    pytest.importorskip("triton")
    compile_for_sm90(SCORES_KERNELS_SM90)
