"""A quantized KV cache served end to end: launch.py --kv-cache-dtype, the real client, each format.

Greedy output changes against the unquantized cache; what must hold is that it does not change with
the cache's state: a prompt prefilled in chunks, over a prefix another request cached, or over one
loaded back from the host tier reads the same stored values as one prefilled at once, so the server's
tokens equal an in-process ModelRunner's (one prefill, the same format). Per format, two servers:

- the tiny long-context Llama with chunked prefill (16 tokens), a 256-token pool far smaller than the
  conversations and the host tier: later turns get their history back from the host, quantized;
- the tiny hybrid Qwen2 (two full-attention layers, two windowed, W = 24) with chunked prefill: the
  sliding-window pool holds the quantized rows too, and a next turn reuses the cached history (int8
  here; every format on this model, chunked and cached, in-process: tests/unit/.../test_kv_cache_dtype.py).

Each ends with the memory invariant of both tiers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime.client import Client
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import random_prompt
from tests.support.harness import Harness
from tests.support.server_fixtures import (
    CLIENT_TIMEOUT_S,
    assert_idle_and_nothing_leaked,
    base_args,
    is_idle,
    wait_until,
)
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
NEW = 5
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
SMALL_POOL = 256


def _reference(model: Path, kv_dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens from an in-process runner with the same cache format, prefilled at once."""
    runner = ModelRunner(
        str(model), device="cpu", dtype="float32", max_total_tokens=2048, kv_cache_dtype=kv_dtype, load_progress=False
    )
    return [Harness(runner).generate([prompt], NEW)[0].output_ids for prompt in prompts]


@pytest.fixture(scope="module", params=FORMATS)
def tier_server(request: pytest.FixtureRequest, tiny_checkpoints: Any) -> Iterator[tuple[str, Client]]:
    args = base_args(
        tiny_checkpoints.path("llama_long"),
        "--kv-cache-dtype",
        request.param,
        "--chunked-prefill-size",
        "16",
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "8",
        max_total_tokens=SMALL_POOL,
    )
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield request.param, client


def test_chunked_cached_and_host_loaded_prompts_read_the_same_quantized_values(
    tier_server: tuple[str, Client], tiny_checkpoints: Any
) -> None:
    kv_dtype, client = tier_server
    assert client.server is not None and client.server.ready_line is not None
    assert f" in {kv_dtype}, " in client.server.ready_line
    info = client.server_info()
    pool = info["kv_pool"]
    assert pool["kv_dtype"] == kv_dtype and pool["tokens"] == SMALL_POOL
    vocab = int(info["model"]["vocab_size"])
    # Three conversations of 110-token openings: together past the pool, so each next turn's history
    # has been evicted to the host tier by the time it runs.
    openings = [random_prompt(110, vocab, seed=500 + s) for s in range(3)]
    firsts = [client.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in openings]
    turns = [
        p + f["output_ids"] + random_prompt(12, vocab, seed=600 + s) for s, (p, f) in enumerate(zip(openings, firsts))
    ]
    seconds = [client.generate(input_ids=[t], sampling_params=GREEDY)[0] for t in turns]
    want = _reference(tiny_checkpoints.path("llama_long"), kv_dtype, openings + turns)
    assert [r["output_ids"] for r in firsts + seconds] == want
    assert all(int(r["meta"]["cached_tokens"]) >= 110 for r in seconds)  # each turn's history came back
    idle = assert_idle_and_nothing_leaked(client)
    assert idle["host_hit_tokens"] > 0  # ... from the host tier, at least once
    assert idle["memory_invariant"]["ok"]


@pytest.fixture(scope="module", params=["int8"])  # (every format on this model in-process: test_kv_cache_dtype.py)
def swa_server(request: pytest.FixtureRequest, tiny_checkpoints: Any) -> Iterator[tuple[str, Client]]:
    args = base_args(
        tiny_checkpoints.path("qwen2_swa"),
        "--kv-cache-dtype",
        request.param,
        "--chunked-prefill-size",
        "16",
        "--swa-full-tokens-ratio",
        "0.5",
        max_total_tokens=1024,
    )
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield request.param, client


def test_the_sliding_window_pool_holds_the_quantized_rows(
    swa_server: tuple[str, Client], tiny_checkpoints: Any
) -> None:
    kv_dtype, client = swa_server
    info = client.server_info()
    assert info["swa_hybrid_memory"] and info["kv_pool"]["kv_dtype"] == kv_dtype
    vocab = int(info["model"]["vocab_size"])
    prompts = [random_prompt(n, vocab, seed=70 + n) for n in (30, 70)]
    got = client.generate(input_ids=prompts, sampling_params=GREEDY)
    turn = prompts[1] + got[1]["output_ids"] + random_prompt(10, vocab, seed=9)
    (again,) = client.generate(input_ids=[turn], sampling_params=GREEDY)
    want = _reference(tiny_checkpoints.path("qwen2_swa"), kv_dtype, prompts + [turn])
    assert [r["output_ids"] for r in (*got, again)] == want
    assert again["meta"]["cached_tokens"] == len(prompts[1]) + NEW - 1
    idle = wait_until(lambda: is_idle(client), 60, "an idle server")
    assert idle["memory_invariant"]["ok"], idle["memory_invariant"]  # (both pools: the SWA-aware invariant)
