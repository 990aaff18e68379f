"""Math answer rewards on math-verify: GSM8K references, strict and lenient scores, MATH-style answers, and calls
from worker threads (math-verify's signal-based timeouts work on the main thread only)."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlhfkit.rewards import (
    apply_reward_function,
    apply_reward_functions,
    gsm8k_lenient_reward,
    gsm8k_reference,
    gsm8k_strict_reward,
    math_reward,
)

pytest.importorskip("math_verify")
GSM8K = Path(__file__).parent / "fixtures" / "gsm8k"
ROWS = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()]


def test_gsm8k_reference_of_the_fixture_answers():
    references = [gsm8k_reference(row["answer"]) for row in ROWS]
    assert references[:3] == ["72", "10", "5"] and references[6:] == ["1080", "850000"]   # commas removed
    assert gsm8k_reference(" 42 ") == "42"
    with pytest.raises(ValueError, match="no answer after '####'"):
        gsm8k_reference("reasoning\n####   ")


RESPONSES = ["She sold 72 clips.\n#### 72", "so 1,080 in all\n#### 1,080", "#### 1080.0", "It is 72, not 70",
             "#### 73\nthen 72", "no number", "The answer: 850,000"]
LABELS = [ROWS[0]["answer"], ROWS[6]["answer"], "1080", "72", "72", "72", ROWS[7]["answer"]]


def test_strict_and_lenient_scores():
    prompts = [""] * len(RESPONSES)
    assert gsm8k_strict_reward(prompts, RESPONSES, LABELS) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert gsm8k_lenient_reward(prompts, RESPONSES, LABELS) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="sample 0 has no label"):
        gsm8k_strict_reward([""], ["#### 1"], [None])


def test_math_answers_are_compared_symbolically():
    responses = ["So the answer is $\\boxed{0.5}$.", "$\\boxed{\\frac{2}{4}}$", "\\boxed{3}", "nothing"]
    assert math_reward([""] * 4, responses, ["\\frac{1}{2}", "$\\frac12$", "4", "1"]) == [1.0, 1.0, 0.0, 0.0]


def test_rewards_work_from_worker_threads():
    """apply_reward_function runs sync rewards in worker threads: math-verify's default (signal) timeouts raise
    there, so without the rewards' timeout switch every sample would fail."""
    math_verify = pytest.importorskip("math_verify")
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError):             # the default: signal-based timeouts, main thread only
            pool.submit(math_verify.parse, "72", raise_on_error=True).result()
        threaded = pool.submit(gsm8k_strict_reward, [""] * 7, RESPONSES, LABELS).result()
    assert threaded == gsm8k_strict_reward([""] * 7, RESPONSES, LABELS)
    total, reports = apply_reward_functions([gsm8k_strict_reward, gsm8k_lenient_reward], [""] * 7, RESPONSES, LABELS)
    assert total == [2.0, 2.0, 2.0, 0.0, 1.0, 0.0, 1.0] and all(r.num_failed == 0 for r in reports)
    scores, report = apply_reward_function(math_reward, ["", ""], ["\\boxed{2}", "\\boxed{3}"], ["2", "2"],
                                           batch_size=1, max_workers=2)
    assert scores == [1.0, 0.0] and report.num_failed == 0


def test_missing_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'rlhfkit\[math\]'"):
        gsm8k_strict_reward([""], ["#### 1"], ["1"])
