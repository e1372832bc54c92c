"""End to end through launch.py, real processes and the real client (CPU, fp32).

1. greedy output equals transformers for tiny Llama and Qwen3, 32 concurrent requests;
2. streaming: deltas add up to the non-stream text, never a partial character, stop
   strings never leak, --stream-interval is honoured;
3. prefix cache: cached_tokens 0 first, the shared prefix on a repeat; none with
   --disable-radix-cache, same text;
5. a client that goes away mid-request is aborted, its KV freed, the server stays up.
(4, bad input, is test_server_errors.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any, Callable

import msgspec
import pytest
import uvloop
import zmq

pytest.register_assert_rewrite("server_fixtures")

from runtime.client import AsyncClient, Client
from runtime.protocol.messages import GenerateReq
from tests.support import REPO_ROOT
from tests.support.checkpoints import hf_greedy, random_prompt  # noqa: E402
from tests.support.server_fixtures import API_KEY, is_idle, wait_until

pytest_plugins = ["tests.support.server_fixtures"]

GREEDY = {"temperature": 0, "ignore_eos": True}
SENTENCES = [
    "Hello! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a land far away, there lived a wise old owl who knew every road.",
    "Question: What is 12 plus 30? Answer:",
    "the scheduler reads a long prompt before noon.",
    "a small cat finds the blue door again and again, while the river keeps the old map.",
    "héllo wörld",
    "def add(a, b):\n    return a + b",
]


def server_for(request: pytest.FixtureRequest, name: str) -> Client:
    return request.getfixturevalue({"llama": "llama_server", "qwen3": "qwen3_server"}[name])


def mixed_workload(vocab: int) -> list[tuple[dict[str, Any], int]]:
    """32 requests: (generate kwargs, max_new_tokens); text and token-id prompts of 3..150 tokens."""
    work = []
    for i in range(32):
        max_new = 4 + (i * 7) % 21
        if i % 2:
            prompt = {"input_ids": random_prompt(3 + (i * 37) % 148, vocab, seed=100 + i)}
        else:
            prompt = {"prompt": " ".join(SENTENCES[j % len(SENTENCES)] for j in range(i // 2, i // 2 + 1 + i % 5))}
        work.append((prompt, max_new))
    return work


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_greedy_equals_transformers_for_32_concurrent_requests(
    request: pytest.FixtureRequest, hf_reference: Callable[[str], Any], name: str
) -> None:
    client = server_for(request, name)
    model, tok = hf_reference(name)
    work = mixed_workload(model.config.vocab_size)

    async def run_all() -> list[dict[str, Any]]:
        async with AsyncClient(client.address, api_key=client.api_key, timeout=120) as c:
            return await asyncio.gather(
                *(c.generate(sampling_params={**GREEDY, "max_new_tokens": n}, **kw) for kw, n in work)
            )

    results = uvloop.run(run_all())
    for (kw, max_new), r in zip(work, results):
        ids = kw.get("input_ids") or tok.encode(kw["prompt"])
        ref, _ = hf_greedy(model, ids, max_new)
        assert r["output_ids"] == ref, kw
        assert r["text"] == tok.decode(ref, skip_special_tokens=True)
        meta = r["meta"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == max_new
        assert meta["finish_reason"] == {"type": "length", "length": max_new}
        assert meta["latency"] > 0 and 0 <= meta["cached_tokens"] < len(ids)


def check_stream(chunks: list[dict[str, Any]], final_text: str, final_ids: list[int]) -> None:
    """Deltas add up to the final text, and the text streamed so far is always a prefix of
    it: no partial character (shown as U+FFFD and later replaced) ever went out."""
    so_far = ""
    for ch in chunks:
        so_far += ch["text"]
        assert final_text.startswith(so_far), (so_far, final_text)
    assert so_far == final_text
    assert [t for ch in chunks for t in ch["output_ids"]] == final_ids
    assert [ch["finished"] for ch in chunks] == [False] * (len(chunks) - 1) + [True]


def test_stream_deltas_add_up_to_the_non_stream_text(llama_server: Client) -> None:
    params = {**GREEDY, "max_new_tokens": 40}
    saw_multibyte = False
    for prompt in SENTENCES:
        full = llama_server.generate(prompt, params)
        chunks = list(llama_server.generate(prompt, params, stream=True))
        check_stream(chunks, full["text"], full["output_ids"])
        assert all(len(ch["output_ids"]) == 1 for ch in chunks)  # --stream-interval 1
        assert chunks[-1]["meta"]["finish_reason"] == {"type": "length", "length": 40}
        saw_multibyte |= any(ord(c) > 127 and c != "\ufffd" for c in full["text"])
    assert saw_multibyte, "no multi-byte character in any output: the check above proved nothing"


def test_stream_interval_groups_tokens(qwen3_server: Client) -> None:
    params = {**GREEDY, "max_new_tokens": 20}
    full = qwen3_server.generate(SENTENCES[2], params)
    chunks = list(qwen3_server.generate(SENTENCES[2], params, stream=True))
    check_stream(chunks, full["text"], full["output_ids"])
    # the first token goes out at once (time to first token), then every 3 tokens
    assert [len(ch["output_ids"]) for ch in chunks] == [1] + [3] * 6 + [1]


def _ascii_window(text: str, start: int, width: int = 3) -> str | None:
    for i in range(start, len(text) - width):
        w = text[i : i + width]
        if all(c.isascii() and (c.isalnum() or c == " ") for c in w) and text.find(w) == i:
            return w
    return None


def test_stop_string_never_leaks(llama_server: Client) -> None:
    params = {**GREEDY, "max_new_tokens": 48}
    tried = 0
    for prompt in SENTENCES:
        full = llama_server.generate(prompt, params)
        stop = _ascii_window(full["text"], 6)
        if stop is None:
            continue
        tried += 1
        expected = full["text"][: full["text"].index(stop)]
        chunks = list(llama_server.generate(prompt, {**params, "stop": [stop, "zzzzqq"]}, stream=True))
        so_far = ""
        for ch in chunks:
            so_far += ch["text"]
            assert expected.startswith(so_far), (so_far, stop)
        assert so_far == expected
        assert chunks[-1]["finish_reason"] == {"type": "stop", "matched": stop}
        ids = [t for ch in chunks for t in ch["output_ids"]]
        assert ids == full["output_ids"][: len(ids)]
        assert llama_server.generate(prompt, {**params, "stop": stop})["text"] == expected
        kept = llama_server.generate(prompt, {**params, "stop": stop, "no_stop_trim": True})["text"]
        assert kept.startswith(expected + stop)  # untrimmed: up to the end of the last token
    assert tried >= 3


def test_prefix_cache_reports_cached_tokens(llama_server: Client) -> None:
    c = llama_server
    vocab = c.server_info()["model"]["vocab_size"]
    shared = random_prompt(40, vocab, seed=9001)
    tail_x, tail_y = [7, 8, 9, 10, 11], [12, 13, 14, 15, 16]
    params = {**GREEDY, "max_new_tokens": 8}
    wait_until(lambda: is_idle(c), 30, "an idle server")
    assert c.flush_cache()["success"] is True
    first = c.generate(input_ids=shared + tail_x, sampling_params=params)
    assert first["meta"]["cached_tokens"] == 0
    other = c.generate(input_ids=shared + tail_y, sampling_params=params)
    assert other["meta"]["cached_tokens"] == len(shared)
    again = c.generate(input_ids=shared + tail_x, sampling_params=params)
    assert len(shared) + len(tail_x) - 1 <= again["meta"]["cached_tokens"] < len(shared) + len(tail_x)
    assert again["text"] == first["text"] and again["output_ids"] == first["output_ids"]
    assert c.server_info()["cache_hit_rate"] > 0


def test_disabled_radix_cache_caches_nothing_and_gives_the_same_text(
    qwen3_server: Client, hf_reference: Callable[[str], Any]
) -> None:
    model, _ = hf_reference("qwen3")
    prompt = random_prompt(40, model.config.vocab_size, seed=9002)
    params = {**GREEDY, "max_new_tokens": 8}
    first = qwen3_server.generate(input_ids=prompt, sampling_params=params)
    again = qwen3_server.generate(input_ids=prompt, sampling_params=params)
    assert first["meta"]["cached_tokens"] == again["meta"]["cached_tokens"] == 0
    assert first["output_ids"] == again["output_ids"] == hf_greedy(model, prompt, 8)[0]
    assert first["text"] == again["text"]


def test_chat_messages_use_the_chat_template(llama_server: Client, hf_reference: Callable[[str], Any]) -> None:
    model, tok = hf_reference("llama")
    messages = [{"role": "user", "content": "Hello there"}]
    r = llama_server.generate(messages=messages, sampling_params={**GREEDY, "max_new_tokens": 6})
    ids = tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    assert r["meta"]["prompt_tokens"] == len(ids)
    assert r["output_ids"] == hf_greedy(model, ids, 6)[0]


def test_parallel_samples_and_logprobs(llama_server: Client, hf_reference: Callable[[str], Any]) -> None:
    model, tok = hf_reference("llama")
    rs = llama_server.generate(
        "Hello", {"max_new_tokens": 6, "n": 3, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    )
    assert len(rs) == 3 and all(len(r["output_ids"]) == 6 for r in rs)
    assert [r["meta"]["index"] for r in rs] == [0, 1, 2]
    r = llama_server.generate("Hello", {**GREEDY, "max_new_tokens": 5}, return_logprob=True)
    ref_ids, ref_lps = hf_greedy(model, tok.encode("Hello"), 5)
    pairs = r["meta"]["output_token_logprobs"]
    assert [int(t) for _, t in pairs] == ref_ids
    assert [lp for lp, _ in pairs] == pytest.approx(ref_lps, abs=1e-3)


def _raw_dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def _recv_reply(sock: zmq.Socket, timeout_ms: int = 60000) -> dict[str, Any]:
    """The next reply frame, skipping the server's empty keepalive frames."""
    while True:
        assert sock.poll(timeout_ms), "no reply from the server"
        frame = sock.recv()
        if frame:
            return msgspec.msgpack.decode(frame)


