"""The hybrid run's memory estimate (rlhfkit.hybrid._fit) under a given plan, and the launcher's checks before
anything starts: a plan that cannot fit one GPU or one node's host memory is refused naming the phase and the
shortfall in GiB (ZeRO-3, offload, LoRA, gradient checkpointing, the engines' KV cache included). Configs only:
models are built on the meta device, nothing is trained. The plan's own choices: tests/test_hybrid_plan.py."""

from __future__ import annotations

import dataclasses

import pytest

transformers = pytest.importorskip("transformers")

from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig
from rlhfkit.hybrid import Hybrid, HybridConfig, TrainerConfig, plan_hybrid
from rlhfkit.hybrid._fit import model_shape, offloaded_fraction
from rlhfkit.hybrid._plan import check_plan
from rlhfkit.lora import LoraConfig
from rlhfkit.placement import MemoryFitError


def _architecture(tmp_path_factory, name: str) -> str:
    """bench/scale.py's published config of ``name`` as a config folder (no weights: the check never reads them)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.scale import ARCHITECTURES

    fields = dict(ARCHITECTURES[name])
    path = tmp_path_factory.mktemp(name)
    transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory):
    return _architecture(tmp_path_factory, "qwen2.5-7b")


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    return _architecture(tmp_path_factory, "llama-3.1-8b")


def _trainers(**deepspeed):
    return DeepSpeedEngineConfig(**({"zero_stage": 3, "bf16": True} | deepspeed))


H100 = {"gpu_memory_gib": 79.2, "host_memory_gib": 125.0}  # the lent GPU machine
H200 = H100 | {"gpu_memory_gib": 139.8}  # torch's total_memory of an H200, in GiB
LARGE_FULL = {"offload_optimizer_ratio": 0.66, "sub_group_elements": 100_000_000}  # the hand 7B-8B layout


def check(config, trainers, machine=None, *, engine=None, tokens=4096, **roles):
    """The estimate of the layout as configured (the plan's first candidate, ``tokens`` per micro-batch, nothing
    kept on the GPU while asleep), with ``engine`` (EnginePlan fields) and ``roles`` (role -> RolePlan fields)
    edited, on ``machine``: :func:`rlhfkit.hybrid._plan.check_plan` raises where it does not fit."""
    plan = plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None)
    for role in plan.roles:
        plan = plan.replace_role(role, micro_batch_tokens=tokens, **roles.get(role, {}))
    plan = plan.replace_engine(**(engine or {}))
    machine = machine or {}
    return check_plan(config, trainers, dataclasses.replace(plan, gpu_memory_gib=machine.get("gpu_memory_gib"),
                                                            host_memory_gib=machine.get("host_memory_gib")))


def test_model_shape_counts_the_real_parameters(qwen7b):
    shape = model_shape(qwen7b)
    assert 7.5e9 < shape.num_params < 7.7e9  # Qwen2.5-7B: 7.62e9 with its untied head
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (3584, 28, 152064)


def test_full_parameter_7b_without_offload_names_the_phase_and_the_shortfall(qwen7b):
    """Regression (issue 20): 7B full-parameter AdamW on one 80 GiB GPU without offload cannot fit (bf16 weights +
    grads + fp32 master and moments ≈ 114 GiB): refused naming the engines' wake after the push beside the actor's
    states ('syncing', the step's peak) and a shortfall of a hundred GiB and more."""
    config = HybridConfig(model=qwen7b, dtype="bfloat16")
    trainers = {"actor": TrainerConfig(deepspeed=_trainers())}
    with pytest.raises(MemoryFitError, match=r"phase 'syncing' needs ~\d+\.\d GiB .*short by \d+\.\d GiB") as info:
        check(config, trainers, {"gpu_memory_gib": 80.0}, engine={"memory": 0.3})
    assert info.value.phase == "syncing" and 100 < info.value.shortfall_gib < 200
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("settings", [
    {"deepspeed": {"offload_optimizer": True, "gradient_checkpointing": True}},
    {"deepspeed": {"gradient_checkpointing": True}, "lora": LoraConfig(rank=16)},
])
def test_offload_or_lora_makes_7b_fit_the_gpu(qwen7b, settings):
    """GPU only (no host size given): both fit 80 GiB."""
    config = HybridConfig(model=qwen7b, dtype="bfloat16", device="cpu", engine="hf")
    trainer = TrainerConfig(deepspeed=_trainers(**settings["deepspeed"]), lora=settings.get("lora"))
    estimate = check(config, {"actor": trainer, "reference": TrainerConfig(deepspeed=_trainers())},
                     {"gpu_memory_gib": 80.0}, engine={"sleep_level": 1, "memory": 0.3})
    assert estimate.host_per_node == {}


def test_full_offload_7b_is_refused_for_host_memory(qwen7b):
    """Regression (issue 20): ZeRO-3 with the whole optimizer offloaded, the trainers resident: DeepSpeed keeps 18
    bytes per parameter in host memory (fp32 master, fp32 gradient, Adam moments, bf16 gradient partition): ~128 GiB
    for 7.6B alone, beside the engine's level-1 backup, in 125 GiB: refused naming host memory, the phase and the
    shortfall. The worst phase is the reference's load: its whole host copy beside the actor's offloaded states."""
    config = HybridConfig(model=qwen7b, dtype="bfloat16")
    actor = TrainerConfig(deepspeed=_trainers(offload_optimizer=True, gradient_checkpointing=True), offload=False)
    reference = TrainerConfig(deepspeed=_trainers(), offload=False)
    with pytest.raises(MemoryFitError, match=r"does not fit host memory: phase 'load_reference' needs ~\d+\.\d GiB "
                                             r"of host memory on node0 \(actor 127\.\d, reference 14\.2, rollout "
                                             r"14\.2.*short by \d+\.\d GiB") as info:
        check(config, {"actor": actor, "reference": reference}, H100, engine={"memory": 0.35})
    assert info.value.memory == "host" and 40 < info.value.shortfall_gib < 55
    with pytest.raises(MemoryFitError, match="phase 'generating'") as steady:  # without the load: still short
        check(config, {"actor": actor}, H100, engine={"memory": 0.35})
    assert steady.value.memory == "host" and steady.value.shortfall_gib > 20


def test_partial_offload_without_reference_fits_7b_and_8b_on_a_141_gb_gpu(qwen7b, llama8b):
    """Issue 20: the hand 7B-8B layout (ZeRO-3, two thirds of the optimizer in host memory, the actor resident)
    passes both budgets on an H200; on an H100 the estimate's margin refuses it in the push; a partial share with a
    sleeping role is refused by the config itself."""
    deepspeed = _trainers(offload_optimizer=True, gradient_checkpointing=True, **LARGE_FULL)
    actor = TrainerConfig(deepspeed=deepspeed, offload=False)
    for path, host in ((qwen7b, 118.0), (llama8b, 122.0)):
        config = HybridConfig(model=path, dtype="bfloat16")
        estimate = check(config, {"actor": actor}, H200, engine={"memory": 0.25})
        assert 78.0 < estimate.peak() < 115 and host - 1 < estimate.host_peak() < host  # 7B measured 78.0 GiB
        assert set(estimate.host_phases) == {"generating", "training", "syncing", "load_actor"}
        with pytest.raises(MemoryFitError, match="phase 'syncing'"):
            check(config, {"actor": actor}, H100, engine={"memory": 0.25})
    with pytest.raises(ValueError, match=r"TrainerConfig\(offload=True\) with deepspeed.offload_optimizer_ratio=0.66"):
        TrainerConfig(deepspeed=deepspeed, offload=True)


def test_lora_7b_fits_both_budgets(qwen7b):
    """The LoRA layout at 7B: the trainers parked in host memory and the engine's level-1 backup."""
    lora = TrainerConfig(deepspeed=_trainers(gradient_checkpointing=True), lora=LoraConfig(rank=16))
    estimate = check(HybridConfig(model=qwen7b, dtype="bfloat16"),
                     {"actor": lora, "reference": TrainerConfig(deepspeed=_trainers())}, H100,
                     engine={"memory": 0.35, "sleep_level": 1})
    assert estimate.peak() < 60 and 55 < estimate.host_peak() < 65


def test_offloaded_fraction_places_whole_sub_groups():
    """DeepSpeed cuts parameters in order into sub-groups that close at sub_group_size and keeps the first
    int((1 - ratio) * n) on the GPU: a large first tensor puts more than 1 - ratio there."""
    sizes = (5, 1, 1, 1, 1, 1)  # sub-groups of >= 2: [5], [1, 1], [1, 1], [1] -> the first 2 of 4 on the GPU
    assert offloaded_fraction(sizes, ratio=0.5, sub_group_elements=2) == pytest.approx(0.3)
    assert offloaded_fraction(sizes, ratio=0.5, sub_group_elements=100) == 1.0  # one sub-group: int(0.5) = 0 on GPU
    assert offloaded_fraction(sizes, ratio=1.0, sub_group_elements=2) == 1.0
    # two ranks: partitions (3, 1, 1, 1, 1, 1) -> [3], [1, 1, 1], [1, 1] -> the first 1 of 3 on the GPU
    assert offloaded_fraction(sizes, ratio=0.5, sub_group_elements=3, world=2) == pytest.approx(5 / 8)


def test_an_engine_share_that_leaves_no_room_names_the_engines_wake(qwen7b):
    """A role kept resident plus a 0.9 engine share overflow the phases the engines are awake in; the worst is their
    wake after the push, beside the actor as it trained."""
    trainer = TrainerConfig(deepspeed=_trainers(offload_optimizer=True, gradient_checkpointing=True), offload=False)
    with pytest.raises(MemoryFitError, match="phase 'syncing'") as info:
        check(HybridConfig(model=qwen7b, dtype="bfloat16"), {"actor": trainer}, {"gpu_memory_gib": 80.0},
              engine={"memory": 0.9})
    assert info.value.phase == "syncing"


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engine_weights_that_fill_the_engine_share_name_generating(qwen7b, engine):
    """Regression (issue 20): 7B float32 engine weights (28 GiB) in a 0.15 share of 80 GiB (12 GiB), for vLLM and
    SGLang alike; in bf16 and a 0.3 share they fit."""
    trainers = {"actor": TrainerConfig(deepspeed=_trainers(offload_optimizer=True))}
    with pytest.raises(MemoryFitError, match=r"phase 'generating'.*28\.\d GiB.*12\.0 GiB.*short by 16\.\d GiB"):
        check(HybridConfig(model=qwen7b, engine=engine), trainers, {"gpu_memory_gib": 80.0})
    check(HybridConfig(model=qwen7b, engine=engine, dtype="bfloat16"), trainers,
          {"gpu_memory_gib": 80.0, "host_memory_gib": 1000.0}, engine={"memory": 0.3})


def test_engine_dtype_follows_the_device(qwen7b):
    assert HybridConfig(model=qwen7b, dtype="bfloat16").engine_dtype == "bfloat16"
    assert HybridConfig(model=qwen7b, dtype="bfloat16", device="cpu", engine="hf").engine_dtype == "float32"


def test_kv_cache_bytes_counts_layers_kv_heads_and_whole_blocks(qwen7b):
    """Qwen2.5-7B: 28 layers x keys and values x 4 KV heads x 128 values = 57,344 bytes a token in bf16; 1,000
    tokens take 63 blocks of 16; tensor parallelism splits the heads, down to one head per GPU."""
    from rlhfkit.hybrid._fit import kv_cache_bytes

    shape = model_shape(qwen7b)
    assert (shape.num_kv_heads, shape.head_dim) == (4, 128)
    assert kv_cache_bytes(shape, tokens=1000, dtype_bytes=2) == 1008 * 57_344
    assert kv_cache_bytes(shape, tokens=1008, dtype_bytes=2, tensor_parallel_size=2) == 1008 * 57_344 // 2
    assert kv_cache_bytes(shape, tokens=16, dtype_bytes=4, tensor_parallel_size=8) == 16 * 28 * 2 * 1 * 128 * 4
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        kv_cache_bytes(dataclasses.replace(shape, num_kv_heads=0), tokens=16, dtype_bytes=2)


def test_a_sized_kv_cache_sizes_the_generating_phase(qwen7b):
    """An engine with a sized KV cache is counted as weights + that cache + vLLM's working memory instead of its
    share: with a 0.5 share of 139.8 GiB the engine takes 70 GiB and its CUDA graphs, with a 128 x 1,024-token
    cache ~23 GiB."""
    from rlhfkit.hybrid._fit import engine_awake_gib

    config = HybridConfig(model=qwen7b, dtype="bfloat16", max_num_seqs=128)
    trainers = {"actor": TrainerConfig(deepspeed=_trainers(offload_optimizer=True))}
    machine = {"gpu_memory_gib": 139.8, "host_memory_gib": 1000.0}
    plan = plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None)
    assert plan.engine.kv_cache_tokens == 128 * 256 and plan.engine.kv_bytes_per_token == 57_344
    sized = plan.engine.__class__(**{**vars(plan.engine), "kv_cache_tokens": 128 * 1024, "memory": 0.5})
    assert sized.kv_cache_bytes == 128 * 1024 * 57_344
    awake = engine_awake_gib(config, sized, model_shape(qwen7b))
    assert 14.2 + 7.0 < awake < 14.2 + 7.0 + 3.0  # weights + KV + (profile forward, sampler, graphs)
    generating = {name: check(config, trainers, machine, engine={"memory": 0.5, "kv_cache_tokens": tokens})
                  .per_gpu[(0, 0)]["generating"] for name, tokens in (("share", None), ("sized", 128 * 1024))}
    assert generating["sized"] < generating["share"] - 45


