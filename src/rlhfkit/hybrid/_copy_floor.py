"""The pinned-copy floor of a phase switch: how fast this GPU copies between pinned host memory and itself.

:func:`measure_copy_rates` times pinned host->device, device->host and device->device copies of one buffer with CUDA
events; :meth:`CopyRates.floor_seconds` turns the bytes a step's sleeps, wakes and weight sync moved into the time
those copies alone would take. A hybrid run measures the rates once in its actor's process after loading
(:class:`rlhfkit.hybrid.PhaseTimer` then reports ``switch/floor_s`` and ``switch/over_floor``). It does not model
allocation, pinning or synchronisation costs: those are what ``over_floor`` shows. Needs only torch; on a machine
without CUDA there is no floor (``None``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CopyRates", "measure_copy_rates"]

_MIB = 1024**2


@dataclass(frozen=True, kw_only=True)
class CopyRates:
    """Measured copy rates of one device, bytes per second (best of the repeats).

    Attributes:
        h2d_bytes_per_s: pinned host -> device.
        d2h_bytes_per_s: device -> pinned host.
        d2d_bytes_per_s: device -> device (bytes copied, not read + written).
        num_bytes: size of the buffer each copy moved.
        device: the device measured (``"cuda:0"``).
    """

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    d2d_bytes_per_s: float
    num_bytes: int
    device: str

    def __post_init__(self) -> None:
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s", "d2d_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CopyRates.{name}={getattr(self, name)!r}; a copy rate must be > 0 bytes/s")

    def floor_seconds(self, *, bytes_d2h: float, bytes_h2d: float, bytes_d2d: float = 0.0) -> float:
        """The time the copies alone take: ``bytes_d2h / d2h + bytes_h2d / h2d + bytes_d2d / d2d``."""
        for name, value in (("bytes_d2h", bytes_d2h), ("bytes_h2d", bytes_h2d), ("bytes_d2d", bytes_d2d)):
            if not value >= 0:
                raise ValueError(f"{name}={value!r}; give a byte count >= 0")
        return (bytes_d2h / self.d2h_bytes_per_s + bytes_h2d / self.h2d_bytes_per_s
                + bytes_d2d / self.d2d_bytes_per_s)


def measure_copy_rates(device: torch.device | str | int | None = None, *, num_bytes: int = 256 * _MIB,
                       repeats: int = 3) -> CopyRates | None:
    """Time ``repeats`` copies of ``num_bytes`` each way between pinned host memory and ``device`` (default: the
    current CUDA device) with CUDA events, after one warm-up copy; returns the best rate of each direction, or
    ``None`` when ``device`` is not a CUDA device or CUDA is unavailable (a CPU run has no device copies to bound).

    Allocates ``num_bytes`` pinned host memory and ``2 * num_bytes`` on the device for the duration of the call.
    """
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 1:
        raise ValueError(f"num_bytes={num_bytes!r}; give an int >= 1 (a few hundred MB measure the bandwidth)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}; give an int >= 1")
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    with torch.cuda.device(device):
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        source, target = (torch.empty(num_bytes, dtype=torch.uint8, device=device) for _ in range(2))
        pairs = {"h2d": (target, host), "d2h": (host, source), "d2d": (target, source)}
        rates = {name: num_bytes / _best_seconds(dst, src, repeats) for name, (dst, src) in pairs.items()}
        del host, source, target
        torch.cuda.empty_cache()
    return CopyRates(h2d_bytes_per_s=rates["h2d"], d2h_bytes_per_s=rates["d2h"], d2d_bytes_per_s=rates["d2d"],
                     num_bytes=num_bytes, device=str(device))


def _best_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up: first-touch and driver paths
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000.0)
    return max(best, 1e-9)
