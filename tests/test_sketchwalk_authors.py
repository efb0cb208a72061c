"""``sketchwalk`` (variant=authors, the default) against an independent re-statement of the authors' code.

The re-statement below is written from what ``Escanord/SketchWalk``'s ``modeling_llama.py`` computes
(``LlamaAttention._hadamard_project`` / ``_fwht`` / ``_block_pool`` / ``_hadamard_attention_probs_block`` /
``_update_random_walk`` / ``_rw_prefill`` / ``_rw_decode`` and ``sdpa_attention_forward``), step by step with
loops, a butterfly Walsh–Hadamard transform and a hand-written linear-interpolation quantile, in float64.
It shares nothing with ``kvsieve.methods.sketchwalk.authors`` but the random draws of each layer's sketch
(signs and permutation: theirs come from torch's global generator, ours from a seed). No network.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.core.rng import derive_seed
from kvsieve.methods.sketchwalk import SketchWalkState, WalkState, authors

F64 = torch.float64


# -- the re-statement --------------------------------------------------------------------------------------


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh–Hadamard transform of a vector whose length is a power of two."""
    y = x.clone()
    n, h = y.shape[0], 1
    while h < n:
        for start in range(0, n, 2 * h):
            for i in range(start, start + h):
                a, b = y[i].clone(), y[i + h].clone()
                y[i], y[i + h] = a + b, a - b
        h *= 2
    return y


