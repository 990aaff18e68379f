"""Tests for rlhfkit.placement without Ray: plans built by hand, invalid plans, the table, the memory estimate.

Ray-backed checks (materialize, scheduling options on a live cluster) live in test_workers.py, which shares one
local cluster with the worker-group tests.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from rlhfkit.placement import (
    SHARE_RESOLUTION,
    ColocationGroup,
    Inventory,
    MemoryConfig,
    MemoryFitError,
    ModelMemory,
    NodeSpec,
    PlacementConfig,
    RoleSpec,
    engines,
    estimate_memory,
    plan_placement,
    ray_share,
    requested_bundles,
    shortfall_report,
)

GIB = 1024**3


@pytest.fixture
def no_ray(monkeypatch):
    """Make ``import ray`` fail: anything here that touched Ray would raise ImportError instead of ValueError."""
    for name in [key for key in sys.modules if key == "ray" or key.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)


def _rows(plan):
    """Table rows as lists of cells (cells are separated by two or more spaces)."""
    lines = plan.table().splitlines()
    return [re.split(r"\s{2,}", line.strip()) for line in lines[1:]]


def hybrid_plan():
    roles = (RoleSpec(name="actor", num_gpus=8), RoleSpec(name="reference", num_gpus=8), engines(4, 2))
    return plan_placement(
        PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=1, gpus_per_node=8), hybrid=True)
    )


def test_hybrid_plan_colocates_every_rank_with_contiguous_tp_groups(no_ray):
    plan = hybrid_plan()
    for rank in range(8):
        assert plan.rank("actor", rank).node == 0 and plan.rank("actor", rank).gpus == (rank,)
        assert plan.rank("reference", rank).gpus == (rank,)
    for engine in range(4):
        placement = plan.rank("rollout", engine)
        assert placement.gpus == (2 * engine, 2 * engine + 1) and placement.bundle_indices == placement.gpus
    shares = {role: plan.rank(role, 0).share for role in ("actor", "reference", "rollout")}
    assert shares == pytest.approx({"actor": 1 / 3, "reference": 1 / 3, "rollout": 1 / 3})
    assert plan.bundles_per_node() == (8,)
    rows = _rows(plan)
    assert rows[0] == ["node", "gpu", "labels", "actor", "reference", "rollout", "free"]
    # GPU 5 holds actor rank 5, reference rank 5 and the second TP worker of engine 2.
    assert rows[6] == ["0", "5", "-", "5 (0.33)", "5 (0.33)", "2/tp1 (0.33)", "0.00"]
    assert "rollout=8 (4 x tensor_parallel_size 2)" in plan.table().splitlines()[0]
    assert str(plan) == plan.table()


def test_actor_reference_and_critic_reward_colocation_on_two_nodes(no_ray):
    roles = (
        RoleSpec(name="actor", num_gpus=4, share=0.75), RoleSpec(name="reference", num_gpus=4),
        RoleSpec(name="critic", num_gpus=4), RoleSpec(name="reward", num_gpus=4),
    )
    config = PlacementConfig(
        roles=roles, inventory=Inventory.uniform(num_nodes=2, gpus_per_node=4),
        colocate=(("actor", "reference"), ColocationGroup(roles=("critic", "reward"))),
    )
    plan = plan_placement(config)
    assert [(p.node, p.gpus) for p in plan.ranks("actor")] == [(0, (g,)) for g in range(4)]
    assert [(p.node, p.gpus) for p in plan.ranks("reference")] == [(0, (g,)) for g in range(4)]
    assert [(p.node, p.gpus) for p in plan.ranks("critic")] == [(1, (g,)) for g in range(4)]
    assert [(p.node, p.gpus) for p in plan.ranks("reward")] == [(1, (g,)) for g in range(4)]
    assert plan.rank("actor", 0).share == 0.75 and plan.rank("reference", 0).share == pytest.approx(0.25)
    assert plan.rank("critic", 3).share == 0.5 and plan.rank("reward", 3).share == 0.5
    rows = _rows(plan)
    assert rows[1] == ["0", "0", "-", "0 (0.75)", "0 (0.25)", "-", "-", "0.00"]
    assert rows[8] == ["1", "3", "-", "-", "-", "3 (0.50)", "3 (0.50)", "0.00"]


def test_labelled_inventory_sends_roles_to_their_nodes(no_ray):
    inventory = Inventory(nodes=(NodeSpec(num_gpus=4, resources={"v100": 1}),
                                 NodeSpec(num_gpus=4, resources={"h100": 1})))
    roles = (
        RoleSpec(name="actor", num_gpus=2, label="h100"), RoleSpec(name="critic", num_gpus=2, label="h100"),
        RoleSpec(name="reference", num_gpus=2, label="v100"), RoleSpec(name="reward", num_gpus=2, label="v100"),
    )
    plan = plan_placement(PlacementConfig(roles=roles, inventory=inventory))
    assert [(p.node, p.gpus) for p in plan.ranks("actor")] == [(1, (0,)), (1, (1,))]
    assert [(p.node, p.gpus) for p in plan.ranks("critic")] == [(1, (2,)), (1, (3,))]
    assert [(p.node, p.gpus) for p in plan.ranks("reference")] == [(0, (0,)), (0, (1,))]
    assert [(p.node, p.gpus) for p in plan.ranks("reward")] == [(0, (2,)), (0, (3,))]
    assert _rows(plan)[1][:3] == ["0", "0", "v100"]
    bundles = requested_bundles(plan, cpus_per_bundle=2)
    assert bundles[0] == ({"GPU": 1.0, "CPU": 2.0, "v100": 1.0},) * 4
    assert bundles[1] == ({"GPU": 1.0, "CPU": 2.0, "h100": 1.0},) * 4


def test_unlabelled_role_declared_first_does_not_block_a_labelled_one(no_ray):
    # Declaration order puts "misc" on the h100 node first; the retry places labelled roles first.
    inventory = Inventory(nodes=(NodeSpec(num_gpus=4, resources={"h100": 1}), NodeSpec(num_gpus=4)))
    roles = (RoleSpec(name="misc", num_gpus=4), RoleSpec(name="actor", num_gpus=4, label="h100"))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=inventory))
    assert {p.node for p in plan.ranks("actor")} == {0} and {p.node for p in plan.ranks("misc")} == {1}


def test_role_spanning_nodes_and_partial_node_use(no_ray):
    roles = (engines(3, 2), RoleSpec(name="critic", num_gpus=1))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=2, gpus_per_node=4)))
    assert [(p.node, p.gpus) for p in plan.ranks("rollout")] == [(0, (0, 1)), (0, (2, 3)), (1, (0, 1))]
    assert [(p.node, p.gpus) for p in plan.ranks("critic")] == [(1, (2,))]
    assert plan.bundles_per_node() == (4, 3)
    assert [row[:2] for row in _rows(plan)[1:]] == [["0", "0"], ["0", "1"], ["0", "2"], ["0", "3"], ["1", "0"],
                                                     ["1", "1"], ["1", "2"]]


INVALID = [
    # (id, builder, message pattern)
    ("colocated-gpus-differ",
     lambda: PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=8), RoleSpec(name="reference", num_gpus=4)),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=8),
                             colocate=(("actor", "reference"),)),
     r"colocated roles \['actor', 'reference'\] must cover the same GPUs, got actor=8, reference=4"),
    ("hybrid-actor-vs-engines",
     lambda: PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=8), engines(2, 2)),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=8), hybrid=True),
     r"hybrid engine: the trainers' GPUs must equal engines x TP\), got actor=8, "
     r"rollout=4 \(2 x tensor_parallel_size 2\)"),
    ("tp-straddles-nodes",
     lambda: PlacementConfig(roles=(engines(1, 16),), inventory=Inventory.uniform(num_nodes=2, gpus_per_node=8)),
     r"role 'rollout' has tensor_parallel_size=16 but the largest node has 8 GPUs; a TP group cannot straddle"),
    ("totals-exceed-inventory",
     lambda: PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=8), RoleSpec(name="critic", num_gpus=4)),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=8)),
     r"roles need 12 GPUs \(actor 8, critic 4\) but the inventory has 1 node\(s\), 8 GPUs"),
    ("unknown-label",
     lambda: PlacementConfig(roles=(RoleSpec(name="reference", num_gpus=1, label="a100"),),
                             inventory=Inventory(nodes=(NodeSpec(num_gpus=4, resources={"h100": 1}),))),
     r"role 'reference' has label 'a100' but no inventory node offers it \(labels offered: \['h100'\]\)"),
    ("zero-gpus", lambda: RoleSpec(name="critic", num_gpus=0), r"RoleSpec\(name='critic'\)\.num_gpus=0; must be >= 1"),
    ("negative-engines", lambda: engines(-1, 2), r"engines\.num_engines=-1; must be >= 1"),
    ("zero-nodes", lambda: Inventory.uniform(num_nodes=0, gpus_per_node=8), r"num_nodes=0; must be >= 1"),
    ("shares-sum-above-one",
     lambda: PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=2, share=0.7),
                                    RoleSpec(name="reference", num_gpus=2, share=0.6)),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2),
                             colocate=(("actor", "reference"),)),
     r"shares of roles sharing a GPU sum to 1\.3 > 1 \(actor=0\.7, reference=0\.6\)"),
    ("shares-leave-nothing",
     lambda: PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=2, share=1.0),
                                    RoleSpec(name="reference", num_gpus=2)),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2),
                             colocate=(("actor", "reference"),)),
     r"explicit shares \(actor=1\.0\) leave 0 of each GPU for roles \['reference'\]"),
    ("tp-does-not-divide",
     lambda: RoleSpec(name="rollout", num_gpus=6, gpus_per_rank=4),
     r"tensor_parallel_size \(gpus_per_rank\)=4 does not divide the 6 GPUs of role 'rollout'"),
    ("unknown-role-in-group",
     lambda: PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=2),),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2),
                             colocate=(("actor", "critic"),)),
     r"colocation group \['actor', 'critic'\] names unknown role 'critic'"),
    ("role-in-two-groups",
     lambda: PlacementConfig(roles=tuple(RoleSpec(name=n, num_gpus=2) for n in ("a", "b", "c")),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2),
                             colocate=(("a", "b"), ("b", "c"))),
     r"role 'b' is in colocation groups 0 and 1"),
    ("duplicate-role",
     lambda: PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=1), RoleSpec(name="actor", num_gpus=1)),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2)),
     r"role name\(s\) \['actor'\] appear more than once"),
    ("label-total-exceeds",
     lambda: PlacementConfig(roles=(RoleSpec(name="reference", num_gpus=4, label="v100"),
                                    RoleSpec(name="reward", num_gpus=4, label="v100")),
                             inventory=Inventory(nodes=(NodeSpec(num_gpus=4, resources={"v100": 1}),
                                                        NodeSpec(num_gpus=8, resources={"h100": 1})))),
     r"roles with label 'v100' need 8 GPUs \(reference 4, reward 4\) but nodes with it have 4"),
    ("tp-fragmentation",
     lambda: plan_placement(PlacementConfig(roles=(engines(3, 4),),
                                            inventory=Inventory.uniform(num_nodes=2, gpus_per_node=6))),
     r"cannot place rollout \(12 GPUs in blocks of 4 inside one node\): free GPUs on eligible nodes after earlier "
     r"roles: node0 2, node1 2"),
    ("hybrid-and-colocate",
     lambda: PlacementConfig(roles=(RoleSpec(name="a", num_gpus=1), RoleSpec(name="b", num_gpus=1)),
                             inventory=Inventory.uniform(num_nodes=1, gpus_per_node=1), hybrid=True,
                             colocate=(("a", "b"),)),
     r"hybrid=True already colocates every role; leave colocate empty"),
    ("share-out-of-range", lambda: RoleSpec(name="actor", num_gpus=1, share=1.5), r"share=1\.5; must be in"),
    ("colocated-labels-differ",
     lambda: PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=1, label="h100"),
                                    RoleSpec(name="reference", num_gpus=1, label="v100")),
                             inventory=Inventory(nodes=(NodeSpec(num_gpus=1, resources={"h100": 1, "v100": 1}),)),
                             colocate=(("actor", "reference"),)),
     r"colocated roles \['actor', 'reference'\] have different labels \(actor='h100', reference='v100'\)"),
    ("colocated-blocks-too-big",
     lambda: PlacementConfig(roles=(RoleSpec(name="a", num_gpus=12, gpus_per_rank=3),
                                    RoleSpec(name="b", num_gpus=12, gpus_per_rank=4)),
                             inventory=Inventory.uniform(num_nodes=2, gpus_per_node=8), colocate=(("a", "b"),)),
     r"colocated roles a\+b need blocks of 12 GPUs on one node \(lcm of gpus_per_rank \[3, 4\]\) but the largest "
     r"node has 8 GPUs"),
    ("bad-node-resource", lambda: NodeSpec(num_gpus=2, resources={"GPU": 1}), r"resources key 'GPU'"),
]


@pytest.mark.parametrize("build,pattern", [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_plans_are_rejected_before_anything_starts(no_ray, build, pattern):
    with pytest.raises(ValueError, match=pattern):
        config = build()
        plan_placement(config)


def test_rank_lookup_errors_name_role_and_range(no_ray):
    plan = hybrid_plan()
    with pytest.raises(ValueError, match=r"rank=4 of role 'rollout'; the role has ranks 0\.\.3"):
        plan.rank("rollout", 4)
    with pytest.raises(ValueError, match=r"unknown role 'critic'"):
        plan.ranks("critic")


def test_ray_share_rounds_down_to_ray_resolution():
    assert ray_share(1 / 3) == 0.3333 and 3 * ray_share(1 / 3) <= 1
    assert ray_share(0.5) == 0.5 and ray_share(1.0) == 1.0 and ray_share(0.25) == 0.25
    assert ray_share(SHARE_RESOLUTION) == SHARE_RESOLUTION


def test_memory_estimate_matches_hand_computation():
    roles = (RoleSpec(name="actor", num_gpus=2), RoleSpec(name="reference", num_gpus=2))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2),
                                          colocate=(("actor", "reference"),)))
    params = 1_000_000_000
    models = {"actor": ModelMemory(num_params=params, kind="trainable"), "reference": ModelMemory(num_params=params)}
    estimate = estimate_memory(plan, models, MemoryConfig(gpu_memory_gib=80, context_gib=0.5))
    actor = params * (2 + 2 + 12 + 4) / GIB  # bf16 weights + grads, fp32 masters + Adam, the step's fp32 grads
    reference = params * 2 / GIB
    assert estimate.phases == ("actor", "reference")
    assert estimate.per_gpu[(0, 0)]["actor"] == pytest.approx(actor + 0.5 + 0.5)
    assert estimate.per_gpu[(0, 1)]["reference"] == pytest.approx(reference + 0.5 + 0.5)
    assert not estimate.warnings
    # ZeRO-3 over the two ranks halves weights, grads and optimizer states; ZeRO-1 only the optimizer states, and its
    # step adds the flattened 16-bit copy of the rank's gradient partition (2 bytes / 2 ranks).
    z3 = estimate_memory(plan, {"actor": ModelMemory(num_params=params, kind="trainable", zero_stage=3)},
                         MemoryConfig(gpu_memory_gib=80, context_gib=0.0))
    assert z3.per_gpu[(0, 0)]["actor"] == pytest.approx(actor / 2)
    z1 = estimate_memory(plan, {"actor": ModelMemory(num_params=params, kind="trainable", zero_stage=1)},
                         MemoryConfig(gpu_memory_gib=80, context_gib=0.0))
    assert z1.per_gpu[(0, 0)]["actor"] == pytest.approx(params * (2 + 2 + 8 + 1) / GIB)
    assert "no ModelMemory for role 'reference'" in z1.warnings[0]
    # ... one optimizer parameter group at a time: that step's flattened copy and fp32 cast count one group's
    # partition (2e8 parameters over 2 ranks, 2 + 4 bytes each), not the whole partition's
    grouped = estimate_memory(plan, {"actor": ModelMemory(num_params=params, kind="trainable", zero_stage=1,
                                                          step_group_params=200_000_000)},
                              MemoryConfig(gpu_memory_gib=80, context_gib=0.0))
    assert grouped.per_gpu[(0, 0)]["actor"] == pytest.approx((params * (2 + 2 + 6) + 200_000_000 * 3) / GIB)
    with pytest.raises(ValueError, match="step_group_params=0"):
        ModelMemory(num_params=params, kind="trainable", step_group_params=0)


def test_memory_estimate_warns_when_a_phase_does_not_fit(caplog):
    plan = hybrid_plan()
    models = {
        "actor": ModelMemory(num_params=7_000_000_000, kind="trainable", zero_stage=3),
        "reference": ModelMemory(num_params=7_000_000_000, zero_stage=3),
        "rollout": ModelMemory(num_params=7_000_000_000, kind="engine"),
    }
    config = MemoryConfig(gpu_memory_gib=24, engine_memory_fraction=0.9,
                          phases={"generate": ("rollout",), "sync": ("actor", "rollout")})
    with caplog.at_level("WARNING"):
        estimate = estimate_memory(plan, models, config)
    generate = 0.9 * 24 + 3 * 0.5
    per_rank_actor = 7e9 * 20 / 8 / GIB  # bf16 weights, grads; fp32 masters, Adam, the step's fp32 grads
    assert estimate.per_gpu[(0, 0)]["generate"] == pytest.approx(generate)
    assert estimate.per_gpu[(0, 7)]["sync"] == pytest.approx(generate + per_rank_actor)
    assert any("phase 'sync': node0 gpu0 needs" in w for w in estimate.warnings)
    assert not any("phase 'generate'" in w for w in estimate.warnings)
    assert "phase 'sync': node0 gpu0" in caplog.text
    assert "! " in estimate.table() or estimate.table().rstrip().endswith("!")
    small = MemoryConfig(gpu_memory_gib=24, engine_memory_fraction=0.2)
    assert any("leaving no KV cache" in w for w in estimate_memory(plan, models, small).warnings)
    with pytest.raises(ValueError, match=r"phases\['x'\] names unknown roles \['critic'\]"):
        estimate_memory(plan, models, MemoryConfig(phases={"x": ("critic",)}))


def test_shortfall_report_names_missing_resources_and_nodes():
    inventory = Inventory(nodes=(NodeSpec(num_gpus=8, resources={"h100": 1}), NodeSpec(num_gpus=2)))
    plan = plan_placement(PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=8, label="h100"),
                                                 RoleSpec(name="critic", num_gpus=2)), inventory=inventory))
    bundles = requested_bundles(plan, cpus_per_bundle=1)
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"GPU": 4.0, "CPU": 8.0, "h100": 4.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"GPU": 2.0, "CPU": 8.0}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"GPU": 8.0, "CPU": 8.0, "h100": 8.0}},
    ]
    report = shortfall_report(bundles, [0], cluster_total={"GPU": 6, "CPU": 16, "h100": 4},
                              cluster_available={"GPU": 6, "CPU": 16, "h100": 4}, nodes=nodes)
    assert "GPU: plan requests 10, cluster has 6 in total, 6 available now" in report
    assert "h100: plan requests 8, cluster has 4 in total" in report
    assert "plan node 0 needs {CPU: 8, GPU: 8, h100: 8} on one Ray node; no alive node has that" in report
    busy = shortfall_report(bundles, [1], cluster_total={"GPU": 6, "CPU": 16}, cluster_available={"GPU": 0, "CPU": 16},
                            nodes=nodes)
    assert "['10.0.0.1', '10.0.0.2'] could hold it but the resources are in use" in busy


def test_placement_and_workers_import_without_ray():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import rlhfkit.placement as p, rlhfkit.workers as w\n"
        "plan = p.plan_placement(p.PlacementConfig(roles=(p.RoleSpec(name='a', num_gpus=1),),"
        " inventory=p.Inventory.uniform(num_nodes=1, gpus_per_node=1)))\n"
        "try:\n    p.materialize(plan)\nexcept ImportError as e:\n    print('IMPORT-ERROR', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "IMPORT-ERROR rlhfkit.placement needs the optional dependency 'ray'" in result.stdout
    assert "pip install 'rlhfkit[ray]'" in result.stdout


ONE = dict(inventory=Inventory.uniform(num_nodes=1, gpus_per_node=2))
PAIR = (RoleSpec(name="actor", num_gpus=2), RoleSpec(name="reference", num_gpus=2))
WRONG_TYPES = [
    # (id, builder, message pattern): each config field's type is checked strictly (bool is not a number)
    ("share-str", lambda: RoleSpec(name="actor", num_gpus=1, share="0.5"),
     r"RoleSpec\(name='actor'\)\.share must be a number \(int or float\), got '0\.5' \(str\)"),
    ("share-bool", lambda: RoleSpec(name="actor", num_gpus=1, share=True),
     r"share must be a number.*got True \(bool\)"),
    ("num-gpus-float", lambda: RoleSpec(name="actor", num_gpus=2.0), r"num_gpus must be an int, got 2\.0"),
    ("num-gpus-bool", lambda: RoleSpec(name="actor", num_gpus=True), r"num_gpus must be an int, got True"),
    ("name-int", lambda: RoleSpec(name=3, num_gpus=1), r"RoleSpec\.name must be a str, got 3 \(int\)"),
    ("label-int", lambda: RoleSpec(name="actor", num_gpus=1, label=3), r"label must be a str, got 3 \(int\)"),
    ("flat-colocate",
     lambda: PlacementConfig(roles=PAIR, colocate=("actor", "reference"), **ONE),
     r"PlacementConfig\.colocate=\('actor', 'reference'\) is a flat tuple of role names; it must be a tuple of "
     r"groups, e.g\. colocate=\(\('actor', 'reference'\),\)"),
    ("colocate-list-of-str", lambda: PlacementConfig(roles=PAIR, colocate=["actor", "reference"], **ONE),
     r"PlacementConfig\.colocate must be a tuple of groups"),
    ("colocate-group-int", lambda: PlacementConfig(roles=PAIR, colocate=(3,), **ONE),
     r"PlacementConfig\.colocate\[0\]=3 \(int\)"),
    ("group-str", lambda: ColocationGroup(roles="ab"), r"ColocationGroup\.roles must be a tuple of role names"),
    ("group-member-int", lambda: ColocationGroup(roles=("actor", 1)), r"each role name must be a str, got 1"),
    ("hybrid-int", lambda: PlacementConfig(roles=PAIR, hybrid=1, **ONE), r"hybrid must be a bool, got 1 \(int\)"),
    ("roles-list", lambda: PlacementConfig(roles=list(PAIR), **ONE), r"roles must be a tuple of RoleSpec, got list"),
    ("inventory-int", lambda: PlacementConfig(roles=PAIR, inventory=8), r"inventory must be an Inventory, got 8"),
    ("nodes-list", lambda: Inventory(nodes=[NodeSpec(num_gpus=1)]), r"Inventory\.nodes must be a tuple of NodeSpec"),
    ("resources-list", lambda: NodeSpec(num_gpus=1, resources=["h100"]), r"resources must be a mapping"),
    ("resource-bool", lambda: NodeSpec(num_gpus=1, resources={"h100": True}), r"must be a number.*True \(bool\)"),
    ("memory-str", lambda: MemoryConfig(gpu_memory_gib="80"), r"gpu_memory_gib must be a number.*'80' \(str\)"),
    ("zero-stage-bool", lambda: ModelMemory(num_params=10, zero_stage=True), r"zero_stage must be an int"),
    ("activation-str", lambda: ModelMemory(num_params=10, activation_gib="1"), r"activation_gib must be a number"),
    ("phases-flat-str", lambda: MemoryConfig(phases={"train": "actor"}),
     r"MemoryConfig\.phases\['train'\]='actor' \(str\).*Write \('actor',\)"),
]


@pytest.mark.parametrize("build,pattern", [c[1:] for c in WRONG_TYPES], ids=[c[0] for c in WRONG_TYPES])
def test_wrong_field_types_raise_type_error_naming_field_and_shape(no_ray, build, pattern):
    """Review defect: share="0.5" gave a bare TypeError, share=True was taken as 1.0, a flat colocate tuple was split
    into characters; every config field now raises a TypeError naming the field and the right shape."""
    with pytest.raises(TypeError, match=pattern):
        plan_placement(build())


NOT_FINITE_OR_HUGE = [
    ("resource-inf", lambda: NodeSpec(num_gpus=1, resources={"h100": float("inf")}),
     r"NodeSpec\.resources\['h100'\]=inf; must be a finite number"),
    ("resource-nan", lambda: NodeSpec(num_gpus=1, resources={"h100": float("nan")}), r"=nan; must be a finite"),
    ("share-nan", lambda: RoleSpec(name="actor", num_gpus=1, share=float("nan")), r"share=nan; must be a finite"),
    ("memory-inf", lambda: MemoryConfig(gpu_memory_gib=float("inf")), r"gpu_memory_gib=inf; must be a finite"),
    ("role-10**12", lambda: RoleSpec(name="actor", num_gpus=10**12),
     r"RoleSpec\(name='actor'\)\.num_gpus=1000000000000 is above the sanity bound 131072; is it a typo\?"),
    ("engines-10**12", lambda: engines(10**12), r"engines\.num_engines=1000000000000 is above the sanity bound"),
    ("tp-huge", lambda: engines(1, 4096), r"tensor_parallel_size=4096 is above the sanity bound 1024"),
    ("node-10**12", lambda: NodeSpec(num_gpus=10**12), r"NodeSpec\.num_gpus=1000000000000 is above the sanity bound"),
    ("uniform-10**12-nodes", lambda: Inventory.uniform(num_nodes=10**12, gpus_per_node=8),
     r"num_nodes=1000000000000 is above the sanity bound"),
    ("uniform-product", lambda: Inventory.uniform(num_nodes=1 << 12, gpus_per_node=1024),
     r"num_nodes=4096 x gpus_per_node=1024 = 4194304 GPUs, above the sanity bound 131072"),
]


@pytest.mark.parametrize("build,pattern", [c[1:] for c in NOT_FINITE_OR_HUGE], ids=[c[0] for c in NOT_FINITE_OR_HUGE])
def test_infinite_nan_and_absurd_sizes_are_rejected_at_once(no_ray, build, pattern):
    """Review defect: num_gpus=10**12 ran out of memory after tens of seconds and an infinite resource was accepted;
    both now raise ValueError in the constructor, before any per-GPU list is built."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=pattern):
            plan_placement(build())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"{peak} bytes allocated before the refusal"  # no per-GPU structure was built


