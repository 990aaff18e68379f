"""What :class:`~rlhfkit.openai_endpoint.OpenAIEndpoint` records: one :class:`ChatRecord` per choice of a
request, and their conversion to rollouts (:func:`records_to_rollouts` per turn, :func:`session_to_rollout` for a
whole conversation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhfkit.types import Rollout

__all__ = ["ChatRecord", "records_to_rollouts", "session_to_rollout"]


@dataclass(frozen=True, kw_only=True)
class ChatRecord:
    """One choice of one chat-completions request, as the engine produced it.

    Attributes:
        session_id: the caller's session (trajectory) id.
        turn_index: the request's position among its session's requests (0-based, in order of completion).
        choice_index: which of the request's ``n`` choices.
        request_id: the ``id`` of the answer (``chatcmpl-...``), shared by the ``n`` choices.
        messages: the request's messages (after validation), for logging and rewards.
        prompt_token_ids: ``[P]`` int64, the chat-templated prompt exactly as the engine saw it.
        response_token_ids: ``[R]`` int64, the sampled tokens (cut after the token completing a stop string, if one
            was hit; a stop or EOS token that ended the sample is included).
        response_logprobs: ``[R]`` float32, the engine's log-prob of each sampled token, ``log_softmax(logits /
            temperature)`` (see :mod:`rlhfkit.engines.protocol`).
        finish_reason: ``"stop"`` or ``"length"`` (``"abort"`` if the engine aborted).
        temperature: the request's temperature (the trainer needs it to reproduce the log-probs; at 0, greedy, the
            log-probs are the raw model's, as at temperature 1).
        weight_version: the engine's weight version when it sampled.
        content: the assistant text returned to the caller.
        tools: the request's ``tools`` (rendered into the prompt by the chat template), None if it gave none.
    """

    session_id: str
    turn_index: int
    choice_index: int
    request_id: str
    messages: list[dict[str, Any]]
    prompt_token_ids: torch.Tensor
    response_token_ids: torch.Tensor
    response_logprobs: torch.Tensor
    finish_reason: Literal["stop", "length", "abort"]
    temperature: float
    weight_version: int
    content: str
    tools: list[Any] | None = None

    def to_rollout(self, *, prompt_index: int = 0, sample_index: int | None = None,
                   label: str | None = None) -> Rollout:
        """This turn as a :class:`~rlhfkit.types.Rollout` (``sample_index`` defaults to ``turn_index``)."""
        return Rollout(prompt_token_ids=self.prompt_token_ids, response_token_ids=self.response_token_ids,
                       response_logprobs=self.response_logprobs, finish_reason=self.finish_reason,
                       prompt_index=prompt_index, weight_version=self.weight_version, response_text=self.content,
                       sample_index=self.turn_index if sample_index is None else sample_index, label=label)


def records_to_rollouts(records: Sequence[ChatRecord], *, prompt_index: int = 0,
                        label: str | None = None) -> list[Rollout]:
    """One Rollout per record, in order, all with ``prompt_index`` and ``sample_index`` = position in ``records``:
    the per-turn form of a conversation (per-turn losses). Each turn has its own prompt, so GRPO-style group
    estimators refuse them as one group; for that, one conversation is one sample: :func:`session_to_rollout`."""
    for index, record in enumerate(records):
        if not isinstance(record, ChatRecord):
            raise TypeError(f"records_to_rollouts: records[{index}] is {type(record).__name__}, not a ChatRecord")
    return [record.to_rollout(prompt_index=prompt_index, sample_index=index, label=label)
            for index, record in enumerate(records)]


def session_to_rollout(records: Sequence[ChatRecord], *, prompt_index: int = 0, sample_index: int = 0,
                       label: str | None = None) -> Rollout:
    """A whole conversation as one multi-turn :class:`~rlhfkit.types.Rollout` (one sample of a GRPO group).

    ``records``: one session's records in turn order, one choice per request. The rollout's prompt is the first
    request's; its response is every sampled response, each followed by the tokens the next request added (tool
    results, the next user message; loss weight 0, log-prob 0, the previous turn's weight version). Each request's
    prompt must begin with the previous prompt and response token for token: an agent that edits earlier messages, or
    a chat template that renders an answer differently from how it was sampled, is a ``ValueError`` naming the turn
    (training on re-tokenised text would not be training on what was sampled).
    """
    if not records:
        raise ValueError("session_to_rollout: no records")
    for index, record in enumerate(records):
        if not isinstance(record, ChatRecord):
            raise TypeError(f"session_to_rollout: records[{index}] is {type(record).__name__}, not a ChatRecord")
        if record.choice_index != 0 or record.session_id != records[0].session_id:
            raise ValueError(f"session_to_rollout: records[{index}] is choice {record.choice_index} of session "
                             f"{record.session_id!r}; pass one session's records with one choice per request (n=1)")
    ids, logprobs, mask, versions = [], [], [], []
    context = records[0].prompt_token_ids.tolist()
    for index, record in enumerate(records):
        prompt = record.prompt_token_ids.tolist()
        if prompt[:len(context)] != context:
            at = next((i for i, (a, b) in enumerate(zip(prompt, context, strict=False)) if a != b),
                      min(len(prompt), len(context)))
            raise ValueError(f"session_to_rollout: turn {record.turn_index} (records[{index}]) of session "
                             f"{record.session_id!r} does not continue the conversation token for token: its prompt "
                             f"differs from the previous prompt + response at token {at}")
        observation = prompt[len(context):]
        response = record.response_token_ids.tolist()
        previous = versions[-1] if versions else record.weight_version
        ids += observation + response
        logprobs += [0.0] * len(observation) + record.response_logprobs.float().tolist()
        mask += [False] * len(observation) + [True] * len(response)
        versions += [previous] * len(observation) + [record.weight_version] * len(response)
        context = prompt + response
    return Rollout(prompt_token_ids=records[0].prompt_token_ids, response_token_ids=torch.tensor(ids, dtype=torch.long),
                   response_logprobs=torch.tensor(logprobs, dtype=torch.float32),
                   response_loss_mask=torch.tensor(mask, dtype=torch.bool),
                   response_weight_versions=torch.tensor(versions, dtype=torch.long),
                   weight_version=min(r.weight_version for r in records), finish_reason=records[-1].finish_reason,
                   prompt_index=prompt_index, sample_index=sample_index, label=label,
                   response_text=records[-1].content)
