"""The contract every registered method keeps (kvpress style: parametrized over ``kvsieve.methods()``).

A new method is tested by registering it. What the test needs to know about a method it reads from
the class (declared on :class:`kvsieve.Method`, documented there):

- ``small_config``: overrides that make the method sparse on these small contexts;
- ``exact_config``: the setting whose budget covers the context, which must give exact attention
  (or ``None`` with ``exact_note`` saying why no setting does);
- ``gqa_equivalent``: GQA gives the same output as the KV heads repeated (or ``gqa_note`` says why not);
- ``stochastic``: the estimate depends on ``seed``.

Batch rows: deterministic methods give every row what it gets alone with its keys cut to its own
length. A stochastic method's draws have the cache's width (``[B, H, N]`` uniforms, ...), so a row
alone is compared at the batch's cache width, with different garbage beyond its length, and with
per-row seeds (``seed=[s_0, ..., s_{B-1}]``: row b gets what it gets alone with ``seed=s_b``).

CPU only, small shapes, float64 where outputs are compared exactly.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kvsieve
from kvsieve.core.registry import method_class
from kvsieve.core.stats import StepStats

ALL_NAMES = kvsieve.methods()
# Methods built from external artifacts declare the module that tests them (checked below).
NAMES = [n for n in ALL_NAMES if not method_class(n).contract_tested_in]
N_KEYS = 160
D, DV = 16, 12  # a value head dim that differs from the key's catches layout assumptions


def build(name: str, **overrides):
    cls = method_class(name)
    return kvsieve.method(name, **{**cls.small_config, **overrides})


def qkv(batch=2, heads=4, kv_heads=2, n=N_KEYS, d=D, dv=DV, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, d, generator=g, dtype=torch.float64) * 2.0  # sharper than uniform
    k = torch.randn(batch, kv_heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, n, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def dense(q, k, v, **kw):
    return kvsieve.method("dense").decode(q, k, v, **kw)[0]


def assert_same(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# --- declarations ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in ALL_NAMES if n not in NAMES])
def test_methods_built_from_artifacts_name_their_contract_tests(name):
    from pathlib import Path

    declared = method_class(name).contract_tested_in
    module, _, why = declared.partition(":")
    assert module.startswith("tests/") and (Path(__file__).parents[1] / module).is_file(), declared
    assert why.strip(), f"{name}: say why the generic contract test cannot build it"


@pytest.mark.parametrize("name", NAMES)
def test_declarations_are_complete(name):
    cls = method_class(name)
    assert cls.name == name and cls.summary, f"{cls.__name__}: set name and summary"
    config_fields = {f.name for f in dataclasses.fields(cls.config_class)}
    assert set(cls.small_config) <= config_fields, f"{name}: small_config names unknown parameters"
    kvsieve.method(name, **cls.small_config)  # valid
    if cls.exact_config is None:
        assert cls.exact_note, f"{name}: exact_config is None; say why in exact_note"
    else:
        assert set(cls.exact_config) <= config_fields, f"{name}: exact_config names unknown parameters"
    if not cls.gqa_equivalent:
        assert cls.gqa_note, f"{name}: gqa_equivalent is False; say how GQA differs in gqa_note"


# --- shapes, dtypes, stats -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_output_shape_and_dtype(name, dtype):
    q, k, v = qkv(dtype=dtype)
    out, stats = build(name).decode(q, k, v, lengths=torch.tensor([N_KEYS, 97]), seed=0)
    assert out.shape == (2, 4, DV) and out.dtype == dtype
    assert torch.isfinite(out).all()
    # An estimate of softmax-weighted values stays within a few value norms of the exact output.
    exact = dense(q, k, v, lengths=torch.tensor([N_KEYS, 97])).double()
    scale = v.double().norm(dim=-1).amax()
    assert ((out.double() - exact).norm(dim=-1) <= 4 * scale).all()
    assert isinstance(stats, StepStats)


@pytest.mark.parametrize("name", NAMES)
def test_stats_present_and_sane(name):
    q, k, v = qkv(batch=2, heads=6, kv_heads=2)
    lengths = torch.tensor([N_KEYS, 90])
    _, st = build(name).decode(q, k, v, lengths=lengths, seed=0)
    for field in ("n_keys", "k_rows_scored", "v_rows_read", "kv_rows_read", "density", "kv_density",
                  "bytes_read", "backend", "exact_rows"):
        assert field in st, field
        assert st[field] == getattr(st, field)
    as_dict = st.as_dict()
    assert set(as_dict) == set(st)
    mean_n = float(lengths.double().mean())
    assert st.n_keys == pytest.approx(mean_n)
    assert 0 < st.density <= 1 and 0 < st.kv_density <= 1
    # The union over a GQA group reads at least what one head reads, at most what all of them read.
    assert st.kv_density >= st.density - 1e-12
    assert st.kv_density <= min(1.0, 3 * st.density) + 1e-12
    assert 0 < st.v_rows_read <= st.kv_rows_read + 1e-9 <= mean_n + 1e-9
    assert 0 < st.k_rows_scored <= mean_n + 1e-9
    assert isinstance(st.bytes_read, int) and st.bytes_read > 0
    # K rows scored and V rows read are bounded by reading the whole cache once.
    full = int(lengths.sum()) * 2 * (D + DV) * q.element_size()
    assert st.bytes_read <= full
    assert isinstance(st.backend, str) and st.backend == "reference"  # the CPU runs the reference path
    assert isinstance(st.exact_rows, int) and 0 <= st.exact_rows <= 2
    for key, value in st.extra.items():
        assert isinstance(key, str)
        if isinstance(value, float):
            assert not math.isnan(value), key


@pytest.mark.parametrize("name", NAMES)
def test_sparse_config_reads_less_than_everything(name):
    """``small_config`` must make the method sparse here, or the other checks prove little."""
    if method_class(name).exact_config == {}:
        pytest.skip("exact as configured (reads everything by definition)")
    q, k, v = qkv()
    _, st = build(name).decode(q, k, v, seed=0)
    assert st.density < 1.0


# --- seeds, GQA, batch rows -------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_output(name):
    q, k, v = qkv()
    m = build(name)
    a, sa = m.decode(q, k, v, seed=7)
    b, sb = m.decode(q, k, v, seed=7)
    assert torch.equal(a, b)
    assert sa.density == sb.density
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(m.decode(q, k, v, seed=gen_a)[0], m.decode(q, k, v, seed=gen_b)[0])
    other, _ = m.decode(q, k, v, seed=8)
    if m.stochastic:
        assert not torch.equal(a, other), "a stochastic method must use its seed"
    else:
        assert torch.equal(a, other), "a deterministic method must not depend on the seed"


@pytest.mark.parametrize("name", NAMES)
def test_gqa_equals_repeated_kv_heads(name):
    cls = method_class(name)
    if not cls.gqa_equivalent:
        pytest.skip(f"declared: {cls.gqa_note}")
    q, k, v = qkv(batch=2, heads=6, kv_heads=2)
    m = build(name)
    lengths = torch.tensor([N_KEYS, 111])
    gqa, st_gqa = m.decode(q, k, v, lengths=lengths, seed=5)
    rep, st_rep = m.decode(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), lengths=lengths,
                           seed=5)
    # 1e-6, not 1e-10: methods that score in float32 (magicpig's cosines) round differently when
    # the group's matmul is batched differently.
    assert_same(gqa, rep, tol=1e-6)
    assert st_gqa.density == pytest.approx(st_rep.density)


@pytest.mark.parametrize("name", NAMES)
def test_batch_rows_equal_rows_alone(name):
    q, k, v = qkv(batch=3, heads=4, kv_heads=2, seed=1)
    lengths = torch.tensor([N_KEYS, 123, 70])
    seeds = [11, 12, 13]
    m = build(name)
    out, st = m.decode(q, k, v, lengths=lengths, seed=seeds)
    garbage = torch.Generator().manual_seed(99)
    alone_density = []
    for b in range(3):
        n = int(lengths[b])
        kb, vb = k[b:b + 1].clone(), v[b:b + 1].clone()
        kb[:, :, n:] = torch.randn(kb[:, :, n:].shape, generator=garbage, dtype=kb.dtype)
        vb[:, :, n:] = torch.randn(vb[:, :, n:].shape, generator=garbage, dtype=vb.dtype)
        alone, st_b = m.decode(q[b:b + 1], kb, vb, lengths=lengths[b:b + 1], seed=seeds[b])
        assert_same(out[b:b + 1], alone)
        alone_density.append(st_b.density)
        if not m.stochastic:  # also with the keys cut to the row's length
            cut, _ = m.decode(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], seed=seeds[b])
            assert_same(out[b:b + 1], cut)
    assert st.density == pytest.approx(sum(alone_density) / 3)


@pytest.mark.parametrize("name", NAMES)
def test_left_padded_row_equals_the_row_alone(name):
    """Keys outside the mask never matter; a deterministic method also gives the unpadded row's answer."""
    q, k, v = qkv(batch=1, seed=2)
    m = build(name)
    # Page-aligned padding (as a paged cache has): quest's pages are cache positions, so a pad that is
    # not a multiple of the page size shifts the page grid and changes which keys share a page.
    n, pad = 120, 32
    g = torch.Generator().manual_seed(5)

    def padded_with_garbage():
        kp = torch.cat([torch.randn(1, 2, pad, D, generator=g, dtype=k.dtype), k[:, :, :n]], dim=2)
        vp = torch.cat([torch.randn(1, 2, pad, DV, generator=g, dtype=v.dtype), v[:, :, :n]], dim=2)
        return kp, vp

    mask = torch.arange(pad + n)[None] >= pad
    if method_class(name).prefix_only_note:
        with pytest.raises(ValueError, match="key_mask"):
            m.decode(q, *padded_with_garbage(), key_mask=mask, seed=4)
        return
    padded, st = m.decode(q, *padded_with_garbage(), key_mask=mask, seed=4)
    other_garbage, _ = m.decode(q, *padded_with_garbage(), key_mask=mask, seed=4)
    assert_same(padded, other_garbage)
    assert st.n_keys == n
    if not m.stochastic:
        alone, _ = m.decode(q, k[:, :, :n], v[:, :, :n], seed=4)
        assert_same(padded, alone)


