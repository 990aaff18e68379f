"""Stepwise (pausable) generation of :class:`~rlhfkit.engines.vllm.VLLMEngine`: with
``VLLMEngineConfig(pausable=True)`` a generate call adds its requests to vLLM's engine and steps it itself, parking
between two steps while a weight update is in flight, and stamps each sampled token with the weight version that
sampled it. Also the reading of sampled tokens' log-probs from vLLM's outputs, which both generate paths share."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.engines.vllm._compat import make_sampling_params, request_seed

__all__ = ["Stepped", "StepwiseGeneration", "completion_logprobs", "logprob_values"]


def logprob_values(completion: Any, token_ids: list[int]) -> list[float]:
    positions = completion.logprobs
    if positions is None or len(positions) < len(token_ids):
        raise RuntimeError(f"vLLM returned log-probs for {0 if positions is None else len(positions)} of "
                           f"{len(token_ids)} tokens; was SamplingParams.logprobs set?")
    flat = [getattr(positions, name, None) for name in ("start_indices", "end_indices", "token_ids", "logprobs")]
    if all(isinstance(field, list) for field in flat):  # vLLM's FlatLogprobs
        # with logprobs=0 a position holds the sampled token alone (first); read the flat lists, else look it up
        starts, ends, ids, values = flat
        picked = [values[s] if s < e and ids[s] == token else None
                  for s, e, token in zip(starts, ends, token_ids)]
        return [float(v) if v is not None else float(positions[t][token_ids[t]].logprob)
                for t, v in enumerate(picked)]
    return [float(positions[t][token].logprob) for t, token in enumerate(token_ids)]


def completion_logprobs(completion: Any, token_ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs: read from vLLM's output, or accumulated by a stepwise call (``Stepped``)."""
    return completion.values if isinstance(completion, Stepped) else logprob_values(completion, token_ids)


@dataclasses.dataclass
class Stepped:
    """One sample of a stepwise (pausable) generate call: its tokens, their log-probs and the weight version that
    sampled each token, accumulated from vLLM's per-step (delta) outputs, or read from its final output with
    ``marks``: ``(tokens produced so far, version from then on)``, one per weight change while it ran."""

    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    values: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    marks: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def _expand_marks(marks: list[tuple[int, int]], length: int) -> list[int]:
    """Each of ``length`` tokens' version from ``marks`` (``(offset, version)`` in order; a later mark at the same
    offset replaces an earlier one)."""
    versions: list[int] = []
    for (offset, version), following in zip(marks, [*marks[1:], (length, None)]):
        versions += [version] * max(0, min(following[0], length) - max(offset, len(versions)))
    return versions


