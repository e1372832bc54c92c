"""Token-history penalties and the tensors they need.

Separate from the sampler because the penalties are pure logit transforms with exact
formulas that tests check by hand, and because building their inputs (token counts over
histories of thousands of tokens for hundreds of requests) is the expensive part of
preparing a batch: it is done here with a single flattened scatter per batch instead of
a Python loop per token.

Formulas (applied in this order, only to the rows that asked for them):
- repetition (HF ``RepetitionPenaltyLogitsProcessor``), over prompt + output tokens:
  ``logit > 0 -> logit / p``, else ``logit * p``.
- frequency (OpenAI), over output tokens: ``logit -= f * count``.
- presence (OpenAI), over output tokens: ``logit -= p * (count > 0)``.
"""

from __future__ import annotations

from itertools import chain
from typing import Sequence

import numpy as np
import torch


def flatten_token_lists(token_lists: Sequence[Sequence[int]], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, token) pairs of every in-vocabulary token, as two int64 host arrays.

    Out-of-range ids are dropped rather than trusted: an index past the vocabulary would be
    a device-side assert on CUDA, which kills the whole process.
    """
    lens = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    total = int(lens.sum()) if len(lens) else 0
    tokens = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total)
    rows = np.repeat(np.arange(len(token_lists), dtype=np.int64), lens)
    ok = (tokens >= 0) & (tokens < vocab_size)
    if not ok.all():
        tokens, rows = tokens[ok], rows[ok]
    return rows, tokens


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [len(token_lists), vocab_size]: how often each token occurs in each list.

    One ``index_add_`` over the flattened (row * vocab + token) index. Counts are small
    integers, exact in fp32, so the atomics' summation order does not matter.
    """
    rows, tokens = flatten_token_lists(token_lists, vocab_size)
    n = len(token_lists)
    counts = torch.zeros(n * vocab_size, dtype=torch.float32, device=device)
    if len(tokens):
        flat = torch.from_numpy(rows * vocab_size + tokens).to(device, non_blocking=True)
        counts.index_add_(0, flat, torch.ones(flat.shape[0], dtype=torch.float32, device=device))
    return counts.view(n, vocab_size)


def token_presence(
    token_lists: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
    more_token_lists: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """bool [len(token_lists), vocab_size]: whether each token occurs in row i's list(s).

    ``more_token_lists`` (same length) adds a second history per row, so prompt and output
    ids need not be concatenated into new Python lists first.
    """
    rows, tokens = flatten_token_lists(token_lists, vocab_size)
    n = len(token_lists)
    if more_token_lists is not None:
        assert len(more_token_lists) == n, "one extra token list per row"
        rows2, tokens2 = flatten_token_lists(more_token_lists, vocab_size)
        rows, tokens = np.concatenate([rows, rows2]), np.concatenate([tokens, tokens2])
    seen = torch.zeros(n * vocab_size, dtype=torch.bool, device=device)
    if len(tokens):
        flat = torch.from_numpy(rows * vocab_size + tokens).to(device, non_blocking=True)
        seen[flat] = True
    return seen.view(n, vocab_size)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """HF repetition penalty on ``logits`` [n, V] fp32; ``penalties`` [n, 1]; returns a new tensor."""
    scale = torch.where(seen, penalties, torch.ones_like(penalties))
    return torch.where(logits > 0, logits / scale, logits * scale)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """OpenAI frequency/presence penalties on ``logits`` [n, V]; ``frequency``/``presence`` [n, 1]."""
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
