"""Multi-turn, tool-using rollouts over any rollout engine, token in and token out.

What it does: :func:`generate_trajectories` runs conversations: the engine samples a turn, a plain-Python
:class:`Environment` (sync or ``async``; :class:`ToolEnvironment` runs tool calls) answers with an observation, and the
next turn's prompt is the previous prompt ids + the sampled ids + the observation ids — never re-tokenised text, so
the trainer sees exactly what the engine sampled. Each :class:`Trajectory` keeps per-turn boundaries, the engine's
log-prob of every sampled token, a loss mask that is False on observation tokens, and its status; ``to_rollout()``
gives a :class:`~rlhfkit.types.Rollout` (with ``response_loss_mask``) for :func:`rlhfkit.experience.make_experience`.
Limits: turns per conversation and total tokens (a context overflow ends the trajectory and is recorded). Every
environment call (``make_environment()``, ``reset``, ``step``) has a timeout; an exception, a timeout or an invalid
observation (not text or in-vocabulary token ids) fails that trajectory's attempt alone (recorded with its type, the
environment and the trajectory named), the trajectory is retried from scratch up to ``max_attempts`` times, and a
GRPO group with a member that still failed is retried or dropped as a whole (``group_policy``), never mixed. Every
trajectory comes back, with its status. With an :class:`~rlhfkit.engines.router.EngineGroup`, each group is pinned
to one engine for all its turns (``assign_sessions`` + ``generate(engine_indices=...)``) so that engine's prefix
cache serves the conversation.

What it does not do: advance conversations independently of each other (a turn waits for the slowest live
environment, at most ``step_timeout_s``), render chat templates (observations are text or ids you format), or
score trajectories (rewards come from :mod:`rlhfkit.rewards` or your code). The built-in task is arithmetic with a
:func:`calculator` tool. Needs only torch; the engine and tokenizer you pass bring their own extras.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.multiturn._env import Action, Environment, Episode, StepResult
from rlhfkit.multiturn._runner import Job, run_attempt
from rlhfkit.multiturn._tools import (
    MalformedToolCallError,
    ToolArgumentError,
    ToolCall,
    ToolEnvironment,
    ToolEnvironmentConfig,
    calculator,
    parse_tool_calls,
)
from rlhfkit.multiturn._trajectory import StepTimeoutError, Trajectory, Turn, trainable_rollouts, trajectory_stats

__all__ = [
    "Action",
    "Environment",
    "Episode",
    "MalformedToolCallError",
    "MultiTurnConfig",
    "StepResult",
    "StepTimeoutError",
    "ToolArgumentError",
    "ToolCall",
    "ToolEnvironment",
    "ToolEnvironmentConfig",
    "Trajectory",
    "Turn",
    "calculator",
    "generate_trajectories",
    "parse_tool_calls",
    "trainable_rollouts",
    "trajectory_stats",
]


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig:
    """Limits and failure handling of :func:`generate_trajectories`.

    Attributes:
        max_turns: model turns per conversation; a conversation still going after them ends with ``"max_turns"``.
        max_total_tokens: prompt + sampled + observation tokens of one conversation (the context the engine must
            hold); a turn is capped to the room left and an observation that does not fit ends the trajectory with
            ``"context_overflow"``. ``SamplingConfig.max_new_tokens`` is the per-turn limit.
        step_timeout_s: bound of every ``reset``/``step`` call; past it the attempt fails with
            :class:`StepTimeoutError` (the hung call is abandoned in its daemon thread).
        make_environment_timeout_s: bound of the ``make_environment()`` calls of an attempt (made at once, one per
            trajectory, e.g. starting a sandbox); a factory past it, or one that raises, fails only its trajectory's
            attempt (a :class:`StepTimeoutError`, or the factory's exception).
        max_attempts: attempts of one trajectory (each from scratch, with a fresh environment and new sampling
            seeds) before it counts as failed.
        group_policy: what happens to a group (the ``n`` samples of one prompt) with a failed member: ``"drop"``
            marks its other members ``"dropped"``; ``"retry"`` re-runs the whole group (every member from scratch) up
            to ``max_group_attempts`` times, then drops it.
        max_group_attempts: attempts of a whole group under ``"retry"``.
    """

    max_turns: int = 4
    max_total_tokens: int = 2048
    step_timeout_s: float = 30.0
    make_environment_timeout_s: float = 60.0
    max_attempts: int = 2
    group_policy: Literal["drop", "retry"] = "drop"
    max_group_attempts: int = 2

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_attempts", "max_group_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MultiTurnConfig.{name}={value!r}; must be an int >= 1")
        for name in ("step_timeout_s", "make_environment_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"MultiTurnConfig.{name}={value!r}; must be a finite number of seconds > 0 (a "
                                 "hanging tool or environment must not hang the run)")
        if self.group_policy not in ("drop", "retry"):
            raise ValueError(f"MultiTurnConfig.group_policy={self.group_policy!r}; choose 'drop' or 'retry'")


def _vocab_size(tokenizer: Any) -> int:
    """Token ids an observation may hold: ``len(tokenizer)`` (an HF tokenizer's vocabulary with its added tokens),
    else its ``vocab_size``."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TypeError(f"tokenizer={tokenizer!r:.80} has neither len() nor an int vocab_size; pass the model's (HF) "
                        "tokenizer (its vocabulary bounds the token ids of observations)")
    return size


def _check_inputs(prompts: Sequence[Sequence[int]], sampling: Any, config: Any, tokenizer: Any,
                  make_environment: Any, per_prompt: dict[str, Sequence[str | None] | None]) -> list[tuple[int, ...]]:
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if not isinstance(config, MultiTurnConfig):
        raise TypeError(f"config must be a MultiTurnConfig, got {type(config).__name__}")
    if not callable(make_environment):
        raise TypeError(f"make_environment={make_environment!r}; pass a callable returning a fresh Environment")
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise TypeError(f"tokenizer={tokenizer!r} has no encode/decode; pass the model's (HF) tokenizer")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompt_token_ids must be a non-empty list of token-id lists")
    out = []
    for index, prompt in enumerate(prompts):
        ids = tuple(int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt))
        if not ids or len(ids) >= config.max_total_tokens:
            raise ValueError(f"prompt_token_ids[{index}] has {len(ids)} tokens; it needs 1 to "
                             f"max_total_tokens - 1 = {config.max_total_tokens - 1} (raise "
                             "MultiTurnConfig.max_total_tokens or shorten the prompt)")
        out.append(ids)
    for name, values in per_prompt.items():
        if values is not None and len(values) != len(out):
            raise ValueError(f"{name} has {len(values)} entries for {len(out)} prompts; give one per prompt")
    return out


