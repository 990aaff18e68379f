"""Where a run's numbers go: :class:`MetricsLogger` writes one row per step to ``metrics.jsonl`` (and to Weights &
Biases or TensorBoard when asked for), and sample completions to ``samples.jsonl`` (and to a W&B table or TensorBoard
text there).

A resumed run appends: ``MetricsLogger(directory, resume_step=N)`` keeps the rows of steps before ``N``, drops those
at or after it (logged by the killed run after its last checkpoint) and logs on, so the file holds each step once.

What it does not do: aggregate, plot or sample. Needs nothing beyond the standard library; ``pip install wandb`` /
``pip install tensorboard`` (``rlhfkit[wandb]`` / ``rlhfkit[tensorboard]``) only when asked for.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger"]

METRICS_FILE, SAMPLES_FILE = "metrics.jsonl", "samples.jsonl"


def _kept_lines(path: Path, resume_step: int) -> list[str]:
    """The complete lines of ``path`` whose ``step`` is below ``resume_step`` (a torn last line is dropped)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        if not line.endswith("\n"):
            continue  # the killed run's half-written last line
        if json.loads(line)["step"] < resume_step:
            kept.append(line)
    return kept


def _rewrite(path: Path, lines: list[str]) -> None:
    """Replace ``path`` by ``lines`` atomically (a kill during a resume leaves the old file or the new one)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)


class MetricsLogger:
    """Writes one row of numbers per step: always to ``directory/metrics.jsonl`` (each line also carries the
    wall-clock ``timestamp``, Unix seconds, of when it was logged); to Weights & Biases when ``wandb_project`` is set
    and to TensorBoard when ``tensorboard=True`` (``pip install wandb`` / ``pip install tensorboard``: optional,
    imported only when asked for).

    Args:
        directory: where ``metrics.jsonl`` and ``samples.jsonl`` go (created).
        resume_step: None starts both files afresh. An int resumes: the rows (and samples) of earlier steps are kept
            (also in :attr:`rows`), those of this step and later dropped, and new ones appended.
        wandb_project, tensorboard, run_config: where else the rows go, and the run's config for W&B.
    """

    def __init__(self, directory: str | Path, *, resume_step: int | None = None, wandb_project: str | None = None,
                 tensorboard: bool = False, run_config: Mapping[str, Any] | None = None) -> None:
        from rlhfkit._optional import require

        if resume_step is not None and (isinstance(resume_step, bool) or not isinstance(resume_step, int)
                                        or resume_step < 0):
            raise ValueError(f"MetricsLogger(resume_step={resume_step!r}); pass the step the run resumes at (an int "
                             ">= 0), or None for a fresh run")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, float]] = []
        if resume_step is None:
            mode = "w"
        else:
            mode = "a"
            for name in (METRICS_FILE, SAMPLES_FILE):
                lines = _kept_lines(self.directory / name, resume_step)
                _rewrite(self.directory / name, lines)
                if name == METRICS_FILE:
                    self.rows = [{k: v for k, v in json.loads(line).items() if k != "timestamp"} for line in lines]
        self._file = (self.directory / METRICS_FILE).open(mode)
        self._samples = (self.directory / SAMPLES_FILE).open(mode)
        self._wandb = self._tensorboard = None
        if wandb_project:
            wandb = require("wandb", user="rlhfkit.hybrid.MetricsLogger(wandb_project=...)", extra="wandb")
            self._wandb = wandb.init(project=wandb_project, dir=str(self.directory), config=dict(run_config or {}),
                                     resume="allow" if resume_step is not None else None)
        if tensorboard:
            require("tensorboard", user="rlhfkit.hybrid.MetricsLogger(tensorboard=True)", extra="tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.directory / "tensorboard"),
                                              purge_step=resume_step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Keep the numeric entries of ``metrics`` (with ``step``); returns the row written."""
        row = {"step": float(step)} | {k: float(v) for k, v in metrics.items()
                                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.rows.append(row)
        self._file.write(json.dumps(row | {"timestamp": time.time()}) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._tensorboard is not None:
            for key, value in row.items():
                self._tensorboard.add_scalar(key, value, step)
        return row

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]], *, name: str = "eval/samples") -> None:
        """Sample completions (dicts of strings and numbers, e.g. ``prompt``, ``response``, ``score``): one line each
        in ``samples.jsonl`` (with ``step`` and ``name``), a W&B table and TensorBoard text where those are on."""
        rows = [{"step": step, "name": name} | dict(sample) for sample in samples]
        for row in rows:
            self._samples.write(json.dumps(row) + "\n")
        self._samples.flush()
        if not rows:
            return
        columns = [key for key in rows[0] if key not in ("step", "name")]
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=columns, data=[[row.get(key) for key in columns] for row in rows])
            self._wandb.log({name: table}, step=step)
        if self._tensorboard is not None:
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(str(row.get(key)).replace("|", "\\|").replace("\n", " ") for key in columns)
                      + " |" for row in rows]
            self._tensorboard.add_text(name, "\n".join(lines), step)

    def close(self) -> None:
        self._file.close()
        self._samples.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
