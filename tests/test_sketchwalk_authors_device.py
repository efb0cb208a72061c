"""variant=authors' batched device decode (``methods/sketchwalk/authors_device.py``) against the per-row
reference ``authors.decode_row``: ragged rows, GQA, ring wrap-around, block boundaries, rewinds, a fresh
state, and the runtime's generate on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
from interpreted import case_groups, group_id, run_interpreter_cases

import kvsieve
from kvsieve.kernels.sketchwalk.authors_reference import page_list, quantile_rows
from kvsieve.methods.sketchwalk import SketchWalkState, authors
from kvsieve.methods.sketchwalk.authors_device import max_kept_pages


def data(b, hq, hkv, n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def reference_rows(spec, q, k, v, prompts, steps):
    """Each row alone through ``decode_row`` (backend=reference): outputs, kept blocks and walk rows per step."""
    m = kvsieve.method(spec + ",backend=reference")
    cfg = m.config
    res = []
    for b, p in enumerate(prompts):
        st = SketchWalkState()
        m.prefill(q[b:b + 1, :, :p], k[b:b + 1, :, :p], v[b:b + 1, :, :p], scale=None, state=st, sparse=False)
        rows = []
        for t in range(p + 1, p + 1 + steps):
            r = authors.decode_row(st.authors, 0, q[b, :, t - 1], k[b, :, :t], v[b, :, :t], block_size=cfg.block_size,
                                   beta=cfg.walk_damping, degree=cfg.degree, query_window=cfg.query_window,
                                   sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac,
                                   scale=q.shape[-1] ** -0.5, dtype=m._compute_dtype(q.dtype))
            rows.append(r)
        res.append(rows)
    return res


def stacked_state(m, q, k, v, prompts) -> SketchWalkState:
    """Each row's prompt recorded alone (``prefill(sparse=False)``), the rows stacked, as the runtime does."""
    rows = []
    for b, p in enumerate(prompts):
        st = m.new_state()
        m.prefill(q[b:b + 1, :, :p], k[b:b + 1, :, :p], v[b:b + 1, :, :p], scale=None, state=st, sparse=False)
        rows.append(st.authors)
    return SketchWalkState(authors=type(rows[0]).stack_rows(rows))


def batched(spec, q, k, v, prompts, steps, capacity=None):
    """Rows prefilled one at a time and stacked (as the runtime does), then decoded together with ragged
    lengths over a cache of ``capacity`` keys (the runtime's static cache)."""
    m = kvsieve.method(spec)
    state = stacked_state(m, q, k, v, prompts)
    cap = capacity or k.shape[2]
    outs, kept, walks = [], [], []
    lens = torch.tensor(prompts)
    for i in range(steps):
        lengths = lens + 1 + i
        qi = q[torch.arange(len(prompts)), :, lengths - 1]
        out, stats = m.decode(qi, k[:, :, :cap], v[:, :, :cap], lengths=lengths, state=state,
                              context=kvsieve.CallContext(capacity=cap))
        assert stats.extra["selection"] == "device"
        outs.append(out)
        dst = state.authors_device
        # the kernel path's page list never needs more than its host bound
        cfg = m.config
        bound = max_kept_pages(cap, cfg.block_size, sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac)
        step = dst.last_step
        full = page_list(step.kept_blocks, step.window_tokens, cfg.block_size, dst.capacity_blocks)
        assert int(full[1].max()) <= bound
        assert torch.equal(step.pages, page_list(step.kept_blocks, step.window_tokens, cfg.block_size, bound)[0])
        kept.append(dst.last_step.kept_blocks)
        walks.append(dst.last_step.walk)
    return outs, kept, walks, state


