#!/usr/bin/env bash
# The README's main job: a complete local GRPO run on the bundled tiny model, on CPU or on this
# machine's GPUs.
#   1. installs into ./.venv if needed
#   2. makes the starting model (tiny Qwen2 warmed up on the answer format only), the training
#      prompts and the evaluation table (every single-digit sum once)
#   3. starts a private Ray head on 127.0.0.1, one generation + one logprob worker, and
#      torchrun trainer_core.py with 2 ranks (local_cluster.py stops all of it on exit). On a
#      machine with one or two GPUs the trainer runs one rank with twice the prompts per rank (the
#      same 512 rollouts per step), everything placed by the launcher's plan (docs/real_models.md)
#   4. the trainer ends with its summary (when the 10-step mean reward reached 0.5 / 0.6 / 0.9,
#      counted from this command's start; the last evaluation; where a step's time goes); then
#      the reward curve goes to <run_dir>/reward.png
# The console shows a progress bar, evaluations, warnings and that summary; every INFO line is in
# <run_dir>/run.log (docs/console.md). Extra arguments go to the trainer, e.g.
#   bash scripts/demo.sh --seed 1   or   --num_steps 50   or   --log_level info (INFO lines here too)
set -euo pipefail
cd "$(dirname "$0")/.."
COMMAND_STARTED_AT=$(date +%s.%N)
bash scripts/install.sh
source scripts/device.sh
PY=.venv/bin/python
# The demo's batch is 2 ranks x 16 prompts x 16 rollouts; one rank takes all 32 prompts.
RANKS=(--nproc_per_node 2)
# GPUs as the launcher counts them (async_grpo/runtime/host_gpus.py: a scheduler's CUDA_VISIBLE_DEVICES respected).
if [ "$(detect_device)" = cuda ] && [ "$($PY -m async_grpo.runtime.host_gpus)" -le 2 ]; then
  RANKS=(--nproc_per_node 1 -- --prompts_per_rank 32)
else
  RANKS=("${RANKS[@]}" --)
fi
for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'  # this header, then the trainer's flags
    echo
    exec $PY trainer_core.py --help
  fi
done
ASSETS=${DEMO_ASSETS:-runs/demo-assets}
RUN_DIR=${DEMO_RUN_DIR:-runs/demo}

if [ ! -f "$ASSETS/model/model.safetensors" ] || [ ! -f "$ASSETS/arithmetic.jsonl" ] || [ ! -f "$ASSETS/arithmetic_eval.jsonl" ]; then
  echo "[demo] preparing the starting model and data in $ASSETS"
  $PY scripts/prepare_demo.py --out_dir "$ASSETS"
fi
rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
echo "$COMMAND_STARTED_AT" > "$RUN_DIR/command_started_at"
echo "[demo] training in $RUN_DIR (Ctrl-C stops everything)"
$PY local_cluster.py --model_path "$ASSETS/model" --run_dir "$RUN_DIR" "${RANKS[@]}" \
  --config configs/demo.yaml --data.path "$ASSETS/arithmetic.jsonl" \
  --eval.data.path "$ASSETS/arithmetic_eval.jsonl" "$@"
COMMAND_FINISHED_AT=$(date +%s.%N)
echo "$COMMAND_FINISHED_AT" > "$RUN_DIR/command_finished_at"
$PY -m async_grpo.telemetry.metrics plot --run_dir "$RUN_DIR" --out "$RUN_DIR/reward.png" --title "demo: tiny Qwen2, single-digit addition, 2 CPU cores" > /dev/null
awk -v s="$COMMAND_STARTED_AT" -v e="$COMMAND_FINISHED_AT" -v d="$RUN_DIR" \
  'BEGIN { printf "[demo] whole command %.1f min; reward curve in %s/reward.png\n", (e - s) / 60, d }'
