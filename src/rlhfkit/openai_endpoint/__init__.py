"""An OpenAI-compatible chat-completions endpoint over any rlhfkit rollout engine, recording what was sampled.

Agent code that speaks OpenAI's API (``POST /v1/chat/completions``, ``GET /v1/models``) runs unchanged against an
rlhfkit engine — :class:`rlhfkit.engines.hf.HFEngine` on CPU, a vLLM engine or an
:class:`~rlhfkit.engines.router.EngineGroup` of vLLM actors on GPU — and every answer is recorded token for token:
the exact prompt token ids (the tokenizer's chat template applied here), the sampled token ids and their log-probs,
grouped by a session id the caller gives (``X-Session-Id`` header, else the ``user`` field). A training loop turns a
session into :class:`~rlhfkit.types.Rollout` objects (:meth:`ChatRecord.to_rollout`, :func:`records_to_rollouts`)
without re-tokenising anything.

What it does: non-streaming chat completions with ``messages`` (text content; ``tools`` are passed to the chat
template), ``n``, ``temperature``, ``top_p``, ``max_tokens``/``max_completion_tokens``, ``stop`` (strings; a
one-token stop string stops the engine, a longer one is cut after generation), ``seed``, ``logprobs``, and vLLM's
``return_token_ids``; OpenAI-style JSON errors (400 naming the field for a malformed request, 404 for an unknown
model or path, 503 while closing, 504 when the engine does not answer within ``request_timeout_s``, 500 when it
fails). Concurrent requests with equal sampling parameters are batched into one engine call (see
:class:`OpenAIEndpoint`). It binds exactly ``OpenAIEndpointConfig.host`` (127.0.0.1 by default), on an ephemeral
port by default, in a daemon thread; :meth:`OpenAIEndpoint.close` returns in bounded time.

Who may call it, checked on the headers before the body is read: ``Host`` must name this server (421 otherwise: DNS
rebinding), an ``Origin`` header must be this server's (403 otherwise: a web page in a browser on this machine), a
POST must be ``Content-Type: application/json`` (415 otherwise: a browser sends ``text/plain`` cross-origin without
asking), and ``Authorization: Bearer <key>`` must carry :attr:`OpenAIEndpoint.api_key` when there is one (401
otherwise): always beyond loopback (a random key unless ``api_key`` is configured), on loopback only when configured.
Bodies are bounded (413) and must be strict JSON in UTF-8; too deep nesting, huge integers, NaN/Infinity and lone
surrogates are 400s naming the problem.

What it does not do: streaming, tool-call parsing (the assistant's text comes back as ``content``; parse tool calls
in your agent), ``top_logprobs``, penalties or logit bias (refused with a 400, never silently ignored: the recorded
log-probs must describe the distribution the tokens came from), or TLS (the key crosses the network in clear text
beyond loopback: put a TLS proxy in front on an untrusted network).
It does not stitch a session's turns into one sequence with a loss mask (that is ``rlhfkit.multiturn``'s job).

Why not vLLM's own OpenAI server: it needs vLLM's engine process (``AsyncLLM``) and drives vLLM only; this endpoint
drives rlhfkit's engine protocol, so the same agent code runs on the CPU ``hf`` engine in CI and on vLLM on GPU, and
it records token ids and log-probs as rlhfkit's trainer consumes them. Needs only the standard library and torch;
the tokenizer you pass needs ``rlhfkit[hf]`` (transformers, with jinja2 for chat templates).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlhfkit._optional import require
from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.engines.router import EngineError, EngineGroup, EngineGroupConfig, EngineTimeoutError
from rlhfkit.openai_endpoint._batching import BatcherClosedError, BatchFailedError, BatchTimeoutError, RequestBatcher
from rlhfkit.openai_endpoint._config import OpenAIEndpointConfig
from rlhfkit.openai_endpoint._guard import RequestGuard, is_loopback, url_host
from rlhfkit.openai_endpoint._http import Reply, start_server
from rlhfkit.openai_endpoint._records import ChatRecord, records_to_rollouts, session_to_rollout
from rlhfkit.openai_endpoint._requests import (
    ChatRequest,
    EndpointError,
    cut_at_stop,
    decode_body,
    error_body,
    parse_chat_request,
    single_token_stops,
)
from rlhfkit.types import Rollout

__all__ = ["ChatRecord", "OpenAIEndpoint", "OpenAIEndpointConfig", "records_to_rollouts", "session_to_rollout"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LastTurn:
    """A session's last request: its messages, rendered prompt text and prompt ids, and each choice's (content,
    sampled ids)."""

    messages: list[dict[str, Any]]
    text: str
    prompt: list[int]
    answers: list[tuple[str, list[int]]]


class OpenAIEndpoint:
    """An OpenAI-compatible chat endpoint over ``engine`` on ``config.host`` (see the module docstring).

    Args:
        engine: a :class:`~rlhfkit.engines.protocol.RolloutEngine` (its calls then run on one worker thread, one at a
            time, with ``request_timeout_s``) or an :class:`~rlhfkit.engines.router.EngineGroup` (used as is, e.g.
            vLLM actors).
        tokenizer: the model's tokenizer, with a chat template (``apply_chat_template``, ``encode``, ``decode``).
        config: address, key, limits, timeouts and batching.

    Attributes:
        api_key: the key every request must send as ``Authorization: Bearer <api_key>``: ``config.api_key``, or one
            made with :mod:`secrets` when ``config.host`` is beyond loopback and none was given; None when no key is
            asked (loopback, no ``config.api_key``).

    Use as a context manager, or :meth:`start` and :meth:`close`. Records stay readable after close.

    Batching: concurrent requests are collected by one batcher thread and sent to the engine together, one
    ``generate(prompts, sampling)`` call per group of requests with equal sampling parameters (``n``, ``max_tokens``,
    ``temperature``, ``top_p``, ``seed``, one-token stops), at most ``max_batch_prompts`` a call, once none has
    arrived for ``batch_window_s`` (at the latest ``max_batch_wait_s`` after the first; at once when full). At most one call per engine of the group runs at a time; requests
    that arrive meanwhile wait and go out together. A request with a ``seed`` is sent alone, so that its answer does
    not depend on what arrived with it. Each request keeps its own prompt ids (session continuation included),
    record, answer and timeout; an engine call that fails answers each of its requests with a 500.
    """

    def __init__(self, engine: Any, tokenizer: Any, config: OpenAIEndpointConfig | None = None) -> None:
        config = config or OpenAIEndpointConfig()
        if not isinstance(config, OpenAIEndpointConfig):
            raise TypeError(f"OpenAIEndpoint(config=...) needs an OpenAIEndpointConfig, got {type(config).__name__}")
        if not callable(getattr(engine, "generate", None)):
            raise TypeError(f"OpenAIEndpoint(engine={type(engine).__name__}) has no generate(prompts, sampling); pass "
                            "a RolloutEngine or an EngineGroup")
        for method in ("apply_chat_template", "encode", "decode"):
            if not callable(getattr(tokenizer, method, None)):
                raise TypeError(f"OpenAIEndpoint(tokenizer={type(tokenizer).__name__}) has no {method}(); pass the "
                                "model's transformers tokenizer")
        if getattr(tokenizer, "chat_template", "") is None:
            raise ValueError("OpenAIEndpoint: the tokenizer has no chat_template; set tokenizer.chat_template (a "
                             "Jinja template) before serving chat requests")
        self.config = config
        self.tokenizer = tokenizer
        self.api_key = config.api_key
        if self.api_key is None and not is_loopback(config.host):
            self.api_key = secrets.token_urlsafe(32)
        self._owns_group = not isinstance(engine, EngineGroup)
        self._group = (EngineGroup([engine], config=EngineGroupConfig(generate_timeout_s=config.request_timeout_s))
                       if self._owns_group else engine)
        self._lock = threading.Condition()
        self._records: dict[str, list[ChatRecord]] = {}
        self._turns: dict[str, int] = {}
        self._last: dict[str, _LastTurn] = {}  # per session: what the next request may continue token for token
        self._in_flight = 0
        self._state: Literal["new", "serving", "closed"] = "new"
        self._server = self._thread = None
        self._batcher: RequestBatcher | None = None
        self._created = int(time.time())

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> OpenAIEndpoint:
        """Bind ``config.host`` and serve in a daemon thread; returns self."""
        if self._state != "new":
            raise RuntimeError(f"OpenAIEndpoint.start() called on an endpoint that is {self._state}; build a new one")
        timeout_s = self.config.request_timeout_s
        self._batcher = RequestBatcher(lambda prompts, sampling: self._group.generate(prompts, sampling,
                                                                                      timeout_s=timeout_s),
                                       window_s=self.config.batch_window_s,
                                       max_wait_s=max(self.config.max_batch_wait_s, self.config.batch_window_s),
                                       max_batch_prompts=self.config.max_batch_prompts,
                                       max_in_flight=self._group.num_engines)
        guard = RequestGuard(bind_host=self.config.host, allowed_hosts=self.config.allowed_hosts, api_key=self.api_key)
        try:
            self._server, self._thread = start_server(self._serve, host=self.config.host, port=self.config.port,
                                                      guard=guard, read_timeout_s=self.config.read_timeout_s,
                                                      max_request_bytes=self.config.max_request_bytes)
        except BaseException:
            self._batcher.close()
            raise
        self._state = "serving"
        logger.info("openai endpoint serving %r at %s (%s)", self.config.model_name, self.url,
                    "bearer key required" if self.api_key is not None else "no key asked")
        return self

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("OpenAIEndpoint.port read before start(); call start() first")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The API base URL, ``http://<host>:<port>/v1`` (what OpenAI clients take as ``base_url``)."""
        return f"http://{url_host(self.config.host)}:{self.port}/v1"

    def close(self) -> None:
        """Stop accepting requests (new ones get 503), wait up to ``shutdown_timeout_s`` for those in flight, close
        the socket. Idempotent; returns in bounded time even if the engine hangs."""
        if self._state != "serving":
            if self._state == "new" and self._owns_group:
                self._group.close()
            self._state = "closed"
            return
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        with self._lock:
            self._state = "closed"
            while self._in_flight and self._lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                pass
            left = self._in_flight
        if left:
            logger.warning("openai endpoint: closing with %d request(s) still in flight after %g s; their clients "
                           "get no answer", left, self.config.shutdown_timeout_s)
        self._server.shutdown()   # returns within the serve loop's poll interval
        self._server.server_close()
        self._batcher.close(timeout_s=max(0.1, deadline - time.monotonic()))   # requests still queued: 503
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        if self._owns_group:
            self._group.close()

    def __enter__(self) -> OpenAIEndpoint:
        if self._state == "new":
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ records
    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._records)

    def records(self, session_id: str) -> list[ChatRecord]:
        """The records of one session so far, by turn then choice (a copy; KeyError names the known sessions)."""
        with self._lock:
            if session_id not in self._records:
                raise KeyError(f"no records for session {session_id!r}; known sessions: {sorted(self._records)}")
            return list(self._records[session_id])

    def pop_records(self, session_id: str) -> list[ChatRecord]:
        """Like :meth:`records`, and forget the session (records are kept until popped)."""
        with self._lock:
            if session_id not in self._records:
                raise KeyError(f"no records for session {session_id!r}; known sessions: {sorted(self._records)}")
            self._turns.pop(session_id, None)
            self._last.pop(session_id, None)
            return self._records.pop(session_id)

    # ------------------------------------------------------------------ serving
    def _serve(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        route = path.split("?", 1)[0].rstrip("/")
        if route not in ("/v1/models", "/v1/chat/completions"):
            return 404, error_body(EndpointError(404, f"no route {method} {route!r}; this endpoint serves GET "
                                                 "/v1/models and POST /v1/chat/completions", code="not_found"))
        expected = "GET" if route == "/v1/models" else "POST"
        if method != expected:
            return 405, error_body(EndpointError(405, f"{method} {route} is not allowed; use {expected}"))
        if route == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                                                     "created": self._created, "owned_by": "rlhfkit"}]}
        with self._lock:
            if self._state != "serving":
                return 503, error_body(EndpointError(503, "the endpoint is shutting down", type="server_error"))
            self._in_flight += 1
        try:
            return 200, self._complete(headers, body)
        except EndpointError as error:
            return error.status, error_body(error)
        finally:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def _complete(self, headers: dict[str, str], body: bytes) -> dict[str, Any]:
        payload = decode_body(body)
        config = self.config
        request = parse_chat_request(payload, model_name=config.model_name, max_n=config.max_n,
                                     default_max_tokens=config.default_max_tokens,
                                     max_tokens_limit=config.max_tokens_limit)
        session_id = headers.get(config.session_header.lower()) or request.user or config.default_session_id
        prompt, text = self._prompt_ids(request, session_id)
        sampling = SamplingConfig(n=request.n, max_new_tokens=request.max_tokens, temperature=request.temperature,
                                  top_p=request.top_p, seed=request.seed, logprobs=True,
                                  stop_token_ids=single_token_stops(self.tokenizer, request.stop))
        rollouts = self._generate(prompt, sampling)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = [self._choice(request, rollout) for rollout in rollouts]
        records = self._record(session_id, request_id, request, prompt, text, rollouts, choices)
        return self._answer(request, request_id, session_id, prompt, records)

    def _generate(self, prompt: list[int], sampling: SamplingConfig) -> list[Rollout]:
        """This request's rollouts, from an engine call shared with concurrent requests of equal ``sampling``."""
        timeout_s = self.config.request_timeout_s
        try:
            return self._batcher.generate(prompt, sampling, timeout_s=timeout_s)
        except BatchTimeoutError as error:
            raise EndpointError(504, f"the engine did not answer within request_timeout_s={timeout_s:g} s "
                                "(waiting for a batch included)", type="timeout_error") from error
        except BatcherClosedError as error:
            raise EndpointError(503, "the endpoint is shutting down", type="server_error") from error
        except BatchFailedError as failure:
            cause, calls = failure.error, f"an engine call of {failure.batch_size} request(s)"
            if isinstance(cause, EngineTimeoutError):
                raise EndpointError(504, f"the engine did not answer within request_timeout_s={timeout_s:g} s "
                                    f"({calls}): {cause}", type="timeout_error") from cause
            if isinstance(cause, EngineError):
                raise EndpointError(500, f"the engine failed ({calls}): {cause}", type="server_error") from cause
            raise EndpointError(500, f"internal error in {calls}: {type(cause).__name__}: {cause}",
                                type="server_error") from cause

    def _render(self, messages: list[dict[str, Any]], request: ChatRequest, generation_prompt: bool = True) -> str:
        extra = {"tools": request.tools} if request.tools else {}
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                      tokenize=False, **extra)
        except _template_errors() as error:
            raise EndpointError(400, f"messages: the chat template rejected them: {type(error).__name__}: {error}",
                                param="messages") from error

    def _prompt_ids(self, request: ChatRequest, session_id: str) -> tuple[list[int], str]:
        """The prompt's token ids and the rendered text they stand for."""
        text = self._render(request.messages, request)
        ids = self._continued(request, session_id, text)
        if ids is None:
            # the template already wrote any BOS/role tokens into the text: add no special tokens twice
            ids = [int(token) for token in self.tokenizer.encode(text, add_special_tokens=False)]
        if not ids:
            raise EndpointError(400, "messages: the chat template rendered an empty prompt", param="messages")
        limit = self.config.max_model_len
        if limit is not None and len(ids) + request.max_tokens > limit:
            raise EndpointError(400, f"messages: the prompt has {len(ids)} tokens and max_tokens={request.max_tokens}; "
                                f"together they exceed max_model_len={limit}: shorten the conversation or lower "
                                "max_tokens", param="messages", code="context_length_exceeded")
        return ids, text

    def _continued(self, request: ChatRequest, session_id: str, text: str) -> list[int] | None:
        """Token in, token out across turns: when this request repeats the session's previous request and appends
        one of its answers unchanged (then more messages), the prompt is the previous prompt's ids + the answer's
        sampled ids + the ids of the text the template adds after them, so no sampled token is re-tokenised (a
        sampled segmentation is often not the tokenizer's own). The previous messages must also render now as they
        did then: a changed ``tools`` list (or anything else the template writes before them) changes the prefix the
        previous ids stand for. None: tokenise ``text`` whole."""
        with self._lock:
            last = self._last.get(session_id)
        messages = request.messages
        if last is None or len(messages) <= len(last.messages) + 1 or messages[:len(last.messages)] != last.messages:
            return None
        said = messages[len(last.messages)]
        answer = next((ids for content, ids in last.answers
                       if said.get("role") == "assistant" and said.get("content") == content), None)
        if answer is None:
            return None
        before = self._render(last.messages, request)
        if before != last.text or not text.startswith(before + said["content"]):
            return None
        rest = text[len(before) + len(said["content"]):]  # the answer's closing markup, the new messages, the prompt
        sampled = self.tokenizer.decode(answer, skip_special_tokens=False)
        if sampled.startswith(said["content"]) and rest.startswith(sampled[len(said["content"]):]):
            rest = rest[len(sampled) - len(said["content"]):]  # a sampled EOS is the template's closing token
        return last.prompt + answer + [int(token) for token in self.tokenizer.encode(rest, add_special_tokens=False)]

    def _choice(self, request: ChatRequest, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, str, str]:
        """``(response ids [R], log-probs [R], content, finish_reason)`` with stop strings applied."""
        if rollout.response_logprobs is None:
            raise EndpointError(500, "the engine returned no log-probs although SamplingConfig.logprobs=True",
                                type="server_error")
        ids, logprobs, finish = rollout.response_token_ids, rollout.response_logprobs.float(), rollout.finish_reason
        cut = cut_at_stop(self.tokenizer, ids.tolist(), request.stop) if request.stop and ids.numel() else None
        if cut is not None:
            keep, content = cut
            return ids[:keep].clone(), logprobs[:keep].clone(), content, "stop"
        return ids, logprobs, self.tokenizer.decode(ids.tolist(), skip_special_tokens=True), finish

    def _record(self, session_id: str, request_id: str, request: ChatRequest, prompt: list[int], text: str,
                rollouts: list[Rollout], choices: list[tuple]) -> list[ChatRecord]:
        prompt_ids = torch.tensor(prompt, dtype=torch.long)
        with self._lock:
            turn = self._turns.get(session_id, 0)
            self._turns[session_id] = turn + 1
            records = [ChatRecord(session_id=session_id, turn_index=turn, choice_index=index, request_id=request_id,
                                  messages=request.messages, prompt_token_ids=prompt_ids, response_token_ids=ids,
                                  response_logprobs=logprobs, finish_reason=finish, temperature=request.temperature,
                                  weight_version=rollout.weight_version, content=content, tools=request.tools)
                       for index, (rollout, (ids, logprobs, content, finish)) in enumerate(zip(rollouts, choices))]
            self._records.setdefault(session_id, []).extend(records)
            self._last[session_id] = _LastTurn(messages=request.messages, text=text, prompt=list(prompt),
                                               answers=[(r.content, r.response_token_ids.tolist()) for r in records])
        return records

    def _answer(self, request: ChatRequest, request_id: str, session_id: str, prompt: list[int],
                records: list[ChatRecord]) -> dict[str, Any]:
        choices = []
        for record in records:
            choice: dict[str, Any] = {"index": record.choice_index, "finish_reason": record.finish_reason,
                                      "message": {"role": "assistant", "content": record.content}, "logprobs": None}
            if request.logprobs:
                choice["logprobs"] = {"content": [self._token_logprob(token, value) for token, value in zip(
                    record.response_token_ids.tolist(), record.response_logprobs.tolist())]}
            if request.return_token_ids:
                choice["token_ids"] = record.response_token_ids.tolist()
            choices.append(choice)
        completion = sum(record.response_token_ids.numel() for record in records)
        answer = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                  "model": self.config.model_name, "choices": choices, "system_fingerprint": None,
                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion,
                            "total_tokens": len(prompt) + completion},
                  "rlhfkit": {"session_id": session_id, "turn_index": records[0].turn_index,
                              "weight_version": records[0].weight_version}}
        if request.return_token_ids:
            answer["prompt_token_ids"] = prompt
        return answer

    def _token_logprob(self, token: int, value: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8")), "top_logprobs": []}


def _template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template raises for messages it rejects (jinja2's ``raise_exception`` included)."""
    jinja2 = require("jinja2", "hf", user="rlhfkit.openai_endpoint")
    return (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError)
