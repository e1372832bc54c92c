"""The Responses API's stored responses (no server): the bounded store's LRU, and the routes over a
fake front door that answers every request with a scripted text: ``previous_response_id`` chaining
(the next prompt is the earlier input and output, then the new input; not the earlier
instructions), ``store: false``, GET and DELETE, the stream stored at its end, and OpenAI's error
shape naming the field (an unknown id is a 404; a refusal of the request path names this API's
field)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.responses import Response

from runtime.config.args import ServerArgs
from runtime.protocol.field_refs import FieldRef
from runtime.protocol.messages import ChunkMeta, GenerateChunk, GenerateReq
from tests.support.asgi import AsgiReply, call_app
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.server import build_app
from tokenizer_proc.request_builder import Rejected
from tokenizer_proc.response_store import ResponseStore

# ---------------------------------------------------------------------- the store


def stored(store: ResponseStore, rid: str, said: str = "hi") -> None:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": said}]}]
    store.put({"id": rid, "output": output}, [{"role": "user", "content": "q"}])


def test_the_least_recently_used_response_is_forgotten_first() -> None:
    store = ResponseStore(2)
    stored(store, "a")
    stored(store, "b")
    store.get("a")  # a use: b is now the least recent
    stored(store, "c")
    assert "a" in store and "c" in store and "b" not in store and len(store) == 2
    with pytest.raises(oai.BadRequest) as exc:
        store.get("b", "previous_response_id")
    assert (exc.value.status, exc.value.param, exc.value.code) == (404, "previous_response_id", "not_found")
    assert "'b'" in exc.value.message and "previous_response_id" in exc.value.message
    store.delete("a")
    assert "a" not in store
    with pytest.raises(oai.BadRequest):
        store.delete("a")


def test_a_store_of_size_zero_keeps_nothing_and_a_negative_size_is_refused() -> None:
    store = ResponseStore(0)
    stored(store, "a")
    assert len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_the_conversation_is_the_input_then_the_output() -> None:
    store = ResponseStore()
    stored(store, "a", said="hello")
    assert [item.get("role") for item in store.get("a").conversation] == ["user", "assistant"]


# ---------------------------------------------------------------------- the routes


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class FakeDoor:
    """A front door whose model answers every request with ``reply`` in ``pieces`` (a stream gets
    one chunk per piece); the prompt's token count is its messages' characters. Records the requests."""

    def __init__(self, reply: str = "Bonjour!", pieces: int = 3) -> None:
        self.reply = reply
        self.pieces = pieces
        self.reqs: list[GenerateReq] = []
        self.queues: dict[bytes, asyncio.Queue[Any]] = {}
        self.closed: list[bytes] = []
        self.tokenizer = _Tokenizer()
        self.context_len = 4096

    def open_local(self) -> tuple[bytes, asyncio.Queue[Any]]:
        identity = str(len(self.queues)).encode()
        self.queues[identity] = asyncio.Queue()
        return identity, self.queues[identity]

    async def submit_local(self, identity: bytes, req: GenerateReq) -> int:
        limit = (req.sampling_params or {}).get("max_new_tokens")
        if limit is not None and limit > 100:
            raise Rejected(
                "invalid_request", ("sampling ", FieldRef("max_new_tokens"), " is above 100"), "max_new_tokens"
            )
        self.reqs.append(req)
        prompt = sum(len(m["content"]) for m in req.messages or [])
        step = -(-len(self.reply) // self.pieces)
        parts = [self.reply[i : i + step] for i in range(0, len(self.reply), step)] if req.stream else [self.reply]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            meta = ChunkMeta(prompt_tokens=prompt, completion_tokens=i + 1, cached_tokens=0)
            self.queues[identity].put_nowait(
                GenerateChunk(req.rid, part, [], last, {"type": "stop"} if last else None, meta)
            )
        return 1

    def close_local(self, identity: bytes) -> None:
        self.closed.append(identity)


@pytest.fixture
def served() -> tuple[Any, FakeDoor]:
    context = HttpContext(ServerArgs(served_model_name="m", responses_store_size=3), 1 << 20)
    door = FakeDoor()
    context.attach(door)  # type: ignore[arg-type]
    return build_app(context), door


def call(app: Any, method: str, path: str, body: Any = None) -> AsgiReply:
    data = b"" if body is None else json.dumps(body).encode()
    return call_app(app, method, path, data, {"content-type": "application/json"})


def post(app: Any, **body: Any) -> dict[str, Any]:
    reply = call(app, "POST", "/v1/responses", {"model": "m", **body})
    assert reply.status == 200, reply.body
    parsed: dict[str, Any] = reply.json()
    Response.model_validate(parsed)
    return parsed


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """The stream's events; each ``event:`` line names the type its data carries."""
    events = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert event["type"] == name[len("event: ") :]
        events.append(event)
    return events


