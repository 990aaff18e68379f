"""torchrun worker for tests/test_deepspeed_engine.py: many DeepSpeed checks in one launch (imports cost ≈ 10 s/rank).

Usage: python -m torch.distributed.run --nproc_per_node N tests/_ds_worker.py --model DIR --workdir DIR --out JSON
           --checks train1,train3,stream0,...

Each check returns a dict of plain values (or records its traceback); rank 0 writes ``{check: result}`` to --out.
The assertions live in the test file, so each property is reported as its own test.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

NUM_STEPS = 4
GROUP_ELEMENTS = 40_000  # the tiny Llama's 123,200 parameters in 4 optimizer parameter groups


def _batch(seed: int, vocab: int, lengths: tuple[int, ...] = (7, 12, 5, 9)):
    from rlhfkit.packing import pack_sequences

    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(10, vocab, (n,), generator=gen) for n in lengths]
    masks = [torch.arange(n) >= n // 2 for n in lengths]
    return pack_sequences(seqs, loss_masks=masks, pad_to_multiple_of=8)


def _config(stage: int, **overrides):
    from rlhfkit.deepspeed_engine import DeepSpeedEngineConfig

    fields = dict(zero_stage=stage, bf16=False, optimizer="torch_adamw", learning_rate=2e-3, gradient_clipping=1.0,
                  lr_warmup_steps=2, lr_schedule="cosine", lr_total_steps=10, lr_min_ratio=0.1,
                  gradient_checkpointing=stage == 2,  # one stage exercises activation checkpointing
                  param_group_elements=GROUP_ELEMENTS)  # ZeRO-0/1/2: the tiny model in 4 parameter groups
    fields.update(json.loads(os.environ.get("RLHFKIT_TEST_DS_CONFIG", "{}")))  # e.g. fused_adam + bf16 on GPU
    fields.update(overrides)
    return DeepSpeedEngineConfig(**fields)


def _nll(engine, batch) -> torch.Tensor:
    logprobs = engine.forward_logprobs(batch)
    mask = batch.loss_mask.to(logprobs.device)
    return -(logprobs * mask).sum() / mask.sum()


def _train_step(engine, batch) -> dict:
    engine.backward(_nll(engine, batch))
    return engine.step()


def _state_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """Every per-rank state tensor a ZeRO engine keeps, by kind: weights (shards), fp32 masters, grads, optimizer."""
    stage = engine.config.zero_stage
    out = {"weights": [p.ds_tensor if stage == 3 else p for p in engine.module.parameters()]}
    wrapper = engine.ds_engine.optimizer
    if engine.has_optimizer:
        if stage == 3:
            out["master"] = list(wrapper.fp32_partitioned_groups_flat)
            out["grads"] = [wrapper.grad_partitions_flat_buffer]
        elif stage in (1, 2):
            out["master"] = list(wrapper.single_partition_of_fp32_groups)
            out["weights"] += list(wrapper.bit16_groups_flat)
        basic = wrapper.optimizer if stage else wrapper
        out["optim"] = [v for state in basic.state.values() for k, v in sorted(state.items())
                        if torch.is_tensor(v) and k != "step" and not k.endswith("_offload_buffer")]
    return {kind: [t for t in tensors if t.numel() > 0] for kind, tensors in out.items()}


def _flat(groups: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for kind in sorted(groups) for t in groups[kind]]


def _expect_error(function, fragment: str) -> str:
    try:
        result = function()
        if hasattr(result, "__next__"):
            next(result)
    except RuntimeError as error:
        return "ok" if fragment in str(error) else f"wrong message: {error}"
    return "no error raised"


def _sleep_round_trip(engine, batch, baseline: dict | None = None) -> dict:
    """Sleep, check errors and that every state storage moved, wake, check bit-identical state.

    "Moved" is checked by storage: on CUDA every state tensor must now live on the host (and the engine's own
    resident-bytes count must be 0); on CPU, where host->host copies keep the device, every storage must differ from
    the one before sleep (the old storages are held meanwhile so their addresses cannot be reused — on CUDA holding
    them would keep the memory allocated, so it is not done there)."""
    cuda = engine.device.type == "cuda"
    before = [t.detach().to("cpu", copy=True) for t in _flat(_state_tensors(engine))]  # host: not counted on GPU
    held = [] if cuda else [t.detach() for t in _flat(_state_tensors(engine))]
    old_ptrs = {t.untyped_storage().data_ptr() for t in held}
    memory_awake = _memory(engine)
    sleep_stats = engine.sleep()
    memory_asleep = _memory(engine)
    if cuda:
        moved = {kind: all(t.device.type == "cpu" for t in tensors)
                 for kind, tensors in _state_tensors(engine).items()}
    else:
        moved = {kind: all(t.untyped_storage().data_ptr() not in old_ptrs for t in tensors)
                 for kind, tensors in _state_tensors(engine).items()}
    resident_asleep = engine.resident_state_bytes()
    errors = {"forward": _expect_error(lambda: engine.forward_logprobs(batch) if engine.role in ("actor", "reference")
                                       else engine.forward_values(batch), "is asleep; call wake_up() first"),
              "stream": _expect_error(lambda: engine.named_parameters_for_sync(), "is asleep")}
    if engine.has_optimizer:
        errors["step"] = _expect_error(engine.step, f"step() called while '{engine.name}' is asleep; call wake_up()")
        errors["backward"] = _expect_error(lambda: engine.backward(torch.zeros(())), "backward() called while")
    asleep = engine.is_asleep
    engine.wake_up()
    after = _flat(_state_tensors(engine))
    identical = len(after) == len(before) and all(torch.equal(a.cpu(), b) for a, b in zip(after, before))
    del held
    return {"moved": moved, "errors": errors, "memory_awake": memory_awake, "memory_asleep": memory_asleep,
            "memory_baseline": baseline or {}, "resident_asleep": resident_asleep,
            "resident_awake": engine.resident_state_bytes(), "sleep_stats": sleep_stats, "asleep_flag": asleep, "awake_flag": not engine.is_asleep,
            "identical": identical, "num_tensors": len(before)}


def _memory(engine=None) -> dict:
    if not torch.cuda.is_available() or (engine is not None and engine.device.type != "cuda"):
        return {}
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def _release() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _stream_dict(engine, **kwargs) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone().cpu() for name, tensor in engine.named_parameters_for_sync(**kwargs)}


def _compare(stream: dict, reference: dict) -> dict:
    keys_equal = set(stream) == set(reference)
    mismatched = [k for k in stream if k in reference and not torch.equal(stream[k], reference[k].to(stream[k].dtype))]
    return {"keys_equal": keys_equal, "mismatched": mismatched[:5], "num": len(stream),
            "missing": sorted(set(reference) - set(stream))[:5], "extra": sorted(set(stream) - set(reference))[:5]}


def _file_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _stream_storages(engine) -> int:
    """How many distinct allocations the sync stream's tensors live in (ZeRO-3 gathers: not meaningful)."""
    if engine.config.zero_stage == 3:
        return -1
    return len({tensor.untyped_storage().data_ptr() for _, tensor in engine.named_parameters_for_sync()})


