#!/usr/bin/env bash
# The README's main job: a complete local GRPO run on the bundled tiny model, on CPU.
#   1. installs into ./.venv if needed
#   2. makes the starting model (tiny Qwen2 warmed up on the answer format only) and the data
#   3. starts a private Ray head on 127.0.0.1, one generation + one logprob worker, and
#      torchrun --nproc_per_node=2 trainer_core.py (local_cluster.py stops all of it on exit)
#   4. draws the reward curve to <run_dir>/reward.png
# Extra arguments go to the trainer, e.g.  bash scripts/demo.sh --num_steps 50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_cpu.sh
PY=.venv/bin/python
ASSETS=${DEMO_ASSETS:-runs/demo-assets}
RUN_DIR=${DEMO_RUN_DIR:-runs/demo}

if [ ! -f "$ASSETS/model/model.safetensors" ] || [ ! -f "$ASSETS/arithmetic.jsonl" ]; then
  echo "[demo] preparing the starting model and data in $ASSETS"
  $PY scripts/prepare_demo.py --out_dir "$ASSETS"
fi
rm -rf "$RUN_DIR"
echo "[demo] training; progress in $RUN_DIR/metrics.jsonl (Ctrl-C stops everything)"
$PY local_cluster.py --model_path "$ASSETS/model" --run_dir "$RUN_DIR" --nproc_per_node 2 -- \
  --config configs/demo.yaml --data.path "$ASSETS/arithmetic.jsonl" "$@"
$PY metrics.py plot --run_dir "$RUN_DIR" --out "$RUN_DIR/reward.png" --title "demo: tiny Qwen2, single-digit addition, 2 CPU cores"
$PY - "$RUN_DIR" <<'PYEOF'
import sys
from pathlib import Path
from metrics import read_metrics, summarize_reward
print("[demo]", summarize_reward(read_metrics(Path(sys.argv[1]) / "metrics.jsonl")))
PYEOF
