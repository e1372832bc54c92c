"""SGLang's Model Gateway (sglang-router 0.3.2, its Rust binary from the test extra) in front of two
tinyserve servers on the tiny Llama, one pair of servers for the whole module and a gateway per policy
(tests/support/gateway_process.py):

* OpenAI completions and chat, whole and streamed, through the gateway with the openai SDK, and
  SGLang's native /generate (the gateway re-serializes its body with fields of its own: ``model``,
  ``return_hidden_states`` ...), whole and streamed: the same greedy tokens as a worker gives directly;
* the gateway's health and readiness, its view of the workers, a cache flush fanned out to both;
* round_robin reaches both workers, counted by each worker's own ``num_received``;
* cache_aware keeps a family of prompts that share a long prefix on one worker, whose prefix cache then
  serves it (``usage.prompt_tokens_details.cached_tokens``);
* a client that drops a stream through the gateway aborts the request on its worker, KV freed;
* a worker killed with SIGKILL leaves the rotation: every later request succeeds (the gateway's retry
  first, its health check, every second here, then marks the worker unhealthy), all on the survivor.

After each test every live worker is idle and its memory invariant holds.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
from typing import Any, Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionUserMessageParam

from tests.support.gateway_process import GatewayProcess, http_json
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args, is_idle, wait_gone, wait_until
from tests.support.server_process import ServedClient, ServerProcess

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over the lazy dog."
GREEDY = {"temperature": 0, "ignore_eos": True}
IGNORE_EOS = {"ignore_eos": True}  # the openai SDK's extra_body
NEW_TOKENS = 8
# The gateway's health check every second, one failure enough: a dead worker leaves within ~1 s.
HEALTH_FLAGS = [
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--health-check-timeout-secs",
    "2",
]
IDLE_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def workers(tiny_checkpoints: Any) -> Iterator[list[ServedClient]]:
    """Two servers on the tiny Llama, started at once (each start is seconds of imports)."""
    args = base_args(tiny_checkpoints.path("llama"), "--served-model-name", MODEL, "--port", "0")
    servers = [ServerProcess(args, wait=False) for _ in range(2)]
    clients: list[ServedClient] = []
    try:
        for server in servers:
            server.wait_ready()
        clients = [ServedClient(s, api_key=None, timeout=CLIENT_TIMEOUT_S) for s in servers]
        yield clients
    finally:
        for client in clients:
            client.close()
        for server in servers:
            server.stop()


def http_url(worker: ServedClient) -> str:
    assert worker.server.http_address is not None
    return worker.server.http_address


@pytest.fixture(scope="module")
def round_robin(workers: list[ServedClient]) -> Iterator[GatewayProcess]:
    with GatewayProcess([http_url(w) for w in workers], "round_robin", HEALTH_FLAGS) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def cache_aware(workers: list[ServedClient]) -> Iterator[GatewayProcess]:
    with GatewayProcess([http_url(w) for w in workers], "cache_aware", HEALTH_FLAGS) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def workers_end_idle(workers: list[ServedClient]) -> Iterator[None]:
    """The memory invariant after each test, on every worker still alive."""
    yield
    for worker in workers:
        if worker.server.process.poll() is not None:
            continue  # the killed one
        info = wait_until(lambda: is_idle(worker), IDLE_TIMEOUT_S, f"{http_url(worker)} idle")
        assert info["memory_invariant"]["ok"], info["memory_invariant"]


def received(workers: list[ServedClient]) -> list[int]:
    """Each worker's count of generation requests received (its own counter, not the gateway's)."""
    return [w.server_info()["num_received"] for w in workers]


def moved(workers: list[ServedClient], before: list[int]) -> list[int]:
    return [now - then for now, then in zip(received(workers), before)]


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)


def complete(gateway: GatewayProcess, prompt: str, max_tokens: int = 2) -> dict[str, Any]:
    """One non-streamed completion through the gateway; its body (status 200 asserted)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **GREEDY}
    status, reply = http_json(gateway.url + "/v1/completions", "POST", body, timeout=CLIENT_TIMEOUT_S)
    assert status == 200, reply
    return dict(reply)


