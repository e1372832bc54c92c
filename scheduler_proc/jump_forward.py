"""Jump-forward decoding of constrained requests: text a request's grammar forces (a JSON key,
``": "``, closing brackets) is appended at once instead of decoded token by token.

The request then gives its row back as a retraction does, keeping its KV in the prefix cache,
and its next prefill computes the forced tokens and samples the token after them (the
scheduler carries that out: it owns the queues and the cache). Not for requests that return
logprobs: forced tokens have none.
"""

from __future__ import annotations

from typing import Any

from scheduler_proc.output import OutputProcessor
from scheduler_proc.req import Req


def jump_forward(reqs: list[Req], tokenizer: Any, context_len: int, output: OutputProcessor) -> list[Req]:
    """Append each request's forced tokens (checking for a stop after each); the requests that got
    some, finished or not."""
    jumped = []
    for req in reqs:
        if req.return_logprob or req.token_ids_logprob or req.finish_reason is not None or req.num_inflight:
            continue
        room = min(req.remaining_new_tokens(), context_len - 1 - req.seqlen)
        forced = req.grammar.forced_tokens(tokenizer, room) if room > 0 else []  # type: ignore[union-attr]
        if not forced:
            continue
        output.stats["jump_forward_tokens"] += len(forced)
        output.append_forced(req, forced)
        req.jumped = True
        jumped.append(req)
    return jumped
