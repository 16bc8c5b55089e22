#!/usr/bin/env bash
# Regeneration throughput on one GPU: the regeneration pipeline on the whole ShareGPT set (every turn,
# slot reuse, loops cut: what `regenerate` runs), then the slot engine against plain batched
# `model.generate` on the same first-turn prompts in the same process. Both are
# `benchmarks/regen_throughput.py` runs; this script only fixes the settings of docs/data.md's table.
#
#   bash benchmarks/regen_bench.sh TARGET SHAREGPT_JSONL OUT [--skip first|pipeline] [--conversations N]
#        [--first N] [--first-new N] [regen_throughput.py flags ...]
#
# TARGET: a .gguf or HF dir; SHAREGPT_JSONL: `python benchmarks/sharegpt_first_turns.py X --turns=all`.
# --skip: leave out the generate comparison (first) or the whole-set row (pipeline); --conversations:
# conversations of the whole-set row (default 0 = all); --first / --first-new: first-turn prompts of the
# generate comparison and their new tokens (defaults 2048 and 256: plain generate runs every batch to its
# longest answer). Any other flag goes to both regen_throughput.py runs and wins over the defaults here,
# e.g. --batch-size 2048 --decode-window 12 --prefill-attention varlen --decode-compile on
# (`python benchmarks/regen_throughput.py --help` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: regen_bench.sh TARGET SHAREGPT_JSONL OUT [--skip first|pipeline] [--conversations N] [--first N] [--first-new N] [regen_throughput.py flags]"
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,16p' "$0"; exit 0; fi
TARGET=${1:?$usage}; DATA=${2:?$usage}; OUT=${3:?$usage}
shift 3
SKIP=; CONVS=0; FIRST=2048; FIRST_NEW=256; EXTRA=()
while [ $# -gt 0 ]; do
    case $1 in
        --skip) SKIP=${2:?--skip first|pipeline}; shift 2 ;;
        --conversations) CONVS=${2:?--conversations N}; shift 2 ;;
        --first) FIRST=${2:?--first N}; shift 2 ;;
        --first-new) FIRST_NEW=${2:?--first-new N}; shift 2 ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
case $SKIP in ""|first|pipeline) ;; *) echo "--skip takes first or pipeline, not '$SKIP'" >&2; exit 2 ;; esac
# the output names carry the extra flags, so runs with different settings do not overwrite each other
TAG=$(printf '%s' "${EXTRA[*]:-}" | tr -c 'A-Za-z0-9.=-' '_' | sed 's/--//g; s/^_*//; s/_*$//')
TAG=${TAG:+_$TAG}
mkdir -p "$OUT"
common=(--target "$TARGET" --prompts "$DATA" --max-prompt-tokens 1536 --batch-size 1024
        --temperature 0.2 --top-p 0.9 --max-prefill-tokens 65536)
if [ "$SKIP" != pipeline ]; then
    echo "== the pipeline: every conversation, every turn, slot reuse, loops cut"
    python3 benchmarks/regen_throughput.py "${common[@]}" --turns all --num-prompts "$CONVS" --stop-loops \
        --max-new-tokens 1024 --modes slots "${EXTRA[@]}" --json "$OUT/regen_all_turns$TAG.json" 2>&1 \
        | tee "$OUT/regen_all_turns$TAG.log"
fi
if [ "$SKIP" != first ]; then
    echo "== slot engine vs plain generate, same first-turn prompts, loops kept (the same work on both sides)"
    python3 benchmarks/regen_throughput.py "${common[@]}" --turns first --num-prompts "$FIRST" \
        --max-new-tokens "$FIRST_NEW" --modes slots,generate "${EXTRA[@]}" --json "$OUT/regen_first_turns$TAG.json" 2>&1 \
        | tee "$OUT/regen_first_turns$TAG.log"
fi
