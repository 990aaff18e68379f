"""Prompt data for rollouts: sources, tokenized prompt datasets, and the built-in verifiable arithmetic task.

What it does: :func:`load_prompts` reads prompts from a ``datasets.Dataset``/``DatasetDict``, a hub id, a JSON-lines
or Parquet file, a folder or a list of dicts, with a held-out split (a named split, a second source, or rows held out
by seed); :class:`PromptDataset` formats (text or chat messages, system prompt, instruction suffix, chat template),
tokenizes once (through ``datasets.map`` when given a ``datasets.Dataset``), applies the length policy and yields
seeded, resumable batches of token ids + texts + labels + every column of each record. The arithmetic task
(:class:`ArithmeticTask`, :func:`arithmetic_reward`, :func:`arithmetic_accuracy`) runs without external data.

What it does not do: streaming of datasets larger than memory, response/preference data, multi-turn rollouts.
Needs only torch to import; Parquet, folders, the hub and ``DatasetDict`` need ``rlhfkit[data]``, and the tokenizer
is usually a transformers one (``rlhfkit[hf]``).
"""

from __future__ import annotations

from rlhfkit._arithmetic import (
    ARITHMETIC_WEIGHTS,
    ArithmeticTask,
    arithmetic_accuracy,
    arithmetic_reward,
    arithmetic_score,
    arithmetic_score_parts,
)
from rlhfkit.data._dataset import PromptBatch, PromptDataset, PromptDatasetConfig, PromptDatasetStats, prompt_batch
from rlhfkit.data._sources import load_prompts, read_jsonl, read_parquet

__all__ = [
    "load_prompts",
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
