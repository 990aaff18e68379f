"""Tests of rlhfkit.deepspeed_engine.

In-process: the config, its DeepSpeed dict, the LR schedule, value alignment, name stripping and the storage
offloader. Real DeepSpeed on CPU: two torchrun launches (world size 1 and 2, gloo, DS_ACCELERATOR=cpu) of
tests/_ds_worker.py run every engine check once; the tests below assert on their results. GPU: the same worker with
FusedAdam + bf16 + NCCL and memory checks (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhfkit.deepspeed_engine._checkpoint import hf_name
from rlhfkit.deepspeed_engine._models import sequence_scores, token_aligned_values
from rlhfkit.deepspeed_engine._sleep import StorageOffloader
from rlhfkit.deepspeed_engine import DeepSpeedEngine, DeepSpeedEngineConfig, lr_factor
from rlhfkit.types import PackedBatch

WORKER = Path(__file__).with_name("_ds_worker.py")
CPU_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


# ---------------------------------------------------------------------------------------------- config (no deepspeed)
@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"zero_stage": 4}, "zero_stage=4"),
    ({"optimizer": "sgd"}, "optimizer='sgd'"),
    ({"learning_rate": 0.0}, "learning_rate=0.0"),
    ({"betas": (0.9, 1.0)}, "betas=(0.9, 1.0)"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
    ({"offload_params": True, "offload_optimizer": True, "zero_stage": 2}, "offload_params=True needs zero_stage=3"),
    ({"offload_optimizer": True, "zero_stage": 0}, "offload_optimizer=True needs zero_stage >= 1"),
    ({"lr_schedule": "cosine", "lr_warmup_steps": 5, "lr_total_steps": 5}, "lr_total_steps=5"),
    ({"lr_min_ratio": 1.5}, "lr_min_ratio=1.5"),
    ({"loss_normalization": "sum"}, "loss_normalization='sum'"),
    ({"gradient_clipping": -1.0}, "gradient_clipping=-1.0"),
])
def test_config_rejects_bad_values_naming_the_field(overrides, fragment):
    with pytest.raises(ValueError, match="DeepSpeedEngineConfig") as error:
        DeepSpeedEngineConfig(**overrides)
    assert fragment in str(error.value)


def test_config_betas_must_be_a_pair():
    with pytest.raises(TypeError, match=r"betas=\[0.9, 0.99\]"):
        DeepSpeedEngineConfig(betas=[0.9, 0.99])


def test_deepspeed_dict_zero3_fused_adam():
    config = DeepSpeedEngineConfig(zero_stage=3, bf16=True, learning_rate=3e-6, betas=(0.9, 0.95), weight_decay=0.1,
                                   gradient_clipping=0.5, gradient_accumulation_steps=4, micro_batch_size=2)
    ds = config.to_deepspeed_dict()
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["bf16"] == {"enabled": True}
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-6, "betas": [0.9, 0.95], "eps": 1e-8,
                                                          "weight_decay": 0.1}}
    assert ds["gradient_clipping"] == 0.5
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_micro_batch_size_per_gpu"] == 2
    assert "train_batch_size" not in ds  # derived by DeepSpeed from the world size
    assert "offload_optimizer" not in ds["zero_optimization"]


def test_deepspeed_dict_torch_adamw_offload_and_no_optimizer():
    config = DeepSpeedEngineConfig(zero_stage=3, optimizer="torch_adamw", offload_optimizer=True, offload_params=True)
    ds = config.to_deepspeed_dict()
    assert ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["zero_force_ds_cpu_optimizer"] is False
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    inference = DeepSpeedEngineConfig(zero_stage=2).to_deepspeed_dict(with_optimizer=False)
    assert "optimizer" not in inference and inference["zero_optimization"]["stage"] == 0  # nothing to shard
    assert DeepSpeedEngineConfig(zero_stage=3).to_deepspeed_dict(with_optimizer=False)["zero_optimization"][
        "stage"] == 3


def test_lr_factor_hand_values():
    assert [lr_factor(k, warmup_steps=4, schedule="constant", total_steps=None, min_ratio=0.0) for k in range(6)] == [
        0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = dict(warmup_steps=2, schedule="cosine", total_steps=10, min_ratio=0.1)
    assert lr_factor(2, **cosine) == pytest.approx(1.0)
    assert lr_factor(6, **cosine) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * 0.5
    assert lr_factor(10, **cosine) == pytest.approx(0.1)
    assert lr_factor(50, **cosine) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="step=-1"):
        lr_factor(-1, **cosine)
    config = DeepSpeedEngineConfig(learning_rate=1e-4, lr_warmup_steps=2, lr_schedule="cosine", lr_total_steps=10)
    assert config.lr_at(0) == pytest.approx(5e-5)


# ---------------------------------------------------------------------------------------------- pure helpers
def _packed(lengths, total):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.arange(total - int(cu[-1]))])
    return PackedBatch(input_ids=torch.arange(total), position_ids=positions, cu_seqlens=cu,
                       loss_mask=torch.zeros(total, dtype=torch.bool))


def test_value_alignment_and_sequence_scores():
    batch = _packed([3, 2], total=6)  # sequences [0, 1, 2], [3, 4], one padding token
    raw = torch.tensor([10.0, 11.0, 12.0, 13.0, 14.0, 15.0])
    # entry t = head output at t - 1 within the sequence; 0 at sequence starts and on padding
    assert token_aligned_values(raw, batch).tolist() == [0.0, 10.0, 11.0, 0.0, 13.0, 0.0]
    assert sequence_scores(raw, batch).tolist() == [12.0, 14.0]


def test_hf_name_strips_wrappers_only():
    assert hf_name("module.model.layers.0._checkpoint_wrapped_module.mlp.weight") == "model.layers.0.mlp.weight"
    assert hf_name("_orig_mod.lm_head.weight") == "lm_head.weight"
    assert hf_name("model.submodule.weight") == "model.submodule.weight"


def test_storage_offloader_keeps_views_aliased_and_values_identical():
    flat = torch.arange(10, dtype=torch.float32)
    first, second = flat[:4].view(2, 2), flat[4:]
    other = torch.randn(3, dtype=torch.bfloat16)
    expected = [t.clone() for t in (flat, first, second, other)]
    old = {t.untyped_storage().data_ptr() for t in (flat, other)}
    held = [flat.detach(), other.detach()]  # keep the old storages alive so their addresses are not reused
    offloader = StorageOffloader()
    moved = offloader.offload([flat, first, second, other, first], device=torch.device("cpu"))
    assert moved == 10 * 4 + 3 * 2
    assert all(t.untyped_storage().data_ptr() not in old for t in (flat, first, second, other))
    assert first.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="twice"):
        offloader.offload([flat], device=torch.device("cpu"))
    assert offloader.reload() == moved
    assert all(torch.equal(t, e) for t, e in zip((flat, first, second, other), expected))
    second[0] = -1.0  # still a view of flat after the round trip
    assert flat[4] == -1.0 and first.shape == (2, 2)
    del held


def test_storage_offloader_coalesces_storages_into_one_buffer_after_a_cycle():
    """After one round trip every storage is a slot of one buffer: the next offload is one copy, values and
    aliasing intact, and the pinned host buffer is reused (no pinning after the first cycle)."""
    states = [torch.randn(n, dtype=dtype) for n, dtype in ((7, torch.float32), (3, torch.bfloat16), (129, torch.float32))]
    view = states[2][5:9]
    expected = [t.clone() for t in states]
    offloader = StorageOffloader()
    assert offloader.offload([*states, view], device=torch.device("cpu")) == 7 * 4 + 3 * 2 + 129 * 4
    assert offloader.last_copies == 3
    offloader.reload()
    assert len({t.untyped_storage().data_ptr() for t in states}) == 1  # one buffer now
    assert all(torch.equal(t, e) for t, e in zip(states, expected))
    for cycle in range(3):
        states[0].add_(1.0)
        expected[0].add_(1.0)
        offloader.offload([*states, view], device=torch.device("cpu"))
        assert offloader.last_copies == 1 and offloader.last_pin_seconds == 0.0
        offloader.reload()
        assert all(torch.equal(t, e) for t, e in zip(states, expected)), cycle
    view[0] = 42.0  # still a view of its tensor
    assert states[2][5] == 42.0
    added = torch.ones(5)  # a new state joins: one more slot, values of the others intact
    offloader.offload([*states, added], device=torch.device("cpu"))
    assert offloader.last_copies == 2
    offloader.reload()
    assert torch.equal(added, torch.ones(5)) and torch.equal(states[1], expected[1])


def test_storage_offloader_reload_in_chunks_is_exact_and_chunks_check_their_sizes():
    """``reload(chunk_bytes=...)`` (the optimizer states' wake behind a forward-backward) brings back the same values
    as one copy, whatever the chunk size against the slots; ``nbytes`` counts what is offloaded."""
    from rlhfkit.deepspeed_engine._sleep import copy_in_chunks

    sizes = ((7, torch.float32), (3, torch.bfloat16), (129, torch.float32))
    states = [torch.randn(n, dtype=dtype) for n, dtype in sizes]
    expected = [t.clone() for t in states]
    offloader = StorageOffloader()
    for chunk in (5, 512, 10**6):  # smaller than a slot, about a slot, everything at once
        moved = offloader.offload(states, device=torch.device("cpu"))
        assert offloader.nbytes == moved >= 7 * 4 + 3 * 2 + 129 * 4  # (one aligned buffer after the first cycle)
        assert offloader.reload(chunk_bytes=chunk) == moved and offloader.nbytes == 0
        assert all(torch.equal(t, e) for t, e in zip(states, expected)), chunk
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        copy_in_chunks(torch.empty(4), torch.empty(4), 0)
    with pytest.raises(ValueError, match="12 bytes to 16 bytes"):
        copy_in_chunks(torch.empty(4), torch.empty(3), 8)


def test_sleep_plan_per_wrapper_and_stage():
    """Which mechanism moves what, decided from DeepSpeed's optimizer wrapper (fakes carry only the class name)."""
    from rlhfkit.deepspeed_engine._sleep import plan_sleep

    def engine_with(wrapper_name: str):
        return type("Engine", (), {"optimizer": type(wrapper_name, (), {"optimizer": object()})()})()

    bf16_wrapper = plan_sleep(engine_with("BF16_Optimizer"), zero_stage=1, has_optimizer=True,
                              offload_optimizer=False, offload_params=False)
    assert "BF16_Optimizer" in bf16_wrapper.unsupported and "grad_accum_dtype" in bf16_wrapper.unsupported
    zero12 = plan_sleep(engine_with("DeepSpeedZeroOptimizer"), zero_stage=2, has_optimizer=True,
                        offload_optimizer=False, offload_params=False)
    assert not zero12.unsupported and zero12.own_optimizer_states and "optim_states" not in zero12.deepspeed_states
    assert set(zero12.deepspeed_states) == {"hp_params", "lp_params", "lp_grads"}
    zero3_torch = plan_sleep(engine_with("DeepSpeedZeroOptimizer_Stage3"), zero_stage=3, has_optimizer=True,
                             offload_optimizer=False, offload_params=False)
    assert zero3_torch.own_master_and_optimizer and "hp_params" not in zero3_torch.deepspeed_states
    no_optimizer = plan_sleep(type("Engine", (), {"optimizer": None})(), zero_stage=3, has_optimizer=False,
                              offload_optimizer=False, offload_params=False)
    assert no_optimizer.own_module_params and not no_optimizer.deepspeed_states


def test_hf_export_shards_reload_with_from_pretrained(tiny_llama_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhfkit.deepspeed_engine._checkpoint import export_hf, iter_named_parameters

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_path))
    stream = iter_named_parameters(model, zero3=False, bucket_bytes=1, dtype=torch.bfloat16)
    export_hf(stream, model, tmp_path, rank=0, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((tmp_path / f).exists() for f in files)
    assert not list(tmp_path.glob(".shard-*"))
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype="auto")
    expected = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_engine_refuses_bad_role_and_missing_deepspeed(monkeypatch):
    config = DeepSpeedEngineConfig(zero_stage=0, bf16=False)
    with pytest.raises(ValueError, match="role='policy'"):
        DeepSpeedEngine(torch.nn.Linear(2, 2), role="policy", config=config)
    with pytest.raises(TypeError, match="DeepSpeedEngineConfig"):
        DeepSpeedEngine(torch.nn.Linear(2, 2), role="actor", config={"zero_stage": 0})
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"pip install 'rlhfkit\[deepspeed\]'"):
        DeepSpeedEngine(torch.nn.Linear(2, 2), role="actor", config=config)


