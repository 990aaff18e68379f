"""Tests for rlhfkit.workers and the Ray half of rlhfkit.placement, on a real local Ray cluster with logical GPUs.

One module-scoped cluster made of two raylets on this machine (``ray.cluster_utils.Cluster``): a head node with 8
logical GPUs labelled ``h100`` and a second node with 4 logical GPUs labelled ``v100`` — real multi-node scheduling
(distinct node ids, per-node local ranks) for about 2 s more than a single ``ray.init``. Actors take ``num_cpus=0``
and bundles no CPU. Every wait has a timeout.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from conftest import kill_and_wait

from rlhfkit.placement import (
    Inventory,
    NodeSpec,
    PlacementConfig,
    PlacementTimeoutError,
    RoleSpec,
    engines,
    materialize,
    plan_placement,
)
from rlhfkit.workers import (
    RayConfig,
    Worker,
    WorkerError,
    WorkerGroup,
    WorkerGroupConfig,
    WorkerTimeoutError,
    ray_init,
    select_device,
)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray
WAIT_S = 60


class Probe(Worker):
    """A test worker: reports what it sees, sleeps, fails on demand."""

    def __init__(self, fail_on_rank: int | None = None) -> None:
        if fail_on_rank is not None and self.rank == fail_on_rank:
            raise ValueError(f"constructor refused on rank {self.rank}")
        self.created_with_rank = self.rank  # the rank env is complete before __init__

    def env(self) -> dict:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES", "RLHFKIT_ROLE", "RLHFKIT_BUNDLE_INDICES", "H3_FORWARDED", "H3_EXPLICIT",
                "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")
        return {key: os.environ.get(key) for key in keys} | {"created_with_rank": self.created_with_rank}

    def gpu(self) -> tuple:
        return tuple(str(i) for i in ray.get_gpu_ids()), str(self.device())

    def add(self, value: int) -> int:
        return self.rank * 100 + value

    def rendezvous(self) -> float:
        """gloo over the group's env:// rendezvous: the sum of the ranks + 1."""
        import torch
        import torch.distributed as dist

        self.init_process_group(backend="gloo", timeout_s=60.0)
        try:
            value = torch.tensor([self.rank + 1.0])
            dist.all_reduce(value)
            return float(value)
        finally:
            dist.destroy_process_group()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self, rank: int) -> int:
        if self.rank == rank:
            raise KeyError(f"no such thing on rank {rank}")
        return self.rank

    def fail_unpicklable(self, rank: int) -> int:
        if self.rank == rank:
            raise Unpicklable(f"worker-side failure on rank {rank}", 7)
        return self.rank


class Unpicklable(Exception):
    """An exception the driver cannot re-create: unpickling calls ``Unpicklable(message)``, which lacks ``code``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(f"{message} (code {code})")


def _report() -> tuple:
    """A task body: which GPU, bundle and node it got."""
    from rlhfkit.workers import Worker as _Worker

    info = _Worker._rlhfkit_info(None)
    return info["gpu_ids"], info["bundle_indices"], info["node_id"], info["num_gpus"]


@pytest.fixture(scope="module")
def cluster():
    """Two raylets (8 GPUs + h100, 4 GPUs + v100); reuses a Ray that is already up (tests needing labels skip)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if ray.is_initialized():
        yield None
        return
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    small = dict(object_store_memory=128 * 1024**2)
    local = Cluster(initialize_head=True, head_node_args=dict(num_cpus=2, num_gpus=8, resources={"h100": 8},
                                                             include_dashboard=False, **small))
    local.add_node(num_cpus=0, num_gpus=4, resources={"v100": 4}, **small)
    ray.init(address=local.address)
    local.wait_for_nodes()
    yield local
    ray.shutdown()
    local.shutdown()


def _need(**resources: float) -> None:
    total = ray.cluster_resources()
    for key, amount in resources.items():
        if total.get(key, 0.0) < amount:
            pytest.skip(f"the running Ray cluster lacks {key}={amount}")


def _node_with(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource, 0) > 0)


def _run(fn, options_list: list[dict]) -> list:
    remote = ray.remote(fn)
    return ray.get([remote.options(**options).remote() for options in options_list], timeout=WAIT_S)


