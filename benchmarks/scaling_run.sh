#!/usr/bin/env bash
# FSDP2 scaling run of the qwen3_8b recipe on a random-weight Qwen3-8B target, with one resume.
#   bash benchmarks/scaling_run.sh NPROC STEPS TOKENIZER_DIR OUT_DIR [--conversations N] [--log-every N]
# --conversations: synthetic chats to write (default 200; enough for STEPS x NPROC rows), --log-every:
# the recipe's train.log_every (default 20).
# The target is built from benchmarks/qwen3_8b_config/config.json (random weights, so no
# checkpoint download); the data are synthetic long chats (throughput does not depend on values).
set -euo pipefail
NPROC=${1:-2}; STEPS=${2:-200}; TOK=${3:?tokenizer dir}; OUT=${4:-outputs/scaling}
shift $(( $# < 4 ? $# : 4 ))
NCONV=200; LOG_EVERY=20
while [ $# -gt 0 ]; do
    case $1 in
        --conversations) NCONV=${2:?--conversations N}; shift 2 ;;
        --log-every) LOG_EVERY=${2:?--log-every N}; shift 2 ;;
        *) echo "unknown argument '$1' (--conversations N, --log-every N)"; exit 2 ;;
    esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
mkdir -p "$(dirname "$OUT")"
cp "$HERE/qwen3_8b_config/config.json" "$TOK"/* "$WORK/"
python3 - "$WORK/chat.jsonl" "$NCONV" <<'PY'
import json, random, sys
rnd = random.Random(0)
words = "the of and to in is that for it as with was on be by this are from or at an have not".split()
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        q = " ".join(rnd.choice(words) for _ in range(rnd.randint(50, 300)))
        a = " ".join(rnd.choice(words) for _ in range(rnd.randint(1500, 3000)))
        f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
PY
COMMON=(--config qwen3_8b.yaml target.path="$WORK" target.random_init=true "data.sources=[{path: $WORK/chat.jsonl}]"
        data.holdout_fraction=0.0 train.eval_every=null train.log_every=$LOG_EVERY wandb.mode=disabled output_dir="$OUT"
        distributed.strategy=fsdp2 checkpoint.keep_last=2)
HALF=$((STEPS / 2))
export NEMO_DFLASH_NO_BAR=1
# First half, checkpoint, stop; then resume to the end (the resume is part of the measurement).
torchrun --standalone --nproc-per-node "$NPROC" -m nemo_dflash.recipes.train "${COMMON[@]}" \
    train.max_steps="$STEPS" train.max_minutes=null checkpoint.every_steps="$HALF" train.epochs=1 \
    > "$OUT.first.log" 2>&1 &
PID=$!
# stop the first run right after its mid-run checkpoint with SIGTERM (a scheduler's preemption)
while [ ! -f "$OUT/checkpoints/step_$(printf %08d "$HALF")/COMPLETE" ]; do
    sleep 2; kill -0 $PID 2>/dev/null || { echo "first run ended early:"; tail -n 30 "$OUT.first.log"; break; }
done
pkill -TERM -f "nemo_dflash.recipes.train" || true
wait $PID || true
echo "--- resumed"
torchrun --standalone --nproc-per-node "$NPROC" -m nemo_dflash.recipes.train "${COMMON[@]}" \
    train.max_steps="$STEPS" checkpoint.every_steps="$STEPS" > "$OUT.resume.log" 2>&1 || tail -n 30 "$OUT.resume.log"
python3 - "$OUT" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
for r in recs:
    if "tok_s" in r:
        print(f"step {r['step']:>4}  loss {r['loss']:.3f}  step {r['step_s']*1e3:.0f} ms  "
              f"tok/s (all GPUs) {r['tok_s']:.0f}  peak {r.get('peak_mem_gb', 0):.1f} GB")
PY
