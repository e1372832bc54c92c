"""Ollama's request bodies (``POST /api/chat``, ``/api/generate``, ``/api/show``; ``/api/embed`` and
``/api/embeddings`` on an embedding server, each input an embedding request) and their translation
onto the OpenAI chat request (tokenizer_proc/openai_protocol.py), so that an Ollama request takes the
request path every chat request takes: the same sampling checks, chat template, tool plan, structured
outputs and parsers. Replies are tokenizer_proc/ollama_reply.py; routes tokenizer_proc/http/ollama_routes.py.

What Ollama's fields become:

- ``options``: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``presence_penalty``,
  ``frequency_penalty`` as they are; ``repeat_penalty`` -> ``repetition_penalty``; ``num_predict`` -> the
  max tokens (-1 and -2, Ollama's "no limit" and "fill the context", leave the server's default). The
  runner's options (``num_ctx``, ``num_thread``, ``num_gpu``, ...) are accepted and ignored: this server
  sized its context and devices at launch. Samplers it does not have (``mirostat``, ``tfs_z``,
  ``typical_p``) are refused unless given their "off" value. SGLang's ``regex`` and ``ebnf`` are taken
  in ``options`` too (Ollama's body has no place for them).
- ``format``: ``"json"`` -> any JSON object; a JSON schema object -> output valid against it.
- ``think``: true (or a level, "low" / "medium" / "high") -> the reasoning parser's output in
  ``thinking``; false -> ``enable_thinking`` false for the template, and no reasoning split. Absent: the
  split happens when the server has ``--reasoning-parser`` (Ollama's default for a thinking model).
- ``/api/generate``: the ``prompt`` (and ``system``) rendered as a chat with the template, as Ollama
  does; ``raw`` true sends the prompt as text, untouched. ``template`` (a per-request template),
  ``suffix`` (fill-in-the-middle), ``images`` and a non-empty ``context`` (the deprecated token history)
  are refused naming the field.

A refusal names the field as Ollama's body calls it (``options.num_predict``, ``format``): ``ollama_names``.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, ValidationError

from runtime.protocol.field_refs import FieldNames
from runtime.protocol.messages import GenerateReq
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import loc_path
from tokenizer_proc.openai_tools import FunctionDefinition

# Options passed on under the same name (Ollama's names are SGLang's for these).
_SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty")
# Samplers this server does not have: refused unless given the value that turns them off.
_NEUTRAL = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}
# num_predict values that mean "no limit of the client's" (Ollama: -1 infinite, -2 fill the context).
_NO_LIMIT = (-1, -2)
THINK_LEVELS = ("low", "medium", "high")
# What the server's names are called in Ollama's body, for refusals.
_OLLAMA_NAMES = {
    "max_new_tokens": "options.num_predict",
    "repetition_penalty": "options.repeat_penalty",
    "json_schema": "format",
    "regex": "options.regex",
    "ebnf": "options.ebnf",
    **{name: f"options.{name}" for name in _SAME_NAME},
}


class Options(oai.LenientBody):
    """Ollama's ``options``: the sampling ones mapped, the runner's ones ignored (typed loosely: they
    are never read), an unknown one ignored with a warning as Ollama itself does."""

    body_name = "ollama options"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repeat_penalty: float | None = None
    num_predict: int | None = None
    # samplers this server lacks (refused unless off)
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    tfs_z: float | None = None
    typical_p: float | None = None
    # the runner's: accepted and ignored (the context, threads and devices are the launch's)
    num_ctx: Any = None
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    num_thread: Any = None
    num_keep: Any = None
    numa: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    logits_all: Any = None
    vocab_only: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    embedding_only: Any = None
    repeat_last_n: Any = None
    penalize_newline: Any = None
    # SGLang's constraints (Ollama's body has no field for them)
    regex: str | None = None
    ebnf: str | None = None

    def sampling(self) -> dict[str, Any]:
        """The OpenAI chat request's sampling fields these options ask for."""
        for name, off in _NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value != off:
                raise oai.BadRequest(
                    f"options.{name}: this server has no {name} sampler; leave it out or send {off} (off)",
                    f"options.{name}",
                )
        fields: dict[str, Any] = {name: getattr(self, name) for name in _SAME_NAME if getattr(self, name) is not None}
        if self.repeat_penalty is not None:
            fields["repetition_penalty"] = self.repeat_penalty
        if self.num_predict is not None and self.num_predict not in _NO_LIMIT:
            if self.num_predict < 0:
                raise oai.BadRequest(
                    f"options.num_predict: must be >= 0, or -1 (no limit), got {self.num_predict}",
                    "options.num_predict",
                )
            fields["max_tokens"] = self.num_predict
        for name in ("regex", "ebnf"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        return fields


class _Part(BaseModel):
    # Strict types; other fields (Ollama's newer ``id`` and ``index`` of a call) are not read.
    model_config = ConfigDict(extra="ignore", strict=True)


class ToolCallFunction(_Part):
    name: str
    arguments: dict[str, Any] = {}


class ToolCall(_Part):
    """An assistant message's call, as Ollama sends it back: ``arguments`` is an object."""

    function: ToolCallFunction


class Message(BaseModel):
    """One of ``messages``: ``tool_name`` names the tool whose result a tool message carries;
    ``thinking`` is an assistant turn's reasoning (kept for templates that show it)."""

    # Messages may carry fields of their own: the chat template decides what it reads.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The OpenAI-style message the chat template reads."""
        if self.images:
            raise oai.BadRequest(
                f"messages[{index}].images: images are not supported (this server serves a text-only model)",
                f"messages[{index}].images",
            )
        out: dict[str, Any] = {**(self.model_extra or {}), "role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_name is not None:
            out["tool_name"] = self.tool_name
            out.setdefault("name", self.tool_name)  # the name OpenAI-style templates read
        if self.thinking:
            out["reasoning_content"] = self.thinking  # what Qwen3-style templates call it
        return out


class Tool(oai.LenientBody):
    """An OpenAI-style function tool (Ollama's ``type`` defaults to "function")."""

    body_name = "ollama tool"
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _GenerateFields(oai.LenientBody):
    """What /api/chat and /api/generate share."""

    # Fields Ollama has that this server cannot honour: a 400 naming each when given a value.
    refused: ClassVar[dict[str, str]] = {
        "logprobs": "logprobs are not served on Ollama's API here; /v1/chat/completions returns them",
        "top_logprobs": "logprobs are not served on Ollama's API here; /v1/chat/completions returns them",
        "width": "image generation is not supported",
        "height": "image generation is not supported",
        "steps": "image generation is not supported",
    }
    model: str
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True  # Ollama streams unless told not to
    think: bool | str | None = None
    keep_alive: str | float | None = None  # accepted: the model stays loaded for the server's life

    def openai_fields(self, reasoning_parser: str | None) -> dict[str, Any]:
        """The OpenAI chat request's fields for ``format``, ``options`` and ``think``."""
        fields: dict[str, Any] = {"model": self.model, "stream": True, **(self.options or Options()).sampling()}
        if isinstance(self.format, dict):
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "format", "schema": self.format},
            }
        elif self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif self.format:
            raise oai.BadRequest(f'format: must be "json" or a JSON schema object, got {self.format!r}', "format")
        if self.thinking is False:
            fields["chat_template_kwargs"] = {"enable_thinking": False}
            fields["separate_reasoning"] = False
        elif self.thinking and reasoning_parser is None:
            raise oai.BadRequest(
                f"think: the model {self.model!r} does not support thinking "
                "(the server was started without --reasoning-parser)",
                "think",
            )
        return fields

    @property
    def thinking(self) -> bool | None:
        """``think`` as a switch (a level is "on"); None when not given."""
        if isinstance(self.think, str):
            if self.think not in THINK_LEVELS:
                raise oai.BadRequest(f"think: must be true, false or one of {', '.join(THINK_LEVELS)}", "think")
            return True
        return self.think


