"""SAAP's device index: keys join their buckets as they leave the window, in place, with fixed shapes.

The update equals a build from scratch at the new length (same windows); a ragged batch equals its rows
run alone, through the method and through ``kvsieve.generate`` on a tiny model; the Triton update and the
bucket kernel's tail scan equal their references (interpreter, and on CUDA); bad artifacts are refused.
"""

from __future__ import annotations

import pytest
import torch
from saap_helpers import exact, qkv, tiny_llama, write_artifacts

import kvsieve
from kvsieve import CallContext
from kvsieve.kernels.saap.buckets import build_csr
from kvsieve.kernels.saap.index import assign_tail_reference, build_assign, index_decode_reference


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    return write_artifacts(tmp_path_factory.mktemp("saap_idx"), heads=4, kv_heads=2, clusters=8)


def members(assign: torch.Tensor, lo: torch.Tensor, sink: int) -> list[list[set[int]]]:
    """Per (row, KV head): the set of (position, bucket) pairs of the indexed keys [sink, lo_b)."""
    out = []
    for b in range(assign.shape[0]):
        out.append([{(p, int(assign[b, h, p])) for p in range(sink, int(lo[b]))} for h in range(assign.shape[1])])
    return out


def test_index_update_equals_a_rebuild_at_every_length(arts):
    """Steps of one key (and a jump of K's shape by 30) bring the index where a build at that length with
    the same windows puts it; the method's output then equals attention over the rebuilt index's keys."""
    q, k, v = qkv(2, 4, 2, 900, seed=31)
    m = kvsieve.method(f"saap:artifacts={arts},probes=3")
    state = m.new_state()
    start = torch.tensor([700, 610])
    cent = m.artifacts.on_device(1, "centroids", q.device)
    freq, scaling = m.artifacts.rope.inv_freq, m.artifacts.rope.attention_scaling
    for step in [0, 1, 2, 3, 4, 5, 35, 36, 37, 100]:  # 5 → 35: K's shape grows by 30 in one call
        lengths = start + step
        n = int(lengths.max())
        out, stats = m.decode(q, k[:, :, :n], v[:, :, :n], lengths=lengths, state=state, context=CallContext(layer=1))
        idx = state.index
        window = idx.window
        assert window.tolist() == [max(63, 700 // 16), max(63, 610 // 16)]  # fixed at the build
        rebuilt, _ = build_assign(k[:, :, :n], lengths, window, 1, cent, freq, scaling, n)
        lo = (lengths - window).clamp(min=1)
        assert members(idx.assign, lo, 1) == members(rebuilt, lo, 1)
        scores = m.bucket_scores(kvsieve.core.inputs.check_decode_inputs(q, k[:, :, :n], v[:, :, :n],
                                                                         lengths=lengths), 1)
        buckets = torch.topk(scores.view(2, 2, 2, -1).sum(2), 3, dim=-1).indices
        ref, _ = index_decode_reference(q, k[:, :, :n], v[:, :, :n], lengths, window, 1, rebuilt, buckets)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-12)
        assert stats.saap_path == "device index"
    assert int(idx.done[0]) == 800 - window[0]  # keys [t_lo, 800 - W) joined their buckets


def test_update_is_idempotent_and_a_build_lists_every_indexed_key(arts):
    """Repeating a step (a runtime rewind, a graph warm-up) writes the same buckets; the CSR lists exactly
    the keys the build assigned."""
    q, k, v = qkv(1, 4, 2, 400, seed=32)
    m = kvsieve.method(f"saap:artifacts={arts},probes=2")
    cent = m.artifacts.on_device(2, "centroids", q.device)
    freq = m.artifacts.rope.inv_freq
    lengths, window = torch.tensor([300]), torch.tensor([63])
    assign, t_lo = build_assign(k, lengths, window, 1, cent, freq, 1.0, 400)
    offsets, ids = build_csr(assign[..., :300], 8)
    for h in range(2):
        listed = set(ids[0, h, : int(offsets[0, h, -1])].tolist())
        assert listed == set(range(1, 300 - 63))
    before = assign.clone()
    for t_hi in (240, 241, 241, 245, 243):  # lengths t_hi + 63
        assign_tail_reference(assign, k, t_lo, torch.tensor([t_hi + 63]), window, 4, cent, freq, 1.0)
    once = assign.clone()
    assign_tail_reference(assign, k, t_lo, torch.tensor([245 + 63]), window, 4, cent, freq, 1.0)
    assert torch.equal(assign, once)
    assert torch.equal(assign[..., :237], before[..., :237]) and (assign[..., 237:245] < 8).all()
    assert (assign[..., 245:] == 8).all()


def test_a_ragged_batch_equals_its_rows_alone(arts):
    q, k, v = qkv(3, 4, 2, 700, seed=33)
    spec = f"saap:artifacts={arts},probes=3"
    start = torch.tensor([650, 420, 90])  # the last row: shorter than sink + window, all exact at first
    m = kvsieve.method(spec)
    batch_state = m.new_state()
    row_states = [m.new_state() for _ in range(3)]
    for step in range(0, 45, 4):
        lengths = start + step
        n = int(lengths.max())
        out, stats = m.decode(q, k[:, :, :n], v[:, :, :n], lengths=lengths, state=batch_state,
                              context=CallContext(layer=2, capacity=700))
        for b in range(3):
            nb = int(lengths[b])
            one, _ = m.decode(q[b:b + 1], k[b:b + 1, :, :nb], v[b:b + 1, :, :nb], lengths=lengths[b:b + 1],
                              state=row_states[b], context=CallContext(layer=2))
            torch.testing.assert_close(out[b:b + 1], one, rtol=0, atol=1e-12)
    assert batch_state.index.assign.shape[-1] == 700  # sized by the capacity


def test_generate_ragged_batch_equals_rows_alone_and_is_declared_capturable(tmp_path):
    """``kvsieve.generate`` with rows of different lengths gives each row what it gets alone (CPU runtime);
    the method declares the captured path and its stats name the device index."""
    model = tiny_llama(heads=4, kv_heads=2, layers=3, seed=1)
    folder = write_artifacts(tmp_path, heads=4, kv_heads=2, clusters=8, model=model)
    spec = f"saap:artifacts={folder},probes=2,window_min=16,window=16"
    assert kvsieve.method(spec).graph_capturable
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 256, (n,), generator=g) for n in (150, 97)]
    both = kvsieve.generate(model, rows, spec, max_new_tokens=24)
    for b, row in enumerate(rows):
        alone = kvsieve.generate(model, [row], spec, max_new_tokens=24)
        assert torch.equal(both.tokens[b, :24], alone.tokens[0, :24])
    paths = {r.get("saap_path") for r in both.stats.records}
    assert paths == {"device index", "layer 0 runs exact attention (the paper)"}


