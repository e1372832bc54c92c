"""A minimal driver for ModelRunner, used by tests until the scheduler exists.

It does what a scheduler does at its simplest: one ``req_to_token`` row per request,
KV slots handed out by a counter (never reused until ``reset``; a hybrid sliding-window pool's
windowed layers get the SWA slot of the same number), ForwardBatch building
for extend (optionally chunked, optionally after a shared prefix) and decode, and
greedy (or SamplingParams-driven) generation. No memory pressure, no eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from memory.swa_kv_pool import SWAKVPool
from runtime.engine.forward_batch import ForwardBatch, ForwardMode
from runtime.engine.model_runner import ModelOutput, ModelRunner
from runtime.engine.sampling.batch_info import SamplingBatchInfo
from runtime.protocol.sampling_params import SamplingParams


@dataclass
class HarnessRequest:
    rid: int
    req_pool_idx: int
    prompt_ids: list[int]
    sampling_params: SamplingParams | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per output token, when asked for
    slots: list[int] = field(default_factory=list)  # KV slot of token i (the first kv_len tokens)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are in the pool."""
        return len(self.slots)

    @property
    def pending(self) -> int:
        """Tokens not yet run through the model (the prompt's rest, or the last output token)."""
        return len(self.prompt_ids) + len(self.output_ids) - self.kv_len


