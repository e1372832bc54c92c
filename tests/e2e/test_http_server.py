"""The HTTP front end end to end: the real openai SDK (and raw HTTP) against a running
server on a tiny Llama (CPU, fp32), one server for the whole module.

* completions and chat, stream and not, equal the ZMQ client's greedy text for the same
  prompts; n=2, logprobs, stop, usage (cached tokens included);
* a bad request per field answers 400 naming the field; a wrong or missing key 401; an
  unknown model 404; an over-long prompt 400;
* /metrics, parsed with prometheus_client's parser, moves by exactly what was sent (constrained
  requests and grammar compiles included);
* HTTP clients that disconnect mid-request are aborted and their KV freed;
* SGLang's /generate body and reply; bench.serving --backend http drives it.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.client import Client
from tests.support.server_fixtures import API_KEY, CLIENT_TIMEOUT_S, base_args, is_idle, wait_until
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

MODEL = "tiny-llama"
PROMPTS = [
    "Hello! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b",
    "héllo wörld",
]
GREEDY_HTTP = {"temperature": 0, "extra_body": {"ignore_eos": True}}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(
        tiny_checkpoints.path("llama"),
        "--api-key",
        API_KEY,
        "--enable-metrics",
        "--log-requests",
        "--served-model-name",
        MODEL,
    )
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        assert client.server.http_address is not None
        yield client


@pytest.fixture(scope="module")
def oai(server: Client) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.server.http_address + "/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def http(server: Client, method: str, path: str, body: Any = None, key: str | None = API_KEY) -> tuple[int, bytes]:
    """A raw HTTP request: (status, body)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.server.http_address + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sse_events(raw: bytes) -> list[Any]:
    lines = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---------------------------------------------------------------------- completions and chat


def test_completions_equal_the_zmq_client(server: Client, oai: openai.OpenAI) -> None:
    for prompt in PROMPTS:
        zmq = server.generate(prompt, {**GREEDY, "max_new_tokens": 12})
        r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY_HTTP)
        assert r.choices[0].text == zmq["text"]
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == zmq["meta"]["prompt_tokens"]
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12
        assert r.model == MODEL and r.object == "text_completion"
    ids = [5, 17, 42, 99, 7, 3]
    zmq = server.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 8})
    r = oai.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY_HTTP)
    assert r.choices[0].text == zmq["text"] and r.usage.prompt_tokens == len(ids)
    # a batch of prompts: one choice per prompt, in order
    batch = oai.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6, **GREEDY_HTTP)
    expected = [server.generate(p, {**GREEDY, "max_new_tokens": 6})["text"] for p in PROMPTS[:2]]
    assert [c.text for c in batch.choices] == expected and [c.index for c in batch.choices] == [0, 1]


def test_completion_stream_adds_up_with_usage_and_cached_tokens(server: Client, oai: openai.OpenAI) -> None:
    prompt = PROMPTS[1] + " again and again"
    full = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY_HTTP)
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY_HTTP,
        )
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert len(text_chunks) == 16  # --stream-interval 1: one event per token
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * 15 + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 16
    # the same prompt again: all but the last prompt token come from the prefix cache
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens >= usage_chunk.usage.prompt_tokens - 1 > 0


