"""ReqToTokenPool: maps a request slot to the KV-pool slots of its tokens.

Owner: the scheduler allocates one row per running request; the row's first
``seq_len`` entries are the KV slot indices of that request's tokens. The table
lives on the model's device so attention kernels can read it directly.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A fixed table ``req_to_token[size, max_context_len]`` (int32) plus a free list."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device) -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size}, {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int = 1) -> list[int] | None:
        """Take ``n`` request slots, or return None (and change nothing) when short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} request slots")
        if n > len(self.free_slots):
            return None
        taken, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return taken

    def free(self, idx: int | list[int]) -> None:
        indices = [idx] if isinstance(idx, int) else list(idx)
        for i in indices:
            if not 0 <= i < self.size:
                raise ValueError(f"request slot {i} is outside [0, {self.size})")
        self.free_slots.extend(indices)

    def write(self, req_idx: int, start: int, values: torch.Tensor) -> None:
        """Store KV slot indices for tokens ``start .. start+len(values)`` of a request."""
        self.req_to_token[req_idx, start : start + values.numel()] = values.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))
