"""DAPO dynamic sampling: group std by hand, whole-group filtering, exact batch size over bounded rounds, no partial
groups, shortfall handling, and composition with the overlong penalty (scripted rollouts and the real hf engine)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from rlhfkit.dynamic_sampling import (
    DynamicSampler,
    DynamicSamplingConfig,
    DynamicSamplingError,
    PromptsExhaustedError,
    group_reward_std,
    informative_groups,
)
from rlhfkit.rewards import overlong_penalty
from rlhfkit.types import Rollout


def test_group_reward_std_by_hand():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 1.0, 0.5, 2.0, 2.0])
    ids = torch.tensor([7, 7, 7, 2, 2, 2, 9, 4, 4])
    unique, std = group_reward_std(rewards, ids)
    assert unique.tolist() == [2, 4, 7, 9]
    # group 2: mean 2/3, squares (4/9 + 1/9 + 1/9) = 6/9, unbiased variance 1/3
    assert std[0].item() == pytest.approx(math.sqrt(1 / 3), abs=1e-7)
    # all-equal groups (0.1 * 3 would round its mean) and a group of one: exactly 0
    assert std[1].item() == 0.0 and std[2].item() == 0.0 and std[3].item() == 0.0


def test_informative_groups_keeps_or_drops_whole_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.01])
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    assert informative_groups(rewards, ids).tolist() == [True, True, False, False, True, True]
    assert informative_groups(rewards, ids, min_std=0.1).tolist() == [True, True, False, False, False, False]
    with pytest.raises(ValueError, match=r"min_std=-1"):
        informative_groups(rewards, ids, min_std=-1)
    with pytest.raises(ValueError, match=r"rewards is not finite at sample index 1"):
        informative_groups(torch.tensor([1.0, math.nan]), torch.tensor([0, 0]))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"num_groups=0"):
        DynamicSamplingConfig(num_groups=0)
    with pytest.raises(ValueError, match=r"oversample_factor=0.5"):
        DynamicSamplingConfig(num_groups=2, oversample_factor=0.5)
    with pytest.raises(ValueError, match=r"on_shortfall='drop'"):
        DynamicSamplingConfig(num_groups=2, on_shortfall="drop")
    with pytest.raises(ValueError, match=r"group_size=0"):
        DynamicSamplingConfig(num_groups=2, group_size=0)


class ScriptedTask:
    """Prompts are ints counted from 0; prompt p's group has rewards ``pattern(p)`` (one per sample) and responses of
    ``lengths(p)`` tokens. Records every call so the tests can check the round sizes."""

    def __init__(self, pattern, lengths=None, group_size=4):
        self.pattern, self.lengths, self.group_size = pattern, lengths, group_size
        self.cursor, self.requests = 0, []

    def next_prompts(self, count):
        self.requests.append(count)
        prompts = list(range(self.cursor, self.cursor + count))
        self.cursor += count
        return prompts

    def generate(self, prompts):
        rollouts = []
        for index, prompt in enumerate(prompts):
            lengths = self.lengths(prompt) if self.lengths else [2] * self.group_size
            for sample in range(self.group_size):
                rollouts.append(Rollout(prompt_token_ids=torch.tensor([1, prompt + 2]),
                                        response_token_ids=torch.full((lengths[sample],), 3), prompt_index=index,
                                        sample_index=sample, finish_reason="stop"))
        return rollouts

    def reward(self, prompts, rollouts):
        return [float(self.pattern(prompts[r.prompt_index])[r.sample_index]) for r in rollouts]


def _check_whole_groups(batch, group_size):
    """Every group is contiguous, renumbered 0..G-1, from one origin, and of full size."""
    ids = [r.prompt_index for r in batch.rollouts]
    assert ids == [g for g in range(batch.num_groups) for _ in range(group_size)]
    for g in range(batch.num_groups):
        members = batch.rollouts[g * group_size:(g + 1) * group_size]
        assert sorted(r.sample_index for r in members) == list(range(group_size))
        assert len({tuple(r.prompt_token_ids.tolist()) for r in members}) == 1


def test_backfill_gives_exactly_num_groups_in_bounded_rounds():
    # prompts divisible by 3 are informative: 1 in 3 groups is kept
    task = ScriptedTask(lambda p: [1, 0, 0, 0] if p % 3 == 0 else [1, 1, 1, 1])
    sampler = DynamicSampler(DynamicSamplingConfig(num_groups=4, oversample_factor=1.5, max_rounds=5))
    batch = sampler.sample(task.next_prompts, task.generate, task.reward)
    assert batch.num_groups == 4 and len(batch.rollouts) == 16 and batch.rewards.shape == (16,)
    _check_whole_groups(batch, 4)
    # round sizes: ceil(4 * 1.5) = 6 prompts -> 0, 3 kept; ceil(2 * 1.5) = 3 -> 6 kept; ceil(1.5) = 2 (9, 10) -> 9
    assert task.requests == [6, 3, 2]
    assert batch.origins == ((0, 0), (0, 3), (1, 0), (2, 0))
    assert [r.prompt_token_ids[1].item() - 2 for r in batch.rollouts[::4]] == [0, 3, 6, 9]
    stats = batch.stats
    assert (stats.num_rounds, stats.num_prompts, stats.num_groups_kept, stats.num_groups_dropped,
            stats.num_groups_surplus) == (3, 11, 4, 7, 0)
    assert stats.fill == 1.0 and stats.informative_rate == pytest.approx(4 / 11)
    assert batch.stats.as_dict()["dynamic_sampling/rounds"] == 3.0
    assert batch.rewards.tolist() == [1, 0, 0, 0] * 4


def test_surplus_informative_groups_are_discarded_not_carried_over():
    task = ScriptedTask(lambda p: [0, 1, 0, 1])
    sampler = DynamicSampler(DynamicSamplingConfig(num_groups=3, oversample_factor=2.0))
    batch = sampler.sample(task.next_prompts, task.generate, task.reward)
    assert task.requests == [6] and batch.num_groups == 3 and batch.stats.num_groups_surplus == 3
    assert batch.origins == ((0, 0), (0, 1), (0, 2))
    second = sampler.sample(task.next_prompts, task.generate, task.reward)
    assert second.origins == ((0, 0), (0, 1), (0, 2)) and second.prompts == ([6, 7, 8, 9, 10, 11],)


def test_shortfall_raises_or_returns_whole_groups(caplog):
    task = ScriptedTask(lambda p: [1, 0, 1, 1] if p == 1 else [0, 0, 0, 0])
    config = DynamicSamplingConfig(num_groups=3, max_rounds=2)
    with pytest.raises(DynamicSamplingError, match=r"kept 1 of num_groups=3 groups after max_rounds=2") as info:
        DynamicSampler(config).sample(task.next_prompts, task.generate, task.reward)
    assert info.value.stats.num_groups_kept == 1 and info.value.stats.num_rounds == 2
    assert task.requests == [3, 2]   # the bound holds: two rounds, no more
    task = ScriptedTask(lambda p: [1, 0, 1, 1] if p == 1 else [0, 0, 0, 0])
    partial = DynamicSamplingConfig(num_groups=3, max_rounds=2, on_shortfall="partial")
    with caplog.at_level(logging.WARNING, logger="rlhfkit.dynamic_sampling"):
        batch = DynamicSampler(partial).sample(task.next_prompts, task.generate, task.reward)
    assert "partial batch" in caplog.text
    assert batch.num_groups == 1 and len(batch.rollouts) == 4 and batch.stats.fill == pytest.approx(1 / 3)
    _check_whole_groups(batch, 4)
    nothing = ScriptedTask(lambda p: [0, 0, 0, 0])
    empty = DynamicSampler(partial).sample(nothing.next_prompts, nothing.generate, nothing.reward)
    assert empty.num_groups == 0 and empty.rollouts == [] and empty.rewards.shape == (0,)


def test_a_partial_group_is_an_error_never_mixed_in():
    task = ScriptedTask(lambda p: [0, 1, 0, 1])

    def generate_missing_one(prompts):
        return task.generate(prompts)[:-1]   # the last prompt lost a sample

    with pytest.raises(ValueError, match=r"round 0: prompt_index=1 has 3 samples but groups have 4"):
        DynamicSampler(DynamicSamplingConfig(num_groups=2)).sample(task.next_prompts, generate_missing_one,
                                                                   task.reward)
    sized = DynamicSampler(DynamicSamplingConfig(num_groups=2, group_size=8))
    with pytest.raises(ValueError, match=r"has 4 samples but groups have 8 \(DynamicSamplingConfig.group_size\)"):
        sized.sample(task.next_prompts, task.generate, task.reward)
    with pytest.raises(ValueError, match=r"returned shape \(7,\) for 8 rollouts"):
        DynamicSampler(DynamicSamplingConfig(num_groups=2)).sample(
            task.next_prompts, task.generate, lambda p, r: task.reward(p, r)[:-1])

    def generate_twice(prompts):
        rollouts = task.generate(prompts)
        return rollouts + rollouts[:1]

    with pytest.raises(ValueError, match=r"prompt_index=0 has sample_index=0 twice"):
        DynamicSampler(DynamicSamplingConfig(num_groups=2)).sample(task.next_prompts, generate_twice, task.reward)


def test_overlong_shaping_after_filtering_is_dapo_order():
    """Filter on the task reward, then shape: a group that is all wrong but varies in length is dropped. Filtering on
    shaped rewards instead would keep it (its only signal is the length penalty)."""
    max_length, buffer = 8, 4

    def lengths(p):
        return [2, 8, 6, 3] if p % 2 == 0 else [2, 2, 3, 2]   # even prompts reach into the overlong buffer

    def task_reward(p):
        return [0, 0, 0, 0] if p % 2 == 0 else [1, 0, 0, 1]

    task = ScriptedTask(task_reward, lengths)
    config = DynamicSamplingConfig(num_groups=3, oversample_factor=2.0, max_rounds=3)
    batch = DynamicSampler(config).sample(task.next_prompts, task.generate, task.reward)
    _check_whole_groups(batch, 4)
    assert [origin for origin in batch.origins] == [(0, 1), (0, 3), (0, 5)]   # the odd prompts only
    shaped = batch.rewards + overlong_penalty(batch.response_lengths, max_length=max_length, buffer_length=buffer)
    assert shaped.tolist() == [1, 0, 0, 1] * 3   # lengths <= 4: no penalty on the kept groups

    shaping_first = ScriptedTask(task_reward, lengths)

    def shaped_reward(prompts, rollouts):
        task_scores = torch.tensor(shaping_first.reward(prompts, rollouts))
        return task_scores + overlong_penalty([r.response_length for r in rollouts], max_length=max_length,
                                              buffer_length=buffer)

    other = DynamicSampler(config).sample(shaping_first.next_prompts, shaping_first.generate, shaped_reward)
    assert other.origins == ((0, 0), (0, 1), (0, 2))   # the all-wrong even groups are kept for their lengths
    _check_whole_groups(other, 4)


def test_with_the_hf_engine_and_grpo(tiny_llama_path):
    """Real engine, real GRPO advantages: exact batch size, whole groups, renumbered groups across rounds."""
    transformers = pytest.importorskip("transformers")
    from rlhfkit.advantages import grpo_advantages
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path), seed=0))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_path)
    words = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "yam", "nut", "oat", "rye", "bean"] * 4
    cursor = {"next": 0, "round": 0}
    max_new_tokens = 6

    def next_prompts(count):
        start = cursor["next"]
        cursor["next"] += count
        return [tokenizer(f"say {w}").input_ids for w in words[start:start + count]]

    def generate(prompts):
        cursor["round"] += 1
        sampling = SamplingConfig(n=4, max_new_tokens=max_new_tokens, temperature=1.0, seed=cursor["round"],
                                  stop_token_ids=(5, 6, 7, 8))
        return engine.generate(prompts, sampling)

    def reward(prompts, rollouts):   # a task reward that is constant in many groups: the parity of the first token
        return [float(r.response_token_ids[0].item() % 2) for r in rollouts]

    config = DynamicSamplingConfig(num_groups=4, oversample_factor=1.0, max_rounds=6)
    batch = DynamicSampler(config).sample(next_prompts, generate, reward)
    assert batch.num_groups == 4 and len(batch.rollouts) == 16
    _check_whole_groups(batch, 4)
    ids = torch.tensor([r.prompt_index for r in batch.rollouts])
    assert bool(informative_groups(batch.rewards, ids).all())
    shaped = batch.rewards + overlong_penalty(batch.response_lengths, max_length=max_new_tokens, buffer_length=3)
    assert shaped.shape == (16,)
    torch.testing.assert_close(shaped - batch.rewards, overlong_penalty(
        [r.response_length for r in batch.rollouts], max_length=max_new_tokens, buffer_length=3))
    advantages = grpo_advantages(batch.rewards, ids)
    # every kept group has a nonzero task-reward spread, so no group's advantages are all zero
    assert all(advantages[ids == g].abs().sum() > 0 for g in range(4))
    # backfilled from a later round: its prompt_index was renumbered, so GRPO does not merge it with a round-0 group
    assert batch.stats.num_rounds >= 2 and max(origin[0] for origin in batch.origins) >= 1
    assert batch.stats.num_rounds <= config.max_rounds


def test_next_prompts_running_dry_is_named_as_the_cause(tiny_llama_path):
    """Issue 50 item 10: when the data source ran out, generate([]) was called and the engine's "got no prompts"
    error blamed generate. Now the sampler stops before generate with PromptsExhaustedError naming next_prompts."""
    transformers = pytest.importorskip("transformers")
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path), seed=0))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_path)
    dataset = [tokenizer(f"say {word}").input_ids for word in ("apple", "pear", "plum")]
    cursor, calls = [0], []

    def next_prompts(count):   # a finite data source: the last prompts, then nothing
        start = cursor[0]
        cursor[0] += count
        return dataset[start:start + count]

    def generate(prompts):
        calls.append(len(prompts))
        return engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=3, seed=len(calls)))

    uniform = lambda prompts, rollouts: [0.0] * len(rollouts)   # nothing informative: every round asks for more
    sampler = DynamicSampler(DynamicSamplingConfig(num_groups=2, max_rounds=5))
    with pytest.raises(RuntimeError, match=r"round 2: next_prompts\(2\) returned \[\], no prompts: the prompt source "
                                           r"ran out, not generate \(0 of num_groups=2 groups kept; 4 prompts asked "
                                           r"for in the 2 rounds before\)") as info:
        sampler.sample(next_prompts, generate, uniform)
    from rlhfkit.dynamic_sampling import PromptsExhaustedError

    assert type(info.value) is PromptsExhaustedError and info.value.round_index == 2
    assert calls == [2, 1]   # generate never saw an empty batch
    assert (info.value.stats.num_rounds, info.value.stats.num_groups_dropped) == (2, 3)

    def from_iterator(count, prompts=iter(dataset)):
        return [next(prompts) for _ in range(count)]   # StopIteration once the iterator ends

    with pytest.raises(PromptsExhaustedError, match=r"round 1: next_prompts\(2\) raised StopIteration") as info:
        sampler.sample(from_iterator, generate, uniform)
    assert isinstance(info.value.__cause__, StopIteration)


def test_partial_returns_the_kept_groups_when_next_prompts_runs_dry(tiny_llama_path):
    """With on_shortfall="partial", prompts running dry return the groups kept so far instead of losing them."""
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path), seed=0))
    dataset, cursor = [[5, 6, 7], [8, 9, 10], [11, 12, 13]], [0]

    def next_prompts(count):
        start = cursor[0]
        cursor[0] += count
        return dataset[start:start + count]

    def generate(prompts):
        return engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=3, seed=0))

    def first_prompt_informative(prompts, rollouts):   # only the group of prompt [5, 6, 7] varies
        return [float(r.sample_index) if list(prompts[r.prompt_index]) == [5, 6, 7] else 0.0 for r in rollouts]

    config = DynamicSamplingConfig(num_groups=2, max_rounds=5, on_shortfall="partial")
    batch = DynamicSampler(config).sample(next_prompts, generate, first_prompt_informative)
    assert batch.stats.num_groups_kept == 1 and len(batch.rollouts) == 2
    with pytest.raises(PromptsExhaustedError):
        cursor[0] = 0
        DynamicSampler(DynamicSamplingConfig(num_groups=2, max_rounds=5)).sample(
            next_prompts, generate, first_prompt_informative)