def assert_same_state(got, want, lengths, *, atol=1e-6, rtol=1e-5):
    """The device state after a step as the torch step leaves it: the logit cache up to each row's block c."""
    for name in ("u", "sigma", "rsum", "qs", "ks", "ksum", "closed_max", "closed_sum"):
        a, b = getattr(got, name), getattr(want, name)
        scale = max(1.0, float(b[b.isfinite()].abs().max())) if name in ("qs", "ks", "ksum") else 1.0  # sketches
        torch.testing.assert_close(a, b, atol=atol * scale, rtol=rtol, msg=name)
    for name in ("n_blocks", "n_queries", "last_pos", "order_error", "n_closed"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    c = (lengths.to(got.logits.device).long() - 1) // got.block_size
    valid = torch.arange(got.logits.shape[-2], device=c.device)[None, :] <= c[:, None]  # logits [B, Hkv, C, G·W]
    scaled = valid[:, None, :, None] * got.logit_scale  # the softmax's logits
    torch.testing.assert_close(got.logits * scaled, want.logits * scaled, atol=atol, rtol=rtol)


def rewinds_and_jumps(prompts, steps, *, skip, back):
    """``(step, lengths [B])`` of rows from ``prompts``, a token a step: row 0 rewinds to its prompt at step 7 (a
    restart), row 1 skips ``skip`` positions ahead at step 5 and steps ``back`` positions back at step 9 (both out
    of order)."""
    lens = torch.tensor(prompts) + 1
    for i in range(steps):
        if i:
            lens = lens + 1
        if i == 7:
            lens[0] = prompts[0] + 1
        if i == 5:
            lens[1] += skip
        if i == 9:
            lens[1] -= back
        yield i, lens.clone()


def block_row_follows_the_torch_step(ref, q, k, schedule, *, atol, rtol, **kernel_kw):
    """The block row's kernels (``row_update_triton``) from copies of the device state ``ref``, with the launch
    sizes ``kernel_kw`` and with the defaults, against the torch step (``row_update_reference``, on ``ref``) over
    the ``schedule``'s lengths: the block row and the whole state after every step."""
    import copy

    from kvsieve.kernels.sketchwalk import authors_decode as kd
    from kvsieve.kernels.sketchwalk import authors_reference as kr

    runs = {"given": (copy.deepcopy(ref), kernel_kw), "default": (copy.deepcopy(ref), {})}
    for i, lens in schedule:
        lengths = lens.to(device=k.device, dtype=torch.int32)
        qi = q[torch.arange(len(lens), device=q.device), :, lengths.long() - 1].contiguous()
        r_want = kr.row_update_reference(ref, qi, k, lengths, scale=ref.logit_scale)
        for name, (got, kw) in runs.items():
            r_got = kd.row_update_triton(got, qi, k, lengths, scale=ref.logit_scale, **kw)
            torch.testing.assert_close(r_got, r_want, atol=atol, rtol=rtol, msg=f"{name} step {i}")
            assert_same_state(got, ref, lengths, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec,shape,prompts,steps", [
    ("sketchwalk:block_size=16", (4, 2, 16), [150, 97, 128], 40),
    ("sketchwalk:block_size=16,query_window=5,window=0.1,sink=0.05,kblocks_frac=0.3", (8, 2, 16), [64, 81], 50),
    ("sketchwalk:block_size=8,degree=1,walk_damping=0.5", (2, 2, 8), [40, 33, 57, 8], 30),
    ("sketchwalk:block_size=16,causal=True,query_window=64", (4, 1, 32), [200], 20),
])
def test_batched_ragged_decode_equals_each_row_alone(spec, shape, prompts, steps, dtype):
    hq, hkv, d = shape
    n = max(prompts) + steps + 5
    q, k, v = data(len(prompts), hq, hkv, n, d, seed=len(prompts) + d, dtype=dtype)
    ref = reference_rows(spec, q, k, v, prompts, steps)
    outs, kept, walks, state = batched(spec, q, k, v, prompts, steps)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    for i in range(steps):
        for b in range(len(prompts)):
            r = ref[b][i]
            nb = r.kept_blocks.shape[0]
            assert torch.equal(kept[i][b, :nb], r.kept_blocks), (i, b)
            assert not kept[i][b, nb:].any()
            torch.testing.assert_close(walks[i][b, :nb], r.walk, **tol)
            torch.testing.assert_close(outs[i][b], r.out.to(outs[i].dtype), **tol)
    assert not state.authors_device.order_error.any()


