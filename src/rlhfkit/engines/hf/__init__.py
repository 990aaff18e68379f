"""The ``hf`` rollout engine: a transformers causal LM behind the :class:`~rlhfkit.engines.protocol.RolloutEngine`
protocol, in-process, on CPU or one GPU.

What it does: batched generation with left padding, an attention mask, correct position ids
(``cumsum(attention_mask) - 1``) and a KV cache; its own sampling loop (temperature, top-k, top-p, greedy, ``n``
samples per prompt, stop tokens and the model's EOS, per-request seeds) so that log-probs are exactly
``log_softmax(logits / temperature)`` of the sampled token (raw ``log_softmax(logits)`` when greedy), the
convention of :mod:`rlhfkit.engines.protocol`; ``sleep``/``wake_up`` with the protocol's levels and tags; weight
loading by HF parameter name with validation and a weight version; in-flight weight updates by abort and resubmit:
:meth:`HFEngine.pause_generation` (from another thread) stops running ``generate`` calls at their next decode step,
the weights are loaded, :meth:`HFEngine.resume_generation` lets each call resubmit its unfinished samples (prompt +
tokens so far, the remaining budget, the same per-request generators) under the new weights; every token is stamped
with the version that produced it (``Rollout.response_weight_versions``); LoRA adapters merged into the weights
(:meth:`HFEngine.load_adapter`).

What it does not do: continuous batching, paged attention, tensor parallelism, speculative decoding, prefix caching;
use the vLLM backend for throughput. Needs ``rlhfkit[hf]`` (transformers).

Sleep semantics: level 1 moves the weights to host memory (on CPU the weights already live there, so level 1 is only
a state change); level 2 discards the weights on any device, CPU included (parameter storage is released, shapes
are remembered), and after ``wake_up`` generation is refused until :meth:`HFEngine.load_weights` has supplied every
parameter. The KV cache lives only inside one ``generate`` call, so the ``"kv_cache"`` tag is a state flag (on GPU,
sleeping also empties the CUDA caching allocator). A module shared with a trainer (see :meth:`HFEngine.from_model`)
is the trainer's module: level 2 discards the trainer's weights too.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlhfkit._optional import require
from rlhfkit.engines._pause import GenerationPause, GenerationPausedTimeout, PausableGeneration
from rlhfkit.engines.hf._sampling import make_generators, request_seed, sample_next_tokens
from rlhfkit.engines.hf._state import EngineWeightState
from rlhfkit.engines.protocol import WAKE_TAGS, SamplingConfig, next_weight_version, prompt_lists
from rlhfkit.types import Rollout

if TYPE_CHECKING:
    from rlhfkit.lora import LoraConfig

__all__ = ["GenerationPausedTimeout", "HFEngine", "HFEngineConfig"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class HFEngineConfig:
    """How to build an :class:`HFEngine` from a saved model.

    Attributes:
        model: folder or hub id of a causal LM (:func:`rlhfkit.models.resolve_model`: a hub id is read from the
            Hugging Face cache, downloaded there unless ``HF_HUB_OFFLINE`` is set), loaded with
            ``AutoModelForCausalLM``.
        tokenizer: tokenizer folder or hub id; defaults to ``model``. Only used to decode ``response_text``.
        device: torch device string, e.g. ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"auto"`` (the checkpoint's dtype).
        max_batch_size: most sequences (prompts × n) decoded together; larger requests run in chunks.
        attn_implementation: passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, ...); None keeps the default.
        seed: seeds the engine's generator, used by requests whose ``SamplingConfig.seed`` is None.
        pause_timeout_s: longest time a paused ``generate`` waits for :meth:`HFEngine.resume_generation`.
    """

    model: str
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 64
    attn_implementation: str | None = None
    seed: int = 0
    pause_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"HFEngineConfig.model={self.model!r}; pass the folder or hub id of a causal LM as a "
                             "string")
        if self.dtype not in (*_DTYPES, "auto"):
            raise ValueError(f"HFEngineConfig.dtype={self.dtype!r}; expected one of {(*_DTYPES, 'auto')}")
        if self.max_batch_size < 1:
            raise ValueError(f"HFEngineConfig.max_batch_size={self.max_batch_size}; must be >= 1")
        try:
            torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"HFEngineConfig.device={self.device!r} is not a torch device ({error}); "
                             "use e.g. 'cpu' or 'cuda:0'") from error


@dataclass(frozen=True)
class _ChunkOutput:
    tokens: list[int]
    logprobs: torch.Tensor
    finish_reason: str  # "stop", "length", or "abort" (paused: the rest is resubmitted)


@dataclass
class _Sample:
    """One request's response so far, across pause rounds."""

    tokens: list[int]
    logprobs: list[torch.Tensor]
    versions: list[int]
    finish_reason: str | None = None


