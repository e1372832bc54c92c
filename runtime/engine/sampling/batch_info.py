"""Per-step sampling tensors of a batch: ``SamplingParams`` + token histories -> device tensors.

Why a module of its own: building these tensors is host-side preparation, done once per step
by whoever assembles the batch (the scheduler's batch builder, the test harness), while
``runtime.engine.sampling.sampler`` only reads them on the logits' device. ``SamplingBatchInfo``
turns the batch's parameters and histories into device tensors in one vectorised pass, plus
host flags that let the sampler skip whole stages nobody in the batch needs (all greedy -> one
argmax; no penalties -> no history tensors; top_k -> one ``topk`` of the batch's largest k;
only rows with top_p < 1 pay for a vocabulary sort).

Reproducibility starts here: ``seed_for_step`` gives a seeded request the generator seed
``mix(seed, step)`` of its step (``step = len(output_ids)``), which the sampler's noise is
drawn from; see ``runtime.engine.sampling.sampler``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from runtime.engine.sampling import penalties as pen
from runtime.engine.sampling.logit_bias import LogitBias
from runtime.engine.sampling.token_ids_logprob import TokenIdsIndex
from runtime.protocol.sampling_params import SamplingParams

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
    # SGLang's token_ids_logprob: the ids each row reports the logprob of (None: no row asks).
    token_ids_logprob: TokenIdsIndex | None = None
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
        token_ids_logprob: Sequence[Sequence[int] | None] | None = None,
    ) -> "SamplingBatchInfo":
        """Build the batch's tensors; vectorised, so cheap for hundreds of requests.

        ``output_ids[i]`` are the tokens request i has generated so far (its step is their
        count). ``eos_token_ids`` are the model's EOS ids; they are suppressed (with the
        request's ``stop_token_ids``) while ``len(output_ids[i]) < min_new_tokens``, except
        that EOS is left alone for ``ignore_eos`` requests, which EOS cannot stop anyway.
        ``vocab_mask`` is the host bitmask of the constrained rows ``vocab_mask_rows``.
        ``token_ids_logprob[i]`` are the ids whose logprob row i reports (None: none).
        """
        bs = len(params)
        if len(prompt_ids) != bs or len(output_ids) != bs:
            raise ValueError(f"batch mismatch: {bs} params, {len(prompt_ids)} prompts, {len(output_ids)} outputs")
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
        if token_ids_logprob is not None:
            if len(token_ids_logprob) != bs:
                raise ValueError(f"batch mismatch: {bs} params, {len(token_ids_logprob)} token_ids_logprob rows")
            info.token_ids_logprob = TokenIdsIndex.build(token_ids_logprob, device)
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
            self.rep_penalties = torch.tensor([[params[i].repetition_penalty] for i in rep], dtype=torch.float32).to(
                self.device
            )
        fp = [i for i in range(bs) if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
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
