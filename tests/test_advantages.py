"""rlhfkit.advantages against naive Python-loop references and hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.advantages import (
    AdaptiveKLController,
    FixedKLController,
    broadcast_to_tokens,
    discounted_returns,
    gae,
    grpo_advantages,
    kl_estimate,
    kl_shaped_rewards,
    reinforce_baseline_advantages,
    rloo_advantages,
    whiten,
)
from rlhfkit.advantages._scan import reverse_discounted_cumsum

# ---------------------------------------------------------------------------------------------------------------
# Naive references: per-token Python loops over plain lists.


def random_packed(seed: int, num_seqs: int = 6, max_len: int = 40, padding: int = 3, holes: bool = False):
    """Random packed layout: prompt (mask False) then response (mask True), optional mask holes, padding tail."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len, (num_seqs,), generator=g)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1]) + padding
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(num_seqs):
        start, end = int(cu[i]), int(cu[i + 1])
        prompt = int(torch.randint(1, end - start, (1,), generator=g))
        mask[start + prompt : end] = True
        if holes and end - start - prompt > 3:
            mask[start + prompt + 1] = False
    return cu, mask, g


def naive_segments(mask, cu):
    """List per sequence of the stream positions of its loss tokens."""
    return [[t for t in range(int(cu[i]), int(cu[i + 1])) if mask[t]] for i in range(len(cu) - 1)]


def naive_returns(rewards, mask, cu, gamma):
    out = [0.0] * len(rewards)
    for positions in naive_segments(mask, cu):
        running = 0.0
        for t in reversed(positions):
            running = float(rewards[t]) + gamma * running
            out[t] = running
    return torch.tensor(out, dtype=torch.float64)


def naive_gae(rewards, values, mask, cu, gamma, lam):
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    for positions in naive_segments(mask, cu):
        last_gae, next_value = 0.0, 0.0
        for t in reversed(positions):
            delta = float(rewards[t]) + gamma * next_value - float(values[t])
            last_gae = delta + gamma * lam * last_gae
            adv[t], ret[t] = last_gae, last_gae + float(values[t])
            next_value = float(values[t])
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def naive_groups(rewards, groups):
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(i)
    return members


def naive_grpo(rewards, groups, scale_by_std=True, eps=1e-6):
    out = [0.0] * len(rewards)
    for idx in naive_groups(rewards, groups).values():
        vals = [float(rewards[i]) for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        for i in idx:
            out[i] = (float(rewards[i]) - mean) / ((std + eps) if scale_by_std else 1.0)
    return torch.tensor(out, dtype=torch.float64)


def naive_rloo(rewards, groups):
    out = [0.0] * len(rewards)
    for idx in naive_groups(rewards, groups).values():
        for i in idx:
            others = [float(rewards[j]) for j in idx if j != i]
            out[i] = float(rewards[i]) - sum(others) / len(others)
    return torch.tensor(out, dtype=torch.float64)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------------------------
# Returns and GAE


def test_discounted_returns_hand_derived():
    # One sequence: prompt token, then 3 response tokens with rewards 1, 0, 2; gamma = 0.5.
    # G2 = 2; G1 = 0 + 0.5*2 = 1; G0 = 1 + 0.5*1 = 1.5.
    rewards = torch.tensor([9.0, 1.0, 0.0, 2.0])
    mask = torch.tensor([False, True, True, True])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    close(discounted_returns(rewards, mask, cu, gamma=0.5), torch.tensor([0.0, 1.5, 1.0, 2.0]))


def test_gae_hand_derived_two_sequences():
    # seq 0 = [p, a, b], seq 1 = [p, c], then one padding token. gamma = 1, lam = 0.5.
    # seq 0: V_a = 1, V_b = 2, r_a = 0, r_b = 3.
    #   delta_b = 3 + 0 - 2 = 1 -> A_b = 1;  delta_a = 0 + 2 - 1 = 1 -> A_a = 1 + 0.5 * 1 = 1.5
    # seq 1: V_c = 0.5, r_c = -1: delta_c = -1.5 -> A_c = -1.5 (no bleed from the next sequence)
    rewards = torch.tensor([0.0, 0.0, 3.0, 0.0, -1.0, 0.0])
    values = torch.tensor([7.0, 1.0, 2.0, 7.0, 0.5, 7.0])
    mask = torch.tensor([False, True, True, False, True, False])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    adv, ret = gae(rewards, values, mask, cu, gamma=1.0, lam=0.5)
    close(adv, torch.tensor([0.0, 1.5, 1.0, 0.0, -1.5, 0.0]))
    close(ret, torch.tensor([0.0, 2.5, 3.0, 0.0, -1.0, 0.0]))


def test_gae_lambda_one_equals_returns_minus_values():
    cu, mask, g = random_packed(3)
    rewards, values = torch.randn(mask.numel(), generator=g), torch.randn(mask.numel(), generator=g)
    adv, ret = gae(rewards, values, mask, cu, gamma=0.9, lam=1.0)
    expected = discounted_returns(rewards, mask, cu, gamma=0.9)
    close(ret, expected)
    close(adv, (expected - values) * mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)])
