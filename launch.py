"""CLI entry point: parse flags, spawn the processes, wait until they are ready, supervise.

    python launch.py [flags]          # see --help; prints "http: http://HOST:PORT" (the
                                      # HTTP server) then "ready: tcp://HOST:PORT (KV pool: ...)"
                                      # (ZMQ, then what the KV pools reserved: parse_ready_line)

Processes (docs/architecture.md), all children of this one, started with "spawn":
  scheduler-0..tp-1    one per TP rank (only rank 0 owns sockets); with --dp-size N,
                       scheduler-dp{d}-tp{r} for each replica d, and a dp-controller;
  detokenizer, tokenizer (the ZMQ and HTTP front doors).
Each child's process title (``ps``) is ``tinyserve::NAME`` (runtime.protocol.child_process.process_title).
With --nnodes > 1, node k runs its share of the TP ranks; only node 0 runs the
tokenizer, detokenizer and DP controller (and prints the client address).
Each child reports on its pipe (msgspec-JSON bytes): {"status": "ready", ...} or
{"status": "error", "error": traceback}. The tokenizer is told the scheduler's
figures (vocab size, context length) once the lead scheduler (dp 0, tp 0) is ready.

Supervision: if any child dies or reports an error, every child is stopped and this
process exits 1 with that child's error (a scheduler whose step outran --watchdog-timeout
exits 3: scheduler_proc/watchdog.py), so a supervisor above it can restart the server.
SIGINT stops every child and exits 0. SIGTERM on a serving server starts a graceful
drain (--graceful-shutdown-timeout; the tokenizer's, tokenizer_proc/drain.py, started with
SIGUSR1): the tokenizer reports {"status": "drained"} when nothing is left in flight, and
every child is stopped, exit 0; a second SIGTERM, SIGINT, or the timeout (plus a margin)
stops at once.
Before any child starts, the serving device's environment defaults (``ServingPlatform.process_env``;
on CPU the OpenMP wait policy, runtime/engine/cpu/process_env.py) are set here for the children to
inherit, unless the environment already sets them.
The ipc directory is removed on every exit path. Children die with this process
even when it is SIGKILLed (PR_SET_PDEATHSIG).

Tests (and notebooks in a source checkout) start it in a subprocess through
``tests/support/server_process.py``, which reads the two lines above (``parse_ready_line``).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Sequence

from runtime.checkpoints.gguf.reader import GGUFError
from runtime.checkpoints.hub import HubError
from runtime.checkpoints.model_source import DEFAULT_MODEL, ModelSourceError, checkpoint_folder, has_tokenizer
from runtime.checkpoints.pooling import PoolingError, pooling_of
from runtime.config.args import ServerArgs
from runtime.config.port_args import PortArgs
from runtime.engine.config_reading import UnsupportedModelError
from runtime.engine.kv_sizing import READY_NOTE_PREFIX, host_kv_pool, ready_note
from runtime.engine.model_config import ModelConfig
from runtime.protocol.child_process import configure_logging, recv_status, run_child, send_status

logger = logging.getLogger("launch")

STOP_GRACE_S = 5.0  # SIGTERM -> SIGKILL delay when stopping children
DRAIN_MARGIN_S = 5.0  # past --graceful-shutdown-timeout, for the tokenizer to abort the rest and report
READY_PREFIX = "ready: "
HTTP_PREFIX = "http: "  # printed just before the ready line
EMBEDDING_NOTE_PREFIX = " (embeddings: "  # an embedding server's ready line: its pooling rule, last


def parse_ready_line(line: str) -> str | None:
    """The client address of a ``ready:`` line (what ``main`` prints: the address, then the KV
    pools' note, ``kv_sizing.ready_note``), or None for any other line."""
    if not line.startswith(READY_PREFIX):
        return None
    return line[len(READY_PREFIX) :].partition(READY_NOTE_PREFIX)[0].partition(EMBEDDING_NOTE_PREFIX)[0].strip()


@dataclass
class Child:
    name: str
    process: multiprocessing.process.BaseProcess
    conn: Connection  # the parent's end of the status pipe
    ready: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # its ready status
    drained: bool = False  # it reported a finished graceful drain: its exit is the stop, not a failure


class ChildFailed(Exception):
    def __init__(self, name: str, error: str) -> None:
        super().__init__(f"{name}: {error}")
        self.name = name
        self.error = error


class Supervisor:
    """Owns the child processes from spawn to stop."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs) -> None:
        self.server_args = server_args
        self.port_args = port_args
        self.ctx = multiprocessing.get_context("spawn")
        self.children: list[Child] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._wake_open = True  # the signal handler writes to the pipe only while open
        self.stop_requested = False
        self.drain_deadline: float | None = None  # monotonic; set while a SIGTERM drain runs

    # ------------------------------------------------------------------ signals

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: Any) -> None:
            if signum == signal.SIGTERM and self.drain_deadline is None and self._can_drain():
                # The first SIGTERM of a serving node 0: a graceful drain in the tokenizer
                # (tokenizer_proc/drain.py), which reports "drained" when it is done.
                logger.info(
                    "received SIGTERM; draining for up to %.0f s (again to stop at once)",
                    self.server_args.graceful_shutdown_timeout,
                )
                self.drain_deadline = time.monotonic() + self.server_args.graceful_shutdown_timeout + DRAIN_MARGIN_S
                tokenizer_pid = self.child("tokenizer").process.pid
                assert tokenizer_pid is not None  # (spawn records a child only once its process started)
                os.kill(tokenizer_pid, signal.SIGUSR1)
            else:
                if not self.stop_requested:
                    logger.info("received %s; shutting down", signal.Signals(signum).name)
                self.stop_requested = True
            if self._wake_open:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def _can_drain(self) -> bool:
        """A drain needs a graceful-shutdown timeout and a serving tokenizer (node 0, every child
        ready); before that, or on the other nodes, SIGTERM stops at once."""
        return (
            self.server_args.graceful_shutdown_timeout > 0
            and self.server_args.node_rank == 0
            and bool(self.children)
            and all(c.ready for c in self.children)
        )

    # ------------------------------------------------------------------ spawn

    def spawn(self, name: str, target: str, *args: Any, **kwargs: Any) -> Child:
        """Start ``target`` ("module:function") as child ``name``: ``target(*args, ready_conn, **kwargs)``."""
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        process = self.ctx.Process(
            target=run_child,
            name=name,
            args=(name, self.server_args.log_level, child_conn, target, *args),
            kwargs=kwargs,
        )
        process.start()
        child_conn.close()  # the child holds the only other end: EOF means it died
        child = Child(name=name, process=process, conn=parent_conn)
        self.children.append(child)
        logger.debug("started %s (pid %s)", name, process.pid)
        return child

    def start_all(self) -> None:
        sa, pa = self.server_args, self.port_args
        ranks_per_node = sa.tp_size // sa.nnodes
        local_ranks = range(sa.node_rank * ranks_per_node, (sa.node_rank + 1) * ranks_per_node)
        for dp_rank in range(sa.dp_size):
            for tp_rank in local_ranks:
                self.spawn(
                    scheduler_name(sa, dp_rank, tp_rank),
                    "scheduler_proc.scheduler_process:run_scheduler_process",
                    sa,
                    pa,
                    tp_rank,
                    dp_rank=dp_rank,
                )
        if sa.node_rank != 0:
            return  # the other nodes only contribute TP ranks
        if sa.dp_size > 1:
            self.spawn("dp-controller", "scheduler_proc.dp_controller:run_dp_controller_process", sa, pa)
        self.spawn("detokenizer", "detokenizer_proc.detokenizer_manager:run_detokenizer_process", sa, pa)
        self.spawn("tokenizer", "tokenizer_proc.process:run_tokenizer_process", sa, pa)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    # ------------------------------------------------------------------ events

    def wait_event(self, timeout: float | None = None) -> None:
        """Block until a child writes, a child exits, or a signal arrives; handle it.

        Raises ChildFailed for an error status or an unexpected exit."""
        objs: list[Any] = [self._wake_r]
        objs += [c.conn for c in self.children]
        objs += [c.process.sentinel for c in self.children]
        ready = multiprocessing.connection.wait(objs, timeout)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        for child in self.children:
            if child.conn in ready:
                self._on_status(child)
        for child in self.children:
            if child.process.sentinel in ready and not child.drained:
                child.process.join(0.1)
                raise ChildFailed(
                    child.name,
                    f"exited with code {child.process.exitcode}{' before becoming ready' if not child.ready else ''}",
                )

    def _on_status(self, child: Child) -> None:
        if child.drained:
            return  # it is exiting after its drain: its pipe closes next
        try:
            status = recv_status(child.conn)
        except (EOFError, OSError):
            child.process.join(STOP_GRACE_S)
            raise ChildFailed(
                child.name,
                f"exited with code {child.process.exitcode}{' before becoming ready' if not child.ready else ''}",
            ) from None
        if status.get("status") == "error":
            raise ChildFailed(child.name, str(status.get("error")))
        if status.get("status") == "drained":  # a graceful drain (SIGTERM or POST /drain) is done
            logger.info("%s drained; stopping the server", child.name)
            child.drained = True
            self.stop_requested = True
            return
        if status.get("status") != "ready" or child.ready:
            logger.warning("ignoring an unexpected status from %s: %s", child.name, status)
            return
        child.ready = True
        child.info = status
        logger.debug("%s is ready: %s", child.name, status)
        if child.name == scheduler_name(self.server_args, 0, 0) and self.server_args.node_rank == 0:
            # The tokenizer waits for the scheduler's figures before it serves.
            try:
                processes = {c.name: c.process.pid for c in self.children}
                processes["launch"] = os.getpid()
                send_status(
                    self.child("tokenizer").conn, {**status, "status": "scheduler_ready", "processes": processes}
                )
            except OSError:
                pass  # the tokenizer died; its sentinel reports it

    def wait_ready(self) -> str | None:
        """Wait until every child is ready; the client address (on other nodes than 0: a
        description of this node), or None on a stop signal."""
        while not all(c.ready for c in self.children):
            if self.stop_requested:
                return None
            self.wait_event()
        if self.server_args.node_rank != 0:
            return f"node {self.server_args.node_rank} of {self.server_args.nnodes} (scheduler ranks only)"
        return str(self.child("tokenizer").info["address"])

    def kv_pool_note(self) -> str:
        """What this host's schedulers reserved for KV, for the ready line (``kv_sizing.ready_note``)."""
        replicas: dict[int, list[dict[str, Any]]] = {}
        for c in self.children:
            pool = c.info.get("kv_pool")
            if c.name.startswith("scheduler") and pool:
                replicas.setdefault(int(c.info.get("dp_rank", 0)), []).append(pool)
        return ready_note(host_kv_pool(replicas))

    def http_address(self) -> str | None:
        """The HTTP server's ``http://HOST:PORT`` (node 0, once ready)."""
        if self.server_args.node_rank != 0:
            return None
        address = self.child("tokenizer").info.get("http_address")
        return str(address) if address else None

    def supervise(self) -> None:
        """Return on a stop signal or a finished drain; raise ChildFailed when a child fails."""
        while not self.stop_requested:
            if self.drain_deadline is None:
                self.wait_event()
                continue
            left = self.drain_deadline - time.monotonic()
            if left <= 0:
                logger.warning("the drain did not finish in time; stopping at once")
                return
            self.wait_event(left)

    # ------------------------------------------------------------------ stop

    def stop_all(self) -> None:
        """SIGTERM every live child (tokenizer first: no new work), SIGKILL stragglers."""
        for child in reversed(self.children):
            if child.process.is_alive():
                child.process.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children:
            child.process.join(max(deadline - time.monotonic(), 0.0))
        for child in self.children:
            if child.process.is_alive():
                logger.warning("%s did not stop within %.0f s; killing it", child.name, STOP_GRACE_S)
                child.process.kill()
                child.process.join(STOP_GRACE_S)
        for child in self.children:
            child.conn.close()
        self._wake_open = False
        os.close(self._wake_r)
        os.close(self._wake_w)


def resolve_paths(server_args: ServerArgs) -> ServerArgs:
    """Local checkpoint folders for --model-path and --tokenizer-path, made once here before
    any child looks for them (runtime.checkpoints.model_source: the default model, named models, GGUF
    files, hub ids). The served model name defaults to --model-path as given, or the default
    model's name."""
    sa = server_args
    model_path = str(checkpoint_folder(sa.model_path, sa.revision))
    tokenizer_path = sa.tokenizer_path
    if tokenizer_path is not None:
        tokenizer_path = str(checkpoint_folder(tokenizer_path, sa.revision, need_weights=False))
    elif not has_tokenizer(model_path):
        raise ModelSourceError(f"{sa.model_path or model_path} has no tokenizer; give --tokenizer-path one")
    served = sa.served_model_name
    return dataclasses.replace(
        sa,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        served_model_name=served if served is not None else sa.model_path or DEFAULT_MODEL,
    )


def check_model(server_args: ServerArgs) -> str:
    """UnsupportedModelError (naming the supported architectures) for a checkpoint no family
    serves, or whose experts ``--ep-size`` cannot split, or an encoder without ``--is-embedding``,
    before any child starts: reading its config needs no torch. Returns the ready line's note of an
    embedding server (its pooling rule; PoolingError for one its files ask for and nothing serves)."""
    folder = server_args.resolved_model_path()
    ModelConfig.from_pretrained(folder, ep_size=server_args.ep_size)
    pooling = pooling_of(folder, server_args.pooling)
    if not server_args.is_embedding:
        if pooling.encoder:
            raise UnsupportedModelError(
                f"{server_args.served_model_name or folder} is an encoder: it serves embeddings and scores "
                "only; start it with --is-embedding"
            )
        return ""
    return f"{EMBEDDING_NOTE_PREFIX}{pooling.describe()})"


def apply_platform_env(server_args: ServerArgs) -> dict[str, str]:
    """Put the serving device's environment defaults (``ServingPlatform.process_env``: the CPU's
    OpenMP wait) into this process's environment, which every child inherits; the libraries read
    them as they load, so this runs before any child starts. They are one setting: where the user
    set any of the variables, none is applied. Returns what was set.

    ``--device cpu`` reads the CPU's defaults from a module without torch (the same tuple as
    ``CPU_PLATFORM.process_env``), so that this process does not spend seconds of a core importing
    torch before the children can start; other devices are resolved through the ops seam."""
    if server_args.device == "cpu":
        from runtime.engine.cpu.process_env import CPU_OPENMP_ENV

        defaults = dict(CPU_OPENMP_ENV)
    else:
        import torch

        from runtime.engine.device import resolve_device
        from runtime.engine.ops import get_ops

        device = resolve_device(server_args.device)
        defaults = dict(get_ops(device, torch.float32).platform(device).process_env)
    if any(key in os.environ for key in defaults):
        return {}
    os.environ.update(defaults)
    return defaults


def scheduler_name(server_args: ServerArgs, dp_rank: int, tp_rank: int) -> str:
    return f"scheduler-{tp_rank}" if server_args.dp_size == 1 else f"scheduler-dp{dp_rank}-tp{tp_rank}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run a server until SIGINT/SIGTERM (0) or a child failure (1)."""
    server_args = ServerArgs.from_cli(argv)
    configure_logging(server_args.log_level, "launch")
    try:
        server_args = resolve_paths(server_args)
        embedding_note = check_model(server_args)
    except (
        HubError,
        GGUFError,
        ModelSourceError,
        UnsupportedModelError,
        PoolingError,
        OSError,
    ) as exc:  # OSError: unreadable
        logger.error("%s", exc)
        return 1
    applied = apply_platform_env(server_args)
    if applied:
        logger.info("environment for the serving processes: %s", " ".join(f"{k}={v}" for k, v in applied.items()))
    port_args = PortArgs.create(server_args)
    supervisor = Supervisor(server_args, port_args)
    supervisor.install_signal_handlers()
    try:
        supervisor.start_all()
        address = supervisor.wait_ready()
        if address is None:
            return 0
        http = supervisor.http_address()
        if http is not None:
            print(f"{HTTP_PREFIX}{http}", flush=True)
        note = supervisor.kv_pool_note() + embedding_note
        print(f"{READY_PREFIX}{address}{note}", flush=True)
        logger.info("serving on %s%s", address, note)
        supervisor.supervise()
        return 0
    except ChildFailed as exc:
        logger.error("%s failed; stopping the server:\n%s", exc.name, exc.error)
        return 1
    finally:
        supervisor.stop_all()
        port_args.cleanup()


if __name__ == "__main__":
    sys.exit(main())
