"""A batch's ``logit_bias`` (OpenAI's) as sparse device tensors, added to the logits in one call.

Requests bias few tokens (at most ``MAX_LOGIT_BIAS_ENTRIES`` each) of a large vocabulary, so the
batch keeps (row, token id, bias) triples rather than a dense ``[bs, vocab]`` tensor: building it
is one host tensor and one transfer per step, applying it one ``index_put_`` on the sampler's
private logits copy. A batch where no request has a bias builds nothing (``build`` returns None),
so the sampler's fast paths stay as they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from runtime.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitBias:
    """The biased entries of one batch, on the logits' device; entry j adds ``values[j]`` to
    logit ``[rows[j], token_ids[j]]``."""

    rows: torch.Tensor  # [n] int64: the entry's row in the batch
    token_ids: torch.Tensor  # [n] int64, each in [0, vocab_size)
    values: torch.Tensor  # [n] float32

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> "LogitBias | None":
        """The entries of every request with a ``logit_bias`` (row i = ``params[i]``); None when none has one.

        The ids come parsed from ``SamplingParams.logit_bias_entries`` (cached per request). Ids outside
        ``[0, vocab_size)`` (possible only for params that skipped ``validate(vocab_size)``) are dropped
        here, on the host: an out-of-range index would make ``index_put_`` fail, or assert on a GPU.
        """
        rows: list[int] = []
        ids: list[int] = []
        values: list[float] = []
        for i, p in enumerate(params):
            if not p.logit_bias:
                continue
            tids, biases = p.logit_bias_entries
            rows.extend([i] * len(tids))
            ids.extend(tids)
            values.extend(biases)
        if not rows:
            return None
        # One host tensor, one transfer: float64 holds every token id (< 2**53) exactly.
        host = torch.tensor([rows, ids, values], dtype=torch.float64)
        in_vocab = (host[1] >= 0) & (host[1] < vocab_size)
        if not bool(in_vocab.all()):
            host = host[:, in_vocab]
            if host.shape[1] == 0:
                return None
        dev = host.to(device)
        return cls(rows=dev[0].to(torch.int64), token_ids=dev[1].to(torch.int64), values=dev[2].to(torch.float32))

    def apply_(self, logits: torch.Tensor) -> None:
        """Add the biases to fp32 ``logits`` [bs, vocab] in place (a banned token, -inf, stays -inf)."""
        logits.index_put_((self.rows, self.token_ids), self.values, accumulate=True)
