"""The typed configuration of :mod:`rlhfkit.deepspeed_engine` and the DeepSpeed JSON dict it builds.

Pure Python: importing this module (and building the dict) needs neither deepspeed nor transformers, so configs are
validated and printed on any machine. The learning-rate schedule is a plain function (:func:`lr_factor`) applied
through a ``torch.optim.lr_scheduler.LambdaLR``, so its values are exactly the documented formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["DeepSpeedEngineConfig", "Role", "ROLES", "lr_factor"]

Role = Literal["actor", "critic", "reference", "reward"]
ROLES: tuple[str, ...] = ("actor", "critic", "reference", "reward")
_OPTIMIZERS = ("fused_adam", "torch_adamw")
_SCHEDULES = ("constant", "cosine")
_NORMALIZATIONS = ("per_micro_batch", "global")


def lr_factor(step: int, *, warmup_steps: int, schedule: str, total_steps: int | None, min_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Warmup is linear and never starts at 0: step ``k < warmup_steps`` uses ``(k + 1) / warmup_steps``. After warmup,
    ``"constant"`` stays at 1; ``"cosine"`` decays as ``min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2`` with
    ``p = (k - warmup_steps) / (total_steps - warmup_steps)`` clamped to [0, 1], so step ``warmup_steps`` uses the
    full rate and every step from ``total_steps`` on uses ``min_ratio``.
    """
    if step < 0:
        raise ValueError(f"step={step}; optimizer steps are counted from 0")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError("schedule='cosine' needs total_steps")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True)
