"""GPU check of rlhfkit.placement + rlhfkit.workers on real GPUs (run on the GPU machine).

(a) one GPU: three colocated roles with fractional shares (0.5 / 0.25 / 0.25; the third with
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``) see the same physical device (UUID, PCI bus id) and all hold
    1 GiB at once;
(b) two GPUs or more: a two-GPU role puts its ranks on distinct GPUs, a NOSET twin of it finds the same devices, and
    an NCCL all-reduce over the MASTER_ADDR/MASTER_PORT the group set works;
(c) two GPUs or more: a hybrid plan (actor on 2 GPUs + one engine with TP 2): TP worker k lands on actor rank k's GPU.

Usage: ``python tests/gpu_placement_check.py --out $OUT/placement.json`` (``--cpu-dry-run`` exercises the plumbing
with logical GPUs on a CPU machine). Writes a JSON report, prints a summary, exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
sys.path.insert(0, SRC)

from rlhfkit.placement import (  # noqa: E402
    Inventory,
    PlacementConfig,
    RoleSpec,
    engines,
    materialize,
    plan_placement,
)
from rlhfkit.workers import RayConfig, Worker, WorkerGroup, WorkerGroupConfig, ray_init  # noqa: E402

GIB = 1024**3
WAIT_S = 180


class DeviceWorker(Worker):
    """Reports its device identity, holds memory, all-reduces."""

    def __init__(self) -> None:
        self.held = []

    def identity(self) -> dict:
        import ray
        import torch

        device = self.device()
        result = {"device": str(device), "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                  "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "uuid": None, "pci_bus_id": None}
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            result["uuid"] = str(props.uuid)
            pci = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
            result["pci_bus_id"] = ":".join(f"{p:02x}" for p in pci) if None not in pci else None
            result["name"] = props.name
        return result

    def hold(self, gib: float) -> dict:
        import torch

        device = self.device()
        if device.type != "cuda":
            return {"allocated_gib": 0.0, "device_used_gib": 0.0}
        self.held.append(torch.ones(int(gib * GIB), dtype=torch.uint8, device=device))
        torch.cuda.synchronize(device)
        return {"allocated_gib": torch.cuda.memory_allocated(device) / GIB}

    def device_used_gib(self) -> float:
        import torch

        device = self.device()
        if device.type != "cuda":
            return 0.0
        free, total = torch.cuda.mem_get_info(device)
        return (total - free) / GIB

    def release(self) -> None:
        import torch

        self.held.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        self.init_process_group(timeout_s=120)
        value = torch.tensor([float(self.rank + 1)], device=self.device())
        dist.all_reduce(value)
        dist.barrier()
        dist.destroy_process_group()
        return float(value.item())


def _report_task() -> dict:
    """A TP worker stand-in, scheduled as a task with tp_worker_options."""
    return DeviceWorker.identity(DeviceWorker.__new__(DeviceWorker))


def _key(identity: dict, dry_run: bool) -> str:
    """What identifies a physical GPU: its UUID (real GPUs) or Ray's GPU id (dry run)."""
    return ",".join(identity["gpu_ids"]) if dry_run else identity["uuid"]


def check_shared_gpu(dry_run: bool) -> dict:
    roles = (RoleSpec(name="alpha", num_gpus=1, share=0.5), RoleSpec(name="beta", num_gpus=1, share=0.25),
             RoleSpec(name="gamma", num_gpus=1, share=0.25))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=1, gpus_per_node=1),
                                          hybrid=True))
    print(plan, flush=True)
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        groups = {
            name: WorkerGroup(DeviceWorker, placed, WorkerGroupConfig(
                role=name, start_timeout_s=WAIT_S, call_timeout_s=WAIT_S, set_cuda_visible_devices=name != "gamma"))
            for name in ("alpha", "beta", "gamma")
        }
        try:
            identity = {name: group.call("identity")[0] for name, group in groups.items()}
            held = {name: group.call("hold", 1.0)[0] for name, group in groups.items()}
            used = groups["beta"].call("device_used_gib")[0]
            for group in groups.values():
                group.call("release")
        finally:
            for group in groups.values():
                group.shutdown()
    keys = {name: _key(ident, dry_run) for name, ident in identity.items()}
    ok = len(set(keys.values())) == 1 and None not in keys.values()
    if not dry_run:
        ok = ok and all(h["allocated_gib"] >= 1.0 for h in held.values()) and used >= 3.0
        ok = ok and len({ident["pci_bus_id"] for ident in identity.values()}) == 1  # None on older torch: still 1
    return {"ok": bool(ok), "identity": identity, "held": held, "device_used_gib_while_all_hold": used}


