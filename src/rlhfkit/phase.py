"""The phase guard: colocated models take turns on a GPU, and a wrong order fails loudly instead of OOMing.

In a hybrid run one GPU hosts several models (rollout engine, actor, critic, reference, ...) that must never be awake
together. :class:`PhaseGuard` is an explicit gate your loop drives::

    guard = PhaseGuard(TCPPhaseStore.serve(), gpu=gpu_key())          # or FilePhaseStore(dir), LocalPhaseStore()
    with guard.phase("train", "actor", actor):                        # actor.wake_up() ... actor.sleep()
        ...
    guard.sleep("actor", actor, keep_weights=True)                    # extra kwargs go to the model's sleep()
    guard.wake("rollout", engine, tags=["weights"])                   # ... and to wake_up()

Each GPU has at most one *awake* role, recorded in a shared store. ``wake`` claims the GPU for its role and model
atomically before waking the model and raises :class:`PhaseConflictError` naming both roles (and models) and the GPU
when another role, or another model under the same role name, holds it; ``sleep`` puts the model to sleep and then
releases the claim. A role that is partially asleep (an actor keeping its weights for a sync, an engine with only its weights awake) counts as asleep once ``sleep``/released: the guard orders
*who may allocate working memory*, the models decide what they keep. Every transition logs this process's allocated
and reserved CUDA memory and the device's free memory (or, without a CUDA context in this process, none: the guard
never creates one) and is kept in ``guard.history``.

A role may hand over before its sleep is done: :meth:`PhaseGuard.mark_releasing` marks its claim as releasing, and a
``wake(..., displace_releasing=True)`` of another role then takes the GPU at once, while the first one's sleep goes
on (the caller vouches that both fit the GPU at that moment; the hybrid run checks it with its memory estimate).

Stores: :class:`LocalPhaseStore` (one process, threads), :class:`FilePhaseStore` (processes of one node sharing a
directory; ``fcntl`` locks, POSIX only), :class:`TCPPhaseStore` (any processes or nodes that reach one
``torch.distributed.TCPStore``; picklable, so a Ray driver can hand it to its actors). What the guard does not do:
move memory itself, order the phases for you, or recover a claim whose process died (``force_release``).
Needs only torch; no deepspeed, ray or vllm.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from rlhfkit._store import SignedStore, StoreAuthenticationError, check_secret, listen_store, new_secret

__all__ = ["PhaseGuard", "PhaseStore", "LocalPhaseStore", "FilePhaseStore", "TCPPhaseStore", "Sleepable",
           "Transition", "gpu_key", "PhaseConflictError", "PhaseStoreCorruptError", "PhaseStoreAuthenticationError"]

logger = logging.getLogger(__name__)
_GIB = 1024**3


class PhaseStoreCorruptError(RuntimeError):
    """A :class:`FilePhaseStore` file could not be read as claims; the message names the file and the fix."""


class PhaseConflictError(RuntimeError):
    """``wake`` refused: another role, or another model under the same role name, is awake on the GPU."""


_OWNER_SEP = "\x1f"  # the store records "<role>\x1f<owner>": one role name may not cover two models on a GPU
_RELEASING = "\x1freleasing"  # appended to a claim whose model is going to sleep (mark_releasing)


def _owner(model: object) -> str:
    """Who holds a claim: the model object (type, id) and the process, so two models sharing a role name differ."""
    what = "no model" if model is None else f"{type(model).__name__} object {id(model):#x}"
    return f"{what} in pid {os.getpid()} on {socket.gethostname()}"


def _split_holder(holder: str) -> tuple[str, str]:
    role, _, owner = holder.removesuffix(_RELEASING).partition(_OWNER_SEP)
    return role, owner


@runtime_checkable
class Sleepable(Protocol):
    """Anything with ``sleep`` and ``wake_up`` (DeepSpeedEngine, rollout engines); kwargs are passed through."""

    def sleep(self, *args: Any, **kwargs: Any) -> Any: ...

    def wake_up(self, *args: Any, **kwargs: Any) -> Any: ...


class PhaseStore(Protocol):
    """Who is awake on which GPU, shared by every process that drives a guard for that GPU."""

    def claim(self, gpu: str, role: str) -> str | None:
        """Atomically make ``role`` the awake role of ``gpu`` unless another role holds it; returns that other role,
        or None on success (also when ``role`` already holds it)."""
        ...

    def release(self, gpu: str, role: str | None) -> bool:
        """Clear the claim if ``role`` holds it (any holder when ``role`` is None); returns whether it was cleared."""
        ...

    def holder(self, gpu: str) -> str | None: ...

    def swap(self, gpu: str, expected: str, desired: str) -> bool:
        """Atomically replace the claim ``expected`` by ``desired``; False (nothing changed) when ``gpu`` holds
        anything else. Only :meth:`PhaseGuard.mark_releasing` and displacing wakes use it."""
        ...


def gpu_key(device_index: int | None = None) -> str:
    """``"<hostname>:<physical GPU id>"`` of this process's current CUDA device (``CUDA_VISIBLE_DEVICES`` mapped back
    to the physical id, as Ray and torchrun set it), or ``"<hostname>:cpu"`` without CUDA."""
    host = socket.gethostname()
    if not torch.cuda.is_available():
        return f"{host}:cpu"
    index = torch.cuda.current_device() if device_index is None else device_index
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return f"{host}:{visible[index] if index < len(visible) else index}"


class LocalPhaseStore:
    """In-process store (threads of one process)."""

    def __init__(self) -> None:
        self._holders: dict[str, str] = {}
        self._lock = threading.Lock()

    def claim(self, gpu: str, role: str) -> str | None:
        with self._lock:
            current = self._holders.setdefault(gpu, role)
            return None if current == role else current

    def release(self, gpu: str, role: str | None) -> bool:
        with self._lock:
            if gpu in self._holders and role in (None, self._holders[gpu]):
                del self._holders[gpu]
                return True
            return False

    def holder(self, gpu: str) -> str | None:
        with self._lock:
            return self._holders.get(gpu)

    def swap(self, gpu: str, expected: str, desired: str) -> bool:
        with self._lock:
            if self._holders.get(gpu) != expected:
                return False
            self._holders[gpu] = desired
            return True


class FilePhaseStore:
    """A JSON file in ``directory`` guarded by an ``fcntl`` lock: processes of one node, no server. Picklable."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, str]]:
        import fcntl  # POSIX only; imported here so the module imports everywhere

        with open(self.directory / "phase.lock", "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                path = self.directory / "phase.json"
                state = _read_state(path) if path.exists() else {}
                before = dict(state)
                yield state
                if state != before:
                    tmp = path.with_name(f"phase.json.tmp-{os.getpid()}")
                    tmp.write_text(json.dumps(state))
                    os.replace(tmp, path)
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def claim(self, gpu: str, role: str) -> str | None:
        with self._locked() as state:
            current = state.setdefault(gpu, role)
            return None if current == role else current

    def release(self, gpu: str, role: str | None) -> bool:
        with self._locked() as state:
            if gpu in state and role in (None, state[gpu]):
                del state[gpu]
                return True
            return False

    def holder(self, gpu: str) -> str | None:
        with self._locked() as state:
            return state.get(gpu)

    def swap(self, gpu: str, expected: str, desired: str) -> bool:
        with self._locked() as state:
            if state.get(gpu) != expected:
                return False
            state[gpu] = desired
            return True


def _read_state(path: Path) -> dict[str, str]:
    """The claims in ``path``; a file that is not a JSON object of strings raises naming the file and the fix."""
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        problem = f"is not valid JSON ({error})"
    else:
        if isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in state.items()):
            return state
        problem = f"holds {type(state).__name__} {str(state)[:80]!r}, not a JSON object of GPU → role strings"
    raise PhaseStoreCorruptError(
        f"phase store file {path} {problem}; it was damaged or written by something else. Make sure no model on "
        f"this node is awake, then delete {path} (every claim on this node is dropped), or give FilePhaseStore a "
        "fresh directory")