def test_gae_and_returns_match_naive_loop(seed, holes, gamma, lam):
    cu, mask, g = random_packed(seed, holes=holes)
    rewards, values = torch.randn(mask.numel(), generator=g), torch.randn(mask.numel(), generator=g)
    adv, ret = gae(rewards, values, mask, cu, gamma=gamma, lam=lam)
    ref_adv, ref_ret = naive_gae(rewards, values, mask, cu, gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)
    close(discounted_returns(rewards, mask, cu, gamma=gamma), naive_returns(rewards, mask, cu, gamma))


def test_gae_long_sequences_cross_blocks():
    # Responses longer than the internal block (64) and several blocks long, float64 inputs.
    cu, mask, g = random_packed(7, num_seqs=4, max_len=400, padding=0)
    rewards = torch.randn(mask.numel(), generator=g, dtype=torch.float64)
    values = torch.randn(mask.numel(), generator=g, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, cu, gamma=0.999, lam=0.97)
    assert adv.dtype == torch.float64
    ref_adv, ref_ret = naive_gae(rewards, values, mask, cu, 0.999, 0.97)
    close(adv, ref_adv, tol=1e-10)
    close(ret, ref_ret, tol=1e-10)


@pytest.mark.parametrize("length", [1, 5, 64, 65, 128, 300])
def test_reverse_discounted_cumsum_matches_loop(length):
    x = torch.randn(3, length, dtype=torch.float64)
    for discount in (0.0, 0.3, 0.97, 1.0):
        expected = torch.zeros_like(x)
        running = torch.zeros(3, dtype=torch.float64)
        for t in reversed(range(length)):
            running = x[:, t] + discount * running
            expected[:, t] = running
        close(reverse_discounted_cumsum(x, discount), expected, tol=1e-10)


def test_gae_bf16_inputs_and_no_grad_to_values():
    cu, mask, g = random_packed(4)
    rewards = torch.randn(mask.numel(), generator=g).bfloat16()
    values = torch.randn(mask.numel(), generator=g).requires_grad_()
    adv, ret = gae(rewards, values, mask, cu, gamma=1.0, lam=0.95)
    assert adv.dtype == torch.float32 and not adv.requires_grad and not ret.requires_grad


# ---------------------------------------------------------------------------------------------------------------
# KL


def test_kl_estimators_hand_derived():
    logprobs = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.4)])
    # log_ratio = [log 2, log 0.5]; k1 = log_ratio; k2 = log_ratio**2 / 2; k3 = ref/p - 1 - log(ref/p)
    log2 = math.log(2.0)
    close(kl_estimate(logprobs, ref, estimator="k1"), torch.tensor([log2, -log2]))
    close(kl_estimate(logprobs, ref, estimator="k2"), torch.tensor([log2**2 / 2, log2**2 / 2]))
    close(kl_estimate(logprobs, ref, estimator="k3"), torch.tensor([0.5 - 1 + log2, 2.0 - 1 - log2]))


