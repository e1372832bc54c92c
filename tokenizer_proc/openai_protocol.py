"""OpenAI's completions and chat completions requests: pydantic models and their translation
into the server's own ``GenerateReq`` (the replies are tokenizer_proc/openai_reply.py).

Types are validated strictly (a string is never a number) so that a client's mistake is
answered with a 400 that names the field, as OpenAI's own API does. Fields, though, are
lenient where OpenAI's clients need it: an unknown field is ignored with one warning log
line per field name (as SGLang and vLLM do: SDKs and agent frameworks add new fields
faster than servers learn them), while a known field the server cannot honour is a 400
naming it and why (``UNSUPPORTED``). Value ranges are not repeated here:
``SamplingParams.validate`` owns them, and ``openai_param`` maps the name it reports
(``max_new_tokens``) back to the one the client sent (``max_tokens``).

SGLang/vLLM extensions accepted in the body (the openai SDK's ``extra_body``): ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``no_stop_trim``, SGLang's constraints ``regex`` and ``ebnf``
(``response_format`` carries a JSON schema), and on chat ``chat_template_kwargs`` and
``separate_reasoning``. The server-side deadline is ``timeout`` (seconds; the SDK's own
``timeout=`` argument is client-side, so send it as ``extra_body={"timeout": ...}``) or its
unambiguous name ``deadline_s``, which wins when both are given.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.protocol.field_refs import FieldNames
from runtime.protocol.messages import GenerateReq
from tokenizer_proc.openai_tools import Tool, ToolChoice, ToolError, ToolPlan, message_for_template, plan_tools

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# What the server's names are called in the OpenAI schema (for error messages).
_OPENAI_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "input_ids": "prompt",
    "json_schema": "response_format",
}
# ``response_format: {"type": "json_object"}``: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Known OpenAI fields this server cannot honour: a 400 naming the field says why (a silent
# ignore would hand the client something other than what it asked for).
UNSUPPORTED: dict[str, str] = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "functions": "the deprecated functions field is not supported; send tools",
    "function_call": "the deprecated function_call field is not supported; send tool_choice",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (insertion) is not supported",
}
_warned_fields: set[tuple[str, str]] = set()  # (body, field name) pairs warned about


class BadRequest(Exception):
    """A request the HTTP layer refuses before it reaches the tokenizer manager."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str = "invalid_request"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


class LenientBody(BaseModel):
    """A request body strict about types and lenient about fields, as SGLang's and vLLM's servers are
    (SDKs, routers and agent frameworks add fields faster than servers learn them): a field it does
    not know is ignored with one warning per body and name; a known field it cannot honour
    (``refused``: name -> why) is a 400 naming it when given a value. The OpenAI bodies, SGLang's
    ``/generate`` body (tokenizer_proc/native_protocol.py) and its operational routes' bodies
    (tokenizer_proc/http/control_bodies.py) are all read this way."""

    model_config = ConfigDict(extra="allow", strict=True)
    body_name: ClassVar[str] = ""  # how the warning names the body (default: the class name)
    refused: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_given(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, why in cls.refused.items():
                if data.get(name) not in (None, False, "", [], {}) and name not in cls.model_fields:
                    raise BadRequest(f"{name}: {why}", name)
        return data

    @model_validator(mode="after")
    def _ignore_unknown(self) -> "LenientBody":
        body = self.body_name or type(self).__name__
        for name in self.model_extra or {}:
            if (body, name) not in _warned_fields:
                _warned_fields.add((body, name))
                logger.warning("ignoring the %s field %r that this server does not know (logged once)", body, name)
        return self


class _Fields(LenientBody):
    """An OpenAI body: ``UNSUPPORTED`` fields refused, and output other than text."""

    refused: ClassVar[dict[str, str]] = UNSUPPORTED

    @model_validator(mode="before")
    @classmethod
    def _refuse_other_modalities(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("modalities") not in (None, ["text"]):
            raise BadRequest("modalities: only text output is supported", "modalities")
        return data


class StreamOptions(_Fields):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class JsonSchemaFormat(_Fields):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted; the output
    always follows the schema)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> dict[str, Any]:
        """The sampling parameter this format asks for ({} for plain text)."""
        if self.type == "text":
            return {}
        if self.type == "json_object":
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise BadRequest("response_format: type json_schema needs json_schema.schema", "response_format")
        return {"json_schema": json.dumps(self.json_schema.schema_)}


class _SamplingFields(_Fields):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # accepted and ignored, as OpenAI's clients send them
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # SGLang / vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    priority: int = 0  # SGLang's extra field: larger first, with --enable-priority-scheduling
    # SGLang's extra field: the LoRA adapter (its loaded name); the route also reads it from model
    # "SERVED:ADAPTER" (HttpContext.adapter_of)
    lora_path: str | None = None
    # Server-side deadline in seconds from arrival (GenerateReq.deadline_s): aborted when it passes.
    timeout: float | None = None
    deadline_s: float | None = None

    @property
    def server_deadline_s(self) -> float | None:
        return self.deadline_s if self.deadline_s is not None else self.timeout

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
        params: dict[str, Any] = {"n": self.n}
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        if self.min_tokens is not None:
            params["min_new_tokens"] = self.min_tokens
        if self.response_format is not None:
            params.update(self.response_format.constraint())
        for name in (
            "temperature",
            "top_p",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "stop_token_ids",
            "regex",
            "ebnf",
            "logit_bias",
        ):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        for name in ("ignore_eos", "no_stop_trim"):
            if getattr(self, name):
                params[name] = True
        if not self.skip_special_tokens:
            params["skip_special_tokens"] = False
        return params

    @property
    def constrained(self) -> bool:
        """Whether decoding follows a grammar the client gave (response_format, regex, ebnf)."""
        text = self.response_format is None or self.response_format.type == "text"
        return not text or self.regex is not None or self.ebnf is not None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None

    def generate_reqs(self) -> list[GenerateReq]:
        """One GenerateReq per prompt (a list of prompts is a batch). ``echo`` with ``logprobs``
        asks for the prompt's own token logprobs too (lm-evaluation-harness's loglikelihood)."""
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest("best_of must equal n (best-of ranking is not supported)", "best_of")
        params = self.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens)
        top = self.logprobs or 0
        prompts: list[Any]
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            prompts = [self.prompt]
        else:
            prompts = list(self.prompt)
        if not prompts:
            raise BadRequest("prompt: empty list", "prompt")
        prompt_logprobs = self.echo and self.logprobs is not None
        return [
            GenerateReq(
                rid=uuid.uuid4().hex,
                sampling_params=params,
                stream=self.stream,
                return_logprob=self.logprobs is not None,
                top_logprobs_num=top,
                logprob_start_len=0 if prompt_logprobs else -1,
                deadline_s=self.server_deadline_s,
                priority=self.priority,
                lora_path=self.lora_path,
                **({"text": p} if isinstance(p, str) else {"input_ids": p}),
            )
            for p in prompts
        ]


