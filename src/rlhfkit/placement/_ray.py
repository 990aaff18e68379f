"""Turn a :class:`~rlhfkit.placement.PlacementPlan` into Ray placement groups and per-rank scheduling options.

One placement group per used inventory node, one bundle per GPU (``{"GPU": 1, "CPU": c, **node.resources}``), bundle
``i`` = local GPU ``i`` of the plan, ``STRICT_PACK`` so a node's bundles (and so every TP group) share one Ray node.
Needs the ``ray`` extra, imported inside the functions that use it.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlhfkit._optional import require
from rlhfkit.placement._plan import _EPS, SHARE_RESOLUTION, PlacementPlan, RankPlacement, _check_real

__all__ = [
    "MaterializedPlan",
    "NodeAddress",
    "PlacementTimeoutError",
    "materialize",
    "ray_share",
    "requested_bundles",
    "shortfall_report",
]

logger = logging.getLogger(__name__)
_USER = "rlhfkit.placement"


class PlacementTimeoutError(TimeoutError):
    """The cluster could not reserve the plan's bundles in time; the message lists what it lacks."""


@dataclass(frozen=True)
class NodeAddress:
    """The Ray node that holds one plan node's placement group."""

    node_id: str
    ip: str


def ray_share(share: float) -> float:
    """``share`` rounded down to Ray's resource resolution (1e-4), so colocated requests never sum above 1."""
    return round(math.floor(share / SHARE_RESOLUTION + 1e-6) * SHARE_RESOLUTION, 4)


def requested_bundles(plan: PlacementPlan, *, cpus_per_bundle: float) -> tuple[tuple[dict[str, float], ...], ...]:
    """Bundles per inventory node (empty for unused nodes): one ``{"GPU": 1, "CPU": c, **labels}`` per GPU."""
    bundles = []
    for node, used in enumerate(plan.bundles_per_node()):
        spec = plan.config.inventory.nodes[node]
        bundle = {"GPU": 1.0, "CPU": float(cpus_per_bundle), **{k: float(v) for k, v in spec.resources.items()}}
        bundles.append(tuple(dict(bundle) for _ in range(used)))
    return tuple(bundles)


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()) if v) + "}"


