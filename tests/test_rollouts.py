"""rlhfkit.rollouts: the staleness-bounded buffer and the background producer (issue 21).

Timing tests use a plain generate_fn that builds rollouts (no engine needed to test the buffer's bookkeeping) with
injected sleeps; the equivalence test runs a real tiny HF engine behind an EngineGroup.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from rlhfkit.rollouts import (
    RolloutBuffer,
    RolloutBufferClosedError,
    RolloutBufferConfig,
    RolloutProducer,
    RolloutProducerError,
    RolloutTimeoutError,
    staleness,
    token_staleness,
)
from rlhfkit.types import Rollout

SRC = Path(__file__).resolve().parents[1] / "src"


def fake_rollouts(prompts, version, *, n=2, delay_s=0.0):
    time.sleep(delay_s)
    return [Rollout(prompt_token_ids=torch.tensor(prompt), response_token_ids=torch.tensor([1, 2, 3]),
                    prompt_index=i, sample_index=s, weight_version=version)
            for i, prompt in enumerate(prompts) for s in range(n)]


def wait_until(condition, what, timeout_s=60.0):
    """Poll ``condition`` until it holds; the deadline is a hang guard, not a speed check."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up after {timeout_s:g} s waiting for {what}"
        time.sleep(0.01)


def prompt_batches(batch_size=2, count=None):
    index = 0
    while count is None or index < count:
        yield [[index * batch_size + j + 1, 7] for j in range(batch_size)]
        index += 1


def train(buffer, *, steps, groups_per_step, step_s=0.0, timeout_s=60.0):
    """A trainer that takes groups_per_step groups per version and bumps its version after each step; returns the
    largest staleness it saw and the version counter the producer reads."""
    version, seen = [0], []
    return version, seen, lambda: _train(buffer, version, seen, steps, groups_per_step, step_s, timeout_s)


def _train(buffer, version, seen, steps, groups_per_step, step_s, timeout_s):
    for _ in range(steps):
        groups = buffer.get(groups_per_step, trainer_version=version[0], timeout_s=timeout_s)
        assert len(groups) == groups_per_step and all(len(group) == 2 for group in groups)
        seen.append(int(staleness([r for group in groups for r in group], version[0]).max()))
        time.sleep(step_s)
        version[0] += 1


# --- config, helper, put -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, match", [
    ({"max_staleness": -1, "capacity": 4}, "max_staleness=-1"),
    ({"max_staleness": 1, "capacity": 0}, "capacity=0"),
    ({"max_staleness": 1, "capacity": 4, "on_stale": "skip"}, "on_stale='skip'"),
    ({"max_staleness": 1, "capacity": 4, "on_stale": "wait"}, "needs groups_per_step"),
    ({"max_staleness": 1, "capacity": 4, "groups_per_step": 0}, "groups_per_step=0"),
    ({"max_staleness": 1, "capacity": 4, "get_timeout_s": 0}, "get_timeout_s=0"),
])
def test_config_names_the_bad_field(fields, match):
    with pytest.raises(ValueError, match=match):
        RolloutBufferConfig(**fields)


def test_staleness_is_trainer_minus_rollout_version_and_refuses_newer_rollouts():
    rollouts = fake_rollouts([[1], [2]], 3, n=1) + fake_rollouts([[3]], 5, n=1)
    assert staleness(rollouts, 5).tolist() == [2, 2, 0]
    assert staleness([], 0).shape == (0,)
    with pytest.raises(ValueError, match="rollout 2 has weight_version=5, newer than trainer_version=4"):
        staleness(rollouts, 4)


def test_put_stamps_the_group_and_get_hands_out_fifo():
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=2, capacity=4))
    first, second = fake_rollouts([[1]], 0), fake_rollouts([[2]], 1)
    buffer.put(first, weight_version=1)        # the stamp wins over the engines' own count
    buffer.put(second)                         # None: the group's oldest Rollout.weight_version
    groups = buffer.get(2, trainer_version=2)
    assert [g[0].prompt_token_ids.tolist() for g in groups] == [[1], [2]]
    assert [r.weight_version for g in groups for r in g] == [1, 1, 1, 1]
    metrics = buffer.metrics()
    assert metrics["staleness_hist_1"] == 4 and metrics["staleness_mean"] == 1 and metrics["groups_out"] == 2
    with pytest.raises(ValueError, match="group\\[1\\].prompt_index=1 but group\\[0\\].prompt_index=0"):
        buffer.put(fake_rollouts([[1], [2]], 0, n=1))
    with pytest.raises(TypeError, match="non-empty list of Rollout"):
        buffer.put([])
    with pytest.raises(ValueError, match="trainer's version never goes back"):
        buffer.get(1, trainer_version=1, timeout_s=0.05)


