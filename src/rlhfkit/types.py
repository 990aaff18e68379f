"""Data carriers exchanged between rlhfkit blocks: :class:`Rollout`, :class:`PackedBatch`, :class:`Experience`.

Shapes use these names: ``R`` response length of one sample, ``P`` prompt length of one sample, ``T`` tokens of a
packed stream (all sequences laid end to end, optionally followed by padding), ``N`` number of sequences in a packed
stream. Per-token tensors of a packed stream are *token aligned*: entry ``t`` is about token ``input_ids[t]`` (its
log-prob given the tokens before it in the same sequence, its advantage, ...). The first token of every sequence has
no log-prob; it is never a response token, so ``loss_mask`` is ``False`` there and its entries are 0.

Every constructor validates shapes and dtypes and names the offending field. This module needs only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal

import torch

from rlhfkit._cu_seqlens import attach_host_copy, check_logprob_values, cu_end, host_copy, segment_ids

__all__ = ["Rollout", "PackedBatch", "PaddedBatch", "Experience"]

FinishReason = Literal["stop", "length", "abort"]
_FINISH_REASONS = ("stop", "length", "abort")


def _moved(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor.to(device)``, carrying its host copy along (see :func:`rlhfkit._cu_seqlens.host_copy`). From pageable
    host memory to a GPU the copy does not wait for the GPU's queued work (CUDA stages the bytes before returning, so
    the source may change right after); from pinned memory it stays a blocking copy."""
    device = torch.device(device)
    staged = device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned()
    moved = tensor.to(device, non_blocking=staged)
    if moved is not tensor:
        host = host_copy(tensor)
        if host is not None:
            attach_host_copy(moved, host)
    return moved


