"""Resident memory of each process of a tinyserve server: idle after start, at its peak under a
workload (the uniform 64-way load by default) and idle again after it, with what the KV pool
reserved (issue 47: "a quarter of the machine's RAM for a 135M model"; docs/serving.md, "KV pool
size").

    python -m bench.process_memory --device cpu                       # the default model
    python -m bench.process_memory --model bench --device cpu --max-total-tokens 65536
    python -m bench.process_memory --address tcp://127.0.0.1:30000    # a server on this host

Memory, unlike time, hardly depends on what else the machine runs, so these figures can be taken
on a busy machine. Each process (``server_info``'s ``processes``: launch, the schedulers, the
detokenizer, the tokenizer) is read from ``/proc/PID/status`` every ``--interval`` seconds while
the workload runs (sent as bench.serving sends it, after the same warm-up; the prefix cache is
flushed first): VmRSS, and of it RssAnon (heap: weights, the KV pool, activations) and RssFile
(mapped libraries and files). The server must run on this host. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, machine_info, print_table, write_json
from bench.load_runner import run_workload
from bench.serving import (
    ServerHandle,
    add_model_args,
    add_workload_args,
    build_workloads,
    flush_cache,
    resolve_model_path,
    server_for,
    warm_up,
)
from bench.workloads import Workload

FIELDS = ("VmRSS", "RssAnon", "RssFile")  # /proc/PID/status, kB there, MiB here
PHASES = ("idle", "peak", "after")


def read_rss(pid: int) -> dict[str, int] | None:
    """``FIELDS`` of ``pid`` in MiB; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0]) // 1024
    return out


def snapshot(pids: dict[str, int]) -> dict[str, dict[str, int]]:
    """Every process's ``read_rss`` by name (a process that is gone is left out)."""
    return {name: rss for name, pid in pids.items() if (rss := read_rss(pid)) is not None}


class PeakSampler:
    """The largest value of each field of each process, sampled on a thread until ``stop``: a
    peak under load is short (a prefill's activations), one snapshot would miss it."""

    def __init__(self, pids: dict[str, int], interval: float) -> None:
        self.pids, self.interval = pids, interval
        self.peak: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, rss in snapshot(self.pids).items():
                top = self.peak.setdefault(name, {})
                for key, value in rss.items():
                    top[key] = max(top.get(key, 0), value)
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def server_pids(handle: ServerHandle) -> tuple[dict[str, int], dict[str, Any]]:
    """The server's processes by name (``server_info``'s ``processes``) and its ``kv_pool``."""
    from runtime.client import Client

    with Client(handle.address, api_key=handle.api_key, timeout=60) as c:
        info = c.server_info()
    return {str(k): int(v) for k, v in (info.get("processes") or {}).items()}, info.get("kv_pool") or {}


def measure(handle: ServerHandle, workload: Workload, settle_s: float, interval: float) -> dict[str, Any]:
    """Idle, peak and after figures of every process for one run of ``workload``."""
    pids, kv_pool = server_pids(handle)
    if not pids or snapshot(pids) == {}:
        raise SystemExit("the server's processes are not on this host (or it does not list them)")
    time.sleep(settle_s)
    idle = snapshot(pids)
    flush_cache(handle.address, handle.api_key)
    via = {"api_key": handle.api_key, "show_progress": False}
    with PeakSampler(pids, interval) as sampler:
        warm_up(handle.address, handle.api_key, workload, -1)
        flush_cache(handle.address, handle.api_key)
        t0 = time.perf_counter()
        records, _ = run_workload(handle.address, workload, **via)
        elapsed = time.perf_counter() - t0
    time.sleep(settle_s)
    after = snapshot(pids)
    failed = sum(1 for r in records if r.error)
    return {
        "workload": {"name": workload.name, "params": workload.params},
        "kv_pool": kv_pool,
        "seconds": elapsed,
        "failed": failed,
        "rss_mib": {"idle": idle, "peak": sampler.peak, "after": after},
    }


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per process: VmRSS (RssAnon) at each phase."""
    rss = result["rss_mib"]
    rows = []
    for name in rss["idle"]:
        row: dict[str, Any] = {"process": name}
        for phase in PHASES:
            figures = rss[phase].get(name, {})
            row[phase] = f"{figures.get('VmRSS', '-')} ({figures.get('RssAnon', '-')})"
        rows.append(row)
    return rows


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
        epilog="Any other flag (e.g. --device cpu --max-total-tokens 65536) is passed to launch.py.",
    )
    parser.add_argument("--address", default=None, help="a running server on this host (default: start one)")
    parser.add_argument("--api-key", default=None)
    add_model_args(parser)
    add_workload_args(parser)
    parser.set_defaults(model="smollm2")  # the model, the server's default
    parser.add_argument("--settle", type=float, default=5.0, help="seconds idle before each idle figure")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples under load")
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/process_memory_*.json)")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args, server_flags = parse_args(argv)
    if len(args.workload) != 1:
        raise SystemExit("one --workload at a time: each run's after-figure is the next one's idle")
    model_path = None if args.address else resolve_model_path(args)
    with server_for(args.address, model_path, server_flags, args.api_key, None) as handle:
        (workload,) = build_workloads(args, handle.model_path, handle.vocab_size)
        result = measure(handle, workload, args.settle, args.interval)
        result["server_args"] = handle.server_args
    result["machine"] = machine_info()
    pool = result["kv_pool"]
    title = (
        f"resident MiB, VmRSS (RssAnon): {workload.name}, {result['seconds']:.1f} s, {result['failed']} failed; "
        f"KV pool {pool.get('tokens')} tokens, {(pool.get('bytes') or 0) / (1 << 30):.2f} GiB; "
        f"{result['machine']['cpu_model']}"
    )
    columns = [("process", "process"), *((p, p) for p in PHASES)]
    print_table(table_rows(result), columns, title=title)
    out = write_json(args.output or default_output_path("process_memory", workload.name), result)
    print(f"\nwrote {out}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
