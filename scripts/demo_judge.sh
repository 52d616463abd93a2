#!/usr/bin/env bash
# The judge demo: the demo's tiny model learns single-digit addition from a model judge alone.
#   1. installs into ./.venv if needed
#   2. makes the demo's starting model and prompts (scripts/prepare_demo.py) and the judge
#      (scripts/prepare_judge_demo.py: a tiny Qwen2 taught to answer yes or no to "a+b=c", with
#      the chat template and the judge's template file beside it)
#   3. for each seed in SEEDS (default "0"): the demo (configs/demo.yaml) with the judge's verdict
#      as the only reward (sampling.reward.functions judge, weight 1), math-verify scored beside it
#      at weight 0 (reward/math_verify_reward, and reward/judge_agreement: the share of answers the
#      two call alike), evaluation by math-verify alone (eval.reward math_verify); a private Ray head
#      on 127.0.0.1, one generation, one logprob and one judge worker, torchrun with 2 ranks
#   4. prints each run's greedy accuracy (math-verify) at each evaluation and its judge agreement
# Several seeds: SEEDS="0 1 2" bash scripts/demo_judge.sh. DEMO_JUDGE_MODE=group judges each group's
# 16 answers in one request (judge.group_wise, a judge taught that format: prepare_judge_demo.py
# --group_wise true) instead of each answer alone. Extra arguments go to every trainer, e.g.
# --num_steps 50; DEMO_JUDGE_CLUSTER_ARGS to local_cluster.py; DEMO_JUDGE_ASSETS / DEMO_JUDGE_RUNS
# move its folders (each run goes to <runs>/demo-judge-s<seed>, group mode demo-judge-group-s<seed>).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DEMO_ASSETS=${DEMO_ASSETS:-runs/demo-assets}
ASSETS=${DEMO_JUDGE_ASSETS:-runs/demo-judge-assets}
RUNS=${DEMO_JUDGE_RUNS:-runs}
SEEDS=${SEEDS:-0}
MODE=${DEMO_JUDGE_MODE:-sample}
case "$MODE" in
  sample) JUDGE=judge; TEMPLATE=judge_template.yaml; NAME=demo-judge; PREPARE=(); JUDGING=(--sampling.reward.judge.max_tokens 4) ;;
  # A reply is 16 lines "K: yes|no" (at most 7 characters each).
  group) JUDGE=judge-group; TEMPLATE=judge_group_template.yaml; NAME=demo-judge-group; PREPARE=(--group_wise true)
         JUDGING=(--sampling.reward.judge.group_wise true --sampling.reward.judge.max_tokens 128) ;;
  *) echo "DEMO_JUDGE_MODE must be sample or group, got $MODE" >&2; exit 2 ;;
esac
bash scripts/install.sh
read -r -a CLUSTER_ARGS <<< "${DEMO_JUDGE_CLUSTER_ARGS:-}"

if [ ! -f "$DEMO_ASSETS/model/model.safetensors" ] || [ ! -f "$DEMO_ASSETS/arithmetic.jsonl" ] \
    || [ ! -f "$DEMO_ASSETS/arithmetic_eval.jsonl" ]; then
  echo "[demo_judge] preparing the starting model and data in $DEMO_ASSETS"
  $PY scripts/prepare_demo.py --out_dir "$DEMO_ASSETS"
fi
if [ ! -f "$ASSETS/$JUDGE/model.safetensors" ] || [ ! -f "$ASSETS/$TEMPLATE" ]; then
  echo "[demo_judge] teaching the judge in $ASSETS/$JUDGE"
  $PY scripts/prepare_judge_demo.py --out_dir "$ASSETS" ${PREPARE[@]+"${PREPARE[@]}"}
fi

RUN_DIRS=()
for seed in $SEEDS; do
  dir="$RUNS/$NAME-s$seed"
  rm -rf "$dir"
  mkdir -p "$dir"
  date +%s.%N > "$dir/command_started_at"
  echo "[demo_judge] seed $seed: training in $dir"
  $PY local_cluster.py --model_path "$DEMO_ASSETS/model" --run_dir "$dir" --nproc_per_node 2 \
    --judge_workers 1 --judge_model_path "$ASSETS/$JUDGE" ${CLUSTER_ARGS[@]+"${CLUSTER_ARGS[@]}"} -- \
    --config configs/demo.yaml --data.path "$DEMO_ASSETS/arithmetic.jsonl" \
    --eval.data.path "$DEMO_ASSETS/arithmetic_eval.jsonl" --eval.reward math_verify --seed "$seed" \
    --sampling.reward.functions judge async_grpo.rewards.math_verifier:math_verify_reward \
    --sampling.reward.weights 1 0 --sampling.reward.judge.template_path "$ASSETS/$TEMPLATE" \
    --sampling.reward.judge.verdict yes_no "${JUDGING[@]}" --sampling.reward.judge.agree_with math_verify_reward "$@"
  date +%s.%N > "$dir/command_finished_at"
  RUN_DIRS+=("$dir")
done
$PY scripts/demo_judge_report.py --runs "${RUN_DIRS[@]}"
