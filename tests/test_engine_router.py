"""EngineGroup (rlhfkit.engines.router): sharding, balance, ordering, timeouts, dead engines, broadcasts — with plain
in-process fake engines and with real Ray actors of a fake engine class (logical GPUs on CPU)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from conftest import kill_and_wait

from rlhfkit.engines.protocol import SamplingConfig, WeightLagError, WeightVersionError, check_weight_lag
from rlhfkit.engines.router import (
    EngineDiedError,
    EngineError,
    EngineGroup,
    EngineGroupConfig,
    EngineTimeoutError,
    assign_prompts,
    pack_generate_result,
    unpack_generate_result,
)
from rlhfkit.types import Rollout


class FakeEngine:
    """Answers deterministically from the prompt: response token t of sample s = (sum(prompt) + 7 s + t) % 1000.

    Records the prompts it served; ``delay_s`` simulates generation time; ``gate`` (an Event) blocks generate.
    """

    def __init__(self, name: int = 0, *, delay_s: float = 0.0, fail: bool = False, gate=None, drop: int = 0,
                 accept_indices: bool = False) -> None:
        self.name, self.delay_s, self.fail, self.gate, self.drop = name, delay_s, fail, gate, drop
        self.served: list[list[int]] = []
        self.calls: list[tuple] = []
        self.version = 0
        if accept_indices:
            self.generate = self._generate_indexed  # type: ignore[method-assign]

    @staticmethod
    def expected_tokens(prompt, sample_index: int, length: int) -> list[int]:
        return [(sum(prompt) + 7 * sample_index + t) % 1000 for t in range(length)]

    def _rollouts(self, prompts, sampling, indices):
        out = []
        for prompt, index in zip(prompts, indices):
            for s in range(sampling.n):
                tokens = self.expected_tokens(prompt, s, sampling.max_new_tokens)
                out.append(Rollout(prompt_token_ids=torch.tensor(prompt), response_token_ids=torch.tensor(tokens),
                                   response_logprobs=torch.full((len(tokens),), -1.0), prompt_index=index,
                                   sample_index=s, weight_version=self.version))
        return out[self.drop:]

    def generate(self, prompt_token_ids, sampling):
        return self._serve(prompt_token_ids, sampling, list(range(len(prompt_token_ids))))

    def _generate_indexed(self, prompt_token_ids, sampling, *, prompt_indices=None):
        self.calls.append(("prompt_indices", list(prompt_indices)))
        return self._serve(prompt_token_ids, sampling, list(prompt_indices))

    def _serve(self, prompts, sampling, indices):
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise ValueError(f"engine {self.name} exploded")
        self.served.extend([list(p) for p in prompts])
        return self._rollouts(prompts, sampling, indices)

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def load_weights(self, weights, *, version=None):
        weights = list(weights)
        self.version = self.version + 1 if version is None else version
        self.calls.append(("load_weights", [name for name, _ in weights]))
        return len(weights)

    @property
    def weight_version(self):
        return self.version

    def get_weight_version(self):
        return self.version

    def ready(self):
        return {"name": self.name, "pid": os.getpid()}


def prompts_of(lengths):
    return [[(13 * i + j) % 97 + 1 for j in range(length)] for i, length in enumerate(lengths)]


def check_rollouts(rollouts, prompts, sampling):
    assert len(rollouts) == len(prompts) * sampling.n
    for k, rollout in enumerate(rollouts):
        p, s = divmod(k, sampling.n)
        assert (rollout.prompt_index, rollout.sample_index) == (p, s)
        assert rollout.prompt_token_ids.tolist() == prompts[p]
        assert rollout.response_token_ids.tolist() == FakeEngine.expected_tokens(prompts[p], s,
                                                                                  sampling.max_new_tokens)


# --- assignment ------------------------------------------------------------------------------------------------------
def test_assign_prompts_is_lpt_with_outstanding_work():
    # Hand-derived LPT: order 8(#2), 7(#0), 6(#4), 5(#1), 4(#3) onto loads [0, 0]: 8 -> e0; 7 -> e1; 6 -> e1 (7 < 8);
    # 5 -> e0 (8 < 13); 4 -> e0 (13 = 13, tie -> lower index).
    assert assign_prompts([7, 5, 8, 4, 6], [0, 0]) == [[1, 2, 3], [0, 4]]
    # Outstanding work on engine 0 (5) sends the first prompts to engine 1: 3 -> e1 (0 < 5), 3 -> e1 (3 < 5),
    # then 3 -> e0 (5 < 6).
    assert assign_prompts([3, 3, 3], [5, 0]) == [[2], [0, 1]]
    assert assign_prompts([], [0, 0, 0]) == [[], [], []]
    with pytest.raises(ValueError, match="at least one engine"):
        assign_prompts([1.0], [])


def test_assign_prompts_balance_against_brute_force():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(20):
        work = [rng.randint(1, 50) for _ in range(7)]
        shards = assign_prompts(work, [0, 0, 0])
        assert sorted(i for shard in shards for i in shard) == list(range(7))
        makespan = max(sum(work[i] for i in shard) for shard in shards)
        best = min(max(sum(w for w, e in zip(work, a) if e == k) for k in range(3))
                   for a in itertools.product(range(3), repeat=7))
        assert makespan <= 4 / 3 * best + 1e-9  # Graham's LPT bound


# --- in-process engines --------------------------------------------------------------------------------------------
def test_group_orders_results_and_balances_tokens():
    engines = [FakeEngine(i) for i in range(3)]
    sampling = SamplingConfig(n=2, max_new_tokens=4)
    prompts = prompts_of([5, 30, 2, 9, 17, 3, 25, 8, 11, 6])
    with EngineGroup(engines) as group:
        rollouts = group.generate(prompts, sampling)
        assert group.outstanding == [0.0, 0.0, 0.0]
    check_rollouts(rollouts, prompts, sampling)
    served = [sorted(map(tuple, e.served)) for e in engines]
    assert sorted(p for s in served for p in s) == sorted(map(tuple, prompts))  # each prompt served exactly once
    loads = [sum((len(p) + 4) * 2 for p in e.served) for e in engines]
    work = [(len(p) + 4) * 2 for p in prompts]
    assert max(loads) - min(loads) <= max(work)  # LPT: spread below one prompt's work


def test_group_forwards_prompt_indices_to_engines_that_accept_them():
    engines = [FakeEngine(0, accept_indices=True), FakeEngine(1)]
    prompts = prompts_of([4, 4, 4, 4])
    with EngineGroup(engines, config=EngineGroupConfig(balance="prompts")) as group:
        rollouts = group.generate(prompts, SamplingConfig(n=1, max_new_tokens=2))
    check_rollouts(rollouts, prompts, SamplingConfig(n=1, max_new_tokens=2))
    assert engines[0].calls == [("prompt_indices", [0, 2])]  # balanced by prompts: engine 0 gets 0 and 2
    assert engines[1].calls == []


def test_pinned_prompts_go_to_their_engine_and_sessions_spread():
    """Session affinity for multi-turn rollouts: engine_indices overrides balancing; assign_sessions balances."""
    engines = [FakeEngine(i) for i in range(2)]
    prompts = prompts_of([3, 30, 4, 5])
    sampling = SamplingConfig(n=2, max_new_tokens=2)
    with EngineGroup(engines) as group:
        rollouts = group.generate(prompts, sampling, engine_indices=[1, 1, 1, 0])
        assert group.assign_sessions([5.0, 1.0, 4.0]) == [0, 1, 1]
        for bad in ([0, 2, 0, 0], [0, 0], [0, True, 0, 0]):
            with pytest.raises(ValueError, match="engine_indices"):
                group.generate(prompts, sampling, engine_indices=bad)
        with pytest.raises(ValueError, match="assign_sessions"):
            group.assign_sessions([-1.0])
    check_rollouts(rollouts, prompts, sampling)
    assert engines[1].served == prompts[:3] and engines[0].served == prompts[3:]


def test_group_runs_engines_concurrently_and_counts_outstanding_work():
    gate = threading.Event()
    engines = [FakeEngine(0, gate=gate), FakeEngine(1, gate=gate)]
    group = EngineGroup(engines)
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=group.generate(prompts_of([3, 3]),
                                                                             SamplingConfig(max_new_tokens=5))))
    thread.start()
    deadline = time.monotonic() + 60  # a hang guard
    while sum(group.outstanding) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert group.outstanding == [8.0, 8.0]  # (3 prompt + 5 new tokens) x n=1 on each engine while blocked
    gate.set()
    thread.join(10)
    assert len(result["r"]) == 2 and group.outstanding == [0.0, 0.0]
    # three engines in parallel, not in sequence: each returns only once all three are inside generate (in sequence
    # the first one's wait breaks the barrier and it raises)
    barrier = threading.Barrier(3, timeout=30)
    together = EngineGroup([FakeEngine(i, gate=barrier) for i in range(3)])
    assert len(together.generate(prompts_of([2, 2, 2]), SamplingConfig(max_new_tokens=1))) == 3
    group.close()
    together.close()


def test_group_avoids_an_engine_with_outstanding_work():
    gate = threading.Event()
    busy, idle = FakeEngine(0, gate=gate), FakeEngine(1)
    group = EngineGroup([busy, idle])
    thread = threading.Thread(target=lambda: group.generate(prompts_of([50, 50]), SamplingConfig(max_new_tokens=10)))
    thread.start()
    deadline = time.monotonic() + 60  # a hang guard
    while group.outstanding != [60.0, 0.0] and time.monotonic() < deadline:  # idle finished, busy still blocked
        time.sleep(0.01)
    assert group.outstanding == [60.0, 0.0]
    prompts = prompts_of([3, 4, 5])
    group.generate(prompts, SamplingConfig(max_new_tokens=1))
    assert sorted(map(tuple, idle.served)) == sorted(map(tuple, prompts + prompts_of([50, 50])[1:]))
    gate.set()
    thread.join(10)
    group.close()


def test_group_errors_name_the_engine():
    prompts = prompts_of([3, 3, 3])
    with EngineGroup([FakeEngine(0), FakeEngine(1, fail=True), FakeEngine(2)]) as group:
        with pytest.raises(EngineError, match=r"engine 1 \(of 3\) failed in generate: ValueError: engine 1 exploded") \
                as info:
            group.generate(prompts, SamplingConfig(max_new_tokens=2))
        assert info.value.engine_index == 1 and info.value.method == "generate"
    with EngineGroup([FakeEngine(0), FakeEngine(1, drop=1)]) as group:
        with pytest.raises(EngineError, match=r"engine 1 \(of 2\) returned 0 rollouts for 1 prompts"):
            group.generate(prompts_of([3, 3]), SamplingConfig(max_new_tokens=2))


def test_hung_engine_times_out_naming_it():
    gate = threading.Event()
    config = EngineGroupConfig(generate_timeout_s=0.5, control_timeout_s=0.5)
    with EngineGroup([FakeEngine(0), FakeEngine(1, gate=gate)], config=config) as group:
        with pytest.raises(EngineTimeoutError, match=r"engine 1 \(of 2\) did not finish generate within 0.5 s") \
                as info:  # (the hung engine would return after its gate's 30 s: the error is the timeout's)
            group.generate(prompts_of([3, 3]), SamplingConfig(max_new_tokens=2))
        assert info.value.engine_index == 1 and isinstance(info.value, TimeoutError)
        gate.set()


def test_broadcasts_reach_every_engine():
    engines = [FakeEngine(i) for i in range(3)]
    with EngineGroup(engines) as group:
        group.sleep(2)
        group.wake_up(["weights"])
        group.wake_up()
        counts = group.load_weights([("a", torch.zeros(2)), ("b", torch.ones(3))], version=4)
        assert counts == [2, 2, 2]
        assert group.weight_versions() == [4, 4, 4]
        assert group.health_check() == [4, 4, 4]  # fakes have no health_check: their weight_version answers
        assert [r["name"] for r in group.call("ready")] == [0, 1, 2]
        with pytest.raises(ValueError, match="expected 1 .* or 2"):
            group.sleep(3)
        with pytest.raises(ValueError, match="tags='weights'"):
            group.wake_up("weights")
        with pytest.raises(ValueError, match="drawn from"):
            group.wake_up(["optimizer"])
    for engine in engines:
        assert engine.calls == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", None),
                                ("load_weights", ["a", "b"])]


def test_group_validates_inputs():
    with pytest.raises(ValueError, match="non-empty sequence of engines"):
        EngineGroup([])
    with pytest.raises(ValueError, match="generate_timeout_s=0"):
        EngineGroupConfig(generate_timeout_s=0)
    with pytest.raises(ValueError, match="balance='bytes'"):
        EngineGroupConfig(balance="bytes")
    with EngineGroup([FakeEngine()]) as group:
        assert group.generate([], SamplingConfig()) == []
        with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]=\[\]"):
            group.generate([[1], []], SamplingConfig())
        with pytest.raises(TypeError, match="SamplingConfig"):
            group.generate([[1]], {"n": 1})
        rollouts = group.generate([torch.tensor([5, 6])], SamplingConfig(max_new_tokens=1))
        assert rollouts[0].prompt_token_ids.tolist() == [5, 6]


# --- Ray actors (the ray_cluster fixture is in conftest.py) ----------------------------------------------------------
@pytest.mark.ray
def test_ray_actor_engines_order_die_and_hang(ray_cluster):
    ray = ray_cluster
    actor_cls = ray.remote(num_cpus=0)(FakeEngine)
    engines = [actor_cls.remote(0), actor_cls.remote(1), actor_cls.remote(2, delay_s=60)]
    config = EngineGroupConfig(generate_timeout_s=60, control_timeout_s=60, health_timeout_s=60)
    group = EngineGroup(engines[:2], config=config)
    try:
        assert [r["name"] for r in group.call("ready")] == [0, 1]
        sampling = SamplingConfig(n=3, max_new_tokens=3)
        prompts = prompts_of([4, 9, 2, 7, 5])
        check_rollouts(group.generate(prompts, sampling), prompts, sampling)
        group.load_weights([("w", torch.arange(4.0))], version=7)
        assert group.weight_versions() == [7, 7]
        assert [r.weight_version for r in group.generate(prompts, sampling)] == [7] * 15

        kill_and_wait(ray, engines[1])
        with pytest.raises(EngineDiedError, match=r"engine 1 \(of 2\) died during generate") as info:
            group.generate(prompts, sampling)  # (died, not timed out: it did not wait out generate_timeout_s)
        assert info.value.engine_index == 1

        # 5 s: long enough for the live engine's answer on a busy machine, far below the hung one's 60 s
        hung = EngineGroup([engines[0], engines[2]], config=EngineGroupConfig(generate_timeout_s=5.0))
        ray.get(engines[2].ready.remote(), timeout=60)
        with pytest.raises(EngineTimeoutError, match=r"engine 1 \(of 2\) did not finish generate within 5 s"):
            hung.generate(prompts_of([3, 3]), SamplingConfig(max_new_tokens=1))
    finally:
        for engine in engines:
            ray.kill(engine)


# --- packed results (the compact form Ray engine actors return) ---------------------------------------------------------
class PackedFakeEngine(FakeEngine):
    """A FakeEngine that also answers ``generate_packed`` (what VLLMEngineActor offers)."""

    def generate_packed(self, prompt_token_ids, sampling, *, prompt_indices=None):
        self.calls.append(("generate_packed", None if prompt_indices is None else list(prompt_indices)))
        rollouts = self._serve(prompt_token_ids, sampling, list(range(len(prompt_token_ids))))
        return pack_generate_result([r.response_token_ids.tolist() for r in rollouts],
                                    [r.response_logprobs.tolist() for r in rollouts],
                                    ["stop" if r.sample_index == 1 else "length" for r in rollouts],
                                    n=sampling.n, weight_version=self.version)


def test_pack_unpack_round_trip_and_errors():
    responses = [[5, 6, 7], [], [8]]
    packed = pack_generate_result(responses, [[-0.5, -1.0, -2.0], [], [-0.25]], ["length", "abort", "stop"], n=1,
                                  weight_version=3)
    assert packed["tokens"].tolist() == [5, 6, 7, 8] and packed["lengths"].tolist() == [3, 0, 1]
    rollouts = unpack_generate_result(packed, [[1], [2, 3], [4]], [10, 11, 12])
    assert [r.response_token_ids.tolist() for r in rollouts] == responses
    assert [r.response_logprobs.tolist() for r in rollouts] == [[-0.5, -1.0, -2.0], [], [-0.25]]
    assert [r.finish_reason for r in rollouts] == ["length", "abort", "stop"]
    assert [r.prompt_index for r in rollouts] == [10, 11, 12] and rollouts[1].prompt_token_ids.tolist() == [2, 3]
    assert all(r.weight_version == 3 for r in rollouts)
    # each rollout owns its storage (pickling a view would carry the whole packed buffer)
    assert rollouts[0].response_token_ids.untyped_storage().nbytes() == 3 * 8
    two = pack_generate_result([[1], [2], [3], [4]], None, ["stop"] * 4, n=2, weight_version=0)
    unpacked = unpack_generate_result(two, [[9], [8]], [0, 1])
    assert [(r.prompt_index, r.sample_index) for r in unpacked] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert unpacked[0].response_logprobs is None
    with pytest.raises(ValueError, match=r"4 samples for 3 prompts × n=2"):
        unpack_generate_result(two, [[9], [8], [7]], [0, 1, 2])
    with pytest.raises(ValueError, match="'finished'"):
        pack_generate_result([[1]], None, ["finished"], n=1, weight_version=0)


@pytest.mark.ray
def test_ray_actor_engines_return_packed_results(ray_cluster):
    ray = ray_cluster
    engines = [ray.remote(num_cpus=0)(PackedFakeEngine).remote(i) for i in range(2)]
    try:
        group = EngineGroup(engines, config=EngineGroupConfig(generate_timeout_s=60), forward_prompt_indices=True)
        sampling = SamplingConfig(n=2, max_new_tokens=4)
        prompts = prompts_of([4, 9, 2, 7, 5])
        rollouts = group.generate(prompts, sampling)
        check_rollouts(rollouts, prompts, sampling)
        assert [r.finish_reason for r in rollouts] == ["length", "stop"] * 5  # came through generate_packed
        plain = EngineGroup(engines, config=EngineGroupConfig(generate_timeout_s=60), packed_results=False)
        check_rollouts(plain.generate(prompts, sampling), prompts, sampling)
        assert [r.finish_reason for r in plain.generate(prompts, sampling)] == ["length"] * 10
    finally:
        for engine in engines:
            ray.kill(engine)


def test_group_weight_versions_strictly_increase():
    """Review defect 2 (EngineGroup): an explicit version not newer than an engine's was accepted; now it is refused
    before anything is sent, naming the engine and both versions."""
    engines = [FakeEngine(i) for i in range(3)]
    with EngineGroup(engines) as group:
        group.load_weights([("w", torch.zeros(2))], version=4)
        engines[2].version = 6
        for offered in (4, 3, 6):
            with pytest.raises(WeightVersionError, match=r"engine \d \(of 3\) holds weight version \d and was "
                                                         rf"offered version {offered}; versions must strictly"):
                group.load_weights([("w", torch.ones(2))], version=offered)
        assert [len([c for c in e.calls if c[0] == "load_weights"]) for e in engines] == [1, 1, 1]  # nothing sent
        assert group.load_weights([("w", torch.ones(2))], version=7) == [1, 1, 1]
        assert group.weight_versions() == [7, 7, 7]


def test_lagging_engine_weights_raise_or_warn(caplog):
    """Review defect 3: an engine the trainer's weights were never pushed to produced rollouts silently; with
    ``trainer_version`` the group checks each engine's rollouts against ``max_weight_lag``."""
    engines = [FakeEngine(i) for i in range(3)]
    prompts, sampling = prompts_of([3, 4, 5, 6, 7, 8]), SamplingConfig(n=2, max_new_tokens=3)
    with EngineGroup(engines) as group:
        group.load_weights([("w", torch.zeros(2))], version=2)
        engines[1].version = 1  # e.g. a sync that missed this engine
        assert len(group.generate(prompts, sampling)) == 12  # no trainer_version: nothing to compare
        with pytest.raises(WeightLagError, match=r"engine 1 \(of 3\) was generated with weight version 1 but the "
                                                 r"trainer is at version 2 \(lag 1 > max_weight_lag=0\)"):
            group.generate(prompts, sampling, trainer_version=2)
        with pytest.raises(ValueError, match="newer than the trainer's trainer_version=1"):
            group.generate(prompts, sampling, trainer_version=1)
    with EngineGroup(engines, config=EngineGroupConfig(max_weight_lag=1)) as group:
        rollouts = group.generate(prompts, sampling, trainer_version=2)
        assert sorted({r.weight_version for r in rollouts}) == [1, 2]  # rollouts carry the version that made them
    with EngineGroup(engines, config=EngineGroupConfig(on_weight_lag="warn")) as group, \
            caplog.at_level("WARNING", logger="rlhfkit.engines.protocol"):
        assert len(group.generate(prompts, sampling, trainer_version=3)) == 12
        assert "lag 2 > max_weight_lag=0" in caplog.text
    with pytest.raises(ValueError, match="max_weight_lag=-1"):
        EngineGroupConfig(max_weight_lag=-1)
    with pytest.raises(ValueError, match="on_weight_lag='ignore'"):
        EngineGroupConfig(on_weight_lag="ignore")