def test_import_pulls_in_no_heavy_dependency():
    code = ("import sys, rlhfkit.deepspeed_engine, rlhfkit.phase; "
            "print([m for m in ('deepspeed', 'transformers', 'ray', 'vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- DeepSpeed on CPU
def _run_worker(num_ranks: int, checks: list[str], model: Path, workdir: Path, env_extra=None) -> dict:
    out = workdir / "results.json"
    env = {**os.environ, **CPU_ENV, **(env_extra or {})}
    if torch.cuda.is_available():
        env.pop("DS_ACCELERATOR")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={num_ranks}",
               str(WORKER), "--model", str(model), "--workdir", str(workdir), "--out", str(out),
               "--checks", ",".join(checks)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


WS1_CHECKS = ["train0", "train1", "train2", "train3", "stream0", "stream3", "stream3_bf16", "critic3", "groups2",
              "zero3views", "discard0", "discard1", "discard2", "discard3"]
WS2_CHECKS = ["train1", "train3", "stream0", "stream3", "critic2", "norm1", "norm3", "groups1", "zero3views",
              "discard2", "discard3"]


@pytest.fixture(scope="module")
def ds_results(tiny_llama_path, tmp_path_factory):
    """{world_size: {check: result}}; both launches run once for the whole module."""
    return {1: _run_worker(1, WS1_CHECKS, tiny_llama_path, tmp_path_factory.mktemp("ds-ws1")),
            2: _run_worker(2, WS2_CHECKS, tiny_llama_path, tmp_path_factory.mktemp("ds-ws2"))}


def _result(ds_results, world_size: int, check: str) -> dict:
    result = ds_results[world_size][check]
    assert "error" not in result, result.get("error")
    return result


TRAIN_CASES = [(1, s) for s in (0, 1, 2, 3)] + [(2, s) for s in (1, 3)]


@pytest.mark.parametrize(("world_size", "stage"), TRAIN_CASES)
def test_training_decreases_loss_with_scheduled_lr(ds_results, world_size, stage):
    result = _result(ds_results, world_size, f"train{stage}")
    losses = result["ref_losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    base = 2e-3  # the worker's config: warmup 2, cosine to step 10, floor 0.1
    expected = [base * (k + 1) / 2 for k in range(2)] + [
        base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 2) / 8))) for k in (2, 3)]
    assert result["ref_lrs"] == pytest.approx(expected, rel=1e-6)
    assert all(math.isfinite(g) and g > 0 for g in result["grad_norms"])