def test_engine_step_tokens_shrink_the_engine_estimate(qwen7b):
    """vLLM sets aside a forward of max_num_batched_tokens in the engine's share (16,384 by vLLM's default on an
    80 GB GPU): the plan passes 4,096 (max_num_seqs if larger), and the estimate counts what the engine gets."""
    from rlhfkit.hybrid._fit import engine_awake_gib

    config = HybridConfig(model=qwen7b, max_num_seqs=128, dtype="bfloat16")
    trainers = {"actor": TrainerConfig(deepspeed=_trainers())}
    engine = plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None).engine
    assert engine.max_num_batched_tokens == 4096
    wide = plan_hybrid(dataclasses.replace(config, max_num_seqs=6000), trainers, gpu_memory_gib=None,
                       host_memory_gib=None).engine
    assert wide.max_num_batched_tokens == 6000
    shape = model_shape(qwen7b)
    per_token_gib = (4 * 3584 + 2 * 18944) * 2 / 1024**3  # Qwen2.5-7B in bf16
    saved = (engine_awake_gib(config, dataclasses.replace(engine, max_num_batched_tokens=16384), shape)
             - engine_awake_gib(config, engine, shape))
    assert saved == pytest.approx((16384 - 4096) * per_token_gib)  # ~1.2 GiB
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=64 is below max_num_seqs=128"):
        dataclasses.replace(engine, max_num_batched_tokens=64)