def test_the_running_matrix_equals_the_reference_within_rounding():
    """``diag(σ)·U`` of the device state is the reference's renormalised running matrix after many steps."""
    spec = "sketchwalk:block_size=8"
    q, k, v = data(1, 4, 2, 400, 16, seed=3)
    m = kvsieve.method(spec + ",backend=reference")
    st = SketchWalkState()
    m.prefill(q[:, :, :100], k[:, :, :100], v[:, :, :100], scale=None, state=st, sparse=False)
    for t in range(101, 381):
        m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=st)
    _, _, _, state = batched(spec, q, k, v, [100], 280)
    dst = state.authors_device
    n = int(dst.n_blocks[0])
    a = (dst.sigma[0, :n, None] * dst.u[0, :n, :n])
    torch.testing.assert_close(a, st.authors.blocks[0, :n, :n], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dst.sigma[0, :n] * dst.rsum[0, :n], torch.ones(n), atol=1e-6, rtol=1e-6)


def test_a_rewind_restarts_from_the_prompt_in_every_row():
    spec = "sketchwalk:block_size=16,query_window=7"
    prompts, steps = [90, 64], 30
    q, k, v = data(2, 4, 2, 130, 16, seed=9)
    m = kvsieve.method(spec)
    state = stacked_state(m, q, k, v, prompts)
    lens = torch.tensor(prompts)
    runs = []
    for _ in range(3):  # the whole decode, rewound twice (the cache keeps the prompt's keys)
        outs = []
        for i in range(steps):
            lengths = lens + 1 + i
            out, _ = m.decode(q[torch.arange(2), :, lengths - 1], k, v, lengths=lengths, state=state,
                              context=kvsieve.CallContext(capacity=k.shape[2]))
            outs.append(out)
        runs.append(torch.stack(outs))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    # a step that is neither the next one nor the first after the prompt is refused (CPU: no sync to ask)
    with pytest.raises(ValueError, match="steps out of order"):
        m.decode(q[:, :, 100], k, v, lengths=lens + steps + 3, state=state)


def test_a_fresh_state_grows_the_matrix_like_the_reference():
    """No prompt recorded: the first step's row fills every block, as the reference's growth rule."""
    spec = "sketchwalk:block_size=16"
    q, k, v = data(1, 4, 2, 140, 16, seed=4)
    ref_m, m = kvsieve.method(spec + ",backend=reference"), kvsieve.method(spec)
    sr, sd = SketchWalkState(), SketchWalkState()
    for t in range(100, 135):  # a cache that grows (no capacity given)
        a, _ = ref_m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=sr)
        b, _ = m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=sd)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_quantile_rows_is_torch_nanquantile():
    g = torch.Generator().manual_seed(0)
    for q in (0.875, 0.5, 0.3, 0.999):
        w = torch.rand(6, 50, generator=g)
        w[1] = w[1].round(decimals=1)  # ties
        cand = torch.rand(6, 50, generator=g) < 0.6
        cand[2] = False  # no candidate: NaN
        cand[3] = False
        cand[3, 7] = True  # one candidate
        want = torch.nanquantile(torch.where(cand, w, float("nan")), q, dim=-1)
        torch.testing.assert_close(quantile_rows(w, cand, q), want, equal_nan=True, atol=0, rtol=0)


def test_page_list_leaves_the_prefix_to_the_dense_part():
    kept = torch.zeros(2, 10, dtype=torch.bool)
    kept[0, [0, 1, 2, 5, 9]] = True
    kept[1, [3, 4]] = True
    pages, counts = page_list(kept, torch.tensor([20, 1]), 8, 6)
    assert counts.tolist() == [3, 2]  # row 0: blocks 0, 1 lie inside the first 20 keys; block 2 reaches past
    assert pages[0, :3].tolist() == [2, 5, 9] and pages[1, :2].tolist() == [3, 4]


def test_generate_on_a_tiny_llama_equals_the_reference_path():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 97, (n,), generator=g) for n in (300, 233)]
    spec = "sketchwalk:block_size=16,kblocks_frac=0.2"
    got = kvsieve.generate(model, rows, spec, max_new_tokens=24)
    ref = kvsieve.generate(model, rows, spec + ",backend=reference", max_new_tokens=24)
    assert torch.equal(got.tokens, ref.tokens)
    assert got.stats.log.records[0]["selection"] == "device"
    assert ref.stats.log.records[0]["selection"] == "reference"


