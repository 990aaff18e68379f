"""rlhfkit.experience: make_experience against a per-sample Python reference, checks, stats, minibatching."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.experience import (
    ExperienceConfig,
    engine_token_logprobs,
    iterate_minibatches,
    make_experience,
    select_experience,
)
from rlhfkit.types import Rollout

ESTIMATORS = ("gae", "reinforce", "reinforce++", "reinforce++_baseline", "rloo", "grpo", "dr_grpo")


# ---------------------------------------------------------------------------------------------------------------
# Plain-callable "models": deterministic functions of the token ids and positions.


def fake_logprobs(batch, scale=0.1):
    return -scale * (batch.input_ids % 7).float() - 0.01 * batch.position_ids.float() - 0.05


def fake_ref(batch):
    return fake_logprobs(batch, scale=0.13) + 0.02


def fake_values(batch):
    return torch.sin(batch.input_ids.float()) + 0.1 * batch.position_ids.float()


def make_rollouts(num_prompts=4, n=3, seed=0, with_logprobs=True):
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for p in range(num_prompts):
        prompt = torch.randint(3, 300, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        for s in range(n):
            length = int(torch.randint(1, 9, (1,), generator=g))
            response = torch.randint(3, 300, (length,), generator=g)
            logprobs = -torch.rand(length, generator=g) if with_logprobs else None
            rollouts.append(Rollout(prompt_token_ids=prompt, response_token_ids=response, response_logprobs=logprobs,
                                    finish_reason="length" if s == 0 else "stop", prompt_index=p, sample_index=s))
    return rollouts


def per_token_fake(fn, rollout):
    """The fake fn's value on the response tokens of one rollout packed alone: [R]."""
    from rlhfkit.packing import pack_rollouts

    batch = pack_rollouts([rollout])
    return fn(batch)[batch.loss_mask]


# ---------------------------------------------------------------------------------------------------------------
# Naive reference: per-sample Python lists, following the papers' definitions directly.


def naive_experience(rollouts, rewards, config, kl_coef):
    n = len(rollouts)
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.prompt_index, []).append(i)
    seq = []
    for i in range(n):
        members = [rewards[j] for j in groups[rollouts[i].prompt_index]]
        mean = sum(members) / len(members)
        if config.estimator == "grpo":
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
            seq.append((rewards[i] - mean) / (std + config.grpo_eps))
        elif config.estimator in ("dr_grpo", "reinforce++_baseline"):
            seq.append(rewards[i] - mean)
        elif config.estimator == "rloo":
            seq.append(rewards[i] - (sum(members) - rewards[i]) / (len(members) - 1))
        else:
            seq.append(rewards[i])
    advantages, returns = [], []
    for i, r in enumerate(rollouts):
        lp = per_token_fake(fake_logprobs, r).tolist()
        ref = per_token_fake(fake_ref, r).tolist()
        vals = per_token_fake(fake_values, r).tolist()
        kl = [math.exp(b - a) - 1 - (b - a) for a, b in zip(lp, ref)]  # k3
        token_r = [-kl_coef * k if config.kl_in_reward else 0.0 for k in kl]
        token_r[-1] += seq[i]
        adv, ret = [0.0] * len(lp), [0.0] * len(lp)
        running, next_value = 0.0, 0.0
        for t in reversed(range(len(lp))):
            if config.estimator == "gae":
                delta = token_r[t] + config.gamma * next_value - vals[t]
                running = delta + config.gamma * config.lam * running
                adv[t], ret[t], next_value = running, running + vals[t], vals[t]
            else:
                running = token_r[t] + config.gamma * running
                adv[t] = ret[t] = running
        advantages.append(adv)
        returns.append(ret)
    if config.whitens:
        flat = [a for adv in advantages for a in adv]
        mean = sum(flat) / len(flat)
        var = sum((a - mean) ** 2 for a in flat) / len(flat)
        advantages = [[(a - mean) / math.sqrt(var + 1e-8) for a in adv] for adv in advantages]
    return advantages, returns


