"""Production lifecycle end to end: request deadlines and --max-queued-requests, through the ZMQ
client, the openai SDK and raw HTTP, on one small server for the module (tiny Llama with 4096
positions, so a generation outlasts a 1 s deadline; one request running at a time, two waiting).

* a 1 s deadline on a long generation aborts it near 1 s with reason timeout; memory invariant;
* over --max-queued-requests the next request gets ``overloaded`` at once (HTTP 503 with
  Retry-After); the queue drains and later requests succeed; the refusals are counted.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import openai
import pytest

from runtime.client import Client, RequestError
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args, is_idle, wait_until
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

MODEL = "tiny-llama"
LONG = 4000  # tokens: seconds of decoding on the tiny model, far past a 1 s deadline
TIMEOUT_REASON = {"type": "abort", "message": "timeout"}
MAX_QUEUED = 2


@pytest.fixture(scope="module")
def server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(
        tiny_checkpoints.path("llama_long"),
        "--served-model-name",
        MODEL,
        "--enable-metrics",
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        str(MAX_QUEUED),
        max_total_tokens=16384,
    )
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: Client) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.server.http_address + "/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def idle_info(server: Client) -> dict[str, Any]:
    info = wait_until(lambda: is_idle(server), 60, "the server to go idle")
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    return info


def long_params() -> dict[str, Any]:
    return {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}


# ---------------------------------------------------------------------------- deadlines


def test_zmq_deadline_aborts_a_long_generation_near_one_second(server: Client) -> None:
    timed_out = server.server_info()["num_timed_out"]
    start = time.monotonic()
    result = server.generate("Tell me a long story", long_params(), deadline_s=1.0)
    elapsed = time.monotonic() - start
    assert result["meta"]["finish_reason"] == TIMEOUT_REASON
    assert 0 < result["meta"]["completion_tokens"] < LONG
    assert len(result["output_ids"]) == result["meta"]["completion_tokens"]
    assert 0.95 <= elapsed < 5.0, elapsed
    info = idle_info(server)
    assert info["num_timed_out"] == timed_out + 1


def test_zmq_stream_deadline_ends_with_a_timeout_chunk(server: Client) -> None:
    chunks = list(server.generate("Once upon a time", long_params(), stream=True, deadline_s=1.0))
    assert chunks[-1]["finished"] and chunks[-1]["finish_reason"] == TIMEOUT_REASON
    assert 0 < sum(len(c["output_ids"]) for c in chunks) < LONG
    idle_info(server)


def test_openai_timeout_aborts_near_one_second(server: Client, oai: openai.OpenAI) -> None:
    start = time.monotonic()
    reply = oai.completions.create(
        model=MODEL,
        prompt="A long text:",
        max_tokens=LONG,
        temperature=0,
        extra_body={"ignore_eos": True, "timeout": 1},
    )
    elapsed = time.monotonic() - start
    assert reply.choices[0].finish_reason == "abort"
    assert 0 < reply.usage.completion_tokens < LONG
    assert 0.95 <= elapsed < 5.0, elapsed
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Go on"}],
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "deadline_s": 1},
    )
    reasons = [c.choices[0].finish_reason for c in chat if c.choices]
    assert reasons[-1] == "abort" and reasons.count("abort") == 1
    idle_info(server)


def test_no_deadline_no_abort(server: Client) -> None:
    result = server.generate("Short", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert result["meta"]["finish_reason"]["type"] == "length"


# ---------------------------------------------------------------------------- bounded queue


def post(server: Client, path: str, body: Any) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(
        server.server.http_address + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


def test_over_the_queue_bound_is_refused_at_once_then_it_drains(server: Client, oai: openai.OpenAI) -> None:
    before = server.server_info()
    # One request runs (--max-running-requests 1) ...
    stream = server.generate("Keep going", long_params(), stream=True, rid="runner")
    first = next(stream)
    assert not first["finished"]
    # ... two wait: the queue is full.
    short = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    pool = ThreadPoolExecutor(MAX_QUEUED)
    waiting = [pool.submit(server.generate, f"queued {i}", short) for i in range(MAX_QUEUED)]
    wait_until(lambda: server.server_info()["num_queued"] == MAX_QUEUED, 30, "two queued requests")

    start = time.monotonic()
    status, headers, body = post(server, "/v1/completions", {"model": MODEL, "prompt": "one more", "max_tokens": 4})
    assert status == 503 and body["error"]["code"] == "overloaded", body
    assert headers.get("retry-after") == "1"
    with pytest.raises(openai.APIStatusError) as sdk:
        oai.completions.create(model=MODEL, prompt="and another", max_tokens=4)
    assert sdk.value.status_code == 503 and sdk.value.response.headers["retry-after"] == "1"
    with pytest.raises(RequestError) as zmq:
        server.generate("via zmq", short)
    assert zmq.value.code == "overloaded" and "--max-queued-requests" in zmq.value.message
    assert time.monotonic() - start < 5.0  # at once: the running request has seconds left
    assert not any(f.done() for f in waiting)  # nothing waiting was disturbed

    # Drain: the runner is aborted, the queued two run and finish, later requests succeed.
    assert server.abort("runner")
    last = None
    for last in stream:
        pass
    assert last is not None and last["finish_reason"]["type"] == "abort"
    for f in waiting:
        assert f.result(timeout=CLIENT_TIMEOUT_S)["meta"]["finish_reason"]["type"] == "length"
    pool.shutdown()
    assert server.generate("after", short)["meta"]["finish_reason"]["type"] == "length"
    status, _, body = post(server, "/v1/completions", {"model": MODEL, "prompt": "after", "max_tokens": 4})
    assert status == 200, body

    info = idle_info(server)
    assert info["num_refused_overloaded"] == before["num_refused_overloaded"] + 3
    assert info["tokenizer"]["requests_refused_overloaded"] == before["tokenizer"]["requests_refused_overloaded"] + 3
    with urllib.request.urlopen(server.server.http_address + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert f'tinyserve:requests_refused_total{{model_name="{MODEL}",reason="overloaded"}} ' in metrics