def test_hybrid_plan_8_gpus_each_rank_on_the_promised_gpu(cluster):
    _need(GPU=8)
    roles = (RoleSpec(name="actor", num_gpus=8), RoleSpec(name="reference", num_gpus=8), engines(4, 2))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=1, gpus_per_node=8),
                                          hybrid=True))
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        with WorkerGroup(Probe, placed, WorkerGroupConfig(role="actor", start_timeout_s=WAIT_S)) as actor, \
                WorkerGroup(Probe, placed, WorkerGroupConfig(role="rollout", start_timeout_s=WAIT_S)) as rollout:
            # The plan's TP workers and reference ranks, scheduled with the helpers as tasks.
            tp = _run(_report, [placed.tp_worker_options("rollout", e, k) for e in range(4) for k in range(2)])
            ref = _run(_report, [placed.actor_options("reference", r) for r in range(8)])
            gpu_of = {}
            for info in actor.infos:
                assert info.bundle_indices == (info.rank,) and info.num_gpus == pytest.approx(0.3333)
                assert len(info.gpu_ids) == 1 and info.cuda_visible_devices == info.gpu_ids[0]
                gpu_of[info.rank] = info.gpu_ids[0]
            assert len(set(gpu_of.values())) == 8  # eight distinct GPUs
            for index, (gpu_ids, bundles, _, share) in enumerate(tp):
                gpu = index  # engine e, TP worker k sits on GPU 2e + k
                assert bundles == (gpu,) and gpu_ids == (gpu_of[gpu],) and share == pytest.approx(0.3333)
            for rank, (gpu_ids, bundles, _, _) in enumerate(ref):
                assert bundles == (rank,) and gpu_ids == (gpu_of[rank],)
            for info in rollout.infos:  # engine drivers: first bundle of their TP group, no GPU slice of their own
                assert info.bundle_indices == (2 * info.rank,) and info.gpu_ids == () and info.num_gpus == 0
            assert placed.tp_bundle_indices("rollout", 3) == (6, 7)
            envs = actor.call("env")
            assert [e["RANK"] for e in envs] == [str(r) for r in range(8)]
            assert [e["created_with_rank"] for e in envs] == list(range(8))  # env complete before __init__
            assert {e["WORLD_SIZE"] for e in envs} == {"8"} and len({e["MASTER_PORT"] for e in envs}) == 1
            assert [e["LOCAL_RANK"] for e in envs] == [str(r) for r in range(8)]
            assert [e["RLHFKIT_BUNDLE_INDICES"] for e in rollout.call("env")] == ["0,1", "2,3", "4,5", "6,7"]
            assert actor.call_scattered("add", list(range(10, 18))) == [r * 100 + 10 + r for r in range(8)]
            assert actor.call("add", 1) == [r * 100 + 1 for r in range(8)]
            actor.barrier(timeout_s=WAIT_S)
            with pytest.raises(ValueError, match=r"got 3 items for the 8 ranks of role 'actor'"):
                actor.call_scattered("add", [1, 2, 3])
            with pytest.raises(AttributeError, match=r"Probe \(role 'actor'\) has no method 'nope'"):
                actor.call("nope")
    _wait_all_gpus_free()  # remove() released the placement groups


def _wait_all_gpus_free() -> None:
    """Placement-group removal is asynchronous: poll until every GPU of the cluster is available again."""
    deadline = time.monotonic() + WAIT_S
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources()["GPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == ray.cluster_resources()["GPU"]


def test_actor_reference_and_critic_reward_colocation(cluster):
    _need(GPU=4)
    roles = (RoleSpec(name="actor", num_gpus=2, share=0.75), RoleSpec(name="reference", num_gpus=2),
             RoleSpec(name="critic", num_gpus=2), RoleSpec(name="reward", num_gpus=2))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=1, gpus_per_node=4),
                                          colocate=(("actor", "reference"), ("critic", "reward"))))
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        with WorkerGroup(Probe, placed, WorkerGroupConfig(role="actor", start_timeout_s=WAIT_S)) as actor:
            got = {role: _run(_report, [placed.actor_options(role, r) for r in range(2)])
                   for role in ("reference", "critic", "reward")}
            actor_gpus = [info.gpu_ids for info in actor.infos]
            assert [info.num_gpus for info in actor.infos] == [0.75, 0.75]
            assert [g for g, *_ in got["reference"]] == actor_gpus
            assert [s for *_, s in got["reference"]] == [0.25, 0.25]
            assert [g for g, *_ in got["critic"]] == [g for g, *_ in got["reward"]]
            assert [b for _, b, *_ in got["critic"]] == [(2,), (3,)]
            assert len({*actor_gpus, *(g for g, *_ in got["critic"])}) == 4
            envs = actor.call("env")
            assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == actor.infos[0].ip


