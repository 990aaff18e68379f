"""The core blocks import with only torch: heavy optional dependencies are blocked in a subprocess.

Putting ``None`` into ``sys.modules[name]`` makes ``import name`` raise ImportError, as if the package were not
installed. One subprocess imports every module of :data:`CORE_MODULES` (one by one, recording failures) and reports
which blocked packages anything tried to import; the tests below check the report. Extend :data:`CORE_MODULES` when a
new block must import without the extras (e.g. ``rlhfkit.placement``, which needs ray only to materialise a plan).

The second half reads ``src/rlhfkit`` with ``ast`` and checks the package's shape: no block imports another block's
private module, no import cycle between blocks, and the core blocks import only torch, einops and the standard
library at module level.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

# Modules that must import with none of the BLOCKED packages installed.
CORE_MODULES = (
    "rlhfkit",
    "rlhfkit.types",
    "rlhfkit.packing",
    "rlhfkit.advantages",
    "rlhfkit.losses",
    "rlhfkit.experience",
    "rlhfkit.engines",
    "rlhfkit.engines.protocol",
    "rlhfkit.checkpoint",
    "rlhfkit.rollouts",
    "rlhfkit.dynamic_sampling",
    "rlhfkit.multiturn",
    # the blocks below need an extra to *run*, but must still import without it (heavy imports live in functions)
    "rlhfkit.weight_sync",
    "rlhfkit.placement",
    "rlhfkit.workers",
    "rlhfkit.rewards",
    "rlhfkit.data",
    "rlhfkit.tiny_models",
    "rlhfkit.engines.hf",
    "rlhfkit.engines.vllm",
    "rlhfkit.engines.sglang",
    "rlhfkit.engines.router",
    "rlhfkit.openai_endpoint",
    "rlhfkit.deepspeed_engine",
    "rlhfkit.phase",
)

# Heavy optional dependencies, each behind an rlhfkit extra.
BLOCKED = ("ray", "vllm", "deepspeed", "transformers", "tokenizers", "accelerate", "datasets", "pyarrow")

_PROBE = textwrap.dedent(
    """
    import builtins, importlib, json, sys, traceback

    blocked, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    for name in blocked:
        sys.modules[name] = None  # "import name" now raises ImportError

    report = {"errors": {}, "leaked": [], "attempted": [], "require_error": None}
    original_import = builtins.__import__

    def recording_import(name, *args, **kwargs):
        # Also catches an import that a module tries and then swallows (try/except ImportError).
        if name.split(".")[0] in blocked:
            report["attempted"].append(name)
        return original_import(name, *args, **kwargs)

    builtins.__import__ = recording_import
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException:
            report["errors"][module] = traceback.format_exc(limit=6)
    builtins.__import__ = original_import
    report["leaked"] = sorted(
        key for key, value in sys.modules.items()
        if value is not None and key.split(".")[0] in blocked
    )
    try:
        from rlhfkit._optional import require
        require("vllm", user="rlhfkit.engines.vllm")
    except ImportError as error:
        report["require_error"] = str(error)
    print("REPORT" + json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report() -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(BLOCKED), json.dumps(CORE_MODULES)],
        capture_output=True, text=True, timeout=120,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT")]
    assert result.returncode == 0 and lines, f"probe failed (rc={result.returncode}):\n{result.stderr[-4000:]}"
    return json.loads(lines[-1][len("REPORT"):])


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_without_heavy_dependencies(report, module):
    assert module not in report["errors"], f"import {module} failed with {BLOCKED} blocked:\n{report['errors'][module]}"


def test_no_blocked_package_was_imported(report):
    assert report["leaked"] == [], f"blocked packages got imported: {report['leaked']}"


def test_no_blocked_package_was_even_tried(report):
    # Importing a core module must not try a heavy import and swallow the failure (``except ImportError: X = None``).
    assert report["attempted"] == [], f"imports of blocked packages were attempted: {sorted(set(report['attempted']))}"


def test_require_names_the_extra_to_install(report):
    message = report["require_error"]
    assert message is not None, "require('vllm') did not raise ImportError although vllm was blocked"
    assert "pip install 'rlhfkit[vllm]'" in message
    assert "rlhfkit.engines.vllm" in message


def test_require_in_process_for_an_absent_module():
    from rlhfkit._optional import require

    with pytest.raises(ImportError, match=r"rlhfkit.workers needs .* pip install 'rlhfkit\[ray\]'"):
        require("rlhfkit_test_absent_package", "ray", user="rlhfkit.workers")


# --- The shape of the package: blocks, their private modules, and what the core may import ------------------------
#
# A *block* is a public module or package of rlhfkit (``rlhfkit.weight_sync``, ``rlhfkit.engines.vllm``,
# ``rlhfkit.engines.router``, ...). A module whose dotted name has a component starting with ``_`` is private to the
# block above it (``rlhfkit.weight_sync._ipc`` belongs to ``rlhfkit.weight_sync``). The checks below read the source
# with ``ast`` (nothing is imported), so they see imports inside functions too.

