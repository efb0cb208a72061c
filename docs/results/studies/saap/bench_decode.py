"""SAAP decode step vs FlashInfer and torch SDPA at Llama-3.1-8B shapes, and the index build time.

One layer, batch 1: 32 query heads, 8 KV heads, head dim 128, bf16, C = 1024 buckets, ℓ = 32 probes,
dense part 1 + 2047. Timed with CUDA events on a cold L2 (kvsieve.bench.timing), medians:

- ``flashinfer``: ``single_decode_with_kv_cache`` over all N keys (skipped with a note if absent);
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (GQA) over all N keys;
- ``saap-step``: everything SAAP does per step: de-rope the 32 queries, the query classifier (one
  per KV head, Linear 128→1024 → BatchNorm → ReLU → Linear 1024→1024, softmax), the GQA group sum,
  top-ℓ, the bucket lists, the sparse attention (dense part + buckets) and the log-sum-exp merge;
- ``saap-attention``: the sparse attention (dense part + the visited buckets) and the merge only, the
  paper's timing: the Triton kernel of ``ℓ + 1`` programs per KV head reading the CSR lists, then the
  split-KV merge (``saap-attention-separate-merge``: the merge as its own launch, the method's choice at batch
  1, where the default fuses it); ``saap-attention-reference``: the same through the torch reference (bucket lists +
  the weighted sparse decode twice + LSE merge);
- ``saap-probe``: de-rope + classifier + top-ℓ only;
- ``method-graph`` / ``method-eager``: what a user gets: ``kvsieve.method("saap:...").decode(...)`` on
  artifacts holding the same centroids and classifier (written to a temporary directory), after the
  index build, captured in a CUDA graph and replayed, and eager; checked against the method's
  ``backend=reference`` once;
- ``index-build``: de-rope the N keys, assign them to the nearest of C centroids, CSR (argsort +
  bincount), and the list width; after prefill, once per request and layer (warm L2 is irrelevant
  at these sizes; plain CUDA events).

Keys: a fitted mixture stand-in. The pre-RoPE keys of each KV head are drawn from a mixture of
C = 1024 spherical Gaussians (unit-norm centres, Dirichlet(1) mixing weights, so bucket sizes are
unequal as k-means buckets are: the largest is several times the mean), then roped at their
positions with Llama-3.1's base frequencies; the centroids are the mixture centres. The classifier
has random weights: its top-ℓ choice is arbitrary but its cost is the trained one's. Each row also
checks the step's output against a float32 softmax over a mask of the same keys.

Usage (H100, about 1-2 minutes)::

    python docs/results/studies/saap/bench_decode.py --out docs/results/gpu-bench/saap-h100

``--hidden 1024,256`` times each classifier width in turn (default: C).

``--smoke`` runs tiny shapes on any device (CPU included) to check the script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvsieve
from kvsieve import CallContext
from kvsieve.fit.saap import save_layer, write_json
from kvsieve.kernels.saap import buckets as bucket_kernels
from kvsieve.kernels.shared import weighted
from kvsieve.methods.saap import ARTIFACT_FORMAT, MANIFEST, QueryClassifier, Rope


def make_case(n: int, hq: int, hkv: int, d: int, clusters: int, window: int, device, dtype, seed: int,
              batch: int = 1, hidden: int | None = None):
    """``batch`` rows of keys drawn from one mixture (the artifacts' centroids serve every row); each row's
    draws in turn, so that row 0 is the batch-1 case at any batch."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    centres = torch.nn.functional.normalize(torch.randn(hkv, clusters, d, generator=g), dim=-1)
    weights = torch.distributions.Dirichlet(torch.ones(clusters)).sample((hkv,))
    rope = Rope(1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d)))
    pos = torch.arange(n)
    rows = []
    for _ in range(batch):
        comp = torch.multinomial(weights, n, replacement=True, generator=g)  # [Hkv, N]
        k_pre = centres.gather(1, comp[..., None].expand(-1, -1, d)) * 4.0 + torch.randn(hkv, n, d, generator=g)
        rows.append((rope.apply(k_pre, pos[None]).to(dtype), torch.randn(hkv, n, d, generator=g).to(dtype),
                     torch.randn(hq, d, generator=g).to(dtype)))
    k, v, q = (torch.stack(t).to(device) for t in zip(*rows, strict=True))
    net = QueryClassifier(hkv, d, hidden or clusters, clusters).eval().to(device=device, dtype=dtype)
    return {"q": q, "k": k, "v": v, "rope": rope, "centroids": centres.to(device=device, dtype=torch.float32),
            "net": net, "n": n, "window": window}


