"""Priorities end to end: a server that runs one request at a time, with priority scheduling and
preemption (and overlap, so the preemption waits for the step in flight), through launch.py.

A long low-priority request is decoding when short low ones queue behind it and then a
high-priority one arrives over HTTP (``priority`` in SGLang's /generate body): the high one
preempts the running low one and finishes first; the preempted one resumes and its greedy
output equals the same request run alone.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from typing import Any, Iterator

import pytest

from runtime.client import Client
from tests.support.server_process import launch_server

pytest.register_assert_rewrite("server_fixtures")

from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args, is_idle, wait_until

pytest_plugins = ["tests.support.server_fixtures"]

LONG = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 480}  # the tiny Llama has 512 positions
SHORT = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def priority_server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(
        tiny_checkpoints.path("llama"),
        "--max-running-requests",
        "1",
        "--enable-priority-scheduling",
        "--priority-preemption",
        "--enable-overlap-schedule",
    )
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]  # 0-2 are pad/bos/eos


def http_generate(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    address = client.server.http_address  # type: ignore[attr-defined]
    req = urllib.request.Request(
        address + "/generate",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def test_high_priority_preempts_the_running_request_whose_output_stays_exact(priority_server: Client) -> None:
    vocab = int(priority_server.server_info()["model"]["vocab_size"])
    long_prompt = random_ids(16, vocab, seed=1)
    order: list[str] = []
    lock = threading.Lock()

    def done(name: str) -> None:
        with lock:
            order.append(name)

    def short_low(i: int) -> None:
        priority_server.generate(input_ids=random_ids(16, vocab, seed=10 + i), sampling_params=SHORT)
        done(f"low{i}")

    high: dict[str, Any] = {}

    def high_request() -> None:
        high.update(
            http_generate(
                priority_server, {"input_ids": random_ids(16, vocab, seed=99), "sampling_params": SHORT, "priority": 10}
            )
        )
        done("high")

    threads: list[threading.Thread] = []
    long_ids: list[int] = []
    for chunk in priority_server.generate(input_ids=long_prompt, sampling_params=LONG, stream=True):
        long_ids.extend(chunk["output_ids"])
        if not threads:  # it is decoding: queue three low ones behind it, then the high one
            threads = [threading.Thread(target=short_low, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            time.sleep(0.2)
            threads.append(threading.Thread(target=high_request))
            threads[-1].start()
    done("long")
    for t in threads:
        t.join(CLIENT_TIMEOUT_S)
    assert order[0] == "high", order
    assert len(high["output_ids"]) == SHORT["max_new_tokens"]
    info = wait_until(lambda: is_idle(priority_server), 30, "the priority server to go idle")
    assert info["num_priority_preemptions"] >= 1
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    # The same request alone, from an empty prefix cache: what an unpressured run gives.
    assert priority_server.flush_cache()["success"]
    alone = priority_server.generate(input_ids=long_prompt, sampling_params=LONG)
    assert long_ids == alone["output_ids"]
