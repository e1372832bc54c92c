"""Many users under a few long system prompts, through SGLang's Model Gateway (``sglang-router``) over
several tinyserve servers: the gateway's ``cache_aware`` policy against ``round_robin``, side by side
in one run.

Each request is a chat: one of ``--num-system-prompts`` system prompts of about
``--system-prompt-tokens`` tokens (the model's tokenizer counts them), then a short question of its
own; ``--users`` users per system prompt, sent in a seeded random order with ``--concurrency`` in
flight, greedy, exactly ``--max-new-tokens``
tokens each (``ignore_eos``), streamed. round_robin spreads every system prompt over every server, so
each server prefills, and keeps in its KV pool, every prompt; cache_aware sends a prompt's users where
the gateway sent that prefix before, so each server holds only its share. The table has, per policy:
output tokens/s, request latency p50 and p90, TTFT p50, the prefix-cache hit rate (the replies'
``usage.prompt_tokens_details.cached_tokens`` summed over their ``prompt_tokens`` summed) and how many
requests each server received (its own ``num_received``).

The servers start once (``--workers``, each on cores of its own: ``--server-cpus``, by default the
allowed cores split evenly, with as many OpenMP threads); each policy gets a gateway of its own in
front of them, started after every server's prefix cache was flushed. The gateway and this client
run unpinned. Flags this script does not know go to every server's ``launch.py``
(``--max-total-tokens`` to make the prefixes compete for the pool).

    python -m bench.gateway_prefix --device cpu          # SmolLM2-135M-Instruct, 4 x ~1000 tokens x 32 users
    python -m bench.gateway_prefix --model tiny --device cpu --num-system-prompts 2 --users 3 \\
        --system-prompt-tokens 48 --max-new-tokens 2 --concurrency 4     # a smoke run: seconds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

from bench.common import (
    Pinning,
    default_output_path,
    machine_info,
    parse_cpu_list,
    percentile,
    print_table,
    write_json,
)
from bench.serving import add_model_args, flush_cache, resolve_model_path

POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
READY_TIMEOUT_S = 600.0
COLUMNS = [
    ("policy", "policy"),
    ("done", "done"),
    ("failed", "failed"),
    ("duration_s", "time s"),
    ("output_tok_s", "out tok/s"),
    ("latency_p50_s", "lat p50 s"),
    ("latency_p90_s", "lat p90 s"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("cache_hit_rate", "cache hit"),
    ("per_worker", "requests per server"),
]

_TOPICS = ("billing", "shipping", "returns", "accounts", "warranty", "installation", "security", "travel")
_NOUNS = ("order", "invoice", "parcel", "refund", "password", "device", "ticket", "receipt", "booking", "plan")
_VERBS = ("check", "confirm", "explain", "record", "escalate", "verify", "summarize", "repeat")
_ADJ = ("late", "damaged", "missing", "duplicate", "expired", "urgent", "partial", "foreign")


@dataclass(frozen=True)
class ChatRequest:
    index: int
    family: int  # which system prompt
    user: int
    messages: list[dict[str, str]]


def system_prompt(family: int, target_tokens: int, count_tokens: Callable[[str], int], rng: random.Random) -> str:
    """A help desk's instructions of about ``target_tokens`` tokens (at least that many, counted a
    sentence at a time), its first words its own so that no two prompts share a prefix."""
    topic = _TOPICS[family % len(_TOPICS)]
    parts = [f"You are assistant {family} of the {topic} help desk. Follow every rule below.\n"]
    total = count_tokens(parts[0])
    while total < target_tokens:
        n = len(parts)
        sentence = (
            f"Rule {n}: when a customer writes about a {rng.choice(_ADJ)} {rng.choice(_NOUNS)}, "
            f"{rng.choice(_VERBS)} the {rng.choice(_NOUNS)} number, then {rng.choice(_VERBS)} the "
            f"{rng.choice(_ADJ)} {rng.choice(_NOUNS)} before you answer.\n"
        )
        parts.append(sentence)
        total += count_tokens(sentence)
    return "".join(parts)


def build_requests(
    num_system_prompts: int,
    users: int,
    system_prompt_tokens: int,
    count_tokens: Callable[[str], int],
    seed: int = 0,
) -> list[ChatRequest]:
    """The workload: ``users`` users per system prompt, in a seeded random order. Not in turn: a
    strict rotation over the prompts would, with as many prompts as a multiple of the servers, make
    round_robin send each prompt to one server too."""
    rng = random.Random(seed)
    systems = [system_prompt(k, system_prompt_tokens, count_tokens, rng) for k in range(num_system_prompts)]
    pairs = [(family, user) for user in range(users) for family in range(num_system_prompts)]
    rng.shuffle(pairs)
    requests: list[ChatRequest] = []
    for family, user in pairs:
        question = (
            f"I am customer {user}. My {rng.choice(_NOUNS)} {rng.randint(100, 999)} is "
            f"{rng.choice(_ADJ)}. What should I do?"
        )
        messages = [{"role": "system", "content": systems[family]}, {"role": "user", "content": question}]
        requests.append(ChatRequest(len(requests), family, user, messages))
    return requests


def split_cpus(allowed: Sequence[int], workers: int) -> list[list[int]]:
    """``allowed`` in ``workers`` contiguous shares (the first ones get the remainder)."""
    if len(allowed) < workers:
        raise SystemExit(f"{len(allowed)} cpus for {workers} servers: give --server-cpus (one list per server)")
    size, extra = divmod(len(allowed), workers)
    shares, start = [], 0
    for i in range(workers):
        end = start + size + (1 if i < extra else 0)
        shares.append(list(allowed[start:end]))
        start = end
    return shares


# ---------------------------------------------------------------------- the client


@dataclass
class Record:
    index: int
    family: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    error: str | None = None


async def _send(session: Any, url: str, model: str, req: ChatRequest, max_new_tokens: int) -> Record:
    """One streamed chat request; the usage comes with the last event (``include_usage``)."""
    rec = Record(req.index, req.family)
    body = {
        "model": model,
        "messages": req.messages,
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.error = str(data["error"].get("code") or data["error"])
                    return rec
                if rec.ttft is None and any(c.get("delta", {}).get("content") for c in data.get("choices") or []):
                    rec.ttft = time.perf_counter() - start
                usage = data.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage["prompt_tokens"])
                    rec.completion_tokens = int(usage["completion_tokens"])
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        rec.latency = time.perf_counter() - start
        if rec.completion_tokens == 0:
            rec.error = "no usage in the stream"
    except Exception as exc:  # a benchmark reports a failure; it does not stop
        rec.error = type(exc).__name__
    return rec


async def run_requests(
    url: str, model: str, requests: Sequence[ChatRequest], max_new_tokens: int, concurrency: int
) -> tuple[list[Record], float]:
    """All of ``requests`` through the HTTP server at ``url``, at most ``concurrency`` in flight."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:

        async def one(req: ChatRequest) -> Record:
            async with sem:
                return await _send(session, url, model, req, max_new_tokens)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(r) for r in requests))
        return list(records), time.perf_counter() - t0