def test_client_gone_mid_stream_is_aborted_and_its_kv_freed(llama_server: Client) -> None:
    """16 long streams (more KV than the pool: some wait in the queue); the client reads one
    chunk and closes its socket. Every request is aborted (running and queued alike)."""
    c = llama_server
    vocab = c.server_info()["model"]["vocab_size"]
    before = wait_until(lambda: is_idle(c), 30, "an idle server")
    ctx, sock = _raw_dealer(c.address)
    for i in range(16):
        req = GenerateReq(
            rid=f"vanishing-{i}",
            input_ids=random_prompt(20, vocab, seed=9100 + i),
            stream=True,
            sampling_params={**GREEDY, "max_new_tokens": 480},
            api_key=API_KEY,
        )
        sock.send(msgspec.msgpack.encode(req))
    try:
        first = _recv_reply(sock)
    finally:
        sock.close()
        ctx.term()
    if first["type"] == "chunks":  # several streams' chunks of one step, one frame
        first = first["chunks"][0]
    assert first["type"] == "chunk" and not first["finished"]
    after = wait_until(lambda: is_idle(c), 30, "the abandoned streams to be dropped")
    assert after["num_aborted"] == before["num_aborted"] + 16
    assert after["tokenizer"]["clients_gone"] == before["tokenizer"]["clients_gone"] + 1
    assert after["memory_invariant"]["ok"], after["memory_invariant"]
    assert after["protected_tokens"] == 0
    assert after["available_tokens"] + after["evictable_tokens"] == after["max_total_tokens"]
    assert c.health()
    assert c.generate("still serving", {**GREEDY, "max_new_tokens": 3})["meta"]["completion_tokens"] == 3


