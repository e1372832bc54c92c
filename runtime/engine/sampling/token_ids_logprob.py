"""SGLang's ``token_ids_logprob``: the logprobs of ids a request names, at each of its logit rows.

Why a module of its own: the same gather serves the sampled rows (``SamplingBatchInfo``, one row
per request, or per verify token) and the prompt rows of a prefill (``InputLogprobRows``), and both
want it as one batched ``gather`` of the rows' log_softmax rather than a Python loop per request.
``TokenIdsIndex`` is built once per batch on the host side: every row's ids, padded to the batch's
longest list, in one device tensor. Row i's first ``len(ids)`` columns are its own, in its order (the
reader pairs them with its request's ids); the padding, and the whole row of a request that named
none, reads column 0 and is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class TokenIdsIndex:
    """A batch's ``token_ids_logprob`` as one gather index over its logit rows."""

    ids: torch.Tensor  # int64 [rows, width] on the logits' device: row i's ids, then 0s

    @classmethod
    def build(
        cls,
        per_row: Sequence[Sequence[int] | None],
        device: torch.device | str,
        repeats: Sequence[int] | None = None,
    ) -> "TokenIdsIndex | None":
        """The index of ``per_row`` (row i's ids, or None / empty when it asks for none), each row
        ``repeats[i]`` times in a row when given (a prefill's prompt rows: a request's ids once on the
        host, however many rows it has); None when no row asks, so a batch without the field does no
        work at all."""
        counts = [len(ids) if ids else 0 for ids in per_row]
        width = max(counts, default=0)
        if width == 0 or (repeats is not None and not any(n and r for n, r in zip(counts, repeats))):
            return None
        flat = [t for ids, n in zip(per_row, counts) for t in [*(ids or ()), *([0] * (width - n))]]
        table = torch.tensor(flat, dtype=torch.int64).view(len(counts), width).to(device, non_blocking=True)
        if repeats is None:
            return cls(ids=table)
        times = torch.tensor(list(repeats), dtype=torch.int64).to(device, non_blocking=True)
        return cls(ids=table.repeat_interleave(times, dim=0, output_size=sum(repeats)))

    def gather(self, logprobs: torch.Tensor, start: int = 0) -> torch.Tensor:
        """float32 ``[n, width]``: the logprobs of rows ``start .. start + n`` at their ids, where
        ``logprobs`` ``[n, vocab]`` are those rows' log_softmax."""
        return logprobs.gather(1, self.ids[start : start + logprobs.shape[0]])
