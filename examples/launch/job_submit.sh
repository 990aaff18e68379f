#!/usr/bin/env bash
# Submit the placement check to a running cluster as a Ray job, with this repository as the working dir.
#
#   HEAD=10.0.0.1 NODES=2 GPUS_PER_NODE=8 bash examples/launch/job_submit.sh [--tp 2]
#
# `--working-dir .` uploads this directory (minus the excludes) to the cluster; the entrypoint runs inside that copy
# on the head node. `py_modules` ships the rlhfkit package to the driver and every worker, so the cluster needs no
# install of it (drop it if rlhfkit is installed on every node). Environment for the job goes in `env_vars`
# explicitly: a job does not see the environment of the shell that submitted it. The dashboard (port 8265) must be
# reachable from here; the driver gets RAY_ADDRESS from Ray.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../.."
source "$HERE/_ray_env.sh"
: "${HEAD:=127.0.0.1}"
: "${NODES:=1}"
: "${GPUS_PER_NODE:=$(nvidia-smi -L 2>/dev/null | wc -l)}"

RUNTIME_ENV=$(cat <<JSON
{
  "py_modules": ["src/rlhfkit"],
  "env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "WARN"},
  "excludes": [".git", ".venv", ".carry", ".whl", "**/__pycache__", "*.egg-info"]
}
JSON
)

ray job submit --address "http://$HEAD:$DASHBOARD_PORT" --working-dir . --runtime-env-json "$RUNTIME_ENV" \
  -- python examples/launch/hello_placement.py --nodes "$NODES" --gpus-per-node "$GPUS_PER_NODE" "$@"
