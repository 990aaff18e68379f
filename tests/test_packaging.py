"""rlhfkit installs like a library: the wheel built from the repo works in a fresh environment.

The wheel is built from a copy of the repository (the working tree is never written to) with the interpreter's own
setuptools and no network (``pip wheel --no-deps --no-build-isolation --no-index``). A fresh venv sees the test
interpreter's packages (torch is not installed again), gets the wheel with ``--no-deps``, and imports every module
of ``tests/test_imports.py``'s ``CORE_MODULES`` from a directory outside the repository with no ``PYTHONPATH``: each
module must come from the venv's site-packages, never from ``src/``. The fast tests check the metadata that points
at ``LICENSE``, the Python floor the docs state, and that ``docs/install.md`` lists every pin of
``constraints/gpu-stack.txt``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from test_imports import CORE_MODULES

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Not part of a source tree a build needs: VCS data, environments, caches, run outputs, benchmark results.
_NOT_SOURCE = {".git", ".venv", ".cache", ".carry", ".whl", ".ci", ".pytest_cache", "__pycache__", "runs", "build",
               "dist", "results"}

_SMOKE = """
import importlib, importlib.metadata, json, sys
modules = json.loads(sys.argv[1])
files = {name: importlib.import_module(name).__file__ for name in modules}
print("SMOKE" + json.dumps({"files": files, "version": importlib.metadata.version("rlhfkit")}))
"""


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert result.returncode == 0, f"{command} failed (rc={result.returncode}):\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}"
    return result


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {name for name in names if name in _NOT_SOURCE or name.endswith(".egg-info")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", minversion="77.0")  # the build backend pyproject.toml asks for
    base = tmp_path_factory.mktemp("packaging")
    source, dist = base / "source", base / "dist"
    shutil.copytree(ROOT, source, ignore=_ignore)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "--wheel-dir", str(dist), str(source)], env=env)
    wheels = sorted(dist.glob("rlhfkit-*.whl"))
    assert len(wheels) == 1, f"expected one rlhfkit wheel in {dist}, found {wheels}"
    return wheels[0]


def _fresh_venv(path: Path) -> Path:
    """A venv that sees this interpreter's packages (a venv's ``--system-site-packages`` alone sees only the base's)."""
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)])
    python = path / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    parent = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    # Plain path lines: the parent's own .pth files (an editable rlhfkit among them) are not processed.
    (site / "_rlhfkit_test_parent.pth").write_text("".join(f"{line}\n" for line in parent))
    return python


def test_wheel_installs_and_imports_in_a_fresh_venv(wheel, tmp_path):
    python = _fresh_venv(tmp_path / "venv")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
         env=env)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    result = _run([str(python), "-c", _SMOKE, json.dumps(CORE_MODULES)], cwd=outside, env=env)
    report = json.loads([line for line in result.stdout.splitlines() if line.startswith("SMOKE")][-1][len("SMOKE"):])
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     env=env).stdout.strip()).resolve()
    for module, file in report["files"].items():
        path = Path(file).resolve()
        assert path.is_relative_to(site), f"{module} was imported from {path}, not from the installed wheel in {site}"
        assert not path.is_relative_to(ROOT), f"{module} was imported from the source tree: {path}"
    assert report["version"] == PYPROJECT["version"]


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
        license_text = archive.read(f"{dist_info}/licenses/LICENSE").decode()
        metadata = Parser().parsestr(archive.read(f"{dist_info}/METADATA").decode())
    assert "rlhfkit/py.typed" in names
    assert license_text == (ROOT / "LICENSE").read_text()
    outside = sorted({name.split("/")[0] for name in names} - {"rlhfkit", dist_info})
    assert outside == [], f"the wheel carries more than the rlhfkit package: {outside}"
    packaged = {name for name in names if name.startswith("rlhfkit/")}
    source = {path.relative_to(ROOT / "src").as_posix() for path in (ROOT / "src" / "rlhfkit").rglob("*")
              if path.is_file() and "__pycache__" not in path.parts}
    assert source - packaged == set(), f"files of src/rlhfkit missing from the wheel: {sorted(source - packaged)}"
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == PYPROJECT["requires-python"]


def test_license_metadata_points_at_the_apache_license():
    assert PYPROJECT["license"] == "Apache-2.0"
    assert PYPROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the full text, not a stub


def test_docs_state_the_python_floor_of_pyproject():
    floor = re.fullmatch(r">=\s*(3\.\d+)", PYPROJECT["requires-python"]).group(1)
    assert sys.version_info >= tuple(map(int, floor.split("."))), "the test interpreter is below requires-python"
    for page in ("README.md", "docs/install.md"):
        assert f"Python ≥ {floor}" in (ROOT / page).read_text(), f"{page} does not say 'Python ≥ {floor}'"


def test_install_page_lists_every_pin_of_the_gpu_constraints():
    pins = [line.split("#")[0].strip() for line in (ROOT / "constraints" / "gpu-stack.txt").read_text().splitlines()]
    pins = [pin for pin in pins if pin]
    assert pins, "constraints/gpu-stack.txt pins nothing"
    page = (ROOT / "docs" / "install.md").read_text()
    for pin in pins:
        name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9A-Za-z.*+]+)", pin).groups()
        row = re.compile(rf"^\| {re.escape(name)} \| {re.escape(version)} \|", re.MULTILINE)
        assert row.search(page), f"docs/install.md's table has no row '| {name} | {version} |' ({pin})"
