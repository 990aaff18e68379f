"""Shared fixtures: tiny locally built HF models (real ``from_pretrained`` path), GPU skipping."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    """``examples/<name>.py`` as a module (registered in ``sys.modules``: its options dataclass looks it up)."""
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def kill_and_wait(ray, actor, *, timeout_s: float = 30.0) -> None:
    """``ray.kill(actor)`` and wait until the actor answers as dead: the kill is asynchronous, and a call submitted
    right after it can still run (the race that made test_killed_worker_surfaces_within_timeout flaky)."""
    import time

    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"actor {actor} still answers {timeout_s:g} s after ray.kill")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """``factory(arch="llama"|"qwen2", **TinyModelConfig fields) -> Path`` of a saved tiny model (cached per args)."""
    from rlhfkit.tiny_models import TinyModelConfig, build_tiny_model

    cache: dict = {}

    def factory(arch: str = "llama", **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[key] = build_tiny_model(path, TinyModelConfig(arch=arch, **overrides))
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    """The tiny Llama's tokenizer (with a chat template)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def hf_engine(tiny_llama_path):
    """An HF engine over the tiny Llama, seed 0."""
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig

    return HFEngine(HFEngineConfig(model=str(tiny_llama_path), seed=0))


@pytest.fixture(scope="session")
def tiny_qwen2_path(tiny_model_factory):
    return tiny_model_factory("qwen2")


def _ray_env() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def shared_ray_address():
    """The address of one local Ray cluster for the whole session (a head node with 2 CPUs and 4 logical GPUs),
    started by the first test that asks for it and stopped at the session's end (its own processes only; never
    ``ray stop``, which would stop every Ray on the machine). Tests join it (``ray.init(address=...)``,
    ``HybridConfig(ray_address=...)``, or the ``ray_address`` fixture's ``$RAY_ADDRESS``) and leave with
    ``ray.shutdown()``, which only disconnects them: a join costs a driver connection, not a cluster start, and the
    cluster frees a job's actors and placement groups when its driver leaves. Tests that need another cluster (other
    GPU counts or labels, several raylets, killing Ray) keep starting their own."""
    pytest.importorskip("ray")
    from ray._common.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    _ray_env()
    # Cluster writes its address where a plain ray.init() (no address: "start one") looks first and would join it,
    # refusing its num_cpus/num_gpus: the file gets back what it held, so nothing joins this cluster unasked
    address_file = Path(get_ray_address_file(None))
    before = address_file.read_text() if address_file.exists() else None
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 4, "include_dashboard": False, "object_store_memory": 512 * 1024**2})
    _restore_file(address_file, before)
    try:
        yield cluster.address
    finally:
        cluster.shutdown()
        _restore_file(address_file, before)


def _restore_file(path: Path, text: str | None) -> None:
    if text is not None:
        path.write_text(text)
    elif path.exists():
        path.unlink()


@pytest.fixture
def ray_address(shared_ray_address, monkeypatch):
    """For runs that start Ray through rlhfkit (an example's ``Hybrid.start``, a bench script's subprocess):
    ``$RAY_ADDRESS`` names the session's cluster, so they join it, and their ``close`` disconnects again. Nothing
    may be connected in this process before."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", shared_ray_address)
    yield shared_ray_address
    if ray.is_initialized():  # a run that failed before its close
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(request, shared_ray_address):
    """This process connected to the session's Ray cluster (4 logical GPUs) for one test module (reused if Ray is
    already up in this process). The test module's classes are pickled by value so actors can run them."""
    import sys

    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address=shared_ray_address, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[request.module.__name__])
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def ray_not_started():
    """For examples that start (and stop) their own Ray: none may be running in this process."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("deepspeed")
    if ray.is_initialized():
        ray.shutdown()
    yield


@pytest.fixture(autouse=True)
def _restore_vllm_multiprocessing_switch(monkeypatch):
    """VLLMEngine sets VLLM_ENABLE_V1_MULTIPROCESSING for its process when it builds an LLM (in_process=True); undo
    it after each test so that no test sees another's setting."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
