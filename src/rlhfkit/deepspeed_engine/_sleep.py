"""Moving a DeepSpeed engine's GPU state to pinned host memory and back (the machinery behind ``sleep``/``wake_up``).

Two mechanisms, chosen per state:
- DeepSpeed's own ``engine.offload_states`` / ``reload_states`` (ZeRO-1/2: bf16 flat weights, fp32 master
  partitions, gradient partitions — DeepSpeed clears the views it keeps of them; ZeRO-3: bf16 parameter shards,
  gradient partitions and the gradient bucket always, fp32 master weights and Adam states only with DeepSpeed's
  FusedAdam, which it asserts);
- :class:`StorageOffloader`, our own: it moves the *storages* behind a list of tensors (so views that share a storage
  stay views of one buffer after the round trip), keeps one pinned host buffer per storage across cycles, and frees
  the device storage. It covers what DeepSpeed does not: models without an optimizer (all stages), ZeRO-3 master
  weights and optimizer states under ``torch.optim.AdamW``, ZeRO-0 with an optimizer, and the ZeRO-1/2 optimizer
  states (DeepSpeed would allocate fresh pinned buffers for them at every sleep).

:func:`resident_state_bytes` checks the result: the bytes of the engine's state storages still on a GPU.
:func:`offload_engine` also counts the bytes it copied off the device (the phase switch's share of the copy floor).

Internal to :mod:`rlhfkit.deepspeed_engine`; needs deepspeed only through the engine object it is handed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["StorageOffloader", "SleepPlan", "plan_sleep", "offload_engine", "reload_engine", "deferrable_states",
           "deferred_bytes", "copy_in_chunks", "device_memory", "resident_state_bytes", "OPTIMIZER_STATES"]

logger = logging.getLogger(__name__)

# DeepSpeed's names for the states of a ZeRO optimizer (deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum).
LP_PARAMS, HP_PARAMS, LP_GRADS, OPTIM_STATES, GRAD_BUFFER = (
    "lp_params", "hp_params", "lp_grads", "optim_states", "contiguous_grad_buffer")
# What a sleep that keeps the optimizer on the device leaves there: the fp32 master weights (DeepSpeed's
# ``hp_params``), the optimizer's states (ZeRO-3 with FusedAdam: DeepSpeed's ``optim_states``) and rlhfkit's own copy
# of either (``own_master``: the ZeRO-0/1/2 Adam moments, ZeRO-3's masters and moments under a torch optimizer).
OPTIMIZER_STATES = frozenset({HP_PARAMS, OPTIM_STATES, "own_master"})


def _pin(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if torch.cuda.is_available() else tensor


class StorageOffloader:
    """Moves the storages behind a set of tensors to (pinned) host memory and back, in place.

    Every tensor keeps its identity (``.data`` is re-pointed), so optimizers, hooks and DeepSpeed's bookkeeping that
    hold the tensor objects see the restored values. Tensors that share a storage are moved as one buffer and stay
    aliased. The host side is one pinned buffer with a slot per storage, kept between cycles (pinning is slow);
    :meth:`release_host_buffers` frees it. :meth:`reload` brings every slot back as a view of *one* device buffer, so
    from the second cycle on the tensors share one storage and each direction is a single copy (a model's hundreds
    of per-parameter optimizer states otherwise cost a copy and its launch each, both ways, every step).

    Tensors that cannot have changed since the last :meth:`reload` need no copy back: the host buffer still holds
    them. ``offload(..., unchanged=True)`` (the caller vouches that nothing it knows of wrote to them) then frees the
    device buffer without a copy, provided the tensors are exactly those the last reload brought back, still views of
    its buffer, and none of them was written in place since (each tensor's version counter); otherwise it copies.
    """

    ALIGN = 512  # bytes: slot offsets in the flat buffers (a multiple of every dtype's size)

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # one flat pinned buffer
        self._layout: list[int] = []  # the byte size of each slot of _host, in order
        self._moved: list[tuple[list[torch.Tensor], int, torch.device]] = []  # members, byte offset, device
        # what the last reload() brought back, while the host buffer still mirrors it: the device buffer's storage
        # pointer and size, and each member with its view geometry and version counter
        self._mirror: tuple[int, int, list[tuple[torch.Tensor, tuple, int]]] | None = None
        self.last_pin_seconds = 0.0  # time the last offload() spent allocating pinned host buffers
        self.last_copies = 0  # device->host copies the last offload() issued
        self.last_kept_bytes = 0  # bytes the last offload() did not copy: the host buffer still held them

    @property
    def active(self) -> bool:
        return bool(self._moved)

    @property
    def nbytes(self) -> int:
        """Bytes of the storages offloaded now (0 when none are)."""
        return sum(self._layout) if self._moved else 0

    def offload(self, tensors: Iterable[torch.Tensor], *, device: torch.device, non_blocking: bool = True,
                unchanged: bool = False) -> int:
        """Copy the storages of ``tensors`` that live on ``device`` to host memory; returns the bytes moved.
        ``unchanged=True``: the caller knows of no write to them since the last :meth:`reload`; if the host buffer
        provably still holds them (see the class), the device buffer is freed without a copy and 0 is returned
        (:attr:`last_kept_bytes` says how many bytes stayed on the host)."""
        if self._moved:
            raise RuntimeError("StorageOffloader.offload() called twice without reload()")
        mirror, self._mirror, self.last_kept_bytes = self._mirror, None, 0
        groups: dict[int, list[torch.Tensor]] = {}
        seen: set[int] = set()
        for tensor in tensors:
            if tensor is None or id(tensor) in seen or tensor.device != device:
                continue
            seen.add(id(tensor))
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                groups.setdefault(storage.data_ptr(), []).append(tensor)
        layout = [members[0].untyped_storage().nbytes() for members in groups.values()]
        self.last_pin_seconds, self.last_copies = 0.0, 0
        if not groups:
            return 0
        if unchanged and mirror is not None and _still_mirrored(groups, mirror):
            members = next(iter(groups.values()))  # one group: the reload's device buffer, at the host's offsets
            _repoint(members, self._host)
            self._moved.append((members, 0, device))
            self.last_kept_bytes = mirror[1]
            return 0
        offsets = _offsets(layout, self.ALIGN)
        total = offsets[-1] + layout[-1]
        if self._host is None or layout != self._layout:
            if self._host is None or self._host.numel() < total:
                started = time.perf_counter()
                self._host = None  # free the old pinned buffer before pinning a larger one
                self._host = _pin(torch.empty(total, dtype=torch.uint8))
                self.last_pin_seconds = time.perf_counter() - started
            self._layout = layout
        for members, offset, nbytes in zip(groups.values(), offsets, layout, strict=True):
            source = torch.empty(0, dtype=torch.uint8, device=device).set_(members[0].untyped_storage())
            self._host[offset:offset + nbytes].copy_(source, non_blocking=non_blocking)
            self._moved.append((members, offset, device))
        self.last_copies = len(layout)
        _synchronize(device)
        for members, offset, _ in self._moved:
            _repoint(members, self._host, offset)
        return sum(layout)

    def reload(self, *, non_blocking: bool = True, chunk_bytes: int | None = None) -> int:
        """Copy every moved storage back in one copy, into one device buffer whose slots they become; returns the
        bytes moved. ``chunk_bytes``: copy in pieces of that size, one in flight at a time (see
        :func:`copy_in_chunks`)."""
        if not self._moved:
            return 0
        device = self._moved[0][2]  # one offload() call, one device
        total = _offsets(self._layout, self.ALIGN)[-1] + self._layout[-1]
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        if chunk_bytes is not None:
            copy_in_chunks(buffer, self._host[:total], chunk_bytes)
        else:
            buffer.copy_(self._host[:total], non_blocking=non_blocking)
        for members, _, _ in self._moved:  # their offsets in the host buffer are their offsets in this one
            _repoint(members, buffer)
        _synchronize(device)
        storage = buffer.untyped_storage()
        self._mirror = (storage.data_ptr(), storage.nbytes(),
                        [(tensor, _geometry(tensor), tensor._version) for members, _, _ in self._moved
                         for tensor in members])
        self._moved = []
        return sum(self._layout)

    def release_host_buffers(self) -> None:
        if self._moved:
            raise RuntimeError("release_host_buffers() while states are offloaded would lose them; reload() first")
        self._host, self._layout, self._mirror = None, [], None


def copy_in_chunks(destination: torch.Tensor, source: torch.Tensor, chunk_bytes: int) -> None:
    """Copy ``source`` into ``destination`` (contiguous, the same bytes; host <-> device) on the current CUDA stream in
    pieces of ``chunk_bytes``, each waited for before the next is queued. A copy that runs beside another stream's
    work (a wake behind a forward-backward) then holds the GPU's copy engine for one piece at a time: that stream's
    own small copies (its inputs, a pageable scalar) wait behind one piece instead of behind the whole transfer."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}; must be >= 1")
    destination, source = destination.reshape(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8)
    if destination.numel() != source.numel():
        raise ValueError(f"copy_in_chunks: {source.numel()} bytes to {destination.numel()} bytes")
    done = torch.cuda.Event() if "cuda" in (destination.device.type, source.device.type) else None
    for start in range(0, source.numel(), chunk_bytes):
        destination[start:start + chunk_bytes].copy_(source[start:start + chunk_bytes], non_blocking=True)
        if done is not None:
            done.record()
            done.synchronize()


