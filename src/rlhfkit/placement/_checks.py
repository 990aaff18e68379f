"""Validation, GPU assignment and table printing for :mod:`rlhfkit.placement` (pure Python, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.placement._plan import (
    _EPS,
    SHARE_RESOLUTION,
    PlacementConfig,
    PlacementPlan,
    RankPlacement,
    RoleSpec,
    lcm_of,
)

__all__ = ["check_config", "resolve_shares", "allocate", "format_table"]


@dataclass(frozen=True)
class _Unit:
    """Roles that get the same GPUs: one colocation group, or one role alone."""

    roles: tuple[RoleSpec, ...]
    num_gpus: int
    chunk: int  # GPUs that must sit together on one node (lcm of the roles' gpus_per_rank)
    label: str | None

    @property
    def name(self) -> str:
        return "+".join(role.name for role in self.roles)


def _units(config: PlacementConfig) -> list[_Unit]:
    grouped = {name for group in config.groups for name in group.roles}
    units = []
    for group in config.groups:
        roles = tuple(config.role(name) for name in group.roles)
        chunk = lcm_of([role.gpus_per_rank for role in roles])
        units.append(_Unit(roles, roles[0].num_gpus, chunk, roles[0].label))
    for role in config.roles:
        if role.name not in grouped:
            units.append(_Unit((role,), role.num_gpus, role.gpus_per_rank, role.label))
    order = {role.name: index for index, role in enumerate(config.roles)}
    units.sort(key=lambda unit: min(order[role.name] for role in unit.roles))
    return units


def _check_names(config: PlacementConfig) -> None:
    names = [role.name for role in config.roles]
    for role in config.roles:
        if not isinstance(role, RoleSpec):
            raise TypeError(f"PlacementConfig.roles must hold RoleSpec, got {type(role).__name__}")
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"PlacementConfig.roles: role name(s) {duplicates} appear more than once")
    seen: dict[str, int] = {}
    for index, group in enumerate(config.groups):
        for name in group.roles:
            if name not in names:
                raise ValueError(f"colocation group {list(group.roles)} names unknown role {name!r}; roles: {names}")
            if name in seen:
                raise ValueError(
                    f"role {name!r} is in colocation groups {seen[name]} and {index}; merge them into one group"
                )
            seen[name] = index


def _check_labels(config: PlacementConfig) -> None:
    offered = sorted({label for node in config.inventory.nodes for label in node.resources})
    for role in config.roles:
        if role.label is not None and role.label not in offered:
            raise ValueError(
                f"role {role.name!r} has label {role.label!r} but no inventory node offers it "
                f"(labels offered: {offered or 'none'}); add it to a NodeSpec.resources or fix the label"
            )


def _check_group_consistency(config: PlacementConfig) -> None:
    for group in config.groups:
        roles = [config.role(name) for name in group.roles]
        if len({role.num_gpus for role in roles}) > 1:
            counts = ", ".join(role.describe() for role in roles)
            hint = " (hybrid engine: the trainers' GPUs must equal engines x TP)" if config.hybrid else ""
            raise ValueError(
                f"colocated roles {list(group.roles)} must cover the same GPUs{hint}, got {counts}; "
                "give every role of the group the same number of GPUs"
            )
        if len({role.label for role in roles}) > 1:
            labels = ", ".join(f"{role.name}={role.label!r}" for role in roles)
            raise ValueError(f"colocated roles {list(group.roles)} have different labels ({labels}); they share GPUs")


def resolve_shares(config: PlacementConfig) -> dict[str, float]:
    """Each role's share of each of its GPUs; raises when colocated shares cannot all fit on one GPU."""
    shares: dict[str, float] = {}
    for unit in _units(config):
        explicit = {role.name: role.share for role in unit.roles if role.share is not None}
        unset = [role.name for role in unit.roles if role.share is None]
        total = sum(explicit.values())
        listing = ", ".join(f"{name}={share}" for name, share in explicit.items())
        if total > 1 + _EPS:
            raise ValueError(
                f"shares of roles sharing a GPU sum to {total:.4g} > 1 ({listing}); lower them so they fit on one GPU"
            )
        if unset:
            rest = (1.0 - total) / len(unset)
            if rest < SHARE_RESOLUTION:
                raise ValueError(
                    f"explicit shares ({listing}) leave {1.0 - total:.4g} of each GPU for roles {unset}, less than "
                    f"{SHARE_RESOLUTION} each; lower the explicit shares or set shares for {unset}"
                )
            explicit.update({name: rest for name in unset})
        shares.update(explicit)
    return shares


def _eligible(config: PlacementConfig, label: str | None) -> list[int]:
    return [i for i, node in enumerate(config.inventory.nodes) if label is None or label in node.resources]


