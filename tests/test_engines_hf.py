"""The hf rollout engine: log-probs vs full forwards and the trainer, batching, sampling controls, weights, sleep."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from rlhfkit.engines.hf._sampling import filter_logits, request_seed, sample_next_tokens
from rlhfkit.engines.protocol import RolloutEngine, SamplingConfig

transformers = pytest.importorskip("transformers")

from rlhfkit.engines.hf import HFEngine, HFEngineConfig  # noqa: E402

PROMPTS = ["What is 2 + 3?", "Hi", "What is 23 + 45? The answer is", "the sum of a and b"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engine(request, tiny_model_factory):
    return HFEngine(HFEngineConfig(model=str(tiny_model_factory(request.param)), max_batch_size=3, seed=0))


@pytest.fixture(scope="module")
def prompt_ids(tiny_llama_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama_path)
    return [tokenizer(p).input_ids for p in PROMPTS]


def full_forward_logprobs(model, rollout, temperature=1.0):
    """Reference: one unpadded forward over prompt + response, no cache."""
    ids = torch.cat([rollout.prompt_token_ids, rollout.response_token_ids])[None]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0].float()
    scaled = logits / temperature if temperature > 0 else logits
    logprobs = torch.log_softmax(scaled, dim=-1)[rollout.prompt_length - 1:-1]
    return logprobs.gather(-1, rollout.response_token_ids[:, None]).squeeze(-1)


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_full_forward(engine, prompt_ids, temperature):
    sampling = SamplingConfig(n=2, max_new_tokens=12, temperature=temperature, seed=3)
    rollouts = engine.generate(prompt_ids, sampling)
    assert len(rollouts) == len(prompt_ids) * 2
    for rollout in rollouts:
        reference = full_forward_logprobs(engine.model, rollout, temperature)
        assert rollout.response_logprobs.dtype == torch.float32
        torch.testing.assert_close(rollout.response_logprobs, reference, atol=1e-4, rtol=0)


def test_logprobs_equal_trainer_losses_module(engine, prompt_ids):
    losses = pytest.importorskip("rlhfkit.losses")
    packing = pytest.importorskip("rlhfkit.packing")
    rollouts = engine.generate(prompt_ids, SamplingConfig(n=2, max_new_tokens=12, temperature=1.0, seed=5))
    batch = packing.pack_rollouts(rollouts)
    with torch.no_grad():
        trainer = losses.model_logprobs(engine.model, batch, temperature=1.0)
    engine_logprobs = torch.cat([r.response_logprobs for r in rollouts])
    torch.testing.assert_close(trainer[batch.loss_mask].float(), engine_logprobs, atol=1e-4, rtol=0)


def test_batched_left_padded_greedy_equals_one_at_a_time(engine, prompt_ids):
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    batched = engine.generate(prompt_ids, sampling)
    for index, prompt in enumerate(prompt_ids):
        alone = engine.generate([prompt], sampling)[0]
        assert alone.response_token_ids.tolist() == batched[index].response_token_ids.tolist()
        torch.testing.assert_close(alone.response_logprobs, batched[index].response_logprobs, atol=1e-5, rtol=0)


def test_left_padding_position_ids_with_absolute_positions(prompt_ids):
    """RoPE is shift invariant, so only an absolute-position model shows wrong position ids under left padding."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=384, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                     initializer_range=0.2, eos_token_id=2, bos_token_id=1)
    model = transformers.GPT2LMHeadModel(config).eval()
    engine = HFEngine.from_model(model, pad_token_id=0, max_batch_size=8)
    rollouts = engine.generate(prompt_ids, SamplingConfig(n=2, max_new_tokens=8, seed=0, ignore_eos=True))
    for rollout in rollouts:
        torch.testing.assert_close(rollout.response_logprobs, full_forward_logprobs(model, rollout), atol=1e-4, rtol=0)


