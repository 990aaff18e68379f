"""rlhfkit.multiturn on CPU with a real tiny HF model and engine: token-in/token-out across turns, observation tokens out
of the loss, failures (raising, hanging, malformed, context overflow) recorded per trajectory, the group rule."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading

import pytest
import torch

from conftest import load_example
from rlhfkit.engines import SamplingConfig
from rlhfkit.engines.hf import HFEngine
from rlhfkit.engines.router import EngineGroup
from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, make_experience
from rlhfkit.losses import model_logprobs, policy_loss
from rlhfkit.multiturn import (
    Action,
    MalformedToolCallError,
    MultiTurnConfig,
    StepResult,
    StepTimeoutError,
    ToolArgumentError,
    ToolEnvironment,
    ToolEnvironmentConfig,
    calculator,
    generate_trajectories,
    parse_tool_calls,
    trainable_rollouts,
    trajectory_stats,
)
from rlhfkit.packing import pack_rollouts
from rlhfkit.rollouts import token_staleness
from rlhfkit.types import Rollout

OBSERVATION = "<|user|>result 12<|end|><|assistant|>"


@pytest.fixture(scope="module")
def setup(tiny_llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    return model, tokenizer, HFEngine.from_model(model, tokenizer=tokenizer, seed=0)


class Recording:
    """A real engine that records every context it is sent (to check what each turn's prompt was)."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    def generate(self, prompt_token_ids, sampling):
        self.prompts += [list(p) for p in prompt_token_ids]
        return self.engine.generate(prompt_token_ids, sampling)


class Fixed:
    """Always answers the same observation and never ends by itself."""

    def reset(self, episode):
        pass

    def step(self, action):
        return StepResult(observation=OBSERVATION)


def _prompts(tokenizer):
    return [tokenizer.encode("What is 2 + 3?"), tokenizer.encode("hi"), tokenizer.encode("What is 17 * 4?")]


def test_trainer_logprobs_equal_engine_logprobs_on_every_sampled_token_across_turns(setup):
    """Defect covered: re-tokenised context between turns (the trainer must see exactly the engine's tokens)."""
    model, tokenizer, engine = setup
    recording = Recording(engine)
    prompts = _prompts(tokenizer)
    trajectories = generate_trajectories(recording, prompts, SamplingConfig(n=2, max_new_tokens=6, seed=3),
                                         make_environment=Fixed, tokenizer=tokenizer,
                                         config=MultiTurnConfig(max_turns=3, max_total_tokens=256))
    assert len(trajectories) == 6 and all(t.status == "ok" and t.num_turns == 3 for t in trajectories)
    observation_ids = tokenizer.encode(OBSERVATION, add_special_tokens=False)
    contexts = {tuple(p) for p in recording.prompts}
    for t in trajectories:
        tokens = t.response_token_ids.tolist()
        for first, second in zip(t.turns, t.turns[1:]):
            # the next turn's prompt is prompt ids + sampled ids + observation ids, as sent to the engine
            assert tokens[first.start + first.num_sampled:second.start] == observation_ids
            assert tuple(t.prompt_token_ids.tolist() + tokens[:second.start]) in contexts
        assert t.loss_mask.sum() == sum(turn.num_sampled for turn in t.turns)
    rollouts = trainable_rollouts(trajectories)
    batch = pack_rollouts(rollouts)
    engine_logprobs = engine_token_logprobs(rollouts, batch)
    with torch.no_grad():
        trainer_logprobs = model_logprobs(model, batch)
    mask = batch.loss_mask
    assert int(mask.sum()) == sum(int(t.loss_mask.sum()) for t in trajectories)
    torch.testing.assert_close(trainer_logprobs[mask], engine_logprobs[mask], atol=2e-5, rtol=0)


class MidTurnUpdate:
    """A real engine whose weights are updated in flight during every turn, as ``HFEngine.pause_generation`` /
    ``resume`` give: turn k's request starts at version 2k and its second half of tokens is sampled by 2k + 1."""

    def __init__(self, engine):
        self.engine, self.num_calls = engine, 0

    def generate(self, prompt_token_ids, sampling):
        version = 2 * self.num_calls
        self.num_calls += 1
        rollouts = []
        for rollout in self.engine.generate(prompt_token_ids, sampling):
            half = rollout.response_length // 2
            versions = torch.tensor([version] * half + [version + 1] * (rollout.response_length - half))
            rollouts.append(dataclasses.replace(rollout, weight_version=version, response_weight_versions=versions))
        return rollouts


def test_each_token_keeps_its_weight_version_across_turns(setup):
    """Review-g item 3 (per-token versions lost in multi-turn): a trajectory kept only each turn's weight_version and
    its Rollout the oldest one, so tokens sampled after an in-flight update counted as stale as the request's start.
    Now every sampled token keeps the engine's version and an observation its turn's last one."""
    _, tokenizer, engine = setup
    trajectories = generate_trajectories(MidTurnUpdate(engine), _prompts(tokenizer)[:2],
                                         SamplingConfig(n=2, max_new_tokens=4, seed=2, ignore_eos=True),
                                         make_environment=Fixed, tokenizer=tokenizer,
                                         config=MultiTurnConfig(max_turns=3, max_total_tokens=256))
    assert all(t.status == "ok" and t.num_turns == 3 for t in trajectories)
    num_observation = len(tokenizer.encode(OBSERVATION, add_special_tokens=False))
    rollouts = trainable_rollouts(trajectories)
    for trajectory, rollout in zip(trajectories, rollouts):
        expected = []
        for turn, version in zip(trajectory.turns, (0, 2, 4)):
            assert (turn.weight_version, turn.num_sampled) == (version, 4)
            expected += [version] * 2 + [version + 1] * (2 + turn.num_observation)
        assert [turn.num_observation for turn in trajectory.turns] == [num_observation, num_observation, 0]
        assert trajectory.response_weight_versions.tolist() == expected
        assert rollout.weight_version == 0 and rollout.token_weight_versions.tolist() == expected
    assert token_staleness(rollouts, 5).tolist() == [5 - v for r in rollouts for v in r.token_weight_versions.tolist()]
    with pytest.raises(ValueError, match="response_weight_versions"):
        dataclasses.replace(trajectories[0], response_weight_versions=torch.zeros(1, dtype=torch.int64))


def test_observation_tokens_get_zero_loss_weight(setup):
    """Defect covered: tool/observation tokens trained on as if the policy had sampled them."""
    model, tokenizer, engine = setup
    trajectories = generate_trajectories(engine, _prompts(tokenizer)[:2], SamplingConfig(n=2, max_new_tokens=4, seed=1),
                                         make_environment=Fixed, tokenizer=tokenizer,
                                         config=MultiTurnConfig(max_turns=2, max_total_tokens=256))
    rollouts = trainable_rollouts(trajectories)
    experience, _ = make_experience(rollouts, torch.tensor([1.0, 0.0, 0.5, 2.0]), config=ExperienceConfig(),
                                    policy_logprobs_fn=lambda b: model_logprobs(model, b))
    batch = experience.batch
    observation = torch.zeros_like(batch.loss_mask)
    for index, rollout in enumerate(rollouts):
        start = int(batch.cu_seqlens[index]) + rollout.prompt_length
        observation[start:start + rollout.response_length] = ~rollout.loss_mask
    assert int(observation.sum()) == 4 * len(tokenizer.encode(OBSERVATION, add_special_tokens=False))
    assert not bool((batch.loss_mask & observation).any())
    assert bool((experience.advantages[observation] == 0).all())
    logprobs = model_logprobs(model, batch).detach().requires_grad_(True)
    loss, _ = policy_loss(logprobs, experience.old_logprobs, experience.advantages, batch.loss_mask,
                          batch.cu_seqlens)
    loss.backward()
    assert bool((logprobs.grad[observation] == 0).all())
    assert bool((logprobs.grad[batch.loss_mask] != 0).any())


def _boom():
    raise RuntimeError("the tool's backend is down")


class Hang:
    """A tool (or step) that blocks until released, 60 s at most (a hang guard); ``returned`` is set once a call
    ended, so a run seen to end while it is unset did not wait for the hanging call."""

    def __init__(self):
        self.release, self.returned = threading.Event(), threading.Event()

    def __call__(self):
        self.release.wait(60)
        self.returned.set()
        return "late"


def _refuse(expression: str):
    raise ToolArgumentError(f"cannot use {expression!r}")


CALL = '<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'
SCRIPTS = {  # (prompt_index, sample_index) -> the text "written" at each turn (the engine's tokens are real)
    0: [CALL.format(name="calculator", arguments='{"expression": "6 * 7"}'), "42"],
    1: [CALL.format(name="boom", arguments="{}")],
    2: [CALL.format(name="calculator", arguments='{"expression": "1 + 1"}'), "2"],
    3: ['<tool_call>{"name": "calculator", "arguments": {"expression": "1 +', "no idea"],
}


class Scripted:
    """A ToolEnvironment driven by scripted turn texts; (2, 0) calls a hanging tool."""

    def __init__(self, on_malformed="observe", hang=None):
        tools = {"calculator": calculator, "boom": _boom, "hang": hang or Hang()}
        self.tools = ToolEnvironment(tools, ToolEnvironmentConfig(on_malformed=on_malformed))

    def reset(self, episode):
        self.episode = episode

    def step(self, action):
        script = SCRIPTS[self.episode.prompt_index]
        if (self.episode.prompt_index, self.episode.sample_index) == (2, 0):
            script = [CALL.format(name="hang", arguments="{}")]
        return self.tools.step(dataclasses.replace(action, text=script[min(action.turn, len(script) - 1)]))


def _run(engine, tokenizer, config, make_environment=Scripted, num_prompts=4):
    prompts = [tokenizer.encode(f"question {i}") for i in range(num_prompts)]
    return generate_trajectories(engine, prompts, SamplingConfig(n=2, max_new_tokens=3, seed=0),
                                 make_environment=make_environment, tokenizer=tokenizer, config=config)


def test_raising_hanging_and_malformed_tools_are_recorded_per_trajectory_and_groups_drop_whole(setup):
    _, tokenizer, engine = setup
    hang = Hang()
    trajectories = _run(engine, tokenizer, MultiTurnConfig(max_turns=3, step_timeout_s=1.0, max_attempts=2),
                        lambda: Scripted(hang=hang))
    assert not hang.returned.is_set(), "the run waited for the hanging tool"
    hang.release.set()
    assert [(t.prompt_index, t.sample_index) for t in trajectories] == [(p, s) for p in range(4) for s in range(2)]
    by_key = {(t.prompt_index, t.sample_index): t for t in trajectories}
    for s in range(2):  # a calculator call, then the answer
        ok = by_key[0, s]
        assert (ok.status, ok.end_reason, ok.num_turns) == ("ok", "done", 2) and ok.turns[0].num_tool_calls == 1
        observed = ok.response_token_ids[~ok.loss_mask].tolist()
        assert "42" in tokenizer.decode(observed)
        failed = by_key[1, s]  # the tool raised on both attempts: its type is on record
        assert (failed.status, failed.end_reason, failed.num_attempts) == ("failed", "error", 2)
        assert [type(e) for e in failed.errors] == [RuntimeError, RuntimeError] and failed.error is failed.errors[-1]
        malformed = by_key[3, s]  # policy "observe": the error goes back to the model, which answers next turn
        assert (malformed.status, malformed.end_reason) == ("ok", "done")
        assert malformed.turns[0].malformed is not None and "error:" in tokenizer.decode(
            malformed.response_token_ids[~malformed.loss_mask].tolist())
    hung, sibling = by_key[2, 0], by_key[2, 1]
    assert (hung.status, hung.end_reason) == ("failed", "timeout")
    assert all(isinstance(e, StepTimeoutError) for e in hung.errors) and len(hung.errors) == 2
    assert (sibling.status, sibling.end_reason) == ("dropped", "done")  # fine itself, but its group failed
    rollouts = trainable_rollouts(trajectories)
    assert sorted({r.prompt_index for r in rollouts}) == [0, 3] and len(rollouts) == 4
    stats = trajectory_stats(trajectories)
    assert (stats["multiturn/ok"], stats["multiturn/failed"], stats["multiturn/dropped"]) == (4.0, 3.0, 1.0)


def test_malformed_call_ends_the_trajectory_under_policy_end(setup):
    _, tokenizer, engine = setup
    trajectories = _run(engine, tokenizer, MultiTurnConfig(max_turns=3, step_timeout_s=0.5, max_attempts=1),
                        lambda: Scripted(on_malformed="end"),
                        num_prompts=4)
    for t in trajectories[6:]:
        assert (t.status, t.end_reason, t.num_turns) == ("ok", "malformed_call", 1)
        assert "closed by </tool_call>" in t.turns[0].malformed and t.to_rollout().finish_reason == "stop"


class Flaky:
    """Raises on every attempt of the first group round for prompt 1, sample 0; async, to cover async envs."""

    async def reset(self, episode):
        self.episode = episode

    async def step(self, action):
        await asyncio.sleep(0)
        if (self.episode.prompt_index, self.episode.sample_index) == (1, 0) and self.episode.attempt < 2:
            raise ConnectionError("sandbox lost")
        return StepResult(done=True)


def test_group_retry_reruns_the_whole_group_and_keeps_the_failures_on_record(setup):
    _, tokenizer, engine = setup
    config = MultiTurnConfig(max_turns=2, max_attempts=2, group_policy="retry", max_group_attempts=2)
    trajectories = _run(engine, tokenizer, config, Flaky, num_prompts=2)
    assert all(t.status == "ok" for t in trajectories)
    retried, sibling = trajectories[2], trajectories[3]
    assert [type(e) for e in retried.errors] == [ConnectionError, ConnectionError] and retried.num_attempts == 3
    assert sibling.num_attempts == 2 and sibling.errors == ()  # re-run with its group, never mixed with the old one
    dropped = _run(engine, tokenizer, dataclasses.replace(config, group_policy="drop"), Flaky, num_prompts=2)
    assert [t.status for t in dropped] == ["ok", "ok", "failed", "dropped"]


class AsyncHang:
    def __init__(self, hang):
        self.hang = hang

    async def reset(self, episode):
        pass

    async def step(self, action):
        self.hang()  # blocks its own event loop on purpose: still bounded by the timeout


def test_async_environment_that_blocks_its_loop_times_out(setup):
    _, tokenizer, engine = setup
    hang = Hang()
    trajectories = _run(engine, tokenizer, MultiTurnConfig(step_timeout_s=0.5, max_attempts=1),
                        lambda: AsyncHang(hang), num_prompts=1)
    assert not hang.returned.is_set(), "the run waited for the blocked event loop"
    hang.release.set()
    assert all(t.status == "failed" and isinstance(t.error, StepTimeoutError) for t in trajectories)


def test_context_overflow_ends_the_trajectory_and_is_recorded(setup):
    _, tokenizer, engine = setup
    prompt = tokenizer.encode("hi")
    observation = len(tokenizer.encode(OBSERVATION, add_special_tokens=False))
    limit = len(prompt) + 4 + observation + 2  # room for turn 0, its observation and 2 tokens of turn 1
    trajectories = generate_trajectories(engine, [prompt], SamplingConfig(n=2, max_new_tokens=4, ignore_eos=True),
                                         make_environment=Fixed, tokenizer=tokenizer,
                                         config=MultiTurnConfig(max_turns=5, max_total_tokens=limit))
    for t in trajectories:
        assert (t.status, t.end_reason, t.num_turns) == ("ok", "context_overflow", 2)
        assert t.turns[1].num_sampled == 2 and t.prompt_token_ids.numel() + t.response_token_ids.numel() == limit
        assert t.to_rollout().truncated
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] has .* max_total_tokens"):
        generate_trajectories(engine, [prompt * 40], SamplingConfig(), make_environment=Fixed, tokenizer=tokenizer,
                              config=MultiTurnConfig(max_total_tokens=len(prompt) * 40))