SRC = Path(__file__).resolve().parents[1] / "src"

# Top-level private modules and the blocks allowed to import them (None: every block). A new top-level private module
# must be registered here, with its users; everything else private stays inside its own block.
SHARED_PRIVATE: dict[str, frozenset[str] | None] = {
    "rlhfkit._optional": None,  # the "pip install 'rlhfkit[extra]'" helper
    "rlhfkit._checks": frozenset({"rlhfkit.advantages", "rlhfkit.experience", "rlhfkit.dynamic_sampling",
                                  "rlhfkit.rollouts", "rlhfkit.losses"}),
    # the packed-layout checks and their messages (cu_seqlens, log-prob alignment) every core block shares, and the
    # per-sequence repeat (repeat_counts) that keeps the driver's small CPU ops off torch's OpenMP team
    "rlhfkit._cu_seqlens": frozenset({"rlhfkit.packing", "rlhfkit.losses", "rlhfkit.types", "rlhfkit.experience",
                                      "rlhfkit._checks", "rlhfkit.advantages", "rlhfkit.rollouts"}),
    "rlhfkit._arithmetic": frozenset({"rlhfkit.data"}),
    # user calls in daemon threads bounded by a timeout (environment steps, tool calls, reward functions)
    "rlhfkit._calls": frozenset({"rlhfkit.multiturn", "rlhfkit.rewards"}),
    # the weight-version / sleep-tag / weight-validity bookkeeping of the server-backed engines
    "rlhfkit.engines._state": frozenset({"rlhfkit.engines.vllm", "rlhfkit.engines.sglang"}),
    # the pause gate of in-flight weight updates (generate parks between decode steps while weights load)
    "rlhfkit.engines._pause": frozenset({"rlhfkit.engines.hf", "rlhfkit.engines.vllm"}),
    # free TCP ports outside the ephemeral range, for ports bound seconds later (MASTER_PORT, SGLang's server)
    "rlhfkit._ports": frozenset({"rlhfkit.placement", "rlhfkit.engines.sglang"}),
    # TCPStore servers bound to one address, and the signed (HMAC) store wrapper both stores share
    "rlhfkit._store": frozenset({"rlhfkit.weight_sync", "rlhfkit.phase"}),
}
# Blocks that must import (at module level) nothing beyond the standard library, torch, einops and each other.
CORE_BLOCKS = ("rlhfkit", "rlhfkit.types", "rlhfkit.packing", "rlhfkit.advantages", "rlhfkit.losses",
               "rlhfkit.experience", "rlhfkit.rollouts", "rlhfkit.dynamic_sampling", "rlhfkit._optional",
               "rlhfkit._checks", "rlhfkit._cu_seqlens")
CORE_THIRD_PARTY = frozenset({"torch", "einops"})


@dataclass(frozen=True)
class ImportEdge:
    module: str        # the importing module
    target: str        # the imported module (for ``from M import name``: M.name when that is a module, else M)
    name: str | None   # the imported name when it is not a module
    line: int
    top_level: bool    # runs when the module is imported (not inside a function, not under ``if TYPE_CHECKING``)

    def where(self, src: Path) -> str:
        return f"{self.module} (line {self.line})"