def test_the_largest_allowed_plan_is_built(no_ray):
    """The sanity bound is not a cliff: a plan of MAX_GPUS GPUs builds (its speed is a benchmark's concern)."""
    from rlhfkit.placement import MAX_GPUS, MAX_GPUS_PER_NODE

    inventory = Inventory.uniform(num_nodes=MAX_GPUS // MAX_GPUS_PER_NODE, gpus_per_node=MAX_GPUS_PER_NODE)
    plan = plan_placement(PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=MAX_GPUS),), inventory=inventory))
    assert len(plan.ranks("actor")) == MAX_GPUS
    with pytest.raises(ValueError, match=r"roles need 131072 GPUs .* but the inventory has 1 node\(s\), 8 GPUs"):
        PlacementConfig(roles=(RoleSpec(name="actor", num_gpus=MAX_GPUS),),
                        inventory=Inventory.uniform(num_nodes=1, gpus_per_node=8))


def test_check_fit_refuses_an_engine_share_that_leaves_no_kv_cache():
    """Review-h (the hybrid launcher had its own copy of this check, which skipped SGLang): estimate_memory finds an
    engine whose weights fill its share, and check_fit raises MemoryFitError naming the engine's phase and the
    shortfall, although every phase fits the GPU; an engine with its own size (engine_gib) is not a share."""
    plan = hybrid_plan()
    models = {"rollout": ModelMemory(num_params=7_000_000_000, kind="engine")}  # bf16, TP 2: 6.5 GiB per GPU
    config = MemoryConfig(gpu_memory_gib=24, engine_memory_fraction=0.2,
                          phases={"train": ("actor",), "generate": ("rollout",)})
    estimate = estimate_memory(plan, models, config)
    weights, budget = 7e9 * 2 / 2 / GIB, 0.2 * 24
    assert max(estimate.per_gpu[(0, 0)].values()) < 24  # no phase is over the GPU
    assert [error.phase for error in estimate.engine_shortfalls] == ["generate"]
    assert estimate.engine_shortfalls[0].shortfall_gib == pytest.approx(weights - budget)
    with pytest.raises(MemoryFitError, match=r"this plan does not fit: phase 'generate': engine role 'rollout': "
                                             r"weights need 6\.5 GiB .* gives 4\.8 GiB, leaving no KV cache: short by "
                                             r"1\.7 GiB") as info:
        estimate.check_fit()
    assert info.value.phase == "generate" and info.value.shortfall_gib == pytest.approx(weights - budget)
    estimate_memory(plan, models, dataclasses.replace(config, engine_memory_fraction=0.3)).check_fit()
    sized = {"rollout": ModelMemory(num_params=7_000_000_000, kind="engine", engine_gib=2.0)}
    estimate_memory(plan, sized, config).check_fit()


