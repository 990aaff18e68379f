"""What :mod:`rlhfkit.multiturn` returns (private; re-exported there): :class:`Turn`, :class:`Trajectory`, their
conversion to :class:`~rlhfkit.types.Rollout` and summary statistics. Needs only torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from rlhfkit.types import Rollout

__all__ = ["END_REASONS", "StepTimeoutError", "Trajectory", "Turn", "trainable_rollouts", "trajectory_stats"]

Status = Literal["ok", "failed", "dropped"]
EndReason = Literal["done", "max_turns", "context_overflow", "malformed_call", "error", "timeout"]
END_REASONS = ("done", "max_turns", "context_overflow", "malformed_call", "error", "timeout")
_FINISH = {"done": "stop", "malformed_call": "stop", "max_turns": "length", "context_overflow": "length",
           "error": "abort", "timeout": "abort"}


class StepTimeoutError(TimeoutError):
    """An environment call did not return in time: ``reset`` or ``step`` within ``MultiTurnConfig.step_timeout_s``,
    ``make_environment()`` within ``MultiTurnConfig.make_environment_timeout_s``."""


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One model turn of a trajectory and the observation that followed it.

    Attributes:
        start: offset of the turn's first sampled token in ``Trajectory.response_token_ids``.
        num_sampled: tokens the engine sampled this turn (loss mask 1).
        num_observation: observation tokens appended after them (loss mask 0; 0 on the last turn).
        finish_reason: why the engine stopped the turn (``"stop"`` or ``"length"``).
        num_tool_calls, num_tool_errors, malformed: as the environment's :class:`StepResult` reported them.
        weight_version: the engine's weight version for this turn.
        engine_index: the engine of an ``EngineGroup`` that sampled it (None for a single engine).
    """

    start: int
    num_sampled: int
    num_observation: int = 0
    finish_reason: str = "stop"
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    malformed: str | None = None
    weight_version: int = 0
    engine_index: int | None = None


