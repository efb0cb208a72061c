#!/usr/bin/env bash
# One call on a GPU machine: the runtime's gpu-marked tests, then `kvsieve bench e2e` for the README's results
# table (Llama-3.1-8B shape, random weights; batch 1 at 32k and 128k, batch 8 at 32k; runtime dense,
# transformers' eager decode, and the methods at about 5 % density where they take a size; MagicPIG also under
# its previous rule (one table, the hub's weight); Sketch&Walk decodes eagerly), all under $OUT. CASES=1x128k (etc.) runs a subset.
#
#   bash benchmarks/runtime/gpu_run.sh            # carry .device_data/wheels (pytest) if the image lacks it
#   bash benchmarks/runtime/gpu_run.sh --no-tests # the benchmark alone (ATTENTION=peaked: calibrated attention)
#
# Expected time on an H100: tests ~1.5 min (Triton compiles), benchmark ~4 min for the three cases (10 methods;
# CASES=1x128k runs one case).
# Build .device_data/wheels here with:
#   pip download --no-deps --only-binary=:all: -d .device_data/wheels pytest pluggy iniconfig packaging pygments
set -uo pipefail
OUT=${OUT:-/tmp/kvsieve-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ! python3 -c "import pytest" 2>/dev/null && compgen -G ".device_data/wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvsieve-testsite .device_data/wheels/*.whl
    export PYTHONPATH="/tmp/kvsieve-testsite:$PYTHONPATH"
fi
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if [[ "${1:-}" != "--no-tests" ]]; then
    timeout 150 python3 -m pytest tests/test_runtime.py -m gpu -q -rs --maxfail=20 -p no:cacheprovider \
        2>&1 | tee "$OUT/gpu_tests.txt" | tail -40
fi
CASES=${CASES:-1x32k,1x128k,8x32k}
METHODS="santa-prop:budget=128;quest:top_k=0.05,share_kv_group=true;streaming:sink=128,window=1536"
METHODS+=";santa-flash:budget=2048;oracle-topk:top_k=0.05,share_kv_group=true;oracle-topp:top_p=0.9"
METHODS+=";random:budget=0.05;magicpig:bits=8,tables=16,budget=0.05;vattention;vattention:predictor=quest"
METHODS+=";magicpig:bits=8,tables=16,budget=0.05,min_tables=1,weight_eps=0,transform=mips;sketchwalk:variant=reconstruction,density=0.1"
timeout ${BENCH_TIMEOUT:-560} python3 -m kvsieve.cli.main bench e2e --shapes llama-3.1-8b --cases "$CASES" --attention "${ATTENTION:-uniform}" \
    --methods "$METHODS" --baselines runtime,hf-eager --out "$OUT" --name "e2e-${CASES//,/-}" \
    --record-command "CASES=$CASES bash benchmarks/runtime/gpu_run.sh" 2>&1 | tee "$OUT/bench.txt" | tail -60
