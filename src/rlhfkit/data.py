"""Prompt datasets for rollouts, and the built-in verifiable arithmetic task.

What it does: reads prompts (and optional labels) from JSONL files, Parquet files (needs ``rlhfkit[data]``, i.e.
pyarrow), HF ``datasets`` objects or any indexable of dicts; optionally applies the tokenizer's chat template
(``add_generation_prompt=True``); tokenizes once, up front; truncates, drops or refuses prompts longer than
``prompt_max_len`` and counts them in :class:`PromptDatasetStats`; yields shuffled batches of token ids + text +
label with an explicit seed (reproducible, resumable by step). The arithmetic task (:class:`ArithmeticTask`,
:func:`arithmetic_reward`, :func:`arithmetic_accuracy`) lets the library run without external data.

What it does not do: streaming of datasets larger than memory, response/preference data, multi-turn rollouts.
A tokenizer is any object with ``__call__(text) -> {"input_ids": ...}`` (and ``apply_chat_template`` when the chat
template is used), e.g. a transformers tokenizer (``rlhfkit[hf]``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlhfkit._arithmetic import (
    ARITHMETIC_WEIGHTS,
    ArithmeticTask,
    arithmetic_accuracy,
    arithmetic_reward,
    arithmetic_score,
    arithmetic_score_parts,
)
from rlhfkit._optional import require

__all__ = [
    "PromptDatasetConfig",
    "PromptDataset",
    "PromptDatasetStats",
    "PromptBatch",
    "prompt_batch",
    "ArithmeticTask",
    "arithmetic_reward",
    "arithmetic_score",
    "arithmetic_score_parts",
    "arithmetic_accuracy",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PromptDatasetConfig:
    """How records become prompts.

    Attributes:
        input_key: record field holding the prompt: a string, or a list of chat messages
            (``[{"role": ..., "content": ...}]``) when ``apply_chat_template`` is True.
        label_key: record field holding the label (converted with ``str``); None for no labels. A record without it
            is an error.
        apply_chat_template: format the prompt with ``tokenizer.apply_chat_template(messages,
            add_generation_prompt=True)``; a string prompt becomes one user message.
        system_prompt: with the chat template, a system message put before a string prompt.
        prompt_max_len: longest prompt in tokens (after the template); None for no limit.
        on_overlong: ``"truncate"`` keeps the *last* ``prompt_max_len`` tokens (the end holds the question and the
            generation prompt; the text is re-decoded from the kept tokens, and up to 3 leading tokens that hold only
            part of a character are dropped too), ``"reject"`` drops the prompt,
            ``"error"`` raises ValueError naming the record. All are counted in the stats.
    """

    input_key: str = "prompt"
    label_key: str | None = "label"
    apply_chat_template: bool = False
    system_prompt: str | None = None
    prompt_max_len: int | None = None
    on_overlong: Literal["truncate", "reject", "error"] = "reject"

    def __post_init__(self) -> None:
        _check_type("input_key", self.input_key, str, "name the record field of the prompt, e.g. 'prompt'")
        if not self.input_key:
            raise ValueError("PromptDatasetConfig.input_key=''; name the record field of the prompt")
        _check_type("label_key", self.label_key, (str, type(None)), "name the label field, or None for no labels")
        _check_type("apply_chat_template", self.apply_chat_template, bool, "pass True or False")
        _check_type("system_prompt", self.system_prompt, (str, type(None)), "pass a string or None")
        _check_type("prompt_max_len", self.prompt_max_len, (int, type(None)), "pass a number of tokens, e.g. 512")
        _check_type("on_overlong", self.on_overlong, str, "pass 'truncate', 'reject' or 'error'")
        if self.prompt_max_len is not None and self.prompt_max_len < 1:
            raise ValueError(f"PromptDatasetConfig.prompt_max_len={self.prompt_max_len}; must be >= 1 or None")
        if self.on_overlong not in ("truncate", "reject", "error"):
            raise ValueError(f"PromptDatasetConfig.on_overlong={self.on_overlong!r}; expected 'truncate', "
                             "'reject' or 'error'")
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("PromptDatasetConfig.system_prompt is set but apply_chat_template=False; enable the "
                             "chat template or drop the system prompt")


def _check_type(field: str, value: Any, types: type | tuple[type, ...], fix: str) -> None:
    """TypeError naming ``PromptDatasetConfig.<field>``, its value and the fix; a bool is not accepted as an int."""
    wanted = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in wanted) or not isinstance(value, wanted):
        names = " or ".join("None" if t is type(None) else t.__name__ for t in wanted)
        raise TypeError(f"PromptDatasetConfig.{field}={value!r} is a {type(value).__name__}, expected {names}; {fix}")


@dataclass(frozen=True, kw_only=True)
class PromptDatasetStats:
    """What happened to the records: ``num_records = num_kept + num_rejected``; truncated ones are kept."""

    num_records: int
    num_kept: int
    num_truncated: int
    num_rejected: int
    max_prompt_len: int
    mean_prompt_len: float

    def as_dict(self) -> dict[str, float]:
        return {f"data/{key}": float(value) for key, value in self.__dict__.items()}


@dataclass(frozen=True, kw_only=True)
class PromptBatch:
    """A batch of prompts, aligned lists. ``token_ids`` go to ``engine.generate``; ``texts``/``labels`` to rewards
    (index them with ``Rollout.prompt_index``). ``indices`` are positions in the dataset."""

    token_ids: list[list[int]]
    texts: list[str]
    labels: list[str | None]
    indices: list[int]

    def __len__(self) -> int:
        return len(self.token_ids)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a UTF-8 JSON-lines file (blank lines and a leading BOM skipped); errors name the file and line."""
    records = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid UTF-8 (byte {raw[error.start]:#04x} at column "
                                 f"{error.start + 1}); JSON lines must be UTF-8, re-encode the file (e.g. iconv -f "
                                 "latin1 -t utf-8)") from error
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error})") from error
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Records of a Parquet file (needs ``rlhfkit[data]``)."""
    parquet = require("pyarrow.parquet", "data", user="rlhfkit.data")
    return parquet.read_table(str(path)).to_pylist()


class PromptDataset:
    """Tokenized prompts with labels, built once from records. See :class:`PromptDatasetConfig`.

    Args:
        records: an indexable of dicts (a list, an HF ``datasets.Dataset``, ...).
        tokenizer: tokenizes the prompt (and applies the chat template if configured).
        config: keys, template and length policy.
    """

    def __init__(self, records: Sequence[dict[str, Any]], tokenizer, config: PromptDatasetConfig | None = None):
        if config is not None and not isinstance(config, PromptDatasetConfig):
            raise TypeError(f"PromptDataset(config=...) got a {type(config).__name__}; pass a PromptDatasetConfig, "
                            "e.g. PromptDatasetConfig(input_key='question')")
        self.config = config or PromptDatasetConfig()
        _check_records(records)
        self.tokenizer = tokenizer
        self._token_ids: list[list[int]] = []
        self._texts: list[str] = []
        self._labels: list[str | None] = []
        self._sources: list[int] = []
        num_records = len(records)
        num_truncated = num_rejected = 0
        for index in range(num_records):
            status = self._add(index, records[index])
            num_truncated += status == "truncated"
            num_rejected += status == "rejected"
        lengths = [len(ids) for ids in self._token_ids]
        self.stats = PromptDatasetStats(num_records=num_records, num_kept=len(lengths), num_truncated=num_truncated,
                                        num_rejected=num_rejected, max_prompt_len=max(lengths, default=0),
                                        mean_prompt_len=sum(lengths) / len(lengths) if lengths else 0.0)
        if not lengths:
            raise ValueError(f"PromptDataset: none of the {num_records} records was kept ({num_rejected} rejected "
                             f"as longer than prompt_max_len={self.config.prompt_max_len}); raise prompt_max_len")
        if num_truncated or num_rejected:
            logger.info("prompt dataset: %d records, %d truncated, %d rejected (prompt_max_len=%s)", num_records,
                        num_truncated, num_rejected, self.config.prompt_max_len)

    @classmethod
    def from_file(cls, path: str | Path, tokenizer, config: PromptDatasetConfig | None = None) -> PromptDataset:
        """Load ``.jsonl``/``.json`` (JSON lines) or ``.parquet`` records."""
        suffix = Path(path).suffix.lower()
        if suffix in (".jsonl", ".json"):
            return cls(read_jsonl(path), tokenizer, config)
        if suffix == ".parquet":
            return cls(read_parquet(path), tokenizer, config)
        raise ValueError(f"PromptDataset.from_file(path={str(path)!r}): unknown suffix {suffix!r}; expected .jsonl, "
                         ".json (JSON lines) or .parquet")

    def _format(self, index: int, record: Any) -> str:
        if not isinstance(record, dict):
            raise TypeError(f"PromptDataset: record {index} is a {type(record).__name__}, expected a dict")
        key = self.config.input_key
        if key not in record:
            raise ValueError(f"PromptDataset: record {index} has no field {key!r} (fields: "
                             f"{sorted(record)}); set PromptDatasetConfig.input_key")
        prompt = record[key]
        if not self.config.apply_chat_template and not isinstance(prompt, str):
            raise TypeError(f"PromptDataset: record {index} field {key!r} is a "
                            f"{type(prompt).__name__}; without the chat template prompts must be strings")
        _check_not_empty(index, key, prompt)
        if not self.config.apply_chat_template:
            return prompt
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.config.system_prompt is not None and not isinstance(prompt, list):
            messages = [{"role": "system", "content": self.config.system_prompt}, *messages]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:                 # re-raised as the tokenizer's own type, with the record named
            error.add_note(f"while applying the chat template to PromptDataset record {index} (field {key!r})")
            raise

    def _tokenize(self, index: int, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:        # e.g. a JSON "\ud800" escape without its pair
            raise ValueError(f"PromptDataset: record {index} field {self.config.input_key!r} holds "
                             f"{text[error.start]!r} at character {error.start} (a lone surrogate, not text a "
                             "tokenizer can encode); fix or drop the record") from error
        try:
            # A chat template already holds its special tokens; do not let the tokenizer add another BOS.
            return list(self.tokenizer(text, add_special_tokens=not self.config.apply_chat_template)["input_ids"])
        except Exception as error:                 # re-raised as the tokenizer's own type, with the record named
            error.add_note(f"while tokenizing PromptDataset record {index} (field {self.config.input_key!r})")
            raise

    def _truncate(self, ids: list[int], text: str) -> tuple[list[int], str]:
        """The last ``prompt_max_len`` tokens, minus leading tokens that hold only part of a character.

        A byte-level tokenizer can split one character over several tokens; keeping the tail of such a split would
        decode to U+FFFD. Up to 3 more leading tokens are dropped until the kept text starts on a whole character.
        """
        kept = ids[-self.config.prompt_max_len:]
        decoded = self.tokenizer.decode(kept)
        for _ in range(3):                         # a UTF-8 character has at most 3 continuation bytes
            if not decoded.startswith("\ufffd") or text.endswith(decoded) or len(kept) == 1:
                break
            kept = kept[1:]
            decoded = self.tokenizer.decode(kept)
        return kept, decoded

    def _add(self, index: int, record: Any) -> str:
        text = self._format(index, record)
        label = None
        if self.config.label_key is not None:
            if self.config.label_key not in record or record[self.config.label_key] is None:
                raise ValueError(f"PromptDataset: record {index} has no label field {self.config.label_key!r}; set "
                                 "PromptDatasetConfig.label_key=None for unlabeled prompts")
            label = str(record[self.config.label_key])
        ids = self._tokenize(index, text)
        if not ids:
            raise ValueError(f"PromptDataset: record {index} tokenizes to no tokens (text {text!r})")
        status = "kept"
        limit = self.config.prompt_max_len
        if limit is not None and len(ids) > limit:
            if self.config.on_overlong == "error":
                raise ValueError(f"PromptDataset: record {index} has {len(ids)} prompt tokens > prompt_max_len="
                                 f"{limit}; raise prompt_max_len or set on_overlong='truncate' or 'reject'")
            if self.config.on_overlong == "reject":
                return "rejected"
            ids, text = self._truncate(ids, text)
            status = "truncated"
        self._token_ids.append(ids)
        self._texts.append(text)
        self._labels.append(label)
        self._sources.append(index)
        return status

    def __len__(self) -> int:
        return len(self._token_ids)

    def __getitem__(self, index: int) -> tuple[list[int], str, str | None]:
        """``(token_ids, text, label)`` of kept prompt ``index``."""
        return self._token_ids[index], self._texts[index], self._labels[index]

    def source_index(self, index: int) -> int:
        """The record number that kept prompt ``index`` came from."""
        return self._sources[index]

    def _batch(self, indices: Sequence[int]) -> PromptBatch:
        return PromptBatch(token_ids=[list(self._token_ids[i]) for i in indices],
                           texts=[self._texts[i] for i in indices], labels=[self._labels[i] for i in indices],
                           indices=list(indices))

    def _order(self, seed: int, epoch: int, shuffle: bool) -> list[int]:
        order = list(range(len(self)))
        if shuffle:
            random.Random(f"{seed}:{epoch}").shuffle(order)
        return order

    def batches(self, batch_size: int, *, seed: int, epoch: int = 0, shuffle: bool = True,
                drop_last: bool = False) -> Iterator[PromptBatch]:
        """One pass over the dataset; the order depends only on ``(seed, epoch)``."""
        _check_batch_size(batch_size)
        order = self._order(seed, epoch, shuffle)
        stop = len(order) - len(order) % batch_size if drop_last else len(order)
        for start in range(0, stop, batch_size):
            yield self._batch(order[start:start + batch_size])

    def stream(self, batch_size: int, *, seed: int, start_step: int = 0, shuffle: bool = True) -> Iterator[PromptBatch]:
        """Endless full batches, epoch after epoch (each reshuffled from ``(seed, epoch)``, the incomplete tail of an
        epoch dropped). Batch ``k`` is the same whatever ``start_step`` is: resume a run with ``start_step=step``."""
        _check_batch_size(batch_size)
        per_epoch = len(self) // batch_size
        if per_epoch == 0:
            raise ValueError(f"PromptDataset.stream(batch_size={batch_size}) exceeds the {len(self)} prompts; "
                             "lower batch_size")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"PromptDataset.stream(start_step={start_step!r}); must be an int >= 0")
        step, epoch, order = start_step, None, []
        while True:
            if step // per_epoch != epoch:
                epoch = step // per_epoch
                order = self._order(seed, epoch, shuffle)
            position = step % per_epoch
            yield self._batch(order[position * batch_size:(position + 1) * batch_size])
            step += 1


def _check_not_empty(index: int, key: str, prompt: Any) -> None:
    """An empty prompt is an error with or without the chat template (a template would wrap it into a non-empty
    text that asks the policy nothing)."""
    if isinstance(prompt, str):
        empty = not prompt.strip()
    elif isinstance(prompt, list):
        contents = [message.get("content") if isinstance(message, dict) else None for message in prompt]
        empty = all(isinstance(content, str) and not content.strip() for content in contents)  # [] is empty too
    else:
        empty = prompt is None
    if empty:
        raise ValueError(f"PromptDataset: record {index} field {key!r} is an empty prompt ({prompt!r}); drop the "
                         "record or fill in the prompt")


def _check_records(records: Any) -> None:
    """Records must be rows: an indexable of dicts. Catch the common wrong shapes before touching them."""
    if isinstance(records, (str, Path)):
        raise TypeError(f"PromptDataset(records={str(records)!r}) got a path; use PromptDataset.from_file()")
    if isinstance(records, Mapping):
        keys = list(records)[:5]
        if all(isinstance(records[key], (list, tuple)) for key in keys):
            raise TypeError(f"PromptDataset(records=...) got a dict of columns (keys {keys}); it expects rows, a "
                            "list of dicts. Convert with [dict(zip(columns, row)) for row in zip(*columns.values())]"
                            " or datasets.Dataset.from_dict(columns)")
        raise TypeError(f"PromptDataset(records=...) got a {type(records).__name__} (keys {keys}); it expects rows, a "
                        "list of dicts (for a DatasetDict pass one split, e.g. records['train'])")
    if not hasattr(records, "__len__") or not hasattr(records, "__getitem__"):
        raise TypeError(f"PromptDataset(records=...) got a {type(records).__name__}, which has no len() or integer "
                        "indexing; pass a list of dicts (e.g. list(records)) or a datasets.Dataset")


def prompt_batch(records: Any, tokenizer: Any, config: PromptDatasetConfig | None = None) -> PromptBatch:
    """All of ``records`` as one :class:`PromptBatch`, in order: for prompts made fresh each step (a task that
    generates problems, an environment) rather than drawn from a dataset. Rejected records are left out, as in
    :class:`PromptDataset`, so the batch may be shorter than ``records``."""
    dataset = PromptDataset(records, tokenizer, config or PromptDatasetConfig())
    if len(dataset) == 0:
        raise ValueError(f"prompt_batch: none of the {len(records)} records was kept ({dataset.stats.as_dict()})")
    return next(dataset.batches(len(dataset), seed=0, shuffle=False))


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; must be a positive int")
