"""One plan of a hybrid run, decided before anything starts: :func:`plan_hybrid` and :class:`HybridPlan`.

What stays on the GPU in which phase is one question; :func:`plan_hybrid` answers it from facts (the model's
config, the GPU and host memory, the run's :class:`~rlhfkit.hybrid.HybridConfig` and trainer roles) with the memory
estimate of :mod:`rlhfkit.hybrid._fit`, and returns a frozen, printable :class:`HybridPlan`: per role a
:class:`RolePlan` (ZeRO stage, the optimizer's share in host memory, whether its sleeps go to host memory and what
they keep on the GPU, the micro-batch budget), the engines' :class:`EnginePlan` (sleep level, memory share, KV cache,
batch sizes), whether the role switches overlap, and the per-phase memory it was based on. :meth:`Hybrid.start
<rlhfkit.hybrid.Hybrid.start>` executes a plan and never rewrites the user's configs; edit a plan with
:func:`dataclasses.replace` (or :meth:`HybridPlan.replace_role` / :meth:`HybridPlan.replace_engine`) and pass it
back. A run no layout fits raises :class:`~rlhfkit.placement.MemoryFitError` naming the phase and the shortfall.

Pure: no Ray, no GPU; the model's config is read through :func:`rlhfkit.hybrid._fit.model_shape` (transformers,
meta device) unless a :class:`~rlhfkit.hybrid._fit.ModelShape` is given.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlhfkit.hybrid._fit import ModelShape, engines_may_build_during_loads, estimate_hybrid_memory, kv_cache_bytes

__all__ = ["EnginePlan", "HybridPlan", "RolePlan", "check_plan", "check_roles", "plan_hybrid"]

TRAINED = ("actor", "critic")
ROLES = ("actor", "critic", "reference", "reward")
# The micro-batch budgets the plan tries, the largest first: fewer, larger micro-batches launch fewer kernels and run
# DeepSpeed's per-gradient work fewer times in a host-bound step. The smallest where none keeps the headroom.
MICRO_BATCH_LADDER = (16384, 12288, 8192, 4096)
# What a trained role that sleeps to host memory keeps on the GPU through its sleeps, in the order tried: (weights,
# optimizer states). The weights first among the partial choices: few bytes (2 a parameter against 12), and their wake
# is on the path of every forward.
KEEP_LADDER = ((True, True), (False, True), (True, False))
# The optimizer shares a trained role may put in host memory when the layout as configured does not fit (ZeRO-3,
# the role resident), the least first: the less the optimizer steps on the host, the faster the step.
OFFLOAD_SHARES = (0.25, 0.5, 0.66, 1.0)
SUB_GROUP_ELEMENTS = 100_000_000  # ZeRO-3 sub-group size with a partial share: the grain of the share
# The share of the GPU a choice made for speed (larger micro-batches, states kept, overlapped switches) leaves free
# beyond the estimate, which is itself an upper bound (rlhfkit.hybrid._fit): a speed-up must not cost an OOM.
HEADROOM = 1.03
ENGINE_BATCHED_TOKENS = 4096  # vLLM's max_num_batched_tokens (TRL's colocated vLLM uses the same)
KV_TOKENS_PER_SEQ = 256  # KV cache per running sequence: a prompt and its response on average (16-token blocks)
ENGINE_SHARE = {"colocated": 0.15, "apart": 0.85}  # the engines' memory share unless their KV cache needs more


@dataclass(frozen=True, kw_only=True)
class RolePlan:
    """Where one trainer role's states live.

    Attributes:
        zero_stage: DeepSpeed ZeRO stage (the configured one unless the plan had to change the layout).
        offload_share: share of the fp32 master weights and Adam moments in host memory (DeepSpeed's
            ``offload_optimizer`` with its ``ratio``; partial shares need ZeRO-3); 0.0: all on the GPU.
        offload: the role's sleeps move its states to pinned host memory (False: it stays on the GPU and only
            returns cached blocks; the phase guard orders the phases either way).
        keep_weights, keep_optimizer: a sleeping (``offload``) trained role leaves its weights / optimizer states
            on the GPU through its sleeps, so no wake waits for them.
        micro_batch_tokens: token budget of one micro-batch.
        gradient_checkpointing: recompute activations in the backward.
        optimizer_threads: CPU threads (``OMP_NUM_THREADS``) of each rank whose optimizer steps in host memory;
            None: Ray's one thread.
    """

    zero_stage: int
    offload_share: float = 0.0
    offload: bool = True
    keep_weights: bool = False
    keep_optimizer: bool = False
    micro_batch_tokens: int = MICRO_BATCH_LADDER[-1]
    gradient_checkpointing: bool = False
    optimizer_threads: int | None = None

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"RolePlan.zero_stage={self.zero_stage!r}; expected 0, 1, 2 or 3")
        if not 0 <= self.offload_share <= 1:
            raise ValueError(f"RolePlan.offload_share={self.offload_share!r}; a share in [0, 1]")
        if 0 < self.offload_share < 1 and self.zero_stage != 3:
            raise ValueError(f"RolePlan.offload_share={self.offload_share} needs zero_stage=3 (DeepSpeed places "
                             f"partial shares by ZeRO-3 sub-groups); zero_stage={self.zero_stage}")
        if self.offload and 0 < self.offload_share < 1:
            raise ValueError(f"RolePlan(offload=True, offload_share={self.offload_share}): the part DeepSpeed keeps "
                             "on the GPU is not moved by its offload_states; use offload=False or a share of 0 or 1")
        for name in ("offload", "keep_weights", "keep_optimizer", "gradient_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RolePlan.{name}={getattr(self, name)!r}; must be True or False")
        if isinstance(self.micro_batch_tokens, bool) or not isinstance(self.micro_batch_tokens, int) or (
                self.micro_batch_tokens < 1):
            raise ValueError(f"RolePlan.micro_batch_tokens={self.micro_batch_tokens!r}; must be an int >= 1")

    def deepspeed_config(self, deepspeed: Any, *, device: str = "cuda") -> Any:
        """``deepspeed`` (a :class:`~rlhfkit.deepspeed_engine.DeepSpeedEngineConfig`) with this plan's ZeRO stage,
        optimizer share and checkpointing: what the role's worker builds. A partial share on CUDA steps the GPU part
        with DeepSpeed's fused Adam (it keeps no other there) in sub-groups of ``SUB_GROUP_ELEMENTS``."""
        changes: dict[str, Any] = {"zero_stage": self.zero_stage, "offload_optimizer": self.offload_share > 0,
                                   "offload_optimizer_ratio": self.offload_share if self.offload_share > 0 else 1.0,
                                   "gradient_checkpointing": self.gradient_checkpointing}
        if self.zero_stage == 3:
            changes["compile_layers"] = False
        if 0 < self.offload_share < 1:
            changes["sub_group_elements"] = min(deepspeed.sub_group_elements, SUB_GROUP_ELEMENTS)
            if device == "cuda":
                changes["optimizer"] = "fused_adam"
        if all(getattr(deepspeed, name) == value for name, value in changes.items()):
            return deepspeed
        return dataclasses.replace(deepspeed, **changes)


