"""Per-phase wall time and peak GPU memory of a training step, and where the numbers go (JSONL, W&B, TensorBoard).

:class:`PhaseTimer` is usable from any script: ``with timer.phase("generate"): ...``. Phase names are yours; a phase
may repeat in a step (times add up). Time that a phase spent putting models to sleep or waking them (measured inside
the workers, reported to :meth:`PhaseTimer.observe_call`) is moved to the ``sleep_wake`` phase, so a step's
breakdown shows the price of time-sharing the GPU; the bytes those sleeps, wakes and weight syncs copied are counted
too, and with the device's measured copy rates (:attr:`PhaseTimer.copy_rates`, :func:`rlhfkit.hybrid.
measure_copy_rates`) the step reports how far its switches are from the pinned-copy floor. Peak memory is
device-wide (NVML: every process, vLLM's pool included), sampled by a thread every few milliseconds; without NVML or a GPU it is simply absent. Nothing here needs Ray or DeepSpeed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from rlhfkit.hybrid._results import CallCost, CallRecord

__all__ = ["GpuMemorySampler", "PhaseTimer"]

_GIB = 1024**3
SWITCH_PHASES = ("sleep_wake", "weight_sync")


def _load_nvml() -> Any:
    for name in ("pynvml", "vllm.third_party.pynvml"):
        with contextlib.suppress(ImportError):
            return __import__(name, fromlist=["nvmlInit"])
    return None


def _visible_handles(nvml: Any) -> list[Any]:
    """NVML handles of the GPUs in ``CUDA_VISIBLE_DEVICES`` (indices or UUID prefixes), else all of them."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    visible = [part.strip() for part in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()]
    if not visible:
        return handles
    uuids = []
    for handle in handles:
        uuid = nvml.nvmlDeviceGetUUID(handle)
        uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
    chosen = []
    for item in visible:
        if item.isdigit() and int(item) < len(handles):
            chosen.append(handles[int(item)])
        else:
            chosen += [h for h, u in zip(handles, uuids, strict=True) if u.startswith(item) or item.startswith(u)]
    return chosen


def visible_gpu_memory_used_gib() -> list[float] | None:
    """GiB in use on each GPU in ``CUDA_VISIBLE_DEVICES`` right now, device-wide (NVML: every process's allocations
    and CUDA contexts); None without NVML or a GPU."""
    nvml = _load_nvml()
    if nvml is None:
        return None
    try:
        nvml.nvmlInit()
        handles = _visible_handles(nvml)
        return [nvml.nvmlDeviceGetMemoryInfo(handle).used / _GIB for handle in handles] or None
    except Exception:  # noqa: BLE001 — NVML's own error types; no driver means no reading
        return None


class GpuMemorySampler:
    """Device-wide used memory of the visible GPUs, polled by a daemon thread; the peak per named phase.

    ``enabled=False``, no NVML (``pip install nvidia-ml-py``; vLLM ships a copy) or no GPU: reports nothing.
    """

    def __init__(self, *, interval_s: float = 0.005, enabled: bool = True) -> None:
        if not interval_s > 0:
            raise ValueError(f"GpuMemorySampler interval_s={interval_s}; must be > 0")
        self._nvml, self._handles = (_load_nvml() if enabled else None), []
        if self._nvml is not None:
            try:
                self._nvml.nvmlInit()
                self._handles = _visible_handles(self._nvml)
            except Exception:  # noqa: BLE001 — NVML's own error types; no driver means no samples
                self._handles = []
        self._phase: str | None = None
        self._peaks: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self._handles:
            threading.Thread(target=self._loop, args=(interval_s,), daemon=True, name="gpu-memory").start()

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    def _sample(self) -> None:  # with the lock held
        if self._phase is None or not self._handles:
            return
        used = [self._nvml.nvmlDeviceGetMemoryInfo(handle).used for handle in self._handles]
        peak = self._peaks.setdefault(self._phase, used)
        self._peaks[self._phase] = [max(a, b) for a, b in zip(peak, used, strict=True)]

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                self._sample()

    def set_phase(self, name: str | None) -> None:
        with self._lock:
            self._sample()
            self._phase = name
            self._sample()

    def take(self) -> dict[str, list[int]]:
        """The peaks (bytes per GPU) of each phase since the last call."""
        with self._lock:
            peaks, self._peaks = self._peaks, {}
        return peaks

    def close(self) -> None:
        self._stop.set()