def test_engine_group_keeps_each_conversation_on_one_engine(setup, tiny_llama_path):
    _, tokenizer, _ = setup
    engines = [Recording(HFEngine.from_model(setup[0], tokenizer=tokenizer, seed=i)) for i in range(2)]
    with EngineGroup(engines) as group:
        trajectories = generate_trajectories(group, _prompts(tokenizer), SamplingConfig(n=2, max_new_tokens=3),
                                             make_environment=Fixed, tokenizer=tokenizer,
                                             config=MultiTurnConfig(max_turns=3))
    for t in trajectories:
        homes = {turn.engine_index for turn in t.turns}
        assert len(homes) == 1  # every turn on the engine that holds the conversation's prefix
        home = homes.pop()
        full = t.prompt_token_ids.tolist() + t.response_token_ids.tolist()
        for turn in t.turns:
            assert full[:t.prompt_token_ids.numel() + turn.start] in engines[home].prompts
    assert {t.turns[0].engine_index for t in trajectories} == {0, 1}  # groups spread over both engines


def test_tool_call_parser_calculator_and_config_errors():
    tools = {"calculator": calculator}
    assert parse_tool_calls("no call", tools) == []
    call = parse_tool_calls('x <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>',
                            tools)[0]
    assert (call.name, dict(call.arguments)) == ("calculator", {"expression": "2*3"})
    for text, message in (('<tool_call>{"name": "calc"}</tool_call>', "unknown tool 'calc'"),
                          ("<tool_call>{oops}</tool_call>", "not valid JSON"),
                          ('<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>', "missing a required argument"),
                          ('<tool_call>{"name": "calculator"', "closed by")):
        with pytest.raises(MalformedToolCallError, match=message):
            parse_tool_calls(text, tools)
    assert calculator("(12 + 3) * -2") == "-30"
    with pytest.raises(ToolArgumentError, match="unsupported"):
        calculator("__import__('os')")
    refused = ToolEnvironment({"calculator": _refuse}).step(
        Action(text=CALL.format(name="calculator", arguments='{"expression": "2 +"}'), token_ids=(1,), turn=0,
               finish_reason="stop"))
    assert (refused.num_tool_calls, refused.num_tool_errors, refused.done) == (1, 1, False)
    assert "cannot use" in refused.observation
    with pytest.raises(ValueError, match="step_timeout_s=0"):
        MultiTurnConfig(step_timeout_s=0)
    with pytest.raises(ValueError, match="group_policy='all'"):
        MultiTurnConfig(group_policy="all")
    with pytest.raises(ValueError, match="response_loss_mask has shape"):
        Rollout(prompt_token_ids=torch.tensor([1]), response_token_ids=torch.tensor([2, 3]),
                response_loss_mask=torch.tensor([True]))


