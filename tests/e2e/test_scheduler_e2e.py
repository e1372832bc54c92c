"""Scheduler features end to end (issue 6): chunked + mixed prefill, retraction, parallel sampling.

Real processes through launch.py and the real client, on the tiny Llama in fp32;
the reference outputs come from the session's unchunked, large-pool Llama server.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

import pytest

from runtime.client import Client
from scheduler_proc.admission import MAX_CONSECUTIVE_PREFILLS
from tests.support.server_process import launch_server

pytest.register_assert_rewrite("server_fixtures")

from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args, is_idle, wait_until

pytest_plugins = ["tests.support.server_fixtures"]

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]  # 0-2 are pad/bos/eos


@pytest.fixture(scope="module")
def chunked_mixed_server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(tiny_checkpoints.path("llama"), "--chunked-prefill-size", "16", "--enable-mixed-chunk")
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def small_pool_server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(tiny_checkpoints.path("llama"))
    args[args.index("--max-total-tokens") + 1] = "512"
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def vocab_of(client: Client) -> int:
    return int(client.server_info()["model"]["vocab_size"])


def test_chunked_and_mixed_prefill_give_the_unchunked_text(llama_server: Client, chunked_mixed_server: Client) -> None:
    vocab = vocab_of(chunked_mixed_server)
    prompts = [random_ids(n, vocab, seed=n) for n in (5, 16, 17, 40, 75, 120)]
    params = {**GREEDY, "max_new_tokens": 12}
    expected = [r["output_ids"] for r in llama_server.generate(input_ids=prompts, sampling_params=params)]
    got = chunked_mixed_server.generate(input_ids=prompts, sampling_params=params)
    assert [r["output_ids"] for r in got] == expected
    info = wait_until(lambda: is_idle(chunked_mixed_server), 30, "the chunked server to go idle")
    assert info["num_mixed_batches"] > 0  # long prompts were prefilled while others decoded
    assert info["memory_invariant"]["ok"], info["memory_invariant"]


def test_small_pool_retracts_and_every_request_completes(llama_server: Client, small_pool_server: Client) -> None:
    # 40 requests x (64 prompt + 64 new) tokens need 5120 KV slots; the pool has 512.
    vocab = vocab_of(small_pool_server)
    prompts = [random_ids(64, vocab, seed=100 + i) for i in range(40)]
    params = {**GREEDY, "max_new_tokens": 64}
    expected = [r["output_ids"] for r in llama_server.generate(input_ids=prompts, sampling_params=params)]
    got = small_pool_server.generate(input_ids=prompts, sampling_params=params)
    assert [r["output_ids"] for r in got] == expected
    info = wait_until(lambda: is_idle(small_pool_server), 30, "the small-pool server to go idle")
    assert info["num_retractions"] > 0 and info["num_retracted_reqs"] > 0
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    assert info["protected_tokens"] == 0


def test_parallel_samples_share_the_prompt(llama_server: Client) -> None:
    """n = 4: four samples equal to four single requests with seeds seed + i, prompt KV stored once."""
    vocab = vocab_of(llama_server)
    prompt = random_ids(48, vocab, seed=7)
    params = {"max_new_tokens": 8, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    wait_until(lambda: is_idle(llama_server), 30, "the server to go idle")
    assert llama_server.flush_cache()["success"]
    samples = llama_server.generate(input_ids=prompt, sampling_params={**params, "n": 4})
    outputs = [r["output_ids"] for r in samples]
    cached = sorted(r["meta"]["cached_tokens"] for r in samples)
    # One sample computes the prompt; the others reuse all of it but the last token.
    assert cached == [0, len(prompt) - 1, len(prompt) - 1, len(prompt) - 1]
    info = wait_until(lambda: is_idle(llama_server), 30, "the server to go idle")
    # The cache holds each distinct token path once: the prompt once, plus each sample's branch.
    paths = {tuple(prompt + out[:k]) for out in outputs for k in range(len(out))}
    assert info["evictable_tokens"] == len({p[:n] for p in paths for n in range(1, len(p) + 1)})
    singles = [
        llama_server.generate(input_ids=prompt, sampling_params={**params, "seed": 3 + i})["output_ids"]
        for i in range(4)
    ]
    assert outputs == singles
    assert len({tuple(o) for o in outputs}) > 1  # each sample decodes on its own
    assert info["memory_invariant"]["ok"], info["memory_invariant"]


@pytest.fixture(scope="module")
def long_prompt_server(tiny_checkpoints: Any) -> Iterator[Client]:
    # One 2,000-token prompt per prefill batch, so prefill batches can be counted by completions.
    args = base_args(
        tiny_checkpoints.path("llama_long"), "--max-prefill-tokens", "2048", "--chunked-prefill-size", "2048"
    )
    args[args.index("--max-total-tokens") + 1] = "20000"
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def test_running_request_keeps_decoding_under_a_stream_of_long_prompts(long_prompt_server: Client) -> None:
    """Between two tokens of a running stream, only a bounded number of prefill batches run."""
    import asyncio

    from runtime.client import AsyncClient

    address = long_prompt_server.server.address
    vocab = vocab_of(long_prompt_server)
    events: list[str] = []

    async def run() -> None:
        async with AsyncClient(address) as client:

            async def stream() -> None:
                async for chunk in client.generate(
                    input_ids=random_ids(8, vocab, seed=1),
                    sampling_params={**GREEDY, "max_new_tokens": 24},
                    stream=True,
                ):
                    events.extend("token" for _ in chunk["output_ids"])

            async def long_prompt(i: int) -> None:
                await client.generate(
                    input_ids=random_ids(2000, vocab, seed=1000 + i), sampling_params={**GREEDY, "max_new_tokens": 1}
                )
                events.append("prefill")

            streaming = asyncio.create_task(stream())
            while "token" not in events:  # the stream is running before the long prompts arrive
                await asyncio.sleep(0.01)
            await asyncio.gather(streaming, *(long_prompt(i) for i in range(8)))

    asyncio.run(run())
    assert events.count("token") == 24 and events.count("prefill") == 8
    # Prefills completed between consecutive tokens (the scheduler allows 2 in a row).
    gaps, run_len = [], 0
    first, last = events.index("token"), len(events) - 1 - events[::-1].index("token")
    for e in events[first : last + 1]:
        if e == "prefill":
            run_len += 1
        else:
            gaps.append(run_len)
            run_len = 0
    # The scheduler runs at most MAX_CONSECUTIVE_PREFILLS (2) prefill batches between decodes.
    # Events come from two asyncio tasks: when replies arrive together, one completion may be
    # recorded before a token that preceded it, hence + 1. Starvation would show gaps up to 8.
    assert max(gaps) <= MAX_CONSECUTIVE_PREFILLS + 1, events


def test_abort_in_queue_while_running_and_all_at_once(small_pool_server: Client) -> None:
    import threading

    vocab = vocab_of(small_pool_server)
    params = {**GREEDY, "max_new_tokens": 400}
    results: dict[str, Any] = {}

    def run(rid: str, prompt: list[int]) -> None:
        results[rid] = small_pool_server.generate(input_ids=prompt, sampling_params=params, rid=rid)

    # "running" holds most of the 512-token pool, so "queued" waits behind it.
    threads = [threading.Thread(target=run, args=("running", random_ids(40, vocab, seed=1)))]
    threads[0].start()
    wait_until(lambda: small_pool_server.server_info()["num_running"] == 1, 30, "the first request to run")
    for rid, seed in (("queued", 2), ("also-queued", 3)):
        threads.append(threading.Thread(target=run, args=(rid, random_ids(100, vocab, seed=seed))))
        threads[-1].start()
    wait_until(lambda: small_pool_server.server_info()["num_queued"] >= 1, 30, "a request to queue")
    assert small_pool_server.abort("queued")
    wait_until(lambda: "queued" in results, 30, "the queued request's abort")
    assert small_pool_server.abort("running")
    assert small_pool_server.abort_all() >= 1
    for t in threads:
        t.join(60)
    for rid in ("queued", "running", "also-queued"):
        assert results[rid]["meta"]["finish_reason"]["type"] == "abort", (rid, results[rid]["meta"])
    info = wait_until(lambda: is_idle(small_pool_server), 30, "the server to go idle")
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    # Other requests still finish normally afterwards.
    after = small_pool_server.generate(
        input_ids=random_ids(10, vocab, seed=4), sampling_params={**GREEDY, "max_new_tokens": 5}
    )
    assert after["meta"]["finish_reason"]["type"] == "length"
