"""Multi-node plans on several Ray raylets of one machine, with logical GPUs (issue 24, "CPU parts").

``ray.cluster_utils.Cluster`` starts two real raylets here, each with 4 logical GPUs and a node resource of its own
(``node0``, ``node1``): distinct Ray node ids, per-node GPU ids, real placement-group scheduling. The 8-GPU, 2-node
plans of :func:`rlhfkit.placement.plan_layout` (checked without Ray in test_placement_layouts.py) are materialized and
their roles started as :class:`~rlhfkit.workers.WorkerGroup`\\ s or tasks; every rank's node id, GPU id
(``CUDA_VISIBLE_DEVICES``) and bundle index is compared with the plan, and no TP group straddles raylets. Actors and
tasks take no CPU; every wait has a timeout.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from rlhfkit.placement import Inventory, NodeSpec, PlacementConfig, materialize, plan_layout, plan_placement
from rlhfkit.workers import Worker, WorkerGroup, WorkerGroupConfig

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]
WAIT_S = 60
GPUS_PER_NODE = 4


class Rank(Worker):
    """Reports the environment a rank got."""

    def env(self) -> dict:
        keys = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES",
                "RLHFKIT_PLAN_NODE", "RLHFKIT_BUNDLE_INDICES")
        return {key: os.environ.get(key) for key in keys}


def _report() -> tuple:
    """A task body (a TP worker or a colocated rank): its GPU ids, bundle indices and node id."""
    from rlhfkit.workers import Worker as _Worker

    info = _Worker._rlhfkit_info(None)
    return info["gpu_ids"], info["bundle_indices"], info["node_id"]


@pytest.fixture(scope="module")
def raylets():
    """Two raylets, 4 logical GPUs each, labelled node0 (the head) and node1; node label -> Ray node id."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already up in this process; these tests need their own raylets")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    small = {"object_store_memory": 128 * 1024**2}
    local = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": GPUS_PER_NODE, "resources": {"node0": GPUS_PER_NODE},
        "include_dashboard": False, **small})
    local.add_node(num_cpus=0, num_gpus=GPUS_PER_NODE, resources={"node1": GPUS_PER_NODE}, **small)
    try:
        ray.init(address=local.address, log_to_driver=False)
        local.wait_for_nodes(timeout=WAIT_S)
        ids = {label: node["NodeID"] for node in ray.nodes() if node["Alive"]
               for label in node["Resources"] if label.startswith("node") and label[4:].isdigit()}
        assert sorted(ids) == ["node0", "node1"], ids
        yield ids
    finally:
        ray.shutdown()
        local.shutdown()


def _run(options_list: list[dict]) -> list:
    remote = ray.remote(_report)
    return ray.get([remote.options(**options).remote() for options in options_list], timeout=WAIT_S)


def _wait_all_gpus_free() -> None:
    """Placement-group removal is asynchronous: wait until every logical GPU is free for the next test."""
    deadline = time.monotonic() + WAIT_S
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources()["GPU"]:
        assert time.monotonic() < deadline, f"GPUs still held after {WAIT_S} s: {ray.available_resources()}"
        time.sleep(0.2)


def _check_group(group: WorkerGroup, node_of_plan_node: dict[int, str]) -> list[dict]:
    """Each rank on the raylet of its plan node, on its planned bundle, with per-raylet LOCAL_RANK."""
    envs = group.call("env", timeout_s=WAIT_S)
    plan = group.placement.plan
    for info, env in zip(group.infos, envs, strict=True):
        planned = plan.rank(group.role, info.rank)
        assert info.node_id == node_of_plan_node[planned.node], (group.role, info.rank)
        assert info.bundle_indices == (planned.gpus[0],)
        assert env["RLHFKIT_PLAN_NODE"] == str(planned.node)
        assert env["RLHFKIT_BUNDLE_INDICES"] == ",".join(map(str, planned.gpus))
        same_node = [p.rank for p in plan.ranks(group.role) if p.node == planned.node]
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(same_node.index(info.rank)), str(len(same_node)))
        assert env["MASTER_ADDR"] == group.infos[0].ip
    return envs


