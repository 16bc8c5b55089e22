#!/usr/bin/env bash
# The issue-13/14 GPU session in one background job, for a lent machine that gets the SmolLM2 GGUF and
# the ShareGPT extract as files (it cannot install their wheels): the regeneration throughput table on
# real prompts (slot engine vs plain generate, nothing else on the GPU), then the whole drafter run.
#   bash benchmarks/gpu_pipeline.sh GGUF SHAREGPT_JSONL OUT_DIR     (knobs of smollm2_drafter.sh apply)
set -uo pipefail
GGUF=${1:?gguf}; SRC=${2:?sharegpt jsonl}; OUT=${3:?out dir}
mkdir -p "$OUT"
echo "[$(date +%T)] regen throughput" >> "$OUT/pipeline.log"
python3 benchmarks/regen_throughput.py --target "$GGUF" --prompts "$SRC" --num-prompts "${BENCH_PROMPTS:-2048}" \
    --max-new-tokens 1024 --max-prompt-tokens 1536 --batch-size 1024 --temperature 0.2 --top-p 0.9 --stop-loops \
    --modes "${BENCH_MODES:-slots,generate}" --json "$OUT/regen_throughput.json" > "$OUT/regen_throughput.log" 2>&1
echo "[$(date +%T)] drafter run" >> "$OUT/pipeline.log"
TARGET="$GGUF" DATA_SRC="$SRC" bash benchmarks/smollm2_drafter.sh "$OUT" >> "$OUT/pipeline.log" 2>&1
echo "[$(date +%T)] pipeline done" >> "$OUT/pipeline.log"
