"""LoRA adapters (Hu et al., 2021, arXiv:2106.09685) for the trainer and the rollout engines.

What it does: :class:`LoraConfig` (rank, alpha, target modules, dropout; :meth:`LoraConfig.from_peft` and
:func:`as_lora_config` take a ``peft.LoraConfig``), checked against a model before anything
expensive starts (:func:`check_target_modules`, :func:`check_target_modules_of`: an unknown target is a ValueError
listing the candidates, a target on the output layer a ValueError saying why); :func:`apply_lora` wraps an HF model
with HF ``peft`` so that only the adapters train; the adapter-only weight-sync contract: :func:`adapter_name`
(peft's saved-adapter names, ``base_model.model.<module>.lora_A.weight``, what vLLM parses too),
:func:`describe_adapter` (the ``(name, shape, dtype)`` a receiver expects, computed from the *base* model, so a rank
or shape mismatch fails the sync's manifest check before any byte moves), :func:`check_adapter_shapes` (every
received tensor's shape, checked by both engines before anything is applied) and :class:`AdapterMerger` (the HF
engine's way to apply a received adapter: the targeted weights become ``W0 + (alpha / r) * B @ A``, as ``peft``'s
``merge_and_unload`` computes them).

What it does not do: DoRA, rsLoRA, bias or embedding adapters, LoRA on critics or reward models, full-weight sync of
a LoRA-wrapped model (the base stays frozen: the engines keep theirs). Needs ``rlhfkit[lora]`` (peft) for
:func:`apply_lora`; the rest needs only torch (and transformers for :func:`check_target_modules_of`).
See ``docs/lora.md``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit._optional import require

__all__ = [
    "LoraConfig",
    "apply_lora",
    "as_lora_config",
    "check_target_modules",
    "check_target_modules_of",
    "describe_adapter",
    "describe_adapter_of",
    "lora_parameters",
]

_PREFIX = "base_model.model."
# Output layers by name (causal LM head, sequence-classification head), never adapted; so is the module a model's
# get_output_embeddings() returns.
OUTPUT_LAYER_NAMES = ("lm_head", "score")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """A LoRA adapter on the actor.

    Attributes:
        rank: ``r``, the adapters' inner dimension (``lora_A``: ``[r, in]``, ``lora_B``: ``[out, r]``).
        alpha: ``lora_alpha``; the update is scaled by ``alpha / rank``.
        target_modules: names of the ``Linear`` modules to adapt, matched as peft does: a module whose full name is
            the target or ends with ``"." + target`` (e.g. ``("q_proj", "v_proj")``).
        dropout: dropout on the adapter's input while training (0 keeps trainer and engine outputs equal).
    """

    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank={self.rank!r}; must be an int >= 1 (e.g. 16)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0 \
                or not math.isfinite(self.alpha):
            raise ValueError(f"LoraConfig.alpha={self.alpha!r}; must be a finite number > 0 (e.g. 2 * rank)")
        if isinstance(self.target_modules, str):
            raise TypeError(f"LoraConfig.target_modules={self.target_modules!r} is a str; give a tuple of module "
                            f"names, e.g. ({self.target_modules!r},)")
        if not isinstance(self.target_modules, tuple) or not self.target_modules \
                or not all(isinstance(name, str) and name for name in self.target_modules):
            raise TypeError(f"LoraConfig.target_modules={self.target_modules!r}; give a non-empty tuple of module "
                            "names, e.g. ('q_proj', 'v_proj')")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraConfig.dropout={self.dropout!r}; must be a number in [0, 1) (0 keeps trainer and "
                             "engine outputs equal)")

    @classmethod
    def from_peft(cls, config: Any) -> LoraConfig:
        """The :class:`LoraConfig` of a ``peft.LoraConfig``: ``r`` -> ``rank``, ``lora_alpha`` -> ``alpha``,
        ``target_modules`` (a list or set of module names) -> ``target_modules``, ``lora_dropout`` -> ``dropout``.
        Every other field must keep peft's default (``task_type`` may be ``"CAUSAL_LM"``): a set one (``use_dora``,
        ``use_rslora``, ``bias``, ``modules_to_save``, ``rank_pattern``, a regex or ``"all-linear"`` as
        ``target_modules``, ...) is a ValueError naming it, as is ``target_modules=None`` (peft's per-architecture
        guess: name the modules)."""
        if not _is_peft_lora(config):
            raise TypeError(f"LoraConfig.from_peft needs a peft.LoraConfig, got {type(config).__name__}")
        targets = config.target_modules
        if targets is None or isinstance(targets, str):
            raise ValueError(f"peft LoraConfig.target_modules={targets!r}; rlhfkit adapts the modules named in a "
                             "list (no regex, 'all-linear' or per-architecture default), e.g. ['q_proj', 'v_proj']")
        defaults = type(config)()
        for field in dataclasses.fields(config):
            if field.name in _PEFT_MAPPED or field.name in _PEFT_IGNORED:
                continue
            if getattr(config, field.name) != getattr(defaults, field.name):
                raise ValueError(f"peft LoraConfig.{field.name}={getattr(config, field.name)!r} is not supported by "
                                 f"rlhfkit's LoRA (rank, alpha, target_modules, dropout); leave it at "
                                 f"{getattr(defaults, field.name)!r}")
        if config.task_type not in (None, "CAUSAL_LM"):
            raise ValueError(f"peft LoraConfig.task_type={config.task_type!r}; rlhfkit adapts causal LMs "
                             "(task_type='CAUSAL_LM' or None)")
        return cls(rank=config.r, alpha=float(config.lora_alpha), target_modules=tuple(sorted(targets))
                   if isinstance(targets, (set, frozenset)) else tuple(targets), dropout=config.lora_dropout)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_dict(self) -> dict[str, Any]:
        """The adapter's ``adapter_config.json`` fields (what peft and vLLM's ``PEFTHelper`` read)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": list(self.target_modules), "lora_dropout": self.dropout, "bias": "none",
                "use_rslora": False, "use_dora": False, "modules_to_save": None}