def test_hybrid_tp2_plan_on_two_raylets_each_rank_on_its_planned_gpu(raylets):
    """plan_layout(2 nodes x 4, colocated, TP 2): actor ranks, reference ranks and each engine's TP workers share the
    GPU the plan gives them, on the raylet that holds their plan node; no TP group straddles raylets."""
    plan = plan_layout(num_nodes=2, gpus_per_node=GPUS_PER_NODE, tensor_parallel_size=2)
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        node_of = {n: placed.node_address("actor", n * GPUS_PER_NODE, timeout_s=WAIT_S).node_id for n in (0, 1)}
        assert set(node_of.values()) == set(raylets.values())  # the two plan nodes on the two raylets
        config = WorkerGroupConfig(role="actor", start_timeout_s=WAIT_S, call_timeout_s=WAIT_S)
        with WorkerGroup(Rank, placed, config) as actor:
            _check_group(actor, node_of)
            # (node id, bundle) -> the GPU id Ray gave the actor rank there; every rank has one GPU of its own
            gpu_at = {}
            for info in actor.infos:
                assert len(info.gpu_ids) == 1 and info.cuda_visible_devices == info.gpu_ids[0]
                gpu_at[(info.node_id, info.bundle_indices[0])] = info.gpu_ids
            assert len(gpu_at) == 8 and {gpu for (node, _), gpu in gpu_at.items() if node == node_of[1]} == {
                ("0",), ("1",), ("2",), ("3",)}
            reference = _run([placed.actor_options("reference", r) for r in range(8)])
            for rank, (gpu_ids, bundles, node) in enumerate(reference):
                assert gpu_at[(node, bundles[0])] == gpu_ids and (node, bundles) == (
                    node_of[rank // GPUS_PER_NODE], (rank % GPUS_PER_NODE,))
            tp = _run([placed.tp_worker_options("rollout", e, k) for e in range(4) for k in range(2)])
            for engine in range(4):
                workers = tp[2 * engine: 2 * engine + 2]
                planned = plan.rank("rollout", engine)
                assert {node for *_, node in workers} == {node_of[planned.node]}  # one raylet per TP group
                assert [b for _, b, _ in workers] == [(g,) for g in planned.gpus]
                assert [g for g, *_ in workers] == [gpu_at[(node_of[planned.node], g)] for g in planned.gpus]
        with WorkerGroup(Rank, placed, WorkerGroupConfig(role="rollout", start_timeout_s=WAIT_S)) as rollout:
            envs = _check_group(rollout, node_of)  # engine drivers: first bundle of their TP group, no GPU slice
            assert [e["RLHFKIT_BUNDLE_INDICES"] for e in envs] == ["0,1", "2,3", "0,1", "2,3"]
            assert all(info.gpu_ids == () for info in rollout.infos)
    _wait_all_gpus_free()


def test_separated_tp4_plan_pinned_to_labelled_raylets(raylets):
    """plan_layout(2 nodes x 4, separated, TP 4), its nodes labelled in reverse (plan node 0 -> raylet node1): the
    trainers land on raylet node1, the TP-4 engine on raylet node0, all four of its TP workers there."""
    layout = plan_layout(num_nodes=2, gpus_per_node=GPUS_PER_NODE, colocate=False, engine_gpus=4,
                         tensor_parallel_size=4)
    inventory = Inventory(nodes=(NodeSpec(num_gpus=GPUS_PER_NODE, resources={"node1": 1}),
                                 NodeSpec(num_gpus=GPUS_PER_NODE, resources={"node0": 1})))
    plan = plan_placement(PlacementConfig(roles=layout.config.roles, inventory=inventory,
                                          colocate=layout.config.colocate))
    assert {role: [(p.node, p.gpus) for p in plan.ranks(role)] for role in plan.placements} == {
        role: [(p.node, p.gpus) for p in layout.ranks(role)] for role in layout.placements}  # labels move nothing
    node_of = {0: raylets["node1"], 1: raylets["node0"]}
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        config = WorkerGroupConfig(role="actor", start_timeout_s=WAIT_S, call_timeout_s=WAIT_S)
        with WorkerGroup(Rank, placed, config) as actor:
            _check_group(actor, node_of)
            assert sorted(info.cuda_visible_devices for info in actor.infos) == ["0", "1", "2", "3"]
            assert [info.num_gpus for info in actor.infos] == [0.5] * 4
            tp = _run([placed.tp_worker_options("rollout", 0, k) for k in range(4)])
            assert {node for *_, node in tp} == {raylets["node0"]}
            assert [b for _, b, _ in tp] == [(0,), (1,), (2,), (3,)]
            assert sorted(g for g, *_ in tp) == [("0",), ("1",), ("2",), ("3",)]
    _wait_all_gpus_free()


def test_plan_nodes_smaller_than_the_raylets_share_one_and_materialize_warns(raylets, caplog):
    """plan_layout(4 nodes x 2, colocated, TP 2) on two 4-GPU raylets: Ray packs two plan nodes on each raylet
    (nothing keeps STRICT_PACK groups apart). materialize warns naming the plan nodes; every TP group stays on one
    raylet and the group's LOCAL_RANKs follow the real raylets, not the plan's nodes."""
    plan = plan_layout(num_nodes=4, gpus_per_node=2, tensor_parallel_size=2)
    with caplog.at_level("WARNING", logger="rlhfkit.placement._ray"):
        placed = materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0)
    with placed:
        node_of = {n: placed.node_address("actor", 2 * n, timeout_s=WAIT_S).node_id for n in range(4)}
        shared = sorted(sorted(n for n in node_of if node_of[n] == ray_node) for ray_node in set(node_of.values()))
        assert set(node_of.values()) == set(raylets.values()) and [len(nodes) for nodes in shared] == [2, 2]
        warnings = [r.getMessage() for r in caplog.records if "share one Ray node" in r.getMessage()]
        assert len(warnings) == 2 and all(any(f"plan nodes {nodes} share one Ray node" in w for w in warnings)
                                          for nodes in shared), warnings
        tp = _run([placed.tp_worker_options("rollout", e, k) for e in range(4) for k in range(2)])
        for engine in range(4):
            assert {node for *_, node in tp[2 * engine: 2 * engine + 2]} == {node_of[engine]}
        with WorkerGroup(Rank, placed, WorkerGroupConfig(role="actor", start_timeout_s=WAIT_S)) as actor:
            envs = actor.call("env", timeout_s=WAIT_S)
            per_raylet = {}
            for info, env in zip(actor.infos, envs, strict=True):
                per_raylet.setdefault(info.node_id, []).append(int(env["LOCAL_RANK"]))
                assert env["LOCAL_WORLD_SIZE"] == "4"
            assert sorted(per_raylet.values()) == [[0, 1, 2, 3]] * 2
    _wait_all_gpus_free()
