"""Reward-model scoring: a transformers sequence-classification model (one label) scores token sequences.

Part of :mod:`rlhfkit.rewards` (re-exported there); needs ``rlhfkit[hf]`` to load a model from a path. The score of a
sequence is the classification head applied to the hidden state of its last real (non-padding) token, found from the
attention mask — not from the pad token id, so a sequence that ends with a token equal to the pad id (e.g. EOS used
as pad) is still scored at its true end. Works with right or left padding.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlhfkit._optional import require
from rlhfkit.rewards._functions import check_field_type
from rlhfkit.types import Rollout

__all__ = ["RewardModelConfig", "RewardModel"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """How to load a reward model.

    Attributes:
        model: folder or hub id (:func:`rlhfkit.models.resolve_model`) of an ``AutoModelForSequenceClassification``
            checkpoint with ``num_labels=1``.
        device: torch device string.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"``; scores are returned as float32.
        max_batch_size: sequences per forward pass.
        attn_implementation: passed to ``from_pretrained``; None keeps the default.
    """

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 32
    attn_implementation: str | None = None

    def __post_init__(self) -> None:
        for field, kind in (("device", "str"), ("dtype", "str"), ("max_batch_size", "int"),
                            ("attn_implementation", "str|None")):
            check_field_type("RewardModelConfig", field, getattr(self, field), kind)
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"RewardModelConfig.model={self.model!r}; pass the path of a saved reward model")
        if self.dtype not in (*_DTYPES, "auto"):
            raise ValueError(f"RewardModelConfig.dtype={self.dtype!r}; expected one of {(*_DTYPES, 'auto')}")
        if self.max_batch_size < 1:
            raise ValueError(f"RewardModelConfig.max_batch_size={self.max_batch_size}; must be >= 1")


class RewardModel:
    """Scores sequences with a one-label sequence-classification model. Build with ``RewardModel(config)`` or
    :meth:`from_model`."""

    def __init__(self, config: RewardModelConfig) -> None:
        if not isinstance(config, RewardModelConfig):
            raise TypeError(f"RewardModel(config) needs a RewardModelConfig, got {type(config).__name__}")
        transformers = require("transformers", user="rlhfkit.rewards")
        kwargs = {"dtype": "auto" if config.dtype == "auto" else _DTYPES[config.dtype]}
        if config.attn_implementation is not None:
            kwargs["attn_implementation"] = config.attn_implementation
        from rlhfkit.models import resolve_model

        model = transformers.AutoModelForSequenceClassification.from_pretrained(resolve_model(config.model), **kwargs)
        model.to(torch.device(config.device))
        self._setup(model, pad_token_id=None, max_batch_size=config.max_batch_size)

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, pad_token_id: int | None = None,
                   max_batch_size: int = 32) -> RewardModel:
        """Wrap a loaded sequence-classification model (``model.config.num_labels == 1``)."""
        if max_batch_size < 1:
            raise ValueError(f"RewardModel.from_model(max_batch_size={max_batch_size}); must be >= 1")
        reward_model = cls.__new__(cls)
        reward_model._setup(model, pad_token_id=pad_token_id, max_batch_size=max_batch_size)
        return reward_model

    def _setup(self, model, *, pad_token_id: int | None, max_batch_size: int) -> None:
        num_labels = getattr(getattr(model, "config", None), "num_labels", None)
        if num_labels != 1:
            raise ValueError(f"reward model has num_labels={num_labels}; a reward model needs exactly one output "
                             "(load it with num_labels=1)")
        self.model = model
        self.max_batch_size = max_batch_size
        config_pad = getattr(model.config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id if pad_token_id is not None else config_pad if config_pad is not None
                                else 0)
        self.device = next(model.parameters()).device
        head = getattr(model, "score", None)
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        self._head_and_base = (head, base) if isinstance(head, torch.nn.Module) and base is not None else None
        if self._head_and_base is None:
            logger.warning("reward model %s has no `score` head; falling back to the model's own pooling, which "
                           "locates the last token by pad_token_id", type(model).__name__)

    @torch.no_grad()
    def score_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores of a padded batch.

        Args:
            input_ids: ``[B, L]`` int64, right- or left-padded.
            attention_mask: ``[B, L]``, 1 on real tokens (each row's real tokens must be contiguous).

        Returns:
            ``[B]`` float32 on CPU.
        """
        if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
            raise ValueError(f"score_padded: input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must both be [B, L]")
        mask = attention_mask.to(self.device).long()
        if bool((mask.sum(-1) == 0).any()):
            raise ValueError("score_padded: a row of attention_mask is all zeros; every sequence needs a token")
        input_ids = input_ids.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
        width = mask.shape[1]
        last = width - 1 - torch.argmax(mask.flip(-1), dim=-1)  # index of each row's last real token
        was_training = self.model.training
        self.model.eval()
        try:
            if self._head_and_base is None:
                scores = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits
            else:
                head, base = self._head_and_base
                hidden = base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state
                scores = head(hidden[torch.arange(hidden.shape[0], device=self.device), last])
        finally:
            self.model.train(was_training)
        return scores.reshape(-1).float().cpu()

    def score(self, sequences: Sequence[Sequence[int] | torch.Tensor]) -> torch.Tensor:
        """Scores of token sequences (each a prompt + response), batched by length, right padding.

        Returns:
            ``[N]`` float32 on CPU, in input order.
        """
        rows = [s.tolist() if isinstance(s, torch.Tensor) else list(s) for s in sequences]
        if not rows:
            raise ValueError("RewardModel.score(sequences=[]) got no sequences")
        for index, row in enumerate(rows):
            if not row:
                raise ValueError(f"RewardModel.score: sequence {index} is empty")
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        scores = torch.empty(len(rows), dtype=torch.float32)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start:start + self.max_batch_size]
            width = max(len(rows[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, index in enumerate(chunk):
                input_ids[row, :len(rows[index])] = torch.tensor(rows[index], dtype=torch.long)
                attention_mask[row, :len(rows[index])] = 1
            scores[chunk] = self.score_padded(input_ids, attention_mask)
        return scores

    def score_rollouts(self, rollouts: Sequence[Rollout]) -> torch.Tensor:
        """``[N]`` float32 scores of ``prompt_token_ids + response_token_ids`` of each rollout."""
        return self.score([torch.cat([r.prompt_token_ids, r.response_token_ids]) for r in rollouts])
