"""Math answer rewards on HF's ``math-verify``: GSM8K (strict and lenient) and MATH-style answers.

Part of :mod:`rlhfkit.rewards` (re-exported there). Answers are compared by ``math_verify.parse``/``verify``
(symbolic equality: ``"0.5"`` equals ``"\\frac{1}{2}"``), not by a hand-written parser. Needs ``rlhfkit[math]``,
imported when a reward first runs. math-verify's own timeouts use ``signal.alarm``, which works on the main thread
only (elsewhere every call would fail and score 0); these rewards run in :func:`apply_reward_function`'s worker
threads, so they turn those timeouts off (``parsing_timeout=None``, ``timeout_seconds=None``) and rely on
``apply_reward_function(timeout_s=...)`` to bound a call.

What it does not do: extract answers from free-form text beyond "after ``####``" (GSM8K strict), "the last number"
(GSM8K lenient) and what math-verify's extraction finds (``\\boxed{}``, LaTeX, expressions) for :func:`math_reward`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlhfkit._optional import require

__all__ = ["gsm8k_reference", "gsm8k_strict_reward", "gsm8k_lenient_reward", "math_reward"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _math_verify():
    return require("math_verify", "math", user="rlhfkit.rewards (math answer rewards)")


def _plain_number(text: str) -> str:
    """``"1,080"`` -> ``"1080"``; a trailing full stop or dollar sign around it dropped."""
    return _THOUSANDS.sub("", text.strip()).strip("$ ").rstrip(".")


def gsm8k_reference(answer: str) -> str:
    """The reference number of a GSM8K ``answer`` column: the text after its last ``#### ``, commas removed
    (``"...\\n#### 1,080"`` -> ``"1080"``). A text without ``####`` is returned stripped, as an already bare answer."""
    if not isinstance(answer, str):
        raise TypeError(f"gsm8k_reference(answer={answer!r}) is a {type(answer).__name__}; pass the answer text")
    reference = _plain_number(answer.rpartition("####")[2])
    if not reference:
        raise ValueError(f"gsm8k_reference: no answer after '####' in {answer[-80:]!r}")
    return reference


def _equal(reference: str, candidate: str) -> bool:
    """math-verify's equality of two answer texts, without signal-based timeouts (thread-safe)."""
    math_verify = _math_verify()
    gold = math_verify.parse(reference, parsing_timeout=None)
    if not gold:
        gold = math_verify.parse(f"${reference}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {reference!r}")
    answer = math_verify.parse(candidate, parsing_timeout=None)
    return bool(answer) and bool(math_verify.verify(gold, answer, timeout_seconds=None))


def _labels(labels: Sequence[str | None]) -> list[str]:
    for index, label in enumerate(labels):
        if label is None:
            raise ValueError(f"math reward: sample {index} has no label; set PromptDatasetConfig.label_key to the "
                             "answer column (e.g. 'answer' for GSM8K)")
    return [gsm8k_reference(label) for label in labels]


def gsm8k_strict_reward(prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str | None]) -> list[float]:
    """1.0 where the response's answer after its last ``####`` (to the end of that line) equals the reference, else
    0.0 (also when the response has no ``####``). Labels are GSM8K ``answer`` texts or bare references."""
    scores = []
    for response, reference in zip(responses, _labels(labels)):
        if "####" not in response:
            scores.append(0.0)
            continue
        span = _plain_number(response.rpartition("####")[2].strip().split("\n", 1)[0])
        scores.append(float(bool(span) and _equal(reference, span)))
    return scores


def gsm8k_lenient_reward(prompts: Sequence[str], responses: Sequence[str],
                         labels: Sequence[str | None]) -> list[float]:
    """1.0 where the last number in the response equals the reference (commas in numbers allowed), else 0.0."""
    scores = []
    for response, reference in zip(responses, _labels(labels)):
        numbers = _NUMBER.findall(response)
        scores.append(float(bool(numbers) and _equal(reference, _plain_number(numbers[-1]))))
    return scores


def math_reward(prompts: Sequence[str], responses: Sequence[str], labels: Sequence[str | None]) -> list[float]:
    """1.0 where math-verify finds in the response an answer equal to the label (MATH-style: ``\\boxed{}``, LaTeX
    or a plain expression; e.g. label ``"\\frac{1}{2}"`` and response ``"... \\boxed{0.5}"``), else 0.0."""
    scores = []
    for index, (response, label) in enumerate(zip(responses, labels)):
        if label is None:
            raise ValueError(f"math_reward: sample {index} has no label; set PromptDatasetConfig.label_key")
        scores.append(float(_equal(label, response)))
    return scores
