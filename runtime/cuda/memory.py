"""What serving on a GPU assumes about memory: the KV pool takes what is left of a fraction of
the GPU's memory after everything this process already holds (the weights), and decode may run
in captured CUDA graphs (``runtime.cuda.graph_runner``)."""

from __future__ import annotations

import torch

from runtime.platform import ServingPlatform

GPU_DEFAULT_MEM_FRACTION = 0.8


def gpu_budget_bytes(device: torch.device, fraction: float) -> float:
    """Bytes the KV pools may take: everything this process holds after them may use at most
    ``fraction`` of the GPU's memory."""
    free, total = torch.cuda.mem_get_info(device)
    return free - total * (1.0 - fraction)


CUDA_PLATFORM = ServingPlatform(
    mem_fraction=GPU_DEFAULT_MEM_FRACTION,
    max_total_tokens=None,
    warn_over_budget=True,
    budget_bytes=gpu_budget_bytes,
    cuda_graphs=True,
)
