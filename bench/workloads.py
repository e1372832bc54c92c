"""Benchmark workloads: lists of token-id prompts, identical for every engine.

Prompts are random token ids under a fixed seed (never special tokens), sent as
``input_ids`` so tokenization cannot make two engines see different inputs.
Every workload is rebuilt from its ``spec()`` (name + parameters), which is
stored in each result file; the roofline script rebuilds it from there to count
the work it contained.

- ``uniform``: independent prompts of one length (no prefix sharing).
- ``single``: one person chatting with the server: requests of 128 prompt tokens -> 128 new
  (by default one), each sent when the one before it finished, so every decode step is a
  batch of one.
- ``shared-prefix``: one long prefix (a system prompt) plus a short unique suffix each.
- ``multi-turn``: chat sessions; turn t's prompt is turn t-1's prompt plus a fixed
  stand-in for the assistant's answer plus a new user message, and turn t is sent
  only after turn t-1 finished (so the prefix cache can serve the history).
  The answer is a fixed stand-in, not the engine's output, so every engine gets
  the same tokens.
- ``multi-turn-overflow``: multi-turn sessions (600-token system prompts by default) whose
  histories add up to ``working_set_ratio`` times a KV pool of ``pool_tokens`` tokens: the
  pool cannot hold them, so a session's history is evicted before its next turn (what a
  hierarchical cache's host tier is for). Give ``pool_tokens`` the server's
  ``--max-total-tokens``.
- ``tree``: prompts that form a prefix tree (shared instructions, then shared
  few-shot examples / agent context per branch, then a unique question), shuffled.
- ``json-schema``: the exception to token-id prompts: chat messages asking to extract a
  record from a short generated text as JSON, each with its JSON schema (``json_schema``
  sampling parameter, greedy, ends with stop). Text, because a constraint is only
  realistic on a real model reading real words; served only (bench/structured.py runs it
  constrained, with and without jump-forward, and unconstrained at the same lengths).
- ``repeat``: text too, for speculative decoding: chat requests whose answer quotes the prompt
  ("rewrite this text with one word changed", "this function with one name changed"), greedy,
  ending at EOS (or ``max_new_tokens``). Served only (bench/speculative.py compares it, and
  ``uniform``, with speculation on and off).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench.chat_workloads import JSON_SCHEMAS, json_schema, repeat
from bench.workload_base import (
    DEFAULT_VOCAB_HIGH,
    DEFAULT_VOCAB_LOW,
    BenchRequest,
    Workload,
    _check_range,
    _random_ids,
)

__all__ = [
    "ALL_WORKLOADS",
    "JSON_SCHEMAS",
    "WORKLOADS",
    "BenchRequest",
    "Workload",
    "from_spec",
    "json_schema",
    "make_workload",
    "parse_workload_args",
    "prefix_tree_stats",
    "repeat",
    "token_range_for",
]


def uniform(
    num_requests: int = 64,
    prompt_len: int = 128,
    max_new_tokens: int = 64,
    seed: int = 0,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
) -> Workload:
    _check_range(vocab_low, vocab_high)
    rng = random.Random(f"uniform-{seed}")
    reqs = [
        BenchRequest(i, _random_ids(rng, prompt_len, vocab_low, vocab_high), max_new_tokens, session=i)
        for i in range(num_requests)
    ]
    return Workload(
        "uniform",
        dict(
            num_requests=num_requests,
            prompt_len=prompt_len,
            max_new_tokens=max_new_tokens,
            seed=seed,
            vocab_low=vocab_low,
            vocab_high=vocab_high,
        ),
        reqs,
    )


def single(
    num_requests: int = 1,
    prompt_len: int = 128,
    max_new_tokens: int = 128,
    seed: int = 0,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
) -> Workload:
    _check_range(vocab_low, vocab_high)
    rng = random.Random(f"single-{seed}")
    reqs = [
        BenchRequest(i, _random_ids(rng, prompt_len, vocab_low, vocab_high), max_new_tokens, after=i - 1 if i else None)
        for i in range(num_requests)
    ]  # one session: one at a time
    return Workload(
        "single",
        dict(
            num_requests=num_requests,
            prompt_len=prompt_len,
            max_new_tokens=max_new_tokens,
            seed=seed,
            vocab_low=vocab_low,
            vocab_high=vocab_high,
        ),
        reqs,
    )


def shared_prefix(
    num_requests: int = 64,
    prefix_len: int = 512,
    suffix_len: int = 32,
    max_new_tokens: int = 64,
    seed: int = 0,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
) -> Workload:
    _check_range(vocab_low, vocab_high)
    rng = random.Random(f"shared-prefix-{seed}")
    prefix = _random_ids(rng, prefix_len, vocab_low, vocab_high)
    reqs = [
        BenchRequest(i, prefix + _random_ids(rng, suffix_len, vocab_low, vocab_high), max_new_tokens, session=i)
        for i in range(num_requests)
    ]
    return Workload(
        "shared-prefix",
        dict(
            num_requests=num_requests,
            prefix_len=prefix_len,
            suffix_len=suffix_len,
            max_new_tokens=max_new_tokens,
            seed=seed,
            vocab_low=vocab_low,
            vocab_high=vocab_high,
        ),
        reqs,
    )


def multi_turn(
    num_requests: int = 64,
    num_turns: int = 4,
    system_len: int = 128,
    user_len: int = 64,
    answer_len: int = 64,
    max_new_tokens: int = 64,
    seed: int = 0,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
) -> Workload:
    """``num_requests // num_turns`` sessions (at least one) of ``num_turns`` turns each."""
    _check_range(vocab_low, vocab_high)
    if num_turns < 1:
        raise ValueError("num_turns must be >= 1")
    rng = random.Random(f"multi-turn-{seed}")
    sessions = max(1, num_requests // num_turns)
    reqs: list[BenchRequest] = []
    for s in range(sessions):
        history = _random_ids(rng, system_len, vocab_low, vocab_high)
        prev: int | None = None
        for t in range(num_turns):
            if t > 0:
                history = history + _random_ids(rng, answer_len, vocab_low, vocab_high)  # the "answer" of turn t-1
            history = history + _random_ids(rng, user_len, vocab_low, vocab_high)
            index = len(reqs)
            reqs.append(BenchRequest(index, history, max_new_tokens, after=prev, session=s))
            prev = index
    return Workload(
        "multi-turn",
        dict(
            num_requests=num_requests,
            num_turns=num_turns,
            system_len=system_len,
            user_len=user_len,
            answer_len=answer_len,
            max_new_tokens=max_new_tokens,
            seed=seed,
            vocab_low=vocab_low,
            vocab_high=vocab_high,
        ),
        reqs,
    )


def multi_turn_overflow(
    pool_tokens: int = 16384,
    working_set_ratio: float = 4.0,
    num_turns: int = 4,
    system_len: int = 600,
    user_len: int = 64,
    answer_len: int = 64,
    max_new_tokens: int = 64,
    num_requests: int | None = None,
    seed: int = 0,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
) -> Workload:
    """Enough ``multi_turn`` sessions that their final histories total ``working_set_ratio * pool_tokens``
    tokens (``num_requests``, when given, fixes the request count instead)."""
    if pool_tokens < 1 or working_set_ratio <= 0:
        raise ValueError("pool_tokens must be >= 1 and working_set_ratio > 0")
    final_len = system_len + num_turns * user_len + (num_turns - 1) * answer_len
    sessions = max(1, -(-int(working_set_ratio * pool_tokens) // final_len))
    inner = multi_turn(
        num_requests if num_requests is not None else sessions * num_turns,
        num_turns,
        system_len,
        user_len,
        answer_len,
        max_new_tokens,
        seed,
        vocab_low,
        vocab_high,
    )
    return Workload(
        "multi-turn-overflow",
        dict(
            pool_tokens=pool_tokens,
            working_set_ratio=working_set_ratio,
            num_turns=num_turns,
            system_len=system_len,
            user_len=user_len,
            answer_len=answer_len,
            max_new_tokens=max_new_tokens,
            num_requests=num_requests,
            seed=seed,
            vocab_low=vocab_low,
            vocab_high=vocab_high,
        ),
        inner.requests,
    )


def tree(
    num_requests: int = 64,
    branching: int = 4,
    segment_lens: tuple[int, ...] | list[int] = (256, 128, 64, 32),
    max_new_tokens: int = 64,
    seed: int = 0,
    vocab_low: int = DEFAULT_VOCAB_LOW,
    vocab_high: int = DEFAULT_VOCAB_HIGH,
) -> Workload:
    """Prompt i = root segment + one segment per inner level + a unique leaf segment.

    With ``segment_lens=(root, l1, ..., leaf)`` there are ``len - 2`` inner levels; at
    each, ``branching`` children per node, so request i's path is its index written in
    base ``branching``. The defaults give 1 root, 4 + 16 inner nodes and 64 leaves.
    Requests are shuffled so siblings are not sent next to each other.
    """
    _check_range(vocab_low, vocab_high)
    lens = [int(x) for x in segment_lens]
    if len(lens) < 2 or branching < 1:
        raise ValueError("tree needs at least a root and a leaf segment and branching >= 1")
    inner = len(lens) - 2
    segments: dict[tuple[int, int], list[int]] = {}

    def segment(level: int, node: int) -> list[int]:
        if (level, node) not in segments:
            rng = random.Random(f"tree-{seed}-{level}-{node}")
            segments[(level, node)] = _random_ids(rng, lens[level], vocab_low, vocab_high)
        return segments[(level, node)]

    prompts = []
    for i in range(num_requests):
        ids = list(segment(0, 0))
        for level in range(1, inner + 1):
            # The node at this level: i's path digits down to this level.
            ids += segment(level, i // branching ** (inner - level + 1))
        ids += segment(inner + 1, i)
        prompts.append(ids)
    order = list(range(num_requests))
    random.Random(f"tree-order-{seed}").shuffle(order)
    reqs = [BenchRequest(k, prompts[i], max_new_tokens, session=k) for k, i in enumerate(order)]
    return Workload(
        "tree",
        dict(
            num_requests=num_requests,
            branching=branching,
            segment_lens=lens,
            max_new_tokens=max_new_tokens,
            seed=seed,
            vocab_low=vocab_low,
            vocab_high=vocab_high,
        ),
        reqs,
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "uniform": uniform,
    "single": single,
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "multi-turn-overflow": multi_turn_overflow,
    "tree": tree,
    "json-schema": json_schema,
    "repeat": repeat,
}


# What ``--workload all`` runs: multi-turn-overflow is sized against a server's pool, and
# json-schema is a comparison of its own (bench/structured.py), so they are asked for by name.
ALL_WORKLOADS = ("uniform", "shared-prefix", "multi-turn", "tree")


def make_workload(name: str, **params: Any) -> Workload:
    """Build workload ``name``; unknown parameters raise TypeError naming them."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](**params)


def from_spec(spec: dict[str, Any]) -> Workload:
    """Inverse of ``Workload.spec()``."""
    params = dict(spec)
    return make_workload(params.pop("name"), **params)


def parse_workload_args(items: list[str] | None) -> dict[str, Any]:
    """``["prefix_len=256", "segment_lens=64,32,16"]`` -> parameters (ints, int lists, floats)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        key = key.strip().replace("-", "_")
        if "," in raw:
            out[key] = [int(x) for x in raw.split(",") if x.strip()]
        else:
            try:
                out[key] = int(raw)
            except ValueError:
                out[key] = float(raw)
    return out


# ---------------------------------------------------------------------- work accounting


@dataclass(frozen=True)
class PrefixTreeStats:
    """The prompts' tokens with shared prefixes counted once (the least prefill any engine must do)."""

    unique_tokens: int  # nodes of the token trie of all prompts
    attended_keys: int  # sum over those tokens of (position + 1): causal attention's key count


def prefix_tree_stats(prompts: list[list[int]]) -> PrefixTreeStats:
    root: dict[int, Any] = {}
    unique = 0
    keys = 0
    for ids in prompts:
        node = root
        for pos, tok in enumerate(ids):
            child = node.get(tok)
            if child is None:
                child = {}
                node[tok] = child
                unique += 1
                keys += pos + 1
            node = child
    return PrefixTreeStats(unique, keys)


def token_range_for(model_path: str | None, vocab_size: int | None = None) -> tuple[int, int]:
    """``[low, high)`` of prompt ids for a checkpoint: above every special token, inside
    both the tokenizer's and the model's vocabulary."""
    low, high = DEFAULT_VOCAB_LOW, vocab_size or DEFAULT_VOCAB_HIGH
    if model_path is None or not Path(model_path).is_dir():  # e.g. a remote server's path
        return low, high
    cfg_file = Path(model_path) / "config.json"
    if cfg_file.is_file():
        high = min(high, int(json.loads(cfg_file.read_text()).get("vocab_size", high)))
    tok_file = Path(model_path) / "tokenizer.json"
    if tok_file.is_file():
        data = json.loads(tok_file.read_text())
        added = [int(t["id"]) for t in data.get("added_tokens", [])]
        vocab = data.get("model", {}).get("vocab", {})
        ids = added + [int(i) for i in vocab.values()] if isinstance(vocab, dict) else added
        if ids:
            high = min(high, max(ids) + 1)
        special = sorted({int(t["id"]) for t in data.get("added_tokens", []) if t.get("special")})
        # Special tokens sit at the start (Llama, the tokenizers built here), the end (Qwen) or both
        # and between (Gemma: pad/eos/bos first, turn markers inside, thousands unused at the end):
        # the longest run of ids between two of them is the prompts' range.
        if special:
            bounds = [low - 1, *(i for i in special if low <= i < high), high]
            low, high = max(((a + 1, b) for a, b in zip(bounds, bounds[1:])), key=lambda r: r[1] - r[0])
    if low >= high:
        raise ValueError(f"no ordinary token ids in {model_path} (range [{low}, {high}))")
    return low, high
