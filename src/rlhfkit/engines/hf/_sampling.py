"""Token sampling for the ``hf`` engine: temperature, top-k, top-p, greedy, seeded per-request generators.

Pure torch functions over ``[B, V]`` logits, used by :mod:`rlhfkit.engines.hf`. The reported log-prob of a sampled
token follows :mod:`rlhfkit.engines.protocol`: ``log_softmax(logits / temperature)`` before top-k/top-p truncation;
at temperature 0 (greedy) it is ``log_softmax(logits)`` of the raw distribution.

Sampling uses the exponential-race form of the categorical draw (``argmax(p / E)`` with ``E ~ Exp(1)``), which lets
every request draw its noise from its own ``torch.Generator``, so a seeded request gives the same tokens whatever
else shares its batch. Needs only torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["request_seed", "make_generators", "filter_logits", "sample_next_tokens"]

_MASK64 = (1 << 64) - 1


def request_seed(seed: int, request_index: int) -> int:
    """A 63-bit seed for request ``request_index`` of a call seeded with ``seed`` (splitmix64 finaliser, so
    neighbouring requests get unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + (request_index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def make_generators(seed: int, request_indices: Sequence[int], device: torch.device) -> list[torch.Generator]:
    """One generator per request, seeded from ``(seed, request_index)``."""
    generators = []
    for index in request_indices:
        generator = torch.Generator(device=device)
        generator.manual_seed(request_seed(seed, index))
        generators.append(generator)
    return generators


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k, then outside the top-p nucleus, to ``-inf``.

    Args:
        logits: ``[B, V]`` float, already divided by the temperature.
        top_k: keep the ``top_k`` largest logits per row (ties at the threshold are kept); 0 disables.
        top_p: keep the smallest set of most likely tokens whose mass reaches ``top_p``; 1 disables.

    Returns:
        ``[B, V]``: a filtered copy (the input is not modified).
    """
    filtered = logits.clone()
    vocab = filtered.shape[-1]
    if 0 < top_k < vocab:
        threshold = torch.topk(filtered, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < threshold, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(filtered, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove_sorted = mass_before >= top_p  # the most likely token always has mass_before == 0 and stays
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_index, remove_sorted)
        filtered = filtered.masked_fill(remove, float("-inf"))
    return filtered


def _exponential_noise(shape: torch.Size, device: torch.device,
                       generators: torch.Generator | list[torch.Generator] | None) -> torch.Tensor:
    if isinstance(generators, list):
        rows = [torch.empty(shape[-1], device=device, dtype=torch.float32).exponential_(generator=g)
                for g in generators]
        noise = torch.stack(rows)
    else:
        noise = torch.empty(shape, device=device, dtype=torch.float32).exponential_(generator=generators)
    # exponential_ can return exactly 0 for extreme draws; keep the division finite.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def sample_next_tokens(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                       generators: torch.Generator | list[torch.Generator] | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its log-prob.

    Args:
        logits: ``[B, V]`` raw model logits (any float dtype; computed in float32).
        temperature: 0 for greedy (argmax of the raw logits).
        top_k, top_p: truncation applied to the temperature-scaled distribution before sampling.
        generators: one generator per row, a shared generator, or None (torch's default generator).

    Returns:
        ``tokens [B]`` int64 and ``logprobs [B]`` float32, where ``logprobs = log_softmax(logits / temperature)``
        at the token (raw ``log_softmax(logits)`` when greedy), before any truncation.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        if top_k > 0 or top_p < 1.0:
            probs = torch.softmax(filter_logits(scaled, top_k=top_k, top_p=top_p), dim=-1)
        else:
            probs = logprobs.exp()
        noise = _exponential_noise(probs.shape, probs.device, generators)
        tokens = torch.argmax(probs / noise, dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
