"""Client and AsyncClient against a fake in-test ROUTER server (no model, no processes).

The fake server runs on a thread with a plain zmq ROUTER; ``handler(identity, request)``
returns the replies to send, so each test scripts exactly what the server says.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable

import msgspec
import pytest
import uvloop
import zmq

from runtime.client import AsyncClient, Client, RequestError, RequestTimeout
from runtime.protocol.messages import (
    AbortReq,
    ChunkMeta,
    ClientRequest,
    ControlReply,
    ErrorReply,
    FlushCacheReq,
    GenerateChunk,
    GenerateChunks,
    GenerateReq,
    HealthReq,
    ServerInfoReq,
)

Handler = Callable[["FakeServer", bytes, Any], list[Any]]


class FakeServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.received: "queue.Queue[Any]" = queue.Queue()
        self.outbox: "queue.Queue[tuple[bytes, bytes]]" = queue.Queue()  # replies sent later by tests
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        dec = msgspec.msgpack.Decoder(ClientRequest)
        enc = msgspec.msgpack.Encoder()
        while not self._stop.is_set():
            while not self.outbox.empty():
                self.sock.send_multipart(list(self.outbox.get()))
            if not self.sock.poll(20):
                continue
            identity, payload = self.sock.recv_multipart()
            req = dec.decode(payload)
            self.received.put(req)
            for reply in self.handler(self, identity, req):
                self.sock.send_multipart([identity, reply if isinstance(reply, bytes) else enc.encode(reply)])

    def send_later(self, identity: bytes, msg: Any) -> None:
        self.outbox.put((identity, msgspec.msgpack.encode(msg)))

    def next_received(self, timeout: float = 5.0) -> Any:
        return self.received.get(timeout=timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.ctx.term()


def echo_handler(server: FakeServer, identity: bytes, req: Any) -> list[Any]:
    """Non-stream: text = prompt reversed; stream: one chunk per character."""
    if isinstance(req, GenerateReq):
        text = req.text or "".join(chr(65 + i % 26) for i in (req.input_ids or []))
        meta = {"prompt_tokens": len(text), "completion_tokens": len(text), "cached_tokens": 0}
        n = (req.sampling_params or {}).get("n", 1)
        if req.stream:
            return [b""] + [  # an empty keepalive frame first: the client must ignore it
                GenerateChunk(
                    rid=req.rid,
                    text=c,
                    output_ids=[ord(c)],
                    finished=i == len(text) - 1,
                    finish_reason={"type": "length", "length": len(text)} if i == len(text) - 1 else None,
                    meta=ChunkMeta(**meta),
                )
                for i, c in enumerate(text)
            ]
        return [
            GenerateChunk(
                rid=req.rid,
                text=text[::-1] + (str(i) if n > 1 else ""),
                output_ids=[ord(c) for c in text],
                finished=True,
                finish_reason={"type": "length", "length": len(text)},
                meta=ChunkMeta(**meta, **({"index": i} if n > 1 else {})),
            )
            for i in reversed(range(n))  # out of order on purpose
        ]
    if isinstance(req, AbortReq):
        return [ControlReply(rid=req.rid, kind="abort", payload={"aborted": True})]
    if isinstance(req, FlushCacheReq):
        return [ControlReply(rid=req.rid, kind="flush_cache", payload={"success": True})]
    if isinstance(req, ServerInfoReq):
        return [ControlReply(rid=req.rid, kind="server_info", payload={"num_running": 0})]
    if isinstance(req, HealthReq):
        return [ControlReply(rid=req.rid, kind="health", payload={"ok": True})]
    return []


@pytest.fixture()
def server() -> Any:
    s = FakeServer(echo_handler)
    yield s
    s.close()


def test_generate_returns_a_result_dict(server: FakeServer) -> None:
    with Client(server.address, api_key="k") as c:
        r = c.generate("abc", {"max_new_tokens": 3, "temperature": 0})
        assert r["text"] == "cba" and r["output_ids"] == [97, 98, 99]
        assert r["meta"]["completion_tokens"] == 3
        sent = server.next_received()
        assert isinstance(sent, GenerateReq)
        assert sent.text == "abc" and sent.sampling_params == {"max_new_tokens": 3, "temperature": 0}
        assert sent.api_key == "k" and not sent.stream and len(sent.rid) == 32  # uuid4 hex
        r = c.generate(input_ids=[0, 1], rid="mine")
        assert r["rid"] == "mine" and r["text"] == "BA"


def test_batch_is_sent_at_once_and_keeps_order() -> None:
    """The fake server answers only when the whole batch has arrived, in reverse order."""
    held: list[GenerateReq] = []

    def handler(server: FakeServer, identity: bytes, req: Any) -> list[Any]:
        held.append(req)
        if len(held) < 5:
            return []
        return [GenerateChunk(rid=r.rid, text=r.text.upper(), output_ids=[], finished=True) for r in reversed(held)]

    s = FakeServer(handler)
    try:
        with Client(s.address) as c:
            prompts = ["a", "b", "c", "d", "e"]
            results = c.generate(prompts, {"max_new_tokens": 1})
            assert [r["text"] for r in results] == ["A", "B", "C", "D", "E"]
    finally:
        s.close()


def test_stream_yields_deltas_and_an_early_break_aborts(server: FakeServer) -> None:
    with Client(server.address) as c:
        chunks = list(c.generate("hello", stream=True))
        assert "".join(ch["text"] for ch in chunks) == "hello"
        assert [ch["finished"] for ch in chunks] == [False] * 4 + [True]
        assert chunks[-1]["finish_reason"] == {"type": "length", "length": 5}
        server.next_received()
        gen = c.generate("a long prompt", stream=True, rid="s1")
        assert next(gen)["text"] == "a"
        gen.close()  # the caller stops reading
        sent = server.next_received()
        assert isinstance(sent, GenerateReq) and sent.stream
        abort = server.next_received()
        assert isinstance(abort, AbortReq) and abort.rid == "s1"


def test_error_reply_raises_for_that_request_only() -> None:
    def handler(server: FakeServer, identity: bytes, req: Any) -> list[Any]:
        if isinstance(req, GenerateReq) and req.text == "bad":
            return [ErrorReply(rid=req.rid, code="invalid_request", message="sampling_params.top_k: nope")]
        return echo_handler(server, identity, req)

    s = FakeServer(handler)
    try:
        with Client(s.address) as c:
            with pytest.raises(RequestError) as exc:
                c.generate("bad")
            assert exc.value.code == "invalid_request" and "top_k" in exc.value.message
            with pytest.raises(RequestError) as exc:
                c.generate(["ok", "bad", "fine"])
            results = exc.value.results
            assert results is not None and results[0]["text"] == "ko" and results[2]["text"] == "enif"
            assert isinstance(results[1], RequestError)
            assert c.generate("still")["text"] == "llits"  # the client keeps working
    finally:
        s.close()


def test_timeout_raises_and_aborts() -> None:
    s = FakeServer(lambda server, identity, req: [])  # never answers
    try:
        with Client(s.address, timeout=0.3) as c:
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout) as exc:
                c.generate("x", rid="slow")
            assert isinstance(exc.value, TimeoutError)
            assert time.monotonic() - t0 < 3
            assert isinstance(s.next_received(), GenerateReq)
            abort = s.next_received()
            assert isinstance(abort, AbortReq) and abort.rid == "slow"
            assert c.health(timeout=0.2) is False
    finally:
        s.close()


def test_parallel_samples_come_back_in_index_order(server: FakeServer) -> None:
    with Client(server.address) as c:
        r = c.generate("ab", {"n": 3})
        assert [x["text"] for x in r] == ["ba0", "ba1", "ba2"]


def test_control_calls(server: FakeServer) -> None:
    with Client(server.address) as c:
        assert c.flush_cache() == {"success": True}
        assert c.server_info() == {"num_running": 0}
        assert c.health() is True
        assert c.abort("some-rid") is True


def test_abort_ends_a_pending_generate() -> None:
    """abort() from another thread: the pending generate gets the server's final chunk."""

    def handler(server: FakeServer, identity: bytes, req: Any) -> list[Any]:
        if isinstance(req, AbortReq):
            return [
                GenerateChunk(rid=req.rid, text="", output_ids=[], finished=True, finish_reason={"type": "abort"}),
                ControlReply(rid=req.rid, kind="abort", payload={"aborted": True}),
            ]
        return []

    s = FakeServer(handler)
    try:
        with Client(s.address) as c:
            result: dict[str, Any] = {}
            t = threading.Thread(target=lambda: result.update(c.generate("x", rid="r1")))
            t.start()
            assert isinstance(s.next_received(), GenerateReq)
            assert c.abort("r1") is True
            t.join(5)
            assert result["meta"] == {} and result["text"] == ""
    finally:
        s.close()


