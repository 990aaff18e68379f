"""Experience making: rollouts + rewards + your forward functions → a packed :class:`~rlhfkit.types.Experience`.

:func:`make_experience` packs the rollouts (:func:`rlhfkit.packing.pack_rollouts`), calls the forward functions you
pass — plain callables ``fn(PackedBatch) -> [T]`` for policy log-probs, reference log-probs and critic values, so
this module never sees Ray, DeepSpeed or a model — checks what they return, estimates the KL to the reference, and
computes advantages and returns with the estimator of :class:`ExperienceConfig` (see :mod:`rlhfkit.advantages`).
:func:`iterate_minibatches` shuffles an experience with an explicit seed and splits it by sequence count or by token
budget.

It does not generate, score, or train: rollouts come from :mod:`rlhfkit.engines`, rewards from :mod:`rlhfkit.rewards`
(or your code), losses from :mod:`rlhfkit.losses`. Needs only torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch

from rlhfkit._checks import check_finite
from rlhfkit.advantages import KLEstimator
from rlhfkit._cu_seqlens import token_shape_hint
from rlhfkit.experience._estimators import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    WHITENED_BY_DEFAULT,
    Estimator,
    estimate_advantages,
)
from rlhfkit.advantages import kl_estimate
from rlhfkit.packing import pack_rollouts, partition_by_token_budget, select_sequences
from rlhfkit.types import Experience, PackedBatch, Rollout

__all__ = ["ExperienceConfig", "ForwardFn", "make_experience", "iterate_minibatches",
           "select_experience", "engine_token_logprobs", "token_weight_versions"]

logger = logging.getLogger(__name__)

ForwardFn = Callable[[PackedBatch], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ExperienceConfig:
    """How :func:`make_experience` turns rewards into advantages.

    Attributes:
        estimator: ``"gae"`` (PPO with a critic; needs ``values_fn``), ``"reinforce"``, ``"reinforce++"`` (Hu 2025),
            ``"reinforce++_baseline"``, ``"rloo"`` (Ahmadian et al. 2024), ``"grpo"`` (Shao et al. 2024) or
            ``"dr_grpo"`` (Liu et al. 2025; pair it with ``aggregation="seq_mean_token_sum"`` in the loss).
        gamma: discount over response tokens, in [0, 1].
        lam: GAE lambda, in [0, 1] (``gae`` only).
        kl_coef: weight of the per-token KL penalty in the reward when ``kl_in_reward`` (>= 0). An adaptive
            controller's value can be passed per call as ``make_experience(..., kl_coef=...)``.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` for ``Experience.kl`` (and the reward penalty).
        kl_clamp: clamp of the KL estimate (see :func:`rlhfkit.advantages.kl_estimate`); None disables it.
        kl_in_reward: True shapes the rewards with ``-kl_coef * kl`` (PPO/REINFORCE++ style); False leaves the KL to a
            KL loss (GRPO style; ``Experience.kl`` and ``ref_logprobs`` are still filled when a reference is given).
        whiten_advantages: whiten advantages over all loss tokens of the batch; None means the estimator's default
            (True for ``gae``, ``reinforce++``, ``reinforce++_baseline``; False otherwise). REINFORCE++ is defined
            by this whitening, so False is refused for its two variants.
        reward_clip: clip sequence rewards to ``[-reward_clip, reward_clip]`` first; None disables it.
        normalize_rewards: standardise sequence rewards over the batch (mean 0, std 1) after clipping.
        grpo_eps: added to the group standard deviation (``grpo``).
    """

    estimator: Estimator = "grpo"
    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_clamp: float | None = 10.0
    kl_in_reward: bool = False
    whiten_advantages: bool | None = None
    reward_clip: float | None = None
    normalize_rewards: bool = False
    grpo_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"ExperienceConfig.estimator={self.estimator!r}; expected one of {ESTIMATORS}")
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ExperienceConfig.{name}={getattr(self, name)}; must be in [0, 1]")
        if not self.kl_coef >= 0:
            raise ValueError(f"ExperienceConfig.kl_coef={self.kl_coef}; must be >= 0")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"ExperienceConfig.kl_estimator={self.kl_estimator!r}; expected 'k1', 'k2' or 'k3'")
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ValueError(f"ExperienceConfig.kl_clamp={self.kl_clamp}; must be > 0, or None to disable it")
        if self.whiten_advantages is False and self.estimator in ("reinforce++", "reinforce++_baseline"):
            raise ValueError(f"ExperienceConfig.whiten_advantages=False with estimator={self.estimator!r}: "
                             "REINFORCE++ is defined by global whitening; use estimator='reinforce' for unwhitened "
                             "returns")
        if self.reward_clip is not None and not self.reward_clip > 0:
            raise ValueError(f"ExperienceConfig.reward_clip={self.reward_clip}; must be > 0, or None to disable it")
        if not self.grpo_eps > 0:
            raise ValueError(f"ExperienceConfig.grpo_eps={self.grpo_eps}; must be > 0")

    @property
    def whitens(self) -> bool:
        """Whether advantages are whitened (the explicit setting, else the estimator's default)."""
        if self.whiten_advantages is None:
            return self.estimator in WHITENED_BY_DEFAULT
        return self.whiten_advantages

    @property
    def needs_values(self) -> bool:
        return self.estimator == "gae"


def _fn_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _call_forward(role: str, fn: ForwardFn, batch: PackedBatch) -> tuple[torch.Tensor, float]:
    """Call ``fn(batch)`` without grad; check its ``[T]`` finite float output; return it (0 outside the loss mask)."""
    name = f"{role}={_fn_name(fn)}"
    start = time.perf_counter()
    with torch.no_grad():
        out = fn(batch)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} returned {type(out).__name__}; it must return a [T] float tensor")
    if out.shape != (batch.num_tokens,) or not out.is_floating_point():
        dtype = str(out.dtype).removeprefix("torch.")
        raise ValueError(f"{name} returned a {dtype} tensor of shape {tuple(out.shape)}; expected a float tensor of "
                         f"shape ({batch.num_tokens},): one token-aligned value per packed token."
                         + token_shape_hint("its output", out, int(batch.cu_seqlens[-1]), batch.num_seqs))
    out = out.detach().to(device=batch.input_ids.device, dtype=torch.float32)
    _check_finite_tokens(f"{name} returned", out, batch)
    elapsed = time.perf_counter() - start
    return torch.where(batch.loss_mask, out, torch.zeros((), dtype=out.dtype, device=out.device)), elapsed


