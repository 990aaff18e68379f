"""The SGLang engine against a fake SGLang server (tests/_fake_sglang: a real HTTP server in a child process, started
by the engine's own launch path with ``python -m sglang.launch_server``, speaking sglang 0.5.17's endpoints and JSON
shapes). Covers the protocol, config validation, start-up failures, sleep/wake calls, weight loads and syncs with
rlhfkit's manifest/version checks, and failure handling (killed server, hang -> timeout, bad JSON)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rlhfkit.engines import RolloutEngine, SamplingConfig
from rlhfkit.engines.protocol import WeightVersionError
from rlhfkit.engines.router import EngineError, EngineGroup, EngineGroupConfig, unpack_generate_result
from rlhfkit.engines.sglang import (
    FLOAT32_BELOW_ONE,
    SGLangEngine,
    SGLangEngineConfig,
    SGLangNotInstalledError,
    SGLangProtocolError,
    SGLangRequestError,
    SGLangServerDied,
    SGLangStartError,
    SGLangTimeout,
    sample_seed,
    sampling_params,
    server_command,
)
from rlhfkit.engines.sglang._config import server_environment

FAKE = Path(__file__).parent / "_fake_sglang"


def fake_config(tmp_path: Path, mode: str = "", **overrides) -> SGLangEngineConfig:
    fields = {"model": str(tmp_path), "python": sys.executable,
              "env": {"PYTHONPATH": str(FAKE), "FAKE_SGLANG_MODE": mode},
              "log_path": str(tmp_path / f"server-{mode or 'ok'}.log"), "startup_timeout_s": 30.0,
              "generate_timeout_s": 20.0, "control_timeout_s": 20.0, "health_timeout_s": 5.0,
              "enable_memory_saver": True, "weights_cpu_backup": True}
    return SGLangEngineConfig(**(fields | overrides))


def fake_tokens(prompt, *, seed=0, version=0, max_new_tokens=4, stops=()):
    """The fake server's rule (tests/_fake_sglang/sglang/launch_server.py), written out by hand."""
    tokens = []
    for t in range(max_new_tokens):
        tokens.append(3 + (sum(prompt) + seed + 5 * version + 7 * t) % 50)
        if tokens[-1] in stops:
            break
    return tokens