def test_a_full_buffer_bounds_put_and_the_timeout_names_what_it_waited_for():
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=1))
    buffer.put(fake_rollouts([[1]], 0))
    with pytest.raises(RolloutTimeoutError, match=r"put\(\) of a group \(weight_version=0\) waited for room: the "
                                                  r"buffer holds 1 of capacity=1"):
        buffer.put(fake_rollouts([[2]], 0), timeout_s=0.05)
    buffer.get(1, trainer_version=0)
    with pytest.raises(RolloutTimeoutError, match=r"get\(num_groups=1, trainer_version=0\) timed out after 0.05 s "
                                                  r"waiting for 1 groups with weight_version >= 0 .*none started"):
        buffer.get(1, trainer_version=0, timeout_s=0.05)
    assert buffer.metrics()["producer_waits"] == 1 and buffer.metrics()["trainer_waits"] == 1


# --- the staleness bound under slow trainers and slow producers ----------------------------------------------------
def test_drop_policy_holds_the_bound_with_a_slow_trainer_and_counts_drops():
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=1, capacity=8, on_stale="drop"))
    version, seen, run = train(buffer, steps=6, groups_per_step=2, step_s=0.05)
    with RolloutProducer(buffer, fake_rollouts, prompt_batches(), current_version=lambda: version[0]):
        run()
    metrics = buffer.metrics()
    assert max(seen) <= 1 and metrics["staleness_max"] <= 1
    assert metrics["dropped_groups"] > 0 and metrics["dropped_rollouts"] == 2 * metrics["dropped_groups"]
    assert metrics["staleness_hist_0"] + metrics["staleness_hist_1"] == metrics["rollouts_out"] == 24


def test_wait_policy_holds_the_bound_with_a_slow_trainer_without_drops():
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=1, capacity=8, on_stale="wait", groups_per_step=2))
    version, seen, run = train(buffer, steps=6, groups_per_step=2, step_s=0.05)
    with RolloutProducer(buffer, fake_rollouts, prompt_batches(), current_version=lambda: version[0]):
        run()
    metrics = buffer.metrics()
    assert max(seen) <= 1 and metrics["dropped_groups"] == 0
    assert metrics["producer_waits"] > 0 and metrics["producer_wait_s"] > 0
    assert metrics["staleness_hist_1"] > 0  # off-policy by one version was used, not only on-policy data


@pytest.mark.parametrize("on_stale", ["drop", "wait"])
def test_the_bound_holds_with_a_slow_producer(on_stale):
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=1, capacity=4, on_stale=on_stale, groups_per_step=2))
    version, seen, run = train(buffer, steps=5, groups_per_step=2)
    slow = lambda prompts, v: fake_rollouts(prompts, v, delay_s=0.03)
    with RolloutProducer(buffer, slow, prompt_batches(), current_version=lambda: version[0]):
        run()
    metrics = buffer.metrics()
    assert max(seen) <= 1 and metrics["staleness_max"] <= 1
    assert metrics["trainer_waits"] > 0 and metrics["trainer_wait_s"] > 0


# --- failures, close, stop, interpreter exit ------------------------------------------------------------------------
def test_a_failing_generate_fn_ends_get_with_its_error_in_bounded_time():
    """Defect covered: an engine dying in the producer thread must not leave the trainer waiting out its timeout."""
    def generate(prompts, version):
        if prompts[0][0] > 4:   # the third batch
            raise ConnectionError("engine 0 died")
        return fake_rollouts(prompts, version)

    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=4, capacity=4))  # batch 2 waits for the first get
    with RolloutProducer(buffer, generate, prompt_batches(), current_version=lambda: 0, name="actor-rollouts"):
        assert len(buffer.get(4, trainer_version=0, timeout_s=60)) == 4
        # the producer's error, not a RolloutTimeoutError: the failure woke the get (60 s would be its timeout)
        with pytest.raises(RolloutProducerError, match=r"producer 'actor-rollouts' failed on prompt batch 2 "
                                                       r"\(2 prompts\): ConnectionError: engine 0 died") as info:
            buffer.get(1, trainer_version=0, timeout_s=60)
        assert isinstance(info.value.__cause__, ConnectionError) and info.value.batch_index == 2
        with pytest.raises(RolloutProducerError):   # sticky: every later get raises it too
            buffer.get(1, trainer_version=0, timeout_s=30)