def test_greedy_matches_transformers_generate(engine, prompt_ids):
    tokenizer = engine.tokenizer
    encoded = tokenizer.pad({"input_ids": prompt_ids}, padding=True, padding_side="left", return_tensors="pt")
    assert encoded["attention_mask"][:, 0].tolist() == [1 if len(p) == max(map(len, prompt_ids)) else 0
                                                         for p in prompt_ids]
    expected = engine.model.generate(**encoded, max_new_tokens=8, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)[:, encoded["input_ids"].shape[1]:]
    ours = engine.generate(prompt_ids, SamplingConfig(max_new_tokens=8, temperature=0.0))
    for rollout, row in zip(ours, expected.tolist()):
        stops = [i for i, t in enumerate(row) if t in engine.eos_token_ids]
        assert rollout.response_token_ids.tolist() == (row[: stops[0] + 1] if stops else row)
        assert rollout.finish_reason == ("stop" if stops else "length")


def test_n_samples_order_and_diversity(engine, prompt_ids):
    rollouts = engine.generate(prompt_ids[:2], SamplingConfig(n=4, max_new_tokens=6, seed=11))
    assert [(r.prompt_index, r.sample_index) for r in rollouts] == [(p, s) for p in range(2) for s in range(4)]
    for rollout in rollouts:
        assert rollout.prompt_token_ids.tolist() == prompt_ids[rollout.prompt_index]
        assert rollout.weight_version == engine.weight_version
        assert rollout.response_text == engine.tokenizer.decode(rollout.response_token_ids.tolist(),
                                                                skip_special_tokens=True)
    responses = {tuple(r.response_token_ids.tolist()) for r in rollouts[:4]}
    assert len(responses) > 1


def test_seed_reproducible_and_batch_invariant(engine, prompt_ids):
    sampling = SamplingConfig(n=3, max_new_tokens=8, seed=42)
    first = engine.generate(prompt_ids, sampling)
    second = engine.generate(prompt_ids, sampling)
    engine.max_batch_size, saved = 64, engine.max_batch_size
    try:
        one_chunk = engine.generate(prompt_ids, sampling)
    finally:
        engine.max_batch_size = saved
    other_seed = engine.generate(prompt_ids, SamplingConfig(n=3, max_new_tokens=8, seed=43))
    tokens = [[r.response_token_ids.tolist() for r in rollouts] for rollouts in (first, second, one_chunk, other_seed)]
    assert tokens[0] == tokens[1] == tokens[2]
    assert tokens[0] != tokens[3]
    # a share of the batch, as an engine group sends it (global prompt indices), samples what the whole batch did
    shard = engine.generate(prompt_ids[1:], sampling, prompt_indices=range(1, len(prompt_ids)))
    assert [r.response_token_ids.tolist() for r in shard] == tokens[0][sampling.n:]
    assert [r.prompt_index for r in shard] == [p for p in range(1, len(prompt_ids)) for _ in range(sampling.n)]
    with pytest.raises(ValueError, match="prompt_indices has 1 entries for 2 prompts"):
        engine.generate(prompt_ids[:2], sampling, prompt_indices=[0])
    unseeded = [engine.generate(prompt_ids, SamplingConfig(n=2, max_new_tokens=8)) for _ in range(2)]
    assert [r.response_token_ids.tolist() for r in unseeded[0]] != [r.response_token_ids.tolist() for r in unseeded[1]]


def test_call_scoped_seed_draws_the_call_from_one_stream(engine, prompt_ids):
    """seed_scope="call": one generator for the whole call, seeded from the seed: the same call repeats, another seed
    differs, the samples of a prompt differ, and the engine's own generator is left alone."""
    sampling = SamplingConfig(n=3, max_new_tokens=8, seed=42, seed_scope="call")
    state = engine._generator.get_state()
    first, second = engine.generate(prompt_ids, sampling), engine.generate(prompt_ids, sampling)
    other = engine.generate(prompt_ids, dataclasses.replace(sampling, seed=43))
    per_sample = engine.generate(prompt_ids, dataclasses.replace(sampling, seed_scope="sample"))
    tokens = [[r.response_token_ids.tolist() for r in rollouts] for rollouts in (first, second, other, per_sample)]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2] and tokens[0] != tokens[3]
    assert len({tuple(t) for t in tokens[0][:3]}) > 1
    assert torch.equal(engine._generator.get_state(), state)