class ContentPart(_Fields):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Messages may carry fields of their own (name, tool_call_id, tool_calls, ...): the chat template decides.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None

    def as_dict(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise BadRequest(
                    f"messages[{index}].content: only text parts are supported", f"messages[{index}].content"
                )
            content = "".join(p.text or "" for p in content)
        return message_for_template({**(self.model_extra or {}), "role": self.role, "content": content or ""})


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # SGLang's: with --reasoning-parser, thinking goes to reasoning_content

    def tool_plan(self, parser: str | None) -> ToolPlan:
        try:
            return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser)
        except ToolError as exc:
            raise BadRequest(exc.message, exc.param) from None

    @property
    def enable_thinking(self) -> bool:
        """What the template was told (Qwen3's ``enable_thinking``, on unless turned off)."""
        return (self.chat_template_kwargs or {}).get("enable_thinking", True) is not False

    def generate_reqs(self, tools: ToolPlan | None = None) -> list[GenerateReq]:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs=true", "top_logprobs")
        tools = tools if tools is not None else self.tool_plan(None)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self.sampling_params(max_tokens)
        if tools.constraint:
            given = [k for k in ("json_schema", "regex", "ebnf") if k in params]
            if given:
                raise BadRequest(
                    f"tool_choice {self.tool_choice_name} constrains the output; it cannot be "
                    f"combined with {openai_param(given[0], True)}",
                    "tool_choice",
                )
            params.update(tools.constraint)
        if tools.keep_special_tokens:
            params["skip_special_tokens"] = False
        messages = [m.as_dict(i) for i, m in enumerate(self.messages)]
        return [
            GenerateReq(
                rid=uuid.uuid4().hex,
                messages=messages,
                sampling_params=params,
                stream=self.stream,
                return_logprob=self.logprobs,
                top_logprobs_num=self.top_logprobs or 0,
                tools=tools.template_tools,
                chat_template_kwargs=self.chat_template_kwargs,
                deadline_s=self.server_deadline_s,
                priority=self.priority,
                lora_path=self.lora_path,
            )
        ]

    @property
    def tool_choice_name(self) -> str:
        choice = self.tool_choice
        return repr(choice) if isinstance(choice, str) or choice is None else f"function {choice.function.name!r}"


def openai_param(field: str | None, chat: bool, body: BaseModel | None = None) -> str | None:
    """The request field a SamplingParams field came from. ``body`` (the request, when known) tells a
    chat request's ``max_tokens`` from its ``max_completion_tokens``: the error names the one it sent."""
    if field is None:
        return None
    if field == "top_logprobs_num":
        return "top_logprobs" if chat else "logprobs"
    if field == "max_new_tokens" and chat:
        legacy = body is not None and getattr(body, "max_completion_tokens", None) is None
        return "max_tokens" if legacy and getattr(body, "max_tokens", None) is not None else "max_completion_tokens"
    return _OPENAI_NAMES.get(field, field)


def openai_names(chat: bool, body: BaseModel | None = None) -> FieldNames:
    """How a refusal names the fields of this body (``runtime.protocol.field_refs``): the OpenAI
    fields the values came from (``max_tokens`` for ``max_new_tokens``, ...); set by the route
    that parsed the body, for the error reply (``http/errors.py``)."""
    return lambda ref: openai_param(ref.name, chat, body) or ref.name
