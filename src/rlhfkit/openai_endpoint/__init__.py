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

import ipaddress
import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlhfkit._optional import require
from rlhfkit.engines.protocol import SamplingConfig
from rlhfkit.engines.router import EngineError, EngineGroup, EngineGroupConfig, EngineTimeoutError
from rlhfkit.openai_endpoint._batching import BatcherClosedError, BatchFailedError, BatchTimeoutError, RequestBatcher
from rlhfkit.openai_endpoint._guard import RequestGuard, is_loopback, url_host
from rlhfkit.openai_endpoint._http import Reply, start_server
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


@dataclass(frozen=True, kw_only=True)
class OpenAIEndpointConfig:
    """How an :class:`OpenAIEndpoint` serves.

    Attributes:
        model_name: the id ``GET /v1/models`` lists; a request naming another model gets a 404.
        host: the IP address the server binds, exactly (``"0.0.0.0"``/``"::"``: every interface). Beyond loopback
            every request needs the bearer key (``api_key``, generated when not given).
        port: port on ``host``; 0 picks a free ephemeral port (read it from :attr:`OpenAIEndpoint.url`).
        api_key: when set, every request must send ``Authorization: Bearer <api_key>`` (401 otherwise). None: no key
            on a loopback ``host``; beyond loopback, a random key the endpoint makes (:attr:`OpenAIEndpoint.api_key`).
            Visible ASCII, no spaces; never shown in the config's repr or in logs.
        allowed_hosts: more names a request's ``Host`` (and ``Origin``) may give for this server, e.g. its DNS
            name when ``host`` is beyond loopback. Always accepted: ``host`` itself; ``localhost`` for a loopback or
            wildcard ``host``; any IP address for a wildcard ``host``.
        default_max_tokens: ``max_tokens`` of a request that gives none.
        max_tokens_limit: the largest ``max_tokens`` accepted.
        max_n: the largest ``n`` accepted.
        max_model_len: when set, a request whose prompt tokens plus ``max_tokens`` exceed it gets a 400
            (``context_length_exceeded``) before it reaches the engine.
        request_timeout_s: longest wait for the engine's answer to one request, queueing for a batch included (504
            after it).
        read_timeout_s: socket timeout while reading a request.
        shutdown_timeout_s: how long :meth:`OpenAIEndpoint.close` waits for requests in flight.
        max_request_bytes: the largest request body accepted (413 beyond).
        session_header: the header that names a request's session (before the body's ``user`` field).
        default_session_id: the session of a request that names none.
        batch_window_s: the quiet gap: waiting requests with the same sampling parameters are sent as one engine
            call once no other such request has arrived for this long (0: as soon as the engine is free; while it is
            busy, requests keep collecting anyway). See "Batching" in :class:`OpenAIEndpoint`.
        max_batch_wait_s: the longest a request waits for others before its call is sent (never less than
            ``batch_window_s``).
        max_batch_prompts: most requests (prompts) in one engine call; a full batch is sent without waiting.
    """

    model_name: str = "rlhfkit"
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] = ()
    default_max_tokens: int = 256
    max_tokens_limit: int = 4096
    max_n: int = 64
    max_model_len: int | None = None
    request_timeout_s: float = 300.0
    read_timeout_s: float = 30.0
    shutdown_timeout_s: float = 10.0
    max_request_bytes: int = 8 * 1024 * 1024
    session_header: str = "X-Session-Id"
    default_session_id: str = "default"
    batch_window_s: float = 0.01
    max_batch_wait_s: float = 0.25
    max_batch_prompts: int = 256

    def __post_init__(self) -> None:
        for name in ("model_name", "session_header", "default_session_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"OpenAIEndpointConfig.{name}={getattr(self, name)!r}; must be a non-empty string")
        self._check_network()
        port = self.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"OpenAIEndpointConfig.port={port!r}; must be an int in [0, 65535] (0: ephemeral)")
        for name in ("default_max_tokens", "max_tokens_limit", "max_n", "max_request_bytes", "max_batch_prompts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"OpenAIEndpointConfig.{name}={value!r}; must be an int >= 1")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"OpenAIEndpointConfig.default_max_tokens={self.default_max_tokens} exceeds "
                             f"max_tokens_limit={self.max_tokens_limit}; lower it or raise the limit")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"OpenAIEndpointConfig.max_model_len={self.max_model_len!r}; must be an int >= 2 or None")
        for name in ("request_timeout_s", "read_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"OpenAIEndpointConfig.{name}={value!r}; must be a finite number of seconds > 0")
        window = self.batch_window_s
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window < math.inf:
            raise ValueError(f"OpenAIEndpointConfig.batch_window_s={window!r}; must be a finite number of seconds "
                             ">= 0 (0: send each batch as soon as the engine is free)")
        wait = self.max_batch_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < math.inf:
            raise ValueError(f"OpenAIEndpointConfig.max_batch_wait_s={wait!r}; must be a finite number of seconds "
                             ">= 0 (a batch waits at least batch_window_s anyway)")

    def _check_network(self) -> None:
        try:
            ipaddress.ip_address(self.host if isinstance(self.host, str) else "")
        except ValueError:
            raise ValueError(f"OpenAIEndpointConfig.host={self.host!r}; must be an IP address literal "
                             "('127.0.0.1', '::1', this machine's address, or '0.0.0.0' for every interface): the "
                             "server binds exactly this address") from None
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key
                                or not all(33 <= ord(character) <= 126 for character in key)):
            # the value itself is a secret: name its type and length, never the value
            raise ValueError(f"OpenAIEndpointConfig.api_key (a {type(key).__name__} of length "
                             f"{len(key) if isinstance(key, str) else '?'}, not shown) must be a non-empty string of "
                             "visible ASCII characters without spaces, or None")
        names = self.allowed_hosts
        if not isinstance(names, tuple) or not all(isinstance(name, str) and name and name.isascii()
                                                   and not any(c in name for c in " /:[]@") for name in names):
            raise ValueError(f"OpenAIEndpointConfig.allowed_hosts={names!r:.200}; must be a tuple of host names "
                             "(e.g. ('trainer-0.cluster',)), without ports or schemes")