def test_an_admission_timeout_fails_the_producer_naming_what_it_waited_for():
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=2))
    with RolloutProducer(buffer, fake_rollouts, prompt_batches(), current_version=lambda: 0, name="p",
                         admission_timeout_s=0.1) as producer:   # the buffer stays full: this timeout must fire
        wait_until(lambda: not producer.running, "the producer to fail its admission")
        with pytest.raises(RolloutProducerError, match="producer 'p' failed on prompt batch 1") as info:
            buffer.get(2, trainer_version=0, timeout_s=60)
    assert isinstance(info.value.__cause__, RolloutTimeoutError)
    assert "waited to generate 2 groups at weight_version=0: the buffer holds 2" in str(info.value.__cause__)


def test_a_batch_that_can_never_be_admitted_fails_the_producer():
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=8, on_stale="wait", groups_per_step=2))
    with (RolloutProducer(buffer, fake_rollouts, prompt_batches(batch_size=3), current_version=lambda: 0),
          pytest.raises(RolloutProducerError, match="on prompt batch 0") as info):
        buffer.get(2, trainer_version=0, timeout_s=60)
    assert isinstance(info.value.__cause__, ValueError)
    assert "a batch of 3 prompts can never be admitted (at most 2 groups" in str(info.value.__cause__)


def test_close_wakes_a_blocked_get_and_a_blocked_put():
    full = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=1))
    full.put(fake_rollouts([[1]], 0))
    errors = []

    def blocked_put():
        try:
            full.put(fake_rollouts([[2]], 0), timeout_s=60)
        except RolloutBufferClosedError as error:
            errors.append(error)

    putter = threading.Thread(target=blocked_put, daemon=True)
    putter.start()
    empty = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=1))

    def close_once_both_wait():   # the counts rise under the buffer's lock, just before its wait releases it
        wait_until(lambda: empty.metrics()["trainer_waits"] == 1 and full.metrics()["producer_waits"] == 1,
                   "the get and the put to block")
        empty.close()
        full.close()

    closer = threading.Thread(target=close_once_both_wait, daemon=True)
    closer.start()
    # closed errors, not RolloutTimeoutErrors: close() woke both (60 s would be their timeout)
    with pytest.raises(RolloutBufferClosedError, match="close\\(\\) was called"):
        empty.get(1, trainer_version=0, timeout_s=60)
    putter.join(60)
    closer.join(60)
    assert len(errors) == 1 and empty.closed and full.closed
    with pytest.raises(RolloutBufferClosedError):   # queued groups are not handed out after close
        full.get(1, trainer_version=0, timeout_s=1)


def test_stop_joins_a_producer_blocked_on_admission():
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=2))
    producer = RolloutProducer(buffer, fake_rollouts, prompt_batches(), current_version=lambda: 0).start()
    wait_until(lambda: buffer.metrics()["producer_waits"] == 1, "the producer to wait for room")
    assert len(buffer) == 2 and producer.running   # full: the producer waits for room (600 s at most)
    producer.stop(timeout_s=60)   # raises if the thread is still alive: stop() woke the admission wait
    assert not producer.running and producer.num_batches == 1
    assert buffer.metrics()["reserved_groups"] == 0


def test_stop_names_a_hung_generate_and_returns_within_its_bound():
    release, entered = threading.Event(), threading.Event()

    def hung(prompts, version):
        entered.set()
        return release.wait(60) and fake_rollouts(prompts, version)

    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=2))
    producer = RolloutProducer(buffer, hung, prompt_batches(), current_version=lambda: 0, name="hung").start()
    assert entered.wait(60), "generate was never called"
    with pytest.raises(RolloutTimeoutError, match="producer 'hung' did not stop within 0.2 s; it is generating "
                                                  "batch 0 at weight_version=0"):
        producer.stop(timeout_s=0.2)
    release.set()
    producer.stop(timeout_s=60)   # the batch finished after stop: discarded
    assert not producer.running and len(buffer) == 0


