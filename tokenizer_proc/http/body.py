"""Reading an HTTP request's body: bounded by --max-request-bytes before it is read whole (a huge
body must not be buffered only to be refused), then validated against its pydantic model with a
validation error worded as an OpenAI ``param``. Every route that takes a body reads it here."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tokenizer_proc import openai_protocol as oai


async def read_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    """The body, validated; one over ``limit`` bytes is refused before it is read whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise oai.BadRequest(
            f"the request body has {declared} bytes; the most this server reads is {limit} (--max-request-bytes)",
            status=413,
            code="too_long",
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise oai.BadRequest(
                f"the request body is longer than {limit} bytes (--max-request-bytes)", status=413, code="too_long"
            )
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = loc_path(err.get("loc", ()))
        raise oai.BadRequest(f"{param or 'body'}: {err.get('msg')}", param or None) from None


def loc_path(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union-branch labels are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in ("str", "int", "float", "bool", "list"):
            out += ("." if out else "") + part
        else:
            break
    return out