def test_stop_tokens_and_eos(engine, prompt_ids):
    free = engine.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True))[0]
    free_tokens = free.response_token_ids.tolist()
    assert free.finish_reason == "length" and len(free_tokens) == 10
    stop = free_tokens[3]
    cut = free_tokens[: free_tokens.index(stop) + 1]
    stopped = engine.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=10, temperature=0.0,
                                                             stop_token_ids=(stop,), ignore_eos=True))[0]
    assert stopped.response_token_ids.tolist() == cut and stopped.finish_reason == "stop"
    assert stopped.response_logprobs.shape == (len(cut),)
    as_eos = HFEngine.from_model(engine.model, eos_token_ids=[999_999, stop], pad_token_id=0)
    by_eos = as_eos.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=10, temperature=0.0))[0]
    assert by_eos.response_token_ids.tolist() == cut and by_eos.finish_reason == "stop"
    ignored = as_eos.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert ignored.response_token_ids.tolist() == free_tokens and ignored.finish_reason == "length"
    assert by_eos.response_text is None  # no tokenizer given to from_model


def test_eos_list_from_generation_config(engine):
    assert engine.eos_token_ids == tuple(engine.model.generation_config.eos_token_id)
    assert len(engine.eos_token_ids) == 2


def test_top_k_one_and_tiny_top_p_are_greedy(engine, prompt_ids):
    greedy = engine.generate(prompt_ids, SamplingConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    for kwargs in ({"top_k": 1}, {"top_p": 1e-6}):
        sampled = engine.generate(prompt_ids, SamplingConfig(max_new_tokens=6, temperature=1.0, ignore_eos=True,
                                                             seed=1, **kwargs))
        assert [r.response_token_ids.tolist() for r in sampled] == [r.response_token_ids.tolist() for r in greedy]
        for rollout in sampled:  # log-probs stay those of the untruncated distribution
            torch.testing.assert_close(rollout.response_logprobs, full_forward_logprobs(engine.model, rollout),
                                       atol=1e-4, rtol=0)


def test_filter_logits_against_naive_reference():
    torch.manual_seed(0)
    logits = torch.randn(5, 17)
    for top_k, top_p in [(3, 1.0), (0, 0.6), (5, 0.5), (0, 1.0), (17, 0.999)]:
        got = filter_logits(logits, top_k=top_k, top_p=top_p)
        for row in range(5):
            order = sorted(range(17), key=lambda i: -logits[row, i].item())
            keep = set(order[:top_k]) if top_k else set(order)
            probs = torch.softmax(torch.tensor([logits[row, i].item() if i in keep else -1e30 for i in range(17)]), 0)
            nucleus, mass = set(), 0.0
            for i in order:
                if i in keep and mass < top_p:
                    nucleus.add(i)
                    mass += probs[i].item()
            kept = {i for i in range(17) if got[row, i].item() != float("-inf")}
            assert kept == nucleus, (top_k, top_p, row)


def test_sampling_frequencies_follow_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 1e-9]])).repeat(20000, 1)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_next_tokens(logits, temperature=1.0, top_k=0, top_p=1.0, generators=generator)
    frequencies = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    torch.testing.assert_close(frequencies, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.015, rtol=0)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))
    assert request_seed(1, 0) != request_seed(1, 1) != request_seed(2, 0)
    assert 0 <= request_seed(2**40, 10**6) < 2**63


def test_load_weights_changes_outputs_to_new_model(tiny_model_factory, prompt_ids):
    engine = HFEngine(HFEngineConfig(model=str(tiny_model_factory("llama"))))
    other_path = tiny_model_factory("llama", seed=7)
    other = HFEngine(HFEngineConfig(model=str(other_path)))
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = [r.response_token_ids.tolist() for r in engine.generate(prompt_ids, sampling)]
    expected = [r.response_token_ids.tolist() for r in other.generate(prompt_ids, sampling)]
    assert before != expected
    state = dict(other.model.named_parameters())
    assert engine.load_weights(((n, t.to(torch.bfloat16).float()) for n, t in state.items())) == len(state)
    engine.load_weights(iter(state.items()), version=5)
    assert engine.weight_version == 5
    rollouts = engine.generate(prompt_ids, sampling)
    assert [r.response_token_ids.tolist() for r in rollouts] == expected
    assert all(r.weight_version == 5 for r in rollouts)
    assert engine.load_weights({"model.norm.weight": state["model.norm.weight"]}) == 1
    assert engine.weight_version == 6


