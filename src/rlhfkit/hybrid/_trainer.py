"""Driver side of a trainer role: :class:`TrainerGroup` and its :class:`TrainerConfig`.

A :class:`TrainerGroup` is one role (actor, critic, reference, reward) as data-parallel Ray actors, each holding a
sleepable :class:`~rlhfkit.deepspeed_engine.DeepSpeedEngine`. Its calls are the small primitives of Tinker/SkyRL:

- :meth:`TrainerGroup.forward`: no-grad ``[T]`` log-probs / values (``[N]`` rewards) of a packed batch;
- :meth:`TrainerGroup.forward_backward`: your loss function on the model's outputs, then backward — the loss is
  defined in your script and shipped with the call;
- :meth:`TrainerGroup.optim_step`: the optimizer step over what ``forward_backward`` accumulated;
  :meth:`TrainerGroup.discard_gradients` gives the step up instead (a failed ``forward_backward`` does by itself);
- :meth:`TrainerGroup.save` / :meth:`TrainerGroup.load`; weights go to engines with :meth:`rlhfkit.hybrid.Hybrid.
  push_weights`.

Each call wakes the role through the phase guard if it is asleep (``wake=True``) and can put it back to sleep
(``sleep_after``), inside the same actor call: one call is one round trip. The batch is split over the ranks by
tokens, and on each rank into micro-batches of at most ``TrainerConfig.micro_batch_tokens`` tokens (the same count on
every rank, as ZeRO's collectives need). Losses are normalised by the whole minibatch's token and sequence counts,
handed to your loss function, so gradients are those of the whole minibatch whatever the split.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhfkit._optional import require
from rlhfkit.experience import select_experience
from rlhfkit.hybrid._timer import PhaseTimer
from rlhfkit.hybrid._trainer_worker import OUTPUTS
from rlhfkit.packing import partition_by_token_budget, select_sequences
from rlhfkit.types import Experience, PackedBatch

__all__ = ["LossFn", "TrainerConfig", "TrainerGroup"]

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
        micro_batch_tokens: token budget of one micro-batch (forward and training). Activation memory grows with
            it, and a host-bound step takes less time in fewer, larger micro-batches. None: :meth:`Hybrid.start
            <rlhfkit.hybrid.Hybrid.start>` sizes it from the plan's memory estimate, the largest of 16,384, 12,288,
            8,192 and 4,096 tokens that leaves the GPU the headroom the overlapped switches need
            (``rlhfkit.hybrid._launch.size_micro_batches``; 4,096 on CPU); a group built outside ``Hybrid.start``
            needs a number.
        tf32_backward: float32 backward passes on TF32 tensor cores (the forwards, log-probs and the engine-vs-trainer
            gap stay float32).
        tf32_frozen_forward: TF32 in the no-grad forwards of frozen roles (reference, reward).
        seed: the model's initialisation seed (fresh value heads).
        lora: train LoRA adapters instead of every weight (:class:`rlhfkit.lora.LoraConfig`; actor only): the base is
            frozen, the optimizer holds only the adapters, and :meth:`rlhfkit.hybrid.Hybrid.push_weights` moves only
            the adapters into the engines. Needs ``rlhfkit[lora]``.
        defer_optimizer_wake: a sleeping (``offload``) trained role's ``forward_backward`` wakes only what forwards
            and backwards read (weights, gradient partitions) and brings the optimizer's states (Adam moments; ZeRO-1/2
            fp32 masters) back in a background thread, on a CUDA stream of its own in 64 MiB pieces, behind its
            compute; ``optim_step`` waits for them (:meth:`rlhfkit.deepspeed_engine.DeepSpeedEngine.finish_wake`).
            False: the whole wake happens before the compute.
        sleep_optimizer: whether a sleeping (``offload``) trained role's sleeps move its optimizer's states (fp32
            master weights, Adam moments: at bf16 with Adam three quarters of its states) to host memory too (True),
            or leave them on the GPU (False: :meth:`rlhfkit.deepspeed_engine.DeepSpeedEngine.sleep` with
            ``keep_optimizer=True``; the weights and gradients still go), so that no wake waits for them and no
            sleep copies them. None: :meth:`Hybrid.start <rlhfkit.hybrid.Hybrid.start>` decides from the plan's
            memory estimate: False where every phase still fits within ``1 / OVERLAP_HEADROOM`` of the GPU with
            them there (``rlhfkit.hybrid._launch.size_state_sleeps``), else True; True on CPU and in a group
            built outside ``Hybrid.start``.
        sleep_weights: the same for the weights of a sleeping (``offload``) trained role (bf16: 2 bytes a parameter;
            ZeRO-3: this rank's shards): True moves them to host memory at every sleep; False leaves them on the GPU
            (``DeepSpeedEngine.sleep(keep_weights=True)``), so that no wake brings them back before the role's
            forward. The phases it sleeps through (generation, the other roles' forwards, the engines' wake after a
            push) hold them; the plan's estimate counts them in those phases. None:
            ``Hybrid.start`` decides with ``sleep_optimizer`` (``rlhfkit.hybrid._launch.size_state_sleeps``): both
            kept where the estimate fits, else the optimizer's states, else the weights alone; True on CPU and in a
            group built outside ``Hybrid.start``.
    """

    deepspeed: Any
    model: str | None = None
    offload: bool = True
    micro_batch_tokens: int | None = 4096
    tf32_backward: bool = True
    tf32_frozen_forward: bool = True
    seed: int = 0
    lora: Any = None
    defer_optimizer_wake: bool = True
    sleep_optimizer: bool | None = None
    sleep_weights: bool | None = None

    def __post_init__(self) -> None:
        from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
        from rlhfkit.lora import as_lora_config

        object.__setattr__(self, "lora", as_lora_config(self.lora, where="TrainerConfig.lora"))  # or a peft config

        if not isinstance(self.deepspeed, DeepSpeedEngineConfig):
            raise TypeError(f"TrainerConfig.deepspeed={self.deepspeed!r}; expected a DeepSpeedEngineConfig")
        if self.micro_batch_tokens is not None and (isinstance(self.micro_batch_tokens, bool) or not isinstance(
                self.micro_batch_tokens, int) or self.micro_batch_tokens < 1):
            raise ValueError(f"TrainerConfig.micro_batch_tokens={self.micro_batch_tokens!r}; must be an int >= 1, or "
                             "None for Hybrid.start to size it")
        for name in ("offload", "tf32_backward", "tf32_frozen_forward", "defer_optimizer_wake"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainerConfig.{name}={getattr(self, name)!r}; must be True or False")
        for name in ("sleep_optimizer", "sleep_weights"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainerConfig.{name}={getattr(self, name)!r}; must be True, False or None "
                                "(Hybrid.start decides)")
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


class TrainerGroup:
    """One trainer role's ranks; see the module docstring. Built by :meth:`rlhfkit.hybrid.Hybrid.start`."""

    def __init__(self, workers: Any, config: TrainerConfig, *, timer: PhaseTimer | None = None) -> None:
        self.workers, self.config, self.timer = workers, config, timer
        self.role, self.world_size = workers.role, workers.world_size
        if config.micro_batch_tokens is None:
            raise ValueError(f"'{self.role}': TrainerConfig.micro_batch_tokens=None is sized by Hybrid.start; a "
                             "TrainerGroup built without it needs a number of tokens")
        self.peak_gib = 0.0
        self.steps_since_push = 0  # optimizer steps whose weights the engines do not have yet
        # (any rank awake, any rank asleep but for its weights) after the last call, or None when not known (before
        # the first call, while a call is under way, after a call failed): a sleep that would do nothing is skipped
        self._state: tuple[bool, bool] | None = None

    def _shards(self, lengths: list[int]) -> list[list[list[int]]]:
        """Per rank, its micro-batches (sequence indices): token-balanced, the same count on every rank."""
        if len(lengths) < self.world_size:
            raise ValueError(f"'{self.role}': a batch of {len(lengths)} sequences cannot be split over "
                             f"{self.world_size} ranks; give at least one sequence per rank")
        shards = partition_by_token_budget(lengths, num_micro_batches=self.world_size)
        budget = self.config.micro_batch_tokens
        count = max(math.ceil(sum(lengths[i] for i in shard) / budget) for shard in shards)
        count = max(1, min(count, min(len(shard) for shard in shards)))
        out = []
        for shard in shards:
            parts = partition_by_token_budget([lengths[i] for i in shard], num_micro_batches=count)
            out.append([[shard[i] for i in part] for part in parts])
        return out

    def _call(self, method: str, *args: Any, scattered: bool = False, **kwargs: Any) -> list[dict[str, Any]]:
        """Call ``method`` on every rank (``scattered``: ``args[0]`` holds each rank's share) and note the state the
        call left the ranks in; while it runs, and if it fails, that state is unknown."""
        self._state = None
        return self._note((self.workers.call_scattered if scattered else self.workers.call)(method, *args, **kwargs))

    def _submit(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Start ``method`` on every rank without waiting (gather the results with ``workers.gather`` and pass them
        to :meth:`_note`); the ranks' state is unknown meanwhile."""
        self._state = None
        return self.workers.submit(method, *args, **kwargs)

    def _note(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Note the state the ranks report after a call (unknown when a result does not report it)."""
        known = all(isinstance(result, dict) and "awake" in result for result in results)
        self._state = ((any(r["awake"] for r in results), any(r["weights_only"] for r in results)) if known
                       else None)
        return results

    def _account(self, results: list[dict[str, Any]]) -> None:
        """Report the ranks' sleep/wake time and bytes to the timer: the slowest rank's time and the largest rank's
        bytes (the ranks copy in parallel, each on its own GPU)."""
        if self.timer is not None:
            self.timer.count_switch(max(result.get("switch_s", 0.0) for result in results),
                                    bytes_d2h=max(result.get("bytes_d2h", 0.0) for result in results),
                                    bytes_h2d=max(result.get("bytes_h2d", 0.0) for result in results),
                                    bytes_kept=max(result.get("bytes_kept", 0.0) for result in results))
            slowest = max(results, key=lambda result: result.get("worker_s", 0.0))
            self.timer.count_worker(slowest.get("worker_s", 0.0), cpu_s=slowest.get("worker_cpu_s", 0.0))
            self.timer.count_overlapped(max(result.get("overlapped_s", 0.0) for result in results))
            self.timer.count_overlapped(max(result.get("overlapped_wake_s", 0.0) for result in results), wake=True)
        self.peak_gib = max([self.peak_gib] + [result.get("peak_gib", 0.0) for result in results])

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
        shards = self._shards(batch.seq_lens.tolist())
        items, places = [], []
        for shard in shards:
            micro = [select_sequences(batch, indices) for indices in shard]
            items.append([sub for sub, _ in micro])
            places.append(shard if output == "rewards" else [index for _, index in micro])
        results = self._call("forward", items, scattered=True, output=output, temperature=temperature, phase=phase,
                             wake=wake, sleep_after=sleep_after, adapters=adapters)
        self._account(results)
        out = torch.zeros(batch.num_seqs if output == "rewards" else batch.num_tokens)
        for result, rank_places in zip(results, places, strict=True):
            for values, place in zip(result["outputs"], rank_places, strict=True):
                out[torch.as_tensor(place)] = values
        return out

    def forward_backward(self, minibatch: Experience, loss_fn: LossFn, *, output: str = "logprobs",
                         temperature: float = 1.0, wake: bool = True, phase: str | None = None) -> dict[str, float]:
        """Your ``loss_fn`` on the model's outputs for ``minibatch`` (split over ranks and micro-batches), then
        backward; gradients accumulate until :meth:`optim_step`. Returns the loss function's stats (mean over
        micro-batches and ranks), ``{role}/loss`` (the minibatch's total loss), ``{role}/peak_gib`` (the largest
        peak of memory allocated by torch on any rank during the call; 0 on CPU) and ``{role}/peak_reserved_gib``
        (the same with the caching allocator's blocks: what the device sees of the process, less its context). When
        the call fails (on any micro-batch, any rank), every rank drops the gradients it had accumulated: the next
        ``forward_backward`` starts a clean step."""
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
            results = self._call("forward_backward", items, scattered=True, loss_fn=shipped, output=output,
                                 temperature=temperature, num_tokens=num_tokens, num_seqs=num_seqs, phase=phase,
                                 wake=wake)
        except Exception as error:
            # the ranks that failed dropped their gradients; the others finished their share: drop theirs too, so
            # that no rank carries part of this minibatch into the next step
            if self.world_size > 1:
                self._discard_after(error, phase)
            raise
        self._account(results)
        stats: dict[str, float] = {}
        for key in results[0]["stats"]:
            values = [result["stats"][key] for result in results]
            stats[f"{self.role}/{key}"] = sum(values) if key == "loss" else sum(values) / len(values)
        return stats | {f"{self.role}/{key}": max(result.get(key, 0.0) for result in results)
                        for key in ("peak_gib", "peak_reserved_gib")}

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
        self._account(self._call("discard_gradients", phase=phase or f"train_{self.role}"))

    def check_push(self, *, phase: str = "sync") -> None:
        """Refuse a weight push that the ranks cannot send (not the actor, asleep without its weights) before any
        engine waits for it; the ranks' state is left as it is."""
        self.workers.call("check_send", phase=phase)

    def optim_step(self, *, sleep_after: bool | str = False, phase: str | None = None) -> dict[str, float]:
        """The optimizer step; returns ``{role}/lr``, ``{role}/grad_norm`` (pre-clip, global) and
        ``{role}/global_step``. ``sleep_after="keep_weights"`` keeps only the weights for a weight push."""
        phase = phase or f"train_{self.role}"
        results = self._call("optim_step", phase=phase, sleep_after=sleep_after)
        self.steps_since_push += 1
        self._account(results)
        return {f"{self.role}/{key}": value for key, value in results[0]["stats"].items()}

    def sleep(self, *, keep_weights: bool = False, phase: str = "sleep") -> None:
        """Put every rank to sleep (``keep_weights``: all but the weights, for a push). No call is made when the last
        call left every rank where this one would (e.g. ``optim_step(sleep_after="keep_weights")`` before a push)."""
        if self._state is not None and not self._state[0] and (keep_weights or not self._state[1]):
            return
        self._account(self._call("sleep", phase, keep_weights))

    def wake(self, *, phase: str = "wake") -> None:
        self._account(self._call("wake", phase))

    def save(self, root: str | Path) -> Path:
        """A DeepSpeed checkpoint (+ HF export) under ``root/step-<global step>``, atomically; the role stays awake."""
        results = self._call("save", str(root), phase=f"save_{self.role}")
        return Path(results[0]["path"])

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer and schedule from a checkpoint directory; returns its client state."""
        results = self._call("load_checkpoint", str(path), phase=f"load_{self.role}")
        return results[0]["client_state"]

    def guard_events(self, *, settle: bool = False) -> list[dict[str, Any]]:
        """Every rank's guarded transitions since the last call; ``settle=True`` first waits for sleeps still running
        in the background (``overlap_switches``), which otherwise show up in a later call."""
        return [event for rank in self.workers.call("guard_events", settle) for event in rank]
