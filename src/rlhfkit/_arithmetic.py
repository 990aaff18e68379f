"""The built-in verifiable task: integer arithmetic questions with a graded rule-based reward.

Re-exported by :mod:`rlhfkit.data`. Prompts look like ``"What is 23 + 45?"`` with label ``"68"``. The reward gives
partial credit so that even a tiny random-weight model gets a learning signal from the first step (see
:func:`arithmetic_score_parts` for the formula). Deterministic, pure Python, no dependencies.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ArithmeticTask",
    "arithmetic_score_parts",
    "arithmetic_score",
    "arithmetic_reward",
    "arithmetic_accuracy",
    "ARITHMETIC_WEIGHTS",
]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INTEGER = re.compile(r"-?[0-9]+")
_DIGITS = frozenset("0123456789")

#: Weight of each part of the arithmetic score; they sum to 1, so scores lie in [0, 1].
ARITHMETIC_WEIGHTS = {"digit_fraction": 0.1, "concise": 0.1, "form": 0.1, "digits": 0.3, "exact": 0.4}
_CONCISE_SLACK = 2  # characters allowed beyond the label before the conciseness credit starts to shrink


@dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    """Integer arithmetic questions ``a op b`` with ``a, b`` uniform in ``[min_value, max_value]``.

    Problem ``i`` depends only on ``(seed, i)``, so any range of problems can be regenerated (use disjoint index
    ranges, e.g. ``records(n, start=10**6)``, for an evaluation set; with a small value range, problems can repeat).

    Attributes:
        min_value, max_value: operand range (inclusive).
        ops: operators to draw from, any of ``"+"``, ``"-"``, ``"*"``.
        template: prompt text with ``{a}``, ``{op}`` and ``{b}`` fields.
        allow_negative: if False, ``a - b`` swaps the operands when ``b > a`` so answers stay >= 0.
        seed: seed of the problem stream.
    """

    min_value: int = 0
    max_value: int = 20
    ops: tuple[str, ...] = ("+", "-")
    template: str = "What is {a} {op} {b}?"
    allow_negative: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for field, wanted in (("min_value", int), ("max_value", int), ("template", str), ("allow_negative", bool),
                              ("seed", int)):
            value = getattr(self, field)
            if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
                raise TypeError(f"ArithmeticTask.{field}={value!r} is a {type(value).__name__}; pass a "
                                f"{wanted.__name__}")
        if self.min_value > self.max_value:
            raise ValueError(f"ArithmeticTask.min_value={self.min_value} > max_value={self.max_value}; swap them")
        if not isinstance(self.ops, tuple) or not self.ops or any(op not in _OPS for op in self.ops):
            raise ValueError(f"ArithmeticTask.ops={self.ops!r}; use a non-empty tuple of {tuple(_OPS)}")
        for field in ("{a}", "{op}", "{b}"):
            if field not in self.template:
                raise ValueError(f"ArithmeticTask.template={self.template!r} lacks the field {field}")

    def problem(self, index: int) -> tuple[str, str]:
        """Prompt text and label (the exact integer answer as a string) of problem ``index``."""
        if index < 0:
            raise ValueError(f"ArithmeticTask.problem(index={index}); index must be >= 0")
        rng = random.Random(f"{self.seed}:{index}")
        a = rng.randint(self.min_value, self.max_value)
        b = rng.randint(self.min_value, self.max_value)
        op = self.ops[rng.randrange(len(self.ops))]
        if op == "-" and not self.allow_negative and b > a:
            a, b = b, a
        return self.template.format(a=a, op=op, b=b), str(_OPS[op](a, b))

    def records(self, num: int, *, start: int = 0, input_key: str = "prompt",
                label_key: str = "label") -> list[dict[str, str]]:
        """Problems ``start .. start + num - 1`` as dicts, ready for :class:`rlhfkit.data.PromptDataset`."""
        if num < 1:
            raise ValueError(f"ArithmeticTask.records(num={num}); need at least one problem")
        rows = []
        for index in range(start, start + num):
            prompt, label = self.problem(index)
            rows.append({input_key: prompt, label_key: label})
        return rows


def _last_integer(text: str) -> str | None:
    matches = _INTEGER.findall(text)
    return matches[-1] if matches else None


def arithmetic_score_parts(response: str, label: str) -> dict[str, float]:
    """Each credit of the arithmetic score, before weighting (all in [0, 1]).

    With ``text = response.strip()`` and ``answer`` the last integer (``-?[0-9]+``) in ``text``:

    - a response with no ASCII digit scores 0 in every part;
    - ``digit_fraction``: share of ``text``'s characters that belong to integers (matches of ``-?[0-9]+``);
    - ``concise``: ``min(1, (len(label) + 2) / len(text))`` — rambling shrinks it;
    - ``form``: 1 if ``text`` is just an integer (``-?[0-9]+``);
    - ``digits``: the answer's and the label's digits (signs ignored) compared right-aligned (units with units, tens
      with tens), ``matches / max(len(answer digits), len(label digits))``;
    - ``exact``: 1 if ``int(answer) == int(label)``.

    The score is ``sum(ARITHMETIC_WEIGHTS[k] * parts[k])``.
    """
    label = label.strip()
    if not _INTEGER.fullmatch(label):
        raise ValueError(f"arithmetic reward: label={label!r} is not an integer; labels must look like '68' or '-3'")
    text = response.strip()
    parts = dict.fromkeys(ARITHMETIC_WEIGHTS, 0.0)
    num_digits = sum(char in _DIGITS for char in text)
    if num_digits == 0:
        return parts
    parts["digit_fraction"] = sum(len(match) for match in _INTEGER.findall(text)) / len(text)
    parts["concise"] = min(1.0, (len(label) + _CONCISE_SLACK) / len(text))
    parts["form"] = float(_INTEGER.fullmatch(text) is not None)
    answer = _last_integer(text)
    if answer is not None:
        got, want = answer.lstrip("-"), label.lstrip("-")
        matches = sum(g == w for g, w in zip(reversed(got), reversed(want)))
        parts["digits"] = matches / max(len(got), len(want))
        parts["exact"] = float(int(answer) == int(label))
    return parts


def arithmetic_score(response: str, label: str) -> float:
    """The graded score in [0, 1] of one response (formula: :func:`arithmetic_score_parts`)."""
    parts = arithmetic_score_parts(response, label)
    return sum(ARITHMETIC_WEIGHTS[name] * value for name, value in parts.items())


def arithmetic_reward(prompts: Sequence[str], responses: Sequence[str],
                      labels: Sequence[str | None]) -> list[float]:
    """Reward function (``fn(prompts, responses, labels) -> scores``) for :func:`rlhfkit.rewards.apply_reward_function`.

    Raises ValueError for a missing or non-integer label (reported per sample by ``apply_reward_function``)."""
    if not len(prompts) == len(responses) == len(labels):
        raise ValueError(f"arithmetic_reward: got {len(prompts)} prompts, {len(responses)} responses and "
                         f"{len(labels)} labels; they must have the same length")
    scores = []
    for index, (response, label) in enumerate(zip(responses, labels)):
        if label is None:
            raise ValueError(f"arithmetic_reward: sample {index} has no label; the arithmetic task needs labels")
        scores.append(arithmetic_score(response, label))
    return scores


def arithmetic_accuracy(responses: Sequence[str], labels: Sequence[str]) -> float:
    """Share of responses whose last integer equals the label (the ``exact`` credit), in [0, 1]."""
    if len(responses) != len(labels) or not responses:
        raise ValueError(f"arithmetic_accuracy: got {len(responses)} responses and {len(labels)} labels; need the "
                         "same non-zero number")
    correct = sum(arithmetic_score_parts(r, l)["exact"] for r, l in zip(responses, labels))
    return correct / len(responses)
