"""The reward protocol's per-sample columns, TRL and verl reward functions used unchanged, rewards named by a string,
and weighted rewards reported per function."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlhfkit.rewards import (
    RewardError,
    RewardFunctionConfig,
    apply_reward_function,
    apply_reward_functions,
    load_reward_function,
    rollout_columns,
    rollout_texts,
    trl_reward,
    verl_reward,
)
from rlhfkit.types import Rollout

PROMPTS = ["p0", "p1", "p2", "p3", "p4"]
RESPONSES = ["r0", "r1", "r2", "r3", "r4"]
COLUMNS = [{"prompt": f"raw {i}", "answer": str(i), "difficulty": i % 2} for i in range(5)]


def test_a_function_with_columns_gets_them_aligned_across_batches():
    seen = []

    def with_columns(prompts, responses, labels, *, columns):
        seen.append([c["answer"] for c in columns])
        return [float(c["answer"] == r[1]) for r, c in zip(responses, columns)]

    def with_kwargs(prompts, responses, labels, **kwargs):
        return [float(c["difficulty"]) for c in kwargs["columns"]]

    def plain(prompts, responses, labels):
        return [0.5] * len(responses)

    scores, _ = apply_reward_function(with_columns, PROMPTS, RESPONSES, columns=COLUMNS, batch_size=2)
    assert scores == [1.0] * 5 and sorted(seen) == [["0", "1"], ["2", "3"], ["4"]]
    assert apply_reward_function(with_kwargs, PROMPTS, RESPONSES, columns=COLUMNS)[0] == [0, 1, 0, 1, 0]
    assert apply_reward_function(plain, PROMPTS, RESPONSES, columns=COLUMNS)[0] == [0.5] * 5
    assert apply_reward_function(with_columns, ["p"], ["r7"], columns=None, on_error="assign")[1].num_failed == 1
    with pytest.raises(ValueError, match="got 2 entries for 5 responses"):
        apply_reward_function(with_columns, PROMPTS, RESPONSES, columns=COLUMNS[:2])


def test_an_async_function_gets_columns_too():
    async def scored(prompts, responses, labels, *, columns):
        await asyncio.sleep(0)
        return [float(c["difficulty"]) for c in columns]

    assert apply_reward_function(scored, PROMPTS, RESPONSES, columns=COLUMNS, batch_size=2)[0] == [0, 1, 0, 1, 0]


def test_trl_reward_function_runs_unchanged_with_its_keyword_columns():
    calls = []

    def accuracy(prompts, completions, answer, completion_ids, trainer_state, **kwargs):   # TRL's signature
        calls.append({"prompts": prompts, "kwargs": sorted(kwargs), "ids": completion_ids, "state": trainer_state})
        kwargs["log_metric"]("accuracy/none", 1.0)
        kwargs["log_extra"]("hard", kwargs["difficulty"])
        return [None if int(a) == 4 else float(c == f"r{a}") for c, a in zip(completions, answer)]

    metrics, extra = {}, {}
    reward = trl_reward(accuracy, none_score=-1.0, log_metric=metrics.__setitem__, log_extra=extra.__setitem__)
    scores, report = apply_reward_function(reward, PROMPTS, RESPONSES, columns=COLUMNS)
    assert scores == [1.0, 1.0, 1.0, 1.0, -1.0] and report.function == "accuracy"
    assert calls[0]["prompts"] == [c["prompt"] for c in COLUMNS]                # the dataset's raw prompts
    assert calls[0]["kwargs"] == ["difficulty", "log_extra", "log_metric"] and calls[0]["state"] is None
    assert calls[0]["ids"] == [None] * 5 and metrics == {"accuracy/none": 1.0} and extra == {"hard": [0, 1, 0, 1, 0]}
    assert apply_reward_function(trl_reward(accuracy), PROMPTS, RESPONSES, columns=COLUMNS)[0][4] == 0.0


def test_trl_reward_conversational_format_and_async():
    chat = [{"prompt": [{"role": "user", "content": f"q{i}"}], "solution": f"r{i}"} for i in range(5)]

    async def format_reward(prompts, completions, **kwargs):
        assert prompts[0] == [{"role": "user", "content": "q0"}]
        return [float(c[0]["role"] == "assistant" and c[0]["content"] == s)
                for c, s in zip(completions, kwargs["solution"])]

    scores, _ = apply_reward_function(trl_reward(format_reward), PROMPTS, RESPONSES, columns=chat)
    assert scores == [1.0] * 5


def test_verl_compute_score_runs_unchanged():
    rows = [{"data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": f"r{i}"},
             "extra_info": {"index": i}} for i in range(5)]
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, extra_info["index"]))
        score = float(solution_str == ground_truth)
        return {"score": score, "acc": score} if extra_info["index"] % 2 else score

    assert apply_reward_function(verl_reward(compute_score), PROMPTS, RESPONSES, columns=rows)[0] == [1.0] * 5
    assert seen[0] == ("openai/gsm8k", 0)
    labels_as_truth = verl_reward(compute_score, ground_truth_key=None)
    assert apply_reward_function(labels_as_truth, PROMPTS, RESPONSES, ["r0", "x", "r2", "r3", "r4"],
                                 columns=rows)[0] == [1.0, 0.0, 1.0, 1.0, 1.0]
    broken = [dict(row) for row in rows]
    del broken[3]["data_source"]
    with pytest.raises(RewardError, match=r"sample 3: ValueError: verl_reward: no column 'data_source'") as caught:
        apply_reward_function(verl_reward(compute_score), PROMPTS, RESPONSES, columns=broken)
    assert caught.value.indices == [3]


def test_load_reward_function_from_a_module_and_a_file(tmp_path):
    from rlhfkit.data import arithmetic_reward

    assert load_reward_function("rlhfkit.data:arithmetic_reward") is arithmetic_reward
    path = tmp_path / "my_rewards.py"
    path.write_text("from dataclasses import dataclass\n\n@dataclass\nclass Scale:\n    factor: float = 2.0\n\n"
                    "def accuracy(prompts, responses, labels):\n"
                    "    return [Scale().factor * (r == l) for r, l in zip(responses, labels)]\n")
    accuracy = load_reward_function(f"{path}:accuracy")
    assert accuracy(["p"], ["4"], ["4"]) == [2.0]
    config = RewardFunctionConfig(fn=f"{path}:accuracy", weight=0.5)
    assert config.display_name == "accuracy" and config.fn(["p"], ["1"], ["2"]) == [0.0]
    with pytest.raises(ValueError, match=r"load_reward_function\('accuracy'\): expected 'module:function'"):
        load_reward_function("accuracy")
    with pytest.raises(ValueError, match=r"no such file '.*missing.py'"):
        load_reward_function(f"{tmp_path}/missing.py:accuracy")
    with pytest.raises(ValueError, match=r"has no 'acuracy' \(callables: \['Scale', 'accuracy', 'dataclass'\]\)"):
        load_reward_function(f"{path}:acuracy")
    with pytest.raises(ModuleNotFoundError) as caught:
        load_reward_function("no_such_module_here:fn")
    assert "load_reward_function('no_such_module_here:fn')" in caught.value.__notes__[0]
    with pytest.raises(TypeError, match="'ARITHMETIC_WEIGHTS' is a dict, not callable"):
        load_reward_function("rlhfkit.data:ARITHMETIC_WEIGHTS")


def test_weighted_rewards_report_each_function():
    def exact(prompts, responses, labels):
        return [float(r == l) for r, l in zip(responses, labels)]

    def by_column(prompts, responses, labels, *, columns):
        return [float(c["difficulty"]) for c in columns]

    labels = ["r0", "r1", "x", "x", "r4"]
    total, reports = apply_reward_functions([RewardFunctionConfig(fn=exact, weight=1.0),
                                             RewardFunctionConfig(fn=by_column, weight=0.5)],
                                            PROMPTS, RESPONSES, labels, columns=COLUMNS)
    assert total == [1.0, 1.5, 0.0, 0.5, 1.0]
    stats = {key: value for report in reports for key, value in report.as_dict().items()}
    assert stats["reward/exact/mean"] == pytest.approx(0.6) and stats["reward/by_column/mean"] == pytest.approx(0.4)
    assert stats["reward/exact/std"] == pytest.approx(0.4899, abs=1e-4)          # population std of 1,1,0,0,1
    assert {"reward/exact/num_failed", "reward/by_column/seconds"} <= set(stats)


def test_rollout_columns_follow_prompt_index():
    rollouts = [Rollout(prompt_token_ids=torch.tensor([1]), response_token_ids=torch.tensor([2]), prompt_index=i,
                        response_text=f"r{i}") for i in (1, 1, 0)]
    columns = rollout_columns(rollouts, COLUMNS[:2])
    prompts, responses, _ = rollout_texts(rollouts, prompts=PROMPTS[:2])
    assert [c["answer"] for c in columns] == ["1", "1", "0"] and prompts == ["p1", "p1", "p0"]
    with pytest.raises(ValueError, match="rollout 0 has prompt_index=1 but columns has only 1 entries"):
        rollout_columns(rollouts, COLUMNS[:1])
