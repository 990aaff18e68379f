"""A per-GPU and per-node host memory, per-phase estimate for a :class:`~rlhfkit.placement.PlacementPlan` (pure
arithmetic).

The estimate is a budget, not a measurement: weights, gradients and optimizer states from parameter counts, ZeRO
sharding over a role's ranks, a fixed engine budget (vLLM's ``gpu_memory_utilization``, plus what the engine keeps
outside it), a CUDA context per process, and the activation peak you supply; ``MemoryConfig.reserve_factor`` scales
every trainer's bytes up to what its caching allocator reserves. It is an upper bound only as far as its inputs are
(:mod:`rlhfkit.hybrid` feeds it margins measured on real runs). Host memory (when ``MemoryConfig.host_memory_gib``
is given) counts what
DeepSpeed's optimizer offload keeps there (fp32 master weights, fp32 gradients and Adam moments; ZeRO-3's gradient
partitions too), offloaded weights, the pinned buffers of roles that sleep to host memory, extra host bytes you name
(an engine's level-1 weight backup), each process's own footprint, a fixed reserve per node, and, with
``MemoryConfig.load_order``, the whole host copy of each model while it loads. It warns when a phase cannot fit or an
engine's weights leave it no KV cache; :meth:`MemoryEstimate.check_fit` turns any of these into a
:class:`MemoryFitError` for launchers that refuse.
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
_FP32_GRAD_BYTES = 4.0  # DeepSpeed's optimizer offload keeps an fp32 gradient per parameter beside the masters


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
            Adam's two moments. With ``bytes_per_param`` below 4 (bf16/fp16 weights) the estimate adds 4 more: the
            fp32 gradients DeepSpeed's optimizer step builds beside the masters; under ZeRO-1/2 with the optimizer on
            the GPU also ``grad_bytes_per_param`` more: the flattened 16-bit copy that step casts from (both for
            ``step_group_params`` parameters at a time).
        zero_stage: DeepSpeed ZeRO stage; shards optimizer states (>= 1), gradients (>= 2) and weights (3) over the
            role's ranks.
        activation_gib: peak activation memory per rank while awake, from your own measurement.
        num_trainable_params: parameters that get gradients and optimizer states (LoRA: the adapters); None: all.
        offload_optimizer: fp32 master weights and optimizer states live in host memory (ZeRO-Offload).
        offload_params: ZeRO-3 weight shards live in host memory (ZeRO-Infinity; the gathered working set belongs
            in ``activation_gib``).
        engine_gib: an engine's GiB while awake when it is not a fraction of the GPU (rlhfkit's HF engine); None:
            ``MemoryConfig.engine_memory_fraction`` of the GPU.
        offload_optimizer_ratio: with ``offload_optimizer``, the fraction of the trainable parameters whose fp32
            master weights, fp32 gradients and optimizer states live in host memory (DeepSpeed ZeRO-3's
            ``offload_optimizer.ratio``); the rest keep theirs on the GPU. Offloaded, each parameter costs
            ``optimizer_bytes_per_param`` + 4 (fp32 gradient) bytes where it lives, and ZeRO-3 also keeps its
            ``grad_bytes_per_param`` gradient partitions in host memory (none on the GPU).
        asleep: what one rank keeps while asleep (a colocated role not awake in a phase): ``"freed"`` nothing but
            its CUDA context and ``asleep_gib``; ``"gpu"`` its weights, gradients and optimizer states stay on the GPU
            (activations freed: a trainer that only empties its caches); ``"host"`` those states sit in pinned host
            memory, whose buffers are kept between sleeps, so the host holds them in every phase.
        host_gib: other host GiB one rank holds in every phase (an engine's level-1 weight backup, kept by the
            pinned-memory cache after a wake).
        asleep_gib: GPU GiB one rank keeps while asleep besides its CUDA context (a vLLM engine's CUDA graphs and
            buffers outside its sleep pool; an engine whose footprint is its share keeps them beside the share while
            awake too).
        step_group_params: ZeRO-1/2, 16-bit weights, optimizer on the GPU: the parameter count of the largest
            optimizer parameter group (:class:`~rlhfkit.deepspeed_engine.DeepSpeedEngineConfig`'s
            ``param_group_elements``); the step builds the flattened 16-bit copy and the fp32 gradients of one group
            at a time. None: every trainable parameter in one group.
        keeps_blocks: its sleeps return no cached blocks to the driver (DeepSpeed's ``empty_cache_on_sleep=False``):
            asleep it holds on the GPU what it holds awake (its states and ``activation_gib``, ``asleep_gib`` on
            top), whatever its sleep moves to host memory, as the freed blocks stay in its allocator's cache.
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
    offload_optimizer_ratio: float = 1.0
    asleep: Literal["freed", "gpu", "host"] = "freed"
    host_gib: float = 0.0
    asleep_gib: float = 0.0
    step_group_params: int | None = None
    keeps_blocks: bool = False

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
        for name in ("bytes_per_param", "grad_bytes_per_param", "optimizer_bytes_per_param", "activation_gib",
                     "host_gib", "asleep_gib"):
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
        if not 0 <= _check_real("ModelMemory", "offload_optimizer_ratio", self.offload_optimizer_ratio) <= 1:
            raise ValueError(f"ModelMemory.offload_optimizer_ratio={self.offload_optimizer_ratio}; a fraction in "
                             "[0, 1] (1: every optimizer state in host memory)")
        if self.asleep not in ("freed", "gpu", "host"):
            raise ValueError(f"ModelMemory.asleep={self.asleep!r}; use 'freed', 'gpu' or 'host'")
        for name in ("offload_optimizer", "offload_params", "keeps_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModelMemory.{name}={getattr(self, name)!r}; must be True or False")
        if self.engine_gib is not None and not _check_real("ModelMemory", "engine_gib", self.engine_gib) >= 0:
            raise ValueError(f"ModelMemory.engine_gib={self.engine_gib}; must be >= 0 or None")
        group = self.step_group_params
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
            raise ValueError(f"ModelMemory.step_group_params={group!r}; an int >= 1 or None (one group)")


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
        host_memory_gib: host memory of one node; None: no host estimate.
        host_process_gib: host memory of each process on a GPU besides the states it is counted for (Python, torch,
            the CUDA and NCCL libraries, allocator caches; a vLLM engine process is about this size too).
        host_reserved_gib: host memory of each node that no role has: the operating system, Ray's GCS and raylet,
            the driver process, headroom for the page cache and pinned-memory rounding.
        load_order: roles in the order they load, each from a whole host copy of its weights (``from_pretrained``,
            then DeepSpeed moves it to the GPU): adds a host-only phase ``load_<role>`` per role, where the roles
            loaded before hold their host states, later ones nothing yet, and roles not listed (engines) all of
            theirs. None: no load phases.
        read_ahead: with ``load_order``, every role reads its host copy before the first one moves its model to the
            GPU (they read in parallel), so in ``load_<role>`` the roles after it hold their whole copies too.
        reserve_factor: every trainer role's (not an engine's) GPU bytes, awake and asleep, times this: a caching
            allocator reserves more than it allocates (fragmentation, blocks cached between phases). 1: the
            allocations alone.
    """

    gpu_memory_gib: float = 80.0
    engine_memory_fraction: float = 0.5
    context_gib: float = 0.5
    phases: Mapping[str, tuple[str, ...]] | None = None
    host_memory_gib: float | None = None
    host_process_gib: float = 3.0
    host_reserved_gib: float = 8.0
    load_order: tuple[str, ...] | None = None
    read_ahead: bool = False
    reserve_factor: float = 1.0

    def __post_init__(self) -> None:
        if not _check_real("MemoryConfig", "gpu_memory_gib", self.gpu_memory_gib) > 0:
            raise ValueError(f"MemoryConfig.gpu_memory_gib={self.gpu_memory_gib}; must be > 0")
        if not 0 < _check_real("MemoryConfig", "engine_memory_fraction", self.engine_memory_fraction) <= 1:
            raise ValueError(f"MemoryConfig.engine_memory_fraction={self.engine_memory_fraction}; must be in (0, 1]")
        if not _check_real("MemoryConfig", "context_gib", self.context_gib) >= 0:
            raise ValueError(f"MemoryConfig.context_gib={self.context_gib}; must be >= 0")
        if self.phases is not None:
            object.__setattr__(self, "phases", MappingProxyType(_checked_phases(self.phases)))
        if self.host_memory_gib is not None and not _check_real("MemoryConfig", "host_memory_gib",
                                                                self.host_memory_gib) > 0:
            raise ValueError(f"MemoryConfig.host_memory_gib={self.host_memory_gib}; must be > 0 or None")
        for name in ("host_process_gib", "host_reserved_gib"):
            if not _check_real("MemoryConfig", name, getattr(self, name)) >= 0:
                raise ValueError(f"MemoryConfig.{name}={getattr(self, name)}; must be >= 0")
        if self.load_order is not None:
            if not isinstance(self.load_order, (tuple, list)) or len(set(self.load_order)) != len(self.load_order):
                raise TypeError(f"MemoryConfig.load_order={self.load_order!r}; a tuple of distinct role names or None")
            for role in self.load_order:
                _check_name("MemoryConfig.load_order: each role name", role, example="actor")
            object.__setattr__(self, "load_order", tuple(self.load_order))
        if not isinstance(self.read_ahead, bool):
            raise TypeError(f"MemoryConfig.read_ahead={self.read_ahead!r}; must be True or False")
        if not _check_real("MemoryConfig", "reserve_factor", self.reserve_factor) >= 1:
            raise ValueError(f"MemoryConfig.reserve_factor={self.reserve_factor}; must be >= 1 (1: allocations alone)")


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
    """GiB per GPU per phase, with the per-role breakdown, and a warning for every phase that does not fit; with a
    host size, GiB of host memory per node per phase too.

    ``engine_shortfalls``: one :class:`MemoryFitError` per engine role whose weights fill its
    ``engine_memory_fraction`` of the GPU (no room for a KV cache), named by the first phase it is awake in;
    :meth:`check_fit` raises for the first of them, and ``warnings`` carries their messages. ``host_phases``: the GPU
    phases plus the ``load_<role>`` phases; ``host_per_node`` / ``host_breakdown`` (role -> GiB, with ``processes``
    and ``reserved``) are empty when ``host_memory_gib`` is None.
    """

    phases: tuple[str, ...]
    gpu_memory_gib: float
    per_gpu: Mapping[tuple[int, int], Mapping[str, float]]
    breakdown: Mapping[tuple[int, int], Mapping[str, Mapping[str, float]]]
    warnings: tuple[str, ...] = field(default_factory=tuple)
    engine_shortfalls: tuple[MemoryFitError, ...] = field(default_factory=tuple)
    host_memory_gib: float | None = None
    host_phases: tuple[str, ...] = field(default_factory=tuple)
    host_per_node: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    host_breakdown: Mapping[int, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)

    def peak(self) -> float:
        return max(value for phases in self.per_gpu.values() for value in phases.values())

    def host_peak(self) -> float | None:
        """The largest host GiB of any node in any phase; None without a host estimate."""
        values = [value for phases in self.host_per_node.values() for value in phases.values()]
        return max(values) if values else None

    def table(self) -> str:
        phases = self.host_phases or self.phases
        host = bool(self.host_per_node)
        header = [*(["memory"] if host else []), "node", "gpu", *phases]
        rows = []
        for (node, gpu), values in self.per_gpu.items():
            marks = [f"{values[p]:.1f}{' !' if values[p] > self.gpu_memory_gib else ''}" if p in values else "-"
                     for p in phases]
            rows.append([*(["gpu"] if host else []), str(node), str(gpu), *marks])
        for node, values in self.host_per_node.items():
            limit = self.host_memory_gib or 0.0
            rows.append(["host", str(node), "", *[f"{values[p]:.1f}{' !' if values[p] > limit else ''}"
                                                  for p in phases]])
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
        title = f"GiB per GPU per phase (of {self.gpu_memory_gib:g}"
        title += f"; host memory per node, of {self.host_memory_gib:g}" if host else ""
        return "\n".join([title + "; ! = does not fit)", *lines])

    def __str__(self) -> str:
        return self.table()

    def check_fit(self, *, what: str = "this plan") -> None:
        """Raise :class:`MemoryFitError` for an engine share that leaves no room for a KV cache (the first of
        ``engine_shortfalls``), else for the worst GPU phase that does not fit, else for the worst host phase
        (``memory="host"``), naming the phase, the GPU or node, what it needs, the shortfall in GiB and each role's
        share; nothing when everything fits."""
        if self.engine_shortfalls:
            first = self.engine_shortfalls[0]
            raise MemoryFitError(f"{what} does not fit: {first}", phase=first.phase,
                                 shortfall_gib=first.shortfall_gib)
        worst = _worst(self.per_gpu, self.gpu_memory_gib)
        if worst is not None:
            total, phase, (node, gpu) = worst
            parts = ", ".join(f"{role} {gib:.1f}" for role, gib in self.breakdown[(node, gpu)][phase].items())
            raise MemoryFitError(
                f"{what} does not fit: phase {phase!r} needs ~{total:.1f} GiB on node{node} gpu{gpu} ({parts} GiB) "
                f"but the GPU has {self.gpu_memory_gib:.1f} GiB: short by {total - self.gpu_memory_gib:.1f} GiB. "
                "Shrink that phase: ZeRO-3 over more GPUs, offload_optimizer / offload_params, "
                "gradient_checkpointing, a smaller micro_batch_tokens, LoRA, a smaller engine share; or a bigger GPU",
                phase=phase, shortfall_gib=total - self.gpu_memory_gib)
        worst = _worst(self.host_per_node, self.host_memory_gib) if self.host_memory_gib is not None else None
        if worst is not None:
            total, phase, node = worst
            parts = ", ".join(f"{role} {gib:.1f}" for role, gib in self.host_breakdown[node][phase].items())
            raise MemoryFitError(
                f"{what} does not fit host memory: phase {phase!r} needs ~{total:.1f} GiB of host memory on node{node} "
                f"({parts} GiB) but the node has {self.host_memory_gib:.1f} GiB: short by "
                f"{total - self.host_memory_gib:.1f} GiB. Keep more on the GPU: a smaller offload_optimizer_ratio, "
                "trainers that stay on the GPU while asleep (TrainerConfig.offload=False), engine sleep level 2, "
                "LoRA; or more nodes", phase=phase, shortfall_gib=total - self.host_memory_gib, memory="host")