def test_async_client_on_uvloop(server: FakeServer) -> None:
    async def main() -> None:
        async with AsyncClient(server.address) as c:
            r = await c.generate("xyz")
            assert r["text"] == "zyx"
            rs = await c.generate(["a", "bc"])
            assert [x["text"] for x in rs] == ["a", "cb"]
            text = ""
            async for ch in c.generate("stream", stream=True):
                text += ch["text"]
            assert text == "stream"
            it = await c.generate("again", stream=True)  # the awaited form works too
            assert [ch["text"] async for ch in it] == list("again")
            assert await c.server_info() == {"num_running": 0}

    uvloop.run(main())


def test_a_frame_of_several_streams_chunks_feeds_each_stream() -> None:
    """The server sends a step's chunks for several requests of one client as one GenerateChunks
    frame: each stream gets its own chunks, in order, and ends at its own last one."""
    held: list[GenerateReq] = []

    def handler(server: FakeServer, identity: bytes, req: Any) -> list[Any]:
        if not isinstance(req, GenerateReq):
            return []
        held.append(req)
        if len(held) < 2:
            return []
        a, b = held
        steps: list[Any] = [
            GenerateChunks(
                [
                    GenerateChunk(rid=a.rid, text=f"a{i}", output_ids=[i], finished=False),
                    GenerateChunk(rid=b.rid, text=f"b{i}", output_ids=[i], finished=i == 1),
                ]
            )
            for i in range(2)
        ]
        return steps + [GenerateChunk(rid=a.rid, text="a2", output_ids=[2], finished=True)]  # b has ended

    s = FakeServer(handler)
    try:

        async def main() -> None:
            async with AsyncClient(s.address) as c:

                async def collect(prompt: str) -> list[str]:
                    return [ch["text"] async for ch in c.generate(prompt, stream=True)]

                return await asyncio.gather(collect("x"), collect("y"))

        first, second = uvloop.run(main())
        streams = {tuple(first), tuple(second)}
        assert streams == {("a0", "a1", "a2"), ("b0", "b1")}
    finally:
        s.close()


