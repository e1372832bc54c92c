"""Step-by-step trace of the real Scheduler driving the real ModelRunner, in one process.

Between ``bench/model_step.py`` (the model alone) and ``bench/serving.py`` (the whole
server): no sockets, no tokenizer or detokenizer process, no client, so what it shows
is the scheduler's own decisions (how prefills are batched, how many decode steps run,
what the prefix cache saves) and their cost. Every step records its kind, batch size,
new tokens, model time and the scheduler's time around it; the summary splits the run
into prefill and decode time.

    python -m bench.scheduler_trace --workload uniform
    python -m bench.scheduler_trace --workload shared-prefix --steps      # plus one line per step
    python -m bench.scheduler_trace --device cuda --model-path DIR --workload uniform
    python -m bench.scheduler_trace --overlap both       # overlap scheduling off, then on, one table

Per decode step it reports the device time of the forward, the host's own time (the
scheduler thread's wall time minus what it spent waiting for the model), how much of
that host time is exposed (step wall time minus device time: the device idles) and how
much the overlap hides (host minus exposed). Without overlap nothing is hidden.

On cuda each forward is followed by a device sync so that its model time is the GPU's
(the server overlaps that wait with scheduling; here it is measured apart).

Like serving.py, each workload is first sent once for 2 tokens (warm-up), then the
prefix cache is flushed, then the workload is submitted all at once and timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_sync, pin_threads, print_table
from bench.serving import add_workload_args, build_workloads


class TracingRunner:
    """Forwards to a ModelRunner and records (mode, batch size, new tokens, seconds) per forward."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.calls: list[tuple[str, int, int, float]] = []
        self.inline_s = 0.0  # forward time spent on the scheduler's own thread (no overlap)
        self._scheduler_thread = threading.get_ident()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def forward(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self.runner.forward(batch, *args, **kwargs)
        device_sync(self.runner.device)
        mode = "decode" if batch.forward_mode.is_decode() else "prefill"
        seconds = time.perf_counter() - t0
        self.calls.append((mode, batch.batch_size, batch.num_tokens, seconds))
        if threading.get_ident() == self._scheduler_thread:
            self.inline_s += seconds
        return out


@contextmanager
def timed_waits() -> Iterator[list[float]]:
    """Accumulate the seconds the scheduler thread blocks waiting for launched steps."""
    from scheduler_proc.model_worker import PendingStep

    waited = [0.0]
    original = PendingStep.wait

    def wait(self: PendingStep) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self)
        finally:
            waited[0] += time.perf_counter() - t0

    PendingStep.wait = wait  # type: ignore[method-assign]
    try:
        yield waited
    finally:
        PendingStep.wait = original  # type: ignore[method-assign]


