"""DAPO dynamic sampling: drop GRPO groups whose rewards are all equal, sample more prompts, and backfill so that the
trained batch holds exactly the requested number of whole groups.

A group (the ``n`` samples of one prompt) whose rewards are all equal has zero group-relative advantage: it adds no
gradient, only noise and compute. Dynamic sampling keeps only *informative* groups (reward std above a threshold)
and generates more prompts until the batch is full (Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476, section 3.2 and eq. 11: ``0 < |{o_i correct}| < G``).

What it does: :func:`group_reward_std` and :func:`informative_groups` are pure functions over ``[N]`` rewards and
group ids. :class:`DynamicSampler` runs the rounds from any loop with three callables of yours (next prompts,
``generate(prompts) -> rollouts``, ``reward(prompts, rollouts) -> [N]``): round 1 asks for
``ceil(num_groups * oversample_factor)`` prompts, each later round for ``ceil(missing * oversample_factor)``, at
most ``max_rounds`` rounds; groups are kept or dropped whole, in arrival order, and informative groups beyond the
requested number are discarded (counted as surplus, never carried into the next batch: they would be off-policy
after the next weight update). A group of the wrong size is an error (a partial group is never mixed in). When the
bound is hit the sampler raises :class:`DynamicSamplingError`, or returns the whole groups it has
(``on_shortfall="partial"``). When ``next_prompts`` runs dry (returns no prompts, or raises ``StopIteration``) it
raises :class:`PromptsExhaustedError`, naming ``next_prompts``, before calling ``generate``. The kept rollouts are
renumbered: ``prompt_index`` is the group's position in the batch, so the groups of different rounds never share an
index.

Reward shaping: the sampler filters on what ``reward`` returns. Filter on the *task* reward (correctness), then add
:func:`rlhfkit.rewards.overlong_penalty` to the kept groups' rewards (DAPO's order): filtering on length-shaped rewards
would keep groups that are all wrong (or all right) but differ in length, whose only signal is the length penalty.

What it does not do: sample, score or shape anything itself, or retry failed samples. Needs only torch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from rlhfkit._checks import check_finite, check_float_vector, check_group_ids
from rlhfkit.types import Rollout

__all__ = [
    "DynamicBatch",
    "DynamicSampler",
    "DynamicSamplingConfig",
    "DynamicSamplingError",
    "DynamicSamplingStats",
    "PromptsExhaustedError",
    "group_reward_std",
    "informative_groups",
]

logger = logging.getLogger(__name__)


def group_reward_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward standard deviation of each group.

    Args:
        rewards: ``[N]`` float, finite.
        group_ids: ``[N]`` int, the group (prompt) of each sample; groups may be anywhere in the batch.

    Returns:
        ``(unique_ids [G], std [G])``: sorted group ids and the unbiased std of each group's rewards in float64;
        exactly 0 for a group whose rewards are all equal (whatever rounding the mean would add) and for a group of
        one sample.
    """
    check_float_vector("rewards", rewards)
    ids = check_group_ids(group_ids, rewards.numel())
    check_finite("rewards", rewards, unit="sample")
    unique_ids, inverse = torch.unique(ids, return_inverse=True)
    num_groups = unique_ids.numel()
    x = rewards.detach().to(torch.float64)
    counts = torch.bincount(inverse, minlength=num_groups).to(torch.float64)
    means = torch.zeros(num_groups, dtype=torch.float64, device=x.device).index_add_(0, inverse, x) / counts
    squares = torch.zeros_like(means).index_add_(0, inverse, (x - means[inverse]).square())
    std = torch.sqrt(squares / (counts - 1).clamp(min=1.0))
    low = torch.full_like(means, math.inf).scatter_reduce_(0, inverse, x, reduce="amin")
    high = torch.full_like(means, -math.inf).scatter_reduce_(0, inverse, x, reduce="amax")
    return unique_ids, torch.where(low == high, torch.zeros_like(std), std)