def _check_finite_tokens(what: str, values: torch.Tensor, batch: PackedBatch) -> None:
    """Raise naming the sample (and packed token) of the first non-finite loss-token value."""
    bad = ~torch.isfinite(values) & batch.loss_mask
    if bool(bad.any()):
        token = int(torch.nonzero(bad)[0])
        sample = int(torch.bucketize(torch.tensor(token), batch.cu_seqlens.long().cpu()[1:], right=True))
        raise ValueError(f"{what} a non-finite value ({values[token].item()}) for sample index {sample} (packed token "
                         f"{token}); {int(bad.sum())} non-finite loss tokens in total")


def _check_rollouts_and_rewards(rollouts: Sequence[Rollout], rewards: object) -> torch.Tensor:
    if isinstance(rollouts, Rollout) or not isinstance(rollouts, Sequence) or len(rollouts) == 0:
        raise ValueError("rollouts must be a non-empty list of rlhfkit.types.Rollout (an empty batch is invalid)")
    for i, rollout in enumerate(rollouts):
        if not isinstance(rollout, Rollout):
            raise TypeError(f"rollouts[{i}] must be a rlhfkit.types.Rollout, got {type(rollout).__name__}")
    try:
        reward_tensor = torch.as_tensor(rewards, dtype=torch.float32).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"rewards must be a [N] float tensor or a list of floats, got {type(rewards).__name__}") \
            from error
    if reward_tensor.shape != (len(rollouts),):
        raise ValueError(f"rewards has shape {tuple(reward_tensor.shape)}; expected ({len(rollouts)},), one scalar per "
                         "rollout")
    check_finite("rewards", reward_tensor, unit="sample")
    return reward_tensor


def _check_groups(rollouts: Sequence[Rollout]) -> None:
    """Samples that share a prompt_index must share the prompt: catches rollouts of two requests mixed up."""
    first_of_group: dict[int, int] = {}
    for i, rollout in enumerate(rollouts):
        j = first_of_group.setdefault(rollout.prompt_index, i)
        other = rollouts[j].prompt_token_ids
        if j != i and (other.shape != rollout.prompt_token_ids.shape
                       or not torch.equal(other.cpu(), rollout.prompt_token_ids.cpu())):
            raise ValueError(
                f"rollouts[{j}] and rollouts[{i}] share prompt_index={rollout.prompt_index} but have different prompt "
                "token ids; group estimators group samples by prompt_index, so give every distinct prompt its own "
                "index (e.g. offset the indices of a second generate() call)"
            )


