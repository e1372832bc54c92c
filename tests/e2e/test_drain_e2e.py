"""Graceful drain end to end (launch.py on a tiny Llama, CPU): SIGTERM under load lets the
requests that fit in --graceful-shutdown-timeout finish with their whole output, aborts the
rest (finish reason abort), refuses new requests (``draining``: the ZMQ error, HTTP 503 with
Retry-After) and health checks (/health 503) meanwhile, exits 0 and leaves no process; POST
/drain does the same on an idle server at once."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from runtime.client import Client, RequestError
from tests.support.server_fixtures import base_args, wait_gone, wait_until
from tests.support.server_process import ServerProcess

pytest_plugins = ["tests.support.server_fixtures"]

GRACE_S = 3
TOKENS = 150  # the short request: it is stopped near its end, so its last tokens fit in the grace
SHORT = {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
# The long ones (llama_long: 4096 positions): one runs at a time, so after the stop 15 x ~4000
# decode steps are left, one request after another; no CPU does 60000 serial steps in GRACE_S.
LONG_TOKENS = 4000
LONG = {"max_new_tokens": LONG_TOKENS, "ignore_eos": True, "temperature": 0}
REQUESTS = 16  # REQUESTS - 1 long ones, then the short one
SHORT_ID = REQUESTS - 1


def http(address: str, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(address + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def test_sigterm_drains_what_fits_and_aborts_the_rest(tiny_checkpoints: Any) -> None:
    # One request runs at a time; the short one comes last with a higher priority and preempts
    # the running long one, so it is the one decoding when the stop comes, whatever the CPU speed.
    server = ServerProcess(
        [
            *base_args(tiny_checkpoints.path("llama_long")),
            "--max-running-requests",
            "1",
            "--enable-priority-scheduling",
            "--priority-preemption",
            "--port",
            "0",
            "--graceful-shutdown-timeout",
            str(GRACE_S),
            # one token a step: with n-gram drafts (the CPU's default) a tiny model's repetitive
            # greedy output takes up to 9 tokens a step, and the long requests' count above assumes 1
            "--speculative-algorithm",
            "none",
        ]
    )
    results: dict[int, Any] = {}
    streamed: dict[int, list[int]] = {i: [] for i in range(REQUESTS)}
    progress = threading.Condition()

    def run(i: int, sampling_params: dict[str, Any], priority: int) -> None:
        try:
            with Client(server.address or "", timeout=60) as c:
                chunk: dict[str, Any] = {}
                for chunk in c.generate(
                    input_ids=[5, 6, 7 + i], sampling_params=sampling_params, stream=True, priority=priority
                ):
                    with progress:
                        streamed[i].extend(chunk["output_ids"])
                        progress.notify_all()
                results[i] = {"output_ids": streamed[i], "meta": chunk["meta"]}
        except RequestError as exc:
            results[i] = exc.code
        finally:
            with progress:
                progress.notify_all()

    threads = [threading.Thread(target=run, args=(i, LONG, 0)) for i in range(REQUESTS - 1)]
    threads.append(threading.Thread(target=run, args=(SHORT_ID, SHORT, 1)))
    try:
        for t in threads[:-1]:
            t.start()
        with Client(server.address or "", timeout=30) as probe:
            # (No push notice for "queued": the tokenizer's count is polled.)
            wait_until(
                lambda: probe.server_info()["tokenizer"]["active_requests"] == REQUESTS - 1,
                60,
                "every long request in flight",
            )
            threads[-1].start()
            children = [pid for name, pid in probe.server_info()["processes"].items() if name != "launch"]
            # The stop comes when the short request is near its end (its streamed output says so),
            # so that it fits in the grace period however slow this machine is (a loaded 2-core
            # box made 150 tokens take > 3 s), while the long ones cannot however fast it is.
            with progress:
                assert progress.wait_for(lambda: len(streamed[SHORT_ID]) >= TOKENS - 10 or SHORT_ID in results, 120), (
                    "the short request near its end"
                )
            assert SHORT_ID not in results or isinstance(results[SHORT_ID], dict), results[SHORT_ID]
            t0 = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            http_address = server.http_address or ""
            status, headers, body = wait_until(
                lambda: (r := http(http_address, "GET", "/health"))[0] == 503 and r, 10, "/health 503"
            )
            assert json.loads(body)["error"]["code"] == "draining"
            with pytest.raises(RequestError) as refused:
                probe.generate(input_ids=[5], sampling_params={"max_new_tokens": 2})
            assert refused.value.code == "draining"
        status, headers, body = http(
            http_address, "POST", "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}
        )
        assert status == 503 and headers.get("retry-after") == "1"
        assert json.loads(body)["error"]["code"] == "draining"
        code = server.process.wait(30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
    finally:
        server.stop()
    assert code == 0, server.log_tail()
    assert took < GRACE_S + 5, took
    finished = [r for r in results.values() if isinstance(r, dict) and r["meta"]["finish_reason"]["type"] == "length"]
    aborted = [r for r in results.values() if isinstance(r, dict) and r["meta"]["finish_reason"]["type"] == "abort"]
    assert len(finished) + len(aborted) == REQUESTS, results
    assert finished and aborted, {
        i: r if not isinstance(r, dict) else r["meta"]["finish_reason"] for i, r in results.items()
    }
    assert all(len(r["output_ids"]) == TOKENS for r in finished)
    assert all("graceful-shutdown" in r["meta"]["finish_reason"]["message"] for r in aborted)
    assert wait_gone(children, 10) == []


def test_post_drain_on_an_idle_server_exits_0(tiny_llama_path: Path) -> None:
    server = ServerProcess([*base_args(tiny_llama_path), "--port", "0"])
    try:
        with Client(server.address or "", timeout=30) as c:
            assert c.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})["output_ids"]
            children = [pid for name, pid in c.server_info()["processes"].items() if name != "launch"]
        status, _, body = http(server.http_address or "", "POST", "/drain")
        assert status == 200 and json.loads(body)["draining"] is True
        code = server.process.wait(15)
    finally:
        server.stop()
    assert code == 0, server.log_tail()
    assert "drained" in server.log_tail()
    assert wait_gone(children, 10) == []