def test_per_row_seeds_are_checked():
    q, k, v = qkv()
    m = kvsieve.method("random", **method_class("random").small_config)
    for bad in ([1], [1, 2, 3], [1.0, 2.0], torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), [True, False]):
        with pytest.raises(ValueError, match=r"seed: expected .* 2 ints \(one per batch row\)"):
            m.decode(q, k, v, seed=bad)
    # A tensor of seeds is the same as the list.
    assert torch.equal(m.decode(q, k, v, seed=torch.tensor([4, 5]))[0], m.decode(q, k, v, seed=[4, 5])[0])


# --- exactness when the budget covers the context -----------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_budget_covering_the_context_is_exact(name):
    cls = method_class(name)
    q, k, v = qkv(batch=2, heads=6, kv_heads=2, seed=3)
    lengths = torch.tensor([N_KEYS, 101])
    covering = cls.covering_config(N_KEYS)
    if covering is None:
        pytest.skip(f"declared inexact: {cls.exact_note}")
    m = build(name, **covering)
    out, st = m.decode(q, k, v, lengths=lengths, seed=0)
    assert_same(out, dense(q, k, v, lengths=lengths), tol=1e-12)
    assert st.density == pytest.approx(1.0)


# --- bad input --------------------------------------------------------------------------------


