"""OpenAI's completions and chat completions schemas: pydantic request models, their
translation into the server's own ``GenerateReq``, and the reply bodies.

The requests are validated strictly (a string is never a number, a field the schema
does not have is an error naming it) so that a client's mistake is answered with a 400
that names the field, as OpenAI's own API does. Value ranges are not repeated here:
``SamplingParams.validate`` owns them, and ``openai_param`` maps the name it reports
(``max_new_tokens``) back to the one the client sent (``max_tokens``).

Replies are plain dicts (encoded with msgspec by the HTTP server): a stream sends one per
token, and building pydantic objects for each would cost more than the encoding.
SGLang/vLLM extensions accepted in the body (the openai SDK's ``extra_body``): ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``no_stop_trim``, and SGLang's constraints ``regex`` and ``ebnf``
(``response_format`` carries a JSON schema).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.messages import GenerateChunk, GenerateReq

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# What the server's names are called in the OpenAI schema (for error messages).
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "input_ids": "prompt",
                 "json_schema": "response_format"}
# ``response_format: {"type": "json_object"}``: any JSON object.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


class BadRequest(Exception):
    """A request the HTTP layer refuses before it reaches the tokenizer manager."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is accepted; the output
    always follows the schema)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
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


class _SamplingFields(_Strict):
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
    user: str | None = None  # accepted and ignored, as OpenAI's clients send it
    logit_bias: dict[str, float] | None = None
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

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
        params: dict[str, Any] = {"n": self.n}
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        if self.min_tokens is not None:
            params["min_new_tokens"] = self.min_tokens
        if self.response_format is not None:
            params.update(self.response_format.constraint())
        for name in ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k",
                     "min_p", "repetition_penalty", "stop_token_ids", "regex", "ebnf"):
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
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def generate_reqs(self) -> list[GenerateReq]:
        """One GenerateReq per prompt (a list of prompts is a batch)."""
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
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
        return [GenerateReq(rid=uuid.uuid4().hex, sampling_params=params, stream=self.stream,
                            return_logprob=self.logprobs is not None, top_logprobs_num=top,
                            **({"text": p} if isinstance(p, str) else {"input_ids": p}))
                for p in prompts]


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Messages may carry fields of their own (name, tool_call_id, ...): the chat template decides.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None

    def as_dict(self, index: int) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" or p.text is None for p in content):
                raise BadRequest(f"messages[{index}].content: only text parts are supported",
                                 f"messages[{index}].content")
            content = "".join(p.text or "" for p in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def generate_reqs(self) -> list[GenerateReq]:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs requires logprobs=true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self.sampling_params(max_tokens)
        messages = [m.as_dict(i) for i, m in enumerate(self.messages)]
        return [GenerateReq(rid=uuid.uuid4().hex, messages=messages, sampling_params=params, stream=self.stream,
                            return_logprob=self.logprobs, top_logprobs_num=self.top_logprobs or 0)]


class NativeGenerateReq(_Strict):
    """SGLang's /generate body (the fields this server has)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # prompt logprobs from this position on (with return_logprob); -1: none
    rid: str | list[str] | None = None

    def generate_reqs(self) -> tuple[list[GenerateReq], bool]:
        """The requests, and whether the body was a batch (the reply is then a list)."""
        if (self.text is None) == (self.input_ids is None):
            raise BadRequest("give exactly one of text, input_ids", "text")
        items: list[Any]
        if self.text is not None:
            batch = isinstance(self.text, list)
            items = list(self.text) if batch else [self.text]
            field = "text"
        else:
            assert self.input_ids is not None
            batch = bool(self.input_ids) and isinstance(self.input_ids[0], list)
            items = list(self.input_ids) if batch else [self.input_ids]
            field = "input_ids"
        if batch and self.stream:
            raise BadRequest("stream takes a single prompt", "stream")
        if self.rid is None:
            rids = [uuid.uuid4().hex for _ in items]
        elif isinstance(self.rid, list) != batch or (batch and len(self.rid) != len(items)):
            raise BadRequest("rid: one rid per prompt (a list for a batch, a string otherwise)", "rid")
        else:
            rids = list(self.rid) if isinstance(self.rid, list) else [self.rid]
        if len(set(rids)) != len(rids):
            raise BadRequest("rid: the rids of a batch must differ", "rid")
        return [GenerateReq(rid=r, sampling_params=self.sampling_params, stream=self.stream,
                            return_logprob=self.return_logprob, top_logprobs_num=self.top_logprobs_num,
                            logprob_start_len=self.logprob_start_len,
                            **{field: item}) for r, item in zip(rids, items)], batch


def openai_param(field: str | None, chat: bool) -> str | None:
    """The request field a SamplingParams field came from."""
    if field is None:
        return None
    if field == "top_logprobs_num":
        return "top_logprobs" if chat else "logprobs"
    if field == "max_new_tokens" and chat:
        return "max_completion_tokens"
    return _OPENAI_NAMES.get(field, field)


# ---------------------------------------------------------------------- replies


def finish_reason(chunk: GenerateChunk) -> str | None:
    """OpenAI's finish_reason: stop (EOS, a stop string or token), length, or abort."""
    if not chunk.finished:
        return None
    return str((chunk.finish_reason or {}).get("type", "stop"))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Usage:
    """Token counts of one HTTP request: the prompt once per prompt (not per sample, as
    OpenAI counts it), the completions of every choice."""

    def __init__(self) -> None:
        self.prompt: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt, cached) tokens
        self.completion = 0

    def add(self, prompt_index: int, chunk: GenerateChunk) -> None:
        if chunk.finished:
            meta = chunk.meta
            self.completion += int(meta.get("completion_tokens", 0))
            if meta.get("index", 0) == 0 or prompt_index not in self.prompt:
                self.prompt[prompt_index] = (int(meta.get("prompt_tokens", 0)), int(meta.get("cached_tokens", 0)))

    def as_dict(self) -> dict[str, Any]:
        return usage(sum(p for p, _ in self.prompt.values()), self.completion,
                     sum(c for _, c in self.prompt.values()))


class LogprobFormatter:
    """Token logprobs in OpenAI's two layouts (tokens as text, through the tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([int(token_id)]))

    def completion(self, meta: dict[str, Any], text_offset: int) -> dict[str, Any]:
        pairs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs")
        tokens = [self.token(t) for _, t in pairs]
        offsets, at = [], text_offset
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        out: dict[str, Any] = {"tokens": tokens, "token_logprobs": [float(lp) for lp, _ in pairs],
                               "text_offset": offsets, "top_logprobs": None}
        if tops is not None:
            out["top_logprobs"] = [{self.token(t): float(lp) for lp, t in top} for top in tops]
        return out

    def chat(self, meta: dict[str, Any]) -> dict[str, Any]:
        pairs = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [[] for _ in pairs]
        content = []
        for (lp, tid), top in zip(pairs, tops):
            tok = self.token(tid)
            content.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode()),
                            "top_logprobs": [{"token": (t := self.token(i)), "logprob": float(v),
                                              "bytes": list(t.encode())} for v, i in top]})
        return {"content": content}


def now() -> int:
    return int(time.time())


Kind = Literal["completion", "chat"]


def response_id(kind: Kind) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
