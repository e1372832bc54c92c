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

TOKENS = 150
LONG = {"max_new_tokens": TOKENS, "ignore_eos": True, "temperature": 0}
REQUESTS = 16  # one runs at a time: far more work than the grace period holds


def http(address: str, method: str, path: str, body: Any = None) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(address + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def test_sigterm_drains_what_fits_and_aborts_the_rest(tiny_llama_path: Path) -> None:
    server = ServerProcess([*base_args(tiny_llama_path), "--max-running-requests", "1", "--port", "0",
                            "--graceful-shutdown-timeout", "3"])
    results: dict[int, Any] = {}
    streamed: dict[int, list[int]] = {i: [] for i in range(REQUESTS)}

    def run(i: int) -> None:
        try:
            with Client(server.address or "", timeout=60) as c:
                chunk: dict[str, Any] = {}
                for chunk in c.generate(input_ids=[5, 6, 7 + i], sampling_params=LONG, stream=True):
                    streamed[i].extend(chunk["output_ids"])
                results[i] = {"output_ids": streamed[i], "meta": chunk["meta"]}
        except RequestError as exc:
            results[i] = exc.code

    threads = [threading.Thread(target=run, args=(i,)) for i in range(REQUESTS)]
    try:
        for t in threads:
            t.start()
        with Client(server.address or "", timeout=30) as probe:
            wait_until(lambda: probe.server_info()["tokenizer"]["active_requests"] == REQUESTS, 60,
                       "every request in flight")
            children = [pid for name, pid in probe.server_info()["processes"].items() if name != "launch"]
            # The stop comes when the running request is near its end, so that one fits in the grace
            # period however slow this machine is (a loaded 2-core box made 150 tokens take > 3 s).
            wait_until(lambda: max(len(ids) for ids in streamed.values()) >= TOKENS - 10, 60, "one request near its end")
            t0 = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            http_address = server.http_address or ""
            status, headers, body = wait_until(
                lambda: (r := http(http_address, "GET", "/health"))[0] == 503 and r, 10, "/health 503")
            assert json.loads(body)["error"]["code"] == "draining"
            with pytest.raises(RequestError) as refused:
                probe.generate(input_ids=[5], sampling_params={"max_new_tokens": 2})
            assert refused.value.code == "draining"
        status, headers, body = http(http_address, "POST", "/generate",
                                     {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
        assert status == 503 and headers.get("retry-after") == "1"
        assert json.loads(body)["error"]["code"] == "draining"
        code = server.process.wait(30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
    finally:
        server.stop()
    assert code == 0, server.log_tail()
    assert took < 3 + 5, took
    finished = [r for r in results.values() if isinstance(r, dict) and r["meta"]["finish_reason"]["type"] == "length"]
    aborted = [r for r in results.values() if isinstance(r, dict) and r["meta"]["finish_reason"]["type"] == "abort"]
    assert len(finished) + len(aborted) == REQUESTS, results
    assert finished and aborted, {i: r if not isinstance(r, dict) else r["meta"]["finish_reason"]
                                  for i, r in results.items()}
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
