#!/bin/bash
# Does logit distillation raise acceptance at T=1? Two fine-tunes of one draft at equal steps, hard CE
# and `loss.distill_weight=1`, then benchmarks/t1_calibration.py on each (and on the draft as given).
#
#   bash benchmarks/distill_t1_probe.sh OUT DRAFT DATA.jsonl ANSWERS.jsonl [STEPS] [DATASET] [extra overrides...]
#
# DRAFT: the draft to start from (draft.init_from); DATA.jsonl: conversations the target answered itself
# (e.g. a regeneration's held-out file); ANSWERS.jsonl: an `evaluate` journal at T=1 (the target's own
# samples on the evaluation prompts, never trained on). Runs on a CPU in fp32 (the step is small: 2
# conversations, 64 anchors); the recipe is smollm2_135m_gpu.yaml's draft and loss with CPU settings.
set -euo pipefail
OUT=$1; DRAFT=$2; DATA=$3; ANSWERS=$4; STEPS=${5:-60}; DATASET=${6:-mtbench}; shift $(( $# < 6 ? $# : 6 ))
PY=${PYTHON:-python}
mkdir -p "$OUT"
for arm in ce:0 distill:1; do
    name=${arm%%:*}; w=${arm##*:}
    if [ ! -f "$OUT/$name/run/final/COMPLETE" ] && [ ! -d "$OUT/$name/export" ]; then
        $PY -m nemo_dflash.recipes.train --config smollm2_135m_gpu.yaml "output_dir=$OUT/$name/run" \
            "data.sources=[{path: $DATA}]" data.holdout_fraction=0.25 data.pack_length=0 data.max_length=1024 \
            data.pad_to_multiple_of=16 "draft.init_from=$DRAFT" target.dtype=fp32 train.precision=fp32 \
            train.compile=false train.compile_target=false train.micro_batch_size=2 loss.num_anchors=64 \
            "loss.distill_weight=$w" optim.lr=1e-4 optim.warmup_ratio=0 "train.max_steps=$STEPS" train.epochs=100 \
            train.log_every=10 "train.eval_every=$STEPS" train.eval_batches=13 train.max_minutes=30 \
            checkpoint.every_steps=100000 wandb.mode=disabled "$@" > "$OUT/$name.train.log" 2>&1
    fi
done
for d in "given:$DRAFT" "ce:$OUT/ce/run" "distill:$OUT/distill/run"; do
    echo "== ${d%%:*}"
    $PY benchmarks/t1_calibration.py --target pkg:smollm2 --draft "${d#*:}" --answers "$ANSWERS" --dataset "$DATASET" \
        --num-answers 40 --tokens 192 --draft-temperatures 1 --device cpu --dtype fp32 2>&1 | grep -v Loading | tail -4
done
grep -h "eval_accept_len" "$OUT"/ce/run/metrics.jsonl "$OUT"/distill/run/metrics.jsonl 2>/dev/null | tail -n 2 || true
