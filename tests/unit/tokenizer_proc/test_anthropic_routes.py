"""POST /v1/messages and /v1/messages/count_tokens through the app, against a fake front door that
answers with recorded chunks (no model): errors in Anthropic's shape with their statuses (the key,
a bad block, a missing max_tokens, a refusal of the shared request path in Anthropic's names, the
server still starting), a whole reply and a stream framed as Anthropic's events, an error event
mid-stream, and count_tokens counting exactly what the same body would be served."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec

from runtime.config.args import ServerArgs
from runtime.protocol.field_refs import FieldRef
from runtime.protocol.messages import ChunkMeta, ErrorReply, GenerateChunk, GenerateReq, TokenizeReq
from tests.support.asgi import AsgiReply, call_app
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.server import build_app
from tokenizer_proc.request_builder import Rejected

KEY = "secret"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


class FakeDoor:
    """A front door that answers every request with ``replies`` (chunks, or an ErrorReply) and
    counts every prompt as ``count`` tokens; it records what it was given."""

    tokenizer = None
    context_len = 8192

    def __init__(self, replies: list[GenerateChunk | ErrorReply], reject: Rejected | None = None) -> None:
        self.replies = replies
        self.reject = reject
        self.submitted: list[GenerateReq] = []
        self.tokenized: list[TokenizeReq] = []
        self.closed = 0
        self.queue: asyncio.Queue[Any] | None = None

    def open_local(self) -> tuple[bytes, asyncio.Queue[Any]]:
        self.queue = asyncio.Queue()
        return b"client", self.queue

    async def submit_local(self, identity: bytes, req: GenerateReq) -> int:
        if self.reject is not None:
            raise self.reject
        self.submitted.append(req)
        assert self.queue is not None
        for reply in self.replies:
            self.queue.put_nowait(msgspec.structs.replace(reply, rid=req.rid))
        return 1

    def close_local(self, identity: bytes) -> None:
        self.closed += 1

    async def tokenize(self, req: TokenizeReq) -> dict[str, Any]:
        self.tokenized.append(req)
        return {"tokens": list(range(42)), "count": 42, "max_model_len": self.context_len}


def chunk(text: str, finished: bool = False, completion: int = 1) -> GenerateChunk:
    reason = {"type": "stop", "matched": 2} if finished else None
    return GenerateChunk(
        "r", text, [], finished, reason, ChunkMeta(prompt_tokens=20, cached_tokens=5, completion_tokens=completion)
    )


def post(
    door: FakeDoor | None,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> AsgiReply:
    context = HttpContext(ServerArgs(api_key=KEY, served_model_name="served"), 1 << 20)
    if door is not None:
        context.attach(door)  # type: ignore[arg-type]
    app = build_app(context)
    given = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    given.update({"x-api-key": KEY} if headers is None else headers)
    return call_app(app, "POST", path, json.dumps(body).encode(), given)


def message_body(**fields: Any) -> dict[str, Any]:
    return {"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": ASK, **fields}


def error_of(reply: AsgiReply, status: int, kind: str) -> str:
    assert reply.status == status, reply.body
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return str(body["error"]["message"])


def frames(reply: AsgiReply) -> list[dict[str, Any]]:
    """The stream's events, each checked to be ``event: <type>`` then its ``data``."""
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in reply.body.decode().split("\n\n")[:-1]:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), frame
        event = json.loads(data[len("data: ") :])
        assert event["type"] == name[len("event: ") :]
        events.append(event)
    assert reply.body.endswith(b"\n\n")
    return events


def test_the_key_is_checked_in_anthropics_shape() -> None:
    door = FakeDoor([chunk("Paris", True)])
    assert "api key" in error_of(post(door, "/v1/messages", message_body(), {}), 401, "authentication_error")
    assert post(door, "/v1/messages", message_body(), {"x-api-key": KEY}).status == 200
    assert post(door, "/v1/messages", message_body(), {"authorization": f"Bearer {KEY}"}).status == 200
    # while the server starts: 503 in Anthropic's shape, with Retry-After
    starting = post(None, "/v1/messages", message_body())
    assert "starting" in error_of(starting, 503, "overloaded_error") and starting.headers["retry-after"] == "1"


