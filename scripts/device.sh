# Sourced by the README's commands (scripts/test.sh, scripts/demo.sh, scripts/install.sh): which
# build this machine needs.
#
#   detect_device   prints "cuda" when the machine has at least one NVIDIA GPU, else "cpu".
#
# The GPU count is the one async_grpo/runtime/host_gpus.py uses: ASYNC_GRPO_HOST_GPUS=N when set,
# else what the NVIDIA driver lists (ASYNC_GRPO_NVIDIA_GPUS_DIR, default /proc/driver/nvidia/gpus,
# one folder per GPU; the tests point it at a faked folder). ASYNC_GRPO_DEVICE=cpu|cuda picks the
# build whatever the count (a CUDA host that should run the CPU build, or the fast tier run here
# with a claimed GPU count).
detect_device() {
  local forced=${ASYNC_GRPO_DEVICE:-}
  if [[ -n "$forced" ]]; then
    if [[ "$forced" != "cpu" && "$forced" != "cuda" ]]; then
      echo "ASYNC_GRPO_DEVICE must be 'cpu' or 'cuda', got '$forced'" >&2
      return 2
    fi
    echo "$forced"
    return 0
  fi
  local count=${ASYNC_GRPO_HOST_GPUS:-}
  if [[ -n "$count" ]]; then
    if ! [[ "$count" =~ ^[0-9]+$ ]]; then
      echo "ASYNC_GRPO_HOST_GPUS must be an integer >= 0, got '$count'" >&2
      return 2
    fi
    if [[ "$count" -gt 0 ]]; then echo cuda; else echo cpu; fi
    return 0
  fi
  local listing=${ASYNC_GRPO_NVIDIA_GPUS_DIR:-/proc/driver/nvidia/gpus}
  if [[ -d "$listing" ]] && [[ -n "$(ls -A "$listing" 2>/dev/null)" ]]; then
    echo cuda
  else
    echo cpu
  fi
}
