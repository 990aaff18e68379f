"""HybridPlan.overlap_switches: a trainer role's sleep runs in the background while the next role wakes.

The worker's background sleep and the guard's hand-over are checked in this process (a real TrainerWorker over a
stand-in model, a LocalPhaseStore, driven through its public calls); the whole loop on CPU with Ray, DeepSpeed and
the HF engine, against the same loop without overlap.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.hybrid import HybridCallError
from rlhfkit.phase import LocalPhaseStore, PhaseConflictError, PhaseGuard


class SlowModel:
    """Sleeps as slowly as told, or fails; records whether it is asleep."""

    def __init__(self, *, sleep_s: float = 0.0, fail: bool = False, release: threading.Event | None = None) -> None:
        self.sleep_s, self.fail, self.is_asleep, self.weights_kept = sleep_s, fail, False, False
        self.release = release  # a sleep holds until the test sets it: whatever ran meanwhile did not wait for it
        self.started = threading.Event()
        self.sleeps: list[bool] = []  # keep_weights of each sleep, in order
        self.streamed: list[bool] = []  # whether a sleep had ended at each read

    config = SimpleNamespace(zero_stage=1)

    def sleep(self, keep_weights: bool = False) -> dict:
        self.started.set()
        self.sleeps.append(keep_weights)
        assert self.release is None or self.release.wait(60), "the test never released the sleep"
        time.sleep(self.sleep_s)
        if self.fail:
            raise MemoryError("the host buffer could not be pinned")
        self.is_asleep, self.weights_kept = True, keep_weights
        return {"bytes_moved": 1000.0}

    def named_parameters_for_sync(self, *, bucket_bytes: int, dtype):
        """The stream a push reads: notes whether a sleep had ended when it was read."""
        self.streamed.append(self.is_asleep)
        yield "w", torch.zeros(2)

    def wake_up(self) -> dict:
        self.is_asleep = self.weights_kept = False
        return {"bytes_moved": 1000.0}


@pytest.fixture
def worker(monkeypatch, tiny_llama_path):
    """A TrainerWorker of role 'reference', rank 0, on GPU key node0/gpu0 of an in-process store, overlapping."""
    return _worker(monkeypatch, tiny_llama_path, "reference")


@pytest.fixture
def actor_worker(monkeypatch, tiny_llama_path):
    """The same of role 'actor' (a role that trains)."""
    return _worker(monkeypatch, tiny_llama_path, "actor")


def _worker(monkeypatch, tiny_llama_path, role: str):
    from rlhfkit.hybrid._trainer_worker import TrainerWorker

    for name, value in {"RLHFKIT_ROLE": role, "RANK": "0", "RLHFKIT_BUNDLE_INDICES": "0",
                        "RLHFKIT_PLAN_NODE": "0"}.items():
        monkeypatch.setenv(name, value)
    store = LocalPhaseStore()
    worker = TrainerWorker(store, "cpu", str(tiny_llama_path))
    # what load() sets, without building a DeepSpeed model
    worker.config, worker.plan, worker.overlap = SimpleNamespace(offload=True), _SleepPlan(), True
    return worker, store


@dataclasses.dataclass(frozen=True)
class _SleepPlan:
    """The RolePlan fields a worker's sleeps read."""

    offload: bool = True
    keep_optimizer: bool = False
    keep_weights: bool = False


def _plan(worker, *, overlap_switches: bool, sleep_optimizer: bool = True, sleep_weights: bool = True) -> None:
    worker.overlap = overlap_switches
    worker.plan = _SleepPlan(keep_optimizer=not sleep_optimizer, keep_weights=not sleep_weights)


def test_a_background_sleep_lets_the_next_role_wake_and_is_joined_by_the_next_call(worker):
    worker, store = worker
    release = threading.Event()
    worker.model = SlowModel(sleep_s=0.5, release=release)
    worker.wake(phase="forward_reference")
    assert worker.sleep("forward_reference").cost.switch_s == 0.0  # returns at once; the sleep runs behind
    assert worker.model.started.wait(60) and not worker.model.is_asleep and not worker.awake
    actor = PhaseGuard(store, gpu="node0/gpu0")
    transition = actor.wake("actor", SlowModel(), phase="train_actor", displace_releasing=True)
    assert transition.displaced == "reference" and not worker.model.is_asleep  # did not wait for it: still held
    release.set()
    # the reference's next call joins its sleep first, then finds the actor awake: refused, as without overlap
    with pytest.raises(PhaseConflictError, match="'actor' is awake there"):
        worker.wake(phase="forward_reference")
    assert worker.model.is_asleep
    assert actor.awake_role() == "actor"  # the reference's finished sleep left the actor's claim alone
    cost = worker.sleep("again").cost  # asleep: nothing to do; reports the background sleep that ended
    assert cost.background_s >= 0.5 and cost.bytes_d2h == 1000.0 and cost.switch_s == 0.0
    assert worker.sleep("again").cost.background_s == 0.0  # reported once
    assert [e["action"] for e in worker.guard_events()] == ["wake", "sleep"]


