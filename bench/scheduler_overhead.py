"""CPU time the scheduler spends per decode step outside the model.

The real ``Scheduler`` drives ``StubModelRunner(verify_kv=False)`` (an instant model)
with ``--num-requests`` (default 256) running requests. Each timed step is one
decode step: batch formation, KV allocation, prefix-cache bookkeeping, stop checks
and output messages; the stub's own forward time is measured separately and
subtracted; msgpack-encoding the step's output messages (which the process loop
does before sending) is included. Time is this thread's CPU time (``time.thread_time``), so other
processes on a shared machine do not inflate it; wall time is reported too.

    python -m bench.scheduler_overhead                      # 256 requests, median/p99 ms per step
    python -m bench.scheduler_overhead --profile            # plus the top scheduler functions (cProfile)

Target: at most 1 ms per step at 256 running requests.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    REPO_ROOT,
    default_output_path,
    machine_info,
    pin_threads,
    print_table,
    progress,
    summarize,
    write_json,
)

TARGET_MS = 1.0


class TimedRunner:
    """Wraps a model runner and accumulates the time spent inside ``forward``."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def forward(self, batch: Any) -> Any:
        c0, w0 = time.thread_time(), time.perf_counter()
        out = self.runner.forward(batch)
        self.cpu_s += time.thread_time() - c0
        self.wall_s += time.perf_counter() - w0
        return out


def build_scheduler(
    num_requests: int,
    prompt_len: int,
    max_new_tokens: int,
    page_size: int = 1,
    radix: bool = True,
    vocab_size: int = 32000,
) -> tuple[Any, TimedRunner]:
    """A scheduler sized so all ``num_requests`` run at once without retraction."""
    from runtime.config.args import ServerArgs
    from scheduler_proc.scheduler import Scheduler
    from tests.support.stub_runner import StubModelRunner

    context = prompt_len + max_new_tokens + 8
    total = num_requests * (prompt_len + max_new_tokens + page_size) + 4096
    args = ServerArgs(
        max_total_tokens=total,
        max_running_requests=num_requests,
        page_size=page_size,
        disable_radix_cache=not radix,
        max_prefill_tokens=max(num_requests * prompt_len, 16384),
        chunked_prefill_size=-1,
    )
    stub = StubModelRunner(
        max_total_tokens=total,
        vocab_size=vocab_size,
        context_len=context,
        max_running_requests=num_requests,
        page_size=page_size,
        eos_token_ids=(2,),
        verify_kv=False,
    )
    runner = TimedRunner(stub)
    return Scheduler(args, model_runner=runner), runner


def submit_requests(
    sched: Any,
    num_requests: int,
    prompt_len: int,
    max_new_tokens: int,
    stream: bool,
    seed: int = 0,
    vocab_size: int = 32000,
) -> None:
    from runtime.protocol.messages import TokenizedGenerateReq
    from runtime.protocol.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        ids = [rng.randrange(6, vocab_size) for _ in range(prompt_len)]
        sched.handle_message(TokenizedGenerateReq(rid=f"r{i}", input_ids=ids, sampling_params=params, stream=stream))