def test_kl_estimators_are_unbiased_or_not_as_documented():
    # Monte Carlo over a categorical: k1 and k3 are unbiased for KL(p || q); k2 is not (but close for near p, q).
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(8, generator=g), 0)
    q = torch.softmax(torch.randn(8, generator=g) * 0.3 + p.log(), 0)
    true_kl = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 400_000, replacement=True, generator=g)
    lp, lq = p.log()[samples], q.log()[samples]
    for estimator in ("k1", "k3"):
        assert abs(float(kl_estimate(lp, lq, estimator=estimator, clamp=None).mean()) - true_kl) < 3e-3
    assert float(kl_estimate(lp, lq, estimator="k3").min()) >= 0
    assert float(kl_estimate(lp, lq, estimator="k2").min()) >= 0


def test_kl_k3_clamp_keeps_values_and_gradients_finite():
    logprobs = torch.tensor([-200.0, 0.0, -1.0, 50.0], requires_grad=True)
    ref = torch.tensor([0.0, -200.0, -1.5, 0.0])
    kl = kl_estimate(logprobs, ref, estimator="k3", clamp=10.0)
    assert torch.isfinite(kl).all() and float(kl.detach().max()) <= 10.0
    kl.sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    # Inside the clamp range the value is exact: log_ratio 0.5 -> exp(-0.5) - 1 + 0.5
    close(kl[2:3].detach(), torch.tensor([math.exp(-0.5) - 0.5]))
    # A diverging ratio is clamped, and gradient there is 0.
    assert float(kl[0].detach()) == 10.0 and float(logprobs.grad[0]) == 0.0


def test_kl_estimate_bad_input():
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        kl_estimate(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="estimator='k4'"):
        kl_estimate(torch.zeros(3), torch.zeros(3), estimator="k4")
    with pytest.raises(ValueError, match="clamp=0"):
        kl_estimate(torch.zeros(3), torch.zeros(3), clamp=0)


def test_kl_shaped_rewards_hand_derived():
    # seq 0 = [p, a, b], seq 1 = [p, p, c], padding. Reward goes to the last loss token; -coef*kl on every loss token.
    kl = torch.tensor([5.0, 1.0, 2.0, 5.0, 5.0, -1.0, 5.0])
    mask = torch.tensor([False, True, True, False, False, True, False])
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    out = kl_shaped_rewards(torch.tensor([10.0, 20.0]), kl, mask, cu, kl_coef=0.1)
    close(out, torch.tensor([0.0, -0.1, 10.0 - 0.2, 0.0, 0.0, 20.0 + 0.1, 0.0]))


def test_kl_shaped_rewards_random_against_loop_with_holes():
    cu, mask, g = random_packed(5, holes=True)
    kl = torch.randn(mask.numel(), generator=g)
    seq_rewards = torch.randn(len(cu) - 1, generator=g)
    out = kl_shaped_rewards(seq_rewards, kl, mask, cu, kl_coef=0.05)
    expected = torch.zeros(mask.numel(), dtype=torch.float64)
    for i, positions in enumerate(naive_segments(mask, cu)):
        for t in positions:
            expected[t] = -0.05 * float(kl[t])
        expected[positions[-1]] += float(seq_rewards[i])
    close(out, expected)


def test_kl_controllers():
    fixed = FixedKLController(value=0.1)
    assert fixed.update(5.0, 100) == 0.1
    adaptive = AdaptiveKLController(value=0.2, target=6.0, horizon=10_000)
    # KL 9 vs target 6: error = clip(0.5, +-0.2) = 0.2 -> value *= 1 + 0.2 * 256 / 10000
    assert adaptive.update(9.0, 256) == pytest.approx(0.2 * (1 + 0.2 * 256 / 10_000))
    # KL 5.4 vs 6: error = -0.1
    before = adaptive.value
    assert adaptive.update(5.4, 1000) == pytest.approx(before * (1 - 0.1 * 1000 / 10_000))
    state = adaptive.state_dict()
    restored = AdaptiveKLController(value=1.0, target=1.0, horizon=1.0)
    restored.load_state_dict(state)
    assert restored == adaptive
    with pytest.raises(ValueError, match="target=0"):
        AdaptiveKLController(value=0.1, target=0, horizon=1)
    with pytest.raises(ValueError, match="current_kl=nan"):
        adaptive.update(float("nan"), 1)
    with pytest.raises(ValueError, match="FixedKLController.value=-1"):
        FixedKLController(value=-1)


# ---------------------------------------------------------------------------------------------------------------
# Group estimators


