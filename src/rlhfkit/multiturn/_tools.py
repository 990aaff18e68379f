"""Tools for :mod:`rlhfkit.multiturn` (private; re-exported there): a parser for tool calls, a tool-calling
environment over a dict of plain Python functions, and the built-in ``calculator`` tool. Needs only the standard
library.

Call format: the Hermes / Qwen / SmolLM2 convention, one JSON object per call between tags::

    <tool_call>{"name": "calculator", "arguments": {"expression": "23 * 45"}}</tool_call>

Malformed-call policy (:class:`ToolEnvironmentConfig.on_malformed`): a turn whose calls cannot be parsed (an unclosed
tag, invalid JSON, an unknown tool, arguments the tool's signature does not take) either gets an observation holding
the error message, so the model can try again (``"observe"``, the default), or ends the trajectory (``"end"``).
Either way the turn's :class:`StepResult` carries the message in ``malformed``. A tool that raises
:class:`ToolArgumentError` (the model's arguments are wrong, e.g. ``"2 +"``) also answers with an error observation;
any other exception from a tool is an environment failure: it propagates and fails the trajectory.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from rlhfkit._calls import resolve
from rlhfkit.multiturn._env import Action, Episode, StepResult

__all__ = [
    "MalformedToolCallError",
    "ToolArgumentError",
    "ToolCall",
    "ToolEnvironment",
    "ToolEnvironmentConfig",
    "calculator",
    "parse_tool_calls",
]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


class MalformedToolCallError(ValueError):
    """The text holds a tool call that cannot be parsed or does not fit any tool."""


class ToolArgumentError(ValueError):
    """Raised by a tool whose arguments are wrong; the message goes back to the model as an observation."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


