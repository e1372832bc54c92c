"""The one way every process loads the server's tokenizer.

The tokenizer process (prompts, chat rendering), the detokenizer (text deltas) and the
scheduler (stop strings) must agree token for token, so they all load it here, from the
same path (``ServerArgs.resolved_tokenizer_path()``). This module imports nothing from
the process packages, so each of them can import it without a cycle.
"""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str, chat_template: str | None = None) -> Any:
    """The HF tokenizer at ``path``; ``chat_template`` (a Jinja file, ``--chat-template``)
    replaces its own template (only the tokenizer process renders chats)."""
    from transformers import AutoTokenizer  # lazy: a slow import the clients never need

    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        with open(chat_template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    return tokenizer