def test_chat_equals_the_zmq_client_stream_and_not(server: Client, oai: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    zmq = server.generate(messages=messages, sampling_params={**GREEDY, "max_new_tokens": 10})
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, **GREEDY_HTTP)
    assert r.choices[0].message.content == zmq["text"] and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == zmq["meta"]["prompt_tokens"] and r.object == "chat.completion"
    chunks = list(
        oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True, **GREEDY_HTTP)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == zmq["text"]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"
    # content given as text parts renders the same prompt
    parts = [
        messages[0],
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    r2 = oai.chat.completions.create(model=MODEL, messages=parts, max_tokens=10, **GREEDY_HTTP)
    assert r2.choices[0].message.content == zmq["text"]


def test_n2_logprobs_and_stop(server: Client, oai: openai.OpenAI) -> None:
    r = oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=6, n=2, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12
    zmq = server.generate("Hello", {**GREEDY, "max_new_tokens": 5}, return_logprob=True, top_logprobs_num=3)
    r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=3, **GREEDY_HTTP)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([p for p, _ in zmq["meta"]["output_token_logprobs"]], abs=1e-5)
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(
        len(top) <= 3 and max(top.values()) >= chosen - 1e-5 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs)
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY_HTTP,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    # stop: the text ends before the stop string, finish_reason "stop", as on ZMQ
    full = server.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 24})["text"]
    stop = next(
        full[i : i + 3]
        for i in range(4, len(full) - 3)
        if full[i : i + 3].strip() == full[i : i + 3] and full.find(full[i : i + 3]) == i
    )
    r = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, stop=[stop], **GREEDY_HTTP)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == server.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 24, "stop": stop})["text"]


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -2}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"frequency_penalty": "a lot"}, "frequency_penalty"),
        ({"stop": 7}, "stop"),
        ({"seed": "x"}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"top_k": 0}, "top_k"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, 10**6]}, "prompt"),
        ({"prompt": list(range(3, 600))}, "prompt"),  # longer than the context (512)
    ],
)
def test_bad_completion_request_names_the_field(oai: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    body = {"prompt": "Hello", "max_tokens": 4, **extra}
    prompt = body.pop("prompt")
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model=MODEL, prompt=prompt, extra_body=body)
    assert exc.value.status_code == 400 and exc.value.param == param, exc.value.body


