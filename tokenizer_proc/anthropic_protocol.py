"""Anthropic's Messages API requests (``POST /v1/messages``, ``/v1/messages/count_tokens``): pydantic
models and their translation onto the OpenAI chat request (tokenizer_proc/openai_protocol.py), whose
``generate_reqs``, tool plans and output parsers then serve it. The replies are
tokenizer_proc/anthropic_reply.py.

Why a translation and not a second request path: Anthropic's body says the same things as OpenAI's
in other words (``system`` is a system message, a ``tool_use`` block an assistant ``tool_calls`` entry,
a ``tool_result`` block a ``tool`` message, ``tool_choice`` ``any`` is ``required``), so tools,
constrained calls, reasoning and sampling behave exactly as on ``/v1/chat/completions``.

What the translation does beyond renaming:

* content blocks: ``text`` blocks of one message are joined with newlines; an assistant's
  ``thinking`` blocks become its ``reasoning_content`` (what Qwen's templates read), its
  ``redacted_thinking`` blocks are dropped (nothing here can read them); a ``tool_result``'s content
  (a string or text blocks) becomes a ``tool`` message with ``tool_call_id``, the tool's ``name``
  when an earlier ``tool_use`` gave it, and ``is_error`` when set. Images, documents and the
  server-side tools' blocks are refused naming the block (``messages[0].content[1]``): this server
  reads text.
* consecutive turns of one role are one turn, as Anthropic combines them (chat templates that
  insist on alternating roles would refuse them otherwise).
* a final assistant message (Anthropic's prefill: the reply continues it) is refused: a chat
  template closes that turn and opens a new one, so the reply would not continue it.
* ``thinking`` enabled or adaptive turns the template's ``enable_thinking`` on, disabled off;
  ``--reasoning-parser`` then splits the reply's thinking into ``thinking`` blocks. The budget is
  accepted, not enforced: the thinking is bounded by ``max_tokens`` only.
* ``model`` is any name (Claude Code sends its own model ids); the reply names the served model.

Validation errors name the field as Anthropic's body calls it: a block is checked where it sits
(``messages[2].content[0].input``), a refusal of the shared request path is worded through
``anthropic_names`` (``stop_sequences`` for the server's ``stop``), and the OpenAI wording of the
tool checks is reworded (``anthropic_wording``).
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any, ClassVar, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.protocol.field_refs import FieldRef
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import loc_path

# The server's field names as Anthropic's body calls them (a refusal of the shared path names these).
_ANTHROPIC_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop": "stop_sequences",
    "json_schema": "output_config.format",
    "prompt": "messages",
    "input_ids": "messages",
}
# The OpenAI words of the shared tool checks (openai_tools.plan_tools, ChatCompletionRequest) in
# Anthropic's: the checks are the same, the names differ.
_REWORDINGS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
    (re.compile(r"\bresponse_format\b"), "output_config.format"),
    (re.compile(r"'required' or a named function"), "'any' or a named tool"),
    (re.compile(r"tool_choice 'required'"), "tool_choice 'any'"),
    (re.compile(r"tool_choice function '"), "tool_choice tool '"),
    (re.compile(r"function '([^']*)' is not among the tools"), r"tool '\1' is not among the tools"),
)
REFUSED: dict[str, str] = {
    "mcp_servers": "MCP connectors are not supported; give the tools as custom tools",
    "container": "containers (code execution) are not supported",
}
# What each place takes (a block of another type is refused naming its type and place).
_READ = (
    "this server reads text: a user turn takes text and tool_result blocks, an assistant turn "
    "text, thinking and tool_use blocks, a system prompt and a tool result text blocks"
)


def anthropic_names(ref: FieldRef) -> str:
    """How a refusal of the shared request path names a field of an Anthropic body
    (``request.state.field_names``: ``max_tokens`` for the server's ``max_new_tokens``, ...)."""
    return _ANTHROPIC_NAMES.get(ref.name, ref.name)


def reword(text: str) -> str:
    """An OpenAI-worded refusal of the tool checks in Anthropic's names."""
    for pattern, replacement in _REWORDINGS:
        text = pattern.sub(replacement, text)
    return text


@contextlib.contextmanager
def anthropic_wording() -> Iterator[None]:
    """Around the shared OpenAI translation (tool plan, ``generate_reqs``): its refusals name the
    fields as Anthropic's body does."""
    try:
        yield
    except oai.BadRequest as exc:
        param = reword(exc.param) if exc.param is not None else None
        raise oai.BadRequest(reword(exc.message), param, exc.status, exc.code) from None


# --------------------------------------------------------------------------- the body's parts


class _Part(BaseModel):
    """A part of the body, checked where it sits (``_parse``): strict types; fields it does not
    read (``cache_control``, ``citations``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Part):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Part):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Part):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class ThinkingBlock(_Part):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolDefinition(_Part):
    """A custom tool (the only kind this server runs: the server tools are Anthropic's own)."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoiceBody(_Part):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Part):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(_Part):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Part):
    format: OutputFormat | None = None
    effort: str | None = None  # accepted: how hard to think is the model's own matter here


def _parse(model: type[_Part], value: Any, where: str) -> Any:
    """``value`` validated as ``model``; a 400 naming the field under ``where`` when it is not one."""
    if not isinstance(value, dict):
        raise oai.BadRequest(f"{where}: must be an object", where)
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        inner = loc_path(err.get("loc", ()))
        path = where + ("" if not inner else inner if inner.startswith("[") else "." + inner)
        raise oai.BadRequest(f"{path}: {err.get('msg')}", path) from None


class Message(_Part):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


# --------------------------------------------------------------------------- messages


class _Turns:
    """The OpenAI-style messages of a conversation, consecutive turns of one role joined."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.tool_names: dict[str, str] = {}  # tool_use id -> the tool's name (a tool message may carry it)

    def add(self, message: dict[str, Any]) -> None:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != message["role"] or message["role"] == "tool":
            self.messages.append(message)
            return
        for key, joiner in (("content", "\n"), ("reasoning_content", "\n")):
            parts = [m[key] for m in (last, message) if m.get(key)]
            if parts:
                last[key] = joiner.join(parts)
        if message.get("tool_calls"):
            last["tool_calls"] = [*last.get("tool_calls", []), *message["tool_calls"]]

    def add_anthropic(self, i: int, message: Message) -> None:
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            self.add({"role": message.role, "content": message.content})
            return
        if not message.content:
            raise oai.BadRequest(f"{where}: must not be empty", where)
        if message.role == "assistant":
            self._assistant(message.content, where)
        else:
            self._user(message.role, message.content, where)

    def _user(self, role: str, blocks: list[dict[str, Any]], where: str) -> None:
        """Text blocks are the turn's text; each tool_result is a ``tool`` message, in order."""
        text: list[str] = []
        for j, raw in enumerate(blocks):
            kind = _kind(raw, f"{where}[{j}]")
            if kind == "text":
                text.append(_parse(TextBlock, raw, f"{where}[{j}]").text)
            elif kind == "tool_result" and role == "user":
                if text:
                    self.add({"role": role, "content": "\n".join(text)})
                    text = []
                self.add(self._tool_message(_parse(ToolResultBlock, raw, f"{where}[{j}]"), f"{where}[{j}].content"))
            else:
                raise _unsupported(kind, f"{where}[{j}]")
        if text:
            self.add({"role": role, "content": "\n".join(text)})

    def _tool_message(self, block: ToolResultBlock, where: str) -> dict[str, Any]:
        content = block.content
        if isinstance(content, list):
            parts = []
            for k, raw in enumerate(content):
                kind = _kind(raw, f"{where}[{k}]")
                if kind != "text":
                    raise _unsupported(kind, f"{where}[{k}]")
                parts.append(_parse(TextBlock, raw, f"{where}[{k}]").text)
            content = "\n".join(parts)
        message: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
        name = self.tool_names.get(block.tool_use_id)
        if name is not None:
            message["name"] = name
        if block.is_error:
            message["is_error"] = True
        return message

    def _assistant(self, blocks: list[dict[str, Any]], where: str) -> None:
        """Text, thinking and tool_use blocks: one assistant message with content, reasoning_content
        and tool_calls (their arguments as JSON text, as OpenAI's body has them)."""
        text: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, raw in enumerate(blocks):
            kind = _kind(raw, f"{where}[{j}]")
            if kind == "text":
                text.append(_parse(TextBlock, raw, f"{where}[{j}]").text)
            elif kind == "thinking":
                thinking.append(_parse(ThinkingBlock, raw, f"{where}[{j}]").thinking)
            elif kind == "redacted_thinking":
                continue  # encrypted by Anthropic for its own models: nothing here can read it
            elif kind == "tool_use":
                block = _parse(ToolUseBlock, raw, f"{where}[{j}]")
                self.tool_names[block.id] = block.name
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)},
                    }
                )
            else:
                raise _unsupported(kind, f"{where}[{j}]")
        message: dict[str, Any] = {"role": "assistant", "content": "\n".join(text)}
        if thinking:
            message["reasoning_content"] = "\n".join(thinking)
        if calls:
            message["tool_calls"] = calls
        self.add(message)


