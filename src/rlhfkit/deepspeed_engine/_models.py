"""The HF models that :mod:`rlhfkit.deepspeed_engine` wraps: loading per role, and the value model of critics and
reward models (an HF backbone plus a scalar head, saved in the ``*ForSequenceClassification`` layout).

Needs ``rlhfkit[hf]`` (transformers) for loading; the value arithmetic is torch only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhfkit._optional import require
from rlhfkit.packing import VARLEN_ATTENTION, register_varlen_attention
from rlhfkit.types import PackedBatch

__all__ = ["ValueModel", "as_value_model", "load_hf_model", "token_aligned_values", "sequence_scores"]


class ValueModel(torch.nn.Module):
    """An HF backbone (``model.<base_model_prefix>``) and its scalar ``score`` head, as in
    ``AutoModelForSequenceClassification(num_labels=1)``; parameter names match that class, so its state dict loads
    back with ``from_pretrained``.

    ``forward(input_ids [1, T], position_ids [1, T])`` returns ``[1, T]`` head outputs in float32: entry ``t`` scores
    the prefix ending with token ``t``. It runs the backbone with ``attention_mask=None`` and ``use_cache=False`` so
    packed sequences stay separate (see :func:`rlhfkit.packing.packed_logits`).
    """

    def __init__(self, backbone: torch.nn.Module, score: torch.nn.Module, *, config, base_model_prefix: str,
                 architecture: str) -> None:
        super().__init__()
        self.base_model_prefix = base_model_prefix
        self.architecture = architecture
        self.config = config
        setattr(self, base_model_prefix, backbone)
        self.score = score

    @property
    def backbone(self) -> torch.nn.Module:
        return getattr(self, self.base_model_prefix)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: None = None,
                use_cache: bool = False, **attention_kwargs) -> torch.Tensor:
        """Takes what :func:`rlhfkit.packing.packed_inputs` gives; ``attention_kwargs`` are the packed-sequence
        boundaries some attention implementations take (``cu_seq_lens_q`` ...)."""
        if attention_mask is not None or use_cache:
            raise ValueError("ValueModel runs packed rows: attention_mask must be None and use_cache False (an "
                             "all-ones mask or a cache would let packed sequences attend to each other)")
        output = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False,
                               **attention_kwargs)
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        return self.score(hidden).squeeze(-1).float()


def as_value_model(model: torch.nn.Module) -> ValueModel:
    """Wrap an ``*ForSequenceClassification`` model with one label (or return a :class:`ValueModel` unchanged)."""
    if isinstance(model, ValueModel):
        return model
    prefix = getattr(model, "base_model_prefix", None)
    score = getattr(model, "score", None)
    if not prefix or not hasattr(model, prefix) or not isinstance(score, torch.nn.Linear):
        raise TypeError(f"a critic/reward model must be a ValueModel or an HF *ForSequenceClassification model with a "
                        f"'score' Linear head; got {type(model).__name__}")
    if score.out_features != 1:
        raise ValueError(f"the value head has out_features={score.out_features}; load the model with num_labels=1")
    return ValueModel(getattr(model, prefix), score, config=model.config, base_model_prefix=prefix,
                      architecture=type(model).__name__)


def load_hf_model(path: str | Path, *, role: str, bf16: bool, attn_implementation: str | None,
                  value_head_init_std: float | None, trust_remote_code: bool = False,
                  fused_kernels: str | None = None) -> torch.nn.Module:
    """Load the model of ``role`` from an HF folder: a causal LM (actor, reference) or a value model (critic,
    reward: ``AutoModelForSequenceClassification`` with ``num_labels=1``; a causal-LM checkpoint gets a fresh head).
    ``fused_kernels="liger"``: see :func:`apply_fused_kernels`."""
    transformers = require("transformers", user="rlhfkit.deepspeed_engine")
    kwargs = {"dtype": torch.bfloat16 if bf16 else torch.float32, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        if attn_implementation == VARLEN_ATTENTION:
            register_varlen_attention()
        kwargs["attn_implementation"] = attn_implementation
    causal = role in ("actor", "reference")
    model = (transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs) if causal else
             transformers.AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, **kwargs))
    if fused_kernels is not None:
        apply_fused_kernels(model, fused_kernels)
    if causal:
        return model
    value_model = as_value_model(model)
    if value_head_init_std is not None:
        with torch.no_grad():
            value_model.score.weight.normal_(mean=0.0, std=value_head_init_std)
            if value_model.score.bias is not None:
                value_model.score.bias.zero_()
    return value_model


def token_aligned_values(raw: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """``[T]`` values token aligned like log-probs: entry ``t`` is ``V(tokens before t)``, the value of the state in
    which token ``t`` was chosen (head output at ``t - 1``); 0 at each sequence's first token and on padding.

    Args:
        raw: ``[T]`` head outputs, entry ``t`` scoring the prefix ending with token ``t``.
    """
    shifted = torch.cat([raw.new_zeros(1), raw[:-1]])
    valid = torch.ones(raw.shape[0], dtype=torch.bool, device=raw.device)
    valid[batch.cu_seqlens[:-1].long()] = False
    valid[int(batch.cu_seqlens[-1]):] = False
    return torch.where(valid, shifted, torch.zeros((), dtype=raw.dtype, device=raw.device))


def sequence_scores(raw: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """``[N]`` head output at the last token of each sequence (a reward model's score of the whole sequence)."""
    return raw[batch.cu_seqlens[1:].long() - 1]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF model (also inside a :class:`ValueModel` or a peft wrapper): the modules whose
    class an HF model names in its ``_no_split_modules``. Raises naming the model when it names none or none is
    found."""
    names = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())}
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"compile_layers=True: found no decoder layers in {type(model).__name__} (an HF model names "
                         f"their class in _no_split_modules; this one names {sorted(names) or 'none'}); leave "
                         "compile_layers False")
    return layers


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """``torch.compile`` each of ``model``'s :func:`decoder_layers` in place (dynamic shapes: packed batches change
    length every step). The layers of one class share the compiled code (torch inlines module parameters as graph
    inputs), so a model compiles once per kind of call, not once per layer. Returns how many layers."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def apply_fused_kernels(model: torch.nn.Module, kind: str) -> None:
    """Swap ``model``'s RMSNorm, rotary embedding and SwiGLU MLP for Liger-Kernel's Triton kernels (``kind="liger"``;
    no fused cross-entropy: rlhfkit computes the log-probs). Raises before touching the model when CUDA is missing,
    Liger-Kernel is not installed (naming ``rlhfkit[liger]``), or Liger has no patch for the architecture."""
    if kind != "liger":
        raise ValueError(f"fused_kernels={kind!r}; expected 'liger'")
    if not torch.cuda.is_available():
        raise RuntimeError("fused_kernels='liger' needs CUDA (Liger-Kernel's kernels are Triton GPU kernels); "
                           "leave DeepSpeedEngineConfig.fused_kernels None on CPU")
    patches = require("liger_kernel.transformers.monkey_patch", extra="liger", user="rlhfkit.deepspeed_engine")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply = patches.MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ValueError(f"fused_kernels='liger': Liger-Kernel has no kernels for model_type={model_type!r} "
                         f"(it patches {sorted(patches.MODEL_TYPE_TO_APPLY_LIGER_FN)}); leave fused_kernels None")
    apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model)
