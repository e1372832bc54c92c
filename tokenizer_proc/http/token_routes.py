"""POST /tokenize and /detokenize, in the bodies SGLang's and vLLM's servers take: what a client calls to
count a prompt against the context before it sends it, or to read token ids back as text. A prompt is
tokenized exactly as a generate request would be (``FrontDoor.tokenize``: the same tokenizer, and for
``messages`` the same chat template with the same tools), so the count is the prompt's real length."""

from __future__ import annotations

import uuid
from typing import Any, cast

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.protocol.messages import DetokenizeReq, TokenizeReq
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, api_router

router = api_router()


class TokenizeBody(oai.LenientBody):
    """SGLang's (``prompt``: a text or a list of texts) or vLLM's chat form (``messages``, ``tools``,
    ``add_generation_prompt``, ``chat_template_kwargs``). ``add_special_tokens`` defaults to on for a
    text and off for a chat (its template writes them), as both servers do."""

    body_name = "tokenize"
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[oai.ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # vLLM's: each token as text too (``token_strs``)

    def requests(self) -> list[TokenizeReq]:
        """One TokenizeReq per prompt (a list of texts is a batch)."""
        if (self.prompt is None) == (self.messages is None):
            raise oai.BadRequest("give exactly one of prompt, messages", "prompt")
        if self.messages is not None:
            kwargs = {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt}
            messages = [m.as_dict(i) for i, m in enumerate(self.messages)]
            return [
                TokenizeReq(
                    rid=uuid.uuid4().hex,
                    messages=messages,
                    tools=self.tools,
                    chat_template_kwargs=kwargs,
                    add_special_tokens=self.add_special_tokens,
                )
            ]
        texts = [self.prompt] if isinstance(self.prompt, str) else list(self.prompt or [])
        if not texts:
            raise oai.BadRequest("prompt: empty list", "prompt")
        return [TokenizeReq(rid=uuid.uuid4().hex, text=t, add_special_tokens=self.add_special_tokens) for t in texts]


class DetokenizeBody(oai.LenientBody):
    """``tokens``: the ids of one text, or a list of them (SGLang's batch form)."""

    body_name = "detokenize"
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


@router.post("/tokenize")
async def tokenize(request: Request, http: Http) -> JSONResponse:
    """``tokens``, ``count`` and ``max_model_len`` (a list of texts: ``tokens`` and ``count`` per text)."""
    http.authorize(request)
    body: TokenizeBody = await read_body(request, TokenizeBody, http.max_request_bytes)
    door = http.ready_door()
    answers = [await door.tokenize(req) for req in body.requests()]
    if body.return_token_strs:
        for answer in answers:
            answer["token_strs"] = door.tokenizer.convert_ids_to_tokens(answer["tokens"])
    if isinstance(body.prompt, list):
        return JSONResponse(
            {
                "tokens": [a["tokens"] for a in answers],
                "count": [a["count"] for a in answers],
                "max_model_len": door.context_len,
                **({"token_strs": [a["token_strs"] for a in answers]} if body.return_token_strs else {}),
            }
        )
    return JSONResponse(answers[0])


@router.post("/detokenize")
async def detokenize(request: Request, http: Http) -> JSONResponse:
    """The text as ``text`` (SGLang's name) and ``prompt`` (vLLM's), so that either server's client reads it."""
    http.authorize(request)
    body: DetokenizeBody = await read_body(request, DetokenizeBody, http.max_request_bytes)
    door = http.ready_door()
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    ids = cast("list[list[int]]", body.tokens if batch else [body.tokens])
    texts = [
        (
            await door.tokenize(
                DetokenizeReq(rid=uuid.uuid4().hex, tokens=t, skip_special_tokens=body.skip_special_tokens)
            )
        )["text"]
        for t in ids
    ]
    text: str | list[str] = texts if batch else texts[0]
    return JSONResponse({"text": text, "prompt": text})
