import torch

from rlhfkit.tiny_models import TinyModelConfig
import pytest


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_reloads_and_generates(tiny_model_factory, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_factory(arch)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|assistant|>")
    ids = tokenizer("What is 12 + 30?", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "What is 12 + 30?"
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_tiny_config_rejects_bad_heads():
    with pytest.raises(ValueError, match="num_heads=3"):
        TinyModelConfig(num_heads=3)