def test_the_process_exits_while_producers_are_blocked():
    """Defect covered: a non-daemon producer thread would keep the interpreter alive at exit."""
    script = textwrap.dedent("""
        import threading, time, torch
        from rlhfkit.rollouts import RolloutBuffer, RolloutBufferConfig, RolloutProducer
        from rlhfkit.types import Rollout

        def make(prompts, version):
            return [Rollout(prompt_token_ids=torch.tensor(p), response_token_ids=torch.tensor([1]),
                            prompt_index=i, weight_version=version) for i, p in enumerate(prompts)]

        batches = lambda: iter([[[1, 2]]] * 100)
        full = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=1))
        RolloutProducer(full, make, batches(), current_version=lambda: 0, name="admission").start()
        hung = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=1))
        entered = threading.Event()
        RolloutProducer(hung, lambda p, v: entered.set() or threading.Event().wait(), batches(),
                        current_version=lambda: 0, name="generate").start()
        while len(full) < 1:
            time.sleep(0.01)
        assert entered.wait(60)   # the second producer is inside its never-ending generate
        print("exiting", flush=True)
    """)
    # the subprocess timeout is the hang guard: a producer keeping the interpreter alive makes it fire
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                            timeout=120, env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0 and "exiting" in result.stdout, result.stderr[-2000:]


# --- on-policy equivalence with a real engine ---------------------------------------------------------------------
def _weights(base, step):
    generator = torch.Generator().manual_seed(1000 + step)
    return [(name, tensor + 0.05 * torch.randn(tensor.shape, generator=generator)) for name, tensor in base.items()]


def test_max_staleness_0_with_a_synchronous_schedule_equals_the_synchronous_loop(tiny_llama_path):
    """With max_staleness=0 and on_stale='wait' the producer generates batch k only after update k: the groups
    handed out are token for token those of a plain generate-then-train loop (same prompts, seeds, weights)."""
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig
    from rlhfkit.engines.router import EngineGroup

    sampling = SamplingConfig(n=2, max_new_tokens=6, temperature=1.0)
    batches = [[[5, 9, 11], [17, 3]], [[8, 8, 2, 4], [30]], [[12, 13], [40, 41, 42]]]
    seeded = lambda step: dataclasses.replace(sampling, seed=100 + step)

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    base = {name: tensor.detach().clone() for name, tensor in engine.model.named_parameters()}
    expected = []
    for step, prompts in enumerate(batches):
        expected.append(engine.generate(prompts, seeded(step)))
        engine.load_weights(_weights(base, step))

    group = EngineGroup([HFEngine(HFEngineConfig(model=str(tiny_llama_path)))])
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=4, on_stale="wait", groups_per_step=2))
    version, got = [0], []
    with RolloutProducer(buffer, lambda prompts, v: group.generate(prompts, seeded(v)), iter(batches),
                         current_version=lambda: version[0]):
        for step in range(len(batches)):
            got.append([r for g in buffer.get(2, trainer_version=version[0], timeout_s=60) for r in g])
            group.load_weights(_weights(base, step))
            version[0] += 1
    group.close()
    assert buffer.metrics()["dropped_groups"] == 0 and buffer.metrics()["staleness_max"] == 0
    for step, (want, have) in enumerate(zip(expected, got)):
        assert [r.prompt_token_ids.tolist() for r in have] == [r.prompt_token_ids.tolist() for r in want]
        assert [r.response_token_ids.tolist() for r in have] == [r.response_token_ids.tolist() for r in want], step
        assert {r.weight_version for r in have} == {step}
    assert len({tuple(r.response_token_ids.tolist()) for rs in got for r in rs}) > 2   # sampling, not a constant


