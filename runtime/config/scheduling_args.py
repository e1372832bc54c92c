"""The "scheduling" flags: how many requests run and wait, how prefill is batched and chunked,
in which order waiting requests go (policy, priorities) and whether steps overlap. The scheduler
(scheduler_proc/) reads the values."""

from __future__ import annotations

import argparse
from typing import Protocol

from runtime.config.flag_checks import choice

SCHEDULE_POLICY_CHOICES = ("fcfs", "lpm", "dfs-weight", "lof", "random")

# Tri-state flags (default None = decided at start-up): the flag that sets each to False.
FALSE_FLAGS = {"disable_overlap_schedule": "--enable-overlap-schedule"}


class SchedulingFlags(Protocol):
    """The ``ServerArgs`` fields of this group, and ``page_size`` (a prefill budget is cut into
    pages); a protocol, so that this module need not import ``runtime.config.server_args``."""

    max_running_requests: int | None
    max_queued_requests: int | None
    max_prefill_tokens: int
    chunked_prefill_size: int | None
    schedule_policy: str
    enable_priority_scheduling: bool
    priority_preemption: bool
    enable_mixed_chunk: bool
    disable_overlap_schedule: bool | None
    page_size: int


def add_scheduling_args(parser: argparse.ArgumentParser, defaults: SchedulingFlags) -> None:
    """The "scheduling" group; ``defaults`` is a default ``ServerArgs``."""
    d = defaults
    g = parser.add_argument_group("scheduling")
    g.add_argument(
        "--max-running-requests",
        type=int,
        default=d.max_running_requests,
        help="maximum requests decoding at once (default: min(512, KV pool tokens)); on cpu it also sizes "
        "the default KV pool (that many requests of min(context, 512) tokens, else 64)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="most requests that may wait in each scheduler's queue (grammar queue included; "
        "each of n samples counts); one more is refused at once with overloaded (HTTP 503 "
        "with Retry-After). With --dp-size, per replica (default: unbounded)",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=d.max_prefill_tokens,
        help=f"token budget of one prefill batch (default {d.max_prefill_tokens})",
    )
    g.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=d.chunked_prefill_size,
        help=f"prefill long prompts in chunks of this many tokens; -1 or 0 disables "
        f"chunking (default {d.chunked_prefill_size})",
    )
    g.add_argument(
        "--schedule-policy",
        type=str,
        default=d.schedule_policy,
        choices=SCHEDULE_POLICY_CHOICES,
        help=f"order of waiting requests (default {d.schedule_policy})",
    )
    g.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        default=d.enable_priority_scheduling,
        help="order waiting requests by their priority (larger first), then by "
        "--schedule-policy; without it a request's priority is ignored",
    )
    g.add_argument(
        "--priority-preemption",
        action="store_true",
        default=d.priority_preemption,
        help="a waiting request that finds no KV memory or request slot retracts running "
        "requests of strictly lower priority (needs --enable-priority-scheduling)",
    )
    g.add_argument(
        "--enable-mixed-chunk",
        action="store_true",
        default=d.enable_mixed_chunk,
        help="run decode requests inside prefill batches",
    )
    g.add_argument(
        "--disable-overlap-schedule",
        dest="disable_overlap_schedule",
        action="store_const",
        const=True,
        default=d.disable_overlap_schedule,
        help="schedule each step only after the previous one's tokens are on the host "
        "(default: overlap on cuda, off on cpu)",
    )
    g.add_argument(
        "--enable-overlap-schedule",
        dest="disable_overlap_schedule",
        action="store_const",
        const=False,
        help="plan step N+1 while step N runs, also on cpu",
    )


def check_schedule_policy(args: SchedulingFlags) -> None:
    """--schedule-policy names a policy; preemption by priority means nothing without priorities."""
    choice("--schedule-policy", args.schedule_policy, SCHEDULE_POLICY_CHOICES)
    if args.priority_preemption and not args.enable_priority_scheduling:
        raise ValueError("--priority-preemption needs --enable-priority-scheduling")


def check_chunked_prefill_size(args: SchedulingFlags) -> None:
    """-1 and 0 are SGLang's ways to turn chunking off; anything else below is a mistake."""
    if args.chunked_prefill_size is not None and args.chunked_prefill_size < -1:
        raise ValueError(
            f"--chunked-prefill-size must be positive, or -1/0 to disable, got {args.chunked_prefill_size}"
        )


def check_prefill_fits_pages(args: SchedulingFlags) -> None:
    """Prefill budgets are cut into whole pages: below one page nothing could ever be admitted."""
    if args.max_prefill_tokens < args.page_size:
        raise ValueError(
            f"--max-prefill-tokens ({args.max_prefill_tokens}) must be at least --page-size ({args.page_size})"
        )
    if args.chunked_prefill_size and 0 < args.chunked_prefill_size < args.page_size:
        raise ValueError(
            f"--chunked-prefill-size ({args.chunked_prefill_size}) must be at least "
            f"--page-size ({args.page_size}), or -1/0 to disable chunking"
        )