BAD_INPUTS = [
    (lambda q, k, v: (q, k.transpose(1, 2), v.transpose(1, 2)),
     r"k: expected shape \[B, Hkv, N, d\] .* got \(2, 40, 2, 16\); if k is \[B, N, Hkv, d\]"),
    (lambda q, k, v: (q[0], k, v), r"q: expected shape \[B, Hq, d\]"),
    (lambda q, k, v: (q, k[0], v), r"k: expected shape \[B, Hkv, N, d\]"),
    (lambda q, k, v: (q, k, v[..., 0]), r"v: expected shape \[B, Hkv, N, dv\]"),
    (lambda q, k, v: (q, k, v[:, :, :10]), r"v: shape .* does not match k"),
    (lambda q, k, v: (q[..., :6], k, v), r"k: head dim"),
    (lambda q, k, v: (q[:, :3], k, v), r"q: 3 query heads is not a multiple of k's 2 KV heads"),
    (lambda q, k, v: (q.float(), k, v), r"q, k, v: expected one dtype"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), r"q: expected dtype"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
@pytest.mark.parametrize("name", NAMES)
def test_bad_input_names_the_argument(name, case):
    mutate, message = BAD_INPUTS[case]
    q, k, v = mutate(*qkv(n=40))
    with pytest.raises(ValueError, match=message):
        build(name).decode(q, k, v, seed=0)


@pytest.mark.parametrize("name", NAMES)
def test_bad_lengths_masks_and_values_name_the_argument(name):
    q, k, v = qkv(n=40)
    m = build(name)
    with pytest.raises(ValueError, match=r"lengths: expected values in \[1, 40\]"):
        m.decode(q, k, v, lengths=torch.tensor([41, 3]), seed=0)
    with pytest.raises(ValueError, match=r"lengths: expected shape \[2\]"):
        m.decode(q, k, v, lengths=torch.tensor([4]), seed=0)
    with pytest.raises(ValueError, match=r"key_mask: every batch row needs at least one valid key"):
        m.decode(q, k, v, key_mask=torch.zeros(2, 40, dtype=torch.bool), seed=0)
    bad_v = v.clone()
    bad_v[1, 0, 3, 0] = math.nan
    with pytest.raises(ValueError, match=r"v: contains NaN or infinite values"):
        m.decode(q, k, bad_v, seed=0)
    with pytest.raises(ValueError, match=r"seed: expected an int"):
        m.decode(q, k, v, seed=1.5)


# --- inside a model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    """A randomly initialised 2-layer Llama with GQA (4 query / 2 KV heads), built in the test."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("name", NAMES)
def test_generates_inside_sparsify_on_a_tiny_llama(name, tiny_llama):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (2, 60), generator=g)
    attention_mask = torch.ones_like(ids)
    if not method_class(name).prefix_only_note:
        attention_mask[1, :9] = 0  # left padding on the second row
    new = 3
    m = build(name)
    with torch.no_grad(), kvsieve.sparsify(tiny_llama, m, seed=1) as session:
        out = tiny_llama.generate(ids, attention_mask=attention_mask, max_new_tokens=new, do_sample=False,
                                  pad_token_id=0)
    assert out.shape == (2, 60 + new)
    assert session.records, "the method never ran"
    steps = {r["step"] for r in session.records}
    assert len(steps) == new - 1  # every generated token after the first ran the method, in both layers
    # every layer but those the method itself keeps exact (sketchwalk's dense_layers)
    assert {r["layer"] for r in session.records} == {0, 1} - set(getattr(m.config, "dense_layers", ()))
    for rec in session.records:
        assert 0 < rec["density"] <= 1 and rec["backend"] == "reference"
