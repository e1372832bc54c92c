"""OpenAI's Responses API request (``POST /v1/responses``): the body's pydantic model, its input
items as chat messages, and its translation onto the chat completions request path.

Why a translation and not a path of its own: a Responses request asks for what a chat request
asks for (a conversation, tools, a tool choice, a structured output, sampling), in other words.
Turned into an ``oai.ChatCompletionRequest`` it reaches the same ``generate_reqs``, tool plan,
constrained tool calls, structured outputs and output parsers (tool calls, reasoning), so that
both APIs serve one behaviour. The replies are tokenizer_proc/responses_reply.py; the stored
responses behind ``previous_response_id``, tokenizer_proc/response_store.py.

The input items map onto the chat template's messages:

- a message (``{role, content}``; ``type: message`` optional) is a message of that role, its
  content parts' text joined (``developer`` is ``system``: the templates know no other);
- ``function_call`` items become the ``tool_calls`` of an assistant message (of the assistant
  message right before them, when there is one), ``function_call_output`` items ``tool`` messages;
- ``reasoning`` items are dropped (a template shows no earlier turn's thinking);
- anything else (images, files, other tools' calls) is refused naming the field.

``instructions`` is a system message before them all; with ``previous_response_id`` the earlier
response's input and output items come first, but not its instructions (OpenAI's rule).

Validation errors name the field as this API calls it (``input[2].content[0]``,
``max_output_tokens``, ``text.format``, ``tools[0].name``), never as the chat request does.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, ClassVar, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.protocol.field_refs import FieldNames
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import loc_path

# Known Responses fields this server cannot honour: a 400 naming the field when given a value.
REFUSED: dict[str, str] = {
    "background": "background responses are not supported",
    "conversation": "the conversations API is not supported; send previous_response_id or the items",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses",
}
# The server's (and the chat request's) field names as this API calls them: refusals of the shared
# request path and of the chat translation are worded with these.
_NAMES = {
    "max_new_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "min_new_tokens": "min_tokens",
    "json_schema": "text.format",
    "response_format": "text.format",
    "messages": "input",
    "input_ids": "input",
}
_CHAT_NAME = re.compile(r"\b(max_completion_tokens|max_tokens|response_format|messages)\b|(tools\[\d+\])\.function\.")
_TEXT_PARTS = ("input_text", "output_text")
MessageRole = Literal["user", "assistant", "system", "developer"]


class _Item(BaseModel):
    """An input item or a part of one: strict types, other fields (``id``, ``status``,
    ``annotations``, ...) accepted and ignored, as the SDK sends back what a reply gave it."""

    model_config = ConfigDict(extra="ignore", strict=True)


class ContentPart(_Item):
    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part

    @property
    def as_text(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: MessageRole
    content: str | list[ContentPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.as_text for p in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.as_text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_MODELS: dict[str, type[_Item]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class FunctionTool(_Item):
    """A Responses function tool: the chat API's ``function`` fields, flat."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class FunctionChoice(_Item):
    type: Literal["function"]
    name: str


class TextFormat(_Item):
    """``text.format``: plain text, any JSON object, or JSON valid for a named schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise oai.BadRequest("text.format: type json_schema needs a schema", "text.format.schema")
        named = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in named.items() if v is not None}}


class TextConfig(_Item):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Item):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the older name of ``summary``


class ResponsesRequest(oai.LenientBody):
    """The body of ``POST /v1/responses`` (the fields the openai SDK's ``responses.create`` sends);
    unknown fields are ignored with a warning, ``REFUSED`` ones refused by name."""

    body_name: ClassVar[str] = "responses"
    refused: ClassVar[dict[str, str]] = REFUSED

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None  # Codex asks for reasoning.encrypted_content: there is none to give
    # SGLang / vLLM extensions (the SDK's extra_body), passed to the chat request as they are
    stop: str | list[str] | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    regex: str | None = None
    ebnf: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    priority: int = 0
    timeout: float | None = None
    deadline_s: float | None = None

    _EXTENSIONS: ClassVar[tuple[str, ...]] = (
        "stop",
        "seed",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "regex",
        "ebnf",
        "chat_template_kwargs",
        "timeout",
        "deadline_s",
    )

    # ------------------------------------------------------------------ items

    def input_items(self) -> list[dict[str, Any]]:
        """This request's own input as items (a string is one user message), each checked: what
        a stored response keeps and a later ``previous_response_id`` continues from."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            parse_item(item, f"input[{i}]")
        return list(self.input)

    def function_tools(self) -> list[FunctionTool]:
        out = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise oai.BadRequest(
                    f"tools[{i}].type: {kind!r} tools are not supported; only function tools", f"tools[{i}].type"
                )
            out.append(_validated(FunctionTool, tool, f"tools[{i}]"))
        return out

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function":
            raise oai.BadRequest(
                f"tool_choice: {choice.get('type')!r} is not supported; send auto, none, required "
                "or {type: function, name}",
                "tool_choice",
            )
        named = _validated(FunctionChoice, choice, "tool_choice")
        return {"type": "function", "function": {"name": named.name}}

    # ------------------------------------------------------------------ translation

    def chat_request(self, items: list[dict[str, Any]]) -> oai.ChatCompletionRequest:
        """The chat completions request this one asks for; ``items``: the whole conversation
        (a previous response's input and output, then this request's input)."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        messages += items_to_messages(items)
        if not messages:
            raise oai.BadRequest("input: the conversation is empty", "input")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
            "separate_reasoning": self.separate_reasoning,
            "priority": self.priority,
        }
        tools = self.function_tools()
        if tools:
            body["tools"] = [t.as_chat() for t in tools]
        body["tool_choice"] = self.chat_tool_choice()
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.as_chat()
        for name in self._EXTENSIONS:
            body[name] = getattr(self, name)
        with responses_errors():
            return oai.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})

    # ------------------------------------------------------------------ echoed in the reply

    def echoed(self) -> dict[str, Any]:
        """The request fields a Response object repeats (the SDK's ``Response`` requires some)."""
        reasoning = self.reasoning or ReasoningConfig()
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text is not None else {}
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary or reasoning.generate_summary},
            "store": self.store,
            "temperature": self.temperature,
            "text": {"format": {"type": "text"}, **text},
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "tools": list(self.tools or []),
            "top_p": self.top_p,
            "truncation": self.truncation or "disabled",
            "metadata": dict(self.metadata or {}),
            "user": self.user,
            "background": False,
        }