def _geometry(tensor: torch.Tensor) -> tuple:
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.size()), tensor.stride()


def _still_mirrored(groups: Mapping[int, list[torch.Tensor]], mirror: tuple) -> bool:
    """Whether ``groups`` (storage pointer -> tensors) is exactly what the last reload brought back, untouched: one
    storage, the reload's buffer, the same tensors as views at the same places, none written in place since."""
    pointer, nbytes, recorded = mirror
    if len(groups) != 1 or pointer not in groups:
        return False
    members = groups[pointer]
    if members[0].untyped_storage().nbytes() != nbytes or len(members) != len(recorded):
        return False
    now = {id(tensor): tensor for tensor in members}
    return all(now.get(id(tensor)) is tensor and _geometry(tensor) == geometry and tensor._version == version
               for tensor, geometry, version in recorded)


def _offsets(layout: list[int], align: int) -> list[int]:
    """Byte offsets of consecutive slots of ``layout``'s sizes, each rounded up to ``align``."""
    offsets, position = [], 0
    for size in layout:
        offsets.append(position)
        position += -(-size // align) * align
    return offsets


def _repoint(members: list[torch.Tensor], buffer: torch.Tensor, byte_offset: int = 0) -> None:
    """Make every tensor in ``members`` a view of ``buffer``'s storage at its own offset (shifted by
    ``byte_offset``), size and stride."""
    storage = buffer.untyped_storage()
    base = buffer.storage_offset() + byte_offset  # buffer is uint8: its offset is in bytes
    for tensor in members:
        itemsize = tensor.element_size()
        view = torch.empty(0, dtype=tensor.dtype, device=buffer.device)
        view.set_(storage, base // itemsize + tensor.storage_offset(), tensor.size(), tensor.stride())
        tensor.data = view


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_memory(device: torch.device) -> dict[str, float]:
    """Allocated/reserved/free bytes of ``device`` as seen by this process; empty on CPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    free, _ = torch.cuda.mem_get_info(device)
    return {"allocated": float(torch.cuda.memory_allocated(device)),
            "reserved": float(torch.cuda.memory_reserved(device)), "free": float(free)}


@dataclass(frozen=True, kw_only=True)
class SleepPlan:
    """Which states each mechanism moves for one engine (decided once from the engine's configuration).

    ``deepspeed_states``: names passed to ``engine.offload_states(include=...)`` (minus ``lp_params`` when the
    weights are kept). ``own_master_and_optimizer``: move ZeRO-3 master weights (ZeRO-0: the parameters' grads) and
    optimizer states ourselves. ``own_optimizer_states``: move only the optimizer states ourselves (ZeRO-1/2).
    ``own_module_params``: move the module's parameters ourselves. ``own_frozen_params``: move the parameters
    that do not train ourselves (ZeRO-1/2, whose flat buffers hold only the trainable ones). ``unsupported``: why this engine cannot sleep
    (empty when it can). ``note``: why, for the log.
    """

    deepspeed_states: tuple[str, ...]
    own_master_and_optimizer: bool
    own_module_params: bool
    note: str
    own_optimizer_states: bool = False
    own_frozen_params: bool = False
    unsupported: str = ""


def plan_sleep(ds_engine, *, zero_stage: int, has_optimizer: bool, offload_optimizer: bool,
               offload_params: bool) -> SleepPlan:
    """Decide what DeepSpeed's ``offload_states`` handles and what :class:`StorageOffloader` must move."""
    if offload_params:
        return SleepPlan(deepspeed_states=(), own_master_and_optimizer=False, own_module_params=False,
                         note="parameter offload: shards and optimizer already live on CPU; sleep frees the caches")
    if not has_optimizer:
        return SleepPlan(deepspeed_states=(), own_master_and_optimizer=False, own_module_params=True,
                         note="no optimizer: rlhfkit moves the parameters (ZeRO-3: the shards)")
    wrapper = type(ds_engine.optimizer).__name__
    if wrapper in ("BF16_Optimizer", "FP16_Optimizer", "FP16_UnfusedOptimizer"):
        # bf16 + ZeRO-1 with data_types.grad_accum_dtype=fp32 (or ZeRO-0 + bf16) routes to these wrappers: they keep
        # private flat buffers and have no offload_states.
        return SleepPlan(deepspeed_states=(), own_master_and_optimizer=False, own_module_params=False,
                         note=f"DeepSpeed optimizer wrapper {wrapper}: sleep unsupported",
                         unsupported=f"DeepSpeed wrapped the optimizer in {wrapper} (ZeRO-0 + bf16, or bf16 + ZeRO-1 "
                                     "with data_types.grad_accum_dtype='fp32'), which keeps private flat buffers and "
                                     "has no offload_states; use zero_stage >= 1 without grad_accum_dtype='fp32'")
    if zero_stage == 0:
        return SleepPlan(deepspeed_states=(), own_master_and_optimizer=True, own_module_params=True,
                         note="ZeRO-0: DeepSpeed has no offload_states; rlhfkit moves parameters, grads, optimizer")
    if zero_stage in (1, 2):
        # DeepSpeed's flat buffers hold the trainable weights only: frozen ones (LoRA's base) are moved by rlhfkit
        frozen = _has_frozen_parameters(ds_engine)
        return SleepPlan(deepspeed_states=(HP_PARAMS, LP_PARAMS, LP_GRADS), own_master_and_optimizer=False,
                         own_optimizer_states=True, own_module_params=False, own_frozen_params=frozen,
                         note="ZeRO-1/2: DeepSpeed offload_states moves weights, masters and grads (its pinned "
                              "buffers kept across cycles); rlhfkit moves the optimizer states"
                              + (" and the frozen parameters" if frozen else ""))
    fused = _is_fused_adam(ds_engine.optimizer.optimizer)
    # DeepSpeed 0.19's ZeRO-3 offload_states(lp_params) maps the shard of *every* parameter onto the flat buffer of
    # the trainable ones, so a model with frozen parameters (LoRA's base) fails ("start + length exceeds dimension
    # size"); rlhfkit then moves the shards itself (with DeepSpeed's flat buffer, so its views stay aliased).
    frozen = _has_frozen_parameters(ds_engine)
    weights = () if frozen else (LP_PARAMS,)
    how = "; rlhfkit moves the parameter shards (frozen parameters)" if frozen else ""
    if fused or offload_optimizer:
        return SleepPlan(deepspeed_states=(HP_PARAMS, *weights, LP_GRADS, GRAD_BUFFER, OPTIM_STATES),
                         own_master_and_optimizer=False, own_module_params=frozen,
                         note="ZeRO-3 with FusedAdam (or CPU optimizer): DeepSpeed offload_states moves the states"
                              + how)
    return SleepPlan(deepspeed_states=(*weights, LP_GRADS, GRAD_BUFFER), own_master_and_optimizer=True,
                     own_module_params=frozen,
                     note="ZeRO-3 with a torch optimizer: DeepSpeed moves bf16 shards and grads, rlhfkit moves fp32 "
                          "master weights and optimizer states (DeepSpeed asserts FusedAdam for those)" + how)


def _has_frozen_parameters(ds_engine) -> bool:
    module = getattr(ds_engine, "module", None)
    return module is not None and any(not param.requires_grad for param in module.parameters())


def _is_fused_adam(optimizer) -> bool:
    """DeepSpeed's FusedAdam, by type (imported only when the optimizer comes from deepspeed: importing the op does
    not build it)."""
    if not type(optimizer).__module__.startswith("deepspeed."):
        return False
    from deepspeed.ops.adam import FusedAdam

    return isinstance(optimizer, FusedAdam)


def _basic_optimizer(ds_engine, zero_stage: int):
    return ds_engine.optimizer if zero_stage == 0 else ds_engine.optimizer.optimizer


def optimizer_state_tensors(ds_engine, zero_stage: int) -> list[torch.Tensor]:
    """Every tensor in the (basic) optimizer's state, DeepSpeed's ``*_offload_buffer`` host copies excluded."""
    basic = _basic_optimizer(ds_engine, zero_stage)
    return [value for state in basic.state.values() for key, value in state.items()
            if isinstance(value, torch.Tensor) and not str(key).endswith("_offload_buffer")]


def master_and_optimizer_tensors(ds_engine, zero_stage: int) -> list[torch.Tensor]:
    """ZeRO-3: fp32 master weights (+ their grads); then every tensor in the optimizer state, for our own offload."""
    tensors: list[torch.Tensor] = []
    if zero_stage == 3:
        flats = list(ds_engine.optimizer.fp32_partitioned_groups_flat)
        tensors += flats + [flat.grad for flat in flats if flat.grad is not None]
    return tensors + optimizer_state_tensors(ds_engine, zero_stage)


def module_tensors(ds_engine, zero_stage: int, *, with_grads: bool) -> list[torch.Tensor]:
    """The module's parameter storages: ZeRO-3 shards (``ds_tensor``) or full parameters (+ grads)."""
    tensors: list[torch.Tensor] = []
    for param in ds_engine.module.parameters():
        if zero_stage == 3 and hasattr(param, "ds_tensor"):
            tensors.append(param.ds_tensor)
        else:
            tensors.append(param)
            if with_grads and param.grad is not None:
                tensors.append(param.grad)
    if zero_stage == 3:  # DeepSpeed's flat buffer of the trainable shards and its views move with them
        wrapper = getattr(ds_engine, "optimizer", None)
        flats = [getattr(wrapper, "lp_param_buffer", None), *(getattr(wrapper, "fp16_partitioned_groups_flat", None)
                                                               or [])]
        tensors += [flat for flat in flats if isinstance(flat, torch.Tensor)]
    return tensors


def state_tensors(ds_engine, zero_stage: int, *, include_weights: bool = True,
                  include_optimizer: bool = True) -> list[torch.Tensor]:
    """Every per-rank state tensor we know of: weights (ZeRO-3 shards, ZeRO-1/2 flat buffers), grads, masters,
    gradient buffers, optimizer states (``include_optimizer=False``: without the masters and optimizer states)."""
    tensors = module_tensors(ds_engine, zero_stage, with_grads=True) if include_weights else []
    wrapper = ds_engine.optimizer
    if wrapper is None:
        return tensors
    if include_optimizer:
        for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
            for flat in getattr(wrapper, name, None) or []:
                tensors += [flat] + ([flat.grad] if isinstance(flat.grad, torch.Tensor) else [])
    if include_weights:
        tensors += list(getattr(wrapper, "bit16_groups_flat", None) or [])
    buffer = getattr(wrapper, "grad_partitions_flat_buffer", None)
    tensors += [buffer] if isinstance(buffer, torch.Tensor) else []
    basic = wrapper if zero_stage == 0 else getattr(wrapper, "optimizer", None)
    if include_optimizer and isinstance(getattr(basic, "state", None), Mapping):
        tensors += optimizer_state_tensors(ds_engine, zero_stage)
    return tensors


def _storages(tensors: Iterable[torch.Tensor], device_type: str) -> dict[int, int]:
    """``{data_ptr: nbytes}`` of the distinct storages behind ``tensors`` on devices of ``device_type``."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == device_type:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def resident_state_bytes(ds_engine, zero_stage: int, *, include_weights: bool = True,
                         include_optimizer: bool = True) -> int:
    """Bytes of the distinct CUDA storages behind :func:`state_tensors` (0 after a complete sleep; the check that
    ``sleep()`` really moved the states, not just flagged them)."""
    return sum(_storages(state_tensors(ds_engine, zero_stage, include_weights=include_weights,
                                       include_optimizer=include_optimizer), "cuda").values())


def split_fixed(tensors: list[torch.Tensor], fixed_params: list[torch.Tensor], zero_stage: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``tensors`` (a :func:`module_tensors` list) split into (the storages of ``fixed_params``: parameters no
    optimizer updates, ZeRO-3: their shards; everything else). A fixed tensor that shares a storage with another
    tensor stays with the others, so that no storage is moved by two offloaders."""
    fixed_ids = {id(param.ds_tensor if zero_stage == 3 and hasattr(param, "ds_tensor") else param)
                 for param in fixed_params}
    fixed = [tensor for tensor in tensors if id(tensor) in fixed_ids]
    rest = [tensor for tensor in tensors if id(tensor) not in fixed_ids]
    shared = {tensor.untyped_storage().data_ptr() for tensor in rest}
    return ([tensor for tensor in fixed if tensor.untyped_storage().data_ptr() not in shared],
            rest + [tensor for tensor in fixed if tensor.untyped_storage().data_ptr() in shared])


def offload_engine(ds_engine, plan: SleepPlan, offloaders: dict[str, StorageOffloader], *, zero_stage: int,
                   keep_weights: bool, done: set[str], empty_cache: bool = True, trains: bool = True,
                   fixed_unchanged: bool = False, keep_optimizer: bool = False) -> tuple[set[str], int, int]:
    """Move what ``plan`` says (skipping what is in ``done``, and with ``keep_optimizer`` the
    :data:`OPTIMIZER_STATES`); returns the names of the states now offloaded, the
    bytes copied off the device, and the bytes not copied because the host still held them (see below). Copied:
    :class:`StorageOffloader`'s count, plus, for DeepSpeed's ``offload_states``, the distinct state storages on the
    device before it that no state tensor uses after it. (On a CPU "device" DeepSpeed's ZeRO-1/2 ``reload_states``
    leaves its states in its host buffers, so later sleeps count only rlhfkit's part.)

    The parameters no optimizer updates (all of them when ``trains`` is False, else the frozen ones) that rlhfkit
    moves go through ``offloaders["own_fixed"]``; ``fixed_unchanged=True`` (the caller knows of no write to them since
    the last wake) lets it skip their copy when its host buffer still holds them (:class:`StorageOffloader`)."""
    device = ds_engine.device if isinstance(ds_engine.device, torch.device) else torch.device(ds_engine.device)
    now, moved, kept = set(done), 0, 0
    if hasattr(ds_engine, "empty_partition_cache") and zero_stage == 3:
        ds_engine.empty_partition_cache()
    kept_here = OPTIMIZER_STATES if keep_optimizer else frozenset()
    include = [s for s in plan.deepspeed_states
               if s not in now and s not in kept_here and not (keep_weights and s == LP_PARAMS)]
    if include:
        enum = _offload_state_enum()
        before = _storages(state_tensors(ds_engine, zero_stage), device.type)
        # ZeRO-1/2: DeepSpeed clears the master-weight views of the optimizer states (``_hp_mapping``) when it moves
        # the masters, so the optimizer states are moved after it and are free to go.
        ds_engine.offload_states(include=[enum(s) for s in include], pin_memory=True, non_blocking=True)
        _synchronize(device)  # the device->host copies are queued; the host copies must be complete when we return
        after = _storages(state_tensors(ds_engine, zero_stage), device.type)
        moved += sum(nbytes for pointer, nbytes in before.items() if pointer not in after)
        now.update(include)
    if plan.own_optimizer_states and "own_master" not in now and not keep_optimizer:
        moved += offloaders["own_master"].offload(optimizer_state_tensors(ds_engine, zero_stage), device=device)
        now.add("own_master")
    if plan.own_master_and_optimizer and "own_master" not in now and not keep_optimizer:
        moved += offloaders["own_master"].offload(master_and_optimizer_tensors(ds_engine, zero_stage), device=device)
        now.add("own_master")
    fixed_params = [param for param in ds_engine.module.parameters() if not (trains and param.requires_grad)]
    if plan.own_frozen_params and not keep_weights and "own_fixed" not in now:
        moved += offloaders["own_fixed"].offload(fixed_params, device=device, unchanged=fixed_unchanged)
        kept += offloaders["own_fixed"].last_kept_bytes
        now.add("own_fixed")
    if plan.own_module_params and not keep_weights and "own_params" not in now:
        tensors = module_tensors(ds_engine, zero_stage, with_grads=plan.own_master_and_optimizer)
        fixed, rest = split_fixed(tensors, fixed_params, zero_stage)
        moved += offloaders["own_fixed"].offload(fixed, device=device, unchanged=fixed_unchanged)
        kept += offloaders["own_fixed"].last_kept_bytes
        moved += offloaders["own_params"].offload(rest, device=device)
        now.update(("own_fixed", "own_params"))
    if device.type == "cuda" and empty_cache:
        release_cuda_caches()
    return now, moved, kept


def release_cuda_caches() -> None:
    """Return this process's cached device memory to the driver: the cuBLAS workspaces first (torch allocates them,
    32 MiB per handle and stream on Hopper, from its caching allocator, where they count as allocated and pin the
    segment they sit in; cuBLAS makes new ones at the next matmul), then every unused cached segment."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize()
        clear()
    torch.cuda.empty_cache()


# DeepSpeed's ZeRO-1/2 reload_states() drops its pinned host buffers for the weights and masters, so the next
# offload_states() would pin new ones (≈ 1 s per 1.5 GB); handing them back makes the next sleep reuse them.
_ZERO12_PIN_BUFFERS = ("hp_params_pin_buffers", "lp_params_pin_buffers")


def deferrable_states(done: set[str], zero_stage: int) -> set[str]:
    """The states in ``done`` (what :func:`offload_engine` moved) that only the optimizer step reads, so that a wake
    may bring them back later, behind a forward-backward: under ZeRO-0/1/2 the optimizer's states (rlhfkit's
    ``own_master``: ZeRO-0's and ZeRO-1/2's Adam moments) and ZeRO-1/2's fp32 master partitions (DeepSpeed's
    ``hp_params``). None under ZeRO-3, whose masters and optimizer DeepSpeed reloads together with the shards."""
    if zero_stage == 3:
        return set()
    return done & {"own_master", HP_PARAMS}


def deferred_bytes(ds_engine, offloaders: dict[str, StorageOffloader], names: set[str]) -> int:
    """Bytes off the device in the states ``names`` (of :func:`deferrable_states`)."""
    total = offloaders["own_master"].nbytes if "own_master" in names else 0
    if HP_PARAMS in names:
        total += sum(flat.numel() * flat.element_size()
                     for flat in getattr(ds_engine.optimizer, "single_partition_of_fp32_groups", None) or [])
    return total


def reload_engine(ds_engine, offloaders: dict[str, StorageOffloader], done: set[str], *,
                  chunk_bytes: int | None = None) -> None:
    """Bring back what :func:`offload_engine` moved, the states named in ``done`` (all it moved, or part of them:
    :func:`deferrable_states` may come later): ours first, so that DeepSpeed's ZeRO-1/2 re-linking of master-weight
    views to the optimizer states sees them on the device. ``chunk_bytes`` (CUDA): rlhfkit's copies and ZeRO-1/2's
    fp32 masters go in pieces (:func:`copy_in_chunks`), for a reload beside another stream's work."""
    for name in ("own_master", "own_params", "own_fixed"):
        if name in done:
            offloaders[name].reload(chunk_bytes=chunk_bytes)
    if any(name in done for name in (HP_PARAMS, LP_PARAMS, LP_GRADS, OPTIM_STATES, GRAD_BUFFER)):
        wrapper = ds_engine.optimizer
        device = ds_engine.device if isinstance(ds_engine.device, torch.device) else torch.device(ds_engine.device)
        if chunk_bytes is not None and HP_PARAMS in done and device.type == "cuda":
            # the masters come back here, in pieces; DeepSpeed's reload then finds them on the device (its .to() is
            # a no-op) and only re-links them
            for flat in getattr(wrapper, "single_partition_of_fp32_groups", None) or []:
                if flat.device.type != "cuda":
                    on_device = torch.empty_like(flat, device=device)
                    copy_in_chunks(on_device, flat.data, chunk_bytes)
                    flat.data = on_device
        kept = {name: getattr(wrapper, name) for name in _ZERO12_PIN_BUFFERS if hasattr(wrapper, name)}
        # DeepSpeed's reload_states() brings back every state it offloaded: the ones left for later are hidden from it
        later = {state for state in getattr(wrapper, "offloaded_states", ()) if state not in done}
        if later:
            wrapper.offloaded_states -= later
        try:
            ds_engine.reload_states(non_blocking=True)
        finally:
            if later:
                wrapper.offloaded_states |= later
        _synchronize(device)  # the host buffers are free to reuse only after this
        for name, buffers in kept.items():
            if not hasattr(wrapper, name):
                setattr(wrapper, name, buffers)


def _offload_state_enum():
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum  # deepspeed is loaded by the engine

    return OffloadStateTypeEnum
