"""The vLLM worker extension through which rlhfkit loads and receives weights inside every vLLM worker process.

vLLM mixes the class named by ``worker_extension_cls`` into each of its workers (one per tensor-parallel rank); the
engine calls its methods with ``LLM.collective_rpc("rlhfkit_...")``, so every rank runs them. vLLM refuses an
extension whose attribute names collide with the worker's, hence the ``rlhfkit_`` prefix on every name here.

What it does: load HF-named tensors with the model's own ``load_weights`` (which maps HF names onto vLLM's fused,
sharded parameters) inside vLLM's layer-wise reload session (``initialize_layerwise_reload`` /
``finalize_layerwise_reload`` from ``vllm.model_executor.model_loader.reload``, the calls vLLM's own weight-transfer
API makes: they re-run each layer's post-load processing — e.g. the CPU backend's weight repacking — and copy the
result into the original storage, so CUDA graphs stay valid) when the model needs it — a quantized model, or one whose
post-load processing replaced a weight (vLLM's CPU backend repacks linear weights) — else the plain ``load_weights``
(one copy per tensor, nothing kept), which is also the fallback where that module does not exist; track which parameters have been rewritten since a level-2 sleep discarded them; run a
weight-sync receiver (:func:`make_weight_receiver` builds an :class:`rlhfkit.weight_sync.WeightReceiver`; any object
with ``receive(load_fn) -> report`` works, built in the worker by a factory named by a dotted path); report the
weight version and per-parameter fingerprints.

LoRA: after ``rlhfkit_use_adapters`` a sync carries a LoRA adapter, registered as a vLLM LoRA model under the id =
its weight version (:mod:`rlhfkit.engines.vllm._lora`); ``rlhfkit_remove_adapters`` removes replaced ones.

What it does not do: transport (the receiver's job, see :mod:`rlhfkit.weight_sync`). Imported by vLLM inside
its worker processes; needs torch only (vLLM is already loaded there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

__all__ = ["WeightSyncExtension", "make_weight_receiver", "resolve_factory", "plain_report", "layerwise_reload_api"]

logger = logging.getLogger(__name__)


def layerwise_reload_api() -> tuple[Any, Any] | None:
    """vLLM's ``(initialize_layerwise_reload, finalize_layerwise_reload)``, or None where this vLLM lacks them."""
    try:
        module = importlib.import_module("vllm.model_executor.model_loader.reload")
    except ImportError:
        return None
    begin = getattr(module, "initialize_layerwise_reload", None)
    finish = getattr(module, "finalize_layerwise_reload", None)
    return (begin, finish) if callable(begin) and callable(finish) else None


def _repacked(model: torch.nn.Module) -> bool:
    """Whether post-load processing replaced a weight of a vLLM layer with a quantization method (every such layer
    creates its parameters with a ``weight_loader``; e.g. vLLM's CPU backend swaps linear weights for repacked
    ones that have none): then only the layer-wise reload can load new weights. Norms and other plain parameters
    legitimately have no loader (``default_weight_loader`` serves them)."""
    for module in model.modules():
        if getattr(module, "quant_method", None) is None:
            continue
        if any(not hasattr(param, "weight_loader") for param in module.parameters(recurse=False)):
            return True
    return False


def resolve_factory(path: str) -> Any:
    """Resolve ``"package.module:attribute"`` (or ``"package.module.attribute"``) to the object it names."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"factory path {path!r} must be a non-empty string like 'package.module:function'")
    module_name, _, attribute = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"factory path {path!r} must name a module and an attribute, like 'package.module:function'")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def plain_report(report: Any) -> dict[str, Any]:
    """A receiver's report as a dict of plain values (collective_rpc results cross process boundaries); a
    ``SyncReport``'s fields."""
    if report is None:
        return {}
    if dataclasses.is_dataclass(report) and not isinstance(report, type):
        report = dataclasses.asdict(report)
    if not isinstance(report, Mapping):
        return {"report": repr(report)}
    plain: dict[str, Any] = {}
    for key, value in report.items():
        if isinstance(value, (str, int, float, bool)) or value is None:
            plain[str(key)] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value):
            plain[str(key)] = list(value)
        else:
            plain[str(key)] = repr(value)
    return plain


