"""Chat-completions requests in, OpenAI-shaped answers and errors out: pure functions, no sockets (private; use
:mod:`rlhfkit.openai_endpoint`).

Every field that would change the sampled distribution and that the engines cannot honour (penalties, logit bias,
structured output, top log-probs) is refused with a 400 naming it, rather than ignored: the recorded log-probs must be
those of the distribution the tokens were drawn from. A body that is not strict JSON in UTF-8 (too deeply nested, an
integer of thousands of digits, NaN or Infinity, a lone surrogate) is a 400 naming the problem.
"""

from __future__ import annotations

import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["MESSAGE_ROLES", "ChatRequest", "EndpointError", "cut_at_stop", "decode_body", "error_body",
           "parse_chat_request", "single_token_stops"]

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
_MAX_STOP = 4
# Far beyond what a chat request (messages, tool schemas) needs; the walks over a body (json's, the template's,
# repr's) recurse, and Python's recursion limit is about 1000.
MAX_JSON_DEPTH = 64
# A seed is at most 19 digits; int() of a longer digit string costs quadratic time (Python refuses 4300+ digits).
_MAX_INT_DIGITS = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
# Accepted only at their neutral value: anything else changes the distribution in a way the engines do not implement.
_NEUTRAL = {"presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {}),
            "top_logprobs": (None, 0), "stream": (None, False), "response_format": (None, {"type": "text"})}
_WHY = {"stream": "this endpoint answers non-streaming requests only; send stream=false",
        "top_logprobs": "the engines return the sampled token's log-prob only; use logprobs=true",
        "response_format": "structured output is not implemented; ask for the format in the messages"}


class EndpointError(Exception):
    """A request the endpoint answers with an OpenAI-style error: ``status`` (HTTP), ``type``, ``param``, ``code``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    @property
    def message(self) -> str:
        return str(self.args[0])


def error_body(error: EndpointError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def _bad(param: str, message: str, code: str | None = None) -> EndpointError:
    return EndpointError(400, f"{param}: {message}", param=param, code=code)


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise EndpointError(400, f"the request body holds an integer of {len(text.lstrip('-'))} digits "
                            f"({text[:20]}...); numbers have at most {_MAX_INT_DIGITS} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise EndpointError(400, f"the request body holds the number {text[:40]!r}, which is not a finite float")
    return value


def _no_constant(name: str) -> Any:
    raise EndpointError(400, f"the request body holds {name}, which is not valid JSON (RFC 8259); send finite numbers")


def _path(path: tuple) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else (f".{part}" if index else part)
                   for index, part in enumerate(path)) or "the request body"


def _check_tree(value: Any) -> None:
    """Depth and valid Unicode of a decoded body, walked iteratively (a recursive walk is what deep nesting breaks)."""
    stack = [(value, ())]
    while stack:
        item, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise EndpointError(400, f"{_path(path[:3])}...: the request body is nested more than {MAX_JSON_DEPTH} "
                                "levels deep")
        if isinstance(item, str):
            surrogate = _SURROGATE.search(item)
            if surrogate is not None:
                where = _path(path)
                raise EndpointError(400, f"{where}: holds a lone surrogate (U+{ord(surrogate.group()):04X}); strings "
                                    "must be valid Unicode (send UTF-8 text, not an escaped half of a surrogate pair)",
                                    param=where if path else None)
        elif isinstance(item, dict):
            for key, child in item.items():
                stack += [(key, path), (child, (*path, key))]
        elif isinstance(item, list):
            stack += [(child, (*path, index)) for index, child in enumerate(item)]


def decode_body(body: bytes) -> Any:
    """A request body as strict JSON in UTF-8; raises :class:`EndpointError` (400) naming what is wrong with it."""
    try:
        text = body.decode("utf-8")   # strict: json.loads(bytes) would also take UTF-16/32 and encoded surrogates
    except UnicodeDecodeError as error:
        raise EndpointError(400, f"the request body is not UTF-8: {error}") from error
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError as error:
        raise EndpointError(400, f"the request body is nested too deeply (more than {MAX_JSON_DEPTH} levels "
                            "accepted)") from error
    except json.JSONDecodeError as error:
        raise EndpointError(400, f"the request body is not valid JSON: {error}") from error
    _check_tree(value)
    return value


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body (fields as in OpenAI's API)."""

    messages: list[dict[str, Any]]
    tools: list[Any] | None
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool
    return_token_ids: bool
    user: str | None


