"""examples/grpo_async.py on CPU (issue 21's must-shows).

Three real runs (the session's local Ray cluster with logical GPUs, joined through ``$RAY_ADDRESS``; the HF engine
in a threaded Ray actor, gloo weight sync, DeepSpeed ZeRO-0): the synchronous loop; the asynchronous loop at
staleness 1 with the engine resident beside the trainers (``HybridConfig(overlap=True)``) and their sleeps behind the
next wakes (``overlap_switches``); and at staleness 1 with the engine on a GPU of its own (weights in flight over the
non-colocated channel).

The rest runs the example's own ``main`` in this process with ``Hybrid`` replaced by ``tests/_local_hybrid.py``'s
stand-in (a real HF engine behind a real ``EngineGroup``, plain-torch trainers, the real ``RolloutProducer`` and
``RolloutBuffer``): at staleness 0 the asynchronous loop is the synchronous one bit for bit; ``--ignore-eos``;
``--reference false``; a trainer exception and a dead engine end the run with their error and stop the producer.
That the overlapped switches train exactly as without them is tests/test_hybrid_overlap.py's.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from _local_hybrid import LocalHybrid

from conftest import load_example

KEYS = ("actor/loss", "actor/grad_norm", "reward/mean", "kl/mean", "mismatch/kl")


def _run(module, tiny_llama_path, out, *extra):
    return module.main(["--model", str(tiny_llama_path), "--out", str(out), "--device", "cpu", "--tiny", "true",
                        "--timeout-s", "60", *extra])


def _producer_threads():
    return [thread for thread in threading.enumerate() if thread.name.startswith("rlhfkit-engines")]


@pytest.fixture
def ray_run(ray_address):
    """A real run: DeepSpeed installed, this process joins the session's Ray cluster through ``$RAY_ADDRESS``."""
    pytest.importorskip("deepspeed")
    return ray_address


@pytest.fixture
def local_example(monkeypatch):
    """examples/grpo_async.py with ``Hybrid`` replaced by the in-process stand-in; ``module.started`` lists the
    stand-ins it started."""
    module = load_example("grpo_async")
    module.started = []

    def start(config, trainers, plan=None):
        module.started.append(LocalHybrid.start(config, trainers, plan=plan))
        return module.started[-1]

    monkeypatch.setattr(module, "Hybrid", type("Hybrid", (), {"start": staticmethod(start)}))
    yield module
    assert all(hybrid.closed for hybrid in module.started)


# what bench/async_grpo.py reads of each row (its test runs a stand-in example that writes these keys)
BENCH_KEYS = {"samples", "samples_per_s", "time/step_s", "time/wait_rollouts_s", "reward/mean", "accuracy",
              "staleness/mean", "staleness/token_mean", "staleness/spanning", "staleness/hist_0", "mismatch/kl",
              "buffer/dropped_groups", "time/train_actor_s", "time/forward_s"}


def _check_bench_keys(rows):
    assert [row["samples"] for row in rows] == [16.0, 32.0, 48.0]  # the tiny run: 4 prompts x 4 samples a step
    for row in rows:
        assert BENCH_KEYS <= set(row), BENCH_KEYS - set(row)
        assert sum(value for key, value in row.items() if key.startswith("staleness/hist_")) == 16.0
        assert row["time/train_actor_s"] > 0


def _check_on_policy(rows):
    assert [row["sync/version"] for row in rows] == [1.0, 2.0, 3.0]
    for row in rows:
        assert row["staleness/max"] == 0 and row["mismatch/kl"] < 1e-8  # on-policy: engine == trainer (fp32)


# --- real runs: Ray, DeepSpeed, the HF engine in an actor -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ray
def test_the_sync_loop_on_ray_is_on_policy(ray_run, tiny_llama_path, tmp_path):
    rows = _run(load_example("grpo_async"), tiny_llama_path, tmp_path, "--mode", "sync")
    _check_on_policy(rows)
    _check_bench_keys(rows)
    assert not any(row["staleness/spanning"] for row in rows)


@pytest.mark.slow
@pytest.mark.ray
def test_staleness_1_on_ray_holds_its_bound_with_the_switches_overlapped(ray_run, tiny_llama_path, tmp_path,
                                                                          monkeypatch):
    """The engine resident beside the trainers, pushes in flight, the trainers' sleeps behind the next wakes
    (overlap_switches: the GPU default where it fits)."""
    module = load_example("grpo_async")
    start = module.Hybrid.start
    monkeypatch.setattr(module.Hybrid, "start", lambda config, trainers, plan: start(
        config, trainers, plan=dataclasses.replace(plan, overlap_switches=True)))
    lagged = _run(module, tiny_llama_path, tmp_path, "--mode", "async", "--max-staleness", "1")
    assert [row["sync/version"] for row in lagged] == [1.0, 2.0, 3.0]
    assert all(row["staleness/max"] <= 1 for row in lagged)
    # batch 1 is generated while step 0 trains: one version behind, and the trainer sees the gap
    assert [row["staleness/max"] for row in lagged][1:] == [1.0, 1.0]
    assert lagged[1]["mismatch/kl"] > 1e-6 and lagged[1]["mismatch/tokens_staleness_1"] > 0
    assert lagged[-1]["buffer/dropped_groups"] == 0  # "wait": nothing generated to be thrown away
    assert all(row["time/overlapped_sleep_s"] > 0 for row in lagged)
    _check_bench_keys(lagged)
    assert not _producer_threads()


