"""Weight lifecycle of the ``hf`` engine: offload (sleep level 1), discard (level 2), wake, and validated loading.

Parameters keep their identity across sleep and wake (only ``param.data`` is swapped), so tied weights stay tied
and references held elsewhere stay valid. Used by :mod:`rlhfkit.engines.hf`; needs only torch.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable

import torch

__all__ = ["EngineWeightState"]

logger = logging.getLogger(__name__)


class EngineWeightState:
    """Where a model's weights are (awake on their device, offloaded to CPU, or discarded) and what is missing.

    Attributes:
        device: the device the weights live on while awake (that of the first parameter).
        awake: whether the weights are usable.
        level: 0 awake, 1 offloaded to host memory (a no-op on CPU), 2 discarded.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        if not self.params:
            raise ValueError("the engine's model has no parameters")
        self.buffers = dict(model.named_buffers(remove_duplicate=False))
        self.device = next(iter(self.params.values())).device
        self.awake = True
        self.level = 0
        self._unique = {id(p): p for p in self.params.values()}
        self._name_of = {}
        for name, param in self.params.items():
            self._name_of.setdefault(id(param), name)
        self._discarded: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._missing: set[int] = set()
        self._failed_load: str | None = None

    # ---------------------------------------------------------------- sleep / wake
    def sleep(self, level: int) -> None:
        if level == 1 and self.level == 0 and self.device.type != "cpu":
            self._move_all(torch.device("cpu"))
        if level == 2 and self.level < 2:
            self._discarded = {key: (p.shape, p.dtype) for key, p in self._unique.items()}
            for param in self._unique.values():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self._move_buffers(torch.device("cpu"))
            self._missing = set(self._unique)
        self.level = max(self.level, level)
        self.awake = False

    def wake(self) -> None:
        if self.awake:
            return
        if self.level == 2:
            for key, param in self._unique.items():
                shape, dtype = self._discarded[key]
                param.data = torch.empty(shape, dtype=dtype, device=self.device)
            self._move_buffers(self.device)
            self._discarded = {}
            logger.info("hf engine: weights woke after sleep(level=2) uninitialised; load all %d tensors before "
                        "generating", len(self._unique))
        elif self.level == 1 and self.device.type != "cpu":
            self._move_all(self.device)
        self.level = 0
        self.awake = True

    def _move_all(self, device: torch.device) -> None:
        for param in self._unique.values():
            param.data = param.data.to(device)
        self._move_buffers(device)

    def _move_buffers(self, device: torch.device) -> None:
        for module in self.model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
        self.buffers = dict(self.model.named_buffers(remove_duplicate=False))

    # ---------------------------------------------------------------- loading
    def check_complete(self) -> None:
        """Raise RuntimeError if a failed load left the weights mixed or a level-2 wake left some uninitialised."""
        if self._failed_load is not None:
            raise RuntimeError(f"{self._failed_load}; the model holds a mix of old and new weights. Call "
                               "load_weights() again with a complete stream before generate()")
        if self._missing:
            names = sorted(self._name_of[key] for key in self._missing)
            raise RuntimeError(f"{len(names)} of {len(self._unique)} parameters are uninitialised after "
                               f"sleep(level=2) (e.g. {names[:3]}); load them with load_weights() before generate()")

    def _target(self, name: str) -> torch.Tensor:
        if name in self.params:
            return self.params[name]
        if name in self.buffers:
            return self.buffers[name]
        close = difflib.get_close_matches(name, list(self.params) + list(self.buffers), n=3)
        hint = f"; close names: {close}" if close else ""
        raise ValueError(f"load_weights(): unknown tensor name {name!r}; the model has no parameter or buffer of "
                         f"that name{hint}. Names must be HF state-dict names (model.named_parameters())")

    def _validate(self, name: str, tensor: object, target: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"load_weights(): {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.shape != target.shape:
            raise ValueError(f"load_weights(): {name!r} has shape {tuple(tensor.shape)} but the model expects "
                             f"{tuple(target.shape)}; nothing of this tensor was copied")
        if tensor.is_floating_point() != target.is_floating_point():
            raise ValueError(f"load_weights(): {name!r} has dtype {tensor.dtype} but the model holds "
                             f"{target.dtype}; floating and integer tensors do not convert")

    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Validate then copy each ``(name, tensor)``; returns the count. See ``HFEngine.load_weights``."""
        if not self.awake:
            raise RuntimeError("load_weights() called while the engine's weights are asleep; call "
                               "wake_up(['weights']) first")
        count = 0
        try:
            for item in items:
                if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                    raise TypeError(f"load_weights() takes (name, tensor) pairs; item {count} is {type(item).__name__}")
                name, tensor = item
                target = self._target(name)
                self._validate(name, tensor, target)
                with torch.no_grad():
                    target.copy_(tensor)
                self._missing.discard(id(target))
                count += 1
        except BaseException:
            if count:
                self._failed_load = f"load_weights() failed after applying {count} tensor(s)"
            raise
        self._failed_load = None
        return count