def test_grpo_rloo_baseline_hand_derived():
    # groups: 7 -> samples 0, 2 (rewards 1, 3); 4 -> samples 1, 3, 4 (rewards 0, 0, 6); non-contiguous.
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.0, 6.0])
    groups = torch.tensor([7, 4, 7, 4, 4])
    # group 7: mean 2, unbiased std sqrt(2); group 4: mean 2, std sqrt((4 + 4 + 16) / 2) = sqrt(12)
    s7, s4 = math.sqrt(2.0), math.sqrt(12.0)
    close(grpo_advantages(rewards, groups, eps=1e-6),
          torch.tensor([-1 / (s7 + 1e-6), -2 / (s4 + 1e-6), 1 / (s7 + 1e-6), -2 / (s4 + 1e-6), 4 / (s4 + 1e-6)]))
    close(grpo_advantages(rewards, groups, scale_by_std=False), torch.tensor([-1.0, -2.0, 1.0, -2.0, 4.0]))
    close(reinforce_baseline_advantages(rewards, groups), torch.tensor([-1.0, -2.0, 1.0, -2.0, 4.0]))
    # RLOO: 1 - 3, 0 - (0 + 6)/2, 3 - 1, 0 - 3, 6 - 0
    close(rloo_advantages(rewards, groups), torch.tensor([-2.0, -3.0, 2.0, -3.0, 6.0]))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_group_estimators_match_naive_and_are_permutation_invariant(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 6, (7,), generator=g)  # ragged groups
    groups = torch.repeat_interleave(torch.randperm(100, generator=g)[:7], sizes)
    rewards = torch.randn(groups.numel(), generator=g) * 3
    results = {
        "grpo": (grpo_advantages(rewards, groups), naive_grpo(rewards, groups)),
        "dr_grpo": (grpo_advantages(rewards, groups, scale_by_std=False), naive_grpo(rewards, groups, False)),
        "rloo": (rloo_advantages(rewards, groups), naive_rloo(rewards, groups)),
        "baseline": (reinforce_baseline_advantages(rewards, groups), naive_grpo(rewards, groups, False)),
    }
    for name, (got, expected) in results.items():
        close(got, expected)
    # Permute samples (which also permutes the order in which groups appear) and relabel groups.
    perm = torch.randperm(groups.numel(), generator=g)
    relabel = {int(x): int(y) for x, y in zip(groups.unique(), torch.randperm(1000, generator=g)[:7])}
    new_groups = torch.tensor([relabel[int(x)] for x in groups[perm]])
    permuted = {
        "grpo": grpo_advantages(rewards[perm], new_groups),
        "dr_grpo": grpo_advantages(rewards[perm], new_groups, scale_by_std=False),
        "rloo": rloo_advantages(rewards[perm], new_groups),
        "baseline": reinforce_baseline_advantages(rewards[perm], new_groups),
    }
    for name, got in permuted.items():
        close(got, results[name][0][perm])


def test_grpo_singleton_group_is_zero_and_rloo_names_the_group():
    rewards = torch.tensor([1.0, 2.0, 5.0])
    groups = torch.tensor([0, 0, 3])
    assert float(grpo_advantages(rewards, groups)[2]) == 0.0
    with pytest.raises(ValueError, match=r"group 3 \(sample index 2\) has 1 sample"):
        rloo_advantages(rewards, groups)