def check_two_gpus(dry_run: bool) -> dict:
    roles = (RoleSpec(name="dp", num_gpus=2, share=0.5), RoleSpec(name="dp_noset", num_gpus=2, share=0.5))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2),
                                          hybrid=True))
    print(plan, flush=True)
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        dp = WorkerGroup(DeviceWorker, placed, WorkerGroupConfig(role="dp", start_timeout_s=WAIT_S,
                                                                 call_timeout_s=WAIT_S))
        noset = WorkerGroup(DeviceWorker, placed, WorkerGroupConfig(
            role="dp_noset", start_timeout_s=WAIT_S, call_timeout_s=WAIT_S, set_cuda_visible_devices=False))
        try:
            ids, noset_ids = dp.call("identity"), noset.call("identity")
            sums = dp.call("all_reduce")
        finally:
            dp.shutdown()
            noset.shutdown()
    keys = [_key(i, dry_run) for i in ids]
    ok = len(set(keys)) == 2 and keys == [_key(i, dry_run) for i in noset_ids] and sums == [3.0, 3.0]
    return {"ok": bool(ok), "dp": ids, "dp_noset": noset_ids, "all_reduce": sums}


def check_hybrid_tp(dry_run: bool) -> dict:
    import ray

    roles = (RoleSpec(name="actor", num_gpus=2), engines(1, 2))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2),
                                          hybrid=True))
    print(plan, flush=True)
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        with WorkerGroup(DeviceWorker, placed, WorkerGroupConfig(role="actor", start_timeout_s=WAIT_S)) as actor:
            ids = actor.call("identity")
            task = ray.remote(_report_task)
            tp = ray.get([task.options(**placed.tp_worker_options("rollout", 0, k)).remote() for k in range(2)],
                         timeout=WAIT_S)
    ok = [_key(i, dry_run) for i in tp] == [_key(i, dry_run) for i in ids] and len({_key(i, dry_run) for i in ids}) == 2
    return {"ok": bool(ok), "actor": ids, "tp_workers": tp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON report")
    parser.add_argument("--cpu-dry-run", action="store_true", help="logical GPUs on CPU: plumbing only")
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if args.cpu_dry_run:
        num_gpus = 2
    else:
        import torch

        num_gpus = torch.cuda.device_count()
    report: dict = {"num_gpus": num_gpus, "dry_run": args.cpu_dry_run, "checks": {}, "errors": {}}
    python_path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p)
    ray_init(RayConfig(num_cpus=max(2, os.cpu_count() or 2), num_gpus=num_gpus,
                       env_vars={"PYTHONPATH": python_path}, object_store_memory=512 * 1024**2))
    checks = [("shared_gpu_fractional_shares", check_shared_gpu)]
    if num_gpus >= 2:
        checks += [("two_gpus_distinct_devices", check_two_gpus), ("hybrid_tp2_workers_on_actor_gpus", check_hybrid_tp)]
    try:
        for name, check in checks:
            start = time.monotonic()
            try:
                report["checks"][name] = check(args.cpu_dry_run) | {"seconds": round(time.monotonic() - start, 2)}
            except Exception:  # recorded in the report and fails the run below
                report["errors"][name] = traceback.format_exc()
                report["checks"][name] = {"ok": False}
            print(f"{name}: {'OK' if report['checks'][name]['ok'] else 'FAILED'}", flush=True)
    finally:
        ray.shutdown()
    report["ok"] = bool(num_gpus >= 1 and all(c["ok"] for c in report["checks"].values()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2, default=str)
    print(json.dumps(report, indent=2, default=str)[-6000:])
    print(f"placement GPU check: {'PASSED' if report['ok'] else 'FAILED'} ({len(report['checks'])} checks, "
          f"{num_gpus} GPU(s)) -> {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