def _sum(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total


def shortfall_report(
    bundles: Sequence[Sequence[Mapping[str, float]]],
    pending: Sequence[int],
    *,
    cluster_total: Mapping[str, float],
    cluster_available: Mapping[str, float],
    nodes: Sequence[Mapping[str, Any]],
) -> str:
    """Say what the cluster lacks for the pending plan nodes.

    Args:
        bundles: requested bundles per plan node (see :func:`requested_bundles`).
        pending: plan nodes whose placement group was not ready.
        cluster_total, cluster_available: ``ray.cluster_resources()`` and ``ray.available_resources()``.
        nodes: ``ray.nodes()`` entries (``Alive``, ``NodeManagerAddress``, ``Resources``).
    """
    lines = []
    requested = _sum([bundle for node_bundles in bundles for bundle in node_bundles])
    for key, want in sorted(requested.items()):
        total, available = cluster_total.get(key, 0.0), cluster_available.get(key, 0.0)
        if want > available + _EPS:
            lines.append(f"{key}: plan requests {want:g}, cluster has {total:g} in total, {available:g} available now")
    alive = [node for node in nodes if node.get("Alive", True)]
    for node in pending:
        need = {key: value for key, value in _sum(bundles[node]).items() if value > 0}
        hosts = [
            n.get("NodeManagerAddress", "?")
            for n in alive
            if all(n.get("Resources", {}).get(k, 0.0) + _EPS >= v for k, v in need.items())
        ]
        biggest = sorted(alive, key=lambda n: -n.get("Resources", {}).get("GPU", 0.0))[:3]
        offers = "; ".join(
            f"{n.get('NodeManagerAddress', '?')} {_fmt({k: n.get('Resources', {}).get(k, 0.0) for k in need})}"
            for n in biggest
        )
        if hosts:
            lines.append(
                f"plan node {node} needs {_fmt(need)} on one Ray node; {hosts} could hold it but the resources are "
                "in use (other placement groups or actors)"
            )
        else:
            lines.append(f"plan node {node} needs {_fmt(need)} on one Ray node; no alive node has that ({offers})")
    return "\n  ".join(["cluster shortfall:", *lines])


def _probe(want_port: bool) -> tuple[str, str, int | None]:
    """Runs on a node inside a bundle: that node's id, IP and optionally a free TCP port (:func:`rlhfkit._ports.free_listen_port`)."""
    import ray

    from rlhfkit._ports import free_listen_port

    port = None
    if want_port:
        port = free_listen_port()
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port


class MaterializedPlan:
    """A plan's placement groups on a live Ray cluster, and the scheduling options for each (role, rank).

    Build it with :func:`materialize`; release it with :meth:`remove` (or use it as a context manager). Colocated
    roles share these groups, so removing them is separate from shutting down a worker group.
    """

    def __init__(self, plan: PlacementPlan, groups: Sequence[Any], *, cpus_per_bundle: float) -> None:
        self.plan = plan
        self.placement_groups = tuple(groups)
        self.cpus_per_bundle = cpus_per_bundle
        self._addresses: dict[int, NodeAddress] = {}
        self._removed = False

    def _check_live(self) -> None:
        if self._removed:
            raise RuntimeError("this MaterializedPlan's placement groups were removed; call materialize() again")

    def placement_group(self, role: str, rank: int) -> Any:
        """The Ray placement group holding ``rank`` of ``role`` (its node's group)."""
        self._check_live()
        return self.placement_groups[self.plan.rank(role, rank).node]

    def tp_bundle_indices(self, role: str, rank: int) -> tuple[int, ...]:
        """Bundle indices of the rank's GPUs (its TP group) in :meth:`placement_group`; one per TP worker."""
        return self.plan.rank(role, rank).bundle_indices

    def scheduling_strategy(self, role: str, rank: int, tp_index: int = 0) -> Any:
        """``PlacementGroupSchedulingStrategy`` pinned to the bundle of the rank's ``tp_index``-th GPU."""
        strategies = require("ray.util.scheduling_strategies", user=_USER)
        placement = self.plan.rank(role, rank)
        if isinstance(tp_index, bool) or not isinstance(tp_index, int) or not 0 <= tp_index < len(placement.gpus):
            raise ValueError(f"tp_index={tp_index!r} for {role!r} rank {rank}; it has {len(placement.gpus)} GPU(s)")
        return strategies.PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group(role, rank),
            placement_group_bundle_index=placement.gpus[tp_index],
            placement_group_capture_child_tasks=False,
        )

    def _check_cpus(self, num_cpus: float) -> None:
        if not 0 <= num_cpus <= self.cpus_per_bundle + _EPS:
            raise ValueError(
                f"num_cpus={num_cpus} does not fit a bundle of {self.cpus_per_bundle} CPUs; the actor could never be "
                "scheduled. Lower num_cpus or materialize with a larger cpus_per_bundle"
            )

    def actor_options(self, role: str, rank: int, *, num_gpus: float | None = None, num_cpus: float = 0.0) -> dict:
        """``.options(**...)`` for the process of ``rank``: on its first bundle, ``num_gpus`` = its share.

        A rank that spans several GPUs (a TP engine) defaults to ``num_gpus=0``: its TP workers take the share of each
        bundle (:meth:`tp_worker_options`), and the driver process must not take a slice of bundle 0 from them.
        """
        placement = self.plan.rank(role, rank)
        self._check_cpus(num_cpus)
        default = ray_share(placement.share) if len(placement.gpus) == 1 else 0.0
        if num_gpus is None:
            num_gpus = default
        elif not 0 <= num_gpus <= ray_share(placement.share) + _EPS:
            raise ValueError(
                f"num_gpus={num_gpus} for {role!r} rank {rank}; the plan gives it a share of {placement.share:.4g} "
                "per GPU; a larger request would not fit next to the colocated ranks"
            )
        return {"scheduling_strategy": self.scheduling_strategy(role, rank), "num_gpus": num_gpus,
                "num_cpus": num_cpus}

    def tp_worker_options(self, role: str, rank: int, tp_index: int, *, num_cpus: float = 0.0) -> dict:
        """``.options(**...)`` for TP worker ``tp_index`` of ``rank``: its own bundle, ``num_gpus`` = the share."""
        self._check_cpus(num_cpus)
        share = ray_share(self.plan.rank(role, rank).share)
        return {"scheduling_strategy": self.scheduling_strategy(role, rank, tp_index), "num_gpus": share,
                "num_cpus": num_cpus}

    def _run_probe(self, placement: RankPlacement, *, want_port: bool, timeout_s: float) -> tuple:
        ray = require("ray", user=_USER)
        self._check_live()
        options = self.actor_options(placement.role, placement.rank, num_gpus=0.0)
        ref = ray.remote(_probe).options(**options, name="rlhfkit_probe").remote(want_port)
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as error:
            ray.cancel(ref, force=True)
            raise TimeoutError(
                f"probing plan node {placement.node} (via {placement.role!r} rank {placement.rank}) took more than "
                f"{timeout_s} s; is the cluster overloaded?"
            ) from error

    def node_address(self, role: str, rank: int, *, timeout_s: float = 60.0) -> NodeAddress:
        """Ray node id and IP of the node holding ``rank`` of ``role`` (probed once per plan node, then cached)."""
        placement = self.plan.rank(role, rank)
        if placement.node not in self._addresses:
            node_id, ip, _ = self._run_probe(placement, want_port=False, timeout_s=timeout_s)
            self._addresses[placement.node] = NodeAddress(node_id=node_id, ip=ip)
        return self._addresses[placement.node]

    def free_port(self, role: str, rank: int, *, timeout_s: float = 60.0) -> int:
        """A TCP port that was free on the node of ``rank`` a moment ago (for MASTER_PORT)."""
        node_id, ip, port = self._run_probe(self.plan.rank(role, rank), want_port=True, timeout_s=timeout_s)
        self._addresses.setdefault(self.plan.rank(role, rank).node, NodeAddress(node_id=node_id, ip=ip))
        return int(port)

    def remove(self) -> None:
        """Remove every placement group of the plan (actors still in them are killed by Ray). Idempotent."""
        if self._removed:
            return
        pg_module = require("ray.util.placement_group", user=_USER)
        for group in self.placement_groups:
            if group is not None:
                pg_module.remove_placement_group(group)
        self._removed = True

    def __enter__(self) -> MaterializedPlan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _fail(ray: Any, plan: PlacementPlan, groups: list, bundles: tuple, pending: list[int], timeout_s: float) -> None:
    report = shortfall_report(
        bundles, pending, cluster_total=ray.cluster_resources(), cluster_available=ray.available_resources(),
        nodes=ray.nodes(),
    )
    MaterializedPlan(plan, groups, cpus_per_bundle=0.0).remove()
    raise PlacementTimeoutError(
        f"placement groups of plan node(s) {pending} were not ready after {timeout_s:g} s; removed all of this plan's "
        f"placement groups.\n  {report}"
    )


