"""examples/grpo_async.py end to end on CPU (issue 21's must-shows): real local Ray with logical GPUs, the HF engine in
a threaded Ray actor resident beside the trainers (``HybridConfig(overlap=True)``) or on a GPU of its own, gloo
weight sync, a RolloutProducer thread and a staleness-bounded RolloutBuffer; DeepSpeed ZeRO-0 (the example's stage).

- staleness 0: the asynchronous loop's losses are bit-identical to the synchronous loop of the same script;
- staleness 1: the bound holds, rollouts lag by one version, the off-policy metrics are logged;
- a trainer exception and an engine killed mid-run end the run with a clear error in bounded time, and no producer
  thread is left behind.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from conftest import load_example


def _run(module, tiny_llama_path, out, *extra):
    return module.main(["--model", str(tiny_llama_path), "--out", str(out), "--device", "cpu", "--tiny", "true",
                        "--timeout-s", "60", *extra])


def _producer_threads():
    return [thread for thread in threading.enumerate() if thread.name.startswith("rlhfkit-engines")]


@pytest.mark.slow
@pytest.mark.ray
def test_async_at_staleness_0_is_the_sync_loop_bit_for_bit_and_staleness_1_holds_its_bound(
        ray_not_started, tiny_llama_path, tmp_path, monkeypatch):
    module = load_example("grpo_async")
    sync = _run(module, tiny_llama_path, tmp_path / "sync", "--mode", "sync")
    same = _run(module, tiny_llama_path, tmp_path / "async0", "--mode", "async", "--max-staleness", "0")
    lagged = _run(module, tiny_llama_path, tmp_path / "async1", "--mode", "async", "--max-staleness", "1")
    keys = ("actor/loss", "actor/grad_norm", "reward/mean", "kl/mean", "mismatch/kl")
    assert [[row[k] for k in keys] for row in same] == [[row[k] for k in keys] for row in sync]  # exact floats
    # the same with the trainers' sleeps behind the next wakes (the plan's overlap_switches: the GPU default where it
    # fits)
    start = module.Hybrid.start
    monkeypatch.setattr(module.Hybrid, "start", lambda config, trainers, plan: start(
        config, trainers, plan=dataclasses.replace(plan, overlap_switches=True)))
    overlapped = _run(module, tiny_llama_path, tmp_path / "async0-overlapped", "--mode", "async",
                      "--max-staleness", "0")
    assert [[row[k] for k in keys] for row in overlapped] == [[row[k] for k in keys] for row in sync]
    assert all(row["time/overlapped_sleep_s"] > 0 for row in overlapped)
    for rows in (sync, same, lagged):
        assert [row["sync/version"] for row in rows] == [1.0, 2.0, 3.0]
    for row in sync + same:
        assert row["staleness/max"] == 0 and row["mismatch/kl"] < 1e-8  # on-policy: engine == trainer (fp32)
    assert all(row["staleness/max"] <= 1 for row in lagged)
    # batch 1 is generated while step 0 trains: one version behind, and the trainer sees the gap
    assert [row["staleness/max"] for row in lagged][1:] == [1.0, 1.0]
    assert lagged[1]["mismatch/kl"] > 1e-6 and lagged[1]["mismatch/tokens_staleness_1"] > 0
    assert lagged[-1]["buffer/dropped_groups"] == 0  # "wait": nothing generated to be thrown away
    assert not _producer_threads()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("failure", ["trainer_exception", "engine_killed"])
def test_a_failure_mid_run_ends_it_with_a_clear_error_in_bounded_time(failure, ray_not_started, tiny_llama_path,
                                                                      tmp_path, monkeypatch):
    import ray

    from rlhfkit.engines.router import EngineDiedError, EngineError

    module = load_example("grpo_async")
    train_step = module.train_step

    def failing_step(hybrid, rollouts, version, *args):
        if version == 1:
            if failure == "trainer_exception":
                raise ArithmeticError("injected trainer failure at version 1")
            ray.kill(hybrid._handles[0], no_restart=True)  # the engine dies while the producer may be generating
        return train_step(hybrid, rollouts, version, *args)

    monkeypatch.setattr(module, "train_step", failing_step)
    with pytest.raises(Exception) as caught:  # (bounded: every wait of the run has a timeout)
        _run(module, tiny_llama_path, tmp_path, "--steps", "3", "--max-staleness", "1")
    error = caught.value
    if failure == "trainer_exception":
        assert isinstance(error, ArithmeticError)
    else:  # the push (or the producer, whichever reaches the dead engine first) names it
        chain = [error, error.__cause__, error.__context__]
        assert any(isinstance(e, (EngineDiedError, EngineError, ray.exceptions.RayActorError)) for e in chain), error
        assert "engine 0" in str(error) or "died" in str(error).lower(), error
    assert not _producer_threads()  # the producer was stopped, the buffer closed, Ray shut down
    assert not ray.is_initialized()


@pytest.mark.slow
@pytest.mark.ray
def test_the_engine_on_a_gpu_of_its_own_runs_the_same_loop(ray_not_started, tiny_llama_path, tmp_path):
    """--num-gpus 2 --engine-gpus 1: the separated layout (trainers on logical GPU 0, the engine on GPU 1, weights
    over the non-colocated channel) trains with the bound held, and at staleness 0 gives the colocated run's losses."""
    module = load_example("grpo_async")
    colocated = _run(module, tiny_llama_path, tmp_path / "colocated", "--mode", "async", "--max-staleness", "0")
    separated = _run(module, tiny_llama_path, tmp_path / "separated0", "--mode", "async", "--max-staleness", "0",
                     "--num-gpus", "2", "--engine-gpus", "1")
    keys = ("actor/loss", "reward/mean", "kl/mean")
    assert [row[k] for row in separated for k in keys] == pytest.approx([row[k] for row in colocated for k in keys])
    lagged = _run(module, tiny_llama_path, tmp_path / "separated1", "--mode", "async", "--max-staleness", "1",
                  "--num-gpus", "2", "--engine-gpus", "1")
    assert [row["sync/version"] for row in lagged] == [1.0, 2.0, 3.0]
    assert all(row["staleness/max"] <= 1 for row in lagged) and lagged[-1]["buffer/dropped_groups"] == 0
    assert not _producer_threads()


