"""The Ray actor behind :class:`rlhfkit.hybrid.TrainerGroup`: one DeepSpeed model of one role on one rank.

Each method is one primitive with its guarded wake and sleep folded in (an actor runs its calls in order, so a call
is one round trip). The algorithm is not here: losses come from the caller as a function, shipped with the call.
"""

from __future__ import annotations

import contextlib
import gc
import math
import numbers
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, wait
from typing import Any

import torch

from rlhfkit._optional import require
from rlhfkit.hybrid._errors import HybridCallError, LossFunctionError, RoleAsleepError, sleep_hint
from rlhfkit.hybrid._timer import StartupClock
from rlhfkit.phase import PhaseGuard
from rlhfkit.workers import Worker

_GIB = 1024**3
OUTPUTS = ("logprobs", "values", "rewards")
SETTLE_TIMEOUT_S = 600.0  # the longest a call waits for the background sleep of the call before it


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


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _since(started: tuple[float, float], switch: float) -> dict[str, float]:
    """A call's own time (``worker_s``: wall, less its sleeps and wakes) and the CPU time of the thread that ran
    it (``worker_cpu_s``): far below ``worker_s`` when the thread waited (for the GPU, or for a core)."""
    return {"worker_s": max(0.0, time.perf_counter() - started[0] - switch),
            "worker_cpu_s": time.thread_time() - started[1]}


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
        self._prefetched: tuple[Any, Any, torch.Tensor] | None = None  # (config, HF model in host memory, RNG state)
        self.awake = False
        self.sender: Any = None
        self._pending_backward = False  # a forward_backward's gradients wait for optim_step
        self._gradients_unknown = False  # a failed call's gradients could not be dropped (see _discard_after)
        self._resident = _Resident()
        # copied by sleeps / wakes since the last call's report; kept: freed by sleeps without a copy
        self._moved = {"bytes_d2h": 0.0, "bytes_h2d": 0.0, "bytes_kept": 0.0}
        self.overlap = False  # HybridConfig.overlap_switches: sleeps run behind the next role's wake
        self._background: tuple[threading.Thread, str, bool] | None = None  # a sleep still running: phase, keep
        self._background_error: tuple[BaseException, str] | None = None  # what a background sleep raised, its phase
        self._overlapped_s = 0.0  # seconds of background sleeps since the last report
        self._stats_lock = threading.Lock()  # the counters above: a background sleep adds while a call reports
        self._weights_written: Any = None  # CUDA event after the step a weights-keeping background sleep follows
        self._send_stream: Any = None  # the CUDA stream a push beside that sleep runs on
        self._finishing: tuple[Future, str] | None = None  # the optimizer states' wake behind a call, its phase
        self._overlapped_wake_s = 0.0  # seconds of those wakes since the last report

    @property
    def trains(self) -> bool:
        return self.role in ("actor", "critic")

    # ------------------------------------------------------------------ lifecycle
    def prefetch(self, config: Any) -> dict[str, float]:
        """Read the model into host memory (no GPU, no claim: every role at once, while :meth:`load` places them one
        at a time); the next :meth:`load` of the same ``config`` wraps it. Returns ``{"read_s"}``."""
        started = time.perf_counter()
        self._prefetched = self._read(config)
        return {"read_s": time.perf_counter() - started}

    def _read(self, config: Any) -> tuple[Any, Any, torch.Tensor]:
        """``(config, the HF model in host memory, the RNG state after reading it)``: seeded, since a fresh value
        head draws from the generator, and :meth:`load` goes on from where the read left it."""
        from rlhfkit.deepspeed_engine import DeepSpeedEngine

        torch.manual_seed(config.seed)
        model = DeepSpeedEngine.read_pretrained(self.model_path, role=self.role, config=config.deepspeed)
        return config, model, torch.get_rng_state()

    def load(self, config: Any, *, measure_copy_rates: bool = False, overlap_switches: bool = False) -> dict[str, Any]:
        """Build the model while holding the GPU's claim, then put it to sleep. ``measure_copy_rates``: first time
        this process's pinned host<->device copies on the still empty GPU (:func:`rlhfkit.hybrid.
        measure_copy_rates`; ``copy_rates`` is None on CPU). ``overlap_switches``: later sleeps run in the
        background, behind the next role's wake (``HybridConfig.overlap_switches``)."""
        from rlhfkit.deepspeed_engine import DeepSpeedEngine
        from rlhfkit.hybrid._copy_floor import measure_copy_rates as measure

        self.config, self.overlap = config, bool(overlap_switches)
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
        if prefetched is None or prefetched[0] != config:
            prefetched = self._read(config)
        _, hf_model, rng = prefetched
        del prefetched
        torch.manual_seed(config.seed)  # the CUDA generator, seeded as before the read; the CPU one goes on from it
        torch.set_rng_state(rng)
        # trained roles own the accumulation boundary: backward accumulates, optim_step() is the boundary
        overrides = {"managed_gradient_accumulation": False} if self.trains else None
        model = DeepSpeedEngine(hf_model, role=self.role, config=config.deepspeed, ds_config_overrides=overrides,
                                lora=config.lora)
        del hf_model
        clock.lap("model_s")
        gc.collect()
        gc.freeze()  # offload_states calls gc.collect(); frozen long-lived objects make that cheap
        (model if config.offload else self._resident).sleep()
        self._transition("sleep", "load")  # the claim was taken with no model: release it the same way
        clock.lap("sleep_s")
        self.model = model
        self._take_moved()  # loading is not a phase switch of any step
        parts = self._startup | {f"load_{name}": seconds for name, seconds in clock.parts.items() if name != "process_s"}
        return {"parameters": sum(getattr(p, "ds_numel", p.numel()) for p in self.model.module.parameters()),
                "copy_rates": rates, "startup_parts": parts}

    def _keeps_optimizer(self) -> bool:
        """Sleeps leave the optimizer's states on the GPU (``TrainerConfig.sleep_optimizer=False``, a trained role
        that sleeps to host memory)."""
        return self.trains and self.model is not None and self.config.offload and self.config.sleep_optimizer is False

    def _keeps_weights(self) -> bool:
        """Sleeps leave the weights on the GPU (``TrainerConfig.sleep_weights=False``, a trained role that sleeps to
        host memory): a full sleep is one that keeps them."""
        return self.trains and self.model is not None and self.config.offload and self.config.sleep_weights is False

    def _sleepable(self) -> Any:
        """What the guard wakes and puts to sleep (one object for the whole run: the guard's claim names it)."""
        return self.model if (self.config.offload and self.model is not None) else self._resident

    def _transition(self, action: str, phase: str, **kwargs: Any) -> float:
        if action == "sleep" and self._keeps_optimizer():
            kwargs["keep_optimizer"] = True
        if action == "sleep" and self._keeps_weights():
            kwargs["keep_weights"] = True
        if action == "wake":
            transition = self.guard.wake(self.role, self._sleepable() if self.model is not None else None,
                                         phase=phase, displace_releasing=self.overlap, **kwargs)
            self.awake = True
        else:
            transition = self.guard.sleep(self.role, self._sleepable() if self.model is not None else None,
                                          phase=phase, **kwargs)
            self.awake = False
        if isinstance(transition.result, dict):  # a DeepSpeed engine's stats (the resident stand-in returns None)
            with self._stats_lock:
                self._moved["bytes_d2h" if action == "sleep" else "bytes_h2d"] += transition.result.get("bytes_moved",
                                                                                                       0)
                self._moved["bytes_kept"] += transition.result.get("bytes_kept_on_host", 0)
        self.events.append(transition_record(transition, rank=self.rank))
        return transition.seconds

    def _report(self) -> dict[str, Any]:
        """What every call returns besides its own results: the bytes its sleeps and wakes copied, and the state it
        leaves the role in (``awake``; ``weights_only``: asleep but for the weights), so the caller can skip calls
        that would do nothing; ``overlapped_s``: seconds of background sleeps that finished since the last report
        (their bytes are in the byte counts of the report after they finish)."""
        weights_only = self._background[2] if self._background is not None else self._weights_only
        weights_only = weights_only and not self._keeps_weights()  # no later sleep would move them
        with self._stats_lock:
            overlapped, self._overlapped_s = self._overlapped_s, 0.0
            overlapped_wake, self._overlapped_wake_s = self._overlapped_wake_s, 0.0
        return {**self._take_moved(), "awake": self.awake, "weights_only": weights_only, "overlapped_s": overlapped,
                "overlapped_wake_s": overlapped_wake}

    def _sleep(self, phase: str, *, keep_weights: bool = False, after: threading.Thread | None = None) -> float:
        """Put the model to sleep now; or, with ``overlap_switches``, mark its claim releasing (the next role may
        wake at once) and sleep in a background thread, which every later call joins first (``after``: a background
        sleep that keeps the weights, still running; this one, the rest of the way, starts when it ends). Returns
        the seconds spent here."""
        if not self.overlap:
            return self._transition("sleep", phase, keep_weights=keep_weights)
        if after is None:
            self.guard.mark_releasing(self.role, self._sleepable() if self.model is not None else None)
            if keep_weights and self.device_kind == "cuda":  # what a send beside this sleep orders its reads after
                self._weights_written = torch.cuda.Event()
                self._weights_written.record()
        self.awake = False  # going to sleep: no call runs before that sleep is over (_settle)

        def sleep() -> None:
            try:
                if after is not None:
                    after.join(SETTLE_TIMEOUT_S)
                    if after.is_alive():
                        raise HybridCallError(f"'{self.role}' rank {self.rank}: its sleep before phase '{phase}' "
                                              f"did not finish within {SETTLE_TIMEOUT_S:g} s", role=self.role,
                                              rank=self.rank, phase=phase)
                    if self._background_error is not None:
                        return  # that sleep failed: the next call raises its error
                if self.device_kind == "cuda":
                    torch.cuda.set_device(self._cuda_device)
                seconds = self._transition("sleep", phase, keep_weights=keep_weights)
                with self._stats_lock:
                    self._overlapped_s += seconds
            except BaseException as error:  # noqa: BLE001 - raised by the next call (_settle), naming the phase
                self._background_error = (error, phase)

        thread = threading.Thread(target=sleep, name=f"{self.role}-{self.rank}-sleep", daemon=True)
        self._background = (thread, phase, keep_weights)
        thread.start()
        return 0.0

    def _wake_optimizer_behind(self, phase: str) -> None:
        """Bring the optimizer's states back in the background while this call computes
        (:meth:`~rlhfkit.deepspeed_engine.DeepSpeedEngine.finish_wake_behind`); the next call, or a sleep, waits for
        them (:meth:`_settle`)."""
        start = getattr(self.model, "finish_wake_behind", None)
        future = start() if start is not None else None
        if future is not None:
            self._finishing = (future, phase)

    def _join_wake(self, method: str) -> None:
        """Wait for the optimizer states' background wake (:meth:`_wake_optimizer_behind`); raise what it raised."""
        if self._finishing is None:
            return
        future, phase = self._finishing
        what = "the wake of its optimizer states in phase"
        if not wait([future], timeout=SETTLE_TIMEOUT_S).done:
            raise HybridCallError(f"{method}() on '{self.role}' rank {self.rank}: {what} '{phase}' did not finish "
                                  f"within {SETTLE_TIMEOUT_S:g} s", role=self.role, rank=self.rank, phase=phase)
        self._finishing, error = None, future.exception()
        self._raise_failed(None if error is None else (error, phase), method, what=what)
        stats = future.result()
        with self._stats_lock:
            self._moved["bytes_h2d"] += stats.get("bytes_moved", 0.0)
            self._overlapped_wake_s += stats.get("seconds", 0.0)

    def _settle(self, method: str) -> None:
        """Wait for a background sleep (``overlap_switches``) or wake of the optimizer's states to finish; raise what
        it raised, naming the phase it closed and the call that found out."""
        self._join_wake(method)
        if self._background is None:
            return
        thread, phase, _ = self._background
        self._join(thread, phase, method, what="its sleep after phase")
        self._background, failed, self._background_error = None, self._background_error, None
        self._raise_failed(failed, method, what="its sleep after phase")

    def _join(self, thread: threading.Thread, phase: str, method: str, *, what: str) -> None:
        """Wait for one of this worker's background threads, at most ``SETTLE_TIMEOUT_S``."""
        thread.join(SETTLE_TIMEOUT_S)
        if thread.is_alive():
            raise HybridCallError(f"{method}() on '{self.role}' rank {self.rank}: {what} '{phase}' did not finish "
                                  f"within {SETTLE_TIMEOUT_S:g} s", role=self.role, rank=self.rank, phase=phase)

    def _raise_failed(self, failed: tuple[BaseException, str] | None, method: str, *, what: str) -> None:
        """Raise what a background thread raised (``failed``: the error and its phase), naming the call that found
        out."""
        if failed is not None:
            error, phase = failed
            raise HybridCallError(f"'{self.role}' rank {self.rank}: {what} '{phase}' failed in the background "
                                  f"({type(error).__name__}: {error}); found by {method}()", role=self.role,
                                  rank=self.rank, phase=phase) from error

    def _take_moved(self) -> dict[str, float]:
        """The bytes sleeps and wakes copied since the last call (reported with its ``switch_s``)."""
        with self._stats_lock:
            moved, self._moved = self._moved, {"bytes_d2h": 0.0, "bytes_h2d": 0.0, "bytes_kept": 0.0}
        return moved

    def wake(self, phase: str = "wake") -> dict[str, float]:
        """Wake the role (if asleep); returns ``switch_s`` and the bytes moved (``bytes_d2h``, ``bytes_h2d``)."""
        self._settle("wake")
        seconds = 0.0 if self.awake else self._transition("wake", phase)
        return {"switch_s": seconds, **self._report()}

    @property
    def _weights_only(self) -> bool:
        """Asleep but for the weights (``sleep(keep_weights=True)``): a push may read them, a full sleep moves them."""
        return self.model is not None and self.model.is_asleep and self.model._weights_kept

    def sleep(self, phase: str = "sleep", keep_weights: bool = False) -> dict[str, float]:
        """Put the role to sleep; when it kept only its weights, ``keep_weights=False`` moves those too. Returns
        ``switch_s`` and the bytes moved (``bytes_d2h``, ``bytes_h2d``). While a background sleep that keeps the
        weights still runs (``overlap_switches``, after ``optim_step(sleep_after="keep_weights")``), the weights'
        sleep is queued behind it and this returns at once."""
        keep_weights = keep_weights or self._keeps_weights()
        background = self._background
        if background is not None and background[2] and self.overlap:
            if not keep_weights:
                self._sleep(phase, after=background[0])
            return {"switch_s": 0.0, **self._report()}
        self._settle("sleep")
        seconds = 0.0
        if self.awake or (self._weights_only and not keep_weights):
            seconds = self._sleep(phase, keep_weights=keep_weights and self.config.offload)
        return {"switch_s": seconds, **self._report()}

    def guard_events(self, settle: bool = False) -> list[dict[str, Any]]:
        """The guarded transitions since the last call. A sleep still running in the background (``overlap_switches``)
        logs its transition when it ends, so it shows up in a later call; ``settle=True`` waits for it first (a
        complete log at the end of a run, not in a per-step log, where it would hold the driver)."""
        if settle:
            self._settle("guard_events")
        events, self.events = self.events, []
        return events

    def _begin(self, method: str, phase: str, wake: bool, *, defer_optimizer: bool = False) -> float:
        """Settle, check, and wake the role if asleep. ``defer_optimizer`` (a call that leaves the role awake and
        does not step): leave the optimizer's states on the host; the call starts their wake behind its compute
        (:meth:`_wake_optimizer_behind`) once its inputs are on the device."""
        self._settle(method)
        if self.model is None:
            raise HybridCallError(f"{method}() on '{self.role}' rank {self.rank} before load()", role=self.role,
                                  rank=self.rank, phase=phase)
        if self.awake:
            return 0.0
        if not wake:
            raise RoleAsleepError(f"{method}() called while '{self.role}' rank {self.rank} is asleep (phase "
                                  f"'{phase}'); pass wake=True or wake the role first", role=self.role,
                                  rank=self.rank, phase=phase)
        if not (defer_optimizer and self.trains and self.config.offload and self.config.defer_optimizer_wake):
            return self._transition("wake", phase)
        return self._transition("wake", phase, defer_optimizer=True)  # the caller starts the rest behind its work

    @contextlib.contextmanager
    def _guarded_call(self, phase: str, *, discard: bool = False):
        """On an error, put the model back to sleep (nothing stays awake by accident) and re-raise. ``discard`` (a
        call that writes gradients: forward_backward, optim_step): first drop the gradients of the step, so that
        none of a failed call's micro-batches reaches a later step; other calls leave the step's gradients."""
        try:
            yield
        except BaseException as error:
            with contextlib.suppress(Exception):
                self._join_wake(f"{phase}-failed")  # the optimizer states' wake ends before the sleep
            if discard and self.trains:
                self._discard_after(error)
            if self.awake:
                with contextlib.suppress(Exception):
                    self._transition("sleep", f"{phase}-failed")
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

    def discard_gradients(self, *, phase: str) -> dict[str, Any]:
        """Drop the gradients accumulated since the last optimizer step (a step given up after its
        ``forward_backward``); the next ``forward_backward`` starts a new step. Wakes the role only when it holds
        such gradients asleep."""
        self._settle("discard_gradients")
        switch = 0.0
        if self.trains and self.model is not None and (self._pending_backward or self._gradients_unknown):
            switch = self._begin("discard_gradients", phase, True)
            with self._guarded_call(phase):
                self.model.discard_gradients()
            self._pending_backward = self._gradients_unknown = False
        return {"switch_s": switch, **self._report()}

    def _end(self, phase: str, sleep_after: bool | str) -> float:
        if sleep_after in (False, None):
            return 0.0
        return self._sleep(phase, keep_weights=sleep_after == "keep_weights" and self.config.offload)

    # ------------------------------------------------------------------ primitives
    def forward(self, batches: list, *, output: str, temperature: float, phase: str, wake: bool,
                sleep_after: bool | str, adapters: bool = True) -> dict[str, Any]:
        """No-grad forwards over this rank's micro-batches: ``[T]`` log-probs or values, or ``[N]`` rewards each."""
        started = _clocks()
        switch = self._begin("forward", phase, wake, defer_optimizer=sleep_after in (False, None))
        with self._guarded_call(phase):
            _reset_peak()
            run = {"logprobs": lambda b: self.model.forward_logprobs(b, temperature=temperature,
                                                                     loss_tokens_only=True, adapters=adapters),
                   "values": self.model.forward_values, "rewards": self.model.forward_rewards}[output]
            batches = [batch.to(self.model.device) for batch in batches]  # before a wake behind the call
            self._wake_optimizer_behind(phase)
            with torch.no_grad(), _tf32(self.config.tf32_frozen_forward and not self.trains):
                outputs = [run(batch).float() for batch in batches]  # queued back to back; one wait for them all
            outputs = [output.cpu() for output in outputs]
            peak = _peak_gib()
            switch += self._end(phase, sleep_after)
        return {"outputs": outputs, "switch_s": switch, "peak_gib": peak, **_since(started, switch),
                **self._report()}

    def forward_backward(self, micro_batches: list, loss_fn: Any, *, output: str, temperature: float,
                         num_tokens: float, num_seqs: float, phase: str, wake: bool) -> dict[str, Any]:
        """Forward + ``loss_fn`` + backward on each micro-batch; gradients accumulate until :meth:`optim_step`."""
        if self._pending_backward:
            raise HybridCallError(f"forward_backward() called twice on '{self.role}' rank {self.rank} without "
                                  "optim_step() in between; pass the whole minibatch to one forward_backward() (it "
                                  "is split into micro-batches) and call optim_step() after it", role=self.role,
                                  rank=self.rank, phase=phase)
        self._check_gradients_known("forward_backward", phase)
        started = _clocks()
        loss_fn = self._loss_function(loss_fn)
        switch = self._begin("forward_backward", phase, wake, defer_optimizer=True)
        sums: dict[str, float] = defaultdict(float)
        tensors: list[tuple[str, torch.Tensor]] = []  # stats the loss gave as tensors: read in one wait at the end
        # a failure on any micro-batch drops the gradients of those before it: no earlier forward_backward of this
        # step holds gradients (a second one is refused above), so the step's gradients are exactly this call's
        with self._guarded_call(phase, discard=True):
            _reset_peak()
            device = self.model.device
            # the inputs first: the optimizer states' wake behind the call then holds the copy engine
            micro_batches = [micro.to(device) for micro in micro_batches]
            self._wake_optimizer_behind(phase)
            for index, micro in enumerate(micro_batches):
                if output == "logprobs":
                    outputs = self.model.forward_logprobs(micro.batch, temperature=temperature,
                                                          loss_tokens_only=True)
                else:
                    outputs = self.model.forward_values(micro.batch)
                loss, stats, value = self._call_loss(loss_fn, outputs, micro, num_tokens, num_seqs, index, phase)
                with _tf32(self.config.tf32_backward):
                    self.model.backward(loss)  # queued: nothing here waits for it (the next wait is the next
                sums["loss"] += value           # micro-batch's loss value, or the end of the call)
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
        return {"stats": dict(sums), "switch_s": switch, "peak_gib": _peak_gib(),
                "peak_reserved_gib": _peak_gib(reserved=True), **_since(started, switch),
                **self._report()}

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
        where = f"'{self.role}' rank {self.rank}, phase '{phase}', micro-batch {index}"
        result = loss_fn(outputs, micro, num_tokens=num_tokens, num_seqs=num_seqs)
        loss, stats = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise LossFunctionError(f"the loss function {_name(loss_fn)} returned {shape} on {where}; it must "
                                    "return a scalar tensor (or (scalar tensor, dict of floats))", role=self.role,
                                    rank=self.rank, phase=phase)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise LossFunctionError(f"the loss function {_name(loss_fn)} returned {value} on {where}; "
                                    "check its inputs (advantages, log-ratios) for overflow", role=self.role,
                                    rank=self.rank, phase=phase)
        if not loss.requires_grad:
            raise LossFunctionError(f"the loss of {_name(loss_fn)} on {where} does not depend on the model's "
                                    "outputs (no gradient); compute it from the outputs it is given",
                                    role=self.role, rank=self.rank, phase=phase)
        if not isinstance(stats, dict):
            raise LossFunctionError(f"the loss function {_name(loss_fn)} returned stats of type "
                                    f"{type(stats).__name__} on {where}; expected a dict of floats", role=self.role,
                                    rank=self.rank, phase=phase)
        for key, stat in stats.items():
            if isinstance(stat, torch.Tensor) and stat.numel() == 1:
                continue
            if not isinstance(stat, numbers.Real):  # int, float, bool, numpy scalars
                shape = tuple(stat.shape) if isinstance(stat, torch.Tensor) else type(stat).__name__
                raise LossFunctionError(f"the loss function {_name(loss_fn)} returned stats[{key!r}] = {shape} on "
                                        f"{where}; each stat must be a number or a one-element tensor",
                                        role=self.role, rank=self.rank, phase=phase)
        return loss, stats, value

    def optim_step(self, *, phase: str, sleep_after: bool | str) -> dict[str, Any]:
        """One optimizer step over the gradients of the last ``forward_backward`` (the accumulation boundary)."""
        self._settle("optim_step")
        self._check_gradients_known("optim_step", phase)
        if not self._pending_backward:
            raise HybridCallError(f"optim_step() on '{self.role}' rank {self.rank} with no forward_backward() "
                                  "before it", role=self.role, rank=self.rank, phase=phase)
        if not self.awake:
            raise RoleAsleepError(f"optim_step() called while '{self.role}' rank {self.rank} is asleep (phase "
                                  f"'{phase}')", role=self.role, rank=self.rank, phase=phase)
        started = _clocks()
        with self._guarded_call(phase, discard=True):
            lr = float(self.model.ds_engine.get_lr()[0])
            norm = self.model.optimizer_step()
            self._pending_backward = False
            stats = {"lr": lr, "grad_norm": float("nan") if norm is None else float(norm),
                     "global_step": float(self.model.global_step)}
            switch = self._end(phase, sleep_after)
        return {"stats": stats, "switch_s": switch, **_since(started, switch), **self._report()}

    def save(self, root: str, *, phase: str) -> dict[str, Any]:
        switch = self._begin("save", phase, True)
        with self._guarded_call(phase):
            path = self.model.save_checkpoint(root, export_hf=True)
        return {"path": str(path), "switch_s": switch, **self._report()}

    def load_checkpoint(self, path: str, *, phase: str) -> dict[str, Any]:
        switch = self._begin("load_checkpoint", phase, True)
        with self._guarded_call(phase):
            client_state = self.model.load_checkpoint(path)
        return {"client_state": client_state, "switch_s": switch, **self._report()}

    # ------------------------------------------------------------------ weights out
    def open_weight_sync(self, sender: bool, *, config: Any, world_size: int, group_name: str,
                         local: bool = False) -> Any:
        """Bind this rank's WeightSender (if it is one) and return its endpoint for the engines."""
        import ray

        from rlhfkit.weight_sync import SyncEndpoint, WeightSender

        self._settle("open_weight_sync")
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
        background = self._background
        beside = background is not None and background[2] and self.model.config.zero_stage < 3
        if not beside:
            self._settle(method)
            if self.model.is_asleep and not self._weights_only:
                raise RoleAsleepError(f"push_weights: '{self.role}' rank {self.rank} is asleep without its weights; "
                                      "train with optim_step(sleep_after='keep_weights') or wake it", role=self.role,
                                      rank=self.rank, phase=phase)
        return beside

    def check_send(self, *, phase: str) -> None:
        """The refusals of :meth:`send_weights`, made before the engines are armed to receive (a refused push then
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
            side.wait_event(self._weights_written)
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

        switch = self._begin("export", phase, True)
        with self._guarded_call(phase):
            export_model(self.model, path, source=self.model_path)
        return {"switch_s": switch, **self._report()}


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(*, reserved: bool = False) -> float:
    """torch's peak since the last reset: allocated, or ``reserved`` (allocated plus the caching allocator's blocks)."""
    if not torch.cuda.is_available():
        return 0.0
    return (torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / _GIB