def response_slices(experience):
    """Per sequence, the experience's per-token fields on its loss tokens (lists of tensors)."""
    mask, cu = experience.batch.loss_mask, experience.batch.cu_seqlens.tolist()
    return [torch.nonzero(mask[cu[i] : cu[i + 1]]).flatten() + cu[i] for i in range(len(cu) - 1)]


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_make_experience_matches_naive_reference(estimator, kl_in_reward):
    rollouts = make_rollouts()
    rewards = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(1)).tolist()
    config = ExperienceConfig(estimator=estimator, gamma=0.97 if estimator != "grpo" else 1.0, lam=0.9,
                              kl_coef=0.05, kl_in_reward=kl_in_reward, kl_estimator="k3")
    experience, stats = make_experience(rollouts, rewards, policy_logprobs_fn=fake_logprobs,
                                        ref_logprobs_fn=fake_ref, values_fn=fake_values, config=config)
    expected_adv, expected_ret = naive_experience(rollouts, rewards, config, kl_coef=0.05)
    for i, positions in enumerate(response_slices(experience)):
        torch.testing.assert_close(experience.advantages[positions].double(), torch.tensor(expected_adv[i],
                                   dtype=torch.float64), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(experience.returns[positions].double(), torch.tensor(expected_ret[i],
                                   dtype=torch.float64), rtol=1e-5, atol=1e-5)
    outside = ~experience.batch.loss_mask
    for name in ("advantages", "returns", "old_logprobs", "ref_logprobs", "values", "kl", "engine_logprobs"):
        assert float(getattr(experience, name)[outside].abs().max()) == 0.0, name


def test_make_experience_fields_are_token_aligned():
    rollouts = make_rollouts(num_prompts=3, n=2)
    experience, _ = make_experience(rollouts, [1.0] * 6, policy_logprobs_fn=fake_logprobs,
                                    ref_logprobs_fn=fake_ref, config=ExperienceConfig(kl_estimator="k1"))
    for rollout, positions in zip(rollouts, response_slices(experience)):
        assert torch.equal(experience.batch.input_ids[positions], rollout.response_token_ids)
        torch.testing.assert_close(experience.engine_logprobs[positions], rollout.response_logprobs)
        torch.testing.assert_close(experience.old_logprobs[positions], per_token_fake(fake_logprobs, rollout))
        torch.testing.assert_close(experience.kl[positions],
                                   per_token_fake(fake_logprobs, rollout) - per_token_fake(fake_ref, rollout))
    assert experience.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert experience.truncated.tolist() == [True, False] * 3
    assert experience.response_lengths.tolist() == [r.response_length for r in rollouts]
    assert experience.values is None and experience.engine_logprobs is not None
    # the engine's log-probs as the behaviour policy's: old log-probs are then the engine's own
    engine_old, _ = make_experience(rollouts, [1.0] * 6, config=ExperienceConfig(kl_estimator="k1"),
                                    policy_logprobs_fn=lambda batch: engine_token_logprobs(rollouts, batch))
    assert torch.equal(engine_old.old_logprobs, experience.engine_logprobs)


def test_grpo_experience_is_invariant_to_rollout_order():
    rollouts = make_rollouts(num_prompts=4, n=4, seed=3)
    rewards = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(2))
    config = ExperienceConfig(estimator="grpo")
    base, _ = make_experience(rollouts, rewards, policy_logprobs_fn=fake_logprobs, config=config)
    perm = torch.randperm(len(rollouts), generator=torch.Generator().manual_seed(5)).tolist()
    shuffled, _ = make_experience([rollouts[i] for i in perm], rewards[perm], policy_logprobs_fn=fake_logprobs,
                                  config=config)
    base_slices, new_slices = response_slices(base), response_slices(shuffled)
    for new_i, old_i in enumerate(perm):
        torch.testing.assert_close(shuffled.advantages[new_slices[new_i]], base.advantages[base_slices[old_i]])