def generate_trajectories(engine: Any, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                          make_environment: Callable[[], Environment], tokenizer: Any, config: MultiTurnConfig,
                          prompt_texts: Sequence[str] | None = None,
                          labels: Sequence[str | None] | None = None) -> list[Trajectory]:
    """Run ``sampling.n`` conversations per prompt; returns ``len(prompts) * n`` trajectories, prompt-major, every
    one with its status (``"ok"``, ``"failed"``, ``"dropped"``).

    Args:
        engine: any :class:`~rlhfkit.engines.protocol.RolloutEngine` (HF, vLLM) or an
            :class:`~rlhfkit.engines.router.EngineGroup` (each group then stays on one engine).
        prompt_token_ids: the first prompts, e.g. chat-templated with the generation prompt open.
        sampling: ``n`` is the group size, ``max_new_tokens`` the per-turn limit; log-probs are always requested.
        make_environment: returns a fresh environment; called once per attempt of every trajectory, bounded by
            ``config.make_environment_timeout_s``.
        tokenizer: decodes turns for the environment and encodes text observations (each on its own).
        config: limits, timeouts, retries and the group rule.
        prompt_texts, labels: one per prompt, handed to ``Environment.reset`` and kept on the trajectories.

    A trajectory whose environment fails (``make_environment()``, ``reset`` or ``step`` raises or times out, or
    ``step`` answers an observation that is neither text nor token ids within the tokenizer's vocabulary; bytes are
    refused) ends with ``status="failed"`` after its attempts, the exceptions in ``Trajectory.errors``, each naming
    the environment and the trajectory's index; the other trajectories complete. Engine errors
    (:class:`~rlhfkit.engines.router.EngineError`) are not a trajectory's failure: they propagate.
    """
    prompts = _check_inputs(prompt_token_ids, sampling, config, tokenizer, make_environment,
                            {"prompt_texts": prompt_texts, "labels": labels})
    vocab_size = _vocab_size(tokenizer)
    pinned = callable(getattr(engine, "assign_sessions", None))  # an EngineGroup: keep each group on one engine
    engines: list[int | None] = [None] * len(prompts)
    if pinned:
        work = [float(sampling.n * config.max_total_tokens)] * len(prompts)
        engines = list(engine.assign_sessions(work))

    def job(prompt_index: int, sample_index: int, attempt: int) -> Job:
        return Job(prompt_index * sampling.n + sample_index, prompt_index, sample_index, prompts[prompt_index], attempt,
                   engines[prompt_index],
                   None if prompt_texts is None else prompt_texts[prompt_index],
                   None if labels is None else labels[prompt_index])

    def run(keys: list[tuple[int, int]], first_attempt: int) -> dict[tuple[int, int], Trajectory]:
        """Each key's trajectory after up to max_attempts attempts, earlier failures kept in ``errors``."""
        results: dict[tuple[int, int], Trajectory] = {}
        errors: dict[tuple[int, int], tuple[BaseException, ...]] = {key: () for key in keys}
        pending = keys
        for attempt in range(config.max_attempts):
            done = run_attempt([job(p, s, first_attempt + attempt) for p, s in pending], engine=engine,
                               sampling=sampling, make_environment=make_environment, tokenizer=tokenizer,
                               vocab_size=vocab_size, max_turns=config.max_turns,
                               max_total_tokens=config.max_total_tokens, step_timeout_s=config.step_timeout_s,
                               make_environment_timeout_s=config.make_environment_timeout_s, pinned=pinned)
            for key, trajectory in zip(pending, done):
                errors[key] += trajectory.errors
                results[key] = replace(trajectory, errors=errors[key], num_attempts=attempt + 1)
            pending = [key for key in pending if results[key].status == "failed"]
            if not pending:
                break
        return results

    keys = [(p, s) for p in range(len(prompts)) for s in range(sampling.n)]
    results = run(keys, 0)
    rounds = config.max_group_attempts if config.group_policy == "retry" else 1
    for group_round in range(1, rounds):
        failed = sorted({p for (p, _), t in results.items() if t.status == "failed"})
        if not failed:
            break
        rerun = run([(p, s) for p in failed for s in range(sampling.n)], group_round * config.max_attempts)
        for key, trajectory in rerun.items():  # earlier failures of the member stay on record
            results[key] = replace(trajectory, errors=results[key].errors + trajectory.errors,
                                   num_attempts=results[key].num_attempts + trajectory.num_attempts)
    failed_groups = {p for (p, _), t in results.items() if t.status == "failed"}
    return [replace(results[key], status="dropped") if key[0] in failed_groups and results[key].status == "ok"
            else results[key] for key in keys]
