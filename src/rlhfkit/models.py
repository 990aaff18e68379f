"""Where a named model lives: a folder stays a folder; a hub id (``Qwen/Qwen2.5-1.5B-Instruct``) becomes its snapshot
folder in the Hugging Face cache, downloaded there when missing.

:func:`resolve_model` runs ``huggingface_hub.snapshot_download`` under the caller's Hugging Face environment, read
when called: the cache (``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``TRANSFORMERS_CACHE``, ``HF_HOME``), the
token (``HF_TOKEN``), the endpoint (``HF_ENDPOINT``) and ``HF_HUB_OFFLINE`` (then only the cache is read). An id the
cache does not hold offline, or the hub does not know, is a :class:`ModelNotFoundError` naming the id and the cache.
:func:`resolve_model_on_nodes` does it once on this machine and once on every other node of the Ray cluster (a tiny
task each, pinned to the commit this machine resolved), so that workers on any node load the same folder.
:func:`hf_environment` is the part of this process's environment that workers need for the same answers.

What it does not do: pick files (every file of the snapshot but ``IGNORED_FILES`` is fetched), load models, or
check that the folder holds one. Needs ``huggingface_hub`` (``rlhfkit[hf]``) for hub ids, ``ray`` for the nodes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from rlhfkit._optional import require

__all__ = ["ModelNotFoundError", "hf_environment", "resolve_model", "resolve_model_on_nodes"]

logger = logging.getLogger(__name__)

# The variables that decide where Hugging Face libraries find and fetch models: workers get the driver's values.
HF_ENVIRONMENT = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_TOKEN",
                  "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "HF_HUB_ETAG_TIMEOUT",
                  "HF_HUB_DOWNLOAD_TIMEOUT", "HF_HUB_ENABLE_HF_TRANSFER", "HF_XET_HIGH_PERFORMANCE")
# Files of a model repository that neither transformers nor vLLM reads (original checkpoints, other frameworks).
IGNORED_FILES = ("original/*", "*.pth", "*.h5", "*.msgpack", "*.onnx", "*.ot", "*.gguf", "*.tflite")
_TRUE = ("1", "true", "yes", "on")


class ModelNotFoundError(FileNotFoundError):
    """A model name that is neither a folder nor a hub id the cache (offline) or the hub can give."""


def hf_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``HF_ENVIRONMENT`` variables set in ``environ`` (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in HF_ENVIRONMENT if name in environ}


def _hub_cache() -> Path:
    """The hub cache folder as ``huggingface_hub`` computes it from the environment, read now (its own constants
    are read once, when it is first imported)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.endswith("/") or name.count("/") > 1 or "\\" in name


