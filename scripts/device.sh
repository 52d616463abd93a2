# Sourced by the README's commands (scripts/test.sh, scripts/demo.sh, scripts/install.sh): which
# build this machine needs.
#
#   detect_device   prints "cuda" when an NVIDIA driver lists at least one GPU, else "cpu".
#
# ASYNC_GRPO_DEVICE=cpu|cuda overrides the detection (a CUDA host that should run the CPU build,
# or a container whose driver listing is hidden). ASYNC_GRPO_NVIDIA_GPUS_DIR names the driver's
# listing (default /proc/driver/nvidia/gpus, one folder per GPU: the same place the trainer's
# fsdp_setup.host_gpu_count reads); the tests point it at a faked folder.
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
  local listing=${ASYNC_GRPO_NVIDIA_GPUS_DIR:-/proc/driver/nvidia/gpus}
  if [[ -d "$listing" ]] && [[ -n "$(ls -A "$listing" 2>/dev/null)" ]]; then
    echo cuda
  else
    echo cpu
  fi
}
