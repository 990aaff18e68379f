"""A trainer rank's sleeps run in a thread, behind the next role's wake (``HybridConfig.overlap_switches``).

The worker marks its phase-guard claim releasing, hands the sleep to :class:`BackgroundSleep` and returns; the next
role may take the GPU at once (both models' memory must fit, which the run's plan checks). Every later call of the
worker first :meth:`~BackgroundSleep.settle`\\ s: it waits for the sleep and raises what it raised, naming the phase it
closed. A second sleep while one runs (the weights' sleep after a sleep that kept them) starts when the first ends.
Needs torch; no Ray.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from rlhfkit.hybrid._errors import HybridCallError
from rlhfkit.hybrid._results import CallCost

__all__ = ["SETTLE_TIMEOUT_S", "BackgroundSleep"]

SETTLE_TIMEOUT_S = 600.0  # the longest a call waits for the background sleep of the call before it


class BackgroundSleep:
    """The background sleeps of one rank (``role``, ``rank``: for the errors); at most one pending at a time."""

    def __init__(self, *, role: str, rank: int) -> None:
        self.role, self.rank = role, rank
        self.keeps_weights = False  # the pending sleep leaves the weights on the GPU (a push may read them)
        self.weights_written: Any = None  # CUDA event after the step that sleep follows: what a push orders after
        self._thread: threading.Thread | None = None
        self._phase = ""
        self._error: tuple[BaseException, str] | None = None
        self._finished = CallCost()  # what the sleeps that ended since the last take() cost
        self._lock = threading.Lock()

    @property
    def pending(self) -> bool:
        """A sleep was started and not yet settled."""
        return self._thread is not None

    def start(self, sleep: Callable[[], CallCost], *, phase: str, keep_weights: bool, device: Any = None) -> None:
        """Run ``sleep`` in a thread (after the pending one, if any); ``device``: the CUDA device to run it on."""
        before, before_phase = self._thread, self._phase
        if before is None and keep_weights and device is not None:
            self.weights_written = torch.cuda.Event()
            self.weights_written.record()

        def run() -> None:
            try:
                if before is not None:
                    self._join(before, before_phase, "its next sleep")
                    if self._error is not None:
                        return  # that sleep failed: the next call raises its error
                if device is not None:
                    torch.cuda.set_device(device)
                cost = sleep()
                with self._lock:
                    self._finished += replace(cost, switch_s=0.0, background_s=cost.switch_s)
            except BaseException as error:  # noqa: BLE001 - raised by the next call (settle), naming the phase
                self._error = (error, phase)

        self._thread = threading.Thread(target=run, name=f"{self.role}-{self.rank}-sleep", daemon=True)
        self._phase, self.keeps_weights = phase, keep_weights
        self._thread.start()

    def settle(self, method: str) -> None:
        """Wait for the pending sleep (at most ``SETTLE_TIMEOUT_S``); raise what it raised, naming ``method``."""
        if self._thread is None:
            return
        self._join(self._thread, self._phase, f"{method}()")
        self._thread, self.keeps_weights, self.weights_written = None, False, None
        failed, self._error = self._error, None
        if failed is not None:
            error, phase = failed
            raise HybridCallError(f"'{self.role}' rank {self.rank}: its sleep after phase '{phase}' failed in the "
                                  f"background ({type(error).__name__}: {error}); found by {method}()",
                                  role=self.role, rank=self.rank, phase=phase) from error

    def take(self) -> CallCost:
        """The seconds and bytes of the sleeps that ended since the last call (``background_s``, bytes)."""
        with self._lock:
            finished, self._finished = self._finished, CallCost()
        return finished

    def _join(self, thread: threading.Thread, phase: str, waiter: str) -> None:
        thread.join(SETTLE_TIMEOUT_S)
        if thread.is_alive():
            raise HybridCallError(f"{waiter} on '{self.role}' rank {self.rank}: its sleep after phase '{phase}' did "
                                  f"not finish within {SETTLE_TIMEOUT_S:g} s", role=self.role, rank=self.rank,
                                  phase=phase)

