"""The rollout-engine protocol every backend implements, and its sampling configuration.

Token ids in, :class:`~rlhfkit.types.Rollout` objects out. Backends: ``hf`` (transformers), ``vllm``, ``sglang`` (an
SGLang server over HTTP). This module needs only torch.

Log-prob convention: ``Rollout.response_logprobs`` are log-probabilities of the sampled tokens under the
distribution the engine *sampled from after temperature scaling*, before top-p/top-k truncation
(``log_softmax(logits / temperature)``). At temperature 1 they are the model's raw log-probs, which is what the
trainer computes with :func:`rlhfkit.losses.token_logprobs`; at another temperature, the trainer must use the same
temperature for the two to agree.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from rlhfkit.types import Rollout

__all__ = ["SamplingConfig", "RolloutEngine", "WeightVersionError", "WeightLagError",
           "next_weight_version", "check_weight_lag", "prompt_lists"]

logger = logging.getLogger(__name__)

WAKE_TAGS = ("weights", "kv_cache")


class WeightVersionError(ValueError):
    """A weight load offered a version that is not newer than the one the engine holds (versions strictly
    increase, so a rollout's ``weight_version`` always names one set of weights)."""


class WeightLagError(RuntimeError):
    """Rollouts were produced by weights older than the trainer's by more than the configured bound."""


def prompt_lists(prompt_token_ids: Sequence[Sequence[int]],
                 prompt_indices: Sequence[int] | None = None) -> tuple[list[list[int]], list[int]]:
    """An engine's prompts as lists of ints (tensors accepted) and their ``prompt_index`` values (default: their
    positions); ValueError for an empty prompt or a ``prompt_indices`` of another length."""
    prompts = [[int(t) for t in (p.tolist() if hasattr(p, "tolist") else p)] for p in prompt_token_ids]
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt_token_ids[{index}] is empty; every prompt needs at least one token")
    indices = list(range(len(prompts))) if prompt_indices is None else [int(i) for i in prompt_indices]
    if len(indices) != len(prompts):
        raise ValueError(f"prompt_indices has {len(indices)} entries for {len(prompts)} prompts")
    return prompts, indices


def next_weight_version(owner: str, current: int, offered: int | None) -> int:
    """The version a weight load sets: ``offered``, or ``current + 1`` when None.

    Raises :class:`WeightVersionError` (naming ``owner``, e.g. ``"engine 2"``) unless ``offered > current``, and
    ``ValueError`` for a negative or non-int ``offered``. Call it before loading anything.
    """
    if offered is None:
        return current + 1
    if isinstance(offered, bool) or not isinstance(offered, int) or offered < 0:
        raise ValueError(f"{owner}: load_weights(version={offered!r}); must be a non-negative int or None")
    if offered <= current:
        raise WeightVersionError(
            f"{owner} holds weight version {current} and was offered version {offered}; versions must strictly "
            f"increase (pass version={current + 1} or more, or None for {current + 1})")
    return offered


def check_weight_lag(weight_versions: Sequence[int], *, trainer_version: int, max_lag: int,
                     on_lag: Literal["raise", "warn"] = "raise", sources: Sequence[str] | None = None) -> int:
    """Check that rollouts (or engines) are at most ``max_lag`` weight versions behind the trainer.

    Args:
        weight_versions: the weight version of each rollout or engine (e.g. ``[r.weight_version for r in rollouts]``).
        trainer_version: the version of the weights the trainer holds now (what the last push to the engines
            carried, or would have carried).
        max_lag: the most versions a rollout may lag (0: on-policy, every rollout from the trainer's current
            weights; k > 0: off-policy by up to k updates).
        on_lag: ``"raise"`` a :class:`WeightLagError`, or ``"warn"`` (log a warning) when the bound is exceeded.
        sources: optional names parallel to ``weight_versions`` (e.g. ``"engine 1"``), quoted in the message.

    Returns:
        The largest lag found (0 for an empty ``weight_versions``). A version newer than the trainer's is a
        bookkeeping error and always raises ``ValueError``.
    """
    if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
        raise ValueError(f"max_lag={max_lag!r}; must be an int >= 0 (0 = on-policy)")
    if on_lag not in ("raise", "warn"):
        raise ValueError(f"on_lag={on_lag!r}; expected 'raise' or 'warn'")
    versions = [int(v) for v in weight_versions]
    if not versions:
        return 0
    names = list(sources) if sources is not None else [f"rollout {i}" for i in range(len(versions))]
    newest = max(range(len(versions)), key=lambda i: versions[i])
    if versions[newest] > trainer_version:
        raise ValueError(f"{names[newest]} has weight version {versions[newest]}, newer than the trainer's "
                         f"trainer_version={trainer_version}; pass the version the trainer last pushed")
    oldest = min(range(len(versions)), key=lambda i: versions[i])
    lag = trainer_version - versions[oldest]
    if lag > max_lag:
        message = (f"{names[oldest]} was generated with weight version {versions[oldest]} but the trainer is at "
                   f"version {trainer_version} (lag {lag} > max_weight_lag={max_lag}); push the trainer's weights "
                   "to the engines (load_weights / a weight sync) before generating, or raise max_weight_lag for "
                   "off-policy training")
        if on_lag == "raise":
            raise WeightLagError(message)
        logger.warning("%s", message)
    return lag


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
        seed_scope: what ``seed`` seeds. ``"sample"``: each sample draws from its own stream, a function of the
            seed, its prompt's index and its sample index, so it does not depend on the rest of the batch or on
            which engine of a group served it. ``"call"``: each engine draws the whole call from one stream, seeded
            from the seed and what tells the engines of a group apart (vLLM: the index of the first prompt it serves;
            HF: the engine's own seed): the same call (same prompts, same order, same engines) gives the same
            samples, but a sample depends on its batch. vLLM then samples the batch at once instead of sample by
            sample (its per-request generators cost a kernel launch per sample and decode step; docs/engines-vllm.md
            has the cost), and restores its generators after the call. SGLang seeds each sample at no extra cost and
            keeps doing so under ``"call"``.
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
    seed_scope: str = "sample"
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.seed_scope not in ("sample", "call"):
            raise ValueError(f"SamplingConfig.seed_scope={self.seed_scope!r}; must be 'sample' or 'call'")
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
