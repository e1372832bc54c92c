"""Speculative decoding's counters (in the scheduler's stats, summed over DP replicas) and the
figures derived from them: shared by the scheduler (log, server_info), the DP controller (its
merged server_info) and the tokenizer's /metrics."""

from __future__ import annotations

# Verify steps; request-steps of decoding (with or without drafts) and the tokens they emitted;
# drafts proposed and accepted.
SPEC_STATS = (
    "spec_verify_batches",
    "spec_decode_req_steps",
    "spec_decode_tokens",
    "spec_draft_tokens",
    "spec_accepted_drafts",
)


def spec_summary(stats: dict[str, int]) -> dict[str, float]:
    """Mean tokens emitted per request per decode step (1.0 when no draft is ever accepted) and the
    share of drafted tokens accepted: the decode log's, server_info's and /metrics' figures; empty
    without speculation."""
    if "spec_decode_req_steps" not in stats:
        return {}
    steps = stats["spec_decode_req_steps"]
    drafted = stats["spec_draft_tokens"]
    return {
        "spec_accept_length": stats["spec_decode_tokens"] / steps if steps else 0.0,
        "spec_accept_rate": stats["spec_accepted_drafts"] / drafted if drafted else 0.0,
    }
