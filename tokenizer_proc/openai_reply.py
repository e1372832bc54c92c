"""OpenAI reply bodies for /v1/completions and /v1/chat/completions: one JSON body, or the
events of an SSE stream.

Replies are plain dicts (encoded with msgspec by the HTTP server): a stream sends one per
token, and building pydantic objects for each would cost more than the encoding.

A chat choice's text passes through ``ChatChoice`` on its way out: with
``--reasoning-parser`` the thinking moves to ``reasoning_content``; with tools, calls are
read out of the rest (``--tool-call-parser``, or the constrained output of a required /
named tool_choice) into ``tool_calls``. Whole replies parse the finished text at once;
streams feed the same parsers piece by piece, which give the same result (their tests cut
the text at every offset), so a stream never shows half a tag as content.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from runtime.protocol.messages import ChunkMeta, GenerateChunk
from runtime.text.parsers import (
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    make_reasoning_parser,
    make_tool_call_parser,
)
from tokenizer_proc.openai_tools import ToolPlan, call_id, constrained_calls

Kind = Literal["completion", "chat"]


def now() -> int:
    return int(time.time())


def response_id(kind: Kind) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def finish_reason(chunk: GenerateChunk) -> str | None:
    """OpenAI's finish_reason: stop (EOS, a stop string or token), length, or abort."""
    if not chunk.finished:
        return None
    return str((chunk.finish_reason or {}).get("type", "stop"))


class Usage:
    """Token counts of one HTTP request so far: the prompt once per prompt (not per sample, as
    OpenAI counts it), the completions of every choice. Every chunk carries its sample's counts."""

    def __init__(self) -> None:
        self.prompt: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt, cached) tokens
        self.completion: dict[tuple[int, int], int] = {}  # (prompt index, sample) -> tokens so far

    def add(self, prompt_index: int, chunk: GenerateChunk) -> None:
        meta = chunk.meta
        sample = meta.index or 0
        if meta.completion_tokens is not None:
            self.completion[prompt_index, sample] = meta.completion_tokens
        if meta.prompt_tokens is not None and (sample == 0 or prompt_index not in self.prompt):
            self.prompt[prompt_index] = (meta.prompt_tokens, meta.cached_tokens or 0)

    def as_dict(self) -> dict[str, Any]:
        prompt = sum(p for p, _ in self.prompt.values())
        completion = sum(self.completion.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c for _, c in self.prompt.values())},
        }


class LogprobFormatter:
    """Token logprobs in OpenAI's two layouts (tokens as text, through the tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([int(token_id)]))

    def completion(self, meta: ChunkMeta, text_offset: int, echo: bool = False) -> dict[str, Any]:
        """``echo``: the prompt's tokens first (the first has no logprob: nothing precedes it)."""
        pairs: list[list[Any]] = list(meta.output_token_logprobs or [])
        tops: list[Any] | None = meta.output_top_logprobs
        if echo:
            prompt = meta.input_token_logprobs or []
            pairs = prompt + pairs
            if tops is not None:
                tops = list(meta.input_top_logprobs or [None] * len(prompt)) + tops
        tokens = [self.token(t) for _, t in pairs]
        offsets, at = [], text_offset
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        out: dict[str, Any] = {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else float(lp) for lp, _ in pairs],
            "text_offset": offsets,
            "top_logprobs": None,
        }
        if tops is not None:
            out["top_logprobs"] = [None if top is None else {self.token(t): float(lp) for lp, t in top} for top in tops]
        return out

    def chat(self, meta: ChunkMeta) -> dict[str, Any]:
        pairs = meta.output_token_logprobs or []
        tops = meta.output_top_logprobs or [[] for _ in pairs]
        content = []
        for (lp, tid), top in zip(pairs, tops):
            tok = self.token(int(tid))
            content.append(
                {
                    "token": tok,
                    "logprob": float(lp),
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {"token": (t := self.token(int(i))), "logprob": float(v), "bytes": list(t.encode())}
                        for v, i in top
                    ],
                }
            )
        return {"content": content}


