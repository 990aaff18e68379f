"""The models a hybrid run names, as folders: every hub id among ``HybridConfig.model`` and the roles'
``TrainerConfig.model`` resolved once on each node (:func:`rlhfkit.models.resolve_model_on_nodes`) before any
worker reads it, so that the engines and trainers load a folder. Needs Ray up (a cluster of several nodes gets one
task per node); a folder is passed through unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["resolve_run_models"]


def resolve_run_models(config: Any, trainers: Mapping[str, Any], *, env: Mapping[str, str],
                       timeout_s: float) -> tuple[Any, dict[str, Any]]:
    """``config`` (a :class:`~rlhfkit.hybrid.HybridConfig`) and ``trainers`` (role -> ``TrainerConfig``) with every
    model name replaced by its folder; ``env``: the workers' environment (its Hugging Face variables decide the
    cache on the other nodes); ``timeout_s`` bounds each node's resolution (a download)."""
    from rlhfkit.models import resolve_model_on_nodes

    names = [config.model, *(trainer.model for trainer in trainers.values() if trainer.model is not None)]
    folders = {name: os.fspath(resolve_model_on_nodes(name, env=env, timeout_s=timeout_s))
               for name in dict.fromkeys(names)}
    if all(os.path.isdir(os.path.expanduser(name)) for name in folders):
        return config, dict(trainers)  # folders as given: the user's configs themselves
    resolved = {role: trainer if trainer.model is None else dataclasses.replace(trainer, model=folders[trainer.model])
                for role, trainer in trainers.items()}
    return dataclasses.replace(config, model=folders[config.model]), resolved