class PhaseStoreAuthenticationError(StoreAuthenticationError):
    """A value on a :class:`TCPPhaseStore` is not signed with the store's secret: a process without it (another host
    that reached the port, or another run) wrote it. The claim is refused, never trusted; the message names the key."""


class TCPPhaseStore:
    """Claims as keys of a ``torch.distributed.TCPStore`` (atomic ``compare_set``): any processes, any nodes.

    One process runs the server (:meth:`serve`, keep that object alive); it listens on exactly ``host`` — loopback by
    default, for processes of this node; give the node's address only when processes on other nodes share the store.
    Others receive a pickled copy (it reconnects as a client; Ray's channel carries it) or connect with
    ``TCPPhaseStore(host, port, secret=server.secret)``. Every key is hashed and every value signed with the store's
    per-run ``secret`` (generated by :meth:`serve`): a process without it finds no claim by name and cannot write one
    a guard accepts (:class:`PhaseStoreAuthenticationError`). The secret is never shown in repr or messages.
    """

    def __init__(self, host: str, port: int, *, secret: bytes | None = None, timeout_s: float = 60.0,
                 _server=None) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"port={port}; expected a TCP port in 1..65535")
        if secret is None:
            raise ValueError("TCPPhaseStore(host, port) needs secret=: the serving store's .secret (or hand the "
                             "served store itself to the other processes: a pickled copy carries it)")
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.secret = check_secret(secret, where="TCPPhaseStore secret")
        self._store = _server

    def __repr__(self) -> str:
        return f"TCPPhaseStore(host={self.host!r}, port={self.port})"

    @classmethod
    def serve(cls, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 60.0,
              secret: bytes | None = None) -> TCPPhaseStore:
        """Start the server in this process, listening on exactly ``host`` (``port=0`` picks a free port; read it
        from ``.port``). ``secret``: the per-run secret (default: ``secrets.token_bytes(32)``)."""
        secret = new_secret() if secret is None else secret
        server = listen_store(host, port, timeout_s, use_libuv=True)  # released claims are empty values
        return cls(host, server.port, secret=secret, timeout_s=timeout_s,
                   _server=SignedStore(server, secret, error=PhaseStoreAuthenticationError))

    def __getstate__(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "timeout_s": self.timeout_s, "secret": self.secret,
                "_store": None}

    def _client(self):
        if self._store is None:
            client = torch.distributed.TCPStore(self.host, self.port, is_master=False,
                                                timeout=datetime.timedelta(seconds=self.timeout_s))
            self._store = SignedStore(client, self.secret, error=PhaseStoreAuthenticationError)
        return self._store

    @staticmethod
    def _key(gpu: str) -> str:
        return f"rlhfkit/phase/{gpu}"

    def claim(self, gpu: str, role: str) -> str | None:
        current = self._client().compare_set(self._key(gpu), "", role).decode()
        return None if current == role else current

    def release(self, gpu: str, role: str | None) -> bool:
        holder = self.holder(gpu)
        if holder is None or role not in (None, holder):
            return False
        # compare_set clears only if the key still holds `holder`; otherwise it returns the new holder.
        return self._client().compare_set(self._key(gpu), holder, "").decode() == ""

    def holder(self, gpu: str) -> str | None:
        store = self._client()
        if not store.check([self._key(gpu)]):
            return None
        return store.get(self._key(gpu)).decode() or None

    def swap(self, gpu: str, expected: str, desired: str) -> bool:
        if not expected:
            raise ValueError("swap() replaces a claim; use claim() on a free GPU")
        # compare_set writes `desired` only if the key holds `expected`, and returns the key's value after it
        return self._client().compare_set(self._key(gpu), expected, desired).decode() == desired

    def set_flag(self, name: str, value: str = "1") -> None:
        """Raise the one-way flag ``name`` for every process that holds this store (e.g. a start-up gate: the
        engines build their models once the trainers have loaded theirs and gone to sleep); ``value``, a non-empty
        string, travels with it (:meth:`flag_value`), e.g. the settings the gated processes build with."""
        if not isinstance(value, str) or not value:
            raise ValueError(f"set_flag({name!r}, value={value!r}); the value must be a non-empty string")
        self._client().set(f"rlhfkit/flag/{name}", value)

    def flag_value(self, name: str) -> str | None:
        """The value :meth:`set_flag` raised ``name`` with, or None while it is not raised."""
        store, key = self._client(), f"rlhfkit/flag/{name}"
        return store.get(key).decode() if store.check([key]) else None

    def wait_flag(self, name: str, *, timeout_s: float, poll_s: float = 0.05) -> float:
        """Block until :meth:`set_flag` raised ``name`` (in any process); returns the seconds waited. Raises
        ``TimeoutError`` naming the flag after ``timeout_s``."""
        store, key, started = self._client(), f"rlhfkit/flag/{name}", time.monotonic()
        while not store.check([key]):
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"flag {name!r} of the phase store at {self.host}:{self.port} was not raised "
                                   f"within {timeout_s:g} s")
            time.sleep(poll_s)
        return time.monotonic() - started


