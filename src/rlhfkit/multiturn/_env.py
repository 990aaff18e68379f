"""The environment interface of :mod:`rlhfkit.multiturn` (private; re-exported there): what an environment is told
(:class:`Episode`, :class:`Action`) and what it answers (:class:`StepResult`). Needs only torch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

__all__ = ["Action", "Environment", "Episode", "StepResult"]


@dataclass(frozen=True, kw_only=True)
class Episode:
    """What :meth:`Environment.reset` is told about the conversation it starts.

    Attributes:
        prompt_index, sample_index: the trajectory's place in the request (a GRPO group shares ``prompt_index``).
        attempt: 0 for the first try of this trajectory, 1, 2, ... for retries after a failure.
        prompt_text, label: the strings given to :func:`~rlhfkit.multiturn.generate_trajectories` (or None).
    """

    prompt_index: int
    sample_index: int
    attempt: int = 0
    prompt_text: str | None = None
    label: str | None = None


@dataclass(frozen=True, kw_only=True)
class Action:
    """One turn the model sampled, as :meth:`Environment.step` receives it.

    Attributes:
        text: the turn's tokens decoded (special tokens skipped).
        token_ids: the sampled token ids of the turn, exactly as the engine returned them.
        turn: 0 for the first turn.
        finish_reason: ``"stop"`` (a stop/EOS token ended the turn) or ``"length"`` (the per-turn token limit, or the
            room left in the context, cut it).
    """

    text: str
    token_ids: tuple[int, ...]
    turn: int
    finish_reason: Literal["stop", "length", "abort"]


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """The environment's answer to one turn.

    Attributes:
        observation: what the model reads next: text (tokenised on its own with the tokenizer given to
            ``generate_trajectories``, never together with the context) or token ids (a list of ints or a 1-D integer
            tensor, each in ``[0, len(tokenizer))``, used as they are; ``bytes`` are refused, never read as ids).
            Its tokens are appended to the context with loss mask 0. Ignored when ``done``. ``generate_trajectories``
            checks it: anything else fails the trajectory, naming the environment and the trajectory.
        done: the conversation is over (the model gave its final answer, or the environment ended it).
        num_tool_calls: well-formed tool calls this turn made (for statistics).
        num_tool_errors: of those, calls whose arguments the tool refused (:class:`ToolArgumentError`).
        malformed: the error message when the turn's tool call could not be parsed, else None.
    """

    observation: str | Sequence[int] | torch.Tensor = ""
    done: bool = False
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    malformed: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.observation, (str, Sequence, torch.Tensor)):
            raise TypeError(f"StepResult.observation={self.observation!r:.80}; pass text or token ids (a list or a "
                            "1-D integer tensor)")
        if not isinstance(self.done, bool):
            raise TypeError(f"StepResult.done={self.done!r}; must be a bool")
        for name in ("num_tool_calls", "num_tool_errors"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StepResult.{name}={value!r}; must be an int >= 0")


@runtime_checkable
class Environment(Protocol):
    """One conversation's environment, written in plain Python. ``reset`` and ``step`` may be ``def`` or
    ``async def``; each call is bounded by ``MultiTurnConfig.step_timeout_s``. A fresh object serves every attempt of
    every trajectory (``make_environment()`` is called once per attempt, bounded by
    ``MultiTurnConfig.make_environment_timeout_s``), so it may keep per-conversation state.

    An exception raised by ``make_environment()``, ``reset`` or ``step`` fails the trajectory (recorded with its
    type, then retried); a problem that is the model's doing (a malformed call, bad tool arguments) should instead
    come back as an observation or a ``StepResult(done=True, malformed=...)``.
    """

    def reset(self, episode: Episode) -> None | Awaitable[None]:
        ...

    def step(self, action: Action) -> StepResult | Awaitable[StepResult]:
        ...
