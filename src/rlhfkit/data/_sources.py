"""Where prompt records come from: files, folders, the HF hub, ``datasets`` objects; and the held-out split.

Part of :mod:`rlhfkit.data` (re-exported there). :func:`load_prompts` resolves a source to records, picks the split,
holds out an evaluation set, and builds :class:`~rlhfkit.data.PromptDataset` objects. Hub ids, folders and
``DatasetDict`` objects need ``datasets`` (``rlhfkit[data]``), imported here only when used; ``datasets`` honours
``HF_HUB_OFFLINE`` and the user's cache (``HF_HOME``/``HF_DATASETS_CACHE``). JSON-lines and Parquet files go through
``datasets`` too when it is installed (so tokenization is cached), and are read directly otherwise.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

from rlhfkit._optional import require
from rlhfkit.data._dataset import PromptDataset, PromptDatasetConfig, _is_hf_dataset

__all__ = ["load_prompts", "read_jsonl", "read_parquet"]

logger = logging.getLogger(__name__)

_FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a UTF-8 JSON-lines file (blank lines and a leading BOM skipped); errors name the file and line."""
    return _read_jsonl(path)[0]


def _read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Records and the line number of each."""
    records, lines = [], []
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
            lines.append(number)
    return records, lines


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Records of a Parquet file (needs ``rlhfkit[data]``)."""
    parquet = require("pyarrow.parquet", "data", user="rlhfkit.data")
    return parquet.read_table(str(path)).to_pylist()


def _has_datasets() -> bool:
    try:
        require("datasets", "data", user="rlhfkit.data")
    except ImportError:
        return False
    return True


def _read_file(path: Path) -> tuple[Any, list[int] | None]:
    """Records of one file: a ``datasets.Dataset`` (cache-backed) when datasets is installed, else a list; and the
    line of each record for JSON lines."""
    kind = _FILE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"load_prompts: {str(path)!r} has suffix {path.suffix!r}; expected .jsonl, .json (JSON "
                         "lines) or .parquet, or a folder")
    if kind == "parquet":
        if not _has_datasets():
            return read_parquet(path), None
        return require("datasets", "data").load_dataset(kind, data_files=str(path), split="train"), None
    records, lines = _read_jsonl(path)     # first, for errors naming the line: datasets' own JSON errors name none
    if not _has_datasets():
        return records, lines
    datasets = require("datasets", "data", user="rlhfkit.data")
    try:
        return datasets.load_dataset(kind, data_files=str(path), split="train"), lines
    except datasets.exceptions.DatasetGenerationError as error:
        # Valid JSON lines that Arrow cannot hold (a column of mixed types, a lone surrogate): use the rows as read.
        logger.info("%s: datasets could not load it (%s); tokenizing the rows without its cache", path, error)
        return records, lines


def _pick_split(source: Any, split: str, name: str) -> Any:
    if split not in source:
        raise ValueError(f"load_prompts: {name} has no split {split!r} (splits: {sorted(source)}); pass one of them "
                         "as split= / eval_split=")
    return source[split]


def read_source(source: Any, *, split: str = "train", subset: str | None = None) -> tuple[Any, str, list[int] | None]:
    """The records of ``source`` (split ``split``), a name for errors, and each record's line (JSON-lines files).

    ``source``: a ``datasets.Dataset`` (``split`` unused), a ``DatasetDict`` (``source[split]``), a list of dicts,
    a ``.jsonl``/``.json``/``.parquet`` file (one split), a folder or a hub id (``datasets.load_dataset(source,
    subset, split=split)``: a folder of split files such as ``train.jsonl``/``test.jsonl``, or a dataset repository).
    """
    if _is_hf_dataset(source):
        return source, "Dataset", None
    if isinstance(source, dict):           # a DatasetDict, or a plain dict of splits
        return _pick_split(source, split, "the DatasetDict"), f"split {split!r}", None
    if not isinstance(source, (str, Path)):
        return source, "records", None
    path = Path(source)
    if path.is_file():
        if split != "train":
            raise ValueError(f"load_prompts: {str(path)!r} is one file, which holds one split; got split={split!r}. "
                             "Pass a folder of split files, or the evaluation file as eval_source=")
        records, lines = _read_file(path)
        return records, str(path), lines
    datasets = require("datasets", "data", user=f"rlhfkit.data.load_prompts({str(source)!r})")
    if path.is_dir():
        return datasets.load_dataset(str(path), subset, split=split), f"{path}/{split}", None
    if str(source).endswith(tuple(_FILE_KINDS)) or str(source).startswith((".", "/")):
        raise ValueError(f"load_prompts: no such file or folder {str(source)!r}")
    try:
        return datasets.load_dataset(str(source), subset, split=split), f"{source}/{split}", None
    except Exception as error:             # keeps its type; the note names the source and the offline switch
        error.add_note(f"while loading {source!r} (subset={subset!r}, split={split!r}) with datasets.load_dataset; "
                       "with HF_HUB_OFFLINE=1 it must be in the datasets cache (HF_DATASETS_CACHE / HF_HOME)")
        raise