def test_labelled_two_node_inventory(cluster):
    _need(h100=4, v100=4)
    inventory = Inventory(nodes=(NodeSpec(num_gpus=2, resources={"h100": 1}),
                                 NodeSpec(num_gpus=4, resources={"v100": 1})))
    roles = (RoleSpec(name="actor", num_gpus=2, label="h100"), RoleSpec(name="reference", num_gpus=2, label="v100"),
             RoleSpec(name="reward", num_gpus=2, label="v100"))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=inventory))
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        with WorkerGroup(Probe, placed, WorkerGroupConfig(role="actor", start_timeout_s=WAIT_S)) as actor, \
                WorkerGroup(Probe, placed, WorkerGroupConfig(role="reference", start_timeout_s=WAIT_S)) as ref:
            reward = _run(_report, [placed.actor_options("reward", r) for r in range(2)])
            assert {info.node_id for info in actor.infos} == {_node_with("h100")}
            assert {info.node_id for info in ref.infos} == {_node_with("v100")}
            assert {node for *_, node, _ in reward} == {_node_with("v100")}
            assert [info.bundle_indices for info in ref.infos] == [(0,), (1,)]
            assert [b for _, b, *_ in reward] == [(2,), (3,)]
            assert len({info.gpu_ids for info in ref.infos} | {g for g, *_ in reward}) == 4


def test_group_across_two_nodes_gets_per_node_local_ranks(cluster):
    _need(h100=2, v100=2)
    inventory = Inventory(nodes=(NodeSpec(num_gpus=2, resources={"h100": 1}),
                                 NodeSpec(num_gpus=2, resources={"v100": 1})))
    plan = plan_placement(PlacementConfig(roles=(RoleSpec(name="dp", num_gpus=4),), inventory=inventory))
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        with WorkerGroup(Probe, placed, WorkerGroupConfig(role="dp", start_timeout_s=WAIT_S)) as group:
            envs = group.call("env")
            nodes = [info.node_id for info in group.infos]
            assert nodes[0] == nodes[1] == _node_with("h100") and nodes[2] == nodes[3] == _node_with("v100")
            assert [(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs] == [("0", "2"), ("1", "2")] * 2
            assert {e["MASTER_ADDR"] for e in envs} == {group.infos[0].ip}


@pytest.fixture
def pair(cluster):
    _need(GPU=2)
    plan = plan_placement(PlacementConfig(roles=(RoleSpec(name="policy", num_gpus=2, share=0.5),),
                                          inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2)))
    with materialize(plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed:
        yield placed


def test_a_one_rank_group_binds_its_rendezvous_port_when_it_starts(pair, cluster):
    """A one-rank group gets MASTER_PORT=0: nobody else connects to its rendezvous, so it binds a port the system
    picks at that moment. A probed port is free only when probed, and a role that loaded later found it taken
    (EADDRINUSE in CI, sessions 18 and 19). Two ranks keep a probed port they share."""
    with WorkerGroup(Probe, pair, WorkerGroupConfig(role="policy", start_timeout_s=WAIT_S)) as group:
        envs = group.call("env")
        assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] != "0"
        assert group.call("rendezvous") == [3.0, 3.0]
    solo_plan = plan_placement(PlacementConfig(roles=(RoleSpec(name="solo", num_gpus=1),),
                                               inventory=Inventory.uniform(num_nodes=1, gpus_per_node=1)))
    with materialize(solo_plan, timeout_s=WAIT_S, cpus_per_bundle=0) as placed, \
            WorkerGroup(Probe, placed, WorkerGroupConfig(role="solo", start_timeout_s=WAIT_S)) as solo:
        assert solo.call("env")[0]["MASTER_PORT"] == "0"
        assert solo.call("rendezvous") == [1.0]


