"""The ``sglang`` rollout engine: an SGLang server behind the :class:`~rlhfkit.engines.protocol.RolloutEngine`
protocol, as a plain class (:class:`SGLangEngine`, usable in-process or as the body of a Ray actor,
:class:`SGLangEngineActor`).

SGLang runs in a process of its own, with its own interpreter or site directory (sglang 0.5.17 pins packages that
vLLM 0.22.1 pins differently), started by the engine (``python -m sglang.launch_server``, a bounded wait for
``/health``, its log tail in every start-up error) or attached to by URL, and driven over its HTTP API:

- ``generate``: token ids in, token ids out, through ``/generate`` with ``input_ids``; each of a prompt's ``n``
  samples is its own request (prompt-major; RadixAttention shares their prefix), seeded per (prompt index, sample)
  when ``SamplingConfig.seed`` is set, so a sample does not depend on which engine of a group served it. Log-probs
  are SGLang's ``output_token_logprobs``: ``log_softmax(logits / temperature)`` before top-p/top-k truncation — the
  protocol's convention — and the raw ``log_softmax(logits)`` when greedy. In SGLang's float32 on-policy mode the
  engine asks for float32 sampling and log-probs (``SGLangEngineConfig.exact_logprobs``), at temperature 0 or 1.
- ``sleep(level)`` / ``wake_up(tags)``: ``/release_memory_occupation`` and ``/resume_memory_occupation`` (the server
  needs ``enable_memory_saver``; level 1 needs ``weights_cpu_backup``, level 2 discards the weights and generation is
  refused until a complete load). A sleep releases the weights and the KV cache, and with them what an eager prefill
  held (a sleepable server runs prefill without a CUDA graph); ``"kv_cache"`` wakes SGLang's KV cache (and CUDA
  graphs, with ``release_cuda_graphs``).
- weights: :meth:`SGLangEngine.load_weights` and the weight-sync channel (:meth:`SGLangEngine.init_weight_sync` /
  :meth:`SGLangEngine.receive_weights`): this process is the channel's receiver — rlhfkit's manifest and version
  checks and bounded waits all apply here — and forwards each bucket to the server through
  ``/update_weights_from_tensor`` as CUDA IPC handles (no copy through the host; a bucket-sized device copy first when
  the bucket itself is mapped from the trainer over CUDA IPC), then flushes the radix cache once. Colocated this is
  trainer --CUDA IPC--> engine process --CUDA IPC--> server; on GPUs of their own trainer --NCCL--> engine process
  --CUDA IPC--> server. SGLang's own ``/update_weights_from_distributed`` group is not used: it would skip those checks.
- failures: every request is bounded; a server that died (or closed the connection) raises :class:`SGLangServerDied`
  naming the engine, a hang :class:`SGLangTimeout`, an answer that is not the expected JSON
  :class:`SGLangProtocolError` — all :class:`SGLangServerError` (a ``RuntimeError``); an ``EngineGroup`` reports them
  as ``EngineError`` with the engine's index.

What it does not do: text prompts, LoRA, speculative decoding, data parallelism inside one server, restart a dead
server. Needs ``sglang`` in the interpreter ``SGLangEngineConfig.python`` (not in rlhfkit's environment) and torch here;
nothing is imported at module import. See ``docs/engines-sglang.md``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from rlhfkit.engines._state import EngineState
from rlhfkit.engines.protocol import WAKE_TAGS, SamplingConfig, WeightVersionError, next_weight_version, prompt_lists
from rlhfkit.engines.router import pack_generate_result
from rlhfkit.engines.sglang._config import SGLANG_VERSION, SGLangEngineConfig, server_command
from rlhfkit.engines.sglang._http import (
    SGLangProtocolError,
    SGLangRequestError,
    SGLangServerDied,
    SGLangServerError,
    SGLangStartError,
    SGLangTimeout,
)
from rlhfkit.engines.sglang._server import SGLangNotInstalledError, SGLangServer
from rlhfkit.engines.sglang._tensors import serialize_named_tensors
from rlhfkit.types import Rollout

__all__ = [
    "SGLangEngine",
    "SGLangEngineActor",
    "SGLangEngineConfig",
    "SGLangNotInstalledError",
    "SGLangProtocolError",
    "SGLangRequestError",
    "SGLangServerDied",
    "SGLangServerError",
    "SGLangStartError",
    "SGLangTimeout",
    "sample_seed",
    "server_command",
]

logger = logging.getLogger(__name__)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_RESUME_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}  # our tag -> SGLang's memory tags
FLOAT32_BELOW_ONE = 0.99999994  # the largest float32 below 1 (1 - 2**-24, rounded): a top-p SGLang does not skip


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The ``sampling_seed`` of one sample: a function of the run's seed, the prompt's global index and the sample's
    index only (not of the engine or the batch), in [0, 2**31)."""
    return (seed * 1_000_003 + prompt_index * 7_919 + sample_index * 104_729) % 2**31