def _deferred_wake_step(engine, batch) -> dict:
    """From asleep: a wake that leaves the optimizer's states on the host, a sleep with them still there, the same
    wake again, then a training step whose optimizer states come back in another thread while its forward and
    backward run (``finish_wake_behind``: on a GPU on a CUDA stream of its own, as the hybrid's trainer worker)."""
    woke = engine.wake_up(defer_optimizer=True)
    away = engine.optimizer_states_away
    engine.sleep()
    resident_asleep, asleep = engine.resident_state_bytes(), engine.is_asleep
    woke_again = engine.wake_up(defer_optimizer=True)
    loss = _nll(engine, batch)
    finishing = engine.finish_wake_behind(chunk_bytes=4096)
    engine.backward(loss)
    finished = finishing.result(timeout=120) if finishing is not None else {}
    away_before_step = engine.optimizer_states_away
    stats = engine.step()
    return {"stats": stats, "away": away, "resident_asleep": resident_asleep, "asleep": asleep,
            "woke_bytes": woke.get("bytes_moved"), "woke_again_bytes": woke_again.get("bytes_moved"),
            "finish_bytes": finished.get("bytes_moved", 0.0), "away_before_step": away_before_step,
            "away_after_step": engine.optimizer_states_away}


def check_train(stage: int, ctx) -> dict:
    """Reference trajectory, the same trajectory with sleeps, and a resume from a checkpoint."""
    from rlhfkit.deepspeed_engine import DeepSpeedEngine, latest_checkpoint

    batch = _batch(100 + ctx.rank, ctx.vocab)
    ref = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=_config(stage))
    ref_stats = [_train_step(ref, batch) for _ in range(NUM_STEPS)]
    ref.destroy()
    del ref  # a destroyed engine still holds its GPU tensors until collected
    _release()
    baseline = _memory()
    engine = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=_config(stage))
    file_state = {k: v.to(engine.dtype) for k, v in _file_state_dict(ctx.model).items()}
    initial_stream = _compare(_stream_dict(engine, bucket_bytes=4096), file_state)
    storages = [_stream_storages(engine)]  # zero-copy weight sync pays when this is small (ZeRO-1/2 flat buffers)
    stats = [_train_step(engine, batch) for _ in range(2)]
    round_trip = _sleep_round_trip(engine, batch, baseline)
    storages.append(_stream_storages(engine))
    root = ctx.workdir / f"ckpt-s{stage}"
    saved = engine.save_checkpoint(root)  # after a sleep: DeepSpeed's host offload buffers must not be saved
    saved_stream = _stream_dict(engine)
    if ctx.rank == 0:
        (root / "step-000099").mkdir(parents=True)  # a half-written checkpoint: no COMPLETE marker
        (root / "step-000099" / "junk").write_text("partial")
    dist.barrier()
    # a sleep that keeps the optimizer's states, and a wake from it, before this step: it trains on exactly
    kept_optimizer = {"sleep": engine.sleep(keep_optimizer=True), "offloaded": sorted(engine._offloaded)}
    kept_optimizer["wake"] = engine.wake_up(defer_optimizer=True)
    kept_optimizer["away"] = engine.optimizer_states_away  # nothing was left on the host for later
    stats.append(_train_step(engine, batch))
    awake_stream = _stream_dict(engine)
    engine.sleep(keep_weights=True, keep_optimizer=True)
    kept_stream = _compare(_stream_dict(engine, bucket_bytes=3000), awake_stream)
    kept_optimizer["deepened"] = engine.sleep(keep_optimizer=True)  # the weights go, the optimizer's states stay
    kept_optimizer["deepened_offloaded"] = sorted(engine._offloaded)
    kept_optimizer["weights_kept"] = engine._weights_kept
    kept_optimizer["moved_at_last"] = engine.sleep()  # and now they go too
    deep_asleep_stream = _expect_error(lambda: engine.named_parameters_for_sync(), "is asleep")
    deferred = _deferred_wake_step(engine, batch)
    stats.append(deferred.pop("stats"))
    engine.destroy()
    latest = latest_checkpoint(root)
    resumed = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=_config(stage))
    try:
        resumed.load_checkpoint(root / "step-000099")
        partial_load = "no error"
    except ValueError as error:
        partial_load = "ok" if "incomplete" in str(error) else str(error)
    client_state = resumed.load_checkpoint(latest)
    resumed_step = resumed.global_step
    optimizer = getattr(resumed.ds_engine.optimizer, "optimizer", resumed.ds_engine.optimizer)
    offload_keys = sum(k.endswith("_offload_buffer") for state in optimizer.state.values() for k in state)
    resumed_stats = [_train_step(resumed, batch) for _ in range(2)]
    resumed.destroy()
    export = _compare(_file_state_dict(saved / "hf"), saved_stream)
    return {"ref_losses": [s["loss"] for s in ref_stats], "losses": [s["loss"] for s in stats],
            "ref_lrs": [s["lr"] for s in ref_stats], "grad_norms": [s["grad_norm"] for s in ref_stats],
            "resumed_losses": [s["loss"] for s in resumed_stats], "resumed_lrs": [s["lr"] for s in resumed_stats],
            "resumed_step": resumed_step, "client_state": client_state.get("rlhfkit", {}),
            "latest": latest.name if latest else None, "saved": saved.name, "partial_load": partial_load,
            "round_trip": round_trip, "kept_stream": kept_stream, "initial_stream": initial_stream,
            "deep_asleep_stream": deep_asleep_stream, "resumed_offload_keys": offload_keys, "deferred": deferred,
            "kept_optimizer": kept_optimizer,
            "stream_storages": storages,
            "export": export, "hf_files": sorted(p.name for p in (saved / "hf").iterdir())}


