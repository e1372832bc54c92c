"""The output flags: the "structured outputs" group (the grammar engine that constrains
json_schema / regex / ebnf requests) and the "OpenAI chat output" group (the parsers that read
tool calls and reasoning out of a chat reply). Both shape what a request's output may be."""

from __future__ import annotations

import argparse
from typing import Protocol

from runtime.config.flag_checks import choice


class OutputFlags(Protocol):
    """The ``ServerArgs`` fields of these groups (a protocol, so that this module need not import
    ``runtime.config.server_args``, which imports it)."""

    grammar_backend: str
    grammar_compile_timeout: float
    disable_jump_forward: bool
    tool_call_parser: str | None
    reasoning_parser: str | None


def add_output_args(parser: argparse.ArgumentParser, defaults: OutputFlags) -> None:
    """The "structured outputs" and "OpenAI chat output" groups; ``defaults`` is a default ``ServerArgs``."""
    d = defaults
    g = parser.add_argument_group("structured outputs")
    g.add_argument(
        "--grammar-backend",
        type=str,
        default=d.grammar_backend,
        choices=("xgrammar", "none"),
        help="engine of json_schema / regex / ebnf constraints and response_format; none "
        f"refuses constrained requests (default {d.grammar_backend})",
    )
    g.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=d.grammar_compile_timeout,
        help="seconds a request may wait for its grammar to compile before it fails "
        f"(default {d.grammar_compile_timeout:g})",
    )
    g.add_argument(
        "--disable-jump-forward",
        action="store_true",
        default=d.disable_jump_forward,
        help="decode text a grammar forces token by token instead of appending it at once",
    )
    g = parser.add_argument_group("OpenAI chat output")
    tool_parsers, reasoning_parsers = parser_names()
    g.add_argument(
        "--tool-call-parser",
        type=str,
        default=d.tool_call_parser,
        choices=tool_parsers,
        help="the model's tool-call format: with tools and tool_choice auto, calls in the "
        "output become message.tool_calls (default: none; tool_choice required or a "
        "named function works without it)",
    )
    g.add_argument(
        "--reasoning-parser",
        type=str,
        default=d.reasoning_parser,
        choices=reasoning_parsers,
        help="the model's thinking markers: the thinking text goes to "
        "message.reasoning_content (default: none, it stays in content)",
    )


def parser_names() -> tuple[list[str], list[str]]:
    """The tool-call and reasoning parsers' names, from their registries (runtime/text/parsers):
    read there, so that a new parser is a flag value without touching this module."""
    from runtime.text.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS

    return sorted(TOOL_CALL_PARSERS), sorted(REASONING_PARSERS)


def check_parsers(args: OutputFlags) -> None:
    """--tool-call-parser and --reasoning-parser name registered parsers."""
    tool_parsers, reasoning_parsers = parser_names()
    if args.tool_call_parser is not None:
        choice("--tool-call-parser", args.tool_call_parser, tool_parsers)
    if args.reasoning_parser is not None:
        choice("--reasoning-parser", args.reasoning_parser, reasoning_parsers)


def check_grammar_compile_timeout(args: OutputFlags) -> None:
    """A timeout of 0 or NaN seconds would fail every constrained request."""
    if not args.grammar_compile_timeout > 0:
        raise ValueError(f"--grammar-compile-timeout must be > 0, got {args.grammar_compile_timeout}")
