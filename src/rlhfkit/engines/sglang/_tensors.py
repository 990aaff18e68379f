"""Named tensors in the form SGLang's ``/update_weights_from_tensor`` reads; private to :mod:`rlhfkit.engines.sglang`.

SGLang decodes each entry of ``serialized_named_tensors`` with ``pickle`` (its ``MultiprocessingSerializer``, a
restricted unpickler that admits torch's rebuild functions) into a list of ``(name, tensor)``. A CUDA tensor travels
as a CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``) whose device is the GPU's UUID — what
SGLang's patched ``rebuild_cuda_tensor`` maps to its own device index — so only the handle crosses the HTTP request
and the server copies straight from our memory, which must stay alive until the request returns. A CPU tensor travels
inline (its bytes in the pickle). No global pickling state is changed: a private pickler does the CUDA reduction.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Sequence

import torch

__all__ = ["serialize_named_tensors"]

_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device argument


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            function, args = reduce_tensor(obj)
            args = list(args)
            args[_DEVICE_ARG] = str(torch.cuda.get_device_properties(obj.device).uuid)
            return function, tuple(args)
        return NotImplemented


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU view pickles its whole storage (e.g. a bucket buffer): send a compact copy instead."""
    if tensor.is_cuda or tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone()


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor), ...]`` as one base64 entry of ``serialized_named_tensors``."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(
        [(str(name), _compact(tensor.detach())) for name, tensor in named_tensors])
    return base64.b64encode(buffer.getvalue()).decode()