def _kind(raw: Any, where: str) -> str:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str):
        raise oai.BadRequest(f"{where}: a content block is an object with a string type", where)
    return kind


def _unsupported(kind: str, where: str) -> oai.BadRequest:
    return oai.BadRequest(f"{where}: {kind} blocks are not supported here ({_READ})", where)


def _text_of(value: str | list[dict[str, Any]], where: str) -> str:
    """A string, or text blocks joined (``system``)."""
    if isinstance(value, str):
        return value
    return "\n".join(_parse(TextBlock, raw, f"{where}[{k}]").text for k, raw in enumerate(value))


# --------------------------------------------------------------------------- the bodies


class CountTokensRequest(oai.LenientBody):
    """``POST /v1/messages/count_tokens``: what shapes the prompt (messages, system, tools, thinking),
    checked as ``/v1/messages`` checks it."""

    body_name = "anthropic messages"
    refused: ClassVar[dict[str, str]] = REFUSED
    model: str
    messages: list[Message]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's name for output_config.format
    chat_template_kwargs: dict[str, Any] | None = None  # SGLang's extension, as on /v1/chat/completions
    # accepted and ignored
    metadata: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # the prefix cache is automatic here
    service_tier: str | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI-style messages for the chat template."""
        turns = _Turns()
        if self.system is not None:
            turns.add({"role": "system", "content": _text_of(self.system, "system")})
        for i, message in enumerate(self.messages):
            turns.add_anthropic(i, message)
        if self.messages and self.messages[-1].role == "assistant":
            last = f"messages[{len(self.messages) - 1}]"
            raise oai.BadRequest(
                f"{last}: a final assistant message (prefill) is not supported: "
                "the chat template would close that turn, and the reply start a new one",
                last,
            )
        return turns.messages

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``thinking`` as the template's ``enable_thinking``."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            thinking: ThinkingConfig = _parse(ThinkingConfig, self.thinking, "thinking")
            if thinking.type == "enabled" and (thinking.budget_tokens is None or thinking.budget_tokens < 1):
                raise oai.BadRequest(
                    "thinking.budget_tokens: a positive number of tokens is required with type 'enabled'",
                    "thinking.budget_tokens",
                )
            kwargs["enable_thinking"] = thinking.type != "disabled"
        return kwargs or None

    def tool_fields(self) -> dict[str, Any]:
        """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI's body has them."""
        fields: dict[str, Any] = {}
        if self.tools is not None:
            fields["tools"] = [_function(i, raw) for i, raw in enumerate(self.tools)]
        if self.tool_choice is not None:
            choice: ToolChoiceBody = _parse(ToolChoiceBody, self.tool_choice, "tool_choice")
            if choice.type == "tool":
                if choice.name is None:
                    raise oai.BadRequest("tool_choice.name: required with type 'tool'", "tool_choice.name")
                fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                fields["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields

    def response_format(self) -> dict[str, Any] | None:
        """``output_config.format`` (or the beta's ``output_format``) as OpenAI's ``response_format``."""
        fmt: OutputFormat | None = None
        if self.output_config is not None:
            fmt = _parse(OutputConfig, self.output_config, "output_config").format
        if fmt is None and self.output_format is not None:
            fmt = _parse(OutputFormat, self.output_format, "output_format")
        if fmt is None:
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}

    def openai_fields(self) -> dict[str, Any]:
        """The OpenAI chat body's fields of this request (sampling comes with ``MessagesRequest``)."""
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            **self.tool_fields(),
            "chat_template_kwargs": self.template_kwargs(),
            "response_format": self.response_format(),
        }
        return fields

    def chat_request(self) -> oai.ChatCompletionRequest:
        """The OpenAI chat request this body asks for (its errors in Anthropic's names; wrap its
        tool plan and ``generate_reqs`` in ``anthropic_wording``)."""
        fields = {k: v for k, v in self.openai_fields().items() if v is not None}
        return oai.ChatCompletionRequest.model_validate(fields)