def test_load_weights_validates_before_copying(tiny_llama_path, prompt_ids):
    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    norm = engine.model.model.norm.weight
    original = norm.detach().clone()
    with pytest.raises(ValueError, match=r"unknown tensor name 'model.norm.weigth'.*model.norm.weight"):
        engine.load_weights([("model.norm.weigth", torch.zeros(64))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(63,\).*expects \(64,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(63))])
    with pytest.raises(ValueError, match="floating and integer"):
        engine.load_weights([("model.norm.weight", torch.zeros(64, dtype=torch.long))])
    assert torch.equal(norm, original) and engine.weight_version == 0
    engine.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=2))  # nothing was applied: still usable
    with pytest.raises(ValueError, match="unknown tensor name"):
        engine.load_weights([("model.norm.weight", torch.ones(64)), ("nope", torch.ones(1))])
    assert torch.equal(norm, torch.ones(64)) and engine.weight_version == 0
    with pytest.raises(RuntimeError, match="failed after applying 1 tensor"):
        engine.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=2))
    engine.load_weights([("model.norm.weight", original)])
    engine.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=2))


@pytest.mark.parametrize("tie", [False, True])
def test_sleep_wake_lifecycle(tiny_model_factory, prompt_ids, tie):
    engine = HFEngine(HFEngineConfig(model=str(tiny_model_factory("qwen2", tie_word_embeddings=tie))))
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [r.response_token_ids.tolist() for r in engine.generate(prompt_ids, sampling)]
    saved = {n: t.detach().clone() for n, t in engine.model.named_parameters()}
    engine.sleep(1)
    assert engine.is_sleeping
    with pytest.raises(RuntimeError, match="weights are asleep; call wake_up"):
        engine.generate(prompt_ids, sampling)
    with pytest.raises(RuntimeError, match=r"asleep; call wake_up\(\['weights'\]\)"):
        engine.load_weights(saved.items())
    engine.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="KV cache is asleep"):
        engine.generate(prompt_ids, sampling)
    engine.wake_up(["kv_cache"])
    assert [r.response_token_ids.tolist() for r in engine.generate(prompt_ids, sampling)] == expected
    engine.sleep(2)
    assert all(p.numel() == 0 for p in engine.model.parameters())
    engine.wake_up()
    with pytest.raises(RuntimeError, match="uninitialised after sleep"):
        engine.generate(prompt_ids, sampling)
    assert engine.load_weights(saved.items()) == len(saved)
    assert (engine.model.get_input_embeddings().weight is engine.model.get_output_embeddings().weight) == tie
    assert [r.response_token_ids.tolist() for r in engine.generate(prompt_ids, sampling)] == expected


def test_lifecycle_and_input_errors(engine, prompt_ids):
    with pytest.raises(ValueError, match="level must be 1"):
        engine.sleep(3)
    with pytest.raises(TypeError, match=r"wake_up\(\['weights'\]\)"):
        engine.wake_up("weights")
    with pytest.raises(ValueError, match="unknown tag"):
        engine.wake_up(["kv"])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([prompt_ids[0], []], SamplingConfig())
    with pytest.raises(ValueError, match=r"token ids outside \[0, 384\)"):
        engine.generate([[1, 400]], SamplingConfig())
    with pytest.raises(TypeError, match="prompt 0 holds non-integer token ids"):
        engine.generate([[1.5, 2.0]], SamplingConfig())
    with pytest.raises(TypeError, match="SamplingConfig"):
        engine.generate(prompt_ids, {"n": 2})
    with pytest.raises(ValueError, match="version"):
        engine.load_weights([], version=-1)
    with pytest.raises(ValueError, match="HFEngineConfig.dtype='fp32'"):
        HFEngineConfig(model="x", dtype="fp32")
    with pytest.raises(ValueError, match="max_batch_size=0"):
        HFEngineConfig(model="x", max_batch_size=0)
    with pytest.raises(ValueError, match="device='gpu0'"):
        HFEngineConfig(model="x", device="gpu0")


