"""The front door's routing state of one client request, from acceptance to its last output.

A ``ReqGroup`` is one client request (its client identity and rid); each of its ``n``
samples is one scheduler request (``SampleState``, by internal rid). Only the
``RequestTable`` (tokenizer_proc/request_table.py) adds and removes them; the output
routing fills in a sample's outputs and timings as they arrive. A group leaves the table
when its last sample finishes, errors or is aborted.

(Not to be confused with ``memory/req_state.py``, the prefix caches' view of a scheduler
request.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from runtime.protocol.messages import ChunkMeta


@dataclass
class SampleState:
    """One scheduler request (one of the ``n`` samples of a client request)."""

    index: int
    internal_rid: str
    finished: bool = False
    text: list[str] = field(default_factory=list)  # non-stream: accumulated deltas
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[Any] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    token_ids_logprobs: list[Any] = field(default_factory=list)  # non-stream: output_token_ids_logprobs so far
    # non-stream: the output that carried the prompt logprobs (its input_* lists), for the final reply's meta
    input_logprobs: ChunkMeta | None = None
    first_output_at: float | None = None  # perf_counter of the first output (its prompt is prefilled)
    last_output_at: float = 0.0


@dataclass
class ReqGroup:
    """A client's generate request, from acceptance until every sample has finished."""

    identity: bytes
    client_rid: str
    stream: bool
    samples: list[SampleState]
    started: float = field(default_factory=time.perf_counter)  # perf_counter at acceptance: every latency

    @property
    def n(self) -> int:
        return len(self.samples)

    def unfinished(self) -> list[SampleState]:
        return [s for s in self.samples if not s.finished]
