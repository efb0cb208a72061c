"""SAAP's probe and bucket attention at batches 1 to 3 under the interpreter, against the torch references: the
tiled hidden layer and the rank in chunks (scores, the top-ℓ of the reference, ties to the lower index), and the
bucket loop (keys found a chunk ahead, the tail tested only where it is) with the update one step ahead in its
launch. Rows of different lengths, several seeds."""

from __future__ import annotations

import pytest

PROBE = r"""
import torch
from kvsieve.kernels.saap.probe import probe_scores_reference, probe_scores_triton, serve_weights, top_buckets_reference
worst = 0.0
checked = 0
# (seed, batch, query heads, KV heads, models, head dim, hidden, C, probes): one model per KV head or per query head,
# batches of up to 3 rows (up to 24 classifier rows: two row tiles of the hidden layer), C a power of two and not, ℓ
# from 1 to C (a power of two and not); PART picks half of them
CASES = [(0, 1, 8, 2, 2, 32, 48, 64, (5, 64)), (1, 2, 8, 2, 8, 32, 40, 40, (1, 17)),
         (2, 3, 4, 1, 1, 64, 100, 257, (32, 257)), (3, 3, 8, 4, 4, 16, 16, 8, (3,)),
         (4, 3, 32, 8, 8, 32, 72, 96, (32,))]
for seed, b, hq, hkv, models, d, hidden, c, probes in CASES[{part}::2]:
    g = torch.Generator().manual_seed(seed)
    w = serve_weights(torch.randn(models, d, hidden, generator=g) * d ** -0.5, torch.randn(models, hidden, generator=g),
                      torch.randn(models, hidden, c, generator=g) * hidden ** -0.5, torch.randn(models, c, generator=g))
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    lengths = torch.randint(10, 9000, (b,), generator=g)  # rows of different lengths: each its own de-rope
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ref = probe_scores_reference(q, lengths - 1, inv, 1.3, *w, kv_heads=hkv)
    for ell in probes:
        scores, top = probe_scores_triton(q, lengths, inv, 1.3, *w, kv_heads=hkv, probes=ell, position_offset=-1)
        case = (seed, b, c, ell)
        assert torch.equal(top, top_buckets_reference(scores, ell)), case
        # the reference's top-ℓ to float32 rounding: best first, and nothing left out scores above what is taken
        chosen = ref.gather(-1, top)
        assert bool((chosen[..., 1:] <= chosen[..., :-1] + 1e-6).all()), case
        if ell < c:
            left = ref.scatter(-1, top, float("-inf")).amax(-1)
            assert bool((left <= chosen[..., -1] + 1e-6).all()), case
        worst = max(worst, float((scores - ref).abs().max()))
        checked += 1
print("checked", checked, "worst", worst)
"""

RANK_TIES = r"""
import torch
from kvsieve.kernels.saap.probe import probe_scores_triton, serve_weights, top_buckets_reference
checked = 0
# Ties: W2 columns and biases copied from 3 buckets (bit-equal scores, within a chunk of the rank and across chunks),
# and logits scaled up so that most probabilities underflow to 0 (a tie at the threshold 0): the lowest indices win,
# as in a stable descending sort. (seed, batch, C, ℓ values): PART picks one
CASES = [(0, 3, 64, (1, 4, 21, 63, 64)), (1, 2, 100, (4, 33, 99)), (2, 1, 1024, (32,))]
for seed, b, c, ells in CASES[{part}:{part} + 1]:
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
            scores, top = probe_scores_triton(q, lengths, inv, 1.3, *wt, kv_heads=hkv, probes=ell)
            ties = (scores[..., :, None] == scores[..., None, :]).sum() > scores.numel()
            assert ties and torch.equal(top, top_buckets_reference(scores, ell)), (seed, gain, ell)
            checked += 1
        assert gain == 1 or int((scores == 0).sum()) > 0, "the large gain gives probabilities of 0"
print("checked", checked)
"""