def test_the_kv_cache_is_sized_to_the_rollout_batch(qwen7b):
    """A vLLM engine's cache holds max_num_seqs x 256 tokens (at least max_model_len); without max_num_seqs, or for
    HF / SGLang engines, it fills the share."""
    trainers = {"actor": TrainerConfig(deepspeed=_trainers())}

    def engine(**changes):
        config = HybridConfig(**({"model": qwen7b, "max_num_seqs": 128} | changes))
        return plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None).engine

    assert engine().kv_cache_bytes == 128 * 256 * 57_344 * 2  # float32: twice bf16
    assert engine(max_num_seqs=2).kv_cache_tokens == 1024  # max_model_len
    for unsized in ({"max_num_seqs": None}, {"engine": "sglang"}, {"engine": "hf"}):
        assert engine(**unsized).kv_cache_bytes is None, unsized


def test_engines_build_during_the_loads_only_with_a_sized_cache_that_fits(tmp_path_factory, qwen7b):
    """Colocated vLLM engines skip the start gate (build while the trainers load) only when a sized cache spares
    vLLM its memory profile and every role's largest footprint fits the GPU at once: 1.5B on an H200 yes; 7B with its
    trainer resident and a 0.6 engine share no; without a sized cache or an estimate, never."""
    from rlhfkit.hybrid._fit import engines_may_build_during_loads

    qwen15 = _architecture(tmp_path_factory, "qwen2.5-1.5b")
    zero1 = {"actor": TrainerConfig(deepspeed=_trainers(zero_stage=1)),
             "reference": TrainerConfig(deepspeed=_trainers(zero_stage=1))}
    config = HybridConfig(model=qwen15, max_num_seqs=128, dtype="bfloat16")
    engine = plan_hybrid(config, zero1, gpu_memory_gib=None, host_memory_gib=None).engine
    sized = dataclasses.replace(engine, memory=0.35, kv_cache_tokens=128 * 1024)
    assert engines_may_build_during_loads(config, sized, check(config, zero1, H200, engine=vars(sized)))
    share = dataclasses.replace(sized, kv_cache_tokens=None)
    assert not engines_may_build_during_loads(config, share, check(config, zero1, H200, engine=vars(share)))
    assert not engines_may_build_during_loads(config, sized, None)
    large = HybridConfig(model=qwen7b, max_num_seqs=128, dtype="bfloat16")
    resident = {"actor": TrainerConfig(deepspeed=_trainers(offload_optimizer=True, gradient_checkpointing=True,
                                                           **LARGE_FULL), offload=False)}
    big = {"memory": 0.6, "kv_cache_tokens": 128 * 1024}
    assert not engines_may_build_during_loads(large, dataclasses.replace(engine, **big),
                                              check(large, resident, H200, engine=big))


