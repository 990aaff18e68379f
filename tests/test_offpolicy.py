"""Off-policy corrections (rlhfkit.losses._offpolicy): importance weights, masks and mismatch statistics.

Hand-derived values on a 2-sequence packed example for every level and mode, equivalence with policy_loss's
``mismatch=`` options (and with a frozen copy of the code they replaced), NaN outside the mask, identical policies,
constant weights, micro-batch invariance and the errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.losses import MAX_LOG_RATIO, importance_weights, mismatch_stats, policy_loss
from rlhfkit.packing import pack_sequences

# Two sequences of 3 and 4 tokens plus one padding token; loss tokens 1, 2 and 4, 5, 6.
CU = torch.tensor([0, 3, 7], dtype=torch.int32)
MASK = torch.tensor([False, True, True, False, True, True, True, False])
# target / behaviour ratio of each loss token: sequence 0: 3, 0.25 (product 0.75); sequence 1: 1, 1.5, 1.6 (2.4).
RATIOS = [1.0, 3.0, 0.25, 1.0, 1.0, 1.5, 1.6, 1.0]
SEQ0, SEQ1 = [1, 2], [4, 5, 6]


def _example(dtype=torch.float64):
    behaviour = torch.full((8,), -3.0, dtype=dtype)
    target = behaviour + torch.tensor(RATIOS, dtype=dtype).log()
    return target, behaviour


def _expected(per_token: dict[int, float]) -> torch.Tensor:
    out = torch.ones(8, dtype=torch.float64)
    for index, value in per_token.items():
        out[index] = value
    return out


G0, G1 = math.sqrt(0.75), 2.4 ** (1 / 3)  # geometric-mean ratios of the two sequences
CASES = [  # (level, mode, low, high, expected weights on loss tokens, affected tokens)
    ("token", "truncate", None, 2.0, {1: 2.0, 2: 0.25, 4: 1.0, 5: 1.5, 6: 1.6}, [1]),
    ("token", "mask", None, 2.0, {1: 0.0, 2: 0.0}, [1, 2]),
    ("token", "mask", 0.2, 2.5, {1: 0.0}, [1]),
    ("sequence", "truncate", None, 2.0, {1: 0.75, 2: 0.75, 4: 2.0, 5: 2.0, 6: 2.0}, SEQ1),
    ("sequence", "mask", None, 2.0, {4: 0.0, 5: 0.0, 6: 0.0}, SEQ1),
    ("geometric", "truncate", None, 2.0, {1: G0, 2: G0, 4: G1, 5: G1, 6: G1}, []),
    ("geometric", "truncate", None, 1.2, {1: G0, 2: G0, 4: 1.2, 5: 1.2, 6: 1.2}, SEQ1),
    ("geometric", "mask", None, 1.2, {4: 0.0, 5: 0.0, 6: 0.0}, SEQ1),       # low = 1/1.2 < G0 = 0.866
    ("geometric", "mask", 0.9, 1.5, {1: 0.0, 2: 0.0}, SEQ0),                 # G0 < 0.9; G1 = 1.339 inside
]


@pytest.mark.parametrize("level, mode, low, high, weights, affected", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}" for c in CASES])
def test_hand_derived_weights(level, mode, low, high, weights, affected):
    target, behaviour = _example()
    got, got_affected = importance_weights(target, behaviour, MASK, CU, level=level, mode=mode, low=low, high=high)
    torch.testing.assert_close(got, _expected(weights), rtol=1e-12, atol=1e-12)
    assert got_affected.dtype == torch.bool and got_affected.nonzero().flatten().tolist() == affected
    assert got[~MASK].eq(1).all()  # padding, prompts and the padding tail: weight exactly 1


def test_hand_derived_mismatch_stats():
    target, behaviour = _example()
    stats = mismatch_stats(target, behaviour, MASK, CU, threshold=2.0)
    ratios = [3.0, 0.25, 1.0, 1.5, 1.6]
    expected = {
        "kl": sum(r - 1 - math.log(r) for r in ratios) / 5,
        "log_ratio_mean": math.log(0.75 * 2.4) / 5,
        "ratio_mean": 1.47, "ratio_min": 0.25, "ratio_max": 3.0,
        "abs_log_ratio_max": math.log(4.0),
        "seq_abs_log_ratio_max_mean": (math.log(4.0) + math.log(1.6)) / 2,
        "geometric_ratio_min": G0, "geometric_ratio_max": G1,
        "outside_fraction": 2 / 5,  # 3 and 0.25 are outside [0.5, 2]
        "num_loss_tokens": 5.0, "num_seqs": 2.0,
    }
    assert stats == pytest.approx(expected, rel=1e-12)


def test_identical_policies_give_weights_one_and_zero_stats():
    target, _ = _example()
    for level in ("token", "sequence", "geometric"):
        for mode in ("truncate", "mask"):
            weights, affected = importance_weights(target, target.clone(), MASK, CU, level=level, mode=mode)
            assert weights.eq(1).all() and not affected.any(), (level, mode)
    stats = mismatch_stats(target, target.clone(), MASK, CU)
    for name in ("kl", "log_ratio_mean", "abs_log_ratio_max", "seq_abs_log_ratio_max_mean", "outside_fraction"):
        assert stats[name] == 0.0, name
    for name in ("ratio_mean", "ratio_min", "ratio_max", "geometric_ratio_min", "geometric_ratio_max"):
        assert stats[name] == 1.0, name


def test_nan_outside_the_mask_never_leaks_into_weights_stats_or_gradients():
    """Defect guarded: a NaN on a prompt or padding token reaching a weight, a stat or a gradient."""
    target, behaviour = _example()
    clean_stats = mismatch_stats(target, behaviour, MASK, CU)
    dirty_target, dirty_behaviour = target.clone(), behaviour.clone()
    dirty_target[~MASK], dirty_behaviour[~MASK] = math.nan, math.inf
    dirty_target.requires_grad_()
    for level, mode, low, high, _, _ in CASES:
        want = importance_weights(target, behaviour, MASK, CU, level=level, mode=mode, low=low, high=high)
        got = importance_weights(dirty_target, dirty_behaviour, MASK, CU, level=level, mode=mode, low=low, high=high)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert not got[0].requires_grad  # constants: no graph back to the inputs
        loss = torch.where(MASK, got[0] * dirty_target, torch.zeros(())).sum()
        (grad,) = torch.autograd.grad(loss, dirty_target)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad, torch.where(MASK, want[0], torch.zeros(())))
    assert mismatch_stats(dirty_target, dirty_behaviour, MASK, CU) == pytest.approx(clean_stats, rel=1e-12)


def test_weights_are_constants_gradient_flows_only_through_what_they_multiply():
    target, behaviour = _example()
    target = target.clone().requires_grad_()
    behaviour = behaviour.clone().requires_grad_()
    weights, _ = importance_weights(target, behaviour, MASK, CU, level="sequence", mode="truncate", high=2.0)
    assert not weights.requires_grad and weights.grad_fn is None
    logprobs = (target.detach() - 0.1).requires_grad_()  # the current policy's log-probs
    (weights * logprobs).sum().backward()
    assert torch.equal(logprobs.grad, weights) and target.grad is None and behaviour.grad is None


def test_log_ratios_are_clamped_like_the_losses():
    target = torch.tensor([0.0, 0.0, -100.0, -200.0], dtype=torch.float64)
    behaviour = torch.tensor([0.0, -100.0, 0.0, -200.0], dtype=torch.float64)
    mask, cu = torch.tensor([False, True, True, False]), torch.tensor([0, 4])
    weights, affected = importance_weights(target, behaviour, mask, cu, mode="mask", high=2.0)
    assert weights.tolist() == [1.0, 0.0, 0.0, 1.0] and affected.tolist() == [False, True, True, False]
    stats = mismatch_stats(target, behaviour, mask, cu)
    assert stats["ratio_max"] == pytest.approx(math.exp(MAX_LOG_RATIO))
    assert stats["ratio_min"] == pytest.approx(math.exp(-MAX_LOG_RATIO))
    assert stats["abs_log_ratio_max"] == MAX_LOG_RATIO and all(math.isfinite(v) for v in stats.values())
    # the sequence product is clamped too: 10 tokens of log-ratio 5 give exp(20), not exp(50)
    long_target, long_behaviour = torch.zeros(11), torch.full((11,), -5.0)
    long_mask = torch.arange(11) > 0
    weights, _ = importance_weights(long_target, long_behaviour, long_mask, torch.tensor([0, 11]), level="sequence",
                                    high=1e9)
    assert weights[1].item() == pytest.approx(math.exp(MAX_LOG_RATIO), rel=1e-5)


def test_low_precision_inputs_give_float32_weights():
    target, behaviour = _example(torch.bfloat16)
    weights, _ = importance_weights(target, behaviour, MASK, CU)
    assert weights.dtype == torch.float32


def test_empty_mask_gives_weights_one_and_nan_stats():
    target, behaviour = _example()
    empty = torch.zeros(8, dtype=torch.bool)
    weights, affected = importance_weights(target, behaviour, empty, CU, level="geometric", mode="mask")
    assert weights.eq(1).all() and not affected.any()
    stats = mismatch_stats(target, behaviour, empty, CU)
    assert math.isnan(stats["kl"]) and math.isnan(stats["seq_abs_log_ratio_max_mean"])
    assert stats["num_loss_tokens"] == 0 and stats["num_seqs"] == 0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_weights_of_a_micro_batch_of_whole_sequences_equal_the_whole_batch(level):
    target, behaviour = _example()
    whole, _ = importance_weights(target, behaviour, MASK, CU, level=level, high=1.2)
    first, _ = importance_weights(target[:3], behaviour[:3], MASK[:3], CU[:2], level=level, high=1.2)
    second, _ = importance_weights(target[3:], behaviour[3:], MASK[3:], CU[1:] - 3, level=level, high=1.2)
    assert torch.equal(torch.cat([first, second]), whole)


# ------------------------------------------------------------------------------- policy_loss equivalence


def _frozen_mismatch_weights(old, engine, mask, cu, mismatch, threshold):
    """policy_loss's private ``_mismatch_weights`` before it moved here (commit 9a8326d), verbatim but inlined."""
    log_ratio = torch.where(mask, old - engine, torch.zeros_like(old)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    if mismatch == "tis":
        return ratio.clamp(max=threshold), (ratio > threshold) & mask
    if mismatch == "token_mask":
        outside = (ratio > threshold) | (ratio < 1 / threshold)
    else:
        masked = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
        seq_ids = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu[1:] - cu[:-1])
        end = int(cu[-1])
        sums = masked.new_zeros(cu.numel() - 1).index_add(0, seq_ids, masked[:end])
        counts = mask.to(old.dtype).new_zeros(cu.numel() - 1).index_add(0, seq_ids, mask[:end].to(old.dtype))
        per_token = masked.new_zeros(old.shape[0])
        per_token[:end] = torch.repeat_interleave(sums / counts.clamp(min=1), cu[1:] - cu[:-1])
        seq_ratio = torch.exp(per_token)
        outside = (seq_ratio > threshold) | (seq_ratio < 1 / threshold)
    return (~outside).to(old.dtype), outside & mask


