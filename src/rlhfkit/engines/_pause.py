"""The engines' pause gate (the ``hf`` engine, and the ``vllm`` engine with ``VLLMEngineConfig(pausable=True)``):
another thread stops running ``generate`` calls at their next decode step, loads weights while they are parked, and
resumes them (the ``hf`` engine then resubmits their unfinished part; the ``vllm`` engine goes on stepping the same
requests, their KV cache kept).

What it does: counts the ``generate`` calls running and parked; :meth:`GenerationPause.pause` returns once every
running call is parked (no forward pass in flight, so the weights may change), bounded by a timeout that names how
many calls did not park; a parked call waits for :meth:`GenerationPause.resume` at most ``park_timeout_s``. What it
does not do: decode, or keep any KV cache across the pause. Needs only the standard library.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["GenerationPause", "GenerationPausedTimeout", "PausableGeneration"]


class GenerationPausedTimeout(TimeoutError):
    """A pause did not take effect, or a paused ``generate`` was not resumed, within its bound."""


class GenerationPause:
    """Thread-safe pause gate shared by an engine's ``generate`` calls (see the module docstring)."""

    def __init__(self, park_timeout_s: float) -> None:
        if isinstance(park_timeout_s, bool) or not isinstance(park_timeout_s, (int, float)) or not park_timeout_s > 0:
            raise ValueError(f"pause_timeout_s={park_timeout_s!r}; must be a number of seconds > 0")
        self.park_timeout_s = float(park_timeout_s)
        self._cond = threading.Condition()
        self._requested = False
        self._active = 0
        self._parked = 0

    @property
    def requested(self) -> bool:
        """True from :meth:`pause` until :meth:`resume` (read by the decode loop at every step, lock-free)."""
        return self._requested

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count one ``generate`` call as running for the duration of the block."""
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def park(self) -> bool:
        """Called by a running ``generate`` between decode rounds: if a pause is requested, wait (counted as parked)
        until it is resumed. Returns True when it parked. Raises :class:`GenerationPausedTimeout` after
        ``park_timeout_s`` without a resume."""
        with self._cond:
            if not self._requested:
                return False
            self._parked += 1
            self._cond.notify_all()
            try:
                if not self._cond.wait_for(lambda: not self._requested, timeout=self.park_timeout_s):
                    raise GenerationPausedTimeout(
                        f"generate() was paused (pause_generation) and not resumed within {self.park_timeout_s:g} s; "
                        "call resume_generation() after the weight update, or raise pause_timeout_s")
                return True
            finally:
                self._parked -= 1

    def pause(self, timeout_s: float) -> int:
        """Request a pause and wait until every running ``generate`` is parked; returns how many are. On timeout the
        pause is withdrawn and :class:`GenerationPausedTimeout` names the calls that did not park."""
        with self._cond:
            self._requested = True
            if not self._cond.wait_for(lambda: self._parked >= self._active, timeout=timeout_s):
                self._requested = False
                self._cond.notify_all()
                raise GenerationPausedTimeout(
                    f"pause_generation: {self._active - self._parked} of {self._active} running generate() calls did "
                    f"not reach a decode step within {timeout_s:g} s (a forward pass that does not return?); the "
                    "pause was withdrawn")
            return self._active

    def check_quiet(self, what: str) -> None:
        """Raise ``RuntimeError`` naming ``what`` when a ``generate`` call is running and not parked (a weight change
        now would race its forward passes)."""
        with self._cond:
            if self._active > self._parked:
                raise RuntimeError(f"{what} while {self._active - self._parked} generate() call(s) are running; call "
                                   "pause_generation() first (and resume_generation() after)")

    def resume(self) -> None:
        """Let parked calls go on (and new ones start); a no-op when not paused."""
        with self._cond:
            self._requested = False
            self._cond.notify_all()


class PausableGeneration:
    """The engines' in-flight update surface over ``self._pause`` (a :class:`GenerationPause`):
    ``pause_generation`` / ``resume_generation`` / ``generation_paused``. ``_check_pausable`` may refuse."""

    _pause: GenerationPause

    def _check_pausable(self) -> None:
        """Raise when this engine cannot pause (a configuration without it); pausable by default."""

    def pause_generation(self, timeout_s: float = 60.0) -> int:
        """Stop running ``generate`` calls at their next decode step and hold new ones, so that weights can be loaded
        mid-generation (from another thread); returns how many calls are parked. Bounded: raises
        :class:`GenerationPausedTimeout` (and withdraws the pause) if a call does not reach a decode step within
        ``timeout_s``. Call :meth:`resume_generation` after the load."""
        self._check_pausable()
        return self._pause.pause(timeout_s)

    def resume_generation(self) -> None:
        """Let paused ``generate`` calls go on under the weights loaded meanwhile (the HF engine resubmits their
        unfinished samples; a pausable vLLM engine steps the same requests again)."""
        self._pause.resume()

    @property
    def generation_paused(self) -> bool:
        return self._pause.requested