def test_artifacts_of_another_shape_name_both_shapes(tmp_path):
    model = tiny_llama(heads=4, kv_heads=2, layers=3)
    folder = write_artifacts(tmp_path, heads=4, kv_heads=4, clusters=8)
    with pytest.raises(ValueError, match=r"kv_heads.*4.*this model.*kv_heads.*2"):
        kvsieve.sparsify(model, f"saap:artifacts={folder}").__enter__()


def test_left_padding_is_refused_by_the_method_and_served_apart_by_the_driver(arts):
    q, k, v = qkv(2, 4, 2, 300, seed=34)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, :40] = False
    with pytest.raises(ValueError, match="key_mask: saap needs each row's valid keys to be a prefix"):
        kvsieve.method(f"saap:artifacts={arts}").decode(q, k, v, key_mask=mask, context=CallContext(layer=1))
    out, _ = kvsieve.method(f"saap:artifacts={arts},probes=8").decode(q, k, v, lengths=torch.tensor([300, 260]),
                                                                       context=CallContext(layer=1))
    torch.testing.assert_close(out.double(), exact(q, k, v, torch.tensor([300, 260])), rtol=0, atol=1e-12)


INDEX_KERNEL_CASES = r"""
import torch
from kvsieve.kernels.saap.buckets import build_csr, bucket_sparse_decode_triton
from kvsieve.kernels.saap.index import (assign_ahead_reference, assign_ahead_triton, assign_tail_parallel_triton,
                                        assign_tail_reference, assign_tail_triton, build_assign,
                                        index_decode_reference)
from kvsieve.kernels.saap.probe import probe_scores_triton
dev = "{device}"
g = torch.Generator().manual_seed(0)
worst = 0.0
for (b, hq, hkv, d, n, c, probes, sink) in [(2, 4, 2, 16, 260, 12, 3, 1), (1, 6, 3, 32, 200, 40, 5, 0),
                                           (3, 2, 1, 16, 150, 8, 8, 2)]:
    cent = torch.nn.functional.normalize(torch.randn(hkv, c, d, generator=g), dim=-1).to(dev)
    freq = (1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))).to(dev)
    q = torch.randn(b, hq, d, generator=g).to(dev)
    k, v = (t.to(dev) for t in torch.randn(2, b, hkv, n, d, generator=g))
    start = torch.tensor([n - 60, n - 100, 40][:b], device=dev)  # row 2: shorter than its window at first
    window = torch.tensor([30, 50, 45][:b], device=dev)
    sink_ids = torch.arange(max(sink, 1), device=dev).expand(b, hkv, -1)  # shared by the heads: stride 0
    sink_counts = torch.full((b, hkv), sink, device=dev)
    probe_weights = [(torch.randn(*shape, generator=g) * 0.3).to(dev)
                     for shape in ((hkv, d, 24), (hkv, 24), (hkv, 24, c), (hkv, c))]
    for inv in (freq, None):  # de-roped keys, and keys compared as stored (the roped baseline)
        assign, t_lo = build_assign(k, start, window, sink, cent, inv, 1.3, n)
        offsets, ids = build_csr(assign, c)
        ref_assign = assign.clone()
        others = {{name: assign.clone() for name in ("parallel", "probe-parallel", "probe-serial")}}
        ahead, ahead_alone, ahead_ref = assign.clone(), assign.clone(), assign.clone()
        prev, prev_span = 0, 0  # no update ahead at the build
        for step in (1, 2, 5, 9, 13, 30, 55):  # a jump of up to 16 keys per call
            lengths = (start + step).int()
            span = 16 if step in (30, 55) else 4
            assign_tail_reference(ref_assign, k, t_lo, lengths, window, span, cent, inv, 1.3)
            assign_tail_triton(assign, k, t_lo, lengths, window, span, cent, inv, 1.3)
            assert torch.equal(assign, ref_assign), (assign != ref_assign).nonzero()[:5]
            # the parallel update (two launches; 16 centroids a block: several blocks), and both updates inside the
            # probe's launches (the method's paths: the parallel one at batch 1, the serial one else) at every batch
            assign_tail_parallel_triton(others["parallel"], k, t_lo, lengths, window, span, cent, inv, 1.3, block_c=16)
            for parallel in (True, False):
                name = "probe-parallel" if parallel else "probe-serial"
                probe_scores_triton(q, lengths, freq, 1.3, *probe_weights, kv_heads=hkv, probes=probes,
                                    tail=(others[name], k, t_lo, lengths, window, span, cent, inv, 1.3),
                                    parallel_tail=parallel)
            for name, got in others.items():
                assert torch.equal(got, ref_assign), (name, (got != ref_assign).nonzero()[:5])
            bk = torch.stack([torch.randperm(c, generator=g)[:probes] for _ in range(b * hkv)]).view(b, hkv, probes)
            bk = bk.to(dev)
            ref, _ = index_decode_reference(q, k, v, lengths, window, sink, assign, bk)
            out, _, _ = bucket_sparse_decode_triton(q, k, v, sink_ids, sink_counts, offsets, ids, bk, 0,
                                                    sliding=(lengths, window, t_lo, assign), block_n=16,
                                                    splits=3 if step % 2 else None)
            worst = max(worst, float((out - ref).abs().max()))
            if step - prev > prev_span:  # more keys left than were assigned ahead: the rest join now (the method's)
                for got in (ahead, ahead_alone, ahead_ref):
                    assign_tail_reference(got, k, t_lo, lengths, window, span, cent, inv, 1.3)
            prev, prev_span = step, span
            # the update one step ahead in the same launch (of its own, 16 centroids a block: several blocks): the
            # reference's writes, the same output whatever it writes (at or past L - W, where the step reads none)
            out, _, _ = bucket_sparse_decode_triton(q, k, v, sink_ids, sink_counts, offsets, ids, bk, 0,
                                                    sliding=(lengths, window, t_lo, ahead), block_n=16,
                                                    splits=3 if step % 2 else None,
                                                    ahead=(cent, inv, 1.3, span))
            ref, _ = index_decode_reference(q, k, v, lengths, window, sink, ahead, bk)
            worst = max(worst, float((out - ref).abs().max()))
            assign_ahead_reference(ahead_ref, k, t_lo, lengths, window, span, cent, inv, 1.3)
            assign_ahead_triton(ahead_alone, k, t_lo, lengths, window, span, cent, inv, 1.3, block_c=16)
            assert torch.equal(ahead, ahead_ref) and torch.equal(ahead_alone, ahead_ref), (ahead != ahead_ref).nonzero()
            # every key below the window start has its bucket, the step update's where that one assigned it (its
            # jumps of 17 and 25 keys at span 16 leave some unassigned)
            pos = torch.arange(n, device=dev)[None, None, :]
            below = ((pos < (lengths - window)[:, None, None]) & (pos >= t_lo[:, None, None])).expand(b, hkv, n)
            assert (ahead_ref[below] < c).all()
            both = below & (ref_assign < c)
            assert torch.equal(ahead_ref[both], ref_assign[both])
    # a row rewound below its build length: bucket keys the window now holds are read once
    lengths = start - 7
    ref, _ = index_decode_reference(q, k, v, lengths, window, sink, assign, bk)
    out, _, _ = bucket_sparse_decode_triton(q, k, v, sink_ids, sink_counts, offsets, ids, bk, 0,
                                            sliding=(lengths, window, t_lo, assign), block_n=16)
    worst = max(worst, float((out - ref).abs().max()))
print("worst", worst)
"""