def check_zero3_views(ctx) -> dict:
    """ZeRO-3 with every parameter released between forwards (persistence threshold 0), after two steps: whether the
    sync stream's tensors are views of the parameters' own partitions (no gather: a partition group of one rank),
    and the stream against DeepSpeed's own gather of every parameter, in the engine dtype and cast to bf16."""
    import deepspeed

    from rlhfkit.deepspeed_engine import DeepSpeedEngine
    from rlhfkit.deepspeed_engine._checkpoint import hf_name

    engine = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=_config(3, param_persistence_threshold=0))
    batch = _batch(300 + ctx.rank, ctx.vocab)
    losses = [_train_step(engine, batch)["loss"] for _ in range(2)]
    params = {hf_name(name): param for name, param in engine.module.named_parameters()}
    released = sum(param.numel() == 0 for param in params.values())  # not gathered now (ZeRO-3's placeholder)
    views, stream = 0, {}
    for name, tensor in engine.named_parameters_for_sync(bucket_bytes=5000):
        views += tensor.untyped_storage().data_ptr() == params[name].ds_tensor.untyped_storage().data_ptr()
        stream[name] = tensor.detach().clone().cpu()
    cast = {name: tensor.detach().clone().cpu() for name, tensor in engine.named_parameters_for_sync(
        dtype=torch.bfloat16)}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        gathered = {name: param.data.detach().clone().cpu() for name, param in params.items()}
    engine.destroy()
    return {"losses": losses, "released": released, "views": views, "num": len(stream),
            "equal": set(stream) == set(gathered) and all(torch.equal(stream[k], gathered[k]) for k in stream),
            "cast_equal": set(cast) == set(gathered) and all(
                torch.equal(cast[k], gathered[k].to(torch.bfloat16)) for k in cast),
            "changed": any(not torch.equal(stream[k], v.to(stream[k].dtype)) for k, v in
                           _file_state_dict(ctx.model).items())}


