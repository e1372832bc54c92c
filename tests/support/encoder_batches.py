"""Packed encoder batches for tests: what the scheduler hands an encoder's forward at its simplest.

An encoder's forward reads no KV (``AttentionBackend.forward_encoder``), so a batch here takes no KV
slots: every request is whole (no prefix), its tokens at positions ``0..n-1``, back to back, with
their token types where given; the pools are the runner's (the batch's fields name them), never
written.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from runtime.engine.forward_batch import ForwardBatch, ForwardMode


def encoder_batch(
    runner: Any,
    prompts: Sequence[Sequence[int]],
    token_types: Sequence[Sequence[int] | None] | None = None,
) -> ForwardBatch:
    """One forward over ``prompts`` (token ids) of ``runner`` (a ``ModelRunner``, or anything with its
    ``device`` and pools); ``token_types``: each prompt's token types (None, or a None entry: zeros;
    all None: the batch's ``token_type_ids`` is None)."""
    device = runner.device
    lens = [len(p) for p in prompts]

    def t(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64, device=device)

    types = None
    if token_types is not None and any(tt is not None for tt in token_types):
        types = t([v for p, tt in zip(prompts, token_types) for v in (tt if tt is not None else [0] * len(p))])
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=t([i for p in prompts for i in p]),
        positions=t([i for n in lens for i in range(n)]),
        req_pool_indices=t(range(len(prompts))),
        seq_lens=t(lens),
        prefix_lens=t([0] * len(prompts)),
        extend_lens=t(lens),
        out_cache_loc=t([0] * sum(lens)),  # (the padding slot: an encoder writes no KV)
        req_to_token_pool=getattr(runner, "req_to_token_pool", None),  # type: ignore[arg-type]
        token_to_kv_pool=getattr(runner, "token_to_kv_pool", None),  # type: ignore[arg-type]
        seq_lens_cpu=lens,
        prefix_lens_cpu=[0] * len(prompts),
        extend_lens_cpu=lens,
        token_type_ids=types,
    )


def request_rows(prompts: Sequence[Sequence[int]]) -> list[range]:
    """Each prompt's rows of the packed token axis."""
    rows, start = [], 0
    for p in prompts:
        rows.append(range(start, start + len(p)))
        start += len(p)
    return rows