def _function(i: int, raw: Any) -> dict[str, Any]:
    """A custom tool as an OpenAI function; a server tool (``web_search_...``, ``bash_...``) is refused."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in (None, "custom"):
        raise oai.BadRequest(
            f"tools[{i}].type: the server tool {kind!r} is not supported; "
            "give custom tools (name, description, input_schema)",
            f"tools[{i}].type",
        )
    tool: ToolDefinition = _parse(ToolDefinition, raw, f"tools[{i}]")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. Sampling fields the body leaves out get the model's defaults (today's
    anthropic SDK sends no ``temperature``, ``top_p`` or ``top_k``); those it carries are obeyed.
    SGLang's extensions of the OpenAI routes are taken here too (``regex``, ``seed``, ...)."""

    max_tokens: int
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    # SGLang / vLLM extensions, as on /v1/chat/completions
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    regex: str | None = None
    ebnf: str | None = None
    priority: int = 0
    timeout: float | None = None
    deadline_s: float | None = None

    _PASSED: ClassVar[tuple[str, ...]] = (
        "max_tokens",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
        "regex",
        "ebnf",
        "priority",
        "timeout",
        "deadline_s",
    )

    def openai_fields(self) -> dict[str, Any]:
        fields = super().openai_fields()
        fields.update({name: getattr(self, name) for name in self._PASSED})
        fields["stop"] = self.stop_sequences or None
        return fields
