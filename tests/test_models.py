"""rlhfkit.models: a hub id resolves to its snapshot in the user's Hugging Face cache (offline here: a local cache
laid out as the hub's), folders stay folders, and the hub-id path loads a real model (HFEngine, RewardModel)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlhfkit.models import ModelNotFoundError, hf_environment, resolve_model, resolve_model_on_nodes

REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tiny_llama_path, tmp_path, monkeypatch) -> Path:
    """A hub cache holding ``REPO_ID`` at ``COMMIT`` (``refs/main`` pointing at it), offline, and no HF_HOME."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    shutil.copytree(tiny_llama_path, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache(hub_cache):
    snapshot = hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert resolve_model(REPO_ID) == snapshot
    assert resolve_model(REPO_ID, revision=COMMIT) == snapshot
    assert resolve_model(REPO_ID, revision="main") == snapshot


def test_a_folder_stays_a_folder(tiny_llama_path, hub_cache, monkeypatch):
    assert resolve_model(tiny_llama_path) == Path(tiny_llama_path).resolve()
    monkeypatch.chdir(Path(tiny_llama_path).parent)
    assert resolve_model(Path(tiny_llama_path).name) == Path(tiny_llama_path).resolve()  # a relative folder
    with pytest.raises(ValueError, match="revision='main' applies to hub ids only"):
        resolve_model(tiny_llama_path, revision="main")
    with pytest.raises(ModelNotFoundError, match="no model folder at"):
        resolve_model("./no/such/folder")


def test_an_unknown_id_offline_names_the_id_and_the_cache(hub_cache):
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("tiny-org/not-there")
    message = str(error.value)
    assert "'tiny-org/not-there'" in message and str(hub_cache) in message and "HF_HUB_OFFLINE" in message
    assert isinstance(error.value, FileNotFoundError)
    with pytest.raises(ModelNotFoundError, match="revision='v9'"):
        resolve_model(REPO_ID, revision="v9")


def test_hf_engine_and_reward_model_load_by_hub_id(hub_cache, tiny_llama_path):
    """transformers reads its cache location once, at import: without the resolver a hub id in a cache set
    afterwards (as a user's HF_HUB_CACHE reaches a worker) is not found offline."""
    from rlhfkit.engines.hf import HFEngine, HFEngineConfig
    from rlhfkit.rewards import RewardModel, RewardModelConfig
    from rlhfkit.engines.protocol import SamplingConfig

    by_id = HFEngine(HFEngineConfig(model=REPO_ID))
    by_folder = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    for name, weight in by_folder.model.state_dict().items():
        torch.testing.assert_close(by_id.model.state_dict()[name], weight, rtol=0, atol=0)
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, seed=3)
    assert torch.equal(by_id.generate([[1, 2, 3]], sampling)[0].response_token_ids,
                       by_folder.generate([[1, 2, 3]], sampling)[0].response_token_ids)
    with pytest.raises(ValueError, match="num_labels=2"):  # read by id (a causal LM's config: not a reward model)
        RewardModel(RewardModelConfig(model=REPO_ID))


def test_on_nodes_without_ray_or_for_a_folder_is_the_local_answer(hub_cache, tiny_llama_path, ray_not_started):
    snapshot = resolve_model(REPO_ID)
    assert resolve_model_on_nodes(REPO_ID) == snapshot
    assert resolve_model_on_nodes(tiny_llama_path) == Path(tiny_llama_path).resolve()


def test_workers_get_the_users_hf_environment_not_a_forced_offline(monkeypatch):
    from rlhfkit.hybrid import HybridConfig

    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE", "HF_HUB_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    config = HybridConfig(model="org/name", device="cpu", engine="hf")
    assert "HF_HUB_OFFLINE" not in config.worker_env()
    monkeypatch.setenv("HF_HUB_CACHE", "/data/hub")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hf_environment() == {"HF_HUB_CACHE": "/data/hub", "HF_TOKEN": "hf_secret", "HF_HUB_OFFLINE": "1"}
    assert config.worker_env().items() >= hf_environment().items()


def test_a_hybrid_run_names_its_models_by_folder(hub_cache, tiny_llama_path, ray_not_started):
    """What Hybrid.start hands its checks and workers: every hub id replaced by its folder, folders kept."""
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
    from rlhfkit.hybrid import HybridConfig, TrainerConfig
    from rlhfkit.hybrid._models import resolve_run_models

    deepspeed = DeepSpeedEngineConfig(optimizer="torch_adamw", bf16=False)
    config = HybridConfig(model=REPO_ID, device="cpu", engine="hf")
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed),
                "reward": TrainerConfig(deepspeed=deepspeed, model=str(tiny_llama_path))}
    resolved, roles = resolve_run_models(config, trainers, env=config.worker_env(), timeout_s=60)
    assert resolved.model == str(resolve_model(REPO_ID)) and roles["actor"].model is None
    assert roles["reward"].model == str(Path(tiny_llama_path).resolve())


@pytest.mark.ray
@pytest.mark.slow
def test_each_node_of_a_cluster_resolves_the_same_commit(hub_cache, ray_not_started):
    """A second Ray node (same machine, same cache path): one task there resolves the commit resolved here; a node
    whose cache lacks the model fails naming the node."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 * 1024**2})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=100 * 1024**2)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        assert len([node for node in ray.nodes() if node["Alive"]]) == 2
        assert resolve_model_on_nodes(REPO_ID, timeout_s=120) == resolve_model(REPO_ID)
        elsewhere = {"HF_HUB_CACHE": str(hub_cache.parent / "empty"), "HF_HUB_OFFLINE": "1"}
        with pytest.raises(ModelNotFoundError, match=r"on node \w+: model='tiny-org/tiny-llama'"):
            resolve_model_on_nodes(REPO_ID, env=elsewhere, timeout_s=120)
    finally:
        ray.shutdown()
        cluster.shutdown()