def _check_tensor(owner: str, name: str, value: object, *, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}.{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.ndim != ndim:
        raise ValueError(f"{owner}.{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{owner}.{name} must have dtype in ({names}), got {str(value.dtype).removeprefix('torch.')}")


_INT = (torch.int64, torch.int32)
_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One generated sample: a prompt, one response to it, and what the engine knows about that response.

    Attributes:
        prompt_token_ids: ``[P]`` int64, the prompt as the engine saw it (P >= 1).
        response_token_ids: ``[R]`` int64, the generated tokens, including a stop token if one ended the sample.
        response_logprobs: ``[R]`` float32 or None; the engine's log-probability of each response token under the
            distribution it sampled from (see the engine's docs for temperature handling).
        finish_reason: ``"stop"`` (stop/EOS token), ``"length"`` (hit max_new_tokens) or ``"abort"``.
        prompt_index: index of the prompt in the request; the ``n`` samples of one prompt share it (a GRPO group).
        sample_index: index of this sample among the ``n`` samples of its prompt.
        weight_version: the engine's weight version when it started this sample (the oldest version among its tokens;
            what staleness bounds use).
        response_weight_versions: ``[R]`` int64 or None; the weight version that produced each response token, for a
            sample whose generation spanned a weight update (an in-flight update continues it with new weights).
            Non-decreasing, each ``>= weight_version``. None: every token is of ``weight_version``
            (:attr:`token_weight_versions` gives the tensor either way).
        prompt_text, response_text, label: optional strings carried for rewards and logging.
        response_loss_mask: ``[R]`` bool or None; True on the response tokens the engine sampled (they enter the
            loss), False on tokens inserted between turns (tool results, environment observations; see
            :mod:`rlhfkit.multiturn`), whose ``response_logprobs`` entries are 0. None means every response token was
            sampled.
    """

    prompt_token_ids: torch.Tensor
    response_token_ids: torch.Tensor
    response_logprobs: torch.Tensor | None = None
    finish_reason: FinishReason = "length"
    prompt_index: int = 0
    sample_index: int = 0
    weight_version: int = 0
    response_weight_versions: torch.Tensor | None = None
    prompt_text: str | None = None
    response_text: str | None = None
    label: str | None = None
    response_loss_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _check_tensor("Rollout", "prompt_token_ids", self.prompt_token_ids, ndim=1, dtypes=_INT)
        _check_tensor("Rollout", "response_token_ids", self.response_token_ids, ndim=1, dtypes=_INT)
        if self.prompt_token_ids.numel() == 0:
            raise ValueError("Rollout.prompt_token_ids is empty; a prompt needs at least one token")
        for name in ("prompt_token_ids", "response_token_ids"):
            ids = getattr(self, name)
            if ids.numel() and bool((ids < 0).any()):
                position = int(torch.nonzero(ids < 0)[0])
                raise ValueError(
                    f"Rollout(prompt_index={self.prompt_index}, sample_index={self.sample_index}).{name}[{position}]="
                    f"{int(ids[position])}; token ids are >= 0 (a padding or ignore value such as -100 left in?)"
                )
        if self.response_logprobs is not None:
            _check_tensor("Rollout", "response_logprobs", self.response_logprobs, ndim=1, dtypes=_FLOAT)
            if self.response_logprobs.shape != self.response_token_ids.shape:
                raise ValueError(
                    f"Rollout.response_logprobs has shape {tuple(self.response_logprobs.shape)} but "
                    f"response_token_ids has shape {tuple(self.response_token_ids.shape)}; they must match"
                )
            check_logprob_values(
                "Rollout.response_logprobs", self.response_logprobs,
                where=f"prompt_index={self.prompt_index}, sample_index={self.sample_index}",
            )
        if self.response_loss_mask is not None:
            _check_tensor("Rollout", "response_loss_mask", self.response_loss_mask, ndim=1, dtypes=(torch.bool,))
            if self.response_loss_mask.shape != self.response_token_ids.shape:
                raise ValueError(
                    f"Rollout.response_loss_mask has shape {tuple(self.response_loss_mask.shape)} but "
                    f"response_token_ids has shape {tuple(self.response_token_ids.shape)}; they must match"
                )
        if self.response_weight_versions is not None:
            self._check_token_versions()
        if self.finish_reason not in _FINISH_REASONS:
            raise ValueError(f"Rollout.finish_reason={self.finish_reason!r}; expected one of {_FINISH_REASONS}")
        if self.prompt_index < 0 or self.sample_index < 0:
            raise ValueError(
                f"Rollout.prompt_index={self.prompt_index} and sample_index={self.sample_index} must be >= 0"
            )

    def _check_token_versions(self) -> None:
        versions = self.response_weight_versions
        where = f"Rollout(prompt_index={self.prompt_index}, sample_index={self.sample_index}).response_weight_versions"
        _check_tensor("Rollout", "response_weight_versions", versions, ndim=1, dtypes=_INT)
        if versions.shape != self.response_token_ids.shape:
            raise ValueError(f"{where} has shape {tuple(versions.shape)} but response_token_ids has shape "
                             f"{tuple(self.response_token_ids.shape)}; give one version per response token")
        if versions.numel() == 0:
            return
        if int(versions.min()) < self.weight_version:
            position = int(torch.argmin(versions))
            raise ValueError(f"{where}[{position}]={int(versions[position])} is older than weight_version="
                             f"{self.weight_version}; weight_version is the sample's oldest version (stamp it with "
                             "the version its request started at, or lower)")
        if versions.numel() > 1 and bool((versions[1:] < versions[:-1]).any()):
            position = int(torch.nonzero(versions[1:] < versions[:-1])[0]) + 1
            raise ValueError(f"{where}[{position}]={int(versions[position])} is older than the token before it "
                             f"({int(versions[position - 1])}); weight versions only go forward within a sample")

    @property
    def token_weight_versions(self) -> torch.Tensor:
        """``[R]`` int64: the weight version of each response token (constant ``weight_version`` unless
        ``response_weight_versions`` says otherwise)."""
        if self.response_weight_versions is not None:
            return self.response_weight_versions.long()
        return torch.full((self.response_length,), self.weight_version, dtype=torch.int64)

    @property
    def prompt_length(self) -> int:
        return int(self.prompt_token_ids.numel())

    @property
    def response_length(self) -> int:
        return int(self.response_token_ids.numel())

    @property
    def truncated(self) -> bool:
        """True when the response ended because it hit the length limit."""
        return self.finish_reason == "length"

    @property
    def loss_mask(self) -> torch.Tensor:
        """``[R]`` bool: ``response_loss_mask``, or all True when it is None."""
        if self.response_loss_mask is not None:
            return self.response_loss_mask
        return torch.ones(self.response_token_ids.shape, dtype=torch.bool, device=self.response_token_ids.device)


@dataclass(frozen=True, kw_only=True)
class PackedBatch:
    """Sequences laid end to end in one padding-free token stream.

    Attributes:
        input_ids: ``[T]`` int64 tokens of all sequences, then ``T - cu_seqlens[-1]`` padding tokens (if any).
        position_ids: ``[T]`` int64, restarting at 0 at every sequence start (and for the padding tail).
        cu_seqlens: ``[N + 1]`` int32, sequence boundaries: sequence ``i`` is ``input_ids[cu_seqlens[i]:cu_seqlens[i+1]]``;
            ``cu_seqlens[0] == 0``; strictly increasing (no empty sequences).
        loss_mask: ``[T]`` bool, True for tokens whose log-prob enters the loss (response tokens); never True on the
            first token of a sequence or on padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self) -> None:
        _check_tensor("PackedBatch", "input_ids", self.input_ids, ndim=1, dtypes=_INT)
        _check_tensor("PackedBatch", "position_ids", self.position_ids, ndim=1, dtypes=_INT)
        _check_tensor("PackedBatch", "cu_seqlens", self.cu_seqlens, ndim=1, dtypes=_INT)
        _check_tensor("PackedBatch", "loss_mask", self.loss_mask, ndim=1, dtypes=(torch.bool,))
        num_tokens = self.input_ids.numel()
        for name in ("position_ids", "loss_mask"):
            if getattr(self, name).numel() != num_tokens:
                raise ValueError(
                    f"PackedBatch.{name} has {getattr(self, name).numel()} entries but input_ids has {num_tokens}"
                )
        cu = self.cu_seqlens
        if cu.numel() < 2:
            raise ValueError(f"PackedBatch.cu_seqlens={cu.tolist()} describes no sequence; an empty batch is invalid")
        if int(cu[0]) != 0:
            raise ValueError(f"PackedBatch.cu_seqlens must start at 0, got {int(cu[0])}")
        lengths = cu[1:] - cu[:-1]
        if bool((lengths <= 0).any()):
            bad = int(torch.nonzero(lengths <= 0)[0])
            raise ValueError(f"PackedBatch.cu_seqlens must be strictly increasing; sequence {bad} has length "
                             f"{int(lengths[bad])}")
        if int(cu[-1]) > num_tokens:
            raise ValueError(f"PackedBatch.cu_seqlens[-1]={int(cu[-1])} exceeds the {num_tokens} tokens of input_ids")
        if bool(self.loss_mask[cu[:-1].long()].any()):
            bad = int(torch.nonzero(self.loss_mask[cu[:-1].long()])[0])
            raise ValueError(f"PackedBatch.loss_mask is True on the first token of sequence {bad}; the first token "
                             "of a sequence has no log-prob")
        if bool(self.loss_mask[int(cu[-1]):].any()):
            raise ValueError("PackedBatch.loss_mask is True on padding tokens after cu_seqlens[-1]")
        negative = self.input_ids < 0
        if bool(negative.any()):
            token = int(torch.nonzero(negative)[0])
            where = ("the padding tail (pad_token_id)" if token >= int(cu[-1]) else
                     f"sequence (sample index) {int(torch.searchsorted(cu[1:], cu.new_tensor(token), right=True))}, "
                     f"position {token - int(cu[int(torch.searchsorted(cu[1:], cu.new_tensor(token), right=True))])}")
            raise ValueError(f"PackedBatch.input_ids[{token}]={int(self.input_ids[token])} in {where}; token ids are "
                             ">= 0 (a padding or ignore value such as -100 left in the tokens?)")

    @property
    def num_tokens(self) -> int:
        """``T``: tokens in the stream, padding included."""
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        """``N``: real sequences (padding excluded)."""
        return int(self.cu_seqlens.numel() - 1)

    @property
    def num_padding_tokens(self) -> int:
        return self.num_tokens - cu_end(self.cu_seqlens)

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[N]`` int64 lengths of the real sequences."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    @property
    def seq_ids(self) -> torch.Tensor:
        """``[T]`` int64: the sequence each token belongs to; padding tokens get ``N``."""
        ids = torch.full((self.num_tokens,), self.num_seqs, dtype=torch.long, device=self.input_ids.device)
        end = cu_end(self.cu_seqlens)
        ids[:end] = segment_ids(self.cu_seqlens.to(ids.device), total=end)
        return ids

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch on ``device``. Its values were checked when it was built, so they are not checked again there
        (each check of a GPU tensor would wait for the GPU); each moved tensor keeps its host copy, which
        boundaries, loss-token positions and token-id bounds are read from (:func:`rlhfkit._cu_seqlens.host_copy`)."""
        moved = {f.name: _moved(getattr(self, f.name), device) for f in fields(self)}
        if all(moved[name] is getattr(self, name) for name in moved):
            return self
        batch = object.__new__(PackedBatch)
        for name, value in moved.items():
            object.__setattr__(batch, name, value)
        return batch


@dataclass(frozen=True, kw_only=True)
class PaddedBatch:
    """A packed batch laid out as HF-style padded rows (:func:`rlhfkit.packing.unpack_to_padded`).

    Attributes:
        input_ids: ``[N, L]`` int64, each sequence in one row, padded with the pad token.
        attention_mask: ``[N, L]`` int64, 1 on real tokens, 0 on padding.
        loss_mask: ``[N, L]`` bool, the packed batch's loss mask (response tokens).
        values: the per-token tensors passed along, each ``[N, L, ...]``, still aligned at each token's own position
            (entry ``[i, t]`` is about token ``t`` of row ``i``; for HF-style shifted log-probs take ``[:, 1:]``).
        side: ``"right"`` or ``"left"``, where the padding is.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    values: tuple[torch.Tensor, ...] = ()
    side: Literal["right", "left"] = "right"

    def __post_init__(self) -> None:
        _check_tensor("PaddedBatch", "input_ids", self.input_ids, ndim=2, dtypes=_INT)
        _check_tensor("PaddedBatch", "attention_mask", self.attention_mask, ndim=2, dtypes=_INT)
        _check_tensor("PaddedBatch", "loss_mask", self.loss_mask, ndim=2, dtypes=(torch.bool,))
        for name in ("attention_mask", "loss_mask"):
            if getattr(self, name).shape != self.input_ids.shape:
                raise ValueError(f"PaddedBatch.{name} has shape {tuple(getattr(self, name).shape)} but input_ids has "
                                 f"{tuple(self.input_ids.shape)}")
        if not isinstance(self.values, tuple):
            raise TypeError(f"PaddedBatch.values must be a tuple of tensors, got {type(self.values).__name__}")
        if self.side not in ("right", "left"):
            raise ValueError(f"PaddedBatch.side={self.side!r}; expected 'right' or 'left'")


