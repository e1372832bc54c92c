"""The chat page at GET / (tokenizer_proc/http/static/chat.html) in a real browser: the system's
headless Chromium (Debian's ``chromium`` and ``chromium-driver``; ``.ci/run`` installs them) driven
through selenium, against a server that launch.py started on the tiny Llama with ``--api-key``.
Without the browser every test here skips and names what is missing.

* the packaged page answers without a key (that it names no other host, so works offline:
  tests/unit/tokenizer_proc/test_chat_page.py; here the browser's console shows no error, which
  the page's Content-Security-Policy would log for anything loaded from elsewhere);
* the page asks for the api key, keeps it in localStorage and shows the served model's name;
* a streamed reply, at temperature 0, is exactly what POST /v1/chat/completions answers whole for
  the same chat, second turn (the history is sent) included; its stats line shows tokens/s and
  the cached prompt tokens, more than zero for a chat the prefix cache has seen;
* New chat forgets the history (the next request is a one-turn chat again);
* Stop mid-stream ends the reply, and the server aborts the request and frees its KV.

Every wait is WebDriverWait on the page's own state (``data-state`` of a reply: streaming, done,
stopped, error), none a sleep. The README's screenshot is made by tests/support/chat_screenshot.py
on the default model, with the same helpers (tests/support/browser.py).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Iterator

import pytest

from runtime.client import Client
from tests.support import REPO_ROOT
from tests.support.browser import ChatPage, console_errors, headless_chromium, missing_browser
from tests.support.server_fixtures import API_KEY, CLIENT_TIMEOUT_S, base_args, is_idle, wait_until
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

MODEL = "tiny-chat"
SYSTEM = "Be brief."
# the reply the test stops: as long as the tiny Llama's context (512) allows, ~1 s of decoding
STOP_MAX_TOKENS = 460


MISSING = missing_browser()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(tiny_checkpoints.path("llama"), "--api-key", API_KEY, "--served-model-name", MODEL)
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        assert client.server.http_address is not None
        yield client


def page_url(server: Client) -> str:
    return server.server.http_address + "/"


def chat_reference(server: Client, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """POST /v1/chat/completions, whole, at temperature 0: the reply the page must show."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    req = urllib.request.Request(
        server.server.http_address + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
    return reply


def open_page(browser: Any, server: Client, max_tokens: int) -> ChatPage:
    """The page, ready to send: the key given (from localStorage after the first time), the
    model's name shown, greedy settings and ``max_tokens``."""
    page = ChatPage(browser, page_url(server))
    page.wait.until(lambda d: page.model() == MODEL or "API key" in page.status(), "the model or the key prompt")
    if page.model() != MODEL:
        page.set_field("api-key", API_KEY)
        page.wait.until(lambda d: page.model() == MODEL, "the model's name once the key is given")
    page.set_field("system", SYSTEM)
    page.set_field("temperature", "0")
    page.set_field("max-tokens", str(max_tokens))
    return page


def test_the_packaged_page_is_served_without_a_key(server: Client) -> None:
    """(Its content: tests/unit/tokenizer_proc/test_chat_page.py.)"""
    with urllib.request.urlopen(page_url(server), timeout=CLIENT_TIMEOUT_S) as resp:  # no Authorization
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/html")
        assert "connect-src 'self'" in resp.headers["Content-Security-Policy"]
        assert resp.read() == (REPO_ROOT / "tokenizer_proc" / "http" / "static" / "chat.html").read_bytes()


def test_a_streamed_chat_equals_the_api_and_new_chat_forgets_it(browser: Any, server: Client) -> None:
    browser.get(page_url(server))
    browser.execute_script("localStorage.clear()")  # the key prompt of a first visit
    page = open_page(browser, server, max_tokens=16)
    assert page.js("return localStorage.getItem('tinyserve.apiKey')") == API_KEY
    question, follow_up = "Hello there", "And then?"
    page.send(question)
    first = page.finished_reply()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    expected = chat_reference(server, messages, 16)
    assert first["state"] == "done", first
    assert first["text"] == expected["choices"][0]["message"]["content"] != ""
    numbers = first["numbers"]
    assert int(numbers["completionTokens"]) == expected["usage"]["completion_tokens"]
    assert int(numbers["promptTokens"]) == expected["usage"]["prompt_tokens"]
    assert float(numbers["tokensPerSecond"]) > 0
    assert "tokens/s" in first["stats"] and "prompt tokens cached" in first["stats"]

    # the second turn sends the history: the API's answer to the whole chat
    page.send(follow_up, click=True)
    second = page.finished_reply()
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": follow_up}]
    assert second["state"] == "done", second
    assert second["text"] == chat_reference(server, messages, 16)["choices"][0]["message"]["content"]
    assert 0 < int(second["numbers"]["cachedTokens"]) < int(second["numbers"]["promptTokens"])
    assert page.history() == messages[1:] + [{"role": "assistant", "content": second["text"]}]

    # New chat: the log is empty, and the same question again is a one-turn chat, its whole
    # prompt but the last token from the prefix cache
    page.el("new-chat").click()
    assert page.history() == [] and page.el("empty").is_displayed()
    page.send(question)
    again = page.finished_reply()
    assert again["state"] == "done" and again["text"] == first["text"]
    prompt, cached = int(again["numbers"]["promptTokens"]), int(again["numbers"]["cachedTokens"])
    assert prompt == expected["usage"]["prompt_tokens"] and cached >= prompt - 1 > 0
    assert f"{cached} of {prompt} prompt tokens cached" in again["stats"]
    assert console_errors(browser) == []


def test_stop_ends_the_reply_and_the_server_frees_its_kv(browser: Any, server: Client) -> None:
    before = wait_until(lambda: is_idle(server), 30, "an idle server")
    page = open_page(browser, server, max_tokens=STOP_MAX_TOKENS)  # the key comes from localStorage
    page.send("Tell me a very long story.")
    page.wait.until(lambda d: page.last_reply()["text"] or page.last_reply()["state"] != "streaming", "streamed text")
    assert page.last_reply()["state"] == "streaming", page.last_reply()
    assert server.server_info()["tokenizer"]["active_requests"] == 1
    page.el("stop").click()
    stopped = page.finished_reply()
    assert stopped["state"] == "stopped" and stopped["stats"].startswith("stopped after"), stopped
    assert page.el("send").is_displayed() and not page.el("stop").is_displayed()
    after = wait_until(lambda: is_idle(server), 30, "the stopped request to be dropped")
    assert after["num_aborted"] == before["num_aborted"] + 1
    assert after["tokenizer"]["clients_gone"] == before["tokenizer"]["clients_gone"] + 1
    assert after["memory_invariant"]["ok"], after["memory_invariant"]
    assert after["protected_tokens"] == 0
    # the chat goes on after a stop
    page.set_field("max-tokens", "4")
    page.send("Shorter, please.")
    assert page.finished_reply()["state"] == "done"
    assert console_errors(browser) == []