class Observes:
    """Answers turn 0 with the observation its prompt is given in ``OBSERVATIONS``, then ends the conversation."""

    def reset(self, episode):
        self.prompt_index = episode.prompt_index

    def step(self, action):
        if action.turn > 0:
            return StepResult(done=True)
        return StepResult(observation=OBSERVATIONS[self.prompt_index](action))


OBSERVATIONS = [
    lambda action: b"result 12",                                   # bytes: refused, not read as ids 114, 101, ...
    lambda action: ["result", "12"],                               # a list of strings
    lambda action: [5, 10_000_000],                                # an id outside the vocabulary
    lambda action: torch.tensor(action.token_ids[:2]),             # a 1-D integer tensor of ids: accepted
    lambda action: OBSERVATION,                                    # text: accepted
    lambda action: list(action.token_ids[:2]),                     # a list of ids: accepted
]


def test_an_invalid_observation_fails_only_its_trajectory_and_names_it(setup):
    """Issue 50 item 8: bytes were taken as token ids, a list of strings or an out-of-vocabulary id ended the whole
    batch with a message naming neither the environment nor the trajectory. Now each fails only its trajectory."""
    _, tokenizer, engine = setup
    config = MultiTurnConfig(max_turns=3, max_total_tokens=256, max_attempts=1)
    trajectories = _run(engine, tokenizer, config, Observes, num_prompts=len(OBSERVATIONS))
    assert [t.status for t in trajectories] == ["failed"] * 6 + ["ok"] * 6   # n=2: trajectory 2p + s
    expected = [(TypeError, r"bytes; return text \(str\) or token ids"),
                (TypeError, r"observation\[0\]='result' \(str\); return text"),
                (ValueError, rf"observation\[1\]=10000000, outside the tokenizer's vocabulary \[0, {len(tokenizer)}\)")]
    for index, trajectory in enumerate(trajectories[:6]):
        error_type, message = expected[index // 2]
        assert trajectory.end_reason == "error" and type(trajectory.error) is error_type
        where = (f"Observes.step() of trajectory {index} (prompt_index={index // 2}, sample_index={index % 2}, "
                 "attempt 0), turn 0,")
        assert str(trajectory.error).startswith(where) and re.search(message, str(trajectory.error))
    for trajectory in trajectories[6:]:   # the others completed, their observations appended with loss mask 0
        assert (trajectory.end_reason, trajectory.num_turns) == ("done", 2) and trajectory.turns[0].num_observation
    tensor_turn = trajectories[6].turns[0]
    observed = trajectories[6].response_token_ids[tensor_turn.num_sampled:][:tensor_turn.num_observation]
    assert observed.tolist() == trajectories[6].response_token_ids[:2].tolist()


def test_a_failing_or_hanging_make_environment_fails_only_its_trajectory(setup):
    """Issue 50 item 8: make_environment() ran without a timeout (one blocking factory hung generate_trajectories)
    and its exception ended the whole batch. Now each call is bounded by make_environment_timeout_s and a failure is
    recorded on its trajectory alone."""
    _, tokenizer, engine = setup
    release, lock, calls = threading.Event(), threading.Lock(), []

    def make_environment(behaviour):
        with lock:
            calls.append(None)
            number = len(calls)
        if number == 1:
            if behaviour == "raise":
                raise ConnectionError("sandbox pool exhausted")
            release.wait(30)   # a factory blocked on a sandbox that never comes
        return Fixed()

    try:
        config = MultiTurnConfig(max_turns=2, max_total_tokens=256, max_attempts=1)
        raised = _run(engine, tokenizer, config, lambda: make_environment("raise"), num_prompts=2)
        calls.clear()
        config = dataclasses.replace(config, make_environment_timeout_s=0.5)
        hung = _run(engine, tokenizer, config, lambda: make_environment("hang"), num_prompts=2)
    finally:
        release.set()
    for trajectories, error_type, end_reason in ((raised, ConnectionError, "error"),
                                                 (hung, StepTimeoutError, "timeout")):
        failed = [t for t in trajectories if t.status == "failed"]
        assert len(failed) == 1 and type(failed[0].error) is error_type and failed[0].end_reason == end_reason
        assert failed[0].num_turns == 0 and failed[0].response_token_ids.numel() == 0
        assert sorted(t.status for t in trajectories) == ["dropped", "failed", "ok", "ok"]   # its group: dropped
        assert [t.num_turns for t in trajectories if t.status == "ok"] == [2, 2]
    index = hung.index(next(t for t in hung if t.status == "failed"))
    assert re.match(rf"make_environment\(\) of trajectory {index} \(prompt_index={index // 2}, sample_index="
                    rf"{index % 2}, attempt 0\) \(make_environment=.*<lambda>\) did not return within "
                    r"make_environment_timeout_s=0.5 s", str(hung[index].error))
    with pytest.raises(ValueError, match="make_environment_timeout_s=0"):
        MultiTurnConfig(make_environment_timeout_s=0)


def test_grpo_tools_example_runs_two_steps_on_cpu(tiny_llama_path, tmp_path):
    example = load_example("grpo_tools")
    rows = example.main(["--device", "cpu", "--tiny", "true", "--model", str(tiny_llama_path), "--out",
                         str(tmp_path)])
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["engine_vs_trainer/mean_abs_logprob_diff"] < 1e-4 for row in rows)
    assert all(row["multiturn/ok"] == 4 and "multiturn/tool_calls_mean" in row for row in rows)
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2