def run_once(
    sched: Any, tracer: TracingRunner, workload: Any, max_new: int | None
) -> tuple[float, list[dict[str, Any]]]:
    """Submit every request of ``workload`` (dependency chains are not supported) and run to completion."""
    from runtime.protocol.messages import TokenizedGenerateReq
    from runtime.protocol.sampling_params import SamplingParams

    for r in workload.requests:
        n = r.max_new_tokens if max_new is None else max_new
        sched.handle_message(
            TokenizedGenerateReq(
                rid=f"r{r.index}-{max_new}",
                input_ids=list(r.input_ids),
                sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                stream=True,
            )
        )
    steps: list[dict[str, Any]] = []
    first_call = len(tracer.calls)
    t_start = time.perf_counter()
    with timed_waits() as waited:
        while not sched.is_idle():
            decodes, inline, wait0 = sched.stats["num_decode_batches"], tracer.inline_s, waited[0]
            t0 = time.perf_counter()
            sched.step()
            sched.take_outbox()
            dt = time.perf_counter() - t0
            host = dt - (waited[0] - wait0) - (tracer.inline_s - inline)
            launched = sched.stats["num_decode_batches"] > decodes
            steps.append(
                {
                    "mode": "decode" if launched else "other",
                    "wall_ms": dt * 1e3,
                    "host_ms": host * 1e3,
                    "t_s": time.perf_counter() - t_start,
                }
            )
    # Forwards finish on the worker thread with overlap: pair them with iterations by order.
    calls = tracer.calls[first_call:]
    for step, (mode, bs, tokens, model_s) in zip(
        [s for s in steps if s["mode"] == "decode"], [c for c in calls if c[0] == "decode"]
    ):
        step.update(bs=bs, tokens=tokens, model_ms=model_s * 1e3)
    for mode, bs, tokens, model_s in calls:
        if mode == "prefill":
            steps.append({"mode": "prefill", "bs": bs, "tokens": tokens, "model_ms": model_s * 1e3})
    return time.perf_counter() - t_start, steps


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def summarize_steps(name: str, duration: float, steps: list[dict[str, Any]], out_tokens: int) -> dict[str, Any]:
    """Totals, and per decode step: device (forward) time, host time, exposed and hidden host time."""
    pre = [s for s in steps if s["mode"] == "prefill"]
    dec = [s for s in steps if s["mode"] == "decode" and "model_ms" in s]
    host = median([s["host_ms"] for s in dec])
    exposed = median([max(s["wall_ms"] - s["model_ms"], 0.0) for s in dec])
    return {
        "workload": name,
        "time_s": duration,
        "out_tok_s": out_tokens / duration,
        "prefills": len(pre),
        "prefill_tokens": sum(s["tokens"] for s in pre),
        "prefill_s": sum(s["model_ms"] for s in pre) / 1e3,
        "decodes": len(dec),
        "decode_s": sum(s["model_ms"] for s in dec) / 1e3,
        "decode_ms_p50": median([s["model_ms"] for s in dec]),
        "step_wall_ms_p50": median([s["wall_ms"] for s in dec]),
        "host_ms_p50": host,
        "exposed_ms_p50": exposed,
        "hidden_ms_p50": max(host - exposed, 0.0),
        "sched_s": sum(s["host_ms"] for s in steps if "host_ms" in s) / 1e3,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="checkpoint folder (default: the bench checkpoint)")
    parser.add_argument(
        "--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda when available, else cpu"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", action="store_true", help="print one line per step")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument(
        "--overlap",
        default="both",
        choices=("off", "on", "both"),
        help="overlap scheduling off, on, or both one after the other (default both)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a ServerArgs field, e.g. max_prefill_tokens=4096 or disable_cuda_graph=1 (repeatable)",
    )
    add_workload_args(parser)
    args = parser.parse_args(argv)

    pin_threads(args.threads)
    from bench.checkpoint import build_bench_checkpoint
    from runtime.config.args import ServerArgs
    from scheduler_proc.model_worker import create_model_runner
    from scheduler_proc.scheduler import Scheduler

    path = args.model_path or str(build_bench_checkpoint())
    overrides: dict[str, Any] = {}
    for item in args.server_arg:
        key, _, value = item.partition("=")
        default = getattr(ServerArgs(), key)
        if isinstance(default, bool):  # bool("0") is True: spell booleans out
            overrides[key] = value.lower() in ("1", "true", "yes")
        else:
            overrides[key] = type(default)(value) if default is not None else int(value)
    server_args = ServerArgs(model_path=path, device=args.device, dtype=args.dtype, **overrides)
    tracer = TracingRunner(create_model_runner(server_args, tp_rank=0))
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.overlap]
    rows = []
    for overlap in modes:
        sched = Scheduler(dataclasses.replace(server_args, disable_overlap_schedule=not overlap), model_runner=tracer)
        for wl in build_workloads(args, path):
            name = f"{wl.name} (overlap {'on' if overlap else 'off'})"
            if not args.no_warmup:
                run_once(sched, tracer, wl, max_new=2)
                sched.control("flush_cache")
            duration, steps = run_once(sched, tracer, wl, max_new=None)
            if args.steps:
                print_table(
                    steps,
                    [
                        ("t_s", "t s"),
                        ("mode", "mode"),
                        ("bs", "bs"),
                        ("tokens", "tokens"),
                        ("model_ms", "model ms"),
                        ("wall_ms", "wall ms"),
                        ("host_ms", "host ms"),
                    ],
                    title=f"{name}: steps",
                )
            rows.append(summarize_steps(name, duration, steps, wl.output_tokens))
            sched.control("flush_cache")
        sched.worker.close()
    print_table(
        rows,
        [
            ("workload", "workload"),
            ("time_s", "time s"),
            ("out_tok_s", "out tok/s"),
            ("prefills", "prefills"),
            ("prefill_s", "prefill s"),
            ("decodes", "decodes"),
            ("decode_ms_p50", "device ms/step"),
            ("step_wall_ms_p50", "wall ms/step"),
            ("host_ms_p50", "host ms/step"),
            ("exposed_ms_p50", "exposed ms/step"),
            ("hidden_ms_p50", "hidden ms/step"),
        ],
        title="scheduler + model, in process (per decode step: medians)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
