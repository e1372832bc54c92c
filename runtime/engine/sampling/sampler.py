"""Batched sampling: logits [bs, vocab] -> next token ids (+ logprobs).

Two pieces:
- ``SamplingBatchInfo`` turns the batch's ``SamplingParams`` and token histories into
  device tensors once per step, plus host flags that let the sampler skip whole stages
  nobody in the batch needs (all greedy -> one argmax; no penalties -> no history
  tensors; top_k -> one ``topk`` of the batch's largest k; only rows with top_p < 1 pay
  for a vocabulary sort).
- ``Sampler`` applies, in order: the grammar bitmask of constrained rows (tokens their
  grammar does not allow next get -inf), the requests' ``logit_bias`` (``runtime.engine.sampling.logit_bias``:
  after the mask, so a banned token stays banned), penalties, min_new_tokens suppression of EOS and stop
  token ids (not where a grammar allows nothing else), then argmax for greedy rows and, for
  the others, temperature, softmax, top_k, top_p, min_p and an exponential race
  ``argmax(probs / q)``, ``q ~ Exp(1)``, which draws from ``probs`` (unnormalised is fine)
  without a cumsum/search pass.

Reproducibility: a seeded request's noise comes from a generator seeded with
``mix(seed, step)`` where ``step = len(output_ids)``, and it is drawn over the vocabulary
in vocabulary order. Its token therefore depends only on its own logits, parameters,
seed and step, never on which other requests share the batch or at which row it sits.
Unseeded rows share one draw from the sampler's generator (the device's global torch RNG,
which ``--random-seed`` seeds, unless one is passed to ``Sampler``).

Everything is batched on the logits' device; the only per-row Python work is seeding
the generators of seeded rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from runtime.engine.sampling import penalties as pen
from runtime.engine.sampling.logit_bias import LogitBias
from runtime.engine.ops import DeviceOps, get_ops
from runtime.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def seed_for_step(seed: int, step: int) -> int:
    """Well-mixed 63-bit generator seed for (request seed, decode step) (splitmix64 finaliser).

    Consecutive steps (and nearby user seeds) must not give correlated streams, so the
    pair is hashed rather than added.
    """
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + (step + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & ((1 << 63) - 1)


@dataclass
class SamplingBatchInfo:
    """Per-step sampling state of a batch, on the device. Owned by the model runner for one step.

    Row i of every [bs, ...] tensor is request i of the batch, in the order given to
    ``from_requests`` (the same order as the logits' rows).
    """

    vocab_size: int
    device: torch.device
    # [bs, 1] float32; 1.0 on greedy rows so the division is harmless there.
    temperatures: torch.Tensor
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64, vocab_size where top_k is off
    min_ps: torch.Tensor  # [bs] float32
    is_greedy: torch.Tensor  # [bs] bool
    # Host flags: skip stages nobody in the batch needs.
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    # Largest active top_k of a sampled row (0 when none): one topk of this width serves all.
    max_top_k: int
    need_min_p: bool
    # (row, generator seed for this step) of every seeded, non-greedy row.
    seeded_rows: list[tuple[int, int]]
    # Largest ``top_logprobs_num`` in the batch: the k the runner asks the sampler for
    # (each request keeps its own first ``top_logprobs_num`` columns).
    top_logprobs_num: int = 0
    # Rows with top_p < 1 (the only ones that pay for a vocabulary sort): None = every row.
    top_p_rows: torch.Tensor | None = None  # [n_p] int64
    # Repetition penalty (rows with p != 1): rows None = every row of the batch.
    rep_rows: torch.Tensor | None = None  # [n_rep] int64
    rep_seen: torch.Tensor | None = None  # [n_rep, vocab] bool: token in prompt + output
    rep_penalties: torch.Tensor | None = None  # [n_rep, 1] float32
    # Frequency / presence penalties (rows with f != 0 or p != 0): rows None = every row.
    fp_rows: torch.Tensor | None = None  # [n_fp] int64
    fp_counts: torch.Tensor | None = None  # [n_fp, vocab] float32: counts over output tokens
    frequency_penalties: torch.Tensor | None = None  # [n_fp, 1] float32
    presence_penalties: torch.Tensor | None = None  # [n_fp, 1] float32
    # True where a token must not be sampled yet (EOS / stop ids before min_new_tokens).
    min_tokens_mask: torch.Tensor | None = None  # [bs, vocab] bool
    # Constrained decoding: int32 [bs, ceil(vocab / 32)] token bitmask (bit set = allowed), read
    # on ``vocab_mask_rows`` only (None: every row); None when no row of the batch is constrained.
    vocab_mask: torch.Tensor | None = None
    vocab_mask_rows: list[int] | None = None
    # Sparse (row, token, bias) entries of the rows with a logit_bias; None when no row has one.
    logit_bias: LogitBias | None = None

    @property
    def batch_size(self) -> int:
        return int(self.top_ps.shape[0])

    @property
    def need_penalties(self) -> bool:
        return self.rep_seen is not None or self.fp_counts is not None

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        eos_token_ids: Iterable[int] | None,
        device: torch.device | str,
        vocab_mask: torch.Tensor | None = None,
        vocab_mask_rows: list[int] | None = None,
    ) -> "SamplingBatchInfo":
        """Build the batch's tensors; vectorised, so cheap for hundreds of requests.

        ``output_ids[i]`` are the tokens request i has generated so far (its step is their
        count). ``eos_token_ids`` are the model's EOS ids; they are suppressed (with the
        request's ``stop_token_ids``) while ``len(output_ids[i]) < min_new_tokens``, except
        that EOS is left alone for ``ignore_eos`` requests, which EOS cannot stop anyway.
        ``vocab_mask`` is the host bitmask of the constrained rows ``vocab_mask_rows``.
        """
        bs = len(params)
        if len(prompt_ids) != bs or len(output_ids) != bs:
            raise ValueError(
                f"batch mismatch: {bs} params, {len(prompt_ids)} prompts, {len(output_ids)} outputs"
            )
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        # One host tensor, one transfer: temperature, top_p, min_p, top_k, greedy flag.
        host = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params],
                [1.0 if g else 0.0 for g in greedy],
            ],
            dtype=torch.float64,
        ).reshape(5, bs)
        dev = host.to(device)
        sampled = [i for i in range(bs) if not greedy[i]]
        seeded_rows = [
            (i, seed_for_step(params[i].seed, len(output_ids[i])))  # type: ignore[arg-type]
            for i in sampled
            if params[i].seed is not None
        ]
        top_k_rows = [i for i in sampled if 0 < params[i].top_k < vocab_size]
        top_p_rows = [i for i in sampled if params[i].top_p < 1.0]
        info = cls(
            vocab_size=vocab_size,
            device=device,
            temperatures=dev[0].to(torch.float32).unsqueeze(1),
            top_ps=dev[1].to(torch.float32),
            top_ks=dev[3].to(torch.int64),
            min_ps=dev[2].to(torch.float32),
            is_greedy=dev[4] > 0.5,
            all_greedy=len(sampled) == 0,
            any_greedy=len(sampled) < bs,
            need_top_k=bool(top_k_rows),
            need_top_p=bool(top_p_rows),
            max_top_k=max((params[i].top_k for i in top_k_rows), default=0),
            need_min_p=any(params[i].min_p > 0.0 for i in sampled),
            seeded_rows=seeded_rows,
            top_logprobs_num=max((p.top_logprobs_num for p in params), default=0),
            vocab_mask=None if vocab_mask is None else vocab_mask.to(device, non_blocking=True),
            vocab_mask_rows=None if vocab_mask_rows is not None and len(vocab_mask_rows) == bs else vocab_mask_rows,
        )
        if top_p_rows:
            info.top_p_rows = info._rows_tensor(top_p_rows, bs)
        info._build_penalties(params, prompt_ids, output_ids)
        info._build_min_tokens_mask(params, output_ids, eos_token_ids)
        info.logit_bias = LogitBias.build(params, vocab_size, device)
        return info

    # ---- builders -----------------------------------------------------------------

    def _rows_tensor(self, rows: list[int], bs: int) -> torch.Tensor | None:
        """Row index tensor, or None when the rows are the whole batch (skip the gather)."""
        if len(rows) == bs:
            return None
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def _build_penalties(
        self,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
    ) -> None:
        bs, vocab = len(params), self.vocab_size
        rep = [i for i in range(bs) if params[i].repetition_penalty != 1.0]
        if rep:
            self.rep_rows = self._rows_tensor(rep, bs)
            self.rep_seen = pen.token_presence(
                [prompt_ids[i] for i in rep], vocab, self.device, [output_ids[i] for i in rep]
            )
            self.rep_penalties = torch.tensor(
                [[params[i].repetition_penalty] for i in rep], dtype=torch.float32
            ).to(self.device)
        fp = [
            i
            for i in range(bs)
            if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0
        ]
        if fp:
            self.fp_rows = self._rows_tensor(fp, bs)
            self.fp_counts = pen.token_counts([output_ids[i] for i in fp], vocab, self.device)
            both = torch.tensor(
                [[params[i].frequency_penalty, params[i].presence_penalty] for i in fp],
                dtype=torch.float32,
            ).to(self.device)
            self.frequency_penalties = both[:, 0:1]
            self.presence_penalties = both[:, 1:2]

    def _build_min_tokens_mask(
        self,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        eos_token_ids: Iterable[int] | None,
    ) -> None:
        eos = sorted(set(eos_token_ids or ()))
        rows: list[int] = []
        cols: list[int] = []
        for i, p in enumerate(params):
            if len(output_ids[i]) >= p.min_new_tokens:
                continue
            banned = list(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned.extend(eos)
            for t in banned:
                if 0 <= t < self.vocab_size:
                    rows.append(i)
                    cols.append(t)
        if not rows:
            return
        mask = torch.zeros(len(params), self.vocab_size, dtype=torch.bool, device=self.device)
        idx = torch.tensor([rows, cols], dtype=torch.int64).to(self.device)
        mask[idx[0], idx[1]] = True
        self.min_tokens_mask = mask


@dataclass
class SamplerOutput:
    """What the sampler returns for one step.

    ``logprobs`` and ``top_logprobs`` are ``log_softmax`` of the ORIGINAL logits (before the
    grammar mask, logit bias, penalties, min_new_tokens masking and temperature), which is what transformers'
    ``log_softmax(model(...).logits)`` gives and what SGLang reports by default.
    """

    next_token_ids: torch.Tensor  # int64 [bs]
    logprobs: torch.Tensor | None = None  # float32 [bs]: logprob of the chosen token
    # (values float32 [bs, k], ids int64 [bs, k]), values sorted descending.
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


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
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match batch {info.batch_size} x vocab {vocab}"
            )
        # Columns past vocab_size are LM-head padding (vocab-parallel): never sampled.
        if (info.all_greedy and not info.need_penalties and info.min_tokens_mask is None
                and info.vocab_mask is None and info.logit_bias is None
                and not return_logprob and top_logprobs_num <= 0):
            # Nothing to adjust: the argmax reads the caller's logits as they are (no copy).
            return SamplerOutput(next_token_ids=self.greedy_argmax(logits[:, :vocab]))
        # A private fp32 copy: the caller's logits buffer is never modified.
        x = logits[:, :vocab].to(torch.float32, copy=True)
        raw_logprobs = None
        if return_logprob or top_logprobs_num > 0:
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
                sub = pen.apply_repetition_penalty(
                    x.index_select(0, info.rep_rows), info.rep_seen, info.rep_penalties
                )
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