# peft.LoraConfig fields from_peft maps, and those that describe the file rather than the adapter
_PEFT_MAPPED = ("r", "lora_alpha", "target_modules", "lora_dropout", "task_type")
_PEFT_IGNORED = ("peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
                 "runtime_config", "megatron_core")


def _is_peft_lora(value: Any) -> bool:
    peft = sys.modules.get("peft")  # a peft config exists only where peft is imported: no import here
    return peft is not None and isinstance(value, peft.LoraConfig)


def as_lora_config(value: Any, *, where: str = "lora") -> LoraConfig | None:
    """``value`` as an rlhfkit :class:`LoraConfig`: None and a :class:`LoraConfig` as they are, a
    ``peft.LoraConfig`` through :meth:`LoraConfig.from_peft`; anything else is a TypeError naming ``where``."""
    if value is None or isinstance(value, LoraConfig):
        return value
    if _is_peft_lora(value):
        return LoraConfig.from_peft(value)
    raise TypeError(f"{where}={value!r}; expected an rlhfkit.lora.LoraConfig, a peft.LoraConfig or None")


def _matches(module_name: str, targets: Iterable[str]) -> bool:
    return any(module_name == target or module_name.endswith("." + target) for target in targets)


def _linear_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def _output_layers(model: torch.nn.Module) -> set[str]:
    """Names of ``model``'s output layers: Linear modules named ``lm_head`` / ``score``, and the module
    ``get_output_embeddings()`` returns (e.g. GPT-NeoX's ``embed_out``)."""
    names = {name for name, _ in _linear_modules(model) if name.rpartition(".")[2] in OUTPUT_LAYER_NAMES}
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    if isinstance(output, torch.nn.Module):
        names.update(name for name, module in model.named_modules() if module is output)
    return names


