#!/usr/bin/env bash
# The tool demo: GRPO teaches the tiny model to call a calculator for 3-digit sums it cannot do.
#   1. installs into ./.venv if needed
#   2. makes the starting model (scripts/prepare_tool_demo.py: knows how to call the calculator and
#      read its answer, calls it in about 1 rollout in 6) and the training prompts (a+b, 100..499)
#   3. for each seed in SEEDS (default "0"): a run with the calculator, then the same run with
#      every tool call refused (tools: []), each a private Ray head on 127.0.0.1, one generation
#      worker (vLLM) running tool_environment.ToolEnvironment, one logprob worker holding the
#      starting model (the KL term's reference), and torchrun --nproc_per_node=2
#   4. prints each run's curve (10-step mean reward and tool-call share), its rise within 10
#      minutes, and tool_gain= (final reward with the tool over without); draws the curves
# Ten seeds, as docs/demo_tools.md reports them: SEEDS="0 1 2 3 4 5 6 7 8 9" bash scripts/demo_tools.sh
# Extra arguments go to both trainers, e.g. --num_steps 20; DEMO_TOOLS_CLUSTER_ARGS to local_cluster.py
# (e.g. "--enforce_eager true"); DEMO_TOOLS_ASSETS / DEMO_TOOLS_RUNS move its folders.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=.venv/bin/python
ASSETS=${DEMO_TOOLS_ASSETS:-runs/tool-demo-assets}
RUNS=${DEMO_TOOLS_RUNS:-runs}
SEEDS=${SEEDS:-0}
read -r -a CLUSTER_ARGS <<< "${DEMO_TOOLS_CLUSTER_ARGS:-}"

if [ ! -f "$ASSETS/model/model.safetensors" ] || [ ! -f "$ASSETS/sums.jsonl" ]; then
  echo "[demo_tools] preparing the starting model and prompts in $ASSETS"
  $PY scripts/prepare_tool_demo.py --out_dir "$ASSETS"
fi

run() {  # run DIR TOOLS SEED [trainer args...]
  local dir=$1 tools=$2 seed=$3
  shift 3
  rm -rf "$dir"
  mkdir -p "$dir"
  date +%s.%N > "$dir/command_started_at"
  echo "[demo_tools] seed $seed, tools $tools: training in $dir"
  $PY local_cluster.py --model_path "$ASSETS/model" --run_dir "$dir" --nproc_per_node 2 \
    ${CLUSTER_ARGS[@]+"${CLUSTER_ARGS[@]}"} -- \
    --config configs/demo_tools.yaml --data.path "$ASSETS/sums.jsonl" --seed "$seed" \
    --sampling.environment.options "{\"tools\": $tools, \"format\": \"text\"}" "$@"
  date +%s.%N > "$dir/command_finished_at"
}

WITH=()
WITHOUT=()
for seed in $SEEDS; do
  run "$RUNS/demo-tools-s$seed" '["calculator"]' "$seed" "$@"
  run "$RUNS/demo-tools-notool-s$seed" '[]' "$seed" "$@"
  WITH+=("$RUNS/demo-tools-s$seed")
  WITHOUT+=("$RUNS/demo-tools-notool-s$seed")
done
$PY scripts/demo_tools_report.py --with_tool "${WITH[@]}" --without_tool "${WITHOUT[@]}" \
  --out_png "$RUNS/demo-tools-reward.png"
echo "[demo_tools] reward curves in $RUNS/demo-tools-reward.png"
