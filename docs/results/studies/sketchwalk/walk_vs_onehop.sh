#!/usr/bin/env bash
# Rebuild docs/results/sketchwalk/walk-vs-onehop.md: the walk against one-hop selection at the same density,
# paired over the same prompts, in every committed task-score folder of Sketch&Walk (setup B and the two
# sparse-prefill modes). Run from the repository root: bash docs/results/studies/sketchwalk/walk_vs_onehop.sh
set -euo pipefail
kvsieve=${KVSIEVE:-.venv/bin/kvsieve}
dir=docs/results/sketchwalk
out=$dir/walk-vs-onehop.md
err=$(mktemp)
trap 'rm -f "$err"' EXIT
folders=(eval-setupB-2k-h200 eval-setupB-4k-h100 eval-setupB-4k-fwe-cpu eval-setupB-8k-h200
         eval-phase-prefill-2k-cpu eval-phase-prefill-4k-h200 eval-phase-prefill-8k-h200
         eval-phase-all-2k-cpu eval-phase-all-4k-h200 eval-phase-all-8k-h200)
{
    echo "# Sketch&Walk: the walk against one-hop selection, paired (default model)"
    echo
    echo "Made $(date -u +%F) by \`bash docs/results/studies/sketchwalk/walk_vs_onehop.sh\` from the committed folders with"
    echo "\`kvsieve compare DIR A B --metrics score,kl_answer,kl_mean,rel_error --markdown\` (A = the walk, B = one-hop"
    echo "at the same density and block budget; same prompts; 95 % paired bootstrap CIs; * = CI excludes 0)."
    echo "Setup B (\`eval-setupB-*\`) is decode-only: the context exact, the question chunk and the answer sparse;"
    echo "\`eval-phase-prefill-*\` is prefill-only, \`eval-phase-all-*\` end to end. Each folder's manifest.json holds its"
    echo "commands and devices. Positive KL / error differences mean the walk is further from dense attention than one-hop."
    for folder in "${folders[@]}"; do
        for density in 0.1 0.2; do
            if [[ $density == 0.2 ]]; then a=sketchwalk; b=sketchwalk:walk=one-hop
            else a=sketchwalk:density=0.1; b=sketchwalk:density=0.1,walk=one-hop; fi
            # a folder without one of the two methods has nothing to pair at this density; any other error stops
            if ! table=$("$kvsieve" compare "$dir/$folder" "$a" "$b" --metrics score,kl_answer,kl_mean,rel_error \
                    --markdown 2>"$err"); then
                grep -q "has no cells in this folder" "$err" && continue
                cat "$err" >&2
                exit 1
            fi
            echo
            echo "## \`$folder\`: \`$a\` − \`$b\`"
            echo
            echo "$table"
        done
    done
} > "$out"
echo "wrote $out"