def test_trainers_that_keep_their_cached_blocks_hold_them_while_asleep(tmp_path_factory):
    """DeepSpeedEngineConfig(empty_cache_on_sleep=False): an asleep trainer keeps its cached blocks, so every phase
    it sleeps through (generating, the reference's forward) holds what it held awake: a resident actor its
    activations' blocks besides its states; its own phase does not change. A trained role that sleeps to host memory
    under ZeRO-1/2/3 sleeps through DeepSpeed's offload_states, which empties the cache whatever the flag says."""
    from rlhfkit.hybrid._fit import TRAINER_RESERVE_FACTOR

    qwen15 = _architecture(tmp_path_factory, "qwen2.5-1.5b")
    config = HybridConfig(model=qwen15, dtype="bfloat16")
    phases = {}
    for offload in (False, True):
        for keep in (False, True):
            deepspeed = _trainers(zero_stage=1, empty_cache_on_sleep=not keep)
            estimate = check(config, {"actor": TrainerConfig(deepspeed=deepspeed, offload=offload),
                                      "reference": TrainerConfig(deepspeed=_trainers(zero_stage=1))}, H100,
                             engine={"memory": 0.35})
            phases[offload, keep] = estimate.per_gpu[(0, 0)]
    assert phases[False, True]["training"] == phases[False, False]["training"]
    kept = phases[False, True]["generating"] - phases[False, False]["generating"]
    assert kept == pytest.approx(phases[False, True]["forward_reference"] - phases[False, False]["forward_reference"])
    # 28 layers x 4,096 tokens x (10 x 1,536 + 4 x 8,960) bf16 values, bf16 logits and one float32 chunk of them,
    # with the estimate's margin
    assert 12.1 * TRAINER_RESERVE_FACTOR < kept < 12.2 * TRAINER_RESERVE_FACTOR
    assert phases[True, True] == phases[True, False]  # emptied by DeepSpeed's offload_states either way