def project(x: torch.Tensor, signs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Their Hadamard projection of one vector: pad, random signs, transform, divide by √(n/m), keep m."""
    n, m = signs.shape[0], rows.shape[0]
    padded = torch.zeros(n, dtype=F64)
    padded[: x.shape[0]] = x
    return butterfly(padded * signs)[rows] / (n / m) ** 0.5


def block_mean(x: torch.Tensor, j: int, bs: int) -> torch.Tensor:
    """Their block pool: the block's rows summed, divided by the block size (zero padding)."""
    return x[j * bs:(j + 1) * bs].sum(0) / bs


def head_block_probs(q_rows, k_blocks, signs, rows, causal_rows=None):
    """One head: ``softmax_j(⟨Φq_r, Φk_j⟩ / √m / 100)`` for each row vector ``q_rows[r]``."""
    m = rows.shape[0]
    kp = [project(kb, signs, rows) for kb in k_blocks]
    out = torch.zeros(len(q_rows), len(k_blocks), dtype=F64)
    for r, qv in enumerate(q_rows):
        qp = project(qv, signs, rows)
        logits = torch.tensor([float(qp @ kj) * m ** -0.5 / 100 for kj in kp], dtype=F64)
        if causal_rows is not None:
            logits[causal_rows[r] + 1:] = -math.inf
        out[r] = torch.softmax(logits, 0)
    return out


def quantile(values: list[float], p: float) -> float:
    """Linear interpolation between order statistics (torch.nanquantile's default); NaN for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    pos = p * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


def sizes(frac: float, n_tok: int, bs: int, n: int) -> tuple[int, int]:
    tokens = max(1, int(frac * n_tok))
    return tokens, min(n, max(1, (tokens + bs - 1) // bs))


def attend(q, k, v, allowed, scale):
    """One head, one query: softmax over the allowed keys."""
    logits = (k @ q) * scale
    logits[~allowed] = -math.inf
    return torch.softmax(logits, 0) @ v


class Theirs:
    """Their prefill and decode for one request (batch row), layer by layer, in float64."""

    def __init__(self, cfg, d, group):
        self.cfg, self.d, self.group = cfg, d, group
        self.walk = None  # the previous sparse layer's prefill walk
        self.layers = {}  # per layer: a_blk, q_window (per head lists), sketch params

    def params(self, ordinal):
        return authors.sketch_params(self.d, self.cfg.hadamard_dim, derive_seed(self.cfg.seed, ordinal))

    def prefill_layer(self, ordinal, q, k, v, scale):
        """q [Hq, N, d], k/v [Hkv, N, ·]. Returns (A, W, kept blocks [n, n] causal, out [Hq, N, dv])."""
        cfg = self.cfg
        bs, hq, n_tok = cfg.block_size, q.shape[0], q.shape[1]
        n = (n_tok + bs - 1) // bs
        signs, rows, _ = self.params(ordinal)
        a = torch.zeros(n, n, dtype=F64)
        for h in range(hq):
            kh = k[h // self.group]
            qb = [block_mean(q[h], i, bs) for i in range(n)]
            kb = [block_mean(kh, j, bs) for j in range(n)]
            a += head_block_probs(qb, kb, signs, rows, list(range(n)) if cfg.causal else None)
        a = a / (a.sum(1, keepdim=True) + 1e-12)
        w = a.clone() if self.walk is None else self.walk.clone()
        for _ in range(cfg.degree):
            w = (1 - cfg.walk_damping) * a + cfg.walk_damping * (w @ a)
        self.walk = w
        win_tok, win_blk = sizes(cfg.window, n_tok, bs, n)
        _, sink_blk = sizes(cfg.sink, n_tok, bs, n)
        kept = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            others = [float(w[i, j]) for j in range(i + 1) if j >= sink_blk and j < i - win_blk + 1]
            th = 0.0 if i >= n - cfg.dense_last_blocks else quantile(others, 1 - cfg.kblocks_frac)
            for j in range(i + 1):
                kept[i, j] = bool(float(w[i, j]) > th)  # False against NaN
        out = torch.zeros(hq, n_tok, v.shape[-1], dtype=F64)
        for t in range(n_tok):
            allowed = torch.tensor([(kept[t // bs, s // bs] or t - win_tok < s or s < win_tok) and s <= t
                                    for s in range(n_tok)])
            for h in range(hq):
                out[h, t] = attend(q[h, t], k[h // self.group], v[h // self.group], allowed, scale)
        wq = min(cfg.query_window, n_tok)
        self.layers[ordinal] = {"a": a.clone(), "queries": [q[h, n_tok - wq:].clone() for h in range(hq)]}
        return a, w, kept, out

    def decode_layer(self, ordinal, q, k, v, scale):
        """q [Hq, d] the new token's query, k/v [Hkv, T, ·] with its key last. Returns (block row, running
        matrix, walk row, kept blocks [n], kept keys [T], out [Hq, dv])."""
        cfg = self.cfg
        bs, hq, n_tok = cfg.block_size, q.shape[0], k.shape[1]
        n = (n_tok + bs - 1) // bs
        signs, rows, _ = self.params(ordinal)
        layer = self.layers[ordinal]
        layer["queries"] = [torch.cat([layer["queries"][h], q[h][None]])[-cfg.query_window:] for h in range(hq)]
        r = torch.zeros(n, dtype=F64)
        for h in range(hq):
            kb = [block_mean(k[h // self.group], j, bs) for j in range(n)]
            r += head_block_probs(list(layer["queries"][h]), kb, signs, rows).sum(0)
        r = r / (r.sum() + 1e-12)
        a = layer["a"]
        if n > a.shape[0]:  # new blocks: zero columns, rows equal to this step's row
            grown = torch.zeros(n, n, dtype=F64)
            grown[: a.shape[0], : a.shape[0]] = a
            grown[a.shape[0]:] = r
            a = grown
        c = min((n_tok - 1) // bs, n - 1)
        step = (n_tok - 1) % bs
        alpha = 1.0 if step == 0 else 1.0 / (step + 1)
        a[c] = (1 - alpha) * a[c] + alpha * r
        a[c] = a[c] / max(float(a[c].sum()), 1e-12)
        a[:, c] = (1 - alpha) * a[:, c] + alpha * r
        a = a / a.sum(1, keepdim=True).clamp(min=1e-12)
        layer["a"] = a
        w = r.clone()
        for _ in range(cfg.degree):
            w = (1 - cfg.walk_damping) * r + cfg.walk_damping * (w @ a)
        win_tok, win_blk = sizes(cfg.window, n_tok, bs, n)
        _, sink_blk = sizes(cfg.sink, n_tok, bs, n)
        qb = (n_tok - 1) // bs
        others = [float(w[j]) for j in range(n) if j >= sink_blk and not (qb - win_blk + 1 <= j <= qb)]
        th = quantile(others, 1 - cfg.kblocks_frac)
        kept = torch.tensor([float(w[j]) > th or j < sink_blk or qb - win_blk + 1 <= j <= qb for j in range(n)])
        keys = torch.tensor([bool(kept[s // bs]) or s < win_tok for s in range(n_tok)])
        out = torch.stack([attend(q[h], k[h // self.group], v[h // self.group], keys, scale) for h in range(hq)])
        return r, a.clone(), w, kept, keys, out


# -- helpers ----------------------------------------------------------------------------------------------


def layer_data(n_layers, b, hq, hkv, n_tok, d, seed, needles=None, bs=16):
    """Random q/k/v per layer; ``needles[l]``: a key block of layer l that every query attends to."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for layer in range(n_layers):
        q = torch.randn(b, hq, n_tok + 1, d, generator=g, dtype=F64)
        k = torch.randn(b, hkv, n_tok + 1, d, generator=g, dtype=F64)
        v = torch.randn(b, hkv, n_tok + 1, d, generator=g, dtype=F64)
        if needles is not None:
            u = torch.randn(d, generator=g, dtype=F64)
            u = u / u.norm()
            j = needles[layer]
            q += 8.0 * u
            k[:, :, j * bs:(j + 1) * bs] += 16.0 * u
        data.append((q, k, v))
    return data


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    union = (a | b).sum()
    return 1.0 if union == 0 else float((a & b).sum() / union)