class HFEngine(PausableGeneration):
    """A transformers causal LM as a rollout engine. Build with ``HFEngine(HFEngineConfig(...))`` or
    :meth:`from_model`. Implements :class:`~rlhfkit.engines.protocol.RolloutEngine`."""

    def __init__(self, config: HFEngineConfig) -> None:
        if not isinstance(config, HFEngineConfig):
            raise TypeError(f"HFEngine(config) needs an HFEngineConfig, got {type(config).__name__}; "
                            "use HFEngine.from_model(model, ...) to wrap a loaded model")
        transformers = require("transformers", user="rlhfkit.engines.hf")
        kwargs = {"dtype": "auto" if config.dtype == "auto" else _DTYPES[config.dtype]}
        if config.attn_implementation is not None:
            kwargs["attn_implementation"] = config.attn_implementation
        from rlhfkit.models import resolve_model

        path = resolve_model(config.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model.to(torch.device(config.device))
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(config.tokenizer) if config.tokenizer
                                                               else path)
        self._setup(model, tokenizer=tokenizer, pad_token_id=None, eos_token_ids=None,
                    max_batch_size=config.max_batch_size, seed=config.seed, pause_timeout_s=config.pause_timeout_s)

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, tokenizer=None, pad_token_id: int | None = None,
                   eos_token_ids: int | Sequence[int] | None = None, max_batch_size: int = 64,
                   seed: int = 0, pause_timeout_s: float = 600.0) -> HFEngine:
        """Wrap an already loaded causal LM (it stays on its device; the engine does not copy it).

        Args:
            model: a transformers causal LM (``model(input_ids, attention_mask, position_ids, cache, use_cache)``
                returning ``.logits`` and ``.cache``; ``past_key_values`` on transformers releases before the rename).
            tokenizer: optional, to decode ``response_text``.
            pad_token_id: filler for left padding (masked out, so any valid id works); default: the model's or the
                tokenizer's pad token, else its first EOS token, else 0.
            eos_token_ids: the model's end tokens; default: ``model.generation_config.eos_token_id`` (int or
                list), else ``model.config.eos_token_id``, else the tokenizer's.
            max_batch_size: most sequences decoded together.
            seed: seeds the engine's generator for unseeded requests.
            pause_timeout_s: longest time a paused ``generate`` waits for :meth:`resume_generation`.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"from_model(model=...) needs a torch.nn.Module, got {type(model).__name__}")
        if max_batch_size < 1:
            raise ValueError(f"from_model(max_batch_size={max_batch_size}); must be >= 1")
        engine = cls.__new__(cls)
        engine._setup(model, tokenizer=tokenizer, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                      max_batch_size=max_batch_size, seed=seed, pause_timeout_s=pause_timeout_s)
        return engine

    def _setup(self, model, *, tokenizer, pad_token_id, eos_token_ids, max_batch_size: int, seed: int,
               pause_timeout_s: float) -> None:
        self._pause = GenerationPause(pause_timeout_s)
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.eos_token_ids = _resolve_eos(model, tokenizer, eos_token_ids)
        self.pad_token_id = _resolve_pad(model, tokenizer, pad_token_id, self.eos_token_ids)
        self._state = EngineWeightState(model)
        self.device = self._state.device
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._seed = seed  # tells the engines of a group apart in a call-scoped stream
        self._kv_awake = True
        self._version = 0
        self._merger = None  # set by the first load_adapter()
        parameters = inspect.signature(model.forward).parameters
        self._takes_logits_to_keep = "logits_to_keep" in parameters
        # transformers >= 5.2x renamed the forward argument and output field ``past_key_values`` to ``cache`` and
        # warns on the old name; older releases (and vLLM's pinned one) only know ``past_key_values``.
        self._cache_name = "cache" if "cache" in parameters else "past_key_values"
        self._vocab_size = _vocab_size(model)

    # ------------------------------------------------------------------ protocol: lifecycle
    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def is_sleeping(self) -> bool:
        """True while weights or KV cache are asleep."""
        return not (self._state.awake and self._kv_awake)

    def sleep(self, level: int = 1) -> None:
        """Release memory: level 1 keeps the weights in host memory, level 2 discards them (see module docs)."""
        if level not in (1, 2):
            raise ValueError(f"sleep(level={level!r}); level must be 1 (offload weights) or 2 (discard weights)")
        self._state.sleep(level)
        self._kv_awake = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.debug("hf engine asleep (level %d) on %s", level, self.device)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wake ``"weights"``, ``"kv_cache"`` or both (None). Waking weights after ``sleep(level=2)`` allocates
        uninitialised storage: load every weight with :meth:`load_weights` before generating."""
        if isinstance(tags, str):
            raise TypeError(f"wake_up(tags={tags!r}) takes a list of tags; write wake_up([{tags!r}])")
        tags = WAKE_TAGS if tags is None else tuple(tags)
        unknown = [tag for tag in tags if tag not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"wake_up(tags={list(tags)!r}): unknown tag(s) {unknown}; valid tags are {WAKE_TAGS}")
        if "weights" in tags:
            self._state.wake()
        if "kv_cache" in tags:
            self._kv_awake = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                     version: int | None = None) -> int:
        """Copy named tensors (HF parameter/buffer names) into the model, casting to each target's dtype and device.

        Each tensor is validated (known name, same shape, floating point) before it is copied, so a bad tensor never
        reaches the model; the tensors before it in the stream have already been applied (streaming keeps memory at
        one tensor). If the load fails midway, the version is not bumped and :meth:`generate` refuses to run until a
        later load succeeds. Returns how many tensors were loaded; the weight version becomes ``version`` (default:
        the current version + 1), which must be newer than the current one (:class:`WeightVersionError` otherwise,
        raised before anything is copied).
        """
        new_version = next_weight_version(f"hf engine on {self.device}", self._version, version)
        items = weights.items() if isinstance(weights, Mapping) else weights
        count = self._state.load(items)
        self._version = new_version
        return count

    def load_adapter(self, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                     lora: LoraConfig, version: int | None = None) -> int:
        """Apply a LoRA adapter (peft's saved names, e.g. ``base_model.model.<module>.lora_A.weight``) by merging it
        into the targeted weights: ``W = W0 + (alpha / r) * B @ A`` from the base weights held when the first adapter
        came (successive adapters replace each other, they never accumulate, also when ``lora`` changes: a module
        the new config does not target gets its base weight back). Generation uses it from the next call (requests
        run one at a time in this engine: none is in flight during a load). All or nothing: every tensor is taken,
        its name and shape checked (``lora_A``: ``[rank, in_features]``, ``lora_B``: ``[out_features, rank]``) and
        every merged weight computed before any weight changes; a bad adapter (incomplete, unknown module, another
        rank, a mis-shaped tensor: ValueError naming the tensor, its shape and the expected one) leaves the weights
        and the version as they were. Returns how many tensors were taken; the weight version rules are those of
        :meth:`load_weights`."""
        from rlhfkit.lora import AdapterMerger, LoraConfig

        if not isinstance(lora, LoraConfig):
            raise TypeError(f"load_adapter(lora={lora!r}); expected an rlhfkit.lora.LoraConfig")
        new_version = next_weight_version(f"hf engine on {self.device}", self._version, version)
        if not self._state.awake:
            raise RuntimeError("load_adapter() called while the engine's weights are asleep; call "
                               "wake_up(['weights']) first")
        merger = self._merger
        if merger is None or merger.config != lora:
            merger = AdapterMerger(self.model, lora, previous=merger)
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        count = merger.merge(items)
        self._merger = merger  # only once merged: a refused adapter leaves the engine's merger as it was
        self._version = new_version
        return count

    # ------------------------------------------------------------------ protocol: generate
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig, *,
                 prompt_indices: Sequence[int] | None = None) -> list[Rollout]:
        """Sample ``sampling.n`` responses per prompt. Returns ``len(prompts) * n`` rollouts, prompt-major.

        ``prompt_indices`` (default ``0..P-1``: the prompts' global indices when an engine group shares a batch out)
        become ``Rollout.prompt_index``. Requests are sorted by prompt length and decoded in chunks of
        ``max_batch_size`` (less padding); the order of the result does not depend on it. With ``sampling.seed`` set,
        request ``i = prompt_index * n + sample_index`` draws from its own generator seeded from ``(seed, i)``: same
        seed, same outputs, whichever engine of a group served the prompt (``seed_scope="call"``: the call draws from
        one generator seeded from ``seed`` and the engine's own seed).

        A :meth:`pause_generation` from another thread stops the call at its next decode step; after
        :meth:`resume_generation` it resubmits each unfinished sample (prompt + tokens so far, the remaining
        ``max_new_tokens``) under the weights loaded meanwhile. Such a sample's ``weight_version`` is its first
        version and ``response_weight_versions`` gives each token's.
        """
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"generate(sampling=...) needs a SamplingConfig, got {type(sampling).__name__}")
        with self._pause.running():
            self._pause.park()  # a call that arrives during a pause starts with the new weights
            self._check_can_generate()
            prompts = self._validate_prompts(prompt_token_ids)
            _, indices = prompt_lists(prompts, prompt_indices)
            requests = [(p, s) for p in range(len(prompts)) for s in range(sampling.n)]
            generators: list[torch.Generator] | torch.Generator | None = None
            if sampling.seed is not None and sampling.seed_scope == "call":  # one stream for the whole call
                generators = torch.Generator(device=self.device)
                generators.manual_seed(request_seed(sampling.seed, self._seed))
            elif sampling.seed is not None:
                generators = make_generators(sampling.seed, [indices[p] * sampling.n + s for p, s in requests],
                                             self.device)
            samples = [_Sample(tokens=[], logprobs=[], versions=[]) for _ in requests]
            pending = list(range(len(requests)))
            while pending:
                version = self._version  # weights change only while every call is parked
                contexts = [prompts[requests[i][0]] + samples[i].tokens for i in pending]
                budgets = [sampling.max_new_tokens - len(samples[i].tokens) for i in pending]
                for index, out in zip(pending, self._decode(contexts, budgets, pending, generators, sampling)):
                    sample = samples[index]
                    sample.tokens += out.tokens
                    sample.logprobs.append(out.logprobs)
                    sample.versions += [version] * len(out.tokens)
                    if out.finish_reason != "abort":
                        sample.finish_reason = out.finish_reason
                pending = [i for i in pending if samples[i].finish_reason is None]
                if pending:
                    self._pause.park()
                    self._check_can_generate()
        return [self._to_rollout(prompts[p], s, indices[p], samples[i], sampling) for i, (p, s) in enumerate(requests)]

    def _decode(self, contexts: list[list[int]], budgets: list[int], request_indices: list[int],
                generators: list[torch.Generator] | torch.Generator | None,
                sampling: SamplingConfig) -> list[_ChunkOutput]:
        """One decode round of ``contexts`` (in order), by length-sorted chunks; stops early at a pause."""
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
        outputs: list[_ChunkOutput | None] = [None] * len(contexts)
        with torch.no_grad(), self._eval_mode():
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start:start + self.max_batch_size]
                if isinstance(generators, list):  # seed_scope="sample": each request its own stream
                    chunk_generators = [generators[request_indices[i]] for i in chunk]
                else:  # the call's one stream, or (unseeded) the engine's own
                    chunk_generators = self._generator if generators is None else generators
                chunk_out = self._generate_chunk([contexts[i] for i in chunk], [budgets[i] for i in chunk],
                                                 chunk_generators, sampling)
                for index, out in zip(chunk, chunk_out):
                    outputs[index] = out
        return outputs  # type: ignore[return-value]

    # ------------------------------------------------------------------ in-flight weight updates: PausableGeneration
    def _check_can_generate(self) -> None:
        if not self._state.awake:
            raise RuntimeError("generate() called while the engine's weights are asleep; call wake_up() first")
        if not self._kv_awake:
            raise RuntimeError("generate() called while the engine's KV cache is asleep; call "
                               "wake_up(['kv_cache']) first")
        self._state.check_complete()

    def _validate_prompts(self, prompt_token_ids) -> list[list[int]]:
        if isinstance(prompt_token_ids, torch.Tensor) or not isinstance(prompt_token_ids, Sequence):
            raise TypeError("generate(prompt_token_ids=...) takes a list of token-id lists, got "
                            f"{type(prompt_token_ids).__name__}")
        if len(prompt_token_ids) == 0:
            raise ValueError("generate(prompt_token_ids=[]) got no prompts")
        prompts = []
        for index, prompt in enumerate(prompt_token_ids):
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
            if not ids:
                raise ValueError(f"generate(): prompt {index} is empty; every prompt needs at least one token")
            try:
                ids = [operator.index(token) for token in ids]  # ints, numpy ints
            except TypeError as error:
                raise TypeError(f"generate(): prompt {index} holds non-integer token ids (e.g. {ids[0]!r})") from error
            if self._vocab_size is not None and (min(ids) < 0 or max(ids) >= self._vocab_size):
                raise ValueError(f"generate(): prompt {index} has token ids outside [0, {self._vocab_size}) "
                                 f"(min {min(ids)}, max {max(ids)})")
            prompts.append(ids)
        return prompts

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    def _forward(self, input_ids, attention_mask, position_ids, cache=None):
        kwargs = {"logits_to_keep": 1} if self._takes_logits_to_keep else {}
        if cache is not None:
            kwargs[self._cache_name] = cache
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **kwargs)
        return out.logits[:, -1, :], getattr(out, self._cache_name)

    def _generate_chunk(self, prompts: list[list[int]], budgets: list[int],
                        generators: torch.Generator | list[torch.Generator],
                        sampling: SamplingConfig) -> list[_ChunkOutput]:
        """Decode one left-padded chunk, row ``b`` for at most ``budgets[b]`` tokens; a pause ends it early, its
        unfinished rows with ``"abort"``."""
        batch, width, device = len(prompts), max(len(p) for p in prompts), self.device
        if self._pause.requested:
            return [_ChunkOutput(tokens=[], logprobs=torch.zeros(0), finish_reason="abort") for _ in prompts]
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((batch, width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long, device=device)
            attention_mask[row, width - len(prompt):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        limit = torch.tensor(budgets, dtype=torch.long, device=device)
        logits, cache = self._forward(input_ids, attention_mask, position_ids)
        next_position = position_ids[:, -1:] + 1
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        stopped = torch.zeros(batch, dtype=torch.bool, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        tokens, logprobs = [], []
        for step in range(max(budgets)):
            token, logprob = sample_next_tokens(logits, temperature=sampling.temperature, top_k=sampling.top_k,
                                                top_p=sampling.top_p, generators=generators)
            token = token.masked_fill(finished, self.pad_token_id)
            tokens.append(token)
            logprobs.append(logprob)
            lengths = torch.where(finished, lengths, step + 1)
            newly_stopped = torch.isin(token, stop) & ~finished
            stopped |= newly_stopped
            finished |= newly_stopped | (lengths >= limit)
            if bool(finished.all()) or self._pause.requested:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=1)
            logits, cache = self._forward(token[:, None], attention_mask, next_position, cache)
            next_position = next_position + 1
        token_matrix = torch.stack(tokens, dim=1).cpu()
        logprob_matrix = torch.stack(logprobs, dim=1).float().cpu()
        lengths_list, finished_list, stopped_list = lengths.tolist(), finished.tolist(), stopped.tolist()
        return [_ChunkOutput(tokens=token_matrix[row, :lengths_list[row]].tolist(),
                             logprobs=logprob_matrix[row, :lengths_list[row]].clone(),
                             finish_reason="stop" if stopped_list[row] else "length" if finished_list[row] else "abort")
                for row in range(batch)]

    def _to_rollout(self, prompt: list[int], sample_index: int, prompt_index: int, sample: _Sample,
                    sampling: SamplingConfig) -> Rollout:
        tokens = sample.tokens
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else None
        first = sample.versions[0] if sample.versions else self._version
        spans = bool(sample.versions) and sample.versions[-1] != first
        return Rollout(
            prompt_token_ids=torch.tensor(prompt, dtype=torch.long),
            response_token_ids=torch.tensor(tokens, dtype=torch.long),
            response_logprobs=torch.cat(sample.logprobs) if sampling.logprobs else None,
            finish_reason=sample.finish_reason,  # type: ignore[arg-type]
            prompt_index=prompt_index,
            sample_index=sample_index,
            weight_version=first,
            response_weight_versions=torch.tensor(sample.versions, dtype=torch.long) if spans else None,
            response_text=text,
        )


def _vocab_size(model) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(getattr(embeddings, "num_embeddings", None), int):
        return embeddings.num_embeddings
    return getattr(getattr(model, "config", None), "vocab_size", None)


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _resolve_eos(model, tokenizer, eos_token_ids) -> tuple[int, ...]:
    if eos_token_ids is not None:
        return _as_id_tuple(eos_token_ids)
    generation_config = getattr(model, "generation_config", None)
    for source in (generation_config, getattr(model, "config", None), tokenizer):
        ids = _as_id_tuple(getattr(source, "eos_token_id", None))
        if ids:
            return ids
    logger.warning("hf engine: the model names no EOS token; samples end only at stop_token_ids or max_new_tokens")
    return ()


def _resolve_pad(model, tokenizer, pad_token_id, eos_token_ids: tuple[int, ...]) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return eos_token_ids[0] if eos_token_ids else 0
