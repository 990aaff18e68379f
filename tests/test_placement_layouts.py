"""Multi-GPU, multi-node plans validated and printed without Ray or GPUs (issue 24, "CPU parts").

Every plan of 4, 8 and 16 GPUs over 1, 2 and 4 nodes, in the colocated (hybrid engine) and the separated layout, with
rollout engines of tensor-parallel size 1, 2 and 4, is built with :func:`rlhfkit.placement.plan_layout` and checked
against invariants computed here from the numbers alone: no TP group straddles a node, every role has all its ranks,
the shares on each GPU sum to at most 1, engines and trainers sit where the layout says, and the printed table shows
exactly the plan. Combinations that cannot exist (a TP group larger than a node) must raise ``ValueError``.
"""

from __future__ import annotations

import itertools
import re
import sys

import pytest

from rlhfkit.placement import plan_layout, ray_share

TRAINERS = ("actor", "reference")
CASES = [
    pytest.param(total, nodes, layout, tp, id=f"{total}gpu-{nodes}node-{layout}-tp{tp}")
    for total, nodes, layout, tp in itertools.product((4, 8, 16), (1, 2, 4), ("colocated", "separated"), (1, 2, 4))
]


@pytest.fixture
def no_ray(monkeypatch):
    """``import ray`` fails: building and printing a plan must not touch Ray."""
    for name in [key for key in sys.modules if key == "ray" or key.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)


def _build(total: int, nodes: int, layout: str, tp: int):
    engine_gpus = None if layout == "colocated" else total // 2
    return plan_layout(num_nodes=nodes, gpus_per_node=total // nodes, colocate=layout == "colocated",
                       engine_gpus=engine_gpus, tensor_parallel_size=tp)


