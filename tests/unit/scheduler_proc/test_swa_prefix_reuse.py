"""A cached prefix stays matchable on a sliding-window model however often requests reuse it.

A request that reuses a cached prefix P must not give back the SWA half of P's last window
(the tree's, which the next request with the same prefix needs to match P at all): each
successive request on P reports P as cached and still produces transformers' greedy tokens,
and both pools' invariant holds after every request. The windowed checkpoint is
``mistral_swa`` (every layer windowed, W = 16); prompts span several windows.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.checkpoints import SWA_WINDOWS, hf_greedy, load_hf_model, random_prompt
from tests.support.stub_scheduler import run_until_idle
from tests.unit.scheduler_proc.test_swa_memory import assert_both_pools_clean, make_scheduler, submit

NAME = "mistral_swa"
WINDOW = SWA_WINDOWS[NAME]
PREFIX_LEN = 42  # > 2 windows
NEW_TOKENS = 12

_expected: dict[tuple[int, ...], list[int]] = {}


@pytest.fixture(scope="module")
def reference(tiny_checkpoints: Any) -> Any:
    return load_hf_model(tiny_checkpoints.path(NAME))


def _greedy(reference: Any, prompt: list[int]) -> list[int]:
    if tuple(prompt) not in _expected:
        _expected[tuple(prompt)] = hf_greedy(reference, prompt, NEW_TOKENS)[0]
    return _expected[tuple(prompt)]


def _run_one(sched: Any, rid: str, prompt: list[int]) -> dict[str, Any]:
    submit(sched, rid, prompt, n=NEW_TOKENS)
    result = run_until_idle(sched)[rid]
    assert_both_pools_clean(sched)  # the invariant, idle: nothing protected or request-owned is left
    return result


@pytest.mark.parametrize("chunk", [8, None], ids=["chunked8", "unchunked"])
@pytest.mark.parametrize("suffix_len", [5, 20], ids=["short-suffix", "suffix>W"])
def test_successive_requests_on_a_cached_prefix_all_hit(
    tiny_checkpoints: Any, reference: Any, chunk: int | None, suffix_len: int
) -> None:
    """A caches P; then five requests P + suffix_i each report P as cached (before the fix the
    first reuse tombstoned P's last window and every later one matched nothing)."""
    sched = make_scheduler(tiny_checkpoints.path(NAME), chunked_prefill_size=chunk or -1)
    vocab = sched.runner.vocab_size
    prefix = random_prompt(PREFIX_LEN, vocab, seed=77)
    first = _run_one(sched, "a", prefix)
    assert first["ids"] == _greedy(reference, prefix)
    for i in range(5):
        prompt = prefix + random_prompt(suffix_len, vocab, seed=100 + i)
        got = _run_one(sched, f"r{i}", prompt)
        assert got["cached"] >= PREFIX_LEN, (i, got["cached"])
        assert got["ids"] == _greedy(reference, prompt), i


@pytest.mark.parametrize("chunk", [8, None], ids=["chunked8", "unchunked"])
def test_a_shorter_reuse_keeps_a_longer_cached_conversation_matchable(
    tiny_checkpoints: Any, reference: Any, chunk: int | None
) -> None:
    """A conversation (prompt + a short answer) is cached; a request reusing only part of it, and
    going on elsewhere, must not take the SWA half of the conversation's last window."""
    sched = make_scheduler(tiny_checkpoints.path(NAME), chunked_prefill_size=chunk or -1)
    vocab = sched.runner.vocab_size
    history = random_prompt(PREFIX_LEN, vocab, seed=78)
    answer = _run_one(sched, "a", history)["ids"]
    partial = history[: PREFIX_LEN - 2] + random_prompt(20, vocab, seed=5)
    got = _run_one(sched, "b", partial)
    assert got["ids"] == _greedy(reference, partial)
    turn = history + answer + random_prompt(4, vocab, seed=6)
    again = _run_one(sched, "c", turn)
    assert again["cached"] == PREFIX_LEN + NEW_TOKENS - 1, again["cached"]
    assert again["ids"] == _greedy(reference, turn)
