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

On cuda each forward is followed by a device sync so that its model time is the GPU's
(the server overlaps that wait with scheduling; here it is measured apart).

Like serving.py, each workload is first sent once for 2 tokens (warm-up), then the
prefix cache is flushed, then the workload is submitted all at once and timed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import device_sync, pin_threads, print_table
from bench.serving import add_workload_args, build_workloads


class TracingRunner:
    """Forwards to a ModelRunner and records (mode, batch size, new tokens, seconds) per forward."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.calls: list[tuple[str, int, int, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def forward(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self.runner.forward(batch, *args, **kwargs)
        device_sync(self.runner.device)
        mode = "decode" if batch.forward_mode.is_decode() else "prefill"
        self.calls.append((mode, batch.batch_size, batch.num_tokens, time.perf_counter() - t0))
        return out


def run_once(sched: Any, tracer: TracingRunner, workload: Any, max_new: int | None) -> tuple[float, list[dict[str, Any]]]:
    """Submit every request of ``workload`` (dependency chains are not supported) and run to completion."""
    from runtime.messages import TokenizedGenerateReq
    from runtime.sampling_params import SamplingParams

    for r in workload.requests:
        n = r.max_new_tokens if max_new is None else max_new
        sched.handle_message(TokenizedGenerateReq(
            rid=f"r{r.index}-{max_new}", input_ids=list(r.input_ids),
            sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True), stream=True))
    steps: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    while not sched.is_idle():
        before = len(tracer.calls)
        t0 = time.perf_counter()
        sched.step()
        sched.take_outbox()
        dt = time.perf_counter() - t0
        if len(tracer.calls) > before:
            mode, bs, tokens, model_s = tracer.calls[-1]
            steps.append({"mode": mode, "bs": bs, "tokens": tokens, "model_ms": model_s * 1e3,
                          "sched_ms": (dt - model_s) * 1e3, "t_s": time.perf_counter() - t_start})
    return time.perf_counter() - t_start, steps


def summarize_steps(name: str, duration: float, steps: list[dict[str, Any]], out_tokens: int) -> dict[str, Any]:
    pre = [s for s in steps if s["mode"] == "prefill"]
    dec = [s for s in steps if s["mode"] == "decode"]
    return {
        "workload": name, "time_s": duration, "out_tok_s": out_tokens / duration,
        "prefills": len(pre), "prefill_tokens": sum(s["tokens"] for s in pre),
        "prefill_s": sum(s["model_ms"] for s in pre) / 1e3,
        "decodes": len(dec), "decode_s": sum(s["model_ms"] for s in dec) / 1e3,
        "decode_ms_p50": sorted(s["model_ms"] for s in dec)[len(dec) // 2] if dec else 0.0,
        "sched_s": sum(s["sched_ms"] for s in steps) / 1e3,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="checkpoint folder (default: the bench checkpoint)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="auto: cuda when available, else cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", action="store_true", help="print one line per step")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--server-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a ServerArgs field, e.g. max_prefill_tokens=4096 or disable_cuda_graph=1 "
                             "(repeatable)")
    add_workload_args(parser)
    args = parser.parse_args(argv)

    pin_threads(args.threads)
    from bench.checkpoint import build_bench_checkpoint
    from runtime.args import ServerArgs
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
    sched = Scheduler(server_args)
    tracer = TracingRunner(sched.runner)
    for owner in (sched, sched.builder, getattr(sched, "worker", None)):  # whoever calls forward
        if owner is not None and hasattr(owner, "runner"):
            owner.runner = tracer
    rows = []
    for wl in build_workloads(args, path):
        name = wl.name
        if not args.no_warmup:
            run_once(sched, tracer, wl, max_new=2)
            sched.control("flush_cache")
        duration, steps = run_once(sched, tracer, wl, max_new=None)
        if args.steps:
            print_table(steps, [("t_s", "t s"), ("mode", "mode"), ("bs", "bs"), ("tokens", "tokens"),
                                ("model_ms", "model ms"), ("sched_ms", "sched ms")], title=f"{name}: steps")
        rows.append(summarize_steps(name, duration, steps, wl.output_tokens))
        sched.control("flush_cache")
    print_table(rows, [("workload", "workload"), ("time_s", "time s"), ("out_tok_s", "out tok/s"),
                       ("prefills", "prefills"), ("prefill_tokens", "prefill tok"), ("prefill_s", "prefill s"),
                       ("decodes", "decodes"), ("decode_s", "decode s"), ("decode_ms_p50", "decode ms p50"),
                       ("sched_s", "scheduler s")], title="scheduler + model, in process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