def _response_values_to_tokens(rollouts: Sequence[Rollout], batch: PackedBatch,
                               values_of: Callable[[Rollout], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``[T]``: each rollout's per-response-token values (``values_of(rollout)``) on the batch's loss tokens, 0
    elsewhere. Only sampled tokens are loss tokens: observation tokens of multi-turn rollouts are left out."""
    if len(rollouts) != batch.num_seqs:
        raise ValueError(f"{len(rollouts)} rollouts for a batch of {batch.num_seqs} sequences; pass the rollouts the "
                         "batch was packed from")
    if all(r.response_loss_mask is None for r in rollouts):  # every response token is a loss token (one turn)
        values = torch.cat([values_of(r).cpu() for r in rollouts])
    else:
        values = torch.cat([values_of(r).cpu()[r.loss_mask.cpu()] for r in rollouts])
    out = torch.zeros(batch.num_tokens, dtype=dtype, device=batch.input_ids.device)
    out[batch.loss_mask] = values.to(out.device, dtype)
    return out


def engine_token_logprobs(rollouts: Sequence[Rollout], batch: PackedBatch) -> torch.Tensor | None:
    """``[T]`` engine log-probs on the response tokens of ``batch`` (``pack_rollouts(rollouts)``; 0 elsewhere), or
    None if no rollout carries them. What :func:`make_experience` stores as ``Experience.engine_logprobs``; also a
    ``policy_logprobs_fn`` that takes the engine's log-probs as the behaviour policy's."""
    have = [r.response_logprobs is not None for r in rollouts]
    if not any(have):
        return None
    if not all(have):
        missing = have.index(False)
        raise ValueError(f"rollouts[{missing}].response_logprobs is None but other rollouts carry engine log-probs; "
                         "request logprobs for all samples or for none")
    out = _response_values_to_tokens(rollouts, batch, lambda r: r.response_logprobs, torch.float32)
    _check_finite_tokens("rollouts' response_logprobs contain", out, batch)
    return out


def token_weight_versions(rollouts: Sequence[Rollout], batch: PackedBatch) -> torch.Tensor:
    """``[T]`` int64: the weight version that generated each response token of ``batch`` (``pack_rollouts(rollouts)``;
    0 elsewhere), from :attr:`~rlhfkit.types.Rollout.token_weight_versions` (a sample continued after an in-flight
    weight update spans versions). What :func:`make_experience` stores as ``Experience.weight_versions``."""
    return _response_values_to_tokens(rollouts, batch, lambda r: r.token_weight_versions, torch.int64)


def _prepare_rewards(rewards: torch.Tensor, config: ExperienceConfig) -> torch.Tensor:
    if config.reward_clip is not None:
        rewards = rewards.clamp(-config.reward_clip, config.reward_clip)
    if config.normalize_rewards and rewards.numel() > 1:
        rewards = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-8)
    return rewards


def _masked_mean_std(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    selected = values[mask].double()
    if selected.numel() == 0:
        return 0.0, 0.0
    return float(selected.mean()), float(selected.std(unbiased=False))


def _statistics(raw_rewards: torch.Tensor, experience: Experience,
                kl_coef: float, timings: dict[str, float]) -> dict[str, float]:
    lengths = experience.response_lengths.double()
    mask = experience.batch.loss_mask
    stats = {
        "reward/mean": float(raw_rewards.mean()),
        "reward/std": float(raw_rewards.double().std(unbiased=False)),
        "reward/min": float(raw_rewards.min()),
        "reward/max": float(raw_rewards.max()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "truncation_rate": float(experience.truncated.double().mean()),
        "num_seqs": float(experience.num_seqs),
        "num_tokens": float(experience.num_tokens),
        "num_loss_tokens": float(mask.sum()),
        "kl_coef": float(kl_coef),
    }
    stats["advantage/mean"], stats["advantage/std"] = _masked_mean_std(experience.advantages, mask)
    if experience.returns is not None:
        stats["return/mean"], _ = _masked_mean_std(experience.returns, mask)
    if experience.kl is not None:
        stats["kl/mean"], _ = _masked_mean_std(experience.kl, mask)
        seq_ids = experience.batch.seq_ids[mask]
        per_seq = torch.zeros(experience.num_seqs + 1, dtype=torch.float64, device=mask.device)
        per_seq.index_add_(0, seq_ids, experience.kl[mask].double())
        stats["kl/seq_sum_mean"] = float(per_seq[:-1].mean())
    stats.update({f"time/{name}_s": seconds for name, seconds in timings.items()})
    return stats


def make_experience(
    rollouts: Sequence[Rollout],
    rewards: torch.Tensor | Sequence[float],
    *,
    policy_logprobs_fn: ForwardFn,
    ref_logprobs_fn: ForwardFn | None = None,
    values_fn: ForwardFn | None = None,
    config: ExperienceConfig,
    pad_token_id: int = 0,
    kl_coef: float | None = None,
) -> tuple[Experience, dict[str, float]]:
    """Pack rollouts, run the forward functions, estimate KL, advantages and returns.

    Args:
        rollouts: N samples (prompt + response, engine log-probs optional but all-or-none).
        rewards: ``[N]`` scalar reward per rollout (finite).
        policy_logprobs_fn: ``fn(batch) -> [T]`` token-aligned log-probs of the policy that generated the data, as the
            trainer computes them (e.g. ``lambda b: rlhfkit.losses.model_logprobs(model, b)``); becomes
            ``old_logprobs``. Called under ``torch.no_grad()``; outputs are moved to the batch's device.
        ref_logprobs_fn: same for the reference model; needed for ``Experience.kl`` and a KL reward penalty.
        values_fn: ``fn(batch) -> [T]`` critic values, token aligned (``values[t]`` is the value of the state before
            token ``t``); required by ``estimator="gae"``.
        config: the estimator and its settings.
        pad_token_id: token id of padding in the packed batch (there is none unless packing adds a tail).
        kl_coef: overrides ``config.kl_coef`` for this call (pass a KL controller's current value).

    Returns:
        ``(experience, stats)``: per-token fields are 0 outside the loss mask; ``experience.rewards`` are the rewards
        after clipping/normalisation; ``stats`` holds reward, length, truncation, KL and advantage statistics (raw
        rewards) and ``time/<phase>_s`` timings, all plain floats.
    """
    start = time.perf_counter()
    raw_rewards = _check_rollouts_and_rewards(rollouts, rewards)
    kl_coef = config.kl_coef if kl_coef is None else float(kl_coef)
    _check_fns(config, policy_logprobs_fn, ref_logprobs_fn, values_fn, kl_coef)
    batch = pack_rollouts(rollouts, pad_token_id=pad_token_id)
    prompt_index = torch.tensor([r.prompt_index for r in rollouts], dtype=torch.long)
    if config.estimator in GROUP_ESTIMATORS:
        _check_groups(rollouts)
    timings = {"pack": time.perf_counter() - start}
    old_logprobs, ref_logprobs, values, kl = _run_forwards(batch, config, timings, policy_logprobs_fn,
                                                           ref_logprobs_fn, values_fn)
    advantage_start = time.perf_counter()
    device = batch.input_ids.device
    seq_rewards = _prepare_rewards(raw_rewards, config).to(device)
    advantages, returns = estimate_advantages(
        config.estimator, seq_rewards, prompt_index.to(device), batch.loss_mask, batch.cu_seqlens,
        kl=kl if config.kl_in_reward else None, kl_coef=kl_coef, values=values, gamma=config.gamma,
        lam=config.lam, whiten_advantages=config.whitens, grpo_eps=config.grpo_eps,
    )
    timings["advantages"] = time.perf_counter() - advantage_start
    experience = Experience(
        batch=batch, old_logprobs=old_logprobs, advantages=advantages, returns=returns, values=values,
        ref_logprobs=ref_logprobs, engine_logprobs=engine_token_logprobs(rollouts, batch), kl=kl, rewards=seq_rewards,
        weight_versions=token_weight_versions(rollouts, batch),
        prompt_index=prompt_index.to(device),
        response_lengths=torch.tensor([r.response_length for r in rollouts], dtype=torch.long, device=device),
        truncated=torch.tensor([r.truncated for r in rollouts], dtype=torch.bool, device=device),
    )
    timings["total"] = time.perf_counter() - start
    return experience, _statistics(raw_rewards, experience, kl_coef, timings)


def _run_forwards(batch: PackedBatch, config: ExperienceConfig, timings: dict[str, float], policy_fn: ForwardFn,
                  ref_fn: ForwardFn | None, values_fn: ForwardFn | None) -> tuple[torch.Tensor, ...]:
    """Policy/ref/value forwards (timed into ``timings``) and the per-token KL (None without a reference)."""
    old_logprobs, timings["policy_logprobs"] = _call_forward("policy_logprobs_fn", policy_fn, batch)
    ref_logprobs = values = kl = None
    if ref_fn is not None:
        ref_logprobs, timings["ref_logprobs"] = _call_forward("ref_logprobs_fn", ref_fn, batch)
        kl = kl_estimate(old_logprobs, ref_logprobs, estimator=config.kl_estimator, clamp=config.kl_clamp)
        kl = torch.where(batch.loss_mask, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    if values_fn is not None:
        values, timings["values"] = _call_forward("values_fn", values_fn, batch)
    return old_logprobs, ref_logprobs, values, kl


def _check_fns(config: ExperienceConfig, policy_fn: object, ref_fn: object, values_fn: object, kl_coef: float) -> None:
    if not isinstance(config, ExperienceConfig):
        raise TypeError(f"config must be an ExperienceConfig, got {type(config).__name__}")
    for name, fn in (("policy_logprobs_fn", policy_fn), ("ref_logprobs_fn", ref_fn), ("values_fn", values_fn)):
        if (fn is None and name == "policy_logprobs_fn") or (fn is not None and not callable(fn)):
            raise TypeError(f"{name} must be a callable fn(PackedBatch) -> [T] tensor, got {fn!r}")
    if config.needs_values and values_fn is None:
        raise ValueError("estimator='gae' needs values_fn (a critic); pass values_fn or choose another estimator")
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef={kl_coef}; must be >= 0")
    if config.kl_in_reward and kl_coef > 0 and ref_fn is None:
        raise ValueError(f"kl_in_reward=True with kl_coef={kl_coef} needs ref_logprobs_fn (the reference model); pass "
                         "it, or set kl_coef=0 / kl_in_reward=False")


def select_experience(experience: Experience, indices: Sequence[int] | torch.Tensor) -> Experience:
    """The sub-experience of sequences ``indices`` (in that order): per-token fields follow the selected tokens."""
    if not isinstance(experience, Experience):
        raise TypeError(f"experience must be an Experience, got {type(experience).__name__}")
    batch, token_index = select_sequences(experience.batch, indices)
    seq_index = torch.as_tensor(indices, dtype=torch.long, device=experience.batch.input_ids.device)
    updates: dict[str, object] = {"batch": batch}
    for f in fields(experience):
        value = getattr(experience, f.name)
        if f.name in Experience._TOKEN_FIELDS and value is not None:
            updates[f.name] = value[token_index]
        elif f.name in Experience._SEQ_FIELDS:
            updates[f.name] = value[seq_index]
    return replace(experience, **updates)


def iterate_minibatches(
    experience: Experience,
    *,
    num_minibatches: int | None = None,
    max_tokens: int | None = None,
    seed: int,
) -> Iterator[Experience]:
    """Shuffle the sequences with ``seed`` and yield sub-experiences; every sequence appears exactly once.

    Args:
        experience: the experience of one step.
        num_minibatches: split into this many minibatches of (nearly) equal sequence counts; with ``max_tokens`` it is
            the minimum count of token-balanced minibatches.
        max_tokens: token budget per minibatch (prompt + response tokens); sequences are balanced across the fewest
            minibatches that respect it (:func:`rlhfkit.packing.partition_by_token_budget`).
        seed: seed of the ``torch.Generator`` that shuffles sequences and minibatch order (use a new one per epoch).
    """
    if not isinstance(experience, Experience):
        raise TypeError(f"experience must be an Experience, got {type(experience).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r}; must be an int (an explicit seed makes the shuffle reproducible)")
    if num_minibatches is None and max_tokens is None:
        raise ValueError("give num_minibatches, max_tokens, or both")
    num_seqs = experience.num_seqs
    if num_minibatches is not None and (isinstance(num_minibatches, bool) or not isinstance(num_minibatches, int)
                                        or not 1 <= num_minibatches <= num_seqs):
        raise ValueError(f"num_minibatches={num_minibatches!r}; must be an int in [1, {num_seqs}] (the number of "
                         "sequences)")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_seqs, generator=generator)
    if max_tokens is None:
        groups = [chunk.tolist() for chunk in torch.tensor_split(order, num_minibatches)]
    else:
        lengths = experience.batch.seq_lens.cpu()[order].tolist()
        parts = partition_by_token_budget(lengths, max_tokens=max_tokens, num_micro_batches=num_minibatches)
        groups = [[int(order[i]) for i in part] for part in parts]
        groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    for group in groups:
        yield select_experience(experience, group)