@pytest.mark.slow
@pytest.mark.ray
def test_ignore_eos_runs_every_sample_to_the_length_limit(ray_not_started, tiny_llama_path, tmp_path):
    """--ignore-eos true: the long-generation workload of the throughput runs (generation grows with
    --max-new-tokens, so the overlap has more to hide); every sample is the tiny run's 8 tokens long."""
    rows = _run(load_example("grpo_async"), tiny_llama_path, tmp_path / "long", "--ignore-eos", "true")
    assert [row["response_length/mean"] for row in rows] == [8.0, 8.0, 8.0]
    assert all(row["truncation_rate"] == 1.0 for row in rows)
    assert not _producer_threads()


@pytest.mark.slow
@pytest.mark.ray
def test_without_a_reference_the_step_has_no_kl_and_no_reference_role(ray_not_started, tiny_llama_path, tmp_path,
                                                                       monkeypatch):
    """--reference false --kl-coef 0 (DAPO-style: the trainer's forward is the actor's alone, which shortens the
    training side the overlap has to hide generation behind): no reference role starts, no KL is logged, the
    asynchronous bound still holds; --reference false with a KL coefficient is refused before anything starts."""
    module = load_example("grpo_async")
    started, start = [], module.start
    monkeypatch.setattr(module, "start", lambda options: started.append(start(options)) or started[-1])
    rows = _run(module, tiny_llama_path, tmp_path / "noref", "--reference", "false", "--kl-coef", "0")
    assert set(started[0].trainers) == {"actor"}
    assert [row["sync/version"] for row in rows] == [1.0, 2.0, 3.0]
    assert not [key for row in rows for key in row if key.startswith(("kl/", "kl_loss"))]
    assert all(row["staleness/max"] <= 1 for row in rows)
    with pytest.raises(ValueError, match="--reference false with --kl-coef 0.001"):
        module.start(module.Options(device="cpu", reference=False))
    assert not _producer_threads()