# --- per-token weight versions (a sample continued after an in-flight update spans versions) --------------------------
def spanning_rollout(versions, *, weight_version=None, prompt_index=0):
    versions = torch.tensor(versions)
    return Rollout(prompt_token_ids=torch.tensor([5, 6]), response_token_ids=torch.arange(len(versions)) + 1,
                   prompt_index=prompt_index, response_weight_versions=versions,
                   weight_version=int(versions.min()) if weight_version is None else weight_version)


def test_staleness_token_staleness_and_mismatch_stats_share_one_check():
    """Review-g item 2 (duplicated staleness): rollouts' staleness/token_staleness and losses' mismatch_stats compute
    the lag with one function: the same refusal of a bad trainer_version, and a newer token is pinned on its own
    rollout (not the first one)."""
    from rlhfkit.losses import mismatch_stats

    rollouts = [spanning_rollout([3, 3, 4]), spanning_rollout([4, 5], prompt_index=1), spanning_rollout([5, 6])]
    logprobs, mask, cu = torch.zeros(2), torch.tensor([False, True]), torch.tensor([0, 2])
    for bad in (-1, True, 1.0, None):
        messages = set()
        for call in (lambda: staleness(rollouts, bad), lambda: token_staleness(rollouts, bad),
                     lambda: mismatch_stats(logprobs, logprobs, mask, cu, weight_versions=torch.tensor([1, 1]),
                                            trainer_version=bad)):
            with pytest.raises(ValueError, match=f"trainer_version={bad!r}; must be an int >= 0") as raised:
                call()
            messages.add(str(raised.value))
        assert len(messages) == 1, messages
    with pytest.raises(ValueError, match="rollout 2 has a token of weight version 6, newer than trainer_version=5"):
        token_staleness(rollouts, 5)
    with pytest.raises(ValueError, match="rollout 1 has a token of weight version 5, newer than trainer_version=4"):
        token_staleness(rollouts[:2], 4)
    assert token_staleness(rollouts, 6).tolist() == [3, 3, 2, 2, 1, 1, 0]
    assert token_staleness([], 0).shape == (0,)


def test_rollout_token_versions_are_validated_and_default_to_the_constant():
    assert Rollout(prompt_token_ids=torch.tensor([1]), response_token_ids=torch.tensor([2, 3]),
                   weight_version=4).token_weight_versions.tolist() == [4, 4]
    assert spanning_rollout([1, 1, 2]).token_weight_versions.tolist() == [1, 1, 2]
    with pytest.raises(ValueError, match=r"response_weight_versions\[0\]=1 is older than weight_version=2"):
        spanning_rollout([1, 2, 2], weight_version=2)
    with pytest.raises(ValueError, match=r"response_weight_versions\[2\]=1 is older than the token before it"):
        spanning_rollout([1, 2, 1])
    with pytest.raises(ValueError, match="one version per response token"):
        Rollout(prompt_token_ids=torch.tensor([1]), response_token_ids=torch.tensor([2, 3]),
                response_weight_versions=torch.tensor([0]))


def test_token_staleness_and_the_buffer_count_each_token_at_its_own_version():
    """Issue 21 item 1: the bound uses the oldest token (the group's stamp); the token metrics use each token's."""
    rollouts = [spanning_rollout([3, 3, 4, 5]), spanning_rollout([5, 5], prompt_index=0)]
    assert token_staleness(rollouts, 5).tolist() == [2, 2, 1, 0, 0, 0]
    assert staleness(rollouts, 5).tolist() == [2, 0]
    with pytest.raises(ValueError, match="rollout 0 has a token of weight version 5, newer than trainer_version=4"):
        token_staleness(rollouts, 4)
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=2, capacity=4))
    buffer.put(rollouts, weight_version=3)  # the stamp: the version at the request's start
    buffer.get(1, trainer_version=5, timeout_s=1)
    metrics = buffer.metrics()
    assert metrics["staleness_hist_2"] == 2 and metrics["staleness_mean"] == 2  # the bound: conservative
    assert [metrics[f"token_staleness_hist_{k}"] for k in range(3)] == [3, 1, 2]
    assert metrics["token_staleness_mean"] == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="older than weight_version=4"):
        buffer.put(rollouts, weight_version=4)  # a stamp newer than a token it covers is a bookkeeping error


