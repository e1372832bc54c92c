"""The fenced code blocks of the user docs (README.md, docs/serving.md) and how each is run.

tests/e2e/test_docs_examples.py runs every block against the real default model, so a stale
example fails the suite. What a block needs is said by an HTML comment on the line right before
its opening fence (GitHub does not render it):

* no comment: a ``bash`` or ``python`` block runs against the examples' server (the README's
  serve command, started once) and must exit 0. Python blocks run with the suite's interpreter
  (the project's venv) in an empty folder, so each must import and connect on its own; bash
  blocks run in the repository root with the venv first on ``PATH``;
* ``<!-- doc-test: expect="Paris" expect="4" -->``: the block's output must contain each word
  (case-insensitive), and so must the answer the doc shows for it (its ``#`` comments, or the
  ``text`` block after it). Words, not whole answers: AVX-512 hosts serve bf16 and AVX2 hosts
  fp32, whose greedy texts may differ;
* ``needs="--enable-metrics"``: a flag of the examples' server the block relies on (the docs
  say so in prose);
* ``<!-- doc-test: serves -->``: every command line starts a server in the foreground. Each is
  started with free ports and the test's flags, waited for until its ``ready:`` line, and
  stopped with Ctrl-C (SIGINT to its process group), which must end every process it started.
  The first such block (the README's ``make serve``) is the examples' server; it is stopped
  last;
* ``<!-- doc-test: on-served -->``: the block runs against the server that the last serves block of
  its section starts (an embedding model's, say), started once for all such blocks, instead of the
  examples' server; its default addresses are rewritten to that server's ports;
* ``<!-- doc-test: skip (why) -->``: not run (multi-node launches, GPU-only, ``make test``
  itself); the reason is required and is listed in the test report.

A ``text`` block is not run: it is the output of the last runnable block before it in the same
section, or, with no such block, must be skipped with a reason. Any other language is refused.
``127.0.0.1:30000`` and ``127.0.0.1:30001`` (the default ZMQ and HTTP addresses) are rewritten
to the ports the test's servers actually use, in code, shown output and ``expect`` alike.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

RUNNABLE = ("bash", "python")
LANGUAGES = (*RUNNABLE, "text")
DEFAULT_ZMQ_PORT = 30000
DEFAULT_HTTP_PORT = 30001

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,})(?P<lang>[^`\s]*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*doc-test:(?P<body>.*?)-->\s*$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>.*)\)$")
_HEADING = re.compile(r"^#{1,6}\s")
_ADDRESS = re.compile(r"(?<=127\.0\.0\.1:)(3000[01])\b")


class DocFormatError(ValueError):
    """A block or directive that breaks the convention (the message names file and line)."""


@dataclass(frozen=True)
class Directives:
    skip: str | None = None
    serves: bool = False
    expect: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    on_served: bool = False  # runs against its section's last serves block's server


@dataclass
class DocBlock:
    doc: str  # the file, relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    section: str
    directives: Directives = field(default_factory=Directives)
    output: str = ""  # the text block(s) shown as its output
    served_by: "DocBlock | None" = None  # an on-served block's: the serves block of its section before it

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE and self.directives.skip is None

    def shown_answer(self) -> str:
        """What the doc shows as this block's result: its comments and its output block."""
        comments = [m.group(1) for m in re.finditer(r"(?:^|\s)#\s?(.*)$", self.code, flags=re.M)]
        return "\n".join([*comments, self.output])


def parse_directives(body: str, where: str) -> Directives:
    body = body.strip()
    skip = _SKIP.match(body)
    if body.startswith("skip"):
        if skip is None or not skip.group("reason").strip():
            raise DocFormatError(f"{where}: a skip must say why: <!-- doc-test: skip (reason) -->")
        return Directives(skip=skip.group("reason").strip())
    serves, on_served, expect, needs = False, False, [], []
    for token in shlex.split(body):
        key, sep, value = token.partition("=")
        if token == "serves":
            serves = True
        elif token == "on-served":
            on_served = True
        elif sep and key == "expect" and value:
            expect.append(value)
        elif sep and key == "needs" and value.startswith("--"):
            needs.append(value)
        else:
            raise DocFormatError(f"{where}: unknown doc-test directive {token!r}")
    return Directives(serves=serves, expect=tuple(expect), needs=tuple(needs), on_served=on_served)


