"""bench/gateway_prefix.py's pure parts and its client: the shared-prefix workload, the cpu shares, a
policy's row, and the streamed chat client against an in-process aiohttp server that answers the way
the gateway does (the whole benchmark, servers and gateway included, is minutes: it is not run here;
tests/e2e/test_gateway_e2e.py drives the gateway itself)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from bench import gateway_prefix
from bench.gateway_prefix import Record, build_requests, split_cpus, summarize


def words(text: str) -> int:
    return len(text.split())


def test_the_workload_is_users_under_a_few_long_system_prompts() -> None:
    reqs = build_requests(num_system_prompts=3, users=5, system_prompt_tokens=60, count_tokens=words, seed=1)
    assert [r.index for r in reqs] == list(range(15))
    systems = {r.family: r.messages[0]["content"] for r in reqs}
    for r in reqs:  # one system prompt per family, each request's own question after it
        assert [m["role"] for m in r.messages] == ["system", "user"] and r.messages[0]["content"] == systems[r.family]
    assert sorted((r.family, r.user) for r in reqs) == [(f, u) for f in range(3) for u in range(5)]
    assert all(words(s) >= 60 for s in systems.values())
    assert len({s.split(".")[0] for s in systems.values()}) == 3  # no two share their first sentence
    assert len({r.messages[1]["content"] for r in reqs}) == 15
    # a seeded shuffle, not a rotation over the prompts (which round_robin would keep on one server)
    assert [r.family for r in reqs] != [i % 3 for i in range(15)]
    again = build_requests(3, 5, 60, words, seed=1)
    assert [r.messages for r in again] == [r.messages for r in reqs]
    assert [r.family for r in build_requests(3, 5, 60, words, seed=2)] != [r.family for r in reqs]


def test_cpu_shares() -> None:
    assert split_cpus([0, 1], 2) == [[0], [1]]
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(SystemExit, match="--server-cpus"):
        split_cpus([0], 2)


def test_a_policys_row() -> None:
    records = [
        Record(0, 0, prompt_tokens=100, completion_tokens=10, cached_tokens=0, ttft=0.2, latency=1.0),
        Record(1, 0, prompt_tokens=100, completion_tokens=10, cached_tokens=90, ttft=0.1, latency=2.0),
        Record(2, 1, prompt_tokens=100, completion_tokens=10, cached_tokens=60, ttft=0.3, latency=3.0),
        Record(3, 1, prompt_tokens=500, error="HTTP 503"),  # a failure counts nowhere else
    ]
    row = summarize("cache_aware", records, 2.0, [2, 2])
    assert (row["done"], row["failed"], row["errors"]) == (3, 1, ["HTTP 503"])
    assert row["output_tok_s"] == 15.0 and row["cache_hit_rate"] == 0.5
    assert row["latency_p50_s"] == 2.0 and row["ttft_p50_ms"] == pytest.approx(200.0)
    assert row["per_worker"] == "2/2"
    assert summarize("round_robin", [], 1.0, [0, 0])["cache_hit_rate"] == 0.0
    assert math.isnan(summarize("round_robin", [], 1.0, [0, 0])["latency_p50_s"])


def test_flags_default_to_the_issue_workload_and_pass_the_rest_to_the_servers() -> None:
    args, server_flags = gateway_prefix.parse_args(["--device", "cpu", "--max-total-tokens", "8192"])
    assert (args.model, args.num_system_prompts, args.system_prompt_tokens, args.users) == ("smollm2", 4, 1000, 32)
    assert (args.concurrency, args.workers, args.policies) == (16, 2, ["cache_aware", "round_robin"])
    assert server_flags == ["--device", "cpu", "--max-total-tokens", "8192"]


async def _serve_and_send(reply: Any) -> list[Record]:
    """The bench client against a one-route aiohttp server whose handler is ``reply``."""
    from aiohttp import web

    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        return await reply(request)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reqs = build_requests(2, 1, 10, words)
        records, duration = await gateway_prefix.run_requests(f"http://127.0.0.1:{port}", "m", reqs, 3, 2)
    finally:
        await runner.cleanup()
    assert duration > 0 and len(seen) == 2
    body = seen[0]
    assert body["model"] == "m" and body["max_tokens"] == 3 and body["stream"] is True
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    return records


def test_the_client_reads_the_usage_at_the_end_of_a_stream() -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in (
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
            {
                "choices": [],
                "usage": {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}},
            },
        ):
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    records = asyncio.run(_serve_and_send(stream))
    for rec in records:
        assert rec.error is None and (rec.prompt_tokens, rec.completion_tokens, rec.cached_tokens) == (40, 3, 32)
        assert rec.ttft is not None and rec.latency is not None and rec.latency >= rec.ttft


def test_the_client_records_a_refusal() -> None:
    from aiohttp import web

    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "busy", "code": "overloaded"}}, status=503)

    records = asyncio.run(_serve_and_send(refuse))
    assert all(r.error is not None and r.error.startswith("HTTP 503") for r in records)