def test_stats_hand_checked():
    prompt = torch.tensor([5, 6])
    rollouts = [
        Rollout(prompt_token_ids=prompt, response_token_ids=torch.tensor([7, 8]), finish_reason="length"),
        Rollout(prompt_token_ids=prompt, response_token_ids=torch.tensor([9, 10, 11, 12]), finish_reason="stop"),
    ]
    config = ExperienceConfig(estimator="reinforce", kl_estimator="k1")
    experience, stats = make_experience(rollouts, torch.tensor([1.0, 3.0]), policy_logprobs_fn=lambda b: torch.full(
        (b.num_tokens,), -1.0), ref_logprobs_fn=lambda b: torch.full((b.num_tokens,), -1.5), config=config)
    assert stats["reward/mean"] == 2.0 and stats["reward/std"] == 1.0
    assert stats["reward/min"] == 1.0 and stats["reward/max"] == 3.0
    assert stats["response_length/mean"] == 3.0 and stats["response_length/max"] == 4.0
    assert stats["truncation_rate"] == 0.5
    assert stats["kl/mean"] == pytest.approx(0.5) and stats["kl/seq_sum_mean"] == pytest.approx(1.5)
    # reinforce, gamma 1, no KL in reward: advantage = reward on every response token: 1,1,3,3,3,3
    assert stats["advantage/mean"] == pytest.approx(14 / 6)
    assert stats["advantage/std"] == pytest.approx(math.sqrt((2 * (4 / 3) ** 2 + 4 * (2 / 3) ** 2) / 6))
    assert stats["num_loss_tokens"] == 6.0 and stats["num_seqs"] == 2.0
    for phase in ("pack", "policy_logprobs", "ref_logprobs", "advantages", "total"):
        assert stats[f"time/{phase}_s"] >= 0.0
    assert all(isinstance(v, float) for v in stats.values())


