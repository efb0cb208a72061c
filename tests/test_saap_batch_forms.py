"""SAAP's batch forms (module constants, default off) against the default forms and the references under the
interpreter: the rank by rows (``probe.RANK_FORM``), the tiled hidden layer (``probe.HIDDEN_FORM``), and the bucket
loop's forms (``buckets.BUCKET_PREFETCH``, ``BUCKET_TAIL_GUARD``, ``BUCKET_BLOCK_N``). Batches 1 to 3 with rows of
different lengths, several seeds; the chosen buckets exactly, scores and outputs to float32 rounding."""

from __future__ import annotations

import pytest

PROBE_FORMS = r"""
import torch
from kvsieve.kernels.saap import probe
from kvsieve.kernels.saap.probe import probe_scores_reference, probe_scores_triton, serve_weights, top_buckets_reference
FORMS = [("tiled", "chunks"), ("tiled", "rows"), ("tiled-tc", "rows")]
worst = 0.0
checked = 0
# (seed, batch, query heads, KV heads, models, head dim, hidden, C, probes): one model per KV head or per query head,
# C a power of two and not, ℓ from 1 to C (a power of two and not); PART picks half of them
CASES = [(0, 1, 8, 2, 2, 32, 48, 64, (5, 64)), (1, 2, 8, 2, 8, 32, 40, 40, (1, 17)),
         (2, 3, 4, 1, 1, 64, 100, 257, (32, 257)), (3, 3, 8, 4, 4, 16, 16, 8, (3,))]
for seed, b, hq, hkv, models, d, hidden, c, probes in CASES[{part}::2]:
    g = torch.Generator().manual_seed(seed)
    w = serve_weights(torch.randn(models, d, hidden, generator=g) * d ** -0.5, torch.randn(models, hidden, generator=g),
                      torch.randn(models, hidden, c, generator=g) * hidden ** -0.5, torch.randn(models, c, generator=g))
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    lengths = torch.randint(10, 9000, (b,), generator=g)  # rows of different lengths: each its own de-rope
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ref = probe_scores_reference(q, lengths - 1, inv, 1.3, *w, kv_heads=hkv)
    for ell in probes:
        base_scores, base_top = probe_scores_triton(q, lengths, inv, 1.3, *w, kv_heads=hkv, probes=ell,
                                                    position_offset=-1)
        for hidden_form, rank_form in FORMS:
            probe.HIDDEN_FORM, probe.RANK_FORM = hidden_form, rank_form
            try:
                scores, top = probe_scores_triton(q, lengths, inv, 1.3, *w, kv_heads=hkv, probes=ell,
                                                  position_offset=-1)
            finally:
                probe.HIDDEN_FORM, probe.RANK_FORM = "all-rows", "chunks"
            case = (seed, b, c, ell, hidden_form, rank_form)
            assert torch.equal(top, top_buckets_reference(scores, ell)), case
            assert torch.equal(top, base_top), case  # random weights: no near tie moves a bucket
            if hidden_form != "tiled-tc":  # the same IEEE products: the same scores
                assert torch.allclose(scores, base_scores, rtol=0, atol=1e-7), case
            worst = max(worst, float((scores - ref).abs().max()), float((scores - base_scores).abs().max()))
            checked += 1
print("checked", checked, "worst", worst)
"""

RANK_TIES = r"""
import torch
from kvsieve.kernels.saap import probe
from kvsieve.kernels.saap.probe import probe_scores_triton, serve_weights, top_buckets_reference
checked = 0
# Ties: W2 columns and biases copied from 3 buckets (bit-equal scores, inside one segment and across segments), and
# logits scaled up so that most probabilities underflow to 0 (a tie at the threshold 0): the lowest indices win.
# (seed, batch, C, ℓ values, segments): PART picks one
CASES = [(0, 3, 64, (1, 4, 21, 63, 64), (1, 4, 8)), (1, 2, 100, (4, 33, 99), (8,)), (2, 1, 1024, (32,), (8,))]
for seed, b, c, ells, segments in CASES[{part}:{part} + 1]:
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, hidden = 8, 2, 32, 32
    w = serve_weights(torch.randn(hkv, d, hidden, generator=g) * d ** -0.5, torch.randn(hkv, hidden, generator=g),
                      torch.randn(hkv, hidden, c, generator=g) * hidden ** -0.5, torch.randn(hkv, c, generator=g))
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    lengths = torch.randint(10, 9000, (b,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    src = torch.randint(0, 3, (c,), generator=g)
    for gain in (1.0, 300.0):
        wt = (w[0], w[1], (w[2][..., src] * gain).contiguous(), (w[3][..., src] * gain).contiguous())
        for ell in ells:
            base_scores, base_top = probe_scores_triton(q, lengths, inv, 1.3, *wt, kv_heads=hkv, probes=ell)
            for segment in segments:
                probe.RANK_FORM, probe.RANK_SEGMENT = "rows", segment
                try:
                    scores, top = probe_scores_triton(q, lengths, inv, 1.3, *wt, kv_heads=hkv, probes=ell)
                finally:
                    probe.RANK_FORM, probe.RANK_SEGMENT = "chunks", 8
                ties = (scores[..., :, None] == scores[..., None, :]).sum() > scores.numel()
                assert ties and torch.equal(scores, base_scores), (seed, gain, ell, segment)
                assert torch.equal(top, top_buckets_reference(scores, ell)), (seed, gain, ell, segment)
                assert torch.equal(top, base_top), (seed, gain, ell, segment)
                checked += 1
        assert gain == 1 or int((scores == 0).sum()) > 0, "the large gain gives probabilities of 0"
print("checked", checked)
"""

