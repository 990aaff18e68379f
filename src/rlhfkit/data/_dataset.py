"""Prompt datasets for rollouts: records in, tokenized prompts with their columns out, batched by seed.

Part of :mod:`rlhfkit.data` (re-exported there). What it does: turns records (a list of dicts, an HF
``datasets.Dataset``, any indexable of dicts) into prompts: the prompt column holds text or chat messages; an optional
system prompt and instruction suffix are added; the tokenizer's chat template is applied when configured
(``add_generation_prompt=True``); prompts are tokenized once, up front (a ``datasets.Dataset`` through
``Dataset.map(batched=True)``, cached by datasets' fingerprint and shown with its progress bar); prompts longer than
``prompt_max_len`` are truncated, dropped or refused and counted in :class:`PromptDatasetStats`; batches of token
ids + texts + labels + every column of the record come out in an order fixed by an explicit seed (resumable by step).

What it does not do: read files or the hub (see :func:`rlhfkit.data.load_prompts`), streaming of datasets larger than
memory, response/preference data. A tokenizer is any object with ``__call__(text) -> {"input_ids": ...}`` (and
``apply_chat_template`` when the chat template is used), e.g. a transformers tokenizer (``rlhfkit[hf]``).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["PromptDatasetConfig", "PromptDataset", "PromptDatasetStats", "PromptBatch", "prompt_batch"]

logger = logging.getLogger(__name__)

_OUTPUT_COLUMNS = ("_rlhfkit_ids", "_rlhfkit_text", "_rlhfkit_label", "_rlhfkit_status")


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
        system_prompt: with the chat template, a system message put first (a chat prompt that already starts with
            a system message keeps its own).
        prompt_suffix: text appended to the prompt (to the last user message of a chat prompt), e.g. an instruction
            such as ``"\nEnd with '#### <number>'."``; with or without the chat template.
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
    prompt_suffix: str | None = None
    prompt_max_len: int | None = None
    on_overlong: Literal["truncate", "reject", "error"] = "reject"

    def __post_init__(self) -> None:
        _check_type("input_key", self.input_key, str, "name the record field of the prompt, e.g. 'prompt'")
        if not self.input_key:
            raise ValueError("PromptDatasetConfig.input_key=''; name the record field of the prompt")
        _check_type("label_key", self.label_key, (str, type(None)), "name the label field, or None for no labels")
        _check_type("apply_chat_template", self.apply_chat_template, bool, "pass True or False")
        _check_type("system_prompt", self.system_prompt, (str, type(None)), "pass a string or None")
        _check_type("prompt_suffix", self.prompt_suffix, (str, type(None)), "pass a string or None")
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
    """A batch of prompts, aligned lists. ``token_ids`` go to ``engine.generate``; ``texts``/``labels``/``columns`` to
    rewards (index them with ``Rollout.prompt_index``). ``indices`` are positions in the dataset. ``columns[i]`` is
    the whole record prompt ``i`` came from (every column, the prompt's and label's included, values as stored)."""

    token_ids: list[list[int]]
    texts: list[str]
    labels: list[str | None]
    indices: list[int]
    columns: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.columns is None:
            object.__setattr__(self, "columns", [{} for _ in self.token_ids])

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class _Where:
    """Names a record in errors: the dataset's source and, for a JSON-lines file, the record's line."""

    name: str | None = None
    line_numbers: tuple[int, ...] | None = None

    def __str__(self) -> str:
        return f"PromptDataset({self.name})" if self.name else "PromptDataset"

    def record(self, index: int) -> str:
        line = (f" (line {self.line_numbers[index]})" if self.line_numbers is not None
                and 0 <= index < len(self.line_numbers) else "")
        return f"{self}: record {index}{line}"


@dataclass(frozen=True)
class _Encoded:
    """One record after formatting, tokenizing and the length policy."""

    ids: list[int]
    text: str
    label: str | None
    status: Literal["kept", "truncated", "rejected"]


def _messages(prompt: list, config: PromptDatasetConfig) -> list:
    messages = [dict(message) if isinstance(message, Mapping) else message for message in prompt]
    if config.prompt_suffix is not None:
        users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            last = messages[users[-1]]
            last["content"] = f"{last.get('content') or ''}{config.prompt_suffix}"
    if config.system_prompt is not None and not (messages and isinstance(messages[0], dict)
                                                  and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages


def _format(index: int, record: Any, tokenizer: Any, config: PromptDatasetConfig, where: _Where) -> str:
    """The prompt text of ``record``: suffix and system prompt added, chat template applied if configured."""
    if not isinstance(record, Mapping):
        raise TypeError(f"{where.record(index)} is a {type(record).__name__}, expected a dict")
    key = config.input_key
    if key not in record:
        raise ValueError(f"{where.record(index)} has no column {key!r} (columns: {sorted(record)}); set "
                         "PromptDatasetConfig.input_key")
    prompt = record[key]
    if prompt is None:                         # also how Arrow fills a column that a row lacks
        present = sorted(name for name, value in record.items() if value is not None)
        raise ValueError(f"{where.record(index)} column {key!r} is an empty prompt (None; columns with a value: "
                         f"{present}); drop the record, fill in the prompt or set PromptDatasetConfig.input_key")
    if not config.apply_chat_template and not isinstance(prompt, str):
        raise TypeError(f"{where.record(index)} column {key!r} is a {type(prompt).__name__}; without the chat "
                        "template prompts must be strings (chat messages need apply_chat_template=True)")
    _check_not_empty(index, key, prompt, where)
    if not config.apply_chat_template:
        return prompt + (config.prompt_suffix or "")
    if isinstance(prompt, (list, tuple)):
        messages = _messages(list(prompt), config)
    else:
        messages = _messages([{"role": "user", "content": str(prompt)}], config)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:                 # re-raised as the tokenizer's own type, with the record named
        error.add_note(f"while applying the chat template to {where.record(index)} (column {key!r})")
        raise


def _label(index: int, record: Mapping, config: PromptDatasetConfig, where: _Where) -> str | None:
    if config.label_key is None:
        return None
    if config.label_key not in record or record[config.label_key] is None:
        raise ValueError(f"{where.record(index)} has no label column {config.label_key!r} (columns: "
                         f"{sorted(record)}); set PromptDatasetConfig.label_key, or None for unlabeled prompts")
    return str(record[config.label_key])


def _tokenize(index: int, text: str, tokenizer: Any, config: PromptDatasetConfig, where: _Where) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:        # e.g. a JSON "\ud800" escape without its pair
        raise ValueError(f"{where.record(index)} column {config.input_key!r} holds {text[error.start]!r} at "
                         f"character {error.start} (a lone surrogate, not text a tokenizer can encode); fix or drop "
                         "the record") from error
    try:
        # A chat template already holds its special tokens; do not let the tokenizer add another BOS.
        return list(tokenizer(text, add_special_tokens=not config.apply_chat_template)["input_ids"])
    except Exception as error:                 # re-raised as the tokenizer's own type, with the record named
        error.add_note(f"while tokenizing {where.record(index)} (column {config.input_key!r})")
        raise


def _tokenize_all(indices: Sequence[int], texts: list[str], tokenizer: Any, config: PromptDatasetConfig,
                  where: _Where) -> list[list[int]]:
    """One batched call for a transformers tokenizer (fast ones encode in parallel); one call per text otherwise,
    and to name the record when the batched call fails."""
    if hasattr(tokenizer, "batch_encode_plus") and len(texts) > 1:
        try:
            encoded = tokenizer(texts, add_special_tokens=not config.apply_chat_template)["input_ids"]
        except Exception as error:             # pinned on its record by the per-text calls below
            for index, text in zip(indices, texts):
                _tokenize(index, text, tokenizer, config, where)
            raise error
        return [list(ids) for ids in encoded]
    return [_tokenize(index, text, tokenizer, config, where) for index, text in zip(indices, texts)]


def _truncate(ids: list[int], text: str, tokenizer: Any, limit: int) -> tuple[list[int], str]:
    """The last ``limit`` tokens, minus leading tokens that hold only part of a character.

    A byte-level tokenizer can split one character over several tokens; keeping the tail of such a split would
    decode to U+FFFD. Up to 3 more leading tokens are dropped until the kept text starts on a whole character.
    """
    kept = ids[-limit:]
    decoded = tokenizer.decode(kept)
    for _ in range(3):                         # a UTF-8 character has at most 3 continuation bytes
        if not decoded.startswith("\ufffd") or text.endswith(decoded) or len(kept) == 1:
            break
        kept = kept[1:]
        decoded = tokenizer.decode(kept)
    return kept, decoded


def _limit(index: int, ids: list[int], text: str, label: str | None, tokenizer: Any, config: PromptDatasetConfig,
           where: _Where) -> _Encoded:
    if not ids:
        raise ValueError(f"{where.record(index)} tokenizes to no tokens (text {text!r})")
    limit = config.prompt_max_len
    if limit is None or len(ids) <= limit:
        return _Encoded(ids, text, label, "kept")
    if config.on_overlong == "error":
        raise ValueError(f"{where.record(index)} has {len(ids)} prompt tokens > prompt_max_len={limit}; raise "
                         "prompt_max_len or set on_overlong='truncate' or 'reject'")
    if config.on_overlong == "reject":
        return _Encoded([], text, label, "rejected")
    ids, text = _truncate(ids, text, tokenizer, limit)
    return _Encoded(ids, text, label, "truncated")


def _encode_rows(indices: Sequence[int], rows: Sequence[Any], tokenizer: Any, config: PromptDatasetConfig,
                 where: _Where) -> list[_Encoded]:
    texts = [_format(index, row, tokenizer, config, where) for index, row in zip(indices, rows)]
    labels = [_label(index, row, config, where) for index, row in zip(indices, rows)]
    ids = _tokenize_all(indices, texts, tokenizer, config, where)
    return [_limit(index, i, t, label, tokenizer, config, where)
            for index, i, t, label in zip(indices, ids, texts, labels)]


def _encode_batch(batch: dict[str, list], indices: list[int], *, tokenizer: Any, config: PromptDatasetConfig,
                  where: _Where) -> dict[str, list]:
    """``datasets.Dataset.map(batched=True, with_indices=True)`` function: columns in, encoded columns out."""
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    encoded = _encode_rows(indices, rows, tokenizer, config, where)
    return {"_rlhfkit_ids": [e.ids for e in encoded], "_rlhfkit_text": [e.text for e in encoded],
            "_rlhfkit_label": [e.label for e in encoded], "_rlhfkit_status": [e.status for e in encoded]}


def _is_hf_dataset(records: Any) -> bool:
    """An HF ``datasets.Dataset`` (recognised without importing datasets)."""
    return (type(records).__module__.startswith("datasets.") and not isinstance(records, Mapping)
            and hasattr(records, "map") and isinstance(getattr(records, "column_names", None), list))


def _encode_dataset(records: Any, tokenizer: Any, config: PromptDatasetConfig, where: _Where) -> list[_Encoded]:
    """Through ``Dataset.map``: cached by datasets' fingerprint (for file-backed datasets), with a progress bar."""
    processed = records.map(_encode_batch, batched=True, batch_size=1000, with_indices=True,
                            remove_columns=records.column_names, desc="Tokenizing prompts",
                            fn_kwargs={"tokenizer": tokenizer, "config": config, "where": where})
    columns = processed.to_dict()
    return [_Encoded(list(ids), text, label, status) for ids, text, label, status
            in zip(*(columns[name] for name in _OUTPUT_COLUMNS))]


