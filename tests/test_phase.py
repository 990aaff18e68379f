"""Tests of rlhfkit.phase: the guard's rules with fake models, and the stores' atomicity across processes."""

from __future__ import annotations

import logging
import multiprocessing
import pickle

import pytest

from rlhfkit.phase import (
    FilePhaseStore,
    LocalPhaseStore,
    PhaseConflictError,
    PhaseGuard,
    PhaseStoreCorruptError,
    TCPPhaseStore,
    Transition,
    gpu_key,
)


class FakeModel:
    """Records every sleep/wake call (with kwargs) into a shared log."""

    def __init__(self, name: str, log: list, *, fail_wake: bool = False) -> None:
        self.name, self.log, self.fail_wake = name, log, fail_wake

    def wake_up(self, **kwargs) -> None:
        self.log.append((self.name, "wake_up", kwargs))
        if self.fail_wake:
            raise MemoryError(f"{self.name} could not wake")

    def sleep(self, **kwargs) -> None:
        self.log.append((self.name, "sleep", kwargs))


@pytest.fixture(params=["local", "file", "tcp"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalPhaseStore()
    if request.param == "file":
        return FilePhaseStore(tmp_path / "phase")
    return TCPPhaseStore.serve(timeout_s=10)


def test_store_claim_release_holder_rules(store):
    assert store.holder("g0") is None
    assert store.claim("g0", "actor") is None
    assert store.claim("g0", "actor") is None  # idempotent for the holder
    assert store.claim("g0", "critic") == "actor"
    assert store.claim("g1", "critic") is None  # another GPU is independent
    assert store.release("g0", "critic") is False  # not the holder
    assert store.holder("g0") == "actor"
    assert store.release("g0", "actor") is True
    assert store.release("g0", "actor") is False
    assert store.claim("g0", "critic") is None
    assert store.release("g0", None) is True  # force
    assert store.holder("g0") is None and store.holder("g1") == "critic"


def test_guard_refuses_second_awake_model_naming_both_roles_and_gpu(store):
    log: list = []
    actor, critic = FakeModel("actor", log), FakeModel("critic", log)
    guard = PhaseGuard(store, gpu="node0:3")
    guard.wake("actor", actor)
    with pytest.raises(RuntimeError) as error:
        guard.wake("critic", critic, phase="critic_train")
    message = str(error.value)
    assert "'critic'" in message and "'actor'" in message and "node0:3" in message and "critic_train" in message
    assert ("critic", "wake_up", {}) not in log  # the refused model was never touched
    guard.sleep("actor", actor, keep_weights=True)
    guard.wake("critic", critic)
    assert guard.awake_role() == "critic"
    assert log == [("actor", "wake_up", {}), ("actor", "sleep", {"keep_weights": True}),
                   ("critic", "wake_up", {})]


def test_store_swap_replaces_only_the_expected_claim(store):
    assert store.swap("g0", "actor", "critic") is False and store.holder("g0") is None  # nothing to replace
    store.claim("g0", "actor")
    assert store.swap("g0", "reference", "critic") is False and store.holder("g0") == "actor"
    assert store.swap("g0", "actor", "actor~") is True and store.holder("g0") == "actor~"
    assert store.claim("g0", "critic") == "actor~" and store.release("g0", "actor") is False
    assert store.release("g0", "actor~") is True and store.holder("g0") is None


def test_a_wake_displaces_a_role_marked_releasing_only_when_asked(store):
    """mark_releasing + wake(displace_releasing=True): the next role takes the GPU while the first one's sleep is
    still to come; that sleep then leaves the new claim alone. Without the flag, or without the mark, it is refused."""
    log: list = []
    reference, actor = FakeModel("reference", log), FakeModel("actor", log)
    guard = PhaseGuard(store, gpu="g0")
    guard.wake("reference", reference)
    with pytest.raises(PhaseConflictError, match="'reference' is awake there"):
        guard.wake("actor", actor, displace_releasing=True)  # not marked: still refused
    assert guard.mark_releasing("reference", reference) is True
    assert guard.awake_role() == "reference"
    with pytest.raises(PhaseConflictError, match="'reference' is going to sleep there"):
        guard.wake("actor", actor)  # marked, but the waker did not ask to displace
    transition = guard.wake("actor", actor, phase="train", displace_releasing=True)
    assert transition.displaced == "reference" and guard.awake_role() == "actor"
    guard.sleep("reference", reference)  # the displaced role's sleep: it must not release the actor's claim
    assert guard.awake_role() == "actor"
    assert guard.mark_releasing("reference", reference) is False  # holds nothing now
    with pytest.raises(PhaseConflictError, match="'actor' is awake there"):
        guard.wake("reference", reference, displace_releasing=True)
    guard.sleep("actor", actor)
    assert guard.awake_role() is None
    # marked, and its sleep done before anyone came: the claim is gone as usual
    guard.wake("reference", reference)
    assert guard.mark_releasing("reference", reference)
    guard.sleep("reference", reference)
    assert guard.awake_role() is None and guard.wake("actor", actor, displace_releasing=True).displaced is None
    assert [entry[:2] for entry in log] == [("reference", "wake_up"), ("actor", "wake_up"), ("reference", "sleep"),
                                            ("actor", "sleep"), ("reference", "wake_up"), ("reference", "sleep"),
                                            ("actor", "wake_up")]


def test_a_role_cannot_displace_its_own_releasing_claim_under_another_model():
    guard, log = PhaseGuard(LocalPhaseStore(), gpu="g0"), []
    first, second = FakeModel("a", log), FakeModel("b", log)
    guard.wake("actor", first)
    guard.mark_releasing("actor", first)
    with pytest.raises(PhaseConflictError, match="already awake there as another model"):
        guard.wake("actor", second, displace_releasing=True)


def test_guard_same_role_rewakes_with_kwargs_and_other_gpu_is_free():
    log: list = []
    engine, actor = FakeModel("rollout", log), FakeModel("actor", log)
    guard = PhaseGuard(gpu="g0")
    guard.wake("rollout", engine, tags=["weights"])
    guard.wake("rollout", engine, tags=["kv_cache"])  # staged wake of one model is fine
    guard.wake("actor", actor, gpu="g1")
    assert log[:2] == [("rollout", "wake_up", {"tags": ["weights"]}), ("rollout", "wake_up", {"tags": ["kv_cache"]})]
    assert guard.awake_role("g0") == "rollout" and guard.awake_role("g1") == "actor"


def test_guard_releases_claim_when_wake_fails():
    log: list = []
    guard = PhaseGuard(gpu="g0")
    with pytest.raises(MemoryError):
        guard.wake("actor", FakeModel("actor", log, fail_wake=True))
    assert guard.awake_role() is None
    guard.wake("critic", FakeModel("critic", log))
    assert guard.awake_role() == "critic"


def test_phase_context_sleeps_even_when_the_block_raises():
    log: list = []
    actor = FakeModel("actor", log)
    guard = PhaseGuard(gpu="g0")
    with guard.phase("train", "actor", actor, sleep_kwargs={"keep_weights": False}) as model:
        assert model is actor and guard.awake_role() == "actor"
    with pytest.raises(ValueError, match="boom"):
        with guard.phase("train", "actor", actor):
            raise ValueError("boom")
    assert guard.awake_role() is None
    assert [entry[1] for entry in log] == ["wake_up", "sleep", "wake_up", "sleep"]
    assert [t.action for t in guard.history] == ["wake", "sleep", "wake", "sleep"]
    assert all(t.phase == "train" for t in guard.history)


def test_sleeping_a_role_that_is_not_awake_is_allowed_and_does_not_release_others():
    log: list = []
    guard = PhaseGuard(gpu="g0")
    guard.wake("rollout", FakeModel("rollout", log))
    guard.sleep("actor", FakeModel("actor", log))  # e.g. deepening a keep-weights sleep
    assert guard.awake_role() == "rollout"
    assert log[-1] == ("actor", "sleep", {})


def test_transitions_log_memory_or_cuda_absence(caplog):
    guard = PhaseGuard(gpu="g0")
    with caplog.at_level(logging.INFO, logger="rlhfkit.phase"):
        transition = guard.wake("actor")
    assert isinstance(transition, Transition) and transition.role == "actor" and transition.gpu == "g0"
    import torch

    if torch.cuda.is_available():
        assert transition.allocated is not None and "allocated" in caplog.text and "free" in caplog.text
    else:
        assert transition.allocated is None and transition.free is None
        assert "no CUDA context in this process" in caplog.text


def test_guard_needs_a_gpu_and_a_role_and_can_force_release():
    guard = PhaseGuard()
    with pytest.raises(ValueError, match="gpu is not set"):
        guard.wake("actor")
    with pytest.raises(ValueError, match="role=''"):
        guard.wake("", gpu="g0")
    guard.wake("actor", gpu="g0")
    assert guard.force_release("g0") == "actor" and guard.awake_role("g0") is None
    assert gpu_key().count(":") == 1


def test_tcp_store_flags_open_a_gate_for_every_holder_and_bound_the_wait():
    """Hybrid.start's start gate: colocated engines build their models once the trainers raise the flag."""
    import threading

    server = TCPPhaseStore.serve(timeout_s=10)
    client = pickle.loads(pickle.dumps(server))  # what an engine actor receives
    waited = {}
    thread = threading.Thread(target=lambda: waited.setdefault("s", client.wait_flag("gate", timeout_s=10)))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # still waiting: nothing raised the flag
    server.set_flag("gate")
    thread.join(5)
    assert not thread.is_alive() and waited["s"] >= 0.3
    assert client.wait_flag("gate", timeout_s=0.1) >= 0  # raised once, open for every later wait
    with pytest.raises(TimeoutError, match="flag 'other'.*0.2 s"):
        client.wait_flag("other", timeout_s=0.2)
    # a flag may carry a value (the gated engines' settings): read by any holder once raised
    assert client.flag_value("gate") == "1" and client.flag_value("valued") is None
    server.set_flag("valued", '{"kv_cache_memory_bytes": 1024}')
    assert client.flag_value("valued") == '{"kv_cache_memory_bytes": 1024}'
    with pytest.raises(ValueError, match="set_flag\\('empty', value=''\\)"):
        server.set_flag("empty", "")


def test_tcp_store_rejects_bad_port():
    with pytest.raises(ValueError, match="port=70000"):
        TCPPhaseStore("127.0.0.1", 70000)


def _race(store, role, barrier, results):
    barrier.wait(timeout=30)
    results.put((role, store.claim("shared-gpu", role)))


@pytest.mark.parametrize("kind", ["file", "tcp"])
def test_cross_process_claims_are_atomic(kind, tmp_path):
    store = FilePhaseStore(tmp_path / "phase") if kind == "file" else TCPPhaseStore.serve(timeout_s=20)
    copy = pickle.loads(pickle.dumps(store))  # what a Ray actor or a spawned worker receives
    # spawn, not fork: a fork of the test process, where earlier tests started Ray (gRPC) and other threads, can
    # abort at exit (SIGABRT in CI once), and the store is shipped pickled either way
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(4), context.Queue()
    processes = [context.Process(target=_race, args=(copy, f"role{i}", barrier, results)) for i in range(4)]
    for process in processes:
        process.start()
    outcomes = dict(results.get(timeout=30) for _ in processes)
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0
    winners = [role for role, other in outcomes.items() if other is None]
    assert len(winners) == 1, outcomes
    assert all(other == winners[0] for role, other in outcomes.items() if role != winners[0])
    guard = PhaseGuard(store, gpu="shared-gpu")  # the parent sees the child's claim
    with pytest.raises(RuntimeError, match=f"'{winners[0]}' is awake there"):
        guard.wake("actor")
    assert guard.sleep(winners[0]).action == "sleep"  # any process may release on the holder's behalf
    guard.wake("actor")
    assert guard.awake_role("shared-gpu") == "actor" and copy.holder("shared-gpu").startswith("actor")


def test_same_role_name_for_two_models_on_one_gpu_is_refused(store):
    """Review defect 7: two guards (sharing a store) with the same role name for two different models on one GPU
    both woke; the claim now belongs to the model too, and the error names both models and the GPU."""
    log: list = []
    first, second = FakeModel("policy-a", log), FakeModel("policy-b", log)
    guard_a, guard_b = PhaseGuard(store, gpu="g0"), PhaseGuard(store, gpu="g0")
    guard_a.wake("actor", first)
    guard_a.wake("actor", first, tags=["kv_cache"])  # the same model re-waking stays fine
    with pytest.raises(PhaseConflictError, match=r"cannot wake 'actor' \(FakeModel object 0x[0-9a-f]+ in pid \d+ .*"
                                                 r"on GPU g0: role 'actor' is already awake there as another model "
                                                 r"\(FakeModel object 0x[0-9a-f]+ in pid"):
        guard_b.wake("actor", second)
    assert ("policy-b", "wake_up", {}) not in log  # the refused model was never touched
    guard_b.sleep("actor", second)  # the other model's sleep does not release the first model's claim
    assert guard_a.awake_role() == "actor"
    with pytest.raises(PhaseConflictError):
        guard_b.wake("actor", second)
    guard_a.sleep("actor", first)
    guard_b.wake("actor", second)
    assert guard_b.awake_role() == "actor"
    with pytest.raises(PhaseConflictError, match=r"'critic' on GPU g0: 'actor' is awake there \(FakeModel object"):
        guard_a.wake("critic", FakeModel("critic", log))


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b'["actor"]', b'{"g0": 3}'])
def test_corrupt_file_store_names_the_file_and_the_fix(tmp_path, content):
    """Review defect 8: a corrupt FilePhaseStore file raised a bare JSONDecodeError without naming the file."""
    store = FilePhaseStore(tmp_path / "phase")
    (tmp_path / "phase" / "phase.json").write_bytes(content)
    path = str(tmp_path / "phase" / "phase.json")
    for call in (lambda: store.claim("g0", "actor"), lambda: store.holder("g0"), lambda: store.release("g0", None)):
        with pytest.raises(PhaseStoreCorruptError, match=f"phase store file {path} .*delete {path}"):
            call()
    (tmp_path / "phase" / "phase.json").unlink()  # the fix the message gives
    assert store.claim("g0", "actor") is None and store.holder("g0") == "actor"
