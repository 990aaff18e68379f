"""A variable-length causal attention for packed sequences, for transformers' attention registry (use via
:mod:`rlhfkit.packing`).

transformers' eager and sdpa paths handle a packed row by building a dense block-diagonal ``[T, T]`` mask: correct,
but every masked block is still computed, so a packed micro-batch of ``T`` tokens pays ``T^2`` attention however
short its sequences are. flash-attention's varlen kernel skips those blocks but is not available everywhere (never on
CPU). This implementation runs ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` once per
sequence when it is given the boundaries (``cu_seq_lens_q`` — :func:`rlhfkit.packing.packed_logits` passes them),
and otherwise delegates to transformers' own sdpa path with the mask transformers built, so generation with a cache,
padded batches and unpacked rows behave exactly like ``attn_implementation="sdpa"``. Needs ``rlhfkit[hf]``.
"""

from __future__ import annotations

import torch

from rlhfkit._optional import require

__all__ = ["VARLEN_ATTENTION", "register_varlen_attention"]

VARLEN_ATTENTION = "rlhfkit_varlen_sdpa"


def _varlen_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         **kwargs):
    """``query [1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]`` → ``([1, T, H, D], None)`` like transformers."""
    cu, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    packed = (cu is not None and cu_k is not None and query.shape[0] == 1 and query.shape[2] == key.shape[2]
              and is_causal is not False and (cu_k is cu or torch.equal(cu_k, cu)))
    if not packed:
        sdpa = require("transformers.integrations.sdpa_attention", user="rlhfkit.packing")
        return sdpa.sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, is_causal=is_causal, **kwargs)
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q={bounds} must start at 0 and end at the {query.shape[2]} packed tokens")
    gqa = key.shape[1] != query.shape[1]
    dropout_p = dropout if module.training else 0.0
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], dropout_p=dropout_p,
            is_causal=True, scale=scaling, enable_gqa=gqa)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


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