@dataclass(frozen=True)
class OutputParsing:
    """How one chat request's choices are read: its tool plan and the server's parsers."""

    tools: ToolPlan
    tool_call_parser: str | None = None  # --tool-call-parser
    reasoning_parser: str | None = None  # --reasoning-parser, None when this request keeps reasoning inline
    enable_thinking: bool = True  # chat_template_kwargs.enable_thinking
    # Decoding follows a grammar (response_format, regex, ebnf, a required / named tool_choice):
    # the output starts where the grammar does, so it is reasoning only if it opens with the tag
    # itself, even where the parser would otherwise assume the template opened it.
    constrained: bool = False


class ChatChoice:
    """One chat choice's text on its way to the client (see the module docstring)."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.plan = parsing.tools
        self.reasoning: ReasoningParser | None = None
        if parsing.reasoning_parser is not None:
            self.reasoning = make_reasoning_parser(parsing.reasoning_parser, parsing.enable_thinking)
            if parsing.constrained and parsing.enable_thinking:
                self.reasoning = ReasoningParser(force_reasoning=False)
        self.parser: ToolCallParser | None = (
            make_tool_call_parser(parsing.tool_call_parser, self.plan.names)
            if self.plan.mode == "parse" and parsing.tool_call_parser is not None
            else None
        )
        self.has_calls = False
        self.held: list[str] = []  # required: the constrained output, parsed once it is whole
        self.named_started = False

    # ------------------------------------------------------------------ whole

    def message(self, text: str) -> dict[str, Any]:
        """The finished choice's ``message``."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.parse(text)
        calls: list[ToolCall] | None = None
        if self.parser is not None:
            text, calls = self.parser.parse(text)
        elif self.plan.mode in ("required", "named"):
            calls = constrained_calls(self.plan, text)
            if calls:
                text = ""
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            self.has_calls = True
            message["tool_calls"] = [
                {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        return message

    # ------------------------------------------------------------------ streamed

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The ``delta`` fields of the next piece of text (``finished``: the last piece)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        calls: list[ToolCallDelta] = []
        content = self._feed_tools(content, calls)
        if finished:
            if self.reasoning is not None:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning += more_reasoning
                content += self._feed_tools(more_content, calls)
            content += self._finish_tools(calls)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            self.has_calls = True
            delta["tool_calls"] = [self._call_delta(c) for c in calls]
        return delta

    def _feed_tools(self, text: str, calls: list[ToolCallDelta]) -> str:
        """Content to send now; call deltas go to ``calls``."""
        if not text:
            return ""
        if self.parser is not None:
            content, found = self.parser.feed(text)
            calls.extend(found)
            return content
        if self.plan.mode == "required":
            self.held.append(text)
            return ""
        if self.plan.mode == "named":  # the output is the arguments: stream them as they come
            assert self.plan.named is not None
            calls.append(ToolCallDelta(0, None if self.named_started else self.plan.named, text))
            self.named_started = True
            return ""
        return text

    def _finish_tools(self, calls: list[ToolCallDelta]) -> str:
        if self.parser is not None:
            content, found = self.parser.finish()
            calls.extend(found)
            return content
        if self.plan.mode == "required":
            text = "".join(self.held)
            parsed = constrained_calls(self.plan, text)
            if not parsed:
                return text
            calls.extend(ToolCallDelta(i, c.name, c.arguments) for i, c in enumerate(parsed))
        return ""

    @staticmethod
    def _call_delta(call: ToolCallDelta) -> dict[str, Any]:
        if call.name is None:
            return {"index": call.index, "function": {"arguments": call.arguments}}
        return {
            "index": call.index,
            "id": call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def finish_reason(self, chunk: GenerateChunk) -> str | None:
        reason = finish_reason(chunk)
        return "tool_calls" if reason == "stop" and self.has_calls else reason


class OpenAIReply:
    """Builds the completion or chat completion reply (one body, or the stream's events)."""

    def __init__(
        self,
        kind: Kind,
        body: Any,
        n: int,
        model: str,
        logprobs: LogprobFormatter,
        parsing: OutputParsing | None = None,
        prompts: list[str] | None = None,
    ) -> None:
        self.chat = kind == "chat"
        self.req = body
        self.n = n
        self.model = model
        self.fmt = logprobs
        self.parsing = parsing if parsing is not None else OutputParsing(ToolPlan("none", None, (), {}))
        self.echo = [] if self.chat or not body.echo else list(prompts or [])  # completions: prompt texts
        self.want_logprobs = bool(body.logprobs) if self.chat else body.logprobs is not None
        self.id = response_id(kind)
        self.created = now()
        self.usage = Usage()
        self.choices: dict[int, dict[str, Any]] = {}
        self.chat_choices: dict[int, ChatChoice] = {}

    def _chat_choice(self, index: int) -> ChatChoice:
        choice = self.chat_choices.get(index)
        if choice is None:
            choice = self.chat_choices[index] = ChatChoice(self.parsing)
        return choice

    # ------------------------------------------------------------------ one body

    def add(self, prompt_index: int, chunk: GenerateChunk) -> None:
        self.usage.add(prompt_index, chunk)
        if not chunk.finished:
            return
        index = prompt_index * self.n + (chunk.meta.index or 0)
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            parsed = self._chat_choice(index)
            choice["message"] = parsed.message(chunk.text)
            choice["logprobs"] = self.fmt.chat(chunk.meta) if self.want_logprobs else None
            choice["finish_reason"] = parsed.finish_reason(chunk)
        else:
            echo = self.echo[prompt_index] if self.echo else ""
            choice["text"] = echo + chunk.text
            choice["logprobs"] = self.fmt.completion(chunk.meta, 0, bool(self.echo)) if self.want_logprobs else None
            choice["finish_reason"] = finish_reason(chunk)
        self.choices[index] = choice

    def body(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choices[i] for i in sorted(self.choices)],
            "usage": self.usage.as_dict(),
        }

    # ------------------------------------------------------------------ stream

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def event(self, prompt_index: int, chunk: GenerateChunk, offsets: dict[int, int]) -> dict[str, Any] | None:
        """The stream event of one chunk (None when it has nothing to show yet: a parser holds
        its text back). ``offsets``: per choice, the text sent so far (absent: not started yet)."""
        self.usage.add(prompt_index, chunk)
        index = prompt_index * self.n + (chunk.meta.index or 0)
        first = index not in offsets
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            parsed = self._chat_choice(index)
            delta = parsed.delta(chunk.text, chunk.finished)
            if first:
                delta = {"role": "assistant", **delta}
                if "content" not in delta and "tool_calls" not in delta and "reasoning_content" not in delta:
                    delta["content"] = ""
            elif not delta and not chunk.finished and not self.want_logprobs:
                return None
            offsets[index] = 0
            choice["delta"] = delta
            choice["logprobs"] = self.fmt.chat(chunk.meta) if self.want_logprobs else None
            choice["finish_reason"] = parsed.finish_reason(chunk)
        else:
            echo = self.echo[prompt_index] if self.echo and first else ""
            at = offsets.get(index, 0)
            choice["text"] = echo + chunk.text
            choice["logprobs"] = self.fmt.completion(chunk.meta, at, bool(echo)) if self.want_logprobs else None
            offsets[index] = at + len(choice["text"])
            choice["finish_reason"] = finish_reason(chunk)
        event = self._chunk([choice])
        if self.req.continuous_usage:
            event["usage"] = self.usage.as_dict()
        return event

    def usage_event(self) -> dict[str, Any] | None:
        """The last event of a stream that asked for ``include_usage``."""
        return {**self._chunk([]), "usage": self.usage.as_dict()} if self.req.include_usage else None
