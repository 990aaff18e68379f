"""Driver side of a trainer role: :class:`TrainerGroup` and its :class:`TrainerConfig`.

A :class:`TrainerGroup` is one role (actor, critic, reference, reward) as data-parallel Ray actors, each holding a
sleepable :class:`~rlhfkit.deepspeed_engine.DeepSpeedEngine`. Its calls are the small primitives of Tinker/SkyRL:
:meth:`~TrainerGroup.forward` (no-grad ``[T]`` log-probs / values, ``[N]`` rewards), :meth:`~TrainerGroup.
forward_backward` (your loss function, shipped with the call, then backward), :meth:`~TrainerGroup.optim_step` (or
:meth:`~TrainerGroup.discard_gradients`), :meth:`~TrainerGroup.save` / :meth:`~TrainerGroup.load`; weights go to
engines with :meth:`rlhfkit.hybrid.Hybrid.push_weights`. They return typed results (:mod:`rlhfkit.hybrid._results`).

The group records what its calls leave on the GPUs (:class:`GpuState`) and tells the ranks to wake or sleep inside
the call itself: one call is one round trip. The batch is split over the ranks by tokens, and on each rank into
micro-batches of at most ``RolePlan.micro_batch_tokens`` tokens (the same count on every rank, as ZeRO's
collectives need). Losses are normalised by the whole minibatch's token and sequence counts, handed to your loss
function, so gradients are those of the whole minibatch whatever the split.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhfkit._optional import require
from rlhfkit.experience import select_experience
from rlhfkit.hybrid._results import CallObserver, CallRecord, ForwardBackwardResult, OptimStepResult, WorkerReply
from rlhfkit.hybrid._trainer_worker import OUTPUTS
from rlhfkit.packing import partition_by_token_budget, select_sequences
from rlhfkit.types import Experience, PackedBatch

__all__ = ["GpuState", "LossFn", "TrainerConfig", "TrainerGroup"]

LossFn = Callable[..., Any]
"""``loss_fn(outputs, micro, *, num_tokens, num_seqs) -> loss | (loss, stats)``: ``outputs`` is the model's ``[T]``
log-probs (or values) of the micro-batch ``micro`` (an :class:`~rlhfkit.types.Experience`), ``num_tokens`` /
``num_seqs`` count the whole minibatch over every rank (pass them to :mod:`rlhfkit.losses`)."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """One trainer role.

    Attributes:
        deepspeed: the model's DeepSpeed configuration (:class:`~rlhfkit.deepspeed_engine.DeepSpeedEngineConfig`).
            Trained roles get ``loss_normalization="global"`` and caller-owned accumulation (``optim_step``). Its
            ``attn_implementation=None`` becomes :data:`rlhfkit.packing.VARLEN_ATTENTION` (each packed sequence's
            attention alone, ``N * L^2``, instead of a ``T^2`` block-diagonal mask over the micro-batch).
        model: HF folder of this role (default: the run's model).
        offload: sleep by moving every state to pinned host memory (True, the hybrid engine) or stay on the GPU and
            only return cached blocks (False, when memory is plentiful); the phase guard orders phases either way.
            The plan starts from it (``RolePlan.offload``) and changes it only where the layout does not fit.
        tf32_backward: float32 backward passes on TF32 tensor cores (the forwards, log-probs and the engine-vs-trainer
            gap stay float32).
        tf32_frozen_forward: TF32 in the no-grad forwards of frozen roles (reference, reward).
        seed: the model's initialisation seed (fresh value heads).
        lora: train LoRA adapters instead of every weight (:class:`rlhfkit.lora.LoraConfig`; actor only): the base is
            frozen, the optimizer holds only the adapters, and :meth:`rlhfkit.hybrid.Hybrid.push_weights` moves only
            the adapters into the engines. Needs ``rlhfkit[lora]``.

    Where the role's states live in each phase (what its sleeps move, ZeRO stage and optimizer share as run, the
    micro-batch budget) is the run's plan, not this config: :class:`rlhfkit.hybrid.RolePlan`.
    """

    deepspeed: Any
    model: str | None = None
    offload: bool = True
    tf32_backward: bool = True
    tf32_frozen_forward: bool = True
    seed: int = 0
    lora: Any = None

    def __post_init__(self) -> None:
        from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
        from rlhfkit.lora import as_lora_config

        object.__setattr__(self, "lora", as_lora_config(self.lora, where="TrainerConfig.lora"))  # or a peft config

        if not isinstance(self.deepspeed, DeepSpeedEngineConfig):
            raise TypeError(f"TrainerConfig.deepspeed={self.deepspeed!r}; expected a DeepSpeedEngineConfig")
        for name in ("offload", "tf32_backward", "tf32_frozen_forward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainerConfig.{name}={getattr(self, name)!r}; must be True or False")
        if self.model is not None and not isinstance(self.model, str):
            raise TypeError(f"TrainerConfig.model={self.model!r}; expected a folder path (str) or None")
        if self.offload and self.deepspeed.offload_optimizer_ratio < 1:
            raise ValueError(f"TrainerConfig(offload=True) with deepspeed.offload_optimizer_ratio="
                             f"{self.deepspeed.offload_optimizer_ratio}: the optimizer part DeepSpeed keeps on the GPU "
                             "is not moved by its offload_states (sleeping would not free it); use offload=False "
                             "(the role stays on the GPU, only the engines sleep) or offload_optimizer_ratio=1")

    def for_role(self, role: str) -> TrainerConfig:
        """This config as a role's worker gets it (trained roles: global loss normalisation)."""
        import dataclasses

        from rlhfkit.packing import VARLEN_ATTENTION

        trains = role in ("actor", "critic")
        deepspeed = self.deepspeed
        if trains and deepspeed.loss_normalization != "global":
            deepspeed = dataclasses.replace(deepspeed, loss_normalization="global")
        if deepspeed.attn_implementation is None:
            deepspeed = dataclasses.replace(deepspeed, attn_implementation=VARLEN_ATTENTION)
        return dataclasses.replace(self, deepspeed=deepspeed)