def test_the_guard_log_of_a_sleep_still_running_comes_later_or_with_settle(worker):
    """A per-step log must not hold the driver for a background sleep: its transition comes with a later call;
    ``settle=True`` (the end of a run) waits for it."""
    worker, _ = worker
    release = threading.Event()
    worker.model = SlowModel(release=release)
    worker.wake(phase="forward_reference")
    worker.sleep("forward_reference")
    assert worker.model.started.wait(60)
    assert [e["action"] for e in worker.guard_events()] == ["wake"]  # the sleep is still running (held)
    release.set()
    assert [e["action"] for e in worker.guard_events(settle=True)] == ["sleep"]
    assert worker.model.is_asleep


def test_a_failed_background_sleep_surfaces_on_the_next_call_naming_role_rank_and_phase(worker):
    worker, _ = worker
    worker.model = SlowModel(fail=True)
    worker.wake(phase="forward_reference")
    worker.sleep("forward_reference", keep_weights=True)
    with pytest.raises(HybridCallError, match=r"'reference' rank 0: its sleep after phase 'forward_reference' "
                                              r"failed in the background \(MemoryError: the host buffer") as error:
        worker.wake(phase="next")
    assert error.value.phase == "forward_reference" and error.value.role == "reference"
    worker.guard_events(settle=True)  # reported once


class Keeping(SlowModel):
    """Records ``(keep_weights, keep_optimizer)`` of each sleep."""

    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def sleep(self, keep_weights: bool = False, keep_optimizer: bool = False) -> dict:
        self.calls.append((keep_weights, keep_optimizer))
        return super().sleep(keep_weights)


def test_sleep_optimizer_false_keeps_a_trained_roles_optimizer_states_through_its_sleeps(actor_worker):
    """The plan's sleep_optimizer=False: every sleep of a trained role asks its model to keep the optimizer's
    states (DeepSpeedEngine.sleep(keep_optimizer=True)); True moves them."""
    calls = []
    actor, _ = actor_worker
    for sleep_optimizer in (False, True):
        _plan(actor, overlap_switches=False, sleep_optimizer=sleep_optimizer)
        actor.model = Keeping(calls)
        actor.wake(phase="train_actor")
        actor.sleep("train_actor", keep_weights=True)
        actor.wake(phase="train_actor")
        actor.sleep("train_actor")
        keeps = not sleep_optimizer
        assert calls[-2:] == [(True, keeps), (False, keeps)], (sleep_optimizer, calls)
    from rlhfkit.hybrid import RolePlan

    with pytest.raises(TypeError, match=r"RolePlan.keep_optimizer='no'; must be True or False"):
        RolePlan(zero_stage=1, keep_optimizer="no")


def test_sleep_weights_false_keeps_a_trained_roles_weights_through_every_sleep(actor_worker):
    """The plan's sleep_weights=False: every sleep of a trained role keeps its weights
    (DeepSpeedEngine.sleep(keep_weights=True)), a full one too, and a full sleep after a keeping one has nothing to
    move; True moves them."""
    calls = []
    actor, _ = actor_worker
    for sleep_weights in (False, True):
        _plan(actor, overlap_switches=False, sleep_weights=sleep_weights, sleep_optimizer=True)
        actor.model, start = Keeping(calls), len(calls)
        actor.wake(phase="train_actor")
        actor.sleep("train_actor", keep_weights=True)  # optim_step(sleep_after="keep_weights")
        actor.sleep("sync")  # after the push
        keeps = not sleep_weights
        assert calls[start:] == ([(True, False)] if keeps else [(True, False), (False, False)]), calls
        actor.wake(phase="forward_actor")
        actor.sleep("forward_actor")  # forward(sleep_after=True)
        assert calls[-1] == (keeps, False), (sleep_weights, calls)
    # the same behind a background sleep: nothing is queued behind it
    _plan(actor, overlap_switches=True, sleep_weights=False)
    actor.model = Keeping(calls)
    actor.wake(phase="train_actor")
    actor.sleep("train_actor", keep_weights=True)
    assert actor.sleep("sync").cost.switch_s == 0.0
    actor.guard_events(settle=True)
    assert calls[-1] == (True, False) and actor.model.sleeps == [True]
    from rlhfkit.hybrid import RolePlan

    with pytest.raises(TypeError, match=r"RolePlan.keep_weights=1; must be True or False"):
        RolePlan(zero_stage=1, keep_weights=1)


