"""The decode contract: no host reads on the decode path, counter-based randomness that a
CUDA graph can replay, many query rows per call."""

from contextlib import contextmanager

import pytest
import torch
from conftest import random_qkv

import kvsieve
from kvsieve.core.registry import method_class
from kvsieve.core.rng import STREAM_TILE, RandomKey, RowStreams, seed_words
from kvsieve.core.sync import no_host_reads
from kvsieve.kernels.shared.triton_utils import uniforms as kernel_uniforms

# Every registered method, at the small settings it declares for ~100-300-key contexts (``small_config``);
# methods built from external artifacts (SAAP) are tested in their own modules (``contract_tested_in``).
ALL = sorted(n for n in kvsieve.methods() if not method_class(n).contract_tested_in)


# sketchwalk's sync-free decode (its Triton path) is variant=reconstruction's; its default, variant=authors, is
# a torch reference that decodes row by row with host-known lengths and keeps running averages over steps
# (docs/methods/sketchwalk.md): contract-tested in test_method_contract.py and test_sketchwalk_authors.py.
CONTRACT_SETTINGS = {"sketchwalk": {"variant": "reconstruction"}}


def spec_of(name):
    """The method at its declared ``small_config`` (and its contract settings), as a spec string."""
    return kvsieve.method(name, **method_class(name).small_config, **CONTRACT_SETTINGS.get(name, {})).spec


