"""SGLang's LoRA adapter routes: POST /load_lora_adapter and /unload_lora_adapter.

Each is one control round trip to the scheduler (tokenizer_proc/control.py), which decides
(scheduler_proc/lora_control.py): a load reads and prepares the PEFT folder on every rank; an unload
refuses new requests on the adapter at once and answers once the requests already running on it have
finished. SGLang's reply (``success``, ``message``) plus the adapters loaded afterwards; 400 when refused.
"""

from __future__ import annotations

from typing import ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.protocol.messages import ErrorReply, LoraAdapterReq, LoraControl
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, HttpContext, api_router
from tokenizer_proc.http.errors import RequestFailed

router = api_router()


class LoadLoraBody(oai.LenientBody):
    """SGLang's ``LoadLoRAAdapterReqInput``."""

    body_name: ClassVar[str] = "/load_lora_adapter"
    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoraBody(oai.LenientBody):
    """SGLang's ``UnLoadLoRAAdapterReqInput``."""

    body_name: ClassVar[str] = "/unload_lora_adapter"
    lora_name: str


async def _adapter_call(http: HttpContext, request: Request, req: LoraAdapterReq) -> JSONResponse:
    http.authorize(request)
    reply = await http.ready_door().local_control(req)
    if isinstance(reply, ErrorReply):
        raise RequestFailed(reply.code, reply.message)
    payload = reply.payload
    body = {key: payload.get(key) for key in ("success", "message", "loaded_adapters")}
    if payload.get("evicted"):
        body["evicted"] = payload["evicted"]
    return JSONResponse(body, status_code=200 if payload.get("success") else 400)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, http: Http) -> JSONResponse:
    body: LoadLoraBody = await read_body(request, LoadLoraBody, http.max_request_bytes)
    control = LoraControl(body.lora_name, body.lora_path, body.pinned)
    return await _adapter_call(http, request, LoraAdapterReq(rid="load_lora_adapter", load=True, adapter=control))


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, http: Http) -> JSONResponse:
    body: UnloadLoraBody = await read_body(request, UnloadLoraBody, http.max_request_bytes)
    control = LoraControl(body.lora_name)
    return await _adapter_call(http, request, LoraAdapterReq(rid="unload_lora_adapter", load=False, adapter=control))