def test_killed_worker_surfaces_within_timeout(pair):
    config = WorkerGroupConfig(role="policy", start_timeout_s=WAIT_S, call_timeout_s=WAIT_S)  # a hang guard
    with WorkerGroup(Probe, pair, config) as group:
        kill_and_wait(ray, group.actors[1])
        with pytest.raises(WorkerError, match=r"role 'policy' rank 1 \(.*pid \d+\) died during 'add'") as caught:
            group.call("add", 1)  # (died: the call did not wait out call_timeout_s)
        assert caught.value.rank == 1 and caught.value.role == "policy"


def test_slow_method_times_out_and_errors_name_the_rank(pair):
    with WorkerGroup(Probe, pair, WorkerGroupConfig(role="policy", start_timeout_s=WAIT_S)) as group:
        with pytest.raises(WorkerError, match=r"role 'policy' rank 1 raised in 'fail': KeyError: .*on rank 1"):
            group.call("fail", 1, timeout_s=WAIT_S)
        pending = group.submit("sleep", 30)
        with pytest.raises(WorkerTimeoutError, match=r"role 'policy': 'sleep' did not finish within 1 s on rank\(s\) "
                                                     r"\[0, 1\] of 2") as caught:
            group.gather(pending, timeout_s=1)  # (the ranks sleep 30 s: the error is the timeout's)
        assert caught.value.pending == (0, 1)
        assert isinstance(caught.value, TimeoutError)


def test_unpicklable_exception_names_role_rank_method_and_original(pair):
    """Review defect 1: an exception whose class cannot be re-created on the driver escaped as Ray's
    UnserializableException naming neither role nor rank; now a WorkerError names them, the method and the
    original exception's type and message."""
    with WorkerGroup(Probe, pair, WorkerGroupConfig(role="policy", start_timeout_s=WAIT_S)) as group:
        with pytest.raises(WorkerError, match=r"role 'policy' rank 1 raised in 'fail_unpicklable': .*Unpicklable: "
                                              r"worker-side failure on rank 1 \(code 7\)") as caught:
            group.call("fail_unpicklable", 1, timeout_s=WAIT_S)
        assert (caught.value.role, caught.value.rank, caught.value.method) == ("policy", 1, "fail_unpicklable")
        assert group.call("add", 1, timeout_s=WAIT_S) == [1, 101]  # the group is still usable


