"""Batched sampling: logits [bs, vocab] -> next token ids (+ logprobs).

Why a module of its own: this is the per-step math on the logits' device, reading the batch's
prepared ``runtime.engine.sampling.batch_info.SamplingBatchInfo`` (built once per step, on the
host side, by whoever assembles the batch) and never building tensors of its own beyond the
noise.

``Sampler`` applies, in order: the grammar bitmask of constrained rows (tokens their
grammar does not allow next get -inf), the requests' ``logit_bias`` (``runtime.engine.sampling.logit_bias``:
after the mask, so a banned token stays banned), penalties, min_new_tokens suppression of EOS and stop
token ids (not where a grammar allows nothing else), then argmax for greedy rows and, for
the others, temperature, softmax, top_k, top_p, min_p and an exponential race
``argmax(probs / q)``, ``q ~ Exp(1)``, which draws from ``probs`` (unnormalised is fine)
without a cumsum/search pass.

Reproducibility: a seeded request's noise comes from a generator seeded with
``mix(seed, step)`` where ``step = len(output_ids)`` (``batch_info.seed_for_step``), and it is
drawn over the vocabulary in vocabulary order. Its token therefore depends only on its own
logits, parameters, seed and step, never on which other requests share the batch or at which
row it sits. Unseeded rows share one draw from the sampler's generator (the device's global
torch RNG, which ``--random-seed`` seeds, unless one is passed to ``Sampler``).

Everything is batched on the logits' device; the only per-row Python work is seeding
the generators of seeded rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from runtime.engine.ops import DeviceOps, get_ops
from runtime.engine.sampling import penalties as pen
from runtime.engine.sampling.batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)


@dataclass
class SamplerOutput:
    """What the sampler returns for one step.

    ``logprobs``, ``top_logprobs`` and ``token_ids_logprobs`` are ``log_softmax`` of the ORIGINAL
    logits (before the grammar mask, logit bias, penalties, min_new_tokens masking and temperature),
    which is what transformers' ``log_softmax(model(...).logits)`` gives and what SGLang reports by default.
    """

    next_token_ids: torch.Tensor  # int64 [bs]
    logprobs: torch.Tensor | None = None  # float32 [bs]: logprob of the chosen token
    # (values float32 [bs, k], ids int64 [bs, k]), values sorted descending.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None
    # float32 [bs, width]: each row's logprobs at ``info.token_ids_logprob``'s ids (its request's
    # ids first, in their order; the rest is padding), or None when no row asks.
    token_ids_logprobs: torch.Tensor | None = None


class Sampler:
    """Callable batched sampler; see the module docstring for the order of operations."""

    def __init__(self, generator: torch.Generator | None = None, ops: DeviceOps | None = None) -> None:
        # Unseeded rows draw from ``generator`` (None -> the device's default torch RNG).
        self._generator = generator
        # Greedy rows take ``ops.argmax_rows`` (None: the ops of the logits' device, per call).
        self._ops = ops
        # One reusable generator per device for seeded rows; it is re-seeded per row, and
        # a kernel captures its seed/offset at launch, so reuse is safe.
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 argmax of each row of ``[bs, vocab]`` logits (the device ops' ``argmax_rows``)."""
        ops = self._ops or get_ops(logits.device, logits.dtype)
        return ops.argmax_rows(logits)

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SamplerOutput:
        bs, vocab = logits.shape[0], info.vocab_size
        if logits.dim() != 2 or logits.shape[1] < vocab or bs != info.batch_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match batch {info.batch_size} x vocab {vocab}")
        # Columns past vocab_size are LM-head padding (vocab-parallel): never sampled.
        if (
            info.all_greedy
            and not info.need_penalties
            and info.min_tokens_mask is None
            and info.vocab_mask is None
            and info.logit_bias is None
            and not return_logprob
            and top_logprobs_num <= 0
            and info.token_ids_logprob is None
        ):
            # Nothing to adjust: the argmax reads the caller's logits as they are (no copy).
            return SamplerOutput(next_token_ids=self.greedy_argmax(logits[:, :vocab]))
        # A private fp32 copy: the caller's logits buffer is never modified.
        x = logits[:, :vocab].to(torch.float32, copy=True)
        raw_logprobs = None
        if return_logprob or top_logprobs_num > 0 or info.token_ids_logprob is not None:
            raw_logprobs = torch.log_softmax(x, dim=-1)

        x = self._adjust_logits(x, info)

        if info.all_greedy:
            next_ids = self.greedy_argmax(x)
        else:
            next_ids = self._sample(x, info)
            if info.any_greedy:
                next_ids = torch.where(info.is_greedy, self.greedy_argmax(x), next_ids)

        out = SamplerOutput(next_token_ids=next_ids.to(torch.int64))
        if raw_logprobs is not None:
            if return_logprob:
                out.logprobs = raw_logprobs.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
            k = min(top_logprobs_num, vocab)
            if k > 0:
                values, ids = raw_logprobs.topk(k, dim=-1, largest=True, sorted=True)
                out.top_logprobs = (values, ids)
            if info.token_ids_logprob is not None:
                out.token_ids_logprobs = info.token_ids_logprob.gather(raw_logprobs)
        return out

    def penalized_logits(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """fp32 [bs, vocab]: the logits greedy rows take the argmax of (grammar mask, logit bias,
        penalties and min_new_tokens masking applied, no temperature). For tests and debugging."""
        return self._adjust_logits(logits[:, : info.vocab_size].to(torch.float32, copy=True), info)

    # ---- stages -------------------------------------------------------------------

    def _adjust_logits(self, x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Grammar bitmask, logit bias, penalties, then min_new_tokens suppression; ``x`` is the
        sampler's private copy.

        The bias comes after the mask (-inf + 100 is still -inf: a bias cannot reopen a token the
        grammar forbids) and before penalties, so a penalty acts on the biased logit.
        """
        if info.vocab_mask is not None:
            ops = self._ops or get_ops(x.device, x.dtype)
            ops.apply_token_bitmask(x, info.vocab_mask, info.vocab_mask_rows)
        if info.logit_bias is not None:
            info.logit_bias.apply_(x)
        x = self._apply_penalties(x, info)
        if info.min_tokens_mask is not None:
            suppress = info.min_tokens_mask
            if info.vocab_mask is not None:
                # A grammar that allows nothing but stop tokens has a complete output: min_new_tokens
                # cannot hold it open (the row would be left with no token at all, and sample one
                # outside the grammar). Suppress stop tokens only where another token remains.
                suppress = suppress & (torch.isfinite(x) & ~suppress).any(dim=1, keepdim=True)
            x.masked_fill_(suppress, float("-inf"))
        return x

    @staticmethod
    def _apply_penalties(x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if info.rep_seen is not None:
            assert info.rep_penalties is not None
            if info.rep_rows is None:
                x = pen.apply_repetition_penalty(x, info.rep_seen, info.rep_penalties)
            else:
                sub = pen.apply_repetition_penalty(x.index_select(0, info.rep_rows), info.rep_seen, info.rep_penalties)
                x.index_copy_(0, info.rep_rows, sub)
        if info.fp_counts is not None:
            assert info.frequency_penalties is not None and info.presence_penalties is not None
            rows = info.fp_rows
            sub = x if rows is None else x.index_select(0, rows)
            sub = pen.apply_frequency_presence_penalties(
                sub, info.fp_counts, info.frequency_penalties, info.presence_penalties
            )
            if rows is None:
                x = sub
            else:
                x.index_copy_(0, rows, sub)
        return x

    def _sample(self, x: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Sampled token of every row (greedy rows' results are discarded by the caller)."""
        probs = torch.softmax(x / info.temperatures, dim=-1)
        if info.need_top_k:
            probs = self._top_k_filter(probs, info)
        if info.need_top_p:
            rows = info.top_p_rows
            if rows is None:
                probs = self._top_p_filter(probs, info.top_ps.unsqueeze(1))
            else:
                sub = self._top_p_filter(probs.index_select(0, rows), info.top_ps[rows].unsqueeze(1))
                probs = probs.index_copy(0, rows, sub)
        if info.need_min_p:
            threshold = probs.max(dim=-1, keepdim=True).values * info.min_ps.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = self._exponential_noise(probs.shape, info)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _top_k_filter(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Zero every prob below the row's k-th largest (ties with it stay, as in HF).

        A threshold rather than a positional cut, so a row's kept set depends only on its
        own probabilities, and one ``topk`` of the batch's largest k (no sort) serves all.
        """
        kmax = info.max_top_k
        top = probs.topk(kmax, dim=-1, largest=True, sorted=True).values  # [bs, kmax]
        ks = info.top_ks.unsqueeze(1)
        threshold = top.gather(1, ks.clamp(max=kmax) - 1)
        threshold = threshold.masked_fill(ks > kmax, 0.0)  # top_k off on this row
        return probs.masked_fill(probs < threshold, 0.0)

    @staticmethod
    def _top_p_filter(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
        """Nucleus filter of rows with ``top_ps`` [n, 1] < 1, over the (top_k-filtered) mass.

        HF order and rule: top_p applies to the distribution renormalised after top_k, and
        a token stays while the mass strictly before it is < top_p (the first always stays).
        The stable sort keeps ties in vocabulary order, so the result is a function of the
        row alone.
        """
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        kept_mass = sorted_probs.sum(dim=-1, keepdim=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= top_ps * kept_mass
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        return probs.masked_fill(drop, 0.0)

    def _exponential_noise(self, shape: torch.Size, info: SamplingBatchInfo) -> torch.Tensor:
        """Exp(1) noise [bs, vocab]: one shared draw, then each seeded row redrawn from its seed."""
        bs, vocab = shape
        device = info.device
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        if len(info.seeded_rows) < bs:
            noise.exponential_(generator=self._generator)
        if info.seeded_rows:
            gen = self._seeded_generators.get(device)
            if gen is None:
                gen = torch.Generator(device=device)
                self._seeded_generators[device] = gen
            for row, seed in info.seeded_rows:
                gen.manual_seed(seed)
                noise[row].exponential_(generator=gen)
        # Exp(1) can round to 0; a zero would turn 0/0 into NaN and win the argmax.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)