def check_groups(stage: int, ctx) -> dict:
    """The same trajectory with the parameters in one optimizer group and in several (param_group_elements): the
    groups' sizes, the largest fp32 gradient partition DeepSpeed's step builds, and the weights after NUM_STEPS."""
    from rlhfkit.deepspeed_engine import DeepSpeedEngine

    batch = _batch(300 + ctx.rank, ctx.vocab)
    result: dict = {}
    for name, elements in (("one", 10**9), ("split", GROUP_ELEMENTS)):
        engine = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=_config(stage,
                                                 param_group_elements=elements))
        optimizer = engine.ds_engine.optimizer
        sizes = [sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in group)
                 for group in optimizer.bit16_groups]  # the model's parameters, before ZeRO partitions them
        largest: list[int] = []
        step = type(optimizer)._optimizer_step  # ZeRO-1/2: one group's fp32 gradient partition is set, then stepped

        def spy(self, index, _step=step, _largest=largest):
            _largest.append(self.single_partition_of_fp32_groups[index].grad.numel())
            return _step(self, index)

        type(optimizer)._optimizer_step = spy
        try:
            losses = [_train_step(engine, batch)["loss"] for _ in range(NUM_STEPS)]
        finally:
            type(optimizer)._optimizer_step = step
        result[name] = {"group_sizes": sizes, "largest_fp32_grad": max(largest, default=0), "losses": losses,
                        "weights": {k: v.float().clone() for k, v in _stream_dict(engine).items()}}
        engine.destroy()
    one, split = result["one"].pop("weights"), result["split"].pop("weights")
    result["max_weight_diff"] = max(float((one[k] - split[k]).abs().max()) for k in one)
    return result


