"""Tensor and data parallelism end to end: real launch.py processes, the real client, gloo on CPU.

* TP 2 greedy output equals TP 1 and transformers for Llama (2 KV heads, split one per
  rank), Qwen3 (q/k norms, head_dim != hidden / heads) and Mistral (1 KV head,
  replicated on both ranks); seeded sampling at temperature 0.8 equals TP 1.
* DP 2 round_robin: both replicas serve (dispatch counts and per-replica payloads in
  server info), outputs equal DP 1.
* DP 2 cache_aware: repeats of a prefix go to the replica that cached it, unrelated
  prompts spread over both.
* TP 2 constrained decoding (regex, JSON schema; greedy and seeded) equals TP 1 and matches.
* Killing one TP rank stops the whole server with a non-zero exit and no orphans.

The TP 2 + DP 2 layout (with shortest_queue) and the two-node layout are in
test_launch_lifecycle.py. Servers are module-scoped and shared between tests: each
start costs seconds of process start-up and model load on a small CPU.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from runtime.client import Client
from tests.support.checkpoints import hf_greedy, random_prompt
from tests.support.server_fixtures import base_args, wait_gone
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

MAX_TOTAL_TOKENS = 1024
CLIENT_TIMEOUT_S = 120.0
NEW_TOKENS = 8
PROMPTS = ["Hello world", "The quick brown fox", "def add(a, b):"]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def args(model: Path, *extra: str) -> list[str]:
    return base_args(model, *extra, max_total_tokens=MAX_TOTAL_TOKENS)


def hf_outputs(hf_reference: Callable[[str], Any], name: str, prompts: list[str]) -> list[list[int]]:
    model, tok = hf_reference(name)
    return [hf_greedy(model, tok.encode(p), NEW_TOKENS)[0] for p in prompts]


def ids(results: list[dict[str, Any]]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


@pytest.fixture(scope="module")
def tp2_llama(tiny_checkpoints: Any) -> Iterator[Client]:
    # With overlap scheduling: each rank's forwards (and their collectives) on a worker thread,
    # the input broadcast on the scheduler thread. tp2_qwen3 keeps the serial loop.
    with launch_server(
        args(tiny_checkpoints.path("llama"), "--tp-size", "2", "--enable-overlap-schedule"),
        client_timeout=CLIENT_TIMEOUT_S,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tp2_qwen3(tiny_checkpoints: Any) -> Iterator[Client]:
    with launch_server(args(tiny_checkpoints.path("qwen3"), "--tp-size", "2"), client_timeout=CLIENT_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def dp2_round_robin(tiny_checkpoints: Any) -> Iterator[Client]:
    with launch_server(args(tiny_checkpoints.path("llama"), "--dp-size", "2"), client_timeout=CLIENT_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def dp2_cache_aware(tiny_checkpoints: Any) -> Iterator[Client]:
    with launch_server(
        args(tiny_checkpoints.path("llama"), "--dp-size", "2", "--load-balance-method", "cache_aware"),
        client_timeout=CLIENT_TIMEOUT_S,
    ) as c:
        yield c


# ---------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tp2_greedy_equals_transformers(
    name: str, request: pytest.FixtureRequest, hf_reference: Callable[[str], Any]
) -> None:
    client: Client = request.getfixturevalue(f"tp2_{name}")
    results = client.generate(PROMPTS, GREEDY)
    assert ids(results) == hf_outputs(hf_reference, name, PROMPTS)
    info = client.server_info()
    assert {"scheduler-0", "scheduler-1"} <= set(info["processes"])
    assert info["server_args"]["tp_size"] == 2
    assert info["overlap_schedule"] is (name == "llama")
    assert info["memory_invariant"]["ok"]


def test_tp2_greedy_equals_tp1_server(tp2_llama: Client, llama_server: Client) -> None:
    """Same prompts, one batch each, on a TP 2 and a TP 1 server; logprobs agree too."""
    tp2 = tp2_llama.generate(PROMPTS, GREEDY, return_logprob=True)
    tp1 = llama_server.generate(PROMPTS, GREEDY, return_logprob=True)
    assert ids(tp2) == ids(tp1)
    for a, b in zip(tp2, tp1):
        tp2_lp = [lp for lp, _ in a["meta"]["output_token_logprobs"]]
        tp1_lp = [lp for lp, _ in b["meta"]["output_token_logprobs"]]
        assert len(tp2_lp) == NEW_TOKENS and tp2_lp == pytest.approx(tp1_lp, abs=1e-4)


def test_tp2_seeded_sampling_equals_tp1(tp2_llama: Client, llama_server: Client) -> None:
    """temperature 0.8 with a request seed: rank 0's samples, the same tokens as one rank."""
    for seed in (7, 12345):
        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.8, "seed": seed, "ignore_eos": True}
        tp2 = ids(tp2_llama.generate(PROMPTS, params))
        assert tp2 == ids(llama_server.generate(PROMPTS, params))
        assert tp2 == ids(tp2_llama.generate(PROMPTS, params))  # reproducible
    # Not greedy in disguise: sampling picked other tokens somewhere.
    assert tp2 != ids(tp2_llama.generate(PROMPTS, GREEDY))