@dataclass(frozen=True, kw_only=True)
class Trajectory:
    """One conversation: the prompt, then every sampled turn and observation laid end to end, token for token.

    Attributes:
        prompt_token_ids: ``[P]`` int64, the prompt as sent to the engine.
        response_token_ids: ``[R]`` int64, turn 0's sampled tokens, its observation, turn 1's, ... exactly the ids
            the engine sampled and the observation ids that followed (nothing re-tokenised).
        response_logprobs: ``[R]`` float32, the engine's log-prob of each sampled token; 0 on observation tokens.
        loss_mask: ``[R]`` bool, True on sampled tokens, False on observation tokens.
        response_weight_versions: ``[R]`` int64 or None: the weight version that sampled each token (a turn
            continued after an in-flight weight update spans versions); an observation token has its turn's last
            version, so the versions never decrease. None: each turn's tokens are of its ``Turn.weight_version``.
        turns: per-turn boundaries and tool statistics.
        status: ``"ok"`` (trainable), ``"failed"`` (the environment raised or timed out on every attempt) or
            ``"dropped"`` (fine itself, but a member of its group failed: the group is left out as a whole).
        end_reason: ``"done"`` (the environment ended it), ``"max_turns"``, ``"context_overflow"`` (no room left
            for another turn or observation), ``"malformed_call"`` (with ``on_malformed="end"``), ``"error"`` or
            ``"timeout"`` (a failed attempt; see ``errors``).
        errors: the exception of every failed attempt, oldest first (timeouts as :class:`StepTimeoutError`); an
            ``"ok"`` trajectory may have some from attempts that were retried.
        prompt_index, sample_index: the trajectory's place in the request.
        num_attempts: attempts it took (1 when the first succeeded).
        final_text: the last turn's decoded text (the model's answer when ``end_reason == "done"``).
        prompt_text, label: as given to ``generate_trajectories``.
    """

    prompt_token_ids: torch.Tensor
    response_token_ids: torch.Tensor
    response_logprobs: torch.Tensor
    loss_mask: torch.Tensor
    response_weight_versions: torch.Tensor | None = None
    turns: tuple[Turn, ...]
    status: Status
    end_reason: EndReason
    errors: tuple[BaseException, ...] = ()
    prompt_index: int = 0
    sample_index: int = 0
    num_attempts: int = 1
    final_text: str = ""
    prompt_text: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        length = self.response_token_ids.shape
        if self.response_logprobs.shape != length or self.loss_mask.shape != length:
            raise ValueError(f"Trajectory(prompt_index={self.prompt_index}, sample_index={self.sample_index}): "
                             f"response_token_ids {tuple(length)}, response_logprobs "
                             f"{tuple(self.response_logprobs.shape)} and loss_mask {tuple(self.loss_mask.shape)} "
                             "must have one entry per response token")
        versions = self.response_weight_versions
        if versions is not None and versions.shape != length:
            raise ValueError(f"Trajectory(prompt_index={self.prompt_index}, sample_index={self.sample_index}): "
                             f"response_weight_versions {tuple(versions.shape)} must have one entry per response "
                             f"token ({tuple(length)})")
        if self.end_reason not in END_REASONS:
            raise ValueError(f"Trajectory.end_reason={self.end_reason!r}; expected one of {END_REASONS}")

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def error(self) -> BaseException | None:
        """The last attempt's exception when the trajectory failed, else None."""
        return self.errors[-1] if self.status == "failed" and self.errors else None

    def to_rollout(self) -> Rollout:
        """A :class:`~rlhfkit.types.Rollout` for :func:`rlhfkit.experience.make_experience`: the whole conversation
        as the response, ``response_loss_mask`` False on observation tokens (so they get no loss weight and no
        engine log-prob), ``response_text`` the final turn's text (what a reward function scores),
        ``finish_reason`` ``"stop"`` when the environment ended it, ``"length"`` at a turn or context limit;
        ``weight_version`` the oldest turn's, ``response_weight_versions`` each token's."""
        versions = [turn.weight_version for turn in self.turns]
        return Rollout(prompt_token_ids=self.prompt_token_ids, response_token_ids=self.response_token_ids,
                       response_logprobs=self.response_logprobs, response_loss_mask=self.loss_mask,
                       finish_reason=_FINISH[self.end_reason], prompt_index=self.prompt_index,  # type: ignore
                       sample_index=self.sample_index, weight_version=min(versions) if versions else 0,
                       response_weight_versions=self.response_weight_versions,
                       prompt_text=self.prompt_text, response_text=self.final_text, label=self.label)


def trainable_rollouts(trajectories: Sequence[Trajectory]) -> list[Rollout]:
    """The rollouts of the ``"ok"`` trajectories, in order. Failed and dropped ones are left out whole groups at a
    time (``generate_trajectories`` marks every member of a group with a failure), so GRPO groups stay complete."""
    return [t.to_rollout() for t in trajectories if t.status == "ok"]


def trajectory_stats(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Flat statistics for logging: status counts, end reasons (fractions), turns, tool calls and how many
    succeeded, malformed turns, sampled and observation tokens, retried attempts."""
    count = max(1, len(trajectories))
    turns = [turn for t in trajectories for turn in t.turns]
    calls = sum(turn.num_tool_calls for turn in turns)
    stats = {f"multiturn/{status}": float(sum(t.status == status for t in trajectories))
             for status in ("ok", "failed", "dropped")}
    stats |= {f"multiturn/end/{reason}": sum(t.end_reason == reason for t in trajectories) / count
              for reason in END_REASONS}
    stats |= {
        "multiturn/turns_mean": len(turns) / count,
        "multiturn/tool_calls_mean": calls / count,
        "multiturn/tool_call_success": (calls - sum(turn.num_tool_errors for turn in turns)) / max(1, calls),
        "multiturn/malformed_turn_rate": sum(turn.malformed is not None for turn in turns) / max(1, len(turns)),
        "multiturn/sampled_tokens_mean": sum(turn.num_sampled for turn in turns) / count,
        "multiturn/observation_tokens_mean": sum(turn.num_observation for turn in turns) / count,
        "multiturn/retried_attempts": float(sum(t.num_attempts - 1 for t in trajectories)),
    }
    return stats