def _worst(per_place: Mapping, limit: float) -> tuple[float, str, object] | None:
    worst = None
    for place, phases in per_place.items():
        for phase, total in phases.items():
            if total > limit and (worst is None or total > worst[0]):
                worst = (total, phase, place)
    return worst


class MemoryFitError(ValueError):
    """A plan whose memory estimate exceeds a GPU (``memory="gpu"``) or a node's host memory (``"host"``) in some
    phase; ``phase`` and ``shortfall_gib`` say where and how much. ``suggestion``: a layout the same estimate
    accepts, where the code that raised worked one out (its message says so), else None."""

    def __init__(self, message: str, *, phase: str, shortfall_gib: float, memory: str = "gpu",
                 suggestion: object = None) -> None:
        super().__init__(message)
        self.phase, self.shortfall_gib, self.memory = phase, shortfall_gib, memory
        self.suggestion = suggestion


def _awake_gib(plan: PlacementPlan, role: str, model: ModelMemory, config: MemoryConfig) -> float:
    """GiB one rank of ``role`` holds on each of its GPUs while awake (context excluded)."""
    if model.kind == "engine":
        if model.engine_gib is not None:
            return model.engine_gib / plan.config.role(role).gpus_per_rank
        # the share covers weights, KV cache and working memory; CUDA graphs and buffers outside the sleep pool
        # (asleep_gib) come on top
        return config.engine_memory_fraction * config.gpu_memory_gib + model.asleep_gib
    return (_states_gib(plan, role, model) + model.activation_gib) * config.reserve_factor