def check_lora(stage: int, ctx) -> dict:
    """An actor with LoRA adapters (the base frozen): train, a sleep/wake round trip, train on; regression (issue
    20): under ZeRO-3 DeepSpeed's offload_states mapped every parameter's shard, frozen ones included, onto the flat
    buffer of the trainable ones and failed (``start + length exceeds dimension size``)."""
    from rlhfkit.deepspeed_engine import DeepSpeedEngine
    from rlhfkit.lora import LoraConfig

    batch = _batch(200 + ctx.rank, ctx.vocab)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    config = _config(stage, lr_warmup_steps=0, lr_schedule="constant")
    torch.manual_seed(1)  # the adapters' initialisation
    ref = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=config, lora=lora)
    ref_losses = []
    for _ in range(3):
        ref_losses.append(float(_nll(ref, batch)))
        _train_step(ref, batch)
    ref.destroy()
    del ref
    _release()
    torch.manual_seed(1)
    engine = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=config, lora=lora)
    losses = [float(_nll(engine, batch))]
    _train_step(engine, batch)
    round_trip = _sleep_round_trip(engine, batch)
    later = []  # the frozen base is not copied again (its pinned copy holds it); the adapters and Adam are
    for _ in range(2):
        losses.append(float(_nll(engine, batch)))
        _train_step(engine, batch)
        first = engine.sleep(keep_weights=True)  # the weights stay for a push: the frozen base is not touched
        later.append(engine.sleep() | {"keep_weights_kept": first["bytes_kept_on_host"]})
        engine.wake_up()
    frozen = sum(not p.requires_grad for p in engine.module.parameters())
    frozen_bytes = sum(getattr(p, "ds_tensor", p).numel() * p.element_size()  # ZeRO-3: this rank's shard
                       for p in engine.module.parameters() if not p.requires_grad)
    engine.destroy()
    return {"round_trip": round_trip, "losses": losses, "ref_losses": ref_losses, "frozen": frozen,
            "frozen_bytes": frozen_bytes,
            "later_sleeps": [{k: stats[k] for k in ("bytes_moved", "bytes_kept_on_host", "keep_weights_kept")}
                             for stats in later]}


