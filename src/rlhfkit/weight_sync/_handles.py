"""CUDA IPC handles as plain JSON (private to :mod:`rlhfkit.weight_sync`). Needs only torch.

``torch.multiprocessing.reductions.reduce_tensor(t)`` of a CUDA tensor is ``(rebuild_cuda_tensor, args)`` with
``args`` = (tensor class, size, stride, storage offset in elements, storage class, dtype, device index, allocation
handle, storage bytes, storage offset in bytes, requires_grad, ref-counter handle, ref-counter offset, event handle,
event sync required) — the same in torch 2.11 and 2.13. Here ``args`` travel as a JSON object of ints, bools,
base64 strings and names: the two classes are looked up in fixed allow-lists, the dtype by name in a fixed list, and
the receiver calls ``rebuild_cuda_tensor`` itself. Nothing is imported or unpickled by name; anything off the
expected shape raises :class:`WeightSyncProtocolError`.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch

from rlhfkit.weight_sync._errors import WeightSyncProtocolError

__all__ = ["encode_tensor_args", "decode_tensor_args", "encode_bytes", "decode_bytes", "check_int"]

_TENSOR_CLASSES: dict[str, type] = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}
_STORAGE_CLASSES: dict[str, type] = {"TypedStorage": torch.storage.TypedStorage,
                                     "UntypedStorage": torch.UntypedStorage}
_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64", "bool",
                "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                "uint16", "uint32", "uint64")
_FIELDS = ("tensor_cls", "size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "size_bytes",
           "offset_bytes", "requires_grad", "ref_counter", "ref_counter_offset", "event", "event_sync_required")
_MAX_DIMS = 64
_MAX_HANDLE_BYTES = 4096  # a cudaIpcMemHandle is 64 bytes; torch adds a little (expandable segments, a file name)


def _dtypes() -> dict[str, torch.dtype]:
    found = {name: getattr(torch, name, None) for name in _DTYPE_NAMES}
    return {name: dtype for name, dtype in found.items() if isinstance(dtype, torch.dtype)}


def _refuse(what: str) -> WeightSyncProtocolError:
    return WeightSyncProtocolError(f"refused a CUDA IPC handle: {what}")


def check_int(value: Any, what: str, *, minimum: int = 0) -> int:
    """``value`` if it is a plain int (not a bool) >= ``minimum``; WeightSyncProtocolError otherwise."""
    if type(value) is not int or value < minimum:
        raise _refuse(f"{what} must be an int >= {minimum}, got {type(value).__name__}")
    return value


def encode_bytes(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(bytes(data)).decode("ascii")


def decode_bytes(text: Any, what: str, *, optional: bool = False) -> bytes | None:
    """Base64 ``text`` back to bytes (bounded in size); None only where ``optional``."""
    if text is None and optional:
        return None
    if not isinstance(text, str) or len(text) > 2 * _MAX_HANDLE_BYTES:
        raise _refuse(f"{what} must be a base64 string of at most {_MAX_HANDLE_BYTES} bytes")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as error:
        raise _refuse(f"{what} is not valid base64 ({error})") from None


def _name_of(cls: type, allowed: dict[str, type], what: str) -> str:
    for name, known in allowed.items():
        if cls is known:
            return name
    raise _refuse(f"the {what} {cls!r} is not one of {sorted(allowed)}")


def _dims(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS:
        raise _refuse(f"{what} must be a list of at most {_MAX_DIMS} ints")
    return [check_int(v, what) for v in value]


def encode_tensor_args(args: tuple) -> dict[str, Any]:
    """The JSON form of ``reduce_tensor(t)[1]`` for a CUDA tensor ``t``."""
    if not isinstance(args, tuple) or len(args) != len(_FIELDS):
        raise _refuse(f"expected the {len(_FIELDS)} arguments of rebuild_cuda_tensor, got "
                      f"{type(args).__name__} of length {len(args) if isinstance(args, tuple) else '?'}")
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes, offset_bytes, requires_grad,
     ref_counter, ref_counter_offset, event, event_sync_required) = args
    dtypes = _dtypes()
    dtype_name = str(dtype).removeprefix("torch.")
    if dtypes.get(dtype_name) is not dtype:
        raise _refuse(f"dtype {dtype!r} is not one of the dtypes a handle may carry")
    return {
        "tensor_cls": _name_of(tensor_cls, _TENSOR_CLASSES, "tensor class"),
        "size": [int(d) for d in size],
        "stride": [int(d) for d in stride],
        "offset": int(offset),
        "storage_cls": _name_of(storage_cls, _STORAGE_CLASSES, "storage class"),
        "dtype": dtype_name,
        "device": int(device),
        "handle": encode_bytes(handle),
        "size_bytes": int(size_bytes),
        "offset_bytes": int(offset_bytes),
        "requires_grad": bool(requires_grad),
        "ref_counter": encode_bytes(ref_counter),
        "ref_counter_offset": int(ref_counter_offset),
        "event": encode_bytes(event),
        "event_sync_required": None if event_sync_required is None else bool(event_sync_required),
    }


def decode_tensor_args(body: Any) -> tuple:
    """The arguments of ``rebuild_cuda_tensor`` from :func:`encode_tensor_args`'s JSON form, checked field by field."""
    if not isinstance(body, dict) or set(body) != set(_FIELDS):
        keys = sorted(body)[:20] if isinstance(body, dict) else type(body).__name__
        raise _refuse(f"expected a JSON object with exactly the fields {list(_FIELDS)}, got {keys}")
    tensor_cls = _TENSOR_CLASSES.get(body["tensor_cls"]) if isinstance(body["tensor_cls"], str) else None
    storage_cls = _STORAGE_CLASSES.get(body["storage_cls"]) if isinstance(body["storage_cls"], str) else None
    dtype = _dtypes().get(body["dtype"]) if isinstance(body["dtype"], str) else None
    if tensor_cls is None:
        raise _refuse(f"unknown tensor class {str(body['tensor_cls'])[:80]!r} (allowed: {sorted(_TENSOR_CLASSES)})")
    if storage_cls is None:
        raise _refuse(f"unknown storage class {str(body['storage_cls'])[:80]!r} "
                      f"(allowed: {sorted(_STORAGE_CLASSES)})")
    if dtype is None:
        raise _refuse(f"unknown dtype {str(body['dtype'])[:80]!r}")
    size, stride = _dims(body["size"], "size"), _dims(body["stride"], "stride")
    if len(size) != len(stride):
        raise _refuse(f"size has {len(size)} dimensions and stride {len(stride)}")
    if type(body["requires_grad"]) is not bool:
        raise _refuse("requires_grad must be a bool")
    if body["event_sync_required"] is not None and type(body["event_sync_required"]) is not bool:
        raise _refuse("event_sync_required must be a bool or null")
    return (
        tensor_cls,
        torch.Size(size),
        tuple(stride),
        check_int(body["offset"], "offset"),
        storage_cls,
        dtype,
        check_int(body["device"], "device"),
        decode_bytes(body["handle"], "handle", optional=True),
        check_int(body["size_bytes"], "size_bytes"),
        check_int(body["offset_bytes"], "offset_bytes"),
        body["requires_grad"],
        decode_bytes(body["ref_counter"], "ref_counter", optional=True),
        check_int(body["ref_counter_offset"], "ref_counter_offset"),
        decode_bytes(body["event"], "event", optional=True),
        body["event_sync_required"],
    )