@pytest.mark.triton
def test_index_kernels_match_their_references():
    """The Triton updates (serial and parallel), alone and inside the probe's launches, equal the torch update bit
    for bit (de-roped and as stored, spans 4 and 16), and so does the update one step ahead, alone and inside the
    bucket kernel's launch (below each window start it then holds the step update's buckets); the
    bucket kernel's tail scan (chosen buckets among the keys that joined after the build, CSR keys the window holds
    skipped, a row shorter than its window) equals attention over the reference's keys."""
    pytest.importorskip("triton")
    from interpreted import run_script

    worst = float(run_script(INDEX_KERNEL_CASES, "cpu", interpret=True).split("worst")[-1])
    assert worst < 1e-5


@pytest.mark.gpu
def test_index_kernels_on_cuda_match_their_references():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from interpreted import run_script

    worst = float(run_script(INDEX_KERNEL_CASES, "cuda", interpret=False).split("worst")[-1])
    assert worst < 1e-4


def test_the_bench_fits_a_random_weight_shape_once_and_reuses_it(tmp_path, monkeypatch):
    """``kvsieve bench e2e --methods saap:probes=2``: the bench fits its own model (random ids for text) into
    its cache folder, loads it on the next run, and hands the method the folder; bad specs fail first."""
    from kvsieve.bench.saap_fit import check_spec, needs_bench_fit, resolve_methods

    model = tiny_llama(heads=4, kv_heads=2, layers=3, seed=2)
    logs = []
    small = dict(clusters=8, prompt_tokens=300, hidden=16, steps=3, queries=32, kmeans_iters=2)
    import kvsieve.bench.saap_fit as saap_fit

    monkeypatch.setattr(saap_fit, "BENCH_FIT", {**saap_fit.BENCH_FIT, **small})

    def no_essays():
        raise FileNotFoundError("the bench fit must not need the essays (the GPU machine has none)")

    import kvsieve.fit.saap as fit_module
    monkeypatch.setattr(fit_module, "essay_split", no_essays)
    monkeypatch.setattr(fit_module, "essay_texts", no_essays)
    specs, fit = resolve_methods(["saap:probes=2", "quest"], model, "tiny", tmp_path, logs.append)
    again, fit2 = resolve_methods(["saap-kmeans:probes=3"], model, "tiny", tmp_path, logs.append)
    assert not fit["cached"] and fit["fit_s"] > 0 and fit["settings"]["clusters"] == 8
    assert fit2["cached"] and fit2["artifacts"] == fit["artifacts"]
    assert specs["quest"] == "quest" and specs["saap:probes=2"] == f"saap:artifacts={fit['artifacts']},probes=2"
    m = kvsieve.method(specs["saap:probes=2"])
    m.check_model(model)  # fitted on this very model
    with pytest.raises(ValueError, match="weights"):
        m.check_model(tiny_llama(heads=4, kv_heads=2, layers=3, seed=5))
    assert needs_bench_fit("saap") and not needs_bench_fit(f"saap:artifacts={tmp_path}")
    check_spec("saap:probes=32")
    with pytest.raises(ValueError, match="probes"):
        check_spec("saap:probes=-1")