def summarize(policy: str, records: Sequence[Record], duration: float, per_worker: Sequence[int]) -> dict[str, Any]:
    """One policy's row (pure: unit-tested)."""
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    latencies = [r.latency for r in ok if r.latency is not None]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    return {
        "policy": policy,
        "done": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error is not None}),
        "duration_s": duration,
        "output_tok_s": sum(r.completion_tokens for r in ok) / duration if duration > 0 else float("nan"),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p90_s": percentile(latencies, 90),
        "ttft_p50_ms": percentile(ttfts, 50),
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "per_worker": "/".join(str(n) for n in per_worker),
    }


# ---------------------------------------------------------------------- servers and gateways


@contextlib.contextmanager
def start_servers(argv: Sequence[str], cpu_sets: Sequence[Sequence[int]]) -> Iterator[list[Any]]:
    """One server per cpu set, started at once, each pinned to its set (the affinity a child inherits
    from this thread when it is forked); a connected client of each (``client.server``: the process)."""
    from tests.support.server_process import ServedClient, ServerProcess

    original = os.sched_getaffinity(0)
    servers: list[ServerProcess] = []
    clients: list[ServedClient] = []
    try:
        for cpus in cpu_sets:
            os.sched_setaffinity(0, cpus)
            env = Pinning(tuple(cpus), len(cpus)).child_env()
            servers.append(ServerProcess([*argv, "--port", "0"], env=env, wait=False))
        os.sched_setaffinity(0, original)
        for server in servers:
            server.wait_ready(READY_TIMEOUT_S)
        clients = [ServedClient(s, api_key=None, timeout=120) for s in servers]
        yield clients
    finally:
        os.sched_setaffinity(0, original)
        for client in clients:
            client.close()
        for server in servers:
            server.stop()


