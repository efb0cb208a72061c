"""Where Sketch&Walk's prefill selection spends its time, stage by stage (issue 17: the selection must cost
<= 10 % of the sparse attention at >= 32k).

The selection is ``bench_prefill.sketchwalk_selection``'s: head-mean + block means + SRHT sketch + ``log Â`` +
``Ã = Â^α`` + the walk GEMM against a previous layer's ``W`` + top-k per query block (+ the FlexAttention
BlockMask, which the Triton kernel does not need). One Llama-3.1-8B layer (32 query / 8 KV heads, d 128),
bf16, batch 1, random q/k.

On CUDA, per length and per stage (the stages call the module's own functions, so the script times whichever
tree ``PYTHONPATH`` points at):

- ``eager_us``: CUDA events around one eager call, cold L2 (``ColdL2Timer``), median. What the bench reports:
  device time plus the launch gaps the host leaves.
- ``graph_us``: the same call captured in a CUDA graph and replayed: device time alone (no host launch cost).
  ``eager_us`` well above ``graph_us`` means the host's launches, not the device, set the time.
- ``host_us``: host time to issue one call with the device kept busy (nothing waits on it), median.
- ``kernels``: device kernels one call launches (profiler); ``aten_ops``: aten ops it dispatches (views
  included), counted with a dispatch mode.

Then a torch.profiler table of the kernels of the selection without the mask (the kernel path where the
tree has one). ``selection_path`` says which path the method took; ``rows_differ_vs_torch``,
``counts_equal_vs_torch`` and ``w_max_rel_diff_vs_torch`` compare it with the torch path (``backend=reference``)
on the same inputs. Without CUDA it only
counts the aten ops per stage on CPU at ``--cpu-length`` tokens.

Usage (GPU machine, repository root; < 1 minute)::

    PYTHONPATH=src python docs/results/studies/sketchwalk/profile_selection.py OUT_DIR [--lengths 32768,65536,131072]

Writes OUT_DIR/profile_selection.json, .md, profile_selection_kernels_<n>.txt and selection_<n>.pt (the
block lists and counts, to compare two trees' selections with ``torch.equal``).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prefill import make_qkv, sketchwalk_selection  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--lengths", default="32768,65536,131072")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-tf32", action="store_true", help="leave TF32 off (bench_prefill.py turns it on)")
    p.add_argument("--cpu-length", type=int, default=8192, help="tokens for the CPU op count (no CUDA)")
    return p.parse_args()


class OpCounter:
    """Counts the aten ops dispatched inside the ``with`` block."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self) -> OpCounter:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)


# aten ops that only make a view (no kernel, little host time): left out of ``compute_ops``
VIEW_OPS = {"aten.view", "aten._unsafe_view", "aten.expand", "aten.unsqueeze", "aten.squeeze", "aten.permute",
            "aten.transpose", "aten.t", "aten.slice", "aten.select", "aten.alias", "aten.as_strided",
            "aten.reshape", "aten.detach"}


def count_ops(fn) -> tuple[int, int, dict[str, int]]:
    """``(aten ops, of them not views, {op: count})`` of one call."""
    with OpCounter() as c:
        fn()
    compute = sum(v for key, v in c.counts.items() if key not in VIEW_OPS)
    return sum(c.counts.values()), compute, dict(c.counts.most_common())


