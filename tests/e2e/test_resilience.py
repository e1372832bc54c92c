"""Resilience of the front door (issue 17), end to end on loopback with bounded loops.

* A stopping or dead server is noticed: SIGTERM (without a drain) under load answers every request in
  flight (ZMQ and HTTP, stream and not) with ``server_shutdown``; a killed scheduler makes
  the launcher stop the server, and a stream with the default timeout (none) raises
  within 10 s.
* Fairness: 20,000 control requests that one socket never reads leave another client's
  2-token generate under 1 s; a 10 MB prompt (ZMQ and HTTP), a 1 MB one and a
  100,000-entry stop list are refused while another client's latency stays within 4x its
  idle value; the per-client limits answer ``too_many_requests`` (HTTP 429); abort_all on
  a server without --api-key only aborts the caller's own requests.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import msgspec
import pytest
import zmq

pytest.register_assert_rewrite("server_fixtures")

from runtime.client import Client, RequestError  # noqa: E402
from runtime.protocol.messages import ServerInfoReq  # noqa: E402
from tests.support import REPO_ROOT as REPO
from tests.support.server_fixtures import base_args, wait_until  # noqa: E402
from tests.support.server_process import ServerProcess, launch_server  # noqa: E402

pytest_plugins = ["tests.support.server_fixtures"]

LONG = {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0}  # the tiny models' context is 512
MAX_REQUESTS_PER_CLIENT = 8


def _http(address: str, path: str, body: bytes, timeout: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(address + path, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _sse_events(address: str, body: dict[str, Any]) -> list[Any]:
    """POST a streaming /generate; every event until [DONE]."""
    req = urllib.request.Request(
        address + "/generate",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            events.append(json.loads(payload))
    return events


def _latency(client: Client) -> float:
    t0 = time.perf_counter()
    client.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "temperature": 0})
    return time.perf_counter() - t0


# ====================================================================== a stopping or dead server


def test_sigterm_under_load_answers_every_request_with_server_shutdown(tiny_llama_path: Path) -> None:
    # Two running at a time, so that the seven stay in flight for seconds.
    server = ServerProcess(
        [*base_args(tiny_llama_path), "--max-running-requests", "2", "--port", "0", "--graceful-shutdown-timeout", "0"]
    )  # no drain: the plain stop
    outcomes: dict[str, Any] = {}

    def zmq_request(name: str, stream: bool) -> None:
        try:
            with Client(server.address or "", timeout=None) as c:
                if stream:
                    for _ in c.generate(input_ids=[5] * 4, sampling_params=LONG, stream=True):
                        pass
                else:
                    c.generate(input_ids=[5] * 4, sampling_params=LONG)
            outcomes[name] = "finished"
        except RequestError as exc:
            outcomes[name] = exc.code

    def http_request(name: str, stream: bool) -> None:
        body = {"input_ids": [5] * 4, "sampling_params": LONG, "stream": stream}
        try:
            if stream:
                events = _sse_events(server.http_address or "", body)
                outcomes[name] = [e["error"]["code"] for e in events if "error" in e]
            else:
                status, raw = _http(server.http_address or "", "/generate", json.dumps(body).encode())
                outcomes[name] = (status, json.loads(raw)["error"]["code"])
        except Exception as exc:  # reported by the asserts below
            outcomes[name] = repr(exc)

    jobs = [
        ("zmq-stream-0", zmq_request, True),
        ("zmq-stream-1", zmq_request, True),
        ("zmq-stream-2", zmq_request, True),
        ("zmq-0", zmq_request, False),
        ("zmq-1", zmq_request, False),
        ("http-stream", http_request, True),
        ("http", http_request, False),
    ]
    threads = [threading.Thread(target=fn, args=(name, stream)) for name, fn, stream in jobs]
    try:
        for t in threads:
            t.start()
        with Client(server.address or "", timeout=60) as probe:
            wait_until(
                lambda: probe.server_info()["tokenizer"]["active_requests"] == len(jobs), 60, "every request in flight"
            )
        t0 = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(10)
        answered_in = time.monotonic() - t0
        code = server.process.wait(30)
    finally:
        server.stop()
    assert not any(t.is_alive() for t in threads)
    assert answered_in < 10
    for name, _, stream in jobs:
        if name.startswith("zmq"):
            assert outcomes[name] == "server_shutdown", (name, outcomes)
    assert outcomes["http"] == (503, "server_shutdown"), outcomes
    assert outcomes["http-stream"] == ["server_shutdown"], outcomes
    assert code == 0, server.log_tail()


def test_a_killed_scheduler_ends_streams_within_10_s(tiny_llama_path: Path) -> None:
    server = ServerProcess([*base_args(tiny_llama_path), "--port", "0"])
    try:
        with Client(server.address or "") as c:  # the default timeout: none
            assert c.timeout is None
            processes = c.server_info()["processes"]
            stream = c.generate(input_ids=[5] * 4, sampling_params=LONG, stream=True)
            next(stream)
            os.kill(processes["scheduler-0"], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RequestError) as exc:
                for _ in stream:
                    pass
            elapsed = time.monotonic() - t0
        assert server.process.wait(10) != 0
    finally:
        server.stop()
    assert elapsed < 10
    assert exc.value.code in ("server_shutdown", "server_gone"), exc.value


# ====================================================================== fairness


@pytest.fixture(scope="module")
def fair_server(tiny_checkpoints: Any) -> Iterator[Client]:
    """No --api-key; small per-client request limit; the defaults otherwise."""
    args = base_args(tiny_checkpoints.path("llama"), "--max-requests-per-client", str(MAX_REQUESTS_PER_CLIENT))
    with launch_server(args, client_timeout=60) as client:
        yield client


def test_unread_control_flood_from_one_socket_leaves_others_served(fair_server: Client) -> None:
    c = fair_server
    dropped_before = c.server_info()["tokenizer"]["replies_dropped"]
    ctx = zmq.Context()
    flood = ctx.socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 0)
    flood.connect(c.address)
    try:
        enc = msgspec.msgpack.Encoder()
        for i in range(20_000):
            flood.send(enc.encode(ServerInfoReq(rid=f"flood-{i}")))
        latencies = [_latency(c) for _ in range(5)]
        t0 = time.perf_counter()
        assert c.health()
        health = time.perf_counter() - t0
        # What the flooding socket was told: the calls over its limit were refused, and
        # what did not fit its bounded send queue was dropped (it was not reading).
        codes: dict[str, int] = {}
        while flood.poll(2000):
            frame = flood.recv()
            if frame:
                msg = msgspec.msgpack.decode(frame)
                key = msg.get("code", msg["type"])
                codes[key] = codes.get(key, 0) + 1
    finally:
        flood.close()
        ctx.term()
    assert max(latencies) < 1.0, latencies
    assert health < 1.0
    assert codes.get("too_many_requests", 0) > 0, codes
    dropped = c.server_info()["tokenizer"]["replies_dropped"] - dropped_before
    assert sum(codes.values()) + dropped == 20_000, (codes, dropped)


# A hostile client in its own process (so that its encoding does not share this process's
# GIL with the latency probe): it sends, one after another until told to stop, a 10 MB text
# prompt over ZMQ (over --max-request-bytes: its connection is closed), the same over HTTP
# (413, or the connection reset when the answer comes before the whole body is sent), a 1 MB one (under the frame limit, over the prompt's byte limit: too_long) and a
# 100,000-entry stop list (invalid_request), and prints what each got.
HOSTILE = r"""
import json, sys, time, urllib.error, urllib.request
from runtime.client import Client, RequestError
address, http, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
big, mid = "x" * 10_000_000, "y" * 1_000_000
stops = ["s%d" % i for i in range(100_000)]
body = json.dumps({"text": big}).encode()
seen = {}
def note(key):
    seen[key] = seen.get(key, 0) + 1
