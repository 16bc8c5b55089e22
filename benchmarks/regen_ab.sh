#!/usr/bin/env bash
# A/B of the slot engine's switches on one GPU, in one process order, one machine: each config
# runs the whole-set row of regen_bench.sh (every conversation, every turn, loops cut, <= 1024 new
# tokens, T=0.2 / top-p 0.9) into OUT/<label>/, then regen_rows.py prints them as one table.
#
#   bash benchmarks/regen_ab.sh TARGET SHAREGPT_JSONL OUT [LABEL ...]
#
# Configs (LABELs; all of them if none is named) are the lines of CONFIGS below: a label, then
# regen_bench.sh's environment, against the engine's defaults (on a GPU since session 9: the
# compiled step, varlen prefills, window 12). Every config shares BATCH (default 2048) and WINDOW
# (default: the engine's).
# Extra environment is passed through (e.g. CONVS=4000 for a shorter set).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?target}; DATA=${2:?sharegpt jsonl}; OUT=${3:?out dir}; shift 3
PY=${PYTHON:-python3}
CONFIGS="
base
groups ATTN=groups
eager COMPILE=off
overlap OVERLAP=on
given SCHEDULE=given
"
want=" $* "
rows=()
while read -r label env; do
    [ -z "$label" ] && continue
    if [ $# -gt 0 ] && [[ "$want" != *" $label "* ]]; then continue; fi
    echo "== $label: ${env:-defaults}"
    # shellcheck disable=SC2086 # env is a list of VAR=value words
    env BATCH="${BATCH:-2048}" ${WINDOW:+WINDOW=$WINDOW} SKIP=first PYTHON="$PY" $env \
        bash benchmarks/regen_bench.sh "$TARGET" "$DATA" "$OUT/$label" || echo "== $label failed"
    file=$(ls "$OUT/$label"/regen_all_turns*.json 2>/dev/null | head -1 || true)
    [ -n "$file" ] && rows+=("$label=$file")
done <<< "$CONFIGS"
[ ${#rows[@]} -gt 0 ] && $PY benchmarks/regen_rows.py "${rows[@]}"