def make_weight_receiver(*, config: Mapping[str, Any], endpoint: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                         first_rank: int, label: str = "engine", expected: Any = None, worker_rank: int = 0,
                         worker_world_size: int = 1, device: str = "cpu") -> Any:
    """Build this worker's :class:`rlhfkit.weight_sync.WeightReceiver` from plain data (what crosses vLLM's RPC):
    ``config`` and ``endpoint`` are the fields of ``WeightSyncConfig`` / ``SyncEndpoint`` (``dtype`` as a string such
    as ``"bfloat16"``); tensor-parallel rank ``r`` joins the group as rank ``first_rank + r``. ``endpoint`` may
    also be a list of one endpoint per TP worker (a colocated TP engine: each worker's own group, whose sender shares
    its GPU): rank ``r`` then joins ``endpoint[r]`` as rank ``first_rank``. ``expected``: ``[name, shape, dtype
    string]`` triples the sender's manifest must match, or None."""
    weight_sync = importlib.import_module("rlhfkit.weight_sync")
    fields = dict(config)
    if isinstance(fields.get("dtype"), str):
        fields["dtype"] = getattr(torch, fields["dtype"].removeprefix("torch."))
    sync_config = weight_sync.WeightSyncConfig(**fields)
    if isinstance(endpoint, Mapping):
        rank, own = int(first_rank) + int(worker_rank), endpoint
    else:
        endpoints = list(endpoint)
        if len(endpoints) != int(worker_world_size) or not 0 <= int(worker_rank) < len(endpoints):
            raise ValueError(f"{label}: {len(endpoints)} weight-sync endpoints for {worker_world_size} tensor-parallel "
                             f"worker(s) (this is worker {worker_rank}); give one per worker")
        rank, own = int(first_rank), endpoints[int(worker_rank)]
    place = weight_sync.SyncEndpoint(**{**dict(own), "rank": rank, "label": f"{label}/tp-{worker_rank}"})
    specs = None
    if expected is not None:
        specs = [(str(name), tuple(int(d) for d in shape), getattr(torch, str(dtype).removeprefix("torch.")))
                 for name, shape, dtype in expected]
    options: dict[str, Any] = {"expected": specs}
    if sync_config.backend == "nccl":
        options["device"] = device
    return weight_sync.WeightReceiver(sync_config, place, **options)