def _targeted(model: torch.nn.Module, config: LoraConfig) -> list[tuple[str, torch.nn.Linear]]:
    """The Linear modules ``config`` adapts, in ``named_modules`` order (never an output layer:
    :func:`check_target_modules` refuses targets on it)."""
    output = _output_layers(model)
    return [(name, module) for name, module in _linear_modules(model)
            if _matches(name, config.target_modules) and name not in output]


def check_target_modules(model: torch.nn.Module, config: LoraConfig, *, where: str = "the model") -> None:
    """Raise ValueError naming every target of ``config`` that matches no Linear module of ``model``, with the
    candidates (the distinct last names of its Linear modules), or that matches its output layer (``lm_head``:
    not supported, see below)."""
    names = [name for name, _ in _linear_modules(model)]
    output = _output_layers(model)
    # An adapter on the output layer cannot be pushed: the engines' adapter manifests (describe_adapter) and the
    # merge cover hidden-layer projections only, and in a model with tied embeddings merging into the output layer
    # would change the input embeddings too, which the trainer's adapter leaves alone.
    on_output = [(target, name) for target in config.target_modules for name in sorted(output)
                 if _matches(name, (target,))]
    if on_output:
        target, name = on_output[0]
        raise ValueError(f"LoraConfig.target_modules={config.target_modules!r}: {target!r} targets the output layer "
                         f"{name!r} of {where}; adapters on the output layer are not supported (the adapter push and "
                         "the engines' merge cover the hidden-layer projections only, and a tied output layer shares "
                         f"its weight with the input embeddings); remove {target!r} from target_modules")
    missing = [target for target in config.target_modules if not any(_matches(name, (target,)) for name in names)]
    if missing:
        candidates = sorted({name.rpartition(".")[2] for name in names if name not in output})
        raise ValueError(f"LoraConfig.target_modules={config.target_modules!r}: {missing} match no Linear module of "
                         f"{where}; candidates: {candidates}")


def meta_model(model_path: str) -> torch.nn.Module:
    """The causal LM saved at ``model_path`` built on the meta device from its config: no weights are read or
    allocated, cheap at any size (target checks, adapter descriptions, the hybrid run's memory estimate)."""
    transformers = require("transformers", user="rlhfkit.lora")
    model_config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(model_config)


def check_target_modules_of(model_path: str, config: LoraConfig) -> None:
    """:func:`check_target_modules` on the model saved at ``model_path``, built on the meta device (no weights
    are read or allocated: cheap at any size)."""
    check_target_modules(meta_model(model_path), config, where=f"the model at {model_path!r}")


def describe_adapter_of(model_path: str, config: LoraConfig, *, dtype: torch.dtype) -> list[tuple]:
    """:func:`describe_adapter` of the model saved at ``model_path``, built on the meta device (for receivers that
    hold no HF model, e.g. a vLLM engine)."""
    return describe_adapter(meta_model(model_path), config, dtype=dtype, where=f"the model at {model_path!r}")