def test_a_stored_response_is_continued_retrieved_and_deleted(served: tuple[Any, FakeDoor]) -> None:
    app, door = served
    first = post(app, input="Say hello in French.", instructions="You are terse.")
    assert first["output_text"] == "Bonjour!" and first["store"] is True
    second = post(app, input="And in Spanish?", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    assert door.reqs[1].messages == [  # the earlier instructions are not carried over (OpenAI's rule)
        {"role": "user", "content": "Say hello in French."},
        {"role": "assistant", "content": "Bonjour!"},
        {"role": "user", "content": "And in Spanish?"},
    ]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] - len("You are terse.")
    third = post(app, input=[{"role": "user", "content": "Thanks"}], previous_response_id=second["id"])
    assert [m["content"] for m in door.reqs[2].messages or []] == [
        "Say hello in French.",
        "Bonjour!",
        "And in Spanish?",
        "Bonjour!",
        "Thanks",
    ]
    got = call(app, "GET", f"/v1/responses/{third['id']}")
    assert got.status == 200 and got.json() == third
    deleted = call(app, "DELETE", f"/v1/responses/{third['id']}")
    assert deleted.json() == {"id": third["id"], "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        gone = call(app, method, f"/v1/responses/{third['id']}")
        assert gone.status == 404 and third["id"] in gone.json()["error"]["message"]
    assert door.closed == [b"0", b"1", b"2"]  # every run's local client closed


def test_store_false_keeps_nothing_and_an_unknown_previous_id_is_a_404(served: tuple[Any, FakeDoor]) -> None:
    app, _ = served
    unstored = post(app, input="x", store=False)
    assert call(app, "GET", f"/v1/responses/{unstored['id']}").status == 404
    reply = call(app, "POST", "/v1/responses", {"model": "m", "input": "y", "previous_response_id": unstored["id"]})
    assert reply.status == 404
    error = reply.json()["error"]
    assert error["param"] == "previous_response_id" and unstored["id"] in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "not_found"


def test_the_store_is_bounded_by_its_flag(served: tuple[Any, FakeDoor]) -> None:
    app, _ = served
    ids = [post(app, input=str(i))["id"] for i in range(4)]  # --responses-store-size 3
    assert [call(app, "GET", f"/v1/responses/{i}").status for i in ids] == [404, 200, 200, 200]


def test_a_stream_is_stored_at_its_end_and_equals_the_whole_reply(served: tuple[Any, FakeDoor]) -> None:
    app, door = served
    reply = call(app, "POST", "/v1/responses", {"model": "m", "input": "hi", "stream": True})
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) == door.pieces and "".join(deltas) == "Bonjour!"
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["output_text"] == "Bonjour!"
    stored = call(app, "GET", f"/v1/responses/{final['response']['id']}").json()
    assert stored == final["response"]
    whole = post(app, input="hi")
    assert whole["output"][0]["content"] == stored["output"][0]["content"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "other", "input": "x"}, 404, "model"),
        ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input[0].content[0]"),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"model": "m", "input": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": "m", "input": "x", "background": True}, 400, "background"),
        ({"model": "m", "input": "x", "max_output_tokens": 500}, 400, "max_output_tokens"),  # refused by the door
    ],
)
def test_refusals_are_openais_error_naming_the_field(
    served: tuple[Any, FakeDoor], body: dict[str, Any], status: int, param: str
) -> None:
    app, _ = served
    reply = call(app, "POST", "/v1/responses", body)
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and param in error["message"]
    assert "max_new_tokens" not in error["message"]
