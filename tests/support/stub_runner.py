"""StubModelRunner: a ModelRunner stand-in that answers instantly, for scheduler tests and benchmarks.

It keeps the real memory contract: each new token's id is written into its KV
slot, and the next token is a hash of the whole sequence *read back through
req_to_token*. So a scheduler that maps a slot wrongly, frees a slot still in
use or loses a prefix produces different tokens than a clean run would, while
the result never depends on batch composition, chunking or cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memory.kv_pool import MHATokenToKVPool
from memory.req_to_token_pool import ReqToTokenPool
from runtime.engine.forward_batch import ForwardBatch, ForwardMode

_HASH_MUL = 1_000_003


@dataclass
class StubOutput:
    next_token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


def reference_next_token(tokens: list[int], vocab_size: int, avoid: set[int]) -> int:
    """What the stub predicts after ``tokens`` (the same formula, on a plain list)."""
    h = 0
    for t in tokens:
        h = (h * _HASH_MUL + t + 1) % (2**31 - 1)
    token = h % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


class StubModelRunner:
    def __init__(
        self,
        max_total_tokens: int = 4096,
        vocab_size: int = 1000,
        context_len: int = 2048,
        max_running_requests: int = 256,
        page_size: int = 1,
        eos_token_ids: tuple[int, ...] = (0,),
        verify_kv: bool = True,
        history: int | None = None,
        rope_switch_len: int | None = None,
    ) -> None:
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.eos_token_ids = list(eos_token_ids)
        # A LongRoPE-like switch for the scheduler's rules (the stub's tokens ignore it).
        self.rope_switch_len = rope_switch_len
        self.verify_kv = verify_kv
        # The next token hashes only the last ``history`` tokens (None: all): a small history makes
        # outputs that repeat, which n-gram drafts predict (speculative decoding's tests).
        self.history = history
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 1, context_len + 8, self.device)
        # One layer, one head, head_dim 1: the "KV" of a token is its id (exact in float64).
        self.token_to_kv_pool = MHATokenToKVPool(max_total_tokens, page_size, torch.float64, 1, 1, 1, self.device)
        self.num_forwards = 0

    def forward(self, batch: ForwardBatch) -> StubOutput:
        self.num_forwards += 1
        k, _ = self.token_to_kv_pool.get_kv_buffer(0)
        k[batch.out_cache_loc, 0, 0] = batch.input_ids.to(torch.float64)
        avoid = set(self.eos_token_ids)
        if not self.verify_kv:
            last = batch.input_ids[batch.last_token_indices()]
            ids = [
                reference_next_token([t, s], self.vocab_size, avoid) for t, s in zip(last.tolist(), batch.seq_lens_cpu)
            ]
            return StubOutput(torch.tensor(ids, dtype=torch.int64))
        table = self.req_to_token_pool.req_to_token
        ids = []
        verify = batch.forward_mode == ForwardMode.VERIFY  # (a sample after every token)
        for row, seq_len, new in zip(batch.req_pool_indices.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu):
            for end in range(seq_len - new + 1 if verify else seq_len, seq_len + 1):
                slots = table[row, :end].to(torch.int64)
                tokens = k[slots, 0, 0].to(torch.int64).tolist()
                ids.append(
                    reference_next_token(tokens[-self.history :] if self.history else tokens, self.vocab_size, avoid)
                )
        return StubOutput(torch.tensor(ids, dtype=torch.int64))