def _output_progress(engine: Any) -> Callable[[set[str]], dict[tuple[str, int], int]] | None:
    """A reader of how many tokens each running sample has produced so far, keyed by (our request id, sample index),
    from vLLM's output processor (``LLMEngine.output_processor.request_states``: one state per sample, with the
    request's ``external_req_id``, its ``request_index`` and ``detokenizer.num_output_tokens()``, as in vLLM 0.22 and
    0.32); None when this vLLM keeps no such states."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    if not isinstance(states, dict):
        return None

    def produced(request_ids: set[str]) -> dict[tuple[str, int], int]:
        counts = {}
        for state in list(states.values()):
            request_id = getattr(state, "external_req_id", None)
            if request_id in request_ids:
                counts[(request_id, int(state.request_index))] = int(state.detokenizer.num_output_tokens())
        return counts

    return produced


@dataclasses.dataclass
class _StepOutput:
    """A stepwise call's result for one prompt, shaped like vLLM's ``RequestOutput`` (its samples in ``outputs``)."""

    outputs: list[Stepped]


class StepwiseGeneration:
    """The stepwise generate path of :class:`~rlhfkit.engines.vllm.VLLMEngine` (a mixin: it uses the engine's
    ``_llm``, ``_vllm``, ``features``, ``engine_index``, ``_pause``, ``_version``, ``_request_ids``, ``_final_only``
    and ``_check_ready``)."""

    _llm: Any
    _vllm: Any
    features: Any
    engine_index: int
    _pause: Any
    _version: int
    _request_ids: Any
    _final_only: bool | None
    _check_ready: Callable[[str], None]

    def _step_requests(self, requests: list[Any], indices: list[int], sampling: SamplingConfig,
                       extra: dict[str, Any]) -> list[Any]:
        """``pausable``: add the requests to vLLM's engine and step it here, parking between two steps while a pause
        is requested (weights may then change; the requests keep their KV cache and go on). Each sample's tokens are
        stamped with the version of the weights that sampled them.

        Where this vLLM lets us read each running sample's progress (:func:`_output_progress`), a prompt is one
        request of ``n`` samples that answers once, when all are finished (vLLM then builds no per-step output: ~7 us
        a token on CPU), and a weight change records how many tokens each sample had. Otherwise every sample is a
        request of its own whose steps return the new tokens (seed: its prompt's + its sample index, as vLLM seeds
        the samples of one ``n > 1`` request, so both give the same samples)."""
        engine = self._llm.llm_engine
        progress = _output_progress(engine) if self._final_only is not False else None
        if progress is not None and self._final_only is None:  # first use: can this vLLM's progress be read?
            self._final_only = self._progress_readable(engine, progress, requests[0], sampling, extra)
            progress = progress if self._final_only else None
        call = next(self._request_ids)
        version = self._version  # weights change only while this call is parked
        outputs, samples = [], {}  # samples: (request id, sample index) -> Stepped
        kinds = self._vllm.sampling_params.RequestOutputKind
        for position, (request, index) in enumerate(zip(requests, indices)):
            group = [Stepped(index=k, marks=[(0, version)]) for k in range(sampling.n)]
            seed = None if sampling.seed is None else request_seed(sampling.seed, index)
            if progress is not None:
                request_id = f"rlhfkit-{self.engine_index}-{call}-{position}"
                samples.update({(request_id, k): sample for k, sample in enumerate(group)})
                engine.add_request(request_id, request, self._step_params(sampling, seed, kinds.FINAL_ONLY), **extra)
            else:
                for k, sample in enumerate(group):
                    request_id = f"rlhfkit-{self.engine_index}-{call}-{position}-{k}"
                    samples[(request_id, 0)] = sample
                    params = self._step_params(dataclasses.replace(sampling, n=1), None if seed is None else seed + k,
                                               kinds.DELTA)
                    engine.add_request(request_id, request, params, **extra)
            outputs.append(_StepOutput(outputs=group))
        running = {request_id for request_id, _ in samples}
        try:
            while running:
                if self._pause.park():
                    self._check_ready("generate")
                if self._version != version:
                    version = self._version
                    if progress is not None:  # the tokens so far were sampled with the old weights
                        for key, produced in progress(running).items():
                            samples[key].marks.append((produced, version))
                for output in engine.step():
                    for completion in output.outputs:
                        sample = samples.get((output.request_id, completion.index if progress is not None else 0))
                        if sample is None:
                            continue
                        tokens = [int(t) for t in completion.token_ids]
                        if progress is None:
                            sample.token_ids += tokens
                            sample.versions += [version] * len(tokens)
                        else:  # the final output: every token
                            sample.token_ids, sample.versions = tokens, _expand_marks(sample.marks, len(tokens))
                        if sampling.logprobs and tokens:
                            values = logprob_values(completion, tokens)
                            sample.values = sample.values + values if progress is None else values
                        if completion.finish_reason is not None:
                            sample.finish_reason = str(completion.finish_reason)
                    if output.finished:
                        running.discard(output.request_id)
                if running and not engine.has_unfinished_requests():
                    raise RuntimeError(f"engine {self.engine_index}: vLLM finished stepping with {len(running)} "
                                       "request(s) of this generate call unanswered")
        except BaseException:
            if running:
                with contextlib.suppress(Exception):
                    engine.abort_request(sorted(running))
            raise
        return outputs

    def _step_params(self, sampling: SamplingConfig, seed: int | None, output_kind: Any) -> Any:
        params = make_sampling_params(sampling, seed=seed, features=self.features,
                                      sampling_params_cls=self._vllm.SamplingParams)
        params.output_kind = output_kind
        return params

    def _progress_readable(self, engine: Any, progress: Callable, request: Any, sampling: SamplingConfig,
                           extra: dict[str, Any]) -> bool:
        """Whether ``progress`` finds every sample of a request just added (each at 0 tokens); the probe request is
        aborted."""
        kinds = self._vllm.sampling_params.RequestOutputKind
        probe = f"rlhfkit-{self.engine_index}-probe"
        engine.add_request(probe, request, self._step_params(sampling, None, kinds.FINAL_ONLY), **extra)
        try:
            return progress({probe}) == {(probe, k): 0 for k in range(sampling.n)}
        except (AttributeError, TypeError, ValueError):  # states of another shape: the progress cannot be read
            return False
        finally:
            engine.abort_request([probe])