def _check_fit(config: PlacementConfig) -> None:
    nodes = config.inventory.nodes
    units = _units(config)
    for unit in units:
        largest = max(nodes[i].num_gpus for i in _eligible(config, unit.label))
        if unit.chunk > largest:
            what = (
                f"role {unit.roles[0].name!r} has tensor_parallel_size={unit.chunk}"
                if len(unit.roles) == 1
                else f"colocated roles {unit.name} need blocks of {unit.chunk} GPUs on one node "
                f"(lcm of gpus_per_rank {[r.gpus_per_rank for r in unit.roles]})"
            )
            where = f" with label {unit.label!r}" if unit.label else ""
            raise ValueError(
                f"{what} but the largest node{where} has {largest} GPUs; a TP group cannot straddle nodes"
            )
    need = sum(unit.num_gpus for unit in units)
    if need > config.inventory.num_gpus:
        detail = ", ".join(f"{unit.name} {unit.num_gpus}" for unit in units)
        raise ValueError(
            f"roles need {need} GPUs ({detail}) but the inventory has {config.inventory.describe()}; "
            "add nodes, shrink roles or colocate them"
        )
    for label in sorted({unit.label for unit in units if unit.label is not None}):
        labelled = [unit for unit in units if unit.label == label]
        want = sum(unit.num_gpus for unit in labelled)
        have = sum(nodes[i].num_gpus for i in _eligible(config, label))
        if want > have:
            detail = ", ".join(f"{unit.name} {unit.num_gpus}" for unit in labelled)
            raise ValueError(f"roles with label {label!r} need {want} GPUs ({detail}) but nodes with it have {have}")


def check_config(config: PlacementConfig) -> None:
    """Every structural check; the GPU assignment itself happens in :func:`allocate`."""
    _check_names(config)
    _check_labels(config)
    _check_group_consistency(config)
    resolve_shares(config)
    _check_fit(config)


def _try_allocate(config: PlacementConfig, units: list[_Unit]) -> dict[str, list[tuple[int, int]]] | str:
    """First fit, node by node; returns role-unit name -> ordered (node, gpu) list, or why it failed."""
    nodes = config.inventory.nodes
    next_free = [0] * len(nodes)
    assigned: dict[str, list[tuple[int, int]]] = {}
    for unit in units:
        gpus: list[tuple[int, int]] = []
        while len(gpus) < unit.num_gpus:
            for index in _eligible(config, unit.label):
                fits = (nodes[index].num_gpus - next_free[index]) // unit.chunk * unit.chunk
                if fits:
                    take = min(fits, unit.num_gpus - len(gpus))
                    gpus.extend((index, next_free[index] + k) for k in range(take))
                    next_free[index] += take
                    break
            else:
                free = ", ".join(f"node{i} {nodes[i].num_gpus - next_free[i]}" for i in _eligible(config, unit.label))
                return (
                    f"cannot place {unit.name} ({unit.num_gpus} GPUs in blocks of {unit.chunk} inside one node): "
                    f"free GPUs on eligible nodes after earlier roles: {free}"
                )
        assigned[unit.name] = gpus
    return assigned


def allocate(config: PlacementConfig) -> dict[str, tuple[RankPlacement, ...]]:
    """Assign GPUs in declaration order; if blocks fragment, retry labelled and larger blocks first."""
    units = _units(config)
    result = _try_allocate(config, units)
    if isinstance(result, str):
        constrained = sorted(units, key=lambda u: (u.label is None, -u.chunk, -u.num_gpus))
        retry = _try_allocate(config, constrained)
        if isinstance(retry, str):
            raise ValueError(f"{result}; also tried labelled and larger blocks first: {retry}")
        result = retry
    shares = resolve_shares(config)
    placements: dict[str, tuple[RankPlacement, ...]] = {}
    for unit in units:
        gpus = result[unit.name]
        for role in unit.roles:
            ranks = []
            for rank in range(role.num_ranks):
                block = gpus[rank * role.gpus_per_rank : (rank + 1) * role.gpus_per_rank]
                assert len({node for node, _ in block}) == 1, f"TP group of {role.name} rank {rank} straddles nodes"
                ranks.append(
                    RankPlacement(
                        role=role.name, rank=rank, node=block[0][0], gpus=tuple(g for _, g in block),
                        share=shares[role.name],
                    )
                )
            placements[role.name] = tuple(ranks)
    return {role.name: placements[role.name] for role in config.roles}


def _cell(placement: RankPlacement, tp_index: int) -> str:
    who = str(placement.rank) if len(placement.gpus) == 1 else f"{placement.rank}/tp{tp_index}"
    return f"{who} ({placement.share:.2f})"


def format_table(plan: PlacementPlan) -> str:
    """One row per used GPU: which rank of which role lives there and with which share, and what is left."""
    config = plan.config
    names = [role.name for role in config.roles]
    header = ["node", "gpu", "labels", *names, "free"]
    rows = []
    for node, used in enumerate(plan.bundles_per_node()):
        for gpu in range(used):
            cells = {name: "-" for name in names}
            total = 0.0
            for placement, tp_index in plan.occupants(node, gpu):
                cells[placement.role] = _cell(placement, tp_index)
                total += placement.share
            labels = ",".join(config.inventory.nodes[node].labels) or "-"
            rows.append([str(node), str(gpu), labels, *(cells[n] for n in names), f"{max(0.0, 1 - total):.2f}"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    roles = ", ".join(role.describe() for role in config.roles)
    groups = "; ".join("+".join(group.roles) for group in config.groups) or "none"
    used = sum(plan.bundles_per_node())
    title = (
        f"PlacementPlan: {used} of {config.inventory.num_gpus} GPUs on {sum(1 for n in plan.bundles_per_node() if n)}"
        f" node(s); roles: {roles}; colocated: {groups}"
    )
    return "\n".join([title, *lines])
