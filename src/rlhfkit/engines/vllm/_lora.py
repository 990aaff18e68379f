"""LoRA adapters pushed into vLLM in memory: the engine's bookkeeping of adapter ids (:class:`AdapterSlots`) and the
worker-side registration (:func:`register_adapter`, :func:`remove_adapters`), which the worker extension
(:mod:`rlhfkit.engines.vllm._worker`) calls. The adapter names are paired and the shapes checked by
:func:`rlhfkit.lora.check_adapter_shapes`, as the HF engine's :class:`rlhfkit.lora.AdapterMerger` does.

How an adapter gets in (no filesystem): the trainer's adapter tensors (peft's saved names,
``base_model.model.<module>.lora_A.weight``) arrive through the weight-sync receiver; the worker builds vLLM's
``LoRAModel.from_lora_tensors`` with a ``PEFTHelper`` made from :meth:`rlhfkit.lora.LoraConfig.peft_dict` and adds it
to the worker's LoRA manager (``model_runner.lora_manager._adapter_manager.add_adapter``: vLLM's own
``add_adapter(LoRARequest)`` would read the adapter from ``lora_path``) under the integer id = the sync's weight
version, once every tensor's shape agrees with the config's rank (:func:`rlhfkit.lora.check_adapter_shapes`, shared
with the HF engine). Generation then asks for that id with a ``LoRARequest`` whose ``lora_path`` is never read (the id
is registered, so vLLM only activates it).

What it does not do: load adapters from disk, serve several different adapters at once, DoRA / rsLoRA / embedding
adapters. Needs vLLM only in the worker functions (imported there, inside the worker process).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from rlhfkit.lora import OUTPUT_LAYER_NAMES, adapter_modules, check_adapter_shapes

__all__ = ["AdapterSlots", "adapter_path", "check_adapter_support", "register_adapter", "remove_adapters"]


def adapter_path(adapter_id: int) -> str:
    """The ``LoRARequest.lora_path`` of an in-memory adapter: never read (vLLM finds the id registered), but named
    so that an error about it says where it came from."""
    return f"rlhfkit-in-memory-adapter/v{adapter_id}"


class AdapterSlots:
    """The engine side's adapter ids: the newest one (what generation uses), how many generate calls use each id,
    and the replaced ids waiting to be removed from the workers once no call uses them.

    With vLLM's synchronous ``LLM.generate`` a call's requests have all finished when the call returns, so an id is
    "in use" from :meth:`acquire` (before ``generate``) to :meth:`release` (after it). At most ``capacity`` ids are
    registered in the workers (vLLM's ``max_cpu_loras``): :meth:`check_room` refuses a new one while replaced ids still
    in use fill them. Thread-safe (generate calls may overlap a sync in another thread).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError(f"capacity={capacity}; an adapter swap needs room for the new and the previous adapter")
        self.capacity = capacity
        self.current: int | None = None
        self._users: dict[int, int] = {}
        self._retired: list[int] = []
        self._lock = threading.Lock()

    @property
    def registered(self) -> list[int]:
        """Ids registered in the workers (replaced ones not removed yet, then the current one)."""
        with self._lock:
            return self._retired + ([] if self.current is None else [self.current])

    def check_room(self) -> None:
        """Raise RuntimeError when a new adapter would not fit next to the registered ones (before any transfer)."""
        with self._lock:
            held = len(self._retired) + (self.current is not None)
            if held >= self.capacity:
                busy = {i: self._users.get(i, 0) for i in self._retired}
                raise RuntimeError(f"no room for a new adapter: {held} registered (capacity {self.capacity}); the "
                                   f"replaced adapters {busy} (id: generate calls using it) are still in use; let "
                                   "those generate calls finish, or raise VLLMEngineConfig.max_loras")

    def install(self, adapter_id: int) -> list[int]:
        """Make ``adapter_id`` (just registered in the workers) the current one; returns the ids to remove now."""
        with self._lock:
            if self.current is not None and adapter_id <= self.current:
                raise RuntimeError(f"adapter id {adapter_id} is not newer than the current one ({self.current})")
            if self.current is not None:
                self._retired.append(self.current)
            self.current = adapter_id
            return self._removable()

    def acquire(self) -> int | None:
        """The id a generate call should use (None: no adapter yet, the base model), counted as in use."""
        with self._lock:
            if self.current is not None:
                self._users[self.current] = self._users.get(self.current, 0) + 1
            return self.current

    def release(self, adapter_id: int | None) -> list[int]:
        """End a generate call that used ``adapter_id``; returns the ids to remove now."""
        with self._lock:
            if adapter_id is not None:
                left = self._users.get(adapter_id, 0) - 1
                if left > 0:
                    self._users[adapter_id] = left
                else:
                    self._users.pop(adapter_id, None)
            return self._removable()

    def removed(self, ids: Iterable[int]) -> None:
        """Forget ``ids`` once the workers have removed them."""
        with self._lock:
            gone = set(ids)
            self._retired = [i for i in self._retired if i not in gone]

    def _removable(self) -> list[int]:
        return [i for i in self._retired if not self._users.get(i)]


# --- worker side (runs inside a vLLM worker process) -----------------------------------------------------------------
def _lora_manager(worker: Any) -> Any:
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None or getattr(manager, "_adapter_manager", None) is None:
        raise RuntimeError("this vLLM engine was started without LoRA support; build it with "
                           "VLLMEngineConfig(enable_lora=True, max_lora_rank=...)")
    return manager


def _vllm_lora_model_class() -> Any:
    import importlib

    for module in ("vllm.lora.lora_model", "vllm.lora.models"):  # 0.11+ / 0.10
        try:
            return importlib.import_module(module).LoRAModel
        except (ImportError, AttributeError):
            continue
    raise ImportError("vLLM's LoRAModel was found in neither vllm.lora.lora_model nor vllm.lora.models")


def _peft_helper(manager: Any, peft: Mapping[str, Any]) -> Any:
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_dict({**peft, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)  # rank <= max_lora_rank, no DoRA / bias / modules_to_save
    return helper


def check_adapter_support(worker: Any, peft: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """Before any transfer: this worker serves LoRA, ``peft`` (an ``adapter_config.json`` dict) passes vLLM's
    ``PEFTHelper.validate_legal`` and every module of ``names`` is one vLLM can adapt in this model. Raises
    ValueError naming what does not fit."""
    manager = _lora_manager(worker)
    targets = {module.rpartition(".")[2] for module in adapter_modules(names)}
    on_output = sorted(targets & set(OUTPUT_LAYER_NAMES))  # vLLM may list lm_head; rlhfkit never adapts it
    if on_output:
        raise ValueError(f"LoraConfig.target_modules: adapters on the output layer {on_output} are not supported; "
                         "remove it from target_modules (rlhfkit.lora.check_target_modules says why)")
    _peft_helper(manager, peft)
    adapters = manager._adapter_manager
    packed = getattr(adapters, "packed_modules_mapping", {}) or {}
    supported: set[str] = set()
    for module in getattr(adapters, "supported_lora_modules", ()):
        supported.update(packed.get(module, [module]))
    unsupported = sorted(targets - supported)
    if supported and unsupported:
        raise ValueError(f"LoraConfig.target_modules: vLLM cannot serve adapters on {unsupported} in this model; "
                         f"it adapts {sorted(supported)}")
    return {"rank": int(getattr(worker, "rank", 0)), "capacity": int(adapters.capacity),
            "max_lora_rank": int(manager.lora_config.max_lora_rank)}


def register_adapter(worker: Any, adapter_id: int, tensors: Mapping[str, torch.Tensor],
                     peft: Mapping[str, Any]) -> list[int]:
    """Build vLLM's ``LoRAModel`` from ``tensors`` (peft names, full unsharded shapes: each tensor-parallel rank
    slices its part when the adapter is activated) and register it under ``adapter_id``; the tensors stay on the
    device they arrived on. Returns the registered ids. Refuses (RuntimeError) when the manager is full, rather than
    let vLLM's LRU cache silently evict an adapter a request may still use. Raises ValueError, before anything is
    built, for a tensor whose shape does not fit ``peft["r"]`` (vLLM would serve an adapter of another rank up to
    ``max_lora_rank`` scaled by ``lora_alpha / r``: the wrong update)."""
    manager = _lora_manager(worker)
    adapters = manager._adapter_manager
    check_adapter_shapes({name: tensor.shape for name, tensor in tensors.items()}, rank=int(peft["r"]))
    registered = set(manager.list_adapters())
    if adapter_id in registered:
        raise RuntimeError(f"adapter id {adapter_id} is already registered in vLLM worker rank "
                           f"{int(getattr(worker, 'rank', 0))}")
    if len(registered) >= adapters.capacity:
        raise RuntimeError(f"vLLM worker rank {int(getattr(worker, 'rank', 0))} holds {sorted(registered)} adapters "
                           f"(capacity {adapters.capacity}); remove one first")
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and callable(getattr(mapper, "get_rename_mapper", None)):
        mapper = mapper.get_rename_mapper()  # vLLM 0.32: renames only (as its own _load_adapter does)
    device = next(iter(tensors.values())).device
    lora = _vllm_lora_model_class().from_lora_tensors(
        lora_model_id=int(adapter_id), tensors=dict(tensors), peft_helper=_peft_helper(manager, peft),
        device=str(device), dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper, skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    adapters.add_adapter(lora)
    return sorted(manager.list_adapters())


def remove_adapters(worker: Any, ids: Iterable[int]) -> list[int]:
    """Remove ``ids`` from this worker's LoRA manager (unknown ids are ignored); returns the registered ids."""
    manager = _lora_manager(worker)
    for adapter_id in ids:
        manager.remove_adapter(int(adapter_id))
    return sorted(manager.list_adapters())