def test_host_estimate_matches_hand_computation():
    """Issue 20: host memory per node per phase — ZeRO-3 optimizer offload (a share of it: masters + moments + fp32
    gradient, 16 bytes, plus the bf16 gradient partitions), a role parked in host memory, an engine's backup, process
    and node reserves, and each model's host copy while it loads; check_fit names the host shortfall."""
    roles = (RoleSpec(name="actor", num_gpus=1), RoleSpec(name="reference", num_gpus=1),
             RoleSpec(name="rollout", num_gpus=1))
    plan = plan_placement(PlacementConfig(roles=roles, inventory=Inventory.uniform(num_nodes=1, gpus_per_node=1),
                                          colocate=(("actor", "reference", "rollout"),)))
    params = 1_000_000_000
    models = {"actor": ModelMemory(num_params=params, kind="trainable", zero_stage=3, offload_optimizer=True,
                                   offload_optimizer_ratio=0.75, asleep="gpu"),
              "reference": ModelMemory(num_params=params, asleep="host"),
              "rollout": ModelMemory(num_params=params, kind="engine", host_gib=1.5, asleep_gib=1.0)}
    config = MemoryConfig(gpu_memory_gib=80, context_gib=0.5, engine_memory_fraction=0.25, host_memory_gib=64,
                          host_process_gib=2.0, host_reserved_gib=4.0, load_order=("actor", "reference"),
                          phases={"generate": ("rollout",), "train": ("actor",)})
    estimate = estimate_memory(plan, models, config)
    actor_host = params * (0.75 * 16 + 2) / GIB  # offloaded optimizer share + bf16 gradient partitions
    reference_host = params * 2 / GIB  # parked weights
    steady = actor_host + reference_host + 1.5 + 3 * 2.0 + 4.0
    assert estimate.host_per_node[0]["generate"] == pytest.approx(steady)
    assert estimate.host_per_node[0]["train"] == pytest.approx(steady)
    assert estimate.host_per_node[0]["load_actor"] == pytest.approx(params * 2 / GIB + 1.5 + 10.0)
    assert estimate.host_per_node[0]["load_reference"] == pytest.approx(actor_host + params * 2 / GIB + 1.5 + 10.0)
    # GPU: the actor keeps bf16 weights and 25% of the optimizer (16 bytes) asleep, no gradients (ZeRO-3 Offload)
    actor_gpu = params * (2 + 0.25 * 16) / GIB
    # the awake engine: its share plus what it keeps outside it (asleep_gib: CUDA graphs)
    assert estimate.per_gpu[(0, 0)]["generate"] == pytest.approx(0.25 * 80 + 1.0 + actor_gpu + 3 * 0.5)
    assert estimate.per_gpu[(0, 0)]["train"] == pytest.approx(actor_gpu + 1.0 + 3 * 0.5)
    assert estimate.host_phases == ("generate", "train", "load_actor", "load_reference")
    assert "host" in estimate.table() and estimate.host_peak() == pytest.approx(steady)
    estimate.check_fit()
    small = estimate_memory(plan, models, dataclasses.replace(config, host_memory_gib=20.0))
    with pytest.raises(MemoryFitError, match=r"does not fit host memory: phase 'generate' .* short by "
                                             r"\d+\.\d GiB") as info:
        small.check_fit()
    assert info.value.memory == "host" and info.value.shortfall_gib == pytest.approx(steady - 20.0)
    assert any("host memory needs" in warning for warning in small.warnings)
    with pytest.raises(ValueError, match="offload_optimizer_ratio=1.5"):
        ModelMemory(num_params=1, offload_optimizer_ratio=1.5)
    with pytest.raises(ValueError, match=r"load_order names unknown roles \['critic'\]"):
        estimate_memory(plan, models, dataclasses.replace(config, load_order=("critic",)))
    # read ahead: every role's host copy is read before the first is placed, so the actor's load holds both copies
    ahead = estimate_memory(plan, models, dataclasses.replace(config, read_ahead=True))
    assert ahead.host_per_node[0]["load_actor"] == pytest.approx(2 * params * 2 / GIB + 1.5 + 10.0)
    assert ahead.host_per_node[0]["load_reference"] == estimate.host_per_node[0]["load_reference"]
    with pytest.raises(TypeError, match="MemoryConfig.read_ahead='yes'"):
        MemoryConfig(read_ahead="yes")