def test_check_weight_lag_by_hand():
    """The reusable check behind max_weight_lag (off-policy training builds on it)."""
    assert check_weight_lag([5, 4, 5], trainer_version=5, max_lag=1) == 1
    assert check_weight_lag([], trainer_version=5, max_lag=0) == 0
    with pytest.raises(WeightLagError, match=r"rollout 1 was generated with weight version 3 .* \(lag 2 > "
                                             r"max_weight_lag=1"):
        check_weight_lag([5, 3], trainer_version=5, max_lag=1)
    with pytest.raises(ValueError, match="max_lag=-1"):
        check_weight_lag([1], trainer_version=1, max_lag=-1)


class Unpicklable(Exception):
    """An exception the driver cannot re-create: unpickling calls ``Unpicklable(message)``, which lacks ``code``."""

    def __init__(self, message, code):
        super().__init__(f"{message} (code {code})")


class UnpicklableFailingEngine(FakeEngine):
    def generate(self, prompt_token_ids, sampling):
        raise Unpicklable("engine-side failure", 7)


def test_ray_engine_unpicklable_exception_names_engine_and_original(ray_cluster):
    """Review defect 1 (EngineGroup): an exception whose class cannot be re-created on the driver escaped as Ray's
    UnserializableException; now an EngineError names the engine, the method and the original type and message."""
    ray = ray_cluster
    engines = [ray.remote(num_cpus=0)(UnpicklableFailingEngine).remote(i) for i in range(2)]
    try:
        with EngineGroup(engines, config=EngineGroupConfig(generate_timeout_s=60)) as group:
            with pytest.raises(EngineError, match=r"engine [01] \(of 2\) failed in generate: .*Unpicklable: "
                                                  r"engine-side failure \(code 7\)") as info:
                group.generate(prompts_of([3, 4]), SamplingConfig(max_new_tokens=2))
            assert info.value.engine_index in (0, 1) and info.value.method == "generate"
    finally:
        for engine in engines:
            ray.kill(engine)
