"""A per-GPU, per-phase memory estimate for a :class:`~rlhfkit.placement.PlacementPlan` (pure arithmetic).

The estimate is a first-order budget, not a measurement: weights, gradients and optimizer states from parameter
counts, ZeRO sharding over a role's ranks, a fixed engine budget (vLLM's ``gpu_memory_utilization``), a CUDA context per
process, and the activation peak you supply. It warns when a phase cannot fit or an engine's weights leave it no KV
cache; :meth:`MemoryEstimate.check_fit` turns either into a :class:`MemoryFitError` for launchers that refuse.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from rlhfkit.placement._plan import PlacementPlan, _check_name, _check_real

__all__ = ["ModelMemory", "MemoryConfig", "MemoryEstimate", "MemoryFitError", "estimate_memory"]

logger = logging.getLogger(__name__)
_GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class ModelMemory:
    """The memory-relevant facts of one role's model.

    Attributes:
        num_params: parameter count.
        kind: ``"trainable"`` (weights + grads + optimizer), ``"frozen"`` (weights only: reference, reward) or
            ``"engine"`` (a rollout engine that takes a fixed fraction of the GPU when awake).
        bytes_per_param: bytes of one weight on GPU (2 for bf16).
        grad_bytes_per_param: bytes of one gradient (trainable only).
        optimizer_bytes_per_param: bytes of optimizer state per parameter (trainable only); 12 = fp32 master copy +
            Adam's two moments.
        zero_stage: DeepSpeed ZeRO stage; shards optimizer states (>= 1), gradients (>= 2) and weights (3) over the
            role's ranks.
        activation_gib: peak activation memory per rank while awake, from your own measurement.
        num_trainable_params: parameters that get gradients and optimizer states (LoRA: the adapters); None: all.
        offload_optimizer: fp32 master weights and optimizer states live in host memory (ZeRO-Offload).
        offload_params: ZeRO-3 weight shards live in host memory (ZeRO-Infinity; the gathered working set belongs
            in ``activation_gib``).
        engine_gib: an engine's GiB while awake when it is not a fraction of the GPU (rlhfkit's HF engine); None:
            ``MemoryConfig.engine_memory_fraction`` of the GPU.
    """

    num_params: int
    kind: Literal["trainable", "frozen", "engine"] = "frozen"
    bytes_per_param: float = 2.0
    grad_bytes_per_param: float = 2.0
    optimizer_bytes_per_param: float = 12.0
    zero_stage: int = 0
    activation_gib: float = 0.0
    num_trainable_params: int | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    engine_gib: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_params, bool) or not isinstance(self.num_params, int):
            raise TypeError(
                f"ModelMemory.num_params must be an int, got {self.num_params!r} ({type(self.num_params).__name__})"
            )
        if self.num_params < 1:
            raise ValueError(f"ModelMemory.num_params={self.num_params!r}; give the parameter count (int >= 1)")
        _check_name("ModelMemory.kind", self.kind, example="trainable")
        if self.kind not in ("trainable", "frozen", "engine"):
            raise ValueError(f"ModelMemory.kind={self.kind!r}; use 'trainable', 'frozen' or 'engine'")
        for name in ("bytes_per_param", "grad_bytes_per_param", "optimizer_bytes_per_param", "activation_gib"):
            if not _check_real("ModelMemory", name, getattr(self, name)) >= 0:
                raise ValueError(f"ModelMemory.{name}={getattr(self, name)}; must be >= 0")
        if isinstance(self.zero_stage, bool) or not isinstance(self.zero_stage, int):
            raise TypeError(
                f"ModelMemory.zero_stage must be an int (0, 1, 2 or 3), got {self.zero_stage!r} "
                f"({type(self.zero_stage).__name__})"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ModelMemory.zero_stage={self.zero_stage!r}; use 0, 1, 2 or 3")
        trainable = self.num_trainable_params
        if trainable is not None and (isinstance(trainable, bool) or not isinstance(trainable, int)
                                      or not 0 <= trainable <= self.num_params):
            raise ValueError(f"ModelMemory.num_trainable_params={trainable!r}; an int in [0, num_params="
                             f"{self.num_params}] or None (all)")
        for name in ("offload_optimizer", "offload_params"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModelMemory.{name}={getattr(self, name)!r}; must be True or False")
        if self.engine_gib is not None and not _check_real("ModelMemory", "engine_gib", self.engine_gib) >= 0:
            raise ValueError(f"ModelMemory.engine_gib={self.engine_gib}; must be >= 0 or None")


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """How to estimate.

    Attributes:
        gpu_memory_gib: memory of one GPU.
        engine_memory_fraction: the fraction of a GPU an awake engine takes (vLLM ``gpu_memory_utilization``),
            weights and KV cache included.
        context_gib: CUDA context and allocator overhead of each process on a GPU, paid in every phase, asleep or not.
        phases: phase name -> roles awake in it. Roles that share no GPU are awake in every phase. None: one phase per
            colocated role with only that role awake (``"all"`` when nothing is colocated). Add a weight-sync phase
            yourself, e.g. ``{"sync": ("actor", "rollout")}``.
    """

    gpu_memory_gib: float = 80.0
    engine_memory_fraction: float = 0.5
    context_gib: float = 0.5
    phases: Mapping[str, tuple[str, ...]] | None = None

    def __post_init__(self) -> None:
        if not _check_real("MemoryConfig", "gpu_memory_gib", self.gpu_memory_gib) > 0:
            raise ValueError(f"MemoryConfig.gpu_memory_gib={self.gpu_memory_gib}; must be > 0")
        if not 0 < _check_real("MemoryConfig", "engine_memory_fraction", self.engine_memory_fraction) <= 1:
            raise ValueError(f"MemoryConfig.engine_memory_fraction={self.engine_memory_fraction}; must be in (0, 1]")
        if not _check_real("MemoryConfig", "context_gib", self.context_gib) >= 0:
            raise ValueError(f"MemoryConfig.context_gib={self.context_gib}; must be >= 0")
        if self.phases is not None:
            object.__setattr__(self, "phases", MappingProxyType(_checked_phases(self.phases)))


def _checked_phases(phases: object) -> dict[str, tuple[str, ...]]:
    shape = "a mapping of phase name to a tuple of role names, e.g. phases={'train': ('actor',)}"
    if not isinstance(phases, Mapping):
        raise TypeError(f"MemoryConfig.phases must be {shape}; got {phases!r} ({type(phases).__name__})")
    if not phases:
        raise ValueError("MemoryConfig.phases is empty; give at least one phase or None")
    checked = {}
    for phase, roles in phases.items():
        _check_name("MemoryConfig.phases key", phase, example="train")
        if not isinstance(roles, (tuple, list)):
            raise TypeError(
                f"MemoryConfig.phases[{phase!r}]={roles!r} ({type(roles).__name__}); it must be {shape}"
                + (f". Write ({roles!r},)" if isinstance(roles, str) else "")
            )
        for role in roles:
            _check_name(f"MemoryConfig.phases[{phase!r}]: each role name", role, example="actor")
        checked[phase] = tuple(roles)
    return checked


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """GiB per GPU per phase, with the per-role breakdown, and a warning for every phase that does not fit.

    ``engine_shortfalls``: one :class:`MemoryFitError` per engine role whose weights fill its
    ``engine_memory_fraction`` of the GPU (no room for a KV cache), named by the first phase it is awake in;
    :meth:`check_fit` raises for the first of them, and ``warnings`` carries their messages.
    """

    phases: tuple[str, ...]
    gpu_memory_gib: float
    per_gpu: Mapping[tuple[int, int], Mapping[str, float]]
    breakdown: Mapping[tuple[int, int], Mapping[str, Mapping[str, float]]]
    warnings: tuple[str, ...] = field(default_factory=tuple)
    engine_shortfalls: tuple[MemoryFitError, ...] = field(default_factory=tuple)

    def peak(self) -> float:
        return max(value for phases in self.per_gpu.values() for value in phases.values())

    def table(self) -> str:
        header = ["node", "gpu", *self.phases]
        rows = []
        for (node, gpu), phases in self.per_gpu.items():
            marks = [f"{phases[p]:.1f}{' !' if phases[p] > self.gpu_memory_gib else ''}" for p in self.phases]
            rows.append([str(node), str(gpu), *marks])
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
        return "\n".join([f"GiB per GPU per phase (of {self.gpu_memory_gib:g}; ! = does not fit)", *lines])

    def __str__(self) -> str:
        return self.table()

    def check_fit(self, *, what: str = "this plan") -> None:
        """Raise :class:`MemoryFitError` for an engine share that leaves no room for a KV cache (the first of
        ``engine_shortfalls``), else naming the phase, the GPU, what it needs, the shortfall in GiB and each role's
        share, for the worst phase that does not fit; nothing when every phase fits."""
        if self.engine_shortfalls:
            first = self.engine_shortfalls[0]
            raise MemoryFitError(f"{what} does not fit: {first}", phase=first.phase,
                                 shortfall_gib=first.shortfall_gib)
        worst = None
        for (node, gpu), phases in self.per_gpu.items():
            for phase, total in phases.items():
                if total > self.gpu_memory_gib and (worst is None or total > worst[0]):
                    worst = (total, phase, node, gpu)
        if worst is None:
            return
        total, phase, node, gpu = worst
        parts = ", ".join(f"{role} {gib:.1f}" for role, gib in self.breakdown[(node, gpu)][phase].items())
        raise MemoryFitError(
            f"{what} does not fit: phase {phase!r} needs ~{total:.1f} GiB on node{node} gpu{gpu} ({parts} GiB) but "
            f"the GPU has {self.gpu_memory_gib:.1f} GiB: short by {total - self.gpu_memory_gib:.1f} GiB. Shrink that "
            "phase: ZeRO-3 over more GPUs, offload_optimizer / offload_params, gradient_checkpointing, a smaller "
            "micro_batch_tokens, LoRA, a smaller engine share; or a bigger GPU",
            phase=phase, shortfall_gib=total - self.gpu_memory_gib)


class MemoryFitError(ValueError):
    """A plan whose memory estimate exceeds a GPU in some phase; ``phase`` and ``shortfall_gib`` say where and how
    much."""

    def __init__(self, message: str, *, phase: str, shortfall_gib: float) -> None:
        super().__init__(message)
        self.phase, self.shortfall_gib = phase, shortfall_gib


def _awake_gib(plan: PlacementPlan, role: str, model: ModelMemory, config: MemoryConfig) -> float:
    """GiB one rank of ``role`` holds on each of its GPUs while awake (context excluded)."""
    spec = plan.config.role(role)
    world = spec.num_ranks
    if model.kind == "engine":
        if model.engine_gib is not None:
            return model.engine_gib / spec.gpus_per_rank
        return config.engine_memory_fraction * config.gpu_memory_gib
    weights = model.num_params * model.bytes_per_param / spec.gpus_per_rank / (world if model.zero_stage == 3 else 1)
    total = (0.0 if model.offload_params else weights) + model.activation_gib * _GIB
    if model.kind == "trainable":
        trainable = model.num_params if model.num_trainable_params is None else model.num_trainable_params
        total += trainable * model.grad_bytes_per_param / (world if model.zero_stage >= 2 else 1)
        if not model.offload_optimizer:
            total += trainable * model.optimizer_bytes_per_param / (world if model.zero_stage >= 1 else 1)
    return total / _GIB


def _default_phases(plan: PlacementPlan) -> dict[str, tuple[str, ...]]:
    colocated = [name for group in plan.config.groups for name in group.roles]
    if not colocated:
        return {"all": tuple(role.name for role in plan.config.roles)}
    return {name: (name,) for name in colocated}


def _engine_shortfalls(plan: PlacementPlan, models: Mapping[str, ModelMemory], config: MemoryConfig,
                       phases: Mapping[str, tuple[str, ...]], colocated: set[str]) -> list[MemoryFitError]:
    """An engine that takes ``engine_memory_fraction`` of the GPU (vLLM, SGLang) holds its weights and KV cache in
    it: weights that fill it leave no KV cache, whatever the other roles hold."""
    shortfalls = []
    budget = config.engine_memory_fraction * config.gpu_memory_gib
    for role, model in models.items():
        if model.kind != "engine" or model.engine_gib is not None:
            continue
        weights = model.num_params * model.bytes_per_param / plan.config.role(role).gpus_per_rank / _GIB
        awake = [phase for phase, roles in phases.items() if role in roles or role not in colocated]
        if weights >= budget and awake:
            shortfalls.append(MemoryFitError(
                f"phase {awake[0]!r}: engine role {role!r}: weights need {weights:.1f} GiB per GPU but "
                f"engine_memory_fraction={config.engine_memory_fraction} of {config.gpu_memory_gib:.1f} GiB gives "
                f"{budget:.1f} GiB, leaving no KV cache: short by {weights - budget:.1f} GiB at least. Raise "
                "engine_memory_fraction (HybridConfig.engine_memory), use bfloat16 weights, or tensor parallelism",
                phase=awake[0], shortfall_gib=weights - budget))
    return shortfalls


def estimate_memory(plan: PlacementPlan, models: Mapping[str, ModelMemory], config: MemoryConfig) -> MemoryEstimate:
    """Estimate every used GPU's memory in every phase; warns (and logs) for each phase/GPU over the GPU's memory."""
    names = [role.name for role in plan.config.roles]
    for role in models:
        if role not in names:
            raise ValueError(f"estimate_memory: models names unknown role {role!r}; plan roles: {names}")
    phases = dict(config.phases) if config.phases is not None else _default_phases(plan)
    for phase, awake in phases.items():
        unknown = [role for role in awake if role not in names]
        if unknown:
            raise ValueError(f"MemoryConfig.phases[{phase!r}] names unknown roles {unknown}; plan roles: {names}")
    colocated = {name for group in plan.config.groups for name in group.roles}
    engine_shortfalls = _engine_shortfalls(plan, models, config, phases, colocated)
    warnings = [str(shortfall) for shortfall in engine_shortfalls]
    warnings += [f"no ModelMemory for role {r!r}; counted only its CUDA context" for r in names if r not in models]
    per_gpu: dict[tuple[int, int], dict[str, float]] = {}
    breakdown: dict[tuple[int, int], dict[str, dict[str, float]]] = {}
    for node, used in enumerate(plan.bundles_per_node()):
        for gpu in range(used):
            occupants = plan.occupants(node, gpu)
            for phase, awake in phases.items():
                parts = {}
                for placement, _ in occupants:
                    role = placement.role
                    is_awake = role in awake or role not in colocated
                    model = models.get(role)
                    held = _awake_gib(plan, role, model, config) if (is_awake and model is not None) else 0.0
                    parts[role] = held + config.context_gib
                total = sum(parts.values())
                per_gpu.setdefault((node, gpu), {})[phase] = total
                breakdown.setdefault((node, gpu), {})[phase] = MappingProxyType(parts)
                if total > config.gpu_memory_gib:
                    detail = ", ".join(f"{role} {gib:.1f}" for role, gib in parts.items())
                    warnings.append(
                        f"phase {phase!r}: node{node} gpu{gpu} needs ~{total:.1f} GiB ({detail}) > "
                        f"{config.gpu_memory_gib:g} GiB"
                    )
    for warning in warnings:
        logger.warning("%s", warning)
    return MemoryEstimate(
        phases=tuple(phases), gpu_memory_gib=config.gpu_memory_gib,
        per_gpu=MappingProxyType({k: MappingProxyType(v) for k, v in per_gpu.items()}),
        breakdown=MappingProxyType({k: MappingProxyType(v) for k, v in breakdown.items()}),
        warnings=tuple(warnings), engine_shortfalls=tuple(engine_shortfalls),
    )