def served_model(http_address: str) -> str:
    from tests.support.gateway_process import http_json

    status, body = http_json(http_address + "/v1/models")
    assert status == 200, body
    return str(body["data"][0]["id"])


def run_policy(
    policy: str, servers: Sequence[Any], requests: Sequence[ChatRequest], args: argparse.Namespace, model: str
) -> dict[str, Any]:
    """One policy: flush every server, start a gateway in front of them, send the workload."""
    from tests.support.gateway_process import GatewayProcess

    for server in servers:
        if not flush_cache(server.server.address, None):
            print(f"warning: could not flush {server.server.address}", file=sys.stderr)
    before = [s.server_info()["num_received"] for s in servers]
    urls = [s.server.http_address for s in servers]
    with GatewayProcess(urls, policy, shlex.split(args.gateway_args)) as gateway:
        records, duration = asyncio.run(
            run_requests(gateway.url, model, requests, args.max_new_tokens, args.concurrency)
        )
    per_worker = [s.server_info()["num_received"] - b for s, b in zip(servers, before)]
    row = summarize(policy, records, duration, per_worker)
    row["records"] = [asdict(r) for r in records]
    return row


# ---------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other flag (e.g. --device cpu --max-total-tokens 8192) is passed to every server's launch.py.",
    )
    add_model_args(parser)
    parser.set_defaults(model="smollm2")
    g = parser.add_argument_group("workload")
    g.add_argument("--num-system-prompts", type=int, default=4)
    g.add_argument("--system-prompt-tokens", type=int, default=1000, help="about this many tokens each (default 1000)")
    g.add_argument("--users", type=int, default=32, help="users per system prompt (default 32)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    g.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("servers and gateway")
    g.add_argument("--workers", type=int, default=2, help="tinyserve servers (default 2)")
    g.add_argument(
        "--server-cpus",
        nargs="+",
        default=None,
        metavar="CPUS",
        help="each server's cpus, taskset syntax, one list per server (default: the allowed cpus split evenly)",
    )
    g.add_argument("--policies", nargs="+", choices=POLICIES, default=["cache_aware", "round_robin"])
    g.add_argument(
        "--gateway-args", default="", help="more flags for the gateway, one string (e.g. '--cache-threshold 0.5')"
    )
    g.add_argument(
        "--no-warmup", action="store_true", help="skip each server's warm-up (one request per system prompt)"
    )
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/gateway_prefix_<time>.json)")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args, server_flags = parse_args(argv)
    if args.server_cpus is not None:
        cpu_sets = [parse_cpu_list(spec) for spec in args.server_cpus]
        if len(cpu_sets) != args.workers:
            raise SystemExit(f"--server-cpus gives {len(cpu_sets)} lists for {args.workers} servers")
    else:
        cpu_sets = split_cpus(sorted(os.sched_getaffinity(0)), args.workers)
    model_path = resolve_model_path(args)
    from runtime.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    requests = build_requests(
        args.num_system_prompts,
        args.users,
        args.system_prompt_tokens,
        lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
        args.seed,
    )
    argv_servers = ["--model-path", model_path, *server_flags]
    with start_servers(argv_servers, cpu_sets) as servers:
        model = served_model(servers[0].server.http_address)
        if not args.no_warmup:  # one-off costs (first prefills of these lengths) paid outside the runs
            warmup = [next(r for r in requests if r.family == k) for k in range(args.num_system_prompts)]
            for server in servers:
                asyncio.run(run_requests(server.server.http_address, model, warmup, 2, 4))
        rows = [run_policy(policy, servers, requests, args, model) for policy in args.policies]
    print_table(
        rows,
        COLUMNS,
        title=(
            f"gateway over {args.workers} servers: {args.num_system_prompts} system prompts x {args.users} users, "
            f"~{args.system_prompt_tokens} + question tokens, {args.max_new_tokens} new, {args.concurrency} in flight"
        ),
    )
    for row in rows:
        if row["failed"]:
            print(f"warning: {row['failed']} requests failed under {row['policy']}: {row['errors']}", file=sys.stderr)
    out = write_json(
        args.output or default_output_path("gateway", "prefix"),
        {
            "kind": "gateway_prefix",
            "rows": rows,
            "settings": {k: v for k, v in vars(args).items() if k != "output"},
            "server_flags": server_flags,
            "server_cpus": cpu_sets,
            "model_path": model_path,
            "machine": machine_info(),
        },
    )
    print(f"\nwrote {out}")
    return 1 if any(row["failed"] or not row["done"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
