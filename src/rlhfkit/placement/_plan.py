"""The pure-data half of :mod:`rlhfkit.placement`: roles, inventory, colocation, and the plan that maps them.

Nothing here imports Ray; a plan is built, validated and printed on any machine. See :mod:`rlhfkit.placement` for the
public description.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "RoleSpec",
    "NodeSpec",
    "Inventory",
    "ColocationGroup",
    "PlacementConfig",
    "RankPlacement",
    "PlacementPlan",
    "engines",
    "plan_placement",
    "SHARE_RESOLUTION",
    "MAX_GPUS",
    "MAX_GPUS_PER_NODE",
]

# Ray stores fractional resources with 4 decimals; a share below this cannot be requested.
SHARE_RESOLUTION = 1e-4
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
_EPS = 1e-9
# Sanity bounds, far above any real cluster, checked before any per-GPU list is built: a typo such as
# num_gpus=10**12 would otherwise allocate for minutes and run out of memory instead of raising.
MAX_GPUS = 1 << 17  # GPUs of one role, one inventory, and nodes of one inventory
MAX_GPUS_PER_NODE = 1024  # GPUs (Ray GPU resources) of one node; also bounds a rank's TP size


def _check_count(owner: str, name: str, value: object, *, minimum: int = 1, maximum: int = MAX_GPUS) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{owner}.{name}={value}; must be >= {minimum}")
    if value > maximum:
        raise ValueError(
            f"{owner}.{name}={value} is above the sanity bound {maximum}; is it a typo? (rlhfkit plans at most "
            f"{MAX_GPUS} GPUs and {MAX_GPUS_PER_NODE} GPUs per node)"
        )


def _check_real(owner: str, name: str, value: object) -> float:
    """``value`` as a finite float; bool, strings and other non-numbers raise TypeError, inf/NaN ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}.{name} must be a number (int or float), got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{owner}.{name}={value!r}; must be a finite number")
    return float(value)