@pytest.mark.parametrize(
    "messages, extra, param",
    [
        ([{"content": "no role"}], {}, "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "messages[0].content"),
        ([{"role": "user", "content": "hi"}], {"top_logprobs": 2}, "top_logprobs"),
        ([{"role": "user", "content": "hi"}], {"max_completion_tokens": 10**6}, "max_completion_tokens"),
    ],
)
def test_bad_chat_request_names_the_field(oai: openai.OpenAI, messages: Any, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=MODEL, messages=messages, extra_body=extra)
    assert exc.value.param == param, exc.value.body


def test_wrong_key_unknown_model_and_routes(server: Client, oai: openai.OpenAI) -> None:
    bad = openai.OpenAI(base_url=server.server.http_address + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert exc.value.status_code == 401 and exc.value.code == "unauthorized"
    status, body = http(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "Hello"}, key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
    assert http(server, "GET", "/get_server_info", key=None)[0] == 401
    with pytest.raises(openai.NotFoundError) as nf:
        oai.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    assert nf.value.param == "model" and nf.value.code == "model_not_found"
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert http(server, "GET", "/health", key=None)[0] == 200  # liveness needs no key
    assert http(server, "GET", "/health_generate")[0] == 200
    status, body = http(server, "GET", "/no/such/route")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    wait_until(lambda: is_idle(server), 30, "an idle server")
    status, body = http(server, "POST", "/flush_cache")
    assert status == 200 and json.loads(body)["success"] is True


# ---------------------------------------------------------------------- /generate (SGLang's native API)


def test_native_generate_body_and_reply(server: Client) -> None:
    params = {**GREEDY, "max_new_tokens": 8}
    zmq = server.generate(PROMPTS[0], params)
    status, body = http(server, "POST", "/generate", {"text": PROMPTS[0], "sampling_params": params})
    assert status == 200
    r = json.loads(body)
    assert r["text"] == zmq["text"] and r["output_ids"] == zmq["output_ids"]
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert r["meta_info"]["completion_tokens"] == 8 and r["meta_info"]["e2e_latency"] > 0
    status, body = http(server, "POST", "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": params})
    assert status == 200 and [x["output_ids"] for x in json.loads(body)] == [
        server.generate(input_ids=ids, sampling_params=params)["output_ids"] for ids in ([5, 6, 7], [8, 9])
    ]
    status, raw = http(server, "POST", "/generate", {"text": PROMPTS[0], "sampling_params": params, "stream": True})
    events = sse_events(raw)
    assert events[-1]["text"] == zmq["text"]  # cumulative text, as SGLang streams it
    assert events[-1]["output_ids"] == zmq["output_ids"]  # so are the ids
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    # --log-requests: a line when the request arrives and one when it finishes, with its rid
    status, body = http(server, "POST", "/generate", {"text": PROMPTS[1], "sampling_params": params, "rid": "log-me"})
    n = json.loads(body)["meta_info"]["prompt_tokens"]
    log = server.server.log_tail(1 << 20)
    assert status == 200 and f"request log-me: {n} prompt tokens, n=1, max_new_tokens=8" in log
    assert f"finished log-me: length, {n} prompt tokens" in log and "8 output tokens" in log
    status, body = http(server, "POST", "/generate", {"text": "x", "sampling_params": {"temperature": -1}})
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature"
    # what SGLang's gateway and clients add is ignored (one warning per field name), as SGLang does
    status, body = http(server, "POST", "/generate", {"text": "x", "model": "m", "bogus": 1, "sampling_params": params})
    assert status == 200 and json.loads(body)["output_ids"] == server.generate("x", params)["output_ids"]
    assert server.server.log_tail(1 << 20).count("ignoring the /generate field 'bogus'") == 1


def test_native_generate_scores_a_prompt_with_max_new_tokens_zero(server: Client) -> None:
    """lm-eval's loglikelihood call: return_logprob, logprob_start_len and max_new_tokens 0 score the
    prompt without generating; the reply's meta_info has what the ZMQ client gets."""
    ids = [17, 42, 99, 5, 230, 61, 8, 150, 77, 12]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 4,
        "top_logprobs_num": 2,
    }
    status, raw = http(server, "POST", "/generate", body)
    assert status == 200, raw
    r = json.loads(raw)
    assert r["output_ids"] == [] and r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    zmq = server.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=4,
    )
    got = r["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[4:] and all(lp < 0 for lp, _, _ in got)
    assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _ in zmq["meta"]["input_token_logprobs"]], abs=1e-5)
    assert [len(row) for row in r["meta_info"]["input_top_logprobs"]] == [2] * 6
    status, raw = http(server, "POST", "/generate", {**body, "logprob_start_len": 10})
    assert status == 400 and json.loads(raw)["error"]["param"] == "logprob_start_len"


# ---------------------------------------------------------------------- metrics


