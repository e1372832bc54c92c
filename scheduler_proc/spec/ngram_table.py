"""N-grams seen across requests (``--speculative-ngram-capacity``): what followed each short run of
tokens in the text of requests that finished, for a request whose own text has no match yet.

A request's own prompt and output (``ngram.NgramIndex``) cover text that quotes itself; answers that
look like earlier answers (a template-shaped reply, the same function written for another user, a
JSON object of a fixed shape) are only found across requests. SGLang keeps such a table as a trie
of token sequences; this one is flat: a run of the last 2 to 4 tokens maps to what followed it the
most recent time, and the table forgets its least recently used runs past its capacity.

Owner: the scheduler's ``SpecDecoder`` (one per scheduler process; under TP every rank sees the
same requests finish in the same order, so every rank drafts the same tokens).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

KEY_LENGTHS = (4, 3, 2)  # runs looked up, longest first


class NgramTable:
    """At most ``capacity`` runs, each with up to ``continuation`` tokens that followed it."""

    def __init__(self, capacity: int, continuation: int, min_window: int = 1, max_window: int = 12) -> None:
        self.capacity = capacity
        self.continuation = continuation
        self.key_lengths = tuple(n for n in KEY_LENGTHS if min_window <= n <= max_window) or (max(min_window, 1),)
        self.entries: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, tokens: Sequence[int]) -> None:
        """Record every run of ``tokens`` (a finished request's prompt and output) with what
        followed it; a run seen before takes the newer continuation."""
        if self.capacity <= 0:
            return
        entries = self.entries
        tokens = list(tokens)
        for n in self.key_lengths:
            for end in range(n, len(tokens)):
                key = tuple(tokens[end - n : end])
                entries[key] = tuple(tokens[end : end + self.continuation])
                entries.move_to_end(key)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def lookup(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest recorded run ending ``tokens``."""
        for n in self.key_lengths:
            if len(tokens) < n:
                continue
            key = tuple(tokens[-n:])
            found = self.entries.get(key)
            if found:
                self.entries.move_to_end(key)
                return list(found[:limit])
        return []
