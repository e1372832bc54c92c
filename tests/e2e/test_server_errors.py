"""Bad input end to end: each bad request gets a RequestError naming the problem, while a
long request of another client keeps running and finishes correctly."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
import zmq

pytest.register_assert_rewrite("server_fixtures")

from runtime.client import Client, RequestError  # noqa: E402
from runtime.protocol.messages import GenerateReq  # noqa: E402
from tests.support.server_fixtures import API_KEY  # noqa: E402

pytest_plugins = ["tests.support.server_fixtures"]

GREEDY = {"temperature": 0, "ignore_eos": True}

BAD_REQUESTS = [
    # (generate kwargs, error code, words the message must contain)
    ({"prompt": "hi", "sampling_params": {"temprature": 0.5}}, "invalid_request", ["temprature", "unknown"]),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": "ten"}}, "invalid_request", ["max_new_tokens"]),
    ({"prompt": "hi", "sampling_params": {"temperature": True}}, "invalid_request", ["temperature"]),
    ({"prompt": "hi", "sampling_params": {"temperature": -0.1}}, "invalid_request", ["temperature", ">= 0"]),
    ({"prompt": "hi", "sampling_params": {"top_p": 0.0}}, "invalid_request", ["top_p"]),
    ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "invalid_request", ["top_p"]),
    ({"prompt": "hi", "sampling_params": {"top_k": 0}}, "invalid_request", ["top_k"]),
    ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "invalid_request", ["max_new_tokens"]),
    ({"prompt": "hi", "sampling_params": {"stop_token_ids": [10**6]}}, "invalid_request", ["stop_token_ids"]),
    ({"prompt": "hi", "sampling_params": {"n": 0}}, "invalid_request", ["n"]),
    ({"prompt": ""}, "invalid_request", ["empty prompt"]),
    ({"input_ids": []}, "invalid_request", ["empty prompt"]),
    ({"messages": []}, "invalid_request", ["empty"]),
    ({"messages": [{"content": "no role"}]}, "invalid_request", ["role"]),
    ({"input_ids": [5] * 600}, "too_long", ["600 tokens", "maximum"]),
    ({"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 100}}, "too_long", ["context length"]),
    ({"input_ids": [1, 2, 384]}, "invalid_request", ["384", "vocabulary"]),
    ({"input_ids": [1, -3]}, "invalid_request", ["-3", "vocabulary"]),
    ({"prompt": "hi", "top_logprobs_num": -1}, "invalid_request", ["top_logprobs_num"]),
]


@pytest.fixture(scope="module")
def long_request(llama_server: Client) -> Any:
    """Another client streaming long greedy requests in a loop for as long as this module's
    bad requests arrive; the last test checks every one of them came out whole and equal."""
    state: dict[str, Any] = {"outputs": [], "error": None, "progress": threading.Condition()}
    started, stop = threading.Event(), threading.Event()

    def run() -> None:
        try:
            with Client(llama_server.address, api_key=API_KEY, timeout=120) as c:
                while not stop.is_set():
                    ids = []
                    for ch in c.generate(
                        input_ids=[9] * 10, sampling_params={**GREEDY, "max_new_tokens": 200}, stream=True
                    ):
                        ids += ch["output_ids"]
                        started.set()
                    with state["progress"]:
                        state["outputs"].append(ids)
                        state["progress"].notify_all()
        except BaseException as exc:  # reported by the last test
            state["error"] = exc
            started.set()
            with state["progress"]:
                state["progress"].notify_all()

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    state["stop"], state["thread"] = stop, t
    yield state
    stop.set()
    t.join(120)


@pytest.mark.parametrize("kwargs, code, words", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_request_is_answered_with_a_named_error(
    llama_server: Client, long_request: Any, kwargs: dict[str, Any], code: str, words: list[str]
) -> None:
    with pytest.raises(RequestError) as exc:
        llama_server.generate(**kwargs)
    assert exc.value.code == code, exc.value
    for w in words:
        assert w in exc.value.message, exc.value.message


def test_wrong_or_missing_api_key_is_unauthorized(llama_server: Client, long_request: Any) -> None:
    for key in ("wrong", None):
        with Client(llama_server.address, api_key=key, timeout=60) as c:
            with pytest.raises(RequestError) as exc:
                c.generate("hi", {"max_new_tokens": 2})
            assert exc.value.code == "unauthorized"
            with pytest.raises(RequestError) as exc:
                c.server_info()
            assert exc.value.code == "unauthorized"
            assert c.health() is False


def _raw_exchange(address: str, frames: list[list[bytes]]) -> list[dict[str, Any]]:
    """Send raw multipart messages from one DEALER; one decoded reply per message."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    replies = []
    try:
        for parts in frames:
            sock.send_multipart(parts)
            while True:
                assert sock.poll(60000), "the server did not answer"
                frame = sock.recv()
                if frame:  # skip keepalive probes
                    replies.append(msgspec.msgpack.decode(frame))
                    break
    finally:
        sock.close()
        ctx.term()
    return replies