def state(engine: SGLangEngine) -> dict:
    with urllib.request.urlopen(engine.server.url + "/fake_state", timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture
def engine(tmp_path):
    engine = SGLangEngine(fake_config(tmp_path))
    yield engine
    engine.close()


# --- config -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("model", ""), ("port", 70000), ("tensor_parallel_size", 0),
                                          ("mem_fraction_static", 1.0), ("dtype", "fp8"), ("seed", -1),
                                          ("startup_timeout_s", 0), ("url", "localhost:30000"),
                                          ("context_length", 0), ("update_bucket_bytes", 0)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SGLangEngineConfig.{field}"):
        SGLangEngineConfig(**({"model": "m"} | {field: value}))


def test_config_refuses_clashing_extra_args_and_backup_without_memory_saver():
    with pytest.raises(ValueError, match="--tp-size"):
        SGLangEngineConfig(model="m", extra_args=("--tp-size=2",))
    with pytest.raises(ValueError, match="enable_memory_saver=True"):
        SGLangEngineConfig(model="m", weights_cpu_backup=True)
    with pytest.raises(TypeError, match="env"):
        SGLangEngineConfig(model="m", env={"A": 1})


def test_server_command_maps_fields_to_sglang_flags():
    config = SGLangEngineConfig(model="/m", python="/venv/bin/python", tensor_parallel_size=2, seed=5,
                                enable_memory_saver=True, weights_cpu_backup=True, context_length=512,
                                enforce_eager=True, extra_args=("--attention-backend", "fa3"))
    command = server_command(config, port=1234, engine_index=2)
    assert command[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    flags = dict(zip(command[3::2], command[4::2]))
    assert flags["--model-path"] == "/m" and flags["--port"] == "1234" and flags["--tp-size"] == "2"
    assert command[command.index("--random-seed") + 1] == "7"  # seed + engine index
    for flag in ("--enable-memory-saver", "--enable-weights-cpu-backup", "--disable-cuda-graph", "--skip-server-warmup"):
        assert flag in command
    assert command[-2:] == ["--attention-backend", "fa3"]


def test_float32_runs_on_native_layers_and_triton_attention():
    # sglang 0.5.17's CUDA RMSNorm and FA3 have no float32 kernels: the command picks the native-torch mode + Triton
    command = server_command(SGLangEngineConfig(model="/m", dtype="float32"), port=1)
    assert command[command.index("--rl-on-policy-target") + 1] == "fsdp"
    assert command[command.index("--attention-backend") + 1] == "triton"
    assert command.count("--enable-fp32-lm-head") == 1  # the on-policy mode's logits are bfloat16 without it
    chosen = server_command(SGLangEngineConfig(model="/m", dtype="float32", extra_args=("--attention-backend=fa4",)),
                            port=1)
    assert [a for a in chosen if a.startswith("--attention-backend")] == ["--attention-backend=fa4"]
    bf16 = server_command(SGLangEngineConfig(model="/m"), port=1)
    assert "--rl-on-policy-target" not in bf16 and "--attention-backend" not in bf16
    assert "--enable-fp32-lm-head" not in bf16
    asked = server_command(SGLangEngineConfig(model="/m", dtype="float32", extra_args=("--enable-fp32-lm-head",)),
                           port=1)
    assert asked.count("--enable-fp32-lm-head") == 1
    forced = server_command(SGLangEngineConfig(model="/m", rl_on_policy_target="fsdp"), port=1)
    assert forced[forced.index("--rl-on-policy-target") + 1] == "fsdp"
    base = {"PATH": "/bin", "TRITON_F32_DEFAULT": "tf32"}
    assert server_environment(SGLangEngineConfig(model="/m", dtype="float32"), base)["TRITON_F32_DEFAULT"] == "ieee"
    assert server_environment(SGLangEngineConfig(model="/m"), base) == base
    chosen_env = SGLangEngineConfig(model="/m", dtype="float32", env={"TRITON_F32_DEFAULT": "tf32x3"})
    assert server_environment(chosen_env, base) == {"PATH": "/bin", "TRITON_F32_DEFAULT": "tf32x3",
                                                    "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
    with pytest.raises(ValueError, match="no float32 kernel"):
        SGLangEngineConfig(model="/m", dtype="float32", rl_on_policy_target="")
    with pytest.raises(ValueError, match="SGLangEngineConfig.rl_on_policy_target='megatron'"):
        SGLangEngineConfig(model="/m", rl_on_policy_target="megatron")
    with pytest.raises(ValueError, match="--rl-on-policy-target"):
        SGLangEngineConfig(model="/m", extra_args=("--rl-on-policy-target", "fsdp"))


def test_memory_saver_runs_prefill_without_a_graph_and_decode_graphs_are_opt_in():
    # sglang 0.5.17 cannot release a prefill graph's pool: a sleepable server runs prefill eagerly, unless the user
    # picks a prefill graph; the decode graphs join the memory saver only when asked (an env switch)
    base = {"PATH": "/bin"}
    saver = SGLangEngineConfig(model="/m", enable_memory_saver=True)
    assert saver.drops_prefill_graph and "--disable-prefill-cuda-graph" in server_command(saver, port=1)
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in server_environment(saver, base)
    graphs = SGLangEngineConfig(model="/m", enable_memory_saver=True, release_cuda_graphs=True)
    assert server_environment(graphs, base)["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"
    for config in (SGLangEngineConfig(model="/m"), SGLangEngineConfig(model="/m", enable_memory_saver=True,
                                                                       enforce_eager=True),
                   SGLangEngineConfig(model="/m", enable_memory_saver=True,
                                      extra_args=("--cuda-graph-backend-prefill", "breakable"))):
        assert not config.drops_prefill_graph
        assert "--disable-prefill-cuda-graph" not in server_command(config, port=1)
    asked = SGLangEngineConfig(model="/m", enable_memory_saver=True, extra_args=("--disable-prefill-cuda-graph",))
    assert server_command(asked, port=1).count("--disable-prefill-cuda-graph") == 1 and asked.drops_prefill_graph
    kept = SGLangEngineConfig(model="/m", enable_memory_saver=True, release_cuda_graphs=True,
                              env={"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "0"})
    assert server_environment(kept, base)["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "0"
    with pytest.raises(ValueError, match="release_cuda_graphs=True needs enable_memory_saver=True"):
        SGLangEngineConfig(model="/m", release_cuda_graphs=True)
    with pytest.raises(ValueError, match="breakable prefill graph"):
        SGLangEngineConfig(model="/m", enable_memory_saver=True, release_cuda_graphs=True,
                           extra_args=("--cuda-graph-backend-prefill", "breakable"))
    with pytest.raises(TypeError, match="release_cuda_graphs=1"):
        SGLangEngineConfig(model="/m", enable_memory_saver=True, release_cuda_graphs=1)


def test_float32_on_policy_samples_and_returns_float32_logprobs():
    base = {"PATH": "/bin"}
    fp32 = SGLangEngineConfig(model="/m", dtype="float32")
    assert fp32.float32_sampling and server_environment(fp32, base)["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    for config in (SGLangEngineConfig(model="/m"), SGLangEngineConfig(model="/m", dtype="float32",
                                                                       exact_logprobs=False)):
        assert not config.float32_sampling
        assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in server_environment(config, base)
    assert SGLangEngineConfig(model="/m", rl_on_policy_target="fsdp").float32_sampling
    with pytest.raises(ValueError, match="exact_logprobs=True needs the on-policy mode"):
        SGLangEngineConfig(model="/m", exact_logprobs=True)
    with pytest.raises(TypeError, match="exact_logprobs='yes'"):
        SGLangEngineConfig(model="/m", dtype="float32", exact_logprobs="yes")
    # top_p=1 goes out as the float32 just below 1: SGLang's float32 top-p sampler, not the bf16 on-policy one
    assert torch.tensor(FLOAT32_BELOW_ONE, dtype=torch.float32).item() == 1 - 2**-24
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0)
    assert sampling_params(sampling, float32_sampling=True)["top_p"] == FLOAT32_BELOW_ONE
    assert sampling_params(sampling)["top_p"] == 1.0
    greedy = SamplingConfig(max_new_tokens=4, temperature=0.0)
    assert sampling_params(greedy, float32_sampling=True)["top_p"] == 1.0
    cut = SamplingConfig(max_new_tokens=4, top_p=0.9)
    assert sampling_params(cut, float32_sampling=True)["top_p"] == pytest.approx(0.9)


def test_float32_logprobs_at_other_temperatures_are_refused_before_a_request(tmp_path):
    engine = SGLangEngine(fake_config(tmp_path, dtype="float32"))
    try:
        got = engine.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=3, temperature=1.0, logprobs=True))
        assert len(got[0].response_token_ids) == 3
        sent = state(engine)
        assert sent["last_sampling_params"]["top_p"] == FLOAT32_BELOW_ONE
        assert sent["env"] == {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "SGLANG_MEMORY_SAVER_CUDA_GRAPH": None}
        assert "--disable-prefill-cuda-graph" in sent["args"]
        calls = len(state(engine)["calls"])
        with pytest.raises(ValueError, match=r"temperature=0\.7 .*exact_logprobs"):
            engine.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=3, temperature=0.7, logprobs=True))
        assert len(state(engine)["calls"]) == calls  # nothing was sent
        engine.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=3, temperature=0.7, logprobs=False))
    finally:
        engine.close()