@pytest.mark.parametrize(("world_size", "stage"), [(1, s) for s in (0, 1, 2, 3)] + [(2, s) for s in (2, 3)])
def test_discarded_gradients_leave_no_trace_in_the_next_step(ds_results, world_size, stage):
    """Issue 50 item 4: discard_gradients() after part of a step (two backwards) leaves the next step exactly as
    if they never ran: the same pre-clip gradient norm and the same weights (the hybrid's accumulation mode)."""
    result = _result(ds_results, world_size, f"discard{stage}")
    assert result["norm"] == pytest.approx(result["clean_norm"], rel=1e-6), result
    assert result["max_weight_diff"] <= 1e-6, result


@pytest.mark.parametrize(("world_size", "stage"), TRAIN_CASES)
def test_sleep_wake_round_trip_is_exact(ds_results, world_size, stage):
    result = _result(ds_results, world_size, f"train{stage}")
    trip = result["round_trip"]
    assert trip["asleep_flag"] and trip["awake_flag"]
    assert trip["identical"], "state after wake_up() differs from before sleep()"
    assert set(trip["errors"].values()) == {"ok"}, trip["errors"]
    assert all(trip["moved"].values()), trip["moved"]  # every state storage left (by storage, not by flag)
    assert trip["resident_asleep"] == 0 and trip["sleep_stats"]["resident_state_bytes"] == 0
    # training after sleep/wake (and after a keep-weights sleep, deepened, then woken) == never slept
    assert result["losses"] == result["ref_losses"]
    assert result["kept_stream"]["keys_equal"] and not result["kept_stream"]["mismatched"]
    assert result["deep_asleep_stream"] == "ok"


