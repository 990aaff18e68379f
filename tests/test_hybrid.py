"""rlhfkit.hybrid's blocks on CPU: a real Hybrid run (Ray with one logical GPU, rlhfkit's HF engine, DeepSpeed ZeRO-1
actor and reference on CPU, gloo push) driven primitive by primitive, its errors, and the timer, metrics and options
that need no cluster."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch

from rlhfkit.hybrid import EnginesBusyError, LossFunctionError, MetricsLogger, PhaseTimer, RoleAsleepError
from rlhfkit.options import parse_options


# ------------------------------------------------------------------------------------------------ no cluster
def _call(*costs, method: str = "forward", phase: str = "train"):
    from rlhfkit.hybrid import CallCost, CallRecord

    return CallRecord(role="actor", method=method, phase=phase, seconds=0.1,
                      costs=tuple(CallCost(**cost) for cost in costs))


def test_phase_timer_moves_the_calls_switch_time_to_sleep_wake():
    """A call's switch seconds (its slowest rank's: ranks switch in parallel) move from the phase running to
    sleep_wake; outside any phase they count as sleep_wake; background sleeps are apart from the switch time."""
    timer = PhaseTimer()
    timer.start_step()
    with timer.phase("train"):
        time.sleep(0.05)
        timer.observe_call(_call({"switch_s": 0.02, "peak_gib": 1.5}, {"switch_s": 0.01, "peak_gib": 2.0}))
    timer.observe_call(_call({"switch_s": 0.005}, method="sleep"))  # outside any phase
    timer.observe_call(_call({"background_s": 0.3}, method="sleep"))
    with timer.phase("weight_sync"):
        time.sleep(0.01)
    row = timer.end_step()
    assert row["time/train_s"] == pytest.approx(0.03, abs=0.015)
    assert row["time/sleep_wake_s"] == pytest.approx(0.025, abs=1e-9)
    assert row["time/phase_switch_s"] == pytest.approx(row["time/sleep_wake_s"] + row["time/weight_sync_s"])
    assert 0 < row["time/phase_switch_fraction"] < 1
    assert row["time/overlapped_sleep_s"] == 0.3 and row["mem/train_allocated_peak_gib"] == 2.0
    assert not [key for key in row if key.startswith("worker/")]
    with pytest.raises(RuntimeError, match="do not nest"), timer.phase("a"), timer.phase("b"):
        pass


def test_phase_timer_reports_switch_bytes_and_their_copy_floor():
    """Issue 18 item 2: the calls' bytes (their largest rank's) and count_sync_bytes add up per step; with measured
    copy rates the step reports floor_s = d2h / d2h rate + h2d / h2d rate + sync / d2d rate and over_floor = switch /
    floor."""
    from rlhfkit.hybrid import CallCost, CopyRates

    timer = PhaseTimer()
    timer.observe_call(_call({"switch_s": 0.5, "bytes_d2h": 10e9}))  # before the step: not counted
    timer.start_step()
    with timer.phase("train"):
        time.sleep(0.02)
        timer.observe_call(_call({"switch_s": 0.01, "bytes_d2h": 2e9, "bytes_h2d": 1e9}, {"bytes_d2h": 1e9}))
    timer.observe_call(_call({"bytes_h2d": 3e9}))
    with timer.phase("weight_sync"):
        timer.count_sync_bytes(4e9)
    row = timer.end_step()
    assert (row["switch/bytes_d2h"], row["switch/bytes_h2d"], row["switch/bytes_sync"]) == (2e9, 4e9, 4e9)
    assert "switch/floor_s" not in row and "switch/over_floor" not in row  # no rates, no floor
    assert "switch/bytes_kept" not in row  # nothing freed without a copy: no column

    timer.copy_rates = CopyRates(h2d_bytes_per_s=50e9, d2h_bytes_per_s=40e9, d2d_bytes_per_s=1000e9, num_bytes=1,
                                 device="cuda:0")
    timer.start_step()
    timer.observe_call(_call({"switch_s": 0.3, "bytes_d2h": 2e9, "bytes_h2d": 4e9, "bytes_kept": 1e9}))
    timer.count_sync_bytes(4e9)
    row = timer.end_step()
    assert row["switch/bytes_kept"] == 1e9  # kept bytes are not in the floor
    floor = 2e9 / 40e9 + 4e9 / 50e9 + 4e9 / 1000e9
    assert row["switch/floor_s"] == pytest.approx(floor)
    assert row["switch/over_floor"] == pytest.approx(row["time/phase_switch_s"] / floor)
    assert row["switch/h2d_gb_per_s"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="CallCost.bytes_d2h=-1"):
        CallCost(switch_s=0.1, bytes_d2h=-1)
    with pytest.raises(ValueError, match="count_sync_bytes"):
        timer.count_sync_bytes(-1.0)
    with pytest.raises(ValueError, match="d2h_bytes_per_s=0"):
        CopyRates(h2d_bytes_per_s=1.0, d2h_bytes_per_s=0, d2d_bytes_per_s=1.0, num_bytes=1, device="cuda:0")


def test_measure_copy_rates_is_none_without_a_cuda_device_and_checks_its_arguments():
    """Issue 18 item 2: on CPU there is no device copy to bound (None, not a made-up rate); bad sizes are refused."""
    from rlhfkit.hybrid import measure_copy_rates

    assert measure_copy_rates("cpu") is None
    if not torch.cuda.is_available():
        assert measure_copy_rates() is None
    with pytest.raises(ValueError, match="num_bytes=0"):
        measure_copy_rates("cpu", num_bytes=0)
    with pytest.raises(ValueError, match="repeats=0"):
        measure_copy_rates("cpu", repeats=0)


class StandInRanks:
    """Two ranks of a trainer role in this process: answer each call as a TrainerWorker would, and log it."""

    role, world_size = "actor", 2

    def __init__(self) -> None:
        from rlhfkit.hybrid import CallCost

        self.calls: list[tuple[str, dict]] = []
        self.cost = CallCost(switch_s=0.01, bytes_h2d=4.0)

    def call(self, method: str, *args, **kwargs) -> list:
        from rlhfkit.hybrid import OptimStepResult
        from rlhfkit.hybrid._results import WorkerReply

        self.calls.append((method, kwargs))
        if method == "optim_step":
            value = OptimStepResult(role="actor", lr=1e-3, grad_norm=0.5, global_step=len(self.calls))
            return [WorkerReply(value=value, cost=self.cost)] * self.world_size
        if method == "forward":
            raise RuntimeError("RoleAsleepError: the rank is asleep")
        return [WorkerReply(cost=self.cost)] * self.world_size

    call_scattered = call


def test_a_trainer_group_records_what_its_calls_leave_on_the_gpu_and_shows_their_costs():
    """The driver's record decides which sleeps and wakes a call carries; each call's costs reach the observer in
    one typed record; the actor's weight version is the last pushed one, plus one once it has stepped since."""
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
    from rlhfkit.hybrid import RolePlan, TrainerConfig, TrainerGroup

    ranks, records = StandInRanks(), []
    observer = type("Observer", (), {"observe_call": lambda self, record: records.append(record)})()
    group = TrainerGroup(ranks, TrainerConfig(deepspeed=DeepSpeedEngineConfig()), RolePlan(zero_stage=0),
                         observer=observer)
    group.sleep()  # load() left the ranks asleep: no call
    assert ranks.calls == [] and group.weight_version == 0
    group.wake()
    group.wake()  # the ranks are told to wake; they wake only if asleep
    step = group.optim_step(sleep_after="keep_weights")
    assert (step.lr, step.grad_norm) == (1e-3, 0.5) and step.metrics()["actor/grad_norm"] == 0.5
    group.optim_step(sleep_after="keep_weights")
    assert group.weight_version == 1  # two steps, one version ahead of the engines
    group.sleep(keep_weights=True)  # already asleep but for the weights: no call
    group.sleep()  # the weights go
    group.sleep()
    assert [method for method, _ in ranks.calls] == ["wake", "wake", "optim_step", "optim_step", "sleep"]
    assert ranks.calls[-1][1] == {"keep_weights": False, "phase": "sleep"}
    group.weights_pushed(1)
    assert group.weight_version == 1
    group.optim_step()
    assert group.weight_version == 2
    with pytest.raises(RuntimeError, match="RoleAsleepError"):  # a failed call: what the ranks hold is unknown
        group.forward(_packed(), wake=False)
    group.sleep()
    assert [method for method, _ in ranks.calls][-2:] == ["forward", "sleep"]
    assert [record.method for record in records] == ["wake", "wake", "optim_step", "optim_step", "sleep",
                                                      "optim_step", "sleep"]
    assert records[0].role == "actor" and records[0].costs == (ranks.cost, ranks.cost)


