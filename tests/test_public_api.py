"""Every public name is documented and shown in use.

A public name is one listed in the ``__all__`` of a public module of ``src/rlhfkit`` (no ``_`` component in its
dotted path). Each must (a) appear in ``docs/*.md`` and (b) appear in an example (``examples/*.py``) or in a
```` ```python ```` block of ``README.md`` or ``docs/*.md``. A name nobody needs leaves ``__all__``; a name users need
gets its docs. The source is read with ``ast``: nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Names that are public but not yet documented and shown in use, waiting for their docs. Keep this small: an entry
# is a debt with an owner, never a way to make the test pass. Remove an entry in the commit that documents the name.
PENDING: dict[str, str] = {
    # "rlhfkit.packing.pack_padded": "lead: docs/packing.md after the wave-2 merge",
}
# Public names found without docs or use when this test was written (wave 2): users need them, their docs pages are
# to be written. Same rules as PENDING: shrink it, never grow it.
DEBT: dict[str, list[str]] = {
}
# Whole modules still being written (the lead's rlhfkit.hybrid): remove the prefix once docs/hybrid.md and an example
# cover their names.
PENDING_MODULES: tuple[str, ...] = ()


def public_names(root: Path = ROOT) -> dict[str, list[str]]:
    """Public module -> its ``__all__``, read from the source."""
    names = {}
    src = root / "src"
    for path in sorted((src / "rlhfkit").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if any(part.startswith("_") for part in parts[1:]):
            continue
        for node in ast.parse(path.read_text()).body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and target.id == "__all__":
                names[".".join(parts)] = list(ast.literal_eval(node.value))
    return names


def documented_text(root: Path = ROOT) -> str:
    return "\n".join(path.read_text() for path in sorted((root / "docs").glob("*.md")))


def usage_text(root: Path = ROOT) -> str:
    snippets = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        snippets += re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)
    examples = [path.read_text() for path in sorted((root / "examples").glob("*.py"))]
    return "\n".join(snippets + examples)


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


def missing(root: Path = ROOT) -> dict[str, list[str]]:
    """``module.name`` -> what it lacks ("docs", "use"), for every public name (dunder names excepted)."""
    docs, usage = documented_text(root), usage_text(root)
    gaps = {}
    for module, names in public_names(root).items():
        for name in names:
            if name.startswith("__"):
                continue
            lacks = [what for what, text in (("docs", docs), ("use", usage)) if not _mentions(text, name)]
            if lacks:
                gaps[f"{module}.{name}"] = lacks
    return gaps


def _pending(qualified: str) -> bool:
    return qualified in PENDING or qualified in DEBT or any(qualified.startswith(prefix + ".") for prefix in PENDING_MODULES)


def test_every_public_name_is_documented_and_used():
    gaps = {name: lacks for name, lacks in missing().items() if not _pending(name)}
    assert not gaps, (
        "public names without docs (docs/*.md) or use (examples/*.py, ```python blocks of README.md/docs): "
        f"{gaps}. Document and show the name, or drop it from __all__ if users do not need it.")


def test_pending_names_are_still_pending():
    # An entry of PENDING whose name is now documented and used (or no longer public) must go.
    gaps = missing()
    stale = sorted(name for name in [*PENDING, *DEBT] if name not in gaps)
    assert not stale, f"remove these from PENDING/DEBT in tests/test_public_api.py, they are done or not public: {stale}"
    stale_lacks = sorted(name for name, lacks in DEBT.items() if name in gaps and gaps[name] != lacks)
    assert not stale_lacks, f"update what these DEBT entries lack: {stale_lacks}"


def test_the_public_api_is_found():
    names = public_names()
    assert "WeightSender" in names["rlhfkit.weight_sync"] and "gae" in names["rlhfkit.advantages"]
    assert "rlhfkit.engines.vllm" in names and not any("._" in module for module in names)


def test_the_check_can_fail(tmp_path):
    """A fake tree: one name documented and used, one only documented, one neither."""
    (tmp_path / "src" / "rlhfkit" / "block").mkdir(parents=True)
    (tmp_path / "src" / "rlhfkit" / "block" / "__init__.py").write_text('__all__ = ["shown", "told", "hidden"]\n')
    (tmp_path / "src" / "rlhfkit" / "block" / "_private.py").write_text('__all__ = ["internal"]\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "block.md").write_text("`shown` and `told`.\n\n```python\nshown()\n```\n\n```\ntold()\n```\n")
    (tmp_path / "examples").mkdir()
    (tmp_path / "README.md").write_text("hidden, in prose only\n")
    assert missing(tmp_path) == {"rlhfkit.block.told": ["use"], "rlhfkit.block.hidden": ["docs", "use"]}