def parse_tool_calls(text: str, tools: Mapping[str, Callable]) -> list[ToolCall]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` calls in ``text``, in order ([] if none).

    Raises :class:`MalformedToolCallError` naming the call (its position) and what is wrong: an unclosed tag,
    invalid JSON, a missing or unknown ``name``, ``arguments`` that are not an object or that ``tools[name]``'s
    signature does not accept."""
    bodies = _CALL.findall(text)
    if text.count(_OPEN) != len(bodies):
        raise MalformedToolCallError(f"{text.count(_OPEN)} {_OPEN} tag(s) but {len(bodies)} closed by </tool_call>")
    calls = []
    for position, body in enumerate(bodies):
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as error:
            raise MalformedToolCallError(f"tool call {position} is not valid JSON ({error.msg} at character "
                                         f"{error.pos}): {body.strip()[:80]!r}") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            raise MalformedToolCallError(f"tool call {position} must be a JSON object with a string \"name\", got "
                                         f"{body.strip()[:80]!r}")
        name, arguments = payload["name"], payload.get("arguments", {})
        if name not in tools:
            raise MalformedToolCallError(f"tool call {position} names the unknown tool {name!r}; tools: "
                                         f"{sorted(tools)}")
        if not isinstance(arguments, dict):
            raise MalformedToolCallError(f"tool call {position} ({name}): \"arguments\" must be a JSON object, got "
                                         f"{type(arguments).__name__}")
        try:
            inspect.signature(tools[name]).bind(**arguments)
        except TypeError as error:
            raise MalformedToolCallError(f"tool call {position} ({name}): {error}") from None
        calls.append(ToolCall(name, arguments))
    return calls


@dataclass(frozen=True, kw_only=True)
class ToolEnvironmentConfig:
    """How a :class:`ToolEnvironment` answers.

    Attributes:
        observation_template: text of one tool result with a ``{result}`` field. It should close the model's turn
            and open the next one in the model's chat format, e.g. for ChatML
            ``"<|im_start|>user\\n<tool_response>{result}</tool_response><|im_end|>\\n<|im_start|>assistant\\n"``.
        on_malformed: ``"observe"`` (answer with ``error_template``, the model may retry) or ``"end"`` (end the
            trajectory; its end reason is ``"malformed_call"``).
        error_template: the result text of a malformed call or a refused argument, with a ``{message}`` field.
        max_calls_per_turn: calls of one turn beyond this are not run (the observation says so).
    """

    observation_template: str = "\n<tool_response>{result}</tool_response>\n"
    on_malformed: Literal["observe", "end"] = "observe"
    error_template: str = "error: {message}"
    max_calls_per_turn: int = 4

    def __post_init__(self) -> None:
        if "{result}" not in self.observation_template:
            raise ValueError(f"ToolEnvironmentConfig.observation_template={self.observation_template!r} lacks the "
                             "{result} field")
        if "{message}" not in self.error_template:
            raise ValueError(f"ToolEnvironmentConfig.error_template={self.error_template!r} lacks the {{message}} "
                             "field")
        if self.on_malformed not in ("observe", "end"):
            raise ValueError(f"ToolEnvironmentConfig.on_malformed={self.on_malformed!r}; choose 'observe' or 'end'")
        if isinstance(self.max_calls_per_turn, bool) or not isinstance(self.max_calls_per_turn, int) \
                or self.max_calls_per_turn < 1:
            raise ValueError(f"ToolEnvironmentConfig.max_calls_per_turn={self.max_calls_per_turn!r}; must be an "
                             "int >= 1")


class ToolEnvironment:
    """An :class:`~rlhfkit.multiturn.Environment` over plain Python tools: each turn's tool calls are parsed and
    run, their results become the observation; a turn without a tool call is the final answer (``done``).

    Args:
        tools: name -> function taking keyword arguments and returning something ``str()`` can show; ``def`` or
            ``async def``. Functions are shared by the concurrent trajectories: keep them thread-safe.
        config: templates and the malformed-call policy.
    """

    def __init__(self, tools: Mapping[str, Callable], config: ToolEnvironmentConfig | None = None) -> None:
        if not isinstance(tools, Mapping) or not tools:
            raise ValueError(f"ToolEnvironment(tools={tools!r}); pass a non-empty dict of name -> function")
        for name, tool in tools.items():
            if not isinstance(name, str) or not callable(tool):
                raise TypeError(f"ToolEnvironment: tools[{name!r}]={tool!r}; names are strings, tools callables")
        self.tools = dict(tools)
        self.config = config or ToolEnvironmentConfig()

    def reset(self, episode: Episode) -> None:
        """Tools keep no per-conversation state."""

    def _error(self, message: str) -> str:
        return self.config.observation_template.format(result=self.config.error_template.format(message=message))

    def step(self, action: Action) -> StepResult:
        try:
            calls = parse_tool_calls(action.text, self.tools)
        except MalformedToolCallError as error:
            if self.config.on_malformed == "end":
                return StepResult(done=True, malformed=str(error))
            return StepResult(observation=self._error(str(error)), malformed=str(error))
        if not calls:
            return StepResult(done=True)
        results, errors = [], 0
        for call in calls[:self.config.max_calls_per_turn]:
            try:
                value = resolve(self.tools[call.name](**call.arguments))
                results.append(self.config.observation_template.format(result=value))
            except ToolArgumentError as error:  # the model's arguments: tell it, it may fix them
                errors += 1
                results.append(self._error(str(error)))
        if len(calls) > self.config.max_calls_per_turn:
            results.append(self._error(f"only {self.config.max_calls_per_turn} tool calls run per turn; "
                                       f"{len(calls) - self.config.max_calls_per_turn} skipped"))
        return StepResult(observation="".join(results), num_tool_calls=len(calls), num_tool_errors=errors)


_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
_LIMIT = 10**30


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        value = _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
        if abs(value) > _LIMIT:
            raise ToolArgumentError(f"the result exceeds {_LIMIT:.0e}")
        return value
    raise ToolArgumentError(f"unsupported expression {ast.unparse(node)!r}; use integers, + - * and parentheses")


def calculator(expression: str) -> str:
    """The built-in tool: the value of an integer expression with ``+``, ``-``, ``*`` and parentheses, as text.
    Raises :class:`ToolArgumentError` for anything else (never evaluates Python)."""
    if not isinstance(expression, str) or len(expression) > 200:
        raise ToolArgumentError(f"expression must be a string of at most 200 characters, got {expression!r:.80}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolArgumentError(f"cannot parse {expression!r}; write e.g. '23 * 45'") from None
    return str(_evaluate(tree.body))