# --- group ids, a failed hand-out, finished producers (issue 50 item 5) ----------------------------------------------
def test_groups_of_different_batches_get_distinct_group_ids_and_grpo_advantages(tiny_llama_path):
    """Issue 50 item 5: an engine numbers each call's prompts from 0, so a get spanning two producer batches handed
    out two groups per prompt_index and GRPO merged them (here the same prompts in both batches: no error, wrong
    advantages). The buffer gives every group a fresh id: its serial number."""
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig
    from rlhfkit.engines.router import EngineGroup
    from rlhfkit.experience import ExperienceConfig, make_experience
    from rlhfkit.losses import model_logprobs

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path), seed=0))
    group = EngineGroup([engine])
    batches = [[[5, 6, 7], [8, 9]], [[5, 6, 7], [8, 9]]]   # a second epoch over the same prompts
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=4))
    with RolloutProducer(buffer, group, iter(batches), current_version=lambda: 0,
                         sampling=SamplingConfig(n=4, max_new_tokens=4)):
        groups = buffer.get(4, trainer_version=0, timeout_s=60)
    group.close()
    assert [[r.prompt_index for r in g] for g in groups] == [[k] * 4 for k in range(4)]
    assert [g[0].prompt_token_ids.tolist() for g in groups] == [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9]]
    rollouts = [r for g in groups for r in g]
    rewards = torch.arange(16, dtype=torch.float32)   # each group: a, a + 1, a + 2, a + 3
    experience, _ = make_experience(rollouts, rewards, config=ExperienceConfig(estimator="grpo"),
                                    policy_logprobs_fn=lambda b: model_logprobs(engine.model, b))
    batch = experience.batch
    first = [int(torch.nonzero(batch.loss_mask & (batch.seq_ids == i))[0]) for i in range(16)]  # a token a sample
    # by hand: deviations -1.5, -0.5, 0.5, 1.5 from the group mean over the unbiased std sqrt(5/3), in every group
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]).repeat(4) / (5 / 3) ** 0.5
    torch.testing.assert_close(experience.advantages[first], expected, atol=1e-5, rtol=0)


def test_a_get_that_fails_its_token_check_keeps_the_groups_queued():
    """Issue 50 item 5: get popped the groups, then token_staleness refused a token newer than trainer_version: the
    groups were lost. Now the check comes first and they stay queued for a get with a consistent version."""
    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=2, capacity=4))
    buffer.put([spanning_rollout([1, 2])], weight_version=1)
    with pytest.raises(ValueError, match="rollout 0 has a token of weight version 2, newer than trainer_version=1"):
        buffer.get(1, trainer_version=1, timeout_s=1)
    assert len(buffer) == 1 and buffer.metrics()["groups_out"] == 0
    (group,) = buffer.get(1, trainer_version=2, timeout_s=1)
    assert group[0].token_weight_versions.tolist() == [1, 2]


def test_get_raises_at_once_when_every_producer_has_finished():
    """Issue 50 item 5: after the producers' prompts ran out, a get the queue could not fill waited its whole
    timeout. Now a waiting get wakes when the last producer ends and raises RolloutBufferExhaustedError (not a
    RolloutTimeoutError: the timeout below is far from spent)."""
    from rlhfkit.rollouts import RolloutBufferExhaustedError

    release = threading.Event()

    def generate(prompts, version):
        release.wait(30)
        return fake_rollouts(prompts, version)

    buffer = RolloutBuffer(RolloutBufferConfig(max_staleness=0, capacity=4))
    with RolloutProducer(buffer, generate, prompt_batches(count=1), current_version=lambda: 0, name="last"):
        def release_once_get_waits():   # the only batch lands while get waits
            wait_until(lambda: buffer.metrics()["trainer_waits"] == 1, "the get to wait")
            release.set()

        threading.Thread(target=release_once_get_waits, daemon=True).start()
        with pytest.raises(RolloutBufferExhaustedError, match=r"every producer has finished \('last': finished: "
                                                              r"its prompt iterator is exhausted\)") as info:
            buffer.get(3, trainer_version=0, timeout_s=60)
        assert (info.value.num_groups, info.value.num_queued) == (3, 2)
        assert len(buffer.get(2, trainer_version=0, timeout_s=1)) == 2   # what is left is still handed out
        with pytest.raises(RolloutBufferExhaustedError):
            buffer.get(1, trainer_version=0, timeout_s=60)