def test_killed_client_process_is_noticed_without_a_stream(llama_server: Client) -> None:
    """A non-stream client SIGKILLed mid-request: nothing is sent to it until the end, so
    the server's keepalive probe notices it; all its requests are aborted, running or queued."""
    c = llama_server
    before = wait_until(lambda: is_idle(c), 30, "an idle server")
    script = textwrap.dedent(f"""
        from runtime.client import Client
        c = Client({c.address!r}, api_key={API_KEY!r})
        c.generate(input_ids=[[5 + i] * 8 for i in range(32)],
                   sampling_params={{"temperature": 0, "ignore_eos": True, "max_new_tokens": 500}})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT)
    try:
        wait_until(
            lambda: (lambda i: i["num_running"] and i["num_queued"])(c.server_info()),
            60,
            "the client's requests to run and queue",
        )
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    after = wait_until(lambda: is_idle(c), 30, "the dead client's requests to be dropped")
    assert after["num_aborted"] == before["num_aborted"] + 32
    assert after["tokenizer"]["clients_gone"] == before["tokenizer"]["clients_gone"] + 1
    assert after["memory_invariant"]["ok"], after["memory_invariant"]
    assert after["available_tokens"] + after["evictable_tokens"] == after["max_total_tokens"]
    assert c.health()