def test_from_model_restores_training_mode(tiny_llama_path, prompt_ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    model.train()
    engine = HFEngine.from_model(model)
    assert engine.eos_token_ids == tuple(model.generation_config.eos_token_id)
    assert engine.pad_token_id == model.generation_config.pad_token_id
    rollouts = engine.generate(prompt_ids, SamplingConfig(max_new_tokens=4, seed=0))
    assert model.training
    assert not rollouts[0].response_token_ids.requires_grad
    # rollout tensors are ordinary tensors (not inference-mode), usable in a later autograd graph
    logits = model(torch.cat([rollouts[0].prompt_token_ids, rollouts[0].response_token_ids])[None]).logits
    logits.sum().backward()


@pytest.mark.gpu
def test_gpu_generate_sleep_wake_and_reload(tiny_llama_path, prompt_ids):
    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path), device="cuda"))
    sampling = SamplingConfig(n=2, max_new_tokens=16, temperature=1.0, seed=0)
    rollouts = engine.generate(prompt_ids, sampling)
    for rollout in rollouts:
        on_gpu = type(rollout)(prompt_token_ids=rollout.prompt_token_ids.cuda(),
                               response_token_ids=rollout.response_token_ids.cuda())
        reference = full_forward_logprobs(engine.model, on_gpu)
        torch.testing.assert_close(rollout.response_logprobs, reference.cpu(), atol=1e-4, rtol=0)
    tokens = [r.response_token_ids.tolist() for r in rollouts]
    saved = {n: t.detach().cpu().clone() for n, t in engine.model.named_parameters()}
    allocated = torch.cuda.memory_allocated()
    engine.sleep(1)
    assert torch.cuda.memory_allocated() < allocated
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    engine.wake_up()
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    assert [r.response_token_ids.tolist() for r in engine.generate(prompt_ids, sampling)] == tokens
    engine.sleep(2)
    assert torch.cuda.memory_allocated() < allocated
    engine.wake_up(["weights"])
    engine.load_weights(saved.items())
    engine.wake_up(["kv_cache"])
    assert [r.response_token_ids.tolist() for r in engine.generate(prompt_ids, sampling)] == tokens
    half = HFEngine(HFEngineConfig(model=str(tiny_llama_path), device="cuda", dtype="bfloat16"))
    for rollout in half.generate(prompt_ids, sampling):
        assert torch.isfinite(rollout.response_logprobs).all() and rollout.response_logprobs.dtype == torch.float32


def test_generation_emits_no_past_key_values_deprecation(tiny_llama_path, prompt_ids):
    """Review defect 9: every run warned that ``past_key_values`` is deprecated; the engine now uses the model's own
    cache argument name (``cache`` on current transformers) for the call and the output."""
    import logging

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rollouts = engine.generate(prompt_ids, SamplingConfig(n=2, max_new_tokens=6, seed=1))
    finally:
        hf_logger.removeHandler(handler)
    assert len(rollouts) == len(prompt_ids) * 2 and all(r.response_length > 0 for r in rollouts)
    texts = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    assert not [t for t in texts if "past_key_values" in t or "cache_params" in t], texts


def test_weight_versions_strictly_increase(tiny_llama_path, prompt_ids):
    """Review defect 2: load_weights(version=5) then version=3 (or 5 again) was accepted and the version went back."""
    from rlhfkit.engines.protocol import WeightVersionError

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    norm = engine.model.model.norm.weight
    original = norm.detach().clone()
    engine.load_weights([("model.norm.weight", original)], version=5)
    for offered in (3, 5):
        with pytest.raises(WeightVersionError, match=rf"hf engine on cpu holds weight version 5 and was offered "
                                                     rf"version {offered}; versions must strictly increase"):
            engine.load_weights([("model.norm.weight", torch.zeros(64))], version=offered)
    assert engine.weight_version == 5 and torch.equal(norm, original)  # refused before anything was copied
    engine.load_weights([("model.norm.weight", original)])
    assert engine.weight_version == 6


