"""A sleepable DeepSpeed ZeRO-0/1/2/3 wrapper around one HF model of an RLHF run.

What it does: wraps an actor (causal LM + AdamW), a critic (backbone + scalar value head + AdamW), or a reference /
reward model (no optimizer) in DeepSpeed from a typed :class:`DeepSpeedEngineConfig`, and gives it
- forwards on a :class:`~rlhfkit.types.PackedBatch`: ``forward_logprobs`` (``[T]``, via
  :func:`rlhfkit.losses.model_logprobs`), ``forward_values`` (``[T]``), ``forward_rewards`` (``[N]``);
- ``backward(loss)`` and ``step() -> {"loss", "grad_norm", "lr", "global_step"}``;
- ``sleep()`` / ``wake_up()``: parameters, gradients and optimizer states to pinned host memory and back, with
  ``sleep(keep_weights=True)`` leaving the bf16 weights (ZeRO-3: the shards) on the GPU for a weight sync;
- ``save_checkpoint`` / ``load_checkpoint`` (DeepSpeed state + HF export in one atomic directory) and
  :func:`latest_checkpoint`;
- ``named_parameters_for_sync()``: ``(hf_name, tensor)`` pairs, ZeRO-3 shards gathered a bucket at a time.

What it does not do: own a training loop, compute losses or advantages (:mod:`rlhfkit.losses`), decide *when* to
sleep (your loop, guarded by :mod:`rlhfkit.phase`), start processes (torchrun or :mod:`rlhfkit.workers`), or send
weights (:mod:`rlhfkit.weight_sync` consumes the stream). Tensor/pipeline/sequence parallelism are not supported.

Needs ``rlhfkit[deepspeed]``. The process group must exist or be creatable from the usual RANK/WORLD_SIZE/
MASTER_ADDR/MASTER_PORT environment. See ``docs/deepspeed_engine.md`` for what runs on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from rlhfkit._optional import require
from rlhfkit.checkpoint import latest_checkpoint
from rlhfkit.deepspeed_engine import _checkpoint as ckpt
from rlhfkit.deepspeed_engine import _sleep as sleeping
from rlhfkit.deepspeed_engine._config import ROLES, DeepSpeedEngineConfig, Role, lr_factor
from rlhfkit.deepspeed_engine._models import (
    ValueModel,
    as_value_model,
    compile_decoder_layers,
    load_hf_model,
    sequence_scores,
    token_aligned_values,
)
from rlhfkit.losses import model_logprobs
from rlhfkit.packing import packed_inputs
from rlhfkit.types import PackedBatch

__all__ = ["DeepSpeedEngine", "DeepSpeedEngineConfig", "ValueModel", "latest_checkpoint", "lr_factor"]

logger = logging.getLogger(__name__)
_GIB = 1024**3
# finish_wake_behind() copies in pieces of this size, one in flight at a time: the forward-backward's own small copies
# (its inputs, a scalar read back) wait behind one piece, not behind the whole transfer (bench/copy_overlap.py)
WAKE_CHUNK_BYTES = 64 * 1024**2


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _lambda_scheduler(optimizer, *, config: DeepSpeedEngineConfig):
    factor = functools.partial(lr_factor, warmup_steps=config.lr_warmup_steps, schedule=config.lr_schedule,
                               total_steps=config.lr_total_steps, min_ratio=config.lr_min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class DeepSpeedEngine:
    """One model of one role in DeepSpeed, on every rank of its data-parallel group.

    Args:
        model: an HF causal LM (actor, reference), or an HF ``*ForSequenceClassification`` model with
            ``num_labels=1`` / a :class:`ValueModel` (critic, reward), on CPU or on the device;
            DeepSpeed moves and, under ZeRO-3, partitions it.
        role: ``"actor"``, ``"critic"`` (trained, with optimizer), ``"reference"``, ``"reward"`` (no optimizer).
        config: the DeepSpeed configuration.
        name: the name used in logs and errors (default: the role), e.g. ``"critic"`` or ``"actor-policy"``.
        ds_config_overrides: deep-merged into ``config.to_deepspeed_dict()`` — an escape hatch for DeepSpeed keys
            the typed config does not cover (e.g. ``{"zero_optimization": {"reduce_bucket_size": 5e8}}``).
        lora: an actor's :class:`rlhfkit.lora.LoraConfig`: the model is wrapped with peft adapters, only they train
            (the optimizer holds only them) and :meth:`named_parameters_for_sync` yields only them.
    """

    def __init__(self, model: torch.nn.Module, *, role: Role, config: DeepSpeedEngineConfig, name: str | None = None,
                 ds_config_overrides: Mapping[str, Any] | None = None, lora: Any = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role={role!r}; expected one of {ROLES}")
        if not isinstance(config, DeepSpeedEngineConfig):
            raise TypeError(f"config must be a DeepSpeedEngineConfig, got {type(config).__name__}")
        if lora is not None:
            from rlhfkit.lora import LoraConfig, apply_lora

            if not isinstance(lora, LoraConfig):
                raise TypeError(f"lora={lora!r}; expected an rlhfkit.lora.LoraConfig or None")
            if role != "actor":
                raise ValueError(f"lora= is given for role {role!r}; LoRA adapters are supported on the actor only")
            model = apply_lora(model, lora)
        deepspeed = require("deepspeed", user="rlhfkit.deepspeed_engine")
        self.role, self.name, self.config, self.lora = role, name or role, config, lora
        self.has_optimizer = role in ("actor", "critic")
        module = as_value_model(model) if role in ("critic", "reward") else model
        if config.gradient_checkpointing and self.has_optimizer:
            hf_model = module.backbone if isinstance(module, ValueModel) else module
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.compile_layers:
            compile_decoder_layers(module)
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed()
        ds_config = _deep_merge(config.to_deepspeed_dict(with_optimizer=self.has_optimizer), ds_config_overrides or {})
        kwargs: dict[str, Any] = {"model": module, "config": ds_config}
        if self.has_optimizer:
            trainable = [p for p in module.parameters() if p.requires_grad]
            # ZeRO-3 cuts its own sub-groups; ZeRO-1/2's step casts one group's gradients to fp32 at a time
            kwargs["model_parameters"] = trainable if config.zero_stage == 3 else [
                {"params": trainable[r.start:r.stop]}
                for r in config.param_group_ranges([param.numel() for param in trainable])]
            kwargs["lr_scheduler"] = functools.partial(_lambda_scheduler, config=config)
        self.ds_engine = deepspeed.initialize(**kwargs)[0]
        self.ds_engine.train(self.has_optimizer)
        self._sleep_plan = sleeping.plan_sleep(
            self.ds_engine, zero_stage=config.zero_stage, has_optimizer=self.has_optimizer,
            offload_optimizer=config.offload_optimizer, offload_params=config.offload_params)
        self._offloaders = {name: sleeping.StorageOffloader() for name in ("own_master", "own_params", "own_fixed")}
        self._offloaded: set[str] = set()
        self._offloaded_bytes = 0  # off the device since the last wake: copied, or already on the host
        self._weight_writes = 0  # writes to the weights we know of (load_checkpoint, weights_changed())
        self._writes_at_wake = -1  # _weight_writes at the last wake_up (-1: never woken)
        self._asleep = False
        self._weights_kept = False
        self._optimizer_kept = False  # asleep with the optimizer's states on the device (sleep(keep_optimizer=True))
        self._later_bytes = 0  # bytes of the states a wake_up(defer_optimizer=True) left for finish_wake()
        self._wake_lock = threading.Lock()  # finish_wake() in another thread against sleep() and the step
        self._wake_stream: Any = None  # the CUDA stream of finish_wake_behind()'s copies
        self._pending_losses: list[torch.Tensor] = []
        logger.info("'%s' (%s) ready: ZeRO-%d, %s, sleep plan: %s", self.name, role, config.zero_stage,
                    "bf16" if config.bf16 else "fp32", self._sleep_plan.note)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, role: Role, config: DeepSpeedEngineConfig, name: str | None = None,
                        trust_remote_code: bool = False, ds_config_overrides: Mapping[str, Any] | None = None,
                        lora: Any = None) -> DeepSpeedEngine:
        """Load ``path`` (an HF folder) for ``role`` and wrap it; critics/rewards get ``num_labels=1`` value heads
        (fresh when the folder holds a causal LM, initialised with ``config.value_head_init_std`` when set).
        The same as ``DeepSpeedEngine(DeepSpeedEngine.read_pretrained(path, role=role, config=config), ...)``."""
        model = cls.read_pretrained(path, role=role, config=config, trust_remote_code=trust_remote_code)
        return cls(model, role=role, config=config, name=name, ds_config_overrides=ds_config_overrides, lora=lora)

    @staticmethod
    def read_pretrained(path: str | Path, *, role: Role, config: DeepSpeedEngineConfig,
                        trust_remote_code: bool = False) -> torch.nn.Module:
        """The HF model of ``path`` for ``role`` as :meth:`from_pretrained` builds it (dtype, attention, value head,
        fused kernels from ``config``), in host memory: the part of a load that needs no GPU, for doing it early or
        beside other work (the hybrid's trainers read their models in parallel, then place them one at a time)."""
        if role not in ROLES:
            raise ValueError(f"role={role!r}; expected one of {ROLES}")
        return load_hf_model(path, role=role, bf16=config.bf16, attn_implementation=config.attn_implementation,
                             value_head_init_std=config.value_head_init_std, trust_remote_code=trust_remote_code,
                             fused_kernels=config.fused_kernels)

    # ------------------------------------------------------------------ properties
    @property
    def module(self) -> torch.nn.Module:
        """The wrapped HF model (a :class:`ValueModel` for critics and reward models)."""
        return self.ds_engine.module

    @property
    def device(self) -> torch.device:
        device = self.ds_engine.device
        return device if isinstance(device, torch.device) else torch.device(device)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.config.bf16 else torch.float32

    @property
    def is_asleep(self) -> bool:
        return self._asleep

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (accumulation boundaries), restored by load_checkpoint."""
        return int(self.ds_engine.global_steps)

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank()

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    def _require_awake(self, method: str) -> None:
        if self._asleep:
            raise RuntimeError(f"{method}() called while '{self.name}' is asleep; call wake_up() first")

    def _require_role(self, method: str, roles: tuple[str, ...]) -> None:
        if self.role not in roles:
            raise RuntimeError(f"{method}() is not available on '{self.name}' (role {self.role!r}); it needs a role "
                               f"in {roles}")

    # ------------------------------------------------------------------ forward / backward / step
    def forward_logprobs(self, batch: PackedBatch, *, temperature: float = 1.0, loss_tokens_only: bool = False,
                         adapters: bool = True) -> torch.Tensor:
        """``[T]`` float32 token-aligned log-probs (see :func:`rlhfkit.losses.model_logprobs`; ``loss_tokens_only``:
        only of the loss-mask tokens, 0 elsewhere, with the LM head on those rows only). Differentiable on the
        actor when grad is enabled; the reference model always runs without grad. ``adapters=False`` (a LoRA actor
        only): the base model's log-probs, adapters switched off for this forward and without grad — the reference
        policy of a LoRA run, with no second copy of the model."""
        self._require_awake("forward_logprobs")
        self._require_role("forward_logprobs", ("actor", "reference"))
        if adapters:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.has_optimizer):
                return model_logprobs(self.ds_engine, batch.to(self.device), temperature=temperature,
                                      loss_tokens_only=loss_tokens_only)
        if self.lora is None:
            raise ValueError(f"forward_logprobs(adapters=False) on '{self.name}', which has no LoRA adapters; only a "
                             "LoRA actor has a base model to fall back to")
        with torch.no_grad(), self.ds_engine.module.disable_adapter():
            return model_logprobs(self.ds_engine, batch.to(self.device), temperature=temperature,
                                  loss_tokens_only=loss_tokens_only)

    def _raw_values(self, batch: PackedBatch, method: str) -> torch.Tensor:
        self._require_awake(method)
        self._require_role(method, ("critic", "reward"))
        batch = batch.to(self.device)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.has_optimizer):
            return self.ds_engine(**packed_inputs(self.ds_engine, batch))[0]

    def forward_values(self, batch: PackedBatch) -> torch.Tensor:
        """``[T]`` float32 values token aligned like log-probs: entry ``t`` is the value of the state in which token
        ``t`` was chosen (the head at ``t - 1``); 0 at sequence starts and on padding."""
        return token_aligned_values(self._raw_values(batch, "forward_values"), batch.to(self.device))

    def forward_rewards(self, batch: PackedBatch) -> torch.Tensor:
        """``[N]`` float32: the head's output at each sequence's last token (a reward model's score)."""
        return sequence_scores(self._raw_values(batch, "forward_rewards"), batch.to(self.device))

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch loss (see ``DeepSpeedEngineConfig.loss_normalization`` for its scaling)."""
        self._require_awake("backward")
        self._require_role("backward", ("actor", "critic"))
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(f"loss must be a scalar tensor, got {type(loss).__name__} "
                             f"{tuple(getattr(loss, 'shape', ()))}")
        self._pending_losses.append(loss.detach())
        if self.config.loss_normalization == "global":
            # The loss is already a share of the global (all micro-batches, all ranks) objective: undo DeepSpeed's
            # averaging so gradients sum over micro-batches and ranks.
            self.ds_engine.backward(loss * self.world_size, scale_wrt_gas=False)
        else:
            self.ds_engine.backward(loss)

    def step(self) -> dict[str, float]:
        """Call once after every ``backward``. At a gradient-accumulation boundary the optimizer steps and this
        returns ``{"loss", "grad_norm", "lr", "global_step"}``; between boundaries it returns ``{}``. ``loss`` is this
        rank's: the mean of its micro-batch losses (``"per_micro_batch"``) or their sum (``"global"``: its share of
        the global objective); ``grad_norm`` is the global pre-clip norm; ``lr`` the rate this step used."""
        self._require_awake("step")
        self._require_role("step", ("actor", "critic"))
        boundary = self.ds_engine.is_gradient_accumulation_boundary()
        lr = float(self.ds_engine.get_lr()[0])
        if not boundary:
            self.ds_engine.step()  # DeepSpeed counts the micro-step; the optimizer waits for the boundary
            return {}
        grad_norm = self.optimizer_step()
        losses, self._pending_losses = self._pending_losses, []
        total = float(torch.stack(losses).float().sum()) if losses else float("nan")
        loss = total if self.config.loss_normalization == "global" else total / max(1, len(losses))
        return {"loss": loss, "lr": lr,
                "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                "global_step": float(self.global_step)}

    def optimizer_step(self) -> float | None:
        """DeepSpeed's step at an accumulation boundary, for callers that own the boundary (``ds_config_overrides=
        {"managed_gradient_accumulation": False}``, as rlhfkit's trainer worker); returns the global pre-clip gradient
        norm (None without gradients). :meth:`step` uses it at its boundaries."""
        self.finish_wake()
        own_norm = self._zero0_grad_norm()
        self.ds_engine.step()
        grad_norm = self.ds_engine.get_global_grad_norm()
        return own_norm if grad_norm is None else float(grad_norm)

    def discard_gradients(self) -> None:
        """Drop every gradient accumulated since the last optimizer step, without stepping: the next ``backward``
        starts a new accumulation, exactly as after a step (the weights, optimizer states, step count and schedule
        are untouched). For a caller that gives up on a step (a loss that failed part-way through the micro-batches)
        instead of training on part of it. Local to this rank; call it on every rank."""
        self._require_awake("discard_gradients")
        self._require_role("discard_gradients", ("actor", "critic"))
        self.finish_wake()
        engine, optimizer = self.ds_engine, self.ds_engine.optimizer
        stage = self.config.zero_stage
        # What DeepSpeed itself clears when its step skips an overflowing update (stage_1_and_2's step, stage3's
        # _overflow_clean_up), and the accumulation window its step() resets: the same end of an accumulation,
        # without the update.
        if stage in (1, 2) and hasattr(optimizer, "averaged_gradients"):
            optimizer.zero_grad(set_to_none=True)
            release = getattr(optimizer, "_release_preflattened_grad_buffers", None)
            if release is not None:
                release()
            for buffers in (optimizer.averaged_gradients, getattr(optimizer, "all_grad_tensors", {})):
                for key in list(buffers):
                    buffers[key] = None
            if optimizer.cpu_offload:
                optimizer.reset_cpu_buffers()
                optimizer._offload_accumulated_param_ids = set()
            optimizer.micro_step_id = -1  # stage_1_and_2.INITIAL_MICRO_STEP_ID: the next backward copies, not adds
        elif stage == 3:
            optimizer.zero_grad(set_to_none=True)  # also restarts its micro-step count (copy, not add)
            if optimizer.offload_optimizer:
                optimizer.reset_cpu_buffers()
            else:
                optimizer.averaged_gradients = {}
            optimizer._offload_boundary_param_ids = set()
        elif hasattr(optimizer, "clear_hp_grads"):  # ZeRO-0 + bf16: DeepSpeed's BF16_Optimizer
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.zero_grad()
        if hasattr(engine, "_unmanaged_backward_count"):
            engine._unmanaged_backward_count = 0  # the samples the next step counts
        self._pending_losses.clear()

    def _zero0_grad_norm(self) -> float | None:
        """DeepSpeed records no gradient norm at stage 0 (no bf16/fp16 wrapper): compute it before the step."""
        if self.config.zero_stage != 0:
            return None
        grads = [p.grad.detach() for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return None
        return float(torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)])))

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, *, keep_weights: bool = False, keep_optimizer: bool = False) -> dict[str, float]:
        """Move this rank's parameters, gradients and optimizer states to pinned host memory, then empty the CUDA
        cache (unless ``DeepSpeedEngineConfig.empty_cache_on_sleep=False``). ``keep_weights=True`` leaves the bf16
        weights (ZeRO-3: this rank's shards) on the device so that :meth:`named_parameters_for_sync` still works; a
        later ``sleep()`` moves them too. ``keep_optimizer=True`` leaves the optimizer's states (fp32 master weights,
        Adam moments: at bf16 with Adam 12 of the 16 bytes a parameter holds) on the device, where the GPU has room
        for them beside the next phase: the wake then has only the weights and gradients to bring back; a later
        ``sleep(keep_optimizer=False)`` moves them too. Returns timing/memory stats
        (seconds, and allocated/reserved bytes before and after on CUDA) and ``bytes_moved``: the bytes this call
        copied device -> host (rlhfkit's copies plus the state storages DeepSpeed's ``offload_states`` moved).

        Parameters no optimizer updates (a reference's or reward model's, the frozen base under LoRA) are copied to
        host only when they may have changed since the last wake: otherwise the pinned copy of the last sleep still
        holds them, their device memory is freed without a copy, and ``bytes_kept_on_host`` counts them. A write is
        known from :meth:`load_checkpoint`, from an in-place op on the parameter (its version counter), or from
        :meth:`weights_changed`, which code writing them another way (``param.data.copy_``) must call."""
        with self._wake_lock:  # a finish_wake() running in another thread ends first
            return self._sleep(keep_weights=keep_weights, keep_optimizer=keep_optimizer)

    def _sleep(self, *, keep_weights: bool, keep_optimizer: bool = False) -> dict[str, float]:
        if (self._asleep and (keep_weights or not self._weights_kept)
                and (keep_optimizer or not self._optimizer_kept)):
            return {}
        if self._sleep_plan.unsupported or (self.has_optimizer and self.config.zero_stage == 0 and self.config.bf16):
            raise NotImplementedError(f"sleep() of '{self.name}' is not supported: "
                                      + (self._sleep_plan.unsupported or "ZeRO-0 + bf16 + optimizer (DeepSpeed's "
                                         "bf16 wrapper keeps private flat buffers); use zero_stage >= 1"))
        before = sleeping.device_memory(self.device)
        start = time.perf_counter()
        self._offloaded, moved, kept = sleeping.offload_engine(
            self.ds_engine, self._sleep_plan, self._offloaders, zero_stage=self.config.zero_stage,
            keep_weights=keep_weights, done=self._offloaded, empty_cache=self.config.empty_cache_on_sleep,
            trains=self.has_optimizer, fixed_unchanged=self._weight_writes == self._writes_at_wake,
            keep_optimizer=keep_optimizer)
        seconds = time.perf_counter() - start
        # weights_kept first: a thread streaming the kept weights meanwhile never sees "asleep without its weights"
        self._weights_kept = keep_weights and (self._weights_kept or not self._asleep)  # moved weights stay moved
        # kept: this sleep was asked to keep them and none is in host memory (an earlier sleep may have moved them)
        self._optimizer_kept = (keep_optimizer and self.has_optimizer
                                and not self._offloaded & sleeping.OPTIMIZER_STATES)
        self._asleep = True
        self._offloaded_bytes += moved + kept + self._later_bytes  # the states a wake left for later are still off
        self._later_bytes = 0
        kept_what = [what for what, flag in (("weights", keep_weights), ("optimizer", self._optimizer_kept)) if flag]
        stats = self._log_transition("asleep" + (f" ({' and '.join(kept_what)} kept)" if kept_what else ""), before,
                                     seconds)
        stats["bytes_moved"] = float(moved)
        stats["bytes_kept_on_host"] = float(kept)
        stats["pin_seconds"] = sum(offloader.last_pin_seconds for offloader in self._offloaders.values())
        stats["resident_state_bytes"] = float(self.resident_state_bytes(include_weights=not keep_weights,
                                                                        include_optimizer=not self._optimizer_kept))
        if stats["resident_state_bytes"] and not self.config.offload_params:
            logger.warning("'%s' asleep but %.1f MiB of its states are still on the GPU", self.name,
                           stats["resident_state_bytes"] / 2**20)
        return stats

    def resident_state_bytes(self, *, include_weights: bool = True, include_optimizer: bool = True) -> int:
        """Bytes of this rank's parameter, gradient, master-weight and optimizer-state storages that are on a GPU
        now (0 after a complete ``sleep()``: checked by storage, not by flags). ``include_weights=False`` leaves out
        the bf16 weights (what ``sleep(keep_weights=True)`` keeps), ``include_optimizer=False`` the fp32 masters and
        optimizer states (what ``sleep(keep_optimizer=True)`` keeps)."""
        return sleeping.resident_state_bytes(self.ds_engine, self.config.zero_stage, include_weights=include_weights,
                                             include_optimizer=include_optimizer)

    def prepare_sleep(self) -> dict[str, float]:
        """Allocate the pinned host buffers now by running one sleep/wake cycle (the engine must be awake, and have
        taken one optimizer step so that its optimizer states exist). The first ``sleep()`` otherwise pays for the
        pinning (seconds per GB: most of the first sleep's time); call
        this once early when a predictable first generation phase matters more than early host memory.
        Returns ``{"sleep_seconds", "wake_seconds"}``."""
        self._require_awake("prepare_sleep")
        slept = self.sleep()
        woke = self.wake_up()
        return {"sleep_seconds": slept.get("seconds", 0.0), "wake_seconds": woke.get("seconds", 0.0)}

    def weights_changed(self) -> None:
        """Say that this engine's parameters were written by code :meth:`sleep` cannot see (writes through
        ``.data``, or into ZeRO-3 shards): the next sleep copies the parameters that do not train to host again
        instead of trusting the pinned copy of the last one."""
        self._weight_writes += 1

    def wake_up(self, *, defer_optimizer: bool = False) -> dict[str, float]:
        """Bring back everything :meth:`sleep` moved (bit-identical); a no-op when awake. Returns timing/memory stats
        and ``bytes_moved``: host -> device bytes, all that the sleeps since the last wake took off the device.

        ``defer_optimizer=True`` (ZeRO-0/1/2 with an optimizer) brings back what forwards and backwards read (the
        weights, the gradient partitions) and leaves the optimizer's states (Adam moments; ZeRO-1/2: the fp32 master
        partitions) in host memory for :meth:`finish_wake`, which a caller may run in another thread, on a CUDA
        stream of its own, while the model computes its first forward-backward: at a 1.5B model they are 18.5 of the
        20.6 GB a wake copies. The optimizer step (and :meth:`sleep`, saving, loading) calls it first, so nothing
        reads them before they are back. ``bytes_moved`` then counts what came back now."""
        if not self._asleep:
            return {}
        before = sleeping.device_memory(self.device)
        start = time.perf_counter()
        later = sleeping.deferrable_states(self._offloaded, self.config.zero_stage) if defer_optimizer else set()
        # (at most what the sleeps counted: on a CPU "device" DeepSpeed's own states stay put and are not counted)
        later_bytes = min(sleeping.deferred_bytes(self.ds_engine, self._offloaders, later), self._offloaded_bytes)
        sleeping.reload_engine(self.ds_engine, self._offloaders, self._offloaded - later)
        seconds = time.perf_counter() - start
        self._offloaded, self._asleep, self._weights_kept, self._optimizer_kept = later, False, False, False
        self._writes_at_wake = self._weight_writes
        moved, self._offloaded_bytes, self._later_bytes = self._offloaded_bytes - later_bytes, 0, later_bytes
        return self._log_transition("awake" + (" (optimizer states later)" if later else ""), before,
                                    seconds) | {"bytes_moved": float(moved)}

    @property
    def optimizer_states_away(self) -> bool:
        """Awake with the optimizer's states still in host memory (after ``wake_up(defer_optimizer=True)``, before
        :meth:`finish_wake`)."""
        return not self._asleep and bool(self._offloaded)

    def finish_wake(self, *, chunk_bytes: int | None = None) -> dict[str, float]:
        """Bring back the optimizer's states a ``wake_up(defer_optimizer=True)`` left in host memory; a no-op when
        none were left. Safe to call from another thread while this one runs forwards and backwards (their copies
        queue on that thread's current CUDA stream, and it waits for them before returning). ``chunk_bytes`` (CUDA):
        copy in pieces of that size, one in flight at a time, so that the other thread's own small host-to-device
        copies do not wait behind the whole transfer. Returns timing/memory stats and ``bytes_moved``."""
        with self._wake_lock:
            if not self.optimizer_states_away:
                return {}
            before = sleeping.device_memory(self.device)
            start = time.perf_counter()
            sleeping.reload_engine(self.ds_engine, self._offloaders, self._offloaded, chunk_bytes=chunk_bytes)
            seconds = time.perf_counter() - start
            self._offloaded, moved, self._later_bytes = set(), self._later_bytes, 0
            return self._log_transition("optimizer states awake", before, seconds) | {"bytes_moved": float(moved)}

    def finish_wake_behind(self, *, chunk_bytes: int | None = WAKE_CHUNK_BYTES) -> Future | None:
        """Start :meth:`finish_wake` in a background thread (on a GPU: on a CUDA stream of its own, in pieces of
        ``chunk_bytes``), so that the optimizer's states come back while this thread runs its forwards and backwards;
        call it once their inputs are on the device (their copies would wait behind a piece). Returns None when no
        states are away, else a :class:`concurrent.futures.Future` of ``finish_wake``'s stats whose ``result()``
        re-raises what it raised. The optimizer step, :meth:`sleep`, saving and loading wait for it by themselves."""
        if not self.optimizer_states_away:
            return None
        device = self.device
        side = None
        if device.type == "cuda":
            self._wake_stream = side = self._wake_stream or torch.cuda.Stream(device)
        future: Future = Future()

        def finish() -> None:
            try:
                if side is not None:
                    torch.cuda.set_device(device)
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    future.set_result(self.finish_wake(chunk_bytes=chunk_bytes))
            except BaseException as error:  # noqa: BLE001 - handed to whoever reads the future
                future.set_exception(error)

        threading.Thread(target=finish, name=f"{self.name}-finish-wake", daemon=True).start()
        return future

    def _log_transition(self, what: str, before: dict[str, float], seconds: float) -> dict[str, float]:
        after = sleeping.device_memory(self.device)
        stats = {"seconds": seconds, **{f"{k}_before": v for k, v in before.items()},
                 **{f"{k}_after": v for k, v in after.items()}}
        if after:
            logger.info("'%s' %s in %.3f s: allocated %.2f -> %.2f GiB, reserved %.2f -> %.2f GiB", self.name, what,
                        seconds, before["allocated"] / _GIB, after["allocated"] / _GIB, before["reserved"] / _GIB,
                        after["reserved"] / _GIB)
        else:
            logger.info("'%s' %s in %.3f s (no CUDA: host copies only)", self.name, what, seconds)
        return stats

    # ------------------------------------------------------------------ weights out
    def named_parameters_for_sync(self, *, bucket_bytes: int = 512 * 1024**2,
                                  dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every parameter (critic/reward: without the value head), in ``dtype``
        (default: the engine's, bf16 or fp32). Under ZeRO-3 this is a collective — every rank iterates it to the
        end — gathering ``bucket_bytes`` of parameters at a time; each tensor is valid until the next is requested.
        Allowed while awake or asleep with ``keep_weights=True``. With LoRA: only the adapters, under peft's saved
        names (:func:`rlhfkit.lora.adapter_name`). Also while a ``sleep(keep_weights=True)`` runs in another thread
        (the weights stay where they are)."""
        if self._asleep and not self._weights_kept:
            raise RuntimeError(f"named_parameters_for_sync() called while '{self.name}' is asleep without its weights;"
                               " call wake_up() or sleep(keep_weights=True) first")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes}; must be >= 1")
        exclude = (lambda name: name.startswith("score.")) if isinstance(self.module, ValueModel) else None
        return ckpt.iter_named_parameters(self.module, zero3=self.config.zero_stage == 3, bucket_bytes=bucket_bytes,
                                          dtype=dtype or self.dtype, exclude=exclude or (lambda name: False),
                                          rename=self._sync_name)

    def _sync_name(self, name: str) -> str | None:
        if self.lora is None:
            return ckpt.hf_name(name)
        from rlhfkit.lora import adapter_name

        return adapter_name(ckpt.hf_name(name))

    def describe_parameters_for_sync(self, *, dtype: torch.dtype | None = None) -> list:
        """``(name, shape, dtype)`` of exactly what :meth:`named_parameters_for_sync` yields, in the same order,
        without gathering ZeRO-3 shards (their full shape is ``ds_shape``): the description a
        :class:`rlhfkit.weight_sync.WeightSender` needs before the first byte moves. Local; no collective."""
        from rlhfkit.weight_sync import describe_parameters

        exclude = (lambda name: name.startswith("score.")) if isinstance(self.module, ValueModel) else None
        named = [(self._sync_name(name), param) for name, param in self.module.named_parameters()]
        named = [(name, param) for name, param in named if name is not None and not (exclude and exclude(name))]
        return describe_parameters(named, dtype=dtype or self.dtype)

    def export_hf(self, directory: str | Path, *, tokenizer=None, max_shard_bytes: int = 5 * 1024**3,
                  bucket_bytes: int = 512 * 1024**2) -> None:
        """Write the weights (value head included) as an HF folder loadable with ``from_pretrained``. Collective;
        rank 0 writes."""
        self._require_awake("export_hf")
        directory = Path(directory)
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        stream = ckpt.iter_named_parameters(self.module, zero3=self.config.zero_stage == 3, bucket_bytes=bucket_bytes,
                                            dtype=self.dtype)
        ckpt.export_hf(stream, self.module, directory, rank=self.rank, max_shard_bytes=max_shard_bytes,
                       tokenizer=tokenizer)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, root: str | Path, *, export_hf: bool = True, tokenizer=None,
                        client_state: Mapping[str, Any] | None = None) -> Path:
        """Write ``root/step-<global_step>`` atomically (DeepSpeed state in ``deepspeed/``, HF weights in ``hf/``);
        a crash mid-write leaves no directory that :func:`latest_checkpoint` returns. Collective."""
        self._require_awake("save_checkpoint")
        self.finish_wake()
        hf_export = (lambda directory: self.export_hf(directory, tokenizer=tokenizer)) if export_hf else None
        state = {"rlhfkit": {"role": self.role, "name": self.name, "global_step": self.global_step},
                 **dict(client_state or {})}
        return ckpt.save_checkpoint(self.ds_engine, root, step=self.global_step, hf_export=hf_export,
                                    client_state=state)

    def load_checkpoint(self, path: str | Path, *, load_optimizer_states: bool = True) -> dict[str, Any]:
        """Restore DeepSpeed state (weights, optimizer, LR schedule, step) from a complete checkpoint directory;
        returns the ``client_state`` saved with it. Collective."""
        self._require_awake("load_checkpoint")
        self.finish_wake()
        self._weight_writes += 1
        return ckpt.load_checkpoint(self.ds_engine, path, load_optimizer_states=load_optimizer_states)

    def destroy(self) -> None:
        """Release DeepSpeed's engine and the host buffers kept for sleeping."""
        if self._asleep:
            self.wake_up()
        self.finish_wake()
        for offloader in self._offloaders.values():
            offloader.release_host_buffers()
        self.ds_engine.destroy()
