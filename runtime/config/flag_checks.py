"""The two checks every flag group shares, in one place so that each group's module says *what*
it checks and every group words the same failure the same way (tests match these messages)."""

from __future__ import annotations

from typing import Sequence


def choice(flag: str, value: str, choices: Sequence[str]) -> None:
    """ValueError naming ``flag`` unless ``value`` is one of ``choices``: argparse checks the
    command line, this checks a ``ServerArgs`` built in code (tests, launch_server)."""
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")


def positive(flag: str, value: int) -> None:
    """ValueError naming ``flag`` unless the count ``value`` is at least 1."""
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