def _states_gib(plan: PlacementPlan, role: str, model: ModelMemory) -> float:
    """GiB of weights, gradients and optimizer states one trainer rank keeps on each of its GPUs."""
    spec = plan.config.role(role)
    world = spec.num_ranks
    weights = model.num_params * model.bytes_per_param / spec.gpus_per_rank / (world if model.zero_stage == 3 else 1)
    total = 0.0 if model.offload_params else weights
    if model.kind == "trainable":
        trainable = model.num_params if model.num_trainable_params is None else model.num_trainable_params
        if not (model.offload_optimizer and model.zero_stage == 3):  # ZeRO-3 Offload: gradient partitions on host
            total += trainable * model.grad_bytes_per_param / (world if model.zero_stage >= 2 else 1)
        on_gpu = 1.0 - model.offload_optimizer_ratio if model.offload_optimizer else 1.0
        # DeepSpeed's optimizer step of a bf16/fp16 model builds fp32 gradients beside the fp32 masters (ZeRO-1/2:
        # the flattened partition; ZeRO-3: the fp32 groups' .grad), as its optimizer offload does in host memory
        fp32_grads = model.offload_optimizer or model.bytes_per_param < _FP32_GRAD_BYTES
        # ZeRO-1/2 with the optimizer on the GPU builds them one parameter group at a time (below)
        grouped = model.zero_stage in (1, 2) and not model.offload_optimizer and fp32_grads
        per_param = model.optimizer_bytes_per_param + (0.0 if grouped or not fp32_grads else _FP32_GRAD_BYTES)
        total += on_gpu * trainable * per_param / (world if model.zero_stage >= 1 else 1)
        if grouped:
            # ZeRO-1/2's step, one parameter group at a time, flattens the group's 16-bit gradients into a new buffer
            # and casts that one to fp32, the per-parameter gradients still held (DeepSpeed 0.19
            # stage_1_and_2.step; a Qwen2.5-3B actor in one group ran out of memory there)
            group = trainable if model.step_group_params is None else min(trainable, model.step_group_params)
            total += group * (model.grad_bytes_per_param + _FP32_GRAD_BYTES) / world
    return total / _GIB