BUCKET_FORMS = r"""
import importlib.util
import torch
from kvsieve.kernels.saap import buckets
from kvsieve.kernels.saap.buckets import bucket_sparse_decode_triton
from kvsieve.kernels.saap.index import index_decode_reference
spec = importlib.util.spec_from_file_location("saap_probe_run", "benchmarks/saap_probe/run.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
FORMS = [{{"BUCKET_PREFETCH": True}}, {{"BUCKET_TAIL_GUARD": True}},
         {{"BUCKET_PREFETCH": True, "BUCKET_TAIL_GUARD": True}},
         {{"BUCKET_PREFETCH": True, "BUCKET_TAIL_GUARD": True, "BUCKET_BLOCK_N": 32}}]
checked, worst = 0, 0.0
for seed, batch, n_keys in [(0, 1, 300), (1, 2, 260), (2, 3, 200)][{part}:{part} + 1]:
    case = bench.make_case(batch, n_keys, 32, bench.TINY, torch.device("cpu"), seed=seed)
    top = bench.references(case)[1]
    for splits, block_n in ((1, 16), (3, None)):  # several chunks a program, and the launcher's chunk

        def call(assign):
            return bucket_sparse_decode_triton(
                case["q"], case["k"], case["v"], case["sink_ids"], case["sink_counts"], case["offsets"], case["ids"],
                top, 0, sliding=(case["lengths"], case["window"], case["t_lo"], assign), splits=splits,
                block_n=block_n, fused_merge=splits <= 3,
                ahead=(case["centroids"], case["inv_freq"], 1.0, bench.SPAN))

        base_assign = case["assign"].clone()
        base, _, base_counts = call(base_assign)
        want, _ = index_decode_reference(case["q"], case["k"], case["v"], case["lengths"], case["window"], 1,
                                         base_assign, top)
        assert float((base.float() - want.float()).abs().max()) < 2e-2
        for form in FORMS:
            before = {{name: getattr(buckets, name) for name in form}}
            for name, value in form.items():
                setattr(buckets, name, value)
            try:
                assign = case["assign"].clone()
                out, _, counts = call(assign)
            finally:
                for name, value in before.items():
                    setattr(buckets, name, value)
            assert torch.equal(assign, base_assign) and torch.equal(counts, base_counts), (seed, form)
            if "BUCKET_BLOCK_N" in form and block_n is None:  # other chunks: another summation order
                worst = max(worst, float((out.float() - base.float()).abs().max()))
            else:  # the same keys in the same order: the same output
                assert torch.equal(out, base), (seed, splits, form, float((out.float() - base.float()).abs().max()))
            checked += 1
print("checked", checked, "worst", worst)
"""


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1])
def test_probe_batch_forms_pick_the_default_forms_buckets(part):
    """Every form of the hidden layer and the rank: the top-ℓ of its own scores (best first, ties to the lower
    index), the default form's buckets, scores within float32 rounding of the reference (bit for bit with the
    default's where the products are the same IEEE ones)."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(PROBE_FORMS, "cpu", interpret=True, part=part)
    assert int(out.split()[1]) == 3 * (4, 3)[part] and float(out.split("worst")[-1]) < 1e-6


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1, 2])
def test_rank_by_rows_breaks_ties_as_the_chunks(part):
    """Bit-equal scores within and across segments, and a tie at 0 past the threshold: the rank by rows keeps the
    lowest indices, as the chunks and a stable sort do, for segments of 1, 4 and 8 buckets."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(RANK_TIES, "cpu", interpret=True, part=part)
    assert int(out.split()[-1]) > 0


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1, 2])
def test_bucket_loop_forms_equal_the_default(part):
    """The bucket kernel with the update one step ahead, the keys found a chunk ahead and/or the tail tested only where
    it is: the default's output bit for bit, its index update and key counts; chunks of 32 to float32 rounding."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(BUCKET_FORMS, "cpu", interpret=True, part=part)
    assert int(out.split()[1]) == 2 * 4 and float(out.split("worst")[-1]) < 1e-2


@pytest.mark.triton
@pytest.mark.slow  # the benchmark's plumbing: every default variant runs too; the forms are checked above
def test_the_probe_benchmark_checks_the_forms(tmp_path):
    """``benchmarks/saap_probe/run.py --check --forms ...``: each form's rows present and passing their checks."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root / "src"))
    forms = ("rank-rows", "hidden-tiled-tc", "bucket-both-n32", "new")
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "saap_probe" / "run.py"), "--check", "--forms",
                          ",".join(forms), "--out", str(tmp_path)], capture_output=True, text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = (tmp_path / "saap_probe.md").read_text()
    named = {row["variant"] for row in json.loads((tmp_path / "saap_probe.json").read_text())["rows"]
             if "[" in row["variant"]}
    for form in forms:
        assert any(name.endswith(f"[{form}]") for name in named), form
    for name in named:
        assert table.count(f"| {name} |") == 2, name
    assert "FAIL" not in table and "top/default 1.000" in table