def check_stream(stage: int, ctx, *, bf16: bool = False) -> dict:
    """Reference model: stream == file state dict; log-probs == naive per-sequence HF forward; sleep round trip."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.deepspeed_engine import DeepSpeedEngine

    engine = DeepSpeedEngine.from_pretrained(ctx.model, role="reference", config=_config(stage, bf16=bf16))
    reference = {k: v.to(engine.dtype) for k, v in _file_state_dict(ctx.model).items()}
    result = {"stream": _compare(_stream_dict(engine, bucket_bytes=4096), reference),
              "stream_one_bucket": _compare(_stream_dict(engine, bucket_bytes=1 << 40), reference),
              "dtypes": sorted({str(t.dtype) for _, t in engine.named_parameters_for_sync()})}
    streamed = [(name, tuple(t.shape), t.dtype) for name, t in engine.named_parameters_for_sync(bucket_bytes=4096)]
    described = [(spec.name, tuple(spec.shape), spec.dtype) for spec in engine.describe_parameters_for_sync()]
    result["description_matches_stream"] = streamed == described and len(described) > 0
    batch = _batch(7 + ctx.rank, ctx.vocab)
    with torch.no_grad():
        logprobs = engine.forward_logprobs(batch).cpu()
    hf = AutoModelForCausalLM.from_pretrained(str(ctx.model), dtype=engine.dtype)
    naive = torch.zeros(batch.num_tokens)
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for start, end in zip(cu[:-1], cu[1:]):
            ids = batch.input_ids[start:end]
            logits = hf(input_ids=ids[None]).logits[0].float()
            naive[start + 1:end] = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    result["logprob_max_err"] = float((logprobs - naive).abs().max())
    result["round_trip"] = _sleep_round_trip(engine, batch)
    with torch.no_grad():
        result["logprobs_identical_after_wake"] = bool(torch.equal(engine.forward_logprobs(batch).cpu(), logprobs))
    result["fixed"] = _fixed_weight_cycles(engine, batch, logprobs)
    engine.destroy()
    return result


def _fixed_weight_cycles(engine, batch, logprobs) -> dict:
    """A model without an optimizer: once its weights went to host and back, the next sleep copies nothing (the pinned
    copy holds them) and the wake brings back the same log-probs; a write in place, or one said with
    weights_changed(), makes the next sleep copy again, and the written values survive the round trip."""
    param = next(engine.module.parameters())
    target = param.ds_tensor if hasattr(param, "ds_tensor") else param
    result = {"second": engine.sleep()}
    engine.wake_up()
    with torch.no_grad():
        result["same_logprobs"] = bool(torch.equal(engine.forward_logprobs(batch).cpu(), logprobs))
        target.add_(1.0)  # in place: the version counter says so
    written = target.detach().cpu().clone()
    result["after_inplace"] = engine.sleep()
    engine.wake_up()
    result["inplace_kept"] = bool(torch.equal(target.detach().cpu(), written))
    target.data.add_(1.0)  # through .data: invisible to the version counter, so it is said
    engine.weights_changed()
    written = target.detach().cpu().clone()
    result["after_said"] = engine.sleep()
    engine.wake_up()
    result["said_kept"] = bool(torch.equal(target.detach().cpu(), written))
    result["after_clean"] = engine.sleep()
    engine.wake_up()
    result["clean_kept"] = bool(torch.equal(target.detach().cpu(), written))
    return result


def check_critic(stage: int, ctx) -> dict:
    """Critic from a causal-LM folder: value alignment, training, stream without head, HF export reload."""
    from transformers import AutoModelForSequenceClassification

    from rlhfkit.deepspeed_engine import DeepSpeedEngine

    config = _config(stage, value_head_init_std=0.05, lr_schedule="constant", lr_warmup_steps=0, learning_rate=1e-3,
                     gradient_checkpointing=True)
    engine = DeepSpeedEngine.from_pretrained(ctx.model, role="critic", config=config)
    batch = _batch(11 + ctx.rank, ctx.vocab)
    targets = torch.linspace(-1, 1, batch.num_tokens)
    mask = batch.loss_mask
    losses = []
    for _ in range(NUM_STEPS):
        values = engine.forward_values(batch).cpu()
        loss = (((values - targets) ** 2) * mask).sum() / mask.sum()
        engine.backward(loss.to(engine.device))
        losses.append(engine.step()["loss"])
    with torch.no_grad():
        values = engine.forward_values(batch).cpu()
        rewards = engine.forward_rewards(batch).cpu()
    starts = batch.cu_seqlens[:-1].long()
    result = {"losses": losses, "zero_at_starts": bool((values[starts] == 0).all()),
              "zero_on_padding": bool((values[int(batch.cu_seqlens[-1]):] == 0).all())}
    stream = _stream_dict(engine)
    result["stream_has_head"] = any(k.startswith("score") for k in stream)
    result["stream_num"] = len(stream)
    export_dir = ctx.workdir / f"critic-hf-s{stage}"
    engine.export_hf(export_dir)
    dist.barrier()
    hf = AutoModelForSequenceClassification.from_pretrained(str(export_dir), num_labels=1)
    hf_state = hf.state_dict()
    result["export_vs_stream"] = _compare(stream, {k: v for k, v in hf_state.items() if not k.startswith("score")})
    cu = batch.cu_seqlens.tolist()
    naive_rewards, naive_values = [], torch.zeros(batch.num_tokens)
    with torch.no_grad():
        for start, end in zip(cu[:-1], cu[1:]):
            hidden = hf.model(input_ids=batch.input_ids[start:end][None]).last_hidden_state
            raw = hf.score(hidden)[0, :, 0]
            naive_rewards.append(raw[-1])
            naive_values[start + 1:end] = raw[:-1]
    result["reward_max_err"] = float((rewards - torch.stack(naive_rewards)).abs().max())
    result["value_max_err"] = float((values - naive_values).abs().max())
    result["round_trip"] = _sleep_round_trip(engine, batch)
    engine.destroy()
    reward = DeepSpeedEngine.from_pretrained(export_dir, role="reward", config=_config(stage))
    with torch.no_grad():
        result["reward_model_vs_critic_max_err"] = float((reward.forward_rewards(batch).cpu() - rewards).abs().max())
    result["reward_round_trip"] = _sleep_round_trip(reward, batch)
    try:
        reward.backward(torch.zeros(()))
        result["reward_backward"] = "no error"
    except RuntimeError as error:
        result["reward_backward"] = str(error)
    reward.destroy()
    return result


def check_normalization(stage: int, ctx) -> dict:
    """Gradient accumulation + DP: DeepSpeed's pre-clip grad norm equals a plain-torch reference for both modes."""
    from transformers import AutoModelForCausalLM

    from rlhfkit.deepspeed_engine import DeepSpeedEngine

    world = dist.get_world_size()
    shapes = [(5, 9), (12, 7, 8), (4, 6), (10, 11, 3)]  # different loss-token counts: the two modes differ
    micro = {(r, m): _batch(300 + 10 * r + m, ctx.vocab, shapes[(2 * r + m) % 4]) for r in range(world)
             for m in range(2)}
    total_tokens = sum(float(b.loss_mask.sum()) for b in micro.values())
    result = {}
    for mode in ("per_micro_batch", "global"):
        config = _config(stage, gradient_accumulation_steps=2, loss_normalization=mode, gradient_clipping=0.0)
        engine = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=config)
        stats = []
        for m in range(2):
            batch = micro[(ctx.rank, m)]
            logprobs = engine.forward_logprobs(batch)
            mask = batch.loss_mask.to(logprobs.device)
            denominator = mask.sum() if mode == "per_micro_batch" else total_tokens
            engine.backward(-(logprobs * mask).sum() / denominator)
            stats.append(engine.step())
        result[mode] = {"grad_norm": stats[1]["grad_norm"], "first_step_stats": stats[0]}
        engine.destroy()
        model = AutoModelForCausalLM.from_pretrained(str(ctx.model), dtype=torch.float32)
        from rlhfkit.losses import model_logprobs

        loss = 0.0
        for batch in micro.values():
            mask = batch.loss_mask
            nll = -(model_logprobs(model, batch) * mask).sum()
            loss = loss + (nll / mask.sum() / len(micro) if mode == "per_micro_batch" else nll / total_tokens)
        loss.backward()
        result[mode]["reference_norm"] = float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    return result