@pytest.mark.triton
@pytest.mark.parametrize("group", case_groups("sketchwalk_authors_decode_interpreter_cases.py",
                                              "test_the_triton_step_keeps_the_blocks_of_decode_row",
                                              "test_the_block_row_follows_the_reference_over_steps"),
                         ids=group_id)
def test_the_kernel_path_under_the_triton_interpreter(group):
    pytest.importorskip("triton")
    run_interpreter_cases("sketchwalk_authors_decode_interpreter_cases.py", group)


COMPILE_FOR_H100 = """
from kvsieve.kernels.sketchwalk import authors_decode as ad

f32 = "*fp32"
ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", lens_ptr="*i32", phi_ptr=f32, qs_ptr=f32, pqs_ptr=f32, nq_ptr="*i64",
            pnq_ptr="*i64", plen_ptr="*i64", ksum_ptr=f32, ks_ptr=f32, pkp_ptr=f32, lg_ptr=f32, mx_ptr=f32,
            se_ptr=f32, part_ptr=f32, r_ptr=f32, u_ptr=f32, sigma_ptr=f32, rsum_ptr=f32, nb_ptr="*i64",
            p_nb_ptr="*i64", p_row_ptr=f32, p_col_ptr=f32, p_rsum_ptr=f32, last_ptr="*i64", err_ptr="*i1",
            pin_ptr=f32, pout_ptr=f32, ue_ptr=f32, frac_ptr="*fp64", walk_ptr=f32, kept_ptr="*i8", pages_ptr="*i32",
            counts_ptr="*i32", wt_ptr="*i32", n_ptr="*i32", short_ptr="*i8", plg_ptr=f32, cmx_ptr=f32, cse_ptr=f32,
            pcmx_ptr=f32, pcse_ptr=f32, ncl_ptr="*i64", tmx_ptr=f32, tse_ptr=f32)
compile_(ad._row_state_kernel, ptrs, dict(GROUP=4, BS=64, BLOCK_R=128, BLOCK_G=16, BLOCK_M=32, BLOCK_D=32),
         num_warps=4)
compile_(ad._row_logits_kernel, ptrs, dict(GROUP=4, BS=64, BLOCK_G=4, BLOCK_N=ad.LOGIT_TILE, BLOCK_R=32,
                                           BLOCK_M=32, PDL=True), floats=("scale",), num_warps=4)
compile_(ad._row_probs_kernel, ptrs, dict(GROUP=4, BS=64, BLOCK_R=64, BLOCK_N=ad.ROW_TILE, BLOCK_G=4, BLOCK_T=64,
                                          TILE=ad.LOGIT_TILE, PDL=True), floats=("scale",), num_warps=4)
print("COMPILED")
"""


@pytest.mark.triton
def test_the_step_kernels_compile_for_the_h100():
    """The interpreter neither type-checks untaken branches nor runs tensor-core dots: compiling for sm_90 (no GPU
    needed) does, at Llama-3.1-8B heads, for the block row's launches (the state's step, the logits, the
    probabilities), with programmatic dependent launch as on the H100 (the tail, the hops and the selection:
    ``test_sketchwalk_authors_walk.py``)."""
    pytest.importorskip("triton")
    from interpreted import compile_for_sm90

    compile_for_sm90(COMPILE_FOR_H100)


def test_the_batched_path_is_declared_capturable_and_the_per_row_loop_is_not():
    assert kvsieve.method("sketchwalk").graph_capturable
    assert kvsieve.method("sketchwalk:backend=triton").graph_capturable
    assert not kvsieve.method("sketchwalk:backend=reference").graph_capturable
    assert not kvsieve.method("sketchwalk:variant=reconstruction").graph_capturable