def find_modules(src: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``src/rlhfkit``."""
    modules = {}
    for path in sorted((src / "rlhfkit").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def block_of(module: str) -> str:
    if module in SHARED_PRIVATE:
        return module
    parts = module.split(".")
    while len(parts) > 1 and parts[-1].startswith("_"):
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[ImportEdge]:
    """Every import in ``path`` (relative imports resolved), marked top-level when it runs at import time."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: list[ImportEdge] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            top_level = False
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, top_level)
            return
        if isinstance(node, ast.Import):
            edges.extend(ImportEdge(module, alias.name, None, node.lineno, top_level) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    edges.append(ImportEdge(module, full, None, node.lineno, top_level))
                else:
                    edges.append(ImportEdge(module, base, alias.name, node.lineno, top_level))
        for child in ast.iter_child_nodes(node):
            visit(child, top_level)

    visit(ast.parse(path.read_text(), filename=str(path)), True)
    return edges


def all_imports(src: Path) -> list[ImportEdge]:
    modules = find_modules(src)
    return [edge for module, path in modules.items() for edge in imports_of(module, path, modules)]


def private_reaches(src: Path) -> list[str]:
    """Imports of another block's private module (or private name)."""
    problems = []
    for edge in all_imports(src):
        if edge.target.split(".")[0] != "rlhfkit":
            continue
        importer = block_of(edge.module)
        if edge.target in SHARED_PRIVATE:
            users = SHARED_PRIVATE[edge.target]
            if users is not None and importer not in users and importer != edge.target:
                problems.append(f"{edge.where(src)} imports {edge.target}, shared only by {sorted(users)}")
            continue
        owner = block_of(edge.target)
        if owner == importer:
            continue
        if any(part.startswith("_") for part in edge.target.split(".")[1:]):
            problems.append(f"{edge.where(src)} imports {edge.target}, private to {owner}: import a public name of "
                            f"{owner} (or register a shared module in SHARED_PRIVATE)")
        elif edge.name is not None and edge.name.startswith("_"):
            problems.append(f"{edge.where(src)} imports the private name {edge.name} of {edge.target}")
    return problems


def block_graph(src: Path) -> dict[str, dict[str, ImportEdge]]:
    """Block -> {imported block: one import that makes the edge}, from top-level imports only. Importing
    ``rlhfkit.engines.vllm`` also runs ``rlhfkit.engines``: parent packages count as imported."""
    graph: dict[str, dict[str, ImportEdge]] = {}
    for edge in all_imports(src):
        if not edge.top_level or edge.target.split(".")[0] != "rlhfkit":
            continue
        source = block_of(edge.module)
        parts = edge.target.split(".")
        targets = {block_of(".".join(parts[:i])) for i in range(2, len(parts) + 1)}
        for target in targets - {source, "rlhfkit"}:
            graph.setdefault(source, {}).setdefault(target, edge)
    return graph


def block_cycles(src: Path) -> list[str]:
    """Each cycle of the block graph once, as 'a -> b -> a' with the import lines that close it."""
    graph = block_graph(src)
    cycles, seen = [], set()

    def walk(node: str, path: list[str]) -> None:
        for target in sorted(graph.get(node, {})):
            if target in path:
                cycle = path[path.index(target):]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    hops = [graph[a][b] for a, b in zip(cycle, cycle[1:] + [target])]
                    cycles.append(" -> ".join(cycle + [target]) + ": " + "; ".join(
                        f"{hop.where(src)} imports {hop.target}" for hop in hops))
            elif len(path) < 20:
                walk(target, path + [target])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def heavy_core_imports(src: Path) -> list[str]:
    """Top-level imports by a core block of anything but the standard library, torch, einops and core rlhfkit."""
    problems = []
    for edge in all_imports(src):
        if not edge.top_level or block_of(edge.module) not in CORE_BLOCKS:
            continue
        root = edge.target.split(".")[0]
        if root == "rlhfkit":
            ok = block_of(edge.target) in CORE_BLOCKS
        else:
            ok = root in sys.stdlib_module_names or root in CORE_THIRD_PARTY or root == "__future__"
        if not ok:
            problems.append(f"{edge.where(src)} imports {edge.target} at module level; core blocks need only torch "
                            f"and einops (import it inside the function that needs it)")
    return problems


def test_no_block_imports_another_blocks_private_module():
    assert private_reaches(SRC) == []


def test_no_import_cycle_between_blocks():
    assert block_cycles(SRC) == []


def test_core_blocks_import_only_torch_einops_and_the_standard_library_at_module_level():
    assert heavy_core_imports(SRC) == []


def test_every_block_is_found():
    blocks = {block_of(module) for module in find_modules(SRC)}
    assert {"rlhfkit.weight_sync", "rlhfkit.engines.vllm", "rlhfkit.engines.hf", "rlhfkit.placement",
            "rlhfkit.packing", "rlhfkit._optional"} <= blocks
    assert "rlhfkit.weight_sync._ipc" in find_modules(SRC)


def test_shape_checks_catch_a_private_reach_a_cycle_and_a_heavy_core_import(tmp_path):
    """The three checks above can fail: a fake tree with one violation of each kind."""
    files = {
        "rlhfkit/__init__.py": "",
        "rlhfkit/alpha/__init__.py": "from rlhfkit.alpha._inner import X\nimport rlhfkit.beta\n",
        "rlhfkit/alpha/_inner.py": "X = 1\n",
        "rlhfkit/beta.py": "from rlhfkit.alpha import X\n"
                           "def f():\n    from rlhfkit.alpha._inner import X\n    from rlhfkit.alpha import _hidden\n",
        "rlhfkit/packing.py": "import transformers\nfrom typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    import vllm\ndef g():\n    import ray\n",
        "rlhfkit/_stray.py": "",
        "rlhfkit/gamma.py": "from rlhfkit import _stray\nfrom rlhfkit._checks import check_finite\n",
        "rlhfkit/_checks.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    reaches = private_reaches(tmp_path)
    assert len(reaches) == 4, reaches
    assert any("rlhfkit.beta (line 3) imports rlhfkit.alpha._inner" in p for p in reaches)
    assert any("private name _hidden" in p for p in reaches)
    assert any("imports rlhfkit._stray, private to rlhfkit" in p for p in reaches)
    assert any("rlhfkit.gamma (line 2) imports rlhfkit._checks, shared only by" in p for p in reaches)
    cycles = block_cycles(tmp_path)
    assert len(cycles) == 1 and cycles[0].startswith("rlhfkit.alpha -> rlhfkit.beta -> rlhfkit.alpha"), cycles
    heavy = heavy_core_imports(tmp_path)
    assert heavy == [heavy[0]] and "rlhfkit.packing (line 1) imports transformers" in heavy[0], heavy