def _check_name(owner: str, value: object, *, example: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{owner} must be a str, got {value!r} ({type(value).__name__}); e.g. {example!r}")


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """One role of a run: ``num_gpus`` GPUs split into ranks of ``gpus_per_rank`` GPUs each.

    A rank that spans several GPUs (a tensor-parallel rollout engine) gets contiguous GPUs of one node.

    Attributes:
        name: role name, e.g. ``"actor"``, ``"critic"``, ``"reward"``, ``"reference"``, ``"rollout"``, or your own.
        num_gpus: GPUs the role occupies in total (``num_ranks * gpus_per_rank``).
        gpus_per_rank: GPUs per rank; the tensor-parallel size of an engine, 1 for a data-parallel trainer.
        share: fraction of each of its GPUs the role requests from Ray (``num_gpus`` of the actor). None: 1.0 alone,
            or an equal split of what colocated roles with explicit shares leave.
        label: a custom resource name (e.g. ``"h100"``); the role goes only to inventory nodes that offer it.
    """

    name: str
    num_gpus: int
    gpus_per_rank: int = 1
    share: float | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        _check_name("RoleSpec.name", self.name, example="actor")
        if not _NAME_RE.match(self.name):
            raise ValueError(f"RoleSpec.name={self.name!r}; use letters, digits, '_', '-', '.' (e.g. 'actor')")
        owner = f"RoleSpec(name={self.name!r})"
        _check_count(owner, "num_gpus", self.num_gpus)
        _check_count(owner, "gpus_per_rank", self.gpus_per_rank, maximum=MAX_GPUS_PER_NODE)
        if self.share is not None:
            _check_real(owner, "share", self.share)
        if self.label is not None:
            _check_name(f"{owner}.label", self.label, example="h100")
        if self.num_gpus % self.gpus_per_rank:
            raise ValueError(
                f"tensor_parallel_size (gpus_per_rank)={self.gpus_per_rank} does not divide the {self.num_gpus} GPUs "
                f"of role {self.name!r}; use a num_gpus that is a multiple of it"
            )
        if self.share is not None and not (SHARE_RESOLUTION <= self.share <= 1.0):
            raise ValueError(
                f"RoleSpec(name={self.name!r}).share={self.share}; must be in [{SHARE_RESOLUTION}, 1] "
                "(a fraction of one GPU that Ray can reserve)"
            )
        if self.label is not None and (not isinstance(self.label, str) or not self.label):
            raise ValueError(f"RoleSpec(name={self.name!r}).label={self.label!r}; give a resource name or None")

    @property
    def num_ranks(self) -> int:
        return self.num_gpus // self.gpus_per_rank

    def describe(self) -> str:
        if self.gpus_per_rank == 1:
            return f"{self.name}={self.num_gpus}"
        return f"{self.name}={self.num_gpus} ({self.num_ranks} x tensor_parallel_size {self.gpus_per_rank})"


def engines(
    num_engines: int,
    tensor_parallel_size: int = 1,
    *,
    name: str = "rollout",
    share: float | None = None,
    label: str | None = None,
) -> RoleSpec:
    """The role of ``num_engines`` rollout engines of ``tensor_parallel_size`` GPUs each."""
    _check_count("engines", "num_engines", num_engines)
    _check_count("engines", "tensor_parallel_size", tensor_parallel_size, maximum=MAX_GPUS_PER_NODE)
    return RoleSpec(
        name=name, num_gpus=num_engines * tensor_parallel_size, gpus_per_rank=tensor_parallel_size,
        share=share, label=label,
    )


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """One node of the inventory.

    Attributes:
        num_gpus: GPUs on the node.
        resources: custom Ray resources each GPU bundle on this node requests, e.g. ``{"h100": 1}``. Start the node
            with at least ``num_gpus`` of each (``ray start --resources='{"h100": 8}'``). The keys are the node's
            labels.
    """

    num_gpus: int
    resources: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_count("NodeSpec", "num_gpus", self.num_gpus, maximum=MAX_GPUS_PER_NODE)
        if not isinstance(self.resources, Mapping):
            raise TypeError(
                f"NodeSpec.resources must be a mapping of resource name to amount, got {self.resources!r} "
                f"({type(self.resources).__name__}); e.g. resources={{'h100': 1}}"
            )
        for key, amount in dict(self.resources).items():
            _check_name("NodeSpec.resources key", key, example="h100")
            if not key or key in ("GPU", "CPU", "memory", "object_store_memory"):
                raise ValueError(f"NodeSpec.resources key {key!r}; use a custom resource name such as 'h100'")
            if not _check_real("NodeSpec", f"resources[{key!r}]", amount) > 0:
                raise ValueError(f"NodeSpec.resources[{key!r}]={amount!r}; must be a positive number (e.g. 1)")
        object.__setattr__(self, "resources", MappingProxyType(dict(self.resources)))

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(sorted(self.resources))


@dataclass(frozen=True, kw_only=True)
class Inventory:
    """The GPUs a plan may use: explicit ``nodes``; :meth:`uniform` builds ``num_nodes`` x ``gpus_per_node``."""

    nodes: tuple[NodeSpec, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, tuple):
            raise TypeError(
                f"Inventory.nodes must be a tuple of NodeSpec, got {type(self.nodes).__name__}; "
                "e.g. nodes=(NodeSpec(num_gpus=8),)"
            )
        if not self.nodes:
            raise ValueError("Inventory.nodes is empty; give a non-empty tuple of NodeSpec")
        for index, node in enumerate(self.nodes):
            if not isinstance(node, NodeSpec):
                raise TypeError(f"Inventory.nodes[{index}] must be a NodeSpec, got {type(node).__name__}")
        if self.num_gpus > MAX_GPUS:
            raise ValueError(
                f"Inventory has {self.num_gpus} GPUs, above the sanity bound {MAX_GPUS}; is a count a typo?"
            )

    @classmethod
    def uniform(cls, *, num_nodes: int, gpus_per_node: int, resources: Mapping[str, float] | None = None) -> Inventory:
        _check_count("Inventory.uniform", "num_nodes", num_nodes)
        _check_count("Inventory.uniform", "gpus_per_node", gpus_per_node, maximum=MAX_GPUS_PER_NODE)
        if num_nodes * gpus_per_node > MAX_GPUS:
            raise ValueError(
                f"Inventory.uniform: num_nodes={num_nodes} x gpus_per_node={gpus_per_node} = "
                f"{num_nodes * gpus_per_node} GPUs, above the sanity bound {MAX_GPUS}; is a count a typo?"
            )
        return cls(nodes=tuple(NodeSpec(num_gpus=gpus_per_node, resources=resources or {}) for _ in range(num_nodes)))

    @property
    def num_gpus(self) -> int:
        return sum(node.num_gpus for node in self.nodes)

    def describe(self) -> str:
        parts = []
        for index, node in enumerate(self.nodes):
            labels = f" [{', '.join(node.labels)}]" if node.labels else ""
            parts.append(f"node{index}: {node.num_gpus}{labels}")
        return f"{len(self.nodes)} node(s), {self.num_gpus} GPUs ({'; '.join(parts)})"


@dataclass(frozen=True, kw_only=True)
class ColocationGroup:
    """Roles that time-share the same GPUs: rank ``i`` of each role lands on the same GPU(s) as the others' rank i."""

    roles: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.roles, tuple):
            raise TypeError(
                f"ColocationGroup.roles must be a tuple of role names, got {self.roles!r} "
                f"({type(self.roles).__name__}); e.g. roles=('actor', 'reference')"
            )
        for name in self.roles:
            _check_name(f"ColocationGroup.roles={self.roles!r}: each role name", name, example="actor")
        if len(self.roles) < 2:
            raise ValueError(f"ColocationGroup.roles={self.roles!r}; give a tuple of at least two role names")
        if len(set(self.roles)) != len(self.roles):
            raise ValueError(f"ColocationGroup.roles={self.roles!r} names a role twice")