def _hold_out(records: Any, eval_size: int, seed: int, name: str) -> tuple[list[int], list[int]]:
    """Row indices split deterministically by ``seed``: the rest, and ``eval_size`` held out (each in order)."""
    num = len(records)
    if isinstance(eval_size, bool) or not isinstance(eval_size, int) or not 0 < eval_size < num:
        raise ValueError(f"load_prompts(eval_size={eval_size!r}): {name} has {num} records; pass an int in "
                         f"1..{num - 1}")
    order = list(range(num))
    random.Random(seed).shuffle(order)
    return sorted(order[eval_size:]), sorted(order[:eval_size])


def _select(records: Any, lines: list[int] | None, indices: list[int]) -> tuple[Any, list[int] | None]:
    chosen = records.select(indices) if _is_hf_dataset(records) else [records[i] for i in indices]
    return chosen, [lines[i] for i in indices] if lines is not None else None


def load_prompts(source: Any, tokenizer: Any, config: PromptDatasetConfig | None = None, *, split: str = "train",
                 subset: str | None = None, eval_source: Any = None, eval_split: str | None = None,
                 eval_size: int | None = None, seed: int = 0) -> tuple[PromptDataset, PromptDataset | None]:
    """Training prompts and, if asked for, held-out evaluation prompts.

    Args:
        source: a ``datasets.Dataset`` or ``DatasetDict``, a hub id (``"openai/gsm8k"``), a ``.jsonl``/``.json``/
            ``.parquet`` file, a folder of split files, or a list of dicts.
        tokenizer, config: as in :class:`PromptDataset`.
        split: the training split of a ``DatasetDict``, folder or hub dataset.
        subset: the dataset's configuration name for the hub or a folder (e.g. ``"main"`` for GSM8K).
        eval_source: held-out prompts from another source (file, hub id, ...); its split is ``eval_split`` or
            ``"train"``.
        eval_split: held-out prompts from this split of ``source`` (or of ``eval_source``), e.g. ``"test"``.
        eval_size: hold out this many rows of the training split, chosen by ``seed`` (the same rows every run).

    Returns:
        ``(train, held_out)``: ``held_out`` is None when none of ``eval_source``/``eval_split``/``eval_size`` is set.
    """
    if eval_size is not None and (eval_source is not None or eval_split is not None):
        raise ValueError("load_prompts: eval_size holds rows out of the training split; it cannot be combined with "
                         "eval_source or eval_split. Pass one of them")
    records, name, lines = read_source(source, split=split, subset=subset)
    held = held_name = held_lines = None
    if eval_size is not None:
        kept, held_out = _hold_out(records, eval_size, seed, name)
        held, held_lines = _select(records, lines, held_out)
        records, lines = _select(records, lines, kept)
        held_name = f"{name}, held out"
    elif eval_source is not None or eval_split is not None:
        held, held_name, held_lines = read_source(source if eval_source is None else eval_source,
                                                  split=eval_split or "train", subset=subset)
    train = PromptDataset(records, tokenizer, config, name=name, line_numbers=lines)
    if held is None:
        return train, None
    return train, PromptDataset(held, tokenizer, config, name=held_name, line_numbers=held_lines)
