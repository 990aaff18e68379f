"""Configuration of the ``sglang`` rollout engine (:class:`SGLangEngineConfig`) and the server command line it
implies (:func:`server_command`); private to :mod:`rlhfkit.engines.sglang`, which re-exports both. Standard library
only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SGLANG_VERSION", "SGLangEngineConfig", "server_command", "server_environment"]

SGLANG_VERSION = "0.5.17"  # the release whose HTTP API this backend speaks (the last one that pins torch 2.11)
_DTYPES = ("auto", "bfloat16", "float16", "float32")
# flags server_command sets from config fields: extra_args may not repeat them
_OWN_FLAGS = ("--model-path", "--host", "--port", "--tp-size", "--mem-fraction-static", "--dtype", "--random-seed",
              "--enable-memory-saver", "--enable-weights-cpu-backup", "--context-length", "--disable-radix-cache",
              "--disable-cuda-graph", "--skip-server-warmup", "--rl-on-policy-target")
_ON_POLICY_TARGETS = ("fsdp",)
# extra_args that pick a prefill CUDA graph (sglang 0.5.17 cannot release one: it stays resident while asleep)
_PREFILL_GRAPH_FLAGS = ("--cuda-graph-backend-prefill", "--cuda-graph-max-bs-prefill")


def _freeze_env(value: Any) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((key, item) for key, item in items)
    except (TypeError, ValueError) as error:
        raise TypeError(f"SGLangEngineConfig.env={value!r}; pass a mapping or (name, value) pairs") from error
    for key, item in pairs:
        if not isinstance(key, str) or not key or not isinstance(item, str):
            raise TypeError(f"SGLangEngineConfig.env has ({key!r}, {item!r}); names and values must be strings")
    return pairs


@dataclass(frozen=True, kw_only=True)
class SGLangEngineConfig:
    """How to start (or reach) one SGLang server and drive it.

    SGLang runs in a process of its own with its own interpreter or site directory (it pins other versions of
    torch-adjacent packages than vLLM), started by the engine with ``python -m sglang.launch_server`` and driven over
    its HTTP API.

    Attributes:
        model: path of an HF model folder.
        python: the interpreter that has ``sglang`` (e.g. ``/opt/sglang/bin/python``); ``env`` may add a site
            directory through ``PYTHONPATH``.
        url: attach to a server already running at this address (``http://host:port``) instead of starting one;
            the engine then neither starts nor stops it.
        host, port: where the started server listens; port 0 picks a free port.
        tensor_parallel_size: GPUs of the server (``--tp-size``).
        mem_fraction_static: SGLang's share of GPU memory for weights + KV cache, in (0, 1).
        dtype: ``--dtype``. ``"float32"`` runs on SGLang's native-torch layers (``rl_on_policy_target``) and, unless
            ``extra_args`` picks one, the Triton attention backend: sglang 0.5.17's CUDA RMSNorm and FlashAttention 3
            have no float32 kernels. Its server also gets ``TRITON_F32_DEFAULT=ieee`` (unless ``env`` sets it), so
            Triton's float32 matmuls are not rounded to TF32, and ``--enable-fp32-lm-head`` (the on-policy mode
            otherwise computes the logits in bfloat16). That mode's sampler draws from, and returns, ``log_softmax``
            of bfloat16-rounded logits; ``exact_logprobs`` (on for float32) makes both float32.
        seed: ``--random-seed`` (engine ``i`` of a group uses ``seed + i``).
        enable_memory_saver: allow :meth:`SGLangEngine.sleep` (``--enable-memory-saver``; CUDA only). Prefill then
            runs without a CUDA graph (``--disable-prefill-cuda-graph``), unless ``extra_args`` picks one
            (``--cuda-graph-backend-prefill``, ``--cuda-graph-max-bs-prefill``): sglang 0.5.17 cannot release a
            prefill graph's pool (up to 8,192 tokens of activations), while an eager prefill's activations go back
            with the cache flush of every sleep. The decode graphs (a few hundred MiB) stay resident unless
            ``release_cuda_graphs``.
        release_cuda_graphs: capture the decode CUDA graphs inside the memory saver
            (``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``, unless ``env`` sets it), so that a sleep releases them too. Off by
            default: with sglang 0.5.17 a GRPO run with it on died of an illegal memory access at its fifth release.
            Needs ``enable_memory_saver`` and no prefill graph.
        weights_cpu_backup: keep a host copy of the weights while they are released (``--enable-weights-cpu-backup``),
            which sleep level 1 needs; without it only level 2 (weights discarded) is possible.
        context_length: ``--context-length`` (None: the model's).
        disable_radix_cache, enforce_eager: ``--disable-radix-cache``; ``--disable-cuda-graph``.
        rl_on_policy_target: ``--rl-on-policy-target``: SGLang's "true on-policy" mode (``"fsdp"``, its only choice):
            RMSNorm, SiLU-and-mul and rotary embeddings in plain torch, batch-invariant matmuls, log-probs from
            ``log_softmax``, the pytorch sampler. None: ``"fsdp"`` when ``dtype="float32"`` (which needs it), else off;
            ``""`` forces it off.
        exact_logprobs: float32 sampling and log-probs in the on-policy mode, whose sampler otherwise draws from and
            returns ``log_softmax`` of bfloat16-rounded logits (about 0.02 nats from the trainer's float32 at T = 1):
            the server returns the float32 ``log_softmax(logits)`` (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, unless
            ``env`` sets it) and a sample with ``top_p=1`` goes to the server with the float32 just below 1, which
            routes it through the float32 top-p sampler (a sort of the vocabulary per step; tokens of mass below
            6e-8 in all are cut). Those log-probs are not tempered, so log-probs at a temperature other than 0 or 1
            are refused. None: on when the on-policy mode is (float32).
        extra_args: more ``launch_server`` arguments, e.g. ``("--attention-backend", "fa3")``; flags the fields
            above set are refused.
        env: environment variables of the server process (added to this process's), as a mapping or pairs.
        log_path: the server's stdout and stderr (None: a temporary file); its tail is quoted in start-up errors.
        startup_timeout_s, generate_timeout_s, control_timeout_s, health_timeout_s: bounds of the server's start
            (until ``/health`` answers 200), of one ``/generate`` call, of sleep/wake/weight updates, of a health
            check.
        update_bucket_bytes: tensors go to ``/update_weights_from_tensor`` in requests of about this many bytes.
    """

    model: str
    python: str = "python3"
    url: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    tensor_parallel_size: int = 1
    mem_fraction_static: float = 0.85
    dtype: str = "bfloat16"
    seed: int = 0
    enable_memory_saver: bool = False
    weights_cpu_backup: bool = False
    context_length: int | None = None
    disable_radix_cache: bool = False
    enforce_eager: bool = False
    rl_on_policy_target: str | None = None
    exact_logprobs: bool | None = None
    release_cuda_graphs: bool = False
    extra_args: tuple[str, ...] = ()
    env: Any = field(default=())
    log_path: str | None = None
    startup_timeout_s: float = 900.0
    generate_timeout_s: float = 600.0
    control_timeout_s: float = 300.0
    health_timeout_s: float = 30.0
    update_bucket_bytes: int = 512 * 1024**2

    def __post_init__(self) -> None:
        for name in ("model", "python", "host"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"SGLangEngineConfig.{name}={value!r}; must be a non-empty string")
        if self.url is not None and (not isinstance(self.url, str) or not self.url.startswith(("http://", "https://"))):
            raise ValueError(f"SGLangEngineConfig.url={self.url!r}; pass None (start a server) or 'http://host:port'")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"SGLangEngineConfig.port={self.port!r}; must be 0 (pick a free port) or a TCP port")
        for name in ("tensor_parallel_size", "update_bucket_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SGLangEngineConfig.{name}={value!r}; must be an integer >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"SGLangEngineConfig.seed={self.seed!r}; must be an integer >= 0")
        if not isinstance(self.mem_fraction_static, (int, float)) or not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"SGLangEngineConfig.mem_fraction_static={self.mem_fraction_static!r}; must be in (0, 1)")
        if self.dtype not in _DTYPES:
            raise ValueError(f"SGLangEngineConfig.dtype={self.dtype!r}; expected one of {_DTYPES}")
        if self.context_length is not None and (isinstance(self.context_length, bool)
                                                or not isinstance(self.context_length, int) or self.context_length < 1):
            raise ValueError(f"SGLangEngineConfig.context_length={self.context_length!r}; must be None or an int >= 1")
        if self.weights_cpu_backup and not self.enable_memory_saver:
            raise ValueError("SGLangEngineConfig.weights_cpu_backup=True needs enable_memory_saver=True (the backup "
                             "is what the memory saver restores at wake-up)")
        for name in ("startup_timeout_s", "generate_timeout_s", "control_timeout_s", "health_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SGLangEngineConfig.{name}={value!r}; must be a number of seconds > 0")
        if isinstance(self.extra_args, (str, bytes)) or not all(isinstance(a, str) for a in self.extra_args):
            raise TypeError(f"SGLangEngineConfig.extra_args={self.extra_args!r}; pass a tuple of strings, e.g. "
                            "('--attention-backend', 'fa3')")
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        clash = [arg.split("=", 1)[0] for arg in self.extra_args if arg.split("=", 1)[0] in _OWN_FLAGS]
        if clash:
            raise ValueError(f"SGLangEngineConfig.extra_args sets {clash}; set the config field instead "
                             "(model, host, port, tensor_parallel_size, mem_fraction_static, dtype, seed, ...)")
        if self.rl_on_policy_target not in (None, "", *_ON_POLICY_TARGETS):
            raise ValueError(f"SGLangEngineConfig.rl_on_policy_target={self.rl_on_policy_target!r}; expected None "
                             f"(on for float32), '' (off) or one of {_ON_POLICY_TARGETS}")
        if self.dtype == "float32" and self.rl_on_policy_target == "":
            raise ValueError("SGLangEngineConfig(dtype='float32', rl_on_policy_target='') cannot start: sglang "
                             f"{SGLANG_VERSION}'s CUDA RMSNorm has no float32 kernel; leave rl_on_policy_target=None "
                             "(native torch layers) or pick dtype='bfloat16'")
        if self.exact_logprobs is not None and not isinstance(self.exact_logprobs, bool):
            raise TypeError(f"SGLangEngineConfig.exact_logprobs={self.exact_logprobs!r}; expected None, True or False")
        if self.exact_logprobs and self.on_policy_target is None:
            raise ValueError("SGLangEngineConfig.exact_logprobs=True needs the on-policy mode (dtype='float32' or "
                             "rl_on_policy_target='fsdp'): outside it the sampler is float32 already")
        if not isinstance(self.release_cuda_graphs, bool):
            raise TypeError(f"SGLangEngineConfig.release_cuda_graphs={self.release_cuda_graphs!r}; expected a bool")
        if self.release_cuda_graphs and not self.drops_prefill_graph:
            raise ValueError("SGLangEngineConfig.release_cuda_graphs=True needs enable_memory_saver=True, CUDA graphs "
                             "(enforce_eager=False) and no prefill graph in extra_args (sglang 0.5.17's breakable "
                             "prefill graph refuses the memory saver)")
        object.__setattr__(self, "env", _freeze_env(self.env))

    @property
    def on_policy_target(self) -> str | None:
        """The ``--rl-on-policy-target`` the server gets (None: the flag is left out)."""
        if self.rl_on_policy_target is None:
            return "fsdp" if self.dtype == "float32" else None
        return self.rl_on_policy_target or None

    @property
    def float32_sampling(self) -> bool:
        """Whether the on-policy sampler is made float32 (``exact_logprobs``, resolved)."""
        return self.on_policy_target is not None if self.exact_logprobs is None else self.exact_logprobs

    @property
    def drops_prefill_graph(self) -> bool:
        """Whether the server runs prefill without a CUDA graph so that a sleep can release what prefill holds: the
        memory saver is on, CUDA graphs are on and ``extra_args`` picks no prefill graph."""
        picks_prefill = any(arg.split("=", 1)[0] in _PREFILL_GRAPH_FLAGS for arg in self.extra_args)
        return self.enable_memory_saver and not self.enforce_eager and not picks_prefill


def server_environment(config: SGLangEngineConfig, base: Mapping[str, str]) -> dict[str, str]:
    """The server process's environment: ``base`` (this process's), then float32's Triton precision, the float32
    log-probs of ``exact_logprobs`` and the memory saver's decode graphs of ``release_cuda_graphs``, then ``env``."""
    exact = {"TRITON_F32_DEFAULT": "ieee"} if config.dtype == "float32" else {}
    if config.float32_sampling:
        exact["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    if config.release_cuda_graphs:
        exact["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
    return dict(base) | exact | dict(config.env)


def server_command(config: SGLangEngineConfig, *, port: int, engine_index: int = 0) -> list[str]:
    """The ``python -m sglang.launch_server ...`` command line of engine ``engine_index`` listening on ``port``."""
    command = [config.python, "-m", "sglang.launch_server", "--model-path", config.model, "--host", config.host,
               "--port", str(port), "--tp-size", str(config.tensor_parallel_size),
               "--mem-fraction-static", str(config.mem_fraction_static), "--dtype", config.dtype,
               "--random-seed", str(config.seed + engine_index), "--skip-server-warmup"]
    if config.enable_memory_saver:
        command.append("--enable-memory-saver")
    if config.drops_prefill_graph and "--disable-prefill-cuda-graph" not in config.extra_args:
        command.append("--disable-prefill-cuda-graph")  # sglang 0.5.17 cannot release a prefill graph's pool
    if config.weights_cpu_backup:
        command.append("--enable-weights-cpu-backup")
    if config.context_length is not None:
        command += ["--context-length", str(config.context_length)]
    if config.disable_radix_cache:
        command.append("--disable-radix-cache")
    if config.enforce_eager:
        command.append("--disable-cuda-graph")
    if config.on_policy_target is not None:
        command += ["--rl-on-policy-target", config.on_policy_target]
    picks_attention = any(arg.split("=", 1)[0] == "--attention-backend" for arg in config.extra_args)
    if config.dtype == "float32" and not picks_attention:
        command += ["--attention-backend", "triton"]  # FlashAttention 3, the Hopper default, is 16-bit only
    if config.dtype == "float32" and "--enable-fp32-lm-head" not in config.extra_args:
        command.append("--enable-fp32-lm-head")  # else the on-policy mode casts hidden states and lm_head to bf16
    return command + list(config.extra_args)
