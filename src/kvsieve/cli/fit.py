"""``kvsieve fit``: offline fitting for methods that need it (``kvsieve fit saap``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit", help="fit a method's offline artifacts (SAAP's key partition and query classifier)",
                       description="Fit the offline part of a method for one model.")
    which = p.add_subparsers(dest="fit_method", metavar="METHOD", required=True)
    s = which.add_parser(
        "saap", help="spherical k-means of pre-RoPE keys + query classifier, per layer and head",
        description="Collect pre-RoPE q/k of the model on the training essays (every fourth essay; the rest "
        "is held out), then per layer >= 1: spherical k-means (FAISS) per KV head, attention-mass labels, the "
        "long-range filter and the query classifier. Resumable: rerun the same command to continue. "
        "Time for SmolLM2-135M at the defaults: the collection (one 4096-token prefill per prompt, 9 prompts) "
        "about 4 minutes on 2 CPU cores, then 4-8 s per layer, about 7 minutes in all (measured with "
        "--threads 1 beside another job); several times that on a busier machine; 1 minute on an H100. "
        "--layers shortens the per-layer part only (every prefill runs the whole model). Disk: about 57 MB "
        "of q/k per layer still to fit (1.6 GB for all 29 layers at the start), each layer's deleted once "
        "it is fitted.")
    s.add_argument("--out", type=Path, required=True, help="artifact directory (created; resumed if it holds this fit)")
    s.add_argument("--model", default=None, help="'default' (offline SmolLM2-135M) or a transformers id/path")
    s.add_argument("--clusters", type=int, default=None,
                   help="C, buckets per KV head (default 256: the paper's 1024 is for 100k-500k tokens; at "
                        "2k-8k, 256 keeps about 8-30 keys per bucket and ℓ = 4..64 spans 1.6-25%%)")
    s.add_argument("--kmeans-iters", type=int, default=None, help="k-means iterations (the paper: 10)")
    s.add_argument("--kmeans-backend", choices=("faiss", "torch"), default=None,
                   help="faiss (default: FAISS's CPU k-means, with its sampling) or torch (on --device, every key)")
    s.add_argument("--prompt-tokens", type=int, default=None, help="tokens per training prompt")
    s.add_argument("--prompts", type=int, default=None, help="training prompts")
    s.add_argument("--val-prompts", type=int, default=None, help="validation prompts (recall metrics)")
    s.add_argument("--queries", type=int, default=None,
                   help="candidate queries per prompt and query head (before the long-range filter)")
    s.add_argument("--long-range", type=int, default=None,
                   help="keep queries whose best key is more than this many positions back (the paper: 1024 "
                        "with a 2047 window); default: the --long-range-keep farthest")
    s.add_argument("--long-range-keep", type=float, default=None,
                   help="without --long-range: keep this fraction of the candidate queries whose best key lies "
                        "farthest back (default 0.21, the paper's pass rate)")
    s.add_argument("--non-causal-labels", action="store_true",
                   help="labels from attention over past and future keys (the paper's apparent default; "
                        "measured worse here, docs/methods/saap.md)")
    s.add_argument("--per", choices=("kv", "query"), default=None,
                   help="one classifier per KV head (default: a group shares one, G times fewer weights to "
                        "read per step) or per query head")
    s.add_argument("--hidden", type=int, default=None, help="classifier hidden width")
    s.add_argument("--steps", type=int, default=None, help="Adam steps per layer (the paper: 40k)")
    s.add_argument("--batch", type=int, default=None, help="rows per step and model")
    s.add_argument("--lr", type=float, default=None, help="Adam learning rate (the paper: 1e-5 over 40k steps)")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--layers", default="", help="comma-separated layers to fit (default: every layer >= 1)")
    s.add_argument("--keep-dumps", action="store_true",
                   help="keep the q/k dumps (DIR/dumps) of every fitted layer instead of deleting each once fitted")
    s.add_argument("--overwrite", action="store_true", help="replace a fit with other settings in --out")
    s.add_argument("--device", default=None,
                   help="run the prefills, labels and classifier there, e.g. cuda (default: cpu); k-means stays on "
                        "FAISS's CPU path")
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    s.set_defaults(handler=run_saap)


# FitConfig fields set from flags of the same name; unset flags keep FitConfig's defaults (shown by
# `kvsieve fit saap --help` through the help texts, without importing torch to build the parser).
_FIELDS = ("model", "clusters", "kmeans_iters", "kmeans_backend", "prompt_tokens", "prompts", "val_prompts", "queries",
           "long_range", "long_range_keep", "per", "hidden", "steps", "batch", "lr", "seed")


def run_saap(args: argparse.Namespace) -> int:
    import torch

    from ..fit.saap import FitConfig, fit_saap

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        layers = tuple(int(x) for x in args.layers.split(",") if x.strip()) or None
    except ValueError:
        raise ValueError(f"--layers: expected comma-separated integers, got {args.layers!r}") from None
    given = {name: getattr(args, name) for name in _FIELDS if getattr(args, name) is not None}
    cfg = FitConfig(causal_labels=not args.non_causal_labels, layers=layers, **given)
    cfg.validate()  # before loading the model
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device: {args.device} asked for, but torch sees no CUDA device")
    manifest = fit_saap(cfg, args.out, keep_dumps=args.keep_dumps, overwrite=args.overwrite, device=args.device)
    wall = manifest["wall_s"]
    print(f"SAAP artifacts in {args.out}: layers {manifest['layers_done']}, complete={manifest['complete']}; "
          f"wall time {wall['total']:.0f} s (collect {wall['collect']:.0f} s), this run {wall['this_run']:.0f} s")
    print(f"use with: kvsieve.method('saap:artifacts={args.out}')")
    return 0