@dataclass(frozen=True, kw_only=True)
class EnginePlan:
    """The rollout engines' memory.

    Attributes:
        sleep_level: 2 drops the weights while asleep (the push rewrites them); 1 keeps them in host memory (LoRA:
            a push carries adapters only); 0 keeps the engine resident (``HybridConfig.overlap``, engines apart).
        memory: the engines' share of GPU memory (vLLM's ``gpu_memory_utilization``, SGLang's
            ``mem_fraction_static``); with a sized KV cache vLLM only needs it free at start-up.
        kv_cache_tokens: vLLM: the tokens each engine's KV cache holds (``kv_cache_memory_bytes``); None: the
            cache fills ``memory``.
        kv_bytes_per_token: bytes of KV cache per token on one engine GPU (from the model's config).
        max_num_seqs: sequences one engine runs at once (None: the engine's default).
        max_num_batched_tokens: tokens one vLLM engine step may process.
    """

    sleep_level: int
    memory: float
    kv_cache_tokens: int | None = None
    kv_bytes_per_token: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = ENGINE_BATCHED_TOKENS

    def __post_init__(self) -> None:
        if self.sleep_level not in (0, 1, 2):
            raise ValueError(f"EnginePlan.sleep_level={self.sleep_level!r}; expected 0, 1 or 2")
        if not 0 < self.memory < 1:
            raise ValueError(f"EnginePlan.memory={self.memory!r}; a share of the GPU in (0, 1)")
        if self.kv_cache_tokens is not None and (self.kv_cache_tokens < 1 or self.kv_bytes_per_token < 1):
            raise ValueError(f"EnginePlan.kv_cache_tokens={self.kv_cache_tokens!r} with kv_bytes_per_token="
                             f"{self.kv_bytes_per_token}: a sized cache needs both positive (or kv_cache_tokens None)")
        if self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"EnginePlan.max_num_batched_tokens={self.max_num_batched_tokens} is below "
                             f"max_num_seqs={self.max_num_seqs}: a decode step gives every running sequence a token")

    @property
    def kv_cache_bytes(self) -> int | None:
        """``kv_cache_tokens`` in bytes per engine GPU, in whole 16-token blocks; None when the cache fills the
        share."""
        if self.kv_cache_tokens is None:
            return None
        return -(-self.kv_cache_tokens // 16) * 16 * self.kv_bytes_per_token


@dataclass(frozen=True, kw_only=True)
class HybridPlan:
    """What a hybrid run keeps where, per role and phase; see the module docstring. ``gpu_phases`` / ``host_phases``:
    the estimate's GiB of the fullest GPU / node in each phase (empty when no GPU size was known: no estimate)."""

    roles: Mapping[str, RolePlan]
    engine: EnginePlan
    overlap_switches: bool = False
    read_ahead: bool = False
    build_during_loads: bool = False
    gpu_memory_gib: float | None = None
    host_memory_gib: float | None = None
    gpu_phases: Mapping[str, float] = dataclasses.field(default_factory=dict)
    host_phases: Mapping[str, float] = dataclasses.field(default_factory=dict)
    layout: str = "as configured"

    def __post_init__(self) -> None:
        if "actor" not in self.roles:
            raise ValueError(f"HybridPlan.roles={list(self.roles)}; a hybrid run needs an 'actor' role")
        for role, role_plan in self.roles.items():
            if not isinstance(role_plan, RolePlan):
                raise TypeError(f"HybridPlan.roles[{role!r}] must be a RolePlan, got {type(role_plan).__name__}")
        if not isinstance(self.engine, EnginePlan):
            raise TypeError(f"HybridPlan.engine must be an EnginePlan, got {type(self.engine).__name__}")

    def replace_role(self, role: str, **changes: Any) -> HybridPlan:
        """This plan with ``role``'s :class:`RolePlan` fields changed (``replace_role("actor", offload=False)``)."""
        if role not in self.roles:
            raise ValueError(f"replace_role({role!r}): the plan's roles are {list(self.roles)}")
        roles = dict(self.roles) | {role: dataclasses.replace(self.roles[role], **changes)}
        return dataclasses.replace(self, roles=roles, layout="edited")

    def replace_engine(self, **changes: Any) -> HybridPlan:
        """This plan with :class:`EnginePlan` fields changed (``plan.replace_engine(sleep_level=1)``)."""
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, **changes), layout="edited")

    def describe(self) -> str:
        """The plan as a table: one row per role, the engines, and the memory estimate per phase."""
        gpu = "unknown GPU" if self.gpu_memory_gib is None else f"GPUs of {self.gpu_memory_gib:.1f} GiB"
        host = "" if self.host_memory_gib is None else f", {self.host_memory_gib:.1f} GiB host memory"
        lines = [f"hybrid plan ({self.layout}) for {gpu}{host}",
                 f"{'role':<10} {'zero':>4} {'optim in host':>13} {'asleep in':>9} {'keeps asleep':>17} "
                 f"{'micro-batch':>11} {'ckpt':>4} {'threads':>7}"]
        for role, plan in self.roles.items():
            kept = "+".join(name for name, kept in (("weights", plan.keep_weights),
                                                    ("optimizer", plan.keep_optimizer)) if kept) or "-"
            lines.append(f"{role:<10} {plan.zero_stage:>4} {plan.offload_share:>13.0%} "
                         f"{'host' if plan.offload else 'gpu':>9} {kept:>17} "
                         f"{plan.micro_batch_tokens:>11} {_yes(plan.gradient_checkpointing):>4} "
                         f"{plan.optimizer_threads or '-':>7}")
        engine = self.engine
        kv = "fills the share" if engine.kv_cache_bytes is None else (
            f"{engine.kv_cache_tokens} tokens ({engine.kv_cache_bytes / 1024**3:.2f} GiB)")
        lines.append(f"engines: sleep level {engine.sleep_level}, memory share {engine.memory:.2f}, KV cache {kv}, "
                     f"max_num_seqs {engine.max_num_seqs or 'default'}, batched tokens "
                     f"{engine.max_num_batched_tokens}")
        lines.append(f"switches overlapped: {_yes(self.overlap_switches)}; models read ahead: "
                     f"{_yes(self.read_ahead)}; engines build during loads: {_yes(self.build_during_loads)}")
        if self.gpu_phases:
            lines.append("estimate per phase, GiB (GPU | host): " + ", ".join(
                f"{phase} {gib:.1f}" for phase, gib in self.gpu_phases.items()) + (" | " + ", ".join(
                    f"{phase} {gib:.1f}" for phase, gib in self.host_phases.items()) if self.host_phases else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


@dataclass(frozen=True)
class _Facts:
    """What a plan is computed from besides the configs."""

    config: Any
    trainers: Mapping[str, Any]
    placement: Any
    shapes: Mapping[str, ModelShape]
    gpu_gib: float | None
    host_gib: float | None
    cores: int


def plan_hybrid(config: Any, trainers: Mapping[str, Any], *, gpu_memory_gib: float | None,
                host_memory_gib: float | None, model_shape: ModelShape | Callable[[str], ModelShape] | None = None,
                host_cores: int | None = None) -> HybridPlan:
    """The plan of a run of ``config`` (:class:`~rlhfkit.hybrid.HybridConfig`) with ``trainers`` (role ->
    :class:`~rlhfkit.hybrid.TrainerConfig`, in load order) on GPUs of ``gpu_memory_gib`` and nodes of
    ``host_memory_gib`` GiB (None: unknown, no estimate: the layout as configured, nothing kept on the GPU while
    asleep, the smallest micro-batch budget, no overlapped switches).

    The first layout the memory estimate accepts, in every phase, GPU and host: the layout as configured; every role
    resident on the GPU; every role asleep in host memory between its phases, trained roles with gradient
    checkpointing; then the trained roles resident with ZeRO-3, gradient checkpointing and ``OFFLOAD_SHARES`` of their
    optimizer in host memory; last, every role asleep with the trained roles' optimizer wholly in host memory under
    ZeRO-3. Within it, the largest micro-batch budget of ``MICRO_BATCH_LADDER``, then the most states kept on the GPU
    through sleeps (``KEEP_LADDER``), that fit within ``1 / HEADROOM`` of the GPU; switches overlap where every role
    fits resident at once within it. Raises :class:`~rlhfkit.placement.MemoryFitError` when none fits, naming the phase
    and shortfall of the layout that came closest. ``model_shape``: the run's model's :class:`ModelShape`, or path ->
    shape (default: read from each model's config.json); ``host_cores``: CPU cores of a node (default: this
    machine's)."""
    from rlhfkit.placement import MemoryFitError

    check_roles(config, trainers)
    facts = _Facts(config=config, trainers=dict(trainers), placement=_placement(config, tuple(trainers)),
                   shapes=_shapes(config, trainers, model_shape), gpu_gib=gpu_memory_gib, host_gib=host_memory_gib,
                   cores=host_cores or _cores())
    engine = _engine_plan(facts)
    configured = {role: _configured(role, trainer) for role, trainer in trainers.items()}
    if gpu_memory_gib is None:
        return _finish(facts, configured, engine, overlap=False, estimate=None, layout="as configured")
    closest: tuple[str, MemoryFitError] | None = None
    layouts = _layouts(facts, configured)
    for layout, roles in layouts:
        engine = _engine_share(facts, roles, engine)
        roles = _size(facts, roles, engine)
        try:
            estimate = _estimate(facts, roles, engine)
            estimate.check_fit(what=f"the hybrid run of {config.model!r} on {config.total_gpus} GPU(s)")
        except MemoryFitError as error:
            if closest is None or error.shortfall_gib < closest[1].shortfall_gib:
                closest = (layout, error)
            continue
        return _finish(facts, roles, engine, overlap=_overlap_fits(facts, roles, engine), estimate=estimate,
                       layout=layout)
    assert closest is not None
    layout, error = closest
    raise MemoryFitError(f"No layout the plan tries fits ({'; '.join(name for name, _ in layouts)}). The closest, "
                         f"{layout}: {error}. "
                         "Try LoRA, more GPUs or a bigger GPU.", phase=error.phase, shortfall_gib=error.shortfall_gib,
                         memory=error.memory)


def check_plan(config: Any, trainers: Mapping[str, Any], plan: HybridPlan, *,
               model_shape: ModelShape | Callable[[str], ModelShape] | None = None) -> Any:
    """Refuse a plan (given to :meth:`Hybrid.start <rlhfkit.hybrid.Hybrid.start>`, perhaps edited) that cannot run
    ``config`` and ``trainers``: other roles, a role layout DeepSpeed refuses, an engine sleep level the run cannot
    use, or, when the plan names a GPU
    size, a memory estimate that does not fit (:class:`~rlhfkit.placement.MemoryFitError`; its ``suggestion`` is
    :func:`plan_hybrid`'s own plan where one fits). Returns that :class:`~rlhfkit.placement.MemoryEstimate` (None
    without a GPU size)."""
    check_roles(config, trainers)
    if not isinstance(plan, HybridPlan):
        raise TypeError(f"plan must be a HybridPlan (from rlhfkit.hybrid.plan_hybrid), got {type(plan).__name__}")
    if list(plan.roles) != list(trainers):
        raise ValueError(f"the plan's roles {list(plan.roles)} are not the run's {list(trainers)} (in load order); "
                         "plan this run with plan_hybrid")
    for role, role_plan in plan.roles.items():  # a layout DeepSpeed refuses fails here, not in the worker
        role_plan.deepspeed_config(trainers[role].deepspeed, device=config.device)
    level = plan.engine.sleep_level
    if trainers["actor"].lora is not None and level == 2:
        raise ValueError("plan.engine.sleep_level=2 discards the engines' base weights, which a LoRA push (adapters "
                         "only) does not rewrite; use sleep_level 1 (or 0) with TrainerConfig.lora")
    if config.overlap and config.colocate and level != 0:
        raise ValueError(f"HybridConfig(overlap=True, colocate=True) keeps the engines resident beside the trainers; "
                         f"plan.engine.sleep_level={level} would put them to sleep: use sleep_level 0")
    from rlhfkit.placement import MemoryFitError

    if plan.gpu_memory_gib is None:
        return None
    facts = _Facts(config=config, trainers=dict(trainers), placement=_placement(config, tuple(trainers)),
                   shapes=_shapes(config, trainers, model_shape), gpu_gib=plan.gpu_memory_gib,
                   host_gib=plan.host_memory_gib, cores=1)
    what = f"the hybrid run of {config.model!r} on {config.total_gpus} GPU(s) with the plan given"
    estimate = _estimate(facts, plan.roles, plan.engine)
    try:
        estimate.check_fit(what=what)
    except MemoryFitError as error:
        try:
            found = plan_hybrid(config, trainers, gpu_memory_gib=plan.gpu_memory_gib,
                                host_memory_gib=plan.host_memory_gib, model_shape=model_shape)
        except MemoryFitError:
            raise error from None
        raise MemoryFitError(f"{error}. plan_hybrid's own plan for this run fits ({found.layout}): error.suggestion",
                             phase=error.phase, shortfall_gib=error.shortfall_gib, memory=error.memory,
                             suggestion=found) from error
    return estimate


def check_roles(config: Any, trainers: Mapping[str, Any]) -> None:
    if "actor" not in trainers:
        raise ValueError(f"trainers={list(trainers)}; a hybrid run needs an 'actor' role (its weights go to the "
                         "engines)")
    for role, trainer in trainers.items():
        if role not in ROLES:
            raise ValueError(f"trainer role {role!r}; expected actor, critic, reference or reward")
        if trainer.lora is not None and role != "actor":
            raise ValueError(f"trainers[{role!r}].lora is set; LoRA adapters are supported on the actor only")


def _placement(config: Any, roles: tuple[str, ...]) -> Any:
    from rlhfkit.placement import plan_layout

    return plan_layout(num_nodes=config.num_nodes, gpus_per_node=config.num_gpus, colocate=config.colocate,
                       engine_gpus=None if config.colocate else config.engine_gpus,
                       tensor_parallel_size=config.tensor_parallel_size, trainer_roles=roles)


def _shapes(config: Any, trainers: Mapping[str, Any], given: Any) -> dict[str, ModelShape]:
    from rlhfkit.hybrid._fit import model_shape

    paths = dict.fromkeys([config.model] + [trainer.model or config.model for trainer in trainers.values()])
    if isinstance(given, ModelShape):
        return dict.fromkeys(paths, given)
    return {path: (given or model_shape)(path) for path in paths}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _engine_plan(facts: _Facts) -> EnginePlan:
    """The engines' plan before the fit: resident with ``overlap`` or on GPUs of their own, level 1 with LoRA
    (a push carries the adapters only), else 2; a vLLM KV cache sized to ``max_num_seqs`` sequences of
    ``KV_TOKENS_PER_SEQ`` tokens (at least ``max_model_len``)."""
    config = facts.config
    level = 0 if config.overlap or not config.colocate else (1 if facts.trainers["actor"].lora is not None else 2)
    shape = facts.shapes[config.model]
    tokens, per_token = None, 0
    if config.engine == "vllm" and config.max_num_seqs is not None and shape.num_kv_heads > 0 and shape.head_dim > 0:
        tokens = max(config.max_model_len, config.max_num_seqs * KV_TOKENS_PER_SEQ)
        per_token = kv_cache_bytes(shape, tokens=16, dtype_bytes=2 if config.engine_dtype == "bfloat16" else 4,
                                   tensor_parallel_size=config.tensor_parallel_size) // 16
    return EnginePlan(sleep_level=level, memory=ENGINE_SHARE["colocated" if config.colocate else "apart"],
                      kv_cache_tokens=tokens, kv_bytes_per_token=per_token, max_num_seqs=config.max_num_seqs,
                      max_num_batched_tokens=max(ENGINE_BATCHED_TOKENS, config.max_num_seqs or 0))


def _engine_share(facts: _Facts, roles: Mapping[str, RolePlan], engine: EnginePlan) -> EnginePlan:
    """A sized vLLM cache: a share of at least what the awake engine holds (weights, cache, working memory), in
    steps of 0.05, that vLLM finds free at start-up."""
    from rlhfkit.hybrid._fit import engine_awake_gib

    awake = engine_awake_gib(facts.config, engine, facts.shapes[facts.config.model])
    if awake is None or facts.gpu_gib is None:
        return engine
    needed = -(-awake * HEADROOM / facts.gpu_gib // 0.05) * 0.05
    share = round(min(0.95, max(ENGINE_SHARE["colocated" if facts.config.colocate else "apart"], needed)), 2)
    return dataclasses.replace(engine, memory=share)


def _configured(role: str, trainer: Any) -> RolePlan:
    ds = trainer.deepspeed
    trains = role in TRAINED
    return RolePlan(zero_stage=ds.zero_stage, offload=trainer.offload,
                    offload_share=ds.offload_optimizer_ratio if ds.offload_optimizer and trains else 0.0,
                    gradient_checkpointing=ds.gradient_checkpointing)


def _layouts(facts: _Facts, configured: dict[str, RolePlan]) -> list[tuple[str, dict[str, RolePlan]]]:
    """The layouts tried, in order, each one the configs accept (a partial share on CPU is not one)."""
    out = [("as configured", configured)]
    resident = {role: dataclasses.replace(plan, offload=False)
                for role, plan in configured.items()}
    out.append(("every role resident on the GPU", resident))  # no copies at the switches, little host memory
    asleep = {role: dataclasses.replace(plan, offload=True, offload_share=1.0 if plan.offload_share > 0 else 0.0,
                                        gradient_checkpointing=plan.gradient_checkpointing or role in TRAINED)
              for role, plan in configured.items()}
    out.append(("every role asleep in host memory", asleep))
    for share in OFFLOAD_SHARES:
        resident = dict(configured)
        for role in TRAINED:
            if role in configured and facts.trainers[role].lora is None:
                resident[role] = dataclasses.replace(configured[role], zero_stage=3, offload=False,
                                                     offload_share=share, gradient_checkpointing=True)
        out.append((f"ZeRO-3, {share:.0%} of the optimizer in host memory", resident))
    parked = dict(asleep)  # the least GPU memory of all: everything sleeps, the optimizer steps in host memory
    for role in TRAINED:
        if role in asleep and facts.trainers[role].lora is None:
            parked[role] = dataclasses.replace(asleep[role], zero_stage=3, offload_share=1.0)
    out.append(("every role asleep in host memory, ZeRO-3, the optimizer in host memory", parked))
    seen, accepted = [], []
    for name, roles in out:
        if roles in seen or not _accepted(facts, roles):
            continue
        seen.append(roles)
        accepted.append((name, roles))
    return accepted


def _accepted(facts: _Facts, roles: Mapping[str, RolePlan]) -> bool:
    try:
        for role, plan in roles.items():
            plan.deepspeed_config(facts.trainers[role].deepspeed, device=facts.config.device)
    except (ValueError, TypeError):
        return False
    return True


def _estimate(facts: _Facts, roles: Mapping[str, RolePlan], engine: EnginePlan, *, gpu_gib: float | None = None,
              read_ahead: bool = False) -> Any:
    return estimate_hybrid_memory(facts.config, facts.trainers, roles, engine, placement=facts.placement,
                                  shapes=facts.shapes, gpu_memory_gib=gpu_gib or facts.gpu_gib,
                                  host_memory_gib=facts.host_gib, read_ahead=read_ahead, log_warnings=False)


def _fits(facts: _Facts, roles: Mapping[str, RolePlan], engine: EnginePlan, *, headroom: float = HEADROOM,
          read_ahead: bool = False) -> bool:
    from rlhfkit.placement import MemoryFitError

    try:
        _estimate(facts, roles, engine, gpu_gib=facts.gpu_gib / headroom, read_ahead=read_ahead).check_fit()
    except MemoryFitError:
        return False
    return True


def _overlap_fits(facts: _Facts, roles: Mapping[str, RolePlan], engine: EnginePlan) -> bool:
    """Overlapped switches put two roles on a GPU for a moment: on where every role fits resident at once (engine
    level 0) within the headroom; off on CPU (no copies to hide)."""
    if facts.config.device != "cuda":
        return False
    resident = {role: dataclasses.replace(plan, offload=False) for role, plan in roles.items()}
    return _fits(facts, resident, dataclasses.replace(engine, sleep_level=0))


def _size(facts: _Facts, roles: Mapping[str, RolePlan], engine: EnginePlan) -> dict[str, RolePlan]:
    """``roles`` with the largest micro-batch budget that fits within the headroom (every role resident too, where
    the switches would overlap at the smallest), then the most states kept on the GPU through sleeps."""

    def sized(tokens: int, keep: tuple[bool, bool] = (False, False)) -> dict[str, RolePlan]:
        return {role: dataclasses.replace(plan, micro_batch_tokens=tokens,
                                          keep_weights=keep[0] and plan.offload and role in TRAINED,
                                          keep_optimizer=keep[1] and plan.offload and role in TRAINED)
                for role, plan in roles.items()}

    smallest = sized(MICRO_BATCH_LADDER[-1])
    if facts.config.device != "cuda":
        return smallest
    overlap = _overlap_fits(facts, smallest, engine)
    chosen = smallest
    for tokens in MICRO_BATCH_LADDER[:-1]:
        candidate = sized(tokens)
        if (not overlap or _overlap_fits(facts, candidate, engine)) and _fits(facts, candidate, engine):
            chosen = candidate
            break
    tokens = chosen["actor"].micro_batch_tokens
    for keep in KEEP_LADDER:
        candidate = sized(tokens, keep)
        if candidate != chosen and _fits(facts, candidate, engine):
            return candidate
    return chosen


def _threads(facts: _Facts, role: str, plan: RolePlan) -> int | None:
    """``OMP_NUM_THREADS`` of a rank whose optimizer steps in host memory: on CUDA, the node's cores divided among
    the role's ranks on it (Ray gives an actor that reserves no CPU one thread)."""
    if plan.offload_share == 0 or facts.config.device != "cuda":
        return None
    per_node = Counter(rank.node for rank in facts.placement.ranks(role))
    return max(1, facts.cores // max(per_node.values(), default=1))


def _finish(facts: _Facts, roles: Mapping[str, RolePlan], engine: EnginePlan, *, overlap: bool, estimate: Any,
            layout: str) -> HybridPlan:
    roles = {role: dataclasses.replace(plan, optimizer_threads=_threads(facts, role, plan))
             for role, plan in roles.items()}
    read_ahead = len(roles) > 1 and (estimate is None or _fits(facts, roles, engine, headroom=1.0, read_ahead=True))
    gpu_phases = host_phases = {}
    if estimate is not None:
        gpu_phases = {phase: max(gpu[phase] for gpu in estimate.per_gpu.values()) for phase in estimate.phases}
        host_phases = {phase: max(node[phase] for node in estimate.host_per_node.values())
                       for phase in estimate.host_phases} if estimate.host_per_node else {}
    return HybridPlan(roles=roles, engine=engine, overlap_switches=overlap, read_ahead=read_ahead,
                      build_during_loads=engines_may_build_during_loads(facts.config, engine, estimate),
                      gpu_memory_gib=facts.gpu_gib, host_memory_gib=facts.host_gib, gpu_phases=gpu_phases,
                      host_phases=host_phases, layout=layout)
