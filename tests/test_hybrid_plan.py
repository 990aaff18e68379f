"""rlhfkit.hybrid.plan_hybrid: one plan, decided before anything starts, for real model shapes on 80 and 141 GB cards
and a small host (config.json files of the published shapes, no weights); printable, editable, checked when passed
back. The memory estimate under a given plan: tests/test_hybrid_fit.py."""

from __future__ import annotations

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.hybrid import EnginePlan, HybridConfig, HybridPlan, RolePlan, TrainerConfig, plan_hybrid
from rlhfkit.hybrid._plan import check_plan
from rlhfkit.lora import LoraConfig
from rlhfkit.placement import MemoryFitError

CARD_80, CARD_141, HOST = 79.2, 139.8, 125.0  # torch's total_memory of an H100 / H200; the lent machine's host
SHAPES = ("smollm2-135m", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.1-8b")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, str]:
    """Each published shape as a config folder (hidden size, layers, heads, KV heads, intermediate, vocab)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.scale import ARCHITECTURES

    folders = {}
    for name in SHAPES:
        fields = dict(ARCHITECTURES[name])
        path = tmp_path_factory.mktemp(name)
        transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(path)
        folders[name] = str(path)
    return folders


def example_run(model: str) -> tuple[HybridConfig, dict[str, TrainerConfig]]:
    """examples/grpo_hybrid.py's configs for ``--model model`` and no layout flags."""
    from conftest import load_example

    from rlhfkit.options import parse_options

    grpo = load_example("grpo_hybrid")
    return grpo.configs(parse_options(grpo.Options, ["--model", model]))


def plan(model: str, gpu: float, host: float = HOST) -> HybridPlan:
    config, trainers = example_run(model)
    return plan_hybrid(config, trainers, gpu_memory_gib=gpu, host_memory_gib=host)


@pytest.mark.parametrize("gpu", [CARD_80, CARD_141])
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-1.5b"])
def test_small_models_run_as_configured_with_their_states_kept_on_the_gpu(shapes, name, gpu):
    """The example's ZeRO-1 layout fits; the actor keeps its weights and optimizer states on the GPU through its
    sleeps (no wake waits for them), the largest micro-batch budget fits, the switches overlap."""
    chosen = plan(shapes[name], gpu)
    actor, reference = chosen.roles["actor"], chosen.roles["reference"]
    assert chosen.layout == "as configured" and actor.zero_stage == 1 and actor.offload_share == 0
    assert actor.offload and actor.keep_weights and actor.keep_optimizer
    assert not (reference.keep_weights or reference.keep_optimizer)  # frozen: nothing to keep
    assert actor.micro_batch_tokens == reference.micro_batch_tokens == 16384
    assert chosen.overlap_switches and chosen.engine.sleep_level == 2 and chosen.engine.kv_cache_tokens == 128 * 256
    assert max(chosen.gpu_phases.values()) < gpu and max(chosen.host_phases.values()) < HOST


def test_3b_sleeps_with_checkpointing_on_80_gb_and_runs_as_configured_on_141(shapes):
    on_80, on_141 = plan(shapes["qwen2.5-3b"], CARD_80), plan(shapes["qwen2.5-3b"], CARD_141)
    assert on_80.layout == "every role asleep in host memory" and on_80.roles["actor"].gradient_checkpointing
    assert not on_80.overlap_switches  # every role resident at once does not fit the card
    assert on_141.layout == "as configured" and not on_141.roles["actor"].gradient_checkpointing
    assert on_141.overlap_switches


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama-3.1-8b"])
def test_7b_and_8b_take_zero3_with_part_of_the_optimizer_in_host_memory_on_141_gb(shapes, name):
    """The example's default command at 7B-8B (no layout flags) on one H200 and ~125 GiB of host memory: fp32
    masters and Adam moments on the GPU do not fit beside the engines with the estimate's margin, so the actor stays
    resident under ZeRO-3 with gradient checkpointing and part of its optimizer in host memory."""
    chosen = plan(shapes[name], CARD_141)
    actor = chosen.roles["actor"]
    assert actor.zero_stage == 3 and 0 < actor.offload_share < 1 and not actor.offload
    assert actor.gradient_checkpointing and chosen.layout.startswith("ZeRO-3")
    assert max(chosen.gpu_phases.values()) < CARD_141 and max(chosen.host_phases.values()) < HOST
    config, trainers = example_run(shapes[name])
    deepspeed = actor.deepspeed_config(trainers["actor"].deepspeed)
    assert deepspeed.zero_stage == 3 and deepspeed.offload_optimizer and not deepspeed.compile_layers
    assert deepspeed.offload_optimizer_ratio == actor.offload_share and deepspeed.optimizer == "fused_adam"
    assert trainers["actor"].deepspeed.zero_stage == 1  # the user's config is not rewritten


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama-3.1-8b"])
def test_7b_and_8b_full_parameters_are_refused_on_80_gb_naming_the_phase_and_the_shortfall(shapes, name):
    """On one 80 GB card no layout the plan tries fits the estimate's margin: the refusal names the layout that came
    closest, its phase and its shortfall, before anything starts."""
    with pytest.raises(MemoryFitError, match=r"No layout the plan tries fits .*The closest, ZeRO-3, 66% .*phase "
                                             r"'syncing'.*short by \d+\.\d GiB") as info:
        plan(shapes[name], CARD_80)
    assert info.value.phase == "syncing" and info.value.memory == "gpu" and 5 < info.value.shortfall_gib < 30


def test_lora_7b_fits_80_gb_with_the_engines_base_kept(shapes):
    config, trainers = example_run(shapes["qwen2.5-7b"])
    lora = LoraConfig(rank=16, target_modules=("q_proj", "v_proj"))
    chosen = plan_hybrid(config, {"actor": dataclasses.replace(trainers["actor"], lora=lora)},
                         gpu_memory_gib=CARD_80, host_memory_gib=HOST)
    assert chosen.engine.sleep_level == 1  # a push carries the adapters only
    assert max(chosen.gpu_phases.values()) < CARD_80


def test_a_small_host_keeps_the_roles_on_the_gpu_or_says_what_does_not_fit(shapes):
    """32 GiB of host memory: SmolLM2 sleeps as configured; 1.5B keeps every role resident on the GPU (nothing
    pinned in host memory); 7B cannot fit its optimizer anywhere: refused naming the phase."""
    assert plan(shapes["smollm2-135m"], CARD_80, 32.0).layout == "as configured"
    resident = plan(shapes["qwen2.5-1.5b"], CARD_80, 32.0)
    assert resident.layout == "every role resident on the GPU"
    assert not any(role.offload for role in resident.roles.values())
    with pytest.raises(MemoryFitError) as info:
        plan(shapes["qwen2.5-7b"], CARD_141, 32.0)
    assert info.value.phase and info.value.shortfall_gib > 0


def test_the_printed_plan_names_every_role_the_engines_and_each_phase(shapes):
    config, trainers = example_run(shapes["qwen2.5-1.5b"])
    critic = TrainerConfig(deepspeed=trainers["actor"].deepspeed)
    trainers = trainers | {"critic": critic, "reward": TrainerConfig(deepspeed=trainers["reference"].deepspeed)}
    chosen = plan_hybrid(config, trainers, gpu_memory_gib=CARD_141, host_memory_gib=HOST)
    text = str(chosen)
    assert text == chosen.describe()
    lines = text.splitlines()
    for role in ("actor", "reference", "critic", "reward"):
        assert any(line.startswith(role) for line in lines), (role, text)
    assert "engines: sleep level 2" in text and "switches overlapped:" in text
    for phase in ("generating", "training", "training_critic", "forward_reference", "forward_reward", "syncing"):
        assert phase in text


def test_without_a_gpu_size_the_plan_is_the_layout_as_configured(shapes):
    """CPU or an unknown GPU: no estimate, nothing kept on the GPU while asleep, the smallest micro-batch budget,
    no overlapped switches, the model read ahead where there are several roles."""
    config = HybridConfig(model=shapes["smollm2-135m"], device="cpu", engine="hf")
    deepspeed = DeepSpeedEngineConfig(zero_stage=0, bf16=False, optimizer="torch_adamw")
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed), "reference": TrainerConfig(deepspeed=deepspeed)}
    chosen = plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None)
    assert chosen.layout == "as configured" and not chosen.gpu_phases and not chosen.overlap_switches
    assert all(role.micro_batch_tokens == 4096 and not role.keep_weights for role in chosen.roles.values())
    assert chosen.read_ahead and chosen.engine.kv_cache_tokens is None and chosen.roles["actor"].offload
    assert check_plan(config, trainers, chosen) is None


