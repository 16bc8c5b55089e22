#!/usr/bin/env bash
# Our SmolLM2 drafter against SpecForge's DFlash trainer at equal data and steps
# (benchmarks/peer_quality.py; setup and substitutions: docs/peer_quality.md).
#
#   bash benchmarks/peer_quality.sh stage SPECFORGE_CHECKOUT [DEST]
#       copy the peer's python package (specforge/, version.txt, LICENSE; 2 MB) and its commit into
#       DEST (default outputs/peer_src/SpecForge, an ignored path: never committed), so that it can
#       travel to a GPU machine that cannot clone it
#   bash benchmarks/peer_quality.sh train|eval|all TARGET DATA OUT [peer_quality.py args...]
#       train: both trainings + curves + exports (one 10-minute GPU command); eval: our evaluate on
#       the two exports (re-run to continue a partial evaluation); all: both. Any further argument goes
#       to peer_quality.py: --peer-src DIR (default outputs/peer_src/SpecForge), --json PATH (the
#       working result, default OUT/peer_quality.json), --bench-json docs/bench/peer_quality.json, ...
#
# Runs the `python3` on PATH (activate the environment first). Wheels in .whl/ are installed first
# when omegaconf or torchdata is missing; the peer itself needs no extra package.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: peer_quality.sh stage CHECKOUT [DEST] | train|eval|all TARGET DATA OUT [args]}
shift
PY=python3

if [ "$mode" = stage ]; then
    src=${1:?usage: peer_quality.sh stage SPECFORGE_CHECKOUT [DEST]}
    dest=${2:-outputs/peer_src/SpecForge}
    [ -f "$src/specforge/algorithms/common/dflash_family_model.py" ] || { echo "$src is not a SpecForge checkout"; exit 2; }
    rm -rf "$dest" && mkdir -p "$dest"
    cp -r "$src/specforge" "$dest/"
    for f in version.txt LICENSE; do [ -f "$src/$f" ] && cp "$src/$f" "$dest/"; done
    git -C "$src" rev-parse HEAD > "$dest/COMMIT"
    find "$dest" -name __pycache__ -type d -prune -exec rm -rf {} +
    echo "staged SpecForge $(cat "$dest/COMMIT") in $dest ($(du -sh "$dest" | cut -f1))"
    exit 0
fi

case $mode in train|eval|all) ;; *) echo "unknown mode '$mode' (stage train eval all)"; exit 2 ;; esac
TARGET=${1:?target}; DATA=${2:?data jsonl}; OUT=${3:?out dir}; shift 3
if ! $PY -c "import omegaconf, torchdata" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps .whl/*.whl
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} NEMO_DFLASH_NO_BAR=1 WANDB_MODE=disabled
args=(--stage "$mode" --target "$TARGET" --out "$OUT")
[ "$mode" != eval ] && args+=(--data "$DATA")
mkdir -p "$OUT"
$PY benchmarks/peer_quality.py "${args[@]}" "$@" 2>&1 | tee -a "$OUT/peer_quality_$mode.log"
