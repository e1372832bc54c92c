"""Prompt logprobs (``logprob_start_len``) and ``max_new_tokens`` 0 end to end: launch.py, the
real processes, the ZMQ client, on the session's tiny Llama server (radix cache on), against
transformers. (The /generate side is in test_http_server.py.)
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

pytest.register_assert_rewrite("server_fixtures")

from runtime.client import Client, RequestError  # noqa: E402
from tests.support.checkpoints import hf_greedy, random_prompt  # noqa: E402
from tests.support.server_fixtures import is_idle, wait_until  # noqa: E402

pytest_plugins = ["tests.support.server_fixtures"]

GREEDY = {"temperature": 0, "ignore_eos": True}


def reference(model: Any, prompt: list[int], start: int, k: int) -> tuple[list[Any], list[Any]]:
    """transformers' [logprob or None, token] per prompt token from ``start``, and the k best."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    tokens: list[Any] = [[None, prompt[0]]] if start == 0 else []
    tops: list[Any] = [None] if start == 0 else []
    for i in range(max(start, 1), len(prompt)):
        tokens.append([float(logprobs[i - 1, prompt[i]]), prompt[i]])
        values, ids = logprobs[i - 1].topk(k)
        tops.append([[float(v), int(t)] for v, t in zip(values, ids)])
    return tokens, tops


def assert_matches(meta: dict[str, Any], want: tuple[list[Any], list[Any]]) -> None:
    tokens, tops = want
    got = meta["input_token_logprobs"]
    assert [t for _, t in got] == [t for _, t in tokens]
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in tokens], abs=1e-4)
    got_top = meta["input_top_logprobs"]
    assert [None if row is None else [t for _, t in row] for row in got_top] == [
        None if row is None else [t for _, t in row] for row in tops
    ]


def test_prompt_logprobs_through_the_client(llama_server: Client, hf_reference: Callable[[str], Any]) -> None:
    model, _ = hf_reference("llama")
    prompt = random_prompt(37, model.config.vocab_size, seed=4242)
    want = reference(model, prompt, 9, 2)
    # Twice: the second finds the prompt cached, yet computes it again from position 8.
    for _ in range(2):
        r = llama_server.generate(
            input_ids=prompt,
            sampling_params={**GREEDY, "max_new_tokens": 3},
            return_logprob=True,
            top_logprobs_num=2,
            logprob_start_len=9,
        )
        assert r["output_ids"] == hf_greedy(model, prompt, 3)[0]
        assert_matches(r["meta"], want)
        assert len(r["meta"]["output_token_logprobs"]) == 3
    assert r["meta"]["cached_tokens"] <= 8
    # Streaming: the first chunk with output carries them, no later one.
    chunks = list(
        llama_server.generate(
            input_ids=prompt,
            sampling_params={**GREEDY, "max_new_tokens": 3},
            stream=True,
            return_logprob=True,
            top_logprobs_num=2,
            logprob_start_len=9,
        )
    )
    assert_matches(chunks[0]["meta"], want)
    assert not any("input_token_logprobs" in c["meta"] for c in chunks[1:])
    # n = 2: each sample has them; without return_logprob there are none.
    rs = llama_server.generate(
        input_ids=prompt,
        sampling_params={**GREEDY, "max_new_tokens": 2, "n": 2},
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=9,
    )
    for r in rs:
        assert_matches(r["meta"], want)
    plain = llama_server.generate(
        input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 2}, logprob_start_len=9
    )
    assert "input_token_logprobs" not in plain["meta"]


def test_max_new_tokens_zero_scores_the_prompt(llama_server: Client, hf_reference: Callable[[str], Any]) -> None:
    model, _ = hf_reference("llama")
    prompt = random_prompt(21, model.config.vocab_size, seed=77)
    r = llama_server.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        top_logprobs_num=1,
        logprob_start_len=0,
    )
    assert r["output_ids"] == [] and r["text"] == ""
    assert r["meta"]["finish_reason"] == {"type": "length", "length": 0}
    assert r["meta"]["completion_tokens"] == 0
    assert_matches(r["meta"], reference(model, prompt, 0, 1))
    info = wait_until(lambda: is_idle(llama_server), 30, "the server to go idle")
    assert info["memory_invariant"]["ok"]


@pytest.mark.parametrize("start,return_logprob", [(-2, True), (5, True), (7, False)])
def test_a_logprob_start_outside_the_prompt_is_refused(llama_server: Client, start: int, return_logprob: bool) -> None:
    with pytest.raises(RequestError) as err:
        llama_server.generate(
            input_ids=[5, 6, 7, 8, 9],
            sampling_params={"max_new_tokens": 1},
            return_logprob=return_logprob,
            logprob_start_len=start,
        )
    assert err.value.code == "invalid_request" and "logprob_start_len" in err.value.message