def test_grpo_tools_example_endpoint_rollouts_on_cpu(tiny_llama_path, tmp_path):
    """--rollouts endpoint: agent code over the OpenAI API drives the same loop; every session becomes one rollout
    whose sampled tokens the trainer scores as the engine did."""
    example = load_example("grpo_tools")
    rows = example.main(["--device", "cpu", "--tiny", "true", "--model", str(tiny_llama_path), "--out",
                         str(tmp_path), "--rollouts", "endpoint"])
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["engine_vs_trainer/mean_abs_logprob_diff"] < 1e-4 for row in rows)
    assert all(row["multiturn/failed"] == 0 and row["num_seqs"] == 4 for row in rows)


def test_grpo_tools_agent_runs_tool_calls_and_feeds_results_back(monkeypatch):
    """The example's agent: a tool call is run and its result sent back as the next user message; a malformed call
    gets the error; an answer without a call ends the conversation."""
    example = load_example("grpo_tools")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "598 * 691"}}</tool_call>'
    answers = iter([call, "<tool_call>{", "413218"])
    sent = []

    def post(url, body):
        sent.append([dict(m) for m in body["messages"]])
        return {"choices": [{"message": {"role": "assistant", "content": next(answers)}}]}

    monkeypatch.setattr(example, "post", post)
    options = example.Options(max_turns=3)
    stats = example.agent("http://unused/v1", "What is 598 * 691?", "s0", options)
    assert stats == {"turns": 3, "tool_calls": 1, "tool_errors": 0}
    assert sent[1][-2:] == [{"role": "assistant", "content": call},
                            {"role": "user", "content": "<tool_response>413218</tool_response>"}]
    assert sent[2][-1]["content"].startswith("<tool_response>error: ")  # the malformed call's message
    assert sent[0][-1] == {"role": "user", "content": "What is 598 * 691?"} and len(sent) == 3