# --- start-up -------------------------------------------------------------------------------------------------------
def test_missing_interpreter_or_sglang_names_the_install(tmp_path):
    with pytest.raises(SGLangNotInstalledError, match=r"pip install 'sglang==0\.5\.17'"):
        SGLangEngine(fake_config(tmp_path, python=str(tmp_path / "no-python")))
    with pytest.raises(SGLangNotInstalledError, match="cannot import sglang"):  # an interpreter without sglang
        SGLangEngine(fake_config(tmp_path, env={"PYTHONPATH": str(tmp_path)}))


def test_server_exit_at_start_reports_code_and_log_tail(tmp_path):
    with pytest.raises(SGLangStartError, match=r"(?s)exited with code 7.*no kernel image"):
        SGLangEngine(fake_config(tmp_path, "exit_at_start"))


def test_server_never_healthy_times_out_and_is_stopped(tmp_path, monkeypatch):
    # 5 s: time for a busy machine to start the fake's interpreter and print its first line, which the error quotes
    with pytest.raises(SGLangStartError, match=r"(?s)startup_timeout_s=5 .*fake sglang: starting on ([\d.]+):(\d+)") \
            as caught:
        SGLangEngine(fake_config(tmp_path, "never_healthy", startup_timeout_s=5.0))
    host, port = re.search(r"fake sglang: starting on ([\d.]+):(\d+)", str(caught.value)).groups()
    with pytest.raises(ConnectionRefusedError):  # stopped: nothing listens on its port any more
        socket.create_connection((host, int(port)), timeout=30).close()


