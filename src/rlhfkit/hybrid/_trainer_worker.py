"""The Ray actor behind :class:`rlhfkit.hybrid.TrainerGroup`: one DeepSpeed model of one role on one rank.

Each method is one primitive with the wake and sleep the driver asked for folded in (an actor runs its calls in
order, so a call is one round trip). The driver decides what is on the GPU; a rank does what it is told and answers
with a :class:`~rlhfkit.hybrid._results.WorkerReply`: the primitive's value and what its sleeps and wakes cost. The
algorithm is not here: losses come from the caller as a function, shipped with the call.
"""

from __future__ import annotations

import contextlib
import gc
import math
import numbers
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit._optional import require
from rlhfkit.hybrid._background_sleep import BackgroundSleep
from rlhfkit.hybrid._errors import HybridCallError, LossFunctionError, RoleAsleepError, sleep_hint
from rlhfkit.hybrid._results import CallCost, ForwardBackwardResult, OptimStepResult, WorkerReply
from rlhfkit.hybrid._timer import StartupClock
from rlhfkit.phase import PhaseGuard
from rlhfkit.workers import Worker

__all__ = ["OUTPUTS", "TrainerWorker", "plan_gpu_key", "transition_record"]

_GIB = 1024**3
OUTPUTS = ("logprobs", "values", "rewards")


def plan_gpu_key(node: int, gpu: int) -> str:
    """The phase guard's name of a plan GPU (the plan, not CUDA, knows which roles share it)."""
    return f"node{node}/gpu{gpu}"


def transition_record(transition: Any, **extra: Any) -> dict[str, Any]:
    """A guarded transition as a plain dict with a wall-clock time (for ``phases.jsonl`` and order checks): when the
    claim changed hands (``Transition.at``), else now."""
    at = getattr(transition, "at", None)
    record = {"time": time.time() if at is None else at, "pid": os.getpid(), "action": transition.action,
              "role": transition.role, "gpu": transition.gpu, "phase": transition.phase, "seconds": transition.seconds}
    for name in ("allocated", "reserved", "free"):
        value = getattr(transition, name)
        record[f"{name}_gib"] = None if value is None else value / _GIB
    if getattr(transition, "displaced", None):  # a wake that took the GPU from a role still going to sleep
        record["displaced"] = transition.displaced
    return record | extra


class _Resident:
    """The sleep of a model that stays on its GPU: the guard still orders the phases; sleeping returns the cached
    activation memory to the device so the next role can allocate it (unless ``empty_cache`` is False:
    ``DeepSpeedEngineConfig.empty_cache_on_sleep``)."""

    def __init__(self, *, empty_cache: bool = True) -> None:
        self.empty_cache = empty_cache

    def sleep(self, **kwargs: Any) -> None:
        if self.empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake_up(self, **kwargs: Any) -> None:
        pass


@contextlib.contextmanager
def _tf32(enabled: bool):
    if not enabled:
        yield
        return
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision("highest")