@contextmanager
def host_reads_raise():
    """Every way of turning a tensor into a host value raises (what a CUDA sync would be)."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def f(self, *a, **k):
            raise AssertionError(f"host read: Tensor.{name} on the decode path")
        return f

    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        with no_host_reads():
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("name", ALL)
def test_decode_reads_nothing_on_the_host(name, q_len):
    """The code path of CUDA devices, run on the CPU: no .item(), bool(t), int(t), tolist()."""
    q, k, v = random_qkv(batch=2, heads=6, kv_heads=2, n=300, d=16, dtype=torch.float32, seed=1)
    q4 = torch.randn(2, 6, q_len, 16, generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([300, 251])
    m = kvsieve.method(spec_of(name))
    state = m.new_state()
    key = RandomKey(5, (0, 3))
    m.decode(q4, k, v, lengths=lengths, seed=key, state=state, check_finite=False)  # first call fills state
    with host_reads_raise():
        for _ in range(2):
            out, stats = m.decode(q4, k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    assert out.shape == (2, 6, q_len, 16)
    assert torch.isfinite(out).all()
    assert 0 < stats.density <= 1 and stats.bytes_read > 0  # read after the call: numbers


@pytest.mark.parametrize("name", ALL)
def test_no_host_read_path_equals_the_cpu_path(name):
    """Sizing buffers by host-known bounds (GPU) instead of the values (CPU) changes nothing."""
    q, k, v = random_qkv(batch=2, heads=6, kv_heads=2, n=300, d=16, seed=3)
    lengths = torch.tensor([300, 260])
    m = kvsieve.method(spec_of(name))
    a, sa = m.decode(q, k, v, lengths=lengths, seed=RandomKey(1, (2,)))
    with no_host_reads():
        b, sb = m.decode(q, k, v, lengths=lengths, seed=RandomKey(1, (2,)), check_finite=False)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert sa.density == pytest.approx(sb.density) and sa.exact_rows == sb.exact_rows


@pytest.mark.parametrize("name", ALL)
def test_chunk_rows_equal_rows_decoded_one_at_a_time(name):
    """q [B, Hq, Q, d]: row j sees len − Q + 1 + j keys and draws what it draws on its own."""
    b, q_len, n = 2, 4, 300
    _, k, v = random_qkv(batch=b, heads=6, kv_heads=2, n=n, d=16, seed=4)
    q4 = torch.randn(b, 6, q_len, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    lengths = torch.tensor([300, 270])
    key = RandomKey(9, (1, 7))
    m = kvsieve.method(spec_of(name))
    chunk, stats = m.decode(q4, k, v, lengths=lengths, seed=key)
    state = m.new_state()
    rows = [m.decode(q4[:, :, j], k, v, lengths=lengths - q_len + 1 + j, seed=key, state=state)[0]
            for j in range(q_len)]
    torch.testing.assert_close(chunk, torch.stack(rows, dim=2), rtol=1e-9, atol=1e-11)
    assert stats.n_keys == pytest.approx(float((lengths[:, None] - torch.arange(3, -1, -1)).double().mean()))


def test_single_row_4d_query_equals_3d():
    q, k, v = random_qkv(batch=2, heads=6, kv_heads=2, n=100, d=16, seed=6)
    m = kvsieve.method("santa-prop:budget=16,tile_size=16")
    a, _ = m.decode(q, k, v, seed=3)
    b, _ = m.decode(q[:, :, None], k, v, seed=3)
    torch.testing.assert_close(a, b[:, :, 0], rtol=0, atol=0)


def test_key_mask_per_row_and_causal_default():
    """key_mask [B, N] for a chunk is the last row's; row j also drops the Q − 1 − j newest keys."""
    _, k, v = random_qkv(batch=1, heads=4, kv_heads=2, n=40, d=8, seed=7)
    q4 = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    mask = torch.ones(1, 40, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    dense = kvsieve.method("dense")
    out, _ = dense.decode(q4, k, v, key_mask=mask)
    for j in range(3):
        row_mask = mask.clone()
        row_mask[0, 40 - 2 + j:] = False
        ref, _ = dense.decode(q4[:, :, j], k, v, key_mask=row_mask)
        torch.testing.assert_close(out[:, :, j], ref)
    with pytest.raises(ValueError, match=r"key_mask: expected shape \[1, 40\] or \[1, 3, 40\]"):
        dense.decode(q4, k, v, key_mask=torch.ones(1, 2, 40, dtype=torch.bool))


def test_bad_layouts_name_the_argument():
    q, k, v = random_qkv(batch=1, heads=4, kv_heads=2, n=40, d=8)
    m = kvsieve.method("dense")
    with pytest.raises(ValueError, match=r"if k is \[B, N, Hkv, d\], pass k.transpose\(1, 2\)"):
        m.decode(q, k.transpose(1, 2), v.transpose(1, 2))
    with pytest.raises(ValueError, match=r"q: expected shape \[B, Hq, d\] or \[B, Hq, Q, d\]"):
        m.decode(q[0], k, v)
    with pytest.raises(ValueError, match=r"lengths: expected values in \[3, 40\]"):
        m.decode(torch.randn(1, 4, 3, 8, dtype=torch.float64), k, v, lengths=torch.tensor([2]))


def test_stats_stay_tensors_until_read():
    q, k, v = random_qkv(batch=2, heads=6, kv_heads=2, n=200, d=16)
    _, stats = kvsieve.method("random:budget=20").decode(q, k, v, seed=0, check_finite=False)
    assert isinstance(stats.raw("density"), torch.Tensor) and isinstance(stats.density, float)
    assert isinstance(stats.raw("bytes_read"), torch.Tensor) and isinstance(stats.bytes_read, int)
    assert isinstance(stats["exact_rows"], int) and stats.as_dict()["density"] == stats.density


# --- the counter-based generator ----------------------------------------------------------------


def test_row_streams_are_the_kernels_hash():
    """With a host key the row words feed the very hash the Triton kernels evaluate; the kernels key
    each batch row by its length first (``core.rng.length_words``)."""
    c = torch.arange(1000).view(2, 500)
    lengths = torch.tensor([700, 701])
    lo, hi = seed_words(123456789123)
    from kvsieve.core.rng import hash_uniform, length_words

    row_lo, row_hi = length_words(lo, hi, lengths)
    torch.testing.assert_close(hash_uniform(row_lo[:, None], row_hi[:, None], STREAM_TILE, c),
                               kernel_uniforms(123456789123, STREAM_TILE, c, lengths))
    assert not torch.equal(hash_uniform(lo, hi, STREAM_TILE, c), kernel_uniforms(123456789123, STREAM_TILE, c, lengths))


def test_device_counters_give_the_host_counters_words():
    host = RandomKey(7, (3, 11)).words()
    dev = RandomKey(7, (3, torch.tensor(11))).words()
    assert host[0] == int(dev[0]) and host[1] == int(dev[1])


def test_row_streams_uniform_independent_and_reproducible():
    n_rows, n = 64, 4096
    key = RandomKey(0, (1, 2))
    s = RowStreams(key, torch.arange(n_rows) // 2, torch.full((n_rows,), 1000) + torch.arange(n_rows) % 2)
    u = s.uniform(3, (2, n))
    assert u.shape == (n_rows, 2, n) and (u >= 0).all() and (u < 1).all()
    torch.testing.assert_close(u, s.uniform(3, (2, n)), rtol=0, atol=0)
    flat = u.flatten()
    # mean 1/2 and variance 1/12: 5 standard errors of n_rows·2·n draws
    se = (1 / 12) ** 0.5 / flat.numel() ** 0.5
    assert abs(float(flat.mean()) - 0.5) < 5 * se
    # rows, heads and streams are uncorrelated: a sample correlation of independent rows has standard
    # deviation 1/sqrt(n); over the 2016 row pairs their spread matches it and the largest stays
    # within the Bonferroni bound (6 sd: p < 1e-5 per test); single pairs within 5 sd
    bound = 5 / n ** 0.5
    corr = torch.corrcoef(u[:, 0, :])
    off = corr[torch.triu(torch.ones(n_rows, n_rows, dtype=torch.bool), 1)] * n ** 0.5
    assert abs(float(off.std()) - 1) < 5 / (2 * off.numel()) ** 0.5
    assert off.abs().max() < 6
    assert abs(float(torch.corrcoef(torch.stack([u[0, 0], u[0, 1]]))[0, 1])) < bound
    assert abs(float(torch.corrcoef(torch.stack([u[0, 0], s.uniform(4, (2, n))[0, 0]]))[0, 1])) < bound
    # a prefix of the last axis is the same draw (counters do not depend on its length)
    torch.testing.assert_close(s.uniform(3, (2, 100)), u[:, :, :100], rtol=0, atol=0)


def test_random_method_stays_unbiased_with_counter_streams():
    """The counter streams drive an unbiased estimator: mean over keys within 5 standard errors."""
    q, k, v = random_qkv(batch=1, heads=2, kv_heads=1, n=400, d=8, seed=11)
    m = kvsieve.method("random:budget=40,sink=0,window=0")
    exact, _ = kvsieve.method("dense").decode(q, k, v)
    outs = torch.stack([m.decode(q, k, v, seed=RandomKey(s))[0] for s in range(300)])
    # the ratio estimator is biased at O(1/b); compare against its own spread with a margin
    mean, se = outs.mean(0), outs.std(0) / 300 ** 0.5
    assert ((mean - exact).abs() < 5 * se + 0.02 * exact.abs().clamp(min=0.05)).all()


# --- on the GPU ---------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Methods with a GPU (Triton) path, and the reference methods that must still run sync-free there.
# the fused Bernoulli path (its small_config takes the reference path): PDL launches, the kT copy in the state
GPU_PATHS = ["dense:backend=triton", "santa-prop:budget=128", "santa-flash:budget=256",
             "bernoulli-qk:query=mean-group,values=santa-prop,budget=128,draws=8,backend=triton"]


GPU_SPECS = [spec_of(n) for n in ALL]


def _gpu_inputs(dtype=torch.bfloat16, n=2048, batch=1, q_len=1):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 9, q_len, 64, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(batch, 3, n, 64, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(batch, 3, n, 64, generator=g, device="cuda", dtype=dtype)
    lengths = torch.full((batch,), n, device="cuda", dtype=torch.int32)
    return q, k, v, lengths


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("spec", [*GPU_PATHS, *GPU_SPECS])
def test_gpu_decode_has_no_sync(spec, q_len):
    q, k, v, lengths = _gpu_inputs(q_len=q_len)
    m = kvsieve.method(spec)
    state = m.new_state()
    key = RandomKey(1, (0, 5))
    m.decode(q, k, v, lengths=lengths, seed=key, state=state, check_finite=False)  # compile, fill state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, stats = m.decode(q, k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.float()).all() and stats.density > 0


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("spec", [*GPU_PATHS, *GPU_SPECS])
def test_gpu_graph_replays_match_eager_calls(spec):
    """Capture one call; each replay, with new lengths (the next decode step) and a new device step
    counter, equals an eager call with them, and draws fresh numbers.

    The Triton santa kernels (Bernoulli's V stage among them) take their seed by value (host counters
    only) and key each row by its length, which the graph reads from device memory: a replayed step draws
    new numbers all the same."""
    q, k, v, lengths = _gpu_inputs()
    n = k.shape[2]
    m = kvsieve.method(spec)
    triton_seed_by_value = spec.startswith(("santa-prop", "santa-flash")) or (
        spec.startswith("bernoulli-qk") and "values=santa-prop" in spec and "backend=triton" in spec)
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    key = RandomKey(3, (0,)) if triton_seed_by_value else RandomKey(3, (0, step))
    state = m.new_state()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            m.decode(q, k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, stats = m.decode(q, k, v, lengths=lengths, seed=key, state=state, check_finite=False)
    outs = []
    for i in range(3):
        step.fill_(i)
        lengths.fill_(n - 3 + i)
        graph.replay()
        outs.append(out.clone())
    for i in range(3):
        step_i = torch.tensor(i, device="cuda")
        eager_key = key if triton_seed_by_value else RandomKey(3, (0, step_i))
        lengths_i = torch.full_like(lengths, n - 3 + i)
        ref, _ = m.decode(q, k, v, lengths=lengths_i, seed=eager_key, state=state, check_finite=False)
        if spec.startswith("santa-flash"):  # its folded merge adds tiles in atomic order: bf16 rounding may differ
            torch.testing.assert_close(outs[i], ref, rtol=2e-2, atol=2e-3)
        else:
            torch.testing.assert_close(outs[i], ref, rtol=0, atol=0)
    if m.stochastic:
        assert not torch.equal(outs[0], outs[1])  # fresh numbers per replayed step


def test_a_method_written_against_the_old_api_keeps_working():
    """``_decode(inputs, seed, state)`` with an int seed and a generator, one row per batch row."""
    from kvsieve.core.method import Method, read_stats
    from kvsieve.core.rng import as_generator

    seen = []

    class Jitter(Method):
        name = "test-jitter"
        stochastic = True

        def _decode(self, inputs, seed, state):
            seen.append((type(seed).__name__, inputs.q.shape[0]))
            assert inputs.q.dim() == 3 and inputs.k.shape[0] == inputs.q.shape[0]
            gen = as_generator(seed, inputs.q.device)
            noise = torch.rand(inputs.q.shape[:2], generator=gen, dtype=torch.float64)[..., None]
            out = inputs.weighted_values(inputs.probs(torch.float64)) + 1e-3 * noise
            return out, read_stats(inputs, inputs.key_mask[:, None, :].expand(-1, inputs.heads, -1))

    q, k, v = random_qkv(batch=2, heads=4, kv_heads=2, n=50, d=8)
    m = Jitter()
    a, _ = m.decode(q, k, v, seed=3)
    b, _ = m.decode(q, k, v, seed=3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c, stats = m.decode(torch.randn(2, 4, 3, 8, dtype=torch.float64), k, v, seed=RandomKey(3, (1, 2)))
    assert c.shape == (2, 4, 3, 8) and stats.n_keys == pytest.approx(49)  # rows see 48, 49, 50 keys
    assert seen == [("int", 2)] * 2 + [("int", 2)] * 3  # a key reaches it as an int, one row at a time


def test_tensor_seeds_per_batch_row():
    """A [B] int64 tensor of seeds (the runtime's per-row seeds in device memory) keys each batch row."""
    q, k, v = random_qkv(batch=3, heads=4, kv_heads=2, n=120, d=8, seed=12)
    m = kvsieve.method("random:budget=10,sink=2,window=2")
    seeds = torch.tensor([5, 6, 5], dtype=torch.int64)
    a, _ = m.decode(q, k, v, seed=seeds, check_finite=False)
    b, _ = m.decode(q, k, v, seed=seeds.clone(), check_finite=False)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c, _ = m.decode(q, k, v, seed=torch.tensor([5, 7, 5]), check_finite=False)
    torch.testing.assert_close(a[[0, 2]], c[[0, 2]], rtol=0, atol=0)  # a row depends on its own seed only
    assert not torch.allclose(a[1], c[1])
    with host_reads_raise():
        m.decode(q, k, v, seed=seeds, check_finite=False)
    assert all(kvsieve.method(name).graph_capturable for name in ("santa", "santa-prop", "santa-flash"))


@pytest.mark.parametrize("spec", ["santa-prop:budget=128", "santa-flash:budget=512", "dense"])
def test_kernel_path_launches_nothing_but_its_kernels(spec, monkeypatch):
    """On the kernel path ``m.decode`` adds no torch op to the kernels' launches (each would cost several
    µs of host time per call on CUDA and a node in a captured graph): inputs, the covered-row fallback
    and the stats are built from the kernels' outputs only when read. The kernels are stubbed here, so
    this runs on any machine; ``docs/results/studies/decode-contract/bench_api.py`` times the real thing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from kvsieve.kernels.santa import decode as santa_kernels
    from kvsieve.kernels.shared import dense as dense_kernels
    from kvsieve.methods.shared import backend

    b, hq, hkv, n, d = 2, 8, 2, 600, 64
    q, k, v = (torch.randn(b, hq, d), torch.randn(b, hkv, n, d), torch.randn(b, hkv, n, d))
    lens = torch.tensor([600, 90], dtype=torch.int32)
    out = torch.randn(b, hq, d)
    counts = torch.zeros(b, hq, n, dtype=torch.int32)
    counts[..., :40] = 1
    budgets = torch.full((b, hq, 3), 40, dtype=torch.int32)
    monkeypatch.setattr(backend, "triton_unsupported", lambda inputs, **limits: None)
    monkeypatch.setattr(santa_kernels, "santa_prop_triton", lambda *a, **kw: (out.clone(), counts, budgets))
    monkeypatch.setattr(santa_kernels, "santa_flash_triton", lambda *a, **kw: (out.clone(), counts))
    monkeypatch.setattr(dense_kernels, "dense_decode_triton", lambda *a, **kw: out.clone())
    monkeypatch.setattr(dense_kernels, "dense_short_rows_triton", lambda *a, **kw: None)
    m = kvsieve.method(spec, backend="triton")
    key = RandomKey(1, (0, 3))

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with CountOps() as counter:
        result, stats = m.decode(q, k, v, lengths=lens, seed=key, check_finite=False)
    # clone() is the stub's own op (the kernel's output)
    assert [op for op in counter.ops if "clone" not in op] == []
    assert stats.backend == "triton"
    with CountOps() as counter:
        density = stats.density  # the stats are real once read
    assert counter.ops and 0 < density <= 1
