"""Scheduler features end to end (issue 6): chunked + mixed prefill, retraction, parallel sampling.

Real processes through launch.py and the real client, on the tiny Llama in fp32;
the reference outputs come from the session's unchunked, large-pool Llama server.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

import pytest

from launch import launch_server
from runtime.client import Client

pytest.register_assert_rewrite("server_fixtures")
from server_fixtures import CLIENT_TIMEOUT_S, base_args, is_idle, wait_until

pytest_plugins = ["server_fixtures"]

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
    vocab = vocab_of(llama_server)
    prompt = random_ids(48, vocab, seed=7)
    llama_server.flush_cache()
    samples = llama_server.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 8, "n": 4, "temperature": 0.8, "seed": 3})
    cached = sorted(r["meta"]["cached_tokens"] for r in samples)
    # One sample computes the prompt; the others reuse all of it but the last token.
    assert cached == [0, len(prompt) - 1, len(prompt) - 1, len(prompt) - 1]
    assert len({tuple(r["output_ids"]) for r in samples}) > 1  # each sample decodes on its own
    info = wait_until(lambda: is_idle(llama_server), 30, "the server to go idle")
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