def _packed():
    from rlhfkit.packing import pack_sequences

    return pack_sequences([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_copy_rates_on_a_gpu():
    from rlhfkit.hybrid import measure_copy_rates

    rates = measure_copy_rates(num_bytes=64 * 1024**2, repeats=2)
    assert rates is not None and rates.device.startswith("cuda")
    assert 1e9 < rates.h2d_bytes_per_s < 1e12 and 1e9 < rates.d2h_bytes_per_s < 1e12  # PCIe/NVLink-C2C range


def test_a_colocated_engine_builds_its_model_only_after_the_start_gate(tiny_llama_path):
    """Hybrid.start loads the trainers first and then raises the gate; an engine actor waits for it before building
    its model (vLLM then profiles memory on a GPU nobody is filling), bounded by its timeout."""
    from rlhfkit.hybrid._engines import HFEngineActor
    from rlhfkit.phase import TCPPhaseStore

    store = TCPPhaseStore.serve(timeout_s=10)
    built = {}

    def build():
        built["actor"] = HFEngineActor(str(tiny_llama_path), engine_index=0, seed=0, device="cpu", guard_store=store,
                                       gpus=["node0/gpu0"], start_gate="trainers-loaded", gate_timeout_s=30)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and "actor" not in built
    store.set_flag("trainers-loaded")
    thread.join(60)
    assert built["actor"].ready()["engine_index"] == 0
    with pytest.raises(TimeoutError, match="never-raised"):
        HFEngineActor(str(tiny_llama_path), engine_index=0, seed=0, device="cpu", guard_store=store,
                      gpus=["node0/gpu0"], start_gate="never-raised", gate_timeout_s=0.2)


def test_metrics_logger_writes_numbers_only(tmp_path):
    before = time.time()
    with MetricsLogger(tmp_path) as metrics:
        row = metrics.log(3, {"loss": torch.tensor(1.0).item(), "flag": True, "name": "x", "n": 2})
    assert row == {"step": 3.0, "loss": 1.0, "n": 2.0}
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert before <= line.pop("timestamp") <= time.time()  # the file also says when (launch -> first step timing)
    assert line == row


def test_metrics_logger_names_the_extra_for_wandb(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match=r"pip install 'rlhfkit\[wandb\]'"):
        MetricsLogger(tmp_path, wandb_project="p")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Options:
    model: str | None = None
    steps: int = 3
    lr: float = 1e-3
    resident: bool = False


def test_parse_options_types_defaults_and_errors(capsys):
    assert parse_options(_Options, []) == _Options()
    parsed = parse_options(_Options, ["--model", "m", "--steps", "7", "--lr", "0.5", "--resident", "yes"])
    assert parsed == _Options(model="m", steps=7, lr=0.5, resident=True)
    assert parse_options(_Options, ["--model", "none"]).model is None
    for argv, message in ((["--steps", "x"], "--steps"), (["--resident", "maybe"], "expected true or false")):
        with pytest.raises(SystemExit):
            parse_options(_Options, argv)
        assert message in capsys.readouterr().err


def test_phase_conflicts_in_a_hybrid_run_name_the_hybrid_calls():
    """Issue 50 item 12: the hybrid's guards tell the user to call the hybrid's API, not the guard's."""
    from rlhfkit.hybrid._errors import sleep_hint
    from rlhfkit.phase import LocalPhaseStore, PhaseConflictError, PhaseGuard

    guard = PhaseGuard(LocalPhaseStore(), gpu="node0/gpu0", sleep_hint=sleep_hint)
    guard.wake("rollout")
    with pytest.raises(PhaseConflictError, match=r"put 'rollout' to sleep first \(hybrid\.engines\.sleep\(\)\)"):
        guard.wake("actor")
    guard.sleep("rollout")
    guard.wake("actor")
    with pytest.raises(PhaseConflictError, match=r"\(hybrid\.trainers\['actor'\]\.sleep\(\)\)"):
        guard.wake("rollout")
    plain = PhaseGuard(guard.store, gpu="node0/gpu0")  # outside a hybrid run: the guard's own call
    with pytest.raises(PhaseConflictError, match=r"\(guard\.sleep\('actor', \.\.\.\)\)"):
        plain.wake("critic")


_MISSING_EXTRA_SCRIPT = """
import json, sys
import torch
missing, model, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
sys.modules[missing] = None  # importing it now fails as if it were not installed
from rlhfkit.deepspeed_engine import DeepSpeedEngine, DeepSpeedEngineConfig
from rlhfkit.hybrid import Hybrid, HybridConfig, TrainerConfig
from rlhfkit.workers import ray_init
deepspeed = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw")
calls = {
    "Hybrid.start": lambda: Hybrid.start(HybridConfig(model=model, device="cpu", engine="hf"),
                                         {"actor": TrainerConfig(deepspeed=deepspeed)}),
    "DeepSpeedEngine": lambda: DeepSpeedEngine(torch.nn.Linear(2, 2), role="actor", config=deepspeed),
    "ray_init": ray_init,
}
out = {}
for name in names:
    try:
        calls[name]()
        out[name] = "no error"
    except ImportError as error:
        out[name] = str(error)
    except Exception as error:
        out[name] = f"{type(error).__name__}: {error}"
out["ray started"] = "ray" in sys.modules and sys.modules["ray"] is not None and sys.modules["ray"].is_initialized()
print(json.dumps(out))
"""


def test_a_missing_extra_names_the_pip_install(tiny_llama_path):
    """Issue 50 item 14: without Ray or DeepSpeed, the entry points raise an ImportError naming the extra to
    install, before anything starts."""
    import subprocess
    import sys

    for missing, entry_points in (("ray", ("Hybrid.start", "ray_init")),
                                  ("deepspeed", ("Hybrid.start", "DeepSpeedEngine"))):
        done = subprocess.run([sys.executable, "-c", _MISSING_EXTRA_SCRIPT, missing, str(tiny_llama_path),
                               ",".join(entry_points)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        for name in entry_points:
            assert f"pip install 'rlhfkit[{missing}]'" in out[name], (missing, name, out[name])
        assert not out["ray started"], out


# ------------------------------------------------------------------------------------------------ a real run
@pytest.fixture(scope="module")
def hybrid(tiny_llama_path, tmp_path_factory, shared_ray_address):
    ray = pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
    from rlhfkit.hybrid import Hybrid, HybridConfig, HybridPlan, TrainerConfig, plan_hybrid

    if ray.is_initialized():
        ray.shutdown()
    deepspeed = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw", learning_rate=1e-3)
    # the run joins the session's cluster; its close leaves it (the cluster frees the run's actors and groups)
    config = HybridConfig(model=str(tiny_llama_path), device="cpu", engine="hf", call_timeout_s=120,
                          sync_timeout_s=60, ray_address=shared_ray_address)
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed), "reference": TrainerConfig(deepspeed=deepspeed)}
    # engine sleep level 1 keeps its weights: the error tests generate again without pushing weights
    plan = plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None).replace_engine(sleep_level=1)
    run = Hybrid.start(config, trainers, plan=plan)
    # the run executes the plan it was given and keeps the user's configs as they are
    assert run.config is config and run.plan is plan and isinstance(run.plan, HybridPlan)
    assert all(run.trainers[role].plan is plan.roles[role] for role in trainers)
    assert run.engines.sleep_level == 1
    yield run
    run.close()


def _experience(hybrid, step: int = 0):
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.experience import ExperienceConfig, engine_token_logprobs, make_experience
    from rlhfkit.packing import pack_rollouts

    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    rollouts = hybrid.engines.generate(prompts, SamplingConfig(n=4, max_new_tokens=6, seed=step))
    batch = pack_rollouts(rollouts)
    ref = hybrid.trainers["reference"].forward(batch)
    scores = torch.arange(len(rollouts), dtype=torch.float32) % 3
    experience, _ = make_experience(rollouts, scores, config=ExperienceConfig(estimator="grpo"),
                                    policy_logprobs_fn=lambda b: engine_token_logprobs(rollouts, b),
                                    ref_logprobs_fn=lambda b: ref)
    return experience


def pg_loss(logprobs, micro, *, num_tokens, num_seqs):
    from rlhfkit.losses import policy_loss

    return policy_loss(logprobs, micro.old_logprobs, micro.advantages, micro.batch.loss_mask, micro.batch.cu_seqlens,
                       num_tokens=num_tokens, num_seqs=num_seqs)


def vector_loss(logprobs, micro, *, num_tokens, num_seqs):
    return logprobs * 2  # not a scalar


def nan_loss(logprobs, micro, *, num_tokens, num_seqs):
    return logprobs.sum() * float("nan")


def bad_stats_loss(logprobs, micro, *, num_tokens, num_seqs):
    return logprobs.sum(), {"ratio": logprobs.detach()}  # a per-token tensor is no stat


def tensor_stats_loss(logprobs, micro, *, num_tokens, num_seqs):
    loss, _ = pg_loss(logprobs, micro, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"as_tensor": logprobs.new_tensor(2.0), "as_float": 3.0}


def crashing_loss(logprobs, micro, *, num_tokens, num_seqs):
    raise KeyError("the user's loss has a bug")


def zero_loss(logprobs, micro, *, num_tokens, num_seqs):
    return logprobs.sum() * 0.0  # trains on nothing: the step's gradient norm is that of what else is there


class FailsAfterFirstMicroBatch:
    """pg_loss on the first micro-batch a worker gives it (its backward runs), NaN on the next."""

    def __init__(self):
        self.calls = 0

    def __call__(self, logprobs, micro, *, num_tokens, num_seqs):
        self.calls += 1
        loss, stats = pg_loss(logprobs, micro, num_tokens=num_tokens, num_seqs=num_seqs)
        return (loss if self.calls == 1 else loss * float("nan")), stats


@pytest.mark.slow
@pytest.mark.ray
def test_primitives_train_push_and_match_the_engine(hybrid):
    startup = hybrid.startup  # the timed parts, and outside them the checks and the time before start()
    assert {"total_s", "ray_s", "processes_s", "models_s", "checks_s", "before_start_s"} <= set(startup)
    assert 0 < startup["ray_s"] < startup["total_s"] and startup["checks_s"] > 0 and startup["before_start_s"] > 0
    for who in ("actor", "reference"):  # where each process's start went (the slowest rank)
        parts = {name: startup[f"{who}/{name}"] for name in ("process_s", "import_s", "read_s", "load_claim_s",
                                                              "load_copy_rates_s", "load_model_s", "load_sleep_s")}
        assert parts["process_s"] > 0 and parts["import_s"] > 0 and parts["read_s"] > 0, (who, parts)
        assert parts["load_model_s"] > 0, (who, parts)
        assert sum(parts.values()) - parts["process_s"] < startup["total_s"], (who, parts)
    engine = {name: startup[f"engine/{name}"] for name in ("process_s", "import_s", "gate_wait_s", "build_s")}
    assert engine["build_s"] > 0 and all(seconds >= 0 for seconds in engine.values()), engine
    actor = hybrid.trainers["actor"]
    experience = _experience(hybrid)
    trained = actor.forward(experience.batch, sleep_after=False)  # the same weights the engine sampled with
    mask = experience.batch.loss_mask
    assert (trained[mask] - experience.old_logprobs[mask]).abs().max() < 1e-4
    trained_on = actor.forward_backward(experience, pg_loss)
    assert trained_on.num_tokens == int(mask.sum()) and trained_on.num_seqs == experience.batch.num_seqs
    assert trained_on.metrics()["actor/loss"] == trained_on.loss != 0
    version = actor.weight_version
    step = actor.optim_step(sleep_after="keep_weights")
    assert step.grad_norm > 0 and step.global_step >= 1 and step.role == "actor"
    assert actor.weight_version == hybrid.actor_version() == version + 1  # ahead of the engines until the push
    before = hybrid.engines.weight_versions()
    pushed = hybrid.push_weights()
    assert pushed["engine/weight_version"] == before[0] + 1 == actor.weight_version
    with pytest.raises(Exception, match="'rollout' is awake there"):  # the push left the engines awake
        actor.forward(experience.batch)
    hybrid.engines.sleep(level=1)  # level 1 keeps the engine's weights: later tests generate without a push
    after = actor.forward(experience.batch)  # new weights: log-probs moved
    assert (after[mask] - trained[mask]).abs().max() > 1e-6


@pytest.mark.slow
@pytest.mark.ray
def test_trainer_sleeps_and_wakes_report_the_bytes_they_copied(hybrid, tiny_llama_path):
    """Issue 18 item 1: each step's row carries the bytes its trainer sleeps copied off the device and its wakes
    brought back. A reference (no optimizer) copies its parameters off the device at its first sleep only (they do
    not train: the pinned copy keeps them) and back at every wake (after its first cycle as slots of one buffer, each
    slot rounded up to 512 bytes); a full-parameter actor after an optimizer step moves at least its parameters (its
    Adam states alone are twice that) each way; a wake brings back what the sleeps before it took off."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_path), dtype=torch.float32)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    padding = 512 * len(list(model.parameters()))  # StorageOffloader.ALIGN per slot, at most
    timer, actor = hybrid.timer, hybrid.trainers["actor"]
    experience = _experience(hybrid)  # the engines generated and went back to sleep

    timer.start_step()
    with timer.phase("forward_reference"):
        hybrid.trainers["reference"].forward(experience.batch)  # wake, forward, sleep
    row = timer.end_step()
    # the reference slept and woke before (start-up, earlier tests): its weights do not train, so the pinned copy of
    # that sleep still holds them and this sleep copies nothing; its wake copies them back
    assert row["switch/bytes_d2h"] == 0 and row["switch/bytes_kept"] == row["switch/bytes_h2d"], row
    assert param_bytes <= row["switch/bytes_h2d"] < param_bytes + padding, row
    assert "switch/floor_s" not in row  # CPU: no copy rates, no floor

    actor.forward_backward(experience, pg_loss)
    actor.optim_step(sleep_after=True)
    timer.start_step()
    actor.wake()
    actor.sleep()
    first = timer.end_step()
    timer.start_step()
    actor.wake()
    actor.sleep()
    second = timer.end_step()
    assert first["switch/bytes_d2h"] >= 2 * param_bytes, first  # Adam's exp_avg and exp_avg_sq at least
    assert second["switch/bytes_h2d"] == first["switch/bytes_d2h"], (first, second)
    assert second["switch/bytes_d2h"] == first["switch/bytes_d2h"], (first, second)  # the same states each cycle
    actor.wake()
    actor.sleep(keep_weights=True)
    hybrid.push_weights()  # the step above moved the actor a version ahead: later tests generate without a push
    hybrid.engines.sleep(level=1)


@pytest.mark.slow
@pytest.mark.ray
def test_a_sleep_that_would_do_nothing_makes_no_call(hybrid, monkeypatch):
    """The driver records what each call leaves on the ranks' GPUs, so a sleep the ranks would ignore (the push's
    sleep(keep_weights=True) right after optim_step(sleep_after="keep_weights")) costs no round trip; a sleep that
    moves something, or one after a failed call (whose outcome is unknown), is still made."""
    from rlhfkit.workers import WorkerError

    actor, experience = hybrid.trainers["actor"], _experience(hybrid, step=3)
    calls = []
    real = actor.workers.call
    monkeypatch.setattr(actor.workers, "call", lambda method, *a, **k: (calls.append(method), real(method, *a, **k))[1])
    actor.forward_backward(experience, pg_loss)
    actor.optim_step(sleep_after="keep_weights")
    actor.sleep(keep_weights=True)  # asleep but for the weights already: skipped
    assert calls == ["optim_step"], calls
    actor.sleep()  # the weights go too: made
    actor.sleep()  # asleep already: skipped
    actor.sleep(keep_weights=True)  # nothing would come back: skipped
    assert calls == ["optim_step", "sleep"], calls
    with pytest.raises(WorkerError, match="RoleAsleepError"):  # a failed call: the next sleep is made
        actor.forward(experience.batch, wake=False)
    actor.sleep()
    assert calls == ["optim_step", "sleep", "sleep"], calls
    actor.wake()
    actor.sleep(keep_weights=True)
    hybrid.push_weights()  # the step moved the actor a version ahead: later tests generate without a push
    hybrid.engines.sleep(level=1)


@pytest.mark.slow
@pytest.mark.ray
def test_loss_stats_may_be_tensors_read_once_per_call(hybrid):
    """A loss may return its stats as one-element tensors: the worker reads them all in one wait at the end of the
    call (a float() per stat would wait for each micro-batch's backward), averaged over the micro-batches like
    floats."""
    actor = hybrid.trainers["actor"]
    stats = actor.forward_backward(_experience(hybrid, step=2), tensor_stats_loss).stats
    assert stats["as_tensor"] == pytest.approx(2.0) and stats["as_float"] == pytest.approx(3.0)
    actor.optim_step(sleep_after="keep_weights")
    hybrid.push_weights()  # the step moved the actor a version ahead: later tests generate without a push
    hybrid.engines.sleep(level=1)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("loss, match", [(vector_loss, r"returned \(\d+,\)"), (nan_loss, "returned nan"),
                                         (bad_stats_loss, r"returned stats\['ratio'\] = \(\d+,\)")])
def test_bad_loss_functions_name_role_rank_and_phase_and_leave_nothing_awake(hybrid, loss, match):
    from rlhfkit.workers import WorkerError

    experience = _experience(hybrid, step=1)
    with pytest.raises(WorkerError, match=match) as raised:
        hybrid.trainers["actor"].forward_backward(experience, loss)
    text = str(raised.value)
    assert "LossFunctionError" in text and "'actor' rank 0, phase 'train_actor', micro-batch 0" in text
    assert isinstance(raised.value.__cause__, LossFunctionError) or "LossFunctionError" in text
    hybrid.trainers["reference"].forward(experience.batch)  # the actor was put back to sleep: the GPU is free


@pytest.mark.slow
@pytest.mark.ray
def test_a_crash_inside_a_call_names_the_role_and_rank_and_releases_the_gpu(hybrid):
    from rlhfkit.workers import WorkerError

    experience = _experience(hybrid, step=2)
    with pytest.raises(WorkerError, match=r"role 'actor' rank 0 raised in 'forward_backward': KeyError"):
        hybrid.trainers["actor"].forward_backward(experience, crashing_loss)
    hybrid.trainers["reference"].forward(experience.batch)


@pytest.mark.slow
@pytest.mark.ray
def test_primitives_on_a_sleeping_role_are_refused(hybrid):
    from rlhfkit.workers import WorkerError

    experience = _experience(hybrid, step=3)
    actor = hybrid.trainers["actor"]
    with pytest.raises(WorkerError, match="RoleAsleepError: forward\\(\\) called while 'actor' rank 0 is asleep"):
        actor.forward(experience.batch, wake=False)
    with pytest.raises(WorkerError, match="optim_step\\(\\) on 'actor' rank 0 with no forward_backward"):
        actor.optim_step()
    assert issubclass(RoleAsleepError, RuntimeError)


@pytest.mark.slow
@pytest.mark.ray
def test_generating_with_weights_the_actor_moved_past_is_refused(hybrid):
    """Forgetting push_weights: the rollouts would come from weights one version behind the actor's."""
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.protocol import WeightLagError

    actor, engines = hybrid.trainers["actor"], hybrid.engines
    experience = _experience(hybrid, step=4)  # on-policy: the engines hold the actor's weights
    actor.forward_backward(experience, pg_loss)
    actor.optim_step(sleep_after="keep_weights")
    version = hybrid.actor_version()
    with pytest.raises(WeightLagError, match=f"trainer.*{version}"):
        engines.generate([[5, 6, 7]], SamplingConfig(n=2, max_new_tokens=2))
    hybrid.push_weights()
    rollouts = engines.generate([[5, 6, 7]], SamplingConfig(n=2, max_new_tokens=2))
    assert {r.weight_version for r in rollouts} == {version}


@pytest.mark.slow
@pytest.mark.ray
def test_hf_engine_actors_seed_each_prompt_by_its_global_index(hybrid):
    """The group sends each engine its share of a batch with the prompts' global indices; the HF engine actor seeds
    by them, so a share samples what the whole batch did (engines of a group would otherwise share noise streams)."""
    import ray

    from rlhfkit.engines import SamplingConfig

    prompts, sampling = [[5, 6, 7], [8, 9, 10, 11], [12, 13]], SamplingConfig(n=2, max_new_tokens=4, seed=3)
    engines = hybrid.engines
    whole = engines.generate(prompts, sampling)  # the engine sleeps after it (it shares the GPU with the trainers)
    engines.wake()
    try:
        share = ray.get(engines.handles[0].generate.remote(prompts[1:], sampling, [1, 2]), timeout=120)
    finally:
        engines.sleep()
    assert [r.prompt_index for r in share] == [1, 1, 2, 2]
    assert [r.response_token_ids.tolist() for r in share] == [r.response_token_ids.tolist() for r in whole[2:]]


@pytest.mark.slow
@pytest.mark.ray
def test_pushing_weights_while_the_engines_generate_is_refused(hybrid):
    from rlhfkit.engines import SamplingConfig

    engines = hybrid.engines
    release = threading.Event()
    original = engines.group.generate

    def slow_generate(*args, **kwargs):
        release.wait(30)
        return original(*args, **kwargs)

    engines.group.generate = slow_generate
    worker = threading.Thread(target=engines.generate, args=([[5, 6, 7]], SamplingConfig(n=2, max_new_tokens=2)))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not engines.generating and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(EnginesBusyError, match="the engines are generating"):
            hybrid.push_weights()
    finally:
        release.set()
        worker.join(60)
        engines.group.generate = original


# --- overlap mode (asynchronous rollouts): config and the in-flight update's ordering, without a cluster ------------
def test_overlap_config_names_what_it_needs():
    from rlhfkit.hybrid import HybridConfig

    with pytest.raises(ValueError, match="max_weight_lag=0"):
        HybridConfig(model="m", overlap=True)
    assert HybridConfig(model="m", overlap=True, max_weight_lag=1).overlap  # the plan keeps the engines resident


class _Group:
    """An engine group stand-in that records the order of generate, pause and resume calls."""

    def __init__(self, generate_s):
        self.events, self.generate_s = [], generate_s

    def generate(self, prompts, sampling, trainer_version=None):
        self.events.append("generate start")
        time.sleep(self.generate_s)
        self.events.append("generate end")
        return []

    def call(self, method, *args, timeout_s=None):
        self.events.append(method)
        return [0]


@pytest.mark.parametrize("pausable", [True, False])
def test_an_in_flight_update_pauses_or_drains_and_holds_new_generates(pausable):
    """Issue 21 item 2: pausable engines are paused around the push; others finish the call in flight first. A
    generate that arrives during the push starts after it."""
    from rlhfkit.hybrid import RolloutEngines

    group = _Group(generate_s=0.3)
    engines = RolloutEngines(group, [], colocated=True, sleep_level=0, overlap=True, pausable=pausable,
                             update_timeout_s=10)
    first = threading.Thread(target=engines.generate, args=([[1]], None))
    first.start()
    time.sleep(0.1)
    with engines.in_flight_update():
        group.events.append("push")
        second = threading.Thread(target=engines.generate, args=([[2]], None))
        second.start()
        time.sleep(0.4)
        group.events.append("push end")
    first.join(10)
    second.join(10)
    if pausable:  # the engine parks the running call itself; the driver only brackets the push
        assert group.events[:3] == ["generate start", "pause_generation", "push"]
        assert group.events.index("resume_generation") < group.events.index("generate start", 1)
    else:
        assert group.events[:3] == ["generate start", "generate end", "push"]
    assert group.events.index("push end") < group.events.index("generate start", 1)


def test_a_drain_that_does_not_end_is_bounded_and_names_it():
    from rlhfkit.hybrid import RolloutEngines

    engines = RolloutEngines(_Group(generate_s=2.0), [], colocated=True, sleep_level=0, overlap=True,
                             pausable=False, update_timeout_s=0.2)
    worker = threading.Thread(target=engines.generate, args=([[1]], None))
    worker.start()
    time.sleep(0.1)
    with pytest.raises(EnginesBusyError, match="1 generate call"):
        with engines.in_flight_update():
            pass
    worker.join(10)
    with engines.in_flight_update():  # the failed update did not leave the engines blocked
        pass


def test_hybrid_config_accepts_sglang_on_cuda_only():
    """engine='sglang' (issue 23): accepted on CUDA with its interpreter and site directory; refused on CPU."""
    from rlhfkit.hybrid import HybridConfig

    config = HybridConfig(model="m", engine="sglang", sglang_python="/opt/sglang/bin/python",
                          sglang_site="/tmp/site/sglang")
    assert config.engine == "sglang" and config.sglang_site == "/tmp/site/sglang"
    with pytest.raises(ValueError, match="engine='sglang' is CUDA-only"):
        HybridConfig(model="m", device="cpu", engine="sglang")
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        HybridConfig(model="m", engine="sglang", colocate=False, num_gpus=4, engine_gpus=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="HybridConfig.engine='tgi'"):
        HybridConfig(model="m", engine="tgi")


def test_the_driver_runs_on_one_thread_for_the_run_and_is_restored_after_it(monkeypatch, tiny_llama_path):
    """start() runs the driver on one torch thread (its small ops stay off an OpenMP team) and close() restores the
    setting, also when the start fails half way."""
    pytest.importorskip("ray")
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
    from rlhfkit.hybrid import Hybrid, HybridConfig, TrainerConfig

    seen = []

    def failing_start(self, trainers, started):
        seen.append(torch.get_num_threads())
        raise RuntimeError("the start failed")

    monkeypatch.setattr(Hybrid, "_start", failing_start)
    trainers = {"actor": TrainerConfig(deepspeed=DeepSpeedEngineConfig(zero_stage=0, optimizer="torch_adamw"))}
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        config = HybridConfig(model=str(tiny_llama_path), device="cpu", engine="hf")
        with pytest.raises(RuntimeError, match="the start failed"):
            Hybrid.start(config, trainers)
        assert seen.pop() == 1 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_single_gpu_vllm_engines_pause_for_in_flight_updates_unless_told_not_to():
    """Overlap mode: single-GPU vLLM engines are started pausable (a push parks them between decode steps);
    tensor-parallel ones, pause_engines=False and synchronous runs keep LLM.generate (a push waits)."""
    from rlhfkit.hybrid import Hybrid, HybridConfig

    overlap = {"overlap": True, "max_weight_lag": 1}
    assert Hybrid(HybridConfig(model="m", **overlap))._pausable_vllm
    assert not Hybrid(HybridConfig(model="m", **overlap, pause_engines=False))._pausable_vllm
    assert not Hybrid(HybridConfig(model="m", **overlap, tensor_parallel_size=2, colocate=False, num_gpus=3,
                                   engine_gpus=2))._pausable_vllm
    assert not Hybrid(HybridConfig(model="m"))._pausable_vllm
    with pytest.raises(TypeError, match="pause_engines=1"):
        HybridConfig(model="m", pause_engines=1)


@pytest.mark.parametrize("nodes,gpus,tp", [(1, 4, 2), (1, 4, 4), (2, 4, 2), (1, 2, 1)])
def test_colocated_tp_engines_get_the_endpoints_of_the_actor_ranks_on_their_gpus(nodes, gpus, tp):
    """Colocated vLLM engines with tensor parallelism (issue 24): worker k of an engine joins the CUDA-IPC group of
    the actor rank on the engine's k-th GPU (a list of endpoints per engine); TP 1 keeps one endpoint per engine."""
    from rlhfkit.hybrid import HybridConfig
    from rlhfkit.hybrid._launch import _colocated_endpoints, plan_gpus

    config = HybridConfig(model="m", num_nodes=nodes, num_gpus=gpus, tensor_parallel_size=tp)
    plan = plan_gpus(config, ("actor", "reference"))
    actor_gpu = {(rank.node, rank.gpus[0]): f"endpoint-of-actor-{rank.rank}" for rank in plan.ranks("actor")}
    per_engine = _colocated_endpoints(plan, [f"endpoint-of-actor-{r.rank}" for r in plan.ranks("actor")])
    engines = plan.ranks("rollout")
    assert len(per_engine) == len(engines) == nodes * gpus // tp
    for engine, got in zip(engines, per_engine, strict=True):
        want = [actor_gpu[(engine.node, gpu)] for gpu in engine.gpus]
        assert got == (want[0] if tp == 1 else want)
    if tp > 1:  # every actor rank serves exactly one TP worker
        assert sorted(e for got in per_engine for e in got) == sorted(actor_gpu.values())


def test_colocated_tensor_parallel_needs_a_divisor_of_the_gpus():
    from rlhfkit.hybrid import HybridConfig

    assert HybridConfig(model="m", num_gpus=4, tensor_parallel_size=2).colocate
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the 3 GPU\(s\) of a colocated run"):
        HybridConfig(model="m", num_gpus=3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="engine='hf'.* no tensor parallelism"):
        HybridConfig(model="m", device="cpu", engine="hf", num_gpus=2, tensor_parallel_size=2)


@pytest.mark.slow
@pytest.mark.ray
def test_a_failed_or_skipped_step_leaves_no_gradients_behind(hybrid):
    """Issue 50 item 4: a forward_backward whose loss fails on micro-batch 1 drops micro-batch 0's gradients (the
    next step trains on nothing else: a zero loss gives a zero gradient norm); discard_gradients() drops a
    successful forward_backward's gradients the same way, and the next forward_backward is accepted."""
    from rlhfkit.hybrid import TrainerGroup
    from rlhfkit.workers import WorkerError

    actor = hybrid.trainers["actor"]
    experience = _experience(hybrid, step=5)
    split = TrainerGroup(actor.workers, actor.config, dataclasses.replace(actor.plan, micro_batch_tokens=16))
    with pytest.raises(WorkerError, match=r"returned nan on 'actor' rank 0, phase 'train_actor', micro-batch 1"):
        split.forward_backward(experience, FailsAfterFirstMicroBatch())
    actor.forward_backward(experience, zero_loss)
    assert actor.optim_step(sleep_after=False).grad_norm == 0.0

    actor.forward_backward(experience, pg_loss)
    actor.discard_gradients()  # skip this minibatch
    actor.forward_backward(experience, zero_loss)
    assert actor.optim_step(sleep_after="keep_weights").grad_norm == 0.0
    hybrid.push_weights()  # the steps moved the actor a version ahead: later tests generate without a push
    hybrid.engines.sleep(level=1)


@pytest.mark.slow
@pytest.mark.ray
def test_a_refused_push_leaves_the_engines_free(hybrid):
    """Issue 50 item 13: a push refused by the trainer (asleep without its weights) or by its arguments leaves no
    engine waiting to receive: the engines answer at once and the next push works."""
    import ray

    from rlhfkit.workers import WorkerError

    actor = hybrid.trainers["actor"]
    actor.forward_backward(_experience(hybrid, step=6), pg_loss)
    actor.optim_step(sleep_after=True)  # the weights went to host memory too: nothing to send from
    with pytest.raises(WorkerError, match="RoleAsleepError: push_weights: 'actor' rank 0 is asleep without its"):
        hybrid.push_weights()
    # an engine still waiting for the refused sync would answer only after sync_timeout_s (60 s here)
    versions = ray.get([handle.get_weight_version.remote() for handle in hybrid.engines.handles], timeout=30)
    with pytest.raises(ValueError, match=r"push_weights\(role='reference'\): only the actor's weights"):
        hybrid.push_weights("reference")
    actor.wake()
    assert hybrid.push_weights()["engine/weight_version"] == versions[0] + 1
    hybrid.engines.sleep(level=1)


@pytest.mark.slow
@pytest.mark.ray
def test_hybrid_errors_name_the_hybrid_calls(hybrid):
    """Issue 50 item 12: a phase conflict names hybrid.engines.sleep(); a push forgotten after a level-2 sleep (the
    engines' weights discarded) raises WeightLagError naming push_weights(), and without a step in between the
    engines refuse to generate from discarded weights too, before any engine wakes."""
    from rlhfkit.engines import SamplingConfig
    from rlhfkit.engines.protocol import WeightLagError
    from rlhfkit.hybrid import HybridCallError
    from rlhfkit.packing import pack_rollouts
    from rlhfkit.workers import WorkerError

    engines, actor, sampling = hybrid.engines, hybrid.trainers["actor"], SamplingConfig(n=2, max_new_tokens=3)
    batch = pack_rollouts(engines.generate([[5, 6, 7]], sampling))
    engines.wake()
    try:
        with pytest.raises(WorkerError, match=r"put 'rollout' to sleep first \(hybrid\.engines\.sleep\(\)\)"):
            hybrid.trainers["reference"].forward(batch)
    finally:
        engines.sleep(level=1)

    experience = _experience(hybrid, step=7)
    actor.forward_backward(experience, pg_loss)
    actor.optim_step(sleep_after="keep_weights")
    engines.sleep(level=2)  # discards the engines' weights
    with pytest.raises(WeightLagError, match=r"actor is at version \d+.*call hybrid\.push_weights\(\)"):
        engines.generate([[5, 6, 7]], sampling)
    hybrid.push_weights()
    engines.sleep(level=2)
    with pytest.raises(HybridCallError, match=r"discarded .* call hybrid\.push_weights\(\) before generate"):
        engines.generate([[5, 6, 7]], sampling)
    actor.wake()  # the last push put the actor fully to sleep: a push needs its weights on the device
    hybrid.push_weights()
    assert len(engines.generate([[5, 6, 7]], sampling)) == 2  # and the engines went back to sleep at level 1