def write_artifacts(case, folder: Path, hq: int) -> None:
    """The case's centroids and classifier as a one-layer artifact directory (layer 1)."""
    cent = case["centroids"].float().cpu()
    hkv, c, d = cent.shape
    tensors = {"centroids": cent.contiguous(), "centroids_roped": cent.clone()}
    tensors.update({f"classifier.{n}": t.detach().float().cpu().contiguous()
                    for n, t in case["net"].state_dict().items()})
    save_layer(folder, 1, tensors)
    shape = {"layers": 2, "heads": hq, "kv_heads": hkv, "head_dim": d}
    write_json(folder / MANIFEST, {
        "format": ARTIFACT_FORMAT, "complete": True,
        "model": {"name": "bench", "config_hash": "-", "weights_fingerprint": "-", "shape": shape},
        "rope": {"inv_freq": case["rope"].inv_freq.tolist(), "attention_scaling": 1.0},
        "hyperparameters": {"clusters": c, "hidden": case["net"].w1.shape[-1], "per": "kv"}, "layers_done": [1]})


def method_rows(case, probes: int, window: int, hq: int, timer, iters: int) -> dict:
    """``m.decode`` as a user calls it: eager and captured, and its error against the reference path."""
    q, k, v, n = case["q"], case["k"], case["v"], case["n"]
    lengths = torch.full((1,), n, device=q.device)
    with tempfile.TemporaryDirectory() as folder:
        write_artifacts(case, Path(folder), hq)
        spec = f"saap:artifacts={folder},probes={probes},window={window},window_scale=1.0"
        m = kvsieve.method(spec)
        ref = kvsieve.method(spec + ",backend=reference")
        state, ctx = m.new_state(), CallContext(layer=1, min_length=n)
        out, stats = m.decode(q, k, v, lengths=lengths, state=state, context=ctx, check_finite=False)  # the index
        ref_out, _ = ref.decode(q, k, v, lengths=lengths, context=CallContext(layer=1), check_finite=False)
        row = {"method_backend": stats.backend,
               "method_selectivity": float(stats["selectivity"]),
               "method_max_abs_err_vs_reference": float((out.float() - ref_out.float()).abs().max())}
        call = lambda: m.decode(q, k, v, lengths=lengths, state=state, context=ctx, check_finite=False)  # noqa: E731
        if timer is not None:
            row["method-graph_us"] = timer.time_graph_us(call, iters=iters)["median_us"]
            row["method-eager_us"] = timer.time_us(call, iters=iters)["median_us"]
            # where the captured step's device time goes (kernel name -> mean µs), for the closing table
            row["method_kernels_us"] = timer.kernel_breakdown(call)
    return row


def build_index(case, probes: int, sink: int = 1):
    """De-rope, assign, CSR: what SAAP does after prefill for one layer."""
    k, n, window = case["k"], case["n"], case["window"]
    pos = torch.arange(n, device=k.device)
    keys = case["rope"].invert(k[0].float(), pos[None])  # [Hkv, N, d]
    assign = torch.einsum("hnd,hcd->hnc", keys, case["centroids"]).argmax(-1)[None]
    c = case["centroids"].shape[1]
    indexed = (pos >= sink) & (pos < n - window)
    assign = torch.where(indexed, assign, torch.full_like(assign, c))
    offsets, ids = bucket_kernels.build_csr(assign, c)
    return offsets, ids, assign


