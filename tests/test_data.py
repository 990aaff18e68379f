"""Prompt datasets (JSONL, Parquet, indexables, chat template, over-long prompts, batching) and the arithmetic task."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from rlhfkit.data import (
    prompt_batch,
    ARITHMETIC_WEIGHTS,
    ArithmeticTask,
    PromptDataset,
    PromptDatasetConfig,
    arithmetic_accuracy,
    arithmetic_reward,
    arithmetic_score,
    arithmetic_score_parts,
)
from rlhfkit.rewards import RewardError, apply_reward_function


RECORDS = [{"question": f"What is {i} + {i + 1}?", "answer": 2 * i + 1, "extra": "x"} for i in range(10)]


class Indexable:
    """Stands in for an HF ``datasets.Dataset``: ``len`` and integer indexing that returns dicts."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return dict(self.rows[index])


def test_jsonl_parquet_and_indexable_give_the_same_prompts(tokenizer, tmp_path):
    config = PromptDatasetConfig(input_key="question", label_key="answer")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
    parquet_module = pytest.importorskip("pyarrow.parquet")
    pyarrow = pytest.importorskip("pyarrow")
    parquet = tmp_path / "prompts.parquet"
    parquet_module.write_table(pyarrow.Table.from_pylist(RECORDS), parquet)
    datasets = [PromptDataset.from_file(jsonl, tokenizer, config), PromptDataset.from_file(parquet, tokenizer, config),
                PromptDataset(Indexable(RECORDS), tokenizer, config)]
    for dataset in datasets:
        assert len(dataset) == 10 and dataset.stats.num_kept == 10 and dataset.stats.num_rejected == 0
        ids, text, label = dataset[3]
        assert text == "What is 3 + 4?" and label == "7"
        assert ids == tokenizer("What is 3 + 4?")["input_ids"]
    assert [d[9] for d in datasets[1:]] == [datasets[0][9]] * 2


