"""The configuration of a hybrid run: :class:`HybridConfig` (where the engines and trainers live, and how they
talk). What stays on the GPU in which phase is not configured here: :func:`rlhfkit.hybrid.plan_hybrid` decides it
(:class:`rlhfkit.hybrid.HybridPlan`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["FORWARD_ENV", "HybridConfig"]

FORWARD_ENV = ("PYTHONPATH", "LD_LIBRARY_PATH", "PATH", "CUDA_HOME", "HF_HOME", "TORCH_EXTENSIONS_DIR")
_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Where and how the engines and trainers of one run live.

    Attributes:
        model: folder or hub id of the policy (engines and, by default, every trainer role): :meth:`Hybrid.start`
            resolves a hub id once on each node (:func:`rlhfkit.models.resolve_model`); the workers load the folder.
        device: ``"cuda"``, or ``"cpu"`` (DeepSpeed on CPU, logical GPUs, gloo sync; needs ``engine="hf"``).
        engine: ``"vllm"``, ``"sglang"`` (an SGLang server per engine, driven by its engine actor; see
            docs/engines-sglang.md) or ``"hf"`` (rlhfkit's transformers engine, for CPU runs and tests).
        sglang_python, sglang_site: the interpreter that runs SGLang's server, and a site directory put on its
            ``PYTHONPATH`` (e.g. ``/tmp/site/sglang`` from ``bench/peers/install-sglang.sh``); ``engine="sglang"`` only.
        num_gpus, num_nodes: GPUs per node the plan uses, and nodes.
        colocate: engines share the trainers' GPUs (the hybrid engine) or get ``engine_gpus`` GPUs of their own.
        engine_gpus, tensor_parallel_size: engine GPUs when not colocated; GPUs per vLLM engine.
        max_model_len, enforce_eager: vLLM settings.
        max_num_seqs: sequences a vLLM engine runs at once; give the rollout batch of one engine (prompts x samples
            / engines): vLLM captures CUDA graphs for batch sizes up to it (at most 512), and its default (1024 on
            large GPUs) captures 51 sizes of each graph kind at start-up, twice that with LoRA. None: vLLM's
            default.
        dtype: engine and weight-sync dtype (float32 keeps engine and trainer log-probs within ~1e-3 on small models).
        sync_bucket_mb: weight-sync bucket size.
        overlap: the engines stay resident beside the awake trainers, outside the phase guard, so that a
            :class:`~rlhfkit.rollouts.RolloutProducer` can generate while the actor trains (asynchronous RL; on one
            GPU the engines keep their memory share, ``EnginePlan.memory``, the whole run).
            :meth:`Hybrid.push_weights` then updates weights in flight: HF engines pause their running requests, take
            the weights and resubmit the unfinished part under them; single-GPU vLLM engines
            (``VLLMEngineConfig.pausable``) stop stepping between two decode steps, take the weights and go on with the
            same requests and their KV cache (tokens stamped per version either way); other engines (SGLang,
            tensor-parallel vLLM) finish the requests in flight first (new ones wait for the push). The plan then keeps
            colocated engines resident (``EnginePlan.sleep_level=0``); needs ``max_weight_lag >= 1`` (the actor steps
            while the engines generate).
        max_weight_lag: how many weight versions rollouts may lag the actor (0: on-policy). The actor is one version
            ahead of the engines from its first ``optim_step`` after a push until the next push; generating past the
            bound raises :class:`~rlhfkit.engines.protocol.WeightLagError` (a forgotten ``push_weights``).
        seed: engine sampling seed (engine ``i`` uses ``seed + i``).
        ray_address: join a running cluster (default ``$RAY_ADDRESS``, else start a local one).
        start_timeout_s, call_timeout_s, sync_timeout_s: bounds of start-up, of each call, of each sync wait.
        pause_engines: overlap mode, single-GPU vLLM engines: a push parks the generate calls in flight between two
            decode steps and they go on under the new weights (``VLLMEngineConfig.pausable``: the engine is stepped
            one decode step at a time). False: a push waits for the calls in flight to finish (the HF engine always
            pauses; SGLang and tensor-parallel vLLM engines always wait).
    """

    model: str
    device: str = "cuda"
    engine: str = "vllm"
    sglang_python: str = "python3"
    sglang_site: str | None = None
    num_gpus: int = 1
    num_nodes: int = 1
    colocate: bool = True
    engine_gpus: int = 1
    tensor_parallel_size: int = 1
    max_model_len: int = 1024
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    dtype: str = "float32"
    sync_bucket_mb: int = 128
    overlap: bool = False
    max_weight_lag: int = 0
    seed: int = 0
    ray_address: str | None = None
    start_timeout_s: float = 900.0
    call_timeout_s: float = 900.0
    sync_timeout_s: float = 300.0
    pause_engines: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"HybridConfig.model={self.model!r}; give an HF model folder")
        for name, choices in (("device", ("cuda", "cpu")), ("engine", ("vllm", "sglang", "hf")), ("dtype", _DTYPES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"HybridConfig.{name}={getattr(self, name)!r}; expected one of {choices}")
        for name in ("num_gpus", "num_nodes", "engine_gpus", "tensor_parallel_size", "sync_bucket_mb", "seed",
                     "max_model_len", "max_weight_lag"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name in ("seed",
                                                                                            "max_weight_lag") else 1):
                raise ValueError(f"HybridConfig.{name}={value!r}; must be a positive int")
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool)
                                              or not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1):
            raise ValueError(f"HybridConfig.max_num_seqs={self.max_num_seqs!r}; must be None or a positive int")
        for name in ("start_timeout_s", "call_timeout_s", "sync_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HybridConfig.{name}={getattr(self, name)!r}; must be > 0 seconds")
        if not isinstance(self.pause_engines, bool):
            raise TypeError(f"HybridConfig.pause_engines={self.pause_engines!r}; must be True or False")
        if self.device == "cpu" and self.engine in ("vllm", "sglang"):
            raise ValueError(f"HybridConfig(device='cpu') needs engine='hf' (engine={self.engine!r} is CUDA-only)")
        total, tp = self.num_gpus * self.num_nodes, self.tensor_parallel_size
        if self.colocate and tp != 1 and total % tp:
            raise ValueError(f"HybridConfig.tensor_parallel_size={tp} must divide the {total} GPU(s) of a colocated "
                             "run (each engine takes tensor_parallel_size of the actor's GPUs)")
        if self.engine == "sglang" and tp != 1:
            raise ValueError(f"HybridConfig(engine='sglang', tensor_parallel_size={tp}): the hybrid run places one GPU "
                             "per SGLang engine actor; use tensor_parallel_size=1 (SGLangEngine itself takes "
                             "tensor_parallel_size > 1 when its process sees that many GPUs)")
        if self.engine == "hf" and tp != 1:
            raise ValueError("HybridConfig(engine='hf') has no tensor parallelism; use tensor_parallel_size=1")
        if not self.colocate and not (0 < self.engine_gpus < total and self.engine_gpus % tp == 0):
            raise ValueError(f"HybridConfig(colocate=False) needs 0 < engine_gpus < {total} GPUs and a multiple of "
                             f"tensor_parallel_size={tp}; got engine_gpus={self.engine_gpus}")

        if not isinstance(self.overlap, bool):
            raise TypeError(f"HybridConfig.overlap={self.overlap!r}; must be True or False")
        if self.overlap and self.max_weight_lag < 1:
            raise ValueError(f"HybridConfig(overlap=True) with max_weight_lag={self.max_weight_lag}: the actor steps "
                             "while the engines generate, so their rollouts lag it by a version; set "
                             "max_weight_lag >= 1 (bound the staleness with rlhfkit.rollouts.RolloutBuffer)")

    @property
    def total_gpus(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def trainer_gpus(self) -> int:
        return self.total_gpus if self.colocate else self.total_gpus - self.engine_gpus

    @property
    def engine_dtype(self) -> str:
        """The dtype the engines run in (and the memory estimate counts): ``dtype`` on CUDA, float32 on CPU."""
        return self.dtype if self.device == "cuda" else "float32"

    def worker_env(self) -> dict[str, str]:
        """Environment of every Ray actor (Ray workers do not inherit the driver's shell)."""
        from rlhfkit.models import hf_environment  # the user's Hugging Face cache, token, endpoint, offline flag

        env = {"TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0",
               "PYTHONWARNINGS": "ignore::FutureWarning"} | hf_environment()
        if self.device == "cpu":
            return env | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        # DeepSpeed 0.19 cannot parse the '9.0a' some images set; FusedAdam's JIT build needs an arch it can parse.
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0").replace("9.0a", "9.0")
        return env | {"TORCH_CUDA_ARCH_LIST": arch, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
