"""The "parallelism" flags: tensor-parallel ranks, data-parallel replicas and how requests are
spread over them, which GPUs a node uses, and the multi-node rendezvous."""

from __future__ import annotations

import argparse
from typing import Protocol

from runtime.config.flag_checks import choice

LOAD_BALANCE_CHOICES = ("round_robin", "shortest_queue", "cache_aware")


class ParallelFlags(Protocol):
    """The ``ServerArgs`` fields of this group (a protocol, so that this module need not import
    ``runtime.config.server_args``, which imports it)."""

    tp_size: int
    ep_size: int
    dp_size: int
    load_balance_method: str
    base_gpu_id: int
    gpu_id_step: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None


def add_parallel_args(parser: argparse.ArgumentParser, defaults: ParallelFlags) -> None:
    """The "parallelism" group; ``defaults`` is a default ``ServerArgs``."""
    d = defaults
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tp-size", type=int, default=d.tp_size, help=f"tensor-parallel ranks (default {d.tp_size})")
    g.add_argument(
        "--ep-size",
        type=int,
        default=d.ep_size,
        help="expert-parallel ranks of a mixture of experts: the --tp-size ranks form this many groups, "
        f"each holding whole experts (a divisor of --tp-size; default {d.ep_size}: every rank holds a "
        "slice of every expert)",
    )
    g.add_argument("--dp-size", type=int, default=d.dp_size, help=f"data-parallel replicas (default {d.dp_size})")
    g.add_argument(
        "--load-balance-method",
        type=str,
        default=d.load_balance_method,
        choices=LOAD_BALANCE_CHOICES,
        help=f"how the DP controller picks a replica (default {d.load_balance_method})",
    )
    g.add_argument(
        "--base-gpu-id", type=int, default=d.base_gpu_id, help=f"first GPU used by this node (default {d.base_gpu_id})"
    )
    g.add_argument(
        "--gpu-id-step",
        type=int,
        default=d.gpu_id_step,
        help=f"distance between the GPUs of consecutive ranks (default {d.gpu_id_step})",
    )
    g.add_argument("--nnodes", type=int, default=d.nnodes, help=f"number of nodes (default {d.nnodes})")
    g.add_argument(
        "--node-rank", type=int, default=d.node_rank, help=f"rank of this node, in [0, nnodes) (default {d.node_rank})"
    )
    g.add_argument(
        "--dist-init-addr",
        type=str,
        default=d.dist_init_addr,
        help="HOST:PORT of the torch.distributed rendezvous (required when --nnodes > 1)",
    )


def check_load_balance_method(args: ParallelFlags) -> None:
    """--load-balance-method names a policy the DP controller has."""
    choice("--load-balance-method", args.load_balance_method, LOAD_BALANCE_CHOICES)


def check_topology(args: ParallelFlags) -> None:
    """The ranks must tile the nodes and every node must find the rendezvous: a mistake here
    would otherwise hang torch.distributed's start-up instead of failing."""
    if args.base_gpu_id < 0:
        raise ValueError(f"--base-gpu-id must be >= 0, got {args.base_gpu_id}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes={args.nnodes}), got {args.node_rank}")
    if args.tp_size % args.ep_size:
        raise ValueError(f"--ep-size ({args.ep_size}) must divide --tp-size ({args.tp_size})")
    if args.tp_size % args.nnodes:
        raise ValueError(f"--tp-size ({args.tp_size}) must be a multiple of --nnodes ({args.nnodes})")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("--dist-init-addr HOST:PORT is required when --nnodes > 1")
    if args.dist_init_addr is not None:
        host, sep, port = args.dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {args.dist_init_addr!r}")
