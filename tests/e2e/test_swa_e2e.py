"""A sliding-window model served end to end: launch.py, the real client, the hybrid SWA pools.

One server (the tiny hybrid Qwen2: two full-attention layers, two windowed with W = 24) with
chunked prefill shorter than the window and a small SWA pool; its greedy tokens equal
transformers' for prompts and generations several windows long, its context length is the
model's (not the window), a cached prefix stays matchable however many requests reuse it,
and server_info reports both pools clean when idle.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from runtime.client import Client
from tests.support.checkpoints import SWA_WINDOWS, hf_greedy, load_hf_model, random_prompt
from tests.support.server_process import launch_server

pytest.register_assert_rewrite("server_fixtures")
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args, is_idle, wait_until  # noqa: E402

pytest_plugins = ["tests.support.server_fixtures"]

NAME = "qwen2_swa"


@pytest.fixture(scope="module")
def swa_server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(
        tiny_checkpoints.path(NAME),
        "--chunked-prefill-size",
        "16",
        "--swa-full-tokens-ratio",
        "0.5",
        max_total_tokens=1024,
    )
    with launch_server(args, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def test_greedy_equals_transformers_and_both_pools_come_back(swa_server: Client, tiny_checkpoints: Any) -> None:
    info = swa_server.server_info()
    assert info["context_len"] == 512 > SWA_WINDOWS[NAME]  # max_position_embeddings, not the window
    assert info["swa_hybrid_memory"] and info["swa_max_total_tokens"] == 512 and info["max_total_tokens"] == 1024
    vocab = int(info["model"]["vocab_size"])
    prompts = [random_prompt(n, vocab, seed=40 + n) for n in (9, 30, 70, 100)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 48}
    got = swa_server.generate(input_ids=prompts, sampling_params=params)
    hf = load_hf_model(tiny_checkpoints.path(NAME))
    for prompt, out in zip(prompts, got):
        assert out["output_ids"] == hf_greedy(hf, prompt, 48)[0], f"prompt of {len(prompt)} tokens"
    # The next turn of the longest conversation reuses its whole history from the cache.
    turn = prompts[3] + got[3]["output_ids"] + random_prompt(10, vocab, seed=7)
    (again,) = swa_server.generate(input_ids=[turn], sampling_params={**params, "max_new_tokens": 16})
    assert again["output_ids"] == hf_greedy(hf, turn, 16)[0]
    assert again["meta"]["cached_tokens"] == len(prompts[3]) + 47
    idle = wait_until(lambda: is_idle(swa_server), 30, "the server to go idle")
    invariant = idle["memory_invariant"]
    assert invariant["ok"], invariant["message"]
    assert invariant["swa"]["available"] + invariant["swa"]["evictable"] == invariant["swa"]["size"] == 512
    assert idle["swa_available_tokens"] + idle["swa_evictable_tokens"] == 512


def test_a_cached_prefix_stays_matchable_after_requests_reuse_it(swa_server: Client, tiny_checkpoints: Any) -> None:
    """Request A caches a prompt P longer than two windows; B = P + one suffix and then C = P +
    another both reuse all of P (before the fix B's reuse gave P's last window back and C matched
    nothing), and both equal transformers; both pools come back clean."""
    vocab = int(swa_server.server_info()["model"]["vocab_size"])
    window = SWA_WINDOWS[NAME]
    prefix = random_prompt(2 * window + 12, vocab, seed=61)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 8}
    hf = load_hf_model(tiny_checkpoints.path(NAME))
    (first,) = swa_server.generate(input_ids=[prefix], sampling_params=params)
    assert first["output_ids"] == hf_greedy(hf, prefix, 8)[0]
    for seed in (62, 63):
        prompt = prefix + random_prompt(window + 4, vocab, seed=seed)
        (out,) = swa_server.generate(input_ids=[prompt], sampling_params=params)
        assert out["meta"]["cached_tokens"] == len(prefix), seed
        assert out["output_ids"] == hf_greedy(hf, prompt, 8)[0], seed
    idle = wait_until(lambda: is_idle(swa_server), 30, "the server to go idle")
    assert idle["memory_invariant"]["ok"], idle["memory_invariant"]["message"]
    assert idle["swa_available_tokens"] + idle["swa_evictable_tokens"] == idle["swa_max_total_tokens"]
