"""Evaluation on a held-out prompt set, through the run's own engines.

:func:`evaluate` sends held-out prompts to anything with the engine protocol's ``generate(prompt_token_ids,
sampling)`` (:class:`rlhfkit.hybrid.RolloutEngines`, :class:`rlhfkit.engines.hf.HFEngine`, a vLLM engine) and
scores the responses with the run's reward functions (:func:`rlhfkit.rewards.apply_reward_functions`):

- greedy accuracy: one greedy response per prompt, correct when its score is ``>= EvalConfig.threshold``;
- pass@k: ``EvalConfig.num_samples`` sampled responses per prompt at ``EvalConfig.temperature``, with the unbiased
  estimator of Chen et al. (2021, arXiv:2107.03374, eq. 1): ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct of ``n``,
  averaged over prompts (:func:`pass_at_k`);
- the mean greedy response length, in tokens;
- a few greedy completions (prompt, response, label, score) for a table (:meth:`MetricsLogger.log_samples
  <rlhfkit.metrics.MetricsLogger.log_samples>`).

What it does not do: train, choose when to evaluate (``EvalConfig.every_steps`` and :func:`should_evaluate` are for
your loop), or hold the engines' GPU beyond their own ``generate``. Needs torch only (and what the engine needs).
See ``docs/evaluation.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EvalConfig", "EvalResult", "evaluate", "pass_at_k", "should_evaluate"]


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """How a held-out set is evaluated.

    Attributes:
        every_steps: evaluate every this many training steps (and at step 0); 0 never does (:func:`should_evaluate`).
        max_new_tokens: response length limit.
        num_samples: sampled responses per prompt for pass@k (``n``); 0 skips the sampled pass.
        k: pass@k's ``k`` (``<= num_samples``).
        temperature: sampling temperature of the pass@k samples (the accuracy pass is greedy).
        threshold: a response is correct when its summed reward is ``>= threshold``.
        num_logged_samples: greedy completions returned in :attr:`EvalResult.samples`.
        batch_size: prompts per ``generate`` call.
        seed: the pass@k samples' seed (the same draws at every evaluation of the same weights and batching).
    """

    every_steps: int = 10
    max_new_tokens: int = 256
    num_samples: int = 4
    k: int = 1
    temperature: float = 1.0
    threshold: float = 1.0
    num_logged_samples: int = 4
    batch_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("every_steps", "max_new_tokens", "num_samples", "k", "num_logged_samples", "batch_size", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"EvalConfig.{name}={value!r} is a {type(value).__name__}; pass an int")
        for name, low in (("every_steps", 0), ("max_new_tokens", 1), ("num_samples", 0), ("k", 1),
                          ("num_logged_samples", 0), ("batch_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"EvalConfig.{name}={getattr(self, name)}; must be >= {low}")
        if self.num_samples and self.k > self.num_samples:
            raise ValueError(f"EvalConfig.k={self.k} exceeds num_samples={self.num_samples}; pass@k needs at least k "
                             "samples per prompt: raise num_samples or lower k")
        for name in ("temperature", "threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"EvalConfig.{name}={value!r}; pass a finite number")
        if self.temperature <= 0:
            raise ValueError(f"EvalConfig.temperature={self.temperature}; pass@k samples need a temperature > 0 "
                             "(the accuracy pass is the greedy one)")


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """What :func:`evaluate` measured.

    Attributes:
        num_prompts: prompts evaluated.
        accuracy: share of prompts whose greedy response scored ``>= threshold``.
        mean_score: mean summed reward of the greedy responses.
        mean_response_tokens: mean length of the greedy responses, in tokens.
        pass_at_k: the unbiased pass@k over the sampled responses (None when ``num_samples == 0``).
        k: the ``k`` of :attr:`pass_at_k`.
        samples: up to ``num_logged_samples`` greedy completions: ``{"prompt", "response", "label", "score"}``.
        also: the greedy accuracy under each of :func:`evaluate`'s ``also`` reward functions, by name.
    """

    num_prompts: int
    accuracy: float
    mean_score: float
    mean_response_tokens: float
    pass_at_k: float | None
    k: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    also: dict[str, float] = field(default_factory=dict)

    def as_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """The numbers as ``{prefix}accuracy``, ``{prefix}mean_score``, ``{prefix}mean_response_tokens``,
        ``{prefix}pass@{k}``, ``{prefix}num_prompts``: a row for :meth:`MetricsLogger.log`."""
        metrics = {f"{prefix}accuracy": self.accuracy, f"{prefix}mean_score": self.mean_score,
                   f"{prefix}mean_response_tokens": self.mean_response_tokens,
                   f"{prefix}num_prompts": float(self.num_prompts)}
        if self.pass_at_k is not None:
            metrics[f"{prefix}pass@{self.k}"] = self.pass_at_k
        return metrics | {f"{prefix}{name}_accuracy": value for name, value in self.also.items()}


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt: ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021, eq. 1), the chance that
    at least one of ``k`` of the ``n`` samples, drawn without replacement, is correct."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(f"pass_at_k(num_samples={num_samples}, num_correct={num_correct}, k={k}); needs "
                         "0 <= num_correct <= num_samples and 1 <= k <= num_samples")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def should_evaluate(step: int, config: EvalConfig) -> bool:
    """Whether the loop evaluates before training step ``step`` (every ``every_steps`` steps from step 0)."""
    return config.every_steps > 0 and step % config.every_steps == 0


def _responses(engine: Any, token_ids: Sequence[Sequence[int]], sampling: Any, batch_size: int,
               tokenizer: Any, options: Mapping[str, Any]) -> list[Any]:
    """Rollouts of every prompt in batches of ``batch_size`` prompts; ``prompt_index`` made global."""
    import dataclasses

    rollouts = []
    for start in range(0, len(token_ids), batch_size):
        for rollout in engine.generate([list(ids) for ids in token_ids[start:start + batch_size]], sampling,
                                       **options):
            text = rollout.response_text
            if text is None and tokenizer is not None:
                text = tokenizer.decode(rollout.response_token_ids, skip_special_tokens=True)
            rollouts.append(dataclasses.replace(rollout, prompt_index=rollout.prompt_index + start,
                                                response_text=text))
    return rollouts


def _scores(rollouts: list[Any], prompts: Any, reward_functions: Sequence[Callable | Any]) -> list[float]:
    from rlhfkit.rewards import apply_reward_functions, rollout_columns, rollout_texts

    texts, responses, answers = rollout_texts(rollouts, prompts=prompts.texts, labels=prompts.labels)
    columns = getattr(prompts, "columns", None)
    columns = rollout_columns(rollouts, columns) if columns is not None else None
    scores, _ = apply_reward_functions(reward_functions, texts, responses, answers, columns=columns)
    return scores


def evaluate(engine: Any, prompts: Any, reward_functions: Sequence[Callable | Any], config: EvalConfig, *,
             tokenizer: Any = None, generate_options: Mapping[str, Any] | None = None,
             also: Mapping[str, Callable | Any] | None = None) -> EvalResult:
    """Greedy accuracy, pass@k and response length of ``prompts`` (see the module docstring).

    Args:
        engine: anything with ``generate(prompt_token_ids, sampling) -> list[Rollout]``.
        prompts: a :class:`rlhfkit.data.PromptBatch` (``token_ids``, ``texts``, ``labels``), e.g. a held-out
            :class:`rlhfkit.data.PromptDataset`'s ``next(dataset.batches(len(dataset), seed=0, shuffle=False))``.
        reward_functions: as :func:`rlhfkit.rewards.apply_reward_functions` takes them (callables or
            :class:`~rlhfkit.rewards.RewardFunctionConfig`); their weighted sum is a response's score.
        config: the :class:`EvalConfig`.
        tokenizer: decodes responses of engines that return token ids only.
        generate_options: extra keywords of every ``engine.generate`` call, e.g. ``{"sleep_after": False}`` for
            :class:`rlhfkit.hybrid.RolloutEngines` that share the GPU: they stay awake between the evaluation's
            calls and for the step's own ``generate`` (a sleep that drops their weights would need a push first).
        also: more reward functions by name (e.g. a lenient scorer beside the strict training reward): each one's
            greedy accuracy is reported as well (:attr:`EvalResult.also`), on the same responses.
    """
    from rlhfkit.engines import SamplingConfig

    if not isinstance(config, EvalConfig):
        raise TypeError(f"evaluate(config={config!r}); pass an rlhfkit.evaluation.EvalConfig")
    if len(prompts.token_ids) == 0:
        raise ValueError("evaluate: the held-out prompt set is empty; pass at least one prompt")
    greedy = SamplingConfig(n=1, max_new_tokens=config.max_new_tokens, temperature=0.0, seed=config.seed)
    rollouts = _responses(engine, prompts.token_ids, greedy, config.batch_size, tokenizer, generate_options or {})
    rollouts.sort(key=lambda rollout: rollout.prompt_index)
    scores = _scores(rollouts, prompts, reward_functions)
    also_accuracy = {name: sum(v >= config.threshold for v in _scores(rollouts, prompts, [fn])) / len(rollouts)
                     for name, fn in (also or {}).items()}
    samples = [{"prompt": prompts.texts[r.prompt_index], "response": r.response_text,
                "label": prompts.labels[r.prompt_index], "score": score}
               for r, score in list(zip(rollouts, scores))[:config.num_logged_samples]]
    estimate = None
    if config.num_samples:
        sampled = SamplingConfig(n=config.num_samples, max_new_tokens=config.max_new_tokens,
                                 temperature=config.temperature, seed=config.seed)
        draws = _responses(engine, prompts.token_ids, sampled, config.batch_size, tokenizer, generate_options or {})
        correct = [0] * len(prompts.token_ids)
        for rollout, score in zip(draws, _scores(draws, prompts, reward_functions)):
            correct[rollout.prompt_index] += score >= config.threshold
        estimate = sum(pass_at_k(config.num_samples, c, config.k) for c in correct) / len(correct)
    return EvalResult(num_prompts=len(rollouts), accuracy=sum(s >= config.threshold for s in scores) / len(scores),
                      mean_score=sum(scores) / len(scores),
                      mean_response_tokens=sum(len(r.response_token_ids) for r in rollouts) / len(rollouts),
                      pass_at_k=estimate, k=config.k, samples=samples, also=also_accuracy)