print("started", flush=True)
deadline = time.monotonic() + seconds
with Client(address, timeout=60) as c:
    while time.monotonic() < deadline:
        for kwargs in ({"prompt": big}, {"prompt": mid}, {"prompt": "hi", "sampling_params": {"stop": stops}}):
            try:
                c.generate(**kwargs)
                note("served")
            except RequestError as exc:
                note(exc.code)
        req = urllib.request.Request(http + "/generate", data=body, method="POST")
        try:
            urllib.request.urlopen(req, timeout=60).read()
            note("http-200")
        except urllib.error.HTTPError as exc:
            note("http-%d" % exc.code)
        except (urllib.error.URLError, ConnectionError):  # refused before the body was all sent
            note("http-413")
print(json.dumps(seen), flush=True)
"""


def test_big_prompts_and_stop_lists_do_not_slow_other_clients(fair_server: Client) -> None:
    c = fair_server
    idle = statistics.median(_latency(c) for _ in range(15))
    hostile = subprocess.Popen(
        [sys.executable, "-c", HOSTILE, c.address, c.server.http_address, "4"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert hostile.stdout is not None and hostile.stdout.readline().strip() == "started"
        busy = []
        while hostile.poll() is None and len(busy) < 10_000:  # probes the whole hostile run
            busy.append(_latency(c))
        out, _ = hostile.communicate(timeout=120)
    finally:
        if hostile.poll() is None:
            hostile.kill()
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen.get("server_gone", 0) >= 1 and seen.get("too_long", 0) >= 1, seen
    assert seen.get("invalid_request", 0) >= 1 and seen.get("http-413", 0) >= 1, seen
    assert "served" not in seen and "http-200" not in seen, seen
    assert len(busy) >= 10
    assert statistics.median(busy) <= 4 * idle, (idle, sorted(busy))
    assert c.health()


def test_too_many_requests_per_client(fair_server: Client) -> None:
    c = fair_server
    streams = [c.generate(input_ids=[5] * 4, sampling_params=LONG, stream=True) for _ in range(MAX_REQUESTS_PER_CLIENT)]
    try:
        for s in streams:
            next(s)  # all in flight
        with pytest.raises(RequestError) as exc:
            c.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})
        assert exc.value.code == "too_many_requests" and "--max-requests-per-client" in exc.value.message
        with Client(c.address, timeout=60) as other:  # the limit is per client
            assert len(other.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})["output_ids"]) == 1
        http = c.server.http_address
        status, raw = _http(
            http,
            "/generate",
            json.dumps(
                {"input_ids": [[5]] * (MAX_REQUESTS_PER_CLIENT + 1), "sampling_params": {"max_new_tokens": 1}}
            ).encode(),
        )
        assert status == 429 and json.loads(raw)["error"]["code"] == "too_many_requests"
    finally:
        for s in streams:
            s.close()  # aborts
    wait_until(lambda: c.server_info()["tokenizer"]["active_requests"] == 0, 30, "the streams aborted")
    assert len(c.generate(input_ids=[5], sampling_params={"max_new_tokens": 1})["output_ids"]) == 1


def test_abort_all_without_api_key_aborts_only_the_callers_requests(fair_server: Client) -> None:
    c = fair_server
    with Client(c.address, timeout=60) as other:
        stream = c.generate(input_ids=[5] * 4, sampling_params={**LONG, "max_new_tokens": 60}, stream=True)
        ids = next(stream)["output_ids"]
        assert other.abort_all() == 0  # not other's to abort
        for chunk in stream:
            ids += chunk["output_ids"]
        assert len(ids) == 60 and chunk["finish_reason"]["type"] == "length"
        own = c.generate(input_ids=[5] * 4, sampling_params=LONG, stream=True)
        next(own)
        assert c.abort_all() == 1
        last = list(own)[-1]
        assert last["finish_reason"]["type"] == "abort"


def test_a_lone_surrogate_is_a_request_error(fair_server: Client) -> None:
    with pytest.raises(RequestError) as exc:
        fair_server.generate("bad \ud800 text", {"max_new_tokens": 1})
    assert exc.value.code == "invalid_request"
    assert fair_server.health()


def test_a_big_prompt_is_tokenized_off_the_loop(fair_server: Client, tiny_checkpoints: Any) -> None:
    """Past OFFLOAD_BYTES (under the byte limit) the prompt is tokenized on the worker thread:
    the tiny models' 512-token context cannot hold it, and the error counts its tokens as
    transformers does."""
    from transformers import AutoTokenizer

    from tokenizer_proc.limits import OFFLOAD_BYTES

    text = "word " * 2000
    assert len(text) > OFFLOAD_BYTES
    expected = len(AutoTokenizer.from_pretrained(tiny_checkpoints.path("llama")).encode(text))
    with pytest.raises(RequestError) as exc:
        fair_server.generate(text, {"max_new_tokens": 2, "temperature": 0})
    assert exc.value.code == "too_long" and f"has {expected} tokens" in exc.value.message
    assert fair_server.health()