def test_close_aborts_requests_in_flight() -> None:
    s = FakeServer(lambda server, identity, req: [])
    try:

        async def main() -> None:
            c = AsyncClient(s.address)
            task = asyncio.ensure_future(c.generate("x", rid="inflight"))
            assert isinstance(await asyncio.get_running_loop().run_in_executor(None, s.next_received), GenerateReq)
            await c.close()
            with pytest.raises(ConnectionError):
                await task

        asyncio.run(main())
        abort = s.next_received()
        assert isinstance(abort, AbortReq) and abort.rid == "inflight"
    finally:
        s.close()


def test_argument_errors_are_raised_locally() -> None:
    c = AsyncClient("tcp://127.0.0.1:1")
    with pytest.raises(ValueError):
        c.generate()
    with pytest.raises(ValueError):
        c.generate("a", input_ids=[1])
    with pytest.raises(ValueError):
        c.generate(["a", "b"], stream=True)
    with pytest.raises(ValueError):
        c.generate(["a", "b"], rid="one")
    asyncio.run(c.close())


def test_a_rejected_batch_leaves_no_rid_registered(server: FakeServer) -> None:
    """Repeated rids in a batch are refused before anything is sent, and the rids stay usable."""
    with Client(server.address) as c:
        with pytest.raises(ValueError, match="distinct rids"):
            c.generate(["x", "y"], rid=["a", "a"])
        assert c.generate("x", rid="a")["rid"] == "a"


