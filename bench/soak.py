"""Soak: many requests, a share of them aborted or abandoned mid-flight, on a small KV pool;
then the server must be idle with every KV slot back (issue 17).

    python -m bench.soak --model tiny --device cpu                  # 3,000 requests, the defaults
    python -m bench.soak --address tcp://HOST:PORT --num-requests 500

Each request draws what happens to it (seeded):
  * complete: a greedy request with ``ignore_eos`` runs to ``max_new_tokens`` (its output
    length is checked), streamed or not;
  * abort: a stream left after a few chunks (the client aborts it), or a non-stream
    request aborted by rid after a short delay;
  * disconnect: a raw socket sends the request and closes after a few chunks or a delay,
    without a word (the server notices the vanished client and aborts its request).
A request whose client times out (``--timeout``) is *hung*; so is one the server still
holds once everything has ended. After the run the server must go idle, and then
``leaked_slots`` = pool size - (available + evictable) must be 0 with the memory invariant
holding. Flags this script does not know go to launch.py; without ``--max-total-tokens``
the started server gets a small pool (``SMALL_POOL_TOKENS``), so that retraction and
eviction take part.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import msgspec
import zmq
import zmq.asyncio

from bench.common import default_output_path, machine_info, print_table, write_json
from bench.serving import add_model_args, resolve_model_path, server_for

SMALL_POOL_TOKENS = 2048
IDLE_TIMEOUT_S = 120.0
TABLE_COLUMNS = [
    ("requests", "requests"),
    ("completed", "completed"),
    ("aborted", "aborted"),
    ("disconnected", "disconnected"),
    ("errors", "errors"),
    ("hung", "hung"),
    ("leaked_slots", "leaked slots"),
    ("invariant_ok", "invariant ok"),
    ("wall_s", "wall s"),
    ("req_per_s", "req/s"),
    ("idle_after_s", "idle after s"),
]


@dataclass(frozen=True)
class Plan:
    """What happens to one request."""

    index: int
    fate: str  # "complete" | "abort" | "disconnect"
    input_ids: list[int]
    max_new_tokens: int
    stream: bool
    after_chunks: int  # abort / disconnect after this many chunks (streams)
    after_s: float  # abort / disconnect after this delay (non-stream)


def make_plans(
    num: int, abort_frac: float, disconnect_frac: float, vocab_size: int, max_prompt: int, max_new: int, seed: int
) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(num):
        u = rng.random()
        fate = "abort" if u < abort_frac else "disconnect" if u < abort_frac + disconnect_frac else "complete"
        plans.append(
            Plan(
                index=i,
                fate=fate,
                input_ids=[rng.randrange(vocab_size) for _ in range(rng.randint(1, max_prompt))],
                max_new_tokens=rng.randint(1, max_new),
                stream=rng.random() < 0.5,
                after_chunks=rng.randint(1, 4),
                after_s=rng.uniform(0.0, 0.2),
            )
        )
    return plans


def _params(plan: Plan) -> dict[str, Any]:
    return {"max_new_tokens": plan.max_new_tokens, "temperature": 0, "ignore_eos": True}


async def _complete(client: Any, plan: Plan) -> str:
    from runtime.client import RequestError, RequestTimeout

    try:
        if plan.stream:
            ids: list[int] = []
            async for chunk in client.generate(input_ids=plan.input_ids, sampling_params=_params(plan), stream=True):
                ids += chunk["output_ids"]
        else:
            ids = (await client.generate(input_ids=plan.input_ids, sampling_params=_params(plan)))["output_ids"]
    except RequestTimeout:
        return "hung"
    except RequestError as exc:
        return f"error:{exc.code}"
    return "completed" if len(ids) == plan.max_new_tokens else f"error:wrong_length_{len(ids)}"


async def _abort(client: Any, plan: Plan) -> str:
    from runtime.client import RequestError, RequestTimeout

    try:
        if plan.stream:
            seen = 0
            async for _ in client.generate(input_ids=plan.input_ids, sampling_params=_params(plan), stream=True):
                seen += 1
                if seen >= plan.after_chunks:
                    break  # leaving the stream aborts it
            return "aborted"
        rid = uuid.uuid4().hex
        task = asyncio.ensure_future(client.generate(input_ids=plan.input_ids, sampling_params=_params(plan), rid=rid))
        await asyncio.sleep(plan.after_s)
        await client.abort(rid)
        await task  # finished or aborted: either way it must end
        return "aborted"
    except RequestTimeout:
        return "hung"
    except RequestError as exc:
        return f"error:{exc.code}"


async def _disconnect(ctx: zmq.asyncio.Context, address: str, api_key: str | None, plan: Plan) -> str:
    """A client that vanishes: its own socket, closed without an abort."""
    from runtime.protocol.messages import GenerateReq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        await sock.send(
            msgspec.msgpack.encode(
                GenerateReq(
                    rid=uuid.uuid4().hex,
                    input_ids=plan.input_ids,
                    sampling_params=_params(plan),
                    stream=plan.stream,
                    api_key=api_key,
                )
            )
        )
        if plan.stream:
            seen = 0
            while seen < plan.after_chunks and await sock.poll(5000):
                if await sock.recv():  # an empty frame is a keepalive probe
                    seen += 1
        else:
            await asyncio.sleep(plan.after_s)
    finally:
        sock.close(linger=0)
    return "disconnected"


async def run_soak(
    address: str, api_key: str | None, plans: list[Plan], concurrency: int, timeout: float
) -> tuple[dict[str, int], float]:
    """Run every plan, ``concurrency`` at a time; the outcome counts and the wall time."""
    from runtime.client import AsyncClient

    counts: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    ctx = zmq.asyncio.Context()
    async with AsyncClient(address, api_key=api_key, timeout=timeout) as client:

        async def one(plan: Plan) -> None:
            async with sem:
                if plan.fate == "complete":
                    outcome = await _complete(client, plan)
                elif plan.fate == "abort":
                    outcome = await _abort(client, plan)
                else:
                    outcome = await _disconnect(ctx, address, api_key, plan)
            counts[outcome] = counts.get(outcome, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in plans))
        wall = time.perf_counter() - t0
    ctx.term()
    return counts, wall


def wait_idle(address: str, api_key: str | None, timeout: float = IDLE_TIMEOUT_S) -> tuple[dict[str, Any], float]:
    """Server info once nothing is left anywhere (or at the timeout), and how long it took."""
    from runtime.client import Client

    t0 = time.perf_counter()
    with Client(address, api_key=api_key, timeout=60) as c:
        while True:
            info = c.server_info()
            busy = (
                info["num_running"]
                or info["num_queued"]
                or info.get("num_chunked")
                or info["tokenizer"]["active_requests"]
            )
            if not busy or time.perf_counter() - t0 > timeout:
                return info, time.perf_counter() - t0
            time.sleep(0.1)  # the server pushes no "idle" event: poll its cheap info call


def summarize(
    plans: list[Plan], counts: dict[str, int], wall: float, info: dict[str, Any], idle_after: float
) -> dict[str, Any]:
    busy_left = (
        int(info["num_running"] or 0) + int(info["num_queued"] or 0) + int(info["tokenizer"]["active_requests"] or 0)
    )
    leaked = int(info["max_total_tokens"]) - int(info["available_tokens"]) - int(info["evictable_tokens"])
    return {
        "requests": len(plans),
        "planned": {f: sum(p.fate == f for p in plans) for f in ("complete", "abort", "disconnect")},
        "completed": counts.get("completed", 0),
        "aborted": counts.get("aborted", 0),
        "disconnected": counts.get("disconnected", 0),
        "errors": sum(v for k, v in counts.items() if k.startswith("error:")),
        "error_kinds": {k: v for k, v in counts.items() if k.startswith("error:")},
        "hung": counts.get("hung", 0) + busy_left,
        "leaked_slots": leaked,
        "invariant_ok": bool(info["memory_invariant"]["ok"]),
        "wall_s": wall,
        "req_per_s": len(plans) / wall if wall > 0 else float("nan"),
        "idle_after_s": idle_after,
        "max_total_tokens": info["max_total_tokens"],
    }


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other flag (e.g. --device cpu) is passed to launch.py.",
    )
    parser.add_argument("--address", default=None, help="a running server (default: start one)")
    parser.add_argument("--api-key", default=None)
    add_model_args(parser)
    g = parser.add_argument_group("soak")
    g.add_argument("--num-requests", type=int, default=3000)
    g.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    g.add_argument("--abort-frac", type=float, default=0.1, help="share aborted by the client (default 0.1)")
    g.add_argument(
        "--disconnect-frac", type=float, default=0.1, help="share whose client vanishes mid-flight (default 0.1)"
    )
    g.add_argument("--max-prompt", type=int, default=256, help="prompt lengths are drawn in [1, this]")
    g.add_argument("--max-new-tokens", type=int, default=64, help="output lengths are drawn in [1, this]")
    g.add_argument("--timeout", type=float, default=120.0, help="a request without a reply this long is hung")
    g.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/soak_<n>_<time>.json)")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args, server_flags = parse_args(argv)
    if not any(f == "--max-total-tokens" or f.startswith("--max-total-tokens=") for f in server_flags):
        server_flags += ["--max-total-tokens", str(SMALL_POOL_TOKENS)]
    model_path = None if args.address else resolve_model_path(args)
    with server_for(args.address, model_path, server_flags, args.api_key, None) as handle:
        from runtime.client import Client

        with Client(handle.address, api_key=args.api_key, timeout=60) as c:
            model = c.server_info()["model"]
        vocab = int(model["vocab_size"])
        # Every prompt and its output fit: nothing is refused for its length.
        max_prompt = max(
            1, min(args.max_prompt, int(model["max_req_input_len"]), int(model["context_len"]) - args.max_new_tokens)
        )
        plans = make_plans(
            args.num_requests, args.abort_frac, args.disconnect_frac, vocab, max_prompt, args.max_new_tokens, args.seed
        )
        counts, wall = asyncio.run(run_soak(handle.address, args.api_key, plans, args.concurrency, args.timeout))
        info, idle_after = wait_idle(handle.address, args.api_key)
    result = summarize(plans, counts, wall, info, idle_after)
    record = {
        "kind": "soak",
        "config": {k: v for k, v in vars(args).items()},
        "server_flags": server_flags,
        "result": result,
        "machine": machine_info(None),
        "first_plans": [asdict(p) for p in plans[:3]],
    }
    print_table([result], TABLE_COLUMNS, title="soak")
    out = write_json(args.output or default_output_path("soak", str(args.num_requests)), record)
    print(f"\nwrote {out}")
    ok = result["hung"] == 0 and result["leaked_slots"] == 0 and result["invariant_ok"] and result["errors"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