def _number(body: dict, name: str, default: float, low: float, high: float, *, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                          and not math.isfinite(value)):
        raise _bad(name, f"expected a number, got {value!r:.80}")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise _bad(name, f"{value!r:.80} is outside {interval}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        raise _bad(name, f"{value} is outside [{low}, {high if high is not None else 'inf'}]")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", f"expected a non-empty list of {{'role', 'content'}} objects, got {value!r:.80}")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise _bad(where, f"expected an object with 'role' and 'content', got {message!r:.80}")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise _bad(f"{where}.role", f"{role!r} is not one of {list(MESSAGE_ROLES)}")
        content = message.get("content")
        if isinstance(content, list):   # content parts: text only
            texts = []
            for part_index, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(f"{where}.content[{part_index}]", f"only {{'type': 'text', 'text': str}} parts are "
                               f"supported, got {part!r:.80}")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and not (role == "assistant" and message.get("tool_calls")):
            raise _bad(f"{where}.content", "missing; only an assistant message with tool_calls may omit it")
        elif content is not None and not isinstance(content, str):
            raise _bad(f"{where}.content", f"expected a string or a list of text parts, got {type(content).__name__}")
        messages.append({**message, "content": content})
    return messages


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > _MAX_STOP:
        raise _bad("stop", f"expected a non-empty string or a list of at most {_MAX_STOP} of them, got {value!r:.80}")
    return tuple(stops)


def parse_chat_request(body: Any, *, model_name: str, default_max_tokens: int, max_tokens_limit: int,
                       max_n: int) -> ChatRequest:
    """Validate a request body; raises :class:`EndpointError` (400, or 404 for an unknown model) naming the field."""
    if not isinstance(body, dict):
        raise EndpointError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise _bad(name, f"{body[name]!r:.80} is not supported: {_WHY.get(name, 'the engines do not implement it')}")
    model = body.get("model")
    if model is not None and model != model_name:
        raise EndpointError(404, f"model {model!r:.80} does not exist; this endpoint serves {model_name!r} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise _bad("max_tokens", "give max_tokens or max_completion_tokens, not both")
    limit_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", f"expected a list of tool definitions, got {type(tools).__name__}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"expected a string (the session id), got {type(user).__name__}")
    for name in ("logprobs", "return_token_ids"):
        if body.get(name) is not None and not isinstance(body.get(name), bool):
            raise _bad(name, f"expected true or false, got {body.get(name)!r:.80}")
    return ChatRequest(
        messages=_messages(body.get("messages")), tools=tools,
        n=_integer(body, "n", 1, 1, max_n),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=_integer(body, limit_name, default_max_tokens, 1, max_tokens_limit),
        stop=_stop(body.get("stop")), seed=_integer(body, "seed", None, 0, 2**63 - 1),
        logprobs=bool(body.get("logprobs")), return_token_ids=bool(body.get("return_token_ids")), user=user)


def single_token_stops(tokenizer: Any, stops: tuple[str, ...]) -> tuple[int, ...]:
    """Stop strings that are exactly one token: the engine can stop on them without decoding."""
    ids = []
    for stop in stops:
        encoded = tokenizer.encode(stop, add_special_tokens=False)
        if len(encoded) == 1 and tokenizer.decode(encoded) == stop:
            ids.append(operator.index(encoded[0]))
    return tuple(ids)


def cut_at_stop(tokenizer: Any, tokens: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
    """``(number of tokens to keep, content)`` when a stop string occurs in the decoded response, else None.

    The kept tokens end with the token that completes the earliest stop string (what the engine sampled, a prefix of
    it); the content ends just before the stop string, as OpenAI's does. Found by bisection over decoded prefixes
    (``O(log R)`` decodes)."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    if not found:
        return None
    start, stop = min(found)
    low, high = 1, len(tokens)   # the shortest prefix whose text holds the stop string
    while low < high:
        middle = (low + high) // 2
        if stop in tokenizer.decode(tokens[:middle], skip_special_tokens=True):
            high = middle
        else:
            low = middle + 1
    return low, text[:start]