def informative_groups(rewards: torch.Tensor, group_ids: torch.Tensor, *, min_std: float = 0.0) -> torch.Tensor:
    """``[N]`` bool: True for every sample of a group whose reward std is above ``min_std`` (whole groups only).

    ``min_std=0`` drops exactly the groups whose rewards are all equal (DAPO); a small positive value also drops
    groups that differ only by noise."""
    if isinstance(min_std, bool) or not isinstance(min_std, (int, float)) or not min_std >= 0:
        raise ValueError(f"min_std={min_std!r}; must be a number >= 0 (0 drops groups whose rewards are all equal)")
    unique_ids, std = group_reward_std(rewards, group_ids)
    keep = std > min_std
    return keep[torch.searchsorted(unique_ids, group_ids.long())]


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    """How :class:`DynamicSampler` fills a batch.

    Attributes:
        num_groups: whole groups in the trained batch.
        oversample_factor: prompts asked per round, relative to the groups still missing (>= 1; ``2`` asks twice
            as many prompts as groups are missing, for a keep rate around one half).
        max_rounds: most ``generate`` calls per batch (1: filter only, no backfill).
        min_reward_std: a group is kept when its reward std is above this (0: drop all-equal groups).
        group_size: samples per group; None takes the size of the first group and requires it of every other.
        on_shortfall: after ``max_rounds`` with fewer than ``num_groups`` informative groups, ``"raise"``
            :class:`DynamicSamplingError` or return a ``"partial"`` batch of the whole groups kept (a warning is
            logged; ``batch.num_groups`` tells how many, possibly 0).
    """

    num_groups: int
    oversample_factor: float = 1.0
    max_rounds: int = 3
    min_reward_std: float = 0.0
    group_size: int | None = None
    on_shortfall: Literal["raise", "partial"] = "raise"

    def __post_init__(self) -> None:
        for name in ("num_groups", "max_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicSamplingConfig.{name}={value!r}; must be an int >= 1")
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                            or self.group_size < 1):
            raise ValueError(f"DynamicSamplingConfig.group_size={self.group_size!r}; must be an int >= 1 or None "
                             "(take the first group's size)")
        factor = self.oversample_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 <= factor < math.inf:
            raise ValueError(f"DynamicSamplingConfig.oversample_factor={factor!r}; must be a finite number >= 1")
        std = self.min_reward_std
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0 <= std < math.inf:
            raise ValueError(f"DynamicSamplingConfig.min_reward_std={std!r}; must be a finite number >= 0")
        if self.on_shortfall not in ("raise", "partial"):
            raise ValueError(f"DynamicSamplingConfig.on_shortfall={self.on_shortfall!r}; expected 'raise' or "
                             "'partial'")


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingStats:
    """What one :meth:`DynamicSampler.sample` call did.

    Attributes:
        num_groups_requested: ``config.num_groups``.
        num_groups_kept: whole groups in the batch.
        num_groups_dropped: groups dropped for a reward std at or below ``min_reward_std``.
        num_groups_surplus: informative groups generated beyond the batch and discarded.
        num_rounds: ``generate`` calls made.
        num_prompts: prompts asked for over all rounds.
    """

    num_groups_requested: int
    num_groups_kept: int
    num_groups_dropped: int
    num_groups_surplus: int
    num_rounds: int
    num_prompts: int

    @property
    def fill(self) -> float:
        """Kept over requested groups: 1.0 unless a partial batch was returned."""
        return self.num_groups_kept / self.num_groups_requested

    @property
    def informative_rate(self) -> float:
        """Share of generated groups that were informative (kept or surplus)."""
        informative = self.num_groups_kept + self.num_groups_surplus
        total = informative + self.num_groups_dropped
        return informative / total if total else 0.0

    def as_dict(self, prefix: str = "dynamic_sampling") -> dict[str, float]:
        return {f"{prefix}/kept": float(self.num_groups_kept), f"{prefix}/dropped": float(self.num_groups_dropped),
                f"{prefix}/surplus": float(self.num_groups_surplus), f"{prefix}/rounds": float(self.num_rounds),
                f"{prefix}/prompts": float(self.num_prompts), f"{prefix}/fill": self.fill,
                f"{prefix}/informative_rate": self.informative_rate}


class DynamicSamplingError(RuntimeError):
    """``max_rounds`` rounds did not give ``num_groups`` informative groups (``on_shortfall="raise"``); ``stats``
    tells what was generated."""

    def __init__(self, message: str, *, stats: DynamicSamplingStats) -> None:
        super().__init__(message)
        self.stats = stats


class PromptsExhaustedError(RuntimeError):
    """``next_prompts`` ran dry during :meth:`DynamicSampler.sample`: it returned no prompts (an empty sequence or
    None) or raised ``StopIteration`` (then the ``__cause__``), before ``generate`` is called. With
    ``on_shortfall="partial"`` and some groups kept, :meth:`DynamicSampler.sample` returns those instead. ``round_index`` is the round that asked, ``stats``
    what the call generated before it (``num_rounds`` counts the rounds that generated)."""

    def __init__(self, message: str, *, round_index: int, stats: DynamicSamplingStats) -> None:
        super().__init__(message)
        self.round_index = round_index
        self.stats = stats