MISMATCH = [("tis", "token", "truncate", 1.5), ("token_mask", "token", "mask", 1.3),
            ("seq_mask", "geometric", "mask", 1.1)]


def _random_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (7,), generator=gen).tolist()
    masks = [torch.arange(n) >= int(torch.randint(1, n, (1,), generator=gen)) for n in lengths]
    batch = pack_sequences([torch.randint(0, 40, (n,), generator=gen) for n in lengths], loss_masks=masks,
                           pad_to_multiple_of=8)
    noise = [torch.randn(batch.num_tokens, generator=gen, dtype=torch.float64) for _ in range(4)]
    logprobs = -noise[0].abs() - 0.3
    old = (logprobs + 0.4 * noise[1]).clamp(max=0.0)
    engine = (old + 0.3 * noise[2]).clamp(max=0.0)
    return batch, logprobs, old, engine, noise[3]


@pytest.mark.parametrize("mismatch, level, mode, threshold", MISMATCH, ids=[m[0] for m in MISMATCH])
def test_policy_loss_mismatch_is_importance_weights(mismatch, level, mode, threshold):
    """policy_loss(mismatch=...) = the frozen old weights = importance_weights: loss, gradient and stats."""
    batch, logprobs, old, engine, advantages = _random_batch(3)
    mask, cu = batch.loss_mask, batch.cu_seqlens
    low = None if mode == "truncate" else 1 / threshold
    weights, affected = importance_weights(old, engine, mask, cu, level=level, mode=mode, low=low, high=threshold)
    frozen, frozen_affected = _frozen_mismatch_weights(old, engine, mask, cu.long(), mismatch, threshold)
    assert torch.equal(weights[mask], frozen[mask]) and torch.equal(affected, frozen_affected)
    assert 0 < int(affected.sum()) < int(mask.sum())  # the case exercises both kinds of token

    for aggregation in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        lp = logprobs.clone().requires_grad_()
        loss, stats = policy_loss(lp, old, advantages, mask, cu, engine_logprobs=engine, mismatch=mismatch,
                                  mismatch_threshold=threshold, aggregation=aggregation, dual_clip=3.0)
        (grad,) = torch.autograd.grad(loss, lp)
        lp_ref = logprobs.clone().requires_grad_()
        # weights >= 0 commute with PPO's max and the dual clip: weighting the advantages is the same loss
        ref, _ = policy_loss(lp_ref, old, advantages * frozen, mask, cu, aggregation=aggregation, dual_clip=3.0)
        (ref_grad,) = torch.autograd.grad(ref, lp_ref)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)

    reported = mismatch_stats(old, engine, mask, cu)
    for name in ("kl", "ratio_mean", "ratio_min", "ratio_max"):
        assert stats[f"mismatch_{name}"] == reported[name], name
    assert stats["mismatch_affected_fraction"] == pytest.approx(int(affected.sum()) / int(mask.sum()), rel=1e-12)
    if mismatch == "token_mask":
        assert stats["mismatch_affected_fraction"] == pytest.approx(
            mismatch_stats(old, engine, mask, cu, threshold=threshold)["outside_fraction"], rel=1e-12)