# --- LoRA adapters merged into the weights ---------------------------------------------------------------------------
def _adapter(model, lora, *, seed=1, rank=None):
    """Random adapter tensors for ``lora`` on ``model`` (peft's names), of rank ``rank`` (default: the config's)."""
    from rlhfkit.lora import describe_adapter

    generator = torch.Generator().manual_seed(seed)
    out = []
    for name, (rows, cols), _ in describe_adapter(model, lora, dtype=torch.float32):
        shape = (rank or rows, cols) if name.endswith("lora_A.weight") else (rows, rank or cols)
        out.append((name, 0.3 * torch.randn(shape, generator=generator)))
    return out


def _weights(engine):
    return {name: param.detach().clone() for name, param in engine.model.named_parameters()}


def test_load_adapter_checks_every_shape_before_merging_any(tiny_llama_path, prompt_ids):
    """Regression (issue 50 item 7): load_adapter checked names only. An adapter of twice the config's rank merged
    without error (a doubled update); a mis-shaped tensor of the last module failed mid-merge and left the first
    modules merged while generate kept serving. Now each is a ValueError naming the tensor, its shape and the
    expected one, and the weights, the version and the output are exactly as before."""
    from rlhfkit.lora import LoraConfig

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    before, weights = engine.generate(prompt_ids, greedy), _weights(engine)
    with pytest.raises(ValueError, match=r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' "
                                         r"has shape \(8, 64\); expected \(4, 64\)"):
        engine.load_adapter(_adapter(engine.model, lora, rank=8), lora=lora)
    bad = _adapter(engine.model, lora)
    name, tensor = bad[-1]  # the last module's lora_B: every module before it would merge first
    bad[-1] = (name, tensor[:-1])
    with pytest.raises(ValueError, match=rf"'{name}' has shape \({tensor.shape[0] - 1}, 4\); "
                                         rf"expected \({tensor.shape[0]}, 4\)"):
        engine.load_adapter(bad, lora=lora)
    assert engine.weight_version == 0
    assert all(torch.equal(param, weights[name]) for name, param in engine.model.named_parameters())
    after = engine.generate(prompt_ids, greedy)
    assert [r.response_token_ids.tolist() for r in after] == [r.response_token_ids.tolist() for r in before]
    assert engine.load_adapter(_adapter(engine.model, lora), lora=lora) == 8 and engine.weight_version == 1


def test_load_adapter_under_a_new_config_replaces_the_previous_adapter(tiny_llama_path):
    """Regression (issue 50 item 7, sibling): a load_adapter with another LoraConfig built a new merger whose base
    was the already merged weights, so the new adapter came on top of the old one (and the old one stayed on
    modules the new config does not target). Now the engine holds exactly what a fresh engine given only the new
    adapter holds."""
    from rlhfkit.lora import LoraConfig

    first = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    second = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "down_proj"))
    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    fresh = HFEngine(HFEngineConfig(model=str(tiny_llama_path)))
    base = _weights(engine)
    engine.load_adapter(_adapter(engine.model, first, seed=1), lora=first)
    assert not torch.equal(engine.model.model.layers[0].self_attn.v_proj.weight,
                           base["model.layers.0.self_attn.v_proj.weight"])
    with pytest.raises(ValueError, match="has shape"):  # a refused adapter under the new config changes nothing
        engine.load_adapter(_adapter(engine.model, second, rank=3), lora=second)
    engine.load_adapter(_adapter(engine.model, second, seed=2), lora=second)
    fresh.load_adapter(_adapter(fresh.model, second, seed=2), lora=second)
    want = _weights(fresh)
    assert all(torch.equal(param, want[name]) for name, param in engine.model.named_parameters())
    engine.load_adapter(_adapter(engine.model, first, seed=3), lora=first)  # and back: down_proj is base again
    assert torch.equal(engine.model.model.layers[1].mlp.down_proj.weight, base["model.layers.1.mlp.down_proj.weight"])


