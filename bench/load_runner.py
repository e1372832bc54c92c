"""Sending a workload to a server and recording what each request saw (bench/serving.py
summarises the records and is the command line).

Each request goes as ``input_ids`` with greedy sampling and ``ignore_eos`` (the same work
for every engine; a json-schema chat request goes as ``messages`` with its ``json_schema``
instead, and ends where its grammar does), through the Python client (``backend="zmq"``)
or the HTTP front door (``backend="http"``, bench/http_backend.py); a request with a ``lora_path``
runs on that LoRA adapter (the client's ``lora_path``, or the OpenAI model ``SERVED:ADAPTER``). Chains (multi-turn sessions) start at their
arrival times, all at once or as a Poisson process; within a chain each request waits for
the previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench.workloads import BenchRequest, Workload


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds, relative to the run's start)."""

    index: int
    prompt_len: int
    sent_at: float = 0.0
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    # Per token after the first chunk: the gap before its chunk divided by the chunk's tokens.
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    text: str | None = None  # the output, kept for constrained requests only (to validate it)


def arrival_times(num_chains: int, request_rate: float, seed: int) -> list[float]:
    """Start offsets of the chains: all 0 for an infinite rate, else a Poisson process."""
    if math.isinf(request_rate) or request_rate <= 0:
        return [0.0] * num_chains
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_chains):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


def sampling_params(req: BenchRequest) -> dict[str, Any]:
    """Greedy, exactly max_new_tokens tokens: the same work for every engine. A constrained
    request instead stops where its schema's JSON is complete, and an ``until_eos`` one (the repeat
    workload) where the model ends it (max_new_tokens is their cap)."""
    if req.json_schema is not None:
        return {"max_new_tokens": req.max_new_tokens, "temperature": 0.0, "json_schema": req.json_schema}
    if req.until_eos:  # (the repeat workload: an answer ends where the model ends it)
        return {"max_new_tokens": req.max_new_tokens, "temperature": 0.0}
    return {"max_new_tokens": req.max_new_tokens, "temperature": 0.0, "ignore_eos": True}


async def _send_one(client: Any, req: BenchRequest, stream: bool, t0: float, bar: Any) -> RequestRecord:
    from bench.http_backend import CompletionsClient, HttpError, send
    from runtime.client import RequestError

    rec = RequestRecord(index=req.index, prompt_len=len(req.input_ids))
    prompt: dict[str, Any] = {"messages": req.messages} if req.messages is not None else {"input_ids": req.input_ids}
    # Only a LoRA request names an adapter (the keyword stays out of other requests).
    adapter: dict[str, Any] = {"lora_path": req.lora_path} if req.lora_path is not None else {}
    if req.json_schema is not None:
        rec.text = ""
    start = time.perf_counter()
    rec.sent_at = start - t0
    try:
        if isinstance(client, CompletionsClient):
            if req.messages is not None:
                raise ValueError("the http backend sends token-id prompts only")
            await send(client, req.input_ids, req.max_new_tokens, stream, rec, start, adapter=req.lora_path)
        elif stream:
            last = start
            async for chunk in client.generate(**prompt, **adapter, sampling_params=sampling_params(req), stream=True):
                now = time.perf_counter()
                n = len(chunk["output_ids"])
                if n:
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:  # each token of a chunk (several: speculative decoding) its share of the gap
                        rec.itl.extend([(now - last) / n] * n)
                    last = now
                    rec.output_len += n
                if rec.text is not None:
                    rec.text += chunk["text"]
                if chunk["finished"]:
                    _take_meta(rec, chunk["meta"])
        else:
            result = await client.generate(**prompt, **adapter, sampling_params=sampling_params(req))
            rec.output_len = len(result["output_ids"])
            if rec.text is not None:
                rec.text = result["text"]
            _take_meta(rec, result["meta"])
        rec.latency = time.perf_counter() - start
    except (RequestError, HttpError) as exc:
        rec.error = exc.code
        rec.latency = time.perf_counter() - start  # how long a refusal took (summaries count successes only)
    except Exception as exc:  # a benchmark reports a failure; it does not stop
        rec.error = type(exc).__name__
    bar.update(1)
    return rec


def _take_meta(rec: RequestRecord, meta: dict[str, Any]) -> None:
    rec.cached_tokens = int(meta.get("cached_tokens", 0))
    rec.prompt_len = int(meta.get("prompt_tokens", rec.prompt_len))  # a chat prompt's length is the server's


async def run_workload_async(
    address: str,
    workload: Workload,
    *,
    api_key: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    stream: bool = True,
    seed: int = 0,
    timeout: float | None = None,
    show_progress: bool = True,
    backend: str = "zmq",
    model: str | None = None,
    extra_body: dict[str, Any] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``workload`` to the server; the request records and the wall time of the whole run.

    ``address`` is the ZMQ address, or with ``backend="http"`` the HTTP one
    (``http://HOST:PORT``; ``model`` is then the served model name, and ``extra_body`` adds
    fields to every request's body: bench/http_backend.py). Chains (multi-turn
    sessions) start at their arrival time; within a chain each request is sent when the
    previous one finished.
    """
    from tqdm import tqdm

    from bench.http_backend import CompletionsClient
    from runtime.client import AsyncClient

    chains = workload.chains()
    starts = arrival_times(len(chains), request_rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    if backend == "http":
        if model is None:
            raise ValueError("backend 'http' needs the served model name")
        opened: Any = contextlib.nullcontext(CompletionsClient(address, model, api_key, extra_body))
    else:
        opened = AsyncClient(address, api_key=api_key, timeout=timeout)
    async with opened as client:
        bar = tqdm(
            total=workload.num_requests,
            desc=workload.name,
            file=sys.stderr,
            leave=False,
            disable=not show_progress,
            dynamic_ncols=True,
        )
        t0 = time.perf_counter()

        async def run_chain(chain: list[BenchRequest], start: float) -> None:
            delay = t0 + start - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            failed = False
            for req in chain:
                if failed:  # later turns depend on the failed one: count them as failed, unsent
                    records.append(RequestRecord(index=req.index, prompt_len=len(req.input_ids), error="skipped"))
                    bar.update(1)
                    continue
                async with sem if sem is not None else contextlib.nullcontext():
                    rec = await _send_one(client, req, stream, t0, bar)
                records.append(rec)
                failed = rec.error is not None

        await asyncio.gather(*(run_chain(c, s) for c, s in zip(chains, starts)))
        duration = time.perf_counter() - t0
        bar.close()
    records.sort(key=lambda r: r.index)
    return records, duration


def run_workload(address: str, workload: Workload, **kwargs: Any) -> tuple[list[RequestRecord], float]:
    """Blocking wrapper of ``run_workload_async`` (uvloop when available)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_workload_async(address, workload, **kwargs))
    return uvloop.run(run_workload_async(address, workload, **kwargs))