def test_a_role_without_an_optimizer_is_never_asked_to_keep_one(worker):
    calls = []
    reference, _ = worker
    _plan(reference, overlap_switches=False, sleep_optimizer=False, sleep_weights=False)
    reference.model = Keeping(calls)
    reference.wake(phase="forward_reference")
    reference.sleep("forward_reference")
    assert calls == [(False, False)]


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, stream, *, description):
        self.sent += [name for name, _ in stream]
        return SimpleNamespace(version=1, num_bytes=8, seconds=0.0, receiver_versions=[1])


def _pushing(worker, model) -> None:
    worker.model, worker.sender, worker.description = model, FakeSender(), None
    worker.sync_config = SimpleNamespace(bucket_bytes=1 << 20, dtype=None)
    worker.wake(phase="train_actor")
    worker.sleep("train_actor", keep_weights=True)  # optim_step(sleep_after="keep_weights")
    assert model.started.wait(60) and not model.is_asleep


def test_a_push_streams_beside_a_sleep_that_keeps_the_weights_and_the_full_sleep_queues_behind(worker):
    """The optimizer's states go to host in the background after optim_step; the push reads only the weights, so it
    starts at once, and the weights' own sleep is queued behind the first (the call returns at once)."""
    worker, _ = worker
    release = threading.Event()
    model = SlowModel(sleep_s=0.6, release=release)
    _pushing(worker, model)
    assert worker.send_weights(phase="sync")["version"] == 1 and worker.sender.sent == ["w"]
    assert model.streamed == [False]  # read beside the sleep, which had not ended (held)
    assert worker.sleep("sync", False).cost.switch_s == 0.0
    assert model.sleeps == [True]  # neither call waited for the first sleep, still held; the second is queued
    release.set()
    assert [(e["action"], e["phase"]) for e in worker.guard_events(settle=True)] == [
        ("wake", "train_actor"), ("sleep", "train_actor"), ("sleep", "sync")]
    assert model.sleeps == [True, False] and model.is_asleep and not model.weights_kept
    assert worker.sleep("next").cost.background_s >= 0.6 * 2


def test_a_push_under_zero3_waits_for_the_sleep_and_a_failed_first_sleep_skips_the_queued_one(worker):
    """ZeRO-3's gathers are not run beside a sleep (its partitions and hooks are shared state): the push joins it
    first. A weights-keeping sleep that fails leaves the queued full sleep undone and surfaces once."""
    worker, _ = worker
    model = SlowModel(sleep_s=0.3)
    model.config = SimpleNamespace(zero_stage=3)
    _pushing(worker, model)
    worker.send_weights(phase="sync")
    assert model.streamed == [True]  # after the sleep ended
    failing = SlowModel(sleep_s=0.2, fail=True)
    _pushing(worker, failing)
    worker.sleep("sync", False)
    with pytest.raises(HybridCallError, match=r"its sleep after phase 'train_actor' failed in the background"):
        worker.wake(phase="next")
    assert failing.sleeps == [True]  # the queued full sleep did not run


def test_without_overlap_the_sleep_is_done_when_the_call_returns(worker):
    worker, store = worker
    _plan(worker, overlap_switches=False)
    worker.model = SlowModel(sleep_s=0.2)
    worker.wake(phase="forward_reference")
    assert worker.sleep("forward_reference").cost.switch_s >= 0.2 and worker.model.is_asleep
    assert store.holder("node0/gpu0") is None


def test_switches_overlap_only_where_every_role_fits_resident(tiny_llama_path):
    """The plan's overlap_switches: on for a GPU run whose estimate with every role resident at once fits within the
    plan's headroom (two roles share the GPU for a moment), off on CPU (no copies to hide) and where the GPU is too
    small for every role resident with that headroom."""
    pytest.importorskip("deepspeed")
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
    from rlhfkit.hybrid import HybridConfig, TrainerConfig, plan_hybrid
    from rlhfkit.hybrid import _plan
    from rlhfkit.hybrid._plan import HEADROOM, check_plan

    trainers = {"actor": TrainerConfig(deepspeed=DeepSpeedEngineConfig(zero_stage=1, optimizer="torch_adamw")),
                "reference": TrainerConfig(deepspeed=DeepSpeedEngineConfig(zero_stage=0, optimizer="torch_adamw"))}
    cpu = HybridConfig(model=str(tiny_llama_path), device="cpu", engine="hf")
    assert not plan_hybrid(cpu, trainers, gpu_memory_gib=80.0, host_memory_gib=64.0).overlap_switches
    cuda = HybridConfig(model=str(tiny_llama_path), device="cuda", engine="hf")
    roomy = plan_hybrid(cuda, trainers, gpu_memory_gib=80.0, host_memory_gib=64.0)
    assert roomy.overlap_switches
    resident = dataclasses.replace(roomy, roles={role: dataclasses.replace(plan, offload=False)
                                                 for role, plan in roomy.roles.items()})
    peak = check_plan(cuda, trainers, resident.replace_engine(sleep_level=0)).peak()
    for gib, overlaps in ((peak * 1.01, False), (peak * HEADROOM * 1.01, True)):  # the headroom over the estimate
        facts = _plan._Facts(config=cuda, trainers=trainers, placement=_plan._placement(cuda, tuple(trainers)),
                             shapes=_plan._shapes(cuda, trainers, None), gpu_gib=gib, host_gib=64.0, cores=1)
        assert _plan._overlap_fits(facts, roomy.roles, roomy.engine) is overlaps