def test_a_question_chunk_then_single_steps_fits_a_capacity_below_the_reference_room():
    """A chunk of query rows through the per-row reference (whose matrix grows by doubling past the blocks
    it holds), then one token at a time on the batched path over a cache of exactly the tokens: the device
    state takes the blocks held, and every step equals the reference."""
    spec = "sketchwalk:block_size=8"
    prompt, chunk, steps = 100, 30, 12
    n = prompt + chunk + steps
    q, k, v = data(1, 4, 2, n, 16, seed=11)
    ref_m, m = kvsieve.method(spec + ",backend=reference"), kvsieve.method(spec)
    sr, sd = SketchWalkState(), SketchWalkState()
    for mm, st in ((ref_m, sr), (m, sd)):
        mm.prefill(q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], scale=None, state=st, sparse=False)
    for t in range(prompt + 1, prompt + chunk + 1):
        ref_m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=sr)
    end = prompt + chunk
    ref_m.decode(q[:, :, prompt:end], k[:, :, :end], v[:, :, :end], state=sd)  # the per-row reference's chunk
    assert sd.authors.blocks.shape[-1] * 8 > n  # the reference's room exceeds the cache below
    for t in range(end + 1, n + 1):
        a, _ = ref_m.decode(q[:, :, t - 1], k[:, :, :t], v[:, :, :t], state=sr)
        b, stats = m.decode(q[:, :, t - 1], k[:, :, :n], v[:, :, :n], lengths=torch.tensor([t]), state=sd,
                            context=kvsieve.CallContext(capacity=n))
        assert stats.extra["selection"] == "device"
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("prompts,chunk", [([100], 30), ([90, 64], 17)])
def test_a_chunk_of_query_rows_runs_as_single_steps_on_the_device_state(prompts, chunk):
    """Q > 1 query rows per batch row (eval's question, a teacher-forced answer) run as Q batched steps in
    order: the same outputs and kept keys as the per-row reference, then single steps continue from there,
    and a second chunk from the prompt (a rewind) gives the first chunk's outputs again."""
    spec = "sketchwalk:block_size=8,query_window=7"
    b, steps = len(prompts), 6
    n = max(prompts) + chunk + steps
    q, k, v = data(b, 4, 2, n, 16, seed=5 + b)
    m = kvsieve.method(spec)
    ref = reference_rows(spec, q, k, v, prompts, chunk + steps)
    state = stacked_state(m, q, k, v, prompts)
    lens = torch.tensor(prompts)
    qc = torch.stack([q[i, :, p:p + chunk] for i, p in enumerate(prompts)])  # [B, Hq, Q, d]
    kc = torch.stack([k[i, :, :n] for i in range(b)])
    vc = torch.stack([v[i, :, :n] for i in range(b)])
    key_len = lens + chunk
    for _ in range(2):
        out, stats = m.decode(qc, kc, vc, lengths=key_len, state=state, context=kvsieve.CallContext(capacity=n))
        assert stats["selection"] == "device"
        for i in range(b):
            for j in range(chunk):
                torch.testing.assert_close(out[i, :, j], ref[i][j].out, atol=1e-5, rtol=1e-4)
    for s in range(steps):
        lengths = key_len + 1 + s
        o, _ = m.decode(q[torch.arange(b), :, lengths - 1], kc, vc, lengths=lengths, state=state,
                        context=kvsieve.CallContext(capacity=n))
        for i in range(b):
            torch.testing.assert_close(o[i], ref[i][chunk + s].out, atol=1e-5, rtol=1e-4)


@pytest.mark.triton
def test_the_decode_benchmark_checks_the_step_on_the_cpu(tmp_path):
    """``benchmarks/sketchwalk_authors/decode.py --check`` (tiny shapes, interpreted): the step keeps the torch
    step's blocks at a restart and at the step after it and over several steps, and launches no torch op."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "src")}
    res = subprocess.run([sys.executable, str(root / "benchmarks/sketchwalk_authors/decode.py"), "--out",
                          str(tmp_path), "--check"], capture_output=True, text=True, env=env, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "decode.json").read_text())
    assert out["check"]["ok"], out["check"]
    assert out["check"]["steps"]["kept_blocks"] > 0 and out["check"]["steps"]["flips"] == 0, out["check"]
    assert set(out["step_dispatch"]["ops"]) <= {"any.default"}, out["step_dispatch"]
    assert (tmp_path / "decode.md").exists()
