"""Drive a ``ModelRunner`` over given token sequences, without a scheduler: prefill each prompt, then
decode steps that append the tokens the caller chooses.

The KV-cache benchmarks need exactly this and no more: the quality guard feeds one fixed sequence
through several caches (teacher forcing: the caller picks every token), the speed benchmark times
decode steps after long prompts. What a scheduler adds (admission, eviction, radix reuse) would only
blur both. The runner's pools are this driver's while it lives: one ``req_to_token`` row per
sequence, KV slots handed out by a counter from slot 1 (slot 0 is the pool's padding slot), none
reused until ``close``. A hybrid sliding-window pool is not handled: load such a model with
``disable_hybrid_swa_memory=True`` (one full pool; the windowed layers still attend to their window).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def slots_needed(prompt_lens: Sequence[int], new_tokens: int) -> int:
    """KV slots a driver needs for these prompts and ``new_tokens`` decode steps each (the pool's
    ``max_total_tokens``)."""
    return sum(prompt_lens) + len(prompt_lens) * new_tokens


class SequenceDriver:
    """``prompts`` run through ``runner``: ``prefill`` once, then any number of ``decode`` steps."""

    def __init__(self, runner: Any, prompts: Sequence[Sequence[int]]) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every sequence needs a non-empty prompt")
        self.runner = runner
        self.prompts = [list(p) for p in prompts]
        rows = runner.req_to_token_pool.alloc(len(prompts))
        if rows is None:
            raise RuntimeError(f"the runner has fewer than {len(prompts)} request rows")
        self.rows: list[int] = list(rows)
        self.lens = [0] * len(prompts)  # tokens of each sequence whose K/V are in the pool
        self._next_slot = 1

    def close(self) -> None:
        """Free the request rows (the slots are the counter's: a new driver starts again at 1)."""
        if self.rows:
            self.runner.req_to_token_pool.free(self.rows)
        self.rows = []

    def __enter__(self) -> SequenceDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _slots(self, n: int) -> list[int]:
        start = self._next_slot
        self._next_slot += n
        if self._next_slot > self.runner.max_total_tokens + 1:
            raise RuntimeError(f"the KV pool ({self.runner.max_total_tokens} tokens) is too small for these sequences")
        return list(range(start, start + n))

    def _batch(self, which: Sequence[int], tokens: Sequence[Sequence[int]], decode: bool) -> Any:
        """A batch appending ``tokens[j]`` to sequence ``which[j]`` (each after its cached tokens)."""
        from runtime.engine.forward_batch import ForwardBatch, ForwardMode

        table = self.runner.req_to_token_pool
        ids: list[int] = []
        positions: list[int] = []
        locs: list[int] = []
        prefix_lens = [self.lens[i] for i in which]
        ext_lens = [len(t) for t in tokens]
        for i, new in zip(which, tokens):
            slots = self._slots(len(new))
            table.write(self.rows[i], self.lens[i], torch.tensor(slots, dtype=torch.int32))
            ids += new
            positions += range(self.lens[i], self.lens[i] + len(new))
            locs += slots
            self.lens[i] += len(new)
        seq_lens = [p + n for p, n in zip(prefix_lens, ext_lens)]
        device = self.runner.device

        def t(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.int64, device=device)

        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=t(ids),
            positions=t(positions),
            req_pool_indices=t([self.rows[i] for i in which]),
            seq_lens=t(seq_lens),
            prefix_lens=t(prefix_lens),
            extend_lens=t(ext_lens),
            out_cache_loc=t(locs),
            req_to_token_pool=table,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=ext_lens,
        )

    def prefill(self, chunk: int | None = None) -> torch.Tensor:
        """Run every prompt, one request at a time (a sequence's figures then do not depend on the
        others'), in extends of ``chunk`` tokens (None: whole; later chunks read the earlier ones from
        the cache, as the server's chunked prefill does). Returns each prompt's last-position logits,
        fp32 ``[sequences, vocab]``."""
        rows = []
        for i in range(len(self.prompts)):
            out = self._prefill_one(i, chunk)
            assert out.logits is not None, "a batch without sampling info returns its logits"
            rows.append(out.logits[-1])
        return torch.stack(rows)

    def _prefill_one(self, i: int, chunk: int | None) -> Any:
        if self.lens[i]:
            raise RuntimeError(f"sequence {i} is already prefilled")
        prompt = self.prompts[i]
        step = chunk or len(prompt)
        out = None
        for start in range(0, len(prompt), step):
            out = self.runner.forward(self._batch([i], [prompt[start : start + step]], decode=False))
        return out

    def decode(self, tokens: Sequence[int], which: Sequence[int] | None = None) -> Any:
        """One decode step: ``tokens[j]`` appended to sequence ``which[j]`` (default: every sequence,
        in order). Returns the runner's ``ModelOutput``: ``next_token_ids`` (greedy) and ``logits``
        (fp32 ``[len(tokens), vocab]``)."""
        which = list(range(len(self.prompts))) if which is None else list(which)
        if len(which) != len(tokens) or not which:
            raise ValueError("decode needs one token for each sequence it steps")
        if any(self.lens[i] == 0 for i in which):
            raise RuntimeError("prefill before decoding")
        return self.runner.forward(self._batch(which, [[t] for t in tokens], decode=True))