def _run(tiny_llama_path, overlap: bool, steps: int = 2, keep: bool = False) -> list[dict]:
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, make_experience
    from rlhfkit.hybrid import Hybrid, HybridConfig, TrainerConfig, plan_hybrid
    from rlhfkit.losses import policy_loss
    from rlhfkit.packing import pack_rollouts

    def loss_fn(logprobs, micro, *, num_tokens, num_seqs):
        return policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.batch.loss_mask,
                           micro.batch.cu_seqlens, num_tokens=num_tokens, num_seqs=num_seqs)

    deepspeed = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw", learning_rate=1e-3)
    config = HybridConfig(model=str(tiny_llama_path), device="cpu", engine="hf", call_timeout_s=120,
                          sync_timeout_s=60)
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed), "reference": TrainerConfig(deepspeed=deepspeed)}
    plan = plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None)
    plan = dataclasses.replace(plan, overlap_switches=overlap).replace_role("actor", keep_weights=keep,
                                                                             keep_optimizer=keep)
    hybrid = Hybrid.start(config, trainers, plan=plan)
    rows = []
    try:
        actor, reference = hybrid.trainers["actor"], hybrid.trainers["reference"]
        for step in range(steps):
            hybrid.timer.start_step()
            rollouts = hybrid.engines.generate([[5, 6, 7], [8, 9, 10, 11]],
                                               SamplingConfig(n=4, max_new_tokens=6, seed=step))
            ref = reference.forward(pack_rollouts(rollouts))
            experience, _ = make_experience(rollouts, torch.arange(len(rollouts), dtype=torch.float32) % 3,
                                            config=ExperienceConfig(estimator="grpo"),
                                            policy_logprobs_fn=lambda b, r=rollouts: engine_token_logprobs(r, b),
                                            ref_logprobs_fn=lambda b, ref=ref: ref)
            stats = actor.forward_backward(experience, loss_fn).metrics()
            stats |= actor.optim_step(sleep_after="keep_weights").metrics()
            stats |= hybrid.push_weights()
            rows.append(stats | hybrid.timer.end_step())
        events = [event for group in (actor, reference) for event in group.guard_events(settle=True)]
    finally:
        hybrid.close()
    rows[-1]["events"] = events
    return rows


@pytest.mark.slow
@pytest.mark.ray
def test_the_loop_with_overlapped_switches_trains_exactly_as_without(tiny_llama_path):
    pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    plain, overlapped = _run(tiny_llama_path, False), _run(tiny_llama_path, True)
    # the actor's optimizer states and weights stay through its sleeps
    kept = _run(tiny_llama_path, True, keep=True)
    for a, b, c in zip(plain, overlapped, kept, strict=True):
        assert a["actor/loss"] == b["actor/loss"] == c["actor/loss"]
        assert a["actor/grad_norm"] == b["actor/grad_norm"] == c["actor/grad_norm"]
        assert a["engine/weight_version"] == b["engine/weight_version"] == c["engine/weight_version"]
    # kept: the switches copied less each way
    assert 0 < kept[-1]["switch/bytes_h2d"] < overlapped[-1]["switch/bytes_h2d"]
    # (on CPU DeepSpeed's own states stay in its host buffers and are not counted: here only rlhfkit's copies of the
    # optimizer's states were, and those now stay)
    assert kept[-1]["switch/bytes_d2h"] < overlapped[-1]["switch/bytes_d2h"]
    assert "time/overlapped_sleep_s" not in plain[-1]
    assert overlapped[-1]["time/overlapped_sleep_s"] > 0 and overlapped[-1]["switch/bytes_d2h"] > 0
    # with or without overlap, the wakes copied the same bytes
    assert plain[-1]["switch/bytes_h2d"] == overlapped[-1]["switch/bytes_h2d"] > 0
    # every sleep still happens (in the background): as many as without overlap, per role and phase
    count = lambda rows: sorted((e["role"], e["action"], e["phase"]) for e in rows[-1]["events"])
    assert count(plain) == count(overlapped)
