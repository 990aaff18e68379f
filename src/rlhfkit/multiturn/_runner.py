"""The turn loop of :mod:`rlhfkit.multiturn` (private): one attempt of a batch of trajectories, turn by turn.

Every turn: the contexts of the live trajectories go to the engine in one ``generate`` call per per-turn token cap
(pinned to their engine when the engine is an ``EngineGroup``), then every environment's ``step`` runs at once under
the step timeout, then observation ids are appended. Needs only torch (engines and tokenizers are passed in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhfkit._calls import CallOutcome, call_all
from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.multiturn._env import Action, Episode, StepResult
from rlhfkit.multiturn._trajectory import StepTimeoutError, Trajectory, Turn

__all__ = ["Job", "run_attempt"]


@dataclasses.dataclass(frozen=True)
class Job:
    """One trajectory to (re-)run: its place, its prompt, its attempt number and its engine (or None)."""

    prompt_index: int
    sample_index: int
    prompt: tuple[int, ...]
    attempt: int
    engine_index: int | None
    prompt_text: str | None
    label: str | None


class _State:
    def __init__(self, job: Job, environment: Any) -> None:
        self.job, self.environment = job, environment
        self.context = list(job.prompt)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[bool] = []
        self.versions: list[int] = []  # the weight version of each response token
        self.turns: list[Turn] = []
        self.end_reason: str | None = None
        self.error: BaseException | None = None
        self.final_text = ""

    def where(self) -> str:
        return (f"trajectory (prompt_index={self.job.prompt_index}, sample_index={self.job.sample_index}, "
                f"attempt {self.job.attempt})")

    def fail(self, outcome: CallOutcome, call: str, timeout_s: float) -> bool:
        if outcome.timed_out:
            self.error = StepTimeoutError(f"{call} of {self.where()} did not return within step_timeout_s="
                                          f"{timeout_s:g} s (a hanging tool or environment)")
            self.end_reason = "timeout"
        elif outcome.error is not None:
            self.error, self.end_reason = outcome.error, "error"
        else:
            return False
        return True

    def result(self) -> Trajectory:
        return Trajectory(
            prompt_token_ids=torch.tensor(self.job.prompt, dtype=torch.long),
            response_token_ids=torch.tensor(self.tokens, dtype=torch.long),
            response_logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            loss_mask=torch.tensor(self.mask, dtype=torch.bool),
            response_weight_versions=torch.tensor(self.versions, dtype=torch.int64), turns=tuple(self.turns),
            status="failed" if self.error is not None else "ok", end_reason=self.end_reason,  # type: ignore
            errors=() if self.error is None else (self.error,), prompt_index=self.job.prompt_index,
            sample_index=self.job.sample_index, num_attempts=1, final_text=self.final_text,
            prompt_text=self.job.prompt_text, label=self.job.label)


def _turn_seed(seed: int | None, attempt: int, turn: int, cap: int) -> int | None:
    if seed is None:
        return None
    return hash((seed, attempt, turn, cap)) & ((1 << 62) - 1)  # ints hash deterministically across processes


def _generate(engine: Any, states: list[_State], sampling: SamplingConfig, turn: int, max_total_tokens: int,
              pinned: bool, tokenizer: Any) -> None:
    by_cap: dict[int, list[_State]] = {}
    for state in states:
        by_cap.setdefault(min(sampling.max_new_tokens, max_total_tokens - len(state.context)), []).append(state)
    for cap, group in by_cap.items():
        attempt = max(state.job.attempt for state in group)
        turn_sampling = dataclasses.replace(sampling, n=1, max_new_tokens=cap, logprobs=True,
                                            seed=_turn_seed(sampling.seed, attempt, turn, cap))
        contexts = [list(state.context) for state in group]
        kwargs = {"engine_indices": [state.job.engine_index for state in group]} if pinned else {}
        rollouts = engine.generate(contexts, turn_sampling, **kwargs)
        if len(rollouts) != len(group):
            raise RuntimeError(f"the engine returned {len(rollouts)} rollouts for {len(group)} contexts (n=1)")
        for state, rollout in zip(group, rollouts):
            if rollout.response_logprobs is None:
                raise RuntimeError(f"the engine returned no log-probs for {state.where()} although logprobs=True")
            ids = rollout.response_token_ids.tolist()
            state.turns.append(Turn(start=len(state.tokens), num_sampled=len(ids), finish_reason=rollout.finish_reason,
                                    weight_version=rollout.weight_version, engine_index=state.job.engine_index))
            state.tokens += ids
            state.logprobs += rollout.response_logprobs.float().tolist()
            state.mask += [True] * len(ids)
            state.versions += rollout.token_weight_versions.tolist()  # several when an update came mid-turn
            state.context += ids
            state.final_text = tokenizer.decode(ids, skip_special_tokens=True)


def _observe(state: _State, result: StepResult, turn: int, max_turns: int, max_total_tokens: int,
             tokenizer: Any) -> None:
    state.turns[-1] = dataclasses.replace(state.turns[-1], num_tool_calls=result.num_tool_calls,
                                          num_tool_errors=result.num_tool_errors, malformed=result.malformed)
    if result.done:
        state.end_reason = "malformed_call" if result.malformed is not None else "done"
        return
    if turn + 1 >= max_turns:
        state.end_reason = "max_turns"
        return
    observation = result.observation
    ids = (tokenizer.encode(observation, add_special_tokens=False) if isinstance(observation, str)
           else [int(token) for token in observation])
    if len(state.context) + len(ids) >= max_total_tokens:  # no room for the observation and one more token
        state.end_reason = "context_overflow"
        return
    state.turns[-1] = dataclasses.replace(state.turns[-1], num_observation=len(ids))
    state.tokens += ids
    state.logprobs += [0.0] * len(ids)
    state.mask += [False] * len(ids)
    # an observation has no version of its own: it takes its turn's last one, so versions stay non-decreasing
    state.versions += [state.versions[-1] if state.versions else state.turns[-1].weight_version] * len(ids)
    state.context += ids


def run_attempt(jobs: Sequence[Job], *, engine: Any, sampling: SamplingConfig, make_environment: Callable[[], Any],
                tokenizer: Any, max_turns: int, max_total_tokens: int, step_timeout_s: float,
                pinned: bool) -> list[Trajectory]:
    """One attempt of every job, turn by turn; returns one trajectory per job, in order (``num_attempts == 1``)."""
    states = [_State(job, make_environment()) for job in jobs]
    episodes = [Episode(prompt_index=s.job.prompt_index, sample_index=s.job.sample_index, attempt=s.job.attempt,
                        prompt_text=s.job.prompt_text, label=s.job.label) for s in states]
    outcomes = call_all([lambda s=s, e=e: s.environment.reset(e) for s, e in zip(states, episodes)],
                        timeout_s=step_timeout_s, name="reset")
    for state, outcome in zip(states, outcomes):
        state.fail(outcome, "reset", step_timeout_s)
    for turn in range(max_turns):
        live = [s for s in states if s.end_reason is None]
        for state in live:
            if len(state.context) >= max_total_tokens:
                state.end_reason = "context_overflow"
        live = [s for s in live if s.end_reason is None]
        if not live:
            break
        _generate(engine, live, sampling, turn, max_total_tokens, pinned, tokenizer)
        actions = [Action(text=s.final_text, token_ids=tuple(s.tokens[s.turns[-1].start:]), turn=turn,
                          finish_reason=s.turns[-1].finish_reason) for s in live]  # type: ignore[arg-type]
        outcomes = call_all([lambda s=s, a=a: s.environment.step(a) for s, a in zip(live, actions)],
                            timeout_s=step_timeout_s, name="step")
        for state, outcome in zip(live, outcomes):
            if state.fail(outcome, f"step of turn {turn}", step_timeout_s):
                continue
            if not isinstance(outcome.value, StepResult):
                state.error = TypeError(f"step() of {state.where()} returned {type(outcome.value).__name__}; it "
                                        "must return a rlhfkit.multiturn.StepResult")
                state.end_reason = "error"
                continue
            _observe(state, outcome.value, turn, max_turns, max_total_tokens, tokenizer)
    return [state.result() for state in states]
