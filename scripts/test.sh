#!/usr/bin/env bash
# Run the CPU test suite (GPU tests are skipped without CUDA) and print its 25 slowest tests. Exit 5 (nothing
# collected) counts as failure.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@" tests
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
