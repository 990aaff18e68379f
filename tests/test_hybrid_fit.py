"""The hybrid run's fit check (issue 20): a plan that cannot fit one GPU is refused before Ray or any actor starts,
naming the phase and the shortfall in GiB, from the placement memory estimate (ZeRO-3, offload, LoRA, gradient
checkpointing included). Configs only: models are built on the meta device, nothing is trained."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.hybrid import Hybrid, HybridConfig, TrainerConfig
from rlhfkit.hybrid._fit import model_shape
from rlhfkit.hybrid._launch import check_fit
from rlhfkit.lora import LoraConfig
from rlhfkit.placement import MemoryFitError


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory):
    """Qwen2.5-7B's architecture as a config folder (no weights: the check never reads them)."""
    path = tmp_path_factory.mktemp("qwen7b")
    transformers.Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                             num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                             tie_word_embeddings=False).save_pretrained(path)
    return str(path)


def _trainers(**deepspeed):
    ds = DeepSpeedEngineConfig(**({"zero_stage": 3, "bf16": True} | deepspeed))
    return ds


def test_model_shape_counts_the_real_parameters(qwen7b):
    shape = model_shape(qwen7b)
    assert 7.5e9 < shape.num_params < 7.7e9  # Qwen2.5-7B: 7.62e9 with its untied head
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (3584, 28, 152064)


def test_full_parameter_7b_without_offload_names_training_and_the_shortfall(qwen7b):
    """Regression (issue 20): 7B full-parameter AdamW on one 80 GiB GPU without offload cannot fit (bf16 weights +
    grads + fp32 master and moments ≈ 114 GiB): refused naming phase 'training' and a shortfall of tens of GiB."""
    config = HybridConfig(model=qwen7b, gpu_memory_gib=80.0, dtype="bfloat16", engine_memory=0.3)
    trainers = {"actor": TrainerConfig(deepspeed=_trainers())}
    with pytest.raises(MemoryFitError, match=r"phase 'training' needs ~\d+\.\d GiB .*short by \d+\.\d GiB") as info:
        check_fit(config, trainers)
    assert info.value.phase == "training" and 30 < info.value.shortfall_gib < 80
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("settings", [
    {"deepspeed": {"offload_optimizer": True, "gradient_checkpointing": True}},
    {"deepspeed": {"gradient_checkpointing": True}, "lora": LoraConfig(rank=16)},
])
def test_offload_or_lora_makes_7b_fit(qwen7b, settings):
    config = HybridConfig(model=qwen7b, gpu_memory_gib=80.0, engine_sleep_level=1, dtype="bfloat16",
                          engine_memory=0.3)
    trainer = TrainerConfig(deepspeed=_trainers(**settings["deepspeed"]), lora=settings.get("lora"),
                            micro_batch_tokens=4096)
    check_fit(config, {"actor": trainer, "reference": TrainerConfig(deepspeed=_trainers())})


def test_an_engine_share_that_leaves_no_room_names_generating(qwen7b):
    """A role kept resident (offload=False) plus a 0.9 engine share overflow the generating phase."""
    config = HybridConfig(model=qwen7b, gpu_memory_gib=80.0, engine_memory=0.9, dtype="bfloat16")
    trainer = TrainerConfig(deepspeed=_trainers(offload_optimizer=True, gradient_checkpointing=True), offload=False)
    with pytest.raises(MemoryFitError, match="phase 'generating'") as info:
        check_fit(config, {"actor": trainer})
    assert info.value.phase == "generating"


def test_engine_weights_that_fill_the_engine_share_name_generating(qwen7b):
    """Regression (issue 20): 7B float32 engine weights (28 GiB) in the default 0.15 share of 80 GiB (12 GiB)."""
    config = HybridConfig(model=qwen7b, gpu_memory_gib=80.0)
    with pytest.raises(MemoryFitError, match=r"phase 'generating'.*28\.\d GiB.*12\.0 GiB.*short by 16\.\d GiB"):
        check_fit(config, {"actor": TrainerConfig(deepspeed=_trainers(offload_optimizer=True))})


def test_hybrid_start_refuses_before_ray_starts(tiny_llama_path):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    config = HybridConfig(model=str(tiny_llama_path), device="cpu", engine="hf", gpu_memory_gib=1.0)
    deepspeed = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw")
    with pytest.raises(MemoryFitError, match="short by"):
        Hybrid.start(config, {"actor": TrainerConfig(deepspeed=deepspeed)})
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match="HybridConfig.gpu_memory_gib=0"):
        HybridConfig(model=str(tiny_llama_path), gpu_memory_gib=0)


def test_sglang_engine_share_is_checked_too(qwen7b):
    """Review-h: the hybrid copy of the engine-share check ran for vLLM only; the placement check covers SGLang."""
    config = HybridConfig(model=qwen7b, gpu_memory_gib=80.0, engine="sglang")
    with pytest.raises(MemoryFitError, match=r"phase 'generating'.*28\.\d GiB.*12\.0 GiB.*short by 16\.\d GiB"):
        check_fit(config, {"actor": TrainerConfig(deepspeed=_trainers(offload_optimizer=True))})
    check_fit(HybridConfig(model=qwen7b, gpu_memory_gib=80.0, engine="sglang", dtype="bfloat16", engine_memory=0.3),
              {"actor": TrainerConfig(deepspeed=_trainers(offload_optimizer=True))})


def test_engine_memory_fraction_and_dtype_defaults(qwen7b):
    """Review-h: one rule each for the engines' memory share and dtype (written three and two times before)."""
    assert HybridConfig(model=qwen7b).engine_memory_fraction == 0.15
    assert HybridConfig(model=qwen7b, colocate=False, num_gpus=2).engine_memory_fraction == 0.85
    assert HybridConfig(model=qwen7b, engine_memory=0.4).engine_memory_fraction == 0.4
    assert HybridConfig(model=qwen7b, dtype="bfloat16").engine_dtype == "bfloat16"
    assert HybridConfig(model=qwen7b, dtype="bfloat16", device="cpu", engine="hf").engine_dtype == "float32"


def test_hybrid_start_builds_each_meta_model_once(tiny_llama_path, monkeypatch):
    """Review-h: Hybrid.start built the meta-device model for the LoRA target check and again for the fit check."""
    ray = pytest.importorskip("ray")
    import rlhfkit.lora

    if ray.is_initialized():
        ray.shutdown()
    built = []
    real = rlhfkit.lora.meta_model
    monkeypatch.setattr(rlhfkit.lora, "meta_model", lambda path: (built.append(path), real(path))[1])
    config = HybridConfig(model=str(tiny_llama_path), device="cpu", engine="hf", gpu_memory_gib=1.0,
                          engine_sleep_level=1)
    deepspeed = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw")
    lora = LoraConfig(rank=4, target_modules=("q_proj",))
    with pytest.raises(MemoryFitError, match="short by"):
        Hybrid.start(config, {"actor": TrainerConfig(deepspeed=deepspeed, lora=lora),
                              "reference": TrainerConfig(deepspeed=deepspeed)})
    assert built == [str(tiny_llama_path)] and not ray.is_initialized()
