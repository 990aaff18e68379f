"""rlhfkit.lora: the config, target checks, peft wrapping, adapter-only sync into the HF engine (issue 20)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from rlhfkit.engines.hf import HFEngine, HFEngineConfig
from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.lora import (  # noqa: E402  (adapter_name is not in __all__: the wire names)
    LoraConfig,
    adapter_modules,
    adapter_name,
    apply_lora,
    check_target_modules,
    check_target_modules_of,
    describe_adapter,
    lora_parameters,
)
from rlhfkit.weight_sync import ManifestMismatchError, WeightReceiver, WeightSender, WeightSyncConfig

PROMPTS = [[5, 17, 33, 40], [8, 9], [100, 101, 102, 7, 3], [60]]


def _trained_adapter(path, config: LoraConfig, seed: int = 1):
    """A peft-wrapped model whose adapters are non-zero (lora_B starts at 0: randomise it, as training would)."""
    model = apply_lora(transformers.AutoModelForCausalLM.from_pretrained(path), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in lora_parameters(model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


@pytest.mark.parametrize("kwargs, error, match", [
    ({"rank": 0}, ValueError, "LoraConfig.rank=0"),
    ({"alpha": -1.0}, ValueError, "LoraConfig.alpha=-1.0"),
    ({"target_modules": "q_proj"}, TypeError, r"write|give a tuple.*\('q_proj',\)"),
    ({"target_modules": ()}, TypeError, "non-empty tuple"),
    ({"dropout": 1.0}, ValueError, "LoraConfig.dropout=1.0"),
    # regression (issue 50 item 7): alpha=inf was accepted
    ({"alpha": math.inf}, ValueError, "LoraConfig.alpha=inf; must be a finite number > 0"),
    ({"alpha": math.nan}, ValueError, "LoraConfig.alpha=nan"),
    ({"dropout": True}, ValueError, "LoraConfig.dropout=True"),
    ({"rank": True}, ValueError, "LoraConfig.rank=True"),
])
def test_config_names_the_bad_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        LoraConfig(**kwargs)


def test_a_peft_lora_config_is_taken_field_by_field():
    """peft's own LoraConfig is accepted where rlhfkit takes one (TrainerConfig.lora); settings rlhfkit's adapters
    do not implement are refused by name instead of being dropped."""
    import peft

    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
    from rlhfkit.hybrid import TrainerConfig
    from rlhfkit.lora import as_lora_config

    theirs = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                             task_type="CAUSAL_LM")
    ours = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), dropout=0.0)
    assert LoraConfig.from_peft(theirs) == as_lora_config(theirs) == ours
    assert LoraConfig.from_peft(peft.LoraConfig(target_modules={"v_proj", "q_proj"})).target_modules == (
        "q_proj", "v_proj")
    trainer = TrainerConfig(deepspeed=DeepSpeedEngineConfig(optimizer="torch_adamw", bf16=False), lora=theirs)
    assert trainer.lora == ours
    for kwargs, field in (({"use_dora": True}, "use_dora"), ({"use_rslora": True}, "use_rslora"),
                          ({"bias": "all"}, "bias"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                          ({"rank_pattern": {"q_proj": 2}}, "rank_pattern")):
        with pytest.raises(ValueError, match=f"peft LoraConfig.{field}="):
            LoraConfig.from_peft(peft.LoraConfig(target_modules=["q_proj"], **kwargs))
    for targets in (None, "all-linear", ".*proj"):
        with pytest.raises(ValueError, match="target_modules"):
            LoraConfig.from_peft(peft.LoraConfig(target_modules=targets))
    with pytest.raises(TypeError, match=r"TrainerConfig.lora=\{'r': 4\}; expected an rlhfkit.lora.LoraConfig, a peft"):
        TrainerConfig(deepspeed=trainer.deepspeed, lora={"r": 4})


def test_unknown_target_module_is_named_with_candidates_before_peft_runs(tiny_llama_path):
    """Regression (issue 20): a LoRA target that does not exist is a ValueError naming it and the candidates,
    from the saved config alone (meta device, no weights read) and before peft wraps anything."""
    config = LoraConfig(rank=4, target_modules=("q_proj", "query_key_value"))
    with pytest.raises(ValueError, match=r"\['query_key_value'\].*candidates: \[.*'q_proj'.*'v_proj'"):
        check_target_modules_of(str(tiny_llama_path), config)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    with pytest.raises(ValueError, match="query_key_value"):
        apply_lora(model, config)
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_apply_lora_freezes_the_base_and_names_match_the_description(tiny_llama_path):
    config = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    model = apply_lora(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path), config)
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert adapter_name(trainable[0]).endswith(".lora_A.weight") and ".default" not in adapter_name(trainable[0])
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    expected = {name: tuple(shape) for name, shape, _ in describe_adapter(base, config, dtype=torch.float32)}
    sent = {name: tuple(param.shape) for name, param in lora_parameters(model)}
    assert sent == expected and len(sent) == 2 * 2 * 2  # 2 layers x 2 modules x (A, B)
    check_target_modules(base, config)


def test_hf_engine_with_pushed_adapter_equals_the_merged_trainer_model(tiny_llama_path):
    """Issue 20: greedy output of the engine after an adapter-only sync equals peft's merge_and_unload of the
    trainer's model; a second adapter replaces the first (no accumulation)."""
    config = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12)
    before = [r.response_token_ids.tolist() for r in engine.generate(PROMPTS, greedy)]
    sync = WeightSyncConfig(backend="inprocess", bucket_bytes=4096)
    receiver = WeightReceiver(sync, expected=describe_adapter(engine.model, config, dtype=torch.float32))
    sender = WeightSender(sync, local_receiver=(
        receiver, lambda tensors, version=None: engine.load_adapter(tensors, lora=config, version=version)))
    for seed in (1, 2):
        trainer = _trained_adapter(tiny_llama_path, config, seed=seed)
        report = sender.send(lora_parameters(trainer))
        assert report.num_tensors == 12 and engine.weight_version == seed
        merged = HFEngine.from_model(trainer.merge_and_unload())
        want = [r.response_token_ids.tolist() for r in merged.generate(PROMPTS, greedy)]
        got = engine.generate(PROMPTS, greedy)
        assert [r.response_token_ids.tolist() for r in got] == want
        assert all(r.weight_version == seed for r in got)
    assert want != before  # the adapter changed the outputs: the equality above is not vacuous