def test_policy_loss_keeps_its_mismatch_stat_names():
    batch, logprobs, old, engine, advantages = _random_batch(4)
    _, stats = policy_loss(logprobs, old, advantages, batch.loss_mask, batch.cu_seqlens, engine_logprobs=engine)
    assert {name for name in stats if name.startswith("mismatch_")} == {
        "mismatch_kl", "mismatch_ratio_mean", "mismatch_ratio_min", "mismatch_ratio_max", "mismatch_affected_fraction"}
    assert stats["mismatch_affected_fraction"] == 0.0  # mismatch="none" only reports


# ------------------------------------------------------------------------------- errors


def test_each_error_names_its_argument():
    target, behaviour = _example()
    for kwargs, error, message in [
        ({"level": "seq"}, ValueError, "level='seq'"),
        ({"mode": "clip"}, ValueError, "mode='clip'"),
        ({"high": 1.0}, ValueError, "high=1.0"),
        ({"high": math.inf}, ValueError, "high=inf"),
        ({"high": True}, TypeError, "high must be a float"),
        ({"mode": "mask", "low": 1.0}, ValueError, "low=1.0"),
        ({"mode": "mask", "low": 0.0}, ValueError, "low=0.0"),
        ({"mode": "truncate", "low": 0.5}, ValueError, "low=0.5 applies to mode='mask' only"),
    ]:
        with pytest.raises(error, match=message):
            importance_weights(target, behaviour, MASK, CU, **kwargs)
    with pytest.raises(ValueError, match="threshold=0.5"):
        mismatch_stats(target, behaviour, MASK, CU, threshold=0.5)
    for call in (importance_weights, mismatch_stats):
        with pytest.raises(TypeError, match="target_logprobs must be"):
            call(None, behaviour, MASK, CU)
        with pytest.raises(TypeError, match="behaviour_logprobs must be"):
            call(target, behaviour.tolist(), MASK, CU)
        with pytest.raises(ValueError, match="behaviour_logprobs has 7 entries"):
            call(target, behaviour[:7], MASK, CU)
        with pytest.raises(ValueError, match=r"target_logprobs must be a \[T\] floating tensor"):
            call(target[None], behaviour, MASK, CU)
        with pytest.raises(ValueError, match=r"mask must be a \[T\] bool tensor"):
            call(target, behaviour, MASK.float(), CU)
        with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
            call(target, behaviour, MASK, CU + 1)
        with pytest.raises(ValueError, match="cu_seqlens.* exceeds"):
            call(target, behaviour, MASK, torch.tensor([0, 9]))
        with pytest.raises(ValueError, match="mask is True on the first token of sequence 1"):
            call(target, behaviour, MASK | (torch.arange(8) == 3), CU)
        positive = behaviour.clone()
        positive[5] = 0.5
        with pytest.raises(ValueError, match="behaviour_logprobs is 0.5 > 0 at sequence 1"):
            call(target, positive, MASK, CU)
        nan = target.clone()
        nan[4] = math.nan
        with pytest.raises(ValueError, match="target_logprobs contain NaN or inf on loss tokens"):
            call(nan, behaviour, MASK, CU)


