"""Requests of a model whose RoPE changes with the sequence's length (Phi-3 LongRoPE), and the one
seam (``RopeSwitch``) through which the scheduler meets that rule.

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
  from the retraction that recomputes it when its decoding outgrows it (``must_recompute``: the
  scheduler retracts it, its short KV becoming cache, and it re-prefills prompt + outputs long). Every
  extend row of a long request reads the long rows (``extend_flags``: ``ForwardBatch.long_rope``);
  decode and verify rows go by position, which past the switch only long requests reach.
- The prefix cache never mixes the two: a long request matches and inserts under its own namespace
  (``extra_key`` + ``LONG_NAMESPACE``), so it reuses only long-rotated KV (another long request's:
  a token's long-rotated KV depends only on the tokens before it) and short requests never see it.
- Speculative drafts of a short request stop at the switch (``draft_room``): the step past it is the
  recomputation's.

The seam: the scheduler holds one ``RopeSwitch`` (``create_rope_switch``) and asks it at four points
of a request's life: when it holds no prefix-cache claim (arrival, retraction: ``settle``), before
planning a batch that decodes the running requests (``must_recompute``), when drafts are budgeted
(``draft_room``) and when an extend batch is laid out (``extend_flags``). No other scheduler module
knows the rule. A model without a switch gets ``OneRope``, whose answers cost nothing per step.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from scheduler_proc.req import Req

# Appended to a long request's prefix namespace (NUL: no client-given key ends so).
LONG_NAMESPACE = "\x00long-rope"


class RopeSwitch(Protocol):
    """What the scheduler asks about how the model's RoPE depends on a request's length."""

    def settle(self, req: Req) -> None:
        """Fix the rotation of ``req``'s KV from now on; called only while it holds no prefix-cache
        claim (at arrival, or just after a retraction gave its row back), since its namespace may change."""
        ...

    def must_recompute(self, running: Sequence[Req]) -> list[Req]:
        """Running requests that must be recomputed (retracted, then re-prefilled) rather than decoded."""
        ...

    def draft_room(self, req: Req) -> int | None:
        """Most drafts a verify step may give ``req`` (None: no bound from the rotation)."""
        ...

    def extend_flags(self, reqs: Sequence[Req]) -> list[bool] | None:
        """Each extend row's rotation for ``ForwardBatch.long_rope`` (None: the model needs none)."""
        ...


class OneRope:
    """A model whose RoPE is one set at every length: nothing to settle, recompute or bound."""

    def settle(self, req: Req) -> None:
        pass

    def must_recompute(self, running: Sequence[Req]) -> list[Req]:
        return []

    def draft_room(self, req: Req) -> int | None:
        return None

    def extend_flags(self, reqs: Sequence[Req]) -> list[bool] | None:
        return None


class LongRopeSwitch:
    """The switch length of the model's RoPE and the request-side rules around it (module docstring)."""

    def __init__(self, switch_len: int) -> None:
        self.switch_len = switch_len

    def settle(self, req: Req) -> None:
        """Make ``req`` long if it is past the switch (once: a long request stays long)."""
        if not req.long_rope and req.scheduled_len > self.switch_len:
            req.long_rope = True
            req.extra_key = (req.extra_key or "") + LONG_NAMESPACE

    def must_recompute(self, running: Sequence[Req]) -> list[Req]:
        """Short running requests whose next forward would take them past the switch."""
        return [r for r in running if not r.long_rope and r.scheduled_len > self.switch_len]

    def draft_room(self, req: Req) -> int | None:
        """Drafts that keep a short request within the switch (its KV short); a long one is unbounded."""
        return None if req.long_rope else self.switch_len - req.scheduled_len

    def extend_flags(self, reqs: Sequence[Req]) -> list[bool] | None:
        """Whether each row's request is long: a chunk of a long prompt ending below the switch still
        reads the long rows (the model alone would go by the chunk's own length)."""
        return [r.long_rope for r in reqs]


def create_rope_switch(switch_len: int | None) -> RopeSwitch:
    """The model's switch (``ModelConfig.rope_switch_len``; None: one RoPE at every length)."""
    return OneRope() if switch_len is None else LongRopeSwitch(switch_len)