def test_adapter_rank_mismatch_fails_before_any_byte_moves(tiny_llama_path):
    """Regression (issue 20): an adapter of another rank (or other modules) than the engine expects is refused by
    the manifest check; the engine's weights and version stay as they were."""
    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    expected = describe_adapter(engine.model, LoraConfig(rank=4, target_modules=("q_proj",)), dtype=torch.float32)
    sync = WeightSyncConfig(backend="inprocess")
    weights = {name: param.detach().clone() for name, param in engine.model.named_parameters()}
    receiver = WeightReceiver(sync, expected=expected)
    loads = []
    sender = WeightSender(sync, local_receiver=(receiver, lambda tensors, version=None: loads.append(1)))
    trainer = _trained_adapter(tiny_llama_path, LoraConfig(rank=8, target_modules=("q_proj",)))
    with pytest.raises(ManifestMismatchError, match=r"lora_A.weight' has shape \(8, 64\).*expects \(4, 64\)"):
        sender.send(lora_parameters(trainer))
    assert not loads and engine.weight_version == 0
    assert all(torch.equal(param, weights[name]) for name, param in engine.model.named_parameters())


def test_incomplete_adapter_leaves_the_engine_unchanged(tiny_llama_path):
    config = LoraConfig(rank=4, target_modules=("q_proj",))
    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    trainer = _trained_adapter(tiny_llama_path, config)
    half = [(name, tensor) for name, tensor in lora_parameters(trainer) if "lora_A" in name]
    weights = {name: param.detach().clone() for name, param in engine.model.named_parameters()}
    with pytest.raises(ValueError, match="adapter incomplete"):
        engine.load_adapter(half, lora=config)
    assert engine.weight_version == 0
    assert all(torch.equal(param, weights[name]) for name, param in engine.model.named_parameters())


def test_adapter_merger_pairs_names_through_adapter_modules(tiny_llama_path):
    """Review-h (adapter names were parsed three times): AdapterMerger.merge pairs and checks names with
    adapter_modules, then refuses an unknown module and a missing module; the weights stay as they were."""
    config = LoraConfig(rank=4, target_modules=("q_proj",))
    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    adapter = lora_parameters(_trained_adapter(tiny_llama_path, config))
    pairs = adapter_modules(name for name, _ in adapter)
    assert sorted(pairs) == sorted(name for name, module in engine.model.named_modules() if name.endswith("q_proj"))
    weights = {name: param.detach().clone() for name, param in engine.model.named_parameters()}
    bogus = [(name.replace("q_proj", "k_proj"), tensor) for name, tensor in adapter[:2]]
    with pytest.raises(ValueError, match=r"k_proj.lora_A.weight' names no adapted module"):
        engine.load_adapter(adapter + bogus, lora=config)
    with pytest.raises(ValueError, match=r"adapter incomplete: no lora_A/lora_B for \['model.layers.1"):
        engine.load_adapter(adapter[:2], lora=config)
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' is not a LoRA weight"):
        engine.load_adapter([("model.embed_tokens.weight", adapter[0][1])], lora=config)
    assert engine.weight_version == 0
    assert all(torch.equal(param, weights[name]) for name, param in engine.model.named_parameters())
    assert engine.load_adapter(dict(adapter), lora=config) == len(adapter) and engine.weight_version == 1


