"""Requests of a model whose RoPE changes with the sequence's length (Phi-3 LongRoPE).

Why the scheduler must know: LongRoPE rotates with its short factors while a sequence is at most
``ModelConfig.rope_switch_len`` (``original_max_position_embeddings``) tokens long and with its long
factors for every token once it is longer. transformers' ``generate`` (our oracle) keeps that true
of the whole cache: a prompt past the switch is one forward with the long factors, and the step at
which a sequence first outgrows it drops the cache and runs the whole sequence again with the long
factors (``Phi3ForCausalLM.prepare_inputs_for_generation``). Rotation is per position, so the model
alone cannot do this: a chunk of a long prompt, a decode step over cached keys or a reused prefix
only sees part of the sequence. The rule kept here instead: a request's KV is short-rotated while
its length is at most the switch, and long-rotated for all its tokens once it is longer.

- A request is *long* (``Req.long_rope``) from its arrival when its prompt is past the switch, or
  from the retraction that recomputes it when its decoding outgrows it (``crossing``: the scheduler
  retracts it, its short KV becoming cache, and it re-prefills prompt + outputs long). Every extend
  row of a long request reads the long rows (``ForwardBatch.long_rope``); decode and verify rows go
  by position, which past the switch only long requests reach.
- The prefix cache never mixes the two: a long request matches and inserts under its own namespace
  (``extra_key`` + ``LONG_NAMESPACE``), so it reuses only long-rotated KV (another long request's:
  a token's long-rotated KV depends only on the tokens before it) and short requests never see it.
- Speculative drafts of a short request stop at the switch (``draft_room``): the step past it is the
  recomputation's.

Models without such a switch build none of this (``LongRopeSwitch.create`` returns None).
"""

from __future__ import annotations

from typing import Sequence

from scheduler_proc.req import Req

# Appended to a long request's prefix namespace (NUL: no client-given key ends so).
LONG_NAMESPACE = "\x00long-rope"


class LongRopeSwitch:
    """The switch length of the model's RoPE and the request-side rules around it."""

    def __init__(self, switch_len: int) -> None:
        self.switch_len = switch_len

    @staticmethod
    def create(switch_len: int | None) -> "LongRopeSwitch | None":
        """None for a model whose RoPE is one set at every length (no per-step work then)."""
        return None if switch_len is None else LongRopeSwitch(switch_len)

    def mark_long(self, req: Req) -> None:
        """Make ``req`` long if it is past the switch; only while it holds no prefix-cache claim
        (at arrival, or just after a retraction gave its row back), since its namespace changes."""
        if not req.long_rope and req.scheduled_len > self.switch_len:
            req.long_rope = True
            req.extra_key = (req.extra_key or "") + LONG_NAMESPACE

    def crossing(self, running: Sequence[Req]) -> list[Req]:
        """Short running requests whose next forward would take them past the switch: they must be
        recomputed (retracted, then re-prefilled long) rather than decoded."""
        return [r for r in running if not r.long_rope and r.scheduled_len > self.switch_len]

    def draft_room(self, req: Req) -> int | None:
        """Most drafts a verify step may give ``req`` without taking it past the switch with short
        KV (None: no bound, it is long already)."""
        return None if req.long_rope else self.switch_len - req.scheduled_len