def test_tp2_constrained_decoding_equals_tp1(tp2_llama: Client, llama_server: Client) -> None:
    """Every rank compiles and masks for itself and follows rank 0's readiness: the random tiny
    model's constrained outputs (greedy and seeded) match their grammar and equal TP 1's."""
    import json
    import re

    regex = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "string", "enum": ["x", "yy"]},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    for params in ({"max_new_tokens": 40, "temperature": 0}, {"max_new_tokens": 40, "temperature": 0.8, "seed": 3}):
        for constraint in ({"regex": regex}, {"json_schema": schema}):
            tp2 = tp2_llama.generate(PROMPTS, {**params, **constraint})
            assert ids(tp2) == ids(llama_server.generate(PROMPTS, {**params, **constraint}))
            for r in tp2:
                assert r["meta"]["finish_reason"]["type"] == "stop", r
                if "regex" in constraint:
                    assert re.fullmatch(regex, r["text"]), r["text"]
                else:
                    assert set(json.loads(r["text"])) == {"a", "b"}, r["text"]


def test_tp2_replicated_kv_head_and_killed_rank_stops_the_server(
    tiny_checkpoints: Any, hf_reference: Callable[[str], Any]
) -> None:
    """Mistral has one KV head: both ranks hold a copy. Then SIGKILL rank 1 (the rank
    without sockets): the server exits non-zero, every process gone."""
    with launch_server(
        args(tiny_checkpoints.path("mistral"), "--tp-size", "2"), client_timeout=CLIENT_TIMEOUT_S
    ) as client:
        assert ids(client.generate(PROMPTS, GREEDY)) == hf_outputs(hf_reference, "mistral", PROMPTS)
        processes = client.server_info()["processes"]
        children = [pid for name, pid in processes.items() if name != "launch"]
        t0 = time.monotonic()
        os.kill(processes["scheduler-1"], signal.SIGKILL)
        code = client.server.process.wait(15)
        assert time.monotonic() - t0 < 15
    assert code != 0
    log = client.server.log_tail(1 << 20)
    # The launcher sees rank 1 die; should rank 0's error report win the race, it names the lost peer.
    assert "scheduler-1 failed" in log or ("scheduler-0 failed" in log and "lost a peer" in log), log
    assert wait_gone(children, 10) == []


# ---------------------------------------------------------------------- data parallelism


def test_dp2_round_robin_uses_both_replicas_and_equals_dp1(
    dp2_round_robin: Client, llama_server: Client, hf_reference: Callable[[str], Any]
) -> None:
    prompts = PROMPTS + ["Once upon a time"]
    before = dp2_round_robin.server_info()
    results = dp2_round_robin.generate(prompts, GREEDY)
    info = dp2_round_robin.server_info()
    assert ids(results) == ids(llama_server.generate(prompts, GREEDY))
    assert ids(results) == hf_outputs(hf_reference, "llama", prompts)
    assert info["dp_size"] == 2 and info["load_balance_method"] == "round_robin"
    dispatched = [a - b for a, b in zip(info["dispatch_counts"], before["dispatch_counts"])]
    assert dispatched == [2, 2]
    finished = [a["num_finished"] - b["num_finished"] for a, b in zip(info["replicas"], before["replicas"])]
    assert finished == [2, 2]
    assert info["num_finished"] == sum(r["num_finished"] for r in info["replicas"])
    assert {"scheduler-dp0-tp0", "scheduler-dp1-tp0", "dp-controller"} <= set(info["processes"])
    assert info["memory_invariant"]["ok"]
    # Each replica reports its own pool; the top level adds them up (two pools in one host's RAM).
    pools = [r["kv_pool"] for r in info["replicas"]]
    assert info["kv_pool"]["tokens"] == sum(p["tokens"] for p in pools) == info["max_total_tokens"]
    assert info["kv_pool"]["share_of_ram"] == pytest.approx(sum(p["share_of_ram"] for p in pools))
    assert all(p["full_length_requests"] == p["tokens"] // p["context_len"] for p in pools)


def _served_by(client: Client, input_ids: list[int]) -> tuple[int, dict[str, Any]]:
    """Send one request, wait for it; (the replica it went to, its result)."""
    before = client.server_info()["dispatch_counts"]
    result = client.generate(input_ids=input_ids, sampling_params={"max_new_tokens": 2, "temperature": 0})
    after = client.server_info()["dispatch_counts"]
    changed = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
    assert len(changed) == 1, (before, after)
    return changed[0], result


def test_dp2_cache_aware_routes_repeats_to_the_replica_with_the_prefix(dp2_cache_aware: Client) -> None:
    prefix_len, vocab = 48, 300  # three router blocks; ordinary token ids of the tiny vocab
    prefixes = [random_prompt(prefix_len, vocab, seed=s) for s in (1, 2)]
    homes: list[int] = []
    for p, prefix in enumerate(prefixes):
        # The first request caches the prefix; its KV events reach the controller
        # with the replica's load report after that step, before the reply arrives.
        home, first = _served_by(dp2_cache_aware, prefix + random_prompt(4, vocab, seed=100 + p))
        homes.append(home)
        for k in range(3):
            replica, repeat = _served_by(dp2_cache_aware, prefix + random_prompt(4, vocab, seed=200 + 10 * p + k))
            assert replica == home
            assert repeat["meta"]["cached_tokens"] >= prefix_len
    # Nothing cached anywhere at first: the second prefix went to the other replica.
    assert sorted(homes) == [0, 1]
    # Unrelated prompts (no shared first block) spread over both replicas.
    before = dp2_cache_aware.server_info()["dispatch_counts"]
    unrelated = [random_prompt(20, vocab, seed=300 + k) for k in range(4)]
    dp2_cache_aware.generate(input_ids=unrelated, sampling_params={"max_new_tokens": 2, "temperature": 0})
    info = dp2_cache_aware.server_info()
    spread = [a - b for a, b in zip(info["dispatch_counts"], before)]
    assert sum(spread) == 4 and min(spread) >= 1, spread
    for home in homes:
        assert info["replicas"][home]["cached_prompt_tokens"] >= 3 * prefix_len
    assert info["memory_invariant"]["ok"]