class PhaseTimer:
    """Wall time per phase of a step and the peak device memory in each; the run's :class:`~rlhfkit.hybrid.
    CallObserver`.

    Call :meth:`start_step`, time phases with :meth:`phase`, then :meth:`end_step` returns the step's row:
    ``time/<phase>_s``, ``time/step_s``, ``time/phase_switch_s`` (``sleep_wake`` + ``weight_sync``),
    ``time/phase_switch_fraction`` and ``mem/<phase>_peak_gib`` (device-wide, GiB; per GPU too with several).

    Each call on a trainer role or the engines reaches :meth:`observe_call`: the seconds its ranks spent on sleeps and
    wakes move from the phase running then to ``sleep_wake`` (the slowest rank's: ranks switch in parallel); sleeps
    that ran in the background, behind another role's work, are ``time/overlapped_sleep_s``, outside the switch time;
    torch's peak allocated memory in the calls of a phase (the busiest rank's, on a GPU) is
    ``mem/<phase>_allocated_peak_gib``.

    Bytes moved (the calls' largest rank's, and :meth:`count_sync_bytes`): ``switch/bytes_d2h`` (device -> host,
    sleeps), ``switch/bytes_h2d`` (host -> device, wakes) and ``switch/bytes_sync`` (the weight sync); and
    ``switch/bytes_kept``, what sleeps freed on the device without a copy (weights that do not train, whose pinned
    host copy was still current), when there was any. With
    ``copy_rates`` set (:class:`~rlhfkit.hybrid.CopyRates`, measured on the device): ``switch/floor_s`` =
    ``bytes_d2h / d2h rate + bytes_h2d / h2d rate + bytes_sync / d2d rate`` (the copies alone),
    ``switch/over_floor`` = ``time/phase_switch_s / switch/floor_s`` and the rates (``switch/{h2d,d2h,d2d}_gb_per_s``).
    """

    def __init__(self, sampler: GpuMemorySampler | None = None, *, copy_rates: Any = None) -> None:
        self.sampler = sampler
        self.copy_rates = copy_rates  # a CopyRates (or None: no floor reported)
        self._current: str | None = None
        self._started: float | None = None
        self._clear()

    def _clear(self) -> None:
        self.times: dict[str, float] = defaultdict(float)
        self._moved: dict[str, float] = defaultdict(float)  # switch seconds inside each phase
        self._bytes: dict[str, float] = defaultdict(float)
        self._peaks: dict[str, float] = defaultdict(float)  # torch's peak allocated GiB per phase
        self._background_s = 0.0

    def start_step(self) -> None:
        self._clear()
        self._started = time.perf_counter()
        if self.sampler is not None:
            self.sampler.take()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name {name!r}; give a non-empty string")
        if self._current is not None:
            raise RuntimeError(f"phase '{name}' started inside phase '{self._current}'; phases do not nest")
        if self.sampler is not None:
            self.sampler.set_phase(name)
        self._current, start = name, time.perf_counter()
        try:
            yield
        finally:
            self.times[name] += time.perf_counter() - start
            self._current = None
            if self.sampler is not None:
                self.sampler.set_phase(None)

    def observe_call(self, record: CallRecord) -> None:
        """Count one call's switch seconds (in the phase running now; outside any phase straight to ``sleep_wake``),
        bytes, background sleeps and torch peaks."""
        costs = record.costs or (CallCost(),)
        for name in ("bytes_d2h", "bytes_h2d", "bytes_kept"):
            self._bytes[name] += max(getattr(cost, name) for cost in costs)
        self._background_s += max(cost.background_s for cost in costs)
        seconds = max(cost.switch_s for cost in costs)
        if self._current is not None:
            self._peaks[self._current] = max([self._peaks[self._current]] + [cost.peak_gib for cost in costs])
        if not seconds > 0:
            return
        if self._current is None:
            self.times["sleep_wake"] += seconds
        elif self._current not in SWITCH_PHASES:
            self._moved[self._current] += seconds

    def count_sync_bytes(self, num_bytes: float) -> None:
        """Count ``num_bytes`` a weight sync moved into the engines in this step."""
        if not num_bytes >= 0:
            raise ValueError(f"count_sync_bytes({num_bytes!r}); give a byte count >= 0")
        self._bytes["bytes_sync"] += num_bytes

    def _switch_bytes(self, switch_s: float) -> dict[str, float]:
        moved = {name: self._bytes.get(name, 0.0) for name in ("bytes_d2h", "bytes_h2d", "bytes_sync")}
        row = {f"switch/{name}": value for name, value in moved.items()}
        if self._bytes.get("bytes_kept"):
            row["switch/bytes_kept"] = self._bytes["bytes_kept"]
        rates = self.copy_rates
        if rates is None:
            return row
        floor = rates.floor_seconds(bytes_d2h=moved["bytes_d2h"], bytes_h2d=moved["bytes_h2d"],
                                    bytes_d2d=moved["bytes_sync"])
        row |= {"switch/floor_s": floor, "switch/h2d_gb_per_s": rates.h2d_bytes_per_s / 1e9,
                "switch/d2h_gb_per_s": rates.d2h_bytes_per_s / 1e9, "switch/d2d_gb_per_s": rates.d2d_bytes_per_s / 1e9}
        if floor > 0:
            row["switch/over_floor"] = switch_s / floor
        return row

    def end_step(self) -> dict[str, float]:
        if self._started is None:
            raise RuntimeError("end_step() called before start_step()")
        step = time.perf_counter() - self._started
        for source, seconds in self._moved.items():
            seconds = min(seconds, self.times[source])
            self.times[source] -= seconds
            self.times["sleep_wake"] += seconds
        self._moved.clear()
        row = {f"time/{name}_s": seconds for name, seconds in self.times.items()} | {"time/step_s": step}
        if self._background_s:
            row["time/overlapped_sleep_s"] = self._background_s
        row |= {f"mem/{name}_allocated_peak_gib": peak for name, peak in self._peaks.items() if peak}
        switch = sum(self.times.get(name, 0.0) for name in SWITCH_PHASES)
        row |= {"time/phase_switch_s": switch, "time/phase_switch_fraction": switch / step if step > 0 else 0.0}
        row |= self._switch_bytes(switch)
        if self.sampler is not None:
            for name, per_gpu in self.sampler.take().items():
                row[f"mem/{name}_peak_gib"] = max(per_gpu) / _GIB
                if len(per_gpu) > 1:
                    row |= {f"mem/gpu{i}/{name}_peak_gib": used / _GIB for i, used in enumerate(per_gpu)}
        self._started = None
        return row


def process_age_s() -> float:
    """Seconds since this process started (psutil, which Ray installs); 0.0 when it cannot be read."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - a missing or failing psutil only loses this number
        return 0.0


class StartupClock:
    """Laps of an actor's start: ``process_s`` (the process's age when the clock started), then each :meth:`lap`."""

    def __init__(self) -> None:
        self.parts = {"process_s": process_age_s()}
        self._mark = time.perf_counter()

    def lap(self, name: str) -> dict[str, float]:
        now = time.perf_counter()
        self.parts[name], self._mark = now - self._mark, now
        return self.parts
