"""Overlap scheduling end to end: the same outputs as the serial scheduler, nothing leaked.

One server runs the tiny Llama with ``--enable-overlap-schedule`` (the cpu default is off),
a 512-token pool (retraction) and 32-token chunks (chunked prefill); every result is
compared with the session's serial Llama server, whose greedy output the rest of the
suite checks against transformers.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Iterator

import pytest
import uvloop

from runtime.client import AsyncClient, Client
from tests.support.server_process import launch_server

pytest.register_assert_rewrite("server_fixtures")

from tests.support.server_fixtures import API_KEY, CLIENT_TIMEOUT_S, base_args, is_idle, wait_until

pytest_plugins = ["tests.support.server_fixtures"]

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def overlap_server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(
        tiny_checkpoints.path("llama"),
        "--enable-overlap-schedule",
        "--chunked-prefill-size",
        "32",
        "--api-key",
        API_KEY,
        max_total_tokens=512,
    )
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]  # 0-2 are pad/bos/eos


def concurrent(client: Client, calls: list[dict[str, Any]]) -> list[Any]:
    """Send every call at once (one asyncio client), results in order."""

    async def run() -> list[Any]:
        async with AsyncClient(client.address, api_key=client.api_key, timeout=CLIENT_TIMEOUT_S) as c:
            return await asyncio.gather(*(c.generate(**kw) for kw in calls))

    return uvloop.run(run())


def assert_idle_and_clean(client: Client) -> dict[str, Any]:
    info = wait_until(lambda: is_idle(client), 60, "the overlap server to go idle")
    assert info["overlap_schedule"] is True
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    assert info["protected_tokens"] == 0
    return info


def test_greedy_equals_serial_under_chunking_and_retraction(overlap_server: Client, llama_server: Client) -> None:
    vocab = overlap_server.server_info()["model"]["vocab_size"]
    # Mixed lengths up to 140 + 40 tokens (chunks), then 40 x (64 + 64) tokens: ten times the
    # 512-token pool, admitted on the optimistic new-token ratio, so decode must retract.
    calls = [
        {
            "input_ids": random_ids(5 + (i * 37) % 136, vocab, seed=i),
            "sampling_params": {**GREEDY, "max_new_tokens": 8 + (i * 11) % 33},
        }
        for i in range(24)
    ]
    calls += [
        {"input_ids": random_ids(64, vocab, seed=100 + i), "sampling_params": {**GREEDY, "max_new_tokens": 64}}
        for i in range(40)
    ]
    expected = [r["output_ids"] for r in concurrent(llama_server, calls)]
    got = concurrent(overlap_server, calls)
    assert [r["output_ids"] for r in got] == expected
    info = assert_idle_and_clean(overlap_server)
    assert info["num_retractions"] > 0


def test_sampling_features_equal_serial(overlap_server: Client, llama_server: Client) -> None:
    """Seeds, penalties, min_new_tokens, logprobs, n > 1 and stop strings give what the serial
    scheduler gives: a seeded token depends only on its request's own step."""
    prompts = ["Hello! How are you today?", "Once upon a time, in a land far away,", "def add(a, b):"]
    variants = [
        {"temperature": 0.9, "seed": 11, "max_new_tokens": 12, "ignore_eos": True},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "seed": 5, "max_new_tokens": 10, "n": 2},
        {
            "temperature": 0.0,
            "frequency_penalty": 0.8,
            "presence_penalty": 0.3,
            "repetition_penalty": 1.2,
            "max_new_tokens": 12,
        },
        {"temperature": 0.0, "min_new_tokens": 6, "max_new_tokens": 9},
    ]
    calls = [
        {"prompt": p, "sampling_params": v, "return_logprob": True, "top_logprobs_num": 2}
        for p in prompts
        for v in variants
    ]

    def key(results: list[Any]) -> list[Any]:
        flat = [r for res in results for r in (res if isinstance(res, list) else [res])]
        return [(r["output_ids"], r["meta"]["finish_reason"]) for r in flat]

    serial, overlapped = concurrent(llama_server, calls), concurrent(overlap_server, calls)
    assert key(overlapped) == key(serial)
    lps = [[lp for lp, _ in r["meta"]["output_token_logprobs"]] for r in overlapped if isinstance(r, dict)]
    ref = [[lp for lp, _ in r["meta"]["output_token_logprobs"]] for r in serial if isinstance(r, dict)]
    assert len(lps) == len(ref) and all(a == pytest.approx(b, abs=1e-4) for a, b in zip(lps, ref))
    # Stop strings end the text where the serial server ends it.
    full = llama_server.generate(prompts[1], {**GREEDY, "max_new_tokens": 40})["text"]
    stop = next(
        full[i : i + 3] for i in range(6, len(full) - 3) if full[i : i + 3].isascii() and full[i : i + 3].strip()
    )
    params = {**GREEDY, "max_new_tokens": 40, "stop": [stop]}
    assert overlap_server.generate(prompts[1], params)["text"] == llama_server.generate(prompts[1], params)["text"]
    assert_idle_and_clean(overlap_server)


def test_aborts_mid_stream_free_everything(overlap_server: Client) -> None:
    vocab = overlap_server.server_info()["model"]["vocab_size"]

    async def run() -> list[dict[str, Any]]:
        async with AsyncClient(overlap_server.address, api_key=overlap_server.api_key, timeout=CLIENT_TIMEOUT_S) as c:

            async def stream(i: int) -> dict[str, Any]:
                chunks = []
                params = {**GREEDY, "max_new_tokens": 200}
                async for chunk in await c.generate(
                    input_ids=random_ids(20 + i, vocab, seed=50 + i), sampling_params=params, stream=True, rid=f"s{i}"
                ):
                    chunks.append(chunk)
                    if i % 2 == 0 and len(chunks) == 1 + i % 5:
                        await c.abort(f"s{i}")
                return {"chunks": len(chunks), "finish": chunks[-1]["finish_reason"]}

            return await asyncio.gather(*(stream(i) for i in range(10)))

    results = uvloop.run(run())
    for i, r in enumerate(results):
        assert r["finish"]["type"] == ("abort" if i % 2 == 0 else "length"), (i, r)
    assert_idle_and_clean(overlap_server)
