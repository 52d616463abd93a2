#!/usr/bin/env bash
# The README's demo figures: the demo once per seed (default 0 1 2), one after the other on a
# quiet machine, then the table (docs/demo_seeds.md) and the curves (docs/demo_reward.png).
#   bash scripts/demo_seeds.sh                 # seeds 0 1 2
#   SEEDS="0 0" bash scripts/demo_seeds.sh     # the same seed twice: run-to-run agreement
# Extra arguments go to every run's trainer. Runs land in runs/demo-seed<seed>[-<k>].
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-"0 1 2"}
OUT_MD=${DEMO_TABLE:-docs/demo_seeds.md}
OUT_PNG=${DEMO_CURVE:-docs/demo_reward.png}
runs=()
for seed in $SEEDS; do
  run="runs/demo-seed$seed"
  k=1
  while printf '%s\n' "${runs[@]}" | grep -qx "$run"; do k=$((k + 1)); run="runs/demo-seed$seed-$k"; done
  echo "[demo_seeds] seed $seed -> $run"
  DEMO_RUN_DIR="$run" bash scripts/demo.sh --seed "$seed" "$@"
  runs+=("$run")
done
.venv/bin/python scripts/demo_report.py --runs "${runs[@]}" --out_md "$OUT_MD" --out_png "$OUT_PNG" \
  --command "SEEDS=\"$SEEDS\" bash scripts/demo_seeds.sh${*:+ $*}"