# --- in-flight weight updates: pause, load, resume (abort and resubmit) ----------------------------------------------
def _perturbed(model, scale=0.05, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return {name: value.detach() + scale * torch.randn(value.shape, generator=generator)
            for name, value in model.named_parameters()}


def _generate_with_a_pause_at_step(path, prompt_ids, sampling, step, new_weights):
    """Run generate in a thread, pause it when the model's ``step``-th forward starts, load ``new_weights`` while it
    is parked, resume; returns the rollouts and the new engine."""
    import threading

    engine = HFEngine(HFEngineConfig(model=path, max_batch_size=8, seed=0, pause_timeout_s=30))
    reached, go, calls = threading.Event(), threading.Event(), [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] == step:
            reached.set()
            assert go.wait(30)

    handle = engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(rollouts=engine.generate(prompt_ids, sampling)))
    worker.start()
    assert reached.wait(30)
    pauser = threading.Thread(target=lambda: result.update(parked=engine.pause_generation(timeout_s=30)))
    pauser.start()
    while not engine.generation_paused:
        pass
    go.set()  # the forward in flight finishes; the decode loop sees the pause and parks
    pauser.join(30)
    assert result["parked"] == 1
    handle.remove()
    engine.load_weights(new_weights, version=1)
    engine.resume_generation()
    worker.join(60)
    assert not worker.is_alive()
    return result["rollouts"], engine


def test_an_in_flight_update_continues_unfinished_samples_with_new_weights_and_stamps_each_token(tiny_llama_path,
                                                                                                 prompt_ids):
    """Issue 21 item 4 (fallback): abort and resubmit; tokens before the pause are the old weights', tokens after it
    the new weights' (their log-probs match a full forward of the new model), each stamped with its version."""
    path = str(tiny_llama_path)
    sampling = SamplingConfig(n=2, max_new_tokens=10, ignore_eos=True, seed=7)
    old = HFEngine(HFEngineConfig(model=path, max_batch_size=8, seed=0))
    uninterrupted = old.generate(prompt_ids, sampling)
    new_weights = _perturbed(old.model)
    rollouts, engine = _generate_with_a_pause_at_step(path, prompt_ids, sampling, step=4, new_weights=new_weights)
    # the 4th forward (the prefill and 2 decode steps ran before it) completes: 4 tokens of version 0
    for rollout, reference in zip(rollouts, uninterrupted, strict=True):
        assert rollout.weight_version == 0 and rollout.finish_reason == "length"
        assert rollout.response_weight_versions.tolist() == [0] * 4 + [1] * 6
        assert rollout.token_weight_versions.tolist() == [0] * 4 + [1] * 6
        assert torch.equal(rollout.response_token_ids[:4], reference.response_token_ids[:4])
        torch.testing.assert_close(rollout.response_logprobs[:4], reference.response_logprobs[:4], atol=1e-5, rtol=0)
        torch.testing.assert_close(rollout.response_logprobs[4:], full_forward_logprobs(engine.model, rollout)[4:],
                                   atol=1e-4, rtol=0)
    assert not torch.equal(torch.stack([r.response_token_ids for r in rollouts]),
                           torch.stack([r.response_token_ids for r in uninterrupted]))


def test_pause_without_generation_returns_and_a_paused_generate_waits_bounded(tiny_llama_path, prompt_ids):
    import threading
    import time

    from rlhfkit.engines.hf import GenerationPausedTimeout

    engine = HFEngine(HFEngineConfig(model=str(tiny_llama_path), seed=0, pause_timeout_s=0.3))
    assert engine.pause_generation(timeout_s=1) == 0 and engine.generation_paused
    start = time.monotonic()
    with pytest.raises(GenerationPausedTimeout, match="not resumed within 0.3 s"):
        engine.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=4))  # arrives during a pause: waits, bounded
    assert time.monotonic() - start < 5
    engine.resume_generation()
    assert len(engine.generate(prompt_ids[:1], SamplingConfig(max_new_tokens=4))) == 1
    # a generate that never reaches a decode step: the pause is bounded and withdrawn
    blocked, go = threading.Event(), threading.Event()
    def hook(*args):
        blocked.set()
        go.wait(30)

    handle = engine.model.register_forward_pre_hook(hook)
    worker = threading.Thread(target=engine.generate, args=(prompt_ids[:1], SamplingConfig(max_new_tokens=4)))
    worker.start()
    assert blocked.wait(30)
    with pytest.raises(GenerationPausedTimeout, match="1 of 1 running generate"):
        engine.pause_generation(timeout_s=0.2)
    assert not engine.generation_paused
    handle.remove()
    go.set()
    worker.join(30)