def test_mismatch_stats_by_token_staleness_hand_derived():
    """Issue 21 item 1: the off-policy metrics read each token's own weight version (a sample continued after an
    in-flight update spans versions: sequence 1 here)."""
    target, behaviour = _example()
    versions = torch.tensor([9, 0, 0, 9, 1, 1, 2, 9])  # outside the mask: ignored
    stats = mismatch_stats(target, behaviour, MASK, CU, weight_versions=versions, trainer_version=2)

    def k3(r):
        return r - 1 - math.log(r)

    expected = {"staleness_mean": 6 / 5, "staleness_max": 2.0,
                "kl_staleness_0": k3(1.6), "tokens_staleness_0": 1.0,
                "kl_staleness_1": (k3(1.0) + k3(1.5)) / 2, "tokens_staleness_1": 2.0,
                "kl_staleness_2": (k3(3.0) + k3(0.25)) / 2, "tokens_staleness_2": 2.0}
    assert {k: stats[k] for k in expected} == pytest.approx(expected, rel=1e-12)
    assert stats["kl"] == pytest.approx(mismatch_stats(target, behaviour, MASK, CU)["kl"], rel=1e-12)
    with pytest.raises(ValueError, match=r"weight_versions\[6\]=2 is newer than trainer_version=1"):
        mismatch_stats(target, behaviour, MASK, CU, weight_versions=versions, trainer_version=1)
    with pytest.raises(ValueError, match="trainer_version=None"):
        mismatch_stats(target, behaviour, MASK, CU, weight_versions=versions)
    with pytest.raises(TypeError, match="weight_versions must be a"):
        mismatch_stats(target, behaviour, MASK, CU, weight_versions=versions.float(), trainer_version=2)