def sse_events(url: str, body: dict[str, Any]) -> list[Any]:
    """A streamed POST's server-sent events, each ``data:`` parsed (``[DONE]`` kept as the string)."""
    status, raw = _post_raw(url, body)
    assert status == 200, raw
    events = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _post_raw(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    host, _, rest = url.removeprefix("http://").partition("/")
    conn = http.client.HTTPConnection(host, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request("POST", "/" + rest, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# ---------------------------------------------------------------------- the routes through the gateway


def test_openai_completions_and_chat_through_the_gateway(
    workers: list[ServedClient], round_robin: GatewayProcess
) -> None:
    via, direct = sdk(round_robin.url), sdk(http_url(workers[0]))
    greedy: dict[str, Any] = {"max_tokens": NEW_TOKENS, "temperature": 0, "extra_body": IGNORE_EOS}
    want = direct.completions.create(model=MODEL, prompt=PROMPT, **greedy).choices[0].text
    got = via.completions.create(model=MODEL, prompt=PROMPT, **greedy)
    assert got.choices[0].text == want and got.usage is not None and got.usage.completion_tokens == NEW_TOKENS

    pieces = via.completions.create(
        model=MODEL, prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **greedy
    )
    chunks = list(pieces)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == NEW_TOKENS

    user: ChatCompletionUserMessageParam = {"role": "user", "content": PROMPT}
    want_chat = direct.chat.completions.create(model=MODEL, messages=[user], **greedy).choices[0].message.content
    got_chat = via.chat.completions.create(model=MODEL, messages=[user], **greedy)
    assert got_chat.choices[0].message.content == want_chat and got_chat.model == MODEL
    stream = via.chat.completions.create(
        model=MODEL, messages=[user], stream=True, max_tokens=NEW_TOKENS, temperature=0, extra_body=IGNORE_EOS
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == want_chat
    assert deltas[-1].finish_reason == "length"


def test_native_generate_through_the_gateway(workers: list[ServedClient], round_robin: GatewayProcess) -> None:
    body: dict[str, Any] = {"text": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS, **GREEDY}}
    status, want = http_json(http_url(workers[0]) + "/generate", "POST", body)
    assert status == 200, want
    # the gateway adds fields of its own to SGLang's body ("model": null, "return_hidden_states" ...)
    status, got = http_json(round_robin.url + "/generate", "POST", body)
    assert status == 200, got
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    assert got["meta_info"]["completion_tokens"] == NEW_TOKENS

    events = sse_events(round_robin.url + "/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]" and len(events) >= 2
    last = events[-2]
    assert last["text"] == want["text"] and last["meta_info"]["completion_tokens"] == NEW_TOKENS


def test_gateway_health_readiness_and_cache_flush(workers: list[ServedClient], round_robin: GatewayProcess) -> None:
    urls = [http_url(w) for w in workers]
    assert round_robin.get("/health")[0] == 200
    assert round_robin.readiness() == {"status": "ready", "healthy_workers": 2, "total_workers": 2}
    assert round_robin.workers() == {url: True for url in urls}
    for url in urls:  # what the gateway's health check may call (--health-check-endpoint)
        assert http_json(url + "/health")[0] == 200 and http_json(url + "/health_generate")[0] == 200
    status, info = round_robin.get("/get_model_info")  # passed on to a worker
    assert status == 200 and info["served_model_name"] == MODEL

    complete(round_robin, PROMPT * 3)  # something in one worker's prefix cache
    for worker in workers:  # a flush waits for no request: it needs an idle server
        wait_until(lambda: is_idle(worker), IDLE_TIMEOUT_S, f"{http_url(worker)} idle")
    status, flushed = http_json(round_robin.url + "/flush_cache", "POST")
    assert status == 200 and flushed["status"] == "success" and flushed["workers_flushed"] == 2, flushed
    for worker in workers:  # both flushed: nothing cached left to evict
        assert worker.server_info()["evictable_tokens"] == 0


# ---------------------------------------------------------------------- policies


def test_round_robin_reaches_both_workers(workers: list[ServedClient], round_robin: GatewayProcess) -> None:
    before = received(workers)
    for i in range(6):
        complete(round_robin, f"{PROMPT} {i}")
    assert moved(workers, before) == [3, 3]


def test_cache_aware_keeps_a_shared_prefix_on_one_worker(
    workers: list[ServedClient], cache_aware: GatewayProcess
) -> None:
    """Two families of four prompts, each family a long prefix of its own and a short question, sent
    interleaved one at a time: each family's requests all reach one worker (whichever: a second family
    may share it), and from its second request on that worker's prefix cache holds the prefix."""
    prefixes = [
        "Alpha system prompt: " + " ".join(f"rule {k} says be brief" for k in range(24)),
        "Omega system prompt: " + " ".join(f"note {k} asks for care" for k in range(24)),
    ]
    where: dict[int, set[int]] = {0: set(), 1: set()}
    for question in range(4):
        for family, prefix in enumerate(prefixes):
            before = received(workers)
            reply = complete(cache_aware, f"{prefix}\nQuestion {question}: why?")
            steps = moved(workers, before)
            assert sorted(steps) == [0, 1], steps
            where[family].add(steps.index(1))
            usage = reply["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if question == 0:
                assert cached < usage["prompt_tokens"] // 2, usage  # a prefix no worker has seen
            else:
                assert cached >= usage["prompt_tokens"] - 8, usage  # all but the question
    assert [len(w) for w in where.values()] == [1, 1], where


# ---------------------------------------------------------------------- failures


def test_a_dropped_stream_through_the_gateway_frees_its_kv(
    workers: list[ServedClient], round_robin: GatewayProcess
) -> None:
    aborted = [w.server_info()["num_aborted"] for w in workers]
    conn = http.client.HTTPConnection("127.0.0.1", round_robin.port, timeout=CLIENT_TIMEOUT_S)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "stream": True, **GREEDY}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    line = b""
    while not line.startswith(b"data: "):  # the first event: the request runs on a worker
        line = resp.fp.readline()
        assert line, "the stream ended before its first event"
    conn.close()  # the client goes away mid-stream
    resp.close()
    for worker in workers:
        wait_until(lambda: is_idle(worker), IDLE_TIMEOUT_S, f"{http_url(worker)} idle")
    # aborted, not finished: the gateway dropped its connection to the worker, which freed the KV
    assert sum(w.server_info()["num_aborted"] for w in workers) - sum(aborted) == 1


def test_a_killed_worker_leaves_the_rotation(workers: list[ServedClient], round_robin: GatewayProcess) -> None:
    """Runs last: it kills the second worker (the launcher with SIGKILL; its children die with it)."""
    survivor, victim = workers
    pids = [int(p) for p in victim.server_info()["processes"].values()]
    os.kill(victim.server.pid, signal.SIGKILL)
    assert wait_gone(pids, 30.0) == []
    before = survivor.server_info()["num_received"]
    # whether or not the health check has noticed yet: a request the gateway sends to the dead worker
    # fails to connect, and its retry goes to the survivor
    for i in range(4):
        complete(round_robin, f"{PROMPT} after the kill {i}")
    wait_until(
        lambda: round_robin.workers() == {http_url(survivor): True, http_url(victim): False},
        15.0,
        "the gateway's health check to mark the killed worker unhealthy",
    )
    assert round_robin.readiness() == {"status": "ready", "healthy_workers": 1, "total_workers": 2}
    for i in range(6):
        complete(round_robin, f"{PROMPT} once it is out {i}")
    # every one of the ten reached the survivor exactly once
    assert survivor.server_info()["num_received"] - before == 10