class WeightSyncExtension:
    """Mixed into each vLLM worker; every method runs on every tensor-parallel rank via ``collective_rpc``.

    A weight update is a session: ``rlhfkit_begin_weight_update``, any number of ``rlhfkit_load_weights`` buckets,
    ``rlhfkit_finish_weight_update(version)``; ``rlhfkit_receive_weights`` runs a whole session around one sync.
    """

    # --- state kept on the worker (created lazily: vLLM builds the worker before the extension is used) -------------
    def _rlhfkit_state(self) -> dict[str, Any]:
        state = self.__dict__.get("_rlhfkit")
        if state is None:
            state = {"version": 0, "receiver": None, "pending": None, "session": None}
            self.__dict__["_rlhfkit"] = state
        return state

    def _rlhfkit_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined]

    def _rlhfkit_device_context(self) -> Any:
        device = getattr(self, "device", None)
        return torch.device(device) if isinstance(device, (str, torch.device)) else contextlib.nullcontext()

    def _rlhfkit_load(self, weights: Iterable[Any], *, borrowed: bool = False) -> int:
        """Stream ``(name, tensor)`` pairs (lists after msgpack) into the model's ``load_weights``; returns the count.

        ``borrowed``: the tensors are views into a buffer their producer reuses once the iterator moves on (a
        weight-sync bucket). The plain loader copies each weight at once, but vLLM's layer-wise reload keeps the
        weights of a layer until the layer is complete — possibly past a bucket boundary — so they are cloned then.
        """
        state = self._rlhfkit_state()
        session = state["session"]
        if session is None:
            raise RuntimeError("rlhfkit_load_weights outside a weight-update session; call "
                               "rlhfkit_begin_weight_update first")
        clone = borrowed and session["layerwise"]
        count = 0

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in weights:
                count += 1
                yield str(name), (tensor.clone() if clone else tensor)

        with self._rlhfkit_device_context():
            loaded = self._rlhfkit_model().load_weights(weights=stream())
        if state["pending"] is not None and loaded is not None:
            state["pending"].difference_update(loaded)
        session["num_tensors"] += count
        return count

    # --- collective_rpc entry points ----------------------------------------------------------------------------------
    def _rlhfkit_layerwise(self) -> bool:
        """Whether updates go through vLLM's layer-wise reload: for a quantized model, or one whose post-load
        processing replaced a weight (walked once per model)."""
        state = self._rlhfkit_state()
        model = self._rlhfkit_model()
        cached = state.get("transforms")
        if cached is None or cached[0] is not model:
            model_config = getattr(self, "model_config", None)
            cached = state["transforms"] = (model, getattr(model_config, "quantization", None) is not None
                                            or _repacked(model))
        return cached[1]

    def rlhfkit_begin_weight_update(self) -> dict[str, Any]:
        state = self._rlhfkit_state()
        if state["session"] is not None:
            raise RuntimeError("rlhfkit_begin_weight_update called while a weight update is open; finish it first")
        api = layerwise_reload_api() if self._rlhfkit_layerwise() else None
        if api is not None:
            with self._rlhfkit_device_context():
                api[0](self._rlhfkit_model())
        state["session"] = {"layerwise": api is not None, "num_tensors": 0}
        return dict(state["session"])

    def rlhfkit_load_weights(self, weights: Iterable[Any]) -> int:
        """Load one bucket of HF-named tensors into the open session; returns how many tensors it held."""
        return self._rlhfkit_load(weights)

    def rlhfkit_finish_weight_update(self, version: int | None = None) -> dict[str, Any]:
        """Close the session (vLLM's layer-wise post-processing runs here); set the version when given."""
        state = self._rlhfkit_state()
        session, state["session"] = state["session"], None
        if session is None:
            raise RuntimeError("rlhfkit_finish_weight_update without an open session")
        api = layerwise_reload_api() if session["layerwise"] else None
        if api is not None:
            with self._rlhfkit_device_context():
                api[1](self._rlhfkit_model(), self.model_config)  # type: ignore[attr-defined]
        if version is not None:
            from rlhfkit.engines.protocol import next_weight_version

            state["version"] = next_weight_version(f"vLLM worker rank {int(getattr(self, 'rank', 0))}",
                                                   int(state["version"]), int(version))
        return {**session, "version": state["version"], "rank": int(getattr(self, "rank", 0))}

    def rlhfkit_mark_weights_discarded(self) -> None:
        """Called after a level-2 sleep: every parameter must be rewritten before the weights are valid again."""
        self._rlhfkit_state()["pending"] = {name for name, _ in self._rlhfkit_model().named_parameters()}

    def rlhfkit_missing_parameters(self) -> list[str]:
        """vLLM parameter names not rewritten since the last discard (empty when the weights are complete)."""
        pending = self._rlhfkit_state()["pending"]
        return sorted(pending) if pending else []

    def rlhfkit_init_weight_sync(self, factory: str, kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Build this rank's weight-sync receiver: ``resolve_factory(factory)(**kwargs)``.

        ``worker_rank``, ``worker_world_size`` and ``device`` are added to ``kwargs`` when the factory's signature
        accepts them, so one factory serves every tensor-parallel rank.
        """
        build = resolve_factory(factory)
        arguments = dict(kwargs or {})
        context = {"worker_rank": int(getattr(self, "rank", 0)),
                   "worker_world_size": int(getattr(getattr(self, "parallel_config", None), "world_size", 1)),
                   "device": str(getattr(self, "device", "cpu"))}
        try:
            accepted = inspect.signature(build).parameters
        except (TypeError, ValueError):
            accepted = {}
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        arguments.update({k: v for k, v in context.items() if (takes_all or k in accepted) and k not in arguments})
        receiver = build(**arguments)
        if not callable(getattr(receiver, "receive", None)):
            raise TypeError(f"weight-sync factory {factory!r} returned {type(receiver).__name__}, which has no "
                            "receive(load_fn) method")
        self.rlhfkit_close_weight_sync()  # a previous receiver leaves its group first
        state = self._rlhfkit_state()
        state["receiver"], state["adapter"] = receiver, None  # full weights until rlhfkit_use_adapters
        return context

    # --- LoRA adapters (see rlhfkit.engines.vllm._lora) ---------------------------------------------------------------
    def rlhfkit_use_adapters(self, peft: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
        """Make every later sync of this receiver a LoRA adapter (``peft``: its ``adapter_config.json`` fields;
        ``names``: the tensors it carries), checked now against vLLM's LoRA support, before any transfer."""
        from rlhfkit.engines.vllm._lora import check_adapter_support

        info = check_adapter_support(self, peft, names)
        self._rlhfkit_state()["adapter"] = {"peft": dict(peft)}
        return info

    def rlhfkit_remove_adapters(self, ids: list[int]) -> list[int]:
        from rlhfkit.engines.vllm._lora import remove_adapters

        return remove_adapters(self, ids)

    def rlhfkit_list_adapters(self) -> list[int]:
        from rlhfkit.engines.vllm._lora import _lora_manager

        return sorted(_lora_manager(self).list_adapters())

    def _rlhfkit_receive_adapter(self, version: int | None, check_version: Callable[[int | None], None]
                                 ) -> dict[str, Any]:
        """One sync of adapter tensors: collected (cloned: they are views of the channel's reused buckets), then
        registered as a vLLM LoRA model under the id = the new weight version."""
        from rlhfkit.engines.vllm._lora import register_adapter

        state = self._rlhfkit_state()
        collected: dict[str, torch.Tensor] = {}

        def collect(weights: Iterable[Any], version: int | None = None) -> int:
            check_version(version)
            count = 0
            for name, tensor in weights:
                collected[str(name)] = tensor.clone()
                count += 1
            return count

        started = time.perf_counter()
        report = plain_report(state["receiver"].receive(collect))
        received = time.perf_counter()
        reported = report.get("version")
        new_version = int(version if version is not None else reported if isinstance(reported, int)
                          else state["version"] + 1)
        registered = register_adapter(self, new_version, collected, state["adapter"]["peft"])
        state["version"] = new_version
        report.update(version=new_version, rank=int(getattr(self, "rank", 0)), adapter_id=new_version,
                      adapters=registered, num_loaded=len(collected), receive_s=received - started,
                      register_s=time.perf_counter() - received, layerwise=False)
        return report

    def rlhfkit_receive_weights(self, version: int | None = None) -> dict[str, Any]:
        """Receive one full sync through the receiver in one session, loading each bucket as it arrives; returns
        the receiver's report (plain values) with the version this rank now holds and the session's timings."""
        state = self._rlhfkit_state()
        receiver = state["receiver"]
        if receiver is None:
            raise RuntimeError("rlhfkit_receive_weights called before rlhfkit_init_weight_sync; call "
                               "engine.init_weight_sync(...) first")
        from rlhfkit.engines.protocol import next_weight_version

        who, held = f"vLLM worker rank {int(getattr(self, 'rank', 0))}", int(state["version"])
        if version is not None:
            next_weight_version(who, held, version)

        def check_version(offered: int | None) -> None:  # the sync's own version, before its first tensor loads
            if version is None and offered is not None:
                next_weight_version(who, held, int(offered))

        if state.get("adapter") is not None:
            return self._rlhfkit_receive_adapter(version, check_version)
        started = time.perf_counter()
        self.rlhfkit_begin_weight_update()
        begun = time.perf_counter()
        try:
            loading_s = [0.0]  # host time spent inside the loads (the rest of receive_s is the channel's)

            def timed(load: Callable[..., int], *args: Any, **kwargs: Any) -> int:
                start = time.perf_counter()
                try:
                    return load(*args, **kwargs)
                finally:
                    loading_s[0] += time.perf_counter() - start

            def load_stream(weights: Iterable[Any], version: int | None = None) -> int:
                check_version(version)
                return timed(self._rlhfkit_load, weights, borrowed=True)

            report = plain_report(receiver.receive(load_stream))
        finally:
            received = time.perf_counter()
            session = self.rlhfkit_finish_weight_update(None)
        report.update(begin_s=begun - started, receive_s=received - begun, finish_s=time.perf_counter() - received,
                      load_s=loading_s[0])
        reported = report.get("version")
        state["version"] = int(version if version is not None else reported if isinstance(reported, int)
                               else state["version"] + 1)
        report.update(version=state["version"], rank=session["rank"], layerwise=session["layerwise"],
                      num_loaded=session["num_tensors"])
        return report

    def rlhfkit_close_weight_sync(self) -> None:
        state = self._rlhfkit_state()
        receiver, state["receiver"] = state["receiver"], None
        if receiver is not None and callable(getattr(receiver, "close", None)):
            receiver.close()

    def rlhfkit_report_version(self) -> int:
        return int(self._rlhfkit_state()["version"])

    def rlhfkit_weight_fingerprint(self) -> dict[str, list[float]]:
        """Per vLLM parameter ``[sum, sum of squares]`` in float64: equal weights give equal fingerprints on the
        same device and sharding (names are vLLM's fused names, e.g. ``qkv_proj``, not HF's)."""
        fingerprint = {}
        with torch.no_grad():
            for name, parameter in self._rlhfkit_model().named_parameters():
                values = parameter.detach().double()
                fingerprint[name] = [float(values.sum()), float((values * values).sum())]
        return fingerprint

    def rlhfkit_weight_bytes(self) -> int:
        """Bytes of this worker's parameters (what a level-1 sleep copies to host)."""
        return sum(p.numel() * p.element_size() for p in self._rlhfkit_model().parameters())

    def rlhfkit_seed_sampling(self, seed: int | None) -> bool:
        """``seed``: save the states of the generators vLLM's sampler draws unseeded requests from (the CPU one and
        this worker's GPU's) and seed both with ``seed``; None: restore the saved states (returns whether any were
        saved). A call under ``SamplingConfig(seed_scope="call")`` runs between the two, so its samples depend on
        its seed alone and the process's own random streams go on as if it had not run."""
        state = self._rlhfkit_state()
        device = getattr(self, "device", None)
        cuda = (torch.device(device) if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"
                else None)
        if seed is None:
            saved, state["rng"] = state.get("rng"), None
            if saved is None:
                return False
            torch.random.set_rng_state(saved[0])
            if cuda is not None:
                torch.cuda.set_rng_state(saved[1], cuda)
            return True
        if state.get("rng") is None:  # a call that failed before restoring keeps the first saved states
            state["rng"] = (torch.random.get_rng_state(), None if cuda is None else torch.cuda.get_rng_state(cuda))
        torch.random.default_generator.manual_seed(int(seed))
        if cuda is not None:
            torch.cuda.default_generators[cuda.index if cuda.index is not None else torch.cuda.current_device()
                                          ].manual_seed(int(seed))
        return True

    def rlhfkit_worker_info(self) -> dict[str, Any]:
        return {"rank": int(getattr(self, "rank", 0)), "pid": os.getpid(), "device": str(getattr(self, "device", "")),
                "version": int(self._rlhfkit_state()["version"])}
