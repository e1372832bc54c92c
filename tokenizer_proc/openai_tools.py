"""OpenAI tool calling on /v1/chat/completions: the ``tools`` / ``tool_choice`` request fields,
what they ask of generation, and the calls read back from the output.

``tool_choice`` decides how calls are found:
- ``none``: the tools reach the chat template (the model knows them) but the output is text.
- ``auto`` (the default when tools are given): the model decides; ``--tool-call-parser``
  reads its calls out of the text in the model's own format (runtime/text/parsers).
- ``required`` or a named function: decoding is constrained with the structured-output
  machinery, so even a small model that never saw the tool format emits a well-formed call.
  The constrained output *is* the call, so no parser and no template support are needed:
  ``required`` generates a JSON array of ``{"name", "arguments"}`` objects (one of the
  offered tools each, at most one unless ``parallel_tool_calls``), a named function its
  arguments object, valid against the function's ``parameters`` schema.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from runtime.text.parsers import TOOL_CALL_PARSERS, ToolCall

logger = logging.getLogger(__name__)

# OpenAI's rule for function names (they become identifiers in the model's prompt).
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function without ``parameters`` takes any object (OpenAI: "omitting parameters defines a
# function with an empty parameter list"; an object keeps the output valid JSON either way).
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
ToolMode = Literal["none", "parse", "required", "named"]


class _ToolModel(BaseModel):
    # Same policy as the request models: strict types, unknown fields ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_ToolModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the output follows the schema whenever decoding is constrained


class Tool(_ToolModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_ToolModel):
    name: str


class NamedToolChoice(_ToolModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolError(Exception):
    """A tools request the server refuses (HTTP 400 naming ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools ask for: the template's tools, the decoding constraint,
    and how the reply's calls are read back."""

    mode: ToolMode
    template_tools: list[dict[str, Any]] | None  # handed to apply_chat_template(tools=...)
    names: tuple[str, ...]  # the offered functions (a parsed call to another name is text)
    constraint: dict[str, Any]  # sampling params ({} unless required / named)
    named: str | None = None  # the function a named tool_choice forces
    # The parser's markers are special tokens (Mistral's [TOOL_CALLS]): the text must keep them.
    keep_special_tokens: bool = False


def plan_tools(
    tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool, parser: str | None
) -> ToolPlan:
    """Check the tools and choice against each other and the server's ``--tool-call-parser``."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ToolError("tool_choice needs tools", "tool_choice")
        return ToolPlan("none", None, (), {})
    names = tuple(t.function.name for t in tools)
    for i, name in enumerate(names):
        if not _FUNCTION_NAME.fullmatch(name):
            raise ToolError(
                f"tools[{i}].function.name: {name!r} must be 1-64 letters, digits, '_' or '-'",
                f"tools[{i}].function.name",
            )
    if len(set(names)) != len(names):
        raise ToolError("tools: function names must be unique", "tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise ToolError(
                f"tool_choice: function {name!r} is not among the tools ({', '.join(names)})", "tool_choice"
            )
        schema = _parameters(tools[names.index(name)])
        return ToolPlan("named", template_tools, names, {"json_schema": json.dumps(schema)}, named=name)
    if choice == "required":
        return ToolPlan(
            "required", template_tools, names, {"json_schema": json.dumps(_calls_schema(tools, parallel_tool_calls))}
        )
    if choice == "none":
        return ToolPlan("none", template_tools, names, {})
    if parser is None:
        if tool_choice is not None:  # asked for explicitly: say why it cannot work
            raise ToolError(
                "tool_choice 'auto' needs the server started with --tool-call-parser; "
                "'required' or a named function work on any server",
                "tool_choice",
            )
        _warn_once(
            "tools were given without tool_choice and the server has no --tool-call-parser: "
            "the model's tool calls are returned as text"
        )
        return ToolPlan("none", template_tools, names, {})
    return ToolPlan(
        "parse", template_tools, names, {}, keep_special_tokens=not TOOL_CALL_PARSERS[parser].skip_special_tokens
    )


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each naming one offered tool with arguments valid for it."""
    one_call = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": one_call[0] if len(one_call) == 1 else {"anyOf": one_call},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def constrained_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls in the output of a constrained (required / named) request; None when the
    output is not a whole call (generation was cut short by max_tokens or an abort)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.mode == "named":
        assert plan.named is not None
        return [ToolCall(plan.named, _dumps(value))] if isinstance(value, dict) else None
    if not isinstance(value, list):
        return None
    calls = [
        ToolCall(c["name"], _dumps(c["arguments"]))
        for c in value
        if isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("arguments"), dict)
    ]
    return calls if calls and len(calls) == len(value) else None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def message_for_template(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` as chat templates read them: OpenAI sends each
    call's arguments as JSON text, the templates (Qwen, Llama 3, Mistral) expect an object."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function = {**function, "arguments": json.loads(function["arguments"])}
            except ValueError:
                pass  # not JSON: the template gets the text as sent
            call = {**call, "function": function}
        converted.append(call)
    return {**message, "tool_calls": converted}


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