def measure_overhead(
    num_requests: int = 256,
    prompt_len: int = 128,
    steps: int = 200,
    warmup_steps: int = 10,
    page_size: int = 1,
    radix: bool = True,
    stream: bool = True,
    profile: cProfile.Profile | None = None,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Per-step scheduler overhead (ms) over ``steps`` decode steps with ``num_requests`` running."""
    max_new = warmup_steps + steps + 4  # nobody finishes while we measure
    sched, runner = build_scheduler(num_requests, prompt_len, max_new, page_size, radix)
    submit_requests(sched, num_requests, prompt_len, max_new, stream)
    for _ in range(100 * num_requests):  # admit everyone (prefill batches)
        if len(sched.queues.running) == num_requests and not sched.queues.waiting:
            break
        sched.step()
        sched.take_outbox()
    else:
        raise RuntimeError(f"only {len(sched.queues.running)} of {num_requests} requests started")
    for _ in range(warmup_steps):
        sched.step()
        sched.take_outbox()

    import msgspec

    encoder = msgspec.msgpack.Encoder()  # the process loop encodes the outbox for the detokenizer
    cpu_ms: list[float] = []
    wall_ms: list[float] = []
    model_ms: list[float] = []
    encode_ms: list[float] = []
    decodes_before = sched.stats["num_decode_batches"]
    for _ in progress(range(steps), total=steps, desc="decode steps", disable=not show_progress):
        m_cpu, m_wall = runner.cpu_s, runner.wall_s
        if profile is not None:
            profile.enable()
        c0, w0 = time.thread_time(), time.perf_counter()
        sched.step()
        outbox = sched.take_outbox()
        e0 = time.thread_time()
        for msg in outbox:
            encoder.encode(msg)
        c1, w1 = time.thread_time(), time.perf_counter()
        if profile is not None:
            profile.disable()
        encode_ms.append((c1 - e0) * 1e3)
        cpu_ms.append((c1 - c0 - (runner.cpu_s - m_cpu)) * 1e3)
        wall_ms.append((w1 - w0 - (runner.wall_s - m_wall)) * 1e3)
        model_ms.append((runner.cpu_s - m_cpu) * 1e3)
    decode_steps = sched.stats["num_decode_batches"] - decodes_before
    if decode_steps != steps or len(sched.queues.running) != num_requests:
        raise RuntimeError(
            f"expected {steps} decode steps of {num_requests} requests, got {decode_steps} "
            f"steps and {len(sched.queues.running)} running"
        )
    cpu, wall, model, enc = summarize(cpu_ms), summarize(wall_ms), summarize(model_ms), summarize(encode_ms)
    return {
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "steps": steps,
        "page_size": page_size,
        "radix_cache": radix,
        "stream": stream,
        "cpu_ms_p50": cpu["p50"],
        "cpu_ms_p99": cpu["p99"],
        "cpu_ms_mean": cpu["mean"],
        "wall_ms_p50": wall["p50"],
        "wall_ms_p99": wall["p99"],
        "encode_ms_p50": enc["p50"],  # part of cpu_ms: msgpack of the step's outputs
        "stub_model_ms_p50": model["p50"],  # not part of cpu_ms
        "target_ms": TARGET_MS,
        "meets_target": cpu["p50"] <= TARGET_MS,
    }


def profile_report(profile: cProfile.Profile, top: int = 25, folders: Sequence[str] = ("scheduler_proc/",)) -> str:
    """The top ``top`` functions by cumulative time whose file is in ``folders``, then overall by own time."""
    stats = pstats.Stats(profile)
    entries = []
    for (filename, line, func), (cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if any(f in filename for f in folders):
            entries.append((ct, tt, nc, f"{os.path.relpath(filename, REPO_ROOT)}:{line}({func})"))
    entries.sort(reverse=True)
    lines = [
        f"top {top} by cumulative time in {', '.join(folders)} (seconds over all profiled steps; "
        "cProfile inflates every call, so compare entries with each other, not with the table):",
        f"{'cumtime':>9} {'tottime':>9} {'calls':>8}  function",
    ]
    lines += [f"{ct:9.4f} {tt:9.4f} {nc:8d}  {name}" for ct, tt, nc, name in entries[:top]]
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(15)
    lines += ["", "overall, by own time:", buf.getvalue()]
    return "\n".join(lines)


COLUMNS = [
    ("num_requests", "running"),
    ("page_size", "page"),
    ("radix_cache", "radix"),
    ("steps", "steps"),
    ("cpu_ms_p50", "CPU ms p50"),
    ("cpu_ms_p99", "CPU ms p99"),
    ("wall_ms_p50", "wall ms p50"),
    ("wall_ms_p99", "wall ms p99"),
    ("encode_ms_p50", "of which encode ms"),
    ("stub_model_ms_p50", "stub model ms (excluded)"),
    ("meets_target", f"<= {TARGET_MS:g} ms"),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256, help="running requests (the decode batch)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--disable-radix-cache", action="store_true")
    parser.add_argument("--no-stream", action="store_true", help="non-streaming requests (no per-step outputs)")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed steps and print the top entries")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--output", default=None, help="JSON path (default bench/results/scheduler_overhead_<N>_<time>.json)"
    )
    args = parser.parse_args(argv)

    pinning = pin_threads(args.threads)
    profile = cProfile.Profile() if args.profile else None
    result = measure_overhead(
        args.num_requests,
        args.prompt_len,
        args.steps,
        args.warmup_steps,
        args.page_size,
        radix=not args.disable_radix_cache,
        stream=not args.no_stream,
        profile=profile,
        show_progress=True,
    )
    print_table([result], COLUMNS, title="scheduler overhead per decode step (outside the model)", digits=3)
    report = profile_report(profile, args.profile_top) if profile is not None else None
    if report:
        print("\n" + report)
    out = write_json(
        args.output or default_output_path("scheduler_overhead", str(args.num_requests)),
        {"kind": "scheduler_overhead", "result": result, "machine": machine_info(pinning), "profile": report},
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
