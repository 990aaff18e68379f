"""Check that a Ray cluster can run an rlhfkit plan: print the plan, reserve it, start a worker group on it, and
all-reduce across its ranks (NCCL on GPUs, gloo on CPU). The launch recipes in this folder run this script.

    python examples/launch/hello_placement.py --tiny                       # local CPU Ray, 2 logical GPUs
    python examples/launch/hello_placement.py --nodes 2 --gpus-per-node 8   # join the running cluster (address=auto)

The plan is the hybrid-engine shape: ``actor`` and ``reference`` on every GPU, colocated with rollout engines of
``--tp`` GPUs each. Only the actor ranks are started here (the others would be your models).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from rlhfkit.placement import PlacementPlan, materialize, plan_layout
from rlhfkit.workers import RayConfig, Worker, WorkerGroup, WorkerGroupConfig, ray_init


class Hello(Worker):
    """One actor rank: says where it runs, then joins an all-reduce over the group's MASTER_ADDR/MASTER_PORT."""

    def hello(self) -> dict:
        import torch
        import torch.distributed as dist

        self.init_process_group(timeout_s=300)
        value = torch.tensor([float(self.rank + 1)], device=self.device())
        dist.all_reduce(value)
        dist.destroy_process_group()
        return {"rank": self.rank, "local_rank": self.local_rank, "host": socket.gethostname(),
                "device": str(self.device()), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "all_reduce": float(value.item())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="start a local CPU Ray with 2 logical GPUs")
    parser.add_argument("--address", default="auto", help="Ray address to join (ignored with --tiny)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each rollout engine")
    parser.add_argument("--cpus-per-bundle", type=float, default=0.0)
    parser.add_argument("--temp-dir", default=None, help="Ray temp dir of a --tiny cluster (absolute path)")
    parser.add_argument("--timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def build_plan(args: argparse.Namespace) -> PlacementPlan:
    """The hybrid plan the check reserves: actor and reference on every GPU, engines of ``--tp`` GPUs beside them."""
    return plan_layout(num_nodes=args.nodes, gpus_per_node=args.gpus_per_node, tensor_parallel_size=args.tp)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.tiny:
        ray_init(RayConfig(num_cpus=2, num_gpus=args.nodes * args.gpus_per_node, temp_dir=args.temp_dir,
                           object_store_memory=256 * 1024**2))
    else:
        # Workers do not inherit this shell: forward what the imports need.
        ray_init(RayConfig(address=args.address, forward_env=("PYTHONPATH", "LD_LIBRARY_PATH")))
    num_gpus = args.nodes * args.gpus_per_node
    plan = build_plan(args)
    print(plan, flush=True)
    start = time.monotonic()
    with materialize(plan, timeout_s=args.timeout, cpus_per_bundle=args.cpus_per_bundle) as placed:
        config = WorkerGroupConfig(role="actor", start_timeout_s=args.timeout, call_timeout_s=args.timeout)
        with WorkerGroup(Hello, placed, config) as group:
            results = group.call("hello")
    expected = num_gpus * (num_gpus + 1) / 2
    for result in results:
        print(result)
    bad = [r["rank"] for r in results if r["all_reduce"] != expected]
    if bad:
        raise SystemExit(f"all-reduce gave a wrong sum on ranks {bad}; expected {expected}")
    print(f"OK: {num_gpus} ranks on {len({r['host'] for r in results})} host(s), all-reduce = {expected:g} "
          f"({time.monotonic() - start:.1f} s)")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