def run_both(spec_kw, shape, n_layers, seed, needles=None, decode_steps=2):
    """Ours and theirs over ``n_layers`` sparse layers: a prompt of N tokens, then ``decode_steps`` tokens.
    Returns per-layer comparisons (ours, theirs) as dicts of tensors."""
    b, hq, hkv, n_tok, d = shape
    m = kvsieve.method("sketchwalk", **spec_kw)
    cfg = m.config
    data = layer_data(n_layers, b, hq, hkv, n_tok + decode_steps, d, seed, needles, cfg.block_size)
    scale = d ** -0.5
    ours, theirs = {"prefill": [], "decode": []}, {"prefill": [], "decode": []}
    states = [SketchWalkState() for _ in range(n_layers)]
    forward = WalkState()
    refs = [Theirs(cfg, d, hq // hkv) for _ in range(b)]
    for layer, (q, k, v) in enumerate(data):
        out, stats = m.prefill(q[:, :, :n_tok], k[:, :, :n_tok], v[:, :, :n_tok], scale=scale,
                               state=states[layer], context=CallContext(forward=forward), sparse=True)
        st = states[layer].authors
        w = forward.walk
        sel = authors.prefill_selection(w, n_tok, block_size=cfg.block_size, sink=cfg.sink, window=cfg.window,
                                        kblocks_frac=cfg.kblocks_frac, dense_last_blocks=cfg.dense_last_blocks)
        ours["prefill"].append({"a": st.prompt_blocks, "w": w, "kept": sel.blocks, "out": out, "phi": st.phi})
        per_row = [ref.prefill_layer(layer, q[i, :, :n_tok], k[i, :, :n_tok], v[i, :, :n_tok], scale)
                   for i, ref in enumerate(refs)]
        theirs["prefill"].append({"a": torch.stack([p[0] for p in per_row]), "w": torch.stack([p[1] for p in per_row]),
                                  "kept": torch.stack([p[2] for p in per_row]),
                                  "out": torch.stack([p[3] for p in per_row])})
    for step in range(decode_steps):
        t = n_tok + step + 1  # keys after this token
        forward = WalkState()
        for layer, (q, k, v) in enumerate(data):
            ctx = CallContext(forward=forward)
            out, stats = m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], scale=scale, state=states[layer],
                                  context=ctx)
            per_row = [ref.decode_layer(layer, q[i, :, t - 1], k[i, :, :t], v[i, :, :t], scale)
                       for i, ref in enumerate(refs)]
            n = -(-t // cfg.block_size)
            ours["decode"].append({"a": running_matrix(states[layer], n), "out": out})
            theirs["decode"].append({"a": torch.stack([p[1] for p in per_row]), "w": [p[2] for p in per_row],
                                     "kept": [p[3] for p in per_row], "keys": [p[4] for p in per_row],
                                     "out": torch.stack([p[5] for p in per_row]), "step": step, "layer": layer})
    return m, data, ours, theirs


def running_matrix(state: SketchWalkState, n: int) -> torch.Tensor:
    """The running block matrix ``[B, n, n]`` of whichever decode path ran (the batched one keeps it as
    ``diag(σ)·U``)."""
    dst = state.authors_device
    if dst is not None:
        return dst.sigma[:, :n, None] * dst.u[:, :n, :n]
    return state.authors.blocks[:, :n, :n].clone()


CASES = [
    # (config overrides, (B, Hq, Hkv, N, d), layers, seed)
    ({"block_size": 16}, (1, 4, 2, 200, 32), 3, 0),
    ({"block_size": 16, "hadamard_dim": 16}, (2, 4, 4, 173, 32), 2, 1),
    ({"block_size": 32, "window": 0.1, "sink": 0.05, "kblocks_frac": 0.3, "degree": 2, "walk_damping": 0.6,
      "query_window": 5}, (1, 2, 1, 333, 16), 3, 2),
    ({"block_size": 16, "causal": True, "dense_last_blocks": 2}, (1, 4, 2, 190, 24), 2, 3),
]


@pytest.mark.parametrize("kw,shape,n_layers,seed", CASES)
def test_sketches_scores_walks_kept_blocks_and_outputs_match_theirs(kw, shape, n_layers, seed):
    m, data, ours, theirs = run_both(kw, shape, n_layers, seed)
    d = shape[-1]
    for layer, (o, t) in enumerate(zip(ours["prefill"], theirs["prefill"], strict=True)):
        signs, rows, _ = authors.sketch_params(d, m.config.hadamard_dim, derive_seed(m.config.seed, layer))
        x = data[layer][0][0, 0, 5]
        torch.testing.assert_close(o["phi"] @ x, project(x, signs, rows), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(o["a"], t["a"], atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(o["w"], t["w"], atol=1e-12, rtol=1e-10)
        assert jaccard(o["kept"], t["kept"]) == 1.0, f"layer {layer}"
        torch.testing.assert_close(o["out"], t["out"], atol=1e-10, rtol=1e-10)
    for o, t in zip(ours["decode"], theirs["decode"], strict=True):
        torch.testing.assert_close(o["a"], t["a"], atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(o["out"], t["out"], atol=1e-10, rtol=1e-10)


def test_decode_walk_rows_and_kept_blocks_match_theirs():
    kw, shape, n_layers, seed = CASES[0]
    m, data, ours, theirs = run_both(kw, shape, n_layers, seed, decode_steps=1)
    cfg = m.config
    q, k, v = data[0]
    n_tok = shape[3]
    # our decode step, called directly on the state our prefill leaves, for its walk row and kept blocks
    state, forward = SketchWalkState(), WalkState()
    ctx = CallContext(forward=forward)
    m.prefill(q[:, :, :n_tok], k[:, :, :n_tok], v[:, :, :n_tok], scale=None, state=state, context=ctx,
              sparse=False)
    res = authors.decode_row(state.authors, 0, q[0, :, n_tok], k[0, :, :n_tok + 1], v[0, :, :n_tok + 1],
                             block_size=cfg.block_size, beta=cfg.walk_damping, degree=cfg.degree,
                             query_window=cfg.query_window, sink=cfg.sink, window=cfg.window,
                             kblocks_frac=cfg.kblocks_frac, scale=shape[-1] ** -0.5, dtype=F64)
    t = theirs["decode"][0]
    torch.testing.assert_close(res.walk, t["w"][0], atol=1e-12, rtol=1e-10)
    assert torch.equal(res.kept_blocks, t["kept"][0])
    assert torch.equal(res.kept_tokens, t["keys"][0])


def test_planted_needle_per_layer_is_kept_in_prefill_and_decode():
    """One dominant key block per layer: theirs and ours keep it for every query block after it, prefill and
    decode, in every layer."""
    needles = [3, 7, 5, 9]
    bs, n_tok = 16, 320
    m, data, ours, theirs = run_both({"block_size": bs}, (1, 4, 2, n_tok, 32), len(needles), 4, needles=needles)
    for layer, j in enumerate(needles):
        for side in (ours, theirs):
            kept = side["prefill"][layer]["kept"][0]
            assert kept[j:, j].all(), f"layer {layer}: prefill drops the needle block {j}"
        assert jaccard(ours["prefill"][layer]["kept"], theirs["prefill"][layer]["kept"]) == 1.0
    for t in theirs["decode"]:
        assert t["kept"][0][needles[t["layer"]]], f"layer {t['layer']}: decode drops the needle"
    for o, t in zip(ours["decode"], theirs["decode"], strict=True):
        torch.testing.assert_close(o["out"], t["out"], atol=1e-10, rtol=1e-10)


# -- parameters, state, edge cases ------------------------------------------------------------------------


@pytest.mark.parametrize("spec,message", [
    ("walk_damping=1.5", r"walk_damping: expected a value in \[0, 1\]"),
    ("walk_damping=-0.1", r"walk_damping: expected a value in \[0, 1\]"),
    ("degree=0", r"degree: expected an integer >= 1"),
    ("query_window=0", r"query_window: expected an integer >= 1"),
    ("sink=0", r"sink: expected a value in \(0, 1\)"), ("window=1", r"window: expected a value in \(0, 1\)"),
    ("kblocks_frac=1.2", r"kblocks_frac: expected a value in \(0, 1\)"),
    ("hadamard_dim=0", r"hadamard_dim: expected an integer >= 1"),
    ("dense_last_blocks=-1", r"dense_last_blocks: expected an integer >= 0"),
    ("density=0.1", r"density: a parameter of variant=reconstruction"),
    ("variant=reconstruction,degree=2", r"degree: a parameter of variant=authors"),
])
def test_bad_parameters_name_the_parameter_and_range(spec, message):
    with pytest.raises(ValueError, match=message):
        kvsieve.method(f"sketchwalk:{spec}")


def test_defaults_are_the_authors_llama_config():
    cfg = kvsieve.method("sketchwalk").config
    assert (cfg.variant, cfg.hadamard_dim, cfg.kblocks_frac, cfg.window, cfg.sink, cfg.degree, cfg.walk_damping,
            cfg.query_window, cfg.block_size, cfg.causal, cfg.dense_last_blocks, cfg.dense_layers) == (
        "authors", 128, 0.125, 0.05, 0.025, 3, 0.25, 32, 64, False, 4, (0, 1))


def test_unnormalised_hadamard_scales_inner_products_by_n():
    phi = authors.sketch_matrix(128, 128, 7, dtype=F64)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 128, generator=g, dtype=F64)
    assert float((phi @ x) @ (phi @ y)) == pytest.approx(128 * float(x @ y), rel=1e-10)
    # each sparse layer draws its own sketch
    m = kvsieve.method("sketchwalk:block_size=16")
    q, k, v = layer_data(1, 1, 2, 2, 64, 16, 0)[0]
    states, forward = [SketchWalkState(), SketchWalkState()], WalkState()
    for st in states:
        m.prefill(q, k, v, scale=None, state=st, context=CallContext(forward=forward), sparse=True)
    assert not torch.equal(states[0].authors.phi, states[1].authors.phi)


def test_short_contexts_run_exact_and_say_so():
    m = kvsieve.method("sketchwalk:block_size=16")
    q, k, v = layer_data(1, 1, 4, 2, 60, 16, 0)[0]  # 61 tokens = 4 blocks: every query block is a dense last one
    out, stats = m.prefill(q[:, :, :61], k[:, :, :61], v[:, :, :61], scale=None, state=None, sparse=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, :61], k[:, :, :61].repeat_interleave(2, 1), v[:, :, :61].repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    assert "exact_reason" in stats.extra and stats.density == pytest.approx(1.0)
    # decode: 40 keys in blocks of 16 with a window of half the context: every block is a sink or window block
    m = kvsieve.method("sketchwalk:block_size=16,window=0.5")
    out, stats = m.decode(q[:, :, 39], k[:, :, :40], v[:, :, :40])
    assert "exact_reason" in stats.as_dict() and stats.density == pytest.approx(1.0)  # deferred: as_dict reads it
    dense, _ = kvsieve.method("dense").decode(q[:, :, 39], k[:, :, :40], v[:, :, :40])
    torch.testing.assert_close(out, dense, atol=1e-10, rtol=1e-10)


def test_decode_steps_must_come_in_order_and_restart_after_the_prompt():
    m = kvsieve.method("sketchwalk:block_size=16")
    q, k, v = layer_data(1, 1, 4, 2, 100, 16, 0)[0]
    state = SketchWalkState()
    m.prefill(q[:, :, :90], k[:, :, :90], v[:, :, :90], scale=None, state=state, sparse=False)
    first = [m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=state)[0] for t in (91, 92, 93)]
    with pytest.raises(ValueError, match="lengths: variant=authors keeps running averages"):
        m.decode(q[:, :, 94], k[:, :, :95], v[:, :, :95], state=state)
    again = [m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=state)[0] for t in (91, 92, 93)]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_beta_zero_is_the_one_hop_walk():
    a = torch.softmax(torch.randn(1, 6, 6, dtype=F64), -1)
    w = authors.damped_walk(a, torch.eye(6, dtype=F64)[None], a, 0.0, 3)
    torch.testing.assert_close(w, a)


def test_cuda_calls_name_why_the_reference_runs():
    m = kvsieve.method("sketchwalk")
    reason = m._authors_backend_reason(torch.device("cuda"), "auto")
    assert "variant=reconstruction" in reason and "torch reference" in reason
    assert m._authors_backend_reason(torch.device("cpu"), "auto") is None
    assert m._authors_backend_reason(torch.device("cuda"), "reference") is None


def test_batch_rows_equal_rows_alone_across_steps():
    """Two requests prefilled and decoded together give each what it gets alone, step after step (rows of
    different lengths in one decode call: the method contract test)."""
    m = kvsieve.method("sketchwalk:block_size=16")
    q, k, v = layer_data(1, 2, 4, 2, 120, 16, 5)[0]
    prompt = 100
    state = SketchWalkState()
    m.prefill(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], scale=None, state=state,
              sparse=False)
    alone = []
    for b in range(2):
        st = SketchWalkState()
        m.prefill(q[b:b + 1, :, :prompt], k[b:b + 1, :, :prompt], v[b:b + 1, :, :prompt], scale=None, state=st,
                   sparse=False)
        alone.append([m.decode(q[b:b + 1, :, t - 1], k[b:b + 1, :, :t], v[b:b + 1, :, :t], state=st)[0]
                      for t in range(prompt + 1, prompt + 4)])
    for i, t in enumerate(range(prompt + 1, prompt + 4)):
        out, _ = m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=state)
        for b in range(2):
            torch.testing.assert_close(out[b:b + 1], alone[b][i], atol=1e-12, rtol=1e-12)


def test_a_chunk_of_rows_equals_single_token_steps():
    """q [B, Hq, Q, d] (a question chunk): the rows of a batch row run as Q single-token steps, in order."""
    m = kvsieve.method("sketchwalk:block_size=16")
    q, k, v = layer_data(1, 2, 4, 2, 130, 16, 6)[0]
    prompt, q_len = 120, 4
    states = [SketchWalkState(), SketchWalkState()]
    for st in states:
        m.prefill(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], scale=None, state=st,
                  sparse=False)
    end = prompt + q_len
    chunk, _ = m.decode(q[:, :, prompt:end], k[:, :, :end], v[:, :, :end], state=states[0])
    rows = [m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=states[1])[0] for t in range(prompt + 1, end + 1)]
    torch.testing.assert_close(chunk, torch.stack(rows, dim=2), atol=1e-12, rtol=1e-12)
    n = -(-end // 16)  # the chunk ran the per-row reference, the single steps the batched path
    torch.testing.assert_close(running_matrix(states[0], n), running_matrix(states[1], n), atol=1e-12, rtol=1e-10)