def resolve_model(name_or_path: str | os.PathLike, *, revision: str | None = None) -> Path:
    """The folder of the model ``name_or_path``: a folder as it is (``revision`` must be None), or the snapshot of
    a hub id at ``revision`` (a branch, tag or commit; None: the repository's default branch) in the hub cache,
    downloaded there unless ``HF_HUB_OFFLINE`` is set.

    Raises :class:`ModelNotFoundError` (a ``FileNotFoundError``) when it is neither, naming the id, the revision and
    the cache; ``ValueError`` for a revision given with a folder."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise TypeError(f"model={name_or_path!r}; give a model folder or a hub id such as 'Qwen/Qwen2.5-0.5B'")
    name = os.fspath(name_or_path)
    folder = Path(name).expanduser()
    if folder.is_dir():
        if revision is not None:
            raise ValueError(f"model={name!r} is a folder; revision={revision!r} applies to hub ids only (drop it)")
        return folder.resolve()
    if folder.exists() or isinstance(name_or_path, Path) or _looks_like_path(name):
        raise ModelNotFoundError(f"model={name!r}: no model folder at {folder} (and a path is not a hub id)")
    user = "rlhfkit.models (a model given by its hub id)"
    huggingface_hub = require("huggingface_hub", "hf", user=user)
    errors = require("huggingface_hub.errors", "hf", user=user)  # a submodule: not loaded by the package's import
    cache, offline = _hub_cache(), _offline()
    try:
        snapshot = huggingface_hub.snapshot_download(
            name, revision=revision, cache_dir=cache, local_files_only=offline, endpoint=os.environ.get("HF_ENDPOINT"),
            ignore_patterns=list(IGNORED_FILES))
    except errors.HFValidationError as error:
        raise ModelNotFoundError(f"model={name!r} is neither a folder nor a valid hub id ('org/name'): {error}") \
            from error
    except errors.GatedRepoError as error:
        raise ModelNotFoundError(f"model={name!r} is gated on the hub: accept its terms on the model page and set "
                                 f"HF_TOKEN to a token of that account ({type(error).__name__})") from error
    except (errors.LocalEntryNotFoundError, errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as error:
        where = (f"the hub cache {cache} holds no snapshot of it (HF_HUB_OFFLINE is set: nothing is downloaded; "
                 "unset it, or download the model where the hub is reachable, into the same cache)" if offline else
                 f"the hub ({os.environ.get('HF_ENDPOINT') or 'huggingface.co'}) and the cache {cache} do not have "
                 "it (a typo? a private repository needs HF_TOKEN)")
        raise ModelNotFoundError(f"model={name!r} (revision={revision!r}) is not a folder, and {where}: "
                                 f"{type(error).__name__}") from error
    return Path(snapshot)


def resolve_model_on_nodes(name_or_path: str | os.PathLike, *, revision: str | None = None,
                           env: Mapping[str, str] | None = None, timeout_s: float = 3600.0) -> Path:
    """:func:`resolve_model` here, then, for a hub id and a Ray cluster of several nodes, once on every other alive
    node: a task of no CPU pinned to each node, under ``env`` (default :func:`hf_environment`), resolving the commit
    resolved here. Returns the folder, which must be the same path on every node (the same cache path), else a
    ``ValueError`` names the nodes and their folders. A node that does not answer within ``timeout_s`` (a download)
    is a ``TimeoutError`` naming it."""
    folder = resolve_model(name_or_path, revision=revision)
    if Path(os.fspath(name_or_path)).expanduser().is_dir():
        return folder  # a folder: the workers read the same path (a shared file system, or a copy on each node)
    ray = require("ray", user="rlhfkit.models.resolve_model_on_nodes")
    if not ray.is_initialized():
        return folder
    here = ray.get_runtime_context().get_node_id()
    others = [node["NodeID"] for node in ray.nodes() if node.get("Alive") and node["NodeID"] != here]
    if not others:
        return folder
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(_resolve_task)
    env = dict(hf_environment() if env is None else env)
    commit = folder.name  # the snapshot folder is named after its commit: every node takes the same one
    pending = {task.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                            runtime_env={"env_vars": env}).remote(os.fspath(name_or_path), commit): node
               for node in others}
    ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    if late:
        for ref in late:
            ray.cancel(ref, force=True)
        raise TimeoutError(f"resolving model {os.fspath(name_or_path)!r} on nodes {[pending[r] for r in late]} took "
                           f"more than {timeout_s} s (a download; pass a larger timeout or download it beforehand)")
    paths = {}
    for ref in ready:
        try:
            paths[pending[ref]] = ray.get(ref)
        except ModelNotFoundError as error:  # Ray's task error is also the task's error type
            raise ModelNotFoundError(f"on node {pending[ref]}: {getattr(error, 'cause', error)}") from error
    different = {node: path for node, path in paths.items() if Path(path) != folder}
    if different:
        raise ValueError(f"model {os.fspath(name_or_path)!r} resolves to {folder} here but to {different} on other "
                         "nodes; give every node the same HF_HUB_CACHE / HF_HOME path (or pass a folder every node "
                         "has)")
    logger.info("model %s resolved to %s on %d node(s)", os.fspath(name_or_path), folder, len(paths) + 1)
    return folder


def _resolve_task(name: str, commit: str) -> str:
    return os.fspath(resolve_model(name, revision=commit))

