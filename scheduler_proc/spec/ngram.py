"""N-gram drafts: continue a request's text the way it continued the last time its latest tokens
occurred in its own prompt and output (SGLang's NGRAM, vLLM's ``ngram`` proposer; no draft model).

Text that quotes its prompt (a rewrite with one word changed, a code edit, an answer citing its
context) repeats long runs of earlier tokens; after the first tokens of such a run the rest is
predictable from the earlier copy. The match is found through a per-request index of where each
token occurred, so a step costs O(candidates x window), not a scan of the whole sequence.

Owner: the proposer's state of a request (``NgramIndex``) lives on the request
(``Req.spec_index``) and only this module writes it; it is rebuilt if the request's tokens were
rewritten under it (a retraction keeps them; a jump-forward only appends).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Earlier occurrences of the latest token examined per draft, most recent first: bounds a step's
# work on long, repetitive sequences (a token seen thousands of times).
MAX_CANDIDATES = 64
# After a draft of which nothing was accepted, a request skips drafting for 2**misses steps (misses:
# such drafts in a row), at most this many: text that does not repeat itself stops paying for
# verification (each verify step costs more than a decode step), text that does resumes soon.
MAX_BACKOFF_STEPS = 8


@dataclass
class NgramIndex:
    """Where each token of a sequence occurred (positions ascending), for the tokens seen so far."""

    positions: dict[int, list[int]] = field(default_factory=dict)
    length: int = 0  # tokens indexed
    fingerprint: tuple[int, ...] = ()  # the first tokens indexed: a different sequence rebuilds
    misses: int = 0  # drafts in a row of which nothing was accepted
    skip: int = 0  # steps left without drafting

    def record(self, drafted: int, accepted: int) -> None:
        """A verify step's outcome for this request: back off after a draft that missed entirely."""
        if drafted and not accepted:
            self.misses += 1
            self.skip = min(2**self.misses, MAX_BACKOFF_STEPS)
        elif accepted:
            self.misses = 0

    def extend(self, tokens: list[int]) -> None:
        """Index ``tokens[self.length:]`` (the tokens appended since the last call)."""
        for pos in range(self.length, len(tokens)):
            self.positions.setdefault(tokens[pos], []).append(pos)
        self.length = len(tokens)


class NgramProposer:
    """Drafts up to ``num_draft_tokens`` tokens from the longest match of at least
    ``min_window`` latest tokens (compared over at most ``max_window``), the most recent one on ties."""

    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.min_window = min_window
        self.max_window = max_window

    def propose(self, tokens: list[int], index: NgramIndex | None, limit: int) -> tuple[list[int], NgramIndex]:
        """Drafts (at most ``limit``) continuing ``tokens``; ``index`` is the request's index from the
        last call (None the first time), returned brought up to date."""
        if index is None or index.length > len(tokens) or tuple(tokens[: len(index.fingerprint)]) != index.fingerprint:
            index = NgramIndex(fingerprint=tuple(tokens[:4]))
        index.extend(tokens)
        if index.skip > 0:
            index.skip -= 1
            return [], index
        limit = min(limit, self.num_draft_tokens)
        n = len(tokens)
        if limit <= 0 or n < 2:
            return [], index
        last = n - 1
        candidates = index.positions.get(tokens[last], [])
        best_len, best_pos = 0, -1
        # Candidates before the last token, most recent first; a longer match wins, the first found on ties.
        seen = 0
        for pos in reversed(candidates):
            if pos >= last:
                continue
            seen += 1
            if seen > MAX_CANDIDATES:
                break
            length = 1
            top = min(self.max_window, pos + 1)
            while length < top and tokens[pos - length] == tokens[last - length]:
                length += 1
            if length > best_len:
                best_len, best_pos = length, pos
                if length == self.max_window:
                    break
        if best_len < self.min_window:
            return [], index
        # Copy what followed the match; a copy that runs into the present continues from the
        # draft itself (a repeating pattern is extrapolated, period by period).
        draft: list[int] = []
        src = best_pos + 1
        for _ in range(limit):
            draft.append(tokens[src] if src < n else draft[src - n])
            src += 1
        return draft, index