def test_chat_template_and_system_prompt(tokenizer):
    records = [{"prompt": "What is 1 + 1?", "label": "2"},
               {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                           {"role": "user", "content": "What is 2 + 2?"}], "label": "4"}]
    dataset = PromptDataset(records, tokenizer, PromptDatasetConfig(apply_chat_template=True, system_prompt="Be brief."))
    assert dataset[0][1] == "<|system|>Be brief.<|end|><|user|>What is 1 + 1?<|end|><|assistant|>"
    assert dataset[1][1] == ("<|system|>Be brief.<|end|><|user|>hi<|end|><|assistant|>yo<|end|><|user|>What is 2 + 2?"
                             "<|end|><|assistant|>")      # a chat prompt without a system message gets it too
    assert dataset[0][0][-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert tokenizer.decode(dataset[0][0]) == dataset[0][1]


def test_overlong_prompts_truncate_reject_error(tokenizer):
    records = [{"prompt": "What is 1 + 2?", "label": "3"}, {"prompt": "the sum of " * 20 + "a and b", "label": "x"},
               {"prompt": "Hi", "label": "0"}]
    full = tokenizer(records[1]["prompt"])["input_ids"]
    limit = 8
    assert len(tokenizer(records[0]["prompt"])["input_ids"]) <= limit < len(full)
    truncated = PromptDataset(records, tokenizer, PromptDatasetConfig(prompt_max_len=limit, on_overlong="truncate"))
    assert len(truncated) == 3 and truncated.stats.num_truncated == 1 and truncated.stats.num_rejected == 0
    assert truncated[1][0] == full[-limit:] and truncated[1][1] == tokenizer.decode(full[-limit:])
    assert truncated.stats.max_prompt_len == limit
    rejected = PromptDataset(records, tokenizer, PromptDatasetConfig(prompt_max_len=limit))
    assert len(rejected) == 2 and rejected.stats.num_rejected == 1 and rejected.stats.num_truncated == 0
    assert [rejected.source_index(i) for i in range(2)] == [0, 2] and rejected[1][2] == "0"
    stats = rejected.stats.as_dict()
    assert stats["data/num_records"] == 3.0 and stats["data/num_rejected"] == 1.0
    with pytest.raises(ValueError, match=rf"record 1 has {len(full)} prompt tokens > prompt_max_len=8"):
        PromptDataset(records, tokenizer, PromptDatasetConfig(prompt_max_len=limit, on_overlong="error"))
    with pytest.raises(ValueError, match="none of the 3 records was kept"):
        PromptDataset(records, tokenizer, PromptDatasetConfig(prompt_max_len=1))


def test_prompt_batch_keeps_order_and_leaves_out_rejected_records(tokenizer):
    records = [{"prompt": "What is 1 + 1?", "label": "2"}, {"prompt": "", "label": "x"},
               {"prompt": "What is 2 + 2?", "label": "4"}]
    with pytest.raises(ValueError, match="record 1"):  # an empty prompt is refused, naming the record
        prompt_batch(records, tokenizer)
    config = PromptDatasetConfig(apply_chat_template=True)
    batch = prompt_batch([records[2], records[0]], tokenizer, config)
    assert batch.labels == ["4", "2"] and batch.indices == [0, 1]  # the records' order, not a shuffle
    alone = next(PromptDataset([records[2]], tokenizer, config).batches(1, seed=0, shuffle=False))
    assert batch.token_ids[0] == alone.token_ids[0] and batch.texts[0] == alone.texts[0]


def test_batches_are_seeded_and_cover_each_prompt_once(tokenizer):
    dataset = PromptDataset(RECORDS, tokenizer, PromptDatasetConfig(input_key="question", label_key="answer"))
    epoch = list(dataset.batches(4, seed=1))
    assert [len(b) for b in epoch] == [4, 4, 2]
    assert sorted(i for b in epoch for i in b.indices) == list(range(10))
    again = list(dataset.batches(4, seed=1))
    assert [b.indices for b in again] == [b.indices for b in epoch]
    assert [b.indices for b in dataset.batches(4, seed=2)] != [b.indices for b in epoch]
    assert [b.indices for b in dataset.batches(4, seed=1, epoch=1)] != [b.indices for b in epoch]
    assert [b.indices for b in dataset.batches(4, seed=1, shuffle=False)][0] == [0, 1, 2, 3]
    assert [len(b) for b in dataset.batches(4, seed=1, drop_last=True)] == [4, 4]
    batch = epoch[0]
    for position, index in enumerate(batch.indices):
        assert (batch.token_ids[position], batch.texts[position], batch.labels[position]) == dataset[index]


def test_stream_crosses_epochs_and_resumes(tokenizer):
    dataset = PromptDataset(RECORDS, tokenizer, PromptDatasetConfig(input_key="question", label_key="answer"))
    run = [b.indices for b in itertools.islice(dataset.stream(3, seed=7), 9)]  # 3 full batches per epoch
    resumed = [b.indices for b in itertools.islice(dataset.stream(3, seed=7, start_step=4), 5)]
    assert resumed == run[4:]
    for epoch in range(3):
        seen = [i for b in run[3 * epoch:3 * epoch + 3] for i in b]
        assert len(set(seen)) == 9
        assert seen == [i for b in list(dataset.batches(3, seed=7, epoch=epoch, drop_last=True)) for i in b.indices]
    with pytest.raises(ValueError, match="batch_size=11"):
        next(dataset.stream(11, seed=0))


def test_dataset_errors(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"record 0 has no column 'prompt' \(columns: \['answer', 'extra', 'question'\]"):
        PromptDataset(RECORDS, tokenizer)
    with pytest.raises(ValueError, match="record 1 has no label column 'label'"):
        PromptDataset([{"prompt": "a", "label": "1"}, {"prompt": "b"}], tokenizer)
    unlabeled = PromptDataset([{"prompt": "b"}], tokenizer, PromptDatasetConfig(label_key=None))
    assert unlabeled[0][2] is None
    with pytest.raises(TypeError, match="prompts must be strings"):
        PromptDataset([{"prompt": ["x"], "label": "1"}], tokenizer)
    with pytest.raises(TypeError, match="use rlhfkit.data.load_prompts"):
        PromptDataset("data.jsonl", tokenizer)
    with pytest.raises(ValueError, match="unknown suffix '.csv'"):
        PromptDataset.from_file(tmp_path / "x.csv", tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        PromptDataset.from_file(bad, tokenizer)
    with pytest.raises(ValueError, match="on_overlong='drop'"):
        PromptDatasetConfig(on_overlong="drop")
    with pytest.raises(ValueError, match="prompt_max_len=0"):
        PromptDatasetConfig(prompt_max_len=0)
    with pytest.raises(ValueError, match="system_prompt is set but apply_chat_template=False"):
        PromptDatasetConfig(system_prompt="x")


def test_jsonl_with_a_non_utf8_byte_names_file_and_line(tokenizer, tmp_path):
    """Review defect 5: a non-UTF-8 byte raised a bare UnicodeDecodeError naming neither the file nor the line."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok", "label": "1"}\n{"prompt": "caf\xe9", "label": "2"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 16\)"):
        PromptDataset.from_file(path, tokenizer)
    bom = tmp_path / "bom.jsonl"                     # sibling: a UTF-8 BOM (Windows editors) is not an error
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "ok", "label": "1"}\n')
    assert PromptDataset.from_file(bom, tokenizer)[0][1] == "ok"


@pytest.mark.parametrize("template", [False, True])
def test_lone_surrogate_names_the_record(tokenizer, tmp_path, template):
    """Review defect 5: a lone surrogate (a JSON "\ud800" escape without its pair) made the tokenizer raise a
    TypeError naming no record."""
    path = tmp_path / "surrogate.jsonl"
    path.write_text('{"prompt": "fine", "label": "1"}\n{"prompt": "bad \\ud800 text", "label": "2"}\n')
    with pytest.raises(ValueError, match=r"record 1 \(line 2\) column 'prompt' holds '\\ud800' at character"):
        PromptDataset.from_file(path, tokenizer, PromptDatasetConfig(apply_chat_template=template))


def test_tokenizer_errors_keep_their_type_and_name_the_record(tokenizer):
    """Review defect 5, sibling: any other tokenizer or chat-template failure keeps its type and gains a note naming
    the record."""

    class Picky:
        def __call__(self, text, **kwargs):
            if "boom" in text:
                raise OverflowError("cannot encode")
            return tokenizer(text, **kwargs)

        def apply_chat_template(self, messages, **kwargs):
            if messages[-1]["content"] == "template boom":
                raise KeyError("role")
            return tokenizer.apply_chat_template(messages, **kwargs)

    records = [{"prompt": "fine", "label": "1"}, {"prompt": "boom", "label": "2"}]
    with pytest.raises(OverflowError, match="cannot encode") as caught:
        PromptDataset(records, Picky())
    assert caught.value.__notes__ == ["while tokenizing PromptDataset: record 1 (column 'prompt')"]
    records[1]["prompt"] = "template boom"
    with pytest.raises(KeyError) as caught:
        PromptDataset(records, Picky(), PromptDatasetConfig(apply_chat_template=True))
    assert caught.value.__notes__ == ["while applying the chat template to PromptDataset: record 1 (column 'prompt')"]


def test_records_of_the_wrong_shape_are_a_clear_type_error(tokenizer):
    """Review defect 5: a dict of columns instead of rows raised ``KeyError: 0``."""
    columns = {"prompt": ["a", "b"], "label": ["1", "2"]}
    with pytest.raises(TypeError, match=r"dict of columns \(keys \['prompt', 'label'\]\); it expects rows"):
        PromptDataset(columns, tokenizer)
    rows = [dict(zip(columns, row)) for row in zip(*columns.values())]     # the conversion the message suggests
    assert [PromptDataset(rows, tokenizer)[i][1] for i in range(2)] == ["a", "b"]
    with pytest.raises(TypeError, match=r"DatasetDict pass one split"):
        PromptDataset({"train": Indexable(rows)}, tokenizer)
    with pytest.raises(TypeError, match="generator, which has no len"):
        PromptDataset((row for row in rows), tokenizer)
    with pytest.raises(TypeError, match="config=...\\) got a dict; pass a PromptDatasetConfig"):
        PromptDataset(rows, tokenizer, {"input_key": "prompt"})


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("prompt_max_len", "8", r"prompt_max_len='8' is a str, expected int or None"),
    ("prompt_max_len", 8.0, r"prompt_max_len=8.0 is a float, expected int or None"),
    ("prompt_max_len", True, r"prompt_max_len=True is a bool, expected int or None"),
    ("input_key", 3, r"input_key=3 is a int, expected str"),
    ("label_key", ["answer"], r"label_key=\['answer'\] is a list, expected str or None"),
    ("apply_chat_template", "yes", r"apply_chat_template='yes' is a str, expected bool"),
    ("system_prompt", 1, r"system_prompt=1 is a int, expected str or None"),
    ("on_overlong", ["reject"], r"on_overlong=\['reject'\] is a list, expected str"),
])
def test_config_fields_of_the_wrong_type_name_field_and_value(field, value, expected):
    """Review defect 5: ``prompt_max_len="8"`` raised a bare TypeError from a comparison; every field's type is
    checked when the config is built."""
    with pytest.raises(TypeError, match=rf"PromptDatasetConfig\.{expected}"):
        PromptDatasetConfig(**{field: value})


@pytest.mark.parametrize("prompt", ["", "   ", [], [{"role": "user", "content": ""}], None])
@pytest.mark.parametrize("template", [False, True])
def test_empty_prompt_is_rejected_with_or_without_chat_template(tokenizer, prompt, template):
    """Review defect 6: an empty prompt was kept when the chat template was on (the template wraps it into a
    non-empty text), but rejected without it."""
    records = [{"prompt": "fine", "label": "1"}, {"prompt": prompt, "label": "2"}]
    config = PromptDatasetConfig(apply_chat_template=template)
    if not template and isinstance(prompt, list):
        error = TypeError                               # without the template a prompt must be a string at all
        match = "record 1 column 'prompt' is a"
    else:
        error, match = ValueError, "record 1 column 'prompt' is an empty prompt"
    with pytest.raises(error, match=match):
        PromptDataset(records, tokenizer, config)


def test_truncation_never_starts_inside_a_multibyte_character(tokenizer):
    """Review defect 6: ``on_overlong="truncate"`` kept the last prompt_max_len tokens even when the first of them
    held only the tail bytes of a character, so the prompt text began with U+FFFD."""
    text = "naïve café — 日本語 ok"
    ids = tokenizer(text)["input_ids"]
    broken = [limit for limit in range(1, len(ids)) if tokenizer.decode(ids[-limit:]).startswith("\ufffd")]
    assert broken, "the tokenizer should split some character over tokens, else this test checks nothing"
    for limit in range(2, len(ids)):
        dataset = PromptDataset([{"prompt": text, "label": "1"}], tokenizer,
                                PromptDatasetConfig(prompt_max_len=limit, on_overlong="truncate"))
        kept, kept_text, _ = dataset[0]
        assert "\ufffd" not in kept_text and text.endswith(kept_text), (limit, kept_text)
        assert kept == ids[-len(kept):] and len(kept) <= limit and len(kept) >= limit - 3
        assert tokenizer.decode(kept) == kept_text
    assert dataset.stats.num_truncated == 1


# ---------------------------------------------------------------- arithmetic task


def test_arithmetic_task_is_deterministic_and_correct():
    task = ArithmeticTask(min_value=0, max_value=50, ops=("+", "-", "*"), seed=3)
    rows = task.records(200)
    assert rows == ArithmeticTask(min_value=0, max_value=50, ops=("+", "-", "*"), seed=3).records(200)
    assert rows != ArithmeticTask(min_value=0, max_value=50, ops=("+", "-", "*"), seed=4).records(200)
    assert task.records(5, start=100) == rows[100:105]
    seen_ops = set()
    for row in rows:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", row["prompt"]).groups()
        seen_ops.add(op)
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["label"] == str(expected) and 0 <= int(a) <= 50 and 0 <= int(b) <= 50
    assert seen_ops == {"+", "-", "*"}
    assert any(int(r["label"]) < 0 for r in rows)
    non_negative = ArithmeticTask(ops=("-",), allow_negative=False).records(100)
    assert all(int(r["label"]) >= 0 for r in non_negative)
    custom = ArithmeticTask(template="Q: {a}{op}{b}=", min_value=7, max_value=7, ops=("+",)).records(1, input_key="q")
    assert custom == [{"q": "Q: 7+7=", "label": "14"}]
    with pytest.raises(ValueError, match="ops=\\('/',\\)"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="lacks the field {b}"):
        ArithmeticTask(template="{a} {op}")
    with pytest.raises(ValueError, match="min_value=5 > max_value=1"):
        ArithmeticTask(min_value=5, max_value=1)


# Hand-worked: (response, label, expected score). Weights 0.1 digit_fraction, 0.1 concise, 0.1 form, 0.3 digits,
# 0.4 exact; concise = min(1, (len(label) + 2) / len(text)).
HAND_CASES = [
    ("68", "68", 1.0),
    ("  68\n", "68", 1.0),
    ("The answer is 68.", "68", 0.1 * 2 / 17 + 0.1 * 4 / 17 + 0.3 + 0.4),
    ("58", "68", 0.1 + 0.1 + 0.1 + 0.3 * 1 / 2),
    ("8", "68", 0.1 + 0.1 + 0.1 + 0.3 * 1 / 2),
    ("168", "68", 0.1 + 0.1 + 0.1 + 0.3 * 2 / 3),
    ("-5", "-5", 1.0),
    ("5", "-5", 0.1 + 0.1 + 0.1 + 0.3),
    ("12 then 68", "68", 0.1 * 4 / 10 + 0.1 * 4 / 10 + 0.3 + 0.4),
    ("abc", "68", 0.0),
    ("", "68", 0.0),
    ("\uff16\uff18", "68", 0.0),  # full-width digits are not ASCII digits
    ("68 68 68 68", "68", 0.1 * 8 / 11 + 0.1 * 4 / 11 + 0.3 + 0.4),
    ("x7", "7", 0.1 * 1 / 2 + 0.1 * 1 + 0.3 + 0.4),
]


@pytest.mark.parametrize(("field", "value"), [("min_value", "0"), ("max_value", 2.5), ("seed", None),
                                             ("allow_negative", "no"), ("template", 5), ("min_value", True)])
def test_arithmetic_task_fields_of_the_wrong_type(field, value):
    """Review defect 5 (sibling in ArithmeticTask): a field of the wrong type raised a bare TypeError from a comparison
    (``min_value="0"``) or was accepted (``allow_negative="no"`` is truthy)."""
    with pytest.raises(TypeError, match=rf"ArithmeticTask\.{field}={re.escape(repr(value))} is a"):
        ArithmeticTask(**{field: value})


@pytest.mark.parametrize("response,label,expected", HAND_CASES)
def test_arithmetic_score_hand_worked(response, label, expected):
    assert arithmetic_score(response, label) == pytest.approx(expected, abs=1e-12)


def test_arithmetic_parts_weights_and_graded_order():
    assert sum(ARITHMETIC_WEIGHTS.values()) == pytest.approx(1.0)
    parts = arithmetic_score_parts("The answer is 68.", "68")
    assert parts == pytest.approx({"digit_fraction": 2 / 17, "concise": 4 / 17, "form": 0.0, "digits": 1.0,
                                   "exact": 1.0})
    # graded: gibberish < some digits < a short number < right units digit < exact
    ladder = ["hello there", "hello 3 there", "3", "8", "68"]
    scores = [arithmetic_score(r, "68") for r in ladder]
    assert scores == sorted(scores) and len(set(scores)) == len(scores)
    with pytest.raises(ValueError, match="label='6.5' is not an integer"):
        arithmetic_score("6", "6.5")


def test_arithmetic_reward_with_apply_and_accuracy():
    responses, labels = ["68", "12", "nope", "The answer is 5"], ["68", "13", "4", "5"]
    scores, report = apply_reward_function(arithmetic_reward, ["q"] * 4, responses, labels, batch_size=3)
    assert scores == [arithmetic_score(r, l) for r, l in zip(responses, labels)]
    assert report.num_failed == 0
    assert arithmetic_accuracy(responses, labels) == 0.5
    with pytest.raises(RewardError) as info:
        apply_reward_function(arithmetic_reward, ["q"] * 4, responses, ["68", None, "4", "5"], batch_size=4)
    assert info.value.indices == [1] and "has no label" in str(info.value)
    with pytest.raises(ValueError, match="same non-zero number"):
        arithmetic_accuracy([], [])


def test_random_responses_score_low_but_not_zero():
    """The reward's first-step signal: random byte soup scores > 0 on average, far below a correct answer."""
    import random

    rng = random.Random(0)
    alphabet = "abcdefgh ijklm?!.0123456789"
    task = ArithmeticTask()
    rows = task.records(300)
    responses = ["".join(rng.choice(alphabet) for _ in range(rng.randint(3, 20))) for _ in rows]
    mean = sum(arithmetic_score(r, row["label"]) for r, row in zip(responses, rows)) / len(rows)
    assert 0.02 < mean < 0.3