def test_reward_clip_normalize_and_kl_coef_override():
    rollouts = make_rollouts(num_prompts=1, n=3)
    config = ExperienceConfig(estimator="reinforce", reward_clip=1.0, normalize_rewards=True, kl_in_reward=True,
                              kl_coef=0.0)
    experience, stats = make_experience(rollouts, [5.0, -5.0, 0.0], policy_logprobs_fn=fake_logprobs,
                                        ref_logprobs_fn=fake_ref, config=config, kl_coef=0.3)
    # clip to [1, -1, 0], then standardise (biased std sqrt(2/3)).
    torch.testing.assert_close(experience.rewards, torch.tensor([1.0, -1.0, 0.0]) / math.sqrt(2 / 3))
    assert stats["reward/max"] == 5.0 and stats["kl_coef"] == 0.3
    positions = response_slices(experience)[2]
    expected_last = -0.3 * float(experience.kl[positions[-1]])  # reward 0 after normalisation: only the KL
    assert float(experience.returns[positions[-1]]) == pytest.approx(expected_last, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def test_forward_fn_checks_name_the_fn_and_sample():
    rollouts = make_rollouts(num_prompts=2, n=2)
    config = ExperienceConfig()

    def bad_shape(batch):
        return torch.zeros(1, batch.num_tokens)

    with pytest.raises(ValueError, match=r"policy_logprobs_fn=.*bad_shape returned a float32 tensor of shape \(1, "):
        make_experience(rollouts, [0.0] * 4, policy_logprobs_fn=bad_shape, config=config)

    def nan_in_sample_2(batch):
        out = fake_logprobs(batch)
        out[int(batch.cu_seqlens[3]) - 1] = float("nan")  # last (response) token of sample 2
        return out

    with pytest.raises(ValueError, match=r"ref_logprobs_fn=.*nan_in_sample_2 returned a non-finite value \(nan\) for "
                                         r"sample index 2"):
        make_experience(rollouts, [0.0] * 4, policy_logprobs_fn=fake_logprobs, ref_logprobs_fn=nan_in_sample_2,
                        config=config)
    with pytest.raises(TypeError, match="values_fn=.*returned list"):
        make_experience(rollouts, [0.0] * 4, policy_logprobs_fn=fake_logprobs, values_fn=lambda b: [0.0],
                        config=ExperienceConfig(estimator="gae"))

    def nan_on_prompt(batch):  # non-loss tokens are not checked (and are zeroed)
        out = fake_logprobs(batch)
        out[0] = float("nan")
        return out

    experience, _ = make_experience(rollouts, [0.0] * 4, policy_logprobs_fn=nan_on_prompt, config=config)
    assert float(experience.old_logprobs[0]) == 0.0


def test_reward_and_rollout_checks():
    rollouts = make_rollouts(num_prompts=2, n=2)
    kwargs = dict(policy_logprobs_fn=fake_logprobs, config=ExperienceConfig())
    with pytest.raises(ValueError, match="rewards is not finite at sample index 1"):
        make_experience(rollouts, [0.0, float("nan"), 0.0, 0.0], **kwargs)
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\); expected \(4,\)"):
        make_experience(rollouts, [0.0] * 3, **kwargs)
    with pytest.raises(ValueError, match="rollouts must be a non-empty list"):
        make_experience([], [], **kwargs)
    with pytest.raises(ValueError, match="estimator='gae' needs values_fn"):
        make_experience(rollouts, [0.0] * 4, policy_logprobs_fn=fake_logprobs, config=ExperienceConfig(estimator="gae"))
    with pytest.raises(ValueError, match="kl_in_reward=True with kl_coef=0.1 needs ref_logprobs_fn"):
        make_experience(rollouts, [0.0] * 4, policy_logprobs_fn=fake_logprobs,
                        config=ExperienceConfig(kl_in_reward=True, kl_coef=0.1))
    mixed = list(rollouts)
    mixed[2] = Rollout(prompt_token_ids=mixed[2].prompt_token_ids, response_token_ids=mixed[2].response_token_ids,
                       prompt_index=1)
    with pytest.raises(ValueError, match=r"rollouts\[2\].response_logprobs is None"):
        make_experience(mixed, [0.0] * 4, **kwargs)
    bad_engine = list(rollouts)
    bad_engine[3] = Rollout(prompt_token_ids=rollouts[3].prompt_token_ids, prompt_index=1,
                            response_token_ids=rollouts[3].response_token_ids,
                            response_logprobs=torch.full((rollouts[3].response_length,), float("-inf")))
    with pytest.raises(ValueError, match="response_logprobs contain a non-finite value \\(-inf\\) for sample index 3"):
        make_experience(bad_engine, [0.0] * 4, **kwargs)
    collided = make_rollouts(num_prompts=2, n=2, with_logprobs=False)
    collided = collided[:2] + [Rollout(prompt_token_ids=r.prompt_token_ids, response_token_ids=r.response_token_ids,
                                       prompt_index=0) for r in collided[2:]]
    with pytest.raises(ValueError, match=r"rollouts\[0\] and rollouts\[2\] share prompt_index=0"):
        make_experience(collided, [0.0] * 4, **kwargs)
    singleton = make_rollouts(num_prompts=2, n=2)[:3]
    with pytest.raises(ValueError, match=r"group 1 \(sample index 2\) has 1 sample"):
        make_experience(singleton, [0.0] * 3, policy_logprobs_fn=fake_logprobs,
                        config=ExperienceConfig(estimator="rloo"))


@pytest.mark.parametrize("field,value,message", [
    ("estimator", "ppo", "estimator='ppo'"),
    ("gamma", 1.1, "gamma=1.1"),
    ("lam", -0.5, "lam=-0.5"),
    ("kl_coef", -1.0, "kl_coef=-1.0"),
    ("kl_estimator", "k5", "kl_estimator='k5'"),
    ("kl_clamp", 0.0, "kl_clamp=0.0"),
    ("reward_clip", -1.0, "reward_clip=-1.0"),
    ("grpo_eps", 0.0, "grpo_eps=0.0"),
])
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=f"ExperienceConfig.{message}"):
        ExperienceConfig(**{field: value})


