"""Rewards: reward-model scoring, Python reward functions with per-sample error reporting, and reward shaping.

What it does:

- :class:`RewardModel` scores prompt + response token ids with a one-label sequence-classification model, in
  batches, at each sequence's last real token (``rlhfkit[hf]`` to load from a path).
- :func:`apply_reward_function` runs ``fn(prompts, responses, labels) -> list[float]`` (sync in daemon worker
  threads, or ``async def`` with asyncio) over batches; a function with a ``columns`` keyword also gets each sample's
  dataset columns; an exception, a non-finite or a non-numeric score is reported
  with the sample index and the function's name, and the caller chooses between raising :class:`RewardError` and
  assigning a configured score. Nothing is dropped silently; a hung function never blocks interpreter exit.
  :func:`apply_reward_functions` sums several functions with weights and reports each.
- :func:`trl_reward` and :func:`verl_reward` run TRL and verl reward functions unchanged;
  :func:`load_reward_function` imports one named ``module:function`` or ``file.py:function``.
- Math answer rewards on HF's math-verify (``rlhfkit[math]``): :func:`gsm8k_strict_reward`,
  :func:`gsm8k_lenient_reward`, :func:`math_reward`, and :func:`gsm8k_reference`.
- :class:`RunningMeanStd` (Chan's parallel update, optionally over a ``torch.distributed`` group),
  :func:`clip_rewards`, :func:`overlong_penalty` (DAPO soft overlong punishment).
- :func:`rollout_texts` lines up prompts, responses and labels of a list of rollouts for the functions above, and
  :func:`rollout_columns` their dataset columns.

What it does not do: generative (LLM-as-judge) reward models, a causal-LM-plus-value-head reward model, process
(per-step) rewards, sandboxed code execution. Besides torch, only :class:`RewardModel` (``rlhfkit[hf]``) and the math
rewards (``rlhfkit[math]``) need an extra.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Literal

from rlhfkit.rewards._adapters import load_reward_function, trl_reward, verl_reward
from rlhfkit.rewards._functions import (
    RewardError,
    RewardFailure,
    RewardReport,
    apply_reward_function,
    check_field_type,
    function_name,
)
from rlhfkit.rewards._math import gsm8k_lenient_reward, gsm8k_reference, gsm8k_strict_reward, math_reward
from rlhfkit.rewards._model import RewardModel, RewardModelConfig
from rlhfkit.rewards._normalization import RunningMeanStd, clip_rewards, overlong_penalty
from rlhfkit.types import Rollout

__all__ = [
    "RewardModel",
    "RewardModelConfig",
    "RewardFunctionConfig",
    "RewardFailure",
    "RewardReport",
    "RewardError",
    "apply_reward_function",
    "apply_reward_functions",
    "rollout_texts",
    "rollout_columns",
    "trl_reward",
    "verl_reward",
    "load_reward_function",
    "gsm8k_reference",
    "gsm8k_strict_reward",
    "gsm8k_lenient_reward",
    "math_reward",
    "RunningMeanStd",
    "clip_rewards",
    "overlong_penalty",
]


@dataclass(frozen=True, kw_only=True)
class RewardFunctionConfig:
    """One reward function and how to run it (see :func:`apply_reward_function` for the fields' meaning).

    Attributes:
        fn: ``fn(prompts, responses, labels) -> list[float]``, sync or ``async def``; with a ``columns`` keyword it
            also receives the samples' dataset columns. A string ``"module:function"`` or ``"file.py:function"``
            is loaded with :func:`load_reward_function`.
        weight: factor of this function's scores in :func:`apply_reward_functions`.
        name: name in reports and errors (default: the function's name).
        batch_size, on_error, error_score, max_workers, timeout_s: as in :func:`apply_reward_function`.
    """

    fn: Callable | str
    weight: float = 1.0
    name: str | None = None
    batch_size: int = 64
    on_error: Literal["raise", "assign"] = "raise"
    error_score: float = 0.0
    max_workers: int = 4
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.fn, str):
            object.__setattr__(self, "fn", load_reward_function(self.fn))
        if not callable(self.fn):
            raise TypeError(f"RewardFunctionConfig.fn={self.fn!r} is not callable; pass fn(prompts, responses, "
                            "labels) -> list[float]")
        for field, kind in (("weight", "real"), ("name", "str|None"), ("batch_size", "int"), ("on_error", "str"),
                            ("error_score", "real"), ("max_workers", "int"), ("timeout_s", "real|None")):
            check_field_type("RewardFunctionConfig", field, getattr(self, field), kind)
        if not math.isfinite(self.weight):
            raise ValueError(f"RewardFunctionConfig.weight={self.weight}; must be finite")
        if self.batch_size < 1:
            raise ValueError(f"RewardFunctionConfig.batch_size={self.batch_size!r}; must be a positive int")
        if self.on_error not in ("raise", "assign"):
            raise ValueError(f"RewardFunctionConfig.on_error={self.on_error!r}; choose 'raise' or 'assign'")
        if not math.isfinite(self.error_score):
            raise ValueError(f"RewardFunctionConfig.error_score={self.error_score}; must be finite")
        if self.max_workers < 1:
            raise ValueError(f"RewardFunctionConfig.max_workers={self.max_workers!r}; must be a positive int")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"RewardFunctionConfig.timeout_s={self.timeout_s}; must be > 0 or None")

    @property
    def display_name(self) -> str:
        return self.name or function_name(self.fn)


def apply_reward_functions(functions: Sequence[RewardFunctionConfig | Callable], prompts: Sequence[str],
                           responses: Sequence[str], labels: Sequence[str | None] | None = None, *,
                           columns: Sequence[Mapping[str, Any]] | None = None
                           ) -> tuple[list[float], list[RewardReport]]:
    """``sum_k weight_k * fn_k(...)`` per sample, running the functions one after another.

    A bare callable (or a ``"module:function"`` string) counts as ``RewardFunctionConfig(fn=...)`` (weight 1,
    ``on_error="raise"``). Two functions may not share a name (their stats would collide). ``columns``: per-sample
    dataset columns, for the functions that take them. Returns the summed scores and one report per function, in
    order: each report's ``as_dict()`` gives that function's own (unweighted) mean, std, failures and time.
    """
    configs = [f if isinstance(f, RewardFunctionConfig) else RewardFunctionConfig(fn=f) for f in functions]
    if not configs:
        raise ValueError("apply_reward_functions(functions=[]) got no reward function")
    names = [c.display_name for c in configs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"apply_reward_functions: several functions are named {duplicates}; give each a "
                         "distinct RewardFunctionConfig.name")
    total = [0.0] * len(responses)
    reports = []
    for config in configs:
        scores, report = apply_reward_function(
            config.fn, prompts, responses, labels, columns=columns, batch_size=config.batch_size, on_error=config.on_error,
            error_score=config.error_score, max_workers=config.max_workers, timeout_s=config.timeout_s,
            name=config.display_name)
        total = [t + config.weight * s for t, s in zip(total, scores)]
        reports.append(report)
    return total, reports


def rollout_texts(rollouts: Sequence[Rollout], *, prompts: Sequence[str] | None = None,
                  labels: Sequence[str | None] | None = None,
                  tokenizer: Any = None) -> tuple[list[str], list[str], list[str | None]]:
    """Aligned ``(prompts, responses, labels)`` lists, one entry per rollout, for the reward functions.

    Args:
        rollouts: from ``engine.generate``; ``response_text`` must be set (give the engine a tokenizer), or pass
            ``tokenizer``: the responses are then decoded from their token ids (special tokens skipped), as engines
            that return token ids only (vLLM with ``detokenize=False``) need.
        prompts: per-prompt texts of the generate request, indexed by ``Rollout.prompt_index``; default: each
            rollout's ``prompt_text`` (or ``""`` when that is None).
        labels: per-prompt labels, indexed by ``Rollout.prompt_index``; default: each rollout's ``label``.
    """
    prompt_list, response_list, label_list = [], [], []
    decoded = (tokenizer.batch_decode([r.response_token_ids for r in rollouts], skip_special_tokens=True)
               if tokenizer is not None else None)
    for index, rollout in enumerate(rollouts):
        if decoded is None and rollout.response_text is None:
            raise ValueError(f"rollout_texts: rollout {index} has no response_text; build the engine with a "
                             "tokenizer (or decode the responses yourself)")
        for name, per_prompt in (("prompts", prompts), ("labels", labels)):
            if per_prompt is not None and rollout.prompt_index >= len(per_prompt):
                raise ValueError(f"rollout_texts: rollout {index} has prompt_index={rollout.prompt_index} but "
                                 f"{name} has only {len(per_prompt)} entries")
        prompt_list.append(prompts[rollout.prompt_index] if prompts is not None else (rollout.prompt_text or ""))
        response_list.append(decoded[index] if decoded is not None else rollout.response_text)
        label_list.append(labels[rollout.prompt_index] if labels is not None else rollout.label)
    return prompt_list, response_list, label_list


def rollout_columns(rollouts: Sequence[Rollout], columns: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per-rollout dataset columns: ``columns[rollout.prompt_index]`` for each rollout (e.g. a ``PromptBatch``'s
    ``columns``), aligned with :func:`rollout_texts`' lists, for ``apply_reward_function(..., columns=...)``."""
    result = []
    for index, rollout in enumerate(rollouts):
        if rollout.prompt_index >= len(columns):
            raise ValueError(f"rollout_columns: rollout {index} has prompt_index={rollout.prompt_index} but columns "
                             f"has only {len(columns)} entries")
        result.append(dict(columns[rollout.prompt_index]))
    return result