def _expected_error(total: int, nodes: int, layout: str, tp: int) -> str | None:
    if layout == "separated" and (total // 2) % tp:
        return rf"engine_gpus={total // 2} must be .* a multiple of tensor_parallel_size={tp}"
    if total // nodes < tp:
        return "a TP group cannot straddle nodes"
    return None


def _check_ranks(plan, gpus_per_node: int, num_nodes: int) -> None:
    """Every role has ranks 0..n-1, each on contiguous GPUs of one existing node (a TP group never straddles)."""
    for role in plan.config.roles:
        ranks = plan.ranks(role.name)
        assert [p.rank for p in ranks] == list(range(role.num_ranks)), role.name
        for placement in ranks:
            assert 0 <= placement.node < num_nodes
            first = placement.gpus[0]
            assert placement.gpus == tuple(range(first, first + role.gpus_per_rank)), (role.name, placement)
            assert 0 <= first and placement.gpus[-1] < gpus_per_node, (role.name, placement)
        globals_ = [(p.node, g) for p in ranks for g in p.gpus]
        assert len(set(globals_)) == len(globals_) == role.num_gpus, f"{role.name}: two ranks on one GPU"


def _check_shares(plan, gpus_per_node: int, num_nodes: int) -> dict[tuple[int, int], frozenset[str]]:
    """Per GPU: shares sum to <= 1 (and their Ray requests too); returns the roles on each GPU."""
    roles_on = {}
    for node, gpu in itertools.product(range(num_nodes), range(gpus_per_node)):
        occupants = [placement for placement, _ in plan.occupants(node, gpu)]
        assert occupants, f"GPU {gpu} of node {node} is unused"
        assert sum(p.share for p in occupants) <= 1 + 1e-9
        assert sum(ray_share(p.share) for p in occupants) <= 1
        assert len({p.role for p in occupants}) == len(occupants), "a role twice on one GPU"
        roles_on[(node, gpu)] = frozenset(p.role for p in occupants)
    return roles_on


def _check_layout(plan, roles_on, *, total: int, gpus_per_node: int, layout: str, tp: int) -> None:
    def global_gpu(placement, k=0):
        return placement.node * gpus_per_node + placement.gpus[k]

    engines = plan.ranks("rollout")
    engine_gpus = {global_gpu(e, k) for e in engines for k in range(tp)}
    trainer_gpus = {role: {global_gpu(p) for p in plan.ranks(role)} for role in TRAINERS}
    assert trainer_gpus["actor"] == trainer_gpus["reference"]  # colocated with each other in both layouts
    for rank, (actor, reference) in enumerate(zip(plan.ranks("actor"), plan.ranks("reference"), strict=True)):
        assert (actor.node, actor.gpus) == (reference.node, reference.gpus), rank
    if layout == "colocated":
        assert engine_gpus == trainer_gpus["actor"] == set(range(total))
        assert set(roles_on.values()) == {frozenset({"actor", "reference", "rollout"})}
        # trainer rank r on global GPU r; engine e's TP worker k on GPU e * tp + k (the CUDA-IPC pairing)
        assert [global_gpu(p) for p in plan.ranks("actor")] == list(range(total))
        assert [global_gpu(e, k) for e in engines for k in range(tp)] == list(range(total))
        assert all(p.share == pytest.approx(1 / 3) for role in plan.placements.values() for p in role)
    else:
        assert not engine_gpus & trainer_gpus["actor"]
        assert len(engine_gpus) == len(trainer_gpus["actor"]) == total // 2
        assert set(roles_on.values()) == {frozenset({"actor", "reference"}), frozenset({"rollout"})}
        assert {p.share for p in engines} == {1.0} and {p.share for p in plan.ranks("actor")} == {0.5}


def _check_table(plan, *, total: int, num_nodes: int, tp: int) -> None:
    """The printed table has one row per GPU and shows exactly the plan's occupants and free share."""
    title, header, *rows = str(plan).splitlines()
    assert title.startswith(f"PlacementPlan: {total} of {total} GPUs on {num_nodes} node(s)")
    names = [role.name for role in plan.config.roles]
    assert re.split(r"\s{2,}", header.strip()) == ["node", "gpu", "labels", *names, "free"]
    assert len(rows) == total
    for row in rows:
        cells = re.split(r"\s{2,}", row.strip())
        node, gpu = int(cells[0]), int(cells[1])
        expected = dict.fromkeys(names, "-")
        for placement, tp_index in plan.occupants(node, gpu):
            who = str(placement.rank) if len(placement.gpus) == 1 else f"{placement.rank}/tp{tp_index}"
            expected[placement.role] = f"{who} ({placement.share:.2f})"
        free = 1 - sum(p.share for p, _ in plan.occupants(node, gpu))
        assert cells[2:] == ["-", *(expected[n] for n in names), f"{max(0.0, free):.2f}"], row
    if tp > 1:
        assert f"0/tp{tp - 1}" in str(plan)


@pytest.mark.parametrize("total,nodes,layout,tp", CASES)
def test_multi_node_plans_keep_their_invariants_and_print_them(no_ray, total, nodes, layout, tp):
    error = _expected_error(total, nodes, layout, tp)
    if error is not None:
        with pytest.raises(ValueError, match=error):
            _build(total, nodes, layout, tp)
        return
    plan = _build(total, nodes, layout, tp)
    gpus_per_node = total // nodes
    assert plan.bundles_per_node() == (gpus_per_node,) * nodes
    _check_ranks(plan, gpus_per_node, nodes)
    roles_on = _check_shares(plan, gpus_per_node, nodes)
    _check_layout(plan, roles_on, total=total, gpus_per_node=gpus_per_node, layout=layout, tp=tp)
    _check_table(plan, total=total, num_nodes=nodes, tp=tp)


@pytest.mark.parametrize("total,nodes,layout,tp", [c for c in CASES if _expected_error(*c.values) is None])
def test_hybrid_config_builds_the_same_plan_as_plan_layout(total, nodes, layout, tp):
    """HybridConfig's plan is the standard layout (regression guard: the hybrid and plan_layout must not drift),
    colocated TP engines included; the invalid plans' errors are checked above."""
    from rlhfkit.hybrid import HybridConfig
    from rlhfkit.hybrid._launch import plan_gpus

    config = HybridConfig(model="unused", num_nodes=nodes, num_gpus=total // nodes, colocate=layout == "colocated",
                          engine_gpus=total // 2, tensor_parallel_size=tp)
    assert dict(plan_gpus(config, TRAINERS).placements) == dict(_build(total, nodes, layout, tp).placements)


@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(num_nodes=0, gpus_per_node=8), ValueError, r"plan_layout.num_nodes=0; must be >= 1"),
    (dict(num_nodes=2, gpus_per_node="8"), TypeError, r"plan_layout.gpus_per_node must be an int, got '8'"),
    (dict(num_nodes=1, gpus_per_node=8, engine_gpus=4), ValueError, r"engine_gpus=4: leave it None"),
    (dict(num_nodes=1, gpus_per_node=6, tensor_parallel_size=4), ValueError,
     r"tensor_parallel_size=4 does not divide the 6 GPUs"),
    (dict(num_nodes=1, gpus_per_node=8, colocate=False), ValueError, r"colocate=False\) needs engine_gpus"),
    (dict(num_nodes=1, gpus_per_node=8, colocate=False, engine_gpus=8), ValueError,
     r"engine_gpus=8 must be below the 8 GPUs"),
    (dict(num_nodes=1, gpus_per_node=8, colocate=1), TypeError, r"colocate=1 \(int\); must be True or False"),
    (dict(num_nodes=1, gpus_per_node=8, trainer_roles="actor"), TypeError, r"trainer_roles='actor'; give a"),
    (dict(num_nodes=2, gpus_per_node=6, tensor_parallel_size=4), ValueError,  # 12 GPUs, but only 2 TP-4 blocks fit
     r"cannot place actor\+reference\+rollout \(12 GPUs in blocks of 4 inside one node\)"),
])
def test_plan_layout_rejects_bad_arguments_naming_them(no_ray, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        plan_layout(**kwargs)