def test_torch_kmeans_is_lloyds_fixed_point_and_checks_its_input():
    from kvsieve.fit.saap import FitConfig, spherical_kmeans_torch

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1000, 16, generator=g) + 0.5
    one = spherical_kmeans_torch(x, 1, niter=3, seed=0)  # one bucket: the normalised mean
    torch.testing.assert_close(one[0], torch.nn.functional.normalize(x.mean(0), dim=0))
    cent = spherical_kmeans_torch(x, 5, niter=30, seed=0)
    torch.testing.assert_close(cent.norm(dim=-1), torch.ones(5))
    assign = (x @ cent.T).argmax(-1)  # converged: a further round moves nothing
    again = torch.stack([torch.nn.functional.normalize(x[assign == c].sum(0), dim=0) for c in range(5)])
    torch.testing.assert_close(again, cent)
    with pytest.raises(ValueError, match="larger than the 3 keys"):
        spherical_kmeans_torch(torch.randn(3, 4), 5, niter=2, seed=0)
    with pytest.raises(ValueError, match="kmeans_backend"):
        FitConfig(kmeans_backend="cuda").validate()
    assert FitConfig().fingerprint() == FitConfig(kmeans_backend="faiss").fingerprint()
    assert FitConfig().fingerprint() != FitConfig(kmeans_backend="torch").fingerprint()