def _host_gib(plan: PlacementPlan, role: str, model: ModelMemory) -> float:
    """Host GiB one rank of ``role`` holds in every phase (the process's own footprint excluded)."""
    spec = plan.config.role(role)
    world = spec.num_ranks
    total = model.host_gib * _GIB
    if model.kind == "engine":
        return total / _GIB
    if model.offload_params:
        total += model.num_params * model.bytes_per_param / world
    if model.kind == "trainable" and model.offload_optimizer:
        trainable = model.num_params if model.num_trainable_params is None else model.num_trainable_params
        per_param = model.optimizer_bytes_per_param + _FP32_GRAD_BYTES
        total += model.offload_optimizer_ratio * trainable * per_param / (world if model.zero_stage >= 1 else 1)
        if model.zero_stage == 3:
            total += trainable * model.grad_bytes_per_param / world
    if model.asleep == "host":
        total += _states_gib(plan, role, model) * spec.gpus_per_rank * _GIB
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


def _gpu_estimate(plan: PlacementPlan, models: Mapping[str, ModelMemory], config: MemoryConfig,
                  phases: Mapping[str, tuple[str, ...]], colocated: set[str]) -> tuple[dict, dict, list[str]]:
    per_gpu: dict[tuple[int, int], dict[str, float]] = {}
    breakdown: dict[tuple[int, int], dict[str, MappingProxyType]] = {}
    warnings = []
    for node, used in enumerate(plan.bundles_per_node()):
        for gpu in range(used):
            occupants = plan.occupants(node, gpu)
            for phase, awake in phases.items():
                parts = {}
                for placement, _ in occupants:
                    role = placement.role
                    model = models.get(role)
                    held = 0.0
                    if model is not None and (role in awake or role not in colocated):
                        held = _awake_gib(plan, role, model, config)
                    elif model is not None and model.kind == "engine":
                        held = model.asleep_gib
                    elif model is not None and model.keeps_blocks:
                        held = _awake_gib(plan, role, model, config) + model.asleep_gib * config.reserve_factor
                    elif model is not None:
                        held = (model.asleep_gib + (_states_gib(plan, role, model) if model.asleep == "gpu"
                                                    else 0.0)) * config.reserve_factor
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
    return per_gpu, breakdown, warnings