def _encode_all(records: Any, tokenizer: Any, config: PromptDatasetConfig, where: _Where) -> list[_Encoded]:
    if _is_hf_dataset(records):
        return _encode_dataset(records, tokenizer, config, where)
    encoded = []
    for start in range(0, len(records), 1000):
        indices = range(start, min(start + 1000, len(records)))
        encoded += _encode_rows(indices, [records[i] for i in indices], tokenizer, config, where)
    return encoded


class PromptDataset:
    """Tokenized prompts with labels and their records' columns, built once. See :class:`PromptDatasetConfig`.

    Args:
        records: an indexable of dicts (a list, an HF ``datasets.Dataset``, ...).
        tokenizer: tokenizes the prompt (and applies the chat template if configured).
        config: keys, template, suffix and length policy.
        name: where the records come from (a file, a split), named in errors.
        line_numbers: the file line of each record (JSON lines), named in errors.
    """

    def __init__(self, records: Sequence[dict[str, Any]], tokenizer, config: PromptDatasetConfig | None = None, *,
                 name: str | None = None, line_numbers: Sequence[int] | None = None):
        if config is not None and not isinstance(config, PromptDatasetConfig):
            raise TypeError(f"PromptDataset(config=...) got a {type(config).__name__}; pass a PromptDatasetConfig, "
                            "e.g. PromptDatasetConfig(input_key='question')")
        self.config = config or PromptDatasetConfig()
        _check_records(records)
        self.tokenizer = tokenizer
        self.name = name
        where = _Where(name, tuple(line_numbers) if line_numbers is not None else None)
        self._records = records
        encoded = _encode_all(records, tokenizer, self.config, where)
        kept = [(index, e) for index, e in enumerate(encoded) if e.status != "rejected"]
        self._token_ids = [e.ids for _, e in kept]
        self._texts = [e.text for _, e in kept]
        self._labels = [e.label for _, e in kept]
        self._sources = [index for index, _ in kept]
        num_records, lengths = len(encoded), [len(ids) for ids in self._token_ids]
        num_truncated = sum(e.status == "truncated" for e in encoded)
        num_rejected = num_records - len(kept)
        self.stats = PromptDatasetStats(num_records=num_records, num_kept=len(lengths), num_truncated=num_truncated,
                                        num_rejected=num_rejected, max_prompt_len=max(lengths, default=0),
                                        mean_prompt_len=sum(lengths) / len(lengths) if lengths else 0.0)
        if not lengths:
            raise ValueError(f"{where}: none of the {num_records} records was kept ({num_rejected} rejected "
                             f"as longer than prompt_max_len={self.config.prompt_max_len}); raise prompt_max_len")
        if num_truncated or num_rejected:
            logger.info("prompt dataset: %d records, %d truncated, %d rejected (prompt_max_len=%s)", num_records,
                        num_truncated, num_rejected, self.config.prompt_max_len)

    @classmethod
    def from_file(cls, path: str | Path, tokenizer, config: PromptDatasetConfig | None = None) -> PromptDataset:
        """Load ``.jsonl``/``.json`` (JSON lines) or ``.parquet`` records: ``load_prompts(path, ...)[0]``."""
        from rlhfkit.data._sources import load_prompts  # the sources build on this module

        suffix = Path(path).suffix.lower()
        if suffix not in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"PromptDataset.from_file(path={str(path)!r}): unknown suffix {suffix!r}; expected "
                             ".jsonl, .json (JSON lines) or .parquet")
        if not Path(path).is_file():
            raise ValueError(f"PromptDataset.from_file(path={str(path)!r}): no such file")
        return load_prompts(path, tokenizer, config)[0]

    def __len__(self) -> int:
        return len(self._token_ids)

    def __getitem__(self, index: int) -> tuple[list[int], str, str | None]:
        """``(token_ids, text, label)`` of kept prompt ``index``."""
        return self._token_ids[index], self._texts[index], self._labels[index]

    def source_index(self, index: int) -> int:
        """The record number that kept prompt ``index`` came from."""
        return self._sources[index]

    def columns(self, index: int) -> dict[str, Any]:
        """Every column of the record that kept prompt ``index`` came from."""
        return dict(self._records[self._sources[index]])

    def _batch(self, indices: Sequence[int]) -> PromptBatch:
        return PromptBatch(token_ids=[list(self._token_ids[i]) for i in indices],
                           texts=[self._texts[i] for i in indices], labels=[self._labels[i] for i in indices],
                           indices=list(indices), columns=[self.columns(i) for i in indices])

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