def test_config_whitening_defaults():
    assert ExperienceConfig(estimator="gae").whitens and ExperienceConfig(estimator="reinforce++").whitens
    assert not ExperienceConfig(estimator="grpo").whitens
    assert ExperienceConfig(estimator="grpo", whiten_advantages=True).whitens
    with pytest.raises(ValueError, match="REINFORCE\\+\\+ is defined by global whitening"):
        ExperienceConfig(estimator="reinforce++_baseline", whiten_advantages=False)


# ---------------------------------------------------------------------------------------------------------------
# Minibatches


@pytest.fixture(scope="module")
def experience():
    rollouts = make_rollouts(num_prompts=6, n=4, seed=11)
    rewards = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(0))
    exp, _ = make_experience(rollouts, rewards, policy_logprobs_fn=fake_logprobs, ref_logprobs_fn=fake_ref,
                             values_fn=fake_values, config=ExperienceConfig(estimator="gae"))
    return exp


def sequence_signature(exp, i):
    """A per-sequence fingerprint of all per-token fields, to match minibatch sequences to the original."""
    cu = exp.batch.cu_seqlens.tolist()
    sl = slice(cu[i], cu[i + 1])
    return (tuple(exp.batch.input_ids[sl].tolist()), tuple(exp.advantages[sl].tolist()),
            tuple(exp.old_logprobs[sl].tolist()), tuple(exp.values[sl].tolist()), tuple(exp.kl[sl].tolist()),
            tuple(exp.engine_logprobs[sl].tolist()), float(exp.rewards[i]), int(exp.prompt_index[i]),
            bool(exp.truncated[i]), int(exp.response_lengths[i]))


@pytest.mark.parametrize("kwargs", [dict(num_minibatches=5), dict(max_tokens=40), dict(max_tokens=60,
                                                                                         num_minibatches=4)])
def test_minibatches_cover_every_sequence_once(experience, kwargs):
    original = sorted(sequence_signature(experience, i) for i in range(experience.num_seqs))
    minibatches = list(iterate_minibatches(experience, seed=3, **kwargs))
    seen = sorted(sequence_signature(mb, i) for mb in minibatches for i in range(mb.num_seqs))
    assert seen == original  # every sequence exactly once, with its per-token fields intact
    if "max_tokens" in kwargs:
        assert all(mb.num_tokens <= kwargs["max_tokens"] for mb in minibatches)
    if "num_minibatches" in kwargs:
        assert len(minibatches) >= kwargs["num_minibatches"]
    if kwargs == dict(num_minibatches=5):
        assert sorted(mb.num_seqs for mb in minibatches) == [4, 5, 5, 5, 5]


def test_minibatches_are_seeded(experience):
    def order(seed):
        return [tuple(mb.batch.input_ids.tolist()) for mb in iterate_minibatches(experience, num_minibatches=4,
                                                                                  seed=seed)]

    assert order(7) == order(7)
    assert order(7) != order(8)
    with pytest.raises(TypeError, match="seed=None"):
        next(iterate_minibatches(experience, num_minibatches=2, seed=None))
    with pytest.raises(ValueError, match="num_minibatches=0"):
        next(iterate_minibatches(experience, num_minibatches=0, seed=0))
    with pytest.raises(ValueError, match="give num_minibatches, max_tokens, or both"):
        next(iterate_minibatches(experience, seed=0))
    with pytest.raises(ValueError, match="exceeds max_tokens=2"):
        next(iterate_minibatches(experience, max_tokens=2, seed=0))


def test_select_experience_keeps_order(experience):
    sub = select_experience(experience, [5, 0])
    assert sequence_signature(sub, 0) == sequence_signature(experience, 5)
    assert sequence_signature(sub, 1) == sequence_signature(experience, 0)


# ---------------------------------------------------------------------------------------------------------------
# A real tiny model as the policy function