def _host_estimate(plan: PlacementPlan, models: Mapping[str, ModelMemory], config: MemoryConfig,
                   phases: tuple[str, ...]) -> tuple[dict, dict, list[str]]:
    """Host GiB per node: in every GPU phase each role holds its host states; in ``load_<role>`` the roles loaded
    before hold theirs, the loading one a whole copy of its weights, later ones nothing (``read_ahead``: their whole
    copies as well)."""
    assert config.host_memory_gib is not None
    order = config.load_order or ()
    per_node: dict[int, dict[str, float]] = {}
    breakdown: dict[int, dict[str, MappingProxyType]] = {}
    warnings = []
    steady = {role: _host_gib(plan, role, model) for role, model in models.items()}
    for phase in (*phases, *(f"load_{role}" for role in order)):
        loading = phase[len("load_"):] if phase not in phases else None
        held = dict(steady)
        if loading is not None:
            for role in order[order.index(loading):]:
                model = models.get(role)
                copy = model.num_params * model.bytes_per_param / _GIB if model is not None else 0.0
                held[role] = copy if role == loading or config.read_ahead else 0.0
        for node in range(len(plan.bundles_per_node())):
            parts: dict[str, float] = {}
            processes = 0
            for ranks in plan.placements.values():
                for placement in ranks:
                    if placement.node == node:
                        processes += len(placement.gpus)
                        parts[placement.role] = parts.get(placement.role, 0.0) + held.get(placement.role, 0.0)
            if not processes:
                continue
            parts |= {"processes": processes * config.host_process_gib, "reserved": config.host_reserved_gib}
            total = sum(parts.values())
            per_node.setdefault(node, {})[phase] = total
            breakdown.setdefault(node, {})[phase] = MappingProxyType(parts)
            if total > config.host_memory_gib:
                detail = ", ".join(f"{role} {gib:.1f}" for role, gib in parts.items())
                warnings.append(f"phase {phase!r}: node{node} host memory needs ~{total:.1f} GiB ({detail}) > "
                                f"{config.host_memory_gib:g} GiB")
    return per_node, breakdown, warnings


