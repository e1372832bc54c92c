"""``PortArgs``: the endpoints between the server's processes (ipc sockets in one private
directory, and the torch.distributed rendezvous of each tensor-parallel group)."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field

from runtime.config.args import ServerArgs

# Unix socket paths are limited to 108 bytes (sun_path) including the terminator.
_MAX_IPC_PATH = 107
_IPC_SUFFIX_LEN = len("/tinyserve-XXXXXXXX/detokenizer")  # what create() appends to the base


@dataclass
class PortArgs:
    """The endpoints between the processes: ipc sockets inside one private directory,
    and the torch.distributed rendezvous of each tensor-parallel group.

    The directory is created with mode 0700 (only this user can connect to the
    sockets) and removed at exit by whoever called ``create`` (``launch.py``).
    """

    ipc_dir: str
    tokenizer_ipc: str  # detokenizer -> tokenizer (the tokenizer binds a PULL)
    scheduler_input_ipc: str  # tokenizer -> scheduler rank 0, or the DP controller (binds a PULL)
    detokenizer_ipc: str  # scheduler(s) -> detokenizer (the detokenizer binds a PULL)
    dp_controller_ipc: str = ""  # DP replicas -> DP controller (the controller binds a PULL)
    dp_scheduler_input_ipcs: list[str] = field(default_factory=list)  # DP controller -> replica i
    dist_init_addrs: list[str] = field(default_factory=list)  # per DP group: tcp://host:port rendezvous
    _owner_pid: int = field(default=0, repr=False)

    @classmethod
    def create(cls, server_args: ServerArgs | None = None) -> "PortArgs":
        """Make the private directory and name every endpoint for ``server_args``'s layout."""
        sa = server_args or ServerArgs()
        base = tempfile.gettempdir()
        if len(base.encode()) + _IPC_SUFFIX_LEN > _MAX_IPC_PATH:
            base = "/tmp"
        ipc_dir = tempfile.mkdtemp(prefix="tinyserve-", dir=base)
        os.chmod(ipc_dir, 0o700)
        dp = sa.dp_size > 1
        args = cls(
            ipc_dir=ipc_dir,
            tokenizer_ipc=f"ipc://{ipc_dir}/tokenizer",
            scheduler_input_ipc=f"ipc://{ipc_dir}/scheduler",
            detokenizer_ipc=f"ipc://{ipc_dir}/detokenizer",
            dp_controller_ipc=f"ipc://{ipc_dir}/dpctl" if dp else "",
            dp_scheduler_input_ipcs=[f"ipc://{ipc_dir}/dp{i}" for i in range(sa.dp_size)] if dp else [],
            dist_init_addrs=_dist_init_addrs(sa),
            _owner_pid=os.getpid(),
        )
        atexit.register(args.cleanup)
        return args

    def dist_init_method(self, dp_rank: int = 0) -> str:
        """``tcp://host:port`` where the TP ranks of DP group ``dp_rank`` meet."""
        if dp_rank >= len(self.dist_init_addrs):
            raise ValueError(f"no rendezvous address for DP group {dp_rank} (is --tp-size > 1?)")
        return self.dist_init_addrs[dp_rank]

    def cleanup(self) -> None:
        """Remove the ipc directory; only the creating process does (children share the object)."""
        if self._owner_pid == os.getpid():
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _dist_init_addrs(sa: ServerArgs) -> list[str]:
    """One rendezvous per DP group: from --dist-init-addr (port + group index, so that every
    node derives the same ones), else free local ports. Empty without tensor parallelism."""
    if sa.tp_size == 1 and sa.dist_init_addr is None:
        return []
    if sa.dist_init_addr is not None:
        host, _, port = sa.dist_init_addr.rpartition(":")
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return [f"tcp://{host}:{int(port) + i}" for i in range(sa.dp_size)]
    return [f"tcp://127.0.0.1:{_free_port()}" for _ in range(sa.dp_size)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
