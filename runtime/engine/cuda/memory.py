"""What serving on a GPU assumes about memory: the KV pool takes what is left of a fraction of
the GPU's memory after everything this process already holds (the weights), and decode may run
in captured CUDA graphs (``runtime.engine.cuda.graph_runner``)."""

from __future__ import annotations

import torch

from runtime.engine.platform import ServingPlatform

GPU_DEFAULT_MEM_FRACTION = 0.8


def gpu_budget_bytes(device: torch.device, fraction: float, weight_bytes: int = 0, ranks: int = 1) -> float:
    """Bytes the KV pools may take: everything this process holds after them may use at most
    ``fraction`` of the GPU's memory. (The free memory already counts the weights, and each rank
    has a GPU of its own: ``weight_bytes`` and ``ranks`` do not enter.)"""
    free, total = torch.cuda.mem_get_info(device)
    return free - total * (1.0 - fraction)


CUDA_PLATFORM = ServingPlatform(
    mem_fraction=GPU_DEFAULT_MEM_FRACTION,
    warn_over_budget=True,
    budget_bytes=gpu_budget_bytes,
    demand_tokens=None,
    ram_bytes=None,
    cuda_graphs=True,
)
