"""The "logging and monitoring" flags: what the processes log, the Prometheus metrics, and the
scheduler watchdog that turns a hung step into stack dumps and a restartable exit."""

from __future__ import annotations

import argparse
from typing import Protocol

from runtime.config.flag_checks import choice

LOG_LEVEL_CHOICES = ("debug", "info", "warning", "error", "critical")


class LoggingFlags(Protocol):
    """The ``ServerArgs`` fields of this group (a protocol, so that this module need not import
    ``runtime.config.server_args``, which imports it)."""

    enable_metrics: bool
    log_requests: bool
    decode_log_interval: int
    watchdog_timeout: float
    log_level: str


def add_logging_args(parser: argparse.ArgumentParser, defaults: LoggingFlags) -> None:
    """The "logging and monitoring" group; ``defaults`` is a default ``ServerArgs``."""
    d = defaults
    g = parser.add_argument_group("logging and monitoring")
    g.add_argument(
        "--enable-metrics",
        action="store_true",
        default=d.enable_metrics,
        help="serve Prometheus metrics on the HTTP server's /metrics",
    )
    g.add_argument(
        "--log-requests",
        action="store_true",
        default=d.log_requests,
        help="log one info line per request when it arrives and when it finishes "
        "(rid, lengths, finish reason, latency)",
    )
    g.add_argument(
        "--decode-log-interval",
        type=int,
        default=d.decode_log_interval,
        help=f"log the scheduler's decode figures every N decode steps (default {d.decode_log_interval})",
    )
    g.add_argument(
        "--watchdog-timeout",
        type=float,
        default=d.watchdog_timeout,
        help="seconds one scheduler step may run; a longer one logs the stack of every thread "
        "of that scheduler process, which then exits non-zero, so the server stops "
        "(clients get server_shutdown) and exits 1 for a supervisor to restart it "
        f"(default {d.watchdog_timeout:g})",
    )
    g.add_argument(
        "--log-level",
        type=str.lower,
        default=d.log_level,
        choices=LOG_LEVEL_CHOICES,
        help=f"logging level of every process (default {d.log_level})",
    )


def check_log_level(args: LoggingFlags) -> None:
    """Case-insensitive, as on the command line (argparse lowers it there)."""
    choice("--log-level", args.log_level.lower(), LOG_LEVEL_CHOICES)


def check_watchdog_timeout(args: LoggingFlags) -> None:
    """A watchdog of 0 or NaN seconds would kill every step or none."""
    if not args.watchdog_timeout > 0:  # (also rejects NaN)
        raise ValueError(f"--watchdog-timeout must be > 0 (seconds), got {args.watchdog_timeout}")