class DeepSpeedEngineConfig:
    """How one model is wrapped in DeepSpeed.

    Attributes:
        zero_stage: ZeRO stage 0 (plain data parallel), 1 (optimizer states sharded), 2 (+ gradients) or 3
            (+ parameters).
        bf16: keep parameters and compute in bfloat16 (the optimizer keeps fp32 master weights); False = fp32.
        optimizer: ``"fused_adam"`` — DeepSpeed's AdamW (``{"type": "AdamW"}``: FusedAdam on GPU, DeepSpeedCPUAdam
            with optimizer offload; both are JIT-compiled on first use); ``"torch_adamw"`` — ``torch.optim.AdamW``
            (``torch_adam: true``), the choice on CPU. ZeRO-3 ``offload_states`` covers master weights and Adam states
            only for FusedAdam; with torch AdamW :class:`~rlhfkit.deepspeed_engine.DeepSpeedEngine` moves those itself.
        learning_rate, betas, eps, weight_decay: AdamW hyper-parameters (decoupled weight decay).
        offload_optimizer: keep fp32 master weights and optimizer states in CPU memory (ZeRO-Offload, stage >= 1).
        offload_params: keep ZeRO-3 parameter shards in CPU memory (ZeRO-Infinity; needs zero_stage=3 and
            offload_optimizer=True).
        offload_optimizer_ratio: with ``offload_optimizer`` at ZeRO-3, the share of the optimizer's sub-groups (in
            parameter order, the last ones) whose fp32 masters, fp32 gradients and Adam moments live in host memory;
            the first ``int((1 - ratio) * num_sub_groups)`` stay on the GPU (DeepSpeed's ``offload_optimizer.ratio``,
            "Twin-Flow"). Below 1 it needs ``optimizer="fused_adam"`` (DeepSpeedCPUAdam; the GPU part steps with
            ``torch.optim.AdamW``) and a constant learning rate without warmup: DeepSpeed builds the GPU part's
            optimizer with the initial rate, and the schedule does not reach it.
        sub_group_elements: ZeRO-3's ``sub_group_size``: parameters are cut, in order, into sub-groups of at least
            this many elements (a larger tensor is a sub-group of its own); the optimizer steps one sub-group at a
            time, and ``offload_optimizer_ratio`` places whole sub-groups. DeepSpeed's default is 1e9.
        param_group_elements: ZeRO-0/1/2: the trainable parameters go to the optimizer in parameter groups of at most
            this many elements (in order, whole tensors; a larger tensor is a group of its own). ZeRO-1/2's
            optimizer step of a bf16 model flattens one group's gradients and casts them to fp32 at a time, so its
            transient memory is (2 + 4) bytes times one group, not the whole partition (17 GiB for a 3B model in one
            group, 1.1 GiB in groups of 2e8). The groups share every hyper-parameter; the update is the same.
        gradient_checkpointing: recompute activations in backward (HF ``gradient_checkpointing_enable``, non-reentrant).
        gradient_clipping: clip the global gradient 2-norm to this value; 0 disables clipping.
        lr_schedule, lr_warmup_steps, lr_total_steps, lr_min_ratio: see :func:`lr_factor`; ``lr_total_steps`` is
            required for ``"cosine"``. Steps are optimizer steps (accumulation boundaries).
        micro_batch_size: sequences per micro-batch per rank, for DeepSpeed's bookkeeping (rlhfkit feeds packed token
            streams, so this only labels throughput).
        gradient_accumulation_steps: micro-batches (``backward`` calls) per optimizer step.
        loss_normalization: ``"per_micro_batch"`` — each loss is a mean over its own micro-batch; the engine averages
            gradients over micro-batches and ranks (DeepSpeed's default). ``"global"`` — each loss was already divided
            by counts of the *whole* step on *all* ranks (``rlhfkit.losses`` with ``num_tokens``/``num_seqs`` from
            ``rlhfkit.packing.global_counts``); the engine then sums gradients over micro-batches and ranks.
        attn_implementation: passed to ``from_pretrained``; None keeps transformers' default (sdpa).
        value_head_init_std: std of the normal init of a fresh critic/reward value head; None keeps the model's
            ``initializer_range`` init.
        param_persistence_threshold: ZeRO-3 parameters with fewer elements stay gathered between forwards
            (DeepSpeed's ``stage3_param_persistence_threshold``); sleep() releases them too.
        empty_cache_on_sleep: ``sleep()`` returns the process's cached CUDA blocks (and cuBLAS workspaces) to the
            driver, so that the other processes on the GPU can use that memory; the next phase allocates them again.
            False keeps them for the next wake: shorter switches, but the process holds its activations' blocks
            while asleep (the hybrid fit check counts them).
        fused_kernels: ``"liger"`` swaps transformers' RMSNorm, rotary embedding and SwiGLU MLP for Liger-Kernel's
            Triton kernels (``rlhfkit[liger]``, CUDA only): the same arithmetic in fewer kernel launches, for steps
            that are host-bound (a 135M model's optimizer step launches ~12,500 kernels). The LM head and the
            log-probs stay rlhfkit's. Liger patches transformers' module of the architecture for the whole process
            (its rotary function and layer classes), so every model of that architecture built afterwards in the
            process gets the kernels too. None keeps transformers' modules.
        compile_layers: ``torch.compile`` each decoder layer (the model's ``_no_split_modules`` classes) with dynamic
            shapes before DeepSpeed wraps it. The layers share one compiled graph per kind of call (training,
            no-grad), whose fused kernels replace most of an eager layer's small elementwise launches: for steps that
            are host-bound, as ``fused_kernels``, with nothing to install (a C compiler and, on a GPU, Triton: both
            come with torch's CUDA wheels). The first call of each kind compiles, which delays the first step.
            ZeRO-0/1/2 only (ZeRO-3's parameter hooks run inside the layers).
        bucket_elements: DeepSpeed's ``reduce_bucket_size`` and ``allgather_bucket_size`` (ZeRO-1/2; ZeRO-3's
            ``reduce_bucket_size``), in elements. ZeRO-1/2 keep a gradient bucket of this many elements on the GPU
            while training: DeepSpeed's default (5e8) is 2 GiB of fp32, 5e7 is 200 MiB.
    """

    zero_stage: int = 3
    bf16: bool = True
    optimizer: Literal["fused_adam", "torch_adamw"] = "fused_adam"
    learning_rate: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_optimizer_ratio: float = 1.0
    sub_group_elements: int = 1_000_000_000
    param_group_elements: int = 200_000_000
    gradient_checkpointing: bool = False
    gradient_clipping: float = 1.0
    lr_schedule: Literal["constant", "cosine"] = "constant"
    lr_warmup_steps: int = 0
    lr_total_steps: int | None = None
    lr_min_ratio: float = 0.0
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    loss_normalization: Literal["per_micro_batch", "global"] = "per_micro_batch"
    attn_implementation: str | None = None
    value_head_init_std: float | None = None
    param_persistence_threshold: int = 100_000
    bucket_elements: int = 50_000_000
    empty_cache_on_sleep: bool = True
    fused_kernels: Literal["liger"] | None = None
    compile_layers: bool = False

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_numbers()
        if self.offload_params and (self.zero_stage != 3 or not self.offload_optimizer):
            raise ValueError(f"DeepSpeedEngineConfig.offload_params=True needs zero_stage=3 and offload_optimizer=True "
                             f"(got zero_stage={self.zero_stage}, offload_optimizer={self.offload_optimizer})")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("DeepSpeedEngineConfig.offload_optimizer=True needs zero_stage >= 1 (got zero_stage=0)")
        self._check_partial_offload()
        total = self.lr_total_steps
        if self.lr_schedule == "cosine" and (total is None or total <= self.lr_warmup_steps):
            raise ValueError(f"DeepSpeedEngineConfig.lr_total_steps={self.lr_total_steps}; lr_schedule='cosine' needs "
                             f"lr_total_steps > lr_warmup_steps={self.lr_warmup_steps}")

    def _check_partial_offload(self) -> None:
        ratio = self.offload_optimizer_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"DeepSpeedEngineConfig.offload_optimizer_ratio={ratio!r}; a fraction in (0, 1] (1: the "
                             "whole optimizer in host memory; for none, offload_optimizer=False)")
        for name in ("sub_group_elements", "param_group_elements"):
            elements = getattr(self, name)
            if isinstance(elements, bool) or not isinstance(elements, int) or elements < 1:
                raise ValueError(f"DeepSpeedEngineConfig.{name}={elements!r}; must be an int >= 1")
        if ratio == 1:
            return
        if not (self.offload_optimizer and self.zero_stage == 3 and self.optimizer == "fused_adam"):
            raise ValueError(f"DeepSpeedEngineConfig.offload_optimizer_ratio={ratio} needs zero_stage=3, "
                             f"offload_optimizer=True and optimizer='fused_adam' (got zero_stage={self.zero_stage}, "
                             f"offload_optimizer={self.offload_optimizer}, optimizer={self.optimizer!r})")
        if self.lr_schedule != "constant" or self.lr_warmup_steps:
            raise ValueError(f"DeepSpeedEngineConfig.offload_optimizer_ratio={ratio} with lr_schedule="
                             f"{self.lr_schedule!r}, lr_warmup_steps={self.lr_warmup_steps}: DeepSpeed steps the GPU "
                             "part with its own optimizer, which the schedule does not reach; use a constant rate "
                             "without warmup, or offload_optimizer_ratio=1")

    def _check_choices(self) -> None:
        if not isinstance(self.empty_cache_on_sleep, bool):
            raise TypeError(f"DeepSpeedEngineConfig.empty_cache_on_sleep={self.empty_cache_on_sleep!r}; must be "
                            "True or False")
        if not isinstance(self.compile_layers, bool):
            raise TypeError(f"DeepSpeedEngineConfig.compile_layers={self.compile_layers!r}; must be True or False")
        if self.compile_layers and self.zero_stage == 3:
            raise ValueError("DeepSpeedEngineConfig.compile_layers=True with zero_stage=3: ZeRO-3 gathers each "
                             "layer's parameters in hooks inside the layer, which compiled layers do not run "
                             "through; use zero_stage 0, 1 or 2, or compile_layers=False")
        if self.fused_kernels not in (None, "liger"):
            raise ValueError(f"DeepSpeedEngineConfig.fused_kernels={self.fused_kernels!r}; expected None or 'liger'")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"DeepSpeedEngineConfig.zero_stage={self.zero_stage!r}; expected 0, 1, 2 or 3")
        for name, choices in (("optimizer", _OPTIMIZERS), ("lr_schedule", _SCHEDULES),
                              ("loss_normalization", _NORMALIZATIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"DeepSpeedEngineConfig.{name}={getattr(self, name)!r}; expected one of {choices}")
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise TypeError(f"DeepSpeedEngineConfig.betas={self.betas!r}; expected a tuple of two floats")

    def _check_numbers(self) -> None:
        if not self.learning_rate > 0:
            raise ValueError(f"DeepSpeedEngineConfig.learning_rate={self.learning_rate}; must be > 0")
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"DeepSpeedEngineConfig.betas={self.betas}; each must be in [0, 1)")
        for name in ("eps", "weight_decay", "gradient_clipping", "lr_warmup_steps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DeepSpeedEngineConfig.{name}={getattr(self, name)}; must be >= 0")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"DeepSpeedEngineConfig.lr_min_ratio={self.lr_min_ratio}; must be in [0, 1]")
        for name in ("micro_batch_size", "gradient_accumulation_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DeepSpeedEngineConfig.{name}={getattr(self, name)!r}; must be an int >= 1")
        if self.value_head_init_std is not None and not self.value_head_init_std > 0:
            raise ValueError(f"DeepSpeedEngineConfig.value_head_init_std={self.value_head_init_std}; must be > 0 "
                             "or None")
        if isinstance(self.bucket_elements, bool) or not isinstance(self.bucket_elements, int) \
                or self.bucket_elements < 1:
            raise ValueError(f"DeepSpeedEngineConfig.bucket_elements={self.bucket_elements!r}; must be an int >= 1")
        if self.param_persistence_threshold < 0:
            raise ValueError(f"DeepSpeedEngineConfig.param_persistence_threshold={self.param_persistence_threshold}; "
                             "must be >= 0")

    def param_group_ranges(self, sizes: Sequence[int]) -> list[range]:
        """Indices of ``sizes`` (trainable parameters' element counts, in order) per optimizer parameter group: at
        most :attr:`param_group_elements` elements each, whole tensors (a larger one is a group of its own)."""
        starts: list[int] = []
        total = 0
        for index, size in enumerate(sizes):
            if not starts or total + size > self.param_group_elements:
                starts.append(index)
                total = 0
            total += size
        return [range(start, stop) for start, stop in zip(starts, starts[1:] + [len(sizes)])]

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        return self.learning_rate * lr_factor(step, warmup_steps=self.lr_warmup_steps, schedule=self.lr_schedule,
                                              total_steps=self.lr_total_steps, min_ratio=self.lr_min_ratio)

    def to_deepspeed_dict(self, *, with_optimizer: bool = True) -> dict[str, Any]:
        """The DeepSpeed JSON config. The LR schedule is not in it (the engine passes a LambdaLR of :func:`lr_factor`);
        ``train_batch_size`` is left for DeepSpeed to derive from the world size."""
        # Without an optimizer ZeRO-1/2 have nothing to shard (DeepSpeed asserts an optimizer): run them as stage 0.
        stage = self.zero_stage if with_optimizer or self.zero_stage == 3 else 0
        zero: dict[str, Any] = {"stage": stage}
        if stage >= 1:
            zero.update(contiguous_gradients=True, overlap_comm=False, reduce_scatter=True,
                        reduce_bucket_size=self.bucket_elements)
            if stage < 3:
                zero["allgather_bucket_size"] = self.bucket_elements
        if self.zero_stage == 3:
            zero["stage3_param_persistence_threshold"] = self.param_persistence_threshold
            zero["stage3_gather_16bit_weights_on_model_save"] = False
            zero["sub_group_size"] = self.sub_group_elements
        if self.offload_optimizer and with_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            if self.offload_optimizer_ratio < 1:
                zero["offload_optimizer"]["ratio"] = self.offload_optimizer_ratio
        if self.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "bf16": {"enabled": self.bf16},
            "zero_optimization": zero,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        if with_optimizer:
            params: dict[str, Any] = {"lr": self.learning_rate, "betas": list(self.betas), "eps": self.eps,
                                      "weight_decay": self.weight_decay}
            if self.optimizer == "torch_adamw":
                params["torch_adam"] = True
                params["adam_w_mode"] = True
                config["zero_force_ds_cpu_optimizer"] = False
            config["optimizer"] = {"type": "AdamW", "params": params}
            config["gradient_clipping"] = self.gradient_clipping
            config["zero_allow_untested_optimizer"] = True
        return config
