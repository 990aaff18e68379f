"""rlhfkit.evaluation: pass@k's estimator by hand, EvalConfig's checks, and a real evaluation through the HF engine
with its samples logged next to the metrics (rlhfkit.metrics)."""

from __future__ import annotations

import json
import math

import pytest

from rlhfkit.evaluation import EvalConfig, EvalResult, evaluate, pass_at_k, should_evaluate


def test_pass_at_k_is_the_unbiased_estimator():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # n - c < k: any k samples hold a correct one
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is the share of correct samples
    # by enumeration: the share of 3-subsets of 6 samples (2 correct) holding a correct one
    import itertools
    subsets = list(itertools.combinations(range(6), 3))
    assert pass_at_k(6, 2, 3) == pytest.approx(sum(any(i < 2 for i in s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError, match="num_correct=5"):
        pass_at_k(4, 5, 1)


def test_eval_config_names_field_value_and_fix():
    with pytest.raises(ValueError, match="k=5 exceeds num_samples=4"):
        EvalConfig(num_samples=4, k=5)
    with pytest.raises(ValueError, match="temperature=0"):
        EvalConfig(temperature=0.0)
    with pytest.raises(TypeError, match="every_steps=True"):
        EvalConfig(every_steps=True)
    assert [should_evaluate(step, EvalConfig(every_steps=2)) for step in range(4)] == [True, False, True, False]
    assert not should_evaluate(0, EvalConfig(every_steps=0))
    result = EvalResult(num_prompts=2, accuracy=0.5, mean_score=0.25, mean_response_tokens=3.0, pass_at_k=0.75, k=2)
    assert result.as_metrics() == {"eval/accuracy": 0.5, "eval/mean_score": 0.25, "eval/mean_response_tokens": 3.0,
                                   "eval/num_prompts": 2.0, "eval/pass@2": 0.75}


def test_evaluate_through_the_hf_engine_and_log_the_samples(tiny_llama_path, tokenizer, tmp_path):
    from rlhfkit.data import PromptDataset, PromptDatasetConfig
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig
    from rlhfkit.metrics import MetricsLogger

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path), max_batch_size=8))
    records = [{"prompt": f"{a} + {a}", "label": str(2 * a)} for a in range(5)]
    held_out = PromptDataset(records, tokenizer, PromptDatasetConfig())
    prompts = next(held_out.batches(len(held_out), seed=0, shuffle=False))

    def even_length(prompts, responses, labels):  # a reward the random model meets about half the time
        return [float(len(r) % 2 == 0) for r in responses]

    config = EvalConfig(max_new_tokens=5, num_samples=4, k=2, num_logged_samples=3, batch_size=5)
    result = evaluate(engine, prompts, [even_length], config)
    assert result.num_prompts == 5 and len(result.samples) == 3
    greedy = [sample["score"] for sample in result.samples]
    assert greedy == [float(len(sample["response"]) % 2 == 0) for sample in result.samples]
    assert result.samples[0]["prompt"] == prompts.texts[0] and result.samples[0]["label"] == "0"
    assert 0 < result.mean_response_tokens <= 5 and 0 <= result.accuracy <= 1 and 0 <= result.pass_at_k <= 1
    # the samples are seeded: the same result again; greedy does not depend on the batching
    assert evaluate(engine, prompts, [even_length], config) == result
    batched = evaluate(engine, prompts, [even_length], EvalConfig(max_new_tokens=5, num_samples=0, batch_size=2,
                                                                  num_logged_samples=3))
    assert (batched.samples, batched.accuracy, batched.pass_at_k) == (result.samples, result.accuracy, None)
    # pass@k by hand from the same draws
    from rlhfkit.engines import SamplingConfig
    draws = engine.generate(prompts.token_ids, SamplingConfig(n=4, max_new_tokens=5, seed=0))
    correct = [0] * 5
    for rollout in draws:
        correct[rollout.prompt_index] += len(rollout.response_text) % 2 == 0
    assert result.pass_at_k == pytest.approx(sum(pass_at_k(4, c, 2) for c in correct) / 5)

    with MetricsLogger(tmp_path) as metrics:
        metrics.log(0, {"loss": 1.0} | result.as_metrics())
        metrics.log_samples(0, result.samples)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["eval/pass@2"] == pytest.approx(result.pass_at_k) and not math.isnan(row["eval/accuracy"])
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [line["response"] for line in lines] == [sample["response"] for sample in result.samples]
    assert lines[0]["step"] == 0 and lines[0]["name"] == "eval/samples"


def test_metrics_logger_resume_drops_later_rows_and_appends(tmp_path):
    """A resumed run (resume_step=2) keeps steps 0-1, drops the killed run's steps 2-3 and its torn last line, and
    appends: each step once. Without resume_step the file starts afresh."""
    from rlhfkit.metrics import MetricsLogger

    with MetricsLogger(tmp_path) as metrics:
        for step in range(4):
            metrics.log(step, {"loss": float(step)})
            metrics.log_samples(step, [{"prompt": "p", "response": str(step), "score": 0.0}])
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4.0, "lo')  # killed mid-write
    with MetricsLogger(tmp_path, resume_step=2) as metrics:
        assert [row["step"] for row in metrics.rows] == [0.0, 1.0]
        metrics.log(2, {"loss": 20.0})
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0.0, 1.0, 2.0]
    assert [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [0, 1]
    with pytest.raises(ValueError, match="resume_step=-1"):
        MetricsLogger(tmp_path, resume_step=-1)
    MetricsLogger(tmp_path).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
