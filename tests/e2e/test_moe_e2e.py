"""Mixtures of experts served through launch.py, as processes: expert parallelism and tensor
parallelism over gloo between scheduler processes, with the features a dense model has.

- ``--tp-size 2 --ep-size 2`` (each rank whole experts) on Qwen3-MoE and OLMoE, ``--tp-size 2`` (each
  rank a slice of every expert) on Mixtral and Qwen2-MoE (shared expert): greedy output equal to
  transformers' ``generate``, with 8-token chunks, overlap on and off, logprobs equal to its
  ``log_softmax``;
- a regex-constrained request and a repeated prompt (a prefix-cache hit) on the same server;
- the memory invariant after.

The per-rank math is tests/unit/runtime/engine/layers/test_moe.py's; here the processes, the collectives and the
front door carry it.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest

from tests.support.checkpoints import TinyCheckpoints, hf_greedy
from tests.support.server_process import launch_server

pytest_plugins = ["tests.support.server_fixtures"]

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog again and again", "def add(a, b):"]
NEW_TOKENS = 10
PATTERN = r"[a-z]{3,6}-[0-9]{2}"
SERVERS = [  # (checkpoint, flags beyond --tp-size 2)
    ("qwen3_moe", ["--ep-size", "2", "--enable-overlap-schedule"]),
    ("olmoe", ["--ep-size", "2", "--disable-overlap-schedule"]),
    ("mixtral", ["--disable-overlap-schedule"]),
    ("qwen2_moe", ["--enable-overlap-schedule"]),
]


@pytest.mark.parametrize(("name", "flags"), SERVERS)
def test_tp2_processes_serve_transformers_greedy_output(
    name: str, flags: list[str], tiny_checkpoints: TinyCheckpoints, hf_reference: Callable[[str], Any]
) -> None:
    model, tok = hf_reference(name)
    args = ["--model-path", str(tiny_checkpoints.path(name)), "--dtype", "float32", "--device", "cpu"]
    args += ["--max-total-tokens", "2048", "--tp-size", "2", "--chunked-prefill-size", "8", *flags]
    greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    with launch_server(args, client_timeout=120) as client:
        results = client.generate(PROMPTS, greedy, return_logprob=True)
        again = client.generate(PROMPTS[1], greedy)
        constrained = client.generate(PROMPTS[0], {"max_new_tokens": 16, "temperature": 0, "regex": PATTERN})
        info = client.server_info()
    assert client.server.process.returncode == 0, client.server.log_tail()
    for prompt, result in zip(PROMPTS, results, strict=True):
        ids = tok.encode(prompt)
        expected, logprobs = hf_greedy(model, ids, NEW_TOKENS)
        assert result["meta"]["prompt_tokens"] == len(ids)
        assert result["output_ids"] == expected, prompt
        got = [lp for lp, _ in result["meta"]["output_token_logprobs"]]
        assert got == pytest.approx(logprobs, abs=1e-4)
    assert again["output_ids"] == results[1]["output_ids"] and again["meta"]["cached_tokens"] > 0
    assert re.fullmatch(PATTERN, constrained["text"]), constrained["text"]
    assert info["memory_invariant"]["ok"]