def apply_lora(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters on ``config.target_modules``: the base weights are frozen
    (``requires_grad=False``), ``lora_A`` is random and ``lora_B`` zero (the wrapped model starts equal to the base).
    Raises ValueError for an unknown target before peft touches the model."""
    check_target_modules(model, config)
    peft = require("peft", user="rlhfkit.lora")
    peft_config = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules),
                                  lora_dropout=config.dropout, bias="none", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, peft_config)


def adapter_name(parameter_name: str) -> str | None:
    """The sync name of a peft parameter (``...q_proj.lora_A.default.weight`` -> ``base_model.model...q_proj.lora_A.
    weight``, as peft saves adapters), or None for a parameter that is not an adapter weight."""
    for part in ("lora_A", "lora_B"):
        marker = f".{part}."
        if marker in parameter_name:
            head, _, tail = parameter_name.partition(marker)
            if tail.endswith("weight"):
                head = head if head.startswith(_PREFIX) else _PREFIX + head
                return f"{head}.{part}.weight"
    return None


def adapter_modules(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """``{module name: (lora_A name, lora_B name)}`` of adapter tensors named as :func:`adapter_name` gives; the
    module name is what vLLM's ``parse_fine_tuned_lora_name`` gives (``base_model.model.`` and ``.lora_X.weight``
    stripped, e.g. ``model.layers.0.self_attn.q_proj``; vLLM packs q/k/v and gate/up into its fused modules itself).
    Raises ValueError for a name that is not an adapter weight or a module missing one of its two tensors.
    Torch-free: the vLLM worker and :class:`AdapterMerger` both pair and check adapters with it."""
    parts: dict[str, dict[str, str]] = {}
    for name in names:
        module, dot, tail = str(name).removeprefix(_PREFIX).rpartition(".lora_")
        if not dot or tail not in ("A.weight", "B.weight"):
            raise ValueError(f"adapter tensor {name!r} is not a LoRA weight; expected peft's saved names "
                             "'base_model.model.<module>.lora_A.weight' / '.lora_B.weight' (rlhfkit.lora.adapter_name)")
        parts.setdefault(module, {})[tail[0]] = str(name)
    incomplete = [module for module, found in parts.items() if len(found) != 2]
    if incomplete:
        raise ValueError(f"adapter incomplete: {len(incomplete)} module(s) lack lora_A or lora_B, e.g. "
                         f"{incomplete[:3]}")
    return {module: (found["A"], found["B"]) for module, found in parts.items()}


def lora_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(sync name, parameter)`` of every adapter weight of a peft-wrapped ``model``, in module order."""
    out = []
    for name, param in model.named_parameters():
        synced = adapter_name(name)
        if synced is not None:
            out.append((synced, param))
    return out


def describe_adapter(model: torch.nn.Module, config: LoraConfig, *, dtype: torch.dtype,
                     where: str = "the model") -> list[tuple]:
    """``(name, shape, dtype)`` of the adapter a LoRA ``config`` gives the *base* ``model`` (``lora_A``: ``[r,
    in]``, ``lora_B``: ``[out, r]``), in the order peft's parameters come: what a receiver expects. An unknown
    target is a ValueError (:func:`check_target_modules`; ``where`` names the model in it)."""
    check_target_modules(model, config, where=where)
    specs = []
    for name, module in _targeted(model, config):
        specs.append((f"{_PREFIX}{name}.lora_A.weight", (config.rank, module.in_features), dtype))
        specs.append((f"{_PREFIX}{name}.lora_B.weight", (module.out_features, config.rank), dtype))
    return specs


def check_adapter_shapes(shapes: Mapping[str, Sequence[int]], *, rank: int,
                         features: Mapping[str, tuple[int, int]] | None = None) -> dict[str, tuple[str, str]]:
    """Pair adapter tensors (:func:`adapter_modules`) and check every shape: ``lora_A`` is ``[rank, in]``,
    ``lora_B`` is ``[out, rank]``, with ``(in, out)`` the module's from ``features`` (``{module name: (in_features,
    out_features)}``, names as :func:`adapter_modules` gives them) when it lists the module, else any. Raises
    ValueError naming the first tensor whose shape differs, its shape and the expected one: an adapter of another
    rank would otherwise apply with the wrong scale (``alpha / rank`` of the config). Returns the pairs. Torch-free:
    both engines call it on the received adapter before anything is applied."""
    pairs = adapter_modules(shapes)
    for module, (name_a, name_b) in pairs.items():
        in_features, out_features = features.get(module, (None, None)) if features is not None else (None, None)
        for name, want in ((name_a, (rank, in_features)), (name_b, (out_features, rank))):
            shape = tuple(int(size) for size in shapes[name])
            if len(shape) != 2 or any(size != expected for size, expected in zip(shape, want) if expected is not None):
                expected = "(" + ", ".join("*" if size is None else str(size) for size in want) + ")"
                raise ValueError(f"adapter tensor {name!r} has shape {shape}; expected {expected} (LoraConfig.rank="
                                 f"{rank}: lora_A is [rank, in_features], lora_B [out_features, rank]); send the "
                                 "adapter of the LoraConfig the receiver was given")
    return pairs