@dataclass(frozen=True, kw_only=True)
class ChatRecord:
    """One choice of one chat-completions request, as the engine produced it.

    Attributes:
        session_id: the caller's session (trajectory) id.
        turn_index: the request's position among its session's requests (0-based, in order of completion).
        choice_index: which of the request's ``n`` choices.
        request_id: the ``id`` of the answer (``chatcmpl-...``), shared by the ``n`` choices.
        messages: the request's messages (after validation), for logging and rewards.
        prompt_token_ids: ``[P]`` int64, the chat-templated prompt exactly as the engine saw it.
        response_token_ids: ``[R]`` int64, the sampled tokens (cut after the token completing a stop string, if one
            was hit; a stop or EOS token that ended the sample is included).
        response_logprobs: ``[R]`` float32, the engine's log-prob of each sampled token, ``log_softmax(logits /
            temperature)`` (see :mod:`rlhfkit.engines.protocol`).
        finish_reason: ``"stop"`` or ``"length"`` (``"abort"`` if the engine aborted).
        temperature: the request's temperature (the trainer needs it to reproduce the log-probs; at 0, greedy, the
            log-probs are the raw model's, as at temperature 1).
        weight_version: the engine's weight version when it sampled.
        content: the assistant text returned to the caller.
        tools: the request's ``tools`` (rendered into the prompt by the chat template), None if it gave none.
    """

    session_id: str
    turn_index: int
    choice_index: int
    request_id: str
    messages: list[dict[str, Any]]
    prompt_token_ids: torch.Tensor
    response_token_ids: torch.Tensor
    response_logprobs: torch.Tensor
    finish_reason: Literal["stop", "length", "abort"]
    temperature: float
    weight_version: int
    content: str
    tools: list[Any] | None = None

    def to_rollout(self, *, prompt_index: int = 0, sample_index: int | None = None,
                   label: str | None = None) -> Rollout:
        """This turn as a :class:`~rlhfkit.types.Rollout` (``sample_index`` defaults to ``turn_index``)."""
        return Rollout(prompt_token_ids=self.prompt_token_ids, response_token_ids=self.response_token_ids,
                       response_logprobs=self.response_logprobs, finish_reason=self.finish_reason,
                       prompt_index=prompt_index, weight_version=self.weight_version, response_text=self.content,
                       sample_index=self.turn_index if sample_index is None else sample_index, label=label)