def test_describe_adapter_of_checks_the_targets_once_and_names_the_folder(tiny_llama_path, monkeypatch):
    """Review-h: describe_adapter_of ran check_target_modules, then describe_adapter ran it again; now once, and the
    error still names the model's folder."""
    import rlhfkit.lora as lora_module

    calls = []
    real = lora_module.check_target_modules
    monkeypatch.setattr(lora_module, "check_target_modules", lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    specs = lora_module.describe_adapter_of(str(tiny_llama_path), LoraConfig(rank=4, target_modules=("q_proj",)),
                                            dtype=torch.float32)
    assert len(calls) == 1 and len(specs) == 4  # two layers x (lora_A, lora_B)
    with pytest.raises(ValueError, match=rf"\['nope'\] match no Linear module of the model at '{tiny_llama_path}'"):
        lora_module.describe_adapter_of(str(tiny_llama_path), LoraConfig(rank=4, target_modules=("nope",)),
                                        dtype=torch.float32)


def test_output_layer_target_is_refused_up_front_with_the_reason(tiny_model_factory):
    """Regression (issue 50 item 7): target_modules=('lm_head',) passed check_target_modules (so Hybrid.start) and
    peft adapted the head, but the engines' adapter manifest leaves it out: the first push failed. Now the target
    checks (on the saved config, and apply_lora before peft runs) refuse it, naming the module and why; the
    adapter description never lists the head. Tied and untied heads alike."""
    for tie in (False, True):
        path = str(tiny_model_factory("llama", tie_word_embeddings=tie))
        config = LoraConfig(rank=4, target_modules=("q_proj", "lm_head"))
        with pytest.raises(ValueError, match=r"'lm_head' targets the output layer 'lm_head' of the model at .*not "
                                             r"supported.*remove 'lm_head' from target_modules"):
            check_target_modules_of(path, config)
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        with pytest.raises(ValueError, match="output layer 'lm_head'"):
            apply_lora(model, config)
        assert not any("lora" in name for name, _ in model.named_parameters())
        with pytest.raises(ValueError, match="candidates: \\[(?!.*lm_head)"):  # the head is no candidate either
            check_target_modules(model, LoraConfig(rank=4, target_modules=("nope",)))


def _stub_vllm_worker(capacity=2):
    """What register_adapter reads of a vLLM worker before it builds anything (no vLLM needed)."""
    adapters = SimpleNamespace(capacity=capacity, model=SimpleNamespace())
    manager = SimpleNamespace(_adapter_manager=adapters, list_adapters=lambda: {})
    return SimpleNamespace(rank=0, model_runner=SimpleNamespace(lora_manager=manager))


def test_both_engines_check_adapter_shapes_against_the_rank(tiny_llama_path):
    """Regression (issue 50 item 7, vLLM sibling): the vLLM worker paired adapter names but built the LoRA model
    from tensors of any rank (up to max_lora_rank vLLM serves it, scaled by alpha / r of the config: the wrong
    update). check_adapter_shapes, shared with the HF engine, refuses it before anything is built, naming the
    tensor, its shape and the expected one."""
    from rlhfkit.engines.vllm._lora import check_adapter_support, register_adapter

    config = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj",))
    adapter = dict(lora_parameters(_trained_adapter(tiny_llama_path, LoraConfig(rank=8, target_modules=("q_proj",)))))
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight' has shape \(8, 64\); expected \(4, \*\)"):
        register_adapter(_stub_vllm_worker(), 1, adapter, config.peft_dict())
    from rlhfkit.lora import check_adapter_shapes

    good = {name: tensor.detach() for name, tensor in lora_parameters(_trained_adapter(tiny_llama_path, config))}
    pairs = check_adapter_shapes({name: tensor.shape for name, tensor in good.items()}, rank=4)
    assert len(pairs) == 2  # two layers' q_proj
    a_name, b_name = pairs["model.layers.1.self_attn.q_proj"]
    features = {module: (64, 64) for module in pairs}
    with pytest.raises(ValueError, match=rf"'{b_name}' has shape \(64, 3\); expected \(64, 4\)"):
        check_adapter_shapes({**{n: t.shape for n, t in good.items()}, b_name: (64, 3)}, rank=4, features=features)
    with pytest.raises(ValueError, match=rf"'{a_name}' has shape \(4, 64, 1\); expected \(4, 64\)"):
        check_adapter_shapes({**{n: t.shape for n, t in good.items()}, a_name: (4, 64, 1)}, rank=4,
                             features=features)
    head = [f"base_model.model.lm_head.lora_{part}.weight" for part in "AB"]  # e.g. an `expected` given by hand
    with pytest.raises(ValueError, match=r"output layer \['lm_head'\] are not supported"):
        check_adapter_support(_stub_vllm_worker(), config.peft_dict(), head)