def parse_blocks(text: str, doc: str) -> list[DocBlock]:
    """Every fenced block of a markdown text, with its directives and shown output."""
    lines = text.splitlines()
    blocks: list[DocBlock] = []
    section, pending, last_runnable = "", None, None
    last_serves: DocBlock | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE.match(line)
        fence = _FENCE.match(line)
        if directive:
            pending = parse_directives(directive.group("body"), f"{doc}:{i + 1}")
            if not (i + 1 < len(lines) and _FENCE.match(lines[i + 1])):
                raise DocFormatError(f"{doc}:{i + 1}: a doc-test comment must be right before a fence")
        elif fence:
            close = fence.group("fence")
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == close), None)
            if end is None:
                raise DocFormatError(f"{doc}:{i + 1}: unclosed fence")
            lang = fence.group("lang")
            where = f"{doc}:{i + 1}"
            if lang not in LANGUAGES:
                raise DocFormatError(f"{where}: a block's language must be one of {LANGUAGES}, not {lang!r}")
            block = DocBlock(doc, i + 1, lang, "\n".join(lines[i + 1 : end]) + "\n", section, pending or Directives())
            pending = None
            _check(block, last_runnable, where)
            if block.directives.on_served:
                if last_serves is None:
                    raise DocFormatError(f"{where}: an on-served block follows no serves block in its section")
                block.served_by = last_serves
            if block.directives.serves:
                last_serves = block
            if lang == "text" and block.directives.skip is None:
                assert last_runnable is not None
                last_runnable.output += block.code
            elif block.runnable:
                last_runnable = block
            blocks.append(block)
            i = end
        elif _HEADING.match(line):
            section, last_runnable, last_serves = line.lstrip("#").strip(), None, None
        i += 1
    return blocks


def _check(block: DocBlock, last_runnable: DocBlock | None, where: str) -> None:
    d = block.directives
    if block.lang == "text" and d.skip is None:
        if last_runnable is None:
            raise DocFormatError(
                f"{where}: a text block follows no runnable block in its section: skip it with a reason"
            )
        if d != Directives():
            raise DocFormatError(f"{where}: put the directives on the code block, not on its output")
    if d.serves and block.lang != "bash":
        raise DocFormatError(f"{where}: a serves block is a bash block")


def doc_blocks(root: Path, docs: tuple[str, ...]) -> list[DocBlock]:
    return [b for doc in docs for b in parse_blocks((root / doc).read_text(), doc)]


def with_ports(text: str, zmq_port: int, http_port: int) -> str:
    """``text`` with the default addresses 127.0.0.1:30000 / :30001 moved to the given ports."""
    ports = {str(DEFAULT_ZMQ_PORT): str(zmq_port), str(DEFAULT_HTTP_PORT): str(http_port)}
    return _ADDRESS.sub(lambda m: ports[m.group(1)], text)


def server_commands(code: str) -> list[str]:
    """The command lines of a serves block (comments and blank lines dropped)."""
    commands = []
    for line in code.splitlines():
        command = re.sub(r"(^|\s+)#.*$", "", line).strip()
        if command:
            commands.append(command)
    return commands


def with_server_flags(command: str, flags: list[str], python: str) -> str:
    """A serves block's command with the test's flags added: ``make serve`` gets them in
    ``SERVE_ARGS`` (and runs this interpreter, with make's install step left to the suite's own
    set-up: ``-o`` marks the venv's stamp as made); ``tinyserve`` / ``python launch.py`` get them
    appended (argparse: the last value of a flag wins)."""
    words = shlex.split(command)
    if words[:2] == ["make", "serve"]:
        if any(w.startswith("SERVE_ARGS=") for w in words):
            raise DocFormatError(f"{command!r}: the test sets SERVE_ARGS itself")
        extra = ["-o", ".venv/.installed", "serve", f"PY={python}", "SERVE_ARGS=" + shlex.join(flags)]
        return shlex.join(["make", *extra, *words[2:]])
    return command + " " + shlex.join(flags)
