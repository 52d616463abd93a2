#!/usr/bin/env bash
# The GPU check: the GPU's own parts, sized for the GPU machine this project is lent at times (one
# H100/H200, torch 2.11 with CUDA, transformers, peft, pytest; no Ray, no vLLM, no network; 15
# minutes in all), then, where Ray and vLLM import (a GPU machine after `bash scripts/install.sh`),
# the whole system on one GPU:
#
#   bash scripts/gpu_check.sh OUT_DIR
#
# writes into OUT_DIR, each part under its own time limit (a part that fails is reported and the
# next one runs):
#   env.txt         python, torch, CUDA, the GPU and its memory, transformers
#   gpu_tier.log    the gpu test tier (scripts/test.sh --gpu): bf16 FSDP2 step against the fp32
#                   padded reference, the varlen packed forward, the CUDA IPC round trip
#   gpu_report.md   benchmarks.gpu_report: trainer tokens/s and MFU at the qwen2.5-0.5b and 1.5b
#                   shapes (default attention and packed_varlen; gradient checkpointing where the
#                   plan's estimate says a row needs it to fit the card), logprob batching, weight
#                   copy; its failed rows are listed in summary.md and fail the check
#   packing.txt     benchmarks.packing on the GPU: packed (varlen) against right-padded, bf16
#   placement.txt   the local launcher's plan for this machine with the 0.5b and 1.5b shapes
#   system.log      scripts/gpu_system_check.py: the demo for 40 steps on one GPU with its printed
#   system/         plan, each process kind's peak GPU memory (nvidia-smi) against the plan's
#                   estimate, the weight push's timings, and the correctness probe (an engine on
#                   random weights, one push of the trained ones, its greedy tokens equal to HF's);
#                   without Ray or vLLM it runs nothing and says so (system/system.md: the details)
#   summary.md      one line per part: ok / failed (exit) / timed out / ran in part, with its last
#                   line; then the verdict, also the last line printed:
#                   `gpu_check: ok: N parts, none failed` or `gpu_check: FAILED: <parts and rows>`,
#                   followed by `; not run: <what, and what it needs>` when a part ran only in part
# Exits 1 when CUDA is missing (one line, nothing run) or when any part or row failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
mkdir -p "$out"
python=.venv/bin/python
[[ -x "$python" ]] || python=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source scripts/gpu_check_parts.sh
if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "scripts/gpu_check.sh: $python sees no CUDA device (torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'not importable')): run it on a GPU machine" >&2
    exit 1
fi

"$python" - > "$out/env.txt" 2>&1 <<'PY'
import sys, torch, transformers
props = torch.cuda.get_device_properties(0)
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
print(f"GPU: {torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} device(s)")
if torch.__version__.split("+")[0] != "2.13.0":
    print(f"note: the project pins torch 2.13.0; this is {torch.__version__}: a part that needs 2.13 fails with its own error")
PY

summary="$out/summary.md"
echo "# GPU check $(date -u '+%Y-%m-%d %H:%M UTC')" > "$summary"
cat "$out/env.txt" >> "$summary"
echo >> "$summary"

part "gpu test tier" 240 "$out/gpu_tier.log" bash scripts/test.sh --gpu
part "gpu report" 330 "$out/gpu_report.log" "$python" -m benchmarks.gpu_report --out "$out/gpu_report.md" \
    --run_tests false --warmup 1 --steps 3
failed_rows "gpu report" "$out/gpu_report.md"
part "packed vs padded (bf16, packed_varlen)" 120 "$out/packing.txt" "$python" -m benchmarks.packing \
    --device cuda --dtype bfloat16 --packed_attn packed_varlen --num_samples 64 --hidden_size 1024 \
    --num_layers 8 --intermediate_size 2816 --warmup 2 --reps 5 --threads 4
part "placement plan" 60 "$out/placement.txt" "$python" - <<'PY'
import torch
from async_grpo.launch.placement import ModelShape, RunShape, plan_placement
from async_grpo.demo_assets.tiny_model import PRESETS, hf_config, build_chat_tokenizer
memory = torch.cuda.get_device_properties(0).total_memory
tokenizer = build_chat_tokenizer()
for preset in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
    shape = ModelShape.from_hf_config(hf_config(PRESETS[preset], tokenizer).to_dict())
    run = RunShape(trainer_ranks=1, max_tokens_per_gpu=16384, generation_workers=1, logprob_workers=1)
    print(f"{preset} ({shape.num_params:,} parameters), 1 GPU:")
    print("\n".join(plan_placement(1, memory, shape, run).lines(run)))
PY
# Last: it starts Ray, vLLM and the trainer on the GPU the parts above have left.
part "system check (demo on one GPU, memory against the plan, push, probe)" 1800 "$out/system.log" \
    "$python" scripts/gpu_system_check.py --out_dir "$out/system"
finish
status=$?
cat "$summary"
exit $status