@pytest.mark.parametrize(("world_size", "stage"), TRAIN_CASES)
def test_wake_may_leave_the_optimizer_states_for_later(ds_results, world_size, stage):
    """wake_up(defer_optimizer=True) leaves the optimizer's states on the host under ZeRO-0/1/2 (not ZeRO-3); a sleep
    with them still there is a complete sleep; finish_wake_behind() (finish_wake() in another thread, in 4 KiB pieces)
    during the backward brings them back, and the step trains exactly as a plain wake would (the loss comparison above covers that step)."""
    deferred = _result(ds_results, world_size, f"train{stage}")["deferred"]
    assert deferred["away"] == (stage < 3)
    assert deferred["asleep"] and deferred["resident_asleep"] == 0
    assert (deferred["finish_bytes"] > 0) == (stage < 3)
    assert not deferred["away_before_step"] and not deferred["away_after_step"]


@pytest.mark.parametrize(("world_size", "stage"), TRAIN_CASES)
def test_a_sleep_may_keep_the_optimizer_states_on_the_device(ds_results, world_size, stage):
    """sleep(keep_optimizer=True) moves the weights and gradients but not the fp32 masters and optimizer states; the
    wake from it has nothing to leave for later, and the step after it trains exactly as without sleeping (the loss
    comparison above); a later sleep(keep_optimizer=True) deepens a keep-weights sleep without moving them, and a plain
    sleep() then moves them (rlhfkit's own optimizer-state copies on every stage here: bytes counted on CPU too)."""
    from rlhfkit.deepspeed_engine._sleep import OPTIMIZER_STATES

    kept = _result(ds_results, world_size, f"train{stage}")["kept_optimizer"]
    assert kept["offloaded"] and not set(kept["offloaded"]) & OPTIMIZER_STATES, kept["offloaded"]
    assert kept["away"] is False
    assert not set(kept["deepened_offloaded"]) & OPTIMIZER_STATES and kept["weights_kept"] is False
    assert kept["moved_at_last"]["bytes_moved"] > 0 and kept["moved_at_last"]["resident_state_bytes"] == 0


@pytest.mark.parametrize(("world_size", "stage"), TRAIN_CASES)
def test_zero12_stream_lives_in_flat_buffers(ds_results, world_size, stage):
    """What makes zero-copy CUDA-IPC sync pay: under ZeRO-1/2 the 21 streamed parameters are views of DeepSpeed's
    flat buffers (one per parameter group: the worker's config cuts the tiny model into 4), also after a sleep/wake
    moved them; without ZeRO each is its own until a sleep/wake cycle, which brings them back as slots of one buffer
    (StorageOffloader)."""
    before, after = _result(ds_results, world_size, f"train{stage}")["stream_storages"]
    if stage in (1, 2):
        assert before == after == 4, (before, after)
    elif stage == 0:
        assert before in (1, 21) and after == 1, (before, after)
    else:
        assert before == after == -1


@pytest.mark.parametrize("world_size", [1, 2])
def test_zero3_stream_skips_the_gather_only_on_one_rank(ds_results, world_size):
    """ZeRO-3 on one rank: each parameter's partition is the whole tensor, so the sync stream yields views of the
    partitions (nothing gathered, nothing copied); on two ranks it gathers. Either way, after training steps, the
    stream equals DeepSpeed's own gather, also cast to bf16."""
    result = _result(ds_results, world_size, "zero3views")
    assert result["num"] == 21 and result["released"] == 21, result  # threshold 0: every parameter released
    assert result["views"] == (21 if world_size == 1 else 0), result
    assert result["equal"] and result["cast_equal"] and result["changed"], result
    assert result["losses"][1] < result["losses"][0], result