def scrape(server: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, body = http(server, "GET", "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_metrics_move_by_exactly_the_requests_sent(server: Client, oai: openai.OpenAI) -> None:
    wait_until(lambda: is_idle(server), 30, "an idle server")
    before = scrape(server)
    usages = [
        oai.completions.create(model=MODEL, prompt=p, max_tokens=n, **GREEDY_HTTP).usage
        for p, n in ((PROMPTS[2], 5), (PROMPTS[3], 7))
    ]
    stream = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Metrics?"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY_HTTP,
        )
    )
    usages.append(stream[-1].usage)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="x", temperature=-1)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tinyserve:requests_total", finish_reason="length") == 3
    assert delta("tinyserve:rejected_requests_total", code="invalid_request") == 1
    assert delta("tinyserve:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("tinyserve:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 16
    assert delta("tinyserve:cached_tokens_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta("tinyserve:e2e_request_latency_seconds_count") == 3
    assert delta("tinyserve:time_to_first_token_seconds_count") == 1  # the one streamed request
    assert delta("tinyserve:inter_token_latency_seconds_count") == 3  # its 4 chunks, 3 gaps
    info = server.server_info()
    assert after[("tinyserve:num_running_reqs", ())] == 0 and after[("tinyserve:num_queue_reqs", ())] == 0
    assert after[("tinyserve:cache_hit_rate", ())] == pytest.approx(info["cache_hit_rate"])
    assert 0 <= after[("tinyserve:token_usage", ())] <= 1


def test_metrics_count_constrained_requests_and_their_compiles(server: Client, oai: openai.OpenAI) -> None:
    """n=2 samples of one new regex: one compile (its time observed), one sample sharing it."""
    wait_until(lambda: is_idle(server), 30, "an idle server")
    before, info_before = scrape(server), server.server_info()
    regex = f"(yes|no|maybe){{1,3}} {time.monotonic_ns()}"  # never compiled before on this server
    reply = oai.completions.create(
        model=MODEL, prompt="Answer:", n=2, max_tokens=48, temperature=0, extra_body={"regex": regex}
    )
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in reply.choices), reply
    after, info_after = scrape(server), server.server_info()

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tinyserve:constrained_requests_total", grammar_source="compiled") == 1
    assert delta("tinyserve:constrained_requests_total", grammar_source="cache") == 1
    assert delta("tinyserve:grammar_compile_seconds_count") == 1
    assert delta("tinyserve:grammar_compile_seconds_sum") > 0
    assert info_after["grammar_compiles"] - info_before["grammar_compiles"] == 1
    assert info_after["grammar_cache_hits"] - info_before["grammar_cache_hits"] == 1
    assert info_after["constrained_requests"] - info_before["constrained_requests"] == 2
    assert info_after["num_grammar_queued"] == 0


# ---------------------------------------------------------------------- disconnects


def _open_request(server: Client, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = server.server.http_address.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT_S)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def test_http_clients_gone_mid_request_are_aborted_and_their_kv_freed(server: Client) -> None:
    """Four streams that read their first event and two non-stream requests, all closed
    mid-generation: every request is aborted, nothing leaks, the server keeps serving."""
    before = wait_until(lambda: is_idle(server), 30, "an idle server")
    body = {"model": MODEL, "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    streams = [
        _open_request(server, "/v1/completions", {**body, "prompt": f"stream {i}", "stream": True}) for i in range(4)
    ]
    for sock in streams:
        got = b""
        while b"data: " not in got:
            got += sock.recv(4096)
        assert got.startswith(b"HTTP/1.1 200")
    plain = [
        _open_request(server, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "x"}]}),
        _open_request(
            server, "/generate", {"text": "y", "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}}
        ),
    ]
    wait_until(lambda: server.server_info()["tokenizer"]["active_requests"] == 6, 60, "all six requests")
    for sock in streams + plain:
        sock.close()
    after = wait_until(lambda: is_idle(server), 30, "the abandoned requests to be dropped")
    assert after["num_aborted"] == before["num_aborted"] + 6
    assert after["tokenizer"]["clients_gone"] == before["tokenizer"]["clients_gone"] + 6
    assert after["memory_invariant"]["ok"], after["memory_invariant"]
    assert after["protected_tokens"] == 0
    assert after["available_tokens"] + after["evictable_tokens"] == after["max_total_tokens"]
    assert http(server, "GET", "/health")[0] == 200


# ---------------------------------------------------------------------- bench.serving --backend http


def test_bench_serving_drives_the_http_front_door(server: Client) -> None:
    from bench.serving import run_workload
    from bench.workloads import BenchRequest, Workload

    reqs = [BenchRequest(i, [5 + i, 6, 7, 8], 6, session=i) for i in range(4)]
    records, duration = run_workload(
        server.server.http_address,
        Workload("smoke", {}, reqs),
        api_key=API_KEY,
        backend="http",
        model=MODEL,
        show_progress=False,
    )
    assert [r.error for r in records] == [None] * 4 and duration > 0
    assert all(r.output_len == 6 and r.ttft is not None and len(r.itl) == 5 for r in records)
    records, _ = run_workload(
        server.server.http_address,
        Workload("smoke", {}, reqs),
        api_key=API_KEY,
        backend="http",
        model=MODEL,
        stream=False,
        show_progress=False,
    )
    assert [(r.error, r.output_len) for r in records] == [(None, 6)] * 4
