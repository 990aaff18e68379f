"""Lazy imports of optional heavy dependencies with errors that say what to install.

Every block imports vllm, ray, deepspeed and transformers through :func:`require`, inside the function that needs
them, so that ``import rlhfkit.<block>`` never pulls them in and a missing one names the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]

_EXTRA_OF_PACKAGE = {
    "transformers": "hf",
    "accelerate": "hf",
    "tokenizers": "hf",
    "safetensors": "hf",
    "ray": "ray",
    "deepspeed": "deepspeed",
    "vllm": "vllm",
    "peft": "lora",
    "liger_kernel": "liger",
    "pyarrow": "data",
    "datasets": "data",
    "tqdm": "examples",
    "matplotlib": "examples",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
}


def require(module: str, extra: str | None = None, *, user: str | None = None) -> ModuleType:
    """Import ``module`` or raise an ImportError naming the rlhfkit extra that provides it.

    Args:
        module: dotted module name, e.g. ``"vllm"`` or ``"ray.util.placement_group"``.
        extra: the rlhfkit extra that installs it; guessed from the top-level package when omitted.
        user: the rlhfkit module that needs it, named in the error (e.g. ``"rlhfkit.engines.vllm"``).
    """
    top = module.split(".", 1)[0]
    extra = extra or _EXTRA_OF_PACKAGE.get(top, "all")
    try:
        return importlib.import_module(module)
    except ImportError as error:
        who = f"{user} needs" if user else "this feature needs"
        raise ImportError(
            f"{who} the optional dependency '{top}' (import of '{module}' failed: {error}). "
            f"Install it with: pip install 'rlhfkit[{extra}]'"
        ) from error