def _check_not_empty(index: int, key: str, prompt: Any, where: _Where) -> None:
    """An empty prompt is an error with or without the chat template (a template would wrap it into a non-empty
    text that asks the policy nothing)."""
    if isinstance(prompt, str):
        empty = not prompt.strip()
    elif isinstance(prompt, (list, tuple)):
        contents = [message.get("content") if isinstance(message, Mapping) else None for message in prompt]
        empty = all(isinstance(content, str) and not content.strip() for content in contents)  # [] is empty too
    else:
        empty = prompt is None
    if empty:
        raise ValueError(f"{where.record(index)} column {key!r} is an empty prompt ({prompt!r}); drop the "
                         "record or fill in the prompt")


def _check_records(records: Any) -> None:
    """Records must be rows: an indexable of dicts. Catch the common wrong shapes before touching them."""
    if isinstance(records, (str, Path)):
        raise TypeError(f"PromptDataset(records={str(records)!r}) got a path; use rlhfkit.data.load_prompts()")
    if isinstance(records, Mapping):
        keys = list(records)[:5]
        if all(isinstance(records[key], (list, tuple)) for key in keys):
            raise TypeError(f"PromptDataset(records=...) got a dict of columns (keys {keys}); it expects rows, a "
                            "list of dicts. Convert with [dict(zip(columns, row)) for row in zip(*columns.values())]"
                            " or datasets.Dataset.from_dict(columns)")
        raise TypeError(f"PromptDataset(records=...) got a {type(records).__name__} (keys {keys}); it expects rows, a "
                        "list of dicts (for a DatasetDict pass one split, e.g. records['train'], or use "
                        "load_prompts(records, ..., split='train'))")
    if not hasattr(records, "__len__") or not hasattr(records, "__getitem__"):
        raise TypeError(f"PromptDataset(records=...) got a {type(records).__name__}, which has no len() or integer "
                        "indexing; pass a list of dicts (e.g. list(records)) or a datasets.Dataset")


def prompt_batch(records: Any, tokenizer: Any, config: PromptDatasetConfig | None = None) -> PromptBatch:
    """All of ``records`` as one :class:`PromptBatch`, in order: for prompts made fresh each step (a task that
    generates problems, an environment) rather than drawn from a dataset. Rejected records are left out, as in
    :class:`PromptDataset`, so the batch may be shorter than ``records``."""
    dataset = PromptDataset(records, tokenizer, config or PromptDatasetConfig())
    return next(dataset.batches(len(dataset), seed=0, shuffle=False))


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}; must be a positive int")
