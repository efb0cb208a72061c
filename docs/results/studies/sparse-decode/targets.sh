#!/usr/bin/env bash
# Issue 15's targets table from one GPU call: the kernel / streaming / quest / oracle-topk bench (run.py),
# the sampling baselines' bench (sampling.py: vattention, random, magicpig), then targets.py joining both
# into $OUT/targets.md. Batch 1 at 32k and 128k, batch 8 at 32k; FlashInfer in the same process as each
# script's rows (install it first, or its rows say why it is missing).
#
#   OUT=/tmp/out bash docs/results/studies/sparse-decode/targets.sh [--iters 10]
#
# About 5-6 minutes on an H100 / H200.
set -uo pipefail
OUT=${OUT:-/tmp/kvsieve-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 benchmarks/sparse_decode/run.py "$OUT" "$@" --variants flashinfer sdpa dense sparse-pages16 streaming \
    quest oracle-topk 2>&1 | tee "$OUT/run.txt" | grep -v "^|" | tail -60
python3 benchmarks/sparse_decode/sampling.py "$OUT" "$@" 2>&1 | tee "$OUT/sampling.txt" | grep -v "^|" | tail -40
python3 docs/results/studies/sparse-decode/targets.py "$OUT"
