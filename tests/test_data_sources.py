"""load_prompts: sources (Dataset, DatasetDict, folder, hub cache, JSONL, Parquet, lists), held-out splits, columns,
tokenization through datasets.map (same result as the plain path, cached), chat prompts, errors naming the source."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from rlhfkit.data import PromptDataset, PromptDatasetConfig, load_prompts

datasets = pytest.importorskip("datasets")

GSM8K = Path(__file__).parent / "fixtures" / "gsm8k"
CONFIG = PromptDatasetConfig(input_key="question", label_key="answer")


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (GSM8K / name).read_text().splitlines()]


def test_folder_with_a_named_eval_split_keeps_every_column(tokenizer):
    train, held_out = load_prompts(GSM8K, tokenizer, CONFIG, eval_split="test")
    assert (len(train), len(held_out)) == (8, 4)
    assert train[0][1] == rows("train.jsonl")[0]["question"] and train[0][2].endswith("#### 72")
    batch = next(train.batches(3, seed=0, shuffle=False))
    assert batch.columns == rows("train.jsonl")[:3]             # every column, as stored
    assert batch.labels == [r["answer"] for r in rows("train.jsonl")[:3]]
    assert held_out.columns(3) == rows("test.jsonl")[3]


def test_dataset_dict_and_dataset_sources(tokenizer):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows("train.jsonl")),
                                   "test": datasets.Dataset.from_list(rows("test.jsonl"))})
    train, held_out = load_prompts(splits, tokenizer, CONFIG, eval_split="test")
    assert (len(train), len(held_out)) == (8, 4)
    with pytest.raises(ValueError, match=r"no split 'validation' \(splits: \['test', 'train'\]\)"):
        load_prompts(splits, tokenizer, CONFIG, eval_split="validation")
    only, none = load_prompts(splits["train"], tokenizer, CONFIG)
    assert none is None and [only[i] for i in range(8)] == [train[i] for i in range(8)]


def test_hub_id_from_the_offline_cache(tokenizer, tmp_path, monkeypatch):
    """A hub dataset as datasets caches it (<cache>/<owner>___<name>/<config>/<version>/<hash>/), read offline."""
    built = tmp_path / "build"
    from datasets.packaged_modules.json.json import Json
    Json(cache_dir=str(built), dataset_name="gsm8k", config_name="main",
         data_files={"train": str(GSM8K / "train.jsonl"), "test": str(GSM8K / "test.jsonl")}).download_and_prepare()
    cache = tmp_path / "cache"
    target = cache / "openai___gsm8k" / "main" / "0.0.0"
    target.mkdir(parents=True)
    shutil.move(str(next(built.glob("gsm8k/main-*/0.0.0"))), str(target / "fixture"))
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    train, held_out = load_prompts("openai/gsm8k", tokenizer, CONFIG, subset="main", eval_split="test")
    assert (len(train), len(held_out)) == (8, 4) and held_out.columns(0) == rows("test.jsonl")[0]
    with pytest.raises(Exception) as caught:                 # not cached: datasets' own error, with a note
        load_prompts("nobody/missing", tokenizer, CONFIG)
    assert any("HF_HUB_OFFLINE=1" in note for note in caught.value.__notes__)


def test_eval_size_holds_out_the_same_rows_for_a_seed(tokenizer, tmp_path):
    path = tmp_path / "train.jsonl"
    shutil.copy(GSM8K / "train.jsonl", path)
    train, held_out = load_prompts(path, tokenizer, CONFIG, eval_size=3, seed=1)
    again, held_again = load_prompts(rows("train.jsonl"), tokenizer, CONFIG, eval_size=3, seed=1)
    questions = {r["question"] for r in rows("train.jsonl")}
    held = {held_out[i][1] for i in range(3)}
    assert held == {held_again[i][1] for i in range(3)}     # a file and a list hold out the same rows
    assert held | {train[i][1] for i in range(5)} == questions and len(held) == 3
    other = load_prompts(path, tokenizer, CONFIG, eval_size=3, seed=2)[1]
    assert {other[i][1] for i in range(3)} != held
    with pytest.raises(ValueError, match=r"eval_size=8.*has 8 records; pass an int in 1..7"):
        load_prompts(path, tokenizer, CONFIG, eval_size=8)
    with pytest.raises(ValueError, match="cannot be combined"):
        load_prompts(path, tokenizer, CONFIG, eval_size=2, eval_split="test")


def test_a_second_file_and_parquet(tokenizer, tmp_path):
    pyarrow, parquet = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pyarrow.Table.from_pylist(rows("test.jsonl")), tmp_path / "dev.parquet")
    train, held_out = load_prompts(GSM8K / "train.jsonl", tokenizer, CONFIG, eval_source=tmp_path / "dev.parquet")
    assert len(train) == 8 and held_out.columns(1) == rows("test.jsonl")[1]
    with pytest.raises(ValueError, match="holds one split; got split='test'"):
        load_prompts(GSM8K / "train.jsonl", tokenizer, CONFIG, eval_split="test")
    with pytest.raises(ValueError, match="no such file or folder 'nowhere/train.jsonl'"):
        load_prompts("nowhere/train.jsonl", tokenizer, CONFIG)


@pytest.mark.parametrize("template", [False, True])
def test_map_tokenization_equals_the_plain_path(tokenizer, template):
    records = [{"prompt": f"Question {i}: " + "word " * i, "label": i} for i in range(1, 40)]
    config = PromptDatasetConfig(apply_chat_template=template, prompt_max_len=20, on_overlong="truncate",
                                 prompt_suffix=" Answer with a number.")
    plain = PromptDataset(records, tokenizer, config)
    mapped = PromptDataset(datasets.Dataset.from_list(records), tokenizer, config)
    assert [plain[i] for i in range(len(plain))] == [mapped[i] for i in range(len(mapped))]
    assert plain.stats == mapped.stats and plain.stats.num_truncated > 0
    assert plain[0][1].endswith("Answer with a number.") or template
    single = [PromptDataset([r], tokenizer, config)[0] for r in records[:5]]      # one-by-one = batched
    assert single == [plain[i] for i in range(5)]


def test_map_result_is_cached_by_fingerprint(tokenizer, tmp_path):
    path = tmp_path / "train.jsonl"
    shutil.copy(GSM8K / "train.jsonl", path)
    load_prompts(path, tokenizer, CONFIG)
    source = datasets.load_dataset("json", data_files=str(path), split="train")
    folder = Path(source.cache_files[0]["filename"]).parent
    first = sorted(folder.glob("cache-*.arrow"))
    load_prompts(path, tokenizer, CONFIG)
    assert first and sorted(folder.glob("cache-*.arrow")) == first        # reused, not written again
    load_prompts(path, tokenizer, PromptDatasetConfig(input_key="question", label_key="answer", prompt_suffix="!"))
    assert len(sorted(folder.glob("cache-*.arrow"))) == len(first) + 1    # another config: another entry


def test_chat_messages_column_with_system_prompt_and_suffix(tokenizer):
    records = [{"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "#### 4", "id": 7},
               {"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": "And 3 + 3?"}],
                "answer": "#### 6", "id": 8}]
    config = PromptDatasetConfig(input_key="messages", label_key="answer", apply_chat_template=True,
                                 system_prompt="Be brief.", prompt_suffix=" End with '#### <number>'.")
    for source in (records, datasets.Dataset.from_list(records)):
        dataset = load_prompts(source, tokenizer, config)[0]
        assert dataset[0][1] == ("<|system|>Be brief.<|end|><|user|>What is 2 + 2? End with '#### <number>'.<|end|>"
                                 "<|assistant|>")
        assert dataset[1][1].startswith("<|system|>Own.<|end|><|user|>And 3 + 3? End")   # its own system message
        assert dataset.columns(1)["id"] == 8 and dataset.columns(0)["messages"] == records[0]["messages"]
    assert records[0]["messages"][0]["content"] == "What is 2 + 2?"                   # the records are not changed


def test_errors_name_the_source_record_line_and_columns(tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n\n" + json.dumps({"q": "b", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"PromptDataset\(.*train.jsonl\): record 1 \(line 3\) column 'question' is "
                                         r"an empty prompt \(None; columns with a value: \['answer', 'q'\]\)"):
        load_prompts(path, tokenizer, CONFIG)
    with monkeypatch.context() as patch:            # the plain path (no datasets): the column is missing, not None
        patch.setitem(sys.modules, "datasets", None)
        with pytest.raises(ValueError, match=r"train.jsonl\): record 1 \(line 3\) has no column 'question' "
                                             r"\(columns: \['answer', 'q'\]\)"):
            load_prompts(path, tokenizer, CONFIG)
    path.write_text(json.dumps({"question": "a", "answer": "1"}) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"train.jsonl:2: not valid JSON"):
        load_prompts(path, tokenizer, CONFIG)
    empty = datasets.Dataset.from_list([{"question": "a", "answer": "1"}, {"question": " ", "answer": "2"}])
    with pytest.raises(ValueError, match="record 1 column 'question' is an empty prompt"):
        load_prompts(empty, tokenizer, CONFIG)


def test_without_datasets_lists_and_files_work_and_the_rest_names_the_extra(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)          # import datasets now raises ImportError
    train, held_out = load_prompts(GSM8K / "train.jsonl", tokenizer, CONFIG, eval_source=rows("test.jsonl"))
    assert (len(train), len(held_out)) == (8, 4) and train.columns(0) == rows("train.jsonl")[0]
    with pytest.raises(ImportError, match=r"pip install 'rlhfkit\[data\]'"):
        load_prompts(GSM8K, tokenizer, CONFIG)
    with pytest.raises(ImportError, match=r"pip install 'rlhfkit\[data\]'"):
        load_prompts("openai/gsm8k", tokenizer, CONFIG)


def test_stream_resumes_with_the_same_columns(tokenizer):
    train = load_prompts(GSM8K, tokenizer, CONFIG)[0]
    full = [b.columns for _, b in zip(range(5), train.stream(3, seed=4))]
    resumed = [b.columns for _, b in zip(range(2), train.stream(3, seed=4, start_step=3))]
    assert resumed == full[3:5]