def test_a_request_the_client_cannot_encode_is_a_request_error(server: FakeServer) -> None:
    """Values msgpack cannot carry (a lone surrogate, an int past 64 bits, an unknown type)
    fail that request alone with RequestError("invalid_request"), before anything is sent."""
    with Client(server.address) as c:
        with pytest.raises(RequestError) as exc:
            c.generate("lone \ud800 surrogate", rid="bad")
        assert exc.value.code == "invalid_request" and exc.value.rid == "bad"
        assert "UnicodeEncodeError" in exc.value.message and "surrogate" in exc.value.message
        for kwargs in (
            {"input_ids": [1, 2**70]},
            {"prompt": "x", "sampling_params": {"stop": object()}},
            {"messages": [{"role": "user", "content": "\udfff"}]},
        ):
            with pytest.raises(RequestError, match="cannot be encoded") as exc:
                c.generate(**kwargs)
            assert exc.value.code == "invalid_request"
        with pytest.raises(RequestError, match="UnicodeEncodeError"):
            list(c.generate("\ud800", stream=True))
        with pytest.raises(RequestError, match="UnicodeEncodeError"):
            c.abort("rid-\ud800")
        assert c.generate("x", rid="bad")["text"] == "x"  # nothing of the failed one stayed registered
        sent = server.next_received()
        assert isinstance(sent, GenerateReq) and sent.rid == "bad" and sent.text == "x"  # the first thing sent
        # In a batch the unencodable prompt fails in its place; the others are sent and answered.
        with pytest.raises(RequestError) as exc:
            c.generate(["ok", "b\ud800d", "fine"])
        results = exc.value.results
        assert results is not None and results[0]["text"] == "ko" and results[2]["text"] == "enif"
        assert isinstance(results[1], RequestError) and results[1].code == "invalid_request"
        assert sorted(server.next_received().text for _ in range(2)) == ["fine", "ok"]
        assert server.received.empty()


def test_async_client_encoding_failure_is_a_request_error(server: FakeServer) -> None:
    async def main() -> None:
        async with AsyncClient(server.address) as c:
            with pytest.raises(RequestError, match="UnicodeEncodeError"):
                await c.generate("\ud800")
            with pytest.raises(RequestError, match="OverflowError"):
                async for _ in c.generate(input_ids=[-(2**64)], stream=True):
                    pass
            with pytest.raises(RequestError, match="UnicodeEncodeError"):
                await c.abort("\ud800")
            assert (await c.generate("ab"))["text"] == "ba"

    uvloop.run(main())


def embedding_handler(server: FakeServer, identity: bytes, req: Any) -> list[Any]:
    """An embedding server: the vector of a request is its rid's length and its input's length;
    ``long`` is refused as too long; ``late`` finishes aborted (its deadline passed) without a vector."""
    if not isinstance(req, GenerateReq) or not req.embed:
        return [ErrorReply(rid=getattr(req, "rid", ""), code="invalid_request", message="serves embeddings")]
    if req.text == "long":
        return [ErrorReply(rid=req.rid, code="too_long", message="the input has 600 tokens")]
    if req.text == "late":
        reason = {"type": "abort", "message": "timeout"}  # (a finished chunk's meta repeats it, as the server's does)
        meta = ChunkMeta(finish_reason=reason)
        return [GenerateChunk(rid=req.rid, text="", output_ids=[], finished=True, finish_reason=reason, meta=meta)]
    size = len(req.text or "") + len(req.text_pair or "") + len(req.input_ids or [])
    meta = ChunkMeta(prompt_tokens=size, completion_tokens=0, embedding=[float(len(req.rid)), float(size), 0.5])
    return [
        GenerateChunk(rid=req.rid, text="", output_ids=[], finished=True, finish_reason={"type": "stop"}, meta=meta)
    ]


def test_embed_sends_an_embedding_request_and_returns_its_vector() -> None:
    s = FakeServer(embedding_handler)
    try:
        with Client(s.address, api_key="k") as c:
            assert c.embed("query", text_pair="doc", truncate_prompt_tokens=-1) == [32.0, 8.0, 0.5]
            sent = s.next_received()
            assert isinstance(sent, GenerateReq) and sent.embed and sent.api_key == "k"
            assert (sent.text, sent.text_pair, sent.truncate_prompt_tokens, sent.input_ids) == (
                "query",
                "doc",
                -1,
                None,
            )
            assert c.embed(input_ids=[1, 2, 3], rid="r") == [1.0, 3.0, 0.5]
            with pytest.raises(RequestError) as exc:
                c.embed("long")
            assert exc.value.code == "too_long" and "600 tokens" in exc.value.message
            with pytest.raises(RequestError) as exc:
                c.embed("late")
            assert exc.value.code == "aborted" and exc.value.message == "timeout"
            with pytest.raises(ValueError):
                c.embed()
            with pytest.raises(ValueError):
                c.embed(input_ids=[1], text_pair="doc")

        async def main() -> None:
            async with AsyncClient(s.address) as ac:
                vectors = await asyncio.gather(*(ac.embed(t) for t in ("a", "bb", "ccc")))
                assert [v[1] for v in vectors] == [1.0, 2.0, 3.0]

        uvloop.run(main())
    finally:
        s.close()
