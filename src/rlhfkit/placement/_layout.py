"""The two standard RLHF layouts as one call: :func:`plan_layout` (pure Python, no Ray).

Colocated (the hybrid engine): every trainer role and the rollout engines share every GPU. Separated: the engines get
``engine_gpus`` GPUs of their own, the trainer roles (colocated with each other) the rest. Both go through
:func:`~rlhfkit.placement.plan_placement`, so a TP group never straddles a node and every invalid request raises
``ValueError`` before anything starts. :class:`~rlhfkit.hybrid.HybridConfig` builds its plan with this function.
"""

from __future__ import annotations

from rlhfkit.placement._plan import (
    MAX_GPUS_PER_NODE,
    Inventory,
    PlacementConfig,
    PlacementPlan,
    RoleSpec,
    _check_count,
    engines,
    plan_placement,
)

__all__ = ["plan_layout"]


def plan_layout(
    *,
    num_nodes: int,
    gpus_per_node: int,
    colocate: bool = True,
    engine_gpus: int | None = None,
    tensor_parallel_size: int = 1,
    trainer_roles: tuple[str, ...] = ("actor", "reference"),
    engine_role: str = "rollout",
) -> PlacementPlan:
    """The plan of an RLHF run on ``num_nodes`` x ``gpus_per_node`` GPUs; ``print()`` it to see the table.

    Args:
        num_nodes, gpus_per_node: a uniform inventory (no labels).
        colocate: True: trainers and engines on the same GPUs (``engine_gpus`` must be None); False: the engines on
            ``engine_gpus`` GPUs of their own (a multiple of ``tensor_parallel_size``), the trainers on the rest.
        tensor_parallel_size: GPUs per rollout engine; each engine's GPUs are contiguous on one node.
        trainer_roles: the trainer roles, each on every trainer GPU (one rank per GPU), colocated with each other.
        engine_role: name of the engine role (one rank per engine).
    """
    _check_count("plan_layout", "num_nodes", num_nodes)
    _check_count("plan_layout", "gpus_per_node", gpus_per_node, maximum=MAX_GPUS_PER_NODE)
    _check_count("plan_layout", "tensor_parallel_size", tensor_parallel_size, maximum=MAX_GPUS_PER_NODE)
    if not isinstance(colocate, bool):
        raise TypeError(f"plan_layout: colocate={colocate!r} ({type(colocate).__name__}); must be True or False")
    if isinstance(trainer_roles, str) or not isinstance(trainer_roles, tuple) or not trainer_roles:
        raise TypeError(f"plan_layout: trainer_roles={trainer_roles!r}; give a non-empty tuple of role names, "
                        "e.g. ('actor', 'reference')")
    total, tp = num_nodes * gpus_per_node, tensor_parallel_size
    if colocate:
        if engine_gpus is not None:
            raise ValueError(f"plan_layout(colocate=True) puts the engines on all {total} GPUs; got "
                             f"engine_gpus={engine_gpus!r}: leave it None, or pass colocate=False")
        if total % tp:
            raise ValueError(f"plan_layout: tensor_parallel_size={tp} does not divide the {total} GPUs "
                             f"({num_nodes} node(s) x {gpus_per_node}); the colocated engines cover every GPU")
        trainer_gpus, engine_gpus = total, total
    else:
        if engine_gpus is None:
            raise ValueError("plan_layout(colocate=False) needs engine_gpus, the GPUs the engines get for themselves")
        _check_count("plan_layout", "engine_gpus", engine_gpus)
        if not (engine_gpus < total and engine_gpus % tp == 0):
            raise ValueError(f"plan_layout(colocate=False): engine_gpus={engine_gpus} must be below the {total} GPUs "
                             f"(the trainers need some) and a multiple of tensor_parallel_size={tp}")
        trainer_gpus = total - engine_gpus
    roles = tuple(RoleSpec(name=name, num_gpus=trainer_gpus) for name in trainer_roles)
    roles += (engines(engine_gpus // tp, tp, name=engine_role),)
    inventory = Inventory.uniform(num_nodes=num_nodes, gpus_per_node=gpus_per_node)
    if colocate:
        return plan_placement(PlacementConfig(roles=roles, inventory=inventory, hybrid=True))
    groups = (tuple(trainer_roles),) if len(trainer_roles) > 1 else ()
    return plan_placement(PlacementConfig(roles=roles, inventory=inventory, colocate=groups))