BUCKET = r"""
import importlib.util
import torch
from kvsieve.kernels.saap.buckets import bucket_sizes, bucket_sparse_decode_triton
from kvsieve.kernels.saap.index import assign_ahead_reference, assign_tail_reference, index_decode_reference
spec = importlib.util.spec_from_file_location("saap_probe_run", "benchmarks/saap_probe/run.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
checked, worst, tail_hits = 0, 0.0, 0
for seed, batch, n_keys in [(0, 1, 300), (1, 2, 260), (2, 3, 200)][{part}:{part} + 1]:
    case = bench.make_case(batch, n_keys, 32, bench.TINY, torch.device("cpu"), seed=seed)
    # the index as the step before leaves it: keys in the tail [t_lo, L - W) assigned, scanned after the buckets
    stepped = case["assign"].clone()
    assign_tail_reference(*bench.tail_of(case, stepped))
    want_assign = stepped.clone()
    assign_ahead_reference(*bench.tail_of(case, want_assign))
    top = bench.references(case)[1].clone()
    # a tail key's bucket among the chosen ones in every (row, KV head), so that the tail test finds a key
    start = (case["lengths"] - case["window"]).long()
    for b in range(batch):
        for h in range(top.shape[1]):
            tail = stepped[b, h, int(case["t_lo"][b]):int(start[b])]
            tail = tail[tail < bench.TINY["buckets"]]
            if len(tail) and int(tail[0]) not in top[b, h].tolist():
                top[b, h, -1] = tail[0]
    for splits, block_n in ((1, 16), (3, 64), (5, 16)):  # several chunks a program, the default chunk, many programs
        assign = stepped.clone()
        out, _, counts = bucket_sparse_decode_triton(
            case["q"], case["k"], case["v"], case["sink_ids"], case["sink_counts"], case["offsets"], case["ids"],
            top, 0, sliding=(case["lengths"], case["window"], case["t_lo"], assign), splits=splits, block_n=block_n,
            fused_merge=splits <= 3, ahead=(case["centroids"], case["inv_freq"], 1.0, bench.SPAN))
        want, read = index_decode_reference(case["q"], case["k"], case["v"], case["lengths"], case["window"], 1,
                                            stepped, top)
        err = float((out.float() - want.float()).abs().max())
        assert err < 2e-2, (seed, splits, block_n, err)
        assert torch.equal(assign, want_assign), (seed, splits, block_n)
        assert torch.equal(counts, bucket_sizes(case["offsets"]).gather(2, top).sum(-1)), (seed, splits, block_n)
        worst = max(worst, err)
        checked += 1
    for b in range(batch):
        lo, hi = int(case["t_lo"][b]), int(start[b])
        tail_hits += int(read[b, :, lo:hi].sum())
assert tail_hits > 0, "no tail key was read"
print("checked", checked, "worst", worst)
"""


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1])
def test_probe_picks_the_references_buckets_at_batches_1_to_3(part):
    """The probe's three launches (the tiled hidden layer, the logits, the rank in chunks): scores within float32
    rounding of the reference, the top-ℓ of its own scores (best first, ties to the lower index) and the reference's
    top-ℓ to that rounding, at batches 1 to 3 with rows of different lengths."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(PROBE, "cpu", interpret=True, part=part)
    assert int(out.split()[1]) == (5, 3)[part] and float(out.split("worst")[-1]) < 1e-6


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1, 2])
def test_rank_breaks_ties_to_the_lower_index(part):
    """Bit-equal scores within and across the rank's chunks, and a tie at 0 past the threshold: the rank keeps the
    lowest indices, as a stable sort does."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(RANK_TIES, "cpu", interpret=True, part=part)
    assert int(out.split()[-1]) > 0


@pytest.mark.triton
@pytest.mark.parametrize("part", [0, 1, 2])
def test_bucket_loop_matches_the_reference_with_the_update_ahead(part):
    """The bucket kernel (keys found a chunk ahead, the tail tested only on the chunks that reach it) with the update
    one step ahead in its launch: exact attention over the index's keys, the update's index and the key counts, at
    batches 1 to 3 with one to five programs a (row, KV head), a tail key read in every row."""
    pytest.importorskip("triton")
    from interpreted import run_script

    out = run_script(BUCKET, "cpu", interpret=True, part=part)
    assert int(out.split()[1]) == 3 and float(out.split("worst")[-1]) < 2e-2
