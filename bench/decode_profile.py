"""Where one request's decode step goes: model compute, LM head, sampling, Python, scheduler,
and what the server's other processes add (IPC, detokenizer, tokenizer, HTTP).

One person chatting with a model (the ``single`` workload: one request, 128 prompt tokens,
``--new-tokens`` greedy tokens) makes every decode step a batch of one, where fixed costs
weigh most. Two measurements, one after the other:

1. In process: the real ``Scheduler`` drives the real ``ModelRunner`` (no sockets). Timers
   (``time.perf_counter``) wrap the decoder layers (the one-call C path,
   ``runtime/engine/cpu/decode_layers.py``, or the layers one by one where it declines), the LM head,
   the sampler, the whole forward and the whole scheduler step; what the forward spends outside
   the first three is Python and small ops (embedding, rotary tables, the final norm, batch
   glue), what the step spends outside the forward is the scheduler's bookkeeping.
2. The server (``launch.py`` with the same flags): the same request over HTTP
   (``/v1/completions``, token ids), unstreamed and streamed, timed per token; plus the CPU
   time each of its processes used per token (``/proc/PID/stat``), since on a small CPU the
   tokenizer's and detokenizer's work takes cores from the model's threads.

The in-process part runs under this process's OpenMP settings, read when torch loads:
launch.py starts the server's processes with ``OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=5000`` on CPU
(unless the environment sets either; runtime/engine/cpu/host_memory.py says why), so run this with the
same variables set for in-process figures that match the server's.

Per-token rows are medians over the decode steps (in process) and over ``--repeat`` runs
(server). The server's ms a token less the in-process step is what the processes, IPC and
HTTP add on the critical path.

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=5000 python -m bench.decode_profile --model smollm2 --dtype float32 \
        --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, machine_info, pin_threads, print_table, write_json

# In-process components, in table order: (key, label).
COMPONENTS = [
    ("layers", "decoder layers ({layers_path})"),
    ("lm_head", "LM head (fp32 logits)"),
    ("sample", "sampling (greedy argmax)"),
    ("python", "embedding, rotary, final norm, Python glue"),
    ("scheduler", "scheduler bookkeeping (batch, outputs)"),
]


class Timers:
    """Seconds accumulated per name, for the wrapped functions (each wrapped once)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)