def test_constructor_failure_and_unschedulable_ranks_fail_fast_and_clean_up(pair):
    with pytest.raises(WorkerError, match=r"role 'policy' rank 1 \(starting\) raised in its constructor during "
                                          r"'__init__': .*ValueError: constructor refused on rank 1"):
        WorkerGroup(Probe, pair, WorkerGroupConfig(role="policy", start_timeout_s=WAIT_S), fail_on_rank=1)
    with pytest.raises(ValueError, match=r"num_cpus=1 does not fit a bundle of 0 CPUs"):
        WorkerGroup(Probe, pair, WorkerGroupConfig(role="policy", num_cpus=1))
    # Occupy bundle 0 fully: rank 0 (share 0.5) can never start; the start-up wait must time out and clean up.
    blocker = ray.remote(Probe).options(num_gpus=1, num_cpus=0, scheduling_strategy=pair.scheduling_strategy(
        "policy", 0), runtime_env={"env_vars": {"RANK": "0"}}).remote()
    ray.get(blocker.add.remote(0), timeout=WAIT_S)
    # 20 s: rank 1 must start within it (a process's spawn and imports, on a busy machine); rank 0 never can
    with pytest.raises(WorkerTimeoutError, match=r"'__init__' did not finish within .* on rank\(s\) \[0\] of 2 "
                                                 r"\(not scheduled\?"):
        WorkerGroup(Probe, pair, WorkerGroupConfig(role="policy", start_timeout_s=20))
    ray.kill(blocker)
    # The failed group killed its ranks (the started one and the pending one): both bundles become whole again.
    pg_hex = pair.placement_group("policy", 0).id.hex()
    keys = [f"GPU_group_{i}_{pg_hex}" for i in range(2)]
    deadline = time.monotonic() + WAIT_S
    while [ray.available_resources().get(k, 0.0) for k in keys] != [1.0, 1.0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [ray.available_resources().get(k, 0.0) for k in keys] == [1.0, 1.0]


def test_noset_cuda_visible_devices_and_explicit_env(pair, monkeypatch):
    monkeypatch.setenv("H3_FORWARDED", "from-driver")
    config = WorkerGroupConfig(role="policy", start_timeout_s=WAIT_S, set_cuda_visible_devices=False,
                               env_vars={"H3_EXPLICIT": "yes"}, forward_env=("H3_FORWARDED",))
    with WorkerGroup(Probe, pair, config) as group:
        envs = group.call("env")
        assert [e["H3_EXPLICIT"] for e in envs] == ["yes", "yes"]
        assert [e["H3_FORWARDED"] for e in envs] == ["from-driver", "from-driver"]
        assert [e["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] for e in envs] == ["1", "1"]
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [inherited, inherited]  # Ray left it alone
        gpus = group.call("gpu")
        assert len({ids for ids, _ in gpus}) == 2 and all(len(ids) == 1 for ids, _ in gpus)
        assert [device for _, device in gpus] == ["cpu", "cpu"]  # logical GPUs, no CUDA: CPU fallback


def test_materialize_timeout_lists_what_the_cluster_lacks(cluster):
    inventory = Inventory(nodes=(NodeSpec(num_gpus=16, resources={"a100": 1}),))
    plan = plan_placement(PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=16, label="a100"),),
                                          inventory=inventory))
    gpus_before = ray.available_resources().get("GPU", 0)
    with pytest.raises(PlacementTimeoutError) as caught:  # (the cluster has no a100: the wait must time out)
        materialize(plan, timeout_s=1.5, cpus_per_bundle=0)
    message = str(caught.value)
    assert "placement groups of plan node(s) [0] were not ready after 1.5 s; removed" in message
    assert "a100: plan requests 16, cluster has 0 in total" in message
    assert "plan node 0 needs {GPU: 16, a100: 16} on one Ray node; no alive node has that" in message
    states = {entry["state"] for entry in ray.util.placement_group_table().values()}
    assert "PENDING" not in states and ray.available_resources().get("GPU", 0) >= gpus_before


def test_ray_init_reuses_a_running_cluster_and_config_validation(cluster):
    assert ray_init(RayConfig(num_cpus=1)) is None  # already up: reused, config ignored
    config = RayConfig(num_cpus=2, num_gpus=4, temp_dir="/scratch/ray", spill_dir="/scratch/spill",
                       env_vars={"A": "1"}, forward_env=("PATH",))
    kwargs = config.init_kwargs()
    assert kwargs["_temp_dir"] == "/scratch/ray" and kwargs["num_gpus"] == 4
    assert kwargs["runtime_env"]["env_vars"] == {"PATH": os.environ["PATH"], "A": "1"}
    assert '"directory_path": "/scratch/spill"' in kwargs["_system_config"]["object_spilling_config"]
    assert kwargs["_system_config"]["prestart_worker_first_driver"] is False  # actors only: no idle task workers
    assert RayConfig(prestart_workers=True).init_kwargs()["_system_config"] == {"prestart_worker_first_driver": True}
    joined = RayConfig(address="auto", temp_dir="/scratch/ray").init_kwargs()
    assert joined["_temp_dir"] == "/scratch/ray" and "num_cpus" not in joined and "_system_config" not in joined
    with pytest.raises(ValueError, match=r"\['num_gpus'\] only apply when starting a local cluster"):
        RayConfig(address="auto", num_gpus=8)
    with pytest.raises(ValueError, match=r"temp_dir='ray-tmp'; must be an absolute path"):
        RayConfig(temp_dir="ray-tmp")


