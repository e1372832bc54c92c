"""Process helpers shared by launch.py and the child processes.

* The ready protocol: a child reports ``{"status": "ready", ...}`` or
  ``{"status": "error", "error": traceback}`` as msgspec-JSON bytes over its
  ``multiprocessing`` pipe (``send_bytes``/``recv_bytes`` only: no pickle on a pipe).
* ``run_child``: the spawn target that wraps every child's main function: logging,
  signals, death with the parent, and reporting a crash to the parent.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing.util
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, NoReturn

import msgspec

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def configure_logging(level: str, process_name: str) -> None:
    """Log to stderr with the process name, at ``level``; replaces earlier handlers."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {process_name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans even when the
    launcher itself is SIGKILLed). A no-op where prctl is unavailable."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def send_status(conn: Connection, status: dict[str, Any]) -> None:
    conn.send_bytes(msgspec.json.encode(status))


def recv_status(conn: Connection) -> dict[str, Any]:
    """Read one status message; a malformed one is reported as an error status."""
    raw = conn.recv_bytes()
    try:
        status = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return {"status": "error", "error": f"malformed status message ({exc}): {raw[:200]!r}"}
    if not isinstance(status, dict) or "status" not in status:
        return {"status": "error", "error": f"malformed status message: {raw[:200]!r}"}
    return status


def send_error(conn: Connection, error: str) -> None:
    try:
        send_status(conn, {"status": "error", "error": error})
    except (OSError, ValueError):  # the parent is gone or the pipe is closed
        pass


def run_child(name: str, log_level: str, ready_conn: Connection, target: str, *args: Any, **kwargs: Any) -> None:
    """Spawn target of every child: ``target(*args, ready_conn, **kwargs)`` with the process set up.

    ``target`` is "module:function", imported here in the child, so that the launcher
    never imports the children's heavy modules (torch) itself.

    SIGINT is ignored (a terminal's Ctrl-C reaches the whole process group; the
    launcher decides how to shut down and sends SIGTERM); SIGTERM exits with status 0. An exception escaping
    ``target`` is sent to the launcher as an error status and the child exits 1.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    die_with_parent()
    set_process_title(process_title(name))
    # The launcher's stdout carries exactly one line ("ready: ..."); whatever a child
    # prints (even from C code) goes to stderr with the logs.
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    configure_logging(log_level, name)
    try:
        module, _, func = target.partition(":")
        main: Callable[..., None] = getattr(importlib.import_module(module), func)
        main(*args, ready_conn, **kwargs)
    except SystemExit:
        raise
    except BaseException:
        error = traceback.format_exc()
        logging.getLogger(name).error("%s failed:\n%s", name, error)
        send_error(ready_conn, error)
        sys.exit(1)


def process_title(name: str) -> str:
    """What ``ps`` shows for child ``name``, in SGLang's style: ``scheduler-0`` ->
    ``tinyserve::scheduler_TP0``, ``scheduler-dp1-tp0`` -> ``tinyserve::scheduler_DP1_TP0``,
    ``dp-controller`` -> ``tinyserve::dp_controller``."""
    head, *ranks = name.split("-")
    if head == "scheduler":
        parts = [r.upper() for r in ranks] if len(ranks) > 1 else [f"TP{ranks[0]}"] if ranks else []
        return "tinyserve::" + "_".join([head, *parts])
    return "tinyserve::" + name.replace("-", "_")


def set_process_title(title: str) -> None:
    """Replace ``python -c "from multiprocessing.spawn ..."`` in ps/top with ``title``
    (no-op without setproctitle)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    exit_now()


def exit_now() -> NoReturn:
    """Exit 0 at once, after the multiprocessing finalizers (they unregister named
    semaphores, e.g. tqdm's lock, which would otherwise be reported as leaked). A full
    interpreter shutdown with torch loaded takes seconds and buys nothing here."""
    try:
        multiprocessing.util._run_finalizers()  # type: ignore[attr-defined]
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(0)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc); used by tests to find the server's processes."""
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may contain spaces; ppid follows it.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] != b"Z"