@contextlib.contextmanager
def patched(obj: Any, name: str, timers: Timers, key: str) -> Iterator[None]:
    original = getattr(obj, name)
    setattr(obj, name, timers.wrap(key, original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def split_step(before: dict[str, float], after: dict[str, float], step_s: float) -> dict[str, float]:
    """One step's components in ms from the timers' totals before and after it (pure)."""

    def d(key: str) -> float:
        return (after.get(key, 0.0) - before.get(key, 0.0)) * 1e3

    layers = d("c_layers") + d("py_layers")
    forward = d("forward")
    return {
        "layers": layers,
        "lm_head": d("lm_head"),
        "sample": d("sample"),
        "python": max(forward - layers - d("lm_head") - d("sample"), 0.0),
        "scheduler": max(step_s * 1e3 - forward, 0.0),
        "step": step_s * 1e3,
    }


def in_process(
    model_path: str, dtype: str, prompt: list[int], new_tokens: int, quantization: str | None = None
) -> tuple[dict[str, float], str]:
    """Median ms per decode step of each component, and which path ran the layers."""
    from runtime.config.args import ServerArgs
    from runtime.engine.cpu import decode_layers
    from runtime.engine.layers.embedding import ParallelLMHead
    from runtime.engine.model_runner import ModelRunner
    from runtime.protocol.messages import TokenizedGenerateReq
    from runtime.protocol.sampling_params import SamplingParams
    from scheduler_proc.model_worker import create_model_runner
    from scheduler_proc.scheduler import Scheduler

    args = ServerArgs(
        model_path=model_path, device="cpu", dtype=dtype, quantization=quantization, disable_overlap_schedule=True
    )
    sched = Scheduler(args, model_runner=create_model_runner(args, tp_rank=0))
    timers = Timers()
    steps: list[dict[str, float]] = []
    with contextlib.ExitStack() as stack:
        for obj, name, key in (
            (decode_layers, "_call", "c_layers"),
            # the layers one by one: what the device's layer stack falls back to (CausalLM.run_layers)
            (type(sched.runner.model), "run_layers", "py_layers"),
            (ParallelLMHead, "forward", "lm_head"),
            (ModelRunner, "_sample", "sample"),
            (ModelRunner, "forward", "forward"),
        ):
            stack.enter_context(patched(obj, name, timers, key))
        for rid, n in (("warm-up", 8), ("timed", new_tokens)):
            sched.handle_message(
                TokenizedGenerateReq(
                    rid=rid,
                    input_ids=list(prompt),
                    stream=True,
                    sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                )
            )
            while not sched.is_idle():
                decodes, before = sched.stats["num_decode_batches"], timers.snapshot()
                t0 = time.perf_counter()
                sched.step()
                sched.take_outbox()
                step_s = time.perf_counter() - t0
                if rid == "timed" and sched.stats["num_decode_batches"] > decodes:
                    steps.append(split_step(before, timers.snapshot(), step_s))
            sched.control("flush_cache")
    sched.worker.close()
    path = "one C call" if timers.calls.get("c_layers") else "Python, layer by layer"
    return {key: statistics.median(s[key] for s in steps) for key in steps[0]}, path


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(launcher: int) -> dict[str, int]:
    """The launcher's children by their titles (tinyserve::scheduler_TP0, ...), plus the launcher."""
    found = {"launcher": launcher}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and title.startswith("tinyserve::"):
            found[title.removeprefix("tinyserve::")] = int(entry.name)
    return found


def served(
    model_path: str, flags: Sequence[str], prompt: list[int], new_tokens: int, repeat: int, env: dict[str, str]
) -> dict[str, Any]:
    """Per token over HTTP, unstreamed and streamed (medians of ``repeat``), and each process's CPU ms a token."""
    from bench.load_runner import run_workload
    from bench.workloads import BenchRequest, Workload
    from tests.support.server_process import launch_server

    workload = Workload("single", {}, [BenchRequest(0, list(prompt), new_tokens)])
    out: dict[str, Any] = {}
    with launch_server(["--model-path", model_path, *flags], env=env, ready_timeout=600, client_timeout=60) as c:
        info = c.server_info()
        via = {"backend": "http", "model": info.get("server_args", {}).get("served_model_name") or model_path}
        procs = server_processes(c.server.pid)
        run_workload(c.server.http_address, workload, stream=False, show_progress=False, **via)  # warm-up
        for stream in (False, True):
            per_token, decode, cpu = [], [], {name: [] for name in procs}
            for _ in range(repeat):
                before = {name: process_cpu_seconds(pid) for name, pid in procs.items()}
                records, duration = run_workload(
                    c.server.http_address, workload, stream=stream, show_progress=False, **via
                )
                (rec,) = records
                if rec.error is not None or rec.output_len != new_tokens:
                    raise RuntimeError(f"the request failed: {rec.error}, {rec.output_len} tokens")
                per_token.append(duration * 1e3 / new_tokens)
                if rec.ttft is not None and rec.latency is not None:  # streamed: the decode steps alone
                    decode.append((rec.latency - rec.ttft) * 1e3 / (new_tokens - 1))
                for name, pid in procs.items():
                    cpu[name].append((process_cpu_seconds(pid) - before[name]) * 1e3 / new_tokens)
            out["stream" if stream else "whole"] = {
                "ms_per_token": statistics.median(per_token),
                "decode_ms_per_token": statistics.median(decode) if decode else None,
                "cpu_ms_per_token": {name: statistics.median(v) for name, v in cpu.items()},
            }
    return out


def profile_rows(parts: dict[str, float], layers_path: str, server: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The table (pure): component, ms a token, share of the total: the served decode step (the
    streamed request's time after its first token, per token) or, without a server, the
    in-process step. What the server adds is the served step less the in-process one (0 when
    the difference is within the noise and negative)."""
    total = server["stream"]["decode_ms_per_token"] if server else parts["step"]
    rows = [{"component": label.format(layers_path=layers_path), "ms": parts[key]} for key, label in COMPONENTS]
    if server:
        rows.append(
            {
                "component": "processes, ZMQ, detokenizer, HTTP (served less in process)",
                "ms": max(total - parts["step"], 0.0),
            }
        )
    rows.append({"component": "total (served decode step, streamed)" if server else "total (in process)", "ms": total})
    for row in rows:
        row["share"] = f"{100 * row['ms'] / total:.1f}%" if total else "-"
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from bench import serving

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False, epilog="Any other flag is passed to launch.py."
    )
    serving.add_model_args(parser)
    parser.add_argument("--dtype", default="float32", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument(
        "--quantization",
        default=None,
        help="launch.py's --quantization, in process and served (default: its auto rule)",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="served runs per mode; medians are quoted")
    parser.add_argument("--skip-server", action="store_true", help="the in-process part only")
    serving.add_pinning_args(parser)
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/decode_profile_<time>.json)")
    parser.set_defaults(model="smollm2")
    args, flags = parser.parse_known_args(argv)
    if args.new_tokens < 2 or args.prompt_len < 1 or args.repeat < 1:
        parser.error("--new-tokens >= 2, --prompt-len >= 1 and --repeat >= 1")
    from bench.common import parse_cpu_list
    from bench.workloads import single, token_range_for

    pinning = pin_threads(args.threads, parse_cpu_list(args.cpus) if args.cpus else None)
    model_path = serving.resolve_model_path(args)
    low, high = token_range_for(model_path)
    prompt = single(prompt_len=args.prompt_len, vocab_low=low, vocab_high=high).requests[0].input_ids
    parts, layers_path = in_process(model_path, args.dtype, prompt, args.new_tokens, args.quantization)
    server = None
    if not args.skip_server:
        server = served(
            model_path,
            ["--device", "cpu", "--dtype", args.dtype, *flags]
            + (["--quantization", args.quantization] if args.quantization else []),
            prompt,
            args.new_tokens,
            args.repeat,
            pinning.child_env(),
        )
    machine = machine_info(pinning)
    rows = profile_rows(parts, layers_path, server)
    print_table(
        rows,
        [("component", "component"), ("ms", "ms a token"), ("share", "share")],
        title=f"one request's decode step ({machine.get('cpu_model')}, {pinning.num_threads} threads, {args.dtype})",
    )
    if server:
        cpu_rows = [
            {
                "mode": mode,
                "ms_per_token": server[mode]["ms_per_token"],
                "decode_ms": server[mode]["decode_ms_per_token"],
                **{f"cpu_{k}": v for k, v in server[mode]["cpu_ms_per_token"].items()},
            }
            for mode in ("whole", "stream")
        ]
        names = list(server["whole"]["cpu_ms_per_token"])
        print_table(
            cpu_rows,
            [
                ("mode", "served"),
                ("ms_per_token", "ms a token (with prefill)"),
                ("decode_ms", "decode ms a token"),
                *[(f"cpu_{n}", f"{n} CPU ms") for n in names],
            ],
            title="served: wall and each process's CPU time, per token",
        )
    out = write_json(
        args.output or default_output_path("decode_profile", args.dtype),
        {
            "kind": "decode_profile",
            "model_path": model_path,
            "dtype": args.dtype,
            "server_flags": flags,
            "layers_path": layers_path,
            "in_process_ms": parts,
            "server": server,
            "rows": rows,
            "machine": machine,
        },
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
