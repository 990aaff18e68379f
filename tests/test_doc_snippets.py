"""Every ```python block of README.md and docs/*.md runs (defect: README's snippet passed a missing argument).

Each file's blocks run in order in one namespace, in this process (the imports are shared, which keeps the test fast),
in a fresh temporary working directory, under a per-file time limit. Tracebacks point at the markdown file and line:
each block is compiled with its file name and its lines at their place in the file.

A block that cannot run on CPU (a GPU, vLLM, a cluster) is marked in the markdown, either on its fence
(```` ```python no-run ````) or with ``<!-- no-run: reason -->`` on the line before the fence; the marks are counted
here (``EXPECTED_NO_RUN``) so that a new one is a visible decision. Prefer a runnable snippet (tiny models, logical
GPUs) to a mark.
"""

from __future__ import annotations

import re
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES_OWNED_ELSEWHERE: set[str] = set()
# Blocks marked no-run, per file: each needs hardware or a cluster that CPU CI does not have.
EXPECTED_NO_RUN = {
    "docs/deepspeed_engine.md": 2,   # bf16 ZeRO-3 with FusedAdam on a GPU; a deferred wake (a process group)
    "docs/engines-vllm.md": 3,       # vLLM on a GPU
    "docs/lora.md": 1,               # vLLM's in-memory LoRA (the main venv has no vLLM)
    "docs/weight_sync.md": 1,        # CUDA IPC between two processes
    "docs/workers.md": 2,            # a Ray cluster with 8 GPUs, /scratch paths
    "docs/placement.md": 1,          # Ray placement groups of the 8-GPU plan
}
TIME_LIMIT_S = 60
# Pages whose snippet starts a whole hybrid run (Ray, engine and DeepSpeed processes on 2 cores).
SLOW_PAGES = {"hybrid.md": 300, "checkpoint.md": 300}

_FENCE = re.compile(r"^```(\S*)\s*(.*)$")
_NO_RUN_COMMENT = re.compile(r"^<!--\s*no-run:\s*(\S.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the first code line
    code: str
    no_run: bool


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a markdown file, with their first code line and their no-run mark."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path}:{index + 1}: code fence is never closed")
        if match.group(1) == "python":
            previous = lines[index - 1] if index else ""
            no_run = "no-run" in match.group(2).split() or _NO_RUN_COMMENT.match(previous) is not None
            blocks.append(Block(path, index + 2, "\n".join(lines[index + 1:end]) + "\n", no_run))
        index = end + 1
    return blocks


def snippet_pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in pages if p.name not in PAGES_OWNED_ELSEWHERE and python_blocks(p)]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


class _TimeLimit(Exception):
    pass


class SnippetError(AssertionError):
    """A block failed; the message names the markdown file and line and holds the traceback."""


def run_blocks(blocks: list[Block], *, time_limit_s: float) -> None:
    """Exec the blocks in order in one namespace; raise AssertionError naming the file and line of a failure."""
    namespace: dict = {"__name__": "__doc_snippet__"}

    def on_alarm(signum, frame):
        raise _TimeLimit(f"ran past {time_limit_s} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, time_limit_s)
    try:
        for block in blocks:
            # Pad with newlines so that line numbers in tracebacks are the markdown file's.
            code = compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
            try:
                exec(code, namespace)
            except BaseException as error:   # noqa: BLE001 - reported with the block's place, then re-raised
                raise SnippetError(f"{_name(block.path)}: the block at line {block.line} failed: "
                                     f"{type(error).__name__}: {error}\n{traceback.format_exc()}") from error
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("page", snippet_pages(), ids=_name)
def test_page_snippets_run(page: Path, tmp_path, monkeypatch):
    blocks = [b for b in python_blocks(page) if not b.no_run]
    if not blocks:
        pytest.skip(f"{_name(page)}: every block is marked no-run")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        run_blocks(blocks, time_limit_s=SLOW_PAGES.get(page.name, TIME_LIMIT_S))
    except SnippetError as error:
        pytest.fail(str(error), pytrace=False)


def test_no_run_marks_are_the_expected_ones():
    """Every no-run mark is listed in EXPECTED_NO_RUN (and every listed one still exists)."""
    found = {}
    for page in snippet_pages():
        count = sum(b.no_run for b in python_blocks(page))
        if count:
            found[_name(page)] = count
    assert found == EXPECTED_NO_RUN


def test_extractor_finds_marks_and_lines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n<!-- no-run: needs a GPU -->\n```python\ncuda()\n```\n"
                    "```bash\nls\n```\n```python no-run\ny = 2\n```\n```python\nraise KeyError('boom')\n```\n")
    blocks = python_blocks(page)
    assert [(b.line, b.no_run) for b in blocks] == [(3, False), (7, True), (13, True), (16, False)]
    with pytest.raises(SnippetError, match=r"page.md: the block at line 16 failed: KeyError") as info:
        run_blocks([b for b in blocks if not b.no_run], time_limit_s=10)
    assert f'File "{page}", line 16' in str(info.value)


def test_time_limit_stops_a_hanging_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nwhile True:\n    pass\n```\n")
    with pytest.raises(SnippetError, match="_TimeLimit: ran past 0.5 s"):
        run_blocks(python_blocks(page), time_limit_s=0.5)


if __name__ == "__main__":   # list every block and its mark: python tests/test_doc_snippets.py
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in python_blocks(page):
            skipped = " (owned elsewhere)" if page.name in PAGES_OWNED_ELSEWHERE else ""
            print(f"{_name(page)}:{block.line}: {'no-run' if block.no_run else 'runs'}{skipped}")
