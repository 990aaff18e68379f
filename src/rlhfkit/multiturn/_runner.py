"""The turn loop of :mod:`rlhfkit.multiturn` (private): one attempt of a batch of trajectories, turn by turn.

An attempt first makes every trajectory's environment (``make_environment()``, all at once under
``make_environment_timeout_s``) and resets it. Every turn: the contexts of the live trajectories go to the engine in
one ``generate`` call per per-turn token cap (pinned to their engine when the engine is an ``EngineGroup``), then
every environment's ``step`` runs at once under the step timeout, then observation ids are checked and appended. A
factory, ``reset`` or ``step`` that raises or times out, and an observation that is not text or in-vocabulary token
ids, fail that one trajectory (recorded on it); the others go on. Needs only torch (engines and tokenizers are passed
in).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlhfkit._calls import CallOutcome, call_all
from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.multiturn._env import Action, Environment, Episode, StepResult
from rlhfkit.multiturn._trajectory import StepTimeoutError, Trajectory, Turn

__all__ = ["Job", "run_attempt"]


@dataclasses.dataclass(frozen=True)
class Job:
    """One trajectory to (re-)run: its place (``index`` in the returned list, ``prompt_index``, ``sample_index``), its
    prompt, its attempt number and its engine (or None)."""

    index: int
    prompt_index: int
    sample_index: int
    prompt: tuple[int, ...]
    attempt: int
    engine_index: int | None
    prompt_text: str | None
    label: str | None


class _State:
    def __init__(self, job: Job, environment: Any, factory: Callable[[], Any]) -> None:
        self.job, self.environment, self.factory = job, environment, factory
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
        return (f"trajectory {self.job.index} (prompt_index={self.job.prompt_index}, sample_index="
                f"{self.job.sample_index}, attempt {self.job.attempt})")

    def environment_name(self) -> str:
        """The environment's class, or the factory when it made none."""
        if self.environment is not None:
            return type(self.environment).__name__
        return f"make_environment={getattr(self.factory, '__qualname__', repr(self.factory))}"

    def fail(self, outcome: CallOutcome, call: str, timeout_s: float, timeout_field: str = "step_timeout_s") -> bool:
        if outcome.timed_out:
            self.error = StepTimeoutError(f"{call} of {self.where()} ({self.environment_name()}) did not return "
                                          f"within {timeout_field}={timeout_s:g} s (a hanging tool or environment)")
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


def _observation_ids(observation: Any, tokenizer: Any, vocab_size: int, where: str) -> list[int]:
    """The ids of an observation: text encoded on its own, or token ids (a sequence or a 1-D integer tensor) each in
    ``[0, vocab_size)``. ``TypeError``/``ValueError`` naming ``where`` otherwise; bytes are refused, never read as
    ids (``list(b"12")`` is ``[49, 50]``, not the text)."""
    if isinstance(observation, str):
        return tokenizer.encode(observation, add_special_tokens=False)
    fix = "return text (str) or token ids (a list or 1-D integer tensor)"
    if isinstance(observation, (bytes, bytearray, memoryview)):
        raise TypeError(f"{where} returned observation={bytes(observation)!r:.80}, bytes; {fix}: decode the bytes "
                        "to str first")
    if isinstance(observation, torch.Tensor):
        if observation.dim() != 1 or observation.dtype.is_floating_point or observation.dtype.is_complex \
                or observation.dtype == torch.bool:
            raise TypeError(f"{where} returned an observation tensor of shape {tuple(observation.shape)} and dtype "
                            f"{observation.dtype}; {fix}")
        ids = observation.tolist()
    elif isinstance(observation, Sequence):
        ids = list(observation)
        for position, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                raise TypeError(f"{where} returned observation[{position}]={token!r:.80} ({type(token).__name__}); "
                                f"{fix}, not a list of {type(token).__name__}")
        ids = [int(token) for token in ids]
    else:
        raise TypeError(f"{where} returned observation={observation!r:.80} ({type(observation).__name__}); {fix}")
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise ValueError(f"{where} returned observation[{position}]={token}, outside the tokenizer's vocabulary "
                             f"[0, {vocab_size}); return ids the model knows, or text")
    return ids


def _observe(state: _State, result: StepResult, turn: int, max_turns: int, max_total_tokens: int,
             tokenizer: Any, vocab_size: int) -> None:
    state.turns[-1] = dataclasses.replace(state.turns[-1], num_tool_calls=result.num_tool_calls,
                                          num_tool_errors=result.num_tool_errors, malformed=result.malformed)
    if result.done:
        state.end_reason = "malformed_call" if result.malformed is not None else "done"
        return
    try:  # checked even on the last turn: the environment could not know, and a bad answer is its bug
        ids = _observation_ids(result.observation, tokenizer, vocab_size,
                               f"{state.environment_name()}.step() of {state.where()}, turn {turn},")
    except (TypeError, ValueError) as error:
        state.error, state.end_reason = error, "error"
        return
    if turn + 1 >= max_turns:
        state.end_reason = "max_turns"
        return
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


def _make_environments(jobs: Sequence[Job], make_environment: Callable[[], Any], timeout_s: float) -> list[_State]:
    """Every job's state with a fresh environment; a factory that raises, hangs or returns no environment fails only
    its trajectory."""
    outcomes = call_all([make_environment] * len(jobs), timeout_s=timeout_s, name="make-environment")
    states = []
    for job, outcome in zip(jobs, outcomes):
        made = outcome.value if outcome.error is None and not outcome.timed_out else None
        state = _State(job, made if isinstance(made, Environment) else None, make_environment)
        if not state.fail(outcome, "make_environment()", timeout_s, "make_environment_timeout_s") \
                and state.environment is None:
            state.error = TypeError(f"{state.environment_name()} returned {type(made).__name__} for "
                                    f"{state.where()}; it must return an Environment (reset and step methods)")
            state.end_reason = "error"
        states.append(state)
    return states


def run_attempt(jobs: Sequence[Job], *, engine: Any, sampling: SamplingConfig, make_environment: Callable[[], Any],
                tokenizer: Any, vocab_size: int, max_turns: int, max_total_tokens: int, step_timeout_s: float,
                make_environment_timeout_s: float, pinned: bool) -> list[Trajectory]:
    """One attempt of every job, turn by turn; returns one trajectory per job, in order (``num_attempts == 1``)."""
    states = _make_environments(jobs, make_environment, make_environment_timeout_s)
    made = [s for s in states if s.end_reason is None]
    episodes = [Episode(prompt_index=s.job.prompt_index, sample_index=s.job.sample_index, attempt=s.job.attempt,
                        prompt_text=s.job.prompt_text, label=s.job.label) for s in made]
    outcomes = call_all([lambda s=s, e=e: s.environment.reset(e) for s, e in zip(made, episodes)],
                        timeout_s=step_timeout_s, name="reset")
    for state, outcome in zip(made, outcomes):
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
                state.error = TypeError(f"{state.environment_name()}.step() of {state.where()} returned "
                                        f"{type(outcome.value).__name__}; it must return a "
                                        "rlhfkit.multiturn.StepResult")
                state.end_reason = "error"
                continue
            _observe(state, outcome.value, turn, max_turns, max_total_tokens, tokenizer, vocab_size)
    return [state.result() for state in states]
