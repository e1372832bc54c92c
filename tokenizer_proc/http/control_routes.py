"""The operational routes: health (/health, /health_generate), server and model info, cache flush, the
graceful drain, Prometheus metrics, and SGLang's aborts (/abort_request), profiling (/start_profile,
/stop_profile) and weight updates (/update_weights_from_disk). None of them generates for a client:
they are what a load balancer, a supervisor, an operator or an RL loop calls, and most are one control
round trip to the scheduler (tokenizer_proc/control.py). SGLang's bodies are read in
tokenizer_proc/http/control_bodies.py."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.protocol.messages import (
    ErrorReply,
    FlushCacheReq,
    GenerateReq,
    HealthReq,
    ProfileReq,
    ServerInfoReq,
    UpdateWeightsReq,
)
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.control import ControlRequest
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, HttpContext, api_router
from tokenizer_proc.http.control_bodies import AbortBody, ProfileBody, UpdateWeightsBody, optional_body
from tokenizer_proc.http.errors import RequestFailed, error_response
from tokenizer_proc.request_builder import Rejected

ABORT_MESSAGE = "aborted by /abort_request"

router = api_router()


async def _control(http: HttpContext, request: Request, req: ControlRequest) -> dict[str, Any]:
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
    """200 once a one-token generation (on an embedding server: a one-token embedding) went through the
    whole pipeline."""
    http.authorize(request)
    if http.ready_door().embedding is not None:
        probe = GenerateReq(rid="health_generate", input_ids=[0], embed=True)
    else:
        probe = GenerateReq(
            rid="health_generate", input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}
        )
    run = await http.start([probe])
    try:
        await run.collect(request, lambda _, __: None)
    except RequestFailed as exc:
        return error_response(503, exc.message, exc.code)
    return Response(status_code=200)


@router.get("/get_server_info")
@router.get("/server_info")  # (SGLang's newer name; its frontend calls this one)
async def server_info(request: Request, http: Http) -> JSONResponse:
    """The server info (the ZMQ client's ``server_info()``) laid out as SGLang's: the flags and the
    model's entries at the top level, where SGLang's Model Gateway reads ``model_path``,
    ``served_model_name``, ``tp_size`` and ``dp_size`` (an object under ``model`` made it drop the
    whole reply)."""
    info = await _control(http, request, ServerInfoReq(rid="server_info"))
    rest = {key: value for key, value in info.items() if key not in ("server_args", "model")}
    flat = {**info.get("server_args", {}), **rest, **info.get("model", {}), "served_model_name": http.model_name}
    flat["max_total_num_tokens"] = flat.get("max_total_tokens")  # SGLang's name for it (its benchmarks read it)
    return JSONResponse(flat)


@router.get("/get_load")
async def get_load(request: Request, http: Http) -> JSONResponse:
    """SGLang's load report, one object per DP replica: what the Model Gateway's load-aware policies
    (power_of_two, cache_aware's balancing) read; ``num_tokens`` is the KV held by requests."""
    info = await _control(http, request, ServerInfoReq(rid="get_load"))
    replicas = info.get("replicas") or [info]
    return JSONResponse(
        [
            {
                "dp_rank": rank,
                "num_reqs": replica.get("num_running", 0) + replica.get("num_queued", 0),
                "num_waiting_reqs": replica.get("num_queued", 0),
                "num_tokens": _tokens_in_use(replica),
            }
            for rank, replica in enumerate(replicas)
        ]
    )


def _tokens_in_use(replica: dict[str, Any]) -> int:
    """KV tokens that neither are free nor could be evicted: held by requests."""
    total, free, evictable = (
        replica.get(key, 0) for key in ("max_total_tokens", "available_tokens", "evictable_tokens")
    )
    return int(total - free - evictable)


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


@router.post("/abort_request")
async def abort_request(request: Request, http: Http) -> JSONResponse:
    """SGLang's abort: the requests in flight with client rid ``rid`` (whichever connection sent them),
    or every request with ``abort_all``. Each one's own reply ends with finish reason abort and its KV
    is freed. 200 even when nothing matched (as SGLang); ``aborted`` says how many were."""
    http.authorize(request)
    body: AbortBody = await read_body(request, AbortBody, http.max_request_bytes)
    rid = body.rid or ""
    why = body.abort_message or ABORT_MESSAGE
    aborted = await http.ready_door().abort_requests(rid, body.abort_all, why) if rid or body.abort_all else 0
    return JSONResponse({"success": True, "rid": rid, "abort_all": body.abort_all, "aborted": aborted})


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request, http: Http) -> JSONResponse:
    """Start the torch profiler on every scheduler rank (SGLang's body, optional); each rank writes a
    Chrome trace into ``output_dir`` at /stop_profile, or after ``num_steps`` forward steps."""
    http.authorize(request)
    body = await optional_body(request, ProfileBody, http.max_request_bytes)
    return await _profile(http, request, ProfileReq(rid="start_profile", start=True, options=body.options()))


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request, http: Http) -> JSONResponse:
    """Stop the profiler; the reply names the traces written (``trace_files``, one per rank)."""
    return await _profile(http, request, ProfileReq(rid="stop_profile", start=False))


async def _profile(http: HttpContext, request: Request, req: ProfileReq) -> JSONResponse:
    """A profile start or stop: its payload, or 400 with the reason's code (``profile_not_started``,
    ``profile_already_started``, ``invalid_request``)."""
    payload = await _control(http, request, req)
    if not payload.get("success"):
        return error_response(400, str(payload.get("message")), str(payload.get("error", "invalid_request")))
    return JSONResponse({k: v for k, v in payload.items() if k not in ("replicas", "error")})


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, http: Http) -> JSONResponse:
    """Reload the weights in place from ``model_path`` (same model, other values), as an RL loop does
    between rollouts: running requests finish on the old weights first (or are aborted, with
    ``abort_all_requests``), requests arriving meanwhile wait; the prefix cache is flushed. SGLang's
    reply: ``success``, ``message``, ``num_paused_requests``; 400 when refused (the old weights serve on)."""
    http.authorize(request)
    body: UpdateWeightsBody = await read_body(request, UpdateWeightsBody, http.max_request_bytes)
    try:
        payload = await _control(http, request, UpdateWeightsReq(rid="update_weights", update=body.update()))
    except Rejected as exc:
        if exc.code != "invalid_request":
            raise
        payload = {"success": False, "message": exc.message, "num_paused_requests": 0}
    reply = {key: payload.get(key) for key in ("success", "message", "num_paused_requests")}
    return JSONResponse(reply, status_code=200 if payload.get("success") else 400)