def test_bench_cli_takes_saap_without_artifacts_and_checks_the_rest(capsys):
    from kvsieve.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("the CPU machine's answer: the spec passes, then no GPU")
    assert main(["bench", "e2e", "--methods", "saap:probes=32", "--baselines", "runtime"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err  # past the spec check: the bench fits the shape
    assert main(["bench", "e2e", "--methods", "saap:probes=-1"]) == 2
    assert "probes" in capsys.readouterr().err


def test_the_bench_fit_draws_a_peaked_models_prompts_as_the_bench_does():
    """A peaked model's bench fit clusters the keys of the tokens the bench serves: each prompt its first
    token then ids of the prompt vocabulary; other models' ids span the whole vocabulary."""
    from kvsieve.bench.peaked import BOS, PeakedAttention
    from kvsieve.bench.saap_fit import RandomTokens

    p = PeakedAttention(vocab=50)
    tok = RandomTokens(1000, peaked=p, prompt_tokens=64)
    ids = torch.tensor(tok("x" * 256)["input_ids"]).view(4, 64)
    assert (ids[:, 0] == BOS).all() and ids[:, 1:].min() >= 1 and ids[:, 1:].max() <= 50
    assert ids[:, 1:].unique().numel() > 40 and tok.source == "peaked-vocab50"
    flat = RandomTokens(1000)
    assert torch.tensor(flat("x" * 4000)["input_ids"]).max() > 50 and flat.source == "all-ids"
    with pytest.raises(ValueError, match="whole prompts"):
        tok("x" * 100)
    with pytest.raises(ValueError, match="prompt_tokens"):
        RandomTokens(1000, peaked=p)


AHEAD_METHOD_CASES = r"""
import tempfile
from pathlib import Path
import torch
import kvsieve
from kvsieve import CallContext
from kvsieve.core.sync import no_host_reads
from tests.saap_helpers import write_artifacts
dev = "{device}"
folder = Path(tempfile.mkdtemp())
write_artifacts(folder, heads=8, kv_heads=2, head_dim=32, clusters=16)
worst = 0.0
for seed, batch, n, start, capacity in [(0, 3, 420, [400, 300, 50], None), (1, 1, 330, [300], 330),
                                        (2, 2, 360, [340, 200], 360)]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 8, 32, generator=g).to(dev)
    k, v = (t.to(dev) for t in torch.randn(2, batch, 2, n, 32, generator=g))
    spec = f"saap:artifacts={{folder}},probes=4,window=63,window_scale=0.125,backend=triton"
    step_m, ahead_m = kvsieve.method(spec + ",index_update=step"), kvsieve.method(spec + ",index_update=ahead")
    step_s, ahead_s = step_m.new_state(), ahead_m.new_state()
    # one key a step, a repeated step (a graph warm-up, a rewind), and without a capacity a jump of K's shape
    # by 9 keys (more than the 4 assigned ahead: the rest join in the step)
    steps = (0, 1, 2, 2, 3, 7, 8, 17, 18, 19) if capacity is None else (0, 1, 2, 3, 3, 4, 5, 6)
    for step in steps:
        lengths = torch.tensor(start, device=dev) + step
        width = n if capacity else int(lengths.max())
        ctx = CallContext(layer=1, capacity=capacity)
        want, ws = step_m.decode(q, k[:, :, :width], v[:, :, :width], lengths=lengths, state=step_s, context=ctx,
                                 check_finite=False)
        with no_host_reads() if capacity else torch.no_grad():
            got, gs = ahead_m.decode(q, k[:, :, :width], v[:, :, :width], lengths=lengths, state=ahead_s,
                                     context=ctx, check_finite=False)
        assert gs["update"] == "ahead" and ws["update"] != "ahead", (gs["update"], ws["update"])
        worst = max(worst, float((got - want).abs().max()))
        # below each row's window start (what a step reads) the two indexes agree; the ahead one holds the next
        # keys to leave too, which the step's never reads
        a, b = ahead_s.index, step_s.index
        lo = (lengths - a.window).clamp(min=0)
        below = torch.arange(a.assign.shape[-1], device=dev)[None, :] < lo[:, None]
        assert torch.equal(a.assign.masked_fill(~below[:, None], -1), b.assign.masked_fill(~below[:, None], -1))
        ahead_rows = (lengths - a.window + 4 > a.tail_lo) & (lengths - a.window + 4 <= lengths)
        for r in ahead_rows.nonzero().flatten().tolist():
            end = int(lengths[r] - a.window[r] + 4)
            assert (a.assign[r, :, end - 4:end] < 16).all(), (r, a.assign[r, :, end - 4:end])
# a window below the 4 keys assigned ahead: the step's update instead
tiny = kvsieve.method(f"saap:artifacts={{folder}},probes=4,window=3,window_min=3,backend=triton,index_update=ahead")
_, st = tiny.decode(q, k, v, lengths=torch.tensor(start, device=dev) + 6, context=CallContext(layer=1))
assert st["update"] != "ahead"
print("worst", worst)
"""


@pytest.mark.triton
def test_the_update_one_step_ahead_gives_the_step_updates_outputs():
    """``index_update=ahead`` (the keys leaving the window assigned one step early, in the bucket attention's
    launch) against ``index_update=step``, call by call: the same outputs and the same index below each window start,
    ragged rows (one shorter than its window), repeated steps, K growing by more than the keys assigned ahead, and
    under ``no_host_reads`` with a capacity-sized cache."""
    pytest.importorskip("triton")
    from interpreted import run_script

    assert float(run_script(AHEAD_METHOD_CASES, "cpu", interpret=True).split("worst")[-1]) < 1e-5


@pytest.mark.gpu
def test_the_update_one_step_ahead_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from interpreted import run_script

    assert float(run_script(AHEAD_METHOD_CASES, "cuda", interpret=False).split("worst")[-1]) < 1e-4
