#!/usr/bin/env bash
# Create .venv and install rlhfkit with the CPU test stack. Idempotent: a second run only checks.
# On machines with a local CPU torch wheel in /opt/wheels it is used; elsewhere pip's ordinary torch is installed
# (bring your own CUDA torch by installing it into .venv first; it is never replaced when it satisfies torch>=2.4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${RLHFKIT_EXTRAS:-test}
stamp=.venv/.rlhfkit-installed-$(cat pyproject.toml scripts/install.sh | sha1sum | cut -c1-12)-$EXTRAS
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check uv
torch_spec=()
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    torch_spec=(--find-links /opt/wheels "torch==2.13.0+cpu")
  fi
fi
.venv/bin/uv pip install --python .venv/bin/python -q --compile-bytecode "${torch_spec[@]}" -e ".[$EXTRAS]"
touch "$stamp"