@pytest.mark.slow
@pytest.mark.ray
def test_the_engine_on_a_gpu_of_its_own_runs_the_same_loop(ray_run, tiny_llama_path, tmp_path):
    """--num-gpus 2 --engine-gpus 1: the separated layout (trainers on logical GPU 0, the engine on GPU 1, weights
    in flight over the non-colocated channel) trains with the bound held."""
    lagged = _run(load_example("grpo_async"), tiny_llama_path, tmp_path, "--mode", "async", "--max-staleness", "1",
                  "--num-gpus", "2", "--engine-gpus", "1")
    assert [row["sync/version"] for row in lagged] == [1.0, 2.0, 3.0]
    assert all(row["staleness/max"] <= 1 for row in lagged) and lagged[-1]["buffer/dropped_groups"] == 0
    assert all(row["engine/weight_version"] == row["sync/version"] for row in lagged)
    assert not _producer_threads()


# --- in process: the example's loop over the stand-in -----------------------------------------------------------------
def test_async_at_staleness_0_is_the_sync_loop_bit_for_bit(local_example, tiny_llama_path, tmp_path):
    sync = _run(local_example, tiny_llama_path, tmp_path / "sync", "--mode", "sync")
    same = _run(local_example, tiny_llama_path, tmp_path / "async0", "--mode", "async", "--max-staleness", "0")
    assert [[row[k] for k in KEYS] for row in same] == [[row[k] for k in KEYS] for row in sync]  # exact floats
    _check_on_policy(sync)
    _check_on_policy(same)
    assert len({row["actor/loss"] for row in sync}) == 3  # the steps trained on different batches
    assert not _producer_threads()


@pytest.mark.parametrize("failure", ["trainer_exception", "engine_killed"])
def test_a_failure_mid_run_ends_it_with_a_clear_error_in_bounded_time(failure, local_example, tiny_llama_path,
                                                                      tmp_path, monkeypatch):
    from rlhfkit.engines.router import EngineError

    train_step = local_example.train_step

    def failing_step(hybrid, rollouts, version, *args):
        if version == 1:
            if failure == "trainer_exception":
                raise ArithmeticError("injected trainer failure at version 1")
            hybrid.kill_engine()  # the engine dies while the producer may be generating
        return train_step(hybrid, rollouts, version, *args)

    monkeypatch.setattr(local_example, "train_step", failing_step)
    with pytest.raises(Exception) as caught:  # (bounded: every wait of the run has a timeout)
        _run(local_example, tiny_llama_path, tmp_path, "--steps", "3", "--max-staleness", "1")
    error = caught.value
    if failure == "trainer_exception":
        assert isinstance(error, ArithmeticError)
    else:  # the push (or the producer, whichever reaches the dead engine first) names it
        chain = [error, error.__cause__, error.__context__]
        assert any(isinstance(e, EngineError) for e in chain), error
        assert "engine 0" in str(error), error
    assert not _producer_threads()  # the producer was stopped, the buffer closed, the hybrid closed


def test_ignore_eos_runs_every_sample_to_the_length_limit(local_example, tiny_llama_path, tmp_path):
    """--ignore-eos true: the long-generation workload of the throughput runs (generation grows with
    --max-new-tokens, so the overlap has more to hide); every sample is the tiny run's 8 tokens long."""
    rows = _run(local_example, tiny_llama_path, tmp_path / "long", "--ignore-eos", "true")
    assert [row["response_length/mean"] for row in rows] == [8.0, 8.0, 8.0]
    assert all(row["truncation_rate"] == 1.0 for row in rows)
    assert not _producer_threads()


def test_without_a_reference_the_step_has_no_kl_and_no_reference_role(local_example, tiny_llama_path, tmp_path):
    """--reference false --kl-coef 0 (DAPO-style: the trainer's forward is the actor's alone, which shortens the
    training side the overlap has to hide generation behind): no reference role starts, no KL is logged, the
    asynchronous bound still holds; --reference false with a KL coefficient is refused before anything starts."""
    rows = _run(local_example, tiny_llama_path, tmp_path / "noref", "--reference", "false", "--kl-coef", "0")
    assert set(local_example.started[0].trainers) == {"actor"}
    assert [row["sync/version"] for row in rows] == [1.0, 2.0, 3.0]
    assert not [key for row in rows for key in row if key.startswith(("kl/", "kl_loss"))]
    assert all(row["staleness/max"] <= 1 for row in rows)
    with pytest.raises(ValueError, match="--reference false with --kl-coef 0.001"):
        local_example.start(local_example.Options(device="cpu", reference=False))
    assert len(local_example.started) == 1  # refused before the hybrid started
    assert not _producer_threads()