@dataclass(frozen=True, kw_only=True)
class Transition:
    """One guarded transition. Memory fields are bytes of this process's view of the device (None without CUDA).
    ``result``: what the model's ``sleep()``/``wake_up()`` returned (e.g. a DeepSpeed engine's stats), or None.
    ``displaced``: the role a ``wake(..., displace_releasing=True)`` took the GPU from while it went to sleep.
    ``at``: the wall-clock time (``time.time()``) the claim changed hands: when a wake took it, when a sleep released
    it (what orders the transitions of several processes on one GPU; their ends come later)."""

    action: str
    role: str
    gpu: str
    phase: str | None
    seconds: float
    allocated: int | None
    reserved: int | None
    free: int | None
    result: Any = None
    displaced: str | None = None
    at: float | None = None


def _memory(device: torch.device | None) -> tuple[int | None, int | None, int | None]:
    # Never create a CUDA context just to log memory: a process that drives a GPU from elsewhere (vLLM's front-end
    # actor, whose model lives in an engine-core process) would otherwise take ≈ 0.5 GiB of the shared GPU.
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, None, None
    device = device or torch.device("cuda", torch.cuda.current_device())
    free, _ = torch.cuda.mem_get_info(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), free


class PhaseGuard:
    """Enforces one awake role per GPU across every process that shares ``store``.

    Args:
        store: the shared claim store (default: a new :class:`LocalPhaseStore`, this process only).
        gpu: the default GPU key for this process's calls (e.g. :func:`gpu_key`); calls may pass ``gpu=``.
        device: the CUDA device whose memory is logged (default: the current device).
        sleep_hint: how the caller puts a role to sleep, quoted by a wake's :class:`PhaseConflictError` (``role ->
            text``; e.g. a layer above the guard names its own API). Default: ``guard.sleep('<role>', ...)``.
    """

    def __init__(self, store: PhaseStore | None = None, *, gpu: str | None = None,
                 device: torch.device | int | None = None, sleep_hint: Callable[[str], str] | None = None) -> None:
        if sleep_hint is not None and not callable(sleep_hint):
            raise TypeError(f"sleep_hint={sleep_hint!r}; expected a function role -> text, or None")
        self.store = store if store is not None else LocalPhaseStore()
        self.gpu = gpu
        self.device = torch.device("cuda", device) if isinstance(device, int) else device
        self.sleep_hint = sleep_hint or (lambda role: f"guard.sleep('{role}', ...)")
        self.history: list[Transition] = []

    def _gpu(self, gpu: str | None) -> str:
        gpu = gpu if gpu is not None else self.gpu
        if not gpu:
            raise ValueError("gpu is not set; pass gpu= (e.g. gpu_key()) to PhaseGuard(...) or to this call")
        return str(gpu)

    def awake_role(self, gpu: str | None = None) -> str | None:
        """The role awake on ``gpu``, or None."""
        holder = self.store.holder(self._gpu(gpu))
        return None if holder is None else _split_holder(holder)[0]

    def wake(self, role: str, model: Sleepable | None = None, *, gpu: str | None = None, phase: str | None = None,
             displace_releasing: bool = False, **wake_kwargs: Any) -> Transition:
        """Claim ``gpu`` for ``role`` and call ``model.wake_up(**wake_kwargs)``; PhaseConflictError if another role is
        awake there (the model is not touched). If ``wake_up`` raises, the claim is released.

        A claim belongs to ``role`` *and* ``model`` (object and process): waking a different model under a role name
        that is already awake on the GPU raises :class:`PhaseConflictError` too, naming both models.

        ``displace_releasing=True``: when the other role's claim is marked releasing (:meth:`mark_releasing`: its
        model is going to sleep), take the GPU from it instead of failing; the other sleep goes on at the same time,
        so both models' memory must fit. The transition's ``displaced`` names the role it took over from."""
        gpu = self._gpu(gpu)
        if not role or _OWNER_SEP in role:
            raise ValueError(f"role={role!r}; name the role being woken")
        owner = _owner(model)
        mine, displaced = f"{role}{_OWNER_SEP}{owner}", None
        other = self.store.claim(gpu, mine)
        for _ in range(8):  # each retry follows a change of the claim by another process: a few at most
            if not (other is not None and displace_releasing and other.endswith(_RELEASING)
                    and _split_holder(other)[0] != role):
                break
            if self._swap(gpu, other, mine):
                other, displaced = None, _split_holder(other)[0]
            else:  # the releasing role finished (or another claim came): try again from the start
                other = self.store.claim(gpu, mine)
        if other is not None:
            where = f" for phase '{phase}'" if phase else ""
            other_role, other_owner = _split_holder(other)
            if other_role == role:
                raise PhaseConflictError(
                    f"cannot wake '{role}' ({owner}) on GPU {gpu}{where}: role '{role}' is already awake there as "
                    f"another model ({other_owner or 'unknown'}); two models under one role name would both be awake. "
                    f"Give each model its own role name, or sleep the other one first")
            state = "going to sleep" if other.endswith(_RELEASING) else "awake"
            raise PhaseConflictError(
                f"cannot wake '{role}' on GPU {gpu}{where}: '{other_role}' is {state} there"
                f"{f' ({other_owner})' if other_owner else ''}; put '{other_role}' to sleep first "
                f"({self.sleep_hint(other_role)})")
        start, result, at = time.perf_counter(), None, time.time()
        try:
            if model is not None:
                result = model.wake_up(**wake_kwargs)
        except BaseException:
            self.store.release(gpu, mine)
            raise
        return self._record("wake", role, gpu, phase, time.perf_counter() - start, result, displaced=displaced, at=at)

    def mark_releasing(self, role: str, model: Sleepable | None = None, *, gpu: str | None = None) -> bool:
        """Mark ``role``'s claim on ``gpu`` (held for ``model``) as releasing: its model is about to go to sleep, and
        a ``wake(..., displace_releasing=True)`` of another role may take the GPU before that sleep is done. Call
        :meth:`sleep` after it as usual. Returns False when ``role`` holds no claim there for ``model``."""
        gpu = self._gpu(gpu)
        holder = f"{role}{_OWNER_SEP}{_owner(model)}"
        return self._swap(gpu, holder, holder + _RELEASING)

    def _swap(self, gpu: str, expected: str, desired: str) -> bool:
        swap = getattr(self.store, "swap", None)
        if swap is None:
            raise TypeError(f"{type(self.store).__name__} has no swap(gpu, expected, desired); a releasing claim and "
                            "a wake that displaces it need it (LocalPhaseStore, FilePhaseStore and TCPPhaseStore "
                            "have it)")
        return swap(gpu, expected, desired)

    def sleep(self, role: str, model: Sleepable | None = None, *, gpu: str | None = None, phase: str | None = None,
              **sleep_kwargs: Any) -> Transition:
        """Call ``model.sleep(**sleep_kwargs)``, then release ``role``'s claim on ``gpu`` (if it holds it). Sleeping a
        role that is not awake is allowed (e.g. deepening a keep-weights sleep). With a ``model``, the claim is
        released only when that model woke it; ``model=None`` releases ``role``'s claim whoever made it (a driver
        releasing on behalf of a process that put its model to sleep itself)."""
        gpu = self._gpu(gpu)
        start, result = time.perf_counter(), None
        if model is not None:
            result = model.sleep(**sleep_kwargs)
            holder, at = f"{role}{_OWNER_SEP}{_owner(model)}", time.time()
            # marked releasing or not; a role that displaced this one holds the GPU now, and keeps it
            if not self.store.release(gpu, holder):
                self.store.release(gpu, holder + _RELEASING)
        else:
            holder, at = self.store.holder(gpu), time.time()
            if holder is not None and _split_holder(holder)[0] == role:
                self.store.release(gpu, holder)
        return self._record("sleep", role, gpu, phase, time.perf_counter() - start, result, at=at)

    @contextlib.contextmanager
    def phase(self, name: str, role: str, model: Sleepable | None = None, *, gpu: str | None = None,
              wake_kwargs: dict[str, Any] | None = None, sleep_kwargs: dict[str, Any] | None = None) -> Iterator[Any]:
        """Wake ``role`` for the block, put it back to sleep after (also when the block raises); yields ``model``."""
        self.wake(role, model, gpu=gpu, phase=name, **(wake_kwargs or {}))
        try:
            yield model
        finally:
            self.sleep(role, model, gpu=gpu, phase=name, **(sleep_kwargs or {}))

    def force_release(self, gpu: str | None = None) -> str | None:
        """Drop whatever claim ``gpu`` holds (recovery after a crashed process); returns the dropped role."""
        gpu = self._gpu(gpu)
        holder = self.store.holder(gpu)
        if holder is not None and self.store.release(gpu, None):
            logger.warning("phase guard: force-released '%s' (%s) on GPU %s", *_split_holder(holder), gpu)
        return None if holder is None else _split_holder(holder)[0]

    def _record(self, action: str, role: str, gpu: str, phase: str | None, seconds: float,
                result: Any = None, displaced: str | None = None, at: float | None = None) -> Transition:
        allocated, reserved, free = _memory(self.device)
        transition = Transition(action=action, role=role, gpu=gpu, phase=phase, seconds=seconds,
                                allocated=allocated, reserved=reserved, free=free, result=result, displaced=displaced,
                                at=at)
        self.history.append(transition)
        where = f" (phase {phase})" if phase else ""
        if allocated is None:
            logger.info("phase guard: %s '%s' on GPU %s%s in %.3f s; no CUDA context in this process, no memory to report",
                        action, role, gpu, where, seconds)
        else:
            logger.info("phase guard: %s '%s' on GPU %s%s in %.3f s; allocated %.2f GiB, reserved %.2f GiB, "
                        "free %.2f GiB", action, role, gpu, where, seconds, allocated / _GIB, reserved / _GIB,
                        free / _GIB)
        return transition
