"""Session-wide servers for the end-to-end tests (a pytest plugin).

Test modules load it with ``pytest_plugins = ["tests.support.server_fixtures"]`` so that every module
shares the same running servers: each start costs seconds (three processes importing
torch/transformers), so the whole e2e suite starts as few as possible:

* ``llama_server``: tiny Llama, radix cache on, ``--api-key``: equality, streaming,
  prefix cache, bad input, disconnects.
* ``qwen3_server``: tiny Qwen3, ``--disable-radix-cache``, ``--stream-interval 3``; the OpenAI chat
  surface of a Qwen3 server: a Qwen3-style template with tools and thinking (``QWEN3_TEMPLATE``),
  ``--tool-call-parser hermes``, ``--reasoning-parser qwen3``.

Each fixture yields a connected ``Client`` (``client.server`` is the ``ServerProcess``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from runtime.client import Client
from runtime.protocol.child_process import pid_alive
from tests.support.server_process import launch_server

API_KEY = "test-key"
MAX_TOTAL_TOKENS = 6144
QWEN3_TEMPLATE = Path(__file__).parent / "chat_templates" / "qwen3_tools.jinja"
CLIENT_TIMEOUT_S = 120.0


def base_args(model: Path, *extra: str, max_total_tokens: int = MAX_TOTAL_TOKENS) -> list[str]:
    return [
        "--model-path",
        str(model),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--max-total-tokens",
        str(max_total_tokens),
        "--random-seed",
        "0",
        *extra,
    ]


@pytest.fixture(scope="session")
def llama_server(tiny_checkpoints: Any) -> Iterator[Client]:
    with launch_server(
        base_args(tiny_checkpoints.path("llama"), "--api-key", API_KEY), client_timeout=CLIENT_TIMEOUT_S
    ) as client:
        yield client


@pytest.fixture(scope="session")
def qwen3_server(tiny_checkpoints: Any) -> Iterator[Client]:
    with launch_server(
        base_args(
            tiny_checkpoints.path("qwen3"),
            "--disable-radix-cache",
            "--stream-interval",
            "3",
            "--chat-template",
            str(QWEN3_TEMPLATE),
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        ),
        client_timeout=CLIENT_TIMEOUT_S,
    ) as client:
        yield client


@pytest.fixture(scope="session")
def hf_reference(tiny_checkpoints: Any) -> Callable[[str], tuple[Any, Any]]:
    """``name -> (transformers model, tokenizer)``, each loaded once."""
    from transformers import AutoTokenizer

    from tests.support.checkpoints import load_hf_model

    cache: dict[str, tuple[Any, Any]] = {}

    def get(name: str) -> tuple[Any, Any]:
        if name not in cache:
            path = tiny_checkpoints.path(name)
            cache[name] = (load_hf_model(path), AutoTokenizer.from_pretrained(path))
        return cache[name]

    return get


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Re-check a server-side condition until it holds (the server offers no push
    notification for "idle", so this polls a cheap server_info round trip)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after ``timeout`` (they were already reaped or reparented)."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def is_idle(client: Client) -> dict[str, Any] | None:
    """server_info when the server holds no request anywhere, else None."""
    info = client.server_info()
    busy = info["num_running"] or info["num_queued"] or info.get("num_chunked") or info["tokenizer"]["active_requests"]
    return None if busy else info


def assert_idle_and_nothing_leaked(client: Client) -> dict[str, Any]:
    """Once every request is done, the KV pool is whole: the memory invariant holds and every
    token is free or held only by the (evictable) prefix cache. The server's info, for more checks."""
    info = wait_until(lambda: is_idle(client), 60, "an idle server")
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    assert info["protected_tokens"] == 0
    assert info["available_tokens"] + info["evictable_tokens"] == info["max_total_tokens"]
    return info


def http_json(server: Client, method: str, path: str, body: Any = None, key: str | None = API_KEY) -> tuple[int, Any]:
    """One HTTP request as SGLang's clients send it (a JSON content type, a body only when given):
    the status and the JSON reply, or for a stream (``"stream": true``) the list of its events' JSON
    (its ``[DONE]`` checked)."""
    headers = {"Content-Type": "application/json; charset=utf-8"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    address = server.server.http_address  # type: ignore[attr-defined]
    req = urllib.request.Request(address + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    if isinstance(body, dict) and body.get("stream"):
        lines = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert lines and lines[-1] == b"[DONE]", raw[-200:]
        return status, [json.loads(line) for line in lines[:-1]]
    return status, json.loads(raw)
