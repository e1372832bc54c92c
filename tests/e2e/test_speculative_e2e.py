"""Speculative decoding end to end: ``launch.py --speculative-algorithm ngram`` serves the same tokens
as the session's plain Llama server, and reports how much its drafts helped.

The server also has ``--enable-overlap-schedule`` (speculation's steps take the non-overlapped
path), 16-token chunks and a 512-token pool (retraction), and ``--enable-metrics``.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from typing import Any, Iterator

import pytest
import uvloop

from runtime.client import AsyncClient, Client
from tests.support.server_process import launch_server

pytest.register_assert_rewrite("server_fixtures")
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args, is_idle, wait_until  # noqa: E402

pytest_plugins = ["tests.support.server_fixtures"]

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def spec_server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(
        tiny_checkpoints.path("llama"),
        "--speculative-algorithm",
        "ngram",
        "--speculative-num-draft-tokens",
        "5",
        "--speculative-max-step-tokens",
        "256",
        "--enable-overlap-schedule",
        "--chunked-prefill-size",
        "16",
        "--enable-metrics",
        max_total_tokens=512,
    )
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def concurrent(client: Client, calls: list[dict[str, Any]]) -> list[Any]:
    async def run() -> list[Any]:
        async with AsyncClient(client.address, api_key=client.api_key, timeout=CLIENT_TIMEOUT_S) as c:
            return await asyncio.gather(*(c.generate(**kw) for kw in calls))

    return uvloop.run(run())


def test_same_tokens_as_plain_decoding(spec_server: Client, llama_server: Client) -> None:
    rng = random.Random(0)
    vocab = spec_server.server_info()["model"]["vocab_size"]
    passages = [[rng.randrange(3, vocab) for _ in range(8 + i)] for i in range(12)]
    calls = [{"input_ids": p * 3, "sampling_params": {**GREEDY, "max_new_tokens": 24}} for p in passages]
    calls += [
        {
            "prompt": "Once upon a time, in a land far away,",
            "sampling_params": {"temperature": 0.8, "seed": 3, "max_new_tokens": 12, "n": 2},
        },
        {
            "prompt": "def add(a, b):",
            "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "repetition_penalty": 1.2, "max_new_tokens": 12, "stop": ["\n\n"]},
        },
    ]
    expected, got = concurrent(llama_server, calls), concurrent(spec_server, calls)

    def key(results: list[Any]) -> list[Any]:
        flat = [r for res in results for r in (res if isinstance(res, list) else [res])]
        return [(r["output_ids"], r["text"], r["meta"]["finish_reason"]) for r in flat]

    assert key(got) == key(expected)
    # Streaming: the chunks of a speculating request add up to the whole answer.
    chunks = list(
        spec_server.generate(input_ids=passages[0] * 3, sampling_params={**GREEDY, "max_new_tokens": 24}, stream=True)
    )
    assert [t for c in chunks for t in c["output_ids"]] == got[0]["output_ids"]
    info = wait_until(lambda: is_idle(spec_server), 60, "the speculative server to go idle")
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    assert info["overlap_schedule"] is True and info["spec_draft_tokens"] > 0
    assert info["spec_accept_length"] >= 1.0
    with urllib.request.urlopen(spec_server.server.http_address + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert "tinyserve:spec_accept_length" in metrics and "tinyserve:spec_accept_rate" in metrics