def test_make_experience_with_tiny_hf_model(tiny_llama_path):
    transformers = pytest.importorskip("transformers")
    from rlhfkit.losses import model_logprobs

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path, attn_implementation="eager").eval()
    rollouts = make_rollouts(num_prompts=2, n=3, seed=4)
    config = ExperienceConfig(estimator="rloo")
    experience, stats = make_experience(rollouts, [0.0, 1.0, 0.5, 1.0, 0.0, 0.0],
                                        policy_logprobs_fn=lambda b: model_logprobs(model, b), config=config)
    assert stats["time/policy_logprobs_s"] > 0
    for rollout, positions in zip(rollouts, response_slices(experience)):
        ids = torch.cat([rollout.prompt_token_ids, rollout.response_token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].float()
        per_token = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        torch.testing.assert_close(experience.old_logprobs[positions], per_token[-rollout.response_length:],
                                   rtol=1e-5, atol=1e-5)


def test_empty_response_counts_in_its_group_but_has_no_tokens():
    prompt = torch.tensor([1, 2])
    rollouts = [
        Rollout(prompt_token_ids=prompt, response_token_ids=torch.zeros(0, dtype=torch.long), finish_reason="abort"),
        Rollout(prompt_token_ids=prompt, response_token_ids=torch.tensor([3, 4])),
    ]
    experience, stats = make_experience(rollouts, [1.0, 0.0], policy_logprobs_fn=fake_logprobs,
                                        config=ExperienceConfig(estimator="rloo"))
    # RLOO: sample 1 gets 0 - 1 = -1 on both of its tokens; the empty sample has no token to carry its +1.
    assert experience.advantages.tolist() == [0.0, 0.0, 0.0, 0.0, -1.0, -1.0]
    assert stats["response_length/mean"] == 1.0 and stats["num_loss_tokens"] == 2.0


@pytest.mark.gpu
def test_forward_fns_on_cuda_results_land_on_the_batch_device():
    rollouts = make_rollouts(num_prompts=2, n=3)
    experience, _ = make_experience(rollouts, [0.0, 1.0, 2.0, 0.5, 0.5, 1.0],
                                    policy_logprobs_fn=lambda b: fake_logprobs(b.to("cuda")),
                                    ref_logprobs_fn=lambda b: fake_ref(b.to("cuda")),
                                    values_fn=lambda b: fake_values(b.to("cuda")),
                                    config=ExperienceConfig(estimator="gae", kl_in_reward=True, kl_coef=0.1))
    cpu, _ = make_experience(rollouts, [0.0, 1.0, 2.0, 0.5, 0.5, 1.0], policy_logprobs_fn=fake_logprobs,
                             ref_logprobs_fn=fake_ref, values_fn=fake_values,
                             config=ExperienceConfig(estimator="gae", kl_in_reward=True, kl_coef=0.1))
    assert experience.advantages.device.type == "cpu"
    torch.testing.assert_close(experience.advantages, cpu.advantages, rtol=1e-5, atol=1e-5)


def test_experience_carries_each_tokens_weight_version_through_minibatches():
    """Issue 21 item 1: make_experience fills Experience.weight_versions ([T], 0 off the loss mask) from the rollouts'
    per-token versions (a constant for a rollout of one version); select_experience keeps it aligned."""
    from rlhfkit.experience import token_weight_versions

    rollouts = [Rollout(prompt_token_ids=torch.tensor([1, 2]), response_token_ids=torch.tensor([3, 4, 5]),
                        weight_version=2, response_weight_versions=torch.tensor([2, 3, 3])),
                Rollout(prompt_token_ids=torch.tensor([6]), response_token_ids=torch.tensor([7, 8]), weight_version=1,
                        prompt_index=1)]
    experience, _ = make_experience(rollouts, torch.tensor([1.0, 0.0]), config=ExperienceConfig(estimator="reinforce"),
                                    policy_logprobs_fn=lambda b: torch.zeros(b.num_tokens))
    assert experience.weight_versions.tolist() == [0, 0, 2, 3, 3, 0, 1, 1]
    assert torch.equal(experience.weight_versions, token_weight_versions(rollouts, experience.batch))
    assert select_experience(experience, [1]).weight_versions.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="1 rollouts for a batch of 2 sequences"):
        token_weight_versions(rollouts[:1], experience.batch)
