#!/usr/bin/env bash
# Several machines without a scheduler: start the head on one, a worker on each other, then run from the head.
#
#   on the head:        HEAD=10.0.0.1 bash examples/launch/multi_node.sh head
#   on every worker:    HEAD=10.0.0.1 bash examples/launch/multi_node.sh worker
#   then, on the head:  HEAD=10.0.0.1 NODES=2 bash examples/launch/multi_node.sh run [--tp 2]
#                 or:   HEAD=10.0.0.1 NODES=2 GPUS_PER_NODE=8 bash examples/launch/job_submit.sh
#
# Labelled nodes (a plan with NodeSpec(resources={"h100": 1}) / {"v100": 1}): give each node its label for every
# GPU, e.g. NODE_RESOURCES='{"h100": 8}' on the H100 machines and '{"v100": 8}' on the V100 machines.
# `head` and `worker` stay in the foreground (--block); Ctrl-C or killing them stops that node only.
# Every node and client needs the same RAY_AUTH_MODE and RAY_AUTH_TOKEN (see _ray_env.sh): export RAY_AUTH_TOKEN
# from `ray get-auth-token` on the head into the environment of the workers if they do not share a home directory.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/../.."
source "$HERE/_ray_env.sh"
: "${HEAD:?set HEAD to the head node IP reachable from every node}"
: "${NUM_GPUS:=$(nvidia-smi -L 2>/dev/null | wc -l)}"
: "${NUM_CPUS:=$(nproc)}"
: "${NODE_RESOURCES:={\}}"
: "${NODES:=1}"

case "${1:-}" in
  head)
    exec ray start --head --node-ip-address="$HEAD" --port="$RAY_PORT" --num-cpus="$NUM_CPUS" \
      --num-gpus="$NUM_GPUS" --resources="$NODE_RESOURCES" --temp-dir="$RAY_TMP" \
      --dashboard-host=0.0.0.0 --dashboard-port="$DASHBOARD_PORT" --block ;;
  worker)
    exec ray start --address="$HEAD:$RAY_PORT" --num-cpus="$NUM_CPUS" --num-gpus="$NUM_GPUS" \
      --resources="$NODE_RESOURCES" --temp-dir="$RAY_TMP" --block ;;
  run)
    shift
    export RAY_ADDRESS="$HEAD:$RAY_PORT"
    wait_for_nodes "$NODES" 600
    : "${GPUS_PER_NODE:=$NUM_GPUS}"
    python examples/launch/hello_placement.py --nodes "$NODES" --gpus-per-node "$GPUS_PER_NODE" "$@" ;;
  *)
    echo "usage: HEAD=<ip> $0 head|worker|run [hello_placement.py args]" >&2; exit 2 ;;
esac