class AdapterMerger:
    """Applies adapters to a plain (unwrapped) model in place: each targeted weight becomes ``W0 + scaling * B @ A``
    computed in float32 from a kept copy of ``W0``, so successive adapters never accumulate. Used by the HF engine.

    Args:
        model: the engine's causal LM (its base weights stay the ones it holds when the merger is built).
        config: the adapter's LoRA configuration.
        previous: the merger of the adapter applied so far under another config, if any: its kept base weights are
            this merger's base (the model holds its merged ones), and its modules that ``config`` does not target
            get their base weights back at this merger's first successful merge.
    """

    def __init__(self, model: torch.nn.Module, config: LoraConfig, *, previous: AdapterMerger | None = None) -> None:
        self.config = config
        self.modules = dict(_targeted(model, config))  # keyed as adapter_modules names them (no prefix)
        if not self.modules:
            check_target_modules(model, config)
        kept = previous.base if previous is not None else {}
        self.base = {name: kept[name] if name in kept else module.weight.detach().float().cpu().clone()
                     for name, module in self.modules.items()}
        self._restore = {} if previous is None else {
            name: (module, previous.base[name]) for name, module in previous.modules.items()
            if name not in self.modules}

    def merge(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Merge the adapter in ``tensors`` (sync names; every targeted module's ``lora_A`` and ``lora_B``, each
        copied as it arrives). All or nothing: every tensor is taken, its name checked (:func:`adapter_modules`,
        then against the targeted modules) and its shape checked (:func:`check_adapter_shapes`), and every new
        weight computed, before any weight changes; an error leaves the model as it was. Returns how many tensors
        were taken."""
        received: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            if str(name) in received:
                raise ValueError(f"adapter tensor {str(name)!r} arrived twice; send each adapter tensor once")
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise TypeError(f"adapter tensor {str(name)!r} is {getattr(tensor, 'dtype', type(tensor).__name__)}; "
                                "expected a floating-point torch.Tensor")
            received[str(name)] = tensor.detach().float().cpu().clone()
        pairs = adapter_modules(received)
        unknown = [module for module in pairs if module not in self.modules]
        if unknown:
            raise ValueError(f"adapter tensor {pairs[unknown[0]][0]!r} names no adapted module; expected "
                             f"'<module>.lora_A.weight' / '.lora_B.weight' for one of "
                             f"{[_PREFIX + name for name in sorted(self.modules)[:4]]}...")
        missing = [name for name in self.modules if name not in pairs]
        if missing:
            raise ValueError(f"adapter incomplete: no lora_A/lora_B for {missing[:4]} ({len(missing)} modules)")
        check_adapter_shapes({name: tensor.shape for name, tensor in received.items()}, rank=self.config.rank,
                             features={name: (module.in_features, module.out_features)
                                       for name, module in self.modules.items()})
        # Every new weight exists (in host memory, in the weight's dtype) before the first copy: nothing left to
        # fail between the first copy and the last but the copies themselves.
        updates = []
        for name, module in self.modules.items():
            name_a, name_b = pairs[name]
            delta = received[name_b] @ received[name_a] * self.config.scaling
            updates.append((module, (self.base[name] + delta).to(module.weight.dtype)))
        updates += [(module, base.to(module.weight.dtype)) for module, base in self._restore.values()]
        with torch.no_grad():
            for module, weight in updates:
                module.weight.copy_(weight)
        self._restore = {}
        return len(received)