@pytest.mark.parametrize(("world_size", "stage"), [(1, 2), (2, 1)])
def test_zero12_parameter_groups_bound_the_step_and_keep_the_update(ds_results, world_size, stage):
    """param_group_elements cuts the parameters into optimizer groups; DeepSpeed's ZeRO-1/2 step then builds one
    group's fp32 gradient partition at a time (its transient memory), and the weights come out as with one group."""
    result = _result(ds_results, world_size, f"groups{stage}")
    one, split = result["one"], result["split"]
    assert one["group_sizes"] == [123_200], one  # the tiny Llama
    assert len(split["group_sizes"]) == 4 and sum(split["group_sizes"]) == 123_200, split
    assert max(split["group_sizes"]) <= 40_000, split  # whole tensors, none larger than the bound here
    assert one["largest_fp32_grad"] >= 123_200 // world_size
    assert split["largest_fp32_grad"] <= -(-max(split["group_sizes"]) // world_size) + 64, split  # + alignment
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert result["max_weight_diff"] < 1e-6, result


@pytest.mark.parametrize(("world_size", "stage"), TRAIN_CASES)
def test_actor_stream_equals_file_state_dict(ds_results, world_size, stage):
    """Before training, the (ZeRO-3: gathered) stream of an actor is exactly the checkpoint's state dict."""
    stream = _result(ds_results, world_size, f"train{stage}")["initial_stream"]
    assert stream["keys_equal"] and not stream["mismatched"] and stream["num"] == 21, stream


@pytest.mark.parametrize(("world_size", "stage"), TRAIN_CASES)
def test_checkpoint_resume_matches_and_partial_is_ignored(ds_results, world_size, stage):
    result = _result(ds_results, world_size, f"train{stage}")
    assert result["saved"] == "step-000002" and result["latest"] == "step-000002"  # step-000099 has no marker
    assert result["partial_load"] == "ok"
    assert result["resumed_step"] == 2
    assert result["resumed_offload_keys"] == 0
    assert result["client_state"] == {"role": "actor", "name": "actor", "global_step": 2}
    assert result["resumed_losses"] == result["ref_losses"][2:]
    assert result["resumed_lrs"] == result["ref_lrs"][2:]
    export = result["export"]
    assert export["keys_equal"] and not export["mismatched"], export
    assert "model.safetensors" in result["hf_files"] and "config.json" in result["hf_files"]


STREAM_CASES = [(1, s) for s in (0, 3)] + [(2, s) for s in (0, 3)]


@pytest.mark.parametrize(("world_size", "stage"), STREAM_CASES)
def test_reference_stream_equals_state_dict_and_logprobs_match_hf(ds_results, world_size, stage):
    result = _result(ds_results, world_size, f"stream{stage}")
    for key in ("stream", "stream_one_bucket"):
        assert result[key]["keys_equal"] and not result[key]["mismatched"], result[key]
    assert result["stream"]["num"] == 21  # tiny llama: 2 layers x 9 + embed + norm + lm_head
    assert result["dtypes"] == ["torch.float32"]
    assert result["description_matches_stream"]  # the sync manifest, described without gathering
    assert result["logprob_max_err"] < 1e-5
    trip = result["round_trip"]
    assert trip["identical"] and all(trip["moved"].values()) and set(trip["errors"].values()) == {"ok"}
    assert result["logprobs_identical_after_wake"]


def test_reference_bf16_stream_dtype(ds_results):
    result = _result(ds_results, 1, "stream3_bf16")
    assert result["dtypes"] == ["torch.bfloat16"]
    assert result["stream"]["keys_equal"] and not result["stream"]["mismatched"]
    assert result["logprob_max_err"] < 2e-2  # bf16 packed vs per-sequence forward


@pytest.mark.parametrize(("world_size", "stage"), [(1, 3), (2, 2)])
def test_critic_values_training_stream_and_export(ds_results, world_size, stage):
    result = _result(ds_results, world_size, f"critic{stage}")
    assert result["losses"][-1] < result["losses"][0], result["losses"]
    assert result["zero_at_starts"] and result["zero_on_padding"]
    assert not result["stream_has_head"] and result["stream_num"] == 20
    assert result["export_vs_stream"]["keys_equal"] and not result["export_vs_stream"]["mismatched"]
    assert result["value_max_err"] < 1e-5 and result["reward_max_err"] < 1e-5
    trip = result["round_trip"]
    assert trip["identical"] and set(trip["errors"].values()) == {"ok"}
    # a reward model (no optimizer) loaded from the critic's HF export scores exactly like the critic
    assert result["reward_model_vs_critic_max_err"] == 0.0
    reward_trip = result["reward_round_trip"]
    assert reward_trip["identical"] and all(reward_trip["moved"].values()) and reward_trip["errors"]["forward"] == "ok"
    assert "not available on 'reward'" in result["reward_backward"]


@pytest.mark.parametrize(("world_size", "stage"), [(2, 1), (2, 3)])
def test_loss_normalization_matches_plain_torch_gradient(ds_results, world_size, stage):
    result = _result(ds_results, world_size, f"norm{stage}")
    for mode in ("per_micro_batch", "global"):
        assert result[mode]["first_step_stats"] == {}  # not an accumulation boundary yet
        assert result[mode]["grad_norm"] == pytest.approx(result[mode]["reference_norm"], rel=1e-5)
    assert result["global"]["grad_norm"] != pytest.approx(result["per_micro_batch"]["grad_norm"], rel=1e-3)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_fused_adam_sleep_frees_memory_and_resumes_exactly(tiny_model_factory, tmp_path):
    """FusedAdam + bf16 + NCCL (ZeRO-1/2/3): every state tensor on the host after sleep, allocated memory net of the
    pre-build baseline <= 10% of awake, bit-identical after wake, same losses as never slept.
    A ≈ 13M-parameter model, so that the states dominate the few fixed buffers left on the GPU."""
    model = tiny_model_factory("llama", hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8)
    config = {"optimizer": "fused_adam", "bf16": True, "attn_implementation": "eager"}
    results = _run_worker(1, ["train1", "train2", "train3"], model, tmp_path,
                          env_extra={"RLHFKIT_TEST_DS_CONFIG": json.dumps(config),
                                     "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0")})
    for check, result in results.items():
        assert "error" not in result, (check, result.get("error"))
        trip = result["round_trip"]
        assert trip["identical"] and all(trip["moved"].values()), (check, trip)  # every state tensor on the host
        assert trip["resident_asleep"] == 0 and trip["resident_awake"] > 0, (check, trip)
        # net of what the process held before this engine was built (CUDA context, NCCL, the batch)
        base = trip["memory_baseline"]["allocated"]
        awake, asleep = trip["memory_awake"]["allocated"] - base, trip["memory_asleep"]["allocated"] - base
        assert awake > 0 and asleep <= 0.1 * awake, (check, base, awake, asleep, trip)
        assert result["losses"] == result["ref_losses"], check