def test_states_kept_through_sleeps_are_counted_in_the_phases_slept_through(tmp_path_factory):
    """RolePlan.keep_optimizer / keep_weights: the actor's fp32 masters and Adam moments (12 bytes a parameter) and
    its bf16 weights (2) stay on the GPU through generation and the reference's forward (with the estimate's
    margin); its own training phase holds them anyway."""
    from rlhfkit.hybrid._fit import TRAINER_RESERVE_FACTOR as margin

    qwen15 = _architecture(tmp_path_factory, "qwen2.5-1.5b")
    config = HybridConfig(model=qwen15, dtype="bfloat16")
    trainers = {"actor": TrainerConfig(deepspeed=_trainers(zero_stage=1)),
                "reference": TrainerConfig(deepspeed=_trainers(zero_stage=1))}
    slept, held, both = (check(config, trainers, H100, engine={"memory": 0.35}, actor=keep).per_gpu[(0, 0)]
                         for keep in ({}, {"keep_optimizer": True}, {"keep_optimizer": True, "keep_weights": True}))
    assert held["generating"] - slept["generating"] == pytest.approx(
        held["forward_reference"] - slept["forward_reference"]) == pytest.approx(1.54e9 * 12 / 2**30 * margin, rel=0.01)
    assert both["generating"] - held["generating"] == pytest.approx(1.54e9 * 2 / 2**30 * margin, rel=0.01)
    assert held["training"] == slept["training"] == both["training"]