# --- generate -------------------------------------------------------------------------------------------------------
def test_generate_follows_the_protocol(engine):
    assert isinstance(engine, RolloutEngine)
    prompts = [[1, 2, 3], [4, 5]]
    sampling = SamplingConfig(n=3, max_new_tokens=4, temperature=1.0, seed=11)
    rollouts = engine.generate(prompts, sampling, prompt_indices=[10, 20])
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(i, s) for i in (10, 20) for s in range(3)]
    for rollout in rollouts:
        prompt = prompts[0 if rollout.prompt_index == 10 else 1]
        expected = fake_tokens(prompt, seed=sample_seed(11, rollout.prompt_index, rollout.sample_index))
        assert rollout.response_token_ids.tolist() == expected
        assert rollout.response_logprobs.tolist() == pytest.approx([-(t % 10 + 1) / 10 for t in expected])
        assert rollout.finish_reason == "length" and rollout.weight_version == 0
    # a sample's seed depends on its global prompt index, not on the batch it came in
    alone = engine.generate([prompts[1]], sampling, prompt_indices=[20])
    assert [r.response_token_ids.tolist() for r in alone] == [r.response_token_ids.tolist() for r in rollouts[3:]]
    packed = unpack_generate_result(engine.generate_packed(prompts, sampling, prompt_indices=[10, 20]), prompts,
                                    [10, 20])
    assert [r.response_token_ids.tolist() for r in packed] == [r.response_token_ids.tolist() for r in rollouts]


def test_generate_stop_token_is_kept_and_greedy_ignores_the_seed(engine):
    first = fake_tokens([1, 2, 3], max_new_tokens=8)
    sampling = SamplingConfig(n=2, max_new_tokens=8, temperature=0.0, seed=3, stop_token_ids=(first[2],))
    rollouts = engine.generate([[1, 2, 3]], sampling)
    assert [r.response_token_ids.tolist() for r in rollouts] == [first[:3]] * 2
    assert [r.finish_reason for r in rollouts] == ["stop", "stop"]
    no_logprobs = engine.generate([[1, 2, 3]], SamplingConfig(max_new_tokens=2, logprobs=False))
    assert no_logprobs[0].response_logprobs is None


# --- sleep / wake ---------------------------------------------------------------------------------------------------
def test_sleep_and_wake_send_memory_tags_and_guard_generation(engine, tmp_path):
    sampling = SamplingConfig(max_new_tokens=2)
    engine.sleep(level=1)
    assert state(engine)["released"] == ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(RuntimeError, match="asleep; call wake_up"):
        engine.generate([[1]], sampling)
    with pytest.raises(RuntimeError, match="already asleep"):
        engine.sleep(level=1)
    engine.wake_up(["weights"])
    assert state(engine)["released"] == ["cuda_graph", "kv_cache"]
    engine.wake_up(["kv_cache"])
    assert state(engine)["released"] == []
    assert len(engine.generate([[1]], sampling)) == 1
    with pytest.raises(ValueError, match="tags="):
        engine.wake_up("weights")


def test_sleep_needs_the_memory_saver_and_level_1_the_cpu_backup(tmp_path):
    engine = SGLangEngine(fake_config(tmp_path, enable_memory_saver=False, weights_cpu_backup=False))
    try:
        with pytest.raises(RuntimeError, match="enable_memory_saver=True"):
            engine.sleep(level=2)
    finally:
        engine.close()
    engine = SGLangEngine(fake_config(tmp_path, weights_cpu_backup=False))
    try:
        with pytest.raises(RuntimeError, match="weights_cpu_backup=True"):
            engine.sleep(level=1)
        engine.sleep(level=2)
        assert state(engine)["released"] == ["cuda_graph", "kv_cache", "weights"]
    finally:
        engine.close()


