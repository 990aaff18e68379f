"""Typed results of the hybrid primitives, and the one hook that sees what each call cost.

A primitive returns what it computed: :class:`ForwardBackwardResult` (the loss and your loss function's stats),
:class:`OptimStepResult` (learning rate, gradient norm, step). What a call cost (the seconds and bytes of the sleeps
and wakes folded into it, torch's peak memory) is not in those results: each rank reports it in one
:class:`CallCost`, and the driver hands every call's costs to a :class:`CallObserver` (the run's
:class:`~rlhfkit.hybrid.PhaseTimer` is one), if there is one. Nothing here needs Ray, DeepSpeed or a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["CallCost", "CallObserver", "CallRecord", "ForwardBackwardResult", "OptimStepResult", "WorkerReply"]


@dataclass(frozen=True, kw_only=True)
class CallCost:
    """What one rank's (or one engine's) call spent on phase switches.

    Attributes:
        switch_s: seconds of sleeps and wakes on the call's path.
        background_s: seconds of sleeps that ran in the background, behind another role's work
            (``HybridConfig.overlap_switches``), finished since the rank's previous call.
        bytes_d2h: bytes its sleeps copied device -> host (a background sleep's, once it finished).
        bytes_h2d: bytes its wakes copied host -> device.
        bytes_kept: bytes its sleeps freed on the device without a copy (the host copy was still current).
        peak_gib: torch's peak allocated memory during the call (0 on CPU).
    """

    switch_s: float = 0.0
    background_s: float = 0.0
    bytes_d2h: float = 0.0
    bytes_h2d: float = 0.0
    bytes_kept: float = 0.0
    peak_gib: float = 0.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if not getattr(self, name) >= 0:
                raise ValueError(f"CallCost.{name}={getattr(self, name)!r}; give a count >= 0")

    def __add__(self, other: CallCost) -> CallCost:
        """Two costs of one rank: seconds and bytes add up, the peak is the larger."""
        return CallCost(**{name: (max if name == "peak_gib" else sum)((getattr(self, name), getattr(other, name)))
                           for name in self.__dataclass_fields__})


@dataclass(frozen=True, kw_only=True)
class WorkerReply:
    """A rank's answer to one call: ``value`` (what the primitive computed) and ``cost``."""

    value: Any = None
    cost: CallCost = field(default_factory=CallCost)


@dataclass(frozen=True, kw_only=True)
class CallRecord:
    """One call on a role as a :class:`CallObserver` sees it.

    Attributes:
        role: the role called (``"actor"``, ..., ``"rollout"`` for the engines).
        method: the primitive (``"forward"``, ``"sleep"``, ...).
        phase: the phase guard's name of the call.
        seconds: the call's wall time on the driver (round trips included).
        costs: each rank's (or engine's) :class:`CallCost`; ranks switch in parallel, each on its own GPU.
    """

    role: str
    method: str
    phase: str
    seconds: float
    costs: tuple[CallCost, ...]


class CallObserver(Protocol):
    """Called by :class:`~rlhfkit.hybrid.TrainerGroup` and :class:`~rlhfkit.hybrid.RolloutEngines` after each call
    that returned (``HybridConfig``'s run: its :class:`~rlhfkit.hybrid.PhaseTimer`)."""

    def observe_call(self, record: CallRecord) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ForwardBackwardResult:
    """What :meth:`~rlhfkit.hybrid.TrainerGroup.forward_backward` computed.

    Attributes:
        role: the trained role.
        loss: the minibatch's loss (the sum of every micro-batch's loss, each normalised by the whole minibatch's
            ``num_tokens`` / ``num_seqs``, over every rank).
        stats: your loss function's stats, each the mean over micro-batches and ranks.
        num_tokens: loss tokens of the minibatch (``loss_mask.sum()``).
        num_seqs: sequences of the minibatch.
    """

    role: str
    loss: float
    stats: dict[str, float]
    num_tokens: int
    num_seqs: int

    def metrics(self) -> dict[str, float]:
        """``{role}/loss`` and ``{role}/<stat>`` for each stat: a row for a metrics logger."""
        return {f"{self.role}/loss": self.loss} | {f"{self.role}/{key}": value for key, value in self.stats.items()}


@dataclass(frozen=True, kw_only=True)
class OptimStepResult:
    """What :meth:`~rlhfkit.hybrid.TrainerGroup.optim_step` did.

    Attributes:
        role: the trained role.
        lr: the learning rate the step used.
        grad_norm: the global gradient norm before clipping (NaN when DeepSpeed does not report it).
        global_step: optimizer steps taken so far (this one included).
    """

    role: str
    lr: float
    grad_norm: float
    global_step: int

    def metrics(self) -> dict[str, float]:
        """``{role}/lr``, ``{role}/grad_norm`` and ``{role}/global_step``: a row for a metrics logger."""
        return {f"{self.role}/lr": self.lr, f"{self.role}/grad_norm": self.grad_norm,
                f"{self.role}/global_step": float(self.global_step)}