@dataclass(frozen=True, kw_only=True)
class Experience:
    """What the trainer learns from: a packed batch with per-token training signals.

    Per-token tensors are ``[T]`` and token aligned with ``batch.input_ids`` (0 where ``batch.loss_mask`` is False).

    Attributes:
        batch: the packed prompt+response sequences.
        old_logprobs: ``[T]`` float, log-probs of the policy that generated the data, as the trainer computes them.
        advantages: ``[T]`` float.
        returns: ``[T]`` float or None, value targets (PPO with a critic).
        values: ``[T]`` float or None, critic values at rollout time.
        ref_logprobs: ``[T]`` float or None, reference-model log-probs (KL penalty or loss).
        engine_logprobs: ``[T]`` float or None, the rollout engine's log-probs (mismatch correction).
        kl: ``[T]`` float or None, per-token KL estimate between policy and reference at rollout time.
        weight_versions: ``[T]`` int64 or None, the weight version that generated each response token
            (:attr:`Rollout.token_weight_versions`; 0 outside the loss mask), for staleness-aware metrics.
        rewards: ``[N]`` float32, the scalar reward of each sequence (after shaping/normalisation).
        prompt_index: ``[N]`` int64, the prompt (group) each sequence answers.
        response_lengths: ``[N]`` int64, response tokens per sequence.
        truncated: ``[N]`` bool, the response hit the length limit.
    """

    batch: PackedBatch
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    prompt_index: torch.Tensor
    response_lengths: torch.Tensor
    truncated: torch.Tensor
    returns: torch.Tensor | None = None
    values: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    engine_logprobs: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    weight_versions: torch.Tensor | None = None

    _TOKEN_FIELDS = ("old_logprobs", "advantages", "returns", "values", "ref_logprobs", "engine_logprobs", "kl",
                     "weight_versions")
    _SEQ_FIELDS = ("rewards", "prompt_index", "response_lengths", "truncated")

    def __post_init__(self) -> None:
        if not isinstance(self.batch, PackedBatch):
            raise TypeError(f"Experience.batch must be a PackedBatch, got {type(self.batch).__name__}")
        num_tokens, num_seqs = self.batch.num_tokens, self.batch.num_seqs
        for name in self._TOKEN_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("old_logprobs", "advantages"):
                raise ValueError(f"Experience.{name} is required")
            if value is not None:
                _check_tensor("Experience", name, value, ndim=1, dtypes=_INT if name == "weight_versions" else _FLOAT)
                if value.numel() != num_tokens:
                    raise ValueError(f"Experience.{name} has {value.numel()} entries; the batch has {num_tokens} tokens")
        seq_dtypes = {"rewards": _FLOAT, "prompt_index": _INT, "response_lengths": _INT, "truncated": (torch.bool,)}
        for name in self._SEQ_FIELDS:
            value = getattr(self, name)
            _check_tensor("Experience", name, value, ndim=1, dtypes=seq_dtypes[name])
            if value.numel() != num_seqs:
                raise ValueError(f"Experience.{name} has {value.numel()} entries; the batch has {num_seqs} sequences")

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    def to(self, device: torch.device | str) -> Experience:
        """The experience on ``device``; each moved tensor keeps its host copy (see :meth:`PackedBatch.to`)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {k: (v.to(device) if k == "batch" else _moved(v, device) if v is not None else None)
                 for k, v in moved.items()}
        return replace(self, **moved)