def sampling_params(sampling: SamplingConfig, *, float32_sampling: bool = False) -> dict[str, Any]:
    """SGLang's ``sampling_params`` of one sample (``n`` is spread over requests by the engine). With
    ``float32_sampling`` (``SGLangEngineConfig.exact_logprobs``) a sample with ``top_p=1`` and T > 0 gets
    :data:`FLOAT32_BELOW_ONE`, which sends it through SGLang's float32 top-p sampler instead of the on-policy mode's
    bfloat16 one."""
    top_p = float(sampling.top_p)
    if float32_sampling and sampling.temperature > 0 and top_p == 1.0:
        top_p = FLOAT32_BELOW_ONE
    params: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens, "temperature": float(sampling.temperature),
                              "top_p": top_p, "top_k": sampling.top_k or -1,
                              "ignore_eos": sampling.ignore_eos, "no_stop_trim": True}
    if sampling.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    return params


def generate_payload(prompts: Sequence[Sequence[int]], indices: Sequence[int], sampling: SamplingConfig, *,
                     float32_sampling: bool = False) -> dict:
    """The ``/generate`` body for ``prompts`` (global indices ``indices``): one request per sample, prompt-major,
    each seeded by :func:`sample_seed` when ``sampling.seed`` is set."""
    base = sampling_params(sampling, float32_sampling=float32_sampling)
    params = [base if sampling.seed is None else base | {"sampling_seed": sample_seed(sampling.seed, index, k)}
              for index in indices for k in range(sampling.n)]
    return {"input_ids": [prompt for prompt in prompts for _ in range(sampling.n)], "sampling_params": params,
            "return_logprob": bool(sampling.logprobs)}


