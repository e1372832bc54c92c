"""What every benchmark workload is made of: ``BenchRequest`` (one request, and the request it
must wait for) and ``Workload`` (a named list of them, rebuilt from its ``spec()``), and the token
range they draw prompts from. ``bench.workloads`` builds the workloads by name."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

DEFAULT_VOCAB_LOW = 6  # the tokenizers built here put their 6 special tokens first
DEFAULT_VOCAB_HIGH = 32000


@dataclass(frozen=True)
class BenchRequest:
    index: int
    input_ids: list[int]
    max_new_tokens: int
    after: int | None = None  # index of the request that must finish before this one is sent
    session: int = 0  # requests of one session form a chain through ``after``
    # A chat request (sent as ``messages``, ``input_ids`` empty) and its output's JSON schema (text).
    messages: list[dict[str, str]] | None = None
    json_schema: str | None = None
    until_eos: bool = False  # greedy up to EOS (max_new_tokens a cap), not exactly max_new_tokens
    lora_path: str | None = None  # the LoRA adapter to generate with, by its served name (None: the base)


@dataclass
class Workload:
    name: str
    params: dict[str, Any]  # make_workload(name, **params) rebuilds exactly this workload
    requests: list[BenchRequest] = field(default_factory=list)

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}

    @property
    def chat(self) -> bool:
        """Sent as chat messages (text the server tokenizes), not token ids: served only."""
        return any(r.messages is not None for r in self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    def chains(self) -> list[list[BenchRequest]]:
        """Requests grouped into dependency chains, each in send order (a session's turns)."""
        chains: dict[int, list[BenchRequest]] = {}
        for req in self.requests:
            chains.setdefault(req.session, []).append(req)
        return list(chains.values())

    @property
    def max_parallel(self) -> int:
        """How many requests can be in flight at once (independent chains)."""
        return len(self.chains())

    def levels(self) -> list[list[BenchRequest]]:
        """Requests grouped by dependency depth: level k may run once level k-1 finished."""
        depth: dict[int, int] = {}
        by_index = {r.index: r for r in self.requests}
        levels: list[list[BenchRequest]] = []
        for req in self.requests:
            d = 0 if req.after is None else depth[by_index[req.after].index] + 1
            depth[req.index] = d
            while len(levels) <= d:
                levels.append([])
            levels[d].append(req)
        return levels


def _random_ids(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


def _check_range(vocab_low: int, vocab_high: int) -> None:
    if not 0 <= vocab_low < vocab_high:
        raise ValueError(f"empty token range [{vocab_low}, {vocab_high})")
