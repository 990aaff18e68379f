"""The core blocks import with only torch: heavy optional dependencies are blocked in a subprocess.

Putting ``None`` into ``sys.modules[name]`` makes ``import name`` raise ImportError, as if the package were not
installed. One subprocess imports every module of :data:`CORE_MODULES` (one by one, recording failures) and reports
which blocked packages anything tried to import; the tests below check the report. Extend :data:`CORE_MODULES` when a
new block must import without the extras (e.g. ``rlhfkit.placement``, which needs ray only to materialise a plan).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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
    # the blocks below need an extra to *run*, but must still import without it (heavy imports live in functions)
    "rlhfkit.weight_sync",
    "rlhfkit.placement",
    "rlhfkit.workers",
    "rlhfkit.rewards",
    "rlhfkit.data",
    "rlhfkit.tiny_models",
    "rlhfkit.engines.hf",
    "rlhfkit.engines.vllm",
    "rlhfkit.engines.router",
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
