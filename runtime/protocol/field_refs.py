"""A refusal's message with the request fields it names kept as references, so that each front door
words it in the names its client sent (``max_tokens`` on the OpenAI API where the server's field is
``max_new_tokens``; ``sampling_params.top_p`` on the ZMQ protocol, ``top_p`` in SGLang's body).

Why references and not text: the field names are known where the refusal is raised and where the
request was parsed, and nowhere in between; a message of plain text would have to be searched for
the server's names afterwards. ``Message`` is a tuple of text and ``FieldRef`` parts; ``render`` joins
it with a naming (``server_name``: the server's own, what ``str()`` of the error shows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True)
class FieldRef:
    """A request field named in a message, by its server name; ``sampling``: a sampling parameter
    named as the subject of the message (the server words it ``sampling_params.<name>``)."""

    name: str
    sampling: bool = False


Message = tuple[Union[str, FieldRef], ...]
# How a front door names a field its client sent (the request's parser knows).
FieldNames = Callable[[FieldRef], str]


def server_name(ref: FieldRef) -> str:
    """The server's own naming (the ZMQ protocol's): ``sampling_params.<name>`` for a sampling parameter."""
    return f"sampling_params.{ref.name}" if ref.sampling else ref.name


def bare_name(ref: FieldRef) -> str:
    """Every field by its own name (SGLang's ``/generate`` body, where the parameters are named as sent)."""
    return ref.name


def render(message: Message, names: FieldNames = server_name) -> str:
    return "".join(part if isinstance(part, str) else names(part) for part in message)


def as_message(message: str | Message) -> Message:
    return (message,) if isinstance(message, str) else message
