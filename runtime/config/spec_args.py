"""The "speculative decoding" flags (SGLang's names): their help text and their checks, one flag
group like the other ``*_args`` modules. ``ServerArgs`` (runtime.config.server_args) holds the values;
scheduler_proc/spec does the work."""

from __future__ import annotations

import argparse
from typing import Protocol

SPECULATIVE_ALGORITHM_CHOICES = ("auto", "ngram", "none")
# launch.py's default: the device's own choice (ServingPlatform.default_speculative_algorithm: n-gram
# drafts on CPUs, none on GPUs). A ServerArgs built in Python keeps None (off) unless given one.
SPECULATIVE_ALGORITHM_CLI_DEFAULT = "auto"


class SpecFlags(Protocol):
    """The ``ServerArgs`` fields of this group, and ``page_size`` (drafts are freed slot by slot);
    a protocol, so that this module need not import ``runtime.config.server_args``."""

    speculative_algorithm: str | None
    speculative_num_draft_tokens: int
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_max_step_tokens: int | None
    speculative_ngram_capacity: int
    page_size: int


def add_spec_args(parser: argparse.ArgumentParser, defaults: SpecFlags) -> None:
    """The "speculative decoding" group; ``defaults`` is a default ``ServerArgs``."""
    g = parser.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative-algorithm",
        type=str.lower,
        default=SPECULATIVE_ALGORITHM_CLI_DEFAULT,
        choices=SPECULATIVE_ALGORITHM_CHOICES,
        help="draft tokens for each decoding request and verify them in one forward (ngram: "
        "match the request's latest tokens against its own prompt and output); the output "
        "is exactly the model's; none: off; auto: ngram on CPUs (where a verify step of a few "
        "rows costs little more than a decode step, and a loaded batch does not draft), off on "
        "GPUs, and off with --page-size above 1 (default auto)",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=defaults.speculative_num_draft_tokens,
        help=f"most tokens drafted per request and step (default {defaults.speculative_num_draft_tokens})",
    )
    g.add_argument(
        "--speculative-max-step-tokens",
        type=int,
        default=defaults.speculative_max_step_tokens,
        help="most tokens a verify step feeds the model: its requests' last tokens plus their drafts, "
        "which are cut to fit (under load a step of many requests has little room left: "
        "speculation steps aside where extra rows stop being nearly free); default: the "
        "device's (16 on CPU, no limit on GPU)",
    )
    g.add_argument(
        "--speculative-ngram-capacity",
        type=int,
        default=defaults.speculative_ngram_capacity,
        help="also draft from n-grams seen in earlier requests: a table of at most this many runs of "
        "tokens (SGLang's flag; its trie is always on) with what followed them, used when a "
        "request's own text has no match (default 0: off)",
    )
    g.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=defaults.speculative_ngram_min_match_window_size,
        help="fewest latest tokens a match must cover before its continuation is drafted "
        f"(default {defaults.speculative_ngram_min_match_window_size})",
    )
    g.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=defaults.speculative_ngram_max_match_window_size,
        help="most latest tokens compared when choosing among matches "
        f"(default {defaults.speculative_ngram_max_match_window_size})",
    )


def check_spec(args: SpecFlags) -> None:
    """ValueError naming the flag when a speculative flag is out of range or inconsistent."""
    if args.speculative_algorithm is not None and args.speculative_algorithm not in SPECULATIVE_ALGORITHM_CHOICES:
        raise ValueError(
            f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHM_CHOICES)}; "
            f"got {args.speculative_algorithm!r}"
        )
    for flag, value in (
        ("--speculative-num-draft-tokens", args.speculative_num_draft_tokens),
        ("--speculative-ngram-min-match-window-size", args.speculative_ngram_min_match_window_size),
        ("--speculative-ngram-max-match-window-size", args.speculative_ngram_max_match_window_size),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.speculative_ngram_capacity < 0:
        raise ValueError(f"--speculative-ngram-capacity must be >= 0, got {args.speculative_ngram_capacity}")
    if args.speculative_max_step_tokens is not None and args.speculative_max_step_tokens < 1:
        raise ValueError(f"--speculative-max-step-tokens must be >= 1, got {args.speculative_max_step_tokens}")
    if args.speculative_ngram_min_match_window_size > args.speculative_ngram_max_match_window_size:
        raise ValueError(
            "--speculative-ngram-min-match-window-size must not exceed --speculative-ngram-max-match-window-size"
        )
    if args.speculative_algorithm == "ngram" and args.page_size != 1:
        # Rejected drafts are freed slot by slot: a page would be left partly owned.
        raise ValueError("--speculative-algorithm needs --page-size 1")


def resolve_speculative_algorithm(args: SpecFlags, device_default: str | None) -> str | None:
    """The algorithm a server runs: the flag's, or with ``auto`` the device's default
    (``device_default``) where the other flags allow it (``--page-size 1``); None: off."""
    chosen = args.speculative_algorithm
    if chosen == "auto":
        chosen = device_default if args.page_size == 1 else None
    return None if chosen in (None, "none") else chosen


def speculative_reason(args: SpecFlags, device_default: str | None) -> str:
    """Why ``resolve_speculative_algorithm`` is what it is, for the start-up log."""
    if args.speculative_algorithm != "auto":
        return "--speculative-algorithm"
    if args.page_size != 1:
        return "auto: off with --page-size above 1 (rejected drafts are freed slot by slot)"
    if device_default is None:
        return "auto: off on this device"
    return "auto: this device drafts by default (few-row verify steps cost little more than a decode step)"