def _colocation_groups(colocate: object) -> tuple[ColocationGroup, ...]:
    """``PlacementConfig.colocate`` as groups; a flat tuple of names (a common slip) raises with the right shape."""
    shape = "a tuple of groups, e.g. colocate=(('actor', 'reference'),) or colocate=(ColocationGroup(roles=(...)),)"
    if not isinstance(colocate, tuple):
        raise TypeError(f"PlacementConfig.colocate must be {shape}; got {colocate!r} ({type(colocate).__name__})")
    if any(isinstance(group, str) for group in colocate):
        raise TypeError(
            f"PlacementConfig.colocate={colocate!r} is a flat tuple of role names; it must be {shape}. "
            f"Write colocate=({colocate!r},)"
        )
    groups = []
    for index, group in enumerate(colocate):
        if isinstance(group, ColocationGroup):
            groups.append(group)
        elif isinstance(group, (tuple, list)):
            groups.append(ColocationGroup(roles=tuple(group)))
        else:
            raise TypeError(
                f"PlacementConfig.colocate[{index}]={group!r} ({type(group).__name__}); each group must be a tuple "
                f"of role names or a ColocationGroup: {shape}"
            )
    return tuple(groups)


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """What to place where: roles, the inventory, and which roles share GPUs.

    Attributes:
        roles: the roles, in the order their GPUs are assigned.
        inventory: the nodes and GPUs available.
        colocate: groups of roles that share GPUs, e.g. ``(("actor", "reference"), ("critic", "reward"))``.
        hybrid: every role shares the same GPUs (the hybrid engine); excludes ``colocate``.
    """

    roles: tuple[RoleSpec, ...]
    inventory: Inventory
    colocate: tuple[ColocationGroup | tuple[str, ...], ...] = ()
    hybrid: bool = False

    def __post_init__(self) -> None:
        from rlhfkit.placement._checks import check_config

        if not isinstance(self.roles, tuple):
            raise TypeError(
                f"PlacementConfig.roles must be a tuple of RoleSpec, got {type(self.roles).__name__}; "
                "e.g. roles=(RoleSpec(name='actor', num_gpus=8),)"
            )
        if not self.roles:
            raise ValueError("PlacementConfig.roles is empty; give a non-empty tuple of RoleSpec")
        if not isinstance(self.inventory, Inventory):
            raise TypeError(
                f"PlacementConfig.inventory must be an Inventory, got {self.inventory!r} "
                f"({type(self.inventory).__name__}); e.g. Inventory.uniform(num_nodes=1, gpus_per_node=8)"
            )
        if not isinstance(self.hybrid, bool):
            raise TypeError(
                f"PlacementConfig.hybrid must be a bool, got {self.hybrid!r} ({type(self.hybrid).__name__})"
            )
        groups = _colocation_groups(self.colocate)
        if self.hybrid and groups:
            raise ValueError("PlacementConfig: hybrid=True already colocates every role; leave colocate empty")
        if self.hybrid:
            if len(self.roles) < 2:
                raise ValueError("PlacementConfig.hybrid=True needs at least two roles to colocate")
            groups = (ColocationGroup(roles=tuple(role.name for role in self.roles)),)
        object.__setattr__(self, "colocate", groups)
        check_config(self)

    def role(self, name: str) -> RoleSpec:
        for role in self.roles:
            if role.name == name:
                return role
        raise ValueError(f"unknown role {name!r}; the plan has roles {[r.name for r in self.roles]}")

    @property
    def groups(self) -> tuple[ColocationGroup, ...]:
        """The colocation groups (after ``hybrid`` expansion); typed view of ``colocate``."""
        return self.colocate  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class RankPlacement:
    """Where one rank of a role lives.

    Attributes:
        role, rank: which rank of which role.
        node: index into ``Inventory.nodes``; each node becomes one Ray placement group.
        gpus: local GPU indices on that node, one per GPU of the rank (its TP group), contiguous. They are also the
            bundle indices in that node's placement group.
        share: fraction of each of these GPUs the rank's process (or each TP worker) requests.
    """

    role: str
    rank: int
    node: int
    gpus: tuple[int, ...]
    share: float

    @property
    def bundle_indices(self) -> tuple[int, ...]:
        return self.gpus


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    """A validated mapping of every rank of every role to GPUs; build it with :func:`plan_placement`."""

    config: PlacementConfig
    placements: Mapping[str, tuple[RankPlacement, ...]]

    def ranks(self, role: str) -> tuple[RankPlacement, ...]:
        if role not in self.placements:
            raise ValueError(f"unknown role {role!r}; the plan has roles {list(self.placements)}")
        return self.placements[role]

    def rank(self, role: str, rank: int) -> RankPlacement:
        ranks = self.ranks(role)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(ranks):
            raise ValueError(f"rank={rank!r} of role {role!r}; the role has ranks 0..{len(ranks) - 1}")
        return ranks[rank]

    def bundles_per_node(self) -> tuple[int, ...]:
        """GPUs (= bundles) the plan uses on each inventory node; a used node's GPUs are always 0..k-1."""
        used = [0] * len(self.config.inventory.nodes)
        for ranks in self.placements.values():
            for placement in ranks:
                used[placement.node] = max(used[placement.node], max(placement.gpus) + 1)
        return tuple(used)

    def occupants(self, node: int, gpu: int) -> tuple[tuple[RankPlacement, int], ...]:
        """``(placement, tp_index)`` of every rank with a process on GPU ``gpu`` of ``node``."""
        found = []
        for ranks in self.placements.values():
            for placement in ranks:
                if placement.node == node and gpu in placement.gpus:
                    found.append((placement, placement.gpus.index(gpu)))
        return tuple(found)

    def table(self) -> str:
        from rlhfkit.placement._checks import format_table

        return format_table(self)

    def __str__(self) -> str:
        return self.table()


def plan_placement(config: PlacementConfig) -> PlacementPlan:
    """Assign GPUs to every rank of every role; raises ValueError (naming roles and numbers) when it cannot."""
    from rlhfkit.placement._checks import allocate

    if not isinstance(config, PlacementConfig):
        raise TypeError(f"plan_placement takes a PlacementConfig, got {type(config).__name__}")
    return PlacementPlan(config=config, placements=MappingProxyType(allocate(config)))


def lcm_of(values: Sequence[int]) -> int:
    result = 1
    for value in values:
        result = result * value // math.gcd(result, value)
    return result
