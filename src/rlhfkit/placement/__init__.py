"""Placement: which rank of which role runs on which GPU, with which share — as pure, printable data.

What it does:
  * Describe roles (:class:`RoleSpec`; rollout engines as ``engines(num_engines, tensor_parallel_size)``), an
    :class:`Inventory` of nodes (optionally labelled with custom Ray resources such as ``{"h100": 1}``), and
    colocation groups (actor+reference, critic+reward, or ``hybrid=True``: every role on the same GPUs).
  * :func:`plan_placement` validates all of it and returns a frozen :class:`PlacementPlan`: for each role, per rank,
    the node, its GPUs (= bundle indices in that node's placement group; a TP group is contiguous on one node) and its
    share of each GPU. ``print(plan)`` shows one row per GPU. Every invalid request raises ``ValueError`` naming the
    roles and numbers, before anything starts.
  * :func:`plan_layout` builds the two standard layouts (colocated hybrid engine, or engines on GPUs of their own)
    over ``num_nodes`` x ``gpus_per_node`` GPUs in one call.
  * :func:`estimate_memory` gives a first-order per-GPU, per-phase memory budget and warns when a phase cannot fit.
  * :func:`materialize` (needs the ``ray`` extra) reserves the plan as Ray placement groups — one ``STRICT_PACK`` group
    per used node, one bundle per GPU — and :class:`MaterializedPlan` gives each (role, rank) its scheduling options:
    an explicit bundle index and a fractional ``num_gpus``, so colocated ranks share a GPU by construction.

What it does not do: start processes (see :mod:`rlhfkit.workers`), pick models, or measure memory.

Dependencies: importing this module needs nothing beyond the standard library; Ray is imported inside
:func:`materialize` and the :class:`MaterializedPlan` methods (``pip install 'rlhfkit[ray]'``).
"""

from __future__ import annotations

from rlhfkit.placement._layout import plan_layout
from rlhfkit.placement._memory import MemoryConfig, MemoryEstimate, MemoryFitError, ModelMemory, estimate_memory
from rlhfkit.placement._plan import (
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    SHARE_RESOLUTION,
    ColocationGroup,
    Inventory,
    NodeSpec,
    PlacementConfig,
    PlacementPlan,
    RankPlacement,
    RoleSpec,
    engines,
    plan_placement,
)
from rlhfkit.placement._ray import (
    MaterializedPlan,
    NodeAddress,
    PlacementTimeoutError,
    materialize,
    ray_share,
    requested_bundles,
    shortfall_report,
)

__all__ = [
    "MAX_GPUS",
    "MAX_GPUS_PER_NODE",
    "ColocationGroup",
    "Inventory",
    "MaterializedPlan",
    "MemoryConfig",
    "MemoryEstimate",
    "MemoryFitError",
    "ModelMemory",
    "NodeSpec",
    "PlacementConfig",
    "PlacementPlan",
    "PlacementTimeoutError",
    "RankPlacement",
    "RoleSpec",
    "engines",
    "estimate_memory",
    "materialize",
    "plan_layout",
    "plan_placement",
    "ray_share",
]
