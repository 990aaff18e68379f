"""The producer thread of :mod:`rlhfkit.rollouts`: :class:`RolloutProducer` generates rollouts on prompt batches and
puts them into a :class:`~rlhfkit.rollouts.RolloutBuffer` until stopped or out of prompts."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rlhfkit.rollouts._buffer import (
    RolloutBuffer,
    RolloutBufferClosedError,
    RolloutProducerError,
    RolloutTimeoutError,
    _check_seconds,
    _Group,
)
from rlhfkit.types import Rollout

__all__ = ["RolloutProducer"]

logger = logging.getLogger(__name__)


class RolloutProducer:
    """A daemon thread that generates rollouts for a :class:`RolloutBuffer` until stopped or out of prompts.

    Args:
        buffer: where the groups go.
        generate: ``generate_fn(prompts, weight_version) -> list[Rollout]`` (``len(prompts) × n`` rollouts,
            prompt-major), or an object with ``.generate(prompts, sampling)`` (an ``EngineGroup``, ``RolloutEngines``,
            an engine), called with ``sampling``.
        prompts: an iterable of prompt batches (each a list of token-id lists); the producer stops at its end.
        current_version: returns the weight version the engines hold now (e.g. the trainer's push count); read when
            a batch is admitted, it stamps the batch's groups.
        sampling: the ``SamplingConfig`` for an object ``generate``; unused with a function.
        name: names the producer (thread name, errors, timeout messages).
        admission_timeout_s: longest wait for room or for the staleness bound before a batch; default
            ``buffer.config.put_timeout_s``. Running out fails the producer (the trainer's ``get`` raises it).

    A batch admitted before :meth:`stop` but finished after it is discarded. An exception in the thread (the
    engine died, the iterator raised) is handed to the buffer: the trainer's next ``get`` raises
    :class:`RolloutProducerError` chained to it, naming the producer and the batch. When the thread ends (prompts
    exhausted, stopped) and no other producer of the buffer runs, a ``get`` the queue cannot fill raises
    :class:`RolloutBufferExhaustedError`. The groups it puts get the buffer's group ids (``prompt_index``), whatever
    ``generate`` numbered them.
    """

    def __init__(self, buffer: RolloutBuffer, generate: Callable[[list[list[int]], int], list[Rollout]] | Any,
                 prompts: Iterable[Sequence[Sequence[int]]], *, current_version: Callable[[], int],
                 sampling: Any = None, name: str = "rollout-producer",
                 admission_timeout_s: float | None = None) -> None:
        if not isinstance(buffer, RolloutBuffer):
            raise TypeError(f"buffer must be a RolloutBuffer, got {type(buffer).__name__}")
        if hasattr(generate, "generate"):
            if sampling is None:
                raise ValueError(f"generate is a {type(generate).__name__} (has .generate); pass sampling= (a "
                                 "SamplingConfig) for its generate(prompts, sampling)")
            engines = generate
            self._generate = lambda batch, version: engines.generate(batch, sampling)
        elif callable(generate):
            self._generate = generate
        else:
            raise TypeError(f"generate must be generate_fn(prompts, weight_version) or an object with .generate, got "
                            f"{type(generate).__name__}")
        if not callable(current_version):
            raise TypeError("current_version must be a callable returning an int, got "
                            f"{type(current_version).__name__}")
        self.buffer, self.name, self._current_version = buffer, str(name), current_version
        self._prompts = iter(prompts)
        self._timeout = _check_seconds("admission_timeout_s", buffer.config.put_timeout_s
                                       if admission_timeout_s is None else admission_timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rlhfkit-{self.name}", daemon=True)
        self._started = False
        self.num_batches = 0  # batches put into the buffer

    def start(self) -> RolloutProducer:
        if self._started:
            raise RuntimeError(f"producer {self.name!r} was already started; make a new RolloutProducer")
        self._started = True
        self.buffer._producer_started(self.name)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the thread to end and join it, at most ``timeout_s``; :class:`RolloutTimeoutError` names what it is
        still doing (a hung ``generate``: the daemon thread is left behind and cannot block interpreter exit)."""
        timeout = _check_seconds("timeout_s", timeout_s)
        self._stop.set()
        with self.buffer._cond:
            self.buffer._cond.notify_all()
        if not self._started:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self.buffer._cond:
                status = self.buffer._producers.get(self.name, "?")
            raise RolloutTimeoutError(f"producer {self.name!r} did not stop within {timeout_s:g} s; it is {status} "
                                      "(a generate call that does not return; the daemon thread is left behind)")

    def __enter__(self) -> RolloutProducer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        batch_index, prompts = -1, None
        try:
            while not self._stop.is_set():
                self.buffer._set_status(self.name, f"reading prompt batch {batch_index + 1}")
                prompts = next(self._prompts, None)
                if prompts is None:
                    self.buffer._set_status(self.name, "finished: its prompt iterator is exhausted")
                    return
                batch_index += 1
                prompts = [list(prompt) for prompt in prompts]
                version = self.buffer._reserve(len(prompts), self._current_version, self._timeout, self._stop,
                                               self.name)
                if version is None:
                    break
                try:
                    self.buffer._set_status(self.name, f"generating batch {batch_index} at weight_version={version}")
                    groups = self._split(self._generate(prompts, version), len(prompts), version)
                except BaseException:
                    self.buffer._release(len(prompts))
                    raise
                if self._stop.is_set():
                    self.buffer._release(len(prompts))
                    break
                self.buffer._put_reserved(groups, len(prompts))
                self.num_batches += 1
            self.buffer._set_status(self.name, "stopped")
        except (RolloutBufferClosedError, RolloutProducerError):
            self.buffer._set_status(self.name, "stopped: the buffer was closed")
        except BaseException as error:  # noqa: BLE001 - handed to the trainer through the buffer
            where = "before its first batch" if batch_index < 0 else f"on prompt batch {batch_index}"
            size = "" if prompts is None else f" ({len(prompts)} prompts)"
            self.buffer._set_status(self.name, f"failed {where}")
            failure = RolloutProducerError(f"rollout producer {self.name!r} failed {where}{size}: "
                                           f"{type(error).__name__}: {error}", producer=self.name,
                                           batch_index=batch_index)
            failure.__cause__ = error
            logger.debug("%s", failure)
            self.buffer._fail(failure)
        finally:
            self.buffer._producer_finished()

    def _split(self, rollouts: Any, num_prompts: int, version: int) -> list[_Group]:
        if not isinstance(rollouts, list) or not rollouts or len(rollouts) % num_prompts:
            got = len(rollouts) if isinstance(rollouts, list) else type(rollouts).__name__
            raise ValueError(f"generate returned {got} rollouts for {num_prompts} prompts; expected a list of "
                             "len(prompts) × n rollouts, prompt-major")
        n = len(rollouts) // num_prompts
        return [self.buffer._stamp(rollouts[i * n:(i + 1) * n], version) for i in range(num_prompts)]
