#!/usr/bin/env bash
# The demo per max_lag and seed, one run after the other, then one table of how soon each learns
# and how stale its rollouts were (scripts/lag_report.py): the evidence for the demo's max_lag.
#   bash scripts/demo_lag.sh                                 # LAGS="0 1 2", SEEDS="0 1 2"
#   LAGS="1" SEEDS="0 1 2 3 4 5 6 7 8 9" bash scripts/demo_lag.sh --num_steps 320
# Extra arguments go to every run's trainer. Runs land in ${DEMO_LAG_RUNS:-runs}/demo-lag<lag>-s<seed>;
# the table goes to ${DEMO_LAG_TABLE:-runs/demo_lag.md}.
set -euo pipefail
cd "$(dirname "$0")/.."
LAGS=${LAGS:-"0 1 2"}
SEEDS=${SEEDS:-"0 1 2"}
ROOT=${DEMO_LAG_RUNS:-runs}
TABLE=${DEMO_LAG_TABLE:-runs/demo_lag.md}
runs=()
for lag in $LAGS; do
  for seed in $SEEDS; do
    run="$ROOT/demo-lag$lag-s$seed"
    echo "[demo_lag] max_lag $lag, seed $seed -> $run"
    DEMO_RUN_DIR="$run" bash scripts/demo.sh --seed "$seed" --max_lag "$lag" "$@"
    runs+=("$run")
  done
done
.venv/bin/python scripts/lag_report.py --runs "${runs[@]}" --out_md "$TABLE" \
  --command "LAGS=\"$LAGS\" SEEDS=\"$SEEDS\" bash scripts/demo_lag.sh${*:+ $*}"