def _ship_by_value(fn: Any) -> None:
    """Let Ray pickle ``fn`` by value when its module is not importable by the workers (a script, an example
    loaded from a path); functions of installed packages and of the standard library travel by reference."""
    import functools

    ray = require("ray", user="rlhfkit.hybrid")
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return
    top = module.__name__.partition(".")[0]
    path = str(getattr(module, "__file__", "") or "")
    if top == "rlhfkit" or top in sys.stdlib_module_names or "site-packages" in path or "dist-packages" in path:
        return
    ray.cloudpickle.register_pickle_by_value(module)


@dataclass(kw_only=True)
class GpuState:
    """What of a role the driver has put on its GPUs (every rank alike): the whole model (``awake``), or at least
    its weights (``weights``: awake, or asleep after a keep-weights sleep)."""

    awake: bool = False
    weights: bool = False


class TrainerGroup:
    """One trainer role's ranks; see the module docstring. Built by :meth:`rlhfkit.hybrid.Hybrid.start`.

    ``observer`` (a :class:`~rlhfkit.hybrid.CallObserver`, the run's :class:`~rlhfkit.hybrid.PhaseTimer`) sees each
    call's :class:`~rlhfkit.hybrid.CallRecord`. ``on_gpu`` is the driver's record of what the ranks hold on their GPUs
    (None while a call runs and after one failed: unknown); ``weight_version`` the version of the weights the role
    holds (the last pushed one, plus one once it has stepped since)."""

    def __init__(self, workers: Any, config: TrainerConfig, plan: Any, *,
                 observer: CallObserver | None = None) -> None:
        # plan: the role's RolePlan (micro-batch budget, what its sleeps move)
        self.workers, self.config, self.plan, self.observer = workers, config, plan, observer
        self.role, self.world_size = workers.role, workers.world_size
        self.on_gpu: GpuState | None = GpuState()  # load() leaves every rank asleep
        self.weight_version = 0
        self._stepped_since_push = False

    def _shards(self, lengths: list[int]) -> list[list[list[int]]]:
        """Per rank, its micro-batches (sequence indices): token-balanced, the same count on every rank."""
        if len(lengths) < self.world_size:
            raise ValueError(f"'{self.role}': a batch of {len(lengths)} sequences cannot be split over "
                             f"{self.world_size} ranks; give at least one sequence per rank")
        shards = partition_by_token_budget(lengths, num_micro_batches=self.world_size)
        budget = self.plan.micro_batch_tokens
        count = max(math.ceil(sum(lengths[i] for i in shard) / budget) for shard in shards)
        count = max(1, min(count, min(len(shard) for shard in shards)))
        out = []
        for shard in shards:
            parts = partition_by_token_budget([lengths[i] for i in shard], num_micro_batches=count)
            out.append([[shard[i] for i in part] for part in parts])
        return out

    def _must_wake(self, wake: bool) -> bool:
        """Whether a call must wake the ranks first: asked to (``wake``) and not known to be awake. A rank told not
        to wake while asleep refuses the call (RoleAsleepError, naming it)."""
        return wake and not (self.on_gpu is not None and self.on_gpu.awake)

    def _needs_sleep(self, keep_weights: bool) -> bool:
        """Whether a sleep would change anything: not when the ranks are known asleep with nothing it would move."""
        state = self.on_gpu
        return state is None or state.awake or (state.weights and not keep_weights)

    def _call(self, method: str, *args: Any, phase: str, after: GpuState | None, scattered: bool = False,
              **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rank (``scattered``: ``args[0]`` holds each rank's share); show its costs to the
        observer; record ``after`` as what the ranks hold on their GPUs (unknown while it runs, and if it fails).
        Returns each rank's value."""
        self.on_gpu, started = None, time.perf_counter()
        call = self.workers.call_scattered if scattered else self.workers.call
        replies = call(method, *args, phase=phase, **kwargs)
        return self._finish(method, phase, replies, after, started)

    def _finish(self, method: str, phase: str, replies: list[WorkerReply], after: GpuState | None,
                started: float) -> list[Any]:
        self.on_gpu = after
        if self.observer is not None:
            self.observer.observe_call(CallRecord(role=self.role, method=method, phase=phase,
                                                  seconds=time.perf_counter() - started,
                                                  costs=tuple(reply.cost for reply in replies)))
        return [reply.value for reply in replies]

    @staticmethod
    def _after(sleep_after: bool | str) -> GpuState:
        """What a call that ends with ``sleep_after`` leaves on the GPUs."""
        return GpuState(awake=not sleep_after, weights=sleep_after is not True)

    def forward(self, batch: PackedBatch, *, output: str = "logprobs", temperature: float = 1.0, wake: bool = True,
                sleep_after: bool | str = True, phase: str | None = None, adapters: bool = True) -> torch.Tensor:
        """No-grad forward of ``batch`` on every rank: ``[T]`` log-probs (token aligned, 0 off the loss mask) or
        values, or ``[N]`` rewards (``output="rewards"``). ``sleep_after``: True, False, or ``"keep_weights"``.
        ``adapters=False`` (a LoRA actor): the base model's log-probs with the adapters switched off, the reference
        policy of a LoRA run without a reference role (phase ``forward_reference`` unless ``phase`` is given)."""
        if output not in OUTPUTS:
            raise ValueError(f"output={output!r}; expected one of {OUTPUTS}")
        if not adapters and (self.config.lora is None or output != "logprobs"):
            raise ValueError(f"'{self.role}'.forward(adapters=False, output={output!r}): only a LoRA role's "
                             "log-probs have a base model to fall back to (TrainerConfig.lora is "
                             f"{self.config.lora!r})")
        if not isinstance(batch, PackedBatch):
            raise TypeError(f"batch must be a PackedBatch (rlhfkit.packing.pack_rollouts), got {type(batch).__name__}")
        phase = phase or (f"forward_{self.role}" if adapters else "forward_reference")
        items, places = [], []
        for shard in self._shards(batch.seq_lens.tolist()):
            micro = [select_sequences(batch, indices) for indices in shard]
            items.append([sub for sub, _ in micro])
            places.append(shard if output == "rewards" else [index for _, index in micro])
        values = self._call("forward", items, scattered=True, output=output, temperature=temperature, phase=phase,
                            wake=self._must_wake(wake), sleep_after=sleep_after, adapters=adapters,
                            after=self._after(sleep_after))
        out = torch.zeros(batch.num_seqs if output == "rewards" else batch.num_tokens)
        for outputs, rank_places in zip(values, places, strict=True):
            for value, place in zip(outputs, rank_places, strict=True):
                out[torch.as_tensor(place)] = value
        return out

    def forward_backward(self, minibatch: Experience, loss_fn: LossFn, *, output: str = "logprobs",
                         temperature: float = 1.0, wake: bool = True,
                         phase: str | None = None) -> ForwardBackwardResult:
        """Your ``loss_fn`` on the model's outputs for ``minibatch`` (split over ranks and micro-batches), then
        backward; gradients accumulate until :meth:`optim_step`. Returns a :class:`~rlhfkit.hybrid.
        ForwardBackwardResult`: the minibatch's loss and the loss function's stats (mean over micro-batches and
        ranks); ``.metrics()`` gives them as ``{role}/loss``, ``{role}/<stat>``. When the call fails (on any
        micro-batch, any rank), every rank drops the gradients it had accumulated: the next ``forward_backward``
        starts a clean step."""
        if output not in ("logprobs", "values"):
            raise ValueError(f"output={output!r}; forward_backward trains on 'logprobs' or 'values'")
        if not isinstance(minibatch, Experience):
            raise TypeError(f"minibatch must be an rlhfkit.types.Experience, got {type(minibatch).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass a function (outputs, micro, *, num_tokens, "
                            "num_seqs) -> loss or (loss, stats)")
        _ship_by_value(loss_fn)
        ray = require("ray", user="rlhfkit.hybrid")
        shipped = ray.cloudpickle.dumps(loss_fn)  # bytes: the workers keep the last one unpickled
        phase = phase or f"train_{self.role}"
        num_tokens = float(minibatch.batch.loss_mask.sum())
        num_seqs = float(minibatch.batch.num_seqs)
        shards = self._shards(minibatch.batch.seq_lens.tolist())
        items = [[select_experience(minibatch, indices) for indices in shard] for shard in shards]
        try:
            parts = self._call("forward_backward", items, scattered=True, loss_fn=shipped, output=output,
                               temperature=temperature, num_tokens=num_tokens, num_seqs=num_seqs, phase=phase,
                               wake=self._must_wake(wake), after=GpuState(awake=True, weights=True))
        except Exception as error:
            # the ranks that failed dropped their gradients; the others finished their share: drop theirs too, so
            # that no rank carries part of this minibatch into the next step
            if self.world_size > 1:
                self._discard_after(error, phase)
            raise
        stats = {key: sum(part.stats[key] for part in parts) / len(parts) for key in parts[0].stats}
        return ForwardBackwardResult(role=self.role, loss=sum(part.loss for part in parts), stats=stats,
                                     num_tokens=round(num_tokens), num_seqs=round(num_seqs))

    def _discard_after(self, error: Exception, phase: str) -> None:
        """After a failed ``forward_backward``: drop every rank's gradients of the step; when that fails too, say so
        on ``error`` (the call's own error is the one raised)."""
        try:
            self.discard_gradients(phase=phase)
        except Exception as discard_error:  # noqa: BLE001 - noted on the error being raised
            error.add_note(f"'{self.role}': dropping the other ranks' gradients of the failed step failed too "
                           f"({type(discard_error).__name__}: {discard_error}); call discard_gradients() before "
                           "the next forward_backward")

    def discard_gradients(self, *, phase: str | None = None) -> None:
        """Drop the gradients of the step under way (a ``forward_backward`` not yet followed by :meth:`optim_step`)
        on every rank: the step is given up, and the next ``forward_backward`` starts a new one. A failed
        ``forward_backward`` or ``optim_step`` does this by itself; call it to skip a minibatch after a successful
        ``forward_backward`` (e.g. on its stats). A rank with no such gradients does nothing."""
        self._call("discard_gradients", phase=phase or f"train_{self.role}", after=None)  # wakes only if it must

    def check_push(self, *, phase: str = "sync") -> None:
        """Refuse a weight push that the ranks cannot send (not the actor, asleep without its weights) before any
        engine waits for it; the ranks' state is left as it is."""
        self.workers.call("check_send", phase=phase)

    def optim_step(self, *, sleep_after: bool | str = False, phase: str | None = None) -> OptimStepResult:
        """The optimizer step; returns an :class:`~rlhfkit.hybrid.OptimStepResult` (learning rate, pre-clip global
        gradient norm, global step). ``sleep_after="keep_weights"`` keeps only the weights for a weight push."""
        phase = phase or f"train_{self.role}"
        results = self._call("optim_step", phase=phase, sleep_after=sleep_after, after=self._after(sleep_after))
        if not self._stepped_since_push:
            self.weight_version, self._stepped_since_push = self.weight_version + 1, True
        return results[0]

    def weights_pushed(self, version: int) -> None:
        """The engines now hold this role's weights as ``version`` (called by :meth:`rlhfkit.hybrid.Hybrid.
        push_weights`)."""
        self.weight_version, self._stepped_since_push = int(version), False

    def sleep(self, *, keep_weights: bool = False, phase: str = "sleep") -> None:
        """Put every rank to sleep (``keep_weights``: all but the weights, for a push). No call is made when the
        ranks already hold no more than this sleep would leave (e.g. after ``optim_step(sleep_after=
        "keep_weights")`` before a push)."""
        if self._needs_sleep(keep_weights):
            self._call("sleep", keep_weights=keep_weights, phase=phase, after=GpuState(weights=keep_weights))

    def start_sleep(self, *, phase: str = "sleep") -> list[Any]:
        """Start a full sleep of every rank without waiting for it (beside a weight push); pass what it returns to
        :meth:`finish_sleep`."""
        self.on_gpu = None
        return [time.perf_counter(), self.workers.submit("sleep", phase, False)]

    def finish_sleep(self, started: list[Any], *, phase: str = "sleep") -> None:
        """Wait for the sleep :meth:`start_sleep` started."""
        self._finish("sleep", phase, self.workers.gather(started[1]), GpuState(), started[0])

    def wake(self, *, phase: str = "wake") -> None:
        self._call("wake", phase=phase, after=GpuState(awake=True, weights=True))

    def save(self, root: str | Path) -> Path:
        """A DeepSpeed checkpoint (+ HF export) under ``root/step-<global step>``, atomically; the role stays awake."""
        return Path(self._call("save", str(root), phase=f"save_{self.role}", after=GpuState(awake=True,
                                                                                            weights=True))[0])

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer and schedule from a checkpoint directory; returns its client state."""
        return self._call("load_checkpoint", str(path), phase=f"load_{self.role}",
                          after=GpuState(awake=True, weights=True))[0]

    def guard_events(self, *, settle: bool = False) -> list[dict[str, Any]]:
        """Every rank's guarded transitions since the last call; ``settle=True`` first waits for sleeps still running
        in the background (``overlap_switches``), which otherwise show up in a later call."""
        return [event for rank in self.workers.call("guard_events", settle) for event in rank]

    def export(self, path: str | Path) -> Path:
        """Write the role's weights as a folder that ``from_pretrained`` and ``vllm serve`` load: safetensors,
        ``config.json``, ``generation_config.json`` and the model source's tokenizer files, gathered from ZeRO-3
        shards; a LoRA actor's is merged, with its peft adapter in ``path/adapter``. Atomic (``path`` appears
        complete or not at all); the role stays awake. :func:`rlhfkit.hybrid.export_model` also puts the engines
        to sleep first and the role after."""
        from rlhfkit.checkpoint import atomic_directory

        with atomic_directory(path) as tmp:
            self._call("export", str(tmp), phase=f"export_{self.role}", after=GpuState(awake=True, weights=True))
        return Path(path)