class TrainerWorker(Worker):
    """One rank of a trainer role (actor, critic, reference, reward) over :class:`rlhfkit.deepspeed_engine.
    DeepSpeedEngine`, every sleep and wake through a :class:`~rlhfkit.phase.PhaseGuard` shared by the whole run."""

    def __init__(self, guard_store: Any, device_kind: str, model_path: str) -> None:
        # Only imports here (they are slow and run in parallel across roles); the GPU is not touched until load().
        clock = StartupClock()
        if device_kind == "cpu":  # skip a ~50 s JIT build of a CPU collective DeepSpeed does not need here
            require("deepspeed.ops", user="rlhfkit.hybrid").__compatible_ops__["deepspeed_shm_comm"] = False
        import torch._dynamo  # noqa: F401 — DeepSpeed imports it lazily while checking the optimizer
        transformers = require("transformers", user="rlhfkit.hybrid")
        require("deepspeed", user="rlhfkit.hybrid")

        import rlhfkit.deepspeed_engine  # noqa: F401

        transformers.AutoConfig.from_pretrained(model_path)
        self._startup = clock.lap("import_s")  # process_s, import_s; load() adds its own parts
        self.device_kind, self.model_path = device_kind, model_path
        bundle = int(os.environ["RLHFKIT_BUNDLE_INDICES"].split(",")[0])
        self.gpu = plan_gpu_key(int(os.environ["RLHFKIT_PLAN_NODE"]), bundle)
        self.guard = PhaseGuard(guard_store, gpu=self.gpu, sleep_hint=sleep_hint)
        self.events: list[dict[str, Any]] = []
        self.model: Any = None
        self.config: Any = None
        self.plan: Any = None  # the role's RolePlan: where its states live (what its sleeps move)
        self.overlap = False  # HybridPlan.overlap_switches: sleeps run behind the next role's wake
        self._prefetched: tuple[Any, Any, torch.Tensor] | None = None  # (config, HF model in host memory, RNG state)
        self.awake = False  # this rank holds its GPU's claim, the whole model on the GPU
        self.weights_kept = False  # asleep but for the weights (a keep-weights sleep): a push may read them
        self.sender: Any = None
        self._pending_backward = False  # a forward_backward's gradients wait for optim_step
        self._gradients_unknown = False  # a failed call's gradients could not be dropped (see _discard_after)
        self._send_stream: Any = None  # the CUDA stream a push beside a background sleep runs on
        self._resident = _Resident()
        self.background = BackgroundSleep(role=self.role, rank=self.rank)  # sleeps behind the next role's wake
        self._cuda_device: Any = None

    @property
    def trains(self) -> bool:
        return self.role in ("actor", "critic")

    # ------------------------------------------------------------------ lifecycle
    def prefetch(self, config: Any, plan: Any) -> dict[str, float]:
        """Read the model into host memory (no GPU, no claim: every role at once, while :meth:`load` places them one
        at a time); the next :meth:`load` of the same ``config`` and ``plan`` wraps it. Returns ``{"read_s"}``."""
        started = time.perf_counter()
        self._prefetched = self._read(config, plan)
        return {"read_s": time.perf_counter() - started}

    def _read(self, config: Any, plan: Any) -> tuple[Any, Any, torch.Tensor]:
        """``(config, the HF model in host memory, the RNG state after reading it)``: seeded, since a fresh value
        head draws from the generator, and :meth:`load` goes on from where the read left it."""
        from rlhfkit.deepspeed_engine import DeepSpeedEngine

        torch.manual_seed(config.seed)
        deepspeed = plan.deepspeed_config(config.deepspeed, device=self.device_kind)
        model = DeepSpeedEngine.read_pretrained(self.model_path, role=self.role, config=deepspeed)
        return (config, plan), model, torch.get_rng_state()

    def load(self, config: Any, plan: Any, *, measure_copy_rates: bool = False,
             overlap_switches: bool = False) -> dict[str, Any]:
        """Build the model of ``config`` (its TrainerConfig) placed as ``plan`` (its RolePlan: ZeRO stage, what its
        sleeps move) while holding the GPU's claim, then put it to sleep. ``measure_copy_rates``: first time
        this process's pinned host<->device copies on the still empty GPU (:func:`rlhfkit.hybrid.
        measure_copy_rates`; ``copy_rates`` is None on CPU). ``overlap_switches``: later sleeps run in the
        background, behind the next role's wake (``HybridPlan.overlap_switches``)."""
        from rlhfkit.deepspeed_engine import DeepSpeedEngine
        from rlhfkit.hybrid._copy_floor import measure_copy_rates as measure

        self.config, self.plan, self.overlap = config, plan, bool(overlap_switches)
        self._resident = _Resident(empty_cache=config.deepspeed.empty_cache_on_sleep)
        clock = StartupClock()
        self._transition("wake", "load")  # claim only: the model does not exist yet
        clock.lap("claim_s")
        if self.device_kind == "cuda":
            self._cuda_device = self.device()  # also for the background sleeps' threads (overlap_switches)
            torch.cuda.set_device(self._cuda_device)
        rates = measure(self.device()) if measure_copy_rates and self.device_kind == "cuda" else None
        clock.lap("copy_rates_s")
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is None or prefetched[0] != (config, plan):
            prefetched = self._read(config, plan)
        _, hf_model, rng = prefetched
        del prefetched
        torch.manual_seed(config.seed)  # the CUDA generator, seeded as before the read; the CPU one goes on from it
        torch.set_rng_state(rng)
        # trained roles own the accumulation boundary: backward accumulates, optim_step() is the boundary
        overrides = {"managed_gradient_accumulation": False} if self.trains else None
        deepspeed = plan.deepspeed_config(config.deepspeed, device=self.device_kind)
        model = DeepSpeedEngine(hf_model, role=self.role, config=deepspeed, ds_config_overrides=overrides,
                                lora=config.lora)
        del hf_model
        clock.lap("model_s")
        gc.collect()
        gc.freeze()  # offload_states calls gc.collect(); frozen long-lived objects make that cheap
        (model if plan.offload else self._resident).sleep()
        self._transition("sleep", "load")  # the claim was taken with no model: release it the same way
        clock.lap("sleep_s")
        self.model = model
        parts = self._startup | {f"load_{name}": value for name, value in clock.parts.items() if name != "process_s"}
        return {"parameters": sum(getattr(p, "ds_numel", p.numel()) for p in self.model.module.parameters()),
                "copy_rates": rates, "startup_parts": parts}

    def _keeps(self, what: str) -> bool:
        """Sleeps leave ``what`` (``"weights"``, ``"optimizer"``) on the GPU: the plan's choice
        (``RolePlan.keep_weights`` / ``keep_optimizer``) for a trained role that sleeps to host memory."""
        if not (self.trains and self.model is not None and self.plan.offload):
            return False
        return self.plan.keep_weights if what == "weights" else self.plan.keep_optimizer

    def _sleepable(self) -> Any:
        """What the guard wakes and puts to sleep (one object for the whole run: the guard's claim names it)."""
        if self.model is None:
            return None
        return self.model if self.plan.offload else self._resident

    def _transition(self, action: str, phase: str, *, keep_weights: bool = False) -> CallCost:
        """One guarded wake or sleep (``keep_weights`` as the caller resolved it); what it cost."""
        if action == "wake":
            transition = self.guard.wake(self.role, self._sleepable(), phase=phase,
                                         displace_releasing=self.overlap)
        else:
            kwargs = {"keep_weights": True} if keep_weights else {}
            if self._keeps("optimizer"):
                kwargs["keep_optimizer"] = True
            transition = self.guard.sleep(self.role, self._sleepable(), phase=phase, **kwargs)
        self.events.append(transition_record(transition, rank=self.rank))
        stats = transition.result if isinstance(transition.result, dict) else {}  # the resident stand-in: None
        moved, kept = float(stats.get("bytes_moved", 0.0)), float(stats.get("bytes_kept_on_host", 0.0))
        if action == "wake":
            return CallCost(switch_s=transition.seconds, bytes_h2d=moved)
        return CallCost(switch_s=transition.seconds, bytes_d2h=moved, bytes_kept=kept)

    def _wake(self, phase: str) -> CallCost:
        cost = self._transition("wake", phase)
        self.awake, self.weights_kept = True, False
        return cost

    def _sleep(self, phase: str, *, keep_weights: bool = False, now: bool = False) -> CallCost:
        """Put the model to sleep now; or, with ``overlap_switches`` (unless ``now``), mark its claim releasing (the
        next role may wake at once) and sleep in the background (:class:`~rlhfkit.hybrid._background_sleep.
        BackgroundSleep`). The rank's state is where the sleep leaves it from here on."""
        keep = self.model is not None and self.plan.offload and (keep_weights or self._keeps("weights"))
        self.weights_kept = keep and (self.weights_kept or self.awake)  # moved weights stay moved
        self.awake = False
        if now or not self.overlap:
            return self._transition("sleep", phase, keep_weights=keep)
        if not self.background.pending:
            self.guard.mark_releasing(self.role, self._sleepable())
        self.background.start(lambda: self._transition("sleep", phase, keep_weights=keep), phase=phase,
                              keep_weights=keep, device=self._cuda_device)
        return CallCost()

    def _reply(self, value: Any, cost: CallCost) -> WorkerReply:
        """``value`` with the call's cost and that of the background sleeps that ended since the last call."""
        return WorkerReply(value=value, cost=cost + self.background.take())

    def wake(self, phase: str = "wake") -> WorkerReply:
        """Wake the role (if asleep)."""
        self.background.settle("wake")
        return self._reply(None, CallCost() if self.awake else self._wake(phase))

    def sleep(self, phase: str = "sleep", keep_weights: bool = False) -> WorkerReply:
        """Put the role to sleep; when it kept only its weights, ``keep_weights=False`` moves those too. While a
        background sleep that keeps the weights still runs (``overlap_switches``), the weights' sleep is queued
        behind it and this returns at once."""
        keep_weights = keep_weights or self._keeps("weights")
        if self.background.pending and self.background.keeps_weights:
            return self._reply(None, CallCost() if keep_weights else self._sleep(phase))
        self.background.settle("sleep")
        cost = CallCost()
        if self.awake or (self.weights_kept and not keep_weights):
            cost = self._sleep(phase, keep_weights=keep_weights and self.plan.offload)
        return self._reply(None, cost)

    def guard_events(self, settle: bool = False) -> list[dict[str, Any]]:
        """The guarded transitions since the last call. A sleep still running in the background (``overlap_switches``)
        logs its transition when it ends, so it shows up in a later call; ``settle=True`` waits for it first (a
        complete log at the end of a run, not in a per-step log, where it would hold the driver)."""
        if settle:
            self.background.settle("guard_events")
        events, self.events = self.events, []
        return events

    def _begin(self, method: str, phase: str, wake: bool) -> CallCost:
        """Settle, check, and wake the role if asleep and the driver said so."""
        self.background.settle(method)
        if self.model is None:
            raise HybridCallError(f"{method}() on '{self.role}' rank {self.rank} before load()", role=self.role,
                                  rank=self.rank, phase=phase)
        if self.awake:
            return CallCost()
        if not wake:
            raise RoleAsleepError(f"{method}() called while '{self.role}' rank {self.rank} is asleep (phase "
                                  f"'{phase}'); pass wake=True or wake the role first", role=self.role,
                                  rank=self.rank, phase=phase)
        return self._wake(phase)

    def _end(self, phase: str, sleep_after: bool | str) -> CallCost:
        if sleep_after in (False, None):
            return CallCost()
        return self._sleep(phase, keep_weights=sleep_after == "keep_weights")

    @contextlib.contextmanager
    def _guarded_call(self, phase: str, *, discard: bool = False):
        """On an error, put the model back to sleep (nothing stays awake by accident) and re-raise. ``discard`` (a
        call that writes gradients: forward_backward, optim_step): first drop the gradients of the step, so that
        none of a failed call's micro-batches reaches a later step; other calls leave the step's gradients."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        except BaseException as error:
            if discard and self.trains:
                self._discard_after(error)
            if self.awake:
                with contextlib.suppress(Exception):
                    self._sleep(f"{phase}-failed", now=True)
            raise

    def _discard_after(self, error: BaseException) -> None:
        """Drop the step's gradients after ``error``; if that fails too, refuse training calls until
        :meth:`discard_gradients` succeeds (the error says so)."""
        self._pending_backward = False
        try:
            self.model.discard_gradients()
            self._gradients_unknown = False
        except Exception as discard_error:  # noqa: BLE001 - the call's own error is the one raised
            self._gradients_unknown = True
            error.add_note(f"'{self.role}' rank {self.rank}: dropping the step's gradients after this error failed "
                           f"too ({type(discard_error).__name__}: {discard_error}); call discard_gradients() "
                           "before training on")

    def _check_gradients_known(self, method: str, phase: str) -> None:
        if self._gradients_unknown:
            raise HybridCallError(f"{method}() on '{self.role}' rank {self.rank}: a failed call left gradients that "
                                  "could not be dropped; call discard_gradients() (TrainerGroup.discard_gradients) "
                                  "first", role=self.role, rank=self.rank, phase=phase)

    def discard_gradients(self, *, phase: str) -> WorkerReply:
        """Drop the gradients accumulated since the last optimizer step (a step given up after its
        ``forward_backward``); the next ``forward_backward`` starts a new step. Wakes the role only when it holds
        such gradients asleep."""
        self.background.settle("discard_gradients")
        cost = CallCost()
        if self.trains and self.model is not None and (self._pending_backward or self._gradients_unknown):
            cost = self._begin("discard_gradients", phase, True)
            with self._guarded_call(phase):
                self.model.discard_gradients()
            self._pending_backward = self._gradients_unknown = False
        return self._reply(None, cost)

    # ------------------------------------------------------------------ primitives
    def forward(self, batches: list, *, output: str, temperature: float, phase: str, wake: bool,
                sleep_after: bool | str, adapters: bool = True) -> WorkerReply:
        """No-grad forwards over this rank's micro-batches: ``[T]`` log-probs or values, or ``[N]`` rewards each."""
        cost = self._begin("forward", phase, wake)
        with self._guarded_call(phase):
            run = {"logprobs": lambda b: self.model.forward_logprobs(b, temperature=temperature,
                                                                     loss_tokens_only=True, adapters=adapters),
                   "values": self.model.forward_values, "rewards": self.model.forward_rewards}[output]
            batches = [batch.to(self.model.device) for batch in batches]
            with torch.no_grad(), _tf32(self.config.tf32_frozen_forward and not self.trains):
                outputs = [run(batch).float() for batch in batches]  # queued back to back; one wait for them all
            outputs = [output.cpu() for output in outputs]
            cost += _peaks() + self._end(phase, sleep_after)  # the peak before the sleep's cache release
        return self._reply(outputs, cost)

    def forward_backward(self, micro_batches: list, loss_fn: Any, *, output: str, temperature: float,
                         num_tokens: float, num_seqs: float, phase: str, wake: bool) -> WorkerReply:
        """Forward + ``loss_fn`` + backward on each micro-batch; gradients accumulate until :meth:`optim_step`.
        Its value: this rank's :class:`~rlhfkit.hybrid.ForwardBackwardResult` (its share of the loss)."""
        if self._pending_backward:
            raise HybridCallError(f"forward_backward() called twice on '{self.role}' rank {self.rank} without "
                                  "optim_step() in between; pass the whole minibatch to one forward_backward() (it "
                                  "is split into micro-batches) and call optim_step() after it", role=self.role,
                                  rank=self.rank, phase=phase)
        self._check_gradients_known("forward_backward", phase)
        loss_fn = self._loss_function(loss_fn)
        cost = self._begin("forward_backward", phase, wake)
        loss_sum, sums = 0.0, defaultdict(float)
        tensors: list[tuple[str, torch.Tensor]] = []  # stats the loss gave as tensors: read in one wait at the end
        # a failure on any micro-batch drops the gradients of those before it: no earlier forward_backward of this
        # step holds gradients (a second one is refused above), so the step's gradients are exactly this call's
        with self._guarded_call(phase, discard=True):
            device = self.model.device
            micro_batches = [micro.to(device) for micro in micro_batches]
            for index, micro in enumerate(micro_batches):
                if output == "logprobs":
                    outputs = self.model.forward_logprobs(micro.batch, temperature=temperature,
                                                          loss_tokens_only=True)
                else:
                    outputs = self.model.forward_values(micro.batch)
                loss, stats, value = self._call_loss(loss_fn, outputs, micro, num_tokens, num_seqs, index, phase)
                with _tf32(self.config.tf32_backward):
                    self.model.backward(loss)  # queued: nothing here waits for it (the next wait is the next
                loss_sum += value               # micro-batch's loss value, or the end of the call)
                for key, stat in stats.items():
                    if isinstance(stat, torch.Tensor):
                        tensors.append((key, stat.detach().reshape(()).double()))
                    else:
                        sums[key] += float(stat) / len(micro_batches)
            if tensors:
                for (key, _), stat in zip(tensors, torch.stack([t.to(device) for _, t in tensors]).tolist(),
                                          strict=True):
                    sums[key] += stat / len(micro_batches)
            self.model._pending_losses.clear()  # optim_step reports the loss; the wrapper's list is not used
            self._pending_backward = True
        result = ForwardBackwardResult(role=self.role, loss=loss_sum, stats=dict(sums), num_tokens=round(num_tokens),
                                       num_seqs=round(num_seqs))
        return self._reply(result, cost + _peaks())

    def _loss_function(self, shipped: Any) -> Any:
        """The caller's loss function, sent pickled; unpickled once while the same bytes keep coming."""
        if not isinstance(shipped, bytes):
            return shipped
        if getattr(self, "_loss_bytes", None) != shipped:
            import ray

            self._loss_fn, self._loss_bytes = ray.cloudpickle.loads(shipped), shipped
        return self._loss_fn

    def _call_loss(self, loss_fn: Any, outputs: torch.Tensor, micro: Any, num_tokens: float, num_seqs: float,
                   index: int, phase: str) -> tuple[torch.Tensor, dict[str, Any], float]:
        """The loss, its stats and its value (read once: the one wait for the GPU per micro-batch, before the
        backward is queued), checked."""
        where = f"on '{self.role}' rank {self.rank}, phase '{phase}', micro-batch {index}"
        result = loss_fn(outputs, micro, num_tokens=num_tokens, num_seqs=num_seqs)
        loss, stats = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.ndim == 0 else None
        bad = [f"stats[{key!r}] = {_shape(stat)}" for key, stat in (stats.items() if isinstance(stats, dict) else ())
               if not (isinstance(stat, numbers.Real) or isinstance(stat, torch.Tensor) and stat.numel() == 1)]
        if value is None:
            problem = (f"returned {_shape(loss)} {where}; it must return a scalar tensor (or (scalar tensor, dict of "
                       "floats))")
        elif not math.isfinite(value):
            problem = f"returned {value} {where}; check its inputs (advantages, log-ratios) for overflow"
        elif not loss.requires_grad:
            problem = (f"gave a loss {where} that does not depend on the model's outputs (no gradient); compute it "
                       "from the outputs it is given")
        elif not isinstance(stats, dict):
            problem = f"returned stats of type {type(stats).__name__} {where}; expected a dict of floats"
        elif bad:
            problem = f"returned {bad[0]} {where}; each stat must be a number or a one-element tensor"
        else:
            return loss, stats, value
        raise LossFunctionError(f"the loss function {_name(loss_fn)} {problem}", role=self.role, rank=self.rank,
                                phase=phase)

    def optim_step(self, *, phase: str, sleep_after: bool | str) -> WorkerReply:
        """One optimizer step over the gradients of the last ``forward_backward`` (the accumulation boundary); its
        value: an :class:`~rlhfkit.hybrid.OptimStepResult`."""
        self.background.settle("optim_step")
        self._check_gradients_known("optim_step", phase)
        if not self._pending_backward:
            raise HybridCallError(f"optim_step() on '{self.role}' rank {self.rank} with no forward_backward() "
                                  "before it", role=self.role, rank=self.rank, phase=phase)
        if not self.awake:
            raise RoleAsleepError(f"optim_step() called while '{self.role}' rank {self.rank} is asleep (phase "
                                  f"'{phase}')", role=self.role, rank=self.rank, phase=phase)
        with self._guarded_call(phase, discard=True):
            lr = float(self.model.ds_engine.get_lr()[0])
            norm = self.model.optimizer_step()
            self._pending_backward = False
            result = OptimStepResult(role=self.role, lr=lr, grad_norm=float("nan") if norm is None else float(norm),
                                     global_step=int(self.model.global_step))
            cost = self._end(phase, sleep_after)
        return self._reply(result, cost)

    def save(self, root: str, *, phase: str) -> WorkerReply:
        cost = self._begin("save", phase, True)
        with self._guarded_call(phase):
            path = self.model.save_checkpoint(root, export_hf=True)
        return self._reply(str(path), cost)

    def load_checkpoint(self, path: str, *, phase: str) -> WorkerReply:
        cost = self._begin("load_checkpoint", phase, True)
        with self._guarded_call(phase):
            client_state = self.model.load_checkpoint(path)
        return self._reply(client_state, cost)

    # ------------------------------------------------------------------ weights out
    def open_weight_sync(self, sender: bool, *, config: Any, world_size: int, group_name: str,
                         local: bool = False) -> Any:
        """Bind this rank's WeightSender (if it is one) and return its endpoint for the engines."""
        import ray

        from rlhfkit.weight_sync import SyncEndpoint, WeightSender

        self.background.settle("open_weight_sync")
        self.sync_config = config
        if not sender:
            return None
        # the control store listens on loopback when every receiver is on this node (``local``), else on the
        # node's address; either way its values are signed with the endpoint's secret (docs/security.md)
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        endpoint = SyncEndpoint(host=host, world_size=world_size, group_name=group_name,
                                label=f"{self.role}-{self.rank}")
        device = self.model.device if config.backend in ("nccl", "cuda_ipc") else None
        self.sender = WeightSender(config, endpoint, device=device)
        self.description = self.model.describe_parameters_for_sync(dtype=config.dtype)
        return self.sender.endpoint

    def _check_send(self, method: str, phase: str) -> bool:
        """Refuse a send this rank cannot make; True when it may run beside a background sleep that keeps the
        weights (see :meth:`send_weights`)."""
        if self.sender is None and self.rank == 0:
            raise HybridCallError(f"push_weights: '{self.role}' has no weight sender (only the actor's weights go to "
                                  "the engines)", role=self.role, rank=self.rank, phase=phase)
        beside = self.background.pending and self.background.keeps_weights and self.model.config.zero_stage < 3
        if not beside:
            self.background.settle(method)
            if self.model.is_asleep and not self.weights_kept:
                raise RoleAsleepError(f"push_weights: '{self.role}' rank {self.rank} is asleep without its weights; "
                                      "train with optim_step(sleep_after='keep_weights') or wake it", role=self.role,
                                      rank=self.rank, phase=phase)
        return beside

    def check_send(self, *, phase: str) -> None:
        """The refusals of :meth:`send_weights`, made before any engine starts to receive (a refused push then
        leaves nothing waiting)."""
        self._check_send("check_send", phase)

    def send_weights(self, *, phase: str) -> dict[str, Any]:
        """Stream the weights to the engines (every rank takes part in ZeRO-3's gathers; the sender ranks send).
        Beside a background sleep that keeps the weights (``overlap_switches``, ZeRO-0/1/2: it moves the optimizer's
        states, which the stream never reads), the stream starts at once; on a GPU its copies run on a stream of
        their own, ordered after the optimizer step's writes, so they do not queue behind that sleep's copies."""
        beside = self._check_send("send_weights", phase)
        side = None
        if beside and self.device_kind == "cuda":
            self._send_stream = side = self._send_stream or torch.cuda.Stream(self._cuda_device)
            side.wait_event(self.background.weights_written)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            stream = self.model.named_parameters_for_sync(bucket_bytes=self.sync_config.bucket_bytes,
                                                          dtype=self.sync_config.dtype)
            if self.sender is None:
                for _ in stream:
                    pass
                return {}
            report = self.sender.send(stream, description=self.description)
        if side is not None:
            side.synchronize()  # the weights' own sleep, queued behind, may move them only after these reads
        return {"version": report.version, "bytes": report.num_bytes, "seconds": report.seconds,
                "receiver_versions": list(report.receiver_versions)}

    def export(self, path: str, *, phase: str) -> dict[str, Any]:
        """Write the model as an HF folder in ``path`` (LoRA: merged, and the adapter in ``path/adapter``);
        :func:`rlhfkit.hybrid._export.export_model`. Collective; the role stays awake."""
        from rlhfkit.hybrid._export import export_model

        cost = self._begin("export", phase, True)
        with self._guarded_call(phase):
            export_model(self.model, path, source=self.model_path)
        return self._reply(None, cost)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _shape(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _peaks() -> CallCost:
    """torch's peak allocated memory since the call reset it (nothing on CPU)."""
    return CallCost(peak_gib=torch.cuda.max_memory_allocated() / _GIB if torch.cuda.is_available() else 0.0)