def check_discard(stage: int, ctx) -> dict:
    """discard_gradients() after two micro-batches' backwards (a step given up part-way), then a clean step: the
    same gradient norm and weights as the clean step alone, under the hybrid's caller-owned accumulation."""
    from rlhfkit.deepspeed_engine import DeepSpeedEngine

    first, second = _batch(400 + ctx.rank, ctx.vocab), _batch(500 + ctx.rank, ctx.vocab, (6, 10, 8))

    def run(discard: bool) -> tuple[float, list[torch.Tensor]]:
        engine = DeepSpeedEngine.from_pretrained(ctx.model, role="actor", config=_config(stage),
                                                 ds_config_overrides={"managed_gradient_accumulation": False})
        engine.backward(_nll(engine, first))
        engine.optimizer_step()  # the optimizer's states exist, as in a run
        if discard:
            engine.backward(_nll(engine, second))
            engine.backward(_nll(engine, first))
            engine.discard_gradients()
        engine.backward(_nll(engine, first))
        engine.backward(_nll(engine, second))
        norm = engine.optimizer_step()
        weights = [tensor.detach().cpu().clone() for tensor in _state_tensors(engine)["weights"]]
        engine.destroy()
        _release()
        return norm, weights

    clean_norm, clean = run(False)
    norm, weights = run(True)
    return {"clean_norm": clean_norm, "norm": norm,
            "max_weight_diff": max(float((a - b).abs().max()) for a, b in zip(weights, clean, strict=True))}


CHECKS = {
    **{f"discard{s}": (lambda s: lambda ctx: check_discard(s, ctx))(s) for s in (0, 1, 2, 3)},
    **{f"train{s}": (lambda s: lambda ctx: check_train(s, ctx))(s) for s in (0, 1, 2, 3)},
    **{f"stream{s}": (lambda s: lambda ctx: check_stream(s, ctx))(s) for s in (0, 1, 2, 3)},
    "stream3_bf16": lambda ctx: check_stream(3, ctx, bf16=True),
    **{f"critic{s}": (lambda s: lambda ctx: check_critic(s, ctx))(s) for s in (2, 3)},
    **{f"norm{s}": (lambda s: lambda ctx: check_normalization(s, ctx))(s) for s in (1, 3)},
    **{f"lora{s}": (lambda s: lambda ctx: check_lora(s, ctx))(s) for s in (1, 3)},
    **{f"groups{s}": functools.partial(check_groups, s) for s in (1, 2)},
    "zero3views": check_zero3_views,
}


class _Context:
    def __init__(self, args) -> None:
        self.model = Path(args.model)
        self.workdir = Path(args.workdir)
        self.rank = dist.get_rank()
        self.vocab = json.loads((self.model / "config.json").read_text())["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", required=True)
    args = parser.parse_args()
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a ≈ 50 s JIT build on CPU
    import gc

    import transformers  # noqa: F401 — import before freezing
    from rlhfkit import deepspeed_engine  # noqa: F401

    gc.freeze()  # DeepSpeed's offload_states runs gc.collect(); frozen imports make it cheap (see docs)
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ctx = _Context(args)
    results = {}
    for name in args.checks.split(","):
        start = time.perf_counter()
        try:
            results[name] = CHECKS[name](ctx)
            results[name]["seconds"] = time.perf_counter() - start
        except Exception:  # noqa: BLE001 — report, then let the other checks run
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if ctx.rank == 0:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
