#!/usr/bin/env bash
# Issue 13's throughput table on one GPU: the regeneration pipeline on the whole ShareGPT set
# (every turn, slot reuse, loops cut: what `regenerate` runs), then the slot engine against plain
# batched `model.generate` on the same first-turn prompts in the same process.
#
#   bash benchmarks/regen_bench.sh TARGET SHAREGPT_JSONL OUT
#
# TARGET: a .gguf or HF dir; SHAREGPT_JSONL: `python benchmarks/sharegpt_first_turns.py X --turns=all`.
# Environment: BATCH (slots, default 1024), CONVS (conversations of the whole-set row, 0 = all),
# FIRST (first-turn prompts of the generate comparison, default 2048), FIRST_NEW (their new tokens,
# default 256: plain generate runs every batch to its longest answer), REFILL (slot refill fraction,
# default the engine's), MERGE=1 (fresh and continuing prefills in shared forwards), SKIP (rows to
# skip: all|first|pipeline), PREPARE (first turns prepared ahead on a thread: regenerate_conversations(prepare_ahead=)),
# PLAN (prefill split: min_cost, the default, or greedy), MAX_PREFILL (rows x longest per prefill, default 65536;
# packed: real tokens per prefill), LAYOUT (prefill forwards: packed, the default, or padded), GROUP_COST
# (packed: an attention group's fixed cost in query-key pairs), WINDOW (decode steps per host round trip), SCHEDULE (most_turns_first, the default, or given),
# COMPILE (on|off: the decode step through torch.compile), ATTN (groups|varlen: packed prefill attention),
# OVERLAP (on|off: the next decode window launched before the loop checks).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?target}; DATA=${2:?sharegpt jsonl}; OUT=${3:?out dir}
PY=${PYTHON:-python3}
BATCH=${BATCH:-1024}; CONVS=${CONVS:-0}; FIRST=${FIRST:-2048}; FIRST_NEW=${FIRST_NEW:-256}; SKIP=${SKIP:-}
EXTRA=(); [ -n "${REFILL:-}" ] && EXTRA+=(--refill-fraction "$REFILL"); [ "${MERGE:-0}" = 1 ] && EXTRA+=(--merge-prefills)
[ -n "${PREPARE:-}" ] && EXTRA+=(--prepare-ahead "$PREPARE")
[ -n "${PLAN:-}" ] && EXTRA+=(--prefill-plan "$PLAN")
[ -n "${LAYOUT:-}" ] && EXTRA+=(--prefill-layout "$LAYOUT")
[ -n "${GROUP_COST:-}" ] && EXTRA+=(--attention-group-cost "$GROUP_COST")
[ -n "${WINDOW:-}" ] && EXTRA+=(--decode-window "$WINDOW")
[ -n "${SCHEDULE:-}" ] && EXTRA+=(--schedule "$SCHEDULE")
[ -n "${COMPILE:-}" ] && EXTRA+=(--decode-compile "$COMPILE")
[ -n "${ATTN:-}" ] && EXTRA+=(--prefill-attention "$ATTN")
[ -n "${OVERLAP:-}" ] && EXTRA+=(--overlap-checks "$OVERLAP")
EXTRA+=(--max-prefill-tokens "${MAX_PREFILL:-65536}")
TAG=${REFILL:+_r$REFILL}; [ "${MERGE:-0}" = 1 ] && TAG+=_merged; TAG+=${PREPARE:+_p$PREPARE}${MAX_PREFILL:+_m$MAX_PREFILL}${PLAN:+_$PLAN}${LAYOUT:+_$LAYOUT}${GROUP_COST:+_g$GROUP_COST}${WINDOW:+_w$WINDOW}${SCHEDULE:+_$SCHEDULE}${COMPILE:+_c$COMPILE}${ATTN:+_$ATTN}${OVERLAP:+_o$OVERLAP}
[ "$BATCH" != 1024 ] && TAG+=_b$BATCH
mkdir -p "$OUT"
common=(--target "$TARGET" --prompts "$DATA" --max-prompt-tokens 1536 --batch-size "$BATCH"
        --temperature 0.2 --top-p 0.9 "${EXTRA[@]}")
if [ "$SKIP" != all ] && [ "$SKIP" != pipeline ]; then
    echo "== the pipeline: every conversation, every turn, slot reuse, loops cut"
    $PY benchmarks/regen_throughput.py "${common[@]}" --turns all --num-prompts "$CONVS" --stop-loops \
        --max-new-tokens 1024 --modes slots --json "$OUT/regen_all_turns$TAG.json" 2>&1 \
        | tee "$OUT/regen_all_turns$TAG.log"
fi
if [ "$SKIP" != first ]; then
    echo "== slot engine vs plain generate, same first-turn prompts, loops kept (the same work on both sides)"
    $PY benchmarks/regen_throughput.py "${common[@]}" --turns first --num-prompts "$FIRST" \
        --max-new-tokens "$FIRST_NEW" --modes slots,generate --json "$OUT/regen_first_turns.json" 2>&1 | tee "$OUT/regen_first_turns.log"
fi