def records_to_rollouts(records: Sequence[ChatRecord], *, prompt_index: int = 0,
                        label: str | None = None) -> list[Rollout]:
    """One Rollout per record, in order, all with ``prompt_index`` and ``sample_index`` = position in ``records``:
    the per-turn form of a conversation (per-turn losses). Each turn has its own prompt, so GRPO-style group
    estimators refuse them as one group; for that, one conversation is one sample: :func:`session_to_rollout`."""
    for index, record in enumerate(records):
        if not isinstance(record, ChatRecord):
            raise TypeError(f"records_to_rollouts: records[{index}] is {type(record).__name__}, not a ChatRecord")
    return [record.to_rollout(prompt_index=prompt_index, sample_index=index, label=label)
            for index, record in enumerate(records)]


def session_to_rollout(records: Sequence[ChatRecord], *, prompt_index: int = 0, sample_index: int = 0,
                       label: str | None = None) -> Rollout:
    """A whole conversation as one multi-turn :class:`~rlhfkit.types.Rollout` (one sample of a GRPO group).

    ``records``: one session's records in turn order, one choice per request. The rollout's prompt is the first
    request's; its response is every sampled response, each followed by the tokens the next request added (tool
    results, the next user message; loss weight 0, log-prob 0, the previous turn's weight version). Each request's
    prompt must begin with the previous prompt and response token for token: an agent that edits earlier messages, or
    a chat template that renders an answer differently from how it was sampled, is a ``ValueError`` naming the turn
    (training on re-tokenised text would not be training on what was sampled).
    """
    if not records:
        raise ValueError("session_to_rollout: no records")
    for index, record in enumerate(records):
        if not isinstance(record, ChatRecord):
            raise TypeError(f"session_to_rollout: records[{index}] is {type(record).__name__}, not a ChatRecord")
        if record.choice_index != 0 or record.session_id != records[0].session_id:
            raise ValueError(f"session_to_rollout: records[{index}] is choice {record.choice_index} of session "
                             f"{record.session_id!r}; pass one session's records with one choice per request (n=1)")
    ids, logprobs, mask, versions = [], [], [], []
    context = records[0].prompt_token_ids.tolist()
    for index, record in enumerate(records):
        prompt = record.prompt_token_ids.tolist()
        if prompt[:len(context)] != context:
            at = next((i for i, (a, b) in enumerate(zip(prompt, context, strict=False)) if a != b),
                      min(len(prompt), len(context)))
            raise ValueError(f"session_to_rollout: turn {record.turn_index} (records[{index}]) of session "
                             f"{record.session_id!r} does not continue the conversation token for token: its prompt "
                             f"differs from the previous prompt + response at token {at}")
        observation = prompt[len(context):]
        response = record.response_token_ids.tolist()
        previous = versions[-1] if versions else record.weight_version
        ids += observation + response
        logprobs += [0.0] * len(observation) + record.response_logprobs.float().tolist()
        mask += [False] * len(observation) + [True] * len(response)
        versions += [previous] * len(observation) + [record.weight_version] * len(response)
        context = prompt + response
    return Rollout(prompt_token_ids=records[0].prompt_token_ids, response_token_ids=torch.tensor(ids, dtype=torch.long),
                   response_logprobs=torch.tensor(logprobs, dtype=torch.float32),
                   response_loss_mask=torch.tensor(mask, dtype=torch.bool),
                   response_weight_versions=torch.tensor(versions, dtype=torch.long),
                   weight_version=min(r.weight_version for r in records), finish_reason=records[-1].finish_reason,
                   prompt_index=prompt_index, sample_index=sample_index, label=label,
                   response_text=records[-1].content)


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