def test_a_bad_request_names_the_field() -> None:
    door = FakeDoor([chunk("Paris", True)])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    bad = message_body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}])
    message = error_of(post(door, "/v1/messages", bad), 400, "invalid_request_error")
    assert message.startswith("messages[0].content[1]: image blocks are not supported")
    missing = {"model": "m", "messages": ASK}
    assert "max_tokens" in error_of(post(door, "/v1/messages", missing), 400, "invalid_request_error")
    assert "tools[0].name" in error_of(
        post(
            door,
            "/v1/messages/count_tokens",
            {"model": "m", "messages": ASK, "tools": [{"name": "a b", "input_schema": {}}]},
        ),
        400,
        "invalid_request_error",
    )
    assert not door.submitted and not door.tokenized


def test_a_refusal_of_the_shared_path_is_worded_in_anthropics_names() -> None:
    reject = Rejected("invalid_request", (FieldRef("stop", True), ": stop strings must be non-empty"), "stop")
    message = error_of(post(FakeDoor([], reject), "/v1/messages", message_body()), 400, "invalid_request_error")
    assert message == "stop_sequences: stop strings must be non-empty"
    too_long = Rejected("too_long", "the prompt has 9000 tokens; the maximum is 8192", "prompt")
    message = error_of(post(FakeDoor([], too_long), "/v1/messages", message_body()), 400, "invalid_request_error")
    assert message == "messages: the prompt has 9000 tokens; the maximum is 8192"


def test_a_whole_reply_names_the_served_model() -> None:
    door = FakeDoor([chunk("Paris.", True, completion=3)])
    reply = post(door, "/v1/messages", message_body(temperature=0, stop_sequences=["END"]))
    assert reply.status == 200, reply.body
    body = reply.json()
    assert body["model"] == "served" and body["content"] == [{"type": "text", "text": "Paris."}]
    assert body["stop_reason"] == "end_turn" and body["usage"]["input_tokens"] == 15
    [req] = door.submitted
    assert req.sampling_params == {"n": 1, "max_new_tokens": 8, "temperature": 0.0, "stop": ["END"]}
    assert not req.stream and door.closed >= 1
    assert req.fit_max_tokens  # Claude Code's budget past the context is shortened, not refused


def test_a_stream_is_anthropics_event_sequence() -> None:
    door = FakeDoor([chunk("Par"), chunk("is", completion=2), chunk(".", True, completion=3)])
    events = frames(post(door, "/v1/messages", message_body(stream=True)))
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "Paris."
    assert events[0]["message"]["model"] == "served" and events[0]["message"]["usage"]["input_tokens"] == 15
    assert events[-2]["usage"]["output_tokens"] == 3 and events[-2]["delta"]["stop_reason"] == "end_turn"
    assert door.submitted[0].stream and door.closed >= 1


def test_a_failure_mid_stream_is_an_error_event() -> None:
    door = FakeDoor([chunk("Par"), ErrorReply("r", "overloaded", "the queue is full")])
    events = frames(post(door, "/v1/messages", message_body(stream=True)))
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "the queue is full"}}
    assert [e["type"] for e in events[:3]] == ["message_start", "ping", "content_block_start"]


def test_count_tokens_counts_the_prompt_the_request_would_be_served() -> None:
    fields = {"system": "Be brief.", "tools": TOOLS, "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"}}
    door = FakeDoor([chunk("x", True)])
    assert post(door, "/v1/messages", message_body(**fields)).status == 200
    reply = post(door, "/v1/messages/count_tokens", {"model": "any-name", "messages": ASK, **fields})
    assert reply.status == 200 and reply.json() == {"input_tokens": 42}
    [served], [counted] = door.submitted, door.tokenized
    assert counted.messages == served.messages and counted.tools == served.tools
    assert counted.chat_template_kwargs == served.chat_template_kwargs == {"enable_thinking": False}
    assert counted.messages is not None and counted.messages[0] == {"role": "system", "content": "Be brief."}
