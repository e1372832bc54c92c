"""Priority preemption (``--priority-preemption``): which running requests give way to a waiting one.

With ``--enable-priority-scheduling`` the waiting queue is ordered by priority (larger first,
``scheduler_proc.policy``), and admission stops at the first request that does not fit, so a
lower priority never overtakes a higher one in the queue. That alone leaves a high-priority
arrival waiting behind running low-priority requests until they finish. With preemption,
when admission admitted nothing because its first request (or the next chunk of a half-prefilled
prompt) lacked KV memory or a request slot (``PrefillPlan.blocked``), running requests of *strictly* lower priority are retracted through
the scheduler's normal retraction path: their KV becomes evictable cache and they wait at the
front of their priority in the queue, to resume (from whatever of it is still cached) with
exactly the output an unpressured run gives.

Who gives way: the lowest priority first, among equals the most recently started (it has the
least progress to lose), until the freed room covers the shortfall; nobody if all the eligible
ones together would not cover it. The room a victim frees is estimated from above (its decode
reservation plus every token of KV it holds, which may be shared with others): an overestimate
only means that the next round finds the arrival still blocked and takes another strictly lower
victim. No thrashing: a victim has a lower priority than the request it made room for, so it can
neither preempt that one back nor be admitted before it (admission stops at the blocked one).

This module only decides. The scheduler retracts on the exact host state: when a step is in
flight (overlap) it marks the decision ``pending``, completes that step before the next plan
(``model_worker.can_plan_ahead``) and decides again then.
"""

from __future__ import annotations

from typing import Sequence

from scheduler_proc.prefill_adder import PrefillPlan, reserved_decode_tokens
from scheduler_proc.req import Req


class PriorityPreemption:
    """Priority-preemption decisions of one scheduler; owns only the ``pending`` mark."""

    def __init__(self) -> None:
        # A plan was blocked while a step was in flight: complete it before planning again.
        self.pending = False

    def victims(self, plan: PrefillPlan, running: Sequence[Req], new_token_ratio: float) -> list[Req]:
        """The running requests to retract so that ``plan.blocked`` fits; [] when none should."""
        blocked = plan.blocked
        if blocked is None or plan.items:
            return []
        eligible = [(r.priority, -i, r) for i, r in enumerate(running) if r.priority < blocked.priority]
        if not eligible:
            return []
        eligible.sort(key=lambda e: (e[0], e[1]))  # lowest priority, then the latest started, first
        chosen: list[Req] = []
        freed = 0
        for _, _, req in eligible:
            chosen.append(req)
            freed += reserved_decode_tokens(req, new_token_ratio) + req.kv_committed_len
            if freed >= plan.blocked_shortfall:
                return chosen  # (a slot shortfall is 0: one victim frees one request slot)
        return []