@pytest.mark.parametrize("fn", [grpo_advantages, rloo_advantages, reinforce_baseline_advantages])
def test_group_estimators_bad_input(fn):
    with pytest.raises(ValueError, match="rewards is not finite at sample index 2"):
        fn(torch.tensor([1.0, 2.0, float("nan"), 1.0]), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="rewards is not finite at sample index 0"):
        fn(torch.tensor([float("inf"), 2.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"group_ids has shape \(3,\); expected \(4,\)"):
        fn(torch.zeros(4), torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        fn(torch.zeros(2), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        fn(torch.zeros(2, 2), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="rewards is empty"):
        fn(torch.zeros(0), torch.zeros(0, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------------------
# Whitening and broadcasting


def test_whiten_matches_naive_and_ignores_masked_entries():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=g) * 4 + 3
    mask = torch.rand(50, generator=g) > 0.3
    selected = [float(v) for v, m in zip(x, mask) if m]
    mean = sum(selected) / len(selected)
    var = sum((v - mean) ** 2 for v in selected) / len(selected)
    expected = torch.tensor([(float(v) - mean) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(x, mask)])
    close(whiten(x, mask), expected)
    close(whiten(x, mask, shift_mean=False), torch.where(mask, expected + mean, 0.0))
    x_changed = torch.where(mask, x, torch.full_like(x, 1e6))
    close(whiten(x_changed, mask), expected)


def test_whiten_hand_derived_and_edge_cases():
    x = torch.tensor([1.0, 3.0, 100.0])
    mask = torch.tensor([True, True, False])
    # mean 2, biased var 1 -> [-1, 1]
    close(whiten(x, mask, eps=1e-12), torch.tensor([-1.0, 1.0, 0.0]))
    close(whiten(x, torch.tensor([False, True, False])), torch.zeros(3))  # one entry: variance 0 -> 0
    with pytest.raises(ValueError, match="mask selects no entry"):
        whiten(x, torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool tensor of the shape of values"):
        whiten(x, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="values is not finite at token index 1"):
        whiten(torch.tensor([1.0, float("nan")]), torch.tensor([True, True]))


def test_whiten_gradient_matches_autograd_of_naive():
    x = torch.randn(20, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(20) % 3 != 0
    weights = torch.randn(20, dtype=torch.float64)
    (whiten(x, mask) * weights).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    sel = x[mask]
    naive = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=False) + 1e-8)
    (naive * weights[mask]).sum().backward()
    close(grad, x.grad, tol=1e-10)


def test_broadcast_to_tokens_hand_derived():
    mask = torch.tensor([False, True, True, False, True, False])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    close(broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask, cu), torch.tensor([0.0, 2.0, 2.0, 0.0, -1.0, 0.0]))
    with pytest.raises(ValueError, match="seq_values has 3 entries but cu_seqlens describes 2"):
        broadcast_to_tokens(torch.zeros(3), mask, cu)


def test_grpo_with_kl_free_shaping_and_gamma_one_equals_broadcast():
    cu, mask, g = random_packed(9, holes=True)
    groups = torch.tensor([0, 1, 0, 1, 2, 2])
    adv = grpo_advantages(torch.randn(6, generator=g), groups)
    shaped = kl_shaped_rewards(adv, torch.zeros(mask.numel()), mask, cu, kl_coef=0.0)
    close(discounted_returns(shaped, mask, cu, gamma=1.0), broadcast_to_tokens(adv, mask, cu))


# ---------------------------------------------------------------------------------------------------------------
# Bad token-level input


def test_token_functions_bad_input():
    mask = torch.tensor([False, True, True])
    cu = torch.tensor([0, 3], dtype=torch.int32)
    r = torch.zeros(3)
    with pytest.raises(ValueError, match=r"values has shape \(4,\) but token_rewards has shape \(3,\)"):
        gae(r, torch.zeros(4), mask, cu, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        discounted_returns(r, mask.float(), cu, gamma=1.0)
    with pytest.raises(ValueError, match=r"mask has shape \(2,\); expected \(3,\)"):
        discounted_returns(r, mask[:2], cu, gamma=1.0)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\]=5 exceeds the 3 tokens"):
        discounted_returns(r, mask, torch.tensor([0, 5], dtype=torch.int32), gamma=1.0)
    with pytest.raises(ValueError, match="sequence 0 has length 0"):
        discounted_returns(r, mask, torch.tensor([0, 0, 3], dtype=torch.int32), gamma=1.0)
    with pytest.raises(ValueError, match="mask is True on padding tokens"):
        discounted_returns(r, mask, torch.tensor([0, 2], dtype=torch.int32), gamma=1.0)
    with pytest.raises(ValueError, match="token_rewards is not finite at token index 2"):
        discounted_returns(torch.tensor([0.0, 1.0, float("inf")]), mask, cu, gamma=1.0)
    # NaN outside the mask is fine (prompt tokens carry no reward)
    discounted_returns(torch.tensor([float("nan"), 0.0, 1.0]), mask, cu, gamma=1.0)
    with pytest.raises(ValueError, match="gamma=1.5"):
        discounted_returns(r, mask, cu, gamma=1.5)
    with pytest.raises(ValueError, match="lam=-0.1"):
        gae(r, r, mask, cu, gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match="kl_coef=-1"):
        kl_shaped_rewards(torch.zeros(1), r, mask, cu, kl_coef=-1)
    with pytest.raises(ValueError, match="seq_rewards has 2 entries but cu_seqlens describes 1"):
        kl_shaped_rewards(torch.zeros(2), r, mask, cu, kl_coef=0.1)


@pytest.mark.gpu
def test_gae_on_cuda_matches_naive_loop_even_with_tf32():
    cu, mask, g = random_packed(12, num_seqs=32, max_len=600, padding=5, holes=True)
    rewards, values = torch.randn(mask.numel(), generator=g), torch.randn(mask.numel(), generator=g)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the scan runs in float64, so TF32 must not cost precision
    try:
        adv, ret = gae(rewards.cuda(), values.cuda(), mask.cuda(), cu.cuda(), gamma=0.99, lam=0.95)
        returns = discounted_returns(rewards.cuda(), mask.cuda(), cu.cuda(), gamma=0.99)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert adv.is_cuda
    ref_adv, ref_ret = naive_gae(rewards, values, mask, cu, 0.99, 0.95)
    close(adv.cpu(), ref_adv)
    close(ret.cpu(), ref_ret)
    close(returns.cpu(), naive_returns(rewards, mask, cu, 0.99))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_masked_out_nan_does_not_poison_the_gradient(shift_mean):
    """Review defect: a NaN (or inf) outside the mask was ignored by whiten's forward but made every gradient entry
    NaN; the gradient now equals that of the same values with the masked-out entries set to 0, and is 0 there."""
    mask = torch.arange(12) % 4 != 0
    weights = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    clean = torch.randn(12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    clean[~mask] = 0.0
    dirty = clean.clone()
    dirty[0], dirty[4], dirty[8] = math.nan, math.inf, -math.inf
    grads = []
    for values in (clean, dirty):
        leaf = values.clone().requires_grad_()
        out = whiten(leaf, mask, shift_mean=shift_mean)
        (out * weights).sum().backward()
        grads.append(leaf.grad)
        close(out, whiten(clean, mask, shift_mean=shift_mean), tol=1e-12)
    assert torch.isfinite(grads[1]).all(), grads[1]
    close(grads[1], grads[0], tol=1e-12)
    assert (grads[1][~mask] == 0).all() and grads[1][mask].abs().sum() > 0


def test_advantage_results_that_overflow_raise_instead_of_flowing_on():
    """Sibling of the policy_loss -inf defect (review): huge finite rewards made whiten return all zeros (or NaN),
    kl_shaped_rewards -inf and rloo_advantages inf, silently; each now raises naming the overflow and the fix."""
    mask = torch.tensor([False, True, True, True])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"whiten: the variance of values overflowed torch\.float32 \(max \|values\| "
                                         r"on the mask = 1e\+20\)"):
        whiten(torch.tensor([0.0, 1e20, -1e20, 5.0]), mask)
    with pytest.raises(ValueError, match=r"kl_shaped_rewards overflowed torch\.float32 .* -inf at token index 1.*"
                                         r"Lower kl_coef"):
        kl_shaped_rewards(torch.tensor([0.0]), torch.full((4,), 3e38), mask, cu, kl_coef=2.0)
    with pytest.raises(ValueError, match=r"rloo_advantages overflowed torch\.float32.* inf at sample index 0"):
        rloo_advantages(torch.tensor([3e38, -3e38, 1.0, 2.0]), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"discounted_returns overflowed"):
        discounted_returns(torch.tensor([0.0, 3e38, 3e38, 3e38]), mask, cu, gamma=1.0)
    with pytest.raises(ValueError, match=r"gae advantages overflowed"):
        gae(torch.tensor([0.0, 3e38, 3e38, 3e38]), torch.zeros(4), mask, cu, gamma=1.0, lam=1.0)
    close(whiten(torch.tensor([0.0, 1e18, -1e18, 0.0]), mask), torch.tensor([0.0, 1.2247, -1.2247, 0.0]), tol=1e-4)
