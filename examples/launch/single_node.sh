#!/usr/bin/env bash
# One machine: start a Ray head with an explicit temp dir, run the placement check as a plain driver, stop the head.
#
#   bash examples/launch/single_node.sh                 # all GPUs of this machine
#   NUM_GPUS=2 bash examples/launch/single_node.sh --tp 2
#
# Extra arguments go to hello_placement.py. Replace that line with your own training script; it joins this cluster
# with rlhfkit.workers.ray_init(RayConfig(address="auto")) (RAY_ADDRESS below tells it where).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../.."
source "$HERE/_ray_env.sh"
: "${NUM_GPUS:=$(nvidia-smi -L 2>/dev/null | wc -l)}"
: "${NUM_CPUS:=$(nproc)}"

# --block keeps `ray start` in the foreground of its own process; stopping that process stops this head only
# (`ray stop` would stop every Ray of this user on the machine).
ray start --head --port="$RAY_PORT" --num-cpus="$NUM_CPUS" --num-gpus="$NUM_GPUS" --temp-dir="$RAY_TMP" \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" --block &
HEAD_PID=$!
trap 'kill "$HEAD_PID" 2>/dev/null || true; wait "$HEAD_PID" 2>/dev/null || true' EXIT

export RAY_ADDRESS="127.0.0.1:$RAY_PORT"
wait_for_nodes 1 120
python examples/launch/hello_placement.py --nodes 1 --gpus-per-node "$NUM_GPUS" "$@"