class ChatBody(_GenerateFields):
    """``POST /api/chat``."""

    body_name = "ollama chat"
    messages: list[Message] = []
    tools: list[Tool] | None = None

    def openai_request(self, reasoning_parser: str | None) -> oai.ChatCompletionRequest:
        """The same request as an OpenAI chat completion (streamed inside the server: the reply's
        timings need its first token's arrival)."""
        fields = self.openai_fields(reasoning_parser)
        fields["messages"] = [m.for_template(i) for i, m in enumerate(self.messages)]
        if self.tools:
            fields["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return _chat_request(fields)


class GenerateBody(_GenerateFields):
    """``POST /api/generate``."""

    body_name = "ollama generate"
    refused: ClassVar[dict[str, str]] = {
        **_GenerateFields.refused,
        "template": "a per-request template is not supported: the prompt is rendered with the server's "
        "chat template (--chat-template); send raw true with the prompt already formatted instead",
        "suffix": "suffix (fill-in-the-middle) is not supported",
        "images": "images are not supported (this server serves a text-only model)",
        "context": "the deprecated token context is not supported: send the conversation as messages to /api/chat",
    }
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None

    @property
    def loads_only(self) -> bool:
        """Ollama's "load the model" call: nothing to generate from."""
        return not self.prompt and not self.system

    def openai_request(self, reasoning_parser: str | None) -> tuple[oai.ChatCompletionRequest, str | None]:
        """The OpenAI chat request, and for ``raw`` the text to send instead of its messages (its
        sampling fields still apply; no template, so no reasoning split)."""
        if self.raw:
            if self.system:
                raise oai.BadRequest(
                    "system: a raw prompt is sent as given, without the template; put the system text in the prompt",
                    "system",
                )
            if self.thinking:
                raise oai.BadRequest(
                    "think: a raw prompt is sent as given, without the template; its thinking is not separated",
                    "think",
                )
            fields = self.openai_fields(None)
            fields["separate_reasoning"] = False
            fields["messages"] = [{"role": "user", "content": self.prompt or ""}]
            return _chat_request(fields), self.prompt or ""
        fields = self.openai_fields(reasoning_parser)
        system = [{"role": "system", "content": self.system}] if self.system else []
        fields["messages"] = [*system, {"role": "user", "content": self.prompt or ""}]
        return _chat_request(fields), None


class ShowBody(oai.LenientBody):
    """``POST /api/show`` (``name`` is the field's old name, still sent by older clients)."""

    body_name = "ollama show"
    model: str | None = None
    name: str | None = None
    verbose: bool = False

    @property
    def model_name(self) -> str:
        if not (self.model or self.name):
            raise oai.BadRequest("model: required", "model")
        return self.model or self.name or ""


class EmbedBody(oai.LenientBody):
    """``POST /api/embed`` on an embedding server: ``input`` a text or a list of them (none: Ollama's
    load call, answered with no embeddings); ``truncate`` (Ollama's default true) cuts an input past
    the model's limit instead of refusing it; ``options`` and ``keep_alive`` are accepted and ignored
    (nothing is sampled; the model stays loaded)."""

    body_name = "ollama embed"
    model: str
    input: str | list[str] | None = None
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None

    def texts(self) -> list[str]:
        return [] if not self.input else [self.input] if isinstance(self.input, str) else list(self.input)

    def generate_reqs(self) -> list[GenerateReq]:
        """One embedding request per input, in order."""
        return [_embed_req(text, self.truncate) for text in self.texts()]


class EmbeddingsBody(oai.LenientBody):
    """``POST /api/embeddings``, Ollama's older form: one ``prompt`` (none or empty: the load call)."""

    body_name = "ollama embeddings"
    model: str
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


def _embed_req(text: str, truncate: bool) -> GenerateReq:
    return GenerateReq(rid=uuid.uuid4().hex, embed=True, text=text, truncate_prompt_tokens=-1 if truncate else None)


def embed_req(text: str) -> GenerateReq:
    """The older route's one request (Ollama cuts its prompt to the context)."""
    return _embed_req(text, truncate=True)


def _chat_request(fields: dict[str, Any]) -> oai.ChatCompletionRequest:
    """Validated as the OpenAI route validates its body; what Ollama's own model let through and
    OpenAI's does not is a 400 naming the field."""
    try:
        return oai.ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = loc_path(err.get("loc", ())) or "body"
        raise oai.BadRequest(f"{param}: {err.get('msg')}", param) from None


def raw_prompt(req: GenerateReq, text: str) -> GenerateReq:
    """``raw``: the request with ``text`` as its prompt, sent as it is (no template, so no tools)."""
    return msgspec.structs.replace(req, text=text, messages=None, tools=None, chat_template_kwargs=None)


def ollama_param(name: str, chat: bool) -> str:
    """The field of Ollama's body a server field came from (the prompt is ``messages`` on a chat)."""
    if name in ("text", "input_ids", "messages"):
        return "messages" if chat else "prompt"
    return _OLLAMA_NAMES.get(name, name)


def ollama_names(chat: bool) -> FieldNames:
    """How a refusal of the shared request path names the fields of an Ollama body."""
    return lambda ref: ollama_param(ref.name, chat)


def ollama_name(served: str) -> str:
    """The name Ollama's clients list and send back: ``name:tag``, ``:latest`` when it has no tag."""
    return served if ":" in served.rsplit("/", 1)[-1] else served + ":latest"


def names_model(model: str, served: str, model_path: str | None) -> bool:
    """Whether ``model`` names the served model: its name (any tag, as Ollama's ``:latest``) or the
    --model-path it was started with."""
    untagged = model.rsplit(":", 1)[0] if ":" in model.rsplit("/", 1)[-1] else model
    return model in (served, ollama_name(served), model_path) or untagged in (served, model_path)


def not_found(model: str) -> oai.BadRequest:
    """Ollama's 404 for a model it does not have (its clients offer to pull it)."""
    return oai.BadRequest(
        f'model "{model}" not found, try pulling it first', "model", status=404, code="model_not_found"
    )
