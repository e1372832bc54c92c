"""``Rejected``: how the front door refuses a request, in a module of its own so that every piece of
request building (tokenizer_proc/request_builder.py, tokenizer_proc/embedding_build.py) and every
front door raises and catches the same exception without importing each other."""

from __future__ import annotations

from runtime.protocol.field_refs import Message, as_message, render


class Rejected(Exception):
    """A request the server refuses; ``code`` goes to the client in an ErrorReply, and
    ``param`` names the offending field where there is one (HTTP reports it). ``parts`` keeps the
    fields the message names as references (``runtime.protocol.field_refs``): the ZMQ reply words
    them in the server's names (``message``), an HTTP front door in the names its body sent."""

    def __init__(self, code: str, message: str | Message, param: str | None = None) -> None:
        self.parts = as_message(message)
        self.message = render(self.parts)
        super().__init__(self.message)
        self.code = code
        self.param = param