# --- weights --------------------------------------------------------------------------------------------------------
def test_load_weights_sends_tensors_versions_and_flushes(engine):
    weights = [("model.a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("model.b", torch.ones(4))]
    assert engine.load_weights(weights) == 2
    seen = state(engine)
    assert seen["weights"] == {"model.a": [[2, 3], 15.0], "model.b": [[4], 4.0]}
    assert seen["version"] == 1 and seen["flushes"] == 1 and engine.weight_version == 1
    rollout = engine.generate([[1, 2]], SamplingConfig(max_new_tokens=3, temperature=0.0))[0]
    assert rollout.response_token_ids.tolist() == fake_tokens([1, 2], version=1, max_new_tokens=3)
    assert rollout.weight_version == 1
    calls = len(state(engine)["calls"])
    with pytest.raises(WeightVersionError, match="holds weight version 1"):
        engine.load_weights(weights, version=1)
    assert len(state(engine)["calls"]) == calls + 0  # refused before anything was sent (fake_state is a GET)


def test_level_2_sleep_refuses_generation_until_every_weight_is_rewritten(engine):
    weights = [("model.a", torch.ones(2)), ("model.b", torch.ones(3))]
    engine.load_weights(weights)
    engine.sleep(level=2)
    engine.wake_up()
    with pytest.raises(RuntimeError, match="weights are incomplete"):
        engine.generate([[1]], SamplingConfig(max_new_tokens=1))
    engine.load_weights(weights[:1])
    with pytest.raises(RuntimeError, match=r"1 weight\(s\) not rewritten"):
        engine.generate([[1]], SamplingConfig(max_new_tokens=1))
    engine.load_weights(weights[1:])
    assert len(engine.generate([[1]], SamplingConfig(max_new_tokens=1))) == 1


def test_rejected_weight_update_raises_and_invalidates(tmp_path):
    engine = SGLangEngine(fake_config(tmp_path, "reject_weights"))
    try:
        with pytest.raises(SGLangRequestError, match="HTTP 400"):
            engine.load_weights([("model.a", torch.ones(2))])
        with pytest.raises(RuntimeError, match="failed part-way"):
            engine.generate([[1]], SamplingConfig(max_new_tokens=1))
    finally:
        engine.close()


def test_weight_sync_over_gloo_checks_manifest_and_version(engine):
    from rlhfkit.weight_sync import ManifestMismatchError, SyncEndpoint, WeightSender, WeightSyncConfig

    config = WeightSyncConfig(backend="gloo", bucket_bytes=1024, timeout_s=20.0)
    weights = [(f"model.w{i}", torch.full((128,), float(i))) for i in range(4)]  # 512 B each: two buckets
    expected = [(name, tuple(t.shape), t.dtype) for name, t in weights]
    sender = WeightSender(config, SyncEndpoint(world_size=2, group_name="sglang-test"))
    try:
        engine.init_weight_sync(config, sender.endpoint, first_rank=1, expected=expected)
        thread = threading.Thread(target=lambda: sender.send(iter(weights)), daemon=True)
        thread.start()
        reports = engine.receive_weights()
        thread.join(30)
        assert reports[0]["version"] == 1 and reports[0]["tensors"] == 4 and engine.weight_version == 1
        assert state(engine)["weights"] == {name: [[128], 128.0 * i] for i, (name, _) in enumerate(weights)}
        wrong = [(name, tensor[:64]) for name, tensor in weights]  # shapes differ from `expected`
        errors = []
        thread = threading.Thread(target=lambda: errors.append(_catch(lambda: sender.send(iter(wrong)))), daemon=True)
        thread.start()
        with pytest.raises(ManifestMismatchError, match="model.w0"):
            engine.receive_weights()
        thread.join(30)
        assert isinstance(errors[0], ManifestMismatchError) and engine.weight_version == 1
        assert len(engine.generate([[1]], SamplingConfig(max_new_tokens=1))) == 1  # weights untouched: still valid
    finally:
        engine.close_weight_sync()
        sender.close()


def _catch(call):
    try:
        call()
    except Exception as error:  # noqa: BLE001 - handed to the test
        return error
    return None


# --- failures -------------------------------------------------------------------------------------------------------
def test_server_dying_mid_request_is_an_engine_error_naming_it(tmp_path):
    engine = SGLangEngine(fake_config(tmp_path, "die_on_generate"), engine_index=3)
    try:
        with pytest.raises(SGLangServerDied, match=r"(?s)engine 3.*gone") as caught:
            engine.generate([[1]], SamplingConfig(max_new_tokens=2))  # (died: not generate_timeout_s's timeout)
        assert caught.value.engine_index == 3
        deadline = time.monotonic() + 60  # the process exits a moment after it dropped the connection
        while "exited with code" not in str(error := _catch(engine.health_check)) and time.monotonic() < deadline:
            assert isinstance(error, SGLangServerDied), error
            time.sleep(0.05)
        assert isinstance(error, SGLangServerDied) and "exited with code 9" in str(error), error
    finally:
        engine.close()


def test_hang_times_out_and_bad_json_is_a_protocol_error(tmp_path):
    hung = SGLangEngine(fake_config(tmp_path, "hang_on_generate", generate_timeout_s=1.0))
    try:
        with pytest.raises(SGLangTimeout, match="did not answer within 1 s"):  # (the fake hangs for good)
            hung.generate([[1]], SamplingConfig(max_new_tokens=2))
    finally:
        hung.close()
    garbled = SGLangEngine(fake_config(tmp_path, "bad_json_generate"))
    try:
        with pytest.raises(SGLangProtocolError, match="not JSON"):
            garbled.generate([[1]], SamplingConfig(max_new_tokens=2))
    finally:
        garbled.close()


def test_killed_server_in_an_engine_group_names_the_engine(tmp_path):
    engines = [SGLangEngine(fake_config(tmp_path / str(i)), engine_index=i) for i in range(2)
               if (tmp_path / str(i)).mkdir() is None]
    group = EngineGroup(engines, config=EngineGroupConfig(generate_timeout_s=20, health_timeout_s=10))
    try:
        assert len(group.generate([[1], [2], [3]], SamplingConfig(n=2, max_new_tokens=2))) == 6
        os.killpg(engines[1].server.process.pid, signal.SIGKILL)
        engines[1].server.process.wait(10)
        with pytest.raises(EngineError, match=r"engine 1 \(of 2\).*SGLangServerDied") as caught:
            group.health_check()
        assert caught.value.engine_index == 1
    finally:
        group.close()
        for engine in engines:
            engine.close()


def test_mixed_backends_in_one_group(engine, tmp_path):
    """Decision: an EngineGroup may mix backends (same protocol and log-prob convention); each prompt's samples stay
    on one engine, so a GRPO group never mixes backends."""
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig
    from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=64, num_layers=1, seed=0))
    hf = HFEngine(HFEngineConfig(model=str(path), device="cpu", dtype="float32", seed=0))
    with EngineGroup([engine, hf], config=EngineGroupConfig(balance="prompts")) as group:
        rollouts = group.generate([[1, 2], [3, 4], [5, 6], [7, 8]], SamplingConfig(n=2, max_new_tokens=3))
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(p, s) for p in range(4) for s in range(2)]
    from_fake = [r for r in rollouts if r.response_token_ids.tolist() == fake_tokens(
        r.prompt_token_ids.tolist(), max_new_tokens=3)]
    assert {r.prompt_index for r in from_fake} == {0, 2}  # the least-loaded rule alternates engines


def test_serialized_cpu_views_carry_only_their_own_bytes():
    """A weight-sync bucket hands out views of one buffer: each must not pickle the whole buffer."""
    import base64
    import pickle

    from rlhfkit.engines.sglang._tensors import serialize_named_tensors

    buffer = torch.arange(1 << 16, dtype=torch.float32)  # 256 KiB
    payload = serialize_named_tensors([("a", buffer[10:14]), ("b", buffer[100:104].view(2, 2))])
    assert len(payload) < 4096
    (name_a, a), (name_b, b) = pickle.loads(base64.b64decode(payload))
    assert (name_a, a.tolist(), name_b, b.tolist()) == ("a", [10.0, 11.0, 12.0, 13.0], "b", [[100.0, 101.0],
                                                                                            [102.0, 103.0]])