def estimate_memory(plan: PlacementPlan, models: Mapping[str, ModelMemory], config: MemoryConfig, *,
                    log_warnings: bool = True) -> MemoryEstimate:
    """Estimate every used GPU's memory in every phase, and with ``config.host_memory_gib`` every used node's host
    memory; warns (and logs, unless ``log_warnings=False``: a probe of what would fit) for each phase/GPU or
    phase/node over its memory."""
    names = [role.name for role in plan.config.roles]
    for role in models:
        if role not in names:
            raise ValueError(f"estimate_memory: models names unknown role {role!r}; plan roles: {names}")
    phases = dict(config.phases) if config.phases is not None else _default_phases(plan)
    for phase, awake in phases.items():
        unknown = [role for role in awake if role not in names]
        if unknown:
            raise ValueError(f"MemoryConfig.phases[{phase!r}] names unknown roles {unknown}; plan roles: {names}")
    unknown = [role for role in config.load_order or () if role not in names]
    if unknown:
        raise ValueError(f"MemoryConfig.load_order names unknown roles {unknown}; plan roles: {names}")
    colocated = {name for group in plan.config.groups for name in group.roles}
    engine_shortfalls = _engine_shortfalls(plan, models, config, phases, colocated)
    warnings = [str(shortfall) for shortfall in engine_shortfalls]
    warnings += [f"no ModelMemory for role {r!r}; counted only its CUDA context" for r in names if r not in models]
    per_gpu, breakdown, gpu_warnings = _gpu_estimate(plan, models, config, phases, colocated)
    host_per_node: dict = {}
    host_breakdown: dict = {}
    host_warnings: list[str] = []
    if config.host_memory_gib is not None:
        host_per_node, host_breakdown, host_warnings = _host_estimate(plan, models, config, tuple(phases))
    warnings += gpu_warnings + host_warnings
    for warning in warnings if log_warnings else ():
        logger.warning("%s", warning)
    return MemoryEstimate(
        phases=tuple(phases), gpu_memory_gib=config.gpu_memory_gib,
        per_gpu=MappingProxyType({k: MappingProxyType(v) for k, v in per_gpu.items()}),
        breakdown=MappingProxyType({k: MappingProxyType(v) for k, v in breakdown.items()}),
        warnings=tuple(warnings), engine_shortfalls=tuple(engine_shortfalls),
        host_memory_gib=config.host_memory_gib,
        host_phases=(*phases, *(f"load_{role}" for role in config.load_order or ())) if host_per_node else (),
        host_per_node=MappingProxyType({k: MappingProxyType(v) for k, v in host_per_node.items()}),
        host_breakdown=MappingProxyType({k: MappingProxyType(v) for k, v in host_breakdown.items()}),
    )