def test_deepspeed_dict_partial_optimizer_offload():
    """Issue 20 (7B on one GPU): DeepSpeed's offload_optimizer.ratio and sub_group_size, refused where DeepSpeed
    would assert (not ZeRO-3 Offload with its CPU Adam) or where the schedule would not reach the GPU part."""
    config = DeepSpeedEngineConfig(zero_stage=3, offload_optimizer=True, offload_optimizer_ratio=0.66,
                                   sub_group_elements=100_000_000)
    zero = config.to_deepspeed_dict()["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.66}
    assert zero["sub_group_size"] == 100_000_000
    assert "ratio" not in DeepSpeedEngineConfig(zero_stage=3, offload_optimizer=True).to_deepspeed_dict()[
        "zero_optimization"]["offload_optimizer"]
    with pytest.raises(ValueError, match=r"offload_optimizer_ratio=0.5 needs zero_stage=3, offload_optimizer=True"):
        DeepSpeedEngineConfig(zero_stage=2, offload_optimizer=True, offload_optimizer_ratio=0.5)
    with pytest.raises(ValueError, match="optimizer='torch_adamw'"):
        DeepSpeedEngineConfig(zero_stage=3, offload_optimizer=True, offload_optimizer_ratio=0.5,
                              optimizer="torch_adamw")
    with pytest.raises(ValueError, match="lr_warmup_steps=2"):
        DeepSpeedEngineConfig(zero_stage=3, offload_optimizer=True, offload_optimizer_ratio=0.5, lr_warmup_steps=2)
    with pytest.raises(ValueError, match="offload_optimizer_ratio=0"):
        DeepSpeedEngineConfig(zero_stage=3, offload_optimizer=True, offload_optimizer_ratio=0)


@pytest.mark.parametrize("stage", [1, 3])
def test_lora_actor_sleeps_and_trains_on_exactly(lora_results, stage):
    """Regression (issue 20, found at 7B on an H100): a ZeRO-3 actor with LoRA adapters (frozen base) could not
    sleep: DeepSpeed's offload_states mapped the frozen parameters' shards onto the trainable ones' flat buffer. Now
    the round trip moves every state, the frozen base included (under ZeRO-1 it used to stay on the GPU: 14.2 GiB at
    7B), and training after it equals never sleeping."""
    result = lora_results[f"lora{stage}"]
    assert "error" not in result, result.get("error")
    trip = result["round_trip"]
    assert result["frozen"] > 0 and trip["identical"] and set(trip["errors"].values()) == {"ok"}, trip
    assert trip["resident_asleep"] == 0
    assert all(trip["moved"].values()), trip["moved"]  # ZeRO-1/2 too: the frozen base is not in DeepSpeed's buffers
    assert result["losses"] == result["ref_losses"]
    # after the first round trip the frozen base stays on the host's pinned copy: later sleeps copy only what trains
    first = trip["sleep_stats"]
    assert first["bytes_moved"] > 0 and first["bytes_kept_on_host"] == 0
    for later in result["later_sleeps"]:  # each after a sleep(keep_weights=True), which leaves the base alone
        assert later["keep_weights_kept"] == 0, later
        assert later["bytes_moved"] < first["bytes_moved"] and later["bytes_kept_on_host"] > 0, later
        # the base's bytes, in one buffer whose slots are 512-byte aligned
        assert 0 <= later["bytes_kept_on_host"] - result["frozen_bytes"] < 512 * result["frozen"], later


@pytest.mark.parametrize(("world_size", "stage"), STREAM_CASES)
def test_reference_sleeps_without_copying_weights_it_already_holds_on_host(ds_results, world_size, stage):
    """A model without an optimizer: the first sleep copies its weights to pinned host memory, later ones free the
    device copy without copying (the host copy still holds them) and the wake brings back identical log-probs. A
    write the engine can see (in place) or is told of (``weights_changed``) makes the next sleep copy again, and the
    written values survive; without a write the sleep after it copies nothing again."""
    result = _result(ds_results, world_size, f"stream{stage}")
    first, fixed = result["round_trip"]["sleep_stats"], result["fixed"]
    assert first["bytes_moved"] > 0 and first["bytes_kept_on_host"] == 0
    kept = fixed["second"]["bytes_kept_on_host"]  # the weights, now in one buffer with 512-byte aligned slots
    assert fixed["second"]["bytes_moved"] == 0 and 0 <= kept - first["bytes_moved"] < 512 * 32, fixed["second"]
    assert fixed["same_logprobs"]
    for after, written in (("after_inplace", "inplace_kept"), ("after_said", "said_kept")):
        assert fixed[after]["bytes_moved"] == kept and fixed[after]["bytes_kept_on_host"] == 0, (after, fixed[after])
        assert fixed[written], after
    assert fixed["after_clean"]["bytes_moved"] == 0 and fixed["clean_kept"]


@pytest.fixture(scope="module")
def lora_results(tiny_llama_path, tmp_path_factory):
    return _run_worker(1, ["lora1", "lora3"], tiny_llama_path, tmp_path_factory.mktemp("ds-lora"))


# ---------------------------------------------------------------------------------------------- fused kernels (Liger)
def test_fused_kernels_config_accepts_liger_or_none():
    assert DeepSpeedEngineConfig(fused_kernels="liger").fused_kernels == "liger"
    with pytest.raises(ValueError, match=r"fused_kernels='triton'; expected None or 'liger'"):
        DeepSpeedEngineConfig(fused_kernels="triton")


def test_fused_kernels_refused_without_cuda_then_without_liger_then_for_unknown_architectures(tiny_llama_path,
                                                                                             monkeypatch):
    """apply_fused_kernels checks, before touching the model: CUDA, then Liger-Kernel (naming the extra), then that
    Liger patches the architecture; a known one gets RMSNorm, RoPE and SwiGLU without any fused cross-entropy."""
    import types

    from transformers import AutoModelForCausalLM

    from rlhfkit.deepspeed_engine._models import apply_fused_kernels

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="fused_kernels='liger' needs CUDA"):
        apply_fused_kernels(model, "liger")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not installed
    monkeypatch.delitem(sys.modules, "liger_kernel.transformers.monkey_patch", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'rlhfkit\[liger\]'"):
        apply_fused_kernels(model, "liger")
    calls = []
    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": lambda **kwargs: calls.append(kwargs)}
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)
    with pytest.raises(ValueError, match=r"no kernels for model_type='llama' \(it patches \['qwen2'\]\)"):
        apply_fused_kernels(model, "liger")
    assert calls == []
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN["llama"] = lambda **kwargs: calls.append(kwargs)
    apply_fused_kernels(model, "liger")
    assert calls == [{"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                      "fused_linear_cross_entropy": False, "model": model}]
    with pytest.raises(ValueError, match=r"fused_kernels='apex'; expected 'liger'"):
        apply_fused_kernels(model, "apex")


_LIGER_CHECK = """
import sys, torch
from rlhfkit.deepspeed_engine._models import load_hf_model
from rlhfkit.losses import model_logprobs
from rlhfkit.packing import VARLEN_ATTENTION, pack_rollouts
from rlhfkit.types import PackedBatch
torch.manual_seed(0)
lengths = [37, 61, 20]
ids = torch.randint(0, 200, (sum(lengths),))
cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
pos = torch.cat([torch.arange(n) for n in lengths])
batch = PackedBatch(input_ids=ids, position_ids=pos, cu_seqlens=cu, loss_mask=pos > 5).to("cuda")
results = []
for kernels in (None, "liger"):  # transformers' modules first: Liger patches the process from then on
    model = load_hf_model(sys.argv[1], role="actor", bf16=False, attn_implementation=VARLEN_ATTENTION,
                          value_head_init_std=None, fused_kernels=kernels).cuda()
    logprobs = model_logprobs(model, batch)
    logprobs[batch.loss_mask].sum().backward()
    results.append((logprobs.detach(), model.model.layers[0].mlp.gate_proj.weight.grad.clone(),
                    model.model.norm._get_name()))
(lp0, g0, norm0), (lp1, g1, norm1) = results
assert (norm0, norm1) == ("LlamaRMSNorm", "LigerRMSNorm"), (norm0, norm1)
assert (lp0 - lp1).abs().max() < 1e-4, (lp0 - lp1).abs().max()
assert torch.allclose(g0, g1, rtol=1e-3, atol=1e-5), (g0 - g1).abs().max()
print("ok", norm1, float((lp0 - lp1).abs().max()))
"""


@pytest.mark.gpu
def test_gpu_liger_kernels_give_transformers_log_probs_and_gradients(tiny_llama_path):
    """On CUDA with Liger-Kernel: the patched model's packed log-probs and gradients equal transformers' (fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("liger_kernel")
    result = subprocess.run([sys.executable, "-c", _LIGER_CHECK, str(tiny_llama_path)], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0 and "ok Liger" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]


# ---------------------------------------------------------------------------------------------- compiled layers
def test_compile_layers_config_is_a_bool_and_refused_under_zero3():
    assert DeepSpeedEngineConfig(zero_stage=1, compile_layers=True).compile_layers is True
    with pytest.raises(TypeError, match=r"compile_layers='yes'"):
        DeepSpeedEngineConfig(zero_stage=1, compile_layers="yes")
    with pytest.raises(ValueError, match=r"compile_layers=True with zero_stage=3"):
        DeepSpeedEngineConfig(zero_stage=3, compile_layers=True)


def test_decoder_layers_are_the_no_split_modules_and_a_model_without_them_is_named(tiny_llama_path):
    transformers = pytest.importorskip("transformers")
    from rlhfkit.deepspeed_engine._models import decoder_layers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    layers = decoder_layers(model)
    assert [type(layer).__name__ for layer in layers] == ["LlamaDecoderLayer"] * model.config.num_hidden_layers
    assert layers == list(model.model.layers)
    # a critic's value model and a LoRA actor's peft wrapper: the same layers, found inside
    from rlhfkit.deepspeed_engine._models import as_value_model
    from rlhfkit.lora import LoraConfig, apply_lora

    critic = as_value_model(transformers.AutoModelForSequenceClassification.from_pretrained(tiny_llama_path,
                                                                                            num_labels=1))
    assert [type(layer).__name__ for layer in decoder_layers(critic)] == ["LlamaDecoderLayer"] * len(layers)
    adapted = apply_lora(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path),
                         LoraConfig(rank=4, target_modules=("q_proj", "v_proj")))
    assert len(decoder_layers(adapted)) == len(layers)
    with pytest.raises(ValueError, match=r"no decoder layers in Sequential .*names none"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


_COMPILE_CHECK = """
import sys, torch
from torch._dynamo.utils import counters
from rlhfkit.deepspeed_engine import DeepSpeedEngine, DeepSpeedEngineConfig
from rlhfkit.deepspeed_engine._models import decoder_layers
from rlhfkit.packing import VARLEN_ATTENTION
from rlhfkit.types import PackedBatch

def batch(lengths, seed):
    ids = torch.randint(0, 200, (sum(lengths),), generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return PackedBatch(input_ids=ids, position_ids=pos, cu_seqlens=cu, loss_mask=pos > 3)

batches = [batch([17, 29, 9], 1), batch([23, 12], 2), batch([31, 8, 14, 6], 3)]  # a new length every step
results = []
for compiled in (False, True):
    config = DeepSpeedEngineConfig(zero_stage=0, bf16=False, optimizer="torch_adamw", learning_rate=1e-3,
                                   attn_implementation=VARLEN_ATTENTION, compile_layers=compiled)
    engine = DeepSpeedEngine.from_pretrained(sys.argv[1], role="actor", config=config, name=f"actor-{compiled}")
    losses = []
    for b in batches:
        logprobs = engine.forward_logprobs(b, loss_tokens_only=True)
        engine.backward(-(logprobs * b.loss_mask).sum() / b.loss_mask.sum())
        losses.append(engine.step()["loss"])
        engine.sleep()  # the hybrid's switches: every state off the device and back between steps
        engine.wake_up()
    with torch.no_grad():
        after = engine.forward_logprobs(batches[0])
    results.append((losses, after, [layer._compiled_call_impl is not None for layer in decoder_layers(engine.module)]))
(eager, eager_after, eager_flags), (compiled, compiled_after, compiled_flags) = results
assert eager_flags == [False, False] and compiled_flags == [True, True], (eager_flags, compiled_flags)
assert max(abs(a - b) for a, b in zip(eager, compiled)) < 1e-5, (eager, compiled)
assert (eager_after - compiled_after).abs().max() < 1e-5, (eager_after - compiled_after).abs().max()
# one graph with its backward for training, one for the no-grad forward: no graph break, no recompile per length
assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
assert counters["stats"]["unique_graphs"] == 2, counters["stats"]["unique_graphs"]
print("ok", compiled)
"""


def test_compiled_layers_train_as_eager_ones_with_one_graph_per_kind_of_call(tiny_llama_path):
    """Real DeepSpeed (ZeRO-0, CPU, fp32) with compile_layers on and off on three packed batches of new lengths,
    asleep and awake again after each step: the same losses and log-probs after training, every decoder layer
    compiled, no graph break, and two graphs in all (training and no-grad), whatever the lengths."""
    env = {**os.environ, **CPU_ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "0"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_CHECK, str(tiny_llama_path)], capture_output=True,
                            text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0 and "ok [" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
