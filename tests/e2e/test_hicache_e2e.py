"""The hierarchical cache end to end: real servers (launch.py, --device cpu, the tiny long-context
Llama) with a KV pool far smaller than the working set.

16 conversations of 3 turns over 600-token system prompts, all sessions at once, against a
1024-token pool: the pool holds about one conversation, so by the time a session's next turn
runs its history has been evicted. With --enable-hierarchical-cache later turns get it back
from the host (cached tokens, host hits in server info); without it the same run recomputes
it. Greedy outputs equal those of a server whose pool holds everything, and neither tier
leaks a slot once idle.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime.client import AsyncClient, Client
from tests.support.checkpoints import random_prompt
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

SESSIONS, TURNS, SYSTEM, USER, NEW = 16, 3, 600, 32, 4
SMALL_POOL = 1024
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def _server(model: Path, pool: int, *extra: str) -> Iterator[Client]:
    with launch_server(base_args(model, *extra, max_total_tokens=pool), client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def tier_server(tiny_checkpoints: Any) -> Iterator[Client]:
    yield from _server(
        tiny_checkpoints.path("llama_long"), SMALL_POOL, "--enable-hierarchical-cache", "--hicache-ratio", "16"
    )


@pytest.fixture(scope="module")
def plain_server(tiny_checkpoints: Any) -> Iterator[Client]:
    yield from _server(tiny_checkpoints.path("llama_long"), SMALL_POOL)


@pytest.fixture(scope="module")
def big_server(tiny_checkpoints: Any) -> Iterator[Client]:
    yield from _server(tiny_checkpoints.path("llama_long"), 32768)


def run_conversations(client: Client) -> dict[tuple[int, int], tuple[list[int], int]]:
    """(session, turn) -> (output ids, cached tokens); each turn's prompt is the history so far
    (the system prompt, the user messages and the model's own answers)."""
    vocab = client.server_info()["model"]["vocab_size"]
    out: dict[tuple[int, int], tuple[list[int], int]] = {}

    async def session(c: AsyncClient, s: int) -> None:
        history: list[int] = []
        for t in range(TURNS):
            history += random_prompt((SYSTEM if t == 0 else 0) + USER, vocab, seed=1000 * s + t)
            result = await c.generate(input_ids=history, sampling_params=GREEDY)
            out[s, t] = (result["output_ids"], int(result["meta"]["cached_tokens"]))
            history += result["output_ids"]

    async def run() -> None:
        async with AsyncClient(client.server.address, timeout=CLIENT_TIMEOUT_S) as c:
            await asyncio.gather(*(session(c, s) for s in range(SESSIONS)))

    asyncio.run(run())
    return out


def later_cached(run: dict[tuple[int, int], tuple[list[int], int]]) -> int:
    return sum(cached for (_, t), (_, cached) in run.items() if t > 0)


def history_before(t: int) -> int:
    """Tokens of a session's history with KV when turn ``t`` starts (its last output token has none)."""
    return SYSTEM + t * (USER + NEW) - 1


@pytest.fixture(scope="module")
def reference(big_server: Client) -> dict[tuple[int, int], tuple[list[int], int]]:
    return run_conversations(big_server)


def test_later_turns_load_their_history_from_the_host(
    tier_server: Client, reference: dict[tuple[int, int], tuple[list[int], int]]
) -> None:
    run = run_conversations(tier_server)
    assert {k: v[0] for k, v in run.items()} == {k: v[0] for k, v in reference.items()}
    info = tier_server.server_info()
    assert info["hierarchical_cache"] and info["max_total_tokens"] == SMALL_POOL
    assert info["memory_invariant"]["ok"], info["memory_invariant"]  # both tiers, idle: nothing leaked
    assert info["protected_tokens"] == 0 and info["host_total_tokens"] == 16 * SMALL_POOL
    everything = SESSIONS * sum(history_before(t) for t in range(1, TURNS))
    # Nearly every later turn found its whole history cached, most of it on the host.
    assert later_cached(run) >= 0.9 * everything
    assert later_cached(reference) >= 0.9 * everything
    assert info["host_hit_tokens"] >= 0.75 * everything
    assert info["device_evicted_tokens"] > 0 and info["host_backed_up_tokens"] > 0


def test_without_the_tier_the_same_run_recomputes(
    plain_server: Client, reference: dict[tuple[int, int], tuple[list[int], int]]
) -> None:
    run = run_conversations(plain_server)
    assert {k: v[0] for k, v in run.items()} == {k: v[0] for k, v in reference.items()}
    info = plain_server.server_info()
    assert not info["hierarchical_cache"] and "host_hit_tokens" not in info
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    everything = SESSIONS * sum(history_before(t) for t in range(1, TURNS))
    assert later_cached(run) <= 0.25 * everything