def test_garbage_frames_get_an_error_and_the_server_keeps_serving(llama_server: Client, long_request: Any) -> None:
    ok = GenerateReq(
        rid="after-garbage", input_ids=[5, 6, 7], sampling_params={**GREEDY, "max_new_tokens": 2}, api_key=API_KEY
    )
    wrong_type = msgspec.msgpack.encode(
        {"type": "generate", "rid": "typed", "text": "hi", "stream": "yes", "api_key": API_KEY}
    )
    unknown_field = msgspec.msgpack.encode(
        {"type": "generate", "rid": "extra", "text": "hi", "colour": 1, "api_key": API_KEY}
    )
    replies = _raw_exchange(
        llama_server.address,
        [
            [b"\xc1\x00 this is not msgpack"],
            [msgspec.msgpack.encode([1, 2, 3])],
            [msgspec.msgpack.encode({"type": "nonsense", "rid": "t"})],
            [wrong_type],
            [unknown_field],
            [b"two", b"frames"],
            [msgspec.msgpack.encode(ok)],
        ],
    )
    garbage, array, tag, typed, extra, multi, answer = replies
    for r in (garbage, array, multi):
        assert (r["type"], r["rid"], r["code"]) == ("error", "", "invalid_request")
    assert (tag["rid"], tag["code"]) == ("t", "invalid_request")
    assert (typed["rid"], typed["code"]) == ("typed", "invalid_request") and "stream" in typed["message"]
    assert (extra["rid"], extra["code"]) == ("extra", "invalid_request") and "colour" in extra["message"]
    assert answer["type"] == "chunk" and answer["rid"] == "after-garbage" and len(answer["output_ids"]) == 2
    assert llama_server.health()
    assert llama_server.server_info()["tokenizer"]["malformed_frames"] >= 6


def test_duplicate_rid_in_flight_is_rejected(llama_server: Client, long_request: Any) -> None:
    slow = msgspec.msgpack.encode(
        GenerateReq(rid="dup", input_ids=[5] * 4, api_key=API_KEY, sampling_params={**GREEDY, "max_new_tokens": 200})
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(llama_server.address)
    try:
        sock.send(slow)
        sock.send(slow)  # the same rid again while the first is in flight
        replies = []
        while len(replies) < 2:
            assert sock.poll(60000)
            frame = sock.recv()
            if frame:
                replies.append(msgspec.msgpack.decode(frame))
    finally:
        sock.close()
        ctx.term()
    kinds = sorted(r["type"] for r in replies)
    assert kinds == ["chunk", "error"]
    err = next(r for r in replies if r["type"] == "error")
    assert err["rid"] == "dup" and "already in flight" in err["message"]


def test_the_other_clients_requests_were_not_disturbed(llama_server: Client, long_request: Any) -> None:
    """Runs last in this module: every long stream that ran meanwhile is whole and identical (at
    least two of them: however fast the host got through the bad requests, the loop runs on until
    a second stream is whole)."""
    with long_request["progress"]:
        assert long_request["progress"].wait_for(
            lambda: len(long_request["outputs"]) >= 2 or long_request["error"] is not None, 120
        ), "two whole streams"
    long_request["stop"].set()
    long_request["thread"].join(120)
    assert long_request["error"] is None, long_request["error"]
    outputs = long_request["outputs"]
    assert len(outputs) >= 2
    assert all(len(o) == 200 for o in outputs)
    assert all(o == outputs[0] for o in outputs)
