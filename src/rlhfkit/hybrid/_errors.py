"""The errors of the hybrid-engine blocks: each names the role, rank (or engine) and phase it happened in."""

from __future__ import annotations

__all__ = ["EnginesBusyError", "HybridCallError", "LossFunctionError", "RoleAsleepError", "sleep_hint"]


def sleep_hint(role: str) -> str:
    """How a hybrid script puts ``role`` to sleep: what its phase guards' conflict errors tell the user to call."""
    return "hybrid.engines.sleep()" if role == "rollout" else f"hybrid.trainers[{role!r}].sleep()"


class HybridCallError(RuntimeError):
    """A primitive was misused or failed on a role; ``role``, ``rank`` and ``phase`` say where."""

    def __init__(self, message: str, *, role: str, rank: int | None, phase: str | None) -> None:
        super().__init__(message)
        self.role, self.rank, self.phase = role, rank, phase

    def __reduce__(self):  # keep the keyword arguments across Ray's pickling
        return (_rebuild, (type(self), str(self), self.role, self.rank, self.phase))


def _rebuild(cls: type, message: str, role: str, rank: int | None, phase: str | None) -> HybridCallError:
    return cls(message, role=role, rank=rank, phase=phase)


class RoleAsleepError(HybridCallError):
    """A primitive was called on a role that is asleep and was not asked to wake."""


class LossFunctionError(HybridCallError, ValueError):
    """The loss function returned something that cannot be trained on (not a scalar, not finite, no gradient)."""


class EnginesBusyError(HybridCallError):
    """Weights were pushed to engines that are generating."""
