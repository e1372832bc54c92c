"""A sliding-window model served end to end: launch.py, the real client, the hybrid SWA pools.

One server (the tiny hybrid Qwen2: two full-attention layers, two windowed with W = 24) with
chunked prefill shorter than the window and a small SWA pool; its greedy tokens equal
transformers' for prompts and generations several windows long, its context length is the
model's (not the window), and server_info reports both pools clean when idle.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.support.checkpoints import SWA_WINDOWS, hf_greedy, load_hf_model, random_prompt
from tests.support.server_process import launch_server
from runtime.client import Client

pytest.register_assert_rewrite("server_fixtures")
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, base_args, is_idle, wait_until  # noqa: E402

pytest_plugins = ["tests.support.server_fixtures"]

NAME = "qwen2_swa"


@pytest.fixture(scope="module")
def swa_server(tiny_checkpoints: Any) -> Iterator[Client]:
    args = base_args(tiny_checkpoints.path(NAME), "--chunked-prefill-size", "16", "--swa-full-tokens-ratio", "0.5",
                     max_total_tokens=1024)
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
