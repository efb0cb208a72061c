"""variant=authors' batched decode per layer at Llama-3.1-8B heads (32/8/128, bf16) vs FlashInfer and the dense
Triton kernel, captured in a CUDA graph, cold L2: the step (``kernels/sketchwalk/authors_decode.py`` and
``authors_walk.py``) checked against the torch step; writes ``decode.json`` and ``decode.md`` to ``--out``.

    python benchmarks/sketchwalk_authors/decode.py --out "$OUT" [--n 131072] [--batch 1] [--spec SPEC]
    TRITON_INTERPRET=1 python benchmarks/sketchwalk_authors/decode.py --out /tmp/x --check   # CPU, tiny shapes

The prompt state comes from the method's own prefill record (``prefill(sparse=False)``, the torch block matrix) of
``n − 2`` random tokens; the step is timed twice, replayed: ``restart`` (length ``n − 1``, the first position after
the prompt: the logit cache copies the prompt's logits) and ``next`` (length ``n``, the step after it: what 63 of
64 steps cost; its replays repeat the same position, which sets the order flag and does the same work). Rows: the
steps (selection + attention; ``sketchwalk_step`` is ``next``), the attention alone on the step's pages (so the
selection's share is the difference), FlashInfer (batch 1) and the dense Triton decode; ``launches`` is the
kernels of one layer's step (torch profiler), ``kernels_us`` the step's mean device µs per kernel (eager, cold L2;
a kernel launched with programmatic dependent launch counts its wait).

``check``: the two steps against the torch step (``row_update_reference``, ``walk_select_reference``) from the same
state: kept blocks that differ (``kept_mismatch``; a difference is a tie within rounding when the reference's walk
there is within ``TIE_GAP`` of its threshold), the walk's largest relative error, the outputs' largest difference
(the sparse kernel on each selection's pages), and whether a captured step's replay equals the eager step bit for
bit (output and state); ``check.steps``: step by step over ``--check-steps`` steps up to position ``n`` (from a
prompt record of ``n − steps − 1`` tokens), the device step against the torch step (``device_step(kernels=False)``)
from the same state: kept blocks that differ (flips at near ties) out of those kept, the walk's and the row scales'
largest relative difference, whether the page lists are equal, and the attention on the step's pages against
masked attention over the reference's kept keys (a flip moves it) and over the step's own (the attention alone).

``--check`` runs the checks on the CPU through Triton's interpreter (tiny shapes, no timing) and reports what a step
launches (``count_dispatched``: Triton launches and torch ops).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time
from pathlib import Path

import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.bench.timing import count_dispatched
from kvsieve.kernels.shared.weighted_triton import sparse_decode_triton
from kvsieve.kernels.sketchwalk import authors_decode as kd
from kvsieve.kernels.sketchwalk import authors_reference as kr
from kvsieve.kernels.sketchwalk import authors_walk as aw
from kvsieve.methods.sketchwalk import SketchWalkState, authors
from kvsieve.methods.sketchwalk import authors_device as ad


def cloned(dst):
    """A device state with tensors of its own (no selection record)."""
    tensors = {f.name: getattr(dst, f.name).clone() for f in dataclasses.fields(dst)
               if isinstance(getattr(dst, f.name), torch.Tensor)}
    return dataclasses.replace(dst, **tensors, last_step=None)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-30)).nan_to_num(0.0).max())


def check_steps(m, layer, hq: int, k, v, n: int, steps: int, g) -> dict:
    """The device step against the torch step from the same state, step by step (module docstring); the device
    state is made by the method at position ``n − steps`` from the prompt's record ``layer``."""
    cfg = m.config
    b, _, n_keys, d = k.shape
    dev = k.device
    state = SketchWalkState(authors=layer)
    bound = ad.max_kept_pages(n_keys, cfg.block_size, sink=cfg.sink, window=cfg.window, kblocks_frac=cfg.kblocks_frac)
    kw = dict(beta=cfg.walk_damping, degree=cfg.degree, sink=cfg.sink, window=cfg.window,
              kblocks_frac=cfg.kblocks_frac, max_pages=bound)
    prefix = authors.reserved(cfg.window, n_keys, cfg.block_size, -(-n_keys // cfg.block_size))[0]
    res = {"steps": steps, "flips": 0, "kept_blocks": 0, "walk_max_rel": 0.0, "sigma_max_rel": 0.0,
           "pages_equal": True, "out_max_abs": 0.0, "out_own_max_abs": 0.0}
    for t in range(n - steps, n + 1):
        q = torch.randn(b, hq, d, device=dev, generator=g).to(k.dtype)
        lengths = torch.full((b,), t, device=dev, dtype=torch.int32)
        if t == n - steps:  # the state, made by the method from the prompt's record, and its first step
            m.decode(q, k, v, lengths=lengths, state=state, context=CallContext(capacity=n_keys), check_finite=False)
            continue
        dst = state.authors_device
        ref = cloned(dst)
        got = ad.device_step(dst, q, k, lengths, kernels=True, **kw)
        want = ad.device_step(ref, q, k, lengths, kernels=False, **kw)
        res["flips"] += int((got.kept_blocks != want.kept_blocks).sum())
        res["kept_blocks"] += int(want.kept_blocks.sum())
        res["walk_max_rel"] = max(res["walk_max_rel"], rel_diff(got.walk, want.walk))
        res["sigma_max_rel"] = max(res["sigma_max_rel"], rel_diff(dst.sigma, ref.sigma))
        res["pages_equal"] &= bool(torch.equal(got.pages, want.pages) and torch.equal(got.counts, want.counts))
        keep = ad.kept_token_mask(want, n_keys, cfg.block_size, lengths)
        out_ref = authors.masked_attention(q[:, :, None], k, v, keep[:, None], d ** -0.5, torch.float32)[:, :, 0]
        out, _ = sparse_decode_triton(q, k, v, got.pages[:, None].expand(b, k.shape[1], -1),
                                      got.counts[:, None].expand(b, k.shape[1]), page_size=cfg.block_size,
                                      lengths=lengths, sink=prefix, sink_lengths=got.window_tokens)
        res["out_max_abs"] = max(res["out_max_abs"], float((out.float() - out_ref).abs().max()))
        own = ad.kept_token_mask(got, n_keys, cfg.block_size, lengths)  # the attention alone: over the step's keys
        out_own = authors.masked_attention(q[:, :, None], k, v, own[:, None], d ** -0.5, torch.float32)[:, :, 0]
        res["out_own_max_abs"] = max(res["out_own_max_abs"], float((out.float() - out_own).abs().max()))
    return res


def prompt_state(m, q, k, v, n: int) -> SketchWalkState:
    """Each row's prompt of ``n − 1`` tokens recorded alone, the rows stacked (as the runtime does)."""
    rows = []
    for r in range(q.shape[0]):
        st = m.new_state()
        m.prefill(q[r:r + 1, :, :n - 1], k[r:r + 1, :, :n - 1], v[r:r + 1, :, :n - 1], scale=None, state=st,
                  sparse=False)
        rows.append(st.authors)
    return SketchWalkState(authors=rows[0] if len(rows) == 1 else type(rows[0]).stack_rows(rows))


def case_arguments() -> argparse.ArgumentParser:
    """The options this bench and ``stage_sweep.py`` share: where to write, the case, the method."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--spec", default="sketchwalk:sink=0.01,window=0.02,kblocks_frac=0.0625")
    return ap


def main() -> None:
    ap = case_arguments()
    ap.add_argument("--check-steps", type=int, default=8, help="steps of the step-by-step check against the torch step")
    ap.add_argument("--check", action="store_true", help="CPU under TRITON_INTERPRET=1: tiny shapes, no timing")
    args = ap.parse_args()
    t0 = time.time()
    check = args.check
    dev = "cpu" if check else "cuda"
    n, b = (600, 2) if check else (args.n, args.batch)
    hq, hkv, d = (8, 2, 64) if check else (32, 8, 128)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, hq, n, d, device=dev, generator=g).bfloat16()
    k = torch.randn(b, hkv, n, d, device=dev, generator=g).bfloat16()
    v = torch.randn(b, hkv, n, d, device=dev, generator=g).bfloat16()
    m = kvsieve.method(args.spec + (",block_size=16,backend=triton" if check else ""))
    check_steps_n = min(args.check_steps, n - 2)
    check_layer = prompt_state(m, q, k, v, n - check_steps_n).authors  # (a prompt of n − steps − 1 tokens)
    prompt = prompt_state(m, q, k, v, n - 1)  # n − 2 tokens
    del q
    q_steps = torch.randn(2, b, hq, d, device=dev, generator=g).bfloat16()
    lengths = {"restart": torch.full((b,), n - 1, device=dev, dtype=torch.int32),
               "next": torch.full((b,), n, device=dev, dtype=torch.int32)}
    ctx = CallContext(capacity=n, count_reads=False)

    def step(state, which):
        qd = q_steps[0 if which == "restart" else 1]
        return m.decode(qd, k, v, lengths=lengths[which], state=state, context=ctx, check_finite=False)[0]

    res = {"n": n, "batch": b, "spec": m.spec, "device": "cpu (interpreter)" if check else torch.cuda.get_device_name(),
           "rows": {}}
    state = copy.deepcopy(prompt)
    _, stats = m.decode(q_steps[0], k, v, lengths=lengths["restart"], state=state, context=CallContext(capacity=n))
    res.update(density=float(stats.density), block_density=float(stats["block_density"]),
               blocks_kept=float(stats["blocks_kept"]), selection=stats.extra["selection"], backend=stats.backend)
    res["check"] = check_step(m, prompt, step, k, v, q_steps, lengths)
    res["check"]["steps"] = check_steps(m, check_layer, hq, k, v, n, check_steps_n, g)
    res["step_dispatch"] = dispatch(lambda: step(state, "next"))
    if not check:
        time_on_gpu(res, m.config, state, step, q_steps[1], k, v, lengths["next"], n, b)
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(res, indent=2))
    (out / "decode.md").write_text(markdown(res))
    print(json.dumps(res, indent=2))


def dispatch(fn) -> dict:
    """What one call of ``fn`` launches (``count_dispatched``)."""
    dispatched = count_dispatched(fn)
    return {key: dispatched[key] for key in ("triton_launches", "torch_ops", "host_reads", "ops")}


class torch_step:
    """Within it the method's device step runs its torch references (``authors_reference``) instead of the
    Triton launches: the same state, the same attention kernel on its pages."""

    def __enter__(self):
        self.saved = kd.row_update_triton, aw.walk_select_triton
        kd.row_update_triton, aw.walk_select_triton = kr.row_update_reference, kr.walk_select_reference

    def __exit__(self, *exc):
        kd.row_update_triton, aw.walk_select_triton = self.saved


def check_step(m, prompt, step, k, v, q_steps, lengths) -> dict:
    """The two steps (restart, next) against the torch step from the same prompt state, and a captured replay of
    the next step against the eager one (module docstring)."""
    cfg = m.config
    got, want = copy.deepcopy(prompt), copy.deepcopy(prompt)
    res = {}
    for which in ("restart", "next"):
        out = step(got, which)
        with torch_step():
            ref = step(want, which)
        sel, sel_ref = got.authors_device.last_step, want.authors_device.last_step
        cand = candidates(sel_ref, cfg, lengths[which])
        th = kr.quantile_rows(sel_ref.walk, cand, 1.0 - cfg.kblocks_frac)
        diff = sel.kept_blocks != sel_ref.kept_blocks
        gap = ((sel_ref.walk - th[:, None]).abs() / th[:, None].abs().clamp(min=1e-30))[diff]
        res[which] = {"kept_mismatch": int(diff.sum()), "tie_gap_max": float(gap.max()) if gap.numel() else 0.0,
                      "walk_max_rel_err": float(((sel.walk - sel_ref.walk).abs()
                                                 / sel_ref.walk.abs().clamp(min=1e-30)).max()),
                      "out_max_abs_diff": float((out.float() - ref.float()).abs().max())}
    if torch.cuda.is_available() and k.is_cuda:
        res["replay_equals_eager"] = replay_equals_eager(step, got)
    res["ok"] = all(r["kept_mismatch"] == 0 or r["tie_gap_max"] < TIE_GAP for r in (res["restart"], res["next"]))
    res["ok"] = res["ok"] and res.get("replay_equals_eager", True)
    return res


#: a kept block that differs from the reference's is a tie when the reference's walk there is this close to the
#: threshold (relative): float32 rounding of the block row's sums
TIE_GAP = 1e-4


def candidates(sel, cfg, lengths) -> torch.Tensor:
    """``[B, C]`` the blocks the quantile runs over (``kept_blocks_reference``'s candidates)."""
    pos = lengths.long() - 1
    _, wb = kr.reserved_device(cfg.window, pos + 1, cfg.block_size, sel.n.long())
    _, sb = kr.reserved_device(cfg.sink, pos + 1, cfg.block_size, sel.n.long())
    cols = torch.arange(sel.walk.shape[1], device=sel.walk.device)[None, :]
    return (cols < sel.n[:, None]) & (cols >= sb[:, None]) & (cols < (sel.n - wb)[:, None])


def replay_equals_eager(step, state) -> bool:
    """The next step captured in a CUDA graph and replayed once, against the same step run eagerly, from two
    copies of ``state``: the same output and state, bit for bit."""
    graphed, eager = copy.deepcopy(state), copy.deepcopy(state)
    step(copy.deepcopy(state), "next")  # the workspaces at this size
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = step(graphed, "next")
    graph.replay()
    out = step(eager, "next")
    torch.cuda.synchronize()
    a, b = graphed.authors_device, eager.authors_device
    same = [torch.equal(getattr(a, name), getattr(b, name)) for name in ("u", "sigma", "rsum", "qs", "ks", "ksum",
                                                                          "logits", "closed_max", "closed_sum")]
    return bool(torch.equal(out_graph, out) and all(same))


def markdown(res) -> str:
    """The rows and the checks as markdown tables."""
    lines = [f"# Sketch&Walk (authors') decode step, n={res['n']}, batch {res['batch']}, {res['device']}", "",
             f"spec `{res['spec']}`; selection `{res['selection']}`, backend `{res['backend']}`, block density "
             f"{res['block_density']:.4f}", "",
             "| row | median µs | launches | top kernels (µs) |", "|---|---|---|---|"]
    for name, row in res["rows"].items():
        top = sorted((row.get("kernels_us") or {}).items(), key=lambda kv: -kv[1])[:10]
        kern = ", ".join(f"{key[:40]} {us:.1f}" for key, us in top)
        lines.append(f"| {name} | {row['median_us']:.1f} | {row.get('launches', '')} | {kern} |")
    chk = res["check"]
    lines += ["", "| step | kept mismatch | tie gap max | walk max rel err | out max abs diff |",
              "|---|---|---|---|---|"]
    for which in ("restart", "next"):
        r = chk[which]
        lines.append(f"| {which} | {r['kept_mismatch']} | {r['tie_gap_max']:.2e} | {r['walk_max_rel_err']:.2e} | "
                     f"{r['out_max_abs_diff']:.2e} |")
    c = chk["steps"]
    lines += ["", f"ok={chk['ok']}, replay_equals_eager={chk.get('replay_equals_eager')}, "
              f"launches per step {res['step_dispatch']['triton_launches']}", "",
              "| steps | flips / kept | walk max rel | σ max rel | pages equal | out max abs (own keys) |",
              "|---|---|---|---|---|---|",
              f"| {c['steps']} | {c['flips']} / {c['kept_blocks']} | {c['walk_max_rel']:.2e} | "
              f"{c['sigma_max_rel']:.2e} | {c['pages_equal']} | {c['out_max_abs']:.2e} ({c['out_own_max_abs']:.2e}) |"]
    return "\n".join(lines) + "\n"


def time_on_gpu(res, cfg, state, step, qd, k, v, lengths, n, b) -> None:
    """The timed rows (module docstring) into ``res``."""
    from kvsieve.bench.decode import load_flashinfer
    from kvsieve.bench.timing import ColdL2Timer, count_launches
    from kvsieve.kernels.shared.dense import dense_decode_triton

    timer = ColdL2Timer()
    rows = res["rows"]

    def timed(fn) -> dict:
        return {**timer.time_graph_us(fn), "launches": count_launches(fn), "kernels_us": timer.kernel_breakdown(fn)}

    rows["step_restart"] = timed(lambda: step(state, "restart"))
    rows["sketchwalk_step"] = timed(lambda: step(state, "next"))
    step(state, "next")  # eager: the last step's pages outside the freed graphs' memory
    hkv = k.shape[1]
    sel = state.authors_device.last_step
    pages, counts = sel.pages, sel.counts
    prefix = authors.reserved(cfg.window, n, cfg.block_size, -(-n // cfg.block_size))[0]
    window_tokens = sel.window_tokens.to(torch.int32)
    res["max_pages"] = int(pages.shape[1])

    def attention():
        return sparse_decode_triton(qd, k, v, pages[:, None].expand(b, hkv, -1), counts[:, None].expand(b, hkv),
                                    page_size=cfg.block_size, lengths=lengths, sink=prefix,
                                    sink_lengths=window_tokens)[0]

    rows["sketchwalk_attention_only"] = {**timer.time_graph_us(attention), "launches": count_launches(attention)}
    rows["dense_triton"] = timer.time_graph_us(lambda: dense_decode_triton(qd, k, v, lengths, qd.shape[-1] ** -0.5))
    fi = load_flashinfer()
    if not isinstance(fi, Exception) and b == 1:
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        rows["flashinfer"] = timer.time_graph_us(lambda: fi.single_decode_with_kv_cache(qd[0], kn, vn, kv_layout="NHD"))
    else:
        res["flashinfer_note"] = str(fi) if isinstance(fi, Exception) else "batch > 1: not run"
    base = rows.get("flashinfer", rows["dense_triton"])["median_us"]
    for row in rows.values():
        row["speedup_vs_flashinfer_or_dense"] = base / row["median_us"]
    res["selection_share"] = 1 - rows["sketchwalk_attention_only"]["median_us"] / rows["sketchwalk_step"]["median_us"]


if __name__ == "__main__":
    main()