def test_worker_group_config_validation():
    with pytest.raises(ValueError, match=r"env_vars sets \['RANK'\]; WorkerGroup sets those per rank"):
        WorkerGroupConfig(role="actor", env_vars={"RANK": "3"})
    with pytest.raises(ValueError, match=r"call_timeout_s=0; must be > 0"):
        WorkerGroupConfig(role="actor", call_timeout_s=0)
    with pytest.raises(TypeError, match=r"forward_env='PYTHONPATH'; give a tuple"):
        WorkerGroupConfig(role="actor", forward_env="PYTHONPATH")
    with pytest.raises(ValueError, match=r"num_gpus=1.5; must be in \[0, 1\]"):
        WorkerGroupConfig(role="actor", num_gpus=1.5)


@pytest.mark.parametrize(
    "gpu_ids,count,visible,ray_sets,expected",
    [
        ([], 8, None, True, "cpu"),                 # no GPU from Ray
        ([3], 0, "3", True, "cpu"),                 # logical GPU, no CUDA: never cuda:3
        ([3], 1, "3", True, "cuda:0"),              # Ray narrowed CUDA_VISIBLE_DEVICES to our GPU
        ([3], 8, None, False, "cuda:3"),            # NOSET, nothing inherited: physical id
        (["3"], 2, "2,3", False, "cuda:1"),         # NOSET, inherited "2,3": position of 3
        (["GPU-ab"], 2, "GPU-aa,GPU-ab", False, "cuda:1"),  # UUID ids
    ],
)
def test_select_device(gpu_ids, count, visible, ray_sets, expected):
    assert select_device(gpu_ids, cuda_device_count=count, cuda_visible_devices=visible,
                         ray_sets_visible_devices=ray_sets) == expected


def test_select_device_rejects_ids_it_cannot_map():
    with pytest.raises(RuntimeError, match=r"Ray GPU id '5' maps to cuda:5 but torch sees 2 device"):
        select_device([5], cuda_device_count=2, cuda_visible_devices=None, ray_sets_visible_devices=False)
    with pytest.raises(RuntimeError, match=r"Ray GPU id '5' is not in CUDA_VISIBLE_DEVICES='0,1'"):
        select_device([5], cuda_device_count=2, cuda_visible_devices="0,1", ray_sets_visible_devices=False)


def test_ray_init_inside_a_submitted_job_drops_env_vars_the_job_already_sets():
    import json

    from rlhfkit.workers._env import _without_job_duplicates

    job = json.dumps({"runtime_env": {"env_vars": {"PYTHONPATH": "src", "A": "1"}, "working_dir": "gcs://x.zip"}})
    assert _without_job_duplicates({"env_vars": {"PYTHONPATH": "src", "B": "2"}}, job) == {"env_vars": {"B": "2"}}
    assert _without_job_duplicates({"env_vars": {"A": "1"}}, job) is None
    with pytest.raises(ValueError, match=r"\{'A': \('2', '1'\)\} \(ours, the job's\) conflict"):
        _without_job_duplicates({"env_vars": {"A": "2"}}, job)


def test_launch_example_runs_tiny_on_the_test_cluster(cluster, monkeypatch):
    """examples/launch/hello_placement.py --tiny: plan, reserve, start the actor ranks, all-reduce over gloo."""
    import importlib.util

    _need(GPU=2)
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "launch", "hello_placement.py")
    spec = importlib.util.spec_from_file_location("hello_placement", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "hello_placement", module)
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # run as a script it is __main__, pickled by value anyway
    results = module.main(["--tiny", "--gpus-per-node", "2", "--timeout", str(WAIT_S)])
    assert [(r["rank"], r["all_reduce"]) for r in results] == [(0, 3.0), (1, 3.0)]


@pytest.mark.gpu
def test_gpu_placement_check_script(tmp_path):
    """Runs tests/gpu_placement_check.py (fractional shares on one real GPU; distinct GPUs with two)."""
    import json
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "gpu_placement_check.py")
    out = tmp_path / "placement.json"
    result = subprocess.run([sys.executable, script, "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert json.loads(out.read_text())["ok"] is True
