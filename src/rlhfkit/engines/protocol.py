"""The rollout-engine protocol every backend implements, and its sampling configuration.

Token ids in, :class:`~rlhfkit.types.Rollout` objects out. Backends: ``hf`` (transformers), ``vllm`` (Ray actors);
SGLang would implement the same four methods. This module needs only torch.

Log-prob convention: ``Rollout.response_logprobs`` are log-probabilities of the sampled tokens under the
distribution the engine *sampled from after temperature scaling*, before top-p/top-k truncation
(``log_softmax(logits / temperature)``). At temperature 1 they are the model's raw log-probs, which is what the
trainer computes with :func:`rlhfkit.losses.token_logprobs`; at another temperature, the trainer must use the same
temperature for the two to agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rlhfkit.types import Rollout

__all__ = ["SamplingConfig", "RolloutEngine"]

WAKE_TAGS = ("weights", "kv_cache")


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How to sample responses.

    Attributes:
        n: samples per prompt (a GRPO group size).
        max_new_tokens: response length limit; a sample that reaches it finishes with ``"length"``.
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 disables it.
        stop_token_ids: tokens that end a sample (included in the response); the model's EOS is added by backends
            unless ``ignore_eos`` is set.
        ignore_eos: do not stop at the model's EOS token.
        seed: seed for reproducible sampling; None draws from the engine's generator.
        logprobs: return per-token log-probs of the sampled tokens.
    """

    n: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n={self.n}; need at least one sample per prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens}; must be >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingConfig.temperature={self.temperature}; must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p={self.top_p}; must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k={self.top_k}; must be >= 0 (0 disables top-k)")
        if not isinstance(self.stop_token_ids, tuple):
            raise TypeError(f"SamplingConfig.stop_token_ids must be a tuple of ints, got {type(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout backend offers. Results come back in input order: prompt-major, then sample index."""

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig) -> list[Rollout]:
        """Sample ``sampling.n`` responses for each prompt; ``len(result) == len(prompts) * n``."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Release accelerator memory. Level 1 keeps weights in host memory; level 2 discards them (the next weight
        load must provide all of them)."""
        ...

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore memory released by :meth:`sleep`: ``"weights"``, ``"kv_cache"`` or both (``None``)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> int:
        """Load named tensors (HF parameter names) into the model; returns how many were loaded.
        ``version`` becomes :attr:`weight_version` (default: the current version + 1)."""
        ...

    @property
    def weight_version(self) -> int:
        """How many weight loads the engine has applied (or the version the last load named)."""
        ...