@dataclass(frozen=True, kw_only=True)
class DynamicBatch:
    """The whole groups :meth:`DynamicSampler.sample` kept.

    Attributes:
        rollouts: group-major; ``prompt_index`` renumbered to the group's position ``0 .. num_groups - 1``.
        rewards: ``[N]`` float32, what ``reward`` returned for each kept rollout (aligned with ``rollouts``).
        origins: per kept group, ``(round, prompt_index)``: the round that generated it and its ``prompt_index`` in
            that round's ``generate`` result (for labels: ``prompts[round].labels[prompt_index]``).
        prompts: what ``next_prompts`` returned, one entry per round.
        stats: counts of the call.
    """

    rollouts: list[Rollout]
    rewards: torch.Tensor
    origins: tuple[tuple[int, int], ...]
    prompts: tuple[Any, ...]
    stats: DynamicSamplingStats

    @property
    def num_groups(self) -> int:
        return len(self.origins)

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[N]`` int64 response tokens per rollout, for :func:`rlhfkit.rewards.overlong_penalty`."""
        return torch.tensor([r.response_length for r in self.rollouts], dtype=torch.long)


@dataclass
class _Group:
    round: int
    prompt_index: int
    members: list[int]   # positions in the round's rollouts, sample-index order as generated


class DynamicSampler:
    """Fills a batch with informative whole groups over bounded rounds (see the module docstring).

    ``sampler.sample(next_prompts, generate, reward)`` with:

    - ``next_prompts(count) -> prompts``: the next ``count`` prompts, any type (token-id lists, a
      :class:`rlhfkit.data.PromptBatch`, ...); called once per round. Fewer than ``count`` are used as they come;
      none (an empty sequence or None) or ``StopIteration`` raises :class:`PromptsExhaustedError`.
    - ``generate(prompts) -> list[Rollout]``: all ``n`` samples of each prompt, ``prompt_index`` naming the prompt
      (e.g. ``lambda p: engine.generate(p.token_ids, sampling)``).
    - ``reward(prompts, rollouts) -> [N]``: one float per rollout, the reward to filter on (the task reward; add
      length shaping to ``batch.rewards`` afterwards).
    """

    def __init__(self, config: DynamicSamplingConfig) -> None:
        if not isinstance(config, DynamicSamplingConfig):
            raise TypeError(f"DynamicSampler(config) needs a DynamicSamplingConfig, got {type(config).__name__}")
        self.config = config

    def sample(self, next_prompts: Callable[[int], Any], generate: Callable[[Any], Sequence[Rollout]],
               reward: Callable[[Any, Sequence[Rollout]], Any]) -> DynamicBatch:
        for name, fn in (("next_prompts", next_prompts), ("generate", generate), ("reward", reward)):
            if not callable(fn):
                raise TypeError(f"DynamicSampler.sample({name}={fn!r}) is not callable")
        config = self.config
        group_size = config.group_size
        kept: list[tuple[_Group, list[Rollout], torch.Tensor]] = []
        prompts_per_round: list[Any] = []
        dropped = surplus = num_prompts = 0
        for round_index in range(config.max_rounds):
            missing = config.num_groups - len(kept)
            if missing == 0:
                break
            count = math.ceil(missing * config.oversample_factor)
            so_far = DynamicSamplingStats(num_groups_requested=config.num_groups, num_groups_kept=len(kept),
                                          num_groups_dropped=dropped, num_groups_surplus=surplus,
                                          num_rounds=len(prompts_per_round), num_prompts=num_prompts)
            try:
                prompts = _ask_prompts(next_prompts, count, round_index, so_far)
            except PromptsExhaustedError as error:
                if config.on_shortfall == "raise" or not kept:
                    raise
                logger.warning("%s; returning the groups kept so far (on_shortfall='partial')", error)
                break
            prompts_per_round.append(prompts)
            num_prompts += count
            rollouts = list(generate(prompts))
            rewards = _round_rewards(reward(prompts, rollouts), rollouts, round_index)
            groups = _split_groups(rollouts, round_index)
            if group_size is None:
                group_size = len(groups[0].members)
            _check_group_sizes(groups, group_size, round_index, config.group_size is None)
            ids = torch.tensor([r.prompt_index for r in rollouts], dtype=torch.long)
            keep = informative_groups(rewards, ids, min_std=config.min_reward_std)
            for group in groups:
                if not bool(keep[group.members[0]]):
                    dropped += 1
                elif len(kept) == config.num_groups:
                    surplus += 1
                else:
                    kept.append((group, [rollouts[i] for i in group.members], rewards[group.members]))
        stats = DynamicSamplingStats(num_groups_requested=config.num_groups, num_groups_kept=len(kept),
                                     num_groups_dropped=dropped, num_groups_surplus=surplus,
                                     num_rounds=len(prompts_per_round), num_prompts=num_prompts)
        if len(kept) < config.num_groups:
            message = (f"dynamic sampling kept {len(kept)} of num_groups={config.num_groups} groups after "
                       f"max_rounds={config.max_rounds} rounds ({num_prompts} prompts; {dropped} groups dropped with "
                       f"reward std <= min_reward_std={config.min_reward_std}); raise max_rounds or "
                       "oversample_factor, lower min_reward_std, or check that the reward varies within a group")
            if config.on_shortfall == "raise":
                raise DynamicSamplingError(message, stats=stats)
            logger.warning("%s; returning a partial batch (on_shortfall='partial')", message)
        rollouts_out = [replace(r, prompt_index=position) if r.prompt_index != position else r
                        for position, (_, members, _) in enumerate(kept) for r in members]
        rewards_out = (torch.cat([r for _, _, r in kept]).float() if kept else torch.zeros(0, dtype=torch.float32))
        return DynamicBatch(rollouts=rollouts_out, rewards=rewards_out,
                            origins=tuple((g.round, g.prompt_index) for g, _, _ in kept),
                            prompts=tuple(prompts_per_round), stats=stats)


def _ask_prompts(next_prompts: Callable[[int], Any], count: int, round_index: int,
                 so_far: DynamicSamplingStats) -> Any:
    """``next_prompts(count)``; :class:`PromptsExhaustedError` when it returns none or raises ``StopIteration``."""
    cause = None
    try:
        prompts = next_prompts(count)
    except StopIteration as error:  # next(iterator) in a plain function: the data source, not a generator, ended
        prompts, cause = None, error
    if prompts is not None and not (hasattr(prompts, "__len__") and len(prompts) == 0):
        return prompts
    what = "raised StopIteration" if cause is not None else f"returned {prompts!r:.40}, no prompts"
    raise PromptsExhaustedError(
        f"dynamic sampling round {round_index}: next_prompts({count}) {what}: the prompt source ran out, not "
        f"generate ({so_far.num_groups_kept} of num_groups={so_far.num_groups_requested} groups kept; "
        f"{so_far.num_prompts} prompts asked for in the {so_far.num_rounds} rounds before); start the next epoch of "
        "prompts (e.g. a fresh iterator) or end training", round_index=round_index, stats=so_far) from cause


def _round_rewards(values: Any, rollouts: list[Rollout], round_index: int) -> torch.Tensor:
    if not rollouts:
        raise ValueError(f"dynamic sampling round {round_index}: generate(prompts) returned no rollouts; it must "
                         "return every sample of every prompt")
    for index, rollout in enumerate(rollouts):
        if not isinstance(rollout, Rollout):
            raise TypeError(f"dynamic sampling round {round_index}: generate(prompts) returned "
                            f"{type(rollout).__name__} at index {index}; expected rlhfkit.types.Rollout")
    try:
        rewards = torch.as_tensor(values, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"dynamic sampling round {round_index}: reward(prompts, rollouts) returned "
                        f"{type(values).__name__}, not a sequence of floats ({error})") from error
    if rewards.shape != (len(rollouts),):
        raise ValueError(f"dynamic sampling round {round_index}: reward(prompts, rollouts) returned shape "
                         f"{tuple(rewards.shape)} for {len(rollouts)} rollouts; return one float per rollout")
    check_finite(f"dynamic sampling round {round_index}: rewards", rewards, unit="sample")
    return rewards


def _split_groups(rollouts: list[Rollout], round_index: int) -> list[_Group]:
    """Groups by ``prompt_index`` in order of first appearance; one prompt and distinct sample indices per group."""
    groups: dict[int, _Group] = {}
    for position, rollout in enumerate(rollouts):
        group = groups.setdefault(rollout.prompt_index, _Group(round_index, rollout.prompt_index, []))
        first = rollouts[group.members[0]] if group.members else rollout
        if not torch.equal(first.prompt_token_ids.cpu(), rollout.prompt_token_ids.cpu()):
            raise ValueError(f"dynamic sampling round {round_index}: rollouts {group.members[0]} and {position} share "
                             f"prompt_index={rollout.prompt_index} but have different prompts; generate must give "
                             "each prompt its own prompt_index")
        if any(rollouts[i].sample_index == rollout.sample_index for i in group.members):
            raise ValueError(f"dynamic sampling round {round_index}: prompt_index={rollout.prompt_index} has "
                             f"sample_index={rollout.sample_index} twice (rollout {position}); generate returned a "
                             "sample twice")
        group.members.append(position)
    return list(groups.values())


def _check_group_sizes(groups: list[_Group], group_size: int, round_index: int, inferred: bool) -> None:
    for group in groups:
        if len(group.members) != group_size:
            source = "the first group's size" if inferred else "DynamicSamplingConfig.group_size"
            raise ValueError(f"dynamic sampling round {round_index}: prompt_index={group.prompt_index} has "
                             f"{len(group.members)} samples but groups have {group_size} ({source}); a partial group "
                             "is never mixed into a batch: make generate return all n samples of every prompt (or "
                             "drop the whole group yourself)")