def test_compiled_layers_keep_about_half_an_eager_layers_activations(tmp_path_factory):
    """DeepSpeedEngineConfig.compile_layers: the estimate counts 5 hidden- and 2 intermediate-sized values per token
    and layer (the compiled backward recomputes the elementwise work) instead of eager's 10 and 4."""
    from rlhfkit.hybrid._fit import TRAINER_RESERVE_FACTOR

    qwen15 = _architecture(tmp_path_factory, "qwen2.5-1.5b")
    config = HybridConfig(model=qwen15, dtype="bfloat16")
    training = {}
    for compiled in (False, True):
        trainers = {"actor": TrainerConfig(deepspeed=_trainers(zero_stage=1, compile_layers=compiled))}
        estimate = check(config, trainers, H200, engine={"memory": 0.35}, tokens=8192)
        training[compiled] = estimate.per_gpu[(0, 0)]["training"]
    saved = 28 * 8192 * (5 * 1536 + 2 * 8960) * 2 / 1024**3  # the values a compiled layer does not keep
    assert training[False] - training[True] == pytest.approx(saved * TRAINER_RESERVE_FACTOR)


def test_the_estimates_logprob_chunk_is_the_losses_chunk():
    """The estimate counts one float32 chunk of the log-prob pass: the size rlhfkit.losses uses on a GPU."""
    from rlhfkit.hybrid._fit import LOGPROB_CHUNK_ELEMENTS
    from rlhfkit.losses._logprobs import DEFAULT_CHUNK_ELEMENTS

    assert LOGPROB_CHUNK_ELEMENTS == DEFAULT_CHUNK_ELEMENTS["other"]


def test_held_gpu_memory_is_read_only_where_it_describes_this_runs_gpus(qwen7b, monkeypatch):
    """``held_by_others_gib``: the busiest visible GPU's used memory (NVML) from ``HELD_GPU_GIB`` up; nothing on CPU,
    when joining a cluster (the GPUs may be elsewhere), below the threshold, or without NVML (this CPU machine: the
    real reading is None)."""
    import rlhfkit.hybrid._machine as machine
    from rlhfkit.hybrid._timer import visible_gpu_memory_used_gib

    assert visible_gpu_memory_used_gib() is None  # no NVML or no GPU here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cuda = HybridConfig(model=qwen7b)
    assert machine.held_by_others_gib(cuda) == 0.0
    monkeypatch.setattr(machine, "visible_gpu_memory_used_gib", lambda: [0.4, 14.8, 0.5])
    assert machine.held_by_others_gib(cuda) == 14.8
    assert machine.held_by_others_gib(HybridConfig(model=qwen7b, device="cpu", engine="hf")) == 0.0
    assert machine.held_by_others_gib(dataclasses.replace(cuda, ray_address="10.0.0.1:6379")) == 0.0
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert machine.held_by_others_gib(cuda) == 0.0
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(machine, "visible_gpu_memory_used_gib", lambda: [machine.HELD_GPU_GIB - 0.01])
    assert machine.held_by_others_gib(cuda) == 0.0