def test_an_edited_plan_is_checked_when_passed_back(shapes):
    """A plan is frozen; edits (dataclasses.replace, replace_role, replace_engine) make a new one, which
    check_plan (what Hybrid.start runs on a plan it is given) accepts or refuses before anything starts."""
    config, trainers = example_run(shapes["qwen2.5-1.5b"])
    chosen = plan_hybrid(config, trainers, gpu_memory_gib=CARD_80, host_memory_gib=HOST)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.overlap_switches = False
    smaller = chosen.replace_role("actor", micro_batch_tokens=4096)
    assert smaller.roles["actor"].micro_batch_tokens == 4096 and chosen.roles["actor"].micro_batch_tokens == 16384
    assert smaller.layout == "edited"
    check_plan(config, trainers, smaller)
    with pytest.raises(MemoryFitError, match="with the plan given does not fit: phase 'syncing'") as info:
        check_plan(config, trainers, chosen.replace_engine(kv_cache_tokens=5_000_000))  # ~134 GiB of KV cache
    assert info.value.suggestion == chosen  # the plan plan_hybrid chose fits: the error offers it
    with pytest.raises(ValueError, match="sleep_level=1 would put them to sleep"):
        check_plan(dataclasses.replace(config, overlap=True, max_weight_lag=1), trainers,
                   chosen.replace_engine(sleep_level=1))
    scheduled = dict(trainers, actor=dataclasses.replace(trainers["actor"], deepspeed=dataclasses.replace(
        trainers["actor"].deepspeed, lr_schedule="cosine", lr_total_steps=100)))
    partial = chosen.replace_role("actor", zero_stage=3, offload=False, offload_share=0.5)
    with pytest.raises(ValueError, match=r"offload_optimizer_ratio=0.5 with lr_schedule='cosine'"):  # DeepSpeed's no
        check_plan(config, scheduled, partial)
    with pytest.raises(ValueError, match=r"the plan's roles \['actor', 'reference'\] are not the run's"):
        check_plan(config, {"actor": trainers["actor"]}, chosen)
    overlap = plan_hybrid(dataclasses.replace(config, overlap=True, max_weight_lag=1), trainers,
                          gpu_memory_gib=None, host_memory_gib=None)
    assert overlap.engine.sleep_level == 0


@pytest.mark.parametrize(("changes", "message"), [
    ({"zero_stage": 4}, "zero_stage=4"),
    ({"zero_stage": 1, "offload_share": 0.5, "offload": False}, "needs zero_stage=3"),
    ({"zero_stage": 3, "offload_share": 0.5, "offload": True}, "is not moved by its offload_states"),
    ({"zero_stage": 1, "micro_batch_tokens": 0}, "micro_batch_tokens=0"),
])
def test_role_plans_refuse_what_cannot_run(changes, message):
    with pytest.raises(ValueError, match=message):
        RolePlan(**changes)


def test_engine_plans_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="sleep_level=3"):
        EnginePlan(sleep_level=3, memory=0.2)
    with pytest.raises(ValueError, match="memory=1.2"):
        EnginePlan(sleep_level=2, memory=1.2)
    with pytest.raises(ValueError, match="kv_bytes_per_token=0"):
        EnginePlan(sleep_level=2, memory=0.2, kv_cache_tokens=1024)
    assert EnginePlan(sleep_level=2, memory=0.2, kv_cache_tokens=1000, kv_bytes_per_token=2).kv_cache_bytes == 2016
