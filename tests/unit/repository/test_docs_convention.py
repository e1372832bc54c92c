"""The user docs keep the convention tests/e2e/test_docs_examples.py runs them by (no server
needed: these fail in seconds), and docs/serving.md's table of contents matches its sections."""

from __future__ import annotations

import re

import pytest

from tests.support import REPO_ROOT
from tests.support.doc_blocks import (
    DocFormatError,
    doc_blocks,
    parse_blocks,
    server_commands,
    with_ports,
    with_server_flags,
)

DOCS = ("README.md", "docs/serving.md")


def test_every_block_of_the_user_docs_is_run_or_skipped_with_a_reason() -> None:
    blocks = doc_blocks(REPO_ROOT, DOCS)  # raises DocFormatError naming file:line
    code = [b for b in blocks if b.lang != "text"]
    skipped = [b for b in code if b.directives.skip is not None]
    assert len(code) >= 10 and len(skipped) <= 3, [f"{b.id}: {b.directives.skip}" for b in skipped]
    readme_servers = [b for b in blocks if b.doc == "README.md" and b.directives.serves]
    assert readme_servers and len(server_commands(readme_servers[0].code)) == 1  # the examples' one server
    assert server_commands(readme_servers[0].code)[0].startswith("make serve")


def test_every_expected_word_is_in_the_answer_the_doc_shows() -> None:
    for block in doc_blocks(REPO_ROOT, DOCS):
        shown = block.shown_answer().lower()
        missing = [w for w in block.directives.expect if w.lower() not in shown]
        assert missing == [], f"{block.id}: the doc shows no {missing}"


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_serving_doc_contents_list_every_section() -> None:
    text = (REPO_ROOT / "docs" / "serving.md").read_text()
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    contents = re.findall(r"^\* \[(.+)\]\(#([\w-]+)\)$", text, flags=re.M)
    assert [title for title, _ in contents] == sections
    assert [anchor for _, anchor in contents] == [github_anchor(s) for s in sections]


SAMPLE = """# Doc

## One

<!-- doc-test: expect="Paris" -->
```bash
curl -s 127.0.0.1:30001/x   # Paris
```

```text
more output
```

## Two

<!-- doc-test: skip (needs two machines) -->
```bash
tinyserve --nnodes 2
```
"""


def test_the_parser_reads_directives_outputs_and_sections() -> None:
    run, skipped = parse_blocks(SAMPLE, "doc.md")[0], parse_blocks(SAMPLE, "doc.md")[2]
    assert (run.lang, run.line, run.section, run.directives.expect) == ("bash", 6, "One", ("Paris",))
    assert run.output == "more output\n" and "Paris" in run.shown_answer()
    assert skipped.directives.skip == "needs two machines" and not skipped.runnable
    assert with_ports(run.code, 4000, 4001) == "curl -s 127.0.0.1:4001/x   # Paris\n"


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- doc-test: skip -->\n```bash\nx\n```\n", "must say why"),
        ("<!-- doc-test: skip () -->\n```bash\nx\n```\n", "must say why"),
        ("<!-- doc-test: expects=x -->\n```bash\nx\n```\n", "unknown"),
        ("```sh\nx\n```\n", "language"),
        ("```\nx\n```\n", "language"),
        ("```text\nlonely output\n```\n", "follows no runnable block"),
        ("```bash\nx\n```\n## Next\n```text\ny\n```\n", "follows no runnable block"),
        ("<!-- doc-test: serves -->\n```python\nx\n```\n", "bash"),
        ("<!-- doc-test: expect=x -->\n\nprose\n```bash\nx\n```\n", "right before a fence"),
        (
            "<!-- doc-test: serves -->\n```bash\nx\n```\n## B\n<!-- doc-test: on-served -->\n```bash\ny\n```\n",
            "no serves",
        ),
    ],
)
def test_the_parser_refuses_what_breaks_the_convention(text: str, message: str) -> None:
    with pytest.raises(DocFormatError, match=message):
        parse_blocks(text, "doc.md")


def test_an_on_served_block_runs_against_the_last_serves_block_of_its_section() -> None:
    text = (
        "## Embeddings\n<!-- doc-test: serves -->\n```bash\ntinyserve --a\n```\n"
        "<!-- doc-test: serves -->\n```bash\ntinyserve --b\n```\n"
        "<!-- doc-test: on-served expect=ok -->\n```bash\ncurl x\n```\n```bash\ncurl y\n```\n"
    )
    first, second, on_served, plain = parse_blocks(text, "doc.md")
    assert on_served.directives.on_served and on_served.served_by is second
    assert plain.served_by is None and not plain.directives.on_served


def test_server_commands_get_the_tests_flags() -> None:
    assert server_commands("make serve   # comment\n\n# only a comment\ntinyserve --port 1\n") == [
        "make serve",
        "tinyserve --port 1",
    ]
    assert with_server_flags("make serve", ["--port", "5", "--device", "cpu"], "/venv/bin/python") == (
        "make -o .venv/.installed serve PY=/venv/bin/python 'SERVE_ARGS=--port 5 --device cpu'"
    )
    assert with_server_flags("tinyserve --model-path x", ["--port", "5"], "py") == "tinyserve --model-path x --port 5"
