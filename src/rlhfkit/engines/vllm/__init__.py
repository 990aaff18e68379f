"""The ``vllm`` rollout engine: vLLM behind the :class:`~rlhfkit.engines.protocol.RolloutEngine` protocol, as a plain
class (:class:`VLLMEngine`, usable in-process) and as Ray actors (:func:`create_engines`, :func:`create_engine_group`).

What it does: token-in/token-out generation with ``n`` samples and the sampled tokens' log-probs; ``sleep(level)`` and
staged ``wake_up(tags)``; weight loading by HF parameter name (:meth:`VLLMEngine.load_weights`, for small models and
tests) and weight receiving through rlhfkit's weight-sync channel inside every vLLM worker
(:meth:`VLLMEngine.init_weight_sync` / :meth:`VLLMEngine.receive_weights`, through the worker extension in
:mod:`rlhfkit.engines.vllm._worker` and ``LLM.collective_rpc``, which applies them with the model's own
``load_weights``); prefix-cache reset after every weight change; a weight
version. Ray helpers place engines on a placement plan (:mod:`rlhfkit.placement`) or a shared placement group, with
tensor parallelism through vLLM's Ray executor; :class:`~rlhfkit.engines.router.EngineGroup` spreads requests.

Log-probs: vLLM's ``logprobs_mode="processed_logprobs"`` (the default here) returns ``log_softmax(logits /
temperature)`` of the sampled token — the convention of :mod:`rlhfkit.engines.protocol` — when ``top_p == 1`` and
``top_k == 0``. With top-p/top-k truncation vLLM renormalises over the kept tokens, so its values are larger than the
protocol's by ``-log(kept mass)``; ``"raw_logprobs"`` ignores the temperature. Greedy requests (temperature 0) get the
raw ``log_softmax(logits)``.

Sleep levels: level 1 copies the weights to pinned host memory and discards the KV cache — wake-up is a host→device
copy. Level 2 discards the weights too (no host copy, no host memory): choose it when the next step overwrites every
weight anyway (a weight sync right after waking), because it saves the device→host copy at sleep and the host memory;
after it, generation is refused until a load or sync has rewritten every parameter (checked per vLLM parameter).

LoRA (``VLLMEngineConfig(enable_lora=True)``, :meth:`VLLMEngine.init_weight_sync` with ``lora=``): each sync carries
the adapter alone, registered in vLLM in memory under the id = its weight version (:mod:`rlhfkit.engines.vllm._lora`);
generation asks for the newest id, and a replaced adapter is removed once no generate call uses it. Sleep level 2 is
refused then (the base weights are never re-sent). See ``docs/lora.md``.

What it does not do: text prompts, speculative decoding; quantized checkpoints are untested (weights are loaded
through vLLM's layer-wise reload, which is meant to handle them). Needs ``rlhfkit[vllm]`` (and ``rlhfkit[ray]`` for
the actor helpers); nothing is imported at module import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from rlhfkit._optional import require
from rlhfkit.engines._pause import GenerationPause, GenerationPausedTimeout, PausableGeneration
from rlhfkit.engines._state import EngineState
from rlhfkit.weight_sync import ManifestMismatchError, WeightSyncVersionError
from rlhfkit.engines.vllm._compat import (
    VLLMFeatureError,
    detect_features,
    lora_request_class,
    make_sampling_params,
    make_token_prompt,
    model_inspection_in_process,
    request_seed,
    require_feature,
)
from rlhfkit.engines.vllm._config import WORKER_EXTENSION, VLLMEngineConfig, build_llm_kwargs
from rlhfkit.engines.vllm._lora import AdapterSlots, adapter_path
from rlhfkit.engines.vllm._stepping import (Stepped, StepwiseGeneration, completion_logprobs,
                                           logprob_values as _logprob_values)  # noqa: F401 - tests read it here
from rlhfkit.engines.vllm._ray import create_engine_group, create_engines, kill_engines, plan_launches, wait_ready
from rlhfkit.engines.protocol import (WAKE_TAGS, SamplingConfig, WeightVersionError, next_weight_version,
                                      prompt_lists)
from rlhfkit.engines.router import pack_generate_result
from rlhfkit.types import Rollout

__all__ = ["VLLMEngineConfig", "VLLMEngine", "VLLMEngineActor", "create_engines",
           "create_engine_group", "plan_launches", "kill_engines", "VLLMFeatureError", "GenerationPausedTimeout"]

logger = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMEngine(StepwiseGeneration, PausableGeneration, EngineState):
    """One vLLM engine (``vllm.LLM``) behind the rollout-engine protocol; see the module docstring.

    Args:
        config: engine settings.
        engine_index: position among the engines of a group (seed offset, names in errors).
        distributed_executor_backend: passed to ``vllm.LLM`` (the Ray actor uses ``"ray"`` for TP > 1).
        vllm: the vllm module to use (default: ``import vllm``); tests pass a stand-in.
        llm: an already built ``vllm.LLM`` (or stand-in) to wrap instead of building one.
    """

    def __init__(self, config: VLLMEngineConfig, *, engine_index: int = 0,
                 distributed_executor_backend: str | None = None, vllm: Any = None, llm: Any = None) -> None:
        if not isinstance(config, VLLMEngineConfig):
            raise TypeError(f"config must be a VLLMEngineConfig, got {type(config).__name__}")
        self.config = config
        self.engine_index = engine_index
        self._vllm = vllm if vllm is not None else require("vllm", user="rlhfkit.engines.vllm")
        self.features = detect_features(self._vllm)
        if config.pausable:  # before the LLM is built: no GPU work for an engine that could not pause
            require_feature("stepwise", self.features, purpose="VLLMEngineConfig(pausable=True)")
        self._pause = GenerationPause(config.pause_timeout_s)  # pausable: generate parks between engine steps
        self._stepping = threading.Lock()  # pausable: one generate call steps the engine at a time
        self._stepper: int | None = None  # the thread that steps it now
        self._request_ids = itertools.count()
        self._final_only: bool | None = None  # pausable: final outputs only (None: not yet known for this vLLM)
        if llm is None:
            if config.in_process and config.tensor_parallel_size == 1:
                # vLLM decides this when the LLM is built; its own engine-core process would also receive
                # load_weights' tensors through a serializer that turns them into lists. An explicit value wins.
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            kwargs = build_llm_kwargs(config, self.features, engine_index=engine_index,
                                      distributed_executor_backend=distributed_executor_backend)
            logger.info("engine %d: starting vLLM %s for %s", engine_index, self.features.version, config.model)
            in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" and config.tensor_parallel_size == 1
            with model_inspection_in_process(self._vllm) if in_process else contextlib.nullcontext():
                llm = self._vllm.LLM(**kwargs)
        self._llm = llm
        self._init_state()
        self._sleep_level = 0
        self._prefix_cache_stale = False
        self._adapters: AdapterSlots | None = None  # set by init_weight_sync(lora=...): syncs carry LoRA adapters

    # --- protocol: state ----------------------------------------------------------------------------------------------
    @property
    def llm(self) -> Any:
        """The wrapped ``vllm.LLM`` (for what this class does not cover)."""
        return self._llm

    def health_check(self) -> dict[str, Any]:
        """Round-trip to every vLLM worker; returns the engine's state and each worker's reported version."""
        workers = self._rpc("rlhfkit_worker_info", timeout=self.config.health_timeout_s)
        return {"engine_index": self.engine_index, "pid": os.getpid(), "weight_version": self._version,
                "asleep": list(self.asleep_tags), "weights_valid": self._weights_valid, "workers": workers,
                "adapters": None if self._adapters is None else self._adapters.registered}

    @property
    def adapter_id(self) -> int | None:
        """The LoRA adapter generation uses (its id = the weight version that brought it), or None (base model)."""
        return None if self._adapters is None else self._adapters.current

    def _rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        if self._stepper not in (None, threading.get_ident()):  # another thread steps the engine (pausable)
            self._check_quiet(f"{method}()")
        if self.features.collective_rpc_timeout and timeout is not None:
            return self._llm.collective_rpc(method, timeout=timeout, args=args)
        return self._llm.collective_rpc(method, args=args)

    # --- protocol: generate -------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 prompt_indices: Sequence[int] | None = None) -> list[Rollout]:
        """Sample ``sampling.n`` responses per prompt; prompt-major, then sample index.

        ``prompt_indices`` (default ``0..P-1``) become ``Rollout.prompt_index`` and, when ``sampling.seed`` is set,
        seed each prompt with :func:`~rlhfkit.engines.vllm._compat.request_seed` — so a prompt's samples do not depend
        on which engine of a group served it. With ``sampling.seed_scope="call"`` the requests carry no seed: the
        workers' generators are seeded with ``request_seed(seed, prompt_indices[0])`` for the call (their states are
        restored after it), and vLLM samples the batch at once.
        """
        prompts, indices, outputs = self._run(prompt_token_ids, sampling, prompt_indices)
        return [rollout for output, prompt, index in zip(outputs, prompts, indices)
                for rollout in self._to_rollouts(output, prompt, index, sampling)]

    def generate_packed(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                        prompt_indices: Sequence[int] | None = None) -> dict[str, Any]:
        """:meth:`generate` in the compact form of :func:`rlhfkit.engines.router.pack_generate_result` (numpy arrays,
        no prompts): what an engine actor returns to an :class:`~rlhfkit.engines.router.EngineGroup`, which rebuilds
        the rollouts on its side (:func:`~rlhfkit.engines.router.unpack_generate_result`)."""
        _, _, outputs = self._run(prompt_token_ids, sampling, prompt_indices)
        responses, logprobs, finish, versions = [], [] if sampling.logprobs else None, [], []
        for output in outputs:
            for completion in self._completions(output, sampling):
                token_ids = list(completion.token_ids)
                responses.append(token_ids)
                finish.append(_FINISH.get(str(completion.finish_reason), "abort"))
                versions.append(completion.versions if isinstance(completion, Stepped) else None)
                if logprobs is not None:
                    logprobs.append(completion_logprobs(completion, token_ids))
        spans = any(v and v[-1] != v[0] for v in versions)
        return pack_generate_result(
            responses, logprobs, finish, n=sampling.n, weight_version=self._version,
            versions=[v or [self._version] * len(r) for v, r in zip(versions, responses)] if spans else None)

    def _run(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
             prompt_indices: Sequence[int] | None) -> tuple[list[list[int]], list[int], list[Any]]:
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if self.config.pausable:
            with self._stepping, self._pause.running():
                self._stepper = threading.get_ident()
                try:
                    self._pause.park()  # a call that arrives during a pause starts with the new weights
                    return self._run_requests(prompt_token_ids, sampling, prompt_indices)
                finally:
                    self._stepper = None
        return self._run_requests(prompt_token_ids, sampling, prompt_indices)

    def _run_requests(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                      prompt_indices: Sequence[int] | None) -> tuple[list[list[int]], list[int], list[Any]]:
        self._check_ready("generate")
        prompts, indices = prompt_lists(prompt_token_ids, prompt_indices)
        if not prompts:
            return [], [], []
        self._reset_prefix_cache_if_stale()  # prefixes cached before a weight change would reuse stale KV
        call_seed = None  # seed_scope="call": the workers' generators, seeded here, sample the unseeded requests
        if sampling.seed is not None and sampling.seed_scope == "call":
            call_seed, sampling = request_seed(sampling.seed, indices[0]), dataclasses.replace(sampling, seed=None)
        make = lambda seed: make_sampling_params(
            sampling, sampling_params_cls=self._vllm.SamplingParams, features=self.features, seed=seed)
        params = make(None) if sampling.seed is None else [make(request_seed(sampling.seed, i)) for i in indices]
        tokens_prompt = getattr(self._vllm, "TokensPrompt", None)
        requests = [make_token_prompt(prompt, tokens_prompt_cls=tokens_prompt) for prompt in prompts]
        adapter_id = self._adapters.acquire() if self._adapters is not None else None
        try:
            extra = {} if adapter_id is None else {"lora_request": lora_request_class(self._vllm)(
                lora_name=f"rlhfkit-v{adapter_id}", lora_int_id=adapter_id, lora_path=adapter_path(adapter_id))}
            if call_seed is not None:
                self._rpc("rlhfkit_seed_sampling", call_seed)
            try:
                if self.config.pausable:
                    outputs = self._step_requests(requests, indices, sampling, extra)
                else:
                    outputs = self._llm.generate(requests, params, use_tqdm=False, **extra)
            except BaseException:
                if call_seed is not None:
                    with contextlib.suppress(Exception):  # the failure is the error; restore the states if we can
                        self._rpc("rlhfkit_seed_sampling", None)
                raise
            if call_seed is not None:
                self._rpc("rlhfkit_seed_sampling", None)
        finally:  # both paths return once this call's requests have finished (or failed)
            if self._adapters is not None:
                self._remove_adapters(self._adapters.release(adapter_id))
        if len(outputs) != len(prompts):
            raise RuntimeError(f"engine {self.engine_index}: vLLM returned {len(outputs)} outputs for "
                               f"{len(prompts)} prompts")
        return prompts, indices, outputs

    # --- in-flight weight updates (pausable) --------------------------------------------------------------------------
    def _check_pausable(self) -> None:
        if not self.config.pausable:
            raise RuntimeError(f"engine {self.engine_index}: pause_generation() needs VLLMEngineConfig(pausable=True)")

    def _check_quiet(self, what: str) -> None:
        """``pausable``: refuse to touch the weights or memory while a generate call is stepping the engine."""
        if self.config.pausable:
            self._pause.check_quiet(f"engine {self.engine_index}: {what}")

    def _completions(self, output: Any, sampling: SamplingConfig) -> list[Any]:
        completions = sorted(output.outputs, key=lambda c: c.index)
        if len(completions) != sampling.n:
            raise RuntimeError(f"engine {self.engine_index}: vLLM returned {len(completions)} samples for a prompt; "
                               f"expected n={sampling.n}")
        return completions

    def _to_rollouts(self, output: Any, prompt: list[int], index: int, sampling: SamplingConfig) -> Iterator[Rollout]:
        completions = self._completions(output, sampling)
        prompt_tensor = torch.tensor(prompt, dtype=torch.int64)
        for sample_index, completion in enumerate(completions):
            token_ids = [int(t) for t in completion.token_ids]
            versions = completion.versions if isinstance(completion, Stepped) else None
            spans = bool(versions) and versions[-1] != versions[0]
            yield Rollout(
                prompt_token_ids=prompt_tensor,
                response_token_ids=torch.tensor(token_ids, dtype=torch.int64),
                response_logprobs=(torch.tensor(completion_logprobs(completion, token_ids), dtype=torch.float32)
                                   if sampling.logprobs else None),
                finish_reason=_FINISH.get(str(completion.finish_reason), "abort"),  # type: ignore[arg-type]
                prompt_index=index, sample_index=sample_index,
                weight_version=versions[0] if versions else self._version,
                response_weight_versions=torch.tensor(versions, dtype=torch.int64) if spans else None,
            )

    # --- protocol: sleep / wake ---------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> dict[str, float]:
        """Release accelerator memory: level 1 keeps the weights in host memory, level 2 discards them. Returns
        ``bytes_moved``: the weights' bytes copied to host (level 1; per GPU, the largest tensor-parallel shard) or 0
        (level 2: nothing is copied, the next weight sync re-sends them)."""
        if not self.config.enable_sleep_mode:
            raise RuntimeError(f"engine {self.engine_index}: sleep() needs VLLMEngineConfig.enable_sleep_mode=True")
        if level == 2 and self._adapters is not None:
            raise ValueError(f"engine {self.engine_index}: sleep(level=2) would discard the base weights (and vLLM's "
                             "adapter buffers), which LoRA adapter syncs never rewrite; use level=1")
        self._check_quiet("sleep()")
        self._check_sleep(level)
        moved = self._weight_bytes() if level == 1 else 0
        self._llm.sleep(level=level)
        self._asleep = set(WAKE_TAGS)
        self._sleep_level = level
        if level == 2:
            self._invalidate("sleep(level=2) discarded them")
        return {"bytes_moved": float(moved)}

    def _weight_bytes(self) -> int:
        """Bytes of the model's parameters on one GPU (the largest worker's), asked once while awake. vLLM's level-1
        sleep also copies the weight-tagged buffers (rotary caches): a small undercount."""
        if getattr(self, "_weight_bytes_cached", None) is None:
            self._weight_bytes_cached = max(self._rpc("rlhfkit_weight_bytes", timeout=self.config.health_timeout_s))
        return self._weight_bytes_cached

    def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, float]:
        """Restore ``"weights"``, ``"kv_cache"`` or both (``None``); waking what is awake does nothing. Returns
        ``bytes_moved``: the weights' bytes copied back from host (after a level-1 sleep), else 0."""
        wanted = self._tags_to_wake(tags)
        if not wanted:
            return {"bytes_moved": 0.0}
        self._check_quiet("wake_up()")
        moved = self._weight_bytes() if "weights" in wanted and self._sleep_level == 1 else 0
        if self.features.sleep_tags:
            self._llm.wake_up(tags=wanted)
        elif len(wanted) < len(self._asleep):
            require_feature("sleep_tags", self.features, purpose=f"wake_up(tags={wanted})")
        else:
            self._llm.wake_up()
        self._asleep.difference_update(wanted)
        if not self._asleep:
            self._sleep_level = 0
        return {"bytes_moved": float(moved)}

    def _reset_prefix_cache_if_stale(self) -> None:
        if self._prefix_cache_stale and "kv_cache" not in self._asleep and self.features.reset_prefix_cache:
            self._llm.reset_prefix_cache()
            self._prefix_cache_stale = False

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes (computed with old weights) now. After a weight change this happens by itself, at
        the next generation: a sync does not wait for the engine core's round trip, and several syncs between two
        generations reset once."""
        self._prefix_cache_stale = True
        self._reset_prefix_cache_if_stale()

    # --- protocol: weights --------------------------------------------------------------------------------------------
    def _invalidate(self, reason: str) -> None:
        if self._weights_valid:
            self._rpc("rlhfkit_mark_weights_discarded")
        self._weights_valid = False
        self._invalid_reason = reason

    def _after_weight_change(self, version: int) -> None:
        self._version = version
        if not self._weights_valid:
            missing = sorted({name for worker in self._rpc("rlhfkit_missing_parameters") for name in worker})
            if missing:
                logger.warning("engine %d: %d parameter(s) not yet rewritten since sleep(level=2), e.g. %s",
                               self.engine_index, len(missing), missing[:3])
            self._weights_valid = not missing
            if missing:
                self._invalid_reason = f"{len(missing)} parameter(s) not rewritten since {self._invalid_reason}"
        self._prefix_cache_stale = True  # reset before the next generation (_run), not inside the sync

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> int:
        """Load HF-named tensors into every worker in one update session (buckets of ``config.load_bucket_bytes``
        through ``collective_rpc``); returns how many tensors were loaded. ``version`` defaults to the current + 1.
        A failure part-way marks the weights invalid (generation is refused until a complete load)."""
        self._check_quiet("load_weights()")
        self._check_weights_awake("load_weights")
        new_version = next_weight_version(f"engine {self.engine_index}", self._version, version)
        timeout = self.config.control_timeout_s
        count, bucket, bucket_bytes = 0, [], 0
        self._rpc("rlhfkit_begin_weight_update", timeout=timeout)
        try:
            for name, tensor in weights:
                if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"load_weights expects (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                                    f"{type(tensor).__name__})")
                bucket.append((name, tensor.detach()))
                bucket_bytes += tensor.numel() * tensor.element_size()
                if bucket_bytes >= self.config.load_bucket_bytes:
                    self._rpc("rlhfkit_load_weights", bucket, timeout=timeout)
                    count, bucket, bucket_bytes = count + len(bucket), [], 0
            if bucket:
                self._rpc("rlhfkit_load_weights", bucket, timeout=timeout)
                count += len(bucket)
        except BaseException:
            self._rpc("rlhfkit_finish_weight_update", None, timeout=timeout)
            self._invalidate("a load_weights call failed part-way")
            raise
        self._rpc("rlhfkit_finish_weight_update", new_version, timeout=timeout)
        self._after_weight_change(new_version)
        return count

    def init_weight_sync(self, sync_config: Any, endpoint: Any, *, first_rank: int,
                         expected: Sequence[tuple[str, Sequence[int], Any]] | None = None,
                         lora: Any = None) -> list[dict[str, Any]]:
        """Join a :mod:`rlhfkit.weight_sync` group: every vLLM worker builds a ``WeightReceiver`` whose rank is
        ``first_rank + its tensor-parallel rank`` (so an engine of TP size t takes ranks ``first_rank ..
        first_rank + t - 1``; the sender's ``SyncEndpoint.world_size`` counts them all).

        Or one group per worker: ``endpoint`` a sequence of ``tensor_parallel_size`` endpoints, and worker ``k``
        joins ``endpoint[k]`` as rank ``first_rank``. This is how a colocated TP engine receives over CUDA IPC: TP
        worker ``k`` shares its GPU with one trainer rank, whose sender sends it the full weights (vLLM's
        ``load_weights`` keeps the worker's shard).

        Args:
            sync_config: the channel's ``WeightSyncConfig`` (same as the sender's).
            endpoint: the sender's ``SyncEndpoint`` (its bound port), e.g. ``sender.endpoint``; or one per TP worker.
            first_rank: this engine's first receiver rank (>= 1).
            expected: ``(HF name, shape, dtype)`` of every tensor the sync must carry, checked against the
                sender's manifest before any byte moves; None accepts any manifest (with ``lora``: the adapter's
                shapes on this engine's model, :func:`rlhfkit.lora.describe_adapter_of`).
            lora: a :class:`rlhfkit.lora.LoraConfig`: every sync then carries only that adapter (peft's names),
                registered in vLLM under the id = its weight version; generation uses the newest one. Needs
                ``VLLMEngineConfig(enable_lora=True)`` and ``max_lora_rank >= lora.rank``.
        """
        if isinstance(first_rank, bool) or not isinstance(first_rank, int) or first_rank < 1:
            raise ValueError(f"first_rank={first_rank!r}; receivers take ranks >= 1 (the sender is rank 0)")
        if lora is not None:
            expected = self._adapter_manifest(lora, sync_config, expected)
        def fields(instance: Any) -> dict[str, Any]:  # a config dataclass as the plain data vLLM's RPC carries
            return {name: getattr(instance, name) for name in instance.__dataclass_fields__}

        config_fields = fields(sync_config)
        if config_fields.get("dtype") is not None:
            config_fields["dtype"] = str(config_fields["dtype"]).removeprefix("torch.")
        per_worker = isinstance(endpoint, (list, tuple))
        if per_worker and len(endpoint) != self.config.tensor_parallel_size:
            raise ValueError(f"engine {self.engine_index}: init_weight_sync got {len(endpoint)} endpoints for "
                             f"tensor_parallel_size={self.config.tensor_parallel_size}; give one per TP worker "
                             "(or one endpoint for all of them)")
        endpoint_fields = [fields(each) for each in endpoint] if per_worker else fields(endpoint)
        plain_expected = None if expected is None else [
            [str(name), [int(d) for d in shape], str(dtype).removeprefix("torch.")] for name, shape, dtype in expected]
        kwargs = {"config": config_fields, "endpoint": endpoint_fields, "first_rank": first_rank,
                  "label": f"engine-{self.engine_index}", "expected": plain_expected}
        contexts = self.init_weight_receiver("rlhfkit.engines.vllm._worker:make_weight_receiver", kwargs)
        if lora is not None:
            names = [name for name, _, _ in plain_expected]
            self._rpc("rlhfkit_use_adapters", lora.peft_dict(), names, timeout=self.config.control_timeout_s)
            if self._adapters is None:
                self._adapters = AdapterSlots(self.config.max_loras + 1)
        return contexts

    def _adapter_manifest(self, lora: Any, sync_config: Any, expected: Any) -> Any:
        """Checks of a LoRA sync before anything is built; the adapter's ``expected`` manifest when not given."""
        from rlhfkit.lora import LoraConfig, describe_adapter_of

        if not isinstance(lora, LoraConfig):
            raise TypeError(f"lora={lora!r}; expected an rlhfkit.lora.LoraConfig or None")
        if not self.config.enable_lora:
            raise ValueError(f"engine {self.engine_index}: init_weight_sync(lora=...) needs an engine built with "
                             "VLLMEngineConfig(enable_lora=True)")
        if lora.rank > self.config.max_lora_rank:
            raise ValueError(f"LoraConfig.rank={lora.rank} is above engine {self.engine_index}'s "
                             f"VLLMEngineConfig.max_lora_rank={self.config.max_lora_rank}; raise max_lora_rank")
        if expected is not None:
            return expected
        dtype = getattr(sync_config, "dtype", None)
        if dtype is None:
            dtype = torch.float32 if self.config.dtype in ("auto", "float32") else getattr(torch, self.config.dtype)
        return describe_adapter_of(self.config.model, lora, dtype=dtype)

    def _remove_adapters(self, ids: list[int]) -> None:
        if ids and self._adapters is not None:
            self._rpc("rlhfkit_remove_adapters", ids, timeout=self.config.control_timeout_s)
            self._adapters.removed(ids)

    def init_weight_receiver(self, factory: str, kwargs: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Build any weight receiver in every vLLM worker: ``factory`` is a dotted path (``"pkg.mod:function"``)
        called there with ``kwargs`` (plain data; plus ``worker_rank``, ``worker_world_size``, ``device`` if it
        accepts them); the result needs ``receive(load_fn)``, where ``load_fn`` takes an iterable of (name, tensor)."""
        return self._rpc("rlhfkit_init_weight_sync", factory, dict(kwargs or {}),
                         timeout=self.config.control_timeout_s)

    def receive_weights(self, *, version: int | None = None) -> list[dict[str, Any]]:
        """Receive one sync in every worker (blocks until the sender has sent it); returns the workers' reports."""
        self._check_quiet("receive_weights()")
        self._check_weights_awake("receive_weights")
        if self._adapters is not None:
            self._adapters.check_room()
        if version is not None:
            next_weight_version(f"engine {self.engine_index}", self._version, version)
        return self._received(lambda: self._rpc("rlhfkit_receive_weights", version,
                                                timeout=self.config.control_timeout_s))

    def _received(self, call: Any) -> list[dict[str, Any]]:
        """Run a receiving RPC and take its reports."""
        try:
            reports = call()
        except (ManifestMismatchError, WeightSyncVersionError, WeightVersionError):
            raise  # refused before any byte moved: the weights are untouched
        except BaseException:
            # after any other failure some buckets may have landed and the weights could be a mix of two versions
            # (an executor that does not carry the exception's type lands here too: the safe side). An adapter sync
            # never writes the base weights and registers its adapter whole or not at all: nothing to invalidate.
            if self._adapters is None:
                self._invalidate("a weight sync failed part-way")
            raise
        versions = {int(report["version"]) for report in reports}
        if len(versions) != 1:
            raise RuntimeError(f"engine {self.engine_index}: workers report different weight versions {versions}")
        adapter_ids = {report.get("adapter_id") for report in reports}
        if adapter_ids != {None} and self._adapters is not None:
            if len(adapter_ids) != 1 or None in adapter_ids:
                raise RuntimeError(f"engine {self.engine_index}: workers registered different adapters "
                                   f"{adapter_ids}")
            self._remove_adapters(self._adapters.install(int(adapter_ids.pop())))
        self._after_weight_change(versions.pop())
        return reports

    def close_weight_sync(self) -> None:
        self._rpc("rlhfkit_close_weight_sync", timeout=self.config.control_timeout_s)

    def weight_fingerprint(self) -> list[dict[str, list[float]]]:
        """Per worker: ``{vLLM parameter name: [sum, sum of squares]}`` (see the worker extension)."""
        return self._rpc("rlhfkit_weight_fingerprint", timeout=self.config.control_timeout_s)

    def worker_versions(self) -> list[int]:
        return [int(version) for version in self._rpc("rlhfkit_report_version",
                                                      timeout=self.config.health_timeout_s)]


class VLLMEngineActor(VLLMEngine):
    """The body of an engine's Ray actor (:func:`create_engines` wraps it with ``ray.remote``)."""

    def __init__(self, config: VLLMEngineConfig, *, engine_index: int = 0,
                 distributed_executor_backend: str | None = None) -> None:
        if config.tensor_parallel_size > 1:
            # vLLM's Ray workers choose their GPUs; a visible-devices list inherited by this driver would mislead it.
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        super().__init__(config, engine_index=engine_index, distributed_executor_backend=distributed_executor_backend)

    def ready(self) -> dict[str, Any]:
        """Answered once vLLM has started: the engine index, process id and Ray GPU ids."""
        ray = require("ray", user="rlhfkit.engines.vllm")
        return {"engine_index": self.engine_index, "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "vllm": self.features.version}
