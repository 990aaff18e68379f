"""A variable-length causal attention for packed sequences, for transformers' attention registry (use via
:mod:`rlhfkit.packing`).

transformers' eager and sdpa paths handle a packed row by building a dense block-diagonal ``[T, T]`` mask: correct,
but every masked block is still computed, so a packed micro-batch of ``T`` tokens pays ``T^2`` attention however
short its sequences are. flash-attention's varlen kernel skips those blocks but is not available everywhere (never on
CPU, nor in float32). This implementation is given the boundaries (``cu_seq_lens_q`` — :func:`rlhfkit.packing.
packed_logits` passes them) and, inside the attention only, scatters the packed queries, keys and values into a
right-padded ``[N, H, L_max, D]`` batch, runs one ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``
on it and gathers the packed rows back. With right padding the causal mask alone keeps every real query off the
padding, so the result is exact, and attention costs ``N * L_max^2`` instead of ``T^2`` while the rest of the model
still runs on the ``T`` packed tokens only. Without boundaries it delegates to transformers' own sdpa path with the
mask transformers built, so generation with a cache, padded batches and unpacked rows behave exactly like
``attn_implementation="sdpa"``; so do layers with a sliding window or logit soft-capping, which the plain causal mask
would get wrong. Needs ``rlhfkit[hf]``.
"""

from __future__ import annotations

import torch

from rlhfkit._optional import require

__all__ = ["VARLEN_ATTENTION", "register_varlen_attention"]

VARLEN_ATTENTION = "rlhfkit_varlen_sdpa"


PADDED_INDEX_KWARG = "rlhfkit_padded_index"  # packed_inputs passes padded_index() under it: one per forward


def padded_index(cu: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row, column)`` of every packed token in the right-padded batch, computed on ``cu``'s device (no sync)."""
    positions = torch.arange(num_tokens, device=cu.device)
    row = torch.searchsorted(cu[1:].to(torch.int64), positions, right=True)
    return row, positions - cu.to(torch.int64)[row]


def _varlen_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         **kwargs):
    """``query [1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]`` → ``([1, T, H, D], None)`` like transformers."""
    cu, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    plain_causal = (window is None or window <= 0) and softcap is None  # else transformers' mask/kernel handles it
    packed = (plain_causal and cu is not None and cu_k is not None and query.shape[0] == 1
              and query.shape[2] == key.shape[2] and is_causal is not False and (cu_k is cu or torch.equal(cu_k, cu)))
    if not packed:
        sdpa = require("transformers.integrations.sdpa_attention", user="rlhfkit.packing")
        return sdpa.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, is_causal=is_causal, **kwargs)
    num_tokens, num_sequences = query.shape[2], cu.numel() - 1
    max_length = kwargs.get("max_length_q")
    if not isinstance(max_length, int):  # one host sync; packed_logits passes it as an int
        lengths = (cu[1:] - cu[:-1]).tolist()
        if cu[0].item() != 0 or sum(lengths) != num_tokens or min(lengths, default=0) < 0:
            raise ValueError(f"cu_seq_lens_q={cu.tolist()} must rise from 0 to the {num_tokens} packed tokens")
        max_length = max(lengths, default=0)
    index = kwargs.get(PADDED_INDEX_KWARG)  # from packed_inputs: the same boundaries, computed once per forward
    row, column = index if index is not None and index[0].numel() == num_tokens else padded_index(cu, num_tokens)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [N, H, L, D]
        tokens = x[0].transpose(0, 1)  # [T, H, D]
        out = tokens.new_zeros(num_sequences, max_length, *tokens.shape[1:])
        return out.index_put((row, column), tokens).transpose(1, 2)

    if key.shape[1] != query.shape[1]:  # grouped-query attention: one kv head per group of query heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    dropout_p = dropout if module.training else 0.0
    output = torch.nn.functional.scaled_dot_product_attention(padded(query), padded(key), padded(value),
                                                              dropout_p=dropout_p, is_causal=True, scale=scaling)
    return output.transpose(1, 2)[row, column][None], None  # [1, T, H, D]


def register_varlen_attention() -> str:
    """Register the varlen attention with transformers (idempotent) and return its name for ``attn_implementation``.

    Example::

        name = rlhfkit.packing.register_varlen_attention()
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

    It changes transformers' global attention registries (adds one entry); nothing else.
    """
    modeling_utils = require("transformers.modeling_utils", user="rlhfkit.packing")
    masking_utils = require("transformers.masking_utils", user="rlhfkit.packing")
    modeling_utils.AttentionInterface.register(VARLEN_ATTENTION, _varlen_sdpa_forward)
    # Masks are built as for sdpa, so every case this implementation delegates gets exactly sdpa's mask.
    masking_utils.AttentionMaskInterface.register(VARLEN_ATTENTION, masking_utils.sdpa_mask)
    return VARLEN_ATTENTION