def saap_step(case, index, probes: int, attend=bucket_kernels.bucket_sparse_decode):
    q, k, v, rope, net = case["q"], case["k"], case["v"], case["rope"], case["net"]
    offsets, ids, width, dense_ids, dense_counts = index
    b, hq, d = q.shape
    hkv = k.shape[1]
    n = case["n"]
    pos = torch.full((1, 1, 1), n - 1, device=q.device)
    q_pre = rope.invert(q[:, :, None, :], pos)[:, :, 0]
    x = q_pre.view(hkv, hq // hkv, d).to(q.dtype)
    probs = torch.softmax(net(x).float(), dim=-1)  # [Hkv, G, C]
    buckets = torch.topk(probs.sum(1), probes, dim=-1).indices[None]
    return attend(q, k, v, dense_ids, dense_counts, offsets, ids, buckets, width)


def measure(n, hq, hkv, d, clusters, probes, window, device, dtype, timed, flashinfer, timer=None,
            iters: int = 40, hidden: int | None = None) -> dict:
    """One context length: index build, correctness check, then the timed calls."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    case = make_case(n, hq, hkv, d, clusters, window, device, dtype, seed=n, hidden=hidden)
    builds = []  # once per request and layer after prefill; median of 5
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        offsets, ids, assign = build_index(case, probes)
        width = bucket_kernels.list_width(offsets, probes)  # one host read
        sync()
        builds.append((time.perf_counter() - t0) * 1e3)
    sizes = bucket_kernels.bucket_sizes(offsets).float()
    dense = torch.cat([torch.arange(1, device=device), torch.arange(n - window, n, device=device)])
    dense_ids = dense.expand(1, hkv, -1).contiguous()
    dense_counts = torch.full((1, hkv), dense.numel(), device=device)
    index = (offsets, ids, width, dense_ids, dense_counts)
    kernel = bucket_kernels.bucket_sparse_decode_triton if device.type == "cuda" else \
        bucket_kernels.bucket_sparse_decode
    out, lse, counts = saap_step(case, index, probes, kernel)
    q, k, v, rope, net = case["q"], case["k"], case["v"], case["rope"], case["net"]
    group = hq // hkv

    def probe():
        pos = torch.full((1, 1, 1), n - 1, device=device)
        x = rope.invert(q[:, :, None, :], pos)[:, :, 0].view(hkv, group, d).to(q.dtype)
        return torch.topk(torch.softmax(net(x).float(), -1).sum(1), probes, dim=-1).indices

    # Correctness beside timing: softmax in float32 over a mask of the same keys (O(N)).
    hit = torch.zeros(hkv, clusters + 1, dtype=torch.bool, device=device)
    hit.scatter_(1, probe(), True)
    keep = hit.gather(1, assign[0])  # [Hkv, N]
    keep[:, dense] = True
    s = torch.einsum("hgd,hnd->hgn", q[0].float().view(hkv, group, d), k[0].float()) * d ** -0.5
    ref = torch.softmax(s.masked_fill(~keep[:, None], float("-inf")), -1) @ v[0].float()
    err = float((out[0].float().view(hkv, group, d) - ref).abs().max())
    row = {"n_keys": n, "heads": hq, "kv_heads": hkv, "head_dim": d, "dtype": str(dtype), "clusters": clusters,
           "hidden": case["net"].w1.shape[-1],
           "probes": probes, "dense": int(dense.numel()), "bucket_keys_mean": float(counts.float().mean()),
           "selectivity_indexed": float(counts.float().mean() / max(n - dense.numel(), 1)),
           "selectivity": float((counts.float().mean() + dense.numel()) / n),
           "bucket_size_mean": float(sizes.mean()), "bucket_size_max": float(sizes.max()),
           "index_build_ms": statistics.median(builds), "max_abs_err_vs_masked_fp32": err,
           "attention_path": kernel.__name__, "sparse_path": weighted.weighted_sparse_decode.__name__}
    buckets = torch.topk(torch.rand(1, hkv, clusters, device=device), probes, dim=-1).indices
    row["saap-step_us"] = timed(lambda: saap_step(case, index, probes, kernel))
    row["saap-attention_us"] = timed(lambda: kernel(q, k, v, dense_ids, dense_counts, offsets, ids, buckets, width))
    if device.type == "cuda":  # the kernel's work split: programs per (row, KV head), each a share of its keys
        for splits in (16, 32, 48, 64, 128):
            row[f"saap-attention@{splits}_us"] = timed(lambda splits=splits: kernel(
                q, k, v, dense_ids, dense_counts, offsets, ids, buckets, width, splits=splits))
        # the merge in its own launch (the method's choice at batch 1) against the fused ticket-counter merge
        row["saap-attention-separate-merge_us"] = timed(lambda: kernel(
            q, k, v, dense_ids, dense_counts, offsets, ids, buckets, width, fused_merge=False))
    row["saap-attention-reference_us"] = timed(lambda: bucket_kernels.bucket_sparse_decode(
        q, k, v, dense_ids, dense_counts, offsets, ids, buckets, width))
    row["saap-probe_us"] = timed(probe)
    row.update(method_rows(case, probes, window, hq, timer, iters))
    qs = q[:, :, None, :]
    row["sdpa_us"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
    if flashinfer is not None and device.type == "cuda":
        kn, vn = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        q0 = q[0]
        row["flashinfer_us"] = timed(lambda: flashinfer.single_decode_with_kv_cache(q0, kn, vn, kv_layout="NHD"))
        row["speedup_step_vs_flashinfer"] = row["flashinfer_us"] / row["saap-step_us"]
        row["speedup_attention_vs_flashinfer"] = row["flashinfer_us"] / row["saap-attention_us"]
        if "method-graph_us" in row:
            row["speedup_method_graph_vs_flashinfer"] = row["flashinfer_us"] / row["method-graph_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for results.json and results.md")
    p.add_argument("--lengths", default="32768,131072")
    p.add_argument("--probes", type=int, default=32)
    p.add_argument("--clusters", type=int, default=1024)
    p.add_argument("--window", type=int, default=2047)
    p.add_argument("--hidden", default="", help="comma-separated classifier widths, one row each per length "
                                                "(default: C, the paper's 1024 at C = 1024)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device, to check the script")
    p.add_argument("--tag", default="", help="names the variant (e.g. a branch) in results.json and the table's title, "
                                            "so that runs of two trees in one session stay apart")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and device.type != "cuda":
        print("no CUDA device: run with --smoke to check the script on CPU", file=sys.stderr)
        return 2
    if args.smoke:
        hq, hkv, d, dtype = 8, 2, 32, torch.float32
        lengths, clusters, probes, window = [3000], 64, 4, 127
        hiddens = [int(x) for x in args.hidden.split(",")] if args.hidden else [None]
    else:
        hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
        lengths = [int(x) for x in args.lengths.split(",")]
        clusters, probes, window = args.clusters, args.probes, args.window
        hiddens = [int(x) for x in args.hidden.split(",")] if args.hidden else [None]
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - optional
        flashinfer, fi_note = None, f"flashinfer not importable: {e}"
    else:
        fi_note = f"flashinfer {getattr(flashinfer, '__version__', '?')}"
    timer = None
    if device.type == "cuda":
        from kvsieve.bench.timing import ColdL2Timer

        timer = ColdL2Timer(device)

    def timed(fn):
        if timer is not None:
            return timer.time_us(fn, iters=args.iters)["median_us"]
        t = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(t)

    rows = []
    with torch.inference_mode():
        for n in lengths:
            for hidden in hiddens:
                row = measure(n, hq, hkv, d, clusters, probes, window, device, dtype, timed, flashinfer, timer,
                              args.iters, hidden)
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "flashinfer": fi_note, "command": " ".join(sys.argv), "smoke": args.smoke,
            "tag": args.tag, "kvsieve": str(Path(kvsieve.__file__).parent),
            "keys": "Gaussian mixture, C unit centres x4 + N(0, I) noise, Dirichlet(1) weights, roped (theta 5e5)"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    cols = ["n_keys", "hidden", "selectivity", "bucket_size_max", "index_build_ms", "saap-probe_us",
            "saap-attention_us", "saap-attention-reference_us", "saap-step_us", "method-eager_us", "method-graph_us",
            "sdpa_us", "flashinfer_us", "speedup_step_vs_flashinfer", "speedup_attention_vs_flashinfer",
            "speedup_method_graph_vs_flashinfer", "max_abs_err_vs_masked_fp32", "method_max_abs_err_vs_reference"]
    tag = f" [{args.tag}]" if args.tag else ""
    lines = [f"# SAAP decode step vs FlashInfer{tag} ({meta['device']}, {meta['date']})", "",
             f"`{meta['command']}`; {meta['flashinfer']}; saap-attention/step run `{rows[0]['attention_path']}`, "
             f"the reference runs `{rows[0]['sparse_path']}`; keys: {meta['keys']}.",
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "-"))
                                       for c in cols) + " |")
    for r in rows:
        kernels = r.get("method_kernels_us") or {}
        if kernels:
            lines += ["", f"Device time of one m.decode call at N = {r['n_keys']}, hidden {r['hidden']}, by kernel "
                          "(torch profiler, µs):", "",
                      "| kernel | µs |", "|---|---:|"]
            lines += [f"| `{name}` | {us:.1f} |" for name, us in sorted(kernels.items(), key=lambda x: -x[1])]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