class Harness:
    """Drives one ModelRunner. Owner of the runner's pools while tests use it."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.requests: list[HarnessRequest] = []
        self._next_slot = 1  # slot 0 is the pool's padding slot
        self._next_rid = 0

    # ---- memory ---------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request; all request rows and KV slots become free again."""
        for req in self.requests:
            self.runner.req_to_token_pool.free(req.req_pool_idx)
        self.requests = []
        self._next_slot = 1

    def alloc_slots(self, n: int) -> list[int]:
        end = self._next_slot + n
        if end > self.runner.max_total_tokens + 1:
            raise RuntimeError(f"harness ran out of KV slots ({self.runner.max_total_tokens}); call reset()")
        slots = list(range(self._next_slot, end))
        self._next_slot = end
        pool = self.runner.token_to_kv_pool
        if isinstance(pool, SWAKVPool):
            # windowed layers: each token keeps the SWA slot of its own number (never reused until reset)
            if end > pool.swa_size + 1:
                raise RuntimeError(f"harness ran out of SWA slots ({pool.swa_size}); call reset()")
            pool.full_to_swa[slots] = torch.tensor(slots, dtype=torch.int64, device=pool.device)
        return slots

    def add_request(self, prompt_ids: Sequence[int], sampling_params: SamplingParams | None = None) -> HarnessRequest:
        if not prompt_ids:
            raise ValueError("empty prompt")
        rows = self.runner.req_to_token_pool.alloc(1)
        if rows is None:
            raise RuntimeError("harness ran out of request rows; call reset()")
        req = HarnessRequest(self._next_rid, rows[0], list(prompt_ids), sampling_params)
        self._next_rid += 1
        self.requests.append(req)
        return req

    def prefill_sharing(self, prompts: Sequence[Sequence[int]], shared_prefix: int = 0) -> list[HarnessRequest]:
        """Add and prefill ``prompts`` whose first ``shared_prefix`` tokens are the same: the first
        prompt alone, then the others reusing its cached slots for those tokens (a radix hit)."""
        first = self.add_request(prompts[0])
        self.prefill([first])
        others = [self.add_request(p) for p in prompts[1:]]
        for other in others:
            if shared_prefix:
                self.share_prefix(first, other, shared_prefix)
        self.prefill(others)
        return [first] + others

    def share_prefix(self, src: HarnessRequest, dst: HarnessRequest, n: int) -> None:
        """Let ``dst`` reuse ``src``'s first ``n`` KV slots (their tokens must be equal)."""
        if dst.kv_len != 0 or n > src.kv_len or src.all_ids[:n] != dst.all_ids[:n]:
            raise ValueError("share_prefix needs a fresh dst whose first n tokens equal src's cached ones")
        dst.slots = src.slots[:n]
        self.runner.req_to_token_pool.write(dst.req_pool_idx, 0, torch.tensor(dst.slots, dtype=torch.int32))

    # ---- batches --------------------------------------------------------------------

    def build_batch(
        self,
        reqs: Sequence[HarnessRequest],
        mode: ForwardMode,
        max_new: int | None = None,
        return_logprob: bool = False,
    ) -> tuple[ForwardBatch, list[int]]:
        """A ForwardBatch running up to ``max_new`` pending tokens of each request.

        Allocates the new tokens' KV slots and writes them into req_to_token. Returns the
        batch and how many tokens of each request it runs.
        """
        device = self.runner.device
        ids: list[int] = []
        positions: list[int] = []
        locs: list[int] = []
        counts: list[int] = []
        prefix_lens: list[int] = []
        for req in reqs:
            n = req.pending if max_new is None else min(req.pending, max_new)
            if n <= 0:
                raise ValueError(f"request {req.rid} has nothing to run")
            if mode.is_decode() and n != 1:
                raise ValueError(f"decode needs exactly one pending token, request {req.rid} has {n}")
            start = req.kv_len
            new_slots = self.alloc_slots(n)
            self.runner.req_to_token_pool.write(req.req_pool_idx, start, torch.tensor(new_slots, dtype=torch.int32))
            ids.extend(req.all_ids[start : start + n])
            positions.extend(range(start, start + n))
            locs.extend(new_slots)
            counts.append(n)
            prefix_lens.append(start)
            req.slots.extend(new_slots)
        seq_lens = [p + c for p, c in zip(prefix_lens, counts)]
        info = None
        if any(r.sampling_params is not None for r in reqs):
            info = SamplingBatchInfo.from_requests(
                [r.sampling_params or SamplingParams(temperature=0.0) for r in reqs],
                [r.prompt_ids for r in reqs],
                [r.output_ids for r in reqs],
                self.runner.vocab_size,
                self.runner.eos_token_ids,
                device,
            )

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        batch = ForwardBatch(
            forward_mode=mode,
            input_ids=t(ids),
            positions=t(positions),
            req_pool_indices=t([r.req_pool_idx for r in reqs]),
            seq_lens=t(seq_lens),
            prefix_lens=t(prefix_lens),
            extend_lens=t(counts),
            out_cache_loc=t(locs),
            req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=counts,
            sampling_info=info,
            return_logprob=return_logprob,
        )
        return batch, counts

    def step(
        self,
        reqs: Sequence[HarnessRequest],
        mode: ForwardMode = ForwardMode.EXTEND,
        max_new: int | None = None,
        return_logprob: bool = False,
    ) -> ModelOutput:
        """Run one forward; requests that caught up with their tokens get the sampled token."""
        batch, _ = self.build_batch(reqs, mode, max_new, return_logprob)
        out = self.runner.forward(batch)
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        for i, req in enumerate(reqs):
            if req.pending == 0:  # the whole sequence is cached: this token is real output
                req.output_ids.append(int(next_ids[i]))
                if logprobs is not None:
                    req.logprobs.append(float(logprobs[i]))
        return out

    def prefill(
        self, reqs: Sequence[HarnessRequest], chunk_size: int | None = None, return_logprob: bool = False
    ) -> None:
        """Extend every request through its prompt, ``chunk_size`` tokens per request per forward."""
        while True:
            todo = [r for r in reqs if r.pending > 0 and not r.output_ids]
            if not todo:
                return
            self.step(todo, ForwardMode.EXTEND, chunk_size, return_logprob)

    def decode(self, reqs: Sequence[HarnessRequest], steps: int, return_logprob: bool = False) -> None:
        for _ in range(steps):
            self.step(reqs, ForwardMode.DECODE, None, return_logprob)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        chunk_size: int | None = None,
        return_logprob: bool = False,
        sampling_params: Sequence[SamplingParams | None] | None = None,
    ) -> list[HarnessRequest]:
        """Prefill all prompts as one batch (chunked if asked), then decode them together.

        Runs exactly ``max_new_tokens`` tokens per request (no EOS stop), as in
        ``transformers.generate`` with EOS disabled.
        """
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        params = list(sampling_params) if sampling_params is not None else [None] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.prefill(reqs, chunk_size, return_logprob)
        self.decode(reqs, max_new_tokens - 1, return_logprob)
        return reqs
