"""Tiny random-weight HF causal LMs with locally trained tokenizers, for tests, examples and smoke runs.

No machine running rlhfkit's tests can reach a model hub, so models are *built*: a byte-level BPE tokenizer is trained
in milliseconds with ``tokenizers``, wrapped in ``PreTrainedTokenizerFast`` with special tokens and a chat template,
a Llama or Qwen2 config gets random weights, and both are written with ``save_pretrained`` so that callers load them
through the real ``from_pretrained`` path. Needs ``rlhfkit[hf]``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlhfkit._optional import require

__all__ = ["TinyModelConfig", "build_tiny_model"]

Architecture = Literal["llama", "qwen2"]

# A minimal chat template: role markers then content; generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>")


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """Size of a tiny model. Defaults: ≈ 0.1M parameters, a vocabulary of a few hundred tokens."""

    arch: Architecture = "llama"
    vocab_size: int = 384
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"TinyModelConfig.arch={self.arch!r}; expected 'llama' or 'qwen2'")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"TinyModelConfig.hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"TinyModelConfig.num_heads={self.num_heads} is not divisible by "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"TinyModelConfig.vocab_size={self.vocab_size}; a byte-level BPE needs at least "
                             f"{256 + len(SPECIAL_TOKENS)}")


def default_corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Arithmetic questions with answers and a little English, enough to give BPE useful merges."""
    rng = random.Random(seed)
    words = ("the answer is what compute please number sum of and plus minus times equals result think step "
             "first then finally so we get a b c yes no").split()
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? The answer is {value}.")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
    return lines


def train_tokenizer(texts: list[str], *, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer on ``texts``; returns a ``PreTrainedTokenizerFast`` with a chat template."""
    tokenizers = require("tokenizers", user="rlhfkit.tiny_models")
    transformers = require("transformers", user="rlhfkit.tiny_models")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny_model(output_dir: str | Path, config: TinyModelConfig | None = None,
                     corpus: list[str] | None = None, *, exist_ok: bool = False) -> Path:
    """Write a random-weight causal LM and its tokenizer to ``output_dir`` (``save_pretrained``); returns the path.
    ``exist_ok=True`` returns a folder that already holds a model (``config.json``) as it is.

    Load it back with ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``.
    The end-of-turn token ``<|end|>`` and ``<|eos|>`` are both generation EOS tokens.
    """
    if exist_ok and (Path(output_dir) / "config.json").exists():
        return Path(output_dir)
    config = config or TinyModelConfig()
    torch = require("torch")
    transformers = require("transformers", user="rlhfkit.tiny_models")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus or default_corpus(seed=config.seed), vocab_size=config.vocab_size)
    config_class = transformers.LlamaConfig if config.arch == "llama" else transformers.Qwen2Config
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|eos|>", "<|end|>")]
    model_config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = transformers.AutoModelForCausalLM.from_config(model_config)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