def stages(q: torch.Tensor, k: torch.Tensor, block_size: int, density: float) -> tuple[list, dict]:
    """``[(name, fn)]``: each stage of the selection on inputs the stages before it computed once, then the
    composite calls. The stages mirror ``SketchWalk.prefill_sketch`` / ``prefill_select`` of the tree under
    test (``block_means`` where it exists, else the division by ``block_token_counts`` it replaced)."""
    import kvsieve
    from kvsieve.kernels.shared.block_sparse import flex_block_mask
    from kvsieve.methods import sketchwalk as sw

    m, prev, selection = sketchwalk_selection(q, k, block_size, density)
    # the torch path beside whichever path the tree's method takes (its prefill selection kernels on CUDA where
    # the tree has them), on the same previous walk
    ref = kvsieve.method(f"sketchwalk:variant=reconstruction,density={density},block_size={block_size},"
                         "backend=reference")
    b, _, n_tok, d = q.shape
    n = -(-n_tok // block_size)
    dtype, logit_scale = m._dims(d, q.dtype)
    phi = m._phi(d, q.device, dtype)
    rows = torch.arange(n, device=q.device)[None].expand(b, n)
    kmax = sw.max_block_budget(n, density, fixed_k=False)

    def means(sums):
        if hasattr(sw, "block_means"):
            return sw.block_means(sums, n_tok, block_size)
        return sums / sw.block_token_counts(n_tok, block_size, q.device).to(dtype)[None, :, None]

    def sketches(q_avg, k_avg):
        q_sum, k_sum = sw.block_sums(q_avg, block_size), sw.block_sums(k_avg, block_size)
        return q_sum, k_sum, means(q_sum) @ phi.T, means(k_sum) @ phi.T

    def rank(w, a_tilde):
        return w + sw.TIE_BREAK * sw.normalize_rows(a_tilde)

    def budget():
        return sw.block_budget(rows, density, fixed_k=False, n_blocks=n)

    q_avg, k_avg = sw.head_mean(q, dtype), sw.head_mean(k, dtype)
    _, _, q_sk, k_sk = sketches(q_avg, k_avg)
    log_a = sw.causal_log_scores(q_sk, k_sk, logit_scale, rows)
    a_tilde = m.transition(log_a)
    w = m.walk_step(prev, a_tilde, lambda p: torch.matmul(p, a_tilde))
    r = rank(w, a_tilde)
    bud = budget()
    idx, cnt = sw.select_blocks(r, rows, bud, kmax)
    out = [
        ("head_mean_q", lambda: sw.head_mean(q, dtype)),
        ("head_mean_k", lambda: sw.head_mean(k, dtype)),
        ("block_sums_sketch", lambda: sketches(q_avg, k_avg)),
        ("log_a_hat", lambda: sw.causal_log_scores(q_sk, k_sk, logit_scale, rows)),
        ("a_tilde", lambda: m.transition(log_a)),
        ("walk_gemm_normalize", lambda: m.walk_step(prev, a_tilde, lambda p: torch.matmul(p, a_tilde))),
        ("rank_tie_break", lambda: rank(w, a_tilde)),
        ("block_budget", budget),
        ("topk_select_blocks", lambda: sw.select_blocks(r, rows, bud, kmax)),
        ("flex_block_mask", lambda: flex_block_mask(idx, cnt, block_size=block_size, n_tokens=n * block_size)),
        ("= prefill_sketch", lambda: m.prefill_sketch(q, k)),
        ("= prefill_select", lambda: m.prefill_select(a_tilde, prev)),
        ("= selection without mask (triton path)", lambda: m.prefill_select(m.prefill_sketch(q, k)["a_tilde"], prev)),
        ("= selection with mask (bench 'selection')", selection),
        ("= torch selection without mask (backend=reference)",
         lambda: ref.prefill_select(ref.prefill_sketch(q, k)["a_tilde"], prev)),
    ]
    path = m.prefill_selection_path(q, n)[0] if hasattr(m, "prefill_selection_path") else "reference"
    return out, {"n_blocks": n, "kmax": kmax, "kept": float(cnt.double().sum() / (n * (n + 1) / 2)),
                 "selection_path": path}


def compare_paths(named: list) -> dict:
    """The method's selection (``= selection without mask``) against the torch path's on the same inputs: rows
    whose block lists differ, and the walk's largest relative difference (0 and equal where both are torch)."""
    calls = dict(named)
    w, idx, cnt = calls["= selection without mask (triton path)"]()
    rw, ridx, rcnt = calls["= torch selection without mask (backend=reference)"]()
    rel = ((w - rw).abs() / rw.abs().clamp_min(1e-30)).masked_fill((w == 0) & (rw == 0), 0)
    return {"rows_differ_vs_torch": int((idx != ridx).any(-1).sum()),
            "counts_equal_vs_torch": bool(torch.equal(cnt, rcnt)), "w_max_rel_diff_vs_torch": float(rel.max())}


def host_issue_us(fn, iters: int = 5) -> float:
    """Median host time of one call while the device runs a long sleep queued before it (no waiting on it)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms of device time queued ahead
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def kernel_table(fn, path: Path) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    path.write_text(table)
    return table


def run_cuda(args, hq, hkv, d) -> tuple[list[dict], dict]:
    from kvsieve.bench.timing import ColdL2Timer, count_launches
    from kvsieve.methods import sketchwalk as sw

    torch.backends.cuda.matmul.allow_tf32 = not args.no_tf32
    dev = torch.device("cuda")
    timer = ColdL2Timer(dev)
    rows, tables = [], {}
    for n_tok in (int(x) for x in args.lengths.split(",")):
        q, k, _ = make_qkv(n_tok, hq, hkv, d, seed=0, device=dev)
        named, info = stages(q, k, args.block_size, args.density)
        # For an A/B across trees: the selection itself (compare the files of two runs with torch.equal), and
        # whether this tree's head mean gives the floats of the float32-copy form.
        _, idx, cnt = dict(named)["= selection with mask (bench 'selection')"]()
        torch.save({"block_idx": idx.cpu(), "block_counts": cnt.cpu()}, args.out / f"selection_{n_tok}.pt")
        info["head_mean_equal_fp32_copy"] = bool(torch.equal(sw.head_mean(q, torch.float32), q.float().mean(1)))
        info.update(compare_paths(named))
        print(json.dumps({"n": n_tok, **info}), flush=True)
        for name, fn in named:
            row = {"n": n_tok, "stage": name, **info}
            row["aten_ops"], row["compute_ops"], ops = count_ops(fn)
            row["top_ops"] = dict(list(ops.items())[:8])
            row["kernels"] = count_launches(fn)
            row["eager_us"] = timer.time_us(fn, warmup=3, iters=args.iters)["median_us"]
            try:
                row["graph_us"] = timer.time_graph_us(fn, warmup=3, iters=args.iters)["median_us"]
            except Exception as exc:  # a stage that cannot be captured still gets its eager time
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
            row["host_us"] = host_issue_us(fn)
            rows.append(row)
            print(json.dumps({key: v for key, v in row.items() if key != "top_ops"}), flush=True)
        full = dict(named)["= selection without mask (triton path)"]
        tables[n_tok] = kernel_table(full, args.out / f"profile_selection_kernels_{n_tok}.txt")
        print(f"\n## kernels of the selection without mask, n = {n_tok} (5 calls)\n{tables[n_tok]}", flush=True)
        del q, k, named
        torch.cuda.empty_cache()
    return rows, tables


def run_cpu(args, hq, hkv, d) -> list[dict]:
    q, k, _ = make_qkv(args.cpu_length, hq, hkv, d, seed=0, device=torch.device("cpu"))
    named, info = stages(q, k, args.block_size, args.density)
    rows = []
    for name, fn in named:
        total, compute, ops = count_ops(fn)
        rows.append({"n": args.cpu_length, "stage": name, "aten_ops": total, "compute_ops": compute,
                     "top_ops": dict(list(ops.items())[:8]), **info})
        print(f"{name:45s} {total:4d} aten ops ({compute:3d} not views)  {dict(list(ops.items())[:6])}", flush=True)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Sketch&Walk prefill selection by stage ({meta['device']}, {meta['date']})", "",
             f"Command: `{meta['command']}`; torch {meta['torch']}; TF32 {meta['tf32']}; {meta['timing']}.", "",
             "| n | stage | aten ops (not views) | kernels | eager µs | graph µs (device) | host µs |",
             "|---:|---|---:|---:|---:|---:|---:|"]

    def f(x):
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return ""
        return f"{x:.1f}" if isinstance(x, float) else str(x)

    for r in rows:
        lines.append(f"| {r['n']} | {r['stage']} | {r['aten_ops']} ({r['compute_ops']}) | {f(r.get('kernels'))} "
                     f"| {f(r.get('eager_us'))} | {f(r.get('graph_us')) or r.get('graph_error', '')} "
                     f"| {f(r.get('host_us'))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse()
    args.out.mkdir(parents=True, exist_ok=True)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    cuda = torch.cuda.is_available()
    if cuda:
        rows, _ = run_cuda(args, hq, hkv, d)
    else:
        print(f"no CUDA: aten ops per stage on CPU at {args.cpu_length} tokens", flush=True)
        rows = run_cpu(args, hq, hkv, d)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if cuda else "CPU (op count only)", "torch": torch.__version__,
            "tf32": bool(cuda and not args.no_tf32), "command": " ".join(sys.argv),
            "timing": "CUDA events, cold L2 (ColdL2Timer), median; graph = CUDA-graph replay; host = issue time"}
    (args.out / "profile_selection.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / "profile_selection.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