def materialize(
    plan: PlacementPlan, *, timeout_s: float = 300.0, cpus_per_bundle: float = 1.0, name: str | None = None
) -> MaterializedPlan:
    """Reserve the plan's GPUs as Ray placement groups (one STRICT_PACK group per used node) and wait for them.

    Args:
        plan: from :func:`~rlhfkit.placement.plan_placement`.
        timeout_s: how long to wait for the reservation; on timeout the groups are removed and a
            :class:`PlacementTimeoutError` lists what the cluster lacks.
        cpus_per_bundle: CPUs reserved with each GPU; the ranks colocated on a GPU share them.
        name: prefix of the placement group names (a random one by default).
    """
    ray = require("ray", user=_USER)
    pg_module = require("ray.util.placement_group", user=_USER)
    if not isinstance(plan, PlacementPlan):
        raise TypeError(f"materialize takes a PlacementPlan (from plan_placement), got {type(plan).__name__}")
    if not _check_real("materialize", "timeout_s", timeout_s) > 0:
        raise ValueError(f"timeout_s={timeout_s}; must be > 0")
    if not _check_real("materialize", "cpus_per_bundle", cpus_per_bundle) >= 0:
        raise ValueError(f"cpus_per_bundle={cpus_per_bundle}; must be >= 0")
    if not ray.is_initialized():
        raise RuntimeError("materialize needs a Ray connection; call rlhfkit.workers.ray_init() or ray.init() first")
    prefix = name or f"rlhfkit-{uuid.uuid4().hex[:8]}"
    bundles = requested_bundles(plan, cpus_per_bundle=cpus_per_bundle)
    groups: list = [
        pg_module.placement_group(list(node_bundles), strategy="STRICT_PACK", name=f"{prefix}-node{node}")
        if node_bundles else None
        for node, node_bundles in enumerate(bundles)
    ]
    waits = {group.ready(): node for node, group in enumerate(groups) if group is not None}
    start = time.monotonic()
    _, not_ready = ray.wait(list(waits), num_returns=len(waits), timeout=timeout_s)
    if not_ready:
        _fail(ray, plan, groups, bundles, sorted(waits[ref] for ref in not_ready), timeout_s)
    logger.info("placement groups of %d node(s) ready in %.2f s", len(waits), time.monotonic() - start)
    _warn_shared_ray_nodes(pg_module, groups)
    return MaterializedPlan(plan, groups, cpus_per_bundle=cpus_per_bundle)


def _warn_shared_ray_nodes(pg_module: Any, groups: Sequence[Any]) -> dict[str, list[int]]:
    """Warn when several plan nodes landed on one Ray node; returns Ray node id -> the plan nodes it holds.

    Nothing keeps two STRICT_PACK groups apart: a Ray node larger than the plan's nodes can take several of them.
    TP groups still stay inside one node; labels (``NodeSpec.resources``) pin plan nodes to machines.
    """
    held: dict[str, list[int]] = {}
    for node, group in enumerate(groups):
        if group is not None:
            ray_nodes = set(pg_module.placement_group_table(group)["bundles_to_node_id"].values())
            for ray_node in ray_nodes:
                held.setdefault(ray_node, []).append(node)
    for ray_node, nodes in held.items():
        if len(nodes) > 1:
            logger.warning(
                "plan nodes %s share one Ray node (%s): it has more GPUs than a plan node. TP groups still stay on "
                "one node; to give each plan node a machine of its own, label the nodes (NodeSpec.resources, "
                "`ray start --resources`) or plan gpus_per_node as the machines have", nodes, ray_node,
            )
    return held
