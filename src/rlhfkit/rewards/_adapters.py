"""Reward functions written for TRL or verl, used unchanged; and reward functions named by a string.

Part of :mod:`rlhfkit.rewards` (re-exported there). :func:`trl_reward` and :func:`verl_reward` wrap a function in
rlhfkit's protocol ``fn(prompts, responses, labels, *, columns) -> list[float]``; :func:`load_reward_function` imports
``module:function`` or ``path/to/file.py:function`` (for recipes' ``--reward`` flags). Needs only the standard
library: the wrapped functions bring their own dependencies.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlhfkit.rewards._functions import function_name

__all__ = ["trl_reward", "verl_reward", "load_reward_function"]

# Columns TRL's GRPOTrainer does not forward as keyword lists (it passes them as prompts/completions/completion_ids).
_TRL_RESERVED = ("prompt", "completion", "completion_ids")


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) and "role" in m for m in prompt)


def _discard(*args: Any) -> None:
    """The default ``log_metric``/``log_extra`` of :func:`trl_reward`: drops what it is given."""


def _trl_arguments(prompts: Sequence[str], responses: Sequence[str], columns: Sequence[Mapping[str, Any]],
                   prompt_key: str, log_metric: Callable, log_extra: Callable) -> dict[str, Any]:
    """The keyword arguments TRL's ``GRPOTrainer._calculate_rewards`` gives a reward function."""
    raw = [column.get(prompt_key, text) for column, text in zip(columns, prompts)]
    conversational = bool(raw) and _is_chat(raw[0])
    keys = list(dict.fromkeys(key for column in columns for key in column if key not in _TRL_RESERVED
                              and key != prompt_key))
    arguments = {key: [column.get(key) for column in columns] for key in keys}
    arguments.update(
        prompts=list(raw) if conversational else [r if isinstance(r, str) else t for r, t in zip(raw, prompts)],
        completions=[[{"role": "assistant", "content": r}] for r in responses] if conversational else list(responses),
        completion_ids=[column.get("completion_ids") for column in columns], trainer_state=None,
        log_metric=log_metric, log_extra=log_extra)
    return arguments


def trl_reward(fn: Callable, *, prompt_key: str = "prompt", none_score: float = 0.0,
               log_metric: Callable[[str, float], None] | None = None,
               log_extra: Callable[[str, list], None] | None = None) -> Callable:
    """A TRL reward function ``fn(prompts, completions, **columns) -> list[float | None]`` as an rlhfkit one.

    ``fn`` is called the way TRL's ``GRPOTrainer`` calls it: ``prompts`` are the dataset's prompts (column
    ``prompt_key``; the formatted text when a sample has no such column), ``completions`` are the response strings,
    or ``[{"role": "assistant", "content": ...}]`` lists when the prompts are chat messages (TRL's conversational
    format); every other column comes as a keyword list; ``completion_ids`` is each sample's ``"completion_ids"``
    column (None when absent), ``trainer_state`` is None, and ``log_metric(name, value)`` /
    ``log_extra(column, values)`` are the callables given here (by default they drop what they get). A None score
    (TRL: "does not apply to this sample") becomes ``none_score``. An ``async def`` stays async.
    """
    if not callable(fn):
        raise TypeError(f"trl_reward(fn={fn!r}): not callable; pass fn(prompts, completions, **kwargs)")

    def scores(values: Sequence[float | None]) -> list[float | None]:
        if isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__iter__"):
            return values               # the wrong shape: apply_reward_function reports it
        return [none_score if value is None else value for value in values]

    loggers = (log_metric or _discard, log_extra or _discard)
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        async def reward(prompts, responses, labels, *, columns):
            return scores(await fn(**_trl_arguments(prompts, responses, columns, prompt_key, *loggers)))
    else:
        def reward(prompts, responses, labels, *, columns):
            return scores(fn(**_trl_arguments(prompts, responses, columns, prompt_key, *loggers)))
    reward.__name__ = reward.__qualname__ = function_name(fn)
    return reward


def _lookup(column: Mapping[str, Any], key: str, what: str) -> Any:
    """``column[key]``, a dotted key reaching into nested dicts (``"reward_model.ground_truth"``)."""
    value: Any = column
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise ValueError(f"verl_reward: no column {key!r} for {what} (columns: {sorted(column)}); set "
                           f"verl_reward(..., {what}_key=...)")
        value = value[part]
    return value


def verl_reward(fn: Callable, *, data_source_key: str = "data_source",
                ground_truth_key: str | None = "reward_model.ground_truth",
                extra_info_key: str | None = "extra_info") -> Callable:
    """A verl ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`` as an
    rlhfkit reward function.

    Per sample, as verl's reward managers call it: ``data_source`` is the ``data_source_key`` column,
    ``ground_truth`` the ``ground_truth_key`` column (dotted keys reach into dicts, as verl's
    ``reward_model.ground_truth``; None takes the sample's label), ``extra_info`` the ``extra_info_key`` column (None
    when absent). A dict result gives its ``"score"``. A missing column raises ValueError naming it (reported with the
    sample index by :func:`apply_reward_function`).
    """
    if not callable(fn):
        raise TypeError(f"verl_reward(fn={fn!r}): not callable; pass compute_score(data_source, solution_str, "
                        "ground_truth, extra_info=None)")
    name = function_name(fn)

    def one(response: str, label: str | None, column: Mapping[str, Any]) -> Any:
        truth = label if ground_truth_key is None else _lookup(column, ground_truth_key, "ground_truth")
        extra = column.get(extra_info_key) if extra_info_key is not None else None
        result = fn(data_source=_lookup(column, data_source_key, "data_source"), solution_str=response,
                    ground_truth=truth, extra_info=extra)
        if isinstance(result, Mapping):
            if "score" not in result:
                raise ValueError(f"verl reward {name!r} returned a dict without 'score' (keys {sorted(result)})")
            return result["score"]
        return result

    def reward(prompts, responses, labels, *, columns):
        return [one(r, label, c) for r, label, c in zip(responses, labels, columns)]

    reward.__name__ = reward.__qualname__ = name
    return reward


def _load_file(path: Path, spec: str):
    if not path.is_file():
        raise ValueError(f"load_reward_function({spec!r}): no such file {str(path)!r}")
    module_name = f"rlhfkit_reward_{path.stem}_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module      # dataclasses and pickling look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[module_name]
        error.add_note(f"while loading reward function file {str(path)!r} for load_reward_function({spec!r})")
        raise
    return module


def load_reward_function(spec: str) -> Callable:
    """The function named by ``"module:function"`` or ``"path/to/file.py:function"`` (a dotted attribute path after
    the colon is followed, e.g. ``"rewards.py:Scorer.score"``). Errors name the spec."""
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise ValueError(f"load_reward_function({spec!r}): expected 'module:function' or 'path/to/file.py:function'")
    where, _, attribute = spec.rpartition(":")
    if not where or not attribute:
        raise ValueError(f"load_reward_function({spec!r}): expected 'module:function' or 'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(Path(where), spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            error.add_note(f"while importing module {where!r} for load_reward_function({spec!r})")
            raise
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise ValueError(f"load_reward_function({spec!r}): {where!r} has no {attribute!r} (callables: "
                             f"{public[:20]})")
        value = getattr(value, part)
    if not callable(value):
        raise TypeError(f"load_reward_function({spec!r}): {attribute!r} is a {type(value).__name__}, not callable")
    return value
