"""The operational routes: health (/health, /health_generate), server and model info, cache flush, the
graceful drain and Prometheus metrics. None of them generates for a client: they are what a load
balancer, a supervisor or an operator calls, and most are one control round trip to the scheduler
(tokenizer_proc/control.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from runtime.protocol.messages import ErrorReply, FlushCacheReq, GenerateReq, HealthReq, ServerInfoReq
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.context import Http, HttpContext
from tokenizer_proc.http.errors import RequestFailed, error_response
from tokenizer_proc.http.run import abort_on_disconnect

router = APIRouter()


async def _control(http: HttpContext, request: Request, req: Any) -> dict[str, Any]:
    """One authorized control round trip; its payload, or RequestFailed."""
    http.authorize(request)
    reply = await http.ready_door().local_control(req)
    if isinstance(reply, ErrorReply):
        raise RequestFailed(reply.code, reply.message)
    payload: dict[str, Any] = reply.payload
    return payload


@router.get("/health")
async def health(http: Http) -> Response:
    """200 while the scheduler answers; 503 while starting, draining or unhealthy."""
    door = http.ready_door()
    if door.draining:
        return error_response(503, "the server is draining", "draining")
    reply = await door.local_control(HealthReq(rid="health"))
    if isinstance(reply, ErrorReply):
        return error_response(503, reply.message, reply.code)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request, http: Http) -> Response:
    """200 once a one-token generation went through the whole pipeline."""
    http.authorize(request)
    run = await http.start(
        [GenerateReq(rid="health_generate", input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})]
    )
    try:
        async with abort_on_disconnect(request, run):
            async for _ in run.events():
                pass
    except RequestFailed as exc:
        return error_response(503, exc.message, exc.code)
    finally:
        run.close()
    return Response(status_code=200)


@router.get("/get_server_info")
async def server_info(request: Request, http: Http) -> JSONResponse:
    return JSONResponse(await _control(http, request, ServerInfoReq(rid="server_info")))


@router.get("/get_model_info")
async def model_info(request: Request, http: Http) -> JSONResponse:
    """SGLang's model info, with the sampling defaults in force (--sampling-defaults): answered by the
    front door alone, as nothing of it is the scheduler's."""
    http.authorize(request)
    return JSONResponse({**http.ready_door().model_info(), "served_model_name": http.model_name})


@router.post("/flush_cache")
async def flush_cache(request: Request, http: Http) -> JSONResponse:
    payload = await _control(http, request, FlushCacheReq(rid="flush_cache"))
    return JSONResponse(payload, status_code=200 if payload.get("success") else 400)


@router.post("/drain")
async def drain(request: Request, http: Http) -> JSONResponse:
    """Start the graceful drain (as the launcher's SIGTERM does): new requests are refused,
    those in flight finish (up to --graceful-shutdown-timeout), then the server exits 0."""
    http.authorize(request)
    started = http.ready_door().start_drain("POST /drain")
    return JSONResponse(
        {
            "draining": True,
            "started_now": started,
            "graceful_shutdown_timeout": http.server_args.graceful_shutdown_timeout,
        }
    )


@router.get("/metrics")
async def metrics(request: Request, http: Http) -> Response:
    """Prometheus text (--enable-metrics), the scheduler's gauges refreshed first."""
    door_metrics = http.ready_door().metrics
    if door_metrics is None:
        raise oai.BadRequest("metrics are off; start the server with --enable-metrics", status=404, code="not_found")
    from prometheus_client import CONTENT_TYPE_LATEST

    door_metrics.set_scheduler_gauges(await _control(http, request, ServerInfoReq(rid="metrics")))
    return Response(door_metrics.render(), media_type=CONTENT_TYPE_LATEST)
