"""One request's grammar state: the token bitmask of its next step, and the tokens it took.

xgrammar's matcher is a pushdown automaton over the vocabulary; a bitmask row holds one
bit per token (``int32`` words, bit set = allowed). The scheduler fills the rows of the
constrained requests of a step on the host; the sampler applies them to the logits before
anything else (``DeviceOps.apply_token_bitmask``).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch
import xgrammar as xgr

from runtime.text.grammar.backend import Compiled


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host ``int32 [rows, ceil(vocab / 32)]`` bitmask with every token allowed."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


# One xgrammar batch matcher per thread that fills masks (each scheduler fills from its own thread).
_batch_fillers = threading.local()


def fill_bitmask(
    grammars: Sequence["RequestGrammar"], rows: Sequence[int], batch_size: int, vocab_size: int
) -> torch.Tensor:
    """The host bitmask of a step: row ``rows[i]`` from ``grammars[i]``, every other row all-allowed.

    One call fills every row on xgrammar's own threads (a row inside some JSON states scans much
    of the vocabulary); a terminated grammar's row is left all-allowed (see ``RequestGrammar.fill``).
    """
    mask = allocate_bitmask(batch_size, vocab_size)
    live = [(g, row) for g, row in zip(grammars, rows) if not g.terminated]
    if live:
        filler = getattr(_batch_fillers, "matcher", None)
        if filler is None:
            filler = _batch_fillers.matcher = xgr.BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads()))
        filler.batch_fill_next_token_bitmask([g._matcher for g, _ in live], mask, [row for _, row in live])
    return mask


class RequestGrammar:
    """The matcher of one request (one sample: each of ``n`` samples has its own).

    Owned by the request, used only by its scheduler's thread. ``terminated`` turns true
    once the grammar is complete and a stop token was accepted; a token the grammar does
    not allow is refused (``accept`` returns False) and leaves the state as it was.
    """

    def __init__(self, compiled: Compiled) -> None:
        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self.compile_seconds = compiled.seconds  # how the grammar was had, for the request's metrics
        self.cache_hit = compiled.cache_hit

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a terminated grammar has none: its
        row is left as it is)."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a speculative draft) the grammar takes in a row from its state,
        up to and including one that completes it; the state is left as it was (rolled back)."""
        taken = 0
        for token in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            taken += 1
        if taken:
            self._matcher.rollback(taken)
        return taken

    def fill_after(self, tokens: Sequence[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Rows ``first_row + 1 + j`` of ``bitmask``: the allowed next tokens after ``tokens[: j + 1]``
        (a draft ``valid_prefix`` took whole; row ``first_row``, before it, is ``fill``'s); the
        state is left as it was."""
        for j, token in enumerate(tokens):
            if not self._matcher.accept_token(token):
                self._matcher.rollback(j)
                raise ValueError("a draft token the grammar refuses (drafts are cut to valid_prefix)")
            self.fill(bitmask, first_row + 1 + j)
        if tokens:
            self._matcher.rollback(len(tokens))

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def _forced_text(self) -> str:
        """The text the grammar allows next and nothing else ('' when none)."""
        try:
            return self._matcher.find_jump_forward_string()
        except UnicodeDecodeError:
            # The output so far ends inside a multi-byte character (a token holds part of its
            # bytes): the forced bytes are no UTF-8 string. Nothing is jumped; the model decodes
            # the rest of the character under the mask, and later steps jump again.
            return ""

    def forced_tokens(self, tokenizer: Any, limit: int) -> list[int]:
        """At most ``limit`` tokens the grammar forces next, accepted already (jump-forward).

        The forced text is tokenized on its own and its last token is left to the model:
        the text that follows may merge with it into a longer token, which the model,
        not this split, should choose. Tokens the matcher refuses end the jump there.
        """
        if self._matcher.is_terminated():
            return []
        text = self._forced_text()
        if not text:
            return []
        ids = list(tokenizer.encode(text, add_special_tokens=False))[:-1][:limit]
        taken: list[int] = []
        for token in ids:
            if not self._matcher.accept_token(token):
                break
            taken.append(token)
        return taken