def parse_item(item: dict[str, Any], where: str) -> InputItem | None:
    """One input (or stored output) item checked; None for a reasoning item (dropped)."""
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "reasoning":
        return None
    model = _ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise oai.BadRequest(
            f"{where}.type: {kind!r} items are not supported; send message, function_call, "
            "function_call_output or reasoning items",
            f"{where}.type",
        )
    for field in ("content", "output"):
        parts = item.get(field)
        if isinstance(parts, list):
            for j, part in enumerate(parts):
                part_type = part.get("type") if isinstance(part, dict) else None
                if part_type not in (*_TEXT_PARTS, "refusal"):
                    raise oai.BadRequest(
                        f"{where}.{field}[{j}]: {part_type!r} parts are not supported; only text "
                        "(input_text, output_text)",
                        f"{where}.{field}[{j}]",
                    )
    parsed = _validated(model, item, where)
    assert isinstance(parsed, (MessageItem, FunctionCallItem, FunctionCallOutputItem))
    return parsed


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat template's messages of a conversation's items (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    calls_of: dict[str, Any] | None = None  # the assistant message the next function calls join
    for i, raw in enumerate(items):
        item = parse_item(raw, f"input[{i}]")
        if item is None:
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
            calls_of = messages[-1] if role == "assistant" else None
        elif isinstance(item, FunctionCallItem):
            if calls_of is None:
                calls_of = {"role": "assistant", "content": ""}
                messages.append(calls_of)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            calls_of.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            calls_of = None
    return messages


def _validated(model: type[_Item], data: Any, where: str) -> Any:
    """``data`` validated against ``model``; a mistake is a 400 naming its path under ``where``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        sub = loc_path(tuple(err.get("loc", ())))
        param = f"{where}.{sub}" if sub and not sub.startswith("[") else where + sub
        raise oai.BadRequest(f"{param}: {err.get('msg')}", param) from None


def responses_param(name: str) -> str:
    """A server or chat field as this API names it (``max_new_tokens`` -> ``max_output_tokens``)."""
    return _NAMES.get(name, name)


def responses_names() -> FieldNames:
    """How a refusal of the shared request path names this body's fields (``runtime.protocol.field_refs``)."""
    return lambda ref: responses_param(ref.name)


def _renamed(text: str) -> str:
    return _CHAT_NAME.sub(lambda m: _NAMES[m.group(1)] if m.group(1) else m.group(2) + ".", text)


@contextlib.contextmanager
def responses_errors() -> Iterator[None]:
    """Within: a refusal worded for the chat request (``max_completion_tokens``,
    ``tools[0].function.name``) is re-worded in this API's names (``max_output_tokens``, ``tools[0].name``)."""
    try:
        yield
    except oai.BadRequest as exc:
        param = None if exc.param is None else _renamed(exc.param)
        raise oai.BadRequest(_renamed(exc.message), param, exc.status, exc.code) from None
    except ValidationError as exc:  # the translation's own output, checked by the chat model
        err = exc.errors()[0]
        raise oai.BadRequest(f"{_renamed(str(err.get('loc')))}: {err.get('msg')}") from None