class SGLangEngine(EngineState):
    """One SGLang server behind the rollout-engine protocol; see the module docstring.

    Args:
        config: the server and its bounds.
        engine_index: position among the engines of a group (seed offset, names in errors).
        server: an already started (or attached) :class:`SGLangServer` to drive instead of starting one.
    """

    def __init__(self, config: SGLangEngineConfig, *, engine_index: int = 0,
                 server: SGLangServer | None = None) -> None:
        if not isinstance(config, SGLangEngineConfig):
            raise TypeError(f"config must be an SGLangEngineConfig, got {type(config).__name__}")
        self.config, self.engine_index = config, engine_index
        if server is None:
            server = (SGLangServer.attach(config, engine_index=engine_index) if config.url is not None
                      else SGLangServer.launch(config, engine_index=engine_index))
        self.server = server
        self._init_state()
        self._known_names: set[str] = set()   # every name a load or sync has carried
        self._rewritten: set[str] = set()     # names rewritten since sleep(level=2)
        self._receiver: Any = None

    # --- state ------------------------------------------------------------------------------------------------------
    def _name(self) -> str:
        return f"engine {self.engine_index} (SGLang at {self.server.url})"

    def _post(self, path: str, payload: Any, timeout_s: float) -> Any:
        return self.server.client.request(path, payload, timeout_s=timeout_s)

    def health_check(self) -> dict[str, Any]:
        """``/health`` within ``health_timeout_s`` (a dead server raises :class:`SGLangServerDied`); the engine's
        state."""
        if not self.server.alive():
            raise SGLangServerDied(f"{self._name()} is gone: {self.server.describe()}", engine_index=self.engine_index)
        self.server.client.request("/health", method="GET", timeout_s=self.config.health_timeout_s,
                                   expect_json=False)
        return {"engine_index": self.engine_index, "pid": os.getpid(), "url": self.server.url,
                "server_pid": None if self.server.process is None else self.server.process.pid,
                "weight_version": self._version, "asleep": list(self.asleep_tags),
                "weights_valid": self._weights_valid}

    # --- generate ---------------------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 prompt_indices: Sequence[int] | None = None) -> list[Rollout]:
        """Sample ``sampling.n`` responses per prompt; prompt-major, then sample index. ``prompt_indices`` (default
        ``0..P-1``) become ``Rollout.prompt_index`` and seed each sample (:func:`sample_seed`)."""
        prompts, indices, samples = self._run(prompt_token_ids, sampling, prompt_indices)
        rollouts = []
        for position, (prompt, index) in enumerate(zip(prompts, indices)):
            prompt_tensor = torch.tensor(prompt, dtype=torch.int64)
            for sample_index in range(sampling.n):
                tokens, logprobs, finish = samples[position * sampling.n + sample_index]
                rollouts.append(Rollout(
                    prompt_token_ids=prompt_tensor, response_token_ids=torch.tensor(tokens, dtype=torch.int64),
                    response_logprobs=None if logprobs is None else torch.tensor(logprobs, dtype=torch.float32),
                    finish_reason=finish, prompt_index=index, sample_index=sample_index,  # type: ignore[arg-type]
                    weight_version=self._version))
        return rollouts

    def generate_packed(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                        prompt_indices: Sequence[int] | None = None) -> dict[str, Any]:
        """:meth:`generate` in the compact form of :func:`rlhfkit.engines.router.pack_generate_result` (what an
        engine actor returns to an :class:`~rlhfkit.engines.router.EngineGroup`)."""
        _, _, samples = self._run(prompt_token_ids, sampling, prompt_indices)
        return pack_generate_result([s[0] for s in samples], [s[1] for s in samples] if sampling.logprobs else None,
                                    [s[2] for s in samples], n=sampling.n, weight_version=self._version)

    def _run(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
             prompt_indices: Sequence[int] | None) -> tuple[list[list[int]], list[int], list[tuple]]:
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        prompts, indices = prompt_lists(prompt_token_ids, prompt_indices)
        self._check_ready("generate")
        if not prompts:
            return [], [], []
        exact = self.config.float32_sampling
        if exact and sampling.logprobs and sampling.temperature not in (0.0, 1.0):
            raise ValueError(f"{self._name()}: log-probs at temperature={sampling.temperature} with "
                             "SGLangEngineConfig.exact_logprobs on: the server's float32 log-probs are not tempered "
                             "(sglang 0.5.17); sample at temperature 1 (or 0), or set exact_logprobs=False for its "
                             "bfloat16-rounded tempered ones")
        payload = generate_payload(prompts, indices, sampling, float32_sampling=exact)
        answer = self._post("/generate", payload, self.config.generate_timeout_s)
        return prompts, indices, self._parse_generate(answer, len(payload["sampling_params"]), sampling.logprobs)

    def _parse_generate(self, answer: Any, expected: int, logprobs: bool) -> list[tuple]:
        def bad(what: str) -> SGLangProtocolError:
            return SGLangProtocolError(f"{self._name()}: /generate answered {what}", engine_index=self.engine_index)

        if isinstance(answer, dict) and expected == 1:
            answer = [answer]
        if not isinstance(answer, list) or len(answer) != expected:
            got = len(answer) if isinstance(answer, list) else type(answer).__name__
            raise bad(f"{got} results for {expected} requests")
        samples = []
        for k, item in enumerate(answer):
            try:
                tokens = [int(t) for t in item["output_ids"]]
                meta = item["meta_info"]
                finish = meta.get("finish_reason") or {}
                kind = finish.get("type") if isinstance(finish, dict) else str(finish)
                values = None
                if logprobs:
                    entries = meta["output_token_logprobs"]
                    values = [float(entry[0]) for entry in entries]
                    if [int(entry[1]) for entry in entries] != tokens:
                        raise bad(f"log-probs of other tokens than the output_ids for sample {k}")
            except (KeyError, TypeError, ValueError, IndexError) as error:
                raise bad(f"a result without the expected fields for sample {k} ({type(error).__name__}: {error}); "
                          f"is the server sglang {SGLANG_VERSION}?") from error
            if kind == "abort":
                raise SGLangRequestError(f"{self._name()}: SGLang aborted sample {k}: {finish.get('message')}",
                                         engine_index=self.engine_index, status=200)
            samples.append((tokens, values, _FINISH.get(str(kind), "abort")))
        return samples

    # --- sleep / wake -----------------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release GPU memory: level 1 keeps the weights in host memory (``weights_cpu_backup``), level 2 discards
        them."""
        if not self.config.enable_memory_saver:
            raise RuntimeError(f"{self._name()}: sleep() needs SGLangEngineConfig.enable_memory_saver=True")
        if level == 1 and not self.config.weights_cpu_backup:
            raise RuntimeError(f"{self._name()}: sleep(level=1) keeps the weights in host memory, which needs "
                               "SGLangEngineConfig.weights_cpu_backup=True; or use level 2 (weights discarded) when "
                               "a weight load follows")
        self._check_sleep(level)
        self._post("/release_memory_occupation", {"tags": ["weights", "kv_cache", "cuda_graph"]},
                   self.config.control_timeout_s)
        self._asleep = set(WAKE_TAGS)
        if level == 2:
            self._invalidate("sleep(level=2) discarded them")

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore ``"weights"``, ``"kv_cache"`` or both (``None``); waking what is awake does nothing."""
        wanted = self._tags_to_wake(tags)
        if not wanted:
            return
        memory_tags = [memory for tag in wanted for memory in _RESUME_TAGS[tag]]
        self._post("/resume_memory_occupation", {"tags": memory_tags}, self.config.control_timeout_s)
        self._asleep.difference_update(wanted)

    # --- weights ----------------------------------------------------------------------------------------------------
    def _invalidate(self, reason: str) -> None:
        self._weights_valid, self._invalid_reason = False, reason
        self._rewritten = set()

    def _send(self, pairs: list[tuple[str, torch.Tensor]], *, version: int | None = None) -> None:
        """One ``/update_weights_from_tensor`` request (every TP rank reads the same handles)."""
        if any(tensor.is_cuda for _, tensor in pairs):
            torch.cuda.current_stream().synchronize()  # the server reads these bytes from its own process and stream
        payload = {"serialized_named_tensors": [serialize_named_tensors(pairs)] * self.config.tensor_parallel_size,
                   "flush_cache": False}
        if version is not None:
            payload["weight_version"] = str(version)
        path = "/update_weights_from_tensor"
        self.server.client.check_success(path, self._post(path, payload, self.config.control_timeout_s))
        self._rewritten.update(name for name, _ in pairs)

    def _finish_update(self, version: int, names: set[str]) -> None:
        self._post("/update_weight_version", {"new_version": str(version)}, self.config.control_timeout_s)
        self.server.client.request("/flush_cache", {}, timeout_s=self.config.control_timeout_s, expect_json=False)
        self._known_names |= names
        if not self._weights_valid:
            missing = self._known_names - self._rewritten
            if missing:
                self._invalid_reason = f"{len(missing)} weight(s) not rewritten since sleep(level=2), e.g. " \
                                       f"{sorted(missing)[:3]}"
                logger.warning("%s: %s", self._name(), self._invalid_reason)
            self._weights_valid = not missing
        self._version = version

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> int:
        """Load HF-named tensors into the server in requests of about ``update_bucket_bytes``; returns how many were
        loaded. ``version`` defaults to the current + 1. A failure part-way marks the weights invalid (generation is
        refused until a complete load). CUDA tensors travel as IPC handles, CPU tensors inline."""
        self._check_weights_awake("load_weights")
        new_version = next_weight_version(f"engine {self.engine_index}", self._version, version)
        names: set[str] = set()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        try:
            for name, tensor in weights:
                if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                    raise TypeError(f"load_weights expects (str, torch.Tensor) pairs, got ({type(name).__name__}, "
                                    f"{type(tensor).__name__})")
                bucket.append((name, tensor))
                names.add(name)
                size += tensor.numel() * tensor.element_size()
                if size >= self.config.update_bucket_bytes:
                    self._send(bucket)
                    bucket, size = [], 0
            if bucket:
                self._send(bucket)
        except TypeError:
            if not names - {name for name, _ in bucket}:  # refused before anything reached the server
                raise
            self._invalidate("a load_weights call failed part-way")
            raise
        except BaseException:
            self._invalidate("a load_weights call failed part-way")
            raise
        self._finish_update(new_version, names)
        return len(names)

    def init_weight_sync(self, sync_config: Any, endpoint: Any, *, first_rank: int,
                         expected: Sequence[tuple[str, Sequence[int], Any]] | None = None) -> list[dict[str, Any]]:
        """Join a :mod:`rlhfkit.weight_sync` group as receiver ``first_rank`` (one rank per engine, whatever its
        tensor-parallel size: this process receives and forwards to every TP rank). ``expected``: ``(HF name, shape,
        dtype)`` of every tensor a sync must carry, checked against the sender's manifest before any byte moves."""
        from rlhfkit.weight_sync import WeightReceiver

        if isinstance(first_rank, bool) or not isinstance(first_rank, int) or first_rank < 1:
            raise ValueError(f"first_rank={first_rank!r}; receivers take ranks >= 1 (the sender is rank 0)")
        device = torch.device("cuda", torch.cuda.current_device()) if sync_config.backend == "nccl" else None
        self._receiver = WeightReceiver(sync_config, endpoint.for_rank(first_rank, f"engine-{self.engine_index}"),
                                        expected=expected, device=device)
        return [{"rank": first_rank, "engine_index": self.engine_index}]

    def receive_weights(self, *, version: int | None = None) -> list[dict[str, Any]]:
        """Receive one sync (blocks until the sender sends it, within the channel's timeout) and forward it to the
        server bucket by bucket; returns ``[{"version", "seconds", "bytes", "tensors"}]``."""
        if self._receiver is None:
            raise RuntimeError(f"{self._name()}: receive_weights() before init_weight_sync()")
        self._check_weights_awake("receive_weights")
        if version is not None:
            next_weight_version(f"engine {self.engine_index}", self._version, version)
        copy = self._receiver.config.backend == "cuda_ipc"  # memory mapped from the trainer cannot be re-shared
        names: set[str] = set()
        started = []

        def load(buckets: Iterator[list[tuple[str, torch.Tensor]]], *, version: int) -> int:
            next_weight_version(f"engine {self.engine_index}", self._version, version)  # before any byte loads
            started.append(True)
            for bucket in buckets:
                pairs = [(name, tensor.clone() if copy else tensor) for name, tensor in bucket]
                self._send(pairs)
                names.update(name for name, _ in pairs)
            return len(names)

        try:
            report = self._receiver.receive(load, by_bucket=True)
        except WeightVersionError:
            raise
        except BaseException:
            if started:
                self._invalidate("a weight sync failed part-way")
            raise
        self._finish_update(report.version, names)
        return [{"version": report.version, "seconds": report.seconds, "bytes": report.num_bytes,
                 "tensors": report.num_tensors}]

    def close_weight_sync(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None

    def close(self) -> None:
        """Leave the weight sync and stop the server if this engine started it."""
        self.close_weight_sync()
        self.server.stop()


class SGLangEngineActor(SGLangEngine):
    """The body of an SGLang engine's Ray actor: the server inherits the actor's ``CUDA_VISIBLE_DEVICES``."""

    def ready(self) -> dict[str, Any]:
        """Answered once the server is up: the engine index, process ids and the server's address."""
        return {"engine_index": self.engine_index, "pid": os.getpid(), "url": self.server.url,
                "server_pid": None if self.server.process is None else self.server.process.pid}