def _fake_gpu(monkeypatch, machine, gib: float) -> None:
    monkeypatch.setattr(machine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(machine.torch.cuda, "get_device_properties",
                        lambda index: type("Props", (), {"total_memory": int(gib * 1024**3)})())


def test_the_machines_plan_counts_held_memory_and_rays_host_threshold(qwen7b, monkeypatch):
    """plan_for_machine (Hybrid.start without a plan): the first GPU's size less what other processes hold (the
    switches then do not overlap), and this machine's physical memory up to Ray's memory-kill threshold
    (RAY_memory_usage_threshold, 0.95 by default); CPU: no sizes."""
    import rlhfkit.hybrid._machine as machine

    _fake_gpu(monkeypatch, machine, 139.8)
    monkeypatch.setattr(machine, "physical_memory_gib", lambda: 200.0)
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    monkeypatch.delenv("RAY_memory_monitor_refresh_ms", raising=False)
    assert machine.ray_memory_threshold() == 0.95
    lora = {"actor": TrainerConfig(deepspeed=_trainers(gradient_checkpointing=True), lora=LoraConfig(rank=16))}
    config = HybridConfig(model=qwen7b, dtype="bfloat16", max_num_seqs=128)
    free = machine.plan_for_machine(config, lora, held_gib=0.0)
    assert (free.gpu_memory_gib, free.host_memory_gib) == (pytest.approx(139.8), pytest.approx(190.0))
    held = machine.plan_for_machine(config, lora, held_gib=20.0)
    assert held.gpu_memory_gib == pytest.approx(119.8) and not held.overlap_switches
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.05")
    with pytest.raises(MemoryFitError, match=r"node has 10\.0 GiB") as info:
        machine.plan_for_machine(config, lora, held_gib=0.0)
    assert info.value.memory == "host"
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")  # Ray's monitor off: all of it
    assert machine.ray_memory_threshold() == 1.0
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "250")
    monkeypatch.setenv("RAY_memory_usage_threshold", "1.5")
    with pytest.raises(ValueError, match="RAY_memory_usage_threshold='1.5'"):
        machine.ray_memory_threshold()
    cpu = machine.plan_for_machine(HybridConfig(model=qwen7b, device="cpu", engine="hf"), lora)
    assert cpu.gpu_memory_gib is None and cpu.host_memory_gib is None and not cpu.gpu_phases


def test_hybrid_start_refuses_before_anything_starts(tiny_llama_path, monkeypatch):
    """A plan that does not fit, bad roles or CUDA-only kernels on CPU: refused before Ray starts; the LoRA target
    check and the plan build each meta-device model once."""
    ray = pytest.importorskip("ray")
    import rlhfkit.lora

    if ray.is_initialized():
        ray.shutdown()
    built = []
    real = rlhfkit.lora.meta_model
    monkeypatch.setattr(rlhfkit.lora, "meta_model", lambda path: (built.append(path), real(path))[1])
    config = HybridConfig(model=str(tiny_llama_path), device="cpu", engine="hf")
    deepspeed = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw")
    trainers = {"actor": TrainerConfig(deepspeed=deepspeed, lora=LoraConfig(rank=4, target_modules=("q_proj",))),
                "reference": TrainerConfig(deepspeed=deepspeed)}
    plan = plan_hybrid(config, trainers, gpu_memory_gib=None, host_memory_gib=None)
    assert plan.engine.sleep_level == 1  # LoRA: the push carries adapters only, the base stays
    built.clear()
    with pytest.raises(MemoryFitError, match="short by"):
        Hybrid.start(config, trainers, plan=dataclasses.replace(plan, gpu_memory_gib=0.5))
    assert built == [str(tiny_llama_path)] and not ray.is_initialized()
    with pytest.raises(ValueError, match="sleep_level=2 discards the engines' base weights"):
        Hybrid.start(config, trainers, plan=plan.replace_engine(sleep_level=2))
    with pytest.raises(ValueError, match=r"the plan's roles \['actor', 'reference'\] are not the run's \['actor'\]"):
        Hybrid.start(config, {"actor": trainers["actor"]}, plan=plan)
    liger = DeepSpeedEngineConfig(zero_stage=1, bf16=False, optimizer="torch_adamw", fused_kernels="liger")
    with pytest.raises(ValueError, match=r"trainers\['reference'\].deepspeed.fused_kernels='liger' needs CUDA"):
        Hybrid.start(config, {"actor": TrainerConfig(deepspeed=deepspeed), "reference": TrainerConfig(deepspeed=liger)})
    with pytest.raises(ValueError, match="a hybrid run needs an 'actor' role"):
        Hybrid.start(config, {"reference": TrainerConfig(deepspeed=deepspeed)})
    assert not ray.is_initialized()