def test_master_port_picks_do_not_follow_the_random_modules_seed():
    """Regression (CI, session 18: two roles' MASTER_PORTs collided, EADDRINUSE at load): the pick drew from the
    ``random`` module's state, so two processes seeded alike (or one reseeded) probed the same port, both found it
    free, and the second rendezvous to bind it failed. The pick now draws from the OS's entropy."""
    import random

    from rlhfkit._ports import free_listen_port

    picks = []
    for _ in range(4):  # the same seed before each pick: the old code returned one port four times
        random.seed(1234)
        picks.append(free_listen_port())
    assert len(set(picks)) > 1, picks


def test_master_ports_come_from_outside_the_ephemeral_range():
    """Regression (CI, session 5): MASTER_PORT was a bind(0) port, which the kernel may hand to another process's
    outgoing connection or bind(0) in the seconds before rank 0 listens on it (EADDRINUSE at init_process_group).
    The probe (and SGLang's server port) now pick a free port outside the kernel's ephemeral range."""
    import socket

    from rlhfkit._ports import _ephemeral_range, free_listen_port

    low, high = _ephemeral_range()
    ports = {free_listen_port() for _ in range(20)}
    assert all(not low <= port <= high for port in ports) and len(ports) > 1
    port = ports.pop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", port))  # free: nothing holds it after the probe
